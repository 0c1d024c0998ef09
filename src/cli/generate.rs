use std::path::PathBuf;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::cli::load_model;
use crate::io::{read_json, write_json_atomic};
use crate::model::Tokenizer;
use crate::ops::BackendKind;
use crate::quant::QuantScheme;
use crate::rollout::{generate, FinishReason, SamplingParams};

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("prompts").required(true).args(["prompt_ids", "prompt"])))]
pub struct GenerateArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// JSON file `{"input_ids": [[id, ...], ...]}` (or `prompt_ids`); rows may differ in length.
    #[arg(long, conflicts_with = "prompt")]
    pub prompt_ids: Option<PathBuf>,
    /// A text prompt (needs the model's tokenizer.json).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Number of tokens to generate per row at most.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Samples per prompt (rows of the output are prompt-major: all samples of prompt 0 first).
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Greedy decoding (argmax); the same as `--temperature 0` (so it takes no sampling option).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    pub greedy: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 1.0, value_parser = super::f32_flag)]
    pub temperature: f32,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0, value_parser = super::f64_flag)]
    pub top_p: f64,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed: the same seed and inputs give the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop a row at the model's end tokens: with a tokenizer, the ones `qarl train` and `qarl eval` stop
    /// at (config.json's, generation_config.json's and tokenizer_config.json's end-of-sequence ids, and
    /// the first of `<eos>`, `<|im_end|>`, `<|endoftext|>` the tokenizer has); without, config.json's and
    /// generation_config.json's.
    #[arg(long)]
    pub stop_at_eos: bool,
    /// Extra stop token ids (repeatable).
    #[arg(long = "stop-id")]
    pub stop_ids: Vec<u32>,
    /// Stop strings (repeatable; need the tokenizer).
    #[arg(long = "stop")]
    pub stop_strings: Vec<String>,
    /// Where to write `{"ids", "logprobs", "finish_reasons", "text"}`.
    #[arg(long)]
    pub output: PathBuf,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Flex)]
    pub backend: BackendKind,
    /// Quantize the projections on load (int4-g32/64/128, int8-pc, fp8-b128, nvfp4, mxfp4); the forward then
    /// runs the low-bit matmul on the packed weights.
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
}

/// A `--prompt-ids` file: its rows under `input_ids`, or `prompt_ids` (the same field by another name;
/// given both, serde's alias reported a "duplicate field `input_ids`" the file did not repeat).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptFile {
    input_ids: Option<Vec<Vec<u32>>>,
    prompt_ids: Option<Vec<Vec<u32>>>,
}

impl PromptFile {
    /// The rows of the file at `path`.
    fn rows(self, path: &std::path::Path) -> anyhow::Result<Vec<Vec<u32>>> {
        match (self.input_ids, self.prompt_ids) {
            (Some(rows), None) | (None, Some(rows)) => Ok(rows),
            (Some(_), Some(_)) => anyhow::bail!(
                "{}: has both `input_ids` and `prompt_ids`, two names of the one field: keep one",
                path.display()
            ),
            (None, None) => anyhow::bail!(
                "{}: no `input_ids` field (or `prompt_ids`): expected {{\"input_ids\": [[id, ...], ...]}}",
                path.display()
            ),
        }
    }
}

#[derive(Serialize)]
struct GenerateOutput {
    ids: Vec<Vec<u32>>,
    logprobs: Vec<Vec<f32>>,
    finish_reasons: Vec<FinishReason>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<Vec<String>>,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    // Checked before anything is loaded: 0 used to write rows without a generated token and exit 0.
    if args.max_new_tokens == 0 {
        anyhow::bail!("--max-new-tokens must be at least 1 (0 generates nothing)");
    }
    crate::io::check_output_file(&args.output)?;
    let inputs = super::inputs_with_model(&args.model, args.prompt_ids.iter());
    crate::io::check_output_not_input(&args.output, &inputs)?;
    let mut stop_token_ids = args.stop_ids.clone();
    let device = args.backend.device()?;
    let model = load_model(&args.model, &device, args.quant, args.activations)?;
    let tokenizer = Tokenizer::load_for(&args.model, &model.config)?;
    if args.stop_at_eos {
        match &tokenizer {
            // One home for a model's end tokens: the same stops as training and evaluation.
            Some(tok) => {
                stop_token_ids.extend(crate::model::EndTokens::of(tok, &model.config)?.stops())
            }
            None => {
                let ids =
                    crate::model::EndTokens::ids_without_tokenizer(&args.model, &model.config)?;
                anyhow::ensure!(
                    !ids.is_empty(),
                    "--stop-at-eos: {0}/config.json and {0}/generation_config.json name no eos_token_id \
                     (and there is no tokenizer.json), so nothing would stop a row; pass --stop-id",
                    args.model.display()
                );
                stop_token_ids.extend(ids);
            }
        }
    }
    let vocab = model.config.vocab_size;
    if let Some(id) = args.stop_ids.iter().find(|&&id| id as usize >= vocab) {
        anyhow::bail!(
            "--stop-id {id}: outside the model's vocabulary (0..{vocab}), so it never occurs"
        );
    }
    let params = SamplingParams {
        temperature: if args.greedy { 0.0 } else { args.temperature },
        top_p: args.top_p,
        top_k: args.top_k,
        max_new_tokens: args.max_new_tokens,
        seed: args.seed,
        stop_token_ids,
        stop_strings: args.stop_strings.clone(),
        record_entropy: false,
        processed_logprobs: false,
    };
    params.validate().context("invalid sampling options")?;
    if args.samples == 0 {
        anyhow::bail!("--samples must be at least 1");
    }
    if !params.stop_strings.is_empty() && tokenizer.is_none() {
        anyhow::bail!(
            "{}: no tokenizer.json, so --stop strings cannot be matched; use --stop-id",
            args.model.display()
        );
    }
    let prompts = match (&args.prompt_ids, &args.prompt) {
        (Some(path), _) => {
            let rows = read_json::<PromptFile>(path)?.rows(path)?;
            model
                .check_prompts(&rows)
                .with_context(|| path.display().to_string())?;
            rows
        }
        (None, Some(text)) => {
            let tok = tokenizer.as_ref().ok_or_else(|| {
                anyhow::anyhow!(
                    "{}: no tokenizer.json, so --prompt cannot be used; pass --prompt-ids",
                    args.model.display()
                )
            })?;
            let ids = tok.encode_prompt(text, true).context("--prompt")?;
            model
                .check_prompts(std::slice::from_ref(&ids))
                .context("--prompt")?;
            vec![ids]
        }
        (None, None) => anyhow::bail!("pass --prompt-ids FILE or --prompt TEXT"),
    };
    // A prompt too long for the model's positions is named (the flags alone do not say it is the prompt).
    crate::rollout::check_prompts_size(
        &model.config,
        crate::rollout::RolloutInputs {
            rows: "--samples",
            reach: "--max-new-tokens",
        },
        prompts.len().saturating_mul(args.samples),
        &prompts,
        args.max_new_tokens,
        |i| match &args.prompt_ids {
            Some(path) => format!("{}: input_ids[{i}]", path.display()),
            None => "--prompt".to_string(),
        },
    )?;
    let rollout = generate(&model, &prompts, args.samples, &params, tokenizer.as_ref());
    rollout.ensure_finite().map_err(|e| {
        anyhow::anyhow!(
            "{}: {e}{}",
            args.model.display(),
            args.activations.nonfinite_hint()
        )
    })?;
    let text = match &tokenizer {
        Some(t) => Some(
            rollout
                .ids
                .iter()
                .map(|r| t.decode(r))
                .collect::<anyhow::Result<Vec<_>>>()?,
        ),
        None => None,
    };
    write_json_atomic(
        &args.output,
        &GenerateOutput {
            ids: rollout.ids,
            logprobs: rollout.logprobs,
            finish_reasons: rollout.finish_reasons,
            text,
        },
    )
}
