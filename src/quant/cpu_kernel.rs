//! The low-bit matmul on the CPU: `y[m, out] = x[m, in] · W'^T` reading the packed codes of a
//! [`QuantizedTensor`] (W' = dequant(Q(W)), decoded one output row at a time, never materialised whole).
//!
//! Every output element is reduced in one fixed order (eight interleaved partial sums over the input axis,
//! combined as a fixed tree), independent of `m`, of which other rows share the call and of the thread
//! count: the same token gets the same bits whether it is decoded alone, in a batch, or scored in a full
//! sequence. This is the arithmetic shared by rollout and the aligned training forward. The speed work
//! (SIMD, repacking) is the CPU-kernels issue; this version is multithreaded and exact.

use rayon::prelude::*;

use super::fp8::Fp8Activations;
use super::tensor::QuantizedTensor;

/// Output rows handled by one task.
const ROWS_PER_TASK: usize = 16;

/// The fixed-order dot product: lane `k % 8` accumulates `a[k] * b[k]` (a multiply then an add, never fused),
/// then the lanes are combined as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
#[inline]
pub fn dot_fixed(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, w) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * w[l];
        }
    }
    for k in chunks * 8..a.len() {
        acc[k % 8] += a[k] * b[k];
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

/// The activations the product sees: `x` itself for weight-only schemes, `dequant(Q8(x))` for fp8 W8A8
/// (per token, per 128 input columns, E4M3). Non-finite activations propagate as NaN instead of failing.
pub fn effective_activations(w: &QuantizedTensor, x: &[f32], m: usize) -> Vec<f32> {
    if !w.scheme().quantizes_activations() {
        return x.to_vec();
    }
    match Fp8Activations::quantize(x, m, w.in_features()) {
        Ok(a) => a.dequantize(),
        Err(_) => vec![f32::NAN; x.len()],
    }
}

/// `y[m, out] = x[m, in] · dequant(Q(W))^T` with the fixed reduction order of [`dot_fixed`].
pub fn lowbit_matmul(w: &QuantizedTensor, x: &[f32], m: usize) -> Vec<f32> {
    let (out, inn) = (w.out_features(), w.in_features());
    assert_eq!(x.len(), m * inn, "activations must be [m, in]");
    let xa = effective_activations(w, x, m);
    // Computed transposed ([out, m]) so that each task owns a contiguous block of output rows.
    let mut yt = vec![0.0f32; out * m];
    yt.par_chunks_mut(ROWS_PER_TASK * m.max(1))
        .enumerate()
        .for_each(|(task, block)| {
            let mut buf = vec![0.0f32; inn];
            for (j, col) in block.chunks_mut(m.max(1)).enumerate() {
                let o = task * ROWS_PER_TASK + j;
                w.dequantize_row(o, &mut buf);
                for (i, y) in col.iter_mut().enumerate().take(m) {
                    *y = dot_fixed(&xa[i * inn..(i + 1) * inn], &buf);
                }
            }
        });
    let mut y = vec![0.0f32; m * out];
    for o in 0..out {
        for i in 0..m {
            y[i * out + o] = yt[o * m + i];
        }
    }
    y
}
