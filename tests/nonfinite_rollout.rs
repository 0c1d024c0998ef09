//! A model whose forward yields NaN logits (here: a NaN in the final norm's weight) is an error that names
//! where the non-finite distribution first appeared, not NaN log-probs or garbage tokens with exit 0.

use std::path::Path;
use std::process::Command;

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

/// The qwen3 fixture with every value of `model.norm.weight` set to NaN, in `dir`.
fn nan_model(dir: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen3");
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    let norm = owned
        .iter_mut()
        .find(|t| t.0 == "model.norm.weight")
        .expect("the fixture has a final norm");
    assert_eq!(norm.1, safetensors::Dtype::F32);
    norm.3 = norm
        .3
        .chunks(4)
        .flat_map(|_| f32::NAN.to_le_bytes())
        .collect();
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn nan_logits_fail_generate_naming_the_token_and_row() {
    let tmp = tempfile::tempdir().unwrap();
    nan_model(tmp.path());
    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, r#"{"input_ids": [[1, 2, 3], [4, 5, 6]]}"#).unwrap();
    let out_file = tmp.path().join("gen.json");
    let out = Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(["generate", "--model"])
        .arg(tmp.path())
        .arg("--prompt-ids")
        .arg(&ids)
        .args(["--samples", "2", "--max-new-tokens", "4", "--output"])
        .arg(&out_file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("not finite") && err.contains("generated token 0 of row 0"),
        "{err}"
    );
    assert!(!out_file.exists());
}
