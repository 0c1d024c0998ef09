//! GGML tensor types and their dequantization to f32, following ggml's reference `dequantize_row_*`
//! (ggml-quants.c) operation for operation, so the results are bit-exact with llama.cpp and with gguf-py
//! (`tests/fixtures/gguf/make_gguf_fixtures.py` checks against the latter).

use half::{bf16, f16};

/// What keeps a tensor's bytes from being sized or decoded. The reader and the importer prefix the file
/// and the tensor; the messages say what is wrong with the data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("rows of {row} values are not whole {block}-value blocks")]
    PartialRow { row: u64, block: u64 },
    #[error("byte size overflows")]
    SizeOverflow,
    #[error("{ty} data of {len} bytes is not whole {block_bytes}-byte blocks")]
    PartialBlock {
        ty: &'static str,
        len: usize,
        block_bytes: usize,
    },
    #[error(
        "GGML type {ty} is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)"
    )]
    Unsupported { ty: &'static str },
}

/// The GGML types a GGUF tensor may have (ids as in ggml.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Bf16,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            30 => Self::Bf16,
            _ => return None,
        })
    }

    /// The ggml.h name of a type id this reader has no variant for (the i-quants, the integer and f64
    /// types, ternary and MX formats), so that a refusal names a real type as one not supported instead of
    /// reading like a damaged file.
    pub fn other_name(id: u32) -> Option<&'static str> {
        Some(match id {
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            40 => "NVFP4",
            41 => "Q1_0",
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q8K => "Q8_K",
            Self::Bf16 => "BF16",
        }
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (u64, u64) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q8_1 => (32, 36),
            Self::Q2K => (256, 84),
            Self::Q3K => (256, 110),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
            Self::Q8K => (256, 292),
        }
    }

    /// Bytes of a tensor of `elements` values whose rows have `row` values (rows hold whole blocks).
    pub fn bytes_for(self, row: u64, elements: u64) -> Result<u64, DequantError> {
        let (be, bb) = self.block();
        if !row.is_multiple_of(be) {
            return Err(DequantError::PartialRow { row, block: be });
        }
        (elements / be)
            .checked_mul(bb)
            .ok_or(DequantError::SizeOverflow)
    }

    /// Whether [`dequantize`] reads this type.
    pub fn supported(self) -> bool {
        matches!(
            self,
            Self::F32
                | Self::F16
                | Self::Bf16
                | Self::Q4_0
                | Self::Q4_1
                | Self::Q8_0
                | Self::Q4K
                | Self::Q6K
        )
    }
}

fn h(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Dequantizes `data` (whole blocks of `ty`) to f32; `Err` names an unsupported type.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>, DequantError> {
    let (be, bb) = ty.block();
    let (be, bb) = (be as usize, bb as usize);
    if !data.len().is_multiple_of(bb) {
        return Err(DequantError::PartialBlock {
            ty: ty.name(),
            len: data.len(),
            block_bytes: bb,
        });
    }
    let mut out = Vec::with_capacity(data.len() / bb * be);
    match ty {
        GgmlType::F32 => out.extend(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        GgmlType::F16 => out.extend(data.chunks_exact(2).map(h)),
        GgmlType::Bf16 => out.extend(
            data.chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        GgmlType::Q4_0 => {
            for b in data.chunks_exact(bb) {
                let d = h(&b[0..2]);
                let qs = &b[2..18];
                let mut y = [0f32; 32];
                for j in 0..16 {
                    y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
                    y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
                }
                out.extend_from_slice(&y);
            }
        }
        GgmlType::Q4_1 => {
            for b in data.chunks_exact(bb) {
                let (d, m) = (h(&b[0..2]), h(&b[2..4]));
                let qs = &b[4..20];
                let mut y = [0f32; 32];
                for j in 0..16 {
                    y[j] = (qs[j] & 0x0F) as f32 * d + m;
                    y[j + 16] = (qs[j] >> 4) as f32 * d + m;
                }
                out.extend_from_slice(&y);
            }
        }
        GgmlType::Q8_0 => {
            for b in data.chunks_exact(bb) {
                let d = h(&b[0..2]);
                out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
            }
        }
        GgmlType::Q4K => {
            for b in data.chunks_exact(bb) {
                let (d, dmin) = (h(&b[0..2]), h(&b[2..4]));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for j in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * j, scales);
                    let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                    let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                    let q = &qs[32 * j..32 * j + 32];
                    out.extend(q.iter().map(|&v| d1 * (v & 0x0F) as f32 - m1));
                    out.extend(q.iter().map(|&v| d2 * (v >> 4) as f32 - m2));
                }
            }
        }
        GgmlType::Q6K => {
            for b in data.chunks_exact(bb) {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = h(&b[208..210]);
                for n in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                    let mut y = [0f32; 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let s = |k: usize| d * sc[k] as i8 as f32;
                        y[l] = s(is) * q1 as f32;
                        y[l + 32] = s(is + 2) * q2 as f32;
                        y[l + 64] = s(is + 4) * q3 as f32;
                        y[l + 96] = s(is + 6) * q4 as f32;
                    }
                    out.extend_from_slice(&y);
                }
            }
        }
        other => return Err(DequantError::Unsupported { ty: other.name() }),
    }
    Ok(out)
}

/// The 6-bit scale and min of sub-block `j` of a K-quant super-block (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
