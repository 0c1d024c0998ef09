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
    #[arg(long, default_value = "wgpu")]
    pub runtime: String,
    /// Weight formats.
    #[arg(
        long,
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
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    pub act_dtype: Vec<String>,
    /// Check each kernel against the host reference before timing.
    #[arg(long)]
    pub check: bool,
    /// Also write the rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Measure nothing: print the MoE block summary of a table written earlier with `--json` (any
    /// build, no device needed).
    #[arg(long, value_name = "JSON")]
    pub summarize: Option<PathBuf>,
    /// Time only these rows (labels as the table prints them, e.g. `moe/mma-frag,moe/mma`; a profiler
    /// then sees only their launches); empty: every row. `--check` still checks every kernel.
    #[arg(long, value_delimiter = ',', value_name = "KERNELS")]
    pub only: Vec<String>,
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
        anyhow::ensure!(
            self.top_k <= self.experts,
            "--top-k {} with --experts {}: a token routes to distinct experts, so at most {}",
            self.top_k,
            self.experts,
            self.experts
        );
        Ok(())
    }

    /// Whether the row `label` is timed (`--only`).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    fn wants(&self, label: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == label)
    }
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
        println!(
            "{} ({}), copy {:.0} GB/s:",
            doc["device"].as_str().unwrap_or("unknown device"),
            doc["runtime"].as_str().unwrap_or("?"),
            doc["copy_gb_per_s"].as_f64().unwrap_or(f64::NAN)
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
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        imp::run(args)
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
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod imp {
    use std::path::PathBuf;
    use std::time::Instant;

    use anyhow::{bail, Context};
    use burn::tensor::{DType, Device, Distribution, Tensor};
    use cube_kernels::{
        reference, ActDType, DeviceBuffer, FragmentCall, FragmentShape, Kernels, MatmulPath,
        MoeRouting, PackedWeights, WeightFormat,
    };
    use serde::Serialize;

    use super::KernelBenchArgs;
    use crate::cli::kernel_summary::print_summaries;
    use crate::io::write_json_atomic;

    #[derive(Debug, Serialize)]
    struct Row {
        kernel: String,
        format: String,
        act_dtype: String,
        tokens: usize,
        micros: f64,
        gb_per_s: f64,
        bandwidth_fraction: f64,
        tflops: f64,
        bf16_micros: f64,
        speedup_over_bf16: f64,
    }

    fn devices(runtime: &str) -> anyhow::Result<(Kernels, Device)> {
        match runtime {
            #[cfg(feature = "wgpu")]
            "wgpu" => Ok((
                Kernels::wgpu()?,
                Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            )),
            #[cfg(feature = "cuda")]
            "cuda" => Ok((Kernels::cuda(0)?, Device::cuda(0))),
            other => bail!("runtime `{other}` is not compiled in (features: wgpu, cuda)"),
        }
    }

    /// Mean seconds of `f` over `iters` runs after two warm-ups, `sync` closing each measurement.
    fn time(iters: usize, mut f: impl FnMut(), sync: &dyn Fn()) -> f64 {
        for _ in 0..2 {
            f();
        }
        sync();
        let start = Instant::now();
        for _ in 0..iters {
            f();
        }
        sync();
        start.elapsed().as_secs_f64() / iters.max(1) as f64
    }

    /// BF16 where burn's matmul supports it on this device, else F32. A runtime without bf16 buffers
    /// (wgpu) is not probed: burn's matmul would panic on its device thread, printing a backtrace.
    fn baseline_dtype(k: &Kernels, device: &Device) -> DType {
        if !k.supports(ActDType::BF16) {
            eprintln!("{} has no bf16: the baseline is f32", k.device_name());
            return DType::F32;
        }
        let probe = std::panic::catch_unwind(|| {
            let a = Tensor::<2>::ones([16, 16], device).cast(DType::BF16);
            let _ = crate::host::to_f32_vec(a.clone().matmul(a));
        });
        if probe.is_ok() {
            DType::BF16
        } else {
            eprintln!("burn's bf16 matmul is unavailable on this device: the baseline is f32");
            DType::F32
        }
    }

    fn random_routing(tokens: usize, top_k: usize, experts: usize, seed: u64) -> Vec<u32> {
        let mut state = seed | 1;
        let mut ids = Vec::with_capacity(tokens * top_k);
        for _ in 0..tokens {
            let mut chosen: Vec<u32> = Vec::with_capacity(top_k);
            while chosen.len() < top_k.min(experts) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let e = (state % experts as u64) as u32;
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            ids.extend(chosen);
        }
        ids
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// The largest `max(0, |got - want| - r(want)) / max |want|`: the error beyond rounding `want` (the
    /// f32 reference) to `dtype`, whose rounding moves a value by at most `r(w) = max(u |w|, s / 2)`, `u`
    /// the unit roundoff and `s` the spacing of the type's subnormals (f16's 2^-24 matters: an MoE output
    /// of 5e-5 is subnormal in f16, where rounding is absolute; 0 for f32).
    fn max_rounded_err(got: &[f32], want: &[f32], dtype: ActDType) -> f32 {
        let (u, half_subnormal) = match dtype {
            ActDType::F32 => (0.0, 0.0),
            ActDType::F16 => (2f32.powi(-11), 2f32.powi(-25)),
            ActDType::BF16 => (2f32.powi(-8), 2f32.powi(-134)),
        };
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        got.iter().zip(want).fold(0.0f32, |m, (g, w)| {
            let rounding = (u * w.abs()).max(half_subnormal);
            m.max(((g - w).abs() - rounding).max(0.0) / scale)
        })
    }

    /// How many values of `got` (in `dtype`) differ in bits from `f32_run` rounded to `dtype`.
    fn contract_mismatches(got: &[f32], f32_run: &[f32], dtype: ActDType) -> usize {
        got.iter()
            .zip(f32_run)
            .filter(|(g, f)| g.to_bits() != dtype.round(**f).to_bits())
            .count()
    }

    /// The activation types asked for that the device has (each missing one is reported).
    fn act_dtypes(k: &Kernels, names: &[String]) -> anyhow::Result<Vec<ActDType>> {
        let mut out = Vec::new();
        for name in names {
            let d = ActDType::parse(name)?;
            if k.supports(d) {
                out.push(d);
            } else {
                println!(
                    "{d} activations: skipped, the device `{}` reports no {d} buffers/conversions",
                    k.device_name()
                );
            }
        }
        Ok(out)
    }

    pub fn run(args: KernelBenchArgs) -> anyhow::Result<()> {
        let (k, device) = devices(&args.runtime)?;
        let sync_k = || k.sync().expect("device sync");
        let sync_b = || device.sync().expect("device sync");
        println!("device: {} ({})", k.device_name(), args.runtime);

        // Rooflines: copy bandwidth (read + write) and burn's bf16 matmul rate, measured here.
        let n_copy = args.copy_mib << 18; // f32 values
        let src = k.upload_f32(&vec![1.0f32; n_copy]);
        let t_copy = time(args.iters, || drop(k.copy(&src)), &sync_k);
        let copy_gbs = 2.0 * 4.0 * n_copy as f64 / t_copy / 1e9;
        // burn's bf16 matmul is the baseline; runtimes without bf16 (lavapipe) fall back to f32, and say so.
        let base = baseline_dtype(&k, &device);
        let m = args.matmul_size;
        let a = Tensor::<2>::random([m, m], Distribution::Default, &device).cast(base);
        let b = Tensor::<2>::random([m, m], Distribution::Default, &device).cast(base);
        let t_mm = time(args.iters, || drop(a.clone().matmul(b.clone())), &sync_b);
        let bf16_tflops = 2.0 * (m as f64).powi(3) / t_mm / 1e12;
        println!("copy bandwidth {copy_gbs:.0} GB/s; burn {base:?} matmul {m}^3 {bf16_tflops:.1} TFLOP/s");

        let dtypes = act_dtypes(&k, &args.act_dtype)?;
        let header = serde_json::json!({
            "device": k.device_name(), "runtime": args.runtime,
            "copy_gb_per_s": copy_gbs, "baseline_dtype": format!("{base:?}"), "baseline_tflops": bf16_tflops,
            "act_dtypes": dtypes.iter().map(|d| d.name()).collect::<Vec<_>>(),
        });
        let mut rows = Table::new(base, args.json.clone().map(|path| (path, header.clone())));
        let mut failures = Vec::new();
        for name in &args.formats {
            for &dtype in &dtypes {
                bench_format(
                    &args,
                    &k,
                    &device,
                    (base, copy_gbs),
                    name,
                    dtype,
                    &mut rows,
                    &mut failures,
                )?;
            }
        }
        rows.finish();
        // The rows as JSON once: the summary reads them, `--json` writes them.
        let table = serde_json::to_value(&rows.rows)?;
        print_summaries(
            &format!("{base:?}"),
            table.as_array().map_or(&[], Vec::as_slice),
        );
        if let Some(path) = &args.json {
            let mut doc = header;
            doc["rows"] = table;
            doc["check_failures"] = serde_json::json!(failures);
            doc["complete"] = serde_json::json!(true);
            write_json_atomic(path, &doc).with_context(|| format!("writing {}", path.display()))?;
        }
        if !failures.is_empty() {
            bail!("kernel check failed:\n{}", failures.join("\n"));
        }
        if args.check {
            println!("check: every kernel matched the host reference");
        }
        Ok(())
    }

    /// Checks (with `--check`) and times the dense and MoE kernels of one format with `dtype` activations.
    #[allow(clippy::too_many_arguments)]
    fn bench_format(
        args: &KernelBenchArgs,
        k: &Kernels,
        device: &Device,
        (base, copy_gbs): (DType, f64),
        name: &str,
        dtype: ActDType,
        rows: &mut Table,
        failures: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        let sync_k = || k.sync().expect("device sync");
        let sync_b = || device.sync().expect("device sync");
        // The same kernels with the tiles' other staging: one K step per pair of barriers where the
        // default stages as many as the device's shared memory holds (the scalar twins), and the most
        // where the default stages one (the tensor-core tiles).
        let staged = [
            k.clone().with_tile_stage_steps(Some(1)),
            k.clone().with_most_tile_stage_steps(),
        ];
        let (hidden, inter) = (args.hidden, args.inter);
        let size = dtype.size();
        // Inputs already in the type, so the host reference and the f32 run see what the kernel widens.
        let act_values = |n: usize, seed: u64| -> Vec<f32> {
            values(n, seed).iter().map(|v| dtype.round(*v)).collect()
        };
        {
            let format = WeightFormat::parse(name)?;
            // Dense: one expert's gate projection [inter, hidden], the unit a decode step streams per expert.
            let w = PackedWeights::random(format, 1, inter, hidden, 1)?;
            let dw = k.upload_weights(&w);
            let wb = Tensor::<2>::random([hidden, inter], Distribution::Default, device).cast(base);
            // The tensor-core tiles' order: with scalar FMAs on any device, on tensor cores where it has them.
            let mut grouped = Vec::new();
            if !format.quantizes_activations() {
                grouped.push((MatmulPath::GroupedScalar, "linear/grouped"));
                if k.supports_mma(dtype) {
                    grouped.push((MatmulPath::Mma, "linear/mma"));
                }
            }
            // The same order on the fragment tiles (`-frag`), where the device has their instruction.
            let frag = k.clone().with_fragment_tiles(true);
            // Its layouts, as the rows name them ([`fragment_variants`]).
            let variants = fragment_variants(&frag)?;
            let frag_grouped: Vec<_> = grouped
                .iter()
                .filter(|(path, _)| {
                    path.tiles(dtype)
                        .is_some_and(|(tc, _)| !tc || frag.supports_mma_fragments(dtype))
                })
                .map(|&(path, kernel)| (path, format!("{kernel}-frag")))
                .collect();
            if args.check {
                for &(path, kernel) in &grouped {
                    check_grouped(args, k, &w, name, dtype, (path, kernel), failures)?;
                }
                let n = args.tokens.iter().copied().max().unwrap_or(1).max(1);
                let x = act_values(n * hidden, 4346);
                for (path, kernel) in &frag_grouped {
                    check_grouped(args, &frag, &w, name, dtype, (*path, kernel), failures)?;
                    let run = |k: &Kernels| -> anyhow::Result<Vec<f32>> {
                        let dx = k.upload(&x, dtype)?;
                        Ok(k.read_f32(&k.linear_with(&dx, n, &dw, *path)?)?)
                    };
                    for (suffix, variant) in &variants {
                        let kernel = format!("{kernel}{suffix}");
                        let what = (name, dtype, *path, kernel.as_str(), n);
                        compare_fragments([k, variant], &run, what, failures)?;
                    }
                }
            }
            for &n in &args.tokens {
                let x = act_values(n * hidden, n as u64);
                let dx = k.upload(&x, dtype)?;
                if args.check {
                    let want = reference::linear(&x, n, &w, 0);
                    let f32_run = k.read_f32(&k.linear(&k.upload_f32(&x), n, &dw)?)?;
                    for path in [MatmulPath::Gemv, MatmulPath::Gemm, MatmulPath::Blocked] {
                        let got = k.read_f32(&k.linear_with(&dx, n, &dw, path)?)?;
                        let err = max_rounded_err(&got, &want, dtype);
                        if err > 1e-5 {
                            failures.push(format!(
                                "{name} {dtype} linear {path:?} n={n}: max rel err beyond rounding {err:.2e}"
                            ));
                        }
                        let bad = contract_mismatches(&got, &f32_run, dtype);
                        if bad > 0 {
                            failures.push(format!(
                                "{name} {dtype} linear {path:?} n={n}: {bad} values are not round(f32 result)"
                            ));
                        }
                    }
                    if n <= 16 {
                        // The straight-through backward's product, g [n, inter] -> dx [n, hidden].
                        let g = act_values(n * inter, 300 + n as u64);
                        let got =
                            k.read_f32(&k.linear_transposed(&k.upload(&g, dtype)?, n, &dw)?)?;
                        let f32_run =
                            k.read_f32(&k.linear_transposed(&k.upload_f32(&g), n, &dw)?)?;
                        let want = reference::linear_transposed(&g, n, &w, 0);
                        let err = max_rounded_err(&got, &want, dtype);
                        let bad = contract_mismatches(&got, &f32_run, dtype);
                        if err > 1e-5 || bad > 0 {
                            failures.push(format!(
                                "{name} {dtype} transposed n={n}: max rel err beyond rounding {err:.2e}, {bad} values not round(f32)"
                            ));
                        }
                    }
                }
                let xb = Tensor::<2>::random([n, hidden], Distribution::Default, device).cast(base);
                let tb = time(args.iters, || drop(xb.clone().matmul(wb.clone())), &sync_b);
                let bytes = (w.bytes() + size * n * (hidden + inter)) as f64;
                let flops = 2.0 * (n * hidden * inter) as f64;
                let mut paths = vec![
                    (MatmulPath::Gemv, "linear/gemv"),
                    (MatmulPath::Gemm, "linear/tile16"),
                    (MatmulPath::Blocked, "linear/block64"),
                ];
                paths.extend(grouped.iter().copied());
                for (path, kernel) in paths.into_iter().filter(|(_, l)| args.wants(l)) {
                    let t = time(
                        args.iters,
                        || drop(k.linear_with(&dx, n, &dw, path).expect("linear")),
                        &sync_k,
                    );
                    rows.push(row(kernel, name, dtype, n, t, bytes, flops, tb, copy_gbs));
                }
                // The tiles with their other staging (`-x1`: one K step per pair of barriers; `-staged`:
                // as many as fit) beside the default: what staging buys, and the same bits.
                for &(path, kernel) in &grouped {
                    let run = |k: &Kernels| k.linear_with(&dx, n, &dw, path).expect("linear");
                    let what = format!("{name} {dtype} {kernel} n={n}");
                    let (other, suffix) = other_staging(path, dtype, &staged);
                    let label = format!("{kernel}{suffix}");
                    if !args.wants(&label) {
                        continue;
                    }
                    let t = time_other_staging(args, [k, other], run, &sync_k, &what, failures)?;
                    rows.push(row(&label, name, dtype, n, t, bytes, flops, tb, copy_gbs));
                }
                for (path, kernel) in frag_grouped.iter().filter(|(_, l)| args.wants(l)) {
                    let t = time(
                        args.iters,
                        || drop(frag.linear_with(&dx, n, &dw, *path).expect("linear")),
                        &sync_k,
                    );
                    rows.push(row(kernel, name, dtype, n, t, bytes, flops, tb, copy_gbs));
                }
            }

            // MoE layer: gate+up (SwiGLU) and down for every expert, random top-k routing.
            let gate = PackedWeights::random(format, args.experts, inter, hidden, 2)?;
            let up = PackedWeights::random(format, args.experts, inter, hidden, 3)?;
            let down = PackedWeights::random(format, args.experts, hidden, inter, 4)?;
            let (dg, du, dd) = (
                k.upload_weights(&gate),
                k.upload_weights(&up),
                k.upload_weights(&down),
            );
            let per_expert = (gate.bytes() + up.bytes() + down.bytes()) / args.experts;
            let block = MoeBlock {
                weights: [&gate, &up, &down],
                device: [&dg, &du, &dd],
            };
            // The decode rows' kernels: the down projection and the combine fused, and apart; the
            // latter with the GEMV taking 4 assignments of a tile at once (`-p4`, the same bits), and
            // recorded once and replayed as a graph.
            let split = k.clone().with_decode_combine(Some(false));
            let per_pass = Kernels::MAX_GEMV_ASSIGNMENTS_PER_PASS;
            let gemv = MatmulPath::Gemv;
            let mut decode = vec![
                (
                    "moe/decode-fused".to_string(),
                    k.clone().with_decode_combine(Some(true)),
                    false,
                    gemv,
                ),
                ("moe/decode-split".to_string(), split.clone(), false, gemv),
                (
                    "moe/decode-split-p4".to_string(),
                    split.clone().with_gemv_assignments_per_pass(Some(per_pass)),
                    false,
                    gemv,
                ),
                ("moe/decode-graph".to_string(), split, true, gemv),
            ];
            // The tensor-core tiles' order for the grouped products, as for the dense weight above.
            let tiles: Vec<_> = grouped
                .iter()
                .map(|&(path, kernel)| (path, kernel.replace("linear/", "moe/")))
                .collect();
            // And on the fragment tiles, as for the dense weight.
            let frag_tiles: Vec<_> = frag_grouped
                .iter()
                .map(|(path, kernel)| (*path, kernel.replace("linear/", "moe/")))
                .collect();
            // The decode step in the tensor-core tiles' order where the device has the instruction (a
            // rollout in `train.tensor_cores` mode decodes on the tiles): the tiles, the fragment tiles,
            // and the fragment tiles recorded as a graph.
            if k.supports_mma(dtype) {
                let mma = MatmulPath::Mma;
                decode.push(("moe/decode-mma".to_string(), k.clone(), false, mma));
                if frag.supports_mma_fragments(dtype) {
                    decode.push(("moe/decode-mma-frag".to_string(), frag.clone(), false, mma));
                    decode.push((
                        "moe/decode-mma-frag-graph".to_string(),
                        frag.clone(),
                        true,
                        mma,
                    ));
                    // The scale groups split among up to 4 sets of planes where the cubes are few.
                    let shape = frag.fragment_shape().with_group_splits(4)?;
                    let split = frag.clone().with_fragment_shape(shape);
                    for (suffix, graph) in [("", false), ("-graph", true)] {
                        let name = format!("moe/decode-mma-frag-s4{suffix}");
                        decode.push((name, split.clone(), graph, mma));
                    }
                }
            }
            if args.check {
                for (path, kernel) in &tiles {
                    check_grouped_moe(args, k, &block, name, dtype, (*path, kernel), failures)?;
                }
                // Against the tiles on the largest count's tokens.
                let n = args.tokens.iter().copied().max().unwrap_or(1).max(1);
                let ids = random_routing(n, args.top_k, args.experts, 4343);
                let routing = MoeRouting::new(&ids, n, args.top_k, args.experts)?;
                let x = act_values(n * hidden, 4344);
                let rw: Vec<f32> = values(n * args.top_k, 4345)
                    .iter()
                    .map(|v| dtype.round(v.abs() / 4.0))
                    .collect();
                for (path, kernel) in &frag_tiles {
                    check_grouped_moe(args, &frag, &block, name, dtype, (*path, kernel), failures)?;
                    let run = |k: &Kernels| -> anyhow::Result<Vec<f32>> {
                        let (dx, drw) = (k.upload(&x, dtype)?, k.upload(&rw, dtype)?);
                        Ok(k.read_f32(&k.moe_with(&dx, &routing, &drw, block.device, *path)?)?)
                    };
                    for (suffix, variant) in &variants {
                        let kernel = format!("{kernel}{suffix}");
                        let what = (name, dtype, *path, kernel.as_str(), n);
                        compare_fragments([k, variant], &run, what, failures)?;
                    }
                }
            }
            for &n in &args.tokens {
                let ids = random_routing(n, args.top_k, args.experts, 7 + n as u64);
                let routing = MoeRouting::new(&ids, n, args.top_k, args.experts)?;
                let x = act_values(n * hidden, 100 + n as u64);
                let rw: Vec<f32> = values(n * args.top_k, 200 + n as u64)
                    .iter()
                    .map(|v| dtype.round(v.abs() / 4.0))
                    .collect();
                let (dx, drw) = (k.upload(&x, dtype)?, k.upload(&rw, dtype)?);
                let paths = [
                    (MatmulPath::Gemv, "moe/gemv"),
                    (MatmulPath::Gemm, "moe/tiled"),
                ];
                if args.check && n <= 16 {
                    let want = reference::moe(&x, &routing, &ids, &rw, &gate, &up, &down);
                    let mut first: Option<Vec<f32>> = None;
                    for (path, kernel) in paths {
                        let got =
                            k.read_f32(&k.moe_with(&dx, &routing, &drw, [&dg, &du, &dd], path)?)?;
                        let err = max_rounded_err(&got, &want, dtype);
                        if err > 2e-5 {
                            failures.push(format!(
                                "{name} {dtype} {kernel} n={n}: max rel err beyond rounding {err:.2e}"
                            ));
                        }
                        // Both paths sum in the canonical order: the same bits.
                        if let Some(prev) = &first {
                            // f32 rounds nothing: the count of values whose bits differ.
                            let differ = contract_mismatches(&got, prev, ActDType::F32);
                            if differ > 0 {
                                failures.push(format!(
                                    "{name} {dtype} moe n={n}: gemv and tiled differ in {differ} values"
                                ));
                            }
                        }
                        if dtype != ActDType::F32 {
                            let f32_run = k.read_f32(&k.moe_with(
                                &k.upload_f32(&x),
                                &routing,
                                &k.upload_f32(&rw),
                                [&dg, &du, &dd],
                                path,
                            )?)?;
                            let bad = contract_mismatches(&got, &f32_run, dtype);
                            if bad > 0 {
                                failures.push(format!(
                                    "{name} {dtype} {kernel} n={n}: {bad} values are not round(f32 result)"
                                ));
                            }
                        }
                        first.get_or_insert(got);
                    }
                }
                let touched = routing.offsets.windows(2).filter(|w| w[1] > w[0]).count();
                let bytes = (touched * per_expert + size * n * hidden * 2) as f64;
                let a = n * args.top_k;
                let flops = 2.0 * (a * hidden * inter * 3) as f64;
                // bf16 baseline: the same FLOPs as two dense matmuls over all assignments (as if one expert).
                let xa = Tensor::<2>::random([a, hidden], Distribution::Default, device).cast(base);
                let wgu = Tensor::<2>::random([hidden, 2 * inter], Distribution::Default, device)
                    .cast(base);
                let ha = Tensor::<2>::random([a, inter], Distribution::Default, device).cast(base);
                let wd =
                    Tensor::<2>::random([inter, hidden], Distribution::Default, device).cast(base);
                let tb = time(
                    args.iters,
                    || {
                        drop(xa.clone().matmul(wgu.clone()));
                        drop(ha.clone().matmul(wd.clone()));
                    },
                    &sync_b,
                );
                let timed = paths
                    .iter()
                    .map(|&(p, kernel)| (p, kernel))
                    .chain(tiles.iter().map(|(p, kernel)| (*p, kernel.as_str())));
                for (path, kernel) in timed.filter(|(_, l)| args.wants(l)) {
                    let t = time(
                        args.iters,
                        || {
                            let y = k.moe_with(&dx, &routing, &drw, [&dg, &du, &dd], path);
                            drop(y.expect("moe"))
                        },
                        &sync_k,
                    );
                    rows.push(row(kernel, name, dtype, n, t, bytes, flops, tb, copy_gbs));
                }
                if n <= Kernels::MOE_GEMV_MAX_TOKENS {
                    for (what, kd, graph, path) in decode.iter().filter(|d| args.wants(&d.0)) {
                        let call = (ids.as_slice(), n, what.as_str());
                        let inputs = [&dx, &drw];
                        let how = (*graph, *path);
                        let Some(t) =
                            time_decode_block(args, kd, &block, call, inputs, how, failures)?
                        else {
                            continue;
                        };
                        rows.push(row(what, name, dtype, n, t, bytes, flops, tb, copy_gbs));
                    }
                }
                // The tiles with their other staging, as for the dense weight.
                for (path, kernel) in &tiles {
                    let run = |k: &Kernels| {
                        let y = k.moe_with(&dx, &routing, &drw, [&dg, &du, &dd], *path);
                        y.expect("moe")
                    };
                    let what = format!("{name} {dtype} {kernel} n={n}");
                    let (other, suffix) = other_staging(*path, dtype, &staged);
                    let label = format!("{kernel}{suffix}");
                    if !args.wants(&label) {
                        continue;
                    }
                    let t = time_other_staging(args, [k, other], run, &sync_k, &what, failures)?;
                    rows.push(row(&label, name, dtype, n, t, bytes, flops, tb, copy_gbs));
                }
                // And in their other layouts.
                for (path, kernel) in &frag_tiles {
                    for (suffix, kf) in &variants {
                        let label = format!("{kernel}{suffix}");
                        if !args.wants(&label) {
                            continue;
                        }
                        let t = time(
                            args.iters,
                            || {
                                let y = kf.moe_with(&dx, &routing, &drw, [&dg, &du, &dd], *path);
                                drop(y.expect("moe"))
                            },
                            &sync_k,
                        );
                        rows.push(row(&label, name, dtype, n, t, bytes, flops, tb, copy_gbs));
                    }
                }
            }
        }
        Ok(())
    }

    /// The fragment tiles' layouts a table times and checks, by the suffix of their rows: as `frag` is,
    /// with chunks of 2 K steps (`-c2`: fewer registers, more cubes per multiprocessor), with the staging
    /// in two buffers (`-db`: one barrier per chunk), and in the other [`FragmentShape`]s with int4 codes
    /// decoded two at a time: one tile of 16 assignments per cube (`-pairs`, and `-ldm` with the A
    /// fragments read by `ldmatrix`), two tiles sharing each decoded weight with 32 rows per cube
    /// (`-m2`) or 64 (`-m2x64`), four with 32 (`-m4`, `-m4-db` with two buffers, `-m4-ldm` with
    /// `ldmatrix`).
    fn fragment_variants(frag: &Kernels) -> anyhow::Result<Vec<(&'static str, Kernels)>> {
        let mut variants = vec![
            ("", frag.clone()),
            ("-c2", frag.clone().with_fragment_chunk_steps(Some(2))),
        ];
        for (suffix, m_tiles, blocks, pairs, two, ldmatrix) in [
            ("-db", 1, 2, false, true, false),
            ("-pairs", 1, 2, true, false, false),
            ("-ldm", 1, 2, true, false, true),
            ("-m2", 2, 1, true, false, false),
            ("-m2x64", 2, 2, true, false, false),
            ("-m4", 4, 1, true, false, false),
            ("-m4-db", 4, 1, true, true, false),
            ("-m4-ldm", 4, 1, true, false, true),
        ] {
            let shape = FragmentShape::new(m_tiles, blocks, pairs)?
                .with_double_buffer(two)
                .with_ldmatrix(ldmatrix);
            variants.push((suffix, frag.clone().with_fragment_shape(shape)));
        }
        Ok(variants)
    }

    /// The fragment tiles against the tiles (`run`: the product on `n` tokens with either kernels): the
    /// scalar twins must give the same bits (a failure otherwise); on the instruction the count of values
    /// that differ is printed, 0 where NVIDIA's `m16n16k16` is two `m16n8k16` with the same arithmetic
    /// (then the two kernels are interchangeable under the contract).
    fn compare_fragments(
        [k, frag]: [&Kernels; 2],
        run: &impl Fn(&Kernels) -> anyhow::Result<Vec<f32>>,
        (name, dtype, path, kernel, n): (&str, ActDType, MatmulPath, &str, usize),
        failures: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        let (got, want) = (run(frag)?, run(k)?);
        let differ = contract_mismatches(&got, &want, ActDType::F32);
        println!(
            "{name} {dtype} {kernel}: {differ} of {} values differ from the tiles' ({n} tokens)",
            want.len()
        );
        if differ > 0 && !path.tiles(dtype).is_some_and(|(tc, _)| tc) {
            failures.push(format!(
                "{name} {dtype} {kernel}: {differ} values differ from the tiles' scalar twin ({n} tokens)"
            ));
        }
        Ok(())
    }

    /// The MoE block as a decode step runs it (`moe/decode-fused`, `moe/decode-split`): expert ids
    /// already on the device, routed there ([`Kernels::route`]: one launch, no upload), and `path`'s
    /// kernels: the grouped GEMV with the down projection and the combine as `k` says
    /// ([`Kernels::with_decode_combine`]: one launch or two), or the tensor-core tiles' order
    /// (`moe/decode-mma*`, on the fragment tiles where `k` says), so the row is what a rollout pays per
    /// MoE layer besides the router. With `graph` (`moe/decode-graph`) those launches are recorded once
    /// ([`Kernels::record`]) and each call is one replay: what the launch path costs at decode sizes.
    /// With `--check`, its bits must be those of host routing on the same order (`moe/tiled`: register
    /// tiles, the combine apart; or the path itself). Returns the mean seconds per call, or `None` for
    /// a graph the runtime does not record or replay (said on stderr).
    #[allow(clippy::too_many_arguments)]
    fn time_decode_block(
        args: &KernelBenchArgs,
        k: &Kernels,
        block: &MoeBlock,
        (ids, n, what): (&[u32], usize, &str),
        [dx, drw]: [&DeviceBuffer; 2],
        (graph, path): (bool, MatmulPath),
        failures: &mut Vec<String>,
    ) -> anyhow::Result<Option<f64>> {
        let experts = block.weights[0].experts();
        let [dg, du, dd] = block.device;
        let decode = |k: &Kernels, inputs: &[DeviceBuffer]| {
            let table = k.route(&inputs[1], n, args.top_k, experts)?;
            k.moe_routed(&inputs[0], &table, &inputs[2], [dg, du, dd], path)
        };
        let inputs = vec![dx.clone(), k.upload_u32(ids), drw.clone()];
        let recorded = if graph {
            match k.record(inputs.clone(), decode) {
                Ok(r) => Some(r),
                Err(e) => {
                    eprintln!("{what}: not timed ({e})");
                    return Ok(None);
                }
            }
        } else {
            None
        };
        let run = || -> anyhow::Result<DeviceBuffer> {
            Ok(match &recorded {
                Some(r) => {
                    r.replay()?;
                    r.output().clone()
                }
                None => decode(k, &inputs)?,
            })
        };
        if args.check {
            // Host routing on the same order: the 16-assignment register tiles for the GEMV's
            // canonical order, else the path itself.
            let routing = MoeRouting::new(ids, n, args.top_k, experts)?;
            let (want_path, want_name) = match path {
                MatmulPath::Gemv => (MatmulPath::Gemm, "moe/tiled"),
                other => (other, "host routing"),
            };
            // A layout with split scale groups against the same layout unsplit: splitting must not
            // move a bit.
            let unsplit = k
                .clone()
                .with_fragment_shape(k.fragment_shape().with_group_splits(1)?);
            let want = unsplit.moe_with(dx, &routing, drw, [dg, du, dd], want_path)?;
            if k.fragment_shape().group_splits() > 1 {
                report_splits(k, block, (n, args.top_k), path.tiles(dx.dtype()), what)?;
            }
            let differ =
                contract_mismatches(&k.read_f32(&run()?)?, &k.read_f32(&want)?, ActDType::F32);
            if differ > 0 {
                failures.push(format!(
                    "{} {what} n={n}: {differ} values differ from {want_name}",
                    dx.dtype()
                ));
            }
        }
        // One call before timing, so that a replay the runtime refuses is reported, not a panic.
        if let Err(e) = run() {
            eprintln!("{what} n={n}: not timed ({e})");
            return Ok(None);
        }
        let sync = || k.sync().expect("device sync");
        Ok(Some(time(
            args.iters,
            || drop(run().expect("moe decode")),
            &sync,
        )))
    }

    /// The sets of planes the fragment tiles split the block's scale groups among at `n` tokens routed
    /// `top_k` ways (gate-up and down; `FragmentShape::splits_for`), printed beside the row `what`.
    fn report_splits(
        k: &Kernels,
        block: &MoeBlock,
        (n, top_k): (usize, usize),
        tiles: Option<(bool, ActDType)>,
        what: &str,
    ) -> anyhow::Result<()> {
        let Some(path) = tiles else { return Ok(()) };
        let [dg, _, dd] = block.device;
        // The table's tiles bound: one per assignment at most.
        let call = FragmentCall::moe(n, top_k, dg.experts(), n * top_k);
        println!(
            "{what} n={n}: scale groups in {} sets (gate-up), {} (down)",
            k.fragment_group_splits(dg, call, path)?,
            k.fragment_group_splits(dd, call, path)?
        );
        Ok(())
    }

    /// The grouped tiles of one dense weight (`path`: [`MatmulPath::Mma`] on tensor cores, or
    /// [`MatmulPath::GroupedScalar`]): within the type's rounding plus a tensor-core accumulation tolerance
    /// of the host reference, and batch-invariant: each token count's rows are bitwise the first rows of
    /// the largest count's result on the same activations (a decode step padded to the instruction's 16
    /// rows computes what a prefill computes).
    #[allow(clippy::too_many_arguments)]
    fn check_grouped(
        args: &KernelBenchArgs,
        k: &Kernels,
        w: &PackedWeights,
        name: &str,
        dtype: ActDType,
        (path, kernel): (MatmulPath, &str),
        failures: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        let (hidden, out) = (w.in_features(), w.out_features());
        let most = args.tokens.iter().copied().max().unwrap_or(1).max(1);
        let x: Vec<f32> = values(most * hidden, 999)
            .iter()
            .map(|v| dtype.round(*v))
            .collect();
        let dw = k.upload_weights(w);
        // Tokens `first..first + n` alone.
        let run = |first: usize, n: usize| -> anyhow::Result<Vec<f32>> {
            let dx = k.upload(&x[first * hidden..(first + n) * hidden], dtype)?;
            Ok(k.read_f32(&k.linear_with(&dx, n, &dw, path)?)?)
        };
        let all = run(0, most)?;
        let want = reference::linear(&x, most, w, 0);
        // Products of half activations and exact codes summed on tensor cores, whose f32 accumulation
        // may round more coarsely than IEEE f32 (a few bits), then one rounding to the type.
        let err = max_rounded_err(&all, &want, dtype);
        if err > 1e-3 {
            failures.push(format!(
                "{name} {dtype} {kernel} n={most}: max rel err beyond rounding {err:.2e}"
            ));
        }
        // Prefixes, and single tokens at other rows of the instruction than in the full run (a decode
        // step puts a token on row 0 of its tile, a prefill on any row).
        let prefixes = args.tokens.iter().map(|&n| (0, n));
        let singles = (1..most.min(8)).chain([most - 1]).map(|t| (t, 1));
        let what = format!("{name} {dtype} {kernel}");
        check_windows(
            prefixes.chain(singles),
            (most, out),
            &all,
            run,
            &what,
            failures,
        )?;
        if let Some(widened) = widened_tiles(path, dtype) {
            let f32_run = k.read_f32(&k.linear_with(&k.upload_f32(&x), most, &dw, widened)?)?;
            let bad = contract_mismatches(&all, &f32_run, dtype);
            if bad > 0 {
                failures.push(format!(
                    "{name} {dtype} {kernel}: {bad} values of the half run are not round(the run on widened inputs)"
                ));
            }
        }
        println!("{name} {dtype} {kernel}: max rel err beyond rounding {err:.2e}, batch invariance checked");
        Ok(())
    }

    /// Each window `(first, n)` of tokens (those shorter than `most`) run alone must give the bits of the
    /// same tokens in `all`, the run on all `most` tokens (`width` values per token).
    fn check_windows(
        windows: impl Iterator<Item = (usize, usize)>,
        (most, width): (usize, usize),
        all: &[f32],
        run: impl Fn(usize, usize) -> anyhow::Result<Vec<f32>>,
        what: &str,
        failures: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        for (first, n) in windows.filter(|&(_, n)| n < most) {
            let got = run(first, n)?;
            let same = &all[first * width..(first + n) * width];
            let differ = contract_mismatches(&got, same, ActDType::F32);
            if differ > 0 {
                failures.push(format!(
                    "{what}: tokens {first}..{} alone differ from the same tokens of n={most} in {differ} values",
                    first + n
                ));
            }
        }
        Ok(())
    }

    /// What a mixed-precision training forward launches for the tiles' `path` on `dtype` activations: the
    /// same half operands, from f32 inputs holding the half values, the result in f32 (rounded to the
    /// type, the half run's bits). `None` for f32 activations or the canonical kernels.
    fn widened_tiles(path: MatmulPath, dtype: ActDType) -> Option<MatmulPath> {
        let (tensor_cores, _) = path.tiles(dtype)?;
        (dtype != ActDType::F32).then_some(MatmulPath::Tiles {
            tensor_cores,
            operand: dtype,
        })
    }

    /// An MoE block's packed weights (gate, up, down) on the host and on the device.
    struct MoeBlock<'a> {
        weights: [&'a PackedWeights; 3],
        device: [&'a cube_kernels::DeviceWeights; 3],
    }

    /// The grouped MoE block in the tensor-core tiles' order (`path`: [`MatmulPath::Mma`] or
    /// [`MatmulPath::GroupedScalar`]) on the largest token count: its first tokens within the type's
    /// rounding plus the tensor-core tolerance of the host reference (with the SwiGLU output rounded to
    /// the type, as the tiles stage it), each smaller count's tokens bitwise the first rows of the largest
    /// (the routing of a prefix is the prefix's), and the first tokens decoded one at a time bitwise
    /// theirs too: the bits do not depend on the batch.
    #[allow(clippy::too_many_arguments)]
    fn check_grouped_moe(
        args: &KernelBenchArgs,
        k: &Kernels,
        block: &MoeBlock,
        name: &str,
        dtype: ActDType,
        (path, kernel): (MatmulPath, &str),
        failures: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        let (hidden, top_k, experts) = (args.hidden, args.top_k, args.experts);
        let most = args.tokens.iter().copied().max().unwrap_or(1).max(1);
        let ids = random_routing(most, top_k, experts, 4242);
        let round = |v: Vec<f32>| -> Vec<f32> { v.iter().map(|v| dtype.round(*v)).collect() };
        let x = round(values(most * hidden, 4243));
        let rw = round(
            values(most * top_k, 4244)
                .iter()
                .map(|v| v.abs() / 4.0)
                .collect(),
        );
        // The block on tokens `first..first + n`, read back.
        let run = |first: usize, n: usize| -> anyhow::Result<Vec<f32>> {
            let ids = &ids[first * top_k..(first + n) * top_k];
            let routing = MoeRouting::new(ids, n, top_k, experts)?;
            let dx = k.upload(&x[first * hidden..(first + n) * hidden], dtype)?;
            let drw = k.upload(&rw[first * top_k..(first + n) * top_k], dtype)?;
            Ok(k.read_f32(&k.moe_with(&dx, &routing, &drw, block.device, path)?)?)
        };
        let all = run(0, most)?;
        let checked = most.min(8);
        let routing = MoeRouting::new(&ids[..checked * top_k], checked, top_k, experts)?;
        let want = reference::moe_staged(
            &x[..checked * hidden],
            &routing,
            &ids[..checked * top_k],
            &rw[..checked * top_k],
            block.weights,
            |v| dtype.round(v),
        );
        let err = max_rounded_err(&all[..checked * hidden], &want, dtype);
        if err > 1e-3 {
            failures.push(format!(
                "{name} {dtype} {kernel} n={most}: max rel err beyond rounding {err:.2e} (first {checked} tokens)"
            ));
        }
        let prefixes = args.tokens.iter().map(|&n| (0, n));
        let singles = (0..checked).map(|t| (t, 1));
        let what = format!("{name} {dtype} {kernel}");
        check_windows(
            prefixes.chain(singles),
            (most, hidden),
            &all,
            run,
            &what,
            failures,
        )?;
        if let Some(widened) = widened_tiles(path, dtype) {
            let routing = MoeRouting::new(&ids, most, top_k, experts)?;
            let y = k.moe_with(
                &k.upload_f32(&x),
                &routing,
                &k.upload_f32(&rw),
                block.device,
                widened,
            )?;
            let bad = contract_mismatches(&all, &k.read_f32(&y)?, dtype);
            if bad > 0 {
                failures.push(format!(
                    "{name} {dtype} {kernel}: {bad} values of the half run are not round(the run on widened inputs)"
                ));
            }
        }
        println!(
            "{name} {dtype} {kernel}: max rel err beyond rounding {err:.2e}, batch invariance checked (counts {:?}, tokens 0..{checked} one at a time)",
            args.tokens
        );
        Ok(())
    }

    /// The timing table, printed a row at a time as the rows are measured (so a run stopped part-way,
    /// by a time limit on a lent GPU, keeps what it measured), and kept for the JSON; with `json` (the
    /// file of `--json` and the table's header fields) the rows so far are also written there after
    /// each row, `"complete": false` until the run's end writes the whole table, so `--summarize` reads
    /// what a stopped run measured.
    struct Table {
        base: DType,
        rows: Vec<Row>,
        json: Option<(PathBuf, serde_json::Value)>,
    }

    impl Table {
        fn new(base: DType, json: Option<(PathBuf, serde_json::Value)>) -> Self {
            Table {
                base,
                rows: Vec::new(),
                json,
            }
        }

        /// Prints `r` (after the header, before the first row), keeps it, and writes the rows so far
        /// where the table has a JSON file (a file it cannot write is reported once per row, and the
        /// run goes on: the end of the run writes it again, and fails there).
        fn push(&mut self, r: Row) {
            if self.rows.is_empty() {
                println!(
                    "{:<25} {:<10} {:<5} {:>6} {:>11} {:>9} {:>8} {:>9} {:>11} {:>8}",
                    "kernel",
                    "format",
                    "act",
                    "tokens",
                    "time (us)",
                    "GB/s",
                    "% copy",
                    "TFLOP/s",
                    format!("{:?} (us)", self.base),
                    "speedup"
                );
            }
            println!(
                "{:<25} {:<10} {:<5} {:>6} {:>11.1} {:>9.1} {:>7.1}% {:>9.3} {:>11.1} {:>7.2}x",
                r.kernel,
                r.format,
                r.act_dtype,
                r.tokens,
                r.micros,
                r.gb_per_s,
                100.0 * r.bandwidth_fraction,
                r.tflops,
                r.bf16_micros,
                r.speedup_over_bf16
            );
            self.rows.push(r);
            if let Some((path, header)) = &self.json {
                let mut doc = header.clone();
                doc["rows"] = serde_json::json!(self.rows);
                doc["complete"] = serde_json::json!(false);
                if let Err(e) = write_json_atomic(path, &doc) {
                    eprintln!("writing the rows so far to {}: {e:#}", path.display());
                }
            }
        }

        /// The table's footnote.
        fn finish(&self) {
            let base = self.base;
            println!("moe {base:?} baseline: the same FLOPs as dense matmuls over all assignments (a lower bound on a {base:?} MoE)");
        }
    }

    /// The kernels with `path`'s other staging and its row suffix, of `[one step, the most]`: the
    /// tensor-core tiles stage one K step per pair of barriers by default, the scalar twins the most.
    fn other_staging(path: MatmulPath, dtype: ActDType, staged: &[Kernels; 2]) -> (&Kernels, &str) {
        let tensor_cores = path
            .tiles(dtype)
            .is_some_and(|(tensor_cores, _)| tensor_cores);
        if Kernels::stages_one_step_by_default(tensor_cores) {
            (&staged[1], "-staged")
        } else {
            (&staged[0], "-x1")
        }
    }

    /// Seconds of `run` on `other`, the kernels with the other staging (the `-x1` and `-staged` rows);
    /// with `--check`, a failure if its bits differ from `run` on `k`, the default staging.
    fn time_other_staging(
        args: &KernelBenchArgs,
        [k, other]: [&Kernels; 2],
        run: impl Fn(&Kernels) -> DeviceBuffer,
        sync: &dyn Fn(),
        what: &str,
        failures: &mut Vec<String>,
    ) -> anyhow::Result<f64> {
        if args.check {
            let (default, other_bits) = (k.read_f32(&run(k))?, k.read_f32(&run(other))?);
            // f32 rounds nothing: the count of values whose bits differ.
            let differ = contract_mismatches(&other_bits, &default, ActDType::F32);
            if differ > 0 {
                failures.push(format!(
                    "{what}: the other staging differs from the default in {differ} values"
                ));
            }
        }
        Ok(time(args.iters, || drop(run(other)), sync))
    }

    #[allow(clippy::too_many_arguments)]
    fn row(
        kernel: &str,
        format: &str,
        act_dtype: ActDType,
        tokens: usize,
        t: f64,
        bytes: f64,
        flops: f64,
        tb: f64,
        copy_gbs: f64,
    ) -> Row {
        let gbs = bytes / t / 1e9;
        Row {
            kernel: kernel.into(),
            format: format.into(),
            act_dtype: act_dtype.name().into(),
            tokens,
            micros: t * 1e6,
            gb_per_s: gbs,
            bandwidth_fraction: gbs / copy_gbs,
            tflops: flops / t / 1e12,
            bf16_micros: tb * 1e6,
            speedup_over_bf16: tb / t,
        }
    }
}
