//! `config.json` of a Hugging Face causal LM, parsed into one architecture-neutral description.
//!
//! One decoder serves Llama, Qwen2/2.5, Qwen3 and Qwen3-MoE: they differ only in a few switches (q/k/v bias,
//! per-head q/k RMSNorm, routed experts). Both the classic key names (`num_experts`, `rope_theta`) and the
//! transformers 5.x ones (`num_local_experts`, `rope_parameters.rope_theta`) are accepted.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::LoadError;
use crate::quant::QuantConfig;

/// Which Hugging Face architecture a checkpoint declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
}

impl Architecture {
    /// The `architectures[0]` names this decoder implements.
    pub const SUPPORTED: [&'static str; 4] = [
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    ];

    fn from_hf_name(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Self::Llama),
            "Qwen2ForCausalLM" => Some(Self::Qwen2),
            "Qwen3ForCausalLM" => Some(Self::Qwen3),
            "Qwen3MoeForCausalLM" => Some(Self::Qwen3Moe),
            _ => None,
        }
    }

    /// The HF name, as written back to config.json.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }
}

/// Routed-expert settings of a Qwen3-MoE model.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Renormalise the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer (1-based: layer `i` when `(i + 1) % step == 0`) is sparse.
    pub decoder_sparse_step: usize,
    /// Layers forced to a dense MLP.
    pub mlp_only_layers: Vec<usize>,
}

/// Everything the decoder needs to know about a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (Qwen2; `attention_bias` on Llama / Qwen3).
    pub qkv_bias: bool,
    /// Bias on the output projection (`attention_bias` on Llama / Qwen3; never on Qwen2).
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3 family).
    pub qk_norm: bool,
    pub moe: Option<MoeConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// `pad_token_id`: transformers builds the input embedding with it as `padding_idx`, so its row takes
    /// no gradient through the input lookup ([`super::Decoder`] does the same).
    pub pad_token_id: Option<u32>,
    /// Set for checkpoints written by `qarl quantize` (`quantization_config` with `quant_method: "qarl"`).
    pub quantization: Option<QuantConfig>,
}

/// The largest size or count accepted in a config.json (hostile values are rejected before anything is
/// allocated from them).
pub const MAX_DIM: u64 = 1 << 31;
/// The most parameters a config may describe (about 1.1e12).
pub const MAX_PARAMS: u128 = 1 << 40;

/// Reads keys out of a JSON object and reports problems against the file they came from.
struct Keys<'a> {
    path: &'a Path,
    root: &'a Value,
}

impl<'a> Keys<'a> {
    fn find(&self, names: &[&str]) -> Option<&'a Value> {
        names.iter().find_map(|name| {
            let mut v = self.root;
            for part in name.split('.') {
                v = v.get(part)?;
            }
            (!v.is_null()).then_some(v)
        })
    }

    /// Refuses `name` written as `null` where transformers refuses it too (its config class types the key
    /// as a value, not an optional): read as absent, it took a default for a model transformers and vLLM
    /// cannot load.
    fn refuse_null(&self, name: &str) -> Result<(), LoadError> {
        match self.root.get(name) {
            Some(Value::Null) => Err(LoadError::InvalidConfig {
                path: self.path.to_path_buf(),
                msg: format!(
                    "`{name}` is null, which transformers refuses for this model: give its value, or \
                     remove the key for the default"
                ),
            }),
            _ => Ok(()),
        }
    }

    fn missing(&self, names: &[&str]) -> LoadError {
        LoadError::MissingKey {
            path: self.path.to_path_buf(),
            key: names.join("` or `"),
        }
    }

    fn bad(&self, name: &str, want: &str, got: &Value) -> LoadError {
        LoadError::InvalidConfig {
            path: self.path.to_path_buf(),
            msg: format!("`{name}` must be {want}, found {got}"),
        }
    }

    fn usize_opt(&self, names: &[&str]) -> Result<Option<usize>, LoadError> {
        match self.find(names) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&x| x <= MAX_DIM)
                .map(|x| Some(x as usize))
                .ok_or_else(|| {
                    self.bad(
                        names[0],
                        &format!("a non-negative integer of at most {MAX_DIM}"),
                        v,
                    )
                }),
        }
    }

    fn usize(&self, names: &[&str]) -> Result<usize, LoadError> {
        self.usize_opt(names)?.ok_or_else(|| self.missing(names))
    }

    fn positive(&self, names: &[&str]) -> Result<usize, LoadError> {
        let v = self.usize(names)?;
        if v == 0 {
            return Err(self.bad(names[0], "positive", &Value::from(0)));
        }
        Ok(v)
    }

    /// A finite number above zero (`rms_norm_eps`, `rope_theta`) that f32 holds: zero, negative or
    /// non-finite values run but give NaN or meaningless outputs, and the forward computes in f32, where
    /// an `rms_norm_eps` of 1e-50 is 0 again, so they are refused here.
    fn positive_f64(&self, names: &[&str]) -> Result<f64, LoadError> {
        // The key that was found is named (`rope_parameters.rope_theta` is not `rope_theta`).
        let (name, v) = names
            .iter()
            .find_map(|&n| self.find(&[n]).map(|v| (n, v)))
            .ok_or_else(|| self.missing(names))?;
        v.as_f64()
            .filter(|x| (f32::MIN_POSITIVE as f64..=f32::MAX as f64).contains(x))
            .ok_or_else(|| {
                self.bad(
                    name,
                    "a finite number above zero, within f32's normal range",
                    v,
                )
            })
    }

    /// [`Self::positive_f64`], or `default` where none of `names` is present (transformers' class default).
    fn positive_f64_or(&self, names: &[&str], default: f64) -> Result<f64, LoadError> {
        if names.iter().all(|&n| self.find(&[n]).is_none()) {
            return Ok(default);
        }
        self.positive_f64(names)
    }

    fn bool_or(&self, names: &[&str], default: bool) -> Result<bool, LoadError> {
        match self.find(names) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.bad(names[0], "true or false", v)),
        }
    }

    /// A token id or a list of them (`eos_token_id` is either in HF configs).
    fn ids(&self, name: &str) -> Result<Vec<u32>, LoadError> {
        match self.find(&[name]) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| self.bad(name, "a token id or a list of ids", v))
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(|x| vec![x])
                .ok_or_else(|| self.bad(name, "a token id or a list of ids", v)),
        }
    }

    /// [`Self::ids`], each below `vocab_size`: a special token outside the vocabulary is never generated, so
    /// a stop at it would never happen.
    fn ids_below(&self, name: &str, vocab_size: usize) -> Result<Vec<u32>, LoadError> {
        let ids = self.ids(name)?;
        for &id in &ids {
            self.check_below(name, id, vocab_size)?;
        }
        Ok(ids)
    }

    fn check_below(&self, name: &str, id: u32, vocab_size: usize) -> Result<(), LoadError> {
        if id as usize >= vocab_size {
            return Err(self.bad(
                name,
                &format!("a token id below vocab_size ({vocab_size})"),
                &Value::from(id),
            ));
        }
        Ok(())
    }
}

/// `pad_token_id` as torch's `nn.Embedding(padding_idx = pad_token_id)` takes it, which transformers builds
/// the input embedding with: one id, a negative one counting from the end of the vocabulary (early LLaMA
/// conversions write -1), refused outside it or as a list, as torch refuses them.
fn padding_idx(k: &Keys, vocab_size: usize) -> Result<Option<u32>, LoadError> {
    let Some(v) = k.find(&["pad_token_id"]) else {
        return Ok(None);
    };
    let want = format!("one token id in [-{vocab_size}, {vocab_size}) (torch's padding_idx)");
    let id = v.as_i64().ok_or_else(|| k.bad("pad_token_id", &want, v))?;
    let from_end = id.checked_add(vocab_size as i64).unwrap_or(-1);
    match id {
        0.. if (id as u64) < vocab_size as u64 => Ok(Some(id as u32)),
        ..0 if from_end >= 0 => Ok(Some(from_end as u32)),
        _ => Err(k.bad("pad_token_id", &want, v)),
    }
}

/// The token ids under `name` of a Hugging Face JSON document read from `path` (`eos_token_id` of
/// config.json or generation_config.json: a token id or a list of them), each below `vocab_size`; errors name
/// the file and the key, as config.json's own.
pub(crate) fn special_token_ids(
    root: &Value,
    path: &Path,
    name: &str,
    vocab_size: usize,
) -> Result<Vec<u32>, LoadError> {
    Keys { path, root }.ids_below(name, vocab_size)
}

/// `quantization_config` of a checkpoint: only qarl's own packed format is understood.
fn parse_quantization(k: &Keys) -> Result<Option<QuantConfig>, LoadError> {
    let Some(q) = k.find(&["quantization_config"]) else {
        return Ok(None);
    };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("(none)");
    if method != "qarl" {
        return Err(LoadError::InvalidConfig {
            path: k.path.to_path_buf(),
            msg: format!(
                "`quantization_config.quant_method` = \"{method}\" is not supported: only checkpoints written by `qarl quantize` (quant_method \"qarl\"); load the full-precision model and pass --quant instead"
            ),
        });
    }
    let mut q = q.clone();
    if let Some(obj) = q.as_object_mut() {
        obj.remove("quant_method");
    }
    serde_json::from_value(q)
        .map(Some)
        .map_err(|e| LoadError::InvalidConfig {
            path: k.path.to_path_buf(),
            msg: format!("`quantization_config`: {e}"),
        })
}

/// transformers' `Qwen3Config.head_dim` where config.json has none.
const QWEN3_DEFAULT_HEAD_DIM: usize = 128;
/// transformers' `Qwen3MoeConfig.num_key_value_heads` where config.json has none.
const QWEN3_MOE_DEFAULT_KV_HEADS: usize = 4;
/// transformers' `Qwen3Config` / `Qwen2Config` `num_key_value_heads` where config.json has no such key
/// (written as `null`, they take the query heads, as Llama does either way).
const QWEN_DEFAULT_KV_HEADS: usize = 32;
/// transformers' `LlamaConfig` `bos_token_id` / `eos_token_id` where config.json has no such key.
const LLAMA_DEFAULT_BOS: u32 = 1;
const LLAMA_DEFAULT_EOS: u32 = 2;

/// The `model_type` transformers builds each architecture as.
fn model_type_of(architecture: Architecture) -> &'static str {
    match architecture {
        Architecture::Llama => "llama",
        Architecture::Qwen2 => "qwen2",
        Architecture::Qwen3 => "qwen3",
        Architecture::Qwen3Moe => "qwen3_moe",
    }
}

/// Refuses a `model_type` that is not `architectures[0]`'s: transformers builds the model from
/// `model_type` (a `mistral` labelled `LlamaForCausalLM` is a Mistral, with its sliding window), so the
/// decoder the architecture names would run another model without an error.
fn check_model_type(k: &Keys, architecture: Architecture) -> Result<(), LoadError> {
    let Some(found) = k.find(&["model_type"]) else {
        return Ok(());
    };
    let expected = model_type_of(architecture);
    match found.as_str() {
        Some(t) if t == expected => Ok(()),
        Some(t) => Err(LoadError::InvalidConfig {
            path: k.path.to_path_buf(),
            msg: format!(
                "`model_type` is `{t}` but `architectures[0]` is `{}` (model_type `{expected}`): \
                 transformers builds the model from `model_type`, which qarl does not implement",
                architecture.hf_name()
            ),
        }),
        None => Err(k.bad("model_type", "a string", found)),
    }
}

/// `mlp_bias`, which only transformers' Llama reads: its Qwen2, Qwen3 and Qwen3-MoE build their MLPs
/// without biases whatever the key says, so here too (a warning says so where it is set).
fn mlp_bias(k: &Keys, architecture: Architecture) -> Result<bool, LoadError> {
    let set = k.bool_or(&["mlp_bias"], false)?;
    if architecture == Architecture::Llama {
        return Ok(set);
    }
    if set {
        tracing::warn!(
            "{}: `mlp_bias` = true is ignored: transformers' {} has no MLP biases",
            k.path.display(),
            architecture.hf_name()
        );
    }
    Ok(false)
}

/// The RoPE base as transformers reads it: the RoPE section is `rope_scaling` where it holds anything,
/// else `rope_parameters`; its `rope_theta` wins over the top-level one, which fills in only where the
/// section has none (so a section with another base than the top level's silently ran with the top
/// level's before).
fn rope_theta(k: &Keys) -> Result<f64, LoadError> {
    let section = ["rope_scaling", "rope_parameters"].into_iter().find(|key| {
        k.find(&[key])
            .and_then(Value::as_object)
            .is_some_and(|o| !o.is_empty())
    });
    match section {
        Some(section) => k.positive_f64_or(
            &[&format!("{section}.rope_theta"), "rope_theta"],
            DEFAULT_ROPE_THETA,
        ),
        // (`rope_parameters.rope_theta` is absent here: named in the error as where the base may be.)
        None => k.positive_f64_or(
            &["rope_theta", "rope_parameters.rope_theta"],
            DEFAULT_ROPE_THETA,
        ),
    }
}

/// transformers' default RoPE base of Llama, Qwen2, Qwen3 and Qwen3-MoE configs (`rope_parameters.rope_theta`
/// of a config that states none: older Llama conversions).
const DEFAULT_ROPE_THETA: f64 = 10000.0;

/// transformers' default `rms_norm_eps` of the same four configs.
const DEFAULT_RMS_NORM_EPS: f64 = 1e-6;

/// The `rope_scaling` / `rope_parameters` kinds this decoder implements.
pub const SUPPORTED_ROPE_TYPES: [&str; 1] = ["default"];

/// Refuses a RoPE scaling this decoder does not implement: running e.g. a `linear` or `yarn` model with plain
/// RoPE gives wrong outputs past (and often within) the original context without any error.
fn check_rope_kind(k: &Keys) -> Result<(), LoadError> {
    let supported = SUPPORTED_ROPE_TYPES.join(", ");
    for key in ["rope_scaling", "rope_parameters"] {
        let Some(section) = k.find(&[key]) else {
            continue;
        };
        let Some(obj) = section.as_object() else {
            return Err(k.bad(key, "an object (or null)", section));
        };
        let found = ["rope_type", "type"]
            .into_iter()
            .find_map(|t| obj.get(t).filter(|v| !v.is_null()).map(|v| (t, v)));
        match found {
            Some((_, Value::String(kind))) if SUPPORTED_ROPE_TYPES.contains(&kind.as_str()) => {}
            Some((t, Value::String(kind))) => {
                return Err(LoadError::InvalidConfig {
                    path: k.path.to_path_buf(),
                    msg: format!(
                        "`{key}.{t}` = {kind} is not supported yet (supported: {supported})"
                    ),
                })
            }
            Some((t, v)) => {
                return Err(k.bad(
                    &format!("{key}.{t}"),
                    &format!("a string (supported: {supported})"),
                    v,
                ))
            }
            // Parameters per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`, as
            // transformers 5.x nests them for models that mix attention kinds): not one RoPE for every layer.
            None if obj.values().any(Value::is_object) => {
                let nested: Vec<&str> = obj
                    .iter()
                    .filter(|(_, v)| v.is_object())
                    .map(|(name, _)| name.as_str())
                    .collect();
                return Err(LoadError::InvalidConfig {
                    path: k.path.to_path_buf(),
                    msg: format!(
                        "`{key}` holds RoPE parameters per layer type ({}): not supported (one RoPE for \
                         every layer)",
                        nested.join(", ")
                    ),
                });
            }
            // `rope_parameters` (transformers 5.x) may hold only `rope_theta`: plain RoPE. A `rope_scaling`
            // with settings but no kind cannot be told apart from a scaled one, so it is refused.
            None if key == "rope_scaling" && !obj.is_empty() => {
                return Err(LoadError::InvalidConfig {
                    path: k.path.to_path_buf(),
                    msg: format!(
                        "`rope_scaling` has no `rope_type` (supported: {supported}, or no `rope_scaling`)"
                    ),
                })
            }
            None => {}
        }
    }
    Ok(())
}

/// Refuses a `partial_rotary_factor` other than 1 (top level, or in `rope_parameters` / `rope_scaling` as
/// transformers 5.x writes it): transformers then rotates only that fraction of each head's dimensions, and
/// this decoder, which rotates all of them, would run such a model with other positions than it was
/// trained with, without an error.
fn check_partial_rotary(k: &Keys) -> Result<(), LoadError> {
    for key in [
        "partial_rotary_factor",
        "rope_parameters.partial_rotary_factor",
        "rope_scaling.partial_rotary_factor",
    ] {
        match k.find(&[key]) {
            None => {}
            Some(v) if v.as_f64() == Some(1.0) => {}
            Some(v) if v.is_number() => {
                return Err(LoadError::InvalidConfig {
                    path: k.path.to_path_buf(),
                    msg: format!(
                        "`{key}` = {v} is not supported (RoPE over part of each head's \
                         dimensions); only 1.0"
                    ),
                })
            }
            Some(v) => return Err(k.bad(key, "a number (only 1.0 is supported)", v)),
        }
    }
    Ok(())
}

/// The `hidden_act` values the decoder's gated MLP implements (`swish` is transformers' other name of SiLU).
pub const SUPPORTED_ACTIVATIONS: [&str; 2] = ["silu", "swish"];

/// `layer_types` (transformers' per-layer attention kinds): only full attention is implemented, so a
/// `sliding_attention` layer (which `use_sliding_window` need not announce) is refused, naming it, as is a
/// list of another length than the layers.
fn check_layer_types(k: &Keys, layers: usize) -> Result<(), LoadError> {
    let Some(types) = k.find(&["layer_types"]) else {
        return Ok(());
    };
    let Some(types) = types.as_array() else {
        return Err(k.bad("layer_types", "a list of attention kinds", types));
    };
    if types.len() != layers {
        return Err(LoadError::InvalidConfig {
            path: k.path.to_path_buf(),
            msg: format!(
                "`layer_types` lists {} layers, but `num_hidden_layers` is {layers}",
                types.len()
            ),
        });
    }
    match types.iter().position(|t| t != "full_attention") {
        None => Ok(()),
        Some(i) => Err(LoadError::InvalidConfig {
            path: k.path.to_path_buf(),
            msg: format!(
                "`layer_types[{i}]` is {}: only \"full_attention\" is supported (sliding-window and other \
                 attention kinds are not)",
                types[i]
            ),
        }),
    }
}

/// Refuses what would change training in transformers but is not implemented here, read as its default
/// otherwise: `attention_dropout` above 0 (attention weights dropped in a training forward) and, for
/// Qwen3-MoE, `output_router_logits` = true (the router's load-balancing loss, `router_aux_loss_coef`
/// times it, added to the training loss).
fn check_training_only_keys(k: &Keys, architecture: Architecture) -> Result<(), LoadError> {
    match k.find(&["attention_dropout"]) {
        None => {}
        Some(v) if v.as_f64() == Some(0.0) => {}
        Some(v) if v.is_number() => {
            return Err(LoadError::InvalidConfig {
                path: k.path.to_path_buf(),
                msg: format!(
                    "`attention_dropout` = {v} is not supported (attention runs without dropout): set it \
                     to 0.0"
                ),
            })
        }
        Some(v) => return Err(k.bad("attention_dropout", "a number", v)),
    }
    if architecture == Architecture::Qwen3Moe && k.bool_or(&["output_router_logits"], false)? {
        return Err(LoadError::InvalidConfig {
            path: k.path.to_path_buf(),
            msg:
                "`output_router_logits` = true is not supported (the router's load-balancing loss, \
                  `router_aux_loss_coef`, is not added to the training loss): set it to false"
                    .into(),
        });
    }
    Ok(())
}

/// Refuses a `hidden_act` other than SiLU: the MLP is `down(silu(gate) * up)` on every path (the CPU grouped
/// MoE kernel included), so a `gelu` or `relu` model would run as SiLU and give wrong outputs without an
/// error. Absent means SiLU (the transformers default of every architecture loaded here).
fn check_activation(k: &Keys) -> Result<(), LoadError> {
    let supported = SUPPORTED_ACTIVATIONS.join(", ");
    match k.find(&["hidden_act"]) {
        None => Ok(()),
        Some(Value::String(act)) if SUPPORTED_ACTIVATIONS.contains(&act.as_str()) => Ok(()),
        Some(Value::String(act)) => Err(LoadError::InvalidConfig {
            path: k.path.to_path_buf(),
            msg: format!(
                "`hidden_act` = {act} is not supported (supported: {supported}): the gated MLP only implements SiLU"
            ),
        }),
        Some(v) => Err(k.bad("hidden_act", &format!("a string (supported: {supported})"), v)),
    }
}

impl ModelConfig {
    /// The experts a token is routed to (`num_experts_per_tok`), 0 for a dense model: the width of a
    /// token's routing record.
    pub fn experts_per_token(&self) -> usize {
        self.moe.as_ref().map_or(0, |m| m.num_experts_per_tok)
    }

    /// Reads `config.json` (the file itself, or the model directory that holds it).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let mut path: PathBuf = path.as_ref().to_path_buf();
        if path.is_dir() || path.extension().is_none_or(|e| e != "json") {
            path = path.join("config.json");
        }
        let text = std::fs::read_to_string(&path).map_err(|io| {
            // A model directory that does not exist is named as such, not as its missing config.json.
            match path.parent().filter(|d| !d.as_os_str().is_empty()) {
                Some(dir) if io.kind() == std::io::ErrorKind::NotFound && !dir.exists() => {
                    LoadError::InvalidConfig {
                        path: dir.to_path_buf(),
                        msg: "no such folder (the model's directory, holding its config.json)"
                            .into(),
                    }
                }
                _ => LoadError::Io {
                    path: path.clone(),
                    io,
                },
            }
        })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses the text of a `config.json`; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self, LoadError> {
        let root: Value = serde_json::from_str(text).map_err(|e| LoadError::InvalidConfig {
            path: path.to_path_buf(),
            msg: format!("not valid JSON: {e}"),
        })?;
        if !root.is_object() {
            return Err(LoadError::InvalidConfig {
                path: path.to_path_buf(),
                msg: "the top level must be a JSON object".into(),
            });
        }
        let k = Keys { path, root: &root };

        let arch_name = match k.find(&["architectures"]) {
            Some(Value::Array(a)) if !a.is_empty() => a[0].as_str().unwrap_or_default().to_string(),
            Some(v) => return Err(k.bad("architectures", "a non-empty list of names", v)),
            None => return Err(k.missing(&["architectures"])),
        };
        let architecture = Architecture::from_hf_name(&arch_name).ok_or_else(|| {
            LoadError::UnknownArchitecture {
                path: path.to_path_buf(),
                name: arch_name.clone(),
            }
        })?;

        check_model_type(&k, architecture)?;
        for key in [
            "rms_norm_eps",
            "tie_word_embeddings",
            "max_position_embeddings",
            "hidden_act",
            "rope_theta",
        ] {
            k.refuse_null(key)?;
        }
        // Qwen2 ignores `attention_bias` (its q/k/v always have one), and transformers takes it as None.
        if architecture != Architecture::Qwen2 {
            k.refuse_null("attention_bias")?;
        }
        if matches!(architecture, Architecture::Qwen3 | Architecture::Qwen3Moe) {
            k.refuse_null("head_dim")?;
        }
        if architecture == Architecture::Qwen3Moe {
            k.refuse_null("num_key_value_heads")?;
            k.refuse_null("decoder_sparse_step")?;
        }
        check_training_only_keys(&k, architecture)?;

        let hidden_size = k.positive(&["hidden_size"])?;
        let num_attention_heads = k.positive(&["num_attention_heads"])?;
        // Absent: transformers' class default (Qwen3-MoE's 4 key/value heads, Qwen3's and Qwen2's 32,
        // Llama's the query heads); `null`: the query heads.
        let absent = k.root.get("num_key_value_heads").is_none();
        let num_key_value_heads =
            k.usize_opt(&["num_key_value_heads"])?
                .unwrap_or(match architecture {
                    Architecture::Qwen3Moe => QWEN3_MOE_DEFAULT_KV_HEADS,
                    Architecture::Qwen3 | Architecture::Qwen2 if absent => QWEN_DEFAULT_KV_HEADS,
                    _ => num_attention_heads,
                });
        if num_key_value_heads == 0 {
            return Err(k.bad("num_key_value_heads", "positive", &Value::from(0)));
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(LoadError::InvalidConfig {
                path: path.to_path_buf(),
                msg: format!(
                    "`num_attention_heads` ({num_attention_heads}) must be a multiple of `num_key_value_heads` ({num_key_value_heads})"
                ),
            });
        }
        // Llama's config refuses this even where `head_dim` is given (transformers' `validate_architecture`).
        if architecture == Architecture::Llama && hidden_size % num_attention_heads != 0 {
            return Err(LoadError::InvalidConfig {
                path: path.to_path_buf(),
                msg: format!(
                    "`hidden_size` ({hidden_size}) is not a multiple of `num_attention_heads` \
                     ({num_attention_heads}), which transformers refuses for Llama"
                ),
            });
        }
        let head_dim = match k.usize_opt(&["head_dim"])? {
            Some(d) => d,
            // transformers' Qwen3Config sets 128 where the key is absent (Qwen3-MoE, Qwen2 and Llama divide).
            None if architecture == Architecture::Qwen3 => QWEN3_DEFAULT_HEAD_DIM,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(k.missing(&["head_dim"]));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(k.bad(
                "head_dim",
                "a positive even number (RoPE rotates pairs)",
                &Value::from(head_dim),
            ));
        }

        check_rope_kind(&k)?;
        let rope_theta = rope_theta(&k)?;
        check_partial_rotary(&k)?;
        check_activation(&k)?;

        if k.bool_or(&["use_sliding_window"], false)? {
            return Err(LoadError::InvalidConfig {
                path: path.to_path_buf(),
                msg: "`use_sliding_window` = true is not supported (sliding-window attention)"
                    .into(),
            });
        }
        let attention_bias = k.bool_or(&["attention_bias"], false)?;
        let (qkv_bias, o_bias, qk_norm) = match architecture {
            Architecture::Llama => (attention_bias, attention_bias, false),
            Architecture::Qwen2 => (true, false, false),
            Architecture::Qwen3 | Architecture::Qwen3Moe => (attention_bias, attention_bias, true),
        };

        let moe = if architecture == Architecture::Qwen3Moe {
            // transformers maps `num_experts` onto `num_local_experts`, which wins where both are written.
            let keys = ["num_local_experts", "num_experts"];
            let num_experts = k.positive(&keys)?;
            if let (Some(local), Some(other)) = (k.find(&keys[..1]), k.find(&keys[1..])) {
                if local != other {
                    return Err(LoadError::InvalidConfig {
                        path: path.to_path_buf(),
                        msg: format!(
                            "`num_local_experts` ({local}) and `num_experts` ({other}) disagree: one count \
                             of experts (transformers reads `num_local_experts`)"
                        ),
                    });
                }
            }
            let num_experts_per_tok = k.positive(&["num_experts_per_tok"])?;
            if num_experts_per_tok > num_experts {
                return Err(LoadError::InvalidConfig {
                    path: path.to_path_buf(),
                    msg: format!("`num_experts_per_tok` ({num_experts_per_tok}) exceeds the number of experts ({num_experts})"),
                });
            }
            let mlp_only_layers = match k.find(&["mlp_only_layers"]) {
                None => vec![],
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_u64()
                            .map(|x| x as usize)
                            .ok_or_else(|| k.bad("mlp_only_layers", "a list of layer indices", v))
                    })
                    .collect::<Result<_, _>>()?,
                Some(v) => return Err(k.bad("mlp_only_layers", "a list of layer indices", v)),
            };
            Some(MoeConfig {
                num_experts,
                num_experts_per_tok,
                moe_intermediate_size: k.positive(&["moe_intermediate_size"])?,
                norm_topk_prob: k.bool_or(&["norm_topk_prob"], false)?,
                // 0 would divide by zero in transformers; it is refused here rather than read as 1.
                decoder_sparse_step: match k.usize_opt(&["decoder_sparse_step"])? {
                    None => 1,
                    Some(0) => {
                        return Err(k.bad("decoder_sparse_step", "positive", &Value::from(0)))
                    }
                    Some(n) => n,
                },
                mlp_only_layers,
            })
        } else {
            None
        };

        let vocab_size = k.positive(&["vocab_size"])?;
        let num_hidden_layers = k.positive(&["num_hidden_layers"])?;
        check_layer_types(&k, num_hidden_layers)?;
        // transformers ignores an index past the last layer; it is a typo or another model's list.
        if let Some(&l) = moe
            .as_ref()
            .and_then(|m| m.mlp_only_layers.iter().find(|&&l| l >= num_hidden_layers))
        {
            return Err(LoadError::InvalidConfig {
                path: path.to_path_buf(),
                msg: format!(
                    "`mlp_only_layers` names layer {l}, but `num_hidden_layers` is {num_hidden_layers} \
                     (layers 0 to {})",
                    num_hidden_layers - 1
                ),
            });
        }

        // A dense layer with a zero-width MLP would add nothing and run without a word: the width must be
        // positive wherever a layer is dense. Only a MoE model whose layers are all sparse needs none.
        let has_dense_layer = match &moe {
            None => true,
            Some(m) => {
                m.decoder_sparse_step > 1
                    || m.mlp_only_layers.iter().any(|&l| l < num_hidden_layers)
            }
        };
        let intermediate_size = if has_dense_layer {
            k.positive(&["intermediate_size"])?
        } else {
            k.usize_opt(&["intermediate_size"])?.unwrap_or(0)
        };
        // An upper bound of the parameter count, in u128 so hostile sizes cannot overflow it.
        let (h, l) = (hidden_size as u128, num_hidden_layers as u128);
        let attn = h
            * head_dim as u128
            * (2 * num_attention_heads as u128 + 2 * num_key_value_heads as u128);
        let mlp = 3 * h * intermediate_size as u128
            + moe.as_ref().map_or(0, |m| {
                m.num_experts as u128 * (3 * h * m.moe_intermediate_size as u128 + h)
            });
        let params = 2 * vocab_size as u128 * h + l * (attn + mlp);
        if params > MAX_PARAMS {
            return Err(LoadError::InvalidConfig {
                path: path.to_path_buf(),
                msg: format!(
                    "the sizes describe about {params:.3e} parameters, more than the {MAX_PARAMS:.1e} this loader accepts (a corrupt or hostile config.json?)",
                    params = params as f64,
                    MAX_PARAMS = MAX_PARAMS as f64
                ),
            });
        }

        let llama_default = |key: &str, id: u32| {
            (architecture == Architecture::Llama && k.root.get(key).is_none()).then_some(id)
        };
        let mut eos_token_ids = k.ids_below("eos_token_id", vocab_size)?;
        if let Some(id) = llama_default("eos_token_id", LLAMA_DEFAULT_EOS) {
            k.check_below("eos_token_id", id, vocab_size)?;
            eos_token_ids = vec![id];
        }
        let bos_token_id = k.ids("bos_token_id")?.first().copied();
        let bos_token_id = bos_token_id.or(llama_default("bos_token_id", LLAMA_DEFAULT_BOS));
        if let Some(id) = bos_token_id {
            k.check_below("bos_token_id", id, vocab_size)?;
        }
        let pad_token_id = padding_idx(&k, vocab_size)?;
        Ok(Self {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: k.positive_f64_or(&["rms_norm_eps"], DEFAULT_RMS_NORM_EPS)?,
            rope_theta,
            max_position_embeddings: match k.usize_opt(&["max_position_embeddings"])? {
                // transformers' class defaults.
                None if architecture == Architecture::Llama => 2048,
                None => 32768,
                Some(0) => {
                    return Err(k.bad("max_position_embeddings", "positive", &Value::from(0)))
                }
                Some(n) => n,
            },
            tie_word_embeddings: k.bool_or(&["tie_word_embeddings"], false)?,
            qkv_bias,
            o_bias,
            mlp_bias: mlp_bias(&k, architecture)?,
            qk_norm,
            moe,
            quantization: parse_quantization(&k)?,
            bos_token_id,
            eos_token_ids,
            pad_token_id,
        })
    }

    /// Whether decoder layer `layer` uses routed experts (Qwen3-MoE's rule).
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        match &self.moe {
            None => false,
            Some(m) => {
                !m.mlp_only_layers.contains(&layer)
                    && m.num_experts > 0
                    && (layer + 1).is_multiple_of(m.decoder_sparse_step)
            }
        }
    }
}
