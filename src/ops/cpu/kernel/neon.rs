//! The aarch64 path: NEON (Advanced SIMD, 4 lanes, so eight registers per 32-lane accumulator). It computes
//! exactly the arithmetic of the module docs, like the x86 paths: lane `l` of a chunk is column `32c + l`,
//! one fused multiply-add (`fmla`) per weight, and the lane tree `t16[j] = acc[j] + acc[j+16]`, ...
//! AArch64's Advanced SIMD rounds to nearest-even and keeps subnormals (Linux leaves FPCR.FZ clear), so
//! every operation is the IEEE one the portable path does.
//!
//! The weights decode as the AVX2 path decodes them: an int4 nibble sign-extended by two shifts and
//! converted (`q as f32 * s`, the product the decoding table holds), int8 widened and converted, fp8 by the
//! folding shift of `x86.rs` (`super::FP8_BITS`); E2M1 (nvfp4, mxfp4) by a `vqtbl1q_u8` lookup of twice the
//! magnitude, converted, halved and scaled, the sign xored in ([`e2m1_lanes`]).
//!
//! NEON is part of the aarch64 base ISA, so the path is always available there; the functions are `unsafe`
//! only for their raw loads, which stay inside the slices of [`TileSrc`] and the activation rows (each
//! `chunks * 32` long), as the callers guarantee and the debug assertions check.

use std::arch::aarch64::*;

use super::{TileSrc, FP8, FP8_BITS, INT4, INT8, LANES, MXFP4, NVFP4, PANEL};

/// Twice the eight E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6), as bytes for `vqtbl1q_u8`; the rest 0.
const E2M1_TWICE: [u8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0];

/// The E2M1 nibbles at bit `down` of each 32-bit lane of `v` times `s`: the magnitude by a byte-table lookup
/// of the nibble's low three bits (the other three bytes of a lane index entry 0, which is 0), converted
/// and halved (both exact), times the scale (the one rounding: `(twice * 0.5) * s == value * s`), then the
/// sign bit moved to bit 31 (`up`) and applied by xor: `-(m * s) == (-m) * s`, `-0.0` for code 8.
#[inline(always)]
unsafe fn e2m1_lanes(v: int32x4_t, down: i32, up: i32, s: float32x4_t) -> float32x4_t {
    // SAFETY: register operations; the table is 16 bytes.
    unsafe {
        let table = vld1q_u8(E2M1_TWICE.as_ptr());
        let u = vreinterpretq_u32_s32(v);
        let index = vandq_u32(vshlq_u32(u, vdupq_n_s32(-down)), vdupq_n_u32(7));
        let twice = vreinterpretq_u32_u8(vqtbl1q_u8(table, vreinterpretq_u8_u32(index)));
        let magnitude = vmulq_f32(vmulq_n_f32(vcvtq_f32_u32(twice), 0.5), s);
        let sign = vandq_u32(vshlq_u32(u, vdupq_n_s32(up)), vdupq_n_u32(0x8000_0000));
        vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(magnitude), sign))
    }
}

/// The scales of a segment for the low and the high 16 lanes of a chunk (only nvfp4 has two per chunk).
#[inline(always)]
fn prep128<const S: u8>(row_scales: &[f32], seg: usize) -> [float32x4_t; 2] {
    // SAFETY: NEON is part of the aarch64 base ISA; register operations.
    unsafe {
        if S == PANEL {
            return [vdupq_n_f32(0.0); 2];
        }
        if S == NVFP4 {
            return [
                vdupq_n_f32(row_scales[2 * seg]),
                vdupq_n_f32(row_scales[2 * seg + 1]),
            ];
        }
        let s = vdupq_n_f32(row_scales[seg]);
        [s, s]
    }
}

/// Eight sign-extended int8 codes per register pair, times the scale: 16 codes from `p` into lanes
/// `4q..4q + 4` of `out[q]`, q = 0..4.
#[inline(always)]
unsafe fn widen16(p: *const u8, s: float32x4_t, fp8: bool) -> [float32x4_t; 4] {
    // SAFETY: the caller guarantees 16 readable bytes at `p`.
    let b = unsafe { vld1q_s8(p as *const i8) };
    let (lo, hi) = (vmovl_s8(vget_low_s8(b)), vmovl_high_s8(b));
    let q = [
        vmovl_s16(vget_low_s16(lo)),
        vmovl_high_s16(lo),
        vmovl_s16(vget_low_s16(hi)),
        vmovl_high_s16(hi),
    ];
    q.map(|v| {
        if fp8 {
            let bits = vandq_s32(vshlq_n_s32::<20>(v), vdupq_n_s32(FP8_BITS));
            vmulq_f32(vreinterpretq_f32_s32(bits), s)
        } else {
            vmulq_f32(vcvtq_f32_s32(v), s)
        }
    })
}

/// The 32 decoded weights of chunk `c` of row `o`, lanes `4q..4q + 4` in register `q`.
#[inline(always)]
unsafe fn decode128<const S: u8>(
    src: &TileSrc<'_>,
    o: usize,
    c: usize,
    prep: [float32x4_t; 2],
) -> [float32x4_t; 8] {
    let s = prep[0];
    // SAFETY (all arms): row `o` exists and `c < chunks` (the caller's contract), so the 64 (int4), 32
    // (int8/fp8) bytes or 32 floats (panel) read here lie inside `codes` / `panel`.
    unsafe {
        match S {
            PANEL => {
                let p = src.panel.as_ptr().add(o * src.chunks * LANES + c * LANES);
                std::array::from_fn(|q| vld1q_f32(p.add(4 * q)))
            }
            INT4 => {
                // Word l of the group's line holds the row's nibbles for lanes l (bits shift..shift+4) and
                // l + 16 (the next four bits): sign-extended by (v << (28 - shift)) >> 28 arithmetic, and
                // (v << (24 - shift)) >> 28.
                let (at, shift) = src.int4_line(o, c);
                let p = src.codes.as_ptr().add(at) as *const i32;
                let (up_lo, up_hi) = (
                    vdupq_n_s32(28 - shift as i32),
                    vdupq_n_s32(24 - shift as i32),
                );
                let mut w = [vdupq_n_f32(0.0); 8];
                for q in 0..4 {
                    let v = vld1q_s32(p.add(4 * q));
                    let lo = vshrq_n_s32::<28>(vshlq_s32(v, up_lo));
                    let hi = vshrq_n_s32::<28>(vshlq_s32(v, up_hi));
                    w[q] = vmulq_f32(vcvtq_f32_s32(lo), s);
                    w[q + 4] = vmulq_f32(vcvtq_f32_s32(hi), s);
                }
                w
            }
            NVFP4 | MXFP4 => {
                // As int4: word l holds the row's nibbles for lanes l (bits shift..) and l + 16 (shift + 4..).
                let (at, shift) = src.int4_line(o, c);
                let p = src.codes.as_ptr().add(at) as *const i32;
                let sh = shift as i32;
                let mut w = [vdupq_n_f32(0.0); 8];
                for q in 0..4 {
                    let v = vld1q_s32(p.add(4 * q));
                    w[q] = e2m1_lanes(v, sh, 28 - sh, prep[0]);
                    w[q + 4] = e2m1_lanes(v, sh + 4, 24 - sh, prep[1]);
                }
                w
            }
            _ => {
                debug_assert!(S == INT8 || S == FP8);
                let p = src.codes.as_ptr().add(o * src.row_bytes + c * LANES);
                let a = widen16(p, s, S == FP8);
                let b = widen16(p.add(16), s, S == FP8);
                [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
            }
        }
    }
}

/// The lane tree of the module docs on a 32-lane accumulator held as eight registers.
#[inline(always)]
fn reduce128(a: [float32x4_t; 8]) -> f32 {
    // SAFETY: NEON is part of the aarch64 base ISA; these are register operations.
    unsafe {
        // t16[j] = acc[j] + acc[j + 16]: register q with register q + 4.
        let t16 = [
            vaddq_f32(a[0], a[4]),
            vaddq_f32(a[1], a[5]),
            vaddq_f32(a[2], a[6]),
            vaddq_f32(a[3], a[7]),
        ];
        // t8[j] = t16[j] + t16[j + 8], t4[j] = t8[j] + t8[j + 4].
        let t8 = [vaddq_f32(t16[0], t16[2]), vaddq_f32(t16[1], t16[3])];
        let t4 = vaddq_f32(t8[0], t8[1]);
        let t2 = vadd_f32(vget_low_f32(t4), vget_high_f32(t4));
        vget_lane_f32::<0>(t2) + vget_lane_f32::<1>(t2)
    }
}

/// An `MB x OB` tile (`MB * OB <= 2`: two eight-register accumulators, eight registers per decoded row).
unsafe fn tile128<const S: u8, const MB: usize, const OB: usize>(
    src: &TileSrc<'_>,
    o0: usize,
    xs: &[&[f32]],
    res: &mut [[f32; 4]; 4],
) {
    // SAFETY (whole body): NEON is always there; the loads stay inside the activation rows (chunks * 32
    // floats each) and the rows o0..o0 + OB of `src` (the caller's contract).
    unsafe {
        let zero = vdupq_n_f32(0.0);
        let mut acc = [[[zero; 8]; OB]; MB];
        let mut sc = [[zero; 2]; OB];
        let rows: [&[f32]; OB] = if S == PANEL {
            [&[]; OB]
        } else {
            std::array::from_fn(|r| src.scale_row(o0 + r))
        };
        let (mut c, mut seg) = (0, 0);
        while c < src.chunks {
            if S != PANEL {
                for (r, s) in sc.iter_mut().enumerate() {
                    *s = prep128::<S>(rows[r], seg);
                }
            }
            seg += 1;
            let end = (c + src.seg_chunks).min(src.chunks);
            while c < end {
                for r in 0..OB {
                    let w = decode128::<S>(src, o0 + r, c, sc[r]);
                    for (i, x) in xs.iter().enumerate().take(MB) {
                        let xp = x.as_ptr().add(c * LANES);
                        for q in 0..8 {
                            acc[i][r][q] = vfmaq_f32(acc[i][r][q], vld1q_f32(xp.add(4 * q)), w[q]);
                        }
                    }
                }
                c += 1;
            }
        }
        for i in 0..MB {
            for r in 0..OB {
                res[i][r] = reduce128(acc[i][r]);
            }
        }
    }
}

unsafe fn decode_rows128<const S: u8>(src: &TileSrc<'_>, o0: usize, n: usize, dst: &mut [f32]) {
    let kp = src.chunks * LANES;
    assert!(dst.len() >= n * kp);
    for r in 0..n {
        let row = src.scale_row(o0 + r);
        for (seg, chunks) in src.segments() {
            let s = prep128::<S>(row, seg);
            for c in chunks {
                // SAFETY: row o0 + r exists, c < chunks, and dst has n rows of kp floats (asserted).
                unsafe {
                    let w = decode128::<S>(src, o0 + r, c, s);
                    let p = dst.as_mut_ptr().add(r * kp + c * LANES);
                    for (q, v) in w.iter().enumerate() {
                        vst1q_f32(p.add(4 * q), *v);
                    }
                }
            }
        }
    }
}

/// # Safety
/// Rows `o0..o0+n` exist in `src` and `dst` holds `n` rows of `chunks * 32` floats.
pub(super) unsafe fn decode_rows_neon(
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    n: usize,
    dst: &mut [f32],
) {
    src.debug_check(scheme, o0 + n, &[]);
    // SAFETY: forwarded contract.
    unsafe { by_scheme!(decode_rows128, scheme, (src, o0, n, dst)) }
}

/// # Safety
/// Rows `o0..o0+ob` exist in `src`; every activation row holds `chunks * 32` floats.
pub(super) unsafe fn tile_neon(
    scheme: u8,
    src: &TileSrc<'_>,
    o0: usize,
    xs: &[&[f32]],
    ob: usize,
    res: &mut [[f32; 4]; 4],
) {
    src.debug_check(scheme, o0 + ob, xs);
    super::in_pair_tiles(xs, ob, res, |o, sub, obs, part| {
        // SAFETY: forwarded contract (rows o..o + obs of the tile, `sub` a part of `xs`).
        unsafe { pair_tile!(tile128, scheme, sub.len(), obs, (src, o0 + o, sub, part)) }
    });
}
