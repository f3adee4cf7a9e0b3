//! Reader for GGUF files, the single-file model format of llama.cpp/ggml.
//!
//! A GGUF file is a little-endian header (magic `GGUF`, version, tensor and
//! metadata counts), a list of typed metadata key/values, a list of tensor
//! infos (name, dimensions with `ne0` — the contiguous one — first, ggml
//! type, offset), and then the tensor data, each tensor aligned to
//! `general.alignment` bytes (default 32). Versions 2 and 3 share this
//! layout; version 1 (32-bit counts) is obsolete and rejected.
//!
//! [`GgufFile::open`] memory-maps the file and validates everything it can up
//! front — counts against the bytes that remain, every tensor's data range
//! against the file size — so that a truncated or corrupt file is reported
//! as an error naming the file instead of panicking later.
//! [`GgufFile::dequantize`] turns the tensors of the types in
//! `formats::dequant::DEQUANTIZABLE_TYPES` into `f32`s.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Context};
use memmap2::Mmap;

use crate::formats::dequant::{block_decoder, DEQUANTIZABLE_TYPES};
pub use crate::formats::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions (`GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Real files nest arrays at most one level deep; the limit keeps a crafted
/// file from exhausting the stack through recursion.
const MAX_ARRAY_NESTING: usize = 8;

/// A metadata value. Integer and float widths are kept as stored so that
/// nothing is lost; the `get_*` helpers of [`GgufFile`] convert leniently.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "uint8",
            Self::I8(_) => "int8",
            Self::U16(_) => "uint16",
            Self::I16(_) => "int16",
            Self::U32(_) => "uint32",
            Self::I32(_) => "int32",
            Self::F32(_) => "float32",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(_) => "array",
            Self::U64(_) => "uint64",
            Self::I64(_) => "int64",
            Self::F64(_) => "float64",
        }
    }

    /// Any integer type, as `i128` so that every stored value fits.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(v) => v.into(),
            Self::I8(v) => v.into(),
            Self::U16(v) => v.into(),
            Self::I16(v) => v.into(),
            Self::U32(v) => v.into(),
            Self::I32(v) => v.into(),
            Self::U64(v) => v.into(),
            Self::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// `float32` or `float64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor-info table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions with `ne0` (the contiguous one) first: a matrix with
    /// `dims = [ne0, ne1]` is stored row-major as `[ne1][ne0]`.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Total number of values. Checked against overflow when the file is
    /// opened, so plain multiplication is safe for infos from [`GgufFile`].
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Size of the tensor's data in bytes.
    pub fn n_bytes(&self) -> u64 {
        self.n_elements() / self.ggml_type.block_size() * self.ggml_type.block_bytes()
    }

    /// The dimensions in row-major order (outermost first), e.g. `[rows, cols]`
    /// for a matrix, which is how PyTorch and safetensors list shapes.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// An opened, validated, memory-mapped GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Absolute file offset where the data section starts.
    data_start: u64,
    bytes: FileBytes,
}

/// The bytes of a GGUF file: mapped from disk, or held in memory (tests).
enum FileBytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Owned(v) => v,
        }
    }
}

impl fmt::Debug for GgufFile {
    // The metadata can hold hundreds of thousands of vocabulary strings, so
    // only a summary is shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Opens and validates a GGUF file. Tensor data is not read until asked
    /// for.
    pub fn open(path: impl AsRef<Path>) -> anyhow::Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path)
            .with_context(|| format!("cannot open GGUF file {}", path.display()))?;
        // SAFETY: the mapping is only read. As with any memory map, another
        // process truncating or rewriting the file while it is mapped would be
        // undefined behaviour; model files are not modified in place.
        let mmap = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot memory-map GGUF file {}", path.display()))?;
        Self::parse(path, FileBytes::Mapped(mmap))
    }

    /// As [`GgufFile::open`], for a file's bytes already in memory; `path`
    /// only names it in messages (the mutation tests parse thousands).
    pub fn from_bytes(path: impl AsRef<Path>, bytes: Vec<u8>) -> anyhow::Result<Self> {
        Self::parse(path.as_ref().to_path_buf(), FileBytes::Owned(bytes))
    }

    fn parse(path: PathBuf, bytes: FileBytes) -> anyhow::Result<Self> {
        // One line naming the file and the whole cause chain, so that the
        // message is complete however the caller prints it.
        let parsed =
            parse(&bytes).map_err(|e| anyhow!("{}: invalid GGUF file: {e:#}", path.display()))?;
        Ok(Self {
            path,
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_start: parsed.data_start,
            bytes,
        })
    }

    /// The value of a metadata key, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// Runs one of the `get_*` helpers only if `key` is present: a missing
    /// key is `Ok(None)`, a present key of the wrong type still an error.
    pub fn opt<'a, T>(
        &'a self,
        key: &str,
        get: impl FnOnce(&'a Self, &str) -> anyhow::Result<T>,
    ) -> anyhow::Result<Option<T>> {
        if self.metadata.contains_key(key) {
            get(self, key).map(Some)
        } else {
            Ok(None)
        }
    }

    fn require(&self, key: &str) -> anyhow::Result<&GgufValue> {
        self.metadata
            .get(key)
            .ok_or_else(|| anyhow!("{}: metadata key `{key}` is missing", self.path.display()))
    }

    fn wrong_type(&self, key: &str, value: &GgufValue, expected: &str) -> anyhow::Error {
        anyhow!(
            "{}: metadata key `{key}` is a {}, expected {expected}",
            self.path.display(),
            value.type_name()
        )
    }

    /// Any integer type whose value fits in `u32` (converters disagree on
    /// signedness and width, e.g. token ids stored as int32).
    pub fn get_u32(&self, key: &str) -> anyhow::Result<u32> {
        self.get_integer(key, "an integer in u32 range")
    }

    /// Any integer type whose value fits in `u64`.
    pub fn get_u64(&self, key: &str) -> anyhow::Result<u64> {
        self.get_integer(key, "a non-negative integer")
    }

    fn get_integer<T: TryFrom<i128>>(&self, key: &str, expected: &str) -> anyhow::Result<T> {
        let value = self.require(key)?;
        match value.as_integer() {
            Some(v) => T::try_from(v).map_err(|_| {
                anyhow!(
                    "{}: metadata key `{key}` is {v}, expected {expected}",
                    self.path.display()
                )
            }),
            None => Err(self.wrong_type(key, value, expected)),
        }
    }

    /// `float32`, or `float64` rounded to `f32`.
    pub fn get_f32(&self, key: &str) -> anyhow::Result<f32> {
        let value = self.require(key)?;
        // f32 -> f64 -> f32 is exact, so only float64 values are rounded.
        value
            .as_f64()
            .map(|v| v as f32)
            .ok_or_else(|| self.wrong_type(key, value, "a float"))
    }

    /// A `bool` value.
    pub fn get_bool(&self, key: &str) -> anyhow::Result<bool> {
        let value = self.require(key)?;
        value
            .as_bool()
            .ok_or_else(|| self.wrong_type(key, value, "a bool"))
    }

    /// A string value, borrowed from the parsed metadata.
    pub fn get_str(&self, key: &str) -> anyhow::Result<&str> {
        let value = self.require(key)?;
        value
            .as_str()
            .ok_or_else(|| self.wrong_type(key, value, "a string"))
    }

    /// An array whose elements are all strings, e.g. `tokenizer.ggml.tokens`.
    pub fn get_str_array(&self, key: &str) -> anyhow::Result<Vec<&str>> {
        self.get_array(key, "an array of strings", GgufValue::as_str)
    }

    /// An array of any integer type whose values fit in `i64`.
    pub fn get_i64_array(&self, key: &str) -> anyhow::Result<Vec<i64>> {
        self.get_array(key, "an array of integers", |item| {
            item.as_integer().and_then(|v| i64::try_from(v).ok())
        })
    }

    /// An array of floats (`float32`, or `float64` rounded to `f32`), e.g.
    /// `tokenizer.ggml.scores`.
    pub fn get_f32_array(&self, key: &str) -> anyhow::Result<Vec<f32>> {
        self.get_array(key, "an array of floats", |item| {
            item.as_f64().map(|v| v as f32)
        })
    }

    /// An array whose every element `element` takes; `expected` says what
    /// it must hold.
    fn get_array<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        element: impl Fn(&'a GgufValue) -> Option<T>,
    ) -> anyhow::Result<Vec<T>> {
        let value = self.require(key)?;
        let items = value
            .as_array()
            .ok_or_else(|| self.wrong_type(key, value, expected))?;
        items
            .iter()
            .map(|item| element(item).ok_or_else(|| self.array_item_type(key, item, expected)))
            .collect()
    }

    fn array_item_type(&self, key: &str, item: &GgufValue, expected: &str) -> anyhow::Error {
        anyhow!(
            "{}: metadata key `{key}` holds a {} element, expected {expected}",
            self.path.display(),
            item.type_name()
        )
    }

    /// The tensor info with this name, if any.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor as stored in the file.
    pub fn tensor_data(&self, tensor: &GgufTensorInfo) -> anyhow::Result<&[u8]> {
        let bytes = (|| {
            let start = usize::try_from(self.data_start.checked_add(tensor.offset)?).ok()?;
            let len = usize::try_from(tensor.n_bytes()).ok()?;
            self.bytes.get(start..start.checked_add(len)?)
        })();
        bytes.ok_or_else(|| {
            anyhow!(
                "{}: data of tensor `{}` ({} bytes at offset {}) lies outside the file",
                self.path.display(),
                tensor.name,
                tensor.n_bytes(),
                tensor.offset
            )
        })
    }

    /// Decodes a tensor to `f32`, in storage order (`ne0` fastest).
    ///
    /// Supports the types in [`DEQUANTIZABLE_TYPES`]; others are an error.
    pub fn dequantize(&self, tensor: &GgufTensorInfo) -> anyhow::Result<Vec<f32>> {
        let ty = tensor.ggml_type;
        let Some(decode) = block_decoder(ty) else {
            let supported: Vec<_> = DEQUANTIZABLE_TYPES.iter().map(|t| t.name()).collect();
            bail!(
                "{}: tensor `{}` has type {ty}, which cannot be dequantized (supported: {})",
                self.path.display(),
                tensor.name,
                supported.join(", ")
            );
        };
        let data = self.tensor_data(tensor)?;
        let n = usize::try_from(tensor.n_elements())?;
        // `open` checked that ne0 is a multiple of the block size, but the info
        // may have been built by hand.
        ensure!(
            tensor
                .dims
                .first()
                .is_some_and(|&ne0| ne0 % ty.block_size() == 0),
            "{}: tensor `{}` of type {ty} has ne0 = {:?}, not a multiple of the block size {}",
            self.path.display(),
            tensor.name,
            tensor.dims.first(),
            ty.block_size()
        );
        let mut out = vec![0f32; n];
        decode(data, &mut out);
        Ok(out)
    }
}

struct Parsed {
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_start: u64,
}

/// A bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    fn bytes(&mut self, n: usize, what: &str) -> anyhow::Result<&'a [u8]> {
        if n > self.remaining() {
            bail!(
                "truncated: {what} needs {n} bytes at offset {}, but the file ends after {} more",
                self.pos,
                self.remaining()
            );
        }
        let bytes = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &str) -> anyhow::Result<[u8; N]> {
        Ok(self
            .bytes(N, what)?
            .try_into()
            .expect("bytes returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> anyhow::Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> anyhow::Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count of items that each take at least `min_item_bytes`, refused if
    /// the rest of the file could not possibly hold them: this bounds every
    /// allocation by the file size.
    fn count(&mut self, min_item_bytes: usize, what: &str) -> anyhow::Result<usize> {
        let n = self.u64(what)?;
        match usize::try_from(n) {
            Ok(n) if n <= self.remaining() / min_item_bytes => Ok(n),
            _ => bail!(
                "{what} is {n}, impossible with {} bytes left in the file",
                self.remaining()
            ),
        }
    }

    fn string(&mut self, what: &str) -> anyhow::Result<String> {
        let len = self.count(1, &format!("length of {what}"))?;
        let start = self.pos;
        let bytes = self.bytes(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| anyhow!("{what} at offset {start} is not valid UTF-8"))
    }

    fn value(&mut self, type_id: u32, depth: usize) -> anyhow::Result<GgufValue> {
        let what = "metadata value";
        Ok(match type_id {
            0 => GgufValue::U8(u8::from_le_bytes(self.array(what)?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)? {
                [0] => GgufValue::Bool(false),
                [1] => GgufValue::Bool(true),
                [b] => bail!(
                    "bool value at offset {} is {b}, expected 0 or 1",
                    self.pos - 1
                ),
            },
            8 => GgufValue::String(self.string("string value")?),
            9 => {
                ensure!(
                    depth < MAX_ARRAY_NESTING,
                    "arrays nested deeper than {MAX_ARRAY_NESTING} levels"
                );
                let item_type = self.u32("array element type")?;
                let min_bytes = value_min_bytes(item_type).ok_or_else(|| {
                    anyhow!("unknown array element type {item_type} (valid: 0..=12)")
                })?;
                let n = self.count(min_bytes, "array length")?;
                let items = (0..n)
                    .map(|i| {
                        self.value(item_type, depth + 1)
                            .with_context(|| format!("array element {i}"))
                    })
                    .collect::<anyhow::Result<_>>()?;
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            _ => bail!("unknown metadata value type {type_id} (valid: 0..=12)"),
        })
    }
}

/// The fewest bytes a value of this type takes in the file, `None` for
/// unknown types.
fn value_min_bytes(type_id: u32) -> Option<usize> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,     // length prefix
        9 => 4 + 8, // element type and count
        10..=12 => 8,
        _ => return None,
    })
}

fn parse(data: &[u8]) -> anyhow::Result<Parsed> {
    let mut cur = Cursor { data, pos: 0 };
    let magic = cur.array::<4>("magic")?;
    ensure!(
        &magic == MAGIC,
        "bad magic {magic:02x?} (expected {MAGIC:02x?} = \"GGUF\"); not a GGUF file"
    );
    let version = cur.u32("version")?;
    match version {
        2 | 3 => {}
        1 => bail!("GGUF version 1 is obsolete and not supported (expected version 2 or 3)"),
        v if v.swap_bytes() <= 3 => {
            bail!("big-endian GGUF files are not supported (version field reads {v:#x})")
        }
        v => bail!("unsupported GGUF version {v} (expected 2 or 3)"),
    }
    // Smallest possible tensor info: name length, n_dims, type, offset.
    let n_tensors = cur.count(8 + 4 + 4 + 8, "tensor count")?;
    // Smallest possible key/value: key length, value type, one byte of value.
    let n_kv = cur.count(8 + 4 + 1, "metadata key/value count")?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = cur.string(&format!("key of metadata entry {i}"))?;
        let type_id = cur.u32(&format!("value type of metadata key `{key}`"))?;
        let value = cur
            .value(type_id, 0)
            .with_context(|| format!("metadata key `{key}`"))?;
        ensure!(
            metadata.insert(key.clone(), value).is_none(),
            "metadata key `{key}` appears twice"
        );
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_integer().and_then(|a| u64::try_from(a).ok()) {
            Some(a) if a.is_power_of_two() => a,
            _ => bail!("`general.alignment` is {v:?}, expected a power of two"),
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut names = HashSet::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = cur.string(&format!("name of tensor {i}"))?;
        let info = tensor_info(&mut cur, name, alignment)?;
        ensure!(
            names.insert(info.name.clone()),
            "tensor `{}` appears twice",
            info.name
        );
        tensors.push(info);
    }

    let data_start = (cur.pos as u64).next_multiple_of(alignment);
    let file_len = data.len() as u64;
    for t in &tensors {
        // Checked: the offset is an arbitrary u64 from the file.
        let end = data_start
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes()));
        match end {
            Some(end) if end <= file_len => {}
            _ => bail!(
                "truncated: tensor `{}` ({} bytes at data offset {}) ends past the end of the file \
                 ({file_len} bytes, data section starts at {data_start})",
                t.name,
                t.n_bytes(),
                t.offset
            ),
        }
    }

    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_start,
    })
}

fn tensor_info(
    cur: &mut Cursor<'_>,
    name: String,
    alignment: u64,
) -> anyhow::Result<GgufTensorInfo> {
    let what = |field: &str| format!("{field} of tensor `{name}`");
    let n_dims = cur.u32(&what("dimension count"))?;
    ensure!(
        (1..=MAX_DIMS).contains(&n_dims),
        "tensor `{name}` has {n_dims} dimensions, expected 1 to {MAX_DIMS}"
    );
    let dims = (0..n_dims)
        .map(|_| cur.u64(&what("dimension")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let type_id = cur.u32(&what("type"))?;
    let offset = cur.u64(&what("data offset"))?;

    let ggml_type = GgmlType::from_id(type_id)
        .ok_or_else(|| anyhow!("tensor `{name}` has unknown ggml type id {type_id}"))?;
    // ggml counts elements in i64; anything larger cannot be a real tensor.
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64);
    ensure!(
        n_elements.is_some(),
        "tensor `{name}` has absurd dimensions {dims:?}"
    );
    ensure!(
        dims[0] % ggml_type.block_size() == 0,
        "tensor `{name}` of type {ggml_type} has ne0 = {}, not a multiple of the block size {}",
        dims[0],
        ggml_type.block_size()
    );
    ensure!(
        offset % alignment == 0,
        "tensor `{name}` has data offset {offset}, not a multiple of the alignment {alignment}"
    );
    Ok(GgufTensorInfo {
        name,
        dims,
        ggml_type,
        offset,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Builds GGUF files in memory, for tests here and in `convert`.
    #[derive(Default)]
    pub(crate) struct GgufBuilder {
        kv: Vec<(String, u32, Vec<u8>)>,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    fn string_bytes(s: &str) -> Vec<u8> {
        let mut out = (s.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(s.as_bytes());
        out
    }

    impl GgufBuilder {
        /// A metadata entry with a raw value encoding.
        pub(crate) fn raw(mut self, key: &str, type_id: u32, value: Vec<u8>) -> Self {
            self.kv.push((key.to_string(), type_id, value));
            self
        }

        /// Drops an entry, to replace it with another value.
        pub(crate) fn remove(mut self, key: &str) -> Self {
            self.kv.retain(|(k, _, _)| k != key);
            self
        }

        pub(crate) fn u32(self, key: &str, v: u32) -> Self {
            self.raw(key, 4, v.to_le_bytes().to_vec())
        }

        pub(crate) fn f32(self, key: &str, v: f32) -> Self {
            self.raw(key, 6, v.to_le_bytes().to_vec())
        }

        pub(crate) fn bool(self, key: &str, v: bool) -> Self {
            self.raw(key, 7, vec![u8::from(v)])
        }

        pub(crate) fn str(self, key: &str, v: &str) -> Self {
            self.raw(key, 8, string_bytes(v))
        }

        pub(crate) fn str_array(self, key: &str, items: &[&str]) -> Self {
            let mut v = 8u32.to_le_bytes().to_vec();
            v.extend((items.len() as u64).to_le_bytes());
            for s in items {
                v.extend(string_bytes(s));
            }
            self.raw(key, 9, v)
        }

        pub(crate) fn i32_array(self, key: &str, items: &[i32]) -> Self {
            let mut v = 5u32.to_le_bytes().to_vec();
            v.extend((items.len() as u64).to_le_bytes());
            for x in items {
                v.extend(x.to_le_bytes());
            }
            self.raw(key, 9, v)
        }

        pub(crate) fn f32_array(self, key: &str, items: &[f32]) -> Self {
            let mut v = 6u32.to_le_bytes().to_vec();
            v.extend((items.len() as u64).to_le_bytes());
            for x in items {
                v.extend(x.to_le_bytes());
            }
            self.raw(key, 9, v)
        }

        /// A tensor with raw data of the given ggml type id.
        pub(crate) fn tensor(
            mut self,
            name: &str,
            dims: &[u64],
            type_id: u32,
            data: Vec<u8>,
        ) -> Self {
            self.tensors
                .push((name.to_string(), dims.to_vec(), type_id, data));
            self
        }

        pub(crate) fn f32_tensor(self, name: &str, dims: &[u64], values: &[f32]) -> Self {
            let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.tensor(name, dims, 0, data)
        }

        pub(crate) fn build(&self) -> Vec<u8> {
            let mut out = b"GGUF".to_vec();
            out.extend(3u32.to_le_bytes());
            out.extend((self.tensors.len() as u64).to_le_bytes());
            out.extend((self.kv.len() as u64).to_le_bytes());
            for (key, type_id, value) in &self.kv {
                out.extend(string_bytes(key));
                out.extend(type_id.to_le_bytes());
                out.extend(value);
            }
            let mut offset = 0u64;
            for (name, dims, type_id, data) in &self.tensors {
                out.extend(string_bytes(name));
                out.extend((dims.len() as u32).to_le_bytes());
                for d in dims {
                    out.extend(d.to_le_bytes());
                }
                out.extend(type_id.to_le_bytes());
                out.extend(offset.to_le_bytes());
                offset = (offset + data.len() as u64).next_multiple_of(DEFAULT_ALIGNMENT);
            }
            for (_, _, _, data) in &self.tensors {
                out.resize(out.len().next_multiple_of(DEFAULT_ALIGNMENT as usize), 0);
                out.extend(data);
            }
            out
        }
    }

    /// A uniquely named scratch directory, removed on drop.
    pub(crate) struct TempDir(pub(crate) PathBuf);

    impl TempDir {
        pub(crate) fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("sieve-test-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        pub(crate) fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, bytes).unwrap();
            path
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn open_bytes(dir: &TempDir, name: &str, bytes: &[u8]) -> anyhow::Result<GgufFile> {
        GgufFile::open(dir.write(name, bytes))
    }

    fn expect_err(dir: &TempDir, name: &str, bytes: &[u8]) -> String {
        match open_bytes(dir, name, bytes) {
            Ok(_) => panic!("{name}: expected an error"),
            Err(e) => {
                let msg = format!("{e}");
                assert!(msg.contains(name), "message does not name the file: {msg}");
                msg
            }
        }
    }

    /// A file exercising every metadata type, F32/F16/BF16 tensors and all
    /// three block formats, with values chosen so that the expected results
    /// are exact.
    fn sample() -> (GgufBuilder, Vec<(&'static str, Vec<f32>)>) {
        // Q8_0: d = 0.5, q = -16..16.
        let mut q8 = f16_bytes(0.5).to_vec();
        q8.extend((-16i8..16).map(|q| q as u8));
        let q8_expected: Vec<f32> = (-16..16).map(|q| 0.5 * q as f32).collect();

        // Q4_0: d = 2, low nibbles j, high nibbles 15 - j (two blocks, the
        // second with d = -1).
        let mut q40 = Vec::new();
        let mut q40_expected = vec![0f32; 64];
        for (b, d) in [2.0f32, -1.0].into_iter().enumerate() {
            q40.extend(f16_bytes(d));
            for j in 0..16u8 {
                q40.push(j | ((15 - j) << 4));
                q40_expected[b * 32 + j as usize] = d * (f32::from(j) - 8.0);
                q40_expected[b * 32 + 16 + j as usize] = d * (f32::from(15 - j) - 8.0);
            }
        }

        // Q4_1: d = 0.25, m = -1, low nibbles j, high nibbles (j * 3) % 16.
        let mut q41 = f16_bytes(0.25).to_vec();
        q41.extend(f16_bytes(-1.0));
        let mut q41_expected = vec![0f32; 32];
        for j in 0..16u8 {
            let hi = (j * 3) % 16;
            q41.push(j | (hi << 4));
            q41_expected[j as usize] = 0.25 * f32::from(j) - 1.0;
            q41_expected[16 + j as usize] = 0.25 * f32::from(hi) - 1.0;
        }

        let f16_vals = [1.5f32, -2.0, 0.0, 65504.0];
        let bf16_vals = [1.0f32, -3.5, 256.0, 0.0078125];
        let builder = GgufBuilder::default()
            .str("general.architecture", "llama")
            .raw("u8", 0, vec![200])
            .raw("i8", 1, vec![0xFF])
            .raw("u16", 2, 60000u16.to_le_bytes().to_vec())
            .raw("i16", 3, (-300i16).to_le_bytes().to_vec())
            .u32("u32", 4_000_000_000)
            .raw("i32", 5, (-7i32).to_le_bytes().to_vec())
            .f32("f32", 0.125)
            .bool("bool", true)
            .raw("u64", 10, u64::MAX.to_le_bytes().to_vec())
            .raw("i64", 11, (-5i64).to_le_bytes().to_vec())
            .raw("f64", 12, 2.5f64.to_le_bytes().to_vec())
            .str_array("strs", &["a", "Ġb", ""])
            .i32_array("ints", &[3, -1, 1])
            .raw("nested", 9, {
                // An array of two arrays of u8.
                let mut v = 9u32.to_le_bytes().to_vec();
                v.extend(2u64.to_le_bytes());
                for inner in [[1u8, 2], [3, 4]] {
                    v.extend(0u32.to_le_bytes());
                    v.extend(2u64.to_le_bytes());
                    v.extend(inner);
                }
                v
            })
            .f32_tensor("f32", &[2, 2], &[1.0, -2.0, 3.5, 1e-3])
            .tensor(
                "f16",
                &[4],
                1,
                f16_vals.iter().flat_map(|&v| f16_bytes(v)).collect(),
            )
            .tensor(
                "bf16",
                &[4],
                30,
                bf16_vals
                    .iter()
                    .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                    .collect(),
            )
            .tensor("q8_0", &[32], 8, q8)
            .tensor("q4_0", &[32, 2], 2, q40)
            .tensor("q4_1", &[32], 3, q41);
        let expected = vec![
            ("f32", vec![1.0, -2.0, 3.5, 1e-3]),
            ("f16", f16_vals.to_vec()),
            ("bf16", bf16_vals.to_vec()),
            ("q8_0", q8_expected),
            ("q4_0", q40_expected),
            ("q4_1", q41_expected),
        ];
        (builder, expected)
    }

    #[test]
    fn reads_metadata_of_every_type() {
        let dir = TempDir::new("gguf-metadata");
        let g = open_bytes(&dir, "meta.gguf", &sample().0.build()).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.alignment, 32);
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get("u8"), Some(&GgufValue::U8(200)));
        assert_eq!(g.get("i8"), Some(&GgufValue::I8(-1)));
        assert_eq!(g.get("u16"), Some(&GgufValue::U16(60000)));
        assert_eq!(g.get("i16"), Some(&GgufValue::I16(-300)));
        assert_eq!(g.get_u32("u32").unwrap(), 4_000_000_000);
        assert_eq!(g.get("i32"), Some(&GgufValue::I32(-7)));
        assert_eq!(g.get_f32("f32").unwrap(), 0.125);
        assert!(g.get_bool("bool").unwrap());
        assert_eq!(g.get_u64("u64").unwrap(), u64::MAX);
        assert_eq!(g.get("i64"), Some(&GgufValue::I64(-5)));
        assert_eq!(g.get_f32("f64").unwrap(), 2.5);
        assert_eq!(g.get_str_array("strs").unwrap(), ["a", "Ġb", ""]);
        assert_eq!(g.get_i64_array("ints").unwrap(), [3, -1, 1]);
        let nested = g.get("nested").and_then(GgufValue::as_array).unwrap();
        assert_eq!(
            nested[1],
            GgufValue::Array(vec![GgufValue::U8(3), GgufValue::U8(4)])
        );
        // Lenient integer reads, strict ranges.
        assert_eq!(g.get_u32("u16").unwrap(), 60000);
        assert!(g
            .get_u32("i32")
            .unwrap_err()
            .to_string()
            .contains("`i32` is -7"));
        assert!(g.get_u32("u64").is_err());
        assert_eq!(g.opt("missing", GgufFile::get_u32).unwrap(), None);
        assert_eq!(g.opt("u8", GgufFile::get_u32).unwrap(), Some(200));
    }

    #[test]
    fn getter_errors_name_key_and_file() {
        let dir = TempDir::new("gguf-getters");
        let g = open_bytes(&dir, "getters.gguf", &sample().0.build()).unwrap();
        let missing = g.get_u32("llama.block_count").unwrap_err().to_string();
        assert!(
            missing.contains("getters.gguf") && missing.contains("`llama.block_count` is missing")
        );
        let wrong = g.get_str("u32").unwrap_err().to_string();
        assert!(
            wrong.contains("getters.gguf") && wrong.contains("is a uint32, expected a string"),
            "{wrong}"
        );
        let elems = g.get_str_array("ints").unwrap_err().to_string();
        assert!(elems.contains("int32 element"), "{elems}");
        assert!(g.opt("u32", GgufFile::get_str).is_err());
    }

    #[test]
    fn dequantizes_every_supported_type() {
        let dir = TempDir::new("gguf-dequant");
        let g = open_bytes(&dir, "dequant.gguf", &sample().0.build()).unwrap();
        let (_, expected) = sample();
        for (name, want) in expected {
            let t = g.tensor(name).unwrap();
            assert_eq!(g.dequantize(t).unwrap(), want, "tensor {name}");
        }
        let q40 = g.tensor("q4_0").unwrap();
        assert_eq!(q40.shape(), [2, 32]);
        assert_eq!(q40.n_bytes(), 36);
    }

    #[test]
    fn unsupported_tensor_type_is_a_clear_error() {
        let dir = TempDir::new("gguf-q2k");
        let bytes = GgufBuilder::default()
            .tensor("blk.0.ffn_up.weight", &[256], 10, vec![0; 84])
            .build();
        let g = open_bytes(&dir, "q2k.gguf", &bytes).unwrap();
        let err = g.dequantize(&g.tensors[0]).unwrap_err().to_string();
        for part in [
            "q2k.gguf",
            "blk.0.ffn_up.weight",
            "Q2_K",
            "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K",
        ] {
            assert!(err.contains(part), "{err}");
        }
    }

    #[test]
    fn truncation_at_any_point_is_an_error() {
        let dir = TempDir::new("gguf-truncated");
        let full = sample().0.build();
        assert!(open_bytes(&dir, "full.gguf", &full).is_ok());
        // Every cut point: header, metadata, tensor infos, padding and data.
        for cut in 0..full.len() {
            let msg = expect_err(&dir, "cut.gguf", &full[..cut]);
            assert!(
                msg.contains("truncated") || msg.contains("impossible"),
                "cut {cut}: {msg}"
            );
        }
    }

    #[test]
    fn malformed_headers_are_errors() {
        let dir = TempDir::new("gguf-malformed");
        let good = GgufBuilder::default()
            .u32("k", 1)
            .f32_tensor("t", &[32], &[0.0; 32]);

        let mut bad_magic = good.build();
        bad_magic[..4].copy_from_slice(b"GGML");
        assert!(expect_err(&dir, "magic.gguf", &bad_magic).contains("bad magic"));

        let mut v1 = good.build();
        v1[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(expect_err(&dir, "v1.gguf", &v1).contains("version 1"));

        let mut big_endian = good.build();
        big_endian[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(expect_err(&dir, "be.gguf", &big_endian).contains("big-endian"));

        let mut v2 = good.build();
        v2[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(open_bytes(&dir, "v2.gguf", &v2).unwrap().version, 2);

        let mut many_tensors = good.build();
        many_tensors[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(expect_err(&dir, "count.gguf", &many_tensors).contains("tensor count"));

        let huge_string = GgufBuilder::default()
            .raw("s", 8, u64::MAX.to_le_bytes().to_vec())
            .build();
        assert!(expect_err(&dir, "string.gguf", &huge_string).contains("length of string value"));

        let huge_array = GgufBuilder::default()
            .raw(
                "a",
                9,
                [8u32.to_le_bytes().as_slice(), &(1u64 << 40).to_le_bytes()].concat(),
            )
            .build();
        assert!(expect_err(&dir, "array.gguf", &huge_array).contains("array length"));

        let unknown_type = GgufBuilder::default().raw("x", 13, vec![0; 8]).build();
        assert!(expect_err(&dir, "vtype.gguf", &unknown_type)
            .contains("unknown metadata value type 13"));

        let bad_bool = GgufBuilder::default().raw("b", 7, vec![2]).build();
        assert!(expect_err(&dir, "bool.gguf", &bad_bool).contains("expected 0 or 1"));

        let duplicate = GgufBuilder::default().u32("k", 1).u32("k", 2).build();
        assert!(expect_err(&dir, "dup.gguf", &duplicate).contains("appears twice"));

        let bad_align = GgufBuilder::default().u32("general.alignment", 24).build();
        assert!(expect_err(&dir, "align.gguf", &bad_align).contains("power of two"));

        let deep = {
            let mut v = Vec::new();
            for _ in 0..100 {
                v.extend(9u32.to_le_bytes());
                v.extend(1u64.to_le_bytes());
            }
            v.extend(0u32.to_le_bytes());
            v.extend(0u64.to_le_bytes());
            GgufBuilder::default().raw("deep", 9, v).build()
        };
        assert!(expect_err(&dir, "deep.gguf", &deep).contains("nested deeper"));

        let unknown_ggml = GgufBuilder::default()
            .tensor("t", &[4], 4, vec![0; 16])
            .build();
        assert!(expect_err(&dir, "ggml.gguf", &unknown_ggml).contains("unknown ggml type id 4"));

        let ragged = GgufBuilder::default()
            .tensor("t", &[33, 2], 8, vec![0; 34 * 2])
            .build();
        let msg = expect_err(&dir, "ragged.gguf", &ragged);
        assert!(
            msg.contains("ne0 = 33, not a multiple of the block size 32"),
            "{msg}"
        );

        let no_dims = GgufBuilder::default().tensor("t", &[], 0, vec![]).build();
        assert!(expect_err(&dir, "dims.gguf", &no_dims).contains("0 dimensions"));

        let huge_dims = GgufBuilder::default()
            .tensor("t", &[1 << 32, 1 << 32], 0, vec![])
            .build();
        assert!(expect_err(&dir, "huge.gguf", &huge_dims).contains("absurd dimensions"));

        let mut past_end = GgufBuilder::default()
            .f32_tensor("t", &[8], &[0.0; 8])
            .build();
        past_end.truncate(past_end.len() - 4);
        let msg = expect_err(&dir, "past.gguf", &past_end);
        assert!(
            msg.contains("tensor `t`") && msg.contains("past the end"),
            "{msg}"
        );

        let missing = GgufFile::open(dir.0.join("nope.gguf")).unwrap_err();
        assert!(format!("{missing:#}").contains("nope.gguf"));
    }
}
