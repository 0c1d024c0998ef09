//! Tensor-core tiles (`cmma`) for the grouped MoE products: [`super::mma`]'s order on the routing table's
//! tiles of 16 assignments ([`super::moe`]), which are exactly the instruction's 16 rows.
//!
//! **Order.** Per assignment and output row, the expert's K axis is cut into steps of 16 inputs and scale
//! groups as in [`super::mma`]: per group an f32 accumulator takes the group's steps in order on tensor
//! cores (the half operands times the weights' exact codes), then the group's sum times the f32 scale is
//! added to the f32 total, groups left to right. Gate and up keep one accumulator each and end in
//! `silu(gate) * up` ([`super::moe::silu_times`]), in f32. An assignment's row of the instruction never
//! mixes with the other rows, and rows past the tile's last assignment are zeros, so an assignment gets
//! the same bits whichever tile it shares, with how many tokens: a decode step computes a prefill's bits.
//!
//! **Operands.** The instruction multiplies two operands of the operand type `X` (the activations' half
//! type): the gate/up input is the activations, rounded to `X` as they are staged (exact for half values,
//! widened to f32 or not); the down projection's input, the SwiGLU output `h` (an f32 buffer), is
//! rounded to `X` as it is staged. That rounding is this path's own (the scalar-order kernels keep `h` in
//! f32), so rollout and training must both take these tiles for their bits to agree.
//!
//! **Tile.** A cube of 4 planes (32 units each) computes up to `blocks` x 16 assignments x 64 rows:
//! plane `p` holds the 16 x 16 accumulators of row tile `p` for each block of 16 assignments (two per
//! block with SwiGLU). Per step the cube stages the blocks' 16 x 16 inputs and 64 x 16 codes per
//! projection in shared memory, `stage_steps` steps per pair of barriers as in [`super::mma`] (the bits
//! do not depend on it), so a weight step is read and decoded once for all the blocks; per scale group
//! the accumulators go through shared memory to the units, which scale and add them. The blocks are
//! consecutive routing-table tiles that continue one expert's assignments; neither `blocks` nor which
//! tiles share a cube changes a bit.
//!
//! [`grouped_tiles`] without `tensor_cores` is the same tiling, staging and scale groups with scalar FMAs
//! in place of the instruction (any runtime): `cube_kernels/tests/kernels.rs` checks it on lavapipe against the host
//! reference and against one-token-at-a-time runs, which leaves only the instruction to the GPU check.

use cubecl::prelude::*;

use super::mma::{add_scaled_group, code_at, tile_element, MMA, MMA_PLANE, SHARED_ALIGN};
use super::moe::silu_times;

/// Row tiles (planes) of a cube: 64 output rows.
pub const MOE_MMA_ROW_TILES: usize = 4;

/// Units of a cube.
const UNITS: usize = MOE_MMA_ROW_TILES * MMA_PLANE;

/// Values of one 16 x 16 operand or accumulator tile.
const TILE_VALUES: usize = MMA * MMA;

/// Weight codes of one staged step per projection: 64 rows x 16.
const W_STEP: usize = MOE_MMA_ROW_TILES * TILE_VALUES;

/// The most 16-assignment blocks a cube takes ([`grouped_tiles`]' `blocks`).
pub const MOE_MMA_MAX_BLOCKS: usize = 4;

/// Shared memory [`grouped_tiles`] allocates with `stage_steps` staged steps of `operand_bytes`-byte
/// operands for `blocks` blocks of 16 assignments, two projections with `swiglu` (and, on tensor cores,
/// the f32 accumulators' way to the units), alignment padding included.
pub fn grouped_tiles_shared_bytes(
    stage_steps: usize,
    blocks: usize,
    operand_bytes: usize,
    swiglu: bool,
    tensor_cores: bool,
) -> usize {
    let sets = if swiglu { 2 } else { 1 };
    let stored = if tensor_cores {
        sets * blocks * W_STEP * 4
    } else {
        0
    };
    // `wb` holds one value without SwiGLU.
    let wb = if swiglu { stage_steps * W_STEP } else { 1 };
    (stage_steps * (blocks * TILE_VALUES + W_STEP) + wb) * operand_bytes + stored + 4 * SHARED_ALIGN
}

/// Stages K step `s` of the cube's run in shared memory slot `slot` (of the kernel's `stage_steps`), in
/// `X`: the inputs of the run's assignments `a0..a_end` (at most `blocks` x 16; `xs[assignment][k]`;
/// with `gather` row `table[rows_at + a]` of `input`, else row `a`; rounded to `X`) and the 64 rows x
/// 16 codes of `a` (and `b` with `swiglu`) of the expert at words `woff` (`ws[row][k]`); zeros past the
/// run's assignments, the rows or the inputs.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_moe_step<I: Float, X: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    words_a: &[u32],
    words_b: &[u32],
    lut: &[f32],
    xs: &mut Shared<[X]>,
    wa: &mut Shared<[X]>,
    wb: &mut Shared<[X]>,
    s: usize,
    slot: usize,
    a0: usize,
    a_end: usize,
    row0: usize,
    n_out: usize,
    inn: usize,
    wpr: usize,
    woff: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] blocks: usize,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let k0 = s * MMA;
    let (xs0, ws0) = (slot * blocks * TILE_VALUES, slot * W_STEP);
    #[unroll]
    for h in 0..comptime!(2 * blocks) {
        let e = unit + h * UNITS;
        let (r, k) = (e / MMA, k0 + e % MMA);
        let mut v = X::from_int(0);
        if a0 + r < a_end && k < inn {
            let mut src = a0 + r;
            if comptime!(gather) {
                src = table[rows_at + a0 + r] as usize;
            }
            v = X::cast_from(input[src * inn + k]);
        }
        xs[xs0 + e] = v;
    }
    #[unroll]
    for h in 0..8usize {
        let e = unit + h * UNITS;
        let (r, k) = (row0 + e / MMA, k0 + e % MMA);
        let mut ca = 0.0f32;
        let mut cb = 0.0f32;
        if r < n_out && k < inn {
            ca = code_at(words_a, lut, woff, r, k, wpr, fmt);
            if comptime!(swiglu) {
                cb = code_at(words_b, lut, woff, r, k, wpr, fmt);
            }
        }
        wa[ws0 + e] = X::cast_from(ca);
        if comptime!(swiglu) {
            wb[ws0 + e] = X::cast_from(cb);
        }
    }
}

/// Stages steps `s0..last` (at most `stage_steps` of them) in slots 0, 1, ... ([`stage_moe_step`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_moe_steps_from<I: Float, X: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    words_a: &[u32],
    words_b: &[u32],
    lut: &[f32],
    xs: &mut Shared<[X]>,
    wa: &mut Shared<[X]>,
    wb: &mut Shared<[X]>,
    s0: usize,
    last: usize,
    a0: usize,
    a_end: usize,
    row0: usize,
    n_out: usize,
    inn: usize,
    wpr: usize,
    woff: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] stage_steps: usize,
    #[comptime] blocks: usize,
) {
    for d in 0..stage_steps {
        if s0 + d < last {
            stage_moe_step(
                input,
                table,
                rows_at,
                words_a,
                words_b,
                lut,
                xs,
                wa,
                wb,
                s0 + d,
                d,
                a0,
                a_end,
                row0,
                n_out,
                inn,
                wpr,
                woff,
                fmt,
                swiglu,
                gather,
                blocks,
            );
        }
    }
}

/// [`add_scaled_group`] for projection `a`'s sums of block `at / 8`, and with `swiglu` for `b`'s (the
/// up projection).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_scaled_groups(
    total_a: &mut Array<f32>,
    total_b: &mut Array<f32>,
    sums_a: &Array<f32>,
    sums_b: &Array<f32>,
    #[comptime] at: usize,
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
        total_a, sums_a, at, scales_a, soff, row_base, k, n_out, spr, fmt, group,
    );
    if comptime!(swiglu) {
        add_scaled_group(
            total_b, sums_b, at, scales_b, soff, row_base, k, n_out, spr, fmt, group,
        );
    }
}

/// Stores the unit's 8 outputs per block into `y [assignments, n_out]` (f32): the totals, or
/// `silu(a) * b`.
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
    #[comptime] blocks: usize,
) {
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    #[unroll]
    for b in 0..blocks {
        #[unroll]
        for j in 0..8usize {
            let e = tile_element(lane, j);
            let a = a0 + b * MMA + e / MMA;
            let r = row0 + plane * MMA + e % MMA;
            if a < a_end && r < n_out {
                let mut v = total_a[b * 8 + j];
                if comptime!(swiglu) {
                    v = silu_times(total_a[b * 8 + j], total_b[b * 8 + j]);
                }
                y[a * n_out + r] = v;
            }
        }
    }
}

/// `y[a, row] = sum_k input[src(a), k] a_e[row, k]` (or `silu(.) * (. b_e)` with `swiglu`) for the
/// assignments of the routing table's tiles `CUBE_POS_Y * blocks ..` (of `tiles`) in the order of the
/// module doc: on tensor cores when `tensor_cores`, else with scalar fused multiply-adds in place of the
/// instruction (each group's sum over its inputs in order from 0; any runtime and operand type, f32
/// included; the same tiling, staging and scale groups, other bits than the instruction's,
/// batch-invariant in the same way). A cube takes `blocks` consecutive tiles; the tiles that continue
/// one expert's assignments form a run whose weights are staged once for all of them (`blocks` times
/// fewer weight reads and decodes per instruction), runs one after the other. An assignment's row of
/// the instruction never mixes with the others', so `blocks` changes no bit. Arguments as
/// [`super::moe::grouped_matmul`]'s, with `steps = ceil(inn / 16)` and the scale group in steps. `I` is
/// the input buffer's type, `X` the operands' (half for the instruction). Launch with `CubeDim (32, 4)`
/// and `CubeCount (ceil(n_out / 64), ceil(tiles / blocks))`.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_tiles<I: Float, X: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    tiles: usize,
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
    #[comptime] blocks: usize,
    #[define(I, X)] _dtypes: [ElemType; 2],
) {
    let mut xs = Shared::<[X]>::new_aligned_slice(
        comptime!(stage_steps * blocks * TILE_VALUES),
        SHARED_ALIGN,
    );
    let mut wa = Shared::<[X]>::new_aligned_slice(comptime!(stage_steps * W_STEP), SHARED_ALIGN);
    let mut wb = Shared::<[X]>::new_aligned_slice(
        comptime!(if swiglu { stage_steps * W_STEP } else { 1 }),
        SHARED_ALIGN,
    );
    let sets = comptime!(if swiglu { 2usize } else { 1usize });
    let mut stored = Shared::<[f32]>::new_aligned_slice(
        comptime!(if tensor_cores {
            sets * blocks * W_STEP
        } else {
            1
        }),
        SHARED_ALIGN,
    );
    let first = CUBE_POS_Y as usize * blocks;
    let mut end = first + blocks;
    if end > tiles {
        end = tiles;
    }
    let row0 = CUBE_POS_X as usize * (MOE_MMA_ROW_TILES * MMA);
    // Runs of tiles that continue one expert's assignments; every unit reads the same entries, so the
    // barriers inside stay uniform.
    let mut t = first;
    while t < end {
        let expert = table[3 * t] as usize;
        let a0 = table[3 * t + 1] as usize;
        let mut a_end = table[3 * t + 2] as usize;
        let mut u = t + 1;
        let mut joining = true;
        while joining {
            joining = false;
            if u < end {
                let (next_expert, next_a0) = (table[3 * u] as usize, table[3 * u + 1] as usize);
                let next_end = table[3 * u + 2] as usize;
                if next_expert == expert && next_a0 == a_end && next_a0 < next_end {
                    a_end = next_end;
                    u += 1;
                    joining = true;
                }
            }
        }
        // An empty tile (the device routing's trailing ones) runs no group and stores nothing.
        let mut groups = 0usize;
        if a0 < a_end {
            groups = steps.div_ceil(steps_per_scale);
        }
        let (woff, soff) = (expert * expert_words, expert * expert_scales);
        let run = (a0, a_end, row0, groups);
        let sizes = (n_out, inn, wpr, spr, steps, steps_per_scale);
        if comptime!(tensor_cores) {
            run_on_instructions(
                input,
                table,
                rows_at,
                words_a,
                scales_a,
                words_b,
                scales_b,
                lut,
                y,
                &mut xs,
                &mut wa,
                &mut wb,
                &mut stored,
                run,
                sizes,
                woff,
                soff,
                fmt,
                group,
                swiglu,
                gather,
                stage_steps,
                blocks,
            );
        } else {
            run_on_fmas(
                input,
                table,
                rows_at,
                words_a,
                scales_a,
                words_b,
                scales_b,
                lut,
                y,
                &mut xs,
                &mut wa,
                &mut wb,
                run,
                sizes,
                woff,
                soff,
                fmt,
                group,
                swiglu,
                gather,
                stage_steps,
                blocks,
            );
        }
        t = u;
    }
}

/// One run of [`grouped_tiles`] on tensor cores: assignments `a0..a_end` (`run`: with the cube's first
/// row and the scale groups to take) of the expert at words `woff` and scales `soff`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn run_on_instructions<I: Float, X: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    words_a: &[u32],
    scales_a: &[f32],
    words_b: &[u32],
    scales_b: &[f32],
    lut: &[f32],
    y: &mut [f32],
    xs: &mut Shared<[X]>,
    wa: &mut Shared<[X]>,
    wb: &mut Shared<[X]>,
    stored: &mut Shared<[f32]>,
    run: (usize, usize, usize, usize),
    sizes: (usize, usize, usize, usize, usize, usize),
    woff: usize,
    soff: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] stage_steps: usize,
    #[comptime] blocks: usize,
) {
    let (a0, a_end, row0, groups) = run;
    let (n_out, inn, wpr, spr, steps, steps_per_scale) = sizes;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let mut total_a = Array::<f32>::new(comptime!(8 * blocks));
    let mut total_b = Array::<f32>::new(comptime!(8 * blocks));
    let mut sums_a = Array::<f32>::new(8usize);
    let mut sums_b = Array::<f32>::new(8usize);
    #[unroll]
    for j in 0..comptime!(8 * blocks) {
        total_a[j] = 0.0f32;
        total_b[j] = 0.0f32;
    }
    let mut accs_a = Sequence::<cmma::Matrix<f32>>::new();
    let mut accs_b = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _b in 0..blocks {
        accs_a.push(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            MMA,
            MMA,
            MMA,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        ));
        if comptime!(swiglu) {
            accs_b.push(cmma::Matrix::<f32>::from_value(
                cmma::MatrixIdent::Accumulator,
                MMA,
                MMA,
                MMA,
                cmma::MatrixLayout::Undefined,
                0.0f32,
            ));
        }
    }
    for g in 0..groups {
        #[unroll]
        for b in 0..blocks {
            cmma::fill(accs_a.index_mut(b), 0.0f32);
            if comptime!(swiglu) {
                cmma::fill(accs_b.index_mut(b), 0.0f32);
            }
        }
        let first = g * steps_per_scale;
        let last = (first + steps_per_scale).min(steps);
        for c in 0..(last - first).div_ceil(stage_steps) {
            let s0 = first + c * stage_steps;
            stage_moe_steps_from(
                input,
                table,
                rows_at,
                words_a,
                words_b,
                lut,
                xs,
                wa,
                wb,
                s0,
                last,
                a0,
                a_end,
                row0,
                n_out,
                inn,
                wpr,
                woff,
                fmt,
                swiglu,
                gather,
                stage_steps,
                blocks,
            );
            sync_cube();
            for d in 0..stage_steps {
                if s0 + d < last {
                    let wr = d * W_STEP + plane * TILE_VALUES;
                    let w_tile = cmma::Matrix::<X>::from_slice(
                        cmma::MatrixIdent::B,
                        MMA,
                        MMA,
                        MMA,
                        cmma::MatrixLayout::ColMajor,
                        &wa[wr..wr + TILE_VALUES],
                        MMA as u32,
                    );
                    // The up projection's tile, with SwiGLU only (a sequence of none or one).
                    let mut wb_tile = Sequence::<cmma::Matrix<X>>::new();
                    if comptime!(swiglu) {
                        wb_tile.push(cmma::Matrix::<X>::from_slice(
                            cmma::MatrixIdent::B,
                            MMA,
                            MMA,
                            MMA,
                            cmma::MatrixLayout::ColMajor,
                            &wb[wr..wr + TILE_VALUES],
                            MMA as u32,
                        ));
                    }
                    #[unroll]
                    for b in 0..blocks {
                        // Blocks past the run's assignments hold only zeros: skipped (uniform).
                        if a0 + b * MMA < a_end {
                            let xa = (d * blocks + b) * TILE_VALUES;
                            let x_tile = cmma::Matrix::<X>::from_slice(
                                cmma::MatrixIdent::A,
                                MMA,
                                MMA,
                                MMA,
                                cmma::MatrixLayout::RowMajor,
                                &xs[xa..xa + TILE_VALUES],
                                MMA as u32,
                            );
                            cmma::execute(&x_tile, &w_tile, accs_a.index(b), accs_a.index(b));
                            if comptime!(swiglu) {
                                cmma::execute(
                                    &x_tile,
                                    wb_tile.index(0),
                                    accs_b.index(b),
                                    accs_b.index(b),
                                );
                            }
                        }
                    }
                }
            }
            sync_cube();
        }
        #[unroll]
        for b in 0..blocks {
            let mine = (plane * blocks + b) * TILE_VALUES;
            cmma::store(
                &mut stored[mine..mine + TILE_VALUES],
                accs_a.index(b),
                MMA as u32,
                cmma::MatrixLayout::RowMajor,
            );
            if comptime!(swiglu) {
                let other = ((MOE_MMA_ROW_TILES + plane) * blocks + b) * TILE_VALUES;
                cmma::store(
                    &mut stored[other..other + TILE_VALUES],
                    accs_b.index(b),
                    MMA as u32,
                    cmma::MatrixLayout::RowMajor,
                );
            }
        }
        sync_cube();
        let k = first * MMA;
        #[unroll]
        for b in 0..blocks {
            let mine = (plane * blocks + b) * TILE_VALUES;
            let other = ((MOE_MMA_ROW_TILES + plane) * blocks + b) * TILE_VALUES;
            #[unroll]
            for j in 0..8usize {
                sums_a[j] = stored[mine + tile_element(lane, j)];
                if comptime!(swiglu) {
                    sums_b[j] = stored[other + tile_element(lane, j)];
                }
            }
            add_scaled_groups(
                &mut total_a,
                &mut total_b,
                &sums_a,
                &sums_b,
                comptime!(8 * b),
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
        sync_cube();
    }
    store_assignments(
        y, &total_a, &total_b, a0, a_end, row0, n_out, swiglu, blocks,
    );
}

/// One run of [`grouped_tiles`] with scalar FMAs in place of the instruction (arguments as
/// [`run_on_instructions`]').
#[cube]
#[allow(clippy::too_many_arguments)]
fn run_on_fmas<I: Float, X: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    words_a: &[u32],
    scales_a: &[f32],
    words_b: &[u32],
    scales_b: &[f32],
    lut: &[f32],
    y: &mut [f32],
    xs: &mut Shared<[X]>,
    wa: &mut Shared<[X]>,
    wb: &mut Shared<[X]>,
    run: (usize, usize, usize, usize),
    sizes: (usize, usize, usize, usize, usize, usize),
    woff: usize,
    soff: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] stage_steps: usize,
    #[comptime] blocks: usize,
) {
    let (a0, a_end, row0, groups) = run;
    let (n_out, inn, wpr, spr, steps, steps_per_scale) = sizes;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let mut total_a = Array::<f32>::new(comptime!(8 * blocks));
    let mut total_b = Array::<f32>::new(comptime!(8 * blocks));
    let mut sums_a = Array::<f32>::new(comptime!(8 * blocks));
    let mut sums_b = Array::<f32>::new(comptime!(8 * blocks));
    let mut block_a = Array::<f32>::new(8usize);
    let mut block_b = Array::<f32>::new(8usize);
    #[unroll]
    for j in 0..comptime!(8 * blocks) {
        total_a[j] = 0.0f32;
        total_b[j] = 0.0f32;
    }
    for g in 0..groups {
        #[unroll]
        for j in 0..comptime!(8 * blocks) {
            sums_a[j] = 0.0f32;
            sums_b[j] = 0.0f32;
        }
        let first = g * steps_per_scale;
        let last = (first + steps_per_scale).min(steps);
        for c in 0..(last - first).div_ceil(stage_steps) {
            let s0 = first + c * stage_steps;
            stage_moe_steps_from(
                input,
                table,
                rows_at,
                words_a,
                words_b,
                lut,
                xs,
                wa,
                wb,
                s0,
                last,
                a0,
                a_end,
                row0,
                n_out,
                inn,
                wpr,
                woff,
                fmt,
                swiglu,
                gather,
                stage_steps,
                blocks,
            );
            sync_cube();
            for d in 0..stage_steps {
                if s0 + d < last {
                    #[unroll]
                    for b in 0..blocks {
                        #[unroll]
                        for j in 0..8usize {
                            let e = tile_element(lane, j);
                            let xa = (d * blocks + b) * TILE_VALUES + (e / MMA) * MMA;
                            let wr = d * W_STEP + plane * TILE_VALUES + (e % MMA) * MMA;
                            let at = b * 8 + j;
                            for kk in 0..MMA {
                                let xv = f32::cast_from(xs[xa + kk]);
                                sums_a[at] = fma(xv, f32::cast_from(wa[wr + kk]), sums_a[at]);
                                if comptime!(swiglu) {
                                    sums_b[at] = fma(xv, f32::cast_from(wb[wr + kk]), sums_b[at]);
                                }
                            }
                        }
                    }
                }
            }
            sync_cube();
        }
        let k = first * MMA;
        #[unroll]
        for b in 0..blocks {
            #[unroll]
            for j in 0..8usize {
                block_a[j] = sums_a[b * 8 + j];
                block_b[j] = sums_b[b * 8 + j];
            }
            add_scaled_groups(
                &mut total_a,
                &mut total_b,
                &block_a,
                &block_b,
                comptime!(8 * b),
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
    store_assignments(
        y, &total_a, &total_b, a0, a_end, row0, n_out, swiglu, blocks,
    );
}
