//! JSONL loaders for GSM8K-format (`question` / `answer`, the final answer after `#### `) and MATH-style
//! (`problem` / `solution`, the final answer in the last `\boxed{...}`) data sets.
//!
//! Blank lines are ignored. A malformed line (not JSON, a missing or non-string field, no final answer, not
//! UTF-8) is an error that names the file and the 1-based line number, or is skipped with a warning under
//! [`OnBadLine::Skip`]. A file without a single usable record is an error.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::verify::last_boxed;

/// What to do with a malformed line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBadLine {
    /// Fail with the file and line number (the default).
    #[default]
    Error,
    /// Skip the line (logged as a warning).
    Skip,
}

/// One problem of a data set.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The question (GSM8K `question`, MATH `problem`).
    pub question: String,
    /// The worked solution as stored (GSM8K `answer`, MATH `solution`).
    pub solution: String,
    /// The final answer (after `####`, or the content of the last `\boxed{}`), trimmed.
    pub answer: String,
    /// 1-based line number in the file.
    pub line: usize,
}

/// Errors of the loaders; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {msg}")]
    BadLine {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    #[error("{path}: no usable records")]
    Empty { path: PathBuf },
}

/// The final answer of a GSM8K `answer` field: the rest of the line after the last `####`, trimmed.
pub fn gsm8k_final_answer(answer: &str) -> Option<&str> {
    let pos = answer.rfind("####")?;
    let rest = answer[pos + 4..].trim_start_matches('#');
    let line = rest.split('\n').next().unwrap_or("").trim();
    (!line.is_empty()).then_some(line)
}

/// Removes GSM8K calculator annotations `<<48/2=24>>`.
pub fn strip_calculator_annotations(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("<<") {
        match rest[start + 2..].find(">>") {
            Some(len) => {
                out.push_str(&rest[..start]);
                rest = &rest[start + 2 + len + 2..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out
}

fn string_field(obj: &serde_json::Value, key: &str) -> Result<String, String> {
    match obj.get(key) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(format!("field `{key}` is not a string")),
        None => Err(format!("missing field `{key}`")),
    }
}

fn parse_object(line: &str) -> Result<serde_json::Value, String> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    if !v.is_object() {
        return Err("not a JSON object".into());
    }
    Ok(v)
}

/// Parses one GSM8K line (`{"question": ..., "answer": "... #### 18"}`).
pub fn parse_gsm8k_line(line: &str) -> Result<Record, String> {
    let v = parse_object(line)?;
    let question = string_field(&v, "question")?;
    let solution = string_field(&v, "answer")?;
    let answer = gsm8k_final_answer(&solution)
        .ok_or("field `answer` has no final answer after `####`")?
        .to_string();
    Ok(Record {
        question,
        solution,
        answer,
        line: 0,
    })
}

/// Parses one MATH-style line (`{"problem": ..., "solution": "... \boxed{42} ..."}`). When the solution has no
/// `\boxed{}`, a string `answer` field is used if present.
pub fn parse_math_line(line: &str) -> Result<Record, String> {
    let v = parse_object(line)?;
    let question = string_field(&v, "problem")?;
    let solution = string_field(&v, "solution")?;
    let answer =
        match last_boxed(&solution)
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            Some(a) => a.to_string(),
            None => match v.get("answer") {
                Some(serde_json::Value::String(a)) if !a.trim().is_empty() => a.trim().to_string(),
                _ => return Err(
                    "field `solution` has no well-formed `\\boxed{...}` (and no `answer` field)"
                        .into(),
                ),
            },
        };
    Ok(Record {
        question,
        solution,
        answer,
        line: 0,
    })
}

/// Loads a GSM8K-format JSONL file.
pub fn load_gsm8k(path: impl AsRef<Path>, on_bad: OnBadLine) -> Result<Vec<Record>, DatasetError> {
    load_jsonl(path.as_ref(), on_bad, parse_gsm8k_line)
}

/// Loads a MATH-style JSONL file.
pub fn load_math(path: impl AsRef<Path>, on_bad: OnBadLine) -> Result<Vec<Record>, DatasetError> {
    load_jsonl(path.as_ref(), on_bad, parse_math_line)
}

fn load_jsonl(
    path: &Path,
    on_bad: OnBadLine,
    parse: fn(&str) -> Result<Record, String>,
) -> Result<Vec<Record>, DatasetError> {
    let bytes = std::fs::read(path).map_err(|source| DatasetError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        let parsed = match std::str::from_utf8(raw) {
            Err(e) => Err(format!("not valid UTF-8: {e}")),
            Ok(s) if s.trim().is_empty() => continue,
            Ok(s) => parse(s.trim_end_matches('\r')),
        };
        match parsed {
            Ok(mut r) => {
                r.line = line_no;
                out.push(r);
            }
            Err(msg) => match on_bad {
                OnBadLine::Error => {
                    return Err(DatasetError::BadLine {
                        path: path.to_path_buf(),
                        line: line_no,
                        msg,
                    })
                }
                OnBadLine::Skip => {
                    tracing::warn!("{}:{line_no}: skipped: {msg}", path.display());
                }
            },
        }
    }
    if out.is_empty() {
        return Err(DatasetError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}
