//! The `[loss]` section of a run config and its resolution into a typed [`PolicyLoss`].
//!
//! The config is flat, as in verl (`objective = "tbpo"`, `seq_eps_high = 4e-4`, ...), which reads well in a
//! file; [`LossConfig::resolve`] then fills each objective's defaults from its paper and rejects any field that
//! does not apply to the chosen objective, so a typo'd or misplaced knob is an error instead of a silent no-op.

use serde::{Deserialize, Serialize};

use crate::rl::corrections::CorrectionConfig;
use crate::rl::RlError;

/// The policy objectives, by their config names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectiveName {
    /// Token-level PPO clip (clip-higher with `eps_low`/`eps_high`, optional dual clip).
    PpoClip,
    /// The same objective as `ppo_clip`; only its default aggregation differs (`seq-mean-token-mean`).
    Grpo,
    /// Sequence-level clip on the geometric-mean ratio.
    Gspo,
    /// Clipped, stop-gradient importance weight times `log pi`.
    Cispo,
    /// Trust-Band Policy Optimization (QaRL).
    Tbpo,
}

impl ObjectiveName {
    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            Self::PpoClip => "ppo_clip",
            Self::Grpo => "grpo",
            Self::Gspo => "gspo",
            Self::Cispo => "cispo",
            Self::Tbpo => "tbpo",
        }
    }
}

/// How per-token losses become one scalar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum LossAggMode {
    /// Sum over all response tokens / number of response tokens (DAPO): long responses weigh more.
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Mean over tokens within each sequence, then mean over sequences (GRPO).
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Sum over tokens within each sequence divided by a constant (`loss_agg_divisor`, the max response length
    /// for Dr.GRPO), then mean over sequences: no length bias.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
}

/// `[loss]` as written in a config file. Unset fields take the chosen objective's defaults.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LossConfig {
    /// `ppo_clip`, `grpo`, `gspo`, `cispo` or `tbpo`.
    pub objective: ObjectiveName,
    /// Default: `token-mean` for `ppo_clip` and `cispo`, `seq-mean-token-mean` for `grpo`, `gspo`, `tbpo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_agg_mode: Option<LossAggMode>,
    /// Constant divisor of `seq-mean-token-sum` (default 1: a plain token sum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_agg_divisor: Option<f32>,
    /// Token clip, `ppo_clip`/`grpo`/`cispo`: ratio clipped to `[1 - eps_low, 1 + eps_high]` (default 0.2 / 0.2;
    /// DAPO's clip-higher is 0.2 / 0.28).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps_low: Option<f32>,
    /// See `eps_low`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps_high: Option<f32>,
    /// Dual clip, `ppo_clip`/`grpo` only: for `A < 0` the objective is floored at `c A` (c > 1, usually 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dual_clip_c: Option<f32>,
    /// Sequence clip, `gspo`/`tbpo` (positive sequences for TBPO): `[1 - seq_eps_low, 1 + seq_eps_high]`,
    /// default 3e-4 / 4e-4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_eps_low: Option<f32>,
    /// See `seq_eps_low`. Alias `seq_clip_ratio_high` (the paper's name).
    #[serde(
        default,
        alias = "seq_clip_ratio_high",
        skip_serializing_if = "Option::is_none"
    )]
    pub seq_eps_high: Option<f32>,
    /// TBPO's trust band for negative sequences, `[1 - seq_eps_low_neg, 1 + seq_eps_high_neg]`, default 3e-4 /
    /// 7e-4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_eps_low_neg: Option<f32>,
    /// See `seq_eps_low_neg`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_eps_high_neg: Option<f32>,
    /// TBPO's cap C on the sequence mismatch weight `w_i = min(exp(mean_t(lp_old - lp_roll)), C)`, default 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_tis_imp_ratio_cap: Option<f32>,
    /// TBPO: clamp the mismatch weight to `[1/C, C]` instead of `(0, C]` (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_mismatch_two_sided: Option<bool>,
    /// TBPO: drop sequences whose mismatch ratio lies outside `[1/C, C]` (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_mismatch_drop: Option<bool>,
    /// Weight of the k3 KL to a reference policy (default 0: off; needs `lp_ref` when > 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_coef: Option<f32>,
    /// Training/rollout mismatch corrections applied on top of the objective (default none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub corrections: Vec<CorrectionConfig>,
}

/// Token-level clip parameters (`ppo_clip`, `grpo`, `cispo`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenClip {
    pub eps_low: f32,
    pub eps_high: f32,
    /// `ppo_clip`/`grpo` only; always `None` for CISPO.
    pub dual_clip_c: Option<f32>,
}

/// Sequence-level clip parameters (GSPO).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeqClip {
    pub eps_low: f32,
    pub eps_high: f32,
}

/// TBPO's parameters (docs/objectives.md, "TBPO").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrustBand {
    /// Clip of positive sequences, `[1 - eps_low, 1 + eps_high]`.
    pub eps_low: f32,
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
    /// The paper's hyper-parameters: 3e-4 / 4e-4 (positive), 3e-4 / 7e-4 (negative), cap 2.
    pub const PAPER: TrustBand = TrustBand {
        eps_low: 3e-4,
        eps_high: 4e-4,
        eps_low_neg: 3e-4,
        eps_high_neg: 7e-4,
        mismatch_cap: 2.0,
        two_sided: false,
        drop_outside_cap: false,
    };
}

/// A resolved objective with all its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    /// `ppo_clip` and `grpo`.
    PpoClip(TokenClip),
    Gspo(SeqClip),
    Cispo(TokenClip),
    Tbpo(TrustBand),
}

/// A validated loss: what [`PolicyLoss::compute`](super::PolicyLoss::compute) runs.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLoss {
    pub objective: Objective,
    pub agg: LossAggMode,
    /// Divisor of `seq-mean-token-sum` (1 for the other modes, where it is unused).
    pub agg_divisor: f32,
    /// k3 KL weight; 0 disables it.
    pub kl_coef: f32,
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
            corrections: Vec::new(),
        }
    }
}

/// A clip width: `eps_low`-like ones must stay in `[0, 1]` (the lower bound `1 - eps` of a ratio cannot go
/// below 0), `eps_high`-like ones only need to be >= 0.
fn check_eps(name: &str, value: f32, lower_side: bool) -> Result<f32, RlError> {
    let ok = value.is_finite() && value >= 0.0 && (!lower_side || value <= 1.0);
    if ok {
        Ok(value)
    } else if lower_side {
        Err(RlError::Config(format!(
            "`{name}` must be in [0, 1], got {value}"
        )))
    } else {
        Err(RlError::Config(format!(
            "`{name}` must be finite and >= 0, got {value}"
        )))
    }
}

impl LossConfig {
    /// A config with only the objective set (all defaults).
    pub fn new(objective: ObjectiveName) -> Self {
        Self {
            objective,
            loss_agg_mode: None,
            loss_agg_divisor: None,
            eps_low: None,
            eps_high: None,
            dual_clip_c: None,
            seq_eps_low: None,
            seq_eps_high: None,
            seq_eps_low_neg: None,
            seq_eps_high_neg: None,
            seq_tis_imp_ratio_cap: None,
            seq_mismatch_two_sided: None,
            seq_mismatch_drop: None,
            kl_coef: None,
            corrections: Vec::new(),
        }
    }

    /// Every objective-specific field that is set, by its config name.
    fn set_fields(&self) -> Vec<&'static str> {
        [
            ("eps_low", self.eps_low.is_some()),
            ("eps_high", self.eps_high.is_some()),
            ("dual_clip_c", self.dual_clip_c.is_some()),
            ("seq_eps_low", self.seq_eps_low.is_some()),
            ("seq_eps_high", self.seq_eps_high.is_some()),
            ("seq_eps_low_neg", self.seq_eps_low_neg.is_some()),
            ("seq_eps_high_neg", self.seq_eps_high_neg.is_some()),
            (
                "seq_tis_imp_ratio_cap",
                self.seq_tis_imp_ratio_cap.is_some(),
            ),
            (
                "seq_mismatch_two_sided",
                self.seq_mismatch_two_sided.is_some(),
            ),
            ("seq_mismatch_drop", self.seq_mismatch_drop.is_some()),
        ]
        .into_iter()
        .filter(|(_, set)| *set)
        .map(|(name, _)| name)
        .collect()
    }

    /// Fills defaults, checks ranges, and rejects fields that the chosen objective does not use.
    pub fn resolve(&self) -> Result<PolicyLoss, RlError> {
        use ObjectiveName::*;
        let applicable: &[&str] = match self.objective {
            PpoClip | Grpo => &["eps_low", "eps_high", "dual_clip_c"],
            Cispo => &["eps_low", "eps_high"],
            Gspo => &["seq_eps_low", "seq_eps_high"],
            Tbpo => &[
                "seq_eps_low",
                "seq_eps_high",
                "seq_eps_low_neg",
                "seq_eps_high_neg",
                "seq_tis_imp_ratio_cap",
                "seq_mismatch_two_sided",
                "seq_mismatch_drop",
            ],
        };
        if let Some(field) = self
            .set_fields()
            .into_iter()
            .find(|f| !applicable.contains(f))
        {
            return Err(RlError::Config(format!(
                "`{field}` does not apply to objective `{}` (it takes: {})",
                self.objective.name(),
                applicable.join(", ")
            )));
        }

        let token_clip = || -> Result<TokenClip, RlError> {
            let dual_clip_c = match self.dual_clip_c {
                Some(c) if !(c.is_finite() && c > 1.0) => {
                    return Err(RlError::Config(format!(
                        "`dual_clip_c` must be > 1, got {c}"
                    )))
                }
                c => c,
            };
            Ok(TokenClip {
                eps_low: check_eps("eps_low", self.eps_low.unwrap_or(0.2), true)?,
                eps_high: check_eps("eps_high", self.eps_high.unwrap_or(0.2), false)?,
                dual_clip_c,
            })
        };
        let objective = match self.objective {
            PpoClip | Grpo => Objective::PpoClip(token_clip()?),
            Cispo => Objective::Cispo(token_clip()?),
            Gspo => Objective::Gspo(SeqClip {
                eps_low: check_eps("seq_eps_low", self.seq_eps_low.unwrap_or(3e-4), true)?,
                eps_high: check_eps("seq_eps_high", self.seq_eps_high.unwrap_or(4e-4), false)?,
            }),
            Tbpo => {
                let paper = TrustBand::PAPER;
                let cap = self.seq_tis_imp_ratio_cap.unwrap_or(paper.mismatch_cap);
                if !(cap.is_finite() && cap >= 1.0) {
                    return Err(RlError::Config(format!(
                        "`seq_tis_imp_ratio_cap` must be >= 1, got {cap}"
                    )));
                }
                Objective::Tbpo(TrustBand {
                    eps_low: check_eps(
                        "seq_eps_low",
                        self.seq_eps_low.unwrap_or(paper.eps_low),
                        true,
                    )?,
                    eps_high: check_eps(
                        "seq_eps_high",
                        self.seq_eps_high.unwrap_or(paper.eps_high),
                        false,
                    )?,
                    eps_low_neg: check_eps(
                        "seq_eps_low_neg",
                        self.seq_eps_low_neg.unwrap_or(paper.eps_low_neg),
                        true,
                    )?,
                    eps_high_neg: check_eps(
                        "seq_eps_high_neg",
                        self.seq_eps_high_neg.unwrap_or(paper.eps_high_neg),
                        false,
                    )?,
                    mismatch_cap: cap,
                    two_sided: self.seq_mismatch_two_sided.unwrap_or(false),
                    drop_outside_cap: self.seq_mismatch_drop.unwrap_or(false),
                })
            }
        };

        let agg = self.loss_agg_mode.unwrap_or(match self.objective {
            PpoClip | Cispo => LossAggMode::TokenMean,
            Grpo | Gspo | Tbpo => LossAggMode::SeqMeanTokenMean,
        });
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
        let kl_coef = self.kl_coef.unwrap_or(0.0);
        if !(kl_coef.is_finite() && kl_coef >= 0.0) {
            return Err(RlError::Config(format!(
                "`kl_coef` must be finite and >= 0, got {kl_coef}"
            )));
        }
        for correction in &self.corrections {
            correction.validate()?;
        }
        Ok(PolicyLoss {
            objective,
            agg,
            agg_divisor,
            kl_coef,
            corrections: self.corrections.clone(),
        })
    }
}
