//! `qarl mismatch`: how far a quantized rollout is from the learner, on real prompts. For each scheme it samples
//! responses with quantized weights (recording the sampler's log-probs), then scores the same tokens with the
//! full-precision training forward and with the aligned (QaRL) forward, and reports the mismatch metrics of
//! each against the rollout: k3 KL, |delta p| max and mean, error-token fraction.

use std::path::PathBuf;

use anyhow::Context;

use crate::model::{Tokenizer, Weights};
use crate::quant::{Precision, QuantScheme};
use crate::rl::metrics::{error_token_metrics, rollout_mismatch_metrics, LoopRule};
use crate::rollout::{generate, SamplingParams};
use crate::tasks::datasets::{load_gsm8k, OnBadLine};
use crate::tasks::template::Template;
use crate::train::batch::SeqBatch;

#[derive(Debug, clap::Args)]
pub struct MismatchArgs {
    /// Model directory (full precision).
    #[arg(long)]
    pub model: PathBuf,
    /// GSM8K-format JSONL, or `gsm8k-test` / `gsm8k-train` (see `qarl eval`).
    #[arg(long, default_value = "gsm8k-test")]
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
        default_value = "int4-g128,int8-pc,fp8-b128",
        value_delimiter = ','
    )]
    pub schemes: Vec<QuantScheme>,
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// System turn of the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Write the table as JSON here (and as Markdown next to it, `.md`).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn run(args: MismatchArgs) -> anyhow::Result<()> {
    // Checked before anything is loaded: 0 samples used to panic, temperature 0 to print a NaN KL.
    anyhow::ensure!(args.samples >= 1, "--samples must be at least 1, got 0");
    anyhow::ensure!(
        args.temperature.is_finite() && args.temperature > 0.0,
        "--temperature must be a finite number > 0 (log-probs of sampled tokens are compared), got {}",
        args.temperature
    );
    anyhow::ensure!(args.limit >= 1, "--limit must be at least 1, got 0");
    anyhow::ensure!(
        args.max_new_tokens >= 1,
        "--max-new-tokens must be at least 1, got 0"
    );
    let path = super::eval::data_path(&args.data);
    let mut records = load_gsm8k(&path, OnBadLine::Error)?;
    records.truncate(args.limit);
    anyhow::ensure!(!records.is_empty(), "{}: no problems", path.display());
    Template::chat_from_model_dir(&args.model)?;
    let template = Template::Chat {
        system: args.system.clone(),
    };
    let device = burn::tensor::Device::flex();
    let full = super::load_model(&args.model, &device, None)?;
    let tok = Tokenizer::load_optional(&args.model)?
        .with_context(|| format!("{}: no tokenizer.json", args.model.display()))?;
    let prompts: Vec<Vec<u32>> = records
        .iter()
        .map(|r| tok.encode(&template.render_prompt(&r.question)))
        .collect::<anyhow::Result<_>>()?;
    let mut stop_ids = full.config.eos_token_ids.clone();
    stop_ids.extend(tok.token_to_id("<|im_end|>"));
    let params = SamplingParams {
        temperature: args.temperature,
        max_new_tokens: args.max_new_tokens,
        seed: args.seed,
        stop_token_ids: stop_ids,
        ..SamplingParams::default()
    };
    let keys = [
        ("rollout_corr/k3_kl", "k3 KL"),
        ("training/rollout_probs_diff_max", "|dp| max"),
        ("training/rollout_probs_diff_mean", "|dp| mean"),
        ("error_tokens/frac", "error-token frac"),
    ];
    let mut rows = Vec::new();
    for &scheme in &args.schemes {
        let mut quantized = full.clone();
        quantized
            .set_precision(Precision::Quantized(scheme))
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.model.display()))?;
        let t = std::time::Instant::now();
        let out = generate(&quantized, &prompts, args.samples, &params, Some(&tok));
        let rollout_s = t.elapsed().as_secs_f64();
        let batch = SeqBatch::new(out.ids.clone(), out.prompt_lens.clone());
        let roll = batch.grid_values(&out.logprobs);
        let mask: Vec<bool> = batch.mask_values().iter().map(|&v| v > 0.0).collect();
        let ids_grid: Vec<u32> = batch
            .seqs
            .iter()
            .flat_map(|s| (0..batch.width).map(move |t| s.get(t + 1).copied().unwrap_or(0)))
            .collect();
        for (forward, weights) in [("full", Weights::Master), ("aligned", Weights::Packed)] {
            let lp = crate::host::to_f32_vec(
                batch
                    .logprobs(&quantized, weights, args.temperature, None)
                    .0,
            );
            let mut m = rollout_mismatch_metrics(&lp, &roll, &mask, batch.width)?;
            let err = error_token_metrics(
                &ids_grid,
                &lp,
                &roll,
                &mask,
                batch.width,
                LoopRule::default(),
            )?;
            m.extend(err.to_map());
            let mut row = serde_json::json!({
                "scheme": scheme.to_string(), "forward": forward,
                "response_tokens": mask.iter().filter(|&&b| b).count(),
                "rollout_tokens_per_s": out.generated_tokens() as f64 / rollout_s.max(1e-9),
            });
            for (k, _) in keys {
                row[k] = serde_json::json!(m.get(k).copied().unwrap_or(f64::NAN));
            }
            println!(
                "{scheme:>10} {forward:>8}: k3 KL {:.3e}  |dp| max {:.3e}  mean {:.3e}  error tokens {:.4}",
                row[keys[0].0].as_f64().unwrap_or(f64::NAN),
                row[keys[1].0].as_f64().unwrap_or(f64::NAN),
                row[keys[2].0].as_f64().unwrap_or(f64::NAN),
                row[keys[3].0].as_f64().unwrap_or(f64::NAN),
            );
            rows.push(row);
        }
    }
    if let Some(out) = &args.output {
        let meta = serde_json::json!({"model": args.model, "data": path, "prompts": records.len(),
            "samples": args.samples, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
            "seed": args.seed, "rows": rows});
        crate::io::write_json_atomic(out, &meta)?;
        let mut md = format!(
            "Rollout/learner mismatch on {} ({} prompts x {} samples, T = {}, up to {} new tokens, seed {}):\n\n\
             | rollout | training forward | k3 KL | abs dp max | abs dp mean | error-token frac | tokens |\n|---|---|---|---|---|---|---|\n",
            path.display(), records.len(), args.samples, args.temperature, args.max_new_tokens, args.seed
        );
        for r in &rows {
            md += &format!(
                "| {} | {} | {:.3e} | {:.3e} | {:.3e} | {:.4} | {} |\n",
                r["scheme"].as_str().unwrap_or(""),
                r["forward"].as_str().unwrap_or(""),
                r[keys[0].0].as_f64().unwrap_or(f64::NAN),
                r[keys[1].0].as_f64().unwrap_or(f64::NAN),
                r[keys[2].0].as_f64().unwrap_or(f64::NAN),
                r[keys[3].0].as_f64().unwrap_or(f64::NAN),
                r["response_tokens"],
            );
        }
        std::fs::write(out.with_extension("md"), md)
            .with_context(|| format!("{}: cannot write", out.with_extension("md").display()))?;
    }
    Ok(())
}
