//! Positive-only: the QaRL paper's "positive-only" ablation, learning from the positive sequences alone.
//!
//! The paper names the ablation ("positive-only GRPO ... worse than TBPO") without a formula, so this is the
//! reading that isolates what TBPO adds on negative sequences: TBPO's (= GSPO's) positive branch, unchanged,
//! and nothing for `A_i <= 0`:
//!
//! ```text
//! A_i > 0:   l_i = max(-A_i s_i, -A_i min(s_i, 1 + seq_eps_high))
//! A_i <= 0:  l_i = 0            (no value, exactly no gradient)
//! ```
//!
//! Negative sequences stay in the loss mask, so they still count in the `seq-mean-*` denominators: a positive
//! sequence gets the same gradient as under GSPO on the same batch. No mismatch weight of its own; the
//! corrections compose with it as with any objective.

use burn::tensor::Tensor;

use crate::rl::losses::spec::LossAggMode;
use crate::rl::losses::spec::Params;
use crate::rl::losses::spec::{Objective, ObjectiveSpec, ObjectiveTerms};
use crate::rl::tensor_ops::{over_tokens, select};
use crate::rl::RlError;

use super::gspo::SEQ_EPS_HIGH;
use super::{pessimistic_clip, seq_ratios};

/// GSPO's upper field and default (4e-4, `seq_clip_ratio_high` accepted), GSPO's aggregation. GSPO's
/// `seq_eps_low` is not one of its fields: for `A_i > 0` the lower clip never binds (set, it is refused).
pub const POSITIVE_ONLY: ObjectiveSpec = ObjectiveSpec {
    name: "positive_only",
    params: &[SEQ_EPS_HIGH],
    default_agg: LossAggMode::SeqMeanTokenMean,
    build,
    weights_mismatch: false,
};

fn build(p: &Params) -> Result<Objective, RlError> {
    Ok(Objective::positive_only(p.float(SEQ_EPS_HIGH.name)?))
}

impl Objective {
    /// Positive-only with this upper width of the sequence clip.
    pub fn positive_only(eps_high: f32) -> Self {
        Self::new("positive_only", eps_high, |&eps_high, x| {
            positive_only(x.lp_theta, x.lp_old, x.mask, x.adv, eps_high)
        })
    }
}

/// GSPO's clipped sequence loss where `A_i > 0`, 0 elsewhere; `clipped` counts only positive sequences, and
/// there is no lower clip (as TBPO's positive branch: one could change nothing where `A_i > 0`). The zero
/// is selected, not multiplied in, so a non-finite term of a negative sequence can not leak into the loss
/// or its gradient.
pub fn positive_only(
    lp_theta: Tensor<2>,
    lp_old: Tensor<2>,
    mask: &Tensor<2>,
    adv: Tensor<2>,
    eps_high: f32,
) -> ObjectiveTerms {
    let [_, t] = lp_theta.dims();
    let (s, r) = seq_ratios(lp_theta, lp_old, mask);
    // Lower bound 0: ratios are positive, so only the upper clip can bind.
    let (_, clipped) = pessimistic_clip(s, adv.clone(), 0.0, 1.0 + eps_high);
    let adv_tokens = over_tokens(adv.clone(), t);
    let (loss, _) = pessimistic_clip(r, adv_tokens.clone(), 0.0, 1.0 + eps_high);
    let positive = adv.greater_elem(0.0);
    let zeros = clipped.zeros_like();
    ObjectiveTerms {
        loss: select(
            adv_tokens.greater_elem(0.0),
            loss.clone(),
            loss.zeros_like(),
        ),
        clipped: select(positive, clipped, zeros.clone()),
        clipped_lower: zeros,
        seq_weight: None,
        seq_keep: None,
    }
}
