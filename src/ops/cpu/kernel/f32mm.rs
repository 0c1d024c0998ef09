//! The batch-invariant f32 matmul of deterministic mode (lm_head, router, unquantized projections, the
//! attention products): `y[i, o] = sum_k x[i, k] * w[k, o]` with `w` row-major `[k, n]`, each output element
//! one chain of fused multiply-adds in `k` order from `+0.0`:
//!
//! ```text
//! acc = +0.0;  for k in 0..K: acc = fma(x[i, k], w[k, o], acc);  y[i, o] = acc
//! ```
//!
//! Every element is computed the same way whatever the number of rows, the other rows, the column block it
//! falls in, the thread count or the SIMD path (IEEE fma everywhere, `f32::mul_add` in the portable code),
//! so a token decoded alone with the KV cache and the same token scored in a full-sequence forward get the
//! same bits. Vectorised across output columns (the chains are independent), so no lane tree is needed.
//! Trailing `x[i, k] * w[k, o] = 0` terms (masked keys) leave a chain's value unchanged.

use std::ops::Range;

use rayon::prelude::*;

use super::SimdPath;

/// Below this many multiply-adds a call runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 18;
/// Output columns per rayon task (single matrix).
const TASK_COLS: usize = 64;
/// Rows from which a single product runs on the blocked kernel ([`super::gemm`], the same chains).
const GEMM_MIN_M: usize = 32;
/// Rows per rayon task (at least; large `m` is split in at most 8 row chunks).
const TASK_ROWS: usize = 128;

/// `R` rows of `x` (`[R, k]` at `x`, row stride `k`) times columns `o0..o0+NB` of `w` (`[k, n]`) into
/// `acc[r][j]`. The generic body every path instantiates (inlined into the target-feature wrappers so that
/// `mul_add` becomes a vector fma there).
#[inline(always)]
fn block<const R: usize, const NB: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    n: usize,
    o0: usize,
    acc: &mut [[f32; NB]; R],
) {
    for kk in 0..k {
        prefetch_row::<NB>(w, (kk + PREFETCH_ROWS) * n + o0);
        let wr: &[f32; NB] = w[kk * n + o0..kk * n + o0 + NB].try_into().unwrap();
        for r in 0..R {
            let xv = x[r * k + kk];
            for j in 0..NB {
                acc[r][j] = xv.mul_add(wr[j], acc[r][j]);
            }
        }
    }
}

/// Rows of `w` ahead of the one being multiplied whose block is prefetched.
const PREFETCH_ROWS: usize = 32;

/// Software prefetch of the `NB` floats of `w` at `at` (a no-op past the end or off x86).
#[inline(always)]
fn prefetch_row<const NB: usize>(w: &[f32], at: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let p = w.as_ptr().wrapping_add(at) as *const i8;
        let mut off = 0;
        while off < NB * 4 {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    p.wrapping_add(off),
                )
            };
            off += 64;
        }
    }
    let _ = (w, at);
}

/// One output element's chain (tails).
#[inline(always)]
fn chain(x: &[f32], w: &[f32], k: usize, n: usize, o: usize) -> f32 {
    let mut acc = 0.0f32;
    for kk in 0..k {
        acc = x[kk].mul_add(w[kk * n + o], acc);
    }
    acc
}

/// Columns `c0..c1` of `y = x · w` for all `m` rows, into `out` (`[m, c1 - c0]`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn cols<const R: usize, const NB: usize>(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    let width = c1 - c0;
    // Full blocks of NB columns: with more than one row block, the block of `w` is first copied to a
    // contiguous `[k, NB]` buffer (rows of `w` are `n` apart: a power-of-two stride puts every row of the
    // block in the same few cache sets, so a second pass in place reads it from DRAM again), then reused by
    // every row block. Copying changes no arithmetic. With one row block (m <= R) `w` is read in place, once.
    // The lm_head of the 195M MoE at decode (m = 8, [768, 8192]): 3.6 -> 2.4 ms with the copy.
    let pack = m > R;
    let mut packed = if pack {
        vec![0.0f32; k * NB]
    } else {
        Vec::new()
    };
    let mut o = c0;
    while o + NB <= c1 {
        let (wb, nb, ob) = if pack {
            for kk in 0..k {
                packed[kk * NB..(kk + 1) * NB].copy_from_slice(&w[kk * n + o..kk * n + o + NB]);
            }
            (&packed[..], NB, 0)
        } else {
            (w, n, o)
        };
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(R);
            if rows == R {
                let mut acc = [[0.0f32; NB]; R];
                block::<R, NB>(&x[i * k..], wb, k, nb, ob, &mut acc);
                for (r, a) in acc.iter().enumerate() {
                    let at = (i + r) * width + o - c0;
                    out[at..at + NB].copy_from_slice(a);
                }
            } else {
                // The last rows together (one pass over the block of `w`; R is at most 8 on every path).
                let xs = &x[i * k..];
                let mut put = |acc: &[[f32; NB]]| {
                    for (r, a) in acc.iter().enumerate() {
                        let at = (i + r) * width + o - c0;
                        out[at..at + NB].copy_from_slice(a);
                    }
                };
                macro_rules! last_rows {
                    ($($r:literal),*) => {
                        match rows {
                            $($r => {
                                let mut acc = [[0.0f32; NB]; $r];
                                block::<$r, NB>(xs, wb, k, nb, ob, &mut acc);
                                put(&acc);
                            })*
                            _ => unreachable!("fewer than R <= 8 rows"),
                        }
                    };
                }
                last_rows!(1, 2, 3, 4, 5, 6, 7);
            }
            i += rows;
        }
        o += NB;
    }
    // Remaining columns in blocks of 8, unpacked (fewer than NB of them).
    while o + 8 <= c1 {
        for i in 0..m {
            let mut acc = [[0.0f32; 8]; 1];
            block::<1, 8>(&x[i * k..], w, k, n, o, &mut acc);
            let at = i * width + o - c0;
            out[at..at + 8].copy_from_slice(&acc[0]);
        }
        o += 8;
    }
    // Tail columns: one scalar chain each (the same arithmetic).
    for oo in o..c1 {
        for i in 0..m {
            out[i * width + oo - c0] = chain(&x[i * k..], w, k, n, oo);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn cols_avx512(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    cols::<4, 64>(x, w, m, k, n, c0, c1, out)
}

/// Rows of `w` per step of [`stream_avx512`] (each accumulator is loaded and stored once per step).
#[cfg(target_arch = "x86_64")]
const STREAM_KB: usize = 4;
/// Most columns per task of [`stream_avx512`] (512 bytes of every row of `w`). Paired probe, lm_head shape
/// (`[8, 768] · [768, 8192]`, cold, 2 cores): 1.33-1.40 ms with 512 columns, 1.29 ms with 128; m = 1 and 4
/// the same. Narrower tasks keep the `[m, cols]` accumulators and the rows in flight well inside L1.
#[cfg(target_arch = "x86_64")]
const STREAM_COLS: usize = 128;
/// Most activation rows for which [`stream_avx512`] is a plain streaming read (little arithmetic per line):
/// those prefetch into L2 and take tasks of [`STREAM_COLS_FEW_ROWS`] columns.
#[cfg(target_arch = "x86_64")]
const STREAM_FEW_ROWS: usize = 2;
/// [`STREAM_COLS`] for up to [`STREAM_FEW_ROWS`] activation rows: their per-task accumulators are small
/// and longer runs of each row stream better. Alternating binaries, cold `[1, 768] · [768, 8192]`, six
/// pairs: 0.84-1.09 ms with 128 columns, 0.74-0.86 ms with 2048; m = 2 1.01 vs 0.90 ms; m = 4 the same
/// (1.14-1.16 vs 1.13-1.14 ms), so three rows and more keep 128.
#[cfg(target_arch = "x86_64")]
const STREAM_COLS_FEW_ROWS: usize = 2048;
/// Narrowest product, in columns per thread, for which [`stream_avx512`] is used (see [`single`]).
#[cfg(target_arch = "x86_64")]
const STREAM_MIN_COLS: usize = 256;
/// Most activation rows [`stream_avx512`] takes (its accumulators, `[m, 256]`, stay in L1).
#[cfg(target_arch = "x86_64")]
const STREAM_MAX_M: usize = 8;

/// Columns `c0..c1` of `y = x · w` for `m <= 8` rows, reading `w` row by row: the accumulators
/// (`out`, `[m, c1 - c0]`, in L1) are updated by `STREAM_KB` rows of `w` at a time, in `k` order, so each
/// element is still the one chain of the module docs. Why: the column blocks of [`cols`] read `w` as
/// hundreds of 256-byte pieces `n` floats apart, which the hardware prefetchers do not follow (the lm_head
/// at decode, `[768, 8192]`, ran at about half the DRAM bandwidth); here each row is one contiguous run.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[allow(clippy::incompatible_msrv)] // AVX-512 intrinsics: see the note in `x86.rs`.
unsafe fn stream_avx512(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let width = c1 - c0;
    let vecs = width / 16;
    assert!(m <= STREAM_MAX_M && out.len() == m * width && x.len() >= m * k && w.len() >= k * n);
    assert!(c1 <= n);
    out.fill(0.0);
    // Up to STREAM_FEW_ROWS activation rows this is a streaming read with little arithmetic per line:
    // prefetch into L2, as the low-bit tiles do (`x86::CODE_PREFETCH`), so the prefetches do not hold L1's
    // few miss buffers. Alternating binaries, cold [1, 768] x [768, 8192]: 2.02-2.36 -> 1.63-1.70 ms; m = 2
    // 1.99-2.05 -> 1.85-1.90 ms. With more rows the loop is compute-heavier and its demand loads want the
    // lines in L1 (m = 8: 2.8-3.2 ms with T0, 3.5 ms with T1; m = 4 no better with T1; a noisy machine).
    let prefetch_to_l2 = m <= STREAM_FEW_ROWS;
    let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    let mut kk = 0;
    while kk < k {
        let kb = (k - kk).min(STREAM_KB);
        // The rows two steps ahead (a prefetch never faults; past the end it is a no-op).
        for r in 0..STREAM_KB {
            let row = wp.wrapping_add((kk + 2 * STREAM_KB + r) * n + c0) as *const i8;
            let mut off = 0;
            while off < vecs * 64 {
                if prefetch_to_l2 {
                    _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(off));
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(off));
                }
                off += 64;
            }
        }
        if kb == STREAM_KB {
            // Activation rows four at a time, their broadcasts held in registers across the vectors.
            let mut i0 = 0;
            while i0 < m {
                // SAFETY: rows kk..kk+4 <= k, columns c0..c0 + 16 vecs <= c1 <= n and activation rows
                // i0.. < m lie inside `w`, `x` and `out` (asserted above); same features.
                unsafe {
                    match m - i0 {
                        1 => stream_step::<1>(xp, wp, op, k, n, width, kk, c0, vecs, i0),
                        2 => stream_step::<2>(xp, wp, op, k, n, width, kk, c0, vecs, i0),
                        3 => stream_step::<3>(xp, wp, op, k, n, width, kk, c0, vecs, i0),
                        _ => stream_step::<4>(xp, wp, op, k, n, width, kk, c0, vecs, i0),
                    }
                }
                i0 += 4;
            }
        } else {
            // The last rows of `w` (k not a multiple of STREAM_KB), one at a time.
            for v in 0..vecs {
                let col = c0 + v * 16;
                for r in 0..kb {
                    // SAFETY: row kk + r < k and columns col..col + 16 <= c1 <= n lie inside `w`; the
                    // accumulator of row i inside `out` ([m, width]); x[i, kk + r] inside `x` (asserted).
                    unsafe {
                        let wr = _mm512_loadu_ps(wp.add((kk + r) * n + col));
                        for i in 0..m {
                            let a = op.add(i * width + v * 16);
                            let acc = _mm512_loadu_ps(a);
                            let xv = _mm512_set1_ps(*xp.add(i * k + kk + r));
                            _mm512_storeu_ps(a, _mm512_fmadd_ps(xv, wr, acc));
                        }
                    }
                }
            }
        }
        kk += kb;
    }
    // Tail columns: one scalar chain each (the same arithmetic).
    for o in c0 + vecs * 16..c1 {
        for i in 0..m {
            out[i * width + o - c0] = chain(&x[i * k..], w, k, n, o);
        }
    }
}

/// One step of four rows of `w` for activation rows `i0..i0 + R` (at most four): their `4 R` broadcast
/// activations stay in registers across every 16-column vector of the task, instead of one broadcast load
/// per multiply-add. Paired probe, `[m, 768] · [768, 8192]` cold: m = 8 1.39-1.40 vs 1.25-1.29 ms, m = 4
/// 1.15 vs 1.06 ms, m = 1 0.94 vs 0.89 ms. Each element's chain is unchanged (rows kk..kk+4 in order).
///
/// # Safety
/// The CPU has avx512f and fma; rows `kk..kk + 4` of `w` (`[k, n]`), columns `c0..c0 + 16 vecs` and
/// activation rows `i0..i0 + R` of `x` (`[m, k]`) and of `out` (`[m, width]`) exist.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[allow(clippy::incompatible_msrv)]
unsafe fn stream_step<const R: usize>(
    xp: *const f32,
    wp: *const f32,
    op: *mut f32,
    k: usize,
    n: usize,
    width: usize,
    kk: usize,
    c0: usize,
    vecs: usize,
    i0: usize,
) {
    use std::arch::x86_64::*;
    unsafe {
        let mut xb = [[_mm512_setzero_ps(); STREAM_KB]; R];
        for (i, row) in xb.iter_mut().enumerate() {
            for (r, b) in row.iter_mut().enumerate() {
                *b = _mm512_set1_ps(*xp.add((i0 + i) * k + kk + r));
            }
        }
        for v in 0..vecs {
            let col = c0 + v * 16;
            let w0 = _mm512_loadu_ps(wp.add(kk * n + col));
            let w1 = _mm512_loadu_ps(wp.add((kk + 1) * n + col));
            let w2 = _mm512_loadu_ps(wp.add((kk + 2) * n + col));
            let w3 = _mm512_loadu_ps(wp.add((kk + 3) * n + col));
            for (i, b) in xb.iter().enumerate() {
                let a = op.add((i0 + i) * width + v * 16);
                let mut acc = _mm512_loadu_ps(a);
                acc = _mm512_fmadd_ps(b[0], w0, acc);
                acc = _mm512_fmadd_ps(b[1], w1, acc);
                acc = _mm512_fmadd_ps(b[2], w2, acc);
                acc = _mm512_fmadd_ps(b[3], w3, acc);
                _mm512_storeu_ps(a, acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn cols_avx2(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    cols::<4, 16>(x, w, m, k, n, c0, c1, out)
}

#[allow(clippy::too_many_arguments)]
fn cols_on(
    path: SimdPath,
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx512 is only chosen when the CPU has avx512f, avx2 and fma (`SimdPath::available`).
        SimdPath::Avx512 => unsafe { cols_avx512(x, w, m, k, n, c0, c1, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2 is only chosen when the CPU has avx2 and fma.
        SimdPath::Avx2 => unsafe { cols_avx2(x, w, m, k, n, c0, c1, out) },
        _ => cols::<1, 8>(x, w, m, k, n, c0, c1, out),
    }
}

/// One `[m, k] · [k, n]` product on `path`, split into tasks of column blocks (and row chunks when `m` is
/// large); each element's chain is the same whatever the split.
fn single(path: SimdPath, x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    if m * n * k < PARALLEL_MIN_WORK {
        cols_on(path, x, w, m, k, n, 0, n, &mut y);
        return y;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let per_thread = n
            .div_ceil(2 * rayon::current_num_threads())
            .next_multiple_of(16);
        let width = per_thread.min(if m <= STREAM_FEW_ROWS {
            STREAM_COLS_FEW_ROWS
        } else {
            STREAM_COLS
        });
        // Only wide products stream: with under 256 columns per thread (the MoE experts, n = 384 or 768) the
        // column blocks were faster (f32 decode step of the 195M MoE 50 vs 55 ms).
        if path == SimdPath::Avx512 && m <= STREAM_MAX_M && per_thread >= STREAM_MIN_COLS {
            by_blocks(&mut y, m, n, m, width, |_, cols, out| {
                // SAFETY: the Avx512 path is only chosen when the CPU has avx512f, avx2 and fma.
                unsafe { stream_avx512(x, w, m, k, n, cols.start, cols.end, out) }
            });
            return y;
        }
    }
    if m >= GEMM_MIN_M {
        // The blocked kernel: the same chains, cache- and register-blocked (prefill, scoring, training).
        return super::gemm::gemm_on(
            path,
            super::gemm::Strided::rows(x, k),
            super::gemm::Strided::rows(w, n),
            m,
            k,
            n,
        );
    }
    let task_rows = TASK_ROWS.max(m.div_ceil(8));
    by_blocks(&mut y, m, n, task_rows, TASK_COLS, |rows, cols, out| {
        let xs = &x[rows.start * k..rows.end * k];
        cols_on(path, xs, w, rows.len(), k, n, cols.start, cols.end, out);
    });
    y
}

/// Runs `f(rows, cols, out)` in parallel on the blocks of `task_rows x task_cols` of `y` (`[m, n]`), each
/// into its own `[rows, cols]` buffer, then copies the blocks into `y`.
fn by_blocks(
    y: &mut [f32],
    m: usize,
    n: usize,
    task_rows: usize,
    task_cols: usize,
    f: impl Fn(Range<usize>, Range<usize>, &mut [f32]) + Sync,
) {
    let (ct, rt) = (n.div_ceil(task_cols), m.div_ceil(task_rows));
    let parts: Vec<(usize, usize, usize, Vec<f32>)> = (0..ct * rt)
        .into_par_iter()
        .map(|t| {
            let (c0, r0) = ((t % ct) * task_cols, (t / ct) * task_rows);
            let (c1, r1) = ((c0 + task_cols).min(n), (r0 + task_rows).min(m));
            let mut out = vec![0.0f32; (r1 - r0) * (c1 - c0)];
            f(r0..r1, c0..c1, &mut out);
            (r0, c0, c1 - c0, out)
        })
        .collect();
    for (r0, c0, width, out) in parts {
        for (i, row) in out.chunks(width).enumerate() {
            y[(r0 + i) * n + c0..(r0 + i) * n + c0 + width].copy_from_slice(row);
        }
    }
}

/// `y[b] = x[b] · w[b]` for `batch` products of `[m, k] · [k, n]` (row-major, contiguous) on the detected
/// path: the fixed order of the module docs.
pub fn f32_matmul(x: &[f32], w: &[f32], batch: usize, m: usize, k: usize, n: usize) -> Vec<f32> {
    f32_matmul_on(SimdPath::detect(), x, w, batch, m, k, n)
}

/// [`f32_matmul`] on a given path (tests compare the paths; a path this machine lacks panics).
pub fn f32_matmul_on(
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
    assert_eq!(w.len(), batch * k * n, "w must be [batch, k, n]");
    if batch == 1 {
        return single(path, x, w, m, k, n);
    }
    let mut y = vec![0.0f32; batch * m * n];
    let task = |(b, yb): (usize, &mut [f32])| {
        cols_on(
            path,
            &x[b * m * k..(b + 1) * m * k],
            &w[b * k * n..(b + 1) * k * n],
            m,
            k,
            n,
            0,
            n,
            yb,
        );
    };
    if batch * m * n * k >= PARALLEL_MIN_WORK && m * n > 0 {
        y.par_chunks_mut(m * n).enumerate().for_each(task);
    } else if m * n > 0 {
        y.chunks_mut(m * n).enumerate().for_each(task);
    }
    y
}

/// The definition, one scalar chain per element (the oracle of the tests).
pub fn f32_matmul_reference(
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
                let mut acc = 0.0f32;
                for kk in 0..k {
                    acc = x[b * m * k + i * k + kk].mul_add(w[b * k * n + kk * n + o], acc);
                }
                y[b * m * n + i * n + o] = acc;
            }
        }
    }
    y
}

/// Softmax of each row of `row_len` values (deterministic mode): the maximum, `exp(x - max)` per element
/// (`f32::exp`), their sum in index order, then one division per element. A row's result does not depend on
/// the other rows, and masked trailing entries (`exp` = 0) leave the sum unchanged.
pub fn softmax_rows(x: &[f32], row_len: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len()];
    if row_len == 0 {
        return y;
    }
    let row = |(src, dst): (&[f32], &mut [f32])| {
        let max = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = (s - max).exp();
            sum += *d;
        }
        for d in dst.iter_mut() {
            *d /= sum;
        }
    };
    if x.len() >= 1 << 16 {
        let rows_per_task = (4096 / row_len).max(1) * row_len;
        y.par_chunks_mut(rows_per_task)
            .zip(x.par_chunks(rows_per_task))
            .for_each(|(d, s)| {
                d.chunks_mut(row_len)
                    .zip(s.chunks(row_len))
                    .for_each(|(d, s)| row((s, d)))
            });
    } else {
        y.chunks_mut(row_len)
            .zip(x.chunks(row_len))
            .for_each(|(d, s)| row((s, d)));
    }
    y
}
