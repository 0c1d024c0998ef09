//! The same seed gives the same run on every CPU: the first SFT and RL steps of the default config (its
//! model, task, precision and objective; a smaller batch and evaluation to keep the test short) give
//! bitwise-identical metrics on every SIMD path this machine has (`QARL_SIMD=portable`, `avx2`, `neon` and
//! the native one). Every kernel the warm start and the learner use (forward, backward, LM head) has a
//! reduction order fixed by constants, not by the SIMD width or the cache sizes, so a machine with another
//! path computes what one of these does.

mod common;

use std::path::Path;
use std::process::Command;

use common::metrics_without_timing;
use qarl::ops::cpu::kernel::SimdPath;

fn run(dir: &Path, path: Option<SimdPath>) -> Vec<serde_json::Value> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_qarl"));
    cmd.args(["train", "--quiet"]);
    for set in [
        format!("run_dir={}", dir.join("run").display()),
        format!("model.dir={}", dir.join("model").display()),
        "sft.steps=3".into(),
        "sft.batch_size=8".into(),
        "train.steps=3".into(),
        "rollout.prompts_per_step=4".into(),
        "rollout.max_new_tokens=16".into(),
        "eval.problems=4".into(),
        "eval.max_new_tokens=16".into(),
        "checkpoint_every=0".into(),
    ] {
        cmd.args(["--set", &set]);
    }
    match path {
        Some(p) => cmd.env("QARL_SIMD", p.name()),
        None => cmd.env_remove("QARL_SIMD"),
    };
    let out = cmd.output().expect("run qarl");
    assert!(
        out.status.success(),
        "{:?}: {}",
        path,
        String::from_utf8_lossy(&out.stderr)
    );
    metrics_without_timing(&dir.join("run/metrics.jsonl"))
}

#[test]
fn every_simd_path_gives_the_same_first_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let native = run(&tmp.path().join("native"), None);
    let phases =
        |rows: &[serde_json::Value], p: &str| rows.iter().filter(|r| r["phase"] == p).count();
    assert!(phases(&native, "sft") >= 1, "{native:?}");
    assert_eq!(phases(&native, "rl"), 3, "{native:?}");
    let others: Vec<SimdPath> = SimdPath::available()
        .into_iter()
        .filter(|&p| p != SimdPath::detect())
        .collect();
    assert!(others.contains(&SimdPath::Portable));
    for path in others {
        let rows = run(&tmp.path().join(path.name()), Some(path));
        assert_eq!(rows.len(), native.len(), "{}", path.name());
        for (a, b) in rows.iter().zip(&native) {
            assert_eq!(
                a,
                b,
                "QARL_SIMD={} differs from the native path",
                path.name()
            );
        }
    }
}
