//! One RL step: roll out with the configured precision, reward, advantages, `lp_old` with the configured
//! training forward, policy updates over mini-batches, then one re-quantization per weight version.

use std::collections::BTreeMap;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;

use super::batch::{replay_routing, SeqBatch};
use super::config::{lr_at, TrainConfig, TrainForward};
use crate::host::{tensor_from_vec, to_f32_vec};
use crate::model::{Decoder, Tokenizer};
use crate::rl::advantages::{group_advantages, groups_with_signal, responses_of_groups};
use crate::rl::losses::{PolicyLoss, PolicyLossInputs};
use crate::rl::metrics::{
    error_token_metrics, masked_mean, response_length_metrics, rollout_mismatch_metrics,
    routing_disagreement, token_entropy,
};
use crate::rollout::{generate, FinishReason, SamplingParams};
use crate::tasks::verify::score;
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

/// Runs RL step `step` on `model` (autodiff device; its quantized state is the rollout's weight version).
/// An update whose loss or gradient is not finite is skipped (the weights and optimizer state stay);
/// `inject_nonfinite` makes every loss NaN (fault injection for tests).
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
    let mut nonfinite_updates = 0usize;
    let mut grad_norms: Vec<f64> = Vec::new();
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
        let v = score(&text, &examples[r / g].answer, &cfg.verify);
        correct += usize::from(v.correct);
        rewards.push(v.reward);
    }
    let tc = &cfg.train;
    let advantages =
        group_advantages(&rewards, g, &tc.advantage).map_err(|e| anyhow::anyhow!("{e}"))?;
    let rows: Vec<usize> = if tc.dynamic_sampling {
        responses_of_groups(
            &groups_with_signal(&rewards, g).map_err(|e| anyhow::anyhow!("{e}"))?,
            g,
        )
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

    // The training forward's weights: the rollout's packed version (aligned) or the f32 masters (full).
    let weights = tc.forward.weights();
    // Whether the packed version lags the masters (after an update with the full-precision forward).
    let mut packed_stale = false;
    let top_k = model
        .config
        .moe
        .as_ref()
        .map_or(0, |c| c.num_experts_per_tok);
    let layers = model.layers.len();
    let device = model.device();
    if !rows.is_empty() {
        let seqs: Vec<Vec<u32>> = rows.iter().map(|&r| out.ids[r].clone()).collect();
        let plens: Vec<usize> = rows.iter().map(|&r| out.prompt_lens[r]).collect();
        let batch = SeqBatch::new(seqs, plens);
        let records: Vec<&Vec<Option<Vec<u32>>>> = rows.iter().map(|&r| &out.routing[r]).collect();
        let replay = (tc.routing_replay && top_k > 0)
            .then(|| replay_routing(&records, &batch.seqs, top_k, layers));

        // lp_old: the learner forward at the start of the step (no gradient).
        let learner = model.valid();
        let (lp_old_t, fwd) = batch.logprobs(&learner, weights, rc.temperature, replay.as_deref());
        let lp_old_grid = to_f32_vec(lp_old_t);
        let lp_old = batch.responses_of(&lp_old_grid);
        let lp_roll: Vec<Vec<f32>> = rows.iter().map(|&r| out.logprobs[r].clone()).collect();
        let mask_vals = batch.mask_values();
        let mask_bool: Vec<bool> = mask_vals.iter().map(|&v| v > 0.0).collect();
        let roll_grid = batch.grid_values(&lp_roll);
        m.extend(
            rollout_mismatch_metrics(&lp_old_grid, &roll_grid, &mask_bool, batch.width)
                .map_err(|e| anyhow::anyhow!("{e}"))?,
        );
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
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        m.extend(err.to_map());
        let entropy = to_f32_vec(token_entropy(fwd.logits.clone().narrow(1, 0, batch.width)));
        m.insert("actor/entropy".into(), masked_mean(&entropy, &mask_bool));
        if top_k > 0 && replay.is_none() {
            // Routing of the learner forward vs the rollout, over the tokens the rollout routed.
            let mut agg = None;
            for (b, rec) in records.iter().enumerate() {
                let t = batch.seqs.iter().map(Vec::len).max().unwrap_or(0);
                let learner_row: Vec<Option<Vec<u32>>> = fwd
                    .routing
                    .iter()
                    .map(|l| {
                        l.as_ref().map(|v| {
                            v[b * t * top_k..(b * t + batch.seqs[b].len() - 1) * top_k].to_vec()
                        })
                    })
                    .collect();
                let d = routing_disagreement(rec, &learner_row, top_k)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                agg = Some(match agg {
                    None => d,
                    Some(a) => a + d,
                });
            }
            if let Some(f) = agg.and_then(|a| a.fraction()) {
                m.insert("moe/routing_disagreement_frac".into(), f);
            }
        }

        // Policy updates.
        let loss_fn: PolicyLoss = tc
            .loss
            .clone()
            .resolve()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let adv: Vec<f32> = rows.iter().map(|&r| advantages[r]).collect();
        let mb = if tc.minibatch_size == 0 {
            rows.len()
        } else {
            tc.minibatch_size.min(rows.len())
        };
        let lr = lr_at(tc.lr, tc.lr_schedule, tc.warmup_steps, step, tc.steps);
        let mut loss_metrics: BTreeMap<String, f64> = BTreeMap::new();
        let mut updates = 0usize;
        let t_train = Instant::now();
        for _epoch in 0..tc.epochs {
            for chunk in (0..rows.len()).collect::<Vec<_>>().chunks(mb) {
                let sub = SeqBatch::new(
                    chunk.iter().map(|&i| batch.seqs[i].clone()).collect(),
                    chunk.iter().map(|&i| batch.prompt_lens[i]).collect(),
                );
                let sub_replay = replay.as_ref().map(|_| {
                    let recs: Vec<&Vec<Option<Vec<u32>>>> =
                        chunk.iter().map(|&i| records[i]).collect();
                    replay_routing(&recs, &sub.seqs, top_k, layers)
                });
                let (lp_theta, _) =
                    sub.logprobs(model, weights, rc.temperature, sub_replay.as_deref());
                let old: Vec<Vec<f32>> = chunk.iter().map(|&i| lp_old[i].clone()).collect();
                let roll: Vec<Vec<f32>> = chunk.iter().map(|&i| lp_roll[i].clone()).collect();
                let advs: Vec<f32> = chunk.iter().map(|&i| adv[i]).collect();
                let inputs = PolicyLossInputs {
                    lp_theta,
                    lp_old: sub.grid(&old, &device),
                    lp_roll: sub.grid(&roll, &device),
                    mask: sub.mask(&device),
                    advantages: tensor_from_vec(advs, [chunk.len()], &device),
                    lp_ref: None,
                };
                let outp = loss_fn
                    .compute(inputs)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
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
                    nonfinite_updates += 1;
                    continue;
                }
                grad_norms.push(norm);
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
                    packed_stale = true;
                }
            }
        }
        for (k, v) in loss_metrics {
            m.insert(k, v / updates.max(1) as f64);
        }
        // Did the update move the right way? Mean per-token log-prob change of the step's responses under the
        // updated weights, for positive and for negative advantages (same forward as lp_old).
        let after = to_f32_vec(
            batch
                .logprobs(&model.valid(), weights, rc.temperature, replay.as_deref())
                .0,
        );
        let after = batch.responses_of(&after);
        for (sign, key) in [
            (1.0f32, "actor/update_lp_delta_pos"),
            (-1.0, "actor/update_lp_delta_neg"),
        ] {
            let (mut sum, mut n) = (0.0f64, 0usize);
            for (i, (a, o)) in after.iter().zip(&lp_old).enumerate() {
                if adv[i] * sign > 0.0 {
                    sum += a.iter().zip(o).map(|(x, y)| (x - y) as f64).sum::<f64>();
                    n += a.len();
                }
            }
            if n > 0 {
                m.insert(key.into(), sum / n as f64);
            }
        }
        m.insert("perf/update_s".into(), t_train.elapsed().as_secs_f64());
        m.insert("actor/lr".into(), lr);
    }
    m.insert("train/nonfinite_updates".into(), nonfinite_updates as f64);
    let grad_norm =
        (!grad_norms.is_empty()).then(|| grad_norms.iter().sum::<f64>() / grad_norms.len() as f64);
    if let Some(g) = grad_norm {
        m.insert("actor/grad_norm".into(), g);
        m.insert(
            "actor/grad_norm_max".into(),
            grad_norms.iter().copied().fold(0.0, f64::max),
        );
    }
    if packed_stale {
        // The next rollout's weight version, quantized once from the final masters.
        model.requantize()?;
    }
    m.insert("perf/step_s".into(), t0.elapsed().as_secs_f64());
    Ok(StepOutcome {
        metrics: m,
        nonfinite_updates,
        grad_norm,
    })
}
