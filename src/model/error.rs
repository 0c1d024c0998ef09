//! The model's errors: loading (each names the file and what is wrong with it), quantizing (the layer), and
//! token ids that a forward cannot take (the row and the id; the caller names where the ids came from).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: {}", path.display(), crate::io::os_error_text(io))]
    Io { path: PathBuf, io: std::io::Error },
    #[error("{path}: missing key `{key}`")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: {msg}")]
    InvalidConfig { path: PathBuf, msg: String },
    #[error("{path}: unknown architecture `{name}` (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)")]
    UnknownArchitecture { path: PathBuf, name: String },
    #[error("{path}: not a valid safetensors file: {msg}")]
    BadSafetensors { path: PathBuf, msg: String },
    #[error(
        "{dir}: no weights found (expected model.safetensors or model.safetensors.index.json)"
    )]
    NoWeights { dir: PathBuf },
    #[error("{path}: tensor `{name}` is listed in {index} for this shard but is not in it")]
    NotInShard {
        path: PathBuf,
        name: String,
        index: PathBuf,
    },
    #[error("tensor `{name}` is in two shards, {first} and {second}: which value the model has is ambiguous")]
    InTwoShards {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("{path}: tensor `{name}`: {msg}")]
    BadTensor {
        path: PathBuf,
        name: String,
        msg: String,
    },
    #[error("{path}: missing tensor `{name}` (expected shape {expected:?})")]
    MissingTensor {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
    },
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("{path}: tensor `{name}` has dtype {dtype}; supported here: {supported}")]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        dtype: String,
        /// What this tensor may be stored as (`F32, BF16, F16` for weights read as f32, one dtype for
        /// packed codes and scales).
        supported: String,
    },
    #[error("{path}: unexpected tensor(s) the model does not use: {names}")]
    UnexpectedTensors { path: PathBuf, names: String },
    #[error("{path}: tokenizer: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    #[error("{path}: {what}, where a file was expected")]
    NotAFile { path: PathBuf, what: &'static str },
    #[error(
        "{}: the checkpoint is quantized ({scheme}), but this needs the full-precision model it was \
         quantized from (training updates full-precision weights; comparing precisions quantizes them)",
        dir.display()
    )]
    QuantizedCheckpoint { dir: PathBuf, scheme: String },
}

/// Errors of putting a model's weights in a precision: one weight that cannot be quantized (named), or a
/// selection that matches no layer.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    // `error`, not `source`: thiserror would make a `source` field the cause, and `{:#}` would print it twice.
    #[error("{layer}: {error}")]
    Layer {
        layer: String,
        error: crate::quant::QuantError,
    },
    #[error("no layer matches the quantization patterns ({patterns})")]
    NoLayerSelected { patterns: String },
    #[error(transparent)]
    Selection(#[from] crate::quant::QuantError),
}

/// Token ids a forward cannot take, found by [`crate::model::Decoder::check_ids`] and
/// [`crate::model::Decoder::check_prompts`] before they reach the forward (which indexes by them and would
/// panic). The messages name the row; the caller prefixes the file or flag the ids came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("no sequences given")]
    NoSequences,
    #[error("row {row} is empty: sequences must not be empty")]
    EmptyRow { row: usize },
    #[error("row {row}: token id {id} is outside the vocabulary (size {vocab_size})")]
    OutOfVocabulary {
        row: usize,
        id: u32,
        vocab_size: usize,
    },
    #[error("row {row} has {len} ids, row 0 has {first}: rows must have equal lengths")]
    RaggedRows {
        row: usize,
        len: usize,
        first: usize,
    },
    #[error("rows of {len} ids are longer than the model's max_position_embeddings ({limit})")]
    TooLong { len: usize, limit: usize },
}
