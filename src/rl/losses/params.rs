//! An objective's own config fields: declared beside the objective ([`ParamSpec`]), written flat in the
//! `[train.loss]` table next to the common fields ([`ObjectiveParams`]), and read back typed, defaulted and
//! range-checked by the objective's `build` ([`Params`]).
//!
//! The declarations are the single source of the names: they decide what the config parser accepts at all
//! (any registered objective's field), what `resolve` accepts for the chosen objective, and each default.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use super::registry::{known_fields, ObjectiveSpec};
use crate::rl::RlError;

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

/// The objective-specific fields of a `[train.loss]` table, by the name they were written under. Parsing
/// rejects a name that no registered objective declares (a typo); whether the chosen objective takes it is
/// [`LossConfig::resolve`](super::LossConfig::resolve)'s check, so that the error can name the objective.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(transparent)]
pub struct ObjectiveParams(BTreeMap<String, ParamValue>);

impl ObjectiveParams {
    /// Sets `key` (an objective field's name or alias); checked only by `resolve`.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<ParamValue>) {
        self.0.insert(key.into(), value.into());
    }

    pub fn get(&self, key: &str) -> Option<ParamValue> {
        self.0.get(key).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, ParamValue)> {
        self.0.iter().map(|(k, v)| (k.as_str(), *v))
    }
}

impl<'de> Deserialize<'de> for ObjectiveParams {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let fields = BTreeMap::<String, ParamValue>::deserialize(deserializer)?;
        let known = known_fields();
        if let Some(unknown) = fields.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(de::Error::unknown_field(unknown, known));
        }
        Ok(Self(fields))
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
    /// Maps every key of `given` to a field of `objective` (by name or alias); a key that is not one of its
    /// fields, or a field set under two names, is an error.
    pub fn new(
        objective: &'static ObjectiveSpec,
        given: &ObjectiveParams,
    ) -> Result<Self, RlError> {
        let mut values = BTreeMap::new();
        for (key, value) in given.iter() {
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
