//! The quantized linear layer's arithmetic: one custom burn op used by rollout and by the training forward.
//!
//! Forward: the low-bit matmul on the packed weights ([`super::cpu_kernel`] on the CPU). Backward: the
//! straight-through estimator to the full-precision master weights, `dW = x^T g` (the quantizer treated as
//! the identity) and `dx = g · dequant(Q(W))` (the weights the forward really used). The packed weights are
//! made once per weight version ([`QuantizedWeight::from_master`]) and shared, never re-quantized per call.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, Flex};
use burn::tensor::{Tensor, TensorData};

use super::cpu_kernel::lowbit_matmul;
use super::{QuantError, QuantScheme, QuantizedTensor};
use crate::model::layers::{tensor_from_vec, to_f32_vec};

/// Packed weights of one weight version, shared between the rollout and the training forward.
#[derive(Debug, Clone)]
pub struct PackedWeight(pub Arc<QuantizedTensor>);

/// One quantized weight version: the packed codes the kernels read and, for the backward pass (and for
/// backends without a low-bit kernel yet), the same values dequantized, laid out like the master `[in, out]`.
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    pub packed: PackedWeight,
    /// `dequant(Q(W))` as `[in, out]`.
    pub dequantized: Tensor<2>,
}

impl QuantizedWeight {
    /// Quantizes a master weight stored `[in, out]` (the spec's groups run along `in` of each output row).
    pub fn from_master(master: Tensor<2>, scheme: QuantScheme) -> Result<Self, QuantError> {
        let device = master.device();
        let [inn, out] = master.dims();
        let w_out_in = to_f32_vec(master.transpose());
        let q = QuantizedTensor::quantize(&w_out_in, out, inn, scheme)?;
        Ok(Self::from_packed(q, &device))
    }

    /// Wraps already quantized weights (e.g. read from a quantized checkpoint).
    pub fn from_packed(q: QuantizedTensor, device: &burn::tensor::Device) -> Self {
        let [out, inn] = q.shape();
        let deq = tensor_from_vec(q.dequantize(), [out, inn], device).transpose();
        let dequantized = Tensor::from_data(deq.into_data(), device);
        Self {
            packed: PackedWeight(Arc::new(q)),
            dequantized,
        }
    }

    pub fn scheme(&self) -> QuantScheme {
        self.packed.0.scheme()
    }

    /// `x: [n, in] -> [n, out]` through the low-bit matmul; gradients flow to `master` (STE) and to `x`.
    pub fn matmul(&self, x: Tensor<2>, master: Tensor<2>) -> Tensor<2> {
        Tensor::from_dispatch(<Dispatch as QuantMatmulBackend>::quant_matmul(
            x.into_dispatch(),
            master.into_dispatch(),
            self.dequantized.clone().into_dispatch(),
            self.packed.clone(),
        ))
    }
}

/// The backend extension carrying the low-bit matmul. Backends without a dedicated kernel yet use the
/// default body (a float matmul on the dequantized weights: the same values, another summation order).
#[backend_extension(Autodiff, Flex)]
pub trait QuantMatmulBackend: Backend {
    /// `x [n, in] · W'` with `W' = dequant(Q(master))` given packed (`packed`) and dequantized `[in, out]`
    /// (`dequantized`); `master` only receives the straight-through gradient.
    fn quant_matmul(
        x: FloatTensor<Self>,
        master: FloatTensor<Self>,
        dequantized: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        let _ = (master, packed);
        Self::float_matmul(x, dequantized)
    }
}

impl QuantMatmulBackend for Flex {
    fn quant_matmul(
        x: FloatTensor<Self>,
        _master: FloatTensor<Self>,
        _dequantized: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        let x: FlexTensor = x.to_contiguous();
        let dims = x.layout().shape().to_vec();
        let (m, inn) = (dims[0], dims[1]);
        let w = &packed.0;
        assert_eq!(
            inn,
            w.in_features(),
            "quant_matmul: activations have {inn} columns, weight expects {}",
            w.in_features()
        );
        let xs: &[f32] = x.as_slice::<f32>().expect("contiguous f32 activations");
        let y = lowbit_matmul(w, xs, m);
        FlexTensor::from_data(TensorData::new(y, [m, w.out_features()]))
    }
}

#[derive(Debug)]
struct SteBackward;

impl<B: Backend> Backward<B, 2> for SteBackward {
    /// `(x, dequantized)` saved by the forward.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_master] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (x, deq) = ops.state;
        if let Some(node) = node_x {
            // dx = g · W'^T, W' = dequant(Q(W)) as [in, out].
            grads.register::<B>(node.id, B::float_matmul(g.clone(), B::float_transpose(deq)));
        }
        if let Some(node) = node_master {
            // Straight-through: dW = x^T g, as if the quantizer were the identity.
            grads.register::<B>(node.id, B::float_matmul(B::float_transpose(x), g));
        }
    }
}

impl<B: Backend + QuantMatmulBackend, C: CheckpointStrategy> QuantMatmulBackend for Autodiff<B, C> {
    fn quant_matmul(
        x: FloatTensor<Self>,
        master: FloatTensor<Self>,
        dequantized: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        let deq = dequantized.primitive().clone();
        match SteBackward
            .prepare::<C>([x.node(), master.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let xp = x.primitive().clone();
                let mp = master.primitive().clone();
                let out = B::quant_matmul(xp.clone(), mp, deq.clone(), packed);
                prep.finish((xp, deq), out)
            }
            OpsKind::UnTracked(prep) => {
                let out = B::quant_matmul(x.into_primitive(), master.into_primitive(), deq, packed);
                prep.finish(out)
            }
        }
    }
}
