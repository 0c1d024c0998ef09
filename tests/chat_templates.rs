//! Chat templates against transformers: each fixture template rendered by qarl equals what
//! `apply_chat_template` rendered for the same conversation (`tests/fixtures/chat_templates/expected.json`,
//! written by `make_expected.py` there), and the prompts and SFT completions qarl builds from them split
//! those texts where transformers' SFT would.

use std::path::{Path, PathBuf};

use qarl::tasks::chat_template::{ModelChatTemplate, Turn};
use qarl::tasks::Template;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates")
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str::<Value>(&text)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// A model folder whose `tokenizer_config.json` holds `template` and `specials`, as transformers saves one.
fn model_dir(root: &Path, template: &str, specials: &Value) -> PathBuf {
    let dir = root.join(template.replace('.', "_"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut config = specials.as_object().unwrap().clone();
    let source = std::fs::read_to_string(fixtures().join(template)).unwrap();
    config.insert("chat_template".into(), Value::String(source));
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    dir
}

fn turns(messages: &Value) -> Vec<Turn<'_>> {
    messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| Turn {
            role: m["role"].as_str().unwrap(),
            content: m["content"].as_str().unwrap(),
        })
        .collect()
}

#[test]
fn templates_render_as_transformers_renders_them() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = cases();
    assert_eq!(cases.len(), 25);
    for case in &cases {
        let name = case["template"].as_str().unwrap();
        let dir = model_dir(tmp.path(), name, &case["specials"]);
        let template = ModelChatTemplate::of_model(&dir).unwrap().unwrap();
        let vars: Vec<(&str, Value)> = match case["enable_thinking"] {
            Value::Bool(b) => vec![("enable_thinking", Value::Bool(b))],
            _ => vec![],
        };
        let got = template
            .render(
                &turns(&case["messages"]),
                case["add_generation_prompt"].as_bool().unwrap(),
                &vars,
            )
            .unwrap();
        assert_eq!(
            got,
            case["expected"].as_str().unwrap(),
            "{name}, {}, enable_thinking {}",
            case["conversation"],
            case["enable_thinking"]
        );
    }
}

/// qarl's prompt for a question is transformers' prompt, and prompt + SFT completion is transformers'
/// whole conversation (TRL's split of a conversational prompt-completion example).
#[test]
fn prompts_and_completions_split_the_conversation() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = cases();
    let mut checked = 0;
    for whole in cases
        .iter()
        .filter(|c| !c["add_generation_prompt"].as_bool().unwrap())
    {
        let name = whole["template"].as_str().unwrap();
        let messages = whole["messages"].as_array().unwrap();
        let system = messages
            .iter()
            .find(|m| m["role"] == "system")
            .map(|m| m["content"].as_str().unwrap().to_string());
        let question = messages.iter().find(|m| m["role"] == "user").unwrap()["content"]
            .as_str()
            .unwrap();
        let answer = messages.last().unwrap()["content"].as_str().unwrap();
        let thinking = whole["enable_thinking"].as_bool();
        // The prompt case of the same template, system turn and switch.
        let prompt_case = cases
            .iter()
            .find(|c| {
                c["template"] == whole["template"]
                    && c["enable_thinking"] == whole["enable_thinking"]
                    && c["conversation"]
                        == if system.is_some() {
                            "system_user"
                        } else {
                            "user"
                        }
            })
            .unwrap();
        let dir = model_dir(tmp.path(), name, &whole["specials"]);
        let template = Template::chat_for_model(&dir, system, thinking).unwrap();
        let prompt = template.render_prompt(question).unwrap();
        assert_eq!(prompt, prompt_case["expected"].as_str().unwrap(), "{name}");
        let completion = template.render_completion(question, answer).unwrap();
        assert_eq!(
            format!("{prompt}{completion}"),
            whole["expected"].as_str().unwrap(),
            "{name}, enable_thinking {thinking:?}"
        );
        assert!(template.completion_closes_turn());
        checked += 1;
    }
    assert_eq!(checked, 10);
}

/// transformers reads `chat_template.jinja` over the config's `chat_template`; so does qarl.
#[test]
fn the_jinja_file_wins_over_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let specials = serde_json::json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"});
    let dir = model_dir(tmp.path(), "smollm2.jinja", &specials);
    std::fs::copy(
        fixtures().join("llama3_style.jinja"),
        dir.join("chat_template.jinja"),
    )
    .unwrap();
    let template = Template::chat_for_model(&dir, None, None).unwrap();
    let prompt = template.render_prompt("2 + 3?").unwrap();
    assert!(
        prompt.starts_with("<|begin_of_text|><|start_header_id|>system"),
        "{prompt}"
    );
    assert_eq!(template.stop_strings(), ["<|eot_id|>"]);
    // A template whose turn end is not its EOS (Gemma's `<end_of_turn>`): read from what it writes.
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n\
         {{ m.content }}<end_of_turn>\n{% endfor %}\
         {% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    )
    .unwrap();
    let gemma = Template::chat_for_model(&dir, None, None).unwrap();
    assert_eq!(gemma.stop_strings(), ["<end_of_turn>", "<|eot_id|>"]);
}

/// What a template cannot do is refused where the template is built, naming its file.
#[test]
fn template_errors_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let smollm2 = model_dir(
        tmp.path(),
        "smollm2.jinja",
        &serde_json::json!({"eos_token": "<|im_end|>"}),
    );
    // A switch the template never reads.
    let err = Template::chat_for_model(&smollm2, None, Some(false))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("never reads it"),
        "{err}"
    );
    // A system prompt the template never writes (it was recorded and changed nothing); SmolLM2's writes
    // one, even one equal to its default.
    let no_system = tmp.path().join("no_system");
    std::fs::create_dir_all(&no_system).unwrap();
    std::fs::write(
        no_system.join("chat_template.jinja"),
        "{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}",
    )
    .unwrap();
    let err = Template::chat_for_model(&no_system, Some("Be brief.".into()), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template.jinja") && err.contains("never writes a system turn"),
        "{err}"
    );
    assert!(Template::chat_for_model(&no_system, None, None).is_ok());
    let default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
    assert!(Template::chat_for_model(&smollm2, Some(default_system.into()), None).is_ok());
    // A template's own exception.
    let llama = model_dir(
        tmp.path(),
        "llama3_style.jinja",
        &serde_json::json!({"bos_token": "<s>"}),
    );
    let template = ModelChatTemplate::of_model(&llama).unwrap().unwrap();
    let lone = [Turn {
        role: "assistant",
        content: "hi",
    }];
    let err = template.render(&lone, false, &[]).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("Conversation roles must alternate"),
        "{err}"
    );
    // A reasoning model's template (its prompt opens a `<think>` block that past turns leave out): prompts
    // render (evaluation, RL), but no SFT completion can be split from a conversation.
    // A model folder named `name` holding only `chat_template.jinja` with `source`.
    let jinja_model = |name: &str, source: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), source).unwrap();
        dir
    };
    let think = jinja_model(
        "think",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
    );
    let template = Template::chat_for_model(&think, None, None).unwrap();
    assert!(template
        .render_prompt("2 + 3?")
        .unwrap()
        .ends_with("<think>\n"));
    let err = template
        .render_completion("2 + 3?", "5")
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not start with its prompt"), "{err}");
    // A template that does not parse.
    let broken = jinja_model("broken", "{% for m in messages %}");
    let err = Template::chat_for_model(&broken, None, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template.jinja") && err.contains("does not render"),
        "{err}"
    );
    // A template that would loop for some 10^12 steps is stopped, not waited for (it hung for minutes).
    let looping = jinja_model(
        "looping",
        "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100) %}\
         {% endfor %}{% endfor %}{% endfor %}",
    );
    let err = Template::chat_for_model(&looping, None, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template.jinja") && err.contains("does not finish rendering within"),
        "{err}"
    );
    // An empty template (in either place): every prompt rendered to nothing, blamed on the data's line.
    let empty = jinja_model("empty", " \n");
    let err = Template::chat_for_model(&empty, None, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template.jinja") && err.contains("the chat template is empty"),
        "{err}"
    );
    let config_template = |name: &str, template: Value| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({ "chat_template": template });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        Template::chat_for_model(&dir, None, None).map_err(|e| e.to_string())
    };
    let err = config_template("empty_in_config", "".into()).unwrap_err();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("the chat template is empty"),
        "{err}"
    );
    // Named templates: the `default` one; without one transformers refuses the list, and so does this.
    let named = |name: &str, t: &str| serde_json::json!({"name": name, "template": t});
    let chosen = config_template(
        "named_default",
        serde_json::json!([
            named("tool_use", "{{ 1 }}"),
            named("default", "<{{ messages[0].content }}>")
        ]),
    )
    .unwrap();
    assert_eq!(chosen.render_prompt("q").unwrap(), "<q>");
    let err = config_template(
        "named_no_default",
        serde_json::json!([named("tool_use", "<{{ messages[0].content }}>")]),
    )
    .unwrap_err();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("without one named `default`"),
        "{err}"
    );
    // No template at all: ChatML, which has no switch.
    let bare = tmp.path().join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    assert_eq!(
        Template::chat_for_model(&bare, None, None).unwrap(),
        Template::chatml()
    );
    let err = Template::chat_for_model(&bare, None, Some(true))
        .unwrap_err()
        .to_string();
    assert!(err.contains("declares no chat template"), "{err}");
}

/// A data set under a reasoning model's template: the task builds (its prompts serve evaluation and RL),
/// and a warm start, which needs completions, is told why there are none.
#[test]
fn a_template_without_completions_serves_prompts_only() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("chat_template.jinja"),
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
    )
    .unwrap();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gsm8k_slice.jsonl");
    let cfg: qarl::tasks::TaskConfig = serde_json::from_value(serde_json::json!({
        "kind": "gsm8k", "path": data, "eval_fraction": 0.3,
        "template": {"kind": "chat", "model_dir": tmp.path()}
    }))
    .unwrap();
    let task = qarl::tasks::Task::from_config(&cfg).unwrap();
    let ex = &task.eval_set(1)[0];
    assert!(ex.prompt.ends_with("<|im_start|>assistant\n<think>\n") && !ex.with_bos);
    assert!(ex.solution.is_none());
    let err = task.check_completions().unwrap_err().to_string();
    assert!(
        err.contains("a warm start needs worked solutions")
            && err.contains("gsm8k_slice.jsonl")
            && err.contains("does not start with its prompt"),
        "{err}"
    );
}

/// What transformers gives every template besides the messages: `{% generation %}` tags (assistant-masking
/// templates) render nothing with their whitespace controls kept, `strftime_now` a date (a fixed one
/// here, so prompts do not change with the day), and `tools` / `documents` are None; these templates were
/// refused, or (tools) took their tool-use branch.
#[test]
fn generation_tags_dates_and_tools_render_as_transformers_gives_them() {
    let render = |template: &str| {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("chat_template.jinja"), template).unwrap();
        let t = ModelChatTemplate::of_model(tmp.path()).unwrap().unwrap();
        let turns = [Turn {
            role: "user",
            content: "q",
        }];
        t.render(&turns, true, &[]).map_err(|e| e.to_string())
    };
    let tagged = "{% for m in messages %}[{{ m.role }}]\n  {%- generation -%}\n  {{ m.content }} \
                  {% endgeneration %}\n{% endfor %}";
    let plain = "{% for m in messages %}[{{ m.role }}]\n  {%- if true -%}\n  {{ m.content }} \
                 {% endif %}\n{% endfor %}";
    assert_eq!(render(tagged).unwrap(), render(plain).unwrap());
    assert_eq!(render(tagged).unwrap(), "[user]q ");
    assert_eq!(
        render("{{ strftime_now('%d %b %Y, %A %%') }}").unwrap(),
        "26 Jul 2024, Friday %"
    );
    let err = render("{{ strftime_now('%Z') }}").unwrap_err();
    assert!(err.contains("strftime_now: the directive %Z"), "{err}");
    assert_eq!(
        render(
            "{% if tools is not none %}tools{% endif %}{% if documents is none %}none{% endif %}"
        )
        .unwrap(),
        "none"
    );
    // `tojson` as Python's json.dumps(ensure_ascii=False) writes it (no HTML escapes; an escaped
    // backslash before `u003c` stays escaped).
    assert_eq!(
        render(r#"{{ {"a": "x<y & 'z' \\u003c é", "b": [1, 2]} | tojson }}"#).unwrap(),
        r#"{"a": "x<y & 'z' \\u003c é", "b": [1, 2]}"#
    );
    assert_eq!(
        render(r#"{{ ["<"] | tojson(indent=2) }}"#).unwrap(),
        "[\n  \"<\"\n]"
    );
    // Maps keep their order, as Python's dicts do: a message is `role` then `content` (json.dumps of
    // transformers' message dict), and a literal keeps the order it is written in (both were sorted).
    assert_eq!(
        render(
            r#"{{ messages[0] | tojson }}{% for k, v in messages[0].items() %} {{ k }}{% endfor %} {{ {"b": 1, "a": 2} | tojson }}"#
        )
        .unwrap(),
        r#"{"role": "user", "content": "q"} role content {"b": 1, "a": 2}"#
    );
}

/// Tool-calling templates (gpt-oss, Qwen3-Coder, Hermes) define macros and read `loop.previtem`.
#[test]
fn macros_and_adjacent_loop_items_render() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("chat_template.jinja"),
        "{% macro turn(m) %}<{{ m.role }}>{{ m.content }}{% endmacro %}\
         {% for m in messages %}{% if loop.previtem %}|{% endif %}{{ turn(m) }}{% endfor %}",
    )
    .unwrap();
    let template = ModelChatTemplate::of_model(tmp.path()).unwrap().unwrap();
    let turns = [
        Turn {
            role: "system",
            content: "s",
        },
        Turn {
            role: "user",
            content: "q",
        },
    ];
    assert_eq!(
        template.render(&turns, false, &[]).unwrap(),
        "<system>s|<user>q"
    );
}
