//! Comparisons of training variants over seeds, resumable: each (variant, seed) run lives in its own
//! directory, finished runs are skipped, unfinished ones resume from their newest checkpoint, and the report
//! is rebuilt from whatever has finished.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Deserialize;

use super::config::overrides::set_dotted;
use super::config::TrainConfig;

mod checks;
mod report;

pub use checks::check_report;
use checks::{
    check_finished_runs, check_same_start_model, check_seeds_alike, check_shared_warm_starts,
};
pub use report::{check_eval_row, write_report, CLAIMS_FILE};

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
    /// `--set` overrides from the command line ([`Self::with_overrides`]), applied to every run's
    /// config after its variant's `set`.
    #[serde(skip)]
    pub overrides: Vec<(String, toml::Value)>,
}

/// The keys an experiment sets for every run itself, with why a variant's or a `--set` value of them
/// would be overwritten.
const SET_BY_THE_EXPERIMENT: [(&str, &str); 2] = [
    ("seed", "the experiment's `seeds` choose it"),
    (
        "run_dir",
        "each run's folder is <results>/<variant>/seed<N>",
    ),
];

/// The key of [`SET_BY_THE_EXPERIMENT`] that `key` sets (itself, or inside it: `seed.x` makes `seed` a
/// table, which the experiment's value then replaces), with why it may not.
fn set_by_the_experiment(key: &str) -> Option<(&'static str, &'static str)> {
    SET_BY_THE_EXPERIMENT
        .into_iter()
        .find(|(own, _)| key == *own || key.starts_with(&format!("{own}.")))
}

/// What an experiment writes in its results folder beside the variants' folders.
const RESULT_FILES: [&str; 4] = ["report.md", "comparison.png", CLAIMS_FILE, OWNER_FILE];

/// Names the experiment a results folder belongs to (`{"name": ...}`), written by its first run or report.
pub const OWNER_FILE: &str = "experiment.json";

/// What keeps `name` from naming a results folder and a report row, if anything: it must be one plain
/// directory name (not empty, no separator, not `.` or `..`) that file systems take (at most 255 bytes: a
/// longer one failed only when its runs began, after earlier variants had trained), and it must not break
/// the report's Markdown tables (a `|` or a line break).
fn name_problem(name: &str) -> Option<&'static str> {
    let path = Path::new(name);
    let plain = path.components().count() == 1
        && path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !plain {
        Some("must be one plain directory name")
    } else if name.len() > 255 {
        Some("is longer than a file name may be (255 bytes)")
    } else if name.contains('|') || name.chars().any(char::is_control) {
        Some("holds a `|` or a control character, which would break the report's tables")
    } else {
        None
    }
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
        // Named like a run config's errors: line, key path, the closest key (`seed` for `seeds`).
        let exp: Self = toml::from_str(&text).map_err(|e| {
            crate::train::config::explain_toml_error(&e, &text, &path.display().to_string(), true)
        })?;
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
        // An empty `results_dir` put the report, the plots and every run in the current directory.
        if exp
            .results_dir
            .as_ref()
            .is_some_and(|d| d.as_os_str().is_empty())
        {
            bail!(
                "{}: `results_dir` is empty: name a folder for the runs and the report",
                path.display()
            );
        }
        // The name is the results directory's last part when `results_dir` is not given:
        // `experiments/results/<name>`; "" or "../x" would put the study's runs and report elsewhere.
        if let Some(problem) = name_problem(&exp.name).filter(|_| exp.results_dir.is_none()) {
            bail!(
                "{}: name {:?} {problem} (the results go to experiments/results/<name> unless \
                 `results_dir` says otherwise)",
                path.display(),
                exp.name
            );
        }
        let mut names = std::collections::BTreeSet::new();
        for v in &exp.variants {
            if let Some(problem) = name_problem(&v.name) {
                bail!(
                    "{}: variant name {:?} {problem} (it names the variant's run directory under the \
                     results directory, and its rows in the report)",
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
            for set in v.set.keys() {
                if let Some((key, why)) = set_by_the_experiment(set) {
                    bail!(
                        "{}: variant {:?} sets `{set}`, which an experiment sets for every run as \
                         `{key}` ({why})",
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

    /// The experiment with `--set KEY=VALUE` overrides (`sets`, each applied to every run's config after
    /// its variant's `set`) and its results in `results_dir`, which the overrides require: runs under
    /// other settings never go among the experiment's own results (a committed study's).
    pub fn with_overrides(
        mut self,
        sets: &[String],
        results_dir: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        for text in sets {
            let (key, value) = crate::train::config::overrides::parse_override(text)?;
            if let Some((own, why)) = set_by_the_experiment(&key) {
                bail!("--set {text}: an experiment sets `{own}` for every run ({why})");
            }
            self.overrides.push((key, value));
        }
        match results_dir {
            Some(dir) if dir.as_os_str().is_empty() => {
                bail!("--results-dir is empty: name a folder for the runs and the report")
            }
            Some(dir) => self.results_dir = Some(dir),
            None if !sets.is_empty() => bail!(
                "--set changes the experiment's runs: give them their own folder with --results-dir \
                 (beside {}, its runs under the file's settings)",
                self.results().display()
            ),
            None => {}
        }
        Ok(self)
    }

    /// Where the runs and the report go: `results_dir`, by default `experiments/results/<name>`.
    pub fn results(&self) -> PathBuf {
        self.results_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("experiments/results").join(&self.name))
    }
}

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
    /// The command line's `--set` ([`ExperimentConfig::overrides`]), after each variant's.
    overrides: Vec<(String, toml::Value)>,
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
            overrides: exp.overrides.clone(),
        })
    }

    /// The config of `v` at `seed` in `run_dir`.
    fn config(&self, v: &Variant, seed: u64, run_dir: &Path) -> anyhow::Result<TrainConfig> {
        let mut doc = self.base.clone();
        for (k, val) in &v.set {
            set_dotted(&mut doc, k, val.clone())
                .with_context(|| format!("{}: variant {:?}", self.path.display(), v.name))?;
        }
        for (k, val) in &self.overrides {
            set_dotted(&mut doc, k, val.clone()).with_context(|| format!("--set {k}"))?;
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
             `set` and the command line's applied)",
            self.path.display(),
            v.name
        );
        TrainConfig::from_toml(&toml::to_string(&doc)?, &origin).map_err(|e| {
            let message = format!("{e:#}");
            match self.setter_of(v, message.strip_prefix(&origin).unwrap_or(&message)) {
                Some(note) => e.context(note),
                None => e,
            }
        })
    }

    /// Where the key an error of `v`'s config names (its `message` after the origin) was set, where that
    /// was the variant's `set` or a `--set`: the error's line is of the config they were applied to, a
    /// text no file holds (an unknown key in a variant's `set` was reported at "line 29").
    fn setter_of(&self, v: &Variant, message: &str) -> Option<String> {
        let named = crate::train::config::key_named_in(message)?;
        let covers = |k: &str| {
            named == k || named.starts_with(&format!("{k}.")) || k.starts_with(&format!("{named}."))
        };
        if let Some((k, _)) = self.overrides.iter().rev().find(|(k, _)| covers(k)) {
            return Some(format!("`{named}`: given by `--set {k}=...`"));
        }
        let k = v.set.keys().find(|k| covers(k))?;
        let line = variant_set_line(self.path, &v.name)
            .map(|l| format!(", line {l}"))
            .unwrap_or_default();
        Some(format!(
            "`{named}`: set by variant {:?}'s `set` (`{k}`) in {}{line}",
            v.name,
            self.path.display()
        ))
    }
}

/// The line (from 1) of the `set` of the variant named `name` in the experiment file at `path`.
fn variant_set_line(path: &Path, name: &str) -> Option<usize> {
    let text = std::fs::read_to_string(path).ok()?;
    let doc = toml::de::DeTable::parse(&text).ok()?;
    let variants = doc.get_ref().get("variant")?.get_ref().as_array()?;
    let variant = variants
        .iter()
        .find(|v| v.get_ref().get("name").and_then(|n| n.get_ref().as_str()) == Some(name))?;
    let set = variant.get_ref().get("set")?;
    let at = set.span().start.min(text.len());
    Some(text[..at].matches('\n').count() + 1)
}

/// Runs every (variant, seed) not finished yet, then writes `report.md`; `backend`, when given, replaces
/// every run's `train.backend`.
pub fn run_experiment(
    path: &Path,
    quiet: bool,
    backend: Option<crate::ops::BackendKind>,
) -> anyhow::Result<PathBuf> {
    run_loaded_experiment(path, ExperimentConfig::load(path)?, quiet, backend)
}

/// [`run_experiment`] of the experiment `exp` read from `path` (with its command-line overrides:
/// [`ExperimentConfig::with_overrides`]).
pub fn run_loaded_experiment(
    path: &Path,
    exp: ExperimentConfig,
    quiet: bool,
    backend: Option<crate::ops::BackendKind>,
) -> anyhow::Result<PathBuf> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // An experiment file with a typo gets the parser's error explained: line, key, closest key.
        let exp = dir.join("exp.toml");
        std::fs::write(&exp, "name = \"x\"\nbase = \"b.toml\"\nseed = [1]\n").unwrap();
        let e = ExperimentConfig::load(&exp).unwrap_err().to_string();
        assert!(
            e.contains("line 3: unknown key `seed`; did you mean `seeds`?"),
            "{e}"
        );
        // An empty results folder would be the current directory.
        std::fs::write(
            &exp,
            "name = \"x\"\nbase = \"b.toml\"\nseeds = [1]\nresults_dir = \"\"\n[[variant]]\nname = \"a\"\n",
        )
        .unwrap();
        let e = ExperimentConfig::load(&exp).unwrap_err().to_string();
        assert!(e.contains("`results_dir` is empty"), "{e}");
    }
}
