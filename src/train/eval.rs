//! Held-out evaluation: greedy pass@1 and sampled mean@k, in a given precision.

use std::collections::BTreeMap;

use super::config::{EvalConfig, Precision};
use crate::model::{Decoder, Tokenizer};
use crate::quant::QuantConfig;
use crate::rollout::{generate, SamplingParams};
use crate::tasks::verify::{score, VerifyConfig};
use crate::tasks::Example;

/// Accuracy of `model` (plain device) on `examples` with its weights in `precision`.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    model: &Decoder,
    precision: Precision,
    tok: &Tokenizer,
    examples: &[Example],
    eos: u32,
    cfg: &EvalConfig,
    verify: &VerifyConfig,
    seed: u64,
) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut m = model.clone();
    match precision.0 {
        Some(s) => {
            m.quantize(&QuantConfig::new(s))
                .map_err(anyhow::Error::msg)?;
        }
        None => m.dequantize(),
    }
    let prompts: Vec<Vec<u32>> = examples
        .iter()
        .map(|e| tok.encode(&e.prompt))
        .collect::<anyhow::Result<_>>()?;
    let accuracy = |samples: usize, temperature: f32| -> anyhow::Result<(f64, f64)> {
        let p = SamplingParams {
            temperature,
            max_new_tokens: cfg.max_new_tokens,
            seed,
            stop_token_ids: vec![eos],
            ..SamplingParams::default()
        };
        let out = generate(&m, &prompts, samples, &p, Some(tok));
        let (mut correct, mut len) = (0usize, 0usize);
        for r in 0..out.ids.len() {
            let resp = out.response(r);
            len += resp.len();
            let text = tok.decode(resp.strip_suffix(&[eos]).unwrap_or(resp))?;
            correct += usize::from(score(&text, &examples[r / samples].answer, verify).correct);
        }
        let n = out.ids.len().max(1) as f64;
        Ok((correct as f64 / n, len as f64 / n))
    };
    let tag = precision.to_string();
    let mut metrics = BTreeMap::new();
    let (greedy, len) = accuracy(1, 0.0)?;
    metrics.insert(format!("eval/{tag}/pass@1_greedy"), greedy);
    metrics.insert(format!("eval/{tag}/response_length"), len);
    if cfg.k > 0 {
        let (mean, _) = accuracy(cfg.k, cfg.temperature)?;
        metrics.insert(format!("eval/{tag}/mean@{}", cfg.k), mean);
    }
    Ok(metrics)
}
