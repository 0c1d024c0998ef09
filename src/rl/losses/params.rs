//! An objective's own config fields: declared beside the objective ([`ParamSpec`]), written flat in the
//! `[train.loss]` table next to the common fields ([`ObjectiveParams`]), and read back typed, defaulted and
//! range-checked by the objective's `build` ([`Params`]).
//!
//! The declarations are the single source of the names: they decide what the config parser accepts at all
//! (any registered objective's field), what `resolve` accepts for the chosen objective, and each default.

use std::collections::BTreeMap;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};

use super::registry::known_fields;
use super::spec::ParamValue;

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

    /// Moves the value under `from` to `to`, unless `to` is set too (then both stay, for `resolve` to
    /// refuse the field given twice).
    pub fn rename(&mut self, from: &str, to: &str) {
        if !self.0.contains_key(to) {
            if let Some(v) = self.0.remove(from) {
                self.0.insert(to.to_string(), v);
            }
        }
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
