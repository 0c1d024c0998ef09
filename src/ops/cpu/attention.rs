//! The core of grouped-query attention on the CPU in deterministic mode, in one pass per (row, key head):
//! scores, scale, mask, softmax and the weighted sum of values, with no tensor ops in between. A decode step
//! of the 195M MoE spent about 2 ms of its 16 in those ops' dispatch and copies (eight layers, five ops
//! each, on a few thousand floats).
//!
//! **The same bits as the op-by-op path** of [`crate::model::attention::Attention`], element by element:
//! - scores: [`super::kernel::f32_matmul_nt`] (`q · k^T`, the 32-lane order), which is what
//!   `det_matmul(q, k, true)` computes on the CPU; it is row- and batch-invariant, so one (row, key head)
//!   at a time gives the batched call's bits;
//! - `score * scale` (one f32 product), then `+ mask` (one f32 sum), as the tensor ops round them;
//! - [`super::kernel::softmax_rows`], as `aligned_softmax` runs it;
//! - [`super::kernel::f32_matmul`] of the probabilities and the values (one fma chain over the keys), as
//!   `det_matmul(probs, v, false)`.
//!
//! So the training forward (the op-by-op path, whose ops carry the gradients) reproduces the rollout's values
//! bit for bit; `tests/rollout.rs` asserts it through the log-probs.

use rayon::prelude::*;

use super::kernel::{f32_matmul, f32_matmul_nt, softmax_rows};

/// The shapes of one attention core: `b` rows, `kv` key heads, `rows = rep * t` query rows per key head
/// (the `rep` query heads sharing it, head-major, `t` queries each), `s` keys, `d` dims per head.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub b: usize,
    pub kv: usize,
    pub rows: usize,
    pub t: usize,
    pub s: usize,
    pub d: usize,
}

/// `q [b, kv, rows, d]`, `k` and `v` `[b, kv, s, d]`, `mask` (additive) `[b, 1, t, s]` or none ->
/// `[b, kv, rows, d]`: `softmax(q k^T * scale + mask) v` per (row, key head). Query row `r` of a key head
/// is query `r % t` (the mask's row).
///
/// # Panics
/// When a slice's length does not match the shape.
pub fn attention_core(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    scale: f32,
    sh: AttentionShape,
) -> Vec<f32> {
    let AttentionShape {
        b,
        kv,
        rows,
        t,
        s,
        d,
    } = sh;
    assert_eq!(q.len(), b * kv * rows * d, "q must be [b, kv, rows, d]");
    assert_eq!(k.len(), b * kv * s * d, "k must be [b, kv, s, d]");
    assert_eq!(v.len(), b * kv * s * d, "v must be [b, kv, s, d]");
    if let Some(m) = mask {
        assert_eq!(m.len(), b * t * s, "the mask must be [b, 1, t, s]");
    }
    assert!(t > 0 && rows % t == 0, "rows must be a multiple of t");
    let mut out = vec![0.0f32; b * kv * rows * d];
    if out.is_empty() || s == 0 {
        return out;
    }
    out.par_chunks_mut(rows * d)
        .enumerate()
        .for_each(|(bg, dst)| {
            let row_b = bg / kv;
            let qs = &q[bg * rows * d..(bg + 1) * rows * d];
            let ks = &k[bg * s * d..(bg + 1) * s * d];
            let vs = &v[bg * s * d..(bg + 1) * s * d];
            let mut scores = f32_matmul_nt(qs, ks, 1, rows, d, s);
            for (r, row) in scores.chunks_mut(s).enumerate() {
                match mask {
                    Some(m) => {
                        let mrow = &m[(row_b * t + r % t) * s..(row_b * t + r % t + 1) * s];
                        for (x, &a) in row.iter_mut().zip(mrow) {
                            *x = *x * scale + a;
                        }
                    }
                    None => row.iter_mut().for_each(|x| *x *= scale),
                }
            }
            let probs = softmax_rows(&scores, s);
            dst.copy_from_slice(&f32_matmul(&probs, vs, 1, rows, s, d));
        });
    out
}
