//! The GGUF container (versions 2 and 3): header, metadata key/values, tensor infos, aligned data section.
//!
//! Every length and offset read from the file is checked against the file's size before anything is
//! allocated or sliced, so a truncated or hostile file is an error naming the file and the field, never a
//! panic or an absurd allocation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::dequant::GgmlType;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

/// Plain text for messages: numbers and strings as written (`linear`, not `String("linear")`), arrays by their
/// first items and length.
impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(v) => write!(f, "{v}"),
            Value::Array(a) => {
                const SHOWN: usize = 4;
                write!(f, "[")?;
                for (i, v) in a.iter().take(SHOWN).enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{v}")?;
                }
                if a.len() > SHOWN {
                    write!(f, ", ... ({} items)", a.len())?;
                }
                write!(f, "]")
            }
        }
    }
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value's GGUF type as gguf-py names it, lower-cased, for messages (`uint8`, `string`; an array by
    /// its first item's type, `array of int32`, since an empty array keeps no item type here).
    pub fn type_name(&self) -> String {
        match self {
            Value::U8(_) => "uint8".into(),
            Value::I8(_) => "int8".into(),
            Value::U16(_) => "uint16".into(),
            Value::I16(_) => "int16".into(),
            Value::U32(_) => "uint32".into(),
            Value::I32(_) => "int32".into(),
            Value::U64(_) => "uint64".into(),
            Value::I64(_) => "int64".into(),
            Value::F32(_) => "float32".into(),
            Value::F64(_) => "float64".into(),
            Value::Bool(_) => "bool".into(),
            Value::String(_) => "string".into(),
            Value::Array(a) => match a.first() {
                Some(v) => format!("array of {}", v.type_name()),
                None => "array (empty)".into(),
            },
        }
    }
}

/// One tensor's entry in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the fastest-varying (the input features of a weight).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Byte range of the data inside the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in row-major order (`[rows, cols]` for a weight: the reverse of `dims`).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An error reading a GGUF file: the file and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{}: {msg}", path.display())]
pub struct GgufError {
    pub path: PathBuf,
    pub msg: String,
}

/// A memory-mapped GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    map: memmap2::Mmap,
}

/// Bounds on what a sane file holds; beyond them the file is rejected before allocating.
const MAX_TENSORS: u64 = 1 << 20;
const MAX_KV: u64 = 1 << 20;
const MAX_DIMS: u32 = 8;
const MAX_NESTING: usize = 4;

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: impl Into<String>) -> GgufError {
        GgufError {
            path: self.path.to_path_buf(),
            msg: format!("{} (at byte {})", msg.into(), self.pos),
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let left = (self.bytes.len() - self.pos) as u64;
        if n > self.bytes.len() as u64 {
            // No file is that short: the length read is not one (a count in the header said more or
            // fewer entries than it holds, and the bytes of another field were read as a length).
            return Err(self.err(format!(
                "{what}: a length of {n} bytes, more than the whole file: the header is damaged, or one \
                 of its counts says more or fewer entries than it holds"
            )));
        }
        if n > left {
            return Err(self.err(format!(
                "truncated: {what} needs {n} bytes, {left} left in the file"
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        Ok(s.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(self.array::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("{what}: boolean byte {b}"))),
            },
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(
                        self.err(format!("{what}: arrays nested deeper than {MAX_NESTING}"))
                    );
                }
                let elem = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the bytes left is a lie.
                if n > (self.bytes.len() - self.pos) as u64 {
                    return Err(self.err(format!(
                        "{what}: array of {n} elements longer than the file"
                    )));
                }
                let mut out = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    out.push(self.value(elem, what, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(self.err(format!("{what}: unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and indexes `path` (the tensor data stays memory-mapped).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let err = |msg: String| GgufError {
            path: path.to_path_buf(),
            msg,
        };
        if path.is_dir() {
            return Err(err("is a directory, not a GGUF file".into()));
        }
        let file = std::fs::File::open(path)
            .map_err(|e| err(format!("cannot open ({})", crate::io::os_error_text(&e))))?;
        // SAFETY: the map is read-only; the file is not expected to change while it is open (same contract
        // as every mmap-based model loader, safetensors included).
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| err(format!("cannot map ({})", crate::io::os_error_text(&e))))?;
        let mut c = Cursor {
            bytes: &map,
            pos: 0,
            path,
        };
        if c.take(4, "magic").ok() != Some(b"GGUF".as_slice()) {
            return Err(err("not a GGUF file (no `GGUF` magic)".into()));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(err(format!(
                "GGUF version {version} (2 and 3 are supported)"
            )));
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        if n_tensors > MAX_TENSORS || n_kv > MAX_KV {
            return Err(err(format!(
                "{n_tensors} tensors and {n_kv} metadata entries: beyond any real model"
            )));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let v = c.value(ty, &format!("metadata `{key}`"), 0)?;
            if metadata.contains_key(&key) {
                return Err(c.err(format!("metadata `{key}` is listed twice")));
            }
            metadata.insert(key, v);
        }
        let mut raw = Vec::with_capacity(n_tensors as usize);
        let mut names = std::collections::HashSet::new();
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            if !names.insert(name.clone()) {
                return Err(c.err(format!("tensor `{name}` is listed twice")));
            }
            let nd = c.u32(&format!("tensor `{name}` rank"))?;
            if nd == 0 || nd > MAX_DIMS {
                return Err(c.err(format!("tensor `{name}`: rank {nd}")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(c.u64(&format!("tensor `{name}` dims"))?);
            }
            let ty = c.u32(&format!("tensor `{name}` type"))?;
            let offset = c.u64(&format!("tensor `{name}` offset"))?;
            raw.push((name, dims, ty, offset));
        }
        let align = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a,
                _ => return Err(err(format!("general.alignment = {v}: not a power of two"))),
            },
        };
        let data_start = (c.pos as u64).div_ceil(align) * align;
        let file_len = map.len() as u64;
        // A header whose counts say less than it holds still parses, and its data section then starts
        // inside the rest of the header: every tensor would be read from the wrong place. The padding is
        // zeros, the tensors follow each other, and the last one ends the file, or it is not this header's.
        let padding = map.get(c.pos..data_start as usize).unwrap_or_default();
        if padding.iter().any(|&b| b != 0) {
            return Err(err(format!(
                "bytes {}..{data_start} between the header and the tensor data are not zero padding: \
                 the header's tensor or metadata count, or its alignment ({align}), does not describe the file",
                c.pos
            )));
        }
        let mut tensors = Vec::with_capacity(raw.len());
        let mut next = 0u64;
        for (name, dims, ty, offset) in raw {
            let ty = GgmlType::from_id(ty).ok_or_else(|| match GgmlType::other_name(ty) {
                Some(known) => err(format!(
                    "tensor `{name}`: {}",
                    super::dequant::DequantError::Unsupported { ty: known }
                )),
                None => err(format!("tensor `{name}`: unknown GGML type id {ty}")),
            })?;
            let elements = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| err(format!("tensor `{name}`: dims {dims:?} overflow")))?;
            let len = ty
                .bytes_for(dims[0], elements)
                .map_err(|m| err(format!("tensor `{name}` ({} {dims:?}): {m}", ty.name())))?;
            let start = data_start
                .checked_add(offset)
                .filter(|s| s.checked_add(len).is_some_and(|e| e <= file_len))
                .ok_or_else(|| {
                    err(format!(
                        "tensor `{name}`: data at offset {offset} + {len} bytes runs past the end of the file ({file_len} bytes)"
                    ))
                })?;
            // llama.cpp's layout, which its reader requires: each tensor right after the one listed
            // before it, at the next multiple of the alignment.
            if offset != next {
                return Err(err(format!(
                    "tensor `{name}`: data at offset {offset}, where the tensors listed before it end at \
                     {next} (aligned to {align} bytes): overlapping or misplaced data"
                )));
            }
            next = (offset + len).div_ceil(align) * align;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                start: start as usize,
                len: len as usize,
            });
        }
        let data_end = tensors
            .last()
            .map_or(data_start, |t| (t.start + t.len) as u64);
        if file_len.saturating_sub(data_end) >= align {
            return Err(err(format!(
                "{} bytes after the end of the tensor data{}: the header's tensor count or sizes do not \
                 describe the file",
                file_len.saturating_sub(data_end),
                tensors
                    .last()
                    .map(|t| format!(" (tensor `{}`, the last listed)", t.name))
                    .unwrap_or_default()
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            map,
        })
    }

    /// The raw bytes of one tensor.
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.start..t.start + t.len]
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// An error about this file.
    pub fn error(&self, msg: impl Into<String>) -> GgufError {
        GgufError {
            path: self.path.clone(),
            msg: msg.into(),
        }
    }

    /// A required metadata value.
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata
            .get(key)
            .ok_or_else(|| self.error(format!("metadata `{key}` is missing")))
    }

    /// The error for metadata `key` = `v` that is not `expected` (`an unsigned integer`): the value and its
    /// GGUF type, so that a number stored as a string (`1`) is told apart from the number.
    pub fn wrong_type(&self, key: &str, v: &Value, expected: &str) -> GgufError {
        self.error(format!(
            "metadata `{key}` = {v} is not {expected} (its GGUF type is {})",
            v.type_name()
        ))
    }

    /// The error for item `i` of the array `key`: as [`Self::wrong_type`].
    pub fn wrong_item(&self, key: &str, i: usize, v: &Value, expected: &str) -> GgufError {
        self.error(format!(
            "metadata `{key}` item {i} = {v} is not {expected} (its GGUF type is {})",
            v.type_name()
        ))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong_type(key, v, "an unsigned integer"))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.get(key)?;
        v.as_f64()
            .ok_or_else(|| self.wrong_type(key, v, "a number"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.get(key)?;
        v.as_str()
            .ok_or_else(|| self.wrong_type(key, v, "a string"))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.get(key)?;
        v.as_bool()
            .ok_or_else(|| self.wrong_type(key, v, "a boolean"))
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        let v = self.get(key)?;
        v.as_array()
            .ok_or_else(|| self.wrong_type(key, v, "an array"))
    }

    /// An array of strings, each item checked.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.get_array(key)?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .ok_or_else(|| self.wrong_item(key, i, v, "a string"))
            })
            .collect()
    }

    // Optional keys: absent is `None` (the caller's default); present but of another type is an error, never
    // the default.

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.optional(key, Self::get_u64)
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.optional(key, Self::get_f64)
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.optional(key, Self::get_str)
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.optional(key, Self::get_bool)
    }

    pub fn opt_array(&self, key: &str) -> Result<Option<&[Value]>, GgufError> {
        self.optional(key, Self::get_array)
    }

    fn optional<'a, T>(
        &'a self,
        key: &str,
        get: impl FnOnce(&'a Self, &str) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        if self.metadata.contains_key(key) {
            get(self, key).map(Some)
        } else {
            Ok(None)
        }
    }
}
