//! The quantization schemes of docs/formats.md, by their exact names.
//!
//! The names are the user-facing identifiers (CLI `--quant`, `quantization_config` in a checkpoint), so
//! parsing is exact and case-sensitive: two spellings of one scheme would make checkpoints ambiguous.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::QuantError;

/// Side of the square FP8 weight block and width of an FP8 activation group (DeepSeek-V3 "blockwise").
pub const FP8_BLOCK: usize = 128;

/// A weight (and, for FP8, activation) quantization format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    /// `int4-g32`: W4A16, symmetric int4 codes in [-8, 7], one f32 scale per 32 inputs of a row.
    Int4G32,
    /// `int4-g64`: as `int4-g32` with groups of 64.
    Int4G64,
    /// `int4-g128`: as `int4-g32` with groups of 128.
    Int4G128,
    /// `int8-pc`: W8A16, symmetric int8 codes in [-127, 127], one f32 scale per output row.
    Int8PerChannel,
    /// `fp8-b128`: FP8 W8A8, E4M3 weight codes with one f32 scale per 128x128 block; activations are
    /// quantized on the fly to E4M3 per token per 128 input columns.
    Fp8Block128,
}

/// The three grid families behind the five schemes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SchemeKind {
    /// Symmetric int4 codes, one scale per `group` inputs of a row (W4A16).
    Int4 { group: usize },
    /// Symmetric int8 codes, one scale per output row (W8A16).
    Int8PerRow,
    /// E4M3 codes, one scale per 128x128 weight block; activations per token per 128 columns (W8A8).
    Fp8Block,
}

impl QuantScheme {
    /// Every scheme, in the order they are listed to users.
    pub const ALL: [QuantScheme; 5] = [
        QuantScheme::Int4G32,
        QuantScheme::Int4G64,
        QuantScheme::Int4G128,
        QuantScheme::Int8PerChannel,
        QuantScheme::Fp8Block128,
    ];

    /// The exact name (`int4-g32`, `int4-g64`, `int4-g128`, `int8-pc`, `fp8-b128`).
    pub fn name(self) -> &'static str {
        match self {
            QuantScheme::Int4G32 => "int4-g32",
            QuantScheme::Int4G64 => "int4-g64",
            QuantScheme::Int4G128 => "int4-g128",
            QuantScheme::Int8PerChannel => "int8-pc",
            QuantScheme::Fp8Block128 => "fp8-b128",
        }
    }

    /// The grid family, for code that works per family (packing, scales, kernels).
    pub fn kind(self) -> SchemeKind {
        match self {
            QuantScheme::Int4G32 => SchemeKind::Int4 { group: 32 },
            QuantScheme::Int4G64 => SchemeKind::Int4 { group: 64 },
            QuantScheme::Int4G128 => SchemeKind::Int4 { group: 128 },
            QuantScheme::Int8PerChannel => SchemeKind::Int8PerRow,
            QuantScheme::Fp8Block128 => SchemeKind::Fp8Block,
        }
    }

    /// The int4 group size along the input axis, `None` for the other schemes.
    pub fn int4_group(self) -> Option<usize> {
        match self.kind() {
            SchemeKind::Int4 { group } => Some(group),
            SchemeKind::Int8PerRow | SchemeKind::Fp8Block => None,
        }
    }

    /// Whether the matmul also quantizes its activations (W8A8); the others keep activations in f32 (A16).
    pub fn quantizes_activations(self) -> bool {
        matches!(self, QuantScheme::Fp8Block128)
    }

    /// Shape of the f32 scale tensor for a weight `[out, inn]`: `[out, ceil(inn/G)]` (int4), `[out]` (int8),
    /// `[ceil(out/128), ceil(inn/128)]` (fp8).
    pub fn scale_shape(self, out: usize, inn: usize) -> Vec<usize> {
        match self.kind() {
            SchemeKind::Int4 { group } => vec![out, inn.div_ceil(group)],
            SchemeKind::Int8PerRow => vec![out],
            SchemeKind::Fp8Block => vec![out.div_ceil(FP8_BLOCK), inn.div_ceil(FP8_BLOCK)],
        }
    }

    /// Bytes of packed codes in one row of `inn` weights: `ceil(inn/2)` for int4 (an odd row ends with a
    /// zero high nibble), `inn` for int8 and fp8.
    pub fn row_bytes(self, inn: usize) -> usize {
        match self.kind() {
            SchemeKind::Int4 { .. } => inn.div_ceil(2),
            SchemeKind::Int8PerRow | SchemeKind::Fp8Block => inn,
        }
    }

    /// Bytes of packed codes plus f32 scales for a weight `[out, inn]` (what a checkpoint stores and what
    /// [`crate::quant::QuantizedTensor::storage_bytes`] reports), without quantizing anything.
    pub fn storage_bytes(self, out: usize, inn: usize) -> usize {
        out * self.row_bytes(inn) + 4 * self.scale_shape(out, inn).iter().product::<usize>()
    }
}

impl fmt::Display for QuantScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for QuantScheme {
    type Err = QuantError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        QuantScheme::ALL
            .into_iter()
            .find(|scheme| scheme.name() == s)
            .ok_or_else(|| QuantError::UnknownScheme { name: s.to_owned() })
    }
}

impl Serialize for QuantScheme {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for QuantScheme {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}
