//! Rollout throughput on the tiny random Qwen3-MoE (`configs/models/qwen3-moe-tiny.json`): f32 weights against
//! int4-g128 and int8-pc, prefill + batched KV-cache decode. Reported as generated tokens per second.
//!
//! `cargo bench --bench rollout`. For the big model and every scheme side by side use
//! `qarl bench rollout` (see the README).

use std::path::Path;
use std::time::Duration;

use burn::tensor::Device;
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use qarl::model::init::write_random_checkpoint;
use qarl::model::Decoder;
use qarl::quant::{Precision, QuantScheme};
use qarl::rollout::{generate, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BATCH: usize = 4;
const PROMPT_LEN: usize = 16;
const NEW_TOKENS: usize = 16;

fn rollout(c: &mut Criterion) {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen3-moe-tiny.json");
    let dir = tempfile::tempdir().expect("temporary directory");
    write_random_checkpoint(&config, dir.path(), 0, 0.02).expect("random checkpoint");
    let mut model = Decoder::load(dir.path(), &Device::flex()).expect("load the random checkpoint");
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..BATCH)
        .map(|_| {
            (0..PROMPT_LEN)
                .map(|_| rng.random_range(0..vocab))
                .collect()
        })
        .collect();
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: NEW_TOKENS,
        ..Default::default()
    };

    let mut group = c.benchmark_group("rollout_qwen3_moe_tiny");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements((BATCH * NEW_TOKENS) as u64));
    for precision in [
        Precision::F32,
        Precision::Quantized(QuantScheme::Int4G128),
        Precision::Quantized(QuantScheme::Int8PerChannel),
    ] {
        model.set_precision(precision).expect("quantize");
        let name = precision.name();
        group.bench_function(name, |b| {
            b.iter(|| generate(&model, &prompts, 1, &params, None));
        });
    }
    group.finish();
}

criterion_group!(benches, rollout);
criterion_main!(benches);
