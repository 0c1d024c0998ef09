//! One RL step in three phases: [`collect`] (roll out with the configured precision, reward, advantages),
//! [`score`] (`lp_old` with the configured training forward, or the rollout's record where that is the same
//! bits, and the mismatch metrics), [`super::update::update`] (policy updates over mini-batches,
//! one quantization per new weight version).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context;
use burn::module::Module;
use burn::optim::ModuleOptimizer;

use super::batch::{replay_routing, ForwardOptions, SeqBatch};
use super::config::TrainConfig;
use super::reference::Reference;
use super::scored::{split_responses, ForwardStats, Scored};
use super::seeds::{rl_seed, RlStream};
use super::update::{update, UpdateOutcome};
use crate::host::to_f32_vec;
use crate::model::{Decoder, EndTokens, Tokenizer};
use crate::rl::advantages::{group_advantages, groups_with_signal, responses_of_groups};
use crate::rl::metrics::{error_token_metrics, response_length_metrics, rollout_mismatch_metrics};
use crate::rollout::{generate, FinishReason, Rollout, SamplingParams};
use crate::tasks::verify::score_response as score_answer;
use crate::tasks::{Example, Task};

/// Everything one step produced for the log.
pub struct StepOutcome {
    pub metrics: BTreeMap<String, f64>,
    /// Updates of this step skipped because the loss or the gradient was NaN or infinite.
    pub nonfinite_updates: usize,
    /// Global L2 norm of the gradient, averaged over the step's applied updates (before clipping).
    pub grad_norm: Option<f64>,
    /// The kept response with the most error tokens, for `worst_responses.jsonl`
    /// (`worst_response_example`).
    pub worst_response: Option<serde_json::Value>,
}

/// Runs RL step `step` on `model` (autodiff device; its quantized state is the rollout's weight version):
/// [`collect`] (rollout, rewards, advantages), [`score`] (`lp_old`, `lp_ref` under `reference` where the
/// KL term is on, and the mismatch metrics), [`update`] (the policy updates). An update whose loss or
/// gradient is not finite is skipped (the weights and optimizer state stay); `inject_nonfinite` makes
/// every loss NaN (fault injection for tests).
/// The keys that size a step's rollout, which a too-large one is refused by.
pub(super) const ROLLOUT_SIZE_KEYS: crate::rollout::RolloutInputs = crate::rollout::RolloutInputs {
    rows: "rollout.prompts_per_step / samples_per_prompt",
    reach: "rollout.max_new_tokens",
};
/// What a training prompt too long for the model is called in the error.
pub(super) const TRAINING_PROMPT: &str = "a training prompt";

#[allow(clippy::too_many_arguments)]
pub fn rl_step(
    model: &mut Decoder,
    optim: &mut ModuleOptimizer,
    task: &Task,
    tok: &Tokenizer,
    end: &EndTokens,
    reference: Option<&Reference>,
    cfg: &TrainConfig,
    step: usize,
    inject_nonfinite: bool,
) -> anyhow::Result<StepOutcome> {
    let t0 = Instant::now();
    // `perf/peak_rss_gb` is this step's peak: the process's, never reset, carried the warm start's (or an
    // earlier experiment run's) into every RL row.
    crate::ops::cpu::probe::reset_peak_resident();
    let collected = collect(model, task, tok, end, cfg, step)?;
    let mut m = collected.metrics.clone();
    let mut outcome = UpdateOutcome::default();
    let mut worst_response = None;
    if collected.rows.is_empty() {
        // verl's DAPO trainer stops where its rounds cannot fill a batch; here the run goes on, but says so
        // at every such step and in its summary (a run of them printed its accuracies as if it trained).
        tracing::warn!(
            step,
            "dynamic sampling kept no group (every group's rewards were equal, in every refill round): \
             this step made no update"
        );
    } else {
        let t_score = Instant::now();
        let mut scored = score(model, &collected, cfg, &mut m)?;
        m.insert("perf/lp_old_s".into(), t_score.elapsed().as_secs_f64());
        if let Some(reference) = reference {
            let t_ref = Instant::now();
            scored.lp_ref = Some(reference.logprobs(
                &scored.batch,
                cfg.rollout.temperature,
                scored.replay.as_deref(),
            ));
            m.insert("perf/lp_ref_s".into(), t_ref.elapsed().as_secs_f64());
            m.insert(
                "actor/kl_coef".into(),
                f64::from(cfg.train.loss.kl_weight()),
            );
        }
        worst_response = worst_response_example(tok, end, &collected, &scored)?;
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
        worst_response,
    })
}

/// Error tokens listed per example, at most (the rest are counted in `error_token_count`).
const EXAMPLE_ERROR_TOKENS: usize = 64;

/// The step's kept response with the highest fraction of error tokens, as the logs show it: its prompt and
/// response text, reward and advantage, and each error token with its text, position, log-probs and the
/// criteria it meets (docs/metrics.md, "Error tokens"). `None` when no response has an error token.
fn worst_response_example(
    tok: &Tokenizer,
    end: &EndTokens,
    c: &Collected,
    s: &Scored,
) -> anyhow::Result<Option<serde_json::Value>> {
    let Some((b, frac, flags)) = &s.worst else {
        return Ok(None);
    };
    let r = c.rows[*b];
    let out = &c.rollout;
    let response = out.response(r);
    let mut tokens = Vec::new();
    for (k, f) in flags.iter().enumerate().filter(|(_, f)| f.any()) {
        if tokens.len() == EXAMPLE_ERROR_TOKENS {
            break;
        }
        tokens.push(serde_json::json!({
            "at": k,
            "token": tok.decode(&response[k..=k])?,
            "lp_old": s.lp_old[*b].get(k),
            "lp_roll": s.lp_roll[*b].get(k),
            "criteria": f.names(),
        }));
    }
    Ok(Some(serde_json::json!({
        "row": r,
        "error_token_frac": frac,
        "error_token_count": flags.iter().filter(|f| f.any()).count(),
        "reward": c.rewards[r],
        "advantage": c.advantages[r],
        "prompt": tok.decode(&out.ids[r][..out.prompt_lens[r]])?,
        "response": tok.decode(end.strip(response))?,
        "error_tokens": tokens,
    })))
}

/// What the rollout phase of a step produced.
pub struct Collected {
    pub rollout: Rollout,
    /// The verifier's reward of each sampled sequence.
    pub rewards: Vec<f32>,
    /// One advantage per sampled sequence.
    pub advantages: Vec<f32>,
    /// The sequences the update trains on (all, or those of groups with a reward signal).
    pub rows: Vec<usize>,
    /// Reward, length and rollout-speed metrics.
    pub metrics: BTreeMap<String, f64>,
}

/// Samples the step's prompts with the model's current weight version, scores the responses with the
/// verifier and computes the group advantages. With dynamic sampling, the groups whose rewards all agree
/// are dropped, and up to `train.refill_rounds` more rounds of `rollout.prompts_per_step` new prompts are
/// sampled until `prompts_per_step` groups with a reward signal are kept (DAPO's refill; verl's
/// `filter_groups.max_num_gen_batches`); the kept groups are the first ones, in sampling order.
pub fn collect(
    model: &Decoder,
    task: &Task,
    tok: &Tokenizer,
    end: &EndTokens,
    cfg: &TrainConfig,
    step: usize,
) -> anyhow::Result<Collected> {
    let (rc, tc) = (&cfg.rollout, &cfg.train);
    let g = rc.samples_per_prompt;
    let mut all = sample_round(model, task, tok, end, cfg, step, 0)?;
    let rows: Vec<usize> = if tc.dynamic_sampling {
        let mut kept = groups_with_signal(&all.rewards, g)?;
        for round in 1..=tc.refill_rounds {
            if kept.len() >= rc.prompts_per_step {
                break;
            }
            all.append(sample_round(model, task, tok, end, cfg, step, round)?);
            kept = groups_with_signal(&all.rewards, g)?;
        }
        kept.truncate(rc.prompts_per_step);
        responses_of_groups(&kept, g)
    } else {
        (0..all.rollout.ids.len()).collect()
    };
    let advantages = group_advantages(&all.rewards, g, &tc.advantage)?;
    let mut m = all.metrics(model, cfg);
    m.insert("train/kept_sequences".into(), rows.len() as f64);
    if tc.dynamic_sampling {
        // Every round samples `prompts_per_step` groups.
        let sampled = all.rollout.ids.len() / g;
        m.insert("train/sampled_groups".into(), sampled as f64);
        m.insert(
            "train/refill_rounds".into(),
            (sampled / rc.prompts_per_step - 1) as f64,
        );
    }
    Ok(Collected {
        rollout: all.rollout,
        rewards: all.rewards,
        advantages,
        rows,
        metrics: m,
    })
}

/// One round of a step's sampling: `rollout.prompts_per_step` prompts, `G` responses each, scored by the
/// verifier; rounds after the first are dynamic sampling's refills ([`collect`]).
struct Round {
    rollout: Rollout,
    rewards: Vec<f32>,
    correct: usize,
    rollout_s: f64,
    reward_s: f64,
    prefill_gflop: f64,
}

impl Round {
    /// `next`'s sequences after this round's, and its times added.
    fn append(&mut self, next: Round) {
        self.rollout.append(next.rollout);
        self.rewards.extend(next.rewards);
        self.correct += next.correct;
        self.rollout_s += next.rollout_s;
        self.reward_s += next.reward_s;
        self.prefill_gflop += next.prefill_gflop;
    }

    /// Reward, length and rollout-speed metrics over every sampled sequence.
    fn metrics(&self, model: &Decoder, cfg: &TrainConfig) -> BTreeMap<String, f64> {
        let out = &self.rollout;
        let mut m = BTreeMap::new();
        m.insert("perf/reward_s".into(), self.reward_s);
        m.insert("perf/rollout_prefill_s".into(), out.prefill_s);
        m.insert("perf/rollout_decode_s".into(), out.decode_s);
        m.insert("perf/rollout_decode_steps".into(), out.decode_steps as f64);
        if out.decode_steps > 0 {
            m.insert(
                "perf/host_reads_per_decode_step".into(),
                out.decode_host_reads as f64 / out.decode_steps as f64,
            );
        }
        m.insert("perf/rollout_prefill_gflop".into(), self.prefill_gflop);
        // Projections and head per token, and the attention over the key slots each token read (the
        // cache's padded width: it was left out, 14% of the default run's decode flops).
        let per_token = model.config.forward_flops(1, 1, 0, 1).total();
        let per_key_slot = model.config.forward_flops(1, 1, 1, 0).attention;
        m.insert(
            "perf/rollout_decode_gflop".into(),
            (per_token * out.decode_tokens as f64 + per_key_slot * out.decode_key_slots as f64)
                / 1e9,
        );
        m.insert(
            "perf/rollout_decode_weight_gb".into(),
            out.decode_weight_bytes as f64 / 1e9,
        );
        m.insert(
            "perf/rollout_decode_kv_gb".into(),
            out.decode_kv_bytes as f64 / 1e9,
        );
        let n = out.ids.len() as f64;
        m.insert(
            "critic/rewards/mean".into(),
            self.rewards.iter().map(|&r| r as f64).sum::<f64>() / n,
        );
        m.insert("train/accuracy".into(), self.correct as f64 / n);
        let lens: Vec<usize> = (0..out.ids.len()).map(|r| out.response(r).len()).collect();
        m.extend(response_length_metrics(&lens, cfg.rollout.max_new_tokens));
        if cfg.verify.overlong_buffer > 0 {
            let overlong: Vec<f64> = lens
                .iter()
                .map(|&l| f64::from(cfg.verify.overlong_reward(l, cfg.rollout.max_new_tokens)))
                .collect();
            m.insert(
                "critic/overlong_reward/mean".into(),
                overlong.iter().sum::<f64>() / n,
            );
            m.insert(
                "response/overlong_frac".into(),
                overlong.iter().filter(|&&p| p < 0.0).count() as f64 / n,
            );
        }
        m.insert(
            "response/stop_frac".into(),
            out.finish_reasons
                .iter()
                .filter(|&&f| f == FinishReason::Stop)
                .count() as f64
                / n,
        );
        let gen_tokens = out.generated_tokens();
        m.insert(
            "perf/rollout_tokens_per_s".into(),
            gen_tokens as f64 / self.rollout_s.max(1e-9),
        );
        m.insert("perf/rollout_s".into(), self.rollout_s);
        m.insert("perf/generated_tokens".into(), gen_tokens as f64);
        m
    }
}

/// The prompts of round `round` of step `step` (a function of the run's seed, the step and the round).
pub fn round_prompts(task: &Task, cfg: &TrainConfig, step: usize, round: usize) -> Vec<Example> {
    task.sample_prompts(
        cfg.rollout.prompts_per_step,
        rl_seed(cfg.seed, RlStream::Prompts, step, round),
    )
}

/// Round `round` of step `step`'s sampling ([`Round`]). Round 0's prompts and sampling seeds are those of a
/// step without refills; each refill draws other prompts and other samples, the same on every rerun.
fn sample_round(
    model: &Decoder,
    task: &Task,
    tok: &Tokenizer,
    end: &EndTokens,
    cfg: &TrainConfig,
    step: usize,
    round: usize,
) -> anyhow::Result<Round> {
    let rc = &cfg.rollout;
    let g = rc.samples_per_prompt;
    let examples = round_prompts(task, cfg, step, round);
    let prompts: Vec<Vec<u32>> = examples
        .iter()
        .map(|e| tok.encode_prompt(&e.prompt, e.with_bos))
        .collect::<anyhow::Result<_>>()?;

    // Rollout on a plain-device view of the model: it shares the packed weights of this weight version.
    let policy = model.valid();
    let params = SamplingParams {
        temperature: rc.temperature,
        top_p: rc.top_p,
        top_k: rc.top_k,
        max_new_tokens: rc.max_new_tokens,
        seed: rl_seed(cfg.seed, RlStream::Sampling, step, round),
        stop_token_ids: end.stops().to_vec(),
        stop_strings: rc.stop.strings(end, tok, || task.stop_strings()),
        // The learner's entropy metric, when its forward would compute the rollout's bits.
        record_entropy: lp_old_is_the_rollout_record(cfg, 0),
        processed_logprobs: rc.logprobs == super::config::RolloutLogprobs::Processed,
    };
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    super::eval::check_example_prompts(
        &model.config,
        (ROLLOUT_SIZE_KEYS, prompts.len().saturating_mul(g)),
        (&examples, &prompts),
        rc.max_new_tokens,
        TRAINING_PROMPT,
    )?;
    let t_roll = Instant::now();
    let out = generate(&policy, &prompts, g, &params, Some(tok));
    out.ensure_finite()
        .with_context(|| format!("RL step {step}, rollout"))?;
    let rollout_s = t_roll.elapsed().as_secs_f64();

    let t_reward = Instant::now();
    let mut rewards = Vec::with_capacity(out.ids.len());
    let mut correct = 0usize;
    for r in 0..out.ids.len() {
        let text = tok.decode_without_special(end.strip(out.response(r)))?;
        let cut_off = out.finish_reasons[r] == FinishReason::Length;
        let v = score_answer(&text, cut_off, &examples[r / g].answer, &cfg.verify);
        correct += usize::from(v.correct);
        let overlong = cfg
            .verify
            .overlong_reward(out.response(r).len(), rc.max_new_tokens);
        rewards.push(v.reward + overlong);
    }
    let prefill = model
        .config
        .forward_flops(prompts.len(), longest, longest, prompts.len());
    Ok(Round {
        rollout: out,
        rewards,
        correct,
        rollout_s,
        reward_s: t_reward.elapsed().as_secs_f64(),
        prefill_gflop: prefill.total() / 1e9,
    })
}

/// Whether `lp_old` equals the rollout's recorded log-probs bit for bit, so that no forward is needed: where
/// the backend reproduces the rollout ([`crate::ops::BackendKind::reproduces_rollout`]: deterministic mode)
/// and nothing in the config blocks it ([`TrainConfig::lp_old_reuse_blocker`]: the aligned forward computes
/// the rollout's bits, one update per step has not changed the weights before the update's own forward,
/// and the record is the full vocabulary's log-prob).
pub fn lp_old_is_the_rollout_record(cfg: &TrainConfig, rows: usize) -> bool {
    cfg.train.backend.reproduces_rollout() && cfg.lp_old_reuse_blocker(rows).is_none()
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
    let top_k = model.config.experts_per_token();
    let seqs: Vec<Vec<u32>> = c.rows.iter().map(|&r| out.ids[r].clone()).collect();
    let plens: Vec<usize> = c.rows.iter().map(|&r| out.prompt_lens[r]).collect();
    let batch = SeqBatch::new(seqs, plens);
    let records: Vec<&Vec<Option<Vec<u32>>>> = c.rows.iter().map(|&r| &out.routing[r]).collect();
    let replay = (tc.routing_replay && top_k > 0)
        .then(|| replay_routing(&records, &batch.seqs, top_k, model.layers.len()));
    let lp_roll: Vec<Vec<f32>> = c.rows.iter().map(|&r| out.logprobs[r].clone()).collect();
    let entropy_roll: Vec<Vec<f32>> = c
        .rows
        .iter()
        .map(|&r| out.entropy.get(r).cloned().unwrap_or_default())
        .collect();
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
            check_lp_old_reuse("lp_old", &lp_old, &lp_roll)?;
            if let Some(h) = fwd.entropy.as_deref() {
                check_lp_old_reuse("entropy", &split_responses(&batch, h), &entropy_roll)?;
            }
        }
        let mut stats = ForwardStats::default();
        stats.add(&fwd, &batch, &records, replay.is_some(), top_k)?;
        stats.record(m);
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
    let worst = err
        .worst_row
        .map(|b| (b, err.worst_row_frac, err.worst_row_tokens));
    Ok(Scored {
        batch,
        records,
        replay,
        lp_old,
        lp_roll,
        lp_ref: None,
        entropy_roll,
        advantages: c.rows.iter().map(|&r| c.advantages[r]).collect(),
        lp_old_reused: reuse,
        top_k,
        worst,
    })
}

/// `train.lp_old_check`: the recomputed `lp_old` (and entropy, `what`) must equal the rollout's record bit
/// for bit wherever the record is reused (rows of `recorded` may be empty: not recorded).
fn check_lp_old_reuse(
    what: &str,
    learner: &[Vec<f32>],
    recorded: &[Vec<f32>],
) -> anyhow::Result<()> {
    for (b, (old, roll)) in learner.iter().zip(recorded).enumerate() {
        if roll.is_empty() && !old.is_empty() && what != "lp_old" {
            continue;
        }
        if let Some(t) =
            (0..old.len()).find(|&t| roll.get(t).map(|r| r.to_bits()) != Some(old[t].to_bits()))
        {
            anyhow::bail!(
                "lp_old reuse check: {what} of response {b}, token {t}: the learner forward gives {} where \
                 the rollout recorded {:?}; the aligned forward no longer reproduces the rollout's bits",
                old[t],
                roll.get(t)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lp_old_check_names_the_first_differing_token() {
        let roll = vec![vec![-0.5f32, -1.25], vec![-2.0]];
        assert!(check_lp_old_reuse("lp_old", &roll, &roll).is_ok());
        let mut old = roll.clone();
        old[0][1] = f32::from_bits((-1.25f32).to_bits() + 1);
        let err = check_lp_old_reuse("lp_old", &old, &roll)
            .unwrap_err()
            .to_string();
        assert!(err.contains("lp_old of response 0, token 1"), "{err}");
        let err = check_lp_old_reuse("entropy", &old, &roll)
            .unwrap_err()
            .to_string();
        assert!(err.contains("entropy of response 0, token 1"), "{err}");
        // Entropy rows the rollout did not record are not compared; log-prob rows always are.
        let empty = vec![Vec::new(), Vec::new()];
        assert!(check_lp_old_reuse("entropy", &old, &empty).is_ok());
        assert!(check_lp_old_reuse("lp_old", &old, &empty).is_err());
    }
}
