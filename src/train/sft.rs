//! Supervised warm start: next-token cross-entropy on worked solutions (the prompt is context, not target).

use anyhow::Context;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;

use super::batch::SeqBatch;
use super::config::{lr_at, LrSchedule, SftConfig, TrainConfig};
use super::metrics::MetricsLog;
use super::progress::progress_bar;
use crate::host::to_f32_vec;
use crate::model::{Decoder, Tokenizer, Weights};
use crate::tasks::{Example, Task};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Prompt ids and prompt + solution + EOS ids of one example.
pub fn encode_example(
    tok: &Tokenizer,
    ex: &Example,
    eos: u32,
) -> anyhow::Result<(Vec<u32>, usize)> {
    let prompt = tok.encode(&ex.prompt)?;
    let solution = ex
        .solution
        .as_deref()
        .context("the task has no worked solutions for SFT")?;
    let mut ids = prompt.clone();
    ids.extend(tok.encode(solution)?);
    ids.push(eos);
    Ok((ids, prompt.len()))
}

/// Replaces the target of a `frac` share of `examples` by the answer alone (`sft.answer_only_frac`), drawn
/// per example from `seed` (the step's sampling seed; the draws use their own ChaCha stream).
pub fn with_answer_only(
    task: &Task,
    mut examples: Vec<Example>,
    frac: f64,
    seed: u64,
) -> Vec<Example> {
    if frac <= 0.0 {
        return examples;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(1);
    for ex in &mut examples {
        if rng.random::<f64>() < frac {
            ex.solution = Some(task.answer_only_solution(ex));
        }
    }
    examples
}

/// Trains `model` (on an autodiff device) for `cfg.steps` steps; returns it and the last loss.
pub fn run_sft(
    mut model: Decoder,
    tok: &Tokenizer,
    eos: u32,
    train: &TrainConfig,
    cfg: &SftConfig,
    log: &mut MetricsLog,
    quiet: bool,
) -> anyhow::Result<(Decoder, f32)> {
    let task = Task::from_config(&train.task)?;
    let device: Device = model.device();
    let mut optim = AdamWConfig::new()
        .with_weight_decay(cfg.weight_decay)
        .init();
    let bar = progress_bar(cfg.steps as u64, "sft", quiet);
    let mut last = f32::NAN;
    let mut nonfinite = 0usize;
    for step in 0..cfg.steps {
        let step_seed = train.seed.wrapping_mul(7919).wrapping_add(step as u64);
        let examples = task.sample_prompts(cfg.batch_size, step_seed);
        let examples = with_answer_only(&task, examples, cfg.answer_only_frac, step_seed);
        let (seqs, lens): (Vec<_>, Vec<_>) = examples
            .iter()
            .map(|ex| encode_example(tok, ex, eos))
            .collect::<anyhow::Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let batch = SeqBatch::new(seqs, lens);
        let mask = batch.mask(&device);
        let (lp, _) = batch.logprobs(&model, Weights::Packed, 1.0, None);
        let loss = (lp * mask.clone()).sum().neg() / mask.sum();
        last = to_f32_vec(loss.clone())[0];
        let grads = loss.backward();
        let grads = GradientsParams::from_grads(grads, &model);
        let norm = super::rl::grad_norm(&model, &grads);
        if !last.is_finite() || !norm.is_finite() {
            // Skip the update (the weights stay) and stop after too many in a row.
            nonfinite += 1;
            tracing::warn!(
                step,
                loss = last,
                grad_norm = norm,
                "sft: non-finite loss or gradient, update skipped"
            );
            log.write(&serde_json::json!({"phase": "sft", "step": step, "sft/loss": last, "sft/nonfinite": 1}))?;
            let max = train.train.max_nonfinite_steps;
            if max > 0 && nonfinite >= max {
                anyhow::bail!(
                    "stopping SFT: {nonfinite} consecutive steps (up to step {step}) had a NaN or infinite loss or \
                     gradient (`train.max_nonfinite_steps` = {max}); lower `sft.lr` or check the data"
                );
            }
            bar.inc(1);
            continue;
        }
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
        bar.inc(1);
    }
    bar.finish();
    Ok((model, last))
}
