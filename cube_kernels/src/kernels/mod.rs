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
//! Weight formats are compile-time parameters (`fmt`: 0 = int4, 1 = int8, 2 = fp8; `group`: the int4 group
//! or the fp8 block), so each launched kernel is specialised and the decode is branch-free.

pub mod dense;
pub mod fp8;
pub mod moe;

use cubecl::prelude::*;

/// Inputs per chunk of the canonical order, and the K depth of a GEMM tile.
pub const CHUNK: usize = 32;
/// Rows and tokens per GEMM tile (the cube is `TILE x TILE` units, one output each).
pub const TILE: usize = 16;

/// The dequantized weight of row `row`, input `k` of the matrix starting at word `woff` / scale `soff`:
/// `q as f32 * s` (fp8: `e4m3(code) * s` through the decode table `lut`), one f32 multiply, as the host
/// reference computes it.
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
    if comptime!(fmt == 0) {
        let word = words[woff + row * wpr + k / 8];
        let nib = (word >> (((k % 8) * 4) as u32)) & 15u32;
        let q = i32::cast_from(nib) - i32::cast_from((nib >> 3u32) << 4u32);
        f32::cast_from(q) * scales[soff + row * spr + k / group]
    } else if comptime!(fmt == 1) {
        let word = words[woff + row * wpr + k / 4];
        let byte = (word >> (((k % 4) * 8) as u32)) & 255u32;
        let q = i32::cast_from(byte) - i32::cast_from((byte >> 7u32) << 8u32);
        f32::cast_from(q) * scales[soff + row]
    } else {
        let word = words[woff + row * wpr + k / 4];
        let byte = (word >> (((k % 4) * 8) as u32)) & 255u32;
        lut[byte as usize] * scales[soff + (row / group) * spr + k / group]
    }
}
