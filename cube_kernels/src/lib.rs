//! CubeCL low-bit matmul kernels for qarl: int4 (`int4-g32/64/128`), int8 (`int8-pc`), fp8
//! (`fp8-b128`, W8A8) and fp4 (`nvfp4`, `mxfp4`: E2M1 codes) weights with f32, f16 or bf16 activations
//! ([`ActDType`]; sums in f32, results rounded once), written once with CubeCL and launched on whatever
//! runtime the device gives (CUDA, wgpu, the CPU runtime).
//!
//! - [`format`](mod@format) and [`e4m3`]: the formats, described once (code widths and values, scale grids,
//!   the storage and kernel layouts, [`PackedWeights`]) and the E4M3 codec. They need no CubeCL and are
//!   always compiled: qarl's quantizer and CPU kernels use them too, without the GPU stack.
//! - [`kernels`]: dequantize, GEMV, tiled GEMM, the transposed product of the straight-through backward,
//!   fp8 activation quantization, and the grouped MoE matmul (gate+up fused with SwiGLU, down, combine).
//! - [`Kernels`]: the host launchers on device buffers.
//! - [`reference`](mod@reference): host references in the kernels' canonical summation order.
//!
//! Every matmul sums in one canonical order, so GEMV and GEMM give the same bits for a token whatever
//! batch it is in: rollout (decode) and the training forward (many tokens) agree bitwise on one device.
//!
//! Features: `wgpu` (default) and `cuda` pick a runtime and turn on `kernels` (CubeCL, the kernels, their
//! launchers and references); without any of them only [`format`](mod@format), [`e4m3`] and [`KernelError`]
//! remain.

#[cfg(feature = "kernels")]
pub mod buffer;
#[cfg(feature = "kernels")]
pub mod context;
#[cfg(feature = "kernels")]
pub mod dtype;
pub mod e4m3;
pub mod error;
pub mod format;
#[cfg(feature = "kernels")]
pub mod kernels;
#[cfg(feature = "kernels")]
pub mod moe;
#[cfg(feature = "cuda")]
pub mod ptx;
#[cfg(feature = "kernels")]
pub mod reference;

#[cfg(feature = "kernels")]
pub use context::{
    DeviceBuffer, DeviceWeights, FragmentCall, FragmentShape, Kernels, MatmulPath, Recorded,
};
#[cfg(feature = "kernels")]
pub use dtype::ActDType;
pub use error::KernelError;
pub use format::{PackedWeights, WeightFormat};
#[cfg(feature = "kernels")]
pub use moe::{MoeRouting, RoutingTable, TableLayout};
