//! Loading: config.json in both key styles, and a clear error (naming file and problem) for each kind of bad
//! checkpoint.

mod common;

use std::path::Path;

use burn::tensor::Device;
use common::{copy_model, fixtures_dir, read_tensors, write_tensors};
use qarl::model::{Architecture, Checkpoint, Decoder, LoadError, ModelConfig};

/// The load's error for a broken directory, which the check without reading weights
/// (`Decoder::check_files`, what `qarl import-gguf` runs) must give word for word.
fn load_err(dir: &Path) -> String {
    let err = match Decoder::load(dir, &Device::flex()) {
        Ok(_) => panic!("{} loaded although it is broken", dir.display()),
        Err(e) => e.to_string(),
    };
    match Decoder::check_files(dir, &Device::flex()) {
        Ok(()) => panic!(
            "{}: the files passed the check, the load failed: {err}",
            dir.display()
        ),
        Err(e) => assert_eq!(e.to_string(), err, "{}", dir.display()),
    }
    err
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

/// A config without `rope_theta` or `rms_norm_eps` (older Llama conversions) reads transformers' class
/// defaults, 10000 and 1e-6, as transformers loads it; a stated value is still checked.
#[test]
fn missing_rope_theta_and_rms_norm_eps_take_transformers_defaults() {
    let text = CLASSIC_MOE
        .replace("\"rope_theta\": 1000000.0,", "")
        .replace("\"rms_norm_eps\": 1e-6,", "");
    let c = ModelConfig::from_json_str(&text, Path::new("config.json")).unwrap();
    assert_eq!((c.rope_theta, c.rms_norm_eps), (10000.0, 1e-6));
    let bad = CLASSIC_MOE.replace("\"rope_theta\": 1000000.0", "\"rope_theta\": -1");
    let err = ModelConfig::from_json_str(&bad, Path::new("config.json"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`rope_theta`"), "{err}");
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
            CLASSIC_MOE.replace("\"num_experts\": 8,", ""),
            "missing key `num_local_experts` or `num_experts`",
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

/// A weights file that is a directory is named as such, not reported as "no weights found".
#[test]
fn a_weights_file_that_is_no_file_is_named() {
    for name in ["model.safetensors", "model.safetensors.index.json"] {
        let tmp = tempfile::tempdir().unwrap();
        copy_model(&fixture("qwen3_moe"), tmp.path());
        std::fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
        assert!(load_err(tmp.path()).contains("no weights found"));
        std::fs::create_dir(tmp.path().join(name)).unwrap();
        let err = load_err(tmp.path());
        assert!(
            err.ends_with(&format!(
                "{name}: is a directory, where a file was expected"
            )),
            "{err}"
        );
    }
}

/// The check without reading weights passes every fixture that loads.
#[test]
fn checking_the_files_passes_what_loads() {
    for name in [
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_f16",
        "qwen3_moe",
        "qwen3_moe_norm",
    ] {
        let dir = fixture(name);
        Decoder::load(&dir, &Device::flex()).unwrap();
        Decoder::check_files(&dir, &Device::flex()).unwrap();
    }
}

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
    assert!(
        err.contains(Q) && err.contains("I32") && err.contains("supported here: F32, BF16, F16"),
        "{err}"
    );
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

/// A tensor in two shards has two values (transformers keeps the shard it loads last, the index may name
/// the other): refused naming both shards, listed in the index or not (the first was taken silently).
#[test]
fn a_tensor_in_two_shards_is_refused() {
    let src = fixture("llama");
    for listed in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        copy_model(&src, tmp.path());
        let path = tmp.path().join("model.safetensors.index.json");
        let mut index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let home = index["weight_map"][Q].as_str().unwrap().to_string();
        let map = index["weight_map"].as_object().unwrap();
        let other = map
            .values()
            .map(|f| f.as_str().unwrap().to_string())
            .find(|f| *f != home)
            .expect("the llama fixture has two shards");
        let copied = read_tensors(&tmp.path().join(&home))[Q].clone();
        let mut tensors = read_tensors(&tmp.path().join(&other));
        tensors.insert(Q.to_string(), copied);
        write_tensors(&tmp.path().join(&other), &tensors);
        if !listed {
            index["weight_map"].as_object_mut().unwrap().remove(Q);
            std::fs::write(&path, index.to_string()).unwrap();
        }
        let err = load_err(tmp.path());
        assert!(
            err.contains(&format!("tensor `{Q}` is in two shards"))
                && err.contains(&home)
                && err.contains(&other),
            "listed {listed}: {err}"
        );
    }
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

/// Saving writes back exactly the tensors loading read: same names, shapes and (f32) values. Both take the
/// names from the one walk over the model's parameters (`qarl::model::params`).
#[test]
fn saving_writes_back_the_tensors_loading_read() {
    let device = Device::flex();
    for dir in common::fixture_models() {
        let model = Decoder::load(&dir, &device).unwrap();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let tmp = tempfile::tempdir().unwrap();
        qarl::model::save::save_pretrained(&model, &json, tmp.path()).unwrap();
        let saved = read_tensors(&tmp.path().join("model.safetensors"));
        let ckpt = Checkpoint::open(&dir).unwrap();
        // A tied model's stored head and transformers' rotary buffers are read by nobody.
        let read: Vec<&str> = ckpt
            .names()
            .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
            .filter(|n| model.lm_head.is_some() || *n != "lm_head.weight")
            .collect();
        let written: Vec<&str> = saved.keys().map(String::as_str).collect();
        assert_eq!(written, read, "{}", dir.display());
        for (name, (dtype, shape, bytes)) in &saved {
            assert_eq!(*dtype, safetensors::Dtype::F32, "{name}");
            let want = ckpt.read_f32(name, shape).unwrap();
            let got: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert!(
                got.iter()
                    .map(|x| x.to_bits())
                    .eq(want.iter().map(|x| x.to_bits())),
                "{}: {name}",
                dir.display()
            );
        }
    }
}

/// A random checkpoint gives tensor number `i` (in load order) random stream `i`, so that order is part of
/// what a seed means: this pins it (embeddings; per layer the input norm, q/k/v/o each with its bias, the
/// q/k norms, the post-attention norm, then the experts before the router, or the dense MLP; final norm;
/// head).
#[test]
fn random_checkpoint_tensors_keep_their_numbering() {
    let mut cfg = ModelConfig::from_json_str(CLASSIC_MOE, Path::new("config.json")).unwrap();
    (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) = (true, true, true);
    let mut want: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![256, 64])];
    let linear =
        |want: &mut Vec<(String, Vec<usize>)>, name: String, out: usize, inn: usize, bias: bool| {
            want.push((format!("{name}.weight"), vec![out, inn]));
            if bias {
                want.push((format!("{name}.bias"), vec![out]));
            }
        };
    for i in 0..2 {
        let p = format!("model.layers.{i}");
        want.push((format!("{p}.input_layernorm.weight"), vec![64]));
        linear(&mut want, format!("{p}.self_attn.q_proj"), 128, 64, true);
        linear(&mut want, format!("{p}.self_attn.k_proj"), 64, 64, true);
        linear(&mut want, format!("{p}.self_attn.v_proj"), 64, 64, true);
        linear(&mut want, format!("{p}.self_attn.o_proj"), 64, 128, true);
        want.push((format!("{p}.self_attn.q_norm.weight"), vec![32]));
        want.push((format!("{p}.self_attn.k_norm.weight"), vec![32]));
        want.push((format!("{p}.post_attention_layernorm.weight"), vec![64]));
        if i == 0 {
            for e in 0..8 {
                let x = format!("{p}.mlp.experts.{e}");
                linear(&mut want, format!("{x}.gate_proj"), 32, 64, false);
                linear(&mut want, format!("{x}.up_proj"), 32, 64, false);
                linear(&mut want, format!("{x}.down_proj"), 64, 32, false);
            }
            linear(&mut want, format!("{p}.mlp.gate"), 8, 64, false);
        } else {
            linear(&mut want, format!("{p}.mlp.gate_proj"), 96, 64, true);
            linear(&mut want, format!("{p}.mlp.up_proj"), 96, 64, true);
            linear(&mut want, format!("{p}.mlp.down_proj"), 64, 96, true);
        }
    }
    want.push(("model.norm.weight".into(), vec![64]));
    want.push(("lm_head.weight".into(), vec![256, 64]));
    assert_eq!(qarl::model::init::tensor_specs(&cfg), want);
}

/// Packed codes stored in another dtype than their layout's: the error says what this tensor may be
/// (it said "supported: F32, BF16, F16", the dtypes of weights read as f32, which a packed tensor is not).
#[test]
fn packed_codes_of_another_dtype_name_theirs() {
    let tmp = tempfile::tempdir().unwrap();
    let q = tmp.path().join("q");
    qarl::model::quantize::quantize_checkpoint(
        &fixture("qwen3_moe"),
        &q,
        &qarl::quant::QuantConfig::new("int8-pc".parse().unwrap()),
    )
    .unwrap();
    let file = q.join("model.safetensors");
    let mut tensors = read_tensors(&file);
    let name = "model.layers.0.self_attn.q_proj.qweight";
    tensors.get_mut(name).expect(name).0 = safetensors::Dtype::I8;
    write_tensors(&file, &tensors);
    let err = load_err(&q);
    assert!(
        err.contains(name)
            && err.contains("has dtype I8; supported here: U8 (the packed layout")
            && !err.contains("F32"),
        "{err}"
    );
}

/// A tied model that stores its head anyway loads where the head is the embedding matrix (dropped, as every
/// loader agrees), and is refused, naming the head and the way out, where it is not: transformers 5 would
/// use the stored head, vLLM and transformers 4 the embedding.
#[test]
fn a_tied_models_stored_head_must_be_its_embedding() {
    const EMBED: &str = "model.embed_tokens.weight";
    let same = broken_copy("qwen3", |t| {
        let embed = t[EMBED].clone();
        t.insert("lm_head.weight".into(), embed);
    });
    Decoder::load(same.path(), &Device::flex()).expect("the embedding's copy loads");
    Decoder::check_files(same.path(), &Device::flex()).expect("and passes the check");
    let other = broken_copy("qwen3", |t| {
        let mut head = t[EMBED].clone();
        head.2[0] ^= 0x40;
        t.insert("lm_head.weight".into(), head);
    });
    let err = load_err(other.path());
    assert!(
        err.contains("lm_head.weight")
            && err.contains("1 of its")
            && err.contains("tie_word_embeddings"),
        "{err}"
    );
}

/// Experts stored fused (transformers' `save_pretrained(save_original_format=False)`: one `gate_up_proj`
/// and one `down_proj` per layer) are named as such, not reported as a missing per-expert tensor (which
/// read like a damaged file).
#[test]
fn fused_experts_are_named_as_a_layout() {
    let tmp = broken_copy("qwen3_moe", |t| {
        let prefix = "model.layers.0.mlp.experts.";
        let experts: Vec<String> = t
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        let (dtype, shape, bytes) = t[&experts[0]].clone();
        for k in experts {
            t.remove(&k);
        }
        t.insert(format!("{prefix}gate_up_proj"), (dtype, shape, bytes));
    });
    let err = load_err(tmp.path());
    assert!(
        err.contains("model.layers.0.mlp.experts.gate_up_proj")
            && err.contains("experts stored fused")
            && err.contains("save_original_format=True"),
        "{err}"
    );
}
