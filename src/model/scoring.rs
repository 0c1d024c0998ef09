//! Per-token log-probabilities of given sequences, the quantity every RL objective is built on.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use rayon::prelude::*;

use super::decoder::{Decoder, ForwardOutput};
use super::layers::Weights;
use super::mlp::Routing;
use crate::host::{rows, to_f32_vec};
use crate::ops::{det_matmul, deterministic, HEAD_CHUNK_ROWS};

/// In deterministic mode ([`crate::ops::deterministic`]) log-probs are computed by [`log_softmax_row`], one
/// fixed-order host routine shared by the rollout's sampler and the training forward, so that (with the
/// batch-invariant forward) the recorded and the re-scored log-probs of a token are bitwise equal; off, burn's
/// `log_softmax` on whole tensors (rounds differently for a `[B, T, V]` and a `[B, V]` tensor).
///
/// `ln(sum(exp(z - max z)))` plus `max z` of `z = row / temperature`: f32 division, the maximum, then
/// the sum of `exp` in f64 in index order. The one normaliser of deterministic mode.
fn log_normaliser(row: &[f32], temperature: f32) -> f64 {
    let z = |x: f32| {
        if temperature == 1.0 {
            x
        } else {
            x / temperature
        }
    };
    let max = row.iter().map(|&x| z(x)).fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (z(x) as f64 - max).exp()).sum();
    max + sum.ln()
}

/// The fixed-order log-softmax of one row at `temperature` (deterministic mode): element `i` is
/// `(z_i as f64 - log_normaliser) as f32` with `z = row / temperature` in f32.
pub fn log_softmax_row(row: &[f32], temperature: f32) -> Vec<f32> {
    log_softmax_with(row, temperature, log_normaliser(row, temperature))
}

/// [`log_softmax_row`] given the row's normaliser at `temperature`.
fn log_softmax_with(row: &[f32], temperature: f32, lse: f64) -> Vec<f32> {
    row.iter()
        .map(|&x| logprob_with(x, temperature, lse))
        .collect()
}

/// [`log_softmax_row`] and, with `entropy`, [`entropy_row`] of the same row: the bits of the two functions,
/// with the vocabulary-wide normaliser computed once where they share it (temperature 1, as RL rollouts
/// sample): a decode step that records entropy otherwise runs `exp` over the vocabulary four times per row.
pub fn log_softmax_and_entropy(
    row: &[f32],
    temperature: f32,
    entropy: bool,
) -> (Vec<f32>, Option<f32>) {
    let lse = log_normaliser(row, temperature);
    let h = entropy.then(|| {
        let lse_1 = if temperature == 1.0 {
            lse
        } else {
            log_normaliser(row, 1.0)
        };
        entropy_with(row, lse_1)
    });
    (log_softmax_with(row, temperature, lse), h)
}

/// `log_softmax_row(row, temperature)[target]` without the rest of the row.
pub fn log_softmax_at(row: &[f32], temperature: f32, target: usize) -> f32 {
    logprob_with(row[target], temperature, log_normaliser(row, temperature))
}

/// The log-prob of logit `x` in a row whose normaliser ([`log_normaliser`]) is `lse`.
fn logprob_with(x: f32, temperature: f32, lse: f64) -> f32 {
    let z = if temperature == 1.0 {
        x
    } else {
        x / temperature
    };
    (z as f64 - lse) as f32
}

/// `logprobs[b][t] = log_softmax(logits[b][t] / temperature)[ids[b][t + 1]]`, as a `[B, T - 1]` tensor
/// (differentiable). `ids` rows must be at least as long as the logits' `T` (extra ids are ignored).
/// In deterministic mode the values are [`log_softmax_at`]'s (bitwise what the rollout records) and the
/// gradient is that of burn's log-softmax (`exact + (lp - lp.detach())`).
pub fn next_token_logprobs_at(logits: Tensor<3>, ids: &[Vec<u32>], temperature: f32) -> Tensor<2> {
    let [b, t, v] = logits.dims();
    let exact = deterministic().then(|| {
        let host = to_f32_vec(logits.clone().detach());
        let vals: Vec<f32> = (0..b * (t - 1))
            .into_par_iter()
            .map(|r| {
                let (row, pos) = (r / (t - 1), r % (t - 1));
                let off = (row * t + pos) * v;
                log_softmax_at(&host[off..off + v], temperature, ids[row][pos + 1] as usize)
            })
            .collect();
        vals
    });
    let logits = at_temperature(logits, temperature);
    // Normalise the whole contiguous tensor and slice afterwards: a strided view can take another reduction
    // path and round differently from the rollout's per-row normalisation.
    let lp = log_softmax(logits, 2).narrow(1, 0, t - 1);
    let targets: Vec<i64> = ids
        .iter()
        .flat_map(|row| row[1..t].iter().map(|&x| x as i64))
        .collect();
    let device = lp.device();
    let idx = Tensor::<3, Int>::from_data(TensorData::new(targets, [b, t - 1, 1]), &device);
    let lp: Tensor<2> = lp.gather(2, idx).reshape([b, t - 1]);
    with_exact_values(lp, exact)
}

/// `lp[i] = log_softmax(logits[i] / temperature)[targets[i]]` for logits rows `[N, V]` (the positions that
/// carry a loss, gathered before the LM head), as an `[N]` tensor (differentiable). In deterministic mode the
/// values are [`log_softmax_at`]'s, bitwise what the rollout records and what [`next_token_logprobs_at`]
/// gives at the same positions; the gradient is that of burn's log-softmax on the `[N, V]` rows.
pub fn target_logprobs(logits: Tensor<2>, targets: &[u32], temperature: f32) -> Tensor<1> {
    let [n, v] = logits.dims();
    assert_eq!(n, targets.len(), "one target per logits row");
    let device = logits.device();
    let exact = deterministic().then(|| {
        let host = to_f32_vec(logits.clone().detach());
        (0..n)
            .into_par_iter()
            .map(|r| log_softmax_at(&host[r * v..(r + 1) * v], temperature, targets[r] as usize))
            .collect::<Vec<f32>>()
    });
    let idx: Vec<i64> = targets.iter().map(|&x| x as i64).collect();
    let idx = Tensor::<2, Int>::from_data(TensorData::new(idx, [n, 1]), &device);
    let lp: Tensor<1> = log_softmax(at_temperature(logits, temperature), 1)
        .gather(1, idx)
        .reshape([n]);
    with_exact_values(lp, exact)
}

/// What [`head_logprobs`] returns: the differentiable `[n]` log-probs and, when asked for, the entropy (at
/// temperature 1) of each row's distribution.
pub struct HeadLogprobs {
    pub logprobs: Tensor<1>,
    pub entropy: Option<Vec<f32>>,
}

/// `lp[i] = log_softmax(head(hidden[i]) / temperature)[targets[i]]` for hidden rows `[n, hidden]` (the
/// positions that carry a loss), the LM head fused with the log-softmax and the gather of the target:
/// logits exist only [`HEAD_CHUNK_ROWS`] rows at a time, in the forward and in the backward (which
/// recomputes them), never as an `[n, vocab]` tensor. The values are [`log_softmax_at`]'s on the LM head's
/// rows (the LM head is row-invariant in deterministic mode), so bitwise what the rollout records and what
/// [`target_logprobs`] gives; the gradient is the exact one, `(onehot - softmax) / temperature` per row,
/// through the head's weights and inputs. A quantized LM head under [`Weights::Packed`] takes
/// [`target_logprobs`] on the whole logits instead.
pub fn head_logprobs(
    model: &Decoder,
    hidden: Tensor<2>,
    weights: Weights,
    targets: &[u32],
    temperature: f32,
    with_entropy: bool,
) -> HeadLogprobs {
    let [n, _] = hidden.dims();
    assert_eq!(n, targets.len(), "one target per hidden row");
    // The logits in f32 whatever the activations' type, as [`Decoder::head`] computes them.
    let hidden = crate::ops::dtype::f32_of(hidden);
    let (w, transposed) = match &model.lm_head {
        Some(head) if head.quant.is_some() && weights == Weights::Packed => {
            let logits = model.head(hidden, weights);
            let entropy = with_entropy.then(|| {
                let v = logits.dims()[1];
                entropy_rows(&to_f32_vec(logits.clone().detach()), v)
            });
            let logprobs = target_logprobs(logits, targets, temperature);
            return HeadLogprobs { logprobs, entropy };
        }
        Some(head) => (head.weight.val(), false),
        None => (model.embed_tokens.val(), true),
    };
    let device = hidden.device();
    let (xd, wd) = (hidden.clone().detach(), w.clone().detach());
    let mut lp = Vec::with_capacity(n);
    let mut lse = Vec::with_capacity(n);
    let mut entropy = with_entropy.then(|| Vec::with_capacity(n));
    for c0 in (0..n).step_by(HEAD_CHUNK_ROWS) {
        let c1 = (c0 + HEAD_CHUNK_ROWS).min(n);
        let logits = det_matmul(xd.clone().narrow(0, c0, c1 - c0), wd.clone(), transposed);
        let v = logits.dims()[1];
        let host = to_f32_vec(logits);
        let rows: Vec<(f32, f32)> = host
            .par_chunks(v)
            .zip(&targets[c0..c1])
            .map(|(row, &t)| {
                let norm = log_normaliser(row, temperature);
                (
                    logprob_with(row[t as usize], temperature, norm),
                    norm as f32,
                )
            })
            .collect();
        for (l, z) in rows {
            lp.push(l);
            lse.push(z);
        }
        if let Some(e) = entropy.as_mut() {
            e.extend(entropy_rows(&host, v));
        }
    }
    let value = Tensor::<1>::from_data(TensorData::new(lp, [n]), &device);
    let lse = Tensor::<1>::from_data(TensorData::new(lse, [n]), &device);
    let logprobs = crate::ops::head_logprobs_with_gradient(
        hidden,
        w,
        transposed,
        lse,
        targets.to_vec(),
        temperature,
        value,
    );
    HeadLogprobs { logprobs, entropy }
}

/// `logits / temperature` (the logits themselves at temperature 1, with no division rounding them).
fn at_temperature<const D: usize>(logits: Tensor<D>, temperature: f32) -> Tensor<D> {
    if temperature == 1.0 {
        logits
    } else {
        logits / temperature as f64
    }
}

/// Deterministic mode's log-probs: the fixed-order host values `exact` (same shape as `lp`, row-major) with
/// the gradient of burn's `lp` (`exact + (lp - lp.detach())`); `lp` itself when there are none.
fn with_exact_values<const D: usize>(lp: Tensor<D>, exact: Option<Vec<f32>>) -> Tensor<D> {
    match exact {
        Some(vals) => {
            let exact = Tensor::<D>::from_data(TensorData::new(vals, lp.dims()), &lp.device());
            exact + (lp.clone() - lp.detach())
        }
        None => lp,
    }
}

/// The entropy `-sum_v p_v ln p_v` (at temperature 1) of each row of host logits `[rows, v]`
/// ([`entropy_row`]).
pub fn entropy_rows(logits: &[f32], v: usize) -> Vec<f32> {
    logits.par_chunks(v.max(1)).map(entropy_row).collect()
}

/// The entropy `-sum_v p_v ln p_v` (at temperature 1) of one row of logits, in one fixed order: the
/// normaliser of [`log_softmax_row`], then the sum in f64 in index order. The rollout and the training
/// forward both compute it with this function, so that equal logits give equal bits.
pub fn entropy_row(row: &[f32]) -> f32 {
    entropy_with(row, log_normaliser(row, 1.0))
}

/// [`entropy_row`] given the row's normaliser at temperature 1.
fn entropy_with(row: &[f32], lse: f64) -> f32 {
    let h: f64 = row
        .iter()
        .map(|&x| {
            let lp = x as f64 - lse;
            -lp.exp() * lp
        })
        .sum();
    h as f32
}

/// [`next_token_logprobs_at`] at temperature 1.
pub fn next_token_logprobs(logits: Tensor<3>, ids: &[Vec<u32>]) -> Tensor<2> {
    next_token_logprobs_at(logits, ids, 1.0)
}

/// Rows of different lengths right-padded with id 0 to the longest (each row's tokens start at slot 0;
/// padding after the real tokens never influences them in a causal model).
pub fn right_pad(seqs: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let t = seqs.iter().map(Vec::len).max().unwrap_or(0);
    seqs.iter()
        .map(|s| {
            s.iter()
                .copied()
                .chain(std::iter::repeat_n(0, t - s.len()))
                .collect()
        })
        .collect()
}

/// Right-pads rows of different lengths to one batch ([`right_pad`]) and runs the full forward with the
/// chosen weights. Returns the output and the padded ids.
pub fn forward_ragged(
    model: &Decoder,
    weights: Weights,
    seqs: &[Vec<u32>],
    replay: Option<&[Option<Routing>]>,
) -> (ForwardOutput, Vec<Vec<u32>>) {
    let padded = right_pad(seqs);
    (model.forward_as(weights, &padded, replay), padded)
}

/// Log-probs of the response tokens (`seqs[b][prompt_lens[b]..]`) under one full forward of each whole
/// sequence at `temperature`: the learner-side counterpart of what the rollout records.
pub fn response_logprobs(
    model: &Decoder,
    seqs: &[Vec<u32>],
    prompt_lens: &[usize],
    temperature: f32,
) -> Vec<Vec<f32>> {
    let (out, padded) = forward_ragged(model, Weights::Packed, seqs, None);
    let lp = rows(next_token_logprobs_at(out.logits, &padded, temperature));
    seqs.iter()
        .zip(prompt_lens)
        .zip(lp)
        .map(|((s, &p), row)| row[p - 1..s.len() - 1].to_vec())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Vec<f32> {
        (0..1000)
            .map(|i| ((i * 7919 % 1013) as f32 * 0.013).sin() * 9.0 - (i % 17) as f32)
            .collect()
    }

    #[test]
    fn log_softmax_and_entropy_has_the_bits_of_the_two_functions() {
        let row = row();
        for t in [1.0f32, 0.7, 1.3] {
            let (lp, h) = log_softmax_and_entropy(&row, t, true);
            let want = log_softmax_row(&row, t);
            assert!(lp
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            assert_eq!(h.map(f32::to_bits), Some(entropy_row(&row).to_bits()));
            let (lp, h) = log_softmax_and_entropy(&row, t, false);
            assert_eq!(lp, want);
            assert_eq!(h, None);
        }
        // The entropy is at temperature 1 whatever the sampling temperature: a cooler row has less.
        let cool: Vec<f32> = row.iter().map(|x| x / 0.5).collect();
        assert!(entropy_row(&cool) < entropy_row(&row));
        let h = entropy_row(&row);
        assert!(h > 0.0 && (h as f64) < (row.len() as f64).ln());
    }
}
