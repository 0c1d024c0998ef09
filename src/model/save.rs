//! Writing a model back in Hugging Face format (config.json + model.safetensors, f32), so every checkpoint
//! qarl produces loads in qarl and in transformers alike.

use std::path::Path;

use anyhow::Context;
use burn::tensor::Tensor;
use serde_json::Value;

use super::decoder::Decoder;
use super::layers::{Linear, RmsNorm};
use super::mlp::{FeedForward, SwiGlu};
use crate::host::to_f32_vec;

/// Every parameter with its HF name, in HF layout (`[out, in]` for linear weights).
pub fn hf_tensors(model: &Decoder) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    let push2 = |out: &mut Vec<(String, Vec<usize>, Vec<f32>)>, name: String, t: Tensor<2>| {
        let dims = t.dims();
        out.push((name, dims.to_vec(), to_f32_vec(t)));
    };
    let linear = |out: &mut Vec<(String, Vec<usize>, Vec<f32>)>, prefix: String, l: &Linear| {
        let w = l.weight.val().transpose(); // [in, out] -> HF [out, in]
        let dims = w.dims();
        out.push((format!("{prefix}.weight"), dims.to_vec(), to_f32_vec(w)));
        if let Some(b) = &l.bias {
            let v = to_f32_vec(b.val());
            out.push((format!("{prefix}.bias"), vec![v.len()], v));
        }
    };
    let norm = |out: &mut Vec<(String, Vec<usize>, Vec<f32>)>, name: String, n: &RmsNorm| {
        let v = to_f32_vec(n.weight.val());
        out.push((name, vec![v.len()], v));
    };
    let swiglu = |out: &mut Vec<(String, Vec<usize>, Vec<f32>)>, p: String, m: &SwiGlu| {
        linear(out, format!("{p}.gate_proj"), &m.gate_proj);
        linear(out, format!("{p}.up_proj"), &m.up_proj);
        linear(out, format!("{p}.down_proj"), &m.down_proj);
    };
    push2(
        &mut out,
        "model.embed_tokens.weight".into(),
        model.embed_tokens.val(),
    );
    for (i, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        norm(
            &mut out,
            format!("{p}.input_layernorm.weight"),
            &layer.input_layernorm,
        );
        norm(
            &mut out,
            format!("{p}.post_attention_layernorm.weight"),
            &layer.post_attention_layernorm,
        );
        let a = &layer.self_attn;
        linear(&mut out, format!("{p}.self_attn.q_proj"), &a.q_proj);
        linear(&mut out, format!("{p}.self_attn.k_proj"), &a.k_proj);
        linear(&mut out, format!("{p}.self_attn.v_proj"), &a.v_proj);
        linear(&mut out, format!("{p}.self_attn.o_proj"), &a.o_proj);
        if let Some(n) = &a.q_norm {
            norm(&mut out, format!("{p}.self_attn.q_norm.weight"), n);
        }
        if let Some(n) = &a.k_norm {
            norm(&mut out, format!("{p}.self_attn.k_norm.weight"), n);
        }
        match &layer.mlp {
            FeedForward::Dense(m) => swiglu(&mut out, format!("{p}.mlp"), m),
            FeedForward::Moe(moe) => {
                linear(&mut out, format!("{p}.mlp.gate"), &moe.gate);
                for (e, ex) in moe.experts.iter().enumerate() {
                    swiglu(&mut out, format!("{p}.mlp.experts.{e}"), ex);
                }
            }
        }
    }
    norm(&mut out, "model.norm.weight".into(), &model.norm);
    if let Some(head) = &model.lm_head {
        linear(&mut out, "lm_head".into(), head);
    }
    out
}

/// Writes `model` to `dir` as config.json (the given JSON, with any `quantization_config` removed: the
/// weights written are the full-precision masters) and model.safetensors, each through a temporary file.
pub fn save_pretrained(model: &Decoder, config_json: &Value, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let tensors = hf_tensors(model);
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let entries: Vec<(String, safetensors::Dtype, Vec<usize>, &[u8])> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), safetensors::Dtype::F32, s.clone(), b.as_slice()))
        .collect();
    crate::io::write_safetensors(&dir.join(super::checkpoint::SINGLE_FILE), &entries)?;
    let mut cfg = config_json.clone();
    if let Some(obj) = cfg.as_object_mut() {
        obj.remove("quantization_config");
    }
    crate::io::write_json_atomic(&dir.join("config.json"), &cfg)
}
