//! GGUF checkpoints (llama.cpp's single-file format, versions 2 and 3) for the llama, mistral,
//! qwen2, qwen3 and gpt2 architectures: shapes from the metadata, weights from F32, F16, BF16 and
//! every block type of [`crate::model::quant::QuantType`] (matrices in blocks kept as stored),
//! and the tokenizer from the metadata. See
//! `docs/MODELS.md` for the conventions and why the container reader is wgpar's own.

pub mod config;
pub mod file;
pub mod tokenizer;
pub mod weights;

use std::io::Read;
use std::ops::Range;
use std::path::Path;

pub use file::{ElementType, GgufFile, TensorInfo, Value};

use crate::error::Result;
use crate::model::config::ModelConfig;
use crate::model::hf::TextTokenizer;
use crate::model::weights::ModelWeights;
use config::Meta;

/// Whether `path` is a GGUF file (a regular file that starts with the magic).
pub fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && magic == file::MAGIC
}

/// An opened GGUF checkpoint.
pub struct Gguf {
    file: GgufFile,
    config: ModelConfig,
    eos: Vec<u32>,
    /// The Q/K rows were permuted by the converter (`llama` and `mistral` architectures).
    permuted: bool,
}

impl Gguf {
    /// Maps `path`, parses its metadata and tensor index and derives the model's shapes.
    pub fn open(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let meta = Meta::new(&file)?;
        let stem = path
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        let config = config::model_config(&meta, &file, &stem)?;
        let eos = config::eos_tokens(&meta)?;
        let permuted = config::permuted_rows(&meta.arch_name);
        Ok(Self {
            file,
            config,
            eos,
            permuted,
        })
    }

    /// The model's shapes (`max_seq` is the file's context length).
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Token ids that end generation.
    pub fn eos_tokens(&self) -> &[u32] {
        &self.eos
    }

    /// The container.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// The tensors of layers `keep` (the others [`crate::model::LayerWeights::absent`]), the
    /// tables and norms, read into [`ModelWeights`] for `config` (the file's, with its context
    /// possibly limited).
    pub fn weights(&self, config: &ModelConfig, keep: Range<usize>) -> Result<ModelWeights> {
        weights::load(&self.file, config, self.permuted, keep)
    }

    /// The tokenizer from the metadata.
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        tokenizer::load(&self.file)
    }
}
