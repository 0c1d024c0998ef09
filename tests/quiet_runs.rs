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
