//! Comparisons of training variants over seeds, resumable: each (variant, seed) run lives in its own
//! directory, finished runs are skipped, unfinished ones resume from their newest checkpoint, and the report
//! is rebuilt from whatever has finished.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Deserialize;

use super::config::overrides::set_dotted;
use super::config::TrainConfig;
use super::metrics::{read_rows, BadLines};
use super::paired::ArmComparison;
use crate::rl::metrics::names;

/// One variant: overrides (dotted keys) applied to the base config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    pub name: String,
    /// Short description for the report.
    #[serde(default)]
    pub about: String,
    #[serde(default)]
    pub set: BTreeMap<String, toml::Value>,
}

/// An experiment file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentConfig {
    pub name: String,
    /// The base training config (relative to the experiment file).
    pub base: PathBuf,
    pub seeds: Vec<u64>,
    /// Where results go (default `experiments/results/<name>`).
    #[serde(default)]
    pub results_dir: Option<PathBuf>,
    #[serde(rename = "variant")]
    pub variants: Vec<Variant>,
}

/// What an experiment writes in its results folder beside the variants' folders.
const RESULT_FILES: [&str; 4] = ["report.md", "comparison.png", CLAIMS_FILE, OWNER_FILE];

/// Names the experiment a results folder belongs to (`{"name": ...}`), written by its first run or report.
pub const OWNER_FILE: &str = "experiment.json";

/// Whether `name` is one plain directory name: not empty, no separator, not `.` or `..`.
fn plain_name(name: &str) -> bool {
    let path = Path::new(name);
    path.components().count() == 1
        && path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// A run's config given where an experiment file is expected: say so, not "unknown field `run_dir`" (the
/// mirror of the check in [`super::config::TrainConfig`]'s parser).
fn refuse_run_config(text: &str, path: &Path) -> anyhow::Result<()> {
    let Ok(doc) = text.parse::<toml::Table>() else {
        return Ok(());
    };
    let run_keys = [
        "run_dir", "model", "task", "rollout", "train", "sft", "eval", "verify",
    ];
    if !doc.contains_key("variant") && run_keys.iter().any(|k| doc.contains_key(*k)) {
        bail!(
            "{0}: a run's config (no `[[variant]]`), not an experiment file: run it with `qarl train \
             --config {0}` (or `qarl sft`), or name it as an experiment's `base` (docs/config.md)",
            path.display()
        );
    }
    Ok(())
}

impl ExperimentConfig {
    /// Reads and checks an experiment file; errors name it.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(crate::io::failed(path, "cannot read"))?;
        refuse_run_config(&text, path)?;
        let exp: Self =
            toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if exp.seeds.is_empty() || exp.variants.is_empty() {
            bail!(
                "{}: needs at least one seed and one variant",
                path.display()
            );
        }
        // Each (variant, seed) is one run directory, `results/<variant>/seed<seed>`: a repeated seed or
        // name would share one, and the report would count a run twice or one never made.
        let mut seeds = std::collections::BTreeSet::new();
        if let Some(s) = exp.seeds.iter().find(|&&s| !seeds.insert(s)) {
            bail!("{}: seed {s} is listed twice in `seeds`", path.display());
        }
        // A run's seed goes into its TOML config, whose integers are i64.
        if let Some(s) = exp.seeds.iter().find(|&&s| i64::try_from(s).is_err()) {
            bail!(
                "{}: seed {s} in `seeds` is beyond a TOML integer's range (at most {})",
                path.display(),
                i64::MAX
            );
        }
        // The name is the results directory's last part when `results_dir` is not given:
        // `experiments/results/<name>`; "" or "../x" would put the study's runs and report elsewhere.
        if exp.results_dir.is_none() && !plain_name(&exp.name) {
            bail!(
                "{}: name {:?} must be one plain directory name (the results go to \
                 experiments/results/<name> unless `results_dir` says otherwise)",
                path.display(),
                exp.name
            );
        }
        let mut names = std::collections::BTreeSet::new();
        for v in &exp.variants {
            if !plain_name(&v.name) {
                bail!(
                    "{}: variant name {:?} must be one plain directory name (it names the variant's run \
                     directory under the results directory)",
                    path.display(),
                    v.name
                );
            }
            if !names.insert(v.name.as_str()) {
                bail!("{}: two variants are named {:?}", path.display(), v.name);
            }
            if RESULT_FILES.contains(&v.name.as_str()) {
                bail!(
                    "{}: variant name {:?} is the name of a file the experiment writes beside the \
                     variants' folders ({}); rename the variant",
                    path.display(),
                    v.name,
                    RESULT_FILES.join(", ")
                );
            }
            // The experiment sets these itself for every run; a variant's value would be overwritten.
            for (key, why) in [
                ("seed", "the experiment's `seeds` choose it"),
                (
                    "run_dir",
                    "each run's folder is <results>/<variant>/seed<N>",
                ),
            ] {
                if v.set.contains_key(key) {
                    bail!(
                        "{}: variant {:?} sets `{key}`, which an experiment sets for every run ({why})",
                        path.display(),
                        v.name
                    );
                }
            }
        }
        Ok(exp)
    }

    /// Marks `results` as this experiment's (its [`OWNER_FILE`]), or refuses where another experiment's
    /// results are there: its finished runs of a variant with the same name would be counted as this
    /// experiment's (trained under another base config) and its report overwritten. `file` is this
    /// experiment's file, for the message.
    pub fn claim_results(&self, file: &Path, results: &Path) -> anyhow::Result<()> {
        let owner = results.join(OWNER_FILE);
        if owner.is_file() {
            let stamp: serde_json::Value = crate::io::read_json(&owner)?;
            let name = stamp.get("name").and_then(|n| n.as_str()).ok_or_else(|| {
                anyhow::anyhow!("{}: no experiment `name` (a string) in it", owner.display())
            })?;
            if name != self.name {
                bail!(
                    "{}: {} holds the results of experiment {name:?} (its {OWNER_FILE}); experiment {:?} \
                     would count that experiment's finished runs as its own and overwrite its report: give \
                     it its own `results_dir`",
                    file.display(),
                    results.display(),
                    self.name
                );
            }
            return Ok(());
        }
        std::fs::create_dir_all(results).map_err(crate::io::failed(
            results,
            "cannot create the results directory",
        ))?;
        crate::io::write_json_atomic(&owner, &serde_json::json!({ "name": self.name }))
    }

    /// Where the runs and the report go: `results_dir`, by default `experiments/results/<name>`.
    pub fn results(&self) -> PathBuf {
        self.results_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("experiments/results").join(&self.name))
    }
}

/// Refuses runs that share a `model.dir` but would make it differently: the first to run makes the model,
/// the others find it there and skip their own warm start, so a variant that differs only in `[sft]`
/// trained the other variant's model while the report credited its own settings. Each run still to do
/// is checked against the others and against the finished ones (`finished`: their recorded configs; a
/// variant added later would otherwise train on a finished variant's model).
fn check_shared_warm_starts(
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
        let r = super::model_dir::warm_start_of(cfg)?;
        recipes.insert(key, r.clone());
        Ok(r)
    };
    for (i, (va, _, _, a)) in runs.iter().enumerate() {
        let later = runs[i + 1..].iter().map(|(v, _, _, c)| (*v, c));
        for (vb, b) in later.chain(done.clone()) {
            if !crate::io::same_dir(&a.model.dir, &b.model.dir) {
                continue;
            }
            let differ = super::config::differing_keys(&recipe(a)?, &recipe(b)?);
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
/// pointers), besides the knobs that leave its results alone ([`super::config::RESULT_NEUTRAL_KEYS`]):
/// where it ran and from which paths. Unlike a resume's ([`super::RESUME_MAY_CHANGE`]), not `train.steps`
/// (a finished run is not run further: longer new seeds would share an arm with it), `eval.every` nor the
/// warm start's settings.
const FINISHED_MAY_CHANGE: [&str; 4] = [
    "/run_dir",
    "/model/dir",
    "/model/base",
    "/model/init_config",
];

/// The file that marks a run of an experiment finished (its final evaluation summarized); kept where a run
/// starting over removes it.
pub use super::resume::finished_marker as marker;

/// `e` in the context of the experiment's run; a resume refused for changed settings says how to start that
/// run over (the experiment resumes on the user's behalf and has no `--overwrite`).
fn resume_refused(
    e: anyhow::Error,
    path: &Path,
    v: &Variant,
    seed: u64,
    run_dir: &Path,
) -> anyhow::Error {
    let again = if e.downcast_ref::<super::ResumeChanged>().is_some() {
        format!(
            "; the experiment resumes an unfinished run from its checkpoints: to run it from the start \
             with the settings now given, remove {}",
            run_dir.display()
        )
    } else {
        String::new()
    };
    e.context(format!(
        "{}: variant {:?} seed {seed}{again}",
        path.display(),
        v.name
    ))
}

/// Builds the config each (variant, seed) runs with: the experiment's base file with the variant's `set`,
/// the seed, the run directory and (when given) the backend applied.
struct RunConfigs<'a> {
    path: &'a Path,
    base: toml::Value,
    backend: Option<crate::ops::BackendKind>,
}

impl<'a> RunConfigs<'a> {
    /// Reads the base file of the experiment at `path`.
    fn load(
        path: &'a Path,
        exp: &ExperimentConfig,
        backend: Option<crate::ops::BackendKind>,
    ) -> anyhow::Result<Self> {
        let base_path = path.parent().unwrap_or(Path::new(".")).join(&exp.base);
        let base_text = std::fs::read_to_string(&base_path)
            .map_err(crate::io::failed(&base_path, "cannot read"))?;
        let base = toml::from_str(&base_text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", base_path.display()))?;
        Ok(Self {
            path,
            base,
            backend,
        })
    }

    /// The config of `v` at `seed` in `run_dir`.
    fn config(&self, v: &Variant, seed: u64, run_dir: &Path) -> anyhow::Result<TrainConfig> {
        let mut doc = self.base.clone();
        for (k, val) in &v.set {
            set_dotted(&mut doc, k, val.clone())
                .with_context(|| format!("{}: variant {:?}", self.path.display(), v.name))?;
        }
        set_dotted(&mut doc, "seed", toml::Value::Integer(seed as i64))?;
        if let Some(b) = self.backend {
            set_dotted(
                &mut doc,
                "train.backend",
                toml::Value::String(b.to_string()),
            )?;
        }
        set_dotted(
            &mut doc,
            "run_dir",
            toml::Value::String(run_dir.display().to_string()),
        )?;
        let origin = format!(
            "{} (variant {}, seed {seed}; line numbers are of the variant's config, the base with its \
             `set` applied)",
            self.path.display(),
            v.name
        );
        TrainConfig::from_toml(&toml::to_string(&doc)?, &origin)
    }
}

/// The finished runs of the experiment at `path`, each with its own config as it ran, checked against the
/// experiment file's now (`configs`): the report would describe a run by settings it did not run with, and
/// a seed added to its variant would average two experiments in one arm, so a difference is refused. Where
/// the experiment's configs cannot be built (`configs` `None`, or a base this version no longer reads), the
/// runs are kept unchecked with a warning: an older experiment's results can still be reported.
fn check_finished_runs<'e>(
    path: &Path,
    exp: &'e ExperimentConfig,
    configs: Option<&RunConfigs>,
    runs_to_do: bool,
) -> anyhow::Result<Vec<(&'e Variant, TrainConfig)>> {
    let results = exp.results();
    let mut finished = Vec::new();
    let mut drifted = Vec::new();
    let mut data_changed = Vec::new();
    let mut unchecked = Vec::new();
    let mut held_out = HeldOut::new();
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
                    let keys =
                        super::config::identity_changes(&mut ran, &now, &FINISHED_MAY_CHANGE)?;
                    if !keys.is_empty() {
                        drifted.push(format!("{}/seed{seed} (`{}`)", v.name, keys.join("`, `")));
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
             experiment and base files, or give the edited experiment another `results_dir`",
            path.display(),
            drifted.join(", ")
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
fn one_logged(rows: &[&serde_json::Value], key: &str) -> Result<Option<String>, Vec<String>> {
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

/// The checks of [`run_experiment`] before a report of finished runs alone (`--report-only`): their settings
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
fn check_seeds_alike(path: &Path, exp: &ExperimentConfig) -> anyhow::Result<()> {
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
fn check_same_start_model(
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
    let now = super::reference::files_fingerprint(&cfg.model.dir)?;
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

/// Runs every (variant, seed) not finished yet, then writes `report.md`; `backend`, when given, replaces
/// every run's `train.backend`.
pub fn run_experiment(
    path: &Path,
    quiet: bool,
    backend: Option<crate::ops::BackendKind>,
) -> anyhow::Result<PathBuf> {
    let exp = ExperimentConfig::load(path)?;
    let results = exp.results();
    // Every run's config, built and checked before the first run starts (and before the results directory
    // is made or claimed): a mistake in the last variant is reported before hours of the first ones, not
    // after, and leaves nothing behind.
    let configs = RunConfigs::load(path, &exp, backend)?;
    let runs_to_do = exp.seeds.iter().any(|seed| {
        exp.variants
            .iter()
            .any(|v| !marker(&results.join(&v.name).join(format!("seed{seed}"))).is_file())
    });
    let finished = check_finished_runs(path, &exp, Some(&configs), runs_to_do)?;
    let mut runs = Vec::new();
    // Seed-major: every variant's first seed before any second seed, so a study stopped part-way (they
    // span sessions) already compares all its arms on the same seeds.
    for &seed in &exp.seeds {
        for v in &exp.variants {
            let run_dir = results.join(&v.name).join(format!("seed{seed}"));
            if !marker(&run_dir).is_file() {
                let cfg = configs.config(v, seed, &run_dir)?;
                // An unfinished run resumes from its checkpoints: settings it cannot resume under are
                // refused now, not when its turn comes after hours of the runs before it.
                if run_dir.join("checkpoints").is_dir() {
                    super::resume::check_resumed_config(&cfg, false)
                        .map_err(|e| resume_refused(e, path, v, seed, &run_dir))?;
                }
                runs.push((v, seed, run_dir, cfg));
            }
        }
    }
    check_shared_warm_starts(path, &runs, &finished)?;
    check_seeds_alike(path, &exp)?;
    // A backend this build cannot run (`--backend wgpu` without the feature) is refused before the
    // results directory is claimed: it left an `experiment.json` behind, then a report of no runs.
    let mut backends: Vec<_> = runs.iter().map(|(.., cfg)| cfg.train.backend).collect();
    backends.dedup();
    for b in backends {
        b.device()
            .with_context(|| format!("{}: `train.backend` = {b}", path.display()))?;
    }
    // One experiment process per results directory (each run directory is locked by its run as well).
    let _lock = super::lock::RunLock::acquire(&results)?;
    exp.claim_results(path, &results)?;
    for (v, seed, run_dir, cfg) in runs {
        if !quiet {
            eprintln!("== {} seed {seed} -> {}", v.name, run_dir.display());
        }
        check_same_start_model(path, &exp, v, &cfg)?;
        // Unfinished: resumed from its newest checkpoint, or (stopped before its first) started over,
        // its partial rows deleted.
        let resume = run_dir.join("checkpoints").is_dir();
        let s = super::run_with(
            &cfg,
            &super::RunOptions {
                resume,
                quiet,
                overwrite: !resume,
                ..super::RunOptions::default()
            },
        )
        .map_err(|e| resume_refused(e, path, v, seed, &run_dir))?;
        crate::io::write_json_atomic(
            &marker(&run_dir),
            &serde_json::json!({
                "accuracy_after": s.accuracy_after,
                "accuracy_before": s.accuracy_before,
                "paired": s.paired.as_ref().map(|p| serde_json::json!({
                    "problems": p.problems,
                    "fixed": p.fixed,
                    "broken": p.broken,
                    "diff": p.diff(),
                    "diff_se": p.diff_se,
                    "p_value": p.p_value,
                })),
                "start_model": s.start_model,
                "train_data": s.train_data,
            }),
        )?;
    }
    check_seeds_alike(path, &exp)?;
    let report = write_report(&exp, &results)?;
    Ok(report)
}

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
    /// A run's set from its config and eval rows; `None` when the config is unreadable or the rows logged
    /// different fingerprints (a run resumed over changed data: its evaluations are not of one set).
    fn of_run(run_dir: &Path, evals: &[&serde_json::Value]) -> Option<Self> {
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run_dir.join("config.json")).ok()?)
                .ok()?;
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
        let stop: super::config::RolloutStop =
            serde_json::from_value(section("/rollout/stop")).unwrap_or_default();
        let judged = serde_json::json!([
            verify.judging_rules(),
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
    super::paired::decode(eval_entry(row, "/greedy_correct", f32_view)?.as_str()?)
}

/// Checks what the report reads from an eval row: every accuracy (`pass@1_greedy`, `mean@k`) a number in
/// [0, 1], every outcome string (`greedy_correct`) made of `0` and `1`, and the greedy accuracy the mean
/// of its outcomes, as `qarl train` writes them. A damaged or edited metrics file is named instead of being
/// averaged into the report (an accuracy of 1.7 was, and an unreadable outcome string was dropped).
fn check_eval_row(path: &Path, row: &serde_json::Value) -> anyhow::Result<()> {
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
            let outcomes = v.as_str().and_then(super::paired::decode);
            let Some(outcomes) = outcomes else {
                anyhow::bail!("{}: `{key}` is not a string of 0s and 1s", at());
            };
            let accuracy = entries
                .get(&format!("eval/{precision}/pass@1_greedy"))
                .and_then(serde_json::Value::as_f64);
            if let Some(a) = accuracy.filter(|&a| !super::paired::accuracy_agrees(a, &outcomes)) {
                anyhow::bail!(
                    "{}: `eval/{precision}/pass@1_greedy` is {a} but its `greedy_correct` outcomes give {}",
                    at(),
                    super::paired::accuracy(&outcomes)
                );
            }
        }
    }
    Ok(())
}

/// Mean of `key` over the RL rows that logged it; `None` when none did (a missing metric is not 0).
fn rl_average(rl: &[&serde_json::Value], key: &str) -> Option<f64> {
    let xs: Vec<f64> = rl.iter().filter_map(|r| r[key].as_f64()).collect();
    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
}

/// Reads a finished run's metrics and config.
fn summarize_run(run_dir: &Path) -> anyhow::Result<RunSummary> {
    let metrics_file = run_dir.join("metrics.jsonl");
    let rows = read_rows(&metrics_file, BadLines::TornLastOnly)?;
    let evals: Vec<&serde_json::Value> = rows.iter().filter(|r| r["phase"] == "eval").collect();
    let mut s = RunSummary {
        eval_set: EvalSet::of_run(run_dir, &evals),
        ..RunSummary::default()
    };
    for e in &evals {
        check_eval_row(&metrics_file, e)?;
    }
    if let (Some(first), Some(last)) = (evals.first(), evals.last()) {
        for (col, e, suffix, f32_view) in [
            ("acc0_roll", first, "/pass@1_greedy", false),
            ("acc_roll", last, "/pass@1_greedy", false),
            ("acc_f32", last, "/pass@1_greedy", true),
        ] {
            if let Some(v) = eval_entry(e, suffix, f32_view).and_then(|v| v.as_f64()) {
                s.cols.insert(col, v);
            }
        }
        for (col, e) in [("meank0_roll", first), ("meank_roll", last)] {
            if let Some(v) = e
                .as_object()
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
        if evals.len() > 1 {
            s.before = greedy_outcomes(first, false);
            s.after_roll = greedy_outcomes(last, false);
            s.after_f32 = greedy_outcomes(last, true);
        }
    }
    let rl: Vec<&serde_json::Value> = rows.iter().filter(|r| r["phase"] == "rl").collect();
    let any_key = super::plot::any_error_key(&rows);
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
    if let Some(c) = shared.and_then(|o| super::paired::ClusteredMean::new(o)) {
        return format!("{:.3} ± {}", c.mean, super::paired::se_text(c.se));
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
/// copies average to itself) or not ([`super::paired::PairedTest::PairedT`]).
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
            let runs = exp
                .seeds
                .iter()
                .map(|seed| results.join(&v.name).join(format!("seed{seed}")))
                .filter(|d| marker(d).is_file())
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
    writeln!(md, "\nMismatch and stability: each run's average over its RL steps (the steps that logged the metric: a step whose groups all had equal rewards trains nothing and logs no loss-side metric), mean ± sample std over seeds. Error tokens (docs/metrics.md): `any` is the fraction of response tokens meeting at least one criterion; `ratio`: the sampler over 20x more confident than the learner; `low prob`: learner probability below 1e-4; `repetition`: inside a repetition loop. Logs written before the criteria were separated have `any` (then named `error_tokens/frac`) and `repetition`, no `ratio`, and a low-probability fraction that also counted ratio errors, left out here. The timing columns (rollout tok/s, step s) are as measured on whatever machine ran each run and with whatever ran beside it: compare them within a run, not across arms.\n")?;
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
            let evaluated = |v: &VariantSummary| v.after_roll.is_some() || v.after_f32.is_some();
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

/// The comparison plot over variants and each finished run's own plots.
fn write_plots(md: &mut String, exp: &ExperimentConfig, results: &Path) -> anyhow::Result<()> {
    let finished: Vec<(String, Vec<Vec<serde_json::Value>>)> = exp
        .variants
        .iter()
        .map(|v| {
            let runs = exp
                .seeds
                .iter()
                .map(|seed| results.join(&v.name).join(format!("seed{seed}")))
                .filter(|d| marker(d).is_file())
                .map(|d| read_rows(&d.join("metrics.jsonl"), BadLines::TornLastOnly))
                .collect::<anyhow::Result<_>>()?;
            Ok((v.name.clone(), runs))
        })
        .collect::<anyhow::Result<_>>()?;
    match super::plot::plot_comparison(&results.join("comparison.png"), &finished) {
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
            if marker(&run_dir).is_file() && super::plot::plot_run_if_missing(&run_dir).is_ok() {
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

    #[test]
    fn a_run_config_is_named_as_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let run = dir.join("run.toml");
        std::fs::write(&run, "run_dir = \"runs/x\"\n[train]\nsteps = 3\n").unwrap();
        let e = ExperimentConfig::load(&run).unwrap_err().to_string();
        assert!(e.contains("a run's config (no `[[variant]]`)"), "{e}");
        assert!(
            e.contains(&format!("qarl train --config {}", run.display())),
            "{e}"
        );
        // An experiment file with a typo still gets the parser's own message.
        let exp = dir.join("exp.toml");
        std::fs::write(&exp, "name = \"x\"\nbase = \"b.toml\"\nseed = [1]\n").unwrap();
        let e = ExperimentConfig::load(&exp).unwrap_err().to_string();
        assert!(e.contains("unknown field `seed`"), "{e}");
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
