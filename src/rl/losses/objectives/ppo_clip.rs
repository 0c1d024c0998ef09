//! PPO-clip and GRPO: one token-level objective under two names that differ only in their default
//! aggregation (`token-mean` for `ppo_clip`, `seq-mean-token-mean` for `grpo`, as in their papers).

use burn::tensor::Tensor;

use crate::rl::losses::spec::LossAggMode;
use crate::rl::losses::spec::{Objective, ObjectiveSpec, ObjectiveTerms};
use crate::rl::losses::spec::{ParamSpec, Params, Range};
use crate::rl::tensor_ops::{bounded_exp, over_tokens, select};
use crate::rl::RlError;

use super::pessimistic_clip;

/// Token clip, lower width: the ratio is clipped to `[1 - eps_low, 1 + eps_high]`.
pub const EPS_LOW: ParamSpec = ParamSpec::float("eps_low", 0.2, Range::Unit);
/// Token clip, upper width (DAPO's clip-higher is 0.28).
pub const EPS_HIGH: ParamSpec = ParamSpec::float("eps_high", 0.2, Range::AtLeast(0.0));
/// Dual clip: for `A < 0` the objective is floored at `c A` (c > 1, usually 3); off unless set.
pub const DUAL_CLIP_C: ParamSpec = ParamSpec::optional_float("dual_clip_c", Range::Above(1.0));

pub const PPO_CLIP: ObjectiveSpec = ObjectiveSpec {
    name: "ppo_clip",
    params: &[EPS_LOW, EPS_HIGH, DUAL_CLIP_C],
    default_agg: LossAggMode::TokenMean,
    build,
    weights_mismatch: false,
};

pub const GRPO: ObjectiveSpec = ObjectiveSpec {
    name: "grpo",
    default_agg: LossAggMode::SeqMeanTokenMean,
    ..PPO_CLIP
};

/// Token-level clip parameters (`ppo_clip`, `grpo`, `cispo`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenClip {
    pub eps_low: f32,
    pub eps_high: f32,
    /// `ppo_clip`/`grpo` only; always `None` for CISPO.
    pub dual_clip_c: Option<f32>,
}

fn build(p: &Params) -> Result<Objective, RlError> {
    Ok(Objective::ppo_clip(TokenClip {
        eps_low: p.float(EPS_LOW.name)?,
        eps_high: p.float(EPS_HIGH.name)?,
        dual_clip_c: p.optional_float(DUAL_CLIP_C.name)?,
    }))
}

impl Objective {
    /// PPO-clip / GRPO with these clip parameters.
    pub fn ppo_clip(clip: TokenClip) -> Self {
        Self::new("ppo_clip", clip, |clip, x| {
            ppo_clip(x.lp_theta, x.lp_old, x.adv, clip)
        })
    }
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
