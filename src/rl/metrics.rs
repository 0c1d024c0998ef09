//! The mismatch and stability metrics of docs/metrics.md, under verl's names so that curves compare with
//! published runs. They are diagnostics, computed on the host in f64 from flat row-major `[B, T]` copies of
//! the batch (`values[b * row_len + t]`) and a response mask of the same layout.
//!
//! Means are over response tokens unless said otherwise; per-sequence statistics skip rows without response
//! tokens. Where verl clamps a log-ratio to +-20 before `exp`, so do we.

use std::collections::BTreeMap;

use super::RlError;

/// Metric names, so that a typo is a compile error rather than a missing curve.
pub mod names {
    pub const KL: &str = "rollout_corr/kl";
    pub const K3_KL: &str = "rollout_corr/k3_kl";
    pub const CHI2_TOKEN: &str = "rollout_corr/chi2_token";
    pub const CHI2_SEQ: &str = "rollout_corr/chi2_seq";
    pub const PPL_RATIO: &str = "rollout_corr/ppl_ratio";
    pub const TRAINING_PPL: &str = "rollout_corr/training_ppl";
    pub const ROLLOUT_PPL: &str = "rollout_corr/rollout_ppl";
    pub const LOG_PPL_DIFF: &str = "rollout_corr/log_ppl_diff";
    pub const PROBS_DIFF_MAX: &str = "training/rollout_probs_diff_max";
    pub const PROBS_DIFF_MEAN: &str = "training/rollout_probs_diff_mean";
    pub const PROBS_DIFF_STD: &str = "training/rollout_probs_diff_std";
    pub const PROBS_PEARSON: &str = "training/rollout_actor_probs_pearson_corr";
    pub const ENTROPY: &str = "actor/entropy";
    pub const RESPONSE_LENGTH_MEAN: &str = "response_length/mean";
    pub const RESPONSE_LENGTH_MAX: &str = "response_length/max";
    pub const RESPONSE_LENGTH_MIN: &str = "response_length/min";
    pub const RESPONSE_LENGTH_CLIP_RATIO: &str = "response_length/clip_ratio";
    pub const REPETITION_FRAC: &str = "error_tokens/repetition_frac";
    pub const LOW_PROB_FRAC: &str = "error_tokens/low_prob_frac";
    pub const RATIO_FRAC: &str = "error_tokens/ratio_frac";
    pub const ANY_ERROR_FRAC: &str = "error_tokens/any_frac";
    pub const WORST_RESPONSE_ERROR_FRAC: &str = "error_tokens/worst_response_frac";
    /// The union of all three criteria under its name before the criteria were reported apart: the same
    /// quantity as [`ANY_ERROR_FRAC`], still read from old logs by the report and plot writers. (In those
    /// logs `error_tokens/low_prob_frac` also counted the ratio criterion.)
    pub const LEGACY_ERROR_TOKEN_FRAC: &str = "error_tokens/frac";
    pub const ROUTING_DISAGREEMENT: &str = "moe/routing_disagreement_frac";
    /// On every held-out evaluation row: [`crate::tasks::questions_fingerprint`] of the problems it was
    /// evaluated on (logs from before 2026-12-05 have none).
    pub const EVAL_QUESTIONS_FINGERPRINT: &str = "eval/questions_fingerprint";
    /// On every held-out evaluation row: [`crate::tasks::Task::problems_fingerprint`], the questions with
    /// their gold answers (logs from before 2026-12-07 have none).
    pub const EVAL_PROBLEMS_FINGERPRINT: &str = "eval/problems_fingerprint";
    /// On every held-out evaluation row: the strings its responses stopped at besides the end tokens
    /// (`rollout.stop`; logs from before 2026-12-06 have none, and stopped at none).
    pub const EVAL_STOP_STRINGS: &str = "eval/stop_strings";
    /// On every held-out evaluation row: [`crate::tasks::verify::VERIFIER_VERSION`], the verifier code that
    /// judged it (logs from before 2026-12-07 have none: version 1).
    pub const EVAL_VERIFIER_VERSION: &str = "eval/verifier_version";
}

/// verl's bound on log-ratios before `exp`.
const LOG_RATIO_BOUND: f64 = 20.0;

/// Checks that the flat arrays describe the same `[B, row_len]` batch.
fn check_batch(lens: &[(&str, usize)], mask: &[bool], row_len: usize) -> Result<usize, RlError> {
    if row_len == 0 || !mask.len().is_multiple_of(row_len) {
        return Err(RlError::Input(format!(
            "mask of {} values is not a whole number of rows of {row_len}",
            mask.len()
        )));
    }
    for (name, len) in lens {
        if *len != mask.len() {
            return Err(RlError::Input(format!(
                "`{name}` has {len} values, the mask {}",
                mask.len()
            )));
        }
    }
    Ok(mask.len() / row_len)
}

/// The mean of `values`, summed in order in f64 (NaN when there are none).
pub fn mean(values: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = values
        .into_iter()
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        sum / n as f64
    }
}

/// Bessel-corrected standard deviation (`torch.std`, what verl logs); 0 for fewer than two values.
fn sample_std(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let m = mean(values.iter().copied());
    let ss: f64 = values.iter().map(|v| (v - m).powi(2)).sum();
    (ss / (values.len() - 1) as f64).sqrt()
}

/// Pearson correlation of two equally long samples; NaN when either is constant (undefined).
pub fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let (mx, my) = (mean(x.iter().copied()), mean(y.iter().copied()));
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx).powi(2);
        syy += (b - my).powi(2);
    }
    if sxx == 0.0 || syy == 0.0 {
        f64::NAN
    } else {
        sxy / (sxx * syy).sqrt()
    }
}

/// Mean of `values` over the positions where `mask` is true (NaN when there are none).
pub fn masked_mean(values: &[f32], mask: &[bool]) -> f64 {
    mean(
        values
            .iter()
            .zip(mask)
            .filter(|(_, &m)| m)
            .map(|(&v, _)| f64::from(v)),
    )
}

/// `rollout_corr/*` and `training/rollout_*` between the learner at the start of the step (`lp_old`) and the
/// sampler (`lp_roll`), with `rho = exp(lp_old - lp_roll)` and `p = exp(lp)`:
///
/// - `rollout_corr/kl` = mean(lp_roll - lp_old), an estimate of KL(pi_roll || pi_old);
/// - `rollout_corr/k3_kl` = mean(rho - log rho - 1), the low-variance estimate of the same KL;
/// - `rollout_corr/chi2_token` = mean(rho^2) - 1; `rollout_corr/chi2_seq` = mean_seq((prod rho)^2) - 1;
/// - `rollout_corr/ppl_ratio` = mean over sequences of `PPL_old / PPL_roll = exp(mean_t lp_roll - mean_t lp_old)`
///   (per-sequence ratio first, as verl), with `training_ppl`, `rollout_ppl` and `log_ppl_diff`;
/// - `training/rollout_probs_diff_{max,mean,std}` over `|p_old - p_roll|` (std Bessel-corrected, as torch.std);
/// - `training/rollout_actor_probs_pearson_corr` between `p_old` and `p_roll` (NaN if either is constant).
pub fn rollout_mismatch_metrics(
    lp_old: &[f32],
    lp_roll: &[f32],
    mask: &[bool],
    row_len: usize,
) -> Result<BTreeMap<String, f64>, RlError> {
    let rows = check_batch(
        &[("lp_old", lp_old.len()), ("lp_roll", lp_roll.len())],
        mask,
        row_len,
    )?;
    let tokens: Vec<(f64, f64)> = (0..mask.len())
        .filter(|&i| mask[i])
        .map(|i| (f64::from(lp_old[i]), f64::from(lp_roll[i])))
        .collect();
    if tokens.is_empty() {
        return Err(RlError::Input("no response tokens in the mask".into()));
    }
    let bounded_rho =
        |old: f64, roll: f64| (old - roll).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp();

    let mut m = BTreeMap::new();
    m.insert(names::KL.into(), mean(tokens.iter().map(|(o, r)| r - o)));
    m.insert(
        names::K3_KL.into(),
        mean(tokens.iter().map(|(o, r)| (o - r).exp() - (o - r) - 1.0)),
    );
    m.insert(
        names::CHI2_TOKEN.into(),
        mean(tokens.iter().map(|&(o, r)| bounded_rho(o, r).powi(2))) - 1.0,
    );

    // Per-sequence statistics.
    let (mut chi2_seq, mut ppl_ratio, mut ppl_old, mut ppl_roll, mut log_ppl_diff) =
        (vec![], vec![], vec![], vec![], vec![]);
    for b in 0..rows {
        let row: Vec<(f64, f64)> = (b * row_len..(b + 1) * row_len)
            .filter(|&i| mask[i])
            .map(|i| (f64::from(lp_old[i]), f64::from(lp_roll[i])))
            .collect();
        if row.is_empty() {
            continue;
        }
        let n = row.len() as f64;
        let mean_old = row.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_roll = row.iter().map(|p| p.1).sum::<f64>() / n;
        let log_rho_sum: f64 = row.iter().map(|(o, r)| o - r).sum();
        chi2_seq.push((2.0 * log_rho_sum.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).exp());
        ppl_old.push((-mean_old).exp());
        ppl_roll.push((-mean_roll).exp());
        log_ppl_diff.push(mean_roll - mean_old);
        ppl_ratio.push((mean_roll - mean_old).exp());
    }
    m.insert(names::CHI2_SEQ.into(), mean(chi2_seq) - 1.0);
    m.insert(names::PPL_RATIO.into(), mean(ppl_ratio));
    m.insert(names::TRAINING_PPL.into(), mean(ppl_old));
    m.insert(names::ROLLOUT_PPL.into(), mean(ppl_roll));
    m.insert(names::LOG_PPL_DIFF.into(), mean(log_ppl_diff));

    let (p_old, p_roll): (Vec<f64>, Vec<f64>) =
        tokens.iter().map(|(o, r)| (o.exp(), r.exp())).unzip();
    let diffs: Vec<f64> = p_old
        .iter()
        .zip(&p_roll)
        .map(|(a, b)| (a - b).abs())
        .collect();
    m.insert(
        names::PROBS_DIFF_MAX.into(),
        diffs.iter().copied().fold(0.0, f64::max),
    );
    m.insert(names::PROBS_DIFF_MEAN.into(), mean(diffs.iter().copied()));
    m.insert(names::PROBS_DIFF_STD.into(), sample_std(&diffs));
    m.insert(names::PROBS_PEARSON.into(), pearson(&p_old, &p_roll));
    Ok(m)
}

/// `response_length/{mean,max,min}` and `response_length/clip_ratio`, the fraction of responses that reached
/// `max_len` (verl's `eq(length, max)`: those cut off, and those whose end token was the last one allowed).
pub fn response_length_metrics(lengths: &[usize], max_len: usize) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    m.insert(
        names::RESPONSE_LENGTH_MEAN.into(),
        mean(lengths.iter().map(|&l| l as f64)),
    );
    m.insert(
        names::RESPONSE_LENGTH_MAX.into(),
        lengths.iter().max().map_or(f64::NAN, |&l| l as f64),
    );
    m.insert(
        names::RESPONSE_LENGTH_MIN.into(),
        lengths.iter().min().map_or(f64::NAN, |&l| l as f64),
    );
    m.insert(
        names::RESPONSE_LENGTH_CLIP_RATIO.into(),
        mean(lengths.iter().map(|&l| f64::from(u8::from(l >= max_len)))),
    );
    m
}

/// What counts as a repetition loop: a pattern of 1..=`max_pattern` tokens repeated at least `min_repeats` times
/// back to back ("to to to", "engine to engine to engine to"), over a stretch of at least `min_span` tokens.
///
/// `min_span` exists for fine-grained tokenizers: with one token per character, `####` or `111` are ordinary
/// text, not a loop, while 1-4 BPE tokens repeated 3 times already are. Set it near the number of tokens a
/// BPE tokenizer would need for 3 words (12 for characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoopRule {
    pub max_pattern: usize,
    pub min_repeats: usize,
    pub min_span: usize,
}

impl Default for LoopRule {
    /// 1-4 token patterns repeated 3 or more times (docs/metrics.md, "Error tokens"), no span floor.
    fn default() -> Self {
        Self {
            max_pattern: 4,
            min_repeats: 3,
            min_span: 0,
        }
    }
}

/// Marks the tokens of `tokens` that sit inside a repetition loop. For each pattern length `n`, a maximal
/// stretch where `tokens[i] == tokens[i + n]` holds is `n`-periodic; if it spans `min_repeats * n` tokens or
/// more, every token in it belongs to some `n`-token pattern repeated `min_repeats` times in a row (the union
/// over start offsets covers the stretch), so the whole stretch is marked. Linear in `len * max_pattern`.
pub fn repetition_loop_mask(tokens: &[u32], rule: LoopRule) -> Vec<bool> {
    let len = tokens.len();
    if rule.min_repeats <= 1 && rule.max_pattern >= 1 && rule.min_span <= 1 {
        return vec![true; len]; // every token is a pattern "repeated" once
    }
    let mut marked = vec![false; len];
    for n in 1..=rule.max_pattern {
        // Saturating: a `min_repeats` near usize::MAX (no loop can be that long) overflowed here.
        let need = n.saturating_mul(rule.min_repeats).max(rule.min_span);
        let mut start = 0;
        while start + n < len {
            if tokens[start] != tokens[start + n] {
                start += 1;
                continue;
            }
            let mut end = start; // the stretch is tokens[start .. end + n]
            while end + n < len && tokens[end] == tokens[end + n] {
                end += 1;
            }
            if end + n - start >= need {
                marked[start..end + n].iter_mut().for_each(|m| *m = true);
            }
            start = end + 1;
        }
    }
    marked
}

/// The absolute criterion: a token the learner gives probability below this is an error token.
pub const LOW_PROB_THRESHOLD: f64 = 1e-4;
/// The ratio criterion: a token the sampler was more than this many times as confident in as the learner is
/// an error token.
pub const RATIO_THRESHOLD: f64 = 20.0;

/// Absolute low-probability test (docs/metrics.md, "Error tokens"): `lp_old < ln(1e-4)`, the learner finds
/// the token nearly impossible. It flags the model's own unlikely choices and does not need any mismatch:
/// an f32 sampler against the f32 learner still has such tokens at `T = 1`.
pub fn is_low_probability(lp_old: f32) -> bool {
    f64::from(lp_old) < LOW_PROB_THRESHOLD.ln()
}

/// Ratio test (docs/metrics.md, "Error tokens"): `lp_old - lp_roll < -ln(20)`, the sampler was over 20x
/// more confident than the learner. Only a rollout/learner mismatch produces it (it never fires when the
/// two log-probs are equal): these are the tokens whose extreme importance ratios dominate a gradient.
pub fn is_ratio_error(lp_old: f32, lp_roll: f32) -> bool {
    f64::from(lp_old) - f64::from(lp_roll) < -RATIO_THRESHOLD.ln()
}

/// Error-token statistics of a batch: each criterion apart, so that a fraction says what it measures (the
/// aligned forward has no ratio errors, yet its repetition loops and low-probability tokens remain), and
/// their union.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorTokenReport {
    /// `error_tokens/repetition_frac`: response tokens inside a repetition loop ([`repetition_loop_mask`]).
    pub repetition_frac: f64,
    /// `error_tokens/low_prob_frac`: response tokens with `p_old < 1e-4` ([`is_low_probability`]).
    pub low_prob_frac: f64,
    /// `error_tokens/ratio_frac`: response tokens with `p_old / p_roll < 1/20` ([`is_ratio_error`]).
    pub ratio_frac: f64,
    /// `error_tokens/any_frac`: response tokens that meet at least one of the three criteria.
    pub any_frac: f64,
    /// The row with the highest fraction of error tokens (any criterion; first on ties; `None` if no row has
    /// any), to print as an example in the logs.
    pub worst_row: Option<usize>,
    /// `error_tokens/worst_response_frac`: that row's fraction (0 when there is none).
    pub worst_row_frac: f64,
    /// The criteria each response token of that row meets, in order (empty when there is none): the
    /// example the logs show ([`crate::train`] writes it to `worst_responses.jsonl`).
    pub worst_row_tokens: Vec<TokenErrors>,
}

/// The error-token criteria one response token meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenErrors {
    pub repetition: bool,
    pub low_prob: bool,
    pub ratio: bool,
}

impl TokenErrors {
    /// Whether it meets any criterion.
    pub fn any(self) -> bool {
        self.repetition || self.low_prob || self.ratio
    }

    /// The names of the criteria it meets (`ratio`, `low_prob`, `repetition`), as the metric names say them.
    pub fn names(self) -> Vec<&'static str> {
        [
            (self.ratio, "ratio"),
            (self.low_prob, "low_prob"),
            (self.repetition, "repetition"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }
}

impl ErrorTokenReport {
    /// Name -> value.
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        [
            (names::REPETITION_FRAC, self.repetition_frac),
            (names::LOW_PROB_FRAC, self.low_prob_frac),
            (names::RATIO_FRAC, self.ratio_frac),
            (names::ANY_ERROR_FRAC, self.any_frac),
            (names::WORST_RESPONSE_ERROR_FRAC, self.worst_row_frac),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

/// Token counts of the three criteria and their union, summed over rows.
#[derive(Debug, Clone, Copy, Default)]
struct ErrorCounts {
    tokens: usize,
    repetition: usize,
    low_prob: usize,
    ratio: usize,
    any: usize,
}

/// Repetition loops, low-probability tokens and ratio errors over the response tokens of a `[B, row_len]`
/// batch (`ids` the token ids; each row's response is its masked positions, in order).
pub fn error_token_metrics(
    ids: &[u32],
    lp_old: &[f32],
    lp_roll: &[f32],
    mask: &[bool],
    row_len: usize,
    rule: LoopRule,
) -> Result<ErrorTokenReport, RlError> {
    let rows = check_batch(
        &[
            ("ids", ids.len()),
            ("lp_old", lp_old.len()),
            ("lp_roll", lp_roll.len()),
        ],
        mask,
        row_len,
    )?;
    let mut total = ErrorCounts::default();
    let (mut worst_row, mut worst_row_frac, mut worst_row_tokens) = (None, 0.0, Vec::new());
    for b in 0..rows {
        let positions: Vec<usize> = (b * row_len..(b + 1) * row_len)
            .filter(|&i| mask[i])
            .collect();
        if positions.is_empty() {
            continue;
        }
        let tokens: Vec<u32> = positions.iter().map(|&i| ids[i]).collect();
        let loops = repetition_loop_mask(&tokens, rule);
        let mut row = ErrorCounts {
            tokens: positions.len(),
            ..ErrorCounts::default()
        };
        let flags: Vec<TokenErrors> = positions
            .iter()
            .zip(&loops)
            .map(|(&i, &repetition)| TokenErrors {
                repetition,
                low_prob: is_low_probability(lp_old[i]),
                ratio: is_ratio_error(lp_old[i], lp_roll[i]),
            })
            .collect();
        for f in &flags {
            row.repetition += usize::from(f.repetition);
            row.low_prob += usize::from(f.low_prob);
            row.ratio += usize::from(f.ratio);
            row.any += usize::from(f.any());
        }
        let frac = row.any as f64 / row.tokens as f64;
        if row.any > 0 && frac > worst_row_frac {
            worst_row = Some(b);
            worst_row_frac = frac;
            worst_row_tokens = flags;
        }
        total.tokens += row.tokens;
        total.repetition += row.repetition;
        total.low_prob += row.low_prob;
        total.ratio += row.ratio;
        total.any += row.any;
    }
    if total.tokens == 0 {
        return Err(RlError::Input("no response tokens in the mask".into()));
    }
    let frac = |n: usize| n as f64 / total.tokens as f64;
    Ok(ErrorTokenReport {
        repetition_frac: frac(total.repetition),
        low_prob_frac: frac(total.low_prob),
        ratio_frac: frac(total.ratio),
        any_frac: frac(total.any),
        worst_row,
        worst_row_frac,
        worst_row_tokens,
    })
}

/// MoE routing decisions that differ between two forwards (rollout vs training), summable over rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoutingDisagreement {
    /// (token, layer) pairs whose expert sets differ.
    pub differing: usize,
    /// (token, layer) pairs compared.
    pub decisions: usize,
}

impl RoutingDisagreement {
    /// `moe/routing_disagreement_frac`; `None` when nothing was compared (a dense model).
    pub fn fraction(&self) -> Option<f64> {
        (self.decisions > 0).then(|| self.differing as f64 / self.decisions as f64)
    }
}

/// Sums two counts (e.g. over the rows of a batch).
impl std::ops::Add for RoutingDisagreement {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            differing: self.differing + other.differing,
            decisions: self.decisions + other.decisions,
        }
    }
}

/// Compares two routings given per layer as `Option<Vec<u32>>` (`None` for dense layers; otherwise the experts
/// of every token, token-major, `top_k` per token, as the decoder records them). A token's decision differs
/// when its *set* of experts differs: the order of the top-k slots (which near-ties can swap) does not change
/// which experts run.
pub fn routing_disagreement(
    rollout: &[Option<Vec<u32>>],
    training: &[Option<Vec<u32>>],
    top_k: usize,
) -> Result<RoutingDisagreement, RlError> {
    if rollout.len() != training.len() {
        return Err(RlError::Input(format!(
            "routings have {} and {} layers",
            rollout.len(),
            training.len()
        )));
    }
    if top_k == 0 {
        return Err(RlError::Input("top_k must be at least 1".into()));
    }
    let mut counts = RoutingDisagreement::default();
    for (layer, (a, b)) in rollout.iter().zip(training).enumerate() {
        match (a, b) {
            (None, None) => {}
            (Some(a), Some(b)) => {
                if a.len() != b.len() || a.len() % top_k != 0 {
                    return Err(RlError::Input(format!(
                        "layer {layer}: routings of {} and {} entries for top_k {top_k}",
                        a.len(),
                        b.len()
                    )));
                }
                for (x, y) in a.chunks(top_k).zip(b.chunks(top_k)) {
                    let (mut x, mut y) = (x.to_vec(), y.to_vec());
                    x.sort_unstable();
                    y.sort_unstable();
                    counts.differing += usize::from(x != y);
                    counts.decisions += 1;
                }
            }
            _ => {
                return Err(RlError::Input(format!(
                    "layer {layer} is MoE in one routing and dense in the other"
                )))
            }
        }
    }
    Ok(counts)
}
