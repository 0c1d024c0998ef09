use super::*;
use crate::tasks::{DatasetConfig, TaskConfig};
use crate::train::TrainConfig;

const QUESTIONS: [&str; 4] = ["1 + 1?", "2 + 2?", "3 + 3?", "4 + 4?"];

/// [`compare_arms`] of two arms given as (name, evaluations).
fn compare(
    a: (&str, &[Evaluation]),
    b: (&str, &[Evaluation]),
    fixed_b: bool,
) -> anyhow::Result<String> {
    compare_arms(
        &Arm {
            name: a.0,
            seeds: a.1,
        },
        &Arm {
            name: b.0,
            seeds: b.1,
        },
        fixed_b,
    )
}

/// A run directory whose task holds out `QUESTIONS` (a data file of its own), with two evaluations:
/// step 0 in int4 and f32 (without the questions' fingerprint, as logs before it), step 40 in int4 only.
fn write_run(dir: &Path, first: &str, last: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let questions: Vec<String> = QUESTIONS.iter().map(|q| q.to_string()).collect();
    let data = dir.join("data.jsonl");
    let lines: Vec<String> = QUESTIONS
        .iter()
        .map(|q| serde_json::json!({"question": q, "answer": "#### 2"}).to_string())
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let mut cfg = TrainConfig::from_toml(crate::train::config::DEFAULT_CONFIG, "default").unwrap();
    cfg.task = TaskConfig::Gsm8k(DatasetConfig {
        path: dir.join("train.jsonl"),
        eval_path: Some(data),
        eval_fraction: None,
        template: Default::default(),
        on_bad_line: Default::default(),
        strip_calculator_annotations: true,
    });
    std::fs::write(
        dir.join("train.jsonl"),
        serde_json::json!({"question": "9 + 9?", "answer": "#### 18"}).to_string(),
    )
    .unwrap();
    cfg.eval.problems = 200;
    // Its last evaluation (below) is the one at its end.
    cfg.train.steps = 40;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    let rows = [
        serde_json::json!({"phase": "eval", "step": 0, "eval/int4-g32/greedy_correct": first,
            "eval/f32/greedy_correct": "1111"}),
        serde_json::json!({"phase": "rl", "step": 1}),
        serde_json::json!({"phase": "eval", "step": 40, "eval/int4-g32/greedy_correct": last,
            "eval/questions_fingerprint": crate::tasks::questions_fingerprint(&questions)}),
    ];
    let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    // The last line cut short, as a run killed while writing leaves it.
    let text = text.join("\n") + "\n{\"phase\": \"rl\", \"st";
    std::fs::write(dir.join("metrics.jsonl"), text).unwrap();
}

/// A `qarl eval --output` file over `questions` with these outcomes.
fn write_eval(path: &Path, questions: &[&str], correct: &str) {
    write_eval_in(path, questions, correct, None);
}

/// [`write_eval`] whose summary records `precision`.
fn write_eval_in(path: &Path, questions: &[&str], correct: &str, precision: Option<&str>) {
    let problems: Vec<serde_json::Value> = questions
        .iter()
        .zip(correct.chars())
        .map(|(q, c)| serde_json::json!({"question": q, "correct": c == '1', "response": "x"}))
        .collect();
    let out = serde_json::json!({"summary": {"precision": precision}, "problems": problems});
    std::fs::write(path, out.to_string()).unwrap();
}

#[test]
fn a_runs_evaluations_are_read_by_row_and_precision_with_its_tasks_questions() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run, "0100", "1101");
    let spec = run.display().to_string();
    let last = Evaluation::load(&spec, None).unwrap();
    assert_eq!(last.correct, [true, true, false, true]);
    assert_eq!(last.questions, QUESTIONS);
    let first = Evaluation::load(&format!("{spec}@first"), None).unwrap();
    assert_eq!(first.correct, [false, true, false, false]);
    assert_eq!(Evaluation::load(&format!("{spec}@40"), None).unwrap(), last);
    let f32 = Evaluation::load(&format!("{spec}@0"), Some("f32")).unwrap();
    assert_eq!(f32.correct, [true; 4]);
    let err = |s: String, p: Option<&str>| format!("{:#}", Evaluation::load(&s, p).unwrap_err());
    let at_7 = err(format!("{spec}@7"), None);
    assert!(
        at_7.contains("no held-out evaluation (at step 7); it has them at steps "),
        "{at_7}"
    );
    assert!(
        err(format!("{spec}@later"), None).contains("expected `@first`, `@last` or a step number")
    );
    assert!(err(spec.clone(), Some("f32")).contains("has no `eval/f32/greedy_correct`"));
    // A value that is there but no outcome string is named as such, not as missing.
    let metrics = run.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).unwrap();
    std::fs::write(&metrics, text.replace("\"1101\"", "\"0x10\"")).unwrap();
    assert!(err(spec.clone(), None)
        .contains("has `eval/int4-g32/greedy_correct` = \"0x10\", not an outcome string"));
    std::fs::write(&metrics, text).unwrap();
    // A run without the evaluation at its end (still training, or stopped early: here `train.steps`
    // is past its last evaluation) is refused under its bare name, not represented by an earlier
    // evaluation; named by row, it is taken.
    let config = run.join("config.json");
    let saved = std::fs::read_to_string(&config).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&saved).unwrap();
    // A config whose end is before the log's last evaluation (edited): not the log's config.
    cfg["train"]["steps"] = 0.into();
    std::fs::write(&config, cfg.to_string()).unwrap();
    let refused = err(spec.clone(), None);
    assert!(
        refused.contains("its evaluations go on to step 40, past the run's end")
            && refused.contains("`train.steps` = 0"),
        "{refused}"
    );
    cfg["train"]["steps"] = 60.into();
    std::fs::write(&config, cfg.to_string()).unwrap();
    let refused = err(spec.clone(), None);
    assert!(
        refused.contains("no evaluation at the run's end (step 60")
            && refused.contains("its last is at step 40")
            && refused.contains(&format!("{spec}@40")),
        "{refused}"
    );
    assert_eq!(
        Evaluation::load(&format!("{spec}@last"), None).unwrap(),
        last
    );
    std::fs::write(&config, saved).unwrap();
    assert!(err(format!("{spec}/missing.json"), None).contains("no such file"));
    std::fs::create_dir_all(tmp.path().join("empty")).unwrap();
    let empty = tmp.path().join("empty").display().to_string();
    assert!(err(empty, None).contains("not a run directory (no config.json)"));
}

#[test]
fn a_run_whose_questions_changed_since_its_evaluation_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run, "0100", "1101");
    let spec = run.display().to_string();
    Evaluation::load(&spec, None).unwrap();
    // The same number of held-out problems, one question edited.
    let edited: Vec<String> = ["1 + 1?", "2 + 2?", "3 + 30?", "4 + 4?"]
        .iter()
        .map(|q| serde_json::json!({"question": q, "answer": "#### 2"}).to_string())
        .collect();
    std::fs::write(run.join("data.jsonl"), edited.join("\n")).unwrap();
    let e = format!("{:#}", Evaluation::load(&spec, None).unwrap_err());
    assert!(
        e.contains("step 40 logged questions") && e.contains("data files changed"),
        "{e}"
    );
    // The step-0 row logged no fingerprint (an older log): only the count can be checked.
    let first = Evaluation::load(&format!("{spec}@first"), None).unwrap();
    assert_eq!(first.questions[2], "3 + 30?");
}

#[test]
fn an_eval_file_in_another_precision_than_asked_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("e.json");
    write_eval_in(&path, &QUESTIONS, "0100", Some("int4-g32"));
    let spec = path.display().to_string();
    let e = Evaluation::load(&spec, Some("int4-g32")).unwrap();
    assert_eq!(e.precision.as_deref(), Some("int4-g32"));
    let err = format!("{:#}", Evaluation::load(&spec, Some("f32")).unwrap_err());
    assert!(
        err.contains("an evaluation in int4-g32, but --precision asks for f32"),
        "{err}"
    );
}

#[test]
fn arms_are_compared_by_problem_with_the_reports_statistics() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_run(&run, "0100", "1101");
    let (e1, e2) = (tmp.path().join("e1.json"), tmp.path().join("e2.json"));
    write_eval(&e1, &QUESTIONS, "0100");
    write_eval(&e2, &QUESTIONS, "0000");
    let load = |p: &Path| Evaluation::load(&p.display().to_string(), None).unwrap();
    let (a, b) = ([load(&run)], [load(&e1), load(&e2)]);
    // B per problem: [0, .5, 0, 0]; A - B = [1, .5, 0, 1], mean 0.625, sample variance
    // (0.140625 + 0.015625 + 0.390625 + 0.140625) / 3 = 0.229167, SE sqrt(0.229167 / 4) = 0.239. One
    // seed against two: the paired t-test, t = 0.625 / 0.239 on 3 degrees of freedom, p = 0.0796
    // (scipy's ttest_1samp).
    let text = compare(("run", &a), ("evals", &b), false).unwrap();
    assert!(
        text.contains("run (1 seed, int4-g32): per seed 0.750"),
        "{text}"
    );
    assert!(
        text.contains(
            "evals (2 seeds, precision not recorded): per seed 0.250 0.000; 0.125 ± 0.125 over 4 problems"
        ),
        "{text}"
    );
    assert!(
        text.contains("run − evals: +0.625 ± 0.239 (3 vs 0 problems; t-test p 8.0e-2)"),
        "{text}"
    );
    assert!(
        !text.contains("with seeds"),
        "one seed of A: no seed spread: {text}"
    );
    // B one fixed model: A's seeds [0.25, 0] alone give sd 0.177 / sqrt(2) = 0.125; d = [-1, -.5, 0, -1],
    // SE over problems 0.239 as above; together sqrt(0.0573 + 0.0156) = 0.270.
    let fixed = compare(("evals", &b), ("run", &a), true).unwrap();
    assert!(
        fixed.contains("with seeds -0.625 ± 0.270 (2 vs 1 seeds; seeds alone ± 0.125)"),
        "{fixed}"
    );
    let e = compare(("run", &a), ("evals", &b), true).unwrap_err();
    assert!(
        e.to_string().contains("one fixed model, but it has 2"),
        "{e}"
    );
    // The warm start's evaluation reproduced by another command: identical; the last one is not.
    check_identical(&[
        &load(&e1),
        &Evaluation::load(&format!("{}@first", run.display()), None).unwrap(),
    ])
    .unwrap();
    let e = check_identical(&[&load(&e1), &load(&run)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("differ on 2 problem(s) (first: problem 1)"),
        "{e}"
    );
}

#[test]
fn evaluations_of_other_problems_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let (e1, e2, e3) = (
        tmp.path().join("e1.json"),
        tmp.path().join("e2.json"),
        tmp.path().join("e3.json"),
    );
    write_eval(&e1, &QUESTIONS, "0100");
    write_eval(&e2, &["1 + 1?", "2 + 2?", "5 + 5?", "4 + 4?"], "0100");
    write_eval(&e3, &QUESTIONS[..3], "010");
    let load = |p: &Path| Evaluation::load(&p.display().to_string(), None).unwrap();
    let arm = |e: &[Evaluation]| compare(("a", &e[..1]), ("b", &e[1..]), false);
    let e = arm(&[load(&e1), load(&e2)]).unwrap_err().to_string();
    assert!(
        e.contains("list different problems: problem 3 is \"3 + 3?\""),
        "{e}"
    );
    let e = arm(&[load(&e1), load(&e3)]).unwrap_err().to_string();
    assert!(
        e.contains("has 4 problems") && e.contains("has 3 (the first 3 agree)"),
        "{e}"
    );
    std::fs::write(&e3, "{\"rows\": []}").unwrap();
    let e = format!(
        "{:#}",
        Evaluation::load(&e3.display().to_string(), None).unwrap_err()
    );
    assert!(
        e.contains("e3.json") && e.contains("expected a `qarl eval --output` file"),
        "{e}"
    );
}

/// How the prompts were rendered, where recorded: one arm's seeds prompted differently are refused
/// (they were pooled as seeds of one measurement), and two arms prompted differently are compared
/// with a line that says so.
#[test]
fn prompts_are_one_per_arm_and_shown_where_arms_differ() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, summary: serde_json::Value| {
        let path = tmp.path().join(name);
        let problems: Vec<serde_json::Value> = [("1 + 1?", true), ("2 + 2?", false)]
            .iter()
            .map(|(q, c)| serde_json::json!({"question": q, "correct": c}))
            .collect();
        std::fs::write(
            &path,
            serde_json::json!({"summary": summary, "problems": problems}).to_string(),
        )
        .unwrap();
        Evaluation::load(&path.display().to_string(), None).unwrap()
    };
    let chat = write("chat.json", serde_json::json!({"template": "chat"}));
    let system = write(
        "sys.json",
        serde_json::json!({"template": "chat", "system": "Be brief."}),
    );
    let plain = write("plain.json", serde_json::json!({"template": "plain"}));
    let old = write("old.json", serde_json::json!({}));
    assert_eq!(system.prompt.as_deref(), Some("chat, system \"Be brief.\""));
    let e = compare(
        ("a", &[chat.clone(), system]),
        ("b", std::slice::from_ref(&plain)),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("seeds of a, were prompted differently (chat and chat, system \"Be brief.\")"),
        "{e}"
    );
    let text = compare(("a", &[chat.clone(), old]), ("b", &[plain]), false).unwrap();
    assert!(
        text.contains("prompted differently: a with chat; b with plain"),
        "{text}"
    );
    let same = compare(
        ("a", std::slice::from_ref(&chat)),
        ("b", std::slice::from_ref(&chat)),
        false,
    );
    assert!(!same.unwrap().contains("prompted differently"));
}

/// What an eval file records beside its outcomes is read: golds that differ between evaluations of one
/// question (two data sets), a summary accuracy its outcomes contradict (an edited file), and the
/// activations, which the arm's label shows.
#[test]
fn eval_files_are_checked_against_what_they_record() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, golds: [&str; 2], accuracy: f64, activations: &str| {
        let path = tmp.path().join(name);
        let problems: Vec<serde_json::Value> =
            [("1 + 1?", golds[0], true), ("2 + 2?", golds[1], false)]
                .iter()
                .map(|(q, g, c)| serde_json::json!({"question": q, "gold": g, "correct": c}))
                .collect();
        let summary = serde_json::json!({"precision": "int4-g32", "activations": activations,
            "accuracy": accuracy});
        std::fs::write(
            &path,
            serde_json::json!({"summary": summary, "problems": problems}).to_string(),
        )
        .unwrap();
        path.display().to_string()
    };
    let a = Evaluation::load(&write("a.json", ["2", "4"], 0.5, "f32"), None).unwrap();
    let b = Evaluation::load(&write("b.json", ["2", "5"], 0.5, "bf16"), None).unwrap();
    let e = compare(("a", std::slice::from_ref(&a)), ("b", &[b]), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("grade problem 2 (\"2 + 2?\") against different gold answers (\"4\" and \"5\")"),
        "{e}"
    );
    let e = format!(
        "{:#}",
        Evaluation::load(&write("c.json", ["2", "4"], 1.0, "f32"), None).unwrap_err()
    );
    assert!(
        e.contains("c.json: its summary's accuracy 1 is not that of its problems' outcomes (0.5)"),
        "{e}"
    );
    // So is a problem count the list contradicts (a summary edited to -1, or a list cut short).
    for count in [serde_json::json!(-1), serde_json::json!(3)] {
        let path = tmp.path().join("counted.json");
        let mut doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(tmp.path().join("a.json")).unwrap())
                .unwrap();
        doc["summary"]["problems"] = count.clone();
        std::fs::write(&path, doc.to_string()).unwrap();
        let e = format!(
            "{:#}",
            Evaluation::load(&path.display().to_string(), None).unwrap_err()
        );
        assert!(
            e.contains(&format!("its summary counts {count} problems but lists 2")),
            "{e}"
        );
    }
    // Outcomes judged under other verifier rules are two measurements.
    let mut strict = a.clone();
    strict.source = "strict.json".into();
    strict.identity = "strict.json".into();
    strict.verify = Some(serde_json::json!({"answer_from": "marked", "truncated": "scored"}));
    let mut flexible = a.clone();
    flexible.verify = Some(serde_json::json!({"answer_from": "any", "truncated": "scored"}));
    let e = compare(("a", &[flexible]), ("b", &[strict]), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("judged answers under different rules"), "{e}");
    // So are responses stopped at other strings; a source that does not record them is not refused.
    let mut stopped = a.clone();
    stopped.source = "stopped.json".into();
    stopped.identity = "stopped.json".into();
    stopped.stop_strings = Some(vec!["\nQuestion:".into()]);
    let mut unstopped = a.clone();
    unstopped.stop_strings = Some(vec![]);
    let e = compare(
        ("a", &[unstopped.clone()]),
        ("b", &[stopped.clone()]),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("stopped.json at [\"\\nQuestion:\"]") && e.contains("a.json stopped"),
        "{e}"
    );
    let mut unrecorded = stopped.clone();
    unrecorded.stop_strings = None;
    assert!(compare(("a", &[unstopped]), ("b", &[unrecorded]), false).is_ok());
    // And responses allowed other token limits; a source that does not record its limit is not refused.
    let mut short = a.clone();
    short.source = "short.json".into();
    short.identity = "short.json".into();
    short.max_new_tokens = Some(4);
    let mut long = a.clone();
    long.max_new_tokens = Some(8);
    let e = compare(("a", &[long.clone()]), ("b", &[short.clone()]), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("to 8 tokens and short.json to 4"), "{e}");
    short.max_new_tokens = None;
    assert!(compare(("a", &[long]), ("b", &[short]), false).is_ok());
    let bf16 = Evaluation::load(&write("d.json", ["2", "4"], 0.5, "bf16"), None).unwrap();
    let text = compare(("a", &[a]), ("b", &[bf16]), false).unwrap();
    assert!(
        text.contains("b (1 seed, int4-g32 with bf16 activations)"),
        "{text}"
    );
}
