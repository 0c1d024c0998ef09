//! The RL run: a run directory taken (locked, checked, resumed or started over), the model made or loaded,
//! then the steps, each logged, with the evaluations and checkpoints `cfg` asks for between them.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Device;

use super::checkpoint::{self, TrainerState};
use super::config::{self, nonfinite_limit_reached, TrainConfig};
use super::metrics::{MetricsLog, WORST_RESPONSES_FILE};
use super::model_dir::{self, check_chat_tokens};
use super::reference::Reference;
use super::rl::{self, StepOutcome};
use super::update::optimizer;
use super::{eval, lock, paired, progress, resume};
use crate::model::{Decoder, EndTokens, Tokenizer};
use crate::tasks::{Example, Task};

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
    /// The fingerprint of the model the run started from ([`TrainerState::start_model`]).
    pub start_model: Option<String>,
    /// The training set's fingerprint ([`TrainerState::train_data`]).
    pub train_data: Option<String>,
    /// RL steps of the run (as its log holds them) that made no update because dynamic sampling kept
    /// no group (`train/kept_sequences` 0), and the RL steps logged.
    pub steps_without_update: (usize, usize),
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
    /// With `resume`: go on although settings outside
    /// [`RESUME_MAY_CHANGE`](super::RESUME_MAY_CHANGE) differ from the run's (a lower learning rate after a
    /// divergence). The run's earlier config is kept beside the new one
    /// (`config.before_step_N.json`) and the changed keys are logged, so the record of how the earlier
    /// rows were made stays.
    pub accept_changes: bool,
}

/// A step whose gradient norm exceeds this multiple of the moving average is logged as a spike.
pub const GRAD_NORM_SPIKE_FACTOR: f64 = 10.0;

/// Non-zero gradient norms the moving average takes in before a spike can be flagged: an average of one
/// or two early norms (a first step where one group of 32 had a reward signal) flagged the next ordinary
/// step as a spike.
pub const GRAD_NORM_SPIKE_WARMUP: usize = 5;

/// The count of norms seen that a checkpoint written before the count was kept resumes with: past the
/// warm-up, as its run was judging spikes then.
pub fn grad_norm_warmed_up() -> usize {
    GRAD_NORM_SPIKE_WARMUP
}

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

/// Runs the RL loop of `cfg` with `opts`.
pub fn run_with(cfg: &TrainConfig, opts: &RunOptions) -> anyhow::Result<RunSummary> {
    apply_process_modes(cfg);
    warn_truncated_sampling(cfg);
    config::warn_long_warmup("train", cfg.train.warmup_steps, cfg.train.steps);
    let device = cfg.train.backend.device()?.autodiff();
    // Before anything in the run directory changes: a second process there stops here.
    let _lock = lock::RunLock::acquire(&cfg.run_dir)?;
    // Then everything the run reads, so that bad input never costs the run directory its files (an
    // `--overwrite` removes them): the task's data, the model's sources, the step's sizes, and a model that
    // is there already, whole.
    let task = Task::from_config(&cfg.task)?;
    warn_run_on_answers(cfg, &task);
    // An evaluation of no problem would log an accuracy of 0 and pass for a result.
    if cfg.eval.problems > 0 && task.eval_set(1).is_empty() {
        anyhow::bail!(
            "task config: the task holds out no problem for the evaluations (`eval.problems` = {}): its \
             problems are too few to hold any out; widen the task (more terms or digits, or a data set \
             with `eval_path` / a larger `eval_fraction`)",
            cfg.eval.problems
        );
    }
    // Whether `model.dir` already holds a model (made by an earlier run's warm start, or given).
    let model_made = cfg.model.dir.join("config.json").is_file();
    let model_config = model_dir::check_sources(cfg, model_made, opts.resume)?;
    let how = if opts.resume {
        resume::Start::Resume {
            accept_changes: opts.accept_changes,
        }
    } else {
        resume::Start::Over {
            overwrite: opts.overwrite,
        }
    };
    let given = match how {
        resume::Start::Over { .. } if model_made => Some(Policy::load(cfg, &task, None, &device)?),
        _ => None,
    };
    check_step_sizes(
        cfg,
        &model_config,
        Some(&task),
        given.as_ref().map(|p| &p.tok),
    )?;
    let sized_with_tokenizer = given.is_some();
    // Known from the config the warm start will build from: refused before it runs, not after.
    check_planned_model(cfg, &model_config, &cfg.model.dir)?;
    let metrics_path = cfg.run_dir.join("metrics.jsonl");
    let resumed = resume::start_point(cfg, how, model_made, &metrics_path)?;
    // The weights come from the checkpoint, but the tokenizer and the end tokens from `model.dir`: a
    // warm start run again there would take minutes, write its rows after the RL rows, and be thrown away.
    if let (Some((p, _)), false) = (&resumed, model_made) {
        anyhow::bail!(
            "{}: holds no model, but the run resumes from {}, which needs the model's folder for its \
             tokenizer and end tokens: restore the folder, or set `model.dir` to where it is now",
            cfg.model.dir.display(),
            p.display()
        );
    }
    // A resume loads its checkpoint before the run directory changes: one that does not load leaves the
    // run as it was (its config.json, its rows), for a resume from an older checkpoint.
    let loaded = match (&resumed, model_made) {
        (Some((p, saved)), true) => {
            let policy = Policy::load(cfg, &task, resumed.as_ref(), &device)?;
            let optim = checkpoint::load_optimizer(optimizer(&cfg.train), p, &policy.model)?;
            Some((policy, optim, resumed_state(cfg, p, saved)))
        }
        _ => None,
    };
    let has_reference = cfg.train.loss.kl_weight() > 0.0;
    let start_files = match (&resumed, model_made) {
        (Some((_, saved)), true) => {
            super::reference::check_resumed(saved, &cfg.model.dir, has_reference)?
        }
        _ => None,
    };
    let train_data = task.training_fingerprint();
    if let (Some((p, saved)), false) = (&resumed, opts.accept_changes) {
        if let (Some(then), Some(now)) = (&saved.train_data, &train_data) {
            anyhow::ensure!(
                then == now,
                "{}: the training data changed since the run started (fingerprint {then} in {}, {now} \
                 now): the steps from here on would train on other examples; restore the data file, or \
                 resume with --accept-changes",
                cfg.run_dir.display(),
                p.display()
            );
        }
    }
    let keeps_sft_rows = resume::keeps_warm_start_rows(cfg, opts.resume, model_made);
    if let (Some((_, saved)), true) = (&resumed, opts.accept_changes) {
        resume::keep_earlier_config(cfg, saved.step + 1)?;
    }
    crate::io::write_json_atomic(&cfg.run_dir.join("config.json"), cfg)?;
    resume::reset_metrics(
        cfg,
        resumed.as_ref().map(|r| &r.1),
        keeps_sft_rows,
        &metrics_path,
    )?;
    let mut log = MetricsLog::open(&metrics_path)?;
    let mut worst_responses = MetricsLog::open(&cfg.run_dir.join(WORST_RESPONSES_FILE))?;
    model_dir::prepare_model_locked(cfg, &device, &mut log, opts.quiet, opts.resume, true)?;

    let (mut policy, mut optim, mut state) = match loaded {
        Some(loaded) => loaded,
        None => {
            let policy = match given {
                Some(policy) => policy,
                None => Policy::load(cfg, &task, resumed.as_ref(), &device)?,
            };
            let (optim, state) = match &resumed {
                Some((p, saved)) => (
                    checkpoint::load_optimizer(optimizer(&cfg.train), p, &policy.model)?,
                    resumed_state(cfg, p, saved),
                ),
                None => (optimizer(&cfg.train), TrainerState::fresh(cfg.seed)),
            };
            (policy, optim, state)
        }
    };
    // After the warm start: the model it made (or the one given) is the run's start, and the KL term's
    // reference, on every resume too.
    let start_model = match start_files {
        Some(f) => f,
        None => super::reference::files_fingerprint(&cfg.model.dir)?,
    };
    state.start_model = Some(start_model.clone());
    state.train_data = train_data;
    let reference = Reference::load(cfg, &device, Some(start_model.clone()))?;
    if let Some(r) = &reference {
        state.reference = Some(r.fingerprint().to_string());
    }
    // Without a tokenizer before (a model still to be made, a resume) the prompts were sized at one
    // token: now by their tokens, before the first evaluation and rollout rather than at them.
    if !sized_with_tokenizer {
        check_step_sizes(cfg, &policy.model.config, Some(&task), Some(&policy.tok))?;
    }
    let start = state.next_step;
    if start < cfg.train.steps {
        checkpoint::check_writable(&checkpoint::checkpoints_dir(&cfg.run_dir))?;
    }
    let evaluator = Evaluator::new(cfg, &task, &policy.tok, &policy.end, opts.quiet);
    let before = if start == 0 {
        Some(evaluator.evaluate(&policy.model, 0, &mut log)?)
    } else {
        before_rl_outcomes(log.path(), cfg.rollout.precision)
    };
    let steps = cfg.train.steps;
    // A run with steps to do is not finished until it ends again (`qarl runs` said finished for an
    // experiment's run a resume took further and that stopped part-way), and plots drawn before are of
    // fewer steps: its marker and plots go before the first step (reports draw a finished run's plots
    // once, where none are there).
    if start < steps {
        crate::io::remove_files_present([
            resume::finished_marker(&cfg.run_dir),
            super::plot::run_plots(&cfg.run_dir),
        ])?;
    }
    // The bar counts the run's steps, a resumed one from where it resumed (it read 0/1 for step 7 of 7).
    let bar = progress::progress_bar(steps as u64, "rl", opts.quiet);
    bar.set_position(start as u64);
    // The rate and the ETA count the steps of this process only.
    bar.reset_eta();
    if let Some((p, saved)) = resumed.as_ref().filter(|_| model_made && start < steps) {
        bar.println(format!(
            "resuming after step {} from {}: steps {start} to {} to go",
            saved.step,
            p.display(),
            steps - 1
        ));
    }
    for step in start..steps {
        let inject = opts.inject_nonfinite_steps.contains(&step);
        let out = rl::rl_step(
            &mut policy.model,
            &mut optim,
            &task,
            &policy.tok,
            &policy.end,
            reference.as_ref(),
            cfg,
            step,
            inject,
        )?;
        log.write(&step_row(&mut state, step, &out))?;
        if let Some(example) = &out.worst_response {
            let mut row = serde_json::json!({"phase": "rl", "step": step});
            for (k, v) in example.as_object().into_iter().flatten() {
                row[k] = v.clone();
            }
            worst_responses.write(&row)?;
        }
        bar.set_message(progress_message(&out));
        bar.inc(1);
        // The evaluation due after this step before a stop for non-finite steps: a resume starts at the
        // next step and would never make it.
        if (step + 1) % cfg.eval.every == 0 && step + 1 < steps {
            evaluator.evaluate(&policy.model, step + 1, &mut log)?;
        }
        if nonfinite_limit_reached(
            state.consecutive_nonfinite,
            cfg.train.max_nonfinite_steps,
            steps,
        ) {
            bar.abandon();
            let ckpt = policy.save(cfg, &optim, &state, &log)?;
            return Err(nonfinite_stop(cfg, &state, step, &ckpt));
        }
        if cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0 {
            policy.save(cfg, &optim, &state, &log)?;
        }
        if opts.stop_after_step == Some(step) {
            bar.abandon();
            return Ok(RunSummary {
                run_dir: cfg.run_dir.clone(),
                metrics_path,
                accuracy_before: before.map(|b| b.0),
                accuracy_after: None,
                paired: None,
                start_model: state.start_model.clone(),
                train_data: state.train_data.clone(),
                steps_without_update: steps_without_update(log.path())?,
            });
        }
    }
    bar.finish();
    // The last step's checkpoint, unless the loop just wrote it, before the final evaluation: a kill
    // between the two then leaves no final accuracy logged for weights that are not on disk (`qarl runs`
    // called such a run finished); a resume drops and redoes the final evaluation.
    let just_saved = cfg.checkpoint_every > 0 && steps.is_multiple_of(cfg.checkpoint_every);
    if steps > 0 && start < steps && !just_saved {
        policy.save(cfg, &optim, &state, &log)?;
    }
    let after = evaluator.evaluate(&policy.model, steps, &mut log)?;
    // Plots drawn while the run went (`qarl plot` on it mid-run, or before a kill during the final
    // evaluation that this resume redid) may show less than it has now: gone, so that a report draws the
    // whole run (it draws only missing plots) instead of linking the partial one.
    crate::io::remove_files_present([super::plot::run_plots(&cfg.run_dir)])?;
    let paired = before
        .as_ref()
        .and_then(|b| paired::PairedComparison::new(&b.1, &after.1));
    Ok(RunSummary {
        run_dir: cfg.run_dir.clone(),
        metrics_path,
        accuracy_before: before.map(|b| b.0),
        accuracy_after: Some(after.0),
        paired,
        start_model: state.start_model.clone(),
        train_data: state.train_data.clone(),
        steps_without_update: steps_without_update(log.path())?,
    })
}

/// Says that top-k / top-p sampling is not in the importance ratios under `rollout.logprobs = "full"`: the
/// sampler then records each token's log-prob under the whole (temperature-scaled) distribution, the
/// learner's, while it draws from the truncated one; the ratios of the corrections and of TBPO's mismatch
/// weight, and the `rollout_corr/*` metrics, compare the learner with the untruncated distribution.
fn warn_truncated_sampling(cfg: &TrainConfig) {
    let r = &cfg.rollout;
    if r.logprobs == config::RolloutLogprobs::Full && r.truncates() {
        tracing::warn!(
            "rollout.top_p = {} / top_k = {}: the recorded log-probs (lp_roll) are those of the whole \
             distribution, not of the truncated one the tokens are drawn from, so the importance ratios, \
             TBPO's mismatch weight and rollout_corr/* leave the truncation out (rollout.logprobs = \
             \"processed\" records the truncated one's, as verl does)",
            r.top_p,
            r.top_k
        );
    }
}

/// Says that responses to a plain prompt run until an end token when no warm start teaches the model to
/// end its answer: a base model then goes on with a `Question:` of its own and answers it, and the
/// verifier reads the last `Answer:` of the response, the invented question's.
fn warn_run_on_answers(cfg: &TrainConfig, task: &Task) {
    if let Some(warning) = run_on_answers(cfg, task) {
        tracing::warn!("{warning}");
    }
}

/// The warning of [`warn_run_on_answers`], where it applies.
fn run_on_answers(cfg: &TrainConfig, task: &Task) -> Option<String> {
    let plain = matches!(task, Task::Dataset(d) if d.template().is_plain());
    (plain && cfg.sft.is_none() && cfg.rollout.stop == config::RolloutStop::EndTokens).then(|| {
        format!(
            "a plain prompt template with `rollout.stop` = \"end_tokens\" and no [sft] warm start: a base \
             model's response may go on past its answer with a question of its own, whose answer the \
             verifier would read; `rollout.stop` = \"template\" ends responses at `{}`",
            task.stop_strings().join("`, `").escape_debug()
        )
    })
}

/// The policy a run trains: the model (from `model.dir`, or the checkpoint it resumes), set to the rollout's
/// precision and activations, its tokenizer and end tokens, and the `config.json` its checkpoints
/// carry.
struct Policy {
    model: Decoder,
    tok: Tokenizer,
    end: EndTokens,
    config_json: serde_json::Value,
}

impl Policy {
    fn load(
        cfg: &TrainConfig,
        task: &Task,
        resumed: Option<&(PathBuf, TrainerState)>,
        device: &Device,
    ) -> anyhow::Result<Self> {
        let model_dir = resumed.map_or(cfg.model.dir.clone(), |(p, _)| p.clone());
        let mut model = match resumed {
            Some((p, st)) => checkpoint::load_model(p, device)
                .with_context(|| unloadable_checkpoint(cfg, p, st.step))?,
            None => Decoder::load_full_precision(&model_dir, device)?,
        };
        let config_json: serde_json::Value = crate::io::read_json(&model_dir.join("config.json"))?;
        if let Some((p, _)) = resumed {
            check_same_tokenizer(&cfg.model.dir, p)?;
        }
        let tok = Tokenizer::load_required(&cfg.model.dir, &model.config)?;
        let end = EndTokens::of(&tok, &model.config)?.with_turn_ends(&tok, &task.turn_ends());
        check_model_for_config(cfg, &model.config, &tok, &model_dir)?;
        model.set_precision(cfg.rollout.precision)?;
        model.set_activations(cfg.train.activations)?;
        Ok(Self {
            model,
            tok,
            end,
            config_json,
        })
    }

    /// A checkpoint of the weights, the optimizer and the trainer's state after `state.step`, written
    /// after `log`'s rows are on the disk (a checkpoint never gets ahead of the log it resumes with).
    fn save(
        &self,
        cfg: &TrainConfig,
        optim: &ModuleOptimizer,
        state: &TrainerState,
        log: &MetricsLog,
    ) -> anyhow::Result<PathBuf> {
        log.sync()?;
        checkpoint::save(
            &cfg.run_dir,
            state,
            &self.model,
            &self.config_json,
            optim,
            &cfg.model.dir,
            cfg.keep_checkpoints,
        )
    }
}

/// What a newest checkpoint that cannot be loaded leaves the user: the checkpoint before it, or starting
/// over.
/// Refuses a resume whose `model.dir` holds another tokenizer, chat template or generation config than the
/// run's (the copies in its checkpoint, [`crate::model::checkpoint::SIDE_FILES`]): the weights come from the
/// checkpoint, but prompts, end tokens and the chat template from `model.dir`, so a resume may move the
/// model folder (`model.dir` may change) but not change them (an edited template mixed two prompt formats
/// in one run). JSON files are compared as JSON, so a copy written with other whitespace or key order
/// passes; a checkpoint without a copy (written before they were kept) checks nothing of that file.
fn check_same_tokenizer(model_dir: &Path, checkpoint: &Path) -> anyhow::Result<()> {
    for f in crate::model::checkpoint::SIDE_FILES {
        let (saved, now) = (checkpoint.join(f), model_dir.join(f));
        if !saved.is_file() {
            continue;
        }
        let read = |p: &Path| -> anyhow::Result<Option<serde_json::Value>> {
            if !p.is_file() {
                return Ok(None);
            }
            if f.ends_with(".json") {
                crate::io::read_json(p).map(Some)
            } else {
                let text =
                    std::fs::read_to_string(p).map_err(crate::io::failed(p, "cannot read"))?;
                Ok(Some(serde_json::Value::String(text)))
            }
        };
        if read(&saved)? != read(&now)? {
            anyhow::bail!(
                "{}: not the {f} the run was made with ({}): its prompts would be tokenized, templated or \
                 ended differently after the resume; point `model.dir` at the run's model",
                now.display(),
                saved.display()
            );
        }
    }
    Ok(())
}

fn unloadable_checkpoint(cfg: &TrainConfig, path: &Path, step: usize) -> String {
    let previous = checkpoint::list(&cfg.run_dir)
        .iter()
        .rev()
        .find(|(_, s)| s.step < step)
        .map_or("start over with --overwrite".to_string(), |(q, s)| {
            format!("resume from step {} ({})", s.step, q.display())
        });
    format!(
        "{}: the newest checkpoint cannot be loaded; move it away to {previous}",
        path.display()
    )
}

/// The run's greedy evaluation on the task's held-out problems, in the rollout precision and (for a
/// quantized rollout) in f32, logged as one `eval` row.
struct Evaluator<'a> {
    cfg: &'a TrainConfig,
    tok: &'a Tokenizer,
    end: &'a EndTokens,
    /// `rollout.stop`'s strings for the task.
    stop_strings: Vec<String>,
    problems: Vec<Example>,
    fingerprint: String,
    /// The questions with their golds ([`Task::problems_fingerprint`]).
    problems_fingerprint: String,
    quiet: bool,
}

impl<'a> Evaluator<'a> {
    fn new(
        cfg: &'a TrainConfig,
        task: &Task,
        tok: &'a Tokenizer,
        end: &'a EndTokens,
        quiet: bool,
    ) -> Self {
        let problems = task.eval_set(cfg.eval.problems);
        if problems.len() < cfg.eval.problems {
            tracing::warn!(
                "eval.problems = {}, but the task holds out {} distinct problems: the evaluations use those {}",
                cfg.eval.problems,
                problems.len(),
                problems.len()
            );
        }
        let problems_fingerprint = crate::tasks::problems_fingerprint(&problems);
        Self {
            cfg,
            tok,
            end,
            stop_strings: cfg.rollout.stop.strings(end, tok, || task.stop_strings()),
            problems,
            fingerprint: crate::tasks::questions_fingerprint(
                &task.eval_questions(cfg.eval.problems),
            ),
            problems_fingerprint,
            quiet,
        }
    }

    /// Evaluates `model` at `step` and logs the row; returns the greedy accuracy in the rollout precision
    /// and its per-problem outcomes.
    fn evaluate(
        &self,
        model: &Decoder,
        step: usize,
        log: &mut MetricsLog,
    ) -> anyhow::Result<(f64, Vec<bool>)> {
        let cfg = self.cfg;
        let spinner = progress::spinner(&format!("eval at step {step}"), self.quiet);
        let plain = model.valid();
        let mut row = serde_json::json!({"phase": "eval", "step": step,
            (crate::rl::metrics::names::EVAL_QUESTIONS_FINGERPRINT): self.fingerprint,
            (crate::rl::metrics::names::EVAL_PROBLEMS_FINGERPRINT): self.problems_fingerprint,
            (crate::rl::metrics::names::EVAL_STOP_STRINGS): self.stop_strings,
            (crate::rl::metrics::names::EVAL_VERIFIER_VERSION): crate::tasks::verify::VERIFIER_VERSION});
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
                self.tok,
                &self.problems,
                self.end,
                &self.stop_strings,
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
    }
}

/// The trainer state a resume from checkpoint `p` (saved after `saved.step`) continues with.
/// A checkpoint written by another build is said: other code may sum or sample otherwise, so the
/// continued steps need not be bitwise those of an uninterrupted run.
fn resumed_state(cfg: &TrainConfig, p: &Path, saved: &TrainerState) -> TrainerState {
    tracing::info!(checkpoint = %p.display(), next_step = saved.step + 1, "resuming");
    if let Some(other) = saved.build.as_deref().filter(|&b| b != checkpoint::BUILD) {
        tracing::warn!(
            checkpoint = %p.display(),
            "written by qarl {other}, resumed by qarl {}: the steps from here on may differ from an \
             uninterrupted run's in their last bits (or more, where the code changed what is computed)",
            checkpoint::BUILD
        );
    }
    TrainerState {
        seed: Some(cfg.seed),
        next_step: saved.step.saturating_add(1),
        build: Some(checkpoint::BUILD.to_string()),
        ..saved.clone()
    }
}

/// The RL steps of the log at `metrics` that made no update because dynamic sampling kept no group, and
/// the RL steps it holds.
fn steps_without_update(metrics: &Path) -> anyhow::Result<(usize, usize)> {
    use super::metrics::{read_rows, BadLines};
    let rows = read_rows(metrics, BadLines::TornLastOnly)?;
    let rl: Vec<_> = rows.iter().filter(|r| r["phase"] == "rl").collect();
    let empty = rl
        .iter()
        .filter(|r| r["train/kept_sequences"].as_f64() == Some(0.0))
        .count();
    Ok((empty, rl.len()))
}

/// The metrics row of RL step `step`, after `state` took in its outcome: the count of non-finite steps in a
/// row, and the gradient norm's moving average, against which a spike is flagged (and warned about).
fn step_row(state: &mut TrainerState, step: usize, out: &StepOutcome) -> serde_json::Value {
    state.step = step;
    state.next_step = step + 1;
    if out.nonfinite_updates > 0 {
        state.consecutive_nonfinite = state.consecutive_nonfinite.saturating_add(1);
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
        let spike = grad_norm_spike(&mut state.grad_norm_ema_bits, &mut state.grad_norms_seen, g);
        if spike {
            tracing::warn!(
                step,
                grad_norm = g,
                average = ema.unwrap_or_default(),
                "gradient-norm spike"
            );
        }
        row["train/grad_norm_spike"] = serde_json::json!(u8::from(spike));
    }
    row
}

/// Whether the norm `g` is a spike against the moving average (kept as f64 bits in the checkpointed state),
/// which it then updates; before the average has taken in [`GRAD_NORM_SPIKE_WARMUP`] norms (`seen`)
/// nothing is a spike. A norm of exactly 0 (every advantage 0: no group had a reward signal) says nothing
/// about the gradients' scale and leaves the average and the count alone: started or pulled down by it,
/// the average would flag the next real norm.
fn grad_norm_spike(ema_bits: &mut Option<u64>, seen: &mut usize, g: f64) -> bool {
    let ema = ema_bits.map(f64::from_bits);
    let warm = *seen >= GRAD_NORM_SPIKE_WARMUP;
    let spike = warm && ema.is_some_and(|e| g > GRAD_NORM_SPIKE_FACTOR * e);
    if g > 0.0 {
        *ema_bits = Some(ema.map_or(g, |e| 0.9 * e + 0.1 * g).to_bits());
        *seen = seen.saturating_add(1);
    }
    spike
}

/// The progress bar's line for a step: reward, accuracy and the rollout/learner mismatch.
fn progress_message(out: &StepOutcome) -> String {
    let get = |k: &str| out.metrics.get(k).copied().unwrap_or(f64::NAN);
    format!(
        "reward {:.3} acc {:.2} k3 {:.1e}",
        get("critic/rewards/mean"),
        get("train/accuracy"),
        get("rollout_corr/k3_kl"),
    )
}

/// The error that stops a run after `state.consecutive_nonfinite` steps in a row with a skipped update,
/// pointing at the checkpoint of the weights the applied updates left.
fn nonfinite_stop(
    cfg: &TrainConfig,
    state: &TrainerState,
    step: usize,
    ckpt: &Path,
) -> anyhow::Error {
    anyhow::anyhow!(
        "stopping the run: {} consecutive RL steps (steps {}..={step}) had a NaN or infinite loss \
         or gradient, and each such update was skipped (`train.max_nonfinite_steps` = {}, or every step \
         of a shorter run). The weights after the updates that did apply (none where a step has one \
         update) are in {}; check the data, or lower `train.lr` or set `train.grad_clip` and go \
         on with `--resume --accept-changes` (the run keeps its earlier config beside the new one).",
        state.consecutive_nonfinite,
        (step + 1).saturating_sub(state.consecutive_nonfinite),
        cfg.train.max_nonfinite_steps,
        ckpt.display()
    )
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

/// What the config asks of the model in `model_dir` beyond sizes: the chat template's tokens in its
/// tokenizer, and a mixture of experts where routing is replayed. Shared by a run and `qarl bench step`,
/// so that neither quietly skips what the config says.
pub(super) fn check_model_for_config(
    cfg: &TrainConfig,
    model: &crate::model::ModelConfig,
    tok: &Tokenizer,
    model_dir: &std::path::Path,
) -> anyhow::Result<()> {
    check_chat_tokens(cfg, tok, &cfg.model.dir)?;
    check_planned_model(cfg, model, model_dir)
}

/// What the config asks of the model that its config.json alone answers (the model in `model_dir`, or
/// the one its warm start will make, so a run is refused before the warm start): `top_k` within the
/// vocabulary, a mixture of experts for `train.routing_replay`.
pub(super) fn check_planned_model(
    cfg: &TrainConfig,
    model: &crate::model::ModelConfig,
    model_dir: &std::path::Path,
) -> anyhow::Result<()> {
    check_top_k(cfg, model, model_dir)?;
    check_routing_replay(cfg, model, model_dir)
}

/// Refuses a `top_k` of at least the model's vocabulary: it keeps every token, so vLLM and transformers
/// read it as off, but as a filter here it would count as truncation (no `lp_old` reuse, `lp_old_check`
/// refused, the truncation warning) and record log-probs a rounding away from the full ones.
fn check_top_k(
    cfg: &TrainConfig,
    model: &crate::model::ModelConfig,
    model_dir: &std::path::Path,
) -> anyhow::Result<()> {
    for (key, k) in [
        ("rollout.top_k", cfg.rollout.top_k),
        ("eval.top_k", cfg.eval.top_k),
    ] {
        if k >= model.vocab_size {
            anyhow::bail!(
                "`{key}` = {k} is at least the vocabulary of {} ({} tokens): it keeps every token; set 0 \
                 (off)",
                model_dir.display(),
                model.vocab_size
            );
        }
    }
    Ok(())
}

/// `train.routing_replay` needs a mixture of experts in `model` (the config of the model in `model_dir`, or
/// of the one its warm start will make).
fn check_routing_replay(
    cfg: &TrainConfig,
    model: &crate::model::ModelConfig,
    model_dir: &std::path::Path,
) -> anyhow::Result<()> {
    if cfg.train.routing_replay && model.moe.is_none() {
        anyhow::bail!(
            "`train.routing_replay` = true, but {} has no mixture-of-experts layer: there is no \
             routing to replay (set it false for a dense model)",
            model_dir.display()
        );
    }
    Ok(())
}

/// The rollout's sizes (and, given the task, its evaluation's: `eval.problems`, or the fewer problems a
/// data set holds out) against the model's positions and the machine's memory, before any prompt is drawn:
/// a `rollout.prompts_per_step` or `eval.problems` far too large is refused by name, not met as an
/// allocation failure after the first evaluation. With the tokenizer, the prompts' lengths are the real
/// longest ones (the held-out problems', the first step's, and the training set's where the task has one);
/// without, one token (a lower bound: each step checks its real prompts again).
pub(super) fn check_step_sizes(
    cfg: &TrainConfig,
    model: &crate::model::ModelConfig,
    evaluation: Option<&Task>,
    tok: Option<&Tokenizer>,
) -> anyhow::Result<()> {
    let (r, e) = (&cfg.rollout, &cfg.eval);
    let rollout_rows = r.prompts_per_step.saturating_mul(r.samples_per_prompt);
    // The one-token bound first: it refuses a count far too large before any prompt is made.
    crate::rollout::check_rollout_size_before_prompts(
        model,
        rl::ROLLOUT_SIZE_KEYS,
        rollout_rows,
        r.max_new_tokens,
    )?;
    let Some(task) = evaluation else {
        return Ok(());
    };
    let eval_rows = task
        .eval_size_at_most(e.problems)
        .saturating_mul(e.k.max(1));
    crate::rollout::check_rollout_size_before_prompts(
        model,
        eval::EVAL_SIZE_KEYS,
        eval_rows,
        e.max_new_tokens,
    )?;
    let Some(tok) = tok else {
        return Ok(());
    };
    // A question the tokenizer cannot encode is named (the tokenizer's error names its own file only).
    let encoded = |examples: &[Example]| -> anyhow::Result<Vec<Vec<u32>>> {
        examples
            .iter()
            .map(|ex| {
                tok.encode_prompt(&ex.prompt, ex.with_bos).map_err(|e| {
                    e.context(format!(
                        "the task's {}",
                        crate::rollout::shown_question(&ex.question)
                    ))
                })
            })
            .collect()
    };
    let mut training = task.training_examples().unwrap_or_default();
    training.extend(super::rl::round_prompts(task, cfg, 0, 0));
    eval::check_example_prompts(
        model,
        (rl::ROLLOUT_SIZE_KEYS, rollout_rows),
        (&training, &encoded(&training)?),
        r.max_new_tokens,
        rl::TRAINING_PROMPT,
    )?;
    let held_out = task.eval_set(e.problems);
    eval::check_example_prompts(
        model,
        (eval::EVAL_SIZE_KEYS, eval_rows),
        (&held_out, &encoded(&held_out)?),
        e.max_new_tokens,
        eval::HELD_OUT,
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

#[cfg(test)]
mod tests {
    use super::TrainerState;

    /// A plain template without a warm start or a stop string is warned about; a stop string, a warm
    /// start or a chat template each silence it.
    #[test]
    fn run_on_answers_of_plain_prompts_are_warned_about() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let base: toml::Table =
            toml::from_str(&std::fs::read_to_string(root.join("configs/default.toml")).unwrap())
                .unwrap();
        let data = root.join("tests/fixtures/gsm8k_slice.jsonl");
        let config = |stop: &str, sft: bool| {
            let mut doc = base.clone();
            let mut task = toml::Table::new();
            task.insert("kind".into(), "gsm8k".into());
            task.insert("path".into(), data.display().to_string().into());
            doc.insert("task".into(), task.into());
            let rollout = doc["rollout"].as_table_mut().unwrap();
            rollout.insert("stop".into(), stop.into());
            if !sft {
                doc.remove("sft");
            }
            let cfg =
                super::TrainConfig::from_toml(&toml::to_string(&doc).unwrap(), "t.toml").unwrap();
            let task = crate::tasks::Task::from_config(&cfg.task).unwrap();
            super::run_on_answers(&cfg, &task)
        };
        let warning = config("end_tokens", false).unwrap();
        assert!(
            warning.contains("`rollout.stop` = \"template\" ends responses at `\\nQuestion:`"),
            "{warning}"
        );
        assert_eq!(config("template", false), None);
        assert_eq!(config("end_tokens", true), None);
    }

    /// A step without reward signal (norm 0) neither starts nor lowers the average: the norms after it are
    /// no spikes; a norm above 10x the average is, once the average has taken in the warm-up's norms.
    #[test]
    fn zero_gradient_norms_leave_the_spike_average_alone() {
        let mut ema = None;
        let mut seen = super::GRAD_NORM_SPIKE_WARMUP;
        let spikes: Vec<bool> = [0.0, 0.5, 0.0, 0.6, 7.0]
            .iter()
            .map(|&g| super::grad_norm_spike(&mut ema, &mut seen, g))
            .collect();
        assert_eq!(spikes, [false, false, false, false, true]);
        assert_eq!(seen, super::GRAD_NORM_SPIKE_WARMUP + 3);
        assert_eq!(
            ema.map(f64::from_bits),
            Some(0.9 * (0.9 * 0.5 + 0.06) + 0.7)
        );
    }

    /// A fresh run flags nothing before the average has taken in the warm-up's norms, however far a norm
    /// jumps (a first step with one group's signal, then a full one), and flags the same jump after it.
    #[test]
    fn no_spike_is_flagged_during_the_warm_up() {
        let (mut ema, mut seen) = (None, 0);
        let warmup = super::GRAD_NORM_SPIKE_WARMUP;
        let mut norms = vec![0.01, 1.0];
        norms.resize(warmup, 1.0);
        for &g in &norms {
            assert!(!super::grad_norm_spike(&mut ema, &mut seen, g), "{g}");
        }
        assert_eq!(seen, warmup);
        assert!(super::grad_norm_spike(&mut ema, &mut seen, 100.0));
    }

    /// A checkpoint written before the count was kept resumes past the warm-up, as its run judged spikes.
    #[test]
    fn an_older_checkpoint_resumes_past_the_warm_up() {
        let mut state = serde_json::to_value(TrainerState::fresh(7)).unwrap();
        assert_eq!(state["grad_norms_seen"], 0);
        state.as_object_mut().unwrap().remove("grad_norms_seen");
        let old: TrainerState = serde_json::from_value(state).unwrap();
        assert_eq!(old.grad_norms_seen, super::GRAD_NORM_SPIKE_WARMUP);
    }
}
