//! Grouped-query self-attention with optional per-head q/k RMSNorm (Qwen3), RoPE and a KV cache.

use burn::module::Module;
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Tensor};

use super::checkpoint::Checkpoint;
use super::config::ModelConfig;
use super::error::LoadError;
use super::layers::{Linear, RmsNorm, Rope};

/// Keys and values of one layer for the tokens seen so far: `[B, kv_heads, S, head_dim]` each.
#[derive(Debug, Clone)]
pub struct LayerKv {
    pub k: Tensor<4>,
    pub v: Tensor<4>,
}

#[derive(Module, Debug)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl Attention {
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        cfg: &ModelConfig,
        device: &Device,
    ) -> Result<Self, LoadError> {
        let (h, kv, d, hid) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        let norm = |name: &str| -> Result<Option<RmsNorm>, LoadError> {
            if cfg.qk_norm {
                Ok(Some(RmsNorm::load(
                    ckpt,
                    &format!("{prefix}.{name}.weight"),
                    d,
                    cfg.rms_norm_eps,
                    device,
                )?))
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            q_proj: Linear::load(
                ckpt,
                &format!("{prefix}.q_proj"),
                hid,
                h * d,
                cfg.qkv_bias,
                device,
            )?,
            k_proj: Linear::load(
                ckpt,
                &format!("{prefix}.k_proj"),
                hid,
                kv * d,
                cfg.qkv_bias,
                device,
            )?,
            v_proj: Linear::load(
                ckpt,
                &format!("{prefix}.v_proj"),
                hid,
                kv * d,
                cfg.qkv_bias,
                device,
            )?,
            o_proj: Linear::load(
                ckpt,
                &format!("{prefix}.o_proj"),
                h * d,
                hid,
                cfg.o_bias,
                device,
            )?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            num_heads: h,
            num_kv_heads: kv,
            head_dim: d,
        })
    }

    /// `x: [B, T, hidden]`; `mask: [B, 1, T, S]` additive (0 or a large negative number), `S` = cached + `T`;
    /// `None` means every query sees every key (a single new token with no padding).
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &(Tensor<4>, Tensor<4>),
        mask: Option<&Tensor<4>>,
        cache: Option<&mut Option<LayerKv>>,
    ) -> Tensor<3> {
        let [b, t, hidden] = x.dims();
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let x2 = x.reshape([b * t, hidden]);
        let mut q = self.q_proj.forward(x2.clone()).reshape([b, t, h, d]);
        let mut k = self.k_proj.forward(x2.clone()).reshape([b, t, kv, d]);
        let v = self.v_proj.forward(x2).reshape([b, t, kv, d]);
        if let Some(n) = &self.q_norm {
            q = n.forward(q);
        }
        if let Some(n) = &self.k_norm {
            k = n.forward(k);
        }
        let q = Rope::apply(q, &rope.0, &rope.1).swap_dims(1, 2);
        let mut k = Rope::apply(k, &rope.0, &rope.1).swap_dims(1, 2);
        let mut v = v.swap_dims(1, 2);
        if let Some(slot) = cache {
            if let Some(prev) = slot.take() {
                k = Tensor::cat(vec![prev.k, k], 2);
                v = Tensor::cat(vec![prev.v, v], 2);
            }
            *slot = Some(LayerKv {
                k: k.clone(),
                v: v.clone(),
            });
        }
        let s = k.dims()[2];
        let rep = h / kv;
        let (k, v) = if rep > 1 {
            (
                k.unsqueeze_dim::<5>(2)
                    .expand([b, kv, rep, s, d])
                    .reshape([b, h, s, d]),
                v.unsqueeze_dim::<5>(2)
                    .expand([b, kv, rep, s, d])
                    .reshape([b, h, s, d]),
            )
        } else {
            (k, v)
        };
        let mut scores = q.matmul(k.swap_dims(2, 3)) * (1.0 / (d as f64).sqrt());
        if let Some(m) = mask {
            scores = scores + m.clone();
        }
        let probs = softmax(scores, 3);
        let out = probs.matmul(v).swap_dims(1, 2).reshape([b * t, h * d]);
        self.o_proj.forward(out).reshape([b, t, hidden])
    }
}
