//! The CPU backend (burn flex) of the custom ops: fixed-order, batch-invariant SIMD kernels.
//!
//! - [`kernel`]: the low-bit matmul on the packed weights, the fixed-order f32 matmul and row softmax.
//! - [`attention`]: the grouped-query attention core in one pass, bitwise the op-by-op path.
//! - [`head`]: the LM head backward's gradient with respect to a chunk of logits, in one parallel pass.
//! - [`probe`]: the FMA peak and the DRAM read bandwidth of this machine, for benchmarks.
//! - [`moe`]: the routed experts of one MoE layer in parallel on the kernel layout, bitwise the loop.
//! - [`rope`]: the rotary embedding and its gradient in one parallel pass, bitwise the op-by-op path.
//! - [`swiglu`]: SwiGLU's `silu(g) * u` and its gradient in one parallel pass, bitwise the op-by-op path.

pub mod attention;
pub mod head;
pub mod kernel;
pub mod moe;
pub mod probe;
pub mod rope;
pub mod swiglu;

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::TensorData;

use rayon::prelude::*;

use self::kernel::gemm::{gemm, gemm_rows, Strided};
use super::switches::deterministic;
use super::{backend_softmax, plain_matmul, ExpertWeights, KernelOps, PackedWeight};

/// A float tensor's values as one contiguous host slice with its dims.
fn host_f32(t: FloatTensor<Flex>) -> (FlexTensor, Vec<usize>) {
    let t: FlexTensor = t.to_contiguous();
    let dims = t.layout().shape().to_vec();
    (t, dims)
}

/// The values of a contiguous f32 tensor (from [`host_f32`]).
fn f32_slice(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>().expect("contiguous f32 tensor")
}

/// The fused rotary embedding's shape for `x` of `dims` `[b, t, h, d]` and tables `[b, t, 1, d]`, or
/// `None` (the op-by-op path) for anything else.
fn rope_shape(
    dims: &[usize],
    cos: &FloatTensor<Flex>,
    sin: &FloatTensor<Flex>,
) -> Option<rope::RopeShape> {
    let table = [dims.first()?, dims.get(1)?, &1, dims.get(3)?].map(|&v| v);
    let ok = dims.len() == 4
        && dims[3].is_multiple_of(2)
        && cos.shape().dims::<4>() == table
        && sin.shape().dims::<4>() == table;
    ok.then_some(rope::RopeShape {
        rows: dims[0] * dims[1],
        heads: dims[2],
        d: dims[3],
    })
}

/// `pass` ([`rope::rope`] or [`rope::rope_backward`]) on `t [b, t, h, d]` and its tables, or `None` for
/// other shapes (see [`rope_shape`]).
fn fused_rope(
    pass: rope::RopePass,
    t: FloatTensor<Flex>,
    cos: FloatTensor<Flex>,
    sin: FloatTensor<Flex>,
) -> Option<FloatTensor<Flex>> {
    let (t, dims) = host_f32(t);
    let shape = rope_shape(&dims, &cos, &sin)?;
    let (c, s) = (host_f32(cos).0, host_f32(sin).0);
    let y = pass(shape, f32_slice(&t), f32_slice(&c), f32_slice(&s));
    Some(FlexTensor::from_data(TensorData::new(y, dims)))
}

impl KernelOps for Flex {
    /// On the blocked fixed-order GEMM ([`kernel::gemm`]) whatever the deterministic switch: transposed
    /// operands are read through strides (only their packing pays for the layout).
    fn grad_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        lhs_transposed: bool,
        rhs_transposed: bool,
    ) -> FloatTensor<Self> {
        let (a, ad) = host_f32(lhs);
        let (b, bd) = host_f32(rhs);
        let r = ad.len();
        assert!(
            r >= 2 && bd.len() == r && ad[..r - 2] == bd[..r - 2],
            "grad_matmul: shapes {ad:?} and {bd:?} do not match"
        );
        let batch: usize = ad[..r - 2].iter().product();
        let (m, k) = if lhs_transposed {
            (ad[r - 1], ad[r - 2])
        } else {
            (ad[r - 2], ad[r - 1])
        };
        let (bk, n) = if rhs_transposed {
            (bd[r - 1], bd[r - 2])
        } else {
            (bd[r - 2], bd[r - 1])
        };
        assert_eq!(k, bk, "grad_matmul: inner dimensions {k} and {bk} differ");
        let av: &[f32] = a.as_slice::<f32>().expect("contiguous f32 tensor");
        let bv: &[f32] = b.as_slice::<f32>().expect("contiguous f32 tensor");
        let product = |i: usize| {
            let (ai, bi) = (
                &av[i * m * k..(i + 1) * m * k],
                &bv[i * k * n..(i + 1) * k * n],
            );
            let sa = if lhs_transposed {
                Strided::transposed(ai, m)
            } else {
                Strided::rows(ai, k)
            };
            let sb = if rhs_transposed {
                Strided::transposed(bi, k)
            } else {
                Strided::rows(bi, n)
            };
            gemm(sa, sb, m, k, n)
        };
        let y: Vec<f32> = if batch == 1 {
            product(0)
        } else {
            (0..batch).into_par_iter().flat_map_iter(product).collect()
        };
        let mut shape = ad;
        shape[r - 2] = m;
        shape[r - 1] = n;
        FlexTensor::from_data(TensorData::new(y, shape))
    }

    /// `g · dequant(Q(W))` on [`kernel::gemm`], a fixed order like every product of the backward: the
    /// weight decoded once per call, a block of rows at a time into the GEMM's packing (never a whole f32
    /// copy: that was a fresh allocation of the weight's size per layer and micro-batch).
    fn quant_matmul_transposed(g: FloatTensor<Self>, packed: PackedWeight) -> FloatTensor<Self> {
        let (g, gd) = host_f32(g);
        let [out, inn] = packed.0.shape();
        let m = gd[0];
        assert_eq!(
            gd,
            [m, out],
            "quant_matmul_transposed: gradient is {gd:?}, weight [{out}, {inn}]"
        );
        let gv: &[f32] = g.as_slice::<f32>().expect("contiguous f32 tensor");
        let row = |r: usize, dst: &mut [f32]| packed.0.dequantize_row(r, dst);
        let y = gemm_rows(Strided::rows(gv, out), &row, m, out, inn);
        FlexTensor::from_data(TensorData::new(y, [m, inn]))
    }

    /// One parallel pass, bitwise the op-by-op path ([`swiglu`]).
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (g, dims) = host_f32(gate);
        let (u, udims) = host_f32(up);
        assert_eq!(dims, udims, "swiglu: gate {dims:?} and up {udims:?} differ");
        let (gv, uv) = (f32_slice(&g), f32_slice(&u));
        FlexTensor::from_data(TensorData::new(swiglu::swiglu(gv, uv), dims))
    }

    /// One parallel pass, bitwise burn autodiff's backwards of the op-by-op path ([`swiglu`]).
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (g, dims) = host_f32(gate);
        let (u, udims) = host_f32(up);
        let (d, ddims) = host_f32(grad);
        assert!(
            dims == udims && dims == ddims,
            "swiglu_backward: shapes {dims:?}, {udims:?} and {ddims:?} differ"
        );
        let (dg, du) = swiglu::swiglu_backward(f32_slice(&g), f32_slice(&u), f32_slice(&d));
        (
            FlexTensor::from_data(TensorData::new(dg, dims.clone())),
            FlexTensor::from_data(TensorData::new(du, dims)),
        )
    }

    /// One parallel pass, bitwise the op-by-op default ([`head::logprob_grad_rows`]).
    fn logprob_grad_rows(
        z: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        g: FloatTensor<Self>,
        targets: &[u32],
    ) -> FloatTensor<Self> {
        let (z, dims) = host_f32(z);
        let (lse, _) = host_f32(lse);
        let (g, _) = host_f32(g);
        let v = dims[1];
        let d = head::logprob_grad_rows(f32_slice(&z), f32_slice(&lse), f32_slice(&g), targets, v);
        FlexTensor::from_data(TensorData::new(d, dims))
    }

    /// One parallel pass ([`rope::rope`]); `None` for shapes other than `x [b, t, h, d]` with tables
    /// `[b, t, 1, d]`.
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        fused_rope(rope::rope, x, cos, sin)
    }

    /// One parallel pass ([`rope::rope_backward`]).
    fn rope_backward(
        g: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        fused_rope(rope::rope_backward, g, cos, sin)
    }

    /// The experts in parallel straight on the kernel layout ([`moe`]), bitwise the loop.
    fn grouped_moe(
        x: FloatTensor<Self>,
        route_w: FloatTensor<Self>,
        ids: IntTensor<Self>,
        experts: ExpertWeights,
    ) -> Option<FloatTensor<Self>> {
        let ids: Vec<u32> = ids
            .into_data()
            .convert::<i64>()
            .iter::<i64>()
            .map(|e| e as u32)
            .collect();
        let x: FlexTensor = x.to_contiguous();
        let route_w: FlexTensor = route_w.to_contiguous();
        let dims = x.layout().shape().to_vec();
        let wdims = route_w.layout().shape().to_vec();
        let (xs, ws) = (x.as_slice::<f32>()?, route_w.as_slice::<f32>()?);
        if dims.len() != 2 || wdims.len() != 2 || wdims[0] != dims[0] {
            return None;
        }
        let y = moe::grouped_moe(xs, ws, &ids, wdims[1], &experts);
        Some(FlexTensor::from_data(TensorData::new(y, dims)))
    }

    fn grouped_moe_matches_loop(_x: &FloatTensor<Self>) -> bool {
        true
    }

    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        scale: f32,
    ) -> Option<FloatTensor<Self>> {
        if !deterministic() {
            return None;
        }
        let (q, k, v, mask): (FlexTensor, FlexTensor, FlexTensor, FlexTensor) = (
            q.to_contiguous(),
            k.to_contiguous(),
            v.to_contiguous(),
            mask.to_contiguous(),
        );
        let (qd, kd) = (q.layout().shape().to_vec(), k.layout().shape().to_vec());
        let md = mask.layout().shape().to_vec();
        if qd.len() != 4 || kd.len() != 4 || md.len() != 4 || v.layout().shape().to_vec() != kd {
            return None;
        }
        let sh = attention::AttentionShape {
            b: qd[0],
            kv: qd[1],
            rows: qd[2],
            t: md[2],
            s: kd[2],
            d: qd[3],
        };
        if kd[..2] != qd[..2] || kd[3] != sh.d || md != [sh.b, 1, sh.t, sh.s] || sh.t == 0 {
            return None;
        }
        let y = attention::attention_core(
            q.as_slice::<f32>()?,
            k.as_slice::<f32>()?,
            v.as_slice::<f32>()?,
            Some(mask.as_slice::<f32>()?),
            scale,
            sh,
        );
        Some(FlexTensor::from_data(TensorData::new(y, qd)))
    }

    fn quant_matmul(
        x: FloatTensor<Self>,
        _master: FloatTensor<Self>,
        packed: PackedWeight,
    ) -> FloatTensor<Self> {
        let x: FlexTensor = x.to_contiguous();
        let dims = x.layout().shape().to_vec();
        let (m, inn) = (dims[0], dims[1]);
        let w = &packed.0;
        assert_eq!(
            inn,
            w.in_features(),
            "quant_matmul: activations have {inn} columns, weight expects {}",
            w.in_features()
        );
        let xs: &[f32] = x.as_slice::<f32>().expect("contiguous f32 activations");
        let y = packed.1.matmul(xs, m);
        FlexTensor::from_data(TensorData::new(y, [m, w.out_features()]))
    }

    fn aligned_softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        let rank = x.shape().num_dims();
        if !deterministic() || dim + 1 != rank {
            return backend_softmax::<Self>(x, dim);
        }
        let x: FlexTensor = x.to_contiguous();
        let dims = x.layout().shape().to_vec();
        let xs: &[f32] = x.as_slice::<f32>().expect("contiguous f32 tensor");
        let y = kernel::softmax_rows(xs, dims[rank - 1]);
        FlexTensor::from_data(TensorData::new(y, dims))
    }

    fn det_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        w_transposed: bool,
    ) -> FloatTensor<Self> {
        if !deterministic() {
            return plain_matmul::<Self>(x, w, w_transposed);
        }
        let x: FlexTensor = x.to_contiguous();
        let w: FlexTensor = w.to_contiguous();
        let xd = x.layout().shape().to_vec();
        let wd = w.layout().shape().to_vec();
        let r = xd.len();
        assert!(
            r >= 2 && wd.len() == r && xd[..r - 2] == wd[..r - 2],
            "det_matmul: shapes {xd:?} and {wd:?} do not match"
        );
        let (m, k) = (xd[r - 2], xd[r - 1]);
        let (wk, n) = if w_transposed {
            (wd[r - 1], wd[r - 2])
        } else {
            (wd[r - 2], wd[r - 1])
        };
        assert_eq!(k, wk, "det_matmul: inner dimensions {k} and {wk} differ");
        let batch: usize = xd[..r - 2].iter().product();
        let xs: &[f32] = x.as_slice::<f32>().expect("contiguous f32 activations");
        let ws: &[f32] = w.as_slice::<f32>().expect("contiguous f32 weights");
        let y = if w_transposed {
            kernel::f32_matmul_nt(xs, ws, batch, m, k, n)
        } else {
            kernel::f32_matmul(xs, ws, batch, m, k, n)
        };
        let mut shape = xd;
        shape[r - 1] = n;
        FlexTensor::from_data(TensorData::new(y, shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, shape))
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 997) as f32 - 498.0) / 331.0)
            .collect()
    }

    /// `[.., r, c]` -> `[.., c, r]` on the host.
    fn transpose(v: &[f32], batch: usize, r: usize, c: usize) -> Vec<f32> {
        let mut out = vec![0.0; v.len()];
        for b in 0..batch {
            for i in 0..r {
                for j in 0..c {
                    out[b * r * c + j * r + i] = v[b * r * c + i * c + j];
                }
            }
        }
        out
    }

    /// Every transpose combination of the backward's products is the one-chain reference on the explicitly
    /// transposed operands, bit for bit (so the gradients do not depend on how an operand is stored),
    /// batched and not, with shapes off every block size.
    #[test]
    fn grad_matmul_is_the_fixed_order_product_of_the_transposed_operands() {
        for (batch, m, k, n) in [
            (1, 37, 70, 131),
            (3, 5, 33, 17),
            (1, 1, 9, 70),
            (2, 66, 1, 3),
        ] {
            let a = values(batch * m * k, 1);
            let b = values(batch * k * n, 2);
            let expect = kernel::f32_matmul_reference(&a, &b, batch, m, k, n);
            for (lt, rt) in [(false, false), (true, false), (false, true), (true, true)] {
                let (av, ashape) = if lt {
                    (transpose(&a, batch, m, k), vec![batch, k, m])
                } else {
                    (a.clone(), vec![batch, m, k])
                };
                let (bv, bshape) = if rt {
                    (transpose(&b, batch, k, n), vec![batch, n, k])
                } else {
                    (b.clone(), vec![batch, k, n])
                };
                let y = Flex::grad_matmul(tensor(av, ashape), tensor(bv, bshape), lt, rt);
                let y: FlexTensor = y.to_contiguous();
                assert_eq!(y.layout().shape().to_vec(), vec![batch, m, n]);
                let got = y.as_slice::<f32>().unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(got),
                    bits(&expect),
                    "{batch}x{m}x{k}x{n} lt={lt} rt={rt}"
                );
            }
        }
    }
}
