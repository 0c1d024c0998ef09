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

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Deserialize;

use super::config::RolloutStop;
use super::metrics::{read_rows, BadLines};
use super::paired::{ArmComparison, ClusteredMean};
use super::TrainConfig;
use crate::rl::metrics::names;
use crate::tasks::Task;

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
            run_evaluation(&path, row, precision)
        } else {
            eval_output(spec, &path, precision)
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

/// How prompts were rendered, in words: the template (`chat`: the model's own, `chatml`, `plain`, or a
/// plain template's prefixes, `arithmetic`'s own), with the system turn and `enable_thinking` where set.
pub fn prompt_text(template: &str, system: Option<&str>, enable_thinking: Option<bool>) -> String {
    format!("{template}{}", prompt_switches(system, enable_thinking))
}

/// A chat template's switches in words, where set: `, system "..."` and `, enable_thinking false`.
pub fn prompt_switches(system: Option<&str>, enable_thinking: Option<bool>) -> String {
    let mut text = String::new();
    if let Some(s) = system {
        text.push_str(&format!(", system {s:?}"));
    }
    if let Some(t) = enable_thinking {
        text.push_str(&format!(", enable_thinking {t}"));
    }
    text
}

/// [`prompt_text`] of a run's task: a chat template with `model_dir` is the model's own (`qarl eval
/// --template chat`), without it ChatML.
fn task_prompt_text(task: &crate::tasks::TaskConfig) -> String {
    use crate::tasks::template::{PlainTemplate, TemplateConfig};
    use crate::tasks::TaskConfig;
    match task {
        TaskConfig::Arithmetic(_) => "arithmetic".into(),
        TaskConfig::Gsm8k(d) | TaskConfig::Math(d) => match &d.template {
            TemplateConfig::Plain(p) => {
                let default: PlainTemplate = serde_json::from_value(serde_json::json!({}))
                    .expect("a plain template's fields all default");
                if *p == default {
                    "plain".into()
                } else {
                    format!("plain {:?} ... {:?}", p.question_prefix, p.answer_prefix)
                }
            }
            TemplateConfig::Chat(c) => prompt_text(
                if c.model_dir.is_some() {
                    "chat"
                } else {
                    "chatml"
                },
                c.system.as_deref(),
                c.enable_thinking,
            ),
        },
    }
}

/// `path` with links and `.`/`..` resolved (as given where it cannot be), for [`Evaluation::identity`].
fn canonical(path: &Path) -> String {
    std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}

/// A `qarl eval --output` file; refused when it records another precision than an asked one.
fn eval_output(spec: &str, path: &Path, precision: Option<&str>) -> anyhow::Result<Evaluation> {
    let (out, text): (EvalOutput, String) = crate::io::read_json_and_text(path).map_err(|e| {
        anyhow::anyhow!("{e:#} (expected a `qarl eval --output` file: `problems` with `question` and `correct`)")
    })?;
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
        .filter(|&a| !super::paired::accuracy_agrees(a, &correct))
    {
        bail!(
            "{}: its summary's accuracy {acc} is not that of its problems' outcomes ({}): the file was \
             changed after `qarl eval` wrote it",
            path.display(),
            super::paired::accuracy(&correct)
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
fn run_evaluation(dir: &Path, row: EvalRow, precision: Option<&str>) -> anyhow::Result<Evaluation> {
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
    .with_context(|| format!("{}: no held-out evaluation ({row})", metrics.display()))?;
    let key = format!("eval/{precision}/greedy_correct");
    let step = picked["step"]
        .as_u64()
        .map_or("?".into(), |s| s.to_string());
    let at = format!("{}: the evaluation at step {step}", metrics.display());
    let correct = match picked.get(key.as_str()) {
        None => bail!("{at} has no `{key}`"),
        Some(v) => v
            .as_str()
            .and_then(super::paired::decode)
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
                .judging_rules_of(super::metrics::verifier_version_of(picked)),
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

/// Fails unless every evaluation lists the first one's questions in its order; names the first evaluation
/// that differs and the first problem where they part.
pub fn check_same_problems(evals: &[&Evaluation]) -> anyhow::Result<()> {
    let Some(first) = evals.first() else {
        return Ok(());
    };
    for e in &evals[1..] {
        let shared = e.questions.len().min(first.questions.len());
        if let Some(i) = (0..shared).find(|&i| e.questions[i] != first.questions[i]) {
            bail!(
                "{} and {} list different problems: problem {} is {:?} in the first and {:?} in the second",
                first.source,
                e.source,
                i + 1,
                first.questions[i],
                e.questions[i]
            );
        }
        if e.questions.len() != first.questions.len() {
            bail!(
                "{} has {} problems, {} has {} (the first {shared} agree): not the same problems",
                first.source,
                first.questions.len(),
                e.source,
                e.questions.len()
            );
        }
    }
    check_same_golds(evals)?;
    check_same_verifier(evals)?;
    check_same_stops(evals)?;
    check_same_token_limit(evals)
}

/// Fails where two evaluations that record their responses' token limit had different ones.
fn check_same_token_limit(evals: &[&Evaluation]) -> anyhow::Result<()> {
    if let Some(((first, a), (e, b))) = first_disagreement(evals, |e| e.max_new_tokens.as_ref()) {
        bail!(
            "{} let its responses run to {a} tokens and {} to {b}: an answer the shorter limit cut off is \
             no answer there (`qarl eval --max-new-tokens`, a run's `eval.max_new_tokens`)",
            first.source,
            e.source
        );
    }
    Ok(())
}

/// Fails where two evaluations that record where their responses stopped stopped them at other strings.
fn check_same_stops(evals: &[&Evaluation]) -> anyhow::Result<()> {
    if let Some(((first, a), (e, b))) = first_disagreement(evals, |e| e.stop_strings.as_ref()) {
        bail!(
            "{} stopped its responses at {a:?} and {} at {b:?} besides the end tokens: a response that runs \
             on past its answer is scored on other text (`qarl eval --stop`, a run's `rollout.stop`)",
            first.source,
            e.source
        );
    }
    Ok(())
}

/// Fails where two evaluations that record how they judged answers judged them differently.
fn check_same_verifier(evals: &[&Evaluation]) -> anyhow::Result<()> {
    if let Some(((first, v), (e, w))) = first_disagreement(evals, |e| e.verify.as_ref()) {
        bail!(
            "{} and {} judged answers under different rules ({v} and {w}): outcomes of two verifiers",
            first.source,
            e.source
        );
    }
    Ok(())
}

/// Two evaluations with the values they record ([`first_disagreement`]).
type Disagreement<'e, T> = ((&'e Evaluation, &'e T), (&'e Evaluation, &'e T));

/// The first evaluation that records `what` and the first one after it that records another value, each
/// with its value; evaluations that record nothing are passed over.
fn first_disagreement<'e, T: PartialEq>(
    evals: &[&'e Evaluation],
    what: impl Fn(&'e Evaluation) -> Option<&'e T>,
) -> Option<Disagreement<'e, T>> {
    let mut recorded = evals.iter().filter_map(|&e| what(e).map(|v| (e, v)));
    let first = recorded.next()?;
    recorded
        .find(|(_, v)| *v != first.1)
        .map(|other| (first, other))
}

/// Fails where two evaluations that record gold answers give one problem different golds.
fn check_same_golds(evals: &[&Evaluation]) -> anyhow::Result<()> {
    let with_golds: Vec<(&Evaluation, &Vec<String>)> = evals
        .iter()
        .filter_map(|e| e.golds.as_ref().map(|g| (*e, g)))
        .collect();
    let Some((first, golds)) = with_golds.first() else {
        return Ok(());
    };
    for (e, other) in &with_golds[1..] {
        if let Some(i) = (0..golds.len().min(other.len())).find(|&i| golds[i] != other[i]) {
            bail!(
                "{} and {} grade problem {} ({:?}) against different gold answers ({:?} and {:?}): \
                 evaluations of two data sets",
                first.source,
                e.source,
                i + 1,
                first.questions[i],
                golds[i],
                other[i]
            );
        }
    }
    Ok(())
}

/// One arm: a name and one evaluation per seed.
pub struct Arm<'a> {
    pub name: &'a str,
    pub seeds: &'a [Evaluation],
}

impl Arm<'_> {
    fn outcomes(&self) -> Vec<Vec<bool>> {
        self.seeds.iter().map(|e| e.correct.clone()).collect()
    }

    /// `name (n seeds, int4-g32): per seed 0.560 0.415; 0.488 ± 0.031 over 193 problems`.
    fn summary(&self) -> String {
        let per_seed: Vec<String> = self
            .seeds
            .iter()
            .map(|e| format!("{:.3}", e.accuracy()))
            .collect();
        let c = ClusteredMean::new(&self.outcomes());
        let clustered = c.map_or_else(String::new, |c| {
            format!(
                "; {:.3} ± {} over {} problems",
                c.mean,
                super::paired::se_text(c.se),
                c.problems
            )
        });
        let mut precisions: Vec<String> = self
            .seeds
            .iter()
            .map(|e| {
                let precision = e.precision.as_deref().unwrap_or("precision not recorded");
                match e.activations.as_deref() {
                    Some(a) if a != "f32" => format!("{precision} with {a} activations"),
                    _ => precision.to_string(),
                }
            })
            .collect();
        // Each precision once, in the order of the seeds (`dedup` alone keeps `a / b / a`).
        let mut seen = std::collections::BTreeSet::new();
        precisions.retain(|p| seen.insert(p.clone()));
        format!(
            "{} ({} seed{}, {}): per seed {}{clustered}",
            self.name,
            self.seeds.len(),
            if self.seeds.len() == 1 { "" } else { "s" },
            precisions.join(" / "),
            per_seed.join(" ")
        )
    }
}

/// Both arms' accuracies and their difference paired by problem (`report.md`'s statistics), as text; fails
/// when the evaluations are not over the same problems. `fixed_b`: B is one fixed model (the warm start),
/// not a training seed, so only A's seeds add to the error ([`ArmComparison::against_fixed`]).
pub fn compare_arms(a: &Arm, b: &Arm, fixed_b: bool) -> anyhow::Result<String> {
    let all: Vec<&Evaluation> = a.seeds.iter().chain(b.seeds).collect();
    if a.seeds.is_empty() || b.seeds.is_empty() {
        bail!("each arm needs at least one evaluation");
    }
    check_same_problems(&all)?;
    if fixed_b && b.seeds.len() != 1 {
        bail!(
            "B is one fixed model, but it has {} evaluations",
            b.seeds.len()
        );
    }
    for arm in [a, b] {
        let seeds: Vec<&Evaluation> = arm.seeds.iter().collect();
        if let Some(((first, x), (e, y))) = first_disagreement(&seeds, |e| e.prompt.as_ref()) {
            bail!(
                "{} and {}, seeds of {}, were prompted differently ({x} and {y}): one arm's seeds answer \
                 the same prompts",
                first.source,
                e.source,
                arm.name
            );
        }
    }
    let (oa, ob) = (a.outcomes(), b.outcomes());
    let c = if fixed_b {
        ArmComparison::against_fixed(&oa, &ob)
    } else {
        ArmComparison::new(&oa, &ob)
    }
    .context("the evaluations cover different numbers of problems")?;
    let mut out = String::new();
    writeln!(out, "{}", a.summary())?;
    writeln!(out, "{}", b.summary())?;
    let prompt = |arm: &Arm| arm.seeds.iter().find_map(|e| e.prompt.clone());
    if let (Some(x), Some(y)) = (prompt(a), prompt(b)) {
        if x != y {
            // A comparison of prompts, or a mistake: either way the reader must see it.
            writeln!(
                out,
                "prompted differently: {} with {x}; {} with {y}",
                a.name, b.name
            )?;
        }
    }
    write!(
        out,
        "{} − {}: {} over problems",
        a.name,
        b.name,
        c.problems_text()
    )?;
    if let Some(both) = c.problems_and_seeds_text() {
        write!(out, "; with seeds {both}")?;
    }
    Ok(out)
}

/// Fails unless every evaluation has the first one's outcome on every problem: two runs of one protocol
/// (e.g. a command that should reproduce a run's own evaluation) agree problem by problem.
pub fn check_identical(evals: &[&Evaluation]) -> anyhow::Result<()> {
    check_same_problems(evals)?;
    let Some(first) = evals.first() else {
        return Ok(());
    };
    for e in &evals[1..] {
        let differ: Vec<usize> = (0..e.correct.len())
            .filter(|&i| e.correct[i] != first.correct[i])
            .map(|i| i + 1)
            .collect();
        if !differ.is_empty() {
            bail!(
                "{} and {} differ on {} problem(s) (first: problem {}): not the same protocol",
                first.source,
                e.source,
                differ.len(),
                differ[0]
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::{DatasetConfig, TaskConfig};

    const QUESTIONS: [&str; 4] = ["1 + 1?", "2 + 2?", "3 + 3?", "4 + 4?"];

    /// [`compare_arms`] of two arms given as (name, evaluations).
    fn compare(
        a: (&str, &[Evaluation]),
        b: (&str, &[Evaluation]),
        fixed_b: bool,
    ) -> anyhow::Result<String> {
        compare_arms(
            &Arm {
                name: a.0,
                seeds: a.1,
            },
            &Arm {
                name: b.0,
                seeds: b.1,
            },
            fixed_b,
        )
    }

    /// A run directory whose task holds out `QUESTIONS` (a data file of its own), with two evaluations:
    /// step 0 in int4 and f32 (without the questions' fingerprint, as logs before it), step 40 in int4 only.
    fn write_run(dir: &Path, first: &str, last: &str) {
        std::fs::create_dir_all(dir).unwrap();
        let questions: Vec<String> = QUESTIONS.iter().map(|q| q.to_string()).collect();
        let data = dir.join("data.jsonl");
        let lines: Vec<String> = QUESTIONS
            .iter()
            .map(|q| serde_json::json!({"question": q, "answer": "#### 2"}).to_string())
            .collect();
        std::fs::write(&data, lines.join("\n")).unwrap();
        let mut cfg =
            TrainConfig::from_toml(super::super::config::DEFAULT_CONFIG, "default").unwrap();
        cfg.task = TaskConfig::Gsm8k(DatasetConfig {
            path: dir.join("train.jsonl"),
            eval_path: Some(data),
            eval_fraction: None,
            template: Default::default(),
            on_bad_line: Default::default(),
            strip_calculator_annotations: true,
        });
        std::fs::write(
            dir.join("train.jsonl"),
            serde_json::json!({"question": "9 + 9?", "answer": "#### 18"}).to_string(),
        )
        .unwrap();
        cfg.eval.problems = 200;
        // Its last evaluation (below) is the one at its end.
        cfg.train.steps = 40;
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string(&cfg).unwrap(),
        )
        .unwrap();
        let rows = [
            serde_json::json!({"phase": "eval", "step": 0, "eval/int4-g32/greedy_correct": first,
                "eval/f32/greedy_correct": "1111"}),
            serde_json::json!({"phase": "rl", "step": 1}),
            serde_json::json!({"phase": "eval", "step": 40, "eval/int4-g32/greedy_correct": last,
                "eval/questions_fingerprint": crate::tasks::questions_fingerprint(&questions)}),
        ];
        let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
        // The last line cut short, as a run killed while writing leaves it.
        let text = text.join("\n") + "\n{\"phase\": \"rl\", \"st";
        std::fs::write(dir.join("metrics.jsonl"), text).unwrap();
    }

    /// A `qarl eval --output` file over `questions` with these outcomes.
    fn write_eval(path: &Path, questions: &[&str], correct: &str) {
        write_eval_in(path, questions, correct, None);
    }

    /// [`write_eval`] whose summary records `precision`.
    fn write_eval_in(path: &Path, questions: &[&str], correct: &str, precision: Option<&str>) {
        let problems: Vec<serde_json::Value> = questions
            .iter()
            .zip(correct.chars())
            .map(|(q, c)| serde_json::json!({"question": q, "correct": c == '1', "response": "x"}))
            .collect();
        let out = serde_json::json!({"summary": {"precision": precision}, "problems": problems});
        std::fs::write(path, out.to_string()).unwrap();
    }

    #[test]
    fn a_runs_evaluations_are_read_by_row_and_precision_with_its_tasks_questions() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        write_run(&run, "0100", "1101");
        let spec = run.display().to_string();
        let last = Evaluation::load(&spec, None).unwrap();
        assert_eq!(last.correct, [true, true, false, true]);
        assert_eq!(last.questions, QUESTIONS);
        let first = Evaluation::load(&format!("{spec}@first"), None).unwrap();
        assert_eq!(first.correct, [false, true, false, false]);
        assert_eq!(Evaluation::load(&format!("{spec}@40"), None).unwrap(), last);
        let f32 = Evaluation::load(&format!("{spec}@0"), Some("f32")).unwrap();
        assert_eq!(f32.correct, [true; 4]);
        let err =
            |s: String, p: Option<&str>| format!("{:#}", Evaluation::load(&s, p).unwrap_err());
        assert!(err(format!("{spec}@7"), None).contains("no held-out evaluation (at step 7)"));
        assert!(err(format!("{spec}@later"), None)
            .contains("expected `@first`, `@last` or a step number"));
        assert!(err(spec.clone(), Some("f32")).contains("has no `eval/f32/greedy_correct`"));
        // A value that is there but no outcome string is named as such, not as missing.
        let metrics = run.join("metrics.jsonl");
        let text = std::fs::read_to_string(&metrics).unwrap();
        std::fs::write(&metrics, text.replace("\"1101\"", "\"0x10\"")).unwrap();
        assert!(err(spec.clone(), None)
            .contains("has `eval/int4-g32/greedy_correct` = \"0x10\", not an outcome string"));
        std::fs::write(&metrics, text).unwrap();
        // A run without the evaluation at its end (still training, or stopped early: here `train.steps`
        // is past its last evaluation) is refused under its bare name, not represented by an earlier
        // evaluation; named by row, it is taken.
        let config = run.join("config.json");
        let saved = std::fs::read_to_string(&config).unwrap();
        let mut cfg: serde_json::Value = serde_json::from_str(&saved).unwrap();
        cfg["train"]["steps"] = 60.into();
        std::fs::write(&config, cfg.to_string()).unwrap();
        let refused = err(spec.clone(), None);
        assert!(
            refused.contains("no evaluation at the run's end (step 60")
                && refused.contains("its last is at step 40")
                && refused.contains(&format!("{spec}@40")),
            "{refused}"
        );
        assert_eq!(
            Evaluation::load(&format!("{spec}@last"), None).unwrap(),
            last
        );
        std::fs::write(&config, saved).unwrap();
        assert!(err(format!("{spec}/missing.json"), None).contains("no such file"));
        std::fs::create_dir_all(tmp.path().join("empty")).unwrap();
        let empty = tmp.path().join("empty").display().to_string();
        assert!(err(empty, None).contains("not a run directory (no config.json)"));
    }

    #[test]
    fn a_run_whose_questions_changed_since_its_evaluation_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        write_run(&run, "0100", "1101");
        let spec = run.display().to_string();
        Evaluation::load(&spec, None).unwrap();
        // The same number of held-out problems, one question edited.
        let edited: Vec<String> = ["1 + 1?", "2 + 2?", "3 + 30?", "4 + 4?"]
            .iter()
            .map(|q| serde_json::json!({"question": q, "answer": "#### 2"}).to_string())
            .collect();
        std::fs::write(run.join("data.jsonl"), edited.join("\n")).unwrap();
        let e = format!("{:#}", Evaluation::load(&spec, None).unwrap_err());
        assert!(
            e.contains("step 40 logged questions") && e.contains("data files changed"),
            "{e}"
        );
        // The step-0 row logged no fingerprint (an older log): only the count can be checked.
        let first = Evaluation::load(&format!("{spec}@first"), None).unwrap();
        assert_eq!(first.questions[2], "3 + 30?");
    }

    #[test]
    fn an_eval_file_in_another_precision_than_asked_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("e.json");
        write_eval_in(&path, &QUESTIONS, "0100", Some("int4-g32"));
        let spec = path.display().to_string();
        let e = Evaluation::load(&spec, Some("int4-g32")).unwrap();
        assert_eq!(e.precision.as_deref(), Some("int4-g32"));
        let err = format!("{:#}", Evaluation::load(&spec, Some("f32")).unwrap_err());
        assert!(
            err.contains("an evaluation in int4-g32, but --precision asks for f32"),
            "{err}"
        );
    }

    #[test]
    fn arms_are_compared_by_problem_with_the_reports_statistics() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        write_run(&run, "0100", "1101");
        let (e1, e2) = (tmp.path().join("e1.json"), tmp.path().join("e2.json"));
        write_eval(&e1, &QUESTIONS, "0100");
        write_eval(&e2, &QUESTIONS, "0000");
        let load = |p: &Path| Evaluation::load(&p.display().to_string(), None).unwrap();
        let (a, b) = ([load(&run)], [load(&e1), load(&e2)]);
        // B per problem: [0, .5, 0, 0]; A - B = [1, .5, 0, 1], mean 0.625, sample variance
        // (0.140625 + 0.015625 + 0.390625 + 0.140625) / 3 = 0.229167, SE sqrt(0.229167 / 4) = 0.239. One
        // seed against two: the paired t-test, t = 0.625 / 0.239 on 3 degrees of freedom, p = 0.0796
        // (scipy's ttest_1samp).
        let text = compare(("run", &a), ("evals", &b), false).unwrap();
        assert!(
            text.contains("run (1 seed, int4-g32): per seed 0.750"),
            "{text}"
        );
        assert!(
            text.contains(
                "evals (2 seeds, precision not recorded): per seed 0.250 0.000; 0.125 ± 0.125 over 4 problems"
            ),
            "{text}"
        );
        assert!(
            text.contains("run − evals: +0.625 ± 0.239 (3 vs 0 problems; t-test p 8.0e-2)"),
            "{text}"
        );
        assert!(
            !text.contains("with seeds"),
            "one seed of A: no seed spread: {text}"
        );
        // B one fixed model: A's seeds [0.25, 0] alone give sd 0.177 / sqrt(2) = 0.125; d = [-1, -.5, 0, -1],
        // SE over problems 0.239 as above; together sqrt(0.0573 + 0.0156) = 0.270.
        let fixed = compare(("evals", &b), ("run", &a), true).unwrap();
        assert!(
            fixed.contains("with seeds -0.625 ± 0.270 (2 vs 1 seeds; seeds alone ± 0.125)"),
            "{fixed}"
        );
        let e = compare(("run", &a), ("evals", &b), true).unwrap_err();
        assert!(
            e.to_string().contains("one fixed model, but it has 2"),
            "{e}"
        );
        // The warm start's evaluation reproduced by another command: identical; the last one is not.
        check_identical(&[
            &load(&e1),
            &Evaluation::load(&format!("{}@first", run.display()), None).unwrap(),
        ])
        .unwrap();
        let e = check_identical(&[&load(&e1), &load(&run)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("differ on 2 problem(s) (first: problem 1)"),
            "{e}"
        );
    }

    #[test]
    fn evaluations_of_other_problems_are_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let (e1, e2, e3) = (
            tmp.path().join("e1.json"),
            tmp.path().join("e2.json"),
            tmp.path().join("e3.json"),
        );
        write_eval(&e1, &QUESTIONS, "0100");
        write_eval(&e2, &["1 + 1?", "2 + 2?", "5 + 5?", "4 + 4?"], "0100");
        write_eval(&e3, &QUESTIONS[..3], "010");
        let load = |p: &Path| Evaluation::load(&p.display().to_string(), None).unwrap();
        let arm = |e: &[Evaluation]| compare(("a", &e[..1]), ("b", &e[1..]), false);
        let e = arm(&[load(&e1), load(&e2)]).unwrap_err().to_string();
        assert!(
            e.contains("list different problems: problem 3 is \"3 + 3?\""),
            "{e}"
        );
        let e = arm(&[load(&e1), load(&e3)]).unwrap_err().to_string();
        assert!(
            e.contains("has 4 problems") && e.contains("has 3 (the first 3 agree)"),
            "{e}"
        );
        std::fs::write(&e3, "{\"rows\": []}").unwrap();
        let e = format!(
            "{:#}",
            Evaluation::load(&e3.display().to_string(), None).unwrap_err()
        );
        assert!(
            e.contains("e3.json") && e.contains("expected a `qarl eval --output` file"),
            "{e}"
        );
    }

    /// How the prompts were rendered, where recorded: one arm's seeds prompted differently are refused
    /// (they were pooled as seeds of one measurement), and two arms prompted differently are compared
    /// with a line that says so.
    #[test]
    fn prompts_are_one_per_arm_and_shown_where_arms_differ() {
        let tmp = tempfile::tempdir().unwrap();
        let write = |name: &str, summary: serde_json::Value| {
            let path = tmp.path().join(name);
            let problems: Vec<serde_json::Value> = [("1 + 1?", true), ("2 + 2?", false)]
                .iter()
                .map(|(q, c)| serde_json::json!({"question": q, "correct": c}))
                .collect();
            std::fs::write(
                &path,
                serde_json::json!({"summary": summary, "problems": problems}).to_string(),
            )
            .unwrap();
            Evaluation::load(&path.display().to_string(), None).unwrap()
        };
        let chat = write("chat.json", serde_json::json!({"template": "chat"}));
        let system = write(
            "sys.json",
            serde_json::json!({"template": "chat", "system": "Be brief."}),
        );
        let plain = write("plain.json", serde_json::json!({"template": "plain"}));
        let old = write("old.json", serde_json::json!({}));
        assert_eq!(system.prompt.as_deref(), Some("chat, system \"Be brief.\""));
        let e = compare(
            ("a", &[chat.clone(), system]),
            ("b", std::slice::from_ref(&plain)),
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(
                "seeds of a, were prompted differently (chat and chat, system \"Be brief.\")"
            ),
            "{e}"
        );
        let text = compare(("a", &[chat.clone(), old]), ("b", &[plain]), false).unwrap();
        assert!(
            text.contains("prompted differently: a with chat; b with plain"),
            "{text}"
        );
        let same = compare(
            ("a", std::slice::from_ref(&chat)),
            ("b", std::slice::from_ref(&chat)),
            false,
        );
        assert!(!same.unwrap().contains("prompted differently"));
    }

    /// What an eval file records beside its outcomes is read: golds that differ between evaluations of one
    /// question (two data sets), a summary accuracy its outcomes contradict (an edited file), and the
    /// activations, which the arm's label shows.
    #[test]
    fn eval_files_are_checked_against_what_they_record() {
        let tmp = tempfile::tempdir().unwrap();
        let write = |name: &str, golds: [&str; 2], accuracy: f64, activations: &str| {
            let path = tmp.path().join(name);
            let problems: Vec<serde_json::Value> =
                [("1 + 1?", golds[0], true), ("2 + 2?", golds[1], false)]
                    .iter()
                    .map(|(q, g, c)| serde_json::json!({"question": q, "gold": g, "correct": c}))
                    .collect();
            let summary = serde_json::json!({"precision": "int4-g32", "activations": activations,
                "accuracy": accuracy});
            std::fs::write(
                &path,
                serde_json::json!({"summary": summary, "problems": problems}).to_string(),
            )
            .unwrap();
            path.display().to_string()
        };
        let a = Evaluation::load(&write("a.json", ["2", "4"], 0.5, "f32"), None).unwrap();
        let b = Evaluation::load(&write("b.json", ["2", "5"], 0.5, "bf16"), None).unwrap();
        let e = compare(("a", std::slice::from_ref(&a)), ("b", &[b]), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "grade problem 2 (\"2 + 2?\") against different gold answers (\"4\" and \"5\")"
            ),
            "{e}"
        );
        let e = format!(
            "{:#}",
            Evaluation::load(&write("c.json", ["2", "4"], 1.0, "f32"), None).unwrap_err()
        );
        assert!(
            e.contains(
                "c.json: its summary's accuracy 1 is not that of its problems' outcomes (0.5)"
            ),
            "{e}"
        );
        // So is a problem count the list contradicts (a summary edited to -1, or a list cut short).
        for count in [serde_json::json!(-1), serde_json::json!(3)] {
            let path = tmp.path().join("counted.json");
            let mut doc: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(tmp.path().join("a.json")).unwrap())
                    .unwrap();
            doc["summary"]["problems"] = count.clone();
            std::fs::write(&path, doc.to_string()).unwrap();
            let e = format!(
                "{:#}",
                Evaluation::load(&path.display().to_string(), None).unwrap_err()
            );
            assert!(
                e.contains(&format!("its summary counts {count} problems but lists 2")),
                "{e}"
            );
        }
        // Outcomes judged under other verifier rules are two measurements.
        let mut strict = a.clone();
        strict.source = "strict.json".into();
        strict.identity = "strict.json".into();
        strict.verify = Some(serde_json::json!({"answer_from": "marked", "truncated": "scored"}));
        let mut flexible = a.clone();
        flexible.verify = Some(serde_json::json!({"answer_from": "any", "truncated": "scored"}));
        let e = compare(("a", &[flexible]), ("b", &[strict]), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("judged answers under different rules"), "{e}");
        // So are responses stopped at other strings; a source that does not record them is not refused.
        let mut stopped = a.clone();
        stopped.source = "stopped.json".into();
        stopped.identity = "stopped.json".into();
        stopped.stop_strings = Some(vec!["\nQuestion:".into()]);
        let mut unstopped = a.clone();
        unstopped.stop_strings = Some(vec![]);
        let e = compare(
            ("a", &[unstopped.clone()]),
            ("b", &[stopped.clone()]),
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("stopped.json at [\"\\nQuestion:\"]") && e.contains("a.json stopped"),
            "{e}"
        );
        let mut unrecorded = stopped.clone();
        unrecorded.stop_strings = None;
        assert!(compare(("a", &[unstopped]), ("b", &[unrecorded]), false).is_ok());
        // And responses allowed other token limits; a source that does not record its limit is not refused.
        let mut short = a.clone();
        short.source = "short.json".into();
        short.identity = "short.json".into();
        short.max_new_tokens = Some(4);
        let mut long = a.clone();
        long.max_new_tokens = Some(8);
        let e = compare(("a", &[long.clone()]), ("b", &[short.clone()]), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("to 8 tokens and short.json to 4"), "{e}");
        short.max_new_tokens = None;
        assert!(compare(("a", &[long]), ("b", &[short]), false).is_ok());
        let bf16 = Evaluation::load(&write("d.json", ["2", "4"], 0.5, "bf16"), None).unwrap();
        let text = compare(("a", &[a]), ("b", &[bf16]), false).unwrap();
        assert!(
            text.contains("b (1 seed, int4-g32 with bf16 activations)"),
            "{text}"
        );
    }
}
