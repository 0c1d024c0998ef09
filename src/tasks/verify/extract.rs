//! Where a response states its final answer: the last box, the first `####` line, the last answer
//! marker, the last number (the module documentation of [`super`] gives the order).

use super::AnswerSource;

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
