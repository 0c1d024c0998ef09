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
use burn::backend::{backend_extension, AutodiffBackend, Backend, Dispatch, Flex, TensorMetadata};
use burn::tensor::{Tensor, TensorData};

use super::cpu_kernel::KernelWeights;
use super::moe::ExpertWeights;
use super::{QuantError, QuantScheme, QuantizedTensor};
use crate::model::layers::{tensor_from_vec, to_f32_vec};

/// Packed weights of one weight version, shared between the rollout and the training forward: the packed
/// format (checkpoints, the backward's `dequant(Q(W))`) and its CPU kernel layout, both made once per
/// weight version.
#[derive(Debug, Clone)]
pub struct PackedWeight(pub Arc<QuantizedTensor>, pub Arc<KernelWeights>);

impl PackedWeight {
    pub fn new(q: QuantizedTensor) -> Self {
        let kernel = KernelWeights::new(&q);
        PackedWeight(Arc::new(q), Arc::new(kernel))
    }
}

/// One quantized weight version: only the packed codes and scales are kept (no float copy); the backward pass
/// decodes them when it needs `dequant(Q(W))`.
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    pub packed: PackedWeight,
}

/// `[rows, cols]` -> `[cols, rows]` on the host, in 32x32 tiles, output row blocks in parallel. Reading
/// the master contiguous and transposing here instead of `into_data()` of a transposed view: burn-flex
/// copies a strided view on one thread, which was a third of re-quantizing a model (every RL weight sync).
fn transpose_host(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    use rayon::prelude::*;
    const TILE: usize = 32;
    let mut dst = vec![0.0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return dst;
    }
    dst.par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(block, out)| {
            let c0 = block * TILE;
            let width = out.len() / rows;
            for r0 in (0..rows).step_by(TILE) {
                for r in r0..(r0 + TILE).min(rows) {
                    let row = &src[r * cols + c0..r * cols + c0 + width];
                    for (c, &v) in row.iter().enumerate() {
                        out[c * rows + r] = v;
                    }
                }
            }
        });
    dst
}

impl QuantizedWeight {
    /// Quantizes a master weight stored `[in, out]` (the spec's groups run along `in` of each output row).
    pub fn from_master(master: Tensor<2>, scheme: QuantScheme) -> Result<Self, QuantError> {
        let [inn, out] = master.dims();
        let w_out_in = transpose_host(&to_f32_vec(master), inn, out);
        let q = QuantizedTensor::quantize(&w_out_in, out, inn, scheme)?;
        Ok(Self::from_packed(q))
    }

    /// Wraps already quantized weights (e.g. read from a quantized checkpoint).
    pub fn from_packed(q: QuantizedTensor) -> Self {
        Self {
            packed: PackedWeight::new(q),
        }
    }

    /// `dequant(Q(W))` laid out like the master, `[in, out]`, on `device`.
    pub fn dequantized(&self, device: &burn::tensor::Device) -> Tensor<2> {
        let [out, inn] = self.packed.0.shape();
        let t = tensor_from_vec(self.packed.0.dequantize(), [out, inn], device).transpose();
        Tensor::from_data(t.into_data(), device)
    }

    /// Bytes of the packed codes and scales.
    pub fn storage_bytes(&self) -> usize {
        self.packed.0.storage_bytes()
    }

    pub fn scheme(&self) -> QuantScheme {
        self.packed.0.scheme()
    }

    /// `x: [n, in] -> [n, out]` through the low-bit matmul; gradients flow to `master` (STE) and to `x`.
    pub fn matmul(&self, x: Tensor<2>, master: Tensor<2>) -> Tensor<2> {
        Tensor::from_dispatch(<Dispatch as QuantMatmulBackend>::quant_matmul(
            x.into_dispatch(),
            master.into_dispatch(),
            self.packed.clone(),
        ))
    }
}

/// `dequant(Q(W))` in HF layout `[out, in]` as a tensor of backend `B` on `device`.
fn dequantized_out_in<B: Backend>(packed: &PackedWeight, device: &B::Device) -> FloatTensor<B> {
    B::float_from_data(
        TensorData::new(packed.0.dequantize(), packed.0.shape()),
        device,
    )
}

/// The backend extension carrying the low-bit matmul. Backends without a dedicated kernel yet use the
/// default body (a float matmul on the dequantized weights: the same values, another summation order).
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait QuantMatmulBackend: Backend {
    /// `x [n, in] · dequant(Q(W))^T` from the packed weights; `master` (`[in, out]`) only receives the
    /// straight-through gradient.
    fn quant_matmul(
        x: FloatTensor<Self>,
        master: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        let _ = master;
        let w = dequantized_out_in::<Self>(&packed, &x.device());
        Self::float_matmul(x, Self::float_transpose(w))
    }

    /// `g [n, out] · dequant(Q(W))` -> `[n, in]`: the straight-through backward's input gradient, from the
    /// same packed weights the forward read (the CubeCL backends run the transposed kernel).
    fn quant_matmul_transposed(g: FloatTensor<Self>, packed: PackedWeight) -> FloatTensor<Self> {
        let w = dequantized_out_in::<Self>(&packed, &g.device());
        Self::float_matmul(g, w)
    }

    /// Softmax along `dim` whose forward is the same op on the inference and the autodiff backend (burn's
    /// autodiff would decompose it into elementary ops and round differently): the backend's fused softmax,
    /// or on the CPU in deterministic mode the fixed-order row softmax
    /// ([`super::cpu_kernel::softmax_rows`], batch-invariant and blind to masked trailing keys).
    fn aligned_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        Self::softmax(x, dim)
    }

    /// `x [.., m, k] · w [.., k, n]` (or `· w^T` with `w [.., n, k]` when `w_transposed`), same leading
    /// dims. In deterministic mode the CPU backend computes it in a fixed, batch-invariant order
    /// ([`super::cpu_kernel::f32_matmul`], [`super::cpu_kernel::f32_matmul_nt`]); elsewhere it is the
    /// backend's matmul. The backward is the usual one (`dx = g w^T`, `dw = x^T g`).
    fn det_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
    ) -> FloatTensor<Self> {
        plain_matmul::<Self>(x, w, w_transposed)
    }

    /// The routed experts of one MoE layer in one grouped launch chain ([`super::moe`]): `x [n, hidden]`,
    /// `route_w [n, top_k]` (the chosen experts' weights, slot order), `ids[t * top_k + j]` the expert of
    /// token `t`'s slot `j` -> `[n, hidden]`, with the arithmetic of the `cube_kernels` MoE contract (fp8
    /// activations for fp8-b128, canonical sums, SwiGLU, combine in slot order with fused multiply-adds).
    /// `None` (the default: the CPU and any backend without the kernel) means "run the per-expert loop";
    /// the autodiff backend returns its inner backend's result without a gradient.
    fn grouped_moe(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: Vec<u32>,
        experts: ExpertWeights,
    ) -> Option<FloatTensor<Self>> {
        let _ = (x, route_w, ids, experts);
        None
    }

    /// The core of grouped-query attention in one op: `q [b, kv, rows, d]` (the query heads sharing a key
    /// head stacked along the rows, `rows = rep * t`), `k`/`v` `[b, kv, s, d]`, the additive `mask`
    /// `[b, 1, t, s]` -> `softmax(q k^T * scale + mask) v`, `[b, kv, rows, d]`, with exactly the bits of
    /// the op-by-op path (`det_matmul`, scale, mask, `aligned_softmax`, `det_matmul`). `None` (the default,
    /// and under autodiff when an input carries a gradient) means "run the op-by-op path"; the CPU in
    /// deterministic mode runs [`super::cpu_attention`].
    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f32,
    ) -> Option<FloatTensor<Self>> {
        let _ = (q, k, v, mask, scale);
        None
    }

    /// Whether [`Self::grouped_moe`] returns the per-expert loop's exact bits (the CPU: then a training
    /// forward runs the loop alone, with the rollout's values, instead of both paths). `x`: a tensor on the
    /// device in question.
    fn grouped_moe_matches_loop(x: &FloatTensor<Self>) -> bool {
        let _ = x;
        false
    }

    /// `value` unchanged (same bits), with the gradient routed to `graph` as is (none to `value`).
    fn forward_value_of(graph: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        let _ = graph;
        value
    }

    /// Whether `x` is part of a recorded autodiff graph; `false` on inference backends.
    fn tracks_gradients(x: &FloatTensor<Self>) -> bool {
        let _ = x;
        false
    }
}

/// The backend's own (fused) softmax.
fn backend_softmax<B: Backend>(x: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    B::softmax(x, dim)
}

/// The backend's own matmul of [`QuantMatmulBackend::det_matmul`]'s operands.
fn plain_matmul<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    w_transposed: bool,
) -> FloatTensor<B> {
    let w = if w_transposed {
        let r = w.shape().num_dims();
        B::float_swap_dims(w, r - 2, r - 1)
    } else {
        w
    };
    B::float_matmul(x, w)
}

impl QuantMatmulBackend for Flex {
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
        let y = super::cpu_moe::grouped_moe(xs, ws, &ids, wdims[1], &experts);
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
        if !crate::model::scoring::deterministic() {
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
        let sh = super::cpu_attention::AttentionShape {
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
        let y = super::cpu_attention::attention_core(
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
        if !crate::model::scoring::deterministic() || dim + 1 != rank {
            return backend_softmax::<Self>(x, dim);
        }
        let x: FlexTensor = x.to_contiguous();
        let dims = x.layout().shape().to_vec();
        let xs: &[f32] = x.as_slice::<f32>().expect("contiguous f32 tensor");
        let y = super::cpu_kernel::softmax_rows(xs, dims[rank - 1]);
        FlexTensor::from_data(TensorData::new(y, dims))
    }

    fn det_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
    ) -> FloatTensor<Self> {
        if !crate::model::scoring::deterministic() {
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
            super::cpu_kernel::f32_matmul_nt(xs, ws, batch, m, k, n)
        } else {
            super::cpu_kernel::f32_matmul(xs, ws, batch, m, k, n)
        };
        let mut shape = xd;
        shape[r - 1] = n;
        FlexTensor::from_data(TensorData::new(y, shape))
    }
}

#[derive(Debug)]
struct DetMatmulBackward;

impl<B: Backend> Backward<B, 2> for DetMatmulBackward {
    /// `(x, w, w_transposed)`.
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (x, w, nt) = ops.state;
        let r = g.shape().num_dims();
        let t = |a: FloatTensor<B>| B::float_swap_dims(a, r - 2, r - 1);
        if let Some(node) = node_x {
            // y = x w: dx = g w^T; y = x w^T: dx = g w.
            let dx = if nt {
                B::float_matmul(g.clone(), w)
            } else {
                B::float_matmul(g.clone(), t(w))
            };
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_w {
            // y = x w: dw = x^T g; y = x w^T: dw = g^T x.
            let dw = if nt {
                B::float_matmul(t(g), x)
            } else {
                B::float_matmul(t(x), g)
            };
            grads.register::<B>(node.id, dw);
        }
    }
}

#[derive(Debug)]
struct SteBackward;

impl<B: Backend + QuantMatmulBackend> Backward<B, 2> for SteBackward {
    /// `(x, packed weights)` saved by the forward.
    type State = (FloatTensor<B>, PackedWeight);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_master] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (x, packed) = ops.state;
        if let Some(node) = node_x {
            // dx = g · W' with W' = dequant(Q(W)) in [out, in]: the weights the forward really used.
            grads.register::<B>(node.id, B::quant_matmul_transposed(g.clone(), packed));
        }
        if let Some(node) = node_master {
            // Straight-through: dW = x^T g, as if the quantizer were the identity.
            grads.register::<B>(node.id, B::float_matmul(B::float_transpose(x), g));
        }
    }
}

#[derive(Debug)]
struct SoftmaxBackward;

impl<B: Backend> Backward<B, 1> for SoftmaxBackward {
    /// `(y = softmax(x), dim)`.
    type State = (FloatTensor<B>, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (y, dim) = ops.state;
        if let Some(node) = node_x {
            // dx = y * (g - sum(g * y, dim))
            let gy = B::float_sum_dim(B::float_mul(g.clone(), y.clone()), dim);
            grads.register::<B>(node.id, B::float_mul(y, B::float_sub(g, gy)));
        }
    }
}

/// The CubeCL backends (wgpu, CUDA): the `cube_kernels` low-bit kernels on the tensors' device buffers
/// ([`super::cube`]) for f32 activations, and f16/bf16 where the device has them (f32 sums, one rounding
/// to the activations' dtype); other dtypes take the default (dequantize, then the backend's matmul).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl QuantMatmulBackend for burn_cubecl::CubeBackend {
    fn quant_matmul(
        x: FloatTensor<Self>,
        master: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        let _ = master;
        super::cube::quant_matmul(x.clone(), &packed).unwrap_or_else(|| {
            let w = dequantized_out_in::<Self>(&packed, &x.device());
            plain_matmul::<Self>(x, w, true)
        })
    }

    fn quant_matmul_transposed(g: FloatTensor<Self>, packed: PackedWeight) -> FloatTensor<Self> {
        super::cube::quant_matmul_transposed(g.clone(), &packed).unwrap_or_else(|| {
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
        super::cube::grouped_moe(x, route_w, &ids, &experts)
    }
}

/// The backward of [`QuantMatmulBackend::forward_value_of`]: the gradient goes to `graph` unchanged.
#[derive(Debug)]
struct ForwardValueOfBackward;

impl<B: Backend> Backward<B, 1> for ForwardValueOfBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_graph] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        if let Some(node) = node_graph {
            grads.register::<B>(node.id, g);
        }
    }
}

impl<B: Backend + QuantMatmulBackend, C: CheckpointStrategy> QuantMatmulBackend for Autodiff<B, C> {
    fn det_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
    ) -> FloatTensor<Self> {
        match DetMatmulBackward
            .prepare::<C>([x.node(), w.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (xp, wp) = (x.primitive().clone(), w.primitive().clone());
                let out = B::det_matmul(xp.clone(), wp.clone(), w_transposed);
                prep.finish((xp, wp, w_transposed), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::det_matmul(
                x.into_primitive(),
                w.into_primitive(),
                w_transposed,
            )),
        }
    }

    fn aligned_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        match SoftmaxBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::aligned_softmax(x.primitive().clone(), dim);
                prep.finish((y.clone(), dim), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::aligned_softmax(x.into_primitive(), dim)),
        }
    }

    fn grouped_moe(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: Vec<u32>,
        experts: ExpertWeights,
    ) -> Option<FloatTensor<Self>> {
        // A constant of the graph: the caller pairs it with the per-expert graph (`forward_value_of`).
        B::grouped_moe(x.into_primitive(), route_w.into_primitive(), ids, experts)
            .map(<Self as AutodiffBackend>::from_inner)
    }

    fn grouped_moe_matches_loop(x: &FloatTensor<Self>) -> bool {
        B::grouped_moe_matches_loop(&x.clone().into_primitive())
    }

    fn forward_value_of(graph: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        let value = value.into_primitive();
        match ForwardValueOfBackward
            .prepare::<C>([graph.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), value),
            OpsKind::UnTracked(prep) => prep.finish(value),
        }
    }

    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f32,
    ) -> Option<FloatTensor<Self>> {
        // With a gradient to carry, the op-by-op path (whose ops have backwards) computes the same bits.
        if [&q, &k, &v].into_iter().any(Self::tracks_gradients) {
            return None;
        }
        B::attention_core(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            mask.into_primitive(),
            scale,
        )
        .map(<Self as AutodiffBackend>::from_inner)
    }

    fn tracks_gradients(x: &FloatTensor<Self>) -> bool {
        // Preparing an op registers nothing until it is finished; it only reads the parents' requirement.
        matches!(
            <ForwardValueOfBackward as Backward<B, 1>>::prepare::<C>(
                ForwardValueOfBackward,
                [x.node()]
            )
            .compute_bound()
            .stateful(),
            OpsKind::Tracked(_)
        )
    }

    fn quant_matmul(
        x: FloatTensor<Self>,
        master: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        match SteBackward
            .prepare::<C>([x.node(), master.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let xp = x.primitive().clone();
                let mp = master.primitive().clone();
                let out = B::quant_matmul(xp.clone(), mp, packed.clone());
                prep.finish((xp, packed), out)
            }
            OpsKind::UnTracked(prep) => {
                let out = B::quant_matmul(x.into_primitive(), master.into_primitive(), packed);
                prep.finish(out)
            }
        }
    }
}

/// [`QuantMatmulBackend::attention_core`] on tensors (`None`: run the op-by-op path).
pub fn attention_core(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<4>,
    scale: f32,
) -> Option<Tensor<4>> {
    <Dispatch as QuantMatmulBackend>::attention_core(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        mask.into_dispatch(),
        scale,
    )
    .map(Tensor::from_dispatch)
}

/// [`QuantMatmulBackend::aligned_softmax`] on a tensor.
pub fn aligned_softmax<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as QuantMatmulBackend>::aligned_softmax(
        x.into_dispatch(),
        dim,
    ))
}

/// [`QuantMatmulBackend::det_matmul`] on tensors: `x · w` (`w [.., k, n]`), or `x · w^T` (`w [.., n, k]`) when
/// `w_transposed`.
pub fn det_matmul<const D: usize>(x: Tensor<D>, w: Tensor<D>, w_transposed: bool) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as QuantMatmulBackend>::det_matmul(
        x.into_dispatch(),
        w.into_dispatch(),
        w_transposed,
    ))
}
