//! The training loops: supervised warm start and RL (QaRL). The only module that knows the whole step.

pub mod batch;
pub mod bench;
pub mod checkpoint;
pub mod compare;
pub mod config;
pub mod eval;
pub mod experiment;
pub mod lock;
pub mod metrics;
mod model_dir;
pub mod paired;
pub mod plot;
pub mod progress;
pub mod rl;
pub mod scored;
pub mod sft;
pub mod update;

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::module::Module;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::AdamWConfig;
use burn::tensor::Device;

pub use config::TrainConfig;
use metrics::MetricsLog;

use crate::model::{Decoder, Tokenizer};
use crate::tasks::Task;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub run_dir: PathBuf,
    pub metrics_path: PathBuf,
    pub accuracy_before: Option<f64>,
    pub accuracy_after: Option<f64>,
    /// Greedy accuracy before vs after RL in the rollout precision, problem by problem (`None` when the
    /// run stopped early or the evaluation before RL is not in the metrics log).
    pub paired: Option<paired::PairedComparison>,
}

pub(crate) fn eos_id(tok: &Tokenizer, model: &Decoder) -> anyhow::Result<u32> {
    tok.token_to_id("<eos>")
        .or_else(|| tok.token_to_id("<|im_end|>"))
        .or_else(|| tok.token_to_id("<|endoftext|>"))
        .or_else(|| model.config.eos_token_ids.first().copied())
        .context("the tokenizer has no end-of-sequence token and config.json no eos_token_id")
}

/// Makes sure `cfg.model.dir` holds a model: created from `init_config` with random weights and the task's
/// character tokenizer, or from the pretrained `base`, then warm-started with `[sft]`, when it does not
/// exist yet. Locks the run directory
/// while it works; a warm start that was stopped continues from its newest checkpoint.
pub fn prepare_model(
    cfg: &TrainConfig,
    device: &Device,
    log: &mut MetricsLog,
    quiet: bool,
) -> anyhow::Result<()> {
    let _lock = lock::RunLock::acquire(&cfg.run_dir)?;
    prepare_model_locked(cfg, device, log, quiet, true)
}

/// [`prepare_model`] in a run directory this process has locked; with `resume`, the warm start continues
/// from its newest checkpoint (otherwise its checkpoints are removed and it starts over).
fn prepare_model_locked(
    cfg: &TrainConfig,
    device: &Device,
    log: &mut MetricsLog,
    quiet: bool,
    resume: bool,
) -> anyhow::Result<()> {
    let dir = &cfg.model.dir;
    let sft_root = sft::checkpoints_root(&cfg.run_dir);
    if dir.join("config.json").is_file() {
        // The resume points of a warm start that finished (a kill can come between the two steps).
        if sft_root.exists() {
            std::fs::remove_dir_all(&sft_root)
                .with_context(|| format!("{}: cannot remove", sft_root.display()))?;
        }
        // A changed `[sft]` section would otherwise seem to be taken: said whatever `quiet` says (it
        // silences progress, not what the run does).
        if cfg.sft.is_some() {
            tracing::warn!(
                "model: {} exists, so the [sft] warm start does not run: its weights are used as they are \
                 (expected where runs share a warm start; remove the folder to warm-start again with this \
                 config's [sft])",
                dir.display()
            );
        }
        return Ok(());
    }
    model_dir::check_free(dir)?;
    let staging = model_dir::fresh_staging(dir)?;
    // Where the starting weights are read from: the pretrained base, or the staged random checkpoint.
    let weights_dir = match (&cfg.model.base, &cfg.model.init_config) {
        (Some(base), _) => {
            model_dir::stage_base_files(base, &staging)?;
            base.clone()
        }
        (None, Some(init)) => {
            model_dir::check_fits_char_tokenizer(init)?;
            crate::model::init::write_random_checkpoint(init, &staging, cfg.seed, cfg.model.init_std)?;
            crate::tasks::char_tokenizer::save(&staging)?;
            staging.clone()
        }
        (None, None) => anyhow::bail!(
            "{}: no model there and neither `model.init_config` nor `model.base` to create one from",
            dir.display()
        ),
    };
    if let Some(sft) = &cfg.sft {
        let model = Decoder::load_full_precision(&weights_dir, device)?;
        // The files the user gave: the base's, or (random weights) the model folder to be; the staging
        // folder is the warm start's own.
        let named = cfg.model.base.as_deref().unwrap_or(dir);
        let tok = Tokenizer::load_for(&staging, &model.config)?.with_context(|| {
            format!(
                "{}: `model.base` has no tokenizer.json; the warm start trains on the task's text and needs one",
                named.display()
            )
        })?;
        check_chat_tokens(cfg, &tok, named)?;
        let eos = eos_id(&tok, &model)?;
        let json: serde_json::Value = crate::io::read_json(&weights_dir.join("config.json"))?;
        let ck = sft::SftCheckpoints {
            root: sft_root.clone(),
            every: cfg.checkpoint_every,
            resume,
            config_json: &json,
            tok_dir: &staging,
        };
        let (model, loss) = sft::run_sft_with(model, &tok, eos, cfg, sft, log, quiet, Some(&ck))?;
        tracing::info!(loss, "sft finished");
        // The warm start writes f32 weights whatever the base held: a base's `torch_dtype` of bfloat16
        // kept beside them would have loaders cast the fine-tuned weights back down.
        let mut json = json;
        if let Some(m) = json.as_object_mut() {
            for key in ["torch_dtype", "dtype"] {
                if m.contains_key(key) {
                    m.insert(key.into(), serde_json::json!("float32"));
                }
            }
        }
        crate::model::save::save_pretrained(&model, &json, &staging)?;
    }
    model_dir::move_into_place(&staging, dir)?;
    if sft_root.exists() {
        std::fs::remove_dir_all(&sft_root)
            .with_context(|| format!("{}: cannot remove", sft_root.display()))?;
    }
    Ok(())
}

/// The task's chat template against `tok` ([`Tokenizer::check_chatml`]), where the template's own
/// `model_dir`, else `model_dir`, declares none.
fn check_chat_tokens(cfg: &TrainConfig, tok: &Tokenizer, model_dir: &Path) -> anyhow::Result<()> {
    match cfg.task.chat_template() {
        Some(chat) => tok.check_chatml(chat.model_dir.as_deref().unwrap_or(model_dir)),
        None => Ok(()),
    }
}

/// The RL optimizer of `tc`: AdamW with its weight decay and epsilon, and gradient clipping by norm.
pub fn optimizer(tc: &config::RlConfig) -> burn::optim::ModuleOptimizer {
    let mut optim_cfg = AdamWConfig::new()
        .with_weight_decay(tc.weight_decay)
        .with_epsilon(tc.adam_eps);
    if tc.grad_clip > 0.0 {
        optim_cfg = optim_cfg.with_grad_clipping(Some(GradientClippingConfig::Norm(tc.grad_clip)));
    }
    optim_cfg.init()
}

/// How to run the RL loop.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue from the newest checkpoint of the run directory.
    pub resume: bool,
    /// No progress bars.
    pub quiet: bool,
    /// Stop right after this step (and its checkpoint, when one is due) as if the process had been
    /// killed: no final evaluation or checkpoint (for tests of `resume`).
    pub stop_after_step: Option<usize>,
    /// Steps whose loss is made NaN (fault injection for tests of the non-finite guard).
    pub inject_nonfinite_steps: Vec<usize>,
    /// Without `resume`, start over in a run directory that has checkpoints (deleting them); otherwise
    /// such a run is refused, so a typo'd command never destroys a run.
    pub overwrite: bool,
    /// With `resume`: go on although settings outside [`RESUME_MAY_CHANGE`] differ from the run's (a
    /// lower learning rate after a divergence). The run's earlier config is kept beside the new one
    /// (`config.before_step_N.json`) and the changed keys are logged, so the record of how the earlier
    /// rows were made stays.
    pub accept_changes: bool,
}

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

/// A step whose gradient norm exceeds this multiple of the moving average is logged as a spike.
pub const GRAD_NORM_SPIKE_FACTOR: f64 = 10.0;

/// Runs (or, with `resume`, continues) the RL run of `cfg`.
pub fn run(cfg: &TrainConfig, resume: bool, quiet: bool) -> anyhow::Result<RunSummary> {
    run_with(
        cfg,
        &RunOptions {
            resume,
            quiet,
            ..RunOptions::default()
        },
    )
}

/// Whether `consecutive` skipped (non-finite) steps in a row stop a loop of `steps` steps under
/// `train.max_nonfinite_steps = max` (0: never): at `max` of them, or, for a loop no longer than that,
/// when every step was skipped (it learned nothing). The RL loop and the warm start share the rule.
pub(crate) fn nonfinite_limit_reached(consecutive: usize, max: usize, steps: usize) -> bool {
    max > 0 && consecutive >= max.min(steps)
}

/// The rollout's sizes (and, given the task, its evaluation's: `eval.problems`, or the fewer problems a
/// data set holds out) against the model's positions and the machine's memory, before any prompt is drawn
/// (with one-token prompts: a lower bound; each step checks its real prompts again): a
/// `rollout.prompts_per_step` or `eval.problems` far too large is refused by name, not met as an
/// allocation failure after the first evaluation.
fn check_step_sizes(
    cfg: &TrainConfig,
    model: &crate::model::ModelConfig,
    evaluation: Option<&Task>,
) -> anyhow::Result<()> {
    let (r, e) = (&cfg.rollout, &cfg.eval);
    crate::rollout::check_rollout_size(
        model,
        "rollout.prompts_per_step / samples_per_prompt / max_new_tokens",
        r.prompts_per_step.saturating_mul(r.samples_per_prompt),
        1,
        r.max_new_tokens,
    )?;
    let Some(task) = evaluation else {
        return Ok(());
    };
    crate::rollout::check_rollout_size(
        model,
        "eval.problems / eval.k / eval.max_new_tokens",
        task.eval_size_at_most(e.problems)
            .saturating_mul(e.k.max(1)),
        1,
        e.max_new_tokens,
    )?;
    Ok(())
}

/// Sets what `cfg` decides for the whole process: deterministic mode (`train.deterministic`) and the order of
/// its low-bit products (`train.tensor_cores`, on the kernels `train.tensor_core_kernel` names, their
/// scale groups split as `train.fragment_group_splits` says). Every command that computes from a training config calls it
/// first (train, sft, bench step), so the warm start, the RL steps and the evaluations of a run all take
/// the same mode.
pub fn apply_process_modes(cfg: &TrainConfig) {
    crate::ops::set_deterministic(cfg.train.deterministic);
    if cfg.train.tensor_cores && cfg.rollout.precision.scheme().is_none() {
        tracing::warn!(
            "train.tensor_cores with rollout.precision = \"f32\": no low-bit product runs, so the setting \
             changes nothing"
        );
    }
    crate::ops::set_tensor_tiles(
        cfg.train
            .tensor_cores
            .then(|| cfg.train.activations.dtype()),
    );
    let fragments = cfg.train.tensor_cores
        && cfg.train.tensor_core_kernel == config::TensorCoreKernel::Fragments;
    crate::ops::set_fragment_tiles(fragments);
    crate::ops::set_fragment_group_splits(if fragments {
        cfg.train.fragment_group_splits
    } else {
        1
    });
}

/// What a resume may change against the run it continues (JSON pointers into the run's config.json):
/// how far it goes, what it evaluates and keeps, where it runs and from which paths, and the knobs that
/// change memory or checks but not what is computed. Everything else (the rollouts, the learner's
/// settings, the objective, the task, the verifier, the warm start, the seed, the metrics' definitions)
/// is the run's identity: rows after the checkpoint made under other values would be another experiment
/// under the same run's name, and its config.json would misstate how the earlier rows were made.
pub const RESUME_MAY_CHANGE: [&str; 12] = [
    "/run_dir",
    "/model",
    "/train/steps",
    "/train/backend",
    "/train/micro_batch_size",
    "/train/max_nonfinite_steps",
    "/train/lp_old_check",
    "/train/tensor_core_kernel",
    "/train/fragment_group_splits",
    "/eval/every",
    "/checkpoint_every",
    "/keep_checkpoints",
];

/// Refuses a resume whose config differs from the run's own (its `config.json`) anywhere outside
/// [`RESUME_MAY_CHANGE`], naming every key that differs ([`ResumeChanged`]); with `accept`, keeps the
/// earlier config as `config.before_step_{done}.json` and logs the changes instead.
fn check_resumed_config(cfg: &TrainConfig, accept: bool, done: usize) -> anyhow::Result<()> {
    let path = cfg.run_dir.join("config.json");
    if !path.is_file() {
        return Ok(());
    }
    // With the implicit defaults written out on both sides: a config saved from `qarl config show` (every
    // default written) continues a run made from the file it came from.
    let raw: serde_json::Value = crate::io::read_json(&path)?;
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
    let mut new = serde_json::to_value(cfg.with_defaults())?;
    for pointer in RESUME_MAY_CHANGE {
        for v in [&mut old, &mut new] {
            remove_pointer(v, pointer);
        }
    }
    let changed = config::differing_keys(&old, &new);
    if !changed.is_empty() && accept {
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
        tracing::warn!(
            "resuming with other settings than the run's (`{}`, --accept-changes): its earlier config is \
             kept in {}",
            changed.join("`, `"),
            kept.display()
        );
        return Ok(());
    }
    if !changed.is_empty() {
        return Err(ResumeChanged {
            path,
            keys: changed.join("`, `"),
            allowed: RESUME_MAY_CHANGE
                .iter()
                .map(|p| format!("`{}`", p.trim_start_matches('/').replace('/', ".")))
                .collect::<Vec<_>>()
                .join(", "),
        }
        .into());
    }
    Ok(())
}

/// Removes the value at `pointer` (`/a/b`) from `v`, if there is one.
fn remove_pointer(v: &mut serde_json::Value, pointer: &str) {
    // `pointer_mut("")` is the document itself.
    let Some((parent, key)) = pointer.rsplit_once('/') else {
        return;
    };
    if let Some(serde_json::Value::Object(map)) = v.pointer_mut(parent) {
        map.remove(key);
    }
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
/// this one (a missing or unreadable config says nothing of them, so they go).
fn keeps_warm_start_rows(cfg: &TrainConfig, resume: bool, model_made: bool) -> bool {
    let earlier = earlier_model_dir(cfg);
    let same = |d: &PathBuf| crate::io::same_dir(d, &cfg.model.dir);
    if resume {
        earlier.as_ref().is_none_or(same)
    } else {
        model_made && earlier.as_ref().is_some_and(same)
    }
}

/// Runs the RL loop of `cfg` with `opts`.
pub fn run_with(cfg: &TrainConfig, opts: &RunOptions) -> anyhow::Result<RunSummary> {
    let (resume, quiet) = (opts.resume, opts.quiet);
    apply_process_modes(cfg);
    let device = cfg.train.backend.device()?.autodiff();
    // Before anything in the run directory changes: a second process there stops here.
    let _lock = lock::RunLock::acquire(&cfg.run_dir)?;
    // The task's data too: a data set that cannot be read must not cost the run directory its files.
    let task = Task::from_config(&cfg.task)?;
    // And the step's sizes, against the config of the model the run starts from (the one there, or the
    // one it will be made from; a missing one is `prepare_model`'s to report).
    let model_config = [
        Some(&cfg.model.dir),
        cfg.model.init_config.as_ref(),
        cfg.model.base.as_ref(),
    ]
    .into_iter()
    .flatten()
    .find_map(|p| crate::model::ModelConfig::from_file(p).ok());
    if let Some(model_config) = &model_config {
        check_step_sizes(cfg, model_config, Some(&task))?;
    }
    let metrics_path = cfg.run_dir.join("metrics.jsonl");
    // Whether `model.dir` already holds a model (made by an earlier run's warm start, or given).
    let model_made = cfg.model.dir.join("config.json").is_file();
    let resumed = if resume {
        let found = checkpoint::latest_checked(&cfg.run_dir)?;
        if found.is_none() {
            tracing::warn!(run_dir = %cfg.run_dir.display(), "--resume: no RL checkpoint yet, so RL starts at step 0 (after the warm start, where it has one to finish)");
        }
        found
    } else {
        // With --overwrite nothing there is read (a damaged checkpoint must not block starting over).
        let existing = if opts.overwrite {
            None
        } else {
            checkpoint::latest_checked(&cfg.run_dir)?
        };
        if let Some((p, st)) = existing {
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
        let unfinished_sft = if opts.overwrite || model_made {
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
        // finished with checkpoints pruned away) are someone's results too: not deleted unasked.
        if !opts.overwrite && metrics_path.is_file() {
            let rows = metrics::read_rows(&metrics_path, metrics::BadLines::Skip)?;
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
        let dir = checkpoint::checkpoints_dir(&cfg.run_dir);
        if opts.overwrite && dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("{}: cannot remove", dir.display()))?;
        }
        None
    };
    if let Some((p, state)) = &resumed {
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
        check_resumed_config(cfg, opts.accept_changes, done)?;
    } else if resume {
        // No RL checkpoint yet: RL starts over (its settings may change), but an unfinished warm start
        // continues, and must be this config's; checked before the run's config.json is rewritten below.
        sft::check_warm_start_resume(cfg)?;
    }
    let keeps_sft_rows = keeps_warm_start_rows(cfg, resume, model_made);
    crate::io::write_json_atomic(&cfg.run_dir.join("config.json"), cfg)?;
    if resumed.is_none() && keeps_sft_rows {
        // RL starts over from step 0, but the warm start's rows stay (they used to be deleted with the
        // file): with `--resume` before the first checkpoint, all of them when it finished, those up to its
        // checkpoint when it resumes (`prepare_model_locked` drops the rest); with `--overwrite`, those of
        // the model that is kept and used again (the earlier run named the same `model.dir`).
        metrics::retain_rows(&metrics_path, |row| row["phase"].as_str() == Some("sft"))?;
    } else if resumed.is_none() && metrics_path.exists() {
        std::fs::remove_file(&metrics_path)?;
    }
    if let Some((_, state)) = &resumed {
        metrics::truncate_after(&metrics_path, "rl", state.step)?;
        // The evaluation after the checkpoint's step is logged before the checkpoint is written; the final
        // one of a finished run is redone.
        let last_eval = if state.step.saturating_add(1) < cfg.train.steps {
            state.step + 1
        } else {
            state.step
        };
        metrics::truncate_after(&metrics_path, "eval", last_eval)?;
    }
    let mut log = MetricsLog::open(&metrics_path)?;
    prepare_model_locked(cfg, &device, &mut log, quiet, resume)?;

    let model_dir = resumed
        .as_ref()
        .map_or(cfg.model.dir.clone(), |(p, _)| p.clone());
    let mut model = match &resumed {
        Some((p, st)) => checkpoint::load_model(p, &device).with_context(|| {
            let previous = checkpoint::list(&cfg.run_dir)
                .iter()
                .rev()
                .find(|(_, s)| s.step < st.step)
                .map_or("start over with --overwrite".to_string(), |(q, s)| {
                    format!("resume from step {} ({})", s.step, q.display())
                });
            format!(
                "{}: the newest checkpoint cannot be loaded; move it away to {previous}",
                p.display()
            )
        })?,
        None => Decoder::load_full_precision(&model_dir, &device)?,
    };
    let config_json: serde_json::Value = crate::io::read_json(&model_dir.join("config.json"))?;
    let tok = Tokenizer::load_for(&cfg.model.dir, &model.config)?
        .with_context(|| format!("{}: no tokenizer.json", cfg.model.dir.display()))?;
    let eos = eos_id(&tok, &model)?;
    check_chat_tokens(cfg, &tok, &cfg.model.dir)?;
    if cfg.train.routing_replay && model.config.moe.is_none() {
        anyhow::bail!(
            "`train.routing_replay` = true, but {} has no mixture-of-experts layer: there is no routing \
             to replay (set it false for a dense model)",
            model_dir.display()
        );
    }
    let eval_set = task.eval_set(cfg.eval.problems);
    let eval_fingerprint =
        crate::tasks::questions_fingerprint(&task.eval_questions(cfg.eval.problems));

    let tc = &cfg.train;
    let mut optim = optimizer(tc);
    let mut state = checkpoint::TrainerState {
        step: 0,
        seed: Some(cfg.seed),
        next_step: 0,
        consecutive_nonfinite: 0,
        grad_norm_ema_bits: None,
    };
    if let Some((p, saved)) = &resumed {
        optim = checkpoint::load_optimizer(optim, p)?;
        state = saved.clone();
        state.seed = Some(cfg.seed);
        state.next_step = saved.step.saturating_add(1);
        tracing::info!(checkpoint = %p.display(), next_step = state.next_step, "resuming");
    }
    let start = state.next_step;
    model.set_precision(cfg.rollout.precision)?;
    model.set_activations(cfg.train.activations)?;

    // Returns the greedy accuracy in the rollout precision and its per-problem outcomes.
    let evaluate =
        |model: &Decoder, step: usize, log: &mut MetricsLog| -> anyhow::Result<(f64, Vec<bool>)> {
            let spinner = progress::spinner(&format!("eval at step {step}"), quiet);
            let plain = model.valid();
            let mut row = serde_json::json!({"phase": "eval", "step": step,
                (crate::rl::metrics::names::EVAL_QUESTIONS_FINGERPRINT): eval_fingerprint});
            let mut rollout_acc = (0.0, Vec::new());
            let mut precisions = vec![cfg.rollout.precision];
            if cfg.rollout.precision != config::Precision::F32 {
                precisions.push(config::Precision::F32);
            }
            for p in precisions {
                spinner.set_message(format!("{p}"));
                let m = eval::evaluate(
                    &plain,
                    p,
                    &tok,
                    &eval_set,
                    eos,
                    &cfg.eval,
                    &cfg.verify,
                    cfg.seed,
                )?;
                row[format!("eval/{p}/greedy_correct")] =
                    serde_json::json!(paired::encode(&m.greedy_correct));
                if p == cfg.rollout.precision {
                    rollout_acc = (
                        m.metrics[&format!("eval/{p}/pass@1_greedy")],
                        m.greedy_correct,
                    );
                }
                for (k, v) in m.metrics {
                    row[k] = serde_json::json!(v);
                }
            }
            spinner.finish_and_clear();
            log.write(&row)?;
            Ok(rollout_acc)
        };
    let save = |model: &Decoder,
                optim: &burn::optim::ModuleOptimizer,
                state: &checkpoint::TrainerState|
     -> anyhow::Result<PathBuf> {
        checkpoint::save(
            &cfg.run_dir,
            state,
            model,
            &config_json,
            optim,
            &cfg.model.dir,
            cfg.keep_checkpoints,
        )
    };

    let before = if start == 0 {
        Some(evaluate(&model, 0, &mut log)?)
    } else {
        before_rl_outcomes(log.path(), cfg.rollout.precision)
    };
    let bar = progress::progress_bar((tc.steps.saturating_sub(start)) as u64, "rl", quiet);
    for step in start..tc.steps {
        let inject = opts.inject_nonfinite_steps.contains(&step);
        let out = rl::rl_step(&mut model, &mut optim, &task, &tok, eos, cfg, step, inject)?;
        state.step = step;
        state.next_step = step + 1;
        if out.nonfinite_updates > 0 {
            state.consecutive_nonfinite += 1;
        } else {
            state.consecutive_nonfinite = 0;
        }
        let mut row = serde_json::json!({"phase": "rl", "step": step});
        for (k, v) in &out.metrics {
            row[k.as_str()] = serde_json::json!(v);
        }
        row["train/consecutive_nonfinite"] = serde_json::json!(state.consecutive_nonfinite);
        if let Some(g) = out.grad_norm {
            let ema = state.grad_norm_ema_bits.map(f64::from_bits);
            let spike = ema.is_some_and(|e| g > GRAD_NORM_SPIKE_FACTOR * e);
            if spike {
                tracing::warn!(
                    step,
                    grad_norm = g,
                    average = ema.unwrap_or_default(),
                    "gradient-norm spike"
                );
            }
            row["train/grad_norm_spike"] = serde_json::json!(u8::from(spike));
            let next = ema.map_or(g, |e| 0.9 * e + 0.1 * g);
            state.grad_norm_ema_bits = Some(next.to_bits());
        }
        log.write(&row)?;
        bar.set_message(format!(
            "reward {:.3} acc {:.2} k3 {:.1e}",
            out.metrics
                .get("critic/rewards/mean")
                .copied()
                .unwrap_or(f64::NAN),
            out.metrics
                .get("train/accuracy")
                .copied()
                .unwrap_or(f64::NAN),
            out.metrics
                .get("rollout_corr/k3_kl")
                .copied()
                .unwrap_or(f64::NAN),
        ));
        bar.inc(1);
        if nonfinite_limit_reached(
            state.consecutive_nonfinite,
            tc.max_nonfinite_steps,
            tc.steps,
        ) {
            bar.abandon();
            let ckpt = save(&model, &optim, &state)?;
            anyhow::bail!(
                "stopping the run: {} consecutive RL steps (steps {}..={step}) had a NaN or infinite loss \
                 or gradient, so their updates were skipped (`train.max_nonfinite_steps` = {}, or every step of \
                 a shorter run). The last \
                 good weights are in {}; check the data, or lower `train.lr` or set `train.grad_clip` and go \
                 on with `--resume --accept-changes` (the run keeps its earlier config beside the new one).",
                state.consecutive_nonfinite,
                (step + 1).saturating_sub(state.consecutive_nonfinite),
                tc.max_nonfinite_steps,
                ckpt.display()
            );
        }
        if (step + 1) % cfg.eval.every == 0 && step + 1 < tc.steps {
            evaluate(&model, step + 1, &mut log)?;
        }
        if cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0 {
            save(&model, &optim, &state)?;
        }
        if opts.stop_after_step == Some(step) {
            bar.abandon();
            return Ok(RunSummary {
                run_dir: cfg.run_dir.clone(),
                metrics_path,
                accuracy_before: before.map(|b| b.0),
                accuracy_after: None,
                paired: None,
            });
        }
    }
    bar.finish();
    let after = evaluate(&model, tc.steps, &mut log)?;
    // The last step's checkpoint, unless the loop just wrote it.
    let just_saved = cfg.checkpoint_every > 0 && tc.steps % cfg.checkpoint_every == 0;
    if tc.steps > 0 && start < tc.steps && !just_saved {
        save(&model, &optim, &state)?;
    }
    let paired = before
        .as_ref()
        .and_then(|b| paired::PairedComparison::new(&b.1, &after.1));
    Ok(RunSummary {
        run_dir: cfg.run_dir.clone(),
        metrics_path,
        accuracy_before: before.map(|b| b.0),
        accuracy_after: Some(after.0),
        paired,
    })
}

/// The evaluation before RL as the metrics log recorded it (a resumed run did not redo it): greedy
/// accuracy in `precision` and the per-problem outcomes.
fn before_rl_outcomes(metrics: &Path, precision: config::Precision) -> Option<(f64, Vec<bool>)> {
    let text = std::fs::read_to_string(metrics).ok()?;
    let row = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|r| r["phase"] == "eval" && r["step"].as_u64() == Some(0))?;
    let acc = row[format!("eval/{precision}/pass@1_greedy")].as_f64()?;
    let outcomes = paired::decode(row[format!("eval/{precision}/greedy_correct")].as_str()?)?;
    Some((acc, outcomes))
}

/// [`load_config`] with a command's `--backend` flag, when given, as one more override
/// (`train.backend=..`, after the `--set` ones): validation then sees the backend the run will use (the
/// settings that need a CubeCL backend, `train.tensor_cores`, are checked against it).
pub fn load_config_on(
    path: Option<&Path>,
    overrides: &[String],
    backend: Option<crate::ops::BackendKind>,
) -> anyhow::Result<TrainConfig> {
    let mut all = overrides.to_vec();
    all.extend(backend.map(|b| format!("train.backend={b}")));
    load_config(path, &all)
}

/// Reads a config file, or the embedded default when `path` is `None`, then applies `overrides`
/// (`key.path=value`, the value in TOML syntax, bare words taken as strings).
pub fn load_config(path: Option<&Path>, overrides: &[String]) -> anyhow::Result<TrainConfig> {
    let (text, origin) = match path {
        Some(p) => (
            std::fs::read_to_string(p).map_err(crate::io::failed(p, "cannot read"))?,
            p.display().to_string(),
        ),
        None => (
            config::DEFAULT_CONFIG.to_string(),
            "the default config (configs/default.toml)".to_string(),
        ),
    };
    if overrides.is_empty() {
        return TrainConfig::from_toml(&text, &origin);
    }
    let mut doc: toml::Value =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{origin}: {e}"))?;
    for o in overrides {
        let (key, value) = experiment::parse_override(o)?;
        experiment::set_dotted(&mut doc, &key, value)?;
    }
    let text = toml::to_string(&doc)?;
    TrainConfig::from_generated_toml(&text, &format!("{origin} with --set overrides"))
}
