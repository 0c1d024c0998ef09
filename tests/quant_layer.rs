//! The quantized linear layer: the low-bit matmul against the spec's reference, batch invariance, the
//! straight-through gradients (hand formulas and finite differences), one forward shared by rollout and
//! training, quantized checkpoints, and re-quantization per weight version.

mod common;

use std::str::FromStr;

use burn::tensor::{Device, Tensor};
use common::{fixtures_dir, max_abs_diff, values};
use qarl::host::{tensor_from_vec, to_f32_vec};
use qarl::model::layers::Linear;
use qarl::model::scoring::response_logprobs;
use qarl::model::{Decoder, Weights};
use qarl::ops::cpu::kernel::lowbit_matmul;
use qarl::quant::{Precision, QuantConfig, QuantScheme, QuantizedTensor};
use qarl::rollout::{generate, SamplingParams};

/// `(f(v + h e_i) - f(v - h e_i)) / 2h`.
fn central_difference(f: &dyn Fn(&[f32]) -> f64, v: &[f32], i: usize, h: f32) -> f64 {
    let (mut plus, mut minus) = (v.to_vec(), v.to_vec());
    plus[i] += h;
    minus[i] -= h;
    (f(&plus) - f(&minus)) / (2.0 * h as f64)
}

/// A linear layer with master `w` given in HF `[out, in]` layout.
fn linear(w: &[f32], out: usize, inn: usize, device: &Device) -> Linear {
    let w_in_out = tensor_from_vec(w.to_vec(), [out, inn], device).transpose();
    Linear {
        weight: burn::module::Param::from_tensor(Tensor::from_data(w_in_out.into_data(), device)),
        bias: None,
        quant: None,
    }
}

#[test]
fn lowbit_matmul_matches_dequantized_reference_for_every_scheme() {
    let (m, out, inn) = (5, 40, 300); // 300: short last group for G = 64/128 and for fp8 blocks
    let w = values(out * inn, 1);
    let x = values(m * inn, 2);
    for scheme in QuantScheme::ALL {
        let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
        let y = lowbit_matmul(&q, &x, m);
        // The spec's reference product (weight-only: f32 activations; fp8: W8A8), summed in f64.
        let deq = q.dequantize();
        let xa = if scheme.quantizes_activations() {
            qarl::quant::Fp8Activations::quantize(&x, m, inn)
                .unwrap()
                .dequantize()
        } else {
            x.clone()
        };
        let mut want = vec![0.0f32; m * out];
        for i in 0..m {
            for o in 0..out {
                let acc: f64 = (0..inn)
                    .map(|k| xa[i * inn + k] as f64 * deq[o * inn + k] as f64)
                    .sum();
                want[i * out + o] = acc as f32;
            }
        }
        let d = max_abs_diff(&y, &want);
        assert!(d < 2e-4, "{scheme}: |lowbit - reference| = {d}");
        // The low-bit product really differs from the full-precision one (the weights are quantized).
        let mut full = vec![0.0f32; m * out];
        for i in 0..m {
            for o in 0..out {
                full[i * out + o] = (0..inn).map(|k| x[i * inn + k] * w[o * inn + k]).sum();
            }
        }
        assert!(
            max_abs_diff(&y, &full) > 1e-3,
            "{scheme}: quantization changed nothing"
        );
    }
}

/// Each output element is reduced in an order that does not depend on the batch: a row computed alone
/// and inside a batch is bitwise equal.
#[test]
fn lowbit_matmul_is_batch_invariant() {
    let (m, out, inn) = (7, 33, 200);
    let w = values(out * inn, 3);
    let x = values(m * inn, 4);
    for scheme in QuantScheme::ALL {
        let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
        let batch = lowbit_matmul(&q, &x, m);
        for i in 0..m {
            let alone = lowbit_matmul(&q, &x[i * inn..(i + 1) * inn], 1);
            assert!(
                alone
                    .iter()
                    .zip(&batch[i * out..(i + 1) * out])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{scheme}: row {i} differs alone vs batched"
            );
        }
    }
}

#[test]
fn quantized_layer_forward_is_the_lowbit_matmul() {
    let device = Device::flex();
    let (m, out, inn) = (3, 16, 64);
    let w = values(out * inn, 5);
    let x = values(m * inn, 6);
    let mut lin = linear(&w, out, inn, &device);
    lin.quantize(QuantScheme::Int4G32).unwrap();
    let y = to_f32_vec(lin.forward(tensor_from_vec(x.clone(), [m, inn], &device)));
    let q = QuantizedTensor::quantize(&w, out, inn, QuantScheme::Int4G32).unwrap();
    assert_eq!(y, lowbit_matmul(&q, &x, m));
    // On an autodiff device (the training forward) the values are the same bits.
    let ad = device.clone().autodiff();
    let mut lin_ad = linear(&w, out, inn, &ad);
    lin_ad.quantize(QuantScheme::Int4G32).unwrap();
    let y_ad = to_f32_vec(lin_ad.forward(tensor_from_vec(x, [m, inn], &ad)));
    assert_eq!(y, y_ad);
}

/// STE: dW = x^T g (the quantizer as identity), dx = g · dequant(Q(W)); checked against the formulas and
/// against central finite differences of the functions they should be the derivatives of.
#[test]
fn straight_through_gradients() {
    let ad = Device::flex().autodiff();
    let (m, out, inn) = (4, 8, 32);
    let w = values(out * inn, 7);
    let xv = values(m * inn, 8);
    let r = values(m * out, 9); // loss = sum(y * r), so g = r
    for scheme in [
        QuantScheme::Int4G32,
        QuantScheme::Int8PerChannel,
        QuantScheme::Nvfp4,
        QuantScheme::Mxfp4,
    ] {
        let mut lin = linear(&w, out, inn, &ad);
        lin.weight = lin.weight.clone().map(|t| t.require_grad());
        lin.quantize(scheme).unwrap();
        let x = tensor_from_vec(xv.clone(), [m, inn], &ad).require_grad();
        let y = lin.forward(x.clone());
        let loss = (y * tensor_from_vec(r.clone(), [m, out], &ad)).sum();
        let grads = loss.backward();
        let dx = to_f32_vec(x.grad(&grads).unwrap());
        let dw = to_f32_vec(lin.weight.val().grad(&grads).unwrap()); // [in, out]
        let deq = QuantizedTensor::quantize(&w, out, inn, scheme)
            .unwrap()
            .dequantize();
        for i in 0..m {
            for k in 0..inn {
                let want: f64 = (0..out)
                    .map(|o| r[i * out + o] as f64 * deq[o * inn + k] as f64)
                    .sum();
                assert!(
                    (dx[i * inn + k] as f64 - want).abs() < 1e-4,
                    "{scheme}: dx[{i},{k}]"
                );
            }
        }
        for k in 0..inn {
            for o in 0..out {
                let want: f64 = (0..m)
                    .map(|i| xv[i * inn + k] as f64 * r[i * out + o] as f64)
                    .sum();
                assert!(
                    (dw[k * out + o] as f64 - want).abs() < 1e-4,
                    "{scheme}: dW[{k},{o}]"
                );
            }
        }
        // Finite differences: dx of the quantized forward (linear in x for weight-only schemes) ...
        let f = |xs: &[f32]| -> f64 {
            let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
            let y = lowbit_matmul(&q, xs, m);
            y.iter().zip(&r).map(|(a, b)| *a as f64 * *b as f64).sum()
        };
        let h = 1e-2f32;
        for &(i, k) in &[(0usize, 0usize), (1, 17), (3, 31)] {
            let fd = central_difference(&f, &xv, i * inn + k, h);
            assert!(
                (dx[i * inn + k] as f64 - fd).abs() < 2e-3,
                "{scheme}: dx fd {fd} vs {}",
                dx[i * inn + k]
            );
        }
        // ... and dW of the unquantized product x W^T (what the straight-through estimator differentiates).
        let g = |ws: &[f32]| -> f64 {
            let mut acc = 0.0;
            for i in 0..m {
                for o in 0..out {
                    let y: f64 = (0..inn)
                        .map(|k| xv[i * inn + k] as f64 * ws[o * inn + k] as f64)
                        .sum();
                    acc += y * r[i * out + o] as f64;
                }
            }
            acc
        };
        for &(o, k) in &[(0usize, 0usize), (5, 20), (7, 31)] {
            let fd = central_difference(&g, &w, o * inn + k, h);
            assert!(
                (dw[k * out + o] as f64 - fd).abs() < 2e-3,
                "{scheme}: dW fd {fd} vs {}",
                dw[k * out + o]
            );
        }
    }
}

/// One forward graph: the log-probs a quantized rollout records equal the quantized learner forward's.
#[test]
fn quantized_rollout_and_training_forward_agree() {
    let device = Device::flex();
    let mut model = Decoder::load(fixtures_dir().join("qwen3_moe"), &device).unwrap();
    let f32_lp = {
        let p = SamplingParams {
            temperature: 1.0,
            max_new_tokens: 6,
            seed: 3,
            ..Default::default()
        };
        let out = generate(&model, &[vec![1, 2, 3, 4]], 2, &p, None);
        response_logprobs(&model, &out.ids, &out.prompt_lens, 1.0)
    };
    let n = model
        .quantize(&QuantConfig::new(QuantScheme::Int4G32))
        .unwrap();
    // 3 layers x 4 attention projections + 2 sparse layers x 8 experts x 3 + 1 dense MLP x 3.
    assert_eq!(n, 12 + 48 + 3);
    let p = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 6,
        seed: 3,
        ..Default::default()
    };
    let out = generate(&model, &[vec![1, 2, 3, 4]], 2, &p, None);
    let full = response_logprobs(&model, &out.ids, &out.prompt_lens, 1.0);
    for (a, b) in out.logprobs.iter().zip(&full) {
        assert!(max_abs_diff(a, b) <= 1e-5, "{a:?} vs {b:?}");
    }
    // The quantized model is a different policy from the f32 one.
    let full_f32 = {
        model.set_precision(Precision::F32).unwrap();
        response_logprobs(&model, &out.ids, &out.prompt_lens, 1.0)
    };
    assert!(full
        .iter()
        .zip(&full_f32)
        .any(|(a, b)| max_abs_diff(a, b) > 1e-3));
    let _ = f32_lp;
}

#[test]
fn router_lm_head_and_embeddings_stay_full_precision_by_default() {
    let mut model = Decoder::load(fixtures_dir().join("qwen3_moe"), &Device::flex()).unwrap();
    model
        .quantize(&QuantConfig::new(QuantScheme::Int8PerChannel))
        .unwrap();
    for (name, lin) in model.linears_mut() {
        let quantized = lin.quant.is_some();
        assert_eq!(quantized, name.ends_with("_proj.weight"), "{name}");
    }
    let mut cfg = QuantConfig::new(QuantScheme::Int8PerChannel);
    cfg.exclude = vec!["model.layers.0.*".into()];
    model.quantize(&cfg).unwrap();
    for (name, lin) in model.linears_mut() {
        if name.starts_with("model.layers.0.") {
            assert!(lin.quant.is_none(), "{name}");
        }
    }
    let bad = QuantConfig {
        include: vec!["[".into()],
        ..QuantConfig::new(QuantScheme::Int8PerChannel)
    };
    assert!(model
        .quantize(&bad)
        .unwrap_err()
        .to_string()
        .contains("invalid layer pattern"));
    // Nothing left to quantize: the error names the exclude patterns that removed it all.
    cfg.exclude = vec!["model.*".into(), "*.weight".into()];
    assert_eq!(
        model.quantize(&cfg).unwrap_err().to_string(),
        "no layer matches the quantization patterns (include `*_proj.weight` less exclude `model.*`, \
         `*.weight`)"
    );
}

/// After a weight change, re-quantization produces the new version; the packed weights are shared (not
/// copied) by clones of the model, e.g. a rollout worker.
#[test]
fn requantize_follows_the_master_weights() {
    let device = Device::flex();
    let mut model = Decoder::load(fixtures_dir().join("qwen3"), &device).unwrap();
    model
        .quantize(&QuantConfig::new(QuantScheme::Int4G128))
        .unwrap();
    let before = model.layers[0].self_attn.q_proj.quant.clone().unwrap();
    let w = model.layers[0].self_attn.q_proj.weight.val();
    model.layers[0].self_attn.q_proj.weight = burn::module::Param::from_tensor(w * 1.5);
    assert_eq!(model.requantize().unwrap(), 2 * 7);
    let after = model.layers[0].self_attn.q_proj.quant.clone().unwrap();
    assert_ne!(before.packed.0.scales(), after.packed.0.scales());
    let shared = model.layers[0].self_attn.q_proj.quant.clone().unwrap();
    assert!(std::sync::Arc::ptr_eq(&shared.packed.0, &after.packed.0));
}

#[test]
fn quantized_checkpoint_round_trip() {
    let device = Device::flex();
    let src = fixtures_dir().join("qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("q");
    for scheme in QuantScheme::ALL {
        let cfg = QuantConfig::new(scheme);
        let s = qarl::model::quantize_checkpoint(&src, &dst, &cfg).unwrap();
        assert_eq!(s.quantized_tensors, 63);
        assert!(s.bytes_after < s.bytes_before);
        let loaded = Decoder::load(&dst, &device).unwrap();
        assert_eq!(loaded.config.quantization.as_ref().unwrap().scheme, scheme);
        let mut onload = Decoder::load(&src, &device).unwrap();
        onload.quantize(&cfg).unwrap();
        let ids = vec![vec![5u32, 9, 200, 31, 7]];
        let a = to_f32_vec(loaded.forward(&ids, None, None, None).logits);
        let b = to_f32_vec(onload.forward(&ids, None, None, None).logits);
        assert_eq!(
            a, b,
            "{scheme}: loaded-quantized and quantized-on-load differ"
        );
    }
    // Re-quantizing a quantized checkpoint is refused; an unknown method in config.json is a clear error.
    let err = qarl::model::quantize_checkpoint(
        &dst,
        &tmp.path().join("qq"),
        &QuantConfig::new(QuantScheme::Int8PerChannel),
    );
    assert!(err.unwrap_err().to_string().contains("already quantized"));
    let cfg_path = dst.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .replace("\"qarl\"", "\"gptq\"");
    std::fs::write(&cfg_path, text).unwrap();
    let err = Decoder::load(&dst, &device).unwrap_err().to_string();
    assert!(err.contains("gptq") && err.contains("config.json"), "{err}");
}

/// A quantized checkpoint whose config.json disagrees with its files is refused, naming what: a scheme
/// relabelled (mxfp4 and int4-g32 codes have one shape and loaded as each other, as garbage), a layer stored
/// packed that the stored patterns leave in full precision, and the other way round (a shard of the
/// full-precision model mixed in ran that layer in f32 under the scheme's name).
#[test]
fn a_quantized_checkpoint_that_disagrees_with_its_config_is_refused() {
    let device = Device::flex();
    let src = fixtures_dir().join("qwen3");
    let tmp = tempfile::tempdir().unwrap();
    let edit_config = |dir: &std::path::Path, edit: &dyn Fn(&mut serde_json::Value)| {
        let path = dir.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut cfg["quantization_config"]);
        std::fs::write(&path, cfg.to_string()).unwrap();
    };
    let load_error = |dir: &std::path::Path| match Decoder::load(dir, &device) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    };

    let mx = tmp.path().join("mx");
    let cfg = QuantConfig::new(QuantScheme::from_str("mxfp4").unwrap());
    qarl::model::quantize_checkpoint(&src, &mx, &cfg).unwrap();
    Decoder::load(&mx, &device).unwrap();
    edit_config(&mx, &|q| q["scheme"] = "int4-g32".into());
    let err = load_error(&mx);
    assert!(
        err.contains("says int4-g32") && err.contains("holds codes written as mxfp4"),
        "{err}"
    );

    let int4 = QuantScheme::from_str("int4-g32").unwrap();
    let partial = tmp.path().join("partial");
    let mut cfg = QuantConfig::new(int4);
    cfg.exclude = vec!["model.layers.1.*".into()];
    qarl::model::quantize_checkpoint(&src, &partial, &cfg).unwrap();
    Decoder::load(&partial, &device).unwrap();
    edit_config(&partial, &|q| q["exclude"] = serde_json::json!([]));
    let err = load_error(&partial);
    assert!(
        err.contains("selects `model.layers.1.") && err.contains("stores it in full precision"),
        "{err}"
    );

    // A quantized dir whose config.json lost `quantization_config`: named as such (it said a projection's
    // `.weight` was missing, and `qarl quantize` that no tensor matched its patterns).
    let bare = tmp.path().join("bare");
    qarl::model::quantize_checkpoint(
        &src,
        &bare,
        &QuantConfig::new(QuantScheme::from_str("int8-pc").unwrap()),
    )
    .unwrap();
    let cfg_path = bare.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&cfg_path, json.to_string()).unwrap();
    let err = load_error(&bare);
    assert!(
        err.contains("hold packed codes") && err.contains("no `quantization_config`"),
        "{err}"
    );
    let err =
        qarl::model::quantize_checkpoint(&bare, &tmp.path().join("again"), &QuantConfig::new(int4))
            .unwrap_err()
            .to_string();
    assert!(err.contains("holds packed codes already"), "{err}");

    // Scales converted to bf16 (rounded): refused by name, not loaded as other weights.
    let rounded = tmp.path().join("rounded");
    qarl::model::quantize_checkpoint(&src, &rounded, &QuantConfig::new(int4)).unwrap();
    let file = rounded.join("model.safetensors");
    let mut tensors = common::read_tensors(&file);
    let name = "model.layers.0.self_attn.q_proj.scales";
    let (_, shape, bytes) = tensors[name].clone();
    let halves: Vec<u8> = bytes
        .chunks_exact(4)
        .flat_map(|b| half::bf16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes())
        .collect();
    tensors.insert(name.into(), (safetensors::Dtype::BF16, shape, halves));
    common::write_tensors(&file, &tensors);
    let err = load_error(&rounded);
    assert!(err.contains(name) && err.contains("BF16"), "{err}");

    let whole = tmp.path().join("whole");
    qarl::model::quantize_checkpoint(&src, &whole, &QuantConfig::new(int4)).unwrap();
    edit_config(&whole, &|q| {
        q["exclude"] = serde_json::json!(["model.layers.0.*"])
    });
    let err = load_error(&whole);
    assert!(
        err.contains("`model.layers.0.") && err.contains("is stored packed, but"),
        "{err}"
    );
}

/// A stored scale that times a code overflows f32 is refused where the tensor is built (it passed the
/// finite-scale check and made the logits non-finite, blamed on no tensor).
#[test]
fn a_scale_that_overflows_its_weights_is_refused() {
    let int8 = QuantScheme::from_str("int8-pc").unwrap();
    let codes = vec![1u8, 127, 2, 3];
    QuantizedTensor::from_parts(int8, 2, 2, codes.clone(), vec![1.0, 1e36]).unwrap();
    let err = QuantizedTensor::from_parts(int8, 2, 2, codes, vec![1.0, 3e38])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("scales[1] is 3e38") && err.contains("a code's value it scales (2)"),
        "{err}"
    );
}

#[test]
fn unknown_scheme_names_the_valid_ones() {
    let err = QuantScheme::from_str("int3-g7").unwrap_err().to_string();
    assert!(
        err.contains("int3-g7") && err.contains("int4-g128") && err.contains("fp8-b128"),
        "{err}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args([
            "score", "--model", "x", "--input", "y", "--output", "z", "--quant", "int3",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("int4-g128"));
}

/// Must-show: for the same weights and sequences, the training forward (autodiff device, parameters tracked)
/// and the inference forward give bitwise the same log-probs, per scheme (deterministic mode).
#[test]
fn training_and_inference_forwards_are_bitwise_aligned() {
    let dir = fixtures_dir().join("qwen3_moe");
    let infer_dev = Device::flex();
    let train_dev = Device::flex().autodiff();
    let seqs = vec![vec![5u32, 9, 200, 31, 7, 8, 100], vec![1, 2, 3, 4]];
    let prompt_lens = [2usize, 1];
    for scheme in QuantScheme::ALL {
        let (a, b) = common::moe::infer_and_train_logprobs(
            &dir,
            &infer_dev,
            &train_dev,
            scheme,
            &seqs,
            &prompt_lens,
        );
        let (mut worst, mut same, mut n) = (0.0f32, 0, 0);
        for (x, y) in a.iter().zip(&b) {
            worst = worst.max(max_abs_diff(x, y));
            same += x
                .iter()
                .zip(y)
                .filter(|(p, q)| p.to_bits() == q.to_bits())
                .count();
            n += x.len();
        }
        println!("{scheme}: training vs inference log-probs max |diff| = {worst:e}, bitwise equal {same}/{n}");
        // Deterministic mode (the default): one kernel for the quantized matmuls, elementary-op softmax and
        // the fixed-order log-softmax make the two forwards bitwise equal.
        assert_eq!(
            same, n,
            "{scheme}: training and inference forwards differ by {worst}"
        );
    }
}

/// Bytes per parameter of the quantized projections, in memory (packed codes + scales) and on disk.
#[test]
fn bytes_per_parameter() {
    let src = fixtures_dir().join("qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    for scheme in QuantScheme::ALL {
        let mut model = Decoder::load(&src, &Device::flex()).unwrap();
        model.quantize(&QuantConfig::new(scheme)).unwrap();
        let (mut params, mut bytes) = (0usize, 0usize);
        for (_, lin) in model.linears_mut() {
            if let Some(q) = &lin.quant {
                let [o, i] = q.packed.0.shape();
                params += o * i;
                bytes += q.storage_bytes();
            }
        }
        let per = bytes as f64 / params as f64;
        let expected = match scheme {
            QuantScheme::Int4G32 => 0.5 + 4.0 / 32.0,
            QuantScheme::Int4G64 => 0.5 + 4.0 / 64.0,
            QuantScheme::Int4G128 => 0.5 + 4.0 / 128.0,
            QuantScheme::Int8PerChannel => 1.0,
            QuantScheme::Fp8Block128 => 1.0,
            QuantScheme::Nvfp4 => 0.5 + 4.0 / 16.0,
            QuantScheme::Mxfp4 => 0.5 + 4.0 / 32.0,
        };
        println!("{scheme}: {per:.4} bytes/param in memory ({params} params)");
        assert!(per >= expected && per < expected + 0.15, "{scheme}: {per}");
        let dst = tmp.path().join(scheme.to_string());
        let s = qarl::model::quantize_checkpoint(&src, &dst, &QuantConfig::new(scheme)).unwrap();
        let disk = std::fs::metadata(dst.join("model.safetensors"))
            .unwrap()
            .len() as usize;
        println!(
            "{scheme}: model.safetensors {} -> {} bytes",
            s.bytes_before, disk
        );
        assert!(disk < s.bytes_before);
    }
}

/// Must-show: `qarl score --quant S` on a Qwen3-MoE matches transformers run on the dequantized weights
/// (`tests/fixtures/make_quant_hf_reference.py`), max |logit difference| <= 1e-4.
#[test]
fn quantized_score_matches_transformers_on_dequantized_weights() {
    let dir = fixtures_dir().join("qwen3_moe");
    let text = std::fs::read_to_string(dir.join("reference_quant.json")).unwrap();
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<Vec<u32>> = serde_json::from_value(r["input_ids"].clone()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("ids.json");
    std::fs::write(&input, serde_json::json!({ "input_ids": ids }).to_string()).unwrap();
    let schemes = r["schemes"].as_object().unwrap();
    assert!(schemes.contains_key("int4-g32") && schemes.contains_key("int8-pc"));
    for (name, entry) in schemes {
        let want: Vec<Vec<Vec<f32>>> = serde_json::from_value(entry["logits"].clone()).unwrap();
        let output = tmp.path().join(format!("{name}.json"));
        let v = common::run_qarl_json(
            std::process::Command::new(env!("CARGO_BIN_EXE_qarl"))
                .args(["score", "--quant", name, "--model"])
                .arg(&dir)
                .arg("--input")
                .arg(&input)
                .arg("--output")
                .arg(&output),
            &output,
        );
        let got: Vec<Vec<Vec<f32>>> = serde_json::from_value(v["logits"].clone()).unwrap();
        let got: Vec<f32> = got.into_iter().flatten().flatten().collect();
        let want: Vec<f32> = want.into_iter().flatten().flatten().collect();
        let d = max_abs_diff(&got, &want);
        println!("{name}: max |qarl --quant - transformers(dequantized)| = {d:e}");
        assert!(d <= 1e-4, "{name}: {d}");
    }
}

/// Deterministic mode (the default): the log-probs the rollout recorded while sampling (KV-cache decode,
/// batched, temperature-scaled) and the training forward's log-probs of the same sequences (autodiff
/// device, one full forward, parameters tracked), for f32 and every scheme on the MoE fixture, are bitwise
/// equal (k3 = 0). The fixture's widths (hidden 64, intermediate 96, experts 32) are not multiples of 128, so
/// fp8-b128's activation blocks are partial ones.
#[test]
fn deterministic_mode_rollout_and_training_logprobs() {
    assert!(
        qarl::ops::deterministic(),
        "deterministic mode is the default"
    );
    let dir = fixtures_dir().join("qwen3_moe");
    let params = SamplingParams {
        temperature: 0.8,
        max_new_tokens: 8,
        seed: 7,
        ..SamplingParams::default()
    };
    let prompts = vec![
        vec![5u32, 9, 200, 31],
        vec![1, 2, 3],
        vec![7u32, 8, 100, 4, 2, 9],
    ];
    let schemes: Vec<Option<QuantScheme>> = std::iter::once(None)
        .chain(QuantScheme::ALL.into_iter().map(Some))
        .collect();
    for scheme in schemes {
        let mut infer = Decoder::load(&dir, &Device::flex()).unwrap();
        let mut train = Decoder::load(&dir, &Device::flex().autodiff()).unwrap();
        for (_, lin) in train.linears_mut() {
            lin.weight = lin.weight.clone().map(|t| t.require_grad());
        }
        if let Some(s) = scheme {
            infer.quantize(&QuantConfig::new(s)).unwrap();
            train.quantize(&QuantConfig::new(s)).unwrap();
        }
        let out = generate(&infer, &prompts, 2, &params, None);
        let fwd = response_logprobs(&train, &out.ids, &out.prompt_lens, params.temperature);
        let name = scheme.map_or("f32", QuantScheme::name);
        let (mut same, mut n, mut k3) = (0usize, 0usize, 0.0f64);
        for (rec, f) in out.logprobs.iter().zip(&fwd) {
            assert_eq!(rec.len(), f.len());
            for (a, b) in rec.iter().zip(f) {
                same += usize::from(a.to_bits() == b.to_bits());
                n += 1;
                let r = (*b as f64 - *a as f64).exp();
                k3 += r - 1.0 - (r).ln();
            }
        }
        let worst = out
            .logprobs
            .iter()
            .zip(&fwd)
            .map(|(a, b)| max_abs_diff(a, b))
            .fold(0.0f32, f32::max);
        println!("{name}: bitwise equal {same}/{n}, max |diff| = {worst:e}, k3 = {k3:e}");
        // Bitwise: every matmul (quantized, lm_head, router, attention's two products) and every softmax
        // runs a fixed-order, row-batch-invariant kernel, and the log-softmax is the shared host routine.
        assert_eq!(
            same, n,
            "{name}: recorded vs training log-probs differ by up to {worst} (k3 {k3:e})"
        );
        assert_eq!(k3, 0.0, "{name}");
    }
}

/// Deterministic mode on a model whose widths are not multiples of 128 but exceed it (hidden 160, experts 136,
/// dense intermediate 200: fp8-b128 has full and partial activation blocks), with tied embeddings (the
/// lm_head is the `[vocab, hidden]` embedding matrix) and sequences that cross the attention's 64-key block:
/// the rollout's recorded log-probs equal the training forward's bitwise, f32, fp8-b128, nvfp4 (two scales
/// per 32-input chunk, a short last block at 200 = 12 * 16 + 8) and mxfp4.
#[test]
fn deterministic_mode_is_bitwise_at_widths_not_multiple_of_128() {
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 300,
        "hidden_size": 160,
        "intermediate_size": 200,
        "moe_intermediate_size": 136,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 40,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "attention_bias": false,
        "tie_word_embeddings": true,
        "torch_dtype": "float32"
    });
    let cfg_path = tmp.path().join("config.json");
    std::fs::write(&cfg_path, config.to_string()).unwrap();
    let dir = tmp.path().join("model");
    qarl::model::init::write_random_checkpoint(&cfg_path, &dir, 3, 0.08).unwrap();
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 10,
        seed: 11,
        ..SamplingParams::default()
    };
    let prompts = vec![
        (0..60u32).map(|i| (i * 37 + 5) % 300).collect::<Vec<_>>(),
        vec![4u32, 250, 17],
    ];
    for scheme in [
        None,
        Some(QuantScheme::Fp8Block128),
        Some(QuantScheme::Nvfp4),
        Some(QuantScheme::Mxfp4),
    ] {
        let mut infer = Decoder::load(&dir, &Device::flex()).unwrap();
        let mut train = Decoder::load(&dir, &Device::flex().autodiff()).unwrap();
        for (_, lin) in train.linears_mut() {
            lin.weight = lin.weight.clone().map(|t| t.require_grad());
        }
        if let Some(s) = scheme {
            infer.quantize(&QuantConfig::new(s)).unwrap();
            train.quantize(&QuantConfig::new(s)).unwrap();
        }
        let out = generate(&infer, &prompts, 2, &params, None);
        let fwd = response_logprobs(&train, &out.ids, &out.prompt_lens, params.temperature);
        let name = scheme.map_or("f32", QuantScheme::name);
        let (mut same, mut n) = (0usize, 0usize);
        for (rec, f) in out.logprobs.iter().zip(&fwd) {
            assert_eq!(rec.len(), f.len());
            same += rec
                .iter()
                .zip(f)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            n += rec.len();
        }
        let worst = out
            .logprobs
            .iter()
            .zip(&fwd)
            .map(|(a, b)| max_abs_diff(a, b))
            .fold(0.0f32, f32::max);
        println!("{name}: bitwise equal {same}/{n}, max |diff| = {worst:e}");
        assert!(n > 0);
        assert_eq!(same, n, "{name}: differ by up to {worst}");
    }
}

/// Deterministic mode's f32 product (`det_matmul`, both weight layouts, rank 2 and 4) is differentiable: its
/// values are the fixed-order kernel's and its gradients (products on the fixed-order GEMM) are burn's
/// matmul gradients up to summation order (<= 1e-6 relative); the values within f32 rounding.
#[test]
fn det_matmul_has_burn_matmul_gradients() {
    use qarl::ops::det_matmul;
    let device = Device::flex().autodiff();
    let grads_of = |det: bool, nt: bool, shape_x: [usize; 4], shape_w: [usize; 4]| {
        let nx: usize = shape_x.iter().product();
        let nw: usize = shape_w.iter().product();
        let x = Tensor::<4>::from_data(
            burn::tensor::TensorData::new(values(nx, 5), shape_x),
            &device,
        )
        .require_grad();
        let w = Tensor::<4>::from_data(
            burn::tensor::TensorData::new(values(nw, 6), shape_w),
            &device,
        )
        .require_grad();
        let y = if det {
            det_matmul(x.clone(), w.clone(), nt)
        } else if nt {
            x.clone().matmul(w.clone().swap_dims(2, 3))
        } else {
            x.clone().matmul(w.clone())
        };
        let c = Tensor::<4>::from_data(
            burn::tensor::TensorData::new(values(y.shape().num_elements(), 7), y.dims()),
            &device,
        );
        let grads = (y.clone() * c).sum().backward();
        (
            to_f32_vec(y),
            to_f32_vec(x.grad(&grads).unwrap()),
            to_f32_vec(w.grad(&grads).unwrap()),
        )
    };
    for (nt, sx, sw) in [
        (false, [1, 1, 5, 70], [1, 1, 70, 9]),
        (true, [1, 1, 5, 70], [1, 1, 9, 70]),
        (false, [2, 3, 4, 6], [2, 3, 6, 8]),
        (true, [2, 3, 4, 40], [2, 3, 7, 40]),
    ] {
        let (y0, dx0, dw0) = grads_of(false, nt, sx, sw);
        let (y1, dx1, dw1) = grads_of(true, nt, sx, sw);
        assert!(max_abs_diff(&y0, &y1) < 1e-5, "values, nt {nt}");
        // The backward's products run on the fixed-order GEMM, burn's on its own blocking: the same
        // gradients up to the order of the sums.
        let rel = |a: &[f32], b: &[f32]| {
            let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let n: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
            (d / n).sqrt()
        };
        assert!(
            rel(&dx1, &dx0) <= 1e-6,
            "dx, nt {nt}: {:e}",
            rel(&dx1, &dx0)
        );
        assert!(
            rel(&dw1, &dw0) <= 1e-6,
            "dw, nt {nt}: {:e}",
            rel(&dw1, &dw0)
        );
    }
}

/// The CPU's grouped MoE op (the experts in parallel on the kernel layout) gives the per-expert loop's bits
/// for every scheme and routing (an expert with no token, one with one token, all tokens to two experts),
/// and an autodiff forward (which runs the loop alone on the CPU) gives the same bits and a gradient.
#[test]
fn cpu_grouped_moe_is_bitwise_the_per_expert_loop() {
    use common::moe::{
        bits, host_ids, moe_block, moe_routings, replay, HIDDEN, MOE_SCHEMES, TOKENS,
    };
    use qarl::model::mlp::ExpertPath;
    let device = Device::flex();
    let ad = device.clone().autodiff();
    let x = values(TOKENS * HIDDEN, 11);
    for scheme in MOE_SCHEMES {
        let block = moe_block(&device, scheme, false);
        let trained = moe_block(&ad, scheme, true);
        for (name, ids) in moe_routings() {
            let run = |b: &qarl::model::mlp::MoeBlock, d: &Device, path| {
                let (y, chosen) = b.forward_with(
                    tensor_from_vec(x.clone(), [TOKENS, HIDDEN], d),
                    replay(ids.as_deref(), d),
                    path,
                    Weights::Packed,
                );
                (y, host_ids(chosen))
            };
            let (grouped, chosen) = run(&block, &device, ExpertPath::Auto);
            let (looped, chosen_loop) = run(&block, &device, ExpertPath::PerExpert);
            assert_eq!(chosen, chosen_loop, "{scheme} {name}: routing");
            let (grouped, looped) = (to_f32_vec(grouped), to_f32_vec(looped));
            assert!(
                looped.iter().any(|v| v.abs() > 1e-2),
                "{scheme} {name}: a degenerate output"
            );
            assert_eq!(
                bits(&grouped),
                bits(&looped),
                "{scheme} {name}: grouped differs from the per-expert loop"
            );
            // The grouped op itself (not a fallback to the loop) gives these bits on the CPU.
            let xt = tensor_from_vec(x.clone(), [TOKENS, HIDDEN], &device);
            let probs = qarl::model::layers::softmax_exact(block.gate.forward(xt.clone()), 1);
            let idx = Tensor::<2, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(
                    chosen.iter().map(|&e| e as i64).collect::<Vec<_>>(),
                    [TOKENS, block.top_k],
                ),
                &device,
            );
            let w = probs.gather(1, idx.clone());
            let w = w.clone() / w.sum_dim(1);
            let packed = |f: fn(&qarl::model::mlp::SwiGlu) -> &Linear| {
                block
                    .experts
                    .iter()
                    .map(|e| f(e).quant.as_ref().unwrap().packed.clone())
                    .collect()
            };
            let experts = qarl::ops::ExpertWeights::new(
                packed(|e| &e.gate_proj),
                packed(|e| &e.up_proj),
                packed(|e| &e.down_proj),
            )
            .unwrap();
            let direct =
                qarl::ops::grouped_moe(xt, w, idx, experts).expect("the CPU has a grouped MoE op");
            assert_eq!(
                bits(&to_f32_vec(direct)),
                bits(&looped),
                "{scheme} {name}: direct op"
            );
            let (y, _) = run(&trained, &ad, ExpertPath::Auto);
            let grads = y.clone().sum().backward();
            assert_eq!(
                bits(&to_f32_vec(y)),
                bits(&grouped),
                "{scheme} {name}: training forward differs from the rollout forward"
            );
            let g = trained.experts[chosen[0] as usize]
                .down_proj
                .weight
                .val()
                .grad(&grads)
                .expect("a gradient to the expert's master weight");
            assert!(to_f32_vec(g).iter().any(|v| v.abs() > 1e-6));
        }
    }
}

/// The fused attention core of the CPU (deterministic mode) gives the op-by-op path's bits: several rows, a
/// key head shared by three query heads, two queries each, masked keys (causal and padding) and a key axis
/// that is not a multiple of 32; and under autodiff with a gradient to carry, the fused op steps aside.
#[test]
fn fused_attention_core_matches_the_op_by_op_path() {
    use qarl::model::attention::attention_core_ops;
    use qarl::ops::attention_core;
    let device = Device::flex();
    let (b, kv, rep, t, s, d) = (3usize, 2usize, 3usize, 2usize, 70usize, 64usize);
    let q = values(b * kv * rep * t * d, 11);
    let k = values(b * kv * s * d, 12);
    let v = values(b * kv * s * d, 13);
    let mut mask = vec![0.0f32; b * t * s];
    for r in 0..b {
        let len = s - 7 * r;
        for qi in 0..t {
            for j in 0..s {
                if j > len - t + qi {
                    mask[(r * t + qi) * s + j] = -1.0e30;
                }
            }
        }
    }
    let tq = |v: &[f32], dims: [usize; 4], dev: &Device| tensor_from_vec(v.to_vec(), dims, dev);
    let shape_q = [b, kv, rep * t, d];
    let shape_kv = [b, kv, s, d];
    let shape_m = [b, 1, t, s];
    let scale = 0.3f32; // not a power of two: a fused multiply-add would round differently
    let fused = attention_core(
        tq(&q, shape_q, &device),
        tq(&k, shape_kv, &device),
        tq(&v, shape_kv, &device),
        tq(&mask, shape_m, &device),
        scale,
    )
    .expect("the CPU fuses the attention core in deterministic mode");
    let ops = attention_core_ops(
        tq(&q, shape_q, &device),
        tq(&k, shape_kv, &device),
        tq(&v, shape_kv, &device),
        Some(&tq(&mask, shape_m, &device)),
        scale,
        t,
    );
    let (f, o) = (to_f32_vec(fused), to_f32_vec(ops));
    assert_eq!(f.len(), b * kv * rep * t * d);
    assert!(f.iter().all(|x| x.is_finite()));
    let same = f
        .iter()
        .zip(&o)
        .filter(|(x, y)| x.to_bits() == y.to_bits())
        .count();
    assert_eq!(same, f.len(), "fused and op-by-op attention differ");
    // A query that carries a gradient: the fused op (which has no backward) is not used.
    let ad = Device::flex().autodiff();
    let tracked = tq(&q, shape_q, &ad).require_grad();
    let none = attention_core(
        tracked,
        tq(&k, shape_kv, &ad),
        tq(&v, shape_kv, &ad),
        tq(&mask, shape_m, &ad),
        scale,
    );
    assert!(
        none.is_none(),
        "a tracked input must take the op-by-op path"
    );
}
