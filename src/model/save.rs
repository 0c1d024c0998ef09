//! Writing a model back in Hugging Face format (config.json + model.safetensors, f32), so every checkpoint
//! qarl produces loads in qarl and in transformers alike.

use std::path::Path;

use anyhow::Context;
use burn::tensor::Tensor;
use serde_json::Value;

use super::decoder::Decoder;
use super::names::{tensor_name, BIAS, WEIGHT};
use super::params::Part;
use crate::host::to_f32_vec;

/// Every parameter with its HF name, in HF layout (`[out, in]` for linear weights), in the order of
/// [`Decoder::visit_parts`] (the file's order is safetensors' own: by name).
pub fn hf_tensors(model: &Decoder) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    fn host<const D: usize>(name: String, t: Tensor<D>) -> (String, Vec<usize>, Vec<f32>) {
        let dims = t.dims().to_vec();
        (name, dims, to_f32_vec(t))
    }
    let mut out = Vec::new();
    model.visit_parts(|path, part| match part {
        Part::Embedding(p) => out.push(host(tensor_name(path, WEIGHT), p.val())),
        Part::Norm(n) => out.push(host(tensor_name(path, WEIGHT), n.weight.val())),
        Part::Linear(l) => {
            // [in, out] -> HF [out, in]
            out.push(host(tensor_name(path, WEIGHT), l.weight.val().transpose()));
            if let Some(b) = &l.bias {
                out.push(host(tensor_name(path, BIAS), b.val()));
            }
        }
    });
    out
}

/// Writes `model` to `dir` as config.json (the given JSON, with any `quantization_config` removed and its
/// `torch_dtype` / `dtype` set to float32: the weights written are the full-precision f32 masters) and
/// model.safetensors, each through a temporary file. A base's `"torch_dtype": "bfloat16"` kept beside them
/// would have transformers (which loads in the config's dtype) round the trained weights back to bf16,
/// losing every update below its spacing: the model it ran would not be the one qarl evaluated. (vLLM's
/// `--dtype auto` runs even a float32 config in bf16; `--dtype float32` keeps the masters.)
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
        for key in ["torch_dtype", "dtype"] {
            if obj.contains_key(key) {
                obj.insert(key.into(), Value::from("float32"));
            }
        }
    }
    crate::io::write_json_atomic(&dir.join("config.json"), &cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An RL checkpoint of a bf16 base states the f32 its weights are in (transformers loads in the
    /// config's dtype), and drops the quantization config of packed weights it does not hold.
    #[test]
    fn saved_configs_state_the_f32_weights() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen3");
        let model = Decoder::load(&fixture, &burn::tensor::Device::flex()).unwrap();
        let mut json: Value =
            serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
                .unwrap();
        json["torch_dtype"] = Value::from("bfloat16");
        json["dtype"] = Value::from("float16");
        json["quantization_config"] = serde_json::json!({"quant_method": "qarl"});
        let out = tempfile::tempdir().unwrap();
        save_pretrained(&model, &json, out.path()).unwrap();
        let saved: Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(saved["torch_dtype"], "float32");
        assert_eq!(saved["dtype"], "float32");
        assert!(saved.get("quantization_config").is_none());
        assert_eq!(saved["hidden_size"], json["hidden_size"]);
        // A config that states no dtype gets none (loaders then take f32).
        json.as_object_mut().unwrap().remove("torch_dtype");
        json.as_object_mut().unwrap().remove("dtype");
        save_pretrained(&model, &json, out.path()).unwrap();
        let saved: Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
                .unwrap();
        assert!(saved.get("torch_dtype").is_none() && saved.get("dtype").is_none());
    }
}
