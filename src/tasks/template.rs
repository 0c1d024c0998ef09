//! Prompt templates: `plain` (`Question: {q}\nAnswer:`, both parts configurable) and `chat`: the model's own
//! chat template ([`ModelChatTemplate`], rendered as transformers renders it) where the model's folder
//! declares one, else ChatML (`<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n`, optionally after
//! a system turn).
//!
//! [`Template::render_completion`] gives the text that follows the prompt for supervised training: plain adds
//! a space after an answer prefix that does not end in whitespace; chat closes the turn as the template
//! closes an assistant's turn (ChatML: `<|im_end|>\n`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::chat_template::Turn;
pub use super::chat_template::{ModelChatTemplate, TemplateError, IM_END, IM_START};

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
    /// Model directory whose chat template the prompts follow (ChatML where it declares none, or where no
    /// directory is given).
    #[serde(default)]
    pub model_dir: Option<PathBuf>,
    /// Optional system turn (without one, the model's template may write its own default).
    #[serde(default)]
    pub system: Option<String>,
    /// The template's `enable_thinking` switch (Qwen3: `false` closes an empty `<think>` block after the
    /// assistant's opening); refused for a template that does not read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_thinking: Option<bool>,
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
    /// A chat: the model's own template (`model`), else ChatML, with an optional system turn.
    Chat {
        system: Option<String>,
        model: Option<ModelChatTemplate>,
        /// `enable_thinking` for the model's template (only with `model`, and only one that reads it).
        enable_thinking: Option<bool>,
    },
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
        Template::Chat {
            system: None,
            model: None,
            enable_thinking: None,
        }
    }

    /// Builds a template from its config (a chat template with `model_dir` follows that model's template).
    pub fn from_config(cfg: &TemplateConfig) -> Result<Self, TemplateError> {
        match cfg {
            TemplateConfig::Plain(PlainTemplate {
                question_prefix,
                answer_prefix,
            }) => Ok(Template::Plain {
                question_prefix: question_prefix.clone(),
                answer_prefix: answer_prefix.clone(),
            }),
            TemplateConfig::Chat(ChatTemplate {
                model_dir,
                system,
                enable_thinking,
            }) => {
                let Some(dir) = model_dir else {
                    if enable_thinking.is_some() {
                        return Err(TemplateError::Invalid {
                            path: "task.template".into(),
                            msg:
                                "`enable_thinking` is a switch of a model's own chat template: set \
                                  `model_dir` to the model whose template reads it"
                                    .into(),
                        });
                    }
                    return Ok(Template::Chat {
                        system: system.clone(),
                        model: None,
                        enable_thinking: None,
                    });
                };
                // A folder that is not there has no chat template to follow: the prompts would silently
                // be ChatML whatever the model's own template is.
                if !dir.is_dir() {
                    return Err(TemplateError::Invalid {
                        path: dir.clone(),
                        msg: "`task.template.model_dir` is not a folder (the model whose chat \
                              template the prompts follow)"
                            .into(),
                    });
                }
                Self::chat_for_model(dir, system.clone(), *enable_thinking)
            }
        }
    }

    /// The chat template of the model in `dir` (its own, else ChatML) with `system` and `enable_thinking`,
    /// checked by rendering a probe prompt: a template that cannot render one, or that `enable_thinking`
    /// would be set for nothing, is refused here, naming its file (a template whose conversations cannot
    /// be split for SFT is refused where a warm start asks for its completions).
    pub fn chat_for_model(
        dir: &Path,
        system: Option<String>,
        enable_thinking: Option<bool>,
    ) -> Result<Self, TemplateError> {
        let model = ModelChatTemplate::of_model(dir)?;
        match (&model, enable_thinking) {
            (None, Some(_)) => return Err(TemplateError::Invalid {
                path: dir.to_path_buf(),
                msg: "`enable_thinking` is set, but the model declares no chat template to read it"
                    .into(),
            }),
            (Some(m), Some(_)) if !m.reads("enable_thinking") => {
                return Err(TemplateError::Invalid {
                    path: m.path.clone(),
                    msg: "`enable_thinking` is set, but this chat template never reads it".into(),
                })
            }
            _ => {}
        }
        // A system turn the template never writes would be recorded as part of the prompt and change
        // nothing (`enable_thinking` above is refused alike): probed with a text of our own, so that a
        // system equal to the template's default still passes.
        if let (Some(m), Some(_)) = (&model, &system) {
            let probe = |system: Option<&str>| {
                Template::Chat {
                    system: system.map(str::to_string),
                    model: Some(m.clone()),
                    enable_thinking,
                }
                .render_prompt("What is 2 + 3?")
            };
            if probe(Some("qarl probe of the system turn"))? == probe(None)? {
                return Err(TemplateError::Invalid {
                    path: m.path.clone(),
                    msg:
                        "a system prompt is set, but this chat template never writes a system turn"
                            .into(),
                });
            }
        }
        let template = Template::Chat {
            system,
            model,
            enable_thinking,
        };
        template.render_prompt("What is 2 + 3?")?;
        Ok(template)
    }

    /// The chat template of the model in `dir`, without a system turn.
    pub fn chat_from_model_dir(dir: impl AsRef<Path>) -> Result<Self, TemplateError> {
        Self::chat_for_model(dir.as_ref(), None, None)
    }

    /// Whether a prompt of this template starts with the tokenizer's BOS ([`Tokenizer::encode_prompt`]):
    /// a plain prompt is a text, encoded as transformers encodes a text; a chat template writes its own.
    ///
    /// [`Tokenizer::encode_prompt`]: crate::model::Tokenizer::encode_prompt
    pub fn prompt_takes_bos(&self) -> bool {
        self.is_plain()
    }

    /// Whether this is the plain `Question: ... Answer:` template (a text, no chat turns).
    pub fn is_plain(&self) -> bool {
        matches!(self, Template::Plain { .. })
    }

    /// The prompt for `question`.
    pub fn render_prompt(&self, question: &str) -> Result<String, TemplateError> {
        match self {
            Template::Plain {
                question_prefix,
                answer_prefix,
            } => Ok(format!("{question_prefix}{question}{answer_prefix}")),
            Template::Chat {
                system,
                model: None,
                ..
            } => {
                let mut s = String::new();
                if let Some(sys) = system {
                    s.push_str(&format!("{IM_START}system\n{sys}{IM_END}\n"));
                }
                s.push_str(&format!(
                    "{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"
                ));
                Ok(s)
            }
            Template::Chat { model: Some(m), .. } => {
                m.render(&self.turns(question, None), true, &self.variables())
            }
        }
    }

    /// The completion that follows the prompt of `question` for a worked `solution` (supervised text =
    /// prompt + this). A model's template renders the whole conversation with the assistant's turn, and the
    /// completion is all that follows the prompt (the turn's end marker and what the template writes after
    /// it), as TRL splits a conversational prompt-completion example (it appends no EOS to it either:
    /// [`Self::completion_closes_turn`]); a template whose conversation does not start with its prompt (a
    /// reasoning model's, whose prompt opens a `<think>` block that past turns leave out) cannot be split
    /// and is refused.
    pub fn render_completion(
        &self,
        question: &str,
        solution: &str,
    ) -> Result<String, TemplateError> {
        match self {
            Template::Plain { answer_prefix, .. } => Ok(
                if answer_prefix.is_empty() || answer_prefix.ends_with(char::is_whitespace) {
                    solution.to_string()
                } else {
                    format!(" {solution}")
                },
            ),
            // The whole turn, as a ChatML model's own template writes it and TRL splits it: the end marker
            // and the newline after it (an example without the newline trained one token less than the
            // same model's template renders, and logged another loss).
            Template::Chat { model: None, .. } => Ok(format!("{solution}{IM_END}\n")),
            Template::Chat { model: Some(m), .. } => {
                let prompt = self.render_prompt(question)?;
                let whole = m.render(
                    &self.turns(question, Some(solution)),
                    false,
                    &self.variables(),
                )?;
                match whole.strip_prefix(&prompt) {
                    Some(rest) => Ok(rest.to_string()),
                    None => Err(TemplateError::Invalid {
                        path: m.path.clone(),
                        msg: "the chat template renders a conversation that does not start with its \
                              prompt (the prompt with `add_generation_prompt`), so a worked solution \
                              cannot be split from it"
                            .into(),
                    }),
                }
            }
        }
    }

    /// Whether a completion of this template ends the assistant's turn itself (a model's template writes
    /// the turn's end): then a supervised example gets no EOS after it.
    pub fn completion_closes_turn(&self) -> bool {
        matches!(self, Template::Chat { .. })
    }

    fn turns<'a>(&'a self, question: &'a str, answer: Option<&'a str>) -> Vec<Turn<'a>> {
        let Template::Chat { system, .. } = self else {
            return vec![];
        };
        let system = system.as_deref().map(|content| Turn {
            role: "system",
            content,
        });
        let user = Some(Turn {
            role: "user",
            content: question,
        });
        let assistant = answer.map(|content| Turn {
            role: "assistant",
            content,
        });
        [system, user, assistant].into_iter().flatten().collect()
    }

    fn variables(&self) -> Vec<(&'static str, serde_json::Value)> {
        match self {
            Template::Chat {
                enable_thinking: Some(on),
                ..
            } => vec![("enable_thinking", serde_json::Value::Bool(*on))],
            _ => vec![],
        }
    }

    /// What closes the assistant's turn under a chat template (its [`Self::stop_strings`]), none for the
    /// plain template: the turn ends a chat completion is taught to end with, which rollouts stop at
    /// ([`crate::model::EndTokens::with_turn_ends`]).
    pub fn turn_ends(&self) -> Vec<String> {
        match self {
            Template::Plain { .. } => vec![],
            Template::Chat { .. } => self.stop_strings(),
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
            Template::Chat { model: None, .. } => vec![IM_END.to_string()],
            Template::Chat { model: Some(m), .. } => {
                // What the template writes after an answer to close the turn (`<|eot_id|>`,
                // `<end_of_turn>`), where a probe conversation shows it; else its ChatML and EOS tokens.
                const ANSWER: &str = "ANSWER-4f1c";
                let closing = self
                    .render_completion("What is 2 + 3?", ANSWER)
                    .ok()
                    .and_then(|c| {
                        let end = c[c.find(ANSWER)? + ANSWER.len()..].trim().to_string();
                        (!end.is_empty()).then_some(end)
                    });
                let mut ends = m.turn_ends();
                if let Some(end) = closing.filter(|e| !ends.contains(e)) {
                    ends.insert(0, end);
                }
                ends
            }
        }
    }
}
