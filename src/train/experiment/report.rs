//! The experiment's `report.md`: accuracies and mismatch per arm over seeds, arms paired by problem, plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::checks::one_logged;
use super::{marker, ExperimentConfig, Variant};
use crate::rl::metrics::names;
use crate::train::metrics::{read_rows, BadLines};
use crate::train::paired::ArmComparison;

/// The mean and the sample standard deviation of `xs`; no deviation for a single value (undefined, not 0).
fn mean_std(xs: &[f64]) -> (f64, Option<f64>) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    let sd = (xs.len() > 1)
        .then(|| (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt());
    (m, sd)
}

/// `mean ± sd` over seeds with `prec` decimals (`prec` 99: scientific), the mean alone for one seed.
fn mean_sd_text(xs: &[f64], prec: usize) -> String {
    match (mean_std(xs), prec) {
        ((m, Some(s)), 99) => format!("{m:.2e} ± {s:.1e}"),
        ((m, None), 99) => format!("{m:.2e}"),
        ((m, Some(s)), _) => format!("{m:.prec$} ± {s:.prec$}"),
        ((m, None), _) => format!("{m:.prec$}"),
    }
}

/// A column of the mismatch table: its header and how the value is printed.
const STABILITY_COLUMNS: [(&str, &str, usize); 8] = [
    ("k3", "k3 KL", 99),
    ("err_any", "error tokens: any", 3),
    ("err_ratio", "ratio", 3),
    ("err_low", "low prob", 3),
    ("err_rep", "repetition", 3),
    ("ent", "entropy", 3),
    ("tps", "rollout tok/s", 0),
    ("step", "step s", 2),
];

/// What one finished run contributes to the report.
#[derive(Debug, Default)]
struct RunSummary {
    /// Per-seed scalars (accuracies, RL-step averages) by column.
    cols: BTreeMap<&'static str, f64>,
    /// Which held-out problems it was evaluated on; `None` when its config is unreadable or its
    /// evaluations logged different questions.
    eval_set: Option<EvalSet>,
    /// Greedy outcome per held-out problem before RL (rollout precision), at the end in the rollout
    /// precision, and at the end in f32.
    before: Option<Vec<bool>>,
    after_roll: Option<Vec<bool>>,
    after_f32: Option<Vec<bool>>,
}

/// Which held-out problems a run was evaluated on: its task and number of problems, which alone determine
/// `Task::eval_set` (the seed does not), and the questions' fingerprint its evaluations logged
/// ([`names::EVAL_QUESTIONS_FINGERPRINT`]; logs from before 2026-12-05 have none), which also tells apart
/// runs whose data files changed in between.
#[derive(Clone, Debug, PartialEq)]
struct EvalSet {
    config: String,
    fingerprint: Option<String>,
    /// The questions with their golds ([`names::EVAL_PROBLEMS_FINGERPRINT`]; logs from before 2026-12-07
    /// have none).
    problems: Option<String>,
    /// How its answers were judged: the verifier's rules, the stop rule and the token limit of the held-out
    /// evaluations (keys an older config lacks read as their defaults).
    judged: String,
}

impl EvalSet {
    /// A run's set from its config (`config.json`, read) and eval rows; `None` when the config lacks its
    /// task or evaluation settings or the rows logged different fingerprints (a run resumed over changed
    /// data: its evaluations are not of one set).
    fn of_run(cfg: &serde_json::Value, evals: &[&serde_json::Value]) -> Option<Self> {
        let problems = cfg.get("eval")?.get("problems")?;
        // Normalised as a resume compares it (`TaskConfig::with_defaults`): runs made before
        // `eval_fraction` was refused beside `eval_path` recorded the default there, later ones nothing.
        let task = crate::tasks::TaskConfig::normalized_json(cfg.get("task")?);
        let config = serde_json::json!([task, problems]).to_string();
        // As `qarl compare` reads a run's (`VerifyConfig::judging_rules`), keys an older config lacks at
        // their defaults.
        let section = |pointer: &str| {
            cfg.pointer(pointer)
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or_else(|| serde_json::json!({}))
        };
        let verify: crate::tasks::verify::VerifyConfig =
            serde_json::from_value(section("/verify")).ok()?;
        let stop: crate::train::config::RolloutStop =
            serde_json::from_value(section("/rollout/stop")).unwrap_or_default();
        // One verifier version for all its evaluations (a run resumed across a verifier change judged
        // them under two: not one set).
        let mut versions = evals
            .iter()
            .map(|r| crate::train::metrics::verifier_version_of(r));
        let version = versions
            .next()
            .unwrap_or(crate::tasks::verify::VERIFIER_VERSION);
        if versions.any(|v| v != version) {
            return None;
        }
        let judged = serde_json::json!([
            verify.judging_rules_of(version),
            stop,
            cfg.pointer("/eval/max_new_tokens"),
        ])
        .to_string();
        let fingerprint = one_logged(evals, names::EVAL_QUESTIONS_FINGERPRINT).ok()?;
        let problems = one_logged(evals, names::EVAL_PROBLEMS_FINGERPRINT).ok()?;
        Some(Self {
            config,
            fingerprint,
            problems,
            judged,
        })
    }

    /// Whether runs of these sets were evaluated on the same problems in the same order and judged alike,
    /// the condition for clustering and pairing by problem: the same task and count, the same fingerprint
    /// where both logged one, and the same verifier rules, stop rule and token limit (as `qarl compare`
    /// refuses outcomes of two verifiers).
    fn same_problems(&self, other: &Self) -> bool {
        // The problems themselves, questions and golds, where both logged them (task tables that differ
        // only where the held-out set does not depend on them, such as `path` beside an `eval_path`, hold
        // out the same problems); else their task and count, and the questions where both logged them.
        self.judged == other.judged
            && match (&self.problems, &other.problems) {
                (Some(a), Some(b)) => a == b,
                _ => {
                    self.config == other.config
                        && match (&self.fingerprint, &other.fingerprint) {
                            (Some(a), Some(b)) => a == b,
                            _ => true,
                        }
                }
            }
    }

    /// The set shared by every one of `sets` (the fingerprint any of them logged), or `None` when some
    /// set is unknown or two differ.
    fn common<'a>(mut sets: impl Iterator<Item = Option<&'a Self>>) -> Option<Self> {
        let mut common = sets.next()??.clone();
        for set in sets {
            let set = set?;
            if !common.same_problems(set) {
                return None;
            }
            common.fingerprint = common.fingerprint.or_else(|| set.fingerprint.clone());
            common.problems = common.problems.or_else(|| set.problems.clone());
        }
        Some(common)
    }
}

/// `eval/<precision>/<suffix>` of an eval row: the rollout precision's (`f32_view` false) or f32's, else
/// whichever there is (an f32 run has only f32's, which is then both).
fn eval_entry<'a>(
    row: &'a serde_json::Value,
    suffix: &str,
    f32_view: bool,
) -> Option<&'a serde_json::Value> {
    row.as_object()?
        .iter()
        .filter(|(k, _)| k.starts_with("eval/") && k.ends_with(suffix))
        .min_by_key(|(k, _)| k.starts_with("eval/f32/") != f32_view)
        .map(|(_, v)| v)
}

/// Per-problem greedy outcomes of an eval row (`eval/<precision>/greedy_correct`).
fn greedy_outcomes(row: &serde_json::Value, f32_view: bool) -> Option<Vec<bool>> {
    crate::train::paired::decode(eval_entry(row, "/greedy_correct", f32_view)?.as_str()?)
}

/// Checks what the report reads from an eval row: every accuracy (`pass@1_greedy`, `mean@k`) a number in
/// [0, 1], every outcome string (`greedy_correct`) made of `0` and `1`, and the greedy accuracy the mean
/// of its outcomes, as `qarl train` writes them. A damaged or edited metrics file is named instead of being
/// averaged into the report (an accuracy of 1.7 was, and an unreadable outcome string was dropped).
pub fn check_eval_row(path: &Path, row: &serde_json::Value) -> anyhow::Result<()> {
    let Some(entries) = row.as_object() else {
        return Ok(());
    };
    let at = || format!("{}, the eval row of step {}", path.display(), row["step"]);
    let evals = || entries.iter().filter(|(k, _)| k.starts_with("eval/"));
    for (key, v) in evals() {
        if key.ends_with("/pass@1_greedy") || key.contains("/mean@") {
            let ok = v.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x));
            anyhow::ensure!(ok, "{}: `{key}` is {v}, not an accuracy in [0, 1]", at());
        }
    }
    for (key, v) in evals() {
        if let Some(precision) = key
            .strip_prefix("eval/")
            .and_then(|k| k.strip_suffix("/greedy_correct"))
        {
            let outcomes = v.as_str().and_then(crate::train::paired::decode);
            let Some(outcomes) = outcomes else {
                anyhow::bail!("{}: `{key}` is not a string of 0s and 1s", at());
            };
            let accuracy = entries
                .get(&format!("eval/{precision}/pass@1_greedy"))
                .and_then(serde_json::Value::as_f64);
            if let Some(a) =
                accuracy.filter(|&a| !crate::train::paired::accuracy_agrees(a, &outcomes))
            {
                anyhow::bail!(
                    "{}: `eval/{precision}/pass@1_greedy` is {a} but its `greedy_correct` outcomes give {}",
                    at(),
                    crate::train::paired::accuracy(&outcomes)
                );
            }
        }
    }
    Ok(())
}

/// Mean of `key` over the RL rows that logged it; `None` when none did (a missing metric is not 0).
/// A step that logged the metric as `null` (a NaN or an infinity: JSON has no such numbers) makes the
/// average NaN, which the table prints: averaged over the other steps, a diverged step left no trace.
fn rl_average(rl: &[&serde_json::Value], key: &str) -> Option<f64> {
    let logged: Vec<&serde_json::Value> = rl.iter().filter_map(|r| r.get(key)).collect();
    if logged.iter().any(|v| v.is_null()) {
        return Some(f64::NAN);
    }
    let xs: Vec<f64> = logged.iter().filter_map(|v| v.as_f64()).collect();
    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
}

/// Reads a finished run's metrics and config.
fn summarize_run(run_dir: &Path) -> anyhow::Result<RunSummary> {
    let metrics_file = run_dir.join("metrics.jsonl");
    let rows = read_rows(&metrics_file, BadLines::TornLastOnly)?;
    let evals: Vec<&serde_json::Value> = rows.iter().filter(|r| r["phase"] == "eval").collect();
    for e in &evals {
        check_eval_row(&metrics_file, e)?;
    }
    let config_path = run_dir.join("config.json");
    let cfg: serde_json::Value = crate::io::read_json(&config_path)?;
    let mut s = RunSummary {
        eval_set: EvalSet::of_run(&cfg, &evals),
        ..RunSummary::default()
    };
    // The evaluations before RL (step 0) and at the run's end (step `train.steps`), by their steps: a
    // finished run without the one at its end would report an earlier one as its final accuracy.
    let end = cfg
        .pointer("/train/steps")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| {
            anyhow::anyhow!("{}: no `train.steps` (a step count)", config_path.display())
        })?;
    let at = |step: u64| evals.iter().find(|e| e["step"].as_u64() == Some(step));
    let Some(last) = at(end) else {
        let steps: Vec<String> = evals
            .iter()
            .filter_map(|e| e["step"].as_u64().map(|s| s.to_string()))
            .collect();
        anyhow::bail!(
            "{}: no evaluation at the run's end (step {end}, its `train.steps`), though {} marks the run \
             finished; its evaluations are at steps [{}]",
            metrics_file.display(),
            marker(run_dir).display(),
            steps.join(", ")
        );
    };
    let first = at(0);
    for (col, e, f32_view) in [
        ("acc0_roll", first, false),
        ("acc_roll", Some(last), false),
        ("acc_f32", Some(last), true),
    ] {
        if let Some(v) = e
            .and_then(|e| eval_entry(e, "/pass@1_greedy", f32_view))
            .and_then(|v| v.as_f64())
        {
            s.cols.insert(col, v);
        }
    }
    for (col, e) in [("meank0_roll", first), ("meank_roll", Some(last))] {
        if let Some(v) = e
            .and_then(|e| e.as_object())
            .and_then(|o| {
                o.iter()
                    .filter(|(k, _)| k.contains("/mean@"))
                    .min_by_key(|(k, _)| k.starts_with("eval/f32/"))
            })
            .and_then(|(_, v)| v.as_f64())
        {
            s.cols.insert(col, v);
        }
    }
    if let Some(first) = first.filter(|_| end > 0) {
        s.before = greedy_outcomes(first, false);
        s.after_roll = greedy_outcomes(last, false);
        s.after_f32 = greedy_outcomes(last, true);
    }
    let rl: Vec<&serde_json::Value> = rows.iter().filter(|r| r["phase"] == "rl").collect();
    let any_key = crate::train::plot::any_error_key(&rows);
    let legacy = any_key == names::LEGACY_ERROR_TOKEN_FRAC;
    for (col, key) in [
        ("k3", names::K3_KL),
        ("err_any", any_key.as_str()),
        ("err_ratio", names::RATIO_FRAC),
        // Before the criteria were reported apart, `low_prob_frac` also counted ratio errors.
        ("err_low", if legacy { "" } else { names::LOW_PROB_FRAC }),
        ("err_rep", names::REPETITION_FRAC),
        ("ent", names::ENTROPY),
        ("tps", "perf/rollout_tokens_per_s"),
        ("step", "perf/step_s"),
    ] {
        if let Some(v) = rl_average(&rl, key) {
            s.cols.insert(col, v);
        }
    }
    Ok(s)
}

/// The outcomes `pick` selects from every run, when all runs have them and were evaluated on the same
/// problems ([`EvalSet::common`]): the only case where problems can be clustered or paired.
fn shared_outcomes(
    runs: &[RunSummary],
    pick: impl Fn(&RunSummary) -> Option<&Vec<bool>>,
) -> Option<(EvalSet, Vec<Vec<bool>>)> {
    let key = EvalSet::common(runs.iter().map(|r| r.eval_set.as_ref()))?;
    let outcomes: Option<Vec<Vec<bool>>> = runs.iter().map(|r| pick(r).cloned()).collect();
    Some((key, outcomes?))
}

/// `mean ± problem-clustered SE` of an accuracy when the seeds share their problems, else `mean (sd s over
/// seeds)` from the per-seed scalars, else `-`.
fn accuracy_cell(shared: Option<&Vec<Vec<bool>>>, per_seed: &[f64]) -> String {
    if let Some(c) = shared.and_then(|o| crate::train::paired::ClusteredMean::new(o)) {
        return format!("{:.3} ± {}", c.mean, crate::train::paired::se_text(c.se));
    }
    if per_seed.is_empty() {
        return "-".into();
    }
    match mean_std(per_seed) {
        (m, Some(s)) => format!("{m:.3} (sd {s:.3} over seeds)"),
        (m, None) => format!("{m:.3} (1 seed)"),
    }
}

/// Each seed's final accuracy, rollout precision then f32 (`0.824 0.798; 0.948 0.829`), or `-`.
fn per_seed_cell(roll: &[f64], f32: &[f64]) -> String {
    if roll.is_empty() && f32.is_empty() {
        return "-".into();
    }
    let list = |xs: &[f64]| {
        xs.iter()
            .map(|x| format!("{x:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!("{}; {}", list(roll), list(f32))
}

/// The RL gain: the final outcomes against those before RL, paired by problem, or `-`. With several seeds
/// the test is the paired t-test whether the seeds share one warm start (the same outcomes before RL: its
/// copies average to itself) or not ([`crate::train::paired::PairedTest::PairedT`]).
fn rl_gain_cell(after: Option<&Vec<Vec<bool>>>, before: Option<&Vec<Vec<bool>>>) -> String {
    let Some((after, before)) = after.zip(before) else {
        return "-".into();
    };
    ArmComparison::new(after, before).map_or_else(|| "-".into(), |c| c.problems_text())
}

/// One variant's finished runs, read back.
struct VariantSummary<'a> {
    variant: &'a Variant,
    runs: Vec<RunSummary>,
    before: Option<(EvalSet, Vec<Vec<bool>>)>,
    after_roll: Option<(EvalSet, Vec<Vec<bool>>)>,
    after_f32: Option<(EvalSet, Vec<Vec<bool>>)>,
}

impl VariantSummary<'_> {
    fn column(&self, col: &str) -> Vec<f64> {
        self.runs
            .iter()
            .filter_map(|r| r.cols.get(col).copied())
            .collect()
    }
}

/// A hand-written statement, claim by claim, of what an experiment reproduces, next to its `report.md`.
pub const CLAIMS_FILE: &str = "claims.md";

/// The report from the finished runs: accuracies with problem-clustered standard errors, arms compared
/// pairwise by final accuracy paired by problem, the mismatch and stability averages, and the plots; a link
/// to [`CLAIMS_FILE`] when the results directory has one.
pub fn write_report(exp: &ExperimentConfig, results: &Path) -> anyhow::Result<PathBuf> {
    let variants: Vec<VariantSummary> = exp
        .variants
        .iter()
        .map(|v| {
            let runs = finished_runs(exp, v, results)
                .map(|d| summarize_run(&d))
                .collect::<anyhow::Result<Vec<RunSummary>>>()?;
            Ok(VariantSummary {
                variant: v,
                before: shared_outcomes(&runs, |r| r.before.as_ref()),
                after_roll: shared_outcomes(&runs, |r| r.after_roll.as_ref()),
                after_f32: shared_outcomes(&runs, |r| r.after_f32.as_ref()),
                runs,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let mut md = String::new();
    writeln!(md, "# {}\n", exp.name)?;
    if !exp.overrides.is_empty() {
        // Runs under `qarl experiment --set`: not the file's settings, and the report says so.
        let sets: Vec<String> = exp
            .overrides
            .iter()
            .map(|(k, v)| format!("`{k} = {v}`"))
            .collect();
        writeln!(
            md,
            "Every run with the command line's {} over the experiment file's settings.\n",
            sets.join(", ")
        )?;
    }
    if results.join(CLAIMS_FILE).is_file() {
        // The verdicts are written by people from this report's numbers; the report only points at them.
        writeln!(md, "The paper's claims, one by one, against these numbers: [{CLAIMS_FILE}]({CLAIMS_FILE}).\n")?;
    }
    writeln!(md, "Seeds: {:?}. Accuracy: held-out greedy pass@1 before RL (the warm start) and at the end of RL, in the rollout precision and in f32; mean@k: the fraction of k sampled answers per held-out problem that are right (sampled at `eval.temperature`, `top_p`, `top_k`: T = 1 and no filter unless the config says otherwise), before and at the end of RL, in the rollout precision.\n", exp.seeds)?;
    writeln!(md, "Uncertainty (`train::paired`): when a variant's seeds were evaluated on the same problems, an accuracy is the mean over problems of the per-problem mean over seeds, ± its standard error over problems (clustered by problem: the seeds of a problem are not independent observations); otherwise the mean over seeds with the sample std over seeds. RL gain: per problem, the seed-averaged final outcome minus the seed-averaged outcome before RL, mean ± SE over problems, with the problems that gained vs lost and the p-value (with one seed, McNemar's exact test; with several, a paired t-test on the per-problem differences, `t-test p`). The SE over problems and the p-value treat the trained models as fixed: they say how well the held-out problems pin down these models' accuracies, not how far other training seeds would move them; the per-seed column shows that spread. mean@k: mean ± sample std over seeds (the mean alone for one seed).\n")?;
    writeln!(md, "| variant | seeds done | acc before RL (rollout prec.) | acc (rollout prec.) | acc (f32) | final acc per seed (rollout prec.; f32) | RL gain, paired by problem | mean@k before RL | mean@k (rollout prec.) |")?;
    writeln!(md, "|---|---|---|---|---|---|---|---|---|")?;
    for v in &variants {
        let mean_sd = |col: &str| {
            let xs = v.column(col);
            if xs.is_empty() {
                "-".into()
            } else {
                mean_sd_text(&xs, 3)
            }
        };
        writeln!(
            md,
            "| {} | {}/{} | {} | {} | {} | {} | {} | {} | {} |",
            v.variant.name,
            v.runs.len(),
            exp.seeds.len(),
            accuracy_cell(v.before.as_ref().map(|o| &o.1), &v.column("acc0_roll")),
            accuracy_cell(v.after_roll.as_ref().map(|o| &o.1), &v.column("acc_roll")),
            accuracy_cell(v.after_f32.as_ref().map(|o| &o.1), &v.column("acc_f32")),
            per_seed_cell(&v.column("acc_roll"), &v.column("acc_f32")),
            rl_gain_cell(
                v.after_roll.as_ref().map(|o| &o.1),
                v.before.as_ref().map(|o| &o.1)
            ),
            mean_sd("meank0_roll"),
            mean_sd("meank_roll"),
        )?;
    }
    write_arm_comparisons(&mut md, &variants)?;
    writeln!(md, "\nMismatch and stability: each run's average over its RL steps (the steps that logged the metric: a step whose groups all had equal rewards trains nothing and logs no loss-side metric; NaN where a step logged a non-finite value), mean ± sample std over seeds. Error tokens (docs/metrics.md): `any` is the fraction of response tokens meeting at least one criterion; `ratio`: the sampler over 20x more confident than the learner; `low prob`: learner probability below 1e-4; `repetition`: inside a repetition loop. Logs written before the criteria were separated have `any` (then named `error_tokens/frac`) and `repetition`, no `ratio`, and a low-probability fraction that also counted ratio errors, left out here. The timing columns (rollout tok/s, step s) are as measured on whatever machine ran each run and with whatever ran beside it: compare them within a run, not across arms.\n")?;
    let header: Vec<&str> = STABILITY_COLUMNS.iter().map(|c| c.1).collect();
    writeln!(md, "| variant | {} |", header.join(" | "))?;
    writeln!(md, "|---|{}", "---|".repeat(header.len()))?;
    for v in &variants {
        let cells: Vec<String> = STABILITY_COLUMNS
            .iter()
            .map(|&(col, _, prec)| {
                let xs = v.column(col);
                if xs.is_empty() {
                    return "-".into();
                }
                mean_sd_text(&xs, prec)
            })
            .collect();
        writeln!(md, "| {} | {} |", v.variant.name, cells.join(" | "))?;
    }
    write_plots(&mut md, exp, results)?;
    writeln!(md, "\nVariants:\n")?;
    for v in &exp.variants {
        let about = if v.about.is_empty() {
            String::new()
        } else {
            format!("{} ", v.about)
        };
        writeln!(md, "- `{}`: {about}({})", v.name, overrides_text(&v.set))?;
    }
    let path = results.join("report.md");
    crate::io::write_atomic(&path, md.as_bytes())?;
    Ok(path)
}

/// A variant's overrides as the TOML a user would write, `` `key = value` `` each (inline tables and
/// arrays in TOML's inline syntax), so the report can be read and copied without a serde dump's noise.
fn overrides_text(set: &BTreeMap<String, toml::Value>) -> String {
    if set.is_empty() {
        return "no overrides: the base config".into();
    }
    set.iter()
        .map(|(key, value)| format!("`{key} = {value}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every pair of variants evaluated on the same problems, compared by final greedy accuracy paired by
/// problem (each problem averaged over each arm's seeds), in the rollout precision and in f32.
fn write_arm_comparisons(md: &mut String, variants: &[VariantSummary]) -> anyhow::Result<()> {
    let mut lines = Vec::new();
    let mut apart = Vec::new();
    let evaluated = |v: &VariantSummary| v.after_roll.is_some() || v.after_f32.is_some();
    // Why a variant has no outcomes to pair: a run without them, or seeds that saw other problems.
    let why_unpaired = |v: &VariantSummary| {
        if v.runs
            .iter()
            .any(|r| r.after_roll.is_none() && r.after_f32.is_none())
        {
            "a run's log holds no per-problem outcomes at its end (`eval/<precision>/greedy_correct`: \
             logs written before they were kept, or a run evaluated once)"
        } else {
            "its seeds were evaluated on different problems"
        }
    };
    // The variants by reason, each reason once.
    let mut unpaired: Vec<(&str, Vec<&str>)> = Vec::new();
    for v in variants
        .iter()
        .filter(|v| !v.runs.is_empty() && !evaluated(v))
    {
        let why = why_unpaired(v);
        match unpaired.iter_mut().find(|(w, _)| *w == why) {
            Some((_, names)) => names.push(&v.variant.name),
            None => unpaired.push((why, vec![&v.variant.name])),
        }
    }
    for (why, names) in unpaired {
        writeln!(
            md,
            "\nNot paired with any arm: {} ({why}).",
            names.join(", ")
        )?;
    }
    for (i, a) in variants.iter().enumerate() {
        for b in &variants[i + 1..] {
            // Each comparison once per precision, only where both arms saw the same problems.
            let compare = |x: &Option<(EvalSet, Vec<Vec<bool>>)>,
                           y: &Option<(EvalSet, Vec<Vec<bool>>)>| match (
                x, y,
            ) {
                (Some((kx, ox)), Some((ky, oy))) if kx.same_problems(ky) => {
                    ArmComparison::new(ox, oy)
                }
                _ => None,
            };
            let roll = compare(&a.after_roll, &b.after_roll);
            let f32 = compare(&a.after_f32, &b.after_f32);
            if roll.is_none() && f32.is_none() && evaluated(a) && evaluated(b) {
                apart.push(format!("{} / {}", a.variant.name, b.variant.name));
            }
            if roll.is_some() || f32.is_some() {
                let cell = |c: &Option<ArmComparison>,
                            text: fn(&ArmComparison) -> Option<String>| {
                    c.as_ref().and_then(text).unwrap_or_else(|| "-".into())
                };
                let (seeds_roll, seeds_f32) = (
                    cell(&roll, ArmComparison::problems_and_seeds_text),
                    cell(&f32, ArmComparison::problems_and_seeds_text),
                );
                let problems = |c: &ArmComparison| Some(c.problems_text());
                let (roll, f32) = (cell(&roll, problems), cell(&f32, problems));
                lines.push(format!(
                    "| {} | {} | {roll} | {f32} | {seeds_roll} | {seeds_f32} |",
                    a.variant.name, b.variant.name
                ));
            }
        }
    }
    if !apart.is_empty() {
        writeln!(
            md,
            "\nNot compared (evaluated on other problems, or judged under other verifier rules, stop rules or \
             token limits): {}.",
            apart.join(", ")
        )?;
    }
    if lines.is_empty() {
        return Ok(());
    }
    writeln!(md, "\nArms compared by final accuracy, paired by problem (`train::paired::ArmComparison`): per problem, A's seed-averaged final greedy outcome minus B's; mean ± SE over problems; the problems where A is ahead vs behind, and the p-value: McNemar's exact test where each arm has one seed, a paired t-test on the per-problem differences (marked `t-test`) where either has several (a sign test on seed-averaged outcomes rejects a true null far too often when one arm's per-problem means are noisier than the other's: fewer seeds, or seeds that barely differ). Only pairs evaluated on the same problems. The SE over problems and the p-value treat each arm's trained models as fixed (a test of these models on more problems, not of the method over training seeds); the last two columns add the seed-to-seed spread of the arms' final accuracies (Welch, `sqrt(s_A^2 / n_A + s_B^2 / n_B)`, rough with 2-3 seeds; shown alone and combined with the SE over problems, `sqrt(SE_problems^2 + SE_seeds^2)`): where they are much wider, the effect depends on which training seeds ran. An arm evaluated only in f32 (an f32 arm) enters the rollout-precision columns with its f32 accuracy.\n")?;
    writeln!(
        md,
        "| arm A | arm B | A − B (rollout prec. of each) | A − B (f32) | A − B, problems and seeds (rollout prec.) | A − B, problems and seeds (f32) |"
    )?;
    writeln!(md, "|---|---|---|---|---|---|")?;
    for l in lines {
        writeln!(md, "{l}")?;
    }
    Ok(())
}

/// The directories of `v`'s finished runs under `results`, in the experiment's seed order.
fn finished_runs<'a>(
    exp: &'a ExperimentConfig,
    v: &'a Variant,
    results: &'a Path,
) -> impl Iterator<Item = PathBuf> + 'a {
    exp.seeds
        .iter()
        .map(move |seed| results.join(&v.name).join(format!("seed{seed}")))
        .filter(|d| marker(d).is_file())
}

/// The comparison plot over variants and each finished run's own plots.
fn write_plots(md: &mut String, exp: &ExperimentConfig, results: &Path) -> anyhow::Result<()> {
    let finished: Vec<(String, Vec<Vec<serde_json::Value>>)> = exp
        .variants
        .iter()
        .map(|v| {
            let runs = finished_runs(exp, v, results)
                .map(|d| read_rows(&d.join("metrics.jsonl"), BadLines::TornLastOnly))
                .collect::<anyhow::Result<_>>()?;
            Ok((v.name.clone(), runs))
        })
        .collect::<anyhow::Result<_>>()?;
    match crate::train::plot::plot_comparison(&results.join("comparison.png"), &finished) {
        Ok(()) => writeln!(
            md,
            "\n![reward, accuracy (rollout precision and f32), k3 KL, entropy, the error-token fractions, response length, clip fraction, mismatch weights and step time per RL step, mean over seeds](comparison.png)\n"
        )?,
        Err(e) => writeln!(md, "\n(comparison plot not drawn: {e:#})\n")?,
    }
    writeln!(
        md,
        "\nPer-run plots (reward, held-out accuracy, k3 KL, entropy, error tokens, response length, clip fractions, mismatch weights and sequence ratios, step time):\n"
    )?;
    // Seed-major: every variant's first seed before any second seed, so a study stopped part-way (they
    // span sessions) already compares all its arms on the same seeds.
    for &seed in &exp.seeds {
        for v in &exp.variants {
            let run_dir = results.join(&v.name).join(format!("seed{seed}"));
            if marker(&run_dir).is_file()
                && crate::train::plot::plot_run_if_missing(&run_dir).is_ok()
            {
                writeln!(
                    md,
                    "- `{}` seed {seed}: ![]({}/seed{seed}/plots.png)",
                    v.name, v.name
                )?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A variant without outcomes to pair is named with the reason: a log without per-problem outcomes
    /// (the paper_mini report said "different problems, or cannot be read" of logs that predate them),
    /// or seeds that saw other problems.
    #[test]
    fn unpaired_variants_are_named_with_the_reason() {
        let variant = |name: &str| Variant {
            name: name.into(),
            about: String::new(),
            set: BTreeMap::new(),
        };
        let (old, apart) = (variant("old-log"), variant("apart"));
        let with_outcomes = RunSummary {
            after_roll: Some(vec![true, false]),
            ..RunSummary::default()
        };
        let summaries = [
            VariantSummary {
                variant: &old,
                runs: vec![RunSummary::default()],
                before: None,
                after_roll: None,
                after_f32: None,
            },
            VariantSummary {
                variant: &apart,
                runs: vec![with_outcomes],
                before: None,
                after_roll: None,
                after_f32: None,
            },
        ];
        let mut md = String::new();
        write_arm_comparisons(&mut md, &summaries).unwrap();
        assert!(
            md.contains(
                "Not paired with any arm: old-log (a run's log holds no per-problem outcomes"
            ) && md.contains(
                "Not paired with any arm: apart (its seeds were evaluated on different problems)"
            ),
            "{md}"
        );
    }

    #[test]
    fn per_seed_cell_lists_both_precisions() {
        assert_eq!(per_seed_cell(&[], &[]), "-");
        assert_eq!(per_seed_cell(&[0.5, 0.25], &[1.0]), "0.500 0.250; 1.000");
    }

    #[test]
    fn one_seed_has_a_mean_and_no_spread() {
        assert_eq!(mean_sd_text(&[0.689], 3), "0.689");
        assert_eq!(mean_sd_text(&[0.5, 0.7], 2), "0.60 ± 0.14");
        assert_eq!(mean_sd_text(&[2e-3], 99), "2.00e-3");
        assert_eq!(accuracy_cell(None, &[0.25]), "0.250 (1 seed)");
        assert_eq!(
            accuracy_cell(None, &[0.5, 0.5]),
            "0.500 (sd 0.000 over seeds)"
        );
    }

    #[test]
    fn the_rl_gain_of_several_seeds_takes_the_t_test() {
        let rows = |rs: &[&str]| -> Vec<Vec<bool>> {
            rs.iter()
                .map(|r| r.bytes().map(|b| b == b'1').collect())
                .collect()
        };
        let after = rows(&["1100", "1110", "1100"]);
        // One warm start: 3 seeds against one model, the t-test.
        let shared = rows(&["0100", "0100", "0100"]);
        let cell = rl_gain_cell(Some(&after), Some(&shared));
        assert!(cell.contains("(2 vs 0 problems; t-test p"), "{cell}");
        // A warm start per seed: 3 seeds against 3, the t-test too (the sign test would give 2 / 2^3):
        // d = [1, 1/3, 1/3, 0], t = 1.987 on 3 degrees of freedom, p 0.141 (scipy's ttest_1samp).
        let own = rows(&["0100", "0000", "0100"]);
        let cell = rl_gain_cell(Some(&after), Some(&own));
        assert!(
            cell.ends_with("(3 vs 0 problems; t-test p 1.4e-1)"),
            "{cell}"
        );
        assert_eq!(rl_gain_cell(None, Some(&own)), "-");
    }

    /// A step that logged a metric as `null` (non-finite) makes the run's average NaN; steps without the
    /// key are left out, as before.
    #[test]
    fn a_non_finite_step_makes_the_average_nan() {
        let rows = [
            serde_json::json!({"k3": 1e-3}),
            serde_json::json!({"other": 1.0}),
            serde_json::json!({"k3": 3e-3}),
        ];
        let refs: Vec<&serde_json::Value> = rows.iter().collect();
        assert_eq!(rl_average(&refs, "k3"), Some(2e-3));
        assert_eq!(rl_average(&refs, "missing"), None);
        let with_null = [rows[0].clone(), serde_json::json!({"k3": null})];
        let refs: Vec<&serde_json::Value> = with_null.iter().collect();
        assert!(rl_average(&refs, "k3").unwrap().is_nan());
    }

    #[test]
    fn overrides_read_as_toml() {
        let mut set = BTreeMap::new();
        assert_eq!(overrides_text(&set), "no overrides: the base config");
        set.insert("train.lr".to_string(), toml::Value::Float(2e-6));
        set.insert("rollout.precision".to_string(), "f32".into());
        assert_eq!(
            overrides_text(&set),
            "`rollout.precision = \"f32\"`, `train.lr = 0.000002`"
        );
    }
}
