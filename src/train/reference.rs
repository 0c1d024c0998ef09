//! The reference policy of the KL term (`train.loss.kl_coef > 0`, verl's `use_kl_loss`): the run's starting
//! model (`model.dir`, the warm start's result), frozen, run with the learner's forward (`train.forward`:
//! the aligned forward on its rollout-precision packed weights, or the f32 masters), so that the KL is 0
//! at the first update of step 0 and grows only as training moves the policy, not with the quantization
//! noise between the two forwards (k3 0.71 between SmolLM2's int4 and f32 forwards on GSM8K prompts).
//! A resume loads it from `model.dir` again, and refuses a folder whose files are not the ones the run
//! started from (their fingerprint is in every checkpoint's trainer state): a resume may point `model.dir`
//! elsewhere (the folder moved), but the KL's target must stay the run's.

use std::io::Read;
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
    fingerprint_of(dir, &names)
}

/// The fingerprint of [`files_fingerprint`] over the files `names` of `dir`, in the order given.
pub fn fingerprint_of(dir: &Path, names: &[String]) -> anyhow::Result<String> {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    // FNV-1a on whole words, with a shift after each product: a product only carries bits upwards, so
    // without it the hash's low bits would never see a word's high bits.
    let mut mix = |word: u64| {
        h ^= word;
        h = h.wrapping_mul(PRIME);
        h ^= h >> 32;
    };
    let mut buf = vec![0u8; 1 << 20];
    for name in names {
        name.bytes().for_each(|b| mix(u64::from(b)));
        let path = dir.join(name);
        let mut file =
            std::fs::File::open(&path).map_err(crate::io::failed(&path, "cannot open"))?;
        let mut len = 0u64;
        loop {
            let n = fill(&mut file, &mut buf).map_err(crate::io::failed(&path, "cannot read"))?;
            if n == 0 {
                break;
            }
            len += n as u64;
            // Whole buffers until the last, so words start at the same offsets however the reads split the
            // file; the last one's short tail is padded with zeros (the length keeps files apart).
            for word in buf[..n].chunks(8) {
                let mut w = [0u8; 8];
                w[..word.len()].copy_from_slice(word);
                mix(u64::from_le_bytes(w));
            }
        }
        mix(len);
    }
    Ok(format!("{h:016x}"))
}

/// Reads into `buf` until it is full or the file ends; how many bytes it holds.
fn fill(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
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
