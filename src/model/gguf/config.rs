//! A GGUF file's metadata to a [`ModelConfig`]: `general.architecture` picks the family, and
//! `<arch>.*` keys give the shapes, as llama.cpp's converter writes them.

use super::file::{GgufFile, Value};
use crate::error::{Result, WgparError};
use crate::model::config::{
    Activation, Arch, LongRopeScaling, ModelConfig, RopeScaling, SlidingWindow, YarnScaling,
};
use crate::model::rope::{longrope_magnitude, yarn_mscale};

/// The `general.architecture` values wgpar reads, and the family each maps to.
pub const GGUF_ARCHS: [(&str, Arch); 7] = [
    ("llama", Arch::Llama),
    ("mistral", Arch::Llama),
    ("qwen2", Arch::Llama),
    ("qwen3", Arch::Llama),
    ("gemma3", Arch::Llama),
    ("phi3", Arch::Llama),
    ("gpt2", Arch::Gpt2),
];

/// Whether llama.cpp's converter interleaved the Q and K rows of `arch` files for its pairwise
/// RoPE (the `llama` family), which the loader puts back; Qwen2, Qwen3, Gemma 3 and Phi-3
/// rotate halves as Hugging Face does (llama.cpp's NEOX RoPE), so their rows are as stored.
pub fn permuted_rows(arch: &str) -> bool {
    !matches!(arch, "qwen2" | "qwen3" | "gemma3" | "phi3")
}

/// Typed reads of the metadata whose errors name the file and key.
pub struct Meta<'a> {
    file: &'a GgufFile,
    /// `general.architecture`, the prefix of the model's own keys.
    pub arch_name: String,
}

impl<'a> Meta<'a> {
    /// The metadata of `file`; refuses an architecture wgpar does not run.
    pub fn new(file: &'a GgufFile) -> Result<Self> {
        let mut m = Self {
            file,
            arch_name: String::new(),
        };
        m.arch_name = m.string("general.architecture")?.to_string();
        if !GGUF_ARCHS.iter().any(|(n, _)| *n == m.arch_name) {
            let known: Vec<&str> = GGUF_ARCHS.iter().map(|(n, _)| *n).collect();
            return Err(m.fail(format!(
                "key 'general.architecture' is '{}': wgpar runs {}",
                m.arch_name,
                known.join(", ")
            )));
        }
        Ok(m)
    }

    /// A checkpoint error about the file.
    pub fn fail(&self, detail: String) -> WgparError {
        WgparError::Checkpoint {
            file: self.file.path().display().to_string(),
            tensor: None,
            detail,
        }
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.file.meta.get(key)
    }

    fn wrong(&self, key: &str, v: &Value, want: &str) -> WgparError {
        let shown = match v {
            Value::Array(items) => format!("an array of {}", items.len()),
            other => format!("{other:?}"),
        };
        self.fail(format!("key '{key}' is {shown}, expected {want}"))
    }

    /// String `key`.
    pub fn string(&self, key: &str) -> Result<&'a str> {
        match self.get(key) {
            Some(Value::Str(s)) => Ok(s),
            Some(v) => Err(self.wrong(key, v, "a string")),
            None => Err(self.fail(format!("key '{key}' is missing"))),
        }
    }

    /// Whole number `key`, if present.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.wrong(key, v, "a whole number")),
        }
    }

    /// Whole number `key` of the model's architecture (`<arch>.<key>`).
    pub fn arch_usize(&self, key: &str) -> Result<usize> {
        let full = format!("{}.{key}", self.arch_name);
        self.opt_usize(&full)?
            .ok_or_else(|| self.fail(format!("key '{full}' is missing")))
    }

    /// Number `<arch>.<key>`, `default` when absent.
    pub fn arch_f32_or(&self, key: &str, default: f32) -> Result<f32> {
        let full = format!("{}.{key}", self.arch_name);
        match self.get(&full) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| self.wrong(&full, v, "a number")),
        }
    }

    /// Boolean `key`, `default` when absent.
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.wrong(key, v, "a boolean")),
        }
    }

    /// Array `key`, if present.
    pub fn opt_array(&self, key: &str) -> Result<Option<&'a [Value]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(v) => Err(self.wrong(key, v, "an array")),
        }
    }
}

/// The model's shapes from the metadata; `name` names it where `general.name` is absent.
pub fn model_config(meta: &Meta, file: &GgufFile, name: &str) -> Result<ModelConfig> {
    let arch = GGUF_ARCHS
        .iter()
        .find(|(n, _)| *n == meta.arch_name)
        .map(|(_, a)| *a)
        .unwrap_or(Arch::Llama);
    let hidden = meta.arch_usize("embedding_length")?;
    let heads = meta.arch_usize("attention.head_count")?;
    let kv_key = format!("{}.attention.head_count_kv", meta.arch_name);
    let head_key = format!("{}.attention.key_length", meta.arch_name);
    let vocab = match meta.opt_array("tokenizer.ggml.tokens")? {
        Some(tokens) => tokens.len(),
        None => file
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .unwrap_or(0),
    };
    let base = ModelConfig {
        name: match meta.get("general.name") {
            Some(Value::Str(s)) if !s.is_empty() => s.clone(),
            _ => name.to_string(),
        },
        arch,
        vocab,
        hidden,
        layers: meta.arch_usize("block_count")?,
        heads,
        kv_heads: meta.opt_usize(&kv_key)?.unwrap_or(heads),
        head_dim: meta.opt_usize(&head_key)?.unwrap_or(hidden / heads.max(1)),
        ffn: meta.arch_usize("feed_forward_length")?,
        max_seq: meta.arch_usize("context_length")?,
        tied_head: file.tensor("output.weight").is_none(),
        ..ModelConfig::default_model()
    };
    let rotary = match arch {
        Arch::Gpt2 => None,
        _ => rotary_dim(meta, base.head_dim)?,
    };
    let pairs = rotary.unwrap_or(base.head_dim) / 2;
    let config = match arch {
        Arch::Gpt2 => ModelConfig {
            norm_eps: meta.arch_f32_or("attention.layer_norm_epsilon", 1e-5)?,
            activation: Activation::GeluTanh,
            ..base
        },
        _ => ModelConfig {
            norm_eps: meta.arch_f32_or("attention.layer_norm_rms_epsilon", 1e-6)?,
            rope_theta: meta.arch_f32_or("rope.freq_base", 10_000.0)?,
            rope_scaling: match longrope(meta, file, base.max_seq, pairs)? {
                Some(s) => Some(RopeScaling::LongRope(s)),
                None => rope_scaling(meta, base.max_seq)?,
            },
            rotary_dim: rotary,
            rope_freq_factors: rope_freq_factors(meta, file, pairs)?,
            // llama.cpp's qwen3 graph normalises every query and key head (attn_q_norm,
            // attn_k_norm), always.
            qk_norm: meta.arch_name == "qwen3",
            activation: Activation::Silu,
            ..base
        },
    };
    let config = match meta.arch_name.as_str() {
        "gemma3" => gemma3(meta, config)?,
        "phi3" => phi3(meta, config)?,
        _ => config,
    };
    if arch != Arch::Gpt2 {
        same_value_length(meta, config.head_dim)?;
    }
    // The declared blocks must be in the file before anything is sized by their count.
    let present = (0..config.layers)
        .take_while(|i| file.tensor(&format!("blk.{i}.attn_norm.weight")).is_some())
        .count();
    if present < config.layers {
        return Err(meta.fail(format!(
            "key '{}.block_count' is {}, but the file holds {present} block(s) (no \
             'blk.{present}.attn_norm.weight')",
            meta.arch_name, config.layers
        )));
    }
    if arch == Arch::Gpt2 && config.head_dim * config.heads != config.hidden {
        return Err(meta.fail(format!(
            "embedding length {} is not a multiple of {} heads",
            config.hidden, config.heads
        )));
    }
    config.validate().map_err(|e| meta.fail(e.to_string()))?;
    Ok(config)
}

/// Gemma 3's features over the Llama-shaped `base`, as llama.cpp's gemma3 graph reads the
/// file: embeddings scaled by sqrt(hidden), sandwich norms (the converter already added the
/// 1 of Gemma's `1 + w` to every norm scale), GeGLU, query/key norms, the query scale
/// (1/sqrt(hidden / heads) for the 62-layer 27B, whose `query_pre_attn_scalar` is that,
/// 1/sqrt(head_dim) otherwise: the file does not store it), sliding layers where
/// `attention.sliding_window` is set (pattern from `attention.sliding_window_pattern`,
/// default 6; base `rope.freq_base_swa`, default 10000) and the final soft-cap if present.
fn gemma3(meta: &Meta, base: ModelConfig) -> Result<ModelConfig> {
    let query = match base.layers {
        62 => base.hidden / base.heads.max(1),
        _ => base.head_dim,
    };
    let window = meta
        .opt_usize("gemma3.attention.sliding_window")?
        .filter(|&w| w > 0);
    let sliding = match window {
        Some(window) => Some(SlidingWindow {
            window,
            layers: gguf_sliding_layers(meta, base.layers)?,
            rope_theta: meta.arch_f32_or("rope.freq_base_swa", 10_000.0)?,
        }),
        None => None,
    };
    let cap = meta.arch_f32_or("final_logit_softcapping", 0.0)?;
    Ok(ModelConfig {
        qk_norm: true,
        embed_scale: Some((base.hidden as f32).sqrt()),
        sandwich_norms: true,
        attn_scale: Some(1.0 / (query as f32).sqrt()),
        sliding,
        final_softcap: (cap != 0.0).then_some(cap),
        activation: Activation::GeluTanhGated,
        ..base
    })
}

/// Phi-3 over the Llama-shaped `base` (LongRoPE is read with the other RoPE keys, by
/// [`longrope`]): a sliding window caps the context as Hugging Face's Phi-3 masks it
/// (llama.cpp leaves it unused).
fn phi3(meta: &Meta, base: ModelConfig) -> Result<ModelConfig> {
    let window = meta
        .opt_usize("phi3.attention.sliding_window")?
        .filter(|&w| w > 0);
    Ok(ModelConfig {
        max_seq: window.map_or(base.max_seq, |w| base.max_seq.min(w)),
        ..base
    })
}

/// `gemma3.attention.sliding_window_pattern`: one flag per layer, or a period `n` (every
/// `n`-th layer global); 6 when absent, as llama.cpp has it.
fn gguf_sliding_layers(meta: &Meta, layers: usize) -> Result<Vec<bool>> {
    const KEY: &str = "gemma3.attention.sliding_window_pattern";
    if let Some(Value::Array(flags)) = meta.get(KEY) {
        let flags: Option<Vec<bool>> = flags
            .iter()
            .map(|v| match v {
                Value::Bool(b) => Some(*b),
                _ => None,
            })
            .collect();
        return flags.filter(|f| f.len() == layers).ok_or_else(|| {
            meta.fail(format!(
                "key '{KEY}' is not {layers} booleans (one per layer)"
            ))
        });
    }
    let period = meta.opt_usize(KEY)?.unwrap_or(6);
    // llama.cpp: a period of 0 makes every layer slide.
    Ok((0..layers)
        .map(|i| period == 0 || (i + 1) % period != 0)
        .collect())
}

/// Token ids that end generation: the end-of-sequence and end-of-turn ids the file names.
pub fn eos_tokens(meta: &Meta) -> Result<Vec<u32>> {
    let mut eos = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(id) = meta.opt_usize(key)? {
            let id = u32::try_from(id).map_err(|_| meta.fail(format!("key '{key}' is {id}")))?;
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    Ok(eos)
}

/// `<arch>.rope.dimension_count`: the first values of each head RoPE rotates (llama.cpp's
/// `n_rot`), `None` for the whole head. Below the head size it is a partial rotation (Phi-4-mini
/// rotates 96 of 128), read in the files whose rows rotate halves; in an interleaved file
/// (the `llama` family) the converter's permutation spans the whole head, and undoing it for a
/// partial rotation is not done, so it is refused there by name, as is an odd count or one
/// beyond the head.
fn rotary_dim(meta: &Meta, head_dim: usize) -> Result<Option<usize>> {
    let key = format!("{}.rope.dimension_count", meta.arch_name);
    let n = match meta.opt_usize(&key)? {
        None => return Ok(None),
        Some(n) if n == head_dim => return Ok(None),
        Some(n) => n,
    };
    if n == 0 || n > head_dim || !n.is_multiple_of(2) {
        return Err(meta.fail(format!(
            "key '{key}' is {n}: RoPE needs an even count of at most head_dim {head_dim}"
        )));
    }
    if permuted_rows(&meta.arch_name) {
        return Err(meta.fail(format!(
            "key '{key}' is {n}: RoPE over part of a head is not supported in '{}' files, whose \
             Q/K rows the converter interleaves over the whole head (head_dim {head_dim})",
            meta.arch_name
        )));
    }
    Ok(Some(n))
}

/// Refuses `<arch>.attention.value_length` other than the key length: the KV cache and the
/// kernels hold values as wide as keys.
fn same_value_length(meta: &Meta, head_dim: usize) -> Result<()> {
    let key = format!("{}.attention.value_length", meta.arch_name);
    match meta.opt_usize(&key)? {
        Some(n) if n != head_dim => Err(meta.fail(format!(
            "key '{key}' is {n}: value heads of another width than key heads ({head_dim}) are \
             not supported"
        ))),
        _ => Ok(()),
    }
}

/// `<arch>.rope.<key>` as a number, if present.
fn rope_number(meta: &Meta, key: &str) -> Result<Option<f64>> {
    let full = format!("{}.rope.{key}", meta.arch_name);
    match meta.get(&full) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| meta.wrong(&full, v, "a number")),
    }
}

/// `<arch>.rope.scaling.*` as llama.cpp reads them: `type` none, linear (also when only a
/// factor is given, llama.cpp's default) or yarn; `context` is the file's context length, the
/// original one unless the file names it. Keys that would change the rotation in ways wgpar
/// does not compute are refused by name.
fn rope_scaling(meta: &Meta, context: usize) -> Result<Option<RopeScaling>> {
    let type_key = format!("{}.rope.scaling.type", meta.arch_name);
    let kind = match meta.get(&type_key) {
        None => None,
        Some(_) => Some(meta.string(&type_key)?),
    };
    for (key, neutral) in [
        ("scaling.attn_factor", 1.0),
        ("scaling.yarn_log_multiplier", 0.0),
        (
            "scaling.yarn_ext_factor",
            if kind == Some("yarn") { 1.0 } else { 0.0 },
        ),
    ] {
        if let Some(v) = rope_number(meta, key)?.filter(|&v| v != neutral) {
            return Err(meta.fail(format!(
                "key '{}.rope.{key}' is {v}: only {neutral} is supported",
                meta.arch_name
            )));
        }
    }
    // A factor of 0 means none, as in llama.cpp.
    let factor = match rope_number(meta, "scaling.factor")? {
        Some(f) => Some(f),
        None => rope_number(meta, "scale_linear")?,
    }
    .filter(|&f| f != 0.0);
    match kind {
        Some("none") => Ok(None),
        None | Some("linear") => Ok(factor.map(|f| RopeScaling::Linear { factor: f as f32 })),
        Some("yarn") => {
            let factor = factor.ok_or_else(|| {
                meta.fail(format!(
                    "key '{type_key}' is yarn, but '{}.rope.scaling.factor' is missing",
                    meta.arch_name
                ))
            })?;
            let original = format!("{}.rope.scaling.original_context_length", meta.arch_name);
            let number =
                |k: &str, default: f64| rope_number(meta, k).map(|v| v.unwrap_or(default) as f32);
            Ok(Some(RopeScaling::Yarn(YarnScaling {
                factor: factor as f32,
                original_context: meta.opt_usize(&original)?.unwrap_or(context),
                beta_fast: number("scaling.yarn_beta_fast", 32.0)?,
                beta_slow: number("scaling.yarn_beta_slow", 1.0)?,
                attention_factor: number("scaling.yarn_attn_factor", yarn_mscale(factor, 1.0))?,
                truncate: true,
            })))
        }
        Some(other) => Err(meta.fail(format!(
            "key '{type_key}' is '{other}': supported RoPE scalings are none, linear and yarn"
        ))),
    }
}

/// LongRoPE as llama.cpp's phi3 graph reads it (Phi-3 128k, Phi-3.5): the per-pair divisors
/// `rope_factors_short.weight` and `rope_factors_long.weight` (both needed), the original
/// context `<arch>.rope.scaling.original_context_length` (else the file's context), and the
/// magnitude `<arch>.rope.scaling.attn_factor` (else LongRoPE's default for `context` over
/// the original). `None` when the file has neither tensor.
fn longrope(
    meta: &Meta,
    file: &GgufFile,
    context: usize,
    pairs: usize,
) -> Result<Option<LongRopeScaling>> {
    const NAMES: [&str; 2] = ["rope_factors_short.weight", "rope_factors_long.weight"];
    let found: Vec<bool> = NAMES.iter().map(|n| file.tensor(n).is_some()).collect();
    match (found[0], found[1]) {
        (false, false) => return Ok(None),
        (true, true) => {}
        (short, _) => {
            let (has, lacks) = if short { (0, 1) } else { (1, 0) };
            return Err(meta.fail(format!(
                "tensor '{}' without '{}': LongRoPE needs both",
                NAMES[has], NAMES[lacks]
            )));
        }
    }
    let type_key = format!("{}.rope.scaling.type", meta.arch_name);
    if let Some(kind) = meta
        .get(&type_key)
        .map(|_| meta.string(&type_key))
        .transpose()?
    {
        if kind != "none" {
            return Err(meta.fail(format!(
                "key '{type_key}' is '{kind}' beside LongRoPE's factor tensors: one scaling only"
            )));
        }
    }
    if let Some(f) = rope_number(meta, "scaling.factor")?.filter(|&f| f != 0.0 && f != 1.0) {
        return Err(meta.fail(format!(
            "key '{}.rope.scaling.factor' is {f} beside LongRoPE's factor tensors: one \
             scaling only",
            meta.arch_name
        )));
    }
    let key = format!("{}.rope.scaling.original_context_length", meta.arch_name);
    let original = meta.opt_usize(&key)?.unwrap_or(context);
    let ratio = context as f64 / original.max(1) as f64;
    let attention_factor = rope_number(meta, "scaling.attn_factor")?
        .unwrap_or_else(|| longrope_magnitude(ratio, original));
    Ok(Some(LongRopeScaling {
        short_factor: pair_divisors(meta, file, NAMES[0], pairs)?,
        long_factor: pair_divisors(meta, file, NAMES[1], pairs)?,
        original_context: original,
        attention_factor: attention_factor as f32,
    }))
}

/// `rope_freqs.weight` (Llama 3.1 / 3.2): one divisor per rotated pair of a head (`pairs`),
/// which llama.cpp applies to every layer's frequencies.
fn rope_freq_factors(meta: &Meta, file: &GgufFile, pairs: usize) -> Result<Option<Vec<f32>>> {
    const NAME: &str = "rope_freqs.weight";
    if file.tensor(NAME).is_none() {
        return Ok(None);
    }
    pair_divisors(meta, file, NAME, pairs).map(Some)
}

/// The `n` values (one per rotated pair) of the 1-D tensor `name` (which must exist).
fn pair_divisors(meta: &Meta, file: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    let info = file
        .tensor(name)
        .ok_or_else(|| meta.fail(format!("tensor '{name}' is missing")))?;
    let bytes = file.data(info);
    if info.shape() != [n] || info.dtype.row_bytes(n) != Some(bytes.len()) {
        return Err(meta.fail(format!(
            "tensor '{name}' has shape {:?} ({} bytes of {:?}): expected [{n}] (one per \
             rotated pair)",
            info.shape(),
            bytes.len(),
            info.dtype
        )));
    }
    Ok(crate::model::quant::dequantize(info.dtype, bytes))
}
