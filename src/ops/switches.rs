//! Process-wide switches of the custom ops: deterministic mode (batch-invariant, fixed-order kernels, the
//! default), the order of its low-bit products on the CubeCL backends (canonical or tensor-core tiles), and
//! whether MoE layers take the grouped-experts op where the backend has one.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use burn::tensor::DType;

static DETERMINISTIC: AtomicBool = AtomicBool::new(true);

/// Deterministic mode (the default): every matmul, softmax and log-softmax of the forward runs in one fixed,
/// batch-invariant order (on the CPU; see [`super::cpu`]), and log-probs come from one fixed-order host
/// routine shared by the rollout's sampler and the training forward, so that the recorded and the re-scored
/// log-probs of a token are bitwise equal. Off: the backend's own kernels (faster, rounding differs).
pub fn set_deterministic(on: bool) {
    DETERMINISTIC.store(on, Ordering::Relaxed);
}

/// Whether deterministic mode is on.
pub fn deterministic() -> bool {
    DETERMINISTIC.load(Ordering::Relaxed)
}

static GROUPED_EXPERTS: AtomicBool = AtomicBool::new(true);

/// Whether MoE layers use the grouped op where the backend has one (the default), or always the per-expert
/// loop (`qarl bench rollout --moe-experts loop` times the two side by side).
pub fn set_grouped_experts(on: bool) {
    GROUPED_EXPERTS.store(on, Ordering::Relaxed);
}

pub fn grouped_experts() -> bool {
    GROUPED_EXPERTS.load(Ordering::Relaxed)
}

/// The tensor-core tiles' operand type: 0 none (the canonical order), 1 f16, 2 bf16.
static TENSOR_TILES: AtomicU8 = AtomicU8::new(0);

/// Deterministic mode's low-bit products on the CubeCL backends in the tensor-core tiles' order with
/// operands of `operand` (f16 or bf16; `train.tensor_cores`), or in the canonical f32 order (`None`, the
/// default). A process-wide switch, as deterministic mode is, so a rollout and the training forward that
/// re-scores it take the same order. Another dtype is a programming error (config validation refuses it).
pub fn set_tensor_tiles(operand: Option<DType>) {
    let code = match operand {
        None => 0,
        Some(DType::F16) => 1,
        Some(DType::BF16) => 2,
        Some(other) => panic!("tensor-core tiles take f16 or bf16 operands, not {other:?}"),
    };
    TENSOR_TILES.store(code, Ordering::Relaxed);
}

/// The operand type of the tensor-core tiles' order when it is on ([`set_tensor_tiles`]).
pub fn tensor_tiles() -> Option<DType> {
    match TENSOR_TILES.load(Ordering::Relaxed) {
        1 => Some(DType::F16),
        2 => Some(DType::BF16),
        _ => None,
    }
}

/// Whether the tensor-core tiles' order runs on the fragment tiles (`train.tensor_core_kernel =
/// "fragments"`; `cube_kernels::kernels::mma_frag`) rather than the tiles: the same order, the same bits
/// on the scalar twins, expected the same on the instruction. A process-wide switch like
/// [`set_tensor_tiles`], so a rollout and the training forward take the same kernels.
static FRAGMENT_TILES: AtomicBool = AtomicBool::new(false);

/// Sets [`fragment_tiles`].
pub fn set_fragment_tiles(on: bool) {
    FRAGMENT_TILES.store(on, Ordering::Relaxed);
}

/// Whether the tensor-core tiles' order runs on the fragment tiles ([`set_fragment_tiles`]).
pub fn fragment_tiles() -> bool {
    FRAGMENT_TILES.load(Ordering::Relaxed)
}
