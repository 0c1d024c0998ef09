//! FP8 activation quantization (W8A8): per token per 128 inputs, `s = absmax / 448`, code = E4M3 of
//! `x / s` (round to nearest even, saturating), and the dequantized value `e4m3(code) * s` the matmul reads.

use cubecl::prelude::*;

/// The E4M3 code of `v` by the bit operations of qarl's `f32_to_e4m3` (inputs are finite).
#[cube]
pub fn e4m3_code(v: f32) -> u32 {
    let bits = u32::reinterpret(v);
    let sign = (bits >> 24u32) & 128u32;
    let mag_bits = bits & 0x7FFF_FFFFu32;
    let mag = f32::reinterpret(mag_bits);
    let mut code = 0x7Eu32;
    if mag < 448.0f32 {
        if mag < 0.015625f32 {
            // m * 512 is exact and below 8; adding 2^23 rounds it to an integer, ties to even.
            let shifted = mag * 512.0f32 + 8388608.0f32;
            code = u32::reinterpret(shifted) - 0x4B00_0000u32;
        } else {
            let rebiased = mag_bits - (120u32 << 23u32);
            let lsb = (rebiased >> 20u32) & 1u32;
            code = (rebiased + 0x7FFFFu32 + lsb) >> 20u32;
            if code > 0x7Eu32 {
                code = 0x7Eu32;
            }
        }
    }
    sign | code
}

/// One unit per (token, 128-column block): writes the block scale to `xs` and the dequantized values to
/// `xq`, both f32; `x` is read in its own type `F` and widened to f32 first.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn quantize_activations<F: Float>(
    x: &[F],
    lut: &[f32],
    xq: &mut [f32],
    xs: &mut [f32],
    rows: usize,
    cols: usize,
    blocks: usize,
    #[define(F)] _dtype: ElemType,
) {
    let id = ABSOLUTE_POS;
    if id < rows * blocks {
        let r = id / blocks;
        let start = (id % blocks) * 128;
        let mut end = start + 128;
        if end > cols {
            end = cols;
        }
        let mut m = 0.0f32;
        for k in start..end {
            let a = f32::cast_from(x[r * cols + k]).abs();
            if a > m {
                m = a;
            }
        }
        let s = m / 448.0f32;
        xs[id] = s;
        for k in start..end {
            let mut code = 0u32;
            if s != 0.0f32 {
                code = e4m3_code(f32::cast_from(x[r * cols + k]) / s);
            }
            xq[r * cols + k] = lut[code as usize] * s;
        }
    }
}
