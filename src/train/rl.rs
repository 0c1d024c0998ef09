//! One RL step in three phases: [`collect`] (roll out with the configured precision, reward, advantages),
//! [`score`] (`lp_old` with the configured training forward, or the rollout's record where that is the same
//! bits, and the mismatch metrics), [`update`] (policy updates over mini-batches, one quantization per new
//! weight version).

use std::collections::BTreeMap;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;

use super::batch::{replay_routing, ResponseForward, SeqBatch};
use super::config::{lr_at, TrainConfig, TrainForward};
use crate::host::{tensor_from_vec, to_f32_vec};
use crate::model::scoring::entropy_rows;
use crate::model::{Decoder, Tokenizer};
use crate::rl::advantages::{group_advantages, groups_with_signal, responses_of_groups};
use crate::rl::losses::{PolicyLoss, PolicyLossInputs};
use crate::rl::metrics::{
    error_token_metrics, mean, response_length_metrics, rollout_mismatch_metrics,
    routing_disagreement,
};
use crate::rollout::{generate, FinishReason, Rollout, SamplingParams};
use crate::tasks::verify::score as score_answer;
use crate::tasks::Task;

/// Everything one step produced for the log.
pub struct StepOutcome {
    pub metrics: BTreeMap<String, f64>,
    /// Updates of this step skipped because the loss or the gradient was NaN or infinite.
    pub nonfinite_updates: usize,
    /// Global L2 norm of the gradient, averaged over the step's applied updates (before clipping).
    pub grad_norm: Option<f64>,
}

/// The global L2 norm of the gradients of `model`'s float parameters (NaN/inf when any entry is).
pub fn grad_norm(model: &Decoder, grads: &GradientsParams) -> f64 {
    struct Norm<'a> {
        grads: &'a GradientsParams,
        sq: f64,
    }
    impl ModuleVisitor for Norm<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let sq = to_f32_vec((g.clone() * g).sum());
                self.sq += sq.first().copied().unwrap_or(f32::NAN) as f64;
            }
        }
    }
    let mut v = Norm { grads, sq: 0.0 };
    model.visit(&mut v);
    v.sq.sqrt()
}

/// Runs RL step `step` on `model` (autodiff device; its quantized state is the rollout's weight version):
/// [`collect`] (rollout, rewards, advantages), [`score`] (`lp_old` and the mismatch metrics), [`update`]
/// (the policy updates). An update whose loss or gradient is not finite is skipped (the weights and
/// optimizer state stay); `inject_nonfinite` makes every loss NaN (fault injection for tests).
#[allow(clippy::too_many_arguments)]
pub fn rl_step(
    model: &mut Decoder,
    optim: &mut ModuleOptimizer,
    task: &Task,
    tok: &Tokenizer,
    eos: u32,
    cfg: &TrainConfig,
    step: usize,
    inject_nonfinite: bool,
) -> anyhow::Result<StepOutcome> {
    let t0 = Instant::now();
    let collected = collect(model, task, tok, eos, cfg, step)?;
    let mut m = collected.metrics.clone();
    let mut outcome = UpdateOutcome::default();
    if !collected.rows.is_empty() {
        let t_score = Instant::now();
        let scored = score(model, &collected, cfg, &mut m)?;
        m.insert("perf/lp_old_s".into(), t_score.elapsed().as_secs_f64());
        outcome = update(model, optim, &scored, cfg, step, inject_nonfinite, &mut m)?;
    }
    m.insert(
        "train/nonfinite_updates".into(),
        outcome.nonfinite_updates as f64,
    );
    let grad_norms = &outcome.grad_norms;
    let grad_norm =
        (!grad_norms.is_empty()).then(|| grad_norms.iter().sum::<f64>() / grad_norms.len() as f64);
    if let Some(g) = grad_norm {
        m.insert("actor/grad_norm".into(), g);
        m.insert(
            "actor/grad_norm_max".into(),
            grad_norms.iter().copied().fold(0.0, f64::max),
        );
    }
    if outcome.packed_stale {
        // The next rollout's weight version, quantized once from the final masters.
        model.requantize()?;
    }
    m.insert("perf/step_s".into(), t0.elapsed().as_secs_f64());
    Ok(StepOutcome {
        metrics: m,
        nonfinite_updates: outcome.nonfinite_updates,
        grad_norm,
    })
}

/// What the rollout phase of a step produced.
pub struct Collected {
    pub rollout: Rollout,
    /// One advantage per sampled sequence.
    pub advantages: Vec<f32>,
    /// The sequences the update trains on (all, or those of groups with a reward signal).
    pub rows: Vec<usize>,
    /// Reward, length and rollout-speed metrics.
    pub metrics: BTreeMap<String, f64>,
}

/// Samples the step's prompts with the model's current weight version, scores the responses with the
/// verifier and computes the group advantages.
pub fn collect(
    model: &Decoder,
    task: &Task,
    tok: &Tokenizer,
    eos: u32,
    cfg: &TrainConfig,
    step: usize,
) -> anyhow::Result<Collected> {
    let rc = &cfg.rollout;
    let g = rc.samples_per_prompt;
    let examples = task.sample_prompts(
        rc.prompts_per_step,
        cfg.seed
            .wrapping_mul(1_000_003)
            .wrapping_add(step as u64 + 1),
    );
    let prompts: Vec<Vec<u32>> = examples
        .iter()
        .map(|e| tok.encode(&e.prompt))
        .collect::<anyhow::Result<_>>()?;

    // Rollout on a plain-device view of the model: it shares the packed weights of this weight version.
    let policy = model.valid();
    let params = SamplingParams {
        temperature: rc.temperature,
        top_p: rc.top_p,
        top_k: rc.top_k,
        max_new_tokens: rc.max_new_tokens,
        seed: cfg.seed.wrapping_mul(31).wrapping_add(step as u64),
        stop_token_ids: vec![eos],
        stop_strings: vec![],
    };
    let t_roll = Instant::now();
    let out = generate(&policy, &prompts, g, &params, Some(tok));
    let rollout_s = t_roll.elapsed().as_secs_f64();
    let gen_tokens = out.generated_tokens();

    // Rewards and advantages.
    let mut rewards = Vec::with_capacity(out.ids.len());
    let mut correct = 0usize;
    for r in 0..out.ids.len() {
        let resp = out.response(r);
        let text = tok.decode(resp.strip_suffix(&[eos]).unwrap_or(resp))?;
        let v = score_answer(&text, &examples[r / g].answer, &cfg.verify);
        correct += usize::from(v.correct);
        rewards.push(v.reward);
    }
    let tc = &cfg.train;
    let advantages = group_advantages(&rewards, g, &tc.advantage)?;
    let rows: Vec<usize> = if tc.dynamic_sampling {
        responses_of_groups(&groups_with_signal(&rewards, g)?, g)
    } else {
        (0..out.ids.len()).collect()
    };

    let mut m = BTreeMap::new();
    let n = out.ids.len() as f64;
    m.insert(
        "critic/rewards/mean".into(),
        rewards.iter().map(|&r| r as f64).sum::<f64>() / n,
    );
    m.insert("train/accuracy".into(), correct as f64 / n);
    let lens: Vec<usize> = (0..out.ids.len()).map(|r| out.response(r).len()).collect();
    m.extend(response_length_metrics(&lens, rc.max_new_tokens));
    m.insert(
        "response/stop_frac".into(),
        out.finish_reasons
            .iter()
            .filter(|&&f| f == FinishReason::Stop)
            .count() as f64
            / n,
    );
    m.insert(
        "perf/rollout_tokens_per_s".into(),
        gen_tokens as f64 / rollout_s.max(1e-9),
    );
    m.insert("perf/rollout_s".into(), rollout_s);
    m.insert("train/kept_sequences".into(), rows.len() as f64);
    Ok(Collected {
        rollout: out,
        advantages,
        rows,
        metrics: m,
    })
}

/// The kept sequences as the learner sees them at the start of the step.
pub struct Scored<'a> {
    pub batch: SeqBatch,
    /// The rollout's expert choices of each kept sequence (MoE).
    pub records: Vec<&'a Vec<Option<Vec<u32>>>>,
    /// Routing replay for `batch`, when on.
    pub replay: Option<Vec<Option<Vec<u32>>>>,
    /// `lp_old` of each kept response: the learner's log-probs before any update of this step.
    pub lp_old: Vec<Vec<f32>>,
    /// The rollout's recorded log-probs of each kept response.
    pub lp_roll: Vec<Vec<f32>>,
    pub advantages: Vec<f32>,
    /// Whether `lp_old` is the rollout's record (no forward ran): the first update's forward then supplies
    /// the metrics of the learner's forward (entropy, routing).
    pub lp_old_reused: bool,
    /// Experts per token of the model's MoE layers (0 for a dense model).
    pub top_k: usize,
}

/// Whether `lp_old` equals the rollout's recorded log-probs bit for bit, so that no forward is needed: in
/// deterministic mode the aligned training forward computes the rollout's bits, and with one update per
/// step nothing has changed the weights before the update's own forward.
pub fn lp_old_is_the_rollout_record(cfg: &TrainConfig, rows: usize) -> bool {
    let tc = &cfg.train;
    crate::ops::deterministic()
        && tc.forward == TrainForward::Aligned
        && tc.epochs == 1
        && (tc.minibatch_size == 0 || tc.minibatch_size >= rows)
        && cfg.rollout.temperature > 0.0
}

/// `lp_old` of the kept sequences (the rollout's record where it is provably the same, else one no-gradient
/// forward) and the rollout/learner mismatch metrics.
pub fn score<'a>(
    model: &Decoder,
    c: &'a Collected,
    cfg: &TrainConfig,
    m: &mut BTreeMap<String, f64>,
) -> anyhow::Result<Scored<'a>> {
    let (rc, tc, out) = (&cfg.rollout, &cfg.train, &c.rollout);
    let top_k = model
        .config
        .moe
        .as_ref()
        .map_or(0, |moe| moe.num_experts_per_tok);
    let seqs: Vec<Vec<u32>> = c.rows.iter().map(|&r| out.ids[r].clone()).collect();
    let plens: Vec<usize> = c.rows.iter().map(|&r| out.prompt_lens[r]).collect();
    let batch = SeqBatch::new(seqs, plens);
    let records: Vec<&Vec<Option<Vec<u32>>>> = c.rows.iter().map(|&r| &out.routing[r]).collect();
    let replay = (tc.routing_replay && top_k > 0)
        .then(|| replay_routing(&records, &batch.seqs, top_k, model.layers.len()));
    let lp_roll: Vec<Vec<f32>> = c.rows.iter().map(|&r| out.logprobs[r].clone()).collect();
    let roll_grid = batch.grid_values(&lp_roll);

    let reuse = lp_old_is_the_rollout_record(cfg, c.rows.len());
    let (lp_old, lp_old_grid) = if reuse && !tc.lp_old_check {
        (lp_roll.clone(), roll_grid.clone())
    } else {
        // The learner forward at the start of the step (no gradient).
        let learner = model.valid();
        let weights = tc.forward.weights();
        let (lp_old_t, fwd) = batch.logprobs(&learner, weights, rc.temperature, replay.as_deref());
        let grid = to_f32_vec(lp_old_t);
        let lp_old = batch.responses_of(&grid);
        if reuse {
            check_lp_old_reuse(&lp_old, &lp_roll)?;
        }
        learner_forward_metrics(&fwd, &batch, &records, replay.is_some(), top_k, m)?;
        (lp_old, grid)
    };
    let mask_bool: Vec<bool> = batch.mask_values().iter().map(|&v| v > 0.0).collect();
    m.extend(rollout_mismatch_metrics(
        &lp_old_grid,
        &roll_grid,
        &mask_bool,
        batch.width,
    )?);
    let ids_grid: Vec<u32> = batch
        .seqs
        .iter()
        .flat_map(|s| (0..batch.width).map(move |t| s.get(t + 1).copied().unwrap_or(0)))
        .collect();
    let err = error_token_metrics(
        &ids_grid,
        &lp_old_grid,
        &roll_grid,
        &mask_bool,
        batch.width,
        tc.error_tokens,
    )?;
    m.extend(err.to_map());
    m.insert("train/lp_old_reused".into(), f64::from(u8::from(reuse)));
    Ok(Scored {
        batch,
        records,
        replay,
        lp_old,
        lp_roll,
        advantages: c.rows.iter().map(|&r| c.advantages[r]).collect(),
        lp_old_reused: reuse,
        top_k,
    })
}

/// `train.lp_old_check`: the recomputed `lp_old` must equal the rollout's record bit for bit wherever the
/// record is reused.
fn check_lp_old_reuse(lp_old: &[Vec<f32>], lp_roll: &[Vec<f32>]) -> anyhow::Result<()> {
    for (b, (old, roll)) in lp_old.iter().zip(lp_roll).enumerate() {
        if let Some(t) = (0..old.len()).find(|&t| old[t].to_bits() != roll[t].to_bits()) {
            anyhow::bail!(
                "lp_old reuse check: response {b}, token {t}: the learner forward gives {} where the \
                 rollout recorded {}; the aligned forward no longer reproduces the rollout's bits",
                old[t],
                roll[t]
            );
        }
    }
    Ok(())
}

/// The metrics of the learner's forward at the step's start: the token entropy over the responses and, for
/// MoE without routing replay, how often the learner routes a token differently from the rollout.
fn learner_forward_metrics(
    fwd: &ResponseForward,
    batch: &SeqBatch,
    records: &[&Vec<Option<Vec<u32>>>],
    replayed: bool,
    top_k: usize,
    m: &mut BTreeMap<String, f64>,
) -> anyhow::Result<()> {
    let [_, vocab] = fwd.logits.dims();
    let entropy = entropy_rows(&to_f32_vec(fwd.logits.clone().detach()), vocab);
    m.insert(
        "actor/entropy".into(),
        mean(entropy.iter().map(|&h| f64::from(h))),
    );
    if top_k == 0 || replayed {
        return Ok(());
    }
    // Routing of the learner forward vs the rollout, over the tokens the rollout routed.
    let t = fwd.padded_len;
    let mut agg = None;
    for (b, rec) in records.iter().enumerate() {
        let learner_row: Vec<Option<Vec<u32>>> = fwd
            .routing
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|v| v[b * t * top_k..(b * t + batch.seqs[b].len() - 1) * top_k].to_vec())
            })
            .collect();
        let d = routing_disagreement(rec, &learner_row, top_k)?;
        agg = Some(match agg {
            None => d,
            Some(a) => a + d,
        });
    }
    if let Some(f) = agg.and_then(|a| a.fraction()) {
        m.insert("moe/routing_disagreement_frac".into(), f);
    }
    Ok(())
}

/// What the update phase did.
#[derive(Default)]
pub struct UpdateOutcome {
    /// Updates skipped for a non-finite loss or gradient.
    pub nonfinite_updates: usize,
    /// The gradient norm of each applied update.
    pub grad_norms: Vec<f64>,
    /// Whether the packed weights lag the masters (updates with the full-precision forward).
    pub packed_stale: bool,
}

/// The policy updates over mini-batches and epochs, then the diagnostic of how the update moved the
/// responses' log-probs.
pub fn update(
    model: &mut Decoder,
    optim: &mut ModuleOptimizer,
    s: &Scored,
    cfg: &TrainConfig,
    step: usize,
    inject_nonfinite: bool,
    m: &mut BTreeMap<String, f64>,
) -> anyhow::Result<UpdateOutcome> {
    let (rc, tc) = (&cfg.rollout, &cfg.train);
    // The training forward's weights: the rollout's packed version (aligned) or the f32 masters (full).
    let weights = tc.forward.weights();
    let device = model.device();
    let top_k = s.top_k;
    let layers = model.layers.len();
    let rows = s.batch.seqs.len();
    let loss_fn: PolicyLoss = tc.loss.clone().resolve()?;
    let mb = if tc.minibatch_size == 0 {
        rows
    } else {
        tc.minibatch_size.min(rows)
    };
    let lr = lr_at(tc.lr, tc.lr_schedule, tc.warmup_steps, step, tc.steps);
    let mut loss_metrics: BTreeMap<String, f64> = BTreeMap::new();
    let mut outcome = UpdateOutcome::default();
    let mut updates = 0usize;
    let t_train = Instant::now();
    for _epoch in 0..tc.epochs {
        for chunk in (0..rows).collect::<Vec<_>>().chunks(mb) {
            let sub = SeqBatch::new(
                chunk.iter().map(|&i| s.batch.seqs[i].clone()).collect(),
                chunk.iter().map(|&i| s.batch.prompt_lens[i]).collect(),
            );
            let sub_replay = s.replay.as_ref().map(|_| {
                let recs: Vec<&Vec<Option<Vec<u32>>>> =
                    chunk.iter().map(|&i| s.records[i]).collect();
                replay_routing(&recs, &sub.seqs, top_k, layers)
            });
            let (lp_theta, fwd) =
                sub.logprobs(model, weights, rc.temperature, sub_replay.as_deref());
            if s.lp_old_reused && updates == 0 && outcome.nonfinite_updates == 0 {
                // One update covering every kept row at the step's weights: its forward is the learner's
                // forward at the step's start.
                learner_forward_metrics(&fwd, &sub, &s.records, s.replay.is_some(), top_k, m)?;
            }
            drop(fwd);
            let old: Vec<Vec<f32>> = chunk.iter().map(|&i| s.lp_old[i].clone()).collect();
            let roll: Vec<Vec<f32>> = chunk.iter().map(|&i| s.lp_roll[i].clone()).collect();
            let advs: Vec<f32> = chunk.iter().map(|&i| s.advantages[i]).collect();
            let inputs = PolicyLossInputs {
                lp_theta,
                lp_old: sub.grid(&old, &device),
                lp_roll: sub.grid(&roll, &device),
                mask: sub.mask(&device),
                advantages: tensor_from_vec(advs, [chunk.len()], &device),
                lp_ref: None,
            };
            let outp = loss_fn.compute(inputs)?;
            let mut loss: Tensor<1> = outp.loss;
            if inject_nonfinite {
                loss = loss * f32::NAN;
            }
            let loss_value = to_f32_vec(loss.clone())[0];
            let grads = loss.backward();
            let grads = GradientsParams::from_grads(grads, &*model);
            let norm = grad_norm(model, &grads);
            if !loss_value.is_finite() || !norm.is_finite() {
                tracing::warn!(
                    step,
                    loss = loss_value,
                    grad_norm = norm,
                    "non-finite loss or gradient: update skipped (weights unchanged)"
                );
                outcome.nonfinite_updates += 1;
                continue;
            }
            outcome.grad_norms.push(norm);
            for (k, v) in outp.metrics.to_map() {
                *loss_metrics.entry(k).or_default() += v;
            }
            let stepped = optim.step(lr, model.clone(), grads);
            *model = stepped;
            updates += 1;
            if tc.forward == TrainForward::Aligned {
                // A new weight version: quantize it once; the next forward (update or rollout) uses it.
                model.requantize()?;
            } else {
                outcome.packed_stale = true;
            }
        }
    }
    for (k, v) in loss_metrics {
        m.insert(k, v / updates.max(1) as f64);
    }
    update_lp_delta_metrics(model, s, cfg, m);
    m.insert("perf/update_s".into(), t_train.elapsed().as_secs_f64());
    m.insert("actor/lr".into(), lr);
    Ok(outcome)
}

/// Did the update move the right way? Mean per-token log-prob change of the step's responses under the
/// updated weights, for positive and for negative advantages (same forward as `lp_old`).
fn update_lp_delta_metrics(
    model: &Decoder,
    s: &Scored,
    cfg: &TrainConfig,
    m: &mut BTreeMap<String, f64>,
) {
    let weights = cfg.train.forward.weights();
    let after = to_f32_vec(
        s.batch
            .logprobs(
                &model.valid(),
                weights,
                cfg.rollout.temperature,
                s.replay.as_deref(),
            )
            .0,
    );
    let after = s.batch.responses_of(&after);
    for (sign, key) in [
        (1.0f32, "actor/update_lp_delta_pos"),
        (-1.0, "actor/update_lp_delta_neg"),
    ] {
        let (mut sum, mut n) = (0.0f64, 0usize);
        for (i, (a, o)) in after.iter().zip(&s.lp_old).enumerate() {
            if s.advantages[i] * sign > 0.0 {
                sum += a.iter().zip(o).map(|(x, y)| (x - y) as f64).sum::<f64>();
                n += a.len();
            }
        }
        if n > 0 {
            m.insert(key.into(), sum / n as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::check_lp_old_reuse;

    #[test]
    fn the_lp_old_check_names_the_first_differing_token() {
        let roll = vec![vec![-0.5f32, -1.25], vec![-2.0]];
        assert!(check_lp_old_reuse(&roll, &roll).is_ok());
        let mut old = roll.clone();
        old[0][1] = f32::from_bits((-1.25f32).to_bits() + 1);
        let err = check_lp_old_reuse(&old, &roll).unwrap_err().to_string();
        assert!(err.contains("response 0, token 1"), "{err}");
    }
}
