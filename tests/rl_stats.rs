//! Advantages, DAPO's filter and the section-5 metrics of `qarl::rl` against values worked out by hand (and, for
//! the loop detector and RLOO, against brute-force definitions).

use proptest::prelude::*;

use qarl::rl::advantages::{
    group_advantages, groups_with_signal, responses_of_groups, AdvantageConfig, AdvantageEstimator,
    StdKind,
};
use qarl::rl::metrics::{
    error_token_metrics, is_low_probability, is_ratio_error, masked_mean, names,
    repetition_loop_mask, response_length_metrics, rollout_mismatch_metrics, routing_disagreement,
    LoopRule, RoutingDisagreement,
};
use qarl::rl::RlError;

fn assert_close(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: got {got}, want {want}"
    );
}

fn assert_all_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (g, w) in got.iter().zip(want) {
        assert_close(f64::from(*g), *w, tol, what);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Advantages

#[test]
fn grpo_dr_grpo_and_rloo_match_hand_values() {
    // Group 1: rewards 1, 0, 0, 0: mean 0.25, deviations 0.75 and -0.25; sum of squares 0.75, so the sample
    // std is sqrt(0.75 / 3) = 0.5 and the population std sqrt(0.75 / 4) = 0.4330127.
    // Group 2: all equal: every advantage 0 (the std is 0, eps keeps it finite).
    let rewards = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0];
    let grpo = group_advantages(&rewards, 4, &AdvantageConfig::grpo()).unwrap();
    let (hi, lo) = (0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6));
    assert_all_close(
        &grpo,
        &[hi, lo, lo, lo, 0.0, 0.0, 0.0, 0.0],
        1e-6,
        "grpo (sample std)",
    );

    let population = AdvantageConfig {
        std: Some(StdKind::Population),
        ..AdvantageConfig::grpo()
    };
    let grpo_pop = group_advantages(&rewards, 4, &population).unwrap();
    let std = (0.75f64 / 4.0).sqrt(); // 0.4330127
    assert_close(
        f64::from(grpo_pop[0]),
        0.75 / (std + 1e-6),
        1e-6,
        "grpo (population std)",
    );

    let dr = group_advantages(
        &rewards,
        4,
        &AdvantageConfig::new(AdvantageEstimator::DrGrpo),
    )
    .unwrap();
    assert_all_close(
        &dr,
        &[0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0],
        1e-7,
        "dr_grpo",
    );

    // RLOO: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3.
    let rloo =
        group_advantages(&rewards, 4, &AdvantageConfig::new(AdvantageEstimator::Rloo)).unwrap();
    let third = -1.0 / 3.0;
    assert_all_close(
        &rloo,
        &[1.0, third, third, third, 0.0, 0.0, 0.0, 0.0],
        1e-7,
        "rloo",
    );
}

#[test]
fn advantage_config_parses_and_rejects_misplaced_fields() {
    let parse = |json: &str| serde_json::from_str::<AdvantageConfig>(json);
    assert_eq!(
        parse(r#"{"estimator": "grpo"}"#).unwrap(),
        AdvantageConfig::grpo()
    );
    assert_eq!(
        parse(r#"{"estimator": "std_free"}"#).unwrap().estimator,
        AdvantageEstimator::DrGrpo
    );
    assert_eq!(
        parse(r#"{"estimator": "grpo", "std": "population", "eps": 1e-4}"#)
            .unwrap()
            .std,
        Some(StdKind::Population)
    );
    let err = parse(r#"{"estimator": "ppo"}"#).unwrap_err().to_string();
    assert!(
        err.contains("unknown variant `ppo`") && err.contains("`rloo`"),
        "{err}"
    );
    let err = parse(r#"{"estimator": "grpo", "std_kind": "sample"}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `std_kind`"), "{err}");
    let misplaced = parse(r#"{"estimator": "rloo", "std": "sample"}"#).unwrap();
    assert!(matches!(
        group_advantages(&[1.0, 0.0], 2, &misplaced),
        Err(RlError::Config(_))
    ));
}

#[test]
fn advantage_inputs_are_checked() {
    let grpo = AdvantageConfig::grpo();
    for (rewards, g) in [
        (&[1.0f32, 0.0][..], 1),
        (&[1.0, 0.0, 1.0][..], 2),
        (&[1.0, f32::NAN][..], 2),
    ] {
        assert!(
            matches!(group_advantages(rewards, g, &grpo), Err(RlError::Input(_))),
            "{rewards:?} / {g}"
        );
    }
}

#[test]
fn dynamic_sampling_drops_groups_with_equal_rewards() {
    let rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0];
    let kept = groups_with_signal(&rewards, 3).unwrap();
    assert_eq!(kept, vec![1, 3]);
    assert_eq!(responses_of_groups(&kept, 3), vec![3, 4, 5, 9, 10, 11]);
    assert!(groups_with_signal(&rewards, 5).is_err());
}

proptest! {
    #[test]
    fn grpo_advantages_are_standardised_within_each_group(
        rewards in prop::collection::vec(prop::sample::select(vec![0.0f32, 0.25, 0.5, 1.0]), 3..=6)
            .prop_flat_map(|g| prop::collection::vec(Just(g), 1..4))
    ) {
        let g = rewards[0].len();
        let flat: Vec<f32> = rewards.concat();
        let adv = group_advantages(&flat, g, &AdvantageConfig::grpo()).unwrap();
        for (group, a) in flat.chunks(g).zip(adv.chunks(g)) {
            let a: Vec<f64> = a.iter().map(|&x| f64::from(x)).collect();
            let mean = a.iter().sum::<f64>() / g as f64;
            prop_assert!(mean.abs() < 1e-5);
            if group.iter().any(|&r| r != group[0]) {
                let sample_var = a.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (g - 1) as f64;
                prop_assert!((sample_var.sqrt() - 1.0).abs() < 1e-4, "sample std {}", sample_var.sqrt());
            } else {
                prop_assert!(a.iter().all(|&x| x == 0.0));
            }
        }
    }

    #[test]
    fn rloo_is_reward_minus_mean_of_the_others(
        flat in prop::collection::vec(-3.0f32..3.0, 8)
    ) {
        for g in [2, 4, 8] {
            let adv = group_advantages(&flat, g, &AdvantageConfig::new(AdvantageEstimator::Rloo)).unwrap();
            for (i, a) in adv.iter().enumerate() {
                let start = i / g * g;
                let others: f64 = (start..start + g).filter(|&j| j != i).map(|j| f64::from(flat[j])).sum();
                let want = f64::from(flat[i]) - others / (g - 1) as f64;
                prop_assert!((f64::from(*a) - want).abs() < 1e-5, "{a} vs {want}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Mismatch metrics

#[test]
fn rollout_mismatch_metrics_match_hand_values() {
    let ln = f64::ln;
    // Two rows of 3; row 1 has 2 response tokens, row 2 one. Token probabilities (old, roll):
    // (0.5, 0.25), (0.25, 0.5), (0.8, 0.4), so rho = 2, 0.5, 2. Padding values are garbage on purpose.
    let lp_old = [ln(0.5), ln(0.25), 7.0, ln(0.8), f64::NAN, 0.0].map(|x| x as f32);
    let lp_roll = [ln(0.25), ln(0.5), -7.0, ln(0.4), 0.0, f64::INFINITY].map(|x| x as f32);
    let mask = [true, true, false, true, false, false];
    let m = rollout_mismatch_metrics(&lp_old, &lp_roll, &mask, 3).unwrap();
    let get = |name: &str| *m.get(name).unwrap_or_else(|| panic!("missing {name}"));
    // kl = mean(lp_roll - lp_old) = (-ln 2 + ln 2 - ln 2) / 3
    assert_close(get(names::KL), -ln(2.0) / 3.0, 1e-6, "kl");
    // k3 = mean(rho - ln rho - 1): (1 - ln 2), (ln 2 - 0.5), (1 - ln 2)
    assert_close(
        get(names::K3_KL),
        (2.0 * (1.0 - ln(2.0)) + ln(2.0) - 0.5) / 3.0,
        1e-6,
        "k3_kl",
    );
    // chi2_token = mean(rho^2) - 1 = (4 + 0.25 + 4) / 3 - 1
    assert_close(get(names::CHI2_TOKEN), 8.25 / 3.0 - 1.0, 1e-6, "chi2_token");
    // chi2_seq = mean((prod rho)^2) - 1 = (1 + 4) / 2 - 1
    assert_close(get(names::CHI2_SEQ), 1.5, 1e-6, "chi2_seq");
    // ppl_ratio per row = exp(mean lp_roll - mean lp_old): row 1 exp(0) = 1, row 2 0.4 / 0.8 = 0.5
    assert_close(get(names::PPL_RATIO), 0.75, 1e-6, "ppl_ratio");
    // training ppl per row: exp(-mean lp_old): sqrt(1 / (0.5 * 0.25)) = sqrt(8), 1 / 0.8
    assert_close(
        get(names::TRAINING_PPL),
        (8f64.sqrt() + 1.25) / 2.0,
        1e-6,
        "training_ppl",
    );
    assert_close(
        get(names::ROLLOUT_PPL),
        (8f64.sqrt() + 2.5) / 2.0,
        1e-6,
        "rollout_ppl",
    );
    // |p_old - p_roll| = 0.25, 0.25, 0.4: max 0.4, mean 0.3, sample std sqrt((0.05^2 * 2 + 0.1^2) / 2)
    assert_close(get(names::PROBS_DIFF_MAX), 0.4, 1e-6, "diff max");
    assert_close(get(names::PROBS_DIFF_MEAN), 0.3, 1e-6, "diff mean");
    assert_close(
        get(names::PROBS_DIFF_STD),
        (0.015f64 / 2.0).sqrt(),
        1e-6,
        "diff std",
    );
    // Pearson of (0.5, 0.25, 0.8) and (0.25, 0.5, 0.4), worked out by hand: -0.0241667 / sqrt(0.151667 * 0.031667)
    assert_close(get(names::PROBS_PEARSON), -0.348715, 1e-5, "pearson");

    // Identical policies: every divergence is zero, the correlation is 1.
    let same = rollout_mismatch_metrics(&lp_old, &lp_old, &mask, 3).unwrap();
    for name in [
        names::KL,
        names::K3_KL,
        names::CHI2_TOKEN,
        names::PROBS_DIFF_MAX,
    ] {
        assert_close(same[name], 0.0, 1e-7, name);
    }
    assert_close(same[names::PPL_RATIO], 1.0, 1e-7, "ppl_ratio");
    assert_close(same[names::PROBS_PEARSON], 1.0, 1e-7, "pearson");

    assert!(rollout_mismatch_metrics(&lp_old, &lp_roll, &[false; 6], 3).is_err());
    assert!(rollout_mismatch_metrics(&lp_old[..5], &lp_roll, &mask, 3).is_err());
    assert!(rollout_mismatch_metrics(&lp_old, &lp_roll, &mask, 4).is_err());
}

#[test]
fn response_length_metrics_match_hand_values() {
    let m = response_length_metrics(&[3, 8, 8, 5], 8);
    assert_eq!(m[names::RESPONSE_LENGTH_MEAN], 6.0);
    assert_eq!(m[names::RESPONSE_LENGTH_CLIP_RATIO], 0.5);
    assert_eq!(m[names::RESPONSE_LENGTH_MAX], 8.0);
    assert_eq!(m[names::RESPONSE_LENGTH_MIN], 3.0);
}

#[test]
fn entropy_matches_hand_values() {
    // Row 1: uniform over 4 -> ln 4. Row 2: probabilities (0.5, 0.25, 0.25, 0) -> 0.5 ln 2 + 0.5 ln 4 = 1.5 ln 2.
    let ln = f32::ln;
    let logits = vec![
        0.0,
        0.0,
        0.0,
        0.0,
        ln(0.5) + 3.0,
        ln(0.25) + 3.0,
        ln(0.25) + 3.0,
        -1e4,
    ];
    // The function whose per-token values `actor/entropy` averages (rollout and learner alike).
    let h = qarl::model::scoring::entropy_rows(&logits, 4);
    assert_close(f64::from(h[0]), 4f64.ln(), 1e-6, "uniform");
    assert_close(f64::from(h[1]), 1.5 * 2f64.ln(), 1e-6, "skewed");
    assert_close(
        masked_mean(&h, &[true, false]),
        4f64.ln(),
        1e-6,
        "actor/entropy over the mask",
    );
}

// ---------------------------------------------------------------------------------------------------------
// Error tokens

fn marked(tokens: &[u32]) -> Vec<usize> {
    repetition_loop_mask(tokens, LoopRule::default())
        .iter()
        .enumerate()
        .filter(|(_, &m)| m)
        .map(|(i, _)| i)
        .collect()
}

#[test]
fn repetition_loops_match_hand_cases() {
    assert!(marked(&[1, 2, 3, 4, 5]).is_empty());
    assert_eq!(marked(&[5, 5, 5]), vec![0, 1, 2]);
    assert!(marked(&[5, 5]).is_empty(), "two in a row is not a loop");
    // "engine to to to to accelerate": the four "to" tokens
    assert_eq!(marked(&[10, 11, 11, 11, 11, 12]), vec![1, 2, 3, 4]);
    // a 2-token pattern three times, inside other tokens
    assert_eq!(
        marked(&[7, 1, 2, 1, 2, 1, 2, 9]),
        (1..7).collect::<Vec<_>>()
    );
    // twice and a half is not enough
    assert!(marked(&[1, 2, 1, 2, 1, 9]).is_empty());
    // a 4-token pattern three times (12 tokens), plus a trailing partial repeat that is still periodic
    let four: Vec<u32> = [3, 1, 4, 1]
        .repeat(3)
        .into_iter()
        .chain([3, 1, 8])
        .collect();
    assert_eq!(marked(&four), (0..14).collect::<Vec<_>>());
    // a 5-token pattern is beyond the default rule ...
    let five: Vec<u32> = [1, 2, 3, 4, 5].repeat(3);
    assert!(marked(&five).is_empty());
    // ... but not beyond a wider one
    let wide = LoopRule {
        max_pattern: 5,
        min_repeats: 3,
        min_span: 0,
    };
    assert!(repetition_loop_mask(&five, wide).iter().all(|&m| m));
    // a repeat count no sequence can hold marks nothing (its product with the pattern length overflowed)
    let never = LoopRule {
        min_repeats: usize::MAX / 2,
        ..wide
    };
    assert!(repetition_loop_mask(&five, never).iter().all(|&m| !m));
    // a span floor for character tokenizers: "####" is text, 12 characters of "ab" are a loop
    let chars = LoopRule {
        min_span: 12,
        ..LoopRule::default()
    };
    let hashes: Vec<u32> = " #### 13".bytes().map(u32::from).collect();
    assert!(marked(&hashes).len() == 4, "the default rule flags `####`");
    assert!(repetition_loop_mask(&hashes, chars).iter().all(|&m| !m));
    let looping: Vec<u32> = "=5. "
        .bytes()
        .chain("ab".repeat(6).bytes())
        .map(u32::from)
        .collect();
    let m = repetition_loop_mask(&looping, chars);
    assert_eq!(m.iter().filter(|&&x| x).count(), 12);
    assert!(m[4..].iter().all(|&x| x));
}

/// The definition, by brute force: token j is in a loop if some pattern of n <= max_pattern tokens starting at
/// some i <= j repeats k >= min_repeats times back to back, and the n-periodic stretch from i (the k repeats
/// and a partial one after them) covers j and spans at least min_span tokens.
fn brute_force_loops(tokens: &[u32], rule: LoopRule) -> Vec<bool> {
    let mut out = vec![false; tokens.len()];
    for n in 1..=rule.max_pattern {
        for i in 0..tokens.len() {
            let mut k = 1;
            while i + (k + 1) * n <= tokens.len()
                && tokens[i + k * n..i + (k + 1) * n] == tokens[i..i + n]
            {
                k += 1;
            }
            let mut end = i + k * n;
            while end < tokens.len() && tokens[end] == tokens[end - n] {
                end += 1;
            }
            if i + n <= tokens.len() && k >= rule.min_repeats && end - i >= rule.min_span {
                out[i..end].iter_mut().for_each(|m| *m = true);
            }
        }
    }
    out
}

proptest! {
    #[test]
    fn repetition_loop_mask_matches_the_brute_force_definition(
        tokens in prop::collection::vec(0u32..3, 0..40),
        max_pattern in 1usize..6,
        min_repeats in 2usize..5,
        min_span in 0usize..12,
    ) {
        let rule = LoopRule { max_pattern, min_repeats, min_span };
        prop_assert_eq!(repetition_loop_mask(&tokens, rule), brute_force_loops(&tokens, rule));
    }
}

#[test]
fn low_probability_and_ratio_criteria_match_the_thresholds() {
    let ln = f32::ln;
    // Absolute: p_old below 1e-4, whatever the sampler did.
    assert!(is_low_probability(ln(5e-5)), "below 1e-4 under the learner");
    assert!(!is_low_probability(ln(2e-4)), "above 1e-4");
    // Ratio: the sampler over 20x more confident than the learner, whatever the absolute level.
    assert!(
        is_ratio_error(ln(0.01), ln(0.3)),
        "sampler 30x more confident"
    );
    assert!(
        !is_ratio_error(ln(0.02), ln(0.3)),
        "15x is within the 20x limit"
    );
    assert!(
        !is_ratio_error(ln(0.9), ln(0.01)),
        "the learner more confident is not a ratio error"
    );
    assert!(
        !is_ratio_error(ln(5e-5), ln(5e-5)),
        "no mismatch, no ratio error, however unlikely the token"
    );
    assert!(
        !is_low_probability(ln(0.01)),
        "a 30x ratio on a 1% token is not low-probability"
    );
}

/// Each criterion counted on its own, and the union counting a token once however many criteria it meets.
#[test]
fn error_token_metrics_match_hand_counts() {
    let ln = f32::ln;
    // Row 0 (5 response tokens), ids "1 2 2 2 3":
    //   t0: p_old 0.01, p_roll 0.3          -> ratio (30x)
    //   t1..t3: the loop "2 2 2"             -> repetition; t2 also has p_old = p_roll = 5e-5 -> low-prob
    //   t4: p_old 1e-5 = p_roll             -> low-prob
    // Row 1 (3 of 5 positions are response tokens), ids "9 8 7":
    //   t0: p_old 5e-5, p_roll 0.5          -> low-prob and ratio
    //   t1: p_old 0.9, p_roll 0.01          -> nothing (the learner is the more confident one)
    //   t2: clean
    // Row 2: no response tokens.
    // Counts over 8 tokens: repetition 3, low-prob 3, ratio 2, any 6 (row 0: all 5; row 1: 1).
    let ids = [1, 2, 2, 2, 3, 9, 8, 7, 9, 9, 9, 9, 9, 9, 9];
    let mut lp_old = [ln(0.5); 15];
    let mut lp_roll = [ln(0.5); 15];
    (lp_old[0], lp_roll[0]) = (ln(0.01), ln(0.3));
    (lp_old[2], lp_roll[2]) = (ln(5e-5), ln(5e-5));
    (lp_old[4], lp_roll[4]) = (ln(1e-5), ln(1e-5));
    (lp_old[5], lp_roll[5]) = (ln(5e-5), ln(0.5));
    (lp_old[6], lp_roll[6]) = (ln(0.9), ln(0.01));
    let mask = [
        true, true, true, true, true, //
        true, true, true, false, false, //
        false, false, false, false, false,
    ];
    let report =
        error_token_metrics(&ids, &lp_old, &lp_roll, &mask, 5, LoopRule::default()).unwrap();
    assert_close(report.repetition_frac, 3.0 / 8.0, 1e-12, "repetition");
    assert_close(report.low_prob_frac, 3.0 / 8.0, 1e-12, "low prob");
    assert_close(report.ratio_frac, 2.0 / 8.0, 1e-12, "ratio");
    assert_close(report.any_frac, 6.0 / 8.0, 1e-12, "any");
    assert_eq!(report.worst_row, Some(0));
    assert_close(report.worst_row_frac, 5.0 / 5.0, 1e-12, "worst row");
    // The worst row's criteria token by token, the example the logs show.
    let flags: Vec<Vec<&str>> = report.worst_row_tokens.iter().map(|f| f.names()).collect();
    assert_eq!(
        flags,
        [
            vec!["ratio"],
            vec!["repetition"],
            vec!["low_prob", "repetition"],
            vec!["repetition"],
            vec!["low_prob"],
        ]
    );
    let map = report.to_map();
    for (key, value) in [
        (names::REPETITION_FRAC, 3.0 / 8.0),
        (names::LOW_PROB_FRAC, 3.0 / 8.0),
        (names::RATIO_FRAC, 2.0 / 8.0),
        (names::ANY_ERROR_FRAC, 6.0 / 8.0),
        (names::WORST_RESPONSE_ERROR_FRAC, 1.0),
    ] {
        assert_close(map[key], value, 1e-12, key);
    }
    assert!(
        !map.contains_key(names::LEGACY_ERROR_TOKEN_FRAC),
        "the mixed name is no longer written"
    );

    // Without a mismatch (lp_roll = lp_old, as with the aligned forward) there are no ratio errors, while the
    // learner's own unlikely tokens and the loop remain.
    let same = error_token_metrics(&ids, &lp_old, &lp_old, &mask, 5, LoopRule::default()).unwrap();
    assert_eq!(same.ratio_frac, 0.0);
    assert_close(
        same.low_prob_frac,
        3.0 / 8.0,
        1e-12,
        "low prob without mismatch",
    );
    // Row 0 loses t0 (only a ratio error); row 1 keeps t0 (low-prob): 4 + 1 of 8.
    assert_close(same.any_frac, 5.0 / 8.0, 1e-12, "any without mismatch");

    let clean = error_token_metrics(
        &ids,
        &[ln(0.5); 15],
        &[ln(0.5); 15],
        &[
            false, false, false, false, false, true, true, true, false, false, false, false, false,
            false, false,
        ],
        5,
        LoopRule::default(),
    )
    .unwrap();
    assert_eq!((clean.any_frac, clean.worst_row), (0.0, None));
    assert!(clean.worst_row_tokens.is_empty());
    assert!(
        error_token_metrics(&ids[..14], &lp_old, &lp_roll, &mask, 5, LoopRule::default()).is_err()
    );

    // Ties go to the first row: rows 2 and 3 both loop on every token.
    let ids = [1, 2, 3, 6, 6, 6, 7, 7, 7];
    let report = error_token_metrics(
        &ids,
        &[-1.0; 9],
        &[-1.0; 9],
        &[true; 9],
        3,
        LoopRule::default(),
    )
    .unwrap();
    assert_eq!((report.worst_row, report.worst_row_frac), (Some(1), 1.0));
}

// ---------------------------------------------------------------------------------------------------------
// MoE routing

#[test]
fn routing_disagreement_counts_differing_expert_sets() {
    // Three layers: dense, MoE (top-2, 3 tokens), MoE. Layer 1: token 0 swaps slot order (same set: agrees),
    // token 1 picks expert 5 instead of 4 (differs). Layer 2: token 1 differs.
    let rollout = vec![
        None,
        Some(vec![2, 1, 3, 4, 5, 6]),
        Some(vec![0, 1, 0, 1, 0, 1]),
    ];
    let training = vec![
        None,
        Some(vec![1, 2, 3, 5, 5, 6]),
        Some(vec![0, 1, 7, 1, 0, 1]),
    ];
    let d = routing_disagreement(&rollout, &training, 2).unwrap();
    assert_eq!(
        d,
        RoutingDisagreement {
            differing: 2,
            decisions: 6
        }
    );
    assert_eq!(d.fraction(), Some(2.0 / 6.0));
    assert_eq!((d + d).fraction(), Some(2.0 / 6.0));
    assert_eq!((d + d).decisions, 12);
    assert_eq!(
        routing_disagreement(&rollout, &rollout, 2)
            .unwrap()
            .fraction(),
        Some(0.0)
    );
    assert_eq!(
        routing_disagreement(&[None], &[None], 2)
            .unwrap()
            .fraction(),
        None,
        "dense model"
    );
    assert!(routing_disagreement(&rollout, &training[..2], 2).is_err());
    assert!(routing_disagreement(&[Some(vec![1, 2])], &[None], 2).is_err());
    assert!(routing_disagreement(&[Some(vec![1, 2, 3])], &[Some(vec![1, 2, 3])], 2).is_err());
}
