//! GGUF (llama.cpp's format): reading the container, dequantizing GGML block formats, and importing a
//! Llama-architecture file as a Hugging Face model directory (`qarl import-gguf`).

pub mod dequant;
pub mod import;
pub mod reader;
pub mod tokenizer;

pub use dequant::{dequantize, DequantError, GgmlType};
pub use import::{import_gguf, ImportSummary, OutputDtype, UnknownDtype};
pub use reader::{GgufError, GgufFile, TensorInfo, Value};
