//! Host references in the kernels' canonical summation order, so tests can ask for bit-exact agreement
//! (kernel vs kernel, batch invariance) and for agreement within rounding against a plain sum.
//!
//! Canonical order, per output: `total = 0.0`; for each chunk of [`CHUNK`] consecutive inputs (the last
//! one shorter), `part = 0.0`, then `part = fma(x[k], w[k], part)` for `k` in order, then
//! `total = total + part`.

use crate::e4m3::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use crate::format::{PackedWeights, CHUNK, FP8_BLOCK};
use crate::moe::MoeRouting;

/// The canonical dot product of `x` and `w` (same length).
pub fn canonical_dot(x: &[f32], w: &[f32]) -> f32 {
    let mut total = 0.0f32;
    for (xc, wc) in x.chunks(CHUNK).zip(w.chunks(CHUNK)) {
        let mut part = 0.0f32;
        for (a, b) in xc.iter().zip(wc) {
            part = a.mul_add(*b, part);
        }
        total += part;
    }
    total
}

/// fp8 activations as the matmul reads them: per row per 128 columns `s = absmax / 448`, values
/// `e4m3(code(x / s)) * s`. Returns (values, scales `[rows, ceil(cols/128)]`).
pub fn fp8_activations(x: &[f32], rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let blocks = cols.div_ceil(FP8_BLOCK);
    let mut values = vec![0.0f32; rows * cols];
    let mut scales = vec![0.0f32; rows * blocks];
    for r in 0..rows {
        for b in 0..blocks {
            let range = r * cols + b * FP8_BLOCK..r * cols + ((b + 1) * FP8_BLOCK).min(cols);
            // A block with a NaN or an infinity is NaN throughout, as the kernel writes it.
            if x[range.clone()].iter().any(|v| !v.is_finite()) {
                scales[r * blocks + b] = f32::NAN;
                values[range].fill(f32::NAN);
                continue;
            }
            let m = x[range.clone()].iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let s = m / E4M3_MAX;
            scales[r * blocks + b] = s;
            for i in range {
                let code = if s == 0.0 { 0 } else { f32_to_e4m3(x[i] / s) };
                values[i] = e4m3_to_f32(code) * s;
            }
        }
    }
    (values, scales)
}

/// The activations a weight's matmul consumes: fp8-quantized for W8A8, unchanged otherwise.
pub fn prepare_activations(x: &[f32], rows: usize, w: &PackedWeights) -> Vec<f32> {
    if w.format().quantizes_activations() {
        fp8_activations(x, rows, w.in_features()).0
    } else {
        x.to_vec()
    }
}

/// `y[n, out] = x[n, inn] · W_e^T` in the canonical order (activations prepared as the format asks).
pub fn linear(x: &[f32], n: usize, w: &PackedWeights, e: usize) -> Vec<f32> {
    let inn = w.in_features();
    let x = prepare_activations(x, n, w);
    let wd = w.dequantize(e);
    let mut y = Vec::with_capacity(n * w.out_features());
    for t in 0..n {
        for row in 0..w.out_features() {
            y.push(canonical_dot(
                &x[t * inn..(t + 1) * inn],
                &wd[row * inn..(row + 1) * inn],
            ));
        }
    }
    y
}

/// `dx[n, inn] = g[n, out] · W_e` in the canonical order over the output axis.
pub fn linear_transposed(g: &[f32], n: usize, w: &PackedWeights, e: usize) -> Vec<f32> {
    let (out, inn) = (w.out_features(), w.in_features());
    let wd = w.dequantize(e);
    let mut dx = Vec::with_capacity(n * inn);
    for t in 0..n {
        for k in 0..inn {
            let col: Vec<f32> = (0..out).map(|o| wd[o * inn + k]).collect();
            dx.push(canonical_dot(&g[t * out..(t + 1) * out], &col));
        }
    }
    dx
}

/// `silu(g) * u` as the kernel writes it.
pub fn silu_mul(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

/// The MoE block: for each assignment, `h = silu(x W_gate^T) * (x W_up^T)`, `y = h W_down^T`, then
/// `out[t] = sum_j route_w[t, j] y[t, j]` in slot order with fused multiply-adds.
pub fn moe(
    x: &[f32],
    routing: &MoeRouting,
    ids: &[u32],
    route_w: &[f32],
    gate: &PackedWeights,
    up: &PackedWeights,
    down: &PackedWeights,
) -> Vec<f32> {
    moe_staged(x, routing, ids, route_w, [gate, up, down], |v| v)
}

/// [`moe`] with each SwiGLU output passed through `stage` before the down projection: the tensor-core
/// tiles' operands round it to the activations' type ([`crate::kernels::mma_moe`], `ActDType::round`).
pub fn moe_staged(
    x: &[f32],
    routing: &MoeRouting,
    ids: &[u32],
    route_w: &[f32],
    [gate, up, down]: [&PackedWeights; 3],
    stage: impl Fn(f32) -> f32,
) -> Vec<f32> {
    let (tokens, top_k) = (routing.tokens(), routing.top_k());
    let hidden = gate.in_features();
    let xq = prepare_activations(x, tokens, gate);
    let mut out = vec![0.0f32; tokens * hidden];
    let mut ys = vec![Vec::new(); tokens * top_k];
    for t in 0..tokens {
        for j in 0..top_k {
            let e = ids[t * top_k + j] as usize;
            let xt = &xq[t * hidden..(t + 1) * hidden];
            let g = linear_prepared(xt, gate, e);
            let u = linear_prepared(xt, up, e);
            let h: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| stage(silu_mul(*g, *u)))
                .collect();
            ys[t * top_k + j] = linear(&h, 1, down, e);
        }
    }
    for t in 0..tokens {
        for c in 0..hidden {
            let mut acc = 0.0f32;
            for j in 0..top_k {
                acc = route_w[t * top_k + j].mul_add(ys[t * top_k + j][c], acc);
            }
            out[t * hidden + c] = acc;
        }
    }
    out
}

fn linear_prepared(x: &[f32], w: &PackedWeights, e: usize) -> Vec<f32> {
    let inn = w.in_features();
    let wd = w.dequantize(e);
    (0..w.out_features())
        .map(|row| canonical_dot(x, &wd[row * inn..(row + 1) * inn]))
        .collect()
}
