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
