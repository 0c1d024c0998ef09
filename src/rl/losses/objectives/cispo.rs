//! CISPO: a clipped, stop-gradient importance weight times `log pi`, so that no token loses its gradient.

use burn::tensor::Tensor;

use crate::rl::losses::spec::LossAggMode;
use crate::rl::losses::spec::Params;
use crate::rl::losses::spec::{Objective, ObjectiveSpec, ObjectiveTerms};
use crate::rl::tensor_ops::{bounded_exp, over_tokens};
use crate::rl::RlError;

use super::ppo_clip::{TokenClip, EPS_HIGH, EPS_LOW};

/// The token clip's widths, without the dual clip (the weight is bounded already).
pub const CISPO: ObjectiveSpec = ObjectiveSpec {
    name: "cispo",
    params: &[EPS_LOW, EPS_HIGH],
    default_agg: LossAggMode::TokenMean,
    build,
    weights_mismatch: false,
};

fn build(p: &Params) -> Result<Objective, RlError> {
    Ok(Objective::cispo(TokenClip {
        eps_low: p.float(EPS_LOW.name)?,
        eps_high: p.float(EPS_HIGH.name)?,
        dual_clip_c: None,
    }))
}

impl Objective {
    /// CISPO with this weight clip (`dual_clip_c` is ignored).
    pub fn cispo(clip: TokenClip) -> Self {
        Self::new("cispo", clip, |clip, x| {
            cispo(x.lp_theta, x.lp_old, x.adv, clip)
        })
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
