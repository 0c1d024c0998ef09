//! One RL step in three phases: [`collect`] (roll out with the configured precision, reward, advantages),
//! [`score`] (`lp_old` with the configured training forward, or the rollout's record where that is the same
//! bits, and the mismatch metrics), [`update`] (policy updates over mini-batches, one quantization per new
//! weight version).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;

use super::batch::{replay_routing, ForwardOptions, ResponseForward, SeqBatch};
use super::config::{lr_at, TrainConfig, TrainForward};
use crate::host::{tensor_from_vec, to_f32_vec};
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
        let t_sync = Instant::now();
        model.requantize()?;
        *m.entry("perf/weight_sync_s".into()).or_default() += t_sync.elapsed().as_secs_f64();
    }
    m.insert("perf/step_s".into(), t0.elapsed().as_secs_f64());
    if let Some(gb) = crate::ops::cpu::probe::peak_resident_gb() {
        m.insert("perf/peak_rss_gb".into(), gb);
    }
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
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    crate::rollout::check_rollout_size(
        &model.config,
        "rollout.prompts_per_step / samples_per_prompt / max_new_tokens",
        prompts.len().saturating_mul(g),
        longest,
        rc.max_new_tokens,
    )?;
    let t_roll = Instant::now();
    let out = generate(&policy, &prompts, g, &params, Some(tok));
    out.ensure_finite()
        .with_context(|| format!("RL step {step}, rollout"))?;
    let rollout_s = t_roll.elapsed().as_secs_f64();
    let gen_tokens = out.generated_tokens();

    // Rewards and advantages.
    let t_reward = Instant::now();
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
    m.insert("perf/reward_s".into(), t_reward.elapsed().as_secs_f64());
    m.insert("perf/rollout_prefill_s".into(), out.prefill_s);
    m.insert("perf/rollout_decode_s".into(), out.decode_s);
    m.insert("perf/rollout_decode_steps".into(), out.decode_steps as f64);
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mc = &model.config;
    let prefill = mc.forward_flops(prompts.len(), longest, longest, prompts.len());
    m.insert("perf/rollout_prefill_gflop".into(), prefill.total() / 1e9);
    let per_token = mc.forward_flops(1, 1, 0, 1).total();
    m.insert(
        "perf/rollout_decode_gflop".into(),
        per_token * out.decode_tokens as f64 / 1e9,
    );
    m.insert(
        "perf/rollout_decode_weight_gb".into(),
        (out.decode_steps * model.weight_bytes()) as f64 / 1e9,
    );
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
    m.insert("perf/generated_tokens".into(), gen_tokens as f64);
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

impl Scored<'_> {
    /// The kept sequences `rows` as a batch of their own, with their routing replay (when on).
    pub fn subset(
        &self,
        rows: &[usize],
        layers: usize,
    ) -> (SeqBatch, Option<Vec<Option<Vec<u32>>>>) {
        let sub = SeqBatch::new(
            rows.iter().map(|&i| self.batch.seqs[i].clone()).collect(),
            rows.iter().map(|&i| self.batch.prompt_lens[i]).collect(),
        );
        let replay = self.replay.as_ref().map(|_| {
            let recs: Vec<&Vec<Option<Vec<u32>>>> = rows.iter().map(|&i| self.records[i]).collect();
            replay_routing(&recs, &sub.seqs, self.top_k, layers)
        });
        (sub, replay)
    }
}

/// Whether `lp_old` equals the rollout's recorded log-probs bit for bit, so that no forward is needed: where
/// the backend reproduces the rollout ([`crate::ops::BackendKind::reproduces_rollout`]: deterministic mode
/// on the CPU) the aligned training forward computes the rollout's bits, and with one update per
/// step nothing has changed the weights before the update's own forward.
pub fn lp_old_is_the_rollout_record(cfg: &TrainConfig, rows: usize) -> bool {
    let tc = &cfg.train;
    tc.backend.reproduces_rollout()
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
        let opts = ForwardOptions {
            entropy: true,
            ..ForwardOptions::default()
        };
        let (lp_old_t, fwd) =
            batch.logprobs_with(&learner, weights, rc.temperature, replay.as_deref(), opts);
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
    let entropy = fwd
        .entropy
        .as_ref()
        .context("the learner forward of the step's start computes the entropy")?;
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

/// Where the update's time went, summed over its mini-batches and epochs, with the work the forwards did.
#[derive(Default)]
struct PhaseTimes {
    /// The learner forwards and the loss (seconds).
    forward_s: f64,
    /// `backward()`, collecting the parameter gradients and their norm.
    backward_s: f64,
    /// The optimizer steps.
    optim_s: f64,
    /// Re-quantizing each new weight version (aligned forward).
    weight_sync_s: f64,
    /// Flops of the learner forwards (see [`crate::model::cost`]), and of those with a graph (the backward
    /// does twice theirs).
    forward_flops: f64,
    graph_flops: f64,
    /// Tokens through the learner forwards (padding included) and the positions that carry a loss (in
    /// forwards with a graph).
    tokens: usize,
    loss_tokens: usize,
    /// Rows that needed no forward with a graph (their loss and gradient are zero).
    skipped: usize,
}

impl PhaseTimes {
    /// A learner forward of `b`, with a graph (a backward follows) or without.
    fn add_forward(&mut self, config: &crate::model::ModelConfig, b: &SeqBatch, graph: bool) {
        let (tokens, flops) = b.forward_work(config);
        self.forward_flops += flops;
        if graph {
            self.graph_flops += flops;
            self.loss_tokens += b
                .seqs
                .iter()
                .zip(&b.prompt_lens)
                .map(|(s, &p)| s.len().saturating_sub(p))
                .sum::<usize>();
        }
        self.tokens += tokens;
    }

    fn record(&self, m: &mut BTreeMap<String, f64>) {
        m.insert("perf/learner_forward_s".into(), self.forward_s);
        m.insert("perf/learner_backward_s".into(), self.backward_s);
        m.insert("perf/optim_s".into(), self.optim_s);
        *m.entry("perf/weight_sync_s".into()).or_default() += self.weight_sync_s;
        m.insert(
            "perf/learner_forward_gflop".into(),
            self.forward_flops / 1e9,
        );
        m.insert(
            "perf/learner_backward_gflop".into(),
            2.0 * self.graph_flops / 1e9,
        );
        m.insert("perf/learner_tokens".into(), self.tokens as f64);
        m.insert("perf/loss_tokens".into(), self.loss_tokens as f64);
        m.insert("train/skipped_sequences".into(), self.skipped as f64);
    }
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
    let tc = &cfg.train;
    let device = model.device();
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
    let mut perf = PhaseTimes::default();
    for _epoch in 0..tc.epochs {
        for chunk in (0..rows).collect::<Vec<_>>().chunks(mb) {
            let sub = s.subset(chunk, layers).0;
            let t_fwd = Instant::now();
            // One update covering every kept row at the step's weights: its forward is the learner's
            // forward at the step's start, whose metrics it then supplies.
            let first_forward = s.lp_old_reused && updates == 0 && outcome.nonfinite_updates == 0;
            let lp_theta = chunk_logprobs(model, s, chunk, cfg, first_forward, &mut perf, m)?;
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
            perf.forward_s += t_fwd.elapsed().as_secs_f64();
            let t_bwd = Instant::now();
            let grads = loss.backward();
            let grads = GradientsParams::from_grads(grads, &*model);
            let norm = grad_norm(model, &grads);
            perf.backward_s += t_bwd.elapsed().as_secs_f64();
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
            let t_optim = Instant::now();
            let stepped = optim.step(lr, model.clone(), grads);
            *model = stepped;
            perf.optim_s += t_optim.elapsed().as_secs_f64();
            updates += 1;
            if tc.forward == TrainForward::Aligned {
                // A new weight version: quantize it once; the next forward (update or rollout) uses it.
                let t_sync = Instant::now();
                model.requantize()?;
                perf.weight_sync_s += t_sync.elapsed().as_secs_f64();
            } else {
                outcome.packed_stale = true;
            }
        }
    }
    for (k, v) in loss_metrics {
        m.insert(k, v / updates.max(1) as f64);
    }
    perf.record(m);
    let t_delta = Instant::now();
    update_lp_delta_metrics(model, s, cfg, m);
    m.insert("perf/lp_delta_s".into(), t_delta.elapsed().as_secs_f64());
    m.insert("perf/update_s".into(), t_train.elapsed().as_secs_f64());
    m.insert("actor/lr".into(), lr);
    Ok(outcome)
}

/// The learner's `[C, W]` log-prob grid of the kept rows `chunk` (differentiable), and with
/// `first_forward` the metrics of the learner's forward at the step's start. Rows whose loss and gradient
/// are provably zero are not forwarded with a graph ([`inert_rows`]): their grid rows are `lp_old`, which
/// is then bitwise what the forward would give, and a forward without a graph supplies their entropy.
fn chunk_logprobs(
    model: &Decoder,
    s: &Scored,
    chunk: &[usize],
    cfg: &TrainConfig,
    first_forward: bool,
    perf: &mut PhaseTimes,
    m: &mut BTreeMap<String, f64>,
) -> anyhow::Result<Tensor<2>> {
    let (weights, temperature) = (cfg.train.forward.weights(), cfg.rollout.temperature);
    let layers = model.layers.len();
    let device = model.device();
    let inert = inert_rows(s, chunk, first_forward);
    let active: Vec<usize> = chunk
        .iter()
        .copied()
        .filter(|i| !inert.contains(i))
        .collect();
    let (sub, replay) = s.subset(&active, layers);
    let opts = ForwardOptions {
        entropy: first_forward,
        ..ForwardOptions::default()
    };
    let (lp, fwd) = sub.logprobs_with(model, weights, temperature, replay.as_deref(), opts);
    perf.add_forward(&model.config, &sub, true);
    perf.skipped += inert.len();
    if inert.is_empty() {
        if first_forward {
            learner_forward_metrics(&fwd, &sub, &s.records, s.replay.is_some(), s.top_k, m)?;
        }
        return Ok(lp);
    }
    let whole = s.subset(chunk, layers).0;
    if first_forward {
        // The entropy of every row, in the rows' order, the inert ones from a forward without a graph.
        let (rest, rest_replay) = s.subset(&inert, layers);
        let (_, rest_fwd) = rest.logprobs_with(
            &model.valid(),
            weights,
            temperature,
            rest_replay.as_deref(),
            opts,
        );
        perf.add_forward(&model.config, &rest, false);
        let split = |b: &SeqBatch, e: &[f32]| -> Vec<Vec<f32>> {
            let mut at = 0;
            b.seqs
                .iter()
                .zip(&b.prompt_lens)
                .map(|(q, &p)| {
                    let n = q.len().saturating_sub(p);
                    at += n;
                    e[at - n..at].to_vec()
                })
                .collect()
        };
        let mut by_active = split(&sub, fwd.entropy.as_deref().unwrap_or(&[])).into_iter();
        let mut by_inert = split(&rest, rest_fwd.entropy.as_deref().unwrap_or(&[])).into_iter();
        let entropy: Vec<f32> = chunk
            .iter()
            .flat_map(|i| {
                if inert.contains(i) {
                    by_inert.next()
                } else {
                    by_active.next()
                }
                .unwrap_or_default()
            })
            .collect();
        let all = ResponseForward {
            entropy: Some(entropy),
            routing: Vec::new(),
            padded_len: 0,
        };
        learner_forward_metrics(&all, &whole, &s.records, s.replay.is_some(), s.top_k, m)?;
    }
    // lp_old on the inert rows, zeros on the active ones, plus the active rows' forward.
    let constant: Vec<Vec<f32>> = chunk
        .iter()
        .map(|&i| {
            if inert.contains(&i) {
                s.lp_old[i].clone()
            } else {
                vec![0.0; s.lp_old[i].len()]
            }
        })
        .collect();
    let [a, wa] = lp.dims();
    let lp = if wa < whole.width {
        Tensor::cat(vec![lp, Tensor::zeros([a, whole.width - wa], &device)], 1)
    } else {
        lp
    };
    let rows: Vec<i64> = chunk
        .iter()
        .enumerate()
        .filter(|(_, i)| !inert.contains(i))
        .map(|(r, _)| r as i64)
        .collect();
    let rows = Tensor::<1, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(rows, [a]),
        &device,
    );
    Ok(whole.grid(&constant, &device).select_assign(
        0,
        rows,
        lp,
        burn::tensor::IndexingUpdateOp::Add,
    ))
}

/// The rows of `chunk` whose loss and gradient are provably zero and whose forward would give `lp_old`
/// bit for bit, so that it need not run with a graph: zero advantage (every objective's loss is
/// proportional to the advantage, and no KL or entropy term exists), in the learner's first forward when
/// that forward computes the rollout's bits (`lp_old` is the rollout's record). Dense models only: a MoE
/// expert that only inert rows reach would then get no gradient at all, and AdamW skips a parameter without
/// one (no decay, no momentum step), where with the zero gradient it would move. Never every row: an
/// update with no active row still runs (the optimizer still steps).
fn inert_rows(s: &Scored, chunk: &[usize], first_forward: bool) -> Vec<usize> {
    if !(first_forward && s.lp_old_reused && s.top_k == 0) {
        return Vec::new();
    }
    let zero: Vec<usize> = chunk
        .iter()
        .copied()
        .filter(|&i| s.advantages[i] == 0.0)
        .collect();
    if zero.len() == chunk.len() {
        Vec::new()
    } else {
        zero
    }
}

/// Did the update move the right way? Mean per-token log-prob change of the step's responses under the
/// updated weights, for positive and for negative advantages (same forward as `lp_old`).
fn update_lp_delta_metrics(
    model: &Decoder,
    s: &Scored,
    cfg: &TrainConfig,
    m: &mut BTreeMap<String, f64>,
) {
    // Only rows with a nonzero advantage enter the metric: the others are not forwarded at all.
    let rows: Vec<usize> = (0..s.batch.seqs.len())
        .filter(|&i| s.advantages[i] != 0.0)
        .collect();
    if rows.is_empty() {
        return;
    }
    let (sub, replay) = s.subset(&rows, model.layers.len());
    let weights = cfg.train.forward.weights();
    let after = to_f32_vec(
        sub.logprobs(
            &model.valid(),
            weights,
            cfg.rollout.temperature,
            replay.as_deref(),
        )
        .0,
    );
    let after = sub.responses_of(&after);
    for (sign, key) in [
        (1.0f32, "actor/update_lp_delta_pos"),
        (-1.0, "actor/update_lp_delta_neg"),
    ] {
        let (mut sum, mut n) = (0.0f64, 0usize);
        for (a, &i) in after.iter().zip(&rows) {
            if s.advantages[i] * sign > 0.0 {
                let o = &s.lp_old[i];
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
    use super::*;
    use crate::model::Weights;

    /// Rows with zero advantage skipped from the graph (their grid rows `lp_old`) give the grid of the full
    /// forward bit for bit, the same entropy metric, and the gradient of a loss whose zero-advantage rows
    /// contribute nothing, within 1e-6 relative (the backward's sums see fewer zero terms).
    #[test]
    fn inert_rows_skip_the_graph_and_change_nothing() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
        let device = burn::tensor::Device::flex().autodiff();
        let model = Decoder::load(&dir, &device).unwrap();
        let seqs = vec![
            vec![3u32, 17, 99, 42, 7, 250, 11],
            vec![3, 17, 99, 42, 8, 9],
            vec![5, 6, 8, 9, 10],
            vec![5, 6, 1],
            vec![200, 1, 2, 3, 9, 9],
        ];
        let batch = SeqBatch::new(seqs, vec![4, 4, 2, 2, 3]);
        let lp_old = batch.responses_of(&to_f32_vec(
            batch.logprobs(&model.valid(), Weights::Packed, 1.0, None).0,
        ));
        let empty: Vec<Option<Vec<u32>>> = Vec::new();
        let advantages = vec![0.5f32, -0.5, 0.0, 0.0, 1.0];
        let scored = |reused: bool| Scored {
            batch: batch.clone(),
            records: vec![&empty; 5],
            replay: None,
            lp_old: lp_old.clone(),
            lp_roll: lp_old.clone(),
            advantages: advantages.clone(),
            lp_old_reused: reused,
            top_k: 0,
        };
        let cfg = crate::train::load_config(None, &[]).unwrap();
        let chunk: Vec<usize> = (0..5).collect();
        let run = |reused: bool| {
            let s = scored(reused);
            let (mut perf, mut m) = (PhaseTimes::default(), BTreeMap::new());
            let lp = chunk_logprobs(&model, &s, &chunk, &cfg, true, &mut perf, &mut m).unwrap();
            let w: Vec<f32> = (0..5 * batch.width)
                .map(|i| advantages[i / batch.width] * (1.0 + (i % 3) as f32))
                .collect();
            let w = tensor_from_vec(w, [5, batch.width], &device) * batch.mask(&device);
            let grads = (lp.clone() * w).sum().backward();
            let g = to_f32_vec(
                model.layers[0]
                    .self_attn
                    .q_proj
                    .weight
                    .val()
                    .grad(&grads)
                    .unwrap(),
            );
            (to_f32_vec(lp), g, m["actor/entropy"], perf.skipped)
        };
        let (lp_skip, g_skip, h_skip, skipped) = run(true);
        let (lp_full, g_full, h_full, none) = run(false);
        assert_eq!((skipped, none), (2, 0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&lp_skip), bits(&lp_full));
        assert_eq!(h_skip.to_bits(), h_full.to_bits());
        let diff: f64 = g_skip
            .iter()
            .zip(&g_full)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let norm: f64 = g_full.iter().map(|&b| (b as f64).powi(2)).sum();
        assert!(
            norm > 0.0 && (diff / norm).sqrt() <= 1e-6,
            "{diff} vs {norm}"
        );
    }

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
