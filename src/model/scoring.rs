//! Per-token log-probabilities of given sequences, the quantity every RL objective is built on.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};

/// `logprobs[b][t] = log_softmax(logits[b][t])[ids[b][t + 1]]`, as a `[B, T - 1]` tensor (differentiable).
pub fn next_token_logprobs(logits: Tensor<3>, ids: &[Vec<u32>]) -> Tensor<2> {
    let [b, t, _v] = logits.dims();
    let lp = log_softmax(logits.narrow(1, 0, t - 1), 2);
    let targets: Vec<i64> = ids
        .iter()
        .flat_map(|row| row[1..].iter().map(|&x| x as i64))
        .collect();
    let idx = Tensor::<3, Int>::from_data(TensorData::new(targets, [b, t - 1, 1]), &lp.device());
    lp.gather(2, idx).reshape([b, t - 1])
}
