//! The low-bit matmul on burn's CubeCL backend (wgpu, CUDA): a tensor's device buffer goes straight to
//! [`cube_kernels`], so rollout and the training forward run the same kernel, with the same bits, on the
//! GPU (the kernels sum in one batch-invariant order). The packed weights are uploaded once per weight
//! version and device and cached here; the backward's `dx = g · dequant(Q(W))` uses the transposed kernel
//! on the same upload. The MoE layer's experts are uploaded once more, stacked per projection, for the grouped
//! MoE kernel ([`grouped_moe`]).
//!
//! Activations in f32, f16 or bf16 go to the kernels as they are (f16/bf16 where the device has them:
//! [`Kernels::supports`]); the kernels sum in f32 and round once to the activations' type, so a half
//! result is the f32 result on the same (widened) inputs, rounded. Other dtypes, or a type the device
//! lacks, get `None` and the caller falls back to dequantize-and-matmul.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::TensorMetadata;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use cube_kernels::context::MoeActivations;
use cube_kernels::{
    ActDType, DeviceBuffer, DeviceWeights, FragmentShape, Kernels, MatmulPath, PackedWeights,
};

use crate::ops::{ExpertWeights, PackedWeight};
use crate::quant::QuantizedTensor;

/// Kernels (client + E4M3 table) per device, with the tensor-core tiles' order on the fragment tiles
/// when the process switch says so ([`crate::ops::fragment_tiles`]), and fresh outputs filled with NaN
/// under `QARL_POISON_OUTPUTS=1` ([`crate::ops::poison_outputs`]).
pub(super) fn kernels_for(t: &CubeTensor) -> Arc<Kernels> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<Kernels>>>> = OnceLock::new();
    let fragments = crate::ops::fragment_tiles();
    let splits = crate::ops::fragment_group_splits();
    let key = format!("{:?}/{fragments}/{splits}", t.device);
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .expect("kernel cache");
    cache
        .entry(key)
        .or_insert_with(|| {
            Arc::new(
                Kernels::from_client(t.client.clone())
                    .with_fragment_tiles(fragments)
                    .with_fragment_shape(fragment_shape(splits))
                    .with_poisoned_outputs(crate::ops::poison_outputs()),
            )
        })
        .clone()
}

/// The fragment tiles' layout with the scale groups split among up to `splits` sets of planes (the
/// config checked the value; another is reported once and taken as 1).
fn fragment_shape(splits: usize) -> FragmentShape {
    FragmentShape::default()
        .with_group_splits(splits)
        .unwrap_or_else(|e| {
            tracing::warn!("{e}; the scale groups are not split");
            FragmentShape::default()
        })
}

type WeightCache = HashMap<(usize, String), (Weak<QuantizedTensor>, DeviceWeights)>;

/// The packed weights of this version on the tensor's device, uploaded on first use. Entries whose weight
/// version is gone are dropped on the next upload.
fn device_weights(kernels: &Kernels, t: &CubeTensor, packed: &PackedWeight) -> DeviceWeights {
    static CACHE: OnceLock<Mutex<WeightCache>> = OnceLock::new();
    let key = (Arc::as_ptr(&packed.0) as usize, format!("{:?}", t.device));
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .expect("weight cache");
    if let Some((weak, w)) = cache.get(&key) {
        if weak.upgrade().is_some_and(|q| Arc::ptr_eq(&q, &packed.0)) {
            return w.clone();
        }
    }
    cache.retain(|_, (weak, _)| weak.strong_count() > 0);
    let q = &packed.0;
    let [out, inn] = q.shape();
    // The scheme's format is the kernels' own type, and `from_parts` / `quantize` already checked the
    // storage against that same description, so repacking cannot fail.
    let host = PackedWeights::from_storage(q.scheme().kind(), out, inn, q.data(), q.scales())
        .expect("a validated QuantizedTensor repacks");
    let w = kernels.upload_weights(&host);
    cache.insert(key, (Arc::downgrade(q), w.clone()));
    w
}

type ExpertCache = HashMap<(Vec<usize>, String), (Vec<Weak<QuantizedTensor>>, [DeviceWeights; 3])>;

/// The experts' gate, up and down weights stacked (expert-major, one buffer per projection) on the tensor's
/// device, uploaded on first use for this set of weight versions; entries with a dead version are dropped
/// on the next upload.
fn device_experts(
    kernels: &Kernels,
    t: &CubeTensor,
    experts: &ExpertWeights,
) -> [DeviceWeights; 3] {
    static CACHE: OnceLock<Mutex<ExpertCache>> = OnceLock::new();
    let all: Vec<&Arc<QuantizedTensor>> = experts
        .gate
        .iter()
        .chain(&experts.up)
        .chain(&experts.down)
        .map(|p| &p.0)
        .collect();
    let key = (
        all.iter()
            .map(|q| Arc::as_ptr(q) as usize)
            .collect::<Vec<_>>(),
        format!("{:?}", t.device),
    );
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .expect("expert weight cache");
    if let Some((weak, w)) = cache.get(&key) {
        let same = weak
            .iter()
            .zip(&all)
            .all(|(w, q)| w.upgrade().is_some_and(|u| Arc::ptr_eq(&u, q)));
        if same {
            return w.clone();
        }
    }
    cache.retain(|_, (weak, _)| weak.iter().all(|w| w.strong_count() > 0));
    let stack = |ws: &[PackedWeight]| {
        let q = &ws[0].0;
        let [out, inn] = q.shape();
        let parts: Vec<(&[u8], &[f32])> = ws.iter().map(|p| (p.0.data(), p.0.scales())).collect();
        let host = PackedWeights::stack(q.scheme().kind(), out, inn, &parts)
            .expect("validated experts of one scheme and shape stack");
        kernels.upload_weights(&host)
    };
    let w = [
        stack(&experts.gate),
        stack(&experts.up),
        stack(&experts.down),
    ];
    cache.insert(
        key,
        (all.iter().map(|q| Arc::downgrade(q)).collect(), w.clone()),
    );
    w
}

/// The kernels' activation type for a burn dtype (f32, f16, bf16), or `None`.
fn act_dtype(dtype: DType) -> Option<ActDType> {
    match dtype {
        DType::F32 => Some(ActDType::F32),
        DType::F16 => Some(ActDType::F16),
        DType::BF16 => Some(ActDType::BF16),
        _ => None,
    }
}

fn burn_dtype(dtype: ActDType) -> DType {
    match dtype {
        ActDType::F32 => DType::F32,
        ActDType::F16 => DType::F16,
        ActDType::BF16 => DType::BF16,
    }
}

/// A contiguous view of a 2-D tensor whose dtype the kernels take on this device, with its rows, columns
/// and type, or `None` (the caller falls back).
fn contiguous_act(
    kernels: &Kernels,
    t: CubeTensor,
) -> Option<(CubeTensor, usize, usize, ActDType)> {
    let dtype = act_dtype(t.dtype)?;
    if t.shape().num_dims() != 2 || !kernels.supports(dtype) {
        return None;
    }
    let t = burn_cubecl::kernel::into_contiguous(t);
    let dims = t.shape().to_vec();
    Some((t, dims[0], dims[1], dtype))
}

fn buffer(t: &CubeTensor, len: usize, dtype: ActDType) -> DeviceBuffer {
    DeviceBuffer::from_handle_typed(t.handle.clone(), len, dtype)
}

/// `len` non-negative int values (expert ids) as a contiguous buffer of 32-bit words, which the routing
/// kernels read as `u32`: an `i32` or `u32` tensor as it is (the same bits), another int type cast first.
fn id_buffer(ids: CubeTensor, len: usize) -> DeviceBuffer {
    let ids = match ids.dtype {
        DType::I32 | DType::U32 => ids,
        _ => burn_cubecl::kernel::cast(ids, DType::U32),
    };
    let ids = burn_cubecl::kernel::into_contiguous(ids);
    assert_eq!(
        ids.shape().num_elements(),
        len,
        "one expert id per token and slot"
    );
    DeviceBuffer::from_handle(ids.handle.clone(), len)
}

fn wrap(like: &CubeTensor, y: DeviceBuffer, rows: usize, cols: usize) -> CubeTensor {
    wrap_shaped(like, y, Shape::new([rows, cols]))
}

/// A kernel's output buffer as a contiguous tensor of `shape` on `like`'s device.
fn wrap_shaped(like: &CubeTensor, y: DeviceBuffer, shape: Shape) -> CubeTensor {
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        y.handle().clone(),
        burn_dtype(y.dtype()),
    )
}

/// The kernels' path for the low-bit products of the forward (rollout and training alike): the
/// tensor-core tiles' order with the process's operand type when it is on ([`crate::ops::tensor_tiles`],
/// `train.tensor_cores`: on the instruction where the device has it, else with scalar FMAs, the same
/// tiling and a warning), else [`MatmulPath::Auto`] (the canonical order).
fn product_path(kernels: &Kernels) -> MatmulPath {
    let Some(operand) = crate::ops::tensor_tiles().and_then(act_dtype) else {
        return MatmulPath::Auto;
    };
    if !kernels.supports(operand) {
        // Rollout and training both land here, so they still agree (in the canonical order).
        static UNSUPPORTED: std::sync::Once = std::sync::Once::new();
        UNSUPPORTED.call_once(|| {
            tracing::warn!(
                device = %kernels.device_name(),
                "train.tensor_cores: the kernels have no {operand} operands here; the canonical order runs"
            )
        });
        return MatmulPath::Auto;
    }
    let tensor_cores = kernels.supports_mma(operand);
    if !tensor_cores {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                device = %kernels.device_name(),
                "train.tensor_cores: the device has no {operand} tensor-core instruction; the tiles run \
                 with scalar multiply-adds (the same tiling and batch invariance, slower)"
            )
        });
    }
    crate::ops::count_tensor_tile_product();
    if kernels.fragment_tiles() {
        crate::ops::count_fragment_tile_product();
        if kernels.fragment_shape().group_splits() > 1 {
            crate::ops::count_split_group_product();
        }
    }
    MatmulPath::Tiles {
        tensor_cores,
        operand,
    }
}

/// `x [n, in] · dequant(Q(W))^T` on the device, in `x`'s dtype, or `None` when `x` is not a matrix of a
/// dtype the kernels take on this device (f32 always; f16, bf16 where supported).
pub(crate) fn quant_matmul(
    x: FloatTensor<CubeBackend>,
    packed: &PackedWeight,
) -> Option<CubeTensor> {
    let kernels = kernels_for(&x);
    let (x, n, inn, dtype) = contiguous_act(&kernels, x)?;
    let w = device_weights(&kernels, &x, packed);
    assert_eq!(
        inn,
        w.in_features(),
        "quant_matmul: activations have {inn} columns, weight expects {}",
        w.in_features()
    );
    let xb = buffer(&x, n * inn, dtype);
    let y = kernels
        .linear_with(&xb, n, &w, product_path(&kernels))
        .expect("shapes checked above; the tiles' format and operands by the config");
    Some(wrap(&x, y, n, w.out_features()))
}

/// `g [n, out] · dequant(Q(W))` on the device, in `g`'s dtype, or `None` when `g` is not a matrix of a
/// dtype the kernels take on this device.
pub(crate) fn quant_matmul_transposed(
    g: FloatTensor<CubeBackend>,
    packed: &PackedWeight,
) -> Option<CubeTensor> {
    let kernels = kernels_for(&g);
    let (g, n, out, dtype) = contiguous_act(&kernels, g)?;
    let w = device_weights(&kernels, &g, packed);
    assert_eq!(
        out,
        w.out_features(),
        "quant_matmul backward: gradient has {out} columns, weight has {} rows",
        w.out_features()
    );
    let gb = buffer(&g, n * out, dtype);
    let dx = kernels
        .linear_transposed(&gb, n, &w)
        .expect("shapes checked above");
    Some(wrap(&g, dx, n, w.in_features()))
}

/// One MoE layer's launch on the device: the activations and routing weights as kernel buffers, the
/// routing table built from the expert ids on the device ([`Kernels::route`]: nothing is read back) and
/// the stacked expert weights.
struct MoeLaunch {
    kernels: Arc<Kernels>,
    /// The contiguous input (its client and device make the outputs).
    x: CubeTensor,
    xb: DeviceBuffer,
    route_w: DeviceBuffer,
    routing: cube_kernels::moe::RoutingTable,
    weights: [DeviceWeights; 3],
    tokens: usize,
    hidden: usize,
    top_k: usize,
}

impl MoeLaunch {
    /// `None` when `x` and `route_w` are not matrices of one dtype the kernels take on this device, or
    /// (`f32_only`) not f32, or there are more experts than the device routing takes.
    fn new(
        x: CubeTensor,
        route_w: CubeTensor,
        ids: IntTensor<CubeBackend>,
        experts: &ExpertWeights,
        f32_only: bool,
    ) -> Option<Self> {
        if x.dtype != route_w.dtype
            || (f32_only && x.dtype != DType::F32)
            || experts.len() > Kernels::MAX_ROUTED_EXPERTS
        {
            return None;
        }
        let kernels = kernels_for(&x);
        let (x, tokens, hidden, dtype) = contiguous_act(&kernels, x)?;
        let (route_w, rows, top_k, _) = contiguous_act(&kernels, route_w)?;
        assert_eq!(
            rows, tokens,
            "grouped MoE: {rows} rows of routing weights for {tokens} tokens"
        );
        assert_eq!(
            hidden,
            experts.dims()[0],
            "grouped MoE: activations have {hidden} columns, experts expect {}",
            experts.dims()[0]
        );
        let routing = kernels
            .route(
                &id_buffer(ids, tokens * top_k),
                tokens,
                top_k,
                experts.len(),
            )
            .expect("one expert id per token and slot");
        let weights = device_experts(&kernels, &x, experts);
        Some(Self {
            xb: buffer(&x, tokens * hidden, dtype),
            route_w: buffer(&route_w, tokens * top_k, dtype),
            kernels,
            x,
            routing,
            weights,
            tokens,
            hidden,
            top_k,
        })
    }

    fn weights(&self) -> [&DeviceWeights; 3] {
        let [g, u, d] = &self.weights;
        [g, u, d]
    }

    fn inter(&self) -> usize {
        self.weights[0].out_features()
    }

    /// A device buffer as a tensor of `shape` on `x`'s device.
    fn tensor<const D: usize>(&self, y: DeviceBuffer, shape: [usize; D]) -> CubeTensor {
        wrap_shaped(&self.x, y, Shape::new(shape))
    }
}

/// The grouped MoE kernel on `x [n, hidden]` with `route_w [n, top_k]` and the expert ids `ids [n, top_k]`,
/// in `x`'s dtype, or `None` when `x` and `route_w` are not matrices of one dtype the kernels take on this
/// device (the caller runs the per-expert loop). The tokens are grouped by expert on the device
/// ([`Kernels::route`]): nothing is read back.
pub(crate) fn grouped_moe(
    x: FloatTensor<CubeBackend>,
    route_w: FloatTensor<CubeBackend>,
    ids: IntTensor<CubeBackend>,
    experts: &ExpertWeights,
) -> Option<CubeTensor> {
    let l = MoeLaunch::new(x, route_w, ids, experts, false)?;
    let y = l
        .kernels
        .moe_routed(
            &l.xb,
            &l.routing,
            &l.route_w,
            l.weights(),
            product_path(&l.kernels),
        )
        .expect("shapes checked above; the tiles' format and operands by the config");
    Some(l.tensor(y, [l.tokens, l.hidden]))
}

/// Whether the grouped MoE training pair takes activations like `x` (f32 matrices).
/// Whether the kernels read `x` as it is: a half-precision matrix of a type this device has.
pub(crate) fn takes_half(x: &CubeTensor) -> bool {
    matches!(x.dtype, DType::F16 | DType::BF16)
        && x.shape().num_dims() == 2
        && act_dtype(x.dtype).is_some_and(|d| kernels_for(x).supports(d))
}

pub(crate) fn grouped_moe_trains(x: &CubeTensor) -> bool {
    x.dtype == DType::F32 && x.shape().num_dims() == 2
}

/// Five tensors: the grouped MoE training forward's `(out, gate, up, swiglu, expert_out)`, its
/// backward's `(dx, d route_w, d gate, d up, d down)`.
type MoeTensors = (CubeTensor, CubeTensor, CubeTensor, CubeTensor, CubeTensor);

/// [`grouped_moe`]'s output (the same bits) with the activations its backward reads: `(out, gate, up,
/// swiglu, expert_out)`, the first three `[assignments, inter]`, the expert outputs `[assignments,
/// hidden]` (f32, sorted assignment order); `None` unless `x` and `route_w` are f32 matrices.
pub(crate) fn grouped_moe_for_training(
    x: FloatTensor<CubeBackend>,
    route_w: FloatTensor<CubeBackend>,
    ids: IntTensor<CubeBackend>,
    experts: &ExpertWeights,
) -> Option<MoeTensors> {
    let l = MoeLaunch::new(x, route_w, ids, experts, true)?;
    let (y, acts) = l
        .kernels
        .moe_routed_for_training(
            &l.xb,
            &l.routing,
            &l.route_w,
            l.weights(),
            product_path(&l.kernels),
        )
        .expect("shapes checked above; the tiles' format and operands by the config");
    let (a, inter) = (l.routing.layout().assignments, l.inter());
    Some((
        l.tensor(y, [l.tokens, l.hidden]),
        l.tensor(acts.gate, [a, inter]),
        l.tensor(acts.up, [a, inter]),
        l.tensor(acts.swiglu, [a, inter]),
        l.tensor(acts.expert_out, [a, l.hidden]),
    ))
}

/// The backward of [`grouped_moe_for_training`] for `grad [n, hidden]`: `[dx, d route_w, d gate, d up,
/// d down]` (the weight gradients `[experts, in, out]`), all computed on the device; `None` unless the
/// inputs are f32 matrices.
pub(crate) fn grouped_moe_backward(
    x: FloatTensor<CubeBackend>,
    route_w: FloatTensor<CubeBackend>,
    ids: IntTensor<CubeBackend>,
    grad: FloatTensor<CubeBackend>,
    experts: &ExpertWeights,
    saved: [CubeTensor; 4],
) -> Option<MoeTensors> {
    let l = MoeLaunch::new(x, route_w, ids, experts, true)?;
    let (tokens, hidden, inter) = (l.tokens, l.hidden, l.inter());
    let (grad, rows, cols, dtype) = contiguous_act(&l.kernels, grad)?;
    assert!(
        [rows, cols] == [tokens, hidden] && dtype == ActDType::F32,
        "grouped MoE backward: the output gradient is {dtype:?} [{rows}, {cols}], not f32 [{tokens}, {hidden}]"
    );
    let [gate, up, swiglu, expert_out] = saved;
    let a = l.routing.layout().assignments;
    let acts = MoeActivations {
        gate: buffer(&gate, a * inter, ActDType::F32),
        up: buffer(&up, a * inter, ActDType::F32),
        swiglu: buffer(&swiglu, a * inter, ActDType::F32),
        expert_out: buffer(&expert_out, a * hidden, ActDType::F32),
    };
    let d = l
        .kernels
        .moe_backward(
            &l.xb,
            &l.routing,
            &l.route_w,
            &acts,
            &buffer(&grad, tokens * hidden, ActDType::F32),
            l.weights(),
        )
        .expect("shapes checked above");
    let e = l.routing.experts();
    Some((
        l.tensor(d.dx, [tokens, hidden]),
        l.tensor(d.d_route_w, [tokens, l.top_k]),
        l.tensor(d.d_gate, [e, hidden, inter]),
        l.tensor(d.d_up, [e, hidden, inter]),
        l.tensor(d.d_down, [e, inter, hidden]),
    ))
}
