//! What a config's reader says when the text is wrong: TOML and serde errors turned into messages that name
//! the file, the line, the full key path and the reason, with the closest valid key or value for a misspelt
//! one; and the floats no setting can hold.

use anyhow::bail;

use crate::tasks::TaskConfig;

/// The error `e` again, pointing at the key at fault, where it points at the `[task]` table or its
/// `template` (tagged by `kind`, which hides the key from toml: [`TaskConfig::locate_error`]).
pub(super) fn locate_in_task(text: &str, e: &toml::de::Error) -> Option<toml::de::Error> {
    let doc = toml::de::DeTable::parse(text).ok()?;
    let task = doc.get_ref().get("task")?;
    let template = task.get_ref().get("template");
    let at = |t: &toml::Spanned<toml::de::DeValue<'_>>| e.span() == Some(t.span());
    if !at(task) && !template.is_some_and(at) {
        return None;
    }
    let mut located = TaskConfig::locate_error(task)?;
    located.set_input(Some(text));
    Some(located)
}

/// The line (from 1) of dotted `key` in TOML `text`, where the text writes it (as `key = ...` in its table,
/// or as a table header): for the range checks, which run on the parsed config and know only the key.
pub(super) fn line_of_key(text: &str, key: &str) -> Option<usize> {
    let doc = toml::de::DeTable::parse(text).ok()?;
    let mut parts = key.split('.');
    let mut value = doc.get_ref().get(parts.next()?)?;
    for part in parts {
        value = value.get_ref().get(part)?;
    }
    let at = value.span().start.min(text.len());
    Some(text[..at].matches('\n').count() + 1)
}

/// The first backtick-quoted dotted key of a range check's message (`rollout.top_p`), if it names one.
pub(crate) fn key_named_in(message: &str) -> Option<&str> {
    let key = message.split('`').nth(1)?;
    let is_key = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.');
    is_key.then_some(key)
}

/// Turns a TOML/serde error into one that names the file, the line, the full key path and the reason, and
/// suggests the closest valid key or value for a misspelt one (a run's config, an experiment file).
pub(crate) fn explain_toml_error(
    e: &toml::de::Error,
    text: &str,
    origin: &str,
    lines: bool,
) -> anyhow::Error {
    let msg = e.message().trim();
    let pos = e.span().map(|s| s.start.min(text.len()));
    let line = pos
        .filter(|_| lines)
        .map(|p| text[..p].matches('\n').count() + 1);
    // The key path of the line the error points at: the enclosing table and the key on the line.
    let path = pos.map(|p| key_path_at(text, p)).unwrap_or_default();
    let dotted = |parts: &[String]| parts.join(".");
    let with = |parts: &[String], last: &str| {
        let mut v = parts.to_vec();
        v.push(last.to_string());
        dotted(&v)
    };
    let mut out = origin.to_string();
    if let Some(l) = line {
        out.push_str(&format!(", line {l}"));
    }
    if let Some((bad, expected)) = unknown_name(msg, "unknown field") {
        // The line names the unknown key itself (`bad = ...` or a `[table.bad]` header) or its table.
        let parent: Vec<String> = if path.last() == Some(&bad) {
            path[..path.len() - 1].to_vec()
        } else {
            path.clone()
        };
        out.push_str(&format!(": unknown key `{}`", with(&parent, &bad)));
        match closest(&bad, &expected) {
            Some(best) => out.push_str(&format!("; did you mean `{}`?", with(&parent, best))),
            None => out.push_str(&format!("; valid keys here: {}", list(&expected))),
        }
    } else if let Some((bad, expected)) = unknown_name(msg, "unknown variant") {
        out.push_str(&format!(
            ": `{}` = \"{bad}\" is not a valid value",
            dotted(&path)
        ));
        match closest(&bad, &expected) {
            Some(best) => out.push_str(&format!("; did you mean \"{best}\"?")),
            None => out.push_str(&format!("; expected one of {}", list(&expected))),
        }
    } else if let Some((given, kinds)) = tagged_table_expected(msg) {
        out.push_str(&format!(
            ": `{}` is {given}, where a table with a `kind` is expected, one of {}, e.g. `{{ kind = \"{}\" }}`",
            dotted(&path),
            list(&kinds),
            kinds[0]
        ));
    } else if let Some(field) = msg
        .strip_prefix("missing field `")
        .and_then(|r| r.split('`').next())
    {
        // toml points a missing top-level key at the document's start, which is the first table's header
        // when the file starts with one ("missing key `model.run_dir`"): a top-level key the document's top
        // level lacks is named there.
        let top_level = TOP_LEVEL_REQUIRED.contains(&field)
            && text
                .parse::<toml::Table>()
                .is_ok_and(|t| !t.contains_key(field));
        let parent = if top_level { &[][..] } else { &path[..] };
        out.push_str(&format!(": missing key `{}`", with(parent, field)));
    } else if !path.is_empty() {
        out.push_str(&format!(": `{}`: {msg}", dotted(&path)));
    } else {
        out.push_str(&format!(": {msg}"));
    }
    if lines {
        anyhow::anyhow!("{out}\n{}", snippet_of(e))
    } else {
        anyhow::anyhow!("{out}")
    }
}

/// The lines of toml's error that show the text with a caret under the fault (`  |`, `3 | key = ...`,
/// `  |    ^^^`), without its header and its message, which the line above them already says.
fn snippet_of(e: &toml::de::Error) -> String {
    let text = e.to_string();
    let snippet: Vec<&str> = text
        .lines()
        .filter(|l| {
            let head = l.split('|').next().unwrap_or("");
            l.contains('|') && head.trim().chars().all(|c| c.is_ascii_digit())
        })
        .collect();
    if snippet.is_empty() {
        text
    } else {
        snippet.join("\n")
    }
}

/// Refuses a float that f32 would turn into 0 or infinity (nonzero below about 7e-46, or finite above
/// about 3.4e38): most float settings are kept as f32, where such a value silently becomes another one (a
/// weight decay turned off, a clip range without bound), and no setting means anything at such magnitudes.
/// Non-finite values are left to [`TrainConfig::validate`], which names each key's rule.
pub(super) fn check_float_range(table: &toml::Table, path: &mut Vec<String>) -> anyhow::Result<()> {
    for (key, value) in table {
        path.push(key.clone());
        check_value_range(value, path)?;
        path.pop();
    }
    Ok(())
}

fn check_value_range(value: &toml::Value, path: &mut Vec<String>) -> anyhow::Result<()> {
    match value {
        toml::Value::Float(v) => {
            let stored = *v as f32;
            let changed = (v.is_finite() && stored.is_infinite()) || (*v != 0.0 && stored == 0.0);
            if changed {
                bail!(
                    "`{}` = {v:e}: no float setting can hold it: as f32, in which most are kept, it would \
                     be {}",
                    path.iter().fold(String::new(), |mut out, part| {
                        if !out.is_empty() && !part.starts_with('[') {
                            out.push('.');
                        }
                        out.push_str(part);
                        out
                    }),
                    if stored == 0.0 { "0".to_string() } else { format!("{stored:e}") }
                );
            }
        }
        toml::Value::Table(t) => check_float_range(t, path)?,
        toml::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                path.push(format!("[{i}]"));
                check_value_range(item, path)?;
                path.pop();
            }
        }
        _ => {}
    }
    Ok(())
}

/// The keys a run config must give at its top level (the fields of [`TrainConfig`] without a default).
const TOP_LEVEL_REQUIRED: [&str; 6] = ["run_dir", "model", "task", "rollout", "train", "eval"];

fn list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `(what was given, the valid kinds)` from serde's "invalid type: string \"plain\", expected internally
/// tagged enum TemplateConfig": a config's tagged table (`task`, `task.template`, a correction) written as
/// a plain value, which serde's message names by the Rust type alone.
fn tagged_table_expected(msg: &str) -> Option<(String, Vec<String>)> {
    let (given, type_name) = msg
        .strip_prefix("invalid type: ")?
        .split_once(", expected internally tagged enum ")?;
    let kinds = match type_name.trim() {
        "TaskConfig" => kinds_of::<TaskConfig>(),
        "TemplateConfig" => kinds_of::<crate::tasks::TemplateConfig>(),
        "CorrectionConfig" => kinds_of::<crate::rl::corrections::CorrectionConfig>(),
        _ => None,
    }?;
    (!kinds.is_empty()).then(|| (given.to_string(), kinds))
}

/// The `kind`s a tagged config table `T` accepts, read from serde's own refusal of an empty kind (so the
/// list cannot fall out of step with the enum).
fn kinds_of<T: serde::de::DeserializeOwned>() -> Option<Vec<String>> {
    let e = toml::from_str::<T>("kind = \"\"").err()?;
    Some(unknown_name(e.message(), "unknown variant")?.1)
}

/// `(name, expected names)` from serde's "unknown field `x`, expected one of `a`, `b`" (or variant).
fn unknown_name(msg: &str, what: &str) -> Option<(String, Vec<String>)> {
    let rest = msg.split_once(&format!("{what} `"))?.1;
    let (bad, tail) = rest.split_once('`')?;
    let expected = tail
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    Some((bad.to_string(), expected))
}

/// The key path of the TOML line around byte `pos`: a `[header]` line's table, or the nearest header
/// above followed by the key before `=`.
fn key_path_at(text: &str, pos: usize) -> Vec<String> {
    if let Some(path) = key_path_by_spans(text, pos) {
        return path;
    }
    let line_start = text[..pos].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[pos..].find('\n').map_or(text.len(), |i| pos + i);
    let split = |s: &str| -> Vec<String> {
        s.split('.')
            .map(|p| p.trim().trim_matches('"').trim_matches('\'').to_string())
            .filter(|p| !p.is_empty())
            .collect()
    };
    let header = |l: &str| -> Option<Vec<String>> {
        let l = l.trim();
        if !l.starts_with('[') {
            return None;
        }
        let inner = l.trim_start_matches('[');
        Some(split(inner.split(']').next().unwrap_or("")))
    };
    let line = &text[line_start..line_end];
    if let Some(h) = header(line) {
        return h;
    }
    let mut path = text[..line_start]
        .lines()
        .rev()
        .find_map(header)
        .unwrap_or_default();
    if let Some((k, _)) = line.split_once('=') {
        path.extend(split(k));
    }
    path
}

/// The key path at byte `pos` of TOML `text` from the parsed document's spans: the innermost key or
/// value whose span holds it, an element of an array named by its index (`corrections[0]`: an unknown key
/// in the first `[[train.loss.corrections]]` was named `train.loss.corrections.extra`, without saying
/// which correction). `None` where the text does not parse or no span holds `pos`.
fn key_path_by_spans(text: &str, pos: usize) -> Option<Vec<String>> {
    let doc = toml::de::DeTable::parse(text).ok()?;
    let mut found = SpanSearch {
        pos,
        best: None,
        path: Vec::new(),
    };
    found.table(doc.get_ref());
    found.best.map(|(_, path)| path)
}

/// The walk of [`key_path_by_spans`]: the path so far, and the smallest span holding `pos` with its path.
struct SpanSearch {
    pos: usize,
    best: Option<(usize, Vec<String>)>,
    path: Vec<String>,
}

impl SpanSearch {
    fn consider(&mut self, span: std::ops::Range<usize>) {
        let holds = span.contains(&self.pos) || (span.is_empty() && span.start == self.pos);
        if holds && self.best.as_ref().is_none_or(|(len, _)| span.len() <= *len) {
            self.best = Some((span.len(), self.path.clone()));
        }
    }

    fn table(&mut self, table: &toml::de::DeTable<'_>) {
        for (key, value) in table.iter() {
            self.path.push(key.get_ref().to_string());
            self.consider(key.span());
            self.value(value);
            self.path.pop();
        }
    }

    fn value(&mut self, value: &toml::Spanned<toml::de::DeValue<'_>>) {
        self.consider(value.span());
        match value.get_ref() {
            toml::de::DeValue::Table(t) => self.table(t),
            toml::de::DeValue::Array(items) => {
                let name = self.path.pop().unwrap_or_default();
                for (i, item) in items.iter().enumerate() {
                    self.path.push(format!("{name}[{i}]"));
                    self.value(item);
                    self.path.pop();
                }
                self.path.push(name);
            }
            _ => {}
        }
    }
}

/// Edit distance between two strings (Levenshtein, by characters).
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The candidate closest to `name`, when it is close enough to be a likely typo; or the one candidate
/// that `name` begins, up to a `_` (`ppo` for `ppo_clip`, which by edit distance is further than `grpo`).
pub fn closest<'a>(name: &str, candidates: &'a [String]) -> Option<&'a str> {
    let lower = name.to_lowercase();
    let mut extended = candidates.iter().filter(|c| {
        c.to_lowercase()
            .strip_prefix(&lower)
            .is_some_and(|rest| rest.starts_with('_'))
    });
    if let (Some(only), None) = (extended.next(), extended.next()) {
        return Some(only.as_str());
    }
    candidates
        .iter()
        .map(|c| (edit_distance(&lower, &c.to_lowercase()), c))
        .filter(|(d, c)| *d <= (c.chars().count().max(name.chars().count()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_path_names_the_table_and_the_key() {
        let text = "seed = 1\n[train.loss]\nobjective = \"x\"\n[eval]\n";
        let at = |needle: &str| key_path_at(text, text.find(needle).unwrap());
        assert_eq!(at("seed"), ["seed"]);
        assert_eq!(at("objective"), ["train", "loss", "objective"]);
        assert_eq!(at("[eval]"), ["eval"]);
    }

    /// An element of an array of tables, or of an inline array, is named by its index: an unknown key in
    /// the second correction was `train.loss.corrections.extra`, the same as one in the first.
    #[test]
    fn key_path_names_the_element_of_an_array() {
        let text =
            "[[train.loss.corrections]]\nkind = \"a\"\n[[train.loss.corrections]]\nkind = \"b\"\n\
                    extra = 1\n[rollout]\nstop = [\"x\", {bad = 2}]\n";
        let at = |needle: &str| key_path_at(text, text.find(needle).unwrap());
        assert_eq!(at("extra"), ["train", "loss", "corrections[1]", "extra"]);
        assert_eq!(
            at("kind = \"a\""),
            ["train", "loss", "corrections[0]", "kind"]
        );
        assert_eq!(at("bad"), ["rollout", "stop[1]", "bad"]);
        // Text that does not parse falls back to the lines' headers.
        let broken = "[train]\nlr = = 1\n";
        assert_eq!(
            key_path_at(broken, broken.find("lr").unwrap()),
            ["train", "lr"]
        );
    }

    #[test]
    fn closest_suggests_typos_only() {
        let keys: Vec<String> = ["samples_per_prompt", "precision"]
            .map(String::from)
            .to_vec();
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(
            closest("sample_per_prompt", &keys),
            Some("samples_per_prompt")
        );
        assert_eq!(closest("Precision", &keys), Some("precision"));
        assert_eq!(closest("temperature", &keys), None);
        let objectives: Vec<String> = ["grpo", "ppo_clip", "gspo"].map(String::from).to_vec();
        assert_eq!(closest("ppo", &objectives), Some("ppo_clip"));
        assert_eq!(closest("gpo", &objectives), Some("grpo"));
    }

    #[test]
    fn a_tagged_table_given_as_a_value_names_its_kinds() {
        let msg = "invalid type: string \"plain\", expected internally tagged enum TemplateConfig";
        let (given, kinds) = tagged_table_expected(msg).unwrap();
        assert_eq!(given, "string \"plain\"");
        assert_eq!(kinds, ["plain", "chat"]);
        let tasks = tagged_table_expected(
            "invalid type: integer `3`, expected internally tagged enum TaskConfig",
        );
        assert_eq!(tasks.unwrap().1, ["arithmetic", "gsm8k", "math"]);
        let corrections = kinds_of::<crate::rl::corrections::CorrectionConfig>().unwrap();
        assert!(
            corrections.contains(&"token_tis".to_string()),
            "{corrections:?}"
        );
        assert!(tagged_table_expected(
            "invalid type: string \"x\", expected internally tagged enum Other"
        )
        .is_none());
    }

    #[test]
    fn the_message_is_said_once_above_the_text_it_points_at() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct T {
            temperature: f32,
        }
        let text = "temperature = \"x\"\n";
        let e = toml::from_str::<T>(text).unwrap_err();
        let out = explain_toml_error(&e, text, "my.toml", true).to_string();
        assert_eq!(out.matches("invalid type").count(), 1, "{out}");
        assert!(out.starts_with("my.toml, line 1: "), "{out}");
        assert!(
            out.contains("1 | temperature = \"x\"") && out.contains("^^^"),
            "{out}"
        );
        assert!(!out.contains("TOML parse error"), "{out}");
    }

    #[test]
    fn floats_outside_f32_are_named_with_their_path() {
        let doc: toml::Table = "a = 1e-3\nb = 0.0\nc = inf\n[t]\nv = [{ w = 1e-46 }]\n"
            .parse()
            .unwrap();
        let err = check_float_range(&doc, &mut Vec::new()).unwrap_err();
        assert!(err.to_string().starts_with("`t.v[0].w` = 1e-46"), "{err}");
        // f32::MAX as Rust prints it, and a subnormal f32 keeps (1e-40): held, if not exactly.
        let ok: toml::Table = "a = 3.4028235e38\nb = -1.2e-38\nc = nan\nd = 1e-40"
            .parse()
            .unwrap();
        check_float_range(&ok, &mut Vec::new()).unwrap();
    }
}
