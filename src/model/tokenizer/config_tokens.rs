//! `tokenizer_config.json`'s `added_tokens_decoder` over `tokenizer.json`'s added tokens, as transformers
//! 5.25 reads a tokenizer (checked against it: `tests/fixtures/tokenizer_config`).
//!
//! transformers re-adds every token the config names: a token `tokenizer.json` already has keeps its id,
//! takes the config's `lstrip`, `rstrip`, `single_word` and `normalized`, and becomes special where the
//! config says so (never the other way: a token the file marks special stays special, so decoding without
//! special tokens still drops it); a token only the config names is added at the next free id. Phi-3's
//! config, for one, sets `rstrip` on its chat tokens where its `tokenizer.json` does not, so the file alone
//! encodes `<|user|>\n...` with other ids than transformers. Where the config's id and the one transformers
//! would give disagree (another token at that id, or a gap before it), the pair is refused: the model's
//! embedding rows would be read under other ids than the config says.

use std::collections::BTreeMap;

use serde::Deserialize;

/// One entry of `added_tokens_decoder`, with transformers' `AddedToken` defaults for a missing field.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct ConfigToken {
    content: String,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    single_word: bool,
    /// transformers' default is `not special`.
    #[serde(default)]
    normalized: Option<bool>,
    #[serde(default)]
    special: bool,
}

impl ConfigToken {
    fn normalized(&self) -> bool {
        self.normalized.unwrap_or(!self.special)
    }

    fn added_token(&self) -> tokenizers::AddedToken {
        tokenizers::AddedToken::from(self.content.clone(), self.special)
            .lstrip(self.lstrip)
            .rstrip(self.rstrip)
            .single_word(self.single_word)
            .normalized(self.normalized())
    }
}

/// The `added_tokens_decoder` of the parsed `tokenizer_config.json` by id, empty where there is no config
/// (or one that is not JSON: the readers of its other keys, the chat template's, report that) or no such
/// key; an entry that is not a token is an error (the message names the id).
pub(super) fn read(
    config: Option<&serde_json::Value>,
) -> Result<BTreeMap<u32, ConfigToken>, String> {
    let Some(decoder) = config.and_then(|c| c.get("added_tokens_decoder")) else {
        return Ok(BTreeMap::new());
    };
    let serde_json::Value::Object(entries) = decoder else {
        return Err("`added_tokens_decoder` is not an object of ids".into());
    };
    entries
        .iter()
        .map(|(id, entry)| {
            let parsed = id
                .parse::<u32>()
                .map_err(|_| format!("`added_tokens_decoder` key {id:?} is not a token id"))?;
            let token = ConfigToken::deserialize(entry)
                .map_err(|e| format!("`added_tokens_decoder` entry {id}: {e}"))?;
            Ok((parsed, token))
        })
        .collect()
}

/// The config's tokens the file does not have as added tokens (ids ascending), for [`add_missing`].
pub(super) type Missing = Vec<(u32, ConfigToken)>;

/// `tokenizer.json`'s text with the flags of the added tokens the config names set as transformers sets
/// them, and the config's tokens the file does not have; `None` where that changes nothing, or where the
/// text is not JSON (the tokenizer's own parser reports that, naming the file).
pub(super) fn patch(
    tokenizer_json: &str,
    config: &BTreeMap<u32, ConfigToken>,
) -> Result<Option<(String, Missing)>, String> {
    let Ok(mut json) = serde_json::from_str::<serde_json::Value>(tokenizer_json) else {
        return Ok(None);
    };
    let mut missing = Vec::new();
    let mut changed = false;
    let added = json
        .get_mut("added_tokens")
        .and_then(serde_json::Value::as_array_mut);
    let mut by_id: BTreeMap<u64, &mut serde_json::Value> = added
        .into_iter()
        .flatten()
        .filter_map(|t| Some((t.get("id")?.as_u64()?, t)))
        .collect();
    for (&id, token) in config {
        let Some(entry) = by_id.get_mut(&u64::from(id)) else {
            missing.push((id, token.clone()));
            continue;
        };
        let content = entry.get("content").and_then(|c| c.as_str()).unwrap_or("");
        if content != token.content {
            return Err(format!(
                "`added_tokens_decoder` names id {id} `{}`, but tokenizer.json's added token {id} is \
                 `{content}` (transformers would add `{}` under another id)",
                token.content, token.content
            ));
        }
        let file_special = entry
            .get("special")
            .and_then(|s| s.as_bool())
            .unwrap_or(false);
        let flags = [
            ("lstrip", token.lstrip),
            ("rstrip", token.rstrip),
            ("single_word", token.single_word),
            ("normalized", token.normalized()),
            ("special", file_special || token.special),
        ];
        for (flag, value) in flags {
            if entry.get(flag).and_then(|v| v.as_bool()) != Some(value) {
                entry[flag] = value.into();
                changed = true;
            }
        }
    }
    // Most models' config repeats the file's flags (Qwen3's, SmolLM2's): the file is then read as it is.
    if !changed && missing.is_empty() {
        return Ok(None);
    }
    Ok(Some((json.to_string(), missing)))
}

/// Adds the config's tokens that `tokenizer.json` has not as added tokens, in id order, each where
/// transformers puts it (its id in the vocabulary, else the next free one), refusing one whose config id
/// is elsewhere.
pub(super) fn add_missing(
    tokenizer: &mut tokenizers::Tokenizer,
    missing: &Missing,
) -> Result<(), String> {
    for (id, token) in missing {
        let added = [token.added_token()];
        // The library panics where it cannot number the token (a vocabulary whose largest id is
        // u32::MAX overflows its next free id): an error here, not a crash.
        crate::host::catch_quietly(std::panic::AssertUnwindSafe(|| {
            if token.special {
                tokenizer.add_special_tokens(&added);
            } else {
                tokenizer.add_tokens(&added);
            }
        }))
        .map_err(|_| {
            format!(
                "`added_tokens_decoder` names id {id} `{}`, which the tokenizers library could not \
                 add to tokenizer.json's vocabulary (no free id after its largest)",
                token.content
            )
        })?;
        let got = tokenizer.token_to_id(&token.content);
        if got != Some(*id) {
            let place = got.map_or("no id".to_string(), |g| format!("id {g}"));
            return Err(format!(
                "`added_tokens_decoder` names id {id} `{}`, but transformers would give it {place} (its \
                 id in tokenizer.json's vocabulary, or the next free one)",
                token.content,
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"added_tokens": [{"id": 5, "content": "<e>", "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": true}], "model": {}}"#;

    fn config(json: &str) -> BTreeMap<u32, ConfigToken> {
        let entries: BTreeMap<String, ConfigToken> = serde_json::from_str(json).unwrap();
        entries
            .into_iter()
            .map(|(k, v)| (k.parse().unwrap(), v))
            .collect()
    }

    /// A config that repeats the file's flags leaves the file to be read as written; one flag that
    /// differs rewrites it, and a token the file lacks is returned to be added.
    #[test]
    fn only_a_config_that_changes_something_rewrites_the_file() {
        let same = config(r#"{"5": {"content": "<e>", "special": true}}"#);
        assert!(patch(FILE, &same).unwrap().is_none());
        let stripped = config(r#"{"5": {"content": "<e>", "special": true, "rstrip": true}}"#);
        let (text, missing) = patch(FILE, &stripped).unwrap().unwrap();
        assert!(missing.is_empty());
        assert!(text.contains(r#""rstrip":true"#), "{text}");
        let new = config(r#"{"6": {"content": "<f>"}}"#);
        let (_, missing) = patch(FILE, &new).unwrap().unwrap();
        assert_eq!(missing.len(), 1);
        assert_eq!(missing[0].0, 6);
        // normalized defaults to `not special`, as transformers' AddedToken.
        assert!(missing[0].1.normalized());
    }
}
