//! The update phase of an RL step ([`update`]): policy updates over mini-batches and epochs, each
//! minibatch's gradient computed in one pass or accumulated over micro-batches
//! (`train.micro_batch_size`, to bound the activations a backward keeps alive), one quantization per new
//! weight version, and the diagnostics of what the update did.

use std::collections::BTreeMap;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};

use super::batch::{ForwardOptions, ResponseForward, SeqBatch};
use super::config::{lr_at, RlConfig, TrainConfig, TrainForward};
use super::scored::{split_responses, ForwardStats, Scored};
use crate::host::{tensor_from_vec, to_f32_vec};
use crate::model::Decoder;
use crate::rl::losses::{LossAggMode, LossMetrics, PolicyLoss, PolicyLossInputs};

/// The RL optimizer of `tc`: AdamW with its weight decay and epsilon. `train.grad_clip` is applied before
/// it, to the global norm ([`clip_to_global_norm`]): burn's own clipping (`GradientClipping::Norm`) clips
/// each tensor by its own norm, another update than torch's and verl's.
pub fn optimizer(tc: &RlConfig) -> burn::optim::ModuleOptimizer {
    AdamWConfig::new()
        .with_weight_decay(tc.weight_decay)
        .with_epsilon(tc.adam_eps)
        .init()
}

/// torch's `clip_grad_norm_` over every parameter at once (verl's `actor.grad_clip`, HF Trainer's
/// `max_grad_norm`): every gradient times `min(1, max_norm / (norm + 1e-6))`, where `norm` is the global L2
/// norm of all of them ([`grad_norm`]). Off for `max_norm <= 0`. Returns the factor applied.
pub fn clip_to_global_norm(
    model: &Decoder,
    grads: &mut GradientsParams,
    norm: f64,
    max_norm: f32,
) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let factor = (max_norm as f64 / (norm + 1e-6)).min(1.0);
    if factor < 1.0 {
        scale_gradients(model, grads, factor as f32);
    }
    factor
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

/// `into + from`, parameter by parameter (a parameter missing from one side keeps the other's gradient).
fn add_gradients(model: &Decoder, into: &mut GradientsParams, mut from: GradientsParams) {
    struct Sum<'a> {
        into: &'a mut GradientsParams,
        from: &'a mut GradientsParams,
    }
    impl ModuleVisitor for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.from.remove::<D>(param.id) {
                let sum = match self.into.remove::<D>(param.id) {
                    Some(acc) => acc + g,
                    None => g,
                };
                self.into.register(param.id, sum);
            }
        }
    }
    model.visit(&mut Sum {
        into,
        from: &mut from,
    });
}

/// Every gradient times `factor`.
fn scale_gradients(model: &Decoder, grads: &mut GradientsParams, factor: f32) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f32,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads.register(param.id, g * self.factor);
            }
        }
    }
    model.visit(&mut Scale { grads, factor });
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
    let rows = s.batch.seqs.len();
    let loss_fn: PolicyLoss = tc.loss.clone().resolve()?;
    let minibatches = minibatches(rows, tc.minibatch_size, cfg.rollout.samples_per_prompt);
    let lr = lr_at(tc.lr, tc.lr_schedule, tc.warmup_steps, step, tc.steps);
    let mut loss_metrics = UpdateMeans::default();
    let mut outcome = UpdateOutcome::default();
    let mut updates = 0usize;
    let t_train = Instant::now();
    let mut perf = PhaseTimes::default();
    for _epoch in 0..tc.epochs {
        for chunk in &minibatches {
            // One update covering every kept row at the step's weights: its forward is the learner's
            // forward at the step's start, whose metrics it then supplies.
            let first_forward = s.lp_old_reused && updates == 0 && outcome.nonfinite_updates == 0;
            let mut stats = ForwardStats::default();
            let pass = Pass {
                model,
                s,
                cfg,
                loss_fn: &loss_fn,
                first_forward,
                inject_nonfinite,
            };
            let g = pass.gradients(chunk, &mut perf, &mut stats)?;
            if first_forward {
                stats.record(m);
            }
            let t_norm = Instant::now();
            let norm = grad_norm(model, &g.grads);
            perf.backward_s += t_norm.elapsed().as_secs_f64();
            if !g.loss.is_finite() || !norm.is_finite() {
                tracing::warn!(
                    step,
                    loss = g.loss,
                    grad_norm = norm,
                    "non-finite loss or gradient: update skipped (weights unchanged)"
                );
                outcome.nonfinite_updates += 1;
                continue;
            }
            outcome.grad_norms.push(norm);
            loss_metrics.add(&g.metrics);
            let t_optim = Instant::now();
            let mut grads = g.grads;
            clip_to_global_norm(model, &mut grads, norm, tc.grad_clip);
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
    loss_metrics.record(step, m);
    perf.record(m);
    if cfg.train.update_diagnostics {
        let t_delta = Instant::now();
        update_lp_delta_metrics(model, s, cfg, m);
        m.insert("perf/lp_delta_s".into(), t_delta.elapsed().as_secs_f64());
    }
    m.insert("perf/update_s".into(), t_train.elapsed().as_secs_f64());
    m.insert("actor/lr".into(), lr);
    Ok(outcome)
}

/// The loss metrics of a step's updates, averaged over them. Most are verl's means over updates (each
/// update counts once, as verl's `reduce_metrics` counts each micro-batch); the sequence means
/// ([`SEQUENCE_MEANS`]) are weighted by the sequences each update had in its loss, so an update whose
/// corrections rejected every sequence adds nothing to them instead of a 0 (a ratio cannot be 0: `geo_rs`
/// rejecting 2 of 4 minibatches logged `seq_ratio_mean` 0.5 for ratios of about 1).
#[derive(Default)]
struct UpdateMeans {
    /// Name -> (weighted sum, sum of weights).
    sums: BTreeMap<String, (f64, f64)>,
}

/// The per-sequence means of [`LossMetrics`], weighted by `loss_sequences` across updates.
const SEQUENCE_MEANS: [&str; 2] = ["actor/seq_ratio_mean", "actor/mismatch_weight_mean"];

impl UpdateMeans {
    fn add(&mut self, metrics: &LossMetrics) {
        for (k, v) in metrics.to_map() {
            let weight = if SEQUENCE_MEANS.contains(&k.as_str()) {
                metrics.loss_sequences
            } else {
                1.0
            };
            let sum = self.sums.entry(k).or_default();
            sum.0 += v * weight;
            sum.1 += weight;
        }
    }

    /// Writes the means into the step's metrics. A sequence mean no update had a sequence for is left out
    /// (no value, rather than a 0 that reads as a collapsed ratio), with a warning.
    fn record(self, step: usize, m: &mut BTreeMap<String, f64>) {
        let mut unlogged = Vec::new();
        for (k, (sum, weight)) in self.sums {
            if weight > 0.0 {
                m.insert(k, sum / weight);
            } else if SEQUENCE_MEANS.contains(&k.as_str()) {
                unlogged.push(k);
            }
        }
        if !unlogged.is_empty() {
            tracing::warn!(
                step,
                "no sequence was left in any update's loss (the corrections rejected them all): {} not logged",
                unlogged.join(", ")
            );
        }
    }
}

/// One minibatch's loss, its metrics and the gradient of the loss.
struct MinibatchGradient {
    loss: f32,
    metrics: LossMetrics,
    grads: GradientsParams,
}

/// What every forward/backward pass of an update reads.
struct Pass<'a, 'b> {
    model: &'a Decoder,
    s: &'a Scored<'b>,
    cfg: &'a TrainConfig,
    loss_fn: &'a PolicyLoss,
    /// The update's forward is the learner's forward at the step's start (see [`inert_rows`]).
    first_forward: bool,
    /// Make every loss NaN (fault injection for tests).
    inject_nonfinite: bool,
}

impl Pass<'_, '_> {
    /// The loss of the kept rows `chunk` (one minibatch) and its gradient: in one forward/backward, or with
    /// `train.micro_batch_size` sequences per pass, summed over micro-batches.
    fn gradients(
        &self,
        chunk: &[usize],
        perf: &mut PhaseTimes,
        stats: &mut ForwardStats,
    ) -> anyhow::Result<MinibatchGradient> {
        let inert = inert_rows(self.s, chunk, self.first_forward);
        let micro = match self.cfg.train.micro_batch_size {
            0 => chunk.len(),
            n => n,
        };
        // Each forward's activations against the memory, before the first: a minibatch too large for one
        // pass is refused with the setting to change, not met by the kernel's out-of-memory killer.
        let batch = &self.s.batch;
        for rows in chunk.chunks(micro.max(1)) {
            let sequences: Vec<(usize, usize)> = rows
                .iter()
                .map(|&r| {
                    let prompt = batch.prompt_lens[r];
                    (prompt, batch.seqs[r].len().saturating_sub(prompt))
                })
                .collect();
            crate::rollout::check_learner_size(
                &self.model.config,
                "train.micro_batch_size (0: a whole minibatch per pass)",
                &sequences,
            )?;
        }
        if micro >= chunk.len() {
            return self.one_pass(chunk, &inert, perf, stats);
        }
        self.accumulated(chunk, micro, &inert, perf, stats)
    }

    /// The whole minibatch in one forward and one backward.
    fn one_pass(
        &self,
        chunk: &[usize],
        inert: &[usize],
        perf: &mut PhaseTimes,
        stats: &mut ForwardStats,
    ) -> anyhow::Result<MinibatchGradient> {
        let t_fwd = Instant::now();
        let (lp_theta, _) = self.rows_logprobs(chunk, inert, perf, stats)?;
        let out = self.loss_fn.compute(self.loss_inputs(chunk, lp_theta))?;
        let mut loss = out.loss;
        if self.inject_nonfinite {
            loss = loss * f32::NAN;
        }
        let value = to_f32_vec(loss.clone())[0];
        perf.forward_s += t_fwd.elapsed().as_secs_f64();
        let t_bwd = Instant::now();
        let grads = GradientsParams::from_grads(loss.backward(), self.model);
        perf.backward_s += t_bwd.elapsed().as_secs_f64();
        Ok(MinibatchGradient {
            loss: value,
            metrics: out.metrics,
            grads,
        })
    }

    /// The minibatch in micro-batches of `micro` rows, each forward followed by its backward, so that only
    /// one micro-batch's activations are alive at a time. The minibatch loss is a sum over its terms divided
    /// by a count (loss tokens or sequences, by the aggregation mode) that is itself a sum over the rows:
    /// each micro-batch back-propagates its loss times its own count, and the summed gradient is divided by
    /// the total count once. The log-probs are the single pass's bits (the forward is batch-invariant), so
    /// the loss and its metrics, computed again over the whole minibatch from them, are the single pass's
    /// too; the gradient differs from it only by summation order (and each pass's rounding to half-precision
    /// activations, where they are bf16 or f16).
    fn accumulated(
        &self,
        chunk: &[usize],
        micro: usize,
        inert: &[usize],
        perf: &mut PhaseTimes,
        stats: &mut ForwardStats,
    ) -> anyhow::Result<MinibatchGradient> {
        let width = self.s.subset(chunk, 0).0.width;
        let device = self.model.device();
        let mut grads = GradientsParams::new();
        let mut count = 0.0f64;
        let mut pieces = Vec::new();
        for rows in chunk.chunks(micro) {
            let t_fwd = Instant::now();
            let (lp_theta, graph) = self.rows_logprobs(rows, inert, perf, stats)?;
            let out = self
                .loss_fn
                .compute(self.loss_inputs(rows, lp_theta.clone()))?;
            let rows_count = loss_count(self.loss_fn.agg, &out.metrics);
            pieces.push(pad_columns(lp_theta.detach(), width, &device));
            perf.forward_s += t_fwd.elapsed().as_secs_f64();
            count += rows_count;
            if graph {
                let t_bwd = Instant::now();
                let mut loss = out.loss * rows_count as f32;
                if self.inject_nonfinite {
                    loss = loss * f32::NAN;
                }
                let part = GradientsParams::from_grads(loss.backward(), self.model);
                add_gradients(self.model, &mut grads, part);
                perf.backward_s += t_bwd.elapsed().as_secs_f64();
            }
        }
        let t_bwd = Instant::now();
        let factor = if count > 0.0 {
            (1.0 / count) as f32
        } else {
            0.0
        };
        scale_gradients(self.model, &mut grads, factor);
        perf.backward_s += t_bwd.elapsed().as_secs_f64();
        let t_loss = Instant::now();
        let out = self
            .loss_fn
            .compute(self.loss_inputs(chunk, Tensor::cat(pieces, 0)))?;
        let mut loss = to_f32_vec(out.loss)[0];
        if self.inject_nonfinite {
            loss = f32::NAN;
        }
        perf.forward_s += t_loss.elapsed().as_secs_f64();
        Ok(MinibatchGradient {
            loss,
            metrics: out.metrics,
            grads,
        })
    }

    /// The loss inputs of the kept rows `rows` with the learner's log-prob grid `lp_theta`.
    fn loss_inputs(&self, rows: &[usize], lp_theta: Tensor<2>) -> PolicyLossInputs {
        let s = self.s;
        let device = self.model.device();
        let sub = s.subset(rows, 0).0;
        let old: Vec<Vec<f32>> = rows.iter().map(|&i| s.lp_old[i].clone()).collect();
        let roll: Vec<Vec<f32>> = rows.iter().map(|&i| s.lp_roll[i].clone()).collect();
        let reference: Option<Vec<Vec<f32>>> = s
            .lp_ref
            .as_ref()
            .map(|r| rows.iter().map(|&i| r[i].clone()).collect());
        let advs: Vec<f32> = rows.iter().map(|&i| s.advantages[i]).collect();
        PolicyLossInputs {
            lp_theta,
            lp_old: sub.grid(&old, &device),
            lp_roll: sub.grid(&roll, &device),
            mask: sub.mask(&device),
            advantages: tensor_from_vec(advs, [rows.len()], &device),
            lp_ref: reference.map(|r| sub.grid(&r, &device)),
        }
    }

    /// The learner's `[C, W]` log-prob grid of the kept rows `rows`, and whether it carries a graph. Rows
    /// whose loss and gradient are provably zero (`inert`, see [`inert_rows`]) are not forwarded with a
    /// graph: their grid rows are `lp_old`, which is then bitwise what the forward would give. With
    /// `first_forward` the forward's metrics go to `stats`: the entropy from the rollout's record where it
    /// has one (bitwise the forward's, see [`Scored::entropy_roll`]), else from the forward, the inert rows'
    /// from a forward without a graph.
    fn rows_logprobs(
        &self,
        rows: &[usize],
        inert: &[usize],
        perf: &mut PhaseTimes,
        stats: &mut ForwardStats,
    ) -> anyhow::Result<(Tensor<2>, bool)> {
        let (model, s) = (self.model, self.s);
        let (weights, temperature) = (
            self.cfg.train.forward.weights(),
            self.cfg.rollout.temperature,
        );
        let layers = model.layers.len();
        let device = model.device();
        let (idle, active): (Vec<usize>, Vec<usize>) =
            rows.iter().copied().partition(|i| inert.contains(i));
        let recorded_entropy = self.first_forward && s.has_rollout_entropy();
        if recorded_entropy {
            stats.add_entropy(rows.iter().flat_map(|&i| s.entropy_roll[i].iter().copied()));
        }
        let forward_entropy = self.first_forward && !recorded_entropy;
        let opts = ForwardOptions {
            entropy: forward_entropy,
            ..ForwardOptions::default()
        };
        let records = |rows: &[usize]| -> Vec<&Vec<Option<Vec<u32>>>> {
            rows.iter().map(|&i| s.records[i]).collect()
        };
        perf.skipped += idle.len();
        let mut active_forward = None;
        if !active.is_empty() {
            let (sub, replay) = s.subset(&active, layers);
            let (lp, fwd) = sub.logprobs_with(model, weights, temperature, replay.as_deref(), opts);
            perf.add_forward(&sub, true, &fwd);
            if self.first_forward {
                let replayed = s.replay.is_some();
                stats.add_routing(&fwd, &sub, &records(&active), replayed, s.top_k)?;
            }
            if idle.is_empty() {
                if forward_entropy {
                    stats.add_entropy(fwd.entropy.iter().flatten().copied());
                }
                return Ok((lp, true));
            }
            active_forward = Some((lp, sub, fwd));
        }
        let whole = s.subset(rows, layers).0;
        if forward_entropy {
            // The entropy of every row, in the rows' order, the inert ones from a forward without a graph.
            let (rest, rest_replay) = s.subset(&idle, layers);
            let (_, rest_fwd) = rest.logprobs_with(
                &model.valid(),
                weights,
                temperature,
                rest_replay.as_deref(),
                opts,
            );
            perf.add_forward(&rest, false, &rest_fwd);
            let active_entropy = active_forward
                .as_ref()
                .map(|(_, sub, fwd)| split_responses(sub, fwd.entropy.as_deref().unwrap_or(&[])))
                .unwrap_or_default();
            let mut by_active = active_entropy.into_iter();
            let mut by_inert =
                split_responses(&rest, rest_fwd.entropy.as_deref().unwrap_or(&[])).into_iter();
            for i in rows {
                let row = if inert.contains(i) {
                    by_inert.next()
                } else {
                    by_active.next()
                };
                stats.add_entropy(row.unwrap_or_default());
            }
        }
        // lp_old on the inert rows, zeros on the active ones, plus the active rows' forward.
        let constant: Vec<Vec<f32>> = rows
            .iter()
            .map(|&i| {
                if inert.contains(&i) {
                    s.lp_old[i].clone()
                } else {
                    vec![0.0; s.lp_old[i].len()]
                }
            })
            .collect();
        let grid = whole.grid(&constant, &device);
        let Some((lp, _, _)) = active_forward else {
            return Ok((grid, false));
        };
        let a = lp.dims()[0];
        let lp = pad_columns(lp, whole.width, &device);
        let positions: Vec<i64> = rows
            .iter()
            .enumerate()
            .filter(|(_, i)| !inert.contains(i))
            .map(|(r, _)| r as i64)
            .collect();
        let positions = Tensor::<1, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new(positions, [a]),
            &device,
        );
        let grid = grid.select_assign(0, positions, lp, burn::tensor::IndexingUpdateOp::Add);
        Ok((grid, true))
    }
}

/// The count a minibatch loss of aggregation `agg` divides by: loss tokens (`token-mean`) or sequences
/// with a token in the loss (`seq-mean-*`).
/// The rows of each optimizer update: `ceil(rows / minibatch_size)` updates (one where `minibatch_size` is 0)
/// over consecutive rows, of near-equal sizes, each of whole groups of `group` rows where a minibatch holds a
/// group (as verl counts its minibatches in prompts). A step that keeps fewer responses than it sampled
/// (dynamic sampling) then makes no small tail update: 5 kept groups of 8 with `minibatch_size` 32 give 24 +
/// 16 rows, not 32 + 8, whose update would weigh one group's sequences as much as four's (Adam's step does
/// not shrink with the batch).
fn minibatches(rows: usize, minibatch_size: usize, group: usize) -> Vec<Vec<usize>> {
    let size = if minibatch_size == 0 {
        rows
    } else {
        minibatch_size.min(rows)
    };
    let count = rows.div_ceil(size.max(1));
    let unit = if group > 0 && size >= group && rows.is_multiple_of(group) {
        group
    } else {
        1
    };
    let units = rows / unit;
    let mut start = 0;
    (0..count)
        .map(|i| {
            let take = (units / count + usize::from(i < units % count)) * unit;
            let rows: Vec<usize> = (start..start + take).collect();
            start += take;
            rows
        })
        .collect()
}

fn loss_count(agg: LossAggMode, metrics: &LossMetrics) -> f64 {
    match agg {
        LossAggMode::TokenMean => metrics.loss_tokens,
        LossAggMode::SeqMeanTokenMean | LossAggMode::SeqMeanTokenSum => metrics.loss_sequences,
    }
}

/// `x [r, w]` padded with zero columns to `[r, width]`.
fn pad_columns(x: Tensor<2>, width: usize, device: &Device) -> Tensor<2> {
    let [r, w] = x.dims();
    if w >= width {
        return x;
    }
    Tensor::cat(vec![x, Tensor::zeros([r, width - w], device)], 1)
}

/// The rows of `chunk` whose loss and gradient are provably zero and whose forward would give `lp_old`
/// bit for bit, so that it need not run with a graph: zero advantage (every objective's loss is
/// proportional to the advantage; none where the KL term is on, whose gradient a zero-advantage row
/// still has once the policy left the reference), in the learner's first forward when
/// that forward computes the rollout's bits (`lp_old` is the rollout's record). Dense models only: a MoE
/// expert that only inert rows reach would then get no gradient at all, and AdamW skips a parameter without
/// one (no decay, no momentum step), where with the zero gradient it would move. Never every row: an
/// update with no active row still runs (the optimizer still steps).
fn inert_rows(s: &Scored, chunk: &[usize], first_forward: bool) -> Vec<usize> {
    if !(first_forward && s.lp_old_reused && s.top_k == 0 && s.lp_ref.is_none()) {
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
    /// Device-to-host reads of the learner forwards' decoder layers ([`ResponseForward::layer_reads`]).
    layer_reads: u64,
}

impl PhaseTimes {
    /// A learner forward of `b`, with a graph (a backward follows) or without.
    fn add_forward(&mut self, b: &SeqBatch, graph: bool, fwd: &ResponseForward) {
        self.layer_reads += fwd.layer_reads;
        let (tokens, flops) = fwd.work;
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

    pub(super) fn record(&self, m: &mut BTreeMap<String, f64>) {
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
        m.insert(
            "perf/host_reads_training_forward".into(),
            self.layer_reads as f64,
        );
        m.insert("train/skipped_sequences".into(), self.skipped as f64);
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
    /// Minibatches cover every row once, in order, in whole groups, with sizes at most one group apart; a
    /// full batch splits as plain chunks did.
    #[test]
    fn minibatches_are_balanced_whole_groups() {
        let sizes = |rows, mb, g| -> Vec<usize> {
            let m = super::minibatches(rows, mb, g);
            let flat: Vec<usize> = m.iter().flatten().copied().collect();
            assert_eq!(flat, (0..rows).collect::<Vec<_>>(), "{rows} {mb} {g}");
            m.iter().map(Vec::len).collect()
        };
        assert_eq!(sizes(128, 32, 8), [32, 32, 32, 32]);
        assert_eq!(sizes(40, 32, 8), [24, 16]);
        assert_eq!(sizes(88, 32, 8), [32, 32, 24]);
        assert_eq!(sizes(24, 32, 8), [24]);
        assert_eq!(sizes(40, 0, 8), [40]);
        // A minibatch smaller than a group splits rows.
        assert_eq!(sizes(16, 3, 8), [3, 3, 3, 3, 2, 2]);
        assert_eq!(sizes(0, 32, 8), Vec::<usize>::new());
    }

    /// An update whose corrections rejected every sequence adds nothing to the sequence means (it added a
    /// 0, halving `seq_ratio_mean`), while verl's plain means still count every update once; a step with
    /// no sequence in any update logs no sequence mean at all.
    #[test]
    fn sequence_means_skip_updates_without_sequences() {
        let metrics =
            |seq_ratio: f64, clipfrac: f64, sequences: f64| crate::rl::losses::LossMetrics {
                pg_loss: 0.0,
                pg_clipfrac: clipfrac,
                pg_clipfrac_lower: 0.0,
                ppo_kl: 0.0,
                seq_ratio_mean: seq_ratio,
                mismatch_weight_mean: seq_ratio,
                kept_token_frac: 1.0,
                kl_loss: None,
                loss_tokens: sequences * 3.0,
                loss_sequences: sequences,
            };
        let mut means = super::UpdateMeans::default();
        means.add(&metrics(1.25, 0.5, 4.0));
        means.add(&metrics(0.0, 0.0, 0.0));
        means.add(&metrics(1.0, 0.25, 1.0));
        let mut m = BTreeMap::new();
        means.record(3, &mut m);
        assert_eq!(m["actor/seq_ratio_mean"], (1.25 * 4.0 + 1.0) / 5.0);
        assert_eq!(m["actor/mismatch_weight_mean"], 1.2);
        assert_eq!(m["actor/pg_clipfrac"], 0.25);
        assert_eq!(m["actor/loss_sequences"], 5.0 / 3.0);

        let mut empty = super::UpdateMeans::default();
        empty.add(&metrics(0.0, 0.0, 0.0));
        let mut m = BTreeMap::new();
        empty.record(3, &mut m);
        assert!(!m.contains_key("actor/seq_ratio_mean"), "{m:?}");
        assert!(!m.contains_key("actor/mismatch_weight_mean"), "{m:?}");
        assert_eq!(m["actor/pg_loss"], 0.0);
    }

    use super::*;
    use crate::model::Weights;

    /// The fixture model on the autodiff CPU device, five sequences of two prompt groups and their
    /// `lp_old` (from a forward of the packed weights, as the rollout would have recorded them).
    struct Fixture {
        model: Decoder,
        batch: SeqBatch,
        lp_old: Vec<Vec<f32>>,
        empty: Vec<Option<Vec<u32>>>,
    }

    fn fixture() -> Fixture {
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
        Fixture {
            model,
            batch,
            lp_old,
            empty: Vec::new(),
        }
    }

    impl Fixture {
        fn scored(&self, advantages: &[f32], reused: bool) -> Scored<'_> {
            let n = self.batch.seqs.len();
            Scored {
                batch: self.batch.clone(),
                records: vec![&self.empty; n],
                replay: None,
                lp_old: self.lp_old.clone(),
                lp_roll: self.lp_old.clone(),
                lp_ref: None,
                entropy_roll: vec![Vec::new(); n],
                advantages: advantages.to_vec(),
                lp_old_reused: reused,
                top_k: 0,
                worst: None,
            }
        }
    }

    /// The pass of a step's first update (the learner forward at the step's start).
    fn first_pass<'a, 'b>(
        model: &'a Decoder,
        s: &'a Scored<'b>,
        cfg: &'a TrainConfig,
        loss_fn: &'a PolicyLoss,
    ) -> Pass<'a, 'b> {
        Pass {
            model,
            s,
            cfg,
            loss_fn,
            first_forward: true,
            inject_nonfinite: false,
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `||a - b|| / ||b||`, and `||b||`.
    fn relative_difference(a: &[f32], b: &[f32]) -> (f64, f64) {
        let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let norm: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
        ((diff / norm).sqrt(), norm)
    }

    /// `train.grad_clip` scales every gradient by one factor, `max / (global norm + 1e-6)` (torch's
    /// `clip_grad_norm_`), so the global norm lands on the limit and each tensor keeps its direction and
    /// its share; under the limit nothing changes. (burn's per-tensor clipping left the small tensors
    /// whole and cut only the big ones: a global norm above the limit and another direction.)
    #[test]
    fn grad_clip_scales_the_global_norm_to_the_limit() {
        let f = fixture();
        let device = f.model.device();
        let lp = f.batch.logprobs(&f.model, Weights::Packed, 1.0, None).0;
        let mask = f.batch.mask(&device);
        let grads = (lp * mask).sum().backward();
        let grads = GradientsParams::from_grads(grads, &f.model);
        let norm = grad_norm(&f.model, &grads);
        let q = |g: &GradientsParams| {
            to_f32_vec(
                g.get::<2>(f.model.layers[0].self_attn.q_proj.weight.id)
                    .unwrap(),
            )
        };
        let q_before = q(&grads);
        let q_norm: f64 = q_before
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(norm > 1.0 && q_norm < norm, "norm {norm}, q_proj {q_norm}");
        // Under the limit (or off): the same gradients.
        let mut same = GradientsParams::from_grads(
            (f.batch.logprobs(&f.model, Weights::Packed, 1.0, None).0 * f.batch.mask(&device))
                .sum()
                .backward(),
            &f.model,
        );
        assert_eq!(
            clip_to_global_norm(&f.model, &mut same, norm, (2.0 * norm) as f32),
            1.0
        );
        assert_eq!(clip_to_global_norm(&f.model, &mut same, norm, 0.0), 1.0);
        assert_eq!(bits(&q(&same)), bits(&q_before));
        // Over it: one factor for every tensor, the global norm at the limit.
        let limit = (norm / 4.0) as f32;
        let mut clipped = grads;
        let factor = clip_to_global_norm(&f.model, &mut clipped, norm, limit);
        let want = limit as f64 / (norm + 1e-6);
        assert!((factor - want).abs() < 1e-12, "{factor} vs {want}");
        let after = grad_norm(&f.model, &clipped);
        assert!(
            (after - limit as f64).abs() < 1e-4 * limit as f64,
            "{after} vs {limit}"
        );
        for (a, b) in q(&clipped).iter().zip(&q_before) {
            assert!((*a as f64 - *b as f64 * factor).abs() <= 1e-6 * (1.0 + b.abs() as f64));
        }
    }

    /// Rows with zero advantage skipped from the graph (their grid rows `lp_old`) give the grid of the full
    /// forward bit for bit, the same entropy metric, and the gradient of a loss whose zero-advantage rows
    /// contribute nothing, within 1e-6 relative (the backward's sums see fewer zero terms).
    #[test]
    fn inert_rows_skip_the_graph_and_change_nothing() {
        let f = fixture();
        let device = f.model.device();
        assert!(!f.scored(&[0.0; 5], true).has_rollout_entropy());
        let advantages = vec![0.5f32, -0.5, 0.0, 0.0, 1.0];
        let cfg = crate::train::load_config(None, &[]).unwrap();
        let loss_fn = cfg.train.loss.clone().resolve().unwrap();
        let chunk: Vec<usize> = (0..5).collect();
        let width = f.batch.width;
        let run = |reused: bool| {
            let s = f.scored(&advantages, reused);
            let pass = first_pass(&f.model, &s, &cfg, &loss_fn);
            let (mut perf, mut stats) = (PhaseTimes::default(), ForwardStats::default());
            let inert = inert_rows(&s, &chunk, true);
            let (lp, graph) = pass
                .rows_logprobs(&chunk, &inert, &mut perf, &mut stats)
                .unwrap();
            assert!(graph);
            let w: Vec<f32> = (0..5 * width)
                .map(|i| advantages[i / width] * (1.0 + (i % 3) as f32))
                .collect();
            let w = tensor_from_vec(w, [5, width], &device) * f.batch.mask(&device);
            let grads = (lp.clone() * w).sum().backward();
            let g = to_f32_vec(
                f.model.layers[0]
                    .self_attn
                    .q_proj
                    .weight
                    .val()
                    .grad(&grads)
                    .unwrap(),
            );
            let mut m = BTreeMap::new();
            stats.record(&mut m);
            (to_f32_vec(lp), g, m["actor/entropy"], perf.skipped)
        };
        let (lp_skip, g_skip, h_skip, skipped) = run(true);
        let (lp_full, g_full, h_full, none) = run(false);
        assert_eq!((skipped, none), (2, 0));
        // With the KL term on, a zero-advantage row still has a gradient: none is inert.
        let mut with_ref = f.scored(&advantages, true);
        with_ref.lp_ref = Some(with_ref.lp_old.clone());
        assert!(inert_rows(&with_ref, &chunk, true).is_empty());
        assert_eq!(bits(&lp_skip), bits(&lp_full));
        assert_eq!(h_skip.to_bits(), h_full.to_bits());
        let (rel, norm) = relative_difference(&g_skip, &g_full);
        assert!(norm > 0.0 && rel <= 1e-6, "{rel} (norm {norm})");
    }

    /// With the rollout's recorded entropy (what `lp_old` reuse provides in deterministic mode), the first
    /// forward takes its entropy metric from the record: the inert rows need no forward at all, and the
    /// metric has the bits of the forward's own entropy.
    #[test]
    fn recorded_entropy_saves_the_inert_rows_forward() {
        let f = fixture();
        let advantages = vec![0.5f32, -0.5, 0.0, 0.0, 1.0];
        let cfg = crate::train::load_config(None, &[]).unwrap();
        let loss_fn = cfg.train.loss.clone().resolve().unwrap();
        let chunk: Vec<usize> = (0..5).collect();
        let opts = ForwardOptions {
            entropy: true,
            ..ForwardOptions::default()
        };
        let (_, fwd) = f
            .batch
            .logprobs_with(&f.model.valid(), Weights::Packed, 1.0, None, opts);
        let entropy = split_responses(&f.batch, fwd.entropy.as_deref().unwrap());
        let run = |recorded: bool| {
            let mut s = f.scored(&advantages, true);
            if recorded {
                s.entropy_roll = entropy.clone();
            }
            assert_eq!(s.has_rollout_entropy(), recorded);
            let pass = first_pass(&f.model, &s, &cfg, &loss_fn);
            let (mut perf, mut stats) = (PhaseTimes::default(), ForwardStats::default());
            let g = pass.gradients(&chunk, &mut perf, &mut stats).unwrap();
            let mut m = BTreeMap::new();
            stats.record(&mut m);
            (g.loss, m["actor/entropy"], perf.tokens, perf.skipped)
        };
        let (loss_rec, h_rec, tokens_rec, skipped_rec) = run(true);
        let (loss_fwd, h_fwd, tokens_fwd, skipped_fwd) = run(false);
        assert_eq!(loss_rec.to_bits(), loss_fwd.to_bits());
        assert_eq!(h_rec.to_bits(), h_fwd.to_bits());
        assert_eq!((skipped_rec, skipped_fwd), (2, 2));
        assert!(tokens_rec < tokens_fwd, "{tokens_rec} vs {tokens_fwd}");
    }

    /// A minibatch in micro-batches (of 2 and of 1 rows, with inert rows in play and a micro-batch made of
    /// inert rows only) gives the single pass's loss and metrics bit for bit, the same entropy, and its
    /// gradient within 1e-5 relative, for each loss aggregation mode.
    #[test]
    fn micro_batches_give_the_single_pass_loss_and_gradient() {
        let f = fixture();
        let chunk: Vec<usize> = (0..5).collect();
        // The KL term too, against a reference the policy has left (every log-prob 0.1 above), and with
        // every advantage 0, where the KL's gradient is all there is.
        let with_kl = |adv: &[f32]| {
            let mut s = f.scored(adv, true);
            s.lp_ref = Some(
                s.lp_old
                    .iter()
                    .map(|r| r.iter().map(|x| x + 0.1).collect())
                    .collect(),
            );
            s
        };
        let cases = [
            ("no KL", vec![0.5f32, -0.5, 0.0, 0.0, 1.0], None),
            ("KL", vec![0.5, -0.5, 0.0, 0.0, 1.0], Some(0.3)),
            ("KL alone", vec![0.0; 5], Some(0.3)),
        ];
        for (agg, (what, advantages, kl)) in
            ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
                .into_iter()
                .flat_map(|agg| cases.iter().map(move |c| (agg, c)))
        {
            let mut cfg = crate::train::load_config(None, &[]).unwrap();
            cfg.train.loss.loss_agg_mode = Some(serde_json::from_value(agg.into()).unwrap());
            cfg.train.loss.kl_coef = *kl;
            let loss_fn = cfg.train.loss.clone().resolve().unwrap();
            let agg = format!("{agg}, {what}");
            let run = |micro: usize| {
                let mut cfg = cfg.clone();
                cfg.train.micro_batch_size = micro;
                let s = if kl.is_some() {
                    with_kl(advantages)
                } else {
                    f.scored(advantages, true)
                };
                let pass = first_pass(&f.model, &s, &cfg, &loss_fn);
                let (mut perf, mut stats) = (PhaseTimes::default(), ForwardStats::default());
                let g = pass.gradients(&chunk, &mut perf, &mut stats).unwrap();
                let mut m = BTreeMap::new();
                stats.record(&mut m);
                let norm = grad_norm(&f.model, &g.grads);
                let q = g
                    .grads
                    .get::<2>(f.model.layers[1].self_attn.q_proj.weight.id)
                    .map(to_f32_vec)
                    .unwrap();
                (g.loss, g.metrics, m["actor/entropy"], norm, q, perf.skipped)
            };
            let one = run(0);
            assert!(one.3 > 0.0 && one.0 != 0.0, "{agg}: a loss with a gradient");
            for micro in [2, 1] {
                let parts = run(micro);
                assert_eq!(parts.0.to_bits(), one.0.to_bits(), "{agg}, micro {micro}");
                assert_eq!(parts.1, one.1, "{agg}, micro {micro}");
                assert_eq!(parts.2.to_bits(), one.2.to_bits(), "{agg}, micro {micro}");
                assert_eq!(parts.5, one.5, "{agg}: the same rows skip the graph");
                let (rel, _) = relative_difference(&parts.4, &one.4);
                assert!(rel <= 1e-5, "{agg}, micro {micro}: gradient {rel}");
                assert!(
                    (parts.3 - one.3).abs() <= 1e-5 * one.3,
                    "{agg}, micro {micro}: norm {} vs {}",
                    parts.3,
                    one.3
                );
            }
        }
    }
}
