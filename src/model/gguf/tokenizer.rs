//! The tokenizer stored in GGUF metadata (`tokenizer.ggml.*`) as a Hugging Face `tokenizer.json` +
//! `tokenizer_config.json`. Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is supported; the
//! pre-tokenizer follows `tokenizer.ggml.pre` (llama.cpp's name for the original tokenizer's splitting).

use serde_json::{json, Map, Value as Json};

use super::reader::{GgufError, GgufFile};

/// GGUF token types (llama.cpp `llama_token_type`: 0 undefined, 1 normal, 2 unknown, 3 control, 4 user
/// defined, 5 unused, 6 byte).
const NORMAL: u64 = 1;
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;
const MAX_TOKEN_TYPE: u64 = 6;

/// (tokenizer.json, tokenizer_config.json).
///
/// Every `tokenizer.ggml.*` key read here is checked: an absent optional key takes its default, one present
/// with another GGUF type (`add_bos_token` as the integer 1, `pre` as a number) or an impossible value (a
/// token id beyond the vocabulary, a token type llama.cpp does not define) is an error naming the key and
/// what it holds, never the default.
pub fn hf_tokenizer(f: &GgufFile) -> Result<(Json, Json), GgufError> {
    let model = f.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(f.error(format!(
            "metadata `tokenizer.ggml.model` = {model}: this tokenizer model is not supported (byte-level \
             BPE `gpt2` is)"
        )));
    }
    let tokens_key = "tokenizer.ggml.tokens";
    let tokens = f.get_strings(tokens_key)?;
    let merges = f.get_strings("tokenizer.ggml.merges")?;
    let types_key = "tokenizer.ggml.token_type";
    let types: Vec<u64> = match f.opt_array(types_key)? {
        Some(types) => types
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64().filter(|&t| t <= MAX_TOKEN_TYPE).ok_or_else(|| {
                    f.wrong_item(
                        types_key,
                        i,
                        v,
                        &format!("an integer token type from 0 to {MAX_TOKEN_TYPE}"),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        None => vec![NORMAL; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(f.error(format!(
            "{} token types (`{types_key}`) for {} tokens (`{tokens_key}`)",
            types.len(),
            tokens.len()
        )));
    }
    let pre = f.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    if pre == "default" {
        // llama.cpp's `default` splits punctuation, digit runs and three-digit groups by regexes of its own;
        // the import splits as GPT-2 does, which may part numbers and punctuation otherwise.
        tracing::warn!(
            "`tokenizer.ggml.pre` is missing or `default`: the tokenizer is imported with GPT-2's \
             pre-tokenizer, which may split numbers and punctuation otherwise than llama.cpp and the \
             model's original tokenizer; check its ids against the original tokenizer.json"
        );
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        // llama.cpp's converter writes `gpt-2` (`llama-vocab.cpp`); `gpt2` kept for files that spell it so.
        "default" | "gpt-2" | "gpt2" => byte_level.clone(),
        // SmolLM's tokenizer splits every digit before the byte-level split.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level.clone(),
        ]}),
        other => {
            return Err(f.error(format!(
                "metadata `tokenizer.ggml.pre` = {other}: this pre-tokenizer is not supported (default, \
                 gpt2, smollm)"
            )))
        }
    };
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        if let Some(first) = vocab.insert((*t).to_string(), json!(id)) {
            return Err(f.error(format!(
                "metadata `{tokens_key}` holds the token {t:?} twice (items {first} and {id})"
            )));
        }
    }
    let added: Vec<Json> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == CONTROL || ty == USER_DEFINED)
        // Only control tokens are special: llama.cpp's converter writes an HF model's added tokens that
        // are not special (`<think>`) as user-defined, and renders them in text, as transformers does;
        // marked special, they vanished from every response the verifier read.
        .map(|(id, (t, &ty))| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": ty == CONTROL})
        })
        .collect();
    // A special token's id, when the key is present: an unsigned integer naming a token of the vocabulary.
    // (llama.cpp warns about an id beyond the vocabulary and falls back to its default id: the imported
    // tokenizer would name no token, or another one.)
    let special = |key: &str| -> Result<Option<(u64, &str)>, GgufError> {
        let Some(id) = f.opt_u64(key)? else {
            return Ok(None);
        };
        match usize::try_from(id).ok().and_then(|i| tokens.get(i)) {
            Some(t) => Ok(Some((id, *t))),
            None => Err(f.error(format!(
                "metadata `{key}` = {id} is not a token id: the vocabulary (`{tokens_key}`) has {} tokens{}",
                tokens.len(),
                match tokens.len() {
                    0 => String::new(),
                    n => format!(" (ids 0 to {})", n - 1),
                }
            ))),
        }
    };
    let bos_key = "tokenizer.ggml.bos_token_id";
    let eos_key = "tokenizer.ggml.eos_token_id";
    let bos = special(bos_key)?;
    let eos = special(eos_key)?;
    // Padding and unknown tokens the encoding never adds (byte-level BPE has no unknown): one beyond the
    // vocabulary is left out with a warning, as llama.cpp loads such files with a warning (a file it loads
    // imports); a wrong type is still an error.
    let optional = |key: &str| -> Result<Option<(u64, &str)>, GgufError> {
        match special(key) {
            Err(e) if f.opt_u64(key).is_ok() => {
                tracing::warn!("{e}; the imported tokenizer names no such token");
                Ok(None)
            }
            other => other,
        }
    };
    let pad = optional("tokenizer.ggml.padding_token_id")?;
    let unk = optional("tokenizer.ggml.unknown_token_id")?;
    // Whether encoding adds BOS before / EOS after the text (llama.cpp's `add_bos_token` / `add_eos_token`):
    // the token to add must be named.
    let adds = |key: &str, id_key: &str, named: bool| -> Result<bool, GgufError> {
        let on = f.opt_bool(key)?.unwrap_or(false);
        if on && !named {
            return Err(f.error(format!(
                "metadata `{key}` is true, but `{id_key}` is missing: no token to add"
            )));
        }
        Ok(on)
    };
    let add_bos = if adds("tokenizer.ggml.add_bos_token", bos_key, bos.is_some())? {
        bos
    } else {
        None
    };
    let add_eos = if adds("tokenizer.ggml.add_eos_token", eos_key, eos.is_some())? {
        eos
    } else {
        None
    };
    // Transformers' Llama layout: `<bos> $A <eos>`, and `<bos> $A <eos> <bos> $B <eos>` for a pair.
    let post_processor = if add_bos.is_none() && add_eos.is_none() {
        Json::Null
    } else {
        let piece = |seq: &str, type_id: u32| -> Vec<Json> {
            let special =
                |(_, t): (u64, &str)| json!({"SpecialToken": {"id": t, "type_id": type_id}});
            add_bos
                .map(special)
                .into_iter()
                .chain([json!({"Sequence": {"id": seq, "type_id": type_id}})])
                .chain(add_eos.map(special))
                .collect()
        };
        let pair = [piece("A", 0), piece("B", 1)].concat();
        let mut special_tokens = Map::new();
        for (id, t) in add_bos.into_iter().chain(add_eos) {
            special_tokens.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
        }
        json!({"type": "TemplateProcessing",
            "single": piece("A", 0),
            "pair": pair,
            "special_tokens": special_tokens})
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    // Loaded here as every command will load it: merges that name tokens missing from the vocabulary (a
    // damaged file) were written out, and only the first command on the imported model failed.
    if let Err(why) = crate::model::Tokenizer::parse(&tokenizer.to_string()) {
        return Err(f.error(format!(
            "the tokenizer built from `tokenizer.ggml.*` does not load: {why}"
        )));
    }
    let mut config = json!({
        "add_bos_token": add_bos.is_some(),
        "add_eos_token": add_eos.is_some(),
        "model_max_length": f.opt_u64("llama.context_length")?.unwrap_or(2048),
    });
    for (token, name) in [
        (bos, "bos_token"),
        (eos, "eos_token"),
        (pad, "pad_token"),
        (unk, "unk_token"),
    ] {
        if let Some((_, t)) = token {
            config[name] = json!(t);
        }
    }
    if let Some(t) = f.opt_str("tokenizer.chat_template")? {
        // Written as is, a template that does not parse would fail every later chat prompt, far from here.
        crate::tasks::chat_template::check_template_source(t).map_err(|e| {
            f.error(format!(
                "`tokenizer.chat_template` does not parse as a Jinja template: {e}"
            ))
        })?;
        config["chat_template"] = json!(t);
    }
    Ok((tokenizer, config))
}
