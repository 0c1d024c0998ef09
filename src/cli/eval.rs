//! `qarl eval`: greedy accuracy of a model on a GSM8K- or MATH-format JSONL file (questions through the
//! chat or plain template, answers checked by the exact verifier), in full precision or a quantized scheme,
//! with the mean response length and decode throughput.

use std::path::PathBuf;
use std::time::Instant;

use crate::model::Tokenizer;
use crate::ops::BackendKind;
use crate::quant::QuantScheme;
use crate::rollout::{generate, FinishReason, SamplingParams};
use crate::tasks::datasets::{load_gsm8k_or_math, OnBadLine};
use crate::tasks::template::Template;
use crate::tasks::verify::{score_response, AnswerFrom, Truncated, VerifyConfig};
use crate::train::config::RolloutStop;

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// Model directory (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL file in GSM8K format (`question`, `answer` ending in `#### N`; e.g.
    /// experiments/data/word_problems_test.jsonl) or MATH format (`problem`, `solution` with a `\boxed{}`
    /// answer or an `answer` field), told apart by the first record; `gsm8k-test` / `gsm8k-train` name
    /// test.jsonl / train.jsonl in $QARL_GSM8K_DIR (a copy of GSM8K's grade_school_math/data).
    #[arg(long)]
    pub data: String,
    /// Evaluate the first N problems.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Quantize the projections first (int4-g32/64/128, int8-pc, fp8-b128, nvfp4, mxfp4).
    #[arg(long, visible_alias = "scheme")]
    pub quant: Option<QuantScheme>,
    /// Activations' type (`f32`, or mixed precision: `bf16`, `f16`; weights stay f32 or packed).
    #[arg(
        long,
        visible_alias = "act-dtype",
        value_enum,
        default_value_t = crate::model::Activations::F32
    )]
    pub activations: crate::model::Activations,
    /// `chat` (the model's own chat template, ChatML where it has none), `chatml` (ChatML whatever the
    /// model declares) or `plain` (`Question: ...\nAnswer:`).
    #[arg(long, default_value = "chat")]
    pub template: String,
    /// System turn of the chat template. Without it, the model's template decides (SmolLM2's writes "You
    /// are a helpful AI assistant named SmolLM, trained by Hugging Face"; ChatML writes none).
    #[arg(long)]
    pub system: Option<String>,
    /// The chat template's `enable_thinking` switch (Qwen3: `false` opens the answer with an empty
    /// `<think>` block); refused for a template that does not read it.
    #[arg(long)]
    pub enable_thinking: Option<bool>,
    /// Most tokens a response may have (its end token included); one cut off there is `truncated`.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// What ends a response besides `--max-new-tokens`: `template`, the model's end tokens and the
    /// template's stop string (`\nQuestion:` for `plain`, the turn's end for a chat template), or
    /// `end-tokens`, the end tokens alone (a training run's default, `rollout.stop`): `qarl compare`
    /// refuses evaluations stopped by different rules.
    #[arg(long, value_enum, default_value_t = RolloutStop::Template)]
    pub stop: RolloutStop,
    /// Prompts decoded together.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Where a response's final answer may come from (`verify.answer_from`): `any` (boxed, `####`,
    /// `Answer:`, else the last number) or `marked` (a `\boxed{}` or a `####` line only).
    #[arg(long, value_enum, default_value_t = AnswerFrom::Any)]
    pub answer_from: AnswerFrom,
    /// A response cut off at `--max-new-tokens` (`verify.truncated`): `scored` as written, or `wrong`.
    #[arg(long, value_enum, default_value_t = Truncated::Scored)]
    pub truncated: Truncated,
    /// Write per-problem results (question, gold, response, correct) and the summary here as JSON.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Compute backend (flex, wgpu, cuda).
    #[arg(long, value_enum, default_value_t = BackendKind::Flex)]
    pub backend: BackendKind,
}

/// The prompt template `--template NAME` (with `--system` and `--enable-thinking`) names for the model in
/// `dir`: `chat`, the model's own chat template (ChatML where it declares none), `chatml` (ChatML whatever
/// the model declares: how `qarl eval` prompted before it rendered the model's template, with no default
/// system turn), or `plain` (`Question: ...\nAnswer:`), which has no system turn.
pub(crate) fn prompt_template(
    dir: &std::path::Path,
    name: &str,
    system: Option<String>,
    enable_thinking: Option<bool>,
) -> anyhow::Result<Template> {
    match name {
        "chat" => Ok(Template::chat_for_model(dir, system, enable_thinking)?),
        "chatml" => {
            anyhow::ensure!(
                enable_thinking.is_none(),
                "--enable-thinking is a switch of the model's chat template; `--template chatml` has none"
            );
            Ok(Template::Chat {
                system,
                model: None,
                enable_thinking: None,
            })
        }
        "plain" => {
            anyhow::ensure!(
                enable_thinking.is_none(),
                "--enable-thinking is a switch of the model's chat template; `--template plain` has none"
            );
            anyhow::ensure!(
                system.is_none(),
                "--system is the chat template's system turn; `--template plain` has none (drop --system)"
            );
            Ok(Template::default())
        }
        other => anyhow::bail!("--template `{other}`: expected `chat`, `chatml` or `plain`"),
    }
}

/// The environment variable naming the directory that holds GSM8K's `test.jsonl` and `train.jsonl`.
pub(crate) const GSM8K_DIR_ENV: &str = "QARL_GSM8K_DIR";

/// The first `limit` problems of a JSONL file, each question once (its first record), as a run's held-out
/// evaluation takes them: a repeated problem counted twice (`qarl eval` and `qarl mismatch`).
pub(super) fn load_problems(
    path: &std::path::Path,
    limit: usize,
) -> anyhow::Result<Vec<crate::tasks::datasets::Record>> {
    let (mut records, repeats) = crate::tasks::datasets::unique_questions(
        load_gsm8k_or_math(path, OnBadLine::Error)?,
        path,
    )?;
    if repeats > 0 {
        eprintln!(
            "{}: {repeats} repeated question(s) left out (each problem counts once, as in a run's evaluation)",
            path.display()
        );
    }
    records.truncate(limit);
    Ok(records)
}

/// The file `--data NAME` reads: `gsm8k-test` / `gsm8k-train` in $QARL_GSM8K_DIR, anything else a path. GSM8K
/// is not part of the repository, so the short names need the variable; an error says how to provide it.
pub(crate) fn data_path(name: &str) -> anyhow::Result<PathBuf> {
    let file = match name {
        "gsm8k-test" => "test.jsonl",
        "gsm8k-train" => "train.jsonl",
        other => return Ok(PathBuf::from(other)),
    };
    match std::env::var_os(GSM8K_DIR_ENV).filter(|d| !d.is_empty()) {
        Some(dir) => Ok(PathBuf::from(dir).join(file)),
        None => anyhow::bail!(
            "--data {name} names {file} in ${GSM8K_DIR_ENV}, which is not set: set it to a directory holding \
             GSM8K's {file} (github.com/openai/grade-school-math, grade_school_math/data), or pass a JSONL file's \
             path (e.g. experiments/data/word_problems_test.jsonl)"
        ),
    }
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.max_new_tokens >= 1,
        "--max-new-tokens must be at least 1, got 0 (no answer could be right)"
    );
    anyhow::ensure!(args.batch >= 1, "--batch must be at least 1, got 0");
    anyhow::ensure!(args.limit >= 1, "--limit must be at least 1, got 0");
    if let Some(out) = &args.output {
        crate::io::check_output_file(out)?;
    }
    let device = args.backend.device()?;
    let path = data_path(&args.data)?;
    if let Some(out) = &args.output {
        crate::io::check_output_not_input(out, &super::inputs_with_model(&args.model, [&path]))?;
    }
    let records = load_problems(&path, args.limit)?;
    anyhow::ensure!(!records.is_empty(), "{}: no problems", path.display());
    let template = prompt_template(
        &args.model,
        &args.template,
        args.system.clone(),
        args.enable_thinking,
    )?;
    let model = super::load_model(&args.model, &device, args.quant, args.activations)?;
    let tok = Tokenizer::load_required(&args.model, &model.config)?;
    tok.check_template(&template, &args.model)?;

    let end = crate::model::EndTokens::of(&tok, &model.config)?
        .with_turn_ends(&tok, &template.turn_ends());
    let stop_strings = args.stop.strings(&end, &tok, || template.stop_strings());
    let stop_ids = end.stops().to_vec();
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: args.max_new_tokens,
        stop_token_ids: stop_ids.clone(),
        stop_strings: stop_strings.clone(),
        ..SamplingParams::default()
    };
    let verify = VerifyConfig {
        answer_from: args.answer_from,
        truncated: args.truncated,
        ..VerifyConfig::default()
    };
    let bar = crate::train::progress::progress_bar(records.len() as u64, "eval", args.quiet);
    let (mut correct, mut tokens, mut decode_s) = (0usize, 0usize, 0.0f64);
    let mut rows = Vec::new();
    let prompts: Vec<Vec<u32>> = records
        .iter()
        .map(|r| super::eval::encode_record(&tok, &template, r, &path))
        .collect::<anyhow::Result<_>>()?;
    let batch = args.batch;
    check_prompt_sizes(
        &model.config,
        (
            crate::rollout::RolloutInputs {
                rows: "--batch",
                reach: "--max-new-tokens",
            },
            batch.min(prompts.len()),
        ),
        (&prompts, &records, &path),
        args.max_new_tokens,
    )?;
    for (chunk, prompts) in records.chunks(batch).zip(prompts.chunks(batch)) {
        let t = Instant::now();
        let out = generate(&model, prompts, 1, &params, Some(&tok));
        out.ensure_finite()
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.model.display()))?;
        decode_s += t.elapsed().as_secs_f64();
        for (i, r) in chunk.iter().enumerate() {
            let resp = out.response(i);
            tokens += resp.len();
            let body: Vec<u32> = resp
                .iter()
                .copied()
                .filter(|id| !stop_ids.contains(id))
                .collect();
            let text = tok.decode(&body)?;
            let cut_off = out.finish_reasons[i] == FinishReason::Length;
            let v = score_response(
                &tok.decode_without_special(&body)?,
                cut_off,
                &r.answer,
                &verify,
            );
            correct += usize::from(v.correct);
            rows.push(
                serde_json::json!({"line": r.line, "question": r.question, "gold": r.answer,
                "response": text, "cut_off": cut_off, "extracted": v.extracted, "correct": v.correct}),
            );
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let n = records.len() as f64;
    // What the weights ran in: the scheme asked for, or the one a quantized checkpoint was written in.
    let precision = args
        .quant
        .or(model.config.quantization.as_ref().map(|q| q.scheme))
        .map_or("f32".to_string(), |s| s.to_string());
    let summary = serde_json::json!({
        "model": args.model, "data": path, "problems": records.len(), "precision": precision,
        "activations": args.activations.to_string(),
        "verify": verify.judging_rules(), "stop_strings": stop_strings,
        "max_new_tokens": args.max_new_tokens,
        // How the prompts were rendered: another template asks other questions of the model.
        "template": args.template, "system": args.system, "enable_thinking": args.enable_thinking,
        "accuracy": correct as f64 / n, "mean_response_tokens": tokens as f64 / n,
        "decode_tokens_per_s": tokens as f64 / decode_s.max(1e-9),
    });
    println!(
        "{}: {} problems, {precision}: greedy accuracy {:.3}, mean length {:.1} tokens, {:.1} tokens/s",
        path.display(),
        records.len(),
        correct as f64 / n,
        tokens as f64 / n,
        tokens as f64 / decode_s.max(1e-9)
    );
    if let Some(out) = &args.output {
        crate::io::write_json_atomic(
            out,
            &serde_json::json!({"summary": summary, "problems": rows}),
        )?;
    }
    Ok(())
}

/// The prompt of data-set record `r` of `path` under `template`, as token ids; an error (a character the
/// tokenizer has no token for) names the file and the line.
pub(super) fn encode_record(
    tok: &Tokenizer,
    template: &Template,
    r: &crate::tasks::datasets::Record,
    path: &std::path::Path,
) -> anyhow::Result<Vec<u32>> {
    let prompt = template.render_prompt(&r.question)?;
    tok.encode_prompt(&prompt, template.prompt_takes_bos())
        .map_err(|e| e.context(format!("{}: line {}", path.display(), r.line)))
}

/// [`crate::rollout::check_rollout_size`] for `rows` rows of these prompts (`records`' questions, read
/// from `path`) and `new` tokens each, naming the file, line and question of the longest where it is too
/// long for the model's positions (the flags in `what` alone do not say which record).
pub(super) fn check_prompt_sizes(
    config: &crate::model::ModelConfig,
    (what, rows): (crate::rollout::RolloutInputs, usize),
    (prompts, records, path): (
        &[Vec<u32>],
        &[crate::tasks::datasets::Record],
        &std::path::Path,
    ),
    new: usize,
) -> anyhow::Result<()> {
    crate::rollout::check_prompts_size(config, what, rows, prompts, new, |i| match records.get(i) {
        Some(r) => format!(
            "{}: line {}: {}",
            path.display(),
            r.line,
            crate::rollout::shown_question(&r.question)
        ),
        None => path.display().to_string(),
    })
}
