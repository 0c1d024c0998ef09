//! The CPU low-bit kernels: every SIMD path this machine has gives the bits of the portable reference
//! (`lowbit_matmul_reference`: the fixed 32-lane fma order), for every scheme, ragged shapes and every `m`
//! (fused and panel paths), whatever the thread count; the kernel layout decodes exactly like
//! `QuantizedTensor::dequantize_row`.

mod common;

use common::values;
use qarl::ops::cpu::kernel::{lowbit_matmul_reference, KernelWeights, SimdPath};
use qarl::quant::{QuantScheme, QuantizedTensor};

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
    // (On aarch64 the NEON path must be there, or this test would check only the reference against itself.)
    #[cfg(target_arch = "aarch64")]
    assert!(paths.contains(&SimdPath::Neon), "no NEON path on aarch64");
    // Ragged in (not a multiple of 32, of G or of 128), out not a multiple of the tile or task sizes.
    for &(out, inn) in &[(37, 300), (29, 64), (130, 161)] {
        let w = values(out * inn, out as u64);
        for scheme in QuantScheme::ALL {
            let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
            let k = KernelWeights::new(&q);
            for m in [1, 2, 3, 4, 5, 6, 8, 9] {
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

/// The activations' address does not matter: rows starting anywhere (the kernels copy them to a 64-byte
/// boundary when they are not on one, padding ragged rows) give the bits of the reference.
#[test]
fn activations_at_any_address_give_the_same_bits() {
    for &(out, inn) in &[(40, 256), (33, 200)] {
        let w = values(out * inn, 21);
        for scheme in QuantScheme::ALL {
            let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
            let k = KernelWeights::new(&q);
            for m in [1, 3, 6] {
                let x = values(m * inn + 16, 22 + m as u64);
                for offset in 0..16 {
                    let xs = &x[offset..offset + m * inn];
                    assert_eq!(
                        bits(&k.matmul(xs, m)),
                        bits(&lowbit_matmul_reference(&q, xs, m)),
                        "{scheme} {out}x{inn} m={m} offset {offset}"
                    );
                }
            }
        }
    }
}

/// A weight with no input features multiplies to zeros on every path (nothing to pad or align).
#[test]
fn zero_input_features_give_zeros() {
    for scheme in QuantScheme::ALL {
        let q = QuantizedTensor::quantize(&[], 3, 0, scheme).unwrap();
        let k = KernelWeights::new(&q);
        for &path in &SimdPath::available() {
            assert_eq!(
                k.matmul_on(path, &[], 2),
                vec![0.0; 6],
                "{scheme} {}",
                path.name()
            );
        }
    }
}

/// A weight whose codes pass 2 MiB lives in a huge-page mapping instead of a vector: the same decoding, the
/// same products, and a clone that is an independent copy.
#[test]
fn weights_in_a_huge_page_mapping_decode_and_multiply_alike() {
    // int8: 1600 x 1344 bytes of codes = 2.05 MiB; int4 in groups of four rows: 1.03 MiB (the vector path).
    let (out, inn) = (1600, 1344);
    let w = values(out * inn, 11);
    for scheme in [QuantScheme::Int8PerChannel, QuantScheme::Int4G32] {
        let q = QuantizedTensor::quantize(&w, out, inn, scheme).unwrap();
        let k = KernelWeights::new(&q);
        let copy = k.clone();
        drop(k);
        assert_eq!(
            copy.codes_in_huge_page_mapping(),
            scheme == QuantScheme::Int8PerChannel,
            "{scheme}"
        );
        let mut row = vec![0.0f32; inn];
        for o in [0, 1, 799, out - 1] {
            q.dequantize_row(o, &mut row);
            assert_eq!(
                bits(&copy.decode_row(o)[..inn]),
                bits(&row),
                "{scheme} row {o}"
            );
        }
        let x = values(2 * inn, 12);
        assert_eq!(
            bits(&copy.matmul(&x, 2)),
            bits(&lowbit_matmul_reference(&q, &x, 2)),
            "{scheme}"
        );
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
    use qarl::host::{tensor_from_vec, to_f32_vec};
    use qarl::ops::QuantizedWeight;
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

/// Deterministic mode's f32 products (`x · w` with `w [k, n]`: one fma chain per element in `k` order; `x · w^T`
/// with `w [n, k]`: the 32-lane order) give the reference's bits on every SIMD path, for odd shapes and
/// batches, and a row's result does not depend on how many other rows the call has.
#[test]
fn f32_products_match_their_reference_and_are_row_batch_invariant() {
    use qarl::ops::cpu::kernel::{
        f32_matmul_nt_on, f32_matmul_nt_reference, f32_matmul_on, f32_matmul_reference,
    };
    for &(batch, m, k, n) in &[
        (1usize, 1usize, 7usize, 5usize),
        (1, 5, 160, 300),
        (3, 6, 40, 70),
        (1, 9, 576, 1000), // output rows split over tasks, a partial last task
        (4, 5, 96, 400),   // products split over tasks, each writing its own slice of the output
        (1, 3, 96, 200),   // three rows in one pass over w
        (1, 7, 33, 130),   // four, then three, from the packed block
        (2, 1, 64, 129),
        (1, 300, 64, 130), // split in row chunks and 64-column blocks over threads
        (1, 8, 131, 1100), // streamed rows of w (m <= 8), a partial step of rows, tail columns
        (1, 6, 35, 1100),  // streamed, activation rows in groups of four and two
        (1, 3, 9, 1040),   // streamed, one group of three
        (1, 1, 12, 1030),  // streamed GEMV
        (1, 2, 515, 600),
    ] {
        let x = values(batch * m * k, (m * k) as u64);
        let w = values(batch * k * n, (k * n + 1) as u64);
        let want = f32_matmul_reference(&x, &w, batch, m, k, n);
        let want_nt = f32_matmul_nt_reference(&x, &w, batch, m, k, n);
        for path in SimdPath::available() {
            let got = f32_matmul_on(path, &x, &w, batch, m, k, n);
            assert_eq!(bits(&got), bits(&want), "nn {path:?} {batch}x{m}x{k}x{n}");
            let got = f32_matmul_nt_on(path, &x, &w, batch, m, k, n);
            assert_eq!(
                bits(&got),
                bits(&want_nt),
                "nt {path:?} {batch}x{m}x{k}x{n}"
            );
            // Row 0 alone gives the same bits as within the batch.
            if batch == 1 && m > 1 {
                let one = f32_matmul_on(path, &x[..k], &w, 1, 1, k, n);
                assert_eq!(bits(&one), bits(&want[..n]), "nn row 0 alone {path:?}");
                let one = f32_matmul_nt_on(path, &x[..k], &w, 1, 1, k, n);
                assert_eq!(bits(&one), bits(&want_nt[..n]), "nt row 0 alone {path:?}");
            }
        }
    }
}

/// Deterministic mode's softmax: a row's bits do not depend on the other rows nor on masked (`-1e30`) entries
/// appended to it.
#[test]
fn fixed_order_softmax_ignores_other_rows_and_masked_tail() {
    use qarl::ops::cpu::kernel::softmax_rows;
    let x = values(3 * 50, 9);
    let all = softmax_rows(&x, 50);
    let alone = softmax_rows(&x[50..100], 50);
    assert_eq!(bits(&all[50..100]), bits(&alone));
    let mut padded = x[50..100].to_vec();
    padded.extend(std::iter::repeat_n(-1.0e30f32, 78));
    let p = softmax_rows(&padded, 128);
    assert_eq!(bits(&p[..50]), bits(&alone));
    assert!(p[50..].iter().all(|&v| v == 0.0));
}
