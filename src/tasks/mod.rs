//! Tasks for RL and SFT: the synthetic arithmetic generator, GSM8K / MATH loaders, prompt templates, the
//! verifier, and the character tokenizer of the synthetic task. Host-side only (no tensors).
//!
//! A [`Task`] is built from a [`TaskConfig`] (serde, tagged by `kind`):
//!
//! ```toml
//! [task]
//! kind = "arithmetic"          # every ArithmeticConfig knob, all optional
//! max_digits = 3
//! ops = ["add", "mul"]
//!
//! # or
//! kind = "gsm8k"               # or "math"; GSM8K-format JSONL (`question`, `answer` ending in `#### N`)
//! path = "experiments/data/word_problems_train.jsonl"
//! eval_path = "experiments/data/word_problems_test.jsonl"   # optional; else a hashed eval_fraction of `path`
//! template = { kind = "chat" } # default: plain "Question: {q}\nAnswer:"
//! ```
//!
//! [`Task::sample_prompts`] draws training examples from a seed, [`Task::eval_set`] returns the held-out set,
//! disjoint from anything `sample_prompts` can return. [`verify::score`] (or [`Task::score`]) judges a
//! response.

pub mod arithmetic;
pub mod char_tokenizer;
pub mod chat_template;
pub mod datasets;
pub mod template;
pub mod verify;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use arithmetic::{ArithmeticConfig, ArithmeticError, Op, Problem};
pub use datasets::{DatasetError, LineError, OnBadLine, Record};
pub use template::{ChatTemplate, PlainTemplate, Template, TemplateConfig, TemplateError};
pub use verify::{score, Verdict, VerifyConfig, VerifyError};

/// One prompt with its gold answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Example {
    /// The question as the data set or the generator states it (before the template).
    pub question: String,
    /// The rendered prompt (template applied).
    pub prompt: String,
    /// Whether the prompt starts with the tokenizer's BOS ([`Template::prompt_takes_bos`]).
    pub with_bos: bool,
    /// The gold final answer (compare with [`verify::score`]).
    pub answer: String,
    /// The completion that follows `prompt` for supervised training (worked solution; no EOS token).
    pub solution: Option<String>,
}

/// Errors of task construction: a knob out of range, a data set that does not load or split, a template
/// that does not build. Each names the task and the knob or the file.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// Not `#[from]`: a source would be printed twice by anyhow's `{:#}`, the message holds it already.
    #[error("task config: {0}")]
    Arithmetic(ArithmeticError),
    #[error(
        "task config: {task}: `task.eval_fraction` must be in (0, 1) when there is no `task.eval_path`, got \
         {eval_fraction}"
    )]
    EvalFraction {
        task: &'static str,
        eval_fraction: f64,
    },
    #[error(
        "task config: {task}: `task.eval_fraction` = {eval_fraction} beside `task.eval_path`: the held-out set \
         is that file and nothing of `task.path` is held out, so the fraction would be ignored; remove one"
    )]
    EvalFractionWithPath {
        task: &'static str,
        eval_fraction: f64,
    },
    #[error(
        "task config: {task}: no training records left in {path} after holding out the eval set"
    )]
    NoTrainingRecords { task: &'static str, path: PathBuf },
    #[error(
        "task config: {task}: the held-out set is empty ({path} has {records} records, eval_fraction \
         {eval_fraction}); set eval_path or a larger eval_fraction"
    )]
    EmptyEvalSet {
        task: &'static str,
        path: PathBuf,
        records: usize,
        eval_fraction: f64,
    },
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// Which task, and its knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum TaskConfig {
    /// The synthetic arithmetic task.
    Arithmetic(ArithmeticConfig),
    /// GSM8K-format JSONL.
    Gsm8k(DatasetConfig),
    /// MATH-style JSONL.
    Math(DatasetConfig),
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig::Arithmetic(ArithmeticConfig::default())
    }
}

impl TaskConfig {
    /// The chat template of a data-set task that prompts with one (`None`: arithmetic, or plain).
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        match self {
            TaskConfig::Gsm8k(d) | TaskConfig::Math(d) => match &d.template {
                TemplateConfig::Chat(chat) => Some(chat),
                TemplateConfig::Plain(_) => None,
            },
            TaskConfig::Arithmetic(_) => None,
        }
    }

    /// The same config with a data set's held-out fraction written out where it applies
    /// ([`DatasetConfig::with_defaults`]).
    pub fn with_defaults(&self) -> Self {
        match self {
            TaskConfig::Gsm8k(d) => TaskConfig::Gsm8k(d.with_defaults()),
            TaskConfig::Math(d) => TaskConfig::Math(d.with_defaults()),
            TaskConfig::Arithmetic(_) => self.clone(),
        }
    }

    /// A recorded `task` table (a run's config.json, a warm start's resume point) as this version writes it
    /// with [`Self::with_defaults`], so that tables recorded before and after a field changed compare
    /// equal; as recorded where it does not read as a task config.
    pub fn normalized_json(recorded: &serde_json::Value) -> serde_json::Value {
        serde_json::from_value::<TaskConfig>(recorded.clone())
            .ok()
            .and_then(|t| serde_json::to_value(t.with_defaults()).ok())
            .unwrap_or_else(|| recorded.clone())
    }

    /// Resolves relative dataset and model paths against `base` (e.g. the directory of the config file).
    pub fn with_base_dir(mut self, base: &Path) -> Self {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        if let TaskConfig::Gsm8k(d) | TaskConfig::Math(d) = &mut self {
            fix(&mut d.path);
            if let Some(e) = &mut d.eval_path {
                fix(e);
            }
            if let TemplateConfig::Chat(ChatTemplate {
                model_dir: Some(m), ..
            }) = &mut d.template
            {
                fix(m);
            }
        }
        self
    }

    /// The error of a `[task]` table read as its kind's struct, which points at the field at fault where
    /// the enum's own error points at the table (serde's internally tagged enums read their table into
    /// a buffer first, so toml's error for a bad value inside one points at the table's header and never
    /// names the key), going on into its `template` table where that is what the error points at; `None`
    /// where it reads.
    pub fn locate_error(table: &toml::Spanned<toml::de::DeValue<'_>>) -> Option<toml::de::Error> {
        let (kind, fields) = kind_and_fields(table)?;
        let error = match kind.as_str() {
            "arithmetic" => ArithmeticConfig::deserialize(fields).err(),
            "gsm8k" | "math" => DatasetConfig::deserialize(fields).err(),
            _ => None,
        }?;
        let template = table.get_ref().get("template");
        match template.filter(|t| error.span() == Some(t.span())) {
            Some(t) => TemplateConfig::locate_error(t).or(Some(error)),
            None => Some(error),
        }
    }
}

/// A table's `kind` and its other fields, still spanned, ready to be read as that kind's struct (why:
/// [`TaskConfig::locate_error`]). `None` for a value that is no table or has no string `kind`.
fn kind_and_fields<'i>(
    table: &toml::Spanned<toml::de::DeValue<'i>>,
) -> Option<(String, toml::de::ValueDeserializer<'i>)> {
    let mut fields = table.get_ref().as_table()?.clone();
    let kind = fields.remove("kind")?.get_ref().as_str()?.to_string();
    let value = toml::Spanned::new(table.span(), toml::de::DeValue::Table(fields));
    Some((kind, toml::de::ValueDeserializer::from(value)))
}

/// A JSONL data set task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    /// Training file.
    pub path: PathBuf,
    /// Held-out file; when absent, `eval_fraction` of `path` (chosen by a hash of the question) is held out.
    #[serde(default)]
    pub eval_path: Option<PathBuf>,
    /// Fraction of `path` held out when there is no `eval_path` ([`DEFAULT_EVAL_FRACTION`] when not
    /// given; refused beside `eval_path`, where nothing is held out of `path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_fraction: Option<f64>,
    /// Prompt template (default plain `Question: {q}\nAnswer:`).
    #[serde(default)]
    pub template: TemplateConfig,
    /// What to do with malformed lines (default `error`).
    #[serde(default)]
    pub on_bad_line: OnBadLine,
    /// Remove GSM8K calculator annotations `<<a*b=c>>` from the solutions (default true).
    #[serde(default = "default_true")]
    pub strip_calculator_annotations: bool,
}

/// The fraction of the training file held out when neither `eval_path` nor `eval_fraction` is given.
pub const DEFAULT_EVAL_FRACTION: f64 = 0.1;

impl DatasetConfig {
    /// The checks that need no file: a held-out fraction that leaves both sets non-empty in principle,
    /// and none beside a held-out file (it would be ignored).
    pub fn check(&self, task: &'static str) -> Result<(), TaskError> {
        match (&self.eval_path, self.eval_fraction) {
            (Some(_), Some(eval_fraction)) => Err(TaskError::EvalFractionWithPath {
                task,
                eval_fraction,
            }),
            (None, _) if !(self.held_out_fraction() > 0.0 && self.held_out_fraction() < 1.0) => {
                Err(TaskError::EvalFraction {
                    task,
                    eval_fraction: self.held_out_fraction(),
                })
            }
            _ => Ok(()),
        }
    }

    /// The fraction of `path` held out (without `eval_path`).
    pub fn held_out_fraction(&self) -> f64 {
        self.eval_fraction.unwrap_or(DEFAULT_EVAL_FRACTION)
    }

    /// The same config with the held-out fraction written out where it applies (`qarl config show`), and
    /// dropped where it does not (the config.json of runs made before it was refused beside `eval_path`
    /// holds one, which a resume compares as absent).
    pub fn with_defaults(&self) -> Self {
        let mut filled = self.clone();
        filled.eval_fraction = match filled.eval_path {
            None => Some(self.held_out_fraction()),
            Some(_) => None,
        };
        filled
    }
}

fn default_true() -> bool {
    true
}

/// A task ready to serve prompts.
#[derive(Clone, Debug)]
pub enum Task {
    Arithmetic(ArithmeticConfig),
    Dataset(DatasetTask),
}

/// A loaded data set split into training and held-out records.
#[derive(Clone, Debug)]
pub struct DatasetTask {
    name: &'static str,
    train: Vec<Record>,
    eval: Vec<Record>,
    /// `train` and `eval` with the template applied, rendered once when the task is built: a record the
    /// template cannot render is reported then, naming its line, not in the middle of a run.
    train_examples: Vec<Example>,
    eval_examples: Vec<Example>,
    template: Template,
    /// Why the training records have no SFT completions, where the template could not split one from its
    /// conversation (a reasoning model's): only a warm start needs them, and it reports this.
    completion_error: Option<String>,
}

impl DatasetTask {
    /// Training records.
    pub fn train(&self) -> &[Record] {
        &self.train
    }

    /// Held-out records (deduplicated, file order).
    pub fn eval(&self) -> &[Record] {
        &self.eval
    }

    /// The prompt template.
    pub fn template(&self) -> &Template {
        &self.template
    }
}

/// `records` of the data set in `path` as examples under `template` (the solutions without calculator
/// annotations where `strip_annotations`), and the first completion the template could not render (then
/// no example has a solution: only a warm start needs them, and it reports the error).
fn render_examples(
    records: &[Record],
    template: &Template,
    strip_annotations: bool,
    path: &Path,
) -> Result<(Vec<Example>, Option<String>), TaskError> {
    let at_line = |r: &Record, e: TemplateError| TemplateError::Invalid {
        path: path.to_path_buf(),
        msg: format!("line {}: {e}", r.line),
    };
    let mut completion_error = None;
    let mut examples = Vec::with_capacity(records.len());
    for r in records {
        let sol = if strip_annotations {
            datasets::strip_calculator_annotations(&r.solution)
        } else {
            r.solution.clone()
        };
        let solution = if completion_error.is_some() {
            None
        } else {
            match template.render_completion(&r.question, &sol) {
                Ok(s) => Some(s),
                Err(e) => {
                    completion_error = Some(at_line(r, e).to_string());
                    None
                }
            }
        };
        examples.push(Example {
            question: r.question.clone(),
            prompt: template
                .render_prompt(&r.question)
                .map_err(|e| at_line(r, e))?,
            with_bos: template.prompt_takes_bos(),
            answer: r.answer.clone(),
            solution,
        });
    }
    if completion_error.is_some() {
        for ex in &mut examples {
            ex.solution = None;
        }
    }
    Ok((examples, completion_error))
}

/// Seed of the arithmetic held-out stream.
pub const ARITHMETIC_EVAL_SEED: u64 = 0x5EED_E7A1_0000_0001;
/// One in this many arithmetic prompts (by a stable hash of the prompt) is held out for evaluation.
pub const ARITHMETIC_EVAL_MODULUS: u64 = 10;

/// FNV-1a 64 of `s` (stable across platforms and Rust versions).
pub fn stable_hash(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A fingerprint of a list of questions, in order (`stable_hash` over each question's byte length and text,
/// as 16 hex digits). Each held-out evaluation logs the fingerprint of its questions
/// (`eval/questions_fingerprint`), so `qarl compare`, which rebuilds a run's questions from its config, can
/// tell whether they are still the ones the run was evaluated on (data files edited, another checkout).
pub fn questions_fingerprint(questions: &[String]) -> String {
    let text: String = questions
        .iter()
        .map(|q| format!("{}:{q}\n", q.len()))
        .collect();
    format!("{:016x}", stable_hash(&text))
}

/// A fingerprint of problems: each question with its gold answer (the questions alone,
/// `eval/questions_fingerprint`, miss an edited gold), logged on every evaluation as
/// `eval/problems_fingerprint`.
pub fn problems_fingerprint(examples: &[Example]) -> String {
    let items: Vec<String> = examples
        .iter()
        .map(|e| format!("{}\u{1f}{}", e.question, e.answer))
        .collect();
    questions_fingerprint(&items)
}

fn arithmetic_is_eval(prompt: &str) -> bool {
    stable_hash(prompt).is_multiple_of(ARITHMETIC_EVAL_MODULUS)
}

fn problem_example(p: Problem) -> Example {
    Example {
        question: p.prompt.clone(),
        prompt: p.prompt,
        with_bos: true,
        answer: p.answer,
        solution: Some(p.solution),
    }
}

impl Task {
    /// Builds the task (loads and splits data sets, checks the template). Errors name the file or the knob.
    pub fn from_config(cfg: &TaskConfig) -> Result<Self, TaskError> {
        match cfg {
            TaskConfig::Arithmetic(a) => {
                a.validate().map_err(TaskError::Arithmetic)?;
                Ok(Task::Arithmetic(a.clone()))
            }
            TaskConfig::Gsm8k(d) => Self::dataset("gsm8k", d, |p, o| datasets::load_gsm8k(p, o)),
            TaskConfig::Math(d) => Self::dataset("math", d, |p, o| datasets::load_math(p, o)),
        }
    }

    fn dataset(
        name: &'static str,
        d: &DatasetConfig,
        load: fn(&Path, OnBadLine) -> Result<Vec<Record>, DatasetError>,
    ) -> Result<Self, TaskError> {
        d.check(name)?;
        let template = Template::from_config(&d.template)?;
        let all = load(&d.path, d.on_bad_line)?;
        let (train, eval_all) = match &d.eval_path {
            Some(ep) => {
                let eval = load(ep, d.on_bad_line)?;
                let held: HashSet<&str> = eval.iter().map(|r| r.question.as_str()).collect();
                let train: Vec<Record> = all
                    .iter()
                    .filter(|r| !held.contains(r.question.as_str()))
                    .cloned()
                    .collect();
                (train, eval)
            }
            None => {
                let cut = (d.held_out_fraction() * 1_000_000.0) as u64;
                let (eval, train): (Vec<Record>, Vec<Record>) = all
                    .into_iter()
                    .partition(|r| stable_hash(&r.question) % 1_000_000 < cut);
                (train, eval)
            }
        };
        let (eval, _repeats) =
            datasets::unique_questions(eval_all, d.eval_path.as_deref().unwrap_or(&d.path))?;
        if train.is_empty() {
            return Err(TaskError::NoTrainingRecords {
                task: name,
                path: d.path.clone(),
            });
        }
        if eval.is_empty() {
            return Err(TaskError::EmptyEvalSet {
                task: name,
                path: d.path.clone(),
                records: train.len(),
                eval_fraction: d.held_out_fraction(),
            });
        }
        let strip = d.strip_calculator_annotations;
        let eval_path = d.eval_path.as_deref().unwrap_or(&d.path);
        let (train_examples, completion_error) =
            render_examples(&train, &template, strip, &d.path)?;
        let (eval_examples, _) = render_examples(&eval, &template, strip, eval_path)?;
        Ok(Task::Dataset(DatasetTask {
            name,
            train_examples,
            eval_examples,
            train,
            eval,
            template,
            completion_error,
        }))
    }

    /// `arithmetic`, `gsm8k` or `math`.
    pub fn name(&self) -> &'static str {
        match self {
            Task::Arithmetic(_) => "arithmetic",
            Task::Dataset(d) => d.name,
        }
    }

    /// `n` training examples drawn deterministically from `seed`, never from the held-out set. Arithmetic:
    /// fresh problems (repeats possible). Data sets: successive seeded permutations of the training records
    /// (no repeat until every record was served once).
    pub fn sample_prompts(&self, n: usize, seed: u64) -> Vec<Example> {
        match self {
            Task::Arithmetic(cfg) => {
                let cap = n.saturating_mul(100).saturating_add(10_000);
                cfg.stream(seed)
                    .enumerate()
                    // A problem space too small to hold anything out falls back to unfiltered draws.
                    .filter(|(drawn, p)| *drawn >= cap || !arithmetic_is_eval(&p.prompt))
                    .map(|(_, p)| problem_example(p))
                    .take(n)
                    .collect()
            }
            Task::Dataset(d) => {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let mut idx: Vec<usize> = (0..d.train.len()).collect();
                // Not `n` itself: the size checks that bound it run on the prompts drawn here.
                let mut out = Vec::with_capacity(n.min(1 << 16));
                while out.len() < n {
                    idx.shuffle(&mut rng);
                    for &i in idx.iter().take(n - out.len()) {
                        out.push(d.train_examples[i].clone());
                    }
                }
                out
            }
        }
    }

    /// Every training example of a data set (`None` for arithmetic, whose problems are drawn afresh):
    /// what a warm start's size checks look at before its first step, since each step draws its own.
    pub fn training_examples(&self) -> Option<Vec<Example>> {
        match self {
            Task::Arithmetic(_) => None,
            Task::Dataset(d) => Some(d.train_examples.clone()),
        }
    }

    /// A fingerprint of the training set ([`questions_fingerprint`] over each example's rendered prompt,
    /// gold answer and worked solution), where it is a data file's (`None` for arithmetic, generated from
    /// the seed): a run records it, so that a data file edited under a resumed or pooled run is found, and a
    /// model directory's recipe names its warm start's examples by it.
    pub fn training_fingerprint(&self) -> Option<String> {
        let examples = self.training_examples()?;
        let items: Vec<String> = examples
            .iter()
            .map(|e| {
                let solution = e.solution.as_deref().unwrap_or("");
                format!("{}\u{1f}{}\u{1f}{solution}", e.prompt, e.answer)
            })
            .collect();
        Some(questions_fingerprint(&items))
    }

    /// [`problems_fingerprint`] of the held-out problems [`Self::eval_set`]`(n)` holds.
    pub fn problems_fingerprint(&self, n: usize) -> String {
        problems_fingerprint(&self.eval_set(n))
    }

    /// How many examples [`Self::eval_set`]`(n)` holds at most: `n`, or fewer where a data set holds out
    /// fewer (found without building them, for the size checks before a run).
    pub fn eval_size_at_most(&self, n: usize) -> usize {
        match self {
            Task::Arithmetic(_) => n,
            Task::Dataset(d) => n.min(d.eval.len()),
        }
    }

    /// The first `n` held-out examples (deduplicated; fewer when the held-out set is smaller). The same for
    /// every call.
    pub fn eval_set(&self, n: usize) -> Vec<Example> {
        match self {
            Task::Arithmetic(cfg) => {
                let mut out = Vec::with_capacity(n.min(1 << 16));
                let mut seen = HashSet::new();
                let cap = n.saturating_mul(200).saturating_add(20_000);
                for p in cfg.stream(ARITHMETIC_EVAL_SEED).take(cap) {
                    if out.len() >= n {
                        break;
                    }
                    if arithmetic_is_eval(&p.prompt) && seen.insert(p.prompt.clone()) {
                        out.push(problem_example(p));
                    }
                }
                out
            }
            Task::Dataset(d) => d.eval_examples.iter().take(n).cloned().collect(),
        }
    }

    /// What identifies each of [`Self::eval_set`]'s problems, in the same order: a data set's question as
    /// written in its file (before the template), an arithmetic problem's prompt. `qarl compare` matches
    /// evaluations by these, including `qarl eval --output` files, which list the questions.
    pub fn eval_questions(&self, n: usize) -> Vec<String> {
        match self {
            Task::Arithmetic(_) => self.eval_set(n).into_iter().map(|e| e.prompt).collect(),
            Task::Dataset(d) => d.eval.iter().take(n).map(|r| r.question.clone()).collect(),
        }
    }

    /// The chat template's turn ends ([`Template::turn_ends`]; none for arithmetic and the plain template).
    pub fn turn_ends(&self) -> Vec<String> {
        match self {
            Task::Arithmetic(_) => vec![],
            Task::Dataset(d) => d.template.turn_ends(),
        }
    }

    /// Strings that end a generated answer: `"\n"` for arithmetic (its answer line ends the solution), the
    /// template's otherwise.
    pub fn stop_strings(&self) -> Vec<String> {
        match self {
            Task::Arithmetic(_) => vec!["\n".into()],
            Task::Dataset(d) => d.template.stop_strings(),
        }
    }

    /// The answer-only completion of `example`: its final-answer line with no working (` #### 7` for
    /// arithmetic and GSM8K, `\boxed{7}` for MATH), rendered like a worked solution. A warm start that mixes
    /// these in (`sft.answer_only_frac`) learns two ways of answering, as models pretrained on real text do.
    pub fn answer_only_solution(&self, example: &Example) -> Result<String, TemplateError> {
        match self {
            Task::Arithmetic(_) => Ok(format!(" #### {}\n", example.answer)),
            Task::Dataset(d) => {
                let line = if d.name == "math" {
                    format!("\\boxed{{{}}}", example.answer)
                } else {
                    format!("#### {}", example.answer)
                };
                d.template.render_completion(&example.question, &line)
            }
        }
    }

    /// Whether the training examples can be trained on (SFT): a data set whose template could not split a
    /// worked solution from its conversation cannot.
    pub fn check_completions(&self) -> Result<(), TaskError> {
        match self {
            Task::Dataset(DatasetTask {
                completion_error: Some(e),
                ..
            }) => Err(TaskError::Template(TemplateError::Invalid {
                path: "task.template".into(),
                msg: format!("a warm start needs worked solutions after the prompts: {e}"),
            })),
            _ => Ok(()),
        }
    }

    /// Whether a supervised completion ends the assistant's turn itself (a model's chat template writes
    /// the turn's end), so that it gets no EOS after it ([`Template::completion_closes_turn`]).
    pub fn completion_closes_turn(&self) -> bool {
        matches!(self, Task::Dataset(d) if d.template.completion_closes_turn())
    }

    /// Scores `response` (the completion only) against `example`'s gold answer.
    pub fn score(&self, response: &str, example: &Example, cfg: &VerifyConfig) -> Verdict {
        verify::score(response, &example.answer, cfg)
    }
}
