//! The registry of policy objectives (docs/objectives.md): one file per objective under `objectives/`, one
//! line per objective in [`REGISTRY`] (plus the file's `mod` line, which Rust needs to find it), and the pieces
//! several objectives share.
//!
//! An objective file declares its config fields with their defaults (a slice of
//! [`ParamSpec`](super::ParamSpec)), an [`ObjectiveSpec`] that reads them, a typed constructor on
//! [`Objective`](super::Objective) and a pure function from log-probs and advantages to a per-token loss
//! (`-objective`) plus the clip indicators the metrics need. Sequence-level objectives repeat their
//! per-sequence loss on every token; aggregated with `seq-mean-token-mean` that is exactly `mean_i l_i`, and
//! under any aggregation it has the same gradient as verl's per-token form
//! `sg(s_i) * exp(lp_theta_t - sg(lp_theta_t))`.

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

/// GSPO's and TBPO's sequence ratio `s_i = exp(mean_t(lp_theta - lp_old))`, `[B, 1]`: the geometric mean of the
/// token ratios, so its size does not grow with the response length.
pub fn seq_ratio(lp_theta: Tensor<2>, lp_old: Tensor<2>, mask: &Tensor<2>) -> Tensor<2> {
    bounded_exp(masked_row_mean(lp_theta - lp_old, mask))
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
