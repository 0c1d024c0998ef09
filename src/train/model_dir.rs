//! Where a run's model directory comes from: assembled in a staging folder of its own beside `model.dir`
//! (random weights from `model.init_config`, or the files of `model.base`, then the warm start) and moved
//! into place when complete, so that `model.dir` never holds half a model and nothing of the user's is
//! removed on the way.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Refuses a `model.dir` that exists without being a model (a file, or a folder of other things) before
/// any work: the finished model is moved into its place at the end, which would then fail, or take what
/// is there for a model.
pub(super) fn check_free(dir: &Path) -> anyhow::Result<()> {
    let what = match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot examine", dir.display())),
        // The finished model is renamed onto `model.dir`, which cannot replace a link.
        Ok(m) if m.file_type().is_symlink() => {
            "a link (give the folder it points to, or a path that does not exist yet)"
        }
        Ok(m) if !m.is_dir() => "not a folder",
        Ok(_) => {
            let mut entries =
                std::fs::read_dir(dir).map_err(crate::io::failed(dir, "cannot read"))?;
            if entries.next().is_none() {
                return Ok(());
            }
            "a folder without a config.json"
        }
    };
    anyhow::bail!(
        "`model.dir` {}: {what}; it must be a model directory, or not exist yet (to be created there)",
        dir.display()
    )
}

/// Marks a staging folder as this program's, so that a leftover one is removed only when it is ours.
const STAGING_MARK: &str = ".qarl-staging";

/// An empty folder beside `dir` (`<dir>.qarl-init`) where the new model is assembled before it is moved into
/// place; a leftover from a stopped attempt is removed first, but only one that carries [`STAGING_MARK`]:
/// anything else there is the user's, and is refused rather than deleted.
pub(super) fn fresh_staging(dir: &Path) -> anyhow::Result<PathBuf> {
    let mut name = dir.file_name().unwrap_or(dir.as_os_str()).to_os_string();
    name.push(".qarl-init");
    let staging = dir.with_file_name(name);
    if staging.join(STAGING_MARK).is_file() {
        std::fs::remove_dir_all(&staging).with_context(|| {
            format!(
                "{}: cannot remove the old staging folder",
                staging.display()
            )
        })?;
    } else if staging.exists() {
        anyhow::bail!(
            "{}: exists and is not a staging folder of qarl's (no {STAGING_MARK} in it); move it, or \
             choose another `model.dir`",
            staging.display()
        );
    }
    std::fs::create_dir_all(&staging)
        .with_context(|| format!("{}: cannot create", staging.display()))?;
    std::fs::write(staging.join(STAGING_MARK), b"")
        .with_context(|| format!("{}: cannot write", staging.join(STAGING_MARK).display()))?;
    Ok(staging)
}

/// A model made from `model.init_config` is paired with the character tokenizer: its vocabulary must hold
/// the tokenizer's ids.
pub(super) fn check_fits_char_tokenizer(init: &Path) -> anyhow::Result<()> {
    let vocab = crate::model::ModelConfig::from_file(init)?.vocab_size;
    let chars = crate::tasks::char_tokenizer::VOCAB_SIZE;
    anyhow::ensure!(
        vocab >= chars,
        "`model.init_config` {}: vocab_size {vocab} is smaller than the character tokenizer's {chars} ids \
         that a model made from it uses (set vocab_size >= {chars})",
        init.display()
    );
    Ok(())
}

/// Moves the finished staging folder onto `dir` (absent or empty, [`check_free`]), then drops its mark: a
/// rename that fails leaves the staging folder marked as qarl's, for the next attempt to remove.
pub(super) fn move_into_place(staging: &Path, dir: &Path) -> anyhow::Result<()> {
    std::fs::rename(staging, dir)
        .with_context(|| format!("{}: cannot move the model into place", dir.display()))?;
    let mark = dir.join(STAGING_MARK);
    std::fs::remove_file(&mark).with_context(|| format!("{}: cannot remove", mark.display()))
}

/// Copies the files of the pretrained `base` that are not its weights (tokenizer, chat template, generation
/// config) into `staging`; the fine-tuned weights and `config.json` are written there after the warm start.
pub(super) fn stage_base_files(base: &Path, staging: &Path) -> anyhow::Result<()> {
    let is_weights = |name: &str| {
        name == "config.json"
            || [
                ".safetensors",
                ".safetensors.index.json",
                ".bin",
                ".gguf",
                ".pt",
                ".pth",
            ]
            .iter()
            .any(|ext| name.ends_with(ext))
    };
    let entries = std::fs::read_dir(base)
        .with_context(|| format!("{}: cannot read `model.base`", base.display()))?;
    std::fs::create_dir_all(staging)
        .with_context(|| format!("{}: cannot create", staging.display()))?;
    for entry in entries {
        let entry = entry.map_err(crate::io::failed(base, "cannot read"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !entry.path().is_file() || is_weights(&name) {
            continue;
        }
        std::fs::copy(entry.path(), staging.join(&name)).with_context(|| {
            format!(
                "{}: cannot copy into {}",
                entry.path().display(),
                staging.display()
            )
        })?;
    }
    Ok(())
}
