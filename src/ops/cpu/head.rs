//! The LM head backward's per-chunk gradient with respect to the logits in one parallel pass.
//!
//! Op by op (`exp(z - lse)`, the product with `g`, the negation, the scatter-add of `g` at the targets),
//! a chunk of 256 rows of a 49152-token vocabulary is five single-threaded passes over 50 MB, the scatter
//! copying the whole chunk once more. Here each row is one pass, rows in parallel, each element rounded as
//! there: `d = -(exp(z - lse) * g)`, then `d[target] = d[target] + g` (a sum or product of two values is
//! commutative in IEEE 754, so the operand order of those ops does not matter). `exp` is `f32::exp`, the
//! function burn flex's `exp` applies.

use rayon::prelude::*;

/// `z [r, v]` row-major, `lse [r]`, `g [r]`, `targets [r]` -> `d [r, v]`:
/// `d[i, j] = -(exp(z[i, j] - lse[i]) * g[i])`, plus `g[i]` at `targets[i]`.
///
/// # Panics
/// When the lengths do not match `r` rows of `v`, or a target is `>= v`.
pub fn logprob_grad_rows(z: &[f32], lse: &[f32], g: &[f32], targets: &[u32], v: usize) -> Vec<f32> {
    let r = targets.len();
    assert!(
        z.len() == r * v && lse.len() == r && g.len() == r,
        "logprob_grad_rows: {} logits, {} normalisers, {} gradients for {r} rows of {v}",
        z.len(),
        lse.len(),
        g.len()
    );
    let mut d = vec![0.0f32; r * v];
    d.par_chunks_mut(v.max(1))
        .zip(z.par_chunks(v.max(1)))
        .enumerate()
        .for_each(|(i, (d, z))| {
            let (l, gi) = (lse[i], g[i]);
            for (d, &z) in d.iter_mut().zip(z) {
                *d = -((z - l).exp() * gi);
            }
            let t = targets[i] as usize;
            d[t] += gi;
        });
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{tensor_from_vec, to_f32_vec};
    use burn::tensor::{Device, IndexingUpdateOp, Int, Tensor, TensorData};

    /// The fused pass against the same chain of burn tensor ops on the CPU, bit for bit.
    #[test]
    fn fused_logits_gradient_is_bitwise_the_op_chain() {
        let (r, v) = (5usize, 1037usize);
        let z: Vec<f32> = (0..r * v)
            .map(|i| ((i * 7919 % 1000) as f32 / 100.0 - 5.0) * if i % 13 == 0 { 3.0 } else { 1.0 })
            .collect();
        let lse: Vec<f32> = (0..r).map(|i| 6.5 + i as f32 * 0.37).collect();
        let g: Vec<f32> = (0..r).map(|i| (i as f32 - 2.0) * 0.731).collect();
        let targets: Vec<u32> = vec![0, 1036, 17, 17, 512];

        let device = Device::flex();
        let zt = tensor_from_vec(z.clone(), [r, v], &device);
        let col = |x: &Vec<f32>| tensor_from_vec(x.clone(), [r, 1], &device);
        let p = (zt - col(&lse).expand([r, v])).exp();
        let d = (p * col(&g).expand([r, v])).neg();
        let at: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
        let at = Tensor::<2, Int>::from_data(TensorData::new(at, [r, 1]), &device);
        let want = to_f32_vec(d.scatter(1, at, col(&g), IndexingUpdateOp::Add));

        let got = logprob_grad_rows(&z, &lse, &g, &targets, v);
        let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
    }
}
