//! The grouped MoE block's training kernels: the pieces of its forward that the backward reads, and the
//! backward itself, on the routing table of [`super::moe`] (assignments sorted by expert, tiles of 16).
//!
//! The training forward computes the gate and up products with the grouped kernels of [`super::moe`] as two
//! plain launches instead of the fused SwiGLU one (the same canonical dot products, so the same bits) and
//! keeps them, then [`swiglu_rows`](fn@swiglu_rows) forms `h = silu(g) * u` with the contract's own
//! [`silu_times`](fn@silu_times): the block's output is bit for bit the rollout's. The backward is free of
//! the rollout contract but sums in fixed orders (never by scheduling or atomics), so a run repeats exactly:
//! - [`combine_backward`](fn@combine_backward), [`route_weight_grad`](fn@route_weight_grad): through the
//!   combine `out[t] = sum_j w[t, j] y[pos(t, j)]`;
//! - [`swiglu_backward_rows`](fn@swiglu_backward_rows): through `h = silu(g) * u`;
//! - [`grouped_transposed`](fn@grouped_transposed): `dx_a = g_a · dequant(W_e)` per sorted assignment `a` of
//!   expert `e` (the straight-through input gradient, from the same packed weights), optionally for two
//!   weights at once (gate and up feed one input);
//! - [`grouped_weight_grad`](fn@grouped_weight_grad): `dW_e = input_e^T g_e` over each expert's assignments
//!   (the straight-through gradient of the f32 master, in its `[in, out]` layout);
//! - [`sum_assignments`](fn@sum_assignments): the sorted input gradients back to their tokens.

use cubecl::prelude::*;

use super::dense::transposed_share;
use super::moe::silu_times;
use super::{TILE_FLOATS, TILE_STRIDE};

/// `h[i] = silu(g[i]) * u[i]` by [`silu_times`](fn@silu_times), the fused gate+up kernel's own arithmetic.
#[cube(launch, create_dummy_kernel)]
pub fn swiglu_rows(g: &[f32], u: &[f32], h: &mut [f32], len: usize) {
    let id = ABSOLUTE_POS;
    if id < len {
        h[id] = silu_times(g[id], u[id]);
    }
}

/// Through the combine: `dy[pos(t, j), c] = route_w[t, j] * d_out[t, c]` (every sorted assignment is some
/// `(t, j)`, so every `dy` value is written once).
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn combine_backward(
    d_out: &[f32],
    table: &[u32],
    pos_at: usize,
    route_w: &[f32],
    dy: &mut [f32],
    tokens: usize,
    hidden: usize,
    top_k: usize,
) {
    let id = ABSOLUTE_POS;
    if id < tokens * top_k * hidden {
        let tj = id / hidden;
        let c = id % hidden;
        let t = tj / top_k;
        let a = table[pos_at + tj] as usize;
        dy[a * hidden + c] = route_w[tj] * d_out[t * hidden + c];
    }
}

/// The routing weights' gradient: `d_w[t, j] = sum_c d_out[t, c] * y[pos(t, j), c]`, `c` in order, fused
/// multiply-adds from 0.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn route_weight_grad(
    d_out: &[f32],
    y: &[f32],
    table: &[u32],
    pos_at: usize,
    d_w: &mut [f32],
    tokens: usize,
    hidden: usize,
    top_k: usize,
) {
    let tj = ABSOLUTE_POS;
    if tj < tokens * top_k {
        let t = tj / top_k;
        let a = table[pos_at + tj] as usize;
        let mut acc = 0.0f32;
        for c in 0..hidden {
            acc = fma(d_out[t * hidden + c], y[a * hidden + c], acc);
        }
        d_w[tj] = acc;
    }
}

/// Through `h = silu(g) * u` with `s = 1 / (1 + exp(-g))`: `du = dh * g * s` and
/// `dg = dh * u * s * (1 + g * (1 - s))`.
#[cube(launch, create_dummy_kernel)]
pub fn swiglu_backward_rows(
    g: &[f32],
    u: &[f32],
    dh: &[f32],
    dg: &mut [f32],
    du: &mut [f32],
    len: usize,
) {
    let id = ABSOLUTE_POS;
    if id < len {
        let gv = g[id];
        let s = 1.0f32 / (1.0f32 + (-gv).exp());
        let d = dh[id];
        du[id] = d * gv * s;
        dg[id] = d * u[id] * s * (1.0f32 + gv * (1.0f32 - s));
    }
}

/// The grouped straight-through input gradient: for the sorted assignments `a` of tile `CUBE_POS_Y` (expert
/// `e`), `dx[a, k] = sum_o g1[a, o] W1_e[o, k]` (`+ sum_o g2[a, o] W2_e[o, k]` when `two`, added after),
/// `k` in `16 CUBE_POS_X..+16`. `g1`, `g2`, `dx` are f32 in sorted order; both weights share one format and
/// shape (`out` rows of `inn`). Empty tiles write nothing.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_transposed(
    g1: &[f32],
    words1: &[u32],
    scales1: &[f32],
    g2: &[f32],
    words2: &[u32],
    scales2: &[f32],
    lut: &[f32],
    table: &[u32],
    dx: &mut [f32],
    out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    expert_words: usize,
    expert_scales: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] chunks: usize,
    #[comptime] two: bool,
) {
    let mut gs = Shared::<[f32]>::new_slice(TILE_FLOATS);
    let mut ws = Shared::<[f32]>::new_slice(512usize);
    let tile = CUBE_POS_Y as usize;
    let e = table[3 * tile] as usize;
    let start = table[3 * tile + 1] as usize;
    let rows = table[3 * tile + 2] as usize - start;
    let col0 = CUBE_POS_X as usize * 16;
    let woff = e * expert_words;
    let soff = e * expert_scales;
    let mut total = transposed_share(
        g1, words1, scales1, lut, &mut gs, &mut ws, start, rows, col0, woff, soff, out, inn, wpr,
        spr, fmt, group, chunks,
    );
    if comptime!(two) {
        total += transposed_share(
            g2, words2, scales2, lut, &mut gs, &mut ws, start, rows, col0, woff, soff, out, inn,
            wpr, spr, fmt, group, chunks,
        );
    }
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    if ty < rows && col0 + tx < inn {
        dx[(start + ty) * inn + col0 + tx] = total;
    }
}

/// The grouped straight-through weight gradient, in the master's `[in, out]` layout: for expert
/// `e = CUBE_POS_Z`, `dw[e, k, r] = sum_a input[src(a), k] g[a, r]` over its sorted assignments `a`
/// (`offsets[e]..offsets[e + 1]` at `offsets_at`), 32 at a time (fused multiply-adds from 0 per chunk, chunk
/// sums added left to right); `src(a)` is the token `table[rows_at + a]` when `gather`, else `a` (an input
/// already in sorted order). Unit `(tx, ty)` of cube `(x, y)` computes `r = 16 x + tx`, `k = 16 y + ty`. An
/// expert without assignments gets zeros.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_weight_grad(
    input: &[f32],
    g: &[f32],
    table: &[u32],
    rows_at: usize,
    offsets_at: usize,
    dw: &mut [f32],
    inn: usize,
    out: usize,
    #[comptime] gather: bool,
) {
    let mut xs = Shared::<[f32]>::new_slice(TILE_FLOATS);
    let mut gs = Shared::<[f32]>::new_slice(TILE_FLOATS);
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * 16 + tx;
    let r0 = CUBE_POS_X as usize * 16;
    let k0 = CUBE_POS_Y as usize * 16;
    let e = CUBE_POS_Z as usize;
    let first = table[offsets_at + e] as usize;
    let last = table[offsets_at + e + 1] as usize;
    // `div_ceil` has no CubeCL expansion for runtime values.
    #[allow(clippy::manual_div_ceil)]
    let chunks = (last - first + 31) / 32;
    let mut total = 0.0f32;
    // The inner loops unrolled here rather than left to the driver: Mesa's llvmpipe (lavapipe) counts
    // every loop iteration of a shader invocation against 65535 and stops short past it, so an expert's
    // chunks are the only loop that grows with the call.
    for c in 0..chunks {
        let a0 = first + c * 32;
        #[unroll]
        for half in 0..2usize {
            let i = unit + half * 256;
            let aa = i / 16;
            let j = i % 16;
            let a = a0 + aa;
            let mut xv = 0.0f32;
            let mut gv = 0.0f32;
            if a < last {
                let mut src = a;
                if comptime!(gather) {
                    src = table[rows_at + a] as usize;
                }
                if k0 + j < inn {
                    xv = input[src * inn + k0 + j];
                }
                if r0 + j < out {
                    gv = g[a * out + r0 + j];
                }
            }
            xs[j * TILE_STRIDE + aa] = xv;
            gs[j * TILE_STRIDE + aa] = gv;
        }
        sync_cube();
        let mut part = 0.0f32;
        #[unroll]
        for aa in 0..32usize {
            part = fma(xs[ty * TILE_STRIDE + aa], gs[tx * TILE_STRIDE + aa], part);
        }
        total += part;
        sync_cube();
    }
    if k0 + ty < inn && r0 + tx < out {
        dw[(e * inn + k0 + ty) * out + r0 + tx] = total;
    }
}

/// Back to the tokens: `dx[t, c] = sum_j d_sorted[pos(t, j), c]`, slots in order from 0.0 (what the
/// combine's backward is for the input gradient; no atomics).
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn sum_assignments(
    d_sorted: &[f32],
    table: &[u32],
    pos_at: usize,
    dx: &mut [f32],
    tokens: usize,
    hidden: usize,
    top_k: usize,
) {
    let id = ABSOLUTE_POS;
    if id < tokens * hidden {
        let t = id / hidden;
        let c = id % hidden;
        let mut acc = 0.0f32;
        for j in 0..top_k {
            let a = table[pos_at + t * top_k + j] as usize;
            acc += d_sorted[a * hidden + c];
        }
        dx[id] = acc;
    }
}
