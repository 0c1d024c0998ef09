//! The policy objectives of docs/objectives.md, each a pure function from log-probs and advantages to a per-token
//! loss (`-objective`) plus the clip indicators the metrics need. They do not aggregate: the caller applies the
//! mismatch weights and the chosen aggregation, so every objective composes with every correction.
//!
//! Inputs: `lp_theta` `[B, T]` (differentiable), `lp_old` `[B, T]`, `mask` `[B, T]` (1 on response tokens),
//! `adv` `[B, 1]`. Sequence-level objectives repeat their per-sequence loss on every token; aggregated with
//! `seq-mean-token-mean` that is exactly `mean_i l_i`, and under any aggregation it has the same gradient as
//! verl's per-token form `sg(s_i) * exp(lp_theta_t - sg(lp_theta_t))`.

use burn::tensor::Tensor;

use super::config::{SeqClip, TokenClip, TrustBand};
use crate::rl::tensor_ops::{bounded_exp, masked_row_mean, over_tokens, select};

/// What an objective hands to the aggregation and the metrics.
#[derive(Debug, Clone)]
pub struct ObjectiveTerms {
    /// Per-token loss `[B, T]`, before mismatch weights and aggregation.
    pub loss: Tensor<2>,
    /// 1.0 where the clipped branch is in force: `[B, T]` for token-level objectives, `[B, 1]` for sequence-level
    /// ones (so that the clip fraction counts sequences, not tokens).
    pub clipped: Tensor<2>,
    /// 1.0 where a negative-advantage term is clipped from the other side: PPO's dual clip, TBPO's negative
    /// sequences outside the trust band. Same shape as `clipped`.
    pub clipped_lower: Tensor<2>,
    /// Stop-gradient per-sequence weight `[B, 1]` (TBPO's mismatch weight `w_i`).
    pub seq_weight: Option<Tensor<2>>,
    /// Per-sequence keep mask `[B, 1]` (TBPO's optional drop of sequences outside `[1/C, C]`).
    pub seq_keep: Option<Tensor<2>>,
}

/// GSPO's and TBPO's sequence ratio `s_i = exp(mean_t(lp_theta - lp_old))`, `[B, 1]`: the geometric mean of the
/// token ratios, so its size does not grow with the response length.
pub fn seq_ratio(lp_theta: Tensor<2>, lp_old: Tensor<2>, mask: &Tensor<2>) -> Tensor<2> {
    bounded_exp(masked_row_mean(lp_theta - lp_old, mask))
}

/// `max(-A r, -A clip(r, lo, hi))`, i.e. `-min(r A, clip(r) A)`, and where the clipped branch won (strictly:
/// inside the band both branches are equal and the gradient flows through `r`).
fn pessimistic_clip(ratio: Tensor<2>, adv: Tensor<2>, lo: f32, hi: f32) -> (Tensor<2>, Tensor<2>) {
    let unclipped = adv.clone().neg() * ratio.clone();
    let clipped = adv.neg() * ratio.clamp(lo, hi);
    let clip_active = clipped.clone().greater(unclipped.clone());
    (
        select(clip_active.clone(), clipped, unclipped),
        clip_active.float(),
    )
}

/// PPO-clip / GRPO, token level: `-min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)` with
/// `r_t = exp(lp_theta - lp_old)`; with dual clip, for `A < 0` the loss is capped at `-c A` (Ye et al. 2020:
/// the objective is floored at `c A`), which bounds how hard one very unlikely negative token can push.
pub fn ppo_clip(
    lp_theta: Tensor<2>,
    lp_old: Tensor<2>,
    adv: Tensor<2>,
    clip: &TokenClip,
) -> ObjectiveTerms {
    let [_, t] = lp_theta.dims();
    let adv = over_tokens(adv, t);
    let ratio = bounded_exp(lp_theta - lp_old);
    let (loss, clipped) =
        pessimistic_clip(ratio, adv.clone(), 1.0 - clip.eps_low, 1.0 + clip.eps_high);
    let (loss, clipped_lower) = match clip.dual_clip_c {
        Some(c) => {
            let cap = adv.clone().neg() * c;
            let dual_active = loss
                .clone()
                .greater(cap.clone())
                .bool_and(adv.lower_elem(0.0));
            (select(dual_active.clone(), cap, loss), dual_active.float())
        }
        None => {
            let zeros = clipped.zeros_like();
            (loss, zeros)
        }
    };
    ObjectiveTerms {
        loss,
        clipped,
        clipped_lower,
        seq_weight: None,
        seq_keep: None,
    }
}

/// GSPO, sequence level: `-min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)`.
pub fn gspo(
    lp_theta: Tensor<2>,
    lp_old: Tensor<2>,
    mask: &Tensor<2>,
    adv: Tensor<2>,
    clip: &SeqClip,
) -> ObjectiveTerms {
    let [_, t] = lp_theta.dims();
    let s = seq_ratio(lp_theta, lp_old, mask);
    let (loss, clipped) = pessimistic_clip(s, adv, 1.0 - clip.eps_low, 1.0 + clip.eps_high);
    let clipped_lower = clipped.zeros_like();
    ObjectiveTerms {
        loss: over_tokens(loss, t),
        clipped,
        clipped_lower,
        seq_weight: None,
        seq_keep: None,
    }
}

/// CISPO: `-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log pi_theta`. The clip only bounds the weight; unlike
/// PPO no token loses its gradient, which is CISPO's point (rare "fork" tokens keep contributing). Its value is
/// not comparable across objectives, only its gradient is. `clipped` marks tokens whose weight was clipped.
pub fn cispo(
    lp_theta: Tensor<2>,
    lp_old: Tensor<2>,
    adv: Tensor<2>,
    clip: &TokenClip,
) -> ObjectiveTerms {
    let [_, t] = lp_theta.dims();
    let adv = over_tokens(adv, t);
    let ratio = bounded_exp(lp_theta.clone().detach() - lp_old);
    let (lo, hi) = (1.0 - clip.eps_low, 1.0 + clip.eps_high);
    let clipped = ratio
        .clone()
        .lower_elem(lo)
        .bool_or(ratio.clone().greater_elem(hi))
        .float();
    let weight = ratio.clamp(lo, hi);
    let loss = adv.neg() * weight * lp_theta;
    let clipped_lower = clipped.zeros_like();
    ObjectiveTerms {
        loss,
        clipped,
        clipped_lower,
        seq_weight: None,
        seq_keep: None,
    }
}

/// TBPO (docs/objectives.md): GSPO's sequence ratio `s_i`, clipped as GSPO for `A_i >= 0`; for `A_i < 0` the
/// whole term is `clip(s_i, 1 - eps_low_neg, 1 + eps_high_neg) A_i`, a trust band on both sides, so a negative
/// sequence whose ratio has left the band contributes no gradient at all (the dual clip that keeps error-token
/// sequences from dominating). Each sequence is weighted by `w_i = sg(min(exp(mean_t(lp_old - lp_roll)), C))`
/// (or clamped to `[1/C, C]`), the sequence-level correction of the remaining rollout/learner mismatch; with
/// `drop_outside_cap` sequences whose mismatch ratio is outside `[1/C, C]` are dropped instead of kept.
pub fn tbpo(
    lp_theta: Tensor<2>,
    lp_old: Tensor<2>,
    lp_roll: Tensor<2>,
    mask: &Tensor<2>,
    adv: Tensor<2>,
    band: &TrustBand,
) -> ObjectiveTerms {
    let [_, t] = lp_theta.dims();
    let s = seq_ratio(lp_theta, lp_old.clone(), mask);
    let (positive_loss, positive_clipped) = pessimistic_clip(
        s.clone(),
        adv.clone(),
        1.0 - band.eps_low,
        1.0 + band.eps_high,
    );
    let (lo_neg, hi_neg) = (1.0 - band.eps_low_neg, 1.0 + band.eps_high_neg);
    let out_of_band = s
        .clone()
        .lower_elem(lo_neg)
        .bool_or(s.clone().greater_elem(hi_neg));
    let negative_loss = adv.clone().neg() * s.clamp(lo_neg, hi_neg);
    let negative = adv.lower_elem(0.0);
    let loss = select(negative.clone(), negative_loss, positive_loss);
    let clipped_lower = negative.clone().bool_and(out_of_band).float();
    let clipped = select(negative, clipped_lower.clone(), positive_clipped);

    let mismatch = bounded_exp(masked_row_mean(lp_old - lp_roll, mask)).detach();
    let cap = band.mismatch_cap;
    let seq_weight = if band.two_sided {
        mismatch.clone().clamp(1.0 / cap, cap)
    } else {
        mismatch.clone().clamp_max(cap)
    };
    let seq_keep = band.drop_outside_cap.then(|| {
        mismatch
            .clone()
            .greater_equal_elem(1.0 / cap)
            .bool_and(mismatch.lower_equal_elem(cap))
            .float()
    });
    ObjectiveTerms {
        loss: over_tokens(loss, t),
        clipped,
        clipped_lower,
        seq_weight: Some(seq_weight),
        seq_keep,
    }
}
