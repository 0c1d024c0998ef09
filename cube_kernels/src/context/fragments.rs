//! Launchers of the fragment tiles ([`crate::kernels::mma_frag`]): the tensor-core tiles' order with the
//! weights kept packed until the instruction's registers, for the grouped MoE products and the dense
//! product, when [`Kernels::with_fragment_tiles`] says so.

use cubecl::prelude::*;

use super::{tile_steps, DeviceBuffer, DeviceWeights, Kernels, MAX_GRID};
use crate::dtype::ActDType;
use crate::error::KernelError;
use crate::format::WeightFormat;
use crate::kernels::mma::{MMA, MMA_PLANE};
use crate::kernels::mma_frag::{self, FRAG_PLANES, FRAG_ROWS};
use crate::moe::RoutingTable;

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
        if self
            .fragment_chunk_steps(format, 1, (tensor_cores, operand))
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
    /// `steps_per_scale` steps: as many as fit, up to eight ([`mma_frag::fragment_chunk_steps`]) or
    /// the cap [`Self::with_fragment_chunk_steps`] set.
    fn fragment_chunk_steps(
        &self,
        format: WeightFormat,
        steps_per_scale: usize,
        (tensor_cores, operand): (bool, ActDType),
    ) -> Option<usize> {
        mma_frag::fragment_chunk_steps(
            format.kernel_code(),
            steps_per_scale.min(self.fragment_chunk.unwrap_or(usize::MAX)),
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
        [a, b]: [&DeviceWeights; 2],
        y: &DeviceBuffer,
        (swiglu, gather): (bool, bool),
        (tensor_cores, operand): (bool, ActDType),
    ) {
        let layout = routing.layout();
        let (steps, steps_per_scale) = tile_steps(a);
        let chunk_steps = self
            .fragment_chunk_steps(a.format, steps_per_scale, (tensor_cores, operand))
            .expect("checked by check_fragments");
        mma_frag::grouped_fragments::launch(
            &self.client,
            CubeCount::Static(a.out.div_ceil(FRAG_ROWS) as u32, layout.tiles as u32, 1),
            CubeDim::new_2d(MMA_PLANE as u32, FRAG_PLANES as u32),
            input.arg(),
            routing.table.arg(),
            layout.rows_at(),
            0,
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
            false,
            tensor_cores,
            chunk_steps,
            [input.dtype.elem(), operand.elem(), ActDType::F32.elem()],
        );
    }

    /// The dense product `y[n, out] = x[n, inn] W^T` on the fragment tiles (what the tiles' order
    /// launches when [`Self::fragment_tiles`], after [`Self::check_tiles`]), `y` in its own type, rounded
    /// once.
    pub(crate) fn launch_dense_fragments(
        &self,
        x: &DeviceBuffer,
        y: &DeviceBuffer,
        n: usize,
        w: &DeviceWeights,
        (tensor_cores, operand): (bool, ActDType),
    ) -> Result<(), KernelError> {
        self.check_fragments(w.format, (tensor_cores, operand))?;
        if n.div_ceil(MMA) > MAX_GRID {
            return Err(KernelError::Shape(format!(
                "fragment tiles on {n} tokens: {} tiles of 16, beyond the {MAX_GRID} a launch grid \
                 holds; split the call",
                n.div_ceil(MMA)
            )));
        }
        let (steps, steps_per_scale) = tile_steps(w);
        let chunk_steps = self
            .fragment_chunk_steps(w.format, steps_per_scale, (tensor_cores, operand))
            .expect("checked by check_fragments");
        mma_frag::grouped_fragments::launch(
            &self.client,
            CubeCount::Static(w.out.div_ceil(FRAG_ROWS) as u32, n.div_ceil(MMA) as u32, 1),
            CubeDim::new_2d(MMA_PLANE as u32, FRAG_PLANES as u32),
            x.arg(),
            // No table: any buffer.
            self.lut.arg(),
            0,
            n,
            w.words.arg(),
            w.scales.arg(),
            w.words.arg(),
            w.scales.arg(),
            self.lut.arg(),
            y.arg(),
            w.out,
            w.inn,
            w.wpr(),
            w.spr(),
            0,
            0,
            steps,
            steps_per_scale,
            w.format.kernel_code(),
            w.format.kernel_group(),
            false,
            false,
            true,
            tensor_cores,
            chunk_steps,
            [x.dtype.elem(), operand.elem(), y.dtype.elem()],
        );
        Ok(())
    }
}
