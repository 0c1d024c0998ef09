//! The `qarl` binary end to end: `score` and `generate` on a fixture, `--help`, and bad input.

mod common;

use std::process::Command;

use common::{fixtures_dir, max_abs_diff, reference};

fn qarl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_qarl"))
}

#[test]
fn help_for_every_command() {
    for args in [
        vec!["--help"],
        vec!["score", "--help"],
        vec!["generate", "--help"],
    ] {
        let out = qarl().args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains("Usage"), "{args:?}: {text}");
    }
}

#[test]
fn score_writes_logits_and_logprobs() {
    let dir = fixtures_dir().join("qwen3_moe");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("ids.json");
    std::fs::write(
        &input,
        serde_json::json!({ "input_ids": r.input_ids }).to_string(),
    )
    .unwrap();
    let output = tmp.path().join("out.json");
    let st = qarl()
        .args(["score", "--model"])
        .arg(&dir)
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .status()
        .unwrap();
    assert!(st.success());
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).unwrap();
    let logits: Vec<Vec<Vec<f32>>> = serde_json::from_value(v["logits"].clone()).unwrap();
    let logprobs: Vec<Vec<f32>> = serde_json::from_value(v["logprobs"].clone()).unwrap();
    let got: Vec<f32> = logits.iter().flatten().flatten().copied().collect();
    let want: Vec<f32> = r.logits.iter().flatten().flatten().copied().collect();
    assert!(max_abs_diff(&got, &want) <= 1e-4);
    // logprobs[b][t] = log_softmax(logits[b][t])[ids[b][t+1]], computed here in f64 from the reference logits.
    for (b, row) in r.logits.iter().enumerate() {
        assert_eq!(logprobs[b].len(), row.len() - 1);
        for t in 0..row.len() - 1 {
            let m = row[t].iter().fold(f64::MIN, |m, &x| m.max(x as f64));
            let lse = m + row[t]
                .iter()
                .map(|&x| (x as f64 - m).exp())
                .sum::<f64>()
                .ln();
            let want = row[t][r.input_ids[b][t + 1] as usize] as f64 - lse;
            assert!(
                (logprobs[b][t] as f64 - want).abs() < 1e-4,
                "b={b} t={t}: {} vs {want}",
                logprobs[b][t]
            );
        }
    }
}

#[test]
fn generate_greedy_matches_reference() {
    let dir = fixtures_dir().join("qwen3");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("p.json");
    std::fs::write(
        &prompts,
        serde_json::json!({ "input_ids": r.greedy.prompt_ids }).to_string(),
    )
    .unwrap();
    let output = tmp.path().join("gen.json");
    let v = common::run_qarl_json(
        qarl()
            .args(["generate", "--greedy", "--max-new-tokens"])
            .arg(r.greedy.max_new_tokens.to_string())
            .arg("--model")
            .arg(&dir)
            .arg("--prompt-ids")
            .arg(&prompts)
            .arg("--output")
            .arg(&output),
        &output,
    );
    let ids: Vec<Vec<u32>> = serde_json::from_value(v["ids"].clone()).unwrap();
    assert_eq!(ids, r.greedy.ids);
}

#[test]
fn bad_inputs_fail_cleanly_and_name_the_file() {
    let dir = fixtures_dir().join("qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("out.json");
    std::fs::write(&output, "previous result").unwrap();
    let cases = [
        (
            "oov.json",
            r#"{"input_ids": [[1, 2, 99999]]}"#,
            "outside the vocabulary",
        ),
        (
            "ragged.json",
            r#"{"input_ids": [[1, 2, 3], [1]]}"#,
            "equal lengths",
        ),
        ("empty.json", r#"{"input_ids": []}"#, "no sequences"),
        ("typo.json", r#"{"input_idz": [[1, 2]]}"#, "invalid content"),
        ("broken.json", r#"{"input_ids": [[1, 2"#, "invalid content"),
    ];
    for (name, text, want) in cases {
        let input = tmp.path().join(name);
        std::fs::write(&input, text).unwrap();
        let out = qarl()
            .args(["score", "--model"])
            .arg(&dir)
            .arg("--input")
            .arg(&input)
            .arg("--output")
            .arg(&output)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains(name) && err.contains(want),
            "{name}: expected `{want}` in {err}"
        );
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert_eq!(
            std::fs::read_to_string(&output).unwrap(),
            "previous result",
            "{name}: output clobbered"
        );
    }
    // A model directory that does not exist.
    let out = qarl()
        .args(["score", "--model", "/nonexistent/model", "--input"])
        .arg(tmp.path().join("oov.json"))
        .arg("--output")
        .arg(&output)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("/nonexistent/model/config.json"), "{err}");
}
