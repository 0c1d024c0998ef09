//! The registry of policy objectives (docs/objectives.md): one file per objective under `objectives/`, one
//! line per objective in [`REGISTRY`] (plus the file's `mod` line, which Rust needs to find it), and the pieces
//! several objectives share.
//!
//! An objective file declares its config fields with their defaults (a slice of
//! [`ParamSpec`](super::ParamSpec)), an [`ObjectiveSpec`] that reads them, a typed constructor on
//! [`Objective`](super::Objective) and a pure function from log-probs and advantages to a per-token loss
//! (`-objective`) plus the clip indicators the metrics need. Sequence-level objectives put their sequence
//! ratio on every token in verl's per-token form ([`seq_ratios`]): each token's loss has the
//! sequence's value and the gradient of its own log-prob alone, so a per-token correction weight (token TIS,
//! MIS, IcePop) scales its own token's gradient, as in verl. Aggregated with `seq-mean-token-mean` the loss is
//! exactly `mean_i l_i`, and with weight 1 everywhere every aggregation has the gradient of the sequence loss
//! `l_i(s_i)` repeated on its tokens.

use burn::tensor::Tensor;

use super::spec::ObjectiveSpec;
use crate::rl::tensor_ops::{bounded_exp, masked_row_mean, select};

pub mod cispo;
pub mod gspo;
pub mod positive_only;
pub mod ppo_clip;
pub mod tbpo;

/// The registry: every objective, one line each, in the order that error messages and docs list them. A
/// name is served by exactly one entry; one file may serve several names (`ppo_clip` and `grpo`).
pub static REGISTRY: &[&ObjectiveSpec] = &[
    &ppo_clip::PPO_CLIP,
    &ppo_clip::GRPO,
    &gspo::GSPO,
    &cispo::CISPO,
    &tbpo::TBPO,
    &positive_only::POSITIVE_ONLY,
];

/// GSPO's and TBPO's sequence ratio `s_i = exp(mean_t(lp_theta - lp_old))` (the geometric mean of the token
/// ratios, so its size does not grow with the response length), bounded as a log-ratio, from one row mean:
/// - per sequence, `[B, 1]`, detached: what the clip indicators read;
/// - on every token in verl's per-token form (its `compute_policy_loss_gspo`), `[B, T]`:
///   `exp(sg(log s_i) + lp_theta_t - sg(lp_theta_t))`, whose value on every token is `s_i` bit for bit
///   (`lp_theta_t - sg(lp_theta_t)` is exactly 0) and whose gradient on token `t` is `s_i d lp_theta_t`, the
///   token's own share of `d s_i` times the length. Aggregated, the per-token copies give the sequence loss's
///   gradient, and a per-token weight lands on its own token instead of being averaged over the sequence (the
///   form that repeats `l_i(s_i)` on every token would give every token the mean weight, so a token IcePop
///   rejected would still be trained).
pub fn seq_ratios(
    lp_theta: Tensor<2>,
    lp_old: Tensor<2>,
    mask: &Tensor<2>,
) -> (Tensor<2>, Tensor<2>) {
    let [b, t] = lp_theta.dims();
    let log_s = masked_row_mean(lp_theta.clone() - lp_old, mask).detach();
    let own = lp_theta.clone() - lp_theta.detach();
    (
        bounded_exp(log_s.clone()),
        bounded_exp(log_s.expand([b, t]) + own),
    )
}

/// `max(-A r, -A clip(r, lo, hi))`, i.e. `-min(r A, clip(r) A)`, and where the clipped branch won (strictly:
/// inside the band both branches are equal and the gradient flows through `r`).
pub fn pessimistic_clip(
    ratio: Tensor<2>,
    adv: Tensor<2>,
    lo: f32,
    hi: f32,
) -> (Tensor<2>, Tensor<2>) {
    let unclipped = adv.clone().neg() * ratio.clone();
    let clipped = adv.neg() * ratio.clamp(lo, hi);
    let clip_active = clipped.clone().greater(unclipped.clone());
    (
        select(clip_active.clone(), clipped, unclipped),
        clip_active.float(),
    )
}
