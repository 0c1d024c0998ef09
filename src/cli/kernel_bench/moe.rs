//! The MoE block's rows of `qarl bench kernels`: every path at every token count against the baseline
//! on the same FLOPs, the decode step as a rollout runs it (ids routed on the device, graphs), and the
//! fragment tiles' layouts.

use burn::tensor::{Distribution, Tensor};
use cube_kernels::{
    reference, ActDType, DeviceBuffer, FragmentCall, Kernels, MatmulPath, MoeRouting, PackedWeights,
};

use super::checks::{
    check_grouped_moe, compare_fragments, contract_mismatches, max_rounded_err, other_staging,
    random_routing, time_other_staging, values, MoeBlock,
};
use super::format_run::FormatRun;
use super::route::{route_variants, time_route};
use super::table::{row, Table};
use super::timing::{time, Timing};
use super::KernelBenchArgs;

/// The MoE block as a decode step runs it (`moe/decode-fused`, `moe/decode-split`): expert ids
/// already on the device, routed there ([`Kernels::route`]: one launch, no upload), and `path`'s
/// kernels: the grouped GEMV with the down projection and the combine as `k` says
/// ([`Kernels::with_decode_combine`]: one launch or two), or the tensor-core tiles' order
/// (`moe/decode-mma*`, on the fragment tiles where `k` says), so the row is what a rollout pays per
/// MoE layer besides the router. With `graph` (`moe/decode-graph`) those launches are recorded once
/// ([`Kernels::record`]) and each call is one replay: what the launch path costs at decode sizes.
/// With `--check`, its bits must be those of host routing on the same order (`moe/tiled`: register
/// tiles, the combine apart; or the path itself). Returns the calls' timing, or `None` for
/// a graph the runtime does not record or replay (said on stderr).
#[allow(clippy::too_many_arguments)]
pub(super) fn time_decode_block(
    args: &KernelBenchArgs,
    k: &Kernels,
    block: &MoeBlock,
    (routings, n, what): (&[Vec<u32>], usize, &str),
    [dx, drw]: [&DeviceBuffer; 2],
    (graph, path): (bool, MatmulPath),
    failures: &mut Vec<String>,
) -> anyhow::Result<Option<Timing>> {
    let experts = block.weights[0].experts();
    let [dg, du, dd] = block.device;
    let decode = |k: &Kernels, inputs: &[DeviceBuffer]| {
        let table = k.route(&inputs[1], n, args.top_k, experts)?;
        k.moe_routed(&inputs[0], &table, &inputs[2], [dg, du, dd], path)
    };
    let ids = &routings[0];
    let inputs: Vec<Vec<DeviceBuffer>> = routings
        .iter()
        .map(|r| vec![dx.clone(), k.upload_u32(r), drw.clone()])
        .collect();
    let mut recorded = Vec::new();
    if graph {
        for i in &inputs {
            match k.record(i.clone(), decode) {
                Ok(r) => recorded.push(r),
                Err(e) => {
                    eprintln!("{what}: not timed ({e})");
                    return Ok(None);
                }
            }
        }
    }
    // The calls go round the routings, one each.
    let next = std::cell::Cell::new(0usize);
    let run = || -> anyhow::Result<DeviceBuffer> {
        let i = next.get();
        next.set((i + 1) % routings.len());
        Ok(match recorded.get(i) {
            Some(r) => {
                r.replay()?;
                r.output().clone()
            }
            None => decode(k, &inputs[i])?,
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
        next.set(0);
        let differ = contract_mismatches(&k.read_f32(&run()?)?, &k.read_f32(&want)?, ActDType::F32);
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

/// Weights one round of a decode row's timed calls reads at least: 4x the L2 cache of an H200 (50 MB).
const DECODE_CYCLE_BYTES: usize = 256 << 20;

/// The routings a decode row's timed calls go round: `first`, then others drawn alike, until a round
/// reads [`DECODE_CYCLE_BYTES`] of weights (`bytes_per_call` a call; at most 64 routings). One routing
/// timed call after call reads its experts from the cache: at one token Qwen3-30B-A3B's block touches
/// 8 experts, 20 MB, which an H200's L2 holds, while the next layer of a real decode step reads others. The
/// row's bytes are the first routing's (at one token every routing touches as many experts; at more
/// tokens a round needs fewer routings, whose touched counts differ by a few experts).
fn decode_routings(
    first: &[u32],
    (n, top_k, experts): (usize, usize, usize),
    bytes_per_call: usize,
) -> Vec<Vec<u32>> {
    let count = DECODE_CYCLE_BYTES
        .div_ceil(bytes_per_call.max(1))
        .clamp(1, 64);
    std::iter::once(first.to_vec())
        .chain((1..count).map(|i| random_routing(n, top_k, experts, 9001 + 131 * i as u64)))
        .collect()
}

/// The sets of planes the fragment tiles split the block's scale groups among at `n` tokens routed
/// `top_k` ways (gate-up and down; `FragmentShape::splits_for`), printed beside the row `what`.
pub(super) fn report_splits(
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

/// The MoE block's rows of one format and activation type ([`FormatRun`]): gate-up (SwiGLU) and
/// down for every expert under random top-k routing, checked (with `--check`) and timed on every path
/// at every token count, the decode step as a rollout runs it at 64 tokens or fewer.
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
    // latter with the GEMV taking 4 assignments of a tile at once (`-p4`, the same bits), holding
    // each tile's words in registers across its passes (`-r`, the same bits), and recorded once and
    // replayed as a graph.
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
        // Each tile's words held in registers across its passes, one and several at a time.
        (
            "moe/decode-split-r".to_string(),
            split.clone().with_resident_gemv_words(Some(true)),
            false,
            gemv,
        ),
        (
            "moe/decode-split-p4-r".to_string(),
            split
                .clone()
                .with_gemv_assignments_per_pass(Some(per_pass))
                .with_resident_gemv_words(Some(true)),
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
        for (path, kernel) in tiles.iter() {
            check_grouped_moe(args, k, &block, name, dtype, (*path, kernel), failures)?;
        }
        // Against the tiles on the largest count's tokens.
        let n = args.most_tokens();
        let ids = random_routing(n, args.top_k, args.experts, 4343);
        let routing = MoeRouting::new(&ids, n, args.top_k, args.experts)?;
        let x = act_values(n * hidden, 4344);
        let rw: Vec<f32> = values(n * args.top_k, 4345)
            .iter()
            .map(|v| dtype.round(v.abs() / 4.0))
            .collect();
        for (path, kernel) in frag_tiles.iter() {
            check_grouped_moe(args, frag, &block, name, dtype, (*path, kernel), failures)?;
            let run = |k: &Kernels| -> anyhow::Result<Vec<f32>> {
                let (dx, drw) = (k.upload(&x, dtype)?, k.upload(&rw, dtype)?);
                Ok(k.read_f32(&k.moe_with(&dx, &routing, &drw, block.device, *path)?)?)
            };
            for (suffix, variant) in variants.iter() {
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
                let got = k.read_f32(&k.moe_with(&dx, &routing, &drw, [&dg, &du, &dd], path)?)?;
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
        let wgu =
            Tensor::<2>::random([hidden, 2 * inter], Distribution::Default, device).cast(base);
        let ha = Tensor::<2>::random([a, inter], Distribution::Default, device).cast(base);
        let wd = Tensor::<2>::random([inter, hidden], Distribution::Default, device).cast(base);
        let tb = time(
            args.iters,
            || {
                drop(xa.clone().matmul(wgu.clone()));
                drop(ha.clone().matmul(wd.clone()));
            },
            &sync_b,
        )
        .mean;
        // The routing table a layer builds on the device before these products (the rows
        // below take the host's, uploaded).
        for (label, kr) in route_variants(k, ids.len()) {
            if args.wants(label) {
                let what = format!("{name} {dtype} {label}");
                let (t, route_bytes) = time_route(args, &kr, (&ids, n), &what, failures)?;
                rows.push(row(
                    label,
                    name,
                    dtype,
                    n,
                    t,
                    route_bytes,
                    0.0,
                    tb,
                    copy_gbs,
                ));
            }
        }
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
            let cycle = decode_routings(&ids, (n, args.top_k, args.experts), touched * per_expert);
            for (what, kd, graph, path) in decode.iter().filter(|d| args.wants(&d.0)) {
                let call = (cycle.as_slice(), n, what.as_str());
                let inputs = [&dx, &drw];
                let how = (*graph, *path);
                let Some(t) = time_decode_block(args, kd, &block, call, inputs, how, failures)?
                else {
                    continue;
                };
                rows.push(row(what, name, dtype, n, t, bytes, flops, tb, copy_gbs));
            }
        }
        // The tiles with their other staging, as for the dense weight.
        for (path, kernel) in tiles.iter() {
            let run = |k: &Kernels| {
                let y = k.moe_with(&dx, &routing, &drw, [&dg, &du, &dd], *path);
                y.expect("moe")
            };
            let what = format!("{name} {dtype} {kernel} n={n}");
            let (other, suffix) = other_staging(*path, dtype, staged);
            let label = format!("{kernel}{suffix}");
            if !args.wants(&label) {
                continue;
            }
            let t = time_other_staging(args, [k, other], run, &sync_k, &what, failures)?;
            rows.push(row(&label, name, dtype, n, t, bytes, flops, tb, copy_gbs));
        }
        // And in their other layouts.
        for (path, kernel) in frag_tiles.iter() {
            for (suffix, kf) in variants.iter() {
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
    Ok(())
}
