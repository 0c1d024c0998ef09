//! Which linear layers are quantized: glob patterns on Hugging Face weight names.
//!
//! Default (docs/formats.md, "Which layers are quantized"): every attention and MLP / routed-expert projection (`*_proj.weight`);
//! embeddings, norms, the MoE router (`mlp.gate.weight`) and `lm_head` stay full precision.

use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};

use super::{QuantError, QuantScheme};

/// Patterns matching the projections quantized by default.
pub const DEFAULT_INCLUDE: &[&str] = &["*_proj.weight"];

/// What to quantize and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantConfig {
    pub scheme: QuantScheme,
    /// Glob patterns on HF weight names (e.g. `model.layers.*.mlp.experts.*.down_proj.weight`).
    #[serde(default = "default_include")]
    pub include: Vec<String>,
    /// Patterns that win over `include` (e.g. `model.layers.0.*` to keep the first layer in full precision).
    #[serde(default)]
    pub exclude: Vec<String>,
}

fn default_include() -> Vec<String> {
    DEFAULT_INCLUDE.iter().map(|s| s.to_string()).collect()
}

impl QuantConfig {
    /// The default layer selection with `scheme`.
    pub fn new(scheme: QuantScheme) -> Self {
        Self {
            scheme,
            include: default_include(),
            exclude: vec![],
        }
    }

    /// The patterns in words, for an error that nothing matched: the include list, and the exclude list
    /// where there is one (`--exclude '*'` is what leaves nothing, not the include list).
    pub fn patterns_text(&self) -> String {
        let quoted = |p: &[String]| {
            p.iter()
                .map(|s| format!("`{s}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut text = format!("include {}", quoted(&self.include));
        if !self.exclude.is_empty() {
            text.push_str(&format!(" less exclude {}", quoted(&self.exclude)));
        }
        text
    }

    /// Compiles the patterns; an invalid glob is an error naming it.
    pub fn selector(&self) -> Result<LayerSelector, QuantError> {
        let build = |pats: &[String]| -> Result<GlobSet, QuantError> {
            let invalid = |pattern: &str, e: globset::Error| QuantError::InvalidPattern {
                pattern: pattern.to_owned(),
                msg: e.kind().to_string(),
            };
            let mut b = GlobSetBuilder::new();
            for p in pats {
                b.add(Glob::new(p).map_err(|e| invalid(p, e))?);
            }
            b.build().map_err(|e| invalid(&pats.join(", "), e))
        };
        Ok(LayerSelector {
            include: build(&self.include)?,
            exclude: build(&self.exclude)?,
        })
    }
}

/// Compiled include/exclude patterns.
pub struct LayerSelector {
    include: GlobSet,
    exclude: GlobSet,
}

impl LayerSelector {
    /// Whether the weight `name` (e.g. `model.layers.3.self_attn.q_proj.weight`) is quantized.
    pub fn selects(&self, name: &str) -> bool {
        self.include.is_match(name) && !self.exclude.is_match(name)
    }
}
