//! SwiGLU's elementwise product `silu(g) * u` and its gradient in one parallel pass each, with the bits of
//! the op-by-op path on burn flex (`g.clone().mul(sigmoid(g)).mul(u)` and burn autodiff's backwards of
//! those three ops).
//!
//! Op by op, the product is five single-threaded passes over `[n, intermediate]` tensors in the forward
//! (sigmoid, two products) and ten in the backward, each allocating its output: on a 2-core machine the
//! learner's other thread idles through them. Every element's arithmetic here is the same sequence of
//! rounded f32 operations as there (a product or sum of two values is commutative in IEEE 754, so only
//! the grouping of three-term expressions matters, and it is kept):
//!
//! ```text
//! forward:   s = sigmoid(g);  h = (g * s) * u
//! backward:  du = dh * (g * s);  dgs = dh * u;  dg = dgs * s + ((dgs * g) * s) * (1 - s)
//! ```
//!
//! where `sigmoid` is burn flex's formula ([`flex_sigmoid`]) and the last term is flex's
//! `sigmoid_backward(s, ds) = ds * s * (1 - s)`. Elements are independent, so the split over threads does
//! not change any bit.

use rayon::prelude::*;

/// Elements per parallel task: large enough that a task outweighs its scheduling, small enough that
/// both cores get work on a few hundred tokens.
const CHUNK: usize = 1 << 14;

/// burn flex's `sigmoid` on f32, the branch-for-branch formula `silu` uses there.
#[inline]
pub fn flex_sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `silu(g) * u` of one element, as `g.mul(sigmoid(g)).mul(u)` rounds it.
#[inline]
pub fn silu_mul(g: f32, u: f32) -> f32 {
    (g * flex_sigmoid(g)) * u
}

/// `(d gate, d up)` of one element for the incoming gradient `dh`, as burn autodiff's backwards of the
/// two products and the sigmoid round them.
#[inline]
fn silu_mul_grad(g: f32, u: f32, dh: f32) -> (f32, f32) {
    let s = flex_sigmoid(g);
    let du = dh * (g * s);
    let dgs = dh * u;
    let ds = dgs * g;
    (dgs * s + ds * s * (1.0 - s), du)
}

/// `silu(gate) * up`, elementwise (equal lengths).
///
/// # Panics
/// When the lengths differ.
pub fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up lengths differ");
    let mut out = vec![0.0f32; gate.len()];
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = silu_mul(g, u);
            }
        });
    out
}

/// The gradients `(d gate, d up)` of [`swiglu`] for the incoming gradient `grad` (equal lengths).
///
/// # Panics
/// When the lengths differ.
pub fn swiglu_backward(gate: &[f32], up: &[f32], grad: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let n = gate.len();
    assert!(
        up.len() == n && grad.len() == n,
        "swiglu_backward: lengths {n}, {} and {} differ",
        up.len(),
        grad.len()
    );
    let (mut dgate, mut dup) = (vec![0.0f32; n], vec![0.0f32; n]);
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, (dg, du))| {
            let at = c * CHUNK;
            let end = at + dg.len();
            let inputs = gate[at..end].iter().zip(&up[at..end]).zip(&grad[at..end]);
            for ((dg, du), ((&g, &u), &dh)) in dg.iter_mut().zip(du.iter_mut()).zip(inputs) {
                (*dg, *du) = silu_mul_grad(g, u, dh);
            }
        });
    (dgate, dup)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{tensor_from_vec, to_f32_vec};
    use burn::tensor::Device;

    /// Values around zero (both sigmoid branches), large magnitudes (saturation) and a long tail, more
    /// than one chunk.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32;
                (x / (1u32 << 24) as f32 - 0.5) * if i % 7 == 0 { 60.0 } else { 8.0 }
            })
            .collect()
    }

    /// The fused forward and backward against burn's own ops on the autodiff CPU backend, bit for bit.
    #[test]
    fn fused_swiglu_is_bitwise_the_op_by_op_graph() {
        let n = CHUNK * 2 + 123;
        let (g, u, dh) = (values(n, 1), values(n, 77), values(n, 5));
        let device = Device::flex().autodiff();
        let t = |v: &Vec<f32>| tensor_from_vec(v.clone(), [n], &device).require_grad();
        let (gt, ut) = (t(&g), t(&u));
        let h = burn::tensor::activation::silu(gt.clone()) * ut.clone();
        let want_h = to_f32_vec(h.clone());
        let grads = (h * tensor_from_vec(dh.clone(), [n], &device))
            .sum()
            .backward();
        let want_dg = to_f32_vec(gt.grad(&grads).unwrap());
        let want_du = to_f32_vec(ut.grad(&grads).unwrap());

        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&swiglu(&g, &u)), bits(&want_h), "forward");
        let (dg, du) = swiglu_backward(&g, &u, &dh);
        assert_eq!(bits(&dg), bits(&want_dg), "d gate");
        assert_eq!(bits(&du), bits(&want_du), "d up");
    }
}
