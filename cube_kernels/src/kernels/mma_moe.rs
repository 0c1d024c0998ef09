//! Tensor-core tiles (`cmma`) for the grouped MoE products: [`super::mma`]'s order on the routing table's
//! tiles of 16 assignments ([`super::moe`]), which are exactly the instruction's 16 rows.
//!
//! **Order.** Per assignment and output row, the expert's K axis is cut into steps of 16 inputs and scale
//! groups as in [`super::mma`]: per group an f32 accumulator takes the group's steps in order on tensor
//! cores (the half operands times the weights' exact codes), then the group's sum times the f32 scale is
//! added to the f32 total, groups left to right. Gate and up keep one accumulator each and end in
//! `silu(gate) * up` ([`super::moe::silu_times`](fn@super::moe::silu_times)), in f32. An assignment's row of
//! the instruction never mixes with the other rows, and rows past the tile's last assignment are zeros, so an
//! assignment gets the same bits whichever tile it shares, with how many tokens: a decode step computes a
//! prefill's bits.
//!
//! **Operands.** The instruction multiplies two operands of the operand type `X` (the activations' half
//! type): the gate/up input is the activations, rounded to `X` as they are staged (exact for half values,
//! widened to f32 or not); the down projection's input, the SwiGLU output `h` (an f32 buffer), is
//! rounded to `X` as it is staged. That rounding is this path's own (the scalar-order kernels keep `h` in
//! f32), so rollout and training must both take these tiles for their bits to agree.
//!
//! **Tile.** A cube of 4 planes (32 units each) computes the tile's 16 assignments x 64 rows: plane `p`
//! holds the 16 x 16 accumulators of row tile `p` (two with SwiGLU). Per step the cube stages 16 x 16
//! inputs and 64 x 16 codes per projection in shared memory, `stage_steps` steps per pair of barriers
//! as in [`super::mma`] (the bits do not depend on it), loaded a chunk ahead into registers, the
//! weights as whole words ([`super::mma`]'s staging); each unit's assignment rows come from the routing
//! table once per tile; per scale group the accumulators go through shared memory to the units, which
//! scale and add them.
//!
//! [`grouped_tiles`](fn@grouped_tiles) without `tensor_cores` is the same tiling, staging and scale groups
//! with scalar FMAs in place of the instruction (any runtime): `cube_kernels/tests/kernels.rs` checks it on
//! lavapipe against the host reference and against one-token-at-a-time runs, which leaves only the
//! instruction to the GPU check.

use cubecl::prelude::*;

use super::mma::{
    add_scaled_group, fetch_word, next_chunk, store_word, tile_element, word_passes, MMA,
    MMA_PLANE, SHARED_ALIGN, STAGED_ROWS,
};
use super::moe::silu_times;

/// Row tiles (planes) of a cube: 64 output rows.
pub const MOE_MMA_ROW_TILES: usize = 4;

/// Values of one 16 x 16 operand or accumulator tile.
const TILE_VALUES: usize = MMA * MMA;

/// Weight codes of one staged step per projection: 64 rows x 16.
const W_STEP: usize = MOE_MMA_ROW_TILES * TILE_VALUES;
const _: () = assert!(MOE_MMA_ROW_TILES * MMA == STAGED_ROWS);

/// Shared memory [`grouped_tiles`](fn@grouped_tiles) allocates with `stage_steps` staged steps of
/// `operand_bytes`-byte operands, two projections with `swiglu` (and, on tensor cores, the f32 accumulators'
/// way to the units), alignment padding included.
pub fn grouped_tiles_shared_bytes(
    stage_steps: usize,
    operand_bytes: usize,
    swiglu: bool,
    tensor_cores: bool,
) -> usize {
    let sets = if swiglu { 2 } else { 1 };
    let stored = if tensor_cores { sets * W_STEP * 4 } else { 0 };
    // `wb` holds one value without SwiGLU.
    let wb = if swiglu { stage_steps * W_STEP } else { 1 };
    (stage_steps * (TILE_VALUES + W_STEP) + wb) * operand_bytes + stored + 4 * SHARED_ALIGN
}

/// Units of a cube.
const UNITS: usize = MOE_MMA_ROW_TILES * MMA_PLANE;

/// Assignments of the tile whose inputs a unit stages at every step: 2, rows `unit / 16` and
/// `unit / 16 + 8`, at input `unit % 16` of the step.
const ROWS_PER_UNIT: usize = MMA * MMA / UNITS;

/// Where the inputs of the unit's [`ROWS_PER_UNIT`] assignments start in `input` (with `gather` row
/// `table[rows_at + a]`, else row `a`; 0 for a row past the tile's `len` assignments): read from the
/// routing table once per tile instead of at every step, where each lookup's latency came before the
/// input's load.
#[cube]
#[allow(clippy::too_many_arguments)]
fn input_rows(
    table: &[u32],
    rows_at: usize,
    a0: usize,
    len: usize,
    inn: usize,
    #[comptime] gather: bool,
) -> Array<usize> {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let mut rows = Array::<usize>::new(ROWS_PER_UNIT);
    #[unroll]
    for h in 0..ROWS_PER_UNIT {
        let r = unit / MMA + h * (UNITS / MMA);
        rows[h] = 0;
        if r < len {
            let mut src = a0 + r;
            if comptime!(gather) {
                src = table[rows_at + a0 + r] as usize;
            }
            rows[h] = src * inn;
        }
    }
    rows
}

/// Loads K steps `s0..last` (at most `stage_steps` of them) of the cube's tile into the unit's registers,
/// step `d` at `d * passes..` of `held_a` / `held_b` and `d * ROWS_PER_UNIT..` of `held_x`: the packed words
/// of `a` (and `b` with `swiglu`) of the expert at words `woff` ([`fetch_word`]) and the inputs of the
/// unit's assignments ([`input_rows`]). No branch separates a step's loads, and [`grouped_tiles`] issues them a
/// chunk ahead (while the tensor cores work on the previous one), so their latencies overlap each other
/// and the arithmetic.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_moe_steps<I: Float>(
    input: &[I],
    rows: &Array<usize>,
    len: usize,
    words_a: &[u32],
    words_b: &[u32],
    held_a: &mut Array<u32>,
    held_b: &mut Array<u32>,
    held_x: &mut Array<I>,
    s0: usize,
    last: usize,
    row0: usize,
    n_out: usize,
    inn: usize,
    wpr: usize,
    woff: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] stage_steps: usize,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let passes = comptime!(word_passes(fmt, UNITS));
    #[unroll]
    for d in 0..stage_steps {
        if s0 + d < last {
            let k0 = (s0 + d) * MMA;
            #[unroll]
            for p in 0..passes {
                let wl = unit + p * UNITS;
                held_a[d * passes + p] =
                    fetch_word(words_a, woff, row0, k0, n_out, inn, wpr, wl, fmt);
                if comptime!(swiglu) {
                    held_b[d * passes + p] =
                        fetch_word(words_b, woff, row0, k0, n_out, inn, wpr, wl, fmt);
                }
            }
            let k = k0 + unit % MMA;
            #[unroll]
            for h in 0..ROWS_PER_UNIT {
                let live = unit / MMA + h * (UNITS / MMA) < len && k < inn;
                held_x[d * ROWS_PER_UNIT + h] = input[select(live, rows[h] + k, 0usize)];
            }
        }
    }
}

/// Stores the steps `s0..last` that [`fetch_moe_steps`] loaded into shared memory slots 0, 1, ... (of the
/// kernel's `stage_steps`), in `X`: the inputs (`xs[assignment][k]`, rounded to `X`; zeros past the tile's
/// `len` assignments or the inputs) and the 64 rows x 16 codes of `a` (and `b`) (`ws[row][k]`,
/// [`store_word`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_moe_steps<I: Float, X: Float>(
    held_a: &Array<u32>,
    held_b: &Array<u32>,
    held_x: &Array<I>,
    lut: &[f32],
    xs: &mut Shared<[X]>,
    wa: &mut Shared<[X]>,
    wb: &mut Shared<[X]>,
    s0: usize,
    last: usize,
    len: usize,
    inn: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] stage_steps: usize,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let passes = comptime!(word_passes(fmt, UNITS));
    #[unroll]
    for d in 0..stage_steps {
        if s0 + d < last {
            let (xs0, ws0) = (d * TILE_VALUES, d * W_STEP);
            let k = (s0 + d) * MMA + unit % MMA;
            #[unroll]
            for h in 0..ROWS_PER_UNIT {
                let live = unit / MMA + h * (UNITS / MMA) < len && k < inn;
                let v = X::cast_from(held_x[d * ROWS_PER_UNIT + h]);
                xs[xs0 + unit + h * UNITS] = select(live, v, X::from_int(0));
            }
            #[unroll]
            for p in 0..passes {
                let wl = unit + p * UNITS;
                store_word(held_a[d * passes + p], lut, wa, ws0, wl, fmt);
                if comptime!(swiglu) {
                    store_word(held_b[d * passes + p], lut, wb, ws0, wl, fmt);
                }
            }
        }
    }
}

/// One chunk's turn in [`grouped_tiles`]' K loop: stores the chunk at `s0` that the registers hold
/// ([`store_moe_steps`]), waits for the cube, and loads the next chunk ([`next_chunk`]) into the registers
/// ([`fetch_moe_steps`]), so its loads fly while the caller multiplies the chunk just staged.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_chunk<I: Float, X: Float>(
    input: &[I],
    rows: &Array<usize>,
    len: usize,
    words_a: &[u32],
    words_b: &[u32],
    lut: &[f32],
    held_a: &mut Array<u32>,
    held_b: &mut Array<u32>,
    held_x: &mut Array<I>,
    xs: &mut Shared<[X]>,
    wa: &mut Shared<[X]>,
    wb: &mut Shared<[X]>,
    s0: usize,
    last: usize,
    steps: usize,
    steps_per_scale: usize,
    row0: usize,
    n_out: usize,
    inn: usize,
    wpr: usize,
    woff: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] stage_steps: usize,
) {
    store_moe_steps(
        &*held_a,
        &*held_b,
        &*held_x,
        lut,
        xs,
        wa,
        wb,
        s0,
        last,
        len,
        inn,
        fmt,
        swiglu,
        stage_steps,
    );
    sync_cube();
    let (n0, n_last) = next_chunk(s0, last, steps, steps_per_scale, stage_steps);
    fetch_moe_steps(
        input,
        rows,
        len,
        words_a,
        words_b,
        held_a,
        held_b,
        held_x,
        n0,
        n_last,
        row0,
        n_out,
        inn,
        wpr,
        woff,
        fmt,
        swiglu,
        stage_steps,
    );
}

/// [`add_scaled_group`] for projection `a`'s sums, and with `swiglu` for `b`'s (the up projection).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_scaled_groups(
    total_a: &mut Array<f32>,
    total_b: &mut Array<f32>,
    sums_a: &Array<f32>,
    sums_b: &Array<f32>,
    scales_a: &[f32],
    scales_b: &[f32],
    soff: usize,
    row0: usize,
    k: usize,
    n_out: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] swiglu: bool,
) {
    // The plane's rows: row tile `plane` of the cube's 64.
    let row_base = row0 + UNIT_POS_Y as usize * MMA;
    add_scaled_group(
        total_a, sums_a, scales_a, soff, row_base, k, n_out, spr, fmt, group,
    );
    if comptime!(swiglu) {
        add_scaled_group(
            total_b, sums_b, scales_b, soff, row_base, k, n_out, spr, fmt, group,
        );
    }
}

/// Stores the unit's 8 outputs into `y [assignments, n_out]` (f32): the totals, or `silu(a) * b`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_assignments(
    y: &mut [f32],
    total_a: &Array<f32>,
    total_b: &Array<f32>,
    a0: usize,
    a_end: usize,
    row0: usize,
    n_out: usize,
    #[comptime] swiglu: bool,
) {
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    #[unroll]
    for j in 0..8usize {
        let e = tile_element(lane, j);
        let a = a0 + e / MMA;
        let r = row0 + plane * MMA + e % MMA;
        if a < a_end && r < n_out {
            let mut v = total_a[j];
            if comptime!(swiglu) {
                v = silu_times(total_a[j], total_b[j]);
            }
            y[a * n_out + r] = v;
        }
    }
}

/// `y[a, row] = sum_k input[src(a), k] a_e[row, k]` (or `silu(.) * (. b_e)` with `swiglu`) for the
/// assignments of tile `CUBE_POS_Y` in the order of the module doc: on tensor cores when `tensor_cores`,
/// else with scalar fused multiply-adds in place of the instruction (each group's sum over its inputs in
/// order from 0; any runtime and operand type, f32 included; the same tiling, staging and scale groups,
/// other bits than the instruction's, batch-invariant in the same way). Arguments as
/// [`super::moe::grouped_matmul`](fn@crate::kernels::moe::grouped_matmul)'s, with `steps = ceil(inn / 16)`
/// and the scale group in steps. `I` is the input buffer's type, `X` the operands' (half for the
/// instruction). Launch with `CubeDim (32, 4)` and `CubeCount (ceil(n_out / 64), tiles)`.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_tiles<I: Float, X: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    words_a: &[u32],
    scales_a: &[f32],
    words_b: &[u32],
    scales_b: &[f32],
    lut: &[f32],
    y: &mut [f32],
    n_out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    expert_words: usize,
    expert_scales: usize,
    steps: usize,
    steps_per_scale: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] tensor_cores: bool,
    #[comptime] stage_steps: usize,
    #[define(I, X)] _dtypes: [ElemType; 2],
) {
    let sets = comptime!(if swiglu { 2usize } else { 1usize });
    let mut xs =
        Shared::<[X]>::new_aligned_slice(comptime!(stage_steps * TILE_VALUES), SHARED_ALIGN);
    let mut wa = Shared::<[X]>::new_aligned_slice(comptime!(stage_steps * W_STEP), SHARED_ALIGN);
    let mut wb = Shared::<[X]>::new_aligned_slice(
        comptime!(if swiglu { stage_steps * W_STEP } else { 1 }),
        SHARED_ALIGN,
    );
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    // The tile's expert and assignments; an empty tile (the device routing's trailing ones) runs no
    // group and stores nothing.
    let tile = CUBE_POS_Y as usize;
    let expert = table[3 * tile] as usize;
    let a0 = table[3 * tile + 1] as usize;
    let a_end = table[3 * tile + 2] as usize;
    let mut groups = 0usize;
    if a0 < a_end {
        groups = steps.div_ceil(steps_per_scale);
    }
    let row0 = CUBE_POS_X as usize * (MOE_MMA_ROW_TILES * MMA);
    let (woff, soff) = (expert * expert_words, expert * expert_scales);
    // Assignments of the tile; 0 for a malformed one (start past end), which then reads no row.
    let mut len = 0usize;
    if a0 < a_end {
        len = a_end - a0;
    }
    let rows = input_rows(table, rows_at, a0, len, inn, gather);
    // The registers a chunk of steps is loaded into a chunk ahead ([`fetch_moe_steps`]); the first
    // chunk's loads go out here.
    let passes = comptime!(word_passes(fmt, UNITS));
    let mut held_a = Array::<u32>::new(comptime!(stage_steps * passes));
    let mut held_b = Array::<u32>::new(comptime!(if swiglu { stage_steps * passes } else { 1 }));
    let mut held_x = Array::<I>::new(comptime!(stage_steps * ROWS_PER_UNIT));
    if groups > 0 {
        fetch_moe_steps(
            input,
            &rows,
            len,
            words_a,
            words_b,
            &mut held_a,
            &mut held_b,
            &mut held_x,
            0,
            steps_per_scale.min(steps),
            row0,
            n_out,
            inn,
            wpr,
            woff,
            fmt,
            swiglu,
            stage_steps,
        );
    }
    let mut total_a = Array::<f32>::new(8usize);
    let mut total_b = Array::<f32>::new(8usize);
    let mut sums_a = Array::<f32>::new(8usize);
    let mut sums_b = Array::<f32>::new(8usize);
    #[unroll]
    for j in 0..8usize {
        total_a[j] = 0.0f32;
        total_b[j] = 0.0f32;
    }
    if comptime!(tensor_cores) {
        let mut stored = Shared::<[f32]>::new_aligned_slice(
            comptime!(sets * MOE_MMA_ROW_TILES * TILE_VALUES),
            SHARED_ALIGN,
        );
        let mut acc_a = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            MMA,
            MMA,
            MMA,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        );
        let mut acc_b = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            MMA,
            MMA,
            MMA,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        );
        let mine = plane * TILE_VALUES;
        for g in 0..groups {
            cmma::fill(&mut acc_a, 0.0f32);
            if comptime!(swiglu) {
                cmma::fill(&mut acc_b, 0.0f32);
            }
            let first = g * steps_per_scale;
            let last = (first + steps_per_scale).min(steps);
            for c in 0..(last - first).div_ceil(stage_steps) {
                let s0 = first + c * stage_steps;
                stage_chunk(
                    input,
                    &rows,
                    len,
                    words_a,
                    words_b,
                    lut,
                    &mut held_a,
                    &mut held_b,
                    &mut held_x,
                    &mut xs,
                    &mut wa,
                    &mut wb,
                    s0,
                    last,
                    steps,
                    steps_per_scale,
                    row0,
                    n_out,
                    inn,
                    wpr,
                    woff,
                    fmt,
                    swiglu,
                    stage_steps,
                );
                for d in 0..stage_steps {
                    if s0 + d < last {
                        let (xa, wr) = (d * TILE_VALUES, d * W_STEP + mine);
                        let x_tile = cmma::Matrix::<X>::from_slice(
                            cmma::MatrixIdent::A,
                            MMA,
                            MMA,
                            MMA,
                            cmma::MatrixLayout::RowMajor,
                            &xs[xa..xa + TILE_VALUES],
                            MMA as u32,
                        );
                        let w_tile = cmma::Matrix::<X>::from_slice(
                            cmma::MatrixIdent::B,
                            MMA,
                            MMA,
                            MMA,
                            cmma::MatrixLayout::ColMajor,
                            &wa[wr..wr + TILE_VALUES],
                            MMA as u32,
                        );
                        cmma::execute(&x_tile, &w_tile, &acc_a, &acc_a);
                        if comptime!(swiglu) {
                            let wb_tile = cmma::Matrix::<X>::from_slice(
                                cmma::MatrixIdent::B,
                                MMA,
                                MMA,
                                MMA,
                                cmma::MatrixLayout::ColMajor,
                                &wb[wr..wr + TILE_VALUES],
                                MMA as u32,
                            );
                            cmma::execute(&x_tile, &wb_tile, &acc_b, &acc_b);
                        }
                    }
                }
                sync_cube();
            }
            cmma::store(
                &mut stored[mine..mine + TILE_VALUES],
                &acc_a,
                MMA as u32,
                cmma::MatrixLayout::RowMajor,
            );
            let other = (MOE_MMA_ROW_TILES + plane) * TILE_VALUES;
            if comptime!(swiglu) {
                cmma::store(
                    &mut stored[other..other + TILE_VALUES],
                    &acc_b,
                    MMA as u32,
                    cmma::MatrixLayout::RowMajor,
                );
            }
            sync_cube();
            #[unroll]
            for j in 0..8usize {
                sums_a[j] = stored[mine + tile_element(lane, j)];
                if comptime!(swiglu) {
                    sums_b[j] = stored[other + tile_element(lane, j)];
                }
            }
            let k = first * MMA;
            add_scaled_groups(
                &mut total_a,
                &mut total_b,
                &sums_a,
                &sums_b,
                scales_a,
                scales_b,
                soff,
                row0,
                k,
                n_out,
                spr,
                fmt,
                group,
                swiglu,
            );
            sync_cube();
        }
    } else {
        for g in 0..groups {
            #[unroll]
            for j in 0..8usize {
                sums_a[j] = 0.0f32;
                sums_b[j] = 0.0f32;
            }
            let first = g * steps_per_scale;
            let last = (first + steps_per_scale).min(steps);
            for c in 0..(last - first).div_ceil(stage_steps) {
                let s0 = first + c * stage_steps;
                stage_chunk(
                    input,
                    &rows,
                    len,
                    words_a,
                    words_b,
                    lut,
                    &mut held_a,
                    &mut held_b,
                    &mut held_x,
                    &mut xs,
                    &mut wa,
                    &mut wb,
                    s0,
                    last,
                    steps,
                    steps_per_scale,
                    row0,
                    n_out,
                    inn,
                    wpr,
                    woff,
                    fmt,
                    swiglu,
                    stage_steps,
                );
                for d in 0..stage_steps {
                    if s0 + d < last {
                        #[unroll]
                        for j in 0..8usize {
                            let e = tile_element(lane, j);
                            let xa = d * TILE_VALUES + (e / MMA) * MMA;
                            let wr = d * W_STEP + plane * TILE_VALUES + (e % MMA) * MMA;
                            for kk in 0..MMA {
                                let xv = f32::cast_from(xs[xa + kk]);
                                sums_a[j] = fma(xv, f32::cast_from(wa[wr + kk]), sums_a[j]);
                                if comptime!(swiglu) {
                                    sums_b[j] = fma(xv, f32::cast_from(wb[wr + kk]), sums_b[j]);
                                }
                            }
                        }
                    }
                }
                sync_cube();
            }
            let k = first * MMA;
            add_scaled_groups(
                &mut total_a,
                &mut total_b,
                &sums_a,
                &sums_b,
                scales_a,
                scales_b,
                soff,
                row0,
                k,
                n_out,
                spr,
                fmt,
                group,
                swiglu,
            );
        }
    }
    store_assignments(y, &total_a, &total_b, a0, a_end, row0, n_out, swiglu);
}
