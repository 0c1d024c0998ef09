//! The learner's matmuls on SmolLM2-135M shapes (hidden 576, intermediate 1536, 2048 tokens): burn flex's
//! matmul (the `gemm` crate, blocking chosen from the detected caches) against ours (fixed-order kernels,
//! the same bits on every machine), side by side in one run, with the FMA peak probed in the same run.
//! A second table times the forward's own products, which the rollout shares bit for bit: the low-bit
//! kernel on int4-g32 weights and the deterministic f32 `x · w^T`, at a rollout decode step's 64 rows and
//! at 2048 (the learner's forward), against burn's f32 matmul of the same product.
//!
//! `cargo bench --bench train_matmul` (`QARL_BENCH_QUICK=1` for fewer repeats). Prints a table.

use std::hint::black_box;
use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use qarl::ops::cpu::kernel::gemm::{gemm, Strided};
use qarl::ops::cpu::kernel::{f32_matmul_nt, KernelWeights, SimdPath};
use qarl::ops::cpu::probe::fma_peak_gflops;
use qarl::quant::{QuantScheme, QuantizedTensor};

const TOKENS: usize = 2048;
const HIDDEN: usize = 576;
const INTER: usize = 1536;

/// Which product: `A · B` with `A [m, k]`, `B [k, n]` (`nn`), `B` stored `[n, k]` (`nt`), or `A` stored
/// `[k, m]` (`tn`).
#[derive(Clone, Copy)]
enum Kind {
    Nn,
    Nt,
    Tn,
}

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 * 1e-3 - 0.5
        })
        .collect()
}

fn median_secs(repeats: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..repeats)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// What the learner runs: the forward's `x W` and the backward's products on the blocked fixed-order GEMM,
/// transposed operands read through strides.
fn ours(kind: Kind, a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    match kind {
        Kind::Nn => gemm(Strided::rows(a, k), Strided::rows(b, n), m, k, n),
        Kind::Nt => gemm(Strided::rows(a, k), Strided::transposed(b, k), m, k, n),
        Kind::Tn => gemm(Strided::transposed(a, m), Strided::rows(b, n), m, k, n),
    }
}

fn burn_matmul(kind: Kind, a: &Tensor<2>, b: &Tensor<2>) -> Tensor<2> {
    match kind {
        Kind::Nn => a.clone().matmul(b.clone()),
        Kind::Nt => a.clone().matmul(b.clone().transpose()),
        Kind::Tn => a.clone().transpose().matmul(b.clone()),
    }
}

fn main() {
    let quick = std::env::var("QARL_BENCH_QUICK").is_ok();
    let repeats = if quick { 3 } else { 7 };
    let path = SimdPath::detect();
    let peak = fma_peak_gflops(path, 5);
    println!(
        "# train_matmul: {} threads, SIMD path {}, FMA peak {peak:.0} GFLOP/s\n",
        rayon::current_num_threads(),
        path.name()
    );
    println!("| product | m x k x n | burn flex (gemm) GFLOP/s | ours GFLOP/s | ours / gemm | ours % of peak |");
    println!("|---|---|---:|---:|---:|---:|");
    let device = Device::flex();
    let cases = [
        ("forward x W (up)", Kind::Nn, TOKENS, HIDDEN, INTER),
        ("forward x W (down)", Kind::Nn, TOKENS, INTER, HIDDEN),
        ("dx = g W^T (up)", Kind::Nt, TOKENS, INTER, HIDDEN),
        ("dx = g W^T (down)", Kind::Nt, TOKENS, HIDDEN, INTER),
        ("dx = g W' (quantized up)", Kind::Nn, TOKENS, INTER, HIDDEN),
        ("dW = x^T g (up)", Kind::Tn, HIDDEN, TOKENS, INTER),
        ("dW = x^T g (down)", Kind::Tn, INTER, TOKENS, HIDDEN),
        ("dW = x^T g (q)", Kind::Tn, HIDDEN, TOKENS, HIDDEN),
    ];
    for (name, kind, m, k, n) in cases {
        let (a_shape, b_shape) = match kind {
            Kind::Nn => ([m, k], [k, n]),
            Kind::Nt => ([m, k], [n, k]),
            Kind::Tn => ([k, m], [k, n]),
        };
        let a = values(m * k, 1);
        let b = values(k * n, 2);
        let ta = Tensor::<2>::from_data(TensorData::new(a.clone(), a_shape), &device);
        let tb = Tensor::<2>::from_data(TensorData::new(b.clone(), b_shape), &device);
        let flops = 2.0 * (m * k * n) as f64;
        let t_burn = median_secs(repeats, || {
            black_box(burn_matmul(kind, &ta, &tb).into_data());
        });
        let t_ours = median_secs(repeats, || {
            black_box(ours(kind, &a, &b, m, k, n));
        });
        let (g_burn, g_ours) = (flops / t_burn / 1e9, flops / t_ours / 1e9);
        println!(
            "| {name} | {m} x {k} x {n} | {g_burn:.1} | {g_ours:.1} | {:.2}x | {:.0}% |",
            g_ours / g_burn,
            100.0 * g_ours / peak
        );
    }
    forward_products(repeats, peak, &device);
}

/// One timed product.
type Product<'a> = Box<dyn Fn() -> Vec<f32> + 'a>;

/// The forward's products `y = x · W^T` (`W` stored `[out, in]`) on the kernels the rollout shares.
fn forward_products(repeats: usize, peak: f64, device: &Device) {
    println!("\n| forward product (shared with the rollout) | m x in x out | burn flex (gemm) GFLOP/s | ours GFLOP/s | ours / gemm | ours % of peak |");
    println!("|---|---|---:|---:|---:|---:|");
    for (label, inn, out) in [("up", HIDDEN, INTER), ("down", INTER, HIDDEN)] {
        let w = values(out * inn, 3);
        let q =
            QuantizedTensor::quantize(&w, out, inn, QuantScheme::Int4G32).expect("finite weights");
        let kernel = KernelWeights::new(&q);
        let wq = q.dequantize();
        for m in [64, TOKENS] {
            let x = values(m * inn, 4);
            let tx = Tensor::<2>::from_data(TensorData::new(x.clone(), [m, inn]), device);
            let tw = Tensor::<2>::from_data(TensorData::new(wq.clone(), [out, inn]), device);
            let t_burn = median_secs(repeats, || {
                black_box(tx.clone().matmul(tw.clone().transpose()).into_data());
            });
            let flops = 2.0 * (m * inn * out) as f64;
            let g_burn = flops / t_burn / 1e9;
            let rows: [(&str, Product); 2] = [
                ("int4-g32", Box::new(|| kernel.matmul(&x, m))),
                (
                    "f32 x w^T",
                    Box::new(|| f32_matmul_nt(&x, &wq, 1, m, inn, out)),
                ),
            ];
            for (kind, run) in rows {
                let t = median_secs(repeats, || {
                    black_box(run());
                });
                let g = flops / t / 1e9;
                println!(
                    "| {kind} ({label}) | {m} x {inn} x {out} | {g_burn:.1} | {g:.1} | {:.2}x | {:.0}% |",
                    g / g_burn,
                    100.0 * g / peak
                );
            }
        }
    }
}
