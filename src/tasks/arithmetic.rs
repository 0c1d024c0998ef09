//! A synthetic arithmetic task: multi-digit `+`, `-`, `*` expressions of several terms, evaluated with the
//! standard precedence (`*` before `+`/`-`, left to right otherwise), with worked solutions. Deterministic from
//! a seed (ChaCha8).
//!
//! ## Text format
//!
//! Compact and character-level friendly (every character is in [`super::char_tokenizer::char_vocab`]):
//!
//! ```text
//! prompt:   "Q: 37+48*2=?\nA:"
//! solution: " 48*2=96. 37+96=133. #### 133\n"
//! ```
//!
//! - The prompt is `Q: ` + the expression (operands are non-negative decimal integers, no spaces) + `=?\nA:`.
//! - The solution is the completion that follows the prompt: one step per binary operation, each
//!   ` {left}{op}{right}={result}.`; first every multiplication chain, left to right (`2*3*4` gives
//!   `2*3=6. 6*4=24.`), then the sums/differences left to right on the products' results. It ends with the
//!   final-answer line ` #### {answer}\n`. A single-term expression has no steps (` #### 37\n`).
//! - Intermediate and final results may be negative only when `allow_negative` is set (`5-12=-7.`); otherwise
//!   problems whose steps would go below zero are redrawn.
//! - `answer` is the canonical final answer: the decimal integer (`133`, `-7`).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// A binary operator of the expressions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    #[serde(alias = "+")]
    Add,
    #[serde(alias = "-")]
    Sub,
    #[serde(alias = "*")]
    Mul,
}

impl Op {
    /// The character written in the expression.
    pub fn symbol(self) -> char {
        match self {
            Op::Add => '+',
            Op::Sub => '-',
            Op::Mul => '*',
        }
    }
}

/// Largest digit count of one operand.
pub const MAX_OPERAND_DIGITS: u32 = 18;
/// Largest number of terms of one expression.
pub const MAX_TERMS: u32 = 16;
/// Bound on `max_digits * max_terms`, which keeps every value inside `i128`.
pub const MAX_TOTAL_DIGITS: u32 = 36;

/// A knob of [`ArithmeticConfig`] out of range, found by [`ArithmeticConfig::validate`] (the generator clamps
/// instead); each message names the knob and its value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArithmeticError {
    #[error(
        "arithmetic: need 1 <= min_digits <= max_digits, got min_digits = {min_digits}, max_digits = {max_digits}"
    )]
    DigitRange { min_digits: u32, max_digits: u32 },
    #[error(
        "arithmetic: max_digits = {max_digits} is above the limit {}",
        MAX_OPERAND_DIGITS
    )]
    TooManyDigits { max_digits: u32 },
    #[error(
        "arithmetic: need 1 <= min_terms <= max_terms, got min_terms = {min_terms}, max_terms = {max_terms}"
    )]
    TermRange { min_terms: u32, max_terms: u32 },
    #[error("arithmetic: max_terms = {max_terms} is above the limit {}", MAX_TERMS)]
    TooManyTerms { max_terms: u32 },
    #[error(
        "arithmetic: max_digits * max_terms = {product} is above {} (values must fit in i128)",
        MAX_TOTAL_DIGITS
    )]
    TooManyTotalDigits { product: u32 },
    #[error("arithmetic: `ops` is empty (use some of \"add\", \"sub\", \"mul\")")]
    NoOps,
}

/// Knobs of the generator. More digits and more terms make harder problems (longer solutions).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ArithmeticConfig {
    /// Fewest digits of an operand (1 allows 0..=9; d > 1 draws from 10^(d-1)..10^d).
    pub min_digits: u32,
    /// Most digits of an operand (at most [`MAX_OPERAND_DIGITS`]).
    pub max_digits: u32,
    /// Operators to draw from (`["add", "sub", "mul"]` or `["+", "-", "*"]`).
    pub ops: Vec<Op>,
    /// Fewest operands of an expression (at least 1).
    pub min_terms: u32,
    /// Most operands of an expression (at most [`MAX_TERMS`]; `max_digits * max_terms` at most
    /// [`MAX_TOTAL_DIGITS`]).
    pub max_terms: u32,
    /// Allow negative intermediate and final results; when false such draws are redrawn.
    pub allow_negative: bool,
}

impl Default for ArithmeticConfig {
    fn default() -> Self {
        Self {
            min_digits: 1,
            max_digits: 2,
            ops: vec![Op::Add, Op::Sub, Op::Mul],
            min_terms: 2,
            max_terms: 3,
            allow_negative: false,
        }
    }
}

/// One generated problem.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Problem {
    /// `Q: {expression}=?\nA:`
    pub prompt: String,
    /// The canonical final answer (a decimal integer).
    pub answer: String,
    /// The worked solution that follows the prompt, ending in ` #### {answer}\n`.
    pub solution: String,
}

impl Problem {
    /// `prompt + solution`: the supervised text.
    pub fn full_text(&self) -> String {
        format!("{}{}", self.prompt, self.solution)
    }
}

impl ArithmeticConfig {
    /// Presets by difficulty level (levels above 4 are level 4):
    ///
    /// | level | digits | ops | terms | negative |
    /// |---|---|---|---|---|
    /// | 0 | 1 | + | 2 | no |
    /// | 1 | 1-2 | + - | 2 | no |
    /// | 2 | 1-2 | + - * | 2-3 | no |
    /// | 3 | 2-3 | + - * | 3-4 | no |
    /// | 4 | 2-4 | + - * | 3-5 | yes |
    pub fn difficulty(level: u32) -> Self {
        let all = vec![Op::Add, Op::Sub, Op::Mul];
        let (min_digits, max_digits, ops, min_terms, max_terms, allow_negative) = match level {
            0 => (1, 1, vec![Op::Add], 2, 2, false),
            1 => (1, 2, vec![Op::Add, Op::Sub], 2, 2, false),
            2 => (1, 2, all, 2, 3, false),
            3 => (2, 3, all, 3, 4, false),
            _ => (2, 4, all, 3, 5, true),
        };
        Self {
            min_digits,
            max_digits,
            ops,
            min_terms,
            max_terms,
            allow_negative,
        }
    }

    /// Checks the knobs; the error says which one is wrong.
    pub fn validate(&self) -> Result<(), ArithmeticError> {
        let (min_digits, max_digits) = (self.min_digits, self.max_digits);
        let (min_terms, max_terms) = (self.min_terms, self.max_terms);
        if min_digits < 1 || min_digits > max_digits {
            return Err(ArithmeticError::DigitRange {
                min_digits,
                max_digits,
            });
        }
        if max_digits > MAX_OPERAND_DIGITS {
            return Err(ArithmeticError::TooManyDigits { max_digits });
        }
        if min_terms < 1 || min_terms > max_terms {
            return Err(ArithmeticError::TermRange {
                min_terms,
                max_terms,
            });
        }
        if max_terms > MAX_TERMS {
            return Err(ArithmeticError::TooManyTerms { max_terms });
        }
        if max_digits * max_terms > MAX_TOTAL_DIGITS {
            return Err(ArithmeticError::TooManyTotalDigits {
                product: max_digits * max_terms,
            });
        }
        if self.ops.is_empty() && max_terms > 1 {
            return Err(ArithmeticError::NoOps);
        }
        Ok(())
    }

    /// The nearest valid config (used by the generator so that it never panics; call [`Self::validate`] to be
    /// told instead).
    fn clamped(&self) -> Self {
        let max_digits = self.max_digits.clamp(1, MAX_OPERAND_DIGITS);
        let min_digits = self.min_digits.clamp(1, max_digits);
        let mut max_terms = self.max_terms.clamp(1, MAX_TERMS);
        max_terms = max_terms.min((MAX_TOTAL_DIGITS / max_digits).max(1));
        let min_terms = self.min_terms.clamp(1, max_terms);
        let ops = if self.ops.is_empty() {
            vec![Op::Add]
        } else {
            self.ops.clone()
        };
        Self {
            min_digits,
            max_digits,
            ops,
            min_terms,
            max_terms,
            allow_negative: self.allow_negative,
        }
    }

    /// `n` problems drawn from `seed` (the first `n` of [`Self::stream`]).
    pub fn generate(&self, n: usize, seed: u64) -> Vec<Problem> {
        self.stream(seed).take(n).collect()
    }

    /// An endless, deterministic stream of problems drawn from `seed`.
    pub fn stream(&self, seed: u64) -> ProblemStream {
        ProblemStream {
            cfg: self.clamped(),
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }
}

/// Endless iterator of problems (see [`ArithmeticConfig::stream`]).
pub struct ProblemStream {
    cfg: ArithmeticConfig,
    rng: ChaCha8Rng,
}

impl Iterator for ProblemStream {
    type Item = Problem;

    fn next(&mut self) -> Option<Problem> {
        Some(self.draw())
    }
}

/// Redraws allowed before a problem that goes negative has its `-` turned into `+`.
const NEGATIVE_REDRAWS: usize = 64;

impl ProblemStream {
    fn draw(&mut self) -> Problem {
        let mut attempt = 0;
        loop {
            let (nums, ops) = self.draw_expression();
            let solved = solve(&nums, &ops);
            if self.cfg.allow_negative || !solved.went_negative {
                return render(&nums, &ops, &solved);
            }
            attempt += 1;
            if attempt >= NEGATIVE_REDRAWS {
                let ops: Vec<Op> = ops
                    .into_iter()
                    .map(|o| if o == Op::Sub { Op::Add } else { o })
                    .collect();
                let solved = solve(&nums, &ops);
                return render(&nums, &ops, &solved);
            }
        }
    }

    fn draw_expression(&mut self) -> (Vec<i128>, Vec<Op>) {
        let terms = self
            .rng
            .random_range(self.cfg.min_terms..=self.cfg.max_terms) as usize;
        let mut nums = Vec::with_capacity(terms);
        let mut ops = Vec::with_capacity(terms.saturating_sub(1));
        for k in 0..terms {
            let digits = self
                .rng
                .random_range(self.cfg.min_digits..=self.cfg.max_digits);
            let (lo, hi) = if digits == 1 {
                (0u64, 9u64)
            } else {
                (10u64.pow(digits - 1), 10u64.pow(digits) - 1)
            };
            nums.push(self.rng.random_range(lo..=hi) as i128);
            if k + 1 < terms {
                let i = self.rng.random_range(0..self.cfg.ops.len());
                ops.push(self.cfg.ops[i]);
            }
        }
        (nums, ops)
    }
}

struct Solved {
    steps: Vec<String>,
    value: i128,
    went_negative: bool,
}

/// Evaluates with `*` first (left to right), then `+`/`-` left to right, recording each step.
fn solve(nums: &[i128], ops: &[Op]) -> Solved {
    let mut steps = Vec::new();
    let mut terms: Vec<(Op, i128)> = Vec::new();
    let mut sign = Op::Add;
    let mut cur = nums[0];
    for (k, &op) in ops.iter().enumerate() {
        let next = nums[k + 1];
        match op {
            Op::Mul => {
                let v = cur * next;
                steps.push(format!("{cur}*{next}={v}"));
                cur = v;
            }
            Op::Add | Op::Sub => {
                terms.push((sign, cur));
                sign = op;
                cur = next;
            }
        }
    }
    terms.push((sign, cur));
    let mut acc = terms[0].1;
    let mut went_negative = acc < 0;
    for &(op, v) in &terms[1..] {
        let r = if op == Op::Add { acc + v } else { acc - v };
        steps.push(format!("{acc}{}{v}={r}", op.symbol()));
        went_negative |= r < 0;
        acc = r;
    }
    Solved {
        steps,
        value: acc,
        went_negative,
    }
}

fn render(nums: &[i128], ops: &[Op], solved: &Solved) -> Problem {
    let mut expr = nums[0].to_string();
    for (k, op) in ops.iter().enumerate() {
        expr.push(op.symbol());
        expr.push_str(&nums[k + 1].to_string());
    }
    let mut solution = String::new();
    for s in &solved.steps {
        solution.push(' ');
        solution.push_str(s);
        solution.push('.');
    }
    solution.push_str(&format!(" #### {}\n", solved.value));
    Problem {
        prompt: format!("Q: {expr}=?\nA:"),
        answer: solved.value.to_string(),
        solution,
    }
}
