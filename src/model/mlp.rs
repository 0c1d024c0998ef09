//! Feed-forward blocks: the SwiGLU MLP and Qwen3-MoE's routed experts.

use std::borrow::Cow;

use burn::module::Module;
use burn::tensor::{DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};

use super::config::{ModelConfig, MoeConfig};
use super::layers::{Linear, Weights};
use crate::host::{reads_transfer, to_i64_vec};
use crate::ops::dtype::as_dtype;
use crate::ops::{
    forward_value_of, grouped_experts, grouped_moe, grouped_moe_matches_loop,
    grouped_moe_with_gradient, swiglu, tracks_gradients, ExpertMasters, ExpertWeights,
};

/// `down(silu(gate(x)) * up(x))`; the product is one op ([`swiglu`]: fused and parallel on the CPU).
#[derive(Module, Debug)]
pub struct SwiGlu {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl SwiGlu {
    /// A SwiGLU of these sizes with parameters not allocated yet (a lazy model's part, see
    /// [`super::params`]).
    pub fn lazy(hidden: usize, inter: usize, bias: bool, device: &Device) -> Self {
        Self {
            gate_proj: Linear::lazy(hidden, inter, bias, device),
            up_proj: Linear::lazy(hidden, inter, bias, device),
            down_proj: Linear::lazy(inter, hidden, bias, device),
        }
    }

    /// `x: [n, hidden] -> [n, hidden]`
    pub fn forward(&self, x: Tensor<2>, weights: Weights) -> Tensor<2> {
        let gate = self.gate_proj.forward_with(x.clone(), weights);
        let h = swiglu(gate, self.up_proj.forward_with(x, weights));
        self.down_proj.forward_with(h, weights)
    }
}

/// Routed experts: softmax over all experts, top-k, optional renormalisation of the k weights, weighted sum
/// of the chosen experts' SwiGLU outputs (transformers' `Qwen3MoeSparseMoeBlock`).
#[derive(Module, Debug)]
pub struct MoeBlock {
    /// Router, `[hidden, num_experts]` (kept full precision).
    pub gate: Linear,
    pub experts: Vec<SwiGlu>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

/// Which experts each token went to in one MoE layer, on the host: `[n_tokens * top_k]`, token-major (the
/// rollout's record, routing replay).
pub type Routing = Vec<u32>;

/// The same on the model's device, `[n_tokens, top_k]` ids: what a forward returns. It stays there (the
/// grouped kernel groups the tokens on the device); a caller that needs it on the host reads every layer
/// at once ([`routing_to_host`], [`rows_and_routing`]).
pub type DeviceRouting = Tensor<2, Int>;

/// Replayed experts of one MoE layer (routing replay), in both places they are needed: on the host (the
/// per-expert loop groups the tokens by them) and on the device (the router's weights are gathered at
/// them; the grouped kernel groups by them there).
#[derive(Debug, Clone)]
pub struct Replay<'a> {
    /// `[n_tokens * top_k]`, token-major.
    pub host: &'a [u32],
    /// The same, `[n_tokens, top_k]`.
    pub device: DeviceRouting,
}

impl<'a> Replay<'a> {
    /// `ids` (`[n_tokens * top_k]`) uploaded for one layer.
    pub fn upload(ids: &'a [u32], top_k: usize, device: &Device) -> Self {
        let device = upload_routing(&[Some(ids.to_vec())], top_k, device)
            .remove(0)
            .expect("one layer");
        Self { host: ids, device }
    }
}

/// The replayed routings of every layer on the device, in one upload for all layers (each MoE layer's
/// `[n_tokens, top_k]` a slice of it), so that a training forward under replay neither uploads nor reads
/// anything per layer for its routing.
pub fn upload_routing(
    layers: &[Option<Routing>],
    top_k: usize,
    device: &Device,
) -> Vec<Option<DeviceRouting>> {
    let flat: Vec<i64> = layers
        .iter()
        .flatten()
        .flat_map(|r| r.iter().map(|&e| e as i64))
        .collect();
    let len = flat.len();
    let all = Tensor::<1, Int>::from_data(TensorData::new(flat, [len]), device);
    let mut at = 0;
    layers
        .iter()
        .map(|r| {
            let r = r.as_ref()?;
            let slice = all.clone().narrow(0, at, r.len());
            at += r.len();
            Some(slice.reshape([r.len() / top_k.max(1), top_k]))
        })
        .collect()
}

/// Host copies of the layers' routings, in one device-to-host read for all layers.
pub fn routing_to_host(layers: Vec<Option<DeviceRouting>>) -> Vec<Option<Routing>> {
    rows_and_routing(None, layers).1
}

/// The rows of `t` (`[B, V]`, e.g. a decode step's logits) and host copies of the layers' routings, in one
/// device-to-host read ([`crate::host::rows_and_ids`]).
pub fn rows_and_routing(
    t: Option<Tensor<2>>,
    layers: Vec<Option<DeviceRouting>>,
) -> (Vec<Vec<f32>>, Vec<Option<Routing>>) {
    let present: Vec<bool> = layers.iter().map(Option::is_some).collect();
    let flat = layers
        .into_iter()
        .flatten()
        .map(|r| {
            let [n, k] = r.dims();
            r.reshape([n * k])
        })
        .collect();
    let (rows, ids) = crate::host::rows_and_ids(t, flat);
    let mut ids = ids.into_iter();
    let routing = present
        .into_iter()
        .map(|p| p.then(|| ids.next().expect("one host copy per MoE layer")))
        .collect();
    (rows, routing)
}

impl MoeBlock {
    /// The routed experts of `moe` with parameters not allocated yet (a lazy model's part, see
    /// [`super::params`]).
    pub fn lazy(hidden: usize, moe: &MoeConfig, device: &Device) -> Self {
        Self {
            gate: Linear::lazy(hidden, moe.num_experts, false, device),
            experts: (0..moe.num_experts)
                .map(|_| SwiGlu::lazy(hidden, moe.moe_intermediate_size, false, device))
                .collect(),
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
        }
    }

    /// `x: [n, hidden] -> ([n, hidden], routing)`. With `replay`, the given experts are used instead of the
    /// router's own top-k (routing replay); their weights still come from this router's probabilities.
    ///
    /// When every expert projection is quantized (one scheme, no bias), the experts run as one grouped op
    /// ([`crate::ops`]):
    /// - on wgpu/CUDA, the grouped MoE kernel's launch chain; under autodiff (f32) its training pair: the
    ///   same output bits with the activations kept, and a grouped backward to the input, the routing
    ///   weights and the experts' masters, so the layer is computed once. Where the backend has no
    ///   training pair (half activations), the grouped output is the value and the per-expert graph gives
    ///   the gradient, a second computation of the layer;
    /// - on the CPU, the experts in parallel on the packed kernel layout ([`crate::ops::cpu::moe`]), the
    ///   per-expert loop's exact bits, so a training forward runs the loop alone.
    ///
    /// Full-precision experts run one by one ([`MoeBlock::forward_with`]).
    ///
    /// The router's choices stay on the device: the grouped kernel groups the tokens there, and they come
    /// back as a [`DeviceRouting`]. Full-precision experts on a GPU, in a forward without gradients of at
    /// most [`MASKED_MAX_TOKENS`] tokens (decode steps), run masked on the device
    /// (`MoeBlock::masked_experts`). Only the per-expert loop groups on the host: it reads the ids (one
    /// read per layer) unless they came from the host (`replay`), so a GPU forward reads nothing per layer
    /// on the grouped and masked paths and under routing replay.
    pub fn forward(
        &self,
        x: Tensor<2>,
        replay: Option<Replay<'_>>,
        weights: Weights,
    ) -> (Tensor<2>, DeviceRouting) {
        self.forward_with(x, replay, ExpertPath::Auto, weights)
    }

    /// [`MoeBlock::forward`] with the experts' path named (tests compare the grouped kernel with the loop).
    /// Half activations are read as f32 and only the block's output is rounded back: the router, the
    /// experts and their weighted sum run in f32, as the grouped kernel sums the whole expert chain.
    pub fn forward_with(
        &self,
        x: Tensor<2>,
        replay: Option<Replay<'_>>,
        path: ExpertPath,
        weights: Weights,
    ) -> (Tensor<2>, DeviceRouting) {
        let act = x.dtype();
        let (out, ids) = self.forward_f32(as_dtype(x, DType::F32), replay, path, weights);
        (as_dtype(out, act), ids)
    }

    /// [`MoeBlock::forward_with`] on f32 activations.
    fn forward_f32(
        &self,
        x: Tensor<2>,
        replay: Option<Replay<'_>>,
        path: ExpertPath,
        weights: Weights,
    ) -> (Tensor<2>, DeviceRouting) {
        let [n, _] = x.dims();
        let probs = super::layers::softmax_exact(self.gate.forward_with(x.clone(), weights), 1);
        let (route_w, ids) = match &replay {
            Some(r) => {
                assert_eq!(
                    (r.host.len(), r.device.dims()),
                    (n * self.top_k, [n, self.top_k]),
                    "replayed routing has one entry per token and slot"
                );
                (probs.gather(1, r.device.clone()), r.device.clone())
            }
            None => probs.topk_with_indices(self.top_k, 1),
        };
        let replay = replay.map(|r| r.host);
        let route_w = if self.norm_topk_prob {
            renormalize(route_w)
        } else {
            route_w
        };
        let tracked = self.tracks_gradients(&x, &route_w);
        // On the CPU the grouped op is the loop's bits: a training forward needs the loop alone.
        let experts = match path {
            ExpertPath::Auto
                if weights == Weights::Packed
                    && grouped_experts()
                    && !(tracked && grouped_moe_matches_loop(&x)) =>
            {
                self.quantized_experts()
            }
            _ => None,
        };
        let per_expert = |x: Tensor<2>, route_w: Tensor<2>| {
            self.per_expert(x, &host_ids(replay, &ids), route_w, weights)
        };
        let grouped = |ew: ExpertWeights| grouped_moe(x.clone(), route_w.clone(), ids.clone(), ew);
        let out = match experts {
            Some(ew) if tracked => {
                match grouped_moe_with_gradient(
                    x.clone(),
                    route_w.clone(),
                    ids.clone(),
                    ew.clone(),
                    || self.masters(),
                ) {
                    Some(out) => out,
                    // No one-pass backward for these inputs: the grouped kernel's bits, the per-expert
                    // graph's gradient.
                    None => match grouped(ew) {
                        Some(fast) => forward_value_of(per_expert(x, route_w), fast),
                        None => per_expert(x, route_w),
                    },
                }
            }
            Some(ew) => grouped(ew).unwrap_or_else(|| per_expert(x, route_w)),
            None if self.masks_on_device(&x, replay.is_some(), tracked, path) => {
                self.masked_experts(x, &ids, route_w, weights)
            }
            None => per_expert(x, route_w),
        };
        (out, ids)
    }

    /// The experts one by one: `out[t] += w[t, j] * expert_e(x[t])` for each expert `e` in order and its
    /// (token, slot) pairs, through [`SwiGlu::forward`] (so through the per-linear quantized op).
    fn per_expert(
        &self,
        x: Tensor<2>,
        chosen: &[u32],
        route_w: Tensor<2>,
        weights: Weights,
    ) -> Tensor<2> {
        let [n, hidden] = x.dims();
        let device = x.device();
        let flat_weights = route_w.reshape([n * self.top_k]);

        // Group (token, slot) pairs by expert on the host; each expert runs once on its tokens.
        let mut tokens_of: Vec<Vec<i64>> = vec![Vec::new(); self.experts.len()];
        let mut slots_of: Vec<Vec<i64>> = vec![Vec::new(); self.experts.len()];
        for (pos, &e) in chosen.iter().enumerate() {
            tokens_of[e as usize].push((pos / self.top_k) as i64);
            slots_of[e as usize].push(pos as i64);
        }
        let mut out = Tensor::<2>::zeros([n, hidden], &device);
        for (e, expert) in self.experts.iter().enumerate() {
            if tokens_of[e].is_empty() {
                continue;
            }
            let m = tokens_of[e].len();
            let tok =
                Tensor::<1, Int>::from_data(TensorData::new(tokens_of[e].clone(), [m]), &device);
            let slot =
                Tensor::<1, Int>::from_data(TensorData::new(slots_of[e].clone(), [m]), &device);
            let y = expert.forward(x.clone().select(0, tok.clone()), weights);
            let w = flat_weights.clone().select(0, slot).reshape([m, 1]);
            out = out.select_assign(0, tok, y * w, IndexingUpdateOp::Add);
        }
        out
    }

    /// Whether a forward runs its (full-precision) experts masked on the device
    /// ([`MoeBlock::masked_experts`]) rather than grouped on the host: a forward without gradients (a
    /// decode step, a prefill) of at most [`MASKED_MAX_TOKENS`] tokens on a device whose reads are
    /// transfers, under the router's own choices (replayed ones are on the host already), with the grouped
    /// path switched on ([`grouped_experts`]: off, every forward groups on the host, the reference).
    fn masks_on_device(
        &self,
        x: &Tensor<2>,
        replayed: bool,
        tracked: bool,
        path: ExpertPath,
    ) -> bool {
        path == ExpertPath::Auto
            && !replayed
            && !tracked
            && grouped_experts()
            && x.dims()[0] <= MASKED_MAX_TOKENS
            && reads_transfer(&x.device())
    }

    /// The experts without grouping: every expert on every token, its output times the token's routing
    /// weight for it (0 where the token did not choose it), summed in expert order. The ids never leave
    /// the device. Bit for bit the per-expert loop's result (its rows are the same products, in a
    /// batch-invariant matmul; its sums add the same terms in the same order, plus exact zeros), at
    /// `experts / top_k` times the loop's arithmetic, which a decode step's reading of the weights
    /// dominates.
    fn masked_experts(
        &self,
        x: Tensor<2>,
        ids: &Tensor<2, Int>,
        route_w: Tensor<2>,
        weights: Weights,
    ) -> Tensor<2> {
        let [n, hidden] = x.dims();
        let mut out = Tensor::<2>::zeros([n, hidden], &x.device());
        for (e, expert) in self.experts.iter().enumerate() {
            // At most one slot of a token holds expert `e`: the sum is that slot's weight, or 0.
            let chose = ids.clone().equal_elem(e as i64).float();
            let w = (route_w.clone() * chose).sum_dim(1);
            out = out + expert.forward(x.clone(), weights) * w;
        }
        out
    }

    /// Every expert's packed gate/up/down weights, when all are quantized with one scheme and none has a
    /// bias (what the grouped kernel computes); `None` otherwise.
    fn quantized_experts(&self) -> Option<ExpertWeights> {
        let packed = |l: &Linear| match (&l.quant, &l.bias) {
            (Some(q), None) => Some(q.packed.clone()),
            _ => None,
        };
        let collect = |f: fn(&SwiGlu) -> &Linear| -> Option<Vec<_>> {
            self.experts.iter().map(|e| packed(f(e))).collect()
        };
        ExpertWeights::new(
            collect(|e| &e.gate_proj)?,
            collect(|e| &e.up_proj)?,
            collect(|e| &e.down_proj)?,
        )
    }

    /// The experts' f32 masters (`[in, out]`), for the grouped op's one-pass backward.
    fn masters(&self) -> ExpertMasters {
        let each =
            |f: fn(&SwiGlu) -> &Linear| self.experts.iter().map(|e| f(e).weight.val()).collect();
        ExpertMasters {
            gate: each(|e| &e.gate_proj),
            up: each(|e| &e.up_proj),
            down: each(|e| &e.down_proj),
        }
    }

    /// Whether a gradient will flow through this layer's experts: the input, the routing weights or any
    /// expert's master weight is tracked.
    fn tracks_gradients(&self, x: &Tensor<2>, weights: &Tensor<2>) -> bool {
        tracks_gradients(x)
            || tracks_gradients(weights)
            || self.experts.iter().any(|e| {
                [&e.gate_proj, &e.up_proj, &e.down_proj]
                    .iter()
                    .any(|l| tracks_gradients(&l.weight.val()))
            })
    }
}

/// The chosen experts' weights `w [n, top_k]` divided by their sum over the slots (`norm_topk_prob`). The
/// sum adds the slots left to right, one elementwise add per slot, so a token's bits do not depend on how
/// many tokens share the call (a backend's row reduction may pick its order by shape, and the rollout's
/// decode step and the training forward have different shapes: with top-k > 2 that would break the
/// bitwise contract).
pub fn renormalize(w: Tensor<2>) -> Tensor<2> {
    let [_, k] = w.dims();
    let sum = (1..k).fold(w.clone().narrow(1, 0, 1), |acc, j| {
        acc + w.clone().narrow(1, j, 1)
    });
    w / sum
}

/// The experts as the per-expert loop needs them, on the host: the replayed ids as given, else the
/// router's `ids` read back (one read).
fn host_ids<'a>(replay: Option<&'a [u32]>, ids: &Tensor<2, Int>) -> Cow<'a, [u32]> {
    match replay {
        Some(r) => Cow::Borrowed(r),
        None => Cow::Owned(
            to_i64_vec(ids.clone())
                .into_iter()
                .map(|e| e as u32)
                .collect(),
        ),
    }
}

/// Tokens up to which a forward without gradients on a GPU runs full-precision experts masked on the
/// device (`MoeBlock::masked_experts`) instead of reading the expert ids back to group them: decode
/// steps and short prefills, where reading the weights costs more than the extra arithmetic and a read
/// per layer would stall the step. Either path gives the same bits.
pub const MASKED_MAX_TOKENS: usize = 256;

/// Which path [`MoeBlock::forward_with`] runs the routed experts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPath {
    /// The grouped MoE kernel when the backend has one and every expert is quantized, else the loop.
    Auto,
    /// One expert at a time (the CPU path; the reference the grouped kernel is tested against).
    PerExpert,
}

/// The feed-forward block of one decoder layer.
// One value per layer, so the size difference between the variants costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum FeedForward {
    Dense(SwiGlu),
    Moe(MoeBlock),
}

impl FeedForward {
    /// The feed-forward block of layer `layer` of `cfg` (routed experts in a sparse layer of an MoE model,
    /// else a dense SwiGLU) with parameters not allocated yet (a lazy model's part, see [`super::params`]).
    pub fn lazy(layer: usize, cfg: &ModelConfig, device: &Device) -> Self {
        match &cfg.moe {
            Some(moe) if cfg.is_sparse_layer(layer) => {
                Self::Moe(MoeBlock::lazy(cfg.hidden_size, moe, device))
            }
            _ => Self::Dense(SwiGlu::lazy(
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.mlp_bias,
                device,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The renormalised weights are `w / sum` with the sum taken left to right over the slots, in f32,
    /// bit for bit; the values make the order visible (a pairwise sum rounds differently).
    #[test]
    fn renormalize_sums_the_slots_left_to_right() {
        let device = Device::flex();
        let rows: [[f32; 8]; 2] = [
            [0.5, 1e-8, 1e-8, 1e-8, 1e-8, 0.25, 3e-8, 0.125],
            [1e-3, 0.3, 7e-9, 0.2, 1e-7, 0.1, 0.05, 2e-8],
        ];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let w = Tensor::<2>::from_data(TensorData::new(flat, [2, 8]), &device);
        let got = crate::host::to_f32_vec(renormalize(w));
        let mut pairwise_differs = false;
        for (r, row) in rows.iter().enumerate() {
            let sum = row.iter().fold(0.0f32, |a, &b| a + b);
            let pairwise =
                ((row[0] + row[1]) + (row[2] + row[3])) + ((row[4] + row[5]) + (row[6] + row[7]));
            pairwise_differs |= pairwise != sum;
            for (j, &v) in row.iter().enumerate() {
                assert_eq!(
                    got[r * 8 + j].to_bits(),
                    (v / sum).to_bits(),
                    "row {r} slot {j}"
                );
            }
        }
        assert!(
            pairwise_differs,
            "the test values do not tell the orders apart"
        );
    }
}
