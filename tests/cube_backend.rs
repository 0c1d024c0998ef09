//! The quantized linear layer on burn's CubeCL backend (`--features wgpu`): the `cube_kernels` low-bit
//! matmul behind the backend extension, against the CPU kernel on the same weights, its batch invariance,
//! and the straight-through gradients (the transposed kernel for dx) against the CPU autodiff.
//!
//! Runs on whatever adapter wgpu finds (lavapipe on a CPU-only machine); skips with a message when there is
//! none, unless `QARL_REQUIRE_WGPU=1`.
#![cfg(feature = "wgpu")]

mod common;

use burn::tensor::{Device, Tensor};
use common::values;
use qarl::model::layers::{tensor_from_vec, to_f32_vec, Linear};
use qarl::quant::cpu_kernel::lowbit_matmul;
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

fn linear(w: &[f32], out: usize, inn: usize, device: &Device) -> Linear {
    let w_in_out = tensor_from_vec(w.to_vec(), [out, inn], device).transpose();
    Linear {
        weight: burn::module::Param::from_tensor(Tensor::from_data(w_in_out.into_data(), device)),
        bias: None,
        quant: None,
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
