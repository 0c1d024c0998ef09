//! The verifier: extract the final answer of a response, normalise it, compare it with the gold answer exactly
//! as a rational number, and turn the result into a reward.
//!
//! **Extraction** (first source that yields a non-empty candidate wins):
//! 1. the content of the last well-formed, non-empty `\boxed{...}` (or `\fbox{...}`), nested braces handled,
//!    or of a later unbraced `\boxed 5` (up to the next `$` or line end, as verl reads it);
//! 2. the rest of the line after the *first* `####` (GSM8K's terminal marker: what follows the first one, e.g. a
//!    run-on generation of a new question, is not part of the answer) that is not a Markdown heading
//!    (`#### Step 1: Add the apples`, `#### 1. Count`, `#### **Step 1**`: after bold/italic markers a word
//!    or a list number first, neither `x = ...` nor an answer phrase; a heading is its whole line);
//! 3. the rest of the line after the last `Answer:` / `answer is` (ASCII case-insensitive; when that line is
//!    empty, the next non-empty line that is not a display-math opener, `$$`, `\[` or `\(`);
//! 4. the last number in the response (`-12`, `−12`, `1,234.5`, `3/4`).
//!
//! [`VerifyConfig::answer_from`] `= "marked"` keeps sources 1 and 2 only (an answer must be stated), and
//! [`VerifyConfig::truncated`] `= "wrong"` gives a response cut off at the token limit no answer
//! ([`score_response`]).
//!
//! **Normalisation** ([`parse_answer`]): LaTeX wrappers are dropped (`$`, `\(`, `\[`, `\text{..}`/`\mathrm{..}`
//! unwrapped, `\left`/`\right`, thin spaces, `\%`/`%`, `^\circ`, `\dfrac`/`\tfrac`/`\cfrac` -> `\frac`, parentheses around a number); only what follows
//! the last `=` is kept (`x = 5`; a list of assignments, `x=2, x=5` or `x = 2 or x = 5`, and an inequality,
//! `x >= 5`, `x != 5`, are no value, and a marker's line that states its value before a note whose `=` is in
//! parentheses or after a sentence end, `#### 18 (16 - 3 - 4 = 9 eggs)`, is read from the value, while its own
//! equation, `#### 5 apples + 7 apples = 12 apples`, is read at its result); leading words (`The total is`) and trailing words/units/punctuation
//! (`dollars`, `cm`, `.`) are ignored, but anything else with a digit, a backslash or a brace beside the number
//! makes the candidate unparseable (so `2\sqrt{2}` is not read as 2), and so do one letter glued to the
//! number (`3x`, `2i`: units of two letters or more, `5cm`, stay units), a name glued to a sign (`x+1`) or
//! before a spaced operator (`x - 3`, `n + 1`; `is -3` is a sign), a subscript (`a_5`) and a factorial
//! (`5!`), which are expressions (a gold such as `3x` is then compared as text, below); a unit's slash or power after a letter
//! (`$15/hour`, `km/h`, `cm^2`) is a unit. A marker's line that does not parse but states its value first and
//! then goes on (`#### 18 (6 apples + 12 pears)`, `The answer is 20. Tom has 20 pencils.`) is read up to where
//! the value ends: a sentence end or `(`, and on a `####` line also a space and a word (not the letter `x` as a
//! times sign between values: `#### 3 x 4 = 12`). Numbers: an optional sign (`-`, `+`,
//! U+2212), digits with optional thousands separators in groups of three (`1,000`), an optional decimal part
//! (`0.750` = 3/4), an optional integer power (`2^{10}`, `2^10`, `10^{-3}`; `-2^2` is -4) or scientific
//! factor (`2.5 \times 10^{3}`, `\cdot`, `×`), optionally `/ denominator`, or `\frac{a}{b}` / `\frac ab`.
//! More than [`MAX_DIGITS`] digits in one number, a power past about as many, or a zero denominator, is
//! unparseable; so is a slash before one letter (`1/x`: a variable, where `15/hour` is a unit's). A
//! negation or a bound just before the number (`not 12`, `isn't 7`, `more than 5`, `at least 5`) states
//! no value, as `x >= 5` does. On a marker's line a comma or a space before a reason (`17, since 10 + 8 =
//! 18`) ends the value as a sentence end does.
//!
//! **Comparison**: when the gold answer parses as a number the candidate must parse to the same rational
//! ([`BigRational`], exact); a candidate that does not parse counts as "no answer" (`extracted: None`). When the
//! gold answer is not a number (MATH's `(1,2)`, `\sqrt{2}`), the normalised strings (whitespace removed, a
//! leading `x =` dropped, `\sqrt2` and `\frac12` braced) must be equal.
//!
//! Everything here is linear in the input (no recursion, no backtracking) and never panics.

use std::str::FromStr;

use num_rational::BigRational;
use serde::{Deserialize, Serialize};

/// Numbers with more digits than this (integer + fractional part, or either side of a fraction) do not parse.
pub const MAX_DIGITS: usize = 1000;

/// At most this many characters of the extracted answer are kept in [`Verdict::extracted`].
pub const MAX_EXTRACTED_CHARS: usize = 256;

/// Rewards of the verifier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VerifyConfig {
    /// Reward of a correct answer (default 1.0).
    pub correct_reward: f32,
    /// Reward of a wrong or missing answer (default 0.0; -1.0 for the +1/-1 scheme).
    pub wrong_reward: f32,
    /// Added to the reward when no answer can be extracted (or parsed); negative for a format penalty.
    pub format_reward: Option<f32>,
    /// Where a response's final answer may come from: `"any"` (the default: the module's four sources, the
    /// last number included) or `"marked"` (a `\boxed{}` or a `####` line only: a response that never
    /// states its answer has none; in the spirit of verl's strict GSM8K score, which reads the last `####`
    /// only, where this takes the first and `\boxed{}` too).
    pub answer_from: AnswerFrom,
    /// A response cut off at the token limit (no end of sequence, no stop string): `"scored"` (the default:
    /// judged as written) or `"wrong"` (no answer, whatever it holds: the last number of a sentence the
    /// limit cut, `Sam has 3 + 20`, is no answer, and scoring it rewards rambling into the limit).
    pub truncated: Truncated,
    /// DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer.len`): a response longer than
    /// `max_new_tokens - overlong_buffer` tokens loses `overlong_penalty` times the fraction of the buffer
    /// it used (0 = off). RL rewards only; evaluations judge correctness.
    pub overlong_buffer: usize,
    /// The penalty at the token limit (verl's `overlong_buffer.penalty_factor`, default 1.0).
    pub overlong_penalty: f32,
}

/// [`VerifyConfig::answer_from`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AnswerFrom {
    #[default]
    Any,
    Marked,
}

/// [`VerifyConfig::truncated`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Truncated {
    #[default]
    Scored,
    Wrong,
}

impl Default for VerifyConfig {
    fn default() -> Self {
        Self {
            correct_reward: 1.0,
            wrong_reward: 0.0,
            format_reward: None,
            answer_from: AnswerFrom::Any,
            truncated: Truncated::Scored,
            overlong_buffer: 0,
            overlong_penalty: 1.0,
        }
    }
}

impl VerifyConfig {
    /// Reward +1 for a correct answer and -1 otherwise.
    pub fn plus_minus_one() -> Self {
        Self {
            correct_reward: 1.0,
            wrong_reward: -1.0,
            ..Self::default()
        }
    }

    /// How answers are judged (`answer_from`, `truncated`; the rewards aside), as evaluations record it:
    /// outcomes judged under other rules are not one measurement (`qarl compare` refuses to pair them).
    pub fn judging_rules(&self) -> serde_json::Value {
        serde_json::json!({"answer_from": self.answer_from, "truncated": self.truncated})
    }

    /// DAPO's overlong reward of a response of `tokens` tokens (its end token included, as verl counts its
    /// response mask) under a limit of `max_new_tokens`: `min(-(tokens - (max_new_tokens - buffer)) /
    /// buffer * penalty, 0)`, 0 when the buffer is off.
    pub fn overlong_reward(&self, tokens: usize, max_new_tokens: usize) -> f32 {
        if self.overlong_buffer == 0 {
            return 0.0;
        }
        let expected = max_new_tokens.saturating_sub(self.overlong_buffer) as f64;
        let exceed = tokens as f64 - expected;
        (-exceed / self.overlong_buffer as f64 * f64::from(self.overlong_penalty)).min(0.0) as f32
    }

    /// Checks that every reward is finite and that some reward tells responses apart: with equal rewards
    /// for right and wrong answers and neither a format reward nor an overlong penalty, every advantage is
    /// 0 and a run trains nothing, without a word (the update skips nothing: its gradient is 0).
    pub fn validate(&self) -> Result<(), VerifyError> {
        let mut all = vec![
            ("correct_reward", self.correct_reward),
            ("wrong_reward", self.wrong_reward),
            ("overlong_penalty", self.overlong_penalty),
        ];
        if let Some(f) = self.format_reward {
            all.push(("format_reward", f));
        }
        if let Some((name, value)) = all.into_iter().find(|(_, v)| !v.is_finite()) {
            return Err(VerifyError::NonFinite { name, value });
        }
        let format_differs = self.format_reward.is_some_and(|f| f != 0.0);
        let overlong_differs = self.overlong_buffer > 0 && self.overlong_penalty != 0.0;
        if self.correct_reward == self.wrong_reward && !format_differs && !overlong_differs {
            return Err(VerifyError::NoSignal {
                reward: self.correct_reward,
            });
        }
        Ok(())
    }
}

/// Rewards of a [`VerifyConfig`] that cannot train, found by [`VerifyConfig::validate`]; the message
/// names the reward.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VerifyError {
    #[error("verifier: {name} must be a finite number, got {value}")]
    NonFinite { name: &'static str, value: f32 },
    #[error(
        "verifier: correct_reward and wrong_reward are both {reward}, and no format_reward or overlong \
         penalty makes rewards differ: every advantage would be 0 and the run would train nothing"
    )]
    NoSignal { reward: f32 },
}

/// The verifier's judgement of one response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The extracted answer equals the gold answer.
    pub correct: bool,
    /// The reward under the [`VerifyConfig`].
    pub reward: f32,
    /// The extracted answer text (trimmed, at most [`MAX_EXTRACTED_CHARS`] characters), `None` when no answer
    /// could be extracted or it did not parse.
    pub extracted: Option<String>,
}

/// Where an extracted answer came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerSource {
    /// The last `\boxed{...}`.
    Boxed,
    /// After the first `####`.
    Hashes,
    /// After the last `Answer:` / `answer is`.
    AnswerMarker,
    /// The last number of the response.
    LastNumber,
}

/// Scores a finished `response` (it stopped by itself) against `gold` (see the module documentation).
/// Never panics.
pub fn score(response: &str, gold: &str, cfg: &VerifyConfig) -> Verdict {
    score_response(response, false, gold, cfg)
}

/// [`score`] for a response that may have been `cut_off` at the token limit ([`VerifyConfig::truncated`]).
pub fn score_response(response: &str, cut_off: bool, gold: &str, cfg: &VerifyConfig) -> Verdict {
    let (correct, extracted) = if cut_off && cfg.truncated == Truncated::Wrong {
        (false, None)
    } else {
        judge(response, gold, cfg.answer_from)
    };
    let mut reward = if correct {
        cfg.correct_reward
    } else {
        cfg.wrong_reward
    };
    if extracted.is_none() {
        if let Some(f) = cfg.format_reward {
            reward += f;
        }
    }
    Verdict {
        correct,
        reward,
        extracted: extracted.map(|s| s.chars().take(MAX_EXTRACTED_CHARS).collect()),
    }
}

/// Whether two answers are equal: as rationals when both parse, else as normalised strings.
pub fn answers_equal(a: &str, b: &str) -> bool {
    match (parse_answer(a), parse_answer(b)) {
        (Some(x), Some(y)) => x == y,
        (None, None) => {
            let (x, y) = (normalize_symbolic(a), normalize_symbolic(b));
            !x.is_empty() && x == y
        }
        _ => false,
    }
}

fn judge<'a>(response: &'a str, gold: &str, from: AnswerFrom) -> (bool, Option<&'a str>) {
    let marked =
        |source: &AnswerSource| matches!(source, AnswerSource::Boxed | AnswerSource::Hashes);
    let Some((source, candidate)) =
        extract_candidate(response).filter(|(source, _)| from == AnswerFrom::Any || marked(source))
    else {
        return (false, None);
    };
    match parse_answer(gold) {
        Some(g) => match numeric_candidate(source, candidate) {
            Some((v, text)) => (v == g, Some(text)),
            None => (false, None),
        },
        None => {
            let c = normalize_symbolic(candidate);
            if c.is_empty() {
                (false, None)
            } else {
                (c == normalize_symbolic(gold), Some(candidate))
            }
        }
    }
}

/// The value of a numeric candidate and the text it was read from: the whole candidate, or, where that
/// does not parse and the candidate is a marker's line, the value it starts with ([`leading_clause`]):
/// `#### 18 (6 apples + 12 pears)` and `The answer is 20. Tom now has 20 pencils.` state their answers
/// first and go on in prose, which made the whole line unparseable.
///
/// A marker's line whose value comes before a note with an `=` in it (`#### 18 (16 - 3 - 4 = 9 eggs)`) is
/// read from its leading value: the note's `=` would otherwise make the note's result the answer.
fn numeric_candidate(source: AnswerSource, candidate: &str) -> Option<(BigRational, &str)> {
    let prose = match source {
        AnswerSource::Hashes => Some(true),
        AnswerSource::AnswerMarker => Some(false),
        AnswerSource::Boxed | AnswerSource::LastNumber => None,
    };
    let clause = prose.and_then(|prose| leading_clause(candidate, prose));
    if let Some(clause) = clause.filter(|c| !c.contains('=') && is_note(&candidate[c.len()..])) {
        if let Some(v) = parse_answer(clause) {
            return Some((v, clause));
        }
    }
    if let Some(v) = parse_answer(candidate) {
        return Some((v, candidate));
    }
    let clause = clause?;
    parse_answer(clause).map(|v| (v, clause))
}

/// Whether the text after a marker line's leading value is a note whose `=` is not the line's: the first `=`
/// comes inside a parenthesis, after a sentence end or after a reason (`18 (16 - 3 - 4 = 9 eggs)`,
/// `20. So 4 x 5 = 20`, `17, since 10 + 8 = 18`, `#### 17 because 9 + 8 = 17`), not in the line's own equation (`5 apples + 7 apples = 12 apples`, whose value is its result).
fn is_note(rest: &str) -> bool {
    let Some(eq) = rest.find('=') else {
        return false;
    };
    let before = &rest[..eq];
    before.contains('(')
        || starts_reason(before)
        || before.char_indices().any(|(i, c)| {
            let after = &before[i + c.len_utf8()..];
            (matches!(c, '.' | '!' | '?' | ';') && after.starts_with(' '))
                || (c == ',' && starts_reason(after))
        })
}

/// Whether `text` (after a comma) goes on with a reason: ` since`, ` because`, ` as`, ` so`, ` which`,
/// ` given` (`17, since 10 + 8 = 18` states 17 and then an equation of its own).
fn starts_reason(text: &str) -> bool {
    let Some(rest) = text.strip_prefix(' ') else {
        return false;
    };
    let word = rest
        .split(|c: char| !c.is_alphabetic())
        .next()
        .unwrap_or("");
    ["since", "because", "as", "so", "which", "given"]
        .iter()
        .any(|w| word.eq_ignore_ascii_case(w))
}

/// The start of a marker's line up to where its first value ends and other text begins: after the first
/// digit, the first sentence end (`.`, `!`, `?` or `;` followed by a space or the end of the line), `(` or
/// a comma before a reason ([`starts_reason`]);
/// with `prose` (a `####` line, where GSM8K's answer is the number right after the marker) also a space
/// followed by a word. A space followed by anything else (a digit, a backslash: `2 \sqrt{2}`) continues
/// the value, so `2\sqrt{2}` and `1 200` stay unparseable rather than read as 2 and 1.
fn leading_clause(s: &str, prose: bool) -> Option<&str> {
    let first = s.find(|c: char| c.is_ascii_digit())?;
    let mut spaced = false;
    for (k, c) in s[first..].char_indices() {
        let i = first + k;
        let after = &s[i + c.len_utf8()..];
        // Only a run's first space looks past the run (linear in the line).
        let run_start = c.is_whitespace() && !spaced;
        spaced = c.is_whitespace();
        let ends = match c {
            '.' | '!' | '?' | ';' => after.chars().next().is_none_or(char::is_whitespace),
            '(' => true,
            ',' => starts_reason(after),
            _ if run_start => {
                let next = after.trim_start();
                prose
                    && !is_times_sign(next)
                    && next
                        .chars()
                        .next()
                        .is_some_and(|n| n.is_alphabetic() || n == '(')
            }
            _ => false,
        };
        if ends {
            return Some(s[..i].trim_end());
        }
    }
    None
}

/// Whether `text` starts with the letter `x` written as a times sign between values (`x 4`, `x $5`), not
/// a word.
fn is_times_sign(text: &str) -> bool {
    text.strip_prefix(['x', 'X']).is_some_and(|rest| {
        rest.starts_with(char::is_whitespace)
            && rest
                .trim_start()
                .starts_with(|c: char| c.is_ascii_digit() || c == '$')
    })
}

/// The extracted final answer of `response` (trimmed), without judging it.
pub fn extract_answer(response: &str) -> Option<&str> {
    extract_candidate(response).map(|(_, s)| s)
}

/// The final-answer candidate of `response` and where it came from (see the module documentation).
pub fn extract_candidate(response: &str) -> Option<(AnswerSource, &str)> {
    if let Some(b) = last_box(response) {
        let b = b.trim();
        if !b.is_empty() {
            return Some((AnswerSource::Boxed, b));
        }
    }
    let mut from = 0;
    while let Some(pos) = response[from..].find("####") {
        let rest = response[from + pos + 4..].trim_start_matches('#');
        let raw_line = rest.split('\n').next().unwrap_or("");
        let line = raw_line.trim();
        if !line.is_empty() && !is_markdown_heading(line) {
            return Some((AnswerSource::Hashes, line));
        }
        // A heading is its whole line: markers later on it are the heading's text (and looking at each of
        // them again would make a line of `####a####a...` quadratic).
        from = response.len() - rest.len() + if line.is_empty() { 0 } else { raw_line.len() };
    }
    if let Some(s) = after_answer_marker(response) {
        return Some((AnswerSource::AnswerMarker, s));
    }
    last_number(response).map(|s| (AnswerSource::LastNumber, s))
}

/// Whether the text after a `####` is a Markdown heading (`#### Step 1: Add the apples`, `#### Final Answer`,
/// `#### 1. Count the apples`, `#### **Step 1: Count**`) rather than GSM8K's answer marker: after any bold
/// or italic markers it starts with a word or with a list number (`1.` or `1)` followed by a space and a
/// word), and is neither an assignment (`x = 5`) nor an answer phrase (`The answer is 18`). A heading's
/// step number is no answer.
fn is_markdown_heading(line: &str) -> bool {
    let line = line.trim_start_matches(['*', '_']).trim_start();
    if is_numbered_heading(line) {
        return true;
    }
    if !line.chars().next().is_some_and(char::is_alphabetic) {
        return false;
    }
    let word_end = line
        .find(|c: char| !c.is_alphanumeric() && c != '_')
        .unwrap_or(line.len());
    if line[word_end..].trim_start().starts_with('=') {
        return false;
    }
    let lower = line.to_lowercase();
    !(lower.contains("answer is") || lower.contains("answer:"))
}

/// `1. Count the apples`, `2) Add`: a list number, `.` or `)`, a space, then a word.
fn is_numbered_heading(line: &str) -> bool {
    let digits = line.len() - line.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    let rest = &line[digits..];
    digits > 0
        && (rest.starts_with(". ") || rest.starts_with(") "))
        && rest[2..]
            .trim_start()
            .chars()
            .next()
            .is_some_and(char::is_alphabetic)
}

fn after_answer_marker(response: &str) -> Option<&str> {
    let lower = response.to_ascii_lowercase();
    let a = lower.rfind("answer:").map(|p| p + "answer:".len());
    let b = lower.rfind("answer is").map(|p| p + "answer is".len());
    let start = match (a, b) {
        (Some(x), Some(y)) => x.max(y),
        (x, y) => x.or(y)?,
    };
    // `start` follows an ASCII match in a byte-for-byte lowercase copy, so it is a char boundary here.
    let rest = response.get(start..)?;
    let rest = rest.trim_start_matches([' ', '\t', ':', '*']);
    rest.split('\n').map(|l| l.trim()).find(|l| {
        !l.is_empty()
            && !l.chars().all(|c| c == '*' || c == ':')
            && !matches!(*l, "$$" | "\\[" | "\\(")
    })
}

/// The content of the last well-formed, non-empty `\boxed{...}` or `\fbox{...}` of `text` (nested braces
/// handled, escaped braces `\{`/`\}` ignored; an empty `\boxed{}` after the answer, a template's leftover,
/// does not hide it). One pass, no recursion.
pub fn last_boxed(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    let mut stack: Vec<(usize, bool)> = Vec::new();
    let mut best: Option<(usize, usize)> = None;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => {
                if i + 1 < b.len() && (b[i + 1] == b'{' || b[i + 1] == b'}') {
                    i += 2;
                    continue;
                }
                if let Some(len) = boxed_command_len(&b[i..]) {
                    let mut j = i + len;
                    while j < b.len() && b[j] == b' ' {
                        j += 1;
                    }
                    if j < b.len() && b[j] == b'{' {
                        stack.push((j, true));
                        i = j + 1;
                        continue;
                    }
                    i = j;
                    continue;
                }
                i += 1;
            }
            b'{' => {
                stack.push((i, false));
                i += 1;
            }
            b'}' => {
                if let Some((open, true)) = stack.pop() {
                    let filled = b[open + 1..i].iter().any(|c| !c.is_ascii_whitespace());
                    if filled && best.is_none_or(|(s, _)| open + 1 > s) {
                        best = Some((open + 1, i));
                    }
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    // Both ends sit next to ASCII braces, so they are char boundaries.
    best.and_then(|(s, e)| text.get(s..e))
}

/// The content of the last box of `text`, braced (`\boxed{5}`, [`last_boxed`]) or not (`\boxed 5`, up to
/// the next `$` or line end, as verl's `last_boxed_only_string` reads it), whichever comes last: a MATH
/// solution's gold answer and a response's boxed answer alike. Two records of MATH's training set box
/// their answer without braces (one was refused, one took an earlier braced box as its gold), and a
/// response's `$\boxed 5$` was passed over for a later number.
pub fn last_box(solution: &str) -> Option<&str> {
    let braced =
        last_boxed(solution).map(|s| (s.as_ptr() as usize - solution.as_ptr() as usize, s));
    let b = solution.as_bytes();
    // Where each unbraced box starts and its content begins, then the last with content: read from the
    // end, an empty one scans only whitespace, so the whole is linear in the text (a response may hold any
    // number of boxes).
    let mut starts = Vec::new();
    let mut i = 0;
    while let Some(at) = solution[i..].find('\\').map(|at| at + i) {
        i = at + 1;
        let Some(len) = boxed_command_len(&b[at..]) else {
            continue;
        };
        let mut j = at + len;
        while j < b.len() && b[j] == b' ' {
            j += 1;
        }
        if j == at + len || j >= b.len() || b[j] == b'{' {
            continue;
        }
        starts.push((at, j));
    }
    let unbraced = starts.into_iter().rev().find_map(|(at, j)| {
        let end = solution[j..]
            .find(['$', '\n'])
            .map_or(solution.len(), |e| e + j);
        let content = solution[j..end].trim();
        (!content.is_empty()).then_some((at, content))
    });
    [braced, unbraced]
        .into_iter()
        .flatten()
        .max_by_key(|&(at, _)| at)
        .map(|(_, content)| content)
}

fn boxed_command_len(b: &[u8]) -> Option<usize> {
    for cmd in [&b"\\boxed"[..], &b"\\fbox"[..]] {
        if b.starts_with(cmd) && b.get(cmd.len()).is_none_or(|c| !c.is_ascii_alphabetic()) {
            return Some(cmd.len());
        }
    }
    None
}

/// The last number of `text`: optional `-` or U+2212 sign (when it does not follow a digit, letter or `)`), digits with
/// optional `,ddd` groups, optional `.digits`, optional `/digits`.
fn last_number(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    let mut last = None;
    let mut i = 0;
    while i < b.len() {
        let starts = b[i].is_ascii_digit()
            || (b[i] == b'.' && b.get(i + 1).is_some_and(|c| c.is_ascii_digit()));
        if !starts {
            i += 1;
            continue;
        }
        let mut start = i;
        // `-`, or U+2212 (3 bytes: E2 88 92), as a sign.
        let sign = if i > 0 && b[i - 1] == b'-' {
            1
        } else if i >= 3 && b[i - 3..i] == [0xE2, 0x88, 0x92] {
            3
        } else {
            0
        };
        if sign > 0 {
            let before = (i > sign).then(|| b[i - sign - 1]);
            if before.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == b')' || c == b'_')) {
                start = i - sign;
            }
        }
        let mut j = scan_digits_grouped(b, i);
        if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_digit() {
            j = scan_digits(b, j + 1);
        }
        if j + 1 < b.len() && b[j] == b'/' && b[j + 1].is_ascii_digit() {
            j = scan_digits(b, j + 1);
        }
        last = Some((start, j));
        i = j.max(i + 1);
    }
    last.and_then(|(s, e)| text.get(s..e))
}

fn scan_digits(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    i
}

/// Digits, then `,ddd` groups when the first run has 1..=3 digits and each group is exactly three digits.
fn scan_digits_grouped(b: &[u8], i: usize) -> usize {
    let mut j = scan_digits(b, i);
    if j - i <= 3 {
        while j + 3 < b.len()
            && b[j] == b','
            && b[j + 1..j + 4].iter().all(|c| c.is_ascii_digit())
            && b.get(j + 4).is_none_or(|c| !c.is_ascii_digit())
        {
            j += 4;
        }
    }
    j
}

/// Parses a final answer into an exact rational after normalisation (see the module documentation); `None` when
/// it is not a number.
pub fn parse_answer(text: &str) -> Option<BigRational> {
    let t = normalize_latex(text);
    if lists_several_values(&t) {
        return None;
    }
    let t = match t.rfind('=') {
        // `x >= 5`, `x <= 5`, `x != 5`: an inequality states no value.
        Some(p) if t[..p].ends_with(['<', '>', '!']) => return None,
        Some(p) => &t[p + 1..],
        None => &t[..],
    };
    parse_value(t.trim())
}

/// Whether `text` states several assignments (`x=2, x=5`, `x = 2 or x = 5`) rather than one chain
/// (`5 + 13 = 18`, `x = 2 + 3 = 5`): a `,`, `;` or a word `or` / `and` between its last two `=`. Such a
/// list is no single value: reading the last one would accept any list that ends with the gold answer.
fn lists_several_values(text: &str) -> bool {
    let mut parts = text.rsplit('=');
    let (Some(_), Some(between), Some(_)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    between.contains([',', ';'])
        || between
            .split(|c: char| !c.is_alphabetic())
            .any(|w| w.eq_ignore_ascii_case("or") || w.eq_ignore_ascii_case("and"))
}

const UNWRAP_COMMANDS: &[&str] = &[
    "text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mathit", "mbox", "boxed", "fbox",
];

const DROP_SEQUENCES: &[&str] = &[
    "\\displaystyle",
    "\\left",
    "\\right",
    "^{\\circ}",
    "^\\circ",
    "\\circ",
    "\\degree",
    "\u{00b0}",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\%",
    "%",
    "\\$",
    "$",
    "\\(",
    "\\)",
    "\\[",
    "\\]",
    "{,}",
];

/// LaTeX cleanup shared by numeric and symbolic comparison.
fn normalize_latex(text: &str) -> String {
    let mut s = unwrap_commands(text);
    for (from, to) in [
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\cfrac", "\\frac"),
    ] {
        if s.contains(from) {
            s = s.replace(from, to);
        }
    }
    for d in DROP_SEQUENCES {
        if s.contains(d) {
            s = s.replace(d, "");
        }
    }
    if s.contains("\\ ") {
        s = s.replace("\\ ", " ");
    }
    if s.contains('~') {
        s = s.replace('~', " ");
    }
    s
}

/// Replaces `\text{X}` (and the other [`UNWRAP_COMMANDS`]) by `X`, in one pass with an explicit stack.
fn unwrap_commands(s: &str) -> String {
    let cs: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut stack: Vec<bool> = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c == '\\' {
            let mut j = i + 1;
            while j < cs.len() && cs[j].is_ascii_alphabetic() {
                j += 1;
            }
            if j == i + 1 {
                // `\{`, `\}`, `\,` ...: keep both characters.
                out.push('\\');
                if let Some(&n) = cs.get(i + 1) {
                    out.push(n);
                }
                i += 2;
                continue;
            }
            let name: String = cs[i + 1..j].iter().collect();
            if UNWRAP_COMMANDS.contains(&name.as_str()) {
                let mut k = j;
                while k < cs.len() && cs[k] == ' ' {
                    k += 1;
                }
                if k < cs.len() && cs[k] == '{' {
                    stack.push(true);
                    i = k + 1;
                } else {
                    i = j;
                }
                continue;
            }
            out.extend(&cs[i..j]);
            i = j;
            continue;
        }
        match c {
            '{' => {
                stack.push(false);
                out.push(c);
            }
            '}' => {
                if stack.pop() != Some(true) {
                    out.push(c);
                }
            }
            _ => out.push(c),
        }
        i += 1;
    }
    out
}

/// Normalised text for comparing non-numeric answers: LaTeX cleanup, whitespace removed, trailing `.` removed,
/// a leading assignment to one name dropped (`x=\sqrt{2}` is `\sqrt{2}`), and the one-character arguments
/// of `\sqrt` and `\frac` braced (`\sqrt2` is `\sqrt{2}`, `\frac12` is `\frac{1}{2}`).
fn normalize_symbolic(text: &str) -> String {
    let s = normalize_latex(text);
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    let s = s.trim_end_matches('.');
    brace_short_arguments(without_assignment(s))
}

/// `s` without a leading `name=` (a name of ASCII letters, digits and `_` starting with a letter), where
/// the rest has no other `=` (an equation such as `y=2x+3=0` stays whole).
fn without_assignment(s: &str) -> &str {
    let Some((name, rest)) = s.split_once('=') else {
        return s;
    };
    let is_name = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if is_name && !rest.is_empty() && !rest.contains('=') {
        rest
    } else {
        s
    }
}

/// Braces the unbraced one-character arguments of `\sqrt` (one) and `\frac` (two), as LaTeX reads them,
/// also after a braced argument and inside one (`\frac{\sqrt3}2` is `\frac{\sqrt{3}}{2}`). One pass: a
/// stack says, for each open brace, how many arguments of its command follow its group.
fn brace_short_arguments(s: &str) -> String {
    let cs: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len() + 8);
    // Arguments still to read at the current position, and per open brace those left after its group.
    let mut wanted = 0;
    let mut groups: Vec<usize> = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if wanted > 0 {
            wanted -= 1;
            if c.is_ascii_alphanumeric() {
                out.extend(['{', c, '}']);
                i += 1;
                continue;
            }
            if c != '{' {
                wanted = 0;
            }
        }
        let command = ["\\sqrt", "\\frac"].into_iter().find(|name| {
            starts_with(&cs, i, name) && !cs.get(i + 5).is_some_and(char::is_ascii_alphabetic)
        });
        if let Some(name) = command {
            out.push_str(name);
            i += 5;
            wanted = if name == "\\sqrt" { 1 } else { 2 };
            continue;
        }
        match c {
            '{' => {
                groups.push(wanted);
                wanted = 0;
            }
            '}' => wanted = groups.pop().unwrap_or(0),
            _ => {}
        }
        out.push(c);
        i += 1;
    }
    out
}

fn is_leading_junk(c: char) -> bool {
    c.is_alphabetic() || c.is_whitespace() || matches!(c, ':' | '*' | '_' | '"' | '\'')
}

fn is_trailing_junk(c: char) -> bool {
    c.is_alphabetic()
        || c.is_whitespace()
        || matches!(
            c,
            '.' | ',' | '!' | '?' | ';' | ':' | '*' | '_' | '"' | '\'' | '(' | ')'
        )
}

fn is_minus(c: char) -> bool {
    c == '-' || c == '\u{2212}'
}

fn skip_spaces(cs: &[char], mut p: usize) -> usize {
    while p < cs.len() && cs[p].is_whitespace() {
        p += 1;
    }
    p
}

/// `[words] [sign] magnitude [words]` -> rational.
fn parse_value(s: &str) -> Option<BigRational> {
    let mut s = s;
    // `{5}` -> `5`, `(-3)` -> `-3` (not a tuple: `(1,2)` keeps its parentheses and stays unparseable).
    while s.len() >= 2
        && ((s.starts_with('{') && s.ends_with('}'))
            || (s.starts_with('(') && s.ends_with(')') && !s.contains(',')))
    {
        s = s[1..s.len() - 1].trim();
    }
    let cs: Vec<char> = s.chars().collect();
    let mut p = 0;
    while p < cs.len() && is_leading_junk(cs[p]) {
        p += 1;
    }
    // A name before a sign is an expression, not words before a number, where the sign is glued to the
    // name (`x+1`, `n-1`) or spaced as a binary operator (`x - 3`, `n + 1`; `is -3` is a sign).
    let sign_at_p = cs.get(p).is_some_and(|&c| is_minus(c) || c == '+');
    let after_name = cs[..p]
        .iter()
        .rev()
        .find(|c| !c.is_whitespace())
        .is_some_and(|c| c.is_alphabetic());
    let glued = p > 0 && cs[p - 1].is_alphabetic();
    let spaced_operator = cs.get(p + 1).is_some_and(|c| c.is_whitespace());
    if sign_at_p && after_name && (glued || spaced_operator) {
        return None;
    }
    // A name with a subscript (`a_5`) is not the number 5.
    if p >= 2 && cs[p - 1] == '_' && cs[p - 2].is_alphanumeric() {
        return None;
    }
    if qualifies_the_value(&cs[..p]) {
        return None;
    }
    let mut negative = false;
    if p < cs.len() && (is_minus(cs[p]) || cs[p] == '+') {
        negative = is_minus(cs[p]);
        p = skip_spaces(&cs, p + 1);
    }
    let (mut value, mut p) = if starts_with(&cs, p, "\\frac") {
        parse_frac(&cs, p + 5)?
    } else {
        let (num, q) = parse_power(&cs, p)?;
        let (num, q) = times_power_of_ten(&cs, q, num)?;
        let r = skip_spaces(&cs, q);
        // `15/hour`: a unit's slash, not a fraction; `1/x` is an expression (one letter: a variable).
        let word = skip_spaces(&cs, r + 1);
        let letters = cs[word.min(cs.len())..]
            .iter()
            .take_while(|c| c.is_alphabetic())
            .count();
        if r < cs.len() && cs[r] == '/' && letters == 1 {
            return None;
        }
        if r < cs.len() && cs[r] == '/' && letters == 0 {
            let r = skip_spaces(&cs, r + 1);
            let (den, r) = parse_power(&cs, r)?;
            (divide(num, den)?, r)
        } else {
            (num, q)
        }
    };
    // One letter glued to the number is a variable or a unit of one letter that reads as one (`3x`, `2i`,
    // `5n`), and `!` a factorial: an expression, not the number. Units of two letters or more (`5cm`)
    // and words after a space stay units.
    let glued = cs[p..].iter().take_while(|c| c.is_alphabetic()).count();
    let after = cs.get(p + glued);
    if (glued == 1 && after.is_none_or(|c| !c.is_alphanumeric())) || cs.get(p) == Some(&'!') {
        return None;
    }
    while p < cs.len() {
        p = skip_trailing(&cs, p)?;
    }
    if negative {
        value = -value;
    }
    Some(value)
}

/// Past the trailing character at `p` (words, units, punctuation: [`is_trailing_junk`]), or past a unit's
/// slash or power (`km/h`, `$/hour`, `cm^2`, `cm^{2}`, `m²`: after a letter); `None` for anything else
/// (a digit, a backslash, an operator), which makes the candidate unparseable.
fn skip_trailing(cs: &[char], p: usize) -> Option<usize> {
    let c = cs[p];
    if is_trailing_junk(c) {
        return Some(p + 1);
    }
    let after_letter = p > 0 && cs[p - 1].is_alphabetic();
    match c {
        '/' if cs.get(p + 1).is_some_and(|n| n.is_alphabetic()) => Some(p + 1),
        '²' | '³' if after_letter => Some(p + 1),
        '^' if after_letter => {
            let mut q = p + 1;
            let braced = cs.get(q) == Some(&'{');
            q += usize::from(braced);
            let digits = cs[q..].iter().take_while(|d| d.is_ascii_digit()).count();
            q += digits;
            if braced {
                (cs.get(q) == Some(&'}')).then_some(())?;
                q += 1;
            }
            (digits > 0).then_some(q)
        }
        _ => None,
    }
}

/// Whether the words before a number say the answer is not that number: a negation (`not 12`, `isn't 7`)
/// or a bound (`more than 5`, `at least 5`, `at most 5`), which, like `x >= 5`, state no value.
fn qualifies_the_value(before: &[char]) -> bool {
    let words: String = before.iter().collect::<String>().to_lowercase();
    let last = words
        .split(|c: char| !(c.is_alphabetic() || c == '\'' || c == '\u{2019}'))
        .rfind(|w| !w.is_empty());
    last.is_some_and(|w| {
        matches!(w, "not" | "than" | "least" | "most")
            || w.ends_with("n't")
            || w.ends_with("n\u{2019}t")
    })
}

/// Past the bits a power may have: 4000 (a result of more than about [`MAX_DIGITS`] digits is refused,
/// as a number written out with them is).
const MAX_POWER_BITS: u64 = 4000;

/// A decimal at `p` raised to an integer power when `^` follows it: `2^{10}`, `2^10` (plain text reads the
/// digits after `^` as the exponent, as math-verify does), `10^{-3}`, `5^2`. Without `^`, the decimal.
fn parse_power(cs: &[char], p: usize) -> Option<(BigRational, usize)> {
    let (base, q) = parse_decimal(cs, p)?;
    if cs.get(q) != Some(&'^') {
        return Some((base, q));
    }
    let (exponent, q) = parse_exponent(cs, q + 1)?;
    Some((power(base, exponent)?, q))
}

/// After `^`: `{[sign]digits}` or `[sign]digits`.
fn parse_exponent(cs: &[char], p: usize) -> Option<(i32, usize)> {
    let braced = cs.get(p) == Some(&'{');
    let mut q = if braced { skip_spaces(cs, p + 1) } else { p };
    let negative = cs.get(q).is_some_and(|&c| is_minus(c));
    if cs.get(q).is_some_and(|&c| is_minus(c) || c == '+') {
        q += 1;
    }
    let digits = cs[q.min(cs.len())..]
        .iter()
        .take_while(|c| c.is_ascii_digit())
        .count();
    if digits == 0 || digits > 6 {
        return None;
    }
    let magnitude: i32 = cs[q..q + digits].iter().collect::<String>().parse().ok()?;
    q += digits;
    if braced {
        q = skip_spaces(cs, q);
        (cs.get(q) == Some(&'}')).then_some(())?;
        q += 1;
    }
    Some((if negative { -magnitude } else { magnitude }, q))
}

/// `base^exponent`, `None` for `0^-k` and for results past [`MAX_POWER_BITS`].
fn power(base: BigRational, exponent: i32) -> Option<BigRational> {
    let bits = base.numer().bits().max(base.denom().bits());
    if bits.saturating_mul(u64::from(exponent.unsigned_abs())) > MAX_POWER_BITS {
        return None;
    }
    if exponent < 0 && base == BigRational::default() {
        return None;
    }
    Some(base.pow(exponent))
}

/// `value \times 10^{k}` (also `\cdot`, `×`, `·`): scientific notation, `value * 10^k`. Anything else
/// after the value (a product such as `3 \times 4`) is left where it is, unread.
fn times_power_of_ten(cs: &[char], p: usize, value: BigRational) -> Option<(BigRational, usize)> {
    let q = skip_spaces(cs, p);
    let sign = ["\\times", "\\cdot", "×", "·"].into_iter().find(|s| {
        starts_with(cs, q, s)
            && !cs
                .get(q + s.chars().count())
                .is_some_and(char::is_ascii_alphabetic)
    });
    let Some(sign) = sign else {
        return Some((value, p));
    };
    let q = skip_spaces(cs, q + sign.chars().count());
    if !(starts_with(cs, q, "10^")) {
        return Some((value, p));
    }
    let (exponent, q) = parse_exponent(cs, q + 3)?;
    let scale = power(BigRational::from_integer(10.into()), exponent)?;
    Some((value * scale, q))
}

fn starts_with(cs: &[char], p: usize, pat: &str) -> bool {
    let pat: Vec<char> = pat.chars().collect();
    cs.get(p..p.saturating_add(pat.len())) == Some(&pat[..])
}

fn divide(num: BigRational, den: BigRational) -> Option<BigRational> {
    if den == BigRational::default() {
        None
    } else {
        Some(num / den)
    }
}

/// After `\frac`: `{a}{b}` (each a signed decimal) or `ab` (two single digits).
fn parse_frac(cs: &[char], p: usize) -> Option<(BigRational, usize)> {
    let (num, p) = parse_frac_arg(cs, skip_spaces(cs, p))?;
    let (den, p) = parse_frac_arg(cs, skip_spaces(cs, p))?;
    Some((divide(num, den)?, p))
}

fn parse_frac_arg(cs: &[char], p: usize) -> Option<(BigRational, usize)> {
    let c = *cs.get(p)?;
    if c.is_ascii_digit() {
        let v = BigRational::from_str(&c.to_string()).ok()?;
        return Some((v, p + 1));
    }
    if c != '{' {
        return None;
    }
    let mut q = skip_spaces(cs, p + 1);
    let mut negative = false;
    if q < cs.len() && (is_minus(cs[q]) || cs[q] == '+') {
        negative = is_minus(cs[q]);
        q = skip_spaces(cs, q + 1);
    }
    let (mut v, q) = parse_decimal(cs, q)?;
    let q = skip_spaces(cs, q);
    if cs.get(q) != Some(&'}') {
        return None;
    }
    if negative {
        v = -v;
    }
    Some((v, q + 1))
}

/// Digits (thousands groups allowed), optional `.digits`; at most [`MAX_DIGITS`] digits.
fn parse_decimal(cs: &[char], p: usize) -> Option<(BigRational, usize)> {
    let mut int = String::new();
    let mut q = p;
    while q < cs.len() && cs[q].is_ascii_digit() {
        int.push(cs[q]);
        q += 1;
        if int.len() > MAX_DIGITS {
            return None;
        }
    }
    if !int.is_empty() && int.len() <= 3 {
        while q + 3 < cs.len()
            && cs[q] == ','
            && cs[q + 1..q + 4].iter().all(|c| c.is_ascii_digit())
            && cs.get(q + 4).is_none_or(|c| !c.is_ascii_digit())
        {
            int.extend(&cs[q + 1..q + 4]);
            q += 4;
            if int.len() > MAX_DIGITS {
                return None;
            }
        }
    }
    let mut frac = String::new();
    if q + 1 < cs.len() && cs[q] == '.' && cs[q + 1].is_ascii_digit() {
        q += 1;
        while q < cs.len() && cs[q].is_ascii_digit() {
            frac.push(cs[q]);
            q += 1;
            if int.len() + frac.len() > MAX_DIGITS {
                return None;
            }
        }
    }
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let numer = format!("{int}{frac}");
    let denom = format!("1{}", "0".repeat(frac.len()));
    let v = BigRational::from_str(&format!("{numer}/{denom}")).ok()?;
    Some((v, q))
}
