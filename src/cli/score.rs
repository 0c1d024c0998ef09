use std::path::PathBuf;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::cli::load_model;
use crate::host::rows;
use crate::io::write_json_atomic;
use crate::model::scoring::next_token_logprobs;
use crate::ops::BackendKind;
use crate::quant::QuantScheme;

#[derive(Debug, clap::Args)]
pub struct ScoreArgs {
    /// Hugging Face model directory (config.json + model.safetensors or sharded index).
    #[arg(long)]
    pub model: PathBuf,
    /// JSON file `{"input_ids": [[id, ...], ...]}` (rows of equal length).
    #[arg(long)]
    pub input: PathBuf,
    /// Where to write `{"logits": [B][T][V], "logprobs": [B][T-1]}`.
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
    /// Leave the (large) logits out of the output.
    #[arg(long)]
    pub no_logits: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScoreInput {
    input_ids: Vec<Vec<u32>>,
}

#[derive(Serialize)]
struct ScoreOutput {
    #[serde(skip_serializing_if = "Option::is_none")]
    logits: Option<Vec<Vec<Vec<f32>>>>,
    logprobs: Vec<Vec<f32>>,
}

pub fn run(args: ScoreArgs) -> anyhow::Result<()> {
    let (input, _): (ScoreInput, _) = crate::io::read_json_expecting(
        &args.input,
        "an object {\"input_ids\": [[id, ...], ...]}, rows of token ids of equal length",
    )?;
    crate::io::check_output_file(&args.output)?;
    let inputs = super::inputs_with_model(&args.model, [&args.input]);
    crate::io::check_output_not_input(&args.output, &inputs)?;
    let device = args.backend.device()?;
    let model = load_model(&args.model, &device, args.quant, args.activations)?;
    model
        .check_ids(&input.input_ids)
        .with_context(|| args.input.display().to_string())?;
    let ids = &input.input_ids;
    let tokens = ids.first().map_or(0, Vec::len);
    let what = args.input.display().to_string();
    crate::rollout::budget::check_scoring_size(
        &model.config,
        &what,
        ids.len(),
        tokens,
        !args.no_logits,
    )?;
    let out = model.forward(ids, None, None, None);
    let [b, t, v] = out.logits.dims();
    let logprobs = if t > 1 {
        rows(next_token_logprobs(out.logits.clone(), ids))
    } else {
        vec![Vec::new(); b]
    };
    let logits = (!args.no_logits).then(|| {
        let flat = rows(out.logits.reshape([b * t, v]));
        flat.chunks(t).map(<[Vec<f32>]>::to_vec).collect()
    });
    // NaN would be written as `null` with exit 0: name the first row and position that is not finite.
    let bad_logits = logits.as_ref().and_then(|l: &Vec<Vec<Vec<f32>>>| {
        first_nonfinite(l, |v: &Vec<f32>| v.iter().all(|x| x.is_finite()))
    });
    // The log-prob at index p is that of token p + 1, computed from the logits at position p.
    let bad = bad_logits.or_else(|| first_nonfinite(&logprobs, |v: &f32| v.is_finite()));
    if let Some((r, p)) = bad {
        anyhow::bail!(
            "{}: the logits at position {p} of row {r} of {} are not finite (NaN or infinite){}",
            args.model.display(),
            args.input.display(),
            args.activations.nonfinite_hint()
        );
    }
    write_json_atomic(&args.output, &ScoreOutput { logits, logprobs })
        .with_context(|| "writing the scores".to_string())?;
    tracing::info!(rows = b, tokens = t, "scored");
    Ok(())
}

/// The first `(row, position)` whose value fails `finite`.
fn first_nonfinite<T>(rows: &[Vec<T>], finite: impl Fn(&T) -> bool) -> Option<(usize, usize)> {
    rows.iter()
        .enumerate()
        .find_map(|(r, row)| row.iter().position(|v| !finite(v)).map(|p| (r, p)))
}
