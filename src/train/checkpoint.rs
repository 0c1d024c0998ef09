//! RL checkpoints: model (HF format), optimizer state and trainer state, written into a temporary directory
//! that is renamed into place, so a crash never leaves a half-written checkpoint where a good one was.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::optim::ModuleOptimizer;
use serde::{Deserialize, Serialize};

use crate::model::save::save_pretrained;
use crate::model::Decoder;

/// What is needed to continue a run besides weights and optimizer moments.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    /// The last completed RL step.
    pub step: usize,
}

pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// Writes checkpoint `step` (replacing one of the same step).
pub fn save(
    run_dir: &Path,
    step: usize,
    model: &Decoder,
    config_json: &serde_json::Value,
    optim: &ModuleOptimizer,
    tok_dir: &Path,
) -> anyhow::Result<PathBuf> {
    let root = checkpoints_dir(run_dir);
    std::fs::create_dir_all(&root)?;
    let tmp = tempfile::Builder::new()
        .prefix(".tmp-ckpt")
        .tempdir_in(&root)?;
    save_pretrained(model, config_json, tmp.path())?;
    optim
        .save(tmp.path().join("optimizer.bpk"))
        .map_err(|e| anyhow::anyhow!("saving the optimizer state: {e:?}"))?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        if tok_dir.join(f).is_file() {
            std::fs::copy(tok_dir.join(f), tmp.path().join(f))?;
        }
    }
    crate::io::write_json_atomic(
        &tmp.path().join("trainer_state.json"),
        &TrainerState { step },
    )?;
    let dst = root.join(format!("step_{step:06}"));
    if dst.exists() {
        std::fs::remove_dir_all(&dst)?;
    }
    let kept = tmp.keep();
    std::fs::rename(&kept, &dst)
        .with_context(|| format!("{}: cannot move the checkpoint into place", dst.display()))?;
    Ok(dst)
}

/// The newest complete checkpoint of a run, if any.
pub fn latest(run_dir: &Path) -> Option<(PathBuf, TrainerState)> {
    let mut best: Option<(PathBuf, TrainerState)> = None;
    for e in std::fs::read_dir(checkpoints_dir(run_dir)).ok()?.flatten() {
        let p = e.path();
        let name = p.file_name()?.to_string_lossy().to_string();
        if !name.starts_with("step_") {
            continue;
        }
        let Ok(state) = crate::io::read_json::<TrainerState>(&p.join("trainer_state.json")) else {
            continue;
        };
        if best.as_ref().is_none_or(|(_, s)| state.step > s.step) {
            best = Some((p, state));
        }
    }
    best
}
