//! CubeCL low-bit matmul kernels for qarl: int4 (`int4-g32/64/128`), int8 (`int8-pc`) and fp8
//! (`fp8-b128`, W8A8) weights with f32, f16 or bf16 activations ([`ActDType`]; sums in f32, results
//! rounded once), written once with CubeCL and launched on whatever
//! runtime the device gives (CUDA, wgpu, the CPU runtime).
//!
//! - [`format`]: the formats and the kernel layout ([`PackedWeights`], repacked once per weight version
//!   from qarl's storage).
//! - [`kernels`]: dequantize, GEMV, tiled GEMM, the transposed product of the straight-through backward,
//!   fp8 activation quantization, and the grouped MoE matmul (gate+up fused with SwiGLU, down, combine).
//! - [`Kernels`]: the host launchers on device buffers.
//! - [`reference`]: host references in the kernels' canonical summation order.
//!
//! Every matmul sums in one canonical order, so GEMV and GEMM give the same bits for a token whatever
//! batch it is in: rollout (decode) and the training forward (many tokens) agree bitwise on one device.

pub mod context;
pub mod dtype;
pub mod error;
pub mod format;
pub mod kernels;
pub mod moe;
pub mod reference;

pub use context::{DeviceBuffer, DeviceWeights, Kernels, MatmulPath};
pub use dtype::ActDType;
pub use error::KernelError;
pub use format::{PackedWeights, WeightFormat};
pub use moe::MoeRouting;
