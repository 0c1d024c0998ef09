//! Loading: config.json in both key styles, and a clear error (naming file and problem) for each kind of bad
//! checkpoint.

mod common;

use std::path::Path;

use burn::tensor::Device;
use common::{copy_model, fixtures_dir, read_tensors, write_tensors};
use qarl::model::{Architecture, Decoder, LoadError, ModelConfig};

fn load_err(dir: &Path) -> String {
    match Decoder::load(dir, &Device::flex()) {
        Ok(_) => panic!("{} loaded although it is broken", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn fixture(name: &str) -> std::path::PathBuf {
    fixtures_dir().join(name)
}

const CLASSIC_MOE: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 2,
  "moe_intermediate_size": 32, "norm_topk_prob": false, "decoder_sparse_step": 1, "mlp_only_layers": [1],
  "tie_word_embeddings": false, "eos_token_id": [1, 2]
}"#;

const V5_MOE: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
  "num_local_experts": 8, "num_experts_per_tok": 2,
  "moe_intermediate_size": 32, "norm_topk_prob": false, "decoder_sparse_step": 1, "mlp_only_layers": [1],
  "tie_word_embeddings": false, "eos_token_id": [1, 2]
}"#;

#[test]
fn classic_and_v5_config_keys_parse_the_same() {
    let a = ModelConfig::from_json_str(CLASSIC_MOE, Path::new("a/config.json")).unwrap();
    let b = ModelConfig::from_json_str(V5_MOE, Path::new("b/config.json")).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.architecture, Architecture::Qwen3Moe);
    assert_eq!(a.rope_theta, 1.0e6);
    let moe = a.moe.as_ref().unwrap();
    assert_eq!((moe.num_experts, moe.num_experts_per_tok), (8, 2));
    assert!(a.is_sparse_layer(0) && !a.is_sparse_layer(1));
    assert!(a.qk_norm && !a.qkv_bias);
    assert_eq!(a.eos_token_ids, vec![1, 2]);
}

#[test]
fn qwen2_gets_qkv_bias_and_no_qk_norm() {
    let text = CLASSIC_MOE
        .replace("Qwen3MoeForCausalLM", "Qwen2ForCausalLM")
        .replace(
            "\"tie_word_embeddings\": false",
            "\"tie_word_embeddings\": true",
        );
    let c = ModelConfig::from_json_str(&text, Path::new("config.json")).unwrap();
    assert!(c.qkv_bias && !c.o_bias && !c.qk_norm && c.moe.is_none() && c.tie_word_embeddings);
}

#[test]
fn config_errors_name_the_file_and_key() {
    let p = Path::new("m/config.json");
    let cases: Vec<(String, &str)> = vec![
        (
            CLASSIC_MOE.replace("Qwen3MoeForCausalLM", "GPT2LMHeadModel"),
            "unknown architecture `GPT2LMHeadModel`",
        ),
        (
            CLASSIC_MOE.replace("\"hidden_size\": 64,", ""),
            "missing key `hidden_size`",
        ),
        (
            CLASSIC_MOE.replace("\"rope_theta\": 1000000.0,", ""),
            "missing key `rope_theta` or `rope_parameters.rope_theta`",
        ),
        (
            CLASSIC_MOE.replace("\"num_experts\": 8,", ""),
            "missing key `num_experts` or `num_local_experts`",
        ),
        (
            CLASSIC_MOE.replace("\"hidden_size\": 64", "\"hidden_size\": \"64\""),
            "`hidden_size` must be a non-negative integer",
        ),
        (
            CLASSIC_MOE.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
            "must be a multiple of `num_key_value_heads`",
        ),
        (
            CLASSIC_MOE.replace("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9"),
            "exceeds the number of experts",
        ),
        (
            CLASSIC_MOE.replace(
                "\"rope_theta\": 1000000.0",
                "\"rope_theta\": 1e6, \"rope_scaling\": {\"rope_type\": \"yarn\"}",
            ),
            "not supported",
        ),
        (CLASSIC_MOE[..40].to_string(), "not valid JSON"),
        ("[1, 2]".to_string(), "must be a JSON object"),
    ];
    for (text, want) in cases {
        let err = ModelConfig::from_json_str(&text, p)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("m/config.json"),
            "error does not name the file: {err}"
        );
        assert!(err.contains(want), "expected `{want}` in: {err}");
    }
}

/// Copies the single-file fixture `name` and lets `edit` change its tensors before writing them back.
fn broken_copy(
    name: &str,
    edit: impl FnOnce(
        &mut std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    ),
) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    copy_model(&fixture(name), tmp.path());
    let file = tmp.path().join("model.safetensors");
    let mut tensors = read_tensors(&file);
    edit(&mut tensors);
    write_tensors(&file, &tensors);
    tmp
}

const Q: &str = "model.layers.0.self_attn.q_proj.weight";

#[test]
fn missing_tensor_is_named_with_file_and_shape() {
    let tmp = broken_copy("qwen3_moe", |t| {
        t.remove(Q);
    });
    let err = load_err(tmp.path());
    assert!(err.contains(&format!("missing tensor `{Q}`")), "{err}");
    assert!(
        err.contains("model.safetensors") && err.contains("[128, 64]"),
        "{err}"
    );
}

#[test]
fn missing_expert_is_named() {
    let name = "model.layers.0.mlp.experts.5.down_proj.weight";
    let tmp = broken_copy("qwen3_moe", |t| {
        t.remove(name);
    });
    let err = load_err(tmp.path());
    assert!(err.contains(name), "{err}");
}

#[test]
fn misshaped_tensor_reports_both_shapes() {
    let tmp = broken_copy("qwen3_moe", |t| {
        let e = t.get_mut(Q).unwrap();
        e.1 = vec![e.1[1], e.1[0]];
    });
    let err = load_err(tmp.path());
    assert!(
        err.contains(Q) && err.contains("shape [64, 128], expected [128, 64]"),
        "{err}"
    );
}

#[test]
fn extra_tensor_is_an_error() {
    let tmp = broken_copy("qwen3_moe", |t| {
        let v = t[Q].clone();
        t.insert("model.layers.7.self_attn.q_proj.weight".into(), v);
    });
    let err = load_err(tmp.path());
    assert!(
        err.contains("unexpected tensor") && err.contains("model.layers.7.self_attn.q_proj.weight"),
        "{err}"
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let tmp = broken_copy("qwen3_moe", |t| {
        let e = t.get_mut(Q).unwrap();
        e.0 = safetensors::Dtype::I32;
    });
    let err = load_err(tmp.path());
    assert!(err.contains(Q) && err.contains("I32"), "{err}");
}

#[test]
fn corrupt_weights_file_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    copy_model(&fixture("qwen3_moe"), tmp.path());
    std::fs::write(
        tmp.path().join("model.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage",
    )
    .unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains("model.safetensors") && err.contains("not a valid safetensors file"),
        "{err}"
    );
    // A truncated file.
    let good = std::fs::read(fixture("qwen3_moe").join("model.safetensors")).unwrap();
    std::fs::write(
        tmp.path().join("model.safetensors"),
        &good[..good.len() / 2],
    )
    .unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("not a valid safetensors file"), "{err}");
}

#[test]
fn directory_without_weights_or_config() {
    let tmp = tempfile::tempdir().unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("config.json"), "{err}");
    std::fs::copy(
        fixture("qwen3_moe").join("config.json"),
        tmp.path().join("config.json"),
    )
    .unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("no weights found"), "{err}");
}

#[test]
fn sharded_checkpoint_with_a_missing_shard() {
    let src = fixture("llama");
    assert!(
        src.join("model.safetensors.index.json").is_file(),
        "the llama fixture is sharded"
    );
    let tmp = tempfile::tempdir().unwrap();
    copy_model(&src, tmp.path());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shard = index["weight_map"][Q].as_str().unwrap().to_string();
    std::fs::remove_file(tmp.path().join(&shard)).unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains(&shard), "{err}");
}

#[test]
fn sharded_index_naming_an_absent_tensor() {
    let src = fixture("llama");
    let tmp = tempfile::tempdir().unwrap();
    copy_model(&src, tmp.path());
    let path = tmp.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let shard = index["weight_map"][Q].clone();
    index["weight_map"]["model.layers.0.self_attn.ghost.weight"] = shard;
    std::fs::write(&path, index.to_string()).unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains("model.layers.0.self_attn.ghost.weight"),
        "{err}"
    );
}

#[test]
fn load_error_is_a_typed_value() {
    let tmp = broken_copy("qwen3_moe", |t| {
        t.remove(Q);
    });
    match Decoder::load(tmp.path(), &Device::flex()) {
        Err(LoadError::MissingTensor { name, expected, .. }) => {
            assert_eq!(name, Q);
            assert_eq!(expected, vec![128, 64]);
        }
        other => panic!("expected MissingTensor, got {:?}", other.err()),
    }
}
