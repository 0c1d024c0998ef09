//! Criterion timings of the CubeCL kernels on the default wgpu adapter (a GPU, or lavapipe on a CPU-only
//! machine): GEMV (1 token) and GEMM (64 tokens) per format on one Qwen3-30B-A3B expert projection
//! (`[768, 2048]`), and the grouped MoE over 16 experts for 16 tokens, top-4; for weight-only formats also
//! the tensor-core tiles' order (`GroupedScalar`, and `Mma` on f16 activations where the adapter has the
//! instruction). Each iteration waits for the device. `cargo bench -p cube_kernels`; the H200 table comes from `qarl bench kernels` (scripts/gpu_check.sh).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use cube_kernels::{ActDType, Kernels, MatmulPath, MoeRouting, PackedWeights, WeightFormat};

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
        // The activations' type of each path: f32, except the instruction's half operands.
        let mut paths = vec![
            (MatmulPath::Gemv, 1usize, ActDType::F32),
            (MatmulPath::Gemm, 64, ActDType::F32),
        ];
        if !format.quantizes_activations() {
            paths.push((MatmulPath::GroupedScalar, 64, ActDType::F32));
            if k.supports_mma(ActDType::F16) {
                paths.push((MatmulPath::Mma, 64, ActDType::F16));
            }
        }
        for &(path, n, dtype) in &paths {
            let x = k.upload(&vec![0.5f32; n * inn], dtype).unwrap();
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
        let moe_paths = paths
            .iter()
            .filter(|(path, ..)| path.tiles(ActDType::F32).is_some())
            .map(|&(path, _, dtype)| (path, dtype));
        for (path, dtype) in [(MatmulPath::Auto, ActDType::F32)]
            .into_iter()
            .chain(moe_paths)
        {
            let x = k.upload(&vec![0.25f32; tokens * hidden], dtype).unwrap();
            let rw = k.upload(&vec![0.25f32; tokens * top_k], dtype).unwrap();
            let id = BenchmarkId::new(format!("moe/{path:?}"), name);
            group.bench_function(id, |b| {
                b.iter(|| {
                    let y = k
                        .moe_with(&x, &routing, &rw, [&gate, &up, &down], path)
                        .unwrap();
                    k.sync().unwrap();
                    y
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
