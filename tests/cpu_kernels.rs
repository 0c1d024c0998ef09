//! The CPU low-bit kernels: every SIMD path this machine has gives the bits of the portable reference
//! (`lowbit_matmul_reference`: the fixed 32-lane fma order), for every scheme, ragged shapes and every `m`
//! (fused and panel paths), whatever the thread count; the kernel layout decodes exactly like
//! `QuantizedTensor::dequantize_row`.

use qarl::quant::cpu_kernel::{lowbit_matmul_reference, KernelWeights, SimdPath};
use qarl::quant::{QuantScheme, QuantizedTensor};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn every_path_matches_the_reference_bitwise() {
    let paths = SimdPath::available();
    eprintln!(
        "paths on this machine: {:?}",
        paths.iter().map(|p| p.name()).collect::<Vec<_>>()
    );
    // Ragged in (not a multiple of 32, of G or of 128), out not a multiple of the tile or task sizes.
    for &(out, inn) in &[(37, 300), (29, 64), (130, 161)] {
        let w = values(out * inn, out as u64);
        for scheme in QuantScheme::ALL {
            let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
            let k = KernelWeights::new(&q);
            for m in [1, 2, 3, 4, 5, 9] {
                let x = values(m * inn, 100 + m as u64);
                let want = bits(&lowbit_matmul_reference(&q, &x, m));
                for &path in &paths {
                    let got = bits(&k.matmul_on(path, &x, m));
                    assert!(
                        got == want,
                        "{scheme} {out}x{inn} m={m}: path {} differs from the reference",
                        path.name()
                    );
                }
            }
        }
    }
}

#[test]
fn kernel_layout_decodes_like_dequantize_row() {
    let (out, inn) = (20, 200);
    let w = values(out * inn, 7);
    for scheme in QuantScheme::ALL {
        let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
        let k = KernelWeights::new(&q);
        let mut row = vec![0.0f32; inn];
        for o in 0..out {
            q.dequantize_row(o, &mut row);
            let dec = k.decode_row(o);
            assert_eq!(bits(&dec[..inn]), bits(&row), "{scheme} row {o}");
            assert!(
                dec[inn..].iter().all(|v| v.to_bits() == 0),
                "{scheme} padding"
            );
        }
    }
}

/// Every finite E4M3 code under scales from subnormal to large: the shift-and-fold decoding of the kernels
/// equals `e4m3_to_f32(code) * s`, also through the SIMD paths; a scale too large to fold falls back.
#[test]
fn fp8_decoding_is_exact_for_every_code_and_scale() {
    let codes: Vec<u8> = (0u8..=255).filter(|c| c & 0x7F != 0x7F).collect();
    let inn = codes.len(); // 254: ragged
    for &s in &[1.0f32, 3.7e-3, 1e-30, 1.2e-40, 17.0, 200.0, 300.0, 1e6] {
        let q = QuantizedTensor::from_parts(
            QuantScheme::Fp8Block128,
            1,
            inn,
            codes.clone(),
            vec![s, s],
        )
        .unwrap();
        let k = KernelWeights::new(&q);
        let mut row = vec![0.0f32; inn];
        q.dequantize_row(0, &mut row);
        assert_eq!(bits(&k.decode_row(0)[..inn]), bits(&row), "scale {s}");
        let x = values(2 * inn, 9);
        let want = bits(&lowbit_matmul_reference(&q, &x, 2));
        for path in SimdPath::available() {
            assert_eq!(
                bits(&k.matmul_on(path, &x, 2)),
                want,
                "scale {s} {}",
                path.name()
            );
        }
    }
}

/// Big enough to run on the rayon pool: one thread and two threads give the same bits, and a row's result
/// does not depend on the other rows of the call.
#[test]
fn thread_count_and_batch_do_not_change_bits() {
    let (out, inn, m) = (520, 256, 9);
    let w = values(out * inn, 11);
    let x = values(m * inn, 12);
    for scheme in QuantScheme::ALL {
        let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
        let k = KernelWeights::new(&q);
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| k.matmul(&x, m))
        };
        let one = bits(&run(1));
        assert_eq!(one, bits(&run(2)), "{scheme}: thread count");
        for i in [0, 4, 8] {
            let alone = bits(&k.matmul(&x[i * inn..(i + 1) * inn], 1));
            assert_eq!(alone, one[i * out..(i + 1) * out], "{scheme}: row {i}");
        }
    }
}

/// The quantized layer through burn (flex): a token decoded alone gives the bits it gets inside a longer
/// batch, for every scheme, with an input width that is not a multiple of 128 (SmolLM2's 576).
#[test]
fn quantized_layer_rows_are_batch_invariant_at_real_widths() {
    use burn::tensor::Device;
    use qarl::model::layers::{tensor_from_vec, to_f32_vec};
    use qarl::quant::QuantizedWeight;
    let device = Device::flex();
    let (inn, out, m) = (576, 96, 13);
    let master = tensor_from_vec(values(inn * out, 21), [inn, out], &device);
    let x = values(m * inn, 22);
    for scheme in QuantScheme::ALL {
        let q = QuantizedWeight::from_master(master.clone(), scheme).unwrap();
        let all = to_f32_vec(q.matmul(
            tensor_from_vec(x.clone(), [m, inn], &device),
            master.clone(),
        ));
        for i in [0, 5, 12] {
            let row = tensor_from_vec(x[i * inn..(i + 1) * inn].to_vec(), [1, inn], &device);
            let alone = to_f32_vec(q.matmul(row, master.clone()));
            assert_eq!(
                bits(&alone),
                bits(&all[i * out..(i + 1) * out]),
                "{scheme}: row {i}"
            );
        }
    }
}
