//! `train.deterministic = false` (issue 28's `deterministic = off`): the backend's own kernels, so the
//! learner's `lp_old` is recomputed rather than taken from the rollout's record, and the mismatch the
//! kernels leave is reported. Deterministic mode is a process-wide switch that a run sets from its config,
//! so this file runs alone in its own process (other test files' runs keep the default).

mod common;

use qarl::train::{self, TrainConfig};

#[test]
fn deterministic_off_recomputes_lp_old_and_reports_the_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let toml = common::tiny_train_toml(tmp.path(), "aligned", 1);
    let default = TrainConfig::from_toml(&toml, "tiny").unwrap();
    assert!(
        default.train.deterministic,
        "deterministic mode is the default"
    );
    let off = toml.replace("[train]\n", "[train]\ndeterministic = false\n");
    let cfg = TrainConfig::from_toml(&off, "tiny").unwrap();
    assert!(
        !cfg.train.deterministic,
        "`deterministic = false` was not read"
    );
    train::run(&cfg, false, true).unwrap();
    assert!(
        !qarl::ops::deterministic(),
        "the run did not switch the mode"
    );
    let text = std::fs::read_to_string(cfg.run_dir.join("metrics.jsonl")).unwrap();
    let row: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["phase"] == "rl")
        .expect("an RL row");
    // Off, the training forward is not known to reproduce the rollout: lp_old comes from a forward.
    assert_eq!(row["train/lp_old_reused"], 0.0, "{row}");
    let k3 = row["rollout_corr/k3_kl"].as_f64().expect("k3 reported");
    assert!(k3.is_finite() && k3 >= 0.0, "k3 {k3}");
    eprintln!("deterministic off, aligned int4 forward: step-0 k3 KL {k3:e}");
}
