//! The CubeCL kernels, written once and launched on any runtime (CUDA, wgpu, the CPU runtime).
//!
//! Every matmul here sums in one **canonical order** ([`crate::reference`]): per output, inputs are taken
//! in chunks of [`CHUNK`] = 32; a chunk is summed sequentially with fused multiply-adds from 0, and the
//! chunk sums are added to the total left to right. The GEMV (one token per cube row, chunks in parallel
//! lanes) and the tiled GEMM (a K tile is one chunk) follow it exactly, so a token's output does not
//! depend on the batch it is in or on which kernel served it: rollout (decode, GEMV) and the training
//! forward (many tokens, GEMM) compute the same bits.
//!
//! # Precision contract (f32, f16 and bf16 activations)
//! The activations' element type is a launch parameter (`F` in f32, f16, bf16; `#[define(..)]`). Inputs
//! are read in `F` and widened to f32 exactly; weights are decoded in f32; every product and sum is
//! accumulated in f32 in the canonical order above; the result is rounded **once**, to `F`, when it is
//! stored. Intermediates that never leave a launch chain (the fp8-quantized activations, the MoE's SwiGLU
//! output and per-assignment down projections) stay f32. So an `F` result is the f32 result on the same
//! inputs widened to f32, rounded to `F`: `y_F = round_F(y_f32(widen(x_F)))`, bit for bit on one device,
//! with the runtime's f32 -> `F` conversion, expected to round to nearest even (CUDA's `__half` and
//! `__nv_bfloat16` conversions from float do). The tests check it bitwise against the host's
//! round-to-nearest-even ([`crate::ActDType::round`]) for f16 on lavapipe, and `qarl bench kernels --check
//! --act-dtype ..` does on a GPU for every type the device has. Against the host reference the
//! result is `round_F` of a value within the f32 tolerance, so it is bit-exact wherever the f32 result is.
//!
//! Weight formats are compile-time parameters (`fmt`: 0 = int4, 1 = int8, 2 = fp8, 3 = fp4 (nvfp4 and
//! mxfp4, E2M1 codes); `group`: the int4 group, the fp8 block or the fp4 block), so each launched kernel is
//! specialised and the decode is branch-free.

pub mod dense;
pub mod exact;
pub mod fp8;
pub mod mma;
pub mod mma_frag;
pub mod mma_moe;
pub mod moe;
pub mod moe_train;
pub mod route;

use cubecl::prelude::*;

/// Sets every word of `out` to `value`, one unit per word: what [`crate::Kernels::with_poisoned_outputs`]
/// fills fresh outputs with. A launch, not an upload, so it runs inside a recorded graph as well.
#[cube(launch)]
pub fn fill_words(out: &mut [u32], value: u32) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        out[i] = value;
    }
}

/// Inputs per chunk of the canonical order, and the K depth of a GEMM tile (defined with the formats, whose
/// groups and blocks are multiples of it).
pub use crate::format::CHUNK;
/// Rows and tokens per GEMM tile (the cube is `TILE x TILE` units, one output each).
pub const TILE: usize = 16;
/// Row stride of a tile staged in shared memory: 33, not 32, so the 16 rows a warp reads at one depth fall
/// in 16 different banks instead of one (a 32-float stride maps every row to the same bank).
pub const TILE_STRIDE: usize = CHUNK + 1;
/// Floats of one staged 16 x 32 tile at [`TILE_STRIDE`].
pub const TILE_FLOATS: usize = TILE * TILE_STRIDE;
/// Tokens and rows per cube of the register-blocked GEMM (16 x 16 units, 4 x 4 outputs each).
pub const BLOCK: usize = 64;
/// K-major stride of the register-blocked GEMM's staging: 65, so a unit's writes (16 neighbouring inputs
/// of one row) and a warp's reads (neighbouring rows at one input) fall in different banks.
pub const STAGE_STRIDE: usize = BLOCK + 1;
/// Floats of one 16-input stage of 64 rows at [`STAGE_STRIDE`].
pub const STAGE_FLOATS: usize = 16 * STAGE_STRIDE;
/// Twice the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (small integers), one per nibble: magnitude code
/// `c` (0..8) is `(E2M1_TWICE >> 4c) & 15`.
pub const E2M1_TWICE: u32 = 0xC864_3210;

/// The value of an E2M1 code ([`crate::format::E2M1_VALUES`]), exactly: twice the magnitude from
/// [`E2M1_TWICE`] as a float ([`small_uint_value`](fn@small_uint_value)), times 0.5, with the code's sign bit
/// as the float's (each step exact, -0.0 for code 8). No integer-to-float conversion: on NVIDIA parts those
/// issue at a fraction of the FMA rate, and the tiles decode one code per weight and tile.
#[cube]
pub fn e2m1_value(nib: u32) -> f32 {
    let twice = (0xC864_3210u32 >> ((nib & 7u32) * 4u32)) & 15u32;
    let magnitude = small_uint_value(twice) * 0.5f32;
    f32::reinterpret(u32::reinterpret(magnitude) | ((nib >> 3u32) << 31u32))
}

/// `v as f32` for `v < 2^23`, exactly, without a conversion instruction: the float whose bits are
/// `0x4B00_0000 | v` is `2^23 + v` (exponent 23, `v` in the mantissa), and subtracting `2^23` is exact.
#[cube]
pub fn small_uint_value(v: u32) -> f32 {
    f32::reinterpret(v | 0x4B00_0000u32) - 8_388_608.0f32
}

/// The XOR that turns a packed word's two's-complement integer codes into offset binary (int4: every
/// nibble's top bit, int8: every byte's), so that [`word_code_value`](fn@word_code_value) reads `q` as
/// `(code ^ 8) - 8` (int4) or `(code ^ 128) - 128` (int8) with one float subtraction; 0 for the float
/// formats.
#[cube]
pub fn code_flip(#[comptime] fmt: u32) -> u32 {
    if comptime!(fmt == 0) {
        0x8888_8888u32
    } else if comptime!(fmt == 1) {
        0x8080_8080u32
    } else {
        0u32
    }
}

/// The value of code `j` of a packed word already XOR-ed with [`code_flip`](fn@code_flip), before its scale,
/// exactly [`crate::format::WeightFormat::code_value`]: int4 and int8 integers (offset binary read as a float
/// by [`small_uint_value`](fn@small_uint_value)'s construction, minus the offset and `2^23` in one exact
/// subtraction), the E4M3 value from the decode table `lut`, or [`e2m1_value`](fn@e2m1_value).
#[cube]
pub fn word_code_value(flipped: u32, j: u32, lut: &[f32], #[comptime] fmt: u32) -> f32 {
    if comptime!(fmt == 0) {
        f32::reinterpret(((flipped >> (j * 4u32)) & 15u32) | 0x4B00_0000u32) - 8_388_616.0f32
    } else if comptime!(fmt == 1) {
        f32::reinterpret(((flipped >> (j * 8u32)) & 255u32) | 0x4B00_0000u32) - 8_388_736.0f32
    } else if comptime!(fmt == 2) {
        lut[((flipped >> (j * 8u32)) & 255u32) as usize]
    } else {
        e2m1_value((flipped >> (j * 4u32)) & 15u32)
    }
}

/// Codes per packed `u32` word: 8 (int4, fp4) or 4 (int8, fp8).
pub const fn codes_per_word(fmt: u32) -> usize {
    if fmt == 0 || fmt == 3 {
        8
    } else {
        4
    }
}

/// Packed words of one chunk: 4 (int4, fp4) or 8 (int8, fp8).
pub const fn words_per_chunk(fmt: u32) -> usize {
    CHUNK / codes_per_word(fmt)
}

/// Whether a whole chunk of format `fmt` with groups (or blocks) of `group` inputs takes one scale, or
/// for fp4 (blocks of 16 or 32 inputs, which divide a chunk or equal it) one per word: int8, fp4, and
/// int4 and fp8 groups that are multiples of 32. Then [`chunk_dots`](fn@chunk_dots) decodes whole
/// words with their scale loaded once ([`word_dots`](fn@word_dots)).
pub const fn whole_chunk_scales(fmt: u32, group: usize) -> bool {
    fmt == 1 || fmt == 3 || group.is_multiple_of(32)
}

/// Scales a whole chunk of format `fmt` takes where [`whole_chunk_scales`]: one per word for fp4, else one.
pub const fn scales_per_chunk(fmt: u32) -> usize {
    if fmt == 3 {
        words_per_chunk(fmt)
    } else {
        1
    }
}

/// The dequantized weight of row `row`, input `k` of the matrix starting at word `woff` / scale `soff`:
/// `q as f32 * s` (fp8: `e4m3(code) * s` through the decode table `lut`, fp4:
/// [`e2m1_value`](fn@e2m1_value)`(code) * s`), one f32 multiply, as the host reference computes it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn weight_at(
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    woff: usize,
    soff: usize,
    row: usize,
    k: usize,
    wpr: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
) -> f32 {
    let cpw = comptime!(codes_per_word(fmt));
    let word = words[woff + row * wpr + k / cpw] ^ code_flip(fmt);
    let code = word_code_value(word, (k % cpw) as u32, lut, fmt);
    code * scale_at(scales, soff, row, k, spr, fmt, group)
}

/// The f32 scale of row `row` for the group holding input `k` of the matrix starting at scale `soff`
/// (int8: one per row; fp8: per 128 x 128 block; int4 and fp4: per `group` inputs of the row).
#[cube]
pub fn scale_at(
    scales: &[f32],
    soff: usize,
    row: usize,
    k: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
) -> f32 {
    if comptime!(fmt == 1) {
        scales[soff + row]
    } else if comptime!(fmt == 2) {
        scales[soff + (row / group) * spr + k / group]
    } else {
        scales[soff + row * spr + k / group]
    }
}

/// Input `k0 + j` of a product: `x[xoff + k0 + j]` widened to f32, or with `staged` its copy in `xs` from
/// `xs_at`, laid out by [`stage_transposed`](fn@stage_transposed) for a row of `chunks` chunks (`k0` a
/// multiple of 32).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn input_at<X: Float>(
    x: &[X],
    xoff: usize,
    xs: &Shared<[f32]>,
    xs_at: usize,
    k0: usize,
    j: usize,
    #[comptime] chunks: usize,
    #[comptime] staged: bool,
) -> f32 {
    if comptime!(staged) {
        xs[xs_at + j * (chunks + 1) + k0 / 32]
    } else {
        f32::cast_from(x[xoff + k0 + j])
    }
}

/// Floats of one input row staged by [`stage_transposed`](fn@stage_transposed) for `chunks` chunks.
pub const fn staged_row_floats(chunks: usize) -> usize {
    32 * (chunks + 1)
}

/// One chunk of the canonical order: `sum_k input(k) * weight(row, k)` for `k` in `k0..k0 + depth`, fused
/// multiply-adds from 0.0 in `k` order, bit for bit what [`weight_at`](fn@weight_at) one input at a time
/// gives. The inputs are `x` from `xoff`, or with `staged` their copy in `xs` ([`input_at`](fn@input_at)):
/// the same values, so the same bits. [`chunk_dots`](fn@chunk_dots) for one input row.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn chunk_dot<X: Float>(
    x: &[X],
    xoff: usize,
    xs: &Shared<[f32]>,
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    woff: usize,
    soff: usize,
    row: usize,
    k0: usize,
    depth: usize,
    wpr: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] chunks: usize,
    #[comptime] staged: bool,
) -> f32 {
    let mut xoffs = Array::<u32>::new(1usize);
    xoffs[0] = xoff as u32;
    let mut parts = Array::<f32>::new(1usize);
    chunk_dots(
        x, &xoffs, xs, words, scales, lut, woff, soff, row, k0, depth, wpr, spr, &mut parts,
        1usize, fmt, group, chunks, staged,
    );
    parts[0]
}

/// [`chunk_dot`](fn@chunk_dot) of one weight row with `count` input rows at once: row `p`'s inputs are `x`
/// from `xoffs[p]`, or with `staged` their copy in `xs` from `p * staged_row_floats(chunks)`; `parts[p]` gets
/// row `p`'s chunk sum. Each weight is decoded and scaled once and then meets each row in one fused
/// multiply-add, in `k` order from 0.0 per row: every `parts[p]` is bit for bit [`chunk_dot`](fn@chunk_dot)
/// of its row, and the decode, most of a GEMV's instructions per weight, is shared by the rows. A full chunk
/// (`depth == 32`, `k0` a multiple of 32) of a format whose scale is constant over it (int8; int4 and fp8
/// groups that are multiples of 32) or over each word (fp4) loads each scale and each packed word once,
/// and decodes the word's 8 (int4, fp4) or 4 (int8, fp8) codes from registers.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn chunk_dots<X: Float>(
    x: &[X],
    xoffs: &Array<u32>,
    xs: &Shared<[f32]>,
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    woff: usize,
    soff: usize,
    row: usize,
    k0: usize,
    depth: usize,
    wpr: usize,
    spr: usize,
    parts: &mut Array<f32>,
    #[comptime] count: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] chunks: usize,
    #[comptime] staged: bool,
) {
    #[unroll]
    for p in 0..count {
        parts[p] = 0.0f32;
    }
    let mut whole = false;
    if comptime!(whole_chunk_scales(fmt, group)) {
        whole = depth == 32;
    }
    if whole {
        let cpw = comptime!(codes_per_word(fmt));
        let base = woff + row * wpr + k0 / cpw;
        // Constant over the chunk but for fp4, whose blocks are looked up per word below.
        let mut s = scale_at(scales, soff, row, k0, spr, fmt, group);
        #[unroll]
        for w in 0..comptime!(words_per_chunk(fmt)) {
            if comptime!(fmt == 3) {
                s = scale_at(scales, soff, row, k0 + w * cpw, spr, fmt, group);
            }
            word_dots(
                x,
                xoffs,
                xs,
                lut,
                words[base + w],
                s,
                k0,
                w,
                parts,
                count,
                fmt,
                chunks,
                staged,
            );
        }
    } else {
        for j in 0..depth {
            let w = weight_at(
                words,
                scales,
                lut,
                woff,
                soff,
                row,
                k0 + j,
                wpr,
                spr,
                fmt,
                group,
            );
            fma_rows(x, xoffs, xs, w, k0, j, parts, count, chunks, staged);
        }
    }
}

/// The fused multiply-adds of packed word `w` of a whole chunk (inputs `k0 + w * codes .. +codes`):
/// each code decoded ([`word_code_value`](fn@word_code_value) after [`code_flip`](fn@code_flip)), times
/// the scale `s`, then one fused multiply-add into `parts[p]` for each of the `count` input rows (as
/// [`input_at`](fn@input_at) reads them), codes in order. The one place that arithmetic is written:
/// every whole-chunk sum, from a word just loaded or one held in registers, runs it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn word_dots<X: Float>(
    x: &[X],
    xoffs: &Array<u32>,
    xs: &Shared<[f32]>,
    lut: &[f32],
    packed: u32,
    s: f32,
    k0: usize,
    w: usize,
    parts: &mut Array<f32>,
    #[comptime] count: usize,
    #[comptime] fmt: u32,
    #[comptime] chunks: usize,
    #[comptime] staged: bool,
) {
    let cpw = comptime!(codes_per_word(fmt));
    let word = packed ^ code_flip(fmt);
    #[unroll]
    for j in 0..cpw {
        let v = word_code_value(word, j as u32, lut, fmt) * s;
        fma_rows(
            x,
            xoffs,
            xs,
            v,
            k0,
            w * cpw + j,
            parts,
            count,
            chunks,
            staged,
        );
    }
}

/// Weight `v` of input `k0 + j` into each of the `count` input rows' sums: `parts[p] = fma(x_p, v,
/// parts[p])`, `x_p` as [`input_at`](fn@input_at) reads row `p` (from `xoffs[p]`, or staged at
/// `p * staged_row_floats(chunks)`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn fma_rows<X: Float>(
    x: &[X],
    xoffs: &Array<u32>,
    xs: &Shared<[f32]>,
    v: f32,
    k0: usize,
    j: usize,
    parts: &mut Array<f32>,
    #[comptime] count: usize,
    #[comptime] chunks: usize,
    #[comptime] staged: bool,
) {
    let row_floats = comptime!(staged_row_floats(chunks));
    #[unroll]
    for p in 0..count {
        let xv = input_at(
            x,
            xoffs[p] as usize,
            xs,
            p * row_floats,
            k0,
            j,
            chunks,
            staged,
        );
        parts[p] = fma(xv, v, parts[p]);
    }
}

/// Inputs in chunk `c` of a sum over `len` inputs: 32, or what the last chunk has left.
#[cube]
pub fn chunk_depth(c: usize, len: usize) -> usize {
    let mut depth = 32usize;
    if c * 32 + 32 > len {
        depth = len - c * 32;
    }
    depth
}

/// Inputs of 16-deep stage `st` (0 or 1) of a chunk of `depth` inputs.
#[cube]
pub fn stage_depth(depth: usize, st: usize) -> usize {
    let mut kd = 0usize;
    if depth > st * 16 {
        kd = depth - st * 16;
        if kd > 16 {
            kd = 16;
        }
    }
    kd
}

/// The canonical total of a row's chunk sums `sums[at..at + chunks]`: added left to right from 0.0.
#[cube]
pub fn sum_chunks(sums: &Shared<[f32]>, at: usize, #[comptime] chunks: usize) -> f32 {
    let mut total = 0.0f32;
    for c in 0..chunks {
        total += sums[at + c];
    }
    total
}

/// Copies `x[xoff..xoff + inn]` into shared memory transposed by chunk: input `32 c + j` goes to
/// `xs[xs_at + j * (chunks + 1) + c]` (zeros past `inn`). The GEMVs' lanes each walk one chunk, so at a given depth
/// `j` they read `chunks` neighbouring floats (no bank conflicts) instead of floats 128 bytes apart in
/// global memory (one cache line per lane per load). `unit` of `units` threads of the cube take part; the
/// caller syncs the cube before reading. A unit's loads go out in batches of up to
/// [`STAGE_LOAD_BATCH`] before any of them is stored, their bounds as selects, so their latencies overlap
/// (with a branch per input each load waited for the store before it).
#[cube]
pub fn stage_transposed<X: Float>(
    x: &[X],
    xoff: usize,
    inn: usize,
    xs: &mut Shared<[f32]>,
    xs_at: usize,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] chunks: usize,
) {
    let total = comptime!(chunks * 32);
    let steps = comptime!(total.div_ceil(units));
    let batch = comptime!(steps.min(STAGE_LOAD_BATCH));
    #[unroll]
    for b in 0..comptime!(steps.div_ceil(batch)) {
        let mut held = Array::<X>::new(batch);
        #[unroll]
        for i in 0..batch {
            let k = unit + (b * batch + i) * units;
            held[i] = x[select(k < inn, xoff + k, xoff)];
        }
        #[unroll]
        for i in 0..batch {
            let k = unit + (b * batch + i) * units;
            if k < total {
                xs[xs_at + (k % 32) * (chunks + 1) + k / 32] =
                    select(k < inn, f32::cast_from(held[i]), 0.0f32);
            }
        }
    }
}

/// Most loads [`stage_transposed`](fn@stage_transposed) keeps in flight per unit (registers per unit it holds
/// for them).
pub const STAGE_LOAD_BATCH: usize = 8;
