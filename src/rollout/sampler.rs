//! Token sampling: temperature, top-k, top-p, greedy, with a per-sequence deterministic random stream.

use rand::Rng;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Sampling parameters out of range, found by [`SamplingParams::validate`] (the sampler itself takes them as
/// given); each message names the parameter, the caller the place it was set (config key or flag).
/// The sampling options a greedy decode was given beside their defaults (`top_p` 1, `top_k` 0): the
/// defaults are not the user's, and were named as if they were.
fn sampling_given(top_p: f64, top_k: usize) -> String {
    let mut given = Vec::new();
    if top_p != 1.0 {
        given.push(format!("top_p (got {top_p})"));
    }
    if top_k != 0 {
        given.push(format!("top_k (got {top_k})"));
    }
    given.join(" or ")
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RolloutError {
    #[error(
        "temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:e} (near 0 the logits \
         divided by it overflow), got {0:?}"
    )]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f64),
    #[error(
        "temperature 0 is greedy decoding, which takes no {}: it would be ignored",
        sampling_given(*top_p, *top_k)
    )]
    GreedyWithSampling { top_p: f64, top_k: usize },
    #[error("stop strings must not be empty")]
    EmptyStopString,
    #[error(
        "the model's next-token distribution is not finite (NaN or infinite logits) at generated token \
         {token} of row {row}: its weights or inputs hold non-finite values, or it has diverged"
    )]
    NonFinite { token: usize, row: usize },
}

/// The smallest sampling temperature above 0: the logits are divided by it, and a temperature such as
/// 1e-45 turns every logit infinite, which then reads as a model gone non-finite. Between it and 1e-2
/// qarl samples at the temperature given, where vLLM raises it to 1e-2 (`_MAX_TEMP`, with a warning).
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// How to sample continuations. `temperature = 0` is greedy decoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means argmax (greedy).
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = off).
    /// An f64, as the config's TOML writes it: held as f32, 0.8 became 0.800000012, and a set of tied tokens
    /// whose mass is exactly 0.8 kept one token more than the exact cut (5 of 5 equal tokens, not 4; HF's on
    /// CPU is the exact one, vLLM's f32 comparison keeps the fifth: docs/verl.md).
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Tokens to generate at most per sequence.
    pub max_new_tokens: usize,
    /// Seed of the random streams; sequence `i` of a call uses its own stream derived from `(seed, i)`.
    pub seed: u64,
    /// A sequence finishes (reason `stop`) after emitting one of these ids; the id is kept.
    pub stop_token_ids: Vec<u32>,
    /// A sequence finishes (reason `stop`) once its decoded continuation contains one of these strings.
    pub stop_strings: Vec<String>,
    /// Record the entropy (temperature 1) of every sampled token's distribution ([`super::Rollout::entropy`];
    /// deterministic mode only, where it is bitwise the training forward's): the learner then needs no
    /// forward for its entropy metric.
    pub record_entropy: bool,
    /// Record each token's log-prob under the distribution it was drawn from, after top-k / top-p and
    /// renormalisation (vLLM's `processed_logprobs`, verl's default): the full vocabulary's log-prob minus
    /// the log of the kept mass. Off (the default): the full vocabulary's, which is the learner's. Without
    /// top-k / top-p the two are the same bits.
    pub processed_logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 64,
            seed: 0,
            stop_token_ids: vec![],
            stop_strings: vec![],
            record_entropy: false,
            processed_logprobs: false,
        }
    }
}

impl SamplingParams {
    /// Range checks; the error names the offending parameter.
    pub fn validate(&self) -> Result<(), RolloutError> {
        let t = self.temperature;
        if !(t == 0.0 || (t.is_finite() && t >= MIN_TEMPERATURE)) {
            return Err(RolloutError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(RolloutError::TopP(self.top_p));
        }
        if t == 0.0 && (self.top_p != 1.0 || self.top_k != 0) {
            return Err(RolloutError::GreedyWithSampling {
                top_p: self.top_p,
                top_k: self.top_k,
            });
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return Err(RolloutError::EmptyStopString);
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The temperature the recorded log-probs are computed at (1 for greedy decoding).
    pub fn logprob_temperature(&self) -> f32 {
        if self.is_greedy() {
            1.0
        } else {
            self.temperature
        }
    }
}

/// The random stream of sequence `index` under `seed`: a sequence's sample does not change when other
/// sequences finish earlier or are added after it, but it is its position in the call (prompt index times
/// samples per prompt, plus its sample), so prompts inserted before it or reordered change it (vLLM's
/// per-request seed does not depend on position). RL steps draw their prompts from seeds, so runs repeat.
pub fn sequence_rng(seed: u64, index: usize) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(index as u64);
    rng
}

/// Index of the largest value, first on ties (as `torch.argmax`).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// How far below `top_p` a kept set's summed probability may fall and still reach it: the rounding of a
/// sum of up to a vocabulary's f64 terms, far below any probability an f32 log-prob resolves.
const TOP_P_SLACK: f64 = 1e-9;

/// Samples a token from `logprobs` (the log-softmax of the temperature-scaled logits) after top-k / top-p
/// filtering and renormalisation.
pub fn sample(logprobs: &[f32], params: &SamplingParams, rng: &mut ChaCha8Rng) -> u32 {
    sample_with_kept_mass(logprobs, params, rng).0
}

/// [`sample`], and the log of the probability mass the filters kept (`ln sum_kept exp(logprob)`; exactly 0
/// where no filter runs, greedy included): the drawn token's log-prob under the renormalised distribution
/// is its `logprob` minus it.
pub fn sample_with_kept_mass(
    logprobs: &[f32],
    params: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> (u32, f64) {
    if params.is_greedy() {
        return (argmax(logprobs), 0.0);
    }
    let u: f64 = rng.random::<f64>();
    // A `top_k` of the whole vocabulary keeps every token: off, as vLLM and transformers read it (the same
    // draws and exactly 0 kept-mass log as without it).
    let top_k = if params.top_k >= logprobs.len() {
        0
    } else {
        params.top_k
    };
    if top_k == 0 && params.top_p >= 1.0 {
        // Inverse CDF over the whole vocabulary in index order: no sort needed.
        // The probabilities once (the f64 `exp` of the whole vocabulary was a few % of a decode step when
        // computed for the total and again for the running sum); the same sums in the same order.
        let probs: Vec<f64> = logprobs.iter().map(|&l| (l as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        let target = u * total;
        let mut acc = 0.0;
        for (i, &p) in probs.iter().enumerate() {
            acc += p;
            if acc > target {
                return (i as u32, 0.0);
            }
        }
        return (argmax(logprobs), 0.0);
    }
    let order = most_likely_first(logprobs, top_k);
    let probs: Vec<f64> = order
        .iter()
        .map(|&i| (logprobs[i as usize] as f64).exp())
        .collect();
    let mut keep = probs.len();
    if params.top_p < 1.0 {
        let total: f64 = probs.iter().sum();
        let mut acc = 0.0;
        // A mass within `TOP_P_SLACK` of `top_p` reaches it: tied tokens whose mass is exactly `p` (four of
        // five equal tokens at 0.8) sum to 0.7999999999999999 in f64 and would keep one token more.
        let reach = params.top_p - TOP_P_SLACK;
        for (n, p) in probs.iter().enumerate() {
            acc += p / total;
            if acc >= reach {
                keep = n + 1;
                break;
            }
        }
    }
    let total: f64 = probs[..keep].iter().sum();
    let target = u * total;
    let mut acc = 0.0;
    for n in 0..keep {
        acc += probs[n];
        if acc > target {
            return (order[n], total.ln());
        }
    }
    (order[0], total.ln())
}

/// The ids of the `top_k` most likely tokens and of every token tied with the k-th (all of them for 0),
/// most likely first, ties by smaller id: the order of `logprobs[b].total_cmp(&logprobs[a]).then(a.cmp(&b))`,
/// fully determined.
///
/// Sorted as one `u64` per token, the log-prob's bits mapped to an integer in `total_cmp`'s order and
/// inverted above the id, instead of by that comparator, which reads two log-probs through their ids in
/// every comparison; with `top_k` the k smallest keys are selected first and only they are sorted. The keys
/// are distinct (the id is part of each), so any sort gives the one order. On a 49152-token row (Zen 4,
/// medians of 50 calls): 1.71 -> 0.54 ms for the whole order (top-p), 1.67 -> 0.07 ms for the first 50
/// (top-k): the comparator's sort cost a 64-row decode step of SmolLM2 about 55 ms of CPU time.
pub fn most_likely_first(logprobs: &[f32], top_k: usize) -> Vec<u32> {
    let mut keys: Vec<u64> = logprobs
        .iter()
        .enumerate()
        .map(|(id, &lp)| (u64::from(!total_order_bits(lp)) << 32) | id as u64)
        .collect();
    if top_k > 0 && top_k < keys.len() {
        keys.select_nth_unstable(top_k - 1);
        // Tokens tied with the k-th most likely stay, as HF's and vLLM's top-k keep them (their mask is
        // "below the k-th value"): which of equal tokens to drop would otherwise be decided by id.
        let bound = keys[top_k - 1] >> 32;
        keys.retain(|&key| key >> 32 <= bound);
    }
    keys.sort_unstable();
    keys.into_iter().map(|key| key as u32).collect()
}

/// `x`'s bits as an unsigned integer that orders as [`f32::total_cmp`] orders the floats (the same
/// transformation `total_cmp` makes, then the sign bit flipped so that unsigned order is signed order).
fn total_order_bits(x: f32) -> u32 {
    let bits = x.to_bits() as i32;
    let ordered = bits ^ (((bits >> 31) as u32) >> 1) as i32;
    (ordered as u32) ^ 0x8000_0000
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order the sampler used to compute with a comparator (the definition).
    fn by_comparator(logprobs: &[f32], top_k: usize) -> Vec<u32> {
        let mut order: Vec<u32> = (0..logprobs.len() as u32).collect();
        order.sort_unstable_by(|&a, &b| {
            logprobs[b as usize]
                .total_cmp(&logprobs[a as usize])
                .then(a.cmp(&b))
        });
        if top_k > 0 && top_k < order.len() {
            let kth = logprobs[order[top_k - 1] as usize];
            let tied = order[top_k..]
                .iter()
                .take_while(|&&i| logprobs[i as usize].total_cmp(&kth).is_eq())
                .count();
            order.truncate(top_k + tied);
        }
        order
    }

    #[test]
    fn keys_sort_as_the_comparator_with_ties_signed_zeros_and_non_finite_values() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let specials = [
            0.0f32,
            -0.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            -f32::NAN,
            -1.5,
        ];
        for len in [1usize, 2, 7, 100, 3000] {
            let row: Vec<f32> = (0..len)
                .map(|_| match next() % 5 {
                    // Few distinct values, so ties are common.
                    0 => -((next() % 8) as f32),
                    1 => specials[(next() % specials.len() as u64) as usize],
                    _ => -((next() % 1_000_000) as f32) * 1e-4,
                })
                .collect();
            for top_k in [0, 1, 5, len.saturating_sub(1), len, len + 3] {
                assert_eq!(
                    most_likely_first(&row, top_k),
                    by_comparator(&row, top_k),
                    "len {len} top_k {top_k}"
                );
            }
        }
    }

    /// Tied tokens whose mass reaches `top_p` exactly are cut at the smallest set whose mass reaches `p`, for
    /// `p` as the config writes it: 4 of 5 equal tokens at 0.8 (held as f32, 0.8 read 0.800000012 and kept
    /// all 5), 3 of 10 at 0.3, 3 of 5 at 0.6 (each fails without the f64 or without the slack).
    #[test]
    fn top_p_cuts_tied_tokens_at_the_written_mass() {
        for (vocab, top_p, kept) in [
            (5usize, 0.8, 4usize),
            (10, 0.3, 3),
            (5, 0.6, 3),
            (4, 0.5, 2),
        ] {
            let logprobs = vec![-(vocab as f32).ln(); vocab];
            let params = SamplingParams {
                top_p,
                ..SamplingParams::default()
            };
            let (_, log_mass) = sample_with_kept_mass(&logprobs, &params, &mut sequence_rng(1, 0));
            let counted = (log_mass.exp() * vocab as f64).round() as usize;
            assert_eq!(counted, kept, "{vocab} tied tokens, top_p {top_p}");
        }
    }

    #[test]
    fn total_order_bits_orders_as_total_cmp() {
        let xs = [
            f32::NEG_INFINITY,
            -1e30,
            -1.0,
            -1e-45,
            -0.0,
            0.0,
            1e-45,
            2.0,
            f32::INFINITY,
            f32::NAN,
        ];
        for w in xs.windows(2) {
            assert!(
                total_order_bits(w[0]) < total_order_bits(w[1]),
                "{} < {}",
                w[0],
                w[1]
            );
        }
        assert!(total_order_bits(-f32::NAN) < total_order_bits(f32::NEG_INFINITY));
    }

    /// A `top_k` of the whole vocabulary is off: the same draws as without it and a kept-mass log of
    /// exactly 0 (the processed record is then the full one's bits), as vLLM reads it.
    #[test]
    fn a_top_k_of_the_whole_vocabulary_is_off() {
        let logits = [0.3f32, -1.2, 2.0, 0.0, -0.4];
        let norm = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        let logprobs: Vec<f32> = logits.iter().map(|l| l - norm).collect();
        for k in [5, 6, usize::MAX] {
            for seed in 0..50 {
                let off = SamplingParams::default();
                let all = SamplingParams {
                    top_k: k,
                    ..SamplingParams::default()
                };
                let a = sample_with_kept_mass(&logprobs, &off, &mut sequence_rng(seed, 3));
                let b = sample_with_kept_mass(&logprobs, &all, &mut sequence_rng(seed, 3));
                assert_eq!(a, b, "top_k {k}, seed {seed}");
                assert_eq!(b.1.to_bits(), 0, "top_k {k}, seed {seed}");
            }
        }
        // One below the vocabulary still filters.
        let four = SamplingParams {
            top_k: 4,
            ..SamplingParams::default()
        };
        let (_, kept) = sample_with_kept_mass(&logprobs, &four, &mut sequence_rng(0, 0));
        assert!(kept < 0.0, "{kept}");
    }
}
