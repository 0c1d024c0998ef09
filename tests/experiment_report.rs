//! The experiment report's statistics on synthetic finished runs, against values worked out by hand:
//! accuracies with problem-clustered standard errors, arms compared by final accuracy paired by problem,
//! and the separated error-token fractions (old logs with only the mixed key included).

use std::path::Path;

use qarl::train::experiment::{write_report, ExperimentConfig};

/// Writes a finished run: its config (one RL step; task and number of eval problems, or none), two
/// evaluations (before and after RL, the same outcomes in int4 and f32) and one RL row.
fn write_run(dir: &Path, task: Option<&str>, before: &str, after: &str, rl: serde_json::Value) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("finished.json"), "{}").unwrap();
    // One RL step: the final evaluation is at step 1.
    let mut cfg = serde_json::json!({"train": {"steps": 1}});
    if let Some(kind) = task {
        cfg["task"] = serde_json::json!({"kind": kind});
        cfg["eval"] = serde_json::json!({"problems": after.len()});
    }
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let acc = |s: &str| s.chars().filter(|&c| c == '1').count() as f64 / s.len() as f64;
    let eval = |step: usize, o: &str| {
        serde_json::json!({
            "phase": "eval", "step": step,
            "eval/int4-g32/pass@1_greedy": acc(o), "eval/int4-g32/greedy_correct": o,
            "eval/f32/pass@1_greedy": acc(o), "eval/f32/greedy_correct": o,
        })
    };
    let rows = [eval(0, before), rl, eval(1, after)];
    let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(dir.join("metrics.jsonl"), text.join("\n") + "\n").unwrap();
}

fn rl_row(errors: &[(&str, f64)]) -> serde_json::Value {
    let mut row = serde_json::json!({"phase": "rl", "step": 1, "rollout_corr/k3_kl": 0.0});
    for (k, v) in errors {
        row[*k] = serde_json::json!(v);
    }
    row
}

#[test]
fn report_clusters_by_problem_and_pairs_arms_by_final_accuracy() {
    let tmp = tempfile::tempdir().unwrap();
    let results = tmp.path();
    let exp: ExperimentConfig = toml::from_str(
        r#"
name = "stats"
base = "unused.toml"
seeds = [1, 2, 3]
[[variant]]
name = "A"
[[variant]]
name = "B"
about = "int4 + TIS"
set = { "rollout.precision" = "int4-g32", "train.loss.corrections" = [{ kind = "token_tis", cap = 2.0 }] }
[[variant]]
name = "C"
[[variant]]
name = "D"
"#,
    )
    .unwrap();
    let new_keys = rl_row(&[
        ("error_tokens/any_frac", 0.2),
        ("error_tokens/ratio_frac", 0.1),
        ("error_tokens/low_prob_frac", 0.05),
        ("error_tokens/repetition_frac", 0.1),
    ]);
    // An old log: the union under its old name, and a low_prob_frac that also counted ratio errors.
    let old_keys = rl_row(&[
        ("error_tokens/frac", 0.4),
        ("error_tokens/low_prob_frac", 0.3),
        ("error_tokens/repetition_frac", 0.1),
    ]);
    for seed in 1..=3 {
        let dir = |v: &str| results.join(v).join(format!("seed{seed}"));
        // A: every seed ends at [1,1,0,0] from the shared warm start [0,1,0,0].
        write_run(&dir("A"), Some("t"), "0100", "1100", new_keys.clone());
        // B: seeds end at [1,0,0,0], [1,0,0,0], [0,0,0,0].
        let b_after = if seed == 3 { "0000" } else { "1000" };
        write_run(&dir("B"), Some("t"), "0100", b_after, old_keys.clone());
    }
    // C: other problems (another task), 2 seeds; D: one seed's config is missing.
    write_run(
        &results.join("C/seed1"),
        Some("u"),
        "0000",
        "1111",
        new_keys.clone(),
    );
    write_run(
        &results.join("C/seed2"),
        Some("u"),
        "0000",
        "1100",
        new_keys.clone(),
    );
    write_run(
        &results.join("D/seed1"),
        Some("t"),
        "0000",
        "1100",
        new_keys.clone(),
    );
    write_run(&results.join("D/seed2"), None, "0000", "1000", new_keys);

    let report = std::fs::read_to_string(write_report(&exp, results).unwrap()).unwrap();
    println!("{report}");
    let line = |start: &str| -> String {
        report
            .lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no line starting {start:?} in:\n{report}"))
            .to_string()
    };
    // A: per-problem means [1,1,0,0]: 0.5 ± sqrt(1/3)/2 = 0.289 (not the naive 0.151 of 12 pooled outcomes).
    // Before RL: [0,1,0,0], 0.25 ± 0.25. Gain: per problem, seed-averaged after minus before = [1,0,0,0],
    // 0.25 ± sqrt(0.75 / 3 / 4) = 0.25; one problem gained, none lost. Every seed started from the one warm
    // start, so 3 seeds against one model: the paired t-test, t = 1 on 3 degrees of freedom, p = 0.391
    // (scipy: 2 * t.sf(1, 3)), not the sign test's 1.
    let a = line("| A |");
    assert!(
        a.contains("| 3/3 | 0.250 ± 0.250 | 0.500 ± 0.289 | 0.500 ± 0.289 |"),
        "{a}"
    );
    assert!(
        a.contains("| +0.250 ± 0.250 (1 vs 0 problems; t-test p 3.9e-1) |"),
        "{a}"
    );
    // Each seed's final accuracy, rollout precision then f32.
    assert!(
        a.contains("| 0.500 0.500 0.500; 0.500 0.500 0.500 |"),
        "{a}"
    );
    // B: per-problem means [2/3,0,0,0]: 1/6 ± 1/6.
    let b = line("| B |");
    assert!(b.contains("| 0.167 ± 0.167 | 0.167 ± 0.167 |"), "{b}");
    // C: [1,1,.5,.5]: 0.75 ± sqrt(0.25 / 3 / 4) = 0.144.
    assert!(line("| C |").contains("| 0.750 ± 0.144 |"), "{report}");
    // D: problems not known to be shared: mean and sd over seeds of 0.5 and 0.25.
    assert!(
        line("| D |").contains("| 0.375 (sd 0.177 over seeds) |"),
        "{report}"
    );

    // A − B per problem: [1/3, 1, 0, 0], mean 1/3, SE sqrt((6/9) / 3 / 4) = 0.236; A ahead on 2, behind on
    // none; 3 seeds per arm take the paired t-test: t = 1.414 on 3 degrees of freedom, p = 0.252 (scipy's
    // ttest_1samp; A's seeds all end alike, where the sign test's 0.5 would be anti-conservative at scale).
    // The same in f32 (same outcomes).
    let ab = line("| A | B |");
    let cell = "+0.333 ± 0.236 (2 vs 0 problems; t-test p 2.5e-1)";
    // Over seeds: A's accuracies [1/2, 1/2, 1/2], B's [1/4, 1/4, 0] (sd sqrt(3) / 12): Welch SE
    // sqrt(0 / 3 + (3 / 144) / 3) = 1/12; with the SE over problems sqrt(0.236^2 + 1/144) = 0.250.
    let seeds = "+0.333 ± 0.250 (3 vs 3 seeds; seeds alone ± 0.083)";
    assert_eq!(
        ab,
        format!("| A | B | {cell} | {cell} | {seeds} | {seeds} |")
    );
    // Overrides as the TOML that sets them, not a serde dump.
    assert_eq!(line("- `A`:"), "- `A`: (no overrides: the base config)");
    assert_eq!(
        line("- `B`:"),
        "- `B`: int4 + TIS (`rollout.precision = \"int4-g32\"`, \
         `train.loss.corrections = [{ cap = 2.0, kind = \"token_tis\" }]`)"
    );
    // Pairs on different or unknown problems are not compared.
    for pair in ["| A | C |", "| B | C |", "| A | D |", "| C | D |"] {
        assert!(!report.contains(pair), "{pair} in:\n{report}");
    }

    // Error tokens: the separated columns; B's old log gives its union and repetition, but not its mixed
    // low-probability fraction, and no ratio fraction.
    assert!(
        report.contains("| variant | k3 KL | error tokens: any | ratio | low prob | repetition |"),
        "{report}"
    );
    let stability = report.split("| variant | k3 KL").nth(1).unwrap();
    let err_line = |start: &str| stability.lines().find(|l| l.starts_with(start)).unwrap();
    let err_a = err_line("| A |");
    assert!(
        err_a.contains("| 0.200 ± 0.000 | 0.100 ± 0.000 | 0.050 ± 0.000 | 0.100 ± 0.000 |"),
        "{err_a}"
    );
    let err_b = err_line("| B |");
    assert!(
        err_b.contains("| 0.400 ± 0.000 | - | - | 0.100 ± 0.000 |"),
        "{err_b}"
    );

    // The hand-written claims are linked once they exist, and not before.
    assert!(!report.contains("claims.md"), "{report}");
    std::fs::write(results.join("claims.md"), "verdicts").unwrap();
    let report = std::fs::read_to_string(write_report(&exp, results).unwrap()).unwrap();
    assert!(report.contains("[claims.md](claims.md)"), "{report}");
}

/// Adds the questions' fingerprint to a run's two evaluations (before, after), as logs since 2026-12-05
/// carry it; `None` leaves one out (an older log).
fn log_fingerprints(dir: &Path, fingerprints: [Option<&str>; 2]) {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut evals = fingerprints.into_iter();
    let rows: Vec<String> = text
        .lines()
        .map(|l| {
            let mut row: serde_json::Value = serde_json::from_str(l).unwrap();
            if row["phase"] == "eval" {
                if let Some(f) = evals.next().unwrap() {
                    row["eval/questions_fingerprint"] = f.into();
                }
            }
            row.to_string()
        })
        .collect();
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
}

/// Arms of one task config are paired only where the fingerprints their evaluations logged agree (a log
/// without one, from before fingerprints, pairs with either); a run whose evaluations logged different
/// questions is not clustered; a damaged row inside a finished run's log stops the report, naming it.
#[test]
fn report_pairs_only_runs_whose_questions_agree() {
    let tmp = tempfile::tempdir().unwrap();
    let results = tmp.path();
    let exp: ExperimentConfig = toml::from_str(
        r#"
name = "fingerprints"
base = "unused.toml"
seeds = [1, 2]
[[variant]]
name = "E"
[[variant]]
name = "F"
[[variant]]
name = "G"
[[variant]]
name = "H"
"#,
    )
    .unwrap();
    for seed in 1..=2 {
        let dir = |v: &str| results.join(v).join(format!("seed{seed}"));
        for (arm, after, fingerprints) in [
            ("E", "1100", [Some("f1"), Some("f1")]),
            // The same task and count, other questions (the data files changed between the arms).
            ("F", "1000", [Some("f2"), Some("f2")]),
            // Older logs: no fingerprint.
            ("G", "1110", [None, None]),
        ] {
            write_run(&dir(arm), Some("t"), "0100", after, rl_row(&[]));
            log_fingerprints(&dir(arm), fingerprints);
        }
        // H's second seed was resumed over changed data: its evaluations logged different questions.
        write_run(&dir("H"), Some("t"), "0100", "1100", rl_row(&[]));
        let h = if seed == 2 { Some("f2") } else { Some("f1") };
        log_fingerprints(&dir("H"), [Some("f1"), h]);
    }
    let report = std::fs::read_to_string(write_report(&exp, results).unwrap()).unwrap();
    println!("{report}");
    assert!(report.contains("| E | G |"), "{report}");
    assert!(report.contains("| F | G |"), "{report}");
    for pair in ["| E | F |", "| E | H |", "| F | H |", "| G | H |"] {
        assert!(!report.contains(pair), "{pair} in:\n{report}");
    }
    // H: accuracies over seeds only (0.5 both), not clustered by problem.
    let h = report.lines().find(|l| l.starts_with("| H |")).unwrap();
    assert!(h.contains("| 0.500 (sd 0.000 over seeds) |"), "{h}");

    // A row damaged inside a finished run's log is an error naming the file and the line.
    let metrics = results.join("G/seed2/metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).unwrap();
    std::fs::write(
        &metrics,
        text.replacen("{\"phase\":\"rl\"", "{\"phase\":\"r", 1),
    )
    .unwrap();
    let err = format!("{:#}", write_report(&exp, results).unwrap_err());
    assert!(
        err.contains("G/seed2/metrics.jsonl: line 2 is not a metrics row"),
        "{err}"
    );
}

/// A repeated seed or variant name would put two runs in one directory (the report then counting a run
/// twice, or one never made); a name that is not one plain directory name would leave the results
/// directory. Each is refused when the file is read, naming it.
#[test]
fn an_experiment_refuses_shared_run_directories() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("exp.toml");
    let variant = |name: &str| format!("[[variant]]\nname = {name:?}\nset = {{}}\n");
    let cases = [
        ("seeds = [1, 1]", variant("a"), "seed 1 is listed twice"),
        // It was reported as seed -1 when the run's config was built.
        (
            "seeds = [18446744073709551615]",
            variant("a"),
            "seed 18446744073709551615 in `seeds` is beyond a TOML integer's range",
        ),
        (
            "seeds = [1]",
            variant("lr") + &variant("lr"),
            "two variants are named \"lr\"",
        ),
        (
            "seeds = [1]",
            variant("../escaped"),
            "one plain directory name",
        ),
        ("seeds = [1]", variant(""), "one plain directory name"),
        // A misspelt key is named with its line and the closest key, as in a run's config.
        (
            "seed = [1]",
            variant("a"),
            "exp.toml, line 3: unknown key `seed`; did you mean `seeds`?",
        ),
        (
            "seeds = [1]",
            variant("a") + "sett = {}\n",
            "unknown key `variant[0].sett`; did you mean `variant[0].set`?",
        ),
    ];
    for (seeds, variants, want) in cases {
        std::fs::write(
            &file,
            format!("name = \"x\"\nbase = \"base.toml\"\n{seeds}\n{variants}"),
        )
        .unwrap();
        let err = format!("{:#}", ExperimentConfig::load(&file).unwrap_err());
        assert!(
            err.contains(want) && err.contains("exp.toml"),
            "{want}: {err}"
        );
    }
}

/// What the report reads from an eval row is checked: an accuracy outside [0, 1], an outcome string of
/// other characters and an accuracy its own outcomes contradict are errors naming the metrics file, the
/// row and the key (they were averaged into the report, or dropped, without a word).
#[test]
fn damaged_evaluations_are_named_not_averaged() {
    let exp: ExperimentConfig = toml::from_str(
        "name = \"damaged\"\nbase = \"unused.toml\"\nseeds = [1]\n[[variant]]\nname = \"A\"\n",
    )
    .unwrap();
    for (key, value, want) in [
        (
            "eval/int4-g32/pass@1_greedy",
            serde_json::json!(1.7),
            "`eval/int4-g32/pass@1_greedy` is 1.7, not an accuracy in [0, 1]",
        ),
        (
            "eval/f32/mean@4",
            serde_json::json!(-3.0),
            "`eval/f32/mean@4` is -3.0, not an accuracy in [0, 1]",
        ),
        (
            "eval/f32/greedy_correct",
            serde_json::json!("10x0"),
            "`eval/f32/greedy_correct` is not a string of 0s and 1s",
        ),
        (
            "eval/int4-g32/pass@1_greedy",
            serde_json::json!(0.25),
            "`eval/int4-g32/pass@1_greedy` is 0.25 but its `greedy_correct` outcomes give 0.5",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("A/seed1");
        write_run(&run, Some("t"), "0100", "1100", rl_row(&[]));
        let log = run.join("metrics.jsonl");
        let mut rows: Vec<serde_json::Value> = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        rows[2][key] = value;
        let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
        std::fs::write(&log, text.join("\n") + "\n").unwrap();
        let err = format!("{:#}", write_report(&exp, tmp.path()).unwrap_err());
        assert!(
            err.contains(&log.display().to_string())
                && err.contains("the eval row of step 1")
                && err.contains(want),
            "{key}: {err}"
        );
    }
}

/// The evaluations before RL and at the run's end are found by their steps: a finished run without the
/// final one is refused (its pre-RL accuracy was reported as final), and a log whose evaluations go back in
/// steps (the first read as the last) is refused where it is read.
#[test]
fn a_finished_run_reports_the_evaluation_at_its_end() {
    let exp: ExperimentConfig = toml::from_str(
        "name = \"ends\"\nbase = \"unused.toml\"\nseeds = [1]\n[[variant]]\nname = \"A\"\n",
    )
    .unwrap();
    for (edit, want) in [
        (
            "drop the final evaluation",
            "no evaluation at the run's end (step 1, its `train.steps`), though",
        ),
        (
            "swap the evaluations",
            "line 3 is a `eval` row for step 0 after the one for step 1 (line 1)",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("A/seed1");
        write_run(&run, Some("t"), "0100", "1100", rl_row(&[]));
        let log = run.join("metrics.jsonl");
        let mut lines: Vec<String> = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        if edit == "drop the final evaluation" {
            lines.pop();
        } else {
            lines.swap(0, 2);
        }
        std::fs::write(&log, lines.join("\n") + "\n").unwrap();
        let err = format!("{:#}", write_report(&exp, tmp.path()).unwrap_err());
        assert!(
            err.contains(&log.display().to_string()) && err.contains(want),
            "{edit}: {err}"
        );
    }
}

/// Two experiments given one results directory: the second would count the first's finished runs of a
/// variant with the same name as its own (trained under another base) and overwrite its report. The
/// first to run or report marks the directory; the other is refused, naming both experiments.
#[test]
fn a_results_directory_belongs_to_one_experiment() {
    let tmp = tempfile::tempdir().unwrap();
    let results = tmp.path().join("shared");
    let exp = |name: &str| -> ExperimentConfig {
        toml::from_str(&format!(
            "name = {name:?}\nbase = \"unused.toml\"\nseeds = [1]\n[[variant]]\nname = \"A\"\n"
        ))
        .unwrap()
    };
    let first = exp("first");
    first
        .claim_results(Path::new("first.toml"), &results)
        .unwrap();
    let stamp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(results.join("experiment.json")).unwrap())
            .unwrap();
    assert_eq!(stamp["name"], "first");
    // Its own later runs and reports go on.
    first
        .claim_results(Path::new("first.toml"), &results)
        .unwrap();
    let err = format!(
        "{:#}",
        exp("second")
            .claim_results(Path::new("second.toml"), &results)
            .unwrap_err()
    );
    assert!(
        err.starts_with("second.toml:")
            && err.contains("holds the results of experiment \"first\"")
            && err.contains("its own `results_dir`"),
        "{err}"
    );
    // A damaged mark is named, not taken for a free directory.
    std::fs::write(results.join("experiment.json"), "{}").unwrap();
    let err = format!(
        "{:#}",
        first
            .claim_results(Path::new("first.toml"), &results)
            .unwrap_err()
    );
    assert!(
        err.contains("experiment.json: no experiment `name`"),
        "{err}"
    );
}

/// Runs of one data set task made before and after `eval_fraction` was refused beside `eval_path`: the
/// earlier config.json recorded the default fraction there, the later one nothing. The same held-out
/// problems, so the report still clusters and pairs them.
#[test]
fn configs_recorded_before_and_after_eval_fraction_changed_still_pair() {
    let tmp = tempfile::tempdir().unwrap();
    let results = tmp.path();
    let exp: ExperimentConfig = toml::from_str(
        "name = \"versions\"\nbase = \"unused.toml\"\nseeds = [1, 2]\n[[variant]]\nname = \"A\"\n",
    )
    .unwrap();
    for seed in 1..=2 {
        let dir = results.join("A").join(format!("seed{seed}"));
        write_run(&dir, Some("t"), "0100", "1100", rl_row(&[]));
        let mut task = serde_json::json!({"kind": "gsm8k", "path": "train.jsonl",
            "eval_path": "test.jsonl"});
        if seed == 1 {
            task["eval_fraction"] = serde_json::json!(0.1);
        }
        let cfg = serde_json::json!({"task": task, "eval": {"problems": 4}, "train": {"steps": 1}});
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    }
    let report = std::fs::read_to_string(write_report(&exp, results).unwrap()).unwrap();
    let a = report.lines().find(|l| l.starts_with("| A |")).unwrap();
    assert!(!a.contains("over seeds"), "clustered by problem: {a}");
}
