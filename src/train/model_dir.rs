//! Where a run's model directory comes from: assembled in a staging folder of its own beside `model.dir`
//! (random weights from `model.init_config`, or the files of `model.base`, then the warm start) and moved
//! into place when complete, so that `model.dir` never holds half a model and nothing of the user's is
//! removed on the way.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::tensor::Device;

use super::config::TrainConfig;
use super::metrics::MetricsLog;
use super::{lock, sft};
use crate::model::{Decoder, EndTokens, ModelConfig, Tokenizer};
use crate::tasks::Template;

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

/// What makes a run's model when its `model.dir` does not exist yet, by what the warm start reads: the
/// model table but its path, its sources by their contents (`model.base` by its config and weight files'
/// names and sizes, `model.init_config` by its JSON; the path where they do not read), `[sft]` but
/// `log_every`, and, with `[sft]`, the examples it trains on ([`training_side`]). Not the seed: seeds share a
/// warm start, made with the first one's. Paths and evaluation settings are left out, so a moved folder or a
/// second test set is the same recipe.
pub(super) fn warm_start_of(cfg: &TrainConfig) -> anyhow::Result<serde_json::Value> {
    let mut model = serde_json::to_value(&cfg.model)?;
    if let Some(m) = model.as_object_mut() {
        m.remove("dir");
        if let Some(base) = &cfg.model.base {
            m.insert("base".into(), base_identity(base));
        }
        if let Some(init) = &cfg.model.init_config {
            let content = crate::io::read_json::<serde_json::Value>(init)
                .unwrap_or_else(|_| init.display().to_string().into());
            m.insert("init_config".into(), content);
        }
    }
    let mut sft = serde_json::to_value(&cfg.sft)?;
    if let Some(s) = sft.as_object_mut() {
        s.remove("log_every");
    }
    let task = match &cfg.sft {
        Some(_) => training_side(cfg)?,
        None => serde_json::Value::Null,
    };
    Ok(serde_json::json!({"model": model, "sft": sft, "task": task}))
}

/// A pretrained base by its contents, cheaply: its config.json and the names and sizes of its weight
/// files (the path where they do not read).
fn base_identity(base: &Path) -> serde_json::Value {
    let config = crate::io::read_json::<serde_json::Value>(&base.join("config.json")).ok();
    let mut weights: Vec<(String, u64)> = std::fs::read_dir(base)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let size = e.metadata().ok()?.len();
            name.ends_with(".safetensors").then_some((name, size))
        })
        .collect();
    weights.sort();
    match config {
        Some(config) => serde_json::json!({"config": config, "weights": weights}),
        None => base.display().to_string().into(),
    }
}

/// What of the task a warm start trains on: a data set's training examples by their fingerprint (the
/// held-out file and fraction only where they change them), or the generator's settings (arithmetic); the
/// task table where it does not load here.
fn training_side(cfg: &TrainConfig) -> anyhow::Result<serde_json::Value> {
    let table = serde_json::to_value(cfg.task.with_defaults())?;
    Ok(match crate::tasks::Task::from_config(&cfg.task) {
        Ok(task) => match task.training_fingerprint() {
            Some(examples) => serde_json::json!({"training_examples": examples}),
            None => table,
        },
        Err(_) => table,
    })
}

/// The file a model directory made by a run holds: how it was made (`warm_start_of`, the recipe, and the seed), so
/// that a later run that finds the folder and would make it otherwise is refused instead of training on it
/// while its config and report credit its own settings.
pub const MADE_BY_FILE: &str = "qarl_made_by.json";

/// Whether `cfg.model.dir` records that this config's warm start made it ([`MADE_BY_FILE`]: the same
/// recipe and seed).
pub(super) fn made_by_this_config(cfg: &TrainConfig) -> bool {
    let Ok(made_by) = crate::io::read_json::<serde_json::Value>(&cfg.model.dir.join(MADE_BY_FILE))
    else {
        return false;
    };
    made_by["seed"] == serde_json::json!(cfg.seed)
        && recipe_changes(&made_by, cfg).is_ok_and(|differ| differ.is_empty())
}

/// The keys where the recipe a [`MADE_BY_FILE`] record (`made_by`) holds differs from `cfg`'s warm start.
fn recipe_changes(made_by: &serde_json::Value, cfg: &TrainConfig) -> anyhow::Result<Vec<String>> {
    Ok(super::config::differing_keys(
        &made_by["recipe"],
        &warm_start_of(cfg)?,
    ))
}

/// Records in `staging` how `cfg` makes its model ([`MADE_BY_FILE`]).
pub(super) fn write_made_by(cfg: &TrainConfig, staging: &Path) -> anyhow::Result<()> {
    let made_by = serde_json::json!({"recipe": warm_start_of(cfg)?, "seed": cfg.seed});
    crate::io::write_json_atomic(&staging.join(MADE_BY_FILE), &made_by)
}

/// A `model.dir` that exists, for a config that says how to make it (`[sft]`, `model.base` or
/// `model.init_config`): refused where the folder records another recipe (another `[sft]`, base, task),
/// whose weights would be credited to this config's settings. A folder without the record (the user's own
/// model, or one made before it was kept) is used as it is, with a warning (`warn`) naming the keys that
/// then do not run.
fn check_made_as_configured(cfg: &TrainConfig, warn: bool) -> anyhow::Result<()> {
    let dir = &cfg.model.dir;
    let recipe = recipe_keys(cfg);
    let record = dir.join(MADE_BY_FILE);
    if !recipe.is_empty() && record.is_file() {
        let made_by: serde_json::Value = crate::io::read_json(&record)?;
        let differ = recipe_changes(&made_by, cfg)?;
        anyhow::ensure!(
            differ.is_empty(),
            "`model.dir` {}: made by another warm start than this config's (`{}` differ, {}): its weights \
             would be trained on and credited to this config's settings; remove the folder to make it \
             again, or set `model.dir` to a new folder",
            dir.display(),
            differ.join("`, `"),
            record.display()
        );
        return Ok(());
    }
    // A changed `[sft]` section or init would otherwise seem to be taken (the run's config.json records
    // them): said whatever `quiet` says (it silences progress, not what the run does).
    if warn && !recipe.is_empty() {
        tracing::warn!(
            "model: {} exists and records no warm start ({MADE_BY_FILE}), so {} do not run: its weights \
             are used as they are (remove the folder to make the model with this config's recipe, or \
             remove those keys)",
            dir.display(),
            recipe.join(", ")
        );
    }
    Ok(())
}

/// The keys of `cfg` that say how to make `model.dir` (none: the config takes the folder as given).
fn recipe_keys(cfg: &TrainConfig) -> Vec<&'static str> {
    let init = cfg.model.init_config.is_some();
    [
        (init, "`model.init_config`"),
        (init, "`model.init_std`"),
        (cfg.model.base.is_some(), "`model.base`"),
        (cfg.sft.is_some(), "`[sft]`"),
    ]
    .into_iter()
    .filter_map(|(set, key)| set.then_some(key))
    .collect()
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

/// The lock that makes one run at a time assemble the model of a `model.dir`, in its own folder beside it
/// (`<dir>.qarl-init.lock`). Dropping it releases the lock and removes the folder, whether the warm start
/// finished or failed (the folder holds nothing but the lock; another run that took it since keeps it).
struct StagingGuard {
    lock: Option<lock::RunLock>,
    folder: PathBuf,
}

impl StagingGuard {
    fn acquire(dir: &Path) -> anyhow::Result<Self> {
        let mut name = dir.file_name().unwrap_or(dir.as_os_str()).to_os_string();
        name.push(".qarl-init.lock");
        let folder = dir.with_file_name(name);
        let lock = lock::RunLock::acquire(&folder).map_err(|e| {
            // Only a lock another process holds means another warm start; a folder that cannot be
            // written is said as it is.
            if e.root_cause().is::<lock::InUse>() {
                e.context(format!(
                    "{}: another run is making this model (its warm start); wait for it, then start this \
                     one",
                    dir.display()
                ))
            } else {
                e.context(format!("{}: cannot lock its staging folder", dir.display()))
            }
        })?;
        Ok(Self {
            lock: Some(lock),
            folder,
        })
    }
}

impl Drop for StagingGuard {
    fn drop(&mut self) {
        drop(self.lock.take());
        // Empty once the lock is gone, unless another run has taken it since: then not removed.
        let _ = std::fs::remove_dir(&self.folder);
    }
}

/// A model made from `model.init_config` (its config `config`) is paired with the character tokenizer: its
/// vocabulary must hold the tokenizer's ids.
fn check_fits_char_tokenizer(init: &Path, config: &ModelConfig) -> anyhow::Result<()> {
    let vocab = config.vocab_size;
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
    crate::io::sync_dir(crate::io::folder_of(dir));
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

/// The config of the model a run starts from, read strictly before anything in the run directory changes:
/// `model.dir`'s when it holds a model (which must be a full-precision one), else the one it will be made
/// from (`model.base`, or `model.init_config` with the character tokenizer; `model.dir` must then be free
/// for it). A missing or unreadable source is refused here, naming its key, rather than after an
/// `--overwrite` has removed the run's earlier results.
pub(super) fn check_sources(
    cfg: &TrainConfig,
    model_made: bool,
    resume: bool,
) -> anyhow::Result<ModelConfig> {
    if !model_made {
        return source_of(cfg).map(|(_, config)| config);
    }
    let config = read_config("model.dir", &cfg.model.dir)?;
    // A resume continues from its checkpoint; the model it started from is checked by its fingerprint.
    if !resume {
        check_made_as_configured(cfg, true)?;
    }
    if let Some(q) = &config.quantization {
        return Err(crate::model::LoadError::QuantizedCheckpoint {
            dir: cfg.model.dir.clone(),
            scheme: q.scheme.name().to_string(),
        }
        .into());
    }
    Ok(config)
}

/// What a `model.dir` that holds no model yet is made from.
enum Source<'a> {
    /// The pretrained `model.base`.
    Base(&'a Path),
    /// Random weights of `model.init_config`, with the character tokenizer.
    Init(&'a Path),
}

/// The source of a `model.dir` that holds no model yet, and its config, read strictly; `model.dir` must be
/// free for the model ([`check_free`]). The one place that chooses between `model.base` and
/// `model.init_config`: the check before a run and the warm start that makes the model.
fn source_of(cfg: &TrainConfig) -> anyhow::Result<(Source<'_>, ModelConfig)> {
    check_free(&cfg.model.dir)?;
    match (&cfg.model.base, &cfg.model.init_config) {
        (Some(base), _) => Ok((Source::Base(base), read_config("model.base", base)?)),
        (None, Some(init)) => {
            let config = read_config("model.init_config", init)?;
            check_fits_char_tokenizer(init, &config)?;
            Ok((Source::Init(init), config))
        }
        (None, None) => anyhow::bail!(
            "{}: no model there and neither `model.init_config` nor `model.base` to create one from",
            cfg.model.dir.display()
        ),
    }
}

/// The model config at `path` (a folder or a config.json), an error naming the config key `key` (the
/// reader's own error names the file).
fn read_config(key: &str, path: &Path) -> anyhow::Result<ModelConfig> {
    ModelConfig::from_file(path).with_context(|| format!("`{key}`"))
}

/// Makes sure `cfg.model.dir` holds a model: created from `init_config` with random weights and the task's
/// character tokenizer, or from the pretrained `base`, then warm-started with `[sft]`, when it does not
/// exist yet. Locks the run directory
/// while it works; a warm start that was stopped continues from its newest checkpoint.
pub fn prepare_model(
    cfg: &TrainConfig,
    device: &Device,
    log: &mut MetricsLog,
    quiet: bool,
) -> anyhow::Result<()> {
    let _lock = lock::RunLock::acquire(&cfg.run_dir)?;
    prepare_model_locked(cfg, device, log, quiet, true, false)
}

/// [`prepare_model`] in a run directory this process has locked; with `resume`, the warm start continues
/// from its newest checkpoint (otherwise its checkpoints are removed and it starts over). `recipe_checked`:
/// the caller has checked an existing `model.dir` against the config's recipe already, or resumes a run
/// (whose starting model its fingerprint checks).
pub(super) fn prepare_model_locked(
    cfg: &TrainConfig,
    device: &Device,
    log: &mut MetricsLog,
    quiet: bool,
    resume: bool,
    recipe_checked: bool,
) -> anyhow::Result<()> {
    let dir = &cfg.model.dir;
    let sft_root = sft::checkpoints_root(&cfg.run_dir);
    if dir.join("config.json").is_file() {
        // The resume points of a warm start that finished (a kill can come between the two steps).
        if sft_root.exists() {
            std::fs::remove_dir_all(&sft_root)
                .with_context(|| format!("{}: cannot remove", sft_root.display()))?;
        }
        if recipe_checked {
            return Ok(());
        }
        return check_made_as_configured(cfg, true);
    }
    let (source, _) = source_of(cfg)?;
    // Runs that share a `model.dir` not made yet (runs whose configs differ in `run_dir` alone) would
    // each remove the other's staging folder: the second is refused while the first warm-starts.
    let _guard = StagingGuard::acquire(dir)?;
    // Made by another run between the first look and the lock: used as it is.
    if dir.join("config.json").is_file() {
        return check_made_as_configured(cfg, true);
    }
    let staging = fresh_staging(dir)?;
    // Where the starting weights are read from: the pretrained base, or the staged random checkpoint.
    let weights_dir = match source {
        Source::Base(base) => {
            stage_base_files(base, &staging)?;
            base.to_path_buf()
        }
        Source::Init(init) => {
            crate::model::init::write_random_checkpoint(
                init,
                &staging,
                cfg.seed,
                cfg.model.init_std,
            )?;
            crate::tasks::char_tokenizer::save(&staging)?;
            staging.clone()
        }
    };
    if let Some(sft) = &cfg.sft {
        let model = Decoder::load_full_precision(&weights_dir, device)?;
        // The files the user gave: the base's, or (random weights) the model folder to be; the staging
        // folder is the warm start's own.
        let named = cfg.model.base.as_deref().unwrap_or(dir);
        let tok = Tokenizer::load_for(&staging, &model.config)?.with_context(|| {
            format!(
                "{}: `model.base` has no tokenizer.json; the warm start trains on the task's text and needs one",
                named.display()
            )
        })?;
        check_chat_tokens(cfg, &tok, named)?;
        let eos = EndTokens::of(&tok, &model.config)?.primary();
        let json: serde_json::Value = crate::io::read_json(&weights_dir.join("config.json"))?;
        let ck = sft::SftCheckpoints {
            root: sft_root.clone(),
            every: cfg.checkpoint_every,
            resume,
            config_json: &json,
            tok_dir: &staging,
        };
        let (model, loss) = sft::run_sft_with(model, &tok, eos, cfg, sft, log, quiet, Some(&ck))?;
        tracing::info!(loss, "sft finished");
        crate::model::save::save_pretrained(&model, &json, &staging)?;
    }
    write_made_by(cfg, &staging)?;
    move_into_place(&staging, dir)?;
    if sft_root.exists() {
        std::fs::remove_dir_all(&sft_root)
            .with_context(|| format!("{}: cannot remove", sft_root.display()))?;
    }
    Ok(())
}

/// The task's chat template against the model: with its own `model_dir`, the template is that model's
/// own, whatever it is. Without one, the prompts are ChatML: where the model in `model_dir` declares a
/// template, ChatML must render what it renders (a system turn given, say, for SmolLM2's), or the prompts
/// would not be the model's; where it declares none, its tokenizer must have ChatML's tokens
/// ([`Tokenizer::check_chatml`]).
pub(super) fn check_chat_tokens(
    cfg: &TrainConfig,
    tok: &Tokenizer,
    model_dir: &Path,
) -> anyhow::Result<()> {
    let Some(chat) = cfg.task.chat_template() else {
        return Ok(());
    };
    if chat.model_dir.is_some() {
        return Ok(());
    }
    let Some(own) = crate::tasks::template::ModelChatTemplate::of_model(model_dir)? else {
        return tok.check_chatml(model_dir);
    };
    let path = own.path.clone();
    let with = |model| Template::Chat {
        system: chat.system.clone(),
        model,
        enable_thinking: None,
    };
    let probe = "What is 2 + 3?";
    anyhow::ensure!(
        with(None).render_prompt(probe)? == with(Some(own)).render_prompt(probe)?,
        "{}: the model's chat template renders other prompts than ChatML, which `task.template` without \
         `model_dir` stands for; set `task.template.model_dir` to the model's folder to prompt with its own \
         template",
        path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task's `{ kind = "chat" }` without `model_dir` prompts with ChatML: taken for a model whose own
    /// template renders the same prompts (SmolLM2's, given a system turn), refused where it would not
    /// (SmolLM2's without one writes its default system turn).
    #[test]
    fn chatml_stands_in_only_for_a_template_that_renders_it() {
        let model = tempfile::tempdir().unwrap();
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates");
        std::fs::copy(
            fixtures.join("smollm2.jinja"),
            model.path().join("chat_template.jinja"),
        )
        .unwrap();
        let tok = Tokenizer::from_json_text(
            r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
                "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}}"#,
        );
        let mut cfg =
            TrainConfig::from_toml(super::super::config::DEFAULT_CONFIG, "default").unwrap();
        let task = |template: serde_json::Value| {
            serde_json::from_value(serde_json::json!({
                "kind": "gsm8k", "path": "data.jsonl", "template": template
            }))
            .unwrap()
        };
        cfg.task = task(serde_json::json!({"kind": "chat", "system": "Be brief."}));
        check_chat_tokens(&cfg, &tok, model.path()).unwrap();
        cfg.task = task(serde_json::json!({"kind": "chat"}));
        let err = check_chat_tokens(&cfg, &tok, model.path())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("chat_template.jinja") && err.contains("set `task.template.model_dir`"),
            "{err}"
        );
        // With the model's folder named, its own template is used, whatever it renders.
        cfg.task = task(serde_json::json!({"kind": "chat", "model_dir": model.path()}));
        check_chat_tokens(&cfg, &tok, model.path()).unwrap();
    }
}
