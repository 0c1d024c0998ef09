//! Dense quantized matmuls: dequantize, GEMV (few tokens), tiled GEMM (many tokens) and the transposed
//! product of the straight-through backward, all from the same packed weights.
//!
//! The matmuls are generic over the activations' element types (see [`super`]'s precision contract): `X`
//! is what they read (the activations, or f32 values prepared from them), `Y` what they write; both are
//! chosen at launch (`#[define(X, Y)]`). Sums are f32 whatever `X` and `Y` are.

use cubecl::prelude::*;

use super::{
    chunk_depth, chunk_dot, stage_depth, stage_transposed, sum_chunks, weight_at, BLOCK,
    STAGE_FLOATS, STAGE_STRIDE, TILE_FLOATS, TILE_STRIDE,
};

/// `out[row * inn + k] = weight(row, k)` for the whole matrix (one unit per weight).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn dequantize(
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    out: &mut [f32],
    rows: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
) {
    let id = ABSOLUTE_POS;
    if id < rows * inn {
        let row = id / inn;
        let k = id % inn;
        out[id] = weight_at(words, scales, lut, 0, 0, row, k, wpr, spr, fmt, group);
    }
}

/// `y[t, row] = sum_k x[t, k] w[row, k]` for few tokens: a cube holds `rows_per_cube` rows of one token
/// (`CUBE_POS_Y`); the `lanes` units of a row sum chunks in parallel into shared memory, then lane 0 adds
/// the chunk sums left to right (the canonical order). With `stage_x` the token's activations are first
/// staged in shared memory ([`stage_transposed`](fn@stage_transposed)), where the lanes read them without
/// bank conflicts.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gemv<X: Float, Y: Float>(
    x: &[X],
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    y: &mut [Y],
    out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] lanes: usize,
    #[comptime] rows_per_cube: usize,
    #[comptime] chunks: usize,
    #[comptime] stage_x: bool,
    #[define(X, Y)] _dtypes: [ElemType; 2],
) {
    let mut partials = Shared::<[f32]>::new_slice(rows_per_cube * chunks);
    let mut xs = Shared::<[f32]>::new_slice(comptime!(if stage_x { 32 * (chunks + 1) } else { 1 }));
    let lane = UNIT_POS_X as usize;
    let local_row = UNIT_POS_Y as usize;
    let row = CUBE_POS_X as usize * rows_per_cube + local_row;
    let token = CUBE_POS_Y as usize;
    if comptime!(stage_x) {
        stage_transposed(
            x,
            token * inn,
            inn,
            &mut xs,
            0,
            local_row * lanes + lane,
            lanes * rows_per_cube,
            chunks,
        );
        sync_cube();
    }
    let per_lane = comptime!(chunks.div_ceil(lanes));
    if row < out {
        for i in 0..per_lane {
            let c = lane + i * lanes;
            if c < chunks {
                partials[local_row * chunks + c] = chunk_dot(
                    x,
                    token * inn,
                    &xs,
                    words,
                    scales,
                    lut,
                    0,
                    0,
                    row,
                    c * 32,
                    chunk_depth(c, inn),
                    wpr,
                    spr,
                    fmt,
                    group,
                    chunks,
                    stage_x,
                );
            }
        }
    }
    sync_cube();
    if lane == 0 && row < out {
        y[token * out + row] = Y::cast_from(sum_chunks(&partials, local_row * chunks, chunks));
    }
}

/// `y[t, row] = sum_k x[t, k] w[row, k]` tiled: a cube of 16 x 16 units computes a 64 x 64 (tokens x rows)
/// tile, each unit a 4 x 4 block of it (tokens `ty + 16 i`, rows `tx + 16 j`) in registers. Activations and
/// dequantized weights are staged 16 inputs deep at a time (two stages per 32-input chunk), k-major at a
/// stride of 65 floats so both the staging writes and the block reads stay clear of bank conflicts. Each
/// output keeps its chunk's sum and the running total apart, so the order is the canonical one (fused
/// multiply-adds over the chunk from 0.0, chunk sums added left to right) and the bits are the GEMV's.
/// Per input step a unit reads 8 staged floats for 16 multiply-adds, where a 16 x 16 tile of single
/// outputs read 2 for 1.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gemm_blocked<X: Float, Y: Float>(
    x: &[X],
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    y: &mut [Y],
    n: usize,
    out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] chunks: usize,
    #[define(X, Y)] _dtypes: [ElemType; 2],
) {
    let mut xs = Shared::<[f32]>::new_slice(STAGE_FLOATS);
    let mut ws = Shared::<[f32]>::new_slice(STAGE_FLOATS);
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * 16 + tx;
    let row0 = CUBE_POS_X as usize * BLOCK;
    let tok0 = CUBE_POS_Y as usize * BLOCK;
    let mut part = Array::<f32>::new(16usize);
    let mut total = Array::<f32>::new(16usize);
    #[unroll]
    for o in 0..16usize {
        total[o] = 0.0f32;
    }
    for c in 0..chunks {
        let k0 = c * 32;
        let depth = chunk_depth(c, inn);
        #[unroll]
        for o in 0..16usize {
            part[o] = 0.0f32;
        }
        for st in 0..2usize {
            let ks = k0 + st * 16;
            #[unroll]
            for h in 0..4usize {
                let e = unit + h * 256;
                let r = e / 16;
                let kk = e % 16;
                let k = ks + kk;
                let mut xv = 0.0f32;
                if tok0 + r < n && k < inn {
                    xv = f32::cast_from(x[(tok0 + r) * inn + k]);
                }
                xs[kk * STAGE_STRIDE + r] = xv;
                let mut wv = 0.0f32;
                if row0 + r < out && k < inn {
                    wv = weight_at(words, scales, lut, 0, 0, row0 + r, k, wpr, spr, fmt, group);
                }
                ws[kk * STAGE_STRIDE + r] = wv;
            }
            sync_cube();
            for kk in 0..stage_depth(depth, st) {
                let base = kk * STAGE_STRIDE;
                #[unroll]
                for i in 0..4usize {
                    let a = xs[base + ty + 16 * i];
                    #[unroll]
                    for j in 0..4usize {
                        part[i * 4 + j] = fma(a, ws[base + tx + 16 * j], part[i * 4 + j]);
                    }
                }
            }
            sync_cube();
        }
        #[unroll]
        for o in 0..16usize {
            total[o] += part[o];
        }
    }
    #[unroll]
    for i in 0..4usize {
        #[unroll]
        for j in 0..4usize {
            let t = tok0 + ty + 16 * i;
            let r = row0 + tx + 16 * j;
            if t < n && r < out {
                y[t * out + r] = Y::cast_from(total[i * 4 + j]);
            }
        }
    }
}

/// `y[t, row] = sum_k x[t, k] w[row, k]` tiled: a cube computes a 16x16 (tokens x rows) tile, one output
/// per unit, staging one 32-deep chunk of activations and dequantized weights in shared memory at a time.
/// Four times the cubes of [`gemm_blocked`](fn@gemm_blocked) for a shape: what a matrix too small to fill the
/// device with 64 x 64 blocks runs (on an H200, [768, 2048] weights at 256 tokens: 165 us here, 201 us in 48
/// blocks).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gemm_tile<X: Float, Y: Float>(
    x: &[X],
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    y: &mut [Y],
    n: usize,
    out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] chunks: usize,
    #[define(X, Y)] _dtypes: [ElemType; 2],
) {
    let mut xs = Shared::<[f32]>::new_slice(TILE_FLOATS);
    let mut ws = Shared::<[f32]>::new_slice(TILE_FLOATS);
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * 16 + tx;
    let row0 = CUBE_POS_X as usize * 16;
    let tok0 = CUBE_POS_Y as usize * 16;
    let mut total = 0.0f32;
    for c in 0..chunks {
        let k0 = c * 32;
        for h in 0..2usize {
            let e = unit + h * 256;
            let r = e / 32;
            let k = k0 + e % 32;
            let at = r * TILE_STRIDE + e % 32;
            let mut xv = 0.0f32;
            if tok0 + r < n && k < inn {
                xv = f32::cast_from(x[(tok0 + r) * inn + k]);
            }
            xs[at] = xv;
            let mut wv = 0.0f32;
            if row0 + r < out && k < inn {
                wv = weight_at(words, scales, lut, 0, 0, row0 + r, k, wpr, spr, fmt, group);
            }
            ws[at] = wv;
        }
        sync_cube();
        let depth = chunk_depth(c, inn);
        let mut part = 0.0f32;
        for kk in 0..depth {
            part = fma(xs[ty * TILE_STRIDE + kk], ws[tx * TILE_STRIDE + kk], part);
        }
        total += part;
        sync_cube();
    }
    if row0 + tx < out && tok0 + ty < n {
        y[(tok0 + ty) * out + row0 + tx] = Y::cast_from(total);
    }
}

/// The straight-through backward's input gradient `dx[t, k] = sum_row g[t, row] w[row, k]`, tiled 16x16
/// (tokens x inputs), reducing over rows in 32-deep chunks (the canonical order over the row axis).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gemm_transposed<X: Float, Y: Float>(
    g: &[X],
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    dx: &mut [Y],
    n: usize,
    out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] chunks: usize,
    #[define(X, Y)] _dtypes: [ElemType; 2],
) {
    let mut gs = Shared::<[f32]>::new_slice(TILE_FLOATS);
    let mut ws = Shared::<[f32]>::new_slice(512usize);
    let col0 = CUBE_POS_X as usize * 16;
    let tok0 = CUBE_POS_Y as usize * 16;
    let total = transposed_share::<X>(
        g,
        words,
        scales,
        lut,
        &mut gs,
        &mut ws,
        tok0,
        n - tok0,
        col0,
        0,
        0,
        out,
        inn,
        wpr,
        spr,
        fmt,
        group,
        chunks,
    );
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    if col0 + tx < inn && tok0 + ty < n {
        dx[(tok0 + ty) * inn + col0 + tx] = Y::cast_from(total);
    }
}

/// One weight's share of a transposed product tile ([`gemm_transposed`](fn@gemm_transposed), the grouped MoE
/// backward's `grouped_transposed`) for unit `(tx, ty)`: `sum_o g[start + ty, o] W[o, col0 + tx]` (`g`
/// widened to f32; rows past `rows` read as 0)
/// over the `out` rows of the expert's weight at `woff`/`soff`, in 32-deep chunks (fused multiply-adds from
/// 0 per chunk, chunk sums added left to right). Every unit of the cube calls it (it syncs the cube).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn transposed_share<X: Float>(
    g: &[X],
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    gs: &mut Shared<[f32]>,
    ws: &mut Shared<[f32]>,
    start: usize,
    rows: usize,
    col0: usize,
    woff: usize,
    soff: usize,
    out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] chunks: usize,
) -> f32 {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * 16 + tx;
    let mut total = 0.0f32;
    for c in 0..chunks {
        let o0 = c * 32;
        for half in 0..2usize {
            let i = unit + half * 256;
            let r = i / 32;
            let o = o0 + i % 32;
            let mut gv = 0.0f32;
            if r < rows && o < out {
                gv = f32::cast_from(g[(start + r) * out + o]);
            }
            gs[r * TILE_STRIDE + i % 32] = gv;
            let wo = o0 + i / 16;
            let wk = col0 + i % 16;
            let mut wv = 0.0f32;
            if wo < out && wk < inn {
                wv = weight_at(words, scales, lut, woff, soff, wo, wk, wpr, spr, fmt, group);
            }
            ws[i] = wv;
        }
        sync_cube();
        let depth = chunk_depth(c, out);
        let mut part = 0.0f32;
        // Whole chunks unrolled (the same multiply-adds in the same order): a runtime loop here took 32
        // of the 65535 loop iterations Mesa's llvmpipe allows a shader invocation per chunk, so a weight
        // of more than 61k rows (a large vocabulary's LM head) came back part-summed on lavapipe.
        if depth == 32 {
            #[unroll]
            for oo in 0..32usize {
                part = fma(gs[ty * TILE_STRIDE + oo], ws[oo * 16 + tx], part);
            }
        } else {
            for oo in 0..depth {
                part = fma(gs[ty * TILE_STRIDE + oo], ws[oo * 16 + tx], part);
            }
        }
        total += part;
        sync_cube();
    }
    total
}

/// `dst[i] = src[i]`, grid-stride (`stride` = units launched), the copy whose bandwidth the benchmarks
/// report as the roofline.
#[cube(launch)]
pub fn copy(src: &[f32], dst: &mut [f32], len: usize, stride: usize, #[comptime] steps: usize) {
    for s in 0..steps {
        let id = ABSOLUTE_POS + s * stride;
        if id < len {
            dst[id] = src[id];
        }
    }
}
