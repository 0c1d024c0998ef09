//! Generation. For now greedy decoding with the KV cache; the batched sampler with log-prob recording is
//! the rollout issue's work.

use burn::tensor::Tensor;

use crate::model::layers::to_f32_vec;
use crate::model::Decoder;

/// Host copy of a `[B, V]` tensor, row by row.
pub fn rows(t: Tensor<2>) -> Vec<Vec<f32>> {
    let [_, v] = t.dims();
    let flat = to_f32_vec(t);
    flat.chunks(v.max(1)).map(<[f32]>::to_vec).collect()
}

/// Index of the largest value; the first one on ties (as `torch.argmax`).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of `max_new_tokens` tokens for equal-length prompts: one prefill, then one cached step per
/// token. Returns prompt + generated ids per row. Stops a row early at any of `stop_ids`.
pub fn generate_greedy(
    model: &Decoder,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    stop_ids: &[u32],
) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = prompts.to_vec();
    if max_new_tokens == 0 {
        return out;
    }
    let mut cache = model.new_cache(prompts.len());
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    let last = |logits: Tensor<3>| {
        let [b, t, v] = logits.dims();
        rows(logits.narrow(1, t - 1, 1).reshape([b, v]))
    };
    let mut next: Vec<u32> = last(model.forward(prompts, None, Some(&mut cache), None).logits)
        .iter()
        .map(|r| argmax(r))
        .collect();
    for step in 0..max_new_tokens {
        let mut keep = Vec::new();
        for (slot, &row) in active.iter().enumerate() {
            out[row].push(next[slot]);
            if !stop_ids.contains(&next[slot]) {
                keep.push(slot);
            }
        }
        if step + 1 == max_new_tokens || keep.is_empty() {
            break;
        }
        cache.retain_rows(&keep);
        active = keep.iter().map(|&s| active[s]).collect();
        let step_ids: Vec<Vec<u32>> = keep.iter().map(|&s| vec![next[s]]).collect();
        next = last(
            model
                .forward(&step_ids, None, Some(&mut cache), None)
                .logits,
        )
        .iter()
        .map(|r| argmax(r))
        .collect();
    }
    out
}
