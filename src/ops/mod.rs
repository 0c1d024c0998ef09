//! The custom backend ops of qarl: every computation whose arithmetic the bitwise rollout/training contract
//! fixes, as one burn backend extension ([`KernelOps`]) with an implementation per backend.
//!
//! - [`cpu`]: the CPU (burn flex) implementation and its SIMD kernels: the low-bit matmul
//!   ([`cpu::kernel`]), the fixed-order f32 matmul and softmax, the fused attention core
//!   ([`cpu::attention`]) and the grouped MoE experts ([`cpu::moe`]).
//! - `cube` (features `wgpu` / `cuda`): the CubeCL backends, through the `cube_kernels` crate.
//! - `autodiff`: the training backend: the straight-through backward of the low-bit matmul (`dW = x^T g`
//!   to the f32 master, `dx = g · dequant(Q(W))`), and the backwards of the fixed-order matmul and softmax.
//! - [`packed`]: the packed weights these ops read ([`QuantizedWeight`], [`ExpertWeights`]), made once per
//!   weight version.
//! - [`switches`]: the process-wide deterministic and grouped-experts switches (and `QARL_POISON_OUTPUTS`).
//! - [`backend`]: which backend a command runs on ([`BackendKind`]).
//!
//! The model ([`crate::model`]) calls the tensor-level functions below; it never sees a backend type.
//!
//! # Grouped MoE experts
//! [`grouped_moe`] runs the routed experts of one MoE layer as one op: on the CubeCL backends the grouped
//! kernel of `cube_kernels` (gate+up with SwiGLU, down, un-permute and combine in one launch chain, the
//! tokens grouped by expert on the device: the expert ids are never read back), on the CPU [`cpu::moe`]; a
//! backend without it answers `None` and the model runs its per-expert loop.
//!
//! **Rollout and training agree bitwise.** On the CubeCL backends (f32 activations) a training forward runs
//! [`grouped_moe_with_gradient`]: the grouped kernel's training pair, whose forward returns the very bits
//! the rollout computes (and keeps the gate, up, SwiGLU and expert outputs), and whose backward runs on the
//! device: through the combine and the routing weights, the transposed products of the same packed weights
//! for the input gradients, and the straight-through gradients of the experts' f32 masters (the quantizer
//! as the identity, as for every quantized linear). The layer is computed once. The masters reach the op as
//! three expert-major stacks (a copy of the layer's masters per training forward, freed at once; the stack's
//! backward hands each expert its slice).
//!
//! Where the backend has no training pair (half activations), the training forward returns the grouped
//! op's output as its value and takes the gradient from the per-expert graph through [`forward_value_of`]:
//! `forward_value_of(y_graph, y_fast)` has the value of `y_fast` and passes the incoming gradient to
//! `y_graph` unchanged (a straight-through estimator between two computations of the same function that
//! differ only by rounding), at the cost of computing the layer twice. On the CPU the grouped op equals the
//! loop bit for bit ([`grouped_moe_matches_loop`]), so a training forward runs the loop alone.
//!
//! Untracked forwards (rollout, evaluation) run the grouped kernel alone.

mod autodiff;
pub mod backend;
pub mod cpu;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
pub mod dtype;
pub mod packed;
pub mod switches;

pub use backend::BackendKind;
use dtype::{as_dtype, f32_of, in_f32};
pub use packed::{ExpertWeights, PackedWeight, QuantizedWeight};
pub use switches::{
    check_poison_env, deterministic, fragment_group_splits, fragment_tiles, grouped_experts,
    poison_outputs, set_deterministic, set_fragment_group_splits, set_fragment_tiles,
    set_grouped_experts, set_tensor_tiles, tensor_tiles,
};

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{Int, Tensor, TensorData};
use std::sync::atomic::{AtomicU64, Ordering};

/// `dequant(Q(W))` in HF layout `[out, in]` as a tensor of backend `B` on `device`.
fn dequantized_out_in<B: Backend>(packed: &PackedWeight, device: &B::Device) -> FloatTensor<B> {
    B::float_from_data(
        TensorData::new(packed.0.dequantize(), packed.0.shape()),
        device,
    )
}

/// The backend extension carrying the low-bit matmul. Backends without a dedicated kernel yet use the
/// default body (a float matmul on the dequantized weights: the same values, another summation order).
#[backend_extension(Autodiff, Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")))]
pub trait KernelOps: Backend {
    /// `x [n, in] · dequant(Q(W))^T` from the packed weights; `master` (`[in, out]`) only receives the
    /// straight-through gradient.
    fn quant_matmul(
        x: FloatTensor<Self>,
        master: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        let _ = master;
        let w = dequantized_out_in::<Self>(&packed, &x.device());
        Self::float_matmul(x, Self::float_transpose(w))
    }

    /// Whether [`Self::quant_matmul`] reads activations like `x` in their own half type (the CubeCL
    /// kernels, where the device has it): the f32 sums and one rounding of the kernels' precision contract,
    /// so the same bits as widening them to f32 first, at half the bytes read and without the casts.
    /// `false` (the default) for f32 and where the backend widens them itself.
    fn quant_matmul_takes_half(x: &FloatTensor<Self>) -> bool {
        let _ = x;
        false
    }

    /// `g [n, out] · dequant(Q(W))` -> `[n, in]`: the straight-through backward's input gradient, from the
    /// same packed weights the forward read (the CubeCL backends run the transposed kernel).
    fn quant_matmul_transposed(g: FloatTensor<Self>, packed: PackedWeight) -> FloatTensor<Self> {
        let w = dequantized_out_in::<Self>(&packed, &g.device());
        Self::float_matmul(g, w)
    }

    /// Softmax along `dim` whose forward is the same op on the inference and the autodiff backend (burn's
    /// autodiff would decompose it into elementary ops and round differently): the backend's fused softmax,
    /// or on the CPU in deterministic mode the fixed-order row softmax
    /// ([`cpu::kernel::softmax_rows`], batch-invariant and blind to masked trailing keys).
    fn aligned_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        Self::softmax(x, dim)
    }

    /// The mean along the last axis, kept as an axis of 1 (`mean_dim(rank - 1)`: RMSNorm's mean of
    /// squares), the same op in the inference and the training forward. The CubeCL backends in
    /// deterministic mode sum each row in index order (burn's reduction picks its order by shape); the
    /// default is the backend's `mean_dim`. The backward is burn's (`g / n` broadcast along the axis).
    fn aligned_mean_last(x: FloatTensor<Self>) -> FloatTensor<Self> {
        backend_mean_last::<Self>(x)
    }

    /// `x [.., m, k] · w [.., k, n]` (or `· w^T` with `w [.., n, k]` when `w_transposed`), same leading
    /// dims. In deterministic mode the CPU backend computes it in a fixed, batch-invariant order
    /// ([`cpu::kernel::f32_matmul`], [`cpu::kernel::f32_matmul_nt`]); elsewhere it is the
    /// backend's matmul. The backward is the usual one (`dx = g w^T`, `dw = x^T g`).
    fn det_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
    ) -> FloatTensor<Self> {
        plain_matmul::<Self>(x, w, w_transposed)
    }

    /// SwiGLU's product `silu(gate) * up` (same shapes): the dense MLP's and every expert's activation.
    /// The default is burn's op-by-op path (`gate * sigmoid(gate)`, then `* up`); the CPU fuses it into
    /// one parallel pass with the same bits ([`cpu::swiglu`]), and the autodiff backend differentiates it
    /// with [`Self::swiglu_backward`].
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let s = Self::sigmoid(gate.clone());
        Self::float_mul(Self::float_mul(gate, s), up)
    }

    /// `(d gate, d up)` of [`Self::swiglu`] for the incoming gradient `grad`: by default the backwards
    /// burn autodiff runs for the op-by-op path (two products and the sigmoid, the two contributions to
    /// `d gate` added), so a backend that fuses it must reproduce these bits.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let s = Self::sigmoid(gate.clone());
        let silu = Self::float_mul(gate.clone(), s.clone());
        let dup = Self::float_mul(grad.clone(), silu);
        let dsilu = Self::float_mul(grad, up);
        let via_product = Self::float_mul(dsilu.clone(), s.clone());
        let via_sigmoid = Self::sigmoid_backward(s, Self::float_mul(dsilu, gate));
        (Self::float_add(via_product, via_sigmoid), dup)
    }

    /// The routed experts of one MoE layer in one grouped launch chain ([`cpu::moe`] on the CPU): `x [n, hidden]`,
    /// `route_w [n, top_k]` (the chosen experts' weights, slot order), `ids [n, top_k]` (int, on the same
    /// device) the expert of each token's slot -> `[n, hidden]`, with the arithmetic of the `cube_kernels`
    /// MoE contract (fp8 activations for fp8-b128, canonical sums, SwiGLU, combine in slot order with fused
    /// multiply-adds). The ids stay where they are: the CubeCL backends group the tokens by expert on the
    /// device (no read back), the CPU reads its own memory. `None` (the default: any backend without the
    /// kernel) means "run the per-expert loop"; the autodiff backend returns its inner backend's result
    /// without a gradient.
    fn grouped_moe(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        experts: ExpertWeights,
    ) -> Option<FloatTensor<Self>> {
        let _ = (x, route_w, ids, experts);
        None
    }

    /// Whether [`Self::grouped_moe_with_gradient`] runs for activations like `x` (the CubeCL backends:
    /// f32), so a caller stacks the experts' masters only when they will be used.
    fn grouped_moe_trains(x: &FloatTensor<Self>) -> bool {
        let _ = x;
        false
    }

    /// [`Self::grouped_moe`]'s training forward: its output, bit for bit, with what its backward reads:
    /// `(out, gate, up, swiglu, expert_out)`, the activations in the backend's own layout (handed back to
    /// [`Self::grouped_moe_backward`] untouched). `None` (the default) when the backend has no training
    /// pair for these inputs (the CubeCL backends have one for f32 activations).
    #[allow(clippy::type_complexity)]
    fn grouped_moe_for_training(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        experts: ExpertWeights,
    ) -> Option<(
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    )> {
        let _ = (x, route_w, ids, experts);
        None
    }

    /// The backward of [`Self::grouped_moe_for_training`] for the output gradient `grad [n, hidden]`,
    /// given the activations it kept: `(dx [n, hidden], d route_w [n, top_k], d gate, d up, d down)`, the
    /// experts' straight-through gradients stacked expert-major in the masters' `[in, out]` layout (gate
    /// and up `[experts, hidden, inter]`, down `[experts, inter, hidden]`); the input gradients go
    /// through the same packed weights the forward read. `Some` wherever the training forward is.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn grouped_moe_backward(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        grad: FloatTensor<Self>,
        experts: ExpertWeights,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        swiglu: FloatTensor<Self>,
        expert_out: FloatTensor<Self>,
    ) -> Option<(
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    )> {
        let _ = (x, route_w, ids, grad, experts);
        let _ = (gate, up, swiglu, expert_out);
        None
    }

    /// The grouped MoE op with its own gradient, for a training forward: [`Self::grouped_moe`]'s value
    /// and a backward ([`Self::grouped_moe_backward`]) to `x`, `route_w` and the experts' f32 masters,
    /// stacked expert-major (`gate`, `up` `[experts, hidden, inter]`, `down` `[experts, inter, hidden]`),
    /// so the layer is computed once. `None` (inference backends, and an autodiff backend whose inner
    /// backend has no training pair) means "pair [`Self::grouped_moe`] with the per-expert graph".
    fn grouped_moe_with_gradient(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        experts: ExpertWeights,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        down: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let _ = (x, route_w, ids, experts, gate, up, down);
        None
    }

    /// The core of grouped-query attention in one op: `q [b, kv, rows, d]` (the query heads sharing a key
    /// head stacked along the rows, `rows = rep * t`), `k`/`v` `[b, kv, s, d]`, the additive `mask`
    /// `[b, 1, t, s]` -> `softmax(q k^T * scale + mask) v`, `[b, kv, rows, d]`, with exactly the bits of
    /// the op-by-op path (`det_matmul`, scale, mask, `aligned_softmax`, `det_matmul`). `None` (the default,
    /// and under autodiff when an input carries a gradient) means "run the op-by-op path"; the CPU in
    /// deterministic mode runs [`cpu::attention`].
    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f32,
    ) -> Option<FloatTensor<Self>> {
        let _ = (q, k, v, mask, scale);
        None
    }

    /// Whether [`Self::grouped_moe`] returns the per-expert loop's exact bits (the CPU: then a training
    /// forward runs the loop alone, with the rollout's values, instead of both paths). `x`: a tensor on the
    /// device in question.
    fn grouped_moe_matches_loop(x: &FloatTensor<Self>) -> bool {
        let _ = x;
        false
    }

    /// `value` unchanged (same bits), with the gradient routed to `graph` as is (none to `value`).
    fn forward_value_of(graph: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        let _ = graph;
        value
    }

    /// `lhs · rhs` with either operand used transposed (`lhs_transposed`: `lhs` is `[.., k, m]` and its
    /// transpose is multiplied; `rhs_transposed`: `rhs` is `[.., n, k]`), same leading dims: the products of
    /// the backward passes (`dx = g w^T`, `dW = x^T g`). Free of the rollout contract, but on the CPU in a
    /// fixed reduction order set by constants ([`cpu::kernel::f32_matmul`], [`cpu::kernel::f32_matmul_nt`]),
    /// so that a seed gives the same gradients on every machine, thread count and SIMD path; the default is
    /// the backend's matmul.
    fn grad_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        lhs_transposed: bool,
        rhs_transposed: bool,
    ) -> FloatTensor<Self> {
        let t = |x: FloatTensor<Self>| {
            let r = x.shape().num_dims();
            Self::float_swap_dims(x, r - 2, r - 1)
        };
        let lhs = if lhs_transposed { t(lhs) } else { lhs };
        let rhs = if rhs_transposed { t(rhs) } else { rhs };
        Self::float_matmul(lhs, rhs)
    }

    /// `value` (`[n]`, the log-probs `log_softmax((x · w) / temperature)[targets]` computed by the caller
    /// chunk by chunk, `w [k, v]` or `[v, k]` when `w_transposed`) with the gradient of that function of
    /// `x` and `w`: the autodiff backend's backward recomputes the logits [`HEAD_CHUNK_ROWS`] rows at a
    /// time from `x`, `w` and the rows' log-normalisers `lse` (`[n]`, of `logits / temperature`), so that
    /// no `[n, v]` tensor lives between the forward and the backward. Inference backends return `value`.
    fn head_logprobs_with_gradient(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
        lse: FloatTensor<Self>,
        targets: Vec<u32>,
        temperature: f32,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let _ = (x, w, w_transposed, lse, targets, temperature);
        value
    }

    /// The gradient of a chunk of target log-probs with respect to its (temperature-scaled) logits:
    /// `z [r, v]`, the rows' log-normalisers `lse [r]` and incoming gradients `g [r]` (already divided by
    /// the temperature) -> `d [r, v]` with `d[i, j] = -(exp(z[i, j] - lse[i]) * g[i])`, then `g[i]` added
    /// at `targets[i]` (`(onehot - softmax) * g`). The default runs it op by op (subtract, exp, product,
    /// negate, scatter-add); the CPU in one parallel pass with the same bits.
    fn logprob_grad_rows(
        z: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        g: FloatTensor<Self>,
        targets: &[u32],
    ) -> FloatTensor<Self> {
        use burn::tensor::{IndexingUpdateOp, Shape};
        let [r, v]: [usize; 2] = z.shape().dims();
        let device = z.device();
        let column = |t: FloatTensor<Self>| Self::float_reshape(t, Shape::new([r, 1]));
        let across = |t: FloatTensor<Self>| Self::float_expand(column(t), Shape::new([r, v]));
        let p = Self::float_exp(Self::float_sub(z, across(lse)));
        let d = Self::float_neg(Self::float_mul(p, across(g.clone())));
        let at: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
        let at = Self::int_from_data(TensorData::new(at, [r, 1]), &device);
        Self::float_scatter(1, d, at, column(g), IndexingUpdateOp::Add)
    }

    /// The rotary embedding (half-split pairing) of `x [b, t, heads, d]` by the position tables `cos`,
    /// `sin` `[b, t, 1, d]` in one op, with the bits of the op-by-op path
    /// ([`crate::model::layers::Rope::apply`]: `x * cos + cat(-x2, x1) * sin`). `None` (the default) means
    /// "run the op-by-op path"; the CPU runs [`cpu::rope`], and the autodiff backend differentiates it
    /// with [`Self::rope_backward`] (the tables are constants).
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let _ = (x, cos, sin);
        None
    }

    /// The gradient of [`Self::rope`] with respect to `x`, with the bits of burn autodiff's backwards of
    /// the op-by-op path; `Some` wherever [`Self::rope`] is.
    fn rope_backward(
        g: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let _ = (g, cos, sin);
        None
    }

    /// Whether `x` is part of a recorded autodiff graph; `false` on inference backends.
    fn tracks_gradients(x: &FloatTensor<Self>) -> bool {
        let _ = x;
        false
    }
}

/// Rows of logits the fused LM-head log-probs compute at once (forward and backward): 256 rows of a
/// 49152-token vocabulary are 50 MB.
pub const HEAD_CHUNK_ROWS: usize = 256;

/// [`KernelOps::head_logprobs_with_gradient`] on tensors.
pub fn head_logprobs_with_gradient(
    x: Tensor<2>,
    w: Tensor<2>,
    w_transposed: bool,
    lse: Tensor<1>,
    targets: Vec<u32>,
    temperature: f32,
    value: Tensor<1>,
) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as KernelOps>::head_logprobs_with_gradient(
        x.into_dispatch(),
        w.into_dispatch(),
        w_transposed,
        lse.into_dispatch(),
        targets,
        temperature,
        value.into_dispatch(),
    ))
}

/// The backend's own mean along the last axis (kept as an axis of 1).
fn backend_mean_last<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let r = x.shape().num_dims();
    B::float_mean_dim(x, r - 1)
}

/// The backend's own (fused) softmax.
fn backend_softmax<B: Backend>(x: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    B::softmax(x, dim)
}

/// The backend's own matmul of [`KernelOps::det_matmul`]'s operands.
fn plain_matmul<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    w_transposed: bool,
) -> FloatTensor<B> {
    let w = if w_transposed {
        let r = w.shape().num_dims();
        B::float_swap_dims(w, r - 2, r - 1)
    } else {
        w
    };
    B::float_matmul(x, w)
}

/// [`KernelOps::attention_core`] on tensors (`None`: run the op-by-op path).
pub fn attention_core(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<4>,
    scale: f32,
) -> Option<Tensor<4>> {
    <Dispatch as KernelOps>::attention_core(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        mask.into_dispatch(),
        scale,
    )
    .map(Tensor::from_dispatch)
}

/// [`KernelOps::swiglu`] on tensors: `silu(gate) * up`, in f32, rounded once to `gate`'s type.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    let up = f32_of(up);
    in_f32(gate, |gate| {
        Tensor::from_dispatch(<Dispatch as KernelOps>::swiglu(
            gate.into_dispatch(),
            up.into_dispatch(),
        ))
    })
}

/// [`KernelOps::rope`] on tensors (`None`: run the op-by-op path), in f32, rounded once to `x`'s type.
pub fn rope(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Option<Tensor<4>> {
    let dtype = x.dtype();
    <Dispatch as KernelOps>::rope(
        f32_of(x).into_dispatch(),
        f32_of(cos).into_dispatch(),
        f32_of(sin).into_dispatch(),
    )
    .map(|y| as_dtype(Tensor::from_dispatch(y), dtype))
}

/// [`KernelOps::aligned_mean_last`] on a tensor: the mean along the last axis, kept as an axis of 1.
pub fn aligned_mean_last<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    in_f32(x, |x| {
        Tensor::from_dispatch(<Dispatch as KernelOps>::aligned_mean_last(
            x.into_dispatch(),
        ))
    })
}

/// [`KernelOps::aligned_softmax`] on a tensor.
pub fn aligned_softmax<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    in_f32(x, |x| {
        Tensor::from_dispatch(<Dispatch as KernelOps>::aligned_softmax(
            x.into_dispatch(),
            dim,
        ))
    })
}

/// [`KernelOps::det_matmul`] on tensors: `x · w` (`w [.., k, n]`), or `x · w^T` (`w [.., n, k]`) when
/// `w_transposed`. Half operands are read as f32; the result is rounded once to `x`'s type. Outside
/// deterministic mode, half activations take the backend's own matmul in their type (`w` rounded to it:
/// a bf16 GEMM, on tensor cores on a GPU).
pub fn det_matmul<const D: usize>(x: Tensor<D>, w: Tensor<D>, w_transposed: bool) -> Tensor<D> {
    let dtype = x.dtype();
    if !deterministic() && dtype::is_half(dtype) {
        let w = as_dtype(w, dtype);
        return x.matmul(if w_transposed { w.transpose() } else { w });
    }
    let w = f32_of(w);
    in_f32(x, |x| {
        Tensor::from_dispatch(<Dispatch as KernelOps>::det_matmul(
            x.into_dispatch(),
            w.into_dispatch(),
            w_transposed,
        ))
    })
}

/// The grouped MoE op ([`KernelOps::grouped_moe`]) on tensors: `x [n, hidden]`, the chosen experts
/// `ids [n, top_k]` (on the device), their routing weights `route_w [n, top_k]` -> `[n, hidden]`, or `None`
/// when the backend has no grouped kernel (then run the per-expert loop). The result carries no gradient:
/// under autodiff, pair it with the per-expert graph through [`forward_value_of`].
pub fn grouped_moe(
    x: Tensor<2>,
    route_w: Tensor<2>,
    ids: Tensor<2, Int>,
    experts: ExpertWeights,
) -> Option<Tensor<2>> {
    <Dispatch as KernelOps>::grouped_moe(
        x.into_dispatch(),
        route_w.into_dispatch(),
        ids.into_dispatch(),
        experts,
    )
    .map(Tensor::from_dispatch)
}

/// The experts' f32 masters of one MoE layer, in expert order, for [`grouped_moe_with_gradient`]: gate
/// and up `[hidden, inter]`, down `[inter, hidden]`.
pub struct ExpertMasters {
    pub gate: Vec<Tensor<2>>,
    pub up: Vec<Tensor<2>>,
    pub down: Vec<Tensor<2>>,
}

/// The grouped MoE op with its own backward ([`KernelOps::grouped_moe_with_gradient`]): the value of
/// [`grouped_moe`] (the rollout's bits), the gradient to `x`, `route_w` and the experts' `masters`
/// (straight-through), the layer computed once; `None` when the backend has no such pair for `x` (then
/// pair [`grouped_moe`] with the per-expert graph through [`forward_value_of`]). The masters are stacked
/// per projection (a copy, recorded on the graph) only when the pair runs.
pub fn grouped_moe_with_gradient(
    x: Tensor<2>,
    route_w: Tensor<2>,
    ids: Tensor<2, Int>,
    experts: ExpertWeights,
    masters: impl FnOnce() -> ExpertMasters,
) -> Option<Tensor<2>> {
    if !<Dispatch as KernelOps>::grouped_moe_trains(&x.clone().into_dispatch()) {
        return None;
    }
    let masters = masters();
    let stacked = |ts: Vec<Tensor<2>>| Tensor::stack::<3>(ts, 0).into_dispatch();
    <Dispatch as KernelOps>::grouped_moe_with_gradient(
        x.into_dispatch(),
        route_w.into_dispatch(),
        ids.into_dispatch(),
        experts,
        stacked(masters.gate),
        stacked(masters.up),
        stacked(masters.down),
    )
    .map(Tensor::from_dispatch)
}

/// The value of `value` (the same bits) with the gradient of `graph`: the backward passes the incoming
/// gradient to `graph` unchanged and none to `value`.
pub fn forward_value_of<const D: usize>(graph: Tensor<D>, value: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as KernelOps>::forward_value_of(
        graph.into_dispatch(),
        value.into_dispatch(),
    ))
}

/// Whether the backend's grouped op reproduces the per-expert loop bit for bit (the CPU): a training forward
/// then runs the loop alone, with the rollout's values. `t`: a tensor on the device in question.
pub fn grouped_moe_matches_loop<const D: usize>(t: &Tensor<D>) -> bool {
    <Dispatch as KernelOps>::grouped_moe_matches_loop(&t.clone().into_dispatch())
}

/// [`KernelOps::quant_matmul_takes_half`] on a tensor.
pub fn quant_matmul_takes_half<const D: usize>(x: &Tensor<D>) -> bool {
    <Dispatch as KernelOps>::quant_matmul_takes_half(&x.clone().into_dispatch())
}

static NATIVE_HALF_MATMULS: AtomicU64 = AtomicU64::new(0);

fn count_native_half_matmul() {
    NATIVE_HALF_MATMULS.fetch_add(1, Ordering::Relaxed);
}

/// How many low-bit matmuls this process ran on half activations in their own type (the kernel's half
/// path, untracked forwards on the CubeCL backends): a debug counter tests use to see that path ran.
pub fn native_half_matmuls() -> u64 {
    NATIVE_HALF_MATMULS.load(Ordering::Relaxed)
}

static TENSOR_TILE_PRODUCTS: AtomicU64 = AtomicU64::new(0);

/// Counts a low-bit product (dense or grouped MoE) launched in the tensor-core tiles' order.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) fn count_tensor_tile_product() {
    TENSOR_TILE_PRODUCTS.fetch_add(1, Ordering::Relaxed);
}

/// How many low-bit products (dense or grouped MoE) this process launched in the tensor-core tiles' order
/// (`train.tensor_cores`): a debug counter tests use to see that rollouts and training forwards took it.
pub fn tensor_tile_products() -> u64 {
    TENSOR_TILE_PRODUCTS.load(Ordering::Relaxed)
}

static FRAGMENT_TILE_PRODUCTS: AtomicU64 = AtomicU64::new(0);

/// Counts a low-bit product launched in the tensor-core tiles' order on the fragment tiles.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) fn count_fragment_tile_product() {
    FRAGMENT_TILE_PRODUCTS.fetch_add(1, Ordering::Relaxed);
}

/// How many of [`tensor_tile_products`] ran on the fragment tiles (`train.tensor_core_kernel =
/// "fragments"`): a debug counter tests use to see that the setting reached the kernels.
pub fn fragment_tile_products() -> u64 {
    FRAGMENT_TILE_PRODUCTS.load(Ordering::Relaxed)
}

static SPLIT_GROUP_PRODUCTS: AtomicU64 = AtomicU64::new(0);

/// Counts a product launched on fragment tiles whose layout splits the scale groups of calls with few
/// cubes.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) fn count_split_group_product() {
    SPLIT_GROUP_PRODUCTS.fetch_add(1, Ordering::Relaxed);
}

/// How many of [`fragment_tile_products`] ran on kernels that split the scale groups of calls with few
/// cubes (`train.fragment_group_splits` above 1): a debug counter tests use to see that the setting
/// reached the kernels.
pub fn split_group_products() -> u64 {
    SPLIT_GROUP_PRODUCTS.load(Ordering::Relaxed)
}

static GROUPED_MOE_BACKWARDS: AtomicU64 = AtomicU64::new(0);

fn count_grouped_moe_backward() {
    GROUPED_MOE_BACKWARDS.fetch_add(1, Ordering::Relaxed);
}

/// How many grouped MoE backwards ([`KernelOps::grouped_moe_backward`]) this process has run: a debug
/// counter that shows a training step took the one-pass MoE path rather than the per-expert graph.
pub fn grouped_moe_backwards() -> u64 {
    GROUPED_MOE_BACKWARDS.load(Ordering::Relaxed)
}

/// Whether `t` is part of a recorded autodiff graph (a gradient will flow through it). Always `false` on
/// an inference backend.
pub fn tracks_gradients<const D: usize>(t: &Tensor<D>) -> bool {
    <Dispatch as KernelOps>::tracks_gradients(&t.clone().into_dispatch())
}
