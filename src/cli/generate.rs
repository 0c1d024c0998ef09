use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::backend::BackendKind;
use crate::io::{read_json, write_json_atomic};
use crate::model::{Decoder, Tokenizer};
use crate::rollout::generate_greedy;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// JSON file `{"input_ids": [[id, ...], ...]}` (or `prompt_ids`), rows of equal length.
    #[arg(long, conflicts_with = "prompt", required_unless_present = "prompt")]
    pub prompt_ids: Option<PathBuf>,
    /// A text prompt (needs the model's tokenizer.json).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Number of tokens to generate per row.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Greedy decoding (argmax). Sampling arrives with the rollout engine.
    #[arg(long)]
    pub greedy: bool,
    /// Stop a row at the model's end-of-sequence token(s).
    #[arg(long)]
    pub stop_at_eos: bool,
    /// Where to write `{"ids": [[prompt + new ids], ...], "text": [...]}`.
    #[arg(long)]
    pub output: PathBuf,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Flex)]
    pub backend: BackendKind,
}

#[derive(Deserialize)]
struct PromptFile {
    #[serde(alias = "prompt_ids")]
    input_ids: Vec<Vec<u32>>,
}

#[derive(Serialize)]
struct GenerateOutput {
    ids: Vec<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<Vec<String>>,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if !args.greedy {
        anyhow::bail!("only greedy decoding is available yet: pass --greedy");
    }
    let device = args.backend.device()?;
    let model = Decoder::load(&args.model, &device)?;
    let tokenizer = Tokenizer::load_optional(&args.model)?;
    let prompts = match (&args.prompt_ids, &args.prompt) {
        (Some(path), _) => {
            let f: PromptFile = read_json(path)?;
            model
                .check_ids(&f.input_ids)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            f.input_ids
        }
        (None, Some(text)) => {
            let tok = tokenizer.as_ref().ok_or_else(|| {
                anyhow::anyhow!(
                    "{}: no tokenizer.json, so --prompt cannot be used; pass --prompt-ids",
                    args.model.display()
                )
            })?;
            let ids = tok.encode(text)?;
            model
                .check_ids(std::slice::from_ref(&ids))
                .map_err(|e| anyhow::anyhow!("--prompt: {e}"))?;
            vec![ids]
        }
        (None, None) => unreachable!("clap requires one of them"),
    };
    let stop: Vec<u32> = if args.stop_at_eos {
        model.config.eos_token_ids.clone()
    } else {
        vec![]
    };
    let ids = generate_greedy(&model, &prompts, args.max_new_tokens, &stop);
    let text = match &tokenizer {
        Some(t) => Some(
            ids.iter()
                .map(|r| t.decode(r))
                .collect::<anyhow::Result<Vec<_>>>()?,
        ),
        None => None,
    };
    write_json_atomic(&args.output, &GenerateOutput { ids, text })?;
    Ok(())
}
