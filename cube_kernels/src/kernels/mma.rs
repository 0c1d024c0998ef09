//! Tensor-core tiles (`cmma`) for the low-bit dense product on half operands: the order deterministic mode
//! takes with `train.tensor_cores` (rollout and training forward alike), checked and timed by `qarl bench
//! kernels` on GPUs that have the instruction.
//!
//! **Order.** Each output `y[t, row]` is computed the same way whatever the batch: the weight's K axis is
//! cut into steps of 16 inputs (one `m16n16k16` instruction) and into scale groups of `steps_per_scale`
//! steps; per group, an f32 accumulator starts at 0 and takes the group's steps in order on tensor cores
//! (the half activations times the weights' *codes*, which are exact in f16 and bf16: int4 and int8
//! integers, E4M3 and E2M1 values), then the group's sum times the group's f32 scale is added to the
//! output's f32 total, groups left to right; the total is rounded once to the activations' type. A
//! token's row of the instruction never mixes with the other rows, and rows beyond the batch are zeros,
//! so a decode step (one token padded to 16) and a training forward (hundreds of tokens) give the same
//! bits: the K tiling is a property of the weight (its format and group), never of the batch size.
//! The order differs from the canonical f32 order of the other kernels, so rollout and training must
//! both take this kernel for the contract to hold.
//!
//! **Tile.** A cube of 8 planes (32 units each) computes 32 tokens x 64 rows: plane `p` holds the 16 x 16
//! accumulator of token tile `p / 4` and row tile `p % 4`. Per step, the cube stages 32 x 16 activations
//! and 64 x 16 weight codes in shared memory (in the activations' type) and each plane multiplies its
//! pair; `stage_steps` steps are staged per pair of barriers (the launcher takes one on the instruction,
//! the faster on an H200, and as many as the shared memory holds, up to 4, for the scalar twin; see
//! `Kernels::stage_steps`), and they still reach each accumulator
//! one by one in K order (a group's last stage runs only the group's remaining steps), so the bits do
//! not depend on it; per group, the accumulators go through shared memory to the units, which scale and add them.
//!
//! **Staging.** A unit loads whole packed words (8 int4 or fp4 codes, 4 int8 or fp8 codes) and decodes
//! them from a register without integer-to-float conversions
//! ([`super::word_code_value`](fn@super::word_code_value)); the loads of a chunk of steps go out a chunk
//! ahead, into registers, while the tensor cores multiply the chunk before, and are written to shared memory
//! after the next barrier ([`fetch_word`](fn@fetch_word), [`store_word`](fn@store_word)). Bounds are selects,
//! not branches, so a step's loads issue together. The staged values, hence the bits, are the ones a per-code
//! load and decode gives.
//!
//! [`gemm_tiles`](fn@gemm_tiles) without `tensor_cores` is the same tiling, staging and scale groups with
//! scalar FMAs in place of the instruction (any runtime): `cube_kernels/tests/kernels.rs` checks it on
//! lavapipe against the host reference and across batch sizes, which leaves only the instruction itself to
//! the GPU check.

use cubecl::prelude::*;

use super::{code_flip, codes_per_word, scale_at, word_code_value};

/// Tokens, rows and inputs of one tensor-core instruction (`m16n16k16`).
pub const MMA: usize = 16;
/// Token tiles of a cube (32 tokens).
pub const MMA_TOKEN_TILES: usize = 2;
/// Row tiles of a cube (64 rows).
pub const MMA_ROW_TILES: usize = 4;
/// Units per plane the kernel is written for (NVIDIA's warp).
pub const MMA_PLANE: usize = 32;
/// Operand values of one staged K step: the cube's activations (32 tokens x 16) and weight codes (64 rows
/// x 16).
pub const XS_STEP: usize = MMA_TOKEN_TILES * MMA * MMA;
pub const WS_STEP: usize = MMA_ROW_TILES * MMA * MMA;
const _: () = assert!(MMA_ROW_TILES * MMA == STAGED_ROWS);

/// Shared memory [`gemm_tiles`](fn@gemm_tiles) allocates with `stage_steps` staged steps of
/// `operand_bytes`-byte operands (and, on tensor cores, the f32 accumulators' way to the units), alignment
/// padding included.
pub fn gemm_tiles_shared_bytes(
    stage_steps: usize,
    operand_bytes: usize,
    tensor_cores: bool,
) -> usize {
    let stored = if tensor_cores {
        XS_STEP * MMA_ROW_TILES * 4
    } else {
        0
    };
    stage_steps * (XS_STEP + WS_STEP) * operand_bytes + stored + 3 * SHARED_ALIGN
}

/// Byte alignment of every shared array the tiles load from or store to: the instruction's loads and
/// stores (`wmma::load_matrix_sync` / `store_matrix_sync`) want 256-bit aligned pointers, and CubeCL packs
/// shared arrays one after the other aligned only to their element type. Every offset into them is a
/// multiple of a 16 x 16 tile, so aligned starts keep every tile aligned.
pub const SHARED_ALIGN: usize = 32;

/// Packed words of one staged K step's 64 rows x 16 codes: 128 (int4, fp4) or 256 (int8, fp8).
pub const fn staged_words(fmt: u32) -> usize {
    STAGED_ROWS * MMA / codes_per_word(fmt)
}

/// Packed word `wl` (of [`staged_words`]) of the K step at inputs `k0..k0 + 16` of rows `row0..row0 + 64`
/// of the matrix starting at word `woff`, with its codes past `inn` set to 0, or 0 for a row past `out` or
/// `wl` past the step. The load reads word 0 instead of branching around it, so a step's loads issue
/// together and their latencies overlap (a branch per load made each wait for the one before).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn fetch_word(
    words: &[u32],
    woff: usize,
    row0: usize,
    k0: usize,
    out: usize,
    inn: usize,
    wpr: usize,
    wl: usize,
    #[comptime] fmt: u32,
) -> u32 {
    let cpw = comptime!(codes_per_word(fmt));
    let per_row = comptime!(MMA / codes_per_word(fmt));
    let (row, kw) = (row0 + wl / per_row, k0 + (wl % per_row) * cpw);
    let live = wl < comptime!(staged_words(fmt)) && row < out && kw < inn;
    let word = words[select(live, woff + row * wpr + kw / cpw, 0usize)];
    clear_past_inputs(word, kw, inn, live, fmt)
}

/// `word` with its codes at inputs `inn` and beyond cleared (`kw`: the word's first input), or 0 where
/// not `live`: the mask keeps the bits of the codes before `inn` (at most a word's) and zeroes padding,
/// and cleared codes are value 0 in every format (after [`code_flip`](fn@code_flip)). The tiles' and the
/// fragment tiles' staging share it.
#[cube]
pub fn clear_past_inputs(
    word: u32,
    kw: usize,
    inn: usize,
    live: bool,
    #[comptime] fmt: u32,
) -> u32 {
    let cpw = comptime!(codes_per_word(fmt));
    let bits = comptime!(32 / codes_per_word(fmt)) as u32;
    let valid = select(live, inn - kw.min(inn), 0usize).min(cpw);
    let partial = (1u32 << (valid.min(cpw - 1) as u32 * bits)) - 1u32;
    word & select(valid == cpw, 0xFFFF_FFFFu32, partial)
}

/// Decodes packed word `wl` of a staged step ([`fetch_word`](fn@fetch_word)'s) into `ws[ws0..]` (`[row][k]`,
/// 64 rows x 16, in the operand type `X`: exact, the codes are small integers, E4M3 or E2M1 values), each
/// code from the register ([`word_code_value`](fn@word_code_value)) instead of one load and one
/// integer-to-float conversion per code. The codes are stored starting from a lane-dependent one, so the
/// 2-byte stores of a plane's 32 units fall in 32 different banks at each step of the unrolled loop (plain
/// order: 4 (int4) or 2 (int8) units per bank). Units with `wl` past the step store nothing.
#[cube]
pub fn store_word<X: Float>(
    word: u32,
    lut: &[f32],
    ws: &mut Shared<[X]>,
    ws0: usize,
    wl: usize,
    #[comptime] fmt: u32,
) {
    let cpw = comptime!(codes_per_word(fmt));
    let per_row = comptime!(MMA / codes_per_word(fmt));
    if wl < comptime!(staged_words(fmt)) {
        // Words `period` apart start in the same bank: 128 bytes (32 banks) of 2-byte codes.
        let period = comptime!(64 / codes_per_word(fmt));
        let rot = 2 * ((wl % MMA_PLANE) / period) % cpw;
        let at = ws0 + (wl / per_row) * MMA + (wl % per_row) * cpw;
        let flipped = word ^ code_flip(fmt);
        #[unroll]
        for j in 0..cpw {
            let jj = (j + rot) % cpw;
            ws[at + jj] = X::cast_from(word_code_value(flipped, jj as u32, lut, fmt));
        }
    }
}

/// Passes of `units` units over one staged step's packed words ([`staged_words`]).
pub const fn word_passes(fmt: u32, units: usize) -> usize {
    staged_words(fmt).div_ceil(units)
}

/// Weight rows one staged K step covers: 64, the dense and the MoE tiles' four row tiles.
pub const STAGED_ROWS: usize = 64;

/// Units of a cube of the dense tiles: 8 planes.
const UNITS: usize = MMA_TOKEN_TILES * MMA_ROW_TILES * MMA_PLANE;

/// Tokens whose inputs a unit stages at every step: 2, `unit / 16` and `unit / 16 + 16`, at input
/// `unit % 16` of the step.
const TOKENS_PER_UNIT: usize = XS_STEP / UNITS;

/// Loads K steps `s0..last` (at most `stage_steps` of them) of the cube's tile into the unit's registers,
/// step `d` at `d * passes..` of `held_w` and `d * TOKENS_PER_UNIT..` of `held_x`: its packed words of the
/// weight ([`fetch_word`]) and its inputs. No branch separates a step's loads, and [`gemm_tiles`] issues them a
/// chunk ahead (while the tensor cores work on the previous one), so their latencies overlap each other
/// and the arithmetic.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_steps<I: Float>(
    x: &[I],
    words: &[u32],
    held_w: &mut Array<u32>,
    held_x: &mut Array<I>,
    s0: usize,
    last: usize,
    tok0: usize,
    row0: usize,
    n: usize,
    out: usize,
    inn: usize,
    wpr: usize,
    #[comptime] fmt: u32,
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
                held_w[d * passes + p] =
                    fetch_word(words, 0, row0, k0, out, inn, wpr, unit + p * UNITS, fmt);
            }
            let k = k0 + unit % MMA;
            #[unroll]
            for h in 0..TOKENS_PER_UNIT {
                let t = tok0 + unit / MMA + h * (UNITS / MMA);
                held_x[d * TOKENS_PER_UNIT + h] = x[select(t < n && k < inn, t * inn + k, 0usize)];
            }
        }
    }
}

/// Stores the steps `s0..last` that [`fetch_steps`] loaded into shared memory slots 0, 1, ... (of the
/// kernel's `stage_steps`), in the operands' type `X`: 32 tokens x 16 inputs (row-major, rounded from the
/// input type `I`; zeros past the batch or the inputs) and 64 rows x 16 weight codes (`[row][k]`,
/// [`store_word`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_steps<I: Float, X: Float>(
    held_w: &Array<u32>,
    held_x: &Array<I>,
    lut: &[f32],
    xs: &mut Shared<[X]>,
    ws: &mut Shared<[X]>,
    s0: usize,
    last: usize,
    tok0: usize,
    n: usize,
    inn: usize,
    #[comptime] fmt: u32,
    #[comptime] stage_steps: usize,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let passes = comptime!(word_passes(fmt, UNITS));
    #[unroll]
    for d in 0..stage_steps {
        if s0 + d < last {
            let (xs0, ws0) = (d * XS_STEP, d * WS_STEP);
            let k = (s0 + d) * MMA + unit % MMA;
            #[unroll]
            for h in 0..TOKENS_PER_UNIT {
                let t = tok0 + unit / MMA + h * (UNITS / MMA);
                let v = X::cast_from(held_x[d * TOKENS_PER_UNIT + h]);
                xs[xs0 + unit + h * UNITS] = select(t < n && k < inn, v, X::from_int(0));
            }
            #[unroll]
            for p in 0..passes {
                store_word(held_w[d * passes + p], lut, ws, ws0, unit + p * UNITS, fmt);
            }
        }
    }
}

/// The chunk of steps after the one at `s0` of a scale group ending at `last`: the group's next chunk of
/// at most `stage_steps`, or the next group's first; empty past `steps`. The tiles load it while they
/// multiply the chunk at `s0`.
#[cube]
pub fn next_chunk(
    s0: usize,
    last: usize,
    steps: usize,
    steps_per_scale: usize,
    #[comptime] stage_steps: usize,
) -> (usize, usize) {
    let mut next = (s0 + stage_steps, last);
    if s0 + stage_steps >= last {
        next = (last, (last + steps_per_scale).min(steps));
    }
    next
}

/// One chunk's turn in [`gemm_tiles`]' K loop: stores the chunk at `s0` that the registers hold
/// ([`store_steps`]), waits for the cube, and loads the next chunk ([`next_chunk`]) into the registers
/// ([`fetch_steps`]), so its loads fly while the caller multiplies the chunk just staged.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_chunk<I: Float, X: Float>(
    x: &[I],
    words: &[u32],
    lut: &[f32],
    held_w: &mut Array<u32>,
    held_x: &mut Array<I>,
    xs: &mut Shared<[X]>,
    ws: &mut Shared<[X]>,
    s0: usize,
    last: usize,
    steps: usize,
    steps_per_scale: usize,
    tok0: usize,
    row0: usize,
    n: usize,
    out: usize,
    inn: usize,
    wpr: usize,
    #[comptime] fmt: u32,
    #[comptime] stage_steps: usize,
) {
    store_steps(
        &*held_w,
        &*held_x,
        lut,
        xs,
        ws,
        s0,
        last,
        tok0,
        n,
        inn,
        fmt,
        stage_steps,
    );
    sync_cube();
    let (n0, n_last) = next_chunk(s0, last, steps, steps_per_scale, stage_steps);
    fetch_steps(
        x,
        words,
        held_w,
        held_x,
        n0,
        n_last,
        tok0,
        row0,
        n,
        out,
        inn,
        wpr,
        fmt,
        stage_steps,
    );
}

/// Element `lane + 32 j` of the plane's 16 x 16 tile (row-major: token `e / 16`, weight row `e % 16`).
#[cube]
pub fn tile_element(lane: usize, j: usize) -> usize {
    lane + MMA_PLANE * j
}

/// Adds a scale group's sums (the unit's 8 elements of its plane's 16 x 16 tile, whose rows start at
/// `row_base`) times their rows' scales (of the matrix starting at scale `soff`) to the totals:
/// `total += sum * scale`, groups left to right. The dense and the MoE tiles share it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_scaled_group(
    total: &mut Array<f32>,
    sums: &Array<f32>,
    scales: &[f32],
    soff: usize,
    row_base: usize,
    k: usize,
    out: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
) {
    let lane = UNIT_POS_X as usize;
    #[unroll]
    for j in 0..8usize {
        let r = row_base + tile_element(lane, j) % MMA;
        if r < out {
            total[j] += sums[j] * scale_at(scales, soff, r, k, spr, fmt, group);
        }
    }
}

/// Stores the unit's 8 totals, rounded once to `Y`.
#[cube]
fn store_totals<Y: Float>(
    y: &mut [Y],
    total: &Array<f32>,
    tok0: usize,
    row0: usize,
    n: usize,
    out: usize,
) {
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tok_tile = plane / MMA_ROW_TILES;
    let row_tile = plane % MMA_ROW_TILES;
    #[unroll]
    for j in 0..8usize {
        let e = tile_element(lane, j);
        let t = tok0 + tok_tile * MMA + e / MMA;
        let r = row0 + row_tile * MMA + e % MMA;
        if t < n && r < out {
            y[t * out + r] = Y::cast_from(total[j]);
        }
    }
}

/// `y[t, row] = sum_k x[t, k] w[row, k]` in the order of the module doc: on tensor cores when
/// `tensor_cores`, else with scalar fused multiply-adds in place of the instruction (each group's sum over
/// its inputs in order from 0: any runtime and operand type, f32 included; the same tiling, staging and
/// scale groups, other bits than the instruction's, batch-invariant in the same way, which lets the tiles'
/// indexing be tested on lavapipe). `I` is the input buffer's type, `X` the operands' (half for the
/// instruction; the input is rounded to it as it is staged, exact when `I` is f32 holding widened `X`
/// values), `Y` the output's. Launch with `CubeDim (32, 8)` and `CubeCount (ceil(out / 64), ceil(n / 32))`;
/// `steps = ceil(inn / 16)`.
#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn gemm_tiles<I: Float, X: Float, Y: Float>(
    x: &[I],
    words: &[u32],
    scales: &[f32],
    lut: &[f32],
    y: &mut [Y],
    n: usize,
    out: usize,
    inn: usize,
    wpr: usize,
    spr: usize,
    steps: usize,
    steps_per_scale: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] tensor_cores: bool,
    #[comptime] stage_steps: usize,
    #[define(I, X, Y)] _dtypes: [ElemType; 3],
) {
    let mut xs = Shared::<[X]>::new_aligned_slice(comptime!(stage_steps * XS_STEP), SHARED_ALIGN);
    let mut ws = Shared::<[X]>::new_aligned_slice(comptime!(stage_steps * WS_STEP), SHARED_ALIGN);
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let tok_tile = plane / MMA_ROW_TILES;
    let row_tile = plane % MMA_ROW_TILES;
    let tok0 = CUBE_POS_Y as usize * (MMA_TOKEN_TILES * MMA);
    let row0 = CUBE_POS_X as usize * (MMA_ROW_TILES * MMA);
    let tile = MMA * MMA;
    let mut total = Array::<f32>::new(8usize);
    let mut sums = Array::<f32>::new(8usize);
    #[unroll]
    for j in 0..8usize {
        total[j] = 0.0f32;
    }
    // The registers a chunk of steps is loaded into a chunk ahead ([`fetch_steps`]); the first chunk's
    // loads go out here.
    let passes = comptime!(word_passes(fmt, UNITS));
    let mut held_w = Array::<u32>::new(comptime!(stage_steps * passes));
    let mut held_x = Array::<I>::new(comptime!(stage_steps * TOKENS_PER_UNIT));
    fetch_steps(
        x,
        words,
        &mut held_w,
        &mut held_x,
        0,
        steps_per_scale.min(steps),
        tok0,
        row0,
        n,
        out,
        inn,
        wpr,
        fmt,
        stage_steps,
    );
    if comptime!(tensor_cores) {
        let mut stored = Shared::<[f32]>::new_aligned_slice(
            MMA_TOKEN_TILES * MMA_ROW_TILES * MMA * MMA,
            SHARED_ALIGN,
        );
        let mut acc = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            MMA,
            MMA,
            MMA,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        );
        let groups = steps.div_ceil(steps_per_scale);
        for g in 0..groups {
            cmma::fill(&mut acc, 0.0f32);
            let first = g * steps_per_scale;
            let last = (first + steps_per_scale).min(steps);
            for c in 0..(last - first).div_ceil(stage_steps) {
                let s0 = first + c * stage_steps;
                stage_chunk(
                    x,
                    words,
                    lut,
                    &mut held_w,
                    &mut held_x,
                    &mut xs,
                    &mut ws,
                    s0,
                    last,
                    steps,
                    steps_per_scale,
                    tok0,
                    row0,
                    n,
                    out,
                    inn,
                    wpr,
                    fmt,
                    stage_steps,
                );
                for d in 0..stage_steps {
                    if s0 + d < last {
                        let xa = d * XS_STEP + tok_tile * tile;
                        let wa = d * WS_STEP + row_tile * tile;
                        let a = cmma::Matrix::<X>::from_slice(
                            cmma::MatrixIdent::A,
                            MMA,
                            MMA,
                            MMA,
                            cmma::MatrixLayout::RowMajor,
                            &xs[xa..xa + tile],
                            MMA as u32,
                        );
                        let b = cmma::Matrix::<X>::from_slice(
                            cmma::MatrixIdent::B,
                            MMA,
                            MMA,
                            MMA,
                            cmma::MatrixLayout::ColMajor,
                            &ws[wa..wa + tile],
                            MMA as u32,
                        );
                        cmma::execute(&a, &b, &acc, &acc);
                    }
                }
                sync_cube();
            }
            cmma::store(
                &mut stored[plane * tile..plane * tile + tile],
                &acc,
                MMA as u32,
                cmma::MatrixLayout::RowMajor,
            );
            sync_cube();
            #[unroll]
            for j in 0..8usize {
                sums[j] = stored[plane * tile + tile_element(lane, j)];
            }
            add_scaled_group(
                &mut total,
                &sums,
                scales,
                0,
                row0 + row_tile * MMA,
                first * MMA,
                out,
                spr,
                fmt,
                group,
            );
            sync_cube();
        }
    } else {
        let groups = steps.div_ceil(steps_per_scale);
        for g in 0..groups {
            #[unroll]
            for j in 0..8usize {
                sums[j] = 0.0f32;
            }
            let first = g * steps_per_scale;
            let last = (first + steps_per_scale).min(steps);
            for c in 0..(last - first).div_ceil(stage_steps) {
                let s0 = first + c * stage_steps;
                stage_chunk(
                    x,
                    words,
                    lut,
                    &mut held_w,
                    &mut held_x,
                    &mut xs,
                    &mut ws,
                    s0,
                    last,
                    steps,
                    steps_per_scale,
                    tok0,
                    row0,
                    n,
                    out,
                    inn,
                    wpr,
                    fmt,
                    stage_steps,
                );
                for d in 0..stage_steps {
                    if s0 + d < last {
                        #[unroll]
                        for j in 0..8usize {
                            let e = tile_element(lane, j);
                            let xa = d * XS_STEP + tok_tile * tile + (e / MMA) * MMA;
                            let wa = d * WS_STEP + row_tile * tile + (e % MMA) * MMA;
                            for kk in 0..MMA {
                                sums[j] = fma(
                                    f32::cast_from(xs[xa + kk]),
                                    f32::cast_from(ws[wa + kk]),
                                    sums[j],
                                );
                            }
                        }
                    }
                }
                sync_cube();
            }
            add_scaled_group(
                &mut total,
                &sums,
                scales,
                0,
                row0 + row_tile * MMA,
                first * MMA,
                out,
                spr,
                fmt,
                group,
            );
        }
    }
    store_totals(y, &total, tok0, row0, n, out);
}
