//! `train.deterministic = false` (issue 28's `deterministic = off`): the backend's own kernels, so the
//! learner's `lp_old` is recomputed rather than taken from the rollout's record, and the mismatch the
//! kernels leave is reported. Deterministic mode is a process-wide switch that a run sets from its config,
//! so this file runs alone in its own process (other test files' runs keep the default).

mod common;

use std::sync::Mutex;

use burn::tensor::Device;
use qarl::host::to_f32_vec;
use qarl::model::{Activations, Decoder, Weights};
use qarl::quant::{QuantConfig, QuantScheme};
use qarl::train::{self, TrainConfig};

/// The tests of this file flip the process-wide switch: one at a time.
static SWITCH: Mutex<()> = Mutex::new(());

#[test]
fn deterministic_off_recomputes_lp_old_and_reports_the_mismatch() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let toml = common::tiny_train_toml(tmp.path(), "aligned", 1);
    let default = TrainConfig::from_toml(&toml, "tiny").unwrap();
    assert!(
        default.train.deterministic,
        "deterministic mode is the default"
    );
    let off = toml.replace("[train]\n", "[train]\ndeterministic = false\n");
    let cfg = TrainConfig::from_toml(&off, "tiny").unwrap();
    assert!(
        !cfg.train.deterministic,
        "`deterministic = false` was not read"
    );
    train::run(&cfg, false, true).unwrap();
    assert!(
        !qarl::ops::deterministic(),
        "the run did not switch the mode"
    );
    let text = std::fs::read_to_string(cfg.run_dir.join("metrics.jsonl")).unwrap();
    let row: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["phase"] == "rl")
        .expect("an RL row");
    // Off, the training forward is not known to reproduce the rollout: lp_old comes from a forward.
    assert_eq!(row["train/lp_old_reused"], 0.0, "{row}");
    let k3 = row["rollout_corr/k3_kl"].as_f64().expect("k3 reported");
    assert!(k3.is_finite() && k3 >= 0.0, "k3 {k3}");
    eprintln!("deterministic off, aligned int4 forward: step-0 k3 KL {k3:e}");
}

/// Outside deterministic mode, bf16 activations take the backend's own matmul in bf16 on the weights rounded
/// to bf16 (dense layers, and quantized ones from `FAST_GEMM_MIN_ROWS` rows): the training forward's
/// log-probs move off the deterministic ones by rounding, not more, and the gradient still reaches every
/// master (straight through the dequantized weights) pointing the same way.
#[test]
fn bf16_outside_deterministic_mode_takes_the_backends_matmul() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let device = Device::flex().autodiff();
    let rows = qarl::ops::packed::FAST_GEMM_MIN_ROWS + 6;
    let seq: Vec<u32> = (0..rows as u32).map(|i| (i * 37 + 5) % 250).collect();
    for dir in common::fixture_models() {
        let run = |deterministic: bool| -> (Vec<f32>, Vec<f32>) {
            qarl::ops::set_deterministic(deterministic);
            let mut m = Decoder::load(&dir, &device).unwrap();
            for (_, lin) in m.linears_mut() {
                lin.weight = lin.weight.clone().map(|t| t.require_grad());
            }
            m.quantize(&QuantConfig::new(QuantScheme::Int4G32)).unwrap();
            m.set_activations(Activations::Bf16).unwrap();
            let (hidden, _) = m.hidden_as(Weights::Packed, std::slice::from_ref(&seq), None);
            let targets = seq[1..].to_vec();
            let h = hidden.narrow(0, 0, rows - 1);
            let lp =
                qarl::model::scoring::head_logprobs(&m, h, Weights::Packed, &targets, 1.0, false)
                    .logprobs;
            let grads = lp.clone().sum().backward();
            let mut g = Vec::new();
            for (_, lin) in m.linears_mut() {
                let w = lin.weight.val();
                match w.grad(&grads) {
                    Some(t) => g.extend(to_f32_vec(t)),
                    None => g.extend(std::iter::repeat_n(0.0, w.shape().num_elements())),
                }
            }
            qarl::ops::set_deterministic(true);
            (to_f32_vec(lp.detach()), g)
        };
        let (lp_on, g_on) = run(true);
        let (lp_off, g_off) = run(false);
        let diff = common::max_abs_diff(&lp_on, &lp_off);
        let dot: f64 = g_on
            .iter()
            .zip(&g_off)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum();
        let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let cos = dot / (norm(&g_on) * norm(&g_off));
        eprintln!(
            "{}: bf16 off vs on: max |dlp| {diff:.3e}, gradient cosine {cos:.6}",
            dir.display()
        );
        assert!(
            diff > 0.0,
            "{}: the backend's matmul changed nothing",
            dir.display()
        );
        assert!(diff < 0.5, "{}: log-probs moved by {diff}", dir.display());
        assert!(g_off.iter().all(|x| x.is_finite()));
        let moe = dir.to_string_lossy().contains("moe");
        assert!(
            cos > if moe { 0.95 } else { 0.99 },
            "{}: gradient cosine {cos}",
            dir.display()
        );
    }
}

/// fp8-b128 quantizes the activations too (W8A8): outside deterministic mode its quantized layers keep
/// their own kernel at training sizes, where the backend's matmul on the dequantized weights would skip
/// the activations' quantization (another function than the rollout's, not another rounding), while a
/// weight-only format takes the backend's matmul there.
#[test]
fn fp8_keeps_its_activation_quantization_outside_deterministic_mode() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let device = Device::flex();
    let rows = qarl::ops::packed::FAST_GEMM_MIN_ROWS + 6;
    let (inn, out) = (256, 64);
    let values = |n: usize, seed: u32| -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let master = burn::tensor::Tensor::<2>::from_data(
        burn::tensor::TensorData::new(values(inn * out, 7), [inn, out]),
        &device,
    );
    let x = burn::tensor::Tensor::<2>::from_data(
        burn::tensor::TensorData::new(values(rows * inn, 11), [rows, inn]),
        &device,
    )
    .cast(burn::tensor::DType::BF16);
    for (scheme, kept) in [
        (QuantScheme::Fp8Block128, true),
        (QuantScheme::Int8PerChannel, false),
    ] {
        let w = qarl::ops::packed::QuantizedWeight::from_master(master.clone(), scheme).unwrap();
        let run = |deterministic: bool| {
            qarl::ops::set_deterministic(deterministic);
            let y = to_f32_vec(
                w.matmul(x.clone(), master.clone())
                    .cast(burn::tensor::DType::F32),
            );
            qarl::ops::set_deterministic(true);
            y
        };
        let (on, off) = (run(true), run(false));
        let same = on.iter().zip(&off).all(|(a, b)| a.to_bits() == b.to_bits());
        assert_eq!(
            same, kept,
            "{scheme:?}: deterministic on and off alike: {same}"
        );
    }
}
