//! The tensors of a checkpoint: one `model.safetensors` or the shards an index names, each
//! memory-mapped, with every tensor's dtype, shape and byte range indexed by name. A tensor is
//! converted to f32 only when asked for, straight from the mapped pages into its own vector,
//! so the host never holds a second copy of the file.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Result, WgparError};

/// Where one tensor's bytes are.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range inside the mapped file (header included in the offsets).
    start: usize,
    end: usize,
}

/// Memory-mapped safetensors files and the index of their tensors.
pub struct TensorStore {
    files: Vec<(PathBuf, Mmap)>,
    entries: HashMap<String, Entry>,
}

fn checkpoint_error(file: &Path, tensor: Option<&str>, detail: String) -> WgparError {
    WgparError::Checkpoint {
        file: file.display().to_string(),
        tensor: tensor.map(str::to_string),
        detail,
    }
}

impl TensorStore {
    /// Opens the model's tensors in `dir`: `model.safetensors`, or else the shards listed in
    /// `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if single.is_file() {
            let mut store = Self {
                files: Vec::new(),
                entries: HashMap::new(),
            };
            store.add_file(&single, None)?;
            return Ok(store);
        }
        if index.is_file() {
            return Self::open_sharded(dir, &index);
        }
        Err(checkpoint_error(
            dir,
            None,
            "neither model.safetensors nor model.safetensors.index.json is here (wgpar reads \
             safetensors weights only; pytorch_model.bin needs converting first)"
                .into(),
        ))
    }

    fn open_sharded(dir: &Path, index: &Path) -> Result<Self> {
        let text = crate::files::read_text(index, crate::files::CONFIG_LIMIT).map_err(|e| {
            WgparError::Io {
                path: index.display().to_string(),
                source: e,
            }
        })?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| checkpoint_error(index, None, format!("invalid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| checkpoint_error(index, None, "no \"weight_map\" object".into()))?;
        // Shard name -> the tensors the index puts there.
        let mut shards: Vec<(String, Vec<String>)> = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| {
                checkpoint_error(index, Some(tensor), "shard name is not a string".into())
            })?;
            match shards.iter_mut().find(|(f, _)| f == file) {
                Some((_, names)) => names.push(tensor.clone()),
                None => shards.push((file.to_string(), vec![tensor.clone()])),
            }
        }
        let mut store = Self {
            files: Vec::new(),
            entries: HashMap::new(),
        };
        for (file, names) in &shards {
            // A shard name must stay inside the model folder.
            if Path::new(file).components().count() != 1 {
                return Err(checkpoint_error(
                    index,
                    None,
                    format!("shard '{file}' is not a plain file name"),
                ));
            }
            let path = dir.join(file);
            if !path.is_file() {
                return Err(checkpoint_error(
                    &path,
                    None,
                    format!("shard listed in {} is missing", index.display()),
                ));
            }
            store.add_file(&path, Some(names))?;
        }
        Ok(store)
    }

    /// Maps one file and indexes its tensors; with `expected`, every named tensor must be there.
    fn add_file(&mut self, path: &Path, expected: Option<&[String]>) -> Result<()> {
        let file = File::open(path).map_err(|e| WgparError::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        // SAFETY: the map is only read. Another process shrinking the file while it is mapped
        // would fault the reads; that is the usual contract of memory-mapped model files.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| WgparError::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
            checkpoint_error(
                path,
                None,
                format!(
                    "not a valid safetensors file ({e}); it may be truncated or corrupt ({} bytes)",
                    map.len()
                ),
            )
        })?;
        let data_start = 8 + header_len;
        let index = self.files.len();
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            self.entries.insert(
                name,
                Entry {
                    file: index,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + start,
                    end: data_start + end,
                },
            );
        }
        for name in expected.unwrap_or_default() {
            if self.entries.get(name).is_none_or(|e| e.file != index) {
                return Err(checkpoint_error(
                    path,
                    Some(name),
                    "the index puts this tensor here, but the file lacks it".into(),
                ));
            }
        }
        self.files.push((path.to_path_buf(), map));
        Ok(())
    }

    /// Names of every tensor.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The file that holds (or, for a missing tensor, would hold) `name`.
    pub fn file_of(&self, name: &str) -> PathBuf {
        match self.entries.get(name) {
            Some(e) => self.files[e.file].0.clone(),
            None if self.files.len() == 1 => self.files[0].0.clone(),
            None => self
                .files
                .first()
                .and_then(|(p, _)| p.parent())
                .map(|d| d.join("model.safetensors.index.json"))
                .unwrap_or_default(),
        }
    }

    /// The storage types of the tensors of two or more dimensions (the matrices).
    pub fn matrix_dtypes(&self) -> impl Iterator<Item = Dtype> + '_ {
        (self.entries.values())
            .filter(|e| e.shape.len() >= 2)
            .map(|e| e.dtype)
    }

    /// Bytes tensor `name` occupies in its file (0 when absent).
    pub fn stored_bytes(&self, name: &str) -> u64 {
        self.entries
            .get(name)
            .map_or(0, |e| (e.end - e.start) as u64)
    }

    /// Total bytes of tensor data across the files.
    pub fn bytes(&self) -> u64 {
        self.entries
            .values()
            .map(|e| (e.end - e.start) as u64)
            .sum()
    }

    /// Converts tensor `name` to f32 after checking its shape is `shape` (`what` says what the
    /// model uses it for, for the error). Accepts F32, F16 and BF16 data.
    pub fn load(&self, name: &str, shape: &[usize], what: &str) -> Result<Vec<f32>> {
        let fail = |detail: String| Err(checkpoint_error(&self.file_of(name), Some(name), detail));
        let Some(e) = self.entries.get(name) else {
            return fail(format!("missing ({what})"));
        };
        if e.shape != shape {
            return fail(format!(
                "shape {:?}, expected {shape:?} ({what}, from config.json)",
                e.shape
            ));
        }
        let bytes = &self.files[e.file].1[e.start..e.end];
        let count: usize = shape.iter().product();
        let width = match e.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return fail(format!(
                    "dtype {other:?} is not supported (wgpar reads F32, F16 and BF16)"
                ))
            }
        };
        if bytes.len() != count * width {
            return fail(format!(
                "{} bytes of data for {count} {:?} values",
                bytes.len(),
                e.dtype
            ));
        }
        // The data may sit at any byte offset, so decode from little-endian bytes rather than
        // reinterpreting the slice.
        let values: Vec<f32> = match e.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        };
        // NaN or infinity in a weight turns every output it touches into NaN: refuse it here,
        // naming the tensor, rather than generate garbage.
        if let Some(first) = values.iter().position(|v| !v.is_finite()) {
            let count = values.iter().filter(|v| !v.is_finite()).count();
            return fail(format!(
                "{count} of {} values are not finite (the first, at index {first}, is {}): the \
                 checkpoint is corrupt or was saved from a diverged run",
                values.len(),
                values[first]
            ));
        }
        Ok(values)
    }
}
