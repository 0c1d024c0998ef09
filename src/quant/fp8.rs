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
use super::error::{check_finite, check_len, element_count, QuantError};
use super::scheme::FP8_BLOCK;

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
    for row_block in 0..row_blocks {
        let row_range = row_block * block_rows..((row_block + 1) * block_rows).min(rows);
        let block_scales = &mut scales[row_block * col_blocks..(row_block + 1) * col_blocks];
        let mut absmax = vec![0.0f32; col_blocks];
        for row in row_range.clone() {
            for (col, v) in values[row * cols..(row + 1) * cols].iter().enumerate() {
                let m = &mut absmax[col / FP8_BLOCK];
                *m = m.max(v.abs());
            }
        }
        for (s, m) in block_scales.iter_mut().zip(&absmax) {
            *s = m / E4M3_MAX;
        }
        for row in row_range {
            let src = &values[row * cols..(row + 1) * cols];
            let dst = &mut codes[row * cols..(row + 1) * cols];
            for (col, (v, code)) in src.iter().zip(dst.iter_mut()).enumerate() {
                let s = block_scales[col / FP8_BLOCK];
                *code = if s == 0.0 { 0 } else { f32_to_e4m3(v / s) };
            }
        }
    }
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
        check_len(
            "activations",
            &[rows, cols],
            element_count("activations", rows, cols)?,
            x.len(),
        )?;
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
