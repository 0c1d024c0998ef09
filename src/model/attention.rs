//! Grouped-query self-attention with optional per-head q/k RMSNorm (Qwen3), RoPE and a KV cache.

use burn::module::Module;
use burn::tensor::{DType, Device, IndexingUpdateOp, Int, Tensor};

use crate::ops::dtype::{as_dtype, zeros_of};

use super::config::ModelConfig;
use super::layers::{Linear, RmsNorm, Rope, Weights};
use crate::ops::det_matmul;

/// Keys and values of one layer for the tokens seen so far: `[B, kv_heads, S, head_dim]` each. Row `b`'s
/// real keys are the first `len[b]` slots (see [`super::decoder::KvCache`]); what lies beyond is masked.
#[derive(Debug, Clone)]
pub struct LayerKv {
    pub k: Tensor<4>,
    pub v: Tensor<4>,
}

/// Where the new keys and values of a forward go in the cache.
// One value per forward: the size difference between the variants is irrelevant.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum KvWrite {
    /// Every row has the same length `at`: write the new tokens at slots `at..at + t`, in place, into a
    /// buffer kept `width` slots wide (zeros beyond; `width` is the attention's key width, a multiple of the
    /// key block), so a decode step copies neither the cache nor a zero padding: the buffer grows once per
    /// key block.
    Append { at: usize, width: usize },
    /// Rows differ in length: grow the buffer to `len` slots and write token `t` of row `b` at slot
    /// `index[b, :, t, :]` (its own next position), so each row's keys stay contiguous from slot 0. Keeping
    /// every row's keys where an unpadded forward would have them makes the attention reductions run over the
    /// same elements in the same order as the full-sequence forward.
    Scatter { index: Tensor<4, Int>, len: usize },
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
    /// The attention of `cfg` with parameters not allocated yet (a lazy model's part, see
    /// [`super::params`]).
    pub fn lazy(cfg: &ModelConfig, device: &Device) -> Self {
        let (h, kv, d, hid) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        let norm = || {
            cfg.qk_norm
                .then(|| RmsNorm::lazy(d, cfg.rms_norm_eps, device))
        };
        Self {
            q_proj: Linear::lazy(hid, h * d, cfg.qkv_bias, device),
            k_proj: Linear::lazy(hid, kv * d, cfg.qkv_bias, device),
            v_proj: Linear::lazy(hid, kv * d, cfg.qkv_bias, device),
            o_proj: Linear::lazy(h * d, hid, cfg.o_bias, device),
            q_norm: norm(),
            k_norm: norm(),
            num_heads: h,
            num_kv_heads: kv,
            head_dim: d,
        }
    }

    /// `x: [B, T, hidden]`; `mask: [B, 1, T, S]` additive (0 or a large negative number), `S` = cached + `T`;
    /// `None` means every query sees every key (a single new token with no padding).
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &(Tensor<4>, Tensor<4>),
        mask: Option<&Tensor<4>>,
        cache: Option<(&mut Option<LayerKv>, &KvWrite)>,
        weights: Weights,
    ) -> Tensor<3> {
        let [b, t, hidden] = x.dims();
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let x2 = x.reshape([b * t, hidden]);
        let mut q = self
            .q_proj
            .forward_with(x2.clone(), weights)
            .reshape([b, t, h, d]);
        let mut k = self
            .k_proj
            .forward_with(x2.clone(), weights)
            .reshape([b, t, kv, d]);
        let v = self.v_proj.forward_with(x2, weights).reshape([b, t, kv, d]);
        if let Some(n) = &self.q_norm {
            q = n.forward(q);
        }
        if let Some(n) = &self.k_norm {
            k = n.forward(k);
        }
        let q = Rope::apply(q, &rope.0, &rope.1).swap_dims(1, 2);
        let mut k = Rope::apply(k, &rope.0, &rope.1).swap_dims(1, 2);
        let mut v = v.swap_dims(1, 2);
        if let Some((slot, write)) = cache {
            let prev = slot.take();
            let (device, dtype) = (k.device(), k.dtype());
            // `old` widened with zero slots to at least `len` (never narrowed).
            let grow = |old: Option<Tensor<4>>, len: usize| -> Tensor<4> {
                let have = old.as_ref().map_or(0, |o| o.dims()[2]);
                if have >= len {
                    return old.expect("a buffer at least `len` wide");
                }
                let zeros = zeros_of([b, kv, len - have, d], &device, dtype);
                match old {
                    Some(o) if have > 0 => Tensor::cat(vec![o, zeros], 2),
                    _ => zeros,
                }
            };
            (k, v) = match (write, prev) {
                (&KvWrite::Append { width, .. }, None) => {
                    let pad = |x: Tensor<4>| {
                        if width > t {
                            grow(Some(x), width)
                        } else {
                            x
                        }
                    };
                    (pad(k), pad(v))
                }
                (&KvWrite::Append { at, width }, Some(p)) => {
                    // In place when the buffer is uniquely owned (the cache's own copy, as here).
                    let put = |buf: Tensor<4>, x: Tensor<4>| {
                        grow(Some(buf), width.max(at + t))
                            .slice_assign([0..b, 0..kv, at..at + t, 0..d], x)
                    };
                    (put(p.k, k), put(p.v, v))
                }
                (KvWrite::Scatter { index, len }, prev) => {
                    let len = *len;
                    let grow = |old: Option<Tensor<4>>| grow(old, len);
                    let (pk, pv) = match prev {
                        Some(p) => (Some(p.k), Some(p.v)),
                        None => (None, None),
                    };
                    (
                        grow(pk).scatter(2, index.clone(), k, IndexingUpdateOp::Assign),
                        grow(pv).scatter(2, index.clone(), v, IndexingUpdateOp::Assign),
                    )
                }
            };
            *slot = Some(LayerKv {
                k: k.clone(),
                v: v.clone(),
            });
        }
        // Pad the key axis with zeros to the mask's width (the decoder rounds it up to a block multiple), or
        // leave out buffer slots beyond it.
        if let Some(m) = mask {
            let want = m.dims()[3];
            let have = k.dims()[2];
            if want > have {
                let zeros = zeros_of([b, kv, want - have, d], &k.device(), k.dtype());
                k = Tensor::cat(vec![k, zeros.clone()], 2);
                v = Tensor::cat(vec![v, zeros], 2);
            } else if want < have {
                k = k.narrow(2, 0, want);
                v = v.narrow(2, 0, want);
            }
        }
        // Grouped-query attention without copying K and V per query head: the `rep = h / kv` query heads
        // that share a key head are stacked along the query axis, `[b, kv, rep * t, d]`, against that key
        // head's `[b, kv, s, d]`. Every score and output element is the same dot product as with expanded
        // K/V (det_matmul sums each one in a fixed order), so the bits do not change, only the copies go.
        let rep = h / kv;
        let q = q.reshape([b, kv, rep * t, d]);
        // The scale as the tensor ops apply it (the f64 scalar rounded to f32 once).
        let scale = (1.0 / (d as f64).sqrt()) as f32;
        // Scores, softmax and the weighted sum in f32 whatever the activations' type; the output rounded once.
        let act = q.dtype();
        let [q, k, v] = [q, k, v].map(|t| as_dtype(t, DType::F32));
        let fused = mask.and_then(|m| {
            crate::ops::attention_core(q.clone(), k.clone(), v.clone(), m.clone(), scale)
        });
        let out = fused.unwrap_or_else(|| attention_core_ops(q, k, v, mask, scale, t));
        let out = as_dtype(out, act)
            .reshape([b, h, t, d])
            .swap_dims(1, 2)
            .reshape([b * t, h * d]);
        self.o_proj
            .forward_with(out, weights)
            .reshape([b, t, hidden])
    }
}

/// The core of grouped-query attention op by op: `q [b, kv, rep * t, d]` (the `rep` query heads of a key
/// head stacked along the rows), `k`/`v` `[b, kv, s, d]`, additive `mask` `[b, 1, t, s]` ->
/// `softmax(q k^T * scale + mask) v`, `[b, kv, rep * t, d]`. The path autodiff differentiates, and the
/// definition that [`crate::ops::attention_core`] (one fused op where the backend has it) matches
/// bit for bit.
pub fn attention_core_ops(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<&Tensor<4>>,
    scale: f32,
    t: usize,
) -> Tensor<4> {
    let [b, kv, rows, _] = q.dims();
    let s = k.dims()[2];
    let h = kv * rows / t.max(1);
    let mut scores = (det_matmul(q, k, true) * scale).reshape([b, h, t, s]);
    if let Some(m) = mask {
        scores = scores + m.clone();
    }
    let probs = crate::model::layers::softmax_exact(scores, 3).reshape([b, kv, rows, s]);
    det_matmul(probs, v, false)
}
