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

use num_rational::BigRational;
use serde::{Deserialize, Serialize};

mod extract;
mod normalize;
mod number;

pub use extract::{extract_answer, extract_candidate, last_box, last_boxed};
use normalize::normalize_symbolic;
pub use number::{parse_answer, value_changing_word};

/// Numbers with more digits than this (integer + fractional part, or either side of a fraction) do not parse.
pub const MAX_DIGITS: usize = 1000;

/// The verifier's code, as evaluations record it: raised whenever a change judges some response otherwise
/// (outcomes of two versions are not one measurement, so `qarl compare` and experiment reports do not pair
/// them). 1: up to 2026-12-07 (logs without a version); 2: powers and scientific factors, bounds and
/// negations, `1/x`, reasons after a stated answer, unbraced boxes in responses, parentheses, `\cfrac`.
pub const VERIFIER_VERSION: u32 = 2;

/// The version of evaluations that recorded none.
pub const UNRECORDED_VERIFIER_VERSION: u32 = 1;

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
        self.judging_rules_of(VERIFIER_VERSION)
    }

    /// [`Self::judging_rules`] of an evaluation judged by verifier `version` ([`VERIFIER_VERSION`] then).
    pub fn judging_rules_of(&self, version: u32) -> serde_json::Value {
        serde_json::json!({"answer_from": self.answer_from, "truncated": self.truncated,
            "verifier": version})
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
