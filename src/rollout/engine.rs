//! Batched generation for RL: prompts of different lengths (right-padded prefill), `G` samples per prompt
//! (one prefill per prompt, the cache then fanned out), batched KV-cache decoding, and a record of what the
//! sampler saw: the log-prob of every sampled token and, for MoE models, the experts each token went to.

use std::time::Instant;

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::sampler::{sample_with_kept_mass, sequence_rng, SamplingParams};
use crate::model::mlp::{rows_and_routing, DeviceRouting, Routing};
use crate::model::{Decoder, Tokenizer};

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// It emitted a stop token or produced a stop string.
    Stop,
    /// It reached `max_new_tokens`.
    Length,
}

/// The result of one rollout call. Rows are prompt-major: all samples of prompt 0 first.
#[derive(Debug, Clone, Default)]
pub struct Rollout {
    /// Prompt followed by the generated tokens.
    pub ids: Vec<Vec<u32>>,
    /// Length of the prompt part of each row.
    pub prompt_lens: Vec<usize>,
    /// Log-prob of each generated token under the temperature-scaled distribution (`log_softmax(logits / T)`
    /// over the whole vocabulary, before top-k/top-p): the learner's log-prob of the same token, bitwise in
    /// deterministic mode. With top-k/top-p on, the token was drawn from the filtered, renormalised
    /// distribution, whose log-prob is this one minus the log of the kept mass: recorded instead with
    /// [`SamplingParams::processed_logprobs`] (vLLM's `processed_logprobs`, verl's default; docs/verl.md).
    pub logprobs: Vec<Vec<f32>>,
    /// The entropy (temperature 1) of the distribution each generated token was sampled from, when
    /// [`SamplingParams::record_entropy`] asked for it in deterministic mode (else empty rows): bitwise
    /// the aligned training forward's entropy at that position.
    pub entropy: Vec<Vec<f32>>,
    pub finish_reasons: Vec<FinishReason>,
    /// `routing[row][layer]`: experts of every token that went through the model (`ids[row][..len - 1]`),
    /// token-major, `top_k` per token; `None` for dense layers. Empty for dense models.
    pub routing: Vec<Vec<Option<Vec<u32>>>>,
    /// Wall time of the prefill (seconds): the prompts' forward, once per prompt.
    pub prefill_s: f64,
    /// Wall time of the decode loop (seconds): sampling and the one-token forwards.
    pub decode_s: f64,
    /// One-token forwards of the decode loop (each over the rows still generating).
    pub decode_steps: usize,
    /// Where the first NaN or infinite log-prob appeared (generation stopped there): `(token, row)`, the
    /// token counted from 0 (the one sampled from the prompt's forward). See [`Rollout::ensure_finite`].
    pub nonfinite: Option<(usize, usize)>,
    /// Tokens through those forwards (the rows still generating, summed over the steps).
    pub decode_tokens: usize,
    /// Key slots the decode forwards' attention read: the rows still generating times the key axis
    /// (padded to the attention's block), summed over the steps.
    pub decode_key_slots: usize,
    /// Bytes of weights the decode forwards read: each step's dense weights and the experts its tokens
    /// were routed to.
    pub decode_weight_bytes: usize,
    /// Bytes of K and V the decode forwards' attention read.
    pub decode_kv_bytes: usize,
    /// Device-to-host reads of the decode loop ([`crate::host::device_reads`]; 0 on the CPU backend):
    /// one per step when the step's sampled-from log-probs and its routing come back in one read.
    pub decode_host_reads: u64,
}

impl Rollout {
    /// `other`'s rows after these (prompt-major order kept), and its times and counts added: the rounds of
    /// a step's sampling as one rollout.
    pub fn append(&mut self, other: Rollout) {
        if self.nonfinite.is_none() {
            self.nonfinite = other
                .nonfinite
                .map(|(token, row)| (token, row + self.ids.len()));
        }
        self.ids.extend(other.ids);
        self.prompt_lens.extend(other.prompt_lens);
        self.logprobs.extend(other.logprobs);
        self.entropy.extend(other.entropy);
        self.finish_reasons.extend(other.finish_reasons);
        self.routing.extend(other.routing);
        self.prefill_s += other.prefill_s;
        self.decode_s += other.decode_s;
        self.decode_steps += other.decode_steps;
        self.decode_tokens += other.decode_tokens;
        self.decode_key_slots += other.decode_key_slots;
        self.decode_weight_bytes += other.decode_weight_bytes;
        self.decode_kv_bytes += other.decode_kv_bytes;
        self.decode_host_reads += other.decode_host_reads;
    }

    /// The generated part of row `r`.
    pub fn response(&self, r: usize) -> &[u32] {
        &self.ids[r][self.prompt_lens[r]..]
    }

    /// An error naming the first row and token whose distribution was not finite (NaN or infinite logits:
    /// broken weights or a diverged model), if any.
    pub fn ensure_finite(&self) -> Result<(), super::RolloutError> {
        match self.nonfinite {
            Some((token, row)) => Err(super::RolloutError::NonFinite { token, row }),
            None => Ok(()),
        }
    }

    /// Number of generated tokens over all rows.
    pub fn generated_tokens(&self) -> usize {
        self.logprobs.iter().map(Vec::len).sum()
    }
}

/// The first row holding a NaN or a +infinity (a log-prob is at most 0; -infinity is a token the model
/// rules out).
fn first_nonfinite(rows: &[Vec<f32>]) -> Option<usize> {
    rows.iter()
        .position(|r| r.iter().any(|x| x.is_nan() || *x == f32::INFINITY))
}

/// What one forward's logits give the sampler: per row, the log-probs and, when recorded, the entropy.
struct NextToken {
    logprobs: Vec<Vec<f32>>,
    /// Empty unless recorded (deterministic mode, [`SamplingParams::record_entropy`]).
    entropy: Vec<f32>,
}

/// `log_softmax(logits[b, at[b], :] / temperature)` as host rows, and with `entropy` (deterministic mode
/// only) each row's entropy at temperature 1 ([`crate::model::scoring::entropy_row`]); with the forward's
/// routing read in the same device-to-host read ([`rows_and_routing`]): the one read of a decode step.
fn logprobs_at(
    logits: Tensor<3>,
    at: &[usize],
    temperature: f32,
    entropy: bool,
    routing: Vec<Option<DeviceRouting>>,
) -> (NextToken, Vec<Option<Routing>>) {
    let [b, t, v] = logits.dims();
    let last = if at.iter().all(|&i| i == t - 1) {
        logits.narrow(1, t - 1, 1).reshape([b, v])
    } else {
        let rows: Vec<i64> = at
            .iter()
            .enumerate()
            .map(|(r, &i)| (r * t + i) as i64)
            .collect();
        let idx = Tensor::<1, Int>::from_data(TensorData::new(rows, [b]), &logits.device());
        logits.reshape([b * t, v]).select(0, idx)
    };
    if crate::ops::deterministic() {
        // The fixed-order host log-softmax the training forward's log-probs are computed with.
        let (host, routing) = rows_and_routing(Some(last), routing);
        let (logprobs, entropy): (Vec<Vec<f32>>, Vec<Option<f32>>) = host
            .par_iter()
            .map(|r| crate::model::scoring::log_softmax_and_entropy(r, temperature, entropy))
            .unzip();
        let entropy = entropy.into_iter().flatten().collect();
        return (NextToken { logprobs, entropy }, routing);
    }
    let last = if temperature == 1.0 {
        last
    } else {
        last / temperature as f64
    };
    let (logprobs, routing) = rows_and_routing(Some(log_softmax(last, 1)), routing);
    let next = NextToken {
        logprobs,
        entropy: Vec::new(),
    };
    (next, routing)
}

/// Appends, for each row of `rows`, the routing of the first `take(slot)` tokens it fed through one forward
/// (`[rows * t * k]` per layer, token-major).
fn append_routing(
    record: &mut [Vec<Option<Vec<u32>>>],
    rows: &[usize],
    routing: &[Option<Vec<u32>>],
    t: usize,
    take: &dyn Fn(usize) -> usize,
) {
    for (layer, r) in routing.iter().enumerate() {
        let Some(r) = r else { continue };
        let k = r.len() / (rows.len() * t);
        for (slot, &row) in rows.iter().enumerate() {
            let chunk = &r[slot * t * k..(slot * t + take(slot)) * k];
            record[row][layer]
                .get_or_insert_with(Vec::new)
                .extend_from_slice(chunk);
        }
    }
}

/// Generates `samples` continuations of each prompt.
///
/// # Panics
///
/// On prompts the model cannot take (an empty prompt, an id outside the vocabulary), as
/// [`Decoder::forward`] does: prompts from outside go through [`Decoder::check_prompts`] first, and
/// `params` through [`SamplingParams::validate`].
pub fn generate(
    model: &Decoder,
    prompts: &[Vec<u32>],
    samples: usize,
    params: &SamplingParams,
    tokenizer: Option<&Tokenizer>,
) -> Rollout {
    // On a thread of rayon's pool: every parallel kernel of the forward is then forked from a worker
    // (work-stealing between awake workers) instead of injected from outside the pool, which parks the
    // caller and wakes a worker per call (a decode step makes dozens of such calls).
    rayon::scope(|_| generate_in_pool(model, prompts, samples, params, tokenizer))
}

fn generate_in_pool(
    model: &Decoder,
    prompts: &[Vec<u32>],
    samples: usize,
    params: &SamplingParams,
    tokenizer: Option<&Tokenizer>,
) -> Rollout {
    let p = prompts.len();
    let rows = p * samples;
    let temperature = params.logprob_temperature();
    let n_layers = model.layers.len();
    let mut out = Rollout {
        ids: Vec::with_capacity(rows),
        prompt_lens: Vec::with_capacity(rows),
        logprobs: vec![Vec::new(); rows],
        entropy: vec![Vec::new(); rows],
        finish_reasons: vec![FinishReason::Length; rows],
        routing: vec![vec![None; n_layers]; rows],
        ..Rollout::default()
    };
    for prompt in prompts {
        for _ in 0..samples {
            out.ids.push(prompt.clone());
            out.prompt_lens.push(prompt.len());
        }
    }
    if rows == 0 || params.max_new_tokens == 0 {
        return out;
    }

    // Prefill every prompt once, right-padded to the longest (each row's tokens start at slot 0).
    let t_prefill = Instant::now();
    let t = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let padded = crate::model::scoring::right_pad(prompts);
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let mut cache = model.new_cache(p);
    let last: Vec<usize> = lens.iter().map(|l| l - 1).collect();
    // Logits only at each prompt's last token: the LM head over the whole prompt would be wasted.
    let pre = model.forward_logits_at(&padded, Some(&lens), Some(&mut cache), None, Some(&last));
    let record_entropy = params.record_entropy;
    let record_routing = pre.routing.iter().any(Option::is_some);
    let (prompt_next, pre_routing) = logprobs_at(
        pre.logits,
        &vec![0; p],
        temperature,
        record_entropy,
        pre.routing,
    );
    let prompt_lp = prompt_next.logprobs;
    if let Some(pi) = first_nonfinite(&prompt_lp) {
        out.nonfinite = Some((0, pi * samples));
        return out;
    }
    if record_routing {
        let fan: Vec<usize> = (0..rows).collect();
        let by_prompt: Vec<usize> = (0..rows).map(|r| r / samples).collect();
        // Each sample's record starts with its prompt's routing (padding slots left out).
        let mut per_prompt: Vec<Vec<Option<Vec<u32>>>> = vec![vec![None; n_layers]; p];
        let prompt_rows: Vec<usize> = (0..p).collect();
        append_routing(&mut per_prompt, &prompt_rows, &pre_routing, t, &|slot| {
            lens[slot]
        });
        for r in fan {
            out.routing[r] = per_prompt[by_prompt[r]].clone();
        }
    }

    // Fan the cache out to `samples` rows per prompt.
    let fan_out: Vec<usize> = (0..rows).map(|r| r / samples).collect();
    cache.select_rows(&fan_out);
    let mut lp_rows: Vec<Vec<f32>> = fan_out.iter().map(|&pi| prompt_lp[pi].clone()).collect();
    let mut entropy_rows: Vec<f32> = if prompt_next.entropy.is_empty() {
        Vec::new()
    } else {
        fan_out.iter().map(|&pi| prompt_next.entropy[pi]).collect()
    };
    out.prefill_s = t_prefill.elapsed().as_secs_f64();
    let (all_bytes, experts) = (model.weight_bytes(), model.expert_weight_bytes());
    let t_decode = Instant::now();
    let reads = crate::host::ReadCount::start();
    let mut rngs: Vec<_> = (0..rows).map(|r| sequence_rng(params.seed, r)).collect();
    let mut active: Vec<usize> = (0..rows).collect();
    let max_stop_len = params
        .stop_strings
        .iter()
        .map(String::len)
        .max()
        .unwrap_or(0);

    for step in 0..params.max_new_tokens {
        let mut keep = Vec::with_capacity(active.len());
        let mut next = Vec::with_capacity(active.len());
        // Each row's draw uses its own generator, so the rows are sampled in parallel. `active` is
        // ascending, so the active rows' generators come out of `rngs` in slot order.
        debug_assert!(active.windows(2).all(|w| w[0] < w[1]));
        let active_rngs: Vec<_> = rngs
            .iter_mut()
            .enumerate()
            .filter(|(row, _)| active.binary_search(row).is_ok())
            .map(|(_, rng)| rng)
            .collect();
        let toks: Vec<(u32, f64)> = active_rngs
            .into_par_iter()
            .enumerate()
            .map(|(slot, rng)| sample_with_kept_mass(&lp_rows[slot], params, rng))
            .collect();
        for (slot, &row) in active.iter().enumerate() {
            let (tok, log_kept) = toks[slot];
            let lp = lp_rows[slot][tok as usize];
            // Without a filter `log_kept` is exactly 0: the processed record is then `lp`'s bits.
            out.logprobs[row].push(if params.processed_logprobs {
                (lp as f64 - log_kept) as f32
            } else {
                lp
            });
            if let Some(&h) = entropy_rows.get(slot) {
                out.entropy[row].push(h);
            }
            out.ids[row].push(tok);
            let stopped = params.stop_token_ids.contains(&tok)
                || (max_stop_len > 0
                    && tokenizer.is_some_and(|tk| {
                        // A stop string spans at most its length in tokens, plus one partial token each side.
                        tail_text(tk, &out.ids[row], out.prompt_lens[row], max_stop_len + 2)
                            .is_some_and(|s| {
                                params.stop_strings.iter().any(|st| s.contains(st.as_str()))
                            })
                    }));
            if stopped {
                out.finish_reasons[row] = FinishReason::Stop;
            } else {
                keep.push(slot);
                next.push(vec![tok]);
            }
        }
        if keep.is_empty() || step + 1 == params.max_new_tokens {
            break;
        }
        // Finished rows leave the batch: they stop costing compute.
        cache.select_rows(&keep);
        active = keep.iter().map(|&s| active[s]).collect();
        let step_out = model.forward(&next, None, Some(&mut cache), None);
        out.decode_steps += 1;
        out.decode_tokens += next.len();
        let (next_token, step_routing) = logprobs_at(
            step_out.logits,
            &vec![0; active.len()],
            temperature,
            record_entropy,
            step_out.routing,
        );
        if record_routing {
            append_routing(&mut out.routing, &active, &step_routing, 1, &|_| 1);
        }
        out.decode_weight_bytes += Decoder::routed_weight_bytes(all_bytes, &experts, &step_routing);
        let key_slots = next.len() * cache.key_width();
        out.decode_key_slots += key_slots;
        out.decode_kv_bytes += key_slots * cache.bytes_per_key_slot();
        (lp_rows, entropy_rows) = (next_token.logprobs, next_token.entropy);
        if let Some(slot) = first_nonfinite(&lp_rows) {
            out.nonfinite = Some((step + 1, active[slot]));
            break;
        }
    }
    out.decode_s = t_decode.elapsed().as_secs_f64();
    out.decode_host_reads = reads.reads();
    out
}

/// The text of a row's last `window` generated tokens (never the prompt's), decoded after the token before
/// them and cut from it: SentencePiece decoders (Llama 2, Mistral) drop the leading space of a decode's first
/// token, so the tokens of ` Question:` decoded alone read `Question:`, and a stop string starting with a
/// space was missed where it began the window (vLLM decodes with such context too). Where the context's own
/// text is not a prefix of the whole (a character split between tokens), the window decoded alone.
fn tail_text(tk: &Tokenizer, ids: &[u32], prompt_len: usize, window: usize) -> Option<String> {
    let start = ids.len().saturating_sub(window).max(prompt_len);
    if let Some(context) = start.checked_sub(1) {
        if let (Ok(whole), Ok(before)) =
            (tk.decode(&ids[context..]), tk.decode(&ids[context..start]))
        {
            if let Some(rest) = whole.strip_prefix(before.as_str()) {
                return Some(rest.to_string());
            }
        }
    }
    tk.decode(&ids[start..]).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece-style tokenizer (Metaspace decoder: a decode drops its first token's leading space).
    fn metaspace_tokenizer(dir: &std::path::Path) -> Tokenizer {
        let metaspace = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}",
            "prepend_scheme": "always", "split": true});
        let vocab = serde_json::json!({"\u{2581}Answer": 0, "\u{2581}42": 1, "\u{2581}Question": 2,
            ":": 3, "<unk>": 4});
        let doc = serde_json::json!({"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [], "normalizer": null, "pre_tokenizer": metaspace, "post_processor": null,
            "decoder": metaspace, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}});
        std::fs::write(dir.join("tokenizer.json"), doc.to_string()).unwrap();
        Tokenizer::load_optional(dir).unwrap().unwrap()
    }

    #[test]
    fn a_window_keeps_the_leading_space_its_first_token_has_in_the_response() {
        let tmp = tempfile::tempdir().unwrap();
        let tk = metaspace_tokenizer(tmp.path());
        // Decoded alone, the window loses its leading space: the stop string ` Question:` was missed.
        assert_eq!(tk.decode(&[2, 3]).unwrap(), "Question:");
        // Prompt `Answer`, response ` 42 Question:`: the window's text after its context.
        let ids = [0, 1, 2, 3];
        assert_eq!(tail_text(&tk, &ids, 1, 2).unwrap(), " Question:");
        // The window starting the response takes the prompt's last token as context, not its text.
        assert_eq!(tail_text(&tk, &ids, 1, 8).unwrap(), " 42 Question:");
        // With no token before the window, it is decoded alone.
        assert_eq!(tail_text(&tk, &ids, 0, 8).unwrap(), "Answer 42 Question:");
    }
}
