//! GGUF (llama.cpp) -> Hugging Face directory: config.json, model.safetensors (dequantized), tokenizer.json
//! and tokenizer_config.json (with the chat template), so every qarl command loads the result.
//!
//! Llama-architecture files store Q and K with llama.cpp's row permutation (its rotary embedding pairs
//! adjacent features; transformers' pairs the two halves of a head): the importer undoes it.

use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Value as Json};

use super::dequant::dequantize;
use super::reader::{GgufFile, TensorInfo};

/// How the imported weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputDtype {
    F32,
    Bf16,
}

/// A `--dtype` that is neither `f32` nor `bf16` (clap shows the message next to the flag).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype `{0}` (f32 or bf16)")]
pub struct UnknownDtype(pub String);

impl std::str::FromStr for OutputDtype {
    type Err = UnknownDtype;
    fn from_str(s: &str) -> Result<Self, UnknownDtype> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            _ => Err(UnknownDtype(s.to_string())),
        }
    }
}

/// Refuses a tensor with a NaN or infinite value, or one that rounds to infinity in `dtype` (bf16 holds
/// magnitudes up to about 3.39e38, f32 to 3.40e38), naming it, how many, and the first.
fn check_storable(name: &str, values: &[f32], dtype: OutputDtype) -> Result<(), String> {
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        let bad = values.iter().filter(|v| !v.is_finite()).count();
        return Err(format!(
            "tensor `{name}` holds {bad} non-finite values (the first at element {i}: {})",
            values[i]
        ));
    }
    let overflows = |v: &f32| dtype == OutputDtype::Bf16 && !half::bf16::from_f32(*v).is_finite();
    if let Some(i) = values.iter().position(overflows) {
        let bad = values.iter().filter(|v| overflows(v)).count();
        return Err(format!(
            "tensor `{name}` holds {bad} values beyond bf16's range (the first at element {i}: {}); \
             import with --dtype f32",
            values[i]
        ));
    }
    Ok(())
}

/// What an import wrote.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    pub architecture: String,
    pub tensors: usize,
    pub parameters: u64,
    /// GGML type name -> tensor count in the source file.
    pub source_types: std::collections::BTreeMap<String, usize>,
}

/// Imports `gguf_path` into the directory `out` (created; files written atomically). Everything is checked
/// before the first file is written; `qarl import-gguf` also writes into a temporary directory first
/// ([`crate::io::write_dir_atomic`]), so a failed import leaves `out` as it was.
pub fn import_gguf(
    gguf_path: &Path,
    out: &Path,
    dtype: OutputDtype,
) -> anyhow::Result<ImportSummary> {
    let f = GgufFile::open(gguf_path)?;
    let arch = f.get_str("general.architecture")?.to_string();
    if arch != "llama" {
        bail!(
            "{}: architecture `{arch}` is not supported by the importer (llama)",
            gguf_path.display()
        );
    }
    let (config, heads, kv_heads) = llama_config(&f)?;
    // The tokenizer before any weight: a file whose tokenizer cannot be converted fails in a moment, not after
    // the whole dequantization.
    let (tokenizer, tokenizer_config) = super::tokenizer::hf_tokenizer(&f)?;
    let layers = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;

    let mut source_types = std::collections::BTreeMap::new();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for t in &f.tensors {
        *source_types.entry(t.ty.name().to_string()).or_insert(0) += 1;
        let hf = hf_name(&t.name, layers).ok_or_else(|| match block_of(&t.name) {
            Some((block, _)) if block >= layers => f.error(format!(
                "tensor `{}` is of block {block}, but `llama.block_count` is {layers} (blocks 0 to {}): \
                 the metadata disagrees with the tensors",
                t.name,
                layers.saturating_sub(1)
            )),
            _ => f.error(format!(
                "tensor `{}` has no Hugging Face Llama counterpart (unsupported feature of this file)",
                t.name
            )),
        })?;
        let mut values = dequantize(t.ty, f.data(t))
            .map_err(|m| f.error(format!("tensor `{}`: {m}", t.name)))?;
        // A NaN or infinite weight is a damaged file: written on, every forward would fail later and
        // blame its input. So is one the output's dtype cannot hold (bf16 rounds it to infinity).
        check_storable(&t.name, &values, dtype).map_err(|m| f.error(m))?;
        let shape = t.shape();
        if t.name.ends_with("attn_q.weight") {
            values = unpermute_rows(&f, t, values, heads)?;
        } else if t.name.ends_with("attn_k.weight") {
            values = unpermute_rows(&f, t, values, kv_heads)?;
        }
        tensors.push((hf, shape, values));
    }
    for required in ["model.embed_tokens.weight", "model.norm.weight"] {
        if !tensors.iter().any(|(n, _, _)| n == required) {
            bail!("{}: no tensor for `{required}`", gguf_path.display());
        }
    }
    let mut config = config;
    config["tie_word_embeddings"] = json!(!tensors.iter().any(|(n, _, _)| n == "lm_head.weight"));
    config["torch_dtype"] = json!(match dtype {
        OutputDtype::F32 => "float32",
        OutputDtype::Bf16 => "bfloat16",
    });

    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| match dtype {
            OutputDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            OutputDtype::Bf16 => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        })
        .collect();
    let st_dtype = match dtype {
        OutputDtype::F32 => safetensors::Dtype::F32,
        OutputDtype::Bf16 => safetensors::Dtype::BF16,
    };
    let entries: Vec<(String, safetensors::Dtype, Vec<usize>, &[u8])> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), st_dtype, s.clone(), b.as_slice()))
        .collect();
    crate::io::write_safetensors(&out.join("model.safetensors"), &entries)?;
    crate::io::write_json_atomic(&out.join("tokenizer.json"), &tokenizer)?;
    crate::io::write_json_atomic(&out.join("tokenizer_config.json"), &tokenizer_config)?;
    crate::io::write_json_atomic(&out.join("config.json"), &config)?;
    Ok(ImportSummary {
        architecture: arch,
        tensors: tensors.len(),
        parameters: tensors.iter().map(|(_, _, v)| v.len() as u64).sum(),
        source_types,
    })
}

/// config.json of a Llama GGUF; also returns (heads, kv heads) for the Q/K un-permutation.
fn llama_config(f: &GgufFile) -> anyhow::Result<(Json, usize, usize)> {
    let hidden = f.get_u64("llama.embedding_length")?;
    let heads = f.get_u64("llama.attention.head_count")?;
    let kv_heads = f.opt_u64("llama.attention.head_count_kv")?.unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || hidden % heads != 0 || heads % kv_heads != 0 {
        bail!(f.error(format!(
            "embedding_length {hidden}, head_count {heads}, head_count_kv {kv_heads}: inconsistent"
        )));
    }
    check_no_rope_scaling(f)?;
    let vocab = match f.opt_array("tokenizer.ggml.tokens")? {
        Some(t) => t.len() as u64,
        None => f.get_u64("llama.vocab_size")?,
    };
    let head_dim = hidden / heads;
    // Optional keys (`opt_*`): absent is the default, present but of another type is an error (it was the
    // default).
    if let Some(k) = f.opt_u64("llama.attention.key_length")? {
        if k != head_dim {
            bail!(f.error(format!(
                "attention.key_length {k} != embedding_length / head_count = {head_dim} (not supported)"
            )));
        }
    }
    // Llama applies RoPE to the whole head; a file that rotates only part of it is another model.
    if let Some(d) = f.opt_u64("llama.rope.dimension_count")? {
        if d != head_dim {
            bail!(f.error(format!(
                "rope.dimension_count {d} != the head dimension {head_dim} (partial RoPE is not supported)"
            )));
        }
    }
    // Positive numbers (a NaN would be written to config.json as null, and then read as missing).
    let positive = |key: &str, value: f64| -> anyhow::Result<f64> {
        if !(value.is_finite() && value > 0.0) {
            bail!(f.error(format!("`{key}` is {value}; it must be a positive number")));
        }
        Ok(value)
    };
    let eps_key = "llama.attention.layer_norm_rms_epsilon";
    let eps = positive(eps_key, f.get_f64(eps_key)?)?;
    let theta_key = "llama.rope.freq_base";
    let rope_theta = positive(theta_key, f.opt_f64(theta_key)?.unwrap_or(10000.0))?;
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": f.get_u64("llama.feed_forward_length")?,
        "num_hidden_layers": f.get_u64("llama.block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "max_position_embeddings": f.opt_u64("llama.context_length")?.unwrap_or(2048),
        "vocab_size": vocab,
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": f.opt_u64("tokenizer.ggml.bos_token_id")?,
        "eos_token_id": f.opt_u64("tokenizer.ggml.eos_token_id")?,
        // Left out where it names no token (the tokenizer leaves it out too): transformers' embedding
        // refuses a padding index beyond the vocabulary.
        "pad_token_id": f
            .opt_u64("tokenizer.ggml.padding_token_id")?
            .filter(|&id| id < vocab),
    });
    Ok((config, heads as usize, kv_heads as usize))
}

/// Refuses RoPE scaling, which the imported config cannot express, as llama.cpp's loader (`load_hparams` in
/// src/llama-model.cpp, and the context's setup) reads it: `rope.scaling.type` defaults to `linear` when the
/// key is absent; the factor is `rope.scaling.factor`, else the older `rope.scale_linear`, and a factor of 0
/// means 1 (frequency scale 1 / factor); a type of `none` never scales, whatever the factor. So a factor
/// other than 0 or 1 without a type is linear scaling, refused as an explicit `linear` is; and
/// `rope.scaling.attn_factor` (default 1) multiplies the rotated queries and keys whatever the type.
fn check_no_rope_scaling(f: &GgufFile) -> anyhow::Result<()> {
    let type_key = "llama.rope.scaling.type";
    let scaling_type = f.opt_str(type_key)?;
    // The factor llama.cpp reads: the first of the two keys present (the other one is never read).
    let factor = ["llama.rope.scaling.factor", "llama.rope.scale_linear"]
        .into_iter()
        .find(|k| f.metadata.contains_key(*k))
        .map(|k| f.get_f64(k).map(|v| (k, v)))
        .transpose()?;
    match (scaling_type, factor) {
        (Some("none"), _) | (None, None) => {}
        (None, Some((_, v))) if v == 0.0 || v == 1.0 => {}
        (None, Some((k, v))) => bail!(f.error(format!(
            "`{k}` = {v} without `{type_key}` is linear RoPE scaling (llama.cpp's default type), which is \
             not supported (supported: no scaling, i.e. no factor, or a factor of 0 or 1)"
        ))),
        (Some(other), _) => bail!(f.error(format!(
            "`{type_key}` = {other} is not supported (supported: none, i.e. no scaling)"
        ))),
    }
    let attn_key = "llama.rope.scaling.attn_factor";
    if let Some(a) = f.opt_f64(attn_key)? {
        if a != 1.0 {
            bail!(f.error(format!(
                "`{attn_key}` = {a} is not supported (it scales the rotated queries and keys; supported: 1)"
            )));
        }
    }
    Ok(())
}

/// The block index and the part of a `blk.N.PART` tensor name.
fn block_of(name: &str) -> Option<(usize, &str)> {
    let (block, part) = name.strip_prefix("blk.")?.split_once('.')?;
    Some((block.parse().ok()?, part))
}

/// The Hugging Face name of a llama.cpp tensor name.
fn hf_name(name: &str, layers: usize) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let (layer, part) = block_of(name)?;
    if layer >= layers {
        return None;
    }
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Undoes llama.cpp's `permute(w, n_head)`: within each head, GGUF row `2 j + s` is Hugging Face row
/// `s * head_dim / 2 + j`.
fn unpermute_rows(
    f: &GgufFile,
    t: &TensorInfo,
    values: Vec<f32>,
    heads: usize,
) -> anyhow::Result<Vec<f32>> {
    let shape = t.shape();
    let (rows, cols) = match shape.as_slice() {
        [r, c] => (*r, *c),
        _ => bail!(f.error(format!("tensor `{}` is not 2-D: {shape:?}", t.name))),
    };
    if rows % heads != 0 || !(rows / heads).is_multiple_of(2) {
        bail!(f.error(format!(
            "tensor `{}`: {rows} rows do not split into {heads} heads of even size",
            t.name
        )));
    }
    let hd = rows / heads;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for j in 0..hd / 2 {
            for s in 0..2 {
                let src = (h * hd + 2 * j + s) * cols;
                let dst = (h * hd + s * (hd / 2) + j) * cols;
                out[dst..dst + cols].copy_from_slice(&values[src..src + cols]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Non-finite values are refused for either dtype; values bf16 rounds to infinity only for bf16.
    #[test]
    fn values_the_output_cannot_hold_are_refused() {
        let ok = [1.0f32, -3.0e38, 3.3e38];
        assert!(check_storable("w", &ok, OutputDtype::Bf16).is_ok());
        let nan = [0.0, f32::NAN, 1.0, f32::INFINITY];
        for dtype in [OutputDtype::F32, OutputDtype::Bf16] {
            let err = check_storable("w", &nan, dtype).unwrap_err();
            assert!(
                err.contains("holds 2 non-finite values (the first at element 1: NaN)"),
                "{err}"
            );
        }
        let big = [1.0, 3.4e38, -f32::MAX];
        assert!(check_storable("w", &big, OutputDtype::F32).is_ok());
        let err = check_storable("w", &big, OutputDtype::Bf16).unwrap_err();
        assert!(
            err.contains("`w` holds 2 values beyond bf16's range (the first at element 1: 340000000000000000000000000000000000000)")
                && err.contains("--dtype f32"),
            "{err}"
        );
    }
}
