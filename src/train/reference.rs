//! The reference policy of the KL term (`train.loss.kl_coef > 0`, verl's `use_kl_loss`): the run's starting
//! model (`model.dir`, the warm start's result), frozen, run with the learner's forward (`train.forward`:
//! the aligned forward on its rollout-precision packed weights, or the f32 masters), so that the KL is 0
//! at the first update of step 0 and grows only as training moves the policy, not with the quantization
//! noise between the two forwards (k3 0.71 between SmolLM2's int4 and f32 forwards on GSM8K prompts).
//! A resume loads it from `model.dir` again: the same weights, so the same bits.

use burn::module::Module;

use super::batch::{ForwardOptions, SeqBatch};
use super::config::TrainConfig;
use crate::host::to_f32_vec;
use crate::model::{Decoder, Weights};

/// The frozen starting policy, on the plain (no-gradient) device.
pub struct Reference {
    model: Decoder,
    weights: Weights,
}

impl Reference {
    /// The reference of `cfg` where its KL term is on (`None` otherwise), loaded from `model.dir` onto the
    /// plain view of `device` (one more copy of the model's weights in memory).
    pub fn load(cfg: &TrainConfig, device: &burn::tensor::Device) -> anyhow::Result<Option<Self>> {
        if cfg.train.loss.kl_coef.unwrap_or(0.0) <= 0.0 {
            return Ok(None);
        }
        let mut model = Decoder::load_full_precision(&cfg.model.dir, device)?;
        model.set_precision(cfg.rollout.precision)?;
        model.set_activations(cfg.train.activations)?;
        Ok(Some(Self {
            model: model.valid(),
            weights: cfg.train.forward.weights(),
        }))
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
