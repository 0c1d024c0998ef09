//! The checks an experiment makes before it runs or reports: finished runs against the experiment file,
//! the warm starts its variants share, and one model, data set and held-out set per arm.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::bail;

use super::{marker, ExperimentConfig, RunConfigs, Variant};
use crate::rl::metrics::names;
use crate::train::config::TrainConfig;
use crate::train::metrics::{read_rows, BadLines};

/// Refuses runs that share a `model.dir` but would make it differently: the first to run makes the model,
/// the others find it there and skip their own warm start, so a variant that differs only in `[sft]`
/// trained the other variant's model while the report credited its own settings. Each run still to do
/// is checked against the others and against the finished ones (`finished`: their recorded configs; a
/// variant added later would otherwise train on a finished variant's model).
pub(super) fn check_shared_warm_starts(
    path: &Path,
    runs: &[(&Variant, u64, PathBuf, TrainConfig)],
    finished: &[(&Variant, TrainConfig)],
) -> anyhow::Result<()> {
    let done = finished.iter().map(|(v, c)| (*v, c));
    // One recipe per distinct model, warm start and task (seeds of a variant share them): a recipe reads
    // the task's data.
    let mut recipes: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    let mut recipe = |cfg: &TrainConfig| -> anyhow::Result<serde_json::Value> {
        let key = serde_json::to_string(&(&cfg.model, &cfg.sft, &cfg.task))?;
        if let Some(r) = recipes.get(&key) {
            return Ok(r.clone());
        }
        let r = crate::train::model_dir::warm_start_of(cfg)?;
        recipes.insert(key, r.clone());
        Ok(r)
    };
    for (i, (va, _, _, a)) in runs.iter().enumerate() {
        let later = runs[i + 1..].iter().map(|(v, _, _, c)| (*v, c));
        for (vb, b) in later.chain(done.clone()) {
            if !crate::io::same_dir(&a.model.dir, &b.model.dir) {
                continue;
            }
            let differ = crate::train::config::differing_keys(&recipe(a)?, &recipe(b)?);
            if !differ.is_empty() {
                bail!(
                    "{}: variants {:?} and {:?} share `model.dir` = {:?} but would make it differently (`{}`): \
                     the first to run makes the model and the other trains on it; give each its own \
                     `model.dir`",
                    path.display(),
                    va.name,
                    vb.name,
                    a.model.dir.display().to_string(),
                    differ.join("`, `")
                );
            }
        }
    }
    Ok(())
}

/// What the experiment file may change under a finished run without making it another experiment's (JSON
/// pointers), besides the knobs that leave its results alone ([`crate::train::config::RESULT_NEUTRAL_KEYS`]):
/// where it ran and from which paths. Unlike a resume's ([`crate::train::RESUME_MAY_CHANGE`]), not `train.steps`
/// (a finished run is not run further: longer new seeds would share an arm with it), `eval.every` nor the
/// warm start's settings.
const FINISHED_MAY_CHANGE: [&str; 4] = [
    "/run_dir",
    "/model/dir",
    "/model/base",
    "/model/init_config",
];

/// The finished runs of the experiment at `path`, each with its own config as it ran, checked against the
/// experiment file's now (`configs`): the report would describe a run by settings it did not run with, and
/// a seed added to its variant would average two experiments in one arm, so a difference is refused. Where
/// the experiment's configs cannot be built (`configs` `None`, or a base this version no longer reads), the
/// runs are kept unchecked with a warning: an older experiment's results can still be reported.
pub(super) fn check_finished_runs<'e>(
    path: &Path,
    exp: &'e ExperimentConfig,
    configs: Option<&RunConfigs>,
    runs_to_do: bool,
) -> anyhow::Result<Vec<(&'e Variant, TrainConfig)>> {
    let results = exp.results();
    let mut finished = Vec::new();
    let mut drifted: Vec<(String, Settings)> = Vec::new();
    let mut data_changed = Vec::new();
    let mut unchecked = Vec::new();
    let mut held_out = HeldOut::new();
    warn_of_broken_links(exp, &results);
    for &seed in &exp.seeds {
        for v in &exp.variants {
            let run_dir = results.join(&v.name).join(format!("seed{seed}"));
            if !marker(&run_dir).is_file() {
                continue;
            }
            let Ok(cfg) = crate::io::read_json::<TrainConfig>(&run_dir.join("config.json")) else {
                unchecked.push(format!(
                    "{}/seed{seed} (its config.json is unreadable here)",
                    v.name
                ));
                continue;
            };
            match configs.map(|c| c.config(v, seed, &run_dir)) {
                Some(Ok(now)) => {
                    let mut ran = serde_json::to_value(cfg.with_defaults())?;
                    let keys = crate::train::config::identity_changes(
                        &mut ran,
                        &now,
                        &FINISHED_MAY_CHANGE,
                    )?;
                    if !keys.is_empty() {
                        let settings = keys
                            .iter()
                            .map(|k| (k.clone(), scalar_at(&ran, k)))
                            .collect();
                        drifted.push((format!("{}/seed{seed}", v.name), settings));
                    } else if !runs_to_do {
                        // A report of finished runs alone pools no new seed with them: their data
                        // as it is now does not matter (their seeds' agreement is checked apart).
                    } else if let Some(change) = held_out_change(&run_dir, &now, &mut held_out)? {
                        data_changed.push(format!("{}/seed{seed} ({change})", v.name));
                    }
                }
                Some(Err(e)) => unchecked.push(format!("{}/seed{seed} ({e:#})", v.name)),
                None => unchecked.push(format!("{}/seed{seed}", v.name)),
            }
            finished.push((v, cfg));
        }
    }
    if !drifted.is_empty() {
        bail!(
            "{}: finished runs were made with other settings than the experiment's now: {}; restore the \
             experiment and base files{}, or give the edited experiment another `results_dir`",
            path.display(),
            drifted
                .iter()
                .map(|(run, settings)| format!("{run} (`{}`)", keys_of(settings).join("`, `")))
                .collect::<Vec<_>>()
                .join(", "),
            same_overrides(&drifted)
                .map(|sets| format!(", pass the overrides the runs were made with ({sets})"))
                .unwrap_or_default()
        );
    }
    if !data_changed.is_empty() {
        bail!(
            "{}: finished runs were made on other data than the experiment's files hold now, and new runs \
             would be pooled with them: {}; restore the data files, or give the changed experiment another \
             `results_dir` (`--report-only` still reports the finished runs)",
            path.display(),
            data_changed.join(", ")
        );
    }
    if !unchecked.is_empty() {
        tracing::warn!(
            "{}: finished runs not checked against the experiment's settings now: {}",
            path.display(),
            unchecked.join(", ")
        );
    }
    Ok(finished)
}

/// Warns of a variant's folder (or a seed's) that is a link to nothing: its runs read as not made yet,
/// and a copy of a study whose arms link to another's results (`cp -r` keeps relative links) reported
/// them as 0 of 3 done without a word.
fn warn_of_broken_links(exp: &ExperimentConfig, results: &Path) {
    for (dir, target) in broken_links(exp, results) {
        tracing::warn!(
            "{}: a link to {}, which does not exist: the runs there read as not made",
            dir.display(),
            target.display()
        );
    }
}

/// The variants' and seeds' folders under `results` that are links to nothing, with their targets (the
/// first of each variant: a variant's broken link hides its seeds).
fn broken_links(exp: &ExperimentConfig, results: &Path) -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    for v in &exp.variants {
        let variant = results.join(&v.name);
        let seeds = exp.seeds.iter().map(|s| variant.join(format!("seed{s}")));
        let broken = std::iter::once(variant.clone()).chain(seeds).find(|dir| {
            dir.symlink_metadata()
                .is_ok_and(|m| m.file_type().is_symlink())
                && !dir.exists()
        });
        if let Some(dir) = broken {
            let target = std::fs::read_link(&dir).unwrap_or_default();
            out.push((dir, target));
        }
    }
    out
}

/// The settings where a finished run differs from the experiment now: dotted key, and the value it ran
/// with where that is one number, string or boolean (`None` for a table or list).
type Settings = Vec<(String, Option<String>)>;

/// The value at dotted `key` of a config as JSON, written as `--set` takes it, where it is a scalar.
fn scalar_at(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.pointer(&format!("/{}", key.replace('.', "/")))? {
        v @ (serde_json::Value::String(_)
        | serde_json::Value::Number(_)
        | serde_json::Value::Bool(_)) => Some(v.to_string()),
        _ => None,
    }
}

/// The keys of `settings`, as the refusal lists them.
fn keys_of(settings: &Settings) -> Vec<&str> {
    settings.iter().map(|(k, _)| k.as_str()).collect()
}

/// `--set KEY=VALUE ...` that gives back what every drifted run was made with, where they were all made
/// with the same scalar values (a trial made with `--set train.steps=1` and reported without it: the
/// runs are the experiment's, and its report needs the same overrides).
fn same_overrides(drifted: &[(String, Settings)]) -> Option<String> {
    let (_, first) = drifted.first()?;
    if drifted.iter().any(|(_, s)| s != first) {
        return None;
    }
    let sets: Option<Vec<String>> = first
        .iter()
        .map(|(k, v)| v.as_ref().map(|v| format!("`--set {k}={v}`")))
        .collect();
    sets.map(|s| s.join(" "))
}

/// The fingerprints of the held-out questions and of the training set a config's task gives now, by the
/// task table and problem count (seeds and variants share them; each data set is read once).
type HeldOut = BTreeMap<String, Option<(String, String, Option<String>)>>;

/// How the held-out problems a finished run's evaluations logged (or the training set its marker
/// records) differ from those its task gives now (`now`: the experiment's config of that run), where they
/// do: an edited data file, whose new seeds would be averaged with the old ones as one arm. `None` where
/// they agree, where the run logged no fingerprint (logs before 2026-12-05) or the task does not load here
/// (a run made elsewhere).
fn held_out_change(
    run_dir: &Path,
    now: &TrainConfig,
    cache: &mut HeldOut,
) -> anyhow::Result<Option<String>> {
    let records = RunRecords::read(run_dir)?;
    let (with_golds, first) = match (&records.problems, &records.questions) {
        (Some(problems), _) => (true, problems),
        (None, Some(questions)) => (false, questions),
        (None, None) => return Ok(None),
    };
    let key = serde_json::json!([now.task.with_defaults(), now.eval.problems]).to_string();
    let current = cache.entry(key).or_insert_with(|| {
        crate::tasks::Task::from_config(&now.task.with_defaults())
            .ok()
            .map(|t| {
                let questions =
                    crate::tasks::questions_fingerprint(&t.eval_questions(now.eval.problems));
                let problems = t.problems_fingerprint(now.eval.problems);
                (questions, problems, t.training_fingerprint())
            })
    });
    let Some((questions, problems, training)) = current else {
        return Ok(None);
    };
    let held_out = if with_golds { problems } else { questions };
    if held_out != first {
        return Ok(Some(format!(
            "held-out problems {first} when it ran, {held_out} now: its data file changed"
        )));
    }
    Ok(match (&records.train_data, training) {
        (Some(then), Some(now)) if then != now => Some(format!(
            "training data {then} when it ran, {now} now: its data file changed"
        )),
        _ => None,
    })
}

/// What a finished run recorded of what it trained on and answered: its marker's start model and
/// training data, and the held-out fingerprints its evaluations logged, the questions and the questions
/// with their golds (each `None` where the run is older than the record).
struct RunRecords {
    start_model: Option<String>,
    train_data: Option<String>,
    questions: Option<String>,
    problems: Option<String>,
}

impl RunRecords {
    /// Reads the marker and the metrics log of the finished run in `run_dir`; evaluations of one run that
    /// logged different fingerprints are an error (its data changed while it ran).
    fn read(run_dir: &Path) -> anyhow::Result<Self> {
        let recorded: serde_json::Value = crate::io::read_json(&marker(run_dir))?;
        let metrics = run_dir.join("metrics.jsonl");
        let rows = read_rows(&metrics, BadLines::TornLastOnly)?;
        let evals: Vec<&serde_json::Value> = rows.iter().filter(|r| r["phase"] == "eval").collect();
        let logged = |key: &str| {
            one_logged(&evals, key).map_err(|values| {
                anyhow::anyhow!(
                    "{}: its evaluations logged different `{key}` ({}): its data files changed while it ran",
                    metrics.display(),
                    values.join(", ")
                )
            })
        };
        let marked = |key: &str| recorded[key].as_str().map(str::to_string);
        Ok(Self {
            start_model: marked("start_model"),
            train_data: marked("train_data"),
            questions: logged(names::EVAL_QUESTIONS_FINGERPRINT)?,
            problems: logged(names::EVAL_PROBLEMS_FINGERPRINT)?,
        })
    }
}

/// The one string value of `key` on the rows that have it (`None` where none has it), or the values where
/// they differ.
pub(super) fn one_logged(
    rows: &[&serde_json::Value],
    key: &str,
) -> Result<Option<String>, Vec<String>> {
    let mut values: Vec<String> = rows
        .iter()
        .filter_map(|r| r[key].as_str().map(str::to_string))
        .collect();
    values.dedup();
    match values.len() {
        0 | 1 => Ok(values.pop()),
        _ => Err(values),
    }
}

/// The checks of [`super::run_experiment`] before a report of finished runs alone (`--report-only`): their settings
/// against the experiment file's (`check_finished_runs`; a base that cannot be read leaves them unchecked,
/// with a warning) and the warm starts they share.
pub fn check_report(path: &Path, exp: &ExperimentConfig) -> anyhow::Result<()> {
    let configs = RunConfigs::load(path, exp, None)
        .map_err(|e| tracing::warn!("{e:#}"))
        .ok();
    let finished = check_finished_runs(path, exp, configs.as_ref(), false)?;
    check_shared_warm_starts(path, &[], &finished)?;
    check_seeds_alike(path, exp)
}

/// The model each finished run of `v` started from (`start_model` in its marker: the fingerprint of its
/// `model.dir` at its first step), by seed; runs finished before markers recorded it are left out.
fn start_models(exp: &ExperimentConfig, v: &Variant) -> anyhow::Result<Vec<(u64, String)>> {
    let mut models = Vec::new();
    for &seed in &exp.seeds {
        let run_dir = exp.results().join(&v.name).join(format!("seed{seed}"));
        if !marker(&run_dir).is_file() {
            continue;
        }
        if let Some(model) = RunRecords::read(&run_dir)?.start_model {
            models.push((seed, model));
        }
    }
    Ok(models)
}

/// Refuses to pool seeds of one variant that started from different models (a `model.init_config`,
/// `model.base` or `model.dir` swapped between seeds, which a finished run may change: its folders may
/// move), trained on different data or were evaluated on different held-out problems (a data file edited
/// between seeds): their mean would average two experiments as one arm.
pub(super) fn check_seeds_alike(path: &Path, exp: &ExperimentConfig) -> anyhow::Result<()> {
    for v in &exp.variants {
        let mut seen: BTreeMap<&str, (u64, String)> = BTreeMap::new();
        for &seed in &exp.seeds {
            let run_dir = exp.results().join(&v.name).join(format!("seed{seed}"));
            if !marker(&run_dir).is_file() {
                continue;
            }
            let records = RunRecords::read(&run_dir)?;
            // Each compared where both seeds recorded it (older runs lack the later records).
            let facts = [
                ("model (files fingerprint)", records.start_model),
                ("training data", records.train_data),
                ("held-out questions", records.questions),
                ("held-out gold answers", records.problems),
            ];
            for (what, value) in facts {
                let Some(value) = value else { continue };
                match seen.get(what) {
                    Some((first, v0)) if *v0 != value => bail!(
                        "{}: variant {:?}: seed {first} and seed {seed} have different {what} ({} and {}): \
                         one arm's seeds must train one model on one data set and answer one set of \
                         problems; remove the runs of the other, or give the changed experiment another \
                         `results_dir`",
                        path.display(),
                        v.name,
                        v0,
                        value
                    ),
                    Some(_) => {}
                    None => {
                        seen.insert(what, (seed, value));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Refuses a run of `v` whose `model.dir` holds another model than the one its finished seeds started
/// from, or none (it would be made again, from this run's seed), before it runs.
pub(super) fn check_same_start_model(
    path: &Path,
    exp: &ExperimentConfig,
    v: &Variant,
    cfg: &TrainConfig,
) -> anyhow::Result<()> {
    let Some((seed, model)) = start_models(exp, v)?.into_iter().next() else {
        return Ok(());
    };
    // A folder made again would be another warm start (made with this run's seed): a seed of another
    // model, found only once it had trained.
    anyhow::ensure!(
        cfg.model.dir.join("config.json").is_file(),
        "{}: variant {:?}: `model.dir` {} holds no model yet, but seed {seed} of this variant started from \
         a model (files fingerprint {model}): made here, it would be another warm start (from this run's \
         seed); point `model.dir` at that model, or give the experiment another `results_dir`",
        path.display(),
        v.name,
        cfg.model.dir.display()
    );
    let now = crate::train::reference::files_fingerprint(&cfg.model.dir)?;
    anyhow::ensure!(
        now == model,
        "{}: variant {:?}: `model.dir` {} holds the model with files fingerprint {now}, but seed {seed} of \
         this variant started from {model}: one arm's seeds must train one model; restore that model, or \
         give the changed experiment another `results_dir`",
        path.display(),
        v.name,
        cfg.model.dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    /// A variant folder that links to nothing is found (it read as a variant with no run made); a link
    /// to a folder that exists is none of its business.
    #[cfg(unix)]
    #[test]
    fn links_to_nothing_are_found() {
        let tmp = tempfile::tempdir().unwrap();
        let exp: super::ExperimentConfig = toml::from_str(
            "name = \"x\"\nbase = \"b.toml\"\nseeds = [1, 2]\n[[variant]]\nname = \"a\"\n\
             [[variant]]\nname = \"b\"\n[[variant]]\nname = \"c\"\n",
        )
        .unwrap();
        let results = tmp.path();
        std::os::unix::fs::symlink("../elsewhere/a", results.join("a")).unwrap();
        std::fs::create_dir_all(results.join("real")).unwrap();
        std::os::unix::fs::symlink("real", results.join("b")).unwrap();
        std::fs::create_dir_all(results.join("c")).unwrap();
        std::os::unix::fs::symlink("gone", results.join("c/seed2")).unwrap();
        let found = super::broken_links(&exp, results);
        assert_eq!(
            found,
            [
                (results.join("a"), "../elsewhere/a".into()),
                (results.join("c/seed2"), "gone".into())
            ]
        );
    }
}
