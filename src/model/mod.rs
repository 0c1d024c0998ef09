//! The decoder-only transformer (Llama / Qwen2 / Qwen3 / Qwen3-MoE), its Hugging Face checkpoint loading and
//! KV cache. The model does not know whether it is rolling out or training: its linear layers decide the
//! arithmetic.

pub mod attention;
pub mod checkpoint;
pub mod config;
pub mod decoder;
pub mod error;
pub mod gguf;
pub mod init;
pub mod layers;
pub mod mlp;
pub mod save;
pub mod scoring;
pub mod tokenizer;

pub use checkpoint::Checkpoint;
pub use config::{Architecture, ModelConfig, MoeConfig};
pub use decoder::{Decoder, ForwardOutput, KvCache};
pub use error::LoadError;
pub use tokenizer::Tokenizer;
