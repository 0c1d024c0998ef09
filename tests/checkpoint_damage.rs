//! Damaged checkpoints give an error naming the file and what is wrong, never a silent fall-back to an older
//! checkpoint; pruning never leaves a partial directory under a checkpoint's name, even when killed.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{sigkill_when, tiny_train_toml};
use qarl::train::{self, checkpoint, TrainConfig};

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        let to = dst.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

fn ckpt(run: &Path, step: usize) -> PathBuf {
    checkpoint::checkpoints_dir(run).join(format!("step_{step:06}"))
}

/// A copy of the finished run `base` in which `damage` changes the checkpoint of step 1; the error of
/// `--resume` there.
fn resume_error(base: &TrainConfig, name: &str, damage: impl Fn(&Path)) -> String {
    let mut cfg = base.clone();
    cfg.run_dir = base.run_dir.with_file_name(name);
    copy_dir(&base.run_dir, &cfg.run_dir);
    damage(&ckpt(&cfg.run_dir, 1));
    let files = ["config.json", "metrics.jsonl", "worst_responses.jsonl"];
    let read = |f: &str| std::fs::read(cfg.run_dir.join(f)).ok();
    let before: Vec<_> = files.iter().map(|f| read(f)).collect();
    let err = format!("{:#}", train::run(&cfg, true, true).unwrap_err());
    println!("{name}: {err}");
    // A refused resume leaves the run as it was: its config and its rows (the final evaluation of a
    // finished run among them), for a resume from the older checkpoint.
    for (f, was) in files.iter().zip(before) {
        assert!(read(f) == was, "{name}: the refused resume changed {f}");
    }
    err
}

/// Rewrites checkpoint `d`'s optimizer state through `edit` (its tensors and scalars) and removes its
/// manifest, as in a checkpoint written before manifests: only the fit check is left to catch the edit.
fn edit_pre_manifest_optimizer(
    d: &Path,
    edit: impl Fn(&mut Vec<burn_pack::Tensor>, &mut BTreeMap<String, burn_pack::Scalar>),
) {
    std::fs::remove_file(d.join(checkpoint::MANIFEST_FILE)).unwrap();
    let p = d.join("optimizer.bpk");
    let pack = burn_pack::Reader::from_file_exact(&p).unwrap();
    let mut scalars = pack.scalars().clone();
    let metadata = pack.metadata().clone();
    let mut tensors = pack.into_tensors().unwrap();
    edit(&mut tensors, &mut scalars);
    let mut writer = burn_pack::Writer::new(tensors);
    for (k, v) in &scalars {
        writer = writer.with_scalar(k, *v);
    }
    for (k, v) in &metadata {
        writer = writer.with_metadata(k, v);
    }
    let edited = d.join("optimizer.edited");
    writer.write_to_file(&edited).unwrap();
    std::fs::rename(&edited, &p).unwrap();
}

#[test]
fn damaged_newest_checkpoints_are_named_not_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(&tiny_train_toml(tmp.path(), "aligned", 2), "tiny").unwrap();
    train::run(&cfg, false, true).unwrap();
    assert_eq!(checkpoint::latest(&cfg.run_dir).unwrap().1.step, 1);

    let err = resume_error(&cfg, "garbage_state", |d| {
        std::fs::write(d.join("trainer_state.json"), "{not json").unwrap()
    });
    assert!(
        err.contains("step_000001/trainer_state.json")
            && err.contains("cannot be read")
            && err.contains("resume from step 0"),
        "{err}"
    );
    let err = resume_error(&cfg, "no_state", |d| {
        std::fs::remove_file(d.join("trainer_state.json")).unwrap()
    });
    assert!(err.contains("trainer_state.json: is missing"), "{err}");

    let err = resume_error(&cfg, "no_optimizer", |d| {
        std::fs::remove_file(d.join("optimizer.bpk")).unwrap()
    });
    assert!(err.contains("step_000001/optimizer.bpk: missing"), "{err}");
    // A log behind its checkpoint (deleted, or rows a power loss kept from the disk).
    let err = resume_error(&cfg, "no_log", |d| {
        let run = d.parent().unwrap().parent().unwrap();
        std::fs::remove_file(run.join("metrics.jsonl")).unwrap()
    });
    assert!(
        err.contains("metrics.jsonl: has no RL row for step 0") && err.contains("step_000001"),
        "{err}"
    );
    // Without the parameter ids the Adam moments would silently restart.
    let err = resume_error(&cfg, "no_param_ids", |d| {
        std::fs::remove_file(d.join(checkpoint::PARAM_IDS_FILE)).unwrap()
    });
    assert!(
        err.contains("step_000001/param_ids.json: missing") && err.contains("older checkpoint"),
        "{err}"
    );
    let err = resume_error(&cfg, "short_optimizer", |d| {
        let p = d.join("optimizer.bpk");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    });
    assert!(
        err.contains("step_000001/optimizer.bpk: truncated") && !err.contains("Io("),
        "{err}"
    );
    let err = resume_error(&cfg, "bad_optimizer", |d| {
        std::fs::write(d.join("optimizer.bpk"), vec![7u8; 4096]).unwrap()
    });
    assert!(
        err.contains("step_000001/optimizer.bpk:") && !err.contains("Io("),
        "{err}"
    );

    // A state whose step is not its folder's: resumed, it redid steps on the newest weights.
    let err = resume_error(&cfg, "edited_step", |d| {
        let p = d.join("trainer_state.json");
        let mut state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        state["step"] = 0.into();
        std::fs::write(&p, state.to_string()).unwrap();
    });
    assert!(err.contains("says step 0, not its folder's"), "{err}");
    // Parameter ids or an optimizer state that are not the checkpoint's own: the moments were restarted
    // or put on other parameters without a word (or a panic at the first step).
    let ids_of = |d: &Path| -> Vec<u64> {
        serde_json::from_str(&std::fs::read_to_string(d.join(checkpoint::PARAM_IDS_FILE)).unwrap())
            .unwrap()
    };
    let write_ids = |d: &Path, ids: &[u64]| {
        std::fs::write(
            d.join(checkpoint::PARAM_IDS_FILE),
            serde_json::to_string(ids).unwrap(),
        )
        .unwrap()
    };
    let err = resume_error(&cfg, "reversed_ids", |d| {
        let mut ids = ids_of(d);
        ids.reverse();
        write_ids(d, &ids);
    });
    assert!(
        err.contains("param_ids.json is not the file this checkpoint was written with"),
        "{err}"
    );
    let err = resume_error(&cfg, "doubled_id", |d| {
        let mut ids = ids_of(d);
        ids[1] = ids[0];
        write_ids(d, &ids);
    });
    assert!(err.contains("twice"), "{err}");
    let err = resume_error(&cfg, "foreign_optimizer", |d| {
        let step0 = d.with_file_name("step_000000");
        std::fs::copy(step0.join("optimizer.bpk"), d.join("optimizer.bpk")).unwrap();
    });
    assert!(
        err.contains("optimizer.bpk is not the file this checkpoint was written with"),
        "{err}"
    );
    // An edited model config: the resumed model took it and passed it on to every later checkpoint.
    let err = resume_error(&cfg, "edited_config", |d| {
        let p = d.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        config["rope_theta"] = 500.0.into();
        std::fs::write(&p, config.to_string()).unwrap();
    });
    assert!(
        err.contains("config.json is not the file this checkpoint was written with")
            && err.contains("another config"),
        "{err}"
    );
    // A manifest written before it vouched for config.json still vouches for the rest.
    let err = resume_error(&cfg, "older_manifest", |d| {
        let p = d.join(checkpoint::MANIFEST_FILE);
        let mut manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        manifest.as_object_mut().unwrap().remove("config.json");
        std::fs::write(&p, manifest.to_string()).unwrap();
        let step0 = d.with_file_name("step_000000");
        std::fs::copy(step0.join("optimizer.bpk"), d.join("optimizer.bpk")).unwrap();
    });
    assert!(
        err.contains("optimizer.bpk is not the file this checkpoint was written with"),
        "{err}"
    );

    // Counters no run writes: the non-finite count overflowed at the next non-finite step (a panic), a NaN
    // gradient-norm average turned spike detection off for good.
    let edit_state = |d: &Path, key: &str, value: serde_json::Value| {
        let p = d.join("trainer_state.json");
        let mut state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        state[key] = value;
        std::fs::write(&p, state.to_string()).unwrap();
    };
    let err = resume_error(&cfg, "nonfinite_count", |d| {
        edit_state(d, "consecutive_nonfinite", u64::MAX.into())
    });
    assert!(
        err.contains(
            "trainer_state.json: says 18446744073709551615 non-finite steps in a row after 2 steps"
        ),
        "{err}"
    );
    let err = resume_error(&cfg, "nan_average", |d| {
        edit_state(d, "grad_norm_ema_bits", f64::NAN.to_bits().into())
    });
    assert!(
        err.contains("has a gradient-norm average of NaN (grad_norm_ema_bits)"),
        "{err}"
    );

    // The run's config with a key given twice: read as its last value, it was named as a changed setting.
    let err = resume_error(&cfg, "repeated_key", |d| {
        let p = d.parent().unwrap().parent().unwrap().join("config.json");
        let text = std::fs::read_to_string(&p).unwrap();
        let seed = format!("\"seed\":{},", cfg.seed);
        std::fs::write(&p, text.replacen('{', &format!("{{{seed}"), 1)).unwrap();
    });
    assert!(err.contains("config.json: `seed` is given twice"), "{err}");

    // Checkpoints gone where the log shows they were written (moved away, or behind a link to a disk
    // that is not mounted): a resume started RL over and dropped the finished run's rows.
    let err = resume_error(&cfg, "checkpoints_moved", |d| {
        std::fs::remove_dir_all(d.parent().unwrap()).unwrap()
    });
    assert!(
        err.contains(
            "metrics.jsonl: the log reaches RL step 1, past the checkpoint written after step 0"
        ) && err.contains("holds no checkpoint: they were moved or deleted"),
        "{err}"
    );
    #[cfg(unix)]
    {
        let err = resume_error(&cfg, "checkpoints_unmounted", |d| {
            let root = d.parent().unwrap();
            std::fs::remove_dir_all(root).unwrap();
            std::os::unix::fs::symlink("/nonexistent/qarl-disk/checkpoints", root).unwrap();
        });
        assert!(
            err.contains("checkpoints: cannot be listed") && err.contains("disk"),
            "{err}"
        );
    }

    // Checkpoints written before the manifest: an optimizer state that does not fit the model panicked
    // burn (at the load or the first update) or restarted moments without a word.
    let err = resume_error(&cfg, "moment_shape", |d| {
        edit_pre_manifest_optimizer(d, |tensors, _| {
            let t = tensors
                .iter_mut()
                .find(|t| t.shape.num_dims() == 2 && t.shape[0] != t.shape[1])
                .unwrap();
            t.shape.as_mut_slice().reverse();
        })
    });
    assert!(
        err.contains("step_000001/optimizer.bpk: tensor `") && err.contains("has shape"),
        "{err}"
    );
    let err = resume_error(&cfg, "moment_rank", |d| {
        edit_pre_manifest_optimizer(d, |_, scalars| {
            let key = scalars
                .keys()
                .find(|k| k.ends_with(".__rank"))
                .unwrap()
                .clone();
            scalars.insert(key, burn_pack::Scalar::UInt(3));
        })
    });
    assert!(err.contains("gives rank UInt(3)"), "{err}");
    let err = resume_error(&cfg, "foreign_id", |d| {
        edit_pre_manifest_optimizer(d, |tensors, scalars| {
            let id = tensors[0].param_id.unwrap();
            let rename = |name: &str| name.replacen(&format!("{id}."), "7.", 1);
            for t in tensors.iter_mut().filter(|t| t.param_id == Some(id)) {
                t.param_id = Some(7);
                t.name = rename(&t.name);
            }
            let moved: Vec<String> = scalars
                .keys()
                .filter(|k| k.starts_with(&format!("{id}.")))
                .cloned()
                .collect();
            for k in moved {
                let v = scalars.remove(&k).unwrap();
                scalars.insert(rename(&k), v);
            }
        })
    });
    assert!(
        err.contains("belongs to parameter id 7, which the model does not have"),
        "{err}"
    );
    let err = resume_error(&cfg, "missing_moment", |d| {
        edit_pre_manifest_optimizer(d, |tensors, _| {
            tensors.remove(0);
        })
    });
    assert!(err.contains("has state"), "{err}");
    let err = resume_error(&cfg, "anonymous_moment", |d| {
        edit_pre_manifest_optimizer(d, |tensors, _| tensors[0].param_id = None)
    });
    assert!(err.contains("carries no parameter id"), "{err}");

    // A fresh run there is refused naming the damage; --overwrite starts over without reading it.
    let mut damaged = cfg.clone();
    damaged.run_dir = cfg.run_dir.with_file_name("garbage_state");
    let err = format!("{:#}", train::run(&damaged, false, true).unwrap_err());
    assert!(err.contains("trainer_state.json"), "{err}");
    train::run_with(
        &damaged,
        &train::RunOptions {
            quiet: true,
            overwrite: true,
            ..train::RunOptions::default()
        },
    )
    .unwrap();
    assert_eq!(
        checkpoint::latest_checked(&damaged.run_dir)
            .unwrap()
            .unwrap()
            .1
            .step,
        1
    );
}

/// SIGKILL while pruning removes an old checkpoint: every directory named like a checkpoint is still complete,
/// and `--resume` finishes the run.
#[test]
fn a_kill_during_pruning_leaves_only_complete_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tiny_train_toml(tmp.path(), "aligned", 4)
        .replace("keep_checkpoints = 0", "keep_checkpoints = 1");
    let cfg = TrainConfig::from_toml(&text, "tiny").unwrap();
    let cfg_path = tmp.path().join("run.toml");
    std::fs::write(&cfg_path, &text).unwrap();
    let qarl = env!("CARGO_BIN_EXE_qarl");
    let mut child = Command::new(qarl)
        .args(["train", "--quiet", "--config"])
        .arg(&cfg_path)
        .env(checkpoint::TEST_PAUSE_ENV, "500")
        .current_dir(tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let root = checkpoint::checkpoints_dir(&cfg.run_dir);
    let pruning = || {
        std::fs::read_dir(&root).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(".pruned-step_"))
        })
    };
    sigkill_when(
        &mut child,
        "the run",
        Duration::from_secs(180),
        Duration::from_millis(5),
        pruning,
    );
    for e in std::fs::read_dir(&root).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with("step_") {
            for f in [
                "trainer_state.json",
                "optimizer.bpk",
                "model.safetensors",
                "tokenizer.json",
                "config.json",
            ] {
                assert!(e.path().join(f).is_file(), "{name} has no {f}");
            }
        }
    }
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
    let names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(
        names,
        vec!["step_000003".to_string()],
        "leftovers after the resume"
    );
}
