//! JSONL loaders for GSM8K-format (`question` / `answer`, the final answer after `#### `) and MATH-style
//! (`problem` / `solution`, the final answer in the last `\boxed{...}`) data sets.
//!
//! Blank lines are ignored. A malformed line (not JSON, a missing or non-string field, no final answer, a
//! GSM8K final answer that is not a number, not UTF-8) is an error that names the file and the 1-based line number, or is skipped with a warning under
//! [`OnBadLine::Skip`]. A file without a single usable record is an error.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::verify::last_box;

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

/// Errors of the loaders; each names the file. The underlying error is part of the message and not a
/// `source`, so that `{:#}` (anyhow's chain) does not print it twice.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{path}: cannot read the data set ({})", crate::io::os_error_text(io))]
    Io { path: PathBuf, io: std::io::Error },
    #[error("{path}:{line}: {error}")]
    BadLine {
        path: PathBuf,
        line: usize,
        error: LineError,
    },
    #[error("{path}: no usable records")]
    Empty { path: PathBuf },
    /// Which of two gold answers of one question is right would be a guess.
    #[error(
        "{path}:{line}: the question of line {first_line} again, with the gold answer {answer:?} where \
         line {first_line} has {first:?}: which is right is a guess (remove or correct one)"
    )]
    ConflictingGolds {
        path: PathBuf,
        first_line: usize,
        first: String,
        line: usize,
        answer: String,
    },
}

/// `records` with each question once, its first record, and how many repeats were left out: a held-out
/// problem listed twice weighed twice in an accuracy (`qarl eval` counted 200 problems where a run's
/// evaluation of the same file counted 193) and paired wrongly between evaluations. A repeat whose gold
/// answer differs is an error naming both lines (it was dropped without a word). Questions are the same
/// whatever their spacing (a trailing space made a repeat with another gold a second problem), and golds
/// the same where the verifier reads them as equal (`1,200` and `1200`).
pub fn unique_questions(
    records: Vec<Record>,
    path: &Path,
) -> Result<(Vec<Record>, usize), DatasetError> {
    let mut first: std::collections::HashMap<String, (usize, String)> = Default::default();
    let mut kept = Vec::with_capacity(records.len());
    let mut repeats = 0;
    for r in records {
        let key = r.question.split_whitespace().collect::<Vec<_>>().join(" ");
        match first.get(&key) {
            Some((first_line, gold)) if !super::verify::answers_equal(gold, &r.answer) => {
                return Err(DatasetError::ConflictingGolds {
                    path: path.to_path_buf(),
                    first_line: *first_line,
                    first: gold.clone(),
                    line: r.line,
                    answer: r.answer,
                })
            }
            Some(_) => repeats += 1,
            None => {
                first.insert(key, (r.line, r.answer.clone()));
                kept.push(r);
            }
        }
    }
    Ok((kept, repeats))
}

/// What is wrong with one line of a data set file; [`DatasetError::BadLine`] adds the file and line number.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error("not valid UTF-8: {0}")]
    NotUtf8(std::str::Utf8Error),
    #[error("not valid JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("not a JSON object")]
    NotObject,
    /// JSON readers keep one of the values of a repeated key (serde_json the last): which question or
    /// answer the record means is ambiguous.
    #[error("field `{0}` appears twice")]
    RepeatedField(String),
    #[error("missing field `{0}`")]
    MissingField(&'static str),
    #[error("field `{0}` is not a string")]
    NotString(&'static str),
    #[error("field `answer` is neither a string nor a number")]
    AnswerNotText,
    /// An empty question would be prompted as an empty user turn (a chat template's markers are never
    /// empty, so the prompt's own check would not see it).
    #[error("field `{0}` is empty")]
    EmptyField(&'static str),
    #[error("field `answer` has no final answer after `####`")]
    NoFinalAnswer,
    /// The gold answer is read after the last `####`, a response's after its first: a solution with two
    /// would teach (in the warm start) answers the verifier reads differently from the gold.
    #[error("field `answer` has {0} `####` markers: which one ends the solution is ambiguous (GSM8K has one)")]
    SeveralFinalAnswers(usize),
    /// The verifier compares a GSM8K answer as a number: a word there (`#### four`) would make every
    /// response wrong without a word.
    #[error("the final answer after `####` is `{0}`, not a number (GSM8K answers are numbers like `18`, `-3`, `1,200` or `2.5`)")]
    NotANumber(String),
    /// The verifier reads past words after a number as units (`1.5 million` is 1.5): every right answer to
    /// such a problem would be scored wrong without a word.
    #[error("the gold answer `{answer}` has the word `{word}`, which changes the number's value, but the verifier reads the number before it alone: write the number itself")]
    ValueWord { answer: String, word: String },
    #[error("field `solution` has no well-formed `\\boxed{{...}}` (and no `answer` field)")]
    NoBoxed,
    #[error("field `answer` is `{field}` but the solution's last `\\boxed{{}}` is `{boxed}`: which is the gold is ambiguous")]
    AnswersDisagree { boxed: String, field: String },
}

/// The final answer of a GSM8K `answer` field: the rest of the line after the last `####`, trimmed.
pub fn gsm8k_final_answer(answer: &str) -> Option<&str> {
    let pos = answer.rfind("####")?;
    let rest = answer[pos + 4..].trim_start_matches('#');
    let line = rest.split('\n').next().unwrap_or("").trim();
    (!line.is_empty()).then_some(line)
}

/// How many final-answer markers `text` holds: runs of four or more `#` (`#####` is one).
fn final_answer_markers(text: &str) -> usize {
    text.split(|c| c != '#')
        .filter(|run| run.len() >= 4)
        .count()
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

/// [`string_field`] that must hold more than whitespace.
fn text_field(obj: &serde_json::Value, key: &'static str) -> Result<String, LineError> {
    let s = string_field(obj, key)?;
    if s.trim().is_empty() {
        return Err(LineError::EmptyField(key));
    }
    Ok(s)
}

fn string_field(obj: &serde_json::Value, key: &'static str) -> Result<String, LineError> {
    match obj.get(key) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(LineError::NotString(key)),
        None => Err(LineError::MissingField(key)),
    }
}

fn parse_object(line: &str) -> Result<serde_json::Value, LineError> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(LineError::NotJson)?;
    if !v.is_object() {
        return Err(LineError::NotObject);
    }
    // The object again, as its keys were written (serde_json's map keeps one value per key).
    match crate::io::first_repeated_key(line.as_bytes()).map_err(LineError::NotJson)? {
        Some(key) => Err(LineError::RepeatedField(key)),
        None => Ok(v),
    }
}

/// Parses one GSM8K line (`{"question": ..., "answer": "... #### 18"}`); the final answer must be a number
/// the verifier reads ([`super::verify::parse_answer`]).
pub fn parse_gsm8k_line(line: &str) -> Result<Record, LineError> {
    let v = parse_object(line)?;
    let question = text_field(&v, "question")?;
    let solution = string_field(&v, "answer")?;
    let markers = final_answer_markers(&solution);
    if markers > 1 {
        return Err(LineError::SeveralFinalAnswers(markers));
    }
    let answer = gsm8k_final_answer(&solution)
        .ok_or(LineError::NoFinalAnswer)?
        .to_string();
    if super::verify::parse_answer(&answer).is_none() {
        let shown: String = answer.chars().take(40).collect();
        return Err(LineError::NotANumber(shown));
    }
    refuse_value_words(&answer)?;
    Ok(Record {
        question,
        solution,
        answer,
        line: 0,
    })
}

/// Parses one MATH-style line (`{"problem": ..., "solution": "... \boxed{42} ..."}`). When the solution has no
/// `\boxed{}`, an `answer` field (a string or a number) is used if present; where it has both, they must agree (MATH-500's
/// `answer` is its solution's box): which one is the gold would otherwise be a silent choice.
pub fn parse_math_line(line: &str) -> Result<Record, LineError> {
    let v = parse_object(line)?;
    let question = text_field(&v, "problem")?;
    // An empty solution would train the warm start to answer nothing.
    let solution = text_field(&v, "solution")?;
    // AIME-style files give integer answers as JSON numbers (`"answer": 42`): read as their text.
    let field = match v.get("answer") {
        Some(serde_json::Value::String(a)) => Some(a.trim().to_string()).filter(|a| !a.is_empty()),
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        Some(serde_json::Value::Null) | None => None,
        Some(_) => return Err(LineError::AnswerNotText),
    };
    let field = field.as_deref();
    let boxed = last_box(&solution).map(str::trim).filter(|s| !s.is_empty());
    let answer = match (boxed, field) {
        (Some(b), Some(a)) if !super::verify::answers_equal(b, a) => {
            return Err(LineError::AnswersDisagree {
                boxed: b.chars().take(40).collect(),
                field: a.chars().take(40).collect(),
            })
        }
        (Some(b), _) => b.to_string(),
        (None, Some(a)) => a.to_string(),
        (None, None) => return Err(LineError::NoBoxed),
    };
    Ok(Record {
        question,
        solution,
        answer,
        line: 0,
    })
}

/// A GSM8K gold answer must not carry a word that changes its value
/// ([`super::verify::value_changing_word`]): GSM8K's golds are plain numbers, so one is a slip in the data.
/// MATH's boxes are left as they are: they write answers as text (`\text{ million}`) that a response in the
/// same form matches.
fn refuse_value_words(answer: &str) -> Result<(), LineError> {
    match super::verify::value_changing_word(answer) {
        Some(word) => Err(LineError::ValueWord {
            answer: answer.chars().take(40).collect(),
            word,
        }),
        None => Ok(()),
    }
}

/// Loads a GSM8K-format JSONL file.
pub fn load_gsm8k(path: impl AsRef<Path>, on_bad: OnBadLine) -> Result<Vec<Record>, DatasetError> {
    load_jsonl(path.as_ref(), on_bad, parse_gsm8k_line)
}

/// Loads a MATH-style JSONL file.
pub fn load_math(path: impl AsRef<Path>, on_bad: OnBadLine) -> Result<Vec<Record>, DatasetError> {
    load_jsonl(path.as_ref(), on_bad, parse_math_line)
}

/// Loads a GSM8K- or MATH-style JSONL file, told apart by the first record: one with a `problem` field
/// and no `question` is MATH's (`problem`, `solution`, the answer boxed or in `answer`); anything else is
/// read as GSM8K's, whose errors then name its fields. For the commands that take any data file
/// (`qarl eval`, `qarl mismatch`), as `task.kind` tells a run which it has.
pub fn load_gsm8k_or_math(
    path: impl AsRef<Path>,
    on_bad: OnBadLine,
) -> Result<Vec<Record>, DatasetError> {
    let path = path.as_ref();
    let bytes = read_jsonl(path)?;
    let first = bytes
        .split(|&b| b == b'\n')
        .filter_map(|l| serde_json::from_slice::<serde_json::Value>(l).ok())
        .next();
    let is_math = first.is_some_and(|v| v.get("problem").is_some() && v.get("question").is_none());
    let parse: fn(&str) -> Result<Record, LineError> = if is_math {
        parse_math_line
    } else {
        parse_gsm8k_line
    };
    parse_jsonl(path, &bytes, on_bad, parse)
}

fn load_jsonl(
    path: &Path,
    on_bad: OnBadLine,
    parse: fn(&str) -> Result<Record, LineError>,
) -> Result<Vec<Record>, DatasetError> {
    parse_jsonl(path, &read_jsonl(path)?, on_bad, parse)
}

/// The bytes of the JSONL file at `path`, without a leading byte-order mark (as some Windows editors
/// write at the start of UTF-8 text: it is not part of the first record).
fn read_jsonl(path: &Path) -> Result<Vec<u8>, DatasetError> {
    let mut bytes = std::fs::read(path).map_err(|io| DatasetError::Io {
        path: path.to_path_buf(),
        io,
    })?;
    if bytes.starts_with(b"\xEF\xBB\xBF") {
        bytes.drain(..3);
    }
    Ok(bytes)
}

/// The records of JSONL `bytes` (read from `path`), each line by `parse`; bad lines as `on_bad` says.
fn parse_jsonl(
    path: &Path,
    bytes: &[u8],
    on_bad: OnBadLine,
    parse: fn(&str) -> Result<Record, LineError>,
) -> Result<Vec<Record>, DatasetError> {
    let mut out = Vec::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        let parsed = match std::str::from_utf8(raw) {
            Err(e) => Err(LineError::NotUtf8(e)),
            Ok(s) if s.trim().is_empty() => continue,
            Ok(s) => parse(s.trim_end_matches('\r')),
        };
        match parsed {
            Ok(mut r) => {
                r.line = line_no;
                out.push(r);
            }
            Err(error) => match on_bad {
                OnBadLine::Error => {
                    return Err(DatasetError::BadLine {
                        path: path.to_path_buf(),
                        line: line_no,
                        error,
                    })
                }
                OnBadLine::Skip => {
                    tracing::warn!("{}:{line_no}: skipped: {error}", path.display());
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
