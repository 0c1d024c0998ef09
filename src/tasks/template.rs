//! Prompt templates: `plain` (`Question: {q}\nAnswer:`, both parts configurable) and `chat` (ChatML:
//! `<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n`, optionally after a system turn).
//!
//! A chat template can be checked against a model directory: its `tokenizer_config.json` `chat_template` (or a
//! `chat_template.jinja` file) must be the ChatML form (Qwen2/2.5/3 are); any other template is a clear error,
//! since rendering arbitrary Jinja is not supported. A directory without a chat template gets ChatML.
//!
//! [`Template::render_completion`] gives the text that follows the prompt for supervised training: plain adds
//! a space after an answer prefix that does not end in whitespace; chat closes the turn with `<|im_end|>`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// Errors of the templates; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The I/O error is in the message, not a `source`: anyhow's `{:#}` would print it twice.
    #[error("{path}: {io}")]
    Io { path: PathBuf, io: std::io::Error },
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    #[error(
        "{path}: the chat template is not the ChatML form (`<|im_start|>role\\n...<|im_end|>`); only ChatML is \
         supported: use a ChatML model or the `plain` template"
    )]
    NotChatMl { path: PathBuf },
}

/// Serde form of a template: `{ kind = "plain", question_prefix = "...", answer_prefix = "..." }` or
/// `{ kind = "chat", model_dir = "...", system = "..." }`. Each kind's fields are a struct of their own,
/// so a config error inside a `[task.template]` table can be located by reading the table as its kind's
/// struct ([`TemplateConfig::locate_error`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum TemplateConfig {
    Plain(PlainTemplate),
    Chat(ChatTemplate),
}

/// The `plain` template's fields: `{question_prefix}{question}{answer_prefix}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlainTemplate {
    #[serde(default = "default_question_prefix")]
    pub question_prefix: String,
    #[serde(default = "default_answer_prefix")]
    pub answer_prefix: String,
}

/// The `chat` template's fields.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatTemplate {
    /// Model directory whose chat template must be ChatML (checked when the template is built).
    #[serde(default)]
    pub model_dir: Option<PathBuf>,
    /// Optional system turn.
    #[serde(default)]
    pub system: Option<String>,
}

fn default_question_prefix() -> String {
    "Question: ".into()
}

fn default_answer_prefix() -> String {
    "\nAnswer:".into()
}

impl Default for PlainTemplate {
    fn default() -> Self {
        Self {
            question_prefix: default_question_prefix(),
            answer_prefix: default_answer_prefix(),
        }
    }
}

impl Default for TemplateConfig {
    fn default() -> Self {
        TemplateConfig::Plain(PlainTemplate::default())
    }
}

impl TemplateConfig {
    /// The error of a `template` table read as its kind's struct, which points at the field at fault
    /// (read as the `[task]` table is: [`super::TaskConfig::locate_error`]); `None` where it reads.
    pub fn locate_error(table: &toml::Spanned<toml::de::DeValue<'_>>) -> Option<toml::de::Error> {
        let (kind, fields) = super::kind_and_fields(table)?;
        match kind.as_str() {
            "plain" => PlainTemplate::deserialize(fields).err(),
            "chat" => ChatTemplate::deserialize(fields).err(),
            _ => None,
        }
    }
}

/// A prompt template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Template {
    /// `{question_prefix}{question}{answer_prefix}`.
    Plain {
        question_prefix: String,
        answer_prefix: String,
    },
    /// ChatML with an optional system turn.
    Chat { system: Option<String> },
}

impl Default for Template {
    fn default() -> Self {
        Template::Plain {
            question_prefix: default_question_prefix(),
            answer_prefix: default_answer_prefix(),
        }
    }
}

impl Template {
    /// ChatML without a system turn.
    pub fn chatml() -> Self {
        Template::Chat { system: None }
    }

    /// Builds a template from its config (a chat template with `model_dir` is checked against the model).
    pub fn from_config(cfg: &TemplateConfig) -> Result<Self, TemplateError> {
        match cfg {
            TemplateConfig::Plain(PlainTemplate {
                question_prefix,
                answer_prefix,
            }) => Ok(Template::Plain {
                question_prefix: question_prefix.clone(),
                answer_prefix: answer_prefix.clone(),
            }),
            TemplateConfig::Chat(ChatTemplate { model_dir, system }) => {
                if let Some(dir) = model_dir {
                    // A folder that is not there has no chat template to check against: the prompts would
                    // silently follow ChatML whatever the model's own template is.
                    if !dir.is_dir() {
                        return Err(TemplateError::Invalid {
                            path: dir.clone(),
                            msg: "`task.template.model_dir` is not a folder (the model whose chat \
                                  template the prompts follow)"
                                .into(),
                        });
                    }
                    chat_template_of_model(dir)?;
                }
                Ok(Template::Chat {
                    system: system.clone(),
                })
            }
        }
    }

    /// The chat template of a model directory (see the module documentation), without a system turn.
    pub fn chat_from_model_dir(dir: impl AsRef<Path>) -> Result<Self, TemplateError> {
        chat_template_of_model(dir.as_ref())?;
        Ok(Template::chatml())
    }

    /// The prompt for `question`.
    pub fn render_prompt(&self, question: &str) -> String {
        match self {
            Template::Plain {
                question_prefix,
                answer_prefix,
            } => format!("{question_prefix}{question}{answer_prefix}"),
            Template::Chat { system } => {
                let mut s = String::new();
                if let Some(sys) = system {
                    s.push_str(&format!("{IM_START}system\n{sys}{IM_END}\n"));
                }
                s.push_str(&format!(
                    "{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"
                ));
                s
            }
        }
    }

    /// The completion that follows the prompt for a worked `solution` (supervised text = prompt + this).
    pub fn render_completion(&self, solution: &str) -> String {
        match self {
            Template::Plain { answer_prefix, .. } => {
                if answer_prefix.is_empty() || answer_prefix.ends_with(char::is_whitespace) {
                    solution.to_string()
                } else {
                    format!(" {solution}")
                }
            }
            Template::Chat { .. } => format!("{solution}{IM_END}"),
        }
    }

    /// Strings that end a generated answer under this template.
    pub fn stop_strings(&self) -> Vec<String> {
        match self {
            Template::Plain {
                question_prefix, ..
            } => {
                let q = question_prefix.trim();
                if q.is_empty() {
                    vec![]
                } else {
                    vec![format!("\n{q}")]
                }
            }
            Template::Chat { .. } => vec![IM_END.to_string()],
        }
    }
}

/// Reads the chat template of a model directory and checks that it is ChatML. `Ok(None)` when the directory
/// has none (then ChatML is used).
pub fn chat_template_of_model(dir: &Path) -> Result<Option<String>, TemplateError> {
    let cfg_path = dir.join("tokenizer_config.json");
    let mut found: Option<(PathBuf, String)> = None;
    if cfg_path.is_file() {
        let text = std::fs::read_to_string(&cfg_path).map_err(|io| TemplateError::Io {
            path: cfg_path.clone(),
            io,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| TemplateError::Invalid {
                path: cfg_path.clone(),
                msg: format!("not valid JSON: {e}"),
            })?;
        match v.get("chat_template") {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(s)) => found = Some((cfg_path.clone(), s.clone())),
            Some(serde_json::Value::Array(list)) => {
                // [{"name": "default", "template": "..."}, ...]
                let pick = list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str());
                match pick {
                    Some(s) => found = Some((cfg_path.clone(), s.to_string())),
                    None => {
                        return Err(TemplateError::Invalid {
                            path: cfg_path,
                            msg: "`chat_template` is a list without a `template` string".into(),
                        })
                    }
                }
            }
            Some(_) => {
                return Err(TemplateError::Invalid {
                    path: cfg_path,
                    msg: "`chat_template` is neither a string nor a list of named templates".into(),
                })
            }
        }
    }
    if found.is_none() {
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let s = std::fs::read_to_string(&jinja).map_err(|io| TemplateError::Io {
                path: jinja.clone(),
                io,
            })?;
            found = Some((jinja, s));
        }
    }
    match found {
        None => Ok(None),
        Some((path, t)) => {
            if t.contains(IM_START) && t.contains(IM_END) && t.contains("assistant") {
                Ok(Some(t))
            } else {
                Err(TemplateError::NotChatMl { path })
            }
        }
    }
}
