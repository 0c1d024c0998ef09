use std::path::PathBuf;

use crate::ops::BackendKind;
use crate::train::{self, config, TrainConfig};

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// TOML config (see configs/); without it, the embedded default (configs/default.toml) runs.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue from the newest checkpoint in the run directory.
    #[arg(long)]
    pub resume: bool,
    /// Start over in a run directory that already has checkpoints (they and its metrics are deleted).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// With --resume: go on although the config differs from the run's in settings a resume keeps (a
    /// lower learning rate after a divergence); the run's earlier config is kept as
    /// `config.before_step_N.json` beside the new one.
    #[arg(long, requires = "resume")]
    pub accept_changes: bool,
    /// Override one config value, e.g. `--set train.lr=3e-5 --set rollout.precision=fp8-b128`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Compute backend (flex, wgpu, cuda); overrides the config's `train.backend`.
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, clap::Args)]
pub struct SftArgs {
    /// A run's TOML config (the whole of it, as `qarl train` reads it: `[rollout]`, `[train]` and `[eval]`
    /// are required too, though SFT uses `[model]`, `[task]` and `[sft]`); without it, the embedded default.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one config value, e.g. `--set sft.steps=500`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Compute backend (flex, wgpu, cuda); overrides the config's `train.backend`.
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

/// Loads the config (`backend`, when given, replaces `train.backend`); for the embedded default,
/// materialises its model config where it expects it.
fn load(
    path: Option<&std::path::Path>,
    overrides: &[String],
    backend: Option<BackendKind>,
) -> anyhow::Result<TrainConfig> {
    let cfg = train::load_config_on(path, overrides, backend)?;
    // A backend this build cannot run is refused before anything is written.
    cfg.train.backend.device()?;
    // Only the default's own path: another (`--set model.init_config=...`, a typo) is the user's to give.
    let default = std::path::Path::new(config::DEFAULT_MODEL_CONFIG_PATH);
    if path.is_none() && cfg.model.init_config.as_deref() == Some(default) && !default.is_file() {
        crate::io::write_atomic(default, config::DEFAULT_MODEL_CONFIG.as_bytes())?;
        eprintln!(
            "wrote {} (the default config's model, embedded in qarl) in the working directory",
            default.display()
        );
    }
    Ok(cfg)
}

pub fn run_train(args: TrainArgs) -> anyhow::Result<()> {
    let cfg = load(args.config.as_deref(), &args.set, args.backend)?;
    let s = train::run_with(
        &cfg,
        &train::RunOptions {
            resume: args.resume,
            quiet: args.quiet,
            overwrite: args.overwrite,
            accept_changes: args.accept_changes,
            ..train::RunOptions::default()
        },
    )?;
    println!("run directory: {}", s.run_dir.display());
    println!("metrics:       {}", s.metrics_path.display());
    match train::plot::plot_run(&s.run_dir) {
        Ok(png) => println!("plots:         {}", png.display()),
        Err(e) => println!("plots:         not drawn ({e:#})"),
    }
    match (&s.paired, s.accuracy_before, s.accuracy_after) {
        (Some(p), _, _) => println!("held-out greedy accuracy ({}): {p}", cfg.rollout.precision),
        (None, Some(b), Some(a)) => println!(
            "held-out greedy accuracy ({}): {b:.3} before RL -> {a:.3} after RL",
            cfg.rollout.precision
        ),
        _ => {}
    }
    if let (empty @ 1.., steps) = s.steps_without_update {
        println!(
            "no update:     {empty} of {steps} RL steps (dynamic sampling kept no group: every group's \
             rewards were equal; `train/kept_sequences`)"
        );
    }
    Ok(())
}

pub fn run_sft(args: SftArgs) -> anyhow::Result<()> {
    let cfg = load(args.config.as_deref(), &args.set, args.backend)?;
    if cfg.sft.is_none() {
        anyhow::bail!("the config has no [sft] section");
    }
    if cfg.model.dir.join("config.json").is_file() {
        anyhow::bail!(
            "{}: a model is already there; remove it to warm-start again",
            cfg.model.dir.display()
        );
    }
    train::apply_process_modes(&cfg);
    let device = cfg.train.backend.device()?.autodiff();
    std::fs::create_dir_all(&cfg.run_dir)
        .map_err(crate::io::failed(&cfg.run_dir, "cannot create `run_dir`"))?;
    let mut log = train::metrics::MetricsLog::open(&cfg.run_dir.join("sft_metrics.jsonl"))?;
    train::prepare_model(&cfg, &device, &mut log, args.quiet)?;
    println!("model: {}", cfg.model.dir.display());
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct ExperimentArgs {
    /// Experiment file (e.g. experiments/paper_mini.toml): a base config, variants and seeds.
    pub file: PathBuf,
    /// Only rebuild the report from the finished runs.
    #[arg(long)]
    pub report_only: bool,
    /// Compute backend (flex, wgpu, cuda) of every run; overrides `train.backend` of the base config and
    /// the variants. (`--report-only` runs nothing: refused beside it.)
    #[arg(long, value_enum, conflicts_with = "report_only")]
    pub backend: Option<BackendKind>,
    /// A config value for every run, over the base's and the variants' (`--set train.steps=2` for a
    /// short trial of a study); repeatable. Needs `--results-dir`: such runs never go among the
    /// experiment's own.
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "results_dir")]
    pub set: Vec<String>,
    /// Where the runs and the report go, instead of the file's `results_dir` (by default
    /// experiments/results/<name>).
    #[arg(long, value_name = "DIR")]
    pub results_dir: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run_experiment(args: ExperimentArgs) -> anyhow::Result<()> {
    let exp = train::experiment::ExperimentConfig::load(&args.file)?
        .with_overrides(&args.set, args.results_dir.clone())?;
    let report = if args.report_only {
        let results = exp.results();
        if !results.is_dir() {
            anyhow::bail!(
                "{}: no results of this experiment yet ({} does not exist)",
                args.file.display(),
                results.display()
            );
        }
        train::experiment::check_report(&args.file, &exp)?;
        exp.claim_results(&args.file, &results)?;
        train::experiment::write_report(&exp, &results)?
    } else {
        train::experiment::run_loaded_experiment(&args.file, exp, args.quiet, args.backend)?
    };
    println!("report: {}", report.display());
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// A run directory (with metrics.jsonl), e.g. runs/default.
    pub run_dir: PathBuf,
}

pub fn run_plot(args: PlotArgs) -> anyhow::Result<()> {
    let png = train::plot::plot_run(&args.run_dir)?;
    println!("plots: {}", png.display());
    Ok(())
}
