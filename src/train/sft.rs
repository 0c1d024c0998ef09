//! Supervised warm start: next-token cross-entropy on worked solutions (the prompt is context, not target).

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;

use super::batch::SeqBatch;
use super::checkpoint::TrainerState;
use super::config::{lr_at, LrSchedule, SftConfig, TrainConfig};
use super::metrics::MetricsLog;
use super::progress::progress_bar;
use crate::host::to_f32_vec;
use crate::model::{Decoder, Tokenizer, Weights};
use crate::tasks::{Example, Task};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Prompt ids and prompt + solution + EOS ids of one example. `eos` is `None` where the completion ends the
/// assistant's turn itself (a chat template: TRL appends nothing to such an example either); a completion
/// that already ends with the EOS does not get a second one, which would train a meaningless `<|im_end|>`
/// after `<|im_end|>`.
///
/// The solution's ids are those that follow the prompt's in the encoding of the whole text, as TRL splits
/// them: a tokenizer that marks the start of a text (SentencePiece's `▁`, Llama 2's legacy normalizer)
/// would otherwise start every solution with a word start the whole text never has, training sequences the
/// tokenizer never produces. Where a token spans the boundary (the whole text's ids do not start with the
/// prompt's), the solution is encoded alone.
pub fn encode_example(
    tok: &Tokenizer,
    ex: &Example,
    eos: Option<u32>,
) -> anyhow::Result<(Vec<u32>, usize)> {
    let prompt = tok.encode_prompt(&ex.prompt, ex.with_bos)?;
    let solution = ex
        .solution
        .as_deref()
        .context("the task has no worked solutions for SFT")?;
    let whole = tok
        .encode_prompt(&format!("{}{solution}", ex.prompt), ex.with_bos)
        .ok()
        .filter(|w| w.len() > prompt.len() && w.starts_with(&prompt));
    let mut ids = match whole {
        Some(whole) => whole,
        None => [prompt.clone(), tok.encode(solution)?].concat(),
    };
    if let Some(eos) = eos.filter(|e| ids.last() != Some(e)) {
        ids.push(eos);
    }
    Ok((ids, prompt.len()))
}

/// Replaces the target of a `frac` share of `examples` by the answer alone (`sft.answer_only_frac`), drawn
/// per example from `seed` (the step's sampling seed; the draws use their own ChaCha stream).
pub fn with_answer_only(
    task: &Task,
    mut examples: Vec<Example>,
    frac: f64,
    seed: u64,
) -> anyhow::Result<Vec<Example>> {
    if frac <= 0.0 {
        return Ok(examples);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(1);
    for ex in &mut examples {
        if rng.random::<f64>() < frac {
            ex.solution = Some(task.answer_only_solution(ex)?);
        }
    }
    Ok(examples)
}

/// Where the warm start of a run keeps its checkpoints (beside the RL ones, which never look there).
pub fn checkpoints_root(run_dir: &Path) -> PathBuf {
    super::checkpoint::checkpoints_dir(run_dir).join("sft")
}

/// The file in an SFT checkpoint that says which warm start wrote it (its `[sft]` section and seed) and the
/// last loss, so a resume continues the same warm start and returns the same loss.
const SFT_STATE_FILE: &str = "sft.json";

/// How a warm start checkpoints and resumes.
pub struct SftCheckpoints<'a> {
    /// Where the checkpoints go ([`checkpoints_root`] of the run directory).
    pub root: PathBuf,
    /// A checkpoint every this many SFT steps (0: none); the run's `checkpoint_every`.
    pub every: usize,
    /// Continue from the newest checkpoint under `root` (otherwise the checkpoints there are removed).
    pub resume: bool,
    /// The model's `config.json`, written into each checkpoint.
    pub config_json: &'a serde_json::Value,
    /// Where the tokenizer files are.
    pub tok_dir: &'a Path,
}

/// Trains `model` (on an autodiff device) for `cfg.steps` steps; returns it and the last loss.
pub fn run_sft(
    model: Decoder,
    tok: &Tokenizer,
    eos: u32,
    train: &TrainConfig,
    cfg: &SftConfig,
    log: &mut MetricsLog,
    quiet: bool,
) -> anyhow::Result<(Decoder, f32)> {
    run_sft_with(model, tok, eos, train, cfg, log, quiet, None)
}

/// The warm start's identity in its checkpoints: what it trains (the model's config, from the base or
/// `init_config`, and the base it starts from) on what (the task) and how (`[sft]`, the seed, the
/// initialisation's std).
fn identity(
    train: &TrainConfig,
    cfg: &SftConfig,
    model_config: &serde_json::Value,
    last: f32,
) -> serde_json::Value {
    // `init_std` only draws random weights: a base's start ignores it.
    let init_std = train.model.base.is_none().then_some(train.model.init_std);
    serde_json::json!({
        "seed": train.seed,
        "sft": cfg,
        "base": train.model.base,
        "model_config": model_config,
        "init_std": init_std,
        "task": train.task.with_defaults(),
        "last_loss_bits": last.to_bits(),
    })
}

/// `v` as written to and read back from a file: f32 values widened to f64 print with 17 digits, which
/// serde_json reads back one step off for some values (0.03), so a fresh identity is compared after the
/// same trip.
fn as_read_back(v: &serde_json::Value) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::from_str(&serde_json::to_string(v)?)?)
}

/// A recorded `[sft]` or task table read as this version reads it (defaults of fields added since filled
/// in), where it parses; as recorded otherwise.
fn as_this_version<T: serde::de::DeserializeOwned + serde::Serialize>(
    v: &serde_json::Value,
) -> serde_json::Value {
    serde_json::from_value::<T>(v.clone())
        .ok()
        .and_then(|t| serde_json::to_value(t).ok())
        .unwrap_or_else(|| v.clone())
}

/// Refuses a resume point (`sft.json` at `path`, read as `saved`) that another warm start wrote: the keys
/// of the identity that both record must agree.
fn check_identity(
    path: &Path,
    root: &Path,
    saved: &serde_json::Value,
    want: &serde_json::Value,
) -> anyhow::Result<()> {
    // The fresh identity through the file's trip that the saved one made, then both tables read as this
    // version reads them (defaults of fields added since filled in).
    let want = as_read_back(want)?;
    let normalize = |v: &serde_json::Value| -> serde_json::Value {
        let mut v = v.clone();
        if let Some(m) = v.as_object_mut() {
            if let Some(t) = m.get("task") {
                let t = crate::tasks::TaskConfig::normalized_json(t);
                m.insert("task".into(), t);
            }
            if let Some(c) = m.get("sft") {
                let c = as_this_version::<SftConfig>(c);
                m.insert("sft".into(), c);
            }
        }
        v
    };
    let (saved, want) = (normalize(saved), normalize(&want));
    // Compared on the keys both record: checkpoints written before a key joined the identity lack it.
    let recorded = |v: &serde_json::Value| -> serde_json::Value {
        let mut v = v.clone();
        if let Some(m) = v.as_object_mut() {
            m.retain(|k, _| {
                k != "last_loss_bits" && saved.get(k).is_some() && want.get(k).is_some()
            });
        }
        v
    };
    let differ = super::config::differing_keys(&recorded(&saved), &recorded(&want));
    if !differ.is_empty() {
        anyhow::bail!(
            "{}: written by a warm start with other `{}` than this config's (the model's config, the base, \
             the task, `[sft]`, the seed and `model.init_std` make a warm start), so resuming would not \
             continue it; restore them, or delete {} to start the warm start over",
            path.display(),
            differ.join("`, `"),
            root.display()
        );
    }
    Ok(())
}

/// The model config a warm start of `train` trains (the base's, or the `init_config` it copies): what
/// its resume point records.
fn model_config_json(train: &TrainConfig) -> anyhow::Result<Option<serde_json::Value>> {
    let file = match (&train.model.base, &train.model.init_config) {
        (Some(base), _) => base.join("config.json"),
        (None, Some(init)) if init.is_dir() => init.join("config.json"),
        (None, Some(init)) => init.clone(),
        (None, None) => return Ok(None),
    };
    Ok(Some(crate::io::read_json(&file)?))
}

/// Before anything of the run directory changes: refuses a resume whose unfinished warm start (its
/// newest resume point under `run_dir`) another warm start wrote, as [`run_sft_with`] would once the
/// model is staged, by when `qarl train` has already rewritten the run's config.json.
pub fn check_warm_start_resume(train: &TrainConfig) -> anyhow::Result<()> {
    let (Some(cfg), false) = (&train.sft, train.model.dir.exists()) else {
        return Ok(());
    };
    let root = checkpoints_root(&train.run_dir);
    let Some((p, _)) = super::checkpoint::latest_checked_in(&root)? else {
        return Ok(());
    };
    let Some(model_config) = model_config_json(train)? else {
        return Ok(());
    };
    let path = p.join(SFT_STATE_FILE);
    let saved: serde_json::Value = crate::io::read_json(&path)?;
    check_identity(
        &path,
        &root,
        &saved,
        &identity(train, cfg, &model_config, 0.0),
    )
}

/// The checkpoint to resume from, checked to belong to this warm start; without `resume`, the old
/// checkpoints are removed.
fn resume_point(
    ck: &SftCheckpoints,
    train: &TrainConfig,
    cfg: &SftConfig,
) -> anyhow::Result<Option<(PathBuf, TrainerState, f32)>> {
    if !ck.resume {
        if ck.root.exists() {
            std::fs::remove_dir_all(&ck.root)
                .with_context(|| format!("{}: cannot remove", ck.root.display()))?;
        }
        return Ok(None);
    }
    let Some((p, state)) = super::checkpoint::latest_checked_in(&ck.root)? else {
        return Ok(None);
    };
    let path = p.join(SFT_STATE_FILE);
    let saved: serde_json::Value = crate::io::read_json(&path)?;
    check_identity(
        &path,
        &ck.root,
        &saved,
        &identity(train, cfg, ck.config_json, 0.0),
    )?;
    let last = saved["last_loss_bits"]
        .as_u64()
        .and_then(|b| u32::try_from(b).ok())
        .map_or(f32::NAN, f32::from_bits);
    Ok(Some((p, state, last)))
}

/// [`run_sft`] with checkpoints: with `ck`, a checkpoint every `ck.every` steps, and a resume from the newest
/// one continues exactly where it stopped (same weights, Adam moments, data and learning rate as a run that
/// was never stopped); the metrics rows of the steps it redoes are dropped from `log`.
#[allow(clippy::too_many_arguments)]
pub fn run_sft_with(
    mut model: Decoder,
    tok: &Tokenizer,
    eos: u32,
    train: &TrainConfig,
    cfg: &SftConfig,
    log: &mut MetricsLog,
    quiet: bool,
    ck: Option<&SftCheckpoints>,
) -> anyhow::Result<(Decoder, f32)> {
    super::config::warn_long_warmup("sft", cfg.warmup_steps, cfg.steps);
    let task = Task::from_config(&train.task)?;
    let device: Device = model.device();
    let mut optim = AdamWConfig::new()
        .with_weight_decay(cfg.weight_decay)
        .init();
    let mut last = f32::NAN;
    let mut nonfinite = 0usize;
    let mut start = 0;
    let resumed = match ck {
        Some(ck) => resume_point(ck, train, cfg)?,
        None => None,
    };
    if let Some((p, state, loss)) = &resumed {
        model = super::checkpoint::load_model(p, &device)?;
        optim = super::checkpoint::load_optimizer(optim, p, &model)?;
        // The step after the checkpoint's (what `next_step` holds, unread: an edited one ran too few
        // steps, or none, and wrote the model as finished).
        start = state.step + 1;
        nonfinite = state.consecutive_nonfinite;
        last = *loss;
        tracing::info!(checkpoint = %p.display(), next_step = start, "resuming the warm start");
        let done = state.step as u64;
        log.retain(|r| r["phase"] != "sft" || r["step"].as_u64().is_some_and(|s| s <= done))?;
    } else {
        log.retain(|r| r["phase"] != "sft")?;
    }
    // The batch size against the memory and the position limit, before a batch is built: every training
    // record of a data set (each step draws its own, so the first step's say nothing of a long record
    // later), and the first step's examples (up to 256) of a generated task, whose lengths its knobs bound.
    task.check_completions()?;
    // A model's chat template closes the turn in the completion itself.
    let eos = (!task.completion_closes_turn()).then_some(eos);
    let probe = task.training_examples().unwrap_or_else(|| {
        task.sample_prompts(
            cfg.batch_size.min(256),
            super::seeds::sft_step_seed(train.seed, 0),
        )
    });
    let (mut longest, mut longest_question) = (0, "");
    for ex in &probe {
        let n = encode_example(tok, ex, eos)?.0.len();
        if n > longest {
            (longest, longest_question) = (n, ex.question.as_str());
        }
    }
    crate::rollout::check_training_size(&model.config, "sft.batch_size", cfg.batch_size, longest)
        .map_err(|e| match e {
        // Named by its question: which record of the data set is too long.
        crate::rollout::BudgetError::TrainPositions { .. } => anyhow::anyhow!(
            "the worked example of {}: {e}",
            crate::rollout::shown_question(longest_question)
        ),
        e => e.into(),
    })?;
    let bar = progress_bar(cfg.steps as u64, "sft", quiet);
    bar.set_position(start as u64);
    // The rate and the ETA count the steps of this process only (a resumed bar jumped to millions/s).
    bar.reset_eta();
    for step in start..cfg.steps {
        let step_seed = super::seeds::sft_step_seed(train.seed, step);
        let examples = task.sample_prompts(cfg.batch_size, step_seed);
        let examples = with_answer_only(&task, examples, cfg.answer_only_frac, step_seed)?;
        let (seqs, lens): (Vec<_>, Vec<_>) = examples
            .iter()
            .map(|ex| encode_example(tok, ex, eos))
            .collect::<anyhow::Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        check_step_positions(&model.config, step, &examples, &seqs)?;
        let batch = SeqBatch::new(seqs, lens);
        let mask = batch.mask(&device);
        let (lp, _) = batch.logprobs(&model, Weights::Packed, 1.0, None);
        let loss = (lp * mask.clone()).sum().neg() / mask.sum();
        last = to_f32_vec(loss.clone())[0];
        let grads = loss.backward();
        let grads = GradientsParams::from_grads(grads, &model);
        let norm = super::update::grad_norm(&model, &grads);
        if !last.is_finite() || !norm.is_finite() {
            // Skip the update (the weights stay) and stop after too many in a row.
            nonfinite = nonfinite.saturating_add(1);
            tracing::warn!(
                step,
                loss = last,
                grad_norm = norm,
                "sft: non-finite loss or gradient, update skipped"
            );
            log.write(&serde_json::json!({"phase": "sft", "step": step, "sft/loss": last, "sft/nonfinite": 1}))?;
            let max = train.train.max_nonfinite_steps;
            if super::config::nonfinite_limit_reached(nonfinite, max, cfg.steps) {
                anyhow::bail!(
                    "stopping SFT: {nonfinite} consecutive steps, from step {} to step {step}, had a NaN or \
                     infinite loss or gradient (`train.max_nonfinite_steps` = {max}, or every step of a \
                     shorter warm start); lower `sft.lr`, or check \
                     the data and the initial weights (`model.init_std`)",
                    (step + 1).saturating_sub(nonfinite)
                );
            }
        } else {
            nonfinite = 0;
            let lr = lr_at(
                cfg.lr,
                LrSchedule::Cosine,
                cfg.warmup_steps,
                step,
                cfg.steps,
            );
            model = optim.step(lr, model, grads);
            if step % cfg.log_every == 0 || step + 1 == cfg.steps {
                log.write(
                    &serde_json::json!({"phase": "sft", "step": step, "sft/loss": last, "sft/lr": lr, "sft/grad_norm": norm}),
                )?;
            }
            bar.set_message(format!("loss {last:.3}"));
        }
        bar.inc(1);
        if let Some(ck) = ck.filter(|c| c.every > 0 && (step + 1) % c.every == 0) {
            if step + 1 < cfg.steps {
                let mut state = TrainerState::after_step(step, train.seed);
                state.consecutive_nonfinite = nonfinite;
                let extra = [(SFT_STATE_FILE, identity(train, cfg, ck.config_json, last))];
                let parts = super::checkpoint::Parts {
                    model: &model,
                    config_json: ck.config_json,
                    optim: &optim,
                    tok_dir: ck.tok_dir,
                    extra: &extra,
                };
                // Only the newest is kept: the checkpoints of a warm start are resume points, not results.
                log.sync()?;
                super::checkpoint::save_in(&ck.root, &state, &parts, 1)?;
            }
        }
    }
    bar.finish();
    Ok((model, last))
}

/// Refuses a step's example longer than the model's positions: the check before the first step reads every
/// record of a data set but only the first step's examples of a generated task, whose later draws may be
/// longer (RoPE would go on past `max_position_embeddings` without a word).
fn check_step_positions(
    config: &crate::model::ModelConfig,
    step: usize,
    examples: &[crate::tasks::Example],
    seqs: &[Vec<u32>],
) -> anyhow::Result<()> {
    let limit = config.max_position_embeddings;
    match seqs.iter().position(|s| s.len() > limit) {
        Some(i) => anyhow::bail!(
            "warm-start step {step}: the worked example of {} is {} tokens, beyond the model's \
             max_position_embeddings ({limit}); narrow the task (fewer digits or terms) or use a model with \
             more positions",
            crate::rollout::shown_question(&examples[i].question),
            seqs[i].len()
        ),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chat completion closes its turn with `<|im_end|>`, the EOS of Qwen and SmolLM2: one end token, not
    /// two; a plain completion gets the EOS appended.
    #[test]
    fn an_example_ends_with_one_eos() {
        let tok = Tokenizer::from_json_text(
            r#"{"version": "1.0", "truncation": null, "padding": null,
                "added_tokens": [{"id": 0, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                                  "rstrip": false, "normalized": false, "special": true}],
                "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
                "decoder": null,
                "model": {"type": "WordLevel", "vocab": {"<|im_end|>": 0, "a": 1, "b": 2, "[UNK]": 3},
                          "unk_token": "[UNK]"}}"#,
        );
        let example = |solution: &str| Example {
            question: "a".into(),
            prompt: "a".into(),
            with_bos: true,
            answer: "b".into(),
            solution: Some(solution.into()),
        };
        for solution in ["b<|im_end|>", "b"] {
            let (ids, prompt_len) = encode_example(&tok, &example(solution), Some(0)).unwrap();
            assert_eq!((ids, prompt_len), (vec![1, 2, 0], 1), "{solution}");
        }
    }

    /// A tokenizer that marks the start of every text (Llama 2's legacy `Prepend("▁")` normalizer) encodes
    /// a solution alone with a word start it never has after its prompt (` b` alone is `▁▁ b`, after `a`
    /// it is `▁b`): the example takes the whole text's ids, as TRL does (the ids the Python `tokenizers`
    /// library gives for this tokenizer: `a` [3, 1], ` b` [4, 2], `a b` [3, 1, 5]).
    #[test]
    fn a_solution_is_encoded_as_it_follows_its_prompt() {
        let tok = Tokenizer::from_json_text(
            r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
                "normalizer":{"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},
                    {"type":"Replace","pattern":{"String":" "},"content":"▁"}]},
                "pre_tokenizer":null,"post_processor":null,"decoder":null,
                "model":{"type":"BPE","dropout":null,"unk_token":"<unk>","continuing_subword_prefix":null,
                    "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
                    "vocab":{"<unk>":0,"a":1,"b":2,"▁":3,"▁▁":4,"▁b":5},"merges":[["▁","▁"],["▁","b"]]}}"#,
        );
        let ex = Example {
            question: "a".into(),
            prompt: "a".into(),
            with_bos: false,
            answer: "b".into(),
            solution: Some(" b".into()),
        };
        assert_eq!(tok.encode(" b").unwrap(), vec![4, 2]);
        let (ids, prompt_len) = encode_example(&tok, &ex, None).unwrap();
        assert_eq!((ids, prompt_len), (vec![3, 1, 5], 2));
    }

    /// A warm start's identity read back from its resume point matches the fresh one for every f32
    /// setting: serde_json reads some 17-digit numbers one step off (`model.init_std = 0.03`, which made
    /// an interrupted warm start impossible to resume), so the fresh one is compared after the same trip.
    #[test]
    fn identities_compare_after_the_files_trip() {
        let mut train = TrainConfig::from_toml(super::super::config::DEFAULT_CONFIG, "d").unwrap();
        let model_config = serde_json::json!({"rms_norm_eps": 1e-6, "hidden_size": 64});
        let root = Path::new("ck");
        for std in [0.03f32, 0.015, 0.014, 0.0039, 0.0098, 0.02] {
            train.model.init_std = std;
            let sft = train.sft.clone().unwrap();
            let mut sft_odd = sft.clone();
            sft_odd.weight_decay = std;
            for cfg in [&sft, &sft_odd] {
                let written = identity(&train, cfg, &model_config, 1.5);
                let saved: serde_json::Value =
                    serde_json::from_str(&serde_json::to_string(&written).unwrap()).unwrap();
                let fresh = identity(&train, cfg, &model_config, 0.0);
                check_identity(Path::new("sft.json"), root, &saved, &fresh).unwrap();
            }
            // A real change is still named.
            let mut other = train.clone();
            other.model.init_std = std * 2.0;
            let saved: serde_json::Value = serde_json::from_str(
                &serde_json::to_string(&identity(&train, &sft, &model_config, 1.5)).unwrap(),
            )
            .unwrap();
            let err = check_identity(
                Path::new("sft.json"),
                root,
                &saved,
                &identity(&other, &sft, &model_config, 0.0),
            )
            .unwrap_err();
            assert!(err.to_string().contains("`init_std`"), "{err}");
        }
    }

    /// A later step's example past the model's positions is refused by its question and step.
    #[test]
    fn a_step_example_past_the_positions_is_refused() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("configs/models/qwen3-moe-arith.json");
        let config = crate::model::ModelConfig::from_file(&path).unwrap();
        let limit = config.max_position_embeddings;
        let example = |q: &str| Example {
            question: q.into(),
            prompt: q.into(),
            with_bos: false,
            answer: "1".into(),
            solution: None,
        };
        let examples = [example("short"), example("long one")];
        let fits = [vec![0; limit], vec![0; 3]];
        check_step_positions(&config, 7, &examples, &fits).unwrap();
        let over = [vec![0; 3], vec![0; limit + 1]];
        let e = check_step_positions(&config, 7, &examples, &over)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("warm-start step 7") && e.contains("long one"),
            "{e}"
        );
        assert!(e.contains(&format!("is {} tokens", limit + 1)), "{e}");
    }
}
