//! Reading a final answer as an exact rational: words and units around it, signs, thousands groups,
//! decimals, fractions, powers and scientific factors.

use std::str::FromStr;

use num_rational::BigRational;

use super::normalize::{normalize_latex, starts_with};
use super::MAX_DIGITS;

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

/// Words that change the value of the number before them, which [`parse_answer`] reads past as it reads
/// past units and words (`1.5 million` is 3/2): a response that writes one is read as the number alone, and a
/// gold answer with one would mark the right answer wrong. Plurals are matched by their singular.
const VALUE_WORDS: [&str; 10] = [
    "hundred", "thousand", "million", "billion", "trillion", "dozen", "half", "halves", "quarter",
    "third",
];

/// The first word of `text` (lowercased) that changes the value of the number it follows (hundred,
/// thousand, million, billion, trillion, dozen, half, quarter, third and their plurals: `1.5 million`, `2
/// dozen`, `3 and a half`), if any: a GSM8K gold answer is refused with it.
pub fn value_changing_word(text: &str) -> Option<String> {
    text.split(|c: char| !c.is_alphabetic())
        .map(str::to_lowercase)
        .find(|w| {
            VALUE_WORDS.contains(&w.as_str())
                || w.strip_suffix('s')
                    .is_some_and(|s| VALUE_WORDS.contains(&s))
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The words that change a value are found (any case, plural), units and other words are not.
    #[test]
    fn value_changing_words_are_found_and_units_are_not() {
        for (text, word) in [
            ("1.5 million", Some("million")),
            ("2 Dozen", Some("dozen")),
            ("3 and a half", Some("half")),
            ("two thirds", Some("thirds")),
            ("4 halves", Some("halves")),
            ("5 hundreds", Some("hundreds")),
            ("18 dollars", None),
            ("$1,200", None),
            ("7 cm^2", None),
            ("12", None),
        ] {
            assert_eq!(value_changing_word(text).as_deref(), word, "{text}");
        }
        // The number alone is what the verifier reads: why such a gold answer is refused.
        assert_eq!(
            parse_answer("1.5 million"),
            parse_answer("1.5"),
            "the verifier now applies the word: the gold check is no longer needed"
        );
    }
}
