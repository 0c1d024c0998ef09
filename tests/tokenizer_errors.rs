//! A `tokenizer.json` the tokenizers library cannot use is reported with the problem by name (its own
//! message for these is about "untagged enum" variants).

use qarl::model::Tokenizer;

fn load_err(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), text).unwrap();
    match Tokenizer::load_optional(dir.path()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{text} was accepted"),
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
