//! The grouped MoE matmul: assignments (token, expert) sorted by expert, one launch over all experts.
//!
//! The host splits each expert's run of sorted assignments into tiles of 16 ([`crate::moe::MoeRouting`]);
//! cube `(x, y)` computes output rows `16x..16x+16` for tile `y`, reading that tile's expert's weights at
//! its word and scale offsets. Gate and up are fused (`swiglu`): both dot products share the staged
//! activations and the result is `silu(gate) * up`. Empty experts have no tiles; nothing is padded.

use cubecl::prelude::*;

use super::weight_at;

/// `y[a, row] = sum_k x[row_index[a], k] w_e[row, k]` for every assignment `a` of tile `CUBE_POS_Y`
/// (expert `e = tile_expert[tile]`), or `silu(gate) * up` when `swiglu` (then `words_b`/`scales_b` are
/// the up projection).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_matmul(
    x: &[f32],
    row_index: &[u32],
    tile_expert: &[u32],
    tile_start: &[u32],
    tile_end: &[u32],
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
) {
    let mut xs = Shared::<[f32]>::new_slice(512usize);
    let mut wa = Shared::<[f32]>::new_slice(512usize);
    let mut wb = Shared::<[f32]>::new_slice(512usize);
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * 16 + tx;
    let tile = CUBE_POS_Y as usize;
    let expert = tile_expert[tile] as usize;
    let a0 = tile_start[tile] as usize;
    let a_end = tile_end[tile] as usize;
    let row0 = CUBE_POS_X as usize * 16;
    let woff = expert * expert_words;
    let soff = expert * expert_scales;
    let mut total_a = 0.0f32;
    let mut total_b = 0.0f32;
    for c in 0..chunks {
        let k0 = c * 32;
        for h in 0..2usize {
            let e = unit + h * 256;
            let r = e / 32;
            let k = k0 + e % 32;
            let mut xv = 0.0f32;
            if a0 + r < a_end && k < inn {
                xv = x[row_index[a0 + r] as usize * inn + k];
            }
            xs[e] = xv;
            let mut va = 0.0f32;
            let mut vb = 0.0f32;
            if row0 + r < n_out && k < inn {
                va = weight_at(
                    words_a,
                    scales_a,
                    lut,
                    woff,
                    soff,
                    row0 + r,
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
                        row0 + r,
                        k,
                        wpr,
                        spr,
                        fmt,
                        group,
                    );
                }
            }
            wa[e] = va;
            wb[e] = vb;
        }
        sync_cube();
        let mut depth = 32usize;
        if k0 + 32 > inn {
            depth = inn - k0;
        }
        let mut part_a = 0.0f32;
        let mut part_b = 0.0f32;
        for kk in 0..depth {
            let xv = xs[ty * 32 + kk];
            part_a = fma(xv, wa[tx * 32 + kk], part_a);
            if comptime!(swiglu) {
                part_b = fma(xv, wb[tx * 32 + kk], part_b);
            }
        }
        total_a += part_a;
        total_b += part_b;
        sync_cube();
    }
    if row0 + tx < n_out && a0 + ty < a_end {
        let mut v = total_a;
        if comptime!(swiglu) {
            v = total_a / (1.0f32 + (-total_a).exp()) * total_b;
        }
        y[(a0 + ty) * n_out + row0 + tx] = v;
    }
}

/// Un-permute and combine: `out[t, c] = sum_j route_w[t, j] * y[pos[t, j], c]` for `j = 0..top_k` in order
/// (fused multiply-adds, no atomics, so the result does not depend on scheduling).
#[cube(launch)]
pub fn combine(
    y: &[f32],
    pos: &[u32],
    route_w: &[f32],
    out: &mut [f32],
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
            let a = pos[t * top_k + j] as usize;
            acc = fma(route_w[t * top_k + j], y[a * hidden + c], acc);
        }
        out[id] = acc;
    }
}
