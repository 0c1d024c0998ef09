//! A character-level tokenizer for the synthetic task, saved as a Hugging Face `tokenizer.json` (loadable by
//! the `tokenizers` crate and by transformers' `PreTrainedTokenizerFast`).
//!
//! Vocabulary (fixed, [`VOCAB_SIZE`] = 100 ids): `<pad>` = 0, `<eos>` = 1, `<bos>` = 2, `<unk>` = 3, `\n` = 4,
//! then the printable ASCII characters from space (5) to `~` (99) in code-point order. Any ASCII text (the
//! arithmetic prompts and solutions, the plain template) is therefore covered; a text with other characters is
//! refused by [`crate::model::Tokenizer::encode`], naming them (the vocabulary maps them to `<unk>`).
//!
//! The model is `WordLevel` behind a `Split` pre-tokenizer that isolates every character, with the `Fuse`
//! decoder, so decoding concatenates the characters exactly (no spaces added): `decode(encode(t)) == t`.

use std::path::{Path, PathBuf};

/// Id of `<pad>`.
pub const PAD_ID: u32 = 0;
/// Id of `<eos>`.
pub const EOS_ID: u32 = 1;
/// Id of `<bos>`.
pub const BOS_ID: u32 = 2;
/// Id of `<unk>`.
pub const UNK_ID: u32 = 3;
/// Number of ids.
pub const VOCAB_SIZE: usize = 100;

pub const PAD_TOKEN: &str = "<pad>";
pub const EOS_TOKEN: &str = "<eos>";
pub const BOS_TOKEN: &str = "<bos>";
pub const UNK_TOKEN: &str = "<unk>";

/// The vocabulary in id order (see the module documentation).
pub fn char_vocab() -> Vec<String> {
    let mut v: Vec<String> = [PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push("\n".into());
    v.extend((b' '..=b'~').map(|b| (b as char).to_string()));
    v
}

/// The `tokenizer.json` document.
pub fn tokenizer_json() -> serde_json::Value {
    let vocab = char_vocab();
    let added: Vec<serde_json::Value> = vocab[..4]
        .iter()
        .enumerate()
        .map(|(id, t)| {
            serde_json::json!({
                "id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true
            })
        })
        .collect();
    let map: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), serde_json::Value::from(id)))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": { "Regex": "[\\s\\S]" },
            "behavior": "Isolated",
            "invert": false
        },
        "post_processor": null,
        "decoder": { "type": "Fuse" },
        "model": { "type": "WordLevel", "vocab": map, "unk_token": UNK_TOKEN }
    })
}

/// The tokenizer.
pub fn build() -> tokenizers::Tokenizer {
    let text = tokenizer_json().to_string();
    // The document is fixed and covered by the tests.
    text.parse::<tokenizers::Tokenizer>()
        .expect("the character tokenizer's fixed tokenizer.json parses")
}

/// The `tokenizer_config.json` document (eos/pad/bos/unk tokens, no BOS added).
pub fn tokenizer_config_json() -> serde_json::Value {
    serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": false,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 1_000_000
    })
}

/// Writing the tokenizer files failed; the message names the file. The underlying error is part of the
/// message, not a `source` (anyhow's `{:#}` would print it twice).
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("cannot create {path}: {io}")]
    CreateDir { path: PathBuf, io: std::io::Error },
    #[error("cannot write {path}: {io}")]
    Write { path: PathBuf, io: std::io::Error },
    #[error("cannot write {path}: {error}")]
    Tokenizer {
        path: PathBuf,
        error: tokenizers::Error,
    },
}

/// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (created if needed).
pub fn save(dir: impl AsRef<Path>) -> Result<(), SaveError> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|io| SaveError::CreateDir {
        path: dir.to_path_buf(),
        io,
    })?;
    let tok_path = dir.join("tokenizer.json");
    build()
        .save(&tok_path, true)
        .map_err(|error| SaveError::Tokenizer {
            path: tok_path,
            error,
        })?;
    let cfg_path = dir.join("tokenizer_config.json");
    // A `serde_json::Value` always serializes (its map keys are strings).
    let text =
        serde_json::to_string_pretty(&tokenizer_config_json()).expect("a JSON value serializes");
    std::fs::write(&cfg_path, text + "\n").map_err(|io| SaveError::Write { path: cfg_path, io })
}
