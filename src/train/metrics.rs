//! Metrics as JSON lines, one object per step, flushed as they are written so a crash loses nothing that
//! was already logged.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;

pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
}

impl MetricsLog {
    /// Opens `path` for appending (created if absent).
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn write(&mut self, value: &serde_json::Value) -> anyhow::Result<()> {
        let line = serde_json::to_string(value)?;
        writeln!(self.file, "{line}")
            .with_context(|| format!("{}: cannot write", self.path.display()))?;
        self.file.flush()?;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Keeps only the lines of `phase` whose `step` is at most `last_step` (for a resumed run), and every line of
/// other phases, written back atomically.
pub fn truncate_after(path: &Path, phase: &str, last_step: usize) -> anyhow::Result<()> {
    retain_rows(path, |v| {
        v["phase"].as_str() != Some(phase)
            || v["step"].as_u64().is_some_and(|s| s as usize <= last_step)
    })
}

/// Keeps only the lines of a metrics file whose row `keep` accepts, written back atomically (nothing to do
/// when the file does not exist).
pub fn retain_rows(path: &Path, keep: impl Fn(&serde_json::Value) -> bool) -> anyhow::Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| keep(&serde_json::from_str(l).unwrap_or_default()))
        .collect();
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    for l in kept {
        writeln!(tmp, "{l}")?;
    }
    tmp.as_file().sync_all()?;
    tmp.persist(path)?;
    Ok(())
}
