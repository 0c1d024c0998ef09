//! TBPO, Trust-Band Policy Optimization (QaRL): GSPO's clip on positive sequences, a two-sided trust band on
//! negative ones, and a sequence-level weight for the remaining rollout/learner mismatch.

use burn::tensor::Tensor;

use crate::rl::losses::spec::LossAggMode;
use crate::rl::losses::spec::{Objective, ObjectiveSpec, ObjectiveTerms};
use crate::rl::losses::spec::{ParamSpec, Params, Range};
use crate::rl::tensor_ops::{bounded_exp, masked_row_mean, over_tokens, select};
use crate::rl::RlError;

use super::gspo::SEQ_EPS_HIGH;
use super::{pessimistic_clip, seq_ratios};

const PAPER: TrustBand = TrustBand::PAPER;

/// Trust band of negative sequences, lower width.
pub const SEQ_EPS_LOW_NEG: ParamSpec =
    ParamSpec::float("seq_eps_low_neg", PAPER.eps_low_neg, Range::Unit);
/// Trust band of negative sequences, upper width.
pub const SEQ_EPS_HIGH_NEG: ParamSpec =
    ParamSpec::float("seq_eps_high_neg", PAPER.eps_high_neg, Range::AtLeast(0.0));
/// Cap C of the sequence mismatch weight `w_i = min(exp(mean_t(lp_old - lp_roll)), C)`.
pub const SEQ_TIS_IMP_RATIO_CAP: ParamSpec = ParamSpec::float(
    "seq_tis_imp_ratio_cap",
    PAPER.mismatch_cap,
    Range::AtLeast(1.0),
);
/// Clamp the mismatch weight to `[1/C, C]` instead of `(0, C]`.
pub const SEQ_MISMATCH_TWO_SIDED: ParamSpec =
    ParamSpec::flag("seq_mismatch_two_sided", PAPER.two_sided);
/// Drop the sequences whose mismatch ratio lies outside `[1/C, C]`.
pub const SEQ_MISMATCH_DROP: ParamSpec =
    ParamSpec::flag("seq_mismatch_drop", PAPER.drop_outside_cap);

/// The positive sequences' clip is GSPO's upper field (the paper's 4e-4). GSPO's `seq_eps_low` is not one of
/// TBPO's: for `A_i >= 0` the lower clip is never the pessimistic branch, so it could change nothing (set
/// with `tbpo`, it is refused as a field TBPO does not read).
pub const TBPO: ObjectiveSpec = ObjectiveSpec {
    name: "tbpo",
    params: &[
        SEQ_EPS_HIGH,
        SEQ_EPS_LOW_NEG,
        SEQ_EPS_HIGH_NEG,
        SEQ_TIS_IMP_RATIO_CAP,
        SEQ_MISMATCH_TWO_SIDED,
        SEQ_MISMATCH_DROP,
    ],
    default_agg: LossAggMode::SeqMeanTokenMean,
    build,
    weights_mismatch: true,
};

/// TBPO's parameters (docs/objectives.md, "TBPO").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrustBand {
    /// Clip of positive sequences from above, `1 + eps_high` (no clip from below: it never binds there).
    pub eps_high: f32,
    /// Trust band of negative sequences, `[1 - eps_low_neg, 1 + eps_high_neg]`: outside it, no gradient.
    pub eps_low_neg: f32,
    pub eps_high_neg: f32,
    /// Cap C of the sequence mismatch weight.
    pub mismatch_cap: f32,
    /// Clamp the weight to `[1/C, C]` rather than `(0, C]`.
    pub two_sided: bool,
    /// Drop the sequences whose mismatch ratio is outside `[1/C, C]`.
    pub drop_outside_cap: bool,
}

impl TrustBand {
    /// The paper's hyper-parameters: 4e-4 (positive; its 3e-4 below never binds), 3e-4 / 7e-4 (negative),
    /// cap 2.
    pub const PAPER: TrustBand = TrustBand {
        eps_high: 4e-4,
        eps_low_neg: 3e-4,
        eps_high_neg: 7e-4,
        mismatch_cap: 2.0,
        two_sided: false,
        drop_outside_cap: false,
    };
}

fn build(p: &Params) -> Result<Objective, RlError> {
    Ok(Objective::tbpo(TrustBand {
        eps_high: p.float(SEQ_EPS_HIGH.name)?,
        eps_low_neg: p.float(SEQ_EPS_LOW_NEG.name)?,
        eps_high_neg: p.float(SEQ_EPS_HIGH_NEG.name)?,
        mismatch_cap: p.float(SEQ_TIS_IMP_RATIO_CAP.name)?,
        two_sided: p.flag(SEQ_MISMATCH_TWO_SIDED.name)?,
        drop_outside_cap: p.flag(SEQ_MISMATCH_DROP.name)?,
    }))
}

impl Objective {
    /// TBPO with these parameters.
    pub fn tbpo(band: TrustBand) -> Self {
        Self::new("tbpo", band, |band, x| {
            tbpo(x.lp_theta, x.lp_old, x.lp_roll, x.mask, x.adv, band)
        })
    }
}

/// TBPO (docs/objectives.md): GSPO's sequence ratio `s_i`, clipped from above as GSPO for `A_i >= 0`; for `A_i < 0` the
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
    let (s, r) = seq_ratios(lp_theta, lp_old.clone(), mask);
    let (_, clipped, clipped_lower) = band_terms(s, adv.clone(), band);
    let (loss, _, _) = band_terms(r, over_tokens(adv, t), band);

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
        loss,
        clipped,
        clipped_lower,
        seq_weight: Some(seq_weight),
        seq_keep,
    }
}

/// TBPO's loss, clip and lower-clip indicators for the ratio `s` and the advantage `adv` of the same shape
/// (`[B, 1]` per sequence, or `[B, T]` with the ratio on every token).
fn band_terms(s: Tensor<2>, adv: Tensor<2>, band: &TrustBand) -> (Tensor<2>, Tensor<2>, Tensor<2>) {
    // Lower bound 0: ratios are positive, so only the upper clip can bind (as GSPO's for `A_i >= 0`).
    let (positive_loss, positive_clipped) =
        pessimistic_clip(s.clone(), adv.clone(), 0.0, 1.0 + band.eps_high);
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
    (loss, clipped, clipped_lower)
}
