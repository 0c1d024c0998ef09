//! Paired comparison of two greedy evaluations on the same held-out problems (before and after RL).
//!
//! Two accuracies measured on the same problems are strongly correlated, so the honest uncertainty of their
//! difference comes from the problems whose outcome changed: `fixed` (wrong before, right after) and
//! `broken` (right before, wrong after). The standard error is that of the mean per-problem difference, and
//! the p-value is McNemar's exact test (a two-sided binomial test of `fixed` against `fixed + broken` fair
//! coin flips), which stays valid when only a handful of problems changed.

use std::fmt;

/// Before/after accuracy on the same problems, with the paired statistics of the difference.
#[derive(Debug, Clone, PartialEq)]
pub struct PairedComparison {
    pub problems: usize,
    pub before: f64,
    pub after: f64,
    /// Wrong before, right after.
    pub fixed: usize,
    /// Right before, wrong after.
    pub broken: usize,
    /// Standard error of `after - before` (sample standard deviation of the per-problem difference over
    /// `sqrt(problems)`).
    pub diff_se: f64,
    /// McNemar's exact two-sided p-value for "RL changed nothing".
    pub p_value: f64,
}

impl PairedComparison {
    /// `None` when the two evaluations are not over the same (non-empty) list of problems.
    pub fn new(before: &[bool], after: &[bool]) -> Option<Self> {
        let n = before.len();
        if n == 0 || after.len() != n {
            return None;
        }
        let count = |v: &[bool]| v.iter().filter(|&&c| c).count();
        let fixed = before
            .iter()
            .zip(after)
            .filter(|(b, a)| !**b && **a)
            .count();
        let broken = before
            .iter()
            .zip(after)
            .filter(|(b, a)| **b && !**a)
            .count();
        let nf = n as f64;
        let mean = (fixed as f64 - broken as f64) / nf;
        let diff_se = if n > 1 {
            let ss = (fixed + broken) as f64 - nf * mean * mean;
            (ss.max(0.0) / (nf - 1.0) / nf).sqrt()
        } else {
            0.0
        };
        Some(Self {
            problems: n,
            before: count(before) as f64 / nf,
            after: count(after) as f64 / nf,
            fixed,
            broken,
            diff_se,
            p_value: mcnemar_exact(fixed, broken),
        })
    }

    pub fn diff(&self) -> f64 {
        self.after - self.before
    }
}

impl fmt::Display for PairedComparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.3} before RL -> {:.3} after RL on {} problems ({:+.3} ± {:.3} paired SE; {} fixed, {} broken; \
             McNemar p = {:.2e})",
            self.before,
            self.after,
            self.problems,
            self.diff(),
            self.diff_se,
            self.fixed,
            self.broken,
            self.p_value
        )
    }
}

/// Two-sided exact McNemar p-value: `min(1, 2 P(X <= min(b, c)))` with `X ~ Binomial(b + c, 1/2)`.
pub fn mcnemar_exact(b: usize, c: usize) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    // ln C(n, i) built up term by term, each binomial term exp(ln C - n ln 2); no factorial overflows.
    let ln_half_n = n as f64 * std::f64::consts::LN_2;
    let mut ln_choose = 0.0f64;
    let mut tail = 0.0f64;
    for i in 0..=k {
        if i > 0 {
            ln_choose += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (ln_choose - ln_half_n).exp();
    }
    (2.0 * tail).min(1.0)
}

/// Per-problem outcomes as a compact `0`/`1` string, kept in the metrics log so a resumed run can still
/// pair its final evaluation with the one before RL.
pub fn encode(correct: &[bool]) -> String {
    correct.iter().map(|&c| if c { '1' } else { '0' }).collect()
}

/// The inverse of [`encode`]; `None` on any other character.
pub fn decode(s: &str) -> Option<Vec<bool>> {
    s.chars()
        .map(|c| match c {
            '1' => Some(true),
            '0' => Some(false),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcnemar_matches_hand_computed_binomial_tails() {
        // 8 fixed, 1 broken: 2 * (C(9,0) + C(9,1)) / 2^9 = 20 / 512.
        assert!((mcnemar_exact(8, 1) - 20.0 / 512.0).abs() < 1e-15);
        assert!((mcnemar_exact(1, 8) - 20.0 / 512.0).abs() < 1e-15);
        // 5 and 0: 2 / 32.
        assert!((mcnemar_exact(5, 0) - 2.0 / 32.0).abs() < 1e-15);
        assert_eq!(mcnemar_exact(3, 3), 1.0);
        assert_eq!(mcnemar_exact(0, 0), 1.0);
        // Large counts stay finite and tiny: 300 vs 200 is about 8e-6 (normal approximation z = 4.43).
        let p = mcnemar_exact(300, 200);
        assert!(p > 1e-6 && p < 2e-5, "{p}");
    }

    #[test]
    fn paired_statistics_match_hand_computation() {
        // 10 problems: 6 right before; after, 2 of the wrong ones are fixed and 1 right one broken.
        let before = [
            true, true, true, true, true, true, false, false, false, false,
        ];
        let after = [
            true, true, true, true, true, false, true, true, false, false,
        ];
        let p = PairedComparison::new(&before, &after).unwrap();
        assert_eq!((p.fixed, p.broken), (2, 1));
        assert!((p.before - 0.6).abs() < 1e-12 && (p.after - 0.7).abs() < 1e-12);
        // d = [0,0,0,0,0,-1,1,1,0,0], mean 0.1, sum of squares about the mean 3 - 10 * 0.01 = 2.9.
        let se = (2.9f64 / 9.0 / 10.0).sqrt();
        assert!((p.diff_se - se).abs() < 1e-12, "{} vs {se}", p.diff_se);
        assert!((p.p_value - 1.0).abs() < 1e-12);
        assert!(PairedComparison::new(&before, &after[..9]).is_none());
        assert!(PairedComparison::new(&[], &[]).is_none());
    }

    #[test]
    fn outcomes_round_trip_through_the_metrics_string() {
        let v = [true, false, false, true];
        assert_eq!(encode(&v), "1001");
        assert_eq!(decode("1001").unwrap(), v);
        assert!(decode("10x1").is_none());
    }
}
