//! The fragment tiles' staging: a chunk of K steps of packed words and input pairs, loaded a chunk ahead
//! into registers ([`fetch_chunk`]) and stored to shared memory ([`store_chunk`]), and the sizes that
//! follow from it (row strides, shared memory, steps per chunk).

use cubecl::prelude::*;

use super::super::codes_per_word;
use super::super::mma::{clear_past_inputs, MMA, MMA_PLANE, SHARED_ALIGN};
use super::{FragCube, EXCHANGE_REGS, FRAG_MAX_CHUNK_STEPS, UNITS};

/// Padding of every staged input row, in 4-byte pairs: rows `8 chunk_steps + 4` pairs apart start in
/// banks 4 apart (mod 32), so the 8 rows x 4 lanes of an A-fragment read fall in 32 distinct banks.
const ROW_PAD: usize = 4;

/// Input pairs per staged row of `chunk_steps` steps, padding included.
pub(super) const fn x_stride(chunk_steps: usize) -> usize {
    chunk_steps * MMA / 2 + ROW_PAD
}

/// Input pairs per staged row of the cube: a chunk's ([`x_stride`]), or all `whole_k` inputs' where
/// they are staged whole (the split groups, [`super::split`]), padded alike.
pub(super) const fn staged_x_stride(cube: FragCube) -> usize {
    if cube.whole_k > 0 {
        cube.whole_k / 2 + ROW_PAD
    } else {
        x_stride(cube.chunk_steps)
    }
}

/// Input pairs the cube stages: its buffers of a chunk's inputs for its assignments, or where the
/// inputs are staged whole ([`super::split`]) all `whole_k` of them for its `staged_rows` rows.
pub(super) const fn staged_inputs_len(cube: FragCube) -> usize {
    if cube.whole_k > 0 {
        cube.staged_rows * staged_x_stride(cube)
    } else {
        cube.buffers() * cube.assignments() * x_stride(cube.chunk_steps)
    }
}

/// Packed words one buffer of the staging holds per projection: the cube's rows of a chunk, once per
/// set of scale groups.
pub(super) const fn staged_words_len(fmt: u32, cube: FragCube) -> usize {
    cube.splits * cube.rows() * w_stride(fmt, cube.chunk_steps)
}

/// Packed words per row of a chunk of `chunk_steps` steps.
pub(super) const fn chunk_words(fmt: u32, chunk_steps: usize) -> usize {
    chunk_steps * MMA / codes_per_word(fmt)
}

/// Packed words per staged row, padding included: the least stride of 4 mod 8 words, so that the 8
/// rows of a B-fragment read (the 4 lanes of a row read one word) start in 8 distinct banks at every
/// chunk size (a fixed pad of 4 gave 8 words at 2 steps of int4: 2 rows per bank).
pub(super) const fn w_stride(fmt: u32, chunk_steps: usize) -> usize {
    let words = chunk_words(fmt, chunk_steps);
    words + (12 - words % 8) % 8
}

/// Packed words a unit loads per chunk and projection: the cube's rows' chunk, once per set of scale
/// groups (the same count at every split: fewer rows, more sets).
pub(super) const fn words_per_unit(fmt: u32, cube: FragCube) -> usize {
    (cube.splits * cube.rows() * chunk_words(fmt, cube.chunk_steps)).div_ceil(UNITS)
}

/// Input pairs a unit loads per chunk: none where the inputs are staged whole.
const fn pairs_per_unit(cube: FragCube) -> usize {
    if cube.whole_k > 0 {
        0
    } else {
        (cube.assignments() * cube.chunk_steps * MMA / 2).div_ceil(UNITS)
    }
}

/// Input values a unit holds between a chunk's loads and its stores.
pub(super) const fn held_inputs(cube: FragCube) -> usize {
    2 * pairs_per_unit(cube)
}

/// The most values a unit holds between a chunk's loads and its stores (packed words of both
/// projections and inputs): 32, what 8 steps of int4 with one tile of 16 assignments and 64 rows hold,
/// the layout measured without spills on sm_90 (8 steps of int8 held 48 and spilled).
const MOST_HELD: usize = 32;

/// Bytes of shared memory the sets' sums take: one accumulator fragment set per unit of the planes
/// past set 0, with its alignment; 0 with one set.
const fn partials_bytes(cube: FragCube, swiglu: bool) -> usize {
    if cube.splits > 1 {
        partials_len(cube, swiglu) * 8 + SHARED_ALIGN
    } else {
        0
    }
}

/// Pairs of f32 sums the sets past set 0 hand over per round.
pub(super) const fn partials_len(cube: FragCube, swiglu: bool) -> usize {
    (cube.splits - 1) * cube.row_planes() * MMA_PLANE * 2 * cube.fragments(swiglu)
}

/// Shared memory [`grouped_fragments`](fn@super::grouped_fragments) allocates with the layout `cube` (its
/// buffers of the staging, and with split groups the inputs staged whole and the sets' sums exchanged),
/// `operand_bytes`-byte operands, two projections with `swiglu`, and the scalar twin's exchange of the
/// fragment registers (without `tensor_cores`), alignment padding included.
pub fn grouped_fragments_shared_bytes(
    fmt: u32,
    cube: FragCube,
    operand_bytes: usize,
    swiglu: bool,
    tensor_cores: bool,
) -> usize {
    let xs = staged_inputs_len(cube) * 2 * operand_bytes;
    let ws = cube.buffers() * staged_words_len(fmt, cube) * 4;
    let wb = if swiglu { ws } else { 4 };
    let exchange = if tensor_cores {
        0
    } else {
        UNITS * EXCHANGE_REGS * 2 * operand_bytes
    };
    xs + ws + wb + exchange + partials_bytes(cube, swiglu) + 5 * SHARED_ALIGN
}

/// The most K steps per chunk, a power of two, for the cube `layout` (its own `chunk_steps` aside): at
/// most [`FRAG_MAX_CHUNK_STEPS`] and a scale group's `steps_per_scale`, holding at most `MOST_HELD`
/// values per unit (gate and up, the most a kernel holds), with the staging (its buffers) in
/// `max_shared` bytes; `None` where not even one step fits.
pub fn fragment_chunk_steps(
    fmt: u32,
    steps_per_scale: usize,
    layout: FragCube,
    operand_bytes: usize,
    tensor_cores: bool,
    max_shared: usize,
) -> Option<usize> {
    let cube = |chunk_steps| FragCube {
        chunk_steps,
        ..layout
    };
    let most = FRAG_MAX_CHUNK_STEPS.min(steps_per_scale.max(1));
    let held = |c: FragCube| 2 * words_per_unit(fmt, c) + held_inputs(c) <= MOST_HELD;
    let shared = |c: FragCube| {
        grouped_fragments_shared_bytes(fmt, c, operand_bytes, true, tensor_cores) <= max_shared
    };
    [8usize, 4, 2, 1]
        .into_iter()
        .find(|&d| d <= most && shared(cube(d)) && (d == 1 || held(cube(d))))
}

/// Where the inputs of the tile's assignment `r` start in `input`: row `table[rows_at + a0 + r]` with
/// `gather`, else row `a0 + r`; 0 past the tile's `len` assignments. Looked up at each chunk rather than
/// held in registers (the lookup is an L1 hit, and the chunk's loads go out a chunk ahead).
#[cube]
pub(super) fn input_row(
    table: &[u32],
    rows_at: usize,
    a0: usize,
    r: usize,
    len: usize,
    inn: usize,
    #[comptime] gather: bool,
) -> usize {
    let mut src = a0 + r;
    if comptime!(gather) {
        src = table[select(r < len, rows_at + a0 + r, 0usize)] as usize;
    }
    select(r < len, src * inn, 0usize)
}

#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn fetch_chunk<I: Float>(
    input: &[I],
    table: &[u32],
    rows_at: usize,
    a0: usize,
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
    #[comptime] gather: bool,
    #[comptime] cube: FragCube,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let cpw = comptime!(codes_per_word(fmt));
    let chunk_steps = comptime!(cube.chunk_steps);
    let cw = comptime!(chunk_words(fmt, chunk_steps));
    let k0 = s0 * MMA;
    let k_end = (last * MMA).min(inn);
    if s0 < last {
        #[unroll]
        for p in 0..comptime!(words_per_unit(fmt, cube)) {
            let i = unit + p * UNITS;
            let (row, w) = (i / cw, i % cw);
            let kw = k0 + w * cpw;
            let r = row0 + row;
            let live = row < comptime!(cube.rows()) && r < n_out && below(kw, k_end, cube);
            let at = select(live, woff + r * wpr + kw / cpw, 0usize);
            held_a[p] = live_word(words_a[at], kw, inn, live, fmt, cube);
            if comptime!(swiglu) {
                held_b[p] = live_word(words_b[at], kw, inn, live, fmt, cube);
            }
        }
        let pairs_per_row = comptime!(chunk_steps * MMA / 2);
        #[unroll]
        for p in 0..comptime!(pairs_per_unit(cube)) {
            let i = unit + p * UNITS;
            let (a, q) = (i / pairs_per_row, i % pairs_per_row);
            let k = k0 + 2 * q;
            let live0 = a < len && below(k, k_end, cube);
            let live1 = a < len && below(k + 1, k_end, cube);
            let row = input_row(table, rows_at, a0, a, len, inn, gather);
            held_x[2 * p] = input[select(live0, row + k, 0usize)];
            held_x[2 * p + 1] = input[select(live1, row + k + 1, 0usize)];
        }
    }
}

/// Whether input `k` of a chunk comes before the chunk's end `k_end`: always, where the cube's chunks are
/// all whole ([`FragCube::full_chunks`]), which spares the comparison.
#[cube]
fn below(k: usize, k_end: usize, #[comptime] cube: FragCube) -> bool {
    let mut inside = true;
    if comptime!(!cube.full_chunks) {
        inside = k < k_end;
    }
    inside
}

/// Packed word `word` starting at input `kw`, its codes past `inn` cleared, or 0 (value 0 in every
/// format) where not `live` ([`clear_past_inputs`]); with whole chunks no code is past `inn`, so only
/// `live` counts.
#[cube]
fn live_word(
    word: u32,
    kw: usize,
    inn: usize,
    live: bool,
    #[comptime] fmt: u32,
    #[comptime] cube: FragCube,
) -> u32 {
    if comptime!(cube.full_chunks) {
        select(live, word, 0u32)
    } else {
        clear_past_inputs(word, kw, inn, live, fmt)
    }
}

/// Stores the chunk at `s0` that [`fetch_chunk`] loaded into the shared buffers at `xbase` (inputs) and
/// `wbase` (words): the input pairs, rounded to
/// `X` (zeros past the tile's `len` assignments or the chunk's inputs), and the packed words as loaded.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_chunk<I: Float, X: Float>(
    held_a: &Array<u32>,
    held_b: &Array<u32>,
    held_x: &Array<I>,
    xs: &mut Shared<[Vector<X, Const<2>>]>,
    wa: &mut Shared<[u32]>,
    wb: &mut Shared<[u32]>,
    xbase: usize,
    wbase: usize,
    s0: usize,
    last: usize,
    len: usize,
    inn: usize,
    #[comptime] fmt: u32,
    #[comptime] swiglu: bool,
    #[comptime] cube: FragCube,
) {
    let unit = UNIT_POS_Y as usize * MMA_PLANE + UNIT_POS_X as usize;
    let chunk_steps = comptime!(cube.chunk_steps);
    let cw = comptime!(chunk_words(fmt, chunk_steps));
    let ws = comptime!(w_stride(fmt, chunk_steps));
    let k_end = (last * MMA).min(inn);
    let zero = X::from_int(0);
    #[unroll]
    for p in 0..comptime!(words_per_unit(fmt, cube)) {
        let i = unit + p * UNITS;
        if i < comptime!(cube.rows() * chunk_words(fmt, cube.chunk_steps)) {
            let at = wbase + (i / cw) * ws + i % cw;
            wa[at] = held_a[p];
            if comptime!(swiglu) {
                wb[at] = held_b[p];
            }
        }
    }
    let pairs_per_row = comptime!(chunk_steps * MMA / 2);
    let xstride = comptime!(x_stride(chunk_steps));
    #[unroll]
    for p in 0..comptime!(pairs_per_unit(cube)) {
        let i = unit + p * UNITS;
        let (a, q) = (i / pairs_per_row, i % pairs_per_row);
        if a < comptime!(cube.assignments()) {
            let k = s0 * MMA + 2 * q;
            let mut pair = Vector::<X, Const<2>>::empty();
            pair.insert(
                0usize,
                select(
                    a < len && below(k, k_end, cube),
                    X::cast_from(held_x[2 * p]),
                    zero,
                ),
            );
            pair.insert(
                1usize,
                select(
                    a < len && below(k + 1, k_end, cube),
                    X::cast_from(held_x[2 * p + 1]),
                    zero,
                ),
            );
            xs[xbase + a * xstride + q] = pair;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::PairDecode;
    use super::*;

    /// The chunk is the most K steps that fit, a power of two, never past a scale group or eight;
    /// `None` where one step does not fit. More tiles per cube hold more inputs, so take fewer steps; the
    /// allocation grows with the chunk, and the scalar twin's exchange costs more.
    #[test]
    fn chunks_take_the_most_steps_that_fit() {
        let (int4, int8, h200) = (0, 1, 227 << 10);
        let layout = |m_tiles, blocks, double_buffer| FragCube {
            chunk_steps: 1,
            m_tiles,
            blocks,
            decode: PairDecode::Scalar,
            full_chunks: false,
            double_buffer,
            splits: 1,
            whole_k: 0,
            staged_rows: 16,
            ldmatrix: false,
        };
        let one_tile = layout(1, 2, false);
        // The whole group of int4-g128 (8 steps), four of int8-pc's 128 (the same bytes; eight would
        // hold 48 values per unit).
        assert_eq!(
            fragment_chunk_steps(int4, 8, one_tile, 2, true, h200),
            Some(8)
        );
        assert_eq!(
            fragment_chunk_steps(int8, 128, one_tile, 2, true, h200),
            Some(4)
        );
        // Groups of 2 (int4-g32) and 1 (nvfp4) steps bound the chunk.
        assert_eq!(
            fragment_chunk_steps(int4, 2, one_tile, 2, true, h200),
            Some(2)
        );
        assert_eq!(
            fragment_chunk_steps(int4, 1, one_tile, 2, true, h200),
            Some(1)
        );
        // Two and four tiles of 16 assignments: 4 and 2 steps hold at most 32 values; two buffers
        // change nothing on an H200.
        for ((m, blocks), want) in [((2, 1), 4), ((2, 2), 4), ((4, 1), 2)] {
            for double_buffer in [false, true] {
                let d =
                    fragment_chunk_steps(int4, 8, layout(m, blocks, double_buffer), 2, true, h200);
                assert_eq!(d, Some(want), "{m} tiles, {blocks} blocks, {double_buffer}");
            }
        }
        // WebGPU's 16 KiB with the exchange: 4 steps of f16 operands, 2 of f32 (twice the bytes); with
        // two buffers 2 of either.
        let twin = |layout, bytes| fragment_chunk_steps(int4, 8, layout, bytes, false, 16 << 10);
        assert_eq!((twin(one_tile, 4), twin(one_tile, 2)), (Some(2), Some(4)));
        let two = layout(1, 2, true);
        assert_eq!((twin(two, 4), twin(two, 2)), (Some(2), Some(2)));
        for (layout, bytes) in [(one_tile, 4), (one_tile, 2), (two, 4), (two, 2)] {
            let d = twin(layout, bytes).unwrap();
            let cube = |chunk_steps| FragCube {
                chunk_steps,
                ..layout
            };
            assert!(grouped_fragments_shared_bytes(int4, cube(d), bytes, true, false) <= 16 << 10);
            assert!(
                grouped_fragments_shared_bytes(int4, cube(2 * d), bytes, true, false) > 16 << 10
            );
        }
        assert_eq!(
            fragment_chunk_steps(int8, 8, one_tile, 4, false, 1 << 10),
            None
        );
    }

    /// Padded row strides put the 8 rows of a plane's B-fragment reads in distinct banks at every chunk
    /// size of 4- and 8-bit codes: no bank conflict for the B fragments.
    #[test]
    fn padded_rows_start_in_distinct_banks() {
        for fmt in [0u32, 1] {
            for chunk_steps in [1, 2, 4, 8] {
                let stride = w_stride(fmt, chunk_steps);
                assert!(stride >= chunk_words(fmt, chunk_steps) && stride % 8 == 4);
                let mut banks: Vec<usize> = (0..8).map(|g| (g * stride) % 32).collect();
                banks.sort_unstable();
                banks.dedup();
                assert_eq!(
                    banks.len(),
                    8,
                    "fmt {fmt}, {chunk_steps} steps: stride {stride}"
                );
            }
        }
        // The input pairs: rows 8 chunk_steps + 4 pairs apart, lanes t = 0..3 beside them: 32 distinct
        // banks.
        for chunk_steps in [1, 2, 4, FRAG_MAX_CHUNK_STEPS] {
            let stride = x_stride(chunk_steps);
            let mut banks: Vec<usize> = (0..8)
                .flat_map(|g| (0..4).map(move |t| (g * stride + t) % 32))
                .collect();
            banks.sort_unstable();
            banks.dedup();
            assert_eq!(banks.len(), 32, "{chunk_steps} steps");
        }
    }

    /// Splitting the scale groups among sets of planes keeps what a unit holds (its weights' words: the
    /// same count at 1, 2 and 4 sets, and no inputs, which are staged whole) while the cube's rows
    /// shrink with the sets; the shared memory then holds all the inputs (Qwen3-30B-A3B's gate-up: 16
    /// rows of 2048 bf16 inputs, 64 KiB and their padding) and the sets' sums.
    #[test]
    fn split_groups_hold_the_same_words_and_stage_whole_inputs() {
        let int4 = 0;
        let cube = FragCube {
            chunk_steps: 8,
            m_tiles: 1,
            blocks: 2,
            decode: PairDecode::Bf16,
            full_chunks: true,
            double_buffer: false,
            splits: 1,
            whole_k: 0,
            staged_rows: 16,
            ldmatrix: false,
        };
        assert_eq!(cube.with_split_groups(1, 2048, 8), cube);
        let unsplit = grouped_fragments_shared_bytes(int4, cube, 2, true, true);
        for (splits, rows) in [(1, 64), (2, 32), (4, 16)] {
            let split = cube.with_split_groups(splits, 2048, 16);
            assert_eq!((split.rows(), split.row_planes()), (rows, 4 / splits));
            assert_eq!(words_per_unit(int4, split), words_per_unit(int4, cube));
            if splits > 1 {
                assert_eq!((split.whole_k, held_inputs(split)), (2048, 0));
                assert_eq!(staged_x_stride(split), 1024 + ROW_PAD);
                let bytes = grouped_fragments_shared_bytes(int4, split, 2, true, true);
                let inputs = 16 * (1024 + ROW_PAD) * 4;
                assert!(
                    bytes > unsplit + inputs - 16 * x_stride(8) * 4,
                    "{splits}: {bytes}"
                );
                assert!(bytes < 227 << 10, "{splits}: {bytes}");
                // A one-token decode step (top-8: at most 8 assignments per tile) stages 8 rows, a
                // call of 3 assignments 4: the inputs' bytes shrink with them.
                for (most, staged) in [(8, 8), (3, 4), (1, 1), (40, 16)] {
                    let fewer = cube.with_split_groups(splits, 2048, most);
                    assert_eq!(fewer.staged_rows, staged);
                    let saved = bytes - grouped_fragments_shared_bytes(int4, fewer, 2, true, true);
                    assert_eq!(saved, (16 - staged) * (1024 + ROW_PAD) * 4);
                }
            }
        }
    }
}
