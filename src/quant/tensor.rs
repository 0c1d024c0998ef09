//! [`QuantizedTensor`]: one quantized weight `[out, in]` (HF layout) with its packed codes and scales,
//! plus the slow, obviously-correct reference matmuls the fast paths are tested against.
//!
//! Storage (`data`, row-major over output rows):
//! - int4-gG: the int4 byte storage of [`super::packing`] (two codes per byte, low nibble = even column,
//!   `ceil(in/2)` bytes per row); scales f32 `[out, ceil(in/G)]`.
//! - int8-pc: one byte per weight, the code's two's complement (`q as u8`); scales f32 `[out]`.
//! - fp8-b128: one E4M3 code per weight; scales f32 `[ceil(out/128), ceil(in/128)]`.
//! - nvfp4 / mxfp4: E2M1 codes in the int4 byte storage; scales f32 `[out, ceil(in/16)]` (nvfp4: the
//!   product of the E4M3 block scale and the tensor scale) / `[out, ceil(in/32)]` (mxfp4: `2^e`), see
//!   [`super::fp4`].
//!
//! The dequantized weight is `q as f32 * s` (fp8: `e4m3_to_f32(code) * s`, fp4: `e2m1_to_f32(code) * s`),
//! one f32 multiply.
//!
//! Row lengths, scale grids and which codes are valid come from the scheme's format description
//! ([`QuantScheme::kind`], shared with the kernels); this module holds the quantizer and the host decoders.

use rayon::prelude::*;

use super::e4m3::e4m3_to_f32;
use super::error::{check_finite, check_len, check_matrix_len, element_count, QuantError};
use super::fp4::{e2m1_to_f32, is_e8m0_scale, quantize_fp4};
use super::fp8::{quantize_blocks, Fp8Activations};
use super::int::{
    absmax, quantize_to_int, symmetric_scale, INT4_MAX, INT4_MIN, INT4_QMAX, INT8_MAX, INT8_QMAX,
};
use super::packing::{int4_bytes_to_words, int4_to_nibble, nibble_to_int4, unpack_int4};
use super::scheme::{QuantScheme, SchemeKind, FP8_BLOCK};

/// A quantized weight matrix `[out, in]`: scheme, shape, packed codes and f32 scales.
///
/// Built by [`QuantizedTensor::quantize`] or, from stored parts (a checkpoint), by
/// [`QuantizedTensor::from_parts`], which validates them; the fields are private so a value is always
/// consistent.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedTensor {
    scheme: QuantScheme,
    out: usize,
    inn: usize,
    data: Vec<u8>,
    scales: Vec<f32>,
}

impl QuantizedTensor {
    /// Quantizes row-major f32 weights `[out, inn]` with `scheme` (docs/formats.md). NaN or infinity is an
    /// error, as is a length that does not match the shape.
    pub fn quantize(
        weights: &[f32],
        out: usize,
        inn: usize,
        scheme: QuantScheme,
    ) -> Result<Self, QuantError> {
        check_matrix_len("weights", out, inn, weights.len())?;
        check_finite("weights", weights, inn)?;
        let (data, scales) = match scheme.kind() {
            SchemeKind::Int4 { group } => quantize_int4(weights, out, inn, group),
            SchemeKind::Int8PerRow => quantize_int8(weights, out, inn),
            SchemeKind::Fp8Block => quantize_blocks(weights, out, inn, FP8_BLOCK),
            kind @ (SchemeKind::Nvfp4 | SchemeKind::Mxfp4) => quantize_fp4(weights, out, inn, kind),
        };
        check_quantized_finite(weights, scheme, out, inn, &data, &scales)?;
        Ok(QuantizedTensor {
            scheme,
            out,
            inn,
            data,
            scales,
        })
    }

    /// Rebuilds a tensor from stored parts, checking lengths, that every code is one the quantizer can
    /// produce (int4 and fp4 padding nibbles 0, int8 not -128, no E4M3 NaN), that scales are finite,
    /// non-negative and scale their codes to finite weights, and that mxfp4 scales are powers of two in
    /// [2^-127, 2^127] (E8M0).
    pub fn from_parts(
        scheme: QuantScheme,
        out: usize,
        inn: usize,
        data: Vec<u8>,
        scales: Vec<f32>,
    ) -> Result<Self, QuantError> {
        let row_bytes = scheme.row_bytes(inn);
        check_matrix_len("packed codes", out, row_bytes, data.len())?;
        let scale_shape = scheme.scale_shape(out, inn);
        let scale_count = scale_shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or(QuantError::ShapeOverflow {
                what: "scales",
                shape: scale_shape.clone(),
            })?;
        check_len("scales", &scale_shape, scale_count, scales.len())?;
        if let Some(index) = scales.iter().position(|s| !(s.is_finite() && *s >= 0.0)) {
            return Err(QuantError::InvalidScale {
                index,
                value: scales[index],
            });
        }
        check_finite_weights(scheme, out, inn, &data, &scales)?;
        if scheme.kind() == SchemeKind::Mxfp4 {
            if let Some(index) = scales.iter().position(|&s| !is_e8m0_scale(s)) {
                return Err(QuantError::NotE8m0Scale {
                    index,
                    value: scales[index],
                });
            }
        }
        if let Some(bad) = scheme.kind().invalid_code(inn, &data) {
            return Err(QuantError::InvalidCode {
                what: "packed codes",
                index: bad.byte(),
                detail: bad.to_string(),
            });
        }
        Ok(QuantizedTensor {
            scheme,
            out,
            inn,
            data,
            scales,
        })
    }

    /// The scheme.
    pub fn scheme(&self) -> QuantScheme {
        self.scheme
    }

    /// Output features (rows of the HF weight).
    pub fn out_features(&self) -> usize {
        self.out
    }

    /// Input features (columns of the HF weight).
    pub fn in_features(&self) -> usize {
        self.inn
    }

    /// `[out, in]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.out, self.inn]
    }

    /// The packed codes (layout in the module docs).
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The f32 scales, row-major in [`QuantScheme::scale_shape`].
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Shape of [`Self::scales`].
    pub fn scale_shape(&self) -> Vec<usize> {
        self.scheme.scale_shape(self.out, self.inn)
    }

    /// Takes the packed codes and scales out (e.g. to upload them to a device without copying).
    pub fn into_parts(self) -> (QuantScheme, [usize; 2], Vec<u8>, Vec<f32>) {
        (self.scheme, [self.out, self.inn], self.data, self.scales)
    }

    /// Unpacked integer codes `[out, in]` for int4 / int8; `None` for fp8 (its codes are [`Self::data`])
    /// and fp4 (E2M1 codes, not integers).
    pub fn int_codes(&self) -> Option<Vec<i8>> {
        match self.scheme.kind() {
            SchemeKind::Int4 { .. } => unpack_int4(&self.data, self.out, self.inn).ok(),
            SchemeKind::Int8PerRow => Some(self.data.iter().map(|&b| b as i8).collect()),
            SchemeKind::Fp8Block | SchemeKind::Nvfp4 | SchemeKind::Mxfp4 => None,
        }
    }

    /// The int4 codes in the u32-word view (eight per word, little nibble first, `ceil(in/8)` words per
    /// row); `None` for the other schemes.
    pub fn int4_words(&self) -> Option<Vec<u32>> {
        self.scheme.int4_group()?;
        int4_bytes_to_words(&self.data, self.out, self.inn).ok()
    }

    /// Bytes of codes plus scales.
    pub fn storage_bytes(&self) -> usize {
        self.data.len() + 4 * self.scales.len()
    }

    /// [`Self::storage_bytes`] per weight (0 for an empty tensor).
    pub fn bytes_per_weight(&self) -> f64 {
        let weights = self.out * self.inn;
        if weights == 0 {
            0.0
        } else {
            self.storage_bytes() as f64 / weights as f64
        }
    }

    /// The dequantized value of `[row, col]`, read straight from the packed storage by the format
    /// description alone (code, its value, its scale): the slow reference the fast decoders agree with.
    fn dequantized_at(&self, row: usize, col: usize) -> f32 {
        let kind = self.scheme.kind();
        let row_bytes = kind.row_bytes(self.inn);
        let code = kind.storage_code(&self.data[row * row_bytes..(row + 1) * row_bytes], col);
        kind.code_value(code) * self.scales[kind.scale_index(self.inn, row, col)]
    }

    /// Dequantized weights, row-major `[out, in]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut weights = vec![0.0f32; self.out * self.inn];
        // Rows are independent: in parallel (the learner's backward decodes each quantized layer once per
        // pass, on its critical path).
        weights
            .par_chunks_mut(self.inn.max(1))
            .enumerate()
            .for_each(|(row, dst_row)| self.dequantize_row(row, dst_row));
        weights
    }

    /// Dequantizes into `dst` (length `out * in`, else an error), row by row.
    pub fn dequantize_into(&self, dst: &mut [f32]) -> Result<(), QuantError> {
        check_len(
            "dequantize destination",
            &[self.out, self.inn],
            self.out * self.inn,
            dst.len(),
        )?;
        for (row, dst_row) in dst.chunks_mut(self.inn.max(1)).enumerate() {
            self.dequantize_row(row, dst_row);
        }
        Ok(())
    }

    /// Dequantizes output row `row` into `dst` (length `in`): the one decoder of the packed layout, used by
    /// [`Self::dequantize`] and by the CPU low-bit kernel.
    pub fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        match self.scheme.kind() {
            SchemeKind::Int4 { group } => {
                let row_bytes = self.scheme.row_bytes(self.inn);
                let bytes = &self.data[row * row_bytes..(row + 1) * row_bytes];
                let [_, per_row] = self.scheme.kind().scale_grid(self.out, self.inn);
                let scales = &self.scales[row * per_row..(row + 1) * per_row];
                for (col, w) in dst.iter_mut().enumerate() {
                    let q = nibble_to_int4(bytes[col / 2] >> (4 * (col & 1)));
                    *w = q as f32 * scales[col / group];
                }
            }
            SchemeKind::Int8PerRow => {
                let s = self.scales[row];
                for (w, &b) in dst
                    .iter_mut()
                    .zip(&self.data[row * self.inn..(row + 1) * self.inn])
                {
                    *w = b as i8 as f32 * s;
                }
            }
            SchemeKind::Fp8Block => {
                let [_, col_blocks] = self.scheme.kind().scale_grid(self.out, self.inn);
                let scales = &self.scales
                    [(row / FP8_BLOCK) * col_blocks..(row / FP8_BLOCK + 1) * col_blocks];
                let codes = &self.data[row * self.inn..(row + 1) * self.inn];
                for (col, (w, &c)) in dst.iter_mut().zip(codes).enumerate() {
                    *w = e4m3_to_f32(c) * scales[col / FP8_BLOCK];
                }
            }
            kind @ (SchemeKind::Nvfp4 | SchemeKind::Mxfp4) => {
                let row_bytes = kind.row_bytes(self.inn);
                let bytes = &self.data[row * row_bytes..(row + 1) * row_bytes];
                let [_, per_row] = kind.scale_grid(self.out, self.inn);
                let scales = &self.scales[row * per_row..(row + 1) * per_row];
                let block = kind.scale_block().inputs.unwrap_or(self.inn.max(1));
                for (col, w) in dst.iter_mut().enumerate() {
                    *w = e2m1_to_f32(bytes[col / 2] >> (4 * (col & 1))) * scales[col / block];
                }
            }
        }
    }

    /// The scheme's matmul on the host, `x[m, in] -> [m, out]`: the same arithmetic and summation order as
    /// [`Self::matmul_reference`] (so the same bits), but it dequantizes the weight (and, for fp8, the
    /// activations) once instead of per product.
    pub fn matmul(&self, x: &[f32], m: usize) -> Result<Vec<f32>, QuantError> {
        check_matrix_len("activations", m, self.inn, x.len())?;
        let mut y = vec![0.0f32; element_count("matmul output", m, self.out)?];
        let quantized_x;
        let x = if self.scheme.quantizes_activations() {
            quantized_x = Fp8Activations::quantize(x, m, self.inn)?.dequantize();
            &quantized_x[..]
        } else {
            x
        };
        let weights = self.dequantize();
        let inn = self.inn.max(1);
        for (x_row, y_row) in x.chunks(inn).zip(y.chunks_mut(self.out.max(1))) {
            for (w_row, y) in weights.chunks(inn).zip(y_row.iter_mut()) {
                let mut acc = 0.0f32;
                for (a, b) in x_row.iter().zip(w_row) {
                    acc += a * b;
                }
                *y = acc;
            }
        }
        Ok(y)
    }

    /// Reference `x[m, in] @ dequant(W)^T -> [m, out]` with f32 activations (no activation quantization,
    /// whatever the scheme). Summation order: for each `[i, o]`, `acc = 0.0f32`, then
    /// `acc += x[i, k] * w'[o, k]` for `k = 0, 1, .., in - 1` in that order, a separate multiply and add
    /// (no fused multiply-add). Slow on purpose: it reads every weight from the packed storage.
    pub fn weight_only_matmul_reference(
        &self,
        x: &[f32],
        m: usize,
    ) -> Result<Vec<f32>, QuantError> {
        check_matrix_len("activations", m, self.inn, x.len())?;
        let mut y = vec![0.0f32; element_count("matmul output", m, self.out)?];
        for i in 0..m {
            for o in 0..self.out {
                let mut acc = 0.0f32;
                for k in 0..self.inn {
                    acc += x[i * self.inn + k] * self.dequantized_at(o, k);
                }
                y[i * self.out + o] = acc;
            }
        }
        Ok(y)
    }

    /// Reference of the scheme's own matmul `x[m, in] -> [m, out]`: for int4 / int8 (W4A16 / W8A16) it is
    /// [`Self::weight_only_matmul_reference`]; for fp8-b128 (W8A8) the activations are first quantized by
    /// [`Fp8Activations::quantize`] (NaN / infinity is an error) and the product is
    /// `acc += x'[i, k] * w'[o, k]` over `k = 0, 1, ..` in order, in f32, with `x' = e4m3(xcode) * sx` and
    /// `w' = e4m3(wcode) * sw` each one f32 multiply.
    pub fn matmul_reference(&self, x: &[f32], m: usize) -> Result<Vec<f32>, QuantError> {
        if !self.scheme.quantizes_activations() {
            return self.weight_only_matmul_reference(x, m);
        }
        check_matrix_len("activations", m, self.inn, x.len())?;
        let activations = Fp8Activations::quantize(x, m, self.inn)?;
        let mut y = vec![0.0f32; element_count("matmul output", m, self.out)?];
        for i in 0..m {
            for o in 0..self.out {
                let mut acc = 0.0f32;
                for k in 0..self.inn {
                    acc += activations.dequantized_at(i, k) * self.dequantized_at(o, k);
                }
                y[i * self.out + o] = acc;
            }
        }
        Ok(y)
    }
}

/// int4: per row, per group of `group` inputs (the last one shorter when `group` does not divide `inn`),
/// `s = absmax / 7` and `q = clamp(rint(w / s), -8, 7)`, packed two per byte.
fn quantize_int4(weights: &[f32], out: usize, inn: usize, group: usize) -> (Vec<u8>, Vec<f32>) {
    let format = SchemeKind::Int4 { group };
    let row_bytes = format.row_bytes(inn);
    let [_, groups_per_row] = format.scale_grid(out, inn);
    let mut data = vec![0u8; out * row_bytes];
    let mut scales = vec![0.0f32; out * groups_per_row];
    if inn == 0 {
        return (data, scales);
    }
    let row = |((src, dst), row_scales): ((&[f32], &mut [u8]), &mut [f32])| {
        for ((g, chunk), scale) in src.chunks(group).enumerate().zip(row_scales) {
            let s = symmetric_scale(absmax(chunk), INT4_QMAX);
            *scale = s;
            for (offset, &w) in chunk.iter().enumerate() {
                let col = g * group + offset;
                let nibble = int4_to_nibble(quantize_to_int(w, s, INT4_MIN, INT4_MAX));
                dst[col / 2] |= nibble << (4 * (col % 2));
            }
        }
    };
    // Rows are independent: in parallel (a weight sync re-quantizes the whole model every RL step).
    weights
        .par_chunks(inn)
        .zip(data.par_chunks_mut(row_bytes))
        .zip(scales.par_chunks_mut(groups_per_row))
        .with_min_len(64)
        .for_each(row);
    (data, scales)
}

/// int8: per row, `s = absmax / 127` and `q = clamp(rint(w / s), -127, 127)`, stored as `q as u8`.
fn quantize_int8(weights: &[f32], out: usize, inn: usize) -> (Vec<u8>, Vec<f32>) {
    let mut data = vec![0u8; out * inn];
    let mut scales = vec![0.0f32; out];
    if inn == 0 {
        return (data, scales);
    }
    weights
        .par_chunks(inn)
        .zip(data.par_chunks_mut(inn))
        .zip(scales.par_iter_mut())
        .with_min_len(64)
        .for_each(|((src, dst), scale)| {
            let s = symmetric_scale(absmax(src), INT8_QMAX);
            *scale = s;
            for (code, &w) in dst.iter_mut().zip(src) {
                *code = quantize_to_int(w, s, -INT8_MAX, INT8_MAX) as u8;
            }
        });
    (data, scales)
}

/// Refuses a stored scale that makes one of the codes it multiplies an infinite weight (the quantizer
/// refuses weights whose own scales would), naming the scale and that code's value.
fn check_finite_weights(
    scheme: QuantScheme,
    out: usize,
    inn: usize,
    data: &[u8],
    scales: &[f32],
) -> Result<(), QuantError> {
    match first_infinite_weight(scheme, out, inn, data, scales) {
        None => Ok(()),
        Some(w) => Err(QuantError::OverflowingScale {
            index: w.scale_index,
            value: scales[w.scale_index],
            largest: w.code.abs(),
        }),
    }
}

/// A weight whose dequantized value (scale times code) is not finite.
struct InfiniteWeight {
    row: usize,
    col: usize,
    scale_index: usize,
    code: f32,
}

/// The first weight, row by row, whose code times its scale overflows f32. Where every scale times the
/// format's largest code is finite (always but at the edge of f32) the codes are not read.
fn first_infinite_weight(
    scheme: QuantScheme,
    out: usize,
    inn: usize,
    data: &[u8],
    scales: &[f32],
) -> Option<InfiniteWeight> {
    let kind = scheme.kind();
    let largest = kind.max_code_magnitude();
    if scales.iter().all(|&s| (s * largest).is_finite()) {
        return None;
    }
    let row_bytes = scheme.row_bytes(inn);
    for (row, bytes) in data.chunks(row_bytes.max(1)).take(out).enumerate() {
        for col in 0..inn {
            let scale_index = kind.scale_index(inn, row, col);
            let code = kind.code_value(kind.storage_code(bytes, col));
            if !(code * scales[scale_index]).is_finite() {
                return Some(InfiniteWeight {
                    row,
                    col,
                    scale_index,
                    code,
                });
            }
        }
    }
    None
}

/// Refuses weights whose quantized form dequantizes to infinity: a weight within a rounding of f32's
/// largest value gets an int8-pc scale `absmax / 127` that rounds up, and 127 times it overflows (int4's
/// `/ 7` happens not to).
fn check_quantized_finite(
    weights: &[f32],
    scheme: QuantScheme,
    out: usize,
    inn: usize,
    data: &[u8],
    scales: &[f32],
) -> Result<(), QuantError> {
    match first_infinite_weight(scheme, out, inn, data, scales) {
        None => Ok(()),
        Some(w) => Err(QuantError::QuantizedOverflow {
            row: w.row,
            col: w.col,
            value: weights[w.row * inn + w.col],
            scheme: scheme.to_string(),
        }),
    }
}
