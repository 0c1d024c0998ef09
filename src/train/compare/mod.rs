//! Greedy evaluations of two arms on the same problems, read back from what qarl wrote and compared by
//! problem (`qarl compare`): the statistics of an experiment's report (`train::paired`) for evaluations the
//! report does not hold, such as a run's final model evaluated again in another precision with
//! `qarl eval --output`.
//!
//! An evaluation is either a `qarl eval --output` file (it lists each problem's question and outcome) or a
//! training run's held-out evaluation (a row of its `metrics.jsonl`; the questions come from the run's own
//! config, through the task that chose them). Every evaluation must list the same questions in the same
//! order: outcomes are only paired where they answer the same problem, so anything else is an error that
//! names the two evaluations and the first problem where they part.

mod arms;
mod checks;
mod prompt;
mod read;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use anyhow::bail;

pub use arms::{compare_arms, Arm};
pub use checks::{check_identical, check_same_problems};
pub use prompt::{prompt_switches, prompt_text};

/// Which of a run's held-out evaluations: the first (before RL), the last, the one logged at a step, or
/// (a run named without `@`) the one at the run's end, `train.steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalRow {
    First,
    Last,
    Step(u64),
    /// The evaluation after the run's last step: a run still training, or stopped before its end, has
    /// none, and is refused rather than represented by an earlier evaluation (its step-0 one, before RL,
    /// pooled as a seed of the trained models).
    Final,
}

impl std::fmt::Display for EvalRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvalRow::First => f.write_str("first"),
            EvalRow::Last => f.write_str("last"),
            EvalRow::Step(s) => write!(f, "at step {s}"),
            EvalRow::Final => f.write_str("at the run's end"),
        }
    }
}

/// One evaluation: where it came from, its problems and each problem's greedy outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The source as the user named it (a file, or `RUN_DIR@ROW`), for messages.
    pub source: String,
    /// What was read, however it was named: the canonical path (with a run's step), so that one
    /// evaluation given twice under two spellings (`run`, `./run/`) is recognised as one.
    pub identity: String,
    /// A hash of what was read (an eval file's bytes, a run's evaluation row): equal for a copy of one
    /// evaluation under another name, which would count as a second seed.
    pub content: u64,
    /// The precision it was evaluated in, where known (`qarl eval` files record it since it was written).
    pub precision: Option<String>,
    /// The activations' type it ran in, where known (`f32`, `bf16`, `f16`).
    pub activations: Option<String>,
    pub questions: Vec<String>,
    /// How answers were judged (`answer_from`, `truncated`), where the source records it: outcomes judged
    /// under other rules are not one measurement.
    pub verify: Option<serde_json::Value>,
    /// The strings that ended its responses besides the model's end tokens, where the source records them
    /// (a run's config, `rollout.stop`; `qarl eval` files since 2026-12-06): a response that runs on past
    /// its answer is scored on other text where one stopped it and the other did not.
    pub stop_strings: Option<Vec<String>>,
    /// The most tokens a response could have, where the source records it (a run's `eval.max_new_tokens`;
    /// `qarl eval --max-new-tokens` in files written since 2026-12-06): an answer the shorter limit cut off
    /// is no answer there.
    pub max_new_tokens: Option<usize>,
    /// Each problem's gold answer, where the source records them (`qarl eval` files): two evaluations of
    /// one question against other golds are of two data sets.
    pub golds: Option<Vec<String>>,
    /// How its prompts were rendered ([`prompt_text`]), where the source records it (a run's task;
    /// `qarl eval` files since 2026-12-07): one arm's seeds must answer the same prompts.
    pub prompt: Option<String>,
    pub correct: Vec<bool>,
}

impl Evaluation {
    /// Reads `spec`: a `qarl eval --output` file, or a run directory with an optional `@first`, `@last`
    /// (default) or `@STEP`. A run's outcomes are those of `precision` (`eval/<precision>/greedy_correct`),
    /// by default the run's rollout precision; an eval file that records another precision is refused.
    pub fn load(spec: &str, precision: Option<&str>) -> anyhow::Result<Self> {
        let (path, row) = split_spec(spec)?;
        if path.is_dir() {
            read::run_evaluation(&path, row, precision)
        } else {
            read::eval_output(spec, &path, precision)
        }
    }

    pub fn accuracy(&self) -> f64 {
        super::paired::accuracy(&self.correct)
    }
}

/// `PATH` or `PATH@ROW`; a path that exists as written wins over the `@` reading (a file named `a@b`).
fn split_spec(spec: &str) -> anyhow::Result<(PathBuf, EvalRow)> {
    if Path::new(spec).exists() {
        return Ok((PathBuf::from(spec), EvalRow::Final));
    }
    let Some((path, row)) = spec.rsplit_once('@') else {
        bail!("{spec}: no such file or directory");
    };
    let row = match row {
        "first" => EvalRow::First,
        "last" => EvalRow::Last,
        step => EvalRow::Step(step.parse().map_err(|_| {
            anyhow::anyhow!("{spec}: `@{step}`: expected `@first`, `@last` or a step number")
        })?),
    };
    if !Path::new(path).is_dir() {
        bail!("{spec}: `{path}` is not a run directory (`@first`, `@last` and `@STEP` select a run's evaluation)");
    }
    Ok((PathBuf::from(path), row))
}

/// `path` with links and `.`/`..` resolved (as given where it cannot be), for [`Evaluation::identity`].
fn canonical(path: &Path) -> String {
    std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}
