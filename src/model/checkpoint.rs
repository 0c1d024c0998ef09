//! Reading Hugging Face safetensors checkpoints: one `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Tensors are converted to f32 on the way in (F32, BF16 and F16 on disk).
//!
//! The reader remembers which tensors were taken so that, once the model is built, anything left over is
//! reported: an extra tensor usually means the config and the weights disagree (a wrong `num_hidden_layers`,
//! a fused-expert layout), which should fail loudly rather than load a half-initialised model.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};

use super::error::LoadError;
use crate::quant::QuantScheme;

struct ShardFile {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    meta: Metadata,
}

/// An open checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<ShardFile>,
    /// tensor name -> index into `shards`
    index: BTreeMap<String, usize>,
    taken: RefCell<BTreeSet<String>>,
    /// The scheme of packed `*.qweight` tensors (from config.json's `quantization_config`).
    pub quant_scheme: Option<QuantScheme>,
}

/// The key of a quantized checkpoint's safetensors metadata that names its scheme (`qarl quantize` writes
/// it since 2026-12-07; files without it are read by config.json alone).
pub const SCHEME_METADATA: &str = "qarl.scheme";

/// Single-file name HF uses.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

fn open_shard(path: &Path) -> Result<ShardFile, LoadError> {
    let bad = |msg: String| LoadError::BadSafetensors {
        path: path.to_path_buf(),
        msg,
    };
    if path.is_dir() {
        return Err(bad("is a directory".into()));
    }
    let file = std::fs::File::open(path).map_err(|io| LoadError::Io {
        path: path.to_path_buf(),
        io,
    })?;
    // SAFETY: the map is read-only; a checkpoint rewritten while we read it is a user error that at
    // worst yields wrong numbers, never unsafety in safe code that only reads bytes.
    let map = unsafe { Mmap::map(&file) }.map_err(|io| LoadError::Io {
        path: path.to_path_buf(),
        io,
    })?;
    let (header_len, meta) =
        SafeTensors::read_metadata(&map).map_err(|e| bad(explain_header(&map, &e)))?;
    Ok(ShardFile {
        path: path.to_path_buf(),
        data_start: 8 + header_len,
        map,
        meta,
    })
}

/// The files of a model directory besides its config and weights that a load reads (the tokenizer, its
/// special tokens, the chat template, the end tokens and sampling defaults of `generation_config.json`):
/// what goes along wherever qarl writes a model of the same tokens (a quantized copy, a checkpoint).
pub const SIDE_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// Copies the [`SIDE_FILES`] of `from` that exist into `to`.
pub fn copy_side_files(from: &Path, to: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    for f in SIDE_FILES {
        let p = from.join(f);
        if p.is_file() {
            std::fs::copy(&p, to.join(f))
                .with_context(|| format!("{}: cannot copy", p.display()))?;
        }
    }
    Ok(())
}

/// The files of model directory `dir` that loading a model (and its tokenizer and chat template) reads,
/// those that exist: what a command must not write its results over (`crate::io::check_output_not_input`).
pub fn files_read(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::iter::once("config.json")
        .chain(SIDE_FILES)
        .map(|n| dir.join(n))
        .collect();
    if let Ok(entries) = std::fs::read_dir(dir) {
        files.extend(entries.flatten().map(|e| e.path()).filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.ends_with(".safetensors") || n.ends_with(".safetensors.index.json")
            })
        }));
    }
    files.retain(|p| p.exists());
    files
}

impl Checkpoint {
    /// Opens the weights of a model directory.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        let dir = dir.as_ref().to_path_buf();
        let single = dir.join(SINGLE_FILE);
        let index_path = dir.join(INDEX_FILE);
        let mut shards = Vec::new();
        let mut index = BTreeMap::new();
        let present = |path: &PathBuf| {
            crate::io::optional_file(path).map_err(|what| LoadError::NotAFile {
                path: path.clone(),
                what,
            })
        };
        if present(&single)? {
            let shard = open_shard(&single)?;
            for name in shard.meta.tensors().keys() {
                index.insert(name.clone(), 0);
            }
            shards.push(shard);
        } else if present(&index_path)? {
            let text = std::fs::read_to_string(&index_path).map_err(|io| LoadError::Io {
                path: index_path.clone(),
                io,
            })?;
            let bad = |msg: String| LoadError::InvalidConfig {
                path: index_path.clone(),
                msg,
            };
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| bad("missing object `weight_map`".into()))?;
            let mut file_ids: HashMap<String, usize> = HashMap::new();
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| bad(format!("`weight_map.{name}` must be a file name")))?;
                if file.contains('/') || file.contains('\\') || file == ".." {
                    return Err(bad(format!(
                        "`weight_map.{name}` = \"{file}\" must be a plain file name"
                    )));
                }
                let id = match file_ids.get(file) {
                    Some(&id) => id,
                    None => {
                        let shard = open_shard(&dir.join(file))?;
                        shards.push(shard);
                        file_ids.insert(file.to_string(), shards.len() - 1);
                        shards.len() - 1
                    }
                };
                if shards[id].meta.info(name).is_none() {
                    return Err(LoadError::NotInShard {
                        path: shards[id].path.clone(),
                        name: name.clone(),
                        index: index_path.clone(),
                    });
                }
                index.insert(name.clone(), id);
            }
            // Tensors present in a shard but not in the index are extras as well. A tensor in two shards
            // has two values, of which transformers keeps the shard it loads last and the index may name
            // the other: which one the model means is a guess.
            let mut seen: HashMap<String, usize> = HashMap::new();
            for (id, shard) in shards.iter().enumerate() {
                for name in shard.meta.tensors().keys() {
                    if let Some(&other) = seen.get(name.as_str()) {
                        return Err(LoadError::InTwoShards {
                            name: name.clone(),
                            first: shards[other].path.clone(),
                            second: shard.path.clone(),
                        });
                    }
                    seen.insert(name.clone(), id);
                    index.entry(name.clone()).or_insert(id);
                }
            }
        } else {
            return Err(LoadError::NoWeights { dir });
        }
        Ok(Self {
            dir,
            shards,
            index,
            taken: RefCell::new(BTreeSet::new()),
            quant_scheme: None,
        })
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The file a tensor lives in (or, for a tensor that is absent, the file it was looked for in).
    pub fn path_of(&self, name: &str) -> PathBuf {
        match self.index.get(name) {
            Some(&id) => self.shards[id].path.clone(),
            None if self.shards.len() == 1 => self.shards[0].path.clone(),
            None => self.dir.join(INDEX_FILE),
        }
    }

    /// Shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let id = *self.index.get(name)?;
        self.shards[id].meta.info(name).map(|i| i.shape.clone())
    }

    /// Where per-expert tensor `name` (`model.layers.0.mlp.experts.3.up_proj.weight`) is missing, a tensor
    /// of the same layer's experts stored fused (`model.layers.0.mlp.experts.gate_up_proj`), if any.
    fn fused_experts_of(&self, name: &str) -> Option<String> {
        let at = name.find(".mlp.experts.")? + ".mlp.experts.".len();
        let prefix = &name[..at];
        self.index
            .keys()
            .filter(|k| k.starts_with(prefix))
            .find(|k| !k[at..].starts_with(|c: char| c.is_ascii_digit()))
            .cloned()
    }

    /// Finds tensor `name`, checks that its shape is `expected`, and returns its file, dtype and bytes.
    fn locate(&self, name: &str, expected: &[usize]) -> Result<(PathBuf, Dtype, &[u8]), LoadError> {
        let path = self.path_of(name);
        let Some(&id) = self.index.get(name) else {
            if let Some(fused) = self.fused_experts_of(name) {
                return Err(LoadError::BadTensor {
                    path,
                    name: fused,
                    msg: "experts stored fused (transformers' `save_pretrained(save_original_format=False)` \
                          layout); qarl reads one tensor per expert (`experts.0.gate_proj.weight`, ...): \
                          save with `save_original_format=True`"
                        .into(),
                });
            }
            return Err(LoadError::MissingTensor {
                path,
                name: name.to_string(),
                expected: expected.to_vec(),
            });
        };
        let shard = &self.shards[id];
        let info = shard.meta.info(name).expect("index built from metadata");
        if info.shape != expected {
            return Err(LoadError::ShapeMismatch {
                path,
                name: name.to_string(),
                expected: expected.to_vec(),
                got: info.shape.clone(),
            });
        }
        let (start, end) = info.data_offsets;
        Ok((
            path,
            info.dtype,
            &shard.map[shard.data_start + start..shard.data_start + end],
        ))
    }

    /// Checks what [`Self::read_f32`] checks before it decodes (the tensor is there, of shape
    /// `expected`, in a dtype it reads) and marks it as used, without reading its data.
    pub fn check(&self, name: &str, expected: &[usize]) -> Result<(), LoadError> {
        let (path, dtype, _) = self.locate(name, expected)?;
        if !READ_AS_F32.contains(&dtype) {
            return Err(unsupported_dtype(path, name, dtype));
        }
        self.taken.borrow_mut().insert(name.to_string());
        Ok(())
    }

    /// Reads tensor `name` as f32, checking that its shape is `expected`, and marks it as used.
    pub fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        let (path, dtype, bytes) = self.locate(name, expected)?;
        // Quantization scales are f32 as `qarl quantize` writes them: a converted file's bf16 or f16 scales
        // are rounded ones, whose weights differ from the scheme's without a word.
        if name.ends_with(&format!(".{}", super::names::SCALES)) && dtype != Dtype::F32 {
            return Err(LoadError::UnsupportedDtype {
                path,
                name: name.to_string(),
                dtype: format!("{dtype:?}"),
                supported:
                    "F32 (quantization scales as `qarl quantize` writes them; rounded ones would \
                            change the weights)"
                        .into(),
            });
        }
        let out: Vec<f32> = match dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => return Err(unsupported_dtype(path, name, other)),
        };
        if name.ends_with(&format!(".{}", super::names::SCALES)) {
            // Quantization scales: checked here, where the tensor and its file are known (a bad scale found
            // later could only be reported against the layer).
            if let Some(i) = out.iter().position(|s: &f32| !(s.is_finite() && *s >= 0.0)) {
                return Err(LoadError::BadTensor {
                    path,
                    name: name.to_string(),
                    msg: format!(
                        "scale {i} is {}; quantization scales must be finite and non-negative",
                        out[i]
                    ),
                });
            }
        }
        self.taken.borrow_mut().insert(name.to_string());
        Ok(out)
    }

    /// A tensor exactly as stored: dtype, shape and bytes (for copying it unchanged).
    pub fn stored(&self, name: &str) -> Option<(Dtype, Vec<usize>, &[u8])> {
        let shard = &self.shards[*self.index.get(name)?];
        let info = shard.meta.info(name)?;
        let (start, end) = info.data_offsets;
        Some((
            info.dtype,
            info.shape.clone(),
            &shard.map[shard.data_start + start..shard.data_start + end],
        ))
    }

    /// Reads tensor `name` as raw bytes of dtype `dtype` and shape `expected` (packed quantized codes), and
    /// marks it as used.
    pub fn read_raw(
        &self,
        name: &str,
        expected: &[usize],
        dtype: Dtype,
    ) -> Result<Vec<u8>, LoadError> {
        let (path, stored, bytes) = self.locate(name, expected)?;
        if stored != dtype {
            return Err(LoadError::UnsupportedDtype {
                path,
                name: name.to_string(),
                dtype: format!("{stored:?}"),
                supported: format!("{dtype:?} (the packed layout of a quantized checkpoint)"),
            });
        }
        // Packed codes of a one-byte-per-input format (int8, E4M3): checked here, where the tensor and its
        // file are known. Formats packing several inputs per byte are checked when the layer is built.
        if let (Some(scheme), Some(&row_bytes)) = (self.quant_scheme, expected.get(1)) {
            // From the format, not from sizes: a 4-bit row of 2 inputs is also 1 byte.
            let one_byte_per_input = scheme.kind().bits() == 8;
            if name.ends_with(&format!(".{}", super::names::QWEIGHT)) && one_byte_per_input {
                if let Some(bad) = scheme.kind().invalid_code(row_bytes, bytes) {
                    return Err(LoadError::BadTensor {
                        path,
                        name: name.to_string(),
                        msg: format!("{bad}, a code the {scheme} quantizer never writes"),
                    });
                }
            }
        }
        self.taken.borrow_mut().insert(name.to_string());
        Ok(bytes.to_vec())
    }

    /// Each shard file with the value of `key` in its header's `__metadata__` (`None` where it has none).
    pub fn shard_metadata<'a>(
        &'a self,
        key: &'a str,
    ) -> impl Iterator<Item = (&'a Path, Option<&'a str>)> + 'a {
        self.shards.iter().map(move |s| {
            let value = s.meta.metadata().as_ref().and_then(|m| m.get(key));
            (s.path.as_path(), value.map(String::as_str))
        })
    }

    /// Marks a tensor as deliberately ignored (e.g. a stored `lm_head.weight` of a tied model).
    pub fn ignore(&self, name: &str) {
        if self.contains(name) {
            self.taken.borrow_mut().insert(name.to_string());
        }
    }

    /// Fails if some tensor of the checkpoint was never read, naming them.
    pub fn ensure_all_used(&self) -> Result<(), LoadError> {
        let taken = self.taken.borrow();
        let extra: Vec<&str> = self
            .index
            .keys()
            .filter(|n| !taken.contains(*n) && !n.ends_with("rotary_emb.inv_freq"))
            .map(String::as_str)
            .collect();
        if extra.is_empty() {
            return Ok(());
        }
        let shown: Vec<String> = extra.iter().take(8).map(|n| format!("`{n}`")).collect();
        let more = if extra.len() > 8 {
            format!(" and {} more", extra.len() - 8)
        } else {
            String::new()
        };
        Err(LoadError::UnexpectedTensors {
            path: self.path_of(extra[0]),
            names: format!("{}{more}", shown.join(", ")),
        })
    }
}

/// The dtypes [`Checkpoint::read_f32`] decodes (and [`Checkpoint::check`] accepts).
const READ_AS_F32: [Dtype; 3] = [Dtype::F32, Dtype::BF16, Dtype::F16];

/// The error for tensor `name` of `path` stored as `dtype`, which the loader does not read as f32.
fn unsupported_dtype(path: PathBuf, name: &str, dtype: Dtype) -> LoadError {
    LoadError::UnsupportedDtype {
        path,
        name: name.to_string(),
        dtype: format!("{dtype:?}"),
        supported: READ_AS_F32.map(|d| format!("{d:?}")).join(", "),
    }
}

/// Bytes per element of a safetensors dtype name (`None` for one this crate version does not know).
fn dtype_bits(name: &str) -> Option<usize> {
    Some(match name {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// What is wrong with a safetensors header that the safetensors crate rejected, naming the tensor where it
/// can be found (the crate's own messages for shapes, types and offsets do not say which tensor).
fn explain_header(bytes: &[u8], err: &safetensors::SafeTensorError) -> String {
    let fallback = || err.to_string();
    // A clone without git-lfs leaves a small text file naming the weights where the weights should be.
    if bytes.starts_with(b"version https://git-lfs") {
        return "a Git LFS pointer, not the weights: fetch them (`git lfs pull`, or download the file)"
            .into();
    }
    let Some(n) = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
    else {
        return format!("{} bytes: too short for a safetensors header", bytes.len());
    };
    let Some(header) = usize::try_from(n)
        .ok()
        .and_then(|n| bytes.get(8..8usize.checked_add(n)?))
    else {
        return format!(
            "the header length {n} runs past the end of the file ({} bytes)",
            bytes.len()
        );
    };
    let Ok(serde_json::Value::Object(entries)) = serde_json::from_slice(header) else {
        return fallback();
    };
    if let Ok(Some(name)) = crate::io::first_repeated_key(header) {
        return match entries.contains_key(&name) {
            true => format!("tensor `{name}` is listed twice in the header"),
            false => format!("`{name}` is given twice in the header"),
        };
    }
    let mut tensors: Vec<(u64, u64, &String, &serde_json::Value)> = Vec::new();
    for (name, t) in entries.iter().filter(|(k, _)| *k != "__metadata__") {
        let offsets = t["data_offsets"].as_array();
        let (Some(s), Some(e)) = (
            offsets.and_then(|o| o.first()?.as_u64()),
            offsets.and_then(|o| o.get(1)?.as_u64()),
        ) else {
            return format!("tensor `{name}`: `data_offsets` is not a pair of byte offsets");
        };
        let dtype = t["dtype"].as_str().unwrap_or_default();
        if dtype_bits(dtype).is_none() {
            return format!("tensor `{name}`: unknown dtype `{dtype}`");
        }
        if !t["shape"]
            .as_array()
            .is_some_and(|a| a.iter().all(|d| d.as_u64().is_some()))
        {
            return format!("tensor `{name}`: `shape` is not a list of sizes");
        }
        tensors.push((s, e, name, t));
    }
    tensors.sort_by_key(|(s, e, _, _)| (*s, *e));
    let mut next = 0u64;
    for (s, e, name, t) in tensors {
        if s != next || e < s {
            return format!(
                "tensor `{name}`: data offsets [{s}, {e}] do not start where the previous tensor ends ({next})"
            );
        }
        let dtype = t["dtype"].as_str().unwrap_or_default();
        let shape: Vec<u64> = t["shape"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        let bits = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype_bits(dtype).unwrap_or(8) as u64));
        match bits {
            Some(b) if b % 8 == 0 && b / 8 == e - s => {}
            Some(b) => {
                return format!(
                    "tensor `{name}`: {dtype} of shape {shape:?} needs {} bytes, but its data offsets [{s}, {e}] \
                     hold {}",
                    b.div_ceil(8),
                    e - s
                )
            }
            None => return format!("tensor `{name}`: shape {shape:?} is too large"),
        }
        next = e;
    }
    let data = (bytes.len() as u64).saturating_sub(8 + n);
    if next != data {
        return format!(
            "the header's tensors cover {next} bytes of data, but the file holds {data}"
        );
    }
    fallback()
}
