//! The reference policy of the KL term (`train.loss.kl_coef > 0`, verl's `use_kl_loss`): the run's starting
//! model (`model.dir`, the warm start's result), frozen, run with the learner's forward (`train.forward`:
//! the aligned forward on its rollout-precision packed weights, or the f32 masters), so that the KL is 0
//! at the first update of step 0 and grows only as training moves the policy, not with the quantization
//! noise between the two forwards (k3 0.71 between SmolLM2's int4 and f32 forwards on GSM8K prompts).
//! A resume loads it from `model.dir` again, and refuses a folder whose files are not the ones the run
//! started from (their fingerprint is in every checkpoint's trainer state): a resume may point `model.dir`
//! elsewhere (the folder moved), but the KL's target must stay the run's.

use std::path::Path;

use anyhow::Context;
use burn::module::Module;

use super::batch::{ForwardOptions, SeqBatch};
use super::config::TrainConfig;
use crate::host::to_f32_vec;
use crate::model::{Decoder, Weights};

/// The frozen starting policy, on the plain (no-gradient) device.
pub struct Reference {
    model: Decoder,
    weights: Weights,
    fingerprint: String,
}

impl Reference {
    /// The reference of `cfg` where its KL term is on (`None` otherwise), loaded from `model.dir` onto the
    /// plain view of `device` (one more copy of the model's weights in memory). `fingerprint`: the folder's
    /// [`files_fingerprint`] where the caller took it already ([`check_resumed`]), else it is taken here.
    pub fn load(
        cfg: &TrainConfig,
        device: &burn::tensor::Device,
        fingerprint: Option<String>,
    ) -> anyhow::Result<Option<Self>> {
        if cfg.train.loss.kl_weight() <= 0.0 {
            return Ok(None);
        }
        // Before the weights are read, so that files changed meanwhile never pass for the ones recorded.
        let fingerprint = match fingerprint {
            Some(f) => f,
            None => files_fingerprint(&cfg.model.dir)?,
        };
        let mut model = Decoder::load_full_precision(&cfg.model.dir, device)?;
        model.set_precision(cfg.rollout.precision)?;
        model.set_activations(cfg.train.activations)?;
        Ok(Some(Self {
            model: model.valid(),
            weights: cfg.train.forward.weights(),
            fingerprint,
        }))
    }

    /// What identifies the reference's files: their fingerprint ([`files_fingerprint`]).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// `lp_ref` of each response of `batch` at `temperature`, with the learner's routing replay (when on):
    /// the two policies then differ in their weights only, as the learner's update sees them.
    pub fn logprobs(
        &self,
        batch: &SeqBatch,
        temperature: f32,
        replay: Option<&[Option<Vec<u32>>]>,
    ) -> Vec<Vec<f32>> {
        let (lp, _) = batch.logprobs_with(
            &self.model,
            self.weights,
            temperature,
            replay,
            ForwardOptions::default(),
        );
        batch.responses_of(&to_f32_vec(lp))
    }
}

/// A fingerprint of a model folder's weights and config: FNV-1a (64-bit, each product folded by a shift)
/// over `config.json` and every `*.safetensors` file in name order, each name, length and content (as
/// little-endian 64-bit words), as 16 hex digits. Stable across builds and machines, unlike std's hasher.
pub fn files_fingerprint(dir: &Path) -> anyhow::Result<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n == "config.json" || n.ends_with(".safetensors"))
        .collect();
    names.sort();
    crate::io::fingerprint_of(dir, &names)
}

/// Refuses a `model_dir` other than the model a resumed run started from (`saved.start_model`, or in older
/// checkpoints the KL reference they name), before the resume changes anything in the run directory: the
/// prompts' tokenizer and end tokens, and the KL term's reference (`kl`: the run has one), come from it.
/// Returns the fingerprint it took, where it took one.
pub fn check_resumed(
    saved: &super::checkpoint::TrainerState,
    model_dir: &Path,
    kl: bool,
) -> anyhow::Result<Option<String>> {
    if kl && saved.reference.is_none() {
        tracing::warn!(
            model = %model_dir.display(),
            "the checkpoint names no KL reference (the KL term was off until now): the reference is this \
             folder's model from here on"
        );
    }
    let Some(saved) = saved.start_model.as_deref().or(saved.reference.as_deref()) else {
        return Ok(None);
    };
    let now = files_fingerprint(model_dir)?;
    anyhow::ensure!(
        now == saved,
        "{}: not the model this run started from (files fingerprint {now}, its checkpoint names {saved}): \
         the prompts' tokenizer and end tokens (and the KL term's reference) come from the run's starting \
         model; point `model.dir` at that folder, or start over with --overwrite",
        model_dir.display()
    );
    Ok(Some(now))
}
