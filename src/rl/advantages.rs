//! Group-relative advantages (docs/objectives.md, "Advantages") and DAPO's dynamic-sampling filter.
//!
//! Rewards arrive flat, `G` consecutive responses per prompt (`rewards[g * G + i]` is response `i` of prompt `g`),
//! which is how the rollout engine lays out a batch of `n` samples per prompt. They are a few floats per prompt,
//! so everything here runs on the host in f64 and returns one f32 advantage per response; the trainer broadcasts
//! it over the response's tokens.

use serde::{Deserialize, Serialize};

use super::RlError;

/// Which baseline (and scale) turns a group's rewards into advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// GRPO: `A_i = (R_i - mean R) / (std R + eps)`.
    #[default]
    Grpo,
    /// Dr.GRPO: `A_i = R_i - mean R`. Dropping the std removes GRPO's bias towards groups that are almost all
    /// right or all wrong; this is what "std-free GRPO" means too, hence the alias.
    #[serde(alias = "std_free")]
    DrGrpo,
    /// RLOO: `A_i = R_i - mean_{j != i} R_j = G / (G - 1) (R_i - mean R)`, a baseline that does not contain the
    /// response's own reward, so the estimator stays unbiased.
    Rloo,
}

impl AdvantageEstimator {
    /// The name a config spells it with.
    pub fn name(self) -> &'static str {
        match self {
            AdvantageEstimator::Grpo => "grpo",
            AdvantageEstimator::DrGrpo => "dr_grpo",
            AdvantageEstimator::Rloo => "rloo",
        }
    }
}

/// Which standard deviation GRPO divides by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StdKind {
    /// Bessel-corrected (divides by `G - 1`): `torch.std`'s default, so what verl's GRPO uses.
    #[default]
    Sample,
    /// Divides by `G` (`numpy.std`'s default, TRL's older GRPO).
    Population,
}

/// `[advantage]` section of a run config, e.g. `{"estimator": "grpo", "std": "population"}`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdvantageConfig {
    /// `grpo` (the default, also where the table sets only `std` or `eps`), `dr_grpo` (alias `std_free`)
    /// or `rloo`.
    #[serde(default)]
    pub estimator: AdvantageEstimator,
    /// GRPO only: `sample` (default, verl) or `population`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub std: Option<StdKind>,
    /// GRPO only: added to the std so that a near-constant group does not blow up (default 1e-6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f32>,
}

/// GRPO's default `eps`.
pub const GRPO_STD_EPS: f32 = 1e-6;

impl AdvantageConfig {
    /// GRPO as verl runs it: sample std, eps 1e-6.
    pub fn grpo() -> Self {
        Self {
            estimator: AdvantageEstimator::Grpo,
            std: None,
            eps: None,
        }
    }

    /// A config with only the estimator set.
    pub fn new(estimator: AdvantageEstimator) -> Self {
        Self {
            estimator,
            std: None,
            eps: None,
        }
    }

    /// The same config with GRPO's defaults (`std = "sample"`, `eps` [`GRPO_STD_EPS`]) written out where
    /// the estimator is GRPO (the other estimators take neither): what `qarl config show` prints.
    pub fn with_defaults(&self) -> Self {
        let mut filled = self.clone();
        if self.estimator == AdvantageEstimator::Grpo {
            filled.std.get_or_insert_with(StdKind::default);
            filled.eps.get_or_insert(GRPO_STD_EPS);
        }
        filled
    }

    /// Checks that the GRPO-only fields are not set on another estimator and that `eps` is usable.
    pub fn validate(&self) -> Result<(), RlError> {
        if self.estimator != AdvantageEstimator::Grpo {
            for (name, set) in [("std", self.std.is_some()), ("eps", self.eps.is_some())] {
                if set {
                    return Err(RlError::Config(format!(
                        "advantage field `{name}` only applies to estimator `grpo`, not `{}`",
                        self.estimator.name()
                    )));
                }
            }
        }
        if let Some(eps) = self.eps {
            // A group of equal rewards has std 0 and deviations 0: with eps 0 its advantages are 0 / 0.
            if !(eps.is_finite() && eps > 0.0) {
                return Err(RlError::Config(format!(
                    "advantage `eps` must be finite and > 0 (a group of equal rewards has std 0), got {eps}"
                )));
            }
        }
        Ok(())
    }
}

/// Checks `rewards` against `group_size`: at least two responses per group (one response has no group
/// baseline), a whole number of groups, finite values.
fn check_groups(rewards: &[f32], group_size: usize) -> Result<(), RlError> {
    if group_size < 2 {
        return Err(RlError::Input(format!(
            "group-relative advantages need at least 2 responses per prompt, got group size {group_size}"
        )));
    }
    if !rewards.len().is_multiple_of(group_size) {
        return Err(RlError::Input(format!(
            "{} rewards do not split into groups of {group_size}",
            rewards.len()
        )));
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(RlError::Input(format!(
            "reward {i} is not finite: {}",
            rewards[i]
        )));
    }
    Ok(())
}

/// One advantage per response, computed within each group of `group_size` consecutive rewards.
pub fn group_advantages(
    rewards: &[f32],
    group_size: usize,
    config: &AdvantageConfig,
) -> Result<Vec<f32>, RlError> {
    config.validate()?;
    check_groups(rewards, group_size)?;
    let eps = f64::from(config.eps.unwrap_or(GRPO_STD_EPS));
    let std_kind = config.std.unwrap_or_default();
    let g = group_size as f64;
    let mut out = Vec::with_capacity(rewards.len());
    for group in rewards.chunks(group_size) {
        let mean = group.iter().map(|&r| f64::from(r)).sum::<f64>() / g;
        let scale = match config.estimator {
            AdvantageEstimator::Grpo => {
                let squares: f64 = group.iter().map(|&r| (f64::from(r) - mean).powi(2)).sum();
                let dof = match std_kind {
                    StdKind::Sample => g - 1.0,
                    StdKind::Population => g,
                };
                1.0 / ((squares / dof).sqrt() + eps)
            }
            AdvantageEstimator::DrGrpo => 1.0,
            AdvantageEstimator::Rloo => g / (g - 1.0),
        };
        out.extend(
            group
                .iter()
                .map(|&r| ((f64::from(r) - mean) * scale) as f32),
        );
    }
    Ok(out)
}

/// DAPO dynamic sampling: the indices of the groups whose rewards are not all equal. A group where every
/// response got the same reward has zero advantage everywhere and only dilutes the batch; the trainer drops it
/// (it does not sample more prompts to refill the batch: a step trains on the groups left, as
/// `docs/objectives.md` says). "Equal" is exact float equality, which is what
/// verl's `std > 0` test amounts to for the usual 0/1 rewards.
pub fn groups_with_signal(rewards: &[f32], group_size: usize) -> Result<Vec<usize>, RlError> {
    check_groups(rewards, group_size)?;
    Ok(rewards
        .chunks(group_size)
        .enumerate()
        .filter(|(_, group)| group.iter().any(|&r| r != group[0]))
        .map(|(g, _)| g)
        .collect())
}

/// The response indices (into the flat batch) of the given groups, in order: what to keep after
/// [`groups_with_signal`].
pub fn responses_of_groups(groups: &[usize], group_size: usize) -> Vec<usize> {
    groups
        .iter()
        .flat_map(|&g| g * group_size..(g + 1) * group_size)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Errors name an estimator as a config spells it (they printed the Rust name, `Rloo`).
    #[test]
    fn estimator_names_are_the_config_spellings() {
        use AdvantageEstimator::*;
        for e in [Grpo, DrGrpo, Rloo] {
            assert_eq!(
                serde_json::to_string(&e).unwrap(),
                format!("\"{}\"", e.name())
            );
        }
        let mut rloo = AdvantageConfig::grpo();
        rloo.estimator = Rloo;
        rloo.std = Some(StdKind::Sample);
        let err = rloo.validate().unwrap_err().to_string();
        assert!(err.contains("not `rloo`"), "{err}");
    }

    #[test]
    fn with_defaults_writes_grpo_defaults_only_for_grpo() {
        let grpo = AdvantageConfig::grpo().with_defaults();
        assert_eq!(
            (grpo.std, grpo.eps),
            (Some(StdKind::Sample), Some(GRPO_STD_EPS))
        );
        let rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0];
        assert_eq!(
            group_advantages(&rewards, 3, &grpo).unwrap(),
            group_advantages(&rewards, 3, &AdvantageConfig::grpo()).unwrap()
        );
        let rloo = AdvantageConfig::new(AdvantageEstimator::Rloo);
        assert_eq!(rloo.with_defaults(), rloo);
        rloo.with_defaults().validate().unwrap();
    }
}
