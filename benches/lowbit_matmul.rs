//! The CPU low-bit matmuls side by side, weights rotated over >= 1 GiB of copies so every call reads them
//! from DRAM (cold): our int4 / int8 / fp8 / nvfp4 / mxfp4 kernels, burn `flex` f32, candle-core's GGUF
//! Q4_0 / Q4_K / Q8_0 (with `--features candle-bench`) and a streaming-read bandwidth probe. GEMV (m = 1) and GEMM
//! (m = 8, 32, 128) on a 4096 x 4096 weight. Prints a markdown table: time per call, GB/s of weight bytes
//! (codes + scales) and % of the probe's bandwidth.
//!
//! `cargo bench --bench lowbit_matmul [--features candle-bench]`; `QARL_BENCH_QUICK=1` for a short run,
//! `QARL_SIMD=avx2|portable` to time a slower path, `QARL_BENCH_ONLY=int8-pc,Q4_K` to time only the kernels
//! whose names contain one of the comma-separated words. The kernels run one after another in one process,
//! and one that runs after another one's gigabyte of copies was freed can come out slower than alone (int8-pc
//! measured 0.85 ms after the int4 kernels, 0.51 ms alone, on a 2-core Zen 4 VM); time each kernel in its own
//! process (`QARL_BENCH_ONLY`) for the best-case numbers.
//!
//! `QARL_BENCH_PAIRED=int4-g128,nvfp4,mxfp4` times our GEMV (m = 1) of the listed schemes and the bandwidth
//! probe in alternation instead: every round streams the probe's buffer once, then runs a block of calls of
//! each kernel, so each kernel's % of the probe compares it with the bandwidth measured next to it in time
//! (medians and quartiles over the rounds). This is the comparison that holds on a VM whose DRAM speed
//! drifts within and between processes (a 2-core Sapphire Rapids VM: int4-g128 alone 0.40-0.94 ms over eight
//! processes).
//!
//! `QARL_BENCH_VERSUS=int4-g128:Q4_K` (with `candle-bench`) runs a head-to-head instead: both kernels' copies
//! (1 GiB each) live at once and blocks of calls alternate, ours then candle's, at m = 1 and 8, so both
//! see the same machine state. On a VM whose DRAM speed changes from process to process (a 2-core Zen 4
//! VM: 2x between runs of the same binary) only such a paired run compares two kernels fairly.

use std::hint::black_box;
use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use qarl::ops::cpu::kernel::{KernelWeights, SimdPath};
use qarl::ops::cpu::probe::{dram_probe_buffer, dram_read_gbs, stream_read_gbs};
use qarl::quant::{QuantScheme, QuantizedTensor};

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
fn time(copies: usize, iters: usize, mut f: impl FnMut(usize) + Send) -> f64 {
    // On a thread of rayon's pool, as `generate` calls the kernels: a call from outside the pool parks the
    // caller and wakes the workers again every time, a dispatch a rollout does not pay and whose cost on a
    // VM varies from process to process (int8-pc alone, called from the main thread: 0.51-0.83 ms over
    // three processes; from a worker: 0.49-0.50 ms over four).
    rayon::scope(|_| {
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
    })
}

/// `QARL_BENCH_PAIRED`: the m = 1 GEMV of each listed scheme and the probe, in alternating rounds (module
/// docs). Prints one row per scheme: median time, median GB/s and the median (with quartiles) over rounds
/// of its GB/s over the probe's GB/s of the same round.
fn paired(w: &[f32], list: &str) {
    const ROUNDS: usize = 40;
    const CALLS: usize = 24;
    let kernels: Vec<(String, Vec<KernelWeights>)> = list
        .split(',')
        .map(|name| {
            let scheme: QuantScheme = name
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("QARL_BENCH_PAIRED: {name}: {e}"));
            let q = QuantizedTensor::quantize(w, N, N, scheme).expect("quantize");
            let k = KernelWeights::new(&q);
            let copies = ROTATE_BYTES.div_ceil(k.storage_bytes());
            (scheme.name().to_string(), vec![k; copies])
        })
        .collect();
    let buf = dram_probe_buffer();
    let x = values(N, 2);
    let mut secs = vec![Vec::new(); kernels.len()];
    let mut share = vec![Vec::new(); kernels.len()];
    let mut probes = Vec::new();
    let mut next = vec![0usize; kernels.len()];
    for _ in 0..ROUNDS {
        let probe = stream_read_gbs(&buf);
        probes.push(probe);
        for (k, (_, copies)) in kernels.iter().enumerate() {
            let t = time(copies.len(), CALLS, |_| {
                next[k] = (next[k] + 1) % copies.len();
                black_box(copies[next[k]].matmul(&x, 1));
            });
            let gbs = copies[0].storage_bytes() as f64 / t / 1e9;
            secs[k].push(t);
            share[k].push(gbs / probe);
        }
    }
    let quantile = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q).round() as usize]
    };
    println!(
        "paired GEMV (m = 1), {ROUNDS} rounds of: one probe pass, {CALLS} calls per kernel; probe median {:.1} GB/s\n",
        quantile(&mut probes, 0.5)
    );
    println!(
        "| kernel | bytes | median time | median GB/s | % of the round's probe: median [q1, q3] |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (k, (name, copies)) in kernels.iter().enumerate() {
        let t = quantile(&mut secs[k], 0.5);
        let bytes = copies[0].storage_bytes();
        let s = &mut share[k];
        println!(
            "| qarl {name} | {bytes} | {:.3} ms | {:.1} | {:.0}% [{:.0}%, {:.0}%] |",
            t * 1e3,
            bytes as f64 / t / 1e9,
            100.0 * quantile(s, 0.5),
            100.0 * quantile(s, 0.25),
            100.0 * quantile(s, 0.75)
        );
    }
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
    if let Ok(list) = std::env::var("QARL_BENCH_PAIRED") {
        println!(
            "# lowbit_matmul paired: {N}x{N}, {} threads, SIMD path {}\n",
            rayon::current_num_threads(),
            SimdPath::detect().name()
        );
        paired(&values(N * N, 1), &list);
        return;
    }
    let probe = dram_read_gbs(5);
    println!(
        "# lowbit_matmul: {N}x{N}, {} threads, SIMD path {}, DRAM probe {probe:.1} GB/s\n",
        rayon::current_num_threads(),
        SimdPath::detect().name()
    );
    let w = values(N * N, 1);
    // The head-to-head replaces the table (timing the table's kernels first would only leave their freed
    // gigabytes of copies behind, which can slow the kernels timed after them).
    #[cfg(feature = "candle-bench")]
    if let Ok(versus) = std::env::var("QARL_BENCH_VERSUS") {
        candle::versus(&w, &versus);
        return;
    }
    let mut rows: Vec<Row> = Vec::new();

    for scheme in [
        QuantScheme::Int4G32,
        QuantScheme::Int4G128,
        QuantScheme::Int8PerChannel,
        QuantScheme::Fp8Block128,
        QuantScheme::Nvfp4,
        QuantScheme::Mxfp4,
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
        let (copies, bytes) = candle_copies::<T>(w);
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

    /// Copies of `w` in candle's `T` blocks over >= 1 GiB and their bytes each.
    fn candle_copies<T: GgmlType>(w: &[f32]) -> (Vec<Vec<T>>, usize) {
        let mut blocks = vec![T::zeros(); N * N / T::BLCK_SIZE];
        T::from_float(w, &mut blocks);
        let bytes = blocks.len() * std::mem::size_of::<T>();
        let copies = (0..ROTATE_BYTES.div_ceil(bytes))
            .map(|_| blocks.clone())
            .collect();
        (copies, bytes)
    }

    /// `QARL_BENCH_VERSUS=<our scheme>:<Q4_0|Q4_K|Q8_0>`: alternating calls, medians side by side.
    pub fn versus(w: &[f32], spec: &str) {
        // On a thread of rayon's pool, as `generate` calls the kernels: a call from outside the pool parks
        // the caller and wakes it again, a dispatch cost a rollout does not pay.
        rayon::scope(|_| versus_in_pool(w, spec))
    }

    fn versus_in_pool(w: &[f32], spec: &str) {
        let Some((ours, theirs)) = spec.split_once(':') else {
            eprintln!(
                "QARL_BENCH_VERSUS wants <scheme>:<candle type>, e.g. int4-g128:Q4_K; got {spec:?}"
            );
            std::process::exit(2);
        };
        let scheme: QuantScheme = match ours.parse() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("QARL_BENCH_VERSUS: {e}");
                std::process::exit(2);
            }
        };
        match theirs {
            "Q4_0" => versus_with::<BlockQ4_0>(w, scheme, theirs),
            "Q4_K" => versus_with::<BlockQ4K>(w, scheme, theirs),
            "Q8_0" => versus_with::<BlockQ8_0>(w, scheme, theirs),
            other => {
                eprintln!("QARL_BENCH_VERSUS: unknown candle type {other:?} (Q4_0, Q4_K, Q8_0)");
                std::process::exit(2);
            }
        }
    }

    fn versus_with<T: GgmlType>(w: &[f32], scheme: QuantScheme, name: &str) {
        let q = QuantizedTensor::quantize(w, N, N, scheme).expect("quantize");
        let k = KernelWeights::new(&q);
        let ours_bytes = k.storage_bytes();
        let ours: Vec<KernelWeights> = (0..ROTATE_BYTES.div_ceil(ours_bytes))
            .map(|_| k.clone())
            .collect();
        let (theirs, theirs_bytes) = candle_copies::<T>(w);
        println!(
            "# head-to-head, alternating calls, {N}x{N}: qarl {} ({} copies of {:.1} MB) vs candle {name} ({} copies of {:.1} MB)\n",
            scheme.name(),
            ours.len(),
            ours_bytes as f64 / 1e6,
            theirs.len(),
            theirs_bytes as f64 / 1e6
        );
        println!("| m | qarl median | candle median | candle / qarl | pairs qarl faster |");
        println!("|---:|---:|---:|---:|---:|");
        for m in [1usize, 8] {
            let x = values(m * N, 5 + m as u64);
            let mut y = vec![0.0f32; m * N];
            // Blocks of calls, ours then candle's: each kernel runs back to back within its block (candle's
            // pool spins for about a millisecond after its last call and would take a core from the
            // first calls of ours, so the first calls of each block are not counted), and the blocks of
            // both sample the same stretch of the machine's state.
            let (blocks, per_block, skip) = if m == 1 { (16, 30, 6) } else { (8, 14, 3) };
            let calls = blocks * (per_block - skip);
            let (mut a, mut b) = (Vec::with_capacity(calls), Vec::with_capacity(calls));
            let mut copy = 0usize;
            for _ in 0..blocks {
                for i in 0..per_block {
                    let start = Instant::now();
                    black_box(ours[(copy + i) % ours.len()].matmul(&x, m));
                    if i >= skip {
                        a.push(start.elapsed().as_secs_f64());
                    }
                }
                for i in 0..per_block {
                    let start = Instant::now();
                    k_quants::matmul((m, N, N), &x, &theirs[(copy + i) % theirs.len()], &mut y)
                        .expect("candle matmul");
                    black_box(&y);
                    if i >= skip {
                        b.push(start.elapsed().as_secs_f64());
                    }
                }
                copy += per_block;
            }
            let faster = a.iter().zip(&b).filter(|(x, y)| x < y).count();
            // (Pairs: the i-th counted call of ours against the i-th of candle's, same block.)
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (ma, mb) = (median(&mut a), median(&mut b));
            println!(
                "| {m} | {:.3} ms | {:.3} ms | {:.2} | {faster}/{calls} |",
                ma * 1e3,
                mb * 1e3,
                mb / ma
            );
        }
    }

    pub fn run(w: &[f32], ms: &[usize], iters: &dyn Fn(usize) -> usize, rows: &mut Vec<Row>) {
        one::<BlockQ4_0>("Q4_0", w, ms, iters, rows);
        one::<BlockQ4K>("Q4_K", w, ms, iters, rows);
        one::<BlockQ8_0>("Q8_0", w, ms, iters, rows);
    }
}
