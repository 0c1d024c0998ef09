//! `qarl mismatch`: how far a quantized rollout is from the learner, on real prompts. For each scheme it samples
//! responses with quantized weights (recording the sampler's log-probs), then scores the same tokens with the
//! full-precision training forward and with the aligned (QaRL) forward, and reports the mismatch metrics of
//! each against the rollout: k3 KL, |delta p| max and mean, and the error-token fractions criterion by
//! criterion (ratio, low probability, repetition) with their union. A first row samples in f32 and scores
//! with the f32 forward: the floor every quantized row is read against.

use std::path::PathBuf;

use crate::model::{Activations, Decoder, Tokenizer, Weights};
use crate::ops::BackendKind;
use crate::quant::{Precision, QuantScheme};
use crate::rl::metrics::{error_token_metrics, names, rollout_mismatch_metrics, LoopRule};
use crate::rollout::{generate, SamplingParams};
use crate::train::batch::SeqBatch;

#[derive(Debug, clap::Args)]
pub struct MismatchArgs {
    /// Model directory (full precision).
    #[arg(long)]
    pub model: PathBuf,
    /// GSM8K- or MATH-format JSONL file (see `qarl eval`), e.g.
    /// experiments/data/word_problems_test.jsonl, or `gsm8k-test` / `gsm8k-train` (files in
    /// $QARL_GSM8K_DIR, see `qarl eval`).
    #[arg(long)]
    pub data: String,
    /// Prompts (the first N questions).
    #[arg(long, default_value_t = 16)]
    pub limit: usize,
    /// Samples per prompt.
    #[arg(long, default_value_t = 2)]
    pub samples: usize,
    /// Rollout schemes, comma-separated.
    #[arg(
        long,
        visible_alias = "formats",
        default_value = "int4-g128,int8-pc,fp8-b128",
        value_delimiter = ','
    )]
    pub schemes: Vec<QuantScheme>,
    /// Sampling temperature of the rollout (the log-probs compared are of the distribution scaled by it).
    #[arg(long, default_value_t = 1.0, value_parser = super::f32_flag)]
    pub temperature: f32,
    /// Most tokens a sampled response may have.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling seed (every scheme samples from the same seeds).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// `chat` (the model's own chat template, ChatML where it has none), `chatml` (ChatML whatever the
    /// model declares) or `plain` (`Question: ...\nAnswer:`, for a base model).
    #[arg(long, default_value = "chat")]
    pub template: String,
    /// System turn of the chat template (without it, the model's template decides: SmolLM2's writes a
    /// default one, ChatML none).
    #[arg(long)]
    pub system: Option<String>,
    /// The chat template's `enable_thinking` switch (Qwen3: `false` opens the answer with an empty
    /// `<think>` block); refused for a template that does not read it.
    #[arg(long)]
    pub enable_thinking: Option<bool>,
    /// What ends a response besides `--max-new-tokens`, as for `qarl eval`: `template`, the model's end
    /// tokens and the template's stop string (`\nQuestion:` for `plain`), or `end-tokens`, the end tokens
    /// alone (a training run's default, `rollout.stop`). Tokens after an answer's end are measured too.
    #[arg(long, value_enum, default_value_t = crate::train::config::RolloutStop::Template)]
    pub stop: crate::train::config::RolloutStop,
    /// Write the table as JSON here (and as Markdown next to it, `.md`).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Compute backend (flex, wgpu, cuda).
    #[arg(long, value_enum, default_value_t = BackendKind::Flex)]
    pub backend: BackendKind,
    /// Deterministic mode `on` (the fixed-order, batch-invariant kernels; the default), `off` (the
    /// backend's own, faster kernels), or `on,off` to measure both: the mismatch that giving up exactness
    /// leaves in the aligned forward.
    #[arg(long, value_delimiter = ',', default_value = "on")]
    pub deterministic: Vec<String>,
    /// Activations' types to measure, comma-separated (`f32`, `bf16`, `f16`): mixed precision rounds every
    /// op's output to the half type in the rollout and the training forward alike.
    #[arg(
        long,
        visible_alias = "act-dtype",
        value_enum,
        value_delimiter = ',',
        default_value = "f32"
    )]
    pub activations: Vec<Activations>,
}

pub fn run(args: MismatchArgs) -> anyhow::Result<()> {
    // Checked before anything is loaded: 0 samples used to panic, temperature 0 to print a NaN KL.
    anyhow::ensure!(args.samples >= 1, "--samples must be at least 1, got 0");
    anyhow::ensure!(
        args.temperature.is_finite() && args.temperature >= crate::rollout::sampler::MIN_TEMPERATURE,
        "--temperature must be a finite number >= {:e} (log-probs of sampled tokens are compared; below, \
         the distribution is greedy's and every KL reads 0, or the logits divided by it overflow), got {:?}",
        crate::rollout::sampler::MIN_TEMPERATURE,
        args.temperature
    );
    anyhow::ensure!(args.limit >= 1, "--limit must be at least 1, got 0");
    // The Markdown table goes beside the JSON, as `.md`: an output named `.md` would be overwritten by it.
    if let Some(out) = &args.output {
        crate::io::check_output_file(out)?;
        crate::io::check_output_file(&out.with_extension("md"))?;
        anyhow::ensure!(
            out.extension().is_none_or(|e| e != "md"),
            "--output {}: the JSON would be overwritten by the Markdown table written beside it as .md; \
             name it .json",
            out.display()
        );
    }
    anyhow::ensure!(
        args.max_new_tokens >= 1,
        "--max-new-tokens must be at least 1, got 0"
    );
    let modes = super::bench::parse_switch_list(
        &args.deterministic,
        "--deterministic",
        "on, off or on,off",
        super::bench::parse_on_off,
    )?;
    anyhow::ensure!(!args.activations.is_empty(), "--activations is empty");
    super::refuse_repeats("--activations", &args.activations, |a| a.to_string())?;
    super::refuse_repeats("--schemes", &args.schemes, |s| s.to_string())?;
    let device = args.backend.device()?;
    let path = super::eval::data_path(&args.data)?;
    if let Some(out) = &args.output {
        let inputs = super::inputs_with_model(&args.model, [&path]);
        crate::io::check_output_not_input(out, &inputs)?;
        crate::io::check_output_not_input(&out.with_extension("md"), &inputs)?;
    }
    let records = super::eval::load_problems(&path, args.limit)?;
    anyhow::ensure!(!records.is_empty(), "{}: no problems", path.display());
    let template = super::eval::prompt_template(
        &args.model,
        &args.template,
        args.system.clone(),
        args.enable_thinking,
    )?;
    let full = Decoder::load_full_precision(&args.model, &device)?;
    let tok = Tokenizer::load_required(&args.model, &full.config)?;
    tok.check_template(&template, &args.model)?;
    let prompts: Vec<Vec<u32>> = records
        .iter()
        .map(|r| super::eval::encode_record(&tok, &template, r, &path))
        .collect::<anyhow::Result<_>>()?;
    super::eval::check_prompt_sizes(
        &full.config,
        (
            crate::rollout::RolloutInputs {
                rows: "--limit / --samples",
                reach: "--max-new-tokens",
            },
            prompts.len().saturating_mul(args.samples),
        ),
        (&prompts, &records, &path),
        args.max_new_tokens,
    )?;
    let end = crate::model::EndTokens::of(&tok, &full.config)?
        .with_turn_ends(&tok, &template.turn_ends());
    // The same rule as `qarl eval`: with only the end tokens, a plain prompt's responses ran on into
    // questions the model made up after its answer, and their tokens were measured.
    let stop_strings = args.stop.strings(&end, &tok, || template.stop_strings());
    let params = SamplingParams {
        temperature: args.temperature,
        max_new_tokens: args.max_new_tokens,
        seed: args.seed,
        stop_token_ids: end.stops().to_vec(),
        stop_strings: stop_strings.clone(),
        ..SamplingParams::default()
    };
    let mut rows = Vec::new();
    for &act in &args.activations {
        let mut model = full.clone();
        model.set_activations(act)?;
        for &on in &modes {
            crate::ops::set_deterministic(on);
            let mode = if on { "on" } else { "off" };
            println!("== activations {act}, deterministic {mode}");
            let measured = measure_schemes(&model, &args, &prompts, &params, &tok);
            crate::ops::set_deterministic(true);
            rows.extend(measured?.into_iter().map(|mut r| {
                r["deterministic"] = serde_json::json!(mode);
                r["activations"] = serde_json::json!(act.to_string());
                r
            }));
        }
    }
    if let Some(out) = &args.output {
        // How the prompts were rendered and where it ran: `--template chat` and `chatml` give other
        // prompts (k3 0.376 against 0.433 on SmolLM2), so a result without them cannot be reproduced.
        let meta = serde_json::json!({"model": args.model, "data": path, "prompts": records.len(),
            "samples": args.samples, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "seed": args.seed, "template": args.template, "system": args.system,
            "enable_thinking": args.enable_thinking, "stop_strings": stop_strings,
            "backend": args.backend.to_string(), "rows": rows});
        crate::io::write_json_atomic(out, &meta)?;
        let mut md = format!(
            "Rollout/learner mismatch on {} ({} prompts x {} samples, T = {}, up to {} new tokens, seed {}; \
             template `{}`{}, stop strings {:?}; backend {}). \
             Rollout `f32` is the floor: the f32 sampler against the f32 forward. Error-token fractions \
             (docs/metrics.md): `ratio`, the sampler over 20x more confident than the learner; `low prob`, \
             learner probability below 1e-4; `repetition`, inside a repetition loop; `any`, at least one.\n\n",
            path.display(), records.len(), args.samples, args.temperature, args.max_new_tokens, args.seed,
            args.template,
            crate::train::compare::prompt_switches(args.system.as_deref(), args.enable_thinking),
            stop_strings,
            args.backend
        );
        md += &modes_measured(&rows);
        md += "| activations | deterministic | rollout | training forward | k3 KL | abs dp max | abs dp mean | error tokens: ratio | low prob | repetition | any | tokens |\n\
               |---|---|---|---|---|---|---|---|---|---|---|---|\n";
        for r in &rows {
            let [k3, dp_max, dp_mean, ratio, low, repetition, any] = measured(r);
            md += &format!(
                "| {} | {} | {} | {} | {k3:.3e} | {dp_max:.3e} | {dp_mean:.3e} | {ratio:.4} | {low:.4} | \
                 {repetition:.4} | {any:.4} | {} |\n",
                r["activations"].as_str().unwrap_or(""),
                r["deterministic"].as_str().unwrap_or(""),
                r["scheme"].as_str().unwrap_or(""),
                r["forward"].as_str().unwrap_or(""),
                r["response_tokens"],
            );
        }
        crate::io::write_atomic(&out.with_extension("md"), md.as_bytes())?;
    }
    Ok(())
}

/// The rows of one deterministic mode: the f32 floor, then each scheme with the full and the aligned
/// training forward.
fn measure_schemes(
    full: &Decoder,
    args: &MismatchArgs,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    tok: &Tokenizer,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut rows = Vec::new();
    // The floor of the measurement: the f32 sampler against the f32 forward. Whatever error tokens and KL
    // it shows are the model's own (unlikely tokens, loops) and the decode/prefill numerics, not quantization.
    let mut f32_model = full.clone();
    if f32_model.precision() != Precision::F32 {
        f32_model
            .set_precision(Precision::F32)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.model.display()))?;
    }
    rows.extend(measure(
        &f32_model,
        "f32",
        &[("full", Weights::Master)],
        prompts,
        params,
        tok,
        args.samples,
    )?);
    for &scheme in &args.schemes {
        let mut quantized = full.clone();
        quantized
            .set_precision(Precision::Quantized(scheme))
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.model.display()))?;
        rows.extend(measure(
            &quantized,
            &scheme.to_string(),
            &[("full", Weights::Master), ("aligned", Weights::Packed)],
            prompts,
            params,
            tok,
            args.samples,
        )?);
    }
    Ok(rows)
}

/// The metrics each row reports, in table order.
const KEYS: [&str; 7] = [
    names::K3_KL,
    names::PROBS_DIFF_MAX,
    names::PROBS_DIFF_MEAN,
    names::RATIO_FRAC,
    names::LOW_PROB_FRAC,
    names::REPETITION_FRAC,
    names::ANY_ERROR_FRAC,
];

/// A row's values of [`KEYS`], in their order (NaN where one is missing), for the printed line and the
/// markdown table alike.
fn measured(row: &serde_json::Value) -> [f64; 7] {
    KEYS.map(|k| row[k].as_f64().unwrap_or(f64::NAN))
}

/// Samples with `sampler` (recording its log-probs), scores the same tokens with each of `forwards` (the
/// sampler's own weights, master or packed), and returns one row per forward: the mismatch metrics of that
/// forward against the rollout. Also prints each row.
fn measure(
    sampler: &Decoder,
    rollout: &str,
    forwards: &[(&str, Weights)],
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    tok: &Tokenizer,
    samples: usize,
) -> anyhow::Result<Vec<serde_json::Value>> {
    // What runs, with its elapsed time (a rollout of a real model's prompts takes minutes on a CPU).
    let spinner = crate::train::progress::spinner(&format!("rollout {rollout}:"), false);
    spinner.set_message(format!("sampling {} prompts x {samples}", prompts.len()));
    let t = std::time::Instant::now();
    let out = generate(sampler, prompts, samples, params, Some(tok));
    out.ensure_finite()
        .map_err(|e| anyhow::anyhow!("rollout {rollout}: {e}"))?;
    let rollout_s = t.elapsed().as_secs_f64();
    let batch = SeqBatch::new(out.ids.clone(), out.prompt_lens.clone());
    let roll = batch.grid_values(&out.logprobs);
    let mask: Vec<bool> = batch.mask_values().iter().map(|&v| v > 0.0).collect();
    let ids_grid: Vec<u32> = batch
        .seqs
        .iter()
        .flat_map(|s| (0..batch.width).map(move |t| s.get(t + 1).copied().unwrap_or(0)))
        .collect();
    let mut rows = Vec::new();
    for &(forward, weights) in forwards {
        spinner.set_message(format!("scoring its tokens with the {forward} forward"));
        let lp =
            crate::host::to_f32_vec(batch.logprobs(sampler, weights, params.temperature, None).0);
        // A non-finite learner log-prob would print a NaN KL and exit 0: name where it first appeared.
        if let Some(i) = lp.iter().zip(&mask).position(|(v, &m)| m && !v.is_finite()) {
            anyhow::bail!(
                "rollout {rollout}, {forward} forward: the log-prob of the token at position {} of row {} is {} \
                 (not finite)",
                i % batch.width + 1,
                i / batch.width,
                lp[i]
            );
        }
        let mut m = rollout_mismatch_metrics(&lp, &roll, &mask, batch.width)?;
        m.extend(
            error_token_metrics(
                &ids_grid,
                &lp,
                &roll,
                &mask,
                batch.width,
                LoopRule::default(),
            )?
            .to_map(),
        );
        let mut row = serde_json::json!({
            "scheme": rollout, "forward": forward,
            "response_tokens": mask.iter().filter(|&&b| b).count(),
            "rollout_tokens_per_s": out.generated_tokens() as f64 / rollout_s.max(1e-9),
        });
        for k in KEYS {
            match m.get(k).copied() {
                Some(v) if v.is_finite() => row[k] = serde_json::json!(v),
                v => anyhow::bail!(
                    "rollout {rollout}, {forward} forward: {k} is {} over {} response tokens (not a finite number)",
                    v.map_or("missing".to_string(), |v| v.to_string()),
                    mask.iter().filter(|&&b| b).count()
                ),
            }
        }
        let [k3, dp_max, dp_mean, ratio, low, repetition, any] = measured(&row);
        spinner.suspend(|| {
            println!(
                "{rollout:>10} {forward:>8}: k3 KL {k3:.3e}  |dp| max {dp_max:.3e}  mean {dp_mean:.3e}  error \
                 tokens: ratio {ratio:.4}  low prob {low:.4}  repetition {repetition:.4}  any {any:.4}",
            )
        });
        rows.push(row);
    }
    spinner.finish_and_clear();
    Ok(rows)
}

/// What the table's less obvious modes mean, for those of them its rows measured (a paragraph, or nothing).
fn modes_measured(rows: &[serde_json::Value]) -> String {
    let any =
        |key: &str, pick: fn(&str) -> bool| rows.iter().any(|r| r[key].as_str().is_some_and(pick));
    let mut text = Vec::new();
    if any("deterministic", |d| d == "off") {
        text.push(
            "Deterministic `off`: the backend's own kernels, whose sums round differently in the rollout's \
             decode steps and the training forward's full sequences.",
        );
    }
    if any("activations", |a| a != "f32") {
        text.push(
            "Activations `bf16` / `f16`: mixed precision (every op's output rounded to the half type, in the \
             rollout and the training forward alike).",
        );
    }
    if text.is_empty() {
        String::new()
    } else {
        format!("{}\n\n", text.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::modes_measured;

    #[test]
    fn the_modes_paragraph_explains_only_the_modes_measured() {
        let row =
            |det: &str, act: &str| serde_json::json!({"deterministic": det, "activations": act});
        assert_eq!(modes_measured(&[row("on", "f32"), row("on", "f32")]), "");
        let off = modes_measured(&[row("on", "f32"), row("off", "f32")]);
        assert!(
            off.contains("Deterministic `off`") && !off.contains("Activations"),
            "{off}"
        );
        let half = modes_measured(&[row("on", "bf16")]);
        assert!(
            half.contains("Activations `bf16`") && !half.contains("Deterministic"),
            "{half}"
        );
        let both = modes_measured(&[row("off", "f16")]);
        assert!(
            both.contains("Deterministic `off`") && both.contains("Activations"),
            "{both}"
        );
    }
}
