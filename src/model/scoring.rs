//! Per-token log-probabilities of given sequences, the quantity every RL objective is built on.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};

use super::decoder::{Decoder, ForwardOutput};
use super::mlp::Routing;
use crate::rollout::rows;

/// `logprobs[b][t] = log_softmax(logits[b][t] / temperature)[ids[b][t + 1]]`, as a `[B, T - 1]` tensor
/// (differentiable). `ids` rows must be at least as long as the logits' `T` (extra ids are ignored).
pub fn next_token_logprobs_at(logits: Tensor<3>, ids: &[Vec<u32>], temperature: f32) -> Tensor<2> {
    let [b, t, _v] = logits.dims();
    let logits = if temperature == 1.0 {
        logits
    } else {
        logits / temperature as f64
    };
    // Normalise the whole contiguous tensor and slice afterwards: a strided view can take another reduction
    // path and round differently from the rollout's per-row normalisation.
    let lp = log_softmax(logits, 2).narrow(1, 0, t - 1);
    let targets: Vec<i64> = ids
        .iter()
        .flat_map(|row| row[1..t].iter().map(|&x| x as i64))
        .collect();
    let idx = Tensor::<3, Int>::from_data(TensorData::new(targets, [b, t - 1, 1]), &lp.device());
    lp.gather(2, idx).reshape([b, t - 1])
}

/// [`next_token_logprobs_at`] at temperature 1.
pub fn next_token_logprobs(logits: Tensor<3>, ids: &[Vec<u32>]) -> Tensor<2> {
    next_token_logprobs_at(logits, ids, 1.0)
}

/// Right-pads rows of different lengths to one batch (padding after the real tokens never influences them
/// in a causal model) and runs the full forward. Returns the output and the padded ids.
pub fn forward_ragged(
    model: &Decoder,
    seqs: &[Vec<u32>],
    replay: Option<&[Option<Routing>]>,
) -> (ForwardOutput, Vec<Vec<u32>>) {
    let t = seqs.iter().map(Vec::len).max().unwrap_or(0);
    let padded: Vec<Vec<u32>> = seqs
        .iter()
        .map(|s| {
            s.iter()
                .copied()
                .chain(std::iter::repeat_n(0, t - s.len()))
                .collect()
        })
        .collect();
    (model.forward(&padded, None, None, replay), padded)
}

/// Log-probs of the response tokens (`seqs[b][prompt_lens[b]..]`) under one full forward of each whole
/// sequence at `temperature`: the learner-side counterpart of what the rollout records.
pub fn response_logprobs(
    model: &Decoder,
    seqs: &[Vec<u32>],
    prompt_lens: &[usize],
    temperature: f32,
) -> Vec<Vec<f32>> {
    let (out, padded) = forward_ragged(model, seqs, None);
    let lp = rows(next_token_logprobs_at(out.logits, &padded, temperature));
    seqs.iter()
        .zip(prompt_lens)
        .zip(lp)
        .map(|((s, &p), row)| row[p - 1..s.len() - 1].to_vec())
        .collect()
}
