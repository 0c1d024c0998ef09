//! The CubeCL backends (wgpu, CUDA) of the custom ops, through the `cube_kernels` crate ([`launch`]).

mod exact;
mod launch;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::TensorMetadata;

use super::{
    backend_mean_last, backend_softmax, dequantized_out_in, deterministic, plain_matmul,
    ExpertWeights, KernelOps, PackedWeight,
};

/// The CubeCL backends (wgpu, CUDA): the `cube_kernels` low-bit kernels on the tensors' device buffers
/// ([`launch`]) for f32 activations, and f16/bf16 where the device has them (f32 sums, one rounding
/// to the activations' dtype); other dtypes take the default (dequantize, then the backend's matmul).
/// In deterministic mode the f32 matmul, softmax and RMSNorm mean are the fixed-order kernels
/// ([`exact`]), so the whole forward is batch-invariant; otherwise burn's own (faster) kernels.
impl KernelOps for burn_cubecl::CubeBackend {
    fn det_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
    ) -> FloatTensor<Self> {
        if deterministic() {
            if let Some(y) = exact::matmul(x.clone(), w.clone(), w_transposed) {
                return y;
            }
        }
        plain_matmul::<Self>(x, w, w_transposed)
    }

    fn aligned_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        if deterministic() {
            if let Some(y) = exact::softmax(x.clone(), dim) {
                return y;
            }
        }
        backend_softmax::<Self>(x, dim)
    }

    fn aligned_mean_last(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if deterministic() {
            if let Some(y) = exact::mean_last(x.clone()) {
                return y;
            }
        }
        backend_mean_last::<Self>(x)
    }

    fn quant_matmul(
        x: FloatTensor<Self>,
        master: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        let _ = master;
        launch::quant_matmul(x.clone(), &packed).unwrap_or_else(|| {
            let w = dequantized_out_in::<Self>(&packed, &x.device());
            plain_matmul::<Self>(x, w, true)
        })
    }

    fn quant_matmul_transposed(g: FloatTensor<Self>, packed: PackedWeight) -> FloatTensor<Self> {
        launch::quant_matmul_transposed(g.clone(), &packed).unwrap_or_else(|| {
            let w = dequantized_out_in::<Self>(&packed, &g.device());
            plain_matmul::<Self>(g, w, false)
        })
    }

    fn grouped_moe(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        experts: ExpertWeights,
    ) -> Option<FloatTensor<Self>> {
        launch::grouped_moe(x, route_w, ids, &experts)
    }

    fn quant_matmul_takes_half(x: &FloatTensor<Self>) -> bool {
        launch::takes_half(x)
    }

    fn grouped_moe_trains(x: &FloatTensor<Self>) -> bool {
        launch::grouped_moe_trains(x)
    }

    fn grouped_moe_for_training(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        experts: ExpertWeights,
    ) -> Option<(
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    )> {
        launch::grouped_moe_for_training(x, route_w, ids, &experts)
    }

    fn grouped_moe_backward(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        grad: FloatTensor<Self>,
        experts: ExpertWeights,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        swiglu: FloatTensor<Self>,
        expert_out: FloatTensor<Self>,
    ) -> Option<(
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    )> {
        let saved = [gate, up, swiglu, expert_out];
        launch::grouped_moe_backward(x, route_w, ids, grad, &experts, saved)
    }
}
