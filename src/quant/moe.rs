//! The routed experts of one MoE layer as one backend op: on the CubeCL backends (wgpu, CUDA) the grouped
//! MoE kernel of [`cube_kernels`] (gate+up with SwiGLU, down, un-permute and combine: one launch chain over
//! all experts); elsewhere the op answers `None` and the model runs its per-expert loop
//! ([`crate::model::mlp::MoeBlock`]), so the CPU path is unchanged.
//!
//! **Rollout and training agree bitwise.** The training (autodiff) forward returns the grouped kernel's
//! output as its value, the very bits the rollout (inference) forward computes, and takes its gradient from
//! the per-expert graph through [`forward_value_of`]: `forward_value_of(y_graph, y_fast)` has the value of
//! `y_fast` and passes the incoming gradient to `y_graph` unchanged (a straight-through estimator between two
//! computations of the same function that differ only by rounding). The gradients are therefore exactly
//! those of the per-expert path, itself straight-through to the full-precision masters
//! ([`super::linear`]).
//!
//! **Cost.** When gradients are tracked, the training forward computes the MoE layer twice: the per-expert
//! graph (for the gradients; one set of launches per expert and projection, as before) and the grouped
//! kernel (for the value), and the packed expert weights sit on the device twice (per linear for the graph
//! and its backward, stacked for the grouped kernel). Untracked forwards (rollout, evaluation, an autodiff
//! forward where nothing needs a gradient) run the grouped kernel alone.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::Tensor;

use super::linear::{PackedWeight, QuantMatmulBackend};
use super::QuantScheme;
use burn::backend::Dispatch;

/// The packed weights of one MoE layer's experts, in expert order: `gate[e]`, `up[e]` (`[inter, hidden]`)
/// and `down[e]` (`[hidden, inter]`), one weight version each, all of one scheme.
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    pub gate: Vec<PackedWeight>,
    pub up: Vec<PackedWeight>,
    pub down: Vec<PackedWeight>,
}

impl ExpertWeights {
    /// Gathers the experts' packed weights; `None` unless there is at least one expert and every projection
    /// is of one scheme with one shape per kind (gate and up `[inter, hidden]`, down `[hidden, inter]`).
    pub fn new(
        gate: Vec<PackedWeight>,
        up: Vec<PackedWeight>,
        down: Vec<PackedWeight>,
    ) -> Option<Self> {
        let first = gate.first()?;
        let scheme: QuantScheme = first.0.scheme();
        let [inter, hidden] = first.0.shape();
        let ok = gate.len() == up.len()
            && gate.len() == down.len()
            && gate
                .iter()
                .chain(&up)
                .all(|p| p.0.scheme() == scheme && p.0.shape() == [inter, hidden])
            && down
                .iter()
                .all(|p| p.0.scheme() == scheme && p.0.shape() == [hidden, inter]);
        ok.then_some(Self { gate, up, down })
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        self.gate.len()
    }

    /// Whether there are no experts (never, for a value made by [`Self::new`]).
    pub fn is_empty(&self) -> bool {
        self.gate.is_empty()
    }

    /// `[hidden, inter]`.
    pub fn dims(&self) -> [usize; 2] {
        let [inter, hidden] = self.gate[0].0.shape();
        [hidden, inter]
    }
}

/// The grouped MoE op ([`QuantMatmulBackend::grouped_moe`]) on tensors: `x [n, hidden]`, the chosen experts
/// `ids[t * top_k + j]`, their routing weights `route_w [n, top_k]` -> `[n, hidden]`, or `None` when the
/// backend has no grouped kernel (then run the per-expert loop). The result carries no gradient: under
/// autodiff, pair it with the per-expert graph through [`forward_value_of`].
pub fn grouped_moe(
    x: Tensor<2>,
    route_w: Tensor<2>,
    ids: &[u32],
    experts: ExpertWeights,
) -> Option<Tensor<2>> {
    <Dispatch as QuantMatmulBackend>::grouped_moe(
        x.into_dispatch(),
        route_w.into_dispatch(),
        ids.to_vec(),
        experts,
    )
    .map(Tensor::from_dispatch)
}

/// The value of `value` (the same bits) with the gradient of `graph`: the backward passes the incoming
/// gradient to `graph` unchanged and none to `value`.
pub fn forward_value_of<const D: usize>(graph: Tensor<D>, value: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as QuantMatmulBackend>::forward_value_of(
        graph.into_dispatch(),
        value.into_dispatch(),
    ))
}

/// Whether the backend's grouped op reproduces the per-expert loop bit for bit (the CPU): a training forward
/// then runs the loop alone, with the rollout's values. `t`: a tensor on the device in question.
pub fn grouped_moe_matches_loop<const D: usize>(t: &Tensor<D>) -> bool {
    <Dispatch as QuantMatmulBackend>::grouped_moe_matches_loop(&t.clone().into_dispatch())
}

/// Whether `t` is part of a recorded autodiff graph (a gradient will flow through it). Always `false` on
/// an inference backend.
pub fn tracks_gradients<const D: usize>(t: &Tensor<D>) -> bool {
    <Dispatch as QuantMatmulBackend>::tracks_gradients(&t.clone().into_dispatch())
}

static GROUPED_EXPERTS: AtomicBool = AtomicBool::new(true);

/// Whether MoE layers use the grouped op where the backend has one (the default), or always the per-expert
/// loop (`qarl bench rollout --moe-experts loop` times the two side by side).
pub fn set_grouped_experts(on: bool) {
    GROUPED_EXPERTS.store(on, Ordering::Relaxed);
}

pub fn grouped_experts() -> bool {
    GROUPED_EXPERTS.load(Ordering::Relaxed)
}
