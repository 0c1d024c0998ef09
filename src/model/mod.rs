//! The decoder-only transformer (Llama / Qwen2 / Qwen3 / Qwen3-MoE), its Hugging Face checkpoint loading and
//! KV cache, log-prob scoring and quantizing a model. The model does not know whether it is rolling out or
//! training: each forward receives which weights to multiply with ([`Weights`]: the packed quantized version
//! or the f32 masters), and its linear layers do the quantized or full-precision matmul.

pub mod activations;
pub mod attention;
pub mod checkpoint;
pub mod config;
pub mod cost;
pub mod decoder;
mod end_tokens;
pub mod error;
pub mod gguf;
pub mod init;
pub mod layers;
pub mod mlp;
pub mod names;
pub mod params;
pub mod quantize;
pub mod save;
pub mod scoring;
pub mod tokenizer;

pub use activations::Activations;
pub use checkpoint::Checkpoint;
pub use config::{Architecture, ModelConfig, MoeConfig};
pub use decoder::{Decoder, ForwardOutput, KvCache};
pub use end_tokens::EndTokens;
pub use error::{LoadError, QuantizeError};
pub use layers::Weights;
pub use quantize::{quantize_checkpoint, QuantizeSummary};
pub use tokenizer::Tokenizer;
