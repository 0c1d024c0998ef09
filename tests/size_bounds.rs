//! Sizes a user gives are checked against the model's position limit and the machine's memory before
//! anything large is allocated: the error names the flags and the limit (these used to abort on allocation).

use std::path::Path;
use std::process::Command;

fn qarl(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(args)
        .output()
        .expect("run qarl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn rollout_sizes_past_the_positions_or_the_memory_are_refused() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
    let model = model.to_str().unwrap();
    let (ok, err) = qarl(&[
        "bench",
        "rollout",
        "--model",
        model,
        "--prompt-len",
        "100000000",
    ]);
    assert!(!ok);
    assert!(
        err.contains("--prompt-len") && err.contains("max_position_embeddings"),
        "{err}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, r#"{"input_ids": [[1, 2, 3]]}"#).unwrap();
    let out = tmp.path().join("gen.json");
    let (ok, err) = qarl(&[
        "generate",
        "--model",
        model,
        "--prompt-ids",
        ids.to_str().unwrap(),
        "--samples",
        "100000000",
        "--max-new-tokens",
        "4",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        err.contains("--samples") && err.contains("KV cache") && err.contains("GB"),
        "{err}"
    );
    assert!(!out.exists());
    let (ok, err) = qarl(&[
        "generate",
        "--model",
        model,
        "--prompt-ids",
        ids.to_str().unwrap(),
        "--max-new-tokens",
        "100000",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("max_position_embeddings"), "{err}");
}
