//! `qarl bench kernels` on a CubeCL runtime: the rooflines (copy bandwidth, the baseline matmul), then
//! per weight format and activation type the dense rows ([`super::dense`]) and the MoE block's
//! ([`super::moe`]), printed as measured and kept for the JSON and the summaries.

use anyhow::{bail, Context};
use burn::tensor::{DType, Device, Distribution, Tensor};
use cube_kernels::{ActDType, Kernels, MatmulPath, WeightFormat};

use super::checks::fragment_variants;
use super::format_run::FormatRun;
use super::table::Table;
use super::timing::time;
use super::{KernelBenchArgs, TablePart};
use crate::cli::kernel_summary::print_summaries;
use crate::io::write_json_atomic;

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

/// BF16 where burn's matmul supports it on this device, else F32. A runtime without bf16 buffers
/// (wgpu) is not probed: burn's matmul would panic on its device thread, printing a backtrace.
fn baseline_dtype(k: &Kernels, device: &Device) -> DType {
    if !k.supports(ActDType::BF16) {
        eprintln!("{} has no bf16: the baseline is f32", k.device_name());
        return DType::F32;
    }
    let probe = crate::host::probe_device(device, || {
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

/// The activation types asked for that the device has (each missing one is reported).
fn act_dtypes(k: &Kernels, names: &[crate::model::Activations]) -> anyhow::Result<Vec<ActDType>> {
    let mut out = Vec::new();
    for name in names {
        let d = ActDType::parse(&name.to_string())?;
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
    let t_copy = time(args.iters, || drop(k.copy(&src)), &sync_k).mean;
    let copy_gbs = 2.0 * 4.0 * n_copy as f64 / t_copy / 1e9;
    // burn's bf16 matmul is the baseline; runtimes without bf16 (lavapipe) fall back to f32, and say so.
    let base = baseline_dtype(&k, &device);
    let m = args.matmul_size;
    let a = Tensor::<2>::random([m, m], Distribution::Default, &device).cast(base);
    let b = Tensor::<2>::random([m, m], Distribution::Default, &device).cast(base);
    let t_mm = time(args.iters, || drop(a.clone().matmul(b.clone())), &sync_b).mean;
    let bf16_tflops = 2.0 * (m as f64).powi(3) / t_mm / 1e12;
    println!(
        "copy bandwidth {copy_gbs:.0} GB/s; burn {base:?} matmul {m}^3 {bf16_tflops:.1} TFLOP/s"
    );

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
        doc["device_failure_rows"] = serde_json::json!(rows.failed_rows);
        doc["complete"] = serde_json::json!(true);
        write_json_atomic(path, &doc).with_context(|| format!("writing {}", path.display()))?;
    }
    let mut problems = Vec::new();
    if !failures.is_empty() {
        problems.push(format!("kernel check failed:\n{}", failures.join("\n")));
    }
    if !rows.failed_rows.is_empty() {
        problems.push(format!(
            "device tasks failed during these rows (left out of the summary):\n{}",
            rows.failed_rows.join("\n")
        ));
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    if args.check {
        println!("check: every kernel matched the host reference");
    }
    // A label no row had (a typo, or a row this device does not time) timed nothing: say so.
    let timed: Vec<String> = rows.rows.iter().map(|r| r.kernel.clone()).collect();
    let missing: Vec<&String> = args.only.iter().filter(|o| !timed.contains(o)).collect();
    if !missing.is_empty() {
        bail!(
            "--only {missing:?}: no row of this run has that label (the labels are the table's \
             `kernel` column, e.g. moe/mma; some rows need a device with the instruction)"
        );
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
    let format = WeightFormat::parse(name)?;
    let mut grouped = Vec::new();
    if !format.quantizes_activations() {
        grouped.push((MatmulPath::GroupedScalar, "linear/grouped"));
        if k.supports_mma(dtype) {
            grouped.push((MatmulPath::Mma, "linear/mma"));
        }
    }
    let frag = k.clone().with_fragment_tiles(true);
    let frag_grouped: Vec<_> = grouped
        .iter()
        .filter(|(path, _)| {
            path.tiles(dtype)
                .is_some_and(|(tc, _)| !tc || frag.supports_mma_fragments(dtype))
        })
        .map(|&(path, kernel)| (path, format!("{kernel}-frag")))
        .collect();
    let f = FormatRun {
        args,
        k,
        device,
        base,
        copy_gbs,
        name,
        format,
        dtype,
        staged: [
            k.clone().with_tile_stage_steps(Some(1)),
            k.clone().with_most_tile_stage_steps(),
        ],
        variants: fragment_variants(&frag)?,
        frag,
        grouped,
        frag_grouped,
    };
    if args.parts.contains(&TablePart::Dense) {
        super::dense::bench(&f, rows, failures)?;
    }
    if args.parts.contains(&TablePart::Moe) {
        super::moe::bench(&f, rows, failures)?;
    }
    Ok(())
}
