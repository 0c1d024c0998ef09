//! The CubeCL backends (wgpu, CUDA) of the custom ops, through the `cube_kernels` crate ([`launch`]).

mod launch;

use burn::backend::tensor::FloatTensor;
use burn::backend::TensorMetadata;

use super::{dequantized_out_in, plain_matmul, ExpertWeights, KernelOps, PackedWeight};

/// The CubeCL backends (wgpu, CUDA): the `cube_kernels` low-bit kernels on the tensors' device buffers
/// ([`launch`]) for f32 activations, and f16/bf16 where the device has them (f32 sums, one rounding
/// to the activations' dtype); other dtypes take the default (dequantize, then the backend's matmul).
impl KernelOps for burn_cubecl::CubeBackend {
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
        ids: Vec<u32>,
        experts: ExpertWeights,
    ) -> Option<FloatTensor<Self>> {
        launch::grouped_moe(x, route_w, &ids, &experts)
    }
}
