//! Random safetensors headers (10,000 cases): loading never panics, every error names the file, and the
//! messages for the common mistakes name the tensor and the problem.

mod common;

use std::path::Path;

use proptest::prelude::*;
use qarl::model::Checkpoint;

const DTYPES: [&str; 9] = ["F32", "F16", "BF16", "U8", "I64", "F64", "BOOL", "F99", ""];

/// A safetensors file from a header and a data length (the data is zeros).
fn write(path: &Path, header: &str, data_len: usize) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data_len, 0);
    std::fs::write(path, bytes).unwrap();
}

fn header(tensors: &[(String, &str, Vec<u64>, u64, u64)]) -> String {
    let entries: Vec<String> = tensors
        .iter()
        .map(|(n, d, shape, s, e)| {
            format!(r#""{n}":{{"dtype":"{d}","shape":{shape:?},"data_offsets":[{s},{e}]}}"#)
        })
        .collect();
    format!("{{{}}}", entries.join(","))
}

fn tensor() -> impl Strategy<Value = (String, &'static str, Vec<u64>, u64, u64)> {
    (
        "[a-z]{1,3}\\.weight",
        proptest::sample::select(&DTYPES[..]),
        proptest::collection::vec(0u64..6, 0..3),
        0u64..64,
        0u64..64,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_headers_never_panic_and_errors_name_the_file(
        tensors in proptest::collection::vec(tensor(), 0..4),
        consistent in any::<bool>(),
        extra in 0usize..3,
        garbage in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        let mut tensors = tensors;
        let mut end = 0;
        if consistent {
            // Offsets laid out the way a writer would, so the other fields decide.
            for t in &mut tensors {
                let bytes: u64 = t.2.iter().product::<u64>() * 4;
                (t.3, t.4) = (end, end + bytes);
                end += bytes;
            }
        }
        match &garbage {
            Some(g) => {
                let mut bytes = (g.len() as u64).to_le_bytes().to_vec();
                bytes.extend_from_slice(g);
                std::fs::write(&file, bytes).unwrap();
            }
            None => write(&file, &header(&tensors), end as usize + extra),
        }
        match Checkpoint::open(dir.path()) {
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.contains(&file.display().to_string()), "{}", msg);
                prop_assert!(!msg.contains("os error"), "{}", msg);
            }
            Ok(ckpt) => {
                for (name, _, shape, _, _) in &tensors {
                    let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
                    if let Err(e) = ckpt.read_f32(name, &shape) {
                        prop_assert!(e.to_string().contains("model.safetensors"), "{}", e);
                    }
                }
            }
        }
    }
}

fn open_err(header_text: &str, data_len: usize) -> String {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("model.safetensors"), header_text, data_len);
    match Checkpoint::open(dir.path()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{header_text} was accepted"),
    }
}

#[test]
fn header_mistakes_name_the_tensor() {
    let t = |n: &str, d: &'static str, shape: Vec<u64>, s, e| (n.to_string(), d, shape, s, e);
    // The dtype does not match the bytes (U8 where F32 was written).
    let err = open_err(
        &header(&[
            t("a.weight", "F32", vec![2], 0, 8),
            t("b.weight", "U8", vec![2], 8, 16),
        ]),
        16,
    );
    assert!(
        err.contains("`b.weight`") && err.contains("needs 2 bytes"),
        "{err}"
    );
    // A gap between tensors.
    let err = open_err(
        &header(&[
            t("a.weight", "F32", vec![2], 0, 8),
            t("b.weight", "F32", vec![1], 12, 16),
        ]),
        16,
    );
    assert!(
        err.contains("`b.weight`") && err.contains("do not start"),
        "{err}"
    );
    // One name twice (a JSON reader keeps one of the two entries): named as such, not as a gap.
    let err = open_err(
        &header(&[
            t("a.weight", "F32", vec![2], 0, 8),
            t("a.weight", "F32", vec![2], 8, 16),
        ]),
        16,
    );
    assert!(
        err.contains("tensor `a.weight` is listed twice in the header"),
        "{err}"
    );
    // An unknown dtype.
    let err = open_err(&header(&[t("a.weight", "F99", vec![2], 0, 8)]), 8);
    assert!(
        err.contains("`a.weight`") && err.contains("unknown dtype `F99`"),
        "{err}"
    );
    // More data than the header covers.
    let err = open_err(&header(&[t("a.weight", "F32", vec![2], 0, 8)]), 12);
    assert!(
        err.contains("cover 8 bytes") && err.contains("holds 12"),
        "{err}"
    );
}

#[test]
fn a_shard_index_pointing_at_the_wrong_shard_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let t = |n: &str| (n.to_string(), "F32", vec![1u64], 0u64, 4u64);
    write(
        &dir.path().join("s1.safetensors"),
        &header(&[t("a.weight")]),
        4,
    );
    write(
        &dir.path().join("s2.safetensors"),
        &header(&[t("b.weight")]),
        4,
    );
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"weight_map": {"a.weight": "s2.safetensors", "b.weight": "s2.safetensors"}}"#,
    )
    .unwrap();
    let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
    assert!(
        err.contains("s2.safetensors") && err.contains("`a.weight`") && err.contains("not in it"),
        "{err}"
    );
    assert!(!err.contains("expected shape"), "{err}");
}

#[test]
fn corrupt_scales_name_the_scales_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = header(&[("l.scales".to_string(), "F32", vec![2], 0, 8)]);
    bytes.push(' ');
    let mut file = (bytes.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(bytes.as_bytes());
    file.extend_from_slice(&1.0f32.to_le_bytes());
    file.extend_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(dir.path().join("model.safetensors"), file).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = ckpt.read_f32("l.scales", &[2]).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors")
            && err.contains("`l.scales`")
            && err.contains("scale 1 is NaN"),
        "{err}"
    );
}

/// A real quantized checkpoint with one NaN scale: the error names the `*.scales` tensor and its file, not
/// an invented path to the layer's `qweight`.
#[test]
fn a_nan_scale_in_a_quantized_checkpoint_names_its_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen3");
    let dst = tmp.path().join("q");
    let cfg = qarl::quant::QuantConfig::new("int8-pc".parse().unwrap());
    qarl::model::quantize_checkpoint(&src, &dst, &cfg).unwrap();
    let file = dst.join("model.safetensors");
    let mut tensors = common::read_tensors(&file);
    let name = tensors
        .keys()
        .find(|n| n.ends_with(".scales"))
        .unwrap()
        .clone();
    let (_, _, bytes) = tensors.get_mut(&name).unwrap();
    bytes[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
    common::write_tensors(&file, &tensors);
    let err = qarl::model::Decoder::load(&dst, &burn::tensor::Device::flex())
        .err()
        .unwrap()
        .to_string();
    println!("{err}");
    assert!(
        err.contains(&file.display().to_string())
            && err.contains(&format!("`{name}`"))
            && err.contains("scale 1 is NaN")
            && !err.contains("qweight"),
        "{err}"
    );
}

/// An int8 code the quantizer never writes (-128) is reported at the `*.qweight` tensor and its file.
#[test]
fn an_invalid_int8_code_names_its_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen3");
    let dst = tmp.path().join("q");
    let cfg = qarl::quant::QuantConfig::new("int8-pc".parse().unwrap());
    qarl::model::quantize_checkpoint(&src, &dst, &cfg).unwrap();
    let file = dst.join("model.safetensors");
    let mut tensors = common::read_tensors(&file);
    let name = tensors
        .keys()
        .find(|n| n.ends_with(".qweight"))
        .unwrap()
        .clone();
    tensors.get_mut(&name).unwrap().2[3] = 0x80;
    common::write_tensors(&file, &tensors);
    let err = qarl::model::Decoder::load(&dst, &burn::tensor::Device::flex())
        .err()
        .unwrap()
        .to_string();
    println!("{err}");
    assert!(
        err.contains(&file.display().to_string()) && err.contains(&format!("`{name}`")),
        "{err}"
    );
}

/// A Git LFS pointer where the weights should be (a clone without git-lfs) is named as such, not as an
/// impossible header length.
#[test]
fn a_git_lfs_pointer_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 538090376\n",
    )
    .unwrap();
    let err = match Checkpoint::open(dir.path()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a pointer file was accepted"),
    };
    assert!(
        err.contains("model.safetensors") && err.contains("Git LFS pointer"),
        "{err}"
    );
}
