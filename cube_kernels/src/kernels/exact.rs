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
//!
//! The long loops take their inputs in unrolled runs of [`RUN`], in the same index order: Mesa's llvmpipe
//! (lavapipe, the CI's Vulkan driver and a laptop's without a GPU) ends a shader invocation's loops after
//! 65535 iterations in all, and a loop of one iteration per input returned a partial sum as if whole
//! beyond that (`tests/exact.rs::long_rows_are_summed_whole`); in runs the limit is 32 times farther (about
//! 2M inputs for the matmul and the mean, 699k for the softmax's three passes).

use cubecl::prelude::*;

/// Inputs per unrolled run of the long loops (see the module's notes).
pub const RUN: usize = 32;

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
        // `w[woff + kk * wstep]` is row `kk` of the product's `w`.
        let mut woff = b * k * n + j;
        let mut wstep = n;
        if comptime!(w_transposed) {
            woff = (b * n + j) * k;
            wstep = 1;
        }
        let mut acc = 0.0f32;
        let whole = k / RUN * RUN;
        for r in 0..k / RUN {
            let k0 = r * RUN;
            #[unroll]
            for kk in 0..RUN {
                acc = fma(x[xoff + k0 + kk], w[woff + (k0 + kk) * wstep], acc);
            }
        }
        for kk in whole..k {
            acc = fma(x[xoff + kk], w[woff + kk * wstep], acc);
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
        let whole = len / RUN * RUN;
        // The maximum as a chain of `v > max` comparisons from the first entry (a NaN never wins
        // one), the sum in index order.
        let mut max = x[off];
        for c in 0..len / RUN {
            #[unroll]
            for i in 0..RUN {
                let v = x[off + c * RUN + i];
                max = select(v > max, v, max);
            }
        }
        for i in whole..len {
            let v = x[off + i];
            max = select(v > max, v, max);
        }
        let mut sum = 0.0f32;
        for c in 0..len / RUN {
            #[unroll]
            for i in 0..RUN {
                sum += (x[off + c * RUN + i] - max).exp();
            }
        }
        for i in whole..len {
            sum += (x[off + i] - max).exp();
        }
        for c in 0..len / RUN {
            #[unroll]
            for i in 0..RUN {
                let at = off + c * RUN + i;
                y[at] = (x[at] - max).exp() / sum;
            }
        }
        for i in whole..len {
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
        for c in 0..len / RUN {
            #[unroll]
            for i in 0..RUN {
                sum += x[off + c * RUN + i];
            }
        }
        for i in len / RUN * RUN..len {
            sum += x[off + i];
        }
        y[r] = sum / len_f;
    }
}
