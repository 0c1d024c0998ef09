//! GSPO: PPO's clip on the sequence ratio `s_i` (the geometric mean of the token ratios) instead of each token's.

use burn::tensor::Tensor;

use crate::rl::losses::spec::LossAggMode;
use crate::rl::losses::spec::{Objective, ObjectiveSpec, ObjectiveTerms};
use crate::rl::losses::spec::{ParamSpec, Params, Range};
use crate::rl::tensor_ops::over_tokens;
use crate::rl::RlError;

use super::{pessimistic_clip, seq_ratios};

/// Sequence clip, lower width: `s_i` clipped to `[1 - seq_eps_low, 1 + seq_eps_high]` (GSPO's 3e-4 / 4e-4).
pub const SEQ_EPS_LOW: ParamSpec = ParamSpec::float("seq_eps_low", 3e-4, Range::Unit);
/// Sequence clip, upper width; `seq_clip_ratio_high` is the QaRL paper's name for it.
pub const SEQ_EPS_HIGH: ParamSpec = ParamSpec::float("seq_eps_high", 4e-4, Range::AtLeast(0.0))
    .with_aliases(&["seq_clip_ratio_high"]);

pub const GSPO: ObjectiveSpec = ObjectiveSpec {
    name: "gspo",
    params: &[SEQ_EPS_LOW, SEQ_EPS_HIGH],
    default_agg: LossAggMode::SeqMeanTokenMean,
    build,
    weights_mismatch: false,
};

/// GSPO's sequence-level clip (TBPO and positive-only clip their positive sequences from above alone).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeqClip {
    pub eps_low: f32,
    pub eps_high: f32,
}

impl SeqClip {
    /// The clip as declared by [`SEQ_EPS_LOW`] and [`SEQ_EPS_HIGH`], for objectives that take those fields.
    pub fn from_params(p: &Params) -> Result<Self, RlError> {
        Ok(Self {
            eps_low: p.float(SEQ_EPS_LOW.name)?,
            eps_high: p.float(SEQ_EPS_HIGH.name)?,
        })
    }
}

fn build(p: &Params) -> Result<Objective, RlError> {
    SeqClip::from_params(p).map(Objective::gspo)
}

impl Objective {
    /// GSPO with this sequence clip.
    pub fn gspo(clip: SeqClip) -> Self {
        Self::new("gspo", clip, |clip, x| {
            gspo(x.lp_theta, x.lp_old, x.mask, x.adv, clip)
        })
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
    let (lo, hi) = (1.0 - clip.eps_low, 1.0 + clip.eps_high);
    let (s, r) = seq_ratios(lp_theta, lp_old, mask);
    let (_, clipped) = pessimistic_clip(s, adv.clone(), lo, hi);
    let clipped_lower = clipped.zeros_like();
    let (loss, _) = pessimistic_clip(r, over_tokens(adv, t), lo, hi);
    ObjectiveTerms {
        loss,
        clipped,
        clipped_lower,
        seq_weight: None,
        seq_keep: None,
    }
}
