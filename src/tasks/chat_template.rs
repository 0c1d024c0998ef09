//! A model's own chat template: the Jinja text its files declare, rendered as transformers'
//! `apply_chat_template` renders it, so that a prompt is the one the model was tuned on, whatever the
//! template (a default system turn, a `<think>` block, a BOS written by the template itself).
//!
//! Where the template comes from follows transformers: `chat_template.jinja` wins over the
//! `chat_template` of `tokenizer_config.json` (a re-saved checkpoint keeps its new template there). The
//! environment is transformers': blocks trimmed and left-stripped, loop controls, `raise_exception`, the
//! special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`) of `tokenizer_config.json`, and
//! Python's string methods (`.strip()`, `.split()`, `.startswith()`), Python's `tojson` (no HTML escapes) and dict order,
//! `tools` and `documents` as None, and the `{% generation %}` tags of assistant-masking templates
//! (rendering nothing). `strftime_now` renders a fixed date, Llama 3.1's own fallback (26 July 2024), so a
//! prompt does not change with the day a run is started or resumed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

/// ChatML's turn markers: the template used where a model declares none, and a turn end that a model's
/// template may write.
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// Errors of the chat templates and of the prompt templates built on them; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The I/O error is in the message, not a `source`: anyhow's `{:#}` would print it twice.
    #[error("{path}: {io}")]
    Io { path: PathBuf, io: std::io::Error },
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
}

/// The special tokens a template may write, as transformers passes them.
const SPECIAL_TOKENS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

/// A model's chat template with the special tokens it is rendered with.
#[derive(Clone)]
pub struct ModelChatTemplate {
    /// The file it was read from (named in every error).
    pub path: PathBuf,
    pub source: String,
    /// `(name, token)` of [`SPECIAL_TOKENS`] that `tokenizer_config.json` sets.
    specials: Vec<(String, String)>,
    /// The parsed template, shared by every prompt (a data set's examples are rendered at once).
    env: Arc<minijinja::Environment<'static>>,
}

impl PartialEq for ModelChatTemplate {
    fn eq(&self, other: &Self) -> bool {
        (&self.path, &self.source, &self.specials) == (&other.path, &other.source, &other.specials)
    }
}

impl Eq for ModelChatTemplate {}

impl std::fmt::Debug for ModelChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelChatTemplate")
            .field("path", &self.path)
            .field("specials", &self.specials)
            .finish_non_exhaustive()
    }
}

/// One turn of a conversation.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Turn<'a> {
    pub role: &'a str,
    pub content: &'a str,
}

impl ModelChatTemplate {
    /// The chat template of the model in `dir`; `None` where its files declare none.
    pub fn of_model(dir: &Path) -> Result<Option<Self>, TemplateError> {
        let cfg_path = dir.join("tokenizer_config.json");
        let config = if cfg_path.is_file() {
            Some(read_json(&cfg_path)?)
        } else {
            None
        };
        let specials = config.as_ref().map(special_tokens).unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        let (path, source) = if jinja.is_file() {
            (jinja.clone(), read_text(&jinja)?)
        } else {
            match config.as_ref().map(|c| template_in_config(&cfg_path, c)) {
                Some(Ok(Some(source))) => (cfg_path, source),
                Some(Err(e)) => return Err(e),
                Some(Ok(None)) | None => return Ok(None),
            }
        };
        // An empty template is refused where it is: every prompt would render to nothing, and the error
        // would come at the first prompt, naming the data file's line.
        if source.trim().is_empty() {
            return Err(TemplateError::Invalid {
                path,
                msg: "the chat template is empty: every prompt would render to nothing; remove it to \
                      prompt with ChatML, or use the plain template"
                    .into(),
            });
        }
        // A template that does not parse is reported where the model is named, not at the first prompt.
        let env = Arc::new(environment(&source).map_err(|e| error(&path, &e))?);
        Ok(Some(Self {
            path,
            source,
            specials,
            env,
        }))
    }

    /// The strings that end an assistant's turn under this template: ChatML's `<|im_end|>` where the
    /// template writes it, and the EOS token of `tokenizer_config.json`.
    pub fn turn_ends(&self) -> Vec<String> {
        let mut ends = Vec::new();
        if self.source.contains(IM_END) {
            ends.push(IM_END.to_string());
        }
        let eos = self.specials.iter().find(|(name, _)| name == "eos_token");
        if let Some((_, token)) = eos {
            if !token.is_empty() && !ends.contains(token) {
                ends.push(token.clone());
            }
        }
        ends
    }

    /// Whether the template reads the variable `name` (`enable_thinking`): a switch it never reads would be
    /// set for nothing.
    pub fn reads(&self, name: &str) -> bool {
        self.source.contains(name)
    }

    /// The template's text for `turns`, with the assistant's opening where `add_generation_prompt`, and
    /// `variables` (such as `enable_thinking`) beside the messages and the special tokens.
    pub fn render(
        &self,
        turns: &[Turn<'_>],
        add_generation_prompt: bool,
        variables: &[(&str, Value)],
    ) -> Result<String, TemplateError> {
        use minijinja::Value as J;
        // The messages as transformers passes them, `role` before `content`: maps keep their order
        // (minijinja's `preserve_order`), so `tojson` of a message and a loop over its items read them as
        // Python does (serde_json's maps sorted them, `content` first).
        let mut ctx: Vec<(String, J)> = vec![
            ("messages".into(), J::from(minijinja::value::Serde(turns))),
            (
                "add_generation_prompt".into(),
                J::from(add_generation_prompt),
            ),
        ];
        // transformers passes `tools` and `documents` as None where a prompt has none: a template's
        // `tools is not none` is false, not true of an undefined value.
        for name in ["tools", "documents"] {
            ctx.push((name.into(), J::from(())));
        }
        for (name, token) in &self.specials {
            ctx.push((name.clone(), J::from(token.as_str())));
        }
        for (name, value) in variables {
            ctx.push(((*name).to_string(), J::from(minijinja::value::Serde(value))));
        }
        let ctx = J::from_pairs(ctx);
        let render = || self.env.get_template("chat")?.render(ctx);
        render().map_err(|e| error(&self.path, &e))
    }
}

/// transformers' Jinja environment (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
/// extensions=[loopcontrols])` with `raise_exception`) holding `source` as the template `chat`.
fn environment(source: &str) -> Result<minijinja::Environment<'static>, minijinja::Error> {
    let mut env = minijinja::Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, _> {
        Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            msg,
        ))
    });
    env.add_function("strftime_now", fixed_date);
    env.add_filter("tojson", python_tojson);
    env.set_fuel(Some(RENDER_FUEL));
    env.add_template_owned("chat", without_generation_tags(source))?;
    Ok(env)
}

/// The date every prompt is rendered with, where a template asks for today's (`strftime_now`): Llama 3.1's
/// own fallback, Friday 26 July 2024, so that a prompt does not change with the day a run is started,
/// resumed or evaluated. `(directive, text)` for the directives of Python's `strftime` templates use.
const FIXED_DATE: [(char, &str); 13] = [
    ('d', "26"),
    ('e', "26"),
    ('m', "07"),
    ('Y', "2024"),
    ('y', "24"),
    ('b', "Jul"),
    ('B', "July"),
    ('a', "Fri"),
    ('A', "Friday"),
    ('j', "208"),
    ('H', "00"),
    ('M', "00"),
    ('S', "00"),
];

/// `strftime_now(format)` on [`FIXED_DATE`]; a directive it does not know is an error naming it.
fn fixed_date(format: String) -> Result<String, minijinja::Error> {
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('%') => out.push('%'),
            Some(d) => match FIXED_DATE.iter().find(|(k, _)| *k == d) {
                Some((_, text)) => out.push_str(text),
                None => {
                    return Err(minijinja::Error::new(
                        minijinja::ErrorKind::InvalidOperation,
                        format!("strftime_now: the directive %{d} is not supported"),
                    ))
                }
            },
            None => out.push('%'),
        }
    }
    Ok(out)
}

/// The escapes minijinja's `tojson` writes for HTML, with the characters they stand for.
const HTML_ESCAPES: [(&str, char); 4] = [
    ("\\u003c", '<'),
    ("\\u003e", '>'),
    ("\\u0026", '&'),
    ("\\u0027", '\''),
];

/// transformers' `tojson` (`json.dumps(value, ensure_ascii=False)`, `", "` and `": "` between items,
/// `indent` for pretty printing): minijinja's own, which also escapes `<`, `>`, `&` and `'` for HTML
/// (`\u003c`: a tool schema of `a<b` rendered to other tokens), with those escapes undone.
fn python_tojson(
    value: &minijinja::Value,
    indent: Option<minijinja::Value>,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let html_safe = minijinja::filters::tojson(value, indent, kwargs)?;
    let text = html_safe.as_str().unwrap_or_default();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    // Left to right over escapes, so that an escaped backslash followed by `u003c` stays as it is.
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let escape = &rest[at..];
        match HTML_ESCAPES.iter().find(|(e, _)| escape.starts_with(e)) {
            Some((e, c)) => {
                out.push(*c);
                rest = &escape[e.len()..];
            }
            None => {
                let len = escape.chars().take(2).map(char::len_utf8).sum();
                out.push_str(&escape[..len]);
                rest = &escape[len..];
            }
        }
    }
    out.push_str(rest);
    Ok(minijinja::Value::from_safe_string(out))
}

/// `source` with transformers' `{% generation %}` / `{% endgeneration %}` tags (which mark the assistant's
/// tokens for an assistant-only loss and render nothing) as `{% if true %}` / `{% endif %}`: the same
/// text, their whitespace controls (`{%-`, `-%}`) kept.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let left = inner
            .strip_prefix(['-', '+'])
            .map(|_| &inner[..1])
            .unwrap_or("");
        let right = inner
            .strip_suffix(['-', '+'])
            .map(|_| &inner[inner.len() - 1..])
            .unwrap_or("");
        let word = inner[left.len()..inner.len() - right.len()].trim();
        let replaced = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replaced {
            Some(w) => out.push_str(&format!("{{%{left} {w} {right}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// The most steps (minijinja's instructions) one render may take: real templates take a few thousand per
/// conversation, and a template that loops without end (or for minutes) is refused in well under a second.
const RENDER_FUEL: u64 = 20_000_000;

/// Parses `source` as a chat template: `Err` holds the parser's message. For importers, which write a
/// template that every later prompt will be rendered with.
pub fn check_template_source(source: &str) -> Result<(), String> {
    environment(source).map(drop).map_err(|e| e.to_string())
}

fn error(path: &Path, e: &minijinja::Error) -> TemplateError {
    let msg = if e.kind() == minijinja::ErrorKind::OutOfFuel {
        format!(
            "the chat template does not finish rendering within {RENDER_FUEL} steps (a loop without end?): {e}"
        )
    } else {
        format!("the chat template does not render: {e}")
    };
    TemplateError::Invalid {
        path: path.to_path_buf(),
        msg,
    }
}

fn read_text(path: &Path) -> Result<String, TemplateError> {
    std::fs::read_to_string(path).map_err(|io| TemplateError::Io {
        path: path.to_path_buf(),
        io,
    })
}

/// A JSON object read from `path` (a `tokenizer_config.json`): anything else is an error, not a file
/// without a template (`[1, 2]` read as "no `chat_template`" prompted with ChatML instead).
fn read_json(path: &Path) -> Result<Value, TemplateError> {
    let invalid = |msg: String| TemplateError::Invalid {
        path: path.to_path_buf(),
        msg,
    };
    let value: Value = serde_json::from_str(&read_text(path)?)
        .map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(invalid("the top level must be a JSON object".into()));
    }
    Ok(value)
}

/// The `chat_template` of a `tokenizer_config.json`: a string, or a list of named templates (the one named
/// `default`; a list without one is refused, as transformers refuses it: "multiple chat templates with no
/// default specified").
fn template_in_config(path: &Path, config: &Value) -> Result<Option<String>, TemplateError> {
    let invalid = |msg: &str| TemplateError::Invalid {
        path: path.to_path_buf(),
        msg: msg.into(),
    };
    let template = match config.get("chat_template") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .ok_or_else(|| {
                invalid(
                    "`chat_template` is a list of named templates without one named `default` (transformers \
                     refuses it too: which one prompts the model would be a guess)",
                )
            })?
            .get("template")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| invalid("`chat_template`'s `default` entry has no `template` string"))?,
        Some(_) => {
            return Err(invalid(
                "`chat_template` is neither a string nor a list of named templates",
            ))
        }
    };
    Ok(Some(template))
}

/// The special tokens of a `tokenizer_config.json`: each a string or an added-token object with `content`.
fn special_tokens(config: &Value) -> Vec<(String, String)> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|&name| {
            let token = match config.get(name)? {
                Value::String(s) => s.clone(),
                Value::Object(o) => o.get("content")?.as_str()?.to_string(),
                _ => return None,
            };
            Some((name.to_string(), token))
        })
        .collect()
}
