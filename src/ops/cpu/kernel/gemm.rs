//! A cache- and register-blocked f32 GEMM whose every output element is the one chain of fused
//! multiply-adds in `k` order from `+0.0` (the arithmetic of `f32mm`, bitwise
//! [`super::f32_matmul_reference`]):
//!
//! ```text
//! acc = +0.0;  for kk in 0..K: acc = fma(a[i, kk], b[kk, o], acc);  y[i, o] = acc
//! ```
//!
//! The blocking only decides where a chain's running value waits between blocks of `k` (in a register, or
//! in the output between two `KC` blocks, which stores and reloads it unchanged), never the order of its
//! terms: the result is the same on every SIMD path, thread count and machine, and the blocking constants
//! are constants, not cache sizes detected at run time. Operands are read through strides, so `a^T` and
//! `b^T` cost only their packing: the backward's `dW = x^T g` and `dx = g W^T` run here without a
//! transposed copy.
//!
//! Blocking (BLIS-style): for each task's `MC x NC` block of the output, for each `KC` block of `k`: `b`'s
//! `KC x NC` panel packed in `NR`-column strips, `a`'s `MC x KC` panel in `MR`-row strips, then an `MR x NR`
//! register tile per strip pair (AVX-512: 12 x 32, 24 accumulators; AVX2: 6 x 16; portable and NEON:
//! 4 x 16).

use rayon::prelude::*;

use super::SimdPath;

/// `k` per block: a packed `KC x 32` strip of `b` (16 KB) and a `KC x 12` strip of `a` (6 KB) stay in L1.
const KC: usize = 128;
/// Output rows per packed panel of `a` (a multiple of every `MR`).
const MC: usize = 96;
/// Output rows per task: `b`'s packed panel serves this many rows before the next is packed.
const TASK_ROWS: usize = 480;
/// Output columns per task (a multiple of every `NR`).
const NC: usize = 128;
/// Below this many multiply-adds the product runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 20;

/// A matrix read through strides: element `(r, c)` at `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub struct Strided<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Strided<'a> {
    /// A row-major `[rows, cols]` matrix.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major `[cols, rows]` matrix, read as `[rows, cols]`.
    pub fn transposed(data: &'a [f32], rows: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: rows,
        }
    }

    #[inline(always)]
    fn at(&self, r: usize, c: usize) -> f32 {
        self.data[r * self.rs + c * self.cs]
    }
}

/// `y = a · b` (`a` is `m x k`, `b` is `k x n`, both through strides), `y` row-major `[m, n]`, on the
/// detected SIMD path.
pub fn gemm(a: Strided, b: Strided, m: usize, k: usize, n: usize) -> Vec<f32> {
    gemm_on(SimdPath::detect(), a, b, m, k, n)
}

/// [`gemm`] on a given path (tests compare the paths; a path this machine lacks panics).
pub fn gemm_on(path: SimdPath, a: Strided, b: Strided, m: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(
        path.is_available(),
        "SIMD path {} is not available on this machine",
        path.name()
    );
    let mut y = vec![0.0f32; m * n];
    if m == 0 || n == 0 {
        return y;
    }
    if k == 0 {
        return y;
    }
    assert!(
        (m - 1) * a.rs + (k - 1) * a.cs < a.data.len()
            && (k - 1) * b.rs + (n - 1) * b.cs < b.data.len(),
        "gemm: operands too short for {m} x {k} x {n}"
    );
    let (rt, ct) = (m.div_ceil(TASK_ROWS), n.div_ceil(NC));
    let task = |t: usize| {
        let (i0, j0) = ((t / ct) * TASK_ROWS, (t % ct) * NC);
        let (mc, nc) = ((m - i0).min(TASK_ROWS), (n - j0).min(NC));
        let mut out = vec![0.0f32; mc * nc];
        block_on(path, a, b, k, i0, j0, mc, nc, &mut out);
        (i0, j0, nc, out)
    };
    let blocks: Vec<(usize, usize, usize, Vec<f32>)> = if m * n * k >= PARALLEL_MIN_WORK {
        (0..rt * ct).into_par_iter().map(task).collect()
    } else {
        (0..rt * ct).map(task).collect()
    };
    for (i0, j0, nc, out) in blocks {
        for (r, row) in out.chunks(nc).enumerate() {
            y[(i0 + r) * n + j0..(i0 + r) * n + j0 + nc].copy_from_slice(row);
        }
    }
    y
}

#[allow(clippy::too_many_arguments)]
fn block_on(
    path: SimdPath,
    a: Strided,
    b: Strided,
    k: usize,
    i0: usize,
    j0: usize,
    mc: usize,
    nc: usize,
    out: &mut [f32],
) {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx512 is only chosen when the CPU has avx512f, avx2 and fma (`SimdPath::available`).
        SimdPath::Avx512 => unsafe { block_avx512(a, b, k, i0, j0, mc, nc, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2 is only chosen when the CPU has avx2 and fma.
        SimdPath::Avx2 => unsafe { block_avx2(a, b, k, i0, j0, mc, nc, out) },
        _ => block::<4, 16>(a, b, k, i0, j0, mc, nc, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_avx512(
    a: Strided,
    b: Strided,
    k: usize,
    i0: usize,
    j0: usize,
    mc: usize,
    nc: usize,
    out: &mut [f32],
) {
    block_with::<12, 32>(
        a,
        b,
        k,
        i0,
        j0,
        mc,
        nc,
        out,
        |ap, bp, kc, c, ldc, rows, cols, first| {
            // SAFETY: this function runs only with avx512f and fma (its own target features).
            unsafe { tile_avx512(ap, bp, kc, c, ldc, rows, cols, first) }
        },
    )
}

/// [`tile`] for `MR = 12`, `NR = 32` in AVX-512 registers: 24 accumulators, two loads of `b` and twelve
/// broadcasts of `a` per 24 fused multiply-adds (the generic body spilled its accumulators).
///
/// # Safety
/// The CPU has avx512f and fma; `ap` holds `kc * 12` and `bp` `kc * 32` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[allow(clippy::incompatible_msrv)] // AVX-512 intrinsics: see the note in `x86.rs`.
unsafe fn tile_avx512(
    ap: &[f32],
    bp: &[f32],
    kc: usize,
    c: &mut [f32],
    ldc: usize,
    rows: usize,
    cols: usize,
    first: bool,
) {
    use std::arch::x86_64::*;
    assert!(ap.len() >= kc * 12 && bp.len() >= kc * 32);
    let mut buf = [[0.0f32; 32]; 12];
    if !first {
        for (r, row) in buf.iter_mut().enumerate().take(rows) {
            row[..cols].copy_from_slice(&c[r * ldc..r * ldc + cols]);
        }
    }
    // SAFETY: every load reads `ap[kk * 12 + r]` / `bp[kk * 32 + 16 h ..]` with kk < kc (asserted above);
    // `buf` is 12 x 32.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; 12];
        for (r, row) in acc.iter_mut().enumerate() {
            row[0] = _mm512_loadu_ps(buf[r].as_ptr());
            row[1] = _mm512_loadu_ps(buf[r].as_ptr().add(16));
        }
        let (pa, pb) = (ap.as_ptr(), bp.as_ptr());
        for kk in 0..kc {
            let b0 = _mm512_loadu_ps(pb.add(kk * 32));
            let b1 = _mm512_loadu_ps(pb.add(kk * 32 + 16));
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*pa.add(kk * 12 + r));
                row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                row[1] = _mm512_fmadd_ps(av, b1, row[1]);
            }
        }
        for (r, row) in acc.iter().enumerate() {
            _mm512_storeu_ps(buf[r].as_mut_ptr(), row[0]);
            _mm512_storeu_ps(buf[r].as_mut_ptr().add(16), row[1]);
        }
    }
    for (r, row) in buf.iter().enumerate().take(rows) {
        c[r * ldc..r * ldc + cols].copy_from_slice(&row[..cols]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_avx2(
    a: Strided,
    b: Strided,
    k: usize,
    i0: usize,
    j0: usize,
    mc: usize,
    nc: usize,
    out: &mut [f32],
) {
    block::<6, 16>(a, b, k, i0, j0, mc, nc, out)
}

/// The `mc x nc` output block at `(i0, j0)` into `out` (`[mc, nc]`), `KC` rows of `k` at a time, with the
/// generic register tile.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block<const MR: usize, const NR: usize>(
    a: Strided,
    b: Strided,
    k: usize,
    i0: usize,
    j0: usize,
    mc: usize,
    nc: usize,
    out: &mut [f32],
) {
    block_with::<MR, NR>(a, b, k, i0, j0, mc, nc, out, tile::<MR, NR>)
}

/// [`block`] with a given register tile (arguments: packed `a` strip, packed `b` strip, `kc`, the output
/// at the tile, its row stride, the valid rows and columns, and whether the chains start here).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_with<const MR: usize, const NR: usize>(
    a: Strided,
    b: Strided,
    k: usize,
    i0: usize,
    j0: usize,
    mc: usize,
    nc: usize,
    out: &mut [f32],
    tile: impl Fn(&[f32], &[f32], usize, &mut [f32], usize, usize, usize, bool),
) {
    let strips_b = nc.div_ceil(NR);
    let mut ap = vec![0.0f32; MC.div_ceil(MR) * MR * KC];
    let mut bp = vec![0.0f32; strips_b * NR * KC];
    let mut k0 = 0;
    while k0 < k {
        let kc = (k - k0).min(KC);
        pack_b::<NR>(b, k0, kc, j0, nc, &mut bp);
        for ic in (0..mc).step_by(MC) {
            let rows_c = (mc - ic).min(MC);
            pack_a::<MR>(a, k0, kc, i0 + ic, rows_c, &mut ap);
            for sa in 0..rows_c.div_ceil(MR) {
                let rows = (rows_c - sa * MR).min(MR);
                let apanel = &ap[sa * MR * KC..sa * MR * KC + kc * MR];
                for sb in 0..strips_b {
                    let cols = (nc - sb * NR).min(NR);
                    let bpanel = &bp[sb * NR * KC..sb * NR * KC + kc * NR];
                    let c = &mut out[(ic + sa * MR) * nc + sb * NR..];
                    tile(apanel, bpanel, kc, c, nc, rows, cols, k0 == 0);
                }
            }
        }
        k0 += kc;
    }
}

/// `b[k0..k0+kc, j0..j0+nc]` into strips of `NR` columns, each `[kc, NR]` (zeros past `nc`), strip `s` at
/// `s * NR * KC`. Row-major `b` copies runs of `NR`; transposed `b` reads its columns as runs.
#[inline(always)]
fn pack_b<const NR: usize>(b: Strided, k0: usize, kc: usize, j0: usize, nc: usize, bp: &mut [f32]) {
    for s in 0..nc.div_ceil(NR) {
        let strip = &mut bp[s * NR * KC..s * NR * KC + kc * NR];
        let cols = (nc - s * NR).min(NR);
        let c0 = j0 + s * NR;
        if b.cs == 1 {
            for kk in 0..kc {
                let at = (k0 + kk) * b.rs + c0;
                strip[kk * NR..kk * NR + cols].copy_from_slice(&b.data[at..at + cols]);
                strip[kk * NR + cols..(kk + 1) * NR].fill(0.0);
            }
        } else if b.rs == 1 {
            for j in 0..NR {
                if j < cols {
                    let col = &b.data[(c0 + j) * b.cs + k0..(c0 + j) * b.cs + k0 + kc];
                    for (kk, &v) in col.iter().enumerate() {
                        strip[kk * NR + j] = v;
                    }
                } else {
                    for kk in 0..kc {
                        strip[kk * NR + j] = 0.0;
                    }
                }
            }
        } else {
            for kk in 0..kc {
                for j in 0..NR {
                    strip[kk * NR + j] = if j < cols { b.at(k0 + kk, c0 + j) } else { 0.0 };
                }
            }
        }
    }
}

/// `a[i0..i0+mc, k0..k0+kc]` into strips of `MR` rows, each `[kc, MR]` (zeros past `mc`), strip `s` at
/// `s * MR * KC`: exactly [`pack_b`] of `a`'s transpose (`k x m`, the strides swapped).
#[inline(always)]
fn pack_a<const MR: usize>(a: Strided, k0: usize, kc: usize, i0: usize, mc: usize, ap: &mut [f32]) {
    let at = Strided {
        data: a.data,
        rs: a.cs,
        cs: a.rs,
    };
    pack_b::<MR>(at, k0, kc, i0, mc, ap)
}

/// One `MR x NR` register tile over `kc` rows of `k`: the chains start from `+0.0` (`first`) or from the
/// values the previous `KC` block left in `c` (row stride `ldc`); the `rows x cols` valid part is stored.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile<const MR: usize, const NR: usize>(
    ap: &[f32],
    bp: &[f32],
    kc: usize,
    c: &mut [f32],
    ldc: usize,
    rows: usize,
    cols: usize,
    first: bool,
) {
    let mut acc = [[0.0f32; NR]; MR];
    if !first {
        for (r, row) in acc.iter_mut().enumerate().take(rows) {
            row[..cols].copy_from_slice(&c[r * ldc..r * ldc + cols]);
        }
    }
    for kk in 0..kc {
        let bv: &[f32; NR] = bp[kk * NR..(kk + 1) * NR].try_into().unwrap();
        let av: &[f32; MR] = ap[kk * MR..(kk + 1) * MR].try_into().unwrap();
        for r in 0..MR {
            for j in 0..NR {
                acc[r][j] = av[r].mul_add(bv[j], acc[r][j]);
            }
        }
    }
    for (r, row) in acc.iter().enumerate().take(rows) {
        c[r * ldc..r * ldc + cols].copy_from_slice(&row[..cols]);
    }
}

#[cfg(test)]
mod tests {
    use super::super::f32_matmul_reference;
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 1999) as f32 - 999.0) / 257.0)
            .collect()
    }

    /// Every path, plain and transposed operands, shapes off every block size (k across two `KC` blocks):
    /// bitwise the one-chain reference.
    #[test]
    fn every_path_and_layout_is_the_chain_reference() {
        for (m, k, n) in [
            (1, 1, 1),
            (13, 300, 37),
            (97, 513, 33),
            (25, 7, 300),
            (2, 260, 1),
        ] {
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let expect = f32_matmul_reference(&a, &b, 1, m, k, n);
            let mut at = vec![0.0f32; m * k];
            for i in 0..m {
                for kk in 0..k {
                    at[kk * m + i] = a[i * k + kk];
                }
            }
            let mut bt = vec![0.0f32; k * n];
            for kk in 0..k {
                for o in 0..n {
                    bt[o * k + kk] = b[kk * n + o];
                }
            }
            for path in SimdPath::available() {
                let cases = [
                    (Strided::rows(&a, k), Strided::rows(&b, n)),
                    (Strided::transposed(&at, m), Strided::rows(&b, n)),
                    (Strided::rows(&a, k), Strided::transposed(&bt, k)),
                ];
                for (case, (sa, sb)) in cases.into_iter().enumerate() {
                    let y = gemm_on(path, sa, sb, m, k, n);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&y),
                        bits(&expect),
                        "{} {m}x{k}x{n} case {case}",
                        path.name()
                    );
                }
            }
        }
    }
}
