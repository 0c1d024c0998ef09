//! Metrics as JSON lines, one object per step, flushed as they are written so a crash loses nothing that
//! was already logged.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The file of a run directory beside `metrics.jsonl` where each RL step's worst response (the kept
/// response with the highest fraction of error tokens) is written, one JSON row per step with error tokens
/// (`phase`, `step`, then the example: docs/metrics.md, "Error tokens").
pub const WORST_RESPONSES_FILE: &str = "worst_responses.jsonl";

pub struct MetricsLog {
    path: PathBuf,
    /// `None` until the first row when the file did not exist: a command that stops before logging anything
    /// (a refused run) leaves no empty file behind.
    file: Option<std::fs::File>,
}

impl MetricsLog {
    /// Opens `path` for appending (created with the first row if absent).
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("{}: cannot create the directory", dir.display()))?;
        }
        let file = if path.exists() {
            Some(Self::open_file(path)?)
        } else {
            None
        };
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    fn open_file(path: &Path) -> anyhow::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("{}: cannot open", path.display()))
    }

    pub fn write(&mut self, value: &serde_json::Value) -> anyhow::Result<()> {
        // No row computed after a device failure.
        crate::device_failures::check()
            .with_context(|| format!("{}: not written", self.path.display()))?;
        let line = serde_json::to_string(value)?;
        if self.file.is_none() {
            self.file = Some(Self::open_file(&self.path)?);
        }
        if let Some(file) = self.file.as_mut() {
            writeln!(file, "{line}")
                .and_then(|()| file.flush())
                .with_context(|| format!("{}: cannot write", self.path.display()))?;
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Puts the rows written so far on the disk (`fsync`), before a checkpoint that depends on them is
    /// written: rows are only flushed as they are written, so after a power loss the checkpoint could
    /// otherwise be on the disk without the rows of its steps (a log the resume then refuses).
    pub fn sync(&self) -> anyhow::Result<()> {
        match &self.file {
            Some(file) => file
                .sync_data()
                .with_context(|| format!("{}: cannot sync", self.path.display())),
            None => Ok(()),
        }
    }

    /// Keeps only the rows `keep` accepts (see [`retain_rows`]) and goes on appending to the rewritten file
    /// (the rewrite replaces the file, so the old handle would write into the replaced one).
    pub fn retain(&mut self, keep: impl Fn(&serde_json::Value) -> bool) -> anyhow::Result<()> {
        retain_rows(&self.path, keep)?;
        *self = Self::open(&self.path)?;
        Ok(())
    }
}

/// What a reader of a metrics log does with a line that is not a row (a JSON object).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadLines {
    /// Only the last line may be one (the row a kill cut short, or the one being written): it is left out.
    /// Any other is an error naming the file and the line, since leaving out a row from the middle of a
    /// log would change what is computed from it without a word (reports, comparisons, plots).
    TornLastOnly,
    /// Every such line is left out: listing runs, where one damaged log must not hide the others.
    Skip,
}

/// The lines of a metrics log: 1-based line number, the text, and the row when the line is one (a JSON
/// object). Blank lines are not listed.
fn parse_lines(text: &str) -> impl Iterator<Item = (usize, &str, Option<serde_json::Value>)> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let row = serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .filter(serde_json::Value::is_object);
            (i + 1, l, row)
        })
}

/// The verifier version an evaluation row records ([`crate::rl::metrics::names::EVAL_VERIFIER_VERSION`]),
/// [`crate::tasks::verify::UNRECORDED_VERIFIER_VERSION`] for a row written before it was recorded.
pub fn verifier_version_of(row: &serde_json::Value) -> u32 {
    row[crate::rl::metrics::names::EVAL_VERIFIER_VERSION]
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or(crate::tasks::verify::UNRECORDED_VERIFIER_VERSION)
}

/// Whether a line that is not a row can be one a killed writer cut short: a row's beginning, `{`. Text
/// that is not (a `garbage` line, a JSON list) is damage wherever it stands.
fn cut_short(line: &str) -> bool {
    line.trim_start().starts_with('{')
}

/// The rows of the metrics log at `path`, in order; lines that are not rows as `bad` says. The one home
/// for reading a log back (the report, `qarl compare`, the plots and `qarl runs`).
pub fn read_rows(path: &Path, bad: BadLines) -> anyhow::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).map_err(crate::io::failed(path, "cannot read"))?;
    let lines: Vec<_> = parse_lines(&text).collect();
    let last = lines.last().map(|(n, _, _)| *n);
    let mut rows = Vec::with_capacity(lines.len());
    // (phase, step) -> line: a log holds one row per phase and step (a resume drops the rows it redoes).
    let mut seen = std::collections::HashMap::new();
    // phase -> (its newest step so far, the line).
    let mut newest = std::collections::HashMap::new();
    for (n, line, row) in lines {
        match row {
            Some(row) if bad == BadLines::TornLastOnly => {
                let (phase, step) = row_position(&row)
                    .map_err(|what| anyhow::anyhow!("{}: line {n}: {what}", path.display()))?;
                if let Some(first) = seen.insert((phase.to_string(), step), n) {
                    anyhow::bail!(
                        "{}: line {n} is a second `{phase}` row for step {step} (the first is line {first}): a \
                         log holds one row per phase and step, and which one counts would be a guess",
                        path.display()
                    );
                }
                // A run writes each phase's rows in step order (a resume drops the rows it redoes before
                // it writes them again): rows out of order were moved or merged, and every reader that
                // takes "the first" or "the last" evaluation would take the wrong one.
                match newest.insert(phase.to_string(), (step, n)) {
                    Some((before, line)) if before > step => anyhow::bail!(
                        "{}: line {n} is a `{phase}` row for step {step} after the one for step {before} \
                         (line {line}): a log's rows go forward in steps, and read in this order the first \
                         and last of them would be the wrong ones",
                        path.display()
                    ),
                    _ => {}
                }
                rows.push(row)
            }
            Some(row) => rows.push(row),
            // A log of only a `garbage` line read as "no steps logged yet".
            None if bad == BadLines::Skip || (Some(n) == last && cut_short(line)) => {}
            None => anyhow::bail!(
                "{}: line {n} is not a metrics row (a JSON object): {}",
                path.display(),
                line.chars().take(80).collect::<String>()
            ),
        }
    }
    Ok(rows)
}

/// A row's `phase` (a string) and `step` (a non-negative integer), or what is wrong with them.
fn row_position(row: &serde_json::Value) -> Result<(&str, u64), String> {
    let phase = row["phase"]
        .as_str()
        .ok_or_else(|| format!("`phase` is {}, not a phase name (a string)", row["phase"]))?;
    let step = row["step"].as_u64().ok_or_else(|| {
        format!(
            "`step` is {}, not a step number (a non-negative integer)",
            row["step"]
        )
    })?;
    Ok((phase, step))
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
/// when the file does not exist). A last line that is a row's beginning but no JSON object (the
/// half-written row of a killed run) is dropped with a warning naming it, so that the rows appended after it stay readable; such a line
/// anywhere else is damage, an error naming the file and the line ([`BadLines::TornLastOnly`]), since
/// dropping it would leave a gap that every later reader takes for a whole log.
pub fn retain_rows(path: &Path, keep: impl Fn(&serde_json::Value) -> bool) -> anyhow::Result<()> {
    // Only a log that is not there is nothing to do: one that cannot be read (a folder in its place, no
    // permission) was taken for an empty log, and a resume then said the log had lost its rows.
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(crate::io::failed(path, "cannot read")(e)),
    };
    let lines: Vec<_> = parse_lines(&text).collect();
    let last = lines.last().map(|(n, _, _)| *n);
    let mut kept: Vec<&str> = Vec::new();
    for (n, l, row) in lines {
        match row {
            Some(row) => {
                if keep(&row) {
                    kept.push(l);
                }
            }
            None if Some(n) == last && cut_short(l) => tracing::warn!(
                "{}:{n}: dropped a last line that is not a metrics row (a row cut short by a kill?)",
                path.display()
            ),
            None => anyhow::bail!(
                "{}: line {n} is not a metrics row (a JSON object), nor a row's beginning on the last line \
                 (a row cut short by a kill): the log is damaged; repair or remove the line to go on: {}",
                path.display(),
                l.chars().take(80).collect::<String>()
            ),
        }
    }
    let text: String = kept.iter().map(|l| format!("{l}\n")).collect();
    crate::io::write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resumed run drops the rows it redoes and the half-written row of a kill, and appends after them.
    #[test]
    fn truncating_drops_a_row_cut_short_by_a_kill() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"phase\":\"sft\",\"step\":0}\n{\"phase\":\"rl\",\"step\":0}\n{\"phase\":\"rl\",\"step\":1}\n{\"phase\":\"rl\",\"st",
        )
        .unwrap();
        truncate_after(&path, "rl", 0).unwrap();
        let mut log = MetricsLog::open(&path).unwrap();
        log.write(&serde_json::json!({"phase": "rl", "step": 1}))
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"phase\":\"sft\",\"step\":0}\n{\"phase\":\"rl\",\"step\":0}\n{\"phase\":\"rl\",\"step\":1}\n"
        );
        // A damaged line in the middle is not a kill's: refused, naming it, and the file is left as it was.
        let damaged = "{\"phase\":\"rl\",\"step\":0}\n{\"pha\n{\"phase\":\"rl\",\"step\":1}\n";
        std::fs::write(&path, damaged).unwrap();
        let err = truncate_after(&path, "rl", 0).unwrap_err().to_string();
        assert!(
            err.contains("metrics.jsonl: line 2 is not a metrics row"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), damaged);
        // A log not there is nothing to truncate; one that cannot be read (a folder) is named, not taken
        // for an empty log.
        truncate_after(&dir.path().join("absent.jsonl"), "rl", 0).unwrap();
        let folder = dir.path().join("folder.jsonl");
        std::fs::create_dir(&folder).unwrap();
        let err = truncate_after(&folder, "rl", 0).unwrap_err().to_string();
        assert!(err.contains("folder.jsonl: cannot read"), "{err}");
    }

    /// Reading back: a torn last line is left out under either policy; one in the middle is an error
    /// naming the file and the line unless lines are skipped; blank lines and a missing file as said.
    #[test]
    fn reading_back_leaves_out_only_what_the_policy_allows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"phase\":\"rl\",\"step\":0}\n\n{\"phase\":\"rl\",\"step\":1}\n{\"st",
        )
        .unwrap();
        for bad in [BadLines::TornLastOnly, BadLines::Skip] {
            let rows = read_rows(&path, bad).unwrap();
            assert_eq!(
                rows,
                [
                    serde_json::json!({"phase": "rl", "step": 0}),
                    serde_json::json!({"phase": "rl", "step": 1})
                ]
            );
        }
        // A last line that is no row's beginning is damage, not a torn write: named, also when it is the
        // log's only line (which read as a log of no steps).
        for text in ["garbage", "{\"phase\":\"rl\",\"step\":0}\n[1]"] {
            std::fs::write(&path, text).unwrap();
            let err = read_rows(&path, BadLines::TornLastOnly)
                .unwrap_err()
                .to_string();
            assert!(err.contains("is not a metrics row"), "{text}: {err}");
            let err = truncate_after(&path, "rl", 5).unwrap_err().to_string();
            assert!(err.contains("is not a metrics row"), "{text}: {err}");
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        }
        // A damaged line (and a line that is JSON but not an object) in the middle.
        std::fs::write(
            &path,
            "{\"phase\":\"rl\",\"step\":0}\n{\"st\n[1]\n{\"phase\":\"rl\",\"step\":2}\n",
        )
        .unwrap();
        let err = read_rows(&path, BadLines::TornLastOnly)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("metrics.jsonl: line 2 is not a metrics row"),
            "{err}"
        );
        let rows = read_rows(&path, BadLines::Skip).unwrap();
        assert_eq!(
            rows,
            [
                serde_json::json!({"phase": "rl", "step": 0}),
                serde_json::json!({"phase": "rl", "step": 2})
            ]
        );
        // Line numbers are the file's, blank lines counted.
        std::fs::write(
            &path,
            "{\"phase\":\"rl\",\"step\":0}\n\n\nnot json\n{\"phase\":\"rl\",\"step\":2}\n",
        )
        .unwrap();
        let err = read_rows(&path, BadLines::TornLastOnly)
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 4 is not a metrics row"), "{err}");
        let missing = read_rows(&dir.path().join("none.jsonl"), BadLines::Skip).unwrap_err();
        assert!(missing.to_string().contains("none.jsonl"), "{missing}");
    }

    /// A row read back for a report, a comparison or a plot has a phase and a step number, and no other row
    /// of its phase has that step: a second evaluation at one step (the report took the last, `qarl runs`
    /// the first) or a step of -1 or 0.5 is an error naming the file and the line.
    #[test]
    fn rows_are_one_per_phase_and_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        for (text, want) in [
            (
                "{\"phase\":\"eval\",\"step\":2}\n{\"phase\":\"rl\",\"step\":2}\n{\"phase\":\"eval\",\"step\":2}\n",
                "line 3 is a second `eval` row for step 2 (the first is line 1)",
            ),
            ("{\"phase\":\"rl\",\"step\":-1}\n", "line 1: `step` is -1, not a step number"),
            ("{\"phase\":\"rl\",\"step\":0.5}\n", "line 1: `step` is 0.5"),
            ("{\"phase\":7,\"step\":1}\n", "line 1: `phase` is 7, not a phase name"),
            ("{\"step\":1}\n", "line 1: `phase` is null"),
            // Rows out of order (moved or merged): "the first" and "the last" would be the wrong ones.
            (
                "{\"phase\":\"eval\",\"step\":2}\n{\"phase\":\"rl\",\"step\":0}\n{\"phase\":\"eval\",\"step\":0}\n",
                "line 3 is a `eval` row for step 0 after the one for step 2 (line 1)",
            ),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = read_rows(&path, BadLines::TornLastOnly)
                .unwrap_err()
                .to_string();
            assert!(err.contains("metrics.jsonl: ") && err.contains(want), "{err}");
            // Listing runs reads on (one damaged log must not hide the others).
            assert!(read_rows(&path, BadLines::Skip).is_ok());
        }
    }
}
