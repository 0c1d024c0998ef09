//! Training with stderr not a terminal (CI, `nohup`, a pipe): progress comes as plain lines with rate and
//! ETA, no colour or cursor codes reach the log, and outputs get the usual permissions (not 0600).

mod common;

use std::process::Command;

use common::tiny_train_toml;

#[test]
fn a_run_into_a_pipe_prints_plain_progress_lines() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("run.toml"),
        tiny_train_toml(tmp.path(), "aligned", 2),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(["train", "--config", "run.toml"])
        .current_dir(tmp.path())
        // A warning is logged (no RL checkpoint to resume from), so the log line's formatting is checked too.
        .arg("--resume")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{err}");
    assert!(out.status.success(), "{err}");
    assert!(!err.contains('\u{1b}'), "escape codes in the log: {err:?}");
    assert!(
        err.contains("WARN") && err.contains("no RL checkpoint yet"),
        "{err}"
    );
    for want in ["sft ", "rl ", "eta "] {
        assert!(err.contains(want), "no `{want}` progress line: {err}");
    }
    // The last line of each phase is written: its final position.
    assert!(err.contains("sft 8/8") && err.contains("rl 2/2"), "{err}");

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let run = tmp.path().join("run");
        let ckpt = run.join("checkpoints/step_000001");
        for p in [
            run.join("metrics.jsonl"),
            run.join("config.json"),
            ckpt.join("model.safetensors"),
            ckpt.join("trainer_state.json"),
            tmp.path().join("model/model.safetensors"),
        ] {
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode & 0o044, 0o044, "{}: mode {mode:o}", p.display());
        }
        for d in [ckpt, tmp.path().join("model")] {
            let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode & 0o055, 0o055, "{}: mode {mode:o}", d.display());
        }
    }
}

/// `perf/peak_rss_gb` is each RL step's own peak: memory the process touched before the run (here 600 MB,
/// as a warm start or an earlier experiment run would) is not in it (the process's all-time peak was
/// logged at every step).
#[test]
fn each_steps_peak_memory_is_its_own() {
    if qarl::ops::cpu::probe::peak_resident_gb().is_none() {
        eprintln!("no VmHWM on this system: nothing to check");
        return;
    }
    let big = vec![1u8; 600_000_000];
    assert!(big.iter().step_by(4096).all(|&b| b == 1));
    assert!(qarl::ops::cpu::probe::peak_resident_gb().unwrap() > 0.6);
    drop(big);
    let tmp = tempfile::tempdir().unwrap();
    let cfg =
        qarl::train::TrainConfig::from_toml(&tiny_train_toml(tmp.path(), "aligned", 2), "tiny")
            .unwrap();
    qarl::train::run(&cfg, false, true).unwrap();
    let text = std::fs::read_to_string(cfg.run_dir.join("metrics.jsonl")).unwrap();
    let peaks: Vec<f64> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["phase"] == "rl")
        .map(|r| r["perf/peak_rss_gb"].as_f64().unwrap())
        .collect();
    assert_eq!(peaks.len(), 2);
    assert!(peaks.iter().all(|&p| p > 0.0 && p < 0.4), "{peaks:?}");
}
