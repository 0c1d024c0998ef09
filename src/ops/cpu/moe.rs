//! The routed experts of one MoE layer on the CPU in one pass: the experts run in parallel (rayon) straight
//! on the packed weights' kernel layout ([`super::kernel::KernelWeights`]), with no per-expert tensor
//! ops (gathers, scatters, broadcasts, allocations through the backend).
//!
//! **The same bits as the per-expert loop** ([`crate::model::mlp::MoeBlock`]'s `per_expert`). Every step
//! repeats that path's arithmetic exactly:
//! - each projection is [`super::kernel::KernelWeights::matmul`], which is row-invariant (a token's output does not depend
//!   on which other tokens share the call), so computing an expert's tokens together or apart is the same;
//! - SwiGLU is `(g * sigmoid(g)) * u` with burn flex's `sigmoid` (`1 / (1 + exp(-g))` for `g >= 0`, else
//!   `e / (1 + e)` with `e = exp(g)`), as `silu(g) * u` computes it there;
//! - the combine adds `y * w` (rounded product, then the sum; no fused multiply-add) into a zeroed output,
//!   expert by expert in ascending id order, as the loop's `select_assign(.., Add)` does.
//!
//! So the training forward can keep the per-expert graph (for its gradients) and still reproduce the
//! rollout's values bit for bit; `tests/quant_layer.rs` asserts both.

use rayon::prelude::*;

use super::swiglu::silu_mul;
use crate::ops::ExpertWeights;

/// `x [n, hidden]`, `route_w [n, top_k]` and `ids[t * top_k + j]` (the expert of token `t`'s slot `j`)
/// -> `[n, hidden]`: `out[t] = sum over slots, in ascending expert order, of route_w[t, j] * expert(x[t])`.
///
/// # Panics
/// When the lengths do not match `n`, `top_k` and the experts' shapes, or an id is out of range (the
/// caller, [`crate::model::mlp::MoeBlock`], builds them consistently).
pub fn grouped_moe(
    x: &[f32],
    route_w: &[f32],
    ids: &[u32],
    top_k: usize,
    experts: &ExpertWeights,
) -> Vec<f32> {
    let [hidden, inter] = experts.dims();
    let n = x.len() / hidden.max(1);
    assert_eq!(x.len(), n * hidden, "activations must be [n, hidden]");
    assert_eq!(ids.len(), n * top_k, "one expert id per token and slot");
    assert_eq!(
        route_w.len(),
        n * top_k,
        "one routing weight per token and slot"
    );
    // (token, slot) pairs per expert, tokens ascending: the loop's grouping.
    let mut pairs: Vec<Vec<(usize, usize)>> = vec![Vec::new(); experts.len()];
    for (pos, &e) in ids.iter().enumerate() {
        assert!(
            (e as usize) < experts.len(),
            "expert id {e} out of range ({} experts)",
            experts.len()
        );
        pairs[e as usize].push((pos / top_k.max(1), pos));
    }
    let outputs: Vec<(usize, Vec<f32>)> = pairs
        .par_iter()
        .enumerate()
        .filter(|(_, p)| !p.is_empty())
        .map(|(e, p)| {
            let m = p.len();
            let mut xs = Vec::with_capacity(m * hidden);
            for &(t, _) in p {
                xs.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
            }
            let g = experts.gate[e].1.matmul(&xs, m);
            let u = experts.up[e].1.matmul(&xs, m);
            debug_assert_eq!(g.len(), m * inter);
            let h: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| silu_mul(g, u)).collect();
            (e, experts.down[e].1.matmul(&h, m))
        })
        .collect();
    let mut out = vec![0.0f32; n * hidden];
    for (e, y) in outputs {
        for (row, &(t, slot)) in pairs[e].iter().enumerate() {
            let w = route_w[slot];
            let dst = &mut out[t * hidden..(t + 1) * hidden];
            for (o, &v) in dst.iter_mut().zip(&y[row * hidden..(row + 1) * hidden]) {
                *o += v * w;
            }
        }
    }
    out
}
