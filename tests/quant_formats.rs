//! The host-side quantization formats (docs/formats.md) against the committed Python reference
//! (`tests/fixtures/quant/make_quant_reference.py`), bit for bit, plus property tests of packing, the
//! reference matmuls, edge values, and the errors user input can cause.

use std::path::PathBuf;

use proptest::prelude::*;
use qarl::quant::e4m3::{e4m3_is_nan, E4M3_MAX, E4M3_NAN};
use qarl::quant::packing::{
    int4_bytes_to_words, int4_row_bytes, int4_row_words, int4_words_to_bytes, pack_int4,
    unpack_int4,
};
use qarl::quant::{
    e4m3_to_f32, f32_to_e4m3, Fp8Activations, QuantError, QuantScheme, QuantizedTensor,
};
use safetensors::{Dtype, SafeTensors};

// ------------------------------------------------------------------------------------------ fixture
fn fixture_bytes() -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quant/quant_reference.safetensors");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

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

    fn has(&self, name: &str) -> bool {
        self.0.tensor(name).is_ok()
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

    fn u32s(&self, name: &str) -> Vec<u32> {
        let (_, data) = self.raw(name, Dtype::U32);
        data.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn u8s(&self, name: &str) -> (Vec<usize>, Vec<u8>) {
        self.raw(name, Dtype::U8)
    }

    fn i8s(&self, name: &str) -> Vec<i8> {
        self.raw(name, Dtype::I8)
            .1
            .into_iter()
            .map(|b| b as i8)
            .collect()
    }

    fn list(&self, key: &str) -> Vec<String> {
        let text = self
            .1
            .get(key)
            .unwrap_or_else(|| panic!("fixture metadata lacks `{key}`"));
        text.split(',').map(str::to_owned).collect()
    }
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

// --------------------------------------------------------------------------------------------- E4M3
#[test]
fn e4m3_decode_of_all_256_codes_matches_python() {
    let bytes = fixture_bytes();
    let fixture = Fixture::open(&bytes);
    let (_, python) = fixture.f32s("e4m3/decode_values");
    let ours: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    assert_same_bits("decode", &ours, &python);
    for code in 0..=255u8 {
        assert_eq!(
            ours[code as usize].is_nan(),
            e4m3_is_nan(code),
            "code {code:#04x}"
        );
    }
    assert_eq!(e4m3_to_f32(0x7E), E4M3_MAX);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
}

#[test]
fn e4m3_encode_sweep_matches_python_and_torch() {
    let bytes = fixture_bytes();
    let fixture = Fixture::open(&bytes);
    let (_, inputs) = fixture.f32s("e4m3/encode_inputs");
    let (_, codes) = fixture.u8s("e4m3/encode_codes");
    assert!(inputs.len() > 10_000);
    for (v, &expected) in inputs.iter().zip(&codes) {
        assert_eq!(f32_to_e4m3(*v), expected, "encode({v:e})");
    }
}

/// Slow, obviously-right encoder: nearest of the 127 non-negative values, ties to the even code.
fn e4m3_encode_by_search(value: f32) -> u8 {
    if value.is_nan() {
        return E4M3_NAN;
    }
    let sign = if value.is_sign_negative() { 0x80 } else { 0 };
    let a = (value.abs() as f64).min(448.0);
    let mut best = 0u8;
    for code in 1..=126u8 {
        let (d_best, d) = (
            (a - e4m3_to_f32(best) as f64).abs(),
            (a - e4m3_to_f32(code) as f64).abs(),
        );
        if d < d_best || (d == d_best && code % 2 == 0) {
            best = code;
        }
    }
    sign | best
}

#[test]
fn e4m3_encode_matches_a_search_over_the_grid_on_a_dense_sweep() {
    // Every 4099th f32 bit pattern up to 2^10 (covers f32 subnormals, every E4M3 binade, saturation).
    let mut bits = 0u32;
    while bits <= 0x4480_0000 {
        let v = f32::from_bits(bits);
        assert_eq!(f32_to_e4m3(v), e4m3_encode_by_search(v), "encode({v:e})");
        assert_eq!(
            f32_to_e4m3(-v),
            e4m3_encode_by_search(-v),
            "encode({:e})",
            -v
        );
        bits += 4099;
    }
    // Every midpoint between neighbours and the f32 values either side of it.
    for code in 0..126u8 {
        let mid = (e4m3_to_f32(code) + e4m3_to_f32(code + 1)) / 2.0;
        for v in [
            mid,
            f32::from_bits(mid.to_bits() + 1),
            f32::from_bits(mid.to_bits().saturating_sub(1)),
        ] {
            assert_eq!(f32_to_e4m3(v), e4m3_encode_by_search(v), "encode({v:e})");
            assert_eq!(
                f32_to_e4m3(-v),
                e4m3_encode_by_search(-v),
                "encode({:e})",
                -v
            );
        }
        let tie_pick = if code % 2 == 0 { code } else { code + 1 };
        assert_eq!(
            f32_to_e4m3(mid),
            tie_pick,
            "tie between {code:#04x} and the next"
        );
    }
    // Every finite code round-trips.
    for code in (0..=255u8).filter(|&c| !e4m3_is_nan(c)) {
        assert_eq!(f32_to_e4m3(e4m3_to_f32(code)), code);
    }
}

#[test]
fn e4m3_special_values() {
    assert_eq!(f32_to_e4m3(f32::NAN), E4M3_NAN);
    assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E);
    assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
    assert_eq!(f32_to_e4m3(f32::MAX), 0x7E);
    assert_eq!(f32_to_e4m3(463.9), 0x7E);
    assert_eq!(
        f32_to_e4m3(464.0),
        0x7E,
        "the tie with the missing 480 saturates"
    );
    assert_eq!(f32_to_e4m3(1e9), 0x7E);
    assert_eq!(f32_to_e4m3(-1e9), 0xFE);
    assert_eq!(f32_to_e4m3(0.0), 0x00);
    assert_eq!(f32_to_e4m3(-0.0), 0x80);
    assert_eq!(
        f32_to_e4m3(-1e-9),
        0x80,
        "the sign of a value rounding to zero is kept"
    );
    assert_eq!(
        f32_to_e4m3(2f32.powi(-10)),
        0x00,
        "half the smallest subnormal ties to 0"
    );
    assert_eq!(
        f32_to_e4m3(3.0 * 2f32.powi(-10)),
        0x02,
        "1.5 subnormal steps ties to the even 2"
    );
    assert_eq!(f32_to_e4m3(2f32.powi(-6)), 0x08, "the smallest normal");
    assert_eq!(
        f32_to_e4m3(15.0 * 2f32.powi(-10)),
        0x08,
        "7.5 subnormal steps round up into the normals"
    );
    assert_eq!(f32_to_e4m3(1.0625), 0x38, "1 + 1/16 ties to 1.0");
    assert_eq!(f32_to_e4m3(1.1875), 0x3A, "1 + 3/16 ties to 1.25");
    assert_eq!(f32_to_e4m3(1.0), 0x38);
    assert_eq!(f32_to_e4m3(f32::from_bits(1)), 0x00, "an f32 subnormal");
}

// ------------------------------------------------------------------------------- schemes vs python
#[test]
fn every_scheme_matches_the_python_reference_bit_exactly() {
    let bytes = fixture_bytes();
    let fixture = Fixture::open(&bytes);
    let schemes = fixture.list("schemes");
    let cases = fixture.list("cases");
    // The fp4 schemes have their own reference (tests/quant_fp4.rs); this one covers every other scheme.
    let fp4 = [QuantScheme::Nvfp4, QuantScheme::Mxfp4];
    assert_eq!(schemes.len(), QuantScheme::ALL.len() - fp4.len());
    assert!(schemes.iter().all(|s| !fp4.iter().any(|f| f.name() == s)));
    assert!(cases.len() >= 5);
    for case in &cases {
        let (w_shape, weights) = fixture.f32s(&format!("case/{case}/weight"));
        let (x_shape, x) = fixture.f32s(&format!("case/{case}/x"));
        let (out, inn, m) = (w_shape[0], w_shape[1], x_shape[0]);
        for name in &schemes {
            let scheme: QuantScheme = name.parse().unwrap();
            let at = |key: &str| format!("{name}/{case}/{key}");
            let q = QuantizedTensor::quantize(&weights, out, inn, scheme).unwrap();

            let (data_shape, data) = fixture.u8s(&at("data"));
            assert_eq!(
                data_shape,
                vec![out, scheme.row_bytes(inn)],
                "{}",
                at("data")
            );
            assert_eq!(q.data(), &data[..], "{}", at("data"));
            let (scale_shape, scales) = fixture.f32s(&at("scales"));
            assert_eq!(q.scale_shape(), scale_shape, "{}", at("scales"));
            assert_same_bits(&at("scales"), q.scales(), &scales);

            if scheme.int4_group().is_some() {
                assert_eq!(
                    q.int4_words().unwrap(),
                    fixture.u32s(&at("words")),
                    "{}",
                    at("words")
                );
            }
            if fixture.has(&at("codes")) {
                assert_eq!(
                    q.int_codes().unwrap(),
                    fixture.i8s(&at("codes")),
                    "{}",
                    at("codes")
                );
            }
            if fixture.has(&at("dequant")) {
                assert_same_bits(
                    &at("dequant"),
                    &q.dequantize(),
                    &fixture.f32s(&at("dequant")).1,
                );
            }
            if scheme.quantizes_activations() {
                let a = Fp8Activations::quantize(&x, m, inn).unwrap();
                assert_eq!(
                    a.codes(),
                    &fixture.u8s(&at("x_codes")).1[..],
                    "{}",
                    at("x_codes")
                );
                assert_same_bits(
                    &at("x_scales"),
                    a.scales(),
                    &fixture.f32s(&at("x_scales")).1,
                );
            }
            let y = q.matmul_reference(&x, m).unwrap();
            assert_same_bits(&at("matmul"), &y, &fixture.f32s(&at("matmul")).1);
            assert_same_bits(&at("matmul, host path"), &q.matmul(&x, m).unwrap(), &y);

            // The stored parts rebuild the same tensor.
            let rebuilt = QuantizedTensor::from_parts(scheme, out, inn, data, scales).unwrap();
            assert_eq!(rebuilt.data(), q.data());
            assert_same_bits("rebuilt scales", rebuilt.scales(), q.scales());
        }
    }
}

#[test]
fn fixture_covers_the_awkward_cases() {
    let bytes = fixture_bytes();
    let fixture = Fixture::open(&bytes);
    // A short last group for G = 128 and fp8, an odd row, fp8 edge blocks in both dims.
    assert_eq!(fixture.f32s("case/smollm_576/weight").0, vec![6, 576]);
    assert_eq!(fixture.f32s("case/odd_77/weight").0, vec![3, 77]);
    assert_eq!(fixture.f32s("case/edges_130x136/weight").0, vec![130, 136]);
    // Round-half-even is exercised: the int4 tie row decodes k + 0.5 to even codes.
    let codes = fixture.i8s("int4-g32/ties_256/codes");
    let (_, weights) = fixture.f32s("case/ties_256/weight");
    assert_eq!(weights[1], -5.5);
    assert_eq!(codes[1], -6);
    assert_eq!(weights[2], -4.5);
    assert_eq!(codes[2], -4);
    // Saturation is exercised: a subnormal scale pushes w / s past the grid.
    let q = QuantizedTensor::quantize(
        &fixture.f32s("case/saturate_40/weight").1,
        3,
        40,
        QuantScheme::Int4G32,
    )
    .unwrap();
    assert!(q.int_codes().unwrap().iter().any(|&c| c == 7 || c == -8));
}

// --------------------------------------------------------------------------------------- properties
fn naive_matmul(x: &[f32], w: &[f32], m: usize, out: usize, inn: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * out];
    for i in 0..m {
        for o in 0..out {
            let mut acc = 0.0f32;
            for k in 0..inn {
                acc += x[i * inn + k] * w[o * inn + k];
            }
            y[i * out + o] = acc;
        }
    }
    y
}

fn any_scheme() -> impl Strategy<Value = QuantScheme> {
    prop::sample::select(QuantScheme::ALL.to_vec())
}

/// Weights of a random shape: normal values with, at random, a zero row, a huge outlier, subnormals.
fn weights_strategy() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (1usize..140, 1usize..300).prop_flat_map(|(out, inn)| {
        let value = prop_oneof![
            8 => -4.0f32..4.0,
            1 => Just(0.0f32),
            1 => -1e-39f32..1e-39,
            1 => prop::sample::select(vec![1e6f32, -3e30, 0.5, -2.5, 448.0, -0.0]),
        ];
        (
            Just(out),
            Just(inn),
            prop::collection::vec(value, out * inn),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn int4_pack_unpack_round_trips(out in 0usize..9, inn in 0usize..70, seed in any::<u64>()) {
        let mut state = seed;
        let codes: Vec<i8> = (0..out * inn)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 60) as i8) - 8
            })
            .collect();
        let bytes = pack_int4(&codes, out, inn).unwrap();
        prop_assert_eq!(bytes.len(), out * int4_row_bytes(inn));
        prop_assert_eq!(&unpack_int4(&bytes, out, inn).unwrap(), &codes);
        let words = int4_bytes_to_words(&bytes, out, inn).unwrap();
        prop_assert_eq!(words.len(), out * int4_row_words(inn));
        for row in 0..out {
            for col in 0..inn {
                let nibble = (words[row * int4_row_words(inn) + col / 8] >> (4 * (col % 8))) & 0xF;
                prop_assert_eq!(nibble as u8, (codes[row * inn + col] as u8) & 0xF);
                let byte = bytes[row * int4_row_bytes(inn) + col / 2];
                prop_assert_eq!((byte >> (4 * (col % 2))) & 0xF, (codes[row * inn + col] as u8) & 0xF);
            }
        }
        prop_assert_eq!(int4_words_to_bytes(&words, out, inn).unwrap(), bytes.clone());
        if inn % 8 == 0 {
            let le: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            prop_assert_eq!(le, bytes, "with whole words per row, the word view is the bytes read as LE u32");
        }
    }

    #[test]
    fn reference_matmuls_equal_dequantize_then_naive_matmul(
        (out, inn, weights) in weights_strategy(),
        scheme in any_scheme(),
        m in 1usize..4,
        x_seed in any::<u32>(),
    ) {
        let x: Vec<f32> = (0..m * inn).map(|i| ((i as u32 ^ x_seed) % 1000) as f32 / 250.0 - 2.0).collect();
        let q = QuantizedTensor::quantize(&weights, out, inn, scheme).unwrap();
        let dequant = q.dequantize();
        let y = q.weight_only_matmul_reference(&x, m).unwrap();
        let expected = naive_matmul(&x, &dequant, m, out, inn);
        prop_assert!(y.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
        let y = q.matmul_reference(&x, m).unwrap();
        let x_used = if scheme.quantizes_activations() {
            Fp8Activations::quantize(&x, m, inn).unwrap().dequantize()
        } else {
            x.clone()
        };
        let expected = naive_matmul(&x_used, &dequant, m, out, inn);
        prop_assert!(y.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
        let fast = q.matmul(&x, m).unwrap();
        prop_assert!(fast.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
        let mut into = vec![1.0f32; out * inn];
        q.dequantize_into(&mut into).unwrap();
        prop_assert!(into.iter().zip(&dequant).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn codes_stay_on_the_grid_and_errors_are_bounded(
        (out, inn, weights) in weights_strategy(),
        scheme in any_scheme(),
    ) {
        let q = QuantizedTensor::quantize(&weights, out, inn, scheme).unwrap();
        let dequant = q.dequantize();
        // Rebuilding from parts validates every code and scale the quantizer produced.
        let (s, [o, i], data, scales) = q.clone().into_parts();
        prop_assert_eq!(QuantizedTensor::from_parts(s, o, i, data, scales).unwrap(), q.clone());
        let scale_of = |row: usize, col: usize| -> f32 {
            let scales = q.scales();
            match (scheme.int4_group(), scheme) {
                (Some(g), _) => scales[row * inn.div_ceil(g) + col / g],
                (None, QuantScheme::Int8PerChannel) => scales[row],
                (None, QuantScheme::Nvfp4) => scales[row * inn.div_ceil(16) + col / 16],
                (None, QuantScheme::Mxfp4) => scales[row * inn.div_ceil(32) + col / 32],
                (None, _) => scales[(row / 128) * inn.div_ceil(128) + col / 128],
            }
        };
        for row in 0..out {
            for col in 0..inn {
                let (w, d, s) = (weights[row * inn + col], dequant[row * inn + col], scale_of(row, col));
                if s < f32::MIN_POSITIVE * 1e3 {
                    continue; // a subnormal or zero scale: the grid is coarse there, codes may clamp
                }
                let err = (w - d).abs();
                if matches!(scheme, QuantScheme::Nvfp4 | QuantScheme::Mxfp4) {
                    // E2M1 steps are at most 2 below the saturation at 6; beyond it the code is +-6.
                    if w.abs() >= 6.0 * s {
                        prop_assert!(d == (6.0 * s).copysign(w), "w {w:e} d {d:e} s {s:e}");
                    } else {
                        prop_assert!(err <= s * 1.0001, "w {w:e} d {d:e} s {s:e}");
                    }
                } else if scheme.quantizes_activations() {
                    // E4M3: 3 mantissa bits, so half an ulp is at most 1/16 of |w|; subnormal step 2^-9 s.
                    let bound = (w.abs() / 16.0).max(s * 2f32.powi(-10)) * 1.001;
                    prop_assert!(err <= bound, "w {w:e} d {d:e} s {s:e}");
                } else {
                    prop_assert!(err <= s * 0.5001, "w {w:e} d {d:e} s {s:e}");
                }
            }
        }
        if let Some(codes) = q.int_codes() {
            let (lo, hi) = if scheme.int4_group().is_some() { (-8, 7) } else { (-127, 127) };
            prop_assert!(codes.iter().all(|&c| (lo..=hi).contains(&c)));
        }
    }
}

#[test]
fn zero_weights_give_zero_codes_and_scales() {
    for scheme in QuantScheme::ALL {
        let q = QuantizedTensor::quantize(&vec![0.0; 3 * 200], 3, 200, scheme).unwrap();
        assert!(q.data().iter().all(|&b| b == 0), "{scheme}");
        // An mxfp4 scale is a power of two: a zero block keeps the smallest, 2^-127.
        let zero_scale = if scheme == QuantScheme::Mxfp4 {
            2f64.powi(-127) as f32
        } else {
            0.0
        };
        assert!(q.scales().iter().all(|&s| s == zero_scale), "{scheme}");
        assert!(q.dequantize().iter().all(|&w| w == 0.0), "{scheme}");
        let x = vec![0.0; 2 * 200];
        assert!(
            q.matmul_reference(&x, 2).unwrap().iter().all(|&y| y == 0.0),
            "{scheme}"
        );
    }
}

#[test]
fn a_single_huge_outlier_takes_the_top_code_and_zeroes_its_group() {
    let mut weights = vec![0.01f32; 128];
    weights[5] = -1e30;
    for (scheme, top) in [
        (QuantScheme::Int4G32, f32::from(-7i8)),
        (QuantScheme::Int8PerChannel, -127.0),
        (QuantScheme::Fp8Block128, -448.0),
    ] {
        let q = QuantizedTensor::quantize(&weights, 1, 128, scheme).unwrap();
        let d = q.dequantize();
        assert_eq!(d[5] / q.scales()[0], top, "{scheme}");
        assert_eq!(
            d[6], 0.0,
            "{scheme}: small weights in the outlier's group vanish"
        );
    }
    let q = QuantizedTensor::quantize(&weights, 1, 128, QuantScheme::Int4G32).unwrap();
    assert_ne!(
        q.dequantize()[40],
        0.0,
        "other int4 groups keep their own scale"
    );
}

#[test]
fn empty_shapes_are_fine() {
    for scheme in QuantScheme::ALL {
        for (out, inn) in [(0, 5), (3, 0), (0, 0)] {
            let q = QuantizedTensor::quantize(&[], out, inn, scheme).unwrap();
            assert!(q.dequantize().is_empty());
            let x = vec![1.0; 2 * inn];
            assert_eq!(q.matmul_reference(&x, 2).unwrap(), vec![0.0; 2 * out]);
            assert_eq!(q.matmul(&x, 2).unwrap(), vec![0.0; 2 * out]);
            assert_eq!(q.bytes_per_weight(), 0.0);
        }
    }
}

#[test]
fn bytes_per_weight_of_each_scheme() {
    let (out, inn) = (256, 4096);
    let weights = vec![0.5f32; out * inn];
    for (scheme, expected) in [
        (QuantScheme::Int4G32, 0.5 + 4.0 / 32.0),
        (QuantScheme::Int4G64, 0.5 + 4.0 / 64.0),
        (QuantScheme::Int4G128, 0.5 + 4.0 / 128.0),
        (QuantScheme::Int8PerChannel, 1.0 + 4.0 / 4096.0),
        (QuantScheme::Fp8Block128, 1.0 + 4.0 / (128.0 * 128.0)),
        (QuantScheme::Nvfp4, 0.5 + 4.0 / 16.0),
        (QuantScheme::Mxfp4, 0.5 + 4.0 / 32.0),
    ] {
        let q = QuantizedTensor::quantize(&weights, out, inn, scheme).unwrap();
        assert_eq!(q.bytes_per_weight(), expected, "{scheme}");
        assert_eq!(
            scheme.storage_bytes(out, inn),
            q.storage_bytes(),
            "{scheme}"
        );
        let odd = QuantizedTensor::quantize(&[1.0; 3 * 131], 3, 131, scheme).unwrap();
        assert_eq!(
            scheme.storage_bytes(3, 131),
            odd.storage_bytes(),
            "{scheme}"
        );
    }
}

// -------------------------------------------------------------------------------------------- errors
#[test]
fn scheme_names_parse_display_and_serialize_exactly() {
    for scheme in QuantScheme::ALL {
        let name = scheme.to_string();
        assert_eq!(name.parse::<QuantScheme>().unwrap(), scheme);
        let json = serde_json::to_string(&scheme).unwrap();
        assert_eq!(json, format!("\"{name}\""));
        assert_eq!(serde_json::from_str::<QuantScheme>(&json).unwrap(), scheme);
    }
    for bad in ["int4-g16", "INT4-G32", "int4", "fp8", "", " int8-pc"] {
        let err = bad.parse::<QuantScheme>().unwrap_err();
        assert_eq!(
            err,
            QuantError::UnknownScheme {
                name: bad.to_owned()
            }
        );
        let message = err.to_string();
        assert!(message.contains(&format!("`{bad}`")), "{message}");
        for scheme in QuantScheme::ALL {
            assert!(message.contains(scheme.name()), "{message} lacks {scheme}");
        }
        let serde_err = serde_json::from_str::<QuantScheme>(&format!("\"{bad}\"")).unwrap_err();
        assert!(
            serde_err.to_string().contains("int4-g32, int4-g64"),
            "{serde_err}"
        );
    }
}

/// Weights at the edge of f32: every scheme either quantizes them to finite weights or refuses them
/// naming the weight and the scheme (int8-pc's `absmax / 127` of f32::MAX rounds up, and 127 times it
/// overflowed to an infinite weight that only a later load refused). Just below the edge, int8-pc takes
/// them.
#[test]
fn weights_at_f32_max_quantize_finite_or_are_refused() {
    let (out, inn) = (2, 256);
    for top in [f32::MAX, -f32::MAX, f32::MAX / 2.0] {
        let mut w: Vec<f32> = (0..out * inn).map(|i| (i % 7) as f32 - 3.0).collect();
        w[inn + 5] = top;
        for scheme in QuantScheme::ALL {
            match QuantizedTensor::quantize(&w, out, inn, scheme) {
                Ok(q) => {
                    let d = q.dequantize();
                    assert!(d.iter().all(|v| v.is_finite()), "{scheme} at {top:e}");
                }
                Err(e) => {
                    assert!(
                        matches!(e, QuantError::QuantizedOverflow { row: 1, col: 5, .. }),
                        "{scheme} at {top:e}: {e}"
                    );
                    let message = e.to_string();
                    assert!(message.contains("weights[1, 5]"), "{message}");
                    assert!(message.contains(scheme.name()), "{message}");
                }
            }
        }
        let int8 = QuantizedTensor::quantize(&w, out, inn, QuantScheme::Int8PerChannel);
        assert_eq!(int8.is_err(), top.abs() == f32::MAX, "int8-pc at {top:e}");
    }
}

#[test]
fn bad_shapes_and_values_are_errors_not_panics() {
    let s = QuantScheme::Int4G32;
    let err = QuantizedTensor::quantize(&[1.0; 11], 3, 4, s).unwrap_err();
    assert_eq!(
        err.to_string(),
        "weights: expected 12 values for shape [3, 4], got 11"
    );

    let err = QuantizedTensor::quantize(&[1.0; 4], usize::MAX, 2, s).unwrap_err();
    assert!(matches!(err, QuantError::ShapeOverflow { .. }), "{err}");

    for scheme in QuantScheme::ALL {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut w = vec![1.0f32; 12];
            w[7] = bad;
            let err = QuantizedTensor::quantize(&w, 3, 4, scheme).unwrap_err();
            assert!(
                matches!(err, QuantError::NonFinite { row: 1, col: 3, .. }),
                "{err}"
            );
            assert!(err.to_string().starts_with("weights[1, 3] is "), "{err}");
        }
    }

    let q = QuantizedTensor::quantize(&[1.0; 12], 3, 4, QuantScheme::Fp8Block128).unwrap();
    let err = q.matmul_reference(&[1.0; 7], 2).unwrap_err();
    assert_eq!(
        err.to_string(),
        "activations: expected 8 values for shape [2, 4], got 7"
    );
    assert_eq!(q.matmul(&[1.0; 7], 2).unwrap_err(), err);
    assert!(q.matmul(&[1.0, 1.0, f32::INFINITY, 1.0], 1).is_err());
    let empty = QuantizedTensor::quantize(&[], 3, 0, QuantScheme::Int8PerChannel).unwrap();
    let err = empty.matmul(&[], usize::MAX).unwrap_err();
    assert!(matches!(err, QuantError::ShapeOverflow { .. }), "{err}");
    let err = empty.matmul_reference(&[], usize::MAX).unwrap_err();
    assert!(matches!(err, QuantError::ShapeOverflow { .. }), "{err}");
    let err = q
        .matmul_reference(&[1.0, f32::NAN, 1.0, 1.0], 1)
        .unwrap_err();
    assert!(
        err.to_string().contains("activations[0, 1] is NaN"),
        "{err}"
    );
    assert!(Fp8Activations::quantize(&[1.0; 3], 2, 2).is_err());
    assert!(q.dequantize_into(&mut [0.0; 5]).is_err());

    assert!(pack_int4(&[8], 1, 1)
        .unwrap_err()
        .to_string()
        .contains("outside [-8, 7]"));
    assert!(pack_int4(&[0; 3], 1, 2).is_err());
    assert!(unpack_int4(&[0; 3], 1, 4).is_err());
    assert!(unpack_int4(&[0x10], 1, 1)
        .unwrap_err()
        .to_string()
        .contains("padding nibble"));
    assert!(int4_words_to_bytes(&[0x0000_0100], 1, 2)
        .unwrap_err()
        .to_string()
        .contains("padding"));
    assert!(int4_bytes_to_words(&[0; 2], 1, 2).is_err());
}

#[test]
fn from_parts_rejects_what_the_quantizer_never_produces() {
    use QuantScheme::*;
    let ok = |scheme, out, inn, data: Vec<u8>, scales: Vec<f32>| {
        QuantizedTensor::from_parts(scheme, out, inn, data, scales)
    };
    assert!(ok(Int4G32, 2, 3, vec![0x77, 0x08, 0x11, 0x0F], vec![1.0, 2.0]).is_ok());
    let err = ok(Int4G32, 2, 3, vec![0; 3], vec![1.0; 2]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "packed codes: expected 4 values for shape [2, 2], got 3"
    );
    let err = ok(Int4G32, 2, 3, vec![0; 4], vec![1.0; 3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "scales: expected 2 values for shape [2, 1], got 3"
    );
    assert!(
        ok(Int4G32, 2, 3, vec![0, 0x10, 0, 0], vec![1.0; 2]).is_err(),
        "padding nibble"
    );
    assert!(ok(Int4G32, 1, 2, vec![0], vec![-1.0])
        .unwrap_err()
        .to_string()
        .contains("scales[0] is -1"));
    assert!(ok(Int4G32, 1, 2, vec![0], vec![f32::NAN]).is_err());
    assert!(ok(Int8PerChannel, 1, 2, vec![0x80, 0], vec![1.0])
        .unwrap_err()
        .to_string()
        .contains("-128"));
    assert!(ok(Int8PerChannel, 1, 2, vec![0x81, 0x7F], vec![1.0]).is_ok());
    assert!(ok(Fp8Block128, 1, 2, vec![0xFF, 0], vec![1.0])
        .unwrap_err()
        .to_string()
        .contains("NaN"));
    assert!(ok(Fp8Block128, 1, 2, vec![0x7E, 0xFE], vec![1.0]).is_ok());
    assert!(
        ok(Fp8Block128, 129, 2, vec![0; 258], vec![1.0; 1]).is_err(),
        "two row blocks need two scales"
    );
}

#[test]
fn int4_word_view_of_a_tensor() {
    let q = QuantizedTensor::quantize(
        &[7.0, -7.0, 1.0, 0.0, -1.0, 2.0, 3.0, 4.0, 5.0],
        1,
        9,
        QuantScheme::Int4G32,
    )
    .unwrap();
    assert_eq!(q.int_codes().unwrap(), vec![7, -7, 1, 0, -1, 2, 3, 4, 5]);
    assert_eq!(q.data(), &[0x97, 0x01, 0x2F, 0x43, 0x05]);
    assert_eq!(q.int4_words().unwrap(), vec![0x432F_0197, 0x0000_0005]);
    assert!(
        QuantizedTensor::quantize(&[1.0], 1, 1, QuantScheme::Int8PerChannel)
            .unwrap()
            .int4_words()
            .is_none()
    );
}

/// The one-pass W8A8 activation rounding the kernels use equals quantize-then-dequantize bitwise: on blocks
/// whose scale is exactly 1 (absmax 448) holding the dense encode sweep, every rounding midpoint and the f32
/// values either side of it (both signs), and on random, all-zero, subnormal-scale and ragged blocks, on
/// both the serial (small) and parallel (large) paths.
#[test]
fn fp8_fake_quantize_equals_quantize_then_dequantize() {
    let mut probes = Vec::new();
    let mut bits = 0u32;
    while bits <= 0x4480_0000 {
        probes.push(f32::from_bits(bits));
        bits += 4099;
    }
    for code in 0..126u8 {
        let mid = (e4m3_to_f32(code) + e4m3_to_f32(code + 1)) / 2.0;
        probes.extend([
            mid,
            f32::from_bits(mid.to_bits() + 1),
            f32::from_bits(mid.to_bits() - 1),
        ]);
    }
    let negatives: Vec<f32> = probes.iter().map(|v| -v).collect();
    probes.extend(negatives);
    probes.retain(|v| v.abs() <= E4M3_MAX);
    // 127 probes and 448 per 128-block, so that s = 448 / 448 = 1 and v / s = v.
    let mut x = Vec::new();
    for chunk in probes.chunks(127) {
        x.push(E4M3_MAX);
        x.extend_from_slice(chunk);
        x.resize(x.len().next_multiple_of(128), 0.5);
    }
    let cols = 128 * 5;
    x.resize(x.len().next_multiple_of(cols), -0.25);
    let mut state = 7u64;
    let mut rand = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for scale in [1.0f32, 3e3, 1e-3, 1e-38, 1e-41, 0.0] {
        x.extend((0..cols).map(|_| rand() * scale));
    }
    let rows = x.len() / cols;
    assert!(x.len() >= 1 << 16, "large enough for the parallel path");
    let want = Fp8Activations::quantize(&x, rows, cols)
        .unwrap()
        .dequantize();
    let got = Fp8Activations::fake_quantize(&x, rows, cols).unwrap();
    assert_same_bits("fake_quantize (parallel)", &got, &want);
    // Small and ragged (cols not a multiple of 128): the serial path and short edge blocks.
    for (r, c) in [(3, 200), (1, 1), (2, 129)] {
        let x: Vec<f32> = (0..r * c).map(|_| rand() * 7.0).collect();
        let want = Fp8Activations::quantize(&x, r, c).unwrap().dequantize();
        let got = Fp8Activations::fake_quantize(&x, r, c).unwrap();
        assert_same_bits("fake_quantize (serial)", &got, &want);
    }
    // Non-finite input is the same error.
    let err = Fp8Activations::fake_quantize(&[1.0, f32::NAN], 1, 2).unwrap_err();
    assert!(err.to_string().contains("activations"), "{err}");
}

/// The inline rounding the quantizers use equals `f32::round_ties_even` bitwise on every
/// tie and its neighbours in the code ranges, a dense sweep of magnitudes up to 2^24, and infinities.
#[test]
fn inline_round_ties_even_equals_std() {
    use qarl::quant::int::round_ties_even;
    let mut values = vec![
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE,
        0.0,
        8_388_607.5,
        8_388_608.0,
    ];
    for k in -300i32..=300 {
        let tie = k as f32 + 0.5;
        values.extend([
            tie,
            f32::from_bits(tie.to_bits() + 1),
            f32::from_bits(tie.to_bits() - 1),
        ]);
    }
    let mut bits = 0u32;
    while bits <= 0x4B80_0000 {
        values.push(f32::from_bits(bits));
        bits += 1009;
    }
    for v in values {
        for v in [v, -v] {
            assert_eq!(
                round_ties_even(v).to_bits(),
                v.round_ties_even().to_bits(),
                "round({v:e})"
            );
        }
    }
}
