//! The tokens that end a model's answer, read once from the model's files: what a warm-start example ends
//! with, and where the RL rollouts, their evaluations, `qarl eval` and `qarl mismatch` stop sampling. One
//! home, so that a run's training and its evaluation stop at the same tokens, and those are the ones the
//! model's own files name, as transformers' `generate` and vLLM read them.

use std::path::Path;

use anyhow::Context;
use serde_json::Value;

use super::{ModelConfig, Tokenizer};

/// Tokens that end a text or a turn under their usual names, tried in this order for the token a training
/// example ends with ([`EndTokens::primary`]) where `tokenizer_config.json` names none.
const END_NAMES: [&str; 3] = ["<eos>", "<|im_end|>", "<|endoftext|>"];

/// The end-of-sequence tokens of a model with a tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndTokens {
    primary: u32,
    stops: Vec<u32>,
}

impl EndTokens {
    /// The end tokens of `tok`'s model (config `config`), from the files beside its `tokenizer.json`:
    ///
    /// - the primary one: `tokenizer_config.json`'s `eos_token` (what transformers' `tokenizer.eos_token`
    ///   and TRL's supervised trainer end an example with: a base model's `<|endoftext|>`, where
    ///   `<|im_end|>` would teach it to end its text with a token transformers' `generate` does not stop
    ///   at), else the tokenizer's `<eos>`, `<|im_end|>` or `<|endoftext|>`, else config.json's first
    ///   `eos_token_id`;
    /// - the stops: the primary one, the first of those usual names the tokenizer has, every
    ///   `eos_token_id` of config.json and of `generation_config.json`, and `tokenizer_config.json`'s
    ///   `eos_token`, each once.
    ///
    /// A chat model's turn end and its base model's text end are often two tokens (Qwen3: `<|im_end|>` and
    /// `<|endoftext|>`, both in its generation_config.json); stopping at only the first let a base model
    /// trained with the chat template run on past its answer to `max_new_tokens`. A stop list that cannot
    /// be read, or that names a token the model does not have, is an error naming the file.
    pub fn of(tok: &Tokenizer, config: &ModelConfig) -> anyhow::Result<Self> {
        let dir = tok.dir();
        let named_eos = tokenizer_config_eos(&dir.join("tokenizer_config.json"), tok)?;
        let by_name = END_NAMES.iter().find_map(|name| tok.token_to_id(name));
        let primary = named_eos
            .or(by_name)
            .or_else(|| config.eos_token_ids.first().copied())
            .context(
                "the tokenizer has no end-of-sequence token (<eos>, <|im_end|>, <|endoftext|>) and \
                 config.json no eos_token_id",
            )?;
        let mut stops = vec![primary];
        let listed = by_name
            .into_iter()
            .chain(Self::ids_without_tokenizer(dir, config)?)
            .chain(named_eos);
        for id in listed {
            if !stops.contains(&id) {
                stops.push(id);
            }
        }
        Ok(Self { primary, stops })
    }

    /// The end-token ids a model in `dir` without a tokenizer names: config.json's `eos_token_id`s and
    /// `generation_config.json`'s, each once (what `qarl generate --stop-at-eos` stops at on token ids; the
    /// second file was not read, and a row ran past an end token transformers stops at).
    pub fn ids_without_tokenizer(dir: &Path, config: &ModelConfig) -> anyhow::Result<Vec<u32>> {
        let mut ids: Vec<u32> = Vec::new();
        let listed = config
            .eos_token_ids
            .iter()
            .copied()
            .chain(generation_config_eos(
                &dir.join("generation_config.json"),
                config.vocab_size,
            )?);
        for id in listed {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        Ok(ids)
    }

    /// These end tokens and, as stops, each of `turn_ends` that is one token of `tok`: a chat template's
    /// turn end (`<|eot_id|>`, `<end_of_turn>`), which a warm start under that template teaches the model
    /// to end its answer with, while a base model's files may name only its text end (Llama-3 base:
    /// `<|end_of_text|>`; Gemma-2 base: `<eos>`), so rollouts ran on past the closed turn. Only special
    /// tokens (left out of the text a verifier reads): a turn closed by plain text, or by several tokens,
    /// stays a stop string.
    pub fn with_turn_ends(mut self, tok: &Tokenizer, turn_ends: &[String]) -> Self {
        let special = |&id: &u32| {
            tok.decode_without_special(&[id])
                .is_ok_and(|t| t.is_empty())
        };
        for id in turn_ends
            .iter()
            .filter_map(|s| tok.token_to_id(s))
            .filter(special)
        {
            if !self.stops.contains(&id) {
                self.stops.push(id);
            }
        }
        self
    }

    /// The token a training example ends with (and the first stop).
    pub fn primary(&self) -> u32 {
        self.primary
    }

    /// Every token at which sampling stops.
    pub fn stops(&self) -> &[u32] {
        &self.stops
    }

    /// `strings` without those that are the text of one of the stop tokens (a chat template's turn end,
    /// `<|im_end|>`, is usually one): sampling stops at the token before its text could match, so the
    /// string adds nothing, and two evaluations that stopped at the same tokens record the same strings.
    pub fn beyond_stops(&self, tok: &Tokenizer, strings: Vec<String>) -> Vec<String> {
        let texts: Vec<String> = self
            .stops
            .iter()
            .filter_map(|&id| tok.decode(&[id]).ok())
            .collect();
        strings.into_iter().filter(|s| !texts.contains(s)).collect()
    }

    /// `response` without its last token when that is a stop (the text the verifier reads).
    pub fn strip<'a>(&self, response: &'a [u32]) -> &'a [u32] {
        match response.split_last() {
            Some((last, rest)) if self.stops.contains(last) => rest,
            _ => response,
        }
    }
}

/// The `eos_token_id` of a `generation_config.json` (a token id, a list of them, or none): nothing when the
/// file is absent; each id must be below `vocab_size` (read as config.json's own).
fn generation_config_eos(path: &Path, vocab_size: usize) -> anyhow::Result<Vec<u32>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let doc: Value = crate::io::read_json(path)?;
    Ok(super::config::special_token_ids(
        &doc,
        path,
        "eos_token_id",
        vocab_size,
    )?)
}

/// The id of a `tokenizer_config.json`'s `eos_token` (a string, or an object with its `content`): nothing
/// when the file or the key is absent; the token must be in the tokenizer's vocabulary.
fn tokenizer_config_eos(path: &Path, tok: &Tokenizer) -> anyhow::Result<Option<u32>> {
    if !path.exists() {
        return Ok(None);
    }
    let doc: Value = crate::io::read_json(path)?;
    if !doc.is_object() {
        anyhow::bail!("{}: the top level must be a JSON object", path.display());
    }
    let token = match doc.get("eos_token") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => s.as_str(),
            _ => anyhow::bail!("{}: `eos_token` has no `content` string", path.display()),
        },
        Some(v) => anyhow::bail!(
            "{}: `eos_token` must be a string, found {v}",
            path.display()
        ),
    };
    match tok.token_to_id(token) {
        Some(id) => Ok(Some(id)),
        None => anyhow::bail!(
            "{}: `eos_token` {token:?} is not a token of {}",
            path.display(),
            tok.path().display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::char_tokenizer;

    /// The character tokenizer's model (`<eos>` = 1) in a fresh folder, with `config.json`'s eos ids.
    fn model_dir(eos: &[u32]) -> (tempfile::TempDir, ModelConfig) {
        let dir = tempfile::tempdir().unwrap();
        char_tokenizer::save(dir.path()).unwrap();
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("configs/models/qwen3-moe-arith.json");
        let mut config = ModelConfig::from_file(&path).unwrap();
        config.eos_token_ids = eos.to_vec();
        (dir, config)
    }

    fn end_tokens(dir: &Path, config: &ModelConfig) -> anyhow::Result<EndTokens> {
        let tok = Tokenizer::load_for(dir, config).unwrap().unwrap();
        EndTokens::of(&tok, config)
    }

    /// The stops gather config.json's, generation_config.json's and tokenizer_config.json's end tokens
    /// after the primary one, each once; `strip` removes a final stop only.
    #[test]
    fn stops_are_every_end_token_the_model_files_name() {
        let (dir, config) = model_dir(&[1, 7]);
        let only = end_tokens(dir.path(), &config).unwrap();
        assert_eq!(only.primary(), char_tokenizer::EOS_ID);
        assert_eq!(only.stops(), &[1, 7]);
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [7, 9, 1]}"#,
        )
        .unwrap();
        let end = end_tokens(dir.path(), &config).unwrap();
        assert_eq!(end.stops(), &[1, 7, 9]);
        assert_eq!(end.strip(&[5, 6, 9]), &[5, 6]);
        assert_eq!(end.strip(&[5, 6, 1]), &[5, 6]);
        assert_eq!(end.strip(&[5, 6]), &[5, 6]);
        assert_eq!(end.strip(&[]), &[] as &[u32]);
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": 11}"#,
        )
        .unwrap();
        assert_eq!(
            end_tokens(dir.path(), &config).unwrap().stops(),
            &[1, 7, 11]
        );
    }

    /// `tokenizer_config.json`'s `eos_token` comes first: a base model whose tokenizer also has a chat turn's
    /// end (SmolLM2, Qwen2.5: `<|im_end|>` beside `<|endoftext|>`) ends its examples with its own end
    /// token, as TRL's trainer does, not with the first of the usual names the tokenizer has.
    #[test]
    fn the_primary_token_is_the_tokenizer_configs_eos() {
        // config.json lists no end token: `<eos>` (1) stays a stop by its name alone (a base model trained
        // on ChatML still stops at its turn's end).
        let (dir, config) = model_dir(&[]);
        let cfg_path = dir.path().join("tokenizer_config.json");
        let mut doc: Value = crate::io::read_json(&cfg_path).unwrap();
        // `<pad>` (0) stands for the base model's own end token beside `<eos>`.
        doc["eos_token"] = "<pad>".into();
        std::fs::write(&cfg_path, doc.to_string()).unwrap();
        let end = end_tokens(dir.path(), &config).unwrap();
        assert_eq!(end.primary(), 0);
        assert_eq!(end.stops(), &[0, 1]);
    }

    /// Without any end token by name the primary one is config.json's first; with none at all, an error.
    #[test]
    fn the_primary_token_falls_back_to_config_json() {
        let (dir, config) = model_dir(&[]);
        let text = std::fs::read_to_string(dir.path().join("tokenizer.json")).unwrap();
        std::fs::write(
            dir.path().join("tokenizer.json"),
            text.replace("\"<eos>\"", "\"<end>\""),
        )
        .unwrap();
        std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
        let err = end_tokens(dir.path(), &config).unwrap_err().to_string();
        assert!(err.contains("no end-of-sequence token"), "{err}");
        let mut config = config;
        config.eos_token_ids = vec![1];
        assert_eq!(end_tokens(dir.path(), &config).unwrap().primary(), 1);
    }

    /// An end token list that names no token of the model, or is not one, is an error naming the file.
    #[test]
    fn bad_end_token_lists_are_refused_by_file() {
        let (dir, config) = model_dir(&[1]);
        let generation = dir.path().join("generation_config.json");
        for (text, want) in [
            (
                r#"{"eos_token_id": 100}"#,
                "`eos_token_id` must be a token id below vocab_size (100), found 100",
            ),
            (
                r#"{"eos_token_id": "2"}"#,
                "`eos_token_id` must be a token id or a list of ids, found \"2\"",
            ),
            (
                r#"{"eos_token_id": [1, -3]}"#,
                "`eos_token_id` must be a token id or a list of ids, found -3",
            ),
            ("{", "generation_config.json"),
        ] {
            std::fs::write(&generation, text).unwrap();
            let err = format!("{:#}", end_tokens(dir.path(), &config).unwrap_err());
            assert!(
                err.contains("generation_config.json") && err.contains(want),
                "{err}"
            );
        }
        std::fs::remove_file(&generation).unwrap();
        let tokenizer_config = dir.path().join("tokenizer_config.json");
        std::fs::write(&tokenizer_config, r#"{"eos_token": "<|im_end|>"}"#).unwrap();
        let err = format!("{:#}", end_tokens(dir.path(), &config).unwrap_err());
        assert!(
            err.contains("tokenizer_config.json") && err.contains("\"<|im_end|>\" is not a token"),
            "{err}"
        );
        std::fs::write(&tokenizer_config, r#"{"eos_token": {"content": "<eos>"}}"#).unwrap();
        assert_eq!(end_tokens(dir.path(), &config).unwrap().stops(), &[1]);
    }

    /// A chat template's turn end that is one special token becomes a stop; a plain character or a string
    /// of several tokens does not.
    #[test]
    fn a_turn_end_of_one_special_token_is_a_stop() {
        let (dir, config) = model_dir(&[]);
        let end = end_tokens(dir.path(), &config).unwrap();
        assert_eq!(end.stops(), &[1]);
        let tok = Tokenizer::load_for(dir.path(), &config).unwrap().unwrap();
        assert!(tok.token_to_id("a").is_some());
        let turn_ends = ["<pad>", "a", "\nQuestion:", "<eos>"].map(String::from);
        let end = end.with_turn_ends(&tok, &turn_ends);
        assert_eq!(end.stops(), &[1, 0]);
        assert_eq!(end.primary(), 1);
    }
}
