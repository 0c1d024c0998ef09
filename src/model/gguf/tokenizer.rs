//! The tokenizer stored in GGUF metadata (`tokenizer.ggml.*`) as a Hugging Face `tokenizer.json` +
//! `tokenizer_config.json`. Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is supported; the
//! pre-tokenizer follows `tokenizer.ggml.pre` (llama.cpp's name for the original tokenizer's splitting).

use serde_json::{json, Map, Value as Json};

use super::reader::{GgufError, GgufFile, Value};

/// GGUF token types (llama.cpp `llama_token_type`).
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;

/// (tokenizer.json, tokenizer_config.json).
pub fn hf_tokenizer(f: &GgufFile) -> Result<(Json, Json), GgufError> {
    let model = f.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(f.error(format!(
            "tokenizer model `{model}` is not supported (byte-level BPE `gpt2` is)"
        )));
    }
    let strings = |key: &str| -> Result<Vec<&str>, GgufError> {
        f.get(key)?
            .as_array()
            .ok_or_else(|| f.error(format!("`{key}` is not an array")))?
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| f.error(format!("`{key}` holds a non-string")))
            })
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<u64> = match f.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .as_array()
            .ok_or_else(|| f.error("`tokenizer.ggml.token_type` is not an array"))?
            .iter()
            .map(|t| t.as_u64().unwrap_or(1))
            .collect(),
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(f.error(format!(
            "{} token types for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let pre = f
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        "default" | "gpt2" => byte_level.clone(),
        // SmolLM's tokenizer splits every digit before the byte-level split.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level.clone(),
        ]}),
        other => {
            return Err(f.error(format!(
                "pre-tokenizer `{other}` is not supported (default, gpt2, smollm)"
            )))
        }
    };
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert((*t).to_string(), json!(id));
    }
    if vocab.len() != tokens.len() {
        return Err(f.error("`tokenizer.ggml.tokens` holds duplicate tokens"));
    }
    let added: Vec<Json> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == CONTROL || ty == USER_DEFINED)
        .map(|(id, (t, _))| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let token_of = |key: &str| -> Option<&str> {
        let id = f.metadata.get(key)?.as_u64()? as usize;
        tokens.get(id).copied()
    };
    let add_bos = f
        .metadata
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let post_processor = match (add_bos, token_of("tokenizer.ggml.bos_token_id")) {
        (true, Some(bos)) => {
            let bos_id = f.get_u64("tokenizer.ggml.bos_token_id")?;
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}})
        }
        _ => Json::Null,
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
        "add_bos_token": add_bos,
        "model_max_length": f.metadata.get("llama.context_length").and_then(Value::as_u64).unwrap_or(2048),
    });
    for (key, name) in [
        ("tokenizer.ggml.bos_token_id", "bos_token"),
        ("tokenizer.ggml.eos_token_id", "eos_token"),
        ("tokenizer.ggml.padding_token_id", "pad_token"),
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
    ] {
        if let Some(t) = token_of(key) {
            config[name] = json!(t);
        }
    }
    if let Some(t) = f
        .metadata
        .get("tokenizer.chat_template")
        .and_then(Value::as_str)
    {
        config["chat_template"] = json!(t);
    }
    Ok((tokenizer, config))
}
