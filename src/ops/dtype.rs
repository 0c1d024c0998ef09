//! Tensor types at the ops' boundary: the custom ops compute in f32; half-precision activations
//! ([`crate::model::Activations`]) are read as f32 (exactly) and results rounded once to their type.

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions};

/// `x` as a tensor of `dtype` (itself when it already is one): casts record a gradient node, so a tensor
/// keeps its graph unchanged when no conversion is needed.
pub fn as_dtype<const D: usize>(x: Tensor<D>, dtype: DType) -> Tensor<D> {
    if x.dtype() == dtype {
        x
    } else {
        x.cast(dtype)
    }
}

/// Whether `dtype` is a half-precision float (bf16, f16).
pub fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `x` as f32 (exact for half types).
pub fn f32_of<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    as_dtype(x, DType::F32)
}

/// Runs `op` on `x` read as f32 (exact for half types) and rounds its result once back to `x`'s type:
/// an f32 island in a mixed-precision forward.
pub fn in_f32<const D: usize, const E: usize>(
    x: Tensor<D>,
    op: impl FnOnce(Tensor<D>) -> Tensor<E>,
) -> Tensor<E> {
    let dtype = x.dtype();
    as_dtype(op(f32_of(x)), dtype)
}

/// Zeros of `shape` and type `dtype` on `device` (a cache buffer in the activations' type).
pub fn zeros_of<const D: usize>(shape: [usize; D], device: &Device, dtype: DType) -> Tensor<D> {
    Tensor::zeros(
        shape,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}
