//! How a config is read: the file (or the embedded default), then the command line's `--set key.path=value`
//! overrides applied to its TOML document before the typed parse, so an override is checked exactly as the
//! same key written in the file would be.

use std::path::Path;

use anyhow::{bail, Context};

use super::{TrainConfig, DEFAULT_CONFIG};

/// [`load_config`] with a command's `--backend` flag, when given, as one more override
/// (`train.backend=..`, after the `--set` ones): validation then sees the backend the run will use (the
/// settings that need a CubeCL backend, `train.tensor_cores`, are checked against it).
pub fn load_config_on(
    path: Option<&Path>,
    overrides: &[String],
    backend: Option<crate::ops::BackendKind>,
) -> anyhow::Result<TrainConfig> {
    let mut all = overrides.to_vec();
    all.extend(backend.map(|b| format!("train.backend={b}")));
    load_config(path, &all)
}

/// Reads a config file, or the embedded default when `path` is `None`, then applies `overrides`
/// (`key.path=value`, the value in TOML syntax, bare words taken as strings).
pub fn load_config(path: Option<&Path>, overrides: &[String]) -> anyhow::Result<TrainConfig> {
    let (text, origin) = match path {
        Some(p) => (
            std::fs::read_to_string(p).map_err(crate::io::failed(p, "cannot read"))?,
            p.display().to_string(),
        ),
        None => (
            DEFAULT_CONFIG.to_string(),
            "the default config (configs/default.toml)".to_string(),
        ),
    };
    if overrides.is_empty() {
        return TrainConfig::from_toml(&text, &origin);
    }
    let mut doc: toml::Value =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{origin}: {e}"))?;
    let mut unquoted = Vec::new();
    for o in overrides {
        let (key, value) = parse_override(o)?;
        if !value.is_str() {
            unquoted.push((key.clone(), value.to_string()));
        }
        set_dotted(&mut doc, &key, value)?;
    }
    let text = toml::to_string(&doc)?;
    TrainConfig::from_generated_toml(&text, &format!("{origin} with --set overrides"))
        .map_err(|e| with_quoting_hint(e, &unquoted))
}

/// Adds to a config error where a string was expected how to pass one for the overrides whose values read
/// as something else (`--set run_dir=2024` reads 2024 as a number: the error alone says "invalid type:
/// integer `2024`, expected path string").
fn with_quoting_hint(e: anyhow::Error, unquoted: &[(String, String)]) -> anyhow::Error {
    let text = format!("{e:#}");
    if !text.contains("expected") || !text.contains("string") {
        return e;
    }
    let Some((key, value)) = unquoted
        .iter()
        .find(|(key, value)| text.contains(&format!("`{value}`")) || text.contains(key.as_str()))
    else {
        return e;
    };
    anyhow::anyhow!(
        "{text} (a --set value is read as TOML, so `{value}` is not a string: quote it for one, as \
         --set '{key}=\"{value}\"')"
    )
}

/// Sets `key` (dotted path such as `rollout.precision`) in a TOML document, creating missing tables on the
/// way (`sft.steps` on a config without `[sft]`); a misspelt key is then rejected by the config's own parse,
/// which names the unknown field.
pub fn set_dotted(doc: &mut toml::Value, key: &str, value: toml::Value) -> anyhow::Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut cur = doc;
    for p in &parts[..parts.len() - 1] {
        let table = cur.as_table_mut().with_context(|| {
            format!("override `{key}`: `{p}` is inside a value that is not a table")
        })?;
        cur = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    let table = cur
        .as_table_mut()
        .with_context(|| format!("override `{key}`: parent is not a table"))?;
    let replaced = table.insert(parts[parts.len() - 1].to_string(), value.clone());
    // A table replaces the table there as a whole (TOML's meaning, and how one switches a tagged table
    // such as `task` to another kind), so the keys it leaves out go back to their defaults: said aloud,
    // since `eval={every=5}` reads like an edit of one key.
    if let (Some(toml::Value::Table(old)), toml::Value::Table(new)) = (replaced, &value) {
        // A tagged table switched to another kind (`task={kind="gsm8k",...}`) drops the old kind's keys
        // by design.
        if old
            .get("kind")
            .is_some_and(|k| new.get("kind").is_some_and(|n| n != k))
        {
            return Ok(());
        }
        let dropped: Vec<String> = old
            .iter()
            .filter(|(k, _)| !new.contains_key(*k))
            .map(|(k, v)| format!("{k} (was {v})"))
            .collect();
        if !dropped.is_empty() {
            tracing::warn!(
                "override `{key}`: the table given replaces `{key}` as a whole, so the keys it leaves out are \
                 dropped and take their defaults, or are missing where they have none: {} (to change one \
                 key, set `{key}.<name>`)",
                dropped.join(", ")
            );
        }
    }
    Ok(())
}

/// Parses one `--set key.path=value` override. The value is read as a TOML value (`3e-4`, `true`,
/// `["add","mul"]`, `"int4-g32"`); anything that is not valid TOML is taken as a bare string (`int4-g32`).
pub fn parse_override(text: &str) -> anyhow::Result<(String, toml::Value)> {
    let (key, raw) = text
        .split_once('=')
        .with_context(|| format!("--set `{text}`: expected key.path=value"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        bail!("--set `{text}`: the key `{key}` is not a dotted path like `train.lr`");
    }
    let raw = raw.trim();
    let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v"),
        Err(_) => None,
    };
    // A number TOML does not read (`1e400`, an integer past i64, `.5`, `007`) would otherwise become a
    // string, and the error would say "invalid type: string". Words (`NaN`, `int4-g32`) stay strings.
    let digits = raw.trim_start_matches(['+', '-']);
    let numeric = digits.starts_with(|c: char| c.is_ascii_digit() || c == '.');
    match (value, raw.parse::<f64>()) {
        (Some(v), _) => Ok((key.to_string(), v)),
        (None, Ok(_)) if numeric && has_leading_zero(digits) => {
            let sign = &raw[..raw.len() - digits.len()];
            let rest = digits.trim_start_matches('0');
            let zero = if rest.is_empty() || rest.starts_with(['.', 'e', 'E']) {
                "0"
            } else {
                ""
            };
            let plain = format!("{sign}{zero}{rest}");
            // The number without the zeros, where TOML reads it (`00.` has none: `0.` is no TOML number).
            let write = match toml::from_str::<toml::Table>(&format!("v = {plain}")) {
                Ok(_) => format!("write {plain}"),
                Err(_) => "write it as TOML does (e.g. 0.5, 5.0, 7)".to_string(),
            };
            bail!(
                "--set `{text}`: `{raw}` has a leading zero, which TOML does not read in a number: {write} \
                 (or \"{raw}\" for a string)"
            )
        }
        (None, Ok(x))
            if numeric && (x.is_infinite() || digits.bytes().all(|b| b.is_ascii_digit())) =>
        {
            bail!("--set `{text}`: `{raw}` is out of the range of a TOML number")
        }
        (None, Ok(_)) if numeric => {
            bail!("--set `{text}`: `{raw}` is not a number as TOML writes it (e.g. 0.5, 5.0, 7)")
        }
        (None, _) => Ok((key.to_string(), toml::Value::String(raw.to_string()))),
    }
}

/// `007`, `00.5`: digits after a leading zero (TOML's numbers have none; `0`, `0.5`, `0e3` are fine).
fn has_leading_zero(digits: &str) -> bool {
    let mut chars = digits.chars();
    chars.next() == Some('0') && chars.next().is_some_and(|c| c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value TOML reads as a number where the config wants a string gets the quoting spelled out; the
    /// quoted value is taken.
    #[test]
    fn a_number_given_for_a_string_says_how_to_quote_it() {
        let err = format!(
            "{:#}",
            load_config(None, &["run_dir=2024".into()]).unwrap_err()
        );
        assert!(
            err.contains("invalid type: integer `2024`")
                && err.contains(r#"--set 'run_dir="2024"'"#),
            "{err}"
        );
        let cfg = load_config(None, &[r#"run_dir="2024""#.into()]).unwrap();
        assert_eq!(cfg.run_dir, std::path::PathBuf::from("2024"));
        // Other errors are left as they are.
        let err = format!(
            "{:#}",
            load_config(None, &["train.lr=fast".into()]).unwrap_err()
        );
        assert!(!err.contains("quote it"), "{err}");
    }
}
