//! The low-bit matmul on the CPU: `y[m, out] = x[m, in] · W'^T` with `W' = dequant(Q(W))`, reading the
//! packed codes (never a float copy of the weight), multithreaded (rayon over output rows) and SIMD with
//! run-time feature detection (AVX-512, AVX2 + FMA, and a portable reference; see [`SimdPath`]).
//!
//! # The arithmetic (fixed, the same on every path)
//! Every weight is decoded exactly as [`QuantizedTensor::dequantize_row`] does (`q as f32 * s`, fp8:
//! `e4m3_to_f32(code) * s`, one rounding), the activations are the scheme's effective ones
//! ([`effective_activations`]: `x` itself, or `dequant(Q8(x))` for fp8 W8A8), and each output element is
//!
//! ```text
//! acc[l] = +0.0 for the 32 lanes l = 0..32
//! for each chunk c of 32 input columns, in order:   acc[l] = fma(x[32c + l], w'[32c + l], acc[l])
//! (the input axis is zero-padded to a multiple of 32; a padded column adds nothing)
//! y = tree(acc): t16[j] = acc[j] + acc[j+16]; t8[j] = t16[j] + t16[j+8]; t4[j] = t8[j] + t8[j+4];
//!                t2[j] = t4[j] + t4[j+2]; y = t2[0] + t2[1]
//! ```
//!
//! One fused multiply-add per weight (IEEE fma on every path: `f32::mul_add` in the portable code), so the
//! AVX-512, AVX2 and portable paths give the same bits, and the result of a row depends neither on `m`,
//! nor on the other rows of the call, nor on the thread count, nor on whether the row is decoded alone (KV
//! cache) or scored within a full sequence. This is the arithmetic shared by rollout and the aligned
//! training forward.
//!
//! # The kernel layout
//! [`KernelWeights`] is made once per weight version (shared by rollout and training through
//! [`crate::ops::PackedWeight`]): rows zero-padded to a multiple of 32 columns; int4 repacked by groups
//! of four rows: chunk `c` of rows `4g..4g+4` is one 64-byte line of 16 little-endian u32 words, word `l`
//! holding row `4g+r`'s column `32c+l` in bits `8r..8r+4` and its column `32c+16+l` in bits `8r+4..8r+8`
//! (one aligned load serves the four rows of a tile; each row's 32 weights are then two shifts and two
//! table lookups, without the byte-to-word widening a row-major layout needs: about 20% fewer cycles per
//! chunk on Zen 4); fp8 block scales premultiplied by 2^120 so that
//! an E4M3 code becomes its f32 value with shifts only (`raw * (s * 2^120) == e4m3_to_f32(code) * s`
//! exactly: both are the one rounding of the same real product).
//!
//! Small `m` (decode, GEMV) runs a fused decode-and-multiply tile over 4 output rows; larger `m` (prefill,
//! scoring) decodes a panel of output rows to f32 once (in a per-thread scratch) and runs a 4x3 register
//! tile over it. On AVX-512 a task's whole row range goes through one call (no per-tile dispatch) and the
//! lane trees of a tile's sums run side by side (`x86`'s `reduce16_512`).

use std::borrow::Cow;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::quant::e4m3::e4m3_to_f32;
use crate::quant::fp4::{E2M1_VALUES, MXFP4_BLOCK, NVFP4_BLOCK};
use crate::quant::fp8::Fp8Activations;
use crate::quant::packing::nibble_to_int4;
use crate::quant::scheme::{SchemeKind, FP8_BLOCK};
use crate::quant::tensor::QuantizedTensor;

/// `f::<S>(args)` for the run-time scheme code `scheme` (the float panel for any other code): the one
/// place the SIMD paths turn a scheme into their const-generic kernels.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! by_scheme {
    ($f:ident, $scheme:expr, ($($a:expr),*)) => {
        match $scheme {
            INT4 => $f::<INT4>($($a),*),
            INT8 => $f::<INT8>($($a),*),
            FP8 => $f::<FP8>($($a),*),
            NVFP4 => $f::<NVFP4>($($a),*),
            MXFP4 => $f::<MXFP4>($($a),*),
            _ => $f::<PANEL>($($a),*),
        }
    };
}

/// `f::<S, MB, OB>(args)` for a sub-tile of [`in_pair_tiles`] (`mb` activation rows, `ob` output rows: 2 x 1,
/// 1 x 2 or 1 x 1) of the run-time scheme code `scheme`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! pair_tile {
    ($f:ident, $scheme:expr, $mb:expr, $ob:expr, $args:tt) => {
        match $scheme {
            INT4 => pair_tile!(@shape $f, INT4, $mb, $ob, $args),
            INT8 => pair_tile!(@shape $f, INT8, $mb, $ob, $args),
            FP8 => pair_tile!(@shape $f, FP8, $mb, $ob, $args),
            NVFP4 => pair_tile!(@shape $f, NVFP4, $mb, $ob, $args),
            MXFP4 => pair_tile!(@shape $f, MXFP4, $mb, $ob, $args),
            _ => pair_tile!(@shape $f, PANEL, $mb, $ob, $args),
        }
    };
    (@shape $f:ident, $s:ident, $mb:expr, $ob:expr, ($($a:expr),*)) => {
        match ($mb, $ob) {
            (2, _) => $f::<$s, 2, 1>($($a),*),
            (_, 2) => $f::<$s, 1, 2>($($a),*),
            _ => $f::<$s, 1, 1>($($a),*),
        }
    };
}

/// The bits of `(code as i8 as i32) << 20` that make the folded fp8 value: the sign (bit 31) and the seven
/// magnitude bits (exponent and mantissa at bits 20..26). Shared by the SIMD fp8 decodes.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const FP8_BITS: i32 = 0x87F0_0000_u32 as i32;

mod f32mm;
pub mod gemm;
mod memory;
#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use f32mm::{f32_matmul, f32_matmul_on, f32_matmul_reference, softmax_rows};
pub use memory::WeightMemoryWords;
use memory::{pad_rows_into, AlignedBytes, AlignedRows};

/// Columns per chunk, and the number of partial sums of every output element.
pub const LANES: usize = 32;

/// `m` up to which the fused decode-and-multiply tiles run, in passes of at most [`FUSED_PASS_M`] activation
/// rows over each task's output rows (above it: decoded panels). A second pass decodes the task's codes again,
/// from L2, which still beats writing and reading an f32 panel at these `m`. Paired probe (cold weights, 2
/// cores, Zen 4), panels vs passes: 4096x4096 int4-g128 m=5 1.84 vs 1.21 ms, m=8 2.14 vs 1.60 ms; int8-pc m=8
/// 2.45 vs 1.94 ms; fp8-b128 m=8 2.49 vs 1.79 ms; 768x768 int4 m=5 53 vs 42 us, m=8 65 vs 60 us (int8 m=8: a
/// tie). From m = 16 on, panels win on small matrices (768x768 int8 m=16: 116 vs 132 us).
const FUSED_MAX_M: usize = 8;
/// Activation rows per fused pass (the register tiles' largest `m`).
const FUSED_PASS_M: usize = 4;
/// Output rows per rayon task on the fused path.
const FUSED_TASK_ROWS: usize = 64;
/// Output rows per panel (decoded once, then multiplied by every activation row).
const PANEL_ROWS: usize = 24;
/// Below this many multiply-adds a call runs on the calling thread (a rayon dispatch costs more).
const PARALLEL_MIN_WORK: usize = 1 << 20;

/// 2^120: an E4M3 code's bits placed in an f32 (exponent field shifted into place) are its value / 2^120.
const FP8_FOLD: f32 = 1.329_228e36;

/// The SIMD implementation a matmul runs on. All paths compute the same bits (see the module docs); the
/// choice only changes the speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimdPath {
    /// AVX-512F/BW + FMA (x86_64).
    Avx512,
    /// AVX2 + FMA (x86_64).
    Avx2,
    /// NEON (aarch64, part of its base ISA).
    Neon,
    /// Plain Rust (`f32::mul_add`); the reference the SIMD paths are tested against.
    Portable,
}

impl SimdPath {
    pub fn name(self) -> &'static str {
        match self {
            Self::Avx512 => "avx512",
            Self::Avx2 => "avx2",
            Self::Neon => "neon",
            Self::Portable => "portable",
        }
    }

    /// Every path this machine can run, fastest first (the portable one always).
    pub fn available() -> Vec<SimdPath> {
        let mut paths = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("avx2")
            {
                paths.push(SimdPath::Avx512);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                paths.push(SimdPath::Avx2);
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            paths.push(SimdPath::Neon);
        }
        paths.push(SimdPath::Portable);
        paths
    }

    /// Whether this machine can run the path (detected once; the kernels check it on every call).
    pub fn is_available(self) -> bool {
        static AVAILABLE: OnceLock<Vec<SimdPath>> = OnceLock::new();
        AVAILABLE.get_or_init(Self::available).contains(&self)
    }

    /// The fastest available path (detected once). `QARL_SIMD=avx512|avx2|neon|portable` picks a slower one.
    ///
    /// A value that names no path, or one this machine cannot run, is reported once on stderr and the
    /// fastest path is used: the variable is read deep in the kernels, where there is no caller to return an
    /// error to, and a silently ignored typo would time (or test) another path than the one asked for.
    pub fn detect() -> SimdPath {
        static PATH: OnceLock<SimdPath> = OnceLock::new();
        *PATH.get_or_init(|| {
            let wanted = std::env::var("QARL_SIMD").ok();
            let (path, warning) = Self::choose(wanted.as_deref(), &Self::available());
            if let Some(warning) = warning {
                eprintln!("warning: {warning}");
            }
            path
        })
    }

    /// The path `QARL_SIMD=wanted` selects among `available` (fastest first, never empty), and a warning when
    /// `wanted` is not honoured (unknown, or not available here). Unset or empty means the fastest.
    pub fn choose(wanted: Option<&str>, available: &[SimdPath]) -> (SimdPath, Option<String>) {
        const ALL: [SimdPath; 4] = [
            SimdPath::Avx512,
            SimdPath::Avx2,
            SimdPath::Neon,
            SimdPath::Portable,
        ];
        let fastest = available.first().copied().unwrap_or(SimdPath::Portable);
        let names = |paths: &[SimdPath]| {
            paths
                .iter()
                .map(|p| p.name())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let wanted = match wanted.map(str::trim) {
            None | Some("") => return (fastest, None),
            Some(w) => w,
        };
        if let Some(&p) = available.iter().find(|p| p.name() == wanted) {
            return (p, None);
        }
        let why = if ALL.iter().any(|p| p.name() == wanted) {
            format!(
                "is not available on this machine (available: {})",
                names(available)
            )
        } else {
            format!("is not a SIMD path (valid values: {})", names(&ALL))
        };
        let warning = format!("QARL_SIMD={wanted} {why}; using {}", fastest.name());
        (fastest, Some(warning))
    }

    /// `QARL_SIMD` checked where a caller can still refuse it (the command line, before any work): the
    /// warning [`SimdPath::choose`] would print, as an error, without the fallback.
    pub fn check_env() -> Result<(), String> {
        let wanted = std::env::var("QARL_SIMD").ok();
        match Self::choose(wanted.as_deref(), &Self::available()) {
            (_, None) => Ok(()),
            (_, Some(warning)) => Err(match warning.rfind("; using ") {
                Some(i) => format!("{}; unset it for the fastest path", &warning[..i]),
                None => warning,
            }),
        }
    }
}

/// Which decoder a tile runs (a const generic of the tiles).
pub(crate) const INT4: u8 = 0;
pub(crate) const INT8: u8 = 1;
pub(crate) const FP8: u8 = 2;
/// Already decoded f32 rows (a panel).
pub(crate) const PANEL: u8 = 3;
/// E2M1 codes in the int4 kernel layout, two f32 scales per chunk (columns `32c..32c+16` and
/// `32c+16..32c+32`: the low and the high nibbles of the chunk's words).
pub(crate) const NVFP4: u8 = 4;
/// E2M1 codes in the int4 kernel layout, one f32 scale per chunk.
pub(crate) const MXFP4: u8 = 5;

/// Whether scheme code `s` reads 4-bit codes in the int4 kernel layout (four-row lines).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) const fn nibbles(s: u8) -> bool {
    matches!(s, INT4 | NVFP4 | MXFP4)
}

/// Scales per chunk of scheme code `s` (nvfp4: one per 16 columns), for the scale prefetches.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) const fn scales_per_chunk(s: u8) -> usize {
    if s == NVFP4 {
        2
    } else {
        1
    }
}

/// The 16-entry decoding table of a 4-bit scheme before its scale: the int4 values or the E2M1 values.
#[cfg(target_arch = "x86_64")]
pub(crate) const fn nibble_table(s: u8) -> &'static [f32; 16] {
    if s == INT4 {
        &INT4_TABLE
    } else {
        &E2M1_VALUES
    }
}

/// `nibble_to_int4(n) as f32` for n = 0..16: the int4 decoding table before the group scale.
#[cfg(target_arch = "x86_64")]
const INT4_TABLE: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0,
];

/// One weight version in the kernel layout (module docs), made by [`KernelWeights::new`].
#[derive(Debug, Clone)]
pub struct KernelWeights {
    scheme: u8,
    out: usize,
    inn: usize,
    /// `inn` rounded up to a multiple of [`LANES`].
    kp: usize,
    /// Codes, `row_bytes` per output row (int4: in groups of four rows, see the module docs), 64-byte
    /// aligned.
    codes: AlignedBytes,
    row_bytes: usize,
    /// int4: `[out, ceil(in/G)]`; int8: `[out]`; fp8: `[ceil(out/128), ceil(in/128)]` times 2^120; nvfp4:
    /// `[out, 2 * chunks]` (zero-padded); mxfp4: `[out, chunks]`.
    scales: Vec<f32>,
    /// Chunks of 32 columns sharing one scale (int4: G/32; fp8: 4; int8: the whole row).
    seg_chunks: usize,
    /// Output rows sharing one scale row (fp8: 128, else 1) and the stride of a scale row.
    scale_row_div: usize,
    scale_row_stride: usize,
    /// fp8 only: a block scale too large to premultiply by 2^120 (|w| > ~1e5); such weights use the
    /// portable path (same bits, slower).
    portable_only: bool,
    fp8_activations: bool,
}

/// What a tile reads: the codes (or a decoded panel) and scales of consecutive output rows.
#[derive(Clone, Copy)]
pub(crate) struct TileSrc<'a> {
    pub codes: &'a [u8],
    pub row_bytes: usize,
    pub panel: &'a [f32],
    pub scales: &'a [f32],
    pub seg_chunks: usize,
    pub scale_row_div: usize,
    pub scale_row_stride: usize,
    /// Chunks per row.
    pub chunks: usize,
    /// fp8 scales not premultiplied by 2^120 (portable path only).
    pub unfolded: bool,
}

impl<'a> TileSrc<'a> {
    /// The scale of output row `o`, segment `seg`.
    #[inline(always)]
    pub fn scale(&self, o: usize, seg: usize) -> f32 {
        self.scale_row(o)[seg]
    }

    /// int4: the byte offset of chunk `c` of row `o`'s four-row group (one 64-byte line) and the row's bit
    /// offset in each word (module docs).
    #[inline(always)]
    pub fn int4_line(&self, o: usize, c: usize) -> (usize, u32) {
        (
            (o / INT4_ROWS) * INT4_ROWS * self.row_bytes + c * 64,
            8 * (o % INT4_ROWS) as u32,
        )
    }

    /// The scales of output row `o`, one per segment (empty for a float panel). The SIMD loops take this
    /// once per row and then count segments, instead of two integer divisions per chunk in
    /// [`Self::scale`]: at int4-g32 (one segment per chunk) those divisions cost more than the decoding.
    #[inline(always)]
    pub fn scale_row(&self, o: usize) -> &'a [f32] {
        let start = (o / self.scale_row_div) * self.scale_row_stride;
        self.scales.get(start..).unwrap_or(&[])
    }

    /// The scale segments of a row in order: `(seg, chunks)` for each run of `seg_chunks` chunks sharing
    /// one scale (the last run may be shorter): the SIMD decodes set up a segment's scale once, then walk
    /// its chunks. The tile kernels keep a hand-written loop: in the GEMV's inner loop this iterator
    /// measured 1.2% (AVX-512) and 3% (AVX2) slower, warm int4-g128 4096 x 4096 on one core.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    #[inline(always)]
    pub fn segments(&self) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> {
        let (chunks, step) = (self.chunks, self.seg_chunks);
        (0..chunks.div_ceil(step))
            .map(move |seg| (seg, seg * step..(seg * step + step).min(chunks)))
    }

    /// Debug-build bounds check of a SIMD tile's reads: rows `..o_end` of the codes (or the panel) and
    /// `chunks * 32` floats of every activation row in `xs`.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn debug_check(&self, scheme: u8, o_end: usize, xs: &[&[f32]]) {
        let kp = self.chunks * LANES;
        debug_assert!(xs.iter().all(|x| x.len() >= kp));
        match scheme {
            PANEL => debug_assert!(self.panel.len() >= o_end * kp),
            _ => debug_assert!(self.codes.len() >= o_end * self.row_bytes),
        }
        let _ = (kp, o_end);
    }
}

impl KernelWeights {
    /// Builds the kernel layout of `w` (once per weight version).
    pub fn new(w: &QuantizedTensor) -> Self {
        let [out, inn] = w.shape();
        let kp = inn.div_ceil(LANES) * LANES;
        let chunks = kp / LANES;
        let data = w.data();
        match w.scheme().kind() {
            kind @ (SchemeKind::Int4 { .. } | SchemeKind::Nvfp4 | SchemeKind::Mxfp4) => {
                let group = match kind {
                    SchemeKind::Int4 { group } => group,
                    _ => LANES,
                };
                assert!(
                    group % LANES == 0,
                    "int4 group {group} is not a multiple of {LANES}"
                );
                let src_row = inn.div_ceil(2);
                let row_bytes = kp / 2;
                let groups = out.div_ceil(INT4_ROWS);
                let mut codes = AlignedBytes::zeroed(groups * INT4_ROWS * row_bytes);
                let nib = |o: usize, k: usize| -> u32 {
                    if o < out && k < inn {
                        ((data[o * src_row + k / 2] >> (4 * (k & 1))) & 0xF) as u32
                    } else {
                        0
                    }
                };
                for g in 0..groups {
                    for c in 0..chunks {
                        let line = (g * chunks + c) * 64;
                        for l in 0..16 {
                            let mut word = 0u32;
                            for r in 0..INT4_ROWS {
                                let o = g * INT4_ROWS + r;
                                word |= nib(o, c * LANES + l) << (8 * r);
                                word |= nib(o, c * LANES + 16 + l) << (8 * r + 4);
                            }
                            codes[line + 4 * l..line + 4 * l + 4]
                                .copy_from_slice(&word.to_le_bytes());
                        }
                    }
                }
                let (scheme, scales, stride) = match kind {
                    SchemeKind::Nvfp4 => {
                        (NVFP4, fp4_scales(w, NVFP4_BLOCK, 2 * chunks), 2 * chunks)
                    }
                    SchemeKind::Mxfp4 => (MXFP4, fp4_scales(w, MXFP4_BLOCK, chunks), chunks),
                    _ => (INT4, w.scales().to_vec(), inn.div_ceil(group)),
                };
                Self {
                    scheme,
                    out,
                    inn,
                    kp,
                    codes,
                    row_bytes,
                    scales,
                    seg_chunks: group / LANES,
                    scale_row_div: 1,
                    scale_row_stride: stride,
                    portable_only: false,
                    fp8_activations: false,
                }
            }
            SchemeKind::Int8PerRow | SchemeKind::Fp8Block => {
                let fp8 = matches!(w.scheme().kind(), SchemeKind::Fp8Block);
                let mut codes = AlignedBytes::zeroed(out * kp);
                pad_rows_into(&mut codes, data, inn, kp);
                let (scales, seg_chunks, scale_row_div, scale_row_stride, portable_only) = if fp8 {
                    let folded: Vec<f32> = w.scales().iter().map(|s| s * FP8_FOLD).collect();
                    let bad = folded.iter().any(|s| !s.is_finite());
                    let scales = if bad { w.scales().to_vec() } else { folded };
                    (
                        scales,
                        FP8_BLOCK / LANES,
                        FP8_BLOCK,
                        inn.div_ceil(FP8_BLOCK),
                        bad,
                    )
                } else {
                    (w.scales().to_vec(), chunks.max(1), 1, 1, false)
                };
                Self {
                    scheme: if fp8 { FP8 } else { INT8 },
                    out,
                    inn,
                    kp,
                    codes,
                    row_bytes: kp,
                    scales,
                    seg_chunks,
                    scale_row_div,
                    scale_row_stride,
                    portable_only,
                    fp8_activations: fp8,
                }
            }
        }
    }

    pub fn out_features(&self) -> usize {
        self.out
    }

    pub fn in_features(&self) -> usize {
        self.inn
    }

    /// Bytes of the kernel layout (codes and scales).
    pub fn storage_bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }

    /// Whether the codes live in their own 2 MiB-aligned mapping advised for transparent huge pages (those
    /// of at least 2 MiB; see `AlignedBytes`). Whether the kernel backs it with huge pages is its choice
    /// (`AnonHugePages` in `/proc/<pid>/smaps_rollup` tells).
    pub fn codes_in_huge_page_mapping(&self) -> bool {
        self.codes.in_huge_page_mapping()
    }

    fn src(&self) -> TileSrc<'_> {
        TileSrc {
            codes: &self.codes,
            row_bytes: self.row_bytes,
            panel: &[],
            scales: &self.scales,
            seg_chunks: self.seg_chunks,
            scale_row_div: self.scale_row_div,
            scale_row_stride: self.scale_row_stride,
            chunks: self.kp / LANES,
            unfolded: self.portable_only,
        }
    }

    /// The path [`Self::matmul`] runs on.
    pub fn path(&self) -> SimdPath {
        if self.portable_only {
            SimdPath::Portable
        } else {
            SimdPath::detect()
        }
    }

    /// Decoded row `o` (padded to a multiple of 32 columns), the portable decoder: the test oracle of the
    /// layout (it must equal [`QuantizedTensor::dequantize_row`]).
    pub fn decode_row(&self, o: usize) -> Vec<f32> {
        let mut row = vec![0.0f32; self.kp];
        portable::decode_rows(self.scheme, &self.src(), o, 1, &mut row);
        row
    }

    /// `y[m, out] = x[m, in] · W'^T` on the detected path.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_on(self.path(), x, m)
    }

    /// [`Self::matmul`] on a given path (tests compare them; a path this machine lacks panics).
    pub fn matmul_on(&self, path: SimdPath, x: &[f32], m: usize) -> Vec<f32> {
        assert!(
            path.is_available(),
            "SIMD path {} is not available on this machine",
            path.name()
        );
        let path = if self.portable_only {
            SimdPath::Portable
        } else {
            path
        };
        let (out, inn, kp) = (self.out, self.inn, self.kp);
        assert_eq!(x.len(), m * inn, "activations must be [m, in]");
        if m == 0 || out == 0 {
            return vec![0.0; m * out];
        }
        let xa: Cow<'_, [f32]> = if self.fp8_activations {
            match Fp8Activations::fake_quantize(x, m, inn) {
                Ok(a) => Cow::Owned(a),
                Err(_) => Cow::Owned(vec![f32::NAN; x.len()]),
            }
        } else {
            Cow::Borrowed(x)
        };
        let xp = AlignedRows::of(&xa, m, inn, kp);
        let mut y = vec![0.0f32; m * out];
        let yp = OutPtr(y.as_mut_ptr());
        let src = self.src();
        let (task_rows, fused) = if m <= FUSED_MAX_M {
            (FUSED_TASK_ROWS, true)
        } else {
            (PANEL_ROWS, false)
        };
        // Each task computes output rows `o0..o0 + rows` transposed (`[rows, m]`, a per-thread scratch) and
        // writes them to their own columns of `y`.
        let task = |t: usize| {
            let o0 = t * task_rows;
            let rows = task_rows.min(out - o0);
            SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                let (block, panel) = scratch.split(rows * m, if fused { 0 } else { rows * kp });
                if fused {
                    self.fused_block(path, &src, &xp, m, o0, block);
                } else {
                    self.panel_block(path, &src, &xp, m, o0, block, panel);
                }
                // SAFETY: `y` has m * out elements and outlives the tasks; rows o0.. < out belong to this
                // task alone, so no two tasks write the same element.
                unsafe { yp.write_columns(0, out, o0, m, block) };
            });
        };
        let tasks = out.div_ceil(task_rows);
        if m * out * kp >= PARALLEL_MIN_WORK {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
        y
    }

    /// Output rows `o0..` into `block` (`[rows, m]`, transposed) with the fused tiles, `m <= FUSED_MAX_M`, in
    /// passes of up to [`FUSED_PASS_M`] activation rows.
    fn fused_block(
        &self,
        path: SimdPath,
        src: &TileSrc<'_>,
        xp: &[f32],
        m: usize,
        o0: usize,
        block: &mut [f32],
    ) {
        let rows = block.len() / m;
        let kp = self.kp;
        let xs: Vec<&[f32]> = (0..m).map(|i| &xp[i * kp..(i + 1) * kp]).collect();
        // Four output rows per tile for one or two activation rows, two for three or four (registers). A
        // GEMV of 8-bit codes streams one row at a time instead: measured on a 2-core Zen 4 (4096 x 4096, cold
        // weights), int8 0.59 vs 0.72 ms and fp8 0.83 vs 1.00 ms, while int4 (half the bytes per column,
        // more decoding) is faster four rows at a time (0.65 vs 0.72 ms at g32). The sums are the same either way.
        for (p, part) in xs.chunks(FUSED_PASS_M).enumerate() {
            let full = match (part.len(), self.scheme) {
                (1, INT8 | FP8) => 1,
                (1 | 2, _) => 4,
                _ => 2,
            };
            // Pass `p` writes columns `FUSED_PASS_M * p..` of the `[rows, m]` block.
            let cols = &mut block[FUSED_PASS_M * p..];
            run_rows(path, self.scheme, src, o0, rows, part, full, cols, m);
        }
    }

    /// Output rows `o0..` into `block` (`[rows, m]`, transposed): decode them to an f32 panel (`panel`,
    /// `rows * kp` floats of scratch), then 4x3 tiles.
    #[allow(clippy::too_many_arguments)]
    fn panel_block(
        &self,
        path: SimdPath,
        src: &TileSrc<'_>,
        xp: &[f32],
        m: usize,
        o0: usize,
        block: &mut [f32],
        panel: &mut [f32],
    ) {
        let rows = block.len() / m;
        let kp = self.kp;
        decode_rows(path, self.scheme, src, o0, rows, panel);
        let psrc = TileSrc {
            codes: &[],
            row_bytes: 0,
            panel,
            scales: &[],
            seg_chunks: src.chunks.max(1),
            scale_row_div: 1,
            scale_row_stride: 0,
            chunks: src.chunks,
            unfolded: false,
        };
        panel_tiles(path, &psrc, xp, kp, m, block);
    }
}

/// Rows per int4 group of the kernel layout (module docs).
pub(crate) const INT4_ROWS: usize = 4;

/// The fp4 block scales of `w` (blocks of `block` columns) with rows zero-padded to `per_row` scales (the
/// chunk count times the scales per chunk), so that a padded chunk reads scales that exist.
fn fp4_scales(w: &QuantizedTensor, block: usize, per_row: usize) -> Vec<f32> {
    let [out, inn] = w.shape();
    let have = inn.div_ceil(block);
    let mut scales = vec![0.0f32; out * per_row];
    if have > 0 {
        for (dst, src) in scales.chunks_mut(per_row).zip(w.scales().chunks(have)) {
            dst[..have].copy_from_slice(src);
        }
    }
    scales
}

/// A per-thread scratch buffer (reused across calls: a fresh allocation per task costs page faults and
/// zeroing at prefill sizes).
struct Scratch(Vec<f32>);

impl Scratch {
    /// Two disjoint slices of `a` and `b` floats (contents unspecified: every caller overwrites them).
    fn split(&mut self, a: usize, b: usize) -> (&mut [f32], &mut [f32]) {
        if self.0.len() < a + b {
            self.0.resize(a + b, 0.0);
        }
        let (x, y) = self.0.split_at_mut(a);
        (x, &mut y[..b])
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = const { std::cell::RefCell::new(Scratch(Vec::new())) };
}

/// The output of a matmul shared by its tasks, each of which writes its own elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: the tasks sharing an `OutPtr` write disjoint elements (see the callers), and the buffer outlives them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Writes `block` (output columns `o0..o0 + rows` of an `[m, n]` product, computed transposed as
    /// `[rows, m]`) into that product, which starts at element `base` of the buffer: activation row by
    /// activation row, each writing `rows` consecutive floats.
    ///
    /// # Safety
    /// The product's elements are inside the buffer, and no other thread accesses those columns
    /// concurrently.
    unsafe fn write_columns(self, base: usize, n: usize, o0: usize, m: usize, block: &[f32]) {
        let rows = block.len() / m.max(1);
        for i in 0..m {
            for r in 0..rows {
                // SAFETY: the caller's contract.
                unsafe { *self.0.add(base + i * n + o0 + r) = block[r * m + i] };
            }
        }
    }
}

/// Decodes `n` rows from `o0` into `dst` (`[n, kp]`) on `path`.
fn decode_rows(
    path: SimdPath,
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    n: usize,
    dst: &mut [f32],
) {
    match path {
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 => {
            // SAFETY: Avx512 is only chosen when the CPU has avx512f/bw/vl, avx2 and fma
            // (`SimdPath::available`), and `src`/`dst` hold `n` rows of `chunks` chunks.
            unsafe { x86::decode_rows_avx512(scheme, src, o0, n, dst) }
        }
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => {
            // SAFETY: as above, with avx2 + fma detected.
            unsafe { x86::decode_rows_avx2(scheme, src, o0, n, dst) }
        }
        #[cfg(target_arch = "aarch64")]
        SimdPath::Neon => {
            // SAFETY: `src`/`dst` hold `n` rows of `chunks` chunks.
            unsafe { neon::decode_rows_neon(scheme, src, o0, n, dst) }
        }
        _ => portable::decode_rows(scheme, src, o0, n, dst),
    }
}

/// 4x3 tiles of an f32 panel (`psrc.panel`, rows of `kp` values) against the `m` activation rows of `xp`,
/// written transposed into `out` (`[rows, m]`): the one tiling both the low-bit panel GEMM and the
/// deterministic f32 `x · w^T` use, so both reduce every output in the same fixed order.
fn panel_tiles(
    path: SimdPath,
    psrc: &TileSrc<'_>,
    xp: &[f32],
    kp: usize,
    m: usize,
    out: &mut [f32],
) {
    let rows = out.len() / m;
    let mut i = 0;
    while i < m {
        let mb = (m - i).min(4);
        let xs: [&[f32]; 4] = std::array::from_fn(|j| &xp[(i + j.min(mb - 1)) * kp..][..kp]);
        let xs = &xs[..mb];
        run_rows(path, PANEL, psrc, 0, rows, xs, 3, &mut out[i..], m);
        i += mb;
    }
}

/// Rows `o0..o0 + n` of `src` against the activation rows `xs` (at most 4) in tiles of `ob` rows (the last
/// `n % ob` rows one at a time, `xs.len() * ob <= 12`), into `block[r * stride + i]`. The tile shape only
/// changes the speed: every output is the same fixed-order sum.
#[allow(clippy::too_many_arguments)]
fn run_rows(
    path: SimdPath,
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    n: usize,
    xs: &[&[f32]],
    ob: usize,
    block: &mut [f32],
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if path == SimdPath::Avx512 {
        // SAFETY: Avx512 is only run when the CPU has it (asserted by the public entry points); rows
        // `o0..o0+n` exist and every activation row holds `chunks * 32` floats.
        unsafe { x86::rows_avx512(scheme, src, o0, n, xs, ob, block, stride) };
        return;
    }
    let mut r = 0;
    while r < n {
        let t = if n - r >= ob { ob } else { 1 };
        let mut res = [[0.0f32; 4]; 4];
        match path {
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => {
                // SAFETY: as above, for avx2 + fma.
                unsafe { x86::tile_avx2(scheme, src, o0 + r, xs, t, &mut res) }
            }
            #[cfg(target_arch = "aarch64")]
            SimdPath::Neon => {
                // SAFETY: rows `o0 + r..` exist and every activation row holds `chunks * 32` floats.
                unsafe { neon::tile_neon(scheme, src, o0 + r, xs, t, &mut res) }
            }
            _ => portable::tile(scheme, src, o0 + r, xs, t, &mut res),
        }
        for j in 0..t {
            for (i, row) in res.iter().enumerate().take(xs.len()) {
                block[(r + j) * stride + i] = row[j];
            }
        }
        r += t;
    }
}

/// Runs an `xs.len() x ob` tile as sub-tiles of at most two accumulators (1 x 2 when there is one activation
/// row, else 2 x 1 or 1 x 1), for the paths with room for two accumulators in registers (AVX2, NEON):
/// `run(r, sub, obs, part)` computes output rows `r..r + obs` against the activation rows `sub` into
/// `part[i][j]`, which lands in `res[..][r..]`. The split changes only the speed: every output is the same
/// fixed-order sum.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn in_pair_tiles(
    xs: &[&[f32]],
    ob: usize,
    res: &mut [[f32; 4]; 4],
    mut run: impl FnMut(usize, &[&[f32]], usize, &mut [[f32; 4]; 4]),
) {
    let mb = xs.len();
    assert!((1..=4).contains(&mb) && (1..=4).contains(&ob));
    let mut r = 0;
    while r < ob {
        let obs = if mb == 1 { (ob - r).min(2) } else { 1 };
        let mut i = 0;
        while i < mb {
            let mbs = (mb - i).min(2).min(3 - obs);
            let mut part = [[0.0f32; 4]; 4];
            run(r, &xs[i..i + mbs], obs, &mut part);
            for ii in 0..mbs {
                for rr in 0..obs {
                    res[i + ii][r + rr] = part[ii][rr];
                }
            }
            i += mbs;
        }
        r += obs;
    }
}

/// The fixed lane tree of the module docs.
#[inline]
pub fn reduce_lanes(acc: &[f32; LANES]) -> f32 {
    let mut t = [0.0f32; 16];
    for j in 0..16 {
        t[j] = acc[j] + acc[j + 16];
    }
    let mut n = 8;
    while n >= 1 {
        for j in 0..n {
            t[j] += t[j + n];
        }
        n /= 2;
    }
    t[0]
}

/// The fixed-order dot product of the module docs (`a` and `b` of equal length, zero-padded to 32).
pub fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    for (ca, cb) in a.chunks(LANES).zip(b.chunks(LANES)) {
        for l in 0..ca.len() {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    reduce_lanes(&acc)
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

/// `y[m, out] = x[m, in] · dequant(Q(W))^T` (builds the kernel layout on every call: for tests and one-off
/// products; layers keep a [`KernelWeights`] per weight version).
pub fn lowbit_matmul(w: &QuantizedTensor, x: &[f32], m: usize) -> Vec<f32> {
    KernelWeights::new(w).matmul(x, m)
}

/// The definition, written out plainly: [`dot_lanes`] of the effective activations and
/// [`QuantizedTensor::dequantize_row`]. The kernels must give these bits.
pub fn lowbit_matmul_reference(w: &QuantizedTensor, x: &[f32], m: usize) -> Vec<f32> {
    let (out, inn) = (w.out_features(), w.in_features());
    let xa = effective_activations(w, x, m);
    let mut row = vec![0.0f32; inn];
    let mut y = vec![0.0f32; m * out];
    for o in 0..out {
        w.dequantize_row(o, &mut row);
        for i in 0..m {
            y[i * out + o] = dot_lanes(&xa[i * inn..(i + 1) * inn], &row);
        }
    }
    y
}

/// Scalar decoders shared by the portable path (exactly `dequantize_row`'s arithmetic).
#[inline(always)]
pub(crate) fn decode_int4_nibble(n: u8, s: f32) -> f32 {
    nibble_to_int4(n & 0xF) as f32 * s
}

#[inline(always)]
pub(crate) fn decode_e2m1_nibble(n: u8, s: f32) -> f32 {
    E2M1_VALUES[(n & 0xF) as usize] * s
}

#[inline(always)]
pub(crate) fn decode_fp8(code: u8, s: f32, folded: bool) -> f32 {
    if folded {
        let bits = ((code as u32 & 0x80) << 24) | ((code as u32 & 0x7F) << 20);
        f32::from_bits(bits) * s
    } else {
        e4m3_to_f32(code) * s
    }
}

/// `y[b] = x[b] · w[b]^T` for `batch` products of `x: [m, k]` and `w: [n, k]` (row-major, contiguous), each
/// element the fixed 32-lane order of the module docs ([`dot_lanes`] of the two rows), on the panel tiles of
/// the low-bit kernel: the f32 product of deterministic mode when the weight is stored `[out, in]` (a tied
/// lm_head, attention's `Q K^T`). Batch-invariant like every product here.
pub fn f32_matmul_nt(x: &[f32], w: &[f32], batch: usize, m: usize, k: usize, n: usize) -> Vec<f32> {
    f32_matmul_nt_on(SimdPath::detect(), x, w, batch, m, k, n)
}

/// [`f32_matmul_nt`] on a given path.
pub fn f32_matmul_nt_on(
    path: SimdPath,
    x: &[f32],
    w: &[f32],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    assert!(
        path.is_available(),
        "SIMD path {} is not available on this machine",
        path.name()
    );
    assert_eq!(x.len(), batch * m * k, "x must be [batch, m, k]");
    assert_eq!(w.len(), batch * n * k, "w must be [batch, n, k]");
    let mut y = vec![0.0f32; batch * m * n];
    if m == 0 || n == 0 {
        return y;
    }
    let kp = k.div_ceil(LANES) * LANES;
    fn pad(src: &[f32], rows: usize, k: usize, kp: usize) -> std::borrow::Cow<'_, [f32]> {
        if kp == k {
            std::borrow::Cow::Borrowed(src)
        } else {
            let mut p = vec![0.0f32; rows * kp];
            pad_rows_into(&mut p, src, k, kp);
            std::borrow::Cow::Owned(p)
        }
    }
    // Output rows `o0..o0+rows` of product `b`, transposed (`[rows, m]`).
    let block = |xp: &[f32], wp: &[f32], o0: usize, yt: &mut [f32]| {
        let rows = yt.len() / m;
        let psrc = TileSrc {
            codes: &[],
            row_bytes: 0,
            panel: &wp[o0 * kp..(o0 + rows) * kp],
            scales: &[],
            seg_chunks: (kp / LANES).max(1),
            scale_row_div: 1,
            scale_row_stride: 0,
            chunks: kp / LANES,
            unfolded: false,
        };
        panel_tiles(path, &psrc, xp, kp, m, yt);
    };
    let parallel = batch * m * n * kp >= PARALLEL_MIN_WORK / 4;
    let out = OutPtr(y.as_mut_ptr());
    // Output rows `o0..o0+rows` of product `b`, computed transposed into a task-local block and written to
    // their own columns of `y` by the task itself (a large product, the tied lm_head at a decode step, used
    // to transpose its whole `[n, m]` result on one thread after the parallel tiles).
    let rows_of = |b: usize, xp: &[f32], wp: &[f32], o0: usize, rows: usize| {
        let mut yt = vec![0.0f32; rows * m];
        block(xp, wp, o0, &mut yt);
        // SAFETY: `y` holds batch * m * n elements and outlives the tasks; columns o0.. < n of product
        // b belong to this task alone.
        unsafe { out.write_columns(b * m * n, n, o0, m, &yt) };
    };
    // One product: rows of `w` split over tasks when it is alone and large.
    let one = |b: usize| {
        let xp = AlignedRows::of(&x[b * m * k..(b + 1) * m * k], m, k, kp);
        let wp = pad(&w[b * n * k..(b + 1) * n * k], n, k, kp);
        if parallel && batch == 1 {
            (0..n.div_ceil(PANEL_ROWS)).into_par_iter().for_each(|t| {
                let o0 = t * PANEL_ROWS;
                rows_of(b, &xp, &wp, o0, PANEL_ROWS.min(n - o0));
            });
        } else {
            rows_of(b, &xp, &wp, 0, n);
        }
    };
    if parallel && batch > 1 {
        (0..batch).into_par_iter().for_each(one);
    } else {
        (0..batch).for_each(one);
    }
    y
}

/// The definition of [`f32_matmul_nt`]: [`dot_lanes`] of every pair of rows.
pub fn f32_matmul_nt_reference(
    x: &[f32],
    w: &[f32],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let mut y = vec![0.0f32; batch * m * n];
    for b in 0..batch {
        for i in 0..m {
            for o in 0..n {
                y[b * m * n + i * n + o] = dot_lanes(
                    &x[b * m * k + i * k..b * m * k + (i + 1) * k],
                    &w[b * n * k + o * k..b * n * k + (o + 1) * k],
                );
            }
        }
    }
    y
}
