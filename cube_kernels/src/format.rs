//! The weight formats, described once: which formats exist, the width and the valid values of their codes,
//! the grid of their scales, and the two layouts of their codes. This module and [`crate::e4m3`] need no
//! CubeCL (they compile without the crate's `kernels` feature), so qarl's quantizer, qarl's CPU kernels and
//! the CubeCL host code all read the same description (in qarl, `quant::SchemeKind` is [`WeightFormat`] and
//! `quant::e4m3` is [`crate::e4m3`]). A new format is a [`WeightFormat`] variant described here, then its
//! quantizer and kernels.
//!
//! **Storage layout** (qarl's `QuantizedTensor`, quantized checkpoints): row-major over output rows,
//! [`WeightFormat::row_bytes`] bytes per row, code `k` of a row in bits `bits*k ..` of the row's bytes
//! (little code first: int4 and fp4 two codes per byte, low nibble = even column; int8 and fp8 one byte per
//! code).
//! `bits` divides 8, so a code never straddles a byte and rows never share one; padding bits are 0.
//!
//! **Kernel layout** ([`PackedWeights`]): each row repacked once per weight version into
//! [`WeightFormat::row_words`] little-endian u32 words, code `k` of a word in bits `bits*k ..`, padding 0.
//! When a row's byte length is a multiple of 4 this is the storage read as u32s, byte for byte.
//!
//! **Scales**: f32, row-major over [`WeightFormat::scale_grid`], copied unchanged between the layouts.

pub use crate::e4m3::round_ties_even;
use crate::e4m3::{e4m3_is_nan, e4m3_to_f32};
pub use crate::error::InvalidCode;
use crate::error::KernelError;

/// Side of the fp8 weight block and width of an fp8 activation group (DeepSeek-V3 "blockwise").
pub const FP8_BLOCK: usize = 128;

/// Inputs per partial sum of the CubeCL kernels' canonical summation order. Every int4 group and the fp8
/// block are multiples of it ([`WeightFormat::validate`]), so a chunk never straddles two scales.
pub const CHUNK: usize = 32;

/// Bits of an int4 code.
pub const INT4_BITS: usize = 4;
/// Smallest int4 code.
pub const INT4_MIN: i8 = -8;
/// Largest int4 code.
pub const INT4_MAX: i8 = 7;
/// The int4 scale's divisor (`s = absmax / 7`): symmetric, so -8 is produced only when `s` is subnormal.
pub const INT4_QMAX: f32 = 7.0;
/// Largest int8 magnitude: codes are in [-127, 127], -128 is never produced (a symmetric grid).
pub const INT8_MAX: i8 = 127;
/// The int8 scale's divisor (`s = absmax / 127`).
pub const INT8_QMAX: f32 = 127.0;

/// Inputs per NVFP4 block (one E4M3 block scale each).
pub const NVFP4_BLOCK: usize = 16;
/// Inputs per MXFP4 block (one E8M0 scale each, OCP Microscaling v1.0).
pub const MXFP4_BLOCK: usize = 32;
/// Largest E2M1 magnitude: FP4 codes saturate at +-6.
pub const E2M1_MAX: f32 = 6.0;
/// The value of each E2M1 code (`s e e m`, bias 1): codes 0..8 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes
/// 8..16 their negatives (code 8 is -0.0). Every FP4 decoder (host, CPU kernels, CubeCL) reads this table.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// A low-bit weight format: what qarl quantizes to and what the kernels (CPU and CubeCL) read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Symmetric int4 codes in [-8, 7], one f32 scale per `group` inputs of a row (`int4-gG`, W4A16).
    Int4 { group: usize },
    /// Symmetric int8 codes in [-127, 127], one f32 scale per output row (`int8-pc`, W8A16).
    Int8PerRow,
    /// E4M3 codes, one f32 scale per [`FP8_BLOCK`]-square block; activations are quantized to E4M3 per
    /// token per [`FP8_BLOCK`] inputs (`fp8-b128`, W8A8).
    Fp8Block,
    /// NVFP4 (`nvfp4`, W4A16): E2M1 codes, per [`NVFP4_BLOCK`] inputs of a row an E4M3 block scale times a
    /// per-matrix f32 tensor scale; the stored f32 scale is their f32 product, the factor a code's value
    /// is multiplied by.
    Nvfp4,
    /// MXFP4 (`mxfp4`, W4A16, OCP Microscaling v1.0): E2M1 codes, per [`MXFP4_BLOCK`] inputs of a row an
    /// E8M0 scale `2^e`, stored as its f32 value.
    Mxfp4,
}

/// The weights one scale covers: `rows` output rows by `inputs` inputs of each (`None`: the whole row).
/// Blocks at the bottom and right edges are shorter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScaleBlock {
    /// Output rows per scale.
    pub rows: usize,
    /// Inputs per scale, `None` for one scale per row whatever its length.
    pub inputs: Option<usize>,
}

impl WeightFormat {
    /// The format's name, as qarl spells its schemes: `int4-g<G>`, `int8-pc`, `fp8-b128`.
    pub fn name(self) -> String {
        match self {
            WeightFormat::Int4 { group } => format!("int4-g{group}"),
            WeightFormat::Int8PerRow => "int8-pc".to_owned(),
            WeightFormat::Fp8Block => format!("fp8-b{FP8_BLOCK}"),
            WeightFormat::Nvfp4 => "nvfp4".to_owned(),
            WeightFormat::Mxfp4 => "mxfp4".to_owned(),
        }
    }

    /// The format named `name` ([`Self::name`] spelled exactly); an int4 group the kernels cannot take
    /// ([`Self::validate`]) is an error too.
    pub fn parse(name: &str) -> Result<Self, KernelError> {
        let candidate = match name {
            "int8-pc" => Some(WeightFormat::Int8PerRow),
            "nvfp4" => Some(WeightFormat::Nvfp4),
            "mxfp4" => Some(WeightFormat::Mxfp4),
            _ if name.starts_with("fp8-") => Some(WeightFormat::Fp8Block),
            _ => name
                .strip_prefix("int4-g")
                .and_then(|g| g.parse().ok())
                .map(|group| WeightFormat::Int4 { group }),
        };
        // Comparing with the canonical name rejects other spellings (`int4-g032`, `int4-g+32`, `fp8-b64`).
        let format = candidate
            .filter(|f| f.name() == name)
            .ok_or_else(|| KernelError::UnknownFormat(name.to_owned()))?;
        format.validate()?;
        Ok(format)
    }

    /// Whether the kernels can take this format: an int4 group must be a positive multiple of [`CHUNK`]
    /// (both kernels sum in 32-input chunks under one scale).
    pub fn validate(self) -> Result<(), KernelError> {
        match self {
            WeightFormat::Int4 { group } if group == 0 || group % CHUNK != 0 => {
                Err(KernelError::Unsupported(format!(
                    "int4 group {group} is not a multiple of {CHUNK}"
                )))
            }
            _ => Ok(()),
        }
    }

    /// Bits per code; always a divisor of 8 (see the module docs).
    pub fn bits(self) -> usize {
        match self {
            WeightFormat::Int4 { .. } | WeightFormat::Nvfp4 | WeightFormat::Mxfp4 => INT4_BITS,
            WeightFormat::Int8PerRow | WeightFormat::Fp8Block => 8,
        }
    }

    /// Bytes per row of `inn` codes in the storage layout: `ceil(inn/2)` for int4 and fp4, `inn` for int8
    /// and fp8.
    pub fn row_bytes(self, inn: usize) -> usize {
        packed_bytes(self.bits(), inn)
    }

    /// u32 words per row of `inn` codes in the kernel layout: `ceil(inn/8)` for int4, `ceil(inn/4)` else.
    pub fn row_words(self, inn: usize) -> usize {
        packed_words(self.bits(), inn)
    }

    /// The weights one scale covers: int4 `1 x G`, int8 a whole row, fp8 a [`FP8_BLOCK`]-square block,
    /// nvfp4 `1 x 16`, mxfp4 `1 x 32`.
    pub fn scale_block(self) -> ScaleBlock {
        match self {
            WeightFormat::Int4 { group } => ScaleBlock {
                rows: 1,
                inputs: Some(group),
            },
            WeightFormat::Int8PerRow => ScaleBlock {
                rows: 1,
                inputs: None,
            },
            WeightFormat::Fp8Block => ScaleBlock {
                rows: FP8_BLOCK,
                inputs: Some(FP8_BLOCK),
            },
            WeightFormat::Nvfp4 => ScaleBlock {
                rows: 1,
                inputs: Some(NVFP4_BLOCK),
            },
            WeightFormat::Mxfp4 => ScaleBlock {
                rows: 1,
                inputs: Some(MXFP4_BLOCK),
            },
        }
    }

    /// The scale grid of a `[out, inn]` weight, `[scale rows, scales per row]`: int4 `[out, ceil(inn/G)]`,
    /// int8 `[out, 1]`, fp8 `[ceil(out/128), ceil(inn/128)]`, nvfp4 `[out, ceil(inn/16)]`, mxfp4
    /// `[out, ceil(inn/32)]`. Scales are row-major over it.
    pub fn scale_grid(self, out: usize, inn: usize) -> [usize; 2] {
        let block = self.scale_block();
        [
            out.div_ceil(block.rows),
            block.inputs.map_or(1, |inputs| inn.div_ceil(inputs)),
        ]
    }

    /// The shape of the stored scale tensor (checkpoints, the Python reference): the scale grid, except
    /// that one scale per row is a vector `[out]`.
    pub fn scale_shape(self, out: usize, inn: usize) -> Vec<usize> {
        let grid = self.scale_grid(out, inn);
        match self.scale_block().inputs {
            Some(_) => grid.to_vec(),
            None => vec![grid[0]],
        }
    }

    /// Index (in the row-major scale grid of a weight with `inn` inputs) of the scale of weight `[row, k]`.
    pub fn scale_index(self, inn: usize, row: usize, k: usize) -> usize {
        let block = self.scale_block();
        let per_row = self.scale_grid(0, inn)[1];
        (row / block.rows) * per_row + block.inputs.map_or(0, |inputs| k / inputs)
    }

    /// Bytes of codes plus f32 scales of a `[out, inn]` weight in the storage layout.
    pub fn storage_bytes(self, out: usize, inn: usize) -> usize {
        let [rows, cols] = self.scale_grid(out, inn);
        out * self.row_bytes(inn) + 4 * rows * cols
    }

    /// Whether the matmul also quantizes its activations (fp8 W8A8: E4M3 per token per [`FP8_BLOCK`]
    /// inputs); the others keep them as they are (A16).
    pub fn quantizes_activations(self) -> bool {
        matches!(self, WeightFormat::Fp8Block)
    }

    /// The value of a code before its scale: `q as f32` for the integer grids (the low [`Self::bits`] of
    /// `code` as a two's complement), `e4m3_to_f32(code)` for fp8, [`E2M1_VALUES`]`[code]` for fp4. The
    /// weight is this times its scale, one f32 multiply.
    pub fn code_value(self, code: u32) -> f32 {
        match self {
            WeightFormat::Int4 { .. } => (((code << 28) as i32) >> 28) as f32,
            WeightFormat::Int8PerRow => code as u8 as i8 as f32,
            WeightFormat::Fp8Block => e4m3_to_f32(code as u8),
            WeightFormat::Nvfp4 | WeightFormat::Mxfp4 => E2M1_VALUES[(code & 0xF) as usize],
        }
    }

    /// The largest magnitude of a code's value ([`Self::code_value`] over every code the quantizer
    /// writes: the symmetric grids' -8 and -128 and E4M3's NaN are not): a scale times it must be finite,
    /// or the weights it scales overflow f32.
    pub fn max_code_magnitude(self) -> f32 {
        (0..1u32 << self.bits())
            .filter(|&c| match self {
                WeightFormat::Int4 { .. } => c != 0x8,
                WeightFormat::Int8PerRow => c != 0x80,
                _ => true,
            })
            .map(|c| self.code_value(c).abs())
            .filter(|v| v.is_finite())
            .fold(0.0, f32::max)
    }

    /// Code `k` of one row in the storage layout.
    pub fn storage_code(self, row: &[u8], k: usize) -> u32 {
        let (bits, at) = (self.bits(), k * self.bits());
        ((row[at / 8] >> (at % 8)) as u32) & ((1 << bits) - 1)
    }

    /// Code `k` of one row in the kernel layout.
    pub fn word_code(self, row: &[u32], k: usize) -> u32 {
        let (bits, at) = (self.bits(), k * self.bits());
        (row[at / 32] >> (at % 32)) & ((1u64 << bits) - 1) as u32
    }

    /// The first code of a storage buffer (`out` rows of [`Self::row_bytes`]) that the quantizer never
    /// produces: a non-zero padding nibble, int8 -128, an E4M3 NaN (every E2M1 code is valid). Loading rejects them, so equal tensors
    /// have equal bytes and the kernels never meet a code the host reference would reject.
    pub fn invalid_code(self, inn: usize, data: &[u8]) -> Option<InvalidCode> {
        match self {
            WeightFormat::Int4 { .. } | WeightFormat::Nvfp4 | WeightFormat::Mxfp4 => {
                padding_fault(INT4_BITS, inn, data)
            }
            WeightFormat::Int8PerRow => data
                .iter()
                .position(|&b| (b as i8) < -INT8_MAX)
                .map(|byte| InvalidCode::Int8Min { byte }),
            WeightFormat::Fp8Block => {
                data.iter()
                    .position(|&c| e4m3_is_nan(c))
                    .map(|byte| InvalidCode::E4m3Nan {
                        byte,
                        code: data[byte],
                    })
            }
        }
    }

    /// The compile-time format code the CubeCL kernels branch on (`fmt` in [`crate::kernels`]).
    #[cfg(feature = "kernels")]
    pub(crate) fn kernel_code(self) -> u32 {
        match self {
            WeightFormat::Int4 { .. } => 0,
            WeightFormat::Int8PerRow => 1,
            WeightFormat::Fp8Block => 2,
            WeightFormat::Nvfp4 | WeightFormat::Mxfp4 => 3,
        }
    }

    /// The int4 group (or the fp8 or fp4 block), the kernels' other compile-time parameter (`group`).
    #[cfg(feature = "kernels")]
    pub(crate) fn kernel_group(self) -> usize {
        match self {
            WeightFormat::Int4 { group } => group,
            WeightFormat::Int8PerRow => 1,
            WeightFormat::Fp8Block => FP8_BLOCK,
            WeightFormat::Nvfp4 => NVFP4_BLOCK,
            WeightFormat::Mxfp4 => MXFP4_BLOCK,
        }
    }
}

/// Bytes of `n` codes of `bits` bits (a divisor of 8) packed little code first.
pub const fn packed_bytes(bits: usize, n: usize) -> usize {
    n.div_ceil(8 / bits)
}

/// u32 words of `n` codes of `bits` bits (a divisor of 8) packed little code first.
pub const fn packed_words(bits: usize, n: usize) -> usize {
    n.div_ceil(32 / bits)
}

/// The first row of a storage buffer of `bits`-bit codes, `inn` per row, whose last byte has non-zero
/// padding bits (a row of `inn` codes leaves them when `inn * bits` is not a multiple of 8).
pub fn padding_fault(bits: usize, inn: usize, data: &[u8]) -> Option<InvalidCode> {
    let used = (inn % (8 / bits)) * bits;
    let row_bytes = packed_bytes(bits, inn);
    if used == 0 || row_bytes == 0 {
        return None;
    }
    data.chunks(row_bytes).enumerate().find_map(|(row, bytes)| {
        let value = bytes[bytes.len() - 1] >> used;
        (value != 0).then_some(InvalidCode::Padding {
            byte: row * row_bytes + bytes.len() - 1,
            row,
            value,
        })
    })
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
        format.validate()?;
        if parts.is_empty() {
            return Err(KernelError::Shape("no weights to pack".to_owned()));
        }
        let row_bytes = format.row_bytes(inn);
        let row_words = format.row_words(inn);
        let [sr, sc] = format.scale_grid(out, inn);
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
            if let Some(code) = format.invalid_code(inn, data) {
                return Err(KernelError::InvalidCode { expert: e, code });
            }
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
        let [sr, sc] = format.scale_grid(out, inn);
        let parts: Vec<(Vec<u8>, Vec<f32>)> = (0..experts)
            .map(|_| {
                let mut data = Vec::with_capacity(out * row_bytes);
                for _ in 0..out {
                    for b in 0..row_bytes {
                        let mut byte = (next() >> 32) as u8;
                        match format {
                            WeightFormat::Int4 { .. }
                            | WeightFormat::Nvfp4
                            | WeightFormat::Mxfp4
                                if inn % 2 == 1 && b == row_bytes - 1 =>
                            {
                                byte &= 0x0F
                            }
                            WeightFormat::Int8PerRow if byte == 0x80 => byte = 0x81,
                            WeightFormat::Fp8Block if e4m3_is_nan(byte) => byte ^= 1,
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
        let [r, c] = self.format.scale_grid(self.out, self.inn);
        r * c
    }
    /// Bytes the kernels stream per full pass over the weights (codes + scales), for bandwidth figures.
    pub fn bytes(&self) -> usize {
        4 * (self.words.len() + self.scales.len())
    }

    /// The dequantized value of expert `e`, row `row`, input `k`: [`WeightFormat::code_value`] times its
    /// scale, one f32 multiply, exactly as qarl's host reference computes it.
    pub fn weight_at(&self, e: usize, row: usize, k: usize) -> f32 {
        let row_words = self.row_words();
        let start = e * self.expert_words() + row * row_words;
        let code = self
            .format
            .word_code(&self.words[start..start + row_words], k);
        let scale =
            self.scales[e * self.expert_scales() + self.format.scale_index(self.inn, row, k)];
        self.format.code_value(code) * scale
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
