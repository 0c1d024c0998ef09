//! Rotary position embedding (half-split pairing) and its gradient in one parallel pass each, with the
//! bits of the op-by-op path on burn flex (`x * cos + cat(-x2, x1) * sin` and burn autodiff's backwards
//! of those ops).
//!
//! Op by op the rotation is six single-threaded passes (two narrows, a negation, a concatenation, two
//! products and a sum) forward and about as many backward, each allocating. Per element, with `h = d / 2`:
//!
//! ```text
//! forward   y[j]     = x[j] * c[j]         + (-x[j + h]) * s[j]
//!           y[j + h] = x[j + h] * c[j + h] + x[j] * s[j + h]
//! backward  dx[j]     = (g[j] * c[j]         + g[j + h] * s[j + h]) + 0
//!           dx[j + h] = (g[j + h] * c[j + h] + -(g[j] * s[j]))   + 0
//! ```
//!
//! The trailing `+ 0` is the zero padding that the backward of each narrow adds (burn accumulates the
//! three gradients of `x` by adding tensors): it turns a `-0` into `+0` and nothing else, wherever it
//! falls in the sum. Rows `(b, t)` are independent, so the split over threads changes no bit.

use rayon::prelude::*;

/// [`rope`] or [`rope_backward`]: `(shape, values, cos, sin) -> result`.
pub type RopePass = fn(RopeShape, &[f32], &[f32], &[f32]) -> Vec<f32>;

/// Positions `(b, t)` per parallel task.
const ROWS_PER_TASK: usize = 16;

/// The shapes of one call: `x [rows, heads, d]`, `cos`/`sin` `[rows, d]` (one table row per position,
/// shared by the heads).
#[derive(Clone, Copy, Debug)]
pub struct RopeShape {
    pub rows: usize,
    pub heads: usize,
    pub d: usize,
}

impl RopeShape {
    fn check(&self, x: usize, table: usize) {
        let RopeShape { rows, heads, d } = *self;
        assert!(
            d % 2 == 0 && x == rows * heads * d && table == rows * d,
            "rope: {x} values and {table} table entries for {rows} positions x {heads} heads x {d}"
        );
    }
}

/// Applies `f(x_head, c, s, out_head)` to every head of every position, positions in parallel.
fn per_head(
    shape: RopeShape,
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    f: impl Fn(&[f32], &[f32], &[f32], &mut [f32]) + Sync,
) -> Vec<f32> {
    let RopeShape { heads, d, .. } = shape;
    let mut out = vec![0.0f32; x.len()];
    let row = heads * d;
    out.par_chunks_mut(row * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(task, out)| {
            for (r, out) in out.chunks_mut(row).enumerate() {
                let p = task * ROWS_PER_TASK + r;
                let (c, s) = (&cos[p * d..(p + 1) * d], &sin[p * d..(p + 1) * d]);
                for (hd, out) in out.chunks_mut(d).enumerate() {
                    let at = p * row + hd * d;
                    f(&x[at..at + d], c, s, out);
                }
            }
        });
    out
}

/// The rotation of `x` by the position tables.
///
/// # Panics
/// When the lengths do not match `shape` or `d` is odd.
pub fn rope(shape: RopeShape, x: &[f32], cos: &[f32], sin: &[f32]) -> Vec<f32> {
    shape.check(x.len(), cos.len());
    shape.check(x.len(), sin.len());
    let h = shape.d / 2;
    per_head(shape, x, cos, sin, |x, c, s, y| {
        for j in 0..h {
            y[j] = x[j] * c[j] + (-x[j + h]) * s[j];
            y[j + h] = x[j + h] * c[j + h] + x[j] * s[j + h];
        }
    })
}

/// The gradient of [`rope`] with respect to `x` for the incoming gradient `g`.
///
/// # Panics
/// When the lengths do not match `shape` or `d` is odd.
pub fn rope_backward(shape: RopeShape, g: &[f32], cos: &[f32], sin: &[f32]) -> Vec<f32> {
    shape.check(g.len(), cos.len());
    shape.check(g.len(), sin.len());
    let h = shape.d / 2;
    per_head(shape, g, cos, sin, |g, c, s, dx| {
        for j in 0..h {
            dx[j] = (g[j] * c[j] + g[j + h] * s[j + h]) + 0.0;
            dx[j + h] = (g[j + h] * c[j + h] + -(g[j] * s[j])) + 0.0;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{tensor_from_vec, to_f32_vec};
    use crate::model::layers::Rope;
    use burn::tensor::Device;

    /// The fused forward and backward against burn's ops on the autodiff CPU backend, bit for bit, on
    /// real tables (positions up to 2000) and values with zeros of both signs in the gradient.
    #[test]
    fn fused_rope_is_bitwise_the_op_by_op_graph() {
        let (b, t, heads, d) = (2usize, 37usize, 3usize, 64usize);
        let device = Device::flex().autodiff();
        let positions: Vec<Vec<usize>> = (0..b)
            .map(|r| (0..t).map(|i| i * (1 + 53 * r)).collect())
            .collect();
        let (cos, sin) = Rope::new(d, 10000.0).tables(&positions, &device);
        let n = b * t * heads * d;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 2_654_435_761) % 10007) as f32 / 1000.0 - 5.0)
            .collect();
        let g: Vec<f32> = (0..n)
            .map(|i| match i % 11 {
                0 => 0.0,
                1 => -0.0,
                _ => ((i * 40503) % 9973) as f32 / 997.0 - 5.0,
            })
            .collect();
        let xt = tensor_from_vec(x.clone(), [b, t, heads, d], &device).require_grad();
        let y = Rope::apply_op_by_op(xt.clone(), &cos, &sin);
        let want_y = to_f32_vec(y.clone());
        let gt = tensor_from_vec(g.clone(), [b, t, heads, d], &device);
        let grads = (y * gt).sum().backward();
        let want_dx = to_f32_vec(xt.grad(&grads).unwrap());

        let shape = RopeShape {
            rows: b * t,
            heads,
            d,
        };
        let (c, s) = (to_f32_vec(cos), to_f32_vec(sin));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&rope(shape, &x, &c, &s)), bits(&want_y), "forward");
        assert_eq!(
            bits(&rope_backward(shape, &g, &c, &s)),
            bits(&want_dx),
            "backward"
        );
    }
}
