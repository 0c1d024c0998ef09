//! The fixed-order f32 ops on burn's CubeCL backend ([`cube_kernels::Kernels::matmul_f32`],
//! [`cube_kernels::Kernels::softmax_rows_f32`], [`cube_kernels::Kernels::mean_rows_f32`]) on the tensors'
//! device buffers: in deterministic mode the f32 matmuls, the softmax and the RMSNorm mean of the forward
//! run these instead of burn's shape-dependent kernels, so the training forward over whole sequences gives
//! the bits the rollout's decode computed one token at a time. Each returns `None` for what the kernels do
//! not take (a dtype other than f32, broadcast leading dims, an axis other than the last): the caller then
//! runs burn's op.

use burn::backend::TensorMetadata;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cube_kernels::{ActDType, DeviceBuffer};

use super::launch::kernels_for;

/// A contiguous f32 copy (or view) of `t` and its buffer of `len` values.
fn f32_buffer(t: CubeTensor) -> Option<(CubeTensor, DeviceBuffer)> {
    if t.dtype != DType::F32 {
        return None;
    }
    let t = burn_cubecl::kernel::into_contiguous(t);
    let len = t.shape().num_elements();
    let b = DeviceBuffer::from_handle_typed(t.handle.clone(), len, ActDType::F32);
    Some((t, b))
}

fn wrap(like: &CubeTensor, y: DeviceBuffer, dims: Vec<usize>) -> CubeTensor {
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims),
        y.handle().clone(),
        DType::F32,
    )
}

/// `x [.., m, k] · w [.., k, n]` (`w [.., n, k]` used transposed with `w_transposed`), equal leading dims,
/// every output summed in `k` order.
pub(crate) fn matmul(x: CubeTensor, w: CubeTensor, w_transposed: bool) -> Option<CubeTensor> {
    let (xs, ws) = (x.shape().to_vec(), w.shape().to_vec());
    let r = xs.len();
    if r < 2 || ws.len() != r || xs[..r - 2] != ws[..r - 2] {
        return None;
    }
    let (m, k) = (xs[r - 2], xs[r - 1]);
    let (wk, n) = if w_transposed {
        (ws[r - 1], ws[r - 2])
    } else {
        (ws[r - 2], ws[r - 1])
    };
    if wk != k {
        return None;
    }
    let batches: usize = xs[..r - 2].iter().product();
    let kernels = kernels_for(&x);
    let (x, xb) = f32_buffer(x)?;
    let (_w, wb) = f32_buffer(w)?;
    let y = kernels
        .matmul_f32(&xb, &wb, batches, m, k, n, w_transposed)
        .ok()?;
    let mut dims = xs[..r - 2].to_vec();
    dims.extend([m, n]);
    Some(wrap(&x, y, dims))
}

/// The softmax of `x` along its last axis (`dim` must be it), maximum and sum in index order per row.
pub(crate) fn softmax(x: CubeTensor, dim: usize) -> Option<CubeTensor> {
    let dims = x.shape().to_vec();
    if dim + 1 != dims.len() || dims[dim] == 0 {
        return None;
    }
    let len = dims[dim];
    let rows = dims.iter().product::<usize>() / len;
    let kernels = kernels_for(&x);
    let (x, xb) = f32_buffer(x)?;
    let y = kernels.softmax_rows_f32(&xb, rows, len).ok()?;
    Some(wrap(&x, y, dims))
}

/// The mean of `x` along its last axis, kept as an axis of 1 (burn's `mean_dim`), summed in index order.
pub(crate) fn mean_last(x: CubeTensor) -> Option<CubeTensor> {
    let mut dims = x.shape().to_vec();
    let len = *dims.last()?;
    if len == 0 {
        return None;
    }
    let rows = dims.iter().product::<usize>() / len;
    let kernels = kernels_for(&x);
    let (x, xb) = f32_buffer(x)?;
    let y = kernels.mean_rows_f32(&xb, rows, len).ok()?;
    *dims.last_mut()? = 1;
    Some(wrap(&x, y, dims))
}
