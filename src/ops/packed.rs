//! The packed weights the custom ops read: one quantized weight version of a linear layer
//! ([`QuantizedWeight`]: the packed codes and scales plus their CPU kernel layout) and the experts of one MoE
//! layer ([`ExpertWeights`]). Made once per weight version from the f32 masters and shared by the rollout and
//! the training forward, never re-quantized per call.

use std::sync::{Arc, OnceLock};

use burn::backend::Dispatch;
use burn::tensor::{DType, Tensor};

use super::dtype::{in_f32, is_half};

use super::cpu::kernel::KernelWeights;
use super::KernelOps;
use crate::host::{to_f32_vec, transpose, transposed_from_vec};
use crate::quant::{QuantError, QuantScheme, QuantizedTensor};

/// Packed weights of one weight version, shared between the rollout and the training forward: the packed
/// format (checkpoints, the backward's `dequant(Q(W))`) and its CPU kernel layout, both made once per
/// weight version.
#[derive(Debug, Clone)]
pub struct PackedWeight(pub Arc<QuantizedTensor>, pub Arc<KernelWeights>);

impl PackedWeight {
    pub fn new(q: QuantizedTensor) -> Self {
        let kernel = KernelWeights::new(&q);
        PackedWeight(Arc::new(q), Arc::new(kernel))
    }
}

/// One quantized weight version: the packed codes and scales (the backward pass decodes them when it needs
/// `dequant(Q(W))`), and, only once a forward outside deterministic mode asks for it, their half-precision
/// copy for the backend's own matmul (shared by the clones of this version).
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    pub packed: PackedWeight,
    half: Arc<OnceLock<Tensor<2>>>,
}

/// Rows from which a forward outside deterministic mode with half activations multiplies the dequantized
/// weights with the backend's matmul (tensor cores on a GPU) instead of the low-bit kernel: below it (decode
/// steps) the kernel, which reads 4-8x fewer weight bytes, is the faster one.
pub const FAST_GEMM_MIN_ROWS: usize = 64;

impl QuantizedWeight {
    /// Quantizes a master weight stored `[in, out]` (the spec's groups run along `in` of each output row).
    pub fn from_master(master: Tensor<2>, scheme: QuantScheme) -> Result<Self, QuantError> {
        let [inn, out] = master.dims();
        let w_out_in = transpose(&to_f32_vec(master), inn, out);
        let q = QuantizedTensor::quantize(&w_out_in, out, inn, scheme)?;
        Ok(Self::from_packed(q))
    }

    /// Wraps already quantized weights (e.g. read from a quantized checkpoint).
    pub fn from_packed(q: QuantizedTensor) -> Self {
        Self {
            packed: PackedWeight::new(q),
            half: Arc::default(),
        }
    }

    /// `dequant(Q(W))` laid out like the master, `[in, out]`, on `device`.
    pub fn dequantized(&self, device: &burn::tensor::Device) -> Tensor<2> {
        let [out, inn] = self.packed.0.shape();
        transposed_from_vec(&self.packed.0.dequantize(), [out, inn], device)
    }

    /// `dequant(Q(W))` `[in, out]` rounded to `dtype`, on `device`: made once per weight version (for the
    /// first dtype and device asked for; others are made per call).
    fn half_dequantized(&self, dtype: DType, device: &burn::tensor::Device) -> Tensor<2> {
        let make = || self.dequantized(device).cast(dtype);
        let cached = self.half.get_or_init(make);
        if cached.dtype() == dtype && &cached.device() == device {
            cached.clone()
        } else {
            make()
        }
    }

    /// Bytes of the packed codes and scales.
    pub fn storage_bytes(&self) -> usize {
        self.packed.0.storage_bytes()
    }

    pub fn scheme(&self) -> QuantScheme {
        self.packed.0.scheme()
    }

    /// `x: [n, in] -> [n, out]` through the low-bit matmul; gradients flow to `master` (STE) and to `x`.
    /// Half activations are read as f32; the result is rounded once to their type. Outside deterministic
    /// mode, half activations of at least [`FAST_GEMM_MIN_ROWS`] rows take the backend's own matmul on the
    /// dequantized weights rounded to the half type (the fastest kernels, whose bits differ from the
    /// decode's: the mismatch `deterministic = off` reports). A format that quantizes the activations too
    /// (fp8-b128, W8A8) keeps its own kernel there: the backend's matmul would skip the activations'
    /// quantization, a different function from the rollout's, not a different rounding (k3 4.9e-3 in a
    /// fixture's aligned training, against 1e-4 for int8-pc).
    pub fn matmul(&self, x: Tensor<2>, master: Tensor<2>) -> Tensor<2> {
        let dtype = x.dtype();
        if !super::deterministic()
            && is_half(dtype)
            && x.dims()[0] >= FAST_GEMM_MIN_ROWS
            && !self.scheme().quantizes_activations()
        {
            let w = self.half_dequantized(dtype, &x.device());
            // Straight through: `master - master` is exactly 0, so the value is the dequantized weights,
            // and the gradient reaches the master unchanged.
            let w = if super::tracks_gradients(&master) {
                (master.clone() - master.detach()).cast(dtype) + w
            } else {
                w
            };
            return x.matmul(w);
        }
        let untracked = !super::tracks_gradients(&x) && !super::tracks_gradients(&master);
        if is_half(dtype) && untracked && super::quant_matmul_takes_half(&x) {
            // The kernel's own half path (a rollout's decode): the bits of the widened call below.
            super::count_native_half_matmul();
            return Tensor::from_dispatch(<Dispatch as KernelOps>::quant_matmul(
                x.into_dispatch(),
                master.into_dispatch(),
                self.packed.clone(),
            ));
        }
        in_f32(x, |x| {
            Tensor::from_dispatch(<Dispatch as KernelOps>::quant_matmul(
                x.into_dispatch(),
                master.into_dispatch(),
                self.packed.clone(),
            ))
        })
    }
}

/// The packed weights of one MoE layer's experts, in expert order: `gate[e]`, `up[e]` (`[inter, hidden]`)
/// and `down[e]` (`[hidden, inter]`), one weight version each, all of one scheme.
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    pub gate: Vec<PackedWeight>,
    pub up: Vec<PackedWeight>,
    pub down: Vec<PackedWeight>,
}

impl ExpertWeights {
    /// Gathers the experts' packed weights; `None` unless there is at least one expert and every projection
    /// is of one scheme with one shape per kind (gate and up `[inter, hidden]`, down `[hidden, inter]`).
    pub fn new(
        gate: Vec<PackedWeight>,
        up: Vec<PackedWeight>,
        down: Vec<PackedWeight>,
    ) -> Option<Self> {
        let first = gate.first()?;
        let scheme: QuantScheme = first.0.scheme();
        let [inter, hidden] = first.0.shape();
        let ok = gate.len() == up.len()
            && gate.len() == down.len()
            && gate
                .iter()
                .chain(&up)
                .all(|p| p.0.scheme() == scheme && p.0.shape() == [inter, hidden])
            && down
                .iter()
                .all(|p| p.0.scheme() == scheme && p.0.shape() == [hidden, inter]);
        ok.then_some(Self { gate, up, down })
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        self.gate.len()
    }

    /// Whether there are no experts (never, for a value made by [`Self::new`]).
    pub fn is_empty(&self) -> bool {
        self.gate.is_empty()
    }

    /// `[hidden, inter]`.
    pub fn dims(&self) -> [usize; 2] {
        let [inter, hidden] = self.gate[0].0.shape();
        [hidden, inter]
    }
}
