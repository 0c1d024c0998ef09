//! The fragment tiles with the scale groups split among the planes: the same bits, more bytes in flight
//! where a call has few cubes.
//!
//! **Why.** A decode step's cubes stream their weights one chunk at a time, each chunk a scale group's
//! worth of K at most, and at one token the Qwen3-30B-A3B block's gate-up product has 96 to 192 cubes
//! for 132 multiprocessors: by Little's law (bytes in flight = bandwidth x latency) about 0.8 MB in
//! flight holds an H200 to about a third of its copy bandwidth, whatever the cube's rows. More cubes of
//! fewer rows change nothing (the same rows, the same chunk each); what does is more of K in flight per
//! row.
//!
//! **Order.** Every scale group's sum starts at 0 and takes its own K steps ([`super`]'s order), so the
//! groups' sums may be computed anywhere, in any order: only `total += sum * scale`, groups left to
//! right, is sequential. Here the cube's 4 planes form `splits` sets of `4 / splits` planes of rows; set
//! `q` computes groups `q, q + splits, ..` of the same rows, so a round of the chunk loop streams
//! `splits` groups at once; after each round the other sets hand their sums to set 0 through shared
//! memory, which adds them in group order. A group past the last (the last round's) streams zeros and
//! is never added. Every output keeps its bits.
//!
//! **Staging.** The inputs are staged once, whole (`whole_k` of them, for at most `staged_rows` rows:
//! the launcher bounds a tile's assignments by the call's, so a one-token decode step stages 8 rows,
//! not 16; the instruction's other rows read staged rows again, their outputs never stored; a decode
//! step's few rows are in the L2 cache, as every cube of a tile reads them), so within the chunk loop
//! the registers a unit holds between a chunk's loads and its stores are all weights: the same count
//! as one set's, split among the sets (before the loop the staging's `whole_k / 128` inputs per unit
//! are held beside the first chunk's words: 16 at 2048 inputs). The launcher splits only where the
//! chunks are whole and the groups are whole chunks.

use cubecl::prelude::*;

use super::super::codes_per_word;
use super::super::mma::{MMA, MMA_PLANE, SHARED_ALIGN};
use super::fragment::zero_fragments;
use super::staging::{
    chunk_words, input_row, partials_len, staged_words_len, staged_x_stride, w_stride,
    words_per_unit,
};
use super::{add_group, multiply_chunk, row_plane, store_fragments, FragCube, UNITS};

/// [`super::grouped_fragments`] with the scale groups split among `cube.splits` sets of planes (see the
/// module's text), for the cube's assignments `a0 .. a_end` of the expert whose codes and scales start
/// at `woff` and `soff`, and its rows from `row0`. Every unit reaches every barrier: the loops' bounds
/// are the cube's.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn split_groups<I: Float, X: Float, Y: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    words_a: &[u32],
    scales_a: &[f32],
    words_b: &[u32],
    scales_b: &[f32],
    lut: &[f32],
    y: &mut [Y],
    n_out: usize,
    wpr: usize,
    spr: usize,
    xs: &mut Shared<[Vector<X, Const<2>>]>,
    wa: &mut Shared<[u32]>,
    wb: &mut Shared<[u32]>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
    woff: usize,
    soff: usize,
    a0: usize,
    a_end: usize,
    row0: usize,
    len: usize,
    groups: usize,
    steps_per_scale: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] tensor_cores: bool,
    #[comptime] cube: FragCube,
) {
    let splits = comptime!(cube.splits);
    let chunk_steps = comptime!(cube.chunk_steps);
    let set = UNIT_POS_Y as usize / comptime!(cube.row_planes());
    // Per buffer, one slab of the cube's rows per set.
    let slab = comptime!(cube.rows() * w_stride(fmt, chunk_steps));
    let wlen = comptime!(staged_words_len(fmt, cube));
    let mut partials = Shared::<[Vector<f32, Const<2>>]>::new_aligned_slice(
        comptime!(partials_len(cube, swiglu)),
        SHARED_ALIGN,
    );
    let rounds = groups.div_ceil(splits);
    let chunks = steps_per_scale / chunk_steps;
    let wpu = comptime!(words_per_unit(fmt, cube));
    let mut held_a = Array::<u32>::new(wpu);
    let mut held_b = Array::<u32>::new(comptime!(if swiglu { wpu } else { 1 }));
    if groups > 0 {
        fetch_slabs(
            words_a,
            words_b,
            &mut held_a,
            &mut held_b,
            0,
            0,
            groups,
            steps_per_scale,
            row0,
            n_out,
            wpr,
            woff,
            fmt,
            swiglu,
            cube,
        );
    }
    // The first chunk's loads are in flight while the inputs are staged; the first barrier below
    // covers both.
    stage_whole_inputs::<I, X>(input, table, rows_at, a0, len, xs, gather, cube);
    let frags = comptime!(cube.fragments(swiglu));
    let mut total = Array::<f32>::new(comptime!(4 * frags));
    #[unroll]
    for j in 0..comptime!(4 * frags) {
        total[j] = 0.0f32;
    }
    let mut buffer = 0usize;
    for r in 0..rounds {
        let mut acc = zero_fragments(comptime!(frags));
        // The set's group this round, or group 0's inputs for a group past the last (its words are
        // zeros, its sums never added).
        let g = r * splits + set;
        let first = select(g < groups, g * steps_per_scale, 0usize);
        for c in 0..chunks {
            let wbase = buffer * wlen;
            if comptime!(cube.double_buffer) {
                buffer = 1 - buffer;
            }
            store_slabs(&held_a, &held_b, wa, wb, wbase, fmt, swiglu, cube);
            sync_cube();
            let last_chunk = c + 1 == chunks;
            let next_round = select(last_chunk, r + 1, r);
            if next_round < rounds {
                fetch_slabs(
                    words_a,
                    words_b,
                    &mut held_a,
                    &mut held_b,
                    next_round,
                    select(last_chunk, 0usize, c + 1),
                    groups,
                    steps_per_scale,
                    row0,
                    n_out,
                    wpr,
                    woff,
                    fmt,
                    swiglu,
                    cube,
                );
            }
            // The inputs staged whole: the set's chunk starts at its group's step.
            multiply_chunk::<X>(
                &*xs,
                0,
                first + c * chunk_steps,
                0,
                chunk_steps,
                &*wa,
                &*wb,
                wbase + set * slab,
                lut,
                &mut acc,
                exchange,
                len,
                fmt,
                swiglu,
                tensor_cores,
                cube,
            );
            if comptime!(!cube.double_buffer) {
                sync_cube();
            }
        }
        add_round(
            &mut total,
            &acc,
            &mut partials,
            scales_a,
            scales_b,
            soff,
            row0,
            r * splits,
            groups,
            steps_per_scale,
            n_out,
            spr,
            fmt,
            group,
            swiglu,
            cube,
        );
    }
    if set == 0 {
        store_fragments(y, &total, a0, a_end, row0, n_out, swiglu, cube);
    }
}

/// The round's group sums into set 0's totals, in group order: the other sets store their accumulators
/// in `partials`, and after a barrier set 0 adds its own (group `g0`) and theirs (`g0 + q`), each where
/// the group exists. The next round's first barrier comes before any set stores again.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_round(
    total: &mut Array<f32>,
    acc: &Array<Vector<f32, Const<2>>>,
    partials: &mut Shared<[Vector<f32, Const<2>>]>,
    scales_a: &[f32],
    scales_b: &[f32],
    soff: usize,
    row0: usize,
    g0: usize,
    groups: usize,
    steps_per_scale: usize,
    n_out: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] swiglu: bool,
    #[comptime] cube: FragCube,
) {
    let regs = comptime!(2 * cube.fragments(swiglu));
    let set = UNIT_POS_Y as usize / comptime!(cube.row_planes());
    // The unit's place among the units of one set.
    let place = row_plane(cube) * MMA_PLANE + UNIT_POS_X as usize;
    let per_set = comptime!(cube.row_planes() * MMA_PLANE);
    if set > 0 {
        #[unroll]
        for j in 0..regs {
            partials[((set - 1) * per_set + place) * regs + j] = acc[j];
        }
    }
    sync_cube();
    if set == 0 {
        add_group(
            total,
            acc,
            scales_a,
            scales_b,
            soff,
            row0,
            g0 * steps_per_scale * MMA,
            n_out,
            spr,
            fmt,
            group,
            swiglu,
            cube,
        );
        #[unroll]
        for q in 1..comptime!(cube.splits) {
            if g0 + q < groups {
                let mut theirs = Array::<Vector<f32, Const<2>>>::new(regs);
                #[unroll]
                for j in 0..regs {
                    theirs[j] = partials[((q - 1) * per_set + place) * regs + j];
                }
                add_group(
                    total,
                    &theirs,
                    scales_a,
                    scales_b,
                    soff,
                    row0,
                    (g0 + q) * steps_per_scale * MMA,
                    n_out,
                    spr,
                    fmt,
                    group,
                    swiglu,
                    cube,
                );
            }
        }
    }
}

/// Loads chunk `c` of every set's group in round `round` (group `round * splits + q` for set `q`) of the
/// cube's rows into the unit's registers: zeros for a group past `groups` or a row past `n_out`. The
/// chunks are whole, so no code is past the inputs.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_slabs(
    words_a: &[u32],
    words_b: &[u32],
    held_a: &mut Array<u32>,
    held_b: &mut Array<u32>,
    round: usize,
    c: usize,
    groups: usize,
    steps_per_scale: usize,
    row0: usize,
    n_out: usize,
    wpr: usize,
    woff: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] cube: FragCube,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let cpw = comptime!(codes_per_word(fmt));
    let cw = comptime!(chunk_words(fmt, cube.chunk_steps));
    let per_slab = comptime!(cube.rows() * cw);
    #[unroll]
    for p in 0..comptime!(words_per_unit(fmt, cube)) {
        let i = unit + p * UNITS;
        let (set, row, w) = (i / per_slab, (i % per_slab) / cw, i % cw);
        let g = round * comptime!(cube.splits) + set;
        let r = row0 + row;
        let live = set < comptime!(cube.splits) && g < groups && r < n_out;
        let kw = (g * steps_per_scale + c * comptime!(cube.chunk_steps)) * MMA + w * cpw;
        let at = select(live, woff + r * wpr + kw / cpw, 0usize);
        held_a[p] = select(live, words_a[at], 0u32);
        if comptime!(swiglu) {
            held_b[p] = select(live, words_b[at], 0u32);
        }
    }
}

/// Stores the words [`fetch_slabs`] loaded into the buffers at `wbase`: set `q`'s rows in slab `q`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_slabs(
    held_a: &Array<u32>,
    held_b: &Array<u32>,
    wa: &mut Shared<[u32]>,
    wb: &mut Shared<[u32]>,
    wbase: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] cube: FragCube,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let cw = comptime!(chunk_words(fmt, cube.chunk_steps));
    let ws = comptime!(w_stride(fmt, cube.chunk_steps));
    let per_slab = comptime!(cube.rows() * cw);
    #[unroll]
    for p in 0..comptime!(words_per_unit(fmt, cube)) {
        let i = unit + p * UNITS;
        if i < comptime!(cube.splits * per_slab) {
            let (set, rest) = (i / per_slab, i % per_slab);
            let at = wbase + set * comptime!(cube.rows() * ws) + (rest / cw) * ws + rest % cw;
            wa[at] = held_a[p];
            if comptime!(swiglu) {
                wb[at] = held_b[p];
            }
        }
    }
}

/// Stages the inputs of the cube's `len` assignments (at most `staged_rows`, as the launcher bounds
/// them), all `whole_k` of them, as operand pairs rounded to `X` (the same rounding as the chunked
/// staging), and zeros for the staged rows past `len`: one live row at a time, the loads of a row all
/// issued before its stores.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_whole_inputs<I: Float, X: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    a0: usize,
    len: usize,
    xs: &mut Shared<[Vector<X, Const<2>>]>,
    #[comptime] gather: bool,
    #[comptime] cube: FragCube,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let pairs = comptime!(cube.whole_k / 2);
    let per_unit = comptime!(cube.whole_k.div_ceil(2 * UNITS));
    let stride = comptime!(staged_x_stride(cube));
    let zero = Vector::<X, Const<2>>::new(X::from_int(0));
    for a in 0..comptime!(cube.staged_rows) {
        if a < len {
            let row = input_row(table, rows_at, a0, a, len, comptime!(cube.whole_k), gather);
            let mut held = Array::<I>::new(comptime!(2 * per_unit));
            #[unroll]
            for p in 0..per_unit {
                let q = unit + p * UNITS;
                let at = select(q < pairs, row + 2 * q, 0usize);
                held[2 * p] = input[at];
                held[2 * p + 1] = input[at + 1];
            }
            #[unroll]
            for p in 0..per_unit {
                let q = unit + p * UNITS;
                if q < pairs {
                    let mut pair = Vector::<X, Const<2>>::empty();
                    pair.insert(0usize, X::cast_from(held[2 * p]));
                    pair.insert(1usize, X::cast_from(held[2 * p + 1]));
                    xs[a * stride + q] = pair;
                }
            }
        } else {
            #[unroll]
            for p in 0..per_unit {
                let q = unit + p * UNITS;
                if q < pairs {
                    xs[a * stride + q] = zero;
                }
            }
        }
    }
}
