//! Quantization formats (QARL.md section 3), packing, and the quantized linear layer.
//!
//! The host-side formats are pure Rust and bit-exact with `tests/fixtures/quant/make_quant_reference.py`:
//! [`QuantScheme`] names a format, [`QuantizedTensor`] holds one quantized weight (packed codes + f32 scales)
//! and its reference matmuls, [`e4m3`] is the FP8 E4M3 codec, [`packing`] the int4 byte / u32 layouts.

pub mod e4m3;
pub mod error;
pub mod fp8;
pub mod int;
pub mod packing;
pub mod scheme;
pub mod tensor;

pub use e4m3::{e4m3_to_f32, f32_to_e4m3};
pub use error::QuantError;
pub use fp8::Fp8Activations;
pub use scheme::{QuantScheme, SchemeKind};
pub use tensor::QuantizedTensor;
pub mod cpu_attention;
pub mod cpu_kernel;
pub mod cpu_moe;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
pub mod linear;
pub mod moe;

pub use linear::QuantizedWeight;
pub mod select;

pub use select::QuantConfig;
pub mod checkpoint;

pub use checkpoint::{quantize_checkpoint, QuantizeSummary};
