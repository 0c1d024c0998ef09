//! `qarl init-model` and `qarl bench rollout` end to end on the tiny Qwen3-MoE config, and their errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn::module::Module;
use burn::tensor::Device;
use qarl::host::to_f32_vec;
use qarl::model::init::{param_count, tensor_specs};
use qarl::model::{Decoder, ModelConfig};
use qarl::quant::QuantScheme;

fn qarl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_qarl"))
}

fn tiny_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen3-moe-tiny.json")
}

fn init_model(config: &Path, out: &Path, seed: u64) -> Output {
    qarl()
        .args(["init-model", "--config"])
        .arg(config)
        .arg("--output")
        .arg(out)
        .args(["--seed", &seed.to_string()])
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Hand count for the tiny config: hidden 128, 4 layers, 4 heads / 2 kv heads of 32, 8 experts of 64, vocab 512.
const TINY_PARAMS: usize = {
    let (v, h, d, heads, kv, e, inter, layers) = (512, 128, 32, 4, 2, 8, 64, 4);
    let attn = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d;
    let moe = e * 3 * h * inter + e * h;
    2 * v * h + h + layers * (attn + moe + 2 * h)
};

#[test]
fn init_model_writes_a_loadable_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    let out = init_model(&tiny_config(), &dir, 3);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(&TINY_PARAMS.to_string()),
        "{}",
        text(&out.stdout)
    );

    let cfg = ModelConfig::from_file(&dir).unwrap();
    assert_eq!(cfg, ModelConfig::from_file(tiny_config()).unwrap());
    assert_eq!(param_count(&cfg), TINY_PARAMS);
    let model = Decoder::load(&dir, &Device::flex()).unwrap();
    assert_eq!(model.num_params(), TINY_PARAMS);

    // Matrices are normal(0, 0.02), norms 1: check one of each through the loaded model.
    let embed = to_f32_vec(model.embed_tokens.val());
    let n = embed.len() as f64;
    let mean = embed.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (embed
        .iter()
        .map(|&x| (x as f64 - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    assert!(
        mean.abs() < 1e-3 && (std - 0.02).abs() < 1e-3,
        "mean {mean}, std {std}"
    );
    let norm = to_f32_vec(model.norm.weight.val());
    assert!(norm.iter().all(|&x| x == 1.0));

    // Deterministic from the seed.
    let same = tmp.path().join("same");
    let other = tmp.path().join("other");
    assert!(init_model(&tiny_config(), &same, 3).status.success());
    assert!(init_model(&tiny_config(), &other, 4).status.success());
    let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(bytes(&dir), bytes(&same));
    assert_ne!(bytes(&dir), bytes(&other));
}

#[test]
fn tensor_specs_cover_dense_and_biased_architectures() {
    // Qwen2: q/k/v biases, no q/k norms; tied embeddings: no lm_head.
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("qwen2.json");
    std::fs::write(
        &config,
        r#"{"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let cfg = ModelConfig::from_file(&config).unwrap();
    let names: Vec<String> = tensor_specs(&cfg).into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"model.layers.1.self_attn.k_proj.bias".to_string()));
    assert!(names.contains(&"model.layers.0.mlp.down_proj.weight".to_string()));
    assert!(!names
        .iter()
        .any(|n| n.contains("q_norm") || n == "lm_head.weight"));
    let dir = tmp.path().join("model");
    qarl::model::init::write_random_checkpoint(&config, &dir, 0, 0.02).unwrap();
    let model = Decoder::load(&dir, &Device::flex()).unwrap();
    assert_eq!(model.num_params(), param_count(&cfg));
}

#[test]
fn bench_rollout_prints_a_row_per_scheme() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    assert!(init_model(&tiny_config(), &dir, 0).status.success());
    let json = tmp.path().join("bench.json");
    // Every precision by name (the fp4 schemes included), whatever the flag's default lists.
    let all: Vec<&str> = qarl::quant::Precision::all().map(|p| p.name()).collect();
    let out = qarl()
        .args(["bench", "rollout", "--model"])
        .arg(&dir)
        .args(["--schemes", &all.join(",")])
        .args([
            "--batch",
            "2",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
            "--repeats",
            "1",
        ])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let mut names = vec!["f32"];
    names.extend(QuantScheme::ALL.iter().map(|s| s.name()));
    for name in &names {
        let row = stdout
            .lines()
            .find(|l| l.split('|').next().map(str::trim) == Some(name))
            .unwrap_or_else(|| panic!("no row for {name} in\n{stdout}"));
        let cols: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!(cols.len(), 8, "{row}");
        assert_eq!(cols[1], "on", "deterministic mode is the default: {row}");
        assert_eq!(
            cols[2], "grouped",
            "grouped MoE experts are the default: {row}"
        );
    }
    assert!(stdout.contains("quantize time:"), "{stdout}");

    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), names.len());
    for r in results {
        assert_eq!(r["tokens"], 6);
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(r["ratio_to_f32"].as_f64().unwrap() > 0.0);
        assert!(r["decode_ms_per_step"].as_f64().is_some());
        // On the CPU a read is a copy in host memory, not a device transfer.
        assert_eq!(r["host_reads_per_decode_step"], 0.0);
        assert_eq!(r["grouped_experts"], true);
    }
    assert_eq!(results[0]["ratio_to_f32"], 1.0);
}

/// `--ragged` times prompts of different lengths (the KV cache's per-row path, which an RL batch takes):
/// the report names their lengths, from `--prompt-len` down to half of it.
#[test]
fn bench_rollout_ragged_prompts_differ_in_length() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    assert!(init_model(&tiny_config(), &dir, 0).status.success());
    let json = tmp.path().join("bench.json");
    let out = qarl()
        .args(["bench", "rollout", "--model"])
        .arg(&dir)
        .args(["--schemes", "int4-g32", "--batch", "3", "--prompt-len", "6"])
        .args(["--new-tokens", "3", "--repeats", "1", "--ragged", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("prompts 3-6 tokens (ragged)"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["prompt_lens"], serde_json::json!([6, 5, 3]));
    assert_eq!(v["results"][0]["tokens"], 9);
}

#[test]
fn bad_inputs_exit_1_naming_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope.json");
    let out = init_model(&missing, &tmp.path().join("out"), 0);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("nope.json"),
        "{}",
        text(&out.stderr)
    );

    let dir = tmp.path().join("tiny");
    assert!(init_model(&tiny_config(), &dir, 0).status.success());
    let out = qarl()
        .args(["bench", "rollout", "--model"])
        .arg(&dir)
        .args(["--schemes", "f32,int3-g7"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("unknown scheme `int3-g7`") && err.contains("int4-g128"),
        "{err}"
    );

    let out = qarl()
        .args(["bench", "rollout", "--model"])
        .arg(tmp.path().join("no-model"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no-model"),
        "{}",
        text(&out.stderr)
    );

    let out = qarl()
        .args(["bench", "rollout", "--model"])
        .arg(&dir)
        .args(["--new-tokens", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--new-tokens"),
        "{}",
        text(&out.stderr)
    );
}

/// A 4-bit layer of 2 inputs packs its row into 1 byte, as an 8-bit layer of 1 input does: the check of
/// one-byte-per-input codes took it for one (its high nibble, the second input, read as padding that must be
/// 0), so a checkpoint `qarl quantize` wrote did not load.
#[test]
fn a_four_bit_layer_of_two_inputs_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_config()).unwrap()).unwrap();
    json["moe_intermediate_size"] = 2.into();
    let config = tmp.path().join("narrow.json");
    std::fs::write(&config, json.to_string()).unwrap();
    let dense = tmp.path().join("dense");
    let out = init_model(&config, &dense, 5);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for scheme in ["int4-g32", "nvfp4", "mxfp4"] {
        let packed = tmp.path().join(scheme);
        let out = qarl()
            .args(["quantize", "--scheme", scheme, "--model"])
            .arg(&dense)
            .arg("--output")
            .arg(&packed)
            .output()
            .unwrap();
        assert!(out.status.success(), "{scheme}: {}", text(&out.stderr));
        Decoder::load(&packed, &Device::flex())
            .unwrap_or_else(|e| panic!("{scheme}: its own checkpoint does not load: {e}"));
    }
}

/// Two `bench step` variants of one label are refused before anything runs, naming the label and both
/// variants (the table and the JSON key rows by label).
#[test]
fn bench_step_refuses_a_label_given_twice() {
    let out = qarl()
        .args(["bench", "step", "--variant", "a:train.steps=1"])
        .args([
            "--variant",
            "b:train.lr=1e-4",
            "--variant",
            "a:train.steps=2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--variant: the label `a` is given twice (variants 1 and 3)"),
        "{err}"
    );
    assert!(!err.contains("probing the machine"), "{err}");
}
