//! Process-wide switches of the custom ops: deterministic mode (batch-invariant, fixed-order kernels, the
//! default) and whether MoE layers take the grouped-experts op where the backend has one.

use std::sync::atomic::{AtomicBool, Ordering};

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
