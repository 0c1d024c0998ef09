//! Held-out evaluation: greedy pass@1 and sampled mean@k and pass@k, in a given precision.

use std::collections::BTreeMap;

use super::config::{EvalConfig, Precision};
use crate::model::{Decoder, EndTokens, Tokenizer};
use crate::rollout::{generate, FinishReason, SamplingParams};
use crate::tasks::verify::{score_response, VerifyConfig};
use crate::tasks::Example;

/// One evaluation: the metrics and which problems the greedy answer got right (for paired comparisons).
#[derive(Debug, Clone)]
pub struct Evaluation {
    pub metrics: BTreeMap<String, f64>,
    /// Greedy outcome per example, in `examples` order.
    pub greedy_correct: Vec<bool>,
}

/// The keys that size an evaluation, which a too-large one is refused by.
pub(super) const EVAL_SIZE_KEYS: crate::rollout::RolloutInputs = crate::rollout::RolloutInputs {
    rows: "eval.problems / eval.k",
    reach: "eval.max_new_tokens",
};
/// What a held-out prompt too long for the model is called in the error.
pub(super) const HELD_OUT: &str = "a held-out problem";

/// [`crate::rollout::check_prompts_size`] for `rows` rows of `examples`' prompts (`prompts`, their
/// encodings) and `new` tokens each: one too long for the model's positions is named by its question and
/// `set` (a training prompt, a held-out problem), which the keys in `what` alone do not say.
pub(super) fn check_example_prompts(
    config: &crate::model::ModelConfig,
    (what, rows): (crate::rollout::RolloutInputs, usize),
    (examples, prompts): (&[Example], &[Vec<u32>]),
    new: usize,
    set: &str,
) -> anyhow::Result<()> {
    crate::rollout::check_prompts_size(config, what, rows, prompts, new, |i| {
        format!(
            "{set}: {}",
            crate::rollout::shown_question(&examples[i].question)
        )
    })
}

/// Accuracy of `model` (plain device) on `examples` with its weights in `precision`; responses end at
/// `end`'s tokens and at `stop_strings` (`rollout.stop`'s, so that held-out answers end as the rollouts'
/// do).
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    model: &Decoder,
    precision: Precision,
    tok: &Tokenizer,
    examples: &[Example],
    end: &EndTokens,
    stop_strings: &[String],
    cfg: &EvalConfig,
    verify: &VerifyConfig,
    seed: u64,
) -> anyhow::Result<Evaluation> {
    let mut m = model.clone();
    if m.precision() != precision {
        // The model's own packed version is the current weight version: only another precision quantizes.
        m.set_precision(precision)?;
    }
    let prompts: Vec<Vec<u32>> = examples
        .iter()
        .map(|e| tok.encode_prompt(&e.prompt, e.with_bos))
        .collect::<anyhow::Result<_>>()?;
    check_example_prompts(
        &m.config,
        (EVAL_SIZE_KEYS, prompts.len().saturating_mul(cfg.k.max(1))),
        (examples, &prompts),
        cfg.max_new_tokens,
        HELD_OUT,
    )?;
    // Per sample: correct or not; and the mean response length. `(temperature, top_p, top_k)`.
    let accuracy = |samples: usize,
                    (temperature, top_p, top_k): (f32, f64, usize)|
     -> anyhow::Result<(Vec<bool>, f64)> {
        let p = SamplingParams {
            temperature,
            top_p,
            top_k,
            max_new_tokens: cfg.max_new_tokens,
            seed,
            stop_token_ids: end.stops().to_vec(),
            stop_strings: stop_strings.to_vec(),
            ..SamplingParams::default()
        };
        let out = generate(&m, &prompts, samples, &p, Some(tok));
        out.ensure_finite()
            .map_err(|e| anyhow::anyhow!("evaluation in {precision}: {e}"))?;
        let mut correct = Vec::with_capacity(out.ids.len());
        let mut len = 0usize;
        for r in 0..out.ids.len() {
            let resp = out.response(r);
            len += resp.len();
            let text = tok.decode_without_special(end.strip(resp))?;
            let cut_off = out.finish_reasons[r] == FinishReason::Length;
            correct.push(
                score_response(&text, cut_off, &examples[r / samples].answer, verify).correct,
            );
        }
        Ok((correct, len as f64 / out.ids.len().max(1) as f64))
    };
    let mean = super::paired::accuracy;
    let tag = precision.to_string();
    let mut metrics = BTreeMap::new();
    let (greedy_correct, len) = accuracy(1, (0.0, 1.0, 0))?;
    metrics.insert(format!("eval/{tag}/pass@1_greedy"), mean(&greedy_correct));
    metrics.insert(format!("eval/{tag}/response_length"), len);
    if cfg.k > 0 {
        let (sampled, _) = accuracy(cfg.k, (cfg.temperature, cfg.top_p, cfg.top_k))?;
        metrics.insert(format!("eval/{tag}/mean@{}", cfg.k), mean(&sampled));
        metrics.insert(
            format!("eval/{tag}/pass@{}", cfg.k),
            pass_at_k(&sampled, cfg.k),
        );
    }
    Ok(Evaluation {
        metrics,
        greedy_correct,
    })
}

/// The fraction of problems with at least one correct answer among their `k` samples (`outcomes` problem by
/// problem, `k` each): pass@k, which with exactly `k` samples per problem is Chen et al.'s unbiased
/// estimator `1 - C(n - c, k) / C(n, k)` at `n = k`.
pub fn pass_at_k(outcomes: &[bool], k: usize) -> f64 {
    let problems = outcomes.chunks(k.max(1));
    let n = problems.len();
    let solved = problems.filter(|p| p.iter().any(|&c| c)).count();
    solved as f64 / n.max(1) as f64
}

#[cfg(test)]
mod tests {
    /// Problems of 2 samples: (0, 1), (0, 0), (0, 0), (1, 1): 2 of 4 solved at least once; of 4 samples: (0 1 0
    /// 0), (0 0 1 1): both.
    #[test]
    fn pass_at_k_counts_problems_with_a_correct_sample() {
        let outcomes = [false, true, false, false, false, false, true, true];
        assert_eq!(super::pass_at_k(&outcomes, 2), 0.5);
        assert_eq!(super::pass_at_k(&outcomes, 4), 1.0);
        assert_eq!(super::pass_at_k(&[], 4), 0.0);
    }
}
