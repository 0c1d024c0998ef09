//! Mixed precision (issue 28): half-precision activations with f32 weights. The rollout (cached decode,
//! one token at a time) and the training forward (full sequence, gradients tracked) still agree bit for
//! bit; the half forward is a rounding of the f32 one, not another function; the KV cache holds half
//! tensors; gradients reach the f32 masters in f32.

mod common;

use burn::tensor::{DType, Device, Tensor};
use common::fixture_models;
use qarl::host::to_f32_vec;
use qarl::model::scoring::response_logprobs;
use qarl::model::{Activations, Decoder, Weights};
use qarl::quant::{QuantConfig, QuantScheme};
use qarl::rollout::generate;

const HALF: [Activations; 2] = [Activations::Bf16, Activations::F16];

/// The model in `dir` on `device` with `activations`, int4-g32 weights when `quant`, every master
/// tracked when `device` is an autodiff device.
fn model(dir: &std::path::Path, device: &Device, act: Activations, quant: bool) -> Decoder {
    let mut m = Decoder::load(dir, device).unwrap();
    if device.is_autodiff() {
        for (_, lin) in m.linears_mut() {
            lin.weight = lin.weight.clone().map(|t| t.require_grad());
        }
    }
    if quant {
        m.quantize(&QuantConfig::new(QuantScheme::Int4G32)).unwrap();
    }
    m.set_activations(act).unwrap();
    m
}

fn flat_bits(v: &[Vec<f32>]) -> Vec<u32> {
    v.iter().flatten().map(|x| x.to_bits()).collect()
}

/// Must-show: with half activations the sampler's recorded log-probs are bitwise the training forward's
/// (autodiff device, masters tracked), for f32 and int4 weights on every fixture architecture (dense and
/// MoE).
#[test]
fn half_activations_keep_rollout_and_training_bitwise_equal() {
    let infer_dev = Device::flex();
    let train_dev = Device::flex().autodiff();
    for dir in fixture_models() {
        for act in HALF {
            for quant in [false, true] {
                let infer = model(&dir, &infer_dev, act, quant);
                let train = model(&dir, &train_dev, act, quant);
                let params = common::sampling(77);
                let out = generate(&infer, &common::ragged_prompts(), 2, &params, None);
                let full =
                    response_logprobs(&train, &out.ids, &out.prompt_lens, params.temperature);
                let (rec, fwd) = (flat_bits(&out.logprobs), flat_bits(&full));
                assert!(!rec.is_empty());
                let differ = rec.iter().zip(&fwd).filter(|(a, b)| a != b).count();
                assert_eq!(
                    differ,
                    0,
                    "{} {act} quant={quant}: {differ}/{} recorded log-probs differ from the training forward",
                    dir.display(),
                    rec.len()
                );
            }
        }
    }
}

/// The half forward is the f32 forward rounded: its log-probs differ from f32's (the rounding happens),
/// and bf16 (8 significant bits) moves them about 8x as far as f16 (11 bits), as rounding errors do.
#[test]
fn half_logprobs_are_a_rounding_of_the_f32_ones() {
    let device = Device::flex();
    for dir in fixture_models() {
        let reference = model(&dir, &device, Activations::F32, false);
        let seqs = vec![vec![3u32, 17, 99, 42, 7, 250, 11, 5, 6, 200]];
        let lp = |m: &Decoder| response_logprobs(m, &seqs, &[2], 1.0).concat();
        let want = lp(&reference);
        let mut worst = Vec::new();
        for act in HALF {
            let got = lp(&model(&dir, &device, act, false));
            let diff = common::max_abs_diff(&got, &want);
            println!("{}: {act} max |lp - lp_f32| = {diff:.3e}", dir.display());
            assert!(diff > 0.0, "{}: {act} changed nothing", dir.display());
            assert!(
                diff < 0.5,
                "{}: {act} moved log-probs by {diff}",
                dir.display()
            );
            worst.push(diff);
        }
        // Rounding errors scale with the unit roundoff: 2^-9 for bf16, 2^-12 for f16, 8x apart. A bug
        // (a lost op, a wrong cast) would not keep that proportion.
        let ratio = worst[0] / worst[1];
        assert!(
            (2.0..32.0).contains(&ratio),
            "{}: bf16 moved log-probs {ratio}x as far as f16 (expected about 8x)",
            dir.display()
        );
    }
}

/// The KV cache and the hidden states are half tensors; the LM head's logits are f32.
#[test]
fn the_cache_holds_half_tensors_and_logits_are_f32() {
    let device = Device::flex();
    let dir = &fixture_models()[0];
    for act in HALF {
        let m = model(dir, &device, act, true);
        let mut cache = m.new_cache(1);
        let ids = vec![vec![3u32, 17, 99]];
        let (hidden, _) = m.hidden_cached(Weights::Packed, &ids, &[3], &mut cache, None, None);
        assert_eq!(hidden.dtype(), act.dtype());
        let kv = cache.layers[0].as_ref().expect("layer 0 cached");
        assert_eq!((kv.k.dtype(), kv.v.dtype()), (act.dtype(), act.dtype()));
        assert_eq!(m.head(hidden, Weights::Packed).dtype(), DType::F32);
    }
}

/// Training with half activations: every master in the forward receives an f32 gradient, finite, pointing the same way
/// as the f32 forward's (cosine > 0.99 over all masters), and not identical to it.
#[test]
fn gradients_reach_the_f32_masters() {
    let device = Device::flex().autodiff();
    for dir in fixture_models() {
        let seqs = vec![vec![3u32, 17, 99, 42, 7, 250, 11, 5, 6, 200]];
        let grads_of = |act: Activations| -> Vec<f32> {
            let m = model(&dir, &device, act, true);
            let lp = response_logprobs_tensor(&m, &seqs);
            let grads = lp.sum().backward();
            let mut all = Vec::new();
            let mut m = m;
            for (name, lin) in m.linears_mut() {
                let w = lin.weight.val();
                assert_eq!(w.dtype(), DType::F32, "{name}: master is not f32");
                let Some(g) = w.grad(&grads) else {
                    // An expert no token chose takes no part in the forward.
                    assert!(name.contains(".experts."), "{name}: no gradient");
                    all.extend(std::iter::repeat_n(0.0, w.shape().num_elements()));
                    continue;
                };
                assert_eq!(g.dtype(), DType::F32, "{name}: gradient is not f32");
                all.extend(to_f32_vec(g));
            }
            all
        };
        let f32_grads = grads_of(Activations::F32);
        for act in HALF {
            let g = grads_of(act);
            assert!(
                g.iter().all(|x| x.is_finite()),
                "{act}: non-finite gradient"
            );
            let dot: f64 = g
                .iter()
                .zip(&f32_grads)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum();
            let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            let cos = dot / (norm(&g) * norm(&f32_grads));
            println!("{}: {act} gradient cosine to f32 {cos:.6}", dir.display());
            // Dense models: the rounding alone. MoE: a token whose router scores are close may also pick
            // another expert, which moves that expert's whole gradient.
            let moe = dir.to_string_lossy().contains("moe");
            let bound = if moe { 0.97 } else { 0.999 };
            assert!(
                cos > bound,
                "{}: {act} gradient cosine {cos}",
                dir.display()
            );
            assert_ne!(
                g,
                f32_grads,
                "{}: {act} gradients equal f32's",
                dir.display()
            );
        }
    }
}

/// The training forward's log-probs of `seqs` (prompt of 2 tokens) as one tensor on the graph.
fn response_logprobs_tensor(m: &Decoder, seqs: &[Vec<u32>]) -> Tensor<1> {
    let (hidden, _) = m.hidden_as(Weights::Packed, seqs, None);
    let n = seqs[0].len();
    let targets: Vec<u32> = seqs[0][1..].to_vec();
    let rows = hidden.narrow(0, 0, n - 1);
    qarl::model::scoring::head_logprobs(m, rows, Weights::Packed, &targets, 1.0, false).logprobs
}

/// A training run with `train.activations = "bf16"`: the aligned forward's recomputed `lp_old` equals the
/// rollout's record for every token (`lp_old_check` stops the run otherwise), k3 is exactly 0, the losses
/// are finite; a type the config does not know is refused, naming the key.
#[test]
fn a_bf16_run_keeps_the_aligned_forward_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let toml = common::tiny_train_toml(tmp.path(), "aligned", 2);
    let bf16 = toml.replace(
        "[train]\n",
        "[train]\nactivations = \"bf16\"\nlp_old_check = true\n",
    );
    let cfg = qarl::train::TrainConfig::from_toml(&bf16, "tiny").unwrap();
    assert_eq!(cfg.train.activations, Activations::Bf16);
    qarl::train::run(&cfg, false, true).unwrap();
    let text = std::fs::read_to_string(cfg.run_dir.join("metrics.jsonl")).unwrap();
    let rl: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["phase"] == "rl")
        .collect();
    assert_eq!(rl.len(), 2);
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cfg.run_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(recorded["train"]["activations"], "bf16");
    for row in &rl {
        assert_eq!(row["rollout_corr/k3_kl"], 0.0, "{row}");
        assert_eq!(row["error_tokens/ratio_frac"], 0.0, "{row}");
        assert!(
            row["actor/pg_loss"].as_f64().is_some_and(f64::is_finite),
            "{row}"
        );
    }
    let bad = toml.replace("[train]\n", "[train]\nactivations = \"fp8\"\n");
    let err = format!(
        "{:#}",
        qarl::train::TrainConfig::from_toml(&bad, "tiny").unwrap_err()
    );
    assert!(
        err.contains("activations") && err.contains("fp8"),
        "unhelpful error: {err}"
    );
}
