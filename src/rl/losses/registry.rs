//! Objectives by registration, as verl's `register_policy_loss`: a name maps to an [`ObjectiveSpec`] (its
//! config fields with their defaults, its default aggregation, and how to build it), and a built
//! [`Objective`] maps log-probs and advantages to [`ObjectiveTerms`]. The list itself is
//! [`REGISTRY`](super::objectives::REGISTRY), one line per objective; nothing else names objectives, so the
//! config parser, `resolve`, the dispatch in `PolicyLoss::compute` and the error messages all follow it.

use std::any::Any;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use burn::tensor::Tensor;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use super::config::{LossAggMode, COMMON_FIELDS};
use super::objectives::REGISTRY;
use super::params::{ParamSpec, Params};
use crate::rl::RlError;

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
}

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
