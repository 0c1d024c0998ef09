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
//! Blocking (BLIS-style): for each `KC` block of `k` and each `NC`-wide panel of the output's columns,
//! `b`'s `KC x NC` panel is packed once, in `NR`-column strips shared by every thread; then each task (a
//! band of at most `MC` output rows, the unit of parallel work) packs its rows of `a` in `MR`-row strips
//! and runs an `MR x NR` register tile per strip pair (AVX-512: 12 x 32, 24 accumulators; AVX2: 6 x 16;
//! portable and NEON: 4 x 16). Each operand is packed once per panel and block (an earlier layout packed
//! `a` again for every 128 output columns: its scattered copies took ~40% of the GEMM's time in the
//! learner's backward).

use rayon::prelude::*;

use super::SimdPath;

/// `k` per block: a packed `KC x 12` strip of `a` (12 KB) stays in L1 while `b`'s strips stream from L2,
/// or from L3 for panels wider than about 1000 columns (panels cut to 512 columns, to stay in a 1 MB L2,
/// measured 5-15% slower on SmolLM2's shapes on a 2-core Zen 4: more passes, each with its own dispatch).
const KC: usize = 256;
/// Output rows per task at most (a multiple of every `MR`).
const MC: usize = 96;
/// Output columns per packed panel of `b` at most (a multiple of every `NR`): `KC x NC` floats, 4 MB.
const NC: usize = 4096;
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

    /// The transpose, read through swapped strides.
    fn t(self) -> Self {
        Self {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// `y = a · b` (`a` is `m x k`, `b` is `k x n`, both through strides), `y` row-major `[m, n]`, on the
/// detected SIMD path.
pub fn gemm(a: Strided, b: Strided, m: usize, k: usize, n: usize) -> Vec<f32> {
    gemm_on(SimdPath::detect(), a, b, m, k, n)
}

/// [`gemm`] on a given path (tests compare the paths; a path this machine lacks panics).
pub fn gemm_on(path: SimdPath, a: Strided, b: Strided, m: usize, k: usize, n: usize) -> Vec<f32> {
    if m > 0 && n > 0 && k > 0 {
        assert!(
            (k - 1) * b.rs + (n - 1) * b.cs < b.data.len(),
            "gemm: b too short for {k} x {n}"
        );
    }
    multiply(path, a, Rhs::Strided(b), m, k, n)
}

/// `y = a · b` where `b` (`k x n`) is given row by row: `row(r, dst)` writes row `r`'s `n` values (a
/// quantized weight's decoder). Each `KC` block of rows is decoded once into a scratch of `KC x n` and
/// packed from there, so the whole `b` never exists in f32. The same chains, bit for bit, as [`gemm`] on
/// the materialised `b`.
pub fn gemm_rows(
    a: Strided,
    row: &(dyn Fn(usize, &mut [f32]) + Sync),
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    gemm_rows_on(SimdPath::detect(), a, row, m, k, n)
}

/// [`gemm_rows`] on a given path.
pub fn gemm_rows_on(
    path: SimdPath,
    a: Strided,
    row: &(dyn Fn(usize, &mut [f32]) + Sync),
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    multiply(path, a, Rhs::Rows(row), m, k, n)
}

fn multiply(path: SimdPath, a: Strided, b: Rhs, m: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(
        path.is_available(),
        "SIMD path {} is not available on this machine",
        path.name()
    );
    let mut y = vec![0.0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return y;
    }
    assert!(
        (m - 1) * a.rs + (k - 1) * a.cs < a.data.len(),
        "gemm: a too short for {m} x {k}"
    );
    let p = Product { a, b, m, k, n };
    match path {
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx512 => p.run::<12, 32>(&mut y, |ap, bp, kc, c, rows, cols, first| {
            // SAFETY: Avx512 is only chosen when the CPU has avx512f, avx2 and fma (`SimdPath::available`);
            // the tile's elements are this task's alone (`Product::run`).
            unsafe { tile_avx512(ap, bp, kc, c, rows, cols, first) }
        }),
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 => p.run::<6, 16>(&mut y, |ap, bp, kc, c, rows, cols, first| {
            // SAFETY: Avx2 is only chosen when the CPU has avx2 and fma; the tile is this task's alone.
            unsafe { tile_avx2(ap, bp, kc, c, rows, cols, first) }
        }),
        _ => p.run::<4, 16>(&mut y, |ap, bp, kc, c, rows, cols, first| {
            // SAFETY: the tile's elements are this task's alone (`Product::run`).
            unsafe { tile::<4, 16>(ap, bp, kc, c, rows, cols, first) }
        }),
    }
    y
}

/// Where `b`'s values come from.
#[derive(Clone, Copy)]
enum Rhs<'a> {
    Strided(Strided<'a>),
    /// Row `r`'s `n` values written by the function.
    Rows(&'a (dyn Fn(usize, &mut [f32]) + Sync)),
}

/// The operands and sizes of one product.
#[derive(Clone, Copy)]
struct Product<'a> {
    a: Strided<'a>,
    b: Rhs<'a>,
    m: usize,
    k: usize,
    n: usize,
}

impl Product<'_> {
    /// `y` (zeros, `[m, n]`) `= a · b` with an `MR x NR` register tile (arguments: packed `a` strip, packed
    /// `b` strip, `kc`, the output at the tile, its row stride, the valid rows and columns, and whether the
    /// chains start here).
    fn run<const MR: usize, const NR: usize>(
        self,
        y: &mut [f32],
        tile: impl Fn(&[f32], &[f32], usize, OutTile, usize, usize, bool) + Sync,
    ) {
        let Product { a, b, m, k, n } = self;
        assert_eq!(y.len(), m * n);
        let parallel = m * n * k >= PARALLEL_MIN_WORK;
        let threads = if parallel {
            rayon::current_num_threads()
        } else {
            1
        };
        // Tasks are bands of output rows (at least four per thread where `m` allows: the bands share
        // `b`'s packed panel, so a thinner band costs only its dispatch), times groups of `b`'s strips
        // where the bands are too few to keep the threads busy (each group packs the band's `a` again).
        let band = m.div_ceil(4 * threads).next_multiple_of(MR).clamp(MR, MC);
        let bands = m.div_ceil(band);
        let width = n.min(NC);
        let mut bp = vec![0.0f32; width.div_ceil(NR) * NR * k.min(KC)];
        let mut decoded = match b {
            Rhs::Rows(_) => vec![0.0f32; k.min(KC) * n],
            Rhs::Strided(_) => Vec::new(),
        };
        let out = OutPtr(y.as_mut_ptr());
        for k0 in (0..k).step_by(KC) {
            let kc = (k - k0).min(KC);
            // `b`'s rows `k0..k0 + kc` as a matrix whose row `base` is row `k0`.
            let (src, base) = match b {
                Rhs::Strided(s) => (s, k0),
                Rhs::Rows(row) => {
                    let rows = &mut decoded[..kc * n];
                    let decode = |(r, dst): (usize, &mut [f32])| row(k0 + r, dst);
                    if parallel {
                        rows.par_chunks_mut(n).enumerate().for_each(decode);
                    } else {
                        rows.chunks_mut(n).enumerate().for_each(decode);
                    }
                    (Strided::rows(&decoded[..kc * n], n), 0)
                }
            };
            for j0 in (0..n).step_by(NC) {
                let nc = (n - j0).min(NC);
                let strips = nc.div_ceil(NR);
                let panel = &mut bp[..strips * NR * kc];
                let pack = |(s, strip): (usize, &mut [f32])| {
                    pack_strip::<NR>(src, base, kc, j0 + s * NR, j0 + nc, strip)
                };
                if parallel {
                    panel.par_chunks_mut(NR * kc).enumerate().for_each(pack);
                } else {
                    panel.chunks_mut(NR * kc).enumerate().for_each(pack);
                }
                let panel = &bp[..strips * NR * kc];
                let groups = (2 * threads).div_ceil(bands).clamp(1, strips);
                let per_group = strips.div_ceil(groups);
                let task = |t: usize| {
                    let (i0, g) = ((t / groups) * band, t % groups);
                    let mc = (m - i0).min(band);
                    let mut ap = vec![0.0f32; mc.div_ceil(MR) * MR * kc];
                    for (s, strip) in ap.chunks_mut(MR * kc).enumerate() {
                        pack_strip::<MR>(a.t(), k0, kc, i0 + s * MR, i0 + mc, strip);
                    }
                    let mine = g * per_group..((g + 1) * per_group).min(strips);
                    for (sa, apanel) in ap.chunks(MR * kc).enumerate() {
                        let rows = (mc - sa * MR).min(MR);
                        for sb in mine.clone() {
                            let cols = (nc - sb * NR).min(NR);
                            let bpanel = &panel[sb * NR * kc..(sb + 1) * NR * kc];
                            let at = (i0 + sa * MR) * n + j0 + sb * NR;
                            // The task's own elements: rows `i0..i0 + mc` of its band, columns of its
                            // strips; no other task of this pass writes them.
                            let c = OutTile {
                                out,
                                at,
                                ldc: n,
                                len: m * n,
                            };
                            tile(apanel, bpanel, kc, c, rows, cols, k0 == 0);
                        }
                    }
                };
                if parallel {
                    (0..bands * groups).into_par_iter().for_each(task);
                } else {
                    (0..bands * groups).for_each(task);
                }
            }
        }
    }
}

/// The output of a product shared by its tasks, each writing its own elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: the tasks sharing an `OutPtr` write disjoint elements (`Product::run`), and the output outlives
// them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// One register tile's place in the output: element `at` of an output of `len` floats, rows `ldc` apart.
#[derive(Clone, Copy)]
struct OutTile {
    out: OutPtr,
    at: usize,
    ldc: usize,
    len: usize,
}

impl OutTile {
    /// Row `r`'s first `cols` elements of the tile. Panics outside the output.
    ///
    /// # Safety
    /// No other reference to those elements is alive, and no other thread accesses them meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, r: usize, cols: usize) -> &mut [f32] {
        let start = self.at + r * self.ldc;
        assert!(start + cols <= self.len, "tile row outside the output");
        // SAFETY: inside the output (asserted); exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.out.0.add(start), cols) }
    }
}

/// [`tile`] for `MR = 12`, `NR = 32` in AVX-512 registers: a whole tile runs in place in the output; an
/// edge tile through a 12 x 32 buffer.
///
/// # Safety
/// The CPU has avx512f and fma; the tile's `rows x cols` elements of the output are the caller's alone.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn tile_avx512(
    ap: &[f32],
    bp: &[f32],
    kc: usize,
    c: OutTile,
    rows: usize,
    cols: usize,
    first: bool,
) {
    assert!(ap.len() >= kc * 12 && bp.len() >= kc * 32);
    if rows == 12 && cols == 32 {
        assert!(c.at + 11 * c.ldc + 32 <= c.len, "tile outside the output");
        // SAFETY: the tile's 12 rows of 32 lie inside the output (asserted) and are the caller's alone;
        // the panels hold `kc` steps (asserted).
        unsafe { chains_avx512(ap, bp, kc, c.out.0.add(c.at), c.ldc, first) };
        return;
    }
    let mut buf = [[0.0f32; 32]; 12];
    if !first {
        for (r, row) in buf.iter_mut().enumerate().take(rows) {
            // SAFETY: the caller's contract.
            row[..cols].copy_from_slice(unsafe { c.row(r, cols) });
        }
    }
    // SAFETY: `buf` is 12 rows of 32, the panels hold `kc` steps (asserted).
    unsafe { chains_avx512(ap, bp, kc, buf.as_mut_ptr() as *mut f32, 32, false) };
    for (r, row) in buf.iter().enumerate().take(rows) {
        // SAFETY: the caller's contract.
        unsafe { c.row(r, cols) }.copy_from_slice(&row[..cols]);
    }
}

/// The 12 x 32 chains over `kc` steps in AVX-512 registers (24 accumulators, two loads of `b` and twelve
/// broadcasts of `a` per 24 fused multiply-adds; the generic body spilled its accumulators), starting from
/// `+0.0` (`first`) or from the values at `c` (rows `ldc` apart), the results stored there: in place, no
/// staging copy (the copies cost ~5% of the GEMM at `KC` = 128).
///
/// # Safety
/// The CPU has avx512f and fma; `ap` holds `kc * 12` and `bp` `kc * 32` values; `c` points at 12 rows of
/// 32 writable floats `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::incompatible_msrv)] // AVX-512 intrinsics: see the note in `x86.rs`.
unsafe fn chains_avx512(ap: &[f32], bp: &[f32], kc: usize, c: *mut f32, ldc: usize, first: bool) {
    use std::arch::x86_64::*;
    // SAFETY: the loads read `ap[kk * 12 + r]` / `bp[kk * 32 + 16 h ..]` with kk < kc and the 12 x 32
    // floats at `c` (the caller's contract).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; 12];
        if !first {
            for (r, row) in acc.iter_mut().enumerate() {
                row[0] = _mm512_loadu_ps(c.add(r * ldc));
                row[1] = _mm512_loadu_ps(c.add(r * ldc + 16));
            }
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
            _mm512_storeu_ps(c.add(r * ldc), row[0]);
            _mm512_storeu_ps(c.add(r * ldc + 16), row[1]);
        }
    }
}

/// The generic [`tile`] for `MR = 6`, `NR = 16`, compiled for AVX2 and FMA.
///
/// # Safety
/// The CPU has avx2 and fma; the tile's elements of the output are the caller's alone.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(
    ap: &[f32],
    bp: &[f32],
    kc: usize,
    c: OutTile,
    rows: usize,
    cols: usize,
    first: bool,
) {
    // SAFETY: forwarded contract.
    unsafe { tile::<6, 16>(ap, bp, kc, c, rows, cols, first) }
}

/// One strip of `W` columns of `src[k0..k0+kc, c0..min(c0+W, end)]` into `strip` (`[kc, W]`, zeros past
/// `end`). Row-major `src` copies runs of `W`; a transposed one reads its columns as runs (`a`'s strips
/// are this function on `a`'s transpose).
#[inline(always)]
fn pack_strip<const W: usize>(
    src: Strided,
    k0: usize,
    kc: usize,
    c0: usize,
    end: usize,
    strip: &mut [f32],
) {
    let cols = (end - c0).min(W);
    let strip = &mut strip[..kc * W];
    if src.cs == 1 {
        for (kk, row) in strip.chunks_mut(W).enumerate() {
            let at = (k0 + kk) * src.rs + c0;
            row[..cols].copy_from_slice(&src.data[at..at + cols]);
            row[cols..].fill(0.0);
        }
    } else if src.rs == 1 {
        for j in 0..W {
            if j < cols {
                let at = (c0 + j) * src.cs + k0;
                for (kk, &v) in src.data[at..at + kc].iter().enumerate() {
                    strip[kk * W + j] = v;
                }
            } else {
                for kk in 0..kc {
                    strip[kk * W + j] = 0.0;
                }
            }
        }
    } else {
        for kk in 0..kc {
            for j in 0..W {
                strip[kk * W + j] = if j < cols {
                    src.at(k0 + kk, c0 + j)
                } else {
                    0.0
                };
            }
        }
    }
}

/// One `MR x NR` register tile over `kc` rows of `k`: the chains start from `+0.0` (`first`) or from the
/// values the previous `KC` block left in the output; the `rows x cols` valid part is stored.
///
/// # Safety
/// The tile's `rows x cols` elements of the output are the caller's alone.
#[inline(always)]
unsafe fn tile<const MR: usize, const NR: usize>(
    ap: &[f32],
    bp: &[f32],
    kc: usize,
    c: OutTile,
    rows: usize,
    cols: usize,
    first: bool,
) {
    let mut acc = [[0.0f32; NR]; MR];
    if !first {
        for (r, row) in acc.iter_mut().enumerate().take(rows) {
            // SAFETY: the caller's contract.
            row[..cols].copy_from_slice(unsafe { c.row(r, cols) });
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
        // SAFETY: the caller's contract.
        unsafe { c.row(r, cols) }.copy_from_slice(&row[..cols]);
    }
}

#[cfg(test)]
mod tests {
    use super::super::f32_matmul_reference;
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The `cols x rows` transpose of row-major `rows x cols` `v`.
    fn transposed(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0.0f32; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = v[r * cols + c];
            }
        }
        t
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 1999) as f32 - 999.0) / 257.0)
            .collect()
    }

    /// `b` given row by row (a quantized weight's decoder in the backward) gives the bits of the
    /// materialised `b`, on every path, across `KC` blocks and `NC` panels.
    #[test]
    fn rows_given_one_by_one_are_the_materialised_product() {
        for (m, k, n) in [(1, 1, 1), (37, 600, 45), (13, 300, 4097), (150, 257, 64)] {
            let a = values(m * k, 3);
            let b = values(k * n, 4);
            let row = |r: usize, dst: &mut [f32]| dst.copy_from_slice(&b[r * n..(r + 1) * n]);
            for path in SimdPath::available() {
                let expect = gemm_on(path, Strided::rows(&a, k), Strided::rows(&b, n), m, k, n);
                let y = gemm_rows_on(path, Strided::rows(&a, k), &row, m, k, n);
                assert_eq!(bits(&y), bits(&expect), "{} {m}x{k}x{n}", path.name());
            }
        }
    }

    /// On a pool of 7 threads the few-row products split their columns among tasks as well as their rows
    /// (groups of `b`'s strips): the same bits as the reference.
    #[test]
    fn column_groups_on_many_threads_are_the_chain_reference() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(7)
            .build()
            .unwrap();
        for (m, k, n) in [
            (13, 300, 4097),
            (40, 100, 900),
            (1, 2000, 700),
            (100, 257, 330),
        ] {
            let a = values(m * k, 5);
            let b = values(k * n, 6);
            let expect = f32_matmul_reference(&a, &b, 1, m, k, n);
            for path in SimdPath::available() {
                let y = pool
                    .install(|| gemm_on(path, Strided::rows(&a, k), Strided::rows(&b, n), m, k, n));
                assert_eq!(bits(&y), bits(&expect), "{} {m}x{k}x{n}", path.name());
            }
        }
    }

    /// Every path, plain and transposed operands, shapes off every block size (k across two or three `KC`
    /// blocks, n across two `NC` panels, m across several bands, in parallel): bitwise the one-chain
    /// reference.
    #[test]
    fn every_path_and_layout_is_the_chain_reference() {
        for (m, k, n) in [
            (1, 1, 1),
            (13, 300, 37),
            (97, 513, 33),
            (25, 7, 300),
            (2, 260, 1),
            (13, 300, 4097),
            (150, 600, 40),
        ] {
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let expect = f32_matmul_reference(&a, &b, 1, m, k, n);
            let (at, bt) = (transposed(&a, m, k), transposed(&b, k, n));
            for path in SimdPath::available() {
                let cases = [
                    (Strided::rows(&a, k), Strided::rows(&b, n)),
                    (Strided::transposed(&at, m), Strided::rows(&b, n)),
                    (Strided::rows(&a, k), Strided::transposed(&bt, k)),
                ];
                for (case, (sa, sb)) in cases.into_iter().enumerate() {
                    let y = gemm_on(path, sa, sb, m, k, n);
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
