//! RL objectives, advantages, mismatch corrections and metrics (docs/objectives.md, docs/metrics.md): pure functions over
//! tensors, backend-agnostic and differentiable, selected by name from config.
//!
//! - [`advantages`]: group-relative advantages (GRPO, Dr.GRPO, RLOO) and DAPO's dynamic-sampling filter, on the
//!   host (rewards are a handful of floats per prompt).
//! - [`losses`]: the policy objectives (a registry by name: `ppo_clip`, `grpo`, `gspo`, `cispo`, `tbpo`, ...),
//!   their aggregation and the optional KL to a reference (k1, abs, k2 or k3), over burn tensors in the three-policy form (`lp_theta`, `lp_old`, `lp_roll`).
//! - [`corrections`]: training/rollout mismatch corrections (TIS, MIS/IcePop, Geo-RS) as stop-gradient per-token
//!   weights and keep-masks that compose with any objective.
//! - [`metrics`]: the mismatch and stability metrics of section 5 under verl's names, computed on the host.

pub mod advantages;
pub mod corrections;
pub mod error;
pub mod losses;
pub mod metrics;
mod tensor_ops;

pub use error::RlError;
