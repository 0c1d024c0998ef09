use std::path::PathBuf;

use crate::model::init::{param_count, write_random_checkpoint};
use crate::model::ModelConfig;

#[derive(Debug, clap::Args)]
pub struct InitModelArgs {
    /// The model's config.json (any architecture the loader supports).
    #[arg(long)]
    pub config: PathBuf,
    /// Directory to write (config.json + model.safetensors): new, or empty.
    #[arg(long)]
    pub output: PathBuf,
    /// Seed of the random weights: the same seed gives the same file.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Standard deviation of the matrices (normal(0, std)); norm weights are 1, biases 0.
    #[arg(long, default_value_t = 0.02, value_parser = super::f32_flag)]
    pub std: f32,
    /// Refuse models whose f32 weights would take more than this many GB (the weights are built in memory).
    #[arg(long, default_value_t = 32.0)]
    pub max_gb: f64,
}

pub fn run(args: InitModelArgs) -> anyhow::Result<()> {
    // Random weights over a model someone trained would be a silent loss, and beside another model's
    // files (shards, an index, a tokenizer) a directory that loads as neither.
    if crate::io::occupied_dir(&args.output)? {
        anyhow::bail!(
            "{}: exists and is not empty; init-model writes into a new or empty directory (remove this \
             one first if its files may go)",
            args.output.display()
        );
    }
    anyhow::ensure!(
        args.max_gb.is_finite() && args.max_gb > 0.0,
        "--max-gb must be a finite number of GB > 0, got {}",
        args.max_gb
    );
    let cfg = ModelConfig::from_file(&args.config)?;
    let gb = param_count(&cfg) as f64 * 4.0 / 1e9;
    if gb > args.max_gb {
        anyhow::bail!(
            "{}: this model's f32 weights would take {gb:.1} GB, more than --max-gb {}; raise --max-gb if that is intended",
            args.config.display(),
            args.max_gb
        );
    }
    // The weights are built in memory before they are written: past the memory, the allocation aborted
    // the process (leaving a partial folder behind) instead of an error.
    let need = param_count(&cfg) as u128 * 4;
    if let Some(have) = crate::rollout::budget::short_of(need) {
        anyhow::bail!(
            "{}: this model's f32 weights ({gb:.1} GB) are built in memory before they are written, and \
             {:.1} GB is available",
            args.config.display(),
            have as f64 / 1e9
        );
    }
    let start = std::time::Instant::now();
    // Written in a temporary sibling and moved into place whole: a kill leaves no half-written model (and
    // the next write of this output removes what the killed one left).
    crate::io::write_dir_atomic(&args.output, |tmp| {
        write_random_checkpoint(&args.config, tmp, args.seed, args.std)
    })?;
    let n = param_count(&cfg);
    println!(
        "{}: {} {} parameters ({:.1}M, {:.2} GB f32), seed {}, std {}, written in {:.1} s",
        args.output.display(),
        cfg.architecture.hf_name(),
        n,
        n as f64 / 1e6,
        n as f64 * 4.0 / 1e9,
        args.seed,
        args.std,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
