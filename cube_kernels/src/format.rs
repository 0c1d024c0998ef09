//! Host side of the kernel formats: which low-bit format a weight has and its kernel layout (u32 words).
//!
//! The storage layout is qarl's (`qarl::quant::QuantizedTensor`): row-major over output rows, int4 two codes
//! per byte (low nibble = even column, `ceil(in/2)` bytes per row), int8 and fp8 one byte per weight. The
//! kernels read 32-bit words, so [`PackedWeights::from_storage`] repacks each row once per weight version
//! into `ceil(in * bits / 32)` little-endian words (code `k` of a word in bits `bits*k ..`), padding codes 0.
//! When a row's byte length is a multiple of 4 this is the storage read as u32s, byte for byte.
//! Scales are copied unchanged: int4 `[out, ceil(in/G)]`, int8 `[out]`, fp8 `[ceil(out/128), ceil(in/128)]`.

use crate::error::KernelError;

/// Side of the fp8 weight block and width of an fp8 activation group.
pub const FP8_BLOCK: usize = 128;

/// Inputs per partial sum of the canonical summation order (see [`crate::reference`]); every int4 group and
/// fp8 block is a multiple of it, so a chunk never straddles two scales.
pub const CHUNK: usize = 32;

/// A weight format the kernels read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Symmetric int4 codes in [-8, 7], one f32 scale per `group` inputs of a row (`int4-g32/64/128`).
    Int4 { group: usize },
    /// Symmetric int8 codes in [-127, 127], one f32 scale per output row (`int8-pc`).
    Int8PerRow,
    /// E4M3 codes, one f32 scale per 128x128 block; activations are quantized per token per 128 inputs
    /// (`fp8-b128`, W8A8).
    Fp8Block128,
}

impl WeightFormat {
    /// Parses qarl's scheme names (`int4-g32`, `int4-g64`, `int4-g128`, `int8-pc`, `fp8-b128`).
    pub fn parse(name: &str) -> Result<Self, KernelError> {
        match name {
            "int4-g32" => Ok(WeightFormat::Int4 { group: 32 }),
            "int4-g64" => Ok(WeightFormat::Int4 { group: 64 }),
            "int4-g128" => Ok(WeightFormat::Int4 { group: 128 }),
            "int8-pc" => Ok(WeightFormat::Int8PerRow),
            "fp8-b128" => Ok(WeightFormat::Fp8Block128),
            other => Err(KernelError::UnknownFormat(other.to_owned())),
        }
    }

    /// The scheme name, as qarl spells it.
    pub fn name(self) -> String {
        match self {
            WeightFormat::Int4 { group } => format!("int4-g{group}"),
            WeightFormat::Int8PerRow => "int8-pc".to_owned(),
            WeightFormat::Fp8Block128 => "fp8-b128".to_owned(),
        }
    }

    /// Bits per code.
    pub fn bits(self) -> usize {
        match self {
            WeightFormat::Int4 { .. } => 4,
            WeightFormat::Int8PerRow | WeightFormat::Fp8Block128 => 8,
        }
    }

    /// Bytes per row of `inn` codes in qarl's storage.
    pub fn row_bytes(self, inn: usize) -> usize {
        (inn * self.bits()).div_ceil(8)
    }

    /// u32 words per row of `inn` codes in the kernel layout.
    pub fn row_words(self, inn: usize) -> usize {
        (inn * self.bits()).div_ceil(32)
    }

    /// Shape of the scale tensor of a `[out, inn]` weight.
    pub fn scale_shape(self, out: usize, inn: usize) -> [usize; 2] {
        match self {
            WeightFormat::Int4 { group } => [out, inn.div_ceil(group)],
            WeightFormat::Int8PerRow => [out, 1],
            WeightFormat::Fp8Block128 => [out.div_ceil(FP8_BLOCK), inn.div_ceil(FP8_BLOCK)],
        }
    }

    /// Whether the matmul also quantizes its activations (fp8 W8A8).
    pub fn quantizes_activations(self) -> bool {
        matches!(self, WeightFormat::Fp8Block128)
    }

    /// The compile-time code the kernels branch on.
    pub(crate) fn kernel_code(self) -> u32 {
        match self {
            WeightFormat::Int4 { .. } => 0,
            WeightFormat::Int8PerRow => 1,
            WeightFormat::Fp8Block128 => 2,
        }
    }

    /// The int4 group (or the fp8 block), the other compile-time parameter of the kernels.
    pub(crate) fn kernel_group(self) -> usize {
        match self {
            WeightFormat::Int4 { group } => group,
            WeightFormat::Int8PerRow => 1,
            WeightFormat::Fp8Block128 => FP8_BLOCK,
        }
    }

    /// Scales per row-index step as the kernels index them (`scale_shape[1]`).
    pub(crate) fn scales_per_row(self, inn: usize) -> usize {
        self.scale_shape(0, inn)[1]
    }

    fn check(self) -> Result<(), KernelError> {
        match self {
            WeightFormat::Int4 { group } if group == 0 || group % CHUNK != 0 => {
                Err(KernelError::Unsupported(format!(
                    "int4 group {group} is not a multiple of {CHUNK}"
                )))
            }
            _ => Ok(()),
        }
    }
}

/// One (or, for MoE, a stack of same-shaped) quantized weight `[out, inn]` in the kernel layout.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedWeights {
    format: WeightFormat,
    experts: usize,
    out: usize,
    inn: usize,
    words: Vec<u32>,
    scales: Vec<f32>,
}

impl PackedWeights {
    /// Repacks qarl's storage (`data`, `scales` as `QuantizedTensor::data/scales` hold them) for the kernels.
    /// Lengths must match the shape; int4 padding nibbles must be 0 and int8 codes never -128 (what the
    /// quantizer produces), so the kernels never see a code the host reference would reject.
    pub fn from_storage(
        format: WeightFormat,
        out: usize,
        inn: usize,
        data: &[u8],
        scales: &[f32],
    ) -> Result<Self, KernelError> {
        Self::stack(format, out, inn, &[(data, scales)])
    }

    /// Stacks the storage of `parts.len()` experts of one shape `[out, inn]` into one buffer, expert-major,
    /// for the grouped MoE matmul.
    pub fn stack(
        format: WeightFormat,
        out: usize,
        inn: usize,
        parts: &[(&[u8], &[f32])],
    ) -> Result<Self, KernelError> {
        format.check()?;
        if parts.is_empty() {
            return Err(KernelError::Shape("no weights to pack".to_owned()));
        }
        let row_bytes = format.row_bytes(inn);
        let row_words = format.row_words(inn);
        let [sr, sc] = format.scale_shape(out, inn);
        let mut words = Vec::with_capacity(parts.len() * out * row_words);
        let mut all_scales = Vec::with_capacity(parts.len() * sr * sc);
        for (e, (data, scales)) in parts.iter().enumerate() {
            if data.len() != out * row_bytes {
                return Err(KernelError::Shape(format!(
                    "expert {e}: {} bytes of codes for a [{out}, {inn}] {} weight, expected {}",
                    data.len(),
                    format.name(),
                    out * row_bytes
                )));
            }
            if scales.len() != sr * sc {
                return Err(KernelError::Shape(format!(
                    "expert {e}: {} scales for a [{out}, {inn}] {} weight, expected {sr}x{sc}",
                    scales.len(),
                    format.name()
                )));
            }
            if let Some(i) = scales.iter().position(|s| !(s.is_finite() && *s >= 0.0)) {
                return Err(KernelError::Shape(format!(
                    "expert {e}: scale {i} is {}, expected finite and >= 0",
                    scales[i]
                )));
            }
            check_codes(format, inn, data, e)?;
            for row in data.chunks(row_bytes.max(1)).take(out) {
                let start = words.len();
                words.resize(start + row_words, 0);
                for (i, b) in row.iter().enumerate() {
                    words[start + i / 4] |= (*b as u32) << (8 * (i % 4));
                }
            }
            if row_bytes == 0 {
                words.resize(words.len() + out * row_words, 0);
            }
            all_scales.extend_from_slice(scales);
        }
        Ok(PackedWeights {
            format,
            experts: parts.len(),
            out,
            inn,
            words,
            scales: all_scales,
        })
    }

    /// Random valid weights for tests and benchmarks: `experts` stacked `[out, inn]` matrices whose codes
    /// cover every value the quantizer can produce (int4 padding nibbles 0, no int8 -128, no E4M3 NaN) and
    /// scales in (0.001, 0.011]. Deterministic in `seed` (xorshift64).
    pub fn random(
        format: WeightFormat,
        experts: usize,
        out: usize,
        inn: usize,
        seed: u64,
    ) -> Result<Self, KernelError> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let row_bytes = format.row_bytes(inn);
        let [sr, sc] = format.scale_shape(out, inn);
        let parts: Vec<(Vec<u8>, Vec<f32>)> = (0..experts)
            .map(|_| {
                let mut data = Vec::with_capacity(out * row_bytes);
                for _ in 0..out {
                    for b in 0..row_bytes {
                        let mut byte = (next() >> 32) as u8;
                        match format {
                            WeightFormat::Int4 { .. } if inn % 2 == 1 && b == row_bytes - 1 => {
                                byte &= 0x0F
                            }
                            WeightFormat::Int8PerRow if byte == 0x80 => byte = 0x81,
                            WeightFormat::Fp8Block128 if byte & 0x7F == 0x7F => byte ^= 1,
                            _ => {}
                        }
                        data.push(byte);
                    }
                }
                let scales = (0..sr * sc)
                    .map(|_| 0.001 + 0.01 * ((next() >> 40) as f32 / (1u64 << 24) as f32))
                    .collect();
                (data, scales)
            })
            .collect();
        let refs: Vec<(&[u8], &[f32])> = parts.iter().map(|(d, s)| (&d[..], &s[..])).collect();
        Self::stack(format, out, inn, &refs)
    }

    /// The format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }
    /// Number of stacked experts (1 for a dense weight).
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Output rows per expert.
    pub fn out_features(&self) -> usize {
        self.out
    }
    /// Inputs per row.
    pub fn in_features(&self) -> usize {
        self.inn
    }
    /// The words, expert-major, row-major.
    pub fn words(&self) -> &[u32] {
        &self.words
    }
    /// The scales, expert-major.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }
    /// Words per row.
    pub fn row_words(&self) -> usize {
        self.format.row_words(self.inn)
    }
    /// Words per expert.
    pub fn expert_words(&self) -> usize {
        self.out * self.row_words()
    }
    /// Scales per expert.
    pub fn expert_scales(&self) -> usize {
        let [r, c] = self.format.scale_shape(self.out, self.inn);
        r * c
    }
    /// Bytes the kernels stream per full pass over the weights (codes + scales), for bandwidth figures.
    pub fn bytes(&self) -> usize {
        4 * (self.words.len() + self.scales.len())
    }

    /// The dequantized value of expert `e`, row `row`, input `k`: `q as f32 * s` (fp8: `e4m3(code) * s`),
    /// one f32 multiply, exactly as qarl's host reference computes it.
    pub fn weight_at(&self, e: usize, row: usize, k: usize) -> f32 {
        let row_words = self.row_words();
        let word =
            self.words[e * self.expert_words() + row * row_words + k * self.format.bits() / 32];
        let scales = &self.scales[e * self.expert_scales()..];
        match self.format {
            WeightFormat::Int4 { group } => {
                let nib = (word >> (4 * (k % 8))) & 15;
                let q = ((nib << 28) as i32) >> 28;
                q as f32 * scales[row * self.inn.div_ceil(group) + k / group]
            }
            WeightFormat::Int8PerRow => {
                let q = ((word >> (8 * (k % 4))) & 255) as u8 as i8;
                q as f32 * scales[row]
            }
            WeightFormat::Fp8Block128 => {
                let code = ((word >> (8 * (k % 4))) & 255) as u8;
                let sc = self.inn.div_ceil(FP8_BLOCK);
                e4m3_to_f32(code) * scales[(row / FP8_BLOCK) * sc + k / FP8_BLOCK]
            }
        }
    }

    /// The dequantized `[out, inn]` matrix of expert `e`.
    pub fn dequantize(&self, e: usize) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.out * self.inn);
        for row in 0..self.out {
            for k in 0..self.inn {
                w.push(self.weight_at(e, row, k));
            }
        }
        w
    }
}

fn check_codes(format: WeightFormat, inn: usize, data: &[u8], e: usize) -> Result<(), KernelError> {
    let row_bytes = format.row_bytes(inn);
    match format {
        WeightFormat::Int4 { .. } if inn % 2 == 1 => {
            if let Some(r) = (0..data.len() / row_bytes.max(1))
                .find(|r| data[r * row_bytes + row_bytes - 1] >> 4 != 0)
            {
                return Err(KernelError::Shape(format!(
                    "expert {e}: row {r} has a non-zero int4 padding nibble"
                )));
            }
        }
        WeightFormat::Int8PerRow => {
            if let Some(i) = data.iter().position(|b| *b == 0x80) {
                return Err(KernelError::Shape(format!(
                    "expert {e}: int8 code -128 at byte {i} (the quantizer never produces it)"
                )));
            }
        }
        WeightFormat::Fp8Block128 => {
            if let Some(i) = data.iter().position(|b| b & 0x7F == 0x7F) {
                return Err(KernelError::Shape(format!(
                    "expert {e}: E4M3 NaN code at byte {i}"
                )));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Decodes an E4M3 (e4m3fn) code exactly; `0x7F`/`0xFF` are NaN.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let exponent = (code >> 3) & 0x0F;
    let mantissa = code & 0x07;
    let magnitude = if exponent == 0x0F && mantissa == 0x07 {
        f32::NAN
    } else if exponent == 0 {
        mantissa as f32 / 512.0
    } else {
        f32::from_bits(((exponent as u32 + 120) << 23) | ((mantissa as u32) << 20))
    };
    if code & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// The 256-entry E4M3 decode table the kernels read (a table is exact on every runtime; not every runtime
/// has a native fp8 conversion).
pub fn e4m3_table() -> Vec<f32> {
    (0..=255u8).map(e4m3_to_f32).collect()
}

/// Encodes `value` as E4M3, round to nearest even, saturating at +-448 (qarl's `f32_to_e4m3`); the kernels
/// use the same bit operations.
pub fn f32_to_e4m3(value: f32) -> u8 {
    if value.is_nan() {
        return 0x7F;
    }
    let sign = if value.is_sign_negative() { 0x80 } else { 0 };
    let magnitude = value.abs();
    let code = if magnitude >= 448.0 {
        0x7E
    } else if magnitude < 1.0 / 64.0 {
        (magnitude * 512.0).round_ties_even() as u8
    } else {
        let rebiased = magnitude.to_bits() - (120 << 23);
        let lsb = (rebiased >> 20) & 1;
        (((rebiased + 0x7_FFFF + lsb) >> 20).min(0x7E)) as u8
    };
    sign | code
}
