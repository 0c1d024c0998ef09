//! Process-wide switches of the custom ops: deterministic mode (batch-invariant, fixed-order kernels, the
//! default), the order of its low-bit products on the CubeCL backends (canonical or tensor-core tiles), and
//! whether MoE layers take the grouped-experts op where the backend has one.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

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

/// The most sets of planes among which the fragment tiles split a call's scale groups where its cubes
/// are few (`train.fragment_group_splits`; `cube_kernels::FragmentShape::with_group_splits`): a layout
/// choice that keeps every bit, process-wide like [`set_fragment_tiles`] so a rollout and the training
/// forward launch alike.
static FRAGMENT_GROUP_SPLITS: AtomicUsize = AtomicUsize::new(1);

/// Sets [`fragment_group_splits`] (1, 2 or 4; the config checks the value).
pub fn set_fragment_group_splits(splits: usize) {
    FRAGMENT_GROUP_SPLITS.store(splits, Ordering::Relaxed);
}

/// The most sets of planes the fragment tiles split scale groups among ([`set_fragment_group_splits`]).
pub fn fragment_group_splits() -> usize {
    FRAGMENT_GROUP_SPLITS.load(Ordering::Relaxed)
}

/// Whether the CubeCL kernels fill every fresh output with all-ones bits (NaN) before a kernel writes it
/// (`QARL_POISON_OUTPUTS=1`; `cube_kernels::Kernels::with_poisoned_outputs`): a value a kernel fails
/// to write then shows as NaN (the runs report non-finite values) instead of passing as whatever the
/// memory pool's freed buffer held. A debugging aid, one more launch per allocation; off by default. A
/// value other than `0` or `1` is refused on the command line ([`check_poison_env`]) and, read deep in
/// the ops, reported once and taken as off.
pub fn poison_outputs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(
        || match parse_poison(std::env::var("QARL_POISON_OUTPUTS").ok().as_deref()) {
            Ok(on) => on,
            Err(why) => {
                eprintln!("warning: {why}; outputs are not poisoned");
                false
            }
        },
    )
}

/// `QARL_POISON_OUTPUTS` checked where a caller can still refuse it (the command line, before any work).
pub fn check_poison_env() -> Result<(), String> {
    parse_poison(std::env::var("QARL_POISON_OUTPUTS").ok().as_deref()).map(|_| ())
}

/// The switch `QARL_POISON_OUTPUTS=value` asks for: unset, empty or `0` off, `1` on, anything else an
/// error naming it.
fn parse_poison(value: Option<&str>) -> Result<bool, String> {
    match value.map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(format!(
            "QARL_POISON_OUTPUTS={other} is not 0 or 1 (1 fills fresh kernel outputs with NaN)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_poison;

    /// `0`, `1`, empty and unset are the switch's values; anything else is an error that names it.
    #[test]
    fn poison_switch_takes_zero_or_one() {
        assert_eq!(parse_poison(None), Ok(false));
        assert_eq!(parse_poison(Some("")), Ok(false));
        assert_eq!(parse_poison(Some("0")), Ok(false));
        assert_eq!(parse_poison(Some(" 1 ")), Ok(true));
        let err = parse_poison(Some("yes")).unwrap_err();
        assert!(
            err.contains("QARL_POISON_OUTPUTS=yes") && err.contains("0 or 1"),
            "{err}"
        );
    }
}
