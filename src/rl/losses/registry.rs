//! Objectives by registration, as verl's `register_policy_loss`: a name maps to an [`ObjectiveSpec`] (its
//! config fields with their defaults, its default aggregation, and how to build it), and a built
//! [`Objective`] maps log-probs and advantages to [`ObjectiveTerms`]. The list itself is
//! [`REGISTRY`](super::objectives::REGISTRY), one line per objective; nothing else names objectives, so the
//! config parser, `resolve`, the dispatch in `PolicyLoss::compute` and the error messages all follow it.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use super::objectives::REGISTRY;
use super::spec::{ObjectiveSpec, COMMON_FIELDS};
use crate::rl::RlError;

/// Every registered name, in registry order.
pub fn registered_names() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| REGISTRY.iter().map(|spec| spec.name).collect())
}

/// Every field a `[train.loss]` table may hold: the common ones, then each objective's names and aliases.
pub fn known_fields() -> &'static [&'static str] {
    static FIELDS: OnceLock<Vec<&'static str>> = OnceLock::new();
    FIELDS.get_or_init(|| {
        let mut fields: Vec<&'static str> = COMMON_FIELDS.to_vec();
        let declared = REGISTRY.iter().flat_map(|spec| spec.params.iter());
        for name in declared.flat_map(|p| std::iter::once(p.name).chain(p.aliases.iter().copied()))
        {
            if !fields.contains(&name) {
                fields.push(name);
            }
        }
        fields
    })
}

/// The registered objective called `name`.
pub fn lookup(name: &str) -> Result<&'static ObjectiveSpec, RlError> {
    REGISTRY
        .iter()
        .copied()
        .find(|spec| spec.name == name)
        .ok_or_else(|| RlError::UnknownObjective {
            name: name.to_string(),
            registered: registered_names().join(", "),
        })
}

/// A registered objective's name, as chosen in a config; only registered names can be built.
#[derive(Clone, Copy)]
pub struct ObjectiveName(&'static ObjectiveSpec);

impl ObjectiveName {
    /// The registered objective `name`, or an error listing the registered ones.
    pub fn new(name: &str) -> Result<Self, RlError> {
        lookup(name).map(Self)
    }

    /// The config name.
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// Its registry entry.
    pub fn spec(self) -> &'static ObjectiveSpec {
        self.0
    }
}

impl PartialEq for ObjectiveName {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for ObjectiveName {}

impl fmt::Debug for ObjectiveName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ObjectiveName").field(&self.name()).finish()
    }
}

impl fmt::Display for ObjectiveName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ObjectiveName {
    type Err = RlError;
    fn from_str(name: &str) -> Result<Self, RlError> {
        Self::new(name)
    }
}

impl Serialize for ObjectiveName {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for ObjectiveName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;
        impl Visitor<'_> for NameVisitor {
            type Value = ObjectiveName;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("the name of a registered objective")
            }
            fn visit_str<E: de::Error>(self, name: &str) -> Result<ObjectiveName, E> {
                ObjectiveName::new(name).map_err(|_| E::unknown_variant(name, registered_names()))
            }
        }
        deserializer.deserialize_str(NameVisitor)
    }
}
