//! Non-finite values in any command are an error that names where they first appeared, not NaN log-probs,
//! `null` scores, a "k3 KL NaN" table or garbage tokens with exit 0: a model whose forward yields NaN logits
//! (a NaN in the final norm's weight) under `generate`, `score`, `eval`, `mismatch`, `bench rollout` and
//! `train`, and a warm start whose losses are NaN from the first step under `sft`.

mod common;

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

/// A random tiny Qwen3-MoE with the arithmetic task's character tokenizer in `dir`, its final norm's weight
/// all NaN when `nan` is set.
fn arith_model(dir: &Path, nan: bool) {
    common::arith_model(dir, 7, 0.02);
    if nan {
        let file = dir.join("model.safetensors");
        let mut tensors = common::read_tensors(&file);
        let norm = tensors
            .get_mut("model.norm.weight")
            .expect("the model has a final norm");
        assert_eq!(norm.0, safetensors::Dtype::F32);
        norm.2 = norm
            .2
            .chunks(4)
            .flat_map(|_| f32::NAN.to_le_bytes())
            .collect();
        common::write_tensors(&file, &tensors);
    }
}

/// Two GSM8K-format problems in `dir/problems.jsonl`.
fn problems(dir: &Path) -> std::path::PathBuf {
    let data = dir.join("problems.jsonl");
    std::fs::write(
        &data,
        "{\"question\": \"1+2?\", \"answer\": \"#### 3\"}\n{\"question\": \"4+4?\", \"answer\": \"#### 8\"}\n",
    )
    .unwrap();
    data
}

/// Runs qarl; returns (exit code, stdout, stderr).
fn qarl(dir: &Path, args: &[&std::ffi::OsStr]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn os<'a>(args: &'a [&'a str]) -> Vec<&'a std::ffi::OsStr> {
    args.iter().map(std::ffi::OsStr::new).collect()
}

#[test]
fn nan_logits_fail_score_naming_the_row_and_position() {
    let tmp = tempfile::tempdir().unwrap();
    nan_model(tmp.path());
    std::fs::write(tmp.path().join("ids.json"), r#"{"input_ids": [[1, 2, 3]]}"#).unwrap();
    for extra in [&[][..], &["--no-logits"][..]] {
        let mut args = vec![
            "score", "--model", ".", "--input", "ids.json", "--output", "s.json",
        ];
        args.extend_from_slice(extra);
        let (code, _, err) = qarl(tmp.path(), &os(&args));
        assert_eq!(code, Some(1), "{extra:?}: {err}");
        assert!(
            err.contains("of row 0 of ids.json are not finite") && err.contains("position 0"),
            "{extra:?}: {err}"
        );
        assert!(!tmp.path().join("s.json").exists());
    }
}

/// `qarl bench rollout` does not time a model whose rollout stops at a NaN (its rows would be cut short).
#[test]
fn nan_logits_fail_bench_rollout() {
    let tmp = tempfile::tempdir().unwrap();
    nan_model(tmp.path());
    let (code, stdout, err) = qarl(
        tmp.path(),
        &os(&[
            "bench",
            "rollout",
            "--model",
            ".",
            "--schemes",
            "f32",
            "--batch",
            "2",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
            "--repeats",
            "1",
        ]),
    );
    assert_eq!(code, Some(1), "{stdout}{err}");
    assert!(
        err.contains("f32 rollout: ") && err.contains("not finite") && err.contains("of row 0"),
        "{err}"
    );
    assert!(!stdout.contains("tokens/s"), "{stdout}");
}

#[test]
fn nan_logits_fail_eval_and_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    arith_model(&model, true);
    problems(tmp.path());
    let (code, stdout, err) = qarl(tmp.path(), &os(&eval_args("model", "eval.json")));
    assert_eq!(code, Some(1), "{stdout}{err}");
    assert!(
        err.contains("model: ")
            && err.contains("not finite")
            && err.contains("generated token 0 of row 0"),
        "{err}"
    );
    assert!(!stdout.contains("accuracy"), "{stdout}");
    assert!(!tmp.path().join("eval.json").exists());

    let (code, stdout, err) = qarl(
        tmp.path(),
        &os(&[
            "mismatch",
            "--model",
            "model",
            "--data",
            "problems.jsonl",
            "--template",
            "plain",
            "--max-new-tokens",
            "4",
            "--schemes",
            "int4-g32",
            "--output",
            "mismatch.json",
        ]),
    );
    assert_eq!(code, Some(1), "{stdout}{err}");
    assert!(
        err.contains("rollout f32: ")
            && err.contains("not finite")
            && err.contains("generated token 0 of row 0"),
        "{err}"
    );
    assert!(!stdout.contains("NaN"), "{stdout}");
    assert!(!tmp.path().join("mismatch.json").exists());
}

/// `qarl train` from a model whose forward is NaN stops at its first rollout, naming it, and logs no NaN rows.
#[test]
fn nan_logits_fail_train() {
    let tmp = tempfile::tempdir().unwrap();
    arith_model(&tmp.path().join("model"), true);
    std::fs::write(
        tmp.path().join("run.toml"),
        common::tiny_train_toml(tmp.path(), "aligned", 2),
    )
    .unwrap();
    let (code, stdout, err) = qarl(
        tmp.path(),
        &os(&["train", "--quiet", "--config", "run.toml"]),
    );
    assert_eq!(code, Some(1), "{stdout}{err}");
    assert!(
        err.contains("not finite") && err.contains("generated token 0 of row 0"),
        "{err}"
    );
    assert!(
        err.contains("RL step 0") || err.contains("evaluation in int4-g32"),
        "{err}"
    );
    let metrics = tmp.path().join("run/metrics.jsonl");
    if let Ok(text) = std::fs::read_to_string(metrics) {
        assert!(!text.contains("null") && !text.contains("NaN"), "{text}");
    }
}

/// `qarl sft` whose losses are NaN from the first step (weights of order 1e30 overflow the forward) stops,
/// naming the steps and the config keys to look at, and moves no model into place.
#[test]
fn nan_losses_stop_sft_naming_the_steps() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("run.toml"),
        common::tiny_train_toml(tmp.path(), "aligned", 1),
    )
    .unwrap();
    let (code, stdout, err) = qarl(
        tmp.path(),
        &os(&[
            "sft",
            "--quiet",
            "--config",
            "run.toml",
            "--set",
            "model.init_std=1e30",
            "--set",
            "train.max_nonfinite_steps=2",
        ]),
    );
    assert_eq!(code, Some(1), "{stdout}{err}");
    assert!(
        err.contains(
            "stopping SFT: 2 consecutive steps, from step 0 to step 1, had a NaN or infinite loss"
        ) && err.contains("model.init_std"),
        "{err}"
    );
    assert!(
        !tmp.path().join("model").exists(),
        "a NaN model was moved into place"
    );
}

/// `qarl eval` of `model` on `problems.jsonl` (plain template, 4 new tokens, quiet), writing `out`.
fn eval_args<'a>(model: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "eval",
        "--model",
        model,
        "--data",
        "problems.jsonl",
        "--template",
        "plain",
        "--max-new-tokens",
        "4",
        "--quiet",
        "--output",
        out,
    ]
}

/// `qarl eval` on a checkpoint `qarl quantize` wrote records the checkpoint's scheme as its precision
/// (it said f32, so `qarl compare --precision int4-g32` refused it and `--precision f32` took it), and
/// the activations' type beside it.
#[test]
fn eval_of_a_quantized_checkpoint_names_its_scheme() {
    let tmp = tempfile::tempdir().unwrap();
    arith_model(&tmp.path().join("model"), false);
    problems(tmp.path());
    let (code, _, err) = qarl(
        tmp.path(),
        &os(&[
            "quantize", "--model", "model", "--scheme", "int4-g32", "--output", "model-q",
        ]),
    );
    assert_eq!(code, Some(0), "{err}");
    // The tokenizer travels with the weights.
    assert!(tmp.path().join("model-q/tokenizer.json").exists());
    // `qarl eval` of the quantized model with `extra` arguments, writing `out`: its JSON.
    let eval = |extra: &[&str], out: &str| -> serde_json::Value {
        let args = [&eval_args("model-q", out)[..], extra].concat();
        let (code, stdout, err) = qarl(tmp.path(), &os(&args));
        assert_eq!(code, Some(0), "{stdout}{err}");
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join(out)).unwrap()).unwrap()
    };
    let doc = eval(&[], "eval.json");
    let summary = &doc["summary"];
    assert_eq!(summary["precision"], "int4-g32", "{doc}");
    assert_eq!(summary["activations"], "f32", "{doc}");
    // And where its responses stopped besides the end tokens: the template's stop string by default,
    // nothing with `--stop end-tokens` (a training run's default), so `qarl compare` can tell them apart.
    assert_eq!(
        summary["stop_strings"],
        serde_json::json!(["\nQuestion:"]),
        "{doc}"
    );
    let doc = eval(&["--stop", "end-tokens"], "eval-end.json");
    assert_eq!(
        doc["summary"]["stop_strings"],
        serde_json::json!([]),
        "{doc}"
    );
    let (code, _, err) = qarl(
        tmp.path(),
        &os(&["compare", "--a", "eval.json", "--b", "eval-end.json"]),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("besides the end tokens"), "{err}");
}
