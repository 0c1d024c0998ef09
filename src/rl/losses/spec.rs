//! What an objective is, independent of which objectives exist: its declaration ([`ObjectiveSpec`]: its
//! config fields with their defaults and ranges, [`ParamSpec`]; its default aggregation, [`LossAggMode`]; how
//! to build it), the checked values its `build` reads ([`Params`]), and the built objective mapping
//! log-probs and advantages to [`ObjectiveTerms`]. Each objective file under `objectives/` writes its
//! declaration against these types; `registry` lists them by name.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use burn::tensor::Tensor;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::rl::RlError;

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

/// The fields of `[train.loss]` that every objective takes; the objective's own fields are declared in its file
/// (src/rl/losses/objectives/).
pub const COMMON_FIELDS: [&str; 6] = [
    "objective",
    "loss_agg_mode",
    "loss_agg_divisor",
    "kl_coef",
    "kl_type",
    "corrections",
];

/// The per-token estimator of KL(pi_theta || pi_ref) of the KL term (verl's `kl_loss_type`, under its names
/// too), with `d = lp_theta - lp_ref`. A `+` suffix (verl's straight-through types) keeps the estimator's
/// value and takes the gradient of k2, `d`: k1's and k3's expectations are the KL, their expected gradients
/// are not, k2's is (Schulman, "Approximating KL divergence"; verl's `kl_penalty`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum KlType {
    /// `d` (verl's `kl`).
    #[serde(rename = "k1", alias = "kl")]
    K1,
    /// `|d|`.
    #[serde(rename = "abs")]
    Abs,
    /// `d^2 / 2` (verl's `mse`; its `k2+` and `mse+` are k2 too, whose gradient is already its own).
    #[serde(rename = "k2", alias = "mse", alias = "k2+", alias = "mse+")]
    K2,
    /// `exp(-d) + d - 1`, clamped as verl's `low_var_kl` (the default there and here).
    #[default]
    #[serde(rename = "k3", alias = "low_var_kl")]
    K3,
    /// k1's value with k2's gradient (verl's `k1+`, `kl+`).
    #[serde(rename = "k1+", alias = "kl+")]
    K1StraightThrough,
    /// abs's value with k2's gradient (verl's `abs+`).
    #[serde(rename = "abs+")]
    AbsStraightThrough,
    /// k3's value with k2's gradient (verl's `k3+`, `low_var_kl+`).
    #[serde(rename = "k3+", alias = "low_var_kl+")]
    K3StraightThrough,
}

impl KlType {
    /// Whether the gradient is k2's rather than the value estimator's own (a `+` type).
    pub fn straight_through(self) -> bool {
        matches!(
            self,
            KlType::K1StraightThrough | KlType::AbsStraightThrough | KlType::K3StraightThrough
        )
    }
}

impl fmt::Display for KlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KlType::K1 => "k1",
            KlType::Abs => "abs",
            KlType::K2 => "k2",
            KlType::K3 => "k3",
            KlType::K1StraightThrough => "k1+",
            KlType::AbsStraightThrough => "abs+",
            KlType::K3StraightThrough => "k3+",
        })
    }
}

/// One registered objective: everything the config needs to know about it.
#[derive(Debug)]
pub struct ObjectiveSpec {
    /// The config name (`objective = "..."`).
    pub name: &'static str,
    /// Its fields; only these may be set in a config that chooses it.
    pub params: &'static [ParamSpec],
    /// The `loss_agg_mode` it takes when none is given (its paper's).
    pub default_agg: LossAggMode,
    /// Reads the fields (defaults filled, ranges checked) into the objective.
    pub build: fn(&Params) -> Result<Objective, RlError>,
    /// Whether its terms carry an importance weight over the training/rollout mismatch ratio of their own
    /// (TBPO's `w_i`): a correction that weights by that ratio again would count it twice.
    pub weights_mismatch: bool,
}

/// The range a number must lie in; checked on the user's value and on the default alike.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Range {
    /// `[0, 1]`: a lower clip width `eps`, since the bound `1 - eps` of a ratio cannot go below 0.
    Unit,
    /// Finite and `>= x` (`AtLeast(0.0)` for upper clip widths, `AtLeast(1.0)` for caps).
    AtLeast(f32),
    /// Finite and `> x` (the dual-clip factor must exceed 1 to floor anything).
    Above(f32),
}

impl Range {
    fn check(self, name: &str, value: f32) -> Result<f32, RlError> {
        let (ok, want) = match self {
            Range::Unit => (
                value.is_finite() && (0.0..=1.0).contains(&value),
                "in [0, 1]".to_string(),
            ),
            Range::AtLeast(x) => (
                value.is_finite() && value >= x,
                format!("finite and >= {x}"),
            ),
            Range::Above(x) => (value.is_finite() && value > x, format!("finite and > {x}")),
        };
        if ok {
            Ok(value)
        } else {
            Err(RlError::Config(format!(
                "`{name}` must be {want}, got {value}"
            )))
        }
    }
}

/// The type of a field and its default.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamKind {
    /// A number; `default: None` means "unset" (the objective reads it with [`Params::optional_float`]).
    Float { default: Option<f32>, range: Range },
    /// `true` or `false`.
    Flag { default: bool },
}

/// One config field of an objective, declared in the objective's file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParamSpec {
    /// The name in the `[train.loss]` table.
    pub name: &'static str,
    /// Other accepted names (the paper's, say); setting two names of one field is an error.
    pub aliases: &'static [&'static str],
    pub kind: ParamKind,
}

impl ParamSpec {
    /// A number with a default.
    pub const fn float(name: &'static str, default: f32, range: Range) -> Self {
        Self::new(
            name,
            ParamKind::Float {
                default: Some(default),
                range,
            },
        )
    }

    /// A number that may stay unset (an option that is off unless given).
    pub const fn optional_float(name: &'static str, range: Range) -> Self {
        Self::new(
            name,
            ParamKind::Float {
                default: None,
                range,
            },
        )
    }

    /// A boolean with a default.
    pub const fn flag(name: &'static str, default: bool) -> Self {
        Self::new(name, ParamKind::Flag { default })
    }

    /// The same field, also accepted under `aliases`.
    pub const fn with_aliases(self, aliases: &'static [&'static str]) -> Self {
        Self { aliases, ..self }
    }

    const fn new(name: &'static str, kind: ParamKind) -> Self {
        Self {
            name,
            aliases: &[],
            kind,
        }
    }

    /// Whether `key` names this field.
    pub fn answers_to(&self, key: &str) -> bool {
        self.name == key || self.aliases.contains(&key)
    }
}

/// A value as written in the config. Integers are kept apart from floats so that the conversion to `f32`
/// rounds once, exactly as serde's own `f32` fields do.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamValue {
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl ParamValue {
    fn as_f32(self, name: &str) -> Result<f32, RlError> {
        match self {
            ParamValue::Int(i) => Ok(i as f32),
            ParamValue::Float(x) => Ok(x as f32),
            ParamValue::Bool(b) => Err(RlError::Config(format!(
                "`{name}` must be a number, got {b}"
            ))),
        }
    }

    fn as_bool(self, name: &str) -> Result<bool, RlError> {
        match self {
            ParamValue::Bool(b) => Ok(b),
            other => Err(RlError::Config(format!(
                "`{name}` must be true or false, got {other}"
            ))),
        }
    }
}

impl ParamValue {
    /// `x` as the shortest decimal that reads back as `x` (`4e-4`, not `0.0003999999898951501`): what a
    /// TOML writer should print for an `f32` default.
    pub fn shortest(x: f32) -> Self {
        ParamValue::Float(x.to_string().parse().unwrap_or(f64::from(x)))
    }
}

impl fmt::Display for ParamValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamValue::Bool(b) => write!(f, "{b}"),
            ParamValue::Int(i) => write!(f, "{i}"),
            ParamValue::Float(x) => write!(f, "{x}"),
        }
    }
}

impl From<bool> for ParamValue {
    fn from(b: bool) -> Self {
        ParamValue::Bool(b)
    }
}

impl From<f32> for ParamValue {
    fn from(x: f32) -> Self {
        ParamValue::Float(f64::from(x))
    }
}

impl From<f64> for ParamValue {
    fn from(x: f64) -> Self {
        ParamValue::Float(x)
    }
}

impl Serialize for ParamValue {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match *self {
            ParamValue::Bool(b) => serializer.serialize_bool(b),
            ParamValue::Int(i) => serializer.serialize_i64(i),
            ParamValue::Float(x) => serializer.serialize_f64(x),
        }
    }
}

impl<'de> Deserialize<'de> for ParamValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ValueVisitor;
        impl Visitor<'_> for ValueVisitor {
            type Value = ParamValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number or a boolean")
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<ParamValue, E> {
                Ok(ParamValue::Bool(b))
            }
            fn visit_i64<E: de::Error>(self, i: i64) -> Result<ParamValue, E> {
                Ok(ParamValue::Int(i))
            }
            fn visit_u64<E: de::Error>(self, u: u64) -> Result<ParamValue, E> {
                // Beyond i64 no clip width or cap means anything; it only has to stay an out-of-range number.
                Ok(i64::try_from(u).map_or(ParamValue::Float(u as f64), ParamValue::Int))
            }
            fn visit_f64<E: de::Error>(self, x: f64) -> Result<ParamValue, E> {
                Ok(ParamValue::Float(x))
            }
        }
        deserializer.deserialize_any(ValueVisitor)
    }
}

/// The chosen objective's fields as its `build` reads them: user value or declared default, range-checked.
#[derive(Debug, Clone)]
pub struct Params {
    objective: &'static ObjectiveSpec,
    /// By canonical name.
    values: BTreeMap<&'static str, ParamValue>,
}

impl Params {
    /// Maps every `(key, value)` given (the `[train.loss]` table's objective fields) to a field of
    /// `objective` (by name or alias); a key that is not one of its fields, or a field set under two names,
    /// is an error.
    pub fn new<'a>(
        objective: &'static ObjectiveSpec,
        given: impl IntoIterator<Item = (&'a str, ParamValue)>,
    ) -> Result<Self, RlError> {
        let mut values = BTreeMap::new();
        for (key, value) in given {
            let Some(param) = objective.params.iter().find(|p| p.answers_to(key)) else {
                let takes: Vec<&str> = objective.params.iter().map(|p| p.name).collect();
                return Err(RlError::Config(format!(
                    "`{key}` does not apply to objective `{}` (it takes: {})",
                    objective.name,
                    takes.join(", ")
                )));
            };
            if values.insert(param.name, value).is_some() {
                return Err(RlError::Config(format!(
                    "`{}` is set twice (under its aliases {:?} too)",
                    param.name, param.aliases
                )));
            }
        }
        Ok(Self { objective, values })
    }

    /// A number with a default.
    pub fn float(&self, name: &str) -> Result<f32, RlError> {
        self.optional_float(name)?.ok_or_else(|| {
            self.misdeclared(name, "is read as a number with a default but declares none")
        })
    }

    /// A number that may be unset.
    pub fn optional_float(&self, name: &str) -> Result<Option<f32>, RlError> {
        let param = self.declared(name)?;
        let ParamKind::Float { default, range } = param.kind else {
            return Err(self.misdeclared(name, "is read as a number but declared a flag"));
        };
        let value = match self.values.get(param.name) {
            Some(v) => Some(v.as_f32(param.name)?),
            None => default,
        };
        value.map(|v| range.check(param.name, v)).transpose()
    }

    /// A flag.
    pub fn flag(&self, name: &str) -> Result<bool, RlError> {
        let param = self.declared(name)?;
        let ParamKind::Flag { default } = param.kind else {
            return Err(self.misdeclared(name, "is read as a flag but declared a number"));
        };
        self.values
            .get(param.name)
            .map_or(Ok(default), |v| v.as_bool(param.name))
    }

    fn declared(&self, name: &str) -> Result<&'static ParamSpec, RlError> {
        self.objective
            .params
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| self.misdeclared(name, "is read but not declared"))
    }

    /// A mismatch between an objective's declarations and its `build`: a bug in the objective, reported as a
    /// config error rather than a panic (the registry test resolves every objective, so it never ships).
    fn misdeclared(&self, name: &str, what: &str) -> RlError {
        RlError::Config(format!(
            "objective `{}`: field `{name}` {what}",
            self.objective.name
        ))
    }
}

/// What an objective reads. Padding is already zeroed; only `lp_theta` carries gradient.
#[derive(Debug, Clone)]
pub struct ObjectiveInputs<'a> {
    /// `[B, T]`, current policy (differentiable).
    pub lp_theta: Tensor<2>,
    /// `[B, T]`, learner at the start of the step.
    pub lp_old: Tensor<2>,
    /// `[B, T]`, sampler.
    pub lp_roll: Tensor<2>,
    /// `[B, T]`, the loss mask: response tokens kept by the corrections. Sequence means run over it.
    pub mask: &'a Tensor<2>,
    /// `[B, 1]`, one advantage per sequence.
    pub adv: Tensor<2>,
}

/// What an objective hands to the aggregation and the metrics. Objectives do not aggregate: the caller
/// applies the mismatch weights and the chosen aggregation, so every objective composes with every correction.
#[derive(Debug, Clone)]
pub struct ObjectiveTerms {
    /// Per-token loss `[B, T]`, before mismatch weights and aggregation.
    pub loss: Tensor<2>,
    /// 1.0 where the clipped branch is in force: `[B, T]` for token-level objectives, `[B, 1]` for sequence-level
    /// ones (so that the clip fraction counts sequences, not tokens).
    pub clipped: Tensor<2>,
    /// 1.0 where a negative-advantage term is clipped from the other side: PPO's dual clip, TBPO's negative
    /// sequences outside the trust band. Same shape as `clipped`.
    pub clipped_lower: Tensor<2>,
    /// Stop-gradient per-sequence weight `[B, 1]` (TBPO's mismatch weight `w_i`).
    pub seq_weight: Option<Tensor<2>>,
    /// Per-sequence keep mask `[B, 1]` (TBPO's optional drop of sequences outside `[1/C, C]`).
    pub seq_keep: Option<Tensor<2>>,
}

/// How an objective with parameters `P` computes its terms.
pub type TermsFn<P> = fn(&P, ObjectiveInputs<'_>) -> ObjectiveTerms;

/// A built objective: its name, its typed parameters and its terms function. Cheap to clone; two are equal
/// when name and parameters are.
#[derive(Clone)]
pub struct Objective(Arc<dyn Bound>);

impl Objective {
    /// Binds `params` to `terms`. Each objective file offers a typed constructor on top
    /// (`Objective::tbpo(band)`, ...).
    pub fn new<P>(name: &'static str, params: P, terms: TermsFn<P>) -> Self
    where
        P: fmt::Debug + PartialEq + Send + Sync + 'static,
    {
        Self(Arc::new(WithParams {
            name,
            params,
            terms,
        }))
    }

    /// The name it was built under.
    pub fn name(&self) -> &'static str {
        self.0.name()
    }

    /// Its parameters, if they are a `P`.
    pub fn params<P: 'static>(&self) -> Option<&P> {
        self.0.params().downcast_ref()
    }

    /// Per-token loss and clip indicators.
    pub fn terms(&self, inputs: ObjectiveInputs<'_>) -> ObjectiveTerms {
        self.0.terms(inputs)
    }
}

impl PartialEq for Objective {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name() && self.0.params_eq(other.0.params())
    }
}

impl fmt::Debug for Objective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt_named(f)
    }
}

/// The type-erased side of [`Objective`].
trait Bound: Send + Sync {
    fn name(&self) -> &'static str;
    fn params(&self) -> &dyn Any;
    fn params_eq(&self, other: &dyn Any) -> bool;
    fn terms(&self, inputs: ObjectiveInputs<'_>) -> ObjectiveTerms;
    fn fmt_named(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result;
}

struct WithParams<P> {
    name: &'static str,
    params: P,
    terms: TermsFn<P>,
}

impl<P> Bound for WithParams<P>
where
    P: fmt::Debug + PartialEq + Send + Sync + 'static,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn params(&self) -> &dyn Any {
        &self.params
    }

    fn params_eq(&self, other: &dyn Any) -> bool {
        other.downcast_ref::<P>() == Some(&self.params)
    }

    fn terms(&self, inputs: ObjectiveInputs<'_>) -> ObjectiveTerms {
        (self.terms)(&self.params, inputs)
    }

    fn fmt_named(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple(self.name).field(&self.params).finish()
    }
}
