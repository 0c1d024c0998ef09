//! The CPU low-bit matmuls side by side, weights rotated over >= 1 GiB of copies so every call reads them
//! from DRAM (cold): our int4 / int8 / fp8 kernels, burn `flex` f32, candle-core's GGUF Q4_0 / Q4_K / Q8_0
//! (with `--features candle-bench`) and a streaming-read bandwidth probe. GEMV (m = 1) and GEMM
//! (m = 8, 32, 128) on a 4096 x 4096 weight. Prints a markdown table: time per call, GB/s of weight bytes
//! (codes + scales) and % of the probe's bandwidth.
//!
//! `cargo bench --bench lowbit_matmul [--features candle-bench]`; `QARL_BENCH_QUICK=1` for a short run,
//! `QARL_SIMD=avx2|portable` to time a slower path, `QARL_BENCH_ONLY=int8-pc,Q4_K` to time only the kernels
//! whose names contain one of the comma-separated words. The kernels run one after another in one process,
//! and one that runs after another one's gigabyte of copies was freed can come out slower than alone (int8-pc
//! measured 0.85 ms after the int4 kernels, 0.51 ms alone, on a 2-core Zen 4 VM); time each kernel in its own
//! process (`QARL_BENCH_ONLY`) for the best-case numbers.

use std::hint::black_box;
use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use qarl::quant::cpu_kernel::{KernelWeights, SimdPath};
use qarl::quant::{QuantScheme, QuantizedTensor};
use rayon::prelude::*;

const N: usize = 4096;
const ROTATE_BYTES: usize = 1 << 30;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Median seconds per call of `f(copy index)` over `iters` calls cycling through `copies`.
fn time(copies: usize, iters: usize, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..copies.min(4) {
        f(i);
    }
    let mut t = Vec::with_capacity(iters);
    for i in 0..iters {
        let start = Instant::now();
        f(i % copies);
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Streaming read of a 1 GiB buffer on every thread of the pool, best of 5: GB/s.
fn bandwidth_probe() -> f64 {
    let buf: Vec<u64> = (0..ROTATE_BYTES / 8).map(|i| i as u64).collect();
    let mut best = 0.0f64;
    for _ in 0..5 {
        let start = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .sum();
        black_box(s);
        best = best.max(ROTATE_BYTES as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// Whether the kernel `name` is selected by `QARL_BENCH_ONLY` (all are when it is unset).
fn selected(name: &str) -> bool {
    match std::env::var("QARL_BENCH_ONLY") {
        Ok(only) => only
            .split(',')
            .any(|w| !w.is_empty() && name.contains(w.trim())),
        Err(_) => true,
    }
}

struct Row {
    name: String,
    m: usize,
    secs: f64,
    bytes: usize,
}

fn main() {
    let quick = std::env::var("QARL_BENCH_QUICK").is_ok();
    let ms: &[usize] = if quick { &[1, 8] } else { &[1, 8, 32, 128] };
    let iters = |m: usize| {
        if quick {
            8
        } else if m >= 32 {
            12
        } else {
            40
        }
    };
    let probe = bandwidth_probe();
    println!(
        "# lowbit_matmul: {N}x{N}, {} threads, SIMD path {}, DRAM probe {probe:.1} GB/s\n",
        rayon::current_num_threads(),
        SimdPath::detect().name()
    );
    let w = values(N * N, 1);
    let mut rows: Vec<Row> = Vec::new();

    for scheme in [
        QuantScheme::Int4G32,
        QuantScheme::Int4G128,
        QuantScheme::Int8PerChannel,
        QuantScheme::Fp8Block128,
    ] {
        if !selected(&format!("qarl {}", scheme.name())) {
            continue;
        }
        let q = QuantizedTensor::quantize(&w, N, N, scheme).expect("quantize");
        let k = KernelWeights::new(&q);
        let bytes = k.storage_bytes();
        let copies: Vec<KernelWeights> = (0..ROTATE_BYTES.div_ceil(bytes))
            .map(|_| k.clone())
            .collect();
        for &m in ms {
            let x = values(m * N, 2 + m as u64);
            let secs = time(copies.len(), iters(m), |i| {
                black_box(copies[i].matmul(&x, m));
            });
            rows.push(Row {
                name: format!("qarl {}", scheme.name()),
                m,
                secs,
                bytes,
            });
        }
    }

    if selected("burn flex f32") {
        let device = Device::flex();
        let bytes = N * N * 4;
        let copies: Vec<Tensor<2>> = (0..ROTATE_BYTES.div_ceil(bytes))
            .map(|c| {
                Tensor::from_data(
                    TensorData::new(values(N * N, 10 + c as u64), [N, N]),
                    &device,
                )
            })
            .collect();
        for &m in ms {
            let x: Tensor<2> =
                Tensor::from_data(TensorData::new(values(m * N, 3), [m, N]), &device);
            let secs = time(copies.len(), iters(m), |i| {
                black_box(x.clone().matmul(copies[i].clone()).into_data());
            });
            rows.push(Row {
                name: "burn flex f32".into(),
                m,
                secs,
                bytes,
            });
        }
    }

    #[cfg(feature = "candle-bench")]
    candle::run(&w, ms, &iters, &mut rows);

    println!("| kernel | m | time/call | weight GB/s | % of probe |");
    println!("|---|---:|---:|---:|---:|");
    for r in &rows {
        let gbs = r.bytes as f64 / r.secs / 1e9;
        println!(
            "| {} | {} | {:.3} ms | {:.1} | {:.0}% |",
            r.name,
            r.m,
            r.secs * 1e3,
            gbs,
            100.0 * gbs / probe
        );
    }
}

#[cfg(feature = "candle-bench")]
mod candle {
    use super::*;
    use candle_core::quantized::k_quants::{self, BlockQ4K, BlockQ4_0, BlockQ8_0, GgmlType};

    fn one<T: GgmlType>(
        name: &str,
        w: &[f32],
        ms: &[usize],
        iters: &dyn Fn(usize) -> usize,
        rows: &mut Vec<Row>,
    ) {
        if !selected(&format!("candle {name}")) {
            return;
        }
        let mut blocks = vec![T::zeros(); N * N / T::BLCK_SIZE];
        T::from_float(w, &mut blocks);
        let bytes = blocks.len() * std::mem::size_of::<T>();
        let copies: Vec<Vec<T>> = (0..ROTATE_BYTES.div_ceil(bytes))
            .map(|_| blocks.clone())
            .collect();
        for &m in ms {
            let x = values(m * N, 4);
            let mut y = vec![0.0f32; m * N];
            let secs = time(copies.len(), iters(m), |i| {
                k_quants::matmul((m, N, N), &x, &copies[i], &mut y).expect("candle matmul");
                black_box(&y);
            });
            rows.push(Row {
                name: format!("candle {name}"),
                m,
                secs,
                bytes,
            });
        }
    }

    pub fn run(w: &[f32], ms: &[usize], iters: &dyn Fn(usize) -> usize, rows: &mut Vec<Row>) {
        one::<BlockQ4_0>("Q4_0", w, ms, iters, rows);
        one::<BlockQ4K>("Q4_K", w, ms, iters, rows);
        one::<BlockQ8_0>("Q8_0", w, ms, iters, rows);
    }
}
