//! The FP4 weight formats (`nvfp4`, `mxfp4`, docs/formats.md) against the committed Python reference
//! (`tests/fixtures/quant/make_fp4_reference.py`), bit for bit: E2M1 encoding over every tie and its
//! neighbours, and per case the packed codes, the scales (and the nvfp4 tensor scale and E4M3 block codes,
//! the mxfp4 E8M0 exponents), the dequantized weights and the weight-only matmul; then the CPU kernels on
//! the same weights, and the loading checks of the packed storage.

use std::path::PathBuf;

use qarl::ops::cpu::kernel::{lowbit_matmul_reference, KernelWeights, SimdPath};
use qarl::quant::fp4::{f32_to_e2m1, nvfp4_scales};
use qarl::quant::{f32_to_e4m3, QuantScheme, QuantizedTensor};
use safetensors::{Dtype, SafeTensors};

struct Fixture<'a>(SafeTensors<'a>, std::collections::HashMap<String, String>);

impl<'a> Fixture<'a> {
    fn open(bytes: &'a [u8]) -> Self {
        let (_, metadata) = SafeTensors::read_metadata(bytes).expect("fixture header");
        let metadata = metadata.metadata().clone().unwrap_or_default();
        Fixture(
            SafeTensors::deserialize(bytes).expect("fixture tensors"),
            metadata,
        )
    }

    fn raw(&self, name: &str, dtype: Dtype) -> (Vec<usize>, Vec<u8>) {
        let t = self
            .0
            .tensor(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.dtype(), dtype, "{name}");
        (t.shape().to_vec(), t.data().to_vec())
    }

    fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (shape, data) = self.raw(name, Dtype::F32);
        let values = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (shape, values)
    }

    fn u8s(&self, name: &str) -> (Vec<usize>, Vec<u8>) {
        self.raw(name, Dtype::U8)
    }

    fn list(&self, key: &str) -> Vec<String> {
        let text = self
            .1
            .get(key)
            .unwrap_or_else(|| panic!("fixture metadata lacks `{key}`"));
        text.split(',').map(str::to_owned).collect()
    }
}

fn fixture_bytes() -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quant/fp4_reference.safetensors");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Bitwise equality of f32 slices, where any NaN equals any NaN (overflowing products in the fixture).
fn assert_same_bits(what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: length");
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        let same = a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        assert!(
            same,
            "{what}[{i}]: ours {a:e} ({:#010x}), python {b:e} ({:#010x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

/// The E8M0 code (exponent + 127) of an mxfp4 scale, which must be an exact power of two in
/// [2^-127, 2^127].
fn e8m0_of(scale: f32) -> u8 {
    let bits = scale.to_bits();
    let biased = bits >> 23;
    if biased == 0 {
        assert_eq!(bits, 1 << 22, "{scale:e} is not 2^-127");
        0
    } else {
        assert_eq!(bits & 0x7F_FFFF, 0, "{scale:e} is not a power of two");
        (biased as i32 - 127 + 127) as u8
    }
}

#[test]
fn e2m1_encoding_matches_python_on_every_tie_and_neighbour() {
    let bytes = fixture_bytes();
    let fixture = Fixture::open(&bytes);
    let (_, inputs) = fixture.f32s("e2m1/encode_inputs");
    let (_, codes) = fixture.u8s("e2m1/encode_codes");
    assert!(inputs.len() > 1000);
    for (v, want) in inputs.iter().zip(&codes) {
        assert_eq!(f32_to_e2m1(*v), *want, "e2m1({v:e})");
    }
    // The spec's ties, by hand: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    let ties = [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
    ];
    for (v, value) in ties {
        let code = f32_to_e2m1(v);
        assert_eq!(qarl::quant::fp4::e2m1_to_f32(code), value, "tie {v}");
    }
}

#[test]
fn both_formats_match_the_python_reference_bit_exactly() {
    let bytes = fixture_bytes();
    let fixture = Fixture::open(&bytes);
    let schemes = fixture.list("schemes");
    let cases = fixture.list("cases");
    assert_eq!(schemes, ["nvfp4", "mxfp4"]);
    assert!(cases.len() >= 8, "{cases:?}");
    for case in &cases {
        let (w_shape, weights) = fixture.f32s(&format!("case/{case}/weight"));
        let (x_shape, x) = fixture.f32s(&format!("case/{case}/x"));
        let (out, inn, m) = (w_shape[0], w_shape[1], x_shape[0]);
        for name in &schemes {
            let scheme: QuantScheme = name.parse().unwrap();
            let at = |key: &str| format!("{name}/{case}/{key}");
            let q = QuantizedTensor::quantize(&weights, out, inn, scheme).unwrap();

            let (data_shape, data) = fixture.u8s(&at("data"));
            assert_eq!(data_shape, [out, inn.div_ceil(2)], "{}", at("data"));
            assert_eq!(q.data(), &data[..], "{}: packed codes", at("data"));
            let (scale_shape, scales) = fixture.f32s(&at("scales"));
            assert_eq!(q.scale_shape(), scale_shape, "{}", at("scales"));
            assert_same_bits(&at("scales"), q.scales(), &scales);
            let (_, dequant) = fixture.f32s(&at("dequant"));
            assert_same_bits(&at("dequant"), &q.dequantize(), &dequant);
            let (_, matmul) = fixture.f32s(&at("matmul"));
            assert_same_bits(&at("matmul"), &q.matmul_reference(&x, m).unwrap(), &matmul);
            assert_same_bits(&at("matmul"), &q.matmul(&x, m).unwrap(), &matmul);

            if scheme == QuantScheme::Nvfp4 {
                let (tensor, block_codes) = nvfp4_scales(&weights, out, inn);
                let (_, want_tensor) = fixture.f32s(&at("tensor_scale"));
                assert_same_bits(&at("tensor_scale"), &[tensor], &want_tensor);
                let (_, want_codes) = fixture.u8s(&at("block_codes"));
                assert_eq!(block_codes, want_codes, "{}", at("block_codes"));
            } else {
                let (_, want) = fixture.u8s(&at("e8m0"));
                let ours: Vec<u8> = q.scales().iter().map(|&s| e8m0_of(s)).collect();
                assert_eq!(ours, want, "{}", at("e8m0"));
            }

            // Loading the stored parts gives the same tensor (every code valid, padding nibbles 0).
            let (s, [o, i], d, sc) = q.clone().into_parts();
            assert_eq!(QuantizedTensor::from_parts(s, o, i, d, sc).unwrap(), q);
        }
    }
}

/// The CPU kernels on the fixture's weights: every SIMD path gives the bits of the fixed-order reference,
/// whatever `m` (the fused tiles and the decoded panels).
#[test]
fn kernels_on_the_fixture_weights_match_the_reference_on_every_path() {
    let bytes = fixture_bytes();
    let fixture = Fixture::open(&bytes);
    for case in fixture.list("cases") {
        let (w_shape, weights) = fixture.f32s(&format!("case/{case}/weight"));
        let (out, inn) = (w_shape[0], w_shape[1]);
        for scheme in [QuantScheme::Nvfp4, QuantScheme::Mxfp4] {
            let q = QuantizedTensor::quantize(&weights, out, inn, scheme).unwrap();
            let k = KernelWeights::new(&q);
            let mut row = vec![0.0f32; inn];
            for o in 0..out {
                q.dequantize_row(o, &mut row);
                assert_same_bits(
                    &format!("{scheme} {case} row {o}"),
                    &k.decode_row(o)[..inn],
                    &row,
                );
            }
            for m in [1, 3, 9] {
                let x: Vec<f32> = (0..m * inn)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                    .collect();
                let want = lowbit_matmul_reference(&q, &x, m);
                for path in SimdPath::available() {
                    let what = format!("{scheme} {case} m={m} {}", path.name());
                    assert_same_bits(&what, &k.matmul_on(path, &x, m), &want);
                }
            }
        }
    }
}

/// The quantizer's own invariants on the fixture's nvfp4 cases: the stored scale is the f32 product of
/// the E4M3 block scale and the tensor scale, and a block scale never exceeds 448.
#[test]
fn nvfp4_scales_are_the_product_of_the_two_factors() {
    let bytes = fixture_bytes();
    let fixture = Fixture::open(&bytes);
    for case in fixture.list("cases") {
        let (w_shape, weights) = fixture.f32s(&format!("case/{case}/weight"));
        let (out, inn) = (w_shape[0], w_shape[1]);
        let q = QuantizedTensor::quantize(&weights, out, inn, QuantScheme::Nvfp4).unwrap();
        let (tensor, codes) = nvfp4_scales(&weights, out, inn);
        for (s, &c) in q.scales().iter().zip(&codes) {
            let block = qarl::quant::e4m3_to_f32(c);
            assert!(
                (0.0..=448.0).contains(&block),
                "{case}: block scale {block}"
            );
            assert_eq!(s.to_bits(), (block * tensor).to_bits(), "{case}");
        }
        assert!(codes
            .iter()
            .all(|&c| c == f32_to_e4m3(qarl::quant::e4m3_to_f32(c))));
    }
}

/// Loading rejects fp4 storage the quantizer never writes: a non-zero padding nibble of an odd row.
#[test]
fn from_parts_rejects_a_nonzero_padding_nibble() {
    for scheme in [QuantScheme::Nvfp4, QuantScheme::Mxfp4] {
        let q = QuantizedTensor::quantize(&[1.0, -0.5, 0.25], 1, 3, scheme).unwrap();
        let (s, [o, i], mut data, scales) = q.into_parts();
        data[1] |= 0x30;
        let err = QuantizedTensor::from_parts(s, o, i, data, scales).unwrap_err();
        assert!(err.to_string().contains("padding"), "{scheme}: {err}");
    }
}

/// Loading refuses mxfp4 scales that are not E8M0 values (powers of two in [2^-127, 2^127]), naming the
/// scale; E8M0 values pass from 2^-127 up to where a code they scale overflows f32 (row 1's largest code
/// is 6: 6 * 2^125 is finite, 6 * 2^127 is not, and is refused as such).
#[test]
fn from_parts_rejects_mxfp4_scales_that_are_not_powers_of_two() {
    let q = QuantizedTensor::quantize(&[1.0, -0.5, 0.0, 3.0], 2, 2, QuantScheme::Mxfp4).unwrap();
    let (s, [o, i], data, _) = q.into_parts();
    let parts = |scales: Vec<f32>| QuantizedTensor::from_parts(s, o, i, data.clone(), scales);
    for good in [[0.25, 0.5], [2f64.powi(-127) as f32, 2f64.powi(125) as f32]] {
        assert!(parts(good.to_vec()).is_ok(), "{good:?}");
    }
    let err = parts(vec![0.5, 2f64.powi(127) as f32])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("overflows f32") && err.contains("(6)"),
        "{err}"
    );
    for bad in [0.3f32, 0.0, 2f64.powi(-128) as f32, f32::from_bits(3 << 21)] {
        let err = parts(vec![0.5, bad]).unwrap_err().to_string();
        assert!(
            err.contains("scales[1]") && err.contains("power of two"),
            "{bad:e}: {err}"
        );
    }
    // nvfp4 scales are products of an E4M3 value and the tensor scale: any finite value >= 0 loads.
    let q = QuantizedTensor::quantize(&[1.0, -0.5, 0.0, 3.0], 2, 2, QuantScheme::Nvfp4).unwrap();
    let (s, [o, i], data, _) = q.into_parts();
    assert!(QuantizedTensor::from_parts(s, o, i, data, vec![0.3, 0.0]).is_ok());
}
