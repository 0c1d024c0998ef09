//! Fixed-order f32 kernels for the full-precision ops of a transformer forward: the matmul (attention
//! scores and values, full-precision projections, the LM head), the row softmax and the row mean (RMSNorm).
//!
//! Why: the rollout decodes one token at a time against a KV cache while the training forward runs whole
//! sequences, so the two agree bitwise only if every op computes a token's values in an order that does not
//! depend on the shape of the call. burn's own CubeCL kernels pick tilings and reduction trees by shape.
//! These kernels compute **one output per unit, summing sequentially in index order from 0.0** (a chain of
//! fused multiply-adds for the matmul): an output's bits depend only on its own inputs. Padding that
//! contributes exact zeros (masked keys after the softmax, zero-padded key slots) leaves a sequential sum
//! unchanged, so a decode row and the same row inside a longer, masked sequence give the same bits.
//! Correctness and batch invariance first: no tiling, no shared memory.
//!
//! Every kernel is indexed by `ABSOLUTE_POS` over a grid of 256-unit cubes and guards against the padding
//! of the last cube.

use cubecl::prelude::*;

/// `y[b, i, j] = sum_k x[b, i, k] * w[b, k, j]` (`w[b, j, k]` with `w_transposed`), for `total = batches *
/// m * n` outputs, each one fused multiply-add chain in `k` order from 0.0.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    total: usize,
    m: usize,
    k: usize,
    n: usize,
    #[comptime] w_transposed: bool,
) {
    let id = ABSOLUTE_POS;
    if id < total {
        let j = id % n;
        let i = (id / n) % m;
        let b = id / (m * n);
        let xoff = (b * m + i) * k;
        let mut acc = 0.0f32;
        if comptime!(w_transposed) {
            let woff = (b * n + j) * k;
            for kk in 0..k {
                acc = fma(x[xoff + kk], w[woff + kk], acc);
            }
        } else {
            let woff = b * k * n + j;
            for kk in 0..k {
                acc = fma(x[xoff + kk], w[woff + kk * n], acc);
            }
        }
        y[id] = acc;
    }
}

/// `y[r, :] = softmax(x[r, :])` for `rows` rows of `len` (>= 1) values: the maximum and the sum of
/// `exp(x - max)` in index order, then `exp(x - max) / sum`. Entries of `-inf` (masked keys) add exact
/// zeros and never raise the maximum, so they do not change the other entries' bits.
#[cube(launch, create_dummy_kernel)]
pub fn softmax_rows(x: &[f32], y: &mut [f32], rows: usize, len: usize) {
    let r = ABSOLUTE_POS;
    if r < rows {
        let off = r * len;
        let mut max = x[off];
        for i in 1..len {
            let v = x[off + i];
            if v > max {
                max = v;
            }
        }
        let mut sum = 0.0f32;
        for i in 0..len {
            sum += (x[off + i] - max).exp();
        }
        for i in 0..len {
            y[off + i] = (x[off + i] - max).exp() / sum;
        }
    }
}

/// `y[r] = (sum_i x[r, i]) / len` for `rows` rows of `len` values (`len_f`: `len` as f32), the sum in index
/// order from 0.0.
#[cube(launch, create_dummy_kernel)]
pub fn mean_rows(x: &[f32], y: &mut [f32], rows: usize, len: usize, len_f: f32) {
    let r = ABSOLUTE_POS;
    if r < rows {
        let off = r * len;
        let mut sum = 0.0f32;
        for i in 0..len {
            sum += x[off + i];
        }
        y[r] = sum / len_f;
    }
}
