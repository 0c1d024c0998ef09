//! A `tokenizer.json` the tokenizers library cannot use is reported with the problem by name (its own
//! message for these is about "untagged enum" variants), and `tokenizer_config.json`'s
//! `added_tokens_decoder` is applied as transformers applies it, or refused where transformers would put a
//! token under another id than the config says.

mod common;

use qarl::model::Tokenizer;

fn load_err(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), text).unwrap();
    dir_err(dir.path())
}

fn dir_err(dir: &std::path::Path) -> String {
    match Tokenizer::load_optional(dir) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{} was accepted", dir.display()),
    }
}

#[test]
fn tokenizer_json_problems_are_named() {
    for (text, want) in [
        ("[1, 2]", "not a JSON object"),
        (r#"{"version": "1.0"}"#, "no `model` object"),
        (r#"{"model": "BPE"}"#, "no `model` object"),
        (
            r#"{"model": {"type": "Bpe", "vocab": {}}}"#,
            "`model.type` is `Bpe`; supported: BPE",
        ),
        ("{\"model\": ", "not valid JSON"),
    ] {
        let err = load_err(text);
        assert!(
            err.contains("tokenizer.json") && err.contains(want),
            "{text}: {err}"
        );
    }
}

/// A `tokenizer.json` that is not a file is named as such, not reported missing ("no tokenizer.json");
/// a directory without one has none.
#[test]
fn a_tokenizer_json_that_is_no_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    assert!(Tokenizer::load_optional(dir.path()).unwrap().is_none());
    let path = dir.path().join("tokenizer.json");
    std::fs::create_dir(&path).unwrap();
    let err = dir_err(dir.path());
    assert_eq!(
        err,
        format!(
            "{}: is a directory, where a file was expected",
            path.display()
        )
    );
    std::fs::remove_dir(&path).unwrap();
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(dir.path().join("absent"), &path).unwrap();
        let err = dir_err(dir.path());
        assert!(
            err.ends_with("tokenizer.json: is a link to nothing, where a file was expected"),
            "{err}"
        );
    }
}

/// A `tokenizer.json` whose vocabulary has no token for a prompt's text encodes it to nothing; that used to
/// reach the user as "row 0 is empty" (the prompt was not) or an empty training sequence. The error names the
/// tokenizer file and the text.
#[test]
fn text_that_encodes_to_no_tokens_names_the_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen3");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), model.join(f)).unwrap();
    }
    std::fs::write(
        model.join("tokenizer.json"),
        r#"{"model": {"type": "BPE", "vocab": {}, "merges": []}}"#,
    )
    .unwrap();
    let tok = Tokenizer::load_optional(&model).unwrap().unwrap();
    let err = tok.encode("1+1").unwrap_err().to_string();
    assert!(
        err.contains("m/tokenizer.json") && err.contains("\"1+1\" to no tokens"),
        "{err}"
    );
    assert_eq!(tok.encode("").unwrap(), Vec::<u32>::new());

    let out_file = dir.path().join("gen.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_qarl"))
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--prompt", "1+1", "--max-new-tokens", "2", "--output"])
        .arg(&out_file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("tokenizer.json") && err.contains("to no tokens") && !err.contains("is empty"),
        "{err}"
    );
    assert!(!out_file.exists());

    // A vocabulary that covers the text still encodes it.
    let chars = dir.path().join("chars");
    qarl::tasks::char_tokenizer::save(&chars).unwrap();
    let tok = Tokenizer::load_optional(&chars).unwrap().unwrap();
    assert_eq!(tok.encode("1+1").unwrap().len(), 3);
}

/// A tokenizer with ids past the model's embedding is refused when it is paired with the model (the ids
/// would index past the embedding in the middle of a run), naming the token, its id and both files;
/// `qarl eval` says so instead of panicking.
#[test]
fn a_tokenizer_with_ids_beyond_the_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::copy_model(&common::fixtures_dir().join("qwen3"), &model);
    qarl::tasks::char_tokenizer::save(&model).unwrap();
    let fixture = qarl::model::ModelConfig::from_file(&model).unwrap();
    let chars = qarl::tasks::char_tokenizer::VOCAB_SIZE;
    assert!(Tokenizer::load_for(&model, &fixture).unwrap().is_some());
    let small = qarl::model::ModelConfig {
        vocab_size: chars - 1,
        ..fixture
    };
    let err = match Tokenizer::load_for(&model, &small) {
        Err(e) => e.to_string(),
        Ok(_) => panic!(
            "a tokenizer of {chars} ids was paired with a vocabulary of {}",
            chars - 1
        ),
    };
    assert!(
        err.contains("tokenizer.json")
            && err.contains(&format!("has id {}", chars - 1))
            && err.contains(&format!("`vocab_size` is {}", chars - 1)),
        "{err}"
    );
    // The same pair on the command line: the model's config.json shrunk to the tokenizer's size less one.
    let config = model.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["vocab_size"] = serde_json::json!(chars - 1);
    let shrunk = dir.path().join("shrunk");
    common::copy_model(&model, &shrunk);
    std::fs::write(shrunk.join("config.json"), json.to_string()).unwrap();
    let weights = common::read_tensors(&shrunk.join("model.safetensors"));
    let cut: std::collections::BTreeMap<_, _> = weights
        .into_iter()
        .map(|(name, (dtype, shape, bytes))| {
            if name.contains("embed_tokens") || name.contains("lm_head") {
                let row = bytes.len() / shape[0];
                let kept = (chars - 1) * row;
                (
                    name,
                    (dtype, vec![chars - 1, shape[1]], bytes[..kept].to_vec()),
                )
            } else {
                (name, (dtype, shape, bytes))
            }
        })
        .collect();
    common::write_tensors(&shrunk.join("model.safetensors"), &cut);
    let err = common::error_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_qarl"))
            .args(["eval", "--template", "plain", "--limit", "1", "--model"])
            .arg(&shrunk)
            .arg("--data")
            .arg(common::fixtures_dir().join("../gsm8k_slice.jsonl")),
    );
    assert!(err.contains("has id") && !err.contains("panicked"), "{err}");
}

/// A prompt that encodes to no token (an empty question under a template with empty prefixes) is refused,
/// naming it: the rollout starts from a prompt's last token, and an empty one underflowed there.
#[test]
fn an_empty_prompt_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    qarl::tasks::char_tokenizer::save(dir.path()).unwrap();
    let tok = Tokenizer::load_optional(dir.path()).unwrap().unwrap();
    let err = tok.encode_prompt("", true).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json: the prompt \"\" encodes to no tokens"),
        "{err}"
    );
    assert!(!tok.encode_prompt("1+2=", true).unwrap().is_empty());
    assert!(
        tok.encode("").unwrap().is_empty(),
        "plain encoding of nothing is allowed"
    );
}

/// Each case of `tests/fixtures/tokenizer_config/expected.json` (written by `make_fixtures.py` there with
/// transformers): the same ids for every text and the same text decoded without special tokens, or, where
/// transformers gives a token the config names another id than the config's, an error naming both.
#[test]
fn added_tokens_decoder_applies_as_in_transformers() {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer_config");
    let text = std::fs::read_to_string(fixtures.join("expected.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let mut refused = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            fixtures.join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        let config = serde_json::to_string(&case["config"]).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
        let decoder = case["config"]["added_tokens_decoder"].as_object();
        // The ids the config gives against the ones transformers gave.
        let moved = decoder.into_iter().flatten().find(|(id, entry)| {
            let content = entry["content"].as_str().unwrap();
            case["ids_given"][content].as_u64().unwrap().to_string() != **id
        });
        if let Some((id, entry)) = moved {
            let content = entry["content"].as_str().unwrap();
            let err = dir_err(dir.path());
            let given = case["ids_given"][content].as_u64().unwrap();
            assert!(err.contains("tokenizer_config.json"), "{name}: {err}");
            assert!(
                err.contains(&format!("names id {id} `{content}`")),
                "{name}: {err}"
            );
            if case["name"] == "gap_before_new" {
                assert!(
                    err.contains(&format!("give it id {given}")),
                    "{name}: {err}"
                );
            }
            refused += 1;
            continue;
        }
        let tok = Tokenizer::load_optional(dir.path()).unwrap().unwrap();
        for row in case["texts"].as_array().unwrap() {
            let text = row["text"].as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(row["ids"].clone()).unwrap();
            let ids = tok.encode(text).unwrap();
            assert_eq!(ids, want, "{name}: ids of {text:?}");
            let without = tok.decode_without_special(&ids).unwrap();
            assert_eq!(without, row["without_special"], "{name}: {text:?} decoded");
        }
    }
    assert_eq!(refused, 2, "the two cases transformers moves are refused");
}
