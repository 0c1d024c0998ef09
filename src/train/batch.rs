//! Turning token sequences into the padded tensors the losses take.

use std::collections::HashMap;

use burn::tensor::{Device, IndexingUpdateOp, Int, Tensor, TensorData};

use crate::host::tensor_from_vec;
use crate::model::mlp::DeviceRouting;
use crate::model::scoring::{head_logprobs, right_pad};
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
    /// are gathered before the LM head, so no `[B, T, vocab]` tensor exists. Rows that share their prompt
    /// (the samples of one group) share its forward (`shared_prefix_hidden`). In deterministic mode
    /// the values are bitwise those of a full forward of each sequence (the kernels are row-invariant and
    /// masked keys change no sum).
    pub fn logprobs(
        &self,
        model: &Decoder,
        weights: Weights,
        temperature: f32,
        replay: Option<&[Option<Vec<u32>>]>,
    ) -> (Tensor<2>, ResponseForward) {
        self.logprobs_with(
            model,
            weights,
            temperature,
            replay,
            ForwardOptions::default(),
        )
    }

    /// [`Self::logprobs`] with the prefix sharing chosen (`Off`: one full forward of every sequence, what
    /// tests compare the shared forward with) and, on request, the entropy of every loss position.
    pub fn logprobs_with(
        &self,
        model: &Decoder,
        weights: Weights,
        temperature: f32,
        replay: Option<&[Option<Vec<u32>>]>,
        opts: ForwardOptions,
    ) -> (Tensor<2>, ResponseForward) {
        let groups = self.prompt_groups_routed(replay, model.config.experts_per_token());
        let shared = opts.sharing == PrefixSharing::Auto && groups.len() < self.seqs.len();
        let reads = crate::host::ReadCount::start();
        let (hidden, rows, routing, padded_len) = if shared {
            self.shared_prefix_hidden(model, weights, replay, &groups, opts.bucket_cost)
        } else {
            let padded = right_pad(&self.seqs);
            let padded_len = padded.first().map_or(0, Vec::len);
            let (hidden, routing) = model.hidden_as(weights, &padded, replay);
            let rows = self
                .loss_positions(padded_len)
                .iter()
                .map(|p| p.0)
                .collect();
            (hidden, rows, routing, padded_len)
        };
        let layer_reads = reads.reads();
        let device = hidden.device();
        let positions = self.loss_positions(padded_len);
        let n = positions.len();
        let index = |v: Vec<i64>| Tensor::<1, Int>::from_data(TensorData::new(v, [n]), &device);
        let targets: Vec<u32> = positions.iter().map(|p| p.2).collect();
        let head = head_logprobs(
            model,
            hidden.select(0, index(rows)),
            weights,
            &targets,
            temperature,
            opts.entropy,
        );
        let lp = head.logprobs;
        let grid = Tensor::<1>::zeros([self.seqs.len() * self.width], &device)
            .select_assign(
                0,
                index(positions.iter().map(|p| p.1).collect()),
                lp,
                IndexingUpdateOp::Add,
            )
            .reshape([self.seqs.len(), self.width]);
        (
            grid,
            ResponseForward {
                entropy: head.entropy,
                routing,
                padded_len,
                layer_reads,
                work: self.forward_work(&model.config, opts),
            },
        )
    }

    /// Tokens the learner forward of [`Self::logprobs_with`] runs (padding included) and its flops
    /// ([`crate::model::cost`]): with shared prompts, the distinct prompts padded to the longest, then each
    /// length bucket's response inputs padded to the bucket's longest against the prompt's keys
    /// ([`length_buckets`]); else every sequence padded.
    pub fn forward_work(
        &self,
        config: &crate::model::ModelConfig,
        opts: ForwardOptions,
    ) -> (usize, f64) {
        let rows = self.seqs.len();
        let loss_of = |r: usize| self.seqs[r].len().saturating_sub(self.prompt_lens[r]);
        let longest = self.seqs.iter().map(Vec::len).max().unwrap_or(0);
        let groups = self.prompt_groups();
        if opts.sharing == PrefixSharing::Off || groups.len() == rows {
            let loss = (0..rows).map(loss_of).sum();
            let f = config.forward_flops(rows, longest, longest, loss).total();
            return (rows * longest, f);
        }
        let lp = groups
            .iter()
            .map(|g| self.prompt_lens[g[0]])
            .max()
            .unwrap_or(0);
        let counts: Vec<usize> = (0..rows)
            .map(|r| self.seqs[r].len().saturating_sub(self.prompt_lens[r] + 1))
            .collect();
        // A row without response inputs (one response token) is scored at its prompt's last position.
        let prompt_loss = (0..rows).filter(|&r| counts[r] == 0).map(loss_of).sum();
        let mut tokens = groups.len() * lp;
        let mut f = config
            .forward_flops(groups.len(), lp, lp, prompt_loss)
            .total();
        for bucket in length_buckets(&counts, opts.bucket_cost) {
            let loss = bucket.rows.iter().map(|&r| loss_of(r)).sum();
            tokens += bucket.rows.len() * bucket.t;
            f += config
                .forward_flops(bucket.rows.len(), bucket.t, lp + bucket.t, loss)
                .total();
        }
        (tokens, f)
    }

    /// The rows with the same prompt (the same tokens before `prompt_lens`), in order of first appearance.
    pub fn prompt_groups(&self) -> Vec<Vec<usize>> {
        let mut first: HashMap<&[u32], usize> = HashMap::new();
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (r, (s, &p)) in self.seqs.iter().zip(&self.prompt_lens).enumerate() {
            let g = *first.entry(&s[..p]).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push(r);
        }
        groups
    }

    /// [`Self::prompt_groups`], split further under routing replay (`replay`, `k` experts per token) by
    /// each row's recorded routing of its prompt: the shared prompt forward replays its group's first
    /// row's, so a row whose prompt its rollout routed otherwise (a refill round's prefill of the same
    /// prompt, which outside deterministic mode can break a near-tie another way) would have its prompt
    /// positions take experts its rollout did not.
    pub fn prompt_groups_routed(
        &self,
        replay: Option<&[Option<Vec<u32>>]>,
        k: usize,
    ) -> Vec<Vec<usize>> {
        let groups = self.prompt_groups();
        let Some(replay) = replay else {
            return groups;
        };
        let padded_len = self.seqs.iter().map(Vec::len).max().unwrap_or(0);
        let prompt_routing = |r: usize| -> Vec<&[u32]> {
            let at = r * padded_len * k;
            let end = at + self.prompt_lens[r] * k;
            replay
                .iter()
                .flatten()
                .map(|full| full.get(at..end).unwrap_or(&[]))
                .collect()
        };
        let mut out = Vec::with_capacity(groups.len());
        for group in groups {
            let mut split: Vec<(Vec<&[u32]>, Vec<usize>)> = Vec::new();
            for r in group {
                let key = prompt_routing(r);
                match split.iter_mut().find(|(routed, _)| *routed == key) {
                    Some((_, rows)) => rows.push(r),
                    None => split.push((key, vec![r])),
                }
            }
            out.extend(split.into_iter().map(|(_, rows)| rows));
        }
        out
    }

    /// The hidden states the loss positions need, with each distinct prompt forwarded once: the prompts
    /// (right-padded) into a KV cache, the cache fanned out to the rows of each group, then the responses
    /// (all tokens but the last) continuing from it: the rollout's own prefill-then-decode, with the
    /// response tokens of a length bucket ([`length_buckets`]) in one forward, right-padded to the bucket's
    /// longest. Returns the hidden rows (`P` prompt-last rows, then each bucket's `rows * t` response rows),
    /// the row of each loss position among them, the routing laid out as the full forward's
    /// (`[B * T * top_k]` per layer), and `T`.
    fn shared_prefix_hidden(
        &self,
        model: &Decoder,
        weights: Weights,
        replay: Option<&[Option<Vec<u32>>]>,
        groups: &[Vec<usize>],
        bucket_cost: usize,
    ) -> (Tensor<2>, Vec<i64>, Vec<Option<DeviceRouting>>, usize) {
        let (b, p) = (self.seqs.len(), groups.len());
        let padded_len = self.seqs.iter().map(Vec::len).max().unwrap_or(0);
        let plens: Vec<usize> = groups.iter().map(|g| self.prompt_lens[g[0]]).collect();
        let prompts: Vec<Vec<u32>> = groups
            .iter()
            .map(|g| self.seqs[g[0]][..self.prompt_lens[g[0]]].to_vec())
            .collect();
        let mut group_of = vec![0usize; b];
        for (gi, g) in groups.iter().enumerate() {
            for &r in g {
                group_of[r] = gi;
            }
        }
        let lp = plens.iter().copied().max().unwrap_or(0);
        let last: Vec<usize> = plens.iter().map(|l| l - 1).collect();
        let layers = model.layers.len();
        // Replay: position `q` of a prompt is position `q` of its first row; of a response, position
        // `prompt_len + q` of its row. Positions past a row's tokens get placeholders (never scored).
        let slice_replay = |rows: &[usize], starts: &[usize], counts: &[usize], width: usize| {
            replay.map(|rp| {
                let k = model.config.experts_per_token();
                (0..layers)
                    .map(|l| {
                        let full = rp.get(l)?.as_ref()?;
                        let mut out = Vec::with_capacity(rows.len() * width * k);
                        for (i, &r) in rows.iter().enumerate() {
                            for q in 0..width {
                                if q < counts[i] {
                                    let at = (r * padded_len + starts[i] + q) * k;
                                    out.extend_from_slice(&full[at..at + k]);
                                } else {
                                    out.extend(0..k as u32);
                                }
                            }
                        }
                        Some(out)
                    })
                    .collect::<Vec<_>>()
            })
        };
        let firsts: Vec<usize> = groups.iter().map(|g| g[0]).collect();
        let prompt_replay = slice_replay(&firsts, &vec![0; p], &plens, lp);
        let mut cache = model.new_cache(p);
        let (h_prompt, r_prompt) = model.hidden_cached(
            weights,
            &right_pad(&prompts),
            &plens,
            &mut cache,
            prompt_replay.as_deref(),
            Some(&last),
        );
        // Response inputs: every response token but the last (it is only a target).
        let inputs: Vec<Vec<u32>> = (0..b)
            .map(|r| {
                let s = &self.seqs[r];
                s[self.prompt_lens[r].min(s.len().saturating_sub(1))..s.len().saturating_sub(1)]
                    .to_vec()
            })
            .collect();
        let counts: Vec<usize> = inputs.iter().map(Vec::len).collect();
        let layout = ResponseLayout::new(&counts, bucket_cost);
        let mut hidden = vec![h_prompt];
        let mut r_resp: Vec<Vec<DeviceRouting>> = vec![Vec::new(); layers];
        for bucket in &layout.buckets {
            let mut bucket_cache = cache.clone();
            bucket_cache.select_rows(&bucket.rows.iter().map(|&r| group_of[r]).collect::<Vec<_>>());
            let padded: Vec<Vec<u32>> = bucket
                .rows
                .iter()
                .map(|&r| {
                    let mut x = inputs[r].clone();
                    x.resize(bucket.t, 0);
                    x
                })
                .collect();
            let starts: Vec<usize> = bucket.rows.iter().map(|&r| self.prompt_lens[r]).collect();
            let lens: Vec<usize> = bucket.rows.iter().map(|&r| counts[r]).collect();
            let resp_replay = slice_replay(&bucket.rows, &starts, &lens, bucket.t);
            let (h, r) = model.hidden_cached(
                weights,
                &padded,
                &lens,
                &mut bucket_cache,
                resp_replay.as_deref(),
                None,
            );
            hidden.push(h);
            for (l, routing) in r.into_iter().enumerate() {
                r_resp[l].extend(routing);
            }
        }
        let hidden = Tensor::cat(hidden, 0);
        // Hidden rows: the prompts' last positions (`P`), then the response forwards'.
        let resp_row = |r: usize, j: usize| (p + layout.row(r, j)) as i64;
        // Loss position j of row r: the prompt's last row for j = 0, else response input j - 1 of the row.
        let mut rows = Vec::new();
        for (r, (s, &g)) in self.seqs.iter().zip(&group_of).enumerate() {
            let n = s.len().saturating_sub(self.prompt_lens[r]);
            if n > 0 {
                rows.push(g as i64);
                rows.extend((1..n).map(|j| resp_row(r, j - 1)));
            }
        }
        // The routing laid out as a full forward's, gathered on the device: token `q` of row `r` is its
        // prompt's token `q`, then its own response token, then a placeholder `0..k` (padding). Routing
        // rows: every prompt position (`P * lp`), then the response forwards'.
        let resp_token = |r: usize, j: usize| (p * lp + layout.row(r, j)) as i64;
        let pad_row = (p * lp + layout.rows) as i64;
        let mut token_rows = Vec::with_capacity(b * padded_len);
        for r in 0..b {
            let (g, pl) = (group_of[r], self.prompt_lens[r]);
            token_rows.extend((0..pl).map(|q| (g * lp + q) as i64));
            token_rows.extend((0..counts[r]).map(|j| resp_token(r, j)));
            token_rows.extend(std::iter::repeat_n(pad_row, padded_len - pl - counts[r]));
        }
        let device = hidden.device();
        let token_rows =
            Tensor::<1, Int>::from_data(TensorData::new(token_rows, [b * padded_len]), &device);
        let routing = (0..layers)
            .map(|l| {
                let pr = r_prompt[l].clone()?;
                let k = pr.dims()[1];
                let placeholder = Tensor::<1, Int>::arange(0..k as i64, &device).reshape([1, k]);
                let parts: Vec<DeviceRouting> = std::iter::once(pr)
                    .chain(r_resp[l].iter().cloned())
                    .chain(std::iter::once(placeholder))
                    .collect();
                Some(Tensor::cat(parts, 0).select(0, token_rows.clone()))
            })
            .collect();
        (hidden, rows, routing, padded_len)
    }
}

/// Padded token slots a separate response forward must save before [`length_buckets`] opens one: on the
/// CPU a forward's fixed cost (per-op dispatch and graph bookkeeping over every layer) is about that of a
/// few dozen tokens of SmolLM2-135M. A constant, not a measurement taken at run time, so the buckets (and
/// with them the backward's summation order) are the same on every machine.
pub const BUCKET_COST_TOKENS: usize = 32;

/// The rows of one response forward and the length they are padded to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub rows: Vec<usize>,
    pub t: usize,
}

/// Rows grouped by response length so that the response forwards pad little: the rows with at least one
/// input token, longest first (ties by row), cut into consecutive runs that minimise the padded tokens
/// plus `cost` per run (exact, by dynamic programming over the sorted lengths). `cost = 0` gives one run
/// per distinct length, `usize::MAX` one padded run of every row.
pub fn length_buckets(counts: &[usize], cost: usize) -> Vec<Bucket> {
    let mut order: Vec<usize> = (0..counts.len()).filter(|&r| counts[r] > 0).collect();
    order.sort_by_key(|&r| std::cmp::Reverse(counts[r]));
    let n = order.len();
    // best[j]: the least cost of rows order[..j]; cut[j]: where its last run starts.
    let mut best = vec![0u128; n + 1];
    let mut cut = vec![0usize; n + 1];
    for j in 1..=n {
        best[j] = u128::MAX;
        for i in 0..j {
            let run = (j - i) as u128 * counts[order[i]] as u128 + cost as u128;
            if best[i] + run < best[j] {
                (best[j], cut[j]) = (best[i] + run, i);
            }
        }
    }
    let mut buckets = Vec::new();
    let mut j = n;
    while j > 0 {
        let i = cut[j];
        buckets.push(Bucket {
            rows: order[i..j].to_vec(),
            t: counts[order[i]],
        });
        j = i;
    }
    buckets.reverse();
    buckets
}

/// Where each row's response inputs sit among the response forwards' hidden rows: bucket after bucket,
/// `t` rows per member row.
struct ResponseLayout {
    buckets: Vec<Bucket>,
    /// Per row: (first hidden row of its response inputs).
    start: Vec<usize>,
    /// Hidden rows of all the response forwards.
    rows: usize,
}

impl ResponseLayout {
    fn new(counts: &[usize], cost: usize) -> Self {
        let buckets = length_buckets(counts, cost);
        let mut start = vec![0usize; counts.len()];
        let mut rows = 0;
        for bucket in &buckets {
            for &r in &bucket.rows {
                start[r] = rows;
                rows += bucket.t;
            }
        }
        Self {
            buckets,
            start,
            rows,
        }
    }

    /// The hidden row of response input `j` of row `r`, counted from the first response row.
    fn row(&self, r: usize, j: usize) -> usize {
        self.start[r] + j
    }
}

/// How [`SeqBatch::logprobs_with`] runs its forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardOptions {
    pub sharing: PrefixSharing,
    /// Also compute the entropy (temperature 1) of every loss position ([`ResponseForward::entropy`]).
    pub entropy: bool,
    /// With a shared prefix, the response forwards' length buckets ([`length_buckets`]'s `cost`).
    pub bucket_cost: usize,
}

impl Default for ForwardOptions {
    fn default() -> Self {
        Self {
            sharing: PrefixSharing::Auto,
            entropy: false,
            bucket_cost: BUCKET_COST_TOKENS,
        }
    }
}

/// Whether rows with the same prompt share its forward ([`SeqBatch::logprobs_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixSharing {
    /// Share whenever two rows have the same prompt.
    Auto,
    /// One full forward per sequence.
    Off,
}

/// What the learner forward of [`SeqBatch::logprobs`] leaves besides the log-probs.
pub struct ResponseForward {
    /// The entropy (temperature 1) at each position that carries a loss, sequence by sequence, position by
    /// position, when [`ForwardOptions::entropy`] asked for it.
    pub entropy: Option<Vec<f32>>,
    /// For each layer, the experts of every token of the padded batch (`[B * T, top_k]`, on the device:
    /// [`crate::model::mlp::routing_to_host`] reads them), `None` for dense layers.
    pub routing: Vec<Option<DeviceRouting>>,
    /// `T`, the tokens per row of the padded batch.
    pub padded_len: usize,
    /// Device-to-host reads of the decoder layers (embedding to the final norm, before the LM head;
    /// [`crate::host::device_reads`]): none with routing replay on a GPU.
    pub layer_reads: u64,
    /// The tokens this forward ran (padding included) and its flops ([`SeqBatch::forward_work`]).
    pub work: (usize, f64),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The padded tokens plus `cost` per run of a bucketing.
    fn total(buckets: &[Bucket], cost: usize) -> usize {
        buckets.iter().map(|b| b.rows.len() * b.t + cost).sum()
    }

    /// The tokens the learner forward is billed for are the tokens its forwards run: the distinct prompts
    /// padded to the longest, then each bucket's rows padded to the bucket's longest response input.
    #[test]
    fn forward_work_counts_the_buckets_tokens() {
        let config =
            crate::model::ModelConfig::from_file("configs/models/qwen3-moe-arith.json").unwrap();
        // Two groups (prompts of 3 and 2 tokens); response inputs 4, 1, 0 and 3, 3.
        let batch = SeqBatch::new(
            vec![
                vec![1, 2, 3, 4, 5, 6, 7, 8],
                vec![1, 2, 3, 9, 9],
                vec![1, 2, 3, 4],
                vec![5, 6, 1, 1, 1, 1],
                vec![5, 6, 2, 2, 2, 2],
            ],
            vec![3, 3, 3, 2, 2],
        );
        let work = |sharing, bucket_cost| {
            let opts = ForwardOptions {
                sharing,
                entropy: false,
                bucket_cost,
            };
            batch.forward_work(&config, opts)
        };
        assert_eq!(work(PrefixSharing::Off, 0).0, 5 * 8);
        assert_eq!(work(PrefixSharing::Auto, usize::MAX).0, 2 * 3 + 4 * 4);
        // Buckets {4}, {3, 3}, {1}.
        assert_eq!(work(PrefixSharing::Auto, 0).0, 2 * 3 + 4 + 2 * 3 + 1);
        let (one, split) = (
            work(PrefixSharing::Auto, usize::MAX).1,
            work(PrefixSharing::Auto, 0).1,
        );
        assert!(split < one, "{split} vs {one}");
    }

    #[test]
    fn the_extreme_costs_give_one_run_or_one_run_per_length() {
        let counts = [5, 0, 9, 5, 2, 9, 1];
        let one = length_buckets(&counts, usize::MAX);
        assert_eq!(
            one,
            vec![Bucket {
                rows: vec![2, 5, 0, 3, 4, 6],
                t: 9
            }]
        );
        let each: Vec<(Vec<usize>, usize)> = length_buckets(&counts, 0)
            .into_iter()
            .map(|b| (b.rows, b.t))
            .collect();
        assert_eq!(
            each,
            vec![(vec![2, 5], 9), (vec![0, 3], 5), (vec![4], 2), (vec![6], 1)]
        );
        assert!(length_buckets(&[0, 0], 0).is_empty());
    }

    /// Against every way of cutting the sorted rows into runs (2^(n-1) of them), on lengths from a fixed
    /// pseudo-random sequence: the dynamic programme's total is the least, every row is in exactly one
    /// run, and a run's `t` is its longest member.
    #[test]
    fn buckets_are_the_cheapest_cut_of_the_sorted_lengths() {
        let mut state = 12345u64;
        let mut next = |m: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % m) as usize
        };
        for _ in 0..200 {
            let n = 1 + next(9);
            let counts: Vec<usize> = (0..n).map(|_| 1 + next(64)).collect();
            let cost = next(80);
            let buckets = length_buckets(&counts, cost);
            let mut seen: Vec<usize> = buckets.iter().flat_map(|b| b.rows.clone()).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
            for b in &buckets {
                assert_eq!(b.t, b.rows.iter().map(|&r| counts[r]).max().unwrap());
            }
            let mut sorted = counts.clone();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            let brute = (0u32..1 << (n - 1))
                .map(|cuts| {
                    let (mut sum, mut first) = (0, 0);
                    for i in 1..=n {
                        if i == n || cuts & (1 << (i - 1)) != 0 {
                            sum += (i - first) * sorted[first] + cost;
                            first = i;
                        }
                    }
                    sum
                })
                .min()
                .unwrap();
            assert_eq!(total(&buckets, cost), brute, "{counts:?}, cost {cost}");
        }
    }
}
