//! `config.json` of a Hugging Face checkpoint to a [`ModelConfig`]: which family the
//! `model_type` names, and each family's own keys for the shapes.

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, WgparError};
use crate::model::config::{
    Activation, Arch, Llama3Scaling, LongRopeScaling, ModelConfig, PoolMode, Pooling, RopeScaling,
    SlidingWindow, YarnScaling,
};
use crate::model::rope::{longrope_magnitude, yarn_mscale};

/// The `model_type` values wgpar reads, and the family each maps to.
pub const SUPPORTED_TYPES: [(&str, Arch); 8] = [
    ("gpt2", Arch::Gpt2),
    ("llama", Arch::Llama),
    ("mistral", Arch::Llama),
    ("qwen2", Arch::Llama),
    ("qwen3", Arch::Llama),
    ("gemma3_text", Arch::Llama),
    ("phi3", Arch::Llama),
    ("bert", Arch::Bert),
];

/// What config.json says.
#[derive(Debug, Clone)]
pub struct HfConfig {
    /// Shapes, with `max_seq` the longest context the checkpoint supports.
    pub config: ModelConfig,
    /// Token ids that end generation (from `eos_token_id`).
    pub eos: Vec<u32>,
    /// The checkpoint is a text-and-vision model (`Gemma3ForConditionalGeneration`) of which
    /// wgpar reads the text model alone: its vision tower's tensors are not read.
    pub vision: bool,
}

/// Typed reads of a JSON object whose errors name the file and key.
struct Keys<'a> {
    json: &'a Value,
    file: &'a Path,
}

impl Keys<'_> {
    fn fail(&self, detail: String) -> WgparError {
        WgparError::Checkpoint {
            file: self.file.display().to_string(),
            tensor: None,
            detail,
        }
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.fail(format!("\"{key}\" is {v}, expected a whole number"))),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.fail(format!("\"{key}\" is missing")))
    }

    /// The first of several spellings of one key (GPT-2's `n_positions` / `n_ctx`).
    fn usize_of(&self, keys: &[&str]) -> Result<usize> {
        for key in keys {
            if let Some(n) = self.opt_usize(key)? {
                return Ok(n);
            }
        }
        Err(self.fail(format!("none of {keys:?} is given")))
    }

    fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| self.fail(format!("\"{key}\" is {v}, expected a number"))),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.fail(format!("\"{key}\" is {v}, expected true or false"))),
        }
    }

    fn str_or<'v>(&'v self, key: &str, default: &'v str) -> Result<&'v str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.fail(format!("\"{key}\" is {v}, expected a string"))),
        }
    }
}

/// Token ids given as one id, a list of ids, or nothing (`eos_token_id`).
pub fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|v| v as u32)
            .collect(),
        Some(v) => v.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        None => Vec::new(),
    }
}

/// The model type a config names (`model_type`, or else the first of `architectures`) and
/// its family.
fn family(keys: &Keys) -> Result<(&'static str, Arch)> {
    let supported = || {
        SUPPORTED_TYPES
            .iter()
            .map(|(t, _)| *t)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let model_type = match keys.get("model_type").and_then(Value::as_str) {
        Some(t) => t.to_string(),
        None => {
            // Older exports name only the class, e.g. "GPT2LMHeadModel", "BertModel".
            let class = keys
                .get("architectures")
                .and_then(|a| a.get(0))
                .and_then(Value::as_str)
                .unwrap_or("");
            let lower = class.to_ascii_lowercase();
            match SUPPORTED_TYPES.iter().find(|(t, _)| lower.starts_with(t)) {
                Some((t, _)) => t.to_string(),
                None => {
                    return Err(keys.fail(format!(
                        "no \"model_type\" (architectures: '{class}'); supported model types: {}",
                        supported()
                    )))
                }
            }
        }
    };
    SUPPORTED_TYPES
        .iter()
        .find(|(t, _)| *t == model_type)
        .copied()
        .ok_or_else(|| {
            keys.fail(format!(
                "model_type '{model_type}' is not supported; supported model types: {}",
                supported()
            ))
        })
}

fn gelu_kind(keys: &Keys, key: &str, default: &str) -> Result<Activation> {
    match keys.str_or(key, default)? {
        "gelu" => Ok(Activation::GeluErf),
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Activation::GeluTanh),
        other => Err(keys.fail(format!(
            "\"{key}\" is '{other}'; supported: gelu (erf), gelu_new / gelu_pytorch_tanh (tanh)"
        ))),
    }
}

/// The keys each `rope_scaling` type reads, beside `type` / `rope_type` (and `rope_theta`,
/// which Transformers 5's `rope_parameters` carries).
const ROPE_KEYS: [(&str, &[&str]); 4] = [
    ("linear", &["factor"]),
    (
        "llama3",
        &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
    ),
    (
        "yarn",
        &[
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
    ),
    (
        "longrope",
        &[
            "short_factor",
            "long_factor",
            "factor",
            "attention_factor",
            "original_max_position_embeddings",
        ],
    ),
];

/// `rope_scaling` (or `rope_parameters`): linear, llama3, yarn and longrope, as
/// Transformers' `modeling_rope_utils` reads them; `default` is none, `su` the old name of
/// longrope, and Phi-3's config reads `yarn` as longrope too. Any other type, or a key the
/// type does not read, is refused by name. `max_pos` is `max_position_embeddings`.
fn rope_scaling(keys: &Keys, value: &Value, max_pos: usize) -> Result<Option<RopeScaling>> {
    let sub = Keys {
        json: value,
        file: keys.file,
    };
    let kind = match sub.get("rope_type") {
        Some(_) => sub.str_or("rope_type", "")?,
        None => sub.str_or("type", "default")?,
    };
    let phi3 = family(keys).is_ok_and(|(t, _)| t == "phi3");
    let kind = match kind {
        "su" => "longrope",
        "yarn" if phi3 => "longrope",
        other => other,
    };
    let known = ROPE_KEYS.iter().find(|(k, _)| *k == kind).map(|(_, v)| *v);
    let Some(known) = known.or((kind == "default").then_some(&[][..])) else {
        return Err(keys.fail(format!(
            "\"rope_scaling\" of type '{kind}' is not supported (supported: default, linear, \
             llama3, yarn, longrope)"
        )));
    };
    // Transformers 5 writes Phi-3's partial_rotary_factor here too: read by `rotary_dim`.
    let all = ["type", "rope_type", "rope_theta", "partial_rotary_factor"];
    if let Some(extra) = value.as_object().and_then(|o| {
        o.keys()
            .find(|k| !known.contains(&k.as_str()) && !all.contains(&k.as_str()))
    }) {
        return Err(keys.fail(format!(
            "\"rope_scaling\" key \"{extra}\" is not supported for type '{kind}'"
        )));
    }
    let number = |k: &str| {
        sub.get(k)
            .and_then(Value::as_f64)
            .ok_or_else(|| keys.fail(format!("\"rope_scaling\" needs a number \"{k}\"")))
    };
    Ok(match kind {
        "linear" => Some(RopeScaling::Linear {
            factor: number("factor")? as f32,
        }),
        "llama3" => Some(RopeScaling::Llama3(Llama3Scaling {
            factor: number("factor")? as f32,
            low_freq_factor: number("low_freq_factor")? as f32,
            high_freq_factor: number("high_freq_factor")? as f32,
            original_context: sub.usize("original_max_position_embeddings")?,
        })),
        "yarn" => Some(RopeScaling::Yarn(yarn(&sub, max_pos)?)),
        "longrope" => Some(RopeScaling::LongRope(longrope(keys, &sub, max_pos, phi3)?)),
        _ => None,
    })
}

/// LongRoPE's parameters as Transformers' `_compute_longrope_parameters` resolves them: the
/// original context from the top-level `original_max_position_embeddings` first (Phi-3's
/// config defaults it to 4096), else the scaling's own, else `max_pos`; `factor` defaults to
/// the context ratio, the attention factor to `sqrt(1 + ln(factor) / ln(original))`.
fn longrope(keys: &Keys, sub: &Keys, max_pos: usize, phi3: bool) -> Result<LongRopeScaling> {
    const KEY: &str = "original_max_position_embeddings";
    let original = match keys.opt_usize(KEY)? {
        Some(n) => n,
        None if phi3 => 4096,
        None => sub.opt_usize(KEY)?.unwrap_or(max_pos),
    };
    let factor = sub.f32_or("factor", (max_pos as f64 / original.max(1) as f64) as f32)? as f64;
    let attention_factor = match sub.get("attention_factor") {
        Some(_) => sub.f32_or("attention_factor", 1.0)?,
        None => longrope_magnitude(factor, original) as f32,
    };
    let list = |k: &str| -> Result<Vec<f32>> {
        let values = sub.get(k).and_then(Value::as_array);
        values
            .and_then(|a| a.iter().map(|v| v.as_f64().map(|x| x as f32)).collect())
            .ok_or_else(|| keys.fail(format!("\"rope_scaling\" needs a list of numbers \"{k}\"")))
    };
    Ok(LongRopeScaling {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_context: original,
        attention_factor,
    })
}

/// YaRN's parameters as Transformers' `_compute_yarn_parameters` resolves them: `factor`
/// defaults to the context ratio, the attention factor to `0.1 ln(factor) + 1` (or the ratio
/// of two such under `mscale` and `mscale_all_dim`), the betas to 32 and 1.
fn yarn(sub: &Keys, max_pos: usize) -> Result<YarnScaling> {
    let original = sub
        .opt_usize("original_max_position_embeddings")?
        .unwrap_or(max_pos);
    let ratio = max_pos as f64 / original.max(1) as f64;
    let factor = sub.f32_or("factor", ratio as f32)? as f64;
    let attention_factor = match sub.get("attention_factor") {
        Some(_) => sub.f32_or("attention_factor", 1.0)? as f64,
        None => {
            let (m, all) = (
                sub.f32_or("mscale", 0.0)?,
                sub.f32_or("mscale_all_dim", 0.0)?,
            );
            if m != 0.0 && all != 0.0 {
                yarn_mscale(factor, m as f64) / yarn_mscale(factor, all as f64)
            } else {
                yarn_mscale(factor, 1.0)
            }
        }
    };
    // Transformers reads the betas with `or`, so 0 also means the default.
    let beta = |k: &str, default: f32| {
        sub.f32_or(k, default)
            .map(|b| if b == 0.0 { default } else { b })
    };
    Ok(YarnScaling {
        factor: factor as f32,
        original_context: original,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        attention_factor: attention_factor as f32,
        truncate: sub.bool_or("truncate", true)?,
    })
}

/// GPT-2's keys (`n_embd`, `n_head`, ...) over `base`.
fn gpt2(keys: &Keys<'_>, base: ModelConfig) -> Result<ModelConfig> {
    if keys.bool_or("scale_attn_by_inverse_layer_idx", false)? {
        return Err(keys.fail("scale_attn_by_inverse_layer_idx is not supported".into()));
    }
    let hidden = keys.usize("n_embd")?;
    let heads = keys.usize("n_head")?;
    Ok(ModelConfig {
        vocab: keys.usize("vocab_size")?,
        hidden,
        layers: keys.usize("n_layer")?,
        heads,
        kv_heads: heads,
        head_dim: hidden / heads.max(1),
        ffn: keys.opt_usize("n_inner")?.unwrap_or(4 * hidden),
        max_seq: keys.usize_of(&["n_positions", "n_ctx"])?,
        norm_eps: keys.f32_or("layer_norm_epsilon", 1e-5)?,
        tied_head: keys.bool_or("tie_word_embeddings", true)?,
        activation: gelu_kind(keys, "activation_function", "gelu_new")?,
        ..base
    })
}

/// Llama-family keys (Llama, Mistral, Qwen2, Qwen3, Phi-3: `model_type`) over `base`.
fn llama(keys: &Keys<'_>, model_type: &str, base: ModelConfig) -> Result<ModelConfig> {
    let act = keys.str_or("hidden_act", "silu")?;
    if act != "silu" {
        return Err(keys.fail(format!("\"hidden_act\" is '{act}', only silu is supported")));
    }
    let hidden = keys.usize("hidden_size")?;
    let heads = keys.usize("num_attention_heads")?;
    let mut max_seq = keys.opt_usize("max_position_embeddings")?.unwrap_or(2048);
    // Transformers 5 writes the scaling (and the base) as "rope_parameters".
    let rope = keys
        .get("rope_scaling")
        .or_else(|| keys.get("rope_parameters"));
    let rope_scaling = match rope {
        None => None,
        Some(v) => rope_scaling(keys, v, max_seq)?,
    };
    let head_dim = keys.opt_usize("head_dim")?.unwrap_or(hidden / heads.max(1));
    let in_rope = |v: &Value| v.get("rope_theta").and_then(Value::as_f64);
    let rope_theta = match rope.and_then(in_rope) {
        Some(theta) => theta as f32,
        None => keys.f32_or("rope_theta", 10_000.0)?,
    };
    // A sliding window equals full attention up to the window's length, so the context
    // is capped there. Mistral and Phi-3 apply their window whenever it is set; Qwen2 and Qwen3 only
    // under "use_sliding_window" (false by default), as Hugging Face reads them.
    let windowed_by_default = !matches!(model_type, "qwen2" | "qwen3");
    if keys.bool_or("use_sliding_window", windowed_by_default)? {
        if let Some(window) = keys.opt_usize("sliding_window")? {
            max_seq = max_seq.min(window);
        }
    }
    Ok(ModelConfig {
        vocab: keys.usize("vocab_size")?,
        hidden,
        layers: keys.usize("num_hidden_layers")?,
        heads,
        kv_heads: keys.opt_usize("num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        ffn: keys.usize("intermediate_size")?,
        max_seq,
        norm_eps: keys.f32_or("rms_norm_eps", 1e-6)?,
        rope_theta,
        rope_scaling,
        // Phi-4-mini rotates the first three quarters of each head.
        rotary_dim: rotary_dim(keys, rope, head_dim)?,
        tied_head: keys.bool_or("tie_word_embeddings", false)?,
        // Qwen3 normalises every query and key head (its q_norm / k_norm), always.
        qk_norm: model_type == "qwen3",
        activation: Activation::Silu,
        ..base
    })
}

/// The rotated part of each head from `partial_rotary_factor`: in the RoPE parameters `rope`
/// first (Transformers 5 moves it there), else at the top level; `None` for the whole head.
/// Transformers rotates `int(head_dim * factor)` values; a factor outside (0, 1], or one that
/// does not give an even whole number, is refused by name.
fn rotary_dim(keys: &Keys, rope: Option<&Value>, head_dim: usize) -> Result<Option<usize>> {
    const KEY: &str = "partial_rotary_factor";
    let value = rope.and_then(|r| r.get(KEY)).filter(|v| !v.is_null());
    let Some(v) = value.or_else(|| keys.get(KEY)) else {
        return Ok(None);
    };
    let factor = v
        .as_f64()
        .ok_or_else(|| keys.fail(format!("\"{KEY}\" is {v}, expected a number")))?;
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(keys.fail(format!("\"{KEY}\" is {factor}: must be in (0, 1]")));
    }
    let exact = head_dim as f64 * factor;
    // Truncated as Python's int(); within rounding of a whole number, or refused.
    let dims = exact as usize;
    if (exact - dims as f64).abs() > 1e-9 || dims == 0 || !dims.is_multiple_of(2) {
        return Err(keys.fail(format!(
            "\"{KEY}\" is {factor}: {factor} x head_dim {head_dim} = {exact} is not an even \
             whole number of dimensions to rotate"
        )));
    }
    Ok((dims < head_dim).then_some(dims))
}

/// Refuses a partial rotary factor anywhere a Gemma 3 config could carry one (the top level,
/// `rope_scaling`, `rope_parameters` and its per-layer-type entries): Gemma 3 rotates whole
/// heads, as its Transformers code does.
fn gemma3_whole_heads(keys: &Keys<'_>, head_dim: usize) -> Result<()> {
    let mut places = vec![None, keys.get("rope_scaling")];
    if let Some(p) = keys.get("rope_parameters") {
        places.extend([Some(p), p.get("full_attention"), p.get("sliding_attention")]);
    }
    for place in places {
        if let Some(dims) = rotary_dim(keys, place, head_dim)? {
            return Err(keys.fail(format!(
                "\"partial_rotary_factor\" rotates {dims} of {head_dim} values a head: Gemma 3 \
                 rotates whole heads, a partial rotation is not supported for it"
            )));
        }
    }
    Ok(())
}

/// Gemma 3 text keys (`gemma3_text`) over the Llama ones: the defaults are
/// transformers' `Gemma3TextConfig`'s. Features wgpar does not compute are refused by name.
fn gemma3(keys: &Keys<'_>, base: ModelConfig) -> Result<ModelConfig> {
    let act = keys.str_or("hidden_activation", "gelu_pytorch_tanh")?;
    if act != "gelu_pytorch_tanh" {
        return Err(keys.fail(format!(
            "\"hidden_activation\" is '{act}', only gelu_pytorch_tanh is supported"
        )));
    }
    for key in ["attn_logit_softcapping", "use_bidirectional_attention"] {
        if let Some(v) = keys.get(key).filter(|v| v.as_bool() != Some(false)) {
            return Err(keys.fail(format!("\"{key}\" is {v}: not supported")));
        }
    }
    let hidden = keys.opt_usize("hidden_size")?.unwrap_or(2304);
    let heads = keys.opt_usize("num_attention_heads")?.unwrap_or(8);
    let layers = keys.opt_usize("num_hidden_layers")?.unwrap_or(26);
    let max_seq = keys
        .opt_usize("max_position_embeddings")?
        .unwrap_or(131_072);
    let (global, local) = gemma3_rope(keys, max_seq)?;
    let head_dim = keys.opt_usize("head_dim")?.unwrap_or(256);
    gemma3_whole_heads(keys, head_dim)?;
    let query_scalar = keys.f32_or("query_pre_attn_scalar", 256.0)?;
    Ok(ModelConfig {
        vocab: keys.opt_usize("vocab_size")?.unwrap_or(262_208),
        hidden,
        layers,
        heads,
        kv_heads: keys.opt_usize("num_key_value_heads")?.unwrap_or(4),
        head_dim,
        ffn: keys.opt_usize("intermediate_size")?.unwrap_or(9216),
        max_seq,
        norm_eps: keys.f32_or("rms_norm_eps", 1e-6)?,
        rope_theta: global.0,
        rope_scaling: global.1,
        tied_head: keys.bool_or("tie_word_embeddings", true)?,
        qk_norm: true,
        embed_scale: Some(embed_scale(keys, hidden)?),
        sandwich_norms: true,
        attn_scale: Some(1.0 / query_scalar.sqrt()),
        sliding: Some(SlidingWindow {
            window: keys.opt_usize("sliding_window")?.unwrap_or(4096),
            layers: sliding_layers(keys, layers)?,
            rope_theta: local,
        }),
        final_softcap: keys
            .get("final_logit_softcapping")
            .map(|_| keys.f32_or("final_logit_softcapping", 0.0))
            .transpose()?,
        activation: Activation::GeluTanhGated,
        ..base
    })
}

/// Gemma 3's RoPE: the global layers' base and scaling, and the sliding layers' base
/// (`rope_local_base_freq`); transformers 5 writes both under "rope_parameters", keyed by
/// layer type.
fn gemma3_rope(keys: &Keys<'_>, max_seq: usize) -> Result<((f32, Option<RopeScaling>), f32)> {
    let theta = |v: &Value| {
        v.get("rope_theta")
            .and_then(Value::as_f64)
            .map(|t| t as f32)
    };
    if let Some(params) = keys
        .get("rope_parameters")
        .filter(|v| v.get("full_attention").is_some())
    {
        let (full, sliding) = (&params["full_attention"], &params["sliding_attention"]);
        let global = (
            theta(full).unwrap_or(1_000_000.0),
            rope_scaling(keys, full, max_seq)?,
        );
        return Ok((global, theta(sliding).unwrap_or(10_000.0)));
    }
    let scaling = match keys.get("rope_scaling") {
        Some(v) => rope_scaling(keys, v, max_seq)?,
        None => None,
    };
    let global = (keys.f32_or("rope_theta", 1_000_000.0)?, scaling);
    Ok((global, keys.f32_or("rope_local_base_freq", 10_000.0)?))
}

/// Which layers slide: "layer_types" (newer configs), or every layer but each
/// "sliding_window_pattern"-th (default 6).
fn sliding_layers(keys: &Keys<'_>, layers: usize) -> Result<Vec<bool>> {
    if let Some(types) = keys.get("layer_types") {
        let kinds: Option<Vec<&str>> = types
            .as_array()
            .and_then(|a| a.iter().map(Value::as_str).collect());
        let bad = || {
            keys.fail(format!("\"layer_types\" is {types}: expected {layers} of \"sliding_attention\" / \"full_attention\""))
        };
        let kinds = kinds.filter(|k| k.len() == layers).ok_or_else(bad)?;
        return kinds
            .iter()
            .map(|k| match *k {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                _ => Err(bad()),
            })
            .collect();
    }
    let pattern = keys
        .opt_usize("sliding_window_pattern")?
        .unwrap_or(6)
        .max(1);
    Ok((0..layers).map(|i| (i + 1) % pattern != 0).collect())
}

/// sqrt(hidden) in the checkpoint's dtype, as Gemma's scaled embedding casts it
/// (`torch_dtype`, or `dtype` in transformers 5; f32 when neither is given).
fn embed_scale(keys: &Keys<'_>, hidden: usize) -> Result<f32> {
    let exact = (hidden as f32).sqrt();
    let dtype = match keys.get("torch_dtype") {
        Some(_) => keys.str_or("torch_dtype", "float32")?,
        None => keys.str_or("dtype", "float32")?,
    };
    Ok(match dtype {
        "bfloat16" => half::bf16::from_f32(exact).to_f32(),
        "float16" => half::f16::from_f32(exact).to_f32(),
        _ => exact,
    })
}

/// BERT's keys over `base`.
fn bert(keys: &Keys<'_>, base: ModelConfig) -> Result<ModelConfig> {
    let kind = keys.str_or("position_embedding_type", "absolute")?;
    if kind != "absolute" {
        return Err(keys.fail(format!(
            "\"position_embedding_type\" is '{kind}', only absolute is supported"
        )));
    }
    let hidden = keys.usize("hidden_size")?;
    let heads = keys.usize("num_attention_heads")?;
    Ok(ModelConfig {
        vocab: keys.usize("vocab_size")?,
        hidden,
        layers: keys.usize("num_hidden_layers")?,
        heads,
        kv_heads: heads,
        head_dim: hidden / heads.max(1),
        ffn: keys.usize("intermediate_size")?,
        max_seq: keys.usize("max_position_embeddings")?,
        norm_eps: keys.f32_or("layer_norm_eps", 1e-12)?,
        tied_head: false,
        activation: gelu_kind(keys, "hidden_act", "gelu")?,
        type_vocab: keys.opt_usize("type_vocab_size")?.unwrap_or(2),
        pooling: Pooling {
            mode: PoolMode::Mean,
            normalize: false,
        },
        ..base
    })
}

/// Parses config.json (`file` is its path, for errors); `name` names the model.
pub fn parse(file: &Path, text: &str, name: &str) -> Result<HfConfig> {
    let json: Value = serde_json::from_str(text).map_err(|e| WgparError::Checkpoint {
        file: file.display().to_string(),
        tensor: None,
        detail: format!("invalid JSON: {e}"),
    })?;
    let keys = Keys { json: &json, file };
    if !json.is_object() {
        return Err(keys.fail("expected a JSON object".into()));
    }
    // Gemma3ForConditionalGeneration: the text model's keys under "text_config".
    let text = multimodal_text(&keys)?;
    let vision = text.is_some();
    let json = text.unwrap_or(json);
    let keys = Keys { json: &json, file };
    let (model_type, arch) = family(&keys)?;
    let base = ModelConfig {
        name: name.to_string(),
        arch,
        ..ModelConfig::default_model()
    };
    let config = match arch {
        Arch::Gpt2 => gpt2(&keys, base)?,
        Arch::Llama if model_type == "gemma3_text" => gemma3(&keys, base)?,
        Arch::Llama => llama(&keys, model_type, base)?,
        Arch::Bert => bert(&keys, base)?,
    };
    if arch != Arch::Llama && config.heads > 0 && config.head_dim * config.heads != config.hidden {
        return Err(keys.fail(format!(
            "hidden size {} is not a multiple of {} heads",
            config.hidden, config.heads
        )));
    }
    config.validate().map_err(|e| keys.fail(e.to_string()))?;
    Ok(HfConfig {
        eos: token_ids(keys.get("eos_token_id")),
        config,
        vision,
    })
}

/// A `Gemma3ForConditionalGeneration` config (`model_type` `gemma3`) as its text model's:
/// `text_config` (transformers' defaults where it is absent) as a `gemma3_text` config, with
/// the top level's `eos_token_id` and `tie_word_embeddings` where the text config lacks them.
/// `None` for any other config. The vision config is not read: wgpar takes no image input.
fn multimodal_text(keys: &Keys) -> Result<Option<Value>> {
    let class = keys
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str);
    let model_type = keys.get("model_type").and_then(Value::as_str);
    let multimodal = match model_type {
        Some(t) => t == "gemma3",
        None => class == Some("Gemma3ForConditionalGeneration"),
    };
    if !multimodal {
        return Ok(None);
    }
    let mut text = match keys.get("text_config") {
        None => serde_json::Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => return Err(keys.fail(format!("\"text_config\" is {v}, expected an object"))),
    };
    let text_type = text.get("model_type").and_then(Value::as_str);
    if text_type.is_some_and(|t| t != "gemma3_text") {
        return Err(keys.fail(format!(
            "\"text_config\" has model_type '{}': a Gemma 3 text model ('gemma3_text') is \
             expected",
            text_type.unwrap_or_default()
        )));
    }
    text.insert("model_type".into(), "gemma3_text".into());
    let dtyped = text.contains_key("torch_dtype") || text.contains_key("dtype");
    for key in [
        "eos_token_id",
        "tie_word_embeddings",
        "torch_dtype",
        "dtype",
    ] {
        let dtype = key.ends_with("dtype");
        if let (false, Some(v)) = (text.contains_key(key) || dtype && dtyped, keys.get(key)) {
            text.insert(key.into(), v.clone());
        }
    }
    Ok(Some(Value::Object(text)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(text: &str) -> Result<HfConfig> {
        parse(Path::new("m/config.json"), text, "m")
    }

    #[test]
    fn gpt2_keys() {
        let c = parse_str(
            r#"{"model_type":"gpt2","vocab_size":50257,"n_embd":768,"n_layer":12,
                "n_head":12,"n_positions":1024,"eos_token_id":50256,"n_inner":null}"#,
        )
        .unwrap();
        assert_eq!(c.config, {
            let mut p = ModelConfig::preset("gpt2-small").unwrap();
            p.name = "m".into();
            p
        });
        assert_eq!(c.eos, vec![50256]);
    }

    #[test]
    fn llama_keys_with_gqa_and_head_dim_default() {
        let c = parse_str(
            r#"{"model_type":"llama","vocab_size":128256,"hidden_size":2048,
                "num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,
                "intermediate_size":8192,"max_position_embeddings":2048,"rope_theta":500000.0,
                "rms_norm_eps":1e-5,"tie_word_embeddings":true,"eos_token_id":[1,2]}"#,
        )
        .unwrap();
        let mut want = ModelConfig::preset("llama-1b").unwrap();
        want.name = "m".into();
        assert_eq!(c.config, want);
        assert_eq!(c.eos, vec![1, 2]);
    }

    /// Issue 29 item 4: Qwen2 attends over the whole context unless "use_sliding_window" is
    /// true; Mistral applies a set window; either may say so explicitly.
    #[test]
    fn sliding_window_caps_the_context_only_where_it_is_used() {
        let cases = [
            ("qwen2", "", 4096),
            ("qwen2", r#""use_sliding_window":false,"#, 4096),
            ("qwen2", r#""use_sliding_window":true,"#, 512),
            ("mistral", "", 512),
            ("mistral", r#""use_sliding_window":false,"#, 4096),
        ];
        for (model_type, flag, want) in cases {
            let c = parse_str(&format!(
                r#"{{"model_type":"{model_type}",{flag}"vocab_size":10,"hidden_size":64,
                    "num_hidden_layers":1,"num_attention_heads":4,"intermediate_size":128,
                    "max_position_embeddings":4096,"sliding_window":512}}"#
            ))
            .unwrap();
            assert_eq!(c.config.max_seq, want, "{model_type} {flag}");
        }
    }

    /// Qwen3: query/key norms always, heads as wide as `head_dim` says (not hidden / heads),
    /// found by `model_type` or by the class alone; its window only under
    /// "use_sliding_window".
    #[test]
    fn qwen3_keys() {
        let keys = r#""vocab_size":151936,"hidden_size":1024,"num_hidden_layers":28,
            "num_attention_heads":16,"num_key_value_heads":8,"head_dim":128,
            "intermediate_size":3072,"max_position_embeddings":40960,"rms_norm_eps":1e-6,
            "rope_theta":1000000,"tie_word_embeddings":true,"sliding_window":4096,
            "use_sliding_window":false,"attention_bias":false"#;
        for head in [
            r#""model_type":"qwen3""#,
            r#""architectures":["Qwen3ForCausalLM"]"#,
        ] {
            let c = parse_str(&format!("{{{head},{keys}}}")).unwrap().config;
            assert!(c.qk_norm && c.tied_head, "{head}");
            assert_eq!((c.head_dim, c.q_dim(), c.hidden), (128, 2048, 1024));
            assert_eq!((c.max_seq, c.norm_eps), (40960, 1e-6));
        }
        let llama = parse_str(&format!(r#"{{"model_type":"llama",{keys}}}"#)).unwrap();
        assert!(!llama.config.qk_norm);
        let windowed = keys.replace(
            r#""use_sliding_window":false"#,
            r#""use_sliding_window":true"#,
        );
        let c = parse_str(&format!(r#"{{"model_type":"qwen3",{windowed}}}"#)).unwrap();
        assert_eq!(c.config.max_seq, 4096);
    }

    /// Phi-4-mini's `partial_rotary_factor` (the RoPE parameters' own first, as Transformers
    /// 5 moves it there) gives the rotated width; Gemma 3 rotates whole heads and refuses one.
    #[test]
    fn partial_rotary_is_read_for_phi3_and_refused_for_gemma3() {
        let phi = r#""model_type":"phi3","vocab_size":10,"hidden_size":128,
            "num_hidden_layers":1,"num_attention_heads":4,"intermediate_size":128"#;
        let c = parse_str(&format!(r#"{{{phi},"partial_rotary_factor":0.75}}"#))
            .unwrap()
            .config;
        assert_eq!((c.head_dim, c.rotary_dim, c.rope_dim()), (32, Some(24), 24));
        let nested = r#""partial_rotary_factor":0.5,
            "rope_parameters":{"rope_type":"default","partial_rotary_factor":0.75}"#;
        let c = parse_str(&format!("{{{phi},{nested}}}")).unwrap().config;
        assert_eq!(c.rotary_dim, Some(24));
        let whole = parse_str(&format!(r#"{{{phi},"partial_rotary_factor":1.0}}"#)).unwrap();
        assert_eq!(whole.config.rotary_dim, None);
        let gemma = r#""model_type":"gemma3_text","vocab_size":10,"hidden_size":64,
            "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,
            "head_dim":32,"intermediate_size":64"#;
        assert_eq!(
            parse_str(&format!("{{{gemma}}}"))
                .unwrap()
                .config
                .rotary_dim,
            None
        );
        for extra in [
            r#""partial_rotary_factor":0.5"#,
            r#""rope_parameters":{"full_attention":{"rope_type":"default",
                "partial_rotary_factor":0.5},"sliding_attention":{"rope_type":"default"}}"#,
        ] {
            let e = parse_str(&format!("{{{gemma},{extra}}}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("Gemma 3 rotates whole heads"), "{e}");
        }
    }

    #[test]
    fn rope_scalings_are_read_and_others_refused_by_name() {
        let base = r#""model_type":"llama","vocab_size":10,"hidden_size":64,
            "num_hidden_layers":1,"num_attention_heads":4,"intermediate_size":128,
            "max_position_embeddings":4096"#;
        let read = |rope: &str| {
            parse_str(&format!(r#"{{{base},"rope_scaling":{rope}}}"#))
                .map(|c| c.config.rope_scaling)
                .map_err(|e| e.to_string())
        };
        let llama3 = read(
            r#"{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,
                "high_freq_factor":4.0,"original_max_position_embeddings":8192}"#,
        );
        let want = Llama3Scaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        };
        assert_eq!(llama3, Ok(Some(RopeScaling::Llama3(want))));
        let linear = read(r#"{"type":"linear","factor":2}"#);
        assert_eq!(linear, Ok(Some(RopeScaling::Linear { factor: 2.0 })));
        assert_eq!(read(r#"{"rope_type":"default"}"#), Ok(None));
        // Qwen2.5's form: the attention factor is 0.1 ln 4 + 1, the betas 32 and 1.
        let yarn = read(r#"{"type":"yarn","factor":4.0,"original_max_position_embeddings":1024}"#);
        let Ok(Some(RopeScaling::Yarn(y))) = yarn else {
            panic!("{yarn:?}")
        };
        assert_eq!((y.factor, y.original_context), (4.0, 1024));
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, true));
        assert!((y.attention_factor as f64 - (1.0 + 0.1 * 4f64.ln())).abs() < 1e-6);
        // DeepSeek's form: factor from the context ratio, the factor a ratio of two mscales.
        let yarn = read(
            r#"{"type":"yarn","original_max_position_embeddings":1024,"mscale":1.0,
                "mscale_all_dim":0.5,"beta_fast":16,"truncate":false}"#,
        );
        let Ok(Some(RopeScaling::Yarn(y))) = yarn else {
            panic!("{yarn:?}")
        };
        let want = (1.0 + 0.1 * 4f64.ln()) / (1.0 + 0.05 * 4f64.ln());
        assert_eq!((y.factor, y.beta_fast, y.truncate), (4.0, 16.0, false));
        assert!((y.attention_factor as f64 - want).abs() < 1e-6, "{y:?}");
        let explicit = read(r#"{"type":"yarn","factor":2,"attention_factor":1.5}"#);
        assert!(matches!(explicit, Ok(Some(RopeScaling::Yarn(y))) if y.attention_factor == 1.5));
        for (rope, want) in [
            (
                r#"{"type":"dynamic","factor":2}"#,
                "type 'dynamic' is not supported",
            ),
            (
                r#"{"rope_type":"longrope","short_factor":[1]}"#,
                "needs a list of numbers \"long_factor\"",
            ),
            (
                r#"{"rope_type":"longrope","short_factor":[1],"long_factor":[1]}"#,
                "LongRoPE short_factor: 1 values for head_dim 16 (needs 8)",
            ),
            (
                r#"{"type":"linear","factor":2,"low_freq_factor":1}"#,
                "key \"low_freq_factor\" is not supported for type 'linear'",
            ),
            (r#"{"type":"linear"}"#, "needs a number \"factor\""),
            (r#"{"type":"linear","factor":-1}"#, "positive finite"),
        ] {
            let e = read(rope).unwrap_err();
            assert!(e.contains(want), "{rope}: {e}");
        }
    }

    #[test]
    fn longrope_resolves_as_transformers_does() {
        // Phi-3-mini-128k's shape of keys: the original context at the top level.
        let phi3 = r#""model_type":"phi3","vocab_size":10,"hidden_size":64,
            "num_hidden_layers":1,"num_attention_heads":4,"intermediate_size":128,
            "max_position_embeddings":131072"#;
        let lists = r#""short_factor":[1,1,1,1,1,1,1,2],"long_factor":[1,2,3,4,5,6,7,8]"#;
        let read = |keys: &str, rope: &str| {
            let c = parse_str(&format!(r#"{{{keys},"rope_scaling":{{{rope},{lists}}}}}"#));
            match c.map(|c| c.config.rope_scaling) {
                Ok(Some(RopeScaling::LongRope(s))) => s,
                other => panic!("{rope}: {other:?}"),
            }
        };
        let magnitude = |factor: f64, original: f64| (1.0 + factor.ln() / original.ln()).sqrt();
        // Phi-3's config defaults the original context to 4096; `su` and `yarn` are longrope.
        for kind in ["longrope", "su", "yarn"] {
            let s = read(phi3, &format!(r#""type":"{kind}""#));
            assert_eq!(
                (s.original_context, s.long_factor[7]),
                (4096, 8.0),
                "{kind}"
            );
            let want = magnitude(32.0, 4096.0);
            assert!((s.attention_factor as f64 - want).abs() < 1e-6, "{kind}");
        }
        let top = format!(r#"{phi3},"original_max_position_embeddings":8192"#);
        let s = read(
            &top,
            r#""type":"longrope","original_max_position_embeddings":2048"#,
        );
        assert_eq!(s.original_context, 8192, "the top-level key wins");
        let s = read(
            phi3,
            r#""type":"longrope","factor":2.0,"attention_factor":1.25"#,
        );
        assert_eq!(s.attention_factor, 1.25);
        // Elsewhere the scaling's own original context, else max_position_embeddings.
        let llama = phi3.replace("phi3", "llama");
        let s = read(
            &llama,
            r#""type":"longrope","original_max_position_embeddings":1024"#,
        );
        let want = magnitude(128.0, 1024.0);
        assert!(
            (
                s.original_context,
                (s.attention_factor as f64 - want).abs() < 1e-6
            ) == (1024, true)
        );
        let s = read(&llama, r#""type":"longrope""#);
        assert_eq!((s.original_context, s.attention_factor), (131_072, 1.0));
    }

    #[test]
    fn rope_parameters_carry_the_base_and_scaling() {
        let c = parse_str(
            r#"{"model_type":"llama","vocab_size":10,"hidden_size":64,
                "num_hidden_layers":1,"num_attention_heads":4,"intermediate_size":128,
                "rope_parameters":{"rope_type":"linear","factor":4.0,"rope_theta":50000.0}}"#,
        )
        .unwrap();
        assert_eq!(c.config.rope_theta, 50_000.0);
        assert_eq!(
            c.config.rope_scaling,
            Some(RopeScaling::Linear { factor: 4.0 })
        );
    }

    #[test]
    fn bert_found_by_architectures() {
        let c = parse_str(
            r#"{"architectures":["BertModel"],"vocab_size":30522,"hidden_size":384,
                "num_hidden_layers":6,"num_attention_heads":12,"intermediate_size":1536,
                "max_position_embeddings":512,"hidden_act":"gelu"}"#,
        )
        .unwrap()
        .config;
        assert_eq!((c.arch, c.head_dim, c.type_vocab), (Arch::Bert, 32, 2));
        assert_eq!((c.activation, c.norm_eps), (Activation::GeluErf, 1e-12));
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let cases = [
            (r#"{"model_type":"t5"}"#, "model_type 't5' is not supported"),
            (
                r#"{"model_type":"gpt2","n_embd":8}"#,
                "\"n_head\" is missing",
            ),
            (
                r#"{"model_type":"gpt2","n_embd":"x"}"#,
                "expected a whole number",
            ),
            (r#"[1]"#, "JSON object"),
            (r#"{"#, "invalid JSON"),
            (r#"{"architectures":["T5Model"]}"#, "no \"model_type\""),
        ];
        for (text, want) in cases {
            let e = parse_str(text).unwrap_err().to_string();
            assert!(e.starts_with("m/config.json: ") && e.contains(want), "{e}");
        }
    }
}
