//! Turning token sequences into the padded tensors the losses take.

use burn::tensor::{Device, Tensor};

use crate::host::tensor_from_vec;
use crate::model::scoring::{forward_ragged, next_token_logprobs_at};
use crate::model::{Decoder, ForwardOutput, Weights};

/// Sequences (prompt + response) with the positions whose next-token log-probs are trained.
#[derive(Debug, Clone)]
pub struct SeqBatch {
    pub seqs: Vec<Vec<u32>>,
    pub prompt_lens: Vec<usize>,
    /// `T - 1` where `T` is the longest sequence.
    pub width: usize,
}

impl SeqBatch {
    pub fn new(seqs: Vec<Vec<u32>>, prompt_lens: Vec<usize>) -> Self {
        let width = seqs
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(1)
            .saturating_sub(1)
            .max(1);
        Self {
            seqs,
            prompt_lens,
            width,
        }
    }

    /// `mask[b][t]` = 1 where position `t` predicts a response token (`t + 1 >= prompt_len`).
    pub fn mask_values(&self) -> Vec<f32> {
        let mut m = Vec::with_capacity(self.seqs.len() * self.width);
        for (s, &p) in self.seqs.iter().zip(&self.prompt_lens) {
            for t in 0..self.width {
                m.push(if t + 1 >= p && t + 1 < s.len() {
                    1.0
                } else {
                    0.0
                });
            }
        }
        m
    }

    pub fn mask(&self, device: &Device) -> Tensor<2> {
        tensor_from_vec(self.mask_values(), [self.seqs.len(), self.width], device)
    }

    /// Per-response values (one per response token) laid out on the `[B, T - 1]` grid, zeros elsewhere.
    pub fn grid_values(&self, per_response: &[Vec<f32>]) -> Vec<f32> {
        let mut g = vec![0.0f32; self.seqs.len() * self.width];
        for (b, vals) in per_response.iter().enumerate() {
            let start = self.prompt_lens[b] - 1;
            for (j, &v) in vals.iter().enumerate() {
                if start + j < self.width {
                    g[b * self.width + start + j] = v;
                }
            }
        }
        g
    }

    /// [`Self::grid_values`] as a tensor.
    pub fn grid(&self, per_response: &[Vec<f32>], device: &Device) -> Tensor<2> {
        tensor_from_vec(
            self.grid_values(per_response),
            [self.seqs.len(), self.width],
            device,
        )
    }

    /// Host rows of a `[B, T - 1]` grid restricted to the response positions.
    pub fn responses_of(&self, grid: &[f32]) -> Vec<Vec<f32>> {
        self.seqs
            .iter()
            .zip(&self.prompt_lens)
            .enumerate()
            .map(|(b, (s, &p))| grid[b * self.width + p - 1..b * self.width + s.len() - 1].to_vec())
            .collect()
    }

    /// Full forward with the chosen weights and `[B, T - 1]` next-token log-probs at `temperature`
    /// (differentiable on an autodiff model).
    pub fn logprobs(
        &self,
        model: &Decoder,
        weights: Weights,
        temperature: f32,
        replay: Option<&[Option<Vec<u32>>]>,
    ) -> (Tensor<2>, ForwardOutput) {
        let (out, padded) = forward_ragged(model, weights, &self.seqs, replay);
        let lp = next_token_logprobs_at(out.logits.clone(), &padded, temperature);
        let lp = if lp.dims()[1] == self.width {
            lp
        } else {
            lp.narrow(1, 0, self.width)
        };
        (lp, out)
    }
}

/// Routing replay for a right-padded batch: the recorded experts of every token that went through the
/// rollout, and placeholder experts `0..k` for the last token and the padding (their outputs are never
/// scored).
pub fn replay_routing(
    records: &[&Vec<Option<Vec<u32>>>],
    seqs: &[Vec<u32>],
    top_k: usize,
    layers: usize,
) -> Vec<Option<Vec<u32>>> {
    let t = seqs.iter().map(Vec::len).max().unwrap_or(0);
    (0..layers)
        .map(|l| {
            if records.iter().all(|r| r.get(l).is_none_or(Option::is_none)) {
                return None;
            }
            let mut flat = Vec::with_capacity(seqs.len() * t * top_k);
            for (r, rec) in records.iter().enumerate() {
                let known = rec
                    .get(l)
                    .and_then(Option::as_ref)
                    .map_or(&[][..], Vec::as_slice);
                for pos in 0..t {
                    if (pos + 1) * top_k <= known.len() && pos + 1 < seqs[r].len() {
                        flat.extend_from_slice(&known[pos * top_k..(pos + 1) * top_k]);
                    } else {
                        flat.extend(0..top_k as u32);
                    }
                }
            }
            Some(flat)
        })
        .collect()
}
