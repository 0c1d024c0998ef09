//! Launchers of the grouped MoE block ([`crate::kernels::moe`], [`crate::kernels::mma_moe`]): the routing
//! table (uploaded from the host, or built on the device from the router's ids), the rollout's forward
//! on the grouped GEMV, the 16-assignment tiles or the tensor-core tiles, and the decode path's fused
//! down projection and combine. The training forward and backward are in [`super::moe_train`].

use cubecl::prelude::*;

use super::{
    expect_len, grid, tile_steps, DeviceBuffer, DeviceWeights, Kernels, MatmulPath, MAX_GRID,
    SHARED_FLOATS,
};
use crate::dtype::ActDType;
use crate::error::KernelError;
use crate::format::WeightFormat;
use crate::kernels::mma::{MMA, MMA_PLANE};
use crate::kernels::mma_moe::{self, MOE_MMA_ROW_TILES};
use crate::kernels::{moe as moe_kernels, BLOCK, CHUNK, TILE};
use crate::moe::{MoeRouting, RoutingTable};

impl Kernels {
    /// These kernels with the MoE decode's down projection and combine always fused into one launch
    /// (`Some(true)`), always two (`Some(false)`), or by [`Self::fuses_decode_combine`] (`None`): the
    /// same bits every way; for tests, and for timing the choice.
    pub fn with_decode_combine(mut self, fused: Option<bool>) -> Self {
        self.fused_combine = fused;
        self
    }

    /// These kernels with the grouped GEMV taking up to `Some(n)` assignments of a tile at once (each
    /// weight decoded once for them, [`crate::kernels::chunk_dots`](fn@crate::kernels::chunk_dots); never
    /// more than the experts average, so a step with one assignment per expert runs the one-per-pass kernel),
    /// or by [`Self::gemv_assignments_per_pass`]'s rule (`None`): the same bits every way; for tests, and for
    /// timing the choice.
    pub fn with_gemv_assignments_per_pass(mut self, n: Option<usize>) -> Self {
        self.gemv_per_pass = n.map(|n| n.clamp(1, Self::MAX_GEMV_ASSIGNMENTS_PER_PASS));
        self
    }

    /// These kernels with the grouped GEMV holding each tile's packed weights in registers across its
    /// passes (`Some(true)`: loaded once per tile, before the first pass's staging;
    /// [`crate::kernels::moe::grouped_gemv`](fn@crate::kernels::moe::grouped_gemv)'s `resident`), never
    /// (`Some(false)`), or by [`Self::holds_gemv_words`]'s rule (`None`): the same bits every way; for tests,
    /// and for timing the choice. Where a unit's words would pass [`moe_kernels::MAX_RESIDENT_WORDS`] or the
    /// format's scales vary within a chunk, the kernel loads them per pass whatever this says.
    pub fn with_resident_gemv_words(mut self, held: Option<bool>) -> Self {
        self.gemv_resident = held;
        self
    }

    /// Whether the grouped GEMV holds a tile's weights in registers, unless
    /// [`Self::with_resident_gemv_words`] says: not yet, the kernel the H200 timed on 2026-12-04 loads
    /// them per chunk and pass; `qarl bench kernels` times both (`moe/decode-split-r`) and the rule
    /// follows what a GPU says.
    pub fn holds_gemv_words(&self) -> bool {
        self.gemv_resident.unwrap_or(false)
    }

    /// The grouped GEMV's cube for projection `a` at `per_pass` assignments a pass (one where that
    /// has no cube), and whether it holds its words: the held cube where [`Self::holds_gemv_words`]
    /// and [`gemv_can_hold`] on that cube, else the one that loads them per pass. `None`: no GEMV
    /// cube (the tiles run).
    fn gemv_launch_shape(
        &self,
        a: &DeviceWeights,
        swiglu: bool,
        per_pass: usize,
    ) -> Option<(GemvShape, bool)> {
        let shape = |held| {
            grouped_gemv_shape(a.inn, a.out, swiglu, per_pass, held)
                .or_else(|| grouped_gemv_shape(a.inn, a.out, swiglu, 1, held))
        };
        let held = self
            .holds_gemv_words()
            .then(|| shape(true))
            .flatten()
            .filter(|s| gemv_can_hold(a.format, a.inn, (s.chunks, s.lanes), swiglu));
        match held {
            Some(s) => Some((s, true)),
            None => shape(false).map(|s| (s, false)),
        }
    }

    /// Most assignments the grouped GEMV takes at once: a tile's 16 would leave a cube room for one row's
    /// sums at 2048 inputs with SwiGLU.
    pub const MAX_GEMV_ASSIGNMENTS_PER_PASS: usize = 4;

    /// Assignments the grouped GEMV takes at once, unless [`Self::with_gemv_assignments_per_pass`] says:
    /// one, the kernel the H200 timed on 2026-12-04. Several (each weight decoded once, one fused
    /// multiply-add per assignment) is timed beside it by `qarl bench kernels` (`moe/decode-split-p4`)
    /// and becomes the rule if a GPU says it pays.
    pub fn gemv_assignments_per_pass(&self) -> usize {
        self.gemv_per_pass.unwrap_or(1)
    }

    /// Whether the grouped GEMV's path fuses the down projection and the combine, unless
    /// [`Self::with_decode_combine`] says. Fused, a cube computes one token's slots, so an expert's rows
    /// are read once per assignment; apart, the down projection runs per 16-assignment tile and reads
    /// them once per expert, at the price of a launch. The first rule, fused while `assignments <=
    /// experts` (a count: at most ~1.6x the bytes there), lost on an H200 (2026-12-04, `qarl bench
    /// kernels`, int4-g128, bf16, Qwen3-30B-A3B's block): the fused launch took 87.7 / 1023 / 4003 us
    /// at 1 / 16 / 64 tokens against 50.4 / 341 / 1214 us for the two launches (its cubes of one
    /// token's slots hold fewer rows and read them once per slot), so the two launches are the rule
    /// everywhere and fusing is there to be asked for.
    pub fn fuses_decode_combine(&self) -> bool {
        self.fused_combine.unwrap_or(false)
    }

    /// The MoE block on `x [tokens, hidden]`: grouped gate+up with SwiGLU, grouped down projection, then
    /// un-permute and combine with `route_w [tokens, top_k]` (slot order). `gate`/`up` are stacks
    /// `[experts, inter, hidden]`, `down` is `[experts, hidden, inter]`, all of one format. Three launches,
    /// or two on the grouped GEMV's path where [`Self::fuses_decode_combine`] (decode: the down
    /// projection and the combine in one), plus two with fp8-b128 (which quantizes `x` and the SwiGLU
    /// output first), and one upload (the routing table); the arithmetic is the contract in [`crate::kernels::moe`], which [`crate::reference::moe`]
    /// computes on the host. `x` and `route_w` are of one element type, the output's; `h` and the
    /// per-assignment outputs stay f32 (one rounding, on the combine's store).
    pub fn moe(
        &self,
        x: &DeviceBuffer,
        routing: &MoeRouting,
        route_w: &DeviceBuffer,
        gate: &DeviceWeights,
        up: &DeviceWeights,
        down: &DeviceWeights,
    ) -> Result<DeviceBuffer, KernelError> {
        self.moe_with(x, routing, route_w, [gate, up, down], MatmulPath::Auto)
    }

    /// [`Self::moe`] with the grouped products on the kernel `path` picks (the same bits either way).
    pub fn moe_with(
        &self,
        x: &DeviceBuffer,
        routing: &MoeRouting,
        route_w: &DeviceBuffer,
        weights: [&DeviceWeights; 3],
        path: MatmulPath,
    ) -> Result<DeviceBuffer, KernelError> {
        let table = self.upload_routing(routing);
        self.moe_routed(x, &table, route_w, weights, path)
    }

    /// The routing table of a host routing on the device (one upload).
    pub fn upload_routing(&self, routing: &MoeRouting) -> RoutingTable {
        RoutingTable {
            table: self.upload_u32(&routing.table()),
            tokens: routing.tokens(),
            top_k: routing.top_k(),
            experts: routing.experts(),
            layout: routing.layout(),
        }
    }

    /// [`Self::moe_with`] on a routing table already on the device ([`Self::route`],
    /// [`Self::upload_routing`]): no upload, no read, the launch grid from the table's sizes.
    pub fn moe_routed(
        &self,
        x: &DeviceBuffer,
        routing: &RoutingTable,
        route_w: &DeviceBuffer,
        [gate, up, down]: [&DeviceWeights; 3],
        path: MatmulPath,
    ) -> Result<DeviceBuffer, KernelError> {
        self.check_moe(x, routing, route_w, [gate, up, down])?;
        let (tokens, hidden, inter) = (routing.tokens(), gate.inn, gate.out);
        let layout = routing.layout();
        let out = self.empty(tokens * hidden, x.dtype);
        if layout.tiles == 0 || hidden == 0 {
            // No assignment (top-0 routing): every token's output is the empty sum.
            if tokens * hidden > 0 {
                self.fill_words(&out, 0);
            }
            return Ok(out);
        }
        let kernel = self.moe_kernel(path, tokens, gate.format, x.dtype)?;
        let xq = self.prepare(x, tokens, gate)?;
        let h = self.empty_f32(layout.assignments * inter);
        if inter > 0 {
            // gate+up fused with SwiGLU, gathering the token rows.
            self.grouped_product(&xq, routing, [gate, up], &h, true, true, kernel);
        }
        if kernel == GroupedKernel::Gemv && self.fuses_decode_combine() {
            self.fused_down_and_combine(&h, routing, route_w, down, &out)?;
        } else {
            self.down_and_combine(&h, routing, route_w, down, &out, kernel)?;
        }
        Ok(out)
    }

    /// The kernel of the grouped products of an MoE call on `tokens` tokens of `dtype` activations with
    /// `format` weights: the GEMV or the tiles (by `path`, or by size under [`MatmulPath::Auto`]; the same
    /// bits either way), or the tensor-core tiles' order ([`MatmulPath::tiles`]; its own bits), refused
    /// where it cannot run ([`Self::check_tiles`]).
    pub(crate) fn moe_kernel(
        &self,
        path: MatmulPath,
        tokens: usize,
        format: WeightFormat,
        dtype: ActDType,
    ) -> Result<GroupedKernel, KernelError> {
        Ok(match path {
            MatmulPath::Auto if tokens <= Self::MOE_GEMV_MAX_TOKENS => GroupedKernel::Gemv,
            MatmulPath::Auto => GroupedKernel::Tiled,
            MatmulPath::Gemv => GroupedKernel::Gemv,
            MatmulPath::Gemm | MatmulPath::Blocked => GroupedKernel::Tiled,
            MatmulPath::Mma | MatmulPath::GroupedScalar | MatmulPath::Tiles { .. } => {
                let tiles = path.tiles(dtype).expect("a tiles path");
                self.check_tiles(format, tiles)?;
                if self.fragment_tiles() {
                    self.check_fragments(format, tiles)?;
                }
                GroupedKernel::Tiles {
                    tensor_cores: tiles.0,
                    operand: tiles.1,
                }
            }
        })
    }

    /// Checks the shapes and types of a grouped MoE call ([`Self::moe_routed`]).
    pub(crate) fn check_moe(
        &self,
        x: &DeviceBuffer,
        routing: &RoutingTable,
        route_w: &DeviceBuffer,
        [gate, up, down]: [&DeviceWeights; 3],
    ) -> Result<(), KernelError> {
        let (tokens, top_k, experts) = (routing.tokens(), routing.top_k(), routing.experts());
        let (hidden, inter) = (gate.inn, gate.out);
        // The grouped products launch one row of cubes per 16-assignment tile, on a grid axis that
        // holds at most MAX_GRID (CUDA's and WebGPU's limit).
        let tiles = routing.layout().tiles;
        if tiles > MAX_GRID {
            return Err(KernelError::Shape(format!(
                "MoE call of {tokens} tokens x top-{top_k}: {tiles} tiles of 16 assignments, beyond \
                 the {MAX_GRID} a launch grid holds; split the call (a smaller micro-batch)"
            )));
        }
        for (name, w, shape) in [
            ("gate", gate, [inter, hidden]),
            ("up", up, [inter, hidden]),
            ("down", down, [hidden, inter]),
        ] {
            if w.experts != experts || [w.out, w.inn] != shape || w.format != gate.format {
                return Err(KernelError::Shape(format!(
                    "{name}: {} experts of [{}, {}] {}, expected {experts} of {shape:?} {}",
                    w.experts,
                    w.out,
                    w.inn,
                    w.format.name(),
                    gate.format.name()
                )));
            }
        }
        expect_len("moe input", x, tokens * hidden)?;
        expect_len("routing weights", route_w, tokens * top_k)?;
        self.check_dtype(x.dtype)?;
        if route_w.dtype != x.dtype {
            return Err(KernelError::Shape(format!(
                "routing weights are {}, activations {}: expected one type",
                route_w.dtype, x.dtype
            )));
        }
        Ok(())
    }

    /// The down projection of the SwiGLU outputs `h` (f32, sorted order) into the per-assignment outputs
    /// `y` (f32, returned) by `kernel`, then the combine into `out` with the routing weights.
    pub(crate) fn down_and_combine(
        &self,
        h: &DeviceBuffer,
        routing: &RoutingTable,
        route_w: &DeviceBuffer,
        down: &DeviceWeights,
        out: &DeviceBuffer,
        kernel: GroupedKernel,
    ) -> Result<DeviceBuffer, KernelError> {
        let (tokens, top_k, hidden) = (routing.tokens(), routing.top_k(), down.out);
        let layout = routing.layout();
        let hq = self.prepare(h, layout.assignments, down)?;
        let y = self.empty_f32(layout.assignments * hidden);
        self.grouped_product(&hq, routing, [down, down], &y, false, false, kernel);
        moe_kernels::combine::launch(
            &self.client,
            grid((tokens * hidden).div_ceil(256)),
            CubeDim::new_1d(256),
            y.arg(),
            routing.table.arg(),
            layout.positions_at(),
            route_w.arg(),
            out.arg(),
            tokens,
            hidden,
            top_k,
            out.dtype.elem(),
        );
        Ok(y)
    }

    /// [`Self::down_and_combine`] on the grouped GEMV's path without the per-assignment outputs, the same
    /// bits in one launch ([`moe_kernels::grouped_gemv_combine`]: the slots of a token side by side in a
    /// cube) where [`fused_combine_shape`] finds a cube for it, else the two launches.
    pub(crate) fn fused_down_and_combine(
        &self,
        h: &DeviceBuffer,
        routing: &RoutingTable,
        route_w: &DeviceBuffer,
        down: &DeviceWeights,
        out: &DeviceBuffer,
    ) -> Result<(), KernelError> {
        let (tokens, top_k, hidden, inter) =
            (routing.tokens(), routing.top_k(), down.out, down.inn);
        let chunks = inter.div_ceil(CHUNK).max(1);
        // No experts: nothing to read weights from (every id is out of range).
        let shape = fused_combine_shape(tokens, top_k, hidden, chunks);
        let Some((lanes, rows_per_cube)) = shape.filter(|_| routing.experts() > 0) else {
            self.down_and_combine(h, routing, route_w, down, out, GroupedKernel::Gemv)?;
            return Ok(());
        };
        let layout = routing.layout();
        let hq = self.prepare(h, layout.assignments, down)?;
        moe_kernels::grouped_gemv_combine::launch(
            &self.client,
            CubeCount::Static(hidden.div_ceil(rows_per_cube) as u32, tokens as u32, 1),
            CubeDim::new_3d(lanes as u32, rows_per_cube as u32, top_k as u32),
            hq.arg(),
            routing.table.arg(),
            layout.positions_at(),
            layout.experts_at(),
            down.words.arg(),
            down.scales.arg(),
            self.lut.arg(),
            route_w.arg(),
            out.arg(),
            hidden,
            inter,
            down.wpr(),
            down.spr(),
            down.expert_words(),
            down.expert_scales(),
            top_k,
            down.format.kernel_code(),
            down.format.kernel_group(),
            lanes,
            rows_per_cube,
            chunks,
            out.dtype.elem(),
        );
        Ok(())
    }

    /// One grouped product over the sorted assignments into the f32 buffer `y`: `input · a_e^T`, or with
    /// `swiglu` `silu(input · a_e^T) * (input · b_e^T)` (`b` the up projection); `gather` reads the input
    /// row of each assignment's token (else the input is already in sorted order). The grouped GEMV when
    /// `kernel` says so and its staging fits, else the tiled kernel (the same bits either way), or the
    /// tensor-core tiles' order.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn grouped_product(
        &self,
        input: &DeviceBuffer,
        routing: &RoutingTable,
        [a, b]: [&DeviceWeights; 2],
        y: &DeviceBuffer,
        swiglu: bool,
        gather: bool,
        kernel: GroupedKernel,
    ) {
        let layout = routing.layout();
        let table = &routing.table;
        if let GroupedKernel::Tiles {
            tensor_cores,
            operand,
        } = kernel
        {
            self.grouped_tiles(
                input,
                routing,
                [a, b],
                y,
                (swiglu, gather),
                (tensor_cores, operand),
            );
            return;
        }
        let gemv = kernel == GroupedKernel::Gemv;
        // A pass never takes more assignments than the experts average (`ceil(assignments / experts)`):
        // a decode step whose experts hold one assignment each runs the one-per-pass kernel itself, with
        // its staging and rows per cube. Where the larger pass has no cube, one per pass runs.
        let per_pass = self
            .gemv_assignments_per_pass()
            .min(layout.assignments.div_ceil(routing.experts().max(1)))
            .max(1);
        // The tiles fit one grid axis here: `check_moe` refuses more.
        if let Some((
            GemvShape {
                chunks,
                lanes,
                rows_per_cube,
                per_pass,
                stage_x,
            },
            hold,
        )) = self.gemv_launch_shape(a, swiglu, per_pass).filter(|_| gemv)
        {
            moe_kernels::grouped_gemv::launch(
                &self.client,
                CubeCount::Static(a.out.div_ceil(rows_per_cube) as u32, layout.tiles as u32, 1),
                CubeDim::new_2d(lanes as u32, rows_per_cube as u32),
                input.arg(),
                table.arg(),
                layout.rows_at(),
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
                a.expert_words(),
                a.expert_scales(),
                a.format.kernel_code(),
                a.format.kernel_group(),
                lanes,
                rows_per_cube,
                chunks,
                per_pass,
                swiglu,
                gather,
                stage_x,
                hold,
                input.dtype.elem(),
            );
            return;
        }
        moe_kernels::grouped_matmul::launch(
            &self.client,
            CubeCount::Static(a.out.div_ceil(BLOCK) as u32, layout.tiles as u32, 1),
            CubeDim::new_2d(BLOCK as u32, (TILE / 4) as u32),
            input.arg(),
            table.arg(),
            layout.rows_at(),
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
            a.expert_words(),
            a.expert_scales(),
            a.format.kernel_code(),
            a.format.kernel_group(),
            a.inn.div_ceil(CHUNK),
            swiglu,
            gather,
            input.dtype.elem(),
        );
    }

    /// [`Self::grouped_product`] on the tensor-core tiles' order ([`crate::kernels::mma_moe`]): operands
    /// of type `operand` (the input is rounded to it as it is staged), on tensor cores or with scalar FMAs.
    fn grouped_tiles(
        &self,
        input: &DeviceBuffer,
        routing: &RoutingTable,
        [a, b]: [&DeviceWeights; 2],
        y: &DeviceBuffer,
        (swiglu, gather): (bool, bool),
        (tensor_cores, operand): (bool, ActDType),
    ) {
        if self.fragment_tiles() {
            self.launch_grouped_fragments(
                input,
                routing,
                [a, b],
                y,
                (swiglu, gather),
                (tensor_cores, operand),
            );
            return;
        }
        let layout = routing.layout();
        let (steps, steps_per_scale) = tile_steps(a);
        let stage_steps = self.stage_steps(tensor_cores, |d| {
            mma_moe::grouped_tiles_shared_bytes(d, operand.size(), swiglu, tensor_cores)
        });
        mma_moe::grouped_tiles::launch(
            &self.client,
            CubeCount::Static(
                a.out.div_ceil(MMA * MOE_MMA_ROW_TILES) as u32,
                layout.tiles as u32,
                1,
            ),
            CubeDim::new_2d(MMA_PLANE as u32, MOE_MMA_ROW_TILES as u32),
            input.arg(),
            routing.table.arg(),
            layout.rows_at(),
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
            a.expert_words(),
            a.expert_scales(),
            steps,
            steps_per_scale,
            a.format.kernel_code(),
            a.format.kernel_group(),
            swiglu,
            gather,
            tensor_cores,
            stage_steps,
            [input.dtype.elem(), operand.elem()],
        );
    }
}

/// The kernel of a grouped MoE product ([`Kernels::moe_kernel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GroupedKernel {
    /// The grouped GEMV, where its staging fits (else the tiles): the canonical order.
    Gemv,
    /// The 16-assignment tiles: the canonical order.
    Tiled,
    /// The tensor-core tiles' order ([`crate::kernels::mma_moe`]) on `operand` operands, on tensor cores
    /// or with scalar FMAs.
    Tiles {
        tensor_cores: bool,
        operand: ActDType,
    },
}

/// How the grouped GEMV ([`moe_kernels::grouped_gemv`]) lays out a cube.
pub(crate) struct GemvShape {
    /// Chunks of [`CHUNK`] inputs per row (at least 1).
    pub chunks: usize,
    /// Units summing one row's chunks side by side.
    pub lanes: usize,
    pub rows_per_cube: usize,
    /// Assignments a lane takes at once (each weight decoded once for them).
    pub per_pass: usize,
    /// Whether the pass's input rows are staged in shared memory.
    pub stage_x: bool,
}

/// Whether the grouped GEMV holds a unit's packed words of `format` in registers for rows of `inn`
/// inputs in a cube of `lanes` lanes over `chunks` chunks: where the kernel can
/// ([`moe_kernels::can_hold`]) and the rows have a whole chunk (a projection of no inputs has no words
/// to load).
pub(crate) fn gemv_can_hold(
    format: WeightFormat,
    inn: usize,
    (chunks, lanes): (usize, usize),
    swiglu: bool,
) -> bool {
    let (fmt, group) = (format.kernel_code(), format.kernel_group());
    inn >= CHUNK && moe_kernels::can_hold(fmt, group, chunks, lanes, swiglu)
}

/// The grouped GEMV's cube for rows of `inn` inputs, `out` rows (two projections with `swiglu`),
/// `per_pass` assignments at a time: the chunk sums of a cube's rows (two sets with SwiGLU, one per
/// assignment of a pass) within WebGPU's 16 KiB of shared memory, beside the pass's input rows staged
/// when they fit; `None` when not even one row's sums fit (then the tiles run). A row's chunks are
/// spread over up to 32 lanes, or with `held` (the tile's words held in registers) up to 64: a lane
/// then holds one chunk per projection up to 2048 inputs, whose decoded weights the compiler keeps in
/// registers across the passes (64 per unit with SwiGLU; at 32 lanes, 128 and ~200 registers per unit
/// in the sm_90 assembly, one cube per multiprocessor).
pub(crate) fn grouped_gemv_shape(
    inn: usize,
    out: usize,
    swiglu: bool,
    per_pass: usize,
    held: bool,
) -> Option<GemvShape> {
    let chunks = inn.div_ceil(CHUNK).max(1);
    let sets = if swiglu { 2 } else { 1 } * per_pass;
    // An array the kernel does not use still takes one float (the up projection's sums without SwiGLU,
    // the staged rows without staging).
    let unused_sums = if swiglu { 0 } else { 1 };
    let staged = per_pass * crate::kernels::staged_row_floats(chunks);
    let stage_x = staged + chunks * sets + unused_sums <= SHARED_FLOATS;
    let taken = if stage_x { staged } else { 1 } + unused_sums;
    let budget = SHARED_FLOATS.checked_sub(taken)?;
    if per_pass == 0 || budget < chunks * sets {
        return None;
    }
    let lanes = chunks.min(if held { 64 } else { 32 });
    let rows_per_cube = (256 / lanes).min(budget / (chunks * sets)).min(out).max(1);
    (out.div_ceil(rows_per_cube) <= MAX_GRID).then_some(GemvShape {
        chunks,
        lanes,
        rows_per_cube,
        per_pass,
        stage_x,
    })
}

/// The cube of the fused down-and-combine for `tokens` tokens of `top_k` slots, `hidden` output rows and
/// `chunks` chunks per row: `(lanes, rows per cube)`, `lanes x rows x top_k` units within 256 (at most
/// 64 slots: the `z` dimension's limit on CUDA and WebGPU), the chunk sums of every slot in shared
/// memory beside the one float of the unused staging array; fewer lanes than chunks when the slots take
/// the room (each lane then sums several chunks). `None` where no such cube or grid exists.
pub(crate) fn fused_combine_shape(
    tokens: usize,
    top_k: usize,
    hidden: usize,
    chunks: usize,
) -> Option<(usize, usize)> {
    let units = 256;
    let budget = SHARED_FLOATS - 1;
    if top_k == 0 || top_k > 64 || top_k * chunks > budget || tokens > MAX_GRID {
        return None;
    }
    let lanes = chunks.min(32).min(units / top_k);
    let rows_per_cube = (units / (lanes * top_k))
        .min(budget / (top_k * chunks))
        .min(hidden)
        .max(1);
    (hidden.div_ceil(rows_per_cube) <= MAX_GRID).then_some((lanes, rows_per_cube))
}
