//! The `qarl` binary end to end: `score` and `generate` on a fixture, `--help`, and bad input.

mod common;

use std::process::Command;

use common::{
    error_of, fixtures_dir, max_abs_diff, reference, run_qarl_json, stdout_of, usage_error_of,
};

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
        let text = stdout_of(qarl().args(&args));
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

/// The reference's greedy prompts as a `--prompt-ids` file in `dir`.
fn greedy_prompts_file(dir: &std::path::Path, r: &common::Reference) -> std::path::PathBuf {
    let path = dir.join("p.json");
    std::fs::write(
        &path,
        serde_json::json!({ "input_ids": r.greedy.prompt_ids }).to_string(),
    )
    .unwrap();
    path
}

#[test]
fn generate_greedy_matches_reference() {
    let dir = fixtures_dir().join("qwen3");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let prompts = greedy_prompts_file(tmp.path(), &r);
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

/// `--activations bf16`: the flag reaches the model (the greedy continuation of this random fixture, whose
/// logits are nearly flat, changes with the rounding), the prompts are kept and a run repeats exactly; an
/// unknown type is refused by name.
#[test]
fn generate_takes_the_activations_type() {
    let dir = fixtures_dir().join("qwen3");
    let r = reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let prompts = greedy_prompts_file(tmp.path(), &r);
    let output = tmp.path().join("gen.json");
    let run = |act: &str| {
        let mut cmd = qarl();
        cmd.args(["generate", "--greedy", "--max-new-tokens", "4"])
            .args(["--activations", act])
            .arg("--model")
            .arg(&dir)
            .arg("--prompt-ids")
            .arg(&prompts)
            .arg("--output")
            .arg(&output);
        cmd
    };
    let ids = |act: &str| -> Vec<Vec<u32>> {
        let v = run_qarl_json(&mut run(act), &output);
        serde_json::from_value(v["ids"].clone()).unwrap()
    };
    let (f32_ids, bf16_ids) = (ids("f32"), ids("bf16"));
    assert_eq!(bf16_ids, ids("bf16"), "a bf16 run does not repeat");
    assert_ne!(bf16_ids, f32_ids, "--activations bf16 changed nothing");
    for (got, prompt) in bf16_ids.iter().zip(&r.greedy.prompt_ids) {
        assert_eq!(&got[..prompt.len()], &prompt[..]);
        assert_eq!(got.len(), prompt.len() + 4);
    }
    let err = usage_error_of(&mut run("fp8"));
    assert!(
        err.contains("--activations") && err.contains("bf16"),
        "{err}"
    );
}

#[test]
fn bad_inputs_fail_cleanly_and_name_the_file() {
    let dir = fixtures_dir().join("qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("out.json");
    std::fs::write(&output, "previous result").unwrap();
    let long = format!(r#"{{"input_ids": [{:?}]}}"#, vec![1u32; 600]);
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
        (
            "long.json",
            long.as_str(),
            "longer than the model's max_position_embeddings",
        ),
        (
            "typo.json",
            r#"{"input_idz": [[1, 2]]}"#,
            "expected an object {\"input_ids\"",
        ),
        (
            "broken.json",
            r#"{"input_ids": [[1, 2"#,
            "EOF while parsing",
        ),
    ];
    for (name, text, want) in cases {
        let input = tmp.path().join(name);
        std::fs::write(&input, text).unwrap();
        let err = error_of(
            qarl()
                .args(["score", "--model"])
                .arg(&dir)
                .arg("--input")
                .arg(&input)
                .arg("--output")
                .arg(&output),
        );
        assert!(
            err.contains(name) && err.contains(want),
            "{name}: expected `{want}` in {err}"
        );
        assert_eq!(
            std::fs::read_to_string(&output).unwrap(),
            "previous result",
            "{name}: output clobbered"
        );
    }
    // A model directory that does not exist.
    let err = error_of(
        qarl()
            .args(["score", "--model", "/nonexistent/model", "--input"])
            .arg(tmp.path().join("oov.json"))
            .arg("--output")
            .arg(&output),
    );
    assert!(
        err.contains("/nonexistent/model: no such folder (the model's directory"),
        "{err}"
    );
    assert!(!err.contains("os error"), "{err}");
    // A missing input file: one sentence naming it, with the OS reason once and in words.
    let err = error_of(
        qarl()
            .args(["score", "--model"])
            .arg(&dir)
            .arg("--input")
            .arg(tmp.path().join("absent.json"))
            .arg("--output")
            .arg(&output),
    );
    assert!(
        err.contains("absent.json")
            && err.matches("not found").count() == 1
            && !err.contains("expected an object"),
        "{err}"
    );
    assert!(
        !err.contains("os error") && !err.contains("No such file"),
        "{err}"
    );
}

#[test]
fn config_show_prints_the_resolved_config_and_names_bad_keys() {
    let text = stdout_of(qarl().args(["config", "show", "default", "--set", "train.lr=1e-4"]));
    let cfg = qarl::train::TrainConfig::from_toml(&text, "shown").unwrap();
    assert_eq!(cfg.train.lr, 1e-4);
    assert!(
        text.contains("keep_checkpoints"),
        "defaults are filled in: {text}"
    );
    // Also those the objective and the estimator declare (the default objective is TBPO, the estimator
    // GRPO), and the shown config resolves to the same loss as the one it came from.
    for key in [
        "seq_eps_high = 0.0004",
        "loss_agg_mode = ",
        "kl_coef = 0.0",
        "eps = 0.000001",
    ] {
        assert!(text.contains(key), "`{key}` is shown: {text}");
    }
    let default =
        qarl::train::TrainConfig::from_toml(qarl::train::config::DEFAULT_CONFIG, "default")
            .unwrap();
    assert_eq!(
        cfg.train.loss.resolve().unwrap(),
        default.train.loss.resolve().unwrap()
    );
    assert!(
        text.contains(
            "# off, so not printed: model.base, train.loss.corrections, verify.format_reward\n"
        ),
        "{text}"
    );
    let ppo = stdout_of(qarl().args(["config", "show", "--set", "train.loss.objective=ppo_clip"]));
    assert!(
        ppo.contains("# off, so not printed: model.base, train.loss.dual_clip_c, train.loss.corrections, verify.format_reward\n"),
        "{ppo}"
    );
    let err = error_of(qarl().args(["config", "show", "--set", "rollout.sample_per_prompt=4"]));
    assert!(
        err.contains("did you mean `rollout.samples_per_prompt`"),
        "{err}"
    );
    // A table given to `--set` replaces the table there (how `task` switches kind), and says which keys
    // went back to their defaults (`eval.k` was 8 in the file, 0 after, without a word).
    let show = |set: &str| {
        let out = qarl()
            .args(["config", "show", "--set", set])
            .output()
            .unwrap();
        assert!(out.status.success(), "{set}");
        (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (shown, warned) = show("eval={every=5,problems=2,max_new_tokens=4}");
    assert!(shown.contains("k = 0"), "{shown}");
    assert!(
        warned.contains("replaces `eval` as a whole") && warned.contains("k (was 8)"),
        "{warned}"
    );
    // Switching a tagged table to another kind drops the old kind's keys by design: no warning.
    let (_, warned) = show("task={kind=\"gsm8k\", path=\"x.jsonl\"}");
    assert!(!warned.contains("as a whole"), "{warned}");
    let err = error_of(qarl().args(["config", "show", "no/such.toml"]));
    assert!(err.contains("no/such.toml: no such config file"), "{err}");
    // `qarl train` names it too, without the OS's own text.
    let err = error_of(qarl().args(["train", "--config", "no/such.toml"]));
    assert!(
        err.contains("no/such.toml: cannot read (not found)")
            && !err.contains("os error")
            && !err.contains("No such file"),
        "{err}"
    );
}

#[test]
fn runs_lists_run_directories_with_their_status() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = tmp.path().join("runs");
    // A finished run and one with a checkpoint, written by hand.
    let cfg = qarl::train::load_config(None, &["train.steps=2".into()]).unwrap();
    for (name, rows) in [
        (
            "done",
            "{\"phase\":\"eval\",\"step\":0,\"eval/int4-g32/pass@1_greedy\":0.25}\n{\"phase\":\"rl\",\"step\":0}\n{\"phase\":\"rl\",\"step\":1}\n{\"phase\":\"eval\",\"step\":2,\"eval/int4-g32/pass@1_greedy\":0.5}\n",
        ),
        // The rows of a finished run, but its last checkpoint is of step 0: killed between the final
        // evaluation and the last save (possible before 2026-12-07), so the weights are not on disk.
        (
            "unsaved",
            "{\"phase\":\"eval\",\"step\":0,\"eval/int4-g32/pass@1_greedy\":0.25}\n{\"phase\":\"rl\",\"step\":0}\n{\"phase\":\"rl\",\"step\":1}\n{\"phase\":\"eval\",\"step\":2,\"eval/int4-g32/pass@1_greedy\":0.5}\n",
        ),
        ("half", "{\"phase\":\"rl\",\"step\":0}\nnot json\n"),
        // An accuracy no evaluation gives (edited, damaged): not shown as the run's, named as damage.
        (
            "badacc",
            "{\"phase\":\"rl\",\"step\":0}\n{\"phase\":\"eval\",\"step\":1,\"eval/int4-g32/pass@1_greedy\":2.5}\n",
        ),
        // Its config.json damaged: said beside the status.
        ("badcfg", "{\"phase\":\"rl\",\"step\":0}\n"),
        // A step at the top of u64 (a damaged log): shown, not an overflow.
        ("huge", "{\"phase\":\"rl\",\"step\":18446744073709551615}\n"),
        // A checkpoint whose trainer state names another step than its folder: not offered for resuming.
        ("edited", "{\"phase\":\"rl\",\"step\":0}\n"),
        // Every row of a finished run and no checkpoint at all (not kept, as committed results are).
        (
            "pruned",
            "{\"phase\":\"eval\",\"step\":0,\"eval/int4-g32/pass@1_greedy\":0.25}\n{\"phase\":\"rl\",\"step\":0}\n{\"phase\":\"rl\",\"step\":1}\n{\"phase\":\"eval\",\"step\":2,\"eval/int4-g32/pass@1_greedy\":0.5}\n",
        ),
        // A warm start stopped part-way (its checkpoint under checkpoints/sft), no RL checkpoint yet.
        ("warm", "{\"phase\":\"sft\",\"step\":9}\n"),
        // Not UTF-8: nothing in it can be read, whatever `finished.json` says.
        ("garbled", "\u{0}"),
        // Finished, but a line in the middle is no row: a report would refuse the log, so the listing
        // says so beside the status.
        (
            "damaged",
            "{\"phase\":\"rl\",\"step\":0}\nnot json\n{\"phase\":\"rl\",\"step\":1}\n",
        ),
    ] {
        let dir = runs.join(name);
        // The finished run's checkpoint is of its last step.
        let ckpt = if name == "done" {
            "checkpoints/step_000001"
        } else {
            "checkpoints/step_000000"
        };
        std::fs::create_dir_all(dir.join(ckpt)).unwrap();
        if name == "garbled" {
            std::fs::write(dir.join("metrics.jsonl"), [0xff, 0xfe, b'\n']).unwrap();
            std::fs::write(dir.join("finished.json"), "{}").unwrap();
        } else if name == "damaged" {
            std::fs::write(dir.join("metrics.jsonl"), rows).unwrap();
            std::fs::write(dir.join("finished.json"), "{}").unwrap();
        } else {
            std::fs::write(dir.join("metrics.jsonl"), rows).unwrap();
        }
        qarl::io::write_json_atomic(&dir.join("config.json"), &cfg).unwrap();
        let state_step = match name {
            "edited" => 7,
            "done" => 1,
            _ => 0,
        };
        if name == "pruned" {
            std::fs::remove_dir_all(dir.join("checkpoints")).unwrap();
            continue;
        }
        if name == "warm" {
            std::fs::remove_dir_all(dir.join("checkpoints/step_000000")).unwrap();
            qarl::io::write_json_atomic(
                &dir.join("checkpoints/sft/step_000009/trainer_state.json"),
                &qarl::train::checkpoint::TrainerState::after_step(9, 1),
            )
            .unwrap();
            continue;
        }
        qarl::io::write_json_atomic(
            &dir.join(ckpt).join("trainer_state.json"),
            &qarl::train::checkpoint::TrainerState::after_step(state_step, 1),
        )
        .unwrap();
    }
    std::fs::write(runs.join("badcfg/config.json"), "{").unwrap();
    let text = stdout_of(qarl().arg("runs").arg(&runs));
    let line = |n: &str| {
        text.lines()
            .find(|l| l.contains(&format!("runs/{n}")))
            .unwrap_or_else(|| panic!("{n} missing: {text}"))
            .to_string()
    };
    assert!(
        line("done").contains("2/2")
            && line("done").contains("0.500")
            && line("done").contains("finished"),
        "{text}"
    );
    assert!(
        line("half").contains("1/2") && line("half").contains("resumable from step 1"),
        "{text}"
    );
    assert!(
        line("unsaved").contains("resumable from step 1") && !line("unsaved").contains("finished"),
        "{text}"
    );
    assert!(
        line("badcfg").contains("its config.json does not read")
            && line("badcfg").contains("config.json"),
        "{text}"
    );
    assert!(
        line("garbled").contains("metrics unreadable") && !line("garbled").contains("finished"),
        "{text}"
    );
    assert!(line("huge").contains("18446744073709551615/2"), "{text}");
    // The same tree given twice, and through a link: each run listed once.
    #[cfg(unix)]
    std::os::unix::fs::symlink(runs.join("done"), tmp.path().join("done-link")).unwrap();
    let twice = stdout_of(
        qarl()
            .arg("runs")
            .arg(&runs)
            .arg(&runs)
            .arg(tmp.path().join("done-link")),
    );
    assert_eq!(
        twice.lines().filter(|l| l.contains("done")).count(),
        1,
        "{twice}"
    );
    assert!(
        !line("badacc").contains("2.500")
            && line("badacc").contains("is 2.5, not an accuracy in [0, 1]"),
        "{text}"
    );
    assert!(
        line("damaged").contains("finished; its log does not read back")
            && line("damaged").contains("line 2 is not a metrics row"),
        "{text}"
    );
    assert!(
        line("warm").contains("resumable: the warm start from its step 10"),
        "{text}"
    );
    assert!(
        line("edited").contains("incomplete (no checkpoint)"),
        "{text}"
    );
    assert!(
        line("pruned").contains("2/2")
            && line("pruned").contains("complete log, no checkpoint here")
            && !line("pruned").contains("finished"),
        "{text}"
    );
    error_of(qarl().args(["runs", "/no/such/dir"]));
    // A file is no directory of runs.
    let file = tmp.path().join("file.json");
    std::fs::write(&file, "{}").unwrap();
    let err = error_of(qarl().arg("runs").arg(&file));
    assert!(err.contains("not a directory"), "{err}");
    // A directory without runs says so in plain text (it printed the list in debug formatting).
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let text = stdout_of(qarl().arg("runs").arg(&empty));
    assert!(
        text.contains(&format!(
            "no runs (directories with a metrics.jsonl) under {}",
            empty.display()
        )) && !text.contains("[\""),
        "{text}"
    );
}

/// `qarl generate --max-new-tokens 0` is refused before the model is read (it used to write prompt-only
/// rows and exit 0).
#[test]
fn generate_refuses_zero_new_tokens() {
    let err = error_of(
        qarl()
            .args(["generate", "--model", "/nonexistent", "--prompt", "1+1="])
            .args(["--output", "/nonexistent/out.json", "--max-new-tokens", "0"]),
    );
    assert!(err.contains("--max-new-tokens must be at least 1"), "{err}");
}

/// `qarl mismatch` refuses sizes and temperatures it cannot measure with, before loading anything: zero
/// samples used to panic (index out of bounds) and temperature 0 to print a NaN KL with exit code 0.
#[test]
fn mismatch_refuses_zero_samples_and_temperature() {
    for (flag, value, want) in [
        ("--samples", "0", "--samples must be at least 1"),
        (
            "--temperature",
            "0",
            "--temperature must be a finite number >= 1e-5",
        ),
        (
            "--temperature",
            "nan",
            "--temperature must be a finite number >= 1e-5",
        ),
        // Greedy's distribution in all but name: every KL read 0.
        (
            "--temperature",
            "1e-6",
            "--temperature must be a finite number >= 1e-5",
        ),
        ("--limit", "0", "--limit must be at least 1"),
        (
            "--schemes",
            "int8-pc,int4-g32,int8-pc",
            "--schemes names the same value twice (int8-pc)",
        ),
        (
            "--activations",
            "f32,f32",
            "--activations names the same value twice (f32)",
        ),
    ] {
        let err = error_of(qarl().args([
            "mismatch",
            "--model",
            "/nonexistent",
            "--data",
            "/nonexistent.jsonl",
            flag,
            value,
        ]));
        assert!(err.contains(want), "{flag} {value}: {err}");
    }
}

/// `qarl mismatch` on a tiny random model: an f32 floor row (f32 sampler, f32 forward) before the quantized
/// rows, each with the error-token fractions criterion by criterion and their union. In deterministic mode
/// the f32 row and the aligned row score the rollout's own bits, so they can have no ratio error and no KL;
/// the full-precision forward against the int4 rollout has both. `--deterministic on,off` measures every
/// row in both modes.
#[test]
fn mismatch_reports_an_f32_floor_and_separate_error_token_fractions() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::arith_model(&model, 7, 1.0);
    let data = tmp.path().join("problems.jsonl");
    std::fs::write(
        &data,
        "{\"question\": \"1+2?\", \"answer\": \"#### 3\"}\n{\"question\": \"4+4?\", \"answer\": \"#### 8\"}\n",
    )
    .unwrap();
    let output = tmp.path().join("mismatch.json");
    let out = qarl()
        .args(["mismatch", "--template", "plain", "--model"])
        .arg(&model)
        .arg("--data")
        .arg(&data)
        .args([
            "--samples",
            "2",
            "--max-new-tokens",
            "24",
            "--schemes",
            "int4-g32",
            "--deterministic",
            "on,off",
            "--output",
        ])
        .arg(&output)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).unwrap();
    // How the prompts were rendered and where it ran: other templates give other prompts.
    assert_eq!(
        (&v["template"], &v["backend"]),
        (&serde_json::json!("plain"), &serde_json::json!("flex")),
        "{v}"
    );
    let md = std::fs::read_to_string(output.with_extension("md")).unwrap();
    // Responses stop as `qarl eval`'s do (`--stop template`): at the plain template's next question.
    assert_eq!(v["stop_strings"], serde_json::json!(["\nQuestion:"]), "{v}");
    assert!(
        md.contains("template `plain`, stop strings [\"\\nQuestion:\"]; backend flex"),
        "{md}"
    );
    let rows = v["rows"].as_array().unwrap();
    let which: Vec<(&str, &str, &str)> = rows
        .iter()
        .map(|r| {
            (
                r["deterministic"].as_str().unwrap(),
                r["scheme"].as_str().unwrap(),
                r["forward"].as_str().unwrap(),
            )
        })
        .collect();
    // Deterministic mode on, then off (the backend's own kernels): the same rows in each.
    assert_eq!(
        which,
        [
            ("on", "f32", "full"),
            ("on", "int4-g32", "full"),
            ("on", "int4-g32", "aligned"),
            ("off", "f32", "full"),
            ("off", "int4-g32", "full"),
            ("off", "int4-g32", "aligned")
        ]
    );
    let get = |r: &serde_json::Value, k: &str| {
        r[k].as_f64()
            .unwrap_or_else(|| panic!("{k} missing in {r}"))
    };
    for r in rows {
        let parts = [
            get(r, "error_tokens/ratio_frac"),
            get(r, "error_tokens/low_prob_frac"),
            get(r, "error_tokens/repetition_frac"),
        ];
        let any = get(r, "error_tokens/any_frac");
        assert!(
            parts.iter().all(|&p| (0.0..=1.0).contains(&p) && p <= any),
            "{r}"
        );
        assert!(any <= parts.iter().sum::<f64>() + 1e-12, "{r}");
        assert!(r.get("error_tokens/frac").is_none(), "old mixed key: {r}");
        assert!(r["response_tokens"].as_u64().unwrap() > 0);
    }
    for r in [&rows[0], &rows[2]] {
        assert_eq!(get(r, "rollout_corr/k3_kl"), 0.0, "{r}");
        assert_eq!(get(r, "error_tokens/ratio_frac"), 0.0, "{r}");
    }
    // With init std 1 the random model is peaked enough that int4-g32 changes many sampled tokens'
    // probabilities by over 20x against the full-precision forward (measured: ratio 0.70, low prob 0.49).
    let full = &rows[1];
    assert!(get(full, "rollout_corr/k3_kl") > 0.0, "{full}");
    assert!(get(full, "error_tokens/ratio_frac") > 0.0, "{full}");
    let md = std::fs::read_to_string(output.with_extension("md")).unwrap();
    eprintln!("{md}");
    assert!(
        md.contains("| error tokens: ratio | low prob | repetition | any |")
            && md.contains("| on | f32 | full |")
            && md.contains("| off | int4-g32 | aligned |"),
        "{md}"
    );
    assert!(stdout.contains("f32     full:"), "{stdout}");
}

/// `qarl score --quant nvfp4|mxfp4` scores with the fp4 weights: the logits are bitwise those of the model
/// quantized in process (the same forward), and differ from the full-precision ones.
#[test]
fn score_with_fp4_quant_uses_the_fp4_weights() {
    use burn::tensor::Device;
    use qarl::host::to_f32_vec;
    use qarl::model::Decoder;
    use qarl::quant::{QuantConfig, QuantScheme};

    let dir = fixtures_dir().join("qwen3_moe");
    let ids = vec![vec![5u32, 9, 200, 31, 7, 8]];
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("ids.json");
    std::fs::write(&input, serde_json::json!({ "input_ids": ids }).to_string()).unwrap();
    let full = to_f32_vec(
        Decoder::load(&dir, &Device::flex())
            .unwrap()
            .forward(&ids, None, None, None)
            .logits,
    );
    for scheme in [QuantScheme::Nvfp4, QuantScheme::Mxfp4] {
        let output = tmp.path().join(format!("{scheme}.json"));
        let v = run_qarl_json(
            qarl()
                .args(["score", "--model"])
                .arg(&dir)
                .args(["--quant", scheme.name(), "--input"])
                .arg(&input)
                .arg("--output")
                .arg(&output),
            &output,
        );
        let logits: Vec<Vec<Vec<f32>>> = serde_json::from_value(v["logits"].clone()).unwrap();
        let got: Vec<f32> = logits.iter().flatten().flatten().copied().collect();
        let mut model = Decoder::load(&dir, &Device::flex()).unwrap();
        model.quantize(&QuantConfig::new(scheme)).unwrap();
        let want = to_f32_vec(model.forward(&ids, None, None, None).logits);
        assert_eq!(got, want, "{scheme}: CLI and in-process quantized logits");
        assert!(
            max_abs_diff(&got, &full) > 0.0,
            "{scheme}: no quantization?"
        );
    }
}

/// The fp4 scheme names are accepted wherever a scheme is named on the command line (`eval --quant`,
/// `mismatch --schemes`): the commands get past parsing to the missing model; a misspelling lists them.
#[test]
fn fp4_scheme_names_parse_on_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("problems.jsonl");
    std::fs::write(&data, "{\"question\": \"1+1?\", \"answer\": \"#### 2\"}\n").unwrap();
    let data = data.to_str().unwrap();
    for args in [
        vec![
            "eval",
            "--model",
            "/nonexistent",
            "--data",
            data,
            "--quant",
            "nvfp4",
        ],
        vec![
            "eval",
            "--model",
            "/nonexistent",
            "--data",
            data,
            "--quant",
            "mxfp4",
        ],
        vec![
            "mismatch",
            "--model",
            "/nonexistent",
            "--data",
            data,
            "--schemes",
            "nvfp4,mxfp4",
        ],
    ] {
        let err = error_of(qarl().args(&args));
        assert!(err.contains("/nonexistent"), "{args:?}: {err}");
    }
    let out = qarl()
        .args([
            "eval",
            "--model",
            "/nonexistent",
            "--data",
            "x",
            "--quant",
            "nvfp8",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("nvfp8") && err.contains("nvfp4") && err.contains("mxfp4"),
        "{err}"
    );
}

/// `qarl eval` and `qarl mismatch` read the problems file they are given: GSM8K is not in the repository, so
/// `gsm8k-test` needs $QARL_GSM8K_DIR and says so, `mismatch` has no default that a clone lacks, and a
/// missing or malformed file is named with what is wrong.
#[test]
fn eval_and_mismatch_name_the_problems_file_they_need() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |args: &[&str], gsm8k_dir: Option<&std::path::Path>| {
        let mut cmd = qarl();
        cmd.args(args).current_dir(tmp.path());
        match gsm8k_dir {
            Some(d) => cmd.env("QARL_GSM8K_DIR", d),
            None => cmd.env_remove("QARL_GSM8K_DIR"),
        };
        let out = cmd.output().unwrap();
        (out.status.code(), String::from_utf8(out.stderr).unwrap())
    };
    for cmd in ["eval", "mismatch"] {
        let (code, err) = run(
            &[cmd, "--model", "/nonexistent", "--data", "gsm8k-test"],
            None,
        );
        assert_eq!(code, Some(1), "{cmd}: {err}");
        assert!(
            err.contains("--data gsm8k-test names test.jsonl in $QARL_GSM8K_DIR, which is not set")
                && err.contains("experiments/data/word_problems_test.jsonl"),
            "{cmd}: {err}"
        );
        let (code, err) = run(
            &[cmd, "--model", "/nonexistent", "--data", "gsm8k-train"],
            Some(tmp.path()),
        );
        assert_eq!(code, Some(1), "{cmd}: {err}");
        assert!(
            err.contains(&format!(
                "{}: cannot read the data set (not found)",
                tmp.path().join("train.jsonl").display()
            )) && !err.contains("os error"),
            "{cmd}: {err}"
        );
        std::fs::write(
            tmp.path().join("bad.jsonl"),
            "{\"question\": \"q\", \"answer\": \"#### 3\"}\n{\"question\": \"q\", \"answer\": \"#### four\"}\n",
        )
        .unwrap();
        let (code, err) = run(
            &[cmd, "--model", "/nonexistent", "--data", "bad.jsonl"],
            None,
        );
        assert_eq!(code, Some(1), "{cmd}: {err}");
        assert!(
            err.contains("bad.jsonl:2: the final answer after `####` is `four`, not a number"),
            "{cmd}: {err}"
        );
    }
    let (code, err) = run(&["mismatch", "--model", "/nonexistent"], None);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--data"), "{err}");
    // A question with a character the tokenizer has no token for: the data file and its line are named
    // (the tokenizer's error named its own file only).
    let model = tmp.path().join("model");
    common::arith_model(&model, 7, 0.02);
    std::fs::write(
        tmp.path().join("accents.jsonl"),
        "{\"question\": \"1+2\", \"answer\": \"#### 3\"}\n{\"question\": \"caf\u{e9} 1+2\", \"answer\": \"#### 3\"}\n",
    )
    .unwrap();
    for cmd in ["eval", "mismatch"] {
        let model = model.to_str().unwrap();
        let (code, err) = run(
            &[
                cmd,
                "--model",
                model,
                "--data",
                "accents.jsonl",
                "--template",
                "plain",
            ],
            None,
        );
        assert_eq!(code, Some(1), "{cmd}: {err}");
        assert!(
            err.contains("accents.jsonl: line 2") && err.contains("U+00E9"),
            "{cmd}: {err}"
        );
    }
}

/// Every command that computes takes `--backend`; one this build lacks is refused before any work, naming
/// the cargo feature to build with.
#[cfg(not(feature = "cuda"))]
#[test]
fn every_computing_command_takes_a_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("problems.jsonl");
    std::fs::write(&data, "{\"question\": \"1+1?\", \"answer\": \"#### 2\"}\n").unwrap();
    let cfg = tmp.path().join("run.toml");
    std::fs::write(&cfg, common::tiny_train_toml(tmp.path(), "aligned", 1)).unwrap();
    let (data, cfg) = (data.to_str().unwrap(), cfg.to_str().unwrap());
    let model = ["--model", "/nonexistent", "--data", data];
    for args in [
        vec!["train", "--config", cfg],
        vec!["sft", "--config", cfg],
        vec!["bench", "step", "--config", cfg, "--steps", "1"],
        [&["eval", "--template", "plain"][..], &model].concat(),
        [&["mismatch"][..], &model].concat(),
    ] {
        let err = error_of(qarl().args(&args).args(["--backend", "cuda"]));
        assert!(err.contains("--features cuda"), "{args:?}: {err}");
    }
    // Nothing was created: the backend is checked before the run directory or the model is touched.
    assert!(!tmp.path().join("run").exists() && !tmp.path().join("model").exists());
    let err = usage_error_of(qarl().args(["train", "--config", cfg, "--backend", "vulkan"]));
    assert!(err.contains("vulkan") && err.contains("wgpu"), "{err}");
    // A scheme name that is none: a usage error naming the valid ones, before anything is read.
    let err =
        usage_error_of(qarl().args(["compare", "--a", "x", "--b", "y", "--precision", "int3"]));
    assert!(
        err.contains("unknown scheme `int3`") && err.contains("int4-g32"),
        "{err}"
    );
}

/// A `top_k` of at least the vocabulary (the tiny model's 100 tokens) keeps every token: refused by name,
/// for the rollout and the evaluation, before the warm start runs (vLLM reads it as off; as a filter it
/// counted as truncation).
#[test]
fn a_top_k_of_the_whole_vocabulary_is_refused_before_the_warm_start() {
    let tmp = tempfile::tempdir().unwrap();
    for (key, section, extra) in [
        ("rollout.top_k", "[rollout]\n", "top_k = 100\n"),
        ("eval.top_k", "[eval]\n", "top_k = 100\nk = 2\n"),
    ] {
        let text = common::tiny_train_toml(tmp.path(), "aligned", 1)
            .replace(section, &format!("{section}{extra}"));
        let cfg = tmp.path().join("run.toml");
        std::fs::write(&cfg, text).unwrap();
        let err = error_of(qarl().args(["train", "--quiet", "--config"]).arg(&cfg));
        assert!(
            err.contains(&format!("`{key}` = 100 is at least the vocabulary"))
                && err.contains("(100 tokens)"),
            "{key}: {err}"
        );
        assert!(
            !tmp.path().join("model").exists(),
            "{key}: the warm start ran first"
        );
    }
}

/// `train.routing_replay` on a dense model is refused by `qarl train` and by `qarl bench step` alike
/// (the bench loaded its model on its own and skipped the replay without a word).
#[test]
fn routing_replay_on_a_dense_model_is_refused_by_train_and_bench_step() {
    let tmp = tempfile::tempdir().unwrap();
    let moe_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs/models/qwen3-moe-arith.json");
    let mut dense: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&moe_path).unwrap()).unwrap();
    let obj = dense.as_object_mut().unwrap();
    for key in [
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    ] {
        obj.remove(key);
    }
    obj.insert(
        "architectures".into(),
        serde_json::json!(["Qwen3ForCausalLM"]),
    );
    obj.insert("model_type".into(), serde_json::json!("qwen3"));
    let dense_path = tmp.path().join("dense.json");
    std::fs::write(&dense_path, dense.to_string()).unwrap();
    let text = common::tiny_train_toml(tmp.path(), "aligned", 1)
        .replace("[sft]\nsteps = 8", "[sft]\nsteps = 1")
        .replace("lr = 1e-4\n", "lr = 1e-4\nrouting_replay = true\n");
    let text = text.replace(
        &moe_path.display().to_string(),
        &dense_path.display().to_string(),
    );
    assert!(
        text.contains("routing_replay = true") && text.contains("dense.json"),
        "{text}"
    );
    let cfg = tmp.path().join("run.toml");
    std::fs::write(&cfg, text).unwrap();
    for args in [
        vec!["train", "--quiet"],
        vec!["bench", "step", "--quiet", "--steps", "1", "--warmup", "0"],
    ] {
        let err = error_of(qarl().args(&args).arg("--config").arg(&cfg));
        assert!(
            err.contains("`train.routing_replay` = true, but")
                && err.contains("no mixture-of-experts layer"),
            "{args:?}: {err}"
        );
        // Known from the config the warm start would build from: refused before it runs.
        assert!(
            !tmp.path().join("model").exists(),
            "{args:?}: the warm start ran first"
        );
    }
}

/// `qarl bench step --json` naming its own config or a record of the run it benches is refused before
/// any work (it replaced the config with its table and exited 0).
#[test]
fn bench_step_json_is_no_file_it_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("run.toml");
    let text = common::tiny_train_toml(tmp.path(), "aligned", 1);
    std::fs::write(&cfg, &text).unwrap();
    let metrics = tmp.path().join("run").join("metrics.jsonl");
    std::fs::create_dir_all(metrics.parent().unwrap()).unwrap();
    std::fs::write(&metrics, "{}\n").unwrap();
    for out in [&cfg, &metrics] {
        let err = error_of(
            qarl()
                .args(["bench", "step", "--quiet", "--steps", "1", "--warmup", "0"])
                .arg("--config")
                .arg(&cfg)
                .arg("--json")
                .arg(out),
        );
        assert!(err.contains("is also what this command reads"), "{err}");
    }
    assert_eq!(std::fs::read_to_string(&cfg).unwrap(), text);
    assert_eq!(std::fs::read_to_string(&metrics).unwrap(), "{}\n");
    assert!(!tmp.path().join("model").exists());
}

/// `qarl bench step` with two variants: each is timed in its own process (so its peak memory is its own),
/// and the JSON report holds both, with the timed steps and the phase keys the table is built from.
#[test]
fn bench_step_times_each_variant_in_its_own_process() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("run.toml");
    std::fs::write(&cfg, common::tiny_train_toml(tmp.path(), "aligned", 1)).unwrap();
    let json = tmp.path().join("bench.json");
    let stdout = stdout_of(
        qarl()
            .current_dir(tmp.path())
            .args(["bench", "step", "--quiet", "--steps", "1", "--warmup", "0"])
            .arg("--config")
            .arg(&cfg)
            .args(["--variant", "f32:rollout.precision=f32,train.forward=full"])
            .args(["--variant", "int4:rollout.precision=int4-g32"])
            .arg("--json")
            .arg(&json),
    );
    assert!(
        stdout.contains("## f32") && stdout.contains("## int4"),
        "{stdout}"
    );
    // The mismatch each variant left: none, in deterministic mode (f32 rollout and f32 learner; int4
    // rollout and the aligned forward).
    assert!(
        stdout.contains("| mismatch (median) | f32 | int4 |"),
        "{stdout}"
    );
    assert!(stdout.contains("| k3 KL | 0.000e0 | 0.000e0 |"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let variants = report["variants"].as_array().unwrap();
    assert_eq!(variants.len(), 2);
    for v in variants {
        let steps = v["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 1, "{v}");
        for key in ["perf/step_s", "perf/peak_rss_gb", "perf/learner_forward_s"] {
            let x = steps[0][key].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x > 0.0, "{key} = {x} in {v}");
        }
    }
}

#[test]
fn compare_pairs_eval_outputs_by_problem_and_refuses_other_problems() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, questions: &[&str], correct: &[bool]| {
        let problems: Vec<serde_json::Value> = questions
            .iter()
            .zip(correct)
            .map(|(q, c)| serde_json::json!({"question": q, "correct": c}))
            .collect();
        let path = tmp.path().join(name);
        std::fs::write(
            &path,
            serde_json::json!({ "problems": problems }).to_string(),
        )
        .unwrap();
        path.display().to_string()
    };
    let qs = ["a?", "b?", "c?"];
    let a = write("a.json", &qs, &[true, true, false]);
    let b = write("b.json", &qs, &[false, true, false]);
    let other = write("other.json", &["a?", "x?", "c?"], &[true, true, false]);
    let text = stdout_of(qarl().args(["compare", "--a", &a, "--b", &b, "--name-a", "new"]));
    // d = [1, 0, 0]: mean 1/3, SE sd / sqrt(3) = 0.5774 / 1.732 = 0.333, one problem ahead: p = 1.
    assert!(
        text.contains("new − B: +0.333 ± 0.333 (1 vs 0 problems; p 1.0e0)"),
        "{text}"
    );
    // Each evaluation is named as read; one given twice in an arm would count as two seeds.
    assert!(
        text.contains(&format!("new: {a}")) && text.contains(&format!("B: {b}")),
        "{text}"
    );
    let err = error_of(qarl().args(["compare", "--a", &a, &a, "--b", &b]));
    assert!(err.contains("are the same evaluation"), "{err}");
    // Also under two spellings of one path.
    let dotted = tmp.path().join(".").join("a.json").display().to_string();
    let err = error_of(qarl().args(["compare", "--a", &a, &dotted, "--b", &b]));
    assert!(
        err.contains(&format!("{a} and {dotted} are the same evaluation")),
        "{err}"
    );
    // A copy of one evaluation under another name is warned about: it would count as a second seed.
    let copy = tmp.path().join("a-copy.json");
    std::fs::copy(&a, &copy).unwrap();
    let copy = copy.display().to_string();
    let out = qarl()
        .args(["compare", "--a", &a, &copy, "--b", &b])
        .output()
        .unwrap();
    let warned = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && warned.contains(&format!("{a} and {copy} hold the same evaluation")),
        "{warned}"
    );
    // One evaluation in both arms: a model compared with itself.
    let err = error_of(qarl().args(["compare", "--a", &a, "--b", &dotted]));
    assert!(err.contains(&format!("{dotted} is in both arms")), "{err}");
    let err = error_of(qarl().args(["compare", "--a", &a, "--b", &other]));
    assert!(
        err.contains("other.json") && err.contains("problem 2 is \"b?\""),
        "{err}"
    );
    let err = error_of(qarl().args(["compare", "--require-identical", "--a", &a, "--b", &b]));
    assert!(
        err.contains("differ on 1 problem(s) (first: problem 1)"),
        "{err}"
    );
}

/// Two variants sharing `model.dir` whose warm starts differ (here only `sft.lr`): the first would make the
/// model and the second train on it while the report credits its own `[sft]`. Refused before any run,
/// naming both variants and the key; seeds of one variant share a warm start as before.
#[test]
fn experiment_variants_sharing_a_model_must_make_it_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let (exp, results) = tiny_experiment(
        tmp.path(),
        "seeds = [1, 2]\n[[variant]]\nname = \"a\"\n[[variant]]\nname = \"b\"\n\
         set = { \"sft.lr\" = 5e-3 }\n",
    );
    let err = error_of(qarl().arg("experiment").arg(&exp).arg("--quiet"));
    assert!(
        err.contains("exp.toml: variants \"a\" and \"b\" share `model.dir`")
            && err.contains("(`sft.lr`)")
            && err.contains("give each its own `model.dir`"),
        "{err}"
    );
    assert!(!tmp.path().join("model").exists(), "nothing ran");
    // A variant added after another finished: checked against the finished run's own config (it trained
    // on the finished variant's model without a word).
    let only_a = format!(
        "name = \"e\"\nbase = \"base.toml\"\nseeds = [1]\nresults_dir = {:?}\n[[variant]]\nname = \"a\"\n",
        results.display().to_string()
    );
    std::fs::write(&exp, &only_a).unwrap();
    stdout_of(qarl().arg("experiment").arg(&exp).arg("--quiet"));
    assert!(results.join("a/seed1/finished.json").is_file());
    std::fs::write(
        &exp,
        only_a + "[[variant]]\nname = \"b\"\nset = { \"sft.lr\" = 5e-3 }\n",
    )
    .unwrap();
    let err = error_of(qarl().arg("experiment").arg(&exp).arg("--quiet"));
    assert!(
        err.contains("variants \"b\" and \"a\" share `model.dir`") && err.contains("(`sft.lr`)"),
        "{err}"
    );
    assert!(!results.join("b").exists(), "b did not run");
}

/// A bad key that a variant's `set` (or a `--set`) put into a run's config is traced to where it was set:
/// the error's own line is of the composed config, which no file holds ("line 29").
#[test]
fn an_experiment_error_names_the_set_that_made_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (exp, _) = tiny_experiment(
        tmp.path(),
        "seeds = [1]\n[[variant]]\nname = \"a\"\nabout = \"x\"\nset = { \"train.lrr\" = 3 }\n",
    );
    let err = error_of(qarl().arg("experiment").arg(&exp).arg("--quiet"));
    assert!(
        err.contains("`train.lrr`: set by variant \"a\"'s `set` (`train.lrr`) in")
            && err.contains("exp.toml, line 8"),
        "{err}"
    );
    let err = error_of(
        qarl()
            .arg("experiment")
            .arg(&exp)
            .args(["--quiet", "--set", "rollout.top_pp=0.5", "--results-dir"])
            .arg(tmp.path().join("trial")),
    );
    assert!(
        err.contains("`rollout.top_pp`: given by `--set rollout.top_pp=...`"),
        "{err}"
    );
}

/// An experiment sets each run's `seed` and `run_dir` itself, and writes `report.md`, `comparison.png` and
/// `claims.md` beside the variants' folders: a variant that sets either key, or is named like one of those
/// files, is refused before any run (the value would be overwritten; the folder would collide).
#[test]
fn experiment_variants_cannot_set_what_the_experiment_sets() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = tmp.path().join("exp.toml");
    for (variant, want) in [
        (
            "name = \"a\"\nset = { seed = 7 }",
            "variant \"a\" sets `seed`",
        ),
        (
            "name = \"a\"\nset = { run_dir = \"x\" }",
            "variant \"a\" sets `run_dir`",
        ),
        (
            "name = \"a\"\nset = { \"seed.x\" = 7 }",
            "variant \"a\" sets `seed.x`, which an experiment sets for every run as `seed`",
        ),
        (
            "name = \"report.md\"",
            "variant name \"report.md\" is the name of a file",
        ),
        // Failed only when its runs began, after the variants before it had trained.
        (
            &format!("name = \"{}\"", "v".repeat(256)),
            "is longer than a file name may be (255 bytes)",
        ),
        // A report row split in two, or given an extra column.
        (
            "name = \"a|b\"",
            "variant name \"a|b\" holds a `|` or a control character",
        ),
        (
            "name = \"a\\nb\"",
            "holds a `|` or a control character, which would break the report's tables",
        ),
    ] {
        let text = format!(
            "name = \"e\"\nbase = \"base.toml\"\nseeds = [1]\nresults_dir = {:?}\n[[variant]]\n{variant}\n",
            tmp.path().join("results").display().to_string()
        );
        std::fs::write(&exp, &text).unwrap();
        let err = error_of(qarl().arg("experiment").arg(&exp));
        assert!(
            err.contains("exp.toml") && err.contains(want),
            "{variant}: {err}"
        );
        assert!(
            !tmp.path().join("results").exists(),
            "{variant}: nothing runs"
        );
    }
    // Without `results_dir` the name is the results folder's last part: "" or "../x" would put it elsewhere.
    for name in ["", "../../elsewhere", "a/b"] {
        let text = format!(
            "name = {name:?}\nbase = \"base.toml\"\nseeds = [1]\n[[variant]]\nname = \"a\"\n"
        );
        std::fs::write(&exp, &text).unwrap();
        let err = error_of(qarl().arg("experiment").arg(&exp));
        assert!(
            err.contains(&format!("name {name:?} must be one plain directory name")),
            "{name}: {err}"
        );
    }
}

/// Files a command writes at its end are checked before its work: a folder where the file would go is
/// refused first (here before the model is even read: the model named does not exist). `--system` with
/// the plain template, which has no system turn, and a folder given as a config are refused by name.
#[test]
fn outputs_are_checked_before_the_work() {
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().display().to_string();
    let data = fixtures_dir()
        .join("../gsm8k_slice.jsonl")
        .display()
        .to_string();
    let missing = tmp.path().join("no-model").display().to_string();
    for args in [
        vec![
            "eval", "--model", &missing, "--data", &data, "--output", &folder,
        ],
        vec![
            "generate",
            "--model",
            &missing,
            "--prompt-ids",
            "[[1]]",
            "--output",
            &folder,
        ],
        vec!["bench", "rollout", "--model", &missing, "--json", &folder],
    ] {
        let err = error_of(qarl().args(&args));
        assert!(
            err.contains(&format!("{folder}: is a folder")),
            "{args:?}: {err}"
        );
    }
    let file = tmp.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let below_file = file.join("out.json").display().to_string();
    let err = error_of(qarl().args([
        "eval",
        "--model",
        &missing,
        "--data",
        &data,
        "--output",
        &below_file,
    ]));
    assert!(err.contains("is not a folder"), "{err}");
    let model = fixtures_dir().join("qwen3").display().to_string();
    // `qarl eval` on the fixture model and the data with `extra` options: its error.
    let eval_error = |extra: &[&str]| {
        error_of(
            qarl()
                .args(["eval", "--model", &model, "--data", &data])
                .args(extra),
        )
    };
    let err = eval_error(&["--template", "plain", "--system", "hi"]);
    assert!(err.contains("`--template plain` has none"), "{err}");
    for (template, refused) in [
        ("chatml", "`--template chatml` has none"),
        ("plain", "`--template plain` has none"),
    ] {
        let err = eval_error(&["--template", template, "--enable-thinking", "false"]);
        assert!(err.contains(refused), "{err}");
    }
    let err = eval_error(&["--template", "jinja"]);
    assert!(
        err.contains("expected `chat`, `chatml` or `plain`"),
        "{err}"
    );
    let err = error_of(qarl().args(["config", "show", &folder]));
    assert!(err.contains("is a folder"), "{err}");
}

/// The chat template on a model that declares none is applied only where its tokenizer has ChatML's
/// tokens: a character tokenizer would spell `<|im_start|>` out as text the model never saw.
#[test]
fn the_chat_template_needs_a_template_or_its_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::copy_model(&fixtures_dir().join("qwen3"), &model);
    qarl::tasks::char_tokenizer::save(&model).unwrap();
    let data = fixtures_dir().join("../gsm8k_slice.jsonl");
    for cmd in ["eval", "mismatch"] {
        let err = error_of(
            qarl()
                .args([cmd, "--limit", "1", "--model"])
                .arg(&model)
                .arg("--data")
                .arg(&data),
        );
        assert!(
            err.contains("no chat template, and the tokenizer")
                && err.contains("has no <|im_start|> or <|im_end|> token"),
            "{cmd}: {err}"
        );
    }
}

/// A quantized checkpoint where the full-precision model is needed (a command that quantizes it itself,
/// or training) is refused by name instead of passing its dequantized codes off as full precision.
#[test]
fn quantized_checkpoints_are_refused_where_full_precision_is_needed() {
    let tmp = tempfile::tempdir().unwrap();
    let q = tmp.path().join("q");
    stdout_of(
        qarl()
            .args(["quantize", "--scheme", "int4-g32", "--model"])
            .arg(fixtures_dir().join("qwen3"))
            .arg("--output")
            .arg(&q),
    );
    let err = error_of(
        qarl()
            .args(["bench", "rollout", "--schemes", "f32", "--model"])
            .arg(&q),
    );
    assert!(
        err.contains("the checkpoint is quantized (int4-g32)"),
        "{err}"
    );
    // The experts' path of a dense model: nothing it names would run.
    let err = error_of(
        qarl()
            .args(["bench", "rollout", "--moe-experts", "loop", "--model"])
            .arg(fixtures_dir().join("qwen3")),
    );
    assert!(
        err.contains("--moe-experts loop") && err.contains("is a dense model"),
        "{err}"
    );
    // Training on it: its full-precision masters would be the dequantized codes.
    let toml = tmp.path().join("train.toml");
    std::fs::write(&toml, common::tiny_train_toml(tmp.path(), "aligned", 1)).unwrap();
    let err = error_of(
        qarl()
            .args(["train", "--quiet", "--config"])
            .arg(&toml)
            .args(["--set", &format!("model.dir=\"{}\"", q.display())]),
    );
    assert!(
        err.contains("the checkpoint is quantized (int4-g32)"),
        "{err}"
    );
    // A checkpoint that holds a quantized tensor beside the weight it would be made from: refused by
    // name (the writer was handed the name twice and indexed out of bounds).
    let half = tmp.path().join("half");
    common::copy_model(&fixtures_dir().join("qwen3"), &half);
    let mut tensors = common::read_tensors(&half.join("model.safetensors"));
    let stray = tensors["model.layers.0.mlp.up_proj.weight"].clone();
    tensors.insert("model.layers.0.mlp.up_proj.qweight".into(), stray);
    common::write_tensors(&half.join("model.safetensors"), &tensors);
    let err = error_of(
        qarl()
            .args(["quantize", "--scheme", "int8-pc", "--model"])
            .arg(&half)
            .arg("--output")
            .arg(tmp.path().join("half_q")),
    );
    assert!(
        err.contains("`model.layers.0.mlp.up_proj.qweight` is already in the checkpoint"),
        "{err}"
    );
    let device = qarl::ops::BackendKind::Flex.device().unwrap();
    let err = qarl::model::Decoder::load_full_precision(&q, &device)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the checkpoint is quantized (int4-g32)"),
        "{err}"
    );
    assert!(
        qarl::model::Decoder::load(&q, &device).is_ok(),
        "the plain load keeps working"
    );
}

/// `qarl experiment --report-only` names the experiment file when it cannot be read or has no results
/// yet (it said "No such file or directory (os error 2)" before), and refuses an experiment without
/// seeds as the full command does.
#[test]
fn experiment_report_only_names_what_is_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = tmp.path().join("exp.toml");
    let results = tmp.path().join("results");
    let text = format!(
        "name = \"e\"\nbase = \"base.toml\"\nseeds = [1]\nresults_dir = {:?}\n[[variant]]\nname = \"a\"\n",
        results.display().to_string()
    );
    std::fs::write(&exp, &text).unwrap();
    let report_only = |file: &std::path::Path| {
        let out = qarl()
            .args(["experiment", "--report-only"])
            .arg(file)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, err) = report_only(&exp);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("exp.toml: no results of this experiment yet"),
        "{err}"
    );
    // `--backend` runs nothing there: refused, not ignored.
    let err = common::usage_error_of(
        qarl()
            .args(["experiment", "--report-only", "--backend", "flex"])
            .arg(&exp),
    );
    assert!(
        err.contains("--backend") && err.contains("--report-only"),
        "{err}"
    );
    assert!(!err.contains("os error"), "{err}");
    let (code, err) = report_only(&tmp.path().join("absent.toml"));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("absent.toml: cannot read (not found)"),
        "{err}"
    );
    std::fs::write(&exp, text.replace("seeds = [1]", "seeds = []")).unwrap();
    let (_, err) = report_only(&exp);
    assert!(err.contains("exp.toml: needs at least one seed"), "{err}");
    // With a results directory (no finished run yet) the report is written.
    std::fs::write(&exp, &text).unwrap();
    std::fs::create_dir_all(&results).unwrap();
    let (code, err) = report_only(&exp);
    assert_eq!(code, Some(0), "{err}");
    assert!(results.join("report.md").is_file());
}

/// `qarl bench kernels --summarize` reads a saved table on any build (no device): the MoE block's
/// yardsticks of H200 run 4, and a clear error for a file that is not such a table.
/// `qarl bench kernels` refuses sizes it cannot bench before it looks for a device, naming the flag:
/// more experts per token than experts, a zero count.
#[test]
fn bench_kernels_refuses_impossible_sizes() {
    for (args, want) in [
        (vec!["--experts", "4"], "--top-k 8 with --experts 4"),
        (vec!["--tokens", "1,0"], "--tokens [1, 0]"),
        (vec!["--hidden", "0"], "--hidden 0: must be at least 1"),
        // Names as well, before any device is sought (they were refused after the rooflines).
        (vec!["--formats", "int5"], "--formats int5"),
        // A runtime that does not exist is named as such (it was told to rebuild with a feature).
        (
            vec!["--runtime", "foo"],
            "--runtime foo`: not a CubeCL runtime",
        ),
    ] {
        let err = error_of(qarl().args(["bench", "kernels"]).args(&args));
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // An activation type the kernels do not have is a usage error, with the ones they do.
    let err = usage_error_of(qarl().args(["bench", "kernels", "--act-dtype", "f32,f64"]));
    assert!(
        err.contains("invalid value 'f64' for '--act-dtype")
            && err.contains("[possible values: f32, bf16, f16]"),
        "{err}"
    );
}

#[test]
fn bench_kernels_summarizes_a_saved_table_without_a_device() {
    let table = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/experiments/results/gpu_h200/run4_kernels_moe_cuda.json"
    );
    let text = stdout_of(qarl().args(["bench", "kernels", "--summarize", table]));
    assert!(text.contains("copy 3759 GB/s"), "{text}");
    // A measurement's options beside it are refused (they would be ignored).
    let err =
        common::usage_error_of(qarl().args(["bench", "kernels", "--check", "--summarize", table]));
    assert!(
        err.contains("--check") && err.contains("--summarize"),
        "{err}"
    );
    assert!(
        text.contains(
            "int4-g128 bf16  4096 tokens, tensor-core: moe/mma-x1 4.86x the baseline's time (beyond 1.3x)"
        ),
        "{text}"
    );
    let tmp = tempfile::tempdir().unwrap();
    // The summary of run 4's table after `edit`, saved as `name`.
    let summarize_edited = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let mut doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(table).unwrap()).unwrap();
        edit(&mut doc);
        let path = tmp.path().join(name);
        std::fs::write(&path, doc.to_string()).unwrap();
        stdout_of(qarl().args(["bench", "kernels", "--summarize"]).arg(&path))
    };
    // An edited table whose numbers a summary would misread is refused, naming the row or the field.
    let refused = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(table).unwrap()).unwrap();
        edit(&mut doc);
        let path = tmp.path().join("edited.json");
        std::fs::write(&path, doc.to_string()).unwrap();
        error_of(qarl().args(["bench", "kernels", "--summarize"]).arg(&path))
    };
    let err = refused(&|d| d["rows"][3]["micros"] = 0.into());
    assert!(
        err.contains("row 3: `micros` = 0: not a positive number"),
        "{err}"
    );
    let err = refused(&|d| d["copy_gb_per_s"] = (-5).into());
    assert!(err.contains("`copy_gb_per_s` = -5"), "{err}");
    let err = refused(&|d| d["rows"][0] = "x".into());
    assert!(err.contains("row 0: no `kernel` string"), "{err}");
    // A table a stopped run left (`"complete": false`, written after each row) is summarized as far as
    // it goes, and says that it is partial. Run 4's rows up to its MoE block at 64 tokens:
    let kept = 66;
    let text = summarize_edited("partial.json", &|doc| {
        let rows = doc["rows"].as_array().unwrap().clone();
        doc["rows"] = serde_json::json!(rows[..kept]);
        doc["complete"] = serde_json::json!(false);
    });
    assert!(
        text.contains(&format!(
            "a partial table: the run stopped after {kept} rows"
        )),
        "{text}"
    );
    assert!(
        text.contains("int4-g128 bf16     1 tokens,   canonical"),
        "{text}"
    );
    assert!(!text.contains("256 tokens"), "{text}");
    // A row during which a device task failed is left out of the summary: another row is the fastest.
    let text = summarize_edited("failed.json", &|doc| {
        for r in doc["rows"].as_array_mut().unwrap() {
            if r["kernel"] == "moe/mma-x1" && r["tokens"] == 4096 {
                r["device_failures"] = serde_json::json!(1);
            }
        }
    });
    assert!(
        text.contains("int4-g128 bf16  4096 tokens, tensor-core:")
            && !text.contains("tensor-core: moe/mma-x1 4.86x"),
        "{text}"
    );
    let bad = tmp.path().join("other.json");
    std::fs::write(&bad, r#"{"rows": 3}"#).unwrap();
    let err = error_of(qarl().args(["bench", "kernels", "--summarize"]).arg(&bad));
    assert!(err.contains("other.json: no `rows` array"), "{err}");
}

/// What is already on disk is never written over or mixed into: `init-model`, `quantize` and
/// `import-gguf` refuse an output directory that holds files, `mismatch` an output named `.md` (its
/// Markdown table would replace the JSON), and `quantize` a pattern that would pack a tensor the model
/// reads in full precision (the checkpoint would not load).
#[test]
fn outputs_never_overwrite_or_mix_with_existing_files() {
    let tmp = tempfile::tempdir().unwrap();
    let taken = tmp.path().join("taken");
    std::fs::create_dir_all(&taken).unwrap();
    std::fs::write(taken.join("model.safetensors"), b"someone's weights").unwrap();
    let fixture = fixtures_dir().join("qwen3");
    let gguf = fixtures_dir().join("../gguf/tiny_llama.gguf");
    let config = fixture.join("config.json");
    let runs: [Vec<&std::ffi::OsStr>; 3] = [
        vec![
            "init-model".as_ref(),
            "--config".as_ref(),
            config.as_os_str(),
        ],
        vec![
            "quantize".as_ref(),
            "--model".as_ref(),
            fixture.as_os_str(),
            "--scheme".as_ref(),
            "int8-pc".as_ref(),
        ],
        vec!["import-gguf".as_ref(), gguf.as_os_str()],
    ];
    for args in runs {
        let err = error_of(qarl().args(&args).arg("--output").arg(&taken));
        assert!(err.contains("exists and is not empty"), "{args:?}: {err}");
        assert_eq!(
            std::fs::read(taken.join("model.safetensors")).unwrap(),
            b"someone's weights"
        );
        assert_eq!(std::fs::read_dir(&taken).unwrap().count(), 1, "{args:?}");
    }
    let err = error_of(
        qarl()
            .args(["init-model", "--config"])
            .arg(&config)
            .args(["--max-gb", "nan", "--output"])
            .arg(tmp.path().join("fresh")),
    );
    assert!(err.contains("--max-gb must be"), "{err}");
    let err = error_of(
        qarl()
            .args([
                "mismatch",
                "--model",
                "/nonexistent",
                "--data",
                "/nonexistent.jsonl",
            ])
            .args(["--output", "table.md"]),
    );
    assert!(err.contains("name it .json"), "{err}");
    let embedding = tmp.path().join("embedding");
    let err = error_of(
        qarl()
            .args(["quantize", "--model"])
            .arg(&fixture)
            .args([
                "--scheme",
                "int8-pc",
                "--include",
                "model.embed_tokens.weight",
            ])
            .arg("--output")
            .arg(&embedding),
    );
    assert!(err.contains("`model.embed_tokens.weight`"), "{err}");
    assert!(err.contains("not a linear layer's weight"), "{err}");
    assert!(!embedding.exists());
}

/// A `config.json` that says quantized over weights that are not (no `*.qweight`) is refused, not run
/// in full precision under the scheme's name.
#[test]
fn a_quantization_config_without_packed_weights_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures_dir().join("qwen3");
    let dir = tmp.path().join("claims_int4");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] =
        serde_json::json!({"quant_method": "qarl", "scheme": "int4-g32"});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = match qarl::model::Decoder::load(&dir, &burn::tensor::Device::flex()) {
        Ok(_) => panic!("a checkpoint without packed weights loaded as int4-g32"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("quantization_config") && err.contains("no `*.qweight` tensor"),
        "{err}"
    );
}

/// `qarl eval` refuses sizes that measure nothing (0 new tokens printed an accuracy of 0 with exit code
/// 0; batch 0 was taken as 1), before loading anything.
#[test]
fn eval_refuses_zero_new_tokens_and_batch() {
    for (flag, want) in [
        ("--max-new-tokens", "--max-new-tokens must be at least 1"),
        ("--batch", "--batch must be at least 1"),
    ] {
        let err = error_of(
            qarl()
                .args([
                    "eval",
                    "--model",
                    "/nonexistent",
                    "--data",
                    "/nonexistent.jsonl",
                ])
                .args([flag, "0"]),
        );
        assert!(err.contains(want), "{flag}: {err}");
    }
}

/// `qarl generate` refuses options it would ignore: sampling options beside `--greedy` (the output was
/// `--greedy`'s), a `--stop-id` outside the vocabulary (it never occurs), before or after loading the
/// model as each needs.
#[test]
fn generate_refuses_options_it_would_ignore() {
    let tmp = tempfile::tempdir().unwrap();
    let out_json = tmp.path().join("gen.json");
    let err = usage_error_of(
        qarl()
            .args([
                "generate",
                "--model",
                "/nonexistent",
                "--prompt",
                "1+1=",
                "--greedy",
            ])
            .args(["--temperature", "0.7"])
            .arg("--output")
            .arg(&out_json),
    );
    assert!(err.contains("--temperature"), "{err}");
    let dir = fixtures_dir().join("qwen3");
    let r = reference(&dir);
    let prompts = greedy_prompts_file(tmp.path(), &r);
    let err = error_of(
        qarl()
            .args(["generate", "--model"])
            .arg(&dir)
            .arg("--prompt-ids")
            .arg(&prompts)
            .args(["--greedy", "--max-new-tokens", "2", "--stop-id", "999999"])
            .arg("--output")
            .arg(&out_json),
    );
    assert!(
        err.contains("--stop-id 999999") && err.contains("vocabulary"),
        "{err}"
    );
    // Temperature 0 is `--greedy` by another name: top-p and top-k were ignored there too.
    for (flag, value) in [("--top-p", "0.5"), ("--top-k", "5")] {
        let err = error_of(
            qarl()
                .args(["generate", "--model"])
                .arg(&dir)
                .arg("--prompt-ids")
                .arg(&prompts)
                .args(["--temperature", "0", flag, value, "--max-new-tokens", "2"])
                .arg("--output")
                .arg(&out_json),
        );
        // Only the option given is named (the other's default was reported as if given).
        let named = format!("which takes no {}", &flag[2..].replace('-', "_"));
        assert!(
            err.contains(&named) && !err.contains(" or top_"),
            "{flag}: {err}"
        );
    }
    assert!(!out_json.exists());
}

/// A `--prompt-ids` file with the field under both its names, or under neither, is named as such (serde's
/// alias reported a "duplicate field `input_ids`" for a file that held it once).
#[test]
fn generate_names_a_prompt_file_with_both_or_no_ids_field() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (
            r#"{"input_ids": [[1, 2]], "prompt_ids": [[1, 2]]}"#,
            "has both `input_ids` and `prompt_ids`",
        ),
        (r#"{}"#, "no `input_ids` field (or `prompt_ids`)"),
    ];
    for (text, want) in cases {
        let prompts = tmp.path().join("prompts.json");
        std::fs::write(&prompts, text).unwrap();
        let err = error_of(
            qarl()
                .args(["generate", "--model"])
                .arg(fixtures_dir().join("qwen3"))
                .arg("--prompt-ids")
                .arg(&prompts)
                .arg("--output")
                .arg(tmp.path().join("out.json")),
        );
        assert!(err.contains("prompts.json") && err.contains(want), "{err}");
    }
    // Either name alone is read.
    std::fs::write(tmp.path().join("p.json"), r#"{"prompt_ids": [[1, 2]]}"#).unwrap();
    let ok = qarl()
        .args(["generate", "--greedy", "--max-new-tokens", "1", "--model"])
        .arg(fixtures_dir().join("qwen3"))
        .arg("--prompt-ids")
        .arg(tmp.path().join("p.json"))
        .arg("--output")
        .arg(tmp.path().join("out.json"))
        .output()
        .unwrap();
    assert!(ok.status.success(), "{ok:?}");
}

/// An output naming a file the command reads (its data, its ids, a file of its model directory) is refused
/// before any work, and the file stays as it was: results are written atomically over what is there.
#[test]
fn outputs_never_replace_what_the_command_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for entry in std::fs::read_dir(fixtures_dir().join("llama")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
    }
    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, r#"{"input_ids": [[1, 2, 3]]}"#).unwrap();
    let data = tmp.path().join("data.jsonl");
    std::fs::copy(fixtures_dir().join("../gsm8k_slice.jsonl"), &data).unwrap();
    let config = model.join("config.json");
    let shard = model.join("model-00002-of-00004.safetensors");
    let before: Vec<Vec<u8>> = [&ids, &data, &config, &shard]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    let (m, i, d) = (
        model.display().to_string(),
        ids.display().to_string(),
        data.display().to_string(),
    );
    let (c, s) = (config.display().to_string(), shard.display().to_string());
    for (args, replaced) in [
        (
            vec!["score", "--model", &m, "--input", &i, "--output", &i],
            &i,
        ),
        (
            vec!["score", "--model", &m, "--input", &i, "--output", &s],
            &s,
        ),
        (
            vec![
                "generate",
                "--model",
                &m,
                "--prompt-ids",
                &i,
                "--output",
                &c,
            ],
            &c,
        ),
        (
            vec!["eval", "--model", &m, "--data", &d, "--output", &d],
            &d,
        ),
        (
            vec!["mismatch", "--model", &m, "--data", &d, "--output", &c],
            &c,
        ),
        (vec!["bench", "rollout", "--model", &m, "--json", &c], &c),
    ] {
        let err = error_of(qarl().args(&args));
        assert!(
            err.contains(&format!("{replaced}: is also what this command reads")),
            "{args:?}: {err}"
        );
    }
    let after: Vec<Vec<u8>> = [&ids, &data, &config, &shard]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    assert_eq!(before, after);
}

/// `init-model` writes f32 weights: a quantized checkpoint's config (with `quantization_config`) is refused,
/// where it used to write a directory that no loader would take.
#[test]
fn init_model_refuses_a_quantized_checkpoints_config() {
    let tmp = tempfile::tempdir().unwrap();
    let quantized = tmp.path().join("q");
    let st = qarl()
        .args(["quantize", "--scheme", "int4-g32", "--model"])
        .arg(fixtures_dir().join("llama"))
        .arg("--output")
        .arg(&quantized)
        .status()
        .unwrap();
    assert!(st.success());
    let out = tmp.path().join("random");
    let err = error_of(
        qarl()
            .args(["init-model", "--config"])
            .arg(quantized.join("config.json"))
            .arg("--output")
            .arg(&out),
    );
    assert!(
        err.contains("has a `quantization_config` (int4-g32)") && err.contains("qarl quantize"),
        "{err}"
    );
    assert!(!out.join("model.safetensors").exists());
    // A standard deviation of 0 (all-zero matrices) is refused, as `model.init_std = 0` is.
    let err = error_of(
        qarl()
            .args(["init-model", "--std", "0", "--config"])
            .arg(fixtures_dir().join("llama").join("config.json"))
            .arg("--output")
            .arg(&out),
    );
    assert!(
        err.contains("standard deviation must be a number above 0"),
        "{err}"
    );
    assert!(!out.join("model.safetensors").exists());
    // Weights past the memory (a vocabulary of 2^31 - 1 rows of 128: about 1.1 TB of f32) are refused by
    // size, not met as an aborting allocation that left a partial folder.
    let mut big: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("configs/models/qwen3-moe-arith.json"),
        )
        .unwrap(),
    )
    .unwrap();
    big["vocab_size"] = serde_json::json!(2147483647u64);
    let big_path = tmp.path().join("big.json");
    std::fs::write(&big_path, big.to_string()).unwrap();
    let err = error_of(
        qarl()
            .args(["init-model", "--max-gb", "1e6", "--config"])
            .arg(&big_path)
            .arg("--output")
            .arg(&out),
    );
    assert!(
        err.contains("are built in memory before they are written"),
        "{err}"
    );
    assert!(!out.exists() || std::fs::read_dir(&out).unwrap().next().is_none());
}

/// Logits that overflow f16's range (a model whose activations grow past 65504) are reported with that
/// cause under `--activations f16`: the same model scores in bf16, so "its weights hold non-finite
/// values" alone pointed at the wrong thing.
#[test]
fn f16_overflow_is_named_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    let st = qarl()
        .args(["init-model", "--std", "300", "--config"])
        .arg(fixtures_dir().join("llama").join("config.json"))
        .arg("--output")
        .arg(&model)
        .status()
        .unwrap();
    assert!(st.success());
    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, r#"{"input_ids": [[1, 2, 3, 4]]}"#).unwrap();
    let score = |act: &str| {
        qarl()
            .args(["score", "--activations", act, "--model"])
            .arg(&model)
            .arg("--input")
            .arg(&ids)
            .arg("--output")
            .arg(tmp.path().join(format!("{act}.json")))
            .output()
            .unwrap()
    };
    let f16 = score("f16");
    let err = String::from_utf8_lossy(&f16.stderr);
    assert!(
        !f16.status.success() && err.contains("with f16 activations any value beyond 65504"),
        "{err}"
    );
    assert!(score("bf16").status.success());
}

/// Every checkpoint keeps the build that wrote it (`qarl --version`); a resume by another build says so,
/// since other code may sum or sample otherwise.
#[test]
fn a_resume_by_another_build_is_said() {
    let version = stdout_of(qarl().arg("--version"));
    let build = version.trim().strip_prefix("qarl ").unwrap().to_string();
    assert!(
        build.starts_with(env!("CARGO_PKG_VERSION")) && build.len() > 6,
        "{version}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let toml = tmp.path().join("tiny.toml");
    std::fs::write(&toml, common::tiny_train_toml(tmp.path(), "aligned", 1)).unwrap();
    let cfg =
        qarl::train::TrainConfig::from_toml(&std::fs::read_to_string(&toml).unwrap(), "t").unwrap();
    let train = |extra: &[&str]| {
        qarl()
            .args(["train", "--quiet", "--config"])
            .arg(&toml)
            .args(extra)
            .output()
            .unwrap()
    };
    assert!(train(&[]).status.success());
    let state = qarl::train::checkpoint::latest(&cfg.run_dir)
        .unwrap()
        .0
        .join("trainer_state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    assert!(text.contains(&format!("\"build\":\"{build}\"")), "{text}");
    std::fs::write(&state, text.replace(&build, "0.0.0+old")).unwrap();
    let out = train(&["--resume", "--set", "train.steps=2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && err.contains(&format!(
                "written by qarl 0.0.0+old, resumed by qarl {build}"
            )),
        "{err}"
    );
}

/// `qarl generate --stop-at-eos` stops at the end tokens training and evaluation stop at (here the char
/// tokenizer's `<eos>`, which config.json does not name): a row holding one ends with it, as a stop; without
/// a tokenizer and without config.json's ids nothing would stop a row, which is refused.
#[test]
fn generate_stops_at_the_end_tokens_of_training() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let init = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs/models/qwen3-moe-arith.json");
    qarl::model::init::write_random_checkpoint(&init, &model, 3, 1.0).unwrap();
    let config = model.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("eos_token_id");
    std::fs::write(&config, json.to_string()).unwrap();
    let output = tmp.path().join("gen.json");
    let generate = |model: &std::path::Path| {
        let mut cmd = qarl();
        cmd.args(["generate", "--stop-at-eos", "--temperature", "3"])
            .args(["--samples", "16", "--max-new-tokens", "100", "--seed", "5"])
            .arg("--model")
            .arg(model)
            .arg("--output")
            .arg(&output);
        cmd
    };
    // No tokenizer yet: config.json names no end token either.
    let prompts = tmp.path().join("prompts.json");
    std::fs::write(&prompts, r#"{"input_ids": [[5, 6, 7]]}"#).unwrap();
    let err = common::error_of(generate(&model).arg("--prompt-ids").arg(&prompts));
    assert!(err.contains("name no eos_token_id"), "{err}");
    // generation_config.json's end tokens stop rows without a tokenizer too (they were not read).
    let gen_config = model.join("generation_config.json");
    let eos = qarl::tasks::char_tokenizer::EOS_ID;
    std::fs::write(&gen_config, format!("{{\"eos_token_id\": [{eos}]}}")).unwrap();
    let v = run_qarl_json(generate(&model).arg("--prompt-ids").arg(&prompts), &output);
    let ids: Vec<Vec<u32>> = serde_json::from_value(v["ids"].clone()).unwrap();
    let reasons: Vec<String> = serde_json::from_value(v["finish_reasons"].clone()).unwrap();
    for (row, reason) in ids.iter().zip(&reasons) {
        let ended = row[3..].iter().position(|&t| t == eos);
        assert_eq!(ended.is_some(), reason == "stop", "{row:?} {reason}");
        if let Some(at) = ended {
            assert_eq!(at + 4, row.len(), "{row:?}: ran past its end token");
        }
    }
    assert!(reasons.iter().any(|r| r == "stop"), "{reasons:?}");
    std::fs::remove_file(&gen_config).unwrap();
    qarl::tasks::char_tokenizer::save(&model).unwrap();
    let v = run_qarl_json(generate(&model).args(["--prompt", "1+2="]), &output);
    let ids: Vec<Vec<u32>> = serde_json::from_value(v["ids"].clone()).unwrap();
    let reasons: Vec<String> = serde_json::from_value(v["finish_reasons"].clone()).unwrap();
    let mut stopped = 0;
    for (row, reason) in ids.iter().zip(&reasons) {
        match row.iter().position(|&t| t == eos) {
            Some(at) if at >= 4 => {
                assert_eq!(at, row.len() - 1, "tokens after <eos>: {row:?}");
                assert_eq!(reason, "stop");
                stopped += 1;
            }
            _ => assert_eq!(reason, "length", "{row:?}"),
        }
    }
    assert!(stopped > 0, "no row reached <eos> in 16 x 100 tokens");
}

/// A `model.dir` that records no warm start (the user's own model) is used as it is, and the recipe keys
/// that then do not run are named in a warning: the run's config.json records them as if they had run.
#[test]
fn an_unrecorded_model_dir_names_the_recipe_it_skips() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("run.toml");
    std::fs::write(&cfg, common::tiny_train_toml(tmp.path(), "aligned", 1)).unwrap();
    let made = qarl()
        .args(["train", "--quiet", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    std::fs::remove_file(tmp.path().join("model").join(qarl::train::MADE_BY_FILE)).unwrap();
    let again = qarl()
        .args(["train", "--quiet", "--config"])
        .arg(&cfg)
        .args([
            "--set",
            &format!("run_dir=\"{}\"", tmp.path().join("again").display()),
        ])
        .output()
        .unwrap();
    assert!(again.status.success(), "{again:?}");
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        stderr.contains("records no warm start")
            && stderr.contains("`model.init_config`, `model.init_std`, `[sft]` do not run"),
        "{stderr}"
    );
}

/// A task too small to hold any problem out is refused before anything runs: its evaluations would log an
/// accuracy of 0 over no problem (exit 0, listed as a finished run).
#[test]
fn a_task_that_holds_out_no_problem_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("run.toml");
    std::fs::write(&cfg, common::tiny_train_toml(tmp.path(), "aligned", 1)).unwrap();
    let err = error_of(qarl().args(["train", "--config"]).arg(&cfg).args([
        "--set",
        "task.min_terms=1",
        "--set",
        "task.max_terms=1",
    ]));
    assert!(
        err.contains("holds out no problem for the evaluations"),
        "{err}"
    );
    assert!(!tmp.path().join("model").exists(), "the warm start ran");
}

/// Real-number flags: a value that reads as 0 or infinity in f32 is refused (`--temperature 1e-50` decoded
/// greedily), and a negative one reaches the range check instead of clap's "unexpected argument '-1'".
#[test]
fn real_number_flags_refuse_underflow_and_name_the_range_of_negatives() {
    let model = common::fixtures_dir().join("qwen3");
    let out = tempfile::tempdir().unwrap();
    let generate = |flag: &str, value: &str| {
        usage_or_error(
            qarl()
                .args(["generate", "--prompt-ids", "1,2", "--model"])
                .arg(&model)
                .arg("--output")
                .arg(out.path().join("g.json"))
                .arg(flag)
                .arg(value),
        )
    };
    let err = generate("--temperature", "1e-50");
    assert!(err.contains("would read as 0"), "{err}");
    // Past f32's range: the text is named, not the `inf` it would read as.
    let err = generate("--temperature", "1e39");
    assert!(
        err.contains("`1e39` is too large for an f32") && !err.contains("got inf"),
        "{err}"
    );
    let err = generate("--temperature", "-1");
    assert!(
        err.contains("temperature must be 0") && !err.contains("unexpected argument"),
        "{err}"
    );
    let err = generate("--top-p", "-0.5");
    assert!(err.contains("top_p must be in (0, 1]"), "{err}");
}

/// The stderr of a command that must fail (a usage error or a refusal alike).
fn usage_or_error(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "it succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// An experiment file given to `qarl train` is named as one, with the command that runs it.
#[test]
fn an_experiment_file_given_to_train_points_at_qarl_experiment() {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/paper_mini.toml");
    let err = error_of(qarl().args(["train", "--config"]).arg(&file));
    assert!(
        err.contains("an experiment file") && err.contains("qarl experiment"),
        "{err}"
    );
}

/// The processes whose command line holds `needle` (Linux's /proc).
#[cfg(target_os = "linux")]
fn processes_with(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline)
                .contains(needle)
                .then_some(pid)
        })
        .collect()
}

/// A killed `qarl bench step` takes its variant's process with it: the child ran on under PID 1 (a warm start
/// of minutes) and a bench under `timeout` left it behind.
#[cfg(target_os = "linux")]
#[test]
fn a_killed_bench_step_stops_its_variant_process() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("run.toml");
    let text = common::tiny_train_toml(tmp.path(), "aligned", 1)
        .replace("[sft]\nsteps = 8", "[sft]\nsteps = 1000000");
    assert!(text.contains("steps = 1000000"), "{text}");
    std::fs::write(&cfg, text).unwrap();
    let mut parent = qarl()
        .args(["bench", "step", "--quiet", "--steps", "1", "--config"])
        .arg(&cfg)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let needle = "--variant-child";
    let config = cfg.display().to_string();
    let children = || -> Vec<u32> {
        processes_with(&config)
            .into_iter()
            .filter(|&p| processes_with(needle).contains(&p))
            .collect()
    };
    let wait_for = |want: bool| {
        (0..300).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(100));
            children().is_empty() != want
        })
    };
    assert!(wait_for(true), "no variant process started");
    parent.kill().unwrap();
    parent.wait().unwrap();
    assert!(
        wait_for(false),
        "the variant process outlived its parent: {:?}",
        children()
    );
}

/// `QARL_FONT` naming no file is an error that says so, not a silent fall-back to another font.
#[test]
fn a_missing_qarl_font_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("metrics.jsonl"),
        "{\"phase\":\"rl\",\"step\":0,\"critic/rewards/mean\":0.5}\n",
    )
    .unwrap();
    let err = error_of(
        qarl()
            .env("QARL_FONT", "/nonexistent/font.ttf")
            .arg("plot")
            .arg(tmp.path()),
    );
    assert!(
        err.contains("QARL_FONT=/nonexistent/font.ttf: no such file"),
        "{err}"
    );
}

/// A held-out question too long for the model's positions is named by its file, line and start, not only
/// by the flags whose sizes it exceeds.
#[test]
fn eval_and_mismatch_name_the_question_too_long_for_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::arith_model(&model, 7, 0.02);
    let data = tmp.path().join("problems.jsonl");
    let long = format!("{}?", "1+".repeat(300));
    std::fs::write(
        &data,
        format!(
            "{}\n{}\n",
            serde_json::json!({"question": "1+2?", "answer": "#### 3"}),
            serde_json::json!({"question": long, "answer": "#### 3"})
        ),
    )
    .unwrap();
    for cmd in ["eval", "mismatch"] {
        let err = error_of(
            qarl()
                .args([cmd, "--template", "plain", "--model"])
                .arg(&model)
                .arg("--data")
                .arg(&data)
                .args(["--max-new-tokens", "4"]),
        );
        assert!(
            err.contains("problems.jsonl: line 2: the question \"1+1+")
                && err.contains("max_position_embeddings (256)"),
            "{cmd}: {err}"
        );
    }
    // generate names the prompt (its file and index), which the flags in the message did not say.
    let ids = tmp.path().join("prompts.json");
    let prompts = serde_json::json!({"input_ids": [[1, 2], vec![1; 300]]});
    std::fs::write(&ids, prompts.to_string()).unwrap();
    let err = error_of(
        qarl()
            .arg("generate")
            .arg("--model")
            .arg(&model)
            .arg("--prompt-ids")
            .arg(&ids)
            .args(["--max-new-tokens", "4", "--output"])
            .arg(tmp.path().join("out.json")),
    );
    assert!(
        err.contains("prompts.json: input_ids[1]: ")
            && err.contains("max_position_embeddings (256)"),
        "generate: {err}"
    );
}

/// Output into a pipe that closed ends the process as Unix tools end (SIGPIPE), not with a panic, a
/// backtrace and exit 101 (`qarl runs | head -1` did about one time in three).
#[cfg(unix)]
#[test]
fn a_closed_output_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    // The reading end is closed before the child starts, so its first print meets a closed pipe (closed
    // after the spawn, a fast child could print everything into the pipe's buffer first and exit 0).
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = qarl()
        .args(["config", "show", "default"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.signal(), Some(13), "{:?}: {stderr}", out.status);
}

/// An experiment on a backend this build cannot run is refused before its results directory is claimed
/// (it wrote `experiment.json` first, then reported no runs).
#[cfg(not(feature = "wgpu"))]
#[test]
fn an_experiment_on_a_backend_not_built_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (exp, results) = tiny_experiment(tmp.path(), "seeds = [1]\n[[variant]]\nname = \"a\"\n");
    let err = error_of(
        qarl()
            .arg("experiment")
            .arg(&exp)
            .args(["--quiet", "--backend", "wgpu"]),
    );
    assert!(err.contains("exp.toml") && err.contains("wgpu"), "{err}");
    assert!(!results.exists(), "{} was made", results.display());
}

/// A tiny experiment in `dir`: `base.toml` (the tiny training config, one RL step) and `exp.toml` naming
/// it, with `body` (seeds and variants) after its results directory; returns (`exp.toml`, results dir).
fn tiny_experiment(dir: &std::path::Path, body: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    std::fs::write(
        dir.join("base.toml"),
        common::tiny_train_toml(dir, "aligned", 1),
    )
    .unwrap();
    let exp = dir.join("exp.toml");
    let results = dir.join("results");
    std::fs::write(
        &exp,
        format!(
            "name = \"e\"\nbase = \"base.toml\"\nresults_dir = {:?}\n{body}",
            results.display().to_string()
        ),
    )
    .unwrap();
    (exp, results)
}
