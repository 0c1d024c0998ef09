//! Paired comparisons of greedy evaluations on the same held-out problems.
//!
//! Two accuracies measured on the same problems are strongly correlated, so the honest uncertainty of their
//! difference comes from the problems whose outcome changed: `fixed` (wrong before, right after) and
//! `broken` (right before, wrong after). The standard error is that of the mean per-problem difference, and
//! the p-value is McNemar's exact test (a two-sided binomial test of `fixed` against `fixed + broken` fair
//! coin flips), which stays valid when only a handful of problems changed.
//!
//! Over seeds evaluated on the same problems, the unit of replication is the problem, not the (seed,
//! problem) pair: the seeds of one arm share the problems' difficulty, and often one warm start, so their
//! outcomes on a problem are correlated. [`ClusteredMean`] and [`ArmComparison`] therefore average each
//! problem over seeds first and take the standard error over problems (the cluster-robust standard error
//! with problems as clusters of equal size). Pooling the seeds' outcomes as if independent understates the
//! error whenever a problem's outcome repeats across seeds, and pooling before/after pairs repeats the one
//! warm start's outcomes once per seed.

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
    /// `sqrt(problems)`); NaN for one problem, where it is undefined ([`se_text`] prints `n/a`).
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
            f64::NAN
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
            "{:.3} before RL -> {:.3} after RL on {} problems ({:+.3} ± {} paired SE; {} fixed, {} broken; \
             McNemar p {})",
            self.before,
            self.after,
            self.problems,
            self.diff(),
            se_text(self.diff_se),
            self.fixed,
            self.broken,
            match p_text(self.p_value, 2) {
                tiny if tiny.starts_with('<') => tiny,
                p => format!("= {p}"),
            }
        )
    }
}

/// Mean and sample standard error (Bessel-corrected standard deviation over `sqrt(n)`; NaN for one value,
/// where it is undefined: a 0 printed as `± 0.000` read as certainty).
fn mean_and_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, f64::NAN);
    }
    let ss: f64 = xs.iter().map(|x| (x - mean).powi(2)).sum();
    (mean, (ss / (n - 1.0) / n).sqrt())
}

/// Per-problem means over seeds of `outcomes[seed][problem]`; `None` when there are no seeds or problems or
/// the seeds do not cover the same number of problems.
fn per_problem_means(outcomes: &[Vec<bool>]) -> Option<Vec<f64>> {
    let n = outcomes.first()?.len();
    if n == 0 || outcomes.iter().any(|o| o.len() != n) {
        return None;
    }
    let seeds = outcomes.len() as f64;
    Some(
        (0..n)
            .map(|i| outcomes.iter().filter(|o| o[i]).count() as f64 / seeds)
            .collect(),
    )
}

/// The accuracy of one arm over its seeds, all evaluated on the same problems, with its standard error
/// clustered by problem.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusteredMean {
    pub problems: usize,
    pub seeds: usize,
    /// Mean over problems and seeds (= the mean of the seeds' accuracies).
    pub mean: f64,
    /// Problem-clustered standard error: the sample standard deviation over problems of the per-problem
    /// mean over seeds, over `sqrt(problems)`.
    pub se: f64,
    /// The naive standard error that treats all `seeds * problems` outcomes as independent (sample standard
    /// deviation of the pooled outcomes over `sqrt(seeds * problems)`), for comparison only.
    pub naive_se: f64,
}

impl ClusteredMean {
    /// `outcomes[seed][problem]`; `None` when empty or when the seeds cover different numbers of problems.
    pub fn new(outcomes: &[Vec<bool>]) -> Option<Self> {
        let means = per_problem_means(outcomes)?;
        let (mean, se) = mean_and_se(&means);
        let pooled: Vec<f64> = outcomes
            .iter()
            .flatten()
            .map(|&c| f64::from(u8::from(c)))
            .collect();
        Some(Self {
            problems: means.len(),
            seeds: outcomes.len(),
            mean,
            se,
            naive_se: mean_and_se(&pooled).1,
        })
    }
}

/// Two arms compared by their accuracy on the same problems, each problem averaged over the arm's seeds
/// first: `diff = mean_i (a_i - b_i)` with `a_i`, `b_i` the seed-averaged outcomes of problem `i`. This
/// compares where the arms end, not gains measured from different starting points.
#[derive(Debug, Clone, PartialEq)]
pub struct ArmComparison {
    pub problems: usize,
    pub seeds_a: usize,
    pub seeds_b: usize,
    pub acc_a: f64,
    pub acc_b: f64,
    /// Sample standard deviation over problems of `a_i - b_i`, over `sqrt(problems)`.
    pub diff_se: f64,
    /// Problems where `a_i > b_i`, and where `a_i < b_i`.
    pub a_better: usize,
    pub b_better: usize,
    /// Two-sided p-value of "the arms are equally accurate" ([`Self::test`] says which test).
    pub p_value: f64,
    pub test: PairedTest,
    /// Standard error of the difference from the seed-to-seed spread of the arms' accuracies (Welch:
    /// `sqrt(s_a^2 / n_a + s_b^2 / n_b)` over the seeds' accuracies on these problems); `None` unless both
    /// arms have two seeds or more. [`Self::diff_se`] treats the trained models as fixed (the problems are
    /// the only sample), this is the part another set of training seeds would add.
    pub seed_se: Option<f64>,
}

impl ArmComparison {
    /// `a[seed][problem]`, `b[seed][problem]` (the seed counts may differ); `None` unless every seed of both
    /// arms covers the same, non-zero number of problems.
    pub fn new(a: &[Vec<bool>], b: &[Vec<bool>]) -> Option<Self> {
        let (ma, mb) = (per_problem_means(a)?, per_problem_means(b)?);
        if ma.len() != mb.len() {
            return None;
        }
        let d: Vec<f64> = ma.iter().zip(&mb).map(|(x, y)| x - y).collect();
        let (mean_d, diff_se) = mean_and_se(&d);
        let a_better = d.iter().filter(|&&x| x > 0.0).count();
        let b_better = d.iter().filter(|&&x| x < 0.0).count();
        // One seed against one: McNemar's test on the binary outcomes. Several seeds on either side: the
        // t-test, unless it has nothing to go on ([`PairedTest::PairedT`] says why).
        let t_p = (a.len() > 1 || b.len() > 1)
            .then(|| paired_t_p(mean_d, diff_se, d.len()))
            .flatten();
        let (p_value, test) = match t_p {
            Some(p) => (p, PairedTest::PairedT),
            None => (mcnemar_exact(a_better, b_better), PairedTest::Sign),
        };
        Some(Self {
            problems: d.len(),
            seeds_a: a.len(),
            seeds_b: b.len(),
            acc_a: ma.iter().sum::<f64>() / ma.len() as f64,
            acc_b: mb.iter().sum::<f64>() / mb.len() as f64,
            diff_se,
            a_better,
            b_better,
            p_value,
            test,
            seed_se: welch_se(&seed_accuracies(a), &seed_accuracies(b)),
        })
    }

    /// [`Self::new`] for a B that is one fixed model rather than a sample of training seeds (the warm start
    /// every arm starts from): B has no seed spread by construction, so the seed part of the error is A's
    /// alone, `s_a / sqrt(n_a)`; `None` when B has several evaluations or under the conditions of `new`.
    pub fn against_fixed(a: &[Vec<bool>], b: &[Vec<bool>]) -> Option<Self> {
        if b.len() != 1 {
            return None;
        }
        let mut c = Self::new(a, b)?;
        c.seed_se = (a.len() >= 2).then(|| mean_and_se(&seed_accuracies(a)).1);
        Some(c)
    }

    /// `acc_a - acc_b`.
    pub fn diff(&self) -> f64 {
        self.acc_a - self.acc_b
    }

    /// Both sources together, `sqrt(diff_se^2 + seed_se^2)` (conservative: each seed's accuracy also
    /// carries some of the problems' sampling noise); `None` where [`Self::seed_se`] is.
    pub fn problems_and_seeds_se(&self) -> Option<f64> {
        self.seed_se.map(|s| self.diff_se.hypot(s))
    }

    /// `+0.020 ± 0.009 (11 vs 5 problems; p 2.1e-1)`: the difference with its SE over problems, the problems
    /// where each arm is ahead and the test's p-value (`t-test p` where either arm has several seeds).
    pub fn problems_text(&self) -> String {
        let test = match self.test {
            PairedTest::Sign => "",
            PairedTest::PairedT => "t-test ",
        };
        format!(
            "{} ± {} ({} vs {} problems; {test}p {})",
            signed3(self.diff()),
            se_text(self.diff_se),
            self.a_better,
            self.b_better,
            p_text(self.p_value, 1)
        )
    }

    /// `+0.020 ± 0.009 (3 vs 2 seeds; seeds alone ± 0.003)`: the difference with the SE over problems and
    /// seeds together ([`Self::problems_and_seeds_se`]); `None` unless both arms have two seeds or more.
    pub fn problems_and_seeds_text(&self) -> Option<String> {
        let (both, seeds) = self.problems_and_seeds_se().zip(self.seed_se)?;
        Some(format!(
            "{} ± {} ({} vs {} seeds; seeds alone ± {seeds:.3})",
            signed3(self.diff()),
            se_text(both),
            self.seeds_a,
            self.seeds_b
        ))
    }
}

/// The test behind [`ArmComparison::p_value`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairedTest {
    /// Exact two-sided sign test over the problems that differ ([`mcnemar_exact`] of the two counts): with
    /// one seed per arm, McNemar's test. Also what stands in for the t-test where the differences have no
    /// spread.
    Sign,
    /// Paired t-test on `a_i - b_i` (`n - 1` degrees of freedom), wherever an arm has several seeds. The
    /// sign test is valid there only if both arms' per-problem means are equally noisy, and they are not
    /// when the seed counts differ, nor when one arm's seeds barely differ (a shared warm start evaluated
    /// per seed, or an arm whose seeds all end at the same outcomes): the noisier side wins the signs on
    /// easy problems and loses them on hard ones even between equally good arms. Simulated at 193
    /// problems with per-problem success rates from Beta(3, 1), at the 5% level: 1 seed against 3, the
    /// sign test rejected 42% of the time; 3 identical seeds against 3 independent ones, 40-44%; the
    /// t-test 4-6% in both (`tests::several_seeds_keep_the_false_positive_rate`). Where the differences
    /// have no spread (all equal), the sign test stands in.
    PairedT,
}

/// Two-sided p-value of a paired t-test: `mean` of `n` differences with standard error `se`; `None` where
/// the test has nothing to go on (fewer than 2 differences, or all of them equal: no spread), for the
/// caller to fall back to the sign test (which gives 1 when they are all 0, and 2^(1-n) when all favour
/// one arm, where t would claim p = 0).
fn paired_t_p(mean: f64, se: f64, n: usize) -> Option<f64> {
    use statrs::distribution::{ContinuousCDF, StudentsT};
    // Equal differences that are not binary fractions (all 1/3) leave a rounding residue of ~1e-17, not 0.
    if n < 2 || se <= 1e-12 * mean.abs().max(1.0) {
        return None;
    }
    let t = StudentsT::new(0.0, 1.0, (n - 1) as f64).ok()?;
    Some((2.0 * t.sf((mean / se).abs())).min(1.0))
}

/// A standard error with 3 decimals, `n/a` where it is undefined (NaN: one problem).
pub fn se_text(se: f64) -> String {
    if se.is_nan() {
        "n/a".into()
    } else {
        format!("{se:.3}")
    }
}

/// A p-value in scientific notation with `digits` decimals (`2.1e-1`), and `< 1e-300` for those too small
/// for a double to hold (an exact 0 from the sign test's `2^-1075`, or the t-distribution's tail, read as
/// a certainty).
fn p_text(p: f64, digits: usize) -> String {
    if p < 1e-300 {
        "< 1e-300".into()
    } else {
        format!("{p:.digits$e}")
    }
}

/// `x` to 3 decimals with its sign, a value that rounds to zero as `+0.000` (a difference of two equal
/// accuracies summed in another order can be -6e-17).
fn signed3(x: f64) -> String {
    let x = if (x * 1000.0).round() == 0.0 { 0.0 } else { x };
    format!("{x:+.3}")
}

/// The fraction of `outcomes` that are right (0 for none): an evaluation's accuracy, as `qarl train`
/// logs it and every report and comparison reads it back.
pub fn accuracy(outcomes: &[bool]) -> f64 {
    outcomes.iter().filter(|&&c| c).count() as f64 / outcomes.len().max(1) as f64
}

/// Whether a recorded accuracy is the mean of the outcomes it was computed from (to rounding): a file
/// edited in one place and not the other fails it.
pub fn accuracy_agrees(recorded: f64, outcomes: &[bool]) -> bool {
    (recorded - accuracy(outcomes)).abs() <= 1e-9
}

/// Each seed's accuracy over its problems.
fn seed_accuracies(outcomes: &[Vec<bool>]) -> Vec<f64> {
    outcomes.iter().map(|o| accuracy(o)).collect()
}

/// Welch's standard error of `mean(a) - mean(b)` (sample variances); `None` unless both have 2 values or more.
fn welch_se(a: &[f64], b: &[f64]) -> Option<f64> {
    (a.len() >= 2 && b.len() >= 2).then(|| mean_and_se(a).1.hypot(mean_and_se(b).1))
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
    use rand::{Rng, SeedableRng};

    fn outcomes(rows: &[&[u8]]) -> Vec<Vec<bool>> {
        rows.iter()
            .map(|r| r.iter().map(|&x| x == 1).collect())
            .collect()
    }

    /// Arms with several seeds take the paired t-test (one seed each: McNemar's test), whose p-value
    /// here is scipy's `ttest_1samp(d, 0).pvalue` for d = [0.5, 1, -0.5, 0, 1]: 0.24198153056802096.
    /// One problem has no standard error (a sample deviation of one value is undefined): it prints as
    /// `n/a`, not as `± 0.000`, which read as certainty in end-of-run lines, comparisons and reports.
    #[test]
    fn one_problem_has_no_standard_error() {
        let p = PairedComparison::new(&[false], &[true]).unwrap();
        assert!(p.diff_se.is_nan());
        let text = p.to_string();
        assert!(
            text.contains("± n/a paired SE") && !text.contains("0.000 paired"),
            "{text}"
        );
        let c = ArmComparison::new(&[vec![true]], &[vec![false]]).unwrap();
        assert!(
            c.problems_text()
                .starts_with("+1.000 ± n/a (1 vs 0 problems"),
            "{}",
            c.problems_text()
        );
        let two =
            ArmComparison::new(&[vec![true], vec![true]], &[vec![false], vec![true]]).unwrap();
        assert!(
            two.problems_and_seeds_text().unwrap().contains("± n/a ("),
            "{:?}",
            two.problems_and_seeds_text()
        );
        assert!(ClusteredMean::new(&[vec![true], vec![false]])
            .unwrap()
            .se
            .is_nan());
        assert_eq!(se_text(0.0), "0.000");
    }

    #[test]
    fn the_test_follows_the_seed_counts() {
        let a = outcomes(&[&[1, 1, 0, 1, 1]]);
        let b = outcomes(&[&[1, 0, 0, 1, 0], &[0, 0, 1, 1, 0]]);
        let c = ArmComparison::new(&a, &b).unwrap();
        assert_eq!(c.test, PairedTest::PairedT);
        assert!(
            (c.p_value - 0.24198153056802096).abs() < 1e-12,
            "{}",
            c.p_value
        );
        assert!(
            c.problems_text().contains("t-test p 2.4e-1"),
            "{}",
            c.problems_text()
        );
        let same = ArmComparison::new(&a, &b[..1]).unwrap();
        assert_eq!(same.test, PairedTest::Sign);
        assert_eq!(same.p_value, mcnemar_exact(same.a_better, same.b_better));
        // A difference that rounds to zero (equal accuracies summed in another order give -6e-17) prints
        // as +0.000, never -0.000.
        assert_eq!(signed3(-5.6e-17), "+0.000");
        assert_eq!(signed3(-4e-4), "+0.000");
        assert_eq!(signed3(-6e-4), "-0.001");
        assert_eq!(paired_t_p(0.0, 0.0, 5), None);
        assert_eq!(paired_t_p(0.5, 0.0, 5), None);
        assert_eq!(paired_t_p(0.5, 0.1, 1), None);
        // Every problem won by A in every seed: no spread, so the sign test's 2 / 2^3, not t's p = 0.
        let all = outcomes(&[&[1, 1, 1]]);
        let none = outcomes(&[&[0, 0, 0], &[0, 0, 0]]);
        let c = ArmComparison::new(&all, &none).unwrap();
        assert!((c.p_value - 0.25).abs() < 1e-12, "{}", c.p_value);
        // ... and says so: the p-value is the sign test's, not a t-test's.
        assert_eq!(c.test, PairedTest::Sign);
        assert!(
            c.problems_text().ends_with("; p 2.5e-1)"),
            "{}",
            c.problems_text()
        );
        // Every difference 1/3 (one seed right on all 10 problems, three seeds right twice in three): no
        // spread either, though the mean of ten 1/3s leaves a rounding residue in the standard error.
        let all10 = outcomes(&[&[1; 10]]);
        let two_of_three = outcomes(&[&[1; 10], &[1; 10], &[0; 10]]);
        let c = ArmComparison::new(&all10, &two_of_three).unwrap();
        assert_eq!(c.test, PairedTest::Sign);
        assert!((c.p_value - 2.0 / 1024.0).abs() < 1e-15, "{}", c.p_value);
    }

    /// Under the null (both arms' models share each problem's success rate), 1 seed against 3, and 3
    /// identical seeds (one model evaluated thrice, or a shared warm start) against 3 independent ones:
    /// the comparison's test rejects at the 5% level about 5% of the time, where the sign test on the same
    /// differences would reject far more often (the reason several seeds take the t-test).
    #[test]
    fn several_seeds_keep_the_false_positive_rate() {
        false_positive_rates_of(|draw| (draw(1), draw(3)));
        false_positive_rates_of(|draw| {
            let one = draw(1);
            (vec![one[0].clone(); 3], draw(3))
        });
    }

    /// Asserts the t-test's false-positive rate near 5% and the sign test's far above it, for the arms
    /// `arms` draws from one set of per-problem success rates.
    fn false_positive_rates_of(
        arms: impl Fn(&mut dyn FnMut(usize) -> Vec<Vec<bool>>) -> (Vec<Vec<bool>>, Vec<Vec<bool>>),
    ) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (trials, problems) = (400, 193);
        let (mut t_rejects, mut sign_rejects) = (0, 0);
        for _ in 0..trials {
            // Beta(3, 1) success rates (mostly easy problems): the inverse of its CDF x^3.
            let rates: Vec<f64> = (0..problems).map(|_| rng.random::<f64>().cbrt()).collect();
            let mut draw = |seeds: usize| -> Vec<Vec<bool>> {
                (0..seeds)
                    .map(|_| rates.iter().map(|&p| rng.random::<f64>() < p).collect())
                    .collect()
            };
            let (a, b) = arms(&mut draw);
            let c = ArmComparison::new(&a, &b).unwrap();
            assert_eq!(c.test, PairedTest::PairedT);
            t_rejects += usize::from(c.p_value < 0.05);
            sign_rejects += usize::from(mcnemar_exact(c.a_better, c.b_better) < 0.05);
        }
        let (t_rate, sign_rate) = (
            t_rejects as f64 / trials as f64,
            sign_rejects as f64 / trials as f64,
        );
        assert!(
            (0.02..=0.09).contains(&t_rate),
            "t-test false positives {t_rate}"
        );
        assert!(
            sign_rate > 0.2,
            "the sign test's {sign_rate}: the case this guards against"
        );
    }

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

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn clustered_se_counts_problems_not_seed_problem_pairs() {
        // Three seeds that agree on every problem: the outcomes repeat, so there are 4 independent
        // observations, not 12. Per-problem means [1, 1, 0, 0], mean 0.5, sample variance 4 * 0.25 / 3:
        // SE = sqrt(1/3) / 2. Naive: 6 ones in 12, sample variance 12 * 0.25 / 11: SE = sqrt(3/11 / 12).
        let s = vec![true, true, false, false];
        let c = ClusteredMean::new(&[s.clone(), s.clone(), s]).unwrap();
        assert_eq!((c.problems, c.seeds), (4, 3));
        assert!(close(c.mean, 0.5));
        assert!(close(c.se, (1.0f64 / 3.0).sqrt() / 2.0), "{}", c.se);
        assert!(
            close(c.naive_se, (3.0f64 / 11.0 / 12.0).sqrt()),
            "{}",
            c.naive_se
        );
        assert!(c.se > 1.9 * c.naive_se);
        // Two seeds that disagree on every problem: each problem averages to 0.5, so the problems add no
        // uncertainty (SE 0), where the naive SE is sqrt(8 * 0.25 / 7 / 8).
        let c = ClusteredMean::new(&[
            vec![true, false, true, false],
            vec![false, true, false, true],
        ])
        .unwrap();
        assert!(close(c.mean, 0.5) && c.se == 0.0);
        assert!(close(c.naive_se, (2.0f64 / 7.0 / 8.0).sqrt()));
        // One seed: clustered and naive agree.
        let one = ClusteredMean::new(&[vec![true, true, true, false, false]]).unwrap();
        assert!(close(one.se, one.naive_se));
        assert!(ClusteredMean::new(&[vec![true], vec![true, false]]).is_none());
        assert!(ClusteredMean::new(&[]).is_none());
        assert!(ClusteredMean::new(&[vec![]]).is_none());
    }

    #[test]
    fn arms_are_compared_by_seed_averaged_final_accuracy_per_problem() {
        // A (2 seeds): [1,1,0,0,1] and [1,0,0,0,1] -> per problem [1, .5, 0, 0, 1], acc 0.5.
        // B (1 seed):  [1,0,0,0,0]                 -> acc 0.2.
        // d = [0, .5, 0, 0, 1], mean 0.3, deviations [-.3, .2, -.3, -.3, .7], sum of squares 0.8:
        // SE = sqrt(0.8 / 4 / 5) = 0.2. A better on 2 problems, B on none. The seed counts differ, so the
        // p-value is the paired t-test's: t = 0.3 / 0.2 = 1.5 on 4 degrees of freedom, p = 0.208 (scipy's
        // ttest_1samp; the sign test would give 2 / 2^2 = 0.5).
        let a = [
            vec![true, true, false, false, true],
            vec![true, false, false, false, true],
        ];
        let b = [vec![true, false, false, false, false]];
        let c = ArmComparison::new(&a, &b).unwrap();
        assert_eq!((c.problems, c.seeds_a, c.seeds_b), (5, 2, 1));
        assert!(close(c.acc_a, 0.5) && close(c.acc_b, 0.2) && close(c.diff(), 0.3));
        assert!(close(c.diff_se, 0.2), "{}", c.diff_se);
        assert_eq!((c.a_better, c.b_better), (2, 0));
        assert_eq!(c.test, PairedTest::PairedT);
        assert!((c.p_value - 0.208).abs() < 1e-9, "{}", c.p_value);
        // Antisymmetric.
        let r = ArmComparison::new(&b, &a).unwrap();
        assert!(close(r.diff(), -0.3) && close(r.diff_se, 0.2));
        assert_eq!((r.a_better, r.b_better), (0, 2));
        assert!(ArmComparison::new(&a, &[vec![true; 4]]).is_none());
        // B has one seed: no seed-to-seed spread to measure.
        assert_eq!(c.seed_se, None);
        assert_eq!(c.problems_and_seeds_se(), None);
    }

    #[test]
    fn seed_spread_is_welch_over_the_seeds_accuracies() {
        // A's seeds: 3/4 and 1/4 right (mean 0.5, sample variance 0.125); B's: 2/4 and 2/4 (variance 0).
        // Welch: sqrt(0.125 / 2 + 0 / 2) = 0.25.
        let a = [
            vec![true, true, false, true],
            vec![true, false, false, false],
        ];
        let b = [
            vec![true, false, true, false],
            vec![false, true, false, true],
        ];
        let c = ArmComparison::new(&a, &b).unwrap();
        assert!(close(c.seed_se.unwrap(), 0.25), "{:?}", c.seed_se);
        // d = [1 - .5, .5 - .5, 0 - .5, .5 - .5] = [.5, 0, -.5, 0], mean 0, sum of squares 0.5:
        // diff_se = sqrt(0.5 / 3 / 4); together sqrt(0.5 / 12 + 0.0625).
        assert!(close(c.diff(), 0.0));
        assert!(close(c.diff_se, (0.5f64 / 12.0).sqrt()));
        assert!(close(
            c.problems_and_seeds_se().unwrap(),
            (0.5f64 / 12.0 + 0.0625).sqrt()
        ));
    }

    #[test]
    fn comparison_texts_need_two_seeds_per_arm_for_the_seed_spread() {
        let a = vec![vec![true, true], vec![true, false]];
        let b = vec![vec![false, false], vec![false, true]];
        // d = [1, 0], diff 0.5, SE over problems sqrt(0.5 / 2) = 0.5; seeds: accuracies [1, .5] and [0, .5],
        // Welch sqrt(0.125 / 2 + 0.125 / 2) = 0.354; together sqrt(0.25 + 0.125) = 0.612. A is ahead on
        // problem 0 only; two seeds per arm take the t-test: t = 1 on 1 degree of freedom, p = 0.5.
        let c = ArmComparison::new(&a, &b).unwrap();
        assert_eq!(
            c.problems_text(),
            "+0.500 ± 0.500 (1 vs 0 problems; t-test p 5.0e-1)"
        );
        assert_eq!(
            c.problems_and_seeds_text().as_deref(),
            Some("+0.500 ± 0.612 (2 vs 2 seeds; seeds alone ± 0.354)")
        );
        let one_seed = ArmComparison::new(&a, &b[..1]).unwrap();
        assert_eq!(one_seed.problems_and_seeds_text(), None);
        // B one fixed model: A's seeds alone, sqrt(0.125 / 2) = 0.25; d = [1, .5], SE over problems 0.25;
        // together sqrt(0.0625 + 0.0625) = 0.354.
        let fixed = ArmComparison::against_fixed(&a, &b[..1]).unwrap();
        assert_eq!(
            fixed.problems_and_seeds_text().as_deref(),
            Some("+0.750 ± 0.354 (2 vs 1 seeds; seeds alone ± 0.250)")
        );
        assert_eq!(ArmComparison::against_fixed(&a, &b), None);
    }

    #[test]
    fn one_seed_per_arm_is_the_before_after_paired_comparison() {
        let before = [
            true, true, true, true, true, true, false, false, false, false,
        ];
        let after = [
            true, true, true, true, true, false, true, true, false, false,
        ];
        let p = PairedComparison::new(&before, &after).unwrap();
        let c = ArmComparison::new(&[after.to_vec()], &[before.to_vec()]).unwrap();
        assert!(close(c.diff(), p.diff()) && close(c.diff_se, p.diff_se));
        assert_eq!((c.a_better, c.b_better), (p.fixed, p.broken));
        assert!(close(c.p_value, p.p_value));
    }

    #[test]
    fn a_shared_warm_start_pooled_over_seeds_overstates_significance() {
        // One warm start (before) and three seeds that end identically: the gain rests on one problem.
        // Pooled as 18 independent pairs (the old report): d has 3 ones, mean 1/6, SE = sqrt((3 - 18/36) /
        // 17 / 18). Clustered: per-problem d = [1, 0, 0, 0, 0, 0], SE = sqrt((1 - 6/36) / 5 / 6) = 1/6.
        let before = vec![false, false, false, false, true, true];
        let after = vec![true, false, false, false, true, true];
        let (mut pb, mut pa) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            pb.extend(before.clone());
            pa.extend(after.clone());
        }
        let pooled = PairedComparison::new(&pb, &pa).unwrap();
        assert!(close(pooled.diff_se, (2.5f64 / 17.0 / 18.0).sqrt()));
        let clustered = ArmComparison::new(
            &[after.clone(), after.clone(), after],
            &[before.clone(), before.clone(), before],
        )
        .unwrap();
        assert!(close(clustered.diff(), 1.0 / 6.0));
        assert!(close(clustered.diff_se, 1.0 / 6.0), "{}", clustered.diff_se);
        assert!(clustered.diff_se > 1.8 * pooled.diff_se);
        // One problem changed: the t-test on it, t = 1 on 5 degrees of freedom, p = 0.363 (scipy's
        // ttest_1samp); the pooled McNemar sees 3 (p = 0.25).
        assert!((clustered.p_value - 0.3632174676491228).abs() < 1e-9);
        assert!(close(pooled.p_value, 0.25));
    }

    #[test]
    fn outcomes_round_trip_through_the_metrics_string() {
        let v = [true, false, false, true];
        assert_eq!(encode(&v), "1001");
        assert_eq!(decode("1001").unwrap(), v);
        assert!(decode("10x1").is_none());
    }
}
