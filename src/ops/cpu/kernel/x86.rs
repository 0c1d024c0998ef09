//! The x86_64 paths: AVX-512 (16-lane registers, two per 32-lane accumulator) and AVX2 (8 lanes, four per
//! accumulator). Both compute exactly the arithmetic of the module docs: lane `l` of a chunk is column
//! `32c + l`, one fused multiply-add per weight, and the lane tree `t16[j] = acc[j] + acc[j+16]`, ...
//!
//! Every function here is `unsafe` because it is compiled for CPU features the caller must have checked
//! (`SimdPath::available`); the memory accesses stay inside the slices of [`TileSrc`] and the activation
//! rows (each `chunks * 32` long), which the callers guarantee and the debug assertions check.

// The AVX-512 intrinsics are stable since Rust 1.89; the crate's declared rust-version (1.85) is below what
// its dependencies need anyway (burn 0.22.1 requires 1.95).
#![allow(clippy::incompatible_msrv)]

use std::arch::x86_64::*;

use super::{
    nibble_table, nibbles, scales_per_chunk, TileSrc, FP8, FP8_BITS, INT4, INT8, LANES, MXFP4,
    NVFP4, PANEL,
};

/// Where the tiles' software prefetches put the codes to come: in L2 (`T1`), not L1 (`T0`). A cold GEMV
/// streams about 17 GB/s per core, which at ~100 ns of DRAM latency is some 30 lines in flight per core;
/// a prefetch into L1 likely holds one of the core's few L1 miss buffers until its line arrives, and with
/// `T0` the int4 GEMV ran well short of the bandwidth probe while its warm (L3) time was lower. Measured
/// on a 2-core Zen 4, alternating binaries, cold 4096 x 4096, m = 1, medians of 400 calls: int4-g128
/// 0.315-0.317 -> 0.275-0.281 ms (`T2` the same as `T1`), fp8-b128 0.553-0.557 -> 0.511-0.517 ms. (int8,
/// read one row at a time, already streams at the probe's bandwidth and gained nothing from a prefetch.)
const CODE_PREFETCH: i32 = _MM_HINT_T1;
/// How many tiles ahead the int4 tiles prefetch their codes (1 to 4 measured alike with [`CODE_PREFETCH`]).
const INT4_PREFETCH_TILES: usize = 2;

// ------------------------------------------------------------------------------------------------
// AVX-512
// ------------------------------------------------------------------------------------------------

/// Per-row state of a scale segment, for the low and the high 16 lanes of a chunk: the 4-bit table (int4
/// or E2M1) times the scale, or the broadcast scale. Only nvfp4 has two scales per chunk (one per 16
/// columns); the others use one for both halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn prep512<const S: u8>(row_scales: &[f32], seg: usize) -> [__m512; 2] {
    if S == PANEL {
        return [_mm512_setzero_ps(); 2];
    }
    if nibbles(S) {
        // SAFETY: the table has 16 f32.
        let table = unsafe { _mm512_loadu_ps(nibble_table(S).as_ptr()) };
        if S == NVFP4 {
            return [
                _mm512_mul_ps(table, _mm512_set1_ps(row_scales[2 * seg])),
                _mm512_mul_ps(table, _mm512_set1_ps(row_scales[2 * seg + 1])),
            ];
        }
        let t = _mm512_mul_ps(table, _mm512_set1_ps(row_scales[seg]));
        return [t, t];
    }
    let s = _mm512_set1_ps(row_scales[seg]);
    [s, s]
}

/// The 32 decoded weights of chunk `c` of row `o`, lanes 0..16 and 16..32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn decode512<const S: u8>(
    src: &TileSrc<'_>,
    o: usize,
    c: usize,
    prep: [__m512; 2],
) -> [__m512; 2] {
    // SAFETY (all arms): the caller guarantees row `o` exists and `c < chunks`, so the 16 (int4), 32
    // (int8/fp8) bytes or 32 floats (panel) read here lie inside `codes` / `panel`.
    unsafe {
        match S {
            PANEL => {
                let p = src.panel.as_ptr().add(o * src.chunks * LANES + c * LANES);
                [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))]
            }
            INT4 | NVFP4 | MXFP4 => {
                // The row's nibbles sit at bits 8r.. of each word of the group's line; the table lookup
                // reads the low four bits of each index.
                // Shift counts from the row's place in its group (no branch; loop-invariant per row).
                let (at, sh) = src.int4_line(o, c);
                let v = _mm512_load_si512(src.codes.as_ptr().add(at) as *const _);
                let lo = _mm512_srl_epi32(v, _mm_cvtsi32_si128(sh as i32));
                let hi = _mm512_srl_epi32(v, _mm_cvtsi32_si128(sh as i32 + 4));
                [
                    _mm512_permutexvar_ps(lo, prep[0]),
                    _mm512_permutexvar_ps(hi, prep[1]),
                ]
            }
            INT8 => {
                let p = src.codes.as_ptr().add(o * src.row_bytes + c * LANES);
                let a = _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i));
                let b = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16) as *const __m128i));
                [
                    _mm512_mul_ps(_mm512_cvtepi32_ps(a), prep[0]),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(b), prep[0]),
                ]
            }
            _ => {
                debug_assert_eq!(S, FP8);
                let p = src.codes.as_ptr().add(o * src.row_bytes + c * LANES);
                // Sign-extended code << 20: sign copies in bits 27..31, magnitude in bits 20..26; keeping bit 31
                // and bits 20..26 gives the f32 whose value is the fp8 value times 2^-120 (the fold of the
                // scale). One shift instead of three: the shifts and widenings share two pipes on Zen 4.
                let mask = _mm512_set1_epi32(FP8_BITS);
                // (A macro, not a closure: closures do not inherit the target features.)
                macro_rules! f {
                    ($at:expr) => {
                        _mm512_mul_ps(
                            _mm512_castsi512_ps(_mm512_and_si512(
                                _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                    $at as *const __m128i,
                                ))),
                                mask,
                            )),
                            prep[0],
                        )
                    };
                }
                [f!(p), f!(p.add(16))]
            }
        }
    }
}

/// Bytes of codes per 32-column chunk.
const fn code_bytes<const S: u8>() -> usize {
    if nibbles(S) {
        16
    } else {
        32
    }
}

/// The lane tree of the module docs on a 32-lane accumulator held as two registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn reduce512(a: [__m512; 2]) -> f32 {
    let t16 = _mm512_add_ps(a[0], a[1]);
    let t8 = _mm256_add_ps(
        _mm512_castps512_ps256(t16),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(t16))),
    );
    let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
    let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps::<1>(t2, t2)))
}

/// The lane tree of the module docs for up to 16 accumulators at once: `t16 = a[0] + a[1]` per accumulator,
/// then the tree's later levels on 16 accumulators side by side (each level pairs exactly the lanes the
/// one-accumulator tree pairs: `t8[j] = t16[j] + t16[j+8]`, `t4[j] = t8[j] + t8[j+4]`, ...), moving
/// lanes with shuffles between levels. About 60 instructions for 16 sums instead of 9 per sum: a 4x3 tile
/// over K = 768 spends a tenth of its time in the trees, and the attention scores (K = head_dim = 64) most.
/// Returns the sums in accumulator order (unused accumulators: zero).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn reduce16_512(a: &[[__m512; 2]]) -> [f32; 16] {
    debug_assert!(a.len() <= 16);
    // (Plain loops, not closures: a closure does not inherit this function's target features, so its
    // intrinsics would become calls.)
    let mut v = [_mm512_setzero_ps(); 16];
    for k in 0..a.len() {
        v[k] = _mm512_add_ps(a[k][0], a[k][1]);
    }
    // t8 of accumulators 2p (lanes 0..8) and 2p+1 (lanes 8..16).
    // Each level only over the pairs that hold accumulators (the rest stay zero).
    let k = a.len();
    let mut w = [_mm512_setzero_ps(); 8];
    for p in 0..k.div_ceil(2) {
        let (x, y) = (v[2 * p], v[2 * p + 1]);
        w[p] = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        );
    }
    // t4 of four accumulators, one per 128-bit quarter.
    let mut u = [_mm512_setzero_ps(); 4];
    for p in 0..k.div_ceil(4) {
        let (x, y) = (w[2 * p], w[2 * p + 1]);
        u[p] = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        );
    }
    // t2 of eight accumulators, two lanes each.
    let mut t = [_mm512_setzero_ps(); 2];
    for p in 0..k.div_ceil(8) {
        let (x, y) = (u[2 * p], u[2 * p + 1]);
        t[p] = _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
            _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
        );
    }
    let y = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(t[0], t[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(t[0], t[1]),
    );
    let mut lanes = [0.0f32; 16];
    // SAFETY: `lanes` holds 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), y) };
    // Lane 4 (k % 4) + k / 4 holds accumulator k.
    let mut out = [0.0f32; 16];
    for (k, o) in out.iter_mut().enumerate() {
        *o = lanes[4 * (k % 4) + k / 4];
    }
    out
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn tile512<const S: u8, const MB: usize, const OB: usize>(
    src: &TileSrc<'_>,
    o0: usize,
    xs: &[&[f32]],
    res: &mut [[f32; 4]; 4],
) {
    let zero = _mm512_setzero_ps();
    let mut acc = [[[zero; 2]; OB]; MB];
    let mut prep = [[zero; 2]; OB];
    let xp: [*const f32; MB] = std::array::from_fn(|i| xs[i].as_ptr());
    let rows: [&[f32]; OB] = if S == PANEL {
        [&[]; OB]
    } else {
        std::array::from_fn(|r| src.scale_row(o0 + r))
    };
    // Software prefetch of the next tile (rows o0 + OB..): a tile's codes are short streams (fp8: one 4 KB
    // stream per row at K = 4096; int4: one line per chunk for a group of four rows), and the hardware prefetcher
    // learns a new stream only after its first misses, so without this every tile starts with demand misses
    // and the decoding waits for DRAM. Prefetching the same chunk of the next tile keeps those lines on their
    // way. (4096 x 4096 int4 GEMV, cold, 2 cores, row-major int4 layout of the time: g32 0.68 -> 0.58 ms, g128
    // 0.58 -> 0.45 ms.) The int4 tiles prefetch a tile further ahead, and all code prefetches go to L2
    // ([`CODE_PREFETCH`]). A prefetch never faults; past the end it is a no-op.
    let next_codes = OB * src.row_bytes;
    let next_scales = if nibbles(S) {
        OB * src.scale_row_stride
    } else {
        0
    };
    // One chunk: prefetch, activations, then one row's weights at a time into every activation row's sums
    // (only two decoded registers live at once; decoding every row first spilled at 2x4 tiles).
    // A four-row int4 tile that starts a group reads one line per chunk for all its rows.
    let group_tile = nibbles(S) && o0.is_multiple_of(super::INT4_ROWS);
    // One row's 32 decoded weights `w` into every activation row's sums (`xv`: the chunk's activations).
    macro_rules! accumulate {
        ($xv:ident, $r:expr, $w:expr) => {{
            let (r, w) = ($r, $w);
            for i in 0..MB {
                acc[i][r][0] = _mm512_fmadd_ps($xv[i][0], w[0], acc[i][r][0]);
                acc[i][r][1] = _mm512_fmadd_ps($xv[i][1], w[1], acc[i][r][1]);
            }
        }};
    }
    macro_rules! chunk {
        ($c:expr) => {{
            let c = $c;
            if nibbles(S) {
                // A later tile's line of this chunk (a group of four rows).
                let (at, _) = src.int4_line(o0 + INT4_PREFETCH_TILES * OB, c);
                _mm_prefetch::<CODE_PREFETCH>(src.codes.as_ptr().wrapping_add(at) as *const i8);
            } else if S == FP8 && c % (64 / code_bytes::<S>()) == 0 {
                for r in 0..OB {
                    let at = (o0 + r) * src.row_bytes + c * code_bytes::<S>() + next_codes;
                    _mm_prefetch::<CODE_PREFETCH>(src.codes.as_ptr().wrapping_add(at) as *const i8);
                }
            }
            let mut xv = [[zero; 2]; MB];
            for (i, v) in xv.iter_mut().enumerate() {
                // SAFETY: each activation row has chunks * 32 floats.
                *v = unsafe {
                    let p = xp[i].add(c * LANES);
                    [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))]
                };
            }
            if nibbles(S) && OB == super::INT4_ROWS && group_tile {
                // The tile is one int4 group: one aligned line holds the chunk of all four rows, each row's
                // nibbles at a fixed bit offset (immediate shifts).
                let (at, _) = src.int4_line(o0, c);
                // SAFETY: the group's line of chunk c lies inside `codes` (rows o0..o0+4 exist, padded).
                let v = unsafe { _mm512_load_si512(src.codes.as_ptr().add(at) as *const _) };
                macro_rules! row {
                    ($r:literal, $lo:expr, $hi:expr) => {
                        accumulate!(
                            xv,
                            $r,
                            [
                                _mm512_permutexvar_ps($lo, prep[$r][0]),
                                _mm512_permutexvar_ps($hi, prep[$r][1]),
                            ]
                        )
                    };
                }
                row!(0, v, _mm512_srli_epi32::<4>(v));
                row!(1, _mm512_srli_epi32::<8>(v), _mm512_srli_epi32::<12>(v));
                row!(2, _mm512_srli_epi32::<16>(v), _mm512_srli_epi32::<20>(v));
                row!(3, _mm512_srli_epi32::<24>(v), _mm512_srli_epi32::<28>(v));
            } else {
                for r in 0..OB {
                    // SAFETY: row o0 + r < out and c < chunks (the caller's contract).
                    let w = unsafe { decode512::<S>(src, o0 + r, c, prep[r]) };
                    accumulate!(xv, r, w);
                }
            }
        }};
    }
    if S != PANEL && src.seg_chunks == 1 {
        // One scale segment per chunk (int4-g32, nvfp4, mxfp4): one loop, the scale step inlined. The
        // next tile's scales are prefetched a line (16 f32) at a time: every 16 chunks for one scale per
        // chunk, every 8 for nvfp4's two (prefetching every 16 left its second line to a demand miss).
        for c in 0..src.chunks {
            if nibbles(S) && c % (16 / scales_per_chunk(S)) == 0 {
                for row in &rows {
                    _mm_prefetch::<_MM_HINT_T0>(
                        row.as_ptr()
                            .wrapping_add(next_scales + c * scales_per_chunk(S))
                            as *const i8,
                    );
                }
            }
            for (r, p) in prep.iter_mut().enumerate() {
                // SAFETY: same features as this function.
                *p = unsafe { prep512::<S>(rows[r], c) };
            }
            chunk!(c);
        }
    } else {
        let (mut c, mut seg) = (0, 0);
        while c < src.chunks {
            if nibbles(S) && seg % 16 == 0 {
                for row in &rows {
                    _mm_prefetch::<_MM_HINT_T0>(
                        row.as_ptr().wrapping_add(next_scales + seg) as *const i8
                    );
                }
            }
            for (r, p) in prep.iter_mut().enumerate() {
                // SAFETY: same features as this function.
                *p = unsafe { prep512::<S>(rows[r], seg) };
            }
            seg += 1;
            let end = (c + src.seg_chunks).min(src.chunks);
            while c < end {
                chunk!(c);
                c += 1;
            }
        }
    }
    if MB * OB >= 4 {
        let mut flat = [[zero; 2]; 16];
        for k in 0..MB * OB {
            flat[k] = acc[k / OB][k % OB];
        }
        // SAFETY: same features as this function.
        let sums = unsafe { reduce16_512(&flat[..MB * OB]) };
        for i in 0..MB {
            for r in 0..OB {
                res[i][r] = sums[i * OB + r];
            }
        }
    } else {
        for i in 0..MB {
            for r in 0..OB {
                // SAFETY: same features as this function.
                res[i][r] = unsafe { reduce512(acc[i][r]) };
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn decode_rows512<const S: u8>(src: &TileSrc<'_>, o0: usize, n: usize, dst: &mut [f32]) {
    let kp = src.chunks * LANES;
    assert!(dst.len() >= n * kp);
    for r in 0..n {
        let row = src.scale_row(o0 + r);
        for (seg, chunks) in src.segments() {
            // SAFETY: same features as this function.
            let prep = unsafe { prep512::<S>(row, seg) };
            for c in chunks {
                // SAFETY: row o0 + r exists, c < chunks, and dst has n rows of kp floats (asserted).
                unsafe {
                    let w = decode512::<S>(src, o0 + r, c, prep);
                    let p = dst.as_mut_ptr().add(r * kp + c * LANES);
                    _mm512_storeu_ps(p, w[0]);
                    _mm512_storeu_ps(p.add(16), w[1]);
                }
            }
        }
    }
}

/// # Safety
/// The CPU has avx512f/bw/vl, avx2 and fma; rows `o0..o0+n` exist in `src`.
pub(super) unsafe fn decode_rows_avx512(
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    n: usize,
    dst: &mut [f32],
) {
    src.debug_check(scheme, o0 + n, &[]);
    // SAFETY: forwarded contract.
    unsafe { by_scheme!(decode_rows512, scheme, (src, o0, n, dst)) }
}

/// Tile shapes with a dedicated AVX-512 kernel: `MB * OB <= 12` accumulators (24 registers).
macro_rules! tile_shapes {
    ($f:ident, $s:ident, $mb:expr, $ob:expr, $args:tt) => {
        match ($mb, $ob) {
            (1, 1) => tile_shapes!(@call $f, $s, 1, 1, $args),
            (1, 2) => tile_shapes!(@call $f, $s, 1, 2, $args),
            (1, 3) => tile_shapes!(@call $f, $s, 1, 3, $args),
            (1, 4) => tile_shapes!(@call $f, $s, 1, 4, $args),
            (2, 1) => tile_shapes!(@call $f, $s, 2, 1, $args),
            (2, 2) => tile_shapes!(@call $f, $s, 2, 2, $args),
            (2, 3) => tile_shapes!(@call $f, $s, 2, 3, $args),
            (2, 4) => tile_shapes!(@call $f, $s, 2, 4, $args),
            (3, 1) => tile_shapes!(@call $f, $s, 3, 1, $args),
            (3, 2) => tile_shapes!(@call $f, $s, 3, 2, $args),
            (3, 3) => tile_shapes!(@call $f, $s, 3, 3, $args),
            (4, 1) => tile_shapes!(@call $f, $s, 4, 1, $args),
            (4, 2) => tile_shapes!(@call $f, $s, 4, 2, $args),
            (4, 3) => tile_shapes!(@call $f, $s, 4, 3, $args),
            _ => unreachable!("tile shape"),
        }
    };
    (@call $f:ident, $s:ident, $mb:literal, $ob:literal, ($($a:expr),*)) => {
        $f::<$s, $mb, $ob>($($a),*)
    };
}

/// Rows `o0..o0 + n` against the activation rows `xs` (`MB` of them) in tiles of `OB` rows (the last
/// `n % OB` rows one at a time), into `block[r * stride + i]`: the whole row range in one call, so the
/// tiles skip the per-tile dispatch (an expert's projection is only 12 or 24 chunks deep, and the dispatch
/// cost a fair share of each tile).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn rows512<const S: u8, const MB: usize, const OB: usize>(
    src: &TileSrc<'_>,
    o0: usize,
    n: usize,
    xs: &[&[f32]],
    block: &mut [f32],
    stride: usize,
) {
    assert!(xs.len() == MB && stride >= MB && (n == 0 || block.len() >= (n - 1) * stride + MB));
    let mut r = 0;
    let mut res = [[0.0f32; 4]; 4];
    while r < n {
        // SAFETY: rows o0 + r .. o0 + r + ob exist (the caller's contract), same features.
        let ob = if n - r >= OB {
            unsafe { tile512::<S, MB, OB>(src, o0 + r, xs, &mut res) };
            OB
        } else {
            unsafe { tile512::<S, MB, 1>(src, o0 + r, xs, &mut res) };
            1
        };
        for j in 0..ob {
            for (i, row) in res.iter().enumerate().take(MB) {
                block[(r + j) * stride + i] = row[j];
            }
        }
        r += ob;
    }
}

/// [`rows512`] for a run-time scheme and tile shape (`mb * ob <= 12`), into `block[r * stride + i]`.
///
/// # Safety
/// The CPU has avx512f/bw/vl, avx2 and fma; rows `o0..o0+n` exist in `src`; every activation row holds
/// `chunks * 32` floats.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows_avx512(
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    n: usize,
    xs: &[&[f32]],
    ob: usize,
    block: &mut [f32],
    stride: usize,
) {
    src.debug_check(scheme, o0 + n, xs);
    let mb = xs.len();
    assert!((1..=4).contains(&mb) && (1..=4).contains(&ob) && mb * ob <= 12);
    // SAFETY: forwarded contract.
    unsafe {
        match scheme {
            INT4 => tile_shapes!(rows512, INT4, mb, ob, (src, o0, n, xs, block, stride)),
            NVFP4 => tile_shapes!(rows512, NVFP4, mb, ob, (src, o0, n, xs, block, stride)),
            MXFP4 => tile_shapes!(rows512, MXFP4, mb, ob, (src, o0, n, xs, block, stride)),
            INT8 => tile_shapes!(rows512, INT8, mb, ob, (src, o0, n, xs, block, stride)),
            FP8 => tile_shapes!(rows512, FP8, mb, ob, (src, o0, n, xs, block, stride)),
            _ => tile_shapes!(rows512, PANEL, mb, ob, (src, o0, n, xs, block, stride)),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// AVX2
// ------------------------------------------------------------------------------------------------

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn int4_lanes256(v: __m256i, shift: u32, s: __m256) -> (__m256, __m256) {
    // The row's nibbles at bits `shift..shift + 4` (low) and `shift + 4..shift + 8` (high) of each word,
    // sign-extended: (v << (28 - shift)) >> 28 arithmetic, and (v << (24 - shift)) >> 28.
    let lo = _mm256_srai_epi32::<28>(_mm256_sllv_epi32(v, _mm256_set1_epi32(28 - shift as i32)));
    let hi = _mm256_srai_epi32::<28>(_mm256_sllv_epi32(v, _mm256_set1_epi32(24 - shift as i32)));
    (
        _mm256_mul_ps(_mm256_cvtepi32_ps(lo), s),
        _mm256_mul_ps(_mm256_cvtepi32_ps(hi), s),
    )
}

/// E2M1 nibbles of the row at bit `shift` of each word of `v`: the low nibbles (lanes of the chunk's first
/// 16 columns) decoded with `t[0]`, the high ones with `t[1]`, each the eight magnitudes times the scale.
/// The magnitude is a lookup by the nibble's low three bits (`permutevar8x32` reads only those), the sign
/// bit is moved to bit 31 and applied by xor: `-(m * s) == (-m) * s` exactly, `-0.0` for code 8.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn e2m1_lanes256(v: __m256i, shift: u32, t: [__m256; 2]) -> (__m256, __m256) {
    let sign = _mm256_set1_epi32(i32::MIN);
    // (A macro, not a closure: closures do not inherit the target features.)
    macro_rules! half {
        ($down:expr, $up:expr, $table:expr) => {{
            let index = _mm256_srlv_epi32(v, _mm256_set1_epi32($down));
            let magnitude = _mm256_permutevar8x32_ps($table, index);
            let s = _mm256_and_si256(_mm256_sllv_epi32(v, _mm256_set1_epi32($up)), sign);
            _mm256_xor_ps(magnitude, _mm256_castsi256_ps(s))
        }};
    }
    (
        half!(shift as i32, 28 - shift as i32, t[0]),
        half!(shift as i32 + 4, 24 - shift as i32, t[1]),
    )
}

/// Per-row state of a scale segment on AVX2, for the low and the high 16 lanes of a chunk: the eight E2M1
/// magnitudes times the scale (nvfp4: one scale per half, mxfp4 one for both), or the broadcast scale.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn prep256<const S: u8>(row_scales: &[f32], seg: usize) -> [__m256; 2] {
    if S == PANEL {
        return [_mm256_setzero_ps(); 2];
    }
    if S == NVFP4 || S == MXFP4 {
        // SAFETY: E2M1_VALUES has 16 f32, the first eight the magnitudes.
        let table = unsafe { _mm256_loadu_ps(super::E2M1_VALUES.as_ptr()) };
        let (lo, hi) = if S == NVFP4 {
            (row_scales[2 * seg], row_scales[2 * seg + 1])
        } else {
            (row_scales[seg], row_scales[seg])
        };
        return [
            _mm256_mul_ps(table, _mm256_set1_ps(lo)),
            _mm256_mul_ps(table, _mm256_set1_ps(hi)),
        ];
    }
    let s = _mm256_set1_ps(row_scales[seg]);
    [s, s]
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fp8_lanes256(v: __m256i, s: __m256) -> __m256 {
    // `v` holds sign-extended codes (see FP8_BITS).
    let bits = _mm256_and_si256(_mm256_slli_epi32::<20>(v), _mm256_set1_epi32(FP8_BITS));
    _mm256_mul_ps(_mm256_castsi256_ps(bits), s)
}

/// The 32 decoded weights of chunk `c` of row `o` as four registers (lanes 0..8, 8..16, 16..24, 24..32).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode256<const S: u8>(
    src: &TileSrc<'_>,
    o: usize,
    c: usize,
    prep: [__m256; 2],
) -> [__m256; 4] {
    let s = prep[0];
    // SAFETY (all arms): row `o` exists and `c < chunks` (the caller's contract), so the bytes / floats
    // read lie inside `codes` / `panel`.
    unsafe {
        match S {
            PANEL => {
                let p = src.panel.as_ptr().add(o * src.chunks * LANES + c * LANES);
                [
                    _mm256_loadu_ps(p),
                    _mm256_loadu_ps(p.add(8)),
                    _mm256_loadu_ps(p.add(16)),
                    _mm256_loadu_ps(p.add(24)),
                ]
            }
            INT4 => {
                let (at, shift) = src.int4_line(o, c);
                let p = src.codes.as_ptr().add(at);
                let v0 = _mm256_loadu_si256(p as *const __m256i);
                let v1 = _mm256_loadu_si256(p.add(32) as *const __m256i);
                let (lo0, hi0) = int4_lanes256(v0, shift, s);
                let (lo1, hi1) = int4_lanes256(v1, shift, s);
                [lo0, lo1, hi0, hi1]
            }
            NVFP4 | MXFP4 => {
                let (at, shift) = src.int4_line(o, c);
                let p = src.codes.as_ptr().add(at);
                let v0 = _mm256_loadu_si256(p as *const __m256i);
                let v1 = _mm256_loadu_si256(p.add(32) as *const __m256i);
                let (lo0, hi0) = e2m1_lanes256(v0, shift, prep);
                let (lo1, hi1) = e2m1_lanes256(v1, shift, prep);
                [lo0, lo1, hi0, hi1]
            }
            INT8 => {
                let p = src.codes.as_ptr().add(o * src.row_bytes + c * LANES);
                // (Macros, not `array::from_fn` closures: closures do not inherit the target features.)
                macro_rules! q {
                    ($q:expr) => {
                        _mm256_mul_ps(
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                p.add(8 * $q) as *const __m128i,
                            ))),
                            s,
                        )
                    };
                }
                [q!(0), q!(1), q!(2), q!(3)]
            }
            _ => {
                debug_assert_eq!(S, FP8);
                let p = src.codes.as_ptr().add(o * src.row_bytes + c * LANES);
                macro_rules! q {
                    ($q:expr) => {
                        fp8_lanes256(
                            _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * $q) as *const __m128i)),
                            s,
                        )
                    };
                }
                [q!(0), q!(1), q!(2), q!(3)]
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce256(a: [__m256; 4]) -> f32 {
    // t16 = (a0 + a2, a1 + a3); t8 = t16[0..8] + t16[8..16]; then 8 -> 4 -> 2 -> 1.
    let t8 = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
    let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
    let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps::<1>(t2, t2)))
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tile256<const S: u8, const MB: usize, const OB: usize>(
    src: &TileSrc<'_>,
    o0: usize,
    xs: &[&[f32]],
    res: &mut [[f32; 4]; 4],
) {
    let zero = _mm256_setzero_ps();
    let mut acc = [[[zero; 4]; OB]; MB];
    let mut sc = [[zero; 2]; OB];
    let xp: [*const f32; MB] = std::array::from_fn(|i| xs[i].as_ptr());
    let rows: [&[f32]; OB] = if S == PANEL {
        [&[]; OB]
    } else {
        std::array::from_fn(|r| src.scale_row(o0 + r))
    };
    let (mut c, mut seg) = (0, 0);
    while c < src.chunks {
        if S != PANEL {
            for (r, s) in sc.iter_mut().enumerate() {
                // SAFETY: same features as this function.
                *s = unsafe { prep256::<S>(rows[r], seg) };
            }
        }
        seg += 1;
        let end = (c + src.seg_chunks).min(src.chunks);
        while c < end {
            // The codes to come, into L2 (as `tile512` does): int4 the line of this chunk
            // `INT4_PREFETCH_TILES` groups of four rows ahead, fp8 the rows after the tile.
            if nibbles(S) {
                let ahead = o0 + INT4_PREFETCH_TILES * super::INT4_ROWS;
                let (at, _) = src.int4_line(ahead, c);
                _mm_prefetch::<CODE_PREFETCH>(src.codes.as_ptr().wrapping_add(at) as *const i8);
            } else if S == FP8 && c % 2 == 0 {
                for r in 0..OB {
                    let at = (o0 + OB + r) * src.row_bytes + c * LANES;
                    _mm_prefetch::<CODE_PREFETCH>(src.codes.as_ptr().wrapping_add(at) as *const i8);
                }
            }
            let mut w = [[zero; 4]; OB];
            for r in 0..OB {
                // SAFETY: row o0 + r < out and c < chunks (the caller's contract).
                w[r] = unsafe { decode256::<S>(src, o0 + r, c, sc[r]) };
            }
            for i in 0..MB {
                for q in 0..4 {
                    // SAFETY: each activation row has chunks * 32 floats.
                    let x = unsafe { _mm256_loadu_ps(xp[i].add(c * LANES + 8 * q)) };
                    for r in 0..OB {
                        acc[i][r][q] = _mm256_fmadd_ps(x, w[r][q], acc[i][r][q]);
                    }
                }
            }
            c += 1;
        }
    }
    for i in 0..MB {
        for r in 0..OB {
            // SAFETY: same features as this function.
            res[i][r] = unsafe { reduce256(acc[i][r]) };
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn decode_rows256<const S: u8>(src: &TileSrc<'_>, o0: usize, n: usize, dst: &mut [f32]) {
    let kp = src.chunks * LANES;
    assert!(dst.len() >= n * kp);
    for r in 0..n {
        let row = src.scale_row(o0 + r);
        for (seg, chunks) in src.segments() {
            // SAFETY: same features as this function.
            let s = unsafe { prep256::<S>(row, seg) };
            for c in chunks {
                // SAFETY: row o0 + r exists, c < chunks, and dst has n rows of kp floats (asserted).
                unsafe {
                    let w = decode256::<S>(src, o0 + r, c, s);
                    let p = dst.as_mut_ptr().add(r * kp + c * LANES);
                    for (q, v) in w.iter().enumerate() {
                        _mm256_storeu_ps(p.add(8 * q), *v);
                    }
                }
            }
        }
    }
}

/// # Safety
/// The CPU has avx2 and fma; rows `o0..o0+n` exist in `src`.
pub(super) unsafe fn decode_rows_avx2(
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    n: usize,
    dst: &mut [f32],
) {
    src.debug_check(scheme, o0 + n, &[]);
    // SAFETY: forwarded contract.
    unsafe { by_scheme!(decode_rows256, scheme, (src, o0, n, dst)) }
}

/// # Safety
/// The CPU has avx2 and fma (checked by the caller through `SimdPath::available`).
pub(super) unsafe fn tile_avx2(
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    xs: &[&[f32]],
    ob: usize,
    res: &mut [[f32; 4]; 4],
) {
    src.debug_check(scheme, o0 + ob, xs);
    // 16 registers: at most two 4-register accumulators per kernel (1x2 or 2x1); larger tiles are split.
    super::in_pair_tiles(xs, ob, res, |o, sub, obs, part| {
        // SAFETY: forwarded contract (rows o..o + obs of the tile, `sub` a part of `xs`).
        unsafe { pair_tile!(tile256, scheme, sub.len(), obs, (src, o0 + o, sub, part)) }
    });
}
