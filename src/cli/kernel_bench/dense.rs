//! The dense rows of `qarl bench kernels`: one expert's gate projection on every path (GEMV, register
//! tiles, blocks, the tensor-core tiles' order and its fragment tiles) at every token count, against the
//! baseline matmul on the same FLOPs.

use burn::tensor::{Distribution, Tensor};
use cube_kernels::{reference, Kernels, MatmulPath, PackedWeights};

use super::checks::{
    check_grouped, compare_fragments, contract_mismatches, max_rounded_err, other_staging,
    time_other_staging,
};
use super::format_run::FormatRun;
use super::table::{row, Table};
use super::timing::time;

/// The dense rows of one format and activation type ([`FormatRun`]): one expert's gate projection
/// `[inter, hidden]`, the unit a decode step streams per expert, checked (with `--check`) and timed
/// on every path at every token count.
pub(super) fn bench(
    f: &FormatRun,
    rows: &mut Table,
    failures: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (args, k, device, name, dtype, format) = (f.args, f.k, f.device, f.name, f.dtype, f.format);
    let (base, copy_gbs) = (f.base, f.copy_gbs);
    let (staged, frag, variants) = (&f.staged, &f.frag, &f.variants);
    let (grouped, frag_grouped) = (&f.grouped, &f.frag_grouped);
    let (hidden, inter, size) = (args.hidden, args.inter, dtype.size());
    let sync_k = || k.sync().expect("device sync");
    let sync_b = || device.sync().expect("device sync");
    let act_values = |n: usize, seed: u64| f.act_values(n, seed);
    // Dense: one expert's gate projection [inter, hidden], the unit a decode step streams per expert.
    let w = PackedWeights::random(format, 1, inter, hidden, 1)?;
    let dw = k.upload_weights(&w);
    let wb = Tensor::<2>::random([hidden, inter], Distribution::Default, device).cast(base);
    if args.check {
        for &(path, kernel) in grouped.iter() {
            check_grouped(args, k, &w, name, dtype, (path, kernel), failures)?;
        }
        let n = args.most_tokens();
        let x = act_values(n * hidden, 4346);
        for (path, kernel) in frag_grouped.iter() {
            check_grouped(args, frag, &w, name, dtype, (*path, kernel), failures)?;
            let run = |k: &Kernels| -> anyhow::Result<Vec<f32>> {
                let dx = k.upload(&x, dtype)?;
                Ok(k.read_f32(&k.linear_with(&dx, n, &dw, *path)?)?)
            };
            for (suffix, variant) in variants.iter() {
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
                let got = k.read_f32(&k.linear_transposed(&k.upload(&g, dtype)?, n, &dw)?)?;
                let f32_run = k.read_f32(&k.linear_transposed(&k.upload_f32(&g), n, &dw)?)?;
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
        let tb = time(args.iters, || drop(xb.clone().matmul(wb.clone())), &sync_b).mean;
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
        for &(path, kernel) in grouped.iter() {
            let run = |k: &Kernels| k.linear_with(&dx, n, &dw, path).expect("linear");
            let what = format!("{name} {dtype} {kernel} n={n}");
            let (other, suffix) = other_staging(path, dtype, staged);
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
    Ok(())
}
