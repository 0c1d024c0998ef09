//! The trainer end to end on a tiny model: config validation, SFT + RL, metrics, checkpoints, resume, the
//! QaRL alignment claim, and HF-format saving.

mod common;

use std::path::Path;

use burn::tensor::Device;
use common::fixtures_dir;
use qarl::host::to_f32_vec;
use qarl::model::Decoder;
use qarl::train::{self, TrainConfig};

/// A small, fast variant of the default config rooted in `dir` (the same one the reliability tests use).
fn tiny_config(dir: &Path, forward: &str, rl_steps: usize) -> TrainConfig {
    TrainConfig::from_toml(&common::tiny_train_toml(dir, forward, rl_steps), "tiny").unwrap()
}

fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn set_overrides_change_the_config_and_bad_ones_are_named() {
    let sets: Vec<String> = [
        "train.lr=1e-4",
        "rollout.precision=fp8-b128",
        "task.ops=[\"add\"]",
        "train.loss.objective = \"gspo\"",
        "train.error_tokens.min_span=7",
        // A key of a table the config leaves out (`[train.advantage]`), whose other keys default.
        "train.advantage.eps=1e-5",
        "rollout.stop=\"template\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cfg = train::load_config(None, &sets).unwrap();
    assert_eq!(cfg.train.lr, 1e-4);
    assert_eq!(
        cfg.train.backend,
        qarl::ops::BackendKind::Flex,
        "the default"
    );
    let on_wgpu = train::load_config(None, &["train.backend=wgpu".to_string()]).unwrap();
    assert_eq!(on_wgpu.train.backend, qarl::ops::BackendKind::Wgpu);
    assert_eq!(cfg.rollout.precision.to_string(), "fp8-b128");
    assert_eq!(cfg.train.error_tokens.min_span, 7);
    assert_eq!(cfg.train.advantage.eps, Some(1e-5));
    assert_eq!(cfg.rollout.stop, qarl::train::config::RolloutStop::Template);
    assert_eq!(
        cfg.train.advantage.estimator,
        qarl::rl::advantages::AdvantageEstimator::Grpo
    );
    let base = train::load_config(None, &[]).unwrap();
    assert_ne!(cfg.train.loss, base.train.loss);
    for (bad, want) in [
        ("train.lrr=1e-4", "lrr"),
        ("train.lr", "key.path=value"),
        (
            "train.lr=1e400",
            "`1e400` is out of the range of a TOML number",
        ),
        (
            "seed=99999999999999999999",
            "out of the range of a TOML number",
        ),
        ("rollout.top_p=.5", "`.5` is not a number as TOML writes it"),
        (
            "train.steps=007",
            "`007` has a leading zero, which TOML does not read in a number: write 7 (or \"007\"",
        ),
        ("rollout.top_p=-00.5", "write -0.5 (or"),
        ("rollout.top_p=00.", "write it as TOML does (e.g. 0.5"),
        ("train..lr=1", "dotted path"),
        ("rollout.precision=int3", "int3"),
        ("rollout.stop=\"strings\"", "`rollout.stop` = \"strings\" is not a valid value; expected one of `end_tokens`, `template`"),
        ("seed.x=1", "not a table"),
        ("train.loss.kl_coef=-0.1", "`kl_coef` must be finite and >= 0"),
        // A group of equal rewards has std 0: with eps 0 its advantages would be 0 / 0.
        (
            "train.advantage={estimator=\"grpo\", eps=0}",
            "`eps` must be finite and > 0",
        ),
        // Logits divided by a tiny temperature are all infinite.
        (
            "rollout.temperature=1e-30",
            "must be a finite number >= 1e-5",
        ),
        // One f32 cannot hold at all (it would be 0).
        (
            "rollout.temperature=1e-46",
            "`rollout.temperature` = 1e-46: no float setting can hold it",
        ),
        ("eval.temperature=1e-6", "`eval.temperature`"),
        // Settings that would do nothing are refused, not ignored.
        (
            "eval={every=20, problems=200, max_new_tokens=40, temperature=0.7}",
            "`eval.temperature` is set with `eval.k` = 0: only the sampled mean@k uses it",
        ),
        (
            "eval={every=20, problems=200, max_new_tokens=40, top_k=5}",
            "`eval.top_k` is set with `eval.k` = 0",
        ),
        ("eval.top_p=0", "`eval.top_p` = 0: must be in (0, 1]"),
        (
            "verify.overlong_buffer=41",
            "`verify.overlong_buffer` = 41: must be <= `rollout.max_new_tokens` = 40",
        ),
        (
            "train.minibatch_size=12",
            "`train.minibatch_size` = 12: must be a multiple of `rollout.samples_per_prompt` = 8",
        ),
        (
            "verify.overlong_penalty=0.5",
            "`verify.overlong_penalty` = 0.5 without `verify.overlong_buffer`",
        ),
        (
            "model={dir=\"m\", base=\"b\", init_std=0.1}",
            "`model.init_std` = 0.1 beside `model.base` = \"b\"",
        ),
        (
            "model={dir=\"m\", init_std=0.1}",
            "`model.init_std` = 0.1 without `model.init_config`",
        ),
        (
            "task={kind=\"gsm8k\", path=\"x.jsonl\", eval_fraction=1.5}",
            "`task.eval_fraction` must be in (0, 1)",
        ),
        // Beside a held-out file nothing of `path` is held out: the fraction was ignored.
        (
            "task={kind=\"gsm8k\", path=\"x.jsonl\", eval_path=\"y.jsonl\", eval_fraction=0.3}",
            "`task.eval_fraction` = 0.3 beside `task.eval_path`",
        ),
    ] {
        let err = format!(
            "{:#}",
            train::load_config(None, &[bad.to_string()]).unwrap_err()
        );
        assert!(err.contains(want), "`{bad}`: expected `{want}` in: {err}");
    }
}

/// The rollout's and the evaluation's sizes are checked before any prompt is drawn: a huge
/// `rollout.prompts_per_step` or `eval.problems` is refused by name (it was an allocation failure after
/// the first evaluation, or a loop drawing problems for hours).
#[test]
fn step_sizes_are_checked_before_any_prompt_is_drawn() {
    let tmp = tempfile::tempdir().unwrap();
    let toml = tmp.path().join("tiny.toml");
    std::fs::write(&toml, common::tiny_train_toml(tmp.path(), "aligned", 1)).unwrap();
    for (set, want) in [
        (
            "rollout.prompts_per_step=100000000000000000",
            "rollout.prompts_per_step / samples_per_prompt",
        ),
        ("eval.problems=100000000000000000", "eval.problems / eval.k"),
    ] {
        let err = common::error_of(
            std::process::Command::new(env!("CARGO_BIN_EXE_qarl"))
                .args(["train", "--quiet", "--overwrite", "--config"])
                .arg(&toml)
                .args(["--set", set]),
        );
        assert!(
            err.contains(want) && err.contains("KV cache"),
            "{set}: {err}"
        );
    }
}

/// A data-set task prompting with the chat template on a model whose files declare none is taken only
/// where the tokenizer has ChatML's tokens: the character tokenizer would spell the markers out.
#[test]
fn training_with_the_chat_template_needs_its_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let data = fixtures_dir().join("../gsm8k_slice.jsonl");
    let task = format!(
        "task={{kind=\"gsm8k\", path=\"{}\", eval_fraction=0.3, template={{kind=\"chat\"}}}}",
        data.display()
    );
    let err = tiny_train_error(tmp.path(), &task);
    assert!(
        err.contains("no chat template, and the tokenizer")
            && err.contains("has no <|im_start|> or <|im_end|> token"),
        "{err}"
    );
}

/// The warm start's checks before any work: a `model.dir` that holds something else than a model, an
/// `init_config` whose vocabulary cannot hold the character tokenizer's ids; and its staging folder is
/// its own (`<model.dir>.qarl-init`, marked): a user's folder of a similar name is left alone, or refused
/// where it would be the staging folder. A warm start whose every step was skipped for a non-finite loss
/// stops with an error even when it is shorter than `max_nonfinite_steps`.
#[test]
fn the_warm_start_checks_its_folders_and_stops_when_nothing_was_learned() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let qarl = || std::process::Command::new(env!("CARGO_BIN_EXE_qarl"));
    let toml = d.join("tiny.toml");
    std::fs::write(&toml, common::tiny_train_toml(d, "aligned", 1)).unwrap();
    let sft = |sets: &[&str]| {
        let mut cmd = qarl();
        cmd.args(["sft", "--quiet", "--config"]).arg(&toml);
        for s in sets {
            cmd.args(["--set", s]);
        }
        cmd
    };
    // A folder beside the model whose name the old staging rule (`model.init`) would have taken.
    std::fs::create_dir_all(d.join("model.init")).unwrap();
    std::fs::write(d.join("model.init/notes.txt"), "mine").unwrap();
    // The staging folder's own name, not made by qarl: refused, not emptied.
    std::fs::create_dir_all(d.join("model.qarl-init")).unwrap();
    std::fs::write(d.join("model.qarl-init/notes.txt"), "mine too").unwrap();
    let err = common::error_of(&mut sft(&[]));
    assert!(
        err.contains("model.qarl-init: exists and is not a staging folder"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(d.join("model.qarl-init/notes.txt")).unwrap(),
        "mine too"
    );
    std::fs::remove_dir_all(d.join("model.qarl-init")).unwrap();
    // A model.dir with other things in it, or a file: refused before the warm start runs.
    std::fs::create_dir_all(d.join("other")).unwrap();
    std::fs::write(d.join("other/x.txt"), "x").unwrap();
    let other = format!("model.dir=\"{}\"", d.join("other").display());
    let err = common::error_of(&mut sft(&[&other]));
    assert!(err.contains("a folder without a config.json"), "{err}");
    // An init config whose vocabulary is smaller than the character tokenizer's.
    let init = d.join("small_vocab.json");
    let mut json: serde_json::Value =
        serde_json::from_str(qarl::train::config::DEFAULT_MODEL_CONFIG).unwrap();
    json["vocab_size"] = serde_json::json!(10);
    std::fs::write(&init, json.to_string()).unwrap();
    let err = common::error_of(&mut sft(&[&format!(
        "model.init_config=\"{}\"",
        init.display()
    )]));
    assert!(
        err.contains("vocab_size 10 is smaller than the character tokenizer's"),
        "{err}"
    );
    // Weights of 1e30: every step non-finite; 2 steps, fewer than the default limit of 5.
    let (nan_run, nan_model) = (d.join("run_nan"), d.join("model_nan"));
    let err = common::error_of(&mut sft(&[
        "model.init_std=1e30",
        "sft.steps=2",
        &format!("run_dir=\"{}\"", nan_run.display()),
        &format!("model.dir=\"{}\"", nan_model.display()),
    ]));
    assert!(
        err.contains("stopping SFT: 2 consecutive steps") && err.contains("every step"),
        "{err}"
    );
    // The failed warm start released its guard and removed the guard's folder.
    assert!(!d.join("model_nan.qarl-init.lock").exists());
    // The warm start that works leaves the user's folder as it was and no staging folder behind.
    assert!(common::stdout_of(&mut sft(&[])).contains("model:"));
    assert!(d.join("model/config.json").is_file());
    assert_eq!(
        std::fs::read_to_string(d.join("model.init/notes.txt")).unwrap(),
        "mine"
    );
    assert!(!d.join("model.qarl-init").exists());
    assert!(!d.join("model/.qarl-staging").exists());
}

/// `train.lp_old_check` is refused where `lp_old` is never the rollout's record (it would check nothing),
/// naming what stops the reuse; accepted in the default run's setup.
#[test]
fn lp_old_check_is_refused_where_there_is_nothing_to_check() {
    let load = |extra: &[&str]| {
        let mut sets = vec!["train.lp_old_check=true".to_string()];
        sets.extend(extra.iter().map(|s| s.to_string()));
        train::load_config(None, &sets)
    };
    assert!(load(&[]).unwrap().train.lp_old_check);
    for (extra, want) in [
        ("train.forward=full", "`train.forward` is \"full\""),
        (
            "train.deterministic=false",
            "`train.deterministic` is false",
        ),
        ("train.epochs=2", "`train.epochs` is 2"),
        (
            "train.minibatch_size=1",
            "`train.minibatch_size` 1 is below",
        ),
    ] {
        let err = format!("{:#}", load(&[extra]).unwrap_err());
        assert!(
            err.contains("train.lp_old_check")
                && err.contains(want)
                && err.contains("check nothing"),
            "{extra}: expected `{want}` in: {err}"
        );
    }
}

/// `rollout.logprobs = "processed"` under top-p records the filtered distribution's log-probs: `lp_old`
/// is then recomputed (never the record), and the aligned forward's k3 against the rollout is the filter's
/// (> 0), where the full record gives exactly 0 on the same samples. `lp_old_check` is refused there.
#[test]
fn processed_rollout_logprobs_are_never_reused_as_lp_old() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, logprobs: &str| {
        let mut cfg = tiny_config(&tmp.path().join("shared"), "aligned", 1);
        cfg.run_dir = tmp.path().join(name);
        cfg.rollout.top_p = 0.9;
        cfg.rollout.logprobs = serde_json::from_value(serde_json::json!(logprobs)).unwrap();
        train::run(&cfg, false, true).unwrap();
        metrics(&cfg.run_dir.join("metrics.jsonl"))
            .into_iter()
            .find(|r| r["phase"] == "rl")
            .unwrap()
    };
    let full = run("full", "full");
    let processed = run("processed", "processed");
    assert_eq!(full["train/lp_old_reused"], 1.0, "{full}");
    assert_eq!(full["rollout_corr/k3_kl"], 0.0, "{full}");
    assert_eq!(processed["train/lp_old_reused"], 0.0, "{processed}");
    assert!(
        processed["rollout_corr/k3_kl"].as_f64().unwrap() > 0.0,
        "{processed}"
    );
    let sets = |extra: &str| {
        train::load_config(
            None,
            &[
                "train.lp_old_check=true".to_string(),
                "rollout.logprobs=\"processed\"".to_string(),
                extra.to_string(),
            ],
        )
    };
    let err = format!("{:#}", sets("rollout.top_p=0.9").unwrap_err());
    assert!(err.contains("`rollout.logprobs` is \"processed\""), "{err}");
    assert!(
        sets("rollout.top_p=1.0").is_ok(),
        "no filter: the record is the learner's"
    );
}

/// `train.tensor_cores` is refused, naming the key and the reason, wherever the tiles cannot run as asked:
/// f32 activations, outside deterministic mode, on the CPU, with a rollout format that quantizes the
/// activations or an f32 rollout (no low-bit product); accepted with half activations on a CubeCL backend.
#[test]
fn tensor_cores_are_refused_where_the_tiles_cannot_run() {
    let load = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        train::load_config(None, &sets)
    };
    let on = ["train.tensor_cores=true", "train.backend=cuda"];
    let half = [on.as_slice(), &["train.activations=bf16"]].concat();
    for (extra, want) in [
        (vec![], "needs half activations"),
        (
            vec!["train.activations=f16", "train.deterministic=false"],
            "deterministic mode",
        ),
        (
            vec!["train.activations=f16", "train.backend=flex"],
            "needs a CubeCL backend",
        ),
        (
            vec!["train.activations=bf16", "rollout.precision=fp8-b128"],
            "quantizes the activations",
        ),
        (
            vec!["train.activations=bf16", "rollout.precision=f32"],
            "runs no low-bit product",
        ),
    ] {
        let sets = [on.as_slice(), &extra].concat();
        let err = format!("{:#}", load(&sets).unwrap_err());
        assert!(
            err.contains("train.tensor_cores") && err.contains(want),
            "{sets:?}: expected `{want}` in: {err}"
        );
    }
    let cfg = load(&half).unwrap();
    assert!(cfg.train.tensor_cores);
    assert!(!load(&[]).unwrap().train.tensor_cores, "off by default");
    // Its kernels: the tiles by default, the fragment tiles on request, refused without the setting, an
    // unknown name refused.
    use qarl::train::config::TensorCoreKernel;
    assert_eq!(cfg.train.tensor_core_kernel, TensorCoreKernel::Tiles);
    let frag = [half.as_slice(), &["train.tensor_core_kernel=fragments"]].concat();
    let cfg = load(&frag).unwrap();
    assert_eq!(cfg.train.tensor_core_kernel, TensorCoreKernel::Fragments);
    let err = format!(
        "{:#}",
        load(&["train.tensor_core_kernel=fragments"]).unwrap_err()
    );
    assert!(
        err.contains("train.tensor_core_kernel")
            && err.contains("needs `train.tensor_cores` = true"),
        "{err}"
    );
    let bad = [half.as_slice(), &["train.tensor_core_kernel=wmma"]].concat();
    let err = format!("{:#}", load(&bad).unwrap_err());
    assert!(err.contains("wmma"), "{err}");
    // The fragment tiles' split scale groups: 1 by default, 2 or 4 on the fragment tiles, another count
    // or another kernel refused with the key named.
    assert_eq!(cfg.train.fragment_group_splits, 1);
    for n in [2, 4] {
        let set = format!("train.fragment_group_splits={n}");
        let sets = [frag.as_slice(), &[set.as_str()]].concat();
        assert_eq!(load(&sets).unwrap().train.fragment_group_splits, n);
    }
    for (sets, want) in [
        (
            [frag.as_slice(), &["train.fragment_group_splits=3"]].concat(),
            "1, 2 or 4",
        ),
        (
            [half.as_slice(), &["train.fragment_group_splits=4"]].concat(),
            "needs `train.tensor_core_kernel` = \"fragments\"",
        ),
    ] {
        let err = format!("{:#}", load(&sets).unwrap_err());
        assert!(
            err.contains("train.fragment_group_splits") && err.contains(want),
            "{sets:?}: {err}"
        );
    }
    // A command's `--backend` flag is validated with the rest: on the default (flex) config the setting
    // needs it, and gets it.
    let sets = ["train.tensor_cores=true", "train.activations=bf16"].map(String::from);
    let err = format!(
        "{:#}",
        train::load_config_on(None, &sets, None).unwrap_err()
    );
    assert!(err.contains("needs a CubeCL backend"), "{err}");
    let cfg = train::load_config_on(None, &sets, Some(qarl::ops::BackendKind::Cuda)).unwrap();
    assert_eq!(cfg.train.backend, qarl::ops::BackendKind::Cuda);
}

#[test]
fn default_config_parses_and_bad_configs_are_named() {
    let cfg = train::load_config(None, &[]).unwrap();
    assert_eq!(cfg.rollout.precision.to_string(), "int4-g32");
    // `qarl train` writes the embedded model file there where it is absent: the two must agree.
    assert_eq!(
        cfg.model.init_config.as_deref(),
        Some(Path::new(train::config::DEFAULT_MODEL_CONFIG_PATH))
    );
    let good =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.toml"))
            .unwrap();
    let cases = [
        (
            good.replace(
                "samples_per_prompt = 8",
                "samples_per_prompt = 8\nsample_per_prompt = 3",
            ),
            "sample_per_prompt",
        ),
        (
            good.replace("precision = \"int4-g32\"", "precision = \"int3\""),
            "int4-g128",
        ),
        (
            good.replace("forward = \"aligned\"", "forward = \"quantized\""),
            "aligned",
        ),
        (
            good.replace("objective = \"tbpo\"", "objective = \"tbpo2\""),
            "tbpo2",
        ),
        (
            good.replace(
                "forward = \"aligned\"",
                "forward = \"aligned\"\nbackend = \"vulkan\"",
            ),
            "`train.backend` = \"vulkan\" is not a valid value; expected one of `flex`, `wgpu`, `cuda`",
        ),
        (
            good.replace("samples_per_prompt = 8", "samples_per_prompt = 1"),
            "samples_per_prompt",
        ),
        (good.replace("lr = 3e-5", "lr = -1.0"), "lr"),
        (
            good.replace("answer_only_frac = 0.5", "answer_only_frac = 1.5"),
            "sft.answer_only_frac",
        ),
    ];
    for (text, want) in cases {
        let err = TrainConfig::from_toml(&text, "my.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("my.toml") && err.contains(want),
            "expected `{want}` in: {err}"
        );
    }
}

/// A bad value inside `[task]` or `[task.template]` (tables tagged by `kind`, which serde reads into a
/// buffer first) is reported at its own line with its full key, not at the table's header.
#[test]
fn errors_inside_task_tables_name_the_key_and_its_line() {
    // The default config without its `[task]`, which each case appends.
    let default =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/default.toml"))
            .unwrap();
    let (head, tail) = default.split_at(default.find("[task]").unwrap());
    let base = format!("{head}{}", &tail[tail.find("[verify]").unwrap()..]);
    let base_lines = base.lines().count();
    let arithmetic = "[task]\nkind = \"arithmetic\"\nmin_digits = 1\nmax_digits = \"two\"\n";
    let dataset = "[task]\nkind = \"gsm8k\"\npath = \"x.jsonl\"\neval_fraction = \"a\"\n";
    let template = "[task]\nkind = \"math\"\npath = \"x.jsonl\"\n\n[task.template]\nkind = \"plain\"\nquestion_prefix = 3\n";
    let unknown = "[task]\nkind = \"gsm8k\"\npath = \"x.jsonl\"\n\n[task.template]\nkind = \"chat\"\nsytem = \"Be brief.\"\n";
    let untagged = "[task]\nkind = \"gsm8k\"\npath = \"x.jsonl\"\ntemplate = \"plain\"\n";
    let cases = [
        (
            untagged,
            4,
            "`task.template` is string \"plain\", where a table with a `kind` is expected, one of \
             `plain`, `chat`, e.g. `{ kind = \"plain\" }`",
        ),
        (
            arithmetic,
            4,
            "`task.max_digits`: invalid type: string \"two\", expected u32",
        ),
        (
            dataset,
            4,
            "`task.eval_fraction`: invalid type: string \"a\", expected f64",
        ),
        (
            template,
            7,
            "`task.template.question_prefix`: invalid type: integer `3`",
        ),
        (
            unknown,
            7,
            "unknown key `task.template.sytem`; did you mean `task.template.system`?",
        ),
    ];
    for (task, line, want) in cases {
        let err = TrainConfig::from_toml(&format!("{base}{task}"), "my.toml")
            .unwrap_err()
            .to_string();
        let want = format!("my.toml, line {}: {want}", base_lines + line);
        assert!(err.contains(&want), "expected `{want}` in: {err}");
    }
    // The same tables with good values read.
    let good = [
        arithmetic.replace("\"two\"", "2"),
        dataset.replace("\"a\"", "0.2"),
        template.replace("3", "\"Q: \""),
        unknown.replace("sytem", "system"),
        untagged.replace("\"plain\"", "{ kind = \"plain\" }"),
    ];
    for task in good {
        TrainConfig::from_toml(&format!("{base}{task}"), "my.toml").unwrap();
    }
    // A value out of its range, found after the parse, is named with its line too.
    let at = default.find("samples_per_prompt = 8").unwrap();
    let line = default[..at].matches('\n').count() + 1;
    let bad = default.replacen("samples_per_prompt = 8", "samples_per_prompt = 1", 1);
    let err = TrainConfig::from_toml(&bad, "my.toml")
        .unwrap_err()
        .to_string();
    let want = format!("my.toml, line {line}: `rollout.samples_per_prompt` = 1: must be >= 2");
    assert!(err.contains(&want), "expected `{want}` in: {err}");
    // A missing top-level key is named at the top level, also when the file starts with a table (toml
    // points such an error at the document's start, the first table's header), and a missing key of a
    // table still with its table.
    let body = default
        .lines()
        .filter(|l| !l.starts_with("run_dir"))
        .collect::<Vec<_>>()
        .join("\n");
    let table_first = &body[body.find("\n[model]").unwrap() + 1..];
    for text in [table_first, &body] {
        let err = TrainConfig::from_toml(text, "my.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains(": missing key `run_dir`"), "{err}");
    }
    let no_dir: String = default
        .lines()
        .filter(|l| !l.starts_with("dir = "))
        .map(|l| format!("{l}\n"))
        .collect();
    let err = TrainConfig::from_toml(&no_dir, "my.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains(": missing key `model.dir`"), "{err}");
}

#[test]
fn sft_then_rl_writes_metrics_checkpoints_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config(tmp.path(), "aligned", 2);
    let s = train::run(&cfg, false, true).unwrap();
    let rows = metrics(&s.metrics_path);
    let rl: Vec<_> = rows.iter().filter(|r| r["phase"] == "rl").collect();
    assert_eq!(rl.len(), 2);
    for key in [
        "rollout_corr/k3_kl",
        "critic/rewards/mean",
        "actor/entropy",
        "actor/pg_clipfrac",
        "response_length/mean",
        "error_tokens/ratio_frac",
        "error_tokens/low_prob_frac",
        "error_tokens/repetition_frac",
        "error_tokens/any_frac",
    ] {
        assert!(rl[0][key].is_number(), "missing {key}: {}", rl[0]);
    }
    assert!(
        rl[0].get("error_tokens/frac").is_none(),
        "the mixed error-token key is gone: {}",
        rl[0]
    );

    assert!(rows.iter().any(|r| r["phase"] == "sft"));
    assert!(rows.iter().filter(|r| r["phase"] == "eval").count() >= 2);
    // The before/after comparison is paired over the same held-out problems, and agrees with the
    // accuracies it pairs and with the per-problem outcomes in the log.
    let p = s
        .paired
        .as_ref()
        .expect("a finished run pairs its evaluations");
    assert_eq!(p.problems, cfg.eval.problems);
    assert_eq!(Some(p.before), s.accuracy_before);
    assert_eq!(Some(p.after), s.accuracy_after);
    assert!((p.diff() - (p.fixed as f64 - p.broken as f64) / p.problems as f64).abs() < 1e-12);
    let last_eval = rows.iter().rfind(|r| r["phase"] == "eval").unwrap();
    let key = format!("eval/{}/greedy_correct", cfg.rollout.precision);
    let outcomes = qarl::train::paired::decode(last_eval[&key].as_str().unwrap()).unwrap();
    assert_eq!(outcomes.len(), cfg.eval.problems);
    assert_eq!(
        outcomes.iter().filter(|&&c| c).count() as f64 / p.problems as f64,
        p.after
    );
    // The warm-started model is an HF directory every command loads, with its tokenizer.
    assert!(cfg.model.dir.join("tokenizer.json").is_file());
    Decoder::load(&cfg.model.dir, &Device::flex()).unwrap();
    let (ckpt, state) = train::checkpoint::latest(&cfg.run_dir).unwrap();
    assert_eq!(state.step, 1);
    Decoder::load(&ckpt, &Device::flex()).unwrap();

    // The PNG rendering of the metrics needs a TrueType font: tests/plots.rs (ignored without one).

    // Resume with more steps: continues at step 2, earlier metrics kept.
    let mut more = cfg.clone();
    more.train.steps = 3;
    let resumed = train::run(&more, true, true).unwrap();
    // The resumed run did not re-evaluate before RL; it pairs with the evaluation recorded in the log.
    assert_eq!(resumed.accuracy_before, s.accuracy_before);
    let rp = resumed
        .paired
        .expect("a resumed run still pairs with the step-0 evaluation");
    assert_eq!(rp.before, p.before);
    let rows = metrics(&s.metrics_path);
    let steps: Vec<u64> = rows
        .iter()
        .filter(|r| r["phase"] == "rl")
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![0, 1, 2]);
}

/// Must-show: with the aligned training forward (deterministic mode, the default), step-1
/// `rollout_corr/k3_kl` is exactly 0, while the full-precision forward sees the int4 rollout's mismatch.
#[test]
fn aligned_forward_removes_the_rollout_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    // Two steps, with lp_old taken from the rollout's record *and* recomputed by the learner forward, which
    // must give the same bits for every token, log-prob and entropy (the run stops with an error otherwise).
    let mut aligned = tiny_config(&tmp.path().join("a"), "aligned", 2);
    aligned.train.lp_old_check = true;
    train::run(&aligned, false, true).unwrap();
    let mut full = tiny_config(&tmp.path().join("a"), "full", 1);
    full.run_dir = tmp.path().join("full-run");
    train::run(&full, false, true).unwrap();
    let k3 = |dir: &Path| -> f64 {
        let rows = metrics(&dir.join("metrics.jsonl"));
        rows.iter().find(|r| r["phase"] == "rl").unwrap()["rollout_corr/k3_kl"]
            .as_f64()
            .unwrap()
    };
    let rl_rows: Vec<_> = metrics(&aligned.run_dir.join("metrics.jsonl"))
        .into_iter()
        .filter(|r| r["phase"] == "rl")
        .collect();
    assert_eq!(rl_rows.len(), 2);
    for row in &rl_rows {
        assert_eq!(row["train/lp_old_reused"], 1.0, "{row}");
        assert_eq!(row["rollout_corr/k3_kl"], 0.0, "{row}");
        // The learner scores the rollout's own bits: no token can be a ratio error.
        assert_eq!(row["error_tokens/ratio_frac"], 0.0, "{row}");
    }
    let (a, f) = (k3(&aligned.run_dir), k3(&full.run_dir));
    println!(
        "step-1 k3_kl: aligned {a:e}, full {f:e}, ratio {:e}",
        f / a.max(f64::MIN_POSITIVE)
    );
    assert!(f > 0.0 && a == 0.0, "aligned {a} vs full {f}");
}

/// The same for the FP4 rollouts: with `rollout.precision = "nvfp4"` / `"mxfp4"` and the aligned forward,
/// the learner's recomputed lp_old equals the rollout's record for every token (`lp_old_check`) and the
/// step's `rollout_corr/k3_kl` is exactly 0.
#[test]
fn aligned_forward_is_exact_for_fp4_rollouts() {
    let tmp = tempfile::tempdir().unwrap();
    for precision in ["nvfp4", "mxfp4"] {
        let toml = common::tiny_train_toml(&tmp.path().join("shared"), "aligned", 1).replace(
            "precision = \"int4-g32\"",
            &format!("precision = \"{precision}\""),
        );
        let mut cfg = TrainConfig::from_toml(&toml, "tiny").unwrap();
        assert_eq!(cfg.rollout.precision.to_string(), precision);
        cfg.run_dir = tmp.path().join(precision);
        cfg.train.lp_old_check = true;
        train::run(&cfg, false, true).unwrap();
        let rows: Vec<_> = metrics(&cfg.run_dir.join("metrics.jsonl"))
            .into_iter()
            .filter(|r| r["phase"] == "rl")
            .collect();
        assert_eq!(rows.len(), 1, "{precision}");
        assert_eq!(
            rows[0]["train/lp_old_reused"], 1.0,
            "{precision}: {}",
            rows[0]
        );
        assert_eq!(
            rows[0]["rollout_corr/k3_kl"], 0.0,
            "{precision}: {}",
            rows[0]
        );
    }
}

#[test]
fn save_pretrained_round_trips() {
    let device = Device::flex();
    let src = fixtures_dir().join("qwen3_moe");
    let model = Decoder::load(&src, &device).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    qarl::model::save::save_pretrained(&model, &json, tmp.path()).unwrap();
    let back = Decoder::load(tmp.path(), &device).unwrap();
    let ids = vec![vec![1u32, 5, 9, 200]];
    let a = to_f32_vec(model.forward(&ids, None, None, None).logits);
    let b = to_f32_vec(back.forward(&ids, None, None, None).logits);
    assert_eq!(a, b);
}

/// `--set` overrides every run's config after its variant's `set`, needs a results folder of its own, and
/// the report says which values the command line gave; the experiment's own keys stay refused.
#[test]
fn experiment_overrides_go_to_every_run_and_their_own_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let base = toml::to_string(&tiny_config(&tmp.path().join("shared"), "full", 2)).unwrap();
    std::fs::write(tmp.path().join("base.toml"), base).unwrap();
    let exp = "name = \"mini\"\nbase = \"base.toml\"\nseeds = [5]\n[[variant]]\nname = \"two\"\n\
               set = { \"train.steps\" = 2 }\n";
    let path = tmp.path().join("exp.toml");
    std::fs::write(&path, exp).unwrap();
    let load = || train::experiment::ExperimentConfig::load(&path).unwrap();
    let sets = ["train.steps=1".to_string()];
    let err = load().with_overrides(&sets, None).unwrap_err().to_string();
    assert!(err.contains("--results-dir"), "{err}");
    let err = load()
        .with_overrides(&["seed=3".to_string()], Some(tmp.path().join("r")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("an experiment sets `seed`"), "{err}");
    let results = tmp.path().join("short");
    let exp = load().with_overrides(&sets, Some(results.clone())).unwrap();
    let report = train::experiment::run_loaded_experiment(&path, exp, true, None).unwrap();
    assert!(report.starts_with(&results));
    let ran: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(results.join("two/seed5/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        ran["train"]["steps"], 1,
        "the command line's value is final"
    );
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(
        text.contains("with the command line's `train.steps = 1`"),
        "{text}"
    );
}

/// An experiment runs each (variant, seed) once, skips finished runs when run again, and reports them.
#[test]
fn experiment_runs_variants_and_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let base = toml::to_string(&tiny_config(&tmp.path().join("shared"), "full", 1)).unwrap();
    std::fs::write(tmp.path().join("base.toml"), base).unwrap();
    let exp = format!(
        r#"
name = "mini"
base = "base.toml"
seeds = [5]
results_dir = "{}"
[[variant]]
name = "full"
set = {{ "train.forward" = "full" }}
[[variant]]
name = "aligned-tbpo"
set = {{ "train.forward" = "aligned", "train.loss.objective" = "tbpo" }}
"#,
        tmp.path().join("results").display()
    );
    let path = tmp.path().join("exp.toml");
    std::fs::write(&path, exp).unwrap();
    let report = train::experiment::run_experiment(&path, true, None).unwrap();
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(
        text.contains("| full | 1/1 |") && text.contains("| aligned-tbpo | 1/1 |"),
        "{text}"
    );
    assert!(text.contains("acc before RL"), "{text}");
    assert!(text.contains("| full | aligned-tbpo |"), "{text}");
    // Arms judged under other verifier rules are not paired (as `qarl compare` refuses them); the report
    // says which pairs it left out.
    let cfg_path = tmp.path().join("results/aligned-tbpo/seed5/config.json");
    let saved = std::fs::read_to_string(&cfg_path).unwrap();
    let mut judged: serde_json::Value = serde_json::from_str(&saved).unwrap();
    judged["verify"]["answer_from"] = "marked".into();
    std::fs::write(&cfg_path, judged.to_string()).unwrap();
    let exp_cfg = train::experiment::ExperimentConfig::load(&path).unwrap();
    let apart = train::experiment::write_report(&exp_cfg, &tmp.path().join("results")).unwrap();
    let apart = std::fs::read_to_string(apart).unwrap();
    assert!(
        apart.contains("Not compared") && apart.contains("full / aligned-tbpo"),
        "{apart}"
    );
    assert!(!apart.contains("| full | aligned-tbpo |"), "{apart}");
    std::fs::write(&cfg_path, saved).unwrap();
    if train::plot::register_font().is_ok() {
        let png = std::fs::read(tmp.path().join("results/comparison.png")).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        assert!(text.contains("](comparison.png)"), "{text}");
    } else {
        assert!(text.contains("comparison plot not drawn"), "{text}");
    }
    let metrics = tmp.path().join("results/full/seed5/metrics.jsonl");
    let before = std::fs::metadata(&metrics).unwrap().modified().unwrap();
    train::experiment::run_experiment(&path, true, None).unwrap();
    assert_eq!(
        std::fs::metadata(&metrics).unwrap().modified().unwrap(),
        before,
        "a finished run was redone"
    );
    // More steps in the base: the finished runs are shorter than the experiment says (new seeds would
    // average both lengths in one arm).
    let longer = tiny_config(&tmp.path().join("shared"), "full", 2);
    std::fs::write(
        tmp.path().join("base.toml"),
        toml::to_string(&longer).unwrap(),
    )
    .unwrap();
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(
        err.contains("full/seed5 (`train.steps`)") && err.contains("aligned-tbpo/seed5"),
        "{err}"
    );
    std::fs::write(
        tmp.path().join("base.toml"),
        toml::to_string(&tiny_config(&tmp.path().join("shared"), "full", 1)).unwrap(),
    )
    .unwrap();
    // A typo in an override is an error naming it.
    let bad = std::fs::read_to_string(&path).unwrap().replace(
        "\"train.forward\" = \"full\"",
        "\"trian.forward\" = \"full\"",
    );
    std::fs::write(&path, bad).unwrap();
    std::fs::remove_file(tmp.path().join("results/full/seed5/finished.json")).unwrap();
    let err = train::experiment::run_experiment(&path, true, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("trian"), "{err}");
    // An unfinished run is resumed, and a base changed since is refused by the resume's check, named
    // with the variant and the way to start it over (`qarl experiment` has no --overwrite).
    let good = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"trian.forward\"", "\"train.forward\"");
    std::fs::write(&path, good).unwrap();
    let mut changed = tiny_config(&tmp.path().join("shared"), "full", 1);
    changed.train.lr *= 2.0;
    std::fs::write(
        tmp.path().join("base.toml"),
        toml::to_string(&changed).unwrap(),
    )
    .unwrap();
    // The finished run of the other variant was made with the old learning rate: reported as it ran or
    // joined by new seeds, it would stand for settings it never had.
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(
        err.contains("finished runs were made with other settings")
            && err.contains("aligned-tbpo/seed5 (`train.lr`)"),
        "{err}"
    );
    // A report of the finished runs alone (`--report-only`) is refused the same way: it would credit their
    // numbers to the settings the files now state.
    let exp_cfg = train::experiment::ExperimentConfig::load(&path).unwrap();
    let err = format!(
        "{:#}",
        train::experiment::check_report(&path, &exp_cfg).unwrap_err()
    );
    assert!(err.contains("aligned-tbpo/seed5 (`train.lr`)"), "{err}");
    // The way back to the settings it ran with is named: its learning rate, half the base's now.
    let ran_with = format!("(`--set train.lr={}`)", changed.train.lr / 2.0);
    assert!(err.contains(&ran_with), "{err} lacks {ran_with}");
    std::fs::remove_file(tmp.path().join("results/aligned-tbpo/seed5/finished.json")).unwrap();
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(
        err.contains("variant \"full\" seed 5; the experiment resumes an unfinished run")
            && err.contains("`train.lr`"),
        "{err}"
    );
}

/// Seeds of one variant that started from different models are not pooled: a seed added after the base's
/// `model.init_config` and `model.dir` were swapped (paths a finished run may change, since folders move)
/// was averaged with the first seed's model as one arm, its RL gain tested across the two.
#[test]
fn an_experiments_seeds_of_other_models_are_not_pooled() {
    let tmp = tempfile::tempdir().unwrap();
    let write_base = |cfg: &TrainConfig| {
        std::fs::write(tmp.path().join("base.toml"), toml::to_string(cfg).unwrap()).unwrap()
    };
    write_base(&tiny_config(&tmp.path().join("a"), "full", 1));
    let path = tmp.path().join("exp.toml");
    let write_exp = |seeds: &str| {
        let exp = format!(
            "name = \"pooled\"\nbase = \"base.toml\"\nseeds = {seeds}\nresults_dir = \"{}\"\n\
             [[variant]]\nname = \"full\"\n",
            tmp.path().join("results").display()
        );
        std::fs::write(&path, exp).unwrap();
    };
    write_exp("[1]");
    let report = train::experiment::run_experiment(&path, true, None).unwrap();
    let first = std::fs::read_to_string(&report).unwrap();
    // Another model: one layer fewer, in another folder.
    let mut other = tiny_config(&tmp.path().join("b"), "full", 1);
    let init = other.model.init_config.clone().unwrap();
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&init).unwrap()).unwrap();
    json["num_hidden_layers"] = (json["num_hidden_layers"].as_u64().unwrap() - 1).into();
    let smaller = tmp.path().join("smaller.json");
    std::fs::write(&smaller, json.to_string()).unwrap();
    other.model.init_config = Some(smaller);
    write_base(&other);
    write_exp("[1, 2]");
    // Its folder not made yet: refused before a warm start would make another model.
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(
        err.contains("holds no model yet, but seed 1 of this variant started from a model"),
        "{err}"
    );
    assert!(!other.model.dir.exists());
    // Made by hand: refused before the run, by its fingerprint.
    let mut log = qarl::train::metrics::MetricsLog::open(&tmp.path().join("sft.jsonl")).unwrap();
    train::prepare_model(&other, &Device::flex().autodiff(), &mut log, true).unwrap();
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(
        err.contains("holds the model with files fingerprint") && err.contains("but seed 1"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(&report).unwrap(),
        first,
        "no report pools them"
    );
}

/// Held-out problems decide what an experiment pairs and pools: arms whose task tables differ only in the
/// training file (one `eval_path`) hold out the same problems and are compared (the report said they were
/// evaluated on other problems); a held-out file edited after a seed finished is refused rather than
/// pooled with new seeds (each accuracy cell averaged two problem sets, and the arms' table vanished
/// without a word); and a finished run that a resume takes further is no longer marked finished.
#[test]
fn an_experiment_pairs_by_held_out_problems_and_refuses_edited_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = |path: &Path, items: &[(&str, &str)]| {
        let lines: Vec<String> = items
            .iter()
            .map(|(q, a)| {
                serde_json::json!({"question": q, "answer": format!("#### {a}")}).to_string()
            })
            .collect();
        std::fs::write(path, lines.join("\n") + "\n").unwrap();
    };
    let (train_a, train_c, held_out) = (
        tmp.path().join("a.jsonl"),
        tmp.path().join("c.jsonl"),
        tmp.path().join("test.jsonl"),
    );
    jsonl(&train_a, &[("1+2?", "3"), ("2+2?", "4")]);
    jsonl(&train_c, &[("3+1?", "4"), ("1+1?", "2")]);
    jsonl(&held_out, &[("2+3?", "5"), ("3+3?", "6"), ("1+3?", "4")]);
    let mut base = tiny_config(&tmp.path().join("shared"), "full", 1);
    base.sft = None;
    base.eval.problems = 3;
    std::fs::write(
        tmp.path().join("base.toml"),
        toml::to_string(&base).unwrap(),
    )
    .unwrap();
    let task = |train: &Path| {
        format!(
            "{{ \"task\" = {{ kind = \"gsm8k\", path = \"{}\", eval_path = \"{}\" }}, \
             \"model.dir\" = \"{}\" }}",
            train.display(),
            held_out.display(),
            train.with_extension("model").display()
        )
    };
    let path = tmp.path().join("exp.toml");
    let write_exp = |seeds: &str| {
        let exp = format!(
            "name = \"held\"\nbase = \"base.toml\"\nseeds = {seeds}\nresults_dir = \"{}\"\n\
             [[variant]]\nname = \"a\"\nset = {}\n[[variant]]\nname = \"c\"\nset = {}\n",
            tmp.path().join("results").display(),
            task(&train_a),
            task(&train_c)
        );
        std::fs::write(&path, exp).unwrap();
    };
    write_exp("[1]");
    let report = train::experiment::run_experiment(&path, true, None).unwrap();
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(
        text.contains("| a | c |") && !text.contains("Not compared"),
        "{text}"
    );

    // Resumed further, a finished run is not finished until it ends again.
    let run_dir = tmp.path().join("results/a/seed1");
    let marker = train::experiment::marker(&run_dir);
    assert!(marker.is_file());
    let mut further: TrainConfig =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("config.json")).unwrap())
            .unwrap();
    further.train.steps = 3;
    let stop = train::RunOptions {
        resume: true,
        quiet: true,
        stop_after_step: Some(1),
        ..Default::default()
    };
    train::run_with(&further, &stop).unwrap();
    assert!(!marker.exists(), "still marked finished at step 2 of 3");

    // The held-out file edited, then a seed added: refused, naming the runs that held out the old problems.
    jsonl(&held_out, &[("2+3?", "5"), ("3+2?", "5"), ("1+3?", "4")]);
    write_exp("[1, 2]");
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(
        err.contains("c/seed1 (held-out problems") && err.contains("its data file changed"),
        "{err}"
    );

    // A gold answer edited, the questions as they were: refused as well (the questions' fingerprint alone
    // did not see it).
    jsonl(&held_out, &[("2+3?", "5"), ("3+3?", "7"), ("1+3?", "4")]);
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(err.contains("c/seed1 (held-out problems"), "{err}");
    // A report of the finished runs alone pools nothing new with them: not refused.
    let exp_cfg = train::experiment::ExperimentConfig::load(&path).unwrap();
    train::experiment::check_report(&path, &exp_cfg).unwrap();

    // The training file edited: refused too, for the finished run and for a resume of the unfinished one.
    jsonl(&held_out, &[("2+3?", "5"), ("3+3?", "6"), ("1+3?", "4")]);
    jsonl(&train_c, &[("3+1?", "4"), ("2+1?", "3")]);
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(err.contains("c/seed1 (training data"), "{err}");
    jsonl(&train_a, &[("1+2?", "3"), ("2+2?", "5")]);
    let err = format!("{:#}", train::run_with(&further, &stop).unwrap_err());
    assert!(
        err.contains("the training data changed since the run started"),
        "{err}"
    );
}

/// An experiment whose variant does not make a valid config is refused before its results directory is
/// made or claimed: nothing is left that a corrected experiment, or another one, would have to explain.
#[test]
fn a_refused_experiment_leaves_no_results_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let base = toml::to_string(&tiny_config(&tmp.path().join("shared"), "full", 1)).unwrap();
    std::fs::write(tmp.path().join("base.toml"), base).unwrap();
    let results = tmp.path().join("results");
    let exp = format!(
        r#"
name = "refused"
base = "base.toml"
seeds = [1]
results_dir = "{}"
[[variant]]
name = "typo"
set = {{ "train.lr" = "fast" }}
"#,
        results.display()
    );
    let path = tmp.path().join("exp.toml");
    std::fs::write(&path, exp).unwrap();
    let err = format!(
        "{:#}",
        train::experiment::run_experiment(&path, true, None).unwrap_err()
    );
    assert!(
        err.contains("variant typo") && err.contains("train.lr"),
        "{err}"
    );
    assert!(!results.exists(), "{} was made", results.display());
}

/// Dynamic sampling with refills (DAPO): a step samples more rounds of new prompts until it keeps
/// `prompts_per_step` groups with a reward signal, or runs out of rounds; every kept group has one; a
/// refill is refused without dynamic sampling.
#[test]
fn dynamic_sampling_refills_the_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(tmp.path(), "aligned", 6);
    cfg.train.dynamic_sampling = true;
    cfg.train.refill_rounds = 3;
    train::run(&cfg, false, true).unwrap();
    let rows: Vec<_> = metrics(&cfg.run_dir.join("metrics.jsonl"))
        .into_iter()
        .filter(|r| r["phase"] == "rl")
        .collect();
    assert_eq!(rows.len(), 6);
    let (prompts, g) = (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt);
    let mut refilled = 0;
    for r in &rows {
        let rounds = r["train/refill_rounds"].as_f64().unwrap() as usize;
        let sampled = r["train/sampled_groups"].as_f64().unwrap() as usize;
        let kept = r["train/kept_sequences"].as_f64().unwrap() as usize;
        assert!(rounds <= 3, "{r}");
        assert_eq!(sampled, (rounds + 1) * prompts, "{r}");
        assert!(kept <= prompts * g && kept.is_multiple_of(g), "{r}");
        // Fewer kept groups than asked for only after the last round.
        assert!(kept == prompts * g || rounds == 3, "{r}");
        assert!(
            r["perf/generated_tokens"].as_f64().unwrap() as usize >= sampled * g,
            "{r}"
        );
        refilled += usize::from(rounds > 0);
    }
    assert!(refilled > 0, "no step refilled: the test shows nothing");
    println!("{refilled} of 6 steps refilled");
    let mut plain = cfg.clone();
    plain.train.dynamic_sampling = false;
    let err = format!("{:#}", plain.validate().unwrap_err());
    assert!(
        err.contains("`train.refill_rounds` = 3 needs `train.dynamic_sampling`"),
        "{err}"
    );
}

/// Gradient descent on every objective's loss raises the log-probs of a positive-advantage response and
/// lowers those of a negative one (on-policy, ratios 1).
#[test]
fn policy_gradient_points_the_right_way() {
    use qarl::host::tensor_from_vec;
    use qarl::rl::losses::{LossConfig, ObjectiveName, PolicyLossInputs};
    let ad = Device::flex().autodiff();
    for name in ["grpo", "gspo", "cispo", "tbpo", "ppo_clip"] {
        let objective: ObjectiveName = serde_json::from_value(serde_json::json!(name)).unwrap();
        let loss = LossConfig::new(objective).resolve().unwrap();
        let lp = vec![-1.0f32, -2.0, -0.5, -1.5, -0.7, -0.2];
        let lp_theta = tensor_from_vec(lp.clone(), [2, 3], &ad).require_grad();
        let old = tensor_from_vec(lp.clone(), [2, 3], &ad);
        let out = loss
            .compute(PolicyLossInputs {
                lp_theta: lp_theta.clone(),
                lp_old: old.clone(),
                lp_roll: old,
                mask: tensor_from_vec(vec![1.0; 6], [2, 3], &ad),
                advantages: tensor_from_vec(vec![1.0, -1.0], [2], &ad),
                lp_ref: None,
            })
            .unwrap();
        let g = to_f32_vec(lp_theta.grad(&out.loss.backward()).unwrap());
        assert!(
            g[..3].iter().all(|&x| x < 0.0),
            "{name}: positive row grads {g:?}"
        );
        assert!(
            g[3..].iter().all(|&x| x > 0.0),
            "{name}: negative row grads {g:?}"
        );
    }
}

/// The learner's log-probs computed only at the loss positions (hidden rows gathered before the LM head, no
/// `[B, T, vocab]` logits) equal the full forward's at those positions bit for bit; their gradient differs
/// from the full forward's only by the summation order of the LM head's and the embeddings' weight gradients
/// (fewer zero rows in the products), bounded here at 1e-5 relative.
#[test]
fn loss_position_logprobs_equal_the_full_forward() {
    use qarl::host::tensor_from_vec;
    use qarl::model::scoring::{forward_ragged, next_token_logprobs_at};
    use qarl::model::Weights;
    use qarl::train::batch::SeqBatch;
    let seqs = vec![
        vec![3u32, 17, 99, 42, 7, 250, 11, 5],
        vec![5, 6, 8],
        vec![200, 1, 2, 3, 9, 9],
    ];
    let batch = SeqBatch::new(seqs.clone(), vec![4, 1, 5]);
    let ad = Device::flex().autodiff();
    for dir in common::fixture_models() {
        let model = Decoder::load(&dir, &ad).unwrap();
        let weights: Vec<f32> = (0..seqs.len() * batch.width)
            .map(|i| 0.25 + (i % 7) as f32 * 0.1)
            .collect();
        let w = tensor_from_vec(weights, [seqs.len(), batch.width], &ad) * batch.mask(&ad);
        let (fused, _) = batch.logprobs(&model, Weights::Packed, 0.8, None);
        let (out, padded) = forward_ragged(&model, Weights::Packed, &seqs, None);
        let full = next_token_logprobs_at(out.logits, &padded, 0.8).narrow(1, 0, batch.width);
        let mask = batch.mask_values();
        let (a, b) = (to_f32_vec(fused.clone()), to_f32_vec(full.clone()));
        for i in (0..mask.len()).filter(|&i| mask[i] > 0.0) {
            assert_eq!(
                a[i].to_bits(),
                b[i].to_bits(),
                "{}: position {i}",
                dir.display()
            );
        }
        let grads_fused = (fused * w.clone()).sum().backward();
        let grads_full = (full * w).sum().backward();
        let what = dir.display().to_string();
        assert_gradients_close(&model, &grads_fused, &grads_full, 1e-5, &what);
    }
}

/// The learner forward with each prompt forwarded once for its group (prompt into a KV cache, responses
/// continuing from it, in one padded forward or in a forward per length bucket) gives bitwise the
/// log-probs of one full forward per sequence in deterministic mode, with and without routing replay and
/// with quantized weights; the gradients differ only by the order in which the group's contributions to
/// the shared prompt and the buckets' contributions to the weights are summed (<= 1e-5 relative); the
/// routing it reports equals the full forward's at every token that went through the model.
#[test]
fn shared_prompt_forward_equals_one_forward_per_sequence() {
    use qarl::host::tensor_from_vec;
    use qarl::model::mlp::routing_to_host;
    use qarl::model::Weights;
    use qarl::quant::Precision;
    use qarl::train::batch::{ForwardOptions, PrefixSharing, SeqBatch};
    let seqs = vec![
        vec![3u32, 17, 99, 42, 7, 250, 11, 5],
        vec![3, 17, 99, 42, 7, 8],
        vec![3, 17, 99, 42, 9],
        vec![5, 6, 8, 9, 10],
        vec![200, 1, 2, 3, 9, 9],
        vec![5, 6, 8],
    ];
    let batch = SeqBatch::new(seqs.clone(), vec![4, 4, 4, 2, 3, 2]);
    assert_eq!(
        batch.prompt_groups(),
        vec![vec![0, 1, 2], vec![3, 5], vec![4]]
    );
    let ad = Device::flex().autodiff();
    for dir in common::fixture_models() {
        for precision in [Precision::F32, "int4-g32".parse().unwrap()] {
            let mut model = Decoder::load(&dir, &ad).unwrap();
            model.set_precision(precision).unwrap();
            let what = format!("{} in {precision}", dir.display());
            let off_opts = ForwardOptions {
                sharing: PrefixSharing::Off,
                ..ForwardOptions::default()
            };
            let (_, off) = batch.logprobs_with(&model, Weights::Packed, 0.8, None, off_opts);
            let moe = off.routing.iter().any(Option::is_some);
            let replays: Vec<Option<Vec<Option<Vec<u32>>>>> = if moe {
                // Also a routing whose row 1 took other experts for its prompt's first token than row 0,
                // which shares its prompt (a refill round's prefill outside deterministic mode): the
                // shared forward replayed row 0's for both.
                let recorded = routing_to_host(off.routing.clone());
                let experts = model.config.moe.as_ref().unwrap().num_experts as u32;
                let mut other = recorded.clone();
                for layer in other.iter_mut().flatten() {
                    let k = layer.len() / (seqs.len() * off.padded_len);
                    let at = off.padded_len * k;
                    for e in &mut layer[at..at + k] {
                        *e = (*e + 1) % experts;
                    }
                }
                vec![None, Some(recorded), Some(other)]
            } else {
                vec![None]
            };
            for replay in replays {
                let what = format!("{what}, replay {}", replay.is_some());
                let w: Vec<f32> = (0..seqs.len() * batch.width)
                    .map(|i| 0.25 + (i % 7) as f32 * 0.1)
                    .collect();
                let w = tensor_from_vec(w, [seqs.len(), batch.width], &ad) * batch.mask(&ad);
                let run = |sharing, bucket_cost| {
                    let opts = ForwardOptions {
                        sharing,
                        entropy: true,
                        bucket_cost,
                    };
                    batch.logprobs_with(&model, Weights::Packed, 0.8, replay.as_deref(), opts)
                };
                // A response forward per distinct length, and all responses in one padded forward
                // (each against a fresh full forward: a backward consumes its graph).
                for bucket_cost in [0, usize::MAX] {
                    let what = format!("{what}, bucket cost {bucket_cost}");
                    let (full, ff) = run(PrefixSharing::Off, 0);
                    let (shared, fs) = run(PrefixSharing::Auto, bucket_cost);
                    let (a, b) = (to_f32_vec(shared.clone()), to_f32_vec(full.clone()));
                    let mask = batch.mask_values();
                    for i in (0..mask.len()).filter(|&i| mask[i] > 0.0) {
                        assert_eq!(a[i].to_bits(), b[i].to_bits(), "{what}: position {i}");
                    }
                    assert_eq!(fs.padded_len, ff.padded_len);
                    // The whole distribution, not only the target: the entropy of every scored position.
                    let bits = |v: &Option<Vec<f32>>| {
                        v.as_ref()
                            .unwrap()
                            .iter()
                            .map(|x| x.to_bits())
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(bits(&fs.entropy), bits(&ff.entropy), "{what}: entropy");
                    let (fs_routing, ff_routing) = (
                        routing_to_host(fs.routing.clone()),
                        routing_to_host(ff.routing.clone()),
                    );
                    for (l, (rs, rf)) in fs_routing.iter().zip(&ff_routing).enumerate() {
                        let (Some(rs), Some(rf)) = (rs, rf) else {
                            assert_eq!(rs.is_some(), rf.is_some(), "{what}: layer {l}");
                            continue;
                        };
                        let k = rf.len() / (seqs.len() * ff.padded_len);
                        for (r, s) in seqs.iter().enumerate() {
                            let span = r * ff.padded_len * k..(r * ff.padded_len + s.len() - 1) * k;
                            assert_eq!(rs[span.clone()], rf[span], "{what}: layer {l}, row {r}");
                        }
                    }
                    let gs = (shared * w.clone()).sum().backward();
                    let gf = (full * w.clone()).sum().backward();
                    assert_gradients_close(&model, &gs, &gf, 1e-5, &what);
                }
            }
        }
    }
}

/// The gradients of a few parameters (embedding, first layer's q and o projections, LM head) of two
/// backward passes agree within `tol` relative (L2), and are not zero.
fn assert_gradients_close(
    model: &Decoder,
    a: &burn::tensor::Gradients,
    b: &burn::tensor::Gradients,
    tol: f64,
    what: &str,
) {
    let mut params = vec![
        ("embed_tokens", model.embed_tokens.val()),
        ("q_proj", model.layers[0].self_attn.q_proj.weight.val()),
        ("o_proj", model.layers[0].self_attn.o_proj.weight.val()),
    ];
    if let Some(head) = &model.lm_head {
        params.push(("lm_head", head.weight.val()));
    }
    for (name, p) in params {
        let g1 = to_f32_vec(p.grad(a).unwrap());
        let g2 = to_f32_vec(p.grad(b).unwrap());
        let diff: f64 = g1
            .iter()
            .zip(&g2)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum();
        let norm: f64 = g2.iter().map(|&y| (y as f64).powi(2)).sum();
        let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
        assert!(
            rel <= tol,
            "{what}: {name} gradient differs by {rel:e} relative"
        );
        assert!(norm > 0.0, "{what}: {name} has no gradient");
    }
}

/// A warm start on a data set checks every training record against the position limit before its first
/// step: each step draws its own records, so a long one passed whenever the first step missed it.
#[test]
fn a_warm_start_checks_every_record_against_the_position_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("train.jsonl");
    let mut lines: Vec<String> = (0..9)
        .map(|i| {
            serde_json::json!({"question": format!("{i}+1?"), "answer": format!("#### {}", i + 1)})
                .to_string()
        })
        .collect();
    let long = "1+".repeat(150) + "1?";
    lines.push(serde_json::json!({"question": long, "answer": "#### 151"}).to_string());
    std::fs::write(&data, lines.join("\n")).unwrap();
    let eval = tmp.path().join("eval.jsonl");
    std::fs::write(&eval, "{\"question\": \"2+2?\", \"answer\": \"#### 4\"}\n").unwrap();
    for seed in [1, 2, 3] {
        let mut cfg = tiny_config(&tmp.path().join(format!("s{seed}")), "full", 1);
        cfg.seed = seed;
        cfg.task = serde_json::from_value(
            serde_json::json!({"kind": "gsm8k", "path": data, "eval_path": eval}),
        )
        .unwrap();
        if let Some(sft) = cfg.sft.as_mut() {
            sft.batch_size = 1;
            sft.steps = 2;
        }
        let err = format!("{:#}", train::run(&cfg, false, true).unwrap_err());
        assert!(
            err.contains("longer than the model's max_position_embeddings (256)"),
            "seed {seed}: {err}"
        );
        assert!(!cfg.model.dir.exists(), "seed {seed}: no model was made");
    }
}

/// `rollout.stop = "template"` ends each rollout at the task's stop string (arithmetic's: the newline
/// after the answer line), every response the prefix of the one `"end_tokens"` samples with the same seeds
/// up to its first newline; a random model writes newlines mid-answer, so the rule has rows to cut.
#[test]
fn template_stop_ends_rollouts_at_the_tasks_stop_string() {
    use qarl::model::{EndTokens, Tokenizer};
    use qarl::train::config::RolloutStop;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    common::arith_model(&dir, 7, 0.02);
    let mut cfg = tiny_config(tmp.path(), "aligned", 1);
    cfg.rollout.max_new_tokens = 40;
    let model = Decoder::load(&dir, &Device::flex()).unwrap();
    let tok = Tokenizer::load_for(&dir, &model.config).unwrap().unwrap();
    let end = EndTokens::of(&tok, &model.config).unwrap();
    let task = qarl::tasks::Task::from_config(&cfg.task.with_defaults()).unwrap();
    let mut responses = |stop: RolloutStop| -> Vec<String> {
        cfg.rollout.stop = stop;
        let c = train::rl::collect(&model, &task, &tok, &end, &cfg, 0).unwrap();
        (0..c.rollout.ids.len())
            .map(|r| tok.decode(c.rollout.response(r)).unwrap())
            .collect()
    };
    let whole = responses(RolloutStop::EndTokens);
    let cut = responses(RolloutStop::Template);
    assert_eq!(whole.len(), cut.len());
    let mut shortened = 0;
    for (w, c) in whole.iter().zip(&cut) {
        match w.find('\n') {
            Some(i) => {
                assert_eq!(c, &w[..=i], "cut at the first newline");
                shortened += usize::from(c.len() < w.len());
            }
            None => assert_eq!(c, w),
        }
    }
    assert!(
        shortened > 0,
        "no response went on past a newline: the test shows nothing ({whole:?})"
    );
}

/// The embedding row of `pad_token_id` takes no gradient through the input lookup, as transformers'
/// `nn.Embedding(padding_idx = pad_token_id)` trains it, where the pad token is a real input (SmolLM2's
/// `<|im_end|>`); any other input row does, and without a pad token so does that one. The logits are the
/// same bits either way.
#[test]
fn the_pad_tokens_input_row_takes_no_gradient_as_in_transformers() {
    let ad = Device::flex().autodiff();
    // Untied, so the row's gradient comes from the lookup alone.
    let dir = common::fixtures_dir().join("llama");
    let (pad, other) = (42u32, 17u32);
    let seq = vec![vec![3u32, other, pad, 99, pad, 7]];
    let run = |pad_token: Option<u32>| {
        let mut model = Decoder::load(&dir, &ad).unwrap();
        assert!(!model.config.tie_word_embeddings);
        model.config.pad_token_id = pad_token;
        let logits = model.forward(&seq, None, None, None).logits;
        let grads = (logits.clone() * logits.clone()).sum().backward();
        let g = to_f32_vec(model.embed_tokens.val().grad(&grads).unwrap());
        let h = model.config.hidden_size;
        let row = |id: u32| g[id as usize * h..(id as usize + 1) * h].to_vec();
        (to_f32_vec(logits.detach()), row(pad), row(other))
    };
    let (logits, pad_row, other_row) = run(Some(pad));
    assert!(pad_row.iter().all(|&x| x == 0.0), "{pad_row:?}");
    assert!(other_row.iter().any(|&x| x != 0.0));
    let (logits_none, pad_row_none, other_row_none) = run(None);
    assert!(pad_row_none.iter().any(|&x| x != 0.0));
    assert_eq!(
        other_row, other_row_none,
        "only the pad row's gradient changes"
    );
    assert_eq!(logits, logits_none);
}

/// `train.loss.kl_coef > 0`: the reference is the run's starting model under the learner's forward, so the
/// k3 KL of step 0's single update is exactly 0 (the aligned forward computes the starting policy's bits)
/// and grows once the policy moved; a run stopped after step 1 and resumed loads the same reference from
/// `model.dir` and logs the uninterrupted run's rows bit for bit.
#[test]
fn the_kl_term_is_measured_against_the_starting_policy_across_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let with_kl = |dir: &Path| {
        let mut cfg = tiny_config(dir, "aligned", 4);
        cfg.train.loss.kl_coef = Some(0.5);
        cfg.train.lr = 3e-3;
        // A reward signal the barely warm-started model earns (an answer marker or none), so it moves.
        cfg.verify.format_reward = Some(-1.0);
        cfg
    };
    let whole = with_kl(&tmp.path().join("a"));
    train::run(&whole, false, true).unwrap();
    let rows = common::metrics_without_timing(&whole.run_dir.join("metrics.jsonl"));
    let rl: Vec<_> = rows.iter().filter(|r| r["phase"] == "rl").collect();
    assert_eq!(rl.len(), 4);
    // Exactly 0 while no update has moved the policy (a step whose groups all earned one reward has
    // no gradient), above 0 after.
    let mut moved = false;
    for r in &rl {
        assert_eq!(r["actor/kl_coef"].as_f64(), Some(0.5));
        let kl = r["actor/kl_loss"].as_f64().unwrap();
        assert!(if moved { kl > 0.0 } else { kl == 0.0 }, "{r}");
        moved |= r["actor/grad_norm"].as_f64().unwrap() > 0.0;
    }
    assert!(
        rl.last().unwrap()["actor/kl_loss"].as_f64().unwrap() > 0.0,
        "the policy never moved: the test shows nothing"
    );
    let parted = with_kl(&tmp.path().join("b"));
    let stop = train::RunOptions {
        quiet: true,
        stop_after_step: Some(1),
        ..Default::default()
    };
    train::run_with(&parted, &stop).unwrap();
    train::run(&parted, true, true).unwrap();
    let resumed = common::metrics_without_timing(&parted.run_dir.join("metrics.jsonl"));
    assert_eq!(resumed, rows);
    // `model.dir` may move (a copy of the same files is the same reference), but not change: a resume
    // against other files is refused before the run directory changes.
    let copy_model = |to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(&parted.model.dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    };
    let edited = tmp.path().join("edited-model");
    copy_model(&edited);
    let config = edited.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}\n")).unwrap();
    let mut longer = parted.clone();
    longer.train.steps = 5;
    longer.model.dir = edited.clone();
    let before = std::fs::read(parted.run_dir.join("metrics.jsonl")).unwrap();
    let err = format!("{:#}", train::run(&longer, true, true).unwrap_err());
    assert!(
        err.contains("not the model this run started from") && err.contains("edited-model"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(parted.run_dir.join("metrics.jsonl")).unwrap(),
        before
    );
    let moved = tmp.path().join("moved-model");
    copy_model(&moved);
    longer.model.dir = moved;
    train::run(&longer, true, true).unwrap();
    // Nor may the moved folder hold another tokenizer: the weights come from the checkpoint, the prompts'
    // tokens from `model.dir`.
    let retok = tmp.path().join("retokenized-model");
    copy_model(&retok);
    let tok_path = retok.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    tok["added_tokens"][0]["content"] = "<pad2>".into();
    std::fs::write(&tok_path, tok.to_string()).unwrap();
    longer.model.dir = retok;
    longer.train.steps = 6;
    let before = std::fs::read(parted.run_dir.join("metrics.jsonl")).unwrap();
    let err = format!("{:#}", train::run(&longer, true, true).unwrap_err());
    assert!(
        err.contains("not the tokenizer.json the run was made with"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(parted.run_dir.join("metrics.jsonl")).unwrap(),
        before
    );
}

/// The held-out evaluations stop by `rollout.stop` too and log the strings they stopped at, which `qarl
/// compare` reads back from the run (a run that logs none stopped at none).
#[test]
fn evaluations_follow_rollout_stop_and_log_their_stop_strings() {
    use qarl::train::compare::Evaluation;
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(tmp.path(), "aligned", 1);
    cfg.rollout.stop = qarl::train::config::RolloutStop::Template;
    train::run(&cfg, false, true).unwrap();
    let rows = metrics(&cfg.run_dir.join("metrics.jsonl"));
    let evals: Vec<_> = rows.iter().filter(|r| r["phase"] == "eval").collect();
    assert_eq!(evals.len(), 2);
    for r in &evals {
        assert_eq!(r["eval/stop_strings"], serde_json::json!(["\n"]), "{r}");
    }
    let run = cfg.run_dir.display().to_string();
    let e = Evaluation::load(&run, None).unwrap();
    assert_eq!(e.stop_strings, Some(vec!["\n".to_string()]));
    // The verifier's version is logged; a copy of the run whose log lacks it (written by the first
    // verifier) is not paired with it.
    let version = qarl::tasks::verify::VERIFIER_VERSION;
    for r in &evals {
        assert_eq!(
            r["eval/verifier_version"],
            serde_json::json!(version),
            "{r}"
        );
    }
    let old_run = tmp.path().join("old_verifier");
    std::fs::create_dir_all(&old_run).unwrap();
    std::fs::copy(cfg.run_dir.join("config.json"), old_run.join("config.json")).unwrap();
    let text = std::fs::read_to_string(cfg.run_dir.join("metrics.jsonl")).unwrap();
    let without = text.replace(&format!(",\"eval/verifier_version\":{version}"), "");
    assert_ne!(without, text);
    std::fs::write(old_run.join("metrics.jsonl"), without).unwrap();
    let old = Evaluation::load(&old_run.display().to_string(), None).unwrap();
    assert_eq!(old.verify.as_ref().unwrap()["verifier"], 1);
    let err = qarl::train::compare::check_same_problems(&[&e, &old])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("judged answers under different rules"),
        "{err}"
    );
    // The same log without the key (written before runs logged it): not known under `"template"`, none
    // under `"end_tokens"` (every run before `rollout.stop`).
    let log = cfg.run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&log).unwrap();
    std::fs::write(&log, text.replace(",\"eval/stop_strings\":[\"\\n\"]", "")).unwrap();
    assert_eq!(Evaluation::load(&run, None).unwrap().stop_strings, None);
    let config = cfg.run_dir.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("\"stop\":\"template\""), "{text}");
    std::fs::write(
        &config,
        text.replace("\"stop\":\"template\"", "\"stop\":\"end_tokens\""),
    )
    .unwrap();
    assert_eq!(
        Evaluation::load(&run, None).unwrap().stop_strings,
        Some(vec![])
    );
}

/// With DAPO's overlong buffer, each rollout reward is the verifier's plus the overlong penalty: the step's
/// mean reward is its accuracy (rewards 1 / 0) plus the mean penalty, which long responses make negative.
#[test]
fn rl_rewards_take_the_overlong_penalty() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(tmp.path(), "aligned", 1);
    cfg.verify.overlong_buffer = 6;
    train::run(&cfg, false, true).unwrap();
    let rows = metrics(&cfg.run_dir.join("metrics.jsonl"));
    let r = rows.iter().find(|r| r["phase"] == "rl").unwrap();
    let get = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("no {k}: {r}"));
    let penalty = get("critic/overlong_reward/mean");
    assert!(penalty < 0.0 && get("response/overlong_frac") > 0.0, "{r}");
    let want = get("train/accuracy") + penalty;
    assert!((get("critic/rewards/mean") - want).abs() < 1e-6, "{r}");
}

/// A worked example too long for the model's positions is named by its question, not only by
/// `sft.batch_size`.
#[test]
fn the_warm_start_names_the_example_too_long_for_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let long = format!("{} #### 3", "1+".repeat(300));
    let task = gsm8k_task(
        tmp.path(),
        &[
            ("1+2?", "1+2=3. #### 3"),
            ("long one?", &long),
            ("2+2?", "2+2=4. #### 4"),
        ],
        &[("3+3?", "#### 6")],
    );
    let err = tiny_train_error(tmp.path(), &task);
    assert!(
        err.contains("the worked example of the question \"long one?\"")
            && err.contains("max_position_embeddings (256)"),
        "{err}"
    );
}

/// A held-out question too long for the model's positions is named by its question and set, not only by
/// the `eval.*` keys that size the evaluation.
#[test]
fn a_held_out_problem_too_long_for_the_model_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let long = format!("{}1?", "1+".repeat(200));
    let task = gsm8k_task(
        tmp.path(),
        &[("1+2?", "1+2=3. #### 3"), ("2+2?", "2+2=4. #### 4")],
        &[("3+3?", "#### 6"), (&long, "#### 201")],
    );
    let err = tiny_train_error(tmp.path(), &task);
    assert!(
        err.contains("a held-out problem: the question \"1+1+1+")
            && err.contains("max_position_embeddings (256)"),
        "{err}"
    );
}

/// `--set task=...` for a GSM8K task over `train` and `held_out` (question, answer) records, written as
/// JSONL files into `dir`.
fn gsm8k_task(dir: &Path, train: &[(&str, &str)], held_out: &[(&str, &str)]) -> String {
    let write = |name: &str, records: &[(&str, &str)]| {
        let path = dir.join(name);
        let lines: String = records
            .iter()
            .map(|(q, a)| serde_json::json!({"question": q, "answer": a}).to_string() + "\n")
            .collect();
        std::fs::write(&path, lines).unwrap();
        path
    };
    let (data, held_out) = (write("train.jsonl", train), write("test.jsonl", held_out));
    format!(
        "task={{kind=\"gsm8k\", path=\"{}\", eval_path=\"{}\"}}",
        data.display(),
        held_out.display()
    )
}

/// A `model.dir` made by one warm start is not taken by a config that would make it otherwise: a run
/// with more `sft.steps` and a new `run_dir` trained on the old warm start while its config and report
/// credited the new steps (a warning called it expected). The same recipe takes it; a config that does not
/// say how to make a model (no `[sft]`, base or init config) uses it as given.
#[test]
fn a_model_made_by_another_warm_start_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config(tmp.path(), "aligned", 1);
    let device = Device::flex().autodiff();
    let mut log = qarl::train::metrics::MetricsLog::open(&tmp.path().join("sft.jsonl")).unwrap();
    train::prepare_model(&cfg, &device, &mut log, true).unwrap();
    let made_by = cfg.model.dir.join(qarl::train::MADE_BY_FILE);
    assert!(made_by.is_file());

    let mut longer = cfg.clone();
    longer.run_dir = tmp.path().join("longer");
    longer.sft.as_mut().unwrap().steps += 1;
    let err = format!("{:#}", train::run(&longer, false, true).unwrap_err());
    assert!(
        err.contains("made by another warm start") && err.contains("sft.steps"),
        "{err}"
    );
    assert!(
        !longer.run_dir.join("config.json").exists(),
        "nothing written"
    );

    let mut again = cfg.clone();
    again.run_dir = tmp.path().join("again");
    train::prepare_model(&again, &device, &mut log, true).unwrap();
    // The recipe is what the warm start reads, not where: its init config copied elsewhere, or another
    // logging interval, is the same recipe.
    let moved = tmp.path().join("moved.json");
    std::fs::copy(cfg.model.init_config.as_ref().unwrap(), &moved).unwrap();
    again.model.init_config = Some(moved);
    again.sft.as_mut().unwrap().log_every += 1;
    train::prepare_model(&again, &device, &mut log, true).unwrap();
    let mut given = longer.clone();
    given.sft = None;
    given.model.init_config = None;
    train::prepare_model(&given, &device, &mut log, true).unwrap();
}

/// A run whose dynamic sampling keeps no group makes no update at those steps, and says so in its summary
/// (a random model that answers nothing right: every group's rewards are 0); it printed its accuracies as
/// if it had trained.
#[test]
fn steps_without_a_kept_group_are_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(tmp.path(), "aligned", 2);
    cfg.sft = None;
    cfg.train.dynamic_sampling = true;
    // Three-digit operands: no random guess is right.
    if let qarl::tasks::TaskConfig::Arithmetic(a) = &mut cfg.task {
        (a.min_digits, a.max_digits) = (3, 3);
    }
    let s = train::run(&cfg, false, true).unwrap();
    let rows = metrics(&cfg.run_dir.join("metrics.jsonl"));
    let kept: Vec<f64> = rows
        .iter()
        .filter(|r| r["phase"] == "rl")
        .map(|r| r["train/kept_sequences"].as_f64().unwrap())
        .collect();
    assert_eq!(
        kept,
        [0.0, 0.0],
        "a random model earned a reward spread: the test shows nothing"
    );
    assert_eq!(s.steps_without_update, (2, 2));
}

/// A checkpoint carries its model's tokenizer, template and generation config (it kept the tokenizer
/// alone: `qarl eval` on one prompted in ChatML and stopped at other tokens than its run), and a resume
/// refuses a `model.dir` whose copy of them changed (an edited template mixed two prompt formats in a run).
#[test]
fn checkpoints_carry_the_models_side_files_and_a_resume_checks_them() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config(tmp.path(), "aligned", 2);
    let device = Device::flex().autodiff();
    let mut log = qarl::train::metrics::MetricsLog::open(&tmp.path().join("sft.jsonl")).unwrap();
    train::prepare_model(&cfg, &device, &mut log, true).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cfg.model.dir.join("config.json")).unwrap())
            .unwrap();
    let generation = cfg.model.dir.join("generation_config.json");
    let write_generation = |temperature: f64| {
        let json =
            serde_json::json!({"eos_token_id": config["eos_token_id"], "temperature": temperature});
        std::fs::write(&generation, json.to_string()).unwrap();
    };
    write_generation(1.0);
    let stop = train::RunOptions {
        quiet: true,
        stop_after_step: Some(0),
        ..Default::default()
    };
    train::run_with(&cfg, &stop).unwrap();
    let (ckpt, _) = train::checkpoint::latest(&cfg.run_dir).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(ckpt.join(f).is_file(), "{f} not in {}", ckpt.display());
    }
    write_generation(0.5);
    let err = format!("{:#}", train::run(&cfg, true, true).unwrap_err());
    assert!(
        err.contains("not the generation_config.json the run was made with"),
        "{err}"
    );
    write_generation(1.0);
    train::run(&cfg, true, true).unwrap();
}

/// The error of `qarl train` on the tiny config (written into `dir`) with the task set to `task`.
fn tiny_train_error(dir: &std::path::Path, task: &str) -> String {
    let toml = dir.join("tiny.toml");
    std::fs::write(&toml, common::tiny_train_toml(dir, "aligned", 1)).unwrap();
    common::error_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_qarl"))
            .args(["train", "--quiet", "--config"])
            .arg(&toml)
            .args(["--set", task]),
    )
}

/// `train.update_diagnostics = false` skips the forward after the updates and its metrics, and nothing
/// else: every other value of every row is the default run's (only timings differ).
#[test]
fn update_diagnostics_off_skips_their_forward_and_changes_nothing_else() {
    let runs: Vec<Vec<serde_json::Value>> = [true, false]
        .iter()
        .map(|&on| {
            let tmp = tempfile::tempdir().unwrap();
            let mut cfg = tiny_config(tmp.path(), "aligned", 3);
            cfg.train.update_diagnostics = on;
            train::run(&cfg, false, true).unwrap();
            metrics(&cfg.run_dir.join("metrics.jsonl"))
        })
        .collect();
    let diagnostic = |k: &str| k.starts_with("actor/update_lp_delta") || k == "perf/lp_delta_s";
    let updated = |rows: &[serde_json::Value]| {
        rows.iter()
            .filter(|r| r.get("perf/update_s").is_some())
            .count()
    };
    assert!(
        updated(&runs[0]) > 0,
        "no step made an update: the test checks nothing"
    );
    for r in runs[0].iter().filter(|r| r.get("perf/update_s").is_some()) {
        assert!(r.get("perf/lp_delta_s").is_some(), "{r}");
    }
    assert_eq!(updated(&runs[1]), updated(&runs[0]));
    let strip = |rows: &[serde_json::Value], drop_diagnostics: bool| -> Vec<serde_json::Value> {
        rows.iter()
            .map(|r| {
                let mut r = r.clone();
                if let Some(o) = r.as_object_mut() {
                    let timing = |k: &str| {
                        k.starts_with("perf/") || k.starts_with("timing") || k.ends_with("_s")
                    };
                    o.retain(|k, _| !(timing(k) || (drop_diagnostics && diagnostic(k))));
                }
                r
            })
            .collect()
    };
    assert!(runs[1]
        .iter()
        .all(|r| r.as_object().unwrap().keys().all(|k| !diagnostic(k))));
    assert_eq!(strip(&runs[1], false), strip(&runs[0], true));
}
