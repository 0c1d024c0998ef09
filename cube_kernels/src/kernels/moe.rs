//! The grouped MoE matmul: assignments (token, expert) sorted by expert, one launch over all experts.
//!
//! Each expert's run of sorted assignments is split into tiles of 16 ([`crate::moe::MoeRouting`] on the
//! host, or [`route()`](fn@super::route::route) on the device, from ids that never leave it); cube `(x, y)`
//! of [`grouped_matmul`](fn@grouped_matmul) computes output rows `64x..64x+64` for tile `y`, reading that
//! tile's expert's weights at its word and scale offsets. Gate and up are fused (`swiglu`): both dot products
//! share the staged activations and the result is `silu(gate) * up`. Empty experts have no tiles; a table
//! built on the device ends with empty tiles up to a bound (their cubes compute nothing).
//!
//! The routing bookkeeping is one `u32` table ([`crate::moe::MoeRouting::table`], uploaded, or
//! [`crate::moe::RoutingTable`], built on the device): per tile `(expert, first assignment, one past the
//! last)` at `3 * tile`, then the token of every sorted assignment from `rows_at`, then the sorted position
//! of every (token, slot) from `pos_at`, then the expert of every sorted assignment, then the offsets.
//!
//! # Arithmetic contract (what [`crate::reference::moe`] computes, and what the model's MoE block relies on)
//! For assignment `a` (token `t`, slot `j`, expert `e`), with `x'` = the activations as the format asks
//! (fp8-b128: each row quantized per 128 columns, as [`crate::reference::fp8_activations`]; else `x`):
//! 1. `g = canonical_dot(x'[t], gate_e[r])`, `u = canonical_dot(x'[t], up_e[r])` for each row `r`, in the
//!    canonical order of [`super`] (chunks of 32, fused multiply-adds from 0.0, chunk sums left to right);
//! 2. `h[r] = g / (1 + exp(-g)) * u` in f32, in that order of operations (`exp` is the runtime's);
//! 3. `h' = h` fp8-quantized per 128 columns for fp8-b128, then `y_a[c] = canonical_dot(h', down_e[c])`;
//! 4. combine: `out[t, c] = fma(w[t, k-1], y[t, k-1][c], ... fma(w[t, 0], y[t, 0][c], 0.0))`, slots in
//!    slot order `0..top_k` (the order of the ids, not of the experts), one fused multiply-add each, no
//!    atomics; a token's output depends only on its own row, ids and weights, never on the batch.
//!
//! With activations in `F` (f16, bf16; [`super`]'s precision contract) `x` and `route_w` are read in `F`
//! and widened to f32, steps 1-4 run in f32 exactly as above (`h` and the per-assignment `y_a` are f32
//! buffers), and only `out` is rounded to `F`: the result is the f32 result on the widened inputs, rounded
//! once.

use cubecl::prelude::*;

use super::{
    chunk_depth, chunk_dot, chunk_dots, codes_per_word, scale_at, scales_per_chunk, stage_depth,
    stage_transposed, staged_row_floats, sum_chunks, weight_at, whole_chunk_scales, word_dots,
    words_per_chunk, BLOCK, STAGE_FLOATS, STAGE_STRIDE,
};

/// SwiGLU's `silu(g) * u = g / (1 + exp(-g)) * u` in f32, in that order of operations (the contract's step
/// 2); both grouped kernels call it, so they round alike.
#[cube]
pub fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0f32 + (-g).exp()) * u
}

/// `y[a, row] = sum_k x[src(a), k] w_e[row, k]` for every assignment `a` of tile `CUBE_POS_Y` (expert
/// `e = table[3 * tile]`), or `silu(gate) * up` when `swiglu` (then `words_b`/`scales_b` are the up
/// projection). `src(a)` is the token `table[rows_at + a]` when `gather`, else `a` itself (the down
/// projection reads the rows the first launch wrote, already in sorted order). `X` is the input's type
/// (the activations', or f32 for the fp8-quantized activations and the down projection); `y` is f32.
///
/// A cube of 64 x 4 units covers 64 rows (`CUBE_POS_X`) of the tile's up to 16 assignments: unit
/// `(tx, ty)` keeps row `tx` of assignments `ty + 4 i` in registers (and the up projection's beside them),
/// so per input step it reads four staged activations (the same for the whole warp) and one weight of each
/// projection for eight multiply-adds. Inputs are staged 16 deep (two stages per chunk), k-major; each
/// output keeps its chunk sum and total apart: the canonical order, the grouped GEMV's bits.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_matmul<X: Float>(
    x: &[X],
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
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] chunks: usize,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[define(X)] _dtype: ElemType,
) {
    // Activations k-major at a stride of 17 (16 assignments), weights at 65 (64 rows).
    let mut xs = Shared::<[f32]>::new_slice(16usize * 17usize);
    let mut wa = Shared::<[f32]>::new_slice(STAGE_FLOATS);
    let mut wb = Shared::<[f32]>::new_slice(comptime!(if swiglu { STAGE_FLOATS } else { 1 }));
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * 64 + tx;
    let tile = CUBE_POS_Y as usize;
    let expert = table[3 * tile] as usize;
    let a0 = table[3 * tile + 1] as usize;
    let a_end = table[3 * tile + 2] as usize;
    let row0 = CUBE_POS_X as usize * BLOCK;
    let woff = expert * expert_words;
    let soff = expert * expert_scales;
    let mut part_a = Array::<f32>::new(4usize);
    let mut part_b = Array::<f32>::new(4usize);
    let mut total_a = Array::<f32>::new(4usize);
    let mut total_b = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        total_a[i] = 0.0f32;
        total_b[i] = 0.0f32;
    }
    for c in 0..chunks {
        let k0 = c * 32;
        let depth = chunk_depth(c, inn);
        #[unroll]
        for i in 0..4usize {
            part_a[i] = 0.0f32;
            part_b[i] = 0.0f32;
        }
        for st in 0..2usize {
            let ks = k0 + st * 16;
            // 16 assignments x 16 inputs: one value per unit.
            let r = unit / 16;
            let kk = unit % 16;
            let mut xv = 0.0f32;
            if a0 + r < a_end && ks + kk < inn {
                let mut src = a0 + r;
                if comptime!(gather) {
                    src = table[rows_at + a0 + r] as usize;
                }
                xv = f32::cast_from(x[src * inn + ks + kk]);
            }
            xs[kk * 17 + r] = xv;
            // 64 rows x 16 inputs of each projection: four values per unit.
            #[unroll]
            for h in 0..4usize {
                let e = unit + h * 256;
                let wr = e / 16;
                let wk = e % 16;
                let k = ks + wk;
                let mut va = 0.0f32;
                let mut vb = 0.0f32;
                if row0 + wr < n_out && k < inn {
                    va = weight_at(
                        words_a,
                        scales_a,
                        lut,
                        woff,
                        soff,
                        row0 + wr,
                        k,
                        wpr,
                        spr,
                        fmt,
                        group,
                    );
                    if comptime!(swiglu) {
                        vb = weight_at(
                            words_b,
                            scales_b,
                            lut,
                            woff,
                            soff,
                            row0 + wr,
                            k,
                            wpr,
                            spr,
                            fmt,
                            group,
                        );
                    }
                }
                wa[wk * STAGE_STRIDE + wr] = va;
                if comptime!(swiglu) {
                    wb[wk * STAGE_STRIDE + wr] = vb;
                }
            }
            sync_cube();
            for kk in 0..stage_depth(depth, st) {
                let wva = wa[kk * STAGE_STRIDE + tx];
                let mut wvb = 0.0f32;
                if comptime!(swiglu) {
                    wvb = wb[kk * STAGE_STRIDE + tx];
                }
                #[unroll]
                for i in 0..4usize {
                    let xv = xs[kk * 17 + ty + 4 * i];
                    part_a[i] = fma(xv, wva, part_a[i]);
                    if comptime!(swiglu) {
                        part_b[i] = fma(xv, wvb, part_b[i]);
                    }
                }
            }
            sync_cube();
        }
        #[unroll]
        for i in 0..4usize {
            total_a[i] += part_a[i];
            total_b[i] += part_b[i];
        }
    }
    #[unroll]
    for i in 0..4usize {
        let a = a0 + ty + 4 * i;
        if row0 + tx < n_out && a < a_end {
            let mut v = total_a[i];
            if comptime!(swiglu) {
                v = silu_times(total_a[i], total_b[i]);
            }
            y[a * n_out + row0 + tx] = v;
        }
    }
}

/// The decode-sized form of [`grouped_matmul`](fn@grouped_matmul), the same values bit for bit: cube `(x, y)`
/// computes rows `rows_per_cube * x..` for the assignments of tile `y` (expert `table[3 y]`, assignments
/// `table[3 y + 1]..table[3 y + 2]`), `per_pass` assignments at a time, each row summed by `lanes` units
/// in parallel chunks as the dense GEMV does (chunk sums in shared memory, added left to right by lane
/// 0; with `stage_x` the pass's input rows are staged in shared memory first). A tile of
/// [`grouped_matmul`](fn@grouped_matmul) keeps 256 units on 64 rows x at most 16 assignments, so with one or
/// two assignments per expert (decode) most of it is idle, while here every unit reads weights; and the
/// cube's rows of the expert's weights come from memory once per tile, not once per assignment: the
/// later passes find them in the cache (a cube's rows are a few KiB), which matters from a few tokens
/// up, where experts start to share assignments. With `per_pass > 1` a lane decodes each weight once
/// for the pass's assignments ([`super::chunk_dots`](fn@super::chunk_dots): one fused multiply-add per
/// assignment and weight), where the decode is most of a GEMV's instructions per weight; each assignment's
/// sums are the same.
///
/// With `resident` (where [`can_hold`]: the scales of a whole chunk loaded once, [`resident_words`]
/// within [`MAX_RESIDENT_WORDS`]) a unit loads its row's packed words and scales of its whole chunks
/// once per tile, into registers, before the first pass stages its inputs, and every pass decodes them
/// from there (`held_chunk_dots`: the same decode and fused multiply-adds in the same order, so the same
/// bits): one wait on memory per tile for the weights, overlapped with the first staging, instead of
/// one per chunk, projection and pass (an H200 took ~2.3 us per assignment at 1-64 tokens, 2026-12-04,
/// about 3.4x the bytes' time: each pass waited on its loads one chunk after another).
///
/// The barriers sit in a loop whose bounds come from the routing table: the same for every unit of the
/// cube (one tile), so every unit reaches every barrier, but only at run time. CUDA, SPIR-V and naga
/// (the wgpu runtime) accept that; a WGSL compiler that proves uniformity statically (Tint) would not.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemv<X: Float>(
    x: &[X],
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
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] lanes: usize,
    #[comptime] rows_per_cube: usize,
    #[comptime] chunks: usize,
    #[comptime] per_pass: usize,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] stage_x: bool,
    #[comptime] resident: bool,
    #[define(X)] _dtype: ElemType,
) {
    // Held only where the held path computes the same sums (the launcher asks for no more).
    let resident = comptime!(resident && can_hold(fmt, group, chunks, lanes, swiglu));
    let sums = comptime!(per_pass * rows_per_cube * chunks);
    let mut part_a = Shared::<[f32]>::new_slice(sums);
    let mut part_b = Shared::<[f32]>::new_slice(comptime!(if swiglu { sums } else { 1 }));
    let row_floats = comptime!(staged_row_floats(chunks));
    let mut xs =
        Shared::<[f32]>::new_slice(comptime!(if stage_x { per_pass * row_floats } else { 1 }));
    let tile = CUBE_POS_Y as usize;
    let expert = table[3 * tile] as usize;
    let a0 = table[3 * tile + 1] as usize;
    let a_end = table[3 * tile + 2] as usize;
    let woff = expert * expert_words;
    let soff = expert * expert_scales;
    let held = comptime!(if resident {
        resident_words(fmt, chunks, lanes, swiglu)
    } else {
        1
    });
    let held_scale_count = comptime!(if resident {
        resident_scales(fmt, chunks, lanes, swiglu)
    } else {
        1
    });
    let mut held_w = Array::<u32>::new(held);
    let mut held_s = Array::<f32>::new(held_scale_count);
    if comptime!(resident) {
        let row = CUBE_POS_X as usize * rows_per_cube + UNIT_POS_Y as usize;
        let lane = UNIT_POS_X as usize;
        let live = a0 < a_end && row < n_out;
        hold_row_words(
            words_a,
            scales_a,
            &mut held_w,
            &mut held_s,
            woff,
            soff,
            row,
            lane,
            live,
            inn,
            wpr,
            spr,
            0usize,
            fmt,
            group,
            lanes,
            chunks,
        );
        if comptime!(swiglu) {
            hold_row_words(
                words_b,
                scales_b,
                &mut held_w,
                &mut held_s,
                woff,
                soff,
                row,
                lane,
                live,
                inn,
                wpr,
                spr,
                1usize,
                fmt,
                group,
                lanes,
                chunks,
            );
        }
    }
    // Full passes, then (when a pass takes several) the tile's last assignments one at a time: a pass
    // never computes an assignment that is not there. (A tile of one assignment still runs in this
    // kernel's cube, sized for the larger pass; the launcher picks one per pass where experts average
    // one assignment.)
    let mut first = a0;
    while first + per_pass <= a_end {
        gemv_pass(
            x,
            table,
            rows_at,
            words_a,
            scales_a,
            words_b,
            scales_b,
            lut,
            y,
            &mut part_a,
            &mut part_b,
            &mut xs,
            &held_w,
            &held_s,
            n_out,
            inn,
            wpr,
            spr,
            woff,
            soff,
            first,
            per_pass,
            fmt,
            group,
            lanes,
            rows_per_cube,
            chunks,
            swiglu,
            gather,
            stage_x,
            resident,
        );
        first += per_pass;
    }
    if comptime!(per_pass > 1) {
        while first < a_end {
            gemv_pass(
                x,
                table,
                rows_at,
                words_a,
                scales_a,
                words_b,
                scales_b,
                lut,
                y,
                &mut part_a,
                &mut part_b,
                &mut xs,
                &held_w,
                &held_s,
                n_out,
                inn,
                wpr,
                spr,
                woff,
                soff,
                first,
                1usize,
                fmt,
                group,
                lanes,
                rows_per_cube,
                chunks,
                swiglu,
                gather,
                stage_x,
                resident,
            );
            first += 1;
        }
    }
}

/// One pass of [`grouped_gemv`]: assignments `first..first + count` of the cube's tile (all there), each
/// row's chunks summed by the lanes ([`super::chunk_dots`]: each weight decoded once for the pass's
/// assignments) into shared memory, then added left to right by lane 0. Two barriers: after staging the
/// pass's input rows, and after its chunk sums; lane 0 adds the sums before it reaches the next pass's
/// first barrier, so one set of sums suffices.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gemv_pass<X: Float>(
    x: &[X],
    table: &[u32],
    rows_at: usize,
    words_a: &[u32],
    scales_a: &[f32],
    words_b: &[u32],
    scales_b: &[f32],
    lut: &[f32],
    y: &mut [f32],
    part_a: &mut Shared<[f32]>,
    part_b: &mut Shared<[f32]>,
    xs: &mut Shared<[f32]>,
    held_w: &Array<u32>,
    held_s: &Array<f32>,
    n_out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    woff: usize,
    soff: usize,
    first: usize,
    #[comptime] count: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] lanes: usize,
    #[comptime] rows_per_cube: usize,
    #[comptime] chunks: usize,
    #[comptime] swiglu: bool,
    #[comptime] gather: bool,
    #[comptime] stage_x: bool,
    #[comptime] resident: bool,
) {
    let lane = UNIT_POS_X as usize;
    let local_row = UNIT_POS_Y as usize;
    let row = CUBE_POS_X as usize * rows_per_cube + local_row;
    let row_floats = comptime!(staged_row_floats(chunks));
    let per_lane = comptime!(chunks.div_ceil(lanes));
    let mut xoffs = Array::<u32>::new(count);
    #[unroll]
    for p in 0..count {
        let mut src = first + p;
        if comptime!(gather) {
            src = table[rows_at + src] as usize;
        }
        xoffs[p] = (src * inn) as u32;
    }
    if comptime!(stage_x) {
        #[unroll]
        for p in 0..count {
            stage_transposed(
                x,
                xoffs[p] as usize,
                inn,
                xs,
                p * row_floats,
                local_row * lanes + lane,
                lanes * rows_per_cube,
                chunks,
            );
        }
    }
    sync_cube();
    if comptime!(resident) {
        if row < n_out {
            #[unroll]
            for i in 0..per_lane {
                let c = lane + i * lanes;
                if c < chunks {
                    let k0 = c * 32;
                    let depth = chunk_depth(c, inn);
                    let mut parts = Array::<f32>::new(count);
                    held_chunk_dots(
                        x, &xoffs, &*xs, held_w, held_s, words_a, scales_a, lut, woff, soff, row,
                        k0, depth, wpr, spr, &mut parts, 0usize, i, count, fmt, group, lanes,
                        chunks, stage_x,
                    );
                    #[unroll]
                    for p in 0..count {
                        part_a[(p * rows_per_cube + local_row) * chunks + c] = parts[p];
                    }
                    if comptime!(swiglu) {
                        held_chunk_dots(
                            x, &xoffs, &*xs, held_w, held_s, words_b, scales_b, lut, woff, soff,
                            row, k0, depth, wpr, spr, &mut parts, 1usize, i, count, fmt, group,
                            lanes, chunks, stage_x,
                        );
                        #[unroll]
                        for p in 0..count {
                            part_b[(p * rows_per_cube + local_row) * chunks + c] = parts[p];
                        }
                    }
                }
            }
        }
    } else if row < n_out {
        for i in 0..per_lane {
            let c = lane + i * lanes;
            if c < chunks {
                let k0 = c * 32;
                let depth = chunk_depth(c, inn);
                let mut parts = Array::<f32>::new(count);
                chunk_dots(
                    x, &xoffs, &*xs, words_a, scales_a, lut, woff, soff, row, k0, depth, wpr, spr,
                    &mut parts, count, fmt, group, chunks, stage_x,
                );
                #[unroll]
                for p in 0..count {
                    part_a[(p * rows_per_cube + local_row) * chunks + c] = parts[p];
                }
                if comptime!(swiglu) {
                    chunk_dots(
                        x, &xoffs, &*xs, words_b, scales_b, lut, woff, soff, row, k0, depth, wpr,
                        spr, &mut parts, count, fmt, group, chunks, stage_x,
                    );
                    #[unroll]
                    for p in 0..count {
                        part_b[(p * rows_per_cube + local_row) * chunks + c] = parts[p];
                    }
                }
            }
        }
    }
    sync_cube();
    if lane == 0 && row < n_out {
        #[unroll]
        for p in 0..count {
            let at = (p * rows_per_cube + local_row) * chunks;
            let mut v = sum_chunks(&*part_a, at, chunks);
            if comptime!(swiglu) {
                v = silu_times(v, sum_chunks(&*part_b, at, chunks));
            }
            y[(first + p) * n_out + row] = v;
        }
    }
}

/// Most packed words a unit of [`grouped_gemv`](fn@grouped_gemv) holds with `resident` (registers: the kernel
/// otherwise takes ~32 per unit).
pub const MAX_RESIDENT_WORDS: usize = 32;

/// Packed words a unit of [`grouped_gemv`](fn@grouped_gemv) holds with `resident`: its chunks'
/// (`chunks / lanes`, rounded up) words of each projection (two with SwiGLU).
pub const fn resident_words(fmt: u32, chunks: usize, lanes: usize, swiglu: bool) -> usize {
    chunks.div_ceil(lanes) * if swiglu { 2 } else { 1 } * words_per_chunk(fmt)
}

/// Scales a unit of [`grouped_gemv`](fn@grouped_gemv) holds with `resident`: one per chunk and projection, or
/// one per word for fp4 (blocks of 16 or 32 inputs).
pub const fn resident_scales(fmt: u32, chunks: usize, lanes: usize, swiglu: bool) -> usize {
    chunks.div_ceil(lanes) * if swiglu { 2 } else { 1 } * scales_per_chunk(fmt)
}

/// Whether [`grouped_gemv`](fn@grouped_gemv) can hold the weights of format `fmt` (groups of `group`)
/// for a cube of `lanes` lanes over `chunks` chunks: their whole chunks decode with the scales
/// [`super::chunk_dots`](fn@super::chunk_dots)'s fast path loads once ([`whole_chunk_scales`]), and a
/// unit's words stay within [`MAX_RESIDENT_WORDS`]. The kernel holds them nowhere else, whatever it is
/// asked.
pub const fn can_hold(fmt: u32, group: usize, chunks: usize, lanes: usize, swiglu: bool) -> bool {
    whole_chunk_scales(fmt, group)
        && resident_words(fmt, chunks, lanes, swiglu) <= MAX_RESIDENT_WORDS
}

/// Loads, for projection `set` (0: `a`, 1: `b`), the packed words and scales of every whole chunk of
/// `row` that `lane` sums into `held_w` / `held_s`, from the expert's words at `woff` and scales at
/// `soff`. Where the cube has no tile or the row no place (`live` false), and for chunks past the
/// row's end or a last chunk cut short, it loads the expert's first word and scale instead (never
/// read: those sums take [`super::chunk_dots`] or nothing), so every load is in bounds and issued
/// without a branch, all before the first use.
#[cube]
#[allow(clippy::too_many_arguments)]
fn hold_row_words(
    words: &[u32],
    scales: &[f32],
    held_w: &mut Array<u32>,
    held_s: &mut Array<f32>,
    woff: usize,
    soff: usize,
    row: usize,
    lane: usize,
    live: bool,
    inn: usize,
    wpr: usize,
    spr: usize,
    #[comptime] set: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] lanes: usize,
    #[comptime] chunks: usize,
) {
    let cpw = comptime!(codes_per_word(fmt));
    let wpc = comptime!(words_per_chunk(fmt));
    let spc = comptime!(scales_per_chunk(fmt));
    let per_lane = comptime!(chunks.div_ceil(lanes));
    #[unroll]
    for i in 0..per_lane {
        let c = lane + i * lanes;
        let ok = live && c < chunks && c * 32 + 32 <= inn;
        let k0 = select(ok, c * 32, 0usize);
        let r = select(ok, row, 0usize);
        let base = woff + r * wpr + k0 / cpw;
        #[unroll]
        for w in 0..wpc {
            held_w[(set * per_lane + i) * wpc + w] = words[select(ok, base + w, woff)];
        }
        #[unroll]
        for q in 0..spc {
            let k = select(ok, k0 + q * cpw, 0usize);
            held_s[(set * per_lane + i) * spc + q] = scale_at(scales, soff, r, k, spr, fmt, group);
        }
    }
}

/// Chunk `i` of the lane (inputs `k0..k0 + depth`) of projection `set`'s row (`words`, `scales`) for
/// the pass's `count` input rows: a whole chunk ([`super::chunk_dots`]'s fast path) from the words and
/// scales [`hold_row_words`] loaded, with the same decode, scale and fused multiply-adds from 0.0 in
/// `k` order, so the same bits; a chunk cut short from memory ([`super::chunk_dots`] itself).
#[cube]
#[allow(clippy::too_many_arguments)]
fn held_chunk_dots<X: Float>(
    x: &[X],
    xoffs: &Array<u32>,
    xs: &Shared<[f32]>,
    held_w: &Array<u32>,
    held_s: &Array<f32>,
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    woff: usize,
    soff: usize,
    row: usize,
    k0: usize,
    depth: usize,
    wpr: usize,
    spr: usize,
    parts: &mut Array<f32>,
    #[comptime] set: usize,
    i: usize,
    #[comptime] count: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] lanes: usize,
    #[comptime] chunks: usize,
    #[comptime] staged: bool,
) {
    let wpc = comptime!(words_per_chunk(fmt));
    let spc = comptime!(scales_per_chunk(fmt));
    let per_lane = comptime!(chunks.div_ceil(lanes));
    if depth < 32 {
        chunk_dots(
            x, xoffs, xs, words, scales, lut, woff, soff, row, k0, depth, wpr, spr, parts, count,
            fmt, group, chunks, staged,
        );
    } else {
        let first_word = (set * per_lane + i) * wpc;
        let first_scale = (set * per_lane + i) * spc;
        #[unroll]
        for p in 0..count {
            parts[p] = 0.0f32;
        }
        let mut s = held_s[first_scale];
        #[unroll]
        for w in 0..wpc {
            if comptime!(fmt == 3) {
                s = held_s[first_scale + w];
            }
            let packed = held_w[first_word + w];
            word_dots(
                x, xoffs, xs, lut, packed, s, k0, w, parts, count, fmt, chunks, staged,
            );
        }
    }
}

/// Un-permute and combine: `out[t, c] = sum_j route_w[t, j] * y[pos(t, j), c]` for `j = 0..top_k` in slot
/// order, `acc = fma(route_w[t, j], y[..], acc)` from `acc = 0.0` (no atomics, so the result does not
/// depend on scheduling); `pos(t, j) = table[pos_at + t * top_k + j]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn combine<F: Float>(
    y: &[f32],
    table: &[u32],
    pos_at: usize,
    route_w: &[F],
    out: &mut [F],
    tokens: usize,
    hidden: usize,
    top_k: usize,
    #[define(F)] _dtype: ElemType,
) {
    let id = ABSOLUTE_POS;
    if id < tokens * hidden {
        let t = id / hidden;
        let c = id % hidden;
        let mut acc = 0.0f32;
        for j in 0..top_k {
            let a = table[pos_at + t * top_k + j] as usize;
            acc = fma(
                f32::cast_from(route_w[t * top_k + j]),
                y[a * hidden + c],
                acc,
            );
        }
        out[id] = F::cast_from(acc);
    }
}

/// The decode-sized down projection and combine in one launch, bit for bit [`grouped_gemv`](fn@grouped_gemv)
/// (down, `h` in sorted order) followed by [`combine`](fn@combine): cube `(x, t)` computes output rows
/// `rows_per_cube * x..` of token `t`. Unit `(lane, r, j)` sums chunks `lane, lane + lanes, ..` of row `r`
/// for slot `j`'s assignment `a = positions[t * top_k + j]` (its expert at `experts[a]`) into shared memory;
/// after the barrier one unit per row adds each slot's chunk sums left to right (the GEMV's `y_a`) and folds
/// the slots in slot order, `acc = fma(route_w[t, j], y_a, acc)` from 0.0 (the combine's), rounding once to
/// `F` on the store. The slots run side by side (the `z` units) and no per-assignment output reaches
/// memory: one launch instead of two for each MoE layer of a decode step, where the launch costs more
/// than the arithmetic.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemv_combine<F: Float>(
    h: &[f32],
    table: &[u32],
    positions_at: usize,
    experts_at: usize,
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    route_w: &[F],
    out: &mut [F],
    n_out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    expert_words: usize,
    expert_scales: usize,
    #[comptime] top_k: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] lanes: usize,
    #[comptime] rows_per_cube: usize,
    #[comptime] chunks: usize,
    #[define(F)] _dtype: ElemType,
) {
    let mut part = Shared::<[f32]>::new_slice(comptime!(top_k * rows_per_cube * chunks));
    // The rows are read from `h` in place (a staged copy per slot would not fit beside the sums).
    let unstaged = Shared::<[f32]>::new_slice(1usize);
    let lane = UNIT_POS_X as usize;
    let local_row = UNIT_POS_Y as usize;
    let slot = UNIT_POS_Z as usize;
    let row = CUBE_POS_X as usize * rows_per_cube + local_row;
    let t = CUBE_POS_Y as usize;
    let a = table[positions_at + t * top_k + slot] as usize;
    let expert = table[experts_at + a] as usize;
    let at = (slot * rows_per_cube + local_row) * chunks;
    let per_lane = comptime!(chunks.div_ceil(lanes));
    if row < n_out {
        for i in 0..per_lane {
            let c = lane + i * lanes;
            if c < chunks {
                part[at + c] = chunk_dot(
                    h,
                    a * inn,
                    &unstaged,
                    words,
                    scales,
                    lut,
                    expert * expert_words,
                    expert * expert_scales,
                    row,
                    c * 32,
                    chunk_depth(c, inn),
                    wpr,
                    spr,
                    fmt,
                    group,
                    chunks,
                    false,
                );
            }
        }
    }
    sync_cube();
    if lane == 0 && slot == 0 && row < n_out {
        let mut acc = 0.0f32;
        for j in 0..top_k {
            let y = sum_chunks(&part, (j * rows_per_cube + local_row) * chunks, chunks);
            acc = fma(f32::cast_from(route_w[t * top_k + j]), y, acc);
        }
        out[t * n_out + row] = F::cast_from(acc);
    }
}
