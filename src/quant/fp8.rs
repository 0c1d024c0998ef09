//! FP8 block scaling (`fp8-b128`): E4M3 codes with one f32 scale per block, for weights (128x128 blocks)
//! and activations (1x128 blocks: per token, per 128 input columns).
//!
//! Per block: `s = absmax(block) / 448` (an f32 division), code = [`f32_to_e4m3`]`(v / s)` (an f32
//! division, then one round-to-nearest-even, saturating at +-448: `v / s` can exceed 448 by an ulp, or by
//! more when `s` is an f32 subnormal). A block of zeros (`s == 0`) gives code `0x00` everywhere. Blocks at
//! the right and bottom edges are shorter and use the same rule over the elements they have.
//! Activation groups line up with weight blocks along the input axis, so a kernel may factor both scales
//! out of each 128-long partial sum.

use super::e4m3::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use super::error::{check_finite, check_matrix_len, QuantError};
use super::int::absmax;
use super::scheme::FP8_BLOCK;
use rayon::prelude::*;

/// E4M3 codes of a row-major `[rows, cols]` matrix with block scales `[ceil(rows/block_rows), ceil(cols/128)]`.
pub(crate) fn quantize_blocks(
    values: &[f32],
    rows: usize,
    cols: usize,
    block_rows: usize,
) -> (Vec<u8>, Vec<f32>) {
    let col_blocks = cols.div_ceil(FP8_BLOCK);
    let row_blocks = rows.div_ceil(block_rows);
    let mut scales = vec![0.0f32; row_blocks * col_blocks];
    let mut codes = vec![0u8; rows * cols];
    if cols == 0 {
        return (codes, scales);
    }
    // Row blocks are independent: in parallel (weights: 128-row blocks; activations: one row per block).
    let block = |((values, codes), block_scales): ((&[f32], &mut [u8]), &mut [f32])| {
        let mut block_max = vec![0.0f32; col_blocks];
        for row in values.chunks(cols) {
            for (m, v) in block_max.iter_mut().zip(row.chunks(FP8_BLOCK)) {
                *m = m.max(absmax(v));
            }
        }
        for (s, m) in block_scales.iter_mut().zip(&block_max) {
            *s = m / E4M3_MAX;
        }
        for (src, dst) in values.chunks(cols).zip(codes.chunks_mut(cols)) {
            for ((v, code), &s) in src
                .chunks(FP8_BLOCK)
                .zip(dst.chunks_mut(FP8_BLOCK))
                .zip(block_scales.iter())
            {
                for (v, code) in v.iter().zip(code) {
                    *code = if s == 0.0 { 0 } else { f32_to_e4m3(v / s) };
                }
            }
        }
    };
    values
        .par_chunks(block_rows * cols)
        .zip(codes.par_chunks_mut(block_rows * cols))
        .zip(scales.par_chunks_mut(col_blocks))
        .with_min_len((1 << 16) / (block_rows * cols) + 1)
        .for_each(block);
    (codes, scales)
}

/// Activations quantized to E4M3, per token (row) per 128 columns, as the `fp8-b128` matmul consumes them.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Activations {
    rows: usize,
    cols: usize,
    codes: Vec<u8>,
    scales: Vec<f32>,
}

impl Fp8Activations {
    /// Quantizes row-major activations `[rows, cols]`; NaN or infinity is an error.
    pub fn quantize(x: &[f32], rows: usize, cols: usize) -> Result<Self, QuantError> {
        check_matrix_len("activations", rows, cols, x.len())?;
        check_finite("activations", x, cols)?;
        let (codes, scales) = quantize_blocks(x, rows, cols, 1);
        Ok(Fp8Activations {
            rows,
            cols,
            codes,
            scales,
        })
    }

    /// Number of tokens (rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// E4M3 codes, row-major `[rows, cols]`.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// f32 scales, row-major `[rows, ceil(cols / 128)]`.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// `Self::quantize(x, rows, cols)?.dequantize()` in one pass without the codes, rows in parallel: what a
    /// W8A8 matmul multiplies by. The same bits (the same `s = absmax / 448`, the same division and rounding,
    /// checked against the two-step form over every E4M3 code), but branch-free so that it vectorizes: the
    /// two-step form spent about half of an fp8 prefill (8 x 64 tokens, 195M MoE) in scalar per-element
    /// indexing and rounding.
    pub fn fake_quantize(x: &[f32], rows: usize, cols: usize) -> Result<Vec<f32>, QuantError> {
        check_matrix_len("activations", rows, cols, x.len())?;
        check_finite("activations", x, cols)?;
        let mut out = vec![0.0f32; x.len()];
        if cols == 0 {
            return Ok(out);
        }
        let row = |(dst, src): (&mut [f32], &[f32])| {
            for (d, v) in dst.chunks_mut(FP8_BLOCK).zip(src.chunks(FP8_BLOCK)) {
                fake_quantize_block(v, d);
            }
        };
        // Below ~64K elements (a decode step) the pool's wake-up costs more than the work.
        if x.len() >= 1 << 16 {
            use rayon::prelude::*;
            out.par_chunks_mut(cols)
                .zip(x.par_chunks(cols))
                .for_each(row);
        } else {
            out.chunks_mut(cols).zip(x.chunks(cols)).for_each(row);
        }
        Ok(out)
    }

    /// The value the matmul uses for element `[row, col]`: `e4m3_to_f32(code) * s`.
    pub fn dequantized_at(&self, row: usize, col: usize) -> f32 {
        let col_blocks = self.cols.div_ceil(FP8_BLOCK);
        e4m3_to_f32(self.codes[row * self.cols + col])
            * self.scales[row * col_blocks + col / FP8_BLOCK]
    }

    /// All dequantized values, row-major `[rows, cols]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for row in 0..self.rows {
            out.extend((0..self.cols).map(|col| self.dequantized_at(row, col)));
        }
        out
    }
}

/// One activation block (at most 128 finite values): `e4m3_to_f32(f32_to_e4m3(v / s)) * s` per value with
/// `s = absmax / 448`, or zeros when `s == 0`, without forming the codes.
fn fake_quantize_block(v: &[f32], out: &mut [f32]) {
    let s = absmax(v) / E4M3_MAX;
    if s == 0.0 {
        out.fill(0.0);
        return;
    }
    for (o, &x) in out.iter_mut().zip(v) {
        *o = round_to_e4m3(x / s) * s;
    }
}

/// `e4m3_to_f32(f32_to_e4m3(q))` for a non-NaN `q`, as selects instead of branches.
#[inline(always)]
fn round_to_e4m3(q: f32) -> f32 {
    let a = q.abs();
    // Subnormal grid (m * 2^-9): round a * 512 to an integer, ties to even, then scale back (exact).
    let sub = super::int::round_ties_even(a * 512.0) / 512.0;
    // Normal grid: round the f32 mantissa to 3 bits, ties to even, in place (a carry bumps the exponent,
    // as it does for the code); at or above 448 (infinity included) saturate.
    let bits = a.to_bits();
    let normal = f32::from_bits((bits + 0x7_FFFF + ((bits >> 20) & 1)) & 0xFFF0_0000).min(E4M3_MAX);
    let magnitude = if a < 1.0 / 64.0 { sub } else { normal };
    magnitude.copysign(q)
}
