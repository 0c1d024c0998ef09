//! Training/rollout mismatch corrections (docs/objectives.md, "Mismatch corrections"), composable with any objective.
//!
//! All of them look at `rho_t = pi_old / pi_roll = exp(lp_old - lp_roll)`, the ratio between the learner's
//! policy at the start of the step and the sampler that produced the tokens, and produce two stop-gradient
//! tensors: an importance `weight` that multiplies each token's loss, and a `keep` mask that removes tokens or
//! whole sequences from the loss (and from its denominators, as verl's rejection sampling does by editing the
//! response mask). Several corrections multiply together; each one is computed from the original response mask.
//! TBPO carries its own sequence weight (see [`crate::rl::losses`]) and needs none of these.

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::tensor_ops::{bounded_exp, masked_row_mean, masked_row_sum, over_tokens};
use super::RlError;

fn default_cap() -> f32 {
    2.0
}
fn default_true() -> bool {
    true
}
fn default_icepop_low() -> f32 {
    0.5
}
fn default_icepop_high() -> f32 {
    5.0
}
fn default_geo_low() -> f32 {
    0.999
}
fn default_geo_high() -> f32 {
    1.001
}

/// One correction, e.g. `{"kind": "token_tis", "cap": 2.0}` or `{"kind": "icepop"}`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum CorrectionConfig {
    /// Token TIS (FlashRL): weight `min(rho_t, cap)`, cap 2 by default.
    TokenTis {
        #[serde(default = "default_cap")]
        cap: f32,
    },
    /// Sequence TIS: weight `min(prod_t rho_t, cap)` on every token of the sequence.
    SeqTis {
        #[serde(default = "default_cap")]
        cap: f32,
    },
    /// Token MIS / IcePop: tokens with `rho_t` outside `[low, high]` (default `[0.5, 5]`) are rejected; the
    /// kept ones are weighted by `rho_t` when `importance_weight` (default, as in the MIS and IcePop papers) or
    /// left unweighted (pure rejection). `low = 0` gives the one-sided MIS of Yao et al. How a rejected token
    /// leaves the loss is `rejected`: dropped from the loss mask and its denominators (default), or given
    /// weight 0 while it still counts in them (verl's IcePop, `rollout_is_threshold = "low_high"`).
    #[serde(alias = "icepop")]
    TokenMis {
        #[serde(default = "default_icepop_low")]
        low: f32,
        #[serde(default = "default_icepop_high")]
        high: f32,
        #[serde(default = "default_true")]
        importance_weight: bool,
        #[serde(default)]
        rejected: Rejected,
    },
    /// Sequence MIS: sequences with `prod_t rho_t > cap` are rejected; kept ones are weighted by
    /// `prod_t rho_t` when `importance_weight` (default). `rejected` as for token MIS: a sequence dropped
    /// from the loss and its denominators (default), or given weight 0 while it still counts in them
    /// (verl's numbers, whose sequence means divide by the mini-batch's size).
    SeqMis {
        #[serde(default = "default_cap")]
        cap: f32,
        #[serde(default = "default_true")]
        importance_weight: bool,
        #[serde(default)]
        rejected: Rejected,
    },
    /// Geo-RS: a sequence is kept only if the geometric mean `exp(mean_t log rho_t)` lies in `[low, high]`
    /// (default `[0.999, 1.001]`); no weight. Being length-normalised, it does not reject long responses just for
    /// being long, which the product of sequence MIS does. `rejected` as for sequence MIS.
    GeoRs {
        #[serde(default = "default_geo_low")]
        low: f32,
        #[serde(default = "default_geo_high")]
        high: f32,
        #[serde(default)]
        rejected: Rejected,
    },
}

/// How a token that a band rejects leaves the loss. The two differ in every denominator of the
/// aggregation (`token-mean`'s token count, `seq-mean-token-mean`'s per-sequence counts), so in the loss's
/// scale and in the metrics averaged over the loss mask: with four tokens of loss 1, one rejected, `dropped`
/// gives a token mean of 3/3 = 1 and `zero_weight` 3/4 = 0.75.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejected {
    /// Out of the loss mask and its denominators (verl's rejection sampling, `rollout_rs`, edits the
    /// response mask the same way).
    #[default]
    Dropped,
    /// Weight 0, still in the loss mask (verl's IcePop weights).
    ZeroWeight,
}

impl Rejected {
    /// Takes `kept` (1 where a token stays, 0 where it is rejected) into the loss mask (`Dropped`) or the
    /// weight (`ZeroWeight`).
    fn apply(self, kept: Tensor<2>, keep: &mut Tensor<2>, weight: &mut Tensor<2>) {
        let target = match self {
            Rejected::Dropped => keep,
            Rejected::ZeroWeight => weight,
        };
        *target = target.clone() * kept;
    }
}

impl CorrectionConfig {
    /// The config name of this correction's kind.
    pub fn name(&self) -> &'static str {
        match self {
            Self::TokenTis { .. } => "token_tis",
            Self::SeqTis { .. } => "seq_tis",
            Self::TokenMis { .. } => "token_mis",
            Self::SeqMis { .. } => "seq_mis",
            Self::GeoRs { .. } => "geo_rs",
        }
    }

    /// Whether it weights kept tokens by the mismatch ratio (`rho_t`, or the sequence's product of them):
    /// the two TIS kinds always, the MIS kinds with `importance_weight`; Geo-RS never.
    pub fn weights_by_ratio(&self) -> bool {
        match *self {
            Self::TokenTis { .. } | Self::SeqTis { .. } => true,
            Self::TokenMis {
                importance_weight, ..
            }
            | Self::SeqMis {
                importance_weight, ..
            } => importance_weight,
            Self::GeoRs { .. } => false,
        }
    }

    /// Checks that caps are positive and bands are non-empty.
    pub fn validate(&self) -> Result<(), RlError> {
        let bad = |what: String| {
            Err(RlError::Config(format!(
                "correction `{}`: {what}",
                self.name()
            )))
        };
        match *self {
            Self::TokenTis { cap } | Self::SeqTis { cap } | Self::SeqMis { cap, .. } => {
                if !(cap.is_finite() && cap > 0.0) {
                    return bad(format!("`cap` must be > 0, got {cap}"));
                }
            }
            Self::TokenMis { low, high, .. } | Self::GeoRs { low, high, .. } => {
                if !(low.is_finite() && high.is_finite() && low >= 0.0 && low < high) {
                    return bad(format!("need 0 <= low < high, got low {low}, high {high}"));
                }
            }
        }
        Ok(())
    }
}

/// The combined effect of a list of corrections, both `[B, T]` and stop-gradient.
#[derive(Debug, Clone)]
pub struct MismatchCorrection {
    /// Multiplies each token's loss (1 where no correction weighs).
    pub weight: Tensor<2>,
    /// 1 for tokens that stay in the loss, 0 for rejected ones.
    pub keep: Tensor<2>,
}

/// `ln(x)` with `ln(0) = -inf`, for comparing bounds in log space (exact, and immune to the exp clamp).
fn ln_bound(x: f32) -> f32 {
    if x > 0.0 {
        x.ln()
    } else {
        f32::NEG_INFINITY
    }
}

/// Whether `log_value` lies in `[ln low, ln high]`, as a 0/1 float tensor.
fn inside<const D: usize>(log_value: Tensor<D>, low: f32, high: f32) -> Tensor<D> {
    log_value
        .clone()
        .greater_equal_elem(ln_bound(low))
        .bool_and(log_value.lower_equal_elem(ln_bound(high)))
        .float()
}

/// Applies `configs` (in any order; they multiply) to the token log-probs of the learner at the start of the
/// step (`lp_old`) and of the sampler (`lp_roll`), over the response `mask`. Inputs are detached here, so the
/// result never carries gradient.
pub fn mismatch_correction(
    configs: &[CorrectionConfig],
    lp_old: Tensor<2>,
    lp_roll: Tensor<2>,
    mask: &Tensor<2>,
) -> MismatchCorrection {
    let [_, t] = lp_old.dims();
    let log_rho = (lp_old - lp_roll).detach();
    let mut weight = log_rho.ones_like();
    let mut keep = log_rho.ones_like();
    for config in configs {
        match *config {
            CorrectionConfig::TokenTis { cap } => {
                weight = weight * bounded_exp(log_rho.clone()).clamp_max(cap);
            }
            CorrectionConfig::SeqTis { cap } => {
                let rho_seq = bounded_exp(masked_row_sum(log_rho.clone(), mask)).clamp_max(cap);
                weight = weight * over_tokens(rho_seq, t);
            }
            CorrectionConfig::TokenMis {
                low,
                high,
                importance_weight,
                rejected,
            } => {
                rejected.apply(inside(log_rho.clone(), low, high), &mut keep, &mut weight);
                if importance_weight {
                    weight = weight * bounded_exp(log_rho.clone());
                }
            }
            CorrectionConfig::SeqMis {
                cap,
                importance_weight,
                rejected,
            } => {
                let log_rho_seq = masked_row_sum(log_rho.clone(), mask);
                let kept = log_rho_seq.clone().lower_equal_elem(cap.ln()).float();
                rejected.apply(over_tokens(kept, t), &mut keep, &mut weight);
                if importance_weight {
                    weight = weight * over_tokens(bounded_exp(log_rho_seq), t);
                }
            }
            CorrectionConfig::GeoRs {
                low,
                high,
                rejected,
            } => {
                let log_geo_mean = masked_row_mean(log_rho.clone(), mask);
                let kept = over_tokens(inside(log_geo_mean, low, high), t);
                rejected.apply(kept, &mut keep, &mut weight);
            }
        }
    }
    MismatchCorrection { weight, keep }
}
