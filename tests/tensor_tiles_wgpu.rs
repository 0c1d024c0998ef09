//! `train.tensor_cores` (issue 28) on wgpu: the low-bit products of the rollout and of the training forward
//! in the tensor-core tiles' order (`cube_kernels::kernels::mma`, `mma_moe`, or the fragment tiles of
//! `mma_frag` with `train.tensor_core_kernel = "fragments"`). Lavapipe (CI) has no
//! tensor-core instruction, so the tiles run with scalar multiply-adds: the same tiling, staging, scale
//! groups and batch invariance as on a GPU, which is what these tests check end to end; the instruction
//! itself is checked on a GPU by `qarl bench kernels --check` (`scripts/gpu_check.sh`).
//!
//! The order is a process-wide switch that a run sets from its config, so this file runs in its own
//! process and its tests take turns.
#![cfg(feature = "wgpu")]

mod common;

use std::sync::Mutex;

use burn::tensor::DType;
use qarl::model::scoring::response_logprobs;
use qarl::model::{Activations, Decoder};
use qarl::ops::BackendKind;
use qarl::quant::{QuantConfig, QuantScheme};
use qarl::rollout::{generate, SamplingParams};
use qarl::train::{self, TrainConfig};

use common::wgpu_available;

/// The tests of this file flip the process-wide switch: one at a time.
static SWITCH: Mutex<()> = Mutex::new(());

fn bits(v: &[Vec<f32>]) -> Vec<u32> {
    v.iter().flatten().map(|x| x.to_bits()).collect()
}

/// The tiny Qwen3-MoE fixture with int4-g32 weights and f16 activations on `device` (masters tracked on
/// an autodiff device).
fn model(device: &burn::tensor::Device) -> Decoder {
    let dir = common::fixtures_dir().join("qwen3_moe");
    let mut m = Decoder::load(&dir, device).unwrap();
    if device.is_autodiff() {
        for (_, lin) in m.linears_mut() {
            lin.weight = lin.weight.clone().map(|t| t.require_grad());
        }
    }
    m.quantize(&QuantConfig::new(QuantScheme::Int4G32)).unwrap();
    m.set_activations(Activations::F16).unwrap();
    m
}

/// The rollout's recorded log-probs are bitwise the training forward's (gradients tracked) with both in
/// the tiles' order; both took it (the tile-product counter moves in each); and the order is not the
/// canonical one (the same responses re-scored in the canonical order differ in some bits).
#[test]
fn tiles_keep_the_rollout_and_the_training_forward_bitwise_equal() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    rollout_and_training_forward_agree(false);
}

/// The same on the fragment tiles (`train.tensor_core_kernel = "fragments"`): rollout and training
/// forward bitwise equal, both on the fragment tiles (their counter moves in each), and (the scalar twins
/// giving the tiles' bits) the same log-probs as the tiles give.
#[test]
fn fragment_tiles_keep_the_rollout_and_the_training_forward_bitwise_equal() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(on_fragments) = rollout_and_training_forward_agree(true) else {
        return;
    };
    let on_tiles = rollout_and_training_forward_agree(false).unwrap();
    assert_eq!(
        on_fragments, on_tiles,
        "the fragment tiles' twin gave other log-probs than the tiles' twin"
    );
}

/// The same with the fragment tiles' scale groups split among up to 4 sets of planes
/// (`train.fragment_group_splits = 4`; on lavapipe, whose runtime names no multiprocessors, every call
/// whose groups allow it splits: the fixture's q/k/v/gate/up (2 groups of int4-g32), o (4) and dense
/// down (3) products): rollout and training forward bitwise equal, both on the split kernels (their
/// counter moves in each), and the tiles' log-probs.
#[test]
fn split_scale_groups_keep_the_rollout_and_the_training_forward_bitwise_equal() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    qarl::ops::set_fragment_group_splits(4);
    let before = qarl::ops::split_group_products();
    let split = rollout_and_training_forward_agree(true);
    let after = qarl::ops::split_group_products();
    qarl::ops::set_fragment_group_splits(1);
    let Some(split) = split else { return };
    assert!(after > before, "no product ran on the split kernels");
    let on_tiles = rollout_and_training_forward_agree(false).unwrap();
    assert_eq!(
        split, on_tiles,
        "the split scale groups gave other log-probs than the tiles' twin"
    );
}

/// The checks of [`tiles_keep_the_rollout_and_the_training_forward_bitwise_equal`] with the tiles'
/// order on the fragment tiles when `fragments`; the rollout's log-prob bits, or `None` without an
/// adapter or f16.
fn rollout_and_training_forward_agree(fragments: bool) -> Option<Vec<u32>> {
    if !wgpu_available() {
        return None;
    }
    let infer_dev = BackendKind::Wgpu.device().unwrap();
    let train_dev = infer_dev.clone().autodiff();
    if let Err(e) = Activations::F16.check_device(&infer_dev) {
        eprintln!("SKIPPED: {e:#}");
        return None;
    }
    let (infer, train) = (model(&infer_dev), model(&train_dev));
    let params = SamplingParams {
        temperature: 0.8,
        max_new_tokens: 8,
        seed: 11,
        ..SamplingParams::default()
    };
    let prompts = vec![vec![3u32, 17, 99, 42, 7], vec![5, 6], vec![8, 1, 2]];
    qarl::ops::set_tensor_tiles(Some(DType::F16));
    qarl::ops::set_fragment_tiles(fragments);
    let counter = if fragments {
        qarl::ops::fragment_tile_products
    } else {
        qarl::ops::tensor_tile_products
    };
    let before = counter();
    let out = generate(&infer, &prompts, 2, &params, None);
    let after_rollout = counter();
    let scored = response_logprobs(&train, &out.ids, &out.prompt_lens, params.temperature);
    let after_training = counter();
    qarl::ops::set_tensor_tiles(None);
    qarl::ops::set_fragment_tiles(false);
    let canonical = response_logprobs(&train, &out.ids, &out.prompt_lens, params.temperature);
    assert!(after_rollout > before, "the rollout did not take the tiles");
    assert!(
        after_training > after_rollout,
        "the training forward did not take the tiles"
    );
    assert!(!out.logprobs.concat().is_empty());
    assert_eq!(
        bits(&out.logprobs),
        bits(&scored),
        "tiles on wgpu: the rollout's log-probs differ from the training forward's"
    );
    assert_ne!(
        bits(&scored),
        bits(&canonical),
        "the tiles' order gave the canonical order's bits: were the tiles used?"
    );
    Some(bits(&scored))
}

/// Two RL steps of the tiny MoE on wgpu with `train.tensor_cores = true` and f16 activations, through the
/// config: every token's `lp_old` re-computed and checked against the rollout's record (`lp_old_check`:
/// the run stops at the first differing bit), `rollout_corr/k3_kl` exactly 0, the tiles used.
#[test]
fn an_rl_run_with_tensor_cores_keeps_k3_at_zero() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    if !wgpu_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let toml = common::tiny_train_toml(tmp.path(), "aligned", 2);
    // No warm start: the random initial model is enough to compare bits.
    let start = toml.find("[sft]").unwrap();
    let end = toml.find("[rollout]").unwrap();
    let toml = format!("{}{}", &toml[..start], &toml[end..]).replace(
        "[train]\n",
        "[train]\nbackend = \"wgpu\"\nactivations = \"f16\"\ntensor_cores = true\nlp_old_check = true\n",
    );
    let cfg = TrainConfig::from_toml(&toml, "tiny").unwrap();
    let before = qarl::ops::tensor_tile_products();
    if let Err(e) = Activations::F16.check_device(&BackendKind::Wgpu.device().unwrap()) {
        eprintln!("SKIPPED: {e:#}");
        return;
    }
    let run = train::run(&cfg, false, true);
    qarl::ops::set_tensor_tiles(None);
    let summary = run.unwrap();
    assert!(
        qarl::ops::tensor_tile_products() > before,
        "the run did not take the tiles"
    );
    let text = std::fs::read_to_string(&summary.metrics_path).unwrap();
    let rl: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["phase"] == "rl")
        .collect();
    assert_eq!(rl.len(), 2, "two RL steps");
    for r in &rl {
        assert_eq!(
            r["rollout_corr/k3_kl"].as_f64(),
            Some(0.0),
            "step {}: k3 is not exactly 0",
            r["step"]
        );
    }
}
