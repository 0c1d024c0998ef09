//! Device-to-host reads on the wgpu backend (issue 25): a decode step of the tiny Qwen3-MoE with int4
//! weights reads the device once (its logits, with the routing riding along), and the aligned training
//! forward with routing replay reads nothing in its layers. `qarl::host` counts every read of a tensor
//! that is not on the CPU backend; the counter is process-wide, so this file holds one test (its own
//! process: no other test reads meanwhile). It also checks what `qarl bench rollout --backend wgpu`
//! reports.
//!
//! Runs on whatever adapter wgpu finds; skips with a message when there is none, unless
//! `QARL_REQUIRE_WGPU=1`.
#![cfg(feature = "wgpu")]

mod common;

use std::path::Path;

use burn::tensor::Device;
use qarl::host::{to_f32_vec, ReadCount};
use qarl::model::mlp::routing_to_host;
use qarl::model::{Decoder, Weights};
use qarl::ops::BackendKind;
use qarl::quant::{QuantConfig, QuantScheme};
use qarl::rollout::{generate, SamplingParams};
use qarl::train::batch::{replay_routing, ForwardOptions, PrefixSharing, SeqBatch};

/// The wgpu device, or `None` (skip) when there is no adapter; a missing one fails the test under
/// `QARL_REQUIRE_WGPU=1`.
fn wgpu_device() -> Option<Device> {
    match BackendKind::Wgpu.device() {
        Ok(d) => Some(d),
        Err(e) if std::env::var("QARL_REQUIRE_WGPU").is_ok_and(|v| v == "1") => {
            panic!("QARL_REQUIRE_WGPU=1 but {e:#}")
        }
        Err(e) => {
            eprintln!("SKIPPED: {e:#}");
            None
        }
    }
}

/// The model in `dir` on `device` with int4 weights; with `train`, every master weight tracked (the
/// aligned training forward of an RL update).
fn int4_model(dir: &Path, device: &Device, train: bool) -> Decoder {
    let mut model = Decoder::load(dir, device).unwrap();
    if train {
        for (_, lin) in model.linears_mut() {
            lin.weight = lin.weight.clone().map(|t| t.require_grad());
        }
    }
    model
        .quantize(&QuantConfig::new(QuantScheme::Int4G32))
        .unwrap();
    model
}

/// Must-show (issue 25): the host-read counter is exactly 1 per decode step of an int4 rollout of the tiny
/// MoE on wgpu (and of an f32 one, whose experts run masked on the device with the loop's bits), and 0 in the layers of the aligned training forward with routing replay, whose log-probs
/// are still the rollout's bit for bit; without replay too (the grouped training pair groups on the
/// device). With the grouped kernel switched off, the per-expert loop groups the tokens on the host and
/// reads each MoE layer's ids, in a decode step and in a training forward: the counter sees both (it can
/// fail). `qarl bench rollout` reports the same counts.
#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); run: cargo test --features wgpu --test host_reads_wgpu -- --include-ignored"]
fn one_host_read_per_decode_step_and_none_per_layer_of_the_training_forward() {
    let Some(device) = wgpu_device() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen3-moe-arith.json");
    qarl::model::init::write_random_checkpoint(&config, tmp.path(), 7, 0.1).unwrap();

    let rollout_model = int4_model(tmp.path(), &device, false);
    let layers = rollout_model.layers.len();
    let top_k = rollout_model
        .config
        .moe
        .as_ref()
        .unwrap()
        .num_experts_per_tok;
    let prompts = vec![
        vec![2, 10, 11, 12],
        vec![2, 20, 21],
        vec![2, 30, 31, 32, 33],
    ];
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 6,
        seed: 3,
        ..SamplingParams::default()
    };
    let out = generate(&rollout_model, &prompts, 2, &params, None);
    assert!(out.decode_steps >= 3, "{} decode steps", out.decode_steps);
    assert_eq!(
        out.decode_host_reads, out.decode_steps as u64,
        "host reads of {} decode steps",
        out.decode_steps
    );
    // The counter sees per-layer reads: with the grouped kernel off, the per-expert loop reads each MoE
    // layer's ids, so a step reads 1 + layers times.
    qarl::ops::set_grouped_experts(false);
    let looped = generate(&rollout_model, &prompts, 2, &params, None);
    qarl::ops::set_grouped_experts(true);
    assert_eq!(
        looped.decode_host_reads,
        looped.decode_steps as u64 * (1 + layers as u64),
        "host reads of {} decode steps through the per-expert loop",
        looped.decode_steps
    );
    // Full-precision experts: masked on the device in a decode step, one read per step too, and the same
    // tokens and log-probs (bit for bit) as the per-expert loop's host grouping.
    let f32_model = Decoder::load(tmp.path(), &device).unwrap();
    let masked = generate(&f32_model, &prompts, 2, &params, None);
    assert_eq!(
        masked.decode_host_reads, masked.decode_steps as u64,
        "host reads of {} f32 decode steps",
        masked.decode_steps
    );
    qarl::ops::set_grouped_experts(false);
    let f32_looped = generate(&f32_model, &prompts, 2, &params, None);
    qarl::ops::set_grouped_experts(true);
    assert_eq!(
        f32_looped.decode_host_reads,
        f32_looped.decode_steps as u64 * (1 + layers as u64),
        "f32 decode steps through the per-expert loop"
    );
    assert_eq!(masked.ids, f32_looped.ids, "f32: masked vs looped tokens");
    let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
        v.iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert_eq!(
        bits(&masked.logprobs),
        bits(&f32_looped.logprobs),
        "f32: masked vs looped log-probs"
    );

    for (r, rec) in out.routing.iter().enumerate() {
        for l in rec {
            assert_eq!(
                l.as_ref().map(Vec::len),
                Some((out.ids[r].len() - 1) * top_k)
            );
        }
    }

    // The aligned training forward of these sequences, the rollout's routing replayed.
    let train_model = int4_model(tmp.path(), &device.clone().autodiff(), true);
    let batch = SeqBatch::new(out.ids.clone(), out.prompt_lens.clone());
    let records: Vec<_> = out.routing.iter().collect();
    let replay = replay_routing(&records, &batch.seqs, top_k, layers);
    let forward = |replay: Option<&[Option<Vec<u32>>]>, sharing| {
        let opts = ForwardOptions {
            sharing,
            ..ForwardOptions::default()
        };
        batch.logprobs_with(
            &train_model,
            Weights::Packed,
            params.temperature,
            replay,
            opts,
        )
    };
    let reads = ReadCount::start();
    // The samples of a prompt share its forward: a prompts' forward, then the responses' forward.
    let (lp, fwd) = forward(Some(&replay), PrefixSharing::Auto);
    assert_eq!(fwd.layer_reads, 0, "host reads in the layers under replay");
    // The head's fixed-order log-softmax reads its logits: not a per-layer read.
    eprintln!(
        "training forward with replay: {} reads in all, {} in the layers",
        reads.reads(),
        fwd.layer_reads
    );
    let lp = batch.responses_of(&to_f32_vec(lp));
    for (r, (a, b)) in lp.iter().zip(&out.logprobs).enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "row {r}: training forward vs rollout");
    }

    // One forward of every sequence, without replay: the grouped training pair groups by the router's own
    // choices on the device, so nothing is read in the layers either.
    let (_, unreplayed) = forward(None, PrefixSharing::Off);
    assert_eq!(
        unreplayed.layer_reads, 0,
        "without replay: host reads in the layers of the grouped training forward"
    );
    // The counter sees a training forward's per-layer reads: through the per-expert graph (grouped
    // kernel off), which groups on the host, it reads each MoE layer's ids.
    qarl::ops::set_grouped_experts(false);
    let (_, looped_train) = forward(None, PrefixSharing::Off);
    qarl::ops::set_grouped_experts(true);
    assert_eq!(
        looped_train.layer_reads, layers as u64,
        "without replay, per-expert graph: one read per MoE layer"
    );

    // The routing the rollout read back with its logits is the experts the training forward picks.
    let learner = routing_to_host(unreplayed.routing);
    let t = unreplayed.padded_len;
    for (r, rec) in out.routing.iter().enumerate() {
        for (l, rec) in rec.iter().enumerate() {
            let rec = rec.as_ref().unwrap();
            let fwd = &learner[l].as_ref().unwrap()[r * t * top_k..][..rec.len()];
            assert_eq!(
                fwd,
                &rec[..],
                "row {r} layer {l}: recorded vs training routing"
            );
        }
    }

    bench_rollout_reports_the_reads_per_decode_step(tmp.path(), layers);
}

/// `qarl bench rollout --backend wgpu` on the model in `dir` reports the decode step's reads: 1 with int4
/// weights (the grouped MoE kernel) and with f32 ones (the experts masked on the device).
fn bench_rollout_reports_the_reads_per_decode_step(dir: &Path, layers: usize) {
    let json = dir.join("bench.json");
    let v = common::run_qarl_json(
        std::process::Command::new(env!("CARGO_BIN_EXE_qarl"))
            .args(["bench", "rollout", "--model"])
            .arg(dir)
            .args(["--schemes", "f32,int4-g32", "--backend", "wgpu"])
            .args(["--batch", "2", "--prompt-len", "4", "--new-tokens", "4"])
            .args(["--repeats", "1", "--json"])
            .arg(&json),
        &json,
    );
    let reads: Vec<f64> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["host_reads_per_decode_step"].as_f64().unwrap())
        .collect();
    assert_eq!(
        reads,
        vec![1.0, 1.0],
        "bench rollout: f32, int4-g32 ({layers} MoE layers)"
    );
}
