//! Criterion timings of the CubeCL kernels on the default wgpu adapter (a GPU, or lavapipe on a CPU-only
//! machine): GEMV (1 token) and GEMM (64 tokens) per format on one Qwen3-30B-A3B expert projection
//! (`[768, 2048]`), and the grouped MoE over 16 experts for 16 tokens, top-4. Each iteration waits for the
//! device. `cargo bench -p cube_kernels`; the H200 table comes from `qarl bench kernels` (scripts/gpu_check.sh).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use cube_kernels::{Kernels, MatmulPath, MoeRouting, PackedWeights, WeightFormat};

fn bench(c: &mut Criterion) {
    let k = match std::panic::catch_unwind(Kernels::wgpu) {
        Ok(Ok(k)) => k,
        _ => {
            eprintln!("no wgpu adapter: nothing to benchmark");
            return;
        }
    };
    let (out, inn) = (768, 2048);
    let mut group = c.benchmark_group("lowbit_kernels");
    group.sample_size(10);
    for name in ["int4-g128", "int8-pc", "fp8-b128"] {
        let format = WeightFormat::parse(name).unwrap();
        let w = k.upload_weights(&PackedWeights::random(format, 1, out, inn, 1).unwrap());
        for (path, n) in [(MatmulPath::Gemv, 1usize), (MatmulPath::Gemm, 64)] {
            let x = k.upload_f32(&vec![0.5f32; n * inn]);
            group.bench_with_input(BenchmarkId::new(format!("{path:?}"), name), &n, |b, &n| {
                b.iter(|| {
                    let y = k.linear_with(&x, n, &w, path).unwrap();
                    k.sync().unwrap();
                    y
                })
            });
        }
        let (experts, top_k, tokens, hidden, inter) = (16, 4, 16, 512, 256);
        let gate =
            k.upload_weights(&PackedWeights::random(format, experts, inter, hidden, 2).unwrap());
        let up =
            k.upload_weights(&PackedWeights::random(format, experts, inter, hidden, 3).unwrap());
        let down =
            k.upload_weights(&PackedWeights::random(format, experts, hidden, inter, 4).unwrap());
        let ids: Vec<u32> = (0..tokens * top_k)
            .map(|i| ((i * 7 + i / top_k) % experts) as u32)
            .collect();
        let routing = MoeRouting::new(&ids, tokens, top_k, experts).unwrap();
        let x = k.upload_f32(&vec![0.25f32; tokens * hidden]);
        let rw = k.upload_f32(&vec![0.25f32; tokens * top_k]);
        group.bench_function(BenchmarkId::new("moe", name), |b| {
            b.iter(|| {
                let y = k.moe(&x, &routing, &rw, &gate, &up, &down).unwrap();
                k.sync().unwrap();
                y
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
