//! The one precision type: the weights a forward computes with, full precision or a quantization scheme.
//! Every command and config that names a precision (`rollout.precision`, `eval.precisions`, `--schemes`,
//! `--quant`) parses it here.

use std::str::FromStr;

use super::scheme::by_name;
use super::{QuantError, QuantScheme};

/// Full-precision (f32) weights, or the packed weights of one quantization scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// The f32 master weights (`"f32"`).
    F32,
    /// One weight version packed in `scheme` (`"int4-g128"`, ...).
    Quantized(QuantScheme),
}

impl Precision {
    /// `f32` followed by every quantization scheme.
    pub fn all() -> impl Iterator<Item = Precision> {
        std::iter::once(Self::F32).chain(QuantScheme::ALL.into_iter().map(Self::Quantized))
    }

    /// The name, as configs and flags spell it.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Quantized(s) => s.name(),
        }
    }

    /// The quantization scheme, `None` for f32.
    pub fn scheme(self) -> Option<QuantScheme> {
        match self {
            Self::F32 => None,
            Self::Quantized(s) => Some(s),
        }
    }
}

impl From<Option<QuantScheme>> for Precision {
    fn from(scheme: Option<QuantScheme>) -> Self {
        scheme.map_or(Self::F32, Self::Quantized)
    }
}

impl FromStr for Precision {
    type Err = QuantError;

    /// `f32` or an exact scheme name; the error lists every valid name.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Precision::all()
            .find(|p| p.name() == s.trim())
            .ok_or_else(|| QuantError::UnknownPrecision { name: s.to_owned() })
    }
}

by_name!(Precision);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_precision_round_trips_through_its_name() {
        for p in Precision::all() {
            assert_eq!(p.name().parse::<Precision>().unwrap(), p);
        }
        assert_eq!(Precision::all().count(), QuantScheme::ALL.len() + 1);
    }

    #[test]
    fn an_unknown_name_lists_the_valid_ones() {
        let err = "int3".parse::<Precision>().unwrap_err().to_string();
        assert!(
            err.contains("`int3`") && err.contains("f32") && err.contains("fp8-b128"),
            "{err}"
        );
    }
}
