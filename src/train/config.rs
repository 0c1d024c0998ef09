//! The TOML configuration of `qarl sft` / `qarl train`: typed, unknown keys rejected, values range-checked.

use std::path::{Path, PathBuf};

use anyhow::bail;
use serde::{Deserialize, Serialize};

use crate::model::Weights;
pub use crate::quant::Precision;
use crate::rl::advantages::AdvantageConfig;
use crate::rl::losses::LossConfig;
use crate::tasks::verify::VerifyConfig;
use crate::tasks::TaskConfig;

pub mod overrides;
mod toml_errors;
use toml_errors::{check_float_range, line_of_key, locate_in_task};
pub use toml_errors::{closest, edit_distance};
pub(crate) use toml_errors::{explain_toml_error, key_named_in};

/// Which weights the learner's forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainForward {
    /// Full-precision masters (the learner differs from a quantized sampler).
    Full,
    /// QaRL: the rollout's quantized weights through the same low-bit matmul, STE to the masters.
    Aligned,
}

impl TrainForward {
    /// The weights this training forward multiplies with.
    pub fn weights(self) -> Weights {
        match self {
            Self::Full => Weights::Master,
            Self::Aligned => Weights::Packed,
        }
    }
}

/// Where the starting weights come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSource {
    /// A Hugging Face model directory; if it has no weights yet, it is created from `init_config` or
    /// `base` and (when `[sft]` is given) warm-started by supervised training on worked solutions.
    pub dir: PathBuf,
    /// config.json used to initialise `dir` with random weights when it does not exist.
    #[serde(default)]
    pub init_config: Option<PathBuf>,
    /// A pretrained Hugging Face model directory that `[sft]` fine-tunes into `dir` when `dir` does not
    /// exist (its tokenizer and other files are copied along), so an RL study can start from a checkpoint
    /// that already knows the task's answer format.
    #[serde(default)]
    pub base: Option<PathBuf>,
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
    /// Fraction of the warm start's examples whose target is the answer alone, without working
    /// (`Task::answer_only_solution`), drawn per example from the seed. Real pretraining text is like this: most
    /// answers come without their working. The warm-started model then has two ways to answer, and RL with a
    /// verifiable reward has to find out which one pays (0 = worked solutions only).
    #[serde(default)]
    pub answer_only_frac: f64,
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
    #[serde(default = "one_f64")]
    pub top_p: f64,
    #[serde(default)]
    pub top_k: usize,
    pub max_new_tokens: usize,
    /// Which log-prob of a sampled token is recorded as `lp_roll` (docs/config.md).
    #[serde(default)]
    pub logprobs: RolloutLogprobs,
    /// Where a response ends besides `max_new_tokens`: the model's end tokens, or also the task's stop
    /// strings. The held-out evaluations stop where the rollouts do.
    #[serde(default)]
    pub stop: RolloutStop,
}

impl RolloutConfig {
    /// Whether a top-k or top-p filter truncates the distribution the tokens are drawn from.
    pub fn truncates(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0
    }

    /// Whether `lp_roll` is the full vocabulary's log-prob, the learner's: always under
    /// [`RolloutLogprobs::Full`], and under `Processed` where no filter truncates.
    pub fn records_learner_logprobs(&self) -> bool {
        self.logprobs == RolloutLogprobs::Full || !self.truncates()
    }
}

/// `rollout.logprobs`: the log-prob recorded for each sampled token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RolloutLogprobs {
    /// `log_softmax(logits / T)` over the whole vocabulary: what the learner computes (its bits in
    /// deterministic mode, so `lp_old` can be the record).
    #[default]
    Full,
    /// Under the distribution the token was drawn from, after top-k / top-p and renormalisation (vLLM's
    /// `processed_logprobs`, verl's default): the mismatch metrics and corrections then see the filter too.
    Processed,
}

/// `rollout.stop`: what ends a rollout's (and a held-out evaluation's) response before `max_new_tokens`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum RolloutStop {
    /// The model's end tokens only (`model::EndTokens`; verl's rollouts stop at EOS alone too).
    #[default]
    #[value(
        alias = "end_tokens",
        help = "the model's end tokens only (verl's rollouts stop at EOS alone too)"
    )]
    EndTokens,
    /// Also the task's stop strings ([`crate::tasks::Task::stop_strings`]: `"\n"` after arithmetic's answer
    /// line, `"\nQuestion:"` for the plain template, where a base model goes on with a question of its
    /// own, the turn's end under a chat template), as `qarl eval` stops by default.
    #[value(
        help = "also the template's stop string: `\\nQuestion:` after a plain prompt, the turn's end under a chat template"
    )]
    Template,
}

impl RolloutStop {
    /// The strings that end a response under this rule besides the end tokens `end`: none, or the
    /// template's (`template_strings`: a task's or `qarl eval`'s prompt template's) without those that are
    /// the text of an end token ([`crate::model::EndTokens::beyond_stops`]).
    pub fn strings(
        self,
        end: &crate::model::EndTokens,
        tok: &crate::model::Tokenizer,
        template_strings: impl FnOnce() -> Vec<String>,
    ) -> Vec<String> {
        match self {
            RolloutStop::EndTokens => vec![],
            RolloutStop::Template => end.beyond_stops(tok, template_strings()),
        }
    }
}

fn one() -> f32 {
    1.0
}

/// 1.0 for the `top_p` settings, which are f64 (see [`crate::rollout::SamplingParams::top_p`]).
fn one_f64() -> f64 {
    1.0
}

/// Learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    Constant,
    Cosine,
}

/// The kernels of `train.tensor_cores`' order ([`RlConfig::tensor_core_kernel`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorCoreKernel {
    /// Decoded codes staged in shared memory (`cube_kernels::kernels::mma`, `mma_moe`).
    #[default]
    Tiles,
    /// Packed words staged, fragments decoded in registers (`cube_kernels::kernels::mma_frag`).
    Fragments,
}

impl std::fmt::Display for TensorCoreKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TensorCoreKernel::Tiles => "tiles",
            TensorCoreKernel::Fragments => "fragments",
        })
    }
}

/// The RL update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlConfig {
    pub steps: usize,
    /// The compute backend of the warm start, the RL steps (rollout and update) and the evaluations:
    /// `flex` (the CPU, the default), `wgpu` or `cuda` (cargo features of the same names). `--backend`
    /// on the command line overrides it.
    #[serde(default)]
    pub backend: crate::ops::BackendKind,
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
    /// Sequences per forward/backward pass within a minibatch (0 = the whole minibatch in one pass). Smaller
    /// passes keep fewer activations alive (the peak memory of an update) and accumulate the gradient,
    /// which then differs from the single pass's only by summation order (and, under half-precision
    /// activations, each pass's rounding of its gradient to them); the loss and its metrics stay
    /// bitwise the same. A multiple of `rollout.samples_per_prompt` keeps each prompt's forward shared by
    /// its samples.
    #[serde(default)]
    pub micro_batch_size: usize,
    /// Reuse the rollout's expert choices in the training forward (MoE routing replay, R3).
    #[serde(default)]
    pub routing_replay: bool,
    /// Deterministic mode (the default): every matmul, softmax and reduction of the forward in one fixed,
    /// batch-invariant order, so the aligned training forward reproduces the rollout's log-probs bit for
    /// bit. `false`: the backend's own (faster) kernels, whose sums round differently in the rollout's
    /// decode steps and the training forward's full sequences; the mismatch that leaves shows in
    /// `rollout_corr/*` and `error_tokens/*`, and `lp_old` is always recomputed.
    #[serde(default = "yes")]
    pub deterministic: bool,
    /// The activations' type of the rollouts, the training forward and the evaluations: `f32` (the
    /// default), `bf16` or `f16` (mixed precision: the weights and the optimizer state stay f32, every op
    /// computes in f32 and rounds its output once; see [`crate::model::activations`]). The warm start
    /// (`[sft]`) trains in f32.
    #[serde(default)]
    pub activations: crate::model::Activations,
    /// Deterministic mode's low-bit products on a CubeCL backend (`cuda`, `wgpu`) in the tensor-core tiles'
    /// order (`cube_kernels::kernels::mma`, `mma_moe`): the half activations times the weights' codes on
    /// tensor cores, one f32 accumulator per scale group, the K tiling fixed by the weight, so the
    /// rollout's decode and the training forward still compute the same bits (another order than the
    /// default's, so both take it). Needs `activations = "bf16"` or `"f16"`, deterministic mode and a
    /// weight-only rollout format; on a device without the instruction the same tiles run with scalar
    /// multiply-adds (slower; a warning says so). `false` (the default): the canonical f32 order.
    #[serde(default)]
    pub tensor_cores: bool,
    /// Which kernels run `tensor_cores`' order: `"tiles"` (the default, `cube_kernels::kernels::mma`,
    /// `mma_moe`: decoded codes staged in shared memory) or `"fragments"` (`kernels::mma_frag`: packed
    /// words staged, each unit decoding its own `m16n8k16` fragment registers, scale groups applied in
    /// registers). The same order; the same bits on the scalar twins (tested), expected the same on the
    /// instruction (`qarl bench kernels --check` counts any difference). Refused without
    /// `tensor_cores = true`.
    #[serde(default)]
    pub tensor_core_kernel: TensorCoreKernel,
    /// With `tensor_core_kernel = "fragments"`: the most sets of planes (1, 2 or 4) among which a call
    /// whose cubes are few (a decode step) splits its scale groups (`cube_kernels::FragmentShape::
    /// with_group_splits`): more of each weight row in flight, the same bits. 1 (the default): never.
    #[serde(default = "default_fragment_group_splits")]
    pub fragment_group_splits: usize,
    /// Where `lp_old` is taken from the rollout's record (deterministic mode, aligned forward, one update per
    /// step: the same bits), recompute it with a forward anyway and stop with an error if any token differs.
    #[serde(default)]
    pub lp_old_check: bool,
    /// The forward after each step's updates behind `actor/update_lp_delta_pos|neg` (did the update move
    /// the log-probs the right way?). A diagnostic only, and a forward over the step's rows with a nonzero
    /// advantage: about 5% of an aligned SmolLM2 step on 2 cores, about 20% of one whose training forward
    /// is the f32 masters' (`lp_old` recomputed too); `false` skips it and those two metrics.
    #[serde(default = "yes")]
    pub update_diagnostics: bool,
    /// DAPO dynamic sampling: drop groups whose rewards are all equal.
    #[serde(default)]
    pub dynamic_sampling: bool,
    /// With `dynamic_sampling`: how many more rounds of `rollout.prompts_per_step` new prompts a step may
    /// sample to keep `prompts_per_step` groups with a reward signal (DAPO's refill; verl's
    /// `filter_groups.max_num_gen_batches` minus one). 0 (the default): no refill.
    #[serde(default)]
    pub refill_rounds: usize,
    #[serde(default = "AdvantageConfig::grpo")]
    pub advantage: AdvantageConfig,
    pub loss: LossConfig,
    /// What `error_tokens/*` counts as a repetition loop (raise `min_span` for character tokenizers).
    #[serde(default)]
    pub error_tokens: crate::rl::metrics::LoopRule,
    /// Stop the run after this many consecutive steps whose update was skipped for a non-finite (NaN or
    /// infinite) loss or gradient (0: never stop; such updates are always skipped).
    #[serde(default = "default_max_nonfinite_steps")]
    pub max_nonfinite_steps: usize,
}

fn default_max_nonfinite_steps() -> usize {
    5
}

fn default_adam_eps() -> f32 {
    1e-5
}

fn default_fragment_group_splits() -> usize {
    1
}

fn default_schedule() -> LrSchedule {
    LrSchedule::Constant
}
fn one_usize() -> usize {
    1
}
fn yes() -> bool {
    true
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
    /// Nucleus filter of the mean@k samples (1 = off; verl's `val_kwargs.top_p`).
    #[serde(default = "one_f64")]
    pub top_p: f64,
    /// Top-k filter of the mean@k samples (0 = off; verl's `val_kwargs.top_k`, -1 there).
    #[serde(default)]
    pub top_k: usize,
    pub max_new_tokens: usize,
}

/// The files a run writes directly in `run_dir` (beside `checkpoints/` and the configs kept by accepted
/// changes, `config.before_step_*.json`): its config, its logs, its plots and an experiment's mark that
/// it finished. No input of the run may be one of them.
pub const RUN_FILES: [&str; 6] = [
    "config.json",
    "metrics.jsonl",
    "sft_metrics.jsonl",
    "worst_responses.jsonl",
    "plots.png",
    "finished.json",
];

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
    /// Keep only the newest this many checkpoints (0: keep all).
    #[serde(default = "default_keep_checkpoints")]
    pub keep_checkpoints: usize,
}

fn default_keep_checkpoints() -> usize {
    3
}

/// The configuration `qarl train` runs without arguments: a tiny MoE on synthetic arithmetic.
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/default.toml");
/// The model it starts from.
pub const DEFAULT_MODEL_CONFIG: &str = include_str!("../../configs/models/qwen3-moe-arith.json");
/// Where the default config names that model file (its `model.init_config`).
pub const DEFAULT_MODEL_CONFIG_PATH: &str = "configs/models/qwen3-moe-arith.json";

impl TrainConfig {
    /// The same config with the defaults that its loss, advantage and task tables leave implicit written
    /// out ([`LossConfig::with_defaults`], [`AdvantageConfig::with_defaults`],
    /// [`TaskConfig::with_defaults`]): `qarl config show` prints
    /// this, so every value a run uses is on the page. It resolves to the same run.
    pub fn with_defaults(&self) -> Self {
        let mut filled = self.clone();
        filled.train.loss = self.train.loss.with_defaults();
        filled.train.advantage = self.train.advantage.with_defaults();
        filled.task = self.task.with_defaults();
        filled
    }

    /// The keys (dotted paths) of options that are off unless given and are not set here: what
    /// [`Self::with_defaults`] cannot write, since TOML has no "unset".
    pub fn unset_options(&self) -> Vec<String> {
        let mut unset: Vec<String> = [
            ("model.init_config", self.model.init_config.is_none()),
            ("model.base", self.model.base.is_none()),
            ("sft", self.sft.is_none()),
        ]
        .into_iter()
        .filter(|&(_, off)| off)
        .map(|(key, _)| key.to_string())
        .collect();
        if let TaskConfig::Gsm8k(d) | TaskConfig::Math(d) = &self.task {
            if d.eval_path.is_none() {
                unset.push("task.eval_path".into());
            }
        }
        if let Some(chat) = self.task.chat_template() {
            let keys = [
                ("task.template.model_dir", chat.model_dir.is_none()),
                ("task.template.system", chat.system.is_none()),
                (
                    "task.template.enable_thinking",
                    chat.enable_thinking.is_none(),
                ),
            ];
            unset.extend(
                keys.into_iter()
                    .filter(|&(_, off)| off)
                    .map(|(k, _)| k.to_string()),
            );
        }
        unset.extend(
            self.train
                .loss
                .unset_options()
                .into_iter()
                .map(|name| format!("train.loss.{name}")),
        );
        if self.train.loss.corrections.is_empty() {
            // An empty array of tables has no TOML form, so the printed config cannot show it.
            unset.push("train.loss.corrections".into());
        }
        if self.verify.format_reward.is_none() {
            unset.push("verify.format_reward".into());
        }
        unset
    }

    /// Every path a run of this config reads, by its key, and whether it names a folder.
    fn input_paths(&self) -> Vec<(&'static str, &Path, bool)> {
        let mut inputs = vec![("model.dir", self.model.dir.as_path(), true)];
        inputs.extend(self.model.base.as_deref().map(|p| ("model.base", p, true)));
        let init = self.model.init_config.as_deref();
        inputs.extend(init.map(|p| ("model.init_config", p, false)));
        if let TaskConfig::Gsm8k(d) | TaskConfig::Math(d) = &self.task {
            inputs.push(("task.path", d.path.as_path(), false));
            inputs.extend(d.eval_path.as_deref().map(|p| ("task.eval_path", p, false)));
        }
        let template_dir = self
            .task
            .chat_template()
            .and_then(|t| t.model_dir.as_deref());
        inputs.extend(template_dir.map(|p| ("task.template.model_dir", p, true)));
        inputs
    }

    /// Refuses an input ([`Self::input_paths`]) that the run's own writes would replace or delete: a
    /// folder that is `run_dir` (whose `config.json` the run's config replaces: a model's, or the base's),
    /// a file among [`RUN_FILES`], and anything inside the run's checkpoints, which a fresh run
    /// (`--overwrite`) deletes and pruning removes.
    fn check_inputs_outside_outputs(&self) -> anyhow::Result<()> {
        let run_dir = &self.run_dir;
        let checkpoints = run_dir.join("checkpoints");
        for (key, path, is_dir) in self.input_paths() {
            let shown = path.display().to_string();
            if is_dir && crate::io::same_dir(path, run_dir) {
                bail!(
                    "`{key}` = {shown:?} is `run_dir`: the run's config.json and metrics would overwrite \
                     its files; choose another `run_dir`"
                );
            }
            if crate::io::within(path, &checkpoints) {
                bail!(
                    "`{key}` = {shown:?} is inside the run's checkpoints ({}), which a fresh run \
                     (`--overwrite`) deletes and checkpoint pruning removes: copy it elsewhere, or \
                     continue that run with `--resume`",
                    checkpoints.display()
                );
            }
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            let written = RUN_FILES.contains(&name)
                || (name.starts_with("config.before_step_") && name.ends_with(".json"));
            let in_run_dir = path.parent().is_some_and(|p| {
                crate::io::same_dir(
                    if p.as_os_str().is_empty() {
                        Path::new(".")
                    } else {
                        p
                    },
                    run_dir,
                )
            });
            if !is_dir && written && in_run_dir {
                bail!(
                    "`{key}` = {shown:?} is a file the run writes in `run_dir` (its {}): keep the input \
                     elsewhere, or choose another `run_dir`",
                    RUN_FILES.join(", ")
                );
            }
        }
        Ok(())
    }

    /// The files a run of this config reads or keeps (the model's and the base model's files, the model
    /// config it may be created from, the task's data, the run directory's records), those that exist:
    /// what a command's output beside the run (`qarl bench step --json`) must not replace.
    pub fn files_in_use(&self) -> Vec<PathBuf> {
        use crate::model::checkpoint::files_read;
        let mut files = files_read(&self.model.dir);
        files.extend(self.model.base.iter().flat_map(|b| files_read(b)));
        files.extend(self.model.init_config.iter().cloned());
        if let TaskConfig::Gsm8k(d) | TaskConfig::Math(d) = &self.task {
            files.push(d.path.clone());
            files.extend(d.eval_path.iter().cloned());
        }
        files.extend(
            ["config.json", "metrics.jsonl", "sft_metrics.jsonl"]
                .iter()
                .map(|name| self.run_dir.join(name)),
        );
        files.retain(|p| p.exists());
        files
    }

    /// Parses TOML text; errors name `origin`, the full key path and the reason, and suggest the closest
    /// valid key for a misspelt one.
    pub fn from_toml(text: &str, origin: &str) -> anyhow::Result<Self> {
        Self::parse(text, origin, true)
    }

    /// `from_toml` for text the user did not write line by line (a file with `--set` overrides applied):
    /// errors name the key path but no line.
    pub fn from_generated_toml(text: &str, origin: &str) -> anyhow::Result<Self> {
        Self::parse(text, origin, false)
    }

    fn parse(text: &str, origin: &str, lines: bool) -> anyhow::Result<Self> {
        // A value out of range, found after TOML's own checks, named with its line where the text has one.
        let located = |e: anyhow::Error| {
            let message = e.to_string();
            let line = key_named_in(&message)
                .filter(|_| lines)
                .and_then(|key| line_of_key(text, key));
            match line {
                Some(l) => anyhow::anyhow!("{origin}, line {l}: {message}"),
                None => anyhow::anyhow!("{origin}: {message}"),
            }
        };
        if let Ok(doc) = text.parse::<toml::Table>() {
            // An experiment file given where a run's config is expected: say so, not "unknown key `base`".
            if doc.contains_key("variant") && doc.contains_key("base") {
                anyhow::bail!(
                    "{origin}: an experiment file (`base`, `[[variant]]`), not a run's config: run it with \
                     `qarl experiment {origin}`"
                );
            }
            check_float_range(&doc, &mut Vec::new()).map_err(located)?;
        }
        let cfg: Self = toml::from_str(text).map_err(|e| {
            let e = locate_in_task(text, &e).unwrap_or(e);
            explain_toml_error(&e, text, origin, lines)
        })?;
        cfg.validate().map_err(located)?;
        Ok(cfg)
    }

    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(crate::io::failed(path, "cannot read"))?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// `train.tensor_cores`' requirements: half activations (the instruction's operands), deterministic
    /// mode (the tiles' point is a fixed order), a CubeCL backend (the CPU has no such tiles) and a
    /// weight-only rollout format (fp8-b128 quantizes the activations too).
    fn check_tensor_cores(&self) -> anyhow::Result<()> {
        let t = &self.train;
        let refuse = |why: String| anyhow::bail!("`train.tensor_cores` = true: {why}");
        if t.activations.dtype() == burn::tensor::DType::F32 {
            return refuse(
                "needs half activations (`train.activations` = \"bf16\" or \"f16\"), the \
                 instruction's operands; `train.activations` is \"f32\""
                    .into(),
            );
        }
        if !t.deterministic {
            return refuse(
                "needs deterministic mode (`train.deterministic` = true): outside it the backend's own \
                 kernels run"
                    .into(),
            );
        }
        if t.backend == crate::ops::BackendKind::Flex {
            return refuse(
                "needs a CubeCL backend (`train.backend` = \"cuda\" or \"wgpu\"); the CPU (flex) has \
                 no tensor-core tiles"
                    .into(),
            );
        }
        match self.rollout.precision.scheme() {
            Some(scheme) if scheme.quantizes_activations() => refuse(format!(
                "`rollout.precision` = \"{}\" quantizes the activations too; the tiles take \
                 weight-only formats",
                scheme.name()
            )),
            Some(_) => Ok(()),
            None => refuse(
                "`rollout.precision` = \"f32\" runs no low-bit product, so the tiles would change \
                 nothing; choose a weight-only format (int4-g*, int8-pc, nvfp4, mxfp4)"
                    .into(),
            ),
        }
    }

    /// What keeps `lp_old` from being the rollout's record for a step of `rows` responses, or `None` where
    /// the learner's forward computes the record's bits: the aligned forward in deterministic mode, one
    /// update per step over every response, a sampling temperature, and a record of the full vocabulary's
    /// log-probs. The one rule of [`crate::train::rl::lp_old_is_the_rollout_record`] and of
    /// `train.lp_old_check`'s validation.
    pub fn lp_old_reuse_blocker(&self, rows: usize) -> Option<String> {
        let t = &self.train;
        Some(if t.forward != TrainForward::Aligned {
            "`train.forward` is \"full\"".to_string()
        } else if !t.deterministic {
            "`train.deterministic` is false".to_string()
        } else if t.epochs != 1 {
            format!("`train.epochs` is {}", t.epochs)
        } else if !self.rollout.records_learner_logprobs() {
            "`rollout.logprobs` is \"processed\" under a top-k / top-p filter".to_string()
        } else if t.minibatch_size != 0 && t.minibatch_size < rows {
            format!(
                "`train.minibatch_size` {} is below a step's {rows} responses",
                t.minibatch_size
            )
        } else if self.rollout.temperature <= 0.0 {
            "`rollout.temperature` is 0".to_string()
        } else {
            return None;
        })
    }

    /// `train.lp_old_check`'s requirement: a run where `lp_old` is the rollout's record
    /// ([`Self::lp_old_reuse_blocker`] with a step's full batch). Elsewhere `lp_old` is always recomputed
    /// and the setting would pass without checking anything.
    fn check_lp_old_check(&self) -> anyhow::Result<()> {
        let rows = self
            .rollout
            .prompts_per_step
            .saturating_mul(self.rollout.samples_per_prompt);
        let Some(why) = self.lp_old_reuse_blocker(rows) else {
            return Ok(());
        };
        anyhow::bail!(
            "`train.lp_old_check` = true checks the rollout's record reused as `lp_old`, which only the \
             aligned forward in deterministic mode, with one update per step over every response, reuses: \
             {why}, so it would check nothing"
        )
    }

    /// Range checks the type system cannot express; errors name the key path, its value and the rule.
    pub fn validate(&self) -> anyhow::Result<()> {
        fn check(
            ok: bool,
            key: &str,
            value: impl std::fmt::Display,
            rule: &str,
        ) -> anyhow::Result<()> {
            if !ok {
                bail!("`{key}` = {value}: must be {rule}");
            }
            Ok(())
        }
        let pos_f32 = |v: f32| v > 0.0 && v.is_finite();
        let nonneg_f32 = |v: f32| v >= 0.0 && v.is_finite();
        // The run's files (config.json, metrics.jsonl) go there: an empty path would write them into
        // the working directory, and the model's own directory would lose its config.json.
        if self.run_dir.as_os_str().is_empty() {
            bail!("`run_dir` = \"\": must name a directory (the run's config, metrics and checkpoints go there)");
        }
        if crate::io::same_dir(&self.run_dir, &self.model.dir) {
            bail!(
                "`run_dir` = {:?} is `model.dir`: the run's config.json and metrics would overwrite the \
                 model's files; choose another `run_dir`",
                self.run_dir.display().to_string()
            );
        }
        self.check_inputs_outside_outputs()?;
        let loops = &self.train.error_tokens;
        check(
            (1..=64).contains(&loops.max_pattern),
            "train.error_tokens.max_pattern",
            loops.max_pattern,
            "1 to 64 (tokens per repeated pattern; the count is linear in it)",
        )?;
        check(
            loops.min_repeats >= 2,
            "train.error_tokens.min_repeats",
            loops.min_repeats,
            ">= 2 (a pattern seen once is no loop: every token would count)",
        )?;
        check(
            pos_f32(self.model.init_std),
            "model.init_std",
            self.model.init_std,
            "a finite number > 0",
        )?;
        // Without an init config no weight is drawn: a value other than the default is set for nothing.
        if self.model.init_config.is_none()
            && self.model.base.is_none()
            && self.model.init_std != default_init_std()
        {
            bail!(
                "`model.init_std` = {} without `model.init_config`: only random weights made from an init \
                 config are drawn with it (`model.dir` is used as it is); remove the key",
                self.model.init_std
            );
        }
        if let Some(base) = &self.model.base {
            // Pretrained weights are not drawn: a value other than the default was set for nothing.
            if self.model.init_std != default_init_std() {
                bail!(
                    "`model.init_std` = {} beside `model.base` = {:?}: the warm start starts from the base's \
                     weights, and only random ones (`model.init_config`) are drawn with it",
                    self.model.init_std,
                    base.display().to_string()
                );
            }
            if self.model.init_config.is_some() {
                bail!(
                    "`model.base` = {:?} and `model.init_config` both given: the warm start starts from one \
                     of them (pretrained weights or random ones)",
                    base.display().to_string()
                );
            }
            if self.sft.is_none() {
                bail!(
                    "`model.base` = {:?} without an `[sft]` section: nothing would change the base's weights; \
                     set `model.dir` to the base directory instead, or add `[sft]`",
                    base.display().to_string()
                );
            }
            // The warm start writes its result to `model.dir`, and runs only where that is missing: the
            // base itself is always there, so `[sft]` would never run.
            if crate::io::same_dir(base, &self.model.dir) {
                bail!(
                    "`model.base` = {:?} is `model.dir`: the warm start writes its model to `model.dir` and \
                     runs only where none is there, so it would never run; give `model.dir` a new folder",
                    base.display().to_string()
                );
            }
        }
        let r = &self.rollout;
        check(
            r.prompts_per_step >= 1,
            "rollout.prompts_per_step",
            r.prompts_per_step,
            ">= 1",
        )?;
        check(
            r.samples_per_prompt >= 2,
            "rollout.samples_per_prompt",
            r.samples_per_prompt,
            ">= 2 (advantages need a group baseline)",
        )?;
        check(
            r.max_new_tokens >= 1,
            "rollout.max_new_tokens",
            r.max_new_tokens,
            ">= 1",
        )?;
        check(
            r.temperature.is_finite() && r.temperature >= crate::rollout::sampler::MIN_TEMPERATURE,
            "rollout.temperature",
            r.temperature,
            &format!(
                "a finite number >= {:e}",
                crate::rollout::sampler::MIN_TEMPERATURE
            ),
        )?;
        check(
            r.top_p > 0.0 && r.top_p <= 1.0,
            "rollout.top_p",
            r.top_p,
            "in (0, 1]",
        )?;
        let t = &self.train;
        check(
            t.lr > 0.0 && t.lr.is_finite(),
            "train.lr",
            t.lr,
            "a finite number > 0",
        )?;
        check(t.epochs >= 1, "train.epochs", t.epochs, ">= 1")?;
        // Updates are of whole groups from a group up: a size between two multiples made updates of one
        // and of two groups (128 responses in groups of 8 at 12: 16-row and 8-row updates, whose sequences
        // weigh 2x apart), larger than asked.
        let group = self.rollout.samples_per_prompt;
        check(
            t.minibatch_size < group || t.minibatch_size.is_multiple_of(group),
            "train.minibatch_size",
            t.minibatch_size,
            &format!(
                "a multiple of `rollout.samples_per_prompt` = {group} (updates are of whole groups), or \
                 below it (updates split a group), or 0 (one update)"
            ),
        )?;
        check(
            t.steps >= 1,
            "train.steps",
            t.steps,
            ">= 1 (a run of no RL step has nothing to compare before and after)",
        )?;
        check(
            nonneg_f32(t.weight_decay),
            "train.weight_decay",
            t.weight_decay,
            "a finite number >= 0",
        )?;
        check(
            pos_f32(t.adam_eps),
            "train.adam_eps",
            t.adam_eps,
            "a finite number > 0",
        )?;
        check(
            nonneg_f32(t.grad_clip),
            "train.grad_clip",
            t.grad_clip,
            "a finite number >= 0 (0 = off)",
        )?;
        check(
            [1, 2, 4].contains(&t.fragment_group_splits),
            "train.fragment_group_splits",
            t.fragment_group_splits,
            "1, 2 or 4 (the planes of a fragment tiles' cube)",
        )?;
        if t.fragment_group_splits > 1 && t.tensor_core_kernel != TensorCoreKernel::Fragments {
            anyhow::bail!(
                "`train.fragment_group_splits` = {} needs `train.tensor_core_kernel` = \"fragments\": \
                 only the fragment tiles split their scale groups",
                t.fragment_group_splits
            );
        }
        if t.refill_rounds > 0 && !t.dynamic_sampling {
            anyhow::bail!(
                "`train.refill_rounds` = {} needs `train.dynamic_sampling` = true: a refill replaces the \
                 groups dynamic sampling drops",
                t.refill_rounds
            );
        }
        if t.lp_old_check {
            self.check_lp_old_check()?;
        }
        if t.tensor_cores {
            self.check_tensor_cores()?;
        } else if t.tensor_core_kernel != TensorCoreKernel::Tiles {
            anyhow::bail!(
                "`train.tensor_core_kernel` = \"{}\" needs `train.tensor_cores` = true: without it the \
                 low-bit products take the canonical order, not the tensor-core tiles' order",
                t.tensor_core_kernel
            );
        }
        t.loss
            .clone()
            .resolve()
            .map_err(|e| anyhow::anyhow!("`train.loss`: {e}"))?;
        t.advantage
            .validate()
            .map_err(|e| anyhow::anyhow!("`train.advantage`: {e}"))?;
        self.verify
            .validate()
            .map_err(|e| anyhow::anyhow!("`verify`: {e}"))?;
        match &self.task {
            crate::tasks::TaskConfig::Arithmetic(a) => {
                a.validate().map_err(|e| anyhow::anyhow!("`task`: {e}"))?
            }
            crate::tasks::TaskConfig::Gsm8k(d) => d.check("gsm8k")?,
            crate::tasks::TaskConfig::Math(d) => d.check("math")?,
        }
        if let Some(s) = &self.sft {
            check(s.steps >= 1, "sft.steps", s.steps, ">= 1")?;
            check(s.batch_size >= 1, "sft.batch_size", s.batch_size, ">= 1")?;
            check(
                s.lr > 0.0 && s.lr.is_finite(),
                "sft.lr",
                s.lr,
                "a finite number > 0",
            )?;
            check(
                nonneg_f32(s.weight_decay),
                "sft.weight_decay",
                s.weight_decay,
                "a finite number >= 0",
            )?;
            check(s.log_every >= 1, "sft.log_every", s.log_every, ">= 1")?;
            check(
                (0.0..1.0).contains(&s.answer_only_frac),
                "sft.answer_only_frac",
                s.answer_only_frac,
                "in [0, 1)",
            )?;
        }
        let v = &self.verify;
        if v.overlong_buffer > 0 {
            check(
                v.overlong_buffer <= self.rollout.max_new_tokens,
                "verify.overlong_buffer",
                v.overlong_buffer,
                &format!(
                    "<= `rollout.max_new_tokens` = {} (the penalty starts at max_new_tokens - overlong_buffer \
                     tokens; verl's DAPO reward manager allows the whole length)",
                    self.rollout.max_new_tokens
                ),
            )?;
            check(
                v.overlong_penalty >= 0.0,
                "verify.overlong_penalty",
                v.overlong_penalty,
                ">= 0",
            )?;
        } else if v.overlong_penalty != 1.0 {
            bail!(
                "`verify.overlong_penalty` = {} without `verify.overlong_buffer`: the penalty applies \
                 within the buffer, which is off (0)",
                v.overlong_penalty
            );
        }
        let e = &self.eval;
        check(e.every >= 1, "eval.every", e.every, ">= 1")?;
        check(e.problems >= 1, "eval.problems", e.problems, ">= 1")?;
        check(
            e.max_new_tokens >= 1,
            "eval.max_new_tokens",
            e.max_new_tokens,
            ">= 1",
        )?;
        check(
            e.temperature.is_finite() && e.temperature >= crate::rollout::sampler::MIN_TEMPERATURE,
            "eval.temperature",
            e.temperature,
            &format!(
                "a finite number >= {:e}",
                crate::rollout::sampler::MIN_TEMPERATURE
            ),
        )?;
        check(
            e.top_p > 0.0 && e.top_p <= 1.0,
            "eval.top_p",
            e.top_p,
            "in (0, 1] (1 = off)",
        )?;
        // Greedy pass@1 has no temperature or filter: only mean@k samples. A value other than the default
        // was set for nothing.
        for (key, set) in [
            ("eval.temperature", e.temperature != one()),
            ("eval.top_p", e.top_p != one_f64()),
            ("eval.top_k", e.top_k != 0),
        ] {
            if e.k == 0 && set {
                bail!(
                    "`{key}` is set with `eval.k` = 0: only the sampled mean@k uses it (greedy pass@1 \
                     samples nothing); set `eval.k` or drop `{key}`"
                );
            }
        }
        Ok(())
    }
}

/// The knobs that change memory, checks or the kernels' layout but not what a run computes beyond the
/// summation order (JSON pointers into a config): neither a resume ([`super::RESUME_MAY_CHANGE`]) nor an
/// experiment's finished runs count them as another experiment.
pub const RESULT_NEUTRAL_KEYS: [&str; 9] = [
    "/train/backend",
    "/train/micro_batch_size",
    "/train/max_nonfinite_steps",
    "/train/lp_old_check",
    "/train/update_diagnostics",
    "/train/tensor_core_kernel",
    "/train/fragment_group_splits",
    "/checkpoint_every",
    "/keep_checkpoints",
];

/// The keys where `cfg` differs from `old` (a run's config as JSON, its defaults written out) outside
/// `may_change` (JSON pointers) and [`RESULT_NEUTRAL_KEYS`]: the settings that make a run another
/// experiment. `old` loses those keys.
pub fn identity_changes(
    old: &mut serde_json::Value,
    cfg: &TrainConfig,
    may_change: &[&str],
) -> anyhow::Result<Vec<String>> {
    let mut new = serde_json::to_value(cfg.with_defaults())?;
    for pointer in may_change.iter().chain(&RESULT_NEUTRAL_KEYS) {
        for v in [&mut *old, &mut new] {
            remove_pointer(v, pointer);
        }
    }
    Ok(differing_keys(old, &new))
}

/// Removes the value at `pointer` (`/a/b`) from `v`, if there is one.
fn remove_pointer(v: &mut serde_json::Value, pointer: &str) {
    // `pointer_mut("")` is the document itself.
    let Some((parent, key)) = pointer.rsplit_once('/') else {
        return;
    };
    if let Some(serde_json::Value::Object(map)) = v.pointer_mut(parent) {
        map.remove(key);
    }
}

/// The dotted keys where two configs (as JSON) differ: objects key by key, anything else (arrays
/// included) whole.
pub fn differing_keys(a: &serde_json::Value, b: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    differing_keys_at(a, b, "", &mut out);
    out
}

fn differing_keys_at(
    a: &serde_json::Value,
    b: &serde_json::Value,
    at: &str,
    out: &mut Vec<String>,
) {
    use serde_json::Value::Object;
    match (a, b) {
        (Object(x), Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let null = serde_json::Value::Null;
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                differing_keys_at(
                    x.get(k).unwrap_or(&null),
                    y.get(k).unwrap_or(&null),
                    &path,
                    out,
                );
            }
        }
        _ if a != b => out.push(at.to_string()),
        _ => {}
    }
}

/// Whether `consecutive` skipped (non-finite) steps in a row stop a loop of `steps` steps under
/// `train.max_nonfinite_steps = max` (0: never): at `max` of them, or, for a loop no longer than that,
/// when every step was skipped (it learned nothing). The RL loop and the warm start share the rule.
pub(crate) fn nonfinite_limit_reached(consecutive: usize, max: usize, steps: usize) -> bool {
    max > 0 && consecutive >= max.min(steps)
}

/// Says where a warm-up outlasts its schedule (`section` is `train` or `sft`): the learning rate then
/// peaks below its `lr` at the last step. Not refused: `--set train.steps=2` on a config with a longer
/// warm-up is how a change is tried in a short run.
pub fn warn_long_warmup(section: &str, warmup: usize, steps: usize) {
    if warmup > steps {
        tracing::warn!(
            "`{section}.warmup_steps` = {warmup} > `{section}.steps` = {steps}: the learning rate never \
             reaches `{section}.lr` (it ends at {steps}/{warmup} of it)"
        );
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
