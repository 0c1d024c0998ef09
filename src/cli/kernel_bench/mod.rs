//! `qarl bench kernels`: the CubeCL low-bit kernels on Qwen3-30B-A3B expert shapes (hidden 2048, expert
//! intermediate 768, 128 experts, top-8), timed against burn's bf16 matmul on the same device, with the
//! achieved GB/s and TFLOP/s next to the measured copy bandwidth and bf16 matmul rate. `--check` first
//! compares every kernel with the host reference on these shapes (fails the command on a mismatch).
//!
//! `--act-dtype f32,f16,bf16` runs the kernels with activations of each type the device has (others are
//! skipped with a message). For f16/bf16 the check is the kernels' precision contract: the result equals
//! the kernel's f32 result on the same inputs, rounded to the type (bitwise), and lies within that rounding
//! (`u |ref|`, `u` the type's unit roundoff) plus the f32 tolerance of the host reference.

use std::path::PathBuf;

use super::kernel_summary::print_summaries;

/// Arguments of `qarl bench kernels`.
#[derive(Debug, clap::Args)]
pub struct KernelBenchArgs {
    /// CubeCL runtime: `wgpu` (Vulkan/Metal/DX12, lavapipe on a CPU) or `cuda`; each needs its cargo feature.
    #[arg(long, visible_alias = "backend", default_value = "wgpu")]
    pub runtime: String,
    /// Weight formats.
    #[arg(
        long,
        visible_alias = "schemes",
        value_delimiter = ',',
        default_value = "int4-g128,int8-pc,fp8-b128"
    )]
    pub formats: Vec<String>,
    /// Token counts (decode batch sizes and prefill chunks).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    pub tokens: Vec<usize>,
    /// Model width.
    #[arg(long, default_value_t = 2048)]
    pub hidden: usize,
    /// Expert intermediate width.
    #[arg(long, default_value_t = 768)]
    pub inter: usize,
    /// Number of experts.
    #[arg(long, default_value_t = 128)]
    pub experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    /// Timed iterations per row (after two warm-up runs); the table shows the mean.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Side of the square bf16 matmul timed as the compute roofline.
    #[arg(long, default_value_t = 4096)]
    pub matmul_size: usize,
    /// MiB copied to measure the bandwidth roofline.
    #[arg(long, default_value_t = 256)]
    pub copy_mib: usize,
    /// Activation types (`f32`, `f16`, `bf16`); a type the device lacks is skipped with a message.
    #[arg(
        long,
        visible_alias = "activations",
        value_enum,
        value_delimiter = ',',
        default_value = "f32"
    )]
    pub act_dtype: Vec<crate::model::Activations>,
    /// Check each kernel against the host reference before timing.
    #[arg(long)]
    pub check: bool,
    /// Also write the rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Measure nothing: print the MoE block summary of a table written earlier with `--json` (any
    /// build, no device needed). The options of a measurement are refused beside it.
    #[arg(long, value_name = "JSON", conflicts_with_all = [
        "runtime", "formats", "tokens", "hidden", "inter", "experts", "top_k", "iters", "matmul_size",
        "copy_mib", "act_dtype", "check", "json", "parts", "only",
    ])]
    pub summarize: Option<PathBuf>,
    /// Which parts of the table to run: `dense` (one expert's gate projection on every path) and `moe`
    /// (the MoE block, the decode step among its rows). The GPU check's MoE table takes `moe` alone.
    #[arg(long, value_delimiter = ',', default_value = "dense,moe")]
    pub parts: Vec<TablePart>,
    /// Time only these rows (labels as the table prints them, e.g. `moe/mma-frag,moe/mma`; a profiler
    /// then sees only their launches); empty: every row. `--check` still checks every kernel.
    #[arg(long, value_delimiter = ',', value_name = "KERNELS")]
    pub only: Vec<String>,
}

/// A part of the kernels' table (`--parts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TablePart {
    /// One expert's gate projection, `linear/...` rows.
    Dense,
    /// The MoE block, `moe/...` rows.
    Moe,
}

impl KernelBenchArgs {
    /// The sizes a table needs, refused with the flag named: at least one of each size and count, and
    /// no more experts per token than experts (a token routes to distinct experts).
    fn check_sizes(&self) -> anyhow::Result<()> {
        let positive = [
            ("--hidden", self.hidden),
            ("--inter", self.inter),
            ("--experts", self.experts),
            ("--top-k", self.top_k),
            ("--iters", self.iters),
            ("--matmul-size", self.matmul_size),
            ("--copy-mib", self.copy_mib),
        ];
        for (flag, value) in positive {
            anyhow::ensure!(value > 0, "{flag} {value}: must be at least 1");
        }
        anyhow::ensure!(
            !self.tokens.is_empty() && !self.tokens.contains(&0),
            "--tokens {:?}: every token count must be at least 1",
            self.tokens
        );
        // The format names too, before any device is sought and the rooflines measured (clap checks
        // the activation types').
        for name in &self.formats {
            cube_kernels::WeightFormat::parse(name)
                .map_err(|e| anyhow::anyhow!("--formats {name}: {e}"))?;
        }
        anyhow::ensure!(
            self.top_k <= self.experts,
            "--top-k {} with --experts {}: a token routes to distinct experts, so at most {}",
            self.top_k,
            self.experts,
            self.experts
        );
        Ok(())
    }

    /// The largest token count (at least 1): the checks compare every smaller count's rows, and the
    /// tiles' checks run, on its tokens.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn most_tokens(&self) -> usize {
        self.tokens.iter().copied().max().unwrap_or(1).max(1)
    }

    /// Whether the row `label` is timed (`--only`).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn wants(&self, label: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == label)
    }
}

/// Refuses a saved table whose rows a summary would misread: each row an object with a `kernel`, a
/// `format` and an `act_dtype` string, a whole `tokens` count, and positive finite times and rates
/// (`micros` 0 read as "0.00x the baseline's time, within 1.3x").
fn check_rows(path: &std::path::Path, rows: &[serde_json::Value]) -> anyhow::Result<()> {
    for (i, r) in rows.iter().enumerate() {
        let bad = |what: &str| anyhow::anyhow!("{}: row {i}: {what}", path.display());
        for key in ["kernel", "format", "act_dtype"] {
            if !r[key].is_string() {
                return Err(bad(&format!("no `{key}` string")));
            }
        }
        if r["tokens"].as_u64().is_none() {
            return Err(bad("no whole `tokens` count"));
        }
        for key in ["micros", "bf16_micros", "bandwidth_fraction"] {
            match r[key].as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => {}
                _ => return Err(bad(&format!("`{key}` = {}: not a positive number", r[key]))),
            }
        }
    }
    Ok(())
}

/// Runs the benchmark (an error naming the cargo feature when no CubeCL runtime is compiled in), or with
/// `--summarize` prints the summary of a saved table.
pub fn run(args: KernelBenchArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.summarize {
        let doc: serde_json::Value = crate::io::read_json(path)?;
        let Some(rows) = doc["rows"].as_array() else {
            anyhow::bail!(
                "{}: no `rows` array (not a `qarl bench kernels --json` table)",
                path.display()
            );
        };
        anyhow::ensure!(
            !rows.is_empty(),
            "{}: a table without rows (its run measured nothing)",
            path.display()
        );
        let Some(copy) = doc["copy_gb_per_s"].as_f64() else {
            anyhow::bail!(
                "{}: no `copy_gb_per_s` (the yardstick of the decode rows; not a `qarl bench kernels \
                 --json` table)",
                path.display()
            );
        };
        anyhow::ensure!(
            copy.is_finite() && copy > 0.0,
            "{}: `copy_gb_per_s` = {copy}: no measured bandwidth (edited, or not a `qarl bench kernels \
             --json` table)",
            path.display()
        );
        check_rows(path, rows)?;
        println!(
            "{} ({}), copy {copy:.0} GB/s:",
            doc["device"].as_str().unwrap_or("unknown device"),
            doc["runtime"].as_str().unwrap_or("?"),
        );
        if doc["complete"] == serde_json::json!(false) {
            println!(
                "a partial table: the run stopped after {} rows (its rows so far are summarized)",
                rows.len()
            );
        }
        let base = doc["baseline_dtype"].as_str().unwrap_or("baseline");
        print_summaries(base, rows);
        return Ok(());
    }
    args.check_sizes()?;
    anyhow::ensure!(
        matches!(args.runtime.as_str(), "wgpu" | "cuda"),
        "`bench kernels --runtime {}`: not a CubeCL runtime (wgpu or cuda)",
        args.runtime
    );
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        bench::run(args)
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        anyhow::bail!(
            "`bench kernels --runtime {}` needs a CubeCL runtime: rebuild with `cargo build --release --features wgpu` (or `cuda`)",
            args.runtime
        )
    }
}

#[cfg(test)]
mod tests {
    use super::KernelBenchArgs;

    /// `--only` names whole row labels: a listed one is timed, a longer label that starts with it is
    /// not, and without the option every row is.
    #[test]
    fn only_times_the_rows_named() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: KernelBenchArgs,
        }
        let parse = |argv: &[&str]| {
            <Cli as clap::Parser>::try_parse_from([&["qarl"], argv].concat())
                .unwrap()
                .args
        };
        let some = parse(&["--only", "moe/mma,moe/decode-split"]);
        assert!(some.wants("moe/mma") && some.wants("moe/decode-split"));
        assert!(!some.wants("moe/mma-frag") && !some.wants("linear/mma"));
        let all = parse(&[]);
        assert!(all.wants("moe/mma-frag") && all.wants("linear/gemv"));
    }

    /// `--parts` takes `dense` and `moe` (both by default) and refuses another name.
    #[test]
    fn parts_name_the_table_sections() {
        use super::TablePart;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: KernelBenchArgs,
        }
        let parse = |argv: &[&str]| {
            <Cli as clap::Parser>::try_parse_from([&["qarl"], argv].concat()).map(|c| c.args.parts)
        };
        assert_eq!(parse(&[]).unwrap(), [TablePart::Dense, TablePart::Moe]);
        assert_eq!(parse(&["--parts", "moe"]).unwrap(), [TablePart::Moe]);
        let err = parse(&["--parts", "attention"]).err().unwrap().to_string();
        assert!(err.contains("attention"), "{err}");
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod bench;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod checks;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod dense;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod format_run;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod moe;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod route;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod table;
// Built without a runtime too (only the runtimes' rows use it), so that its tests run in every build.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
mod timing;
