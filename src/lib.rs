//! qarl: a burn-based research framework for reinforcement learning of LLMs with quantized rollouts that stay
//! aligned with training (QaRL, TBPO).
//!
//! - [`model`] holds the config-driven decoder (Llama / Qwen2 / Qwen3 / Qwen3-MoE), HF checkpoints, KV cache.
//! - [`rollout`] generates.
//! - [`backend`] picks the backend at run time.
//! - [`cli`] is the `qarl` command line.

pub mod backend;
pub mod cli;
pub mod io;
pub mod model;
pub mod quant;
pub mod rl;
pub mod rollout;
pub mod tasks;
pub mod train;
