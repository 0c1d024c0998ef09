//! RL checkpoints: model (HF format), optimizer state and trainer state (step, seed, data cursor and the
//! counters the loop carries), written into a temporary directory whose files are fsynced before it is
//! renamed into place (and the parent directory fsynced), so a crash or a SIGKILL never leaves a
//! half-written checkpoint where a good one was: `latest` only ever sees complete `step_*` directories.
//!
//! A resumed run is exact: the prompts and the rollout sampler of step `s` are derived from `(seed, s)`
//! (see `rl::rl_step`), so the data cursor is the step itself, and everything else the loop carries from
//! one step to the next is in [`TrainerState`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::ModuleOptimizer;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::model::save::save_pretrained;
use crate::model::Decoder;

/// Test-only hook: milliseconds to sleep between the files of a checkpoint, so a test can SIGKILL the
/// process in the middle of a write (`tests/reliability.rs`). Not meant for users.
pub const TEST_PAUSE_ENV: &str = "QARL_TEST_PAUSE_IN_CHECKPOINT_MS";

/// The version and commit of this build (`0.1.0+1a2b3c4d5e6f`), kept with every checkpoint.
pub const BUILD: &str = concat!(env!("CARGO_PKG_VERSION"), "+", env!("QARL_BUILD_COMMIT"));

/// What is needed to continue a run besides weights and optimizer moments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// The last completed RL step.
    pub step: usize,
    /// The run's seed (a resume with another seed would not continue the same run).
    #[serde(default)]
    pub seed: Option<u64>,
    /// The next step to run. Prompts and sampling seeds are a function of `(seed, step)`, so this is the
    /// whole data cursor and RNG state.
    #[serde(default)]
    pub next_step: usize,
    /// Steps in a row, up to `step`, whose update was skipped for a non-finite loss or gradient.
    #[serde(default)]
    pub consecutive_nonfinite: usize,
    /// Exponential moving average of the gradient norm (f64 bits, exact through JSON), for spike detection.
    #[serde(default)]
    pub grad_norm_ema_bits: Option<u64>,
    /// Non-zero gradient norms the average has taken in: a spike is flagged only once it has
    /// `GRAD_NORM_SPIKE_WARMUP` (5) (checkpoints written before the count was kept were past it).
    #[serde(default = "super::run::grad_norm_warmed_up")]
    pub grad_norms_seen: usize,
    /// The build that wrote the checkpoint ([`BUILD`]; absent in checkpoints written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
    /// The KL term's reference model, by its files' fingerprint
    /// ([`super::reference::files_fingerprint`]), where the run has one: a resume must find the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// The model the run started from (`model.dir` at its first step), by its files' fingerprint: a resume
    /// must find the same there (the prompts' tokenizer and end tokens come from it), and an experiment
    /// pools only seeds of a variant that started from one model. Absent in checkpoints written before it
    /// was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_model: Option<String>,
    /// The training set's fingerprint ([`crate::tasks::Task::training_fingerprint`]; none for arithmetic):
    /// a resume over an edited data file is refused unless `--accept-changes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_data: Option<String>,
}

impl TrainerState {
    /// What no run writes in a state after `step` (an edited or damaged file), if anything: more non-finite
    /// steps in a row than steps (a resume went on counting from it, and a count near the integer limit
    /// overflowed at the next non-finite step), or a gradient-norm average that is not a finite,
    /// non-negative number (NaN turned spike detection off for good, -inf flagged every step).
    pub fn impossible(&self) -> Option<String> {
        let steps_done = self.step.saturating_add(1);
        if self.consecutive_nonfinite > steps_done {
            return Some(format!(
                "says {} non-finite steps in a row after {steps_done} steps",
                self.consecutive_nonfinite
            ));
        }
        let ema = self.grad_norm_ema_bits.map(f64::from_bits);
        if let Some(e) = ema.filter(|e| !e.is_finite() || *e < 0.0) {
            return Some(format!(
                "has a gradient-norm average of {e} (grad_norm_ema_bits), not a finite norm"
            ));
        }
        None
    }

    /// The state of a run with `seed` that has done no RL step yet.
    pub fn fresh(seed: u64) -> Self {
        Self {
            step: 0,
            seed: Some(seed),
            next_step: 0,
            consecutive_nonfinite: 0,
            grad_norm_ema_bits: None,
            grad_norms_seen: 0,
            build: Some(BUILD.to_string()),
            reference: None,
            start_model: None,
            train_data: None,
        }
    }

    /// The state after step `step` of a run with `seed`.
    pub fn after_step(step: usize, seed: u64) -> Self {
        Self {
            step,
            seed: Some(seed),
            next_step: step + 1,
            consecutive_nonfinite: 0,
            grad_norm_ema_bits: None,
            grad_norms_seen: 0,
            build: Some(BUILD.to_string()),
            reference: None,
            start_model: None,
            train_data: None,
        }
    }
}

/// The optimizer state is keyed by parameter id, and a model loaded from disk gets fresh ids: the
/// checkpoint keeps the ids of its float parameters in visiting order so a resumed model takes them back
/// and finds its Adam moments (without this, a resume silently restarts the optimizer).
pub const PARAM_IDS_FILE: &str = "param_ids.json";

/// The ids of `model`'s float parameters, in visiting order.
pub fn param_ids(model: &Decoder) -> Vec<u64> {
    struct Ids(Vec<u64>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id.val());
        }
    }
    let mut v = Ids(vec![]);
    model.visit(&mut v);
    v.0
}

/// Gives `model`'s float parameters the ids `ids` (from [`param_ids`] of the model that was saved).
pub fn restore_param_ids(model: Decoder, ids: &[u64]) -> anyhow::Result<Decoder> {
    let have = param_ids(&model).len();
    if have != ids.len() {
        anyhow::bail!(
            "the checkpoint lists {} parameters but the model has {have}",
            ids.len()
        );
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(id) = ids.iter().find(|&&id| !seen.insert(id)) {
        anyhow::bail!("the checkpoint lists parameter id {id} twice");
    }
    struct Ids<'a>(std::slice::Iter<'a, u64>);
    impl ModuleMapper for Ids<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, value, mapper) = param.consume();
            let id = self.0.next().map_or(id, |&v| ParamId::from(v));
            Param::from_mapped_value(id, value, mapper)
        }
    }
    Ok(model.map(&mut Ids(ids.iter())))
}

/// Loads the model of checkpoint `dir` on `device` with the parameter ids its optimizer state refers to.
pub fn load_model(dir: &Path, device: &burn::tensor::Device) -> anyhow::Result<Decoder> {
    let model = Decoder::load(dir, device)?;
    let ids_path = dir.join(PARAM_IDS_FILE);
    // Every checkpoint is written with it: without it the Adam moments would silently restart, and the
    // resumed run would differ from an uninterrupted one.
    if !ids_path.is_file() {
        anyhow::bail!(
            "{}: missing, so the optimizer state cannot be matched to the parameters and the checkpoint is \
             incomplete; move {} away to resume from an older checkpoint",
            ids_path.display(),
            dir.display()
        );
    }
    let ids: Vec<u64> = crate::io::read_json(&ids_path)?;
    restore_param_ids(model, &ids).with_context(|| format!("{}", ids_path.display()))
}

pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

fn test_pause() {
    if let Some(ms) = std::env::var(TEST_PAUSE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// fsyncs a file or a directory.
fn sync_path(p: &Path) -> anyhow::Result<()> {
    std::fs::File::open(p)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("{}: cannot fsync", p.display()))
}

/// Writes the checkpoint of `state.step` (replacing one of the same step), then keeps only the newest
/// `keep` checkpoints (0: all).
#[allow(clippy::too_many_arguments)]
pub fn save(
    run_dir: &Path,
    state: &TrainerState,
    model: &Decoder,
    config_json: &serde_json::Value,
    optim: &ModuleOptimizer,
    tok_dir: &Path,
    keep: usize,
) -> anyhow::Result<PathBuf> {
    let parts = Parts {
        model,
        config_json,
        optim,
        tok_dir,
        extra: &[],
    };
    save_in(&checkpoints_dir(run_dir), state, &parts, keep)
}

/// What a checkpoint holds besides its [`TrainerState`].
pub struct Parts<'a> {
    pub model: &'a Decoder,
    pub config_json: &'a serde_json::Value,
    pub optim: &'a ModuleOptimizer,
    /// Where `tokenizer.json` and `tokenizer_config.json` are copied from.
    pub tok_dir: &'a Path,
    /// More JSON files (name, content), such as the warm start's `sft.json`.
    pub extra: &'a [(&'a str, serde_json::Value)],
}

/// Checks that checkpoints can be written under `root` (made where missing), by writing and removing an
/// empty temporary directory there: a run whose checkpoints folder is read-only or full did its step, logged
/// it, then failed at the save, and the step was lost.
pub fn check_writable(root: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(root).with_context(|| format!("{}: cannot create", root.display()))?;
    tempfile::Builder::new()
        .prefix(".tmp-ckpt")
        .tempdir_in(root)
        .map(drop)
        .map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot write a checkpoint there ({}); make it writable before the run's steps are \
                 done for nothing",
                root.display(),
                crate::io::os_error_text(&e)
            )
        })
}

/// Writes the checkpoint of `state.step` under `root` (replacing one of the same step), then keeps only the
/// newest `keep` checkpoints there (0: all).
pub fn save_in(
    root: &Path,
    state: &TrainerState,
    parts: &Parts,
    keep: usize,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(root).with_context(|| format!("{}: cannot create", root.display()))?;
    remove_leftovers(root);
    let tmp = tempfile::Builder::new()
        .prefix(".tmp-ckpt")
        .tempdir_in(root)
        .with_context(|| format!("{}: cannot create a temporary directory", root.display()))?;
    save_pretrained(parts.model, parts.config_json, tmp.path())?;
    test_pause();
    parts
        .optim
        .save(tmp.path().join(OPTIMIZER_FILE))
        .map_err(|e| {
            anyhow::anyhow!("{}: cannot save the optimizer state ({e})", root.display())
        })?;
    test_pause();
    // The model's own tokens, template and end tokens: without them a checkpoint prompted in ChatML and
    // stopped at other tokens than its run (`qarl eval` on one scored 0.000 where `model.dir` scored 0.500).
    crate::model::checkpoint::copy_side_files(parts.tok_dir, tmp.path())?;
    for (name, value) in parts.extra {
        crate::io::write_json_atomic(&tmp.path().join(name), value)?;
    }
    crate::io::write_json_atomic(&tmp.path().join(PARAM_IDS_FILE), &param_ids(parts.model))?;
    write_manifest(tmp.path())?;
    crate::io::write_json_atomic(&tmp.path().join(STATE_FILE), state)?;
    // Every file on disk before the directory becomes visible under its final name.
    for e in std::fs::read_dir(tmp.path())?.flatten() {
        if e.path().is_file() {
            sync_path(&e.path())?;
        }
    }
    sync_path(tmp.path())?;
    crate::io::set_usual_permissions(tmp.path());
    let dst = root.join(format!("{STEP_PREFIX}{:06}", state.step));
    let kept = tmp.keep();
    // Replacing a checkpoint of the same step: move the old one aside first, so there is always one.
    let old = root.join(format!(".old-step_{:06}", state.step));
    if dst.exists() {
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&dst, &old)
            .with_context(|| format!("{}: cannot move the old checkpoint aside", dst.display()))?;
    }
    std::fs::rename(&kept, &dst)
        .with_context(|| format!("{}: cannot move the checkpoint into place", dst.display()))?;
    sync_path(root)?;
    let _ = std::fs::remove_dir_all(&old);
    if keep > 0 {
        prune_in(root, keep)?;
    }
    Ok(dst)
}

/// The optimizer state inside a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.bpk";
/// The [`TrainerState`] inside a checkpoint.
pub const STATE_FILE: &str = "trainer_state.json";
/// A checkpoint directory is this prefix and the step (6 digits).
const STEP_PREFIX: &str = "step_";
/// Where pruning moves a checkpoint before deleting it, so a kill in the middle of the deletion never
/// leaves a partial directory under a valid `step_*` name.
const PRUNED_PREFIX: &str = ".pruned-step_";

/// Removes what a killed writer left behind (temporary, set-aside and half-pruned directories) under a
/// checkpoints folder `root`; call with the run's lock held.
pub fn remove_leftovers(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        // A checkpoint set aside to be replaced, whose replacement never arrived (a kill between the two
        // renames): it is the only one of its step, so it goes back under its name.
        if let Some(step) = name.strip_prefix(".old-step_") {
            let back = root.join(format!("{STEP_PREFIX}{step}"));
            if !back.exists() && std::fs::rename(e.path(), &back).is_ok() {
                continue;
            }
        }
        if is_leftover(&name) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Whether `name`, an entry of a checkpoints folder, is a checkpoint or what a killed writer left
/// ([`remove_leftovers`]): the entries qarl writes there.
fn written_by_a_run(name: &str) -> bool {
    step_of_name(name).is_some() || is_leftover(name)
}

/// Whether `name` is a temporary, set-aside or half-pruned directory a killed writer left.
fn is_leftover(name: &str) -> bool {
    name.starts_with(".tmp-ckpt")
        || name.starts_with(".old-step_")
        || name.starts_with(PRUNED_PREFIX)
}

/// Removes every checkpoint of a run under its checkpoints folder `root` (with what killed writers
/// left), then `root` once empty. Returns the entries left, which no run wrote (a user's files kept
/// there): a fresh run (`--overwrite`) deleted the whole folder, and those with it.
pub fn remove_all(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(crate::io::failed(root, "cannot list")(e)),
    };
    let mut left = Vec::new();
    for e in entries {
        let e = e.map_err(crate::io::failed(root, "cannot list"))?;
        let name = e.file_name().to_string_lossy().to_string();
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && written_by_a_run(&name) {
            std::fs::remove_dir_all(e.path())
                .map_err(crate::io::failed(&e.path(), "cannot remove"))?;
        } else {
            left.push(e.path());
        }
    }
    if left.is_empty() {
        std::fs::remove_dir(root).map_err(crate::io::failed(root, "cannot remove"))?;
    }
    Ok(left)
}

/// The step in the name of checkpoint directory `dir`.
fn newest_step(dir: &Path) -> Option<usize> {
    step_of_name(&dir.file_name()?.to_string_lossy())
}

/// The step in a checkpoint directory's name (`step_000012` -> 12).
fn step_of_name(name: &str) -> Option<usize> {
    name.strip_prefix(STEP_PREFIX)?.parse().ok()
}

/// Every complete checkpoint of a run, oldest first.
pub fn list(run_dir: &Path) -> Vec<(PathBuf, TrainerState)> {
    list_in(&checkpoints_dir(run_dir))
}

/// Every complete checkpoint under `root`, oldest first (directories whose state cannot be read are left
/// out: [`latest_checked_in`] reports them when they are the newest).
pub fn list_in(root: &Path) -> Vec<(PathBuf, TrainerState)> {
    // A listing only: a folder that cannot be listed holds none here (a resume reports it).
    let mut all: Vec<(PathBuf, TrainerState)> = step_dirs(root)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(named, p)| {
            let state = crate::io::read_json::<TrainerState>(&p.join(STATE_FILE)).ok()?;
            // A state whose step is not its folder's was edited or damaged: not a checkpoint to resume.
            if state.step != named {
                tracing::warn!(
                    checkpoint = %p.display(),
                    step = state.step,
                    "the trainer state's step is not its folder's; the checkpoint is left out"
                );
                return None;
            }
            Some((p, state))
        })
        .collect();
    all.sort_by_key(|(_, s)| s.step);
    all
}

/// The `step_*` directories under `root` with the step of their name, oldest first; none where nothing is
/// there. A folder that is there but cannot be listed (a link to an unmounted disk, a link loop, no
/// permission) is an error: read as holding no checkpoints, a resume started RL over and dropped the run's
/// rows.
fn step_dirs(root: &Path) -> anyhow::Result<Vec<(usize, PathBuf)>> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if root.symlink_metadata().is_ok() => anyhow::bail!(
            "{}: cannot be listed ({}), so its checkpoints cannot be found; make it readable (or the disk \
             it links to present) to resume, or move it away to start over",
            root.display(),
            crate::io::os_error_text(&e)
        ),
        Err(_) => return Ok(vec![]),
    };
    let mut all: Vec<(usize, PathBuf)> = entries
        .flatten()
        .filter_map(|e| Some((step_of_name(&e.file_name().to_string_lossy())?, e.path())))
        .collect();
    all.sort();
    Ok(all)
}

/// Keeps the newest `keep` checkpoints of a run.
pub fn prune(run_dir: &Path, keep: usize) -> anyhow::Result<()> {
    prune_in(&checkpoints_dir(run_dir), keep)
}

/// Keeps the newest `keep` checkpoints under `root`. Each one removed is first renamed to a hidden name, so a
/// kill during the deletion leaves no partial directory that looks like a checkpoint.
pub fn prune_in(root: &Path, keep: usize) -> anyhow::Result<()> {
    let all = list_in(root);
    let n = all.len().saturating_sub(keep);
    for (p, s) in &all[..n] {
        let doomed = root.join(format!("{PRUNED_PREFIX}{:06}", s.step));
        let _ = std::fs::remove_dir_all(&doomed);
        std::fs::rename(p, &doomed)
            .with_context(|| format!("{}: cannot move aside to remove", p.display()))?;
        test_pause();
        std::fs::remove_dir_all(&doomed)
            .with_context(|| format!("{}: cannot remove", doomed.display()))?;
    }
    Ok(())
}

/// The newest complete checkpoint of a run, if any.
pub fn latest(run_dir: &Path) -> Option<(PathBuf, TrainerState)> {
    list(run_dir).pop()
}

/// The newest checkpoint of a run, or an error when the newest `step_*` directory cannot be used (its
/// trainer state missing or unreadable): resuming from an older one instead would silently redo steps.
pub fn latest_checked(run_dir: &Path) -> anyhow::Result<Option<(PathBuf, TrainerState)>> {
    latest_checked_in(&checkpoints_dir(run_dir))
}

/// [`latest_checked`] for the checkpoints under `root`.
pub fn latest_checked_in(root: &Path) -> anyhow::Result<Option<(PathBuf, TrainerState)>> {
    let Some((_, newest)) = step_dirs(root)?.pop() else {
        return Ok(None);
    };
    let state_path = newest.join(STATE_FILE);
    let problem = if !state_path.is_file() {
        "is missing".to_string()
    } else {
        match crate::io::read_json::<TrainerState>(&state_path) {
            // Edited or damaged: resumed, it redid steps on the newest weights and replaced good
            // checkpoints.
            Ok(state) if Some(state.step) != newest_step(&newest) => {
                format!("says step {}, not its folder's", state.step)
            }
            Ok(state) => match state.impossible() {
                Some(problem) => problem,
                None => return Ok(Some((newest, state))),
            },
            Err(e) => format!("cannot be read ({})", e.root_cause()),
        }
    };
    let older = list_in(root)
        .into_iter()
        .rev()
        .find(|(p, _)| p != &newest)
        .map_or("start over with --overwrite".to_string(), |(p, s)| {
            format!("resume from step {} ({})", s.step, p.display())
        });
    anyhow::bail!(
        "{}: {problem}, so the newest checkpoint {} is unusable; move that directory away to {older}",
        state_path.display(),
        newest.display()
    )
}

/// The fingerprints of a checkpoint's weights, optimizer state and parameter ids, written with them: the
/// optimizer's moments are keyed by the ids, and burn matches them by count alone, so an optimizer file or
/// an ids file from another run (or edited) restarted or misplaced the moments without a word, or
/// panicked at the first step.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The files [`MANIFEST_FILE`] vouches for: the weights, the optimizer state, the parameter ids and the
/// model config (which a resume builds the model from: an edited `rope_theta` went on into every later
/// checkpoint without a word).
fn manifest_files() -> Vec<String> {
    [
        "model.safetensors",
        OPTIMIZER_FILE,
        PARAM_IDS_FILE,
        "config.json",
    ]
    .map(String::from)
    .to_vec()
}

/// The files of [`manifest_files`] that manifests written before they were added lack: such a manifest
/// vouches for the others alone.
const LATER_MANIFEST_FILES: [&str; 1] = ["config.json"];

fn manifest_of(dir: &Path) -> anyhow::Result<serde_json::Value> {
    let mut m = serde_json::Map::new();
    for name in manifest_files() {
        let fp = crate::io::fingerprint_of(dir, std::slice::from_ref(&name))?;
        m.insert(name, fp.into());
    }
    Ok(m.into())
}

fn write_manifest(dir: &Path) -> anyhow::Result<()> {
    crate::io::write_json_atomic(&dir.join(MANIFEST_FILE), &manifest_of(dir)?)
}

/// Refuses a checkpoint whose weights, optimizer state or parameter ids are not those it was written with
/// ([`MANIFEST_FILE`]; checkpoints written before it are not checked).
pub fn check_manifest(dir: &Path) -> anyhow::Result<()> {
    let path = dir.join(MANIFEST_FILE);
    if !path.is_file() {
        return Ok(());
    }
    let written: serde_json::Value = crate::io::read_json(&path)?;
    if !written.is_object() {
        anyhow::bail!(
            "{}: not a JSON object of file fingerprints; move {} away to resume from an older checkpoint",
            path.display(),
            dir.display()
        );
    }
    let now = manifest_of(dir)?;
    for name in manifest_files() {
        if written.get(&name).is_none() && LATER_MANIFEST_FILES.contains(&name.as_str()) {
            continue;
        }
        if written.get(&name) != now.get(&name) {
            let harm = if name == "config.json" {
                "the model would be rebuilt from another config than the one it was trained under"
            } else {
                "the optimizer's moments would be restarted or put on other parameters"
            };
            anyhow::bail!(
                "{}: {name} is not the file this checkpoint was written with (fingerprint {} in {MANIFEST_FILE}, \
                 {} now): {harm}; restore it, or move {} away to resume from an older checkpoint",
                dir.display(),
                written.get(&name).unwrap_or(&serde_json::Value::Null),
                now[&name],
                dir.display()
            );
        }
    }
    Ok(())
}

/// Loads the optimizer state of checkpoint `dir` into `optim`; a missing or damaged file is named with what
/// is wrong with it, and so is one that is not the checkpoint's own ([`check_manifest`]) or that does not fit
/// `model`'s parameters ([`check_optimizer_fits`]).
pub fn load_optimizer(
    optim: ModuleOptimizer,
    dir: &Path,
    model: &Decoder,
) -> anyhow::Result<ModuleOptimizer> {
    let path = dir.join(OPTIMIZER_FILE);
    let len = match std::fs::metadata(&path) {
        Ok(m) => m.len(),
        Err(_) => anyhow::bail!(
            "{}: missing, so the checkpoint is incomplete and its Adam moments are lost; move {} away to \
             resume from an older checkpoint",
            path.display(),
            dir.display()
        ),
    };
    let unreadable = |detail: String| unreadable_optimizer(&path, dir, len, detail);
    // The header and the tensors' descriptions only: the moments are read once, by the load below.
    let pack = burn_pack::Reader::from_file_exact(&path).map_err(|e| unreadable(e.to_string()))?;
    check_manifest(dir)?;
    check_optimizer_fits(pack, &param_shapes(model)).map_err(|what| {
        anyhow::anyhow!(
            "{}: {what}, so the first update would fail or restart moments without a word; move {} away \
             to resume from an older checkpoint",
            path.display(),
            dir.display()
        )
    })?;
    optim.load(&path).map_err(|e| unreadable(e.to_string()))
}

/// The error for an optimizer file that cannot be read: truncated, or not an optimizer state, in words
/// rather than the record library's variants.
fn unreadable_optimizer(path: &Path, dir: &Path, len: u64, detail: String) -> anyhow::Error {
    let mut detail = detail;
    for prefix in ["Record I/O error: ", "Validation error: ", "I/O error: "] {
        if let Some(rest) = detail.strip_prefix(prefix) {
            detail = rest.to_string();
        }
    }
    let what = if detail.contains("fill whole buffer") || detail.contains("unexpected end") {
        format!("truncated ({len} bytes)")
    } else if let Some(rest) = detail.strip_prefix("File truncated: ") {
        format!("truncated ({rest})")
    } else {
        format!("not a valid optimizer state ({detail})")
    };
    anyhow::anyhow!(
        "{}: {what}; move {} away to resume from an older checkpoint",
        path.display(),
        dir.display()
    )
}

/// The shape of each of `model`'s float parameters, by parameter id.
pub fn param_shapes(model: &Decoder) -> HashMap<u64, Vec<usize>> {
    struct Shapes(HashMap<u64, Vec<usize>>);
    impl ModuleVisitor for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.insert(param.id.val(), param.val().dims().to_vec());
        }
    }
    let mut v = Shapes(HashMap::new());
    model.visit(&mut v);
    v.0
}

/// The suffix of the scalar in which burn's optimizer record keeps each parameter's rank
/// (`"{param_id}.__rank"`).
const RANK_SUFFIX: &str = ".__rank";

/// What makes optimizer state `pack` unfit for a model whose parameters have `shapes` (by id), if anything.
/// burn matches the state to the parameters by id alone: a state tensor without an id panics the load, one of
/// another shape or rank panics the first update, and a state for an id the model lacks, or with a moment
/// missing, is dropped and its moments restart silently. Checkpoints with a manifest are already the files
/// they were written with; this also covers those written before it, and any other damage that parses.
pub fn check_optimizer_fits(
    pack: burn_pack::Reader,
    shapes: &HashMap<u64, Vec<usize>>,
) -> Result<(), String> {
    let shape_of = |id: u64, item: &str| {
        shapes.get(&id).ok_or_else(|| {
            format!("{item} belongs to parameter id {id}, which the model does not have")
        })
    };
    for (key, value) in pack.scalars() {
        let Some(id) = key.strip_suffix(RANK_SUFFIX) else {
            continue;
        };
        let id: u64 = id
            .parse()
            .map_err(|_| format!("scalar `{key}` names no parameter id"))?;
        let shape = shape_of(id, &format!("scalar `{key}`"))?;
        if u64::try_from(*value).ok() != Some(shape.len() as u64) {
            return Err(format!(
                "scalar `{key}` gives rank {value:?} to a parameter of shape {shape:?}"
            ));
        }
    }
    let tensors = pack.into_tensors().map_err(|e| e.to_string())?;
    let mut fields: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for t in &tensors {
        let item = format!("tensor `{}`", t.name);
        let id = t
            .param_id
            .ok_or_else(|| format!("{item} carries no parameter id"))?;
        let shape = shape_of(id, &item)?;
        if t.shape.as_slice() != shape.as_slice() {
            return Err(format!(
                "{item} has shape {:?}, its parameter (id {id}) {shape:?}",
                t.shape.as_slice()
            ));
        }
        if t.dtype != burn_pack::DType::F32 {
            return Err(format!("{item} holds {:?}, not f32", t.dtype));
        }
        let field = t.name.strip_prefix(&format!("{id}.")).unwrap_or(&t.name);
        fields.entry(id).or_default().push(field.to_string());
    }
    // Every parameter with a state has the same fields (Adam's two moments).
    let mut states = fields.iter();
    if let Some((first_id, first)) = states.next() {
        if let Some((id, f)) = states.find(|(_, f)| f != &first) {
            return Err(format!(
                "parameter id {id} has state {f:?} where parameter id {first_id} has {first:?}"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The write check leaves nothing behind where it can write, and names the folder where it cannot.
    #[test]
    fn checkpoints_are_checked_writable_before_the_steps() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("run/checkpoints");
        super::check_writable(&root).unwrap();
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
        let blocked = tmp.path().join("file");
        std::fs::write(&blocked, "").unwrap();
        let err = super::check_writable(&blocked.join("checkpoints"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("file/checkpoints: cannot create"), "{err}");
    }

    /// A checkpoint set aside for its replacement that never arrived goes back under its name; one whose
    /// replacement is there, and temporary directories, are removed.
    #[test]
    fn a_set_aside_checkpoint_without_its_replacement_is_restored() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        for d in [
            ".old-step_000003",
            ".old-step_000004",
            "step_000004",
            ".tmp-ckpt1",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
            std::fs::write(root.join(d).join("mark"), d).unwrap();
        }
        super::remove_leftovers(root);
        let mut names: Vec<String> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        names.sort();
        assert_eq!(names, ["step_000003", "step_000004"]);
        let mark = |d: &str| std::fs::read_to_string(root.join(d).join("mark")).unwrap();
        assert_eq!(mark("step_000003"), ".old-step_000003");
        assert_eq!(mark("step_000004"), "step_000004");
    }
}
