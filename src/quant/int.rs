//! The symmetric integer grids (int4 per group, int8 per row), exactly as docs/formats.md states them.
//!
//! Every step is one IEEE f32 operation so that any implementation (this host code, a burn graph, a GPU
//! kernel, the numpy reference) gets the same bits: `s = absmax / qmax` is an f32 division, the code is
//! `clamp(round_ties_even(w / s), lo, hi)` with `w / s` an f32 division (not `w * (1/s)`, which rounds
//! differently), and an all-zero group (`s == 0`) gives code 0 instead of 0/0.

/// Largest int4 magnitude used for the scale (`s = absmax / 7`); codes are clamped to [-8, 7].
pub const INT4_QMAX: f32 = 7.0;
/// Smallest int4 code.
pub const INT4_MIN: i8 = -8;
/// Largest int4 code.
pub const INT4_MAX: i8 = 7;
/// Largest int8 magnitude (`s = absmax / 127`); codes are clamped to [-127, 127], -128 is never produced.
pub const INT8_QMAX: f32 = 127.0;

/// `max |v|` over a slice (0 for an empty one). Inputs are checked finite before this is called.
pub fn absmax(values: &[f32]) -> f32 {
    values.iter().fold(0.0f32, |acc, v| acc.max(v.abs()))
}

/// The symmetric scale `absmax / qmax`, an f32 division.
pub fn symmetric_scale(absmax: f32, qmax: f32) -> f32 {
    absmax / qmax
}

/// `clamp(round_ties_even(w / s), lo, hi)`, or 0 when `s == 0`.
pub fn quantize_to_int(w: f32, s: f32, lo: i8, hi: i8) -> i8 {
    if s == 0.0 {
        0
    } else {
        round_ties_even(w / s).clamp(lo as f32, hi as f32) as i8
    }
}

/// `v.round_ties_even()`, computed inline: `(|v| + 2^23) - 2^23` rounds to an integer, ties to even,
/// exactly for `|v| < 2^23` (from 2^23 on every f32 is an integer), with `v`'s sign put back.
/// `f32::round_ties_even` is a call to libm's `rintf` on baseline x86-64 (no SSE4.1 `roundps`), which took
/// 40% of quantizing a model; this form inlines and vectorizes.
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
