//! LaTeX cleanup shared by numeric and symbolic comparison, and the normal form of a symbolic answer.

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
pub(super) fn normalize_latex(text: &str) -> String {
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
pub(super) fn normalize_symbolic(text: &str) -> String {
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

/// Whether `cs` holds `pat` from position `p`.
pub(super) fn starts_with(cs: &[char], p: usize, pat: &str) -> bool {
    let pat: Vec<char> = pat.chars().collect();
    cs.get(p..p.saturating_add(pat.len())) == Some(&pat[..])
}
