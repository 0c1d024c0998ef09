//! The symmetric integer grids (int4 per group, int8 per row), exactly as docs/formats.md states them.
//!
//! Every step is one IEEE f32 operation so that any implementation (this host code, a burn graph, a GPU
//! kernel, the numpy reference) gets the same bits: `s = absmax / qmax` is an f32 division, the code is
//! `clamp(round_ties_even(w / s), lo, hi)` with `w / s` an f32 division (not `w * (1/s)`, which rounds
//! differently), and an all-zero group (`s == 0`) gives code 0 instead of 0/0.
//!
//! The grids themselves (code ranges, scale divisors) and the rounding are part of the format description
//! shared with the kernels, `cube_kernels::format`; they are re-exported here.

pub use cube_kernels::format::{
    round_ties_even, INT4_MAX, INT4_MIN, INT4_QMAX, INT8_MAX, INT8_QMAX,
};

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
