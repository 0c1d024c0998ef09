//! Tests of `qarl::tasks`: the arithmetic generator, the GSM8K / MATH loaders, the templates, the verifier
//! (hand cases and properties) and the character tokenizer.
//!
//! `tests/fixtures/gsm8k_slice.jsonl` is the first 20 lines of GSM8K's `test.jsonl` (openai/grade-school-math,
//! MIT License, Copyright (c) 2021 OpenAI). `tests/fixtures/math_slice.jsonl` is hand-written in the MATH
//! format.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use qarl::tasks::arithmetic::{ArithmeticConfig, Op};
use qarl::tasks::char_tokenizer;
use qarl::tasks::datasets::{self, OnBadLine};
use qarl::tasks::template::{ChatTemplate, PlainTemplate, Template, TemplateConfig};
use qarl::tasks::verify::{self, score, VerifyConfig};
use qarl::tasks::{Task, TaskConfig};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

// ---------------------------------------------------------------------------------------------------------
// arithmetic

/// Independent evaluation of `a+b*c-d` with the standard precedence.
fn eval_expr(expr: &str) -> i128 {
    let mut total: i128 = 0;
    let mut sign: i128 = 1;
    let mut product: Option<i128> = None;
    let mut num = String::new();
    let mut pending_mul = false;
    let flush = |num: &mut String, product: &mut Option<i128>, pending_mul: bool| {
        let v: i128 = num.parse().unwrap();
        num.clear();
        *product = Some(match (*product, pending_mul) {
            (Some(p), true) => p * v,
            _ => v,
        });
    };
    for c in expr.chars() {
        match c {
            '0'..='9' => num.push(c),
            '*' => {
                flush(&mut num, &mut product, pending_mul);
                pending_mul = true;
            }
            '+' | '-' => {
                flush(&mut num, &mut product, pending_mul);
                total += sign * product.take().unwrap();
                pending_mul = false;
                sign = if c == '+' { 1 } else { -1 };
            }
            _ => panic!("unexpected char {c:?} in {expr:?}"),
        }
    }
    flush(&mut num, &mut product, pending_mul);
    total + sign * product.unwrap()
}

fn expr_of(prompt: &str) -> &str {
    prompt
        .strip_prefix("Q: ")
        .and_then(|s| s.strip_suffix("=?\nA:"))
        .unwrap_or_else(|| panic!("bad prompt {prompt:?}"))
}

/// Checks every ` a op b=c.` step of a solution in i128 and returns the `####` value.
fn check_solution(solution: &str) -> i128 {
    assert!(solution.starts_with(' '), "{solution:?}");
    assert!(solution.ends_with('\n'), "{solution:?}");
    let (steps, fin) = solution.rsplit_once("#### ").unwrap();
    for step in steps.split('.').map(str::trim).filter(|s| !s.is_empty()) {
        let (lhs, rhs) = step.split_once('=').unwrap();
        let rhs: i128 = rhs.parse().unwrap();
        // the operator is the first +,-,* after the first character (the left operand may be negative)
        let k = lhs[1..].find(['+', '-', '*']).unwrap() + 1;
        let a: i128 = lhs[..k].parse().unwrap();
        let b: i128 = lhs[k + 1..].parse().unwrap();
        let want = match &lhs[k..k + 1] {
            "+" => a + b,
            "-" => a - b,
            "*" => a * b,
            _ => unreachable!(),
        };
        assert_eq!(want, rhs, "step {step:?} of {solution:?}");
    }
    fin.trim().parse().unwrap()
}

#[test]
fn arithmetic_example_format() {
    // The documented example, reproduced through the public pieces.
    let cfg = ArithmeticConfig {
        min_digits: 1,
        max_digits: 2,
        ops: vec![Op::Add, Op::Mul],
        min_terms: 3,
        max_terms: 3,
        allow_negative: false,
    };
    let ps = cfg.generate(200, 1);
    for p in &ps {
        assert!(p.prompt.starts_with("Q: ") && p.prompt.ends_with("=?\nA:"));
        assert!(p.solution.ends_with(&format!(" #### {}\n", p.answer)));
        assert_eq!(p.full_text(), format!("{}{}", p.prompt, p.solution));
    }
    // e.g. "Q: 37+48*2=?\nA:" -> " 48*2=96. 37+96=133. #### 133\n"
    let p = ps
        .iter()
        .find(|p| {
            let e = expr_of(&p.prompt);
            e.find('+')
                .is_some_and(|i| e.find('*').is_some_and(|j| i < j))
        })
        .expect("some a+b*c");
    let e = expr_of(&p.prompt);
    let (a, bc) = e.split_once('+').unwrap();
    let (b, c) = bc.split_once('*').unwrap();
    let (a, b, c): (i128, i128, i128) =
        (a.parse().unwrap(), b.parse().unwrap(), c.parse().unwrap());
    assert_eq!(
        p.solution,
        format!(
            " {b}*{c}={}. {a}+{}={}. #### {}\n",
            b * c,
            b * c,
            a + b * c,
            a + b * c
        )
    );
}

#[test]
fn arithmetic_is_deterministic_and_seed_dependent() {
    let cfg = ArithmeticConfig::default();
    assert_eq!(cfg.generate(100, 7), cfg.generate(100, 7));
    assert_ne!(cfg.generate(100, 7), cfg.generate(100, 8));
    // generate = prefix of the stream
    let s: Vec<_> = cfg.stream(7).take(30).collect();
    assert_eq!(s, cfg.generate(30, 7));
}

#[test]
fn arithmetic_solutions_are_correct() {
    let mut configs: Vec<ArithmeticConfig> = (0..=5).map(ArithmeticConfig::difficulty).collect();
    configs.push(ArithmeticConfig {
        min_digits: 1,
        max_digits: 3,
        ops: vec![Op::Sub, Op::Mul],
        min_terms: 1,
        max_terms: 6,
        allow_negative: true,
    });
    configs.push(ArithmeticConfig {
        min_digits: 9,
        max_digits: 9,
        ops: vec![Op::Mul],
        min_terms: 4,
        max_terms: 4,
        allow_negative: false,
    });
    configs.push(ArithmeticConfig {
        min_digits: 1,
        max_digits: 2,
        ops: vec![Op::Sub],
        min_terms: 4,
        max_terms: 5,
        allow_negative: false,
    });
    let vocab = char_tokenizer::char_vocab();
    for (ci, cfg) in configs.iter().enumerate() {
        cfg.validate().unwrap();
        for p in cfg.generate(300, 100 + ci as u64) {
            let want = eval_expr(expr_of(&p.prompt));
            assert_eq!(p.answer, want.to_string(), "{p:?}");
            assert_eq!(check_solution(&p.solution), want, "{p:?}");
            if !cfg.allow_negative {
                assert!(!p.solution.contains("=-"), "negative step in {p:?}");
                assert!(want >= 0);
            }
            let v = score(&p.solution, &p.answer, &VerifyConfig::default());
            assert!(v.correct && v.reward == 1.0, "{p:?} {v:?}");
            for c in p.full_text().chars() {
                assert!(
                    vocab.contains(&c.to_string()),
                    "{c:?} not in the char vocab"
                );
            }
        }
    }
}

fn mean_len(cfg: &ArithmeticConfig, f: fn(&qarl::tasks::Problem) -> usize) -> f64 {
    let ps = cfg.generate(400, 3);
    ps.iter().map(f).sum::<usize>() as f64 / ps.len() as f64
}

#[test]
fn arithmetic_difficulty_knobs_change_lengths() {
    let base = ArithmeticConfig {
        min_digits: 1,
        max_digits: 1,
        ops: vec![Op::Add, Op::Sub, Op::Mul],
        min_terms: 2,
        max_terms: 2,
        allow_negative: true,
    };
    let more_digits = ArithmeticConfig {
        min_digits: 3,
        max_digits: 3,
        ..base.clone()
    };
    let more_terms = ArithmeticConfig {
        min_terms: 5,
        max_terms: 5,
        ..base.clone()
    };
    let prompt_len = |p: &qarl::tasks::Problem| p.prompt.len();
    let sol_len = |p: &qarl::tasks::Problem| p.solution.len();
    assert!(mean_len(&more_digits, prompt_len) > mean_len(&base, prompt_len) + 3.0);
    assert!(mean_len(&more_digits, sol_len) > mean_len(&base, sol_len) + 3.0);
    assert!(mean_len(&more_terms, prompt_len) > mean_len(&base, prompt_len) + 5.0);
    assert!(mean_len(&more_terms, sol_len) > 2.0 * mean_len(&base, sol_len));
    // presets grow monotonically
    let lens: Vec<f64> = (0..=4)
        .map(|l| mean_len(&ArithmeticConfig::difficulty(l), sol_len))
        .collect();
    assert!(lens.windows(2).all(|w| w[0] < w[1]), "{lens:?}");
    // exact digit counts
    for p in more_digits.generate(100, 1) {
        for n in expr_of(&p.prompt).split(['+', '-', '*']) {
            assert_eq!(n.len(), 3, "{p:?}");
        }
    }
    for p in more_terms.generate(100, 1) {
        assert_eq!(expr_of(&p.prompt).split(['+', '-', '*']).count(), 5);
    }
}

#[test]
fn arithmetic_config_validation_and_serde() {
    let bad = [
        ArithmeticConfig {
            min_digits: 0,
            ..Default::default()
        },
        ArithmeticConfig {
            min_digits: 3,
            max_digits: 2,
            ..Default::default()
        },
        ArithmeticConfig {
            ops: vec![],
            ..Default::default()
        },
        ArithmeticConfig {
            max_digits: 10,
            max_terms: 4,
            ..Default::default()
        },
        ArithmeticConfig {
            max_digits: 19,
            max_terms: 1,
            min_terms: 1,
            ..Default::default()
        },
    ];
    for b in &bad {
        assert!(b.validate().is_err(), "{b:?}");
        // the generator never panics, even on a bad config
        let _ = b.generate(5, 0);
    }
    let c: ArithmeticConfig =
        serde_json::from_str(r#"{"max_digits": 3, "ops": ["+", "mul"], "allow_negative": true}"#)
            .unwrap();
    assert_eq!(c.max_digits, 3);
    assert_eq!(c.ops, vec![Op::Add, Op::Mul]);
    assert_eq!(c.min_terms, ArithmeticConfig::default().min_terms);
    let e = serde_json::from_str::<ArithmeticConfig>(r#"{"max_digit": 3}"#).unwrap_err();
    assert!(e.to_string().contains("max_digit"), "{e}");
}

// ---------------------------------------------------------------------------------------------------------
// tasks

#[test]
fn task_config_serde() {
    let t: TaskConfig = serde_json::from_str(r#"{"kind": "arithmetic", "max_digits": 3}"#).unwrap();
    match &t {
        TaskConfig::Arithmetic(a) => assert_eq!(a.max_digits, 3),
        other => panic!("{other:?}"),
    }
    let e =
        serde_json::from_str::<TaskConfig>(r#"{"kind": "arithmetic", "digits": 3}"#).unwrap_err();
    assert!(e.to_string().contains("digits"), "{e}");
    let e = serde_json::from_str::<TaskConfig>(r#"{"kind": "poetry"}"#).unwrap_err();
    assert!(e.to_string().contains("poetry"), "{e}");
    let t: TaskConfig = serde_json::from_str(
        r#"{"kind": "gsm8k", "path": "a.jsonl", "template": {"kind": "chat", "system": "Be brief."}}"#,
    )
    .unwrap();
    match &t {
        TaskConfig::Gsm8k(d) => {
            assert_eq!(d.path, PathBuf::from("a.jsonl"));
            assert_eq!(d.on_bad_line, OnBadLine::Error);
            assert_eq!(
                d.template,
                TemplateConfig::Chat(ChatTemplate {
                    model_dir: None,
                    system: Some("Be brief.".into()),
                    enable_thinking: None,
                })
            );
        }
        other => panic!("{other:?}"),
    }
    let e = serde_json::from_str::<TaskConfig>(r#"{"kind": "math", "path": "a", "pth": "b"}"#)
        .unwrap_err();
    assert!(e.to_string().contains("pth"), "{e}");
    let e = serde_json::from_str::<TaskConfig>(r#"{"kind": "math"}"#).unwrap_err();
    assert!(e.to_string().contains("path"), "{e}");
    let rel = t.with_base_dir(Path::new("/cfg"));
    match rel {
        TaskConfig::Gsm8k(d) => assert_eq!(d.path, PathBuf::from("/cfg/a.jsonl")),
        _ => unreachable!(),
    }
}

#[test]
fn arithmetic_task_eval_is_held_out() {
    let cfg = TaskConfig::Arithmetic(ArithmeticConfig::difficulty(2));
    let task = Task::from_config(&cfg).unwrap();
    assert_eq!(task.name(), "arithmetic");
    assert_eq!(task.stop_strings(), vec!["\n".to_string()]);
    let eval = task.eval_set(200);
    assert_eq!(eval.len(), 200);
    assert_eq!(eval, task.eval_set(200));
    assert_eq!(&task.eval_set(50)[..], &eval[..50]);
    let eval_prompts: std::collections::HashSet<_> =
        eval.iter().map(|e| e.prompt.clone()).collect();
    assert_eq!(eval_prompts.len(), eval.len(), "eval is deduplicated");
    for seed in 0..20 {
        let train = task.sample_prompts(500, seed);
        assert_eq!(train.len(), 500);
        for ex in &train {
            assert!(!eval_prompts.contains(&ex.prompt), "{ex:?} is held out");
            let sol = ex.solution.as_deref().unwrap();
            assert!(verify::score(sol, &ex.answer, &VerifyConfig::default()).correct);
        }
    }
    assert_eq!(task.sample_prompts(64, 3), task.sample_prompts(64, 3));
    assert_ne!(task.sample_prompts(64, 3), task.sample_prompts(64, 4));
    // a tiny problem space: eval returns what exists, training still fills its batch
    let tiny = Task::from_config(&TaskConfig::Arithmetic(ArithmeticConfig::difficulty(0))).unwrap();
    let e = tiny.eval_set(1000);
    assert!(!e.is_empty() && e.len() < 100, "{}", e.len());
    assert_eq!(tiny.sample_prompts(300, 1).len(), 300);
    // bad knobs are a clear error
    let bad = TaskConfig::Arithmetic(ArithmeticConfig {
        max_digits: 12,
        max_terms: 5,
        ..Default::default()
    });
    let err = Task::from_config(&bad).unwrap_err().to_string();
    assert!(err.contains("max_digits * max_terms"), "{err}");
}

#[test]
fn dataset_tasks() {
    let cfg: TaskConfig = serde_json::from_value(serde_json::json!({
        "kind": "gsm8k", "path": fixture("gsm8k_slice.jsonl"), "eval_fraction": 0.3
    }))
    .unwrap();
    let task = Task::from_config(&cfg).unwrap();
    let Task::Dataset(d) = &task else { panic!() };
    assert_eq!(d.train().len() + d.eval().len(), 20);
    assert!(!d.eval().is_empty() && !d.train().is_empty());
    let eval = task.eval_set(100);
    assert_eq!(eval.len(), d.eval().len());
    let eval_prompts: std::collections::HashSet<_> =
        eval.iter().map(|e| e.prompt.clone()).collect();
    let train = task.sample_prompts(50, 9);
    assert_eq!(train.len(), 50);
    assert_eq!(train, task.sample_prompts(50, 9));
    for ex in &train {
        assert!(!eval_prompts.contains(&ex.prompt));
        assert!(ex.prompt.starts_with("Question: ") && ex.prompt.ends_with("\nAnswer:"));
        let sol = ex.solution.as_deref().unwrap();
        assert!(sol.starts_with(' ') && !sol.contains("<<"), "{sol:?}");
        assert!(verify::score(sol, &ex.answer, &VerifyConfig::default()).correct);
    }
    // one permutation serves every training record once
    let first: std::collections::HashSet<_> = task
        .sample_prompts(d.train().len(), 1)
        .into_iter()
        .map(|e| e.prompt)
        .collect();
    assert_eq!(first.len(), d.train().len());
    assert_eq!(task.stop_strings(), vec!["\nQuestion:".to_string()]);

    // explicit eval file: its questions are removed from training
    let cfg: TaskConfig = serde_json::from_value(serde_json::json!({
        "kind": "gsm8k", "path": fixture("gsm8k_slice.jsonl"), "eval_path": fixture("gsm8k_slice.jsonl"),
    }))
    .unwrap();
    let err = Task::from_config(&cfg).unwrap_err().to_string();
    assert!(err.contains("no training records"), "{err}");

    // MATH with a chat template
    let cfg: TaskConfig = serde_json::from_value(serde_json::json!({
        "kind": "math", "path": fixture("math_slice.jsonl"), "eval_path": fixture("math_slice.jsonl"),
        "template": {"kind": "chat"}
    }))
    .unwrap();
    assert!(Task::from_config(&cfg).is_err());
    let dir = tempfile::tempdir().unwrap();
    let ev = dir.path().join("eval.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(fixture("math_slice.jsonl"))
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    std::fs::write(&ev, lines[..2].join("\n")).unwrap();
    let cfg: TaskConfig = serde_json::from_value(serde_json::json!({
        "kind": "math", "path": fixture("math_slice.jsonl"), "eval_path": ev,
        "template": {"kind": "chat"}
    }))
    .unwrap();
    let task = Task::from_config(&cfg).unwrap();
    assert_eq!(task.name(), "math");
    let eval = task.eval_set(10);
    assert_eq!(eval.len(), 2);
    assert_eq!(eval[0].answer, "\\frac{3}{4}");
    assert!(eval[0]
        .prompt
        .starts_with("<|im_start|>user\nWhat is $\\frac{1}{2}"));
    assert!(eval[0]
        .prompt
        .ends_with("<|im_end|>\n<|im_start|>assistant\n"));
    assert!(eval[0]
        .solution
        .as_deref()
        .unwrap()
        .ends_with("<|im_end|>\n"));
    let train = task.sample_prompts(9, 0);
    assert!(train
        .iter()
        .all(|e| e.answer != "\\frac{3}{4}" && e.answer != "391"));
    assert_eq!(task.stop_strings(), vec!["<|im_end|>".to_string()]);
    // a missing file names the file
    let cfg: TaskConfig = serde_json::from_value(
        serde_json::json!({"kind": "gsm8k", "path": "/nonexistent/x.jsonl"}),
    )
    .unwrap();
    let err = Task::from_config(&cfg).unwrap_err().to_string();
    assert!(err.contains("/nonexistent/x.jsonl"), "{err}");
}

// ---------------------------------------------------------------------------------------------------------
// loaders

#[test]
fn gsm8k_slice_loads() {
    let recs = datasets::load_gsm8k(fixture("gsm8k_slice.jsonl"), OnBadLine::Error).unwrap();
    assert_eq!(recs.len(), 20);
    let answers: Vec<&str> = recs.iter().map(|r| r.answer.as_str()).collect();
    assert_eq!(
        answers,
        [
            "18", "3", "70000", "540", "20", "64", "260", "160", "45", "460", "366", "694", "13",
            "18", "60", "125", "230", "57500", "7", "6"
        ]
    );
    assert!(recs[0].question.starts_with("Janet"));
    assert!(recs[0].solution.ends_with("#### 18"));
    assert_eq!(recs[0].line, 1);
    assert_eq!(recs[19].line, 20);
    assert_eq!(
        datasets::strip_calculator_annotations("16 - 3 - 4 = <<16-3-4=9>>9 eggs <<x"),
        "16 - 3 - 4 = 9 eggs <<x"
    );
}

/// The loader of `qarl eval` and `qarl mismatch` tells the two formats apart by the first record: each
/// slice reads as its own loader reads it, and a file of neither gets GSM8K's error naming its fields
/// (`qarl eval` on a MATH file said "missing field `question`").
#[test]
fn eval_data_is_read_as_gsm8k_or_math() {
    let both = |name: &str| datasets::load_gsm8k_or_math(fixture(name), OnBadLine::Error).unwrap();
    let answers = |recs: Vec<datasets::Record>| -> Vec<String> {
        recs.into_iter().map(|r| r.answer).collect()
    };
    let math = datasets::load_math(fixture("math_slice.jsonl"), OnBadLine::Error).unwrap();
    assert_eq!(answers(both("math_slice.jsonl")), answers(math));
    let gsm8k = datasets::load_gsm8k(fixture("gsm8k_slice.jsonl"), OnBadLine::Error).unwrap();
    assert_eq!(answers(both("gsm8k_slice.jsonl")), answers(gsm8k));
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other.jsonl");
    std::fs::write(&other, "{\"prompt\": \"1+1\", \"completion\": \"2\"}\n").unwrap();
    let err = datasets::load_gsm8k_or_math(&other, OnBadLine::Error)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("other.jsonl") && err.contains("question"),
        "{err}"
    );
}

#[test]
fn math_slice_loads() {
    let recs = datasets::load_math(fixture("math_slice.jsonl"), OnBadLine::Error).unwrap();
    let answers: Vec<&str> = recs.iter().map(|r| r.answer.as_str()).collect();
    assert_eq!(
        answers,
        [
            "\\frac{3}{4}",
            "391",
            "2\\sqrt{2}",
            "-5",
            "\\frac{\\sqrt{3}}{2}"
        ]
    );
    assert!(verify::answers_equal(&recs[0].answer, "0.75"));
    assert!(verify::answers_equal(
        &recs[4].answer,
        "\\dfrac{\\sqrt{3}}{2}"
    ));
    // the solutions themselves verify
    for r in &recs {
        assert!(
            score(&r.solution, &r.answer, &VerifyConfig::default()).correct,
            "{r:?}"
        );
    }
}

#[test]
fn bad_lines_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"question": "q", "answer": "work\n#### 5"}"#;
    let cases = [
        ("{not json", "not valid JSON"),
        (r#"{"question": "q"}"#, "missing field `answer`"),
        (
            r#####"{"question": 3, "answer": "#### 1"}"#####,
            "`question` is not a string",
        ),
        (r#"{"question": "q", "answer": "no marker"}"#, "####"),
        // An empty question would be prompted as an empty user turn.
        (
            r#####"{"question": " \n ", "answer": "#### 1"}"#####,
            "field `question` is empty",
        ),
        ("[1, 2]", "not a JSON object"),
        // serde_json would keep the second question without a word.
        (
            r#####"{"question": "q", "answer": "#### 1", "question": "other"}"#####,
            "field `question` appears twice",
        ),
        (
            r#####"{"question": "q", "answer": "work\n#### four"}"#####,
            "the final answer after `####` is `four`, not a number",
        ),
        (
            r#####"{"question": "q", "answer": "#### 2\\sqrt{2}"}"#####,
            "not a number",
        ),
        // The verifier would read 1.5: every response of 1500000 scored wrong.
        (
            r#####"{"question": "q", "answer": "#### 1.5 million"}"#####,
            "the gold answer `1.5 million` has the word `million`, which changes the number's value",
        ),
        (
            r#####"{"question": "q", "answer": "#### 3 and a half"}"#####,
            "has the word `half`",
        ),
        // The gold would be 2 (after the last marker), a response's copy of it read as 1 (after its first).
        (
            r#####"{"question": "q", "answer": "x #### 1 ##### 2"}"#####,
            "field `answer` has 2 `####` markers",
        ),
    ];
    for (i, (bad, want)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("bad{i}.jsonl"));
        std::fs::write(&path, format!("{good}\n\n{bad}\n{good}\n")).unwrap();
        let err = datasets::load_gsm8k(&path, OnBadLine::Error)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{}:3:", path.display())) && err.contains(want),
            "{err}"
        );
        let recs = datasets::load_gsm8k(&path, OnBadLine::Skip).unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!((recs[0].line, recs[1].line), (1, 4));
    }
    // non-UTF-8
    let path = dir.path().join("bin.jsonl");
    let mut bytes = format!("{good}\n").into_bytes();
    bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
    std::fs::write(&path, bytes).unwrap();
    let err = datasets::load_gsm8k(&path, OnBadLine::Error)
        .unwrap_err()
        .to_string();
    assert!(err.contains(":2:") && err.contains("UTF-8"), "{err}");
    // MATH without \boxed
    let path = dir.path().join("m.jsonl");
    std::fs::write(
        &path,
        "{\"problem\": \"p\", \"solution\": \"\\\\boxed{1}\"}\n{\"problem\": \"p\", \"solution\": \"\\\\boxed{1\"}\n",
    )
    .unwrap();
    let err = datasets::load_math(&path, OnBadLine::Error)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("{}:2:", path.display())) && err.contains("boxed"),
        "{err}"
    );
    // MATH with an `answer` field and no \boxed
    std::fs::write(
        &path,
        r#"{"problem": "p", "solution": "it is 7", "answer": "7"}"#,
    )
    .unwrap();
    assert_eq!(
        datasets::load_math(&path, OnBadLine::Error).unwrap()[0].answer,
        "7"
    );
    // Both, agreeing (MATH-500: the field is the box, perhaps written otherwise): the box is the gold.
    std::fs::write(
        &path,
        r#"{"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}", "answer": "1/2"}"#,
    )
    .unwrap();
    assert_eq!(
        datasets::load_math(&path, OnBadLine::Error).unwrap()[0].answer,
        "\\frac{1}{2}"
    );
    // Both, disagreeing: which is the gold would be a silent choice.
    std::fs::write(
        &path,
        r#"{"problem": "p", "solution": "so \\boxed{4}", "answer": "5"}"#,
    )
    .unwrap();
    let err = datasets::load_math(&path, OnBadLine::Error)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(":1:") && err.contains("field `answer` is `5` but the solution's last"),
        "{err}"
    );
    // all lines bad + skip -> empty is an error; missing file names the file
    std::fs::write(&path, "garbage\n").unwrap();
    let err = datasets::load_math(&path, OnBadLine::Skip)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no usable records") && err.contains("m.jsonl"),
        "{err}"
    );
    let err = datasets::load_gsm8k(dir.path().join("nope.jsonl"), OnBadLine::Error)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nope.jsonl: cannot read the data set (not found)")
            && !err.contains("os error"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------------------
// templates

#[test]
fn templates_render() {
    let plain = Template::default();
    assert_eq!(
        plain.render_prompt("2+2?").unwrap(),
        "Question: 2+2?\nAnswer:"
    );
    assert_eq!(plain.render_completion("2+2?", "4").unwrap(), " 4");
    let custom = Template::from_config(&TemplateConfig::Plain(PlainTemplate {
        question_prefix: String::new(),
        answer_prefix: "\nA: ".into(),
    }))
    .unwrap();
    assert_eq!(custom.render_prompt("2+2?").unwrap(), "2+2?\nA: ");
    assert_eq!(custom.render_completion("2+2?", "4").unwrap(), "4");
    let chat = Template::chatml();
    assert_eq!(
        chat.render_prompt("2+2?").unwrap(),
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    // The whole turn, as a ChatML model's own template closes it (the next test's).
    assert_eq!(
        chat.render_completion("2+2?", "4").unwrap(),
        "4<|im_end|>\n"
    );
    assert!(chat.completion_closes_turn() && !plain.completion_closes_turn());
    let sys = Template::from_config(&TemplateConfig::Chat(ChatTemplate {
        model_dir: None,
        system: Some("Be brief.".into()),
        enable_thinking: None,
    }))
    .unwrap();
    assert_eq!(
        sys.render_prompt("q").unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    );
    let t: TemplateConfig = serde_json::from_str(r#"{"kind": "plain"}"#).unwrap();
    assert_eq!(t, TemplateConfig::default());
    assert!(serde_json::from_str::<TemplateConfig>(r#"{"kind": "plain", "x": 1}"#).is_err());
}

#[test]
fn chat_template_from_model_dir() {
    let dir = tempfile::tempdir().unwrap();
    // no tokenizer_config.json: ChatML
    assert_eq!(
        Template::chat_from_model_dir(dir.path()).unwrap(),
        Template::chatml()
    );
    // A ChatML template renders as ChatML (without the default system turn some templates add).
    let qwen = r#"{"chat_template": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}", "eos_token": "<|im_end|>"}"#;
    std::fs::write(dir.path().join("tokenizer_config.json"), qwen).unwrap();
    let from_dir = Template::chat_from_model_dir(dir.path()).unwrap();
    assert_eq!(
        from_dir.render_prompt("2+2?").unwrap(),
        Template::chatml().render_prompt("2+2?").unwrap()
    );
    // The whole turn as TRL splits it (its end marker and the newline the template writes after it).
    assert_eq!(
        from_dir.render_completion("2+2?", "4").unwrap(),
        "4<|im_end|>\n"
    );
    let cfg = TemplateConfig::Chat(ChatTemplate {
        model_dir: Some(dir.path().to_path_buf()),
        system: None,
        enable_thinking: None,
    });
    assert!(Template::from_config(&cfg).is_ok());
    // A model folder that is not there is refused, not read as "no template": ChatML.
    let missing = TemplateConfig::Chat(ChatTemplate {
        model_dir: Some(dir.path().join("no-such-model")),
        system: None,
        enable_thinking: None,
    });
    let err = Template::from_config(&missing).unwrap_err().to_string();
    assert!(
        err.contains("no-such-model") && err.contains("`task.template.model_dir` is not a folder"),
        "{err}"
    );
    // A template that renders no prompt the conversation starts with: its prompts render, its SFT
    // completions cannot be split.
    let odd = r#"{"chat_template": "{% if not add_generation_prompt %}X{% endif %}{{ messages[0].content }}"}"#;
    std::fs::write(dir.path().join("tokenizer_config.json"), odd).unwrap();
    let template = Template::from_config(&cfg).unwrap();
    let err = template
        .render_completion("2+2?", "4")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("does not start with its prompt"),
        "{err}"
    );
    // broken JSON
    std::fs::write(dir.path().join("tokenizer_config.json"), "{").unwrap();
    let err = Template::from_config(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("JSON"),
        "{err}"
    );
    // JSON, but not an object: refused, not read as a file without a template (ChatML).
    std::fs::write(dir.path().join("tokenizer_config.json"), "[1, 2]").unwrap();
    let err = Template::from_config(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("must be a JSON object"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------------------
// verifier

#[test]
fn verifier_hand_cases() {
    let cfg = VerifyConfig::default();
    // (response, gold, correct, extracted)
    let cases: &[(&str, &str, bool, Option<&str>)] = &[
        // boxed, last one wins, nested braces
        ("so the answer is \\boxed{42}.", "42", true, Some("42")),
        ("first \\boxed{1} then \\boxed{2}", "2", true, Some("2")),
        ("\\boxed{\\frac{3}{4}}", "0.75", true, Some("\\frac{3}{4}")),
        (
            "\\boxed{\\dfrac{6}{8}}",
            "\\frac{3}{4}",
            true,
            Some("\\dfrac{6}{8}"),
        ),
        ("\\boxed{\\frac34}", "3/4", true, Some("\\frac34")),
        (
            "\\boxed{x = -\\frac{1}{2}}",
            "-0.5",
            true,
            Some("x = -\\frac{1}{2}"),
        ),
        (
            "\\boxed{\\text{18 dollars}}",
            "18",
            true,
            Some("\\text{18 dollars}"),
        ),
        ("\\boxed {7}", "7", true, Some("7")),
        ("\\fbox{7}", "7", true, Some("7")),
        (
            "\\boxed{\\frac{\\sqrt{3}}{2}}",
            "\\frac{\\sqrt{3}}{2}",
            true,
            Some("\\frac{\\sqrt{3}}{2}"),
        ),
        ("\\boxed{2\\sqrt{2}}", "2", false, None),
        // A letter glued to a number, a name glued to a sign, a factorial: expressions, not numbers (on
        // either side: a gold `3x` is compared as text).
        ("\\boxed{3}", "3x", false, Some("3")),
        ("\\boxed{3x}", "3x", true, Some("3x")),
        ("\\boxed{5x}", "5", false, None),
        ("\\boxed{x+5}", "5", false, None),
        ("\\boxed{n-1}", "-1", false, None),
        ("\\boxed{5!}", "5", false, None),
        ("\\boxed{2i}", "2", false, None),
        ("The answer is 42!", "42", true, Some("42")),
        // Non-numeric golds: one-character LaTeX arguments braced, a leading assignment dropped.
        ("\\boxed{\\sqrt2}", "\\sqrt{2}", true, Some("\\sqrt2")),
        (
            "\\boxed{\\frac{\\sqrt3}{2}}",
            "\\frac{\\sqrt{3}}{2}",
            true,
            Some("\\frac{\\sqrt3}{2}"),
        ),
        (
            "\\boxed{x = \\sqrt{2}}",
            "\\sqrt{2}",
            true,
            Some("x = \\sqrt{2}"),
        ),
        ("\\boxed{y = 2x+3}", "2x+3", true, Some("y = 2x+3")),
        ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", false, Some("\\sqrt{3}")),
        ("\\boxed{(1, 2)}", "(1,2)", true, Some("(1, 2)")),
        ("\\boxed{5", "5", true, Some("5")), // unclosed box: falls through to the last number
        ("\\boxed{} the total is 9", "9", true, Some("9")),
        // #### (GSM8K): the first marker
        ("48*2=96. 37+96=133. #### 133", "133", true, Some("133")),
        ("#### 133\nQ: 1+1=?\nA: #### 2", "133", true, Some("133")),
        ("#### 1,000", "1000", true, Some("1,000")),
        ("#### $1,234.50", "1234.5", true, Some("$1,234.50")),
        ("#### 18 dollars", "18", true, Some("18 dollars")),
        ("#### 18.", "18", true, Some("18.")),
        ("#### -7", "-7", true, Some("-7")),
        ("#### +7", "7", true, Some("+7")),
        ("#### \u{2212}7", "-7", true, Some("\u{2212}7")),
        ("#### 7.000", "7", true, Some("7.000")),
        ("#### 50%", "50", true, Some("50%")),
        ("#### 30^\\circ", "30", true, Some("30^\\circ")),
        ("#### 3/4", "\\frac{3}{4}", true, Some("3/4")),
        ("#### 0.75", "3/4", true, Some("0.75")),
        ("#### .5", "1/2", true, Some(".5")),
        ("#### 0.33", "1/3", false, Some("0.33")),
        ("#### 134", "133", false, Some("134")),
        ("#### 5cm", "5", true, Some("5cm")),
        ("#### 1e3", "1000", false, None),
        ("#### banana", "5", false, None),
        ("#### 1/0", "5", false, None),
        ("####\n", "5", false, None),
        // A `####` line that goes on in prose after its number (verl's strict GSM8K score reads the number
        // right after the marker); a space and a digit or a backslash still continue the value.
        ("#### 18 (6 apples + 12 pears)", "18", true, Some("18")),
        ("#### 18 because she bought 3 more", "18", true, Some("18")),
        ("#### 20. Tom has 20 pencils now.", "20", true, Some("20")),
        ("#### 2 \\sqrt{2}", "2", false, None),
        ("#### 1 200", "1200", false, None),
        // Markdown headings are no marker: their step numbers are no answer.
        (
            "#### Step 1: Add the apples\n6 + 12 = 18. So she has 18.",
            "1",
            false,
            Some("18"),
        ),
        (
            "#### Step 1: Add the apples\n6 + 12 = 18. So she has 18.",
            "18",
            true,
            Some("18"),
        ),
        (
            "#### Final Answer\nJanet makes 18 dollars.",
            "18",
            true,
            Some("18"),
        ),
        ("#### Plan\nadd them\n#### 7", "7", true, Some("7")),
        ("#### x = 5", "5", true, Some("x = 5")),
        (
            "#### The answer is 18",
            "18",
            true,
            Some("The answer is 18"),
        ),
        // Units with a slash or a power.
        ("#### $15/hour", "15", true, Some("$15/hour")),
        (
            "\\boxed{60 \\text{ km/h}}",
            "60",
            true,
            Some("60 \\text{ km/h}"),
        ),
        (
            "\\boxed{25 \\text{ cm}^2}",
            "25",
            true,
            Some("25 \\text{ cm}^2"),
        ),
        ("#### 25 m\u{b2}", "25", true, Some("25 m\u{b2}")),
        ("#### 3/4 cup", "0.75", true, Some("3/4 cup")),
        ("#### 5 ^2", "5", false, None),
        // Answer: / answer is
        ("Answer: 42", "42", true, Some("42")),
        ("The answer is 42.", "42", true, Some("42.")),
        ("the ANSWER IS: $5", "5", true, Some("$5")),
        ("**Answer:** 12", "12", true, Some("12")),
        ("Answer:\n\n  17 apples\n", "17", true, Some("17 apples")),
        ("The answer is 3 apples and 4 pears", "3", false, None),
        // An answer phrase's sentence ends after its value, or a parenthesis follows it.
        (
            "The answer is 20. Tom now has 20 pencils.",
            "20",
            true,
            Some("20"),
        ),
        ("Answer: 20 (13 + 7)", "20", true, Some("20")),
        (
            "I think the answer is 5 but wait, 6 is the answer is 6",
            "6",
            true,
            Some("6"),
        ),
        // last number
        ("3 + 4 = 7", "7", true, Some("7")),
        (
            "we get 1,000,000 in total",
            "1000000",
            true,
            Some("1,000,000"),
        ),
        ("it is -12 degrees", "-12", true, Some("-12")),
        (
            "the temperature drops to \u{2212}3 degrees",
            "-3",
            true,
            Some("\u{2212}3"),
        ),
        ("3\u{2212}1 leaves 2", "2", true, Some("2")),
        ("10-3 leaves 7-", "7", true, Some("7")),
        ("x-3", "3", true, Some("3")),
        ("the ratio is 3/4.", "0.75", true, Some("3/4")),
        ("1,2 and 3", "3", true, Some("3")),
        ("1,23", "23", true, Some("23")),
        ("2.50 then 2.5", "2.5", true, Some("2.5")),
        // garbage / empty / wrong
        ("", "5", false, None),
        ("no numbers here", "5", false, None),
        ("\u{1F600}\u{0663}", "3", false, None),
        ("five", "5", false, None),
        ("6", "5", false, Some("6")),
        // A letter x between values is a times sign, and an equation on the marker's line is read at its
        // result; a note's `=` in parentheses or after a sentence end is not the line's.
        ("#### 3 x 4 = 12", "12", true, Some("3 x 4 = 12")),
        ("#### 4 x $5 = $20", "20", true, Some("4 x $5 = $20")),
        (
            "#### 5 x 4 = 20 apples",
            "20",
            true,
            Some("5 x 4 = 20 apples"),
        ),
        (
            "#### 5 apples + 7 apples = 12 apples",
            "12",
            true,
            Some("5 apples + 7 apples = 12 apples"),
        ),
        ("#### 18 eggs (16 - 3 - 4 = 9 eggs)", "18", true, Some("18")),
        ("#### 20. So 4 x 5 = 20", "20", true, Some("20")),
        ("#### 12 = 3 x 4", "3", false, None),
        // An inequality states no value.
        ("\\boxed{x >= 5}", "5", false, None),
        ("\\boxed{x<=5}", "5", false, None),
        ("\\boxed{x != 5}", "5", false, None),
        // Display math on the lines after the marker; an empty box after the answer hides nothing.
        ("The answer is:\n$$\n18\n$$", "18", true, Some("18")),
        ("The answer is:\n\\[\n18\n\\]", "18", true, Some("18")),
        ("\\boxed{18}. Check: \\boxed{}", "18", true, Some("18")),
        // gold formats
        ("#### 1000", "1,000", true, Some("1000")),
        ("#### 5", "$5.00", true, Some("5")),
        ("#### 0", "-0", true, Some("0")),
    ];
    for (resp, gold, correct, extracted) in cases {
        let v = score(resp, gold, &cfg);
        assert_eq!(
            (v.correct, v.extracted.as_deref()),
            (*correct, *extracted),
            "response {resp:?}, gold {gold:?}"
        );
        assert_eq!(v.reward, if *correct { 1.0 } else { 0.0 });
    }
}

#[test]
fn verifier_rewards() {
    let pm = VerifyConfig::plus_minus_one();
    assert_eq!(score("#### 4", "4", &pm).reward, 1.0);
    assert_eq!(score("#### 5", "4", &pm).reward, -1.0);
    let fmt = VerifyConfig {
        correct_reward: 1.0,
        wrong_reward: 0.0,
        format_reward: Some(-0.5),
        ..Default::default()
    };
    assert_eq!(score("#### 4", "4", &fmt).reward, 1.0);
    assert_eq!(score("#### 5", "4", &fmt).reward, 0.0);
    assert_eq!(score("nothing", "4", &fmt).reward, -0.5);
    assert_eq!(score("#### x", "4", &fmt).reward, -0.5);
    let c: VerifyConfig = serde_json::from_str(r#"{"wrong_reward": -1.0}"#).unwrap();
    assert_eq!(c, pm);
    assert!(serde_json::from_str::<VerifyConfig>(r#"{"wrong": -1.0}"#).is_err());
    assert!(VerifyConfig {
        correct_reward: f32::NAN,
        ..Default::default()
    }
    .validate()
    .is_err());
    assert!(pm.validate().is_ok());
    // Equal rewards for right and wrong answers train nothing, unless a format reward or an overlong
    // penalty makes rewards differ.
    let flat = VerifyConfig {
        correct_reward: 0.0,
        ..Default::default()
    };
    let err = flat.validate().unwrap_err().to_string();
    assert!(
        err.contains("correct_reward and wrong_reward are both 0") && err.contains("train nothing"),
        "{err}"
    );
    for differs in [
        VerifyConfig {
            format_reward: Some(-0.5),
            ..flat.clone()
        },
        VerifyConfig {
            overlong_buffer: 4,
            ..flat.clone()
        },
    ] {
        assert!(differs.validate().is_ok(), "{differs:?}");
    }
    for still_flat in [
        VerifyConfig {
            format_reward: Some(0.0),
            ..flat.clone()
        },
        VerifyConfig {
            overlong_buffer: 4,
            overlong_penalty: 0.0,
            ..flat.clone()
        },
    ] {
        assert!(still_flat.validate().is_err(), "{still_flat:?}");
    }
}

/// DAPO's soft overlong punishment, as verl's DAPO reward manager computes it: with a limit of 20 tokens
/// and a buffer of 4, nothing up to 16 tokens, then a linear penalty reaching `overlong_penalty` at 20.
#[test]
fn overlong_reward_is_dapos_soft_punishment() {
    let off = VerifyConfig::default();
    assert_eq!(off.overlong_reward(20, 20), 0.0);
    let dapo = VerifyConfig {
        overlong_buffer: 4,
        ..Default::default()
    };
    for (tokens, want) in [(10, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0)] {
        assert_eq!(dapo.overlong_reward(tokens, 20), want, "{tokens} tokens");
    }
    let half = VerifyConfig {
        overlong_penalty: 0.5,
        ..dapo
    };
    assert_eq!(half.overlong_reward(18, 20), -0.25);
    assert!(VerifyConfig {
        overlong_penalty: f32::INFINITY,
        ..Default::default()
    }
    .validate()
    .is_err());
}

/// `answer_from = "marked"` takes a final answer only from `\boxed{}` or `####` (verl's strict GSM8K
/// score); `truncated = "wrong"` gives a response the token limit cut off no answer, whatever it holds
/// (the last number of a cut sentence, `Sam has 3 + 20`, was read as the answer 20).
#[test]
fn verifier_strictness_options() {
    use verify::{score_response, AnswerFrom, Truncated};
    let any = VerifyConfig::default();
    let marked = VerifyConfig {
        answer_from: AnswerFrom::Marked,
        format_reward: Some(-0.5),
        ..Default::default()
    };
    for (response, any_correct, marked_correct) in [
        ("Sam has 3 + 20", true, false),
        ("The answer is 20", true, false),
        ("so #### 20", true, true),
        ("\\boxed{20}", true, true),
        ("#### 21", false, false),
    ] {
        assert_eq!(
            score(response, "20", &any).correct,
            any_correct,
            "{response}"
        );
        let v = score(response, "20", &marked);
        assert_eq!(v.correct, marked_correct, "{response}");
        // An unmarked answer is no answer: the format reward applies.
        let unmarked = !response.contains("####") && !response.contains("boxed");
        assert_eq!(v.extracted.is_none(), unmarked, "{response}");
        assert_eq!(
            v.reward,
            if marked_correct {
                1.0
            } else if unmarked {
                -0.5
            } else {
                0.0
            }
        );
    }
    let cut = VerifyConfig {
        truncated: Truncated::Wrong,
        ..Default::default()
    };
    assert!(score_response("Sam has 3 + 20", true, "20", &any).correct);
    let v = score_response("Sam has 3 + 20", true, "20", &cut);
    assert!(!v.correct && v.extracted.is_none() && v.reward == 0.0);
    // Finished responses are judged as before.
    assert!(score_response("#### 20", false, "20", &cut).correct);
    let c: VerifyConfig =
        serde_json::from_str(r#"{"answer_from": "marked", "truncated": "wrong"}"#).unwrap();
    assert_eq!(
        (c.answer_from, c.truncated),
        (AnswerFrom::Marked, Truncated::Wrong)
    );
    assert!(serde_json::from_str::<VerifyConfig>(r#"{"answer_from": "strict"}"#).is_err());
}

/// Silent wrong answers a review against verl's reward functions found (2026-12-06), each now read as a
/// reader would: numbered or bold Markdown headings after `####` are headings; a note with an `=` after
/// the stated value does not replace it; `x - 3`, `n + 1`, `a_5` are expressions; a list of assignments is
/// no single value.
#[test]
fn verifier_reads_headings_notes_and_expressions_as_a_reader_would() {
    // (response, gold, correct under `any`, correct under `marked`)
    let cases: &[(&str, &str, bool, bool)] = &[
        (
            "#### 1. Count the apples\nThere are 18.\n#### 18",
            "18",
            true,
            true,
        ),
        (
            "#### 1. Count the apples\nThere are 18.\n#### 18",
            "1",
            false,
            false,
        ),
        ("#### 2) Add\n#### 18", "18", true, true),
        (
            "#### **Step 1: Count**\n16 + 2 = 18\n#### 18",
            "18",
            true,
            true,
        ),
        (
            "#### **Step 1: Count**\n16 + 2 = 18\n#### 18",
            "1",
            false,
            false,
        ),
        ("#### **18**", "18", true, true),
        ("#### 18.", "18", true, true),
        ("#### 2.5 apples", "2.5", true, true),
        ("#### 18 (16 - 3 - 4 = 9 eggs)", "18", true, true),
        ("#### 18 (16 - 3 - 4 = 9 eggs)", "9", false, false),
        ("The answer is 18 (since 2 = 2).", "18", true, false),
        ("#### 5 + 13 = 18", "18", true, true),
        ("#### x = 2 + 3 = 5", "5", true, true),
        ("\\boxed{x - 3}", "-3", false, false),
        ("\\boxed{-3}", "x - 3", false, false),
        ("\\boxed{x-3}", "x - 3", true, true),
        ("\\boxed{n + 1}", "1", false, false),
        ("\\boxed{y = x + 3}", "3", false, false),
        ("The answer is -3", "-3", true, false),
        ("#### - 5", "-5", true, true),
        ("\\boxed{x=2, x=5}", "5", false, false),
        ("\\boxed{x = 2 \\text{ or } x = 5}", "5", false, false),
        ("\\boxed{a_5}", "5", false, false),
        ("\\boxed{_5_}", "5", true, true),
    ];
    check_any_and_marked(cases);
}

#[test]
fn verifier_hostile_inputs() {
    let cfg = VerifyConfig::default();
    // huge numbers: over the digit cap is unparseable, at the cap is fine
    let big = "9".repeat(1000);
    assert!(score(&format!("#### {big}"), &big, &cfg).correct);
    let huge = "9".repeat(1001);
    let v = score(&format!("#### {huge}"), "9", &cfg);
    assert_eq!((v.correct, v.extracted), (false, None));
    let v = score(&huge, "9", &cfg);
    assert_eq!((v.correct, v.extracted), (false, None));
    // a gold answer over the cap is compared as text
    assert!(score(&format!("#### {huge}"), &huge, &cfg).correct);
    let v = score(&format!("#### 0.{}", "1".repeat(2000)), "0.1", &cfg);
    assert_eq!(v.extracted, None);
    // deep nesting, unbalanced braces, many boxes: no recursion, linear time
    let deep = format!(
        "{}{}5{}",
        "{".repeat(200_000),
        "\\boxed{".repeat(100_000),
        "}".repeat(250_000)
    );
    let t = std::time::Instant::now();
    let v = score(&deep, "5", &cfg);
    assert!(v.correct, "{v:?}");
    let unclosed = "\\boxed{".repeat(200_000);
    let _ = score(&unclosed, "5", &cfg);
    let many = "#### answer is 1,".repeat(50_000);
    let _ = score(&many, "1", &cfg);
    let digits = "1,000,".repeat(100_000);
    let _ = score(&digits, "1", &cfg);
    // Heading-like markers on one line: each line is looked at once (was quadratic).
    let headings = "####a".repeat(40_000);
    assert!(!score(&headings, "1", &cfg).correct);
    assert!(t.elapsed().as_secs() < 20, "{:?}", t.elapsed());
    // extracted text is capped
    let long = format!("#### 5{}", " apples".repeat(1000));
    let v = score(&long, "5", &cfg);
    assert!(v.correct);
    assert_eq!(
        v.extracted.unwrap().chars().count(),
        verify::MAX_EXTRACTED_CHARS
    );
    // unicode everywhere
    for s in [
        "\u{0}",
        "\\",
        "\\boxed",
        "\\boxed{\u{10FFFF}}",
        "####\u{2028}5",
        "Ünswer: 5",
        "İanswer is 4",
    ] {
        let _ = score(s, s, &cfg);
        let _ = score(s, "5", &cfg);
    }
    assert!(score("İanswer is 4", "4", &cfg).correct);
}

fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\\boxed{".to_string()),
        Just("\\fbox".to_string()),
        Just("{".to_string()),
        Just("}".to_string()),
        Just("\\{".to_string()),
        Just("####".to_string()),
        Just("answer is".to_string()),
        Just("Answer:".to_string()),
        Just("\\frac".to_string()),
        Just("\\text{".to_string()),
        Just("-".to_string()),
        Just(",".to_string()),
        Just(".".to_string()),
        Just("/".to_string()),
        Just("=".to_string()),
        Just("$".to_string()),
        Just("\n".to_string()),
        Just(" ".to_string()),
        "[0-9]{1,4}",
        "\\PC{0,3}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn verifier_never_panics_on_arbitrary_strings(resp in "\\PC*", gold in "\\PC{0,12}") {
        let v = score(&resp, &gold, &VerifyConfig::default());
        prop_assert!(v.reward == 0.0 || v.reward == 1.0);
        let _ = score(&gold, &resp, &VerifyConfig::plus_minus_one());
    }

    #[test]
    fn verifier_never_panics_on_structured_noise(
        resp in prop::collection::vec(piece(), 0..40),
        gold in prop::collection::vec(piece(), 0..6),
    ) {
        let (resp, gold) = (resp.concat(), gold.concat());
        let _ = score(&resp, &gold, &VerifyConfig::default());
        let _ = score(&gold, &resp, &VerifyConfig::default());
        let _ = verify::parse_answer(&resp);
    }

    #[test]
    fn hashes_of_any_i64_are_correct(n in any::<i64>()) {
        let v = score(&format!("#### {n}"), &n.to_string(), &VerifyConfig::default());
        prop_assert!(v.correct, "{:?}", v);
        let v = score(&format!("#### {}", n as i128 + 1), &n.to_string(), &VerifyConfig::default());
        prop_assert!(!v.correct);
    }

    #[test]
    fn formatting_variants_of_a_rational_are_equal(
        p in -1_000_000i64..1_000_000,
        a in 0u32..4,
        b in 0u32..4,
        odd in prop::sample::select(vec![1i64, 3, 7, 9]),
    ) {
        // q = 2^a 5^b * odd; the decimal variants exist when odd == 1
        let q = 2i64.pow(a) * 5i64.pow(b) * odd;
        let mut variants = vec![
            format!("{p}/{q}"),
            format!("\\frac{{{p}}}{{{q}}}"),
            format!("\\dfrac{{{p}}}{{{q}}}"),
            format!("{}\\frac{{{}}}{{{}}}", if p < 0 { "-" } else { "" }, p.abs(), q),
            format!("{}/{}", 3 * p, 3 * q),
            format!("$\\frac{{{}}}{{{}}}$", 7 * p, 7 * q),
        ];
        if p >= 0 {
            variants.push(format!("+{p}/{q}"));
        }
        if odd == 1 {
            // exact decimal with `digits` fractional digits, plus trailing zeros
            let digits = a.max(b) as usize;
            let scale = 10i128.pow(digits as u32);
            let scaled = p as i128 * (scale / q as i128);
            let sign = if scaled < 0 { "-" } else { "" };
            let (ip, fp) = (scaled.abs() / scale, scaled.abs() % scale);
            let dec = if digits == 0 {
                format!("{sign}{ip}")
            } else {
                format!("{sign}{ip}.{fp:0digits$}")
            };
            variants.push(dec.clone());
            if digits > 0 {
                variants.push(format!("{dec}000"));
            } else {
                variants.push(format!("{dec}.00"));
                variants.push(format!("${dec}"));
                variants.push(format!("{dec} dollars"));
                // thousands separators
                let s = ip.to_string();
                let mut grouped = String::new();
                for (i, c) in s.chars().enumerate() {
                    if i > 0 && (s.len() - i) % 3 == 0 {
                        grouped.push(',');
                    }
                    grouped.push(c);
                }
                variants.push(format!("{sign}{grouped}"));
            }
        }
        for x in &variants {
            for y in &variants {
                prop_assert!(verify::answers_equal(x, y), "{} vs {}", x, y);
                let v = score(&format!("\\boxed{{{x}}}"), y, &VerifyConfig::default());
                prop_assert!(v.correct, "boxed {} vs {}", x, y);
                let v = score(&format!("so #### {x}"), y, &VerifyConfig::default());
                prop_assert!(v.correct, "#### {} vs {}", x, y);
            }
            let other = format!("{}/{}", p + 1, q);
            prop_assert!(!verify::answers_equal(x, &other), "{} vs {}", x, other);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// character tokenizer

#[test]
fn char_tokenizer_round_trips_through_tokenizers() {
    let vocab = char_tokenizer::char_vocab();
    assert_eq!(vocab.len(), char_tokenizer::VOCAB_SIZE);
    assert_eq!(vocab[char_tokenizer::PAD_ID as usize], "<pad>");
    assert_eq!(vocab[char_tokenizer::EOS_ID as usize], "<eos>");
    let unique: std::collections::HashSet<_> = vocab.iter().collect();
    assert_eq!(unique.len(), vocab.len());

    let dir = tempfile::tempdir().unwrap();
    char_tokenizer::save(dir.path()).unwrap();
    let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(tok.get_vocab_size(true), char_tokenizer::VOCAB_SIZE);
    assert_eq!(tok.token_to_id("<eos>"), Some(char_tokenizer::EOS_ID));
    assert_eq!(tok.token_to_id("<pad>"), Some(char_tokenizer::PAD_ID));
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["eos_token"], "<eos>");
    assert_eq!(cfg["pad_token"], "<pad>");

    let mut texts: Vec<String> = ArithmeticConfig::difficulty(4)
        .generate(200, 5)
        .into_iter()
        .map(|p| p.full_text())
        .collect();
    texts.push("Question: Janet's ducks lay 16 eggs.\nAnswer: 16 - 3 = 13 #### 13".into());
    texts.push("  two  spaces\n\nand newlines ~`{}|\\ ".into());
    texts.push(String::new());
    for t in &texts {
        let enc = tok.encode(t.as_str(), false).unwrap();
        let ids = enc.get_ids();
        assert_eq!(ids.len(), t.chars().count(), "{t:?}");
        assert!(
            ids.iter().all(|&i| i > char_tokenizer::UNK_ID),
            "{t:?}: {ids:?}"
        );
        assert_eq!(&tok.decode(ids, false).unwrap(), t);
        // an EOS at the end is dropped by skip_special_tokens
        let mut with_eos = ids.to_vec();
        with_eos.push(char_tokenizer::EOS_ID);
        assert_eq!(&tok.decode(&with_eos, true).unwrap(), t);
        assert_eq!(tok.decode(&with_eos, false).unwrap(), format!("{t}<eos>"));
    }
    // characters outside the vocabulary become <unk>
    let enc = tok.encode("1\u{e9}2", false).unwrap();
    assert_eq!(enc.get_ids()[1], char_tokenizer::UNK_ID);
    // ids are stable: '\n' = 4, ' ' = 5, '0' = 5 + 16
    assert_eq!(tok.encode("\n 0", false).unwrap().get_ids(), &[4, 5, 21]);

    // the crate's loader reads it
    let q = qarl::model::Tokenizer::load_optional(dir.path())
        .unwrap()
        .unwrap();
    let t = &texts[0];
    let ids = q.encode(t).unwrap();
    assert_eq!(&q.decode(&ids).unwrap(), t);
    assert_eq!(q.token_to_id("<eos>"), Some(char_tokenizer::EOS_ID));
    // build() is the same tokenizer
    let b = char_tokenizer::build();
    assert_eq!(b.encode(t.as_str(), false).unwrap().get_ids(), &ids[..]);
}

/// `sft.answer_only_frac`: the answer-only targets verify on every task, the share is what was asked for, the
/// draw is deterministic, and the other examples keep their worked solutions.
#[test]
fn answer_only_solutions_verify_and_mix_in_at_the_asked_rate() {
    use qarl::train::sft::with_answer_only;
    let arith = Task::from_config(&TaskConfig::Arithmetic(ArithmeticConfig::default())).unwrap();
    let gsm = Task::from_config(
        &serde_json::from_value(serde_json::json!({
            "kind": "gsm8k", "path": fixture("gsm8k_slice.jsonl"), "eval_fraction": 0.3
        }))
        .unwrap(),
    )
    .unwrap();
    let math = Task::from_config(
        &serde_json::from_value(serde_json::json!({
            "kind": "math", "path": fixture("math_slice.jsonl"), "eval_fraction": 0.3
        }))
        .unwrap(),
    )
    .unwrap();
    // the plain template puts a space after `Answer:`, as for worked solutions
    for (task, want) in [(&arith, " #### "), (&gsm, " #### "), (&math, " \\boxed{")] {
        for ex in task.sample_prompts(10, 3) {
            let sol = task.answer_only_solution(&ex).unwrap();
            assert!(sol.starts_with(want), "{}: {sol:?}", task.name());
            assert!(
                score(&sol, &ex.answer, &VerifyConfig::default()).correct,
                "{}: {sol:?} for {:?}",
                task.name(),
                ex.answer
            );
        }
    }
    assert_eq!(
        arith
            .answer_only_solution(&arith.sample_prompts(1, 3)[0])
            .unwrap()
            .chars()
            .filter(|&c| c == '.')
            .count(),
        0
    );

    let worked = arith.sample_prompts(4000, 11);
    let mixed = with_answer_only(&arith, worked.clone(), 0.6, 17).unwrap();
    assert_eq!(
        mixed,
        with_answer_only(&arith, worked.clone(), 0.6, 17).unwrap()
    );
    assert_ne!(
        mixed,
        with_answer_only(&arith, worked.clone(), 0.6, 18).unwrap()
    );
    let mut n_short = 0;
    for (m, w) in mixed.iter().zip(&worked) {
        assert_eq!((&m.prompt, &m.answer), (&w.prompt, &w.answer));
        if m.solution != w.solution {
            assert_eq!(
                m.solution.as_deref(),
                Some(arith.answer_only_solution(w).unwrap().as_str())
            );
            n_short += 1;
        }
    }
    let share = n_short as f64 / worked.len() as f64;
    // the binomial SE of 4000 draws at 0.6 is 0.008; single-term problems are already answer-only
    assert!((share - 0.6).abs() < 0.04, "answer-only share {share}");
    assert_eq!(
        with_answer_only(&arith, worked.clone(), 0.0, 17).unwrap(),
        worked
    );
}

/// A held-out question listed twice counts once (its first record), as a run's evaluation takes it and
/// `qarl eval` now does too; a repeat with another gold answer is an error naming both lines.
#[test]
fn repeated_questions_count_once_and_conflicting_golds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dup.jsonl");
    std::fs::write(
        &path,
        "{\"question\": \"legs of a spider?\", \"answer\": \"#### 8\"}\n\
         {\"question\": \"2+2?\", \"answer\": \"#### 4\"}\n\
         {\"question\": \"legs of a spider?\", \"answer\": \"#### 8\"}\n\
         {\"question\": \" legs of  a spider? \", \"answer\": \"#### 8.0\"}\n",
    )
    .unwrap();
    let recs = datasets::load_gsm8k(&path, OnBadLine::Error).unwrap();
    let (unique, repeats) = datasets::unique_questions(recs, &path).unwrap();
    // The same question spaced otherwise, with a gold the verifier reads as equal, is a repeat too.
    assert_eq!(repeats, 2);
    assert_eq!(
        unique.iter().map(|r| r.line).collect::<Vec<_>>(),
        vec![1, 2]
    );
    std::fs::write(
        &path,
        "{\"question\": \"legs of a spider?\", \"answer\": \"#### 8\"}\n\
         {\"question\": \"legs of a spider? \", \"answer\": \"#### 6\"}\n",
    )
    .unwrap();
    let recs = datasets::load_gsm8k(&path, OnBadLine::Error).unwrap();
    let err = datasets::unique_questions(recs, &path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("{}:2:", path.display()))
            && err.contains("question of line 1 again")
            && err.contains("\"6\"")
            && err.contains("\"8\""),
        "{err}"
    );
}

/// A MATH gold boxed without braces (`\boxed 5`, two records of MATH's training set) is read up to the `$`
/// as verl reads it, and the last box wins whichever its form (one such record took an earlier braced
/// box as its gold, the other was refused).
#[test]
fn math_golds_boxed_without_braces_are_read() {
    let line =
        |solution: &str| serde_json::json!({"problem": "p", "solution": solution}).to_string();
    let gold = |solution: &str| datasets::parse_math_line(&line(solution)).map(|r| r.answer);
    assert_eq!(gold("So $x = \\boxed 2$.").unwrap(), "2");
    assert_eq!(gold("First $\\boxed{3}$, then $\\boxed 5$.").unwrap(), "5");
    assert_eq!(gold("First $\\boxed 5$, then $\\boxed{3}$.").unwrap(), "3");
    assert_eq!(gold("$\\boxed{\\frac{1}{2}}$").unwrap(), "\\frac{1}{2}");
    assert_eq!(gold("The end: \\boxed 7\nmore").unwrap(), "7");
    assert!(gold("no box at all").is_err());
}

/// AIME-style rows give the answer as a JSON number; a list or an object there is named.
#[test]
fn math_answers_given_as_numbers_are_read() {
    let parse = |row: serde_json::Value| datasets::parse_math_line(&row.to_string());
    let row = |solution: &str, answer: serde_json::Value| serde_json::json!({"problem": "p", "solution": solution, "answer": answer});
    assert_eq!(
        parse(row("no box", serde_json::json!(42))).unwrap().answer,
        "42"
    );
    assert_eq!(
        parse(row("so $\\boxed{42}$", serde_json::json!(42)))
            .unwrap()
            .answer,
        "42"
    );
    let e = parse(row("so $\\boxed{41}$", serde_json::json!(42)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("field `answer` is `42`"), "{e}");
    assert_eq!(
        parse(row("so $\\boxed{3}$", serde_json::Value::Null))
            .unwrap()
            .answer,
        "3"
    );
    let e = parse(row("so $\\boxed{3}$", serde_json::json!([3])))
        .unwrap_err()
        .to_string();
    assert!(e.contains("neither a string nor a number"), "{e}");
    // An empty solution would teach the warm start to answer nothing, whatever the answer field says.
    let e = parse(row(" ", serde_json::json!(42)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("field `solution` is empty"), "{e}");
}

/// Powers and scientific notation are values (math-verify 0.x agrees on those rows and on
/// `\frac{\sqrt3}2`; it reads `The answer is not 12.` as 12 and `so $\boxed 5$ and 6 left` as 6), a
/// negation or a bound before a number states none, `1/x` is an expression, a stated answer followed by
/// its reason is read at the answer, and an unbraced `\boxed 5` in a response is its answer.
#[test]
fn verifier_reads_powers_bounds_reasons_and_unbraced_boxes() {
    // (response, gold, correct under `any`, correct under `marked`)
    let cases: &[(&str, &str, bool, bool)] = &[
        ("\\boxed{2^{10}}", "1024", true, true),
        ("\\boxed{2^10}", "1024", true, true),
        ("\\boxed{1024}", "2^{10}", true, true),
        ("\\boxed{10^{-3}}", "0.001", true, true),
        ("\\boxed{-2^2}", "-4", true, true),
        ("\\boxed{5^2}", "25", true, true),
        ("\\boxed{2.5\\times10^{3}}", "2500", true, true),
        ("\\boxed{1 \\cdot 10^3}", "1000", true, true),
        ("\\boxed{3 \\times 4}", "3", false, false),
        ("\\boxed{3 \\times 4}", "12", false, false),
        ("\\boxed{2^{100000}}", "2", false, false),
        ("\\boxed{0^{-1}}", "0", false, false),
        ("\\boxed{1/x}", "1", false, false),
        ("\\boxed{1/2}", "0.5", true, true),
        ("\\boxed{\\$15/hour}", "15", true, true),
        ("The answer is not 12.", "12", false, false),
        ("The answer isn't 7.", "7", false, false),
        ("\\boxed{\\text{more than } 5}", "5", false, false),
        ("\\boxed{\\text{at least } 5}", "5", false, false),
        ("The answer is 17, since 10 + 8 = 18.", "17", true, false),
        ("The answer is 17, since 10 + 8 = 18.", "18", false, false),
        ("#### 17 because 9 + 8 = 17", "17", true, true),
        ("#### 17 since 10 + 8 = 18", "18", false, false),
        ("#### 17 since 10 + 8 = 18", "17", true, true),
        ("The answer is x = 5, y = 3", "5", false, false),
        ("so $\\boxed 5$ and 6 left", "5", true, true),
        ("the answer is $\\boxed 5$", "5", true, true),
        (
            "\\boxed{\\frac{\\sqrt3}2}",
            "\\frac{\\sqrt{3}}{2}",
            true,
            true,
        ),
        (
            "\\boxed{\\frac{\\sqrt3}2}",
            "\\frac{\\sqrt{2}}{2}",
            false,
            false,
        ),
        ("\\boxed{(-3)}", "-3", true, true),
        ("\\boxed{(1,2)}", "1", false, false),
        ("\\boxed{(3)(4)}", "3", false, false),
        ("\\boxed{\\cfrac12}", "0.5", true, true),
    ];
    check_any_and_marked(cases);
    // Many unbraced boxes with nothing in them stay linear (each scans only its spaces).
    let many = "\\boxed $".repeat(100_000) + "\\boxed 7";
    assert!(score(&many, "7", &VerifyConfig::default()).correct);
}

/// Each `(response, gold, correct under `answer_from = "any"`, correct under `"marked"`)` case, scored under
/// both rules.
fn check_any_and_marked(cases: &[(&str, &str, bool, bool)]) {
    let cfg = VerifyConfig::default();
    let marked = VerifyConfig {
        answer_from: verify::AnswerFrom::Marked,
        ..VerifyConfig::default()
    };
    for &(response, gold, any, only_marked) in cases {
        assert_eq!(
            score(response, gold, &cfg).correct,
            any,
            "{response:?} against {gold:?} (any)"
        );
        assert_eq!(
            score(response, gold, &marked).correct,
            only_marked,
            "{response:?} against {gold:?} (marked)"
        );
    }
}
