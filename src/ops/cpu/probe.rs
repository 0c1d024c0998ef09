//! What this machine can do, measured in the same run as the work it is compared with: the fused
//! multiply-add peak of every thread of the pool (the ceiling of the matmul-heavy phases) and the
//! streaming-read bandwidth from DRAM (the ceiling of a decode step, which reads every weight once), and
//! the peak resident memory of this process.
//!
//! Benchmarks print achieved rates next to these probes, so a ratio holds on whatever machine it ran on.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;

use super::kernel::SimdPath;

/// Independent accumulators per thread: enough to cover the FMA latency (4 cycles) on two ports.
const CHAINS: usize = 12;

/// FMA loop iterations per probe call on one thread (each `CHAINS` vector FMAs).
const ITERS: usize = 4_000_000;

/// The f32 FMA peak of every thread of rayon's pool on `path` in GFLOP/s (2 flops per lane per FMA),
/// best of `repeats` runs.
pub fn fma_peak_gflops(path: SimdPath, repeats: usize) -> f64 {
    let threads = rayon::current_num_threads();
    let lanes = lanes(path);
    let mut best = 0.0f64;
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        let s: f32 = (0..threads)
            .into_par_iter()
            .map(|t| fma_loop(path, 1.0 + t as f32 * 1e-7))
            .sum();
        black_box(s);
        let flops = (threads * iters(path) * CHAINS * lanes * 2) as f64;
        best = best.max(flops / start.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// Loop iterations of [`fma_loop`] on `path` (the scalar loop does fewer: it is slower per iteration).
fn iters(path: SimdPath) -> usize {
    match path {
        SimdPath::Avx512 | SimdPath::Avx2 => ITERS,
        SimdPath::Neon | SimdPath::Portable => ITERS / 16,
    }
}

/// f32 lanes of one FMA on `path`.
fn lanes(path: SimdPath) -> usize {
    match path {
        SimdPath::Avx512 => 16,
        SimdPath::Avx2 => 8,
        // The scalar loop below (NEON included: a lower bound there).
        SimdPath::Neon | SimdPath::Portable => 1,
    }
}

fn fma_loop(path: SimdPath, seed: f32) -> f32 {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the Avx512 path is only chosen when the CPU has avx512f and fma.
        SimdPath::Avx512 => unsafe { fma_loop_avx512(seed) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the Avx2 path is only chosen when the CPU has avx2 and fma.
        SimdPath::Avx2 => unsafe { fma_loop_avx2(seed) },
        _ => fma_loop_scalar(seed),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[allow(clippy::incompatible_msrv)] // AVX-512 intrinsics: see the note in `kernel/x86.rs`.
unsafe fn fma_loop_avx512(seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let mul = _mm512_set1_ps(0.999_999);
    let add = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(seed); CHAINS];
    for _ in 0..ITERS {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, mul, add);
        }
    }
    let mut s = _mm512_setzero_ps();
    for a in acc {
        s = _mm512_add_ps(s, a);
    }
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let mul = _mm256_set1_ps(0.999_999);
    let add = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    for _ in 0..ITERS {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, mul, add);
        }
    }
    let mut out = [0.0f32; 8];
    let mut s = _mm256_setzero_ps();
    for a in acc {
        s = _mm256_add_ps(s, a);
    }
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}

/// The portable path (and NEON): `CHAINS` scalar chains of `mul_add`, a lower bound of the peak there.
fn fma_loop_scalar(seed: f32) -> f32 {
    let mut acc = [seed; CHAINS];
    for _ in 0..ITERS / 16 {
        for a in acc.iter_mut() {
            *a = black_box(a.mul_add(0.999_999, 1e-7));
        }
    }
    acc.iter().sum::<f32>()
}

/// Bytes each thread's share of the bandwidth probe reads.
const PROBE_BYTES: usize = 1 << 30;

/// Streaming read of a 1 GiB buffer on every thread of the pool, best of `repeats`: GB/s.
pub fn dram_read_gbs(repeats: usize) -> f64 {
    let buf = dram_probe_buffer();
    (0..repeats.max(1))
        .map(|_| stream_read_gbs(&buf))
        .fold(0.0, f64::max)
}

/// The bandwidth probe's 1 GiB buffer, for callers that interleave single passes with other work: in the
/// kind of memory the kernels' weights are in ([`super::kernel::WeightMemoryWords`]), so that a kernel's
/// share of the probe compares reads of like pages.
pub fn dram_probe_buffer() -> super::kernel::WeightMemoryWords {
    super::kernel::WeightMemoryWords::filled(PROBE_BYTES / 8, |i| i as u64)
}

/// One parallel streaming read of `buf` on every thread of the pool: GB/s.
pub fn stream_read_gbs(buf: &[u64]) -> f64 {
    let start = Instant::now();
    let s: u64 = buf
        .par_chunks(1 << 16)
        .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
        .sum();
    black_box(s);
    std::mem::size_of_val(buf) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// The peak resident memory of this process so far (`VmHWM` of `/proc/self/status`) in GB (1e9 bytes);
/// `None` where the kernel does not report it (not Linux).
pub fn peak_resident_gb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0 / 1e9)
}

/// Resets the peak resident memory to the current resident size (Linux: `5` to `/proc/self/clear_refs`),
/// so that the next [`peak_resident_gb`] measures what follows; a no-op elsewhere.
pub fn reset_peak_resident() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bandwidth probe reads the kind of memory the weights are in: buffers of a huge page or more
    /// in an advised mapping (it read a `Vec` of small pages, which read slower than the weights).
    #[test]
    fn the_probe_buffer_is_weight_memory() {
        use super::super::kernel::WeightMemoryWords;
        let words = WeightMemoryWords::filled((4 << 20) / 8, |i| i as u64 * 3);
        assert_eq!(words.len(), (4 << 20) / 8);
        assert!(words.iter().enumerate().all(|(i, &w)| w == i as u64 * 3));
        assert_eq!(words.as_ptr() as usize % 64, 0);
        #[cfg(target_os = "linux")]
        assert!(words.in_huge_page_mapping());
        let small = WeightMemoryWords::filled(100, |i| i as u64);
        assert!(!small.in_huge_page_mapping());
        assert_eq!(small[99], 99);
    }

    #[test]
    fn the_fma_probe_counts_lanes_of_the_path() {
        assert_eq!(lanes(SimdPath::Avx512), 16);
        assert_eq!(lanes(SimdPath::Portable), 1);
        // The loop's value is finite and deterministic (the probe must not be optimised away).
        let a = fma_loop(SimdPath::Portable, 1.0);
        assert!(a.is_finite() && a > 0.0);
        assert_eq!(a.to_bits(), fma_loop(SimdPath::Portable, 1.0).to_bits());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn peak_resident_memory_grows_with_an_allocation_touched() {
        let before = peak_resident_gb().expect("VmHWM on Linux");
        let v = vec![1u8; 256 << 20];
        black_box(&v);
        let after = peak_resident_gb().unwrap();
        assert!(after >= before && after > 0.25, "{before} -> {after}");
    }
}
