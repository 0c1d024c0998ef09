//! The quantized linear layer on burn's CubeCL backend (`--features wgpu`): the `cube_kernels` low-bit
//! matmul behind the backend extension, against the CPU kernel on the same weights, its batch invariance,
//! and the straight-through gradients (the transposed kernel for dx) against the CPU autodiff. The MoE
//! block's grouped kernel against its per-expert loop: values, autodiff forward bits, and the gradients of
//! its one-pass training pair (the grouped backward) against the per-expert graph's. f16
//! activations (where the adapter has them; lavapipe does) go to the kernels too: the f32 result, rounded.
//!
//! Runs on whatever adapter wgpu finds (lavapipe on a CPU-only machine); skips with a message when there is
//! none, unless `QARL_REQUIRE_WGPU=1`.
#![cfg(feature = "wgpu")]

mod common;

use burn::tensor::{Device, Int, Tensor, TensorData};
use common::moe::{
    bits, host_ids, linear, moe_block, moe_routings, replay, EXPERTS, HIDDEN, INTER, MOE_SCHEMES,
    TOKENS, TOP_K,
};
use common::{fixtures_dir, values};
use qarl::host::{tensor_from_vec, to_f32_vec};
use qarl::model::mlp::ExpertPath;
use qarl::model::Weights;

use qarl::ops::cpu::kernel::lowbit_matmul;
use qarl::quant::{QuantScheme, QuantizedTensor};

fn wgpu_device() -> Option<Device> {
    let made = std::panic::catch_unwind(|| {
        let d = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        // Touch the device so a missing adapter shows up here.
        let _ = to_f32_vec(Tensor::<2>::zeros([1, 1], &d));
        d
    });
    match made {
        Ok(d) => Some(d),
        Err(_) if std::env::var("QARL_REQUIRE_WGPU").is_ok_and(|v| v == "1") => {
            panic!("QARL_REQUIRE_WGPU=1 but burn found no wgpu adapter")
        }
        Err(_) => {
            eprintln!("SKIPPED: no wgpu adapter (install mesa-vulkan-drivers for lavapipe)");
            None
        }
    }
}

/// `sum_k |x_k w_k|` per output: the magnitude a sum's rounding is relative to.
fn abs_scale(x: &[f32], m: usize, q: &QuantizedTensor) -> Vec<f32> {
    let [out, inn] = q.shape();
    let xa = if q.scheme().quantizes_activations() {
        qarl::quant::Fp8Activations::quantize(x, m, inn)
            .unwrap()
            .dequantize()
    } else {
        x.to_vec()
    };
    let deq = q.dequantize();
    (0..m * out)
        .map(|i| {
            (0..inn)
                .map(|k| (xa[i / out * inn + k] * deq[i % out * inn + k]).abs())
                .sum()
        })
        .collect()
}

#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); run: cargo test --features wgpu --test cube_backend -- --include-ignored"]
fn cube_quant_matmul_matches_the_cpu_kernel_and_is_batch_invariant() {
    let Some(device) = wgpu_device() else { return };
    let (out, inn) = (48, 300);
    let w = values(out * inn, 1);
    for scheme in QuantScheme::ALL {
        let mut lin = linear(&w, out, inn, &device);
        lin.quantize(scheme).unwrap();
        let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
        for m in [1usize, 3, 21] {
            let x = values(m * inn, 2 + m as u64);
            let y = to_f32_vec(lin.forward(tensor_from_vec(x.clone(), [m, inn], &device)));
            let want = lowbit_matmul(&q, &x, m);
            for (i, ((a, b), s)) in y.iter().zip(&want).zip(abs_scale(&x, m, &q)).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * s.max(1e-6),
                    "{scheme} m={m} y[{i}]: {a} vs cpu {b}"
                );
            }
            // The last token alone gives the bits it got inside the batch (GEMV vs GEMM included).
            let last = to_f32_vec(lin.forward(tensor_from_vec(
                x[(m - 1) * inn..].to_vec(),
                [1, inn],
                &device,
            )));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&last),
                bits(&y[(m - 1) * out..]),
                "{scheme} m={m}: batch dependence"
            );
        }
    }
}

#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); run: cargo test --features wgpu --test cube_backend -- --include-ignored"]
fn cube_straight_through_gradients_match_the_cpu() {
    let Some(device) = wgpu_device() else { return };
    let (m, out, inn) = (5, 24, 96);
    let w = values(out * inn, 7);
    let xv = values(m * inn, 8);
    let r = values(m * out, 9);
    for scheme in [
        QuantScheme::Int4G32,
        QuantScheme::Int8PerChannel,
        QuantScheme::Fp8Block128,
        QuantScheme::Nvfp4,
        QuantScheme::Mxfp4,
    ] {
        let grads_on = |dev: &Device| {
            let ad = dev.clone().autodiff();
            let mut lin = linear(&w, out, inn, &ad);
            lin.weight = lin.weight.clone().map(|t| t.require_grad());
            lin.quantize(scheme).unwrap();
            let x = tensor_from_vec(xv.clone(), [m, inn], &ad).require_grad();
            let loss = (lin.forward(x.clone()) * tensor_from_vec(r.clone(), [m, out], &ad)).sum();
            let grads = loss.backward();
            (
                to_f32_vec(x.grad(&grads).unwrap()),
                to_f32_vec(lin.weight.val().grad(&grads).unwrap()),
            )
        };
        let (dx_gpu, dw_gpu) = grads_on(&device);
        let (dx_cpu, dw_cpu) = grads_on(&Device::flex());
        for (name, a, b) in [("dx", &dx_gpu, &dx_cpu), ("dW", &dw_gpu, &dw_cpu)] {
            assert_eq!(a.len(), b.len());
            for (i, (p, q)) in a.iter().zip(b.iter()).enumerate() {
                assert!(
                    (p - q).abs() <= 1e-4 * (1.0 + q.abs()),
                    "{scheme} {name}[{i}]: wgpu {p} vs cpu {q}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); run: cargo test --features wgpu --test cube_backend -- --include-ignored"]
fn cube_grouped_moe_matches_the_per_expert_loop() {
    let Some(device) = wgpu_device() else { return };
    let x = values(TOKENS * HIDDEN, 11);
    for scheme in MOE_SCHEMES {
        let block = moe_block(&device, scheme, false);
        let mut worst = 0.0f32;
        let mut any_bit_differs = false;
        for (name, ids) in moe_routings() {
            let run = |path| {
                let xt = tensor_from_vec(x.clone(), [TOKENS, HIDDEN], &device);
                let forced = replay(ids.as_deref(), &device);
                let (y, chosen) = block.forward_with(xt, forced, path, Weights::Packed);
                (to_f32_vec(y), host_ids(chosen))
            };
            let (grouped, chosen) = run(ExpertPath::Auto);
            let (looped, chosen_loop) = run(ExpertPath::PerExpert);
            assert_eq!(chosen, chosen_loop, "{scheme} {name}: routing");
            if let Some(ids) = &ids {
                assert_eq!(&chosen, ids);
            }
            let scale = looped.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(scale > 1e-2, "{scheme} {name}: a degenerate output");
            for (i, (g, l)) in grouped.iter().zip(&looped).enumerate() {
                let rel = (g - l).abs() / scale;
                worst = worst.max(rel);
                assert!(
                    rel <= 1e-5,
                    "{scheme} {name} out[{i}]: grouped {g} vs per-expert {l} (scale {scale})"
                );
            }
            any_bit_differs |= bits(&grouped) != bits(&looped);
            // The grouped path is deterministic.
            assert_eq!(bits(&run(ExpertPath::Auto).0), bits(&grouped));
        }
        eprintln!("{scheme}: grouped vs per-expert, max |diff| / max |out| = {worst:.3e}");
        // Another summation (fused combine, the kernel's SwiGLU) shows in the bits: the grouped kernel
        // really served the Auto path.
        assert!(
            any_bit_differs,
            "{scheme}: Auto gave the per-expert loop's bits"
        );
    }
}

/// Loss `sum(out * r)` of the block on `device` (an autodiff one): (out, dx, d router, d master of the
/// gate, up and down projections of token 0's first expert).
fn moe_grads(
    device: &Device,
    scheme: QuantScheme,
    ids: Option<&[u32]>,
    path: ExpertPath,
) -> [Vec<f32>; 6] {
    let block = moe_block(device, scheme, true);
    let x = tensor_from_vec(values(TOKENS * HIDDEN, 11), [TOKENS, HIDDEN], device).require_grad();
    let r = tensor_from_vec(values(TOKENS * HIDDEN, 12), [TOKENS, HIDDEN], device);
    let (y, chosen) = block.forward_with(x.clone(), replay(ids, device), path, Weights::Packed);
    let e = host_ids(chosen)[0] as usize;
    let grads = (y.clone() * r).sum().backward();
    let g = |t: Tensor<2>| to_f32_vec(t.grad(&grads).expect("a gradient"));
    [
        to_f32_vec(y),
        g(x),
        g(block.gate.weight.val()),
        g(block.experts[e].gate_proj.weight.val()),
        g(block.experts[e].up_proj.weight.val()),
        g(block.experts[e].down_proj.weight.val()),
    ]
}

#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); run: cargo test --features wgpu --test cube_backend -- --include-ignored"]
fn cube_grouped_moe_autodiff_forward_is_the_rollout_forward_and_gradients_are_the_loops() {
    let Some(device) = wgpu_device() else { return };
    let ad = device.clone().autodiff();
    let x = values(TOKENS * HIDDEN, 11);
    for scheme in MOE_SCHEMES {
        let block = moe_block(&device, scheme, false);
        for (name, ids) in moe_routings() {
            let ids = ids.as_deref();
            let rollout = to_f32_vec(
                block
                    .forward(
                        tensor_from_vec(x.clone(), [TOKENS, HIDDEN], &device),
                        replay(ids, &device),
                        Weights::Packed,
                    )
                    .0,
            );
            let backwards = qarl::ops::grouped_moe_backwards();
            let [out, dx, dgate, dg1, du1, dd1] = moe_grads(&ad, scheme, ids, ExpertPath::Auto);
            // The one-pass path ran: its own backward, not the per-expert graph's.
            assert!(
                qarl::ops::grouped_moe_backwards() > backwards,
                "{scheme} {name}: the training forward did not take the grouped MoE backward"
            );
            assert_eq!(
                bits(&out),
                bits(&rollout),
                "{scheme} {name}: training forward differs from the rollout forward"
            );
            let [out_loop, dx_l, dgate_l, dg1_l, du1_l, dd1_l] =
                moe_grads(&ad, scheme, ids, ExpertPath::PerExpert);
            assert_ne!(
                bits(&out_loop),
                bits(&out),
                "{scheme} {name}: the grouped kernel did not run under autodiff"
            );
            // The CPU autodiff of the same block (the per-expert loop, the CPU kernels).
            let [_, dx_c, dgate_c, dg1_c, du1_c, dd1_c] =
                moe_grads(&Device::flex().autodiff(), scheme, ids, ExpertPath::Auto);
            let mut worst = [0.0f32; 2];
            for (what, a, b, c) in [
                ("dx", &dx, &dx_l, &dx_c),
                ("d router", &dgate, &dgate_l, &dgate_c),
                ("d expert gate", &dg1, &dg1_l, &dg1_c),
                ("d expert up", &du1, &du1_l, &du1_c),
                ("d expert down", &dd1, &dd1_l, &dd1_c),
            ] {
                assert_eq!(a.len(), b.len());
                assert!(
                    a.iter().any(|v| v.abs() > 1e-6),
                    "{scheme} {name} {what}: no gradient"
                );
                for (i, ((p, q), r)) in a.iter().zip(b).zip(c).enumerate() {
                    worst[0] = worst[0].max((p - q).abs());
                    worst[1] = worst[1].max((p - r).abs());
                    assert!(
                        (p - q).abs() <= 1e-5 * (1.0 + q.abs()),
                        "{scheme} {name} {what}[{i}]: grouped {p} vs per-expert {q}"
                    );
                    assert!(
                        (p - r).abs() <= 1e-4 * (1.0 + r.abs()),
                        "{scheme} {name} {what}[{i}]: wgpu {p} vs cpu {r}"
                    );
                }
            }
            eprintln!(
                "{scheme} {name}: max |grad diff| vs per-expert {:.3e}, vs cpu {:.3e}",
                worst[0], worst[1]
            );
        }
    }
}

/// The whole Qwen3-MoE fixture on wgpu, its experts on the grouped kernel: the training (autodiff) forward's
/// log-probs are the rollout (inference) forward's, bit for bit.
#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); run: cargo test --features wgpu --test cube_backend -- --include-ignored"]
fn cube_moe_model_training_and_rollout_log_probs_are_bitwise_equal() {
    let Some(device) = wgpu_device() else { return };
    let dir = fixtures_dir().join("qwen3_moe");
    let train_dev = device.clone().autodiff();
    let seqs = vec![vec![5u32, 9, 200, 31, 7, 8, 100], vec![1, 2, 3, 4]];
    let prompt_lens = [2usize, 1];
    for scheme in MOE_SCHEMES {
        let (a, b) = common::moe::infer_and_train_logprobs(
            &dir,
            &device,
            &train_dev,
            scheme,
            &seqs,
            &prompt_lens,
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!(!x.is_empty());
            assert_eq!(
                bits(x),
                bits(y),
                "{scheme}: training {y:?} vs rollout {x:?} log-probs"
            );
        }
    }
}

/// f16 activations reach the kernels (no dequantize-and-matmul fallback) and come back as the f32 result on
/// the same inputs widened, rounded once to f16: the quantized linear layer, the straight-through
/// backward's transposed product, and the grouped MoE op.
#[test]
#[ignore = "needs a wgpu adapter (a Vulkan driver, e.g. Mesa lavapipe: mesa-vulkan-drivers); run: cargo test --features wgpu --test cube_backend -- --include-ignored"]
fn cube_kernels_take_f16_activations_and_round_the_f32_result_once() {
    use burn::backend::Dispatch;
    use burn::tensor::DType;
    use cube_kernels::ActDType;
    use qarl::ops::{grouped_moe, ExpertWeights};
    use qarl::ops::{KernelOps, PackedWeight};

    let Some(device) = wgpu_device() else { return };
    match cube_kernels::Kernels::wgpu() {
        Ok(k) if k.supports(ActDType::F16) => {
            eprintln!("adapter `{}` has f16", k.device_name())
        }
        Ok(k) => {
            // A pass must mean it ran: CI (`QARL_REQUIRE_WGPU=1`) fails here, as the kernel crate's f16
            // tests do (`half_kernels` in cube_kernels/tests/kernels.rs).
            let why = format!("adapter `{}` has no f16 buffers", k.device_name());
            if std::env::var("QARL_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("QARL_REQUIRE_WGPU=1 but {why}: this test needs f16");
            }
            eprintln!("SKIPPED: {why}");
            return;
        }
        Err(e) => panic!("burn found a wgpu adapter but cube_kernels did not: {e}"),
    }
    let half =
        |v: &[f32], shape: [usize; 2]| tensor_from_vec(v.to_vec(), shape, &device).cast(DType::F16);
    // Exact widening on the device, then the host copy.
    let widened = |t: Tensor<2>| {
        assert_eq!(
            t.dtype(),
            DType::F16,
            "the result keeps the activations' dtype"
        );
        to_f32_vec(t.cast(DType::F32))
    };
    let rounded = |t: Tensor<2>| -> Vec<f32> {
        to_f32_vec(t)
            .iter()
            .map(|v| ActDType::F16.round(*v))
            .collect()
    };

    let (m, out, inn) = (5, 24, 96);
    for scheme in QuantScheme::ALL {
        let mut lin = linear(&values(out * inn, 21), out, inn, &device);
        lin.quantize(scheme).unwrap();
        let x = half(&values(m * inn, 22), [m, inn]);
        assert_eq!(
            bits(&widened(lin.forward(x.clone()))),
            bits(&rounded(lin.forward(x.cast(DType::F32)))),
            "{scheme}: f16 forward is not round(f32 forward)"
        );
        let packed = lin.quant.as_ref().unwrap().packed.clone();
        let transposed = |g: Tensor<2>| {
            Tensor::<2>::from_dispatch(<Dispatch as KernelOps>::quant_matmul_transposed(
                g.into_dispatch(),
                packed.clone(),
            ))
        };
        let g = half(&values(m * out, 23), [m, out]);
        assert_eq!(
            bits(&widened(transposed(g.clone()))),
            bits(&rounded(transposed(g.cast(DType::F32)))),
            "{scheme}: f16 dx is not round(f32 dx)"
        );
    }

    for scheme in MOE_SCHEMES {
        let proj = |out: usize, inn: usize, seed: u64| {
            let w: Vec<f32> = values(out * inn, seed).iter().map(|v| 0.4 * v).collect();
            PackedWeight::new(QuantizedTensor::quantize(&w, out, inn, scheme).unwrap())
        };
        let e = 0..EXPERTS as u64;
        let experts = ExpertWeights::new(
            e.clone()
                .map(|e| proj(INTER, HIDDEN, 200 + 3 * e))
                .collect(),
            e.clone()
                .map(|e| proj(INTER, HIDDEN, 201 + 3 * e))
                .collect(),
            e.map(|e| proj(HIDDEN, INTER, 202 + 3 * e)).collect(),
        )
        .unwrap();
        let ids: Vec<i64> = moe_routings()[0]
            .1
            .iter()
            .flatten()
            .map(|&e| e as i64)
            .collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [TOKENS, TOP_K]), &device);
        let x = half(&values(TOKENS * HIDDEN, 24), [TOKENS, HIDDEN]);
        let rw: Vec<f32> = values(TOKENS * TOP_K, 25).iter().map(|v| v.abs()).collect();
        let rw = half(&rw, [TOKENS, TOP_K]);
        let y16 =
            grouped_moe(x.clone(), rw.clone(), ids.clone(), experts.clone()).expect("f16 kernel");
        let y32 = grouped_moe(x.cast(DType::F32), rw.cast(DType::F32), ids, experts).unwrap();
        assert_eq!(
            bits(&widened(y16)),
            bits(&rounded(y32)),
            "{scheme}: f16 grouped MoE is not round(f32)"
        );
    }
}
