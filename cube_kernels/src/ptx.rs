//! The kernels that have never run on a CUDA device, compiled for an NVIDIA architecture without a GPU:
//! the tensor-core tiles ([`crate::kernels::mma::gemm_tiles`], [`crate::kernels::mma_moe::grouped_tiles`]),
//! the GPU training kernels ([`crate::kernels::moe_train`], [`crate::kernels::exact`]) and the MoE
//! decode's one-launch routing and down-and-combine ([`compile_decode_kernels`]). The same kernel
//! definitions the CUDA runtime compiles at a launch, through the same compiler (CubeCL's default CUDA
//! backend: LLVM's NVPTX target, or NVRTC's C++ with cubecl-cuda's `cpp` feature), with the device
//! properties the runtime reads off such a part. Why: GPU time is scarce and the instruction paths run
//! nowhere else (lavapipe has no `cmma`; the training kernels were written after the last GPU session),
//! so a CPU machine compiles them, checks that the instruction is there, and assembles the PTX with
//! `ptxas` (`tests/cuda_codegen.rs`, `scripts/cuda_codegen.sh`) before a GPU is at hand; a codegen
//! failure then costs a build, not a GPU session.
//!
//! Only the launch's *shape* matters here: buffers are placeholders and runtime scalars are zero (they
//! are kernel arguments, not compiled in); the compile-time parameters (format, group, SwiGLU, gather,
//! `tensor_cores`, K steps per stage, operand types) are those the launchers pass.

use std::sync::Arc;

use cubecl::cuda::compiler::CudaBackend;
use cubecl::cuda::{CudaCompilationOptions, CudaCompiler, CudaRepresentation, CudaRuntime};
use cubecl::ir::nvidia::SmArch;
use cubecl::ir::{
    DeviceIdentity, DeviceProperties, HardwareProperties, MemoryDeviceProperties, VectorSize,
};
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::Compiler;
use cubecl_core::device::{DeviceId, ServiceId};
use cubecl_core::environment::stream::StreamId;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaCmmaCompiler;
use cubecl_cpp::shared::{register_mma_features, register_wmma_features};
use cubecl_llvm::nvptx::ptx_version::PtxVersion;
use cubecl_llvm::shared::lowered_features::{restrict_features, GpuTarget};
use cubecl_runtime::runtime::Runtime;

use crate::context::moe::{fused_combine_shape, gemv_can_hold, grouped_gemv_shape};
use crate::context::tile_stage_steps;
use crate::kernels::mma::{self, MMA_PLANE, MMA_ROW_TILES, MMA_TOKEN_TILES};
use crate::kernels::mma_frag;
use crate::kernels::mma_moe::{self, MOE_MMA_ROW_TILES};
use crate::{ActDType, KernelError, WeightFormat};

/// The part compiled for: its compute capability (`90` for sm_90, the H100/H200) and the CUDA driver
/// version whose newest PTX ISA the LLVM backend emits (`13000` for CUDA 13.0).
#[derive(Clone, Copy, Debug)]
pub struct CudaTarget {
    /// Compute capability, major * 10 + minor.
    pub arch: u32,
    /// `cuDriverGetVersion`'s value: 1000 * major + 10 * minor.
    pub driver: i32,
}

/// Which tile kernel and how it is launched.
#[derive(Clone, Copy, Debug)]
pub enum TileKernel {
    /// The dense product `y[n, out] = x[n, inn] W^T` ([`mma::gemm_tiles`]).
    Dense,
    /// The grouped MoE gate + up projection, fused with SwiGLU, on gathered token rows.
    MoeGateUp,
    /// The grouped MoE down projection on the assignments' rows.
    MoeDown,
}

/// One kernel variant as the runtime compiles it.
pub struct CompiledKernel {
    /// The variant, e.g. `Dense int4-g128 f32->bf16 tensor-cores x4`.
    pub name: String,
    /// Whether it was compiled for the tensor-core instruction (a tile's scalar twin and every other
    /// kernel: not).
    pub tensor_cores: bool,
    /// What the driver would get: PTX (LLVM backend) or CUDA C++ (C++ backend, see `is_ptx`).
    pub source: String,
    /// Whether `source` is PTX, to be assembled by `ptxas`.
    pub is_ptx: bool,
    /// Shared memory the launch reserves, in bytes.
    pub shared_bytes: usize,
}

/// Compiles `module::kernel` (named `name`; built for the instruction when `tensor_cores`) as launched
/// with cube dimensions `dim` and the launch arguments `args` (buffers as placeholders, runtime scalars
/// 0, the compile-time parameters as the launchers pass them) on `target`.
macro_rules! compile_dummy {
    ($target:expr, $name:expr, $tensor_cores:expr, $module:ident :: $kernel:ident, $dim:expr;
     $($arg:expr),* $(,)?) => {
        compile_kernel(
            $target,
            $name,
            $tensor_cores,
            &$module::$kernel::create_dummy_kernel(
                Arc::new(device_properties($target)),
                Arc::new(CudaRuntime::target_properties()),
                CubeCount::Static(1, 1, 1),
                $dim,
                $($arg),*
            ),
        )
    };
}

/// Compiles `kernel` for `format` weights with `input`-typed buffers staged as `operand` on `target`,
/// on tensor cores or with the scalar twin, staging `stage_steps` K steps per pair of barriers. Errors
/// name the variant and what the compiler said.
pub fn compile_tile(
    target: CudaTarget,
    kernel: TileKernel,
    format: WeightFormat,
    (input, operand): (ActDType, ActDType),
    (tensor_cores, stage_steps): (bool, usize),
) -> Result<CompiledKernel, KernelError> {
    let name = format!(
        "{kernel:?} {} {input}->{operand} {} x{stage_steps}",
        format.name(),
        if tensor_cores {
            "tensor-cores"
        } else {
            "scalar"
        }
    );
    if format.quantizes_activations() {
        return Err(KernelError::Unsupported(format!(
            "{name}: the tiles take weight-only formats"
        )));
    }
    let (fmt, group) = (format.kernel_code(), format.kernel_group());
    let p = placeholder;
    match kernel {
        TileKernel::Dense => compile_dummy!(
            target, name, tensor_cores, mma::gemm_tiles,
            CubeDim::new_2d(MMA_PLANE as u32, (MMA_TOKEN_TILES * MMA_ROW_TILES) as u32);
            p(), p(), p(), p(), p(), 0, 0, 0, 0, 0, 0, 0,
            fmt, group, tensor_cores, stage_steps, [input.elem(), operand.elem(), input.elem()]
        ),
        TileKernel::MoeGateUp | TileKernel::MoeDown => {
            let swiglu = matches!(kernel, TileKernel::MoeGateUp);
            compile_dummy!(
                target, name, tensor_cores, mma_moe::grouped_tiles,
                CubeDim::new_2d(MMA_PLANE as u32, MOE_MMA_ROW_TILES as u32);
                p(), p(), 0, p(), p(), p(), p(), p(), p(), 0, 0, 0, 0, 0, 0, 0, 0,
                fmt, group, swiglu, swiglu, tensor_cores, stage_steps,
                [input.elem(), operand.elem()]
            )
        }
    }
}

/// Defines `kernel` and compiles it as the runtime does: PTX from the LLVM backend, or the C++ source
/// where cubecl-cuda's `cpp` feature selects NVRTC.
fn compile_kernel<K: CubeKernel>(
    target: CudaTarget,
    name: String,
    tensor_cores: bool,
    kernel: &K,
) -> Result<CompiledKernel, KernelError> {
    let definition = cubecl::define_kernel(kernel)
        .map_err(|err| KernelError::Compile(format!("{name}: defining the kernel: {err}")))?;
    let compiled = CudaCompiler::default()
        .compile(definition, &compilation_options(target))
        .map_err(|err| KernelError::Compile(format!("{name}: {err}")))?;
    let shared_bytes = compiled.shared_memory_size();
    let (source, is_ptx) = match &compiled {
        CudaRepresentation::Llvm(module) => {
            let bytes: Vec<u8> = module
                .ptx
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            (String::from_utf8_lossy(&bytes).into_owned(), true)
        }
        CudaRepresentation::Cpp(kernel) => (kernel.to_string(), false),
    };
    Ok(CompiledKernel {
        name,
        tensor_cores,
        source,
        is_ptx,
        shared_bytes,
    })
}

/// A buffer argument that only has to exist: the kernel definition reads its element type from the
/// kernel's type parameters, never from the handle.
fn placeholder() -> BufferArg {
    let handle = Handle::new(
        ServiceId::of::<CudaRuntime>(DeviceId {
            type_id: 0,
            index_id: 0,
        }),
        StreamId::current(),
        16,
    );
    // SAFETY: nothing is launched; the length is the placeholder's own.
    unsafe { BufferArg::from_raw_parts(handle, 4) }
}

/// What the CUDA runtime's device service reads off a part of compute capability `target.arch` that
/// bears on code generation: the types, the matrix instructions the C++ backend knows for the
/// architecture, narrowed to what the LLVM backend lowers (as the runtime narrows them), warp 32.
pub fn device_properties(target: CudaTarget) -> DeviceProperties {
    let arch = CudaArchitecture {
        version: target.arch,
        tensor_cores: target.arch >= 70,
    };
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: MMA_PLANE as u32,
        plane_size_max: MMA_PLANE as u32,
        max_bindings: 1024,
        max_shared_memory_size: MAX_SHARED,
        max_cube_count: (i32::MAX as u32, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: None,
        num_cpu_cores: None,
        last_level_cache_size: None,
        num_tensor_cores: arch.tensor_cores.then_some(4),
        min_tensor_cores_dim: arch.tensor_cores.then_some(8),
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut props = DeviceProperties::new(
        Default::default(),
        MemoryDeviceProperties::new(1 << 30, 512),
        hardware,
        cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: format!("sm_{} (compile only)", target.arch),
            fingerprint: format!("ptx_sm{}", target.arch),
            physical: None,
        },
    );
    cubecl_cpp::register_supported_types(&mut props);
    register_wmma_features(
        CudaCmmaCompiler::Cpp.supported_cmma_combinations(&arch),
        &mut props,
    );
    register_mma_features(
        cubecl_cpp::cuda::supported_mma_combinations(&arch),
        &mut props,
    );
    if CudaBackend::default() == CudaBackend::Llvm {
        restrict_features(&mut props, GpuTarget::Nvptx);
    }
    props
}

/// The runtime's compilation options for `target` (warp 32, fast math, grid constants from sm_70).
fn compilation_options(target: CudaTarget) -> CudaCompilationOptions {
    let mut options = CudaCompilationOptions {
        arch: Some(SmArch::new(target.arch, target.arch >= 70)),
        ptx_version: PtxVersion::for_driver(target.driver),
        ..Default::default()
    };
    options.cpp.warp_size = MMA_PLANE;
    options.cpp.supports_features.fast_math = true;
    options.cpp.supports_features.grid_constants = target.arch >= 70;
    options
}

/// Shared memory a cube may take on the parts compiled for (sm_80 and later, with the opt-in that
/// cubecl-cuda sets at the launch).
const MAX_SHARED: usize = 227 * 1024;

/// Shared memory `kernel` allocates staging `stage_steps` steps of `operand` values.
fn tile_shared_bytes(
    kernel: TileKernel,
    stage_steps: usize,
    operand: ActDType,
    tensor_cores: bool,
) -> usize {
    match kernel {
        TileKernel::Dense => {
            mma::gemm_tiles_shared_bytes(stage_steps, operand.size(), tensor_cores)
        }
        TileKernel::MoeGateUp | TileKernel::MoeDown => mma_moe::grouped_tiles_shared_bytes(
            stage_steps,
            operand.size(),
            matches!(kernel, TileKernel::MoeGateUp),
            tensor_cores,
        ),
    }
}

/// The (input, operand) types the tile launchers take: f32 inputs staged as bf16 (the mixed-precision
/// training forward), bf16 and f16 activations (the rollout).
const TILE_DTYPES: [(ActDType, ActDType); 3] = [
    (ActDType::F32, ActDType::BF16),
    (ActDType::BF16, ActDType::BF16),
    (ActDType::F16, ActDType::F16),
];

/// Every tile variant the launchers can ask for on `target`: dense and both MoE products, for each of
/// `formats`, with f32 inputs staged as bf16 (the mixed-precision training forward), bf16 and f16
/// activations (the rollout), on the instruction and with the scalar twin, staging one K step per pair
/// of barriers and as many as the launchers take on such a part ([`crate::context::tile_stage_steps`]).
pub fn compile_all_tiles(
    target: CudaTarget,
    formats: &[WeightFormat],
) -> Vec<Result<CompiledKernel, KernelError>> {
    let dtypes = TILE_DTYPES;
    let kernels = [
        TileKernel::Dense,
        TileKernel::MoeGateUp,
        TileKernel::MoeDown,
    ];
    let mut out = Vec::new();
    for &format in formats {
        for kernel in kernels {
            for dtypes in dtypes {
                for tensor_cores in [true, false] {
                    let most = tile_stage_steps(MAX_SHARED, |d| {
                        tile_shared_bytes(kernel, d, dtypes.1, tensor_cores)
                    });
                    for stage_steps in [1, most] {
                        let variant = (tensor_cores, stage_steps);
                        out.push(compile_tile(target, kernel, format, dtypes, variant));
                    }
                }
            }
        }
    }
    out
}

/// The fragment tiles ([`crate::kernels::mma_frag::grouped_fragments`]) as the launchers ask for them
/// on such a part: the MoE gate + up (SwiGLU, gathered rows) and down projections and the dense product,
/// for each of `formats`, with f32 inputs staged as bf16 and bf16 and f16 activations (the dense output
/// in the input's type), on the instruction and with the emulation, in the default layout (one tile of
/// 16 per cube, 64 rows, one code at a time), staging as many K steps per chunk as fit
/// ([`mma_frag::fragment_chunk_steps`]); then, for int4-g128 on the instruction, the other layouts
/// [`crate::FragmentShape`] offers with the pair decode: 2 tiles x 32 rows, 2 x 64, 4 x 32, 1 x 64, and
/// 1 x 32 (what a 32-row layout runs where a call's experts hold 16 assignments or fewer); and two with
/// the staging in two buffers: the default layout and 4 x 32 with pairs.
pub fn compile_fragment_tiles(
    target: CudaTarget,
    formats: &[WeightFormat],
) -> Vec<Result<CompiledKernel, KernelError>> {
    let mut out = Vec::new();
    for &format in formats {
        for tensor_cores in [true, false] {
            out.extend(compile_fragment_layout(
                target,
                format,
                tensor_cores,
                (1, 2, false, false, 1),
                false,
            ));
        }
    }
    let int4 = WeightFormat::Int4 { group: 128 };
    for shape in [
        (2, 1, true, false, 1),
        (2, 2, true, false, 1),
        (4, 1, true, false, 1),
        (1, 2, true, false, 1),
        (1, 1, true, false, 1),
        (1, 2, false, true, 1),
        (4, 1, true, true, 1),
        // The scale groups split among 4 and 2 sets of planes (decode-sized calls).
        (1, 2, true, false, 4),
        (1, 1, true, false, 4),
        (1, 2, true, true, 2),
    ] {
        out.extend(compile_fragment_layout(target, int4, true, shape, false));
    }
    // The A fragments by ldmatrix: the default layout with pairs, 4 tiles, and split groups.
    for shape in [
        (1, 2, true, false, 1),
        (4, 1, true, false, 1),
        (1, 2, true, false, 4),
    ] {
        out.extend(compile_fragment_layout(target, int4, true, shape, true));
    }
    out
}

/// The most assignments a tile of a one-token decode step with Qwen3-30B-A3B's top-8 routing holds:
/// the inputs' rows the split layouts stage ([`mma_frag::FragCube::with_split_groups`]).
const DECODE_ROWS: usize = 8;

/// [`compile_fragment_tiles`]' variants of one format, path and layout `(tiles, blocks, pair decode, two
/// buffers, sets of scale groups)`: the three kernels for the three operand pairs.
fn compile_fragment_layout(
    target: CudaTarget,
    format: WeightFormat,
    tensor_cores: bool,
    (m_tiles, blocks, pair, double_buffer, splits): (usize, usize, bool, bool, usize),
    ldmatrix: bool,
) -> Vec<Result<CompiledKernel, KernelError>> {
    let (fmt, group) = (format.kernel_code(), format.kernel_group());
    // int8-pc's one group spans the row: Qwen3-30B-A3B's 2048 inputs.
    let steps_per_scale = if fmt == 1 { 128 } else { group / mma::MMA };
    let shape = match crate::FragmentShape::new(m_tiles, blocks, pair) {
        Ok(shape) => shape
            .with_double_buffer(double_buffer)
            .with_ldmatrix(ldmatrix),
        Err(e) => return vec![Err(e)],
    };
    let mut out = Vec::new();
    for (kind, swiglu, dense) in [
        ("gate-up", true, false),
        ("down", false, false),
        ("dense", false, true),
    ] {
        for (input, operand) in TILE_DTYPES {
            let output = if dense { input } else { ActDType::F32 };
            // The layout as the launchers build it ([`crate::FragmentShape`]), for Qwen3-30B-A3B's
            // inputs: 2048 (gate-up, dense), 768 (down).
            let path = (tensor_cores, operand);
            let layout = shape.cube((m_tiles, 1, false), fmt, path);
            let chunk_steps = mma_frag::fragment_chunk_steps(
                fmt,
                steps_per_scale,
                layout,
                operand.size(),
                tensor_cores,
                MAX_SHARED,
            )
            .unwrap_or(1);
            let inn = if swiglu || dense { 2048 } else { 768 };
            let full = mma_frag::FragCube::whole_chunks(chunk_steps, inn, steps_per_scale);
            let cube = shape
                .cube((m_tiles, chunk_steps, full), fmt, path)
                .with_split_groups(splits, inn, DECODE_ROWS);
            let name = format!(
                "Fragments {kind} {} {input}->{operand} {} {m_tiles}x{} rows chunk {chunk_steps}{}{}{}{}{}",
                format.name(),
                if tensor_cores {
                    "tensor-cores"
                } else {
                    "emulated"
                },
                cube.rows(),
                if cube.decode == mma_frag::PairDecode::Scalar {
                    ""
                } else {
                    " pairs"
                },
                if cube.full_chunks { " whole" } else { "" },
                if double_buffer { " 2 buffers" } else { "" },
                if splits > 1 {
                    format!(" groups in {splits} sets")
                } else {
                    String::new()
                },
                if cube.ldmatrix { " ldmatrix" } else { "" }
            );
            let p = placeholder;
            out.push(compile_dummy!(
                target, name, tensor_cores, mma_frag::grouped_fragments,
                CubeDim::new_2d(MMA_PLANE as u32, mma_frag::FRAG_PLANES as u32);
                p(), p(), 0, 0, 0, p(), p(), p(), p(), p(), p(), 0, 0, 0, 0, 0, 0, 0, 0,
                fmt, group, swiglu, swiglu, dense, tensor_cores, cube,
                [input.elem(), operand.elem(), output.elem()]
            ));
        }
    }
    out
}

/// The GPU training kernels ([`crate::kernels::moe_train`]: SwiGLU forward and backward, the combine's
/// and the routing weights' gradients, the grouped straight-through input gradient and weight gradient,
/// the assignments' sum; [`crate::kernels::exact`]: the f32 matmul, softmax and mean rows of the
/// full-precision backward) with the compile-time variants their launchers pass for a
/// Qwen3-30B-A3B-shaped MoE layer (hidden 2048, intermediate 768) with `formats` weights.
pub fn compile_training_kernels(
    target: CudaTarget,
    formats: &[WeightFormat],
) -> Vec<Result<CompiledKernel, KernelError>> {
    use crate::kernels::{exact, moe_train, TILE};
    let (line, square) = (
        CubeDim::new_1d(256),
        CubeDim::new_2d(TILE as u32, TILE as u32),
    );
    let p = placeholder;
    macro_rules! compile {
        ($name:expr, $($rest:tt)*) => { compile_dummy!(target, $name, false, $($rest)*) };
    }
    let name = |kernel: &str| kernel.to_string();
    let mut out = vec![
        compile!(name("swiglu_rows"), moe_train::swiglu_rows, line; p(), p(), p(), 0),
        compile!(
            name("swiglu_backward_rows"), moe_train::swiglu_backward_rows, line;
            p(), p(), p(), p(), p(), 0
        ),
        compile!(
            name("combine_backward"), moe_train::combine_backward, line;
            p(), p(), 0, p(), p(), 0, 0, 0
        ),
        compile!(
            name("route_weight_grad"), moe_train::route_weight_grad, line;
            p(), p(), p(), 0, p(), 0, 0, 0
        ),
        compile!(
            name("sum_assignments"), moe_train::sum_assignments, line;
            p(), p(), 0, p(), 0, 0, 0
        ),
        compile!(name("softmax_rows"), exact::softmax_rows, line; p(), p(), 0, 0),
        compile!(name("mean_rows"), exact::mean_rows, line; p(), p(), 0, 0, 0.0),
    ];
    for w_transposed in [false, true] {
        out.push(compile!(
            format!("exact_matmul w_transposed={w_transposed}"), exact::matmul, line;
            p(), p(), p(), 0, 0, 0, 0, w_transposed
        ));
    }
    for gather in [false, true] {
        out.push(compile!(
            format!("grouped_weight_grad gather={gather}"), moe_train::grouped_weight_grad, square;
            p(), p(), p(), 0, 0, p(), 0, 0, gather
        ));
    }
    // The gate + up backward (two gradients, out = intermediate) and the down backward (out = hidden).
    for &format in formats {
        for (two, rows) in [(true, 768usize), (false, 2048)] {
            let (fmt, group) = (format.kernel_code(), format.kernel_group());
            out.push(compile!(
                format!("grouped_transposed {} two={two}", format.name()),
                moe_train::grouped_transposed, square;
                p(), p(), p(), p(), p(), p(), p(), p(), p(), 0, 0, 0, 0, 0, 0,
                fmt, group, rows.div_ceil(crate::format::CHUNK), two
            ));
        }
    }
    out
}

/// The MoE decode path's kernels changed or written after the last GPU session: the routing
/// ([`crate::kernels::route`]: one cube, and the three launches over blocks; 128 experts), the grouped GEMV over a tile's assignments
/// ([`crate::kernels::moe::grouped_gemv`]: gate-up with SwiGLU on gathered rows, 64 chunks on 32 lanes x
/// 8 rows, f32, bf16 and f16 inputs; down on the f32 SwiGLU rows, 24 chunks on 24 lanes x 10 rows; both
/// with the input row staged) and the fused down projection and combine
/// ([`crate::kernels::moe::grouped_gemv_combine`]: top-8, 24 chunks on 24 lanes x 8 slots, one row per
/// cube; f32, bf16 and f16 outputs), as their launchers shape them for a Qwen3-30B-A3B layer (hidden
/// 2048, intermediate 768), for `formats` weights.
pub fn compile_decode_kernels(
    target: CudaTarget,
    formats: &[WeightFormat],
) -> Vec<Result<CompiledKernel, KernelError>> {
    use crate::kernels::moe as moe_kernels;
    use crate::kernels::route::{self as route_kernels, ROUTE_UNITS};
    let p = placeholder;
    let (experts, top_k, chunks) = (128usize, 8usize, 768usize.div_ceil(crate::format::CHUNK));
    let (lanes, rows) = fused_combine_shape(1, top_k, 2048, chunks)
        .expect("a cube for the Qwen3-30B-A3B down projection");
    let line = CubeDim::new_1d(ROUTE_UNITS as u32);
    let mut out = vec![
        compile_dummy!(
            target, format!("route experts={experts}"), false, route_kernels::route, line;
            p(), p(), 0, 0, 0, 0, 0, 0, 0, experts
        ),
        compile_dummy!(
            target, format!("route_count_blocks experts={experts}"), false,
            route_kernels::route_count_blocks, line;
            p(), p(), 0, 0, experts
        ),
        compile_dummy!(
            target, format!("route_offsets experts={experts}"), false,
            route_kernels::route_offsets, line;
            p(), p(), 0, 0, 0, 0, 0, 0, experts
        ),
        compile_dummy!(
            target, format!("route_scatter_blocks experts={experts}"), false,
            route_kernels::route_scatter_blocks, line;
            p(), p(), p(), 0, 0, 0, 0, 0, 0, experts
        ),
    ];
    for &format in formats {
        let (fmt, group) = (format.kernel_code(), format.kernel_group());
        // Gate-up (2048 inputs, 768 rows) for each input type; down (768 inputs, 2048 rows) on f32.
        let products = [
            (true, ActDType::F32),
            (true, ActDType::BF16),
            (true, ActDType::F16),
            (false, ActDType::F32),
        ];
        for (swiglu, dtype) in products {
            let (kind, inn, rows_out) = if swiglu {
                ("gate-up", 2048, 768)
            } else {
                ("down", 768, 2048)
            };
            for per_pass in [1, crate::Kernels::MAX_GEMV_ASSIGNMENTS_PER_PASS] {
                // And with the tile's words held in registers (its own cube), where the format allows.
                for resident in [false, true] {
                    let shape = grouped_gemv_shape(inn, rows_out, swiglu, per_pass, resident)
                        .expect("a grouped GEMV cube");
                    if resident && !gemv_can_hold(format, inn, (shape.chunks, shape.lanes), swiglu)
                    {
                        continue;
                    }
                    let dim = CubeDim::new_2d(shape.lanes as u32, shape.rows_per_cube as u32);
                    let held = if resident { " held" } else { "" };
                    out.push(compile_dummy!(
                        target,
                        format!("grouped_gemv {kind} {} {dtype} p{per_pass}{held}", format.name()),
                        false, moe_kernels::grouped_gemv, dim;
                        p(), p(), 0, p(), p(), p(), p(), p(), p(), 0, 0, 0, 0, 0, 0,
                        fmt, group, shape.lanes, shape.rows_per_cube, shape.chunks, per_pass,
                        swiglu, swiglu, shape.stage_x, resident, dtype.elem()
                    ));
                }
            }
        }
        for dtype in [ActDType::F32, ActDType::BF16, ActDType::F16] {
            out.push(compile_dummy!(
                target, format!("grouped_gemv_combine {} ->{dtype}", format.name()), false,
                moe_kernels::grouped_gemv_combine,
                CubeDim::new_3d(lanes as u32, rows as u32, top_k as u32);
                p(), p(), 0, 0, p(), p(), p(), p(), p(), 0, 0, 0, 0, 0, 0,
                top_k, fmt, group, lanes, rows, chunks, dtype.elem()
            ));
        }
    }
    out
}
