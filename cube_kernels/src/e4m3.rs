//! FP8 E4M3 ("e4m3fn", the OCP / NVIDIA / DeepSeek-V3 format) encoding and decoding, exactly: the one host
//! codec, used by qarl's quantizer (re-exported as `qarl::quant::e4m3`), qarl's CPU kernels and the host side
//! of the CubeCL kernels (their decode table, their references). The CubeCL fp8 activation kernel encodes
//! with the same bit operations on the device.
//!
//! Layout of a code: `s eeee mmm`, exponent bias 7. Exponent 0 is subnormal (`m * 2^-9`); exponents 1..=15
//! are normal (`(1 + m/8) * 2^(e-7)`). There is no infinity: `0x7F` / `0xFF` (all exponent and mantissa
//! bits set) are NaN, so the largest finite magnitude is `0x7E` = 448. Both zeros exist (`0x00`, `0x80`).
//!
//! Encoding is a single rounding of the f32 value: round to nearest, ties to even (the even code; adjacent
//! E4M3 values differ by one in their code, so exactly one of the two is even), saturating: every magnitude
//! at or above 448, infinity included, becomes +-448 (no value becomes NaN). The sign is kept, also for
//! values that round to zero (`-1e-9` gives `0x80`), as `torch.float8_e4m3fn` does. NaN encodes to `0x7F`.

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The canonical NaN code (`0xFF` is NaN too).
pub const E4M3_NAN: u8 = 0x7F;

/// Code of +448, the saturation target.
const E4M3_MAX_CODE: u8 = 0x7E;

/// Smallest normal E4M3 magnitude, 2^-6; below it the grid is uniform with step 2^-9.
const E4M3_MIN_NORMAL: f32 = 1.0 / 64.0;

/// Encodes `value` as E4M3 with round-to-nearest-even and saturation at +-448 (see the module docs).
pub fn f32_to_e4m3(value: f32) -> u8 {
    if value.is_nan() {
        return E4M3_NAN;
    }
    let sign = if value.is_sign_negative() { 0x80 } else { 0x00 };
    let magnitude = value.abs();
    let code = if magnitude >= E4M3_MAX {
        E4M3_MAX_CODE
    } else if magnitude < E4M3_MIN_NORMAL {
        // Subnormal range: the grid is m * 2^-9, m = 0..=8 (m = 8 is code 0x08 = 2^-6, the smallest normal,
        // so the code is m itself). Multiplying by 512 is exact, so this is a single rounding.
        round_ties_even(magnitude * 512.0) as u8
    } else {
        // Normal range: re-bias the f32 exponent (127 -> 7) in place, then round the 23-bit mantissa to 3
        // bits, ties to even; a carry out of the mantissa correctly bumps the exponent.
        let rebiased = magnitude.to_bits() - (120 << 23);
        let lsb = (rebiased >> 20) & 1;
        let rounded = (rebiased + 0x7_FFFF + lsb) >> 20;
        rounded.min(E4M3_MAX_CODE as u32) as u8
    };
    sign | code
}

/// Decodes an E4M3 code exactly (every E4M3 value is an f32). `0x7F` and `0xFF` decode to NaN.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let exponent = (code >> 3) & 0x0F;
    let mantissa = code & 0x07;
    let magnitude = if exponent == 0x0F && mantissa == 0x07 {
        f32::NAN
    } else if exponent == 0 {
        mantissa as f32 / 512.0
    } else {
        f32::from_bits(((exponent as u32 + 120) << 23) | ((mantissa as u32) << 20))
    };
    if code & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Whether `code` is one of the two NaN codes.
pub fn e4m3_is_nan(code: u8) -> bool {
    code & 0x7F == E4M3_NAN
}

/// The 256-entry E4M3 decode table the CubeCL kernels read (a table is exact on every runtime; not every
/// runtime has a native fp8 conversion).
pub fn e4m3_table() -> Vec<f32> {
    (0..=255u8).map(e4m3_to_f32).collect()
}

/// `v.round_ties_even()`, computed inline: `(|v| + 2^23) - 2^23` rounds to an integer, ties to even,
/// exactly for `|v| < 2^23` (from 2^23 on every f32 is an integer), with `v`'s sign put back. The one
/// rounding of the integer grids and of E4M3's subnormal range. `f32::round_ties_even` is a call to libm's
/// `rintf` on baseline x86-64 (no SSE4.1 `roundps`), which took 40% of quantizing a model; this form
/// inlines and vectorizes.
#[inline(always)]
pub fn round_ties_even(v: f32) -> f32 {
    const TWO_23: f32 = 8_388_608.0;
    let a = v.abs();
    if a < TWO_23 {
        ((a + TWO_23) - TWO_23).copysign(v)
    } else {
        v
    }
}
