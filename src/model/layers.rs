//! The building blocks shared by every architecture: linear projections, RMSNorm and rotary embeddings.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::checkpoint::Checkpoint;
use super::error::LoadError;
use super::names::{lazy_param, tensor_name, BIAS, QWEIGHT, SCALES, WEIGHT};
use crate::host::{tensor_from_vec, transposed_from_vec};
use crate::ops::deterministic;
use crate::ops::dtype::{as_dtype, in_f32, is_half};
use crate::ops::{aligned_mean_last, aligned_softmax, det_matmul, QuantizedWeight};
use crate::quant::{QuantError, QuantScheme, QuantizedTensor};

/// Which weights a forward multiplies with. A model holds the f32 masters and, in a quantized precision,
/// the current packed version of each quantized layer; the choice between them is a value every forward
/// receives, not a state of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Weights {
    /// Each layer's packed version where it has one, else its master: the rollout, and the QaRL (aligned)
    /// training forward, which thereby computes the rollout's bits.
    #[default]
    Packed,
    /// The f32 masters everywhere: the full-precision training forward.
    Master,
}

/// A linear projection `y = x W^T + b` with HF's `[out, in]` weight stored transposed as `[in, out]`.
///
/// `weight` is always the full-precision master. When `quant` holds a quantized version of it, the forward
/// runs the low-bit matmul on those packed weights (rollout and training alike) and gradients reach the
/// master through the straight-through estimator.
#[derive(Module, Debug)]
pub struct Linear {
    /// `[in, out]`
    pub weight: Param<Tensor<2>>,
    /// `[out]`
    pub bias: Option<Param<Tensor<1>>>,
    /// The current quantized weight version, if this layer is quantized.
    #[module(skip)]
    pub quant: Option<QuantizedWeight>,
}

impl Linear {
    /// A full-precision layer of these shapes whose parameters are not allocated yet (a lazy model's part,
    /// see [`super::params`]).
    pub fn lazy(d_in: usize, d_out: usize, bias: bool, device: &Device) -> Self {
        Self {
            weight: lazy_param([d_in, d_out], device),
            bias: bias.then(|| lazy_param([d_out], device)),
            quant: None,
        }
    }

    /// Loads `{prefix}.weight` (`[out, in]` on disk) and, if `bias`, `{prefix}.bias`; in a quantized
    /// checkpoint, `{prefix}.qweight` and `{prefix}.scales` where present instead of the weight.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
        device: &Device,
    ) -> Result<Self, LoadError> {
        let qname = tensor_name(prefix, QWEIGHT);
        let (weight, quant) = match ckpt.quant_scheme.filter(|_| ckpt.contains(&qname)) {
            Some(scheme) => {
                // A quantized checkpoint: the packed codes are the weights; the master starts as their
                // dequantized values (exactly what the quantized forward computes with).
                let data = ckpt.read_raw(
                    &qname,
                    &[d_out, scheme.row_bytes(d_in)],
                    safetensors::Dtype::U8,
                )?;
                let sname = tensor_name(prefix, SCALES);
                let scales = ckpt.read_f32(&sname, &scheme.scale_shape(d_out, d_in))?;
                let q = QuantizedTensor::from_parts(scheme, d_out, d_in, data, scales).map_err(
                    |e| LoadError::InvalidConfig {
                        path: ckpt.path_of(&qname),
                        msg: format!("tensor `{qname}`: {e}"),
                    },
                )?;
                let qw = QuantizedWeight::from_packed(q);
                (qw.dequantized(device), Some(qw))
            }
            None => {
                let w = ckpt.read_f32(&tensor_name(prefix, WEIGHT), &[d_out, d_in])?;
                // The transposed layout materialised once instead of on every matmul.
                (transposed_from_vec(&w, [d_out, d_in], device), None)
            }
        };
        let bias = if bias {
            let b = ckpt.read_f32(&tensor_name(prefix, BIAS), &[d_out])?;
            Some(Param::from_tensor(tensor_from_vec(b, [d_out], device)))
        } else {
            None
        };
        Ok(Self {
            weight: Param::from_tensor(weight),
            bias,
            quant,
        })
    }

    /// Quantizes the current master weights (one new weight version); the packed result serves every
    /// forward until the next call.
    pub fn quantize(&mut self, scheme: QuantScheme) -> Result<(), QuantError> {
        self.quant = Some(QuantizedWeight::from_master(
            self.weight.val().detach(),
            scheme,
        )?);
        Ok(())
    }

    /// Drops the quantized version: the forward is full precision again.
    pub fn dequantize(&mut self) {
        self.quant = None;
    }

    /// Input features (read without allocating a lazy weight).
    pub fn d_in(&self) -> usize {
        self.weight.lazy_shape().dims::<2>()[0]
    }

    /// Output features (read without allocating a lazy weight).
    pub fn d_out(&self) -> usize {
        self.weight.lazy_shape().dims::<2>()[1]
    }

    /// `x: [n, in] -> [n, out]` with the packed weights when the layer has them ([`Weights::Packed`]).
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.forward_with(x, Weights::Packed)
    }

    /// `x: [n, in] -> [n, out]` with the chosen weights, in `x`'s type: half activations are read as f32,
    /// multiplied with the f32 (or packed) weights, the bias added, and the sum rounded once. Outside
    /// deterministic mode the product is the op's own choice for half activations (the backend's half
    /// matmul, see [`det_matmul`]) and the bias is added in the half type.
    pub fn forward_with(&self, x: Tensor<2>, weights: Weights) -> Tensor<2> {
        let product = |x: Tensor<2>| match (&self.quant, weights) {
            (Some(q), Weights::Packed) => q.matmul(x, self.weight.val()),
            _ => det_matmul(x, self.weight.val(), false),
        };
        match &self.bias {
            None => product(x),
            Some(b) if !deterministic() && is_half(x.dtype()) => {
                let y = product(x);
                let b = as_dtype(b.val(), y.dtype());
                y + b.unsqueeze_dim(0)
            }
            Some(b) => in_f32(x, |x| product(x) + b.val().unsqueeze_dim(0)),
        }
    }
}

/// Root-mean-square normalisation over the last axis, as transformers computes it (in f32).
#[derive(Module, Debug)]
pub struct RmsNorm {
    pub weight: Param<Tensor<1>>,
    pub eps: f64,
}

impl RmsNorm {
    /// A norm over `dim` features whose weight is not allocated yet (a lazy model's part, see
    /// [`super::params`]).
    pub fn lazy(dim: usize, eps: f64, device: &Device) -> Self {
        Self {
            weight: lazy_param([dim], device),
            eps,
        }
    }

    /// Features normalised (read without allocating a lazy weight).
    pub fn dim(&self) -> usize {
        self.weight.lazy_shape().dims::<1>()[0]
    }

    /// The mean of squares is [`aligned_mean_last`]: one row's bits whatever the shape of the call (the
    /// CubeCL backends' fixed-order kernel in deterministic mode; burn's `mean_dim` on the CPU).
    /// Half activations are normalised in f32 and the result rounded once.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        in_f32(x, |x| {
            let var = aligned_mean_last(x.clone().square());
            let x = x * (var + self.eps).sqrt().recip();
            let mut shape = [1usize; D];
            shape[D - 1] = self.dim();
            x * self.weight.val().reshape(shape)
        })
    }
}

/// Rotary position embedding with the half-split (NeoX / HF `rotate_half`) pairing.
///
/// The cos/sin tables are computed on the host for exactly the positions of a forward, in f32 and in the same
/// order of operations as transformers (`inv_freq = 1 / theta^(2i/d)`, `angle = pos * inv_freq`), so the
/// angles agree with the reference to the last bit in most cases.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f64) -> Self {
        let base = theta as f32;
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0f32 / base.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        Self { inv_freq }
    }

    pub fn head_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// `(cos, sin)`, each `[B, T, 1, head_dim]`, for `positions[b][t]`.
    pub fn tables(&self, positions: &[Vec<usize>], device: &Device) -> (Tensor<4>, Tensor<4>) {
        let b = positions.len();
        let t = positions.first().map_or(0, Vec::len);
        let d = self.head_dim();
        let half = d / 2;
        let mut cos = Vec::with_capacity(b * t * d);
        let mut sin = Vec::with_capacity(b * t * d);
        for row in positions {
            assert_eq!(
                row.len(),
                t,
                "every row of a batch has the same number of positions"
            );
            for &p in row {
                for k in 0..d {
                    let angle = p as f32 * self.inv_freq[k % half];
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        (
            tensor_from_vec(cos, [b, t, 1, d], device),
            tensor_from_vec(sin, [b, t, 1, d], device),
        )
    }

    /// Applies the rotation to `x: [B, T, H, D]` with tables from [`Rope::tables`]: one op where the
    /// backend fuses it ([`crate::ops::rope`], the same bits), else op by op. Half activations are rotated
    /// in f32 and rounded once.
    pub fn apply(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
        in_f32(x, |x| {
            crate::ops::rope(x.clone(), cos.clone(), sin.clone())
                .unwrap_or_else(|| Self::apply_op_by_op(x, cos, sin))
        })
    }

    /// [`Rope::apply`] op by op: `x * cos + cat(-x2, x1) * sin`, the path burn differentiates and the
    /// definition the fused op matches bit for bit.
    pub fn apply_op_by_op(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
        let d = x.dims()[3];
        let half = d / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * cos.clone() + rotated * sin.clone()
    }
}

/// Softmax along `dim`, the same bits in the inference and the training forward: in deterministic mode the
/// fixed-order row softmax on the CPU ([`crate::ops::cpu::kernel::softmax_rows`]: a row's bits depend
/// neither on the other rows nor on masked entries after it), else the backend's fused softmax, on both
/// (see [`crate::ops::aligned_softmax`]).
pub fn softmax_exact<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    aligned_softmax(x, dim)
}
