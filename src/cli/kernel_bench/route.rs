//! The MoE block's routing rows of `qarl bench kernels` (`moe/route`): the routing table built on the
//! device from the router's expert ids ([`Kernels::route`]), as a rollout and the training forward
//! build it for every MoE layer before the block's products. The block's own rows take a table the
//! host built and uploaded, so these rows are the part of a layer's time those rows leave out.

use cube_kernels::{Kernels, MoeRouting};

use super::KernelBenchArgs;

/// Most ids the one-cube routing is timed on beside the blocks (`moe/route-1cube`): 64 rounds. Past
/// that the launch rule's blocks are the only sensible launch, and Mesa's llvmpipe (lavapipe) ends
/// a shader invocation's loops after 65535 iterations in all, which one cube's ranking of more ids
/// exceeds.
const ONE_CUBE_TIMED_MAX: usize = 64 * cube_kernels::kernels::route::ROUTE_UNITS;

/// The routing rows for `assignments` ids: the launch rule's (`moe/route`), and beside it the other
/// launch (`moe/route-blocks` where the rule takes one cube, `moe/route-1cube` where it takes the
/// blocks, up to [`ONE_CUBE_TIMED_MAX`] ids), so the table shows what the rule's threshold buys.
pub(super) fn route_variants(k: &Kernels, assignments: usize) -> Vec<(&'static str, Kernels)> {
    let mut rows = vec![("moe/route", k.clone())];
    if !k.routes_in_blocks(assignments) {
        rows.push(("moe/route-blocks", k.clone().with_block_routing(Some(true))));
    } else if assignments <= ONE_CUBE_TIMED_MAX {
        rows.push(("moe/route-1cube", k.clone().with_block_routing(Some(false))));
    }
    rows
}

/// Mean seconds per call of [`Kernels::route`] on `ids` (`n` tokens routed `args.top_k` ways over
/// `args.experts` experts) as `k` launches it, and the bytes it moves (the ids read, the table
/// written). With `--check`, the table must be the host's ([`MoeRouting::new`] on the same ids;
/// the tiles past the host's last are empty): a mismatch is pushed to `failures` as `what` says.
pub(super) fn time_route(
    args: &KernelBenchArgs,
    k: &Kernels,
    (ids, n): (&[u32], usize),
    what: &str,
    failures: &mut Vec<String>,
) -> anyhow::Result<(super::timing::Timing, f64)> {
    let (top_k, experts) = (args.top_k, args.experts);
    let device_ids = k.upload_u32(ids);
    let route = || k.route(&device_ids, n, top_k, experts);
    let table = route()?;
    if args.check {
        let host = MoeRouting::new(ids, n, top_k, experts)?;
        if let Some(problem) = table_mismatch(&k.read_u32(table.buffer())?, &table, &host) {
            failures.push(format!("{what} n={n}: {problem}"));
        }
    }
    let bytes = 4.0 * (ids.len() + table.layout().len(experts)) as f64;
    let sync = || k.sync().expect("device sync");
    let t = super::timing::time(
        args.iters,
        || drop(route().expect("routing on the device")),
        &sync,
    );
    Ok((t, bytes))
}

/// Where a device-built table (`got`, read from `table`) differs from the host's routing of the same
/// ids: the same tiles, then empty tiles up to the device's bound, then the same rows, positions,
/// sorted experts and offsets; `None` when it does not.
fn table_mismatch(
    got: &[u32],
    table: &cube_kernels::RoutingTable,
    host: &MoeRouting,
) -> Option<String> {
    let want = host.table();
    let (l, hl) = (table.layout(), host.layout());
    if got.len() != l.len(host.experts()) || l.tiles < hl.tiles {
        return Some(format!(
            "a table of {} values and {} tiles, for {} tiles",
            got.len(),
            l.tiles,
            hl.tiles
        ));
    }
    let first_differing = |a: &[u32], b: &[u32]| a.iter().zip(b).position(|(x, y)| x != y);
    if let Some(i) = first_differing(&got[..hl.rows_at()], &want[..hl.rows_at()]) {
        return Some(format!("tile value {i} differs from the host's"));
    }
    if let Some(i) = got[hl.rows_at()..l.rows_at()].iter().position(|&v| v != 0) {
        return Some(format!(
            "tile value {} past the last tile is not 0",
            hl.rows_at() + i
        ));
    }
    first_differing(&got[l.rows_at()..], &want[hl.rows_at()..])
        .map(|i| format!("rows/positions/experts/offsets value {i} differs from the host's"))
}
