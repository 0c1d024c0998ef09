//! The quantization schemes of docs/formats.md, by their exact names.
//!
//! The names are the user-facing identifiers (CLI `--quant`, `quantization_config` in a checkpoint), so
//! parsing is exact and case-sensitive: two spellings of one scheme would make checkpoints ambiguous.
//!
//! A scheme is a name for one [`SchemeKind`], the format description shared with the CubeCL kernels
//! (`cube_kernels::format::WeightFormat`: code width and values, scale grid, storage and kernel layouts).
//! Everything a scheme knows about its layout it asks that description, so the quantizer, the CPU
//! kernels and the GPU path cannot disagree about it.

use std::str::FromStr;

use super::error::QuantError;

/// Side of the square FP8 weight block and width of an FP8 activation group (DeepSeek-V3 "blockwise").
pub use cube_kernels::format::FP8_BLOCK;

/// The format behind a scheme: `Int4 { group }`, `Int8PerRow` or `Fp8Block`. It is the kernels' own
/// format type (`cube_kernels::WeightFormat`), so handing a weight to the CubeCL kernels needs no
/// conversion, and a layout question (row bytes, scale grid, valid codes) has one answer.
pub use cube_kernels::format::WeightFormat as SchemeKind;

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
    /// `nvfp4`: W4A16, E2M1 codes, one E4M3 scale per 16 inputs of a row times one f32 scale per matrix.
    Nvfp4,
    /// `mxfp4`: W4A16, E2M1 codes, one E8M0 (power of two) scale per 32 inputs of a row.
    Mxfp4,
}

impl QuantScheme {
    /// Every scheme, in the order they are listed to users.
    pub const ALL: [QuantScheme; 7] = [
        QuantScheme::Int4G32,
        QuantScheme::Int4G64,
        QuantScheme::Int4G128,
        QuantScheme::Int8PerChannel,
        QuantScheme::Fp8Block128,
        QuantScheme::Nvfp4,
        QuantScheme::Mxfp4,
    ];

    /// The exact name (`int4-g32`, `int4-g64`, `int4-g128`, `int8-pc`, `fp8-b128`, `nvfp4`, `mxfp4`); the same as the
    /// format's own name (`SchemeKind::name`, checked by a test), but `&'static str` for configs and flags.
    pub fn name(self) -> &'static str {
        match self {
            QuantScheme::Int4G32 => "int4-g32",
            QuantScheme::Int4G64 => "int4-g64",
            QuantScheme::Int4G128 => "int4-g128",
            QuantScheme::Int8PerChannel => "int8-pc",
            QuantScheme::Fp8Block128 => "fp8-b128",
            QuantScheme::Nvfp4 => "nvfp4",
            QuantScheme::Mxfp4 => "mxfp4",
        }
    }

    /// The format description (total: every scheme has one, and every one of them is a format the
    /// kernels take).
    pub fn kind(self) -> SchemeKind {
        match self {
            QuantScheme::Int4G32 => SchemeKind::Int4 { group: 32 },
            QuantScheme::Int4G64 => SchemeKind::Int4 { group: 64 },
            QuantScheme::Int4G128 => SchemeKind::Int4 { group: 128 },
            QuantScheme::Int8PerChannel => SchemeKind::Int8PerRow,
            QuantScheme::Fp8Block128 => SchemeKind::Fp8Block,
            QuantScheme::Nvfp4 => SchemeKind::Nvfp4,
            QuantScheme::Mxfp4 => SchemeKind::Mxfp4,
        }
    }

    /// The int4 group size along the input axis, `None` for the other schemes.
    pub fn int4_group(self) -> Option<usize> {
        match self.kind() {
            SchemeKind::Int4 { group } => Some(group),
            SchemeKind::Int8PerRow
            | SchemeKind::Fp8Block
            | SchemeKind::Nvfp4
            | SchemeKind::Mxfp4 => None,
        }
    }

    /// Whether the matmul also quantizes its activations (W8A8); the others keep activations in f32 (A16).
    pub fn quantizes_activations(self) -> bool {
        self.kind().quantizes_activations()
    }

    /// Shape of the f32 scale tensor for a weight `[out, inn]`: `[out, ceil(inn/G)]` (int4), `[out]` (int8),
    /// `[ceil(out/128), ceil(inn/128)]` (fp8), `[out, ceil(inn/16)]` (nvfp4), `[out, ceil(inn/32)]` (mxfp4).
    pub fn scale_shape(self, out: usize, inn: usize) -> Vec<usize> {
        self.kind().scale_shape(out, inn)
    }

    /// Bytes of packed codes in one row of `inn` weights: `ceil(inn/2)` for int4 and fp4 (an odd row ends
    /// with a zero high nibble), `inn` for int8 and fp8.
    pub fn row_bytes(self, inn: usize) -> usize {
        self.kind().row_bytes(inn)
    }

    /// Bytes of packed codes plus f32 scales for a weight `[out, inn]` (what a checkpoint stores and what
    /// [`crate::quant::QuantizedTensor::storage_bytes`] reports), without quantizing anything.
    pub fn storage_bytes(self, out: usize, inn: usize) -> usize {
        self.kind().storage_bytes(out, inn)
    }
}

impl From<QuantScheme> for SchemeKind {
    fn from(scheme: QuantScheme) -> Self {
        scheme.kind()
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

/// Display, serde and parsing by the name a type's `name()` gives and its `FromStr` accepts, so configs,
/// flags and files spell a scheme or precision one way.
macro_rules! by_name {
    ($t:ty) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.name())
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let name = <String as serde::Deserialize>::deserialize(deserializer)?;
                name.parse::<$t>().map_err(serde::de::Error::custom)
            }
        }
    };
}
pub(crate) use by_name;

by_name!(QuantScheme);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_is_a_kernel_format_of_the_same_name() {
        for scheme in QuantScheme::ALL {
            let kind = scheme.kind();
            assert_eq!(kind.name(), scheme.name());
            assert_eq!(SchemeKind::parse(scheme.name()).unwrap(), kind);
            assert!(kind.validate().is_ok(), "{scheme}");
        }
    }
}
