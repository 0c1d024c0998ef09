//! qarl: a burn-based research framework for reinforcement learning of LLMs with quantized rollouts that stay
//! aligned with training (QaRL, TBPO; the method and formats as implemented: `docs/`).
//!
//! The modules, from the ground up (each imports only modules listed before it):
//! - [`device_failures`]: the device failures CubeCL only logs, counted so that no result computed after
//!   one is written.
//! - [`host`]: host tensor helpers (tensors from `Vec`s and back).
//! - [`io`]: atomic file writes (JSON, safetensors).
//! - [`quant`]: the quantization formats (quantize, pack, dequantize); no tensors.
//! - [`tasks`]: prompts, datasets and the exact answer verifier; no tensors.
//! - [`ops`]: the custom backend ops under the bitwise contract (low-bit matmul with its straight-through
//!   backward, fixed-order matmul / softmax / attention core, grouped MoE), one implementation per backend
//!   (CPU SIMD kernels, CubeCL, autodiff), the deterministic switch and the backend choice.
//! - [`model`]: the config-driven decoder (Llama / Qwen2 / Qwen3 / Qwen3-MoE), Hugging Face checkpoints, KV
//!   cache, log-prob scoring, quantizing a model; it does not know whether it is rolling out or training.
//! - [`rollout`]: batched sampling with recorded log-probs and MoE routing; no RL knowledge.
//! - [`rl`]: advantages, policy objectives, mismatch corrections and metrics: functions over tensors.
//! - [`train`]: the SFT and RL loops, evaluation, checkpoints, metrics files, experiments.
//! - [`cli`]: the `qarl` command line: argument parsing that calls into the above.

pub mod cli;
pub mod device_failures;
pub mod host;
pub mod io;
pub mod model;
pub mod ops;
pub mod quant;
pub mod rl;
pub mod rollout;
pub mod tasks;
pub mod train;
