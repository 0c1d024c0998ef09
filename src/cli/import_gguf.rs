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
    let s = crate::io::write_dir_atomic(&args.output, |tmp| {
        let s = import_gguf(&args.file, tmp, args.dtype)?;
        // Metadata that disagrees with the tensors, or values no model can use, would otherwise make a
        // directory that every later command refuses: its files are checked as a load checks them
        // (headers only, not the weights in f32) before it is moved into place.
        let device = crate::ops::BackendKind::Flex.device()?;
        crate::model::Decoder::check_files(tmp, &device).map_err(|e| {
            // The message names the temporary folder's files; they would have been the output's.
            let why = e.to_string().replace(
                &tmp.display().to_string(),
                &args.output.display().to_string(),
            );
            anyhow::anyhow!(
                "{}: the imported model would not load ({why}); nothing was written",
                args.file.display()
            )
        })?;
        Ok(s)
    })?;
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
