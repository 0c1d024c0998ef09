//! Host-side launchers: a [`Kernels`] value holds a runtime client and the E4M3 table, uploads weights
//! once ([`DeviceWeights`]) and launches the kernels on device buffers ([`DeviceBuffer`]).
//!
//! A buffer of activations carries its element type ([`ActDType`]: f32, f16, bf16); the matmuls read
//! activations of that type and write their result in the same type, under the precision contract of
//! [`crate::kernels`] (f32 sums, one rounding on store). [`Kernels::supports`] says which types the
//! device has; a launch on another is [`KernelError::Unsupported`].

mod exact;
mod fragments;
mod graph;
pub(crate) mod moe;
mod moe_train;
mod route;

use cubecl::prelude::*;

pub use crate::buffer::DeviceBuffer;
use crate::dtype::ActDType;
use crate::e4m3::e4m3_table;
use crate::error::KernelError;
use crate::format::{PackedWeights, WeightFormat, FP8_BLOCK};
use crate::kernels::mma::{self, MMA, MMA_PLANE, MMA_ROW_TILES, MMA_TOKEN_TILES};
use crate::kernels::mma_moe;
use crate::kernels::{dense, fp8, BLOCK, CHUNK, TILE};
pub use fragments::{FragmentCall, FragmentShape};
pub use graph::Recorded;
pub use moe_train::{MoeActivations, MoeGradients};

/// Packed weights (one matrix or a stack of experts) uploaded to the device.
#[derive(Clone)]
pub struct DeviceWeights {
    format: WeightFormat,
    experts: usize,
    out: usize,
    inn: usize,
    words: DeviceBuffer,
    scales: DeviceBuffer,
    bytes: usize,
}

impl DeviceWeights {
    /// The format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }
    /// Output rows (per expert).
    pub fn out_features(&self) -> usize {
        self.out
    }
    /// Inputs per row.
    pub fn in_features(&self) -> usize {
        self.inn
    }
    /// Stacked experts.
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Bytes of codes and scales (what one pass streams).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    fn wpr(&self) -> usize {
        self.format.row_words(self.inn)
    }
    fn spr(&self) -> usize {
        self.format.scale_grid(0, self.inn)[1]
    }
    fn expert_words(&self) -> usize {
        self.out * self.wpr()
    }
    fn expert_scales(&self) -> usize {
        let [r, c] = self.format.scale_grid(self.out, self.inn);
        r * c
    }
}

/// Which matmul kernel serves a call. `Auto`, `Gemv`, `Gemm` and `Blocked` give the same bits (the
/// canonical order); for the MoE block `Gemv` is the grouped GEMV (per tile, assignment by assignment), and
/// `Gemm` and `Blocked` the 16-assignment register tiles. The tensor-core tiles' paths (`Mma`, `GroupedScalar`, `Tiles`) sum in their
/// own order, batch-invariant too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulPath {
    /// GEMV up to [`Kernels::GEMV_MAX_TOKENS`] tokens ([`Kernels::MOE_GEMV_MAX_TOKENS`] for the MoE block);
    /// above, 64 x 64 blocks when they make at least [`Kernels::BLOCKED_MIN_CUBES`] cubes, else 16 x 16 tiles.
    Auto,
    /// One cube row per token and output row (decode).
    Gemv,
    /// 16 x 16 tiles, one output per unit.
    Gemm,
    /// 64 x 64 blocks, 4 x 4 outputs per unit (prefill, training).
    Blocked,
    /// Tensor-core tiles with half activations ([`crate::kernels::mma`]): another summation order than the
    /// others (never chosen by `Auto`), the same bits at every batch size. Where [`Kernels::supports_mma`].
    Mma,
    /// [`MatmulPath::Mma`]'s tiles, staging and scale groups with scalar fused multiply-adds in place of
    /// the instruction: any runtime and activation type (tests check the tiles' indexing with it on
    /// lavapipe); its own bits, batch-invariant.
    GroupedScalar,
    /// The tensor-core tiles' order with operands of type `operand` whatever the activations' type: the
    /// input is rounded to it as it is staged (exact for f32 activations holding widened half values,
    /// which is how a mixed-precision training forward calls it) and the result has the activations'
    /// type. On the instruction when `tensor_cores` ([`MatmulPath::Mma`]'s bits on half inputs), else with
    /// scalar FMAs ([`MatmulPath::GroupedScalar`]'s).
    Tiles {
        tensor_cores: bool,
        operand: ActDType,
    },
}

impl MatmulPath {
    /// This path's tensor-core tiles' order on activations of type `dtype` (whether on the instruction,
    /// and the operands' type), or `None` for the canonical kernels. [`MatmulPath::Mma`] and
    /// [`MatmulPath::GroupedScalar`] take the activations' own type as operands.
    pub fn tiles(self, dtype: ActDType) -> Option<(bool, ActDType)> {
        match self {
            MatmulPath::Mma => Some((true, dtype)),
            MatmulPath::GroupedScalar => Some((false, dtype)),
            MatmulPath::Tiles {
                tensor_cores,
                operand,
            } => Some((tensor_cores, operand)),
            _ => None,
        }
    }
}

/// A runtime client with the kernels' shared tables. Clones share the client and the tables.
#[derive(Clone)]
pub struct Kernels {
    client: Client,
    lut: DeviceBuffer,
    /// K steps the tiles stage per pair of barriers ([`Self::stage_steps`]).
    staging: Staging,
    /// Whether the grouped GEMV's path runs the down projection and the combine as one launch; `None`:
    /// by [`Self::fuses_decode_combine`]'s rule ([`Self::with_decode_combine`]).
    fused_combine: Option<bool>,
    /// Assignments the grouped GEMV takes at once; `None`: by [`Self::gemv_assignments_per_pass`]'s rule
    /// ([`Self::with_gemv_assignments_per_pass`]).
    gemv_per_pass: Option<usize>,
    /// Whether the grouped GEMV holds a tile's weights in registers across its passes; `None`: by
    /// [`Self::holds_gemv_words`]'s rule ([`Self::with_resident_gemv_words`]).
    gemv_resident: Option<bool>,
    /// Whether routing on the device runs in three launches over blocks of ids; `None`: by
    /// [`Self::routes_in_blocks`]'s rule ([`Self::with_block_routing`]).
    block_routing: Option<bool>,
    /// Whether the tensor-core tiles' order runs on the fragment tiles ([`crate::kernels::mma_frag`])
    /// rather than [`crate::kernels::mma`]'s and [`crate::kernels::mma_moe`]'s
    /// ([`Self::with_fragment_tiles`]).
    fragment_tiles: bool,
    /// Most K steps the fragment tiles stage per chunk; `None`: as many as fit, up to eight
    /// ([`Self::with_fragment_chunk_steps`]).
    fragment_chunk: Option<usize>,
    /// The fragment tiles' cubes ([`Self::with_fragment_shape`]).
    fragment_shape: FragmentShape,
    /// Whether fresh outputs are filled with all-ones bits ([`Self::with_poisoned_outputs`]).
    poison_outputs: bool,
}

/// How many K steps the tiles stage per pair of barriers ([`Kernels::stage_steps`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Staging {
    /// One on the instruction, as many as fit with scalar FMAs.
    Default,
    /// As many as fit on both ([`Kernels::with_most_tile_stage_steps`]).
    Most,
    /// This count ([`Kernels::with_tile_stage_steps`]; [`Kernels::check_tiles`] checks that it fits).
    Fixed(usize),
}

/// Most K steps the tiles stage at once: 4 steps of 16 inputs cut the barriers per instruction by 4.
pub const MAX_STAGE_STEPS: usize = 4;

/// The K steps a tile kernel stages per pair of barriers on a device with `max_shared` bytes of shared
/// memory per cube: the most of 4, 2, 1 whose allocation (`shared_bytes(steps)`) fits. The bits do not
/// depend on it, only the barrier count.
pub fn tile_stage_steps(max_shared: usize, shared_bytes: impl Fn(usize) -> usize) -> usize {
    [MAX_STAGE_STEPS, 2, 1]
        .into_iter()
        .find(|&steps| shared_bytes(steps) <= max_shared)
        .unwrap_or(1)
}

impl Kernels {
    /// Token counts up to this use the GEMV. On an H200 (`qarl bench kernels`, [768, 2048] weights) the
    /// GEMV was ahead of the 16 x 16 tiles up to 64 tokens for int4 and int8 on CUDA and Vulkan (fp8 on
    /// CUDA: 96 against 79 us at 64 tokens), and behind for every format at 256.
    pub const GEMV_MAX_TOKENS: usize = 64;
    /// Token counts up to this run the MoE block's grouped GEMV instead of its 16-assignment tiles (on the
    /// H200, Qwen3-30B-A3B expert shapes, int4-g128, bf16, 2026-12-04: the GEMV's decode path took 341
    /// and 1214 us at 16 and 64 tokens against 1160 and 1769 us for the tiles; at 256 the GEMV took 4517
    /// against 2597 us).
    pub const MOE_GEMV_MAX_TOKENS: usize = 64;
    /// The most experts [`Self::route`] routes: its cubes keep two words per expert (the offsets and
    /// the first tiles) and a round of ids in shared memory.
    pub const MAX_ROUTED_EXPERTS: usize =
        (SHARED_FLOATS - crate::kernels::route::ROUTE_UNITS) / 2 - 1;
    /// Cubes below which the dense GEMM runs 16 x 16 tiles rather than 64 x 64 blocks: the blocks move a
    /// fourth of the staged bytes per multiply-add, but a grid of fewer cubes than about twice the
    /// multiprocessors leaves most of the device idle (an H200 has 132).
    pub const BLOCKED_MIN_CUBES: usize = 256;

    /// Kernels on `device` (panics only if the build does not link its runtime; use the named
    /// constructors to get an error instead).
    pub fn new(device: &cubecl::Device) -> Self {
        Self::from_client(device.client())
    }

    /// Kernels on the device of an existing client (burn's CubeCL tensors carry one).
    pub fn from_client(client: Client) -> Self {
        let table = e4m3_table();
        let lut = DeviceBuffer {
            handle: client.create_from_slice(f32::as_bytes(&table)),
            len: table.len(),
            dtype: ActDType::F32,
        };
        Kernels {
            client,
            lut,
            staging: Staging::Default,
            fused_combine: None,
            gemv_per_pass: None,
            gemv_resident: None,
            block_routing: None,
            fragment_tiles: false,
            fragment_chunk: None,
            fragment_shape: FragmentShape::default(),
            poison_outputs: false,
        }
    }

    /// These kernels with the tensor-core tiles staging `steps` K steps per pair of barriers (`None`: as
    /// many as the device's shared memory holds): for tests, which check the bits do not depend on it,
    /// and for timing the choice. A count whose allocation the device cannot hold is refused when the
    /// tiles are asked for, with an error naming it.
    pub fn with_tile_stage_steps(mut self, steps: Option<usize>) -> Self {
        self.staging = steps.map_or(Staging::Default, Staging::Fixed);
        self
    }

    /// These kernels with the tensor-core tiles staging as many K steps as the device's shared memory
    /// holds (up to [`MAX_STAGE_STEPS`]), as the scalar twins do: the alternative to their default of
    /// one, for timing the choice. It replaces a count [`Self::with_tile_stage_steps`] fixed.
    pub fn with_most_tile_stage_steps(mut self) -> Self {
        self.staging = Staging::Most;
        self
    }

    /// The K steps per stage for a tile kernel whose allocation is `shared_bytes(steps)`: the fixed count
    /// ([`Self::check_tiles`] has checked that it fits); else by default one on the instruction
    /// (`tensor_cores`) and as many as fit with scalar FMAs, or as many as fit on both. On an H200 (2026-12-04, `qarl bench kernels`, int4-g128, bf16,
    /// Qwen3-30B-A3B expert shapes) four steps took 1.05-1.07x one step's time on the instruction for the
    /// MoE block at 16-4096 tokens and 1.2-1.4x for one [768, 2048] weight at 1-4096 tokens, while with
    /// scalar FMAs one step took 1.03-1.5x four steps' time. The bits never depend on it.
    fn stage_steps(&self, tensor_cores: bool, shared_bytes: impl Fn(usize) -> usize) -> usize {
        match self.staging {
            Staging::Fixed(steps) => steps,
            Staging::Default if Self::stages_one_step_by_default(tensor_cores) => 1,
            Staging::Default | Staging::Most => {
                tile_stage_steps(self.max_shared_bytes(), shared_bytes)
            }
        }
    }

    /// Whether the tiles stage one K step per pair of barriers by default (on the instruction), rather
    /// than as many as fit (the scalar twins; `Self::stage_steps` says why): what a benchmark timing
    /// "the other" staging beside the default needs to know.
    pub fn stages_one_step_by_default(tensor_cores: bool) -> bool {
        tensor_cores
    }

    /// Shared memory one cube may allocate on this device, in bytes.
    fn max_shared_bytes(&self) -> usize {
        self.client.properties().hardware.max_shared_memory_size
    }

    /// The wgpu runtime's default adapter (a GPU, or lavapipe on a CPU-only machine).
    #[cfg(feature = "wgpu")]
    pub fn wgpu() -> Result<Self, KernelError> {
        let device = cubecl::Device::wgpu(cubecl::device::WgpuDeviceKind::DefaultDevice)
            .map_err(|e| KernelError::NoDevice(e.to_string()))?;
        Ok(Self::new(&device))
    }

    /// The CUDA device `index`.
    #[cfg(feature = "cuda")]
    pub fn cuda(index: usize) -> Result<Self, KernelError> {
        let device =
            cubecl::Device::cuda(index).map_err(|e| KernelError::NoDevice(e.to_string()))?;
        Ok(Self::new(&device))
    }

    /// The runtime's name for its adapter.
    pub fn device_name(&self) -> String {
        self.client.name().to_owned()
    }

    /// The client, for callers that launch their own kernels on the same device.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Whether the device can hold and convert activations of `dtype` ([`ActDType::usable_on`]).
    pub fn supports(&self, dtype: ActDType) -> bool {
        dtype.usable_on(self.client.properties())
    }

    /// Whether the device has the `m16n16k16` tensor-core instruction on `dtype` operands with f32
    /// accumulation, which [`MatmulPath::Mma`] needs ([`ActDType::has_tensor_tiles_on`]).
    pub fn supports_mma(&self, dtype: ActDType) -> bool {
        dtype.has_tensor_tiles_on(self.client.properties())
    }

    /// Whether the device has the `m16n8k16` instruction on `dtype` operands with f32 accumulators, in
    /// the manual (register-level) form the fragment tiles take ([`crate::kernels::mma_frag`]).
    pub fn supports_mma_fragments(&self, dtype: ActDType) -> bool {
        dtype.has_fragment_mma_on(self.client.properties())
    }

    fn check_dtype(&self, dtype: ActDType) -> Result<(), KernelError> {
        if self.supports(dtype) {
            Ok(())
        } else {
            Err(KernelError::Unsupported(format!(
                "{dtype} activations on {} (the runtime reports no {dtype} buffers or conversions)",
                self.device_name()
            )))
        }
    }

    /// Uploads f32 values.
    pub fn upload_f32(&self, values: &[f32]) -> DeviceBuffer {
        DeviceBuffer {
            handle: self
                .client
                .create_from_slice(f32::as_bytes(nonempty_f32(values))),
            len: values.len(),
            dtype: ActDType::F32,
        }
    }

    /// Uploads `values` as activations of `dtype`, each rounded to it on the host ([`ActDType::round`]).
    pub fn upload(&self, values: &[f32], dtype: ActDType) -> Result<DeviceBuffer, KernelError> {
        self.check_dtype(dtype)?;
        let mut bytes = dtype.encode(values);
        // Whole 32-bit words, at least one: a 16-bit buffer of odd length is padded.
        bytes.resize(4 * stored_words(values.len(), dtype), 0);
        Ok(DeviceBuffer {
            handle: self.client.create_from_slice(&bytes),
            len: values.len(),
            dtype,
        })
    }

    /// Uploads u32 values.
    pub fn upload_u32(&self, values: &[u32]) -> DeviceBuffer {
        // A buffer holds at least one value; an empty upload keeps its length 0 (as `upload_f32`'s).
        let stored: &[u32] = if values.is_empty() { &[0] } else { values };
        DeviceBuffer {
            handle: self.client.create_from_slice(u32::as_bytes(stored)),
            len: values.len(),
            dtype: ActDType::F32,
        }
    }

    /// Reads values back as f32 (waits for the kernels that write them); f16 and bf16 buffers are widened
    /// exactly.
    pub fn read_f32(&self, buffer: &DeviceBuffer) -> Result<Vec<f32>, KernelError> {
        Ok(match self.read_bytes(buffer)? {
            Some(bytes) => buffer.dtype.decode(&bytes, buffer.len),
            None => Vec::new(),
        })
    }

    /// Reads `u32` values back (waits for the kernels that write them).
    pub fn read_u32(&self, buffer: &DeviceBuffer) -> Result<Vec<u32>, KernelError> {
        Ok(match self.read_bytes(buffer)? {
            Some(bytes) => u32::from_bytes(&bytes)[..buffer.len].to_vec(),
            None => Vec::new(),
        })
    }

    /// The bytes of a buffer (waits for the kernels that write them); `None` for an empty one, which has
    /// nothing on the device to read (its handle holds a placeholder element).
    fn read_bytes(
        &self,
        buffer: &DeviceBuffer,
    ) -> Result<Option<cubecl::bytes::Bytes>, KernelError> {
        if buffer.len == 0 {
            return Ok(None);
        }
        self.client
            .read_one(buffer.handle.clone())
            .map(Some)
            .map_err(|e| KernelError::Device(format!("{e:?}")))
    }

    /// Waits until every launched kernel has finished (for timing).
    pub fn sync(&self) -> Result<(), KernelError> {
        cubecl::future::block_on(self.client.sync())
            .map_err(|e| KernelError::Device(format!("{e:?}")))
    }

    /// Uploads packed weights once; every later matmul reads them in place.
    pub fn upload_weights(&self, w: &PackedWeights) -> DeviceWeights {
        DeviceWeights {
            format: w.format(),
            experts: w.experts(),
            out: w.out_features(),
            inn: w.in_features(),
            words: self.upload_u32(w.words()),
            scales: self.upload_f32(w.scales()),
            bytes: w.bytes(),
        }
    }

    fn empty_f32(&self, len: usize) -> DeviceBuffer {
        self.empty(len, ActDType::F32)
    }

    /// `len` uninitialised `u32` values (a kernel writes every one).
    fn empty_u32(&self, len: usize) -> DeviceBuffer {
        // u32 buffers report f32, the type of their element size ([`DeviceBuffer`]).
        self.empty(len, ActDType::F32)
    }

    fn empty(&self, len: usize, dtype: ActDType) -> DeviceBuffer {
        let buffer = DeviceBuffer {
            handle: self.client.empty(4 * stored_words(len, dtype)),
            len,
            dtype,
        };
        if self.poison_outputs {
            self.fill_words(&buffer, u32::MAX);
        }
        buffer
    }

    /// Sets every 4-byte word of `buffer` to `value` (0: +0.0 in every float type), by a launch.
    pub(crate) fn fill_words(&self, buffer: &DeviceBuffer, value: u32) {
        let words = stored_words(buffer.len, buffer.dtype);
        crate::kernels::fill_words::launch(
            &self.client,
            grid(words.div_ceil(256)),
            CubeDim::new_1d(256),
            // SAFETY: `empty` and `upload` store whole words: `words` of them.
            unsafe { BufferArg::from_raw_parts(buffer.handle.clone(), words) },
            value,
        );
    }

    /// These kernels with every fresh output buffer filled with all-ones bits (NaN in every float type,
    /// `u32::MAX`) rather than left as the memory pool hands it over, when `on`: a value a kernel fails
    /// to write then shows in a bitwise comparison instead of keeping what a freed buffer of the same
    /// size held (often the right answer, from the run just compared against). For tests and
    /// debugging: one more launch per allocation
    /// ([`crate::kernels::fill_words`](fn@crate::kernels::fill_words); recorded graphs replay it too).
    pub fn with_poisoned_outputs(mut self, on: bool) -> Self {
        self.poison_outputs = on;
        self
    }

    /// A device-to-device copy of the f32 buffer `src` (what the benchmarks time as the bandwidth
    /// roofline).
    pub fn copy(&self, src: &DeviceBuffer) -> DeviceBuffer {
        assert_eq!(src.dtype, ActDType::F32, "copy moves f32 buffers");
        let dst = self.empty_f32(src.len);
        if src.len > 0 {
            let cubes = src.len.div_ceil(256).min(8192);
            let stride = cubes * 256;
            dense::copy::launch(
                &self.client,
                CubeCount::Static(cubes as u32, 1, 1),
                CubeDim::new_1d(256),
                src.arg(),
                dst.arg(),
                src.len,
                stride,
                src.len.div_ceil(stride),
            );
        }
        dst
    }

    /// The dequantized `[out, inn]` matrix of a dense weight.
    pub fn dequantize(&self, w: &DeviceWeights) -> Result<DeviceBuffer, KernelError> {
        dense_only(w)?;
        let n = w.out * w.inn;
        let out = self.empty_f32(n);
        if n > 0 {
            dense::dequantize::launch(
                &self.client,
                grid(n.div_ceil(256)),
                CubeDim::new_1d(256),
                w.words.arg(),
                w.scales.arg(),
                self.lut.arg(),
                out.arg(),
                w.out,
                w.inn,
                w.wpr(),
                w.spr(),
                w.format.kernel_code(),
                w.format.kernel_group(),
            );
        }
        Ok(out)
    }

    /// fp8 activations `[rows, cols]` (of any supported type): (dequantized values, scales
    /// `[rows, ceil(cols/128)]`), both f32.
    pub fn fp8_activations(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        cols: usize,
    ) -> Result<(DeviceBuffer, DeviceBuffer), KernelError> {
        expect_len("activations", x, rows * cols)?;
        self.check_dtype(x.dtype)?;
        let blocks = cols.div_ceil(FP8_BLOCK);
        let values = self.empty_f32(rows * cols);
        let scales = self.empty_f32(rows * blocks);
        if rows * blocks > 0 {
            fp8::quantize_activations::launch(
                &self.client,
                grid(rows * blocks),
                CubeDim::new_1d(FP8_BLOCK as u32),
                x.arg(),
                self.lut.arg(),
                values.arg(),
                scales.arg(),
                rows,
                cols,
                blocks,
                x.dtype.elem(),
            );
        }
        Ok((values, scales))
    }

    fn prepare(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: &DeviceWeights,
    ) -> Result<DeviceBuffer, KernelError> {
        if w.format.quantizes_activations() {
            Ok(self.fp8_activations(x, rows, w.inn)?.0)
        } else {
            Ok(x.clone())
        }
    }

    /// `y[n, out] = x[n, inn] · dequant(W)^T` (fp8: activations quantized first), kernel chosen by `n`;
    /// `y` has `x`'s element type.
    pub fn linear(
        &self,
        x: &DeviceBuffer,
        n: usize,
        w: &DeviceWeights,
    ) -> Result<DeviceBuffer, KernelError> {
        self.linear_with(x, n, w, MatmulPath::Auto)
    }

    /// [`Kernels::linear`] with the kernel named (tests and benchmarks compare the two).
    pub fn linear_with(
        &self,
        x: &DeviceBuffer,
        n: usize,
        w: &DeviceWeights,
        path: MatmulPath,
    ) -> Result<DeviceBuffer, KernelError> {
        dense_only(w)?;
        expect_len("activations", x, n * w.inn)?;
        self.check_dtype(x.dtype)?;
        let y = self.empty(n * w.out, x.dtype);
        if n == 0 || w.out == 0 {
            return Ok(y);
        }
        let x = self.prepare(x, n, w)?;
        let dtypes = [x.dtype.elem(), y.dtype.elem()];
        let chunks = w.inn.div_ceil(CHUNK);
        let (fmt, group) = (w.format.kernel_code(), w.format.kernel_group());
        let blocks = w.out.div_ceil(BLOCK) * n.div_ceil(BLOCK);
        let path = match path {
            MatmulPath::Auto if n <= Self::GEMV_MAX_TOKENS => MatmulPath::Gemv,
            MatmulPath::Auto if blocks >= Self::BLOCKED_MIN_CUBES => MatmulPath::Blocked,
            MatmulPath::Auto => MatmulPath::Gemm,
            chosen => chosen,
        };
        if let Some(tiles) = path.tiles(x.dtype) {
            self.launch_grouped(&x, &y, n, w, tiles)?;
        } else if path == MatmulPath::Gemv {
            let lanes = chunks.clamp(1, 32);
            // Chunk sums of a cube's rows live in shared memory: keep them within WebGPU's 16 KiB floor.
            if chunks > SHARED_FLOATS {
                return Err(KernelError::Unsupported(format!(
                    "GEMV over {} inputs (at most {})",
                    w.inn,
                    SHARED_FLOATS * CHUNK
                )));
            }
            let chunks = chunks.max(1);
            // The token's activations staged in shared memory when they fit beside a row of chunk sums.
            let stage_x = 32 * (chunks + 1) + chunks <= SHARED_FLOATS;
            let budget = SHARED_FLOATS - if stage_x { 32 * (chunks + 1) } else { 0 };
            let rows_per_cube = (256 / lanes).min(budget / chunks).min(w.out).max(1);
            dense::gemv::launch(
                &self.client,
                CubeCount::Static(w.out.div_ceil(rows_per_cube) as u32, n as u32, 1),
                CubeDim::new_2d(lanes as u32, rows_per_cube as u32),
                x.arg(),
                w.words.arg(),
                w.scales.arg(),
                self.lut.arg(),
                y.arg(),
                w.out,
                w.inn,
                w.wpr(),
                w.spr(),
                fmt,
                group,
                lanes,
                rows_per_cube,
                chunks,
                stage_x,
                dtypes,
            );
        } else {
            // Both GEMMs take the same arguments; the kernel and its tile side differ.
            macro_rules! gemm {
                ($kernel:ident, $side:expr) => {
                    dense::$kernel::launch(
                        &self.client,
                        CubeCount::Static(
                            w.out.div_ceil($side) as u32,
                            n.div_ceil($side) as u32,
                            1,
                        ),
                        CubeDim::new_2d(TILE as u32, TILE as u32),
                        x.arg(),
                        w.words.arg(),
                        w.scales.arg(),
                        self.lut.arg(),
                        y.arg(),
                        n,
                        w.out,
                        w.inn,
                        w.wpr(),
                        w.spr(),
                        fmt,
                        group,
                        chunks,
                        dtypes,
                    )
                };
            }
            if path == MatmulPath::Gemm {
                gemm!(gemm_tile, TILE);
            } else {
                gemm!(gemm_blocked, BLOCK);
            }
        }
        Ok(y)
    }

    /// Whether the tensor-core tiles' order (on the instruction when `tensor_cores`, else with scalar
    /// FMAs) can run `format` weights with `dtype` operands here: weight-only formats (fp8-b128 quantizes
    /// the activations too), operands of a type the device has, and for the instruction half operands on
    /// a device that has it. Otherwise an error saying which, never another kernel's result.
    fn check_tiles(
        &self,
        format: WeightFormat,
        (tensor_cores, dtype): (bool, ActDType),
    ) -> Result<(), KernelError> {
        self.check_dtype(dtype)?;
        if format.quantizes_activations() {
            return Err(KernelError::Unsupported(format!(
                "grouped (tensor-core) tiles for {format:?} weights: their activations are quantized too"
            )));
        }
        if let Staging::Fixed(steps) = self.staging {
            // The largest tile allocation for these operands: the MoE gate + up.
            let need = mma::gemm_tiles_shared_bytes(steps, dtype.size(), tensor_cores).max(
                mma_moe::grouped_tiles_shared_bytes(steps, dtype.size(), true, tensor_cores),
            );
            if steps == 0 || need > self.max_shared_bytes() {
                return Err(KernelError::Unsupported(format!(
                    "tensor-core tiles staging {steps} K steps with {dtype} operands: {need} bytes of \
                     shared memory per cube, {} allows {}",
                    self.device_name(),
                    self.max_shared_bytes()
                )));
            }
        }
        if tensor_cores && !self.supports_mma(dtype) {
            return Err(KernelError::Unsupported(format!(
                "tensor-core tiles for {format:?} weights with {dtype} activations on {} (half \
                 activations, weight-only formats and a device with m16n16k16 {dtype}-operand \
                 instructions)",
                self.device_name(),
            )));
        }
        Ok(())
    }

    /// The tensor-core tiles' order (`(tensor_cores, operand)`: on the instruction or with scalar FMAs, on
    /// operands of that type), for weights whose codes are exact in the operands' type and whose
    /// activations stay as they are (not fp8's quantized ones).
    fn launch_grouped(
        &self,
        x: &DeviceBuffer,
        y: &DeviceBuffer,
        n: usize,
        w: &DeviceWeights,
        (tensor_cores, operand): (bool, ActDType),
    ) -> Result<(), KernelError> {
        self.check_tiles(w.format, (tensor_cores, operand))?;
        if self.fragment_tiles {
            self.check_fragments(w.format, (tensor_cores, operand))?;
            return self.launch_dense_fragments(x, y, n, w, (tensor_cores, operand));
        }
        let (fmt, group) = (w.format.kernel_code(), w.format.kernel_group());
        let (steps, steps_per_scale) = tile_steps(w);
        let stage_steps = self.stage_steps(tensor_cores, |d| {
            mma::gemm_tiles_shared_bytes(d, operand.size(), tensor_cores)
        });
        mma::gemm_tiles::launch(
            &self.client,
            CubeCount::Static(
                w.out.div_ceil(MMA * MMA_ROW_TILES) as u32,
                n.div_ceil(MMA * MMA_TOKEN_TILES) as u32,
                1,
            ),
            CubeDim::new_2d(MMA_PLANE as u32, (MMA_TOKEN_TILES * MMA_ROW_TILES) as u32),
            x.arg(),
            w.words.arg(),
            w.scales.arg(),
            self.lut.arg(),
            y.arg(),
            n,
            w.out,
            w.inn,
            w.wpr(),
            w.spr(),
            steps,
            steps_per_scale,
            fmt,
            group,
            tensor_cores,
            stage_steps,
            [x.dtype.elem(), operand.elem(), y.dtype.elem()],
        );
        Ok(())
    }

    /// The straight-through input gradient `dx[n, inn] = g[n, out] · dequant(W)`, in `g`'s element type.
    pub fn linear_transposed(
        &self,
        g: &DeviceBuffer,
        n: usize,
        w: &DeviceWeights,
    ) -> Result<DeviceBuffer, KernelError> {
        dense_only(w)?;
        expect_len("output gradient", g, n * w.out)?;
        self.check_dtype(g.dtype)?;
        let dx = self.empty(n * w.inn, g.dtype);
        if n == 0 || w.inn == 0 {
            return Ok(dx);
        }
        dense::gemm_transposed::launch(
            &self.client,
            CubeCount::Static(w.inn.div_ceil(TILE) as u32, n.div_ceil(TILE) as u32, 1),
            CubeDim::new_2d(TILE as u32, TILE as u32),
            g.arg(),
            w.words.arg(),
            w.scales.arg(),
            self.lut.arg(),
            dx.arg(),
            n,
            w.out,
            w.inn,
            w.wpr(),
            w.spr(),
            w.format.kernel_code(),
            w.format.kernel_group(),
            w.out.div_ceil(CHUNK),
            [g.dtype.elem(), dx.dtype.elem()],
        );
        Ok(dx)
    }
}

/// The tensor-core tiles' K steps of `w` and the steps per scale group: one scale per row (int8) covers
/// every step; otherwise a group is `group` inputs (a multiple of the instruction's 16).
fn tile_steps(w: &DeviceWeights) -> (usize, usize) {
    let steps = w.inn.div_ceil(MMA);
    if w.format.kernel_code() == 1 {
        (steps, steps.max(1))
    } else {
        (steps, w.format.kernel_group() / MMA)
    }
}

/// f32 values of shared memory a kernel may use: 16 KiB, the least WebGPU guarantees.
const SHARED_FLOATS: usize = 4096;

/// Most cubes along one grid axis on every runtime (WebGPU's limit).
const MAX_GRID: usize = 65_535;

/// The 32-bit words a buffer of `len` values of `dtype` stores: whole words, at least one (what
/// [`Kernels::upload`] and the fresh outputs allocate, and [`Kernels::fill_words`] fills).
fn stored_words(len: usize, dtype: ActDType) -> usize {
    (dtype.size() * len).div_ceil(4).max(1)
}

/// A grid of `cubes` cubes for kernels indexed by `ABSOLUTE_POS` (linear over the whole grid), spilling into
/// the y axis past [`MAX_GRID`].
fn grid(cubes: usize) -> CubeCount {
    let x = cubes.clamp(1, MAX_GRID);
    CubeCount::Static(x as u32, cubes.div_ceil(x).max(1) as u32, 1)
}

fn nonempty_f32(values: &[f32]) -> &[f32] {
    if values.is_empty() {
        &[0.0]
    } else {
        values
    }
}

fn dense_only(w: &DeviceWeights) -> Result<(), KernelError> {
    if w.experts != 1 {
        return Err(KernelError::Shape(format!(
            "a dense matmul got a stack of {} experts (use the MoE launcher)",
            w.experts
        )));
    }
    Ok(())
}

/// An error unless `b` holds f32 values: `kernels` names the launchers that take f32 only.
fn f32_only(what: &str, b: &DeviceBuffer, kernels: &str) -> Result<(), KernelError> {
    if b.dtype() != ActDType::F32 {
        return Err(KernelError::Unsupported(format!(
            "{what}: {} values (the {kernels} take f32)",
            b.dtype()
        )));
    }
    Ok(())
}

fn expect_len(what: &str, b: &DeviceBuffer, len: usize) -> Result<(), KernelError> {
    if b.len != len {
        return Err(KernelError::Shape(format!(
            "{what}: {} values, expected {len}",
            b.len
        )));
    }
    Ok(())
}
