use std::path::PathBuf;

use crate::model::quantize_checkpoint;
use crate::quant::{QuantConfig, QuantScheme};

#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// Hugging Face model directory (full precision).
    #[arg(long)]
    pub model: PathBuf,
    /// Quantization scheme: int4-g32, int4-g64, int4-g128, int8-pc, fp8-b128, nvfp4, mxfp4.
    #[arg(long, visible_alias = "quant")]
    pub scheme: QuantScheme,
    /// Output directory (config.json with `quantization_config`, model.safetensors with codes and scales).
    #[arg(long)]
    pub output: PathBuf,
    /// Glob patterns of HF weight names to quantize (repeatable; default: every `*_proj.weight`).
    #[arg(long = "include")]
    pub include: Vec<String>,
    /// Glob patterns of HF weight names to keep in full precision (repeatable).
    #[arg(long = "exclude")]
    pub exclude: Vec<String>,
}

pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    let mut cfg = QuantConfig::new(args.scheme);
    if !args.include.is_empty() {
        cfg.include = args.include;
    }
    cfg.exclude = args.exclude;
    if crate::io::same_dir(&args.model, &args.output) {
        anyhow::bail!(
            "{}: --output is the --model directory; the quantized copy goes to another directory",
            args.output.display()
        );
    }
    // Into a temporary sibling, renamed on success (a failure leaves `--output` as it was).
    let s = crate::io::write_dir_atomic(&args.output, |tmp| {
        quantize_checkpoint(&args.model, tmp, &cfg)
    })?;
    println!(
        "{}: {} tensors quantized ({}), {} copied; {:.1} MB -> {:.1} MB",
        args.output.display(),
        s.quantized_tensors,
        args.scheme,
        s.copied_tensors,
        s.bytes_before as f64 / 1e6,
        s.bytes_after as f64 / 1e6
    );
    Ok(())
}
