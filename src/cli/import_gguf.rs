use std::path::PathBuf;

use crate::model::gguf::{import_gguf, OutputDtype};

#[derive(Debug, clap::Args)]
pub struct ImportGgufArgs {
    /// A llama.cpp GGUF file (Llama architecture; F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors).
    pub file: PathBuf,
    /// Output model directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json).
    #[arg(long)]
    pub output: PathBuf,
    /// Storage of the dequantized weights: f32 (exact) or bf16 (half the size, rounded).
    #[arg(long, default_value = "f32")]
    pub dtype: OutputDtype,
}

pub fn run(args: ImportGgufArgs) -> anyhow::Result<()> {
    // Into a temporary sibling, renamed on success: a failed import leaves no half-written directory and
    // never mixes new weights with an old config or tokenizer.
    let s =
        crate::io::write_dir_atomic(&args.output, |tmp| import_gguf(&args.file, tmp, args.dtype))?;
    let types: Vec<String> = s
        .source_types
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    println!(
        "imported {} ({} tensors: {}; {:.1}M parameters) -> {}",
        s.architecture,
        s.tensors,
        types.join(", "),
        s.parameters as f64 / 1e6,
        args.output.display()
    );
    Ok(())
}
