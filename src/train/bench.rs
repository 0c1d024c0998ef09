//! `qarl bench step`: RL steps of a training config, timed phase by phase. Each step runs exactly what
//! `qarl train` runs ([`super::rl::rl_step`], which records the split in its `perf/*` metrics); the bench
//! adds warm-up steps, the machine's FMA peak and DRAM bandwidth measured in the same run, and the peak
//! resident memory, and prints a table per config.

use std::collections::BTreeMap;

use anyhow::Context;
use burn::tensor::Device;

use super::config::TrainConfig;
use super::metrics::MetricsLog;
use super::model_dir::prepare_model;
use super::{optimizer, rl};
use crate::model::{Decoder, Tokenizer};
use crate::tasks::Task;

/// The `perf/*` metrics of the timed steps of one config.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct StepTimings {
    /// One map per timed step (warm-up steps left out).
    pub steps: Vec<BTreeMap<String, f64>>,
    /// Parameters of the model, for the report.
    pub model: String,
}

impl StepTimings {
    /// The median over the timed steps of metric `key` (`None` when no step has it).
    pub fn median(&self, key: &str) -> Option<f64> {
        let mut v: Vec<f64> = self
            .steps
            .iter()
            .filter_map(|m| m.get(key).copied())
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(if v.len() % 2 == 1 {
            v[v.len() / 2]
        } else {
            0.5 * (v[v.len() / 2 - 1] + v[v.len() / 2])
        })
    }

    /// The largest value over the timed steps of `key`.
    pub fn max(&self, key: &str) -> Option<f64> {
        self.steps
            .iter()
            .filter_map(|m| m.get(key).copied())
            .reduce(f64::max)
    }
}

/// Runs `warmup + steps` RL steps of `cfg` from its model (created and warm-started first, as `qarl train`
/// would, when `model.dir` does not exist yet) and returns the metrics of the last `steps`. The RL steps
/// write nothing: no metrics file, no checkpoint, no evaluation (creating a missing model takes the run
/// directory's lock and writes the warm start's checkpoints there, as `qarl train` does).
pub fn bench_steps(
    cfg: &TrainConfig,
    device: &Device,
    warmup: usize,
    steps: usize,
    quiet: bool,
) -> anyhow::Result<StepTimings> {
    anyhow::ensure!(steps > 0, "--steps must be at least 1");
    super::apply_process_modes(cfg);
    let model_made = cfg.model.dir.join("config.json").is_file();
    // What the config asks of the model, known from the config the warm start builds from: refused
    // before the warm start runs.
    let planned = super::model_dir::check_sources(cfg, model_made, false)?;
    super::run::check_planned_model(cfg, &planned, &cfg.model.dir)?;
    if !model_made {
        // The warm start's own metrics go to a scratch file: the bench leaves the run directory alone.
        let scratch = std::env::temp_dir().join(format!("qarl-bench-{}", std::process::id()));
        std::fs::create_dir_all(&scratch)
            .with_context(|| format!("{}: cannot create", scratch.display()))?;
        let mut log = MetricsLog::open(&scratch.join("metrics.jsonl"))?;
        let made = prepare_model(cfg, device, &mut log, quiet);
        let _ = std::fs::remove_dir_all(&scratch);
        made?;
    }
    let mut model = Decoder::load_full_precision(&cfg.model.dir, device)?;
    let tok = Tokenizer::load_required(&cfg.model.dir, &model.config)?;
    let task = Task::from_config(&cfg.task)?;
    let end =
        crate::model::EndTokens::of(&tok, &model.config)?.with_turn_ends(&tok, &task.turn_ends());
    super::run::check_model_for_config(cfg, &model.config, &tok, &cfg.model.dir)?;
    super::run::check_step_sizes(cfg, &model.config, None, None)?;
    let mut optim = optimizer(&cfg.train);
    model.set_precision(cfg.rollout.precision)?;
    model.set_activations(cfg.train.activations)?;
    let c = &model.config;
    let description = format!(
        "{} layers, hidden {}, vocab {}{}",
        c.num_hidden_layers,
        c.hidden_size,
        c.vocab_size,
        c.moe.as_ref().map_or(String::new(), |m| format!(
            ", {} experts (top {})",
            m.num_experts, m.num_experts_per_tok
        ))
    );
    let reference = super::reference::Reference::load(cfg, device, None)?;
    let mut timed = Vec::new();
    for step in 0..warmup + steps {
        let phase = if step < warmup { "warm-up" } else { "timed" };
        // A step of a real model takes minutes on a CPU: the spinner shows the bench is at work.
        let spinner = super::progress::spinner(
            &format!("step {}/{} ({phase})", step + 1, warmup + steps),
            quiet,
        );
        let out = rl::rl_step(
            &mut model,
            &mut optim,
            &task,
            &tok,
            &end,
            reference.as_ref(),
            cfg,
            step,
            false,
        );
        spinner.finish_and_clear();
        let out = out?;
        if !quiet {
            eprintln!(
                "step {}/{} ({phase}): {:.1} s",
                step + 1,
                warmup + steps,
                out.metrics.get("perf/step_s").copied().unwrap_or(f64::NAN)
            );
        }
        if step >= warmup {
            timed.push(out.metrics);
        }
    }
    Ok(StepTimings {
        steps: timed,
        model: description,
    })
}
