//! Quantization formats ([`docs/formats.md`](../../docs/formats.md)): quantize, pack, dequantize. Pure host
//! code with no tensor or backend in it, bit-exact with `tests/fixtures/quant/make_quant_reference.py`.
//!
//! [`QuantScheme`] names a format, [`QuantizedTensor`] holds one quantized weight (packed codes + f32 scales)
//! and its reference matmuls, [`e4m3`] is the FP8 E4M3 codec, [`packing`] the int4 byte / u32 layouts and
//! [`select`] which layers of a model are quantized. What a format *is* (code width and values, scale grid,
//! row bytes and words, the E4M3 codec, the fp8 block) is described once in `cube_kernels::format` and
//! `cube_kernels::e4m3`, cubecl-free host code always compiled, and re-exported here ([`SchemeKind`],
//! [`e4m3`], [`scheme::FP8_BLOCK`]): the quantizer, the CPU kernels and the CubeCL path read one description. The kernels that read these formats live in
//! [`crate::ops`]; quantizing a whole model or checkpoint lives in [`crate::model`].

pub mod e4m3;
pub mod error;
pub mod fp4;
pub mod fp8;
pub mod int;
pub mod packing;
pub mod precision;
pub mod scheme;
pub mod select;
pub mod tensor;

pub use e4m3::{e4m3_to_f32, f32_to_e4m3};
pub use error::QuantError;
pub use fp8::Fp8Activations;
pub use precision::Precision;
pub use scheme::{QuantScheme, SchemeKind};
pub use select::QuantConfig;
pub use tensor::QuantizedTensor;
