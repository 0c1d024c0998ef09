//! The policy objectives, corrections, aggregations and KL of `qarl::rl::losses` against (a) numbers worked out
//! by hand from docs/objectives.md and (b) an independent f64 re-implementation of the same formulas, written
//! here from the paper's notation, whose central finite differences check the autodiff gradients.
//!
//! Every batch uses ratios on both sides of every band and both signs of advantage; band edges are kept well
//! away from the inputs so that finite differences never straddle a kink.

use burn::tensor::{Device, Tensor};
use qarl::host::{tensor_from_vec, to_f32_vec};
use qarl::rl::corrections::{mismatch_correction, CorrectionConfig, Rejected};
use qarl::rl::losses::{
    registered_names, LossAggMode, LossConfig, Objective, ObjectiveName, ParamKind, ParamSpec,
    ParamValue, PolicyLoss, PolicyLossInputs, PolicyLossOutput, Range, SeqClip, TokenClip,
    TrustBand, COMMON_FIELDS, REGISTRY,
};
use qarl::rl::RlError;

// ---------------------------------------------------------------------------------------------------------
// Batches and running the burn implementation

/// A `[b, t]` batch in f64, holding values that are exactly representable in f32 (what burn sees).
#[derive(Debug, Clone)]
struct Batch {
    b: usize,
    t: usize,
    lp_theta: Vec<f64>,
    lp_old: Vec<f64>,
    lp_roll: Vec<f64>,
    mask: Vec<f64>,
    adv: Vec<f64>,
    lp_ref: Option<Vec<f64>>,
}

fn f32_exact(v: Vec<f64>) -> Vec<f64> {
    v.into_iter().map(|x| f64::from(x as f32)).collect()
}

impl Batch {
    fn new(b: usize, t: usize) -> Self {
        Self {
            b,
            t,
            lp_theta: vec![-1.0; b * t],
            lp_old: vec![-1.0; b * t],
            lp_roll: vec![-1.0; b * t],
            mask: vec![1.0; b * t],
            adv: vec![1.0; b],
            lp_ref: None,
        }
    }

    /// Rounds every value to f32 so that the f64 reference sees what burn sees.
    fn rounded(mut self) -> Self {
        self.lp_theta = f32_exact(self.lp_theta);
        self.lp_old = f32_exact(self.lp_old);
        self.lp_roll = f32_exact(self.lp_roll);
        self.adv = f32_exact(self.adv);
        self.lp_ref = self.lp_ref.map(f32_exact);
        self
    }

    fn lengths(mut self, lengths: &[usize]) -> Self {
        for (row, &len) in lengths.iter().enumerate() {
            for j in 0..self.t {
                self.mask[row * self.t + j] = if j < len { 1.0 } else { 0.0 };
            }
        }
        self
    }
}

fn ad_device() -> Device {
    Device::flex().autodiff()
}

fn tensor2(values: &[f64], b: usize, t: usize, device: &Device) -> Tensor<2> {
    tensor_from_vec(values.iter().map(|&x| x as f32).collect(), [b, t], device)
}

/// Runs `loss` on `batch`; returns the output and d loss / d lp_theta.
fn run(loss: &PolicyLoss, batch: &Batch) -> (PolicyLossOutput, Vec<f64>) {
    let device = ad_device();
    let (b, t) = (batch.b, batch.t);
    let lp_theta = tensor2(&batch.lp_theta, b, t, &device).require_grad();
    let inputs = PolicyLossInputs {
        lp_theta: lp_theta.clone(),
        lp_old: tensor2(&batch.lp_old, b, t, &device),
        lp_roll: tensor2(&batch.lp_roll, b, t, &device),
        mask: tensor2(&batch.mask, b, t, &device),
        advantages: tensor_from_vec(batch.adv.iter().map(|&x| x as f32).collect(), [b], &device),
        lp_ref: batch.lp_ref.as_ref().map(|v| tensor2(v, b, t, &device)),
    };
    let out = loss.compute(inputs).expect("loss computes");
    let grads = out.loss.clone().backward();
    let grad = lp_theta.grad(&grads).expect("lp_theta has a gradient");
    let grad = to_f32_vec(grad).into_iter().map(f64::from).collect();
    (out, grad)
}

fn loss_value(out: &PolicyLossOutput) -> f64 {
    f64::from(to_f32_vec(out.loss.clone())[0])
}

fn assert_close(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: got {got}, want {want} (tol {tol})"
    );
}

fn assert_all_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: got {g}, want {w} (tol {tol})\n got  {got:?}\n want {want:?}"
        );
    }
}

fn token_clip(eps_low: f32, eps_high: f32, dual_clip_c: Option<f32>) -> TokenClip {
    TokenClip {
        eps_low,
        eps_high,
        dual_clip_c,
    }
}

// ---------------------------------------------------------------------------------------------------------
// Independent f64 reference (docs/objectives.md)

#[derive(Debug, Clone, Copy)]
enum RefObjective {
    Ppo {
        lo: f64,
        hi: f64,
        c: Option<f64>,
    },
    Gspo {
        lo: f64,
        hi: f64,
    },
    Cispo {
        lo: f64,
        hi: f64,
    },
    Tbpo {
        lo: f64,
        hi: f64,
        lo_neg: f64,
        hi_neg: f64,
        cap: f64,
        two_sided: bool,
        drop: bool,
    },
    PositiveOnly {
        lo: f64,
        hi: f64,
    },
}

#[derive(Debug, Clone, Copy)]
enum RefAgg {
    TokenMean,
    SeqMeanTokenMean,
    SeqMeanTokenSum(f64),
}

#[derive(Debug, Clone, Copy)]
enum RefCorrection {
    TokenTis(f64),
    SeqTis(f64),
    TokenMis {
        low: f64,
        high: f64,
        weighted: bool,
        zero_weight: bool,
    },
    SeqMis {
        cap: f64,
        weighted: bool,
        zero_weight: bool,
    },
    GeoRs {
        low: f64,
        high: f64,
        zero_weight: bool,
    },
}

fn clip(x: f64, lo: f64, hi: f64) -> f64 {
    x.max(lo).min(hi)
}

/// Per-token (weight, keep) of a list of corrections, each computed on the original mask.
fn ref_corrections(batch: &Batch, corrections: &[RefCorrection]) -> (Vec<f64>, Vec<f64>) {
    let (b, t) = (batch.b, batch.t);
    let mut weight = vec![1.0; b * t];
    let mut keep = vec![1.0; b * t];
    let log_rho = |i: usize| batch.lp_old[i] - batch.lp_roll[i];
    for c in corrections {
        for row in 0..b {
            let idx: Vec<usize> = (row * t..(row + 1) * t)
                .filter(|&i| batch.mask[i] > 0.5)
                .collect();
            let sum: f64 = idx.iter().map(|&i| log_rho(i)).sum();
            let n = idx.len().max(1) as f64;
            for i in row * t..(row + 1) * t {
                let rho = log_rho(i).exp();
                match *c {
                    RefCorrection::TokenTis(cap) => weight[i] *= rho.min(cap),
                    RefCorrection::SeqTis(cap) => weight[i] *= sum.exp().min(cap),
                    RefCorrection::TokenMis {
                        low,
                        high,
                        weighted,
                        zero_weight,
                    } => {
                        if !(low..=high).contains(&rho) {
                            if zero_weight {
                                weight[i] = 0.0;
                            } else {
                                keep[i] = 0.0;
                            }
                        }
                        if weighted {
                            weight[i] *= rho;
                        }
                    }
                    RefCorrection::SeqMis {
                        cap,
                        weighted,
                        zero_weight,
                    } => {
                        if sum.exp() > cap {
                            if zero_weight {
                                weight[i] = 0.0;
                            } else {
                                keep[i] = 0.0;
                            }
                        }
                        if weighted {
                            weight[i] *= sum.exp();
                        }
                    }
                    RefCorrection::GeoRs {
                        low,
                        high,
                        zero_weight,
                    } => {
                        if !(low..=high).contains(&(sum / n).exp()) {
                            if zero_weight {
                                weight[i] = 0.0;
                            } else {
                                keep[i] = 0.0;
                            }
                        }
                    }
                }
            }
        }
    }
    (weight, keep)
}

/// The loss as a function of `theta` (the CISPO weights are taken at `theta_sg`, they are stop-gradient; so is
/// the sequence ratio of GSPO, TBPO and positive-only, which each token carries times its own ratio change,
/// verl's per-token form: a per-token correction weight then scales that token's gradient alone).
fn ref_loss(
    batch: &Batch,
    theta: &[f64],
    theta_sg: &[f64],
    objective: RefObjective,
    agg: RefAgg,
    corrections: &[RefCorrection],
    kl_coef: f64,
) -> f64 {
    let (b, t) = (batch.b, batch.t);
    let (corr_weight, keep) = ref_corrections(batch, corrections);
    let mut mask: Vec<f64> = (0..b * t).map(|i| batch.mask[i] * keep[i]).collect();
    let mut per_token = vec![0.0; b * t];
    for row in 0..b {
        let a = batch.adv[row];
        let idx: Vec<usize> = (row * t..(row + 1) * t)
            .filter(|&i| mask[i] > 0.5)
            .collect();
        let n = idx.len().max(1) as f64;
        // The sequence ratio in verl's per-token form: `s_i` at `theta_sg`, times token i's own ratio change.
        let s_sg = (idx
            .iter()
            .map(|&i| theta_sg[i] - batch.lp_old[i])
            .sum::<f64>()
            / n)
            .exp();
        let mismatch = (idx
            .iter()
            .map(|&i| batch.lp_old[i] - batch.lp_roll[i])
            .sum::<f64>()
            / n)
            .exp();
        for i in row * t..(row + 1) * t {
            let r = (theta[i] - batch.lp_old[i]).exp();
            let s = s_sg * (theta[i] - theta_sg[i]).exp();
            per_token[i] = match objective {
                RefObjective::Ppo { lo, hi, c } => {
                    let mut obj = (r * a).min(clip(r, lo, hi) * a);
                    if let (Some(c), true) = (c, a < 0.0) {
                        obj = obj.max(c * a);
                    }
                    -obj
                }
                RefObjective::Gspo { lo, hi } => -(s * a).min(clip(s, lo, hi) * a),
                RefObjective::Cispo { lo, hi } => {
                    let w = clip((theta_sg[i] - batch.lp_old[i]).exp(), lo, hi);
                    -w * a * theta[i]
                }
                RefObjective::Tbpo {
                    lo,
                    hi,
                    lo_neg,
                    hi_neg,
                    cap,
                    two_sided,
                    drop,
                } => {
                    let l = if a >= 0.0 {
                        (s * a).min(clip(s, lo, hi) * a)
                    } else {
                        clip(s, lo_neg, hi_neg) * a
                    };
                    let w = if two_sided {
                        clip(mismatch, 1.0 / cap, cap)
                    } else {
                        mismatch.min(cap)
                    };
                    if drop && !(1.0 / cap..=cap).contains(&mismatch) {
                        mask[i] = 0.0;
                    }
                    -w * l
                }
                RefObjective::PositiveOnly { lo, hi } if a > 0.0 => {
                    -(s * a).min(clip(s, lo, hi) * a)
                }
                RefObjective::PositiveOnly { .. } => 0.0,
            } * corr_weight[i];
        }
    }
    let aggregate = |values: &[f64]| -> f64 {
        let rows: Vec<(f64, f64)> = (0..b)
            .map(|row| {
                let idx = row * t..(row + 1) * t;
                let sum: f64 = idx.clone().map(|i| values[i] * mask[i]).sum();
                let n: f64 = idx.map(|i| mask[i]).sum();
                (sum, n)
            })
            .collect();
        let valid: Vec<&(f64, f64)> = rows.iter().filter(|(_, n)| *n > 0.0).collect();
        let seq_mean = |f: &dyn Fn(&(f64, f64)) -> f64| {
            valid.iter().map(|r| f(r)).sum::<f64>() / (valid.len().max(1) as f64)
        };
        match agg {
            RefAgg::TokenMean => {
                rows.iter().map(|r| r.0).sum::<f64>()
                    / rows.iter().map(|r| r.1).sum::<f64>().max(1.0)
            }
            RefAgg::SeqMeanTokenMean => seq_mean(&|(s, n)| s / n),
            RefAgg::SeqMeanTokenSum(d) => seq_mean(&|(s, _)| s / d),
        }
    };
    let mut loss = aggregate(&per_token);
    if kl_coef > 0.0 {
        let lp_ref = batch.lp_ref.as_ref().expect("lp_ref");
        let k3: Vec<f64> = (0..b * t)
            .map(|i| {
                let x = lp_ref[i] - theta[i];
                x.exp() - x - 1.0
            })
            .collect();
        loss += kl_coef * aggregate(&k3);
    }
    loss
}

/// Central differences of the reference loss in each response position of lp_theta.
fn ref_grad(
    batch: &Batch,
    objective: RefObjective,
    agg: RefAgg,
    corrections: &[RefCorrection],
    kl_coef: f64,
) -> Vec<f64> {
    let h = 1e-6;
    (0..batch.b * batch.t)
        .map(|i| {
            let mut plus = batch.lp_theta.clone();
            let mut minus = batch.lp_theta.clone();
            plus[i] += h;
            minus[i] -= h;
            let f = |theta: &[f64]| {
                ref_loss(
                    batch,
                    theta,
                    &batch.lp_theta,
                    objective,
                    agg,
                    corrections,
                    kl_coef,
                )
            };
            (f(&plus) - f(&minus)) / (2.0 * h)
        })
        .collect()
}

/// Checks the burn loss and its gradient against the reference.
fn check_against_reference(
    loss: &PolicyLoss,
    batch: &Batch,
    objective: RefObjective,
    agg: RefAgg,
    corrections: &[RefCorrection],
    what: &str,
) {
    let kl_coef = f64::from(loss.kl_coef);
    let (out, grad) = run(loss, batch);
    let want = ref_loss(
        batch,
        &batch.lp_theta,
        &batch.lp_theta,
        objective,
        agg,
        corrections,
        kl_coef,
    );
    assert_close(loss_value(&out), want, 2e-5, &format!("{what}: loss"));
    let want_grad = ref_grad(batch, objective, agg, corrections, kl_coef);
    assert_all_close(&grad, &want_grad, 2e-4, &format!("{what}: gradient"));
    // Guard against a vacuous check: some gradient must be non-zero.
    assert!(
        want_grad.iter().any(|g| g.abs() > 1e-3),
        "{what}: all-zero reference gradient"
    );
}

// A small deterministic generator (no test depends on a particular draw; they compare two computations).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }
}

/// Five rows of lengths 6, 4, 2, 0, 5 (one empty), mixed advantages, token ratios in roughly [0.55, 1.65]
/// kept at least 0.01 (in log) from the token band edges `1 - 0.2`, `1 + 0.2`, `1 + 0.28`, and a sampler that
/// disagrees by up to a factor e^0.9 per token.
fn token_level_batch(seed: u64) -> Batch {
    let mut rng = Lcg(seed);
    let (b, t) = (5, 6);
    let mut batch = Batch::new(b, t).lengths(&[6, 4, 2, 0, 5]);
    batch.adv = vec![1.3, -0.7, 0.4, 1.0, -1.5];
    let edges = [0.8f64.ln(), 1.2f64.ln(), 1.28f64.ln()];
    for i in 0..b * t {
        batch.lp_old[i] = rng.uniform(-3.0, -0.1);
        let mut log_r = rng.uniform(-0.6, 0.5);
        while edges.iter().any(|e| (log_r - e).abs() < 0.01) {
            log_r = rng.uniform(-0.6, 0.5);
        }
        batch.lp_theta[i] = batch.lp_old[i] + log_r;
        batch.lp_roll[i] = batch.lp_old[i] + rng.uniform(-0.9, 0.9);
    }
    batch.rounded()
}

/// Six sequences whose sequence ratios sit at chosen places relative to the sequence bands (3e-4 / 4e-4,
/// negative 3e-4 / 7e-4): inside all, above the positive band but inside the negative one, above both, below
/// both; advantages of both signs; and sampler log-probs that give mismatch weights on both sides of the cap.
fn sequence_level_batch(seed: u64) -> Batch {
    let mut rng = Lcg(seed);
    let (b, t) = (6, 5);
    let mut batch = Batch::new(b, t).lengths(&[5, 3, 4, 5, 2, 5]);
    // mean log-ratio per row, and its advantage
    let means = [1e-4, 5.5e-4, 1.2e-3, -8e-4, -1e-4, 5.5e-4];
    batch.adv = vec![0.9, 1.1, -0.6, -1.2, -0.8, -0.5];
    let mismatch = [0.05, -0.02, 1.0, -1.0, 0.0, 0.3]; // mean lp_old - lp_roll per row
    for row in 0..b {
        let len = batch.mask[row * t..(row + 1) * t]
            .iter()
            .filter(|&&m| m > 0.5)
            .count();
        let noise: Vec<f64> = (0..len).map(|_| rng.uniform(-3e-4, 3e-4)).collect();
        let noise_mean = noise.iter().sum::<f64>() / len as f64;
        for j in 0..t {
            let i = row * t + j;
            batch.lp_old[i] = rng.uniform(-2.5, -0.2);
            let d = noise.get(j).map_or(0.3, |n| means[row] + n - noise_mean);
            batch.lp_theta[i] = batch.lp_old[i] + d;
            batch.lp_roll[i] = batch.lp_old[i] - mismatch[row] + rng.uniform(-0.1, 0.1);
        }
    }
    batch.rounded()
}

// ---------------------------------------------------------------------------------------------------------
// Hand-computed values

/// Row 1 (A = +1, 3 response tokens): r = 1.1 (inside), 1.5 (above 1 + 0.28: clipped at 1.28), 0.7 (below
/// 1 - 0.2, but for A > 0 the min keeps 0.7: unclipped). Row 2 (A = -1, 4 tokens): r = 1.1 (inside), 1.5 (for
/// A < 0 the min keeps -1.5: unclipped), 0.7 (clipped at 0.8), 4.0 (unclipped -4, dual clip c = 3 floors it
/// at -3).
fn hand_ppo_batch() -> Batch {
    let mut batch = Batch::new(2, 4).lengths(&[3, 4]);
    batch.adv = vec![1.0, -1.0];
    let ratios = [1.1, 1.5, 0.7, 0.9, 1.1, 1.5, 0.7, 4.0];
    let old = [-0.5, -1.0, -2.0, -0.3, -1.5, -0.7, -0.2, -3.0];
    for i in 0..8 {
        batch.lp_old[i] = old[i];
        batch.lp_theta[i] = old[i] + f64::ln(ratios[i]);
        batch.lp_roll[i] = old[i];
    }
    batch.rounded()
}

#[test]
fn ppo_clip_matches_hand_values() {
    let batch = hand_ppo_batch();
    let clip = token_clip(0.2, 0.28, Some(3.0));
    // Per-token losses: row 1: -1.1, -1.28, -0.7; row 2: 1.1, 1.5, 0.8, 3.0.
    let (row1, row2) = (-1.1 - 1.28 - 0.7, 1.1 + 1.5 + 0.8 + 3.0);
    let cases = [
        (LossAggMode::TokenMean, 1.0, (row1 + row2) / 7.0),
        (
            LossAggMode::SeqMeanTokenMean,
            1.0,
            (row1 / 3.0 + row2 / 4.0) / 2.0,
        ),
        (
            LossAggMode::SeqMeanTokenSum,
            4.0,
            (row1 / 4.0 + row2 / 4.0) / 2.0,
        ),
    ];
    for (agg, divisor, want) in cases {
        let mut loss = PolicyLoss::new(Objective::ppo_clip(clip), agg);
        loss.agg_divisor = divisor;
        let (out, grad) = run(&loss, &batch);
        assert_close(loss_value(&out), want, 1e-5, &format!("{agg:?} loss"));
        // d(-A r)/d lp_theta = -A r where unclipped, 0 where clipped; then the aggregation's scale.
        let scale: [f64; 2] = match agg {
            LossAggMode::TokenMean => [1.0 / 7.0, 1.0 / 7.0],
            LossAggMode::SeqMeanTokenMean => [1.0 / 6.0, 1.0 / 8.0],
            LossAggMode::SeqMeanTokenSum => [1.0 / 8.0, 1.0 / 8.0],
        };
        let want_grad = [
            -1.1 * scale[0],
            0.0,
            -0.7 * scale[0],
            0.0,
            1.1 * scale[1],
            1.5 * scale[1],
            0.0,
            0.0,
        ];
        assert_all_close(&grad, &want_grad, 1e-5, &format!("{agg:?} grad"));
        assert_eq!(grad[1], 0.0, "clipped token has exactly no gradient");
        assert_eq!(grad[7], 0.0, "dual-clipped token has exactly no gradient");
        assert_close(out.metrics.pg_clipfrac, 2.0 / 7.0, 1e-6, "pg_clipfrac");
        assert_close(
            out.metrics.pg_clipfrac_lower,
            1.0 / 7.0,
            1e-6,
            "pg_clipfrac_lower",
        );
        assert_close(out.metrics.pg_loss, want, 1e-5, "pg_loss metric");
    }
    // Without the dual clip the r = 4 token is unbounded: loss 4, gradient 4 / 7.
    let loss = PolicyLoss::new(
        Objective::ppo_clip(token_clip(0.2, 0.28, None)),
        LossAggMode::TokenMean,
    );
    let (out, grad) = run(&loss, &batch);
    assert_close(
        loss_value(&out),
        (row1 + row2 - 3.0 + 4.0) / 7.0,
        1e-5,
        "no dual clip",
    );
    assert_close(grad[7], 4.0 / 7.0, 1e-5, "no dual clip grad");
    assert_eq!(out.metrics.pg_clipfrac_lower, 0.0);
}

#[test]
fn gspo_matches_hand_values() {
    // Row 1: A = +1, log-ratios 1e-3 and 2e-4: s = e^6e-4 > 1 + 4e-4, clipped: loss -(1 + 4e-4), no gradient.
    // Row 2: A = -1, log-ratios -1e-4 and 3e-4: s = e^1e-4, inside: loss s; d/d lp_t = s / 2 (mean over 2).
    let mut batch = Batch::new(2, 2);
    batch.adv = vec![1.0, -1.0];
    batch.lp_old = vec![-1.0, -2.0, -0.5, -1.5];
    let deltas = [1e-3, 2e-4, -1e-4, 3e-4];
    batch.lp_theta = (0..4).map(|i| batch.lp_old[i] + deltas[i]).collect();
    batch.lp_roll = batch.lp_old.clone();
    let batch = batch.rounded();
    let s2 = f64::exp(1e-4);
    let loss = PolicyLoss::new(
        Objective::gspo(SeqClip {
            eps_low: 3e-4,
            eps_high: 4e-4,
        }),
        LossAggMode::SeqMeanTokenMean,
    );
    let (out, grad) = run(&loss, &batch);
    assert_close(
        loss_value(&out),
        (-(1.0 + 4e-4) + s2) / 2.0,
        1e-6,
        "gspo loss",
    );
    assert_all_close(&grad, &[0.0, 0.0, s2 / 4.0, s2 / 4.0], 1e-5, "gspo grad");
    assert_close(
        out.metrics.pg_clipfrac,
        0.5,
        1e-6,
        "one of two sequences clipped",
    );
    assert_close(
        out.metrics.seq_ratio_mean,
        (f64::exp(6e-4) + s2) / 2.0,
        1e-6,
        "mean s_i",
    );
}

#[test]
fn cispo_matches_hand_values() {
    // A = 2; r = 1.5 (weight clipped to 1.2), 0.9 (inside): loss tokens -A w lp_theta = 2.4 and 3.6,
    // token-mean 3.0; gradient -A w / 2 = -1.2 and -0.9: the clipped token keeps its gradient.
    let mut batch = Batch::new(1, 2);
    batch.adv = vec![2.0];
    batch.lp_theta = vec![-1.0, -2.0];
    batch.lp_old = vec![-1.0 - f64::ln(1.5), -2.0 - f64::ln(0.9)];
    batch.lp_roll = batch.lp_old.clone();
    let batch = batch.rounded();
    let loss = PolicyLoss::new(
        Objective::cispo(token_clip(0.2, 0.2, None)),
        LossAggMode::TokenMean,
    );
    let (out, grad) = run(&loss, &batch);
    assert_close(loss_value(&out), 3.0, 1e-5, "cispo loss");
    assert_all_close(&grad, &[-1.2, -0.9], 1e-5, "cispo grad");
    assert_close(out.metrics.pg_clipfrac, 0.5, 1e-6, "cispo clipfrac");
}

/// TBPO with the paper's hyper-parameters on five 2-token sequences, `w_i = min(exp(mean(lp_old - lp_roll)), 2)`:
/// a: A = +1, s = e^1e-4 (inside), w = 1.5      -> -1.5 s, gradient -1.5 s / 2 / 5 per token
/// b: A = +1, s = e^1e-3 (above 1 + 4e-4), w = 2 (3 capped) -> -2 (1 + 4e-4), no gradient
/// c: A = -1, s = e^5e-4 (inside the negative band, 7e-4), w = 1 -> s, gradient s / 2 / 5
/// d: A = -1, s = e^-1e-3 (below 1 - 3e-4), w = 0.6 -> 0.6 (1 - 3e-4), exactly no gradient
/// e: A = -1, s = e^1e-3 (above 1 + 7e-4), w = 1    -> 1 + 7e-4, exactly no gradient
fn hand_tbpo_batch() -> Batch {
    let mut batch = Batch::new(5, 2);
    batch.adv = vec![1.0, 1.0, -1.0, -1.0, -1.0];
    let seq_log_ratio = [1e-4, 1e-3, 5e-4, -1e-3, 1e-3];
    let split = [3e-5, -2e-4, 1e-4, 5e-5, 0.0]; // token deviations around the mean, opposite on the two tokens
    let log_w = [f64::ln(1.5), f64::ln(3.0), 0.0, f64::ln(0.6), 0.0];
    for row in 0..5 {
        for j in 0..2 {
            let i = row * 2 + j;
            let sign = if j == 0 { 1.0 } else { -1.0 };
            batch.lp_old[i] = -0.25 - 0.5 * i as f64;
            batch.lp_theta[i] = batch.lp_old[i] + seq_log_ratio[row] + sign * split[row];
            batch.lp_roll[i] = batch.lp_old[i] - log_w[row] + sign * 0.01;
        }
    }
    batch.rounded()
}

#[test]
fn tbpo_matches_hand_values_and_negative_sequences_outside_the_band_get_exactly_no_gradient() {
    let batch = hand_tbpo_batch();
    let loss = PolicyLoss::new(
        Objective::tbpo(TrustBand::PAPER),
        LossAggMode::SeqMeanTokenMean,
    );
    let (out, grad) = run(&loss, &batch);
    let (sa, sc) = (f64::exp(1e-4), f64::exp(5e-4));
    let want = (-1.5 * sa - 2.0 * (1.0 + 4e-4) + sc + 0.6 * (1.0 - 3e-4) + (1.0 + 7e-4)) / 5.0;
    assert_close(loss_value(&out), want, 2e-6, "tbpo loss");
    let want_grad = [
        -1.5 * sa / 10.0,
        -1.5 * sa / 10.0,
        0.0,
        0.0,
        sc / 10.0,
        sc / 10.0,
        0.0,
        0.0,
        0.0,
        0.0,
    ];
    assert_all_close(&grad, &want_grad, 1e-5, "tbpo grad");
    // The must-hold property: exactly zero, not merely small, for negatives outside the band ...
    for g in &grad[6..10] {
        assert_eq!(*g, 0.0, "negative sequence outside the band: gradient {g}");
    }
    // ... and non-zero for the negative sequence inside it.
    assert!(
        grad[4] > 0.05 && grad[5] > 0.05,
        "inside the band: {grad:?}"
    );
    let m = &out.metrics;
    assert_close(m.pg_clipfrac, 3.0 / 5.0, 1e-6, "b, d, e are clipped");
    assert_close(
        m.pg_clipfrac_lower,
        2.0 / 5.0,
        1e-6,
        "d, e are negatives out of band",
    );
    assert_close(
        m.mismatch_weight_mean,
        (1.5 + 2.0 + 1.0 + 0.6 + 1.0) / 5.0,
        1e-5,
        "mean w_i",
    );
    let s_mean = [1e-4, 1e-3, 5e-4, -1e-3, 1e-3]
        .iter()
        .map(|x: &f64| x.exp())
        .sum::<f64>()
        / 5.0;
    assert_close(m.seq_ratio_mean, s_mean, 1e-6, "mean s_i");
}

#[test]
fn tbpo_mismatch_weight_options() {
    let batch = hand_tbpo_batch();
    // Two-sided with C = 1.5: a 1.5, b 1.5 (3 capped), c 1, d 1/1.5 (0.6 raised), e 1.
    let band = TrustBand {
        mismatch_cap: 1.5,
        two_sided: true,
        ..TrustBand::PAPER
    };
    let (out, _) = run(
        &PolicyLoss::new(Objective::tbpo(band), LossAggMode::SeqMeanTokenMean),
        &batch,
    );
    let (sa, sc) = (f64::exp(1e-4), f64::exp(5e-4));
    let want = (-1.5 * sa - 1.5 * (1.0 + 4e-4) + sc + (1.0 - 3e-4) / 1.5 + (1.0 + 7e-4)) / 5.0;
    assert_close(loss_value(&out), want, 2e-6, "two-sided weight");
    // Drop: with C = 2, b (ratio 3) and nothing else is outside [1/2, 2].
    let band = TrustBand {
        drop_outside_cap: true,
        ..TrustBand::PAPER
    };
    let (out, grad) = run(
        &PolicyLoss::new(Objective::tbpo(band), LossAggMode::SeqMeanTokenMean),
        &batch,
    );
    let want = (-1.5 * sa + sc + 0.6 * (1.0 - 3e-4) + (1.0 + 7e-4)) / 4.0;
    assert_close(loss_value(&out), want, 2e-6, "dropped sequence b");
    assert_close(grad[0], -1.5 * sa / 8.0, 1e-5, "denominator is 4 sequences");
    assert_close(
        out.metrics.loss_sequences,
        4.0,
        0.0,
        "sequences in the loss",
    );
}

// ---------------------------------------------------------------------------------------------------------
// The must-show: TBPO reduces to GSPO on positive sequences when lp_old == lp_roll

#[test]
fn tbpo_equals_gspo_on_positive_sequences_when_rollout_is_aligned() {
    let mut rng = Lcg(7);
    let (b, t) = (8, 12);
    let lengths = [12, 7, 3, 12, 1, 9, 5, 11];
    let mut batch = Batch::new(b, t).lengths(&lengths);
    batch.adv = (0..b).map(|_| rng.uniform(0.05, 2.0)).collect();
    for i in 0..b * t {
        batch.lp_old[i] = rng.uniform(-4.0, -0.05);
        // one optimizer step's worth of movement: |lp_theta - lp_old| <= 1e-4 per token
        batch.lp_theta[i] = batch.lp_old[i] + rng.uniform(-1e-4, 1e-4);
    }
    // ... except one sequence that moved further (6e-4 per token): both objectives must clip it the same way.
    for j in 0..t {
        batch.lp_theta[3 * t + j] = batch.lp_old[3 * t + j] + 6e-4;
    }
    batch.lp_roll = batch.lp_old.clone(); // QaRL: the rollout is the learner's own forward
    let batch = batch.rounded();

    let tbpo = LossConfig::new(ObjectiveName::new("tbpo").unwrap())
        .resolve()
        .unwrap(); // paper defaults
    assert_eq!(tbpo.objective, Objective::tbpo(TrustBand::PAPER));
    let gspo = LossConfig::new(ObjectiveName::new("gspo").unwrap())
        .resolve()
        .unwrap();
    assert_eq!(
        gspo.objective,
        Objective::gspo(SeqClip {
            eps_low: 3e-4,
            eps_high: 4e-4
        })
    );

    let (out_t, grad_t) = run(&tbpo, &batch);
    let (out_g, grad_g) = run(&gspo, &batch);
    let (lt, lg) = (loss_value(&out_t), loss_value(&out_g));
    println!("TBPO loss {lt:.9}, GSPO loss {lg:.9}");
    assert!(
        (lt - lg).abs() <= 1e-7 * lg.abs(),
        "losses differ: {lt} vs {lg}"
    );
    let max_diff = grad_t
        .iter()
        .zip(&grad_g)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let max_grad = grad_g.iter().fold(0.0f64, |m, g| m.max(g.abs()));
    println!("max |grad TBPO - grad GSPO| = {max_diff:.3e} (max |grad| {max_grad:.3e})");
    assert!(
        max_diff <= 1e-7 * max_grad,
        "gradients differ by {max_diff}"
    );
    assert!(max_grad > 1e-3, "a vacuous comparison");
    // The aligned rollout makes every mismatch weight exactly 1, and only the far-moved sequence is clipped.
    assert_eq!(out_t.metrics.mismatch_weight_mean, 1.0);
    assert_close(
        out_t.metrics.pg_clipfrac,
        1.0 / 8.0,
        1e-6,
        "TBPO clip fraction",
    );
    assert_close(
        out_g.metrics.pg_clipfrac,
        1.0 / 8.0,
        1e-6,
        "GSPO clip fraction",
    );
    assert!(
        grad_t[3 * t..4 * t].iter().all(|&g| g == 0.0),
        "the clipped sequence has no gradient"
    );
    // And the loss is that of the formula: mean_i -s_i A_i (with s_3 clipped at 1 + 4e-4).
    let want = ref_loss(
        &batch,
        &batch.lp_theta,
        &batch.lp_theta,
        RefObjective::Gspo {
            lo: 1.0 - 3e-4,
            hi: 1.0 + 4e-4,
        },
        RefAgg::SeqMeanTokenMean,
        &[],
        0.0,
    );
    assert_close(lt, want, 1e-6, "TBPO = GSPO = formula");
}

// ---------------------------------------------------------------------------------------------------------
// Finite differences against the reference, every objective and aggregation

fn all_aggs() -> [(LossAggMode, RefAgg, f32); 3] {
    [
        (LossAggMode::TokenMean, RefAgg::TokenMean, 1.0),
        (LossAggMode::SeqMeanTokenMean, RefAgg::SeqMeanTokenMean, 1.0),
        (
            LossAggMode::SeqMeanTokenSum,
            RefAgg::SeqMeanTokenSum(6.0),
            6.0,
        ),
    ]
}

#[test]
fn token_objectives_match_reference_and_finite_differences() {
    for seed in [1, 2] {
        let batch = token_level_batch(seed);
        for (agg, ref_agg, divisor) in all_aggs() {
            let cases = [
                (
                    Objective::ppo_clip(token_clip(0.2, 0.28, Some(3.0))),
                    RefObjective::Ppo {
                        lo: 0.8,
                        hi: 1.28,
                        c: Some(3.0),
                    },
                ),
                (
                    Objective::ppo_clip(token_clip(0.2, 0.2, None)),
                    RefObjective::Ppo {
                        lo: 0.8,
                        hi: 1.2,
                        c: None,
                    },
                ),
                (
                    Objective::cispo(token_clip(0.2, 0.28, None)),
                    RefObjective::Cispo { lo: 0.8, hi: 1.28 },
                ),
            ];
            for (objective, reference) in cases {
                let mut loss = PolicyLoss::new(objective.clone(), agg);
                loss.agg_divisor = divisor;
                let what = format!("seed {seed} {objective:?} {agg:?}");
                check_against_reference(&loss, &batch, reference, ref_agg, &[], &what);
            }
        }
    }
}

#[test]
fn sequence_objectives_match_reference_and_finite_differences() {
    let batch = sequence_level_batch(3);
    let band = TrustBand::PAPER;
    let tbpo_ref = |band: TrustBand| RefObjective::Tbpo {
        // The paper's lower clip of positive sequences, which TBPO leaves out: it never binds for A >= 0,
        // so the reference with it must give TBPO's loss and gradient.
        lo: 1.0 - 3e-4,
        hi: 1.0 + f64::from(band.eps_high),
        lo_neg: 1.0 - f64::from(band.eps_low_neg),
        hi_neg: 1.0 + f64::from(band.eps_high_neg),
        cap: f64::from(band.mismatch_cap),
        two_sided: band.two_sided,
        drop: band.drop_outside_cap,
    };
    for (agg, ref_agg, divisor) in all_aggs() {
        let cases = [
            (
                Objective::gspo(SeqClip {
                    eps_low: 3e-4,
                    eps_high: 4e-4,
                }),
                RefObjective::Gspo {
                    lo: 1.0 - 3e-4,
                    hi: 1.0 + 4e-4,
                },
            ),
            (Objective::tbpo(band), tbpo_ref(band)),
            (
                Objective::tbpo(TrustBand {
                    two_sided: true,
                    drop_outside_cap: true,
                    mismatch_cap: 1.5,
                    ..band
                }),
                tbpo_ref(TrustBand {
                    two_sided: true,
                    drop_outside_cap: true,
                    mismatch_cap: 1.5,
                    ..band
                }),
            ),
        ];
        for (objective, reference) in cases {
            let mut loss = PolicyLoss::new(objective.clone(), agg);
            loss.agg_divisor = divisor;
            check_against_reference(
                &loss,
                &batch,
                reference,
                ref_agg,
                &[],
                &format!("{objective:?} {agg:?}"),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Corrections

/// Reads a `[B, T]` tensor back as f64.
fn host(t: Tensor<2>) -> Vec<f64> {
    to_f32_vec(t).into_iter().map(f64::from).collect()
}

#[test]
fn corrections_match_hand_values() {
    let device = Device::flex();
    // Two rows of 4 tokens, the last token of row 2 is padding (with an infinite log-prob: must be ignored).
    // rho = pi_old / pi_roll: row 1: 0.55, 3, 6, 0.4; row 2: 1.25, 1.6, 1, (pad).
    let rho = [0.55, 3.0, 6.0, 0.4, 1.25, 1.6, 1.0, 1.0];
    let lp_old: Vec<f64> = (0..8).map(|i| -0.5 - 0.25 * i as f64).collect();
    let mut lp_roll: Vec<f64> = (0..8).map(|i| lp_old[i] - f64::ln(rho[i])).collect();
    lp_roll[7] = f64::NEG_INFINITY;
    let mask = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0];
    let apply = |configs: &[CorrectionConfig]| {
        let c = mismatch_correction(
            configs,
            tensor2(&lp_old, 2, 4, &device),
            tensor2(&lp_roll, 2, 4, &device),
            &tensor2(&mask, 2, 4, &device),
        );
        (host(c.weight), host(c.keep))
    };
    let ones = [1.0; 8];
    // Token TIS, C = 2: min(rho, 2).
    let (w, k) = apply(&[CorrectionConfig::TokenTis { cap: 2.0 }]);
    assert_all_close(
        &w[..7],
        &[0.55, 2.0, 2.0, 0.4, 1.25, 1.6, 1.0],
        1e-6,
        "token tis",
    );
    assert_eq!(k, ones);
    // Sequence TIS, C = 2.5: prod rho = 0.55 * 3 * 6 * 0.4 = 3.96 -> 2.5; 1.25 * 1.6 * 1 = 2 (the padding is not
    // in it).
    let (w, _) = apply(&[CorrectionConfig::SeqTis { cap: 2.5 }]);
    assert_all_close(
        &w[..7],
        &[2.5, 2.5, 2.5, 2.5, 2.0, 2.0, 2.0],
        1e-5,
        "seq tis",
    );
    // IcePop [0.5, 5]: drops 6 and 0.4; the kept tokens are weighted by rho.
    let (w, k) = apply(&[CorrectionConfig::TokenMis {
        low: 0.5,
        high: 5.0,
        importance_weight: true,
        rejected: Rejected::Dropped,
    }]);
    assert_eq!(&k[..7], &[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    assert_all_close(
        &[w[0], w[1], w[4], w[5]],
        &[0.55, 3.0, 1.25, 1.6],
        1e-5,
        "icepop weight",
    );
    let (w, _) = apply(&[CorrectionConfig::TokenMis {
        low: 0.5,
        high: 5.0,
        importance_weight: false,
        rejected: Rejected::Dropped,
    }]);
    assert_eq!(w, ones, "pure rejection has no weight");
    // verl's IcePop: the same band gives the rejected tokens weight 0 and keeps them in the loss mask.
    let (w, k) = apply(&[CorrectionConfig::TokenMis {
        low: 0.5,
        high: 5.0,
        importance_weight: true,
        rejected: Rejected::ZeroWeight,
    }]);
    assert_eq!(k, ones, "zero-weight rejection keeps every token");
    assert_all_close(
        &w[..7],
        &[0.55, 3.0, 0.0, 0.0, 1.25, 1.6, 1.0],
        1e-5,
        "icepop zero weight",
    );
    // Sequence MIS, C = 3: row 1 (3.96) dropped, row 2 (2.0) kept with weight 2.
    let (w, k) = apply(&[CorrectionConfig::SeqMis {
        cap: 3.0,
        importance_weight: true,
        rejected: Rejected::Dropped,
    }]);
    assert_eq!(&k[..7], &[0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    assert_all_close(&w[4..7], &[2.0, 2.0, 2.0], 1e-5, "seq mis weight");
    // The same with verl's zero weight: row 1 stays in the mask with weight 0.
    let (w, k) = apply(&[CorrectionConfig::SeqMis {
        cap: 3.0,
        importance_weight: true,
        rejected: Rejected::ZeroWeight,
    }]);
    assert_eq!(k, ones);
    assert_all_close(
        &w[..7],
        &[0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0],
        1e-5,
        "seq mis zero weight",
    );
    // Geo-RS [0.8, 1.3]: geometric means 3.96^(1/4) = 1.411 (dropped), 2^(1/3) = 1.26 (kept).
    let (w, k) = apply(&[CorrectionConfig::GeoRs {
        low: 0.8,
        high: 1.3,
        rejected: Rejected::Dropped,
    }]);
    assert_eq!(&k[..7], &[0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    assert_eq!(w, ones);
    let (w, k) = apply(&[CorrectionConfig::GeoRs {
        low: 0.8,
        high: 1.3,
        rejected: Rejected::ZeroWeight,
    }]);
    assert_eq!(k, ones);
    assert_eq!(&w[..7], &[0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    // Composition multiplies: token TIS (cap 2) then Geo-RS.
    let (w, k) = apply(&[
        CorrectionConfig::TokenTis { cap: 2.0 },
        CorrectionConfig::GeoRs {
            low: 0.8,
            high: 1.3,
            rejected: Rejected::Dropped,
        },
    ]);
    assert_all_close(&w[4..7], &[1.25, 1.6, 1.0], 1e-6, "composed weight");
    assert_eq!(&k[..4], &[0.0; 4]);
}

#[test]
fn corrections_compose_with_every_objective() {
    let token_batch = token_level_batch(11);
    let seq_batch = sequence_level_batch(12);
    let corrections: [(Vec<CorrectionConfig>, Vec<RefCorrection>); 8] = [
        (
            vec![CorrectionConfig::TokenTis { cap: 2.0 }],
            vec![RefCorrection::TokenTis(2.0)],
        ),
        (
            vec![CorrectionConfig::SeqTis { cap: 2.0 }],
            vec![RefCorrection::SeqTis(2.0)],
        ),
        (
            vec![CorrectionConfig::TokenMis {
                low: 0.5,
                high: 1.8,
                importance_weight: true,
                rejected: Rejected::Dropped,
            }],
            vec![RefCorrection::TokenMis {
                low: 0.5,
                high: 1.8,
                weighted: true,
                zero_weight: false,
            }],
        ),
        (
            vec![CorrectionConfig::TokenMis {
                low: 0.5,
                high: 1.8,
                importance_weight: true,
                rejected: Rejected::ZeroWeight,
            }],
            vec![RefCorrection::TokenMis {
                low: 0.5,
                high: 1.8,
                weighted: true,
                zero_weight: true,
            }],
        ),
        (
            vec![CorrectionConfig::SeqMis {
                cap: 1.5,
                importance_weight: false,
                rejected: Rejected::Dropped,
            }],
            vec![RefCorrection::SeqMis {
                cap: 1.5,
                weighted: false,
                zero_weight: false,
            }],
        ),
        (
            vec![CorrectionConfig::SeqMis {
                cap: 1.5,
                importance_weight: true,
                rejected: Rejected::ZeroWeight,
            }],
            vec![RefCorrection::SeqMis {
                cap: 1.5,
                weighted: true,
                zero_weight: true,
            }],
        ),
        (
            vec![
                CorrectionConfig::GeoRs {
                    low: 0.9,
                    high: 1.1,
                    rejected: Rejected::Dropped,
                },
                CorrectionConfig::TokenTis { cap: 1.5 },
            ],
            vec![
                RefCorrection::GeoRs {
                    low: 0.9,
                    high: 1.1,
                    zero_weight: false,
                },
                RefCorrection::TokenTis(1.5),
            ],
        ),
        (
            vec![CorrectionConfig::GeoRs {
                low: 0.9,
                high: 1.1,
                rejected: Rejected::ZeroWeight,
            }],
            vec![RefCorrection::GeoRs {
                low: 0.9,
                high: 1.1,
                zero_weight: true,
            }],
        ),
    ];
    for (configs, refs) in &corrections {
        let objectives = [
            (
                &token_batch,
                Objective::ppo_clip(token_clip(0.2, 0.28, Some(3.0))),
                RefObjective::Ppo {
                    lo: 0.8,
                    hi: 1.28,
                    c: Some(3.0),
                },
            ),
            (
                &token_batch,
                Objective::cispo(token_clip(0.2, 0.2, None)),
                RefObjective::Cispo { lo: 0.8, hi: 1.2 },
            ),
            (
                &seq_batch,
                Objective::gspo(SeqClip {
                    eps_low: 3e-4,
                    eps_high: 4e-4,
                }),
                RefObjective::Gspo {
                    lo: 1.0 - 3e-4,
                    hi: 1.0 + 4e-4,
                },
            ),
            (
                &seq_batch,
                Objective::tbpo(TrustBand::PAPER),
                RefObjective::Tbpo {
                    lo: 0.0,
                    hi: 1.0 + f64::from(TrustBand::PAPER.eps_high),
                    lo_neg: 1.0 - f64::from(TrustBand::PAPER.eps_low_neg),
                    hi_neg: 1.0 + f64::from(TrustBand::PAPER.eps_high_neg),
                    cap: f64::from(TrustBand::PAPER.mismatch_cap),
                    two_sided: TrustBand::PAPER.two_sided,
                    drop: TrustBand::PAPER.drop_outside_cap,
                },
            ),
        ];
        for (batch, objective, reference) in objectives {
            let mut loss = PolicyLoss::new(objective.clone(), LossAggMode::TokenMean);
            loss.corrections = configs.clone();
            let what = format!("{configs:?} on {objective:?}");
            check_against_reference(&loss, batch, reference, RefAgg::TokenMean, refs, &what);
        }
    }
    // A rejection leaves the denominators: IcePop on the token batch keeps fewer tokens than it was given.
    let mut loss = PolicyLoss::new(
        Objective::ppo_clip(token_clip(0.2, 0.2, None)),
        LossAggMode::TokenMean,
    );
    loss.corrections = vec![CorrectionConfig::TokenMis {
        low: 0.5,
        high: 1.8,
        importance_weight: true,
        rejected: Rejected::Dropped,
    }];
    let (out, _) = run(&loss, &token_batch);
    let (_, keep) = ref_corrections(
        &token_batch,
        &[RefCorrection::TokenMis {
            low: 0.5,
            high: 1.8,
            weighted: true,
            zero_weight: false,
        }],
    );
    let kept = (0..keep.len())
        .filter(|&i| keep[i] * token_batch.mask[i] > 0.5)
        .count() as f64;
    let total = token_batch.mask.iter().sum::<f64>();
    assert!(kept < total, "the batch must exercise the rejection");
    assert_close(out.metrics.loss_tokens, kept, 0.0, "tokens in the loss");
    assert_close(
        out.metrics.kept_token_frac,
        kept / total,
        1e-6,
        "kept fraction",
    );
}

/// verl's per-token form of the sequence ratio: a per-token correction weight scales its own token's gradient.
/// One sequence of 2 tokens, `A = +1`, `rho = exp(lp_old - lp_roll)` 1 and e^-1.9; IcePop with zero weight
/// (`[0.5, 5]`) rejects the second token. Under GSPO, TBPO and positive-only it gets exactly no gradient and the
/// first gets its share of the sequence's, `-A s w / n = -0.5` (TBPO: times its sequence weight). Repeating
/// `l_i(s_i)` on both tokens would give each the mean weight: -0.25 and -0.25.
#[test]
fn a_token_icepop_rejects_gets_no_gradient_under_sequence_objectives() {
    let mut one = Batch::new(1, 2);
    one.lp_theta = vec![-1.0, -3.0];
    one.lp_old = vec![-1.0, -3.0];
    one.lp_roll = vec![-1.0, -1.1];
    let one = one.rounded();
    let objectives = [
        Objective::gspo(SeqClip {
            eps_low: 3e-4,
            eps_high: 4e-4,
        }),
        Objective::positive_only(4e-4),
        Objective::tbpo(TrustBand::PAPER),
    ];
    for objective in objectives {
        let mut loss = PolicyLoss::new(objective.clone(), LossAggMode::SeqMeanTokenMean);
        loss.corrections = vec![CorrectionConfig::TokenMis {
            low: 0.5,
            high: 5.0,
            importance_weight: true,
            rejected: Rejected::ZeroWeight,
        }];
        let (_, grad) = run(&loss, &one);
        assert_eq!(grad[1], 0.0, "{objective:?}: the rejected token");
        let seq_weight = if objective.name() == "tbpo" {
            let mismatch = (-1.9f64 / 2.0).exp();
            let cap = f64::from(TrustBand::PAPER.mismatch_cap);
            if TrustBand::PAPER.two_sided {
                mismatch.clamp(1.0 / cap, cap)
            } else {
                mismatch.min(cap)
            }
        } else {
            1.0
        };
        assert_close(
            grad[0],
            -0.5 * seq_weight,
            1e-6,
            &format!("{objective:?}: the kept token"),
        );
    }
}

// ---------------------------------------------------------------------------------------------------------
// KL, padding, config

#[test]
fn k3_kl_to_reference_adds_to_the_loss() {
    let mut batch = token_level_batch(5);
    let mut rng = Lcg(99);
    batch.lp_ref = Some(f32_exact(
        batch
            .lp_old
            .iter()
            .map(|x| x + rng.uniform(-0.3, 0.3))
            .collect(),
    ));
    let mut loss = PolicyLoss::new(
        Objective::ppo_clip(token_clip(0.2, 0.28, None)),
        LossAggMode::SeqMeanTokenMean,
    );
    loss.kl_coef = 0.25;
    let reference = RefObjective::Ppo {
        lo: 0.8,
        hi: 1.28,
        c: None,
    };
    check_against_reference(
        &loss,
        &batch,
        reference,
        RefAgg::SeqMeanTokenMean,
        &[],
        "ppo + k3",
    );
    // Hand value of k3 for one token: lp_ref - lp_theta = ln 2 gives 2 - ln 2 - 1.
    let mut one = Batch::new(1, 1);
    one.adv = vec![0.0];
    one.lp_ref = Some(vec![-1.0 + f64::ln(2.0)]);
    let one = one.rounded();
    let (out, grad) = run(&loss, &one);
    assert_close(
        out.metrics.kl_loss.unwrap(),
        1.0 - f64::ln(2.0),
        1e-6,
        "k3 value",
    );
    // d/d lp_theta of e^(ref - theta) - (ref - theta) - 1 = 1 - e^(ref - theta) = -1, times kl_coef.
    assert_close(grad[0], -0.25, 1e-5, "k3 gradient");
}

/// verl's other `kl_loss_type`s on one token with `d = lp_theta - lp_ref = -ln 2` and `kl_coef` 0.25: k1
/// is `d` (gradient 0.25), abs `|d|` (gradient -0.25), k2 `d^2 / 2` (gradient 0.25 d); the straight-through
/// `+` types have k1's, abs's or k3's value and k2's gradient (k3's own would be -0.25, see above); verl's
/// names read as the same estimators (its `k2+` is k2), and a type other than the default with the term
/// off is refused.
#[test]
fn kl_types_are_verls_estimators() {
    use qarl::rl::losses::{KlType, LossConfig};
    let d = -f64::ln(2.0);
    let mut one = Batch::new(1, 1);
    one.adv = vec![0.0];
    one.lp_ref = Some(vec![-1.0 - d]);
    let one = one.rounded();
    for (kind, value, slope) in [
        (KlType::K1, d, 1.0),
        (KlType::Abs, -d, -1.0),
        (KlType::K2, d * d / 2.0, d),
        (KlType::K1StraightThrough, d, d),
        (KlType::AbsStraightThrough, -d, d),
        (KlType::K3StraightThrough, 1.0 - f64::ln(2.0), d),
    ] {
        let mut loss = PolicyLoss::new(
            Objective::ppo_clip(token_clip(0.2, 0.28, None)),
            LossAggMode::TokenMean,
        );
        loss.kl_coef = 0.25;
        loss.kl_type = kind;
        let (out, grad) = run(&loss, &one);
        assert_close(
            out.metrics.kl_loss.unwrap(),
            value,
            1e-6,
            &format!("{kind} value"),
        );
        assert_close(grad[0], 0.25 * slope, 1e-5, &format!("{kind} gradient"));
    }
    let parse = |kl: &str| -> LossConfig {
        toml::from_str(&format!(
            "objective = \"tbpo\"\nkl_coef = 0.1\nkl_type = \"{kl}\""
        ))
        .unwrap()
    };
    for (verl, ours) in [
        ("kl", KlType::K1),
        ("mse", KlType::K2),
        ("low_var_kl", KlType::K3),
        ("abs", KlType::Abs),
        ("k1+", KlType::K1StraightThrough),
        ("kl+", KlType::K1StraightThrough),
        ("abs+", KlType::AbsStraightThrough),
        ("k3+", KlType::K3StraightThrough),
        ("low_var_kl+", KlType::K3StraightThrough),
        ("k2+", KlType::K2),
        ("mse+", KlType::K2),
    ] {
        assert_eq!(parse(verl).resolve().unwrap().kl_type, ours, "{verl}");
    }
    let mut off = parse("k2");
    off.kl_coef = Some(0.0);
    let err = off.resolve().unwrap_err().to_string();
    assert!(
        err.contains("`kl_type` = \"k2\" with `kl_coef` = 0"),
        "{err}"
    );
}

/// verl's safety clamps, reached: a token log-ratio beyond 20 is taken as 20 (the ratio e^20, with exactly
/// no gradient through the clamp), and the k3 KL of a token is at most 10 (no gradient beyond). Without
/// them one token with log-ratio 25 would give a loss and a gradient of 7.2e10.
#[test]
fn log_ratio_and_k3_clamps_bound_the_loss() {
    let mut one = Batch::new(1, 1);
    one.adv = vec![-1.0];
    one.lp_old = vec![-30.0];
    one.lp_roll = vec![-30.0];
    one.lp_theta = vec![-5.0];
    let one = one.rounded();
    let loss = PolicyLoss::new(
        Objective::ppo_clip(token_clip(0.2, 0.28, None)),
        LossAggMode::TokenMean,
    );
    let (out, grad) = run(&loss, &one);
    // A < 0: max(-A r, -A clip(r)) = r = e^20 once the log-ratio 25 is clamped.
    assert_close(loss_value(&out), 20f64.exp(), 1e-5, "clamped ratio");
    assert_eq!(grad[0], 0.0, "no gradient through the clamped log-ratio");
    // `actor/ppo_kl` is the mean of the same clamped log-ratio (verl's): -20, not -25.
    assert_close(out.metrics.ppo_kl, -20.0, 1e-6, "clamped ppo_kl");
    // Just inside the bound the ratio is unclamped, and so is its gradient (-A r).
    let mut inside = one.clone();
    inside.lp_theta = vec![-30.0 + 19.5];
    let (out, grad) = run(&loss, &inside.rounded());
    assert_close(
        loss_value(&out),
        19.5f64.exp(),
        1e-5,
        "ratio inside the bound",
    );
    assert_close(grad[0], 19.5f64.exp(), 1e-5, "gradient inside the bound");

    // k3 alone (A = 0): ref - theta = 3 gives e^3 - 4 = 16.1, capped at 10 with no gradient; 25 is first
    // clamped to 20, then capped; 2 gives e^2 - 3 = 4.39 and the gradient kl_coef (1 - e^2).
    let mut loss = loss;
    loss.kl_coef = 0.25;
    for (gap, want, want_grad) in [
        (3.0, 10.0, 0.0),
        (25.0, 10.0, 0.0),
        (2.0, 2f64.exp() - 3.0, 0.25 * (1.0 - 2f64.exp())),
    ] {
        let mut b = Batch::new(1, 1);
        b.adv = vec![0.0];
        b.lp_ref = Some(vec![-1.0 + gap]);
        let (out, grad) = run(&loss, &b.rounded());
        assert_close(
            out.metrics.kl_loss.unwrap(),
            want,
            1e-5,
            &format!("k3 at {gap}"),
        );
        assert_close(grad[0], want_grad, 1e-4, &format!("k3 gradient at {gap}"));
    }
}

#[test]
fn padding_values_never_reach_the_loss_or_the_gradient() {
    let clean = {
        let mut batch = token_level_batch(21);
        batch.lp_ref = Some(batch.lp_old.clone());
        batch
    };
    let padded: Vec<usize> = (0..clean.b * clean.t)
        .filter(|&i| clean.mask[i] < 0.5)
        .collect();
    assert!(!padded.is_empty());
    let mut dirty = clean.clone();
    for &i in &padded {
        dirty.lp_theta[i] = f64::NAN;
        dirty.lp_old[i] = f64::NEG_INFINITY;
        dirty.lp_roll[i] = f64::INFINITY;
        dirty.lp_ref.as_mut().unwrap()[i] = f64::NAN;
    }
    // Each objective with an importance weight and a rejection band, and with IcePop's own weight (TBPO,
    // which weights by its own w_i, with the band alone).
    let lists = [
        r#"[{"kind": "seq_tis"}, {"kind": "icepop", "importance_weight": false}]"#,
        r#"[{"kind": "icepop"}]"#,
        r#"[{"kind": "icepop", "importance_weight": false}]"#,
    ];
    let cases = ["ppo_clip", "grpo", "gspo", "cispo", "tbpo"]
        .into_iter()
        .flat_map(|objective| lists.map(|list| (objective, list)))
        .filter(|(objective, list)| *objective != "tbpo" || *list == lists[2]);
    for (objective, corrections) in cases {
        let json = format!(
            r#"{{"objective": "{objective}", "kl_coef": 0.1, "corrections": {corrections}}}"#
        );
        let loss = serde_json::from_str::<LossConfig>(&json)
            .unwrap()
            .resolve()
            .unwrap();
        let (out_clean, grad_clean) = run(&loss, &clean);
        let (out_dirty, grad_dirty) = run(&loss, &dirty);
        assert!(loss_value(&out_clean).is_finite());
        assert_eq!(
            loss_value(&out_dirty),
            loss_value(&out_clean),
            "{objective}: loss"
        );
        assert_eq!(grad_dirty, grad_clean, "{objective}: gradient");
        assert_eq!(out_dirty.metrics, out_clean.metrics, "{objective}: metrics");
        assert!(
            padded.iter().all(|&i| grad_dirty[i] == 0.0),
            "{objective}: padding gradient"
        );
    }
}

#[test]
fn config_resolves_defaults_and_rejects_unknown_names() {
    let parse = |json: &str| serde_json::from_str::<LossConfig>(json);
    let tbpo = parse(r#"{"objective": "tbpo"}"#)
        .unwrap()
        .resolve()
        .unwrap();
    assert_eq!(tbpo.objective, Objective::tbpo(TrustBand::PAPER));
    assert_eq!(tbpo.agg, LossAggMode::SeqMeanTokenMean);
    let dapo = parse(r#"{"objective": "ppo_clip", "eps_high": 0.28, "dual_clip_c": 3.0, "loss_agg_mode": "token-mean"}"#)
        .unwrap()
        .resolve()
        .unwrap();
    assert_eq!(
        dapo.objective,
        Objective::ppo_clip(token_clip(0.2, 0.28, Some(3.0)))
    );
    let grpo = parse(r#"{"objective": "grpo"}"#)
        .unwrap()
        .resolve()
        .unwrap();
    assert_eq!(grpo.agg, LossAggMode::SeqMeanTokenMean);
    assert_eq!(
        parse(r#"{"objective": "cispo"}"#)
            .unwrap()
            .resolve()
            .unwrap()
            .agg,
        LossAggMode::TokenMean
    );
    let dr = parse(
        r#"{"objective": "grpo", "loss_agg_mode": "seq-mean-token-sum", "loss_agg_divisor": 4096}"#,
    )
    .unwrap()
    .resolve()
    .unwrap();
    assert_eq!(
        (dr.agg, dr.agg_divisor),
        (LossAggMode::SeqMeanTokenSum, 4096.0)
    );
    let aliased = parse(r#"{"objective": "gspo", "seq_clip_ratio_high": 5e-4}"#)
        .unwrap()
        .resolve()
        .unwrap();
    assert_eq!(
        aliased.objective,
        Objective::gspo(SeqClip {
            eps_low: 3e-4,
            eps_high: 5e-4
        })
    );
    let with_corr = parse(r#"{"objective": "grpo", "corrections": [{"kind": "icepop", "importance_weight": false}, {"kind": "seq_tis", "cap": 3}]}"#)
        .unwrap()
        .resolve()
        .unwrap();
    assert_eq!(
        with_corr.corrections,
        vec![
            CorrectionConfig::TokenMis {
                low: 0.5,
                high: 5.0,
                importance_weight: false,
                rejected: Rejected::Dropped
            },
            CorrectionConfig::SeqTis { cap: 3.0 }
        ]
    );
    // Two importance weights over the mismatch ratio would multiply (min(rho, 3) * rho): refused, as is
    // one beside TBPO's own w_i; a band without its weight, or Geo-RS, composes with either.
    let twice = [
        (
            "grpo",
            r#"[{"kind": "icepop"}, {"kind": "seq_tis", "cap": 3}]"#,
            "`token_mis` and `seq_tis` both weight by the mismatch ratio",
        ),
        (
            "ppo_clip",
            r#"[{"kind": "token_tis"}, {"kind": "seq_mis"}]"#,
            "`token_tis` and `seq_mis` both weight",
        ),
        (
            "tbpo",
            r#"[{"kind": "token_tis"}]"#,
            "which the objective `tbpo` already weights by",
        ),
    ];
    for (objective, corrections, want) in twice {
        let json = format!(r#"{{"objective": "{objective}", "corrections": {corrections}}}"#);
        let err = parse(&json).unwrap().resolve().unwrap_err().to_string();
        assert!(
            err.contains(want) && err.contains("importance_weight = false"),
            "{json}: {err}"
        );
    }
    for corrections in [
        r#"[{"kind": "seq_mis", "importance_weight": false}, {"kind": "geo_rs"}]"#,
        r#"[{"kind": "token_tis"}, {"kind": "geo_rs"}, {"kind": "token_mis", "importance_weight": false}]"#,
    ] {
        for objective in ["tbpo", "grpo"] {
            let json = format!(r#"{{"objective": "{objective}", "corrections": {corrections}}}"#);
            let ok = parse(&json).unwrap().resolve();
            assert_eq!(
                ok.is_ok(),
                objective == "grpo" || !corrections.contains("token_tis"),
                "{json}: {ok:?}"
            );
        }
    }

    let err = parse(r#"{"objective": "tbpo2"}"#).unwrap_err().to_string();
    assert!(
        err.contains("unknown variant `tbpo2`") && err.contains("`gspo`"),
        "{err}"
    );
    let err = parse(r#"{"objective": "tbpo", "seq_eps_hi": 1e-3}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `seq_eps_hi`"), "{err}");
    let err = parse(r#"{"objective": "grpo", "loss_agg_mode": "token_mean"}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown variant `token_mean`"), "{err}");
    let err = parse(r#"{"objective": "grpo", "corrections": [{"kind": "tis"}]}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown variant `tis`"), "{err}");
    let err = parse(r#"{"objective": "grpo", "corrections": [{"kind": "token_tis", "capp": 2}]}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `capp`"), "{err}");

    let config_err = |json: &str| match parse(json).unwrap().resolve() {
        Err(RlError::Config(msg)) => msg,
        other => panic!("{json}: expected a config error, got {other:?}"),
    };
    assert!(config_err(r#"{"objective": "gspo", "dual_clip_c": 3}"#)
        .contains("`dual_clip_c` does not apply to objective `gspo`"));
    assert!(config_err(r#"{"objective": "cispo", "dual_clip_c": 3}"#).contains("dual_clip_c"));
    // A positive sequence's lower clip never binds: TBPO and positive-only do not take GSPO's lower width.
    for objective in ["tbpo", "positive_only"] {
        let err = config_err(&format!(
            r#"{{"objective": "{objective}", "seq_eps_low": 1e-3}}"#
        ));
        assert!(
            err.contains(&format!(
                "`seq_eps_low` does not apply to objective `{objective}`"
            )),
            "{err}"
        );
    }
    assert!(parse(r#"{"objective": "gspo", "seq_eps_low": 1e-3}"#)
        .unwrap()
        .resolve()
        .is_ok());
    assert!(
        config_err(r#"{"objective": "ppo_clip", "seq_eps_high": 1e-3}"#).contains("seq_eps_high")
    );
    assert!(config_err(r#"{"objective": "ppo_clip", "dual_clip_c": 0.5}"#).contains("> 1"));
    assert!(config_err(r#"{"objective": "ppo_clip", "eps_low": 1.5}"#)
        .contains("`eps_low` must be in [0, 1]"));
    assert!(
        config_err(r#"{"objective": "tbpo", "seq_eps_high_neg": -1e-4}"#)
            .contains("`seq_eps_high_neg` must be finite and >= 0")
    );
    assert!(
        config_err(r#"{"objective": "ppo_clip", "loss_agg_divisor": 2}"#)
            .contains("seq-mean-token-sum")
    );
    assert!(config_err(r#"{"objective": "tbpo", "seq_tis_imp_ratio_cap": 0.5}"#).contains(">= 1"));
    assert!(config_err(
        r#"{"objective": "grpo", "corrections": [{"kind": "geo_rs", "low": 1.1, "high": 1.0}]}"#
    )
    .contains("geo_rs"));
}

#[test]
fn bad_inputs_are_errors() {
    let batch = Batch::new(2, 3);
    let device = ad_device();
    let inputs = |adv_len: usize, mask_t: usize, lp_ref: bool| PolicyLossInputs {
        lp_theta: tensor2(&batch.lp_theta, 2, 3, &device),
        lp_old: tensor2(&batch.lp_old, 2, 3, &device),
        lp_roll: tensor2(&batch.lp_roll, 2, 3, &device),
        mask: tensor2(&vec![1.0; 2 * mask_t], 2, mask_t, &device),
        advantages: tensor_from_vec(vec![1.0; adv_len], [adv_len], &device),
        lp_ref: lp_ref.then(|| tensor2(&batch.lp_old, 2, 3, &device)),
    };
    let mut loss = PolicyLoss::new(
        Objective::ppo_clip(token_clip(0.2, 0.2, None)),
        LossAggMode::TokenMean,
    );
    assert!(matches!(
        loss.compute(inputs(3, 3, false)),
        Err(RlError::Input(_))
    ));
    assert!(matches!(
        loss.compute(inputs(2, 4, false)),
        Err(RlError::Input(_))
    ));
    loss.kl_coef = 0.1;
    let err = loss.compute(inputs(2, 3, false)).unwrap_err();
    assert!(err.to_string().contains("lp_ref"), "{err}");
    assert!(loss.compute(inputs(2, 3, true)).is_ok());
}

// ---------------------------------------------------------------------------------------------------------
// The registry: what holds for every registered objective, present and future

/// A valid value other than the field's default, to see that the objective reads the field.
fn another_value(param: &ParamSpec) -> ParamValue {
    match param.kind {
        ParamKind::Flag { default } => ParamValue::Bool(!default),
        ParamKind::Float { default, range } => {
            let floor = match range {
                Range::Unit => 0.0,
                Range::AtLeast(x) | Range::Above(x) => x,
            };
            let value = match (default, range) {
                (None, _) => floor + 2.0,
                (Some(d), Range::Unit) if d > 0.0 => d / 2.0,
                (Some(_), Range::Unit) => 0.5,
                (Some(d), _) => d + 0.5,
            };
            ParamValue::Float(f64::from(value))
        }
    }
}

#[test]
fn registry_is_consistent_and_every_field_is_read() {
    let names = registered_names();
    for name in ["ppo_clip", "grpo", "gspo", "cispo", "tbpo"] {
        assert!(names.contains(&name), "{name} is registered");
    }
    for (i, spec) in REGISTRY.iter().enumerate() {
        assert_eq!(names[i], spec.name);
        assert!(!names[..i].contains(&spec.name), "{} twice", spec.name);
        let mut keys: Vec<&str> = Vec::new();
        for param in spec.params {
            for key in std::iter::once(param.name).chain(param.aliases.iter().copied()) {
                assert!(!keys.contains(&key), "{}: `{key}` twice", spec.name);
                assert!(
                    !COMMON_FIELDS.contains(&key),
                    "{}: `{key}` is common",
                    spec.name
                );
                keys.push(key);
            }
            // A name means the same kind of value in every objective that declares it.
            for other in REGISTRY.iter().flat_map(|s| s.params.iter()) {
                if other.name == param.name {
                    assert_eq!(
                        std::mem::discriminant(&other.kind),
                        std::mem::discriminant(&param.kind),
                        "`{}`",
                        param.name
                    );
                }
            }
        }
        // Defaults resolve, to the objective's default aggregation ...
        let config = LossConfig::new(ObjectiveName::new(spec.name).unwrap());
        let default = config.resolve().unwrap();
        assert_eq!(default.agg, spec.default_agg, "{}", spec.name);
        // ... and every declared field changes the objective when set (so its build reads it).
        for param in spec.params {
            let changed = config
                .clone()
                .with(param.name, another_value(param))
                .resolve()
                .unwrap_or_else(|e| panic!("{} with `{}`: {e}", spec.name, param.name));
            assert_ne!(
                changed.objective, default.objective,
                "{}: `{}` is declared but not read",
                spec.name, param.name
            );
        }
    }
}

#[test]
fn unknown_objective_names_list_the_registered_ones() {
    let err = ObjectiveName::new("tbpo2").unwrap_err();
    assert!(matches!(err, RlError::UnknownObjective { .. }), "{err:?}");
    let parsed = serde_json::from_str::<LossConfig>(r#"{"objective": "tbpo2"}"#)
        .unwrap_err()
        .to_string();
    for name in registered_names() {
        assert!(err.to_string().contains(name), "{err}");
        assert!(parsed.contains(&format!("`{name}`")), "{parsed}");
    }
    assert_eq!(
        "gspo".parse::<ObjectiveName>().unwrap().name(),
        "gspo",
        "FromStr"
    );
}

#[test]
fn flat_toml_round_trips_and_checks_field_types() {
    let text = r#"
objective = "tbpo"
seq_clip_ratio_high = 5e-4
seq_tis_imp_ratio_cap = 3
seq_mismatch_two_sided = true
kl_coef = 0.0
corrections = [{ kind = "token_mis", importance_weight = false }]
"#;
    let config: LossConfig = toml::from_str(text).unwrap();
    let loss = config.resolve().unwrap();
    assert_eq!(
        loss.objective,
        Objective::tbpo(TrustBand {
            eps_high: 5e-4,
            mismatch_cap: 3.0,
            two_sided: true,
            ..TrustBand::PAPER
        })
    );
    assert_eq!(
        loss.corrections,
        vec![CorrectionConfig::TokenMis {
            low: 0.5,
            high: 5.0,
            importance_weight: false,
            rejected: Rejected::Dropped
        }]
    );
    let written = toml::to_string(&config).unwrap();
    let back: LossConfig = toml::from_str(&written).unwrap();
    assert_eq!(back, config, "{written}");
    assert_eq!(
        LossConfig::new(ObjectiveName::new("tbpo").unwrap())
            .with("seq_clip_ratio_high", 5e-4f32)
            .with("seq_tis_imp_ratio_cap", 3.0f32)
            .with("seq_mismatch_two_sided", true)
            .resolve()
            .unwrap()
            .objective,
        loss.objective,
        "the builder reads the same"
    );

    let err = toml::from_str::<LossConfig>("objective = \"tbpo\"\nseq_eps_hi = 1e-3")
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `seq_eps_hi`"), "{err}");
    let config_err = |json: &str| match serde_json::from_str::<LossConfig>(json).unwrap().resolve()
    {
        Err(RlError::Config(msg)) => msg,
        other => panic!("{json}: expected a config error, got {other:?}"),
    };
    assert!(
        config_err(r#"{"objective": "tbpo", "seq_eps_high": true}"#).contains("must be a number")
    );
    assert!(
        config_err(r#"{"objective": "tbpo", "seq_mismatch_drop": 1}"#)
            .contains("must be true or false")
    );
    assert!(config_err(
        r#"{"objective": "gspo", "seq_eps_high": 1e-3, "seq_clip_ratio_high": 1e-3}"#
    )
    .contains("set twice"));
    assert!(
        config_err(r#"{"objective": "cispo", "seq_clip_ratio_high": 1e-3}"#)
            .contains("`seq_clip_ratio_high` does not apply to objective `cispo`")
    );
}

#[test]
fn every_registered_objective_ignores_padding() {
    let clean = token_level_batch(23);
    let mut dirty = clean.clone();
    for i in 0..clean.b * clean.t {
        if clean.mask[i] < 0.5 {
            dirty.lp_theta[i] = f64::NAN;
            dirty.lp_old[i] = f64::NEG_INFINITY;
            dirty.lp_roll[i] = f64::INFINITY;
        }
    }
    for name in registered_names() {
        let loss = LossConfig::new(ObjectiveName::new(name).unwrap())
            .resolve()
            .unwrap();
        let (out_clean, grad_clean) = run(&loss, &clean);
        let (out_dirty, grad_dirty) = run(&loss, &dirty);
        assert!(loss_value(&out_clean).is_finite(), "{name}");
        assert_eq!(loss_value(&out_dirty), loss_value(&out_clean), "{name}");
        assert_eq!(grad_dirty, grad_clean, "{name}: gradient");
        assert_eq!(out_dirty.metrics, out_clean.metrics, "{name}: metrics");
    }
}

// ---------------------------------------------------------------------------------------------------------
// positive_only: the paper's positive-only ablation

/// Four 2-token sequences and a sampler that disagrees (positive-only has no mismatch weight of its own):
/// a: A = +1, s = e^1e-4 (inside the band)  -> -s_a, gradient -s_a / 2 / 4 per token (seq-mean over 4)
/// b: A = +2, s = e^1e-3 (above 1 + 4e-4)   -> -2 (1 + 4e-4), no gradient
/// c: A = -1, s = e^5e-4 (GSPO: s_c)        -> 0, exactly no gradient
/// d: A = -0.5, s = e^-1e-3                 -> 0, exactly no gradient
fn hand_positive_only_batch() -> Batch {
    let mut batch = Batch::new(4, 2);
    batch.adv = vec![1.0, 2.0, -1.0, -0.5];
    let seq_log_ratio = [1e-4, 1e-3, 5e-4, -1e-3];
    let split = [3e-5, -2e-4, 1e-4, 5e-5];
    for row in 0..4 {
        for j in 0..2 {
            let i = row * 2 + j;
            let sign = if j == 0 { 1.0 } else { -1.0 };
            batch.lp_old[i] = -0.25 - 0.5 * i as f64;
            batch.lp_theta[i] = batch.lp_old[i] + seq_log_ratio[row] + sign * split[row];
            batch.lp_roll[i] = batch.lp_old[i] - 0.3;
        }
    }
    batch.rounded()
}

#[test]
fn positive_only_matches_hand_values_and_negatives_get_exactly_no_gradient() {
    let batch = hand_positive_only_batch();
    let loss = LossConfig::new(ObjectiveName::new("positive_only").unwrap())
        .resolve()
        .unwrap();
    assert_eq!(
        loss.objective,
        // No lower clip: for A > 0 one could change nothing.
        Objective::positive_only(4e-4)
    );
    assert_eq!(loss.agg, LossAggMode::SeqMeanTokenMean);
    let (out, grad) = run(&loss, &batch);
    let sa = f64::exp(1e-4);
    let want = (-sa - 2.0 * (1.0 + 4e-4)) / 4.0;
    assert_close(loss_value(&out), want, 2e-6, "positive_only loss");
    let want_grad = [-sa / 8.0, -sa / 8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    assert_all_close(&grad, &want_grad, 1e-5, "positive_only grad");
    for g in &grad[2..] {
        assert_eq!(*g, 0.0, "clipped or negative sequence: gradient {g}");
    }
    let m = &out.metrics;
    assert_close(m.pg_clipfrac, 1.0 / 4.0, 1e-6, "only b is clipped");
    assert_eq!(m.pg_clipfrac_lower, 0.0);
    assert_eq!(m.mismatch_weight_mean, 1.0, "no weight of its own");
    assert_close(
        m.loss_sequences,
        4.0,
        0.0,
        "negatives stay in the denominator",
    );

    // A positive sequence gets GSPO's gradient on the same batch.
    let gspo = LossConfig::new(ObjectiveName::new("gspo").unwrap())
        .resolve()
        .unwrap();
    let (_, grad_gspo) = run(&gspo, &batch);
    assert_all_close(&grad[..4], &grad_gspo[..4], 1e-6, "positive rows as GSPO");
    assert!(
        grad_gspo[4] > 0.05,
        "GSPO does push the negative sequence c"
    );

    let err = serde_json::from_str::<LossConfig>(
        r#"{"objective": "positive_only", "seq_eps_low_neg": 1e-3}"#,
    )
    .unwrap()
    .resolve()
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`seq_eps_low_neg` does not apply to objective `positive_only`"),
        "{err}"
    );
}

#[test]
fn positive_only_matches_reference_and_finite_differences() {
    let batch = sequence_level_batch(4);
    // The reference keeps GSPO's lower clip, which must never bind for A > 0.
    let reference = RefObjective::PositiveOnly {
        lo: 1.0 - 3e-4,
        hi: 1.0 + 4e-4,
    };
    for (agg, ref_agg, divisor) in all_aggs() {
        let mut loss = PolicyLoss::new(Objective::positive_only(4e-4), agg);
        loss.agg_divisor = divisor;
        let what = format!("positive_only {agg:?}");
        check_against_reference(&loss, &batch, reference, ref_agg, &[], &what);
    }
    let mut loss = PolicyLoss::new(
        Objective::positive_only(4e-4),
        LossAggMode::SeqMeanTokenMean,
    );
    loss.corrections = vec![CorrectionConfig::SeqTis { cap: 2.0 }];
    check_against_reference(
        &loss,
        &batch,
        reference,
        RefAgg::SeqMeanTokenMean,
        &[RefCorrection::SeqTis(2.0)],
        "positive_only with seq_tis",
    );
}
