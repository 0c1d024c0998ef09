//! Reliability of the trainer: exact resume, a SIGKILL in the middle of a checkpoint write, determinism,
//! the non-finite guard, checkpoint retention, and `qarl runs` / `qarl config show`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use burn::tensor::Device;
use common::{metrics_without_timing, sigkill_when, tiny_train_toml};
use qarl::model::Decoder;
use qarl::train::{self, checkpoint, RunOptions, TrainConfig};

fn tiny(dir: &Path, steps: usize) -> TrainConfig {
    TrainConfig::from_toml(&tiny_train_toml(dir, "aligned", steps), "tiny").unwrap()
}

fn ckpt(run: &Path, step: usize) -> PathBuf {
    checkpoint::checkpoints_dir(run).join(format!("step_{step:06}"))
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Rows of one phase (`rl`, `eval`) of a metrics file, without timing keys.
fn rows(run: &Path, phases: &[&str]) -> Vec<serde_json::Value> {
    metrics_without_timing(&run.join("metrics.jsonl"))
        .into_iter()
        .filter(|r| phases.iter().any(|p| r["phase"] == *p))
        .collect()
}

/// Must-show: "4 steps" and "2 steps, stop (as if killed), --resume to 4" give bitwise identical weights,
/// optimizer state and metrics rows.
#[test]
fn resume_is_bitwise_identical_to_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let straight = tiny(tmp.path(), 4);
    train::run(&straight, false, true).unwrap();

    let mut split = straight.clone();
    split.run_dir = tmp.path().join("split");
    let s = train::run_with(
        &split,
        &RunOptions {
            quiet: true,
            stop_after_step: Some(1),
            ..RunOptions::default()
        },
    )
    .unwrap();
    assert!(s.accuracy_after.is_none());
    assert_eq!(checkpoint::latest(&split.run_dir).unwrap().1.step, 1);
    train::run(&split, true, true).unwrap();

    // The weights after the resumed steps depend on the restored Adam moments too (a resume that restarted
    // the optimizer fails here). optimizer.bpk itself is keyed by per-process parameter ids, so its bytes
    // are not compared.
    assert!(
        bytes(&ckpt(&straight.run_dir, 3).join("model.safetensors"))
            == bytes(&ckpt(&split.run_dir, 3).join("model.safetensors")),
        "weights differ after resume"
    );
    let (a, b) = (
        rows(&straight.run_dir, &["rl", "eval"]),
        rows(&split.run_dir, &["rl", "eval"]),
    );
    assert_eq!(a.len(), 4 + 2);
    assert_eq!(a, b, "metrics differ after resume");
    // The worst response of every step with error tokens, the same after the resume (the rows after the
    // checkpoint dropped and redone).
    let with_errors = a
        .iter()
        .filter(|r| r["phase"] == "rl" && r["error_tokens/any_frac"].as_f64().unwrap() > 0.0)
        .count();
    let examples = |run: &Path| {
        let path = run.join(train::metrics::WORST_RESPONSES_FILE);
        if path.exists() {
            metrics_without_timing(&path)
        } else {
            Vec::new()
        }
    };
    let (ea, eb) = (examples(&straight.run_dir), examples(&split.run_dir));
    println!("worst responses: {} of 4 steps had error tokens", ea.len());
    assert_eq!(ea.len(), with_errors);
    assert_eq!(ea, eb, "worst responses differ after resume");
    for e in &ea {
        let tokens = e["error_tokens"].as_array().unwrap();
        assert!(e["response"].is_string() && e["prompt"].is_string(), "{e}");
        assert!(e["error_token_frac"].as_f64().unwrap() > 0.0, "{e}");
        assert!(!tokens.is_empty(), "{e}");
        assert!(tokens
            .iter()
            .all(|t| !t["criteria"].as_array().unwrap().is_empty()));
    }
    println!(
        "resume exactness: 4 RL steps, weights and {} metric rows identical",
        a.len()
    );
}

/// Must-show: SIGKILL while a checkpoint is being written leaves the previous checkpoint loadable, and
/// `--resume` finishes the run with the same weights as an uninterrupted one.
#[test]
fn sigkill_during_checkpoint_write_keeps_the_previous_one() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tiny_train_toml(tmp.path(), "aligned", 3);
    let cfg = TrainConfig::from_toml(&text, "tiny").unwrap();
    // The model (SFT) once, in-process, so the child only runs RL.
    train::prepare_model(
        &cfg,
        &Device::flex().autodiff(),
        &mut train::metrics::MetricsLog::open(&tmp.path().join("sft.jsonl")).unwrap(),
        true,
    )
    .unwrap();
    let cfg_path = tmp.path().join("run.toml");
    std::fs::write(&cfg_path, &text).unwrap();
    let qarl = env!("CARGO_BIN_EXE_qarl");
    let mut child = Command::new(qarl)
        .args(["train", "--quiet", "--config"])
        .arg(&cfg_path)
        .env(checkpoint::TEST_PAUSE_ENV, "700")
        .current_dir(tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let root = checkpoint::checkpoints_dir(&cfg.run_dir);
    let writing_second = || {
        ckpt(&cfg.run_dir, 0).is_dir()
            && std::fs::read_dir(&root).unwrap().flatten().any(|e| {
                e.file_name().to_string_lossy().starts_with(".tmp-ckpt")
                    && e.path().join("model.safetensors").is_file()
            })
    };
    let waited = sigkill_when(
        &mut child,
        "the run",
        Duration::from_secs(120),
        Duration::from_millis(10),
        writing_second,
    );
    println!("killed the child during the checkpoint of step 1 after {waited:?}");

    // The half-written checkpoint is invisible; the previous one loads.
    let (p, state) = checkpoint::latest(&cfg.run_dir).unwrap();
    assert_eq!((p.clone(), state.step), (ckpt(&cfg.run_dir, 0), 0));
    Decoder::load(&p, &Device::flex()).unwrap();

    let out = Command::new(qarl)
        .args(["train", "--quiet", "--resume", "--config"])
        .arg(&cfg_path)
        .current_dir(tmp.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<u64> = rows(&cfg.run_dir, &["rl"])
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![0, 1, 2]);
    let leftovers: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Same weights as a run that was never killed.
    let mut straight = cfg.clone();
    straight.run_dir = tmp.path().join("straight");
    train::run(&straight, false, true).unwrap();
    assert!(
        bytes(&ckpt(&cfg.run_dir, 2).join("model.safetensors"))
            == bytes(&ckpt(&straight.run_dir, 2).join("model.safetensors")),
        "the killed and resumed run differs from the straight one"
    );
}

/// Must-show: the same config and seed twice (SFT from scratch included) give identical metrics and weights.
#[test]
fn same_config_and_seed_give_identical_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny(&tmp.path().join("a"), 2);
    let b = tiny(&tmp.path().join("b"), 2);
    train::run(&a, false, true).unwrap();
    train::run(&b, false, true).unwrap();
    let (ra, rb) = (
        rows(&a.run_dir, &["sft", "rl", "eval"]),
        rows(&b.run_dir, &["sft", "rl", "eval"]),
    );
    assert!(ra.len() >= 5);
    assert_eq!(ra, rb);
    assert!(
        bytes(&ckpt(&a.run_dir, 1).join("model.safetensors"))
            == bytes(&ckpt(&b.run_dir, 1).join("model.safetensors"))
    );
}

/// A NaN loss skips the update (weights and optimizer unchanged), is logged, and N in a row stop the run
/// with a message that says what happened and where the last good weights are.
#[test]
fn nonfinite_updates_are_skipped_logged_and_stop_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny(tmp.path(), 3);
    train::run_with(
        &cfg,
        &RunOptions {
            quiet: true,
            inject_nonfinite_steps: vec![1],
            ..RunOptions::default()
        },
    )
    .unwrap();
    for f in ["model.safetensors", "optimizer.bpk"] {
        assert!(
            bytes(&ckpt(&cfg.run_dir, 0).join(f)) == bytes(&ckpt(&cfg.run_dir, 1).join(f)),
            "{f}: a skipped update changed the state"
        );
        assert!(
            bytes(&ckpt(&cfg.run_dir, 1).join(f)) != bytes(&ckpt(&cfg.run_dir, 2).join(f)),
            "{f}: the next step did not update"
        );
    }
    let rl = rows(&cfg.run_dir, &["rl"]);
    let col = |k: &str| -> Vec<f64> { rl.iter().map(|r| r[k].as_f64().unwrap()).collect() };
    assert_eq!(col("train/nonfinite_updates"), vec![0.0, 1.0, 0.0]);
    assert_eq!(col("train/consecutive_nonfinite"), vec![0.0, 1.0, 0.0]);
    // The finite steps log their gradient (zero where no group's rewards differ), the skipped one none.
    let norms: Vec<f64> = [0, 2]
        .iter()
        .map(|&i| rl[i]["actor/grad_norm"].as_f64().unwrap())
        .collect();
    assert!(norms.iter().any(|&n| n > 0.0), "{norms:?}");
    assert!(rl[1].get("actor/grad_norm").is_none());

    // Every step non-finite: stop after `max_nonfinite_steps`.
    let mut stop = cfg.clone();
    stop.run_dir = tmp.path().join("stop");
    stop.train.steps = 5;
    stop.train.max_nonfinite_steps = 2;
    stop.eval.every = 2;
    let err = train::run_with(
        &stop,
        &RunOptions {
            quiet: true,
            inject_nonfinite_steps: (0..5).collect(),
            ..RunOptions::default()
        },
    )
    .unwrap_err();
    let msg = format!("{err:#}");
    println!("{msg}");
    assert!(
        msg.contains("2 consecutive RL steps") && msg.contains("max_nonfinite_steps"),
        "{msg}"
    );
    assert_eq!(checkpoint::latest(&stop.run_dir).unwrap().1.step, 1);
    assert_eq!(rows(&stop.run_dir, &["rl"]).len(), 2);
    // The evaluation due after the last step is made before the stop: a resume starts at the next step
    // and would never make it.
    let evals: Vec<u64> = rows(&stop.run_dir, &["eval"])
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, vec![0, 2]);
}

#[test]
fn retention_keeps_the_newest_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny(tmp.path(), 4);
    cfg.keep_checkpoints = 2;
    train::run(&cfg, false, true).unwrap();
    let steps: Vec<usize> = checkpoint::list(&cfg.run_dir)
        .iter()
        .map(|(_, s)| s.step)
        .collect();
    assert_eq!(steps, vec![2, 3]);
    // A resume with another seed is refused rather than silently continuing a different run.
    let mut other = cfg.clone();
    other.seed = 4;
    let err = format!("{:#}", train::run(&other, true, true).unwrap_err());
    assert!(err.contains("seed 3") && err.contains("seed 4"), "{err}");
    // A damaged newest checkpoint: the error names it and the previous one to resume from.
    std::fs::write(ckpt(&cfg.run_dir, 3).join("model.safetensors"), b"garbage").unwrap();
    let err = format!("{:#}", train::run(&cfg, true, true).unwrap_err());
    assert!(
        err.contains("step_000003") && err.contains("resume from step 2"),
        "{err}"
    );
    println!("damaged newest checkpoint: {err}");
}

/// A run directory with checkpoints is never started over by accident; `--resume` without a checkpoint
/// starts from step 0.
#[test]
fn a_fresh_run_refuses_to_overwrite_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny(tmp.path(), 1);
    train::run(&cfg, false, true).unwrap();
    let err = format!("{:#}", train::run(&cfg, false, true).unwrap_err());
    assert!(
        err.contains("--resume") && err.contains("--overwrite"),
        "{err}"
    );
    assert!(
        checkpoint::latest(&cfg.run_dir).is_some(),
        "the refusal lost a checkpoint"
    );
    let sft_rows = rows(&cfg.run_dir, &["sft"]).len();
    assert!(sft_rows > 0);
    // What the earlier run left beside its rows: an experiment's mark that it finished, its plots, a
    // config kept by an accepted change. Kept, they would describe it beside the new run's rows.
    let earlier = ["finished.json", "plots.png", "config.before_step_1.json"];
    for f in earlier {
        std::fs::write(cfg.run_dir.join(f), "{}").unwrap();
    }
    // A user's own file among the checkpoints is no checkpoint: it stays (the folder was deleted whole).
    let notes = checkpoint::checkpoints_dir(&cfg.run_dir).join("notes.txt");
    std::fs::write(&notes, "mine").unwrap();
    let old_checkpoint = checkpoint::latest(&cfg.run_dir).unwrap().0;
    std::fs::write(old_checkpoint.join("of_the_earlier_run"), "").unwrap();
    train::run_with(
        &cfg,
        &RunOptions {
            quiet: true,
            overwrite: true,
            ..RunOptions::default()
        },
    )
    .unwrap();
    for f in earlier {
        assert!(!cfg.run_dir.join(f).exists(), "--overwrite kept {f}");
    }
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "mine");
    assert!(
        !old_checkpoint.join("of_the_earlier_run").exists(),
        "--overwrite kept the earlier run's checkpoint"
    );
    assert_eq!(checkpoint::list(&cfg.run_dir).len(), 1);
    assert_eq!(rows(&cfg.run_dir, &["rl"]).len(), 1);
    // The model is kept and used again, and with it the rows of its warm start.
    assert_eq!(rows(&cfg.run_dir, &["sft"]).len(), sft_rows);
    // The same model spelt another way (`dir/.`): still its rows.
    let mut respelt = cfg.clone();
    respelt.model.dir = cfg.model.dir.join(".");
    let overwrite = RunOptions {
        quiet: true,
        overwrite: true,
        ..RunOptions::default()
    };
    train::run_with(&respelt, &overwrite).unwrap();
    assert_eq!(rows(&cfg.run_dir, &["sft"]).len(), sft_rows);
    // Another model (a copy made elsewhere) under the same run directory: the rows of the first model's
    // warm start are not this run's.
    let mut moved = cfg.clone();
    moved.model.dir = tmp.path().join("copied-model");
    std::fs::create_dir_all(&moved.model.dir).unwrap();
    for entry in std::fs::read_dir(&cfg.model.dir).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), moved.model.dir.join(entry.file_name())).unwrap();
        }
    }
    train::run_with(&moved, &overwrite).unwrap();
    assert_eq!(rows(&moved.run_dir, &["rl"]).len(), 1);
    assert_eq!(rows(&moved.run_dir, &["sft"]).len(), 0);
    let mut other = cfg.clone();
    other.run_dir = tmp.path().join("new");
    train::run(&other, true, true).unwrap();
    assert_eq!(rows(&other.run_dir, &["rl"]).len(), 1);
}

/// `--resume` continues the same experiment or nothing: another rollout precision, training forward or
/// objective is refused (the rows after the checkpoint would come from another run than those before),
/// while more steps are taken.
#[test]
fn a_resume_with_another_experiment_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny(tmp.path(), 1);
    train::run(&cfg, false, true).unwrap();
    let before = bytes(&cfg.run_dir.join("metrics.jsonl"));
    let mut other = cfg.clone();
    other.rollout.precision = "int8-pc".parse().unwrap();
    other.train.steps = 2;
    let err = format!("{:#}", train::run(&other, true, true).unwrap_err());
    assert!(
        err.contains("`rollout.precision`") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(bytes(&cfg.run_dir.join("metrics.jsonl")), before);
    // The learner's settings too (the learning rate went from 1e-4 to 1 mid-run, config.json rewritten):
    // every key that differs is named.
    let mut other = cfg.clone();
    other.train.lr = 1.0;
    other.train.activations = qarl::model::Activations::Bf16;
    other.train.steps = 2;
    let err = format!("{:#}", train::run(&other, true, true).unwrap_err());
    assert!(
        err.contains("`train.activations`, `train.lr` settings"),
        "{err}"
    );
    assert_eq!(bytes(&cfg.run_dir.join("metrics.jsonl")), before);
    // A model folder that is gone (or a new path): the resume would warm-start again for nothing.
    let mut moved = cfg.clone();
    moved.model.dir = tmp.path().join("gone");
    moved.train.steps = 2;
    let err = format!("{:#}", train::run(&moved, true, true).unwrap_err());
    assert!(
        err.contains("gone: holds no model") && err.contains("resumes from"),
        "{err}"
    );
    assert!(!moved.model.dir.exists());
    assert_eq!(bytes(&cfg.run_dir.join("metrics.jsonl")), before);
    // ... also where other settings were accepted: a refused resume keeps no earlier config.
    moved.train.lr = 5e-5;
    let accept = train::RunOptions {
        resume: true,
        quiet: true,
        accept_changes: true,
        ..train::RunOptions::default()
    };
    assert!(train::run_with(&moved, &accept).is_err());
    assert!(!cfg.run_dir.join("config.before_step_1.json").exists());
    // More steps stretch a cosine schedule over them: the learning rate would rise again mid-run.
    let mut cosine = cfg.clone();
    cosine.run_dir = tmp.path().join("cosine");
    cosine.train.lr_schedule = train::config::LrSchedule::Cosine;
    train::run(&cosine, false, true).unwrap();
    cosine.train.steps = 2;
    let err = format!("{:#}", train::run(&cosine, true, true).unwrap_err());
    assert!(
        err.contains("`train.steps (under the cosine schedule)` settings")
            && err.contains("`train.steps` (but not under the cosine schedule)"),
        "{err}"
    );
    // A run whose config.json is gone (a copied or edited run directory): nothing to check the resume
    // against, so it is refused rather than any settings passing.
    let config = cfg.run_dir.join("config.json");
    let kept_config = bytes(&config);
    std::fs::remove_file(&config).unwrap();
    let mut other = cfg.clone();
    other.train.lr = 1.0;
    other.train.steps = 2;
    let err = format!("{:#}", train::run(&other, true, true).unwrap_err());
    assert!(
        err.contains("config.json: missing, though the run has checkpoints")
            && err.contains("--accept-changes"),
        "{err}"
    );
    assert_eq!(bytes(&cfg.run_dir.join("metrics.jsonl")), before);
    std::fs::write(&config, kept_config).unwrap();
    let mut more = cfg.clone();
    more.train.steps = 2;
    train::run(&more, true, true).unwrap();
    assert_eq!(rows(&cfg.run_dir, &["rl"]).len(), 2);
    // Fewer steps than done: the final evaluation would have been logged again at step 1, a second
    // row there, labelling the weights after 2 steps as step 1's.
    let before = bytes(&cfg.run_dir.join("metrics.jsonl"));
    let err = format!("{:#}", train::run(&cfg, true, true).unwrap_err());
    assert!(
        err.contains("the run has done 2 RL steps, but `train.steps` = 1"),
        "{err}"
    );
    assert_eq!(bytes(&cfg.run_dir.join("metrics.jsonl")), before);
    // Asked for (a lower learning rate after a divergence): it goes on, and the earlier config stays
    // beside the new one.
    let mut lower = cfg.clone();
    lower.train.lr = 5e-5;
    lower.train.steps = 3;
    let earlier = std::fs::read_to_string(cfg.run_dir.join("config.json")).unwrap();
    train::run_with(
        &lower,
        &train::RunOptions {
            resume: true,
            quiet: true,
            accept_changes: true,
            ..train::RunOptions::default()
        },
    )
    .unwrap();
    assert_eq!(rows(&cfg.run_dir, &["rl"]).len(), 3);
    let kept = std::fs::read_to_string(cfg.run_dir.join("config.before_step_2.json")).unwrap();
    assert_eq!(kept, earlier);
    let now: train::TrainConfig = qarl::io::read_json(&cfg.run_dir.join("config.json")).unwrap();
    assert_eq!(now.train.lr, 5e-5);
    // A config.json this version does not read (a key removed since): said so, not compared key by key
    // (which listed keys that had not changed).
    let path = cfg.run_dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap().replacen(
        "\"train\":{",
        "\"train\":{\"old_knob\":1,",
        1,
    );
    std::fs::write(&path, text).unwrap();
    lower.train.steps = 4;
    let err = format!("{:#}", train::run(&lower, true, true).unwrap_err());
    assert!(
        err.contains("the run's config does not read as a config of this version")
            && err.contains("old_knob")
            && !err.contains("settings than this config's"),
        "{err}"
    );
}

/// An earlier run's results in a run directory without checkpoints (a run stopped before its first, or
/// one whose checkpoints were pruned away) are not deleted by a fresh run unless `--overwrite` says so;
/// and a data set that cannot be read stops the run before anything in its directory changes.
#[test]
fn a_fresh_run_keeps_an_earlier_runs_metrics_and_checks_its_data_first() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny(tmp.path(), 1);
    std::fs::create_dir_all(&cfg.run_dir).unwrap();
    let metrics = cfg.run_dir.join("metrics.jsonl");
    let earlier = "{\"phase\":\"sft\",\"step\":0}\n{\"phase\":\"rl\",\"step\":0}\n{\"phase\":\"eval\",\"step\":0}\n";
    std::fs::write(&metrics, earlier).unwrap();
    let err = format!("{:#}", train::run(&cfg, false, true).unwrap_err());
    assert!(
        err.contains("2 RL and evaluation rows") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&metrics).unwrap(), earlier);
    // A task whose data cannot be read: refused before the directory's files change.
    let mut bad_data = cfg.clone();
    bad_data.task = toml::from_str("kind = \"gsm8k\"\npath = \"no_such_data.jsonl\"").unwrap();
    let overwrite = RunOptions {
        quiet: true,
        overwrite: true,
        ..RunOptions::default()
    };
    let err = format!("{:#}", train::run_with(&bad_data, &overwrite).unwrap_err());
    assert!(err.contains("no_such_data.jsonl"), "{err}");
    assert_eq!(std::fs::read_to_string(&metrics).unwrap(), earlier);
    assert!(!cfg.run_dir.join("config.json").exists());
    // Asked for, the earlier rows go.
    train::run_with(
        &cfg,
        &RunOptions {
            quiet: true,
            overwrite: true,
            ..RunOptions::default()
        },
    )
    .unwrap();
    assert_eq!(rows(&cfg.run_dir, &["rl"]).len(), 1);
}

/// With `--overwrite`, bad model input is refused before anything in the run directory changes: a missing
/// `model.init_config`, a quantized checkpoint as `model.dir`, and held-out or first-step prompts that with
/// `eval.max_new_tokens` / `rollout.max_new_tokens` pass the model's positions (the one-token bound fits,
/// the real prompts do not).
/// The earlier run's checkpoints, metrics and config stay, and no staging folder is left behind.
#[test]
fn an_overwrite_with_bad_model_input_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny(tmp.path(), 1);
    train::run(&cfg, false, true).unwrap();
    let (metrics, config) = (
        bytes(&cfg.run_dir.join("metrics.jsonl")),
        bytes(&cfg.run_dir.join("config.json")),
    );
    let quantized = tmp.path().join("quantized");
    let scheme = "int4-g32".parse().unwrap();
    qarl::model::quantize::quantize_checkpoint(
        &cfg.model.dir,
        &quantized,
        &qarl::quant::QuantConfig::new(scheme),
    )
    .unwrap();
    let overwrite = RunOptions {
        quiet: true,
        overwrite: true,
        ..RunOptions::default()
    };
    let mut no_init = cfg.clone();
    no_init.model.dir = tmp.path().join("new-model");
    no_init.model.init_config = Some(tmp.path().join("no_such_config.json"));
    let mut from_quantized = cfg.clone();
    from_quantized.model.dir = quantized;
    let mut long_eval = cfg.clone();
    long_eval.eval.max_new_tokens = 255;
    let mut long_rollout = cfg.clone();
    long_rollout.rollout.max_new_tokens = 255;
    for (bad, expect) in [
        (&no_init, "`model.init_config`"),
        (&from_quantized, "quantized"),
        (&long_eval, "eval.max_new_tokens"),
        (&long_rollout, "rollout.max_new_tokens: a prompt of"),
    ] {
        let err = format!("{:#}", train::run_with(bad, &overwrite).unwrap_err());
        assert!(err.contains(expect), "{err}");
        assert!(
            checkpoint::latest(&cfg.run_dir).is_some(),
            "{expect}: checkpoint lost"
        );
        assert_eq!(
            bytes(&cfg.run_dir.join("metrics.jsonl")),
            metrics,
            "{expect}"
        );
        assert_eq!(bytes(&cfg.run_dir.join("config.json")), config, "{expect}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("qarl-init"))
        .collect();
    assert!(leftovers.is_empty(), "staging folders left: {leftovers:?}");
}

/// Bad configs: every error names the file, the key path and the reason (printed as the table of the
/// closing note with `--nocapture`).
#[test]
fn bad_configs_are_named_with_their_key_path() {
    let good = train::config::DEFAULT_CONFIG;
    let edit = |from: &str, to: &str| {
        assert!(good.contains(from), "{from}");
        good.replacen(from, to, 1)
    };
    let cases: Vec<(&str, String, &[&str])> =
        vec![
        (
            "misspelt key",
            edit("samples_per_prompt = 8", "sample_per_prompt = 8"),
            &[
                "line",
                "`rollout.sample_per_prompt`",
                "did you mean `rollout.samples_per_prompt`",
            ],
        ),
        (
            "misspelt section",
            edit("[rollout]", "[rolout]"),
            &["unknown key `rolout`", "did you mean `rollout`"],
        ),
        (
            "misspelt value",
            edit("forward = \"aligned\"", "forward = \"alinged\""),
            &["`train.forward` = \"alinged\"", "did you mean \"aligned\""],
        ),
        (
            "unknown precision",
            edit("precision = \"int4-g32\"", "precision = \"int3\""),
            &["`rollout.precision`", "int3"],
        ),
        (
            "wrong type",
            edit("steps = 80", "steps = \"eighty\""),
            &["`train.steps`", "invalid type"],
        ),
        (
            "negative count",
            edit("steps = 80", "steps = -1"),
            &["`train.steps`"],
        ),
        (
            "missing key",
            edit("max_new_tokens = 40\n\n[train]", "\n[train]"),
            &["missing key `rollout.max_new_tokens`"],
        ),
        (
            "out of range",
            edit("temperature = 1.0", "temperature = 1.0\ntop_p = 1.5"),
            &["`rollout.top_p` = 1.5", "(0, 1]"],
        ),
        (
            "zero that used to panic (division)",
            edit("warmup_steps = 20", "warmup_steps = 20\nlog_every = 0"),
            &["`sft.log_every` = 0", ">= 1"],
        ),
        (
            "NaN learning rate",
            edit("lr = 3e-5", "lr = nan"),
            &["`train.lr` = NaN"],
        ),
        (
            "a weight decay too small for f32 (was stored as 0)",
            edit("lr = 3e-5", "lr = 3e-5\nweight_decay = 1e-300"),
            &["`train.weight_decay` = 1e-300", "it would be 0"],
        ),
        (
            "a correction's cap too large for f32 (was stored as inf)",
            edit(
                "objective = \"tbpo\"",
                "objective = \"tbpo\"\ncorrections = [{ kind = \"token_tis\", cap = 1e300 }]",
            ),
            &["`train.loss.corrections[0].cap` = 1e300", "it would be inf"],
        ),
        ("TOML syntax", edit("[eval]", "[eval"), &["line"]),
        (
            "run files over the model's own",
            edit(
                "run_dir = \"runs/default\"",
                "run_dir = \"runs/default/./model-sft\"",
            ),
            &["`run_dir`", "is `model.dir`", "overwrite the model's files"],
        ),
        (
            "a model inside the run's checkpoints (--overwrite deleted it)",
            edit(
                "run_dir = \"runs/default\"",
                "run_dir = \"runs/x/../default\"",
            )
            .replace(
                "dir = \"runs/default/model-sft\"",
                "dir = \"runs/default/checkpoints/step_000001\"",
            ),
            &["`model.dir`", "inside the run's checkpoints"],
        ),
        (
            "run files over the warm start's base (its config.json was replaced)",
            edit(
                "init_config = \"configs/models/qwen3-moe-arith.json\"",
                "base = \"runs/base\"",
            )
            .replace("run_dir = \"runs/default\"", "run_dir = \"runs/./base\""),
            &["`model.base` = \"runs/base\" is `run_dir`", "overwrite its files"],
        ),
        (
            "a model config where the run writes its own config.json",
            edit(
                "init_config = \"configs/models/qwen3-moe-arith.json\"",
                "init_config = \"runs/default/config.json\"",
            ),
            &["`model.init_config`", "a file the run writes in `run_dir`"],
        ),
        (
            "a data set inside the run's checkpoints (--overwrite deleted it)",
            edit(
                "kind = \"arithmetic\"\nmin_digits = 1\nmax_digits = 1\nops = [\"add\", \"sub\"]\n\
                 min_terms = 3\nmax_terms = 4",
                "kind = \"gsm8k\"\npath = \"runs/default/checkpoints/data.jsonl\"",
            ),
            &["`task.path`", "inside the run's checkpoints"],
        ),
        (
            "a warm start from model.dir into itself (it never ran)",
            edit(
                "init_config = \"configs/models/qwen3-moe-arith.json\"",
                "base = \"runs/default/./model-sft\"",
            ),
            &["`model.base`", "is `model.dir`", "would never run"],
        ),
        (
            "run files into the working directory",
            edit("run_dir = \"runs/default\"", "run_dir = \"\""),
            &["`run_dir` = \"\"", "must name a directory"],
        ),
        (
            "a repetition pattern too long to search (used to hang)",
            edit(
                "min_span = 12",
                "min_span = 12\nmax_pattern = 1000000000000",
            ),
            &["`train.error_tokens.max_pattern`", "1 to 64"],
        ),
        (
            "no RL step (a before/after of nothing)",
            edit("steps = 80", "steps = 0"),
            &["`train.steps` = 0", ">= 1"],
        ),
        (
            "a pattern seen once (every token counted as a loop)",
            edit("min_span = 12", "min_span = 12\nmin_repeats = 0"),
            &["`train.error_tokens.min_repeats` = 0", ">= 2"],
        ),
    ];
    println!("| bad input | error the user sees |");
    for (what, text, want) in cases {
        let err = format!(
            "{:#}",
            TrainConfig::from_toml(&text, "my.toml").unwrap_err()
        );
        let first = err.lines().next().unwrap();
        println!("| {what} | {first} |");
        assert!(err.starts_with("my.toml"), "{err}");
        for w in want {
            assert!(err.contains(w), "{what}: expected `{w}` in: {err}");
        }
    }
    let err = format!(
        "{:#}",
        train::load_config(None, &["train.lrr=1e-4".into()]).unwrap_err()
    );
    println!("| --set train.lrr=1e-4 | {err} |");
    assert!(err.contains("did you mean `train.lr`"), "{err}");
}

/// SFT with an absurd learning rate: the non-finite steps are skipped and the run stops with a message.
#[test]
fn sft_stops_on_repeated_nonfinite_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny(tmp.path(), 1);
    let sft = cfg.sft.as_mut().unwrap();
    sft.lr = 1e30;
    sft.steps = 12;
    sft.log_every = 1;
    cfg.train.max_nonfinite_steps = 2;
    let err = format!("{:#}", train::run(&cfg, false, true).unwrap_err());
    println!("{err}");
    assert!(
        err.contains("stopping SFT") && err.contains("sft.lr"),
        "{err}"
    );
    assert!(
        !cfg.model.dir.exists(),
        "a broken model was moved into place"
    );
    let rows = rows(&cfg.run_dir, &["sft"]);
    assert!(rows.iter().any(|r| r["sft/nonfinite"] == 1), "{rows:?}");
}

/// `--resume` before the first RL checkpoint keeps the warm start's metrics rows (the warm start is not
/// redone) and redoes RL from step 0; it used to delete the whole metrics file.
#[test]
fn resume_before_the_first_checkpoint_keeps_the_sft_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny(tmp.path(), 2);
    cfg.checkpoint_every = 100;
    train::run_with(
        &cfg,
        &RunOptions {
            quiet: true,
            stop_after_step: Some(0),
            ..RunOptions::default()
        },
    )
    .unwrap();
    assert!(
        checkpoint::latest(&cfg.run_dir).is_none(),
        "no checkpoint yet"
    );
    let sft_before = rows(&cfg.run_dir, &["sft"]);
    assert!(!sft_before.is_empty());
    train::run(&cfg, true, true).unwrap();
    assert_eq!(
        rows(&cfg.run_dir, &["sft"]),
        sft_before,
        "SFT rows lost or changed"
    );
    let rl_steps: Vec<u64> = rows(&cfg.run_dir, &["rl"])
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        rl_steps,
        vec![0, 1],
        "RL redone from step 0, each step once"
    );
}

/// Must-show (issue 24): a SIGKILL of `qarl train` after its first RL rows but before its first RL checkpoint,
/// then `qarl train --resume` with the same config, loses no metrics row: every row logged before the kill
/// (the warm start's and the first RL steps') is in the final file, unchanged and in its place (RL is redone
/// from step 0 and writes the same rows again), no step is logged twice, and the final metrics are those of
/// a run that was never killed.
#[test]
fn sigkill_before_the_first_rl_checkpoint_loses_no_metrics_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("killed");
    std::fs::create_dir_all(&dir).unwrap();
    let steps = 6;
    let text = tiny_train_toml(&dir, "aligned", steps)
        .replace("checkpoint_every = 1\n", "checkpoint_every = 1000\n");
    std::fs::write(dir.join("run.toml"), &text).unwrap();
    let cfg = TrainConfig::from_toml(&text, "tiny").unwrap();
    assert_eq!(cfg.checkpoint_every, 1000);
    let metrics = cfg.run_dir.join("metrics.jsonl");
    // The complete rows of the metrics file (a row a kill cut short is not one), without timing keys.
    let complete_rows = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&metrics)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|mut v| {
                v.as_object_mut()
                    .unwrap()
                    .retain(|k, _| !k.starts_with("perf/"));
                v
            })
            .collect()
    };
    let qarl = env!("CARGO_BIN_EXE_qarl");

    let mut child = Command::new(qarl)
        .args(["train", "--quiet", "--config", "run.toml"])
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let waited = sigkill_when(
        &mut child,
        "the run",
        Duration::from_secs(600),
        Duration::from_millis(10),
        || complete_rows().iter().any(|r| r["phase"] == "rl"),
    );
    let before = complete_rows();
    let rl_before = before.iter().filter(|r| r["phase"] == "rl").count();
    println!(
        "killed after {waited:?}: {} rows logged ({} SFT, {rl_before} RL)",
        before.len(),
        before.iter().filter(|r| r["phase"] == "sft").count()
    );
    assert!(
        checkpoint::latest(&cfg.run_dir).is_none(),
        "an RL checkpoint was written before the kill"
    );
    assert!(before.iter().any(|r| r["phase"] == "sft"));
    assert!(
        rl_before < steps,
        "the run finished its RL steps before the kill"
    );

    let out = Command::new(qarl)
        .args(["train", "--quiet", "--resume", "--config", "run.toml"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = metrics_without_timing(&metrics);
    assert!(after.len() > before.len(), "{} rows", after.len());
    for (i, row) in before.iter().enumerate() {
        assert_eq!(
            &after[i],
            row,
            "metrics.jsonl row {} logged before the kill was lost or changed by the resume",
            i + 1
        );
    }
    for phase in ["sft", "rl", "eval"] {
        let steps_logged: Vec<u64> = after
            .iter()
            .filter(|r| r["phase"] == phase)
            .map(|r| r["step"].as_u64().unwrap())
            .collect();
        assert!(
            steps_logged.windows(2).all(|w| w[0] < w[1]),
            "{phase} steps logged twice or out of order: {steps_logged:?}"
        );
    }
    let rl_steps: Vec<u64> = after
        .iter()
        .filter(|r| r["phase"] == "rl")
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(rl_steps, (0..steps as u64).collect::<Vec<_>>());

    // The same rows, bit for bit, as a run that was never killed.
    let mut straight = cfg.clone();
    straight.run_dir = tmp.path().join("straight/run");
    straight.model.dir = tmp.path().join("straight/model");
    train::run(&straight, false, true).unwrap();
    assert_eq!(
        after,
        metrics_without_timing(&straight.run_dir.join("metrics.jsonl")),
        "the killed and resumed run's metrics differ from an uninterrupted run's"
    );
}

/// Two runs sharing a `model.dir` not made yet: while one warm-starts it, the other is refused instead of
/// removing the first one's staging folder; once it is made, the model is used, and no guard is left.
#[test]
fn one_run_at_a_time_makes_a_shared_model() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny(tmp.path(), 1);
    assert!(!cfg.model.dir.exists());
    let guard = cfg.model.dir.with_file_name(format!(
        "{}.qarl-init.lock",
        cfg.model.dir.file_name().unwrap().to_string_lossy()
    ));
    // The other run (this process holding the guard stands for it).
    let other = qarl::train::lock::RunLock::acquire(&guard).unwrap();
    let err = format!("{:#}", train::run(&cfg, false, true).unwrap_err());
    assert!(
        err.contains("another run is making this model") && err.contains("in use"),
        "{err}"
    );
    assert!(!cfg.model.dir.exists());
    drop(other);
    train::run(&cfg, false, true).unwrap();
    assert!(cfg.model.dir.join("config.json").is_file());
    assert!(!guard.exists(), "{} was left", guard.display());
}

/// The project's prose (README.md, docs/*.md, the committed results' Markdown) holds no control character
/// but newlines and tabs: a backslash escape written through a string (`\b`, `\f`) turned docs/verl.md's
/// `\boxed` and `\frac` into a backspace and a form feed, and the MATH rows read `oxed{rac{6}{8}}`.
#[test]
fn documents_hold_no_control_characters() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let markdown_in = |dir: &Path, files: &mut Vec<std::path::PathBuf>| {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "md") {
                files.push(e.path());
            }
        }
    };
    markdown_in(&root.join("docs"), &mut files);
    for study in std::fs::read_dir(root.join("experiments/results"))
        .unwrap()
        .flatten()
    {
        if study.path().is_dir() {
            markdown_in(&study.path(), &mut files);
        }
    }
    assert!(files.len() > 10, "{files:?}");
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let bad: Vec<u32> = line
                .chars()
                .filter(|&c| c.is_control() && c != '\t')
                .map(u32::from)
                .collect();
            assert!(
                bad.is_empty(),
                "{}:{}: control characters {bad:?}",
                file.display(),
                n + 1
            );
        }
    }
}

/// Every key a run writes to metrics.jsonl is documented in docs/metrics.md (the names in backticks;
/// `{p}`, `{k}` stand for one path segment or part of one, and `/max` after `response_length/mean` for
/// `response_length/max`): a new metric cannot land without its documentation. The tiny run's rows cover
/// the warm start, RL steps with timing and evaluations in two precisions.
#[test]
fn every_metric_a_run_writes_is_documented() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md"))
            .unwrap();
    let patterns = documented_names(&doc);
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny(tmp.path(), 2);
    train::run(&cfg, false, true).unwrap();
    let text = std::fs::read_to_string(cfg.run_dir.join("metrics.jsonl")).unwrap();
    let mut undocumented = std::collections::BTreeSet::new();
    let mut seen = 0;
    for line in text.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        for key in row.as_object().unwrap().keys() {
            seen += 1;
            if key != "phase" && key != "step" && !patterns.iter().any(|p| glob(p, key)) {
                undocumented.insert(key.clone());
            }
        }
    }
    assert!(seen > 50, "the run wrote only {seen} keys");
    assert!(
        undocumented.is_empty(),
        "not in docs/metrics.md: {undocumented:?}"
    );
    // The matcher can fail: a made-up key matches nothing.
    assert!(!patterns.iter().any(|p| glob(p, "actor/made_up")));
}

/// The metric names of docs/metrics.md: every backticked word with a `/`, placeholders (`{p}`) as `*`,
/// and a name starting with `/` completed with the previous name's prefix.
fn documented_names(doc: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut prefix = String::new();
    for (i, part) in doc.split('`').enumerate() {
        // `actor/*` in the text names a family, not a metric.
        if i % 2 == 0
            || part.contains(char::is_whitespace)
            || part.contains('*')
            || !part.contains('/')
        {
            continue;
        }
        let name = match part.strip_prefix('/') {
            Some(rest) => format!("{prefix}{rest}"),
            None => part.to_string(),
        };
        prefix = name[..=name.rfind('/').unwrap()].to_string();
        let mut glob = String::new();
        let mut depth = 0;
        for c in name.chars() {
            match c {
                '{' => {
                    depth += 1;
                    glob.push('*');
                }
                '}' => depth -= 1,
                _ if depth == 0 => glob.push(c),
                _ => {}
            }
        }
        names.push(glob);
    }
    names
}

/// Whether `text` matches `pattern`, where `*` stands for any characters but `/`.
fn glob(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((head, tail)) => {
            let Some(rest) = text.strip_prefix(head) else {
                return false;
            };
            (0..=rest.len())
                .take_while(|&n| !rest[..n].contains('/'))
                .filter(|&n| rest.is_char_boundary(n))
                .any(|n| glob(tail, &rest[n..]))
        }
    }
}

/// Plots drawn while a run goes (`qarl plot` on it mid-run) show fewer steps than the run has when it ends:
/// the run removes them as it ends, so an experiment's report draws the whole run instead of linking the
/// partial plot it found (it draws only missing plots).
#[test]
fn plots_drawn_mid_run_are_removed_when_it_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny(tmp.path(), 40);
    let run_dir = cfg.run_dir.clone();
    let running = std::thread::spawn(move || train::run(&cfg, false, true).map(|_| ()));
    let metrics = run_dir.join("metrics.jsonl");
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&metrics).is_ok_and(|t| t.contains("\"phase\":\"rl\"")) {
        assert!(started.elapsed().as_secs() < 600, "no RL step logged");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let plots = train::plot::run_plots(&run_dir);
    std::fs::write(&plots, b"drawn at step 1").unwrap();
    assert!(
        !running.is_finished(),
        "the run ended before the plot was drawn: give it more steps"
    );
    running.join().unwrap().unwrap();
    assert!(!plots.exists(), "a mid-run plot outlived the run");
}
