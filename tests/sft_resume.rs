//! The warm start (SFT) checkpoints and resumes like RL: a SIGKILL in the middle of SFT, then `--resume`,
//! gives the same model and the same SFT metrics rows as a run that was never killed.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{metrics_without_timing, sigkill_when, tiny_train_toml};
use qarl::train::{self, checkpoint, sft, TrainConfig};

fn sft_rows(run: &Path) -> Vec<serde_json::Value> {
    metrics_without_timing(&run.join("metrics.jsonl"))
        .into_iter()
        .filter(|r| r["phase"] == "sft")
        .collect()
}

fn qarl(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "qarl=info")
        .output()
        .unwrap()
}

#[test]
fn a_kill_during_sft_resumes_sft_bitwise_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let killed_dir = tmp.path().join("killed");
    let mut text = tiny_train_toml(&killed_dir, "aligned", 1);
    text = text.replace("[sft]\n", "[sft]\nlog_every = 1\n");
    std::fs::create_dir_all(&killed_dir).unwrap();
    let cfg_path = killed_dir.join("run.toml");
    std::fs::write(&cfg_path, &text).unwrap();
    let cfg = TrainConfig::from_toml(&text, "tiny").unwrap();
    let root = sft::checkpoints_root(&cfg.run_dir);

    let mut child = Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(["train", "--quiet", "--config"])
        .arg(&cfg_path)
        .env(checkpoint::TEST_PAUSE_ENV, "300")
        .current_dir(&killed_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    sigkill_when(
        &mut child,
        "the run",
        Duration::from_secs(120),
        Duration::from_millis(10),
        || {
            root.join("step_000002")
                .join("trainer_state.json")
                .is_file()
        },
    );
    assert!(
        !cfg.model.dir.exists(),
        "the warm start finished before the kill"
    );
    let killed_at = checkpoint::latest_checked_in(&root)
        .unwrap()
        .unwrap()
        .1
        .step;
    println!("killed during SFT, newest SFT checkpoint: step {killed_at}");
    assert!((2..7).contains(&killed_at), "{killed_at}");

    // A fresh start is refused (it would throw the warm start away), and so is a resume with another [sft].
    let out = qarl(&killed_dir, &["train", "--quiet", "--config", "run.toml"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("unfinished warm start"),
        "{err}"
    );
    // A resume with other settings: refused, naming the key, before the run's config.json changes.
    let run_config = std::fs::read(cfg.run_dir.join("config.json")).unwrap();
    let refused = |extra: &[&str], set: &str, want: &[&str]| {
        let mut args = vec!["train", "--quiet", "--resume"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--config", "run.toml", "--set", set]);
        let out = qarl(&killed_dir, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set}: {err}");
        for w in want {
            assert!(err.contains(w), "{set}: expected `{w}` in {err}");
        }
        assert_eq!(
            std::fs::read(cfg.run_dir.join("config.json")).unwrap(),
            run_config,
            "{set}: config.json rewritten"
        );
    };
    refused(&[], "sft.lr=1e-3", &["`sft.lr`"]);
    // Another task or model config too (the warm start's identity: a changed model config wrote a model
    // whose config.json was not its weights'), also where the run is told to accept changes.
    refused(&[], "task.max_digits=2", &["`task.max_digits`"]);
    let other_model = killed_dir.join("other_model.json");
    let mut model_cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(cfg.model.init_config.as_ref().unwrap()).unwrap(),
    )
    .unwrap();
    model_cfg["num_hidden_layers"] = serde_json::json!(1);
    std::fs::write(&other_model, model_cfg.to_string()).unwrap();
    let set_model = format!("model.init_config={:?}", other_model.display().to_string());
    refused(
        &["--accept-changes"],
        &set_model,
        &["sft.json", "model_config"],
    );
    assert!(!cfg.model.dir.exists(), "no model was written");

    // The step to go on from is the checkpoint's step + 1, not the state's `next_step`: an edited one ran
    // too few steps (or none) and wrote the model as a finished warm start.
    let newest = checkpoint::latest_checked_in(&root).unwrap().unwrap().0;
    let state_path = newest.join("trainer_state.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state_path).unwrap()).unwrap();
    state["next_step"] = serde_json::json!(100000);
    std::fs::write(&state_path, state.to_string()).unwrap();
    let out = qarl(
        &killed_dir,
        &["train", "--quiet", "--resume", "--config", "run.toml"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("resuming the warm start"),
        "SFT was not resumed: {err}"
    );
    assert!(
        !root.exists(),
        "the warm start's checkpoints stayed after it finished"
    );

    let mut straight = cfg.clone();
    straight.run_dir = tmp.path().join("straight/run");
    straight.model.dir = tmp.path().join("straight/model");
    train::run(&straight, false, true).unwrap();
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        weights(&cfg.model.dir) == weights(&straight.model.dir),
        "the resumed warm start gives other weights than an uninterrupted one"
    );
    let (a, b) = (sft_rows(&cfg.run_dir), sft_rows(&straight.run_dir));
    let steps: Vec<u64> = a.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(
        steps,
        (0..8).collect::<Vec<u64>>(),
        "each SFT step logged once"
    );
    assert_eq!(a, b, "SFT metrics differ after the resume");
}

/// `qarl sft` checkpoints too (`checkpoint_every` = 1 here), and a finished warm start leaves none behind.
#[test]
fn qarl_sft_leaves_no_checkpoints_when_it_finishes() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tiny_train_toml(tmp.path(), "aligned", 1);
    let cfg = TrainConfig::from_toml(&text, "tiny").unwrap();
    std::fs::write(tmp.path().join("run.toml"), &text).unwrap();
    let out = qarl(tmp.path(), &["sft", "--quiet", "--config", "run.toml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(cfg.model.dir.join("config.json").is_file());
    assert!(!sft::checkpoints_root(&cfg.run_dir).exists());
    let rows = metrics_without_timing(&cfg.run_dir.join("sft_metrics.jsonl"));
    assert!(!rows.is_empty() && rows.iter().all(|r| r["phase"] == "sft"));
}

/// `qarl sft` (the warm start alone) resumes too: killed in the middle, the next `qarl sft` continues from
/// its resume point and ends with the weights and `sft_metrics.jsonl` rows of a run that was never killed.
#[test]
fn a_kill_during_qarl_sft_resumes_on_the_next_qarl_sft() {
    let tmp = tempfile::tempdir().unwrap();
    let setup = |name: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let text = tiny_train_toml(&dir, "aligned", 1).replace("[sft]\n", "[sft]\nlog_every = 1\n");
        std::fs::write(dir.join("run.toml"), &text).unwrap();
        (dir, TrainConfig::from_toml(&text, "tiny").unwrap())
    };
    let (killed_dir, cfg) = setup("killed");
    let root = sft::checkpoints_root(&cfg.run_dir);
    let mut child = Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(["sft", "--quiet", "--config", "run.toml"])
        .env(checkpoint::TEST_PAUSE_ENV, "300")
        .current_dir(&killed_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    sigkill_when(
        &mut child,
        "the warm start",
        Duration::from_secs(120),
        Duration::from_millis(10),
        || {
            root.join("step_000002")
                .join("trainer_state.json")
                .is_file()
        },
    );
    assert!(
        !cfg.model.dir.exists(),
        "the warm start finished before the kill"
    );

    let out = qarl(&killed_dir, &["sft", "--quiet", "--config", "run.toml"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("resuming the warm start"),
        "SFT was not resumed: {err}"
    );
    assert!(
        !root.exists(),
        "the resume points stayed after the warm start finished"
    );

    let (straight_dir, straight) = setup("straight");
    let out = qarl(&straight_dir, &["sft", "--quiet", "--config", "run.toml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        weights(&cfg.model.dir) == weights(&straight.model.dir),
        "the resumed warm start gives other weights than an uninterrupted one"
    );
    let rows = |c: &TrainConfig| metrics_without_timing(&c.run_dir.join("sft_metrics.jsonl"));
    let (a, b) = (rows(&cfg), rows(&straight));
    let steps: Vec<u64> = a.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(
        steps,
        (0..8).collect::<Vec<u64>>(),
        "each SFT step logged once"
    );
    assert_eq!(a, b, "SFT metrics differ after the resume");
}

/// `model.base`: `qarl sft` fine-tunes a pretrained directory into `model.dir`. Here the base is itself a
/// warm-started tiny model, so a start from its weights shows in the first SFT loss (next to the base's
/// last one, far from a random start's); its tokenizer comes along, its weights are changed by the steps, and the base is untouched.
#[test]
fn qarl_sft_fine_tunes_a_pretrained_base() {
    let tmp = tempfile::tempdir().unwrap();
    let first_loss = |run: &Path| -> (f64, f64) {
        let rows = metrics_without_timing(&run.join("sft_metrics.jsonl"));
        let loss = |r: &serde_json::Value| r["sft/loss"].as_f64().unwrap();
        (loss(&rows[0]), loss(rows.last().unwrap()))
    };
    let base_dir = tmp.path().join("base");
    std::fs::create_dir_all(&base_dir).unwrap();
    let text =
        tiny_train_toml(&base_dir, "aligned", 1).replace("[sft]\n", "[sft]\nlog_every = 1\n");
    std::fs::write(base_dir.join("run.toml"), &text).unwrap();
    let base = TrainConfig::from_toml(&text, "base").unwrap();
    let out = qarl(&base_dir, &["sft", "--quiet", "--config", "run.toml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (random_start, base_end) = first_loss(&base.run_dir);
    let base_weights = std::fs::read(base.model.dir.join("model.safetensors")).unwrap();
    // A base that says it holds bfloat16 (its weights read the same): the tuned model's f32 weights must
    // not inherit the claim.
    let base_config = base.model.dir.join("config.json");
    let mut claimed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&base_config).unwrap()).unwrap();
    claimed["torch_dtype"] = serde_json::json!("bfloat16");
    std::fs::write(&base_config, claimed.to_string()).unwrap();

    let tuned_dir = tmp.path().join("tuned");
    std::fs::create_dir_all(&tuned_dir).unwrap();
    let init_line = text
        .lines()
        .find(|l| l.starts_with("init_config"))
        .unwrap()
        .to_string();
    let tuned_text = tiny_train_toml(&tuned_dir, "aligned", 1)
        .replace("[sft]\n", "[sft]\nlog_every = 1\n")
        .replace(&init_line, "")
        .replace(
            "[model]\n",
            &format!("[model]\nbase = \"{}\"\n", base.model.dir.display()),
        );
    std::fs::write(tuned_dir.join("run.toml"), &tuned_text).unwrap();
    let tuned = TrainConfig::from_toml(&tuned_text, "tuned").unwrap();
    assert!(tuned.model.init_config.is_none(), "{tuned_text}");
    let out = qarl(&tuned_dir, &["sft", "--quiet", "--config", "run.toml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (tuned_start, _) = first_loss(&tuned.run_dir);
    println!("first SFT loss: random start {random_start}, base's last {base_end}, from the base {tuned_start}");
    assert!(
        (tuned_start - base_end).abs() < 0.1 * (random_start - base_end),
        "the warm start did not start from the base's weights: {tuned_start} vs {random_start} / {base_end}"
    );
    for file in ["tokenizer.json", "config.json"] {
        let read = |dir: &Path| std::fs::read_to_string(dir.join(file)).unwrap();
        let json = |s: String| serde_json::from_str::<serde_json::Value>(&s).unwrap();
        let (mut from_base, mut tuned_json) =
            (json(read(&base.model.dir)), json(read(&tuned.model.dir)));
        if file == "config.json" {
            assert_eq!(tuned_json["torch_dtype"], "float32");
            from_base["torch_dtype"] = serde_json::Value::Null;
            tuned_json["torch_dtype"] = serde_json::Value::Null;
        }
        assert_eq!(from_base, tuned_json, "{file}");
    }
    let tuned_weights = std::fs::read(tuned.model.dir.join("model.safetensors")).unwrap();
    assert_eq!(tuned_weights.len(), base_weights.len());
    assert_ne!(
        tuned_weights, base_weights,
        "the fine-tuning changed nothing"
    );
    assert_eq!(
        std::fs::read(base.model.dir.join("model.safetensors")).unwrap(),
        base_weights,
        "the base was modified"
    );
}

/// `model.base` is refused beside `model.init_config` and without `[sft]`, naming both keys.
#[test]
fn model_base_needs_sft_and_excludes_init_config() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tiny_train_toml(tmp.path(), "aligned", 1);
    let with_base = text.replace("[model]\n", "[model]\nbase = \"somewhere\"\n");
    let err = TrainConfig::from_toml(&with_base, "x.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.base") && err.contains("model.init_config"),
        "{err}"
    );
    let sft_start = with_base.find("[sft]").unwrap();
    let sft_end = with_base.find("[rollout]").unwrap();
    let init_line = with_base
        .lines()
        .find(|l| l.starts_with("init_config"))
        .unwrap();
    let no_sft =
        format!("{}{}", &with_base[..sft_start], &with_base[sft_end..]).replace(init_line, "");
    let err = TrainConfig::from_toml(&no_sft, "x.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.base") && err.contains("[sft]"), "{err}");
}
