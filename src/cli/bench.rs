//! `qarl bench rollout`: rollout throughput of full-precision and quantized weights, side by side in one run.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use burn::module::Module;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::io::write_json_atomic;
use crate::model::Decoder;
use crate::ops::BackendKind;
use crate::quant::Precision;
use crate::rollout::{generate, SamplingParams};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Debug, clap::Subcommand)]
pub enum BenchWhat {
    /// Rollout tokens/s with f32 and quantized weights (prefill + batched KV-cache decode).
    Rollout(RolloutBenchArgs),
    /// The CubeCL low-bit kernels on Qwen3-30B-A3B expert shapes vs burn's bf16 matmul (`--features wgpu`/`cuda`).
    Kernels(super::kernel_bench::KernelBenchArgs),
    /// The RL step of a training config phase by phase, with the machine's FMA peak and DRAM bandwidth
    /// measured in the same run; several variants side by side.
    Step(super::bench_step::StepBenchArgs),
}

#[derive(Debug, clap::Args)]
pub struct RolloutBenchArgs {
    /// Hugging Face model directory (e.g. one made by `qarl init-model`).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompts per generate call (one sample each).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per prompt (random ids from the seed); with `--ragged`, the longest prompt.
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// Prompts of different lengths, spread evenly from `--prompt-len` down to half of it, as an RL batch's
    /// differ: rows of different lengths take their own path through the KV cache (each row's keys
    /// written at its own position), which equal lengths never run.
    #[arg(long)]
    pub ragged: bool,
    /// Tokens generated per prompt (no stop tokens: every row generates all of them).
    #[arg(long, default_value_t = 32)]
    pub new_tokens: usize,
    /// Comma-separated weight formats: `f32` (no quantization) and quantization scheme names.
    #[arg(
        long,
        visible_alias = "formats",
        value_delimiter = ',',
        default_value = "f32,int4-g32,int4-g64,int4-g128,int8-pc,fp8-b128,nvfp4,mxfp4"
    )]
    pub schemes: Vec<String>,
    /// Timed runs per scheme (after one warm-up run); the table shows medians.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Seed of the prompts and of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the numbers to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Flex)]
    pub backend: BackendKind,
    /// Deterministic mode (batch-invariant kernels; the default) `on`, `off`, or `on,off` to time both side
    /// by side (every scheme in each mode, interleaved per scheme).
    #[arg(long, value_delimiter = ',', default_value = "on")]
    pub deterministic: Vec<String>,
    /// MoE experts: `grouped` (one op per layer where the backend has it; the default), `loop` (one expert
    /// at a time), or `grouped,loop` to time both side by side.
    #[arg(long, value_delimiter = ',', default_value = "grouped")]
    pub moe_experts: Vec<String>,
}

/// A comma list of a two-way switch (`--deterministic on,off`), parsed by `parse`; empty is an error.
pub(super) fn parse_switch_list(
    values: &[String],
    flag: &str,
    choices: &str,
    parse: fn(&str) -> anyhow::Result<bool>,
) -> anyhow::Result<Vec<bool>> {
    let parsed = values
        .iter()
        .map(|s| parse(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if parsed.is_empty() {
        anyhow::bail!("{flag} is empty: give {choices}");
    }
    super::refuse_repeats(flag, &parsed, |&on| {
        let spellings: Vec<&str> = values
            .iter()
            .filter(|s| parse(s).is_ok_and(|p| p == on))
            .map(String::as_str)
            .collect();
        spellings.join(", ")
    })?;
    Ok(parsed)
}

/// `grouped` -> true, `loop` -> false.
fn parse_moe_experts(s: &str) -> anyhow::Result<bool> {
    match s.trim() {
        "grouped" => Ok(true),
        "loop" => Ok(false),
        other => anyhow::bail!("--moe-experts takes grouped, loop or grouped,loop; got `{other}`"),
    }
}

/// `on` / `off` (also `true`/`false`, `1`/`0`).
pub(super) fn parse_on_off(s: &str) -> anyhow::Result<bool> {
    match s.trim() {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        other => anyhow::bail!("--deterministic takes on, off or on,off; got `{other}`"),
    }
}

/// Puts `model` in `precision`; returns the seconds it took.
fn timed_set_precision(model: &mut Decoder, precision: Precision) -> anyhow::Result<f64> {
    let start = Instant::now();
    model
        .set_precision(precision)
        .map_err(|e| anyhow::anyhow!("quantizing to {precision}: {e}"))?;
    Ok(start.elapsed().as_secs_f64())
}

/// The measurements of one weight format.
#[derive(Debug, Clone, Serialize)]
pub struct SchemeResult {
    pub scheme: String,
    /// Whether deterministic mode was on.
    pub deterministic: bool,
    /// Whether MoE layers ran the grouped op (else the per-expert loop).
    pub grouped_experts: bool,
    /// Seconds of `model.quantize` (0-ish for f32: dropping the quantized versions).
    pub quantize_s: f64,
    /// Tokens generated per call (batch x new tokens).
    pub tokens: usize,
    /// Median seconds of the whole generate call (prefill + decode).
    pub generate_s: f64,
    /// Median seconds of a generate call of one token (prefill and the first sample).
    pub prefill_s: f64,
    /// Generated tokens per second of the whole call.
    pub tokens_per_s: f64,
    /// `tokens_per_s` over f32's, when f32 was measured.
    pub ratio_to_f32: Option<f64>,
    /// `(generate_s - prefill_s) / (new_tokens - 1)`: one batched decode forward and sampling step.
    pub decode_ms_per_step: Option<f64>,
    /// Device-to-host reads per decode step of the warm-up call ([`crate::host::device_reads`]: 1 on a GPU
    /// on the grouped MoE path, 0 on the CPU), when it made a decode step.
    pub host_reads_per_decode_step: Option<f64>,
    /// Every timed generate call, seconds.
    pub generate_runs_s: Vec<f64>,
    pub prefill_runs_s: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct BenchReport {
    model: String,
    params: usize,
    backend: String,
    batch: usize,
    prompt_len: usize,
    /// The prompts' lengths (`--ragged` spreads them).
    prompt_lens: Vec<usize>,
    new_tokens: usize,
    repeats: usize,
    seed: u64,
    results: Vec<SchemeResult>,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// One prompt of random ids below `vocab` per length.
fn prompts_of_lengths(lens: &[usize], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    lens.iter()
        .map(|&len| {
            (0..len)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect()
        })
        .collect()
}

/// `batch` lengths spread evenly from `longest` down to half of it (at least 1), longest first.
fn ragged_lengths(batch: usize, longest: usize) -> Vec<usize> {
    let shortest = longest.div_ceil(2).max(1);
    let span = longest - shortest;
    (0..batch)
        .map(|i| longest - if batch > 1 { i * span / (batch - 1) } else { 0 })
        .collect()
}

/// Times `generate` on `model` as it is now: one warm-up, then `repeats` runs of the whole call and of a
/// one-token call (prefill). Returns the result without the quantize time and ratio, or an error when the
/// warm-up's log-probs are not finite (a broken model would be timed on rows cut short).
pub fn time_rollout(
    model: &Decoder,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    repeats: usize,
    seed: u64,
    scheme: &str,
) -> anyhow::Result<SchemeResult> {
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: new_tokens,
        seed,
        ..Default::default()
    };
    let prefill = SamplingParams {
        max_new_tokens: 1,
        ..params.clone()
    };
    let warm = generate(model, prompts, 1, &params, None);
    warm.ensure_finite()
        .map_err(|e| anyhow::anyhow!("{scheme} rollout: {e}"))?;
    let tokens = warm.generated_tokens();
    let host_reads_per_decode_step =
        (warm.decode_steps > 0).then(|| warm.decode_host_reads as f64 / warm.decode_steps as f64);
    // Grown as the runs come (`--repeats` is the user's, unbounded: reserving it up front aborted on a huge value).
    let mut full_runs = Vec::new();
    let mut prefill_runs = Vec::new();
    for _ in 0..repeats {
        let start = Instant::now();
        let r = generate(model, prompts, 1, &params, None);
        full_runs.push(start.elapsed().as_secs_f64());
        debug_assert_eq!(r.generated_tokens(), tokens);
        if new_tokens > 1 {
            let start = Instant::now();
            generate(model, prompts, 1, &prefill, None);
            prefill_runs.push(start.elapsed().as_secs_f64());
        }
    }
    let generate_s = median(&full_runs);
    let (prefill_s, decode_ms_per_step) = if new_tokens > 1 {
        let p = median(&prefill_runs);
        (
            p,
            Some((generate_s - p).max(0.0) * 1e3 / (new_tokens - 1) as f64),
        )
    } else {
        (generate_s, None)
    };
    Ok(SchemeResult {
        scheme: scheme.to_string(),
        deterministic: crate::ops::deterministic(),
        grouped_experts: crate::ops::grouped_experts(),
        quantize_s: 0.0,
        tokens,
        generate_s,
        prefill_s,
        tokens_per_s: tokens as f64 / generate_s,
        ratio_to_f32: None,
        decode_ms_per_step,
        host_reads_per_decode_step,
        generate_runs_s: full_runs,
        prefill_runs_s: prefill_runs,
    })
}

fn format_table(results: &[SchemeResult]) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:<10} | {:>13} | {:>11} | {:>10} | {:>8} | {:>10} | {:>14} | {:>10}\n",
        "scheme",
        "deterministic",
        "moe experts",
        "tokens/s",
        "x f32",
        "prefill ms",
        "ms/decode step",
        "quantize s"
    ));
    s.push_str(&format!(
        "{:-<10}-+-{:->13}-+-{:->11}-+-{:->10}-+-{:->8}-+-{:->10}-+-{:->14}-+-{:->10}\n",
        "", "", "", "", "", "", "", ""
    ));
    for r in results {
        let ratio = r.ratio_to_f32.map_or("-".into(), |x| format!("{x:.2}"));
        let decode = r
            .decode_ms_per_step
            .map_or("-".into(), |x| format!("{x:.1}"));
        s.push_str(&format!(
            "{:<10} | {:>13} | {:>11} | {:>10.1} | {:>8} | {:>10.1} | {:>14} | {:>10.2}\n",
            r.scheme,
            if r.deterministic { "on" } else { "off" },
            if r.grouped_experts { "grouped" } else { "loop" },
            r.tokens_per_s,
            ratio,
            r.prefill_s * 1e3,
            decode,
            r.quantize_s
        ));
    }
    s
}

fn run_rollout(args: RolloutBenchArgs) -> anyhow::Result<()> {
    if let Some(json) = &args.json {
        crate::io::check_output_file(json)?;
        let model_files = crate::model::checkpoint::files_read(&args.model);
        crate::io::check_output_not_input(json, &model_files)?;
    }
    let formats = args
        .schemes
        .iter()
        .map(|s| Precision::from_str(s).map_err(|e| anyhow::anyhow!("--schemes: {e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if formats.is_empty() {
        anyhow::bail!("--schemes is empty: name at least one of f32, int4-g128, ...");
    }
    super::refuse_repeats("--schemes", &formats, |p| p.to_string())?;
    for (name, v) in [
        ("--batch", args.batch),
        ("--prompt-len", args.prompt_len),
        ("--new-tokens", args.new_tokens),
        ("--repeats", args.repeats),
    ] {
        if v == 0 {
            anyhow::bail!("{name} must be at least 1");
        }
    }
    let modes = parse_switch_list(
        &args.deterministic,
        "--deterministic",
        "on, off or on,off",
        parse_on_off,
    )?;
    let expert_paths = parse_switch_list(
        &args.moe_experts,
        "--moe-experts",
        "grouped, loop or grouped,loop",
        parse_moe_experts,
    )?;
    let device = args.backend.device()?;
    let start = Instant::now();
    let mut model = Decoder::load_full_precision(&args.model, &device)?;
    crate::rollout::check_rollout_size(
        &model.config,
        crate::rollout::RolloutInputs {
            rows: "--batch",
            reach: "--prompt-len / --new-tokens",
        },
        args.batch,
        args.prompt_len,
        args.new_tokens,
    )?;
    // A dense model has no experts: the column would name a path that never ran.
    if model.config.moe.is_none() && expert_paths != [true] {
        anyhow::bail!(
            "--moe-experts {}: {} is a dense model (no `moe` experts), so only the default applies",
            args.moe_experts.join(","),
            args.model.display()
        );
    }
    let params = model.num_params();
    eprintln!(
        "loaded {} ({:.1}M parameters) in {:.1} s",
        args.model.display(),
        params as f64 / 1e6,
        start.elapsed().as_secs_f64()
    );
    let prompt_lens = if args.ragged {
        ragged_lengths(args.batch, args.prompt_len)
    } else {
        vec![args.prompt_len; args.batch]
    };
    let prompts = prompts_of_lengths(&prompt_lens, model.config.vocab_size, args.seed);
    let mut results = Vec::with_capacity(formats.len());
    for f in &formats {
        let quantize_s = timed_set_precision(&mut model, *f)?;
        eprintln!(
            "{}: weights ready in {quantize_s:.2} s, timing...",
            f.name()
        );
        for &on in &modes {
            crate::ops::set_deterministic(on);
            for &grouped in &expert_paths {
                crate::ops::set_grouped_experts(grouped);
                let mut r = time_rollout(
                    &model,
                    &prompts,
                    args.new_tokens,
                    args.repeats,
                    args.seed,
                    f.name(),
                )?;
                r.quantize_s = quantize_s;
                results.push(r);
            }
        }
    }
    crate::ops::set_deterministic(true);
    crate::ops::set_grouped_experts(true);
    for &on in &modes {
        for &grouped in &expert_paths {
            let same = |r: &SchemeResult| r.deterministic == on && r.grouped_experts == grouped;
            if let Some(base) = results
                .iter()
                .find(|r| r.scheme == "f32" && same(r))
                .map(|r| r.tokens_per_s)
            {
                for r in results.iter_mut().filter(|r| same(r)) {
                    r.ratio_to_f32 = Some(r.tokens_per_s / base);
                }
            }
        }
    }
    let prompt = match (prompt_lens.iter().min(), prompt_lens.iter().max()) {
        (Some(lo), Some(hi)) if lo != hi => format!("prompts {lo}-{hi} tokens (ragged)"),
        _ => format!("prompt {} tokens", args.prompt_len),
    };
    println!(
        "rollout benchmark: {} ({:.1}M params, backend {}), batch {}, {prompt}, {} new tokens, median of {} run(s)",
        args.model.display(),
        params as f64 / 1e6,
        args.backend,
        args.batch,
        args.new_tokens,
        args.repeats
    );
    print!("{}", format_table(&results));
    let quant_line: Vec<String> = results
        .iter()
        // Once per scheme: the first mode's and the first expert path's row (`--moe-experts
        // grouped,loop` listed every scheme twice).
        .filter(|r| r.deterministic == modes[0] && r.grouped_experts == results[0].grouped_experts)
        .map(|r| format!("{} {:.2} s", r.scheme, r.quantize_s))
        .collect();
    println!("quantize time: {}", quant_line.join(", "));
    // tokens/s of variant `a` over variant `b` per scheme, the other setting held at its first value.
    let ratios = |pick: &dyn Fn(&SchemeResult, bool) -> bool| -> String {
        formats
            .iter()
            .filter_map(|f| {
                let tps = |v: bool| {
                    results
                        .iter()
                        .find(|r| r.scheme == f.name() && pick(r, v))
                        .map(|r| r.tokens_per_s)
                };
                Some(format!("{} {:.2}", f.name(), tps(true)? / tps(false)?))
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    if modes.contains(&true) && modes.contains(&false) {
        let line = ratios(&|r, on| r.deterministic == on && r.grouped_experts == expert_paths[0]);
        println!("deterministic on / off tokens/s: {line}");
    }
    if expert_paths.contains(&true) && expert_paths.contains(&false) {
        let line =
            ratios(&|r, grouped| r.deterministic == modes[0] && r.grouped_experts == grouped);
        println!("moe experts grouped / loop tokens/s: {line}");
    }
    if let Some(path) = &args.json {
        write_json_atomic(
            path,
            &BenchReport {
                model: args.model.display().to_string(),
                params,
                backend: args.backend.to_string(),
                batch: args.batch,
                prompt_len: args.prompt_len,
                prompt_lens,
                new_tokens: args.new_tokens,
                repeats: args.repeats,
                seed: args.seed,
                results,
            },
        )?;
    }
    Ok(())
}

/// Said before a benchmark times anything in a binary built without `--release` (debug assertions
/// on: `cargo build` / `cargo run`, whose profile builds qarl's own CPU kernels at opt-level 1): its
/// times are several times a release build's, with nothing else to tell them apart.
fn warn_if_dev_build() {
    if cfg!(debug_assertions) {
        eprintln!(
            "warning: this qarl is a dev build (built without --release): its CPU kernels run at \
             opt-level 1, so these timings are several times a release build's; for numbers to \
             compare, `cargo build --release` (or `cargo run --release -- bench ...`)"
        );
    }
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let summarizes = matches!(&args.what, BenchWhat::Kernels(a) if a.summarize.is_some());
    // A variant's own process: its parent has said it once already.
    let variant_child = matches!(&args.what, BenchWhat::Step(a) if a.variant_child.is_some());
    if !summarizes && !variant_child {
        warn_if_dev_build();
    }
    match args.what {
        BenchWhat::Rollout(a) => run_rollout(a),
        BenchWhat::Kernels(a) => super::kernel_bench::run(a),
        BenchWhat::Step(a) => super::bench_step::run(a),
    }
}
