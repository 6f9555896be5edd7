//! The GGUF container (versions 2 and 3, little-endian): a header, typed key/value metadata,
//! tensor descriptors, then aligned tensor data. The file is memory-mapped; parsing reads the
//! header and descriptors only, and bounds every count and size by the bytes left in the file
//! before anything is allocated from it, so a malformed file fails in microseconds with the key
//! or tensor at fault.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Result, WgparError};
use crate::model::quant::QuantType;

/// Magic at the start of every GGUF file ("GGUF" in ASCII).
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Deepest nesting of arrays accepted (llama.cpp writes none nested).
const MAX_DEPTH: usize = 2;
/// Most dimensions a tensor may declare (ggml's limit).
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string (invalid UTF-8 is replaced).
    Str(String),
    /// Array of values.
    Array(Vec<Value>),
}

impl Value {
    /// A non-negative integer, whatever its stored width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(n) => Some(n),
            Value::I64(n) => u64::try_from(n).ok(),
            _ => None,
        }
    }

    /// A number as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(x) => Some(x),
            Value::U64(n) => Some(n as f64),
            Value::I64(n) => Some(n as f64),
            _ => None,
        }
    }
}

/// Where one tensor's data is and how it is stored.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Dimensions, innermost (contiguous) first, as GGUF lists them.
    pub dims: Vec<usize>,
    /// Element type.
    pub dtype: ElementType,
    /// Byte range in the file.
    pub start: usize,
    /// End of the byte range.
    pub end: usize,
}

/// A tensor's element type: every type GGUF files carry that wgpar's kernels read (the float
/// types and the block types), kept as stored.
pub type ElementType = QuantType;

impl TensorInfo {
    /// Dimensions outermost first (`[rows, cols]` for a matrix), as wgpar and PyTorch write them.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// An opened GGUF file: its metadata and tensor index, the data mapped.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub meta: HashMap<String, Value>,
    /// Tensor descriptors by name, in file order.
    pub tensors: Vec<(String, TensorInfo)>,
}

/// A bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn fail(&self, tensor: Option<&str>, detail: String) -> WgparError {
        WgparError::Checkpoint {
            file: self.path.display().to_string(),
            tensor: tensor.map(str::to_string),
            detail,
        }
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(self.fail(
                None,
                format!(
                    "truncated: {what} needs {n} bytes at offset {}, the file has {} ({} bytes \
                     in all)",
                    self.at,
                    self.left(),
                    self.bytes.len()
                ),
            ));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }

    /// A count of items of at least `min_item` bytes each, refused when the rest of the file
    /// could not hold that many (so nothing is sized by a forged count).
    fn count(&mut self, min_item: usize, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        let fits = (self.left() / min_item.max(1)) as u64;
        if n > fits {
            return Err(self.fail(
                None,
                format!(
                    "{what} is {n}, but the {} bytes left in the file hold at most {fits}",
                    self.left()
                ),
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(1, what)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }

    fn value(&mut self, kind: u32, key: &str, depth: usize) -> Result<Value> {
        let what = format!("the value of key '{key}'");
        Ok(match kind {
            0 => Value::U64(u64::from(self.take(1, &what)?[0])),
            1 => Value::I64(i64::from(self.take(1, &what)?[0] as i8)),
            2 | 3 => {
                let b = self.take(2, &what)?;
                let raw = u16::from_le_bytes([b[0], b[1]]);
                match kind {
                    2 => Value::U64(u64::from(raw)),
                    _ => Value::I64(i64::from(raw as i16)),
                }
            }
            4 => Value::U64(u64::from(self.u32(&what)?)),
            5 => Value::I64(i64::from(self.u32(&what)? as i32)),
            6 => Value::F64(f64::from(f32::from_bits(self.u32(&what)?))),
            7 => Value::Bool(self.take(1, &what)?[0] != 0),
            8 => Value::Str(self.string(&what)?),
            9 => self.array(key, depth)?,
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(self.u64(&what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(&what)?)),
            other => {
                return Err(self.fail(
                    None,
                    format!("key '{key}' has value type {other}, which GGUF does not define"),
                ))
            }
        })
    }

    fn array(&mut self, key: &str, depth: usize) -> Result<Value> {
        if depth >= MAX_DEPTH {
            return Err(self.fail(None, format!("key '{key}': arrays nested too deeply")));
        }
        let kind = self.u32(&format!("the element type of key '{key}'"))?;
        // The smallest encoding of one element bounds the count.
        let min_item = match kind {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            _ => 8,
        };
        let n = self.count(min_item, &format!("the length of array '{key}'"))?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.value(kind, key, depth + 1)?);
        }
        Ok(Value::Array(items))
    }
}

impl GgufFile {
    /// Maps `path` and parses its header, metadata and tensor descriptors.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |e| WgparError::Io {
            path: path.display().to_string(),
            source: e,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is only read. Another process shrinking the file while it is mapped
        // would fault the reads; that is the usual contract of memory-mapped model files.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let parsed = parse(&map, path)?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            version: parsed.0,
            meta: parsed.1,
            tensors: parsed.2,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The descriptor of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// The stored bytes of a tensor.
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.start..info.end]
    }

    /// Bytes of tensor data in the file.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|(_, t)| (t.end - t.start) as u64)
            .sum()
    }
}

type Parsed = (u32, HashMap<String, Value>, Vec<(String, TensorInfo)>);
/// A descriptor as read: dimensions, type, offset in the data section.
type Descriptor = (Vec<usize>, ElementType, u64);

fn parse(bytes: &[u8], path: &Path) -> Result<Parsed> {
    let mut c = Cursor { bytes, at: 0, path };
    if c.take(4, "the magic")? != MAGIC {
        return Err(c.fail(
            None,
            "not a GGUF file (it does not start with 'GGUF')".into(),
        ));
    }
    let version = c.u32("the version")?;
    if !(2..=3).contains(&version) {
        let hint = if version.swap_bytes() <= 3 {
            " (a big-endian file: wgpar reads little-endian GGUF)"
        } else {
            ""
        };
        return Err(c.fail(
            None,
            format!("GGUF version {version} is not supported (2 and 3 are){hint}"),
        ));
    }
    // A descriptor takes at least 8 + 4 + 8 + 4 + 8 bytes; a key/value at least 8 + 4 + 1.
    let n_tensors = c.count(32, "the tensor count")?;
    let n_kv = c.count(13, "the metadata count")?;
    let mut meta = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let kind = c.u32(&format!("the type of key '{key}'"))?;
        let value = c.value(kind, &key, 0)?;
        meta.insert(key, value);
    }
    let mut descs = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&format!("the name of tensor {i}"))?;
        descs.push((name.clone(), descriptor(&mut c, &name)?));
    }
    let align = match meta.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a as usize,
            _ => {
                return Err(c.fail(
                    None,
                    format!("key 'general.alignment' is {v:?}, expected a power of two"),
                ))
            }
        },
    };
    let data_start = c.at.div_ceil(align) * align;
    let tensors = place(&c, descs, data_start, align)?;
    Ok((version, meta, tensors))
}

/// A descriptor: dimensions, type, offset (relative to the data section), checked for shape.
fn descriptor(c: &mut Cursor, name: &str) -> Result<Descriptor> {
    let n_dims = c.u32(&format!("the rank of tensor '{name}'"))?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(c.fail(
            Some(name),
            format!("{n_dims} dimensions (1 to 4 are valid)"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        let d = c.u64(&format!("the dimensions of tensor '{name}'"))?;
        if d == 0 || d > c.bytes.len() as u64 * 2 {
            return Err(c.fail(
                Some(name),
                format!(
                    "dimension {d} is impossible in a file of {} bytes",
                    c.bytes.len()
                ),
            ));
        }
        dims.push(d as usize);
    }
    let id = c.u32(&format!("the type of tensor '{name}'"))?;
    let dtype = ElementType::from_ggml(id).ok_or_else(|| WgparError::TensorType {
        file: c.path.display().to_string(),
        tensor: name.to_string(),
        ggml_type: QuantType::ggml_name(id),
    })?;
    let offset = c.u64(&format!("the offset of tensor '{name}'"))?;
    Ok((dims, dtype, offset))
}

/// Each tensor's byte range, checked against the file: whole blocks per row, aligned, inside.
fn place(
    c: &Cursor,
    descs: Vec<(String, Descriptor)>,
    data_start: usize,
    align: usize,
) -> Result<Vec<(String, TensorInfo)>> {
    let mut out = Vec::with_capacity(descs.len());
    for (name, (dims, dtype, offset)) in descs {
        let fail = |detail: String| Err(c.fail(Some(&name), detail));
        let Some(row) = dtype.row_bytes(dims[0]) else {
            return fail(format!(
                "rows of {} values are not whole {:?} blocks of {}",
                dims[0],
                dtype,
                dtype.block_len()
            ));
        };
        let size = dims[1..].iter().try_fold(row, |acc, &d| acc.checked_mul(d));
        let start = (offset as usize).checked_add(data_start);
        let (Some(size), Some(start)) = (size, start) else {
            return fail(format!("dimensions {dims:?} overflow"));
        };
        if !(offset as usize).is_multiple_of(align) {
            return fail(format!("offset {offset} is not aligned to {align} bytes"));
        }
        match start.checked_add(size) {
            Some(end) if end <= c.bytes.len() => out.push((
                name,
                TensorInfo {
                    dims,
                    dtype,
                    start,
                    end,
                },
            )),
            _ => {
                return fail(format!(
                    "its {size} bytes at offset {start} run past the end of the file ({} \
                     bytes): the file is truncated",
                    c.bytes.len()
                ))
            }
        }
    }
    Ok(out)
}
