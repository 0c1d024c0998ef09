//! The `qarl` command line: argument parsing that calls into the library, no logic of its own.

mod bench;
mod bench_step;
mod compare;
mod config;
mod eval;
mod generate;
mod import_gguf;
mod init_model;
mod kernel_bench;
mod kernel_summary;
mod mismatch;
mod quantize;
pub mod runs;
mod score;
mod train;

use clap::{Parser, Subcommand};

/// qarl: reinforcement learning of LLMs with quantized rollouts aligned with training.
#[derive(Debug, Parser)]
#[command(name = "qarl", version = crate::train::checkpoint::BUILD, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Full-sequence forward: logits and next-token log-probs of given token ids.
    Score(score::ScoreArgs),
    /// Generate continuations of prompts: sampling with recorded log-probs, or greedy.
    Generate(generate::GenerateArgs),
    /// Write a model directory with random weights from a config.json.
    InitModel(init_model::InitModelArgs),
    /// Benchmarks (`bench rollout`: tokens/s of f32 and quantized rollouts side by side).
    Bench(bench::BenchArgs),
    /// RL training (QaRL): without --config, a tiny MoE learns arithmetic (SFT first, then int4 QaRL + TBPO).
    Train(train::TrainArgs),
    /// Show the resolved training config (`qarl config show default --set train.lr=1e-4`).
    Config(config::ConfigArgs),
    /// List the runs under runs/ and experiments/results/ with their last step, accuracy and status.
    Runs(runs::RunsArgs),
    /// Render a run's metrics (reward, accuracy, mismatch KL, entropy, error tokens, step time) to PNG.
    Plot(train::PlotArgs),
    /// Run a comparison of training variants over seeds (resumable) and write its report.
    Experiment(train::ExperimentArgs),
    /// Supervised warm start on worked solutions; writes a Hugging Face-format model directory.
    Sft(train::SftArgs),
    /// Write a quantized checkpoint (packed codes + scales) that every command loads without re-quantizing.
    Quantize(quantize::QuantizeArgs),
    /// Greedy accuracy on a GSM8K-format JSONL file (chat or plain template), in any precision.
    Eval(eval::EvalArgs),
    /// Two arms' greedy evaluations (`qarl eval` outputs, runs' held-out evaluations) paired by problem.
    Compare(compare::CompareArgs),
    /// Rollout/learner mismatch of quantized rollouts on GSM8K prompts (full vs aligned training forward).
    Mismatch(mismatch::MismatchArgs),
    /// Import a llama.cpp GGUF file (Llama architecture) as a Hugging Face model directory.
    ImportGguf(import_gguf::ImportGgufArgs),
}

/// A real-number flag read as f32, refused where a value other than 0 would read as 0 (`1e-50` would silently
/// mean greedy decoding as a temperature). Negative and non-finite numbers reach the command's own range check
/// (every value flag takes one: [`parse_from`]), which names the range, rather than clap calling `-1` an
/// unexpected argument.
pub fn f32_flag(text: &str) -> Result<f32, String> {
    let v = f64_flag(text)?;
    let x = v as f32;
    if v != 0.0 && x == 0.0 {
        return Err(format!(
            "`{text}` is too small for an f32: it would read as 0"
        ));
    }
    // Past f32's range the value would read as infinity, and the range check name `inf`, not the text.
    if v.is_finite() && !x.is_finite() {
        return Err(format!(
            "`{text}` is too large for an f32 (at most about 3.4e38)"
        ));
    }
    Ok(x)
}

/// A number flag held as f64 (`--top-p`, compared in f64 as the config's `top_p` is: as f32, 0.8 would read
/// 0.800000012).
pub fn f64_flag(text: &str) -> Result<f64, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))
}

/// Loads a model directory and, with `quant`, quantizes its projections (default layer selection); its
/// forwards run with `activations`.
pub fn load_model(
    dir: &std::path::Path,
    device: &burn::tensor::Device,
    quant: Option<crate::quant::QuantScheme>,
    activations: crate::model::Activations,
) -> anyhow::Result<crate::model::Decoder> {
    let mut model = crate::model::Decoder::load(dir, device)?;
    if let Some(scheme) = quant {
        if let Some(have) = &model.config.quantization {
            anyhow::bail!(
                "{}: the checkpoint is already quantized ({}); drop --quant or start from the full-precision model",
                dir.display(),
                have.scheme
            );
        }
        model
            .set_precision(crate::quant::Precision::Quantized(scheme))
            .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    }
    model.set_activations(activations)?;
    Ok(model)
}

/// What a command reads that its output must not replace (`crate::io::check_output_not_input`): the given
/// files and the files of its model directory.
pub(crate) fn inputs_with_model<'a>(
    model: &std::path::Path,
    files: impl IntoIterator<Item = &'a std::path::PathBuf>,
) -> Vec<std::path::PathBuf> {
    let mut inputs = crate::model::checkpoint::files_read(model);
    inputs.extend(files.into_iter().cloned());
    inputs
}

/// Refuses a list flag that names one value twice (`--schemes f32,f32`): it would be measured twice, in
/// two rows that read as two things.
pub(crate) fn refuse_repeats<T: PartialEq>(
    flag: &str,
    items: &[T],
    name: impl Fn(&T) -> String,
) -> anyhow::Result<()> {
    for (i, item) in items.iter().enumerate() {
        if items[..i].contains(item) {
            anyhow::bail!(
                "{flag} names the same value twice ({}): it would be measured twice",
                name(item)
            );
        }
    }
    Ok(())
}

/// Every flag that takes a value accepts one that starts with `-` and a digit (`--max-gb -1`), for every
/// subcommand: the value's own check then names the flag and its range, where clap would call `-1` an
/// unexpected argument.
fn negative_numbers_as_values(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        let takes_values = a.get_action().takes_values();
        a.allow_negative_numbers(takes_values)
    })
    .mut_subcommands(negative_numbers_as_values)
}

/// The command line `args` (the program's name first), as [`run`] reads it.
pub fn parse_from<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::{CommandFactory, FromArgMatches};
    let matches = negative_numbers_as_values(Cli::command()).try_get_matches_from(args)?;
    Cli::from_arg_matches(&matches)
}

/// Parses the command line and runs the command.
pub fn run() -> anyhow::Result<()> {
    let cli = parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit());
    // A misspelt path would otherwise run (and time, or test) another path than the one asked for.
    crate::ops::cpu::kernel::SimdPath::check_env().map_err(anyhow::Error::msg)?;
    crate::ops::check_poison_env().map_err(anyhow::Error::msg)?;
    match cli.command {
        Command::Score(a) => score::run(a),
        Command::Generate(a) => generate::run(a),
        Command::InitModel(a) => init_model::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::ImportGguf(a) => import_gguf::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Mismatch(a) => mismatch::run(a),
        Command::Train(a) => train::run_train(a),
        Command::Sft(a) => train::run_sft(a),
        Command::Experiment(a) => train::run_experiment(a),
        Command::Plot(a) => train::run_plot(a),
        Command::Config(a) => config::run(a),
        Command::Runs(a) => runs::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Activations;
    use crate::quant::QuantScheme;

    fn parse(args: &[&str]) -> Command {
        parse_from(std::iter::once("qarl").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .command
    }

    /// A negative number is a flag's value on every subcommand, so the flag's own check names it (clap
    /// alone calls `-1` an unexpected argument); a flag that takes no value still refuses one.
    #[test]
    fn negative_numbers_reach_the_flags_checks() {
        let args = [
            "init-model",
            "--config",
            "c",
            "--output",
            "o",
            "--max-gb",
            "-1",
        ];
        let Command::InitModel(a) = parse(&args) else {
            panic!("not init-model");
        };
        assert_eq!(a.max_gb, -1.0);
        let limit = [
            "qarl", "eval", "--model", "m", "--data", "d", "--limit", "-1",
        ];
        let e = parse_from(limit).unwrap_err().to_string();
        assert!(
            e.contains("invalid value '-1' for '--limit <LIMIT>'"),
            "{e}"
        );
        let flag = [
            "qarl", "eval", "--model", "m", "--data", "d", "--quiet", "-1",
        ];
        let e = parse_from(flag).unwrap_err().to_string();
        assert!(e.contains("unexpected argument '-1'"), "{e}");
    }

    /// One meaning, one flag name across commands: each command that spells a meaning its own way also
    /// takes the other commands' spelling (`--quant`/`--scheme`, `--runtime`/`--backend`,
    /// `--act-dtype`/`--activations`, `--formats`/`--schemes`).
    #[test]
    fn other_commands_flag_names_are_accepted() {
        for cmd in ["eval", "generate", "score"] {
            let mut args = vec![
                cmd,
                "--model",
                "m",
                "--scheme",
                "int4-g32",
                "--act-dtype",
                "bf16",
            ];
            args.extend(match cmd {
                "eval" => &["--data", "d"][..],
                "score" => &["--input", "i", "--output", "o"][..],
                _ => &["--prompt", "p", "--output", "o"][..],
            });
            let (quant, activations) = match parse(&args) {
                Command::Eval(a) => (a.quant, a.activations),
                Command::Generate(a) => (a.quant, a.activations),
                Command::Score(a) => (a.quant, a.activations),
                other => panic!("{other:?}"),
            };
            assert_eq!(quant, Some(QuantScheme::Int4G32), "{cmd}");
            assert_eq!(activations, Activations::Bf16, "{cmd}");
        }
        let args = [
            "quantize", "--model", "m", "--output", "o", "--quant", "int8-pc",
        ];
        let Command::Quantize(q) = parse(&args) else {
            panic!("not quantize");
        };
        assert_eq!(q.scheme, QuantScheme::Int8PerChannel);
        let args = [
            "mismatch",
            "--model",
            "m",
            "--data",
            "d",
            "--formats",
            "int8-pc",
        ];
        let Command::Mismatch(m) = parse(&[&args[..], &["--act-dtype", "f16"]].concat()) else {
            panic!("not mismatch");
        };
        assert_eq!(m.schemes, [QuantScheme::Int8PerChannel]);
        assert_eq!(m.activations, [Activations::F16]);
        let args = [
            "bench",
            "rollout",
            "--model",
            "m",
            "--formats",
            "f32,int4-g32",
        ];
        let Command::Bench(bench::BenchArgs {
            what: bench::BenchWhat::Rollout(r),
        }) = parse(&args)
        else {
            panic!("not bench rollout");
        };
        assert_eq!(r.schemes, ["f32", "int4-g32"]);
        let kernels = [
            "bench",
            "kernels",
            "--backend",
            "cuda",
            "--schemes",
            "int8-pc",
            "--activations",
            "bf16,f32",
        ];
        let Command::Bench(bench::BenchArgs {
            what: bench::BenchWhat::Kernels(k),
        }) = parse(&kernels)
        else {
            panic!("not bench kernels");
        };
        assert_eq!(k.runtime, "cuda");
        assert_eq!(k.formats, ["int8-pc"]);
        assert_eq!(k.act_dtype, [Activations::Bf16, Activations::F32]);
    }
}
