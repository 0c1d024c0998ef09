//! The CPU backend (burn flex) of the custom ops: fixed-order, batch-invariant SIMD kernels.
//!
//! - [`kernel`]: the low-bit matmul on the packed weights, the fixed-order f32 matmul and row softmax.
//! - [`attention`]: the grouped-query attention core in one pass, bitwise the op-by-op path.
//! - [`moe`]: the routed experts of one MoE layer in parallel on the kernel layout, bitwise the loop.

pub mod attention;
pub mod kernel;
pub mod moe;

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::TensorData;

use super::switches::deterministic;
use super::{backend_softmax, plain_matmul, ExpertWeights, KernelOps, PackedWeight};

impl KernelOps for Flex {
    /// The experts in parallel straight on the kernel layout ([`super::cpu_moe`]), bitwise the loop.
    fn grouped_moe(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: Vec<u32>,
        experts: ExpertWeights,
    ) -> Option<FloatTensor<Self>> {
        let x: FlexTensor = x.to_contiguous();
        let route_w: FlexTensor = route_w.to_contiguous();
        let dims = x.layout().shape().to_vec();
        let wdims = route_w.layout().shape().to_vec();
        let (xs, ws) = (x.as_slice::<f32>()?, route_w.as_slice::<f32>()?);
        if dims.len() != 2 || wdims.len() != 2 || wdims[0] != dims[0] {
            return None;
        }
        let y = moe::grouped_moe(xs, ws, &ids, wdims[1], &experts);
        Some(FlexTensor::from_data(TensorData::new(y, dims)))
    }

    fn grouped_moe_matches_loop(_x: &FloatTensor<Self>) -> bool {
        true
    }

    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f32,
    ) -> Option<FloatTensor<Self>> {
        if !deterministic() {
            return None;
        }
        let (q, k, v, mask): (FlexTensor, FlexTensor, FlexTensor, FlexTensor) = (
            q.to_contiguous(),
            k.to_contiguous(),
            v.to_contiguous(),
            mask.to_contiguous(),
        );
        let (qd, kd) = (q.layout().shape().to_vec(), k.layout().shape().to_vec());
        let md = mask.layout().shape().to_vec();
        if qd.len() != 4 || kd.len() != 4 || md.len() != 4 || v.layout().shape().to_vec() != kd {
            return None;
        }
        let sh = attention::AttentionShape {
            b: qd[0],
            kv: qd[1],
            rows: qd[2],
            t: md[2],
            s: kd[2],
            d: qd[3],
        };
        if kd[..2] != qd[..2] || kd[3] != sh.d || md != [sh.b, 1, sh.t, sh.s] || sh.t == 0 {
            return None;
        }
        let y = attention::attention_core(
            q.as_slice::<f32>()?,
            k.as_slice::<f32>()?,
            v.as_slice::<f32>()?,
            Some(mask.as_slice::<f32>()?),
            scale,
            sh,
        );
        Some(FlexTensor::from_data(TensorData::new(y, qd)))
    }

    fn quant_matmul(
        x: FloatTensor<Self>,
        _master: FloatTensor<Self>,
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
        let y = packed.1.matmul(xs, m);
        FlexTensor::from_data(TensorData::new(y, [m, w.out_features()]))
    }

    fn aligned_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        let rank = x.shape().num_dims();
        if !deterministic() || dim + 1 != rank {
            return backend_softmax::<Self>(x, dim);
        }
        let x: FlexTensor = x.to_contiguous();
        let dims = x.layout().shape().to_vec();
        let xs: &[f32] = x.as_slice::<f32>().expect("contiguous f32 tensor");
        let y = kernel::softmax_rows(xs, dims[rank - 1]);
        FlexTensor::from_data(TensorData::new(y, dims))
    }

    fn det_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
    ) -> FloatTensor<Self> {
        if !deterministic() {
            return plain_matmul::<Self>(x, w, w_transposed);
        }
        let x: FlexTensor = x.to_contiguous();
        let w: FlexTensor = w.to_contiguous();
        let xd = x.layout().shape().to_vec();
        let wd = w.layout().shape().to_vec();
        let r = xd.len();
        assert!(
            r >= 2 && wd.len() == r && xd[..r - 2] == wd[..r - 2],
            "det_matmul: shapes {xd:?} and {wd:?} do not match"
        );
        let (m, k) = (xd[r - 2], xd[r - 1]);
        let (wk, n) = if w_transposed {
            (wd[r - 1], wd[r - 2])
        } else {
            (wd[r - 2], wd[r - 1])
        };
        assert_eq!(k, wk, "det_matmul: inner dimensions {k} and {wk} differ");
        let batch: usize = xd[..r - 2].iter().product();
        let xs: &[f32] = x.as_slice::<f32>().expect("contiguous f32 activations");
        let ws: &[f32] = w.as_slice::<f32>().expect("contiguous f32 weights");
        let y = if w_transposed {
            kernel::f32_matmul_nt(xs, ws, batch, m, k, n)
        } else {
            kernel::f32_matmul(xs, ws, batch, m, k, n)
        };
        let mut shape = xd;
        shape[r - 1] = n;
        FlexTensor::from_data(TensorData::new(y, shape))
    }
}
