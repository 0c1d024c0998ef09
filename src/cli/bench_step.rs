//! `qarl bench step`: the RL step of a training config phase by phase (rollout prefill and decode, reward,
//! `lp_old`, learner forward and backward, optimizer, weight sync), with achieved GFLOP/s next to the FMA
//! peak and decode bandwidth next to the DRAM probe, both measured in the same run, and the peak resident
//! memory; several variants of the config side by side.

use std::path::PathBuf;

use serde::Serialize;

use crate::io::write_json_atomic;
use crate::ops::cpu::kernel::SimdPath;
use crate::ops::cpu::probe;
use crate::ops::BackendKind;
use crate::train::bench::{bench_steps, StepTimings};
use crate::train::load_config_on;

#[derive(Debug, clap::Args)]
pub struct StepBenchArgs {
    /// Training config (TOML); without it, the embedded default.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one config value for every variant, e.g. `--set rollout.prompts_per_step=4`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// A variant timed side by side: `LABEL:KEY=VALUE,KEY=VALUE` (e.g. `f32:rollout.precision=f32`),
    /// applied after `--set`. Without any, the config itself is timed.
    #[arg(long = "variant", value_name = "LABEL:KEY=VALUE,...")]
    pub variants: Vec<String>,
    /// Compute backend (flex, wgpu, cuda) of every variant; overrides the config's `train.backend`.
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Timed steps per variant (the table shows medians).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Untimed steps first (allocator and caches warm).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Also write every step's `perf/*` numbers to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// No per-step lines.
    #[arg(long)]
    pub quiet: bool,
    /// Internal: time the config alone (no probes, no table) and write its timings to this JSON file. The
    /// parent runs each variant of a side-by-side comparison this way, in its own process, so that a
    /// variant's peak resident memory is its own (a process's heap keeps what an earlier variant freed).
    #[arg(long, hide = true)]
    pub variant_child: Option<PathBuf>,
}

/// One variant: its label and its extra overrides.
fn parse_variant(s: &str) -> anyhow::Result<(String, Vec<String>)> {
    let (label, sets) = s.split_once(':').ok_or_else(|| {
        anyhow::anyhow!("--variant `{s}`: expected LABEL:KEY=VALUE[,KEY=VALUE...]")
    })?;
    anyhow::ensure!(
        !label.trim().is_empty(),
        "--variant `{s}`: the label is empty"
    );
    let sets: Vec<String> = split_top_level(sets)
        .into_iter()
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(String::from)
        .collect();
    Ok((label.trim().to_string(), sets))
}

/// `s` cut at the commas outside brackets, braces and quotes: a TOML array or inline table in a value
/// (`task.ops=["add","sub"]`) stays one override.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut quote, mut start) = (Vec::new(), 0i32, None, 0);
    for (i, c) in s.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '[' | '{') => depth += 1,
            (None, ']' | '}') => depth -= 1,
            (None, ',') if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

#[derive(Debug, Serialize)]
struct Report {
    fma_peak_gflops: f64,
    dram_gbs: f64,
    simd_path: String,
    threads: usize,
    variants: Vec<VariantReport>,
}

#[derive(Debug, Serialize)]
struct VariantReport {
    label: String,
    model: String,
    steps: Vec<std::collections::BTreeMap<String, f64>>,
}

pub fn run(a: StepBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.steps > 0, "--steps must be at least 1");
    if let Some(out) = &a.variant_child {
        return run_child(&a, out);
    }
    if let Some(json) = &a.json {
        crate::io::check_output_file(json)?;
    }
    let variants: Vec<(String, Vec<String>)> = if a.variants.is_empty() {
        vec![("config".to_string(), Vec::new())]
    } else {
        a.variants
            .iter()
            .map(|v| parse_variant(v))
            .collect::<anyhow::Result<_>>()?
    };
    // Rows and the JSON are keyed by label: two variants of one label would read as one.
    let labels: Vec<&String> = variants.iter().map(|(label, _)| label).collect();
    if let Some((i, label)) = labels
        .iter()
        .enumerate()
        .find(|(i, label)| labels[..*i].contains(label))
    {
        anyhow::bail!(
            "--variant: the label `{label}` is given twice (variants {} and {}): each variant needs its \
             own label",
            labels.iter().position(|l| l == label).map_or(0, |p| p + 1),
            i + 1
        );
    }
    // Every config is read and validated before anything runs.
    let configs = variants
        .iter()
        .map(|(label, sets)| {
            let all: Vec<String> = a.set.iter().chain(sets).cloned().collect();
            load_config_on(a.config.as_deref(), &all, a.backend)
                .map(|c| (label.clone(), c))
                .map_err(|e| anyhow::anyhow!("variant {label}: {e}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some(json) = &a.json {
        let mut inputs: Vec<PathBuf> = a.config.iter().cloned().collect();
        inputs.extend(configs.iter().flat_map(|(_, c)| c.files_in_use()));
        crate::io::check_output_not_input(json, &inputs)?;
    }
    // Every backend is checked before the (slow) machine probes.
    let devices = configs
        .iter()
        .map(|(_, cfg)| cfg.train.backend.device().map(|d| d.autodiff()))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let path = SimdPath::detect();
    eprintln!("probing the machine (FMA peak, DRAM read bandwidth)...");
    let peak = probe::fma_peak_gflops(path, 5);
    let dram = probe::dram_read_gbs(5);
    drop(devices);
    let mut results = Vec::new();
    for ((label, _), (_, sets)) in configs.iter().zip(&variants) {
        eprintln!(
            "variant {label}: {} warm-up + {} timed steps (own process)",
            a.warmup, a.steps
        );
        let t = time_in_child(&a, sets).map_err(|e| anyhow::anyhow!("variant {label}: {e}"))?;
        results.push((label.clone(), t));
    }
    println!(
        "# qarl bench step: {} threads, SIMD path {}, FMA peak {peak:.0} GFLOP/s, DRAM read {dram:.1} GB/s\n",
        rayon::current_num_threads(),
        path.name()
    );
    for (label, t) in &results {
        println!(
            "## {label} ({}; medians of {} steps)\n",
            t.model,
            t.steps.len()
        );
        print_table(t, peak, dram);
    }
    if results.len() > 1 {
        print_side_by_side(&results);
    }
    if let Some(json) = &a.json {
        let report = Report {
            fma_peak_gflops: peak,
            dram_gbs: dram,
            simd_path: path.name().to_string(),
            threads: rayon::current_num_threads(),
            variants: results
                .into_iter()
                .map(|(label, t)| VariantReport {
                    label,
                    model: t.model,
                    steps: t.steps,
                })
                .collect(),
        };
        write_json_atomic(json, &report)?;
    }
    Ok(())
}

/// Times one variant in a child process of this executable (`--variant-child`): the config and
/// overrides of `a`, then `sets`.
fn time_in_child(a: &StepBenchArgs, sets: &[String]) -> anyhow::Result<StepTimings> {
    let out = tempfile::NamedTempFile::new()?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(["bench", "step", "--steps", &a.steps.to_string()])
        .args(["--warmup", &a.warmup.to_string()]);
    if let Some(c) = &a.config {
        cmd.arg("--config").arg(c);
    }
    for s in a.set.iter().chain(sets) {
        cmd.arg("--set").arg(s);
    }
    if let Some(b) = a.backend {
        cmd.arg("--backend").arg(b.to_string());
    }
    if a.quiet {
        cmd.arg("--quiet");
    }
    cmd.arg("--variant-child").arg(out.path());
    // The child's stdin is a pipe this process holds open: killed, it closes, and the child stops too
    // instead of running on (a warm start of minutes) under PID 1.
    cmd.env(EXIT_WITH_PARENT, "1")
        .stdin(std::process::Stdio::piped());
    let mut child = cmd.spawn()?;
    // Held here, not by `child`: `Child::wait` closes the stdin it holds before waiting.
    let pipe = child.stdin.take();
    let status = child.wait()?;
    drop(pipe);
    anyhow::ensure!(status.success(), "its process failed ({status})");
    let text = std::fs::read_to_string(out.path())?;
    Ok(serde_json::from_str(&text)?)
}

/// Set by [`time_in_child`] for its child: exit when stdin, the parent's pipe, ends.
const EXIT_WITH_PARENT: &str = "QARL_BENCH_EXIT_WITH_PARENT";

/// The child side of [`time_in_child`]: the steps of the one config, written to `out`.
fn run_child(a: &StepBenchArgs, out: &std::path::Path) -> anyhow::Result<()> {
    if std::env::var_os(EXIT_WITH_PARENT).is_some() {
        // Nothing is ever written to the pipe: its end is the parent's.
        std::thread::spawn(|| {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            eprintln!("qarl bench step: the parent process ended; stopping this variant");
            std::process::exit(130);
        });
    }
    let cfg = load_config_on(a.config.as_deref(), &a.set, a.backend)?;
    let device = cfg.train.backend.device()?.autodiff();
    probe::reset_peak_resident();
    let t = bench_steps(&cfg, &device, a.warmup, a.steps, a.quiet)?;
    write_json_atomic(out, &t)
}

/// The phases of a step: label and `perf/*` key of their seconds.
const PHASES: [(&str, &str); 10] = [
    ("rollout prefill", "perf/rollout_prefill_s"),
    ("rollout decode", "perf/rollout_decode_s"),
    ("reward", "perf/reward_s"),
    ("lp_old", "perf/lp_old_s"),
    ("lp_ref", "perf/lp_ref_s"),
    ("learner forward", "perf/learner_forward_s"),
    ("learner backward", "perf/learner_backward_s"),
    ("optimizer", "perf/optim_s"),
    ("weight sync", "perf/weight_sync_s"),
    ("update diagnostics", "perf/lp_delta_s"),
];

fn print_table(t: &StepTimings, peak: f64, dram: f64) {
    let get = |k: &str| t.median(k).unwrap_or(0.0);
    let step = get("perf/step_s");
    let pct = |x: f64| format!("{:.0}%", 100.0 * x);
    println!("| phase | s/step | share | rate | of the probe |");
    println!("|---|---:|---:|---:|---:|");
    let mut accounted = 0.0;
    for (name, key) in PHASES {
        let s = get(key);
        accounted += s;
        let (rate, of_probe) = match name {
            "rollout prefill" => gflops(get("perf/rollout_prefill_gflop"), s, peak),
            "rollout decode" => {
                let weights = get("perf/rollout_decode_weight_gb") / s.max(1e-12);
                let kv = get("perf/rollout_decode_kv_gb") / s.max(1e-12);
                let tps = get("perf/rollout_decode_gflop") / s.max(1e-12);
                (
                    format!("{tps:.1} GFLOP/s, weights {weights:.1} + KV {kv:.1} GB/s"),
                    pct((weights + kv) / dram),
                )
            }
            "learner forward" => gflops(get("perf/learner_forward_gflop"), s, peak),
            // dx and dW: two products of the forward's size for each matmul of a forward with a graph.
            "learner backward" => gflops(get("perf/learner_backward_gflop"), s, peak),
            _ => (String::new(), String::new()),
        };
        println!(
            "| {name} | {s:.2} | {} | {rate} | {of_probe} |",
            pct(s / step.max(1e-12))
        );
    }
    println!(
        "| other | {:.2} | {} | | |",
        step - accounted,
        pct((step - accounted) / step.max(1e-12))
    );
    let fb = get("perf/learner_forward_s") + get("perf/learner_backward_s");
    let fb_gflop = get("perf/learner_forward_gflop") + get("perf/learner_backward_gflop");
    let (rate, of_probe) = gflops(fb_gflop, fb, peak);
    println!(
        "| **learner forward + backward** | {fb:.2} | {} | {rate} | {of_probe} |",
        pct(fb / step.max(1e-12))
    );
    println!("| **step** | {step:.2} | 100% | | |\n");
    println!(
        "learner tokens {:.0} (loss positions {:.0}), generated tokens {:.0}, peak resident memory {:.2} GB\n",
        get("perf/learner_tokens"),
        get("perf/loss_tokens"),
        get("perf/generated_tokens"),
        t.max("perf/peak_rss_gb").unwrap_or(f64::NAN)
    );
}

/// `gflop / s` as GFLOP/s and its share of `peak`.
fn gflops(gflop: f64, s: f64, peak: f64) -> (String, String) {
    if gflop <= 0.0 || s <= 0.0 {
        return (String::new(), String::new());
    }
    let rate = gflop / s;
    (
        format!("{rate:.1} GFLOP/s"),
        format!("{:.0}% of FMA peak", 100.0 * rate / peak),
    )
}

fn print_side_by_side(results: &[(String, StepTimings)]) {
    println!("{}", side_by_side(results));
    print_mismatch(results);
}

/// The variants' phase times side by side, with the first variant's time over each other's.
fn side_by_side(results: &[(String, StepTimings)]) -> String {
    use std::fmt::Write;
    let base = &results[0];
    let mut out = String::from("| phase (s/step) |");
    for (label, _) in results {
        let _ = write!(out, " {label} |");
    }
    for (label, _) in &results[1..] {
        let _ = write!(out, " {} / {label} |", base.0);
    }
    let _ = writeln!(out, "\n|---|{}", "---:|".repeat(2 * results.len() - 1));
    let keys = PHASES.iter().copied().chain([
        ("step", "perf/step_s"),
        ("peak RSS (GB)", "perf/peak_rss_gb"),
    ]);
    for (name, key) in keys {
        // A phase a variant does not run logs no time: 0 s, as the one-variant table prints it (the
        // reference forward without `kl_coef`: it printed NaN here), where the peak memory is a
        // measurement or nothing.
        let value = |t: &StepTimings| {
            if key == "perf/peak_rss_gb" {
                t.max(key)
            } else {
                Some(t.median(key).unwrap_or(0.0))
            }
        };
        let _ = write!(out, "| {name} |");
        for (_, t) in results {
            match value(t) {
                Some(v) => write!(out, " {v:.2} |"),
                None => write!(out, " - |"),
            }
            .ok();
        }
        for (_, t) in &results[1..] {
            match (value(&base.1), value(t)) {
                (Some(b), Some(v)) if v > 0.0 => write!(out, " {:.2}x |", b / v),
                _ => write!(out, " - |"),
            }
            .ok();
        }
        out.push('\n');
    }
    out
}

/// The rollout/learner mismatch each variant's timed steps left (medians): what a faster variant's kernels
/// cost in alignment (deterministic mode: k3 exactly 0 with the aligned forward).
fn print_mismatch(results: &[(String, StepTimings)]) {
    const KEYS: [(&str, &str); 3] = [
        ("k3 KL", crate::rl::metrics::names::K3_KL),
        ("error tokens: ratio", crate::rl::metrics::names::RATIO_FRAC),
        (
            "error tokens: any",
            crate::rl::metrics::names::ANY_ERROR_FRAC,
        ),
    ];
    print!("| mismatch (median) |");
    for (label, _) in results {
        print!(" {label} |");
    }
    println!();
    println!("|---|{}", "---:|".repeat(results.len()));
    for (name, key) in KEYS {
        print!("| {name} |");
        for (_, t) in results {
            print!(" {:.3e} |", t.median(key).unwrap_or(f64::NAN));
        }
        println!();
    }
    println!();
}

#[cfg(test)]
mod tests {
    use super::parse_variant;

    /// A phase one variant does not run (the reference forward without `kl_coef`) is 0 s, and a ratio
    /// against nothing is `-`: both printed NaN.
    #[test]
    fn side_by_side_reads_a_phase_not_run_as_zero() {
        use crate::train::bench::StepTimings;
        let timings = |pairs: &[(&str, f64)]| StepTimings {
            steps: vec![pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()],
            model: String::new(),
        };
        let base = timings(&[
            ("perf/step_s", 2.0),
            ("perf/lp_ref_s", 0.5),
            ("perf/peak_rss_gb", 1.0),
        ]);
        let other = timings(&[("perf/step_s", 1.0)]);
        let table = super::side_by_side(&[("a".into(), base), ("b".into(), other)]);
        assert!(!table.contains("NaN"), "{table}");
        assert!(table.contains("| step | 2.00 | 1.00 | 2.00x |"), "{table}");
        assert!(
            table.contains("| peak RSS (GB) | 1.00 | - | - |"),
            "{table}"
        );
        assert!(table.contains("| lp_ref | 0.50 | 0.00 | - |"), "{table}");
    }

    #[test]
    fn variants_parse_their_label_and_overrides() {
        let (l, s) = parse_variant("f32: rollout.precision=f32, train.forward=full").unwrap();
        assert_eq!(l, "f32");
        assert_eq!(s, vec!["rollout.precision=f32", "train.forward=full"]);
        assert!(parse_variant("no-colon").is_err());
        assert!(parse_variant(":a=b").is_err());
        // A comma inside an array, an inline table or a string belongs to the value.
        let (_, s) =
            parse_variant(r#"a: task.ops=["add","sub"], x={ p = 1, q = "2,3" }, y="u,v""#).unwrap();
        assert_eq!(
            s,
            vec![
                r#"task.ops=["add","sub"]"#,
                r#"x={ p = 1, q = "2,3" }"#,
                r#"y="u,v""#
            ]
        );
    }
}
