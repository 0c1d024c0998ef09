//! `qarl runs`: the run directories under runs/ and experiments/results/ with their last step, final
//! held-out accuracy and status (finished, resumable, or neither).

use std::path::{Path, PathBuf};

use crate::train::{checkpoint, metrics, TrainConfig};

#[derive(Debug, clap::Args)]
pub struct RunsArgs {
    /// Directories to search (default: runs and experiments/results).
    pub dirs: Vec<PathBuf>,
}

/// What `qarl runs` shows of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    pub dir: PathBuf,
    /// Last RL step logged, if any.
    pub last_step: Option<u64>,
    /// Steps the config asks for.
    pub steps: Option<usize>,
    /// Greedy held-out accuracy of the newest evaluation (rollout precision), and its step.
    pub accuracy: Option<(f64, u64)>,
    pub status: String,
}

/// Finds run directories (those with a metrics.jsonl) under `root`, at most `depth` levels down.
fn find(root: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    if root.join("metrics.jsonl").is_file() {
        out.push(root.to_path_buf());
        return;
    }
    if depth == 0 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n != "checkpoints"))
        .collect();
    dirs.sort();
    for d in dirs {
        find(&d, depth - 1, out);
    }
}

/// Reads what a run directory says about itself; unreadable lines and files are skipped, not fatal.
pub fn inspect(dir: &Path) -> RunInfo {
    let cfg_read: anyhow::Result<TrainConfig> = crate::io::read_json(&dir.join("config.json"));
    // A config that does not read leaves the run's length unknown (not "finished" from the rows), and a
    // resume would refuse it: said beside the status.
    let config_problem = cfg_read
        .as_ref()
        .err()
        .filter(|_| dir.join("config.json").exists())
        .map(|e| format!("{e:#}"));
    let cfg = cfg_read.ok();
    // Read as a report, a comparison or a plot reads it; where that refuses the log (a damaged line in the
    // middle, a repeated step), the listing reads on past the damage and says so beside the status. A log
    // that cannot be read at all (not UTF-8, a directory) says nothing about the run: its status says so
    // rather than what `finished.json` or the empty rows would.
    let log = dir.join("metrics.jsonl");
    let (read, damaged) = match metrics::read_rows(&log, metrics::BadLines::TornLastOnly) {
        Ok(rows) => (Ok(rows), None),
        Err(e) => {
            let read = metrics::read_rows(&log, metrics::BadLines::Skip);
            let damaged = read.is_ok().then(|| format!("{e:#}"));
            (read, damaged)
        }
    };
    let unreadable = read.as_ref().err().map(|e| format!("{e:#}"));
    let rows = read.unwrap_or_default();
    // An evaluation a report refuses (an accuracy outside [0, 1], outcomes that disagree with it) is
    // listed as damage, and its accuracy is not shown as the run's.
    let mut bad_eval = None;
    let rows: Vec<_> = rows
        .into_iter()
        .filter(|v| {
            let refused = (v["phase"] == "eval")
                .then(|| crate::train::experiment::check_eval_row(&log, v).err())
                .flatten();
            if let Some(e) = &refused {
                bad_eval.get_or_insert_with(|| format!("{e:#}"));
            }
            refused.is_none()
        })
        .collect();
    let damaged = damaged.or(bad_eval);
    let (mut last_step, mut accuracy) = (None, None);
    let want = cfg
        .as_ref()
        .map(|c| format!("eval/{}/pass@1_greedy", c.rollout.precision));
    for v in rows {
        let step = v["step"].as_u64();
        match v["phase"].as_str() {
            Some("rl") => last_step = step.or(last_step),
            Some("eval") => {
                let acc = want
                    .as_ref()
                    .and_then(|k| v[k.as_str()].as_f64())
                    .or_else(|| {
                        v.as_object()?
                            .iter()
                            .find(|(k, _)| k.ends_with("pass@1_greedy"))
                            .and_then(|(_, x)| x.as_f64())
                    });
                if let (Some(a), Some(s)) = (acc, step) {
                    accuracy = Some((a, s));
                }
            }
            _ => {}
        }
    }
    let steps = cfg.as_ref().map(|c| c.train.steps);
    let ckpt = checkpoint::latest(dir);
    // From the rows: the final evaluation and the last step, and the last step's weights on disk (a run
    // killed between its final evaluation and its last checkpoint, as runs before 2026-12-07 could be,
    // is not finished: its accuracy is of weights nobody can load).
    let last_saved = ckpt.as_ref().map(|(_, st)| st.step.saturating_add(1));
    let complete = complete_log(accuracy, steps, last_step);
    let finished = dir.join("finished.json").is_file() || (complete && last_saved == steps);
    let status = if let Some(e) = unreadable {
        format!("metrics unreadable ({e})")
    } else if finished {
        "finished".to_string()
    } else if let Some((_, st)) = &ckpt {
        format!("resumable from step {}", st.step.saturating_add(1))
    } else if let Some((_, st)) =
        checkpoint::list_in(&crate::train::sft::checkpoints_root(dir)).pop()
    {
        // A warm start stopped part-way: `qarl train --resume` continues it.
        format!(
            "resumable: the warm start from its step {}",
            st.step.saturating_add(1)
        )
    } else if complete {
        // Every row of a finished run, and no checkpoint at all: they were not kept (a committed result,
        // a copied run). A run killed before its last save would still hold its earlier checkpoints.
        "complete log, no checkpoint here (its weights were not kept): not resumable".to_string()
    } else {
        "incomplete (no checkpoint)".to_string()
    };
    let status = match damaged {
        Some(e) => format!("{status}; its log does not read back ({e})"),
        None => status,
    };
    let status = match config_problem {
        Some(e) => format!("{status}; its config.json does not read ({e})"),
        None => status,
    };
    RunInfo {
        dir: dir.to_path_buf(),
        last_step,
        steps,
        accuracy,
        status,
    }
}

/// All runs under `roots`.
pub fn list(roots: &[PathBuf]) -> Vec<RunInfo> {
    let mut dirs = vec![];
    for r in roots {
        find(r, 3, &mut dirs);
    }
    // One run reached twice (a root given twice, a link to a run among the roots) is listed once.
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.canonicalize().unwrap_or_else(|_| d.clone())));
    dirs.iter().map(|d| inspect(d)).collect()
}

pub fn run(args: RunsArgs) -> anyhow::Result<()> {
    let roots = if args.dirs.is_empty() {
        vec![PathBuf::from("runs"), PathBuf::from("experiments/results")]
    } else {
        args.dirs
    };
    for r in &roots {
        if !r.exists() && !args_default(r) {
            anyhow::bail!("{}: no such directory", r.display());
        }
        if r.exists() && !r.is_dir() {
            anyhow::bail!(
                "{}: not a directory (`qarl runs` lists the runs under directories)",
                r.display()
            );
        }
    }
    let runs = list(&roots);
    if runs.is_empty() {
        let roots: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
        println!(
            "no runs (directories with a metrics.jsonl) under {}",
            roots.join(", ")
        );
        return Ok(());
    }
    let w = runs
        .iter()
        .map(|r| r.dir.display().to_string().len())
        .max()
        .unwrap_or(3)
        .max(3);
    println!(
        "{:<w$}  {:>9}  {:>14}  status",
        "run", "step", "held-out acc"
    );
    for r in runs {
        let step = match (r.last_step, r.steps) {
            (Some(l), Some(n)) => format!("{}/{n}", l.saturating_add(1)),
            (Some(l), None) => format!("{}", l.saturating_add(1)),
            (None, Some(n)) => format!("0/{n}"),
            (None, None) => "-".into(),
        };
        let acc = r
            .accuracy
            .map_or("-".into(), |(a, s)| format!("{a:.3} @{s}"));
        println!(
            "{:<w$}  {step:>9}  {acc:>14}  {}",
            r.dir.display(),
            r.status
        );
    }
    Ok(())
}

/// The default roots may be absent.
fn args_default(p: &Path) -> bool {
    p == Path::new("runs") || p == Path::new("experiments/results")
}

/// Whether a run's rows are those of a finished run: its last RL step is `train.steps - 1` and its last
/// evaluation is at `train.steps` (the final one).
fn complete_log(
    accuracy: Option<(f64, u64)>,
    steps: Option<usize>,
    last_step: Option<u64>,
) -> bool {
    matches!((accuracy, steps, last_step), (Some((_, s)), Some(n), Some(l)) if s as usize == n && l.saturating_add(1) == n as u64)
}
