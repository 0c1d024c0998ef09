//! Helpers shared by the integration tests: fixture discovery and writing small checkpoints.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

pub mod moe;

/// A random tiny Qwen3-MoE (`configs/models/qwen3-moe-arith.json`, weights drawn with `seed` and
/// `init_std`) with the arithmetic task's character tokenizer, written into `dir`.
pub fn arith_model(dir: &Path, seed: u64, init_std: f32) {
    let init = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen3-moe-arith.json");
    qarl::model::init::write_random_checkpoint(&init, dir, seed, init_std).unwrap();
    qarl::tasks::char_tokenizer::save(dir).unwrap();
}

/// Directory of the committed transformers fixtures.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

/// Whether wgpu has an adapter; a missing one fails the test under `QARL_REQUIRE_WGPU=1` (CI), else the
/// caller skips with the message printed here.
pub fn wgpu_available() -> bool {
    match qarl::ops::BackendKind::Wgpu.device() {
        Ok(_) => true,
        Err(e) if std::env::var("QARL_REQUIRE_WGPU").is_ok_and(|v| v == "1") => {
            panic!("QARL_REQUIRE_WGPU=1 but {e:#}")
        }
        Err(e) => {
            eprintln!("SKIPPED: {e:#}");
            false
        }
    }
}

/// Every fixture model directory (each has a `reference.json`).
pub fn fixture_models() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures/hf exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixtures under tests/fixtures/hf");
    dirs
}

#[derive(Debug, Deserialize)]
pub struct Greedy {
    pub prompt_ids: Vec<Vec<u32>>,
    pub max_new_tokens: usize,
    pub ids: Vec<Vec<u32>>,
}

#[derive(Debug, Deserialize)]
pub struct Reference {
    pub input_ids: Vec<Vec<u32>>,
    pub logits: Vec<Vec<Vec<f32>>>,
    pub greedy: Greedy,
}

pub fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Copies a fixture directory (config + weights, not the reference) to `dst`.
pub fn copy_model(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
}

/// All tensors of a single-file checkpoint as `(dtype, shape, raw bytes)`.
pub fn read_tensors(file: &Path) -> BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// Writes tensors to a safetensors file.
pub fn write_tensors(
    file: &Path,
    tensors: &BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, file).unwrap();
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs a `qarl` command, fails the test with its stderr if it fails, and returns the JSON it wrote to
/// `output`.
pub fn run_qarl_json(cmd: &mut std::process::Command, output: &Path) -> serde_json::Value {
    stdout_of(cmd);
    serde_json::from_str(&std::fs::read_to_string(output).unwrap()).unwrap()
}

/// Runs a command that must succeed and returns its standard output; a failure fails the test with
/// its standard error.
pub fn stdout_of(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command that must fail the way bad input does (exit code 1: an error, no panic) and returns
/// its standard error.
pub fn error_of(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{cmd:?}: {err}");
    assert!(!err.contains("panicked"), "{cmd:?}: {err}");
    err
}

/// Runs a command whose arguments the parser must refuse (exit code 2) and returns its standard error.
pub fn usage_error_of(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{cmd:?}: {err}");
    err
}

/// The TOML of a small, fast training run rooted in `dir` (run in `dir/run`, model in `dir/model`):
/// 1-digit arithmetic, 8 SFT steps, int4 rollouts, TBPO, a checkpoint every step, all kept.
pub fn tiny_train_toml(dir: &Path, forward: &str, rl_steps: usize) -> String {
    let model_cfg =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen3-moe-arith.json");
    format!(
        r#"
run_dir = "{run}"
seed = 3
checkpoint_every = 1
keep_checkpoints = 0
[model]
dir = "{model}"
init_config = "{init}"
[task]
kind = "arithmetic"
max_digits = 1
max_terms = 2
[sft]
steps = 8
batch_size = 8
lr = 3e-3
answer_only_frac = 0.5
[rollout]
precision = "int4-g32"
prompts_per_step = 3
samples_per_prompt = 4
max_new_tokens = 12
[train]
steps = {rl_steps}
forward = "{forward}"
lr = 1e-4
[train.loss]
objective = "tbpo"
[eval]
every = 100
problems = 4
max_new_tokens = 12
"#,
        run = dir.join("run").display(),
        model = dir.join("model").display(),
        init = model_cfg.display(),
    )
}

/// The rows of a metrics.jsonl file with the timing keys (`perf/*`) removed.
pub fn metrics_without_timing(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            if let Some(o) = v.as_object_mut() {
                o.retain(|k, _| !k.starts_with("perf/"));
            }
            v
        })
        .collect()
}

/// Waits, polling every `poll`, until `ready()` holds, then kills `child` with SIGKILL and checks that it
/// did not exit successfully. Fails if `what` (the child: "the run", "the warm start") ends first or
/// `limit` passes. Returns how long it waited.
pub fn sigkill_when(
    child: &mut std::process::Child,
    what: &str,
    limit: std::time::Duration,
    poll: std::time::Duration,
    ready: impl Fn() -> bool,
) -> std::time::Duration {
    let t0 = std::time::Instant::now();
    while !ready() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "{what} ended before it could be killed"
        );
        assert!(t0.elapsed() < limit, "timed out");
        std::thread::sleep(poll);
    }
    child.kill().unwrap(); // SIGKILL
    assert!(!child.wait().unwrap().success());
    t0.elapsed()
}

/// Deterministic pseudo-random values in [-1, 1).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Three prompts of different lengths (7, 2 and 4 tokens), ids within every fixture's vocabulary: the
/// rollout tests' batch, ragged so padding and per-row positions are exercised.
pub fn ragged_prompts() -> Vec<Vec<u32>> {
    vec![
        vec![3, 17, 99, 42, 7, 250, 11],
        vec![5, 6],
        vec![200, 1, 2, 3],
    ]
}

/// Sampling at T = 0.8 with top-p 0.95 and top-k 50, 10 new tokens, seeded.
pub fn sampling(seed: u64) -> qarl::rollout::SamplingParams {
    qarl::rollout::SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 50,
        max_new_tokens: 10,
        seed,
        ..qarl::rollout::SamplingParams::default()
    }
}
