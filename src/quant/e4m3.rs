//! FP8 E4M3 ("e4m3fn") encoding and decoding, exactly: the one codec of qarl's quantizer, its CPU kernels
//! and the CubeCL path, defined in `cube_kernels::e4m3` (cubecl-free host code, always compiled) and
//! re-exported here. Layout, rounding and saturation rules: that module's docs and docs/formats.md.

pub use cube_kernels::e4m3::{
    e4m3_is_nan, e4m3_table, e4m3_to_f32, f32_to_e4m3, E4M3_MAX, E4M3_NAN,
};
