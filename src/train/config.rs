//! The TOML configuration of `qarl sft` / `qarl train`: typed, unknown keys rejected, values range-checked.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::quant::QuantScheme;
use crate::rl::advantages::AdvantageConfig;
use crate::rl::losses::LossConfig;
use crate::tasks::verify::VerifyConfig;
use crate::tasks::TaskConfig;

/// Weights for the forward: full precision (`"f32"`) or a quantization scheme (`"int4-g128"`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Precision(pub Option<QuantScheme>);

impl TryFrom<String> for Precision {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        if s == "f32" {
            return Ok(Self(None));
        }
        s.parse::<QuantScheme>()
            .map(|q| Self(Some(q)))
            .map_err(|e| format!("{e} (or \"f32\")"))
    }
}

impl From<Precision> for String {
    fn from(p: Precision) -> String {
        p.to_string()
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            None => f.write_str("f32"),
            Some(q) => write!(f, "{q}"),
        }
    }
}

/// Which weights the learner's forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainForward {
    /// Full-precision masters (the learner differs from a quantized sampler).
    Full,
    /// QaRL: the rollout's quantized weights through the same low-bit matmul, STE to the masters.
    Aligned,
}

/// Where the starting weights come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSource {
    /// A Hugging Face model directory; if it has no weights yet, it is created from `init_config` and
    /// (when `[sft]` is given) warm-started by supervised training on worked solutions.
    pub dir: PathBuf,
    /// config.json used to initialise `dir` with random weights when it does not exist.
    #[serde(default)]
    pub init_config: Option<PathBuf>,
    /// Standard deviation of the random initialisation.
    #[serde(default = "default_init_std")]
    pub init_std: f32,
}

fn default_init_std() -> f32 {
    0.02
}

/// Supervised warm start on worked solutions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftConfig {
    pub steps: usize,
    pub batch_size: usize,
    pub lr: f64,
    #[serde(default)]
    pub warmup_steps: usize,
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f32,
    #[serde(default = "default_log_every")]
    pub log_every: usize,
}

fn default_weight_decay() -> f32 {
    0.0
}
fn default_log_every() -> usize {
    10
}

/// Sampling of the rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    pub precision: Precision,
    pub prompts_per_step: usize,
    pub samples_per_prompt: usize,
    #[serde(default = "one")]
    pub temperature: f32,
    #[serde(default = "one")]
    pub top_p: f32,
    #[serde(default)]
    pub top_k: usize,
    pub max_new_tokens: usize,
}

fn one() -> f32 {
    1.0
}

/// Learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    Constant,
    Cosine,
}

/// The RL update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlConfig {
    pub steps: usize,
    pub forward: TrainForward,
    pub lr: f64,
    #[serde(default = "default_schedule")]
    pub lr_schedule: LrSchedule,
    #[serde(default)]
    pub warmup_steps: usize,
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f32,
    /// AdamW's epsilon. Larger values damp the sign-like steps Adam takes on parameters whose gradients are
    /// tiny and noisy, which on small models otherwise random-walk the policy.
    #[serde(default = "default_adam_eps")]
    pub adam_eps: f32,
    /// Clip the gradient norm (0 = off).
    #[serde(default)]
    pub grad_clip: f32,
    /// Passes over each step's rollouts.
    #[serde(default = "one_usize")]
    pub epochs: usize,
    /// Sequences per optimizer step (0 = the whole batch: one update per epoch).
    #[serde(default)]
    pub minibatch_size: usize,
    /// Reuse the rollout's expert choices in the training forward (MoE routing replay, R3).
    #[serde(default)]
    pub routing_replay: bool,
    /// DAPO dynamic sampling: drop groups whose rewards are all equal.
    #[serde(default)]
    pub dynamic_sampling: bool,
    #[serde(default = "AdvantageConfig::grpo")]
    pub advantage: AdvantageConfig,
    pub loss: LossConfig,
    /// What `error_tokens/*` counts as a repetition loop (raise `min_span` for character tokenizers).
    #[serde(default)]
    pub error_tokens: crate::rl::metrics::LoopRule,
}

fn default_adam_eps() -> f32 {
    1e-5
}

fn default_schedule() -> LrSchedule {
    LrSchedule::Constant
}
fn one_usize() -> usize {
    1
}

/// Held-out evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalConfig {
    /// Evaluate every `every` RL steps (and before the first and after the last).
    pub every: usize,
    /// Held-out problems.
    pub problems: usize,
    /// Samples per problem for mean@k (0 = greedy pass@1 only).
    #[serde(default)]
    pub k: usize,
    #[serde(default = "one")]
    pub temperature: f32,
    pub max_new_tokens: usize,
}

/// Everything `qarl train` needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Directory of metrics, checkpoints and plots.
    pub run_dir: PathBuf,
    #[serde(default)]
    pub seed: u64,
    pub model: ModelSource,
    pub task: TaskConfig,
    #[serde(default)]
    pub verify: VerifyConfig,
    #[serde(default)]
    pub sft: Option<SftConfig>,
    pub rollout: RolloutConfig,
    pub train: RlConfig,
    pub eval: EvalConfig,
    /// Write a checkpoint every this many RL steps (0: only at the end).
    #[serde(default)]
    pub checkpoint_every: usize,
}

/// The configuration `qarl train` runs without arguments: a tiny MoE on synthetic arithmetic.
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/default.toml");
/// The model it starts from.
pub const DEFAULT_MODEL_CONFIG: &str = include_str!("../../configs/models/qwen3-moe-arith.json");

impl TrainConfig {
    /// Parses TOML text; errors name `origin` and the offending key.
    pub fn from_toml(text: &str, origin: &str) -> anyhow::Result<Self> {
        let cfg: Self = toml::from_str(text).map_err(|e| anyhow::anyhow!("{origin}: {e}"))?;
        cfg.validate()
            .map_err(|e| anyhow::anyhow!("{origin}: {e}"))?;
        Ok(cfg)
    }

    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read", path.display()))?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Range checks the type system cannot express.
    pub fn validate(&self) -> anyhow::Result<()> {
        let r = &self.rollout;
        if r.prompts_per_step == 0 || r.samples_per_prompt < 2 {
            bail!("rollout: prompts_per_step must be >= 1 and samples_per_prompt >= 2 (group baselines)");
        }
        if r.max_new_tokens == 0 {
            bail!("rollout.max_new_tokens must be >= 1");
        }
        if !(r.temperature > 0.0 && r.temperature.is_finite()) {
            bail!("rollout.temperature must be > 0");
        }
        if !(r.top_p > 0.0 && r.top_p <= 1.0) {
            bail!("rollout.top_p must be in (0, 1]");
        }
        let t = &self.train;
        if !(t.lr > 0.0 && t.lr.is_finite()) || t.epochs == 0 {
            bail!("train: lr must be > 0 and epochs >= 1");
        }
        if t.grad_clip < 0.0 {
            bail!("train.grad_clip must be >= 0");
        }
        t.loss
            .clone()
            .resolve()
            .map_err(|e| anyhow::anyhow!("train.loss: {e}"))?;
        t.advantage
            .validate()
            .map_err(|e| anyhow::anyhow!("train.advantage: {e}"))?;
        if let Some(s) = &self.sft {
            if s.batch_size == 0 || s.lr.is_nan() || s.lr <= 0.0 {
                bail!("sft: batch_size must be >= 1 and lr > 0");
            }
        }
        if self.eval.every == 0 || self.eval.max_new_tokens == 0 {
            bail!("eval: every and max_new_tokens must be >= 1");
        }
        Ok(())
    }
}

/// Learning rate at `step` (0-based) of `total` with linear warm-up.
pub fn lr_at(base: f64, schedule: LrSchedule, warmup: usize, step: usize, total: usize) -> f64 {
    if step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    match schedule {
        LrSchedule::Constant => base,
        LrSchedule::Cosine => {
            let span = total.saturating_sub(warmup).max(1) as f64;
            let p = (step - warmup) as f64 / span;
            base * 0.5 * (1.0 + (std::f64::consts::PI * p.min(1.0)).cos())
        }
    }
}
