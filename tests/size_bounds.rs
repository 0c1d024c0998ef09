//! Sizes a user gives are checked against the model's position limit and the machine's memory before
//! anything large is allocated: the error names the flags and the limit (these used to abort on allocation).

mod common;

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

/// `qarl eval` and `qarl mismatch` check their token budget and rows against the model before decoding, and
/// `qarl train` checks `eval.max_new_tokens` and `rollout.max_new_tokens` the same way, naming the keys, and
/// `qarl sft` its batch size.
#[test]
fn eval_mismatch_and_train_budgets_are_checked_against_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::arith_model(&model, 7, 0.02);
    let data = tmp.path().join("problems.jsonl");
    std::fs::write(&data, "{\"question\": \"1+2?\", \"answer\": \"#### 3\"}\n").unwrap();
    let (model, data) = (model.to_str().unwrap(), data.to_str().unwrap());
    let (ok, err) = qarl(&[
        "eval",
        "--model",
        model,
        "--data",
        data,
        "--template",
        "plain",
        "--max-new-tokens",
        "100000",
    ]);
    assert!(!ok);
    assert!(
        err.contains(": --max-new-tokens: ")
            && !err.contains("--batch")
            && err.contains("100000 new tokens")
            && err.contains("max_position_embeddings (256)"),
        "{err}"
    );
    let (ok, err) = qarl(&[
        "mismatch",
        "--model",
        model,
        "--data",
        data,
        "--template",
        "plain",
        "--samples",
        "100000000",
        "--max-new-tokens",
        "8",
    ]);
    assert!(!ok);
    assert!(
        err.contains("--limit / --samples / --max-new-tokens") && err.contains("KV cache"),
        "{err}"
    );
    let toml = tmp.path().join("run.toml");
    std::fs::write(&toml, common::tiny_train_toml(tmp.path(), "aligned", 1)).unwrap();
    for (set, want) in [
        ("eval.max_new_tokens=100000", "eval.max_new_tokens: "),
        ("rollout.max_new_tokens=100000", "rollout.max_new_tokens: "),
    ] {
        let (ok, err) = qarl(&[
            "train",
            "--quiet",
            "--config",
            toml.to_str().unwrap(),
            "--set",
            set,
        ]);
        assert!(!ok, "{set}");
        assert!(
            err.contains(want) && err.contains("max_position_embeddings (256)"),
            "{set}: {err}"
        );
    }
    // The warm start's batch, before its first batch is built.
    let sft_dir = tmp.path().join("sft");
    std::fs::create_dir_all(&sft_dir).unwrap();
    let toml = sft_dir.join("run.toml");
    std::fs::write(&toml, common::tiny_train_toml(&sft_dir, "aligned", 1)).unwrap();
    let (ok, err) = qarl(&[
        "sft",
        "--quiet",
        "--config",
        toml.to_str().unwrap(),
        "--set",
        "sft.batch_size=1000000000000",
    ]);
    assert!(!ok);
    assert!(
        err.contains("sft.batch_size: 1000000000000 sequences")
            && err.contains("GB of memory available"),
        "{err}"
    );
    assert!(!sft_dir.join("model").exists());
}
