//! The model's Hugging Face `tokenizer.json`, when it has one. A model directory without one still works
//! on token ids.

use std::path::{Path, PathBuf};

use super::error::LoadError;
use crate::tasks::template::Template;

mod config_tokens;

/// A loaded HF tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The `tokenizer.json` it was read from (named in encoding errors).
    path: PathBuf,
    /// The id and text of the vocabulary's unknown token, where it has one: a text it encodes to that
    /// id (for characters outside the vocabulary) is refused, not read as `<unk>` (byte-level BPE
    /// vocabularies, Qwen's, Llama's and SmolLM2's, have none and encode every text).
    unknown: Option<(u32, String)>,
}

/// Whether transformers 5.25 rebuilds a tokenizer of `class` (tokenizer_config.json) for a model of
/// `model_type` (config.json; `None` without one) instead of using `tokenizer_json` as written: a
/// non-byte-level Llama-class tokenizer of a `llama` model (other model types, Phi-3's or Mistral's, map
/// to the file as written).
fn transformers_5_rebuilds(class: &str, model_type: Option<&str>, tokenizer_json: &str) -> bool {
    let llama_class = ["LlamaTokenizer", "CodeLlamaTokenizer"]
        .contains(&class.strip_suffix("Fast").unwrap_or(class));
    llama_class
        && model_type.is_none_or(|t| t == "llama")
        && !tokenizer_json.contains("\"ByteLevel\"")
}

/// The JSON file `name` of `dir`, `None` where it is missing or not JSON (its own readers report that).
fn read_json_in(dir: &Path, name: &str) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
}

/// Warns where transformers 5 would not use `tokenizer.json` as written: it rebuilds a SentencePiece
/// `LlamaTokenizer` / `CodeLlamaTokenizer` of a `llama` model (no normalizer, its own Metaspace
/// pre-tokenizer), so text after a special token or starting with a space gets other ids there (Llama-2
/// chat prompts: `<s>[INST]` is `[` there, `▁[` here). qarl encodes with the file, as transformers 4.x and
/// vLLM on it do; the warning says which side a comparison with transformers 5 stands on.
fn warn_if_rebuilt_by_transformers_5(
    dir: &Path,
    tokenizer_config: Option<&serde_json::Value>,
    tokenizer_json: &str,
) {
    let class = tokenizer_config
        .and_then(|c| c["tokenizer_class"].as_str())
        .unwrap_or_default();
    let model_type =
        read_json_in(dir, "config.json").and_then(|c| c["model_type"].as_str().map(str::to_string));
    if transformers_5_rebuilds(class, model_type.as_deref(), tokenizer_json) {
        tracing::warn!(
            "{}: a SentencePiece {class}, which transformers 5 rebuilds (no normalizer, its own Metaspace \
             pre-tokenizer) where transformers 4 and qarl use tokenizer.json as written: text after a special \
             token or starting with a space is encoded to other ids there",
            dir.display()
        );
    }
}

impl Tokenizer {
    /// `Ok(None)` when the directory has no `tokenizer.json`.
    pub fn load_optional(dir: impl AsRef<Path>) -> Result<Option<Self>, LoadError> {
        let path = dir.as_ref().join("tokenizer.json");
        match crate::io::optional_file(&path) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(what) => return Err(LoadError::NotAFile { path, what }),
        }
        let err = |msg: String| LoadError::Tokenizer {
            path: path.clone(),
            msg,
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| err(format!("cannot read ({})", crate::io::os_error_text(&e))))?;
        // Read once for both of its readers here.
        let config = read_json_in(dir.as_ref(), "tokenizer_config.json");
        let inner = Self::parse_with_config(dir.as_ref(), config.as_ref(), &text, err)?;
        warn_if_rebuilt_by_transformers_5(dir.as_ref(), config.as_ref(), &text);
        Ok(Some(Self::new(inner, path)))
    }

    /// [`Self::parse`] after `tokenizer_config.json`'s `added_tokens_decoder` (`config`, the parsed file of
    /// `dir`) is applied as transformers applies it ([`config_tokens`]); `file_err` names `tokenizer.json` in
    /// the file's own errors.
    fn parse_with_config(
        dir: &Path,
        config: Option<&serde_json::Value>,
        text: &str,
        file_err: impl Fn(String) -> LoadError,
    ) -> Result<tokenizers::Tokenizer, LoadError> {
        let config_err = |msg: String| LoadError::Tokenizer {
            path: dir.join("tokenizer_config.json"),
            msg,
        };
        let config = config_tokens::read(config).map_err(config_err)?;
        let patched = if config.is_empty() {
            None
        } else {
            config_tokens::patch(text, &config).map_err(config_err)?
        };
        let Some((patched, missing)) = patched else {
            return Self::parse(text).map_err(file_err);
        };
        let mut inner = Self::parse(&patched).map_err(file_err)?;
        config_tokens::add_missing(&mut inner, &missing).map_err(config_err)?;
        Ok(inner)
    }

    /// The text of a `tokenizer.json` as the tokenizers library reads it, or what is wrong with it: what
    /// [`Self::load_optional`] reads, and what the GGUF importer checks the file it builds with.
    pub(crate) fn parse(text: &str) -> Result<tokenizers::Tokenizer, String> {
        // Check the JSON first: the tokenizers crate panics on some malformed files (a truncated one, for
        // example) instead of returning an error, and a panic is caught below as a last resort. Its own
        // message for a missing or misspelt model section is about "untagged enum" variants, so the
        // sections it needs are checked here, by name.
        let json = serde_json::from_str::<serde_json::Value>(text)
            .map_err(|e| format!("not valid JSON: {e}"))?;
        if !json.is_object() {
            return Err("not a JSON object".into());
        }
        let model = &json["model"];
        if !model.is_object() {
            return Err("no `model` object (the vocabulary and its kind)".into());
        }
        if let Some(kind) = model.get("type").and_then(|t| t.as_str()) {
            const KINDS: [&str; 4] = ["BPE", "WordPiece", "WordLevel", "Unigram"];
            if !KINDS.contains(&kind) {
                return Err(format!(
                    "`model.type` is `{kind}`; supported: {}",
                    KINDS.join(", ")
                ));
            }
        }
        let mut tok = crate::host::catch_quietly(|| text.parse::<tokenizers::Tokenizer>())
            .map_err(|_| "the tokenizers library could not read this file".to_string())?
            .map_err(|e| e.to_string())?;
        // transformers encodes with neither (a call without `truncation=` / `padding=` turns the file's
        // off), nor does vLLM: kept, a file's `truncation` would cut prompts short and its `padding`
        // put pad ids the model reads before them, without a word (and a `stride` not below
        // `max_length` panics the library's encoder).
        tok.with_truncation(None).map_err(|e| e.to_string())?;
        tok.with_padding(None);
        Ok(tok)
    }

    fn new(inner: tokenizers::Tokenizer, path: PathBuf) -> Self {
        let unknown = unknown_token(&inner);
        Self {
            inner,
            path,
            unknown,
        }
    }

    /// A tokenizer from the text of a `tokenizer.json` (for tests that need no folder).
    #[cfg(test)]
    pub(crate) fn from_json_text(text: &str) -> Self {
        Self::new(Self::parse(text).unwrap(), PathBuf::from("tokenizer.json"))
    }

    /// [`Self::load_for`] where a command needs the tokenizer: a folder without one is an error that says
    /// what to do about it, since `qarl init-model` writes weights and config only.
    pub fn load_required(dir: &Path, config: &super::ModelConfig) -> anyhow::Result<Self> {
        Self::load_for(dir, config)?.ok_or_else(|| {
            anyhow::anyhow!(
                "{}: no tokenizer.json (`qarl init-model` writes none: copy the tokenizer files of the model \
                 the weights belong to, or let `qarl train` make `model.dir` from `model.init_config`, which \
                 writes the character tokenizer)",
                dir.display()
            )
        })
    }

    /// [`Self::load_optional`] for the model `config` of the same directory, refusing a tokenizer with ids
    /// that the model has no embedding row for: any text holding such a token would index past the
    /// embedding in the middle of a run (a vocabulary smaller than the tokenizer's is a mismatched pair,
    /// e.g. tokens added to `tokenizer.json` without resizing the model).
    pub fn load_for(
        dir: impl AsRef<Path>,
        config: &super::ModelConfig,
    ) -> Result<Option<Self>, LoadError> {
        let Some(tok) = Self::load_optional(&dir)? else {
            return Ok(None);
        };
        let beyond = tok
            .inner
            .get_vocab(true)
            .into_iter()
            .filter(|&(_, id)| id as usize >= config.vocab_size)
            .max_by_key(|&(_, id)| id);
        match beyond {
            None => Ok(Some(tok)),
            Some((token, id)) => Err(LoadError::Tokenizer {
                path: tok.path,
                msg: format!(
                    "token {token:?} has id {id}, but the model's `vocab_size` is {}: the tokenizer does \
                     not belong to this model's embedding",
                    config.vocab_size
                ),
            }),
        }
    }

    /// Token ids of `text`, without adding special tokens (prompts carry their own template).
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| {
            anyhow::anyhow!("{}: could not encode the text: {e}", self.path.display())
        })?;
        // A vocabulary without tokens for the text (an empty one, say) drops it silently; an empty sequence
        // would then be reported as an empty prompt, or trained on as nothing.
        if enc.get_ids().is_empty() && !text.trim().is_empty() {
            let shown: String = text.chars().take(40).collect();
            let more = if text.chars().count() > 40 { "..." } else { "" };
            anyhow::bail!(
                "{}: the tokenizer encodes the text {shown:?}{more} to no tokens (its vocabulary has \
                 none for it)",
                self.path.display()
            );
        }
        self.refuse_unknown(text, &enc)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Refuses a text whose encoding holds the unknown token where the text does not spell that token:
    /// the model would read (and SFT would train it to write) `<unk>` in place of the characters, and the
    /// verifier would then compare an answer that no longer says what the data set says (the char
    /// tokenizer has no `−`, U+2212, so `−3` read as `<unk>3`).
    fn refuse_unknown(&self, text: &str, enc: &tokenizers::Encoding) -> anyhow::Result<()> {
        let Some((unk, spelt)) = &self.unknown else {
            return Ok(());
        };
        let unknown = enc
            .get_ids()
            .iter()
            .zip(enc.get_offsets())
            .filter(|&(id, _)| id == unk)
            .filter_map(|(_, &(start, end))| text.get(start..end))
            .find(|piece| piece != spelt);
        let Some(piece) = unknown else {
            return Ok(());
        };
        let codes: Vec<String> = piece
            .chars()
            .map(|c| format!("U+{:04X}", c as u32))
            .collect();
        let shown: String = text.chars().take(60).collect();
        let more = if text.chars().count() > 60 { "..." } else { "" };
        anyhow::bail!(
            "{}: the text {shown:?}{more} has {piece:?} ({}), which the tokenizer has no token for: it \
             would read as {spelt} (rewrite the text, or use a tokenizer that covers it)",
            self.path.display(),
            codes.join(" ")
        )
    }

    /// [`Self::encode`] for a prompt, which a model must be given at least one token of (the rollout starts
    /// from the prompt's last token): an empty question under a template without prefixes is refused here,
    /// naming it, instead of reaching the rollout as an empty row.
    ///
    /// With `with_bos` (a plain prompt: what [`Template::prompt_takes_bos`] says), the prompt starts with
    /// the special tokens the tokenizer's post-processor puts before a text (a BOS, as transformers, vLLM
    /// and llama.cpp add it for Llama-family models), once: a text that begins with the BOS itself does
    /// not get a second one. Special tokens it would put after the text (an EOS) are left out: a prompt
    /// is continued, not ended. A chat template's prompt is encoded as written (transformers'
    /// `apply_chat_template` encodes it without special tokens: the template writes its own BOS).
    pub fn encode_prompt(&self, text: &str, with_bos: bool) -> anyhow::Result<Vec<u32>> {
        let mut ids = if with_bos {
            self.leading_special_tokens(text)?
        } else {
            Vec::new()
        };
        let body = self.encode(text)?;
        if !ids.is_empty() && body.starts_with(&ids) {
            ids.clear();
        }
        ids.extend(body);
        if ids.is_empty() {
            anyhow::bail!(
                "{}: the prompt {text:?} encodes to no tokens (an empty text, or an empty question under a \
                 template with empty prefixes)",
                self.path.display()
            );
        }
        Ok(ids)
    }

    /// The special tokens the post-processor adds before `text` (none for most tokenizers; Llama's BOS).
    fn leading_special_tokens(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let enc = self.inner.encode(text, true).map_err(|e| {
            anyhow::anyhow!("{}: could not encode the text: {e}", self.path.display())
        })?;
        let added = enc.get_special_tokens_mask();
        let lead = added.iter().take_while(|&&m| m == 1).count();
        Ok(enc.get_ids()[..lead].to_vec())
    }

    /// Whether this tokenizer can take the ChatML template where `declared_in` (a model directory)
    /// declares no chat template of its own: then the template is a guess, taken where the tokenizer has
    /// ChatML's tokens (an instruct model whose files left the template out) and refused where it has not
    /// (the markers would be spelt out as plain text the model never saw).
    pub fn check_chatml(&self, declared_in: &Path) -> anyhow::Result<()> {
        use crate::tasks::template::{ModelChatTemplate, IM_END, IM_START};
        if ModelChatTemplate::of_model(declared_in)?.is_some() {
            return Ok(());
        }
        let missing: Vec<&str> = [IM_START, IM_END]
            .into_iter()
            .filter(|t| self.token_to_id(t).is_none())
            .collect();
        anyhow::ensure!(
            missing.is_empty(),
            "{}: no chat template, and the tokenizer {} has no {} token: the chat template cannot apply \
             (use the plain template)",
            declared_in.display(),
            self.path.display(),
            missing.join(" or ")
        );
        Ok(())
    }

    /// [`Self::check_chatml`] where `template` is the chat template, for the model in `dir`.
    pub fn check_template(&self, template: &Template, dir: &Path) -> anyhow::Result<()> {
        match template {
            Template::Chat { .. } => self.check_chatml(dir),
            Template::Plain { .. } => Ok(()),
        }
    }

    /// Text of `ids`, special tokens kept.
    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow::anyhow!("tokenizer could not decode ids: {e}"))
    }

    /// The text a verifier reads: special tokens (a chat turn's end, padding) left out, as verl's reward
    /// managers decode (`skip_special_tokens=True`). A turn end that is not a stop id (a model that runs on
    /// past it, or a template's stop string) would otherwise be glued to the answer: `#### 18<|eot_id|>`.
    pub fn decode_without_special(&self, ids: &[u32]) -> anyhow::Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow::anyhow!("tokenizer could not decode ids: {e}"))
    }

    /// The id of a token string such as `<|im_end|>`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The `tokenizer.json` it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The folder of its `tokenizer.json`, where the model's other tokenizer and generation files are.
    pub fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }
}

/// The id and text of the vocabulary's unknown token (`model.unk_token`, or a Unigram's `unk_id`), where
/// the vocabulary holds it.
fn unknown_token(tok: &tokenizers::Tokenizer) -> Option<(u32, String)> {
    use tokenizers::models::ModelWrapper;
    let spelt = match tok.get_model() {
        ModelWrapper::BPE(m) => m.unk_token.clone()?,
        ModelWrapper::WordPiece(m) => m.unk_token.clone(),
        ModelWrapper::WordLevel(m) => m.unk_token.clone(),
        // A Unigram's `unk_id` is not public: read back from its own serialization.
        ModelWrapper::Unigram(m) => {
            let id = serde_json::to_value(m).ok()?["unk_id"].as_u64()?;
            return Some((id as u32, tok.id_to_token(id as u32)?));
        }
    };
    Some((tok.token_to_id(&spelt)?, spelt))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::char_tokenizer;

    /// Which tokenizers transformers 5.25 rebuilds (checked against it on SentencePiece and byte-level
    /// files, model types llama, phi3 and none).
    #[test]
    fn transformers_5_rebuilds_sentencepiece_llama_tokenizers_of_llama_models() {
        let spm = r#"{"pre_tokenizer": {"type": "Metaspace"}}"#;
        let byte_level = r#"{"pre_tokenizer": {"type": "ByteLevel"}}"#;
        assert!(transformers_5_rebuilds(
            "LlamaTokenizer",
            Some("llama"),
            spm
        ));
        assert!(transformers_5_rebuilds("LlamaTokenizerFast", None, spm));
        assert!(transformers_5_rebuilds(
            "CodeLlamaTokenizer",
            Some("llama"),
            spm
        ));
        assert!(!transformers_5_rebuilds(
            "LlamaTokenizer",
            Some("phi3"),
            spm
        ));
        assert!(!transformers_5_rebuilds(
            "LlamaTokenizer",
            Some("llama"),
            byte_level
        ));
        assert!(!transformers_5_rebuilds(
            "PreTrainedTokenizerFast",
            Some("llama"),
            spm
        ));
    }

    fn char_tokenizer() -> Tokenizer {
        Tokenizer::from_json_text(&char_tokenizer::tokenizer_json().to_string())
    }

    #[test]
    fn characters_outside_the_vocabulary_are_refused_by_name() {
        let tok = char_tokenizer();
        let err = tok.encode("12 + −3 = ?").unwrap_err().to_string();
        assert!(err.contains("\"−\" (U+2212)"), "{err}");
        assert!(err.contains("12 + −3 = ?"), "{err}");
        assert!(err.contains("<unk>"), "{err}");
        let err = tok.encode_prompt("café", false).unwrap_err().to_string();
        assert!(err.contains("U+00E9"), "{err}");
    }

    /// A `tokenizer.json` with `truncation` or `padding` set encodes as transformers encodes by
    /// default, with neither: the whole prompt, no pad ids before it (a `stride` not below
    /// `max_length` panicked the library's encoder).
    #[test]
    fn the_files_truncation_and_padding_are_not_applied() {
        let plain = char_tokenizer().encode("Question: 12+34+56+7=").unwrap();
        assert_eq!(plain.len(), 21);
        for (key, value) in [
            (
                "truncation",
                serde_json::json!({"direction": "Left", "max_length": 3,
                "strategy": "LongestFirst", "stride": 0}),
            ),
            (
                "truncation",
                serde_json::json!({"direction": "Right", "max_length": 3,
                "strategy": "LongestFirst", "stride": 5}),
            ),
            (
                "padding",
                serde_json::json!({"strategy": {"Fixed": 40}, "direction": "Left",
                "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>", "pad_to_multiple_of": null}),
            ),
        ] {
            let mut json = char_tokenizer::tokenizer_json();
            json[key] = value;
            let tok = Tokenizer::from_json_text(&json.to_string());
            assert_eq!(tok.encode("Question: 12+34+56+7=").unwrap(), plain, "{key}");
        }
    }

    /// An added token the library cannot number (the vocabulary's largest id is u32::MAX) is an error
    /// naming `tokenizer_config.json`, not an overflow panic.
    #[test]
    fn an_added_token_beyond_the_last_id_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 4294967295u32, "content": "<x>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1, "<x>": 4294967295u32},
                "unk_token": "<unk>"},
        });
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"added_tokens_decoder": {"5": {"content": "<y>", "special": true}}}"#,
        )
        .unwrap();
        let Err(err) = Tokenizer::load_optional(dir.path()) else {
            panic!("a token numbered past u32::MAX was added");
        };
        let err = err.to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("<y>"),
            "{err}"
        );
    }

    #[test]
    fn covered_text_and_the_unknown_token_spelt_out_encode() {
        let tok = char_tokenizer();
        assert_eq!(tok.unknown, Some((3, "<unk>".to_string())));
        let ids = tok.encode("12 + 3 = 15").unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), "12 + 3 = 15");
        // A text that writes the unknown token itself asks for it.
        assert!(tok.encode("a <unk> b").unwrap().contains(&3));
    }

    /// A special token glued to the answer (a turn end the model ran past) hides it from the verifier in
    /// the text with special tokens kept; the verifier's text leaves it out.
    #[test]
    fn the_verifiers_text_leaves_special_tokens_out() {
        use crate::tasks::verify::{score_response, VerifyConfig};
        let tok = char_tokenizer();
        let mut ids = tok.encode("#### 18").unwrap();
        ids.extend([char_tokenizer::PAD_ID, char_tokenizer::BOS_ID]);
        let kept = tok.decode(&ids).unwrap();
        assert_eq!(kept, "#### 18<pad><bos>");
        let cfg = VerifyConfig::default();
        assert!(!score_response(&kept, false, "18", &cfg).correct);
        let text = tok.decode_without_special(&ids).unwrap();
        assert_eq!(text, "#### 18");
        assert!(score_response(&text, false, "18", &cfg).correct);
    }

    #[test]
    fn a_vocabulary_without_an_unknown_token_checks_nothing() {
        let mut json = char_tokenizer::tokenizer_json();
        json["model"]["unk_token"] = serde_json::json!("<missing>");
        let tok = Tokenizer::from_json_text(&json.to_string());
        assert_eq!(tok.unknown, None);
    }
}
