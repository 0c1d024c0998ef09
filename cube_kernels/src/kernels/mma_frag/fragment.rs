//! The fragment tiles' registers: each unit's `m16n8k16` A, B and accumulator fragments in the PTX ISA's
//! layout, the instruction (or, for the scalar twin, its emulation from those registers), and the scale
//! groups applied to the accumulators.

use cubecl::prelude::*;

use super::super::mma::{MMA, MMA_PLANE};
use super::super::{code_flip, codes_per_word, scale_at, word_code_value};
use super::staging::{staged_x_stride, w_stride};
use super::{fragment_index, row_plane, FragCube, PairDecode, EXCHANGE_REGS, N8};

/// The unit's A fragments of staged step `s` (of the buffer at `base`), one per tile of 16
/// assignments of the cube (registers `4 m .. 4 m + 4` for tile `m`), in the `m16n8k16` register
/// layout: with `g = lane / 4`, `t = lane % 4`, registers (row g, inputs 2t, 2t+1), (row g + 8, same),
/// (row g, inputs 2t + 8, 2t + 9), (row g + 8, same).
#[cube]
pub(super) fn a_fragments<X: Float>(
    xs: &Shared<[Vector<X, Const<2>>]>,
    base: usize,
    s: usize,
    #[comptime] cube: FragCube,
) -> Array<Vector<X, Const<2>>> {
    if comptime!(cube.ldmatrix) {
        a_fragments_ldmatrix::<X>(xs, base, s, cube)
    } else {
        a_fragments_loaded::<X>(xs, base, s, cube)
    }
}

/// [`a_fragments`] by one `ldmatrix.x4` per tile (on the instruction only): matrix `n` of the four
/// holds rows `8 (n % 2) ..` and inputs `8 (n / 2) ..` of the tile's 16 x 16, so its register `n` in
/// every lane is register `n` of the `m16n8k16` A layout; lane `l` addresses row `l % 8` of matrix
/// `l / 8`, 16 bytes (4 pairs) at a 16-byte boundary (the staged rows' strides are multiples of 4
/// pairs, [`staged_x_stride`]).
#[cube]
fn a_fragments_ldmatrix<X: Float>(
    xs: &Shared<[Vector<X, Const<2>>]>,
    base: usize,
    s: usize,
    #[comptime] cube: FragCube,
) -> Array<Vector<X, Const<2>>> {
    let lane = UNIT_POS_X as usize;
    let (matrix, i) = (lane / 8, lane % 8);
    let xstride = comptime!(staged_x_stride(cube));
    let def = cmma::MmaDefinition::<X, X, f32>::new(MMA, N8, MMA);
    let mut regs = Array::<Vector<X, Const<2>>>::new(comptime!(4 * cube.m_tiles));
    #[unroll]
    for m in 0..comptime!(cube.m_tiles) {
        let row = staged_row(m * MMA + i + 8 * (matrix % 2), cube);
        let start = base + row * xstride + s * (MMA / 2) + 4 * (matrix / 2);
        let tile = def.load_matrix::<Vector<X, Const<2>>, Const<2>>(
            &xs[start..start + 4],
            cmma::MatrixIdent::A,
            4usize,
            false,
        );
        #[unroll]
        for r in 0..4usize {
            regs[4 * m + r] = tile[r];
        }
    }
    regs
}

/// The staged row that holds the inputs of the cube's assignment row `row`: itself, or where the inputs
/// are staged whole for fewer rows than 16, a staged row again (rows past the tile's assignments, whose
/// outputs are never stored).
#[cube]
fn staged_row(row: usize, #[comptime] cube: FragCube) -> usize {
    let mut row = row;
    if comptime!(cube.whole_k > 0 && cube.staged_rows < MMA) {
        row %= comptime!(cube.staged_rows);
    }
    row
}

/// [`a_fragments`] by 4 loads of one operand pair per tile.
#[cube]
fn a_fragments_loaded<X: Float>(
    xs: &Shared<[Vector<X, Const<2>>]>,
    base: usize,
    s: usize,
    #[comptime] cube: FragCube,
) -> Array<Vector<X, Const<2>>> {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    let xstride = comptime!(staged_x_stride(cube));
    let mut regs = Array::<Vector<X, Const<2>>>::new(comptime!(4 * cube.m_tiles));
    #[unroll]
    for m in 0..comptime!(cube.m_tiles) {
        #[unroll]
        for r in 0..4usize {
            let row = staged_row(m * MMA + g + (r % 2) * 8, cube);
            let pair = s * (MMA / 2) + (r / 2) * 4 + t;
            regs[4 * m + r] = xs[base + row * xstride + pair];
        }
    }
    regs
}

/// The unit's B fragment of staged step `s` (of the buffer at `base`) for the cube's row `row` (its
/// `n = g`): registers (inputs 2t, 2t+1) and (inputs 2t + 8, 2t + 9), decoded from the packed words
/// ([`code_pair`]; exact in `X`).
#[cube]
fn b_fragment<X: Float>(
    ws: &Shared<[u32]>,
    base: usize,
    lut: &[f32],
    row: usize,
    s: usize,
    #[comptime] fmt: u32,
    #[comptime] cube: FragCube,
) -> Array<Vector<X, Const<2>>> {
    let t = UNIT_POS_X as usize % 4;
    let cpw = comptime!(codes_per_word(fmt));
    let wstride = comptime!(w_stride(fmt, cube.chunk_steps));
    let mut regs = Array::<Vector<X, Const<2>>>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let k = s * MMA + r * 8 + 2 * t;
        let word = ws[base + row * wstride + k / cpw];
        regs[r] = code_pair::<X>(word, (k % cpw) as u32, lut, fmt, cube.decode);
    }
    regs
}

/// Codes `j` and `j + 1` (`j` even) of a stored packed word as a pair of operand values: each by
/// itself ([`word_code_value`] after [`code_flip`]), or with a [`PairDecode`] of int4 codes, both at
/// once: the two codes moved to bits 0 and 16, one XOR that puts the exponent bits of `2^10` (f16) or
/// `2^7` (bf16) over them and flips their sign bits to offset binary, and one packed subtraction of
/// `2^10 + 8` or `2^7 + 8`, which leaves each code's value exactly, the value [`word_code_value`] gives.
#[cube]
pub(super) fn code_pair<X: Float>(
    word: u32,
    j: u32,
    lut: &[f32],
    #[comptime] fmt: u32,
    #[comptime] decode: PairDecode,
) -> Vector<X, Const<2>> {
    let mut pair = Vector::<X, Const<2>>::empty();
    if comptime!(fmt == 0 && decode != PairDecode::Scalar) {
        let (magic, bias) = comptime!(decode.magic());
        let v = word >> (j * 4u32);
        let bits = ((v & 0xFu32) | ((v << 12u32) & 0xF_0000u32)) ^ magic;
        // On the concrete half type (the operand type `X` is), then a cast to itself.
        if comptime!(decode == PairDecode::F16) {
            let codes = Vector::<half::f16, Const<2>>::reinterpret(bits);
            pair = Vector::cast_from(codes - Vector::<half::f16, Const<2>>::reinterpret(bias));
        } else {
            let codes = Vector::<half::bf16, Const<2>>::reinterpret(bits);
            pair = Vector::cast_from(codes - Vector::<half::bf16, Const<2>>::reinterpret(bias));
        }
    } else {
        let word = word ^ code_flip(fmt);
        pair.insert(0usize, X::cast_from(word_code_value(word, j, lut, fmt)));
        pair.insert(1usize, X::cast_from(word_code_value(word, j + 1, lut, fmt)));
    }
    pair
}

/// `acc += A B` for one `m16n8k16` fragment: the instruction with `tensor_cores`, else its emulation from
/// the plane's fragment registers ([`emulate_mma`]).
#[cube]
fn fragment_mma<X: Float>(
    a: &Array<Vector<X, Const<2>>>,
    b: &Array<Vector<X, Const<2>>>,
    acc: &mut Array<Vector<f32, Const<2>>>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
    #[comptime] tensor_cores: bool,
) {
    if comptime!(tensor_cores) {
        let def = cmma::MmaDefinition::<X, X, f32>::new(MMA, N8, MMA);
        def.execute_inplace(a, b, acc);
    } else {
        emulate_mma(a, b, acc, exchange);
    }
}

/// What `mma.m16n8k16` computes, from the fragment registers as the instruction receives them: each unit
/// writes its registers to the plane's part of `exchange`, and each output `(m, n)` the unit holds
/// (accumulator registers (row g, columns 2t, 2t+1), (row g + 8, same)) takes `A[m, k] B[k, n]` for `k`
/// in order with fused multiply-adds from its accumulator, reading `A[m, k]` from unit `4 (m % 8) +
/// (k % 8) / 2` and `B[k, n]` from unit `4 n + (k % 8) / 2`, as the PTX ISA lays them out. Every plane of
/// the cube calls it together (it waits for the cube).
#[cube]
fn emulate_mma<X: Float>(
    a: &Array<Vector<X, Const<2>>>,
    b: &Array<Vector<X, Const<2>>>,
    acc: &mut Array<Vector<f32, Const<2>>>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
) {
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let (g, t) = (lane / 4, lane % 4);
    // The plane's 32 units x (4 A + 2 B) registers.
    let base = plane * MMA_PLANE * EXCHANGE_REGS;
    #[unroll]
    for r in 0..4usize {
        exchange[base + lane * EXCHANGE_REGS + r] = a[r];
    }
    #[unroll]
    for r in 0..2usize {
        exchange[base + lane * EXCHANGE_REGS + 4 + r] = b[r];
    }
    sync_cube();
    #[unroll]
    for half in 0..2usize {
        let mut out = acc[half];
        let base_a = base + 4 * g * EXCHANGE_REGS + half;
        out.insert(
            0usize,
            emulated_output(
                &*exchange,
                base_a,
                base + 4 * (2 * t) * EXCHANGE_REGS + 4,
                out.extract(0usize),
            ),
        );
        out.insert(
            1usize,
            emulated_output(
                &*exchange,
                base_a,
                base + 4 * (2 * t + 1) * EXCHANGE_REGS + 4,
                out.extract(1usize),
            ),
        );
        acc[half] = out;
    }
    sync_cube();
}

/// One output of [`emulate_mma`]: `sum + A[m, k] B[k, n]` for `k = 0..16` in order, with `A[m, k]` at
/// `a_at + (k % 8) / 2 * 6 + 2 * (k / 8)` and `B[k, n]` at `b_at + (k % 8) / 2 * 6 + k / 8` of
/// `exchange` (element `k % 2` of each pair).
#[cube]
fn emulated_output<X: Float>(
    exchange: &Shared<[Vector<X, Const<2>>]>,
    a_at: usize,
    b_at: usize,
    sum: f32,
) -> f32 {
    let mut sum = sum;
    for k in 0..MMA {
        let av = exchange[a_at + (k % 8) / 2 * EXCHANGE_REGS + 2 * (k / 8)];
        let bv = exchange[b_at + (k % 8) / 2 * EXCHANGE_REGS + k / 8];
        let odd = k % 2 == 1;
        let a = select(odd, av.extract(1usize), av.extract(0usize));
        let b = select(odd, bv.extract(1usize), bv.extract(0usize));
        sum = fma(f32::cast_from(a), f32::cast_from(b), sum);
    }
    sum
}

/// One staged step for one block of 8 rows: per projection (`a`, and `b` with `swiglu`) its B fragment
/// ([`b_fragment`]), decoded once, into the block's accumulator of every tile of the cube that holds
/// assignments (of the `len` the cube covers).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn block_step<X: Float>(
    a: &Array<Vector<X, Const<2>>>,
    wa: &Shared<[u32]>,
    wb: &Shared<[u32]>,
    wbase: usize,
    lut: &[f32],
    acc: &mut Array<Vector<f32, Const<2>>>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
    len: usize,
    block: usize,
    s: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] tensor_cores: bool,
    #[comptime] cube: FragCube,
) {
    let row = (row_plane(cube) * comptime!(cube.blocks) + block) * N8 + UNIT_POS_X as usize / 4;
    let b = b_fragment::<X>(wa, wbase, lut, row, s, fmt, cube);
    tiles_step::<X>(
        a,
        &b,
        acc,
        exchange,
        len,
        0,
        block,
        swiglu,
        tensor_cores,
        cube,
    );
    if comptime!(swiglu) {
        let b = b_fragment::<X>(wb, wbase, lut, row, s, fmt, cube);
        tiles_step::<X>(
            a,
            &b,
            acc,
            exchange,
            len,
            1,
            block,
            swiglu,
            tensor_cores,
            cube,
        );
    }
}

/// One B fragment (projection `proj`, block `block`) into the accumulators of the cube's tiles that hold
/// assignments: one instruction per tile, from the tile's A fragment.
#[cube]
#[allow(clippy::too_many_arguments)]
fn tiles_step<X: Float>(
    a: &Array<Vector<X, Const<2>>>,
    b: &Array<Vector<X, Const<2>>>,
    acc: &mut Array<Vector<f32, Const<2>>>,
    exchange: &mut Shared<[Vector<X, Const<2>>]>,
    len: usize,
    proj: usize,
    block: usize,
    #[comptime] swiglu: bool,
    #[comptime] tensor_cores: bool,
    #[comptime] cube: FragCube,
) {
    #[unroll]
    for m in 0..comptime!(cube.m_tiles) {
        // Uniform over the cube: a tile past its assignments skips the instruction.
        if m * MMA < len {
            let mut tile_a = Array::<Vector<X, Const<2>>>::new(4usize);
            #[unroll]
            for r in 0..4usize {
                tile_a[r] = a[4 * m + r];
            }
            let f = fragment_index(m, proj, block, swiglu, cube);
            let mut tile_acc = Array::<Vector<f32, Const<2>>>::new(2usize);
            tile_acc[0] = acc[2 * f];
            tile_acc[1] = acc[2 * f + 1];
            fragment_mma::<X>(&tile_a, b, &mut tile_acc, exchange, tensor_cores);
            acc[2 * f] = tile_acc[0];
            acc[2 * f + 1] = tile_acc[1];
        }
    }
}

/// `n` fresh accumulator fragments (registers `2 f, 2 f + 1` for fragment `f`).
#[cube]
pub(super) fn zero_fragments(#[comptime] n: usize) -> Array<Vector<f32, Const<2>>> {
    let mut acc = Array::<Vector<f32, Const<2>>>::new(comptime!(2 * n));
    #[unroll]
    for i in 0..comptime!(2 * n) {
        acc[i] = Vector::<f32, Const<2>>::new(0.0f32);
    }
    acc
}

/// `total[4 f + i] += sum_i * scale(row)` for the 4 outputs of accumulator fragment `f` (registers `2 f,
/// 2 f + 1` of `acc`; block `block`), output `i` in row `2t + i % 2` of the block (assignment `g + 8 (i /
/// 2)` of the fragment's tile); rows past `n_out` keep 0.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn add_scaled_fragment(
    total: &mut Array<f32>,
    acc: &Array<Vector<f32, Const<2>>>,
    f: usize,
    block: usize,
    scales: &[f32],
    soff: usize,
    row0: usize,
    k: usize,
    n_out: usize,
    spr: usize,
    #[comptime] fmt: u32,
    #[comptime] group: usize,
    #[comptime] cube: FragCube,
) {
    let t = UNIT_POS_X as usize % 4;
    let base = row0 + (row_plane(cube) * comptime!(cube.blocks) + block) * N8 + 2 * t;
    #[unroll]
    for i in 0..4usize {
        let r = base + i % 2;
        if r < n_out {
            let v = acc[2 * f + i / 2];
            let sum = select(i % 2 == 1, v.extract(1usize), v.extract(0usize));
            total[4 * f + i] += sum * scale_at(scales, soff, r, k, spr, fmt, group);
        }
    }
}
