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
//! groups left to right; gate and up end in `silu(gate) * up`
//! ([`super::moe::silu_times`](fn@super::moe::silu_times)), in f32. An `m16n16k16` instruction is two
//! `m16n8k16` ones on NVIDIA parts, so the two kernels are expected to give the same bits
//! (`qarl bench kernels --check` counts the values that differ on the device); within this kernel, an
//! assignment's row never mixes with the others and rows past the tile are zeros, so a decode step computes a
//! prefill's bits.
//!
//! **Cube.** A cube of 4 planes computes `16 m_tiles` assignments x `32 blocks` output rows per projection
//! (`32 blocks / splits` with split groups; [`FragCube`]): plane `p` holds `blocks` blocks of 8 rows
//! (the instruction's `n`; its plane of rows, `row_plane`, with split groups), and each unit
//! decodes a block's B fragment once per K step for the `m_tiles` tiles of 16 assignments it multiplies
//! (sharing a decoded weight across tiles: fewer decodes per instruction at prefill sizes). Per chunk
//! the cube stages the inputs (as pairs of operand values, rounded to `X` as in [`super::mma_moe`]) and
//! its rows of packed words per projection, loaded a chunk ahead into registers, into one buffer (two
//! barriers per chunk) or two (one); row strides are padded so that a plane's fragment reads fall in
//! distinct banks, and whole chunks skip the end-of-inputs checks. int4 codes with half operands may be
//! decoded two at a time ([`PairDecode`]), and the A fragments read by `ldmatrix`. Where a call's cubes
//! are few (a decode step), the planes may instead form 2 or 4 sets over fewer rows, each set computing
//! every second or fourth scale group, set 0 adding the groups' sums in order (`split`). No choice of
//! the cube changes a bit: every output keeps its order, and only which unit computes it changes, so a
//! launcher may choose the cube per call.
//!
//! [`grouped_fragments`](fn@grouped_fragments) without `tensor_cores` is the same staging, fragments and
//! scale groups with the instruction emulated from the units' fragment registers (exchanged through shared
//! memory, each output summed with scalar FMAs in K order from the accumulator):
//! [`super::mma_moe::grouped_tiles`](fn@super::mma_moe::grouped_tiles)' scalar twin's bits, which
//! `cube_kernels/tests/kernels.rs` checks bitwise on lavapipe, leaving only the instruction to the GPU check.

mod fragment;
mod split;
mod staging;

use cubecl::prelude::*;

use super::mma::{next_chunk, MMA, MMA_PLANE, SHARED_ALIGN};
use super::moe::silu_times;
use fragment::{a_fragments, add_scaled_fragment, block_step, zero_fragments};
use staging::{
    fetch_chunk, held_inputs, staged_inputs_len, staged_words_len, store_chunk, words_per_unit,
    x_stride,
};
pub use staging::{fragment_chunk_steps, grouped_fragments_shared_bytes};

/// Output rows of one instruction (`n` of `m16n8k16`).
const N8: usize = 8;
/// Planes of a cube.
pub const FRAG_PLANES: usize = 4;
/// Units of a cube.
const UNITS: usize = FRAG_PLANES * MMA_PLANE;
/// Fragment registers a unit holds per instruction (4 of A, 2 of B), each two operand values: what the
/// scalar twin's emulation exchanges through shared memory per unit.
const EXCHANGE_REGS: usize = 6;
/// Most K steps a cube stages per pair of barriers (a chunk never crosses a scale group).
pub const FRAG_MAX_CHUNK_STEPS: usize = 8;

/// How codes become the B fragment's operand pairs. Every way gives the same values (the codes are small
/// integers, exact in every operand type).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PairDecode {
    /// Each code by itself, as an f32 integer converted to the operand type
    /// ([`super::word_code_value`](fn@super::word_code_value)).
    Scalar,
    /// Two int4 codes at once into an f16 pair: the codes under the exponent of 1024 (`0x6400`), then
    /// one packed subtraction of 1032 (`1024 + c - 1032 = c - 8`, exact).
    F16,
    /// The same into a bf16 pair: under the exponent of 128 (`0x4300`), minus 136.
    Bf16,
}

impl PairDecode {
    /// The pair decode for `fmt` codes into `operand` operands: packed for int4 (format 0) into f16 or
    /// bf16, else [`PairDecode::Scalar`].
    pub fn for_codes(fmt: u32, operand: crate::dtype::ActDType) -> Self {
        use crate::dtype::ActDType;
        match (fmt, operand) {
            (0, ActDType::F16) => PairDecode::F16,
            (0, ActDType::BF16) => PairDecode::Bf16,
            _ => PairDecode::Scalar,
        }
    }

    /// The bits to XOR over a pair of stored int4 codes (two's complement, at bits 0 and 16): the
    /// exponent of `2^10` (`0x6400`) or `2^7` (`0x4300`) and the sign bit of each code flipped (`0x8`,
    /// [`super::code_flip`]'s offset binary: exponent and code bits are disjoint, so one XOR does both);
    /// and the pair to subtract after (`2^10 + 8` twice: `0x6408`, or `2^7 + 8`: `0x4308`), as half
    /// pairs' bits.
    const fn magic(self) -> (u32, u32) {
        match self {
            PairDecode::Scalar => (0, 0),
            PairDecode::F16 => (0x6408_6408, 0x6408_6408),
            PairDecode::Bf16 => (0x4308_4308, 0x4308_4308),
        }
    }
}

/// The compile-time layout of one cube of [`grouped_fragments`](fn@grouped_fragments): `chunk_steps` K steps
/// staged per pair of barriers ([`fragment_chunk_steps`]), `m_tiles` tiles of 16 assignments (tokens, for the
/// dense product), `blocks` blocks of 8 output rows per plane and projection, the codes' [`PairDecode`], and
/// whether every chunk is whole (`full_chunks`: the inputs a multiple of `16 chunk_steps` and the scale
/// groups of `chunk_steps`, as in every Qwen3 projection; then the staging skips the checks of the inputs'
/// end), and whether the staging has two buffers (`double_buffer`: one barrier per chunk instead of two, for
/// twice the shared memory and a runtime buffer offset); and `splits`: the planes split the scale groups
/// among themselves in `splits` sets (1: every plane takes every group of its own rows; 2 or 4: `4 /
/// splits` planes of rows, set `q` taking groups `q, q + splits, ..`, with the inputs of all `whole_k`
/// inputs staged once, `staged_rows` rows of them: at least the most assignments a tile of the call
/// holds, a power of two up to 16, the instruction's other rows reading those rows again, as their
/// outputs are never stored; `split`); and `ldmatrix`: on the instruction, each tile's A fragment
/// read from shared memory by one `ldmatrix.x4` (the 4 registers of 8 x 8 operand matrices, rows
/// addressed by the plane's lanes) instead of 4 loads of 4 bytes. The bits never depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragCube {
    pub chunk_steps: usize,
    pub m_tiles: usize,
    pub blocks: usize,
    pub decode: PairDecode,
    pub full_chunks: bool,
    pub double_buffer: bool,
    pub splits: usize,
    pub whole_k: usize,
    pub staged_rows: usize,
    pub ldmatrix: bool,
}

impl FragCube {
    /// This layout with its scale groups split among `splits` sets of planes and the inputs of all `inn`
    /// staged whole for tiles of at most `most_rows` assignments (`splits` 1: as it is); the launcher
    /// checks that the chunks and the groups are whole and that the staging fits.
    pub const fn with_split_groups(self, splits: usize, inn: usize, most_rows: usize) -> FragCube {
        if splits == 1 {
            return self;
        }
        let mut staged_rows = 1;
        while staged_rows < most_rows && staged_rows < MMA {
            staged_rows *= 2;
        }
        FragCube {
            splits,
            whole_k: inn,
            staged_rows,
            ..self
        }
    }

    /// Planes of distinct output rows: `4 / splits`.
    pub const fn row_planes(&self) -> usize {
        FRAG_PLANES / self.splits
    }

    /// Output rows the cube covers per projection: `8 blocks` per plane of rows.
    pub const fn rows(&self) -> usize {
        self.row_planes() * self.blocks * N8
    }

    /// Buffers of the staging: 2 with `double_buffer`, else 1.
    pub const fn buffers(&self) -> usize {
        if self.double_buffer {
            2
        } else {
            1
        }
    }

    /// Whether every chunk of `chunk_steps` K steps over `inn` inputs in scale groups of
    /// `steps_per_scale` steps is whole (what `full_chunks` says).
    pub const fn whole_chunks(chunk_steps: usize, inn: usize, steps_per_scale: usize) -> bool {
        inn.is_multiple_of(MMA * chunk_steps) && steps_per_scale.is_multiple_of(chunk_steps)
    }

    /// Assignments (dense: tokens) the cube covers: `16 m_tiles`.
    pub const fn assignments(&self) -> usize {
        MMA * self.m_tiles
    }

    /// Accumulator fragments a unit holds: one per tile, projection and block.
    const fn fragments(&self, swiglu: bool) -> usize {
        self.m_tiles * self.blocks * if swiglu { 2 } else { 1 }
    }
}

/// Index of the accumulator fragment of tile `m`, projection `proj` and block `block` among a unit's
/// [`FragCube::fragments`] (constant once the loops over them unroll).
#[cube]
fn fragment_index(
    m: usize,
    proj: usize,
    block: usize,
    #[comptime] swiglu: bool,
    #[comptime] cube: FragCube,
) -> usize {
    let projections = comptime!(if swiglu { 2usize } else { 1usize });
    (m * projections + proj) * comptime!(cube.blocks) + block
}

/// `y[a, row] = sum_k input[src(a), k] a_e[row, k]` (or `silu(.) * (. b_e)` with `swiglu`) for the
/// assignments of the cube's tiles, in [`super::mma_moe`](crate::kernels::mma_moe)'s order, with
/// [`super::mma_moe::grouped_tiles`](fn@crate::kernels::mma_moe::grouped_tiles)' arguments, `offsets_at`
/// where the table's expert offsets start, and the compile-time layout `cube` ([`FragCube`]; the bits do not
/// depend on it). The cube of tile `CUBE_POS_Y` of the table covers it and the expert's next `m_tiles - 1`
/// tiles when it is the first of them (its place in the expert a multiple of `16 m_tiles`), and nothing
/// otherwise: the grid is the table's, whatever the cube. On the instruction with `tensor_cores` (half `X`),
/// else emulated (any runtime and operand type). `y` is f32 for the grouped products. With `dense`, the dense
/// product `y[t, row] = sum_k input[t, k] w[row, k]` of
/// [`super::mma::gemm_tiles`](fn@crate::kernels::mma::gemm_tiles)' order instead: the cube covers tokens
/// `16 m_tiles CUBE_POS_Y ..` of `tokens`, one matrix, no table (any buffer), `y` of the activations' type
/// `Y`, rounded once. Launch with `CubeDim (32, 4)` and `CubeCount (ceil(n_out / rows), tiles)` (dense:
/// `ceil(tokens / (16 m_tiles))`).
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_fragments<I: Float, X: Float, Y: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    offsets_at: usize,
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
    #[comptime] cube: FragCube,
    #[define(I, X, Y)] _dtypes: [ElemType; 3],
) {
    let (expert, a0, a_end) = cube_assignments(table, offsets_at, tokens, dense, cube);
    let row0 = CUBE_POS_X as usize * comptime!(cube.rows());
    let (woff, soff) = (expert * expert_words, expert * expert_scales);
    // The staging (with `double_buffer` two buffers of each chunk: a chunk is stored into one while
    // the cube may still multiply the last from the other, so one barrier per chunk suffices), and the
    // scalar twin's exchange of fragment registers.
    let buffers = comptime!(cube.buffers());
    let mut xs = Shared::<[Vector<X, Const<2>>]>::new_aligned_slice(
        comptime!(staged_inputs_len(cube)),
        SHARED_ALIGN,
    );
    let wlen = comptime!(staged_words_len(fmt, cube));
    let mut wa = Shared::<[u32]>::new_aligned_slice(comptime!(buffers * wlen), SHARED_ALIGN);
    let mut wb = Shared::<[u32]>::new_aligned_slice(
        comptime!(if swiglu { buffers * wlen } else { 1 }),
        SHARED_ALIGN,
    );
    let mut exchange = Shared::<[Vector<X, Const<2>>]>::new_aligned_slice(
        comptime!(if tensor_cores {
            1
        } else {
            UNITS * EXCHANGE_REGS
        }),
        SHARED_ALIGN,
    );
    let mut len = 0usize;
    let mut groups = 0usize;
    if a0 < a_end {
        len = a_end - a0;
        groups = steps.div_ceil(steps_per_scale);
    }
    if comptime!(cube.splits > 1) {
        split::split_groups::<I, X, Y>(
            input,
            table,
            rows_at,
            words_a,
            scales_a,
            words_b,
            scales_b,
            lut,
            y,
            n_out,
            wpr,
            spr,
            &mut xs,
            &mut wa,
            &mut wb,
            &mut exchange,
            woff,
            soff,
            a0,
            a_end,
            row0,
            len,
            groups,
            steps_per_scale,
            fmt,
            group,
            swiglu,
            gather,
            tensor_cores,
            cube,
        );
    } else {
        let chunk_steps = comptime!(cube.chunk_steps);
        // One buffer's inputs.
        let xlen = comptime!(cube.assignments() * x_stride(chunk_steps));
        let wpu = comptime!(words_per_unit(fmt, cube));
        let mut held_a = Array::<u32>::new(wpu);
        let mut held_b = Array::<u32>::new(comptime!(if swiglu { wpu } else { 1 }));
        let mut held_x = Array::<I>::new(comptime!(held_inputs(cube)));
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
                cube,
            );
        }
        let frags = comptime!(cube.fragments(swiglu));
        let mut total = Array::<f32>::new(comptime!(4 * frags));
        #[unroll]
        for j in 0..comptime!(4 * frags) {
            total[j] = 0.0f32;
        }
        // The buffer the next chunk is stored into.
        let mut buffer = 0usize;
        for g in 0..groups {
            let mut acc = zero_fragments(comptime!(frags));
            let first = g * steps_per_scale;
            let last = (first + steps_per_scale).min(steps);
            for c in 0..(last - first).div_ceil(chunk_steps) {
                let s0 = first + c * chunk_steps;
                let chunk_last = (s0 + chunk_steps).min(last);
                let (xbase, wbase) = (buffer * xlen, buffer * wlen);
                if comptime!(cube.double_buffer) {
                    buffer = 1 - buffer;
                }
                store_chunk::<I, X>(
                    &held_a, &held_b, &held_x, &mut xs, &mut wa, &mut wb, xbase, wbase, s0,
                    chunk_last, len, inn, fmt, swiglu, cube,
                );
                // After it every unit has stored this chunk, so has multiplied the last: with two buffers,
                // the one the next store overwrites is free.
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
                    cube,
                );
                multiply_chunk::<X>(
                    &xs,
                    xbase,
                    0,
                    s0,
                    chunk_last,
                    &wa,
                    &wb,
                    wbase,
                    lut,
                    &mut acc,
                    &mut exchange,
                    len,
                    fmt,
                    swiglu,
                    tensor_cores,
                    cube,
                );
                if comptime!(!cube.double_buffer) {
                    // One buffer: every unit is done with it before the next store.
                    sync_cube();
                }
            }
            add_group(
                &mut total,
                &acc,
                scales_a,
                scales_b,
                soff,
                row0,
                first * MMA,
                n_out,
                spr,
                fmt,
                group,
                swiglu,
                cube,
            );
        }
        store_fragments(y, &total, a0, a_end, row0, n_out, swiglu, cube);
    }
}

/// The cube's expert and assignments `a0 .. a_end` (dense: its tokens); an empty range where the cube
/// has nothing to do (an empty or malformed tile, or a tile another cube covers with its first).
// Kernel code: `#[cube]` expands the `%` operator, not `usize::is_multiple_of`.
#[allow(clippy::manual_is_multiple_of)]
#[cube]
fn cube_assignments(
    table: &[u32],
    offsets_at: usize,
    tokens: usize,
    #[comptime] dense: bool,
    #[comptime] cube: FragCube,
) -> (usize, usize, usize) {
    let tile = CUBE_POS_Y as usize;
    let span = comptime!(cube.assignments());
    let mut expert = 0usize;
    let mut a0 = tile * span;
    let mut a_end = tokens.min(a0 + span);
    if comptime!(!dense) {
        expert = table[3 * tile] as usize;
        a0 = table[3 * tile + 1] as usize;
        a_end = table[3 * tile + 2] as usize;
        if comptime!(cube.m_tiles > 1) {
            // An empty tile stays empty and reads only the first offset (the device table's trailing
            // tiles name expert 0, which may not exist).
            let at = select(a0 < a_end, offsets_at + expert, offsets_at);
            let start = table[at] as usize;
            let end = table[select(a0 < a_end, at + 1, at)] as usize;
            let first = a0 < a_end && a0 >= start && (a0 - start) % span == 0;
            a_end = select(first, end.min(a0 + span), a0);
        }
    }
    (expert, a0, a_end)
}

/// The staged chunk's steps into the accumulators: for each step `s` of the chunk of steps `s0 ..
/// chunk_last`, the A fragments of staged input step `a_step0 + s` (of the buffer at `xbase`) and, per
/// block, the B fragments of staged word step `s` (of the words at `wbase`). Unrolled on the
/// instruction; the emulation's shaders stay small (lavapipe compiles them).
#[cube]
#[allow(clippy::too_many_arguments)]
fn multiply_chunk<X: Float>(
    xs: &Shared<[Vector<X, Const<2>>]>,
    xbase: usize,
    a_step0: usize,
    s0: usize,
    chunk_last: usize,
    wa: &Shared<[u32]>,
    wb: &Shared<[u32]>,
    wbase: usize,
    lut: &[f32],
    acc: &mut Array<Vector<f32, Const<2>>>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
    len: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] tensor_cores: bool,
    #[comptime] cube: FragCube,
) {
    #[unroll(tensor_cores)]
    for s in 0..comptime!(cube.chunk_steps) {
        if s0 + s < chunk_last {
            let a = a_fragments::<X>(xs, xbase, a_step0 + s, cube);
            #[unroll]
            for block in 0..comptime!(cube.blocks) {
                block_step::<X>(
                    &a,
                    wa,
                    wb,
                    wbase,
                    lut,
                    acc,
                    exchange,
                    len,
                    block,
                    s,
                    fmt,
                    swiglu,
                    tensor_cores,
                    cube,
                );
            }
        }
    }
}

/// `total += acc * scale` for every accumulator fragment of a scale group starting at input `k`: per
/// output, its groups are added in order (the order's `total += sum * scale`, groups left to right).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_group(
    total: &mut Array<f32>,
    acc: &Array<Vector<f32, Const<2>>>,
    scales_a: &[f32],
    scales_b: &[f32],
    soff: usize,
    row0: usize,
    k: usize,
    n_out: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] swiglu: bool,
    #[comptime] cube: FragCube,
) {
    #[unroll]
    for m in 0..comptime!(cube.m_tiles) {
        #[unroll]
        for block in 0..comptime!(cube.blocks) {
            let f = fragment_index(m, 0, block, swiglu, cube);
            add_scaled_fragment(
                total, acc, f, block, scales_a, soff, row0, k, n_out, spr, fmt, group, cube,
            );
            if comptime!(swiglu) {
                let f = fragment_index(m, 1, block, swiglu, cube);
                add_scaled_fragment(
                    total, acc, f, block, scales_b, soff, row0, k, n_out, spr, fmt, group, cube,
                );
            }
        }
    }
}

/// The unit's plane of output rows: `UNIT_POS_Y` where every plane has its own rows, else its place
/// among the cube's `4 / splits` planes of rows (the planes of one set of scale groups, [`split`]).
#[cube]
pub(super) fn row_plane(#[comptime] cube: FragCube) -> usize {
    let mut plane = UNIT_POS_Y as usize;
    if comptime!(cube.splits > 1) {
        plane %= comptime!(cube.row_planes());
    }
    plane
}

/// Stores the unit's outputs into `y [assignments, n_out]`: the totals, or `silu(a) * b`, rounded once to
/// `Y`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_fragments<Y: Float>(
    y: &mut [Y],
    total: &Array<f32>,
    a0: usize,
    a_end: usize,
    row0: usize,
    n_out: usize,
    #[comptime] swiglu: bool,
    #[comptime] cube: FragCube,
) {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    #[unroll]
    for m in 0..comptime!(cube.m_tiles) {
        #[unroll]
        for block in 0..comptime!(cube.blocks) {
            let fa = fragment_index(m, 0, block, swiglu, cube);
            #[unroll]
            for i in 0..4usize {
                let a = a0 + m * MMA + g + 8 * (i / 2);
                let r =
                    row0 + (row_plane(cube) * comptime!(cube.blocks) + block) * N8 + 2 * t + i % 2;
                if a < a_end && r < n_out {
                    let mut v = total[4 * fa + i];
                    if comptime!(swiglu) {
                        let fb = fragment_index(m, 1, block, swiglu, cube);
                        v = silu_times(total[4 * fa + i], total[4 * fb + i]);
                    }
                    y[a * n_out + r] = Y::cast_from(v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// The pair decode's constants: every stored int4 code (two's complement) under the magic bits,
    /// minus the bias pair, is the code's value (exact), in both halves, for f16 and bf16; and the
    /// kernel's bit moves (mirrored here: `(v & 0xF) | ((v << 12) & 0xF0000)` of the stored word shifted
    /// to code `j`, XOR the magic) put codes `j` and `j + 1` of every word under the two halves.
    #[test]
    fn pair_decode_constants_give_the_codes_values() {
        let value = |decode, bits: u32| match decode {
            PairDecode::F16 => f16::from_bits(bits as u16).to_f32(),
            _ => bf16::from_bits(bits as u16).to_f32(),
        };
        // A stored nibble's value: two's complement.
        let stored = |c: u32| ((c as i32) << 28 >> 28) as f32;
        for decode in [PairDecode::F16, PairDecode::Bf16] {
            let (magic, bias) = decode.magic();
            let pair =
                |bits: u32| [0, 16].map(|h| value(decode, bits >> h) - value(decode, bias >> h));
            for c in 0u32..16 {
                assert_eq!(
                    pair((c | c << 16) ^ magic),
                    [stored(c); 2],
                    "{decode:?} {c}"
                );
            }
            let mut word = 0x9E37_79B9u32;
            for _ in 0..64 {
                word = word.rotate_left(5) ^ word.wrapping_mul(0x85EB_CA6B);
                for j in [0u32, 2, 4, 6] {
                    let v = word >> (j * 4);
                    let got = pair(((v & 0xF) | ((v << 12) & 0xF_0000)) ^ magic);
                    let code = |i: u32| stored((word >> (4 * i)) & 15);
                    assert_eq!(got, [code(j), code(j + 1)], "{decode:?} {word:#x} code {j}");
                }
            }
        }
    }

    /// The `ldmatrix.x4` addressing of [`fragment::a_fragments`] (mirrored: lane `l` gives the address of
    /// row `l % 8 + 8 ((l / 8) % 2)` at input `8 (l / 16)`), with the PTX ISA's distribution of the
    /// four 8 x 8 matrices (register `n` of lane `l` holds row `l / 4` of matrix `n`, columns `2 (l %
    /// 4)` and the next, matrix `n`'s rows being those the lanes `8 n ..` address), puts in every lane's
    /// register `r` the inputs the `m16n8k16` A layout puts there (row `g + 8 (r % 2)`, inputs `2 t + 8
    /// (r / 2)` and the next): the loads by pairs and by `ldmatrix` fill the same registers.
    #[test]
    fn ldmatrix_rows_fill_the_a_fragment_layout() {
        // The (row, first input) lane `l` addresses.
        let address = |l: usize| (l % 8 + 8 * ((l / 8) % 2), 8 * (l / 16));
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            for n in 0..4 {
                let (row, k0) = address(8 * n + g);
                let by_ldmatrix = (row, k0 + 2 * t);
                let by_layout = (g + 8 * (n % 2), 2 * t + 8 * (n / 2));
                assert_eq!(by_ldmatrix, by_layout, "lane {lane} register {n}");
            }
        }
    }
}
