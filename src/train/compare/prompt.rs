//! How an evaluation's prompts were rendered, in words: two evaluations are one arm's seeds only where
//! they answered the same prompts.

/// How prompts were rendered, in words: the template (`chat`: the model's own, `chatml`, `plain`, or a
/// plain template's prefixes, `arithmetic`'s own), with the system turn and `enable_thinking` where set.
pub fn prompt_text(template: &str, system: Option<&str>, enable_thinking: Option<bool>) -> String {
    format!("{template}{}", prompt_switches(system, enable_thinking))
}

/// A chat template's switches in words, where set: `, system "..."` and `, enable_thinking false`.
pub fn prompt_switches(system: Option<&str>, enable_thinking: Option<bool>) -> String {
    let mut text = String::new();
    if let Some(s) = system {
        text.push_str(&format!(", system {s:?}"));
    }
    if let Some(t) = enable_thinking {
        text.push_str(&format!(", enable_thinking {t}"));
    }
    text
}

/// [`prompt_text`] of a run's task: a chat template with `model_dir` is the model's own (`qarl eval
/// --template chat`), without it ChatML.
pub(super) fn task_prompt_text(task: &crate::tasks::TaskConfig) -> String {
    use crate::tasks::template::{PlainTemplate, TemplateConfig};
    use crate::tasks::TaskConfig;
    match task {
        TaskConfig::Arithmetic(_) => "arithmetic".into(),
        TaskConfig::Gsm8k(d) | TaskConfig::Math(d) => match &d.template {
            TemplateConfig::Plain(p) => {
                let default: PlainTemplate = serde_json::from_value(serde_json::json!({}))
                    .expect("a plain template's fields all default");
                if *p == default {
                    "plain".into()
                } else {
                    format!("plain {:?} ... {:?}", p.question_prefix, p.answer_prefix)
                }
            }
            TemplateConfig::Chat(c) => prompt_text(
                if c.model_dir.is_some() {
                    "chat"
                } else {
                    "chatml"
                },
                c.system.as_deref(),
                c.enable_thinking,
            ),
        },
    }
}
