//! The config-driven decoder-only transformer shared by Llama, Qwen2, Qwen3 and Qwen3-MoE.

use std::path::Path;

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor, TensorData};

use super::attention::{Attention, LayerKv};
use super::checkpoint::Checkpoint;
use super::config::ModelConfig;
use super::error::LoadError;
use super::layers::{tensor_from_vec, Linear, RmsNorm, Rope};
use super::mlp::{FeedForward, Routing};

/// Additive mask value for keys a query must not see. Finite (not -inf) so that a padding query that sees no
/// key at all gets a uniform, finite distribution instead of NaN, which would leak into later layers.
const MASKED: f32 = -1.0e30;

#[derive(Module, Debug)]
pub struct DecoderLayer {
    pub input_layernorm: RmsNorm,
    pub self_attn: Attention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: FeedForward,
}

/// Per-layer attention state for incremental decoding, plus per-row bookkeeping of which cached positions are
/// real tokens (left padding) and the next RoPE position of each row.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub layers: Vec<Option<LayerKv>>,
    /// `valid[b][s]`: whether cached slot `s` of row `b` holds a real token.
    pub valid: Vec<Vec<bool>>,
}

impl KvCache {
    pub fn new(num_layers: usize, batch: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            valid: vec![Vec::new(); batch],
        }
    }

    /// Number of cached slots (the same for every row).
    pub fn len(&self) -> usize {
        self.valid.first().map_or(0, Vec::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-arranges the batch: row `i` of the result is row `rows[i]` of the cache. Drops finished rows
    /// (finished sequences stop costing compute) and fans a prompt out to several samples (repeated indices).
    pub fn select_rows(&mut self, rows: &[usize]) {
        if rows.iter().copied().eq(0..self.valid.len()) {
            return;
        }
        self.valid = rows.iter().map(|&r| self.valid[r].clone()).collect();
        let Some(device) = self.layers.iter().flatten().next().map(|l| l.k.device()) else {
            return;
        };
        let idx = Tensor::<1, Int>::from_data(
            TensorData::new(rows.iter().map(|&r| r as i64).collect::<Vec<_>>(), [rows.len()]),
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
    /// For each layer, the experts chosen for each token (`[B * T * top_k]`, token-major), `None` for dense layers.
    pub routing: Vec<Option<Routing>>,
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
}

impl Decoder {
    /// Loads `config.json` and the safetensors weights of a Hugging Face model directory.
    pub fn load(dir: impl AsRef<Path>, device: &Device) -> Result<Self, LoadError> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_file(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ckpt, device)
    }

    /// Builds the model from an open checkpoint, failing on any missing, mis-shaped or extra tensor.
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        device: &Device,
    ) -> Result<Self, LoadError> {
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed = ckpt.read_f32("model.embed_tokens.weight", &[v, h])?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                Ok(DecoderLayer {
                    input_layernorm: RmsNorm::load(
                        ckpt,
                        &format!("{p}.input_layernorm.weight"),
                        h,
                        config.rms_norm_eps,
                        device,
                    )?,
                    self_attn: Attention::load(ckpt, &format!("{p}.self_attn"), &config, device)?,
                    post_attention_layernorm: RmsNorm::load(
                        ckpt,
                        &format!("{p}.post_attention_layernorm.weight"),
                        h,
                        config.rms_norm_eps,
                        device,
                    )?,
                    mlp: FeedForward::load(ckpt, &format!("{p}.mlp"), i, &config, device)?,
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let norm = RmsNorm::load(ckpt, "model.norm.weight", h, config.rms_norm_eps, device)?;
        let lm_head = if config.tie_word_embeddings {
            // Some exports store the tied head anyway; it is the embedding matrix, so it is not an extra.
            ckpt.ignore("lm_head.weight");
            None
        } else {
            Some(Linear::load(ckpt, "lm_head", h, v, false, device)?)
        };
        ckpt.ensure_all_used()?;
        Ok(Self {
            embed_tokens: Param::from_tensor(tensor_from_vec(embed, [v, h], device)),
            layers,
            norm,
            lm_head,
            rope: Rope::new(config.head_dim, config.rope_theta),
            config,
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.embed_tokens.val().device()
    }

    /// Checks that token ids fit the vocabulary and rows have equal length; the message says what is wrong.
    pub fn check_ids(&self, ids: &[Vec<u32>]) -> Result<(), String> {
        self.check_prompts(ids)?;
        let first = ids[0].len();
        match ids.iter().position(|r| r.len() != first) {
            Some(b) => Err(format!("row {b} has {} ids, row 0 has {first}: rows must have equal lengths", ids[b].len())),
            None => Ok(()),
        }
    }

    /// Checks that there is at least one non-empty row and every id fits the vocabulary (rows may differ in
    /// length, as prompts do).
    pub fn check_prompts(&self, ids: &[Vec<u32>]) -> Result<(), String> {
        let Some(first) = ids.first() else {
            return Err("no sequences given".into());
        };
        if first.is_empty() {
            return Err("sequences must not be empty".into());
        }
        for (b, row) in ids.iter().enumerate() {
            if row.len() != first.len() {
                return Err(format!(
                    "row {b} has {} ids, row 0 has {}: rows must have equal lengths",
                    row.len(),
                    first.len()
                ));
            }
            if let Some(&bad) = row.iter().find(|&&t| t as usize >= self.config.vocab_size) {
                return Err(format!(
                    "row {b}: token id {bad} is outside the vocabulary (size {})",
                    self.config.vocab_size
                ));
            }
        }
        Ok(())
    }

    /// Full forward over `ids` (`B` rows of `T` tokens each).
    ///
    /// - `pad[b][t]`: whether token `t` of row `b` is real (`None`: all real). Padding tokens are neither
    ///   attended to nor counted in RoPE positions, so a left-padded row computes exactly what it would alone.
    /// - `cache`: when given, the new tokens are appended to it and attend to everything cached.
    /// - `replay`: per layer, expert choices to reuse instead of the router's (MoE routing replay).
    pub fn forward(
        &self,
        ids: &[Vec<u32>],
        pad: Option<&[Vec<bool>]>,
        mut cache: Option<&mut KvCache>,
        replay: Option<&[Option<Routing>]>,
    ) -> ForwardOutput {
        let device = self.device();
        let b = ids.len();
        let t = ids[0].len();
        let cfg = &self.config;

        // Which keys are real, per row: the cached ones followed by the new ones.
        let new_valid: Vec<Vec<bool>> = match pad {
            Some(p) => p.to_vec(),
            None => vec![vec![true; t]; b],
        };
        let past_valid: Vec<Vec<bool>> = match &cache {
            Some(c) if !c.valid.is_empty() && c.valid.len() == b => c.valid.clone(),
            _ => vec![Vec::new(); b],
        };
        let past = past_valid[0].len();
        let s = past + t;
        let positions: Vec<Vec<usize>> = (0..b)
            .map(|r| {
                let mut p = past_valid[r].iter().filter(|&&v| v).count();
                new_valid[r]
                    .iter()
                    .map(|&v| {
                        let here = p;
                        if v {
                            p += 1;
                        }
                        if v {
                            here
                        } else {
                            0
                        }
                    })
                    .collect()
            })
            .collect();
        let any_pad = past_valid
            .iter()
            .chain(new_valid.iter())
            .any(|row| row.iter().any(|&v| !v));
        let mask = (t > 1 || any_pad).then(|| {
            let mut m = Vec::with_capacity(b * t * s);
            for r in 0..b {
                for q in 0..t {
                    for k in 0..s {
                        let real = if k < past {
                            past_valid[r][k]
                        } else {
                            new_valid[r][k - past]
                        };
                        let visible = real && k <= past + q;
                        m.push(if visible { 0.0 } else { MASKED });
                    }
                }
            }
            tensor_from_vec(m, [b, 1, t, s], &device)
        });
        let rope = self.rope.tables(&positions, &device);

        let flat: Vec<i64> = ids.iter().flatten().map(|&x| x as i64).collect();
        let idx = Tensor::<1, Int>::from_data(TensorData::new(flat, [b * t]), &device);
        let mut x = self
            .embed_tokens
            .val()
            .select(0, idx)
            .reshape([b, t, cfg.hidden_size]);

        let mut routing = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let slot = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            let h = layer.self_attn.forward(
                layer.input_layernorm.forward(x.clone()),
                &rope,
                mask.as_ref(),
                slot,
            );
            let x1 = x + h;
            let normed = layer
                .post_attention_layernorm
                .forward(x1.clone())
                .reshape([b * t, cfg.hidden_size]);
            let (ff, r) = match &layer.mlp {
                FeedForward::Dense(mlp) => (mlp.forward(normed), None),
                FeedForward::Moe(moe) => {
                    let forced = replay.and_then(|rp| rp.get(i)).and_then(|r| r.as_deref());
                    let (y, r) = moe.forward(normed, forced);
                    (y, Some(r))
                }
            };
            routing.push(r);
            x = x1 + ff.reshape([b, t, cfg.hidden_size]);
        }
        if let Some(c) = cache {
            c.valid = past_valid
                .into_iter()
                .zip(new_valid)
                .map(|(mut a, n)| {
                    a.extend(n);
                    a
                })
                .collect();
        }
        let x = self.norm.forward(x).reshape([b * t, cfg.hidden_size]);
        let logits = match &self.lm_head {
            Some(head) => head.forward(x),
            None => x.matmul(self.embed_tokens.val().transpose()),
        };
        ForwardOutput {
            logits: logits.reshape([b, t, cfg.vocab_size]),
            routing,
        }
    }

    /// A fresh cache for `batch` rows.
    pub fn new_cache(&self, batch: usize) -> KvCache {
        KvCache::new(self.layers.len(), batch)
    }
}
