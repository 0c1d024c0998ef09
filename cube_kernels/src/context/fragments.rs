//! Launchers of the fragment tiles ([`crate::kernels::mma_frag`]): the tensor-core tiles' order with the
//! weights kept packed until the instruction's registers, for the grouped MoE products and the dense
//! product, when [`Kernels::with_fragment_tiles`] says so.

use cubecl::prelude::*;

use super::{tile_steps, DeviceBuffer, DeviceWeights, Kernels, MAX_GRID};
use crate::dtype::ActDType;
use crate::error::KernelError;
use crate::format::WeightFormat;
use crate::kernels::mma::{MMA, MMA_PLANE};
use crate::kernels::mma_frag::{self, FragCube, PairDecode, FRAG_PLANES};
use crate::moe::RoutingTable;

/// The layout of the fragment tiles' cubes ([`Kernels::with_fragment_shape`]): up to `m_tiles` tiles of
/// 16 assignments (tokens) per cube, each unit decoding a weight fragment once for all of them (fewer
/// tiles, down to one, where a call's experts take fewer assignments on average:
/// [`FragmentShape::tiles_for`]); `blocks` blocks of 8 output rows per plane (32 or 64 rows per cube);
/// int4 codes decoded two at a time into half operands on the instruction path with `pair_decode`
/// ([`mma_frag::PairDecode`]); and the staging in two buffers with `double_buffer`. Every shape gives
/// the same bits (tested), so the shape is a speed choice only; the default is the layout built first
/// (one tile, two blocks, one code at a time, one buffer), kept until a GPU has timed the others.
///
/// With `group_splits` above 1, a call whose cubes would not fill the device twice over (a decode step)
/// splits its scale groups among up to that many sets of planes ([`FragmentShape::splits_for`],
/// [`crate::kernels::mma_frag`]'s `split`): more of K in flight per output row, the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragmentShape {
    m_tiles: usize,
    blocks: usize,
    pair_decode: bool,
    double_buffer: bool,
    group_splits: usize,
    ldmatrix: bool,
}

impl Default for FragmentShape {
    fn default() -> Self {
        FragmentShape {
            m_tiles: 1,
            blocks: 2,
            pair_decode: false,
            double_buffer: false,
            group_splits: 1,
            ldmatrix: false,
        }
    }
}

impl FragmentShape {
    /// Most tiles of 16 assignments a cube takes: four hold 64 accumulator values per unit with one
    /// block of rows.
    pub const MOST_TILES: usize = 4;

    /// A shape of at most `m_tiles` (1, 2 or [`Self::MOST_TILES`]: a power of two, as
    /// [`Self::tiles_for`] rounds to) tiles per cube and `blocks` (1 or 2) blocks of rows per plane,
    /// `m_tiles * blocks` at most 4; an error naming the value otherwise.
    pub fn new(m_tiles: usize, blocks: usize, pair_decode: bool) -> Result<Self, KernelError> {
        if ![1, 2, Self::MOST_TILES].contains(&m_tiles)
            || !(1..=2).contains(&blocks)
            || m_tiles * blocks > 4
        {
            return Err(KernelError::Shape(format!(
                "fragment tiles of {m_tiles} tiles x {blocks} blocks per cube: tiles take 1, 2 or {}, \
                 blocks 1 or 2, and their product at most 4 (the accumulators a unit holds)",
                Self::MOST_TILES
            )));
        }
        Ok(FragmentShape {
            m_tiles,
            blocks,
            pair_decode,
            double_buffer: false,
            group_splits: 1,
            ldmatrix: false,
        })
    }

    /// This shape with the A fragments read by `ldmatrix` when `on` (on the instruction only: the
    /// scalar twin has no such load; `FragCube::ldmatrix`).
    pub fn with_ldmatrix(mut self, on: bool) -> Self {
        self.ldmatrix = on;
        self
    }

    /// Whether the A fragments are read by `ldmatrix` on the instruction.
    pub fn ldmatrix(&self) -> bool {
        self.ldmatrix
    }

    /// This shape with the scale groups of a call with few cubes split among up to `splits` (1, 2 or
    /// 4) sets of planes ([`Self::splits_for`]); an error naming the value otherwise.
    pub fn with_group_splits(mut self, splits: usize) -> Result<Self, KernelError> {
        if ![1, 2, FRAG_PLANES].contains(&splits) {
            return Err(KernelError::Shape(format!(
                "fragment tiles with scale groups split {splits} ways: 1, 2 or {FRAG_PLANES} (the \
                 planes of a cube)"
            )));
        }
        self.group_splits = splits;
        Ok(self)
    }

    /// The most sets of planes the scale groups are split among.
    pub fn group_splits(&self) -> usize {
        self.group_splits
    }

    /// Sets of planes for a call of `groups` scale groups whose cubes, unsplit, would be `cubes`: the
    /// most (a power of two, at most [`Self::group_splits`] and `groups`) that keeps the split cubes
    /// under twice `fill`, doubling only while the cubes are fewer than `fill` (twice the device's
    /// multiprocessors: below it the device waits on the few chunks in flight). 1 without groups to
    /// split.
    pub fn splits_for(&self, groups: usize, cubes: usize, fill: usize) -> usize {
        let mut splits = 1;
        while 2 * splits <= self.group_splits
            && 2 * splits <= groups
            && cubes.saturating_mul(splits) < fill
        {
            splits *= 2;
        }
        splits
    }

    /// This shape with the staging in two buffers when `on` (one barrier per chunk instead of two, for
    /// twice its shared memory and a runtime buffer offset; `FragCube::double_buffer`).
    pub fn with_double_buffer(mut self, on: bool) -> Self {
        self.double_buffer = on;
        self
    }

    /// Whether the staging has two buffers.
    pub fn double_buffer(&self) -> bool {
        self.double_buffer
    }

    /// Most tiles of 16 assignments per cube.
    pub fn m_tiles(&self) -> usize {
        self.m_tiles
    }

    /// Blocks of 8 output rows per plane.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Whether int4 codes are decoded two at a time into half operands.
    pub fn pair_decode(&self) -> bool {
        self.pair_decode
    }

    /// Tiles per cube for a call whose experts (the dense product: its one matrix) take `per_expert`
    /// assignments on average: the power of two of tiles of 16 that covers them, at most `m_tiles`, so a
    /// decode step keeps one tile's registers.
    pub fn tiles_for(&self, per_expert: usize) -> usize {
        per_expert
            .div_ceil(MMA)
            .next_power_of_two()
            .clamp(1, self.m_tiles)
    }

    /// The compiled layout for `tiles` tiles per cube, `chunk_steps` steps per chunk (whole ones with
    /// `full_chunks`), `fmt` codes and `operand` operands, on the instruction with `tensor_cores`. The
    /// pair decode runs on the instruction path only: WGSL's translator (naga) types a bitcast of a `u32`
    /// to `vec2<f16>` as an `f32`, so the scalar twin on WebGPU decodes one code at a time (the same
    /// values).
    pub(crate) fn cube(
        &self,
        (tiles, chunk_steps, full_chunks): (usize, usize, bool),
        fmt: u32,
        (tensor_cores, operand): (bool, ActDType),
    ) -> FragCube {
        FragCube {
            chunk_steps,
            m_tiles: tiles,
            blocks: self.blocks,
            full_chunks,
            double_buffer: self.double_buffer,
            splits: 1,
            whole_k: 0,
            staged_rows: MMA,
            ldmatrix: self.ldmatrix && tensor_cores,
            decode: if self.pair_decode && tensor_cores {
                PairDecode::for_codes(fmt, operand)
            } else {
                PairDecode::Scalar
            },
        }
    }
}

/// The size of a call of the fragment tiles, what their layout follows: the assignments its experts
/// take on average (the dense product: its tokens), the tiles of 16 that hold any (the grid's busy rows),
/// and the most assignments one tile can hold (16, or the call's assignments where fewer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragmentCall {
    pub per_expert: usize,
    pub busy_tiles: usize,
    pub most_rows: usize,
}

impl FragmentCall {
    /// An MoE call of `tokens` tokens routed `top_k` ways over `experts` experts, whose table has
    /// `tiles` tiles: no expert takes more than every assignment, whatever the ids.
    pub fn moe(tokens: usize, top_k: usize, experts: usize, tiles: usize) -> Self {
        let assignments = tokens * top_k;
        FragmentCall {
            per_expert: assignments.div_ceil(experts.max(1)),
            busy_tiles: tiles.min(assignments),
            most_rows: assignments.min(MMA),
        }
    }

    /// The dense product on `tokens` tokens.
    pub fn dense(tokens: usize) -> Self {
        FragmentCall {
            per_expert: tokens,
            busy_tiles: tokens.div_ceil(MMA),
            most_rows: tokens.min(MMA),
        }
    }
}

impl Kernels {
    /// These kernels with the tensor-core tiles' order ([`crate::MatmulPath::tiles`]) on the fragment
    /// tiles ([`crate::kernels::mma_frag`]: packed words staged, fragments decoded in registers, scale
    /// groups applied in registers) when `on`, for the dense product and the grouped MoE products alike,
    /// else on [`crate::kernels::mma`]'s and [`crate::kernels::mma_moe`]'s tiles. The scalar twins give
    /// the same bits either way (tested); on the instruction, NVIDIA's `m16n16k16` being two `m16n8k16`,
    /// the same bits are expected and `qarl bench kernels --check` counts any that differ. Off until a
    /// GPU has timed it: rollout and training must take the same choice, which one `Kernels` value does.
    pub fn with_fragment_tiles(mut self, on: bool) -> Self {
        self.fragment_tiles = on;
        self
    }

    /// Whether the tensor-core tiles' order runs on the fragment tiles ([`Self::with_fragment_tiles`]).
    pub fn fragment_tiles(&self) -> bool {
        self.fragment_tiles
    }

    /// These kernels with the fragment tiles staging at most `Some(n)` K steps per chunk (fewer
    /// registers and more cubes per multiprocessor, more barriers), or as many as fit up to eight
    /// (`None`): the same bits every way; for tests, and for timing the choice.
    pub fn with_fragment_chunk_steps(mut self, steps: Option<usize>) -> Self {
        self.fragment_chunk = steps.map(|n| n.clamp(1, mma_frag::FRAG_MAX_CHUNK_STEPS));
        self
    }

    /// These kernels with the fragment tiles' cubes laid out as `shape` ([`FragmentShape`]): the same
    /// bits every way.
    pub fn with_fragment_shape(mut self, shape: FragmentShape) -> Self {
        self.fragment_shape = shape;
        self
    }

    /// The fragment tiles' layout ([`Self::with_fragment_shape`]).
    pub fn fragment_shape(&self) -> FragmentShape {
        self.fragment_shape
    }

    /// Whether the fragment tiles can run `format` weights with `operand` operands here (beyond
    /// [`Self::check_tiles`]): the manual `m16n8k16` instruction on the instruction path, and a chunk of
    /// one K step in shared memory. Otherwise an error saying which.
    pub(crate) fn check_fragments(
        &self,
        format: WeightFormat,
        (tensor_cores, operand): (bool, ActDType),
    ) -> Result<(), KernelError> {
        if tensor_cores && !self.supports_mma_fragments(operand) {
            return Err(KernelError::Unsupported(format!(
                "fragment tiles for {format:?} weights with {operand} operands on {}: no manual \
                 m16n8k16 {operand}-operand instruction",
                self.device_name()
            )));
        }
        if tensor_cores
            && self.fragment_shape.ldmatrix
            && !operand.has_ldmatrix_on(self.client.properties())
        {
            return Err(KernelError::Unsupported(format!(
                "fragment tiles reading their A fragments by ldmatrix with {operand} operands on {}: \
                 no ldmatrix for {operand}",
                self.device_name()
            )));
        }
        let most = self.fragment_shape.m_tiles;
        if self
            .fragment_chunk_steps(format, 1, most, (tensor_cores, operand))
            .is_none()
        {
            return Err(KernelError::Unsupported(format!(
                "fragment tiles for {format:?} weights with {operand} operands: one K step's staging \
                 exceeds the {} bytes of shared memory {} allows",
                self.max_shared_bytes(),
                self.device_name()
            )));
        }
        Ok(())
    }

    /// K steps the fragment tiles stage per chunk for `format` weights whose scale groups span
    /// `steps_per_scale` steps, with `tiles` tiles per cube: as many as fit, up to eight
    /// ([`mma_frag::fragment_chunk_steps`]) or the cap [`Self::with_fragment_chunk_steps`] set.
    fn fragment_chunk_steps(
        &self,
        format: WeightFormat,
        steps_per_scale: usize,
        tiles: usize,
        (tensor_cores, operand): (bool, ActDType),
    ) -> Option<usize> {
        let fmt = format.kernel_code();
        let layout = self
            .fragment_shape
            .cube((tiles, 1, false), fmt, (tensor_cores, operand));
        mma_frag::fragment_chunk_steps(
            fmt,
            steps_per_scale.min(self.fragment_chunk.unwrap_or(usize::MAX)),
            layout,
            operand.size(),
            tensor_cores,
            self.max_shared_bytes(),
        )
    }

    /// One grouped MoE product on the fragment tiles (what [`Self::grouped_product`] launches for the
    /// tiles' order when [`Self::fragment_tiles`]): `input · a_e^T`, or with `swiglu` `silu(input ·
    /// a_e^T) * (input · b_e^T)`, into the f32 buffer `y`.
    pub(crate) fn launch_grouped_fragments(
        &self,
        input: &DeviceBuffer,
        routing: &RoutingTable,
        ab: [&DeviceWeights; 2],
        y: &DeviceBuffer,
        (swiglu, gather): (bool, bool),
        path: (bool, ActDType),
    ) {
        let layout = routing.layout();
        let call = FragmentCall::moe(
            routing.tokens(),
            routing.top_k(),
            routing.experts(),
            layout.tiles,
        );
        let cube = self.fragment_cube(ab[0], call, path);
        let table = (&routing.table, layout.rows_at(), layout.offsets_at());
        let grid = (layout.tiles, 0);
        self.launch_fragment_kernel(
            input,
            y,
            ab,
            table,
            grid,
            (swiglu, gather, false),
            path,
            cube,
        );
    }

    /// The dense product `y[n, out] = x[n, inn] W^T` on the fragment tiles (what the tiles' order
    /// launches when [`Self::fragment_tiles`], after [`Self::check_tiles`] and [`Self::check_fragments`]),
    /// `y` in its own type, rounded once.
    pub(crate) fn launch_dense_fragments(
        &self,
        x: &DeviceBuffer,
        y: &DeviceBuffer,
        n: usize,
        w: &DeviceWeights,
        path: (bool, ActDType),
    ) -> Result<(), KernelError> {
        let cube = self.fragment_cube(w, FragmentCall::dense(n), path);
        let cubes = n.div_ceil(cube.assignments());
        if cubes > MAX_GRID {
            return Err(KernelError::Shape(format!(
                "fragment tiles on {n} tokens: {cubes} cubes of {}, beyond the {MAX_GRID} a launch \
                 grid holds; split the call",
                cube.assignments()
            )));
        }
        // No table: any buffer.
        let table = (&self.lut, 0, 0);
        self.launch_fragment_kernel(
            x,
            y,
            [w, w],
            table,
            (cubes, n),
            (false, false, true),
            path,
            cube,
        );
        Ok(())
    }

    /// The compiled layout of a call of `w` whose experts take `per_expert` assignments on average (the
    /// dense product: its tokens): the shape's tiles for them ([`FragmentShape::tiles_for`]), as many K
    /// steps per chunk as fit ([`Self::fragment_chunk_steps`]; [`Self::check_fragments`] has checked
    /// that one does), whole chunks where they are ([`FragCube::whole_chunks`]).
    fn fragment_cube(
        &self,
        w: &DeviceWeights,
        call: FragmentCall,
        (tensor_cores, operand): (bool, ActDType),
    ) -> FragCube {
        let tiles = self.fragment_shape.tiles_for(call.per_expert);
        let (_, steps_per_scale) = tile_steps(w);
        let chunk_steps = self
            .fragment_chunk_steps(w.format, steps_per_scale, tiles, (tensor_cores, operand))
            .expect("checked by check_fragments");
        let full = FragCube::whole_chunks(chunk_steps, w.inn, steps_per_scale);
        let fmt = w.format.kernel_code();
        let cube =
            self.fragment_shape
                .cube((tiles, chunk_steps, full), fmt, (tensor_cores, operand));
        self.split_groups(cube, w, call, (tensor_cores, operand))
    }

    /// Sets of planes the fragment tiles split the scale groups of `w` among (1: not split) for `call`
    /// on `path`'s operands: what a bench or a test reports of the layout
    /// ([`FragmentShape::with_group_splits`]). An error where the fragment tiles cannot run it.
    pub fn fragment_group_splits(
        &self,
        w: &DeviceWeights,
        call: FragmentCall,
        path: (bool, ActDType),
    ) -> Result<usize, KernelError> {
        self.check_fragments(w.format, path)?;
        Ok(self.fragment_cube(w, call, path).splits)
    }

    /// `cube` with its scale groups split among sets of planes where the shape allows it
    /// ([`FragmentShape::splits_for`], given the call's busy tiles), the cube holds one tile, every
    /// chunk is whole and every group whole chunks, and the inputs staged whole (the call's most rows
    /// per tile) fit in shared memory; else `cube` as it is. (Fewer sets are tried where more do not
    /// fit, but they save only the exchanged sums: the staged inputs and the word slabs, `splits x rows`
    /// rows, take the same bytes at every split. The bound on a tile's rows holds by construction: a
    /// routing table's tiles hold at most 16 assignments and no more than the call has,
    /// [`FragmentCall`]; a tile past it would store rows computed from other rows' inputs.)
    fn split_groups(
        &self,
        cube: FragCube,
        w: &DeviceWeights,
        call: FragmentCall,
        (tensor_cores, operand): (bool, ActDType),
    ) -> FragCube {
        let (steps, steps_per_scale) = tile_steps(w);
        if cube.m_tiles > 1 || !cube.full_chunks || steps % steps_per_scale != 0 {
            return cube;
        }
        let cubes = w.out.div_ceil(cube.rows()) * call.busy_tiles.max(1);
        let fill = self
            .client
            .properties()
            .hardware
            .num_streaming_multiprocessors
            .map_or(usize::MAX, |n| 2 * n as usize);
        let mut splits = self
            .fragment_shape
            .splits_for(steps / steps_per_scale, cubes, fill);
        let fmt = w.format.kernel_code();
        while splits > 1 {
            let split = cube.with_split_groups(splits, w.inn, call.most_rows);
            let bytes = mma_frag::grouped_fragments_shared_bytes(
                fmt,
                split,
                operand.size(),
                true,
                tensor_cores,
            );
            if bytes <= self.max_shared_bytes() {
                return split;
            }
            splits /= 2;
        }
        cube
    }

    /// Launches [`mma_frag::grouped_fragments`] in the layout `cube` over `cubes` cubes of tiles: with
    /// `table` (the routing table's buffer, where its rows and offsets start) the grouped products of
    /// `[a, b]` (`swiglu`, `gather`), or with `dense` the product of `a` over `tokens` tokens (the table
    /// any buffer). `y` takes the kernel's output type (f32 for the grouped products).
    #[allow(clippy::too_many_arguments)]
    fn launch_fragment_kernel(
        &self,
        input: &DeviceBuffer,
        y: &DeviceBuffer,
        [a, b]: [&DeviceWeights; 2],
        (table, rows_at, offsets_at): (&DeviceBuffer, usize, usize),
        (cubes, tokens): (usize, usize),
        (swiglu, gather, dense): (bool, bool, bool),
        (tensor_cores, operand): (bool, ActDType),
        cube: FragCube,
    ) {
        let (steps, steps_per_scale) = tile_steps(a);
        mma_frag::grouped_fragments::launch(
            &self.client,
            CubeCount::Static(a.out.div_ceil(cube.rows()) as u32, cubes as u32, 1),
            CubeDim::new_2d(MMA_PLANE as u32, FRAG_PLANES as u32),
            input.arg(),
            table.arg(),
            rows_at,
            offsets_at,
            tokens,
            a.words.arg(),
            a.scales.arg(),
            b.words.arg(),
            b.scales.arg(),
            self.lut.arg(),
            y.arg(),
            a.out,
            a.inn,
            a.wpr(),
            a.spr(),
            // The dense product's one matrix is expert 0: the strides are never used.
            a.expert_words(),
            a.expert_scales(),
            steps,
            steps_per_scale,
            a.format.kernel_code(),
            a.format.kernel_group(),
            swiglu,
            gather,
            dense,
            tensor_cores,
            cube,
            [input.dtype.elem(), operand.elem(), y.dtype.elem()],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shapes beyond what a unit's registers hold are refused with an error naming them; the tiles per
    /// cube follow the assignments per expert, at most the shape's.
    #[test]
    fn fragment_shapes_are_checked_and_follow_the_call() {
        for (m, blocks) in [(0, 1), (3, 1), (5, 1), (1, 0), (1, 3), (4, 2)] {
            let err = FragmentShape::new(m, blocks, false)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("{m} tiles x {blocks} blocks")),
                "{err}"
            );
        }
        let shape = FragmentShape::new(4, 1, true).unwrap();
        let tiles: Vec<usize> = [0, 1, 16, 17, 33, 48, 64, 65, 4096]
            .map(|n| shape.tiles_for(n))
            .into();
        assert_eq!(tiles, [1, 1, 1, 2, 4, 4, 4, 4, 4]);
        assert_eq!(FragmentShape::new(2, 2, false).unwrap().tiles_for(1000), 2);
        assert_eq!(FragmentShape::default().tiles_for(1000), 1);
    }

    /// The scale groups split only where a call's cubes are fewer than the fill (twice the
    /// multiprocessors), doubling while they stay so, never past the shape's most, the groups, or 4;
    /// other split counts are refused with an error naming them.
    #[test]
    fn groups_split_where_the_cubes_are_few() {
        let shape = FragmentShape::default().with_group_splits(4).unwrap();
        // Qwen3-30B-A3B's block on an H200 (fill 264): gate-up at one token (96 cubes of 64 rows,
        // 16 groups), down (256 cubes, 6 groups), and gate-up at 16 tokens (972 cubes).
        assert_eq!(shape.splits_for(16, 96, 264), 4);
        assert_eq!(shape.splits_for(6, 256, 264), 2);
        assert_eq!(shape.splits_for(16, 972, 264), 1);
        // Bounded by the groups and the shape; any fill where the runtime names no multiprocessors.
        assert_eq!(shape.splits_for(3, 1, 264), 2);
        assert_eq!(shape.splits_for(1, 1, 264), 1);
        assert_eq!(shape.splits_for(64, 10_000, usize::MAX), 4);
        let two = FragmentShape::default().with_group_splits(2).unwrap();
        assert_eq!(two.splits_for(16, 1, 264), 2);
        assert_eq!(FragmentShape::default().splits_for(16, 1, 264), 1);
        for bad in [0, 3, 8] {
            let err = FragmentShape::default()
                .with_group_splits(bad)
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("split {bad} ways")), "{err}");
        }
    }
}
