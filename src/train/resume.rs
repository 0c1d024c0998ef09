//! Where an RL run starts: over, refusing to destroy what a run directory holds unasked, or from its newest
//! checkpoint, refusing a config that would make the continued rows another experiment's.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::checkpoint::{self, TrainerState};
use super::config::{self, TrainConfig};
use super::metrics;
use super::sft;

/// A resume refused because the config differs from the run's own outside [`RESUME_MAY_CHANGE`]
/// (callers that resume on the user's behalf, `qarl experiment`, say how to start the run over).
#[derive(Debug, thiserror::Error)]
#[error(
    "{path}: the run was made with other `{keys}` settings than this config's; resuming would mix two \
     experiments in one run (restore them, go on anyway with --resume --accept-changes, start over with \
     --overwrite, or choose another `run_dir`; a resume may change only {allowed})"
)]
pub struct ResumeChanged {
    pub path: PathBuf,
    pub keys: String,
    pub allowed: String,
}

/// What a resume may change against the run it continues (JSON pointers into the run's config.json),
/// besides the knobs that change memory or checks but not what is computed
/// ([`config::RESULT_NEUTRAL_KEYS`]): how far it goes, how often it evaluates, where it runs and from
/// which paths. Everything else (the rollouts, the learner's settings, the objective, the task, the
/// verifier, the warm start, the seed, the metrics' definitions) is the run's identity: rows after the
/// checkpoint made under other values would be another experiment under the same run's name, and its
/// config.json would misstate how the earlier rows were made.
pub const RESUME_MAY_CHANGE: [&str; 4] = ["/run_dir", "/model", "/train/steps", "/eval/every"];

/// Refuses a resume whose config differs from the run's own (its `config.json`) anywhere outside
/// [`RESUME_MAY_CHANGE`] and [`config::RESULT_NEUTRAL_KEYS`], naming every key that differs ([`ResumeChanged`]); with `accept`, logs the
/// changes instead ([`keep_earlier_config`] keeps the earlier config once the checkpoint has loaded).
pub(super) fn check_resumed_config(cfg: &TrainConfig, accept: bool) -> anyhow::Result<()> {
    let path = cfg.run_dir.join("config.json");
    // A run writes its config before its first checkpoint: one missing beside checkpoints was removed or
    // left behind in a copy, and without it any settings would pass.
    if !path.is_file() && !accept {
        anyhow::bail!(
            "{}: missing, though the run has checkpoints: the resume cannot check that it continues the same \
             experiment (the settings its steps so far were made with); restore the file, or go on under \
             this config with --resume --accept-changes",
            path.display()
        );
    }
    let changed = resume_changes(cfg, &path, accept)?;
    if changed.is_empty() {
        return Ok(());
    }
    if accept {
        tracing::warn!(
            "resuming with other settings than the run's (`{}`, --accept-changes): its earlier config is \
             kept beside the new one once the checkpoint has loaded",
            changed.join("`, `")
        );
        return Ok(());
    }
    Err(ResumeChanged {
        path,
        keys: changed.join("`, `"),
        allowed: RESUME_MAY_CHANGE
            .iter()
            .chain(&config::RESULT_NEUTRAL_KEYS)
            .map(|p| match *p {
                // The one exception, said where the list is (it read as a contradiction beside it).
                "/train/steps" => "`train.steps` (but not under the cosine schedule)".to_string(),
                p => format!("`{}`", p.trim_start_matches('/').replace('/', ".")),
            })
            .collect::<Vec<_>>()
            .join(", "),
    }
    .into())
}

/// The settings where `cfg` differs from the run's own config at `path` in a way a resume may not change
/// unasked (none where the run has no config yet). A config this version does not read is an error unless
/// `accept` (then compared as JSON).
fn resume_changes(cfg: &TrainConfig, path: &Path, accept: bool) -> anyhow::Result<Vec<String>> {
    if !path.is_file() {
        return Ok(Vec::new());
    }
    // With the implicit defaults written out on both sides: a config saved from `qarl config show` (every
    // default written) continues a run made from the file it came from.
    let (raw, text): (serde_json::Value, String) = crate::io::read_json_and_text(path)?;
    // A key given twice reads as its last value, and the difference from this config would be named as
    // a changed setting rather than as the damage it is.
    if let (Ok(Some(key)), false) = (crate::io::first_repeated_key(text.as_bytes()), accept) {
        anyhow::bail!(
            "{}: `{key}` is given twice, so which value the run was made with is ambiguous; restore the \
             file, or go on under this config with --resume --accept-changes",
            path.display()
        );
    }
    let mut old = match serde_json::from_value::<TrainConfig>(raw.clone()) {
        Ok(c) => serde_json::to_value(c.with_defaults())?,
        // Compared key by key, a config this version no longer reads would list keys that did not
        // change (defaults filled in on one side only): say what is wrong instead.
        Err(e) if !accept => anyhow::bail!(
            "{}: the run's config does not read as a config of this version ({e}), so the resume cannot \
             check that it continues the same experiment: go on anyway with --resume --accept-changes, or \
             start over with --overwrite",
            path.display()
        ),
        Err(_) => raw.clone(),
    };
    let mut changed = config::identity_changes(&mut old, cfg, &RESUME_MAY_CHANGE)?;
    // `train.steps` may grow, except under a schedule that spans the steps: a cosine decay stretched over
    // more steps would raise the learning rate again mid-run, a schedule no uninterrupted run has.
    let old_steps = raw.pointer("/train/steps").and_then(|v| v.as_u64());
    if cfg.train.lr_schedule == config::LrSchedule::Cosine
        && old_steps.is_some_and(|s| s != cfg.train.steps as u64)
    {
        changed.push("train.steps (under the cosine schedule)".into());
    }
    Ok(changed)
}

/// Keeps the run's config.json as `config.before_step_{done}.json` where a resume with --accept-changes
/// continues it under other settings: called once the checkpoint has loaded and before config.json is
/// rewritten, so that a refused resume leaves nothing behind.
pub(super) fn keep_earlier_config(cfg: &TrainConfig, done: usize) -> anyhow::Result<()> {
    let path = cfg.run_dir.join("config.json");
    if resume_changes(cfg, &path, true)?.is_empty() {
        return Ok(());
    }
    // A name of its own: a second accepted change at the same step keeps the first record too.
    let kept = (0..)
        .map(|i| match i {
            0 => cfg.run_dir.join(format!("config.before_step_{done}.json")),
            i => cfg
                .run_dir
                .join(format!("config.before_step_{done}.{i}.json")),
        })
        .find(|p| !p.exists())
        .expect("an unused name");
    let bytes = std::fs::read(&path).map_err(crate::io::failed(&path, "cannot read"))?;
    crate::io::write_atomic(&kept, &bytes)?;
    tracing::warn!("the run's earlier config is kept in {}", kept.display());
    Ok(())
}

/// The `model.dir` the run directory's earlier config names, if it has a readable one: the model
/// whose warm start the rows in its metrics are.
fn earlier_model_dir(cfg: &TrainConfig) -> Option<PathBuf> {
    let old: serde_json::Value = crate::io::read_json(&cfg.run_dir.join("config.json")).ok()?;
    old.pointer("/model/dir")?.as_str().map(PathBuf::from)
}

/// Whether the warm start's rows in the run directory's metrics stay when RL starts over: they are
/// the rows of the model this run uses only where the earlier config named the same `model.dir`
/// (compared as directories: `m`, `./m` and its absolute path are one). With `--resume` they stay
/// unless the earlier config names another; without, a made model keeps them only where it names
/// this one (a missing or unreadable config says nothing of them, so they go). A run moved with its model
/// (the earlier folder gone, the one named now made by this config's warm start) keeps them too.
pub(super) fn keeps_warm_start_rows(cfg: &TrainConfig, resume: bool, model_made: bool) -> bool {
    let earlier = earlier_model_dir(cfg);
    let moved_here = |d: &PathBuf| !d.exists() && super::model_dir::made_by_this_config(cfg);
    let same = |d: &PathBuf| crate::io::same_dir(d, &cfg.model.dir) || moved_here(d);
    if resume {
        earlier.as_ref().is_none_or(same)
    } else {
        model_made && earlier.as_ref().is_some_and(same)
    }
}

/// How a run takes its run directory: starting over (with `overwrite`, removing an earlier run's
/// checkpoints and metrics; without, refusing them) or resuming its newest checkpoint (with
/// `accept_changes`, under a config that differs outside [`RESUME_MAY_CHANGE`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Start {
    Over { overwrite: bool },
    Resume { accept_changes: bool },
}

/// The checkpoint an RL run continues from (`--resume`), or `None` when RL starts at step 0, after the
/// checks that keep a run directory's results from being lost or mixed: without `--resume`, checkpoints,
/// an unfinished warm start or earlier RL rows there are refused unless `--overwrite` (which removes the
/// checkpoints); with it, the checkpoint must be this run's (seed, `train.steps`, the config outside
/// [`RESUME_MAY_CHANGE`]). `model_made`: `model.dir` already holds a model.
pub(super) fn start_point(
    cfg: &TrainConfig,
    start: Start,
    model_made: bool,
    metrics_path: &Path,
) -> anyhow::Result<Option<(PathBuf, TrainerState)>> {
    let accept_changes = match start {
        Start::Over { overwrite } => {
            refuse_earlier_results(cfg, overwrite, model_made, metrics_path)?;
            if overwrite {
                remove_earlier_outputs(&cfg.run_dir)?;
            }
            return Ok(None);
        }
        Start::Resume { accept_changes } => accept_changes,
    };
    // What a killed checkpoint write or prune left (a finished run's last prune is never followed by
    // another save, which would remove it).
    checkpoint::remove_leftovers(&checkpoint::checkpoints_dir(&cfg.run_dir));
    let Some((p, state)) = checkpoint::latest_checked(&cfg.run_dir)? else {
        refuse_lost_checkpoints(cfg, metrics_path)?;
        tracing::warn!(run_dir = %cfg.run_dir.display(), "--resume: no RL checkpoint yet, so RL starts at step 0 (after the warm start, where it has one to finish)");
        // RL starts over (its settings may change), but an unfinished warm start continues, and must be
        // this config's; checked before the run's config.json is rewritten.
        sft::check_warm_start_resume(cfg)?;
        return Ok(None);
    };
    if let Some(seed) = state.seed.filter(|&s| s != cfg.seed) {
        anyhow::bail!(
            "{}: written by a run with seed {seed}, but the config has seed {}; resuming would not \
             continue the same run (set `seed = {seed}`, or choose another `run_dir` for a new run)",
            p.display(),
            cfg.seed
        );
    }
    // The checkpoint holds the weights after `state.step + 1` steps: fewer steps would end the run
    // before where it already is, labelling those weights with an earlier step.
    let done = state.step.saturating_add(1);
    if done > cfg.train.steps {
        anyhow::bail!(
            "{}: the run has done {done} RL steps, but `train.steps` = {}: a resume only goes further \
             (set `train.steps` >= {done}; for an earlier step's model, take its checkpoint)",
            p.display(),
            cfg.train.steps
        );
    }
    check_resumed_config(cfg, accept_changes)?;
    check_log_reaches(metrics_path, &p, state.step)?;
    Ok(Some((p, state)))
}

/// Refuses a resume that finds no checkpoint where the log shows one was written (an RL row past a step
/// that ends with a checkpoint, every `checkpoint_every`-th, or the final evaluation, logged after the last
/// step's checkpoint): the checkpoints were moved or deleted, and starting RL over would drop the run's
/// rows for a run nobody asked to redo. A run stopped before its first checkpoint starts RL over.
fn refuse_lost_checkpoints(cfg: &TrainConfig, metrics_path: &Path) -> anyhow::Result<()> {
    if !metrics_path.is_file() {
        return Ok(());
    }
    let rows = metrics::read_rows(metrics_path, metrics::BadLines::Skip)?;
    let steps_of = |phase: &'static str| {
        rows.iter()
            .filter(move |r| r["phase"].as_str() == Some(phase))
            .filter_map(|r| r["step"].as_u64())
    };
    let last_rl = steps_of("rl").max();
    let every = cfg.checkpoint_every as u64;
    let past_periodic = last_rl.filter(|&t| every > 0 && t >= every);
    let final_eval = cfg.train.steps > 0 && steps_of("eval").any(|s| s == cfg.train.steps as u64);
    let evidence = match (past_periodic, final_eval) {
        (Some(t), _) => format!(
            "reaches RL step {t}, past the checkpoint written after step {}",
            every - 1
        ),
        (None, true) => format!(
            "holds the final evaluation (step {}), logged after the last step's checkpoint",
            cfg.train.steps
        ),
        (None, false) => return Ok(()),
    };
    anyhow::bail!(
        "{}: the log {evidence}, but {} holds no checkpoint: they were moved or deleted, and a resume \
         from none would start RL over and drop the run's rows; restore them to resume, or pass \
         --overwrite to start over",
        metrics_path.display(),
        checkpoint::checkpoints_dir(&cfg.run_dir).display()
    )
}

/// Refuses a resume whose metrics log lacks an RL row up to the checkpoint's step (a log deleted or cut
/// back, or rows that a power loss kept from the disk while the checkpoint reached it): the continued run
/// would read as whole with rows missing, and its first evaluation before RL with them.
fn check_log_reaches(metrics_path: &Path, checkpoint: &Path, step: usize) -> anyhow::Result<()> {
    let rows = if metrics_path.is_file() {
        metrics::read_rows(metrics_path, metrics::BadLines::TornLastOnly)?
    } else {
        Vec::new()
    };
    let logged: std::collections::HashSet<u64> = rows
        .iter()
        .filter(|r| r["phase"] == "rl")
        .filter_map(|r| r["step"].as_u64())
        .collect();
    if let Some(missing) = (0..=step as u64).find(|s| !logged.contains(s)) {
        anyhow::bail!(
            "{}: has no RL row for step {missing}, but {} holds the weights after step {step}: the log \
             lost rows of this run (restore it, or start over with --overwrite)",
            metrics_path.display(),
            checkpoint.display()
        );
    }
    Ok(())
}

/// What `--overwrite` removes of an earlier run besides its rows ([`reset_metrics`]): its checkpoints, the
/// experiment's mark that it finished, its plots and the configs kept by accepted changes. Left behind, they
/// would describe the earlier run beside the new one's rows (a new run killed early would still read as
/// finished).
fn remove_earlier_outputs(run_dir: &Path) -> anyhow::Result<()> {
    let dir = checkpoint::checkpoints_dir(run_dir);
    let left = checkpoint::remove_all(&dir)?;
    if !left.is_empty() {
        let names: Vec<String> = left.iter().map(|p| p.display().to_string()).collect();
        tracing::warn!(
            "{}: the earlier run's checkpoints are removed; left in place, not written by a run: {}",
            dir.display(),
            names.join(", ")
        );
    }
    let kept_configs = std::fs::read_dir(run_dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("config.before_step_") && n.ends_with(".json"))
        });
    let files = [finished_marker(run_dir), super::plot::run_plots(run_dir)];
    crate::io::remove_files_present(files.into_iter().chain(kept_configs))
}

/// The file that marks a run of an experiment finished (its final evaluation summarized): written by
/// `qarl experiment`, removed here when the run starts over.
pub fn finished_marker(run_dir: &Path) -> PathBuf {
    run_dir.join("finished.json")
}

/// A run starting over refuses a run directory with an earlier run's checkpoints, an unfinished warm start
/// (where `model.dir` is not made yet) or RL and evaluation rows, unless `overwrite`: each is someone's
/// results, never deleted unasked. With `overwrite` nothing there is read (a damaged checkpoint must not
/// block starting over).
fn refuse_earlier_results(
    cfg: &TrainConfig,
    overwrite: bool,
    model_made: bool,
    metrics_path: &Path,
) -> anyhow::Result<()> {
    if overwrite {
        return Ok(());
    }
    if let Some((p, st)) = checkpoint::latest_checked(&cfg.run_dir)? {
        anyhow::bail!(
            "{}: this run directory already has checkpoints (newest: step {}, {}); pass --resume to \
             continue it, --overwrite to start over (deleting its checkpoints and metrics), or choose \
             another `run_dir`",
            cfg.run_dir.display(),
            st.step,
            p.display()
        );
    }
    let sft_root = sft::checkpoints_root(&cfg.run_dir);
    let unfinished_sft = if model_made {
        None
    } else {
        checkpoint::latest_checked_in(&sft_root)?
    };
    if let Some((p, st)) = unfinished_sft {
        anyhow::bail!(
            "{}: this run directory has a checkpoint of an unfinished warm start (SFT step {}, {}); pass \
             --resume to continue it, --overwrite to start over, or choose another `run_dir`",
            cfg.run_dir.display(),
            st.step,
            p.display()
        );
    }
    // An earlier run's RL or evaluation rows without a checkpoint (one stopped before its first, or
    // finished with checkpoints pruned away).
    if metrics_path.is_file() {
        let rows = metrics::read_rows(metrics_path, metrics::BadLines::Skip)?;
        let earlier = rows
            .iter()
            .filter(|r| matches!(r["phase"].as_str(), Some("rl" | "eval")))
            .count();
        if earlier > 0 {
            anyhow::bail!(
                "{}: holds {earlier} RL and evaluation rows of an earlier run (and no checkpoint to \
                 resume from); pass --overwrite to start over (deleting them), --resume to keep the \
                 warm start's rows and start RL over, or choose another `run_dir`",
                metrics_path.display()
            );
        }
    }
    Ok(())
}

/// The metrics log as the run's start needs it: a resumed run drops the rows after its checkpoint (the
/// evaluation after the checkpoint's step is logged before the checkpoint is written; a finished run's
/// final one is redone); a run starting over keeps the warm start's rows where `keeps_sft_rows`
/// ([`keeps_warm_start_rows`]) and otherwise starts a new log. The same for the RL rows of
/// [`metrics::WORST_RESPONSES_FILE`].
pub(super) fn reset_metrics(
    cfg: &TrainConfig,
    resumed: Option<&TrainerState>,
    keeps_sft_rows: bool,
    metrics_path: &Path,
) -> anyhow::Result<()> {
    match resumed {
        Some(state) => {
            metrics::truncate_after(metrics_path, "rl", state.step)?;
            let last_eval = if state.step.saturating_add(1) < cfg.train.steps {
                state.step + 1
            } else {
                state.step
            };
            metrics::truncate_after(metrics_path, "eval", last_eval)?;
        }
        // RL starts over from step 0, but the warm start's rows stay (they used to be deleted with the
        // file): with `--resume` before the first checkpoint, all of them when it finished, those up to its
        // checkpoint when it resumes (`prepare_model_locked` drops the rest); with `--overwrite`, those of
        // the model that is kept and used again (the earlier run named the same `model.dir`).
        None if keeps_sft_rows => {
            metrics::retain_rows(metrics_path, |row| row["phase"].as_str() == Some("sft"))?;
        }
        None if metrics_path.exists() => std::fs::remove_file(metrics_path)
            .with_context(|| format!("{}: cannot remove", metrics_path.display()))?,
        None => {}
    }
    // The worst responses follow the RL rows: those after the checkpoint go, and all of them when RL
    // starts over.
    let examples = cfg.run_dir.join(metrics::WORST_RESPONSES_FILE);
    match resumed {
        Some(state) => metrics::truncate_after(&examples, "rl", state.step)?,
        None if examples.exists() => std::fs::remove_file(&examples)
            .with_context(|| format!("{}: cannot remove", examples.display()))?,
        None => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The files a run writes in `run_dir` are those no input may be ([`config::RUN_FILES`]).
    #[test]
    fn the_run_files_list_names_every_file_a_run_writes() {
        let dir = std::path::Path::new("r");
        let written = [
            super::finished_marker(dir),
            crate::train::plot::run_plots(dir),
            dir.join(crate::train::metrics::WORST_RESPONSES_FILE),
        ];
        for file in written {
            let name = file.file_name().unwrap().to_str().unwrap();
            assert!(super::config::RUN_FILES.contains(&name), "{name}");
        }
    }

    /// A run moved with its model before its first RL checkpoint keeps its warm start's rows on
    /// `--resume`: the earlier `model.dir` is gone and the one named now records this config's recipe.
    #[test]
    fn a_run_moved_with_its_model_keeps_its_warm_start_rows() {
        let tmp = tempfile::tempdir().unwrap();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(root.join("configs/default.toml"))
            .unwrap()
            .replace(
                "configs/models/qwen3-moe-arith.json",
                &root
                    .join("configs/models/qwen3-moe-arith.json")
                    .display()
                    .to_string(),
            );
        let mut cfg = super::TrainConfig::from_toml(&text, "default.toml").unwrap();
        cfg.run_dir = tmp.path().join("moved/run");
        cfg.model.dir = tmp.path().join("moved/model");
        std::fs::create_dir_all(&cfg.run_dir).unwrap();
        std::fs::create_dir_all(&cfg.model.dir).unwrap();
        let mut earlier = serde_json::to_value(&cfg).unwrap();
        earlier["model"]["dir"] = tmp.path().join("was/model").display().to_string().into();
        crate::io::write_json_atomic(&cfg.run_dir.join("config.json"), &earlier).unwrap();
        // Without the record, a model the run did not make: the rows go.
        assert!(!super::keeps_warm_start_rows(&cfg, true, true));
        super::super::model_dir::write_made_by(&cfg, &cfg.model.dir).unwrap();
        assert!(super::keeps_warm_start_rows(&cfg, true, true));
        // Another seed's warm start is another model.
        let mut other = cfg.clone();
        other.seed += 1;
        assert!(!super::keeps_warm_start_rows(&other, true, true));
        // The earlier folder still there: another model, whatever this one records.
        std::fs::create_dir_all(tmp.path().join("was/model")).unwrap();
        assert!(!super::keeps_warm_start_rows(&cfg, true, true));
    }
}
