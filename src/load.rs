//! A model as the command line names it (`--model`, `--dtype`, `--weights`, `--seed`,
//! `--max-seq`), loaded the way every command loads it: a preset's synthetic weights or a
//! checkpoint's (a folder, a GGUF file, a hub-cache name), its context limited, its layers
//! packed as asked, its weight dtype resolved against the adapters. Examples and tests that
//! take the same choices call this instead of the CLI.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::device::{AdapterDesc, DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::hf::{Checkpoint, TextTokenizer};
use crate::model::hub::ModelRef;
use crate::model::memory::{FileBlocks, Vectors, WeightFormat};
use crate::model::quant::QuantType;
use crate::model::{ModelConfig, ModelWeights};
use crate::server::ChatTemplate;

/// The model choices of a command.
#[derive(Debug, Clone, Copy)]
pub struct ModelChoice<'a> {
    /// A preset or a checkpoint (`--model`).
    pub model: &'a ModelRef,
    /// `auto`, `f32` or `f16` (`--dtype`).
    pub dtype: &'a str,
    /// A block type to pack the layers into, or `dense` (`--weights`).
    pub weights: Option<&'a str>,
    /// Seed of a preset's synthetic weights (`--seed`).
    pub seed: u64,
    /// Longest context (`--max-seq`).
    pub max_seq: Option<usize>,
}

/// Context a checkpoint gets where the command does not know its lengths (the KV cache and
/// position tables are sized for it).
pub const DEFAULT_CONTEXT: usize = 2048;

/// Largest `--max-seq`: far beyond what a CPU driver decodes, small enough that a KV cache
/// size computed from it cannot overflow.
pub const MAX_CONTEXT: usize = 1 << 20;

impl<'a> ModelChoice<'a> {
    /// The model folder or GGUF file, when `--model` names one rather than a preset.
    pub fn checkpoint_dir(&self) -> Option<&'a Path> {
        self.model.path()
    }

    /// The checkpoint, its context limited to `context` (or its own, if shorter).
    pub fn checkpoint(&self, dir: &Path, context: usize) -> Result<Checkpoint> {
        let mut ckpt = Checkpoint::open(dir)?;
        let limit = ckpt.max_context().min(context);
        ckpt.limit_context(limit)?;
        Ok(ckpt)
    }

    /// The decoder to run: a preset, or a checkpoint's config (context up to 2048 tokens, or
    /// `--max-seq`).
    pub fn config(&self) -> Result<ModelConfig> {
        let config = self.any_config()?;
        if config.is_encoder() {
            return Err(WgparError::unsupported(format!(
                "model '{}' is an encoder (BERT): use `wgpar embed`",
                config.name
            )));
        }
        self.packed(&config)?;
        Ok(config)
    }

    /// [`Self::config`], an encoder's included (`serve` answers embeddings with one).
    pub fn any_config(&self) -> Result<ModelConfig> {
        if self.max_seq == Some(0) || self.max_seq > Some(MAX_CONTEXT) {
            return Err(WgparError::option(
                "--max-seq",
                format!("--max-seq must be within 1..={MAX_CONTEXT}"),
            ));
        }
        let config = match self.checkpoint_dir() {
            Some(dir) => {
                let ckpt = Checkpoint::open(dir)?;
                let limit = match self.max_seq {
                    Some(n) if n > ckpt.max_context() => {
                        return Err(WgparError::option(
                            "--max-seq",
                            format!(
                                "--max-seq {n} exceeds the context of {} tokens of model '{}'",
                                ckpt.max_context(),
                                ckpt.config().name
                            ),
                        ))
                    }
                    Some(n) => n,
                    None => ckpt.max_context().min(DEFAULT_CONTEXT),
                };
                let mut ckpt = ckpt;
                ckpt.limit_context(limit)?;
                ckpt.config().clone()
            }
            None => {
                let mut config = ModelConfig::preset(self.model.name())?;
                if let Some(n) = self.max_seq {
                    config.max_seq = n;
                }
                config
            }
        };
        Ok(config)
    }

    /// Weights for `config` (from [`Self::config`]): synthetic for a preset, loaded (with a
    /// progress bar) for a checkpoint.
    pub fn weights(&self, config: &ModelConfig) -> Result<ModelWeights> {
        self.weights_of_layers(config, 0..config.layers)
    }

    /// [`Self::weights`] of layers `keep` alone (an MPI rank's stages), the others absent:
    /// a checkpoint's other layers are not read, synthetic ones are drawn and dropped.
    pub fn weights_of_layers(
        &self,
        config: &ModelConfig,
        keep: Range<usize>,
    ) -> Result<ModelWeights> {
        let mut w = match self.checkpoint_dir() {
            Some(dir) => {
                let ckpt = self.checkpoint(dir, config.max_seq)?;
                ckpt.weights_of_layers(true, keep)?
            }
            None => {
                let mut w = ModelWeights::synthetic(config, self.seed);
                w.keep_layers(&keep);
                w
            }
        };
        self.apply_weights(&mut w)?;
        Ok(w)
    }

    /// Applies `--weights` to loaded weights: the block type to pack into, or `dense` (the
    /// file's blocks dropped). A note on stderr names the file's blocks that get re-packed.
    pub fn apply_weights(&self, w: &mut ModelWeights) -> Result<()> {
        w.packed = self.packed(&w.config)?;
        if self.weights == Some("dense") {
            w.drop_blocks();
        }
        if let Some(t) = w.packed {
            let mut other: Vec<&str> = w
                .blocks()
                .filter(|(_, _, m)| m.dtype != t)
                .map(|(_, _, m)| m.dtype.name())
                .collect();
            let count = other.len();
            other.sort_unstable();
            other.dedup();
            if count > 0 {
                eprintln!(
                    "note: --weights {} re-packs {count} layer matrices the file stores as {} \
                     (a second rounding); leave --weights out to keep the file's own blocks",
                    t.name(),
                    other.join(", ")
                );
            }
        }
        Ok(())
    }

    /// How the weights will be stored, known before they are built: `dtype` for dense ones,
    /// `--weights`, and a GGUF file's own blocks and biases read from its tensor index.
    pub fn weight_format(&self, config: &ModelConfig, dtype: DType) -> Result<WeightFormat> {
        let mut format = WeightFormat::of_config(config, dtype, self.packed(config)?);
        let Some(dir) = self.checkpoint_dir() else {
            return Ok(format);
        };
        if let Some(gguf) = Checkpoint::open(dir)?.gguf() {
            format.vectors = Vectors::of_gguf(gguf.file());
            if self.weights != Some("dense") {
                format.blocks = FileBlocks::of_gguf(gguf.file(), config);
            }
        }
        Ok(format)
    }

    /// The block type `--weights` asks for, checked against the model's shapes (`None` for
    /// none and for `dense`).
    pub fn packed(&self, config: &ModelConfig) -> Result<Option<QuantType>> {
        let Some(name) = self.weights.filter(|n| *n != "dense") else {
            return Ok(None);
        };
        let t = QuantType::parse(name).ok_or_else(|| {
            let packs: Vec<&str> = (crate::model::quant::WEIGHTS_TYPES.iter())
                .filter(|t| t.is_quantized())
                .map(|t| t.name())
                .collect();
            WgparError::option(
                "--weights",
                format!(
                    "--weights {name}: wgpar packs into {} or dense (a GGUF's other block types \
                     are kept as stored without --weights)",
                    packs.join(", ")
                ),
            )
        })?;
        crate::model::quant::check_packable(config, t)?;
        Ok(Some(t))
    }

    /// The weight dtype `--dtype` asks for, checked against the selected adapters before any
    /// device is opened (`force_f32`: --force-f32 or WGPAR_FORCE_F32=1).
    pub fn dtype_for(&self, adapters: &[AdapterDesc], force_f32: bool) -> Result<DType> {
        let force_f32 = force_f32 || crate::switches::flag(crate::switches::FORCE_F32);
        if self.dtype == "auto" {
            let lacking = adapters.iter().find(|a| !a.shader_f16);
            let why = match lacking {
                _ if force_f32 => {
                    Some("--force-f32 (or WGPAR_FORCE_F32=1) keeps every device in f32".into())
                }
                Some(a) => Some(format!(
                    "adapter {} ({}) lacks SHADER_F16",
                    a.index,
                    a.label()
                )),
                None => None,
            };
            return self.auto_dtype(why);
        }
        if self.dtype != "f16" {
            return Ok(DType::F32);
        }
        if force_f32 {
            return Err(WgparError::unsupported(
                "--dtype f16 asks for f16 weights, but --force-f32 (or WGPAR_FORCE_F32=1) keeps \
                 every device in f32: drop one of the two"
                    .into(),
            ));
        }
        match adapters.iter().find(|a| !a.shader_f16) {
            Some(a) => Err(WgparError::unsupported(format!(
                "--dtype f16 needs SHADER_F16, which adapter {} ({}) lacks: use --dtype f32, or \
                 pick adapters that have it (`wgpar devices` lists the features)",
                a.index,
                a.label()
            ))),
            None => Ok(DType::F16),
        }
    }

    /// `--dtype auto`: f16 for a checkpoint stored in 16 bits unless `why_f32` says why not
    /// (then f32, with a note), f32 for everything else (presets, f32 checkpoints).
    pub fn auto_dtype(&self, why_f32: Option<String>) -> Result<DType> {
        let half = match self.checkpoint_dir() {
            Some(dir) => Checkpoint::open(dir)?.stores_half(),
            None => false,
        };
        if !half {
            return Ok(DType::F32);
        }
        match why_f32 {
            Some(why) => {
                eprintln!(
                    "wgpar: note: the checkpoint stores f16/bf16 weights; they are held in f32 \
                     because {why}"
                );
                Ok(DType::F32)
            }
            None => {
                eprintln!(
                    "wgpar: note: weights held in f16, as the checkpoint stores them (--dtype \
                     f32 widens them)"
                );
                Ok(DType::F16)
            }
        }
    }

    /// The weight dtype `--dtype` asks for on the open `gpus`.
    pub fn dtype(&self, gpus: &[Arc<Gpu>]) -> Result<DType> {
        if self.dtype == "auto" {
            let lacking = gpus.iter().find(|g| !g.supports_f16_weights());
            let why = lacking.map(|g| {
                format!(
                    "{} keeps weights in f32 (no SHADER_F16, or --force-f32)",
                    g.describe()
                )
            });
            return self.auto_dtype(why);
        }
        match self.dtype {
            "f16" => match gpus.iter().find(|g| !g.supports_f16_weights()) {
                Some(g) if g.info().shader_f16 => Err(WgparError::unsupported(format!(
                    "--dtype f16 asks for f16 weights, but --force-f32 (or WGPAR_FORCE_F32=1) \
                     keeps {} in f32: drop one of the two",
                    g.describe()
                ))),
                Some(g) => Err(WgparError::unsupported(format!(
                    "--dtype f16 needs SHADER_F16, which {} lacks: use --dtype f32, or pick \
                     adapters that have it (`wgpar devices` lists the features)",
                    g.describe()
                ))),
                None => Ok(DType::F16),
            },
            _ => Ok(DType::F32),
        }
    }
}

/// A model's text side: what turns text into tokens and messages into a prompt.
pub struct TextSide {
    /// The tokenizer.
    pub tokenizer: TextTokenizer,
    /// The chat template, where there is one.
    pub template: Option<ChatTemplate>,
    /// The tokens that end a reply.
    pub eos: Vec<u32>,
}

impl ModelChoice<'_> {
    /// The checkpoint's tokenizer (or `tokenizer`), chat template (or the one in
    /// `chat_template`) and end tokens; for a preset (synthetic weights), a word-level
    /// tokenizer of `t0` ... and no template (but `chat_template`) or end token.
    pub fn text_side(
        &self,
        config: &ModelConfig,
        tokenizer: Option<&Path>,
        chat_template: Option<&Path>,
    ) -> Result<TextSide> {
        let (tokenizer, mut template, eos) = match self.checkpoint_dir() {
            Some(dir) => {
                let ckpt = Checkpoint::open(dir)?;
                let eos = ckpt.eos_tokens().to_vec();
                let template = match ckpt.gguf() {
                    Some(gguf) => ChatTemplate::from_gguf(gguf.file())?,
                    None => ChatTemplate::load(dir)?,
                };
                let tokenizer = ckpt.tokenizer_from(tokenizer)?;
                (tokenizer, template, eos)
            }
            None if tokenizer.is_some() => {
                return Err(WgparError::unsupported(format!(
                    "--tokenizer applies to a checkpoint (--model DIR or FILE.gguf); preset \
                     '{}' has synthetic weights and a word-level vocabulary of its own",
                    config.name
                )))
            }
            None => (TextTokenizer::word_level(config.vocab)?, None, Vec::new()),
        };
        if let Some(file) = chat_template {
            let (bos, eos) = match self.checkpoint_dir() {
                Some(dir) => ChatTemplate::special_tokens(dir),
                None => Default::default(),
            };
            template = Some(ChatTemplate::from_file(file, &bos, &eos)?);
        }
        Ok(TextSide {
            tokenizer,
            template,
            eos,
        })
    }
}
