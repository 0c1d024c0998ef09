//! Evaluations read back from what qarl wrote: a `qarl eval --output` file, or a run's held-out evaluation
//! (a row of its `metrics.jsonl`, its questions rebuilt from the run's task).

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

use super::prompt::{prompt_text, task_prompt_text};
use super::{canonical, EvalRow, Evaluation};
use crate::rl::metrics::names;
use crate::tasks::Task;
use crate::train::config::RolloutStop;
use crate::train::metrics::{read_rows, BadLines};
use crate::train::TrainConfig;

#[derive(Deserialize)]
struct EvalOutput {
    problems: Vec<EvalProblem>,
    #[serde(default)]
    summary: Option<EvalSummary>,
}

#[derive(Deserialize)]
struct EvalProblem {
    question: String,
    correct: bool,
    #[serde(default)]
    gold: Option<String>,
}

#[derive(Deserialize, Default)]
struct EvalSummary {
    precision: Option<String>,
    #[serde(default)]
    activations: Option<String>,
    #[serde(default)]
    accuracy: Option<f64>,
    /// How many problems `qarl eval` scored (`problems`' length).
    #[serde(default)]
    problems: Option<serde_json::Value>,
    #[serde(default)]
    verify: Option<serde_json::Value>,
    #[serde(default)]
    stop_strings: Option<Vec<String>>,
    #[serde(default)]
    max_new_tokens: Option<usize>,
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    system: Option<String>,
    #[serde(default)]
    enable_thinking: Option<bool>,
}

/// A `qarl eval --output` file; refused when it records another precision than an asked one.
pub(super) fn eval_output(
    spec: &str,
    path: &Path,
    precision: Option<&str>,
) -> anyhow::Result<Evaluation> {
    let (out, text): (EvalOutput, String) = crate::io::read_json_expecting(
        path,
        "a `qarl eval --output` file: `problems` with `question` and `correct`",
    )?;
    if out.problems.is_empty() {
        bail!("{}: no problems", path.display());
    }
    // A file without a summary records nothing beside its outcomes.
    let s = out.summary.unwrap_or_default();
    check_summary_count(path, s.problems.as_ref(), out.problems.len())?;
    let prompt = s
        .template
        .as_deref()
        .map(|t| prompt_text(t, s.system.as_deref(), s.enable_thinking));
    let recorded = s.precision;
    if let (Some(asked), Some(have)) = (precision, &recorded) {
        if asked != have {
            bail!(
                "{}: an evaluation in {have}, but --precision asks for {asked}",
                path.display()
            );
        }
    }
    let golds: Option<Vec<String>> = out.problems.iter().map(|p| p.gold.clone()).collect();
    let (questions, correct): (Vec<String>, Vec<bool>) = out
        .problems
        .into_iter()
        .map(|p| (p.question, p.correct))
        .unzip();
    // The summary's accuracy and the outcomes compared are one measurement: a file edited in one place
    // and not the other is refused, not read either way.
    if let Some(acc) = s
        .accuracy
        .filter(|&a| !crate::train::paired::accuracy_agrees(a, &correct))
    {
        bail!(
            "{}: its summary's accuracy {acc} is not that of its problems' outcomes ({}): the file was \
             changed after `qarl eval` wrote it",
            path.display(),
            crate::train::paired::accuracy(&correct)
        );
    }
    Ok(Evaluation {
        source: spec.to_string(),
        identity: canonical(path),
        content: crate::tasks::stable_hash(&text),
        precision: recorded,
        activations: s.activations,
        // Files written before the version was recorded were judged by the first verifier.
        verify: s.verify.map(|mut v| {
            if let Some(o) = v.as_object_mut() {
                o.entry("verifier")
                    .or_insert(crate::tasks::verify::UNRECORDED_VERIFIER_VERSION.into());
            }
            v
        }),
        stop_strings: s.stop_strings,
        max_new_tokens: s.max_new_tokens,
        questions,
        golds,
        prompt,
        correct,
    })
}

/// The summary's problem count (when it has one) against the problems listed: an edited or damaged file
/// is refused, as for the accuracy.
fn check_summary_count(
    path: &Path,
    count: Option<&serde_json::Value>,
    listed: usize,
) -> anyhow::Result<()> {
    match count {
        None => Ok(()),
        Some(v) if v.as_u64() == Some(listed as u64) => Ok(()),
        Some(v) => bail!(
            "{}: its summary counts {v} problems but lists {listed}: the file was changed after `qarl \
             eval` wrote it",
            path.display()
        ),
    }
}

/// The eval rows of a metrics log ([`BadLines::TornLastOnly`]: a last line cut short is left out, as
/// training and the report do; any other line that is not a row is an error naming it).
fn eval_rows(metrics: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let rows = read_rows(metrics, BadLines::TornLastOnly)?;
    Ok(rows.into_iter().filter(|v| v["phase"] == "eval").collect())
}

/// A run's held-out evaluation: the outcomes from its metrics log, the questions rebuilt from its config's
/// task and checked against the fingerprint the evaluation logged (logs from before 2026-12-05 have none:
/// then only the number of problems is checked).
pub(super) fn run_evaluation(
    dir: &Path,
    row: EvalRow,
    precision: Option<&str>,
) -> anyhow::Result<Evaluation> {
    let config = dir.join("config.json");
    if !config.is_file() {
        bail!("{}: not a run directory (no config.json)", dir.display());
    }
    let cfg: TrainConfig = crate::io::read_json(&config)?;
    let precision = precision.map_or_else(|| cfg.rollout.precision.to_string(), str::to_string);
    let metrics = dir.join("metrics.jsonl");
    let evals = eval_rows(&metrics)?;
    let picked = match row {
        EvalRow::First => evals.first(),
        EvalRow::Last => evals.last(),
        EvalRow::Step(s) => evals.iter().find(|v| v["step"].as_u64() == Some(s)),
        EvalRow::Final => {
            let end = cfg.train.steps as u64;
            let found = evals.iter().find(|v| v["step"].as_u64() == Some(end));
            let last = evals.last().and_then(|v| v["step"].as_u64());
            // Evaluations past the end the config gives: the config is not the log's (edited), and the
            // one at "the end" would be an earlier model's.
            if let Some(later) = last.filter(|&l| l > end) {
                bail!(
                    "{}: its evaluations go on to step {later}, past the run's end in {} (`train.steps` = \
                     {end}): the config does not describe this log; name the evaluation to compare \
                     ({}@{later}, or @last)",
                    metrics.display(),
                    config.display(),
                    dir.display()
                );
            }
            if let (None, Some(last)) = (found, last) {
                bail!(
                    "{}: no evaluation at the run's end (step {end}, its `train.steps`): its last is at \
                     step {last}, so the run is unfinished or stopped early; name the one to compare \
                     ({}@{last}, or @last) to take it anyway",
                    metrics.display(),
                    dir.display()
                );
            }
            found
        }
    }
    .with_context(|| {
        let steps: Vec<String> = evals
            .iter()
            .filter_map(|v| v["step"].as_u64())
            .map(|s| s.to_string())
            .collect();
        let held = if steps.is_empty() {
            "none at any step".to_string()
        } else {
            format!("it has them at steps {}", steps.join(", "))
        };
        format!("{}: no held-out evaluation ({row}); {held}", metrics.display())
    })?;
    let key = format!("eval/{precision}/greedy_correct");
    let step = picked["step"]
        .as_u64()
        .map_or("?".into(), |s| s.to_string());
    let at = format!("{}: the evaluation at step {step}", metrics.display());
    let correct = match picked.get(key.as_str()) {
        None => bail!("{at} has no `{key}`"),
        Some(v) => v
            .as_str()
            .and_then(crate::train::paired::decode)
            .with_context(|| {
                let shown: String = v.to_string().chars().take(40).collect();
                format!(
                    "{at} has `{key}` = {shown}, not an outcome string (one 0 or 1 per problem)"
                )
            })?,
    };
    // Normalised as a resume compares it: runs made before `eval_fraction` was refused beside
    // `eval_path` recorded the default one there.
    let task = Task::from_config(&cfg.task.with_defaults()).with_context(|| {
        format!("{}: its task (the held-out questions) does not load; run from the directory the run was started in", dir.display())
    })?;
    let questions = task.eval_questions(cfg.eval.problems);
    if questions.is_empty() {
        bail!("{}: the run holds out no problems", dir.display());
    }
    if questions.len() != correct.len() {
        bail!(
            "{at} has {} outcomes, but the run's task holds out {} problems now: its data files changed",
            correct.len(),
            questions.len()
        );
    }
    if let Some(logged) = picked[names::EVAL_QUESTIONS_FINGERPRINT].as_str() {
        let now = crate::tasks::questions_fingerprint(&questions);
        if now != logged {
            bail!(
                "{at} logged questions {logged}, but its task's held-out questions are now {now}: its data \
                 files changed, or this is not the directory the run was started in"
            );
        }
    }
    if let Some(logged) = picked[names::EVAL_PROBLEMS_FINGERPRINT].as_str() {
        let now = task.problems_fingerprint(cfg.eval.problems);
        if now != logged {
            bail!(
                "{at} logged problems {logged} (questions with their gold answers), but its task's are now \
                 {now}: the gold answers of its data files changed"
            );
        }
    }
    Ok(Evaluation {
        source: format!("{}@{step}", dir.display()),
        identity: format!("{}@{step}", canonical(dir)),
        content: crate::tasks::stable_hash(&picked.to_string()),
        precision: Some(precision),
        activations: Some(cfg.train.activations.to_string()),
        verify: Some(
            cfg.verify
                .judging_rules_of(crate::train::metrics::verifier_version_of(picked)),
        ),
        stop_strings: logged_stop_strings(picked, &at, cfg.rollout.stop)?,
        max_new_tokens: Some(cfg.eval.max_new_tokens),
        questions,
        golds: None,
        prompt: Some(task_prompt_text(&cfg.task)),
        correct,
    })
}

/// The stop strings an eval row logged. A row without them stopped at none where its run's `rule` has none
/// (every run before `rollout.stop`); under `"template"` they are not known (`None`: not compared).
fn logged_stop_strings(
    row: &serde_json::Value,
    at: &str,
    rule: RolloutStop,
) -> anyhow::Result<Option<Vec<String>>> {
    match row.get(names::EVAL_STOP_STRINGS) {
        None if rule == RolloutStop::EndTokens => Ok(Some(Vec::new())),
        None => Ok(None),
        Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|_| {
            anyhow::anyhow!(
                "{at} has `{}` = {v}, not a list of strings",
                names::EVAL_STOP_STRINGS
            )
        }),
    }
}
