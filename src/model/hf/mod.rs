//! Hugging Face checkpoints: a model folder with `config.json`, `model.safetensors` (or shards
//! named by `model.safetensors.index.json`) and `tokenizer.json`, for the GPT-2, Llama-style
//! and BERT families. See `docs/MODELS.md` for the name mapping and the memory behaviour.
//!
//! Memory: the safetensors files are memory-mapped, not read; each tensor is converted to f32
//! on its own, from the mapped pages into the vector [`ModelWeights`] keeps, so the host holds
//! the f32 model once plus one tensor's transient (GPT-2's transposes), never the file twice.
//! The mapped pages are the kernel's page cache and can be dropped under pressure.

pub mod bert;
pub mod config;
pub mod gpt2;
pub mod llama;
pub mod reader;
pub mod tensors;
pub mod tokenizer;

use std::ops::Range;
use std::path::{Path, PathBuf};

pub use config::{HfConfig, SUPPORTED_TYPES};
pub use tensors::TensorStore;
pub use tokenizer::{TextStream, TextTokenizer};

use crate::error::{Result, WgparError};
use crate::model::config::{Arch, ModelConfig, PoolMode, Pooling};
use crate::model::weights::ModelWeights;
use reader::Reader;

/// An opened checkpoint folder: its config parsed, its tensor files mapped and indexed.
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    /// Positions the checkpoint's tables hold (before [`Self::limit_context`]).
    positions: usize,
    eos: Vec<u32>,
    /// A text-and-vision folder whose vision tower is not read (see [`HfConfig::vision`]).
    vision: bool,
    source: Source,
}

/// Where a text-and-vision checkpoint keeps its vision tower and projector (before and
/// after transformers 4.52 moved them under `model.`): tensors wgpar does not read.
const VISION_PARTS: [&str; 4] = [
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
];

fn is_vision(name: &str) -> bool {
    VISION_PARTS.iter().any(|p| name.starts_with(p))
}

/// Where the weights and tokenizer come from.
enum Source {
    /// A Hugging Face folder's safetensors files.
    Folder(TensorStore),
    /// One GGUF file (weights and tokenizer inside); boxed, being much larger than a folder's
    /// store.
    Gguf(Box<crate::model::gguf::Gguf>),
}

fn read_text(path: &Path) -> Result<Option<String>> {
    match crate::files::read_text(path, crate::files::CONFIG_LIMIT) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(WgparError::Io {
            path: path.display().to_string(),
            source: e,
        }),
    }
}

fn json_error(path: &Path, detail: String) -> WgparError {
    WgparError::Checkpoint {
        file: path.display().to_string(),
        tensor: None,
        detail,
    }
}

/// sentence-transformers' pooling, from `modules.json` and `1_Pooling/config.json`: mean or
/// CLS, and whether a `Normalize` module follows. Plain BERT folders get unnormalised mean.
fn sentence_pooling(dir: &Path) -> Result<Pooling> {
    let mut pooling = Pooling {
        mode: PoolMode::Mean,
        normalize: false,
    };
    let modules_path = dir.join("modules.json");
    let Some(text) = read_text(&modules_path)? else {
        return Ok(pooling);
    };
    let modules: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| json_error(&modules_path, format!("invalid JSON: {e}")))?;
    let modules = modules.as_array().cloned().unwrap_or_default();
    let field = |m: &serde_json::Value, k: &str| {
        m.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string()
    };
    for m in &modules {
        let kind = field(m, "type");
        if kind.ends_with("Normalize") {
            pooling.normalize = true;
        } else if kind.ends_with("Pooling") {
            let path = dir.join(field(m, "path")).join("config.json");
            let Some(text) = read_text(&path)? else {
                continue;
            };
            let cfg: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| json_error(&path, format!("invalid JSON: {e}")))?;
            let on = |k: &str| cfg.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
            pooling.mode = if on("pooling_mode_cls_token") {
                PoolMode::Cls
            } else if on("pooling_mode_mean_tokens") {
                PoolMode::Mean
            } else {
                return Err(json_error(
                    &path,
                    "only mean and CLS pooling are supported (max / sqrt-length pooling is not)"
                        .into(),
                ));
            };
        } else if !kind.ends_with("Transformer") {
            return Err(json_error(
                &modules_path,
                format!("sentence-transformers module '{kind}' is not supported"),
            ));
        }
    }
    Ok(pooling)
}

/// The layers the weights hold: one more than the highest `N` in names like
/// `model.layers.N.`, `h.N.` or `encoder.layer.N.`.
fn layers_present(arch: Arch, store: &TensorStore) -> usize {
    let marker = match arch {
        Arch::Gpt2 => "h.",
        Arch::Llama => "layers.",
        Arch::Bert => "encoder.layer.",
    };
    store
        .names()
        .filter(|name| !is_vision(name))
        .filter_map(|name| {
            // The marker at the start or after a dot (`transformer.h.3.`, not `...gh.3.`).
            let at = name
                .match_indices(marker)
                .find(|(i, _)| *i == 0 || name[..*i].ends_with('.'))?
                .0;
            let rest = &name[at + marker.len()..];
            rest.split('.').next()?.parse::<usize>().ok()
        })
        .map(|n| n + 1)
        .max()
        .unwrap_or(0)
}

/// Refuses a config.json that declares more layers than the weights hold, before anything is
/// sized by the declared count.
fn check_layers_present(
    config_path: &Path,
    config: &ModelConfig,
    store: &TensorStore,
) -> Result<()> {
    let present = layers_present(config.arch, store);
    if config.layers > present {
        let key = match config.arch {
            Arch::Gpt2 => "n_layer",
            _ => "num_hidden_layers",
        };
        return Err(json_error(
            config_path,
            format!(
                "\"{key}\" is {}, but the safetensors files hold {present} layer(s): the config \
                 does not belong to these weights (or shards are missing)",
                config.layers
            ),
        ));
    }
    Ok(())
}

/// The warning for tensors a checkpoint holds but its config does not use, naming the first
/// few; `None` when every tensor was read.
fn unused_warning(unused: &[String]) -> Option<String> {
    const SHOWN: usize = 6;
    let (first, rest) = unused.split_at(unused.len().min(SHOWN));
    let more = match rest.len() {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    (!first.is_empty()).then(|| {
        format!(
            "wgpar: warning: {} tensor(s) of the checkpoint are not used by its config.json \
             (ignored, as Hugging Face does): {}{more}",
            unused.len(),
            first.join(", ")
        )
    })
}

impl Checkpoint {
    /// Opens the checkpoint at `path`: a GGUF file ([`crate::model::gguf`]), or a Hugging Face
    /// folder, whose config.json is parsed and safetensors headers checked. Tensors are
    /// converted later, by [`Self::weights`].
    pub fn open(path: &Path) -> Result<Self> {
        if crate::model::gguf::is_gguf(path) {
            let gguf = crate::model::gguf::Gguf::open(path)?;
            return Ok(Self {
                dir: path.to_path_buf(),
                positions: gguf.config().max_seq,
                config: gguf.config().clone(),
                eos: gguf.eos_tokens().to_vec(),
                vision: false,
                source: Source::Gguf(Box::new(gguf)),
            });
        }
        Self::open_folder(path)
    }

    fn open_folder(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(json_error(dir, "not a model folder".into()));
        }
        let config_path = dir.join("config.json");
        let text = read_text(&config_path)?.ok_or_else(|| {
            json_error(
                &config_path,
                "missing: a model folder needs config.json".into(),
            )
        })?;
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "checkpoint".into());
        let HfConfig {
            mut config,
            mut eos,
            vision,
        } = config::parse(&config_path, &text, &name)?;
        if config.is_encoder() {
            config.pooling = sentence_pooling(dir)?;
        }
        // generation_config.json may list more end tokens (chat models end turns with them).
        let gen_path = dir.join("generation_config.json");
        if let Some(text) = read_text(&gen_path)? {
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| json_error(&gen_path, format!("invalid JSON: {e}")))?;
            for id in config::token_ids(json.get("eos_token_id")) {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        let store = TensorStore::open(dir)?;
        check_layers_present(&config_path, &config, &store)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            positions: config.max_seq,
            config,
            eos,
            vision,
            source: Source::Folder(store),
        })
    }

    /// The model's shapes (`max_seq` as limited by [`Self::limit_context`]).
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The model folder (or GGUF file).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Token ids that end generation.
    pub fn eos_tokens(&self) -> &[u32] {
        &self.eos
    }

    /// Longest context the checkpoint supports.
    pub fn max_context(&self) -> usize {
        self.positions
    }

    /// Limits the context (and so the KV cache and position tables) to `max_seq` tokens, at
    /// most the checkpoint's own limit.
    pub fn limit_context(&mut self, max_seq: usize) -> Result<()> {
        if max_seq == 0 || max_seq > self.positions {
            return Err(WgparError::option(
                "--max-seq",
                format!(
                    "a context of {max_seq} tokens is outside 1..={} of model '{}'",
                    self.positions, self.config.name
                ),
            ));
        }
        self.config.max_seq = max_seq;
        Ok(())
    }

    /// Whether the checkpoint stores its weights in 16 bits: no matrix in f32 and at least one
    /// in f16 or bf16 (a GGUF's block-quantized matrices count as neither: they stay packed).
    /// `--dtype auto` keeps such checkpoints in f16.
    pub fn stores_half(&self) -> bool {
        use crate::model::quant::QuantType;
        let kinds: Vec<Option<bool>> = match &self.source {
            Source::Folder(store) => (store.matrix_dtypes())
                .map(|d| match d {
                    safetensors::Dtype::F16 | safetensors::Dtype::BF16 => Some(true),
                    safetensors::Dtype::F32 => Some(false),
                    _ => None,
                })
                .collect(),
            Source::Gguf(gguf) => (gguf.file().tensors.iter())
                .filter(|(_, t)| t.dims.len() >= 2)
                .map(|(_, t)| match t.dtype {
                    QuantType::F16 | QuantType::Bf16 => Some(true),
                    QuantType::F32 => Some(false),
                    _ => None,
                })
                .collect(),
        };
        !kinds.contains(&Some(false)) && kinds.contains(&Some(true))
    }

    /// The GGUF file, when the checkpoint is one.
    pub fn gguf(&self) -> Option<&crate::model::gguf::Gguf> {
        match &self.source {
            Source::Gguf(gguf) => Some(gguf),
            Source::Folder(_) => None,
        }
    }

    /// Converts every tensor into [`ModelWeights`] (f32), checking names, shapes and dtypes;
    /// `progress` draws a bar on a terminal.
    pub fn weights(&self, progress: bool) -> Result<ModelWeights> {
        self.weights_of_layers(progress, 0..self.config.layers)
    }

    /// [`Self::weights`] of layers `keep` alone, the others [`crate::model::LayerWeights::absent`]
    /// (what one MPI rank of a pipeline holds; tables and norms always). A GGUF's and a
    /// decoder folder's other layers are never read; an encoder's are read and dropped.
    pub fn weights_of_layers(&self, progress: bool, keep: Range<usize>) -> Result<ModelWeights> {
        let c = &self.config;
        let store = match &self.source {
            Source::Folder(store) => store,
            Source::Gguf(gguf) => return gguf.weights(c, keep),
        };
        // Name prefixes each family is saved with (the first is the canonical one), and a
        // tensor every checkpoint of the family has, to tell which prefix this one uses.
        let (prefixes, probe): (&[&str], &str) = match c.arch {
            Arch::Gpt2 => (&["", "transformer."], "wte.weight"),
            // Gemma3ForConditionalGeneration's text model, in transformers 4's layout and 5's.
            Arch::Llama => (
                &[
                    "model.",
                    "",
                    "language_model.model.",
                    "model.language_model.",
                ],
                "embed_tokens.weight",
            ),
            Arch::Bert => (&["", "bert."], "embeddings.word_embeddings.weight"),
        };
        let r = Reader::new(store, prefixes, probe, progress);
        let weights = match c.arch {
            Arch::Gpt2 => gpt2::load(&r, c, self.positions, &keep),
            Arch::Llama => llama::load(&r, c, &keep),
            Arch::Bert => bert::load(&r, c, self.positions).map(|mut w| {
                w.keep_layers(&keep);
                w
            }),
        };
        r.finish();
        // The tensors of layers not read are not unused: the warning needs every layer read.
        let whole = keep == (0..c.layers) || c.arch == Arch::Bert;
        if weights.is_ok() && whole {
            let mut unused = r.unused();
            if self.vision {
                unused.retain(|n| !is_vision(n));
            }
            if let Some(line) = unused_warning(&unused) {
                eprintln!("{line}");
            }
        }
        weights
    }

    /// The checkpoint's tokenizer: a folder's `tokenizer.json`, a GGUF file's metadata.
    /// Encoders cut texts to the model's context (or the shorter `max_seq_length` of
    /// `sentence_bert_config.json`); decoders never cut a prompt.
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        self.tokenizer_from(None)
    }

    /// [`Self::tokenizer`], or the Hugging Face `tokenizer.json` at `file` where one is given
    /// (`--tokenizer`: for a GGUF whose pre-tokenizer wgpar does not rebuild, or a folder
    /// without its own), with the same cut for encoders.
    pub fn tokenizer_from(&self, file: Option<&Path>) -> Result<TextTokenizer> {
        let max_len = self.encoder_text_limit()?;
        match (file, &self.source) {
            (Some(file), _) => TextTokenizer::from_file(file, max_len),
            (None, Source::Gguf(gguf)) => gguf.tokenizer(),
            (None, Source::Folder(_)) => {
                TextTokenizer::from_file(&self.dir.join("tokenizer.json"), max_len)
            }
        }
    }

    /// The longest text an encoder takes, in tokens; `None` for a decoder.
    fn encoder_text_limit(&self) -> Result<Option<usize>> {
        if !self.config.is_encoder() {
            return Ok(None);
        }
        let st_path = self.dir.join("sentence_bert_config.json");
        let st_max = read_text(&st_path)?
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("max_seq_length").and_then(|m| m.as_u64()))
            .map(|m| m as usize);
        Ok(Some(st_max.map_or(self.config.max_seq, |m| {
            m.min(self.config.max_seq)
        })))
    }
}
