//! FP4 weights (`nvfp4`, `mxfp4`): E2M1 codes with block scales along the input axis, W4A16.
//!
//! E2M1 (`s e e m`, bias 1) holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign. Encoding ([`f32_to_e2m1`]) is one
//! round-to-nearest on that grid, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
//! 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at +-6, the sign kept (a negative value that rounds to zero is
//! code 8, -0.0, as the E4M3 codec does).
//!
//! - `nvfp4`: a tensor scale `s_t = amax(W) / 2688` (6 * 448, an f32 division; per weight matrix, so per
//!   expert in a MoE), and per block of 16 inputs of a row an E4M3 block scale
//!   `s_b = e4m3(amax(block) / 6 / s_t)` (two f32 divisions, round to nearest even, saturating at 448).
//!   The code is `e2m1(w / (s_b * s_t))`, the product in f32 and an f32 division.
//! - `mxfp4` (OCP Microscaling v1.0): per block of 32 inputs of a row an E8M0 scale
//!   `X = 2^(floor(log2(amax(block))) - 2)`, the exponent clamped to [-127, 127]; the code is `e2m1(w / X)`.
//!
//! A block whose amax or effective scale is 0 gives codes 0 (not -0.0): all-zero blocks, `s_t == 0`, and
//! an E4M3 block scale that rounds to 0 (mxfp4's zero block keeps `X = 2^-127`). Blocks at the right edge
//! are shorter and use the same rule over the inputs they have.
//!
//! **What is stored.** The codes as int4's byte storage (two per byte, low nibble = even column, an odd row
//! ends with a zero high nibble). The f32 scale of a block is the factor its codes' values are multiplied by:
//! `s_b * s_t` for nvfp4 (their f32 product, exactly what dequantization multiplies by) and `X` for mxfp4
//! (a power of two, exact in f32, 2^-127 a subnormal). So the dequantized weight is
//! `E2M1_VALUES[code] * scale`, one f32 multiply, as for every other format, and a checkpoint holds one
//! scale tensor. The nvfp4 factors themselves (the tensor scale and the E4M3 block codes a hardware NVFP4
//! layout stores) come from [`nvfp4_scales`].

use rayon::prelude::*;

use super::e4m3::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use super::int::absmax;
use super::scheme::SchemeKind;

pub use cube_kernels::format::{E2M1_MAX, E2M1_VALUES, MXFP4_BLOCK, NVFP4_BLOCK};

/// `6 * 448`: the nvfp4 tensor scale's divisor (the largest E2M1 value times the largest E4M3 value).
pub const NVFP4_TENSOR_DIVISOR: f32 = E2M1_MAX * E4M3_MAX;

/// Smallest and largest exponent of an mxfp4 (E8M0) scale.
pub const MXFP4_MIN_EXP: i32 = -127;
pub const MXFP4_MAX_EXP: i32 = 127;

/// The E2M1 code of `v` (module docs): nearest grid value, ties to the even code, saturating at +-6 (an
/// infinity too), the sign kept. `v` is never NaN here (weights are checked finite, scales are non-zero).
pub fn f32_to_e2m1(v: f32) -> u8 {
    let a = v.abs();
    // The midpoints between neighbouring grid values; at a midpoint the even code wins (`<=` when the
    // lower code is even, `<` when the upper one is).
    let magnitude = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    magnitude | if v.is_sign_negative() { 8 } else { 0 }
}

/// The value of E2M1 code `code` (its low four bits).
pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1_VALUES[(code & 0xF) as usize]
}

/// `2^e` as an f32, exactly, for `e` in [-149, 127] (2^-127 is a subnormal).
pub fn pow2(e: i32) -> f32 {
    assert!((-149..=127).contains(&e), "2^{e} is not an f32");
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1 << (e + 149))
    }
}

/// The mxfp4 scale exponent of a block whose absolute maximum is `amax`:
/// `clamp(floor(log2(amax)) - 2, -127, 127)`, and -127 for `amax == 0`.
pub fn mxfp4_exponent(amax: f32) -> i32 {
    let biased = (amax.to_bits() >> 23) & 0xFF;
    // A zero or subnormal amax (below 2^-126) has floor(log2) <= -127: the clamp gives -127 either way.
    if biased == 0 {
        return MXFP4_MIN_EXP;
    }
    (biased as i32 - 127 - 2).clamp(MXFP4_MIN_EXP, MXFP4_MAX_EXP)
}

/// Whether `scale` is an mxfp4 (E8M0) scale: `2^e` for `e` in [-127, 127], exactly.
pub fn is_e8m0_scale(scale: f32) -> bool {
    let bits = scale.to_bits();
    let biased = bits >> 23; // the sign bit makes it > 255
    match biased {
        0 => bits == pow2(MXFP4_MIN_EXP).to_bits(),
        1..=254 => bits & 0x7F_FFFF == 0,
        _ => false,
    }
}

/// The nvfp4 factors of a row-major `[out, inn]` weight: the tensor scale `s_t` and the E4M3 codes of the
/// block scales `s_b`, row-major `[out, ceil(inn/16)]` (module docs). `s_t == 0` gives codes 0.
pub fn nvfp4_scales(weights: &[f32], out: usize, inn: usize) -> (f32, Vec<u8>) {
    let per_row = inn.div_ceil(NVFP4_BLOCK);
    let tensor = absmax(weights) / NVFP4_TENSOR_DIVISOR;
    let mut codes = vec![0u8; out * per_row];
    if inn == 0 || tensor == 0.0 {
        return (tensor, codes);
    }
    weights
        .par_chunks(inn)
        .zip(codes.par_chunks_mut(per_row))
        .with_min_len(64)
        .for_each(|(row, row_codes)| {
            for (block, code) in row.chunks(NVFP4_BLOCK).zip(row_codes) {
                *code = f32_to_e4m3(absmax(block) / E2M1_MAX / tensor);
            }
        });
    (tensor, codes)
}

/// Quantizes row-major finite weights `[out, inn]` to `format` (nvfp4 or mxfp4): the packed codes and the
/// f32 scales `[out, ceil(inn / block)]` (module docs).
pub(crate) fn quantize_fp4(
    weights: &[f32],
    out: usize,
    inn: usize,
    format: SchemeKind,
) -> (Vec<u8>, Vec<f32>) {
    let [_, per_row] = format.scale_grid(out, inn);
    let scales = match format {
        SchemeKind::Nvfp4 => {
            let (tensor, codes) = nvfp4_scales(weights, out, inn);
            codes.iter().map(|&c| e4m3_to_f32(c) * tensor).collect()
        }
        SchemeKind::Mxfp4 => {
            let mut scales = vec![0.0f32; out * per_row];
            for (row, row_scales) in weights
                .chunks(inn.max(1))
                .zip(scales.chunks_mut(per_row.max(1)))
            {
                for (block, s) in row.chunks(MXFP4_BLOCK).zip(row_scales) {
                    *s = pow2(mxfp4_exponent(absmax(block)));
                }
            }
            scales
        }
        _ => unreachable!("{} is not an fp4 format", format.name()),
    };
    let data = encode_rows(weights, out, inn, format, &scales);
    (data, scales)
}

/// The packed E2M1 codes of `weights` under per-block `scales`: `e2m1(w / s)`, or 0 for a block whose amax
/// or scale is 0.
fn encode_rows(
    weights: &[f32],
    out: usize,
    inn: usize,
    format: SchemeKind,
    scales: &[f32],
) -> Vec<u8> {
    let row_bytes = format.row_bytes(inn);
    let mut data = vec![0u8; out * row_bytes];
    let [_, per_row] = format.scale_grid(out, inn);
    let Some(block) = format.scale_block().inputs else {
        unreachable!("fp4 blocks run along the inputs")
    };
    if inn == 0 {
        return data;
    }
    // Rows are independent: in parallel (a weight sync re-quantizes the whole model every RL step).
    weights
        .par_chunks(inn)
        .zip(data.par_chunks_mut(row_bytes))
        .zip(scales.par_chunks(per_row))
        .with_min_len(64)
        .for_each(|((src, dst), row_scales)| {
            for ((b, values), &s) in src.chunks(block).enumerate().zip(row_scales) {
                if s == 0.0 || absmax(values) == 0.0 {
                    continue;
                }
                for (offset, &w) in values.iter().enumerate() {
                    let col = b * block + offset;
                    dst[col / 2] |= f32_to_e2m1(w / s) << (4 * (col % 2));
                }
            }
        });
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_rounds_ties_to_even_and_saturates() {
        let cases = [
            (0.0, 0),
            (0.25, 0),
            (0.2500001, 1),
            (0.75, 2),
            (0.7499999, 1),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.0000005, 7),
            (6.0, 7),
            (1e30, 7),
            (f32::INFINITY, 7),
            (-0.1, 8),
            (-1.25, 10),
            (-7.0, 15),
        ];
        for (v, code) in cases {
            assert_eq!(f32_to_e2m1(v), code, "{v}");
        }
        for code in 0..16u8 {
            assert_eq!(
                f32_to_e2m1(e2m1_to_f32(code)),
                code,
                "code {code} round-trips"
            );
        }
    }

    #[test]
    fn mxfp4_exponents_and_powers_of_two() {
        assert_eq!(mxfp4_exponent(0.0), -127);
        assert_eq!(mxfp4_exponent(1.0), -2);
        assert_eq!(mxfp4_exponent(7.99), 0);
        assert_eq!(mxfp4_exponent(8.0), 1);
        assert_eq!(mxfp4_exponent(f32::MAX), 125);
        assert_eq!(mxfp4_exponent(f32::from_bits(1)), -127);
        assert_eq!(pow2(-127), 2f64.powi(-127) as f32);
        assert_eq!(pow2(-127).to_bits(), 1 << 22);
        assert_eq!(pow2(5), 32.0);
    }
}
