//! The `[loss]` section of a run config and its resolution into a typed [`PolicyLoss`].
//!
//! The config is flat, as in verl (`objective = "tbpo"`, `seq_eps_high = 4e-4`, ...), which reads well in a
//! file. The fields every objective takes are [`LossConfig`]'s own; the others belong to the objectives, which
//! declare them with their defaults beside their code (src/rl/losses/registry.rs). Parsing rejects a field no
//! objective declares; [`LossConfig::resolve`] then fills the chosen objective's defaults and rejects any field
//! that it does not take, so a typo'd or misplaced knob is an error instead of a silent no-op.

use serde::{Deserialize, Serialize};

use super::params::ObjectiveParams;
use super::registry::ObjectiveName;
use super::spec::{KlType, LossAggMode, Objective, ObjectiveSpec, ParamKind, ParamValue, Params};
use crate::rl::corrections::CorrectionConfig;
use crate::rl::RlError;

/// `[loss]` as written in a config file. Unset fields take the chosen objective's defaults.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct LossConfig {
    /// A registered objective (`ppo_clip`, `grpo`, `gspo`, `cispo`, `tbpo`, ...; see
    /// [`registered_names`](super::registered_names)).
    pub objective: ObjectiveName,
    /// Default: the objective's (`token-mean` for `ppo_clip` and `cispo`, `seq-mean-token-mean` for the others).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_agg_mode: Option<LossAggMode>,
    /// Constant divisor of `seq-mean-token-sum` (default 1: a plain token sum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_agg_divisor: Option<f32>,
    /// Weight of the KL to a reference policy (default 0: off; needs `lp_ref` when > 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_coef: Option<f32>,
    /// The KL's per-token estimator (default `k3`, verl's `low_var_kl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_type: Option<KlType>,
    /// The objective's own fields (`eps_high`, `seq_eps_low_neg`, ...), written flat beside the common ones.
    /// Before `corrections` so that a TOML writer emits these values before that array of tables.
    #[serde(flatten)]
    pub params: ObjectiveParams,
    /// Training/rollout mismatch corrections applied on top of the objective (default none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub corrections: Vec<CorrectionConfig>,
}

/// A validated loss: what [`PolicyLoss::compute`](super::PolicyLoss::compute) runs.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLoss {
    pub objective: Objective,
    pub agg: LossAggMode,
    /// Divisor of `seq-mean-token-sum` (1 for the other modes, where it is unused).
    pub agg_divisor: f32,
    /// KL weight; 0 disables it.
    pub kl_coef: f32,
    /// The KL's per-token estimator.
    pub kl_type: KlType,
    pub corrections: Vec<CorrectionConfig>,
}

impl PolicyLoss {
    /// A loss with the given objective, aggregation, no KL and no corrections.
    pub fn new(objective: Objective, agg: LossAggMode) -> Self {
        Self {
            objective,
            agg,
            agg_divisor: 1.0,
            kl_coef: 0.0,
            kl_type: KlType::K3,
            corrections: Vec::new(),
        }
    }
}

impl LossConfig {
    /// A config with only the objective set (all defaults).
    pub fn new(objective: ObjectiveName) -> Self {
        Self {
            objective,
            loss_agg_mode: None,
            loss_agg_divisor: None,
            kl_coef: None,
            kl_type: None,
            params: ObjectiveParams::default(),
            corrections: Vec::new(),
        }
    }

    /// The KL term's weight (`kl_coef`, 0 when unset: off).
    pub fn kl_weight(&self) -> f32 {
        self.kl_coef.unwrap_or(0.0)
    }

    /// The same config with the objective field `key` (a name or alias) set; checked by [`Self::resolve`].
    pub fn with(mut self, key: &str, value: impl Into<ParamValue>) -> Self {
        self.params.set(key, value);
        self
    }

    /// The same config with every default [`Self::resolve`] would fill in written out: the objective's
    /// own fields, its `loss_agg_mode`, `kl_coef` 0 and (for `seq-mean-token-sum`) the divisor 1. What
    /// `qarl config show` prints, so that a user sees the values a run uses without reading the
    /// objective's code. Resolving it gives the same loss. Fields without a default (options that stay off
    /// unless given) are left out: [`Self::unset_options`] names them.
    pub fn with_defaults(&self) -> Self {
        let spec = self.objective.spec();
        let mut filled = self.clone();
        for field in spec.params {
            // A field given under an alias is written under its name: a run made with
            // `seq_clip_ratio_high` and resumed with `seq_eps_high` (one setting) was refused as changed.
            let aliases: Vec<&str> = self
                .params
                .iter()
                .map(|(key, _)| key)
                .filter(|key| *key != field.name && field.answers_to(key))
                .collect();
            if let [alias] = aliases[..] {
                filled.params.rename(alias, field.name);
            }
            if self.params.iter().any(|(key, _)| field.answers_to(key)) {
                continue;
            }
            match field.kind {
                ParamKind::Float {
                    default: Some(x), ..
                } => filled.params.set(field.name, ParamValue::shortest(x)),
                ParamKind::Flag { default } => filled.params.set(field.name, default),
                ParamKind::Float { default: None, .. } => {}
            }
        }
        let agg = *filled.loss_agg_mode.get_or_insert(spec.default_agg);
        if agg == LossAggMode::SeqMeanTokenSum {
            filled.loss_agg_divisor.get_or_insert(1.0);
        }
        filled.kl_coef.get_or_insert(0.0);
        filled.kl_type.get_or_insert(KlType::K3);
        filled
    }

    /// The chosen objective's fields that have no default and are not set (off unless given).
    pub fn unset_options(&self) -> Vec<&'static str> {
        let spec = self.objective.spec();
        spec.params
            .iter()
            .filter(|f| matches!(f.kind, ParamKind::Float { default: None, .. }))
            .filter(|f| !self.params.iter().any(|(key, _)| f.answers_to(key)))
            .map(|f| f.name)
            .collect()
    }

    /// Builds the objective from its fields (defaults filled, ranges checked, fields that it does not take
    /// rejected), then checks the common fields.
    pub fn resolve(&self) -> Result<PolicyLoss, RlError> {
        let spec = self.objective.spec();
        let objective = (spec.build)(&Params::new(spec, self.params.iter())?)?;
        let agg = self.loss_agg_mode.unwrap_or(spec.default_agg);
        let agg_divisor = match (self.loss_agg_divisor, agg) {
            (None, _) => 1.0,
            (Some(d), LossAggMode::SeqMeanTokenSum) if d.is_finite() && d > 0.0 => d,
            (Some(d), LossAggMode::SeqMeanTokenSum) => {
                return Err(RlError::Config(format!(
                    "`loss_agg_divisor` must be > 0, got {d}"
                )))
            }
            (Some(_), _) => {
                return Err(RlError::Config(
                    "`loss_agg_divisor` only applies to loss_agg_mode `seq-mean-token-sum`".into(),
                ))
            }
        };
        let kl_coef = self.kl_weight();
        if !(kl_coef.is_finite() && kl_coef >= 0.0) {
            return Err(RlError::Config(format!(
                "`kl_coef` must be finite and >= 0, got {kl_coef}"
            )));
        }
        let kl_type = self.kl_type.unwrap_or_default();
        if kl_coef == 0.0 && kl_type != KlType::K3 {
            return Err(RlError::Config(format!(
                "`kl_type` = \"{kl_type}\" with `kl_coef` = 0: the KL term is off"
            )));
        }
        for correction in &self.corrections {
            correction.validate()?;
        }
        check_one_importance_weight(spec, &self.corrections)?;
        Ok(PolicyLoss {
            objective,
            agg,
            agg_divisor,
            kl_coef,
            kl_type,
            corrections: self.corrections.clone(),
        })
    }
}

/// Refuses a loss that weights by the training/rollout mismatch ratio twice (two corrections that weight,
/// or one beside an objective with its own mismatch weight, TBPO's `w_i`): their weights multiply, so
/// `token_tis` with the default `icepop` weighs a kept token by `min(rho, 2) * rho`, which no method
/// intends and verl cannot express (it takes one `rollout_is`). A rejection band beside an importance
/// weight is what such a list usually means: the band's `importance_weight = false`.
fn check_one_importance_weight(
    spec: &ObjectiveSpec,
    corrections: &[CorrectionConfig],
) -> Result<(), RlError> {
    let weighting: Vec<&str> = corrections
        .iter()
        .filter(|c| c.weights_by_ratio())
        .map(CorrectionConfig::name)
        .collect();
    let fix = "keep one importance weight and make the other corrections pure rejections \
               (`importance_weight = false` on `token_mis` / `icepop` / `seq_mis`, or `geo_rs`)";
    match weighting[..] {
        [first, second, ..] => Err(RlError::Config(format!(
            "`corrections`: `{first}` and `{second}` both weight by the mismatch ratio, and their weights \
             would multiply (`token_tis` and `icepop`: min(rho, 2) * rho); {fix}"
        ))),
        [only] if spec.weights_mismatch => Err(RlError::Config(format!(
            "`corrections`: `{only}` weights by the mismatch ratio, which the objective `{}` already \
             weights by (its `w_i`), so the two would multiply; {fix}, or leave the weight to the objective",
            spec.name
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::losses::registered_names;

    fn config(name: &str) -> LossConfig {
        LossConfig::new(name.parse().unwrap())
    }

    /// Written-out defaults are the ones `resolve` fills in: the same loss, and nothing left implicit but
    /// the options without a default.
    #[test]
    fn with_defaults_resolves_to_the_same_loss_for_every_objective() {
        for name in registered_names() {
            let bare = config(name);
            let filled = bare.with_defaults();
            assert_eq!(filled.resolve().unwrap(), bare.resolve().unwrap(), "{name}");
            assert!(
                filled.loss_agg_mode.is_some() && filled.kl_coef == Some(0.0),
                "{name}"
            );
            for field in bare.objective.spec().params {
                let written = filled.params.get(field.name).is_some();
                let optional = bare.unset_options().contains(&field.name);
                assert!(written != optional, "{name}: `{}`", field.name);
            }
            assert_eq!(
                filled.with_defaults(),
                filled,
                "{name}: filling twice changes nothing"
            );
        }
    }

    /// A field set under an alias keeps its value and is written under its name, once: the config a run
    /// records and the one a resume compares it with agree whichever spelling each used.
    #[test]
    fn with_defaults_keeps_what_was_set_even_under_an_alias() {
        let set = config("gspo").with("seq_clip_ratio_high", 5e-3);
        let filled = set.with_defaults();
        assert_eq!(
            filled.params.get("seq_eps_high"),
            Some(ParamValue::shortest(5e-3)),
            "{filled:?}"
        );
        assert_eq!(filled.params.get("seq_clip_ratio_high"), None);
        assert_eq!(
            filled,
            config("gspo").with("seq_eps_high", 5e-3).with_defaults()
        );
        assert_eq!(filled.resolve().unwrap(), set.resolve().unwrap());
        // Both spellings given: both stay, and resolving refuses the field set twice.
        let twice = config("gspo")
            .with("seq_clip_ratio_high", 5e-3)
            .with("seq_eps_high", 5e-3)
            .with_defaults();
        assert!(twice.params.get("seq_clip_ratio_high").is_some());
        assert!(twice.resolve().is_err());
        let token_sum = LossConfig {
            loss_agg_mode: Some(LossAggMode::SeqMeanTokenSum),
            ..config("grpo")
        };
        assert_eq!(token_sum.with_defaults().loss_agg_divisor, Some(1.0));
        assert_eq!(config("grpo").with_defaults().loss_agg_divisor, None);
    }

    #[test]
    fn defaults_are_written_as_their_shortest_decimal() {
        assert_eq!(ParamValue::shortest(4e-4), ParamValue::Float(0.0004));
        assert_eq!(ParamValue::shortest(0.2), ParamValue::Float(0.2));
        assert_eq!(config("ppo_clip").unset_options(), ["dual_clip_c"]);
    }
}
