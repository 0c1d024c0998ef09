//! The training (autodiff) backend of the custom ops: each op's forward is the inner backend's, so the
//! training forward computes the rollout's bits; the backwards are written here.
//!
//! - the low-bit matmul: the straight-through estimator to the f32 master (`dW = x^T g`, the quantizer
//!   treated as the identity) and `dx = g · dequant(Q(W))` from the same packed weights;
//! - the fixed-order matmul and softmax: the usual gradients (`dx = g w^T`, `dw = x^T g`;
//!   `dx = y * (g - sum(g * y))`);
//! - SwiGLU's `silu(gate) * up` and the rotary embedding: the backend's [`KernelOps::swiglu_backward`]
//!   and [`KernelOps::rope_backward`];
//! - [`KernelOps::forward_value_of`]: the gradient passes to the graph operand unchanged.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{AutodiffBackend, Backend, TensorMetadata};

use super::{ExpertWeights, KernelOps, PackedWeight};

#[derive(Debug)]
struct DetMatmulBackward;

impl<B: Backend + KernelOps> Backward<B, 2> for DetMatmulBackward {
    /// `(x, w, w_transposed)`.
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (x, w, nt) = ops.state;
        if let Some(node) = node_x {
            // y = x w: dx = g w^T; y = x w^T: dx = g w.
            grads.register::<B>(node.id, B::grad_matmul(g.clone(), w, false, !nt));
        }
        if let Some(node) = node_w {
            // y = x w: dw = x^T g; y = x w^T: dw = g^T x.
            let dw = if nt {
                B::grad_matmul(g, x, true, false)
            } else {
                B::grad_matmul(x, g, true, false)
            };
            grads.register::<B>(node.id, dw);
        }
    }
}

#[derive(Debug)]
struct SteBackward;

impl<B: Backend + KernelOps> Backward<B, 2> for SteBackward {
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
            grads.register::<B>(node.id, B::grad_matmul(x, g, true, false));
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

/// The backward of [`KernelOps::aligned_mean_last`], as burn's `mean_dim` computes it (the same bits):
/// `ones * (1 / n) * sum_dim(g)` (the sum over an axis of 1 is `g`), broadcast along the axis.
#[derive(Debug)]
struct MeanLastBackward;

impl<B: Backend> Backward<B, 1> for MeanLastBackward {
    /// The input's shape.
    type State = burn::tensor::Shape;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        use burn::backend::Scalar;
        let [node_x] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let shape = ops.state;
        if let Some(node) = node_x {
            let dim = shape.num_dims() - 1;
            let val = 1_f64 / shape[dim] as f64;
            let ones = B::float_ones(shape, &g.device(), g.dtype().into());
            let val = B::float_mul_scalar(ones, Scalar::Float(val));
            grads.register::<B>(node.id, B::float_mul(val, B::float_sum_dim(g, dim)));
        }
    }
}

/// The backward of [`KernelOps::swiglu`]: the backend's [`KernelOps::swiglu_backward`] (on the CPU one
/// fused pass with the bits of burn's op-by-op backwards).
#[derive(Debug)]
struct SwiGluBackward;

impl<B: Backend + KernelOps> Backward<B, 2> for SwiGluBackward {
    /// `(gate, up)`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (dgate, dup) = B::swiglu_backward(gate, up, g);
        if let Some(node) = node_gate {
            grads.register::<B>(node.id, dgate);
        }
        if let Some(node) = node_up {
            grads.register::<B>(node.id, dup);
        }
    }
}

/// The backward of [`KernelOps::rope`]: the backend's [`KernelOps::rope_backward`] (the tables carry no
/// gradient).
#[derive(Debug)]
struct RopeBackward;

impl<B: Backend + KernelOps> Backward<B, 1> for RopeBackward {
    /// `(cos, sin)`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (cos, sin) = ops.state;
        if let Some(node) = node_x {
            let dx = B::rope_backward(g, cos, sin)
                .expect("a backend with a fused rope has its backward");
            grads.register::<B>(node.id, dx);
        }
    }
}

/// The backward of [`KernelOps::forward_value_of`]: the gradient goes to `graph` unchanged.
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

/// The backward of [`KernelOps::grouped_moe_with_gradient`]: the inner backend's
/// [`KernelOps::grouped_moe_backward`] on the forward's saved activations, to the parents `x`, `route_w`
/// and the stacked gate, up and down masters.
#[derive(Debug)]
struct GroupedMoeBackward;

/// What [`GroupedMoeBackward`] keeps: the op's inputs (`x`, `route_w`, the expert ids, the packed
/// experts) and the activations its training forward saved.
#[derive(Debug, Clone)]
struct GroupedMoeState<B: Backend> {
    x: FloatTensor<B>,
    route_w: FloatTensor<B>,
    ids: IntTensor<B>,
    experts: ExpertWeights,
    /// `(gate, up, swiglu, expert_out)`, in the inner backend's layout.
    saved: [FloatTensor<B>; 4],
}

impl<B: Backend + KernelOps> Backward<B, 5> for GroupedMoeBackward {
    type State = GroupedMoeState<B>;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let g = grads.consume::<B>(&ops.node);
        let GroupedMoeState {
            x,
            route_w,
            ids,
            experts,
            saved: [gate, up, swiglu, expert_out],
        } = ops.state;
        let (dx, d_route_w, d_gate, d_up, d_down) =
            B::grouped_moe_backward(x, route_w, ids, g, experts, gate, up, swiglu, expert_out)
                .expect("a backend with the grouped MoE training forward has its backward");
        super::count_grouped_moe_backward();
        let parts = [dx, d_route_w, d_gate, d_up, d_down];
        for (node, grad) in ops.parents.into_iter().zip(parts) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The backward of the fused LM-head log-probs ([`KernelOps::head_logprobs_with_gradient`]): with
/// `z = (x · w) / T` and `p = exp(z - lse)`, `dz = g (onehot(target) - p)`, so `dlogits = dz / T`; then
/// `dx = dlogits · w^T` and `dw = x^T · dlogits` (`w [k, v]`; transposed for `w [v, k]`), chunk by chunk.
#[derive(Debug)]
struct HeadLogprobsBackward;

/// What [`HeadLogprobsBackward`] keeps: `x`, `w`, `w_transposed`, `lse`, the targets and the temperature.
type HeadState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    bool,
    FloatTensor<B>,
    Vec<u32>,
    f32,
);

impl<B: Backend + KernelOps> Backward<B, 2> for HeadLogprobsBackward {
    type State = HeadState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        use burn::backend::Scalar;
        use burn::tensor::{Shape, TensorData};
        let [node_x, node_w] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (x, w, wt, lse, targets, temperature) = ops.state;
        let device = x.device();
        let n = targets.len();
        let index = |vals: Vec<i64>, shape: [usize; 2]| {
            B::int_from_data(TensorData::new(vals, shape), &device)
        };
        let scaled = |t: FloatTensor<B>| {
            if temperature == 1.0 {
                t
            } else {
                B::float_div_scalar(t, Scalar::Float(temperature as f64))
            }
        };
        let mut dx_parts = Vec::new();
        let mut dw: Option<FloatTensor<B>> = None;
        for c0 in (0..n).step_by(super::HEAD_CHUNK_ROWS) {
            let c1 = (c0 + super::HEAD_CHUNK_ROWS).min(n);
            let r = c1 - c0;
            let rows = index((c0 as i64..c1 as i64).collect(), [r, 1]);
            let rows = B::int_reshape(rows, Shape::new([r]));
            let xc = B::float_select(x.clone(), 0, rows.clone());
            let z = scaled(B::det_matmul(xc.clone(), w.clone(), wt));
            // dlogits = (g / T) (onehot - p): -p g / T everywhere, plus g / T at the target.
            let gt = scaled(B::float_select(g.clone(), 0, rows.clone()));
            let lse_rows = B::float_select(lse.clone(), 0, rows.clone());
            let d = B::logprob_grad_rows(z, lse_rows, gt, &targets[c0..c1]);
            if node_x.is_some() {
                // w [v, k]: dx = d w; w [k, v]: dx = d w^T.
                dx_parts.push(B::grad_matmul(d.clone(), w.clone(), false, !wt));
            }
            if node_w.is_some() {
                // w [v, k]: dw = d^T x; w [k, v]: dw = x^T d.
                let part = if wt {
                    B::grad_matmul(d, xc, true, false)
                } else {
                    B::grad_matmul(xc, d, true, false)
                };
                dw = Some(match dw {
                    Some(acc) => B::float_add(acc, part),
                    None => part,
                });
            }
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::float_cat(dx_parts, 0));
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<B>(node.id, dw);
        }
    }
}

impl<B: Backend + KernelOps, C: CheckpointStrategy> KernelOps for Autodiff<B, C> {
    fn head_logprobs_with_gradient(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
        lse: FloatTensor<Self>,
        targets: Vec<u32>,
        temperature: f32,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let value = value.into_primitive();
        match HeadLogprobsBackward
            .prepare::<C>([x.node(), w.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (
                    x.primitive().clone(),
                    w.primitive().clone(),
                    w_transposed,
                    lse.into_primitive(),
                    targets,
                    temperature,
                );
                prep.finish(state, value)
            }
            OpsKind::UnTracked(prep) => prep.finish(value),
        }
    }

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

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        match SwiGluBackward
            .prepare::<C>([gate.node(), up.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (g, u) = (gate.primitive().clone(), up.primitive().clone());
                let out = B::swiglu(g.clone(), u.clone());
                prep.finish((g, u), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::swiglu(gate.into_primitive(), up.into_primitive()))
            }
        }
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        // The tables are constants of the graph (computed on the host for the forward's positions).
        let (c, s) = (cos.into_primitive(), sin.into_primitive());
        match RopeBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::rope(x.primitive().clone(), c.clone(), s.clone())?;
                Some(prep.finish((c, s), y))
            }
            OpsKind::UnTracked(prep) => Some(prep.finish(B::rope(x.into_primitive(), c, s)?)),
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

    fn aligned_mean_last(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match MeanLastBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let xp = x.primitive().clone();
                let shape = xp.shape();
                prep.finish(shape, B::aligned_mean_last(xp))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::aligned_mean_last(x.into_primitive())),
        }
    }

    fn grouped_moe(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        experts: ExpertWeights,
    ) -> Option<FloatTensor<Self>> {
        // A constant of the graph: the caller pairs it with the per-expert graph (`forward_value_of`).
        B::grouped_moe(x.into_primitive(), route_w.into_primitive(), ids, experts)
            .map(<Self as AutodiffBackend>::from_inner)
    }

    fn quant_matmul_takes_half(x: &FloatTensor<Self>) -> bool {
        B::quant_matmul_takes_half(&x.clone().into_primitive())
    }

    fn grouped_moe_trains(x: &FloatTensor<Self>) -> bool {
        B::grouped_moe_trains(&x.clone().into_primitive())
    }

    fn grouped_moe_with_gradient(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        experts: ExpertWeights,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        down: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let (xp, wp) = (x.primitive().clone(), route_w.primitive().clone());
        let (out, g, u, h, y) =
            B::grouped_moe_for_training(xp.clone(), wp.clone(), ids.clone(), experts.clone())?;
        match GroupedMoeBackward
            .prepare::<C>([
                x.node(),
                route_w.node(),
                gate.node(),
                up.node(),
                down.node(),
            ])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = GroupedMoeState {
                    x: xp,
                    route_w: wp,
                    ids,
                    experts,
                    saved: [g, u, h, y],
                };
                Some(prep.finish(state, out))
            }
            OpsKind::UnTracked(prep) => Some(prep.finish(out)),
        }
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
