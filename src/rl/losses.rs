//! The policy loss: one registered objective chosen by name (`ppo_clip`, `grpo`, `gspo`, `cispo`, `tbpo`, ...:
//! [`registered_names`]; adding one is a file under `losses/objectives/` and a line in [`REGISTRY`], see
//! docs/objectives.md), optional mismatch corrections, an aggregation (`token-mean`, `seq-mean-token-mean`, `seq-mean-token-sum`) and an optional k3 KL
//! to a reference policy, in the three-policy form of docs/objectives.md:
//!
//! - `lp_theta`: the current policy's token log-probs, with gradient;
//! - `lp_old`: the learner's forward at the start of the step (the proximal policy of the trust region);
//! - `lp_roll`: what the sampler recorded (only the mismatch corrections and TBPO's weight use it).
//!
//! ```no_run
//! # use qarl::rl::losses::*;
//! # fn demo(inputs: PolicyLossInputs) -> Result<(), qarl::rl::RlError> {
//! let config: LossConfig = serde_json::from_str(r#"{"objective": "tbpo"}"#).unwrap();
//! let loss = config.resolve()?;
//! let out = loss.compute(inputs)?;
//! let grads = out.loss.backward();
//! println!("{:?}", out.metrics.to_map());
//! # Ok(()) }
//! ```

mod config;
pub mod objectives;
mod params;
mod registry;
mod spec;

use std::collections::BTreeMap;

use burn::tensor::Tensor;
use serde::Serialize;

pub use config::{LossConfig, PolicyLoss};
pub use objectives::cispo::cispo;
pub use objectives::gspo::{gspo, SeqClip};
pub use objectives::ppo_clip::{ppo_clip, TokenClip};
pub use objectives::tbpo::{tbpo, TrustBand};
pub use objectives::{seq_ratios, REGISTRY};
pub use params::ObjectiveParams;
pub use registry::{known_fields, lookup, registered_names, ObjectiveName};
pub use spec::{
    KlType, LossAggMode, Objective, ObjectiveInputs, ObjectiveSpec, ObjectiveTerms, ParamKind,
    ParamSpec, ParamValue, Params, Range, TermsFn, COMMON_FIELDS,
};

use super::corrections::mismatch_correction;
use super::tensor_ops::{
    bounded_exp, masked_mean, masked_row_mean, masked_row_sum, mean_over_valid_rows, valid_rows,
    zero_outside, LOG_RATIO_BOUND,
};
use super::RlError;
use crate::host::to_f32_vec;

/// Everything the loss reads, all on the same device (the autodiff one when a gradient is wanted). Only
/// `lp_theta` should carry gradient; the others are detached here anyway.
#[derive(Debug, Clone)]
pub struct PolicyLossInputs {
    /// `[B, T]`, current policy.
    pub lp_theta: Tensor<2>,
    /// `[B, T]`, learner at the start of the step.
    pub lp_old: Tensor<2>,
    /// `[B, T]`, sampler.
    pub lp_roll: Tensor<2>,
    /// `[B, T]`, 1.0 on response tokens, 0.0 on prompt and padding. Values at masked positions are ignored
    /// (they may even be inf).
    pub mask: Tensor<2>,
    /// `[B]`, one advantage per sequence.
    pub advantages: Tensor<1>,
    /// `[B, T]`, reference policy; required when `kl_coef > 0`.
    pub lp_ref: Option<Tensor<2>>,
}

/// The scalar loss to back-propagate and what to log about it.
#[derive(Debug, Clone)]
pub struct PolicyLossOutput {
    /// `[1]`: policy loss + `kl_coef` * KL loss.
    pub loss: Tensor<1>,
    pub metrics: LossMetrics,
}

/// Per-step loss statistics, serialised under verl's names (`actor/...`). Fractions and means are over the
/// response tokens (or sequences) that survived the corrections' rejections.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LossMetrics {
    /// Aggregated policy loss (without the KL term).
    #[serde(rename = "actor/pg_loss")]
    pub pg_loss: f64,
    /// Fraction of terms whose clipped branch is in force: tokens for token-level objectives, sequences for
    /// GSPO/TBPO (for TBPO both positive sequences clipped and negative ones outside the band). For CISPO:
    /// tokens whose weight was clipped.
    #[serde(rename = "actor/pg_clipfrac")]
    pub pg_clipfrac: f64,
    /// Fraction of terms with a negative advantage clipped on the far side: PPO's dual clip (tokens), TBPO's
    /// negative sequences outside the trust band (over all sequences, as verl normalises its dual-clip fraction).
    #[serde(rename = "actor/pg_clipfrac_lower")]
    pub pg_clipfrac_lower: f64,
    /// `mean_t(lp_old - lp_theta)`: how far the update has moved (0 on the first minibatch).
    #[serde(rename = "actor/ppo_kl")]
    pub ppo_kl: f64,
    /// Mean over sequences of `s_i = exp(mean_t(lp_theta - lp_old))`.
    #[serde(rename = "actor/seq_ratio_mean")]
    pub seq_ratio_mean: f64,
    /// Mean over sequences of the per-sequence mean of the mismatch weight applied (correction weights times
    /// TBPO's `w_i`; 1 when there is none).
    #[serde(rename = "actor/mismatch_weight_mean")]
    pub mismatch_weight_mean: f64,
    /// Fraction of response tokens kept by the rejections (1 when nothing rejects).
    #[serde(rename = "actor/kept_token_frac")]
    pub kept_token_frac: f64,
    /// Aggregated KL estimate to the reference (`kl_type`), when enabled.
    #[serde(rename = "actor/kl_loss", skip_serializing_if = "Option::is_none")]
    pub kl_loss: Option<f64>,
    /// Response tokens in the loss, the `token-mean` denominator (to rescale when accumulating micro-batches).
    #[serde(rename = "actor/loss_tokens")]
    pub loss_tokens: f64,
    /// Sequences with at least one token in the loss, the denominator of the `seq-mean-*` modes.
    #[serde(rename = "actor/loss_sequences")]
    pub loss_sequences: f64,
}

impl LossMetrics {
    /// Name -> value, ready to merge into a step's log line.
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(fields)) => fields
                .into_iter()
                .filter_map(|(name, value)| value.as_f64().map(|v| (name, v)))
                .collect(),
            _ => BTreeMap::new(),
        }
    }
}

/// Reduces a per-token loss `[B, T]` to a scalar `[1]` over the response tokens of `mask`. Sequences without
/// response tokens do not count in the `seq-mean-*` denominators; an empty batch gives 0.
pub fn aggregate(loss: Tensor<2>, mask: &Tensor<2>, mode: LossAggMode, divisor: f32) -> Tensor<1> {
    match mode {
        LossAggMode::TokenMean => masked_mean(loss, mask),
        LossAggMode::SeqMeanTokenMean => mean_over_valid_rows(masked_row_mean(loss, mask), mask),
        LossAggMode::SeqMeanTokenSum => {
            mean_over_valid_rows(masked_row_sum(loss, mask) / divisor, mask)
        }
    }
}

/// The k3 estimator of KL(pi_theta || pi_ref) per token: `exp(lp_ref - lp_theta) - (lp_ref - lp_theta) - 1`,
/// always >= 0, with verl's safety clamps (log-ratio to +-20, value to at most 10). Unbiased only for
/// tokens sampled from pi_theta and without the clamps; here the tokens are the rollout's (as in verl's
/// `low_var_kl`).
pub fn k3_kl(lp_theta: Tensor<2>, lp_ref: Tensor<2>) -> Tensor<2> {
    let log_ratio = (lp_ref - lp_theta).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND);
    (log_ratio.clone().exp() - log_ratio - 1.0).clamp_max(10.0)
}

/// The per-token KL estimate of `kind` (verl's `kl_penalty`): with `d = lp_theta - lp_ref`, `d` (k1), `|d|`
/// (abs), `d^2 / 2` (k2), or [`k3_kl`]; a straight-through kind has its value estimator's value and k2's
/// gradient (`k2 - detach(k2) + detach(value)`: the value's bits, since `k2 - detach(k2)` is exactly 0).
pub fn kl_estimate(kind: KlType, lp_theta: Tensor<2>, lp_ref: Tensor<2>) -> Tensor<2> {
    let k2 = |lp_theta: Tensor<2>, lp_ref: Tensor<2>| (lp_theta - lp_ref).powi_scalar(2) * 0.5;
    let value = match kind {
        KlType::K1 | KlType::K1StraightThrough => lp_theta.clone() - lp_ref.clone(),
        KlType::Abs | KlType::AbsStraightThrough => (lp_theta.clone() - lp_ref.clone()).abs(),
        KlType::K2 => k2(lp_theta.clone(), lp_ref.clone()),
        KlType::K3 | KlType::K3StraightThrough => k3_kl(lp_theta.clone(), lp_ref.clone()),
    };
    if !kind.straight_through() {
        return value;
    }
    let gradient = k2(lp_theta, lp_ref);
    gradient.clone() - gradient.detach() + value.detach()
}

fn same_dims(name: &str, got: [usize; 2], want: [usize; 2]) -> Result<(), RlError> {
    if got == want {
        Ok(())
    } else {
        Err(RlError::Input(format!(
            "`{name}` is {got:?}, `lp_theta` is {want:?}"
        )))
    }
}

impl PolicyLoss {
    /// The loss and its metrics. One host read-back (the metrics); the loss stays on the device.
    pub fn compute(&self, inputs: PolicyLossInputs) -> Result<PolicyLossOutput, RlError> {
        let dims = inputs.lp_theta.dims();
        same_dims("lp_old", inputs.lp_old.dims(), dims)?;
        same_dims("lp_roll", inputs.lp_roll.dims(), dims)?;
        same_dims("mask", inputs.mask.dims(), dims)?;
        if let Some(lp_ref) = &inputs.lp_ref {
            same_dims("lp_ref", lp_ref.dims(), dims)?;
        }
        if inputs.advantages.dims() != [dims[0]] {
            return Err(RlError::Input(format!(
                "`advantages` is {:?}, expected [{}]",
                inputs.advantages.dims(),
                dims[0]
            )));
        }
        let lp_ref = match (self.kl_coef > 0.0, inputs.lp_ref) {
            (true, None) => {
                return Err(RlError::Input(
                    "`kl_coef` > 0 needs `lp_ref`, the reference policy's log-probs".into(),
                ))
            }
            (true, Some(lp_ref)) => Some(lp_ref),
            (false, _) => None,
        };

        let mask = inputs.mask.detach();
        // Zero the padding first: whatever sits there (even inf) can then not leak into a sum or a gradient.
        let lp_theta = zero_outside(inputs.lp_theta, &mask);
        let lp_old = zero_outside(inputs.lp_old.detach(), &mask);
        let lp_roll = zero_outside(inputs.lp_roll.detach(), &mask);
        let adv = inputs.advantages.detach().unsqueeze_dim::<2>(1);

        let correction =
            mismatch_correction(&self.corrections, lp_old.clone(), lp_roll.clone(), &mask);
        let mut loss_mask = mask.clone() * correction.keep;
        let terms = self.objective.terms(ObjectiveInputs {
            lp_theta: lp_theta.clone(),
            lp_old: lp_old.clone(),
            lp_roll,
            mask: &loss_mask,
            adv,
        });
        let mut weight = correction.weight;
        if let Some(seq_weight) = terms.seq_weight {
            weight = weight * seq_weight;
        }
        if let Some(seq_keep) = terms.seq_keep {
            loss_mask = loss_mask * seq_keep;
        }

        let pg_loss = aggregate(
            terms.loss * weight.clone(),
            &loss_mask,
            self.agg,
            self.agg_divisor,
        );
        let kl_loss = lp_ref.map(|lp_ref| {
            let lp_ref = zero_outside(lp_ref.detach(), &mask);
            aggregate(
                kl_estimate(self.kl_type, lp_theta.clone(), lp_ref),
                &loss_mask,
                self.agg,
                self.agg_divisor,
            )
        });
        let loss = match &kl_loss {
            Some(kl) => pg_loss.clone() + kl.clone() * self.kl_coef,
            None => pg_loss.clone(),
        };

        // Metrics, all from detached values, read back in one transfer.
        let per_seq = |flags: Tensor<2>| -> Tensor<1> {
            if flags.dims()[1] == 1 {
                mean_over_valid_rows(flags, &loss_mask)
            } else {
                masked_mean(flags, &loss_mask)
            }
        };
        let theta = lp_theta.detach();
        let mut scalars = vec![
            pg_loss.detach(),
            per_seq(terms.clipped),
            per_seq(terms.clipped_lower),
            // verl's `ppo_kl`: the mean of the clamped log-ratio its ratio is built from.
            masked_mean(
                (lp_old.clone() - theta.clone()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND),
                &loss_mask,
            ),
            mean_over_valid_rows(
                bounded_exp(masked_row_mean(theta - lp_old, &loss_mask)),
                &loss_mask,
            ),
            mean_over_valid_rows(masked_row_mean(weight, &loss_mask), &loss_mask),
            loss_mask.clone().sum() / mask.clone().sum().clamp_min(1.0),
            loss_mask.clone().sum(),
            valid_rows(&loss_mask).sum(),
        ];
        if let Some(kl) = &kl_loss {
            scalars.push(kl.clone().detach());
        }
        let values: Vec<f64> = to_f32_vec(Tensor::cat(scalars, 0))
            .into_iter()
            .map(f64::from)
            .collect();
        let metrics = LossMetrics {
            pg_loss: values[0],
            pg_clipfrac: values[1],
            pg_clipfrac_lower: values[2],
            ppo_kl: values[3],
            seq_ratio_mean: values[4],
            mismatch_weight_mean: values[5],
            kept_token_frac: values[6],
            loss_tokens: values[7],
            loss_sequences: values[8],
            kl_loss: values.get(9).copied(),
        };
        Ok(PolicyLossOutput { loss, metrics })
    }
}
