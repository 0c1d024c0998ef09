//! Routing on the device: the routing table ([`crate::moe::RoutingTable`], the layout of
//! [`crate::moe::MoeRouting::table`]) built from the router's expert ids without a read back, the same
//! table as the host's on the same ids. It is a stable counting sort of the assignments by expert:
//! count each expert's ids, turn the counts into offsets and cut each expert's run into tiles of at most
//! [`TILE`], then give each assignment its place (the `n`-th of expert `e`'s ids goes to
//! `offsets[e] + n`).
//!
//! The ids are taken in rounds of [`ROUTE_UNITS`], one per unit: a unit's rank among the round's equal
//! ids is a count over the round's ids in shared memory, and the last of an expert's ids in the round
//! adds the round's count to the expert's running count (one writer per expert: no atomics, the same
//! sums in any schedule). Small calls (a decode step) run all of it in one cube ([`route`](fn@route)); larger
//! ones split the ids into blocks of whole rounds and run three launches
//! ([`route_count_blocks`](fn@route_count_blocks): each block's count per expert;
//! [`route_offsets`](fn@route_offsets): one cube turns them into each block's first place per expert, the
//! offsets and the tiles; [`route_scatter_blocks`](fn@route_scatter_blocks): each block places its ids), so
//! the work spreads over the device's multiprocessors instead of every unit of one cube reading every id.
//!
//! The barriers sit in loops whose bounds come from the launch arguments and the cube's position: the
//! same for every unit of a cube, as the grouped GEMV's
//! ([`super::moe::grouped_gemv`](fn@super::moe::grouped_gemv)).

use cubecl::prelude::*;

use super::TILE;

/// Units of a routing cube: the ids of a round, one per unit.
pub const ROUTE_UNITS: usize = 256;

/// Blocks the three-launch routing aims for, about an H200's 132 multiprocessors:
/// [`route_offsets`](fn@route_offsets) adds each expert's block counts one after the other, so more blocks
/// lengthen its one cube's loop; fewer leave multiprocessors idle. Past [`ROUTE_BLOCK_ROUNDS`] rounds a
/// block, there are more.
pub const ROUTE_BLOCKS: usize = 128;

/// Most rounds of ids a block takes: a unit ranks its id against up to 255 others per round, and
/// Mesa's llvmpipe (lavapipe) ends a shader invocation's loops after 65535 iterations in all, so a
/// block of some 248 rounds or more came back part-routed there (2M ids in 128 blocks of 64 rounds;
/// beyond, the blocks grow in number instead).
pub const ROUTE_BLOCK_ROUNDS: usize = 64;

/// Words of shared memory a routing cube takes for `experts` experts: the offsets and the first tile
/// of each expert (one more than the experts each), and a round's ids.
pub const fn route_shared_words(experts: usize) -> usize {
    2 * (experts + 1) + ROUTE_UNITS
}

/// The whole routing in one cube (for up to a few rounds of ids: a decode step, where one launch
/// costs more than the work): the counts, the offsets and tiles (`write_offsets_and_tiles`), the
/// places, each over all `assignments` ids. `experts` at most what [`route_shared_words`] fits.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn route(
    ids: &[u32],
    table: &mut [u32],
    assignments: usize,
    top_k: usize,
    tiles: usize,
    rows_at: usize,
    positions_at: usize,
    experts_at: usize,
    offsets_at: usize,
    #[comptime] experts: usize,
) {
    let mut offsets = Shared::<[u32]>::new_slice(comptime!(experts + 1));
    let mut tile_first = Shared::<[u32]>::new_slice(comptime!(experts + 1));
    let mut round = Shared::<[u32]>::new_slice(ROUTE_UNITS);
    zero_counts(&mut offsets, experts);
    sync_cube();
    count_rounds(ids, 0, assignments, &mut round, &mut offsets, experts);
    write_offsets_and_tiles(
        &mut offsets,
        &mut tile_first,
        table,
        assignments,
        tiles,
        rows_at,
        experts_at,
        offsets_at,
        experts,
    );
    // The offsets (final for every unit: the call ends with a barrier) become each expert's next place.
    scatter_rounds(
        ids,
        0,
        assignments,
        top_k,
        &mut round,
        &mut offsets,
        table,
        rows_at,
        positions_at,
        experts_at,
        experts,
    );
}

/// First launch of the three-launch routing: cube `b` counts the ids `b * block_len..` (at most
/// `block_len`, a multiple of [`ROUTE_UNITS`]) per expert into `counts[b * experts + e]`.
#[cube(launch, create_dummy_kernel)]
pub fn route_count_blocks(
    ids: &[u32],
    counts: &mut [u32],
    assignments: usize,
    block_len: usize,
    #[comptime] experts: usize,
) {
    let mut sums = Shared::<[u32]>::new_slice(comptime!(experts + 1));
    let mut round = Shared::<[u32]>::new_slice(ROUTE_UNITS);
    let block = CUBE_POS_X as usize;
    let first = block * block_len;
    let end = (first + block_len).min(assignments);
    zero_counts(&mut sums, experts);
    sync_cube();
    count_rounds(ids, first, end, &mut round, &mut sums, experts);
    let mut e = UNIT_POS as usize;
    while e < experts {
        counts[block * experts + e] = sums[e + 1];
        e += ROUTE_UNITS;
    }
}

/// Second launch, one cube: turns the `blocks` blocks' counts into the place each block's first id of
/// expert `e` takes (`counts[b * experts + e]` becomes `offsets[e]` plus the expert's ids in blocks
/// `0..b`), and writes the offsets, the tiles and the places no valid id takes
/// (`write_offsets_and_tiles`).
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn route_offsets(
    counts: &mut [u32],
    table: &mut [u32],
    blocks: usize,
    assignments: usize,
    tiles: usize,
    rows_at: usize,
    experts_at: usize,
    offsets_at: usize,
    #[comptime] experts: usize,
) {
    let mut offsets = Shared::<[u32]>::new_slice(comptime!(experts + 1));
    let mut tile_first = Shared::<[u32]>::new_slice(comptime!(experts + 1));
    let mut e = UNIT_POS as usize;
    while e < experts {
        let mut before = 0u32;
        for b in 0..blocks {
            let n = counts[b * experts + e];
            counts[b * experts + e] = before;
            before += n;
        }
        offsets[e + 1] = before;
        e += ROUTE_UNITS;
    }
    sync_cube();
    write_offsets_and_tiles(
        &mut offsets,
        &mut tile_first,
        table,
        assignments,
        tiles,
        rows_at,
        experts_at,
        offsets_at,
        experts,
    );
    let mut e = UNIT_POS as usize;
    while e < experts {
        for b in 0..blocks {
            counts[b * experts + e] += offsets[e];
        }
        e += ROUTE_UNITS;
    }
}

/// Third launch: cube `b` places the ids of its block (as [`route_count_blocks`](fn@route_count_blocks) cut
/// them), starting each expert at `starts[b * experts + e]` ([`route_offsets`](fn@route_offsets)).
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn route_scatter_blocks(
    ids: &[u32],
    starts: &[u32],
    table: &mut [u32],
    assignments: usize,
    block_len: usize,
    top_k: usize,
    rows_at: usize,
    positions_at: usize,
    experts_at: usize,
    #[comptime] experts: usize,
) {
    let mut next = Shared::<[u32]>::new_slice(experts);
    let mut round = Shared::<[u32]>::new_slice(ROUTE_UNITS);
    let block = CUBE_POS_X as usize;
    let first = block * block_len;
    let end = (first + block_len).min(assignments);
    let mut e = UNIT_POS as usize;
    while e < experts {
        next[e] = starts[block * experts + e];
        e += ROUTE_UNITS;
    }
    sync_cube();
    scatter_rounds(
        ids,
        first,
        end,
        top_k,
        &mut round,
        &mut next,
        table,
        rows_at,
        positions_at,
        experts_at,
        experts,
    );
}

/// `counts[0..=experts] = 0`, the units taking every [`ROUTE_UNITS`]-th.
#[cube]
fn zero_counts(counts: &mut Shared<[u32]>, #[comptime] experts: usize) {
    let mut e = UNIT_POS as usize;
    while e <= experts {
        counts[e] = 0u32;
        e += ROUTE_UNITS;
    }
}

/// Stages the round of ids from `start` (up to `end`) in `round`, one per unit, and returns this
/// unit's id (0 past the end: the callers look at units below the round's length only).
#[cube]
fn stage_round(ids: &[u32], start: usize, end: usize, round: &mut Shared<[u32]>) -> u32 {
    let i = start + UNIT_POS as usize;
    let mut id = 0u32;
    if i < end {
        id = ids[i];
    }
    round[UNIT_POS as usize] = id;
    id
}

/// This unit's rank among the ids equal to `id` in the round's first `len` (how many come before it),
/// and whether none comes after it.
#[cube]
fn rank_in_round(round: &Shared<[u32]>, len: usize, id: u32) -> (u32, bool) {
    let unit = UNIT_POS as usize;
    let mut before = 0u32;
    for j in 0..unit {
        before += select(round[j] == id, 1u32, 0u32);
    }
    let mut after = 0u32;
    for j in unit + 1..len {
        after += select(round[j] == id, 1u32, 0u32);
    }
    (before, after == 0u32)
}

/// Adds the ids `first..end` of each expert to `counts[e + 1]` (out-of-range ids count nowhere), in
/// rounds; every unit leaves after the last round's barrier.
#[cube]
fn count_rounds(
    ids: &[u32],
    first: usize,
    end: usize,
    round: &mut Shared<[u32]>,
    counts: &mut Shared<[u32]>,
    #[comptime] experts: usize,
) {
    let mut start = first;
    while start < end {
        let len = (end - start).min(ROUTE_UNITS);
        let id = stage_round(ids, start, end, round);
        sync_cube();
        if (UNIT_POS as usize) < len && (id as usize) < experts {
            let (before, last) = rank_in_round(&*round, len, id);
            if last {
                counts[id as usize + 1] += before + 1u32;
            }
        }
        sync_cube();
        start += ROUTE_UNITS;
    }
}

/// Places the ids `first..end` (`top_k` per token): the id `i` of expert `e` goes to `next[e]` plus
/// its rank in its round (`rows[pos]` = its token, `positions[i] = pos`, `experts[pos] = e`), and
/// `next[e]` moves past the round's ids of `e`; an out-of-range id gets position 0 (its slot's output
/// is undefined, its reads in bounds).
#[cube]
#[allow(clippy::too_many_arguments)]
fn scatter_rounds(
    ids: &[u32],
    first: usize,
    end: usize,
    top_k: usize,
    round: &mut Shared<[u32]>,
    next: &mut Shared<[u32]>,
    table: &mut [u32],
    rows_at: usize,
    positions_at: usize,
    experts_at: usize,
    #[comptime] experts: usize,
) {
    let unit = UNIT_POS as usize;
    let mut start = first;
    while start < end {
        let len = (end - start).min(ROUTE_UNITS);
        let id = stage_round(ids, start, end, round);
        sync_cube();
        let i = start + unit;
        let mut added = 0u32;
        if unit < len {
            if (id as usize) < experts {
                let (before, last) = rank_in_round(&*round, len, id);
                let pos = (next[id as usize] + before) as usize;
                table[rows_at + pos] = (i / top_k) as u32;
                table[positions_at + i] = pos as u32;
                table[experts_at + pos] = id;
                if last {
                    added = before + 1u32;
                }
            } else {
                table[positions_at + i] = 0u32;
            }
        }
        // Every unit has read `next` and the round before the last ids move `next` on and the next
        // round is staged.
        sync_cube();
        if added > 0u32 {
            next[id as usize] += added;
        }
        start += ROUTE_UNITS;
    }
}

/// With `offsets[e + 1]` holding expert `e`'s count: makes `offsets` the prefix sums (`offsets[0] =
/// 0`) and `tile_first` the first tile of each expert, then writes the offsets to the table, every
/// tile up to the bound `tiles` (`(expert, first, one past the last)` at `3 * tile`, experts in order,
/// at most 16 assignments; `(0, 0, 0)` past the last real one) and the sorted places no valid id takes
/// (`offsets[experts]..assignments`: token 0 of expert 0, so that every read of the grouped kernels
/// stays in bounds). Ends with a barrier: `offsets` is final for every unit.
#[cube]
// `div_ceil` has no CubeCL expansion for runtime values.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn write_offsets_and_tiles(
    offsets: &mut Shared<[u32]>,
    tile_first: &mut Shared<[u32]>,
    table: &mut [u32],
    assignments: usize,
    tiles: usize,
    rows_at: usize,
    experts_at: usize,
    offsets_at: usize,
    #[comptime] experts: usize,
) {
    let unit = UNIT_POS as usize;
    if unit == 0 {
        // The counts are read ahead of the running sums, so the loads do not wait on each other.
        let mut total = 0u32;
        let mut total_tiles = 0u32;
        offsets[0] = 0u32;
        tile_first[0] = 0u32;
        for e in 0..experts {
            let n = offsets[e + 1];
            total += n;
            total_tiles += (n + TILE as u32 - 1u32) / TILE as u32;
            offsets[e + 1] = total;
            tile_first[e + 1] = total_tiles;
        }
    }
    sync_cube();
    let mut e = unit;
    while e <= experts {
        table[offsets_at + e] = offsets[e];
        e += ROUTE_UNITS;
    }
    let real = tile_first[experts] as usize;
    let mut t = unit;
    while t < tiles {
        let mut expert = 0u32;
        let mut start = 0u32;
        let mut stop = 0u32;
        if t < real {
            let e = expert_of_tile(&*tile_first, t as u32, experts);
            expert = e as u32;
            start = offsets[e] + TILE as u32 * (t as u32 - tile_first[e]);
            stop = (start + TILE as u32).min(offsets[e + 1]);
        }
        table[3 * t] = expert;
        table[3 * t + 1] = start;
        table[3 * t + 2] = stop;
        t += ROUTE_UNITS;
    }
    let mut p = offsets[experts] as usize + unit;
    while p < assignments {
        table[rows_at + p] = 0u32;
        table[experts_at + p] = 0u32;
        p += ROUTE_UNITS;
    }
    sync_cube();
}

/// The expert whose tiles include tile `t` (`t` below the last expert's end): the last `e` with
/// `tile_first[e] <= t`, by bisection (`tile_first` never decreases; experts without tiles share their
/// first tile with the next one, and the last of those is the one that has it).
#[cube]
// `div_ceil` has no CubeCL expansion for runtime values.
#[allow(clippy::manual_div_ceil)]
fn expert_of_tile(tile_first: &Shared<[u32]>, t: u32, #[comptime] experts: usize) -> usize {
    // At least one expert: the launcher refuses none.
    let mut lo = 0usize;
    let mut hi = 0usize;
    hi += experts - 1;
    while lo < hi {
        let mid = (lo + hi + 1) / 2;
        if tile_first[mid] <= t {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}
