//! Fragment tiles for the grouped MoE products: [`super::mma_moe`]'s order with the weights kept packed
//! until they reach the instruction's registers, and the scale groups applied in registers.
//!
//! **Why.** The tensor-core tiles of [`super::mma_moe`] stage every weight code in shared memory as a
//! decoded half value (one 2-byte store per code, four times the packed bytes) and take each scale group's
//! sums back through shared memory to scale them, for one or two `m16n16k16` instructions per plane
//! between two barriers: on an H200 (run 4 of `experiments/results/gpu_h200`) that work around the
//! instruction, not the instruction or the bytes, set their time. Here a cube stages a chunk of up to
//! eight K steps of *packed words* (4 or 8 codes per 4-byte store), and each unit decodes the codes its
//! own fragment registers hold (the `mma.m16n8k16` register layout of NVIDIA's PTX ISA, CubeCL's manual
//! MMA) right before the instruction; the accumulators stay in registers, where the unit scales and adds
//! them.
//!
//! **Order.** The same as [`super::mma_moe`]'s: per assignment and output row, K steps of 16 inputs,
//! scale groups of `steps_per_scale` steps; per group an f32 accumulator starts at 0 and takes the group's
//! steps in order on tensor cores (each step one instruction over 16 inputs), then `total += sum * scale`,
//! groups left to right; gate and up end in `silu(gate) * up` ([`super::moe::silu_times`]), in f32. An
//! `m16n16k16` instruction is two `m16n8k16` ones on NVIDIA parts, so the two kernels are expected to give
//! the same bits (`qarl bench kernels --check` counts the values that differ on the device); within this
//! kernel, an assignment's row never mixes with the others and rows past the tile are zeros, so a decode
//! step computes a prefill's bits.
//!
//! **Tile.** A cube of 4 planes computes the tile's 16 assignments x 64 output rows per projection; plane
//! `p` holds rows `16 p .. 16 p + 16` as two blocks of 8 (the instruction's `n`), one accumulator
//! fragment per block and projection. Per chunk the cube stages the 16 assignments' inputs (as pairs of
//! operand values, rounded to `X` as in [`super::mma_moe`]) and 64 rows of packed words per projection,
//! loaded a chunk ahead into registers; row strides are padded by 4 words so that a plane's fragment reads
//! fall in distinct banks.
//!
//! [`grouped_fragments`] without `tensor_cores` is the same staging, fragments and scale groups with the
//! instruction emulated from the units' fragment registers (exchanged through shared memory, each output
//! summed with scalar FMAs in K order from the accumulator): [`super::mma_moe::grouped_tiles`]' scalar
//! twin's bits, which `cube_kernels/tests/kernels.rs` checks bitwise on lavapipe, leaving only the
//! instruction to the GPU check.

mod fragment;
mod staging;

use cubecl::prelude::*;

use super::mma::{next_chunk, MMA, MMA_PLANE, SHARED_ALIGN};
use super::moe::silu_times;
use fragment::{a_fragment, add_scaled_fragment, block_step, zero_fragment};
use staging::{fetch_chunk, pairs_per_unit, store_chunk, w_stride, words_per_unit, x_stride};
pub use staging::{fragment_chunk_steps, grouped_fragments_shared_bytes};

/// Output rows of one instruction (`n` of `m16n8k16`).
const N8: usize = 8;
/// Planes of a cube.
pub const FRAG_PLANES: usize = 4;
/// Blocks of [`N8`] rows per plane.
const BLOCKS: usize = 2;
/// Output rows a cube covers per projection: 64.
pub const FRAG_ROWS: usize = FRAG_PLANES * BLOCKS * N8;
/// Units of a cube.
const UNITS: usize = FRAG_PLANES * MMA_PLANE;
/// Fragment registers a unit holds per instruction (4 of A, 2 of B), each two operand values: what the
/// scalar twin's emulation exchanges through shared memory per unit.
const EXCHANGE_REGS: usize = 6;
/// Most K steps a cube stages per pair of barriers (a chunk never crosses a scale group).
pub const FRAG_MAX_CHUNK_STEPS: usize = 8;

/// `y[a, row] = sum_k input[src(a), k] a_e[row, k]` (or `silu(.) * (. b_e)` with `swiglu`) for the
/// assignments of tile `CUBE_POS_Y`, in [`super::mma_moe`]'s order, with [`super::mma_moe::grouped_tiles`]'
/// arguments and `chunk_steps` K steps staged per pair of barriers ([`fragment_chunk_steps`]; the bits do
/// not depend on it). On the instruction with `tensor_cores` (half `X`), else emulated (any runtime and
/// operand type). `y` is f32 for the grouped products. With `dense`, the dense product `y[t, row] =
/// sum_k input[t, k] w[row, k]` of [`super::mma::gemm_tiles`]' order instead: tile `CUBE_POS_Y` is
/// tokens `16 tile .. 16 tile + 16` of `tokens`, one matrix, no table (any buffer), `y` of the
/// activations' type `Y`, rounded once. Launch with `CubeDim (32, 4)` and `CubeCount (ceil(n_out / 64),
/// tiles)` (dense: `ceil(tokens / 16)` tiles).
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_fragments<I: Float, X: Float, Y: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    tokens: usize,
    words_a: &[u32],
    scales_a: &[f32],
    words_b: &[u32],
    scales_b: &[f32],
    lut: &[f32],
    y: &mut [Y],
    n_out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    expert_words: usize,
    expert_scales: usize,
    steps: usize,
    steps_per_scale: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] dense: bool,
    #[comptime] tensor_cores: bool,
    #[comptime] chunk_steps: usize,
    #[define(I, X, Y)] _dtypes: [ElemType; 3],
) {
    let mut xs = Shared::<[Vector<X, Const<2>>]>::new_aligned_slice(
        comptime!(MMA * x_stride(chunk_steps)),
        SHARED_ALIGN,
    );
    let wlen = comptime!(FRAG_ROWS * w_stride(fmt, chunk_steps));
    let mut wa = Shared::<[u32]>::new_aligned_slice(wlen, SHARED_ALIGN);
    let mut wb =
        Shared::<[u32]>::new_aligned_slice(comptime!(if swiglu { wlen } else { 1 }), SHARED_ALIGN);
    let mut exchange = Shared::<[Vector<X, Const<2>>]>::new_aligned_slice(
        comptime!(if tensor_cores {
            1
        } else {
            UNITS * EXCHANGE_REGS
        }),
        SHARED_ALIGN,
    );
    // The tile's expert and assignments (dense: its tokens); an empty or malformed tile runs no group
    // and stores nothing.
    let tile = CUBE_POS_Y as usize;
    let mut expert = 0usize;
    let mut a0 = tile * MMA;
    let mut a_end = tokens.min(a0 + MMA);
    if comptime!(!dense) {
        expert = table[3 * tile] as usize;
        a0 = table[3 * tile + 1] as usize;
        a_end = table[3 * tile + 2] as usize;
    }
    let mut len = 0usize;
    let mut groups = 0usize;
    if a0 < a_end {
        len = a_end - a0;
        groups = steps.div_ceil(steps_per_scale);
    }
    let row0 = CUBE_POS_X as usize * FRAG_ROWS;
    let (woff, soff) = (expert * expert_words, expert * expert_scales);
    let wpu = comptime!(words_per_unit(fmt, chunk_steps));
    let mut held_a = Array::<u32>::new(wpu);
    let mut held_b = Array::<u32>::new(comptime!(if swiglu { wpu } else { 1 }));
    let mut held_x = Array::<I>::new(comptime!(2 * pairs_per_unit(chunk_steps)));
    if groups > 0 {
        fetch_chunk(
            input,
            table,
            rows_at,
            a0,
            len,
            words_a,
            words_b,
            &mut held_a,
            &mut held_b,
            &mut held_x,
            0,
            chunk_steps.min(steps_per_scale).min(steps),
            row0,
            n_out,
            inn,
            wpr,
            woff,
            fmt,
            swiglu,
            gather,
            chunk_steps,
        );
    }
    // Totals: fragment f = block + 2 * projection, 4 outputs each.
    let mut total = Array::<f32>::new(16usize);
    #[unroll]
    for j in 0..16usize {
        total[j] = 0.0f32;
    }
    for g in 0..groups {
        let mut acc_a0 = zero_fragment();
        let mut acc_a1 = zero_fragment();
        let mut acc_b0 = zero_fragment();
        let mut acc_b1 = zero_fragment();
        let first = g * steps_per_scale;
        let last = (first + steps_per_scale).min(steps);
        for c in 0..(last - first).div_ceil(chunk_steps) {
            let s0 = first + c * chunk_steps;
            let chunk_last = (s0 + chunk_steps).min(last);
            store_chunk::<I, X>(
                &held_a,
                &held_b,
                &held_x,
                &mut xs,
                &mut wa,
                &mut wb,
                s0,
                chunk_last,
                len,
                inn,
                fmt,
                swiglu,
                chunk_steps,
            );
            sync_cube();
            let (n0, n_last) = next_chunk(s0, last, steps, steps_per_scale, chunk_steps);
            fetch_chunk(
                input,
                table,
                rows_at,
                a0,
                len,
                words_a,
                words_b,
                &mut held_a,
                &mut held_b,
                &mut held_x,
                n0,
                (n0 + chunk_steps).min(n_last),
                row0,
                n_out,
                inn,
                wpr,
                woff,
                fmt,
                swiglu,
                gather,
                chunk_steps,
            );
            // Unrolled on the instruction; the emulation's shaders stay small (lavapipe compiles them).
            #[unroll(tensor_cores)]
            for s in 0..chunk_steps {
                if s0 + s < chunk_last {
                    let a = a_fragment::<X>(&xs, s, chunk_steps);
                    block_step::<X>(
                        &a,
                        &wa,
                        lut,
                        &mut acc_a0,
                        &mut exchange,
                        0,
                        s,
                        fmt,
                        chunk_steps,
                        tensor_cores,
                    );
                    block_step::<X>(
                        &a,
                        &wa,
                        lut,
                        &mut acc_a1,
                        &mut exchange,
                        1,
                        s,
                        fmt,
                        chunk_steps,
                        tensor_cores,
                    );
                    if comptime!(swiglu) {
                        block_step::<X>(
                            &a,
                            &wb,
                            lut,
                            &mut acc_b0,
                            &mut exchange,
                            0,
                            s,
                            fmt,
                            chunk_steps,
                            tensor_cores,
                        );
                        block_step::<X>(
                            &a,
                            &wb,
                            lut,
                            &mut acc_b1,
                            &mut exchange,
                            1,
                            s,
                            fmt,
                            chunk_steps,
                            tensor_cores,
                        );
                    }
                }
            }
            sync_cube();
        }
        let k = first * MMA;
        add_scaled_fragment(
            &mut total, &acc_a0, 0, 0, scales_a, soff, row0, k, n_out, spr, fmt, group,
        );
        add_scaled_fragment(
            &mut total, &acc_a1, 1, 1, scales_a, soff, row0, k, n_out, spr, fmt, group,
        );
        if comptime!(swiglu) {
            add_scaled_fragment(
                &mut total, &acc_b0, 2, 0, scales_b, soff, row0, k, n_out, spr, fmt, group,
            );
            add_scaled_fragment(
                &mut total, &acc_b1, 3, 1, scales_b, soff, row0, k, n_out, spr, fmt, group,
            );
        }
    }
    store_fragments(y, &total, a0, a_end, row0, n_out, swiglu);
}

/// Stores the unit's outputs into `y [assignments, n_out]`: the totals, or `silu(a) * b`, rounded once to
/// `Y`.
#[cube]
fn store_fragments<Y: Float>(
    y: &mut [Y],
    total: &Array<f32>,
    a0: usize,
    a_end: usize,
    row0: usize,
    n_out: usize,
    #[comptime] swiglu: bool,
) {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    #[unroll]
    for block in 0..BLOCKS {
        #[unroll]
        for i in 0..4usize {
            let a = a0 + g + 8 * (i / 2);
            let r = row0 + UNIT_POS_Y as usize * (BLOCKS * N8) + block * N8 + 2 * t + i % 2;
            if a < a_end && r < n_out {
                let j = 4 * block + i;
                let mut v = total[j];
                if comptime!(swiglu) {
                    v = silu_times(total[j], total[8 + j]);
                }
                y[a * n_out + r] = Y::cast_from(v);
            }
        }
    }
}
