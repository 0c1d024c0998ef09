//! Turning token sequences into the padded tensors the losses take.

use burn::tensor::{Device, IndexingUpdateOp, Int, Tensor, TensorData};

use crate::host::tensor_from_vec;
use crate::model::mlp::Routing;
use crate::model::scoring::{right_pad, target_logprobs};
use crate::model::{Decoder, Weights};

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

    /// The positions that carry a loss, row-major: `(row of the padded forward's [B * T] hidden states, index
    /// on the [B, T - 1] grid, target token)` for every response token.
    fn loss_positions(&self, padded_len: usize) -> Vec<(i64, i64, u32)> {
        let mut out = Vec::new();
        for (b, (s, &p)) in self.seqs.iter().zip(&self.prompt_lens).enumerate() {
            for t in p.saturating_sub(1)..s.len().saturating_sub(1) {
                out.push((
                    (b * padded_len + t) as i64,
                    (b * self.width + t) as i64,
                    s[t + 1],
                ));
            }
        }
        out
    }

    /// Forward with the chosen weights and the `[B, T - 1]` grid of next-token log-probs at `temperature`
    /// (differentiable on an autodiff model; zeros where the mask is 0). Logits and log-softmax are computed
    /// only at the positions that carry a loss (the response tokens): the hidden states of those positions
    /// are gathered before the LM head, so no `[B, T, vocab]` tensor exists. In deterministic mode the values
    /// are bitwise those of the full forward at the same positions (the LM head is row-invariant).
    pub fn logprobs(
        &self,
        model: &Decoder,
        weights: Weights,
        temperature: f32,
        replay: Option<&[Option<Vec<u32>>]>,
    ) -> (Tensor<2>, ResponseForward) {
        let padded = right_pad(&self.seqs);
        let padded_len = padded.first().map_or(0, Vec::len);
        let (hidden, routing) = model.hidden_as(weights, &padded, replay);
        let device = hidden.device();
        let positions = self.loss_positions(padded_len);
        let n = positions.len();
        let index = |f: fn(&(i64, i64, u32)) -> i64| {
            let v: Vec<i64> = positions.iter().map(f).collect();
            Tensor::<1, Int>::from_data(TensorData::new(v, [n]), &device)
        };
        let logits = model.head(hidden.select(0, index(|p| p.0)), weights);
        let targets: Vec<u32> = positions.iter().map(|p| p.2).collect();
        let lp = target_logprobs(logits.clone(), &targets, temperature);
        let grid = Tensor::<1>::zeros([self.seqs.len() * self.width], &device)
            .select_assign(0, index(|p| p.1), lp, IndexingUpdateOp::Add)
            .reshape([self.seqs.len(), self.width]);
        (
            grid,
            ResponseForward {
                logits,
                routing,
                padded_len,
            },
        )
    }
}

/// What the learner forward of [`SeqBatch::logprobs`] leaves besides the log-probs.
pub struct ResponseForward {
    /// Logits `[N, vocab]` at the positions that carry a loss, sequence by sequence, position by position.
    pub logits: Tensor<2>,
    /// For each layer, the experts of every token of the padded batch (`[B * T * top_k]`), `None` for dense
    /// layers.
    pub routing: Vec<Option<Routing>>,
    /// `T`, the tokens per row of the padded batch.
    pub padded_len: usize,
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
