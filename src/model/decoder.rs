//! The config-driven decoder-only transformer shared by Llama, Qwen2, Qwen3 and Qwen3-MoE.

use burn::module::{Module, Param};
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use super::activations::Activations;
use crate::ops::dtype::as_dtype;

use super::attention::{Attention, KvWrite, LayerKv};
use super::config::ModelConfig;
use super::layers::{Linear, RmsNorm, Rope, Weights};
use super::mlp::{upload_routing, DeviceRouting, FeedForward, Replay, Routing};
use super::names::lazy_param;
use crate::host::tensor_from_vec;

/// Additive mask value for keys a query must not see. Finite (not -inf) so that a padding query that sees no
/// key at all gets a uniform, finite distribution instead of NaN, which would leak into later layers.
const MASKED: f32 = -1.0e30;

/// Granularity of the attention key axis (see [`Decoder::forward`]). In deterministic mode the attention's
/// products and softmax reduce over keys in a fixed order that masked trailing keys do not change, so the
/// rollout's recorded log-probs equal the full forward's bitwise whatever the padding; outside it, 64 keeps
/// burn's reductions grouping the real keys alike (within 1e-5 on every fixture; 32 gave 1.4e-5).
pub const KEY_BLOCK: usize = 64;

#[derive(Module, Debug)]
pub struct DecoderLayer {
    pub input_layernorm: RmsNorm,
    pub self_attn: Attention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: FeedForward,
}

impl DecoderLayer {
    /// Layer `layer` of `cfg` with parameters not allocated yet (a lazy model's part, see
    /// [`super::params`]).
    pub fn lazy(layer: usize, cfg: &ModelConfig, device: &Device) -> Self {
        Self {
            input_layernorm: RmsNorm::lazy(cfg.hidden_size, cfg.rms_norm_eps, device),
            self_attn: Attention::lazy(cfg, device),
            post_attention_layernorm: RmsNorm::lazy(cfg.hidden_size, cfg.rms_norm_eps, device),
            mlp: FeedForward::lazy(layer, cfg, device),
        }
    }
}

/// Per-layer attention state for incremental decoding. Each row's tokens occupy the first `lens[b]` slots
/// of the buffers (no left padding), so a row attends over exactly the keys, at exactly the indices, that a
/// full-sequence forward of that row alone would use.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub layers: Vec<Option<LayerKv>>,
    /// Real tokens cached per row.
    pub lens: Vec<usize>,
    /// Slots written so far, the longest row's end (>= every row's length; the buffers themselves are kept
    /// as wide as the attention's key axis, a multiple of [`KEY_BLOCK`] at least this).
    pub capacity: usize,
}

impl KvCache {
    pub fn new(num_layers: usize, batch: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            lens: vec![0; batch],
            capacity: 0,
        }
    }

    /// Rows in the batch.
    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    /// The key axis a forward's attention reads for each row: the slots written, rounded up to
    /// [`KEY_BLOCK`] as the attention runs it.
    pub fn key_width(&self) -> usize {
        self.capacity.div_ceil(KEY_BLOCK) * KEY_BLOCK
    }

    /// Bytes of K and V one key slot of one row holds over all layers (in the cache's dtype).
    pub fn bytes_per_key_slot(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|kv| {
                let [_, heads, _, d] = kv.k.dims();
                2 * heads * d * kv.k.dtype().size()
            })
            .sum()
    }

    /// Re-arranges the batch: row `i` of the result is row `rows[i]` of the cache. Drops finished rows
    /// (finished sequences stop costing compute) and fans a prompt out to several samples (repeated indices).
    pub fn select_rows(&mut self, rows: &[usize]) {
        if rows.iter().copied().eq(0..self.lens.len()) {
            return;
        }
        self.lens = rows.iter().map(|&r| self.lens[r]).collect();
        let Some(device) = self.layers.iter().flatten().next().map(|l| l.k.device()) else {
            return;
        };
        let idx = Tensor::<1, Int>::from_data(
            TensorData::new(
                rows.iter().map(|&r| r as i64).collect::<Vec<_>>(),
                [rows.len()],
            ),
            &device,
        );
        for kv in self.layers.iter_mut().flatten() {
            kv.k = kv.k.clone().select(0, idx.clone());
            kv.v = kv.v.clone().select(0, idx.clone());
        }
    }
}

/// What a forward pass returns.
#[derive(Debug)]
pub struct ForwardOutput {
    /// `[B, T, vocab]`
    pub logits: Tensor<3>,
    /// For each layer, the experts chosen for each token (`[B * T, top_k]` on the device, token-major),
    /// `None` for dense layers ([`super::mlp::routing_to_host`] reads them).
    pub routing: Vec<Option<DeviceRouting>>,
}

#[derive(Module, Debug)]
pub struct Decoder {
    /// `[vocab, hidden]`
    pub embed_tokens: Param<Tensor<2>>,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// `None` when the output projection is tied to the embeddings.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    pub config: ModelConfig,
    #[module(skip)]
    pub rope: Rope,
    /// The type of the activations between ops ([`super::activations`]); f32 unless set.
    #[module(skip)]
    pub activations: Activations,
}

impl Decoder {
    /// The model of `config` with every parameter in place but not allocated (lazy, zeros if read): its
    /// shapes and names without its weights. Loading fills one in; the random checkpoint writer lists one's
    /// tensors.
    pub fn lazy(config: ModelConfig, device: &Device) -> Self {
        let (v, h, eps) = (config.vocab_size, config.hidden_size, config.rms_norm_eps);
        Self {
            embed_tokens: lazy_param([v, h], device),
            layers: (0..config.num_hidden_layers)
                .map(|i| DecoderLayer::lazy(i, &config, device))
                .collect(),
            norm: RmsNorm::lazy(h, eps, device),
            lm_head: (!config.tie_word_embeddings).then(|| Linear::lazy(h, v, false, device)),
            rope: Rope::new(config.head_dim, config.rope_theta),
            config,
            activations: Activations::F32,
        }
    }

    /// Sets the activations' type of every later forward, after checking that the model's device computes
    /// with it (an error names the type and the device).
    pub fn set_activations(&mut self, activations: Activations) -> anyhow::Result<()> {
        activations.check_device(&self.device())?;
        self.activations = activations;
        Ok(())
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.embed_tokens.val().device()
    }

    /// Checks that token ids fit the vocabulary, rows have equal length and fit the position limit; the
    /// message says what is wrong.
    pub fn check_ids(&self, ids: &[Vec<u32>]) -> Result<(), super::error::InputError> {
        use super::error::InputError;
        self.check_prompts(ids)?;
        let first = ids[0].len();
        if let Some(row) = ids.iter().position(|r| r.len() != first) {
            return Err(InputError::RaggedRows {
                row,
                len: ids[row].len(),
                first,
            });
        }
        if first > self.config.max_position_embeddings {
            return Err(InputError::TooLong {
                len: first,
                limit: self.config.max_position_embeddings,
            });
        }
        Ok(())
    }

    /// Checks that there is at least one non-empty row and every id fits the vocabulary (rows may differ in
    /// length, as prompts do).
    pub fn check_prompts(&self, ids: &[Vec<u32>]) -> Result<(), super::error::InputError> {
        use super::error::InputError;
        if ids.is_empty() {
            return Err(InputError::NoSequences);
        }
        let vocab_size = self.config.vocab_size;
        for (row, r) in ids.iter().enumerate() {
            if r.is_empty() {
                return Err(InputError::EmptyRow { row });
            }
            if let Some(&id) = r.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(InputError::OutOfVocabulary {
                    row,
                    id,
                    vocab_size,
                });
            }
        }
        Ok(())
    }

    /// Forward over `ids` (`B` rows of `T` tokens each).
    ///
    /// - `lens[b]`: how many leading tokens of row `b` are real (right padding; `None`: all `T`). Padding
    ///   tokens are never attended to by real ones and never enter the cache as visible keys.
    /// - `cache`: when given, the new tokens continue each row's cached sequence (RoPE positions and keys
    ///   start at that row's cached length) and are added to the cache.
    /// - `replay`: per layer, expert choices to reuse instead of the router's (MoE routing replay).
    ///
    /// # Panics
    ///
    /// The forward is the hot path and takes its inputs as given: ids from outside (a file, a flag) go
    /// through [`Decoder::check_ids`] or [`Decoder::check_prompts`] first, which say what is wrong instead.
    /// Unchecked, no rows, ragged rows or an id outside the vocabulary panic here, as do a `cache` of
    /// another batch size and `lens` / `at` whose lengths differ from the number of rows (caller bugs).
    pub fn forward(
        &self,
        ids: &[Vec<u32>],
        lens: Option<&[usize]>,
        cache: Option<&mut KvCache>,
        replay: Option<&[Option<Routing>]>,
    ) -> ForwardOutput {
        self.forward_logits_at(ids, lens, cache, replay, None)
    }

    /// A full forward of `ids` (equal-length rows, no cache) with the chosen weights: the learner's forward
    /// (`Weights::Packed` is the aligned QaRL forward, `Weights::Master` the full-precision one). Panics
    /// as [`Decoder::forward`] does.
    pub fn forward_as(
        &self,
        weights: Weights,
        ids: &[Vec<u32>],
        replay: Option<&[Option<Routing>]>,
    ) -> ForwardOutput {
        let (hidden, routing) = self.run(ids, None, None, replay, None, weights);
        self.logits(hidden, ids.len(), weights, routing)
    }

    /// The final hidden states `[B * T, hidden]` (after the last norm) of a full forward of `ids` with the
    /// chosen weights, and the routing: for a caller that needs logits at a few positions only
    /// ([`Decoder::head`] on the rows it selects; the LM head is row-invariant in deterministic mode, so those
    /// logits are the bits a full forward computes there).
    pub fn hidden_as(
        &self,
        weights: Weights,
        ids: &[Vec<u32>],
        replay: Option<&[Option<Routing>]>,
    ) -> (Tensor<2>, Vec<Option<DeviceRouting>>) {
        self.run(ids, None, None, replay, None, weights)
    }

    /// The final hidden states of `ids` appended to `cache` (rows of `lens[b]` real tokens, right-padded),
    /// with the chosen weights, at every position or at `at[b]` of each row, and the routing: a prompt
    /// forward whose cache later forwards continue, as the rollout's prefill and decode do. On an autodiff
    /// device the cache carries the graph, so gradients of the continuation reach the prompt. Panics as
    /// [`Decoder::forward`] does.
    pub fn hidden_cached(
        &self,
        weights: Weights,
        ids: &[Vec<u32>],
        lens: &[usize],
        cache: &mut KvCache,
        replay: Option<&[Option<Routing>]>,
        at: Option<&[usize]>,
    ) -> (Tensor<2>, Vec<Option<DeviceRouting>>) {
        self.run(ids, Some(lens), Some(cache), replay, at, weights)
    }

    /// The LM head (or the tied embeddings) on hidden rows `[n, hidden]` -> logits `[n, vocab]`, in f32
    /// whatever the activations' type (the rows are read as f32 and the logits never rounded to half).
    pub fn head(&self, x: Tensor<2>, weights: Weights) -> Tensor<2> {
        let x = as_dtype(x, DType::F32);
        match &self.lm_head {
            Some(head) => head.forward_with(x, weights),
            None => crate::ops::det_matmul(x, self.embed_tokens.val(), true),
        }
    }

    /// `[B, T, vocab]` logits of `b` rows of hidden states.
    fn logits(
        &self,
        hidden: Tensor<2>,
        b: usize,
        weights: Weights,
        routing: Vec<Option<DeviceRouting>>,
    ) -> ForwardOutput {
        let t = hidden.dims()[0] / b.max(1);
        ForwardOutput {
            logits: self
                .head(hidden, weights)
                .reshape([b, t, self.config.vocab_size]),
            routing,
        }
    }

    /// [`Decoder::forward`], with the logits computed only at position `at[b]` of each row when `at` is
    /// given (`logits: [B, 1, vocab]`): a prefill needs only each prompt's last position, and the LM head
    /// over every prompt token is a large share of its cost. The LM head is row-invariant in deterministic
    /// mode, so those logits are the bits a full forward computes at the same positions. Panics as
    /// [`Decoder::forward`] does, and on a position `at[b]` past the row.
    pub fn forward_logits_at(
        &self,
        ids: &[Vec<u32>],
        lens: Option<&[usize]>,
        cache: Option<&mut KvCache>,
        replay: Option<&[Option<Routing>]>,
        at: Option<&[usize]>,
    ) -> ForwardOutput {
        let (hidden, routing) = self.run(ids, lens, cache, replay, at, Weights::Packed);
        self.logits(hidden, ids.len(), Weights::Packed, routing)
    }

    /// The forward behind [`Decoder::forward_logits_at`], [`Decoder::forward_as`] and
    /// [`Decoder::hidden_as`], up to the LM head: the final hidden states (`B * T` rows, or `B` with `at`) and
    /// the routing.
    fn run(
        &self,
        ids: &[Vec<u32>],
        lens: Option<&[usize]>,
        mut cache: Option<&mut KvCache>,
        replay: Option<&[Option<Routing>]>,
        at: Option<&[usize]>,
        weights: Weights,
    ) -> (Tensor<2>, Vec<Option<DeviceRouting>>) {
        let device = self.device();
        let b = ids.len();
        let t = ids[0].len();
        let cfg = &self.config;
        let new_lens: Vec<usize> = lens.map_or_else(|| vec![t; b], <[usize]>::to_vec);
        let (past, capacity): (Vec<usize>, usize) = match &cache {
            Some(c) if c.batch() == b => (c.lens.clone(), c.capacity),
            Some(c) => panic!("cache holds {} rows, forward got {b}", c.batch()),
            None => (vec![0; b], 0),
        };
        let uniform = past.iter().all(|&p| p == capacity) && new_lens.iter().all(|&n| n == t);
        let total = if uniform {
            capacity + t
        } else {
            capacity.max(past.iter().max().unwrap_or(&0) + t)
        };
        // Keys: with a cache, its `total` slots; without, the `t` new tokens. Attention runs over a key axis
        // rounded up to a multiple of KEY_BLOCK (masked zeros beyond): the backend's reductions over that
        // axis then group the real keys the same way whatever the sequence length, so a token scored in a
        // full forward and the same token decoded with the cache round alike.
        let keys = (if cache.is_some() { total } else { t }).div_ceil(KEY_BLOCK) * KEY_BLOCK;
        let write = match (&cache, uniform) {
            (None, _) | (_, true) => KvWrite::Append {
                at: capacity,
                width: keys,
            },
            (Some(_), false) => {
                let (kv, d) = (cfg.num_key_value_heads, cfg.head_dim);
                let mut index = Vec::with_capacity(b * kv * t * d);
                for &p in &past {
                    for _ in 0..kv {
                        for q in 0..t {
                            index.extend(std::iter::repeat_n((p + q) as i64, d));
                        }
                    }
                }
                // The buffer kept `keys` slots wide, as `Append` keeps it: grown once per key block, and
                // as wide as the mask, so a decode step copies neither the cache (growing it by a slot)
                // nor a zero padding to the mask's width.
                KvWrite::Scatter {
                    index: Tensor::from_data(TensorData::new(index, [b, kv, t, d]), &device),
                    len: keys,
                }
            }
        };
        let needs_mask = t > 1 || (0..b).any(|r| past[r] + new_lens[r] < keys);
        let mask = needs_mask.then(|| {
            let mut m = Vec::with_capacity(b * t * keys);
            for r in 0..b {
                let end = past[r] + new_lens[r];
                for q in 0..t {
                    for s in 0..keys {
                        let visible = s < end && s <= past[r] + q;
                        m.push(if visible { 0.0 } else { MASKED });
                    }
                }
            }
            tensor_from_vec(m, [b, 1, t, keys], &device)
        });
        let positions: Vec<Vec<usize>> = past.iter().map(|&p| (p..p + t).collect()).collect();
        let rope = self.rope.tables(&positions, &device);

        let flat: Vec<i64> = ids.iter().flatten().map(|&x| x as i64).collect();
        let idx = Tensor::<1, Int>::from_data(TensorData::new(flat.clone(), [b * t]), &device);
        let x = self
            .embed_tokens
            .val()
            .select(0, idx)
            .reshape([b, t, cfg.hidden_size]);
        let x = without_pad_gradient(x, &flat, cfg.pad_token_id);
        let mut x = as_dtype(x, self.activations.dtype());

        let top_k = cfg.experts_per_token();
        let replay_on_device = replay.map(|rp| upload_routing(rp, top_k, &device));
        let mut routing = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let slot = cache.as_deref_mut().map(|c| (&mut c.layers[i], &write));
            let h = layer.self_attn.forward(
                layer.input_layernorm.forward(x.clone()),
                &rope,
                mask.as_ref(),
                slot,
                weights,
            );
            let x1 = x + h;
            let normed = layer
                .post_attention_layernorm
                .forward(x1.clone())
                .reshape([b * t, cfg.hidden_size]);
            let (ff, r) = match &layer.mlp {
                FeedForward::Dense(mlp) => (mlp.forward(normed, weights), None),
                FeedForward::Moe(moe) => {
                    let forced = replay.zip(replay_on_device.as_ref()).and_then(|(rp, dv)| {
                        Some(Replay {
                            host: rp.get(i)?.as_deref()?,
                            device: dv.get(i)?.clone()?,
                        })
                    });
                    let (y, r) = moe.forward(normed, forced, weights);
                    (y, Some(r))
                }
            };
            routing.push(r);
            x = x1 + ff.reshape([b, t, cfg.hidden_size]);
        }
        if let Some(c) = cache {
            c.lens = past.iter().zip(&new_lens).map(|(p, n)| p + n).collect();
            c.capacity = total;
        }
        let x = self.norm.forward(x).reshape([b * t, cfg.hidden_size]);
        match at {
            Some(at) => {
                assert_eq!(at.len(), b, "one logits position per row");
                let rows: Vec<i64> = at
                    .iter()
                    .enumerate()
                    .map(|(r, &p)| {
                        assert!(p < t, "logits position {p} is past the row's {t} tokens");
                        (r * t + p) as i64
                    })
                    .collect();
                let idx = Tensor::<1, Int>::from_data(TensorData::new(rows, [b]), &device);
                (x.select(0, idx), routing)
            }
            None => (x, routing),
        }
    }

    /// A fresh cache for `batch` rows.
    pub fn new_cache(&self, batch: usize) -> KvCache {
        KvCache::new(self.layers.len(), batch)
    }
}

/// The embedded inputs `x` (`[b, t, hidden]`, from the ids `flat`) with no gradient into the rows of
/// `pad_token_id` through this lookup, as transformers' `nn.Embedding(padding_idx = pad_token_id)` (and
/// so verl's actor and TRL) trains: where the pad token is a real one (SmolLM2-Instruct's is its
/// `<|im_end|>`, in every chat prompt) its input row stays as it is; a tied output projection still
/// updates it, as there. The values are unchanged.
fn without_pad_gradient(x: Tensor<3>, flat: &[i64], pad: Option<u32>) -> Tensor<3> {
    let Some(pad) = pad.map(i64::from) else {
        return x;
    };
    if !x.is_tracked() || !flat.contains(&pad) {
        return x;
    }
    let dims = x.dims();
    let is_pad: Vec<bool> = flat.iter().map(|&id| id == pad).collect();
    let mask = Tensor::<1, Bool>::from_data(TensorData::new(is_pad, [flat.len()]), &x.device())
        .reshape([dims[0], dims[1], 1])
        .expand(dims);
    x.clone().mask_where(mask, x.detach())
}
