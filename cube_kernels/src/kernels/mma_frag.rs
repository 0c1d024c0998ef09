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

use cubecl::prelude::*;

use super::mma::{clear_past_inputs, next_chunk, MMA, MMA_PLANE, SHARED_ALIGN};
use super::moe::silu_times;
use super::{code_flip, codes_per_word, scale_at, word_code_value};

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
/// Most K steps a cube stages per pair of barriers (a chunk never crosses a scale group).
pub const FRAG_MAX_CHUNK_STEPS: usize = 8;
/// Padding of every staged row, in 4-byte words: with it, the 8 rows a plane's fragment reads touch
/// start in 8 different banks at 8 staged steps.
const ROW_PAD: usize = 4;

/// Input pairs per staged row of `chunk_steps` steps, padding included.
const fn x_stride(chunk_steps: usize) -> usize {
    chunk_steps * MMA / 2 + ROW_PAD
}

/// Packed words per row of a chunk of `chunk_steps` steps.
const fn chunk_words(fmt: u32, chunk_steps: usize) -> usize {
    chunk_steps * MMA / codes_per_word(fmt)
}

/// Packed words per staged row, padding included.
const fn w_stride(fmt: u32, chunk_steps: usize) -> usize {
    chunk_words(fmt, chunk_steps) + ROW_PAD
}

/// Packed words a unit loads per chunk and projection.
const fn words_per_unit(fmt: u32, chunk_steps: usize) -> usize {
    (FRAG_ROWS * chunk_words(fmt, chunk_steps)).div_ceil(UNITS)
}

/// Input pairs a unit loads per chunk.
const fn pairs_per_unit(chunk_steps: usize) -> usize {
    (MMA * chunk_steps * MMA / 2).div_ceil(UNITS)
}

/// Shared memory [`grouped_fragments`] allocates with chunks of `chunk_steps` steps, `operand_bytes`-byte
/// operands, two projections with `swiglu`, and the scalar twin's exchange of the fragment registers
/// (without `tensor_cores`), alignment padding included.
pub fn grouped_fragments_shared_bytes(
    fmt: u32,
    chunk_steps: usize,
    operand_bytes: usize,
    swiglu: bool,
    tensor_cores: bool,
) -> usize {
    let xs = MMA * x_stride(chunk_steps) * 2 * operand_bytes;
    let ws = FRAG_ROWS * w_stride(fmt, chunk_steps) * 4;
    let wb = if swiglu { ws } else { 4 };
    let exchange = if tensor_cores {
        0
    } else {
        UNITS * (4 + 2) * 2 * operand_bytes
    };
    xs + ws + wb + exchange + 5 * SHARED_ALIGN
}

/// The most K steps per chunk (at most [`FRAG_MAX_CHUNK_STEPS`] of 4-bit codes or half as many of 8-bit
/// ones, and a scale group's `steps_per_scale`) whose staging fits in `max_shared` bytes, or `None` where
/// not even one does.
pub fn fragment_chunk_steps(
    fmt: u32,
    steps_per_scale: usize,
    operand_bytes: usize,
    tensor_cores: bool,
    max_shared: usize,
) -> Option<usize> {
    // The same packed bytes per chunk for every format: 8 steps of 4-bit codes, 4 of 8-bit ones (8 of
    // int8-pc's took 255 registers and spilled in the sm_90 gate-up kernel).
    let most = FRAG_MAX_CHUNK_STEPS * codes_per_word(fmt) / 8;
    (1..=most.min(steps_per_scale.max(1))).rev().find(|&d| {
        grouped_fragments_shared_bytes(fmt, d, operand_bytes, true, tensor_cores) <= max_shared
    })
}

/// Where the inputs of the tile's assignment `r` start in `input`: row `table[rows_at + a0 + r]` with
/// `gather`, else row `a0 + r`; 0 past the tile's `len` assignments. Looked up at each chunk rather than
/// held in registers (the lookup is an L1 hit, and the chunk's loads go out a chunk ahead).
#[cube]
fn input_row(
    table: &[u32],
    rows_at: usize,
    a0: usize,
    r: usize,
    len: usize,
    inn: usize,
    #[comptime] gather: bool,
) -> usize {
    let mut src = a0 + r;
    if comptime!(gather) {
        src = table[select(r < len, rows_at + a0 + r, 0usize)] as usize;
    }
    select(r < len, src * inn, 0usize)
}

#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_chunk<I: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    a0: usize,
    len: usize,
    words_a: &[u32],
    words_b: &[u32],
    held_a: &mut Array<u32>,
    held_b: &mut Array<u32>,
    held_x: &mut Array<I>,
    s0: usize,
    last: usize,
    row0: usize,
    n_out: usize,
    inn: usize,
    wpr: usize,
    woff: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] chunk_steps: usize,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let cpw = comptime!(codes_per_word(fmt));
    let cw = comptime!(chunk_words(fmt, chunk_steps));
    let k0 = s0 * MMA;
    let k_end = (last * MMA).min(inn);
    if s0 < last {
        #[unroll]
        for p in 0..comptime!(words_per_unit(fmt, chunk_steps)) {
            let i = unit + p * UNITS;
            let (row, w) = (i / cw, i % cw);
            let kw = k0 + w * cpw;
            let r = row0 + row;
            let live = row < FRAG_ROWS && r < n_out && kw < k_end;
            let at = select(live, woff + r * wpr + kw / cpw, 0usize);
            held_a[p] = clear_past_inputs(words_a[at], kw, inn, live, fmt);
            if comptime!(swiglu) {
                held_b[p] = clear_past_inputs(words_b[at], kw, inn, live, fmt);
            }
        }
        let pairs_per_row = comptime!(chunk_steps * MMA / 2);
        #[unroll]
        for p in 0..comptime!(pairs_per_unit(chunk_steps)) {
            let i = unit + p * UNITS;
            let (a, q) = (i / pairs_per_row, i % pairs_per_row);
            let k = k0 + 2 * q;
            let live0 = a < len && k < k_end;
            let live1 = a < len && k + 1 < k_end;
            let row = input_row(table, rows_at, a0, a, len, inn, gather);
            held_x[2 * p] = input[select(live0, row + k, 0usize)];
            held_x[2 * p + 1] = input[select(live1, row + k + 1, 0usize)];
        }
    }
}

/// Stores the chunk at `s0` that [`fetch_chunk`] loaded into shared memory: the input pairs, rounded to
/// `X` (zeros past the tile's `len` assignments or the chunk's inputs), and the packed words as loaded.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_chunk<I: Float, X: Float>(
    held_a: &Array<u32>,
    held_b: &Array<u32>,
    held_x: &Array<I>,
    xs: &mut Shared<[Vector<X, Const<2>>]>,
    wa: &mut Shared<[u32]>,
    wb: &mut Shared<[u32]>,
    s0: usize,
    last: usize,
    len: usize,
    inn: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] chunk_steps: usize,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let cw = comptime!(chunk_words(fmt, chunk_steps));
    let ws = comptime!(w_stride(fmt, chunk_steps));
    let k_end = (last * MMA).min(inn);
    let zero = X::from_int(0);
    #[unroll]
    for p in 0..comptime!(words_per_unit(fmt, chunk_steps)) {
        let i = unit + p * UNITS;
        if i < FRAG_ROWS * cw {
            let at = (i / cw) * ws + i % cw;
            wa[at] = held_a[p];
            if comptime!(swiglu) {
                wb[at] = held_b[p];
            }
        }
    }
    let pairs_per_row = comptime!(chunk_steps * MMA / 2);
    let xstride = comptime!(x_stride(chunk_steps));
    #[unroll]
    for p in 0..comptime!(pairs_per_unit(chunk_steps)) {
        let i = unit + p * UNITS;
        let (a, q) = (i / pairs_per_row, i % pairs_per_row);
        if a < MMA {
            let k = s0 * MMA + 2 * q;
            let mut pair = Vector::<X, Const<2>>::empty();
            pair.insert(
                0usize,
                select(a < len && k < k_end, X::cast_from(held_x[2 * p]), zero),
            );
            pair.insert(
                1usize,
                select(
                    a < len && k + 1 < k_end,
                    X::cast_from(held_x[2 * p + 1]),
                    zero,
                ),
            );
            xs[a * xstride + q] = pair;
        }
    }
}

/// The unit's A fragment (the 16 assignments x 16 inputs of staged step `s`) in the `m16n8k16` register
/// layout: with `g = lane / 4`, `t = lane % 4`, registers (row g, inputs 2t, 2t+1), (row g + 8, same),
/// (row g, inputs 2t + 8, 2t + 9), (row g + 8, same).
#[cube]
fn a_fragment<X: Float>(
    xs: &Shared<[Vector<X, Const<2>>]>,
    s: usize,
    #[comptime] chunk_steps: usize,
) -> Array<Vector<X, Const<2>>> {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    let xstride = comptime!(x_stride(chunk_steps));
    let mut regs = Array::<Vector<X, Const<2>>>::new(4usize);
    #[unroll]
    for r in 0..4usize {
        let row = g + (r % 2) * 8;
        let pair = s * (MMA / 2) + (r / 2) * 4 + t;
        regs[r] = xs[row * xstride + pair];
    }
    regs
}

/// The unit's B fragment of staged step `s` for the cube's row `row` (its `n = g`): registers (inputs
/// 2t, 2t+1) and (inputs 2t + 8, 2t + 9), decoded from the packed words ([`word_code_value`]; exact in
/// `X`).
#[cube]
fn b_fragment<X: Float>(
    ws: &Shared<[u32]>,
    lut: &[f32],
    row: usize,
    s: usize,
    #[comptime] fmt: u32,
    #[comptime] chunk_steps: usize,
) -> Array<Vector<X, Const<2>>> {
    let t = UNIT_POS_X as usize % 4;
    let cpw = comptime!(codes_per_word(fmt));
    let wstride = comptime!(w_stride(fmt, chunk_steps));
    let mut regs = Array::<Vector<X, Const<2>>>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let k = s * MMA + r * 8 + 2 * t;
        let word = ws[row * wstride + k / cpw] ^ code_flip(fmt);
        let j = (k % cpw) as u32;
        let mut pair = Vector::<X, Const<2>>::empty();
        pair.insert(0usize, X::cast_from(word_code_value(word, j, lut, fmt)));
        pair.insert(1usize, X::cast_from(word_code_value(word, j + 1, lut, fmt)));
        regs[r] = pair;
    }
    regs
}

/// `acc += A B` for one `m16n8k16` fragment: the instruction with `tensor_cores`, else its emulation from
/// the plane's fragment registers ([`emulate_mma`]).
#[cube]
fn fragment_mma<X: Float>(
    a: &Array<Vector<X, Const<2>>>,
    b: &Array<Vector<X, Const<2>>>,
    acc: &mut Array<Vector<f32, Const<2>>>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
    #[comptime] tensor_cores: bool,
) {
    if comptime!(tensor_cores) {
        let def = cmma::MmaDefinition::<X, X, f32>::new(MMA, N8, MMA);
        def.execute_inplace(a, b, acc);
    } else {
        emulate_mma(a, b, acc, exchange);
    }
}

/// What `mma.m16n8k16` computes, from the fragment registers as the instruction receives them: each unit
/// writes its registers to the plane's part of `exchange`, and each output `(m, n)` the unit holds
/// (accumulator registers (row g, columns 2t, 2t+1), (row g + 8, same)) takes `A[m, k] B[k, n]` for `k`
/// in order with fused multiply-adds from its accumulator, reading `A[m, k]` from unit `4 (m % 8) +
/// (k % 8) / 2` and `B[k, n]` from unit `4 n + (k % 8) / 2`, as the PTX ISA lays them out. Every plane of
/// the cube calls it together (it waits for the cube).
#[cube]
fn emulate_mma<X: Float>(
    a: &Array<Vector<X, Const<2>>>,
    b: &Array<Vector<X, Const<2>>>,
    acc: &mut Array<Vector<f32, Const<2>>>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
) {
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let (g, t) = (lane / 4, lane % 4);
    // The plane's 32 units x (4 A + 2 B) registers.
    let base = plane * MMA_PLANE * 6;
    #[unroll]
    for r in 0..4usize {
        exchange[base + lane * 6 + r] = a[r];
    }
    #[unroll]
    for r in 0..2usize {
        exchange[base + lane * 6 + 4 + r] = b[r];
    }
    sync_cube();
    #[unroll]
    for half in 0..2usize {
        let mut out = acc[half];
        let base_a = base + 4 * g * 6 + half;
        out.insert(
            0usize,
            emulated_output(
                &*exchange,
                base_a,
                base + 4 * (2 * t) * 6 + 4,
                out.extract(0usize),
            ),
        );
        out.insert(
            1usize,
            emulated_output(
                &*exchange,
                base_a,
                base + 4 * (2 * t + 1) * 6 + 4,
                out.extract(1usize),
            ),
        );
        acc[half] = out;
    }
    sync_cube();
}

/// One output of [`emulate_mma`]: `sum + A[m, k] B[k, n]` for `k = 0..16` in order, with `A[m, k]` at
/// `a_at + (k % 8) / 2 * 6 + 2 * (k / 8)` and `B[k, n]` at `b_at + (k % 8) / 2 * 6 + k / 8` of
/// `exchange` (element `k % 2` of each pair).
#[cube]
fn emulated_output<X: Float>(
    exchange: &Shared<[Vector<X, Const<2>>]>,
    a_at: usize,
    b_at: usize,
    sum: f32,
) -> f32 {
    let mut sum = sum;
    for k in 0..MMA {
        let av = exchange[a_at + (k % 8) / 2 * 6 + 2 * (k / 8)];
        let bv = exchange[b_at + (k % 8) / 2 * 6 + k / 8];
        let odd = k % 2 == 1;
        let a = select(odd, av.extract(1usize), av.extract(0usize));
        let b = select(odd, bv.extract(1usize), bv.extract(0usize));
        sum = fma(f32::cast_from(a), f32::cast_from(b), sum);
    }
    sum
}

/// One staged step for one block of 8 rows of one projection: its B fragment ([`b_fragment`]) into the
/// block's accumulator.
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_step<X: Float>(
    a: &Array<Vector<X, Const<2>>>,
    ws: &Shared<[u32]>,
    lut: &[f32],
    acc: &mut Array<Vector<f32, Const<2>>>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
    block: usize,
    s: usize,
    #[comptime] fmt: u32,
    #[comptime] chunk_steps: usize,
    #[comptime] tensor_cores: bool,
) {
    let row = UNIT_POS_Y as usize * (BLOCKS * N8) + block * N8 + UNIT_POS_X as usize / 4;
    let b = b_fragment::<X>(ws, lut, row, s, fmt, chunk_steps);
    fragment_mma::<X>(a, &b, acc, exchange, tensor_cores);
}

/// A fresh accumulator fragment.
#[cube]
fn zero_fragment() -> Array<Vector<f32, Const<2>>> {
    let mut acc = Array::<Vector<f32, Const<2>>>::new(2usize);
    acc[0] = Vector::<f32, Const<2>>::new(0.0f32);
    acc[1] = Vector::<f32, Const<2>>::new(0.0f32);
    acc
}

/// `total[4 f + i] += sum_i * scale(row)` for the 4 outputs of accumulator fragment `f` (block `block`),
/// output `i` in row `2t + i % 2` of the block (assignment `g + 8 (i / 2)`); rows past `n_out` keep 0.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_scaled_fragment(
    total: &mut Array<f32>,
    acc: &Array<Vector<f32, Const<2>>>,
    f: usize,
    block: usize,
    scales: &[f32],
    soff: usize,
    row0: usize,
    k: usize,
    n_out: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
) {
    let t = UNIT_POS_X as usize % 4;
    let base = row0 + UNIT_POS_Y as usize * (BLOCKS * N8) + block * N8 + 2 * t;
    #[unroll]
    for i in 0..4usize {
        let r = base + i % 2;
        if r < n_out {
            let v = acc[i / 2];
            let sum = select(i % 2 == 1, v.extract(1usize), v.extract(0usize));
            total[4 * f + i] += sum * scale_at(scales, soff, r, k, spr, fmt, group);
        }
    }
}

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
        comptime!(if tensor_cores { 1 } else { UNITS * 6 }),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunk is the most K steps that fit, never past a scale group or eight; `None` where one step
    /// does not fit. The allocation grows with the chunk, and the scalar twin's exchange costs more.
    #[test]
    fn chunks_take_the_most_steps_that_fit() {
        let (int4, int8) = (0, 1);
        // An H200's 227 KiB: the whole group of int4-g128 (8 steps), four of int8-pc's 128 (the same
        // bytes).
        assert_eq!(fragment_chunk_steps(int4, 8, 2, true, 227 << 10), Some(8));
        assert_eq!(fragment_chunk_steps(int8, 128, 2, true, 227 << 10), Some(4));
        // Groups of 2 (int4-g32) and 1 (nvfp4) steps bound the chunk.
        assert_eq!(fragment_chunk_steps(int4, 2, 2, true, 227 << 10), Some(2));
        assert_eq!(fragment_chunk_steps(int4, 1, 2, true, 227 << 10), Some(1));
        // WebGPU's 16 KiB: fewer steps for f32 than f16 operands, and with the exchange.
        let f32_twin = fragment_chunk_steps(int4, 8, 4, false, 16 << 10).unwrap();
        let f16_twin = fragment_chunk_steps(int4, 8, 2, false, 16 << 10).unwrap();
        assert!(f32_twin < f16_twin && f16_twin < 8, "{f32_twin} {f16_twin}");
        for d in [f32_twin, f16_twin] {
            let bytes = if d == f32_twin { 4 } else { 2 };
            assert!(grouped_fragments_shared_bytes(int4, d, bytes, true, false) <= 16 << 10);
            assert!(grouped_fragments_shared_bytes(int4, d + 1, bytes, true, false) > 16 << 10);
        }
        assert_eq!(fragment_chunk_steps(int8, 8, 4, false, 1 << 10), None);
    }

    /// Row strides padded by 4 words put the 8 rows of a plane's fragment reads in distinct banks at the
    /// most staged steps (20 words: 8 steps of int4, 4 of int8): no bank conflict for the B fragments.
    #[test]
    fn padded_rows_start_in_distinct_banks() {
        for fmt in [0u32, 1] {
            let stride = w_stride(fmt, FRAG_MAX_CHUNK_STEPS * codes_per_word(fmt) / 8);
            let mut banks: Vec<usize> = (0..8).map(|g| (g * stride) % 32).collect();
            banks.sort_unstable();
            banks.dedup();
            assert_eq!(banks.len(), 8, "fmt {fmt}: stride {stride}");
        }
        // The input pairs: rows 68 pairs apart, lanes t = 0..3 beside them: 32 distinct banks.
        let stride = x_stride(FRAG_MAX_CHUNK_STEPS);
        let mut banks: Vec<usize> = (0..8)
            .flat_map(|g| (0..4).map(move |t| (g * stride + t) % 32))
            .collect();
        banks.sort_unstable();
        banks.dedup();
        assert_eq!(banks.len(), 32);
    }
}
