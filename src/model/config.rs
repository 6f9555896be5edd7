//! Model shapes: the two decoder families, the encoder family, and their presets.

use serde::{Deserialize, Serialize};

use crate::error::{Result, WgparError};
use crate::kernels::ops::KV_BLOCK;

/// Model family: which block structure the layers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2: pre-LayerNorm, GELU MLP, learned positions, biases, tied LM head.
    Gpt2,
    /// Llama: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, no biases.
    Llama,
    /// BERT encoder: LayerNorm after each residual (post-norm), bidirectional attention,
    /// learned positions and token types, a LayerNorm on the embeddings, biases, GELU MLP,
    /// and pooling instead of an LM head.
    Bert,
}

/// The MLP's non-linearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Activation {
    /// GELU, tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    /// GELU, exact erf form (BERT's `gelu`).
    GeluErf,
    /// SiLU gating a second projection (SwiGLU, Llama).
    Silu,
    /// GELU (tanh approximation) gating a second projection (GeGLU, Gemma's
    /// `gelu_pytorch_tanh`).
    GeluTanhGated,
}

/// Sliding-window attention on some layers (Gemma 3): a token there sees only the `window`
/// positions ending at its own, and those layers rotate with their own RoPE base.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlidingWindow {
    /// Positions a token sees on a sliding layer, its own included.
    pub window: usize,
    /// Per layer: whether it slides (the others attend to the whole context).
    pub layers: Vec<bool>,
    /// RoPE base of the sliding layers (unscaled; `rope_theta` and `rope_scaling` are the
    /// global layers').
    pub rope_theta: f32,
}

/// How an encoder reduces its token states to one vector per sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    /// Mean over the sequence's (non-padding) tokens.
    Mean,
    /// The first token's state (BERT's `[CLS]`).
    Cls,
}

pub use super::rope::{Llama3Scaling, LongRopeScaling, RopeScaling, YarnScaling};

/// An encoder's pooling step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pooling {
    /// Which reduction.
    pub mode: PoolMode,
    /// Scale each pooled vector to unit L2 norm (sentence-transformers' `Normalize` module).
    pub normalize: bool,
}

/// Every shape a forward pass needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Preset or model name.
    pub name: String,
    /// Block structure.
    pub arch: Arch,
    /// Vocabulary size.
    pub vocab: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (equal to `heads` without grouped-query attention).
    pub kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// MLP inner width.
    pub ffn: usize,
    /// Longest sequence (prompt + generated) the KV cache and positions allow.
    pub max_seq: usize,
    /// Normalisation epsilon.
    pub norm_eps: f32,
    /// RoPE base frequency (Llama).
    pub rope_theta: f32,
    /// RoPE frequency scaling for contexts past the trained one (linear, Llama 3, YaRN), if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Dimensions of each head RoPE rotates, the first ones (Phi-4-mini's
    /// `partial_rotary_factor` 0.75, GGUF `rope.dimension_count`); the rest pass through.
    /// `None`: the whole head. Even and at most `head_dim` when set.
    #[serde(default)]
    pub rotary_dim: Option<usize>,
    /// Per-pair RoPE frequency divisors (`rope_dim() / 2` values, GGUF `rope_freqs.weight` of
    /// Llama 3.1 / 3.2 files), if the checkpoint carries them.
    #[serde(default)]
    pub rope_freq_factors: Option<Vec<f32>>,
    /// LM head shares the token embedding matrix.
    pub tied_head: bool,
    /// Each query and key head is RMS-normalised (a `[head_dim]` scale shared by the heads,
    /// the model's `norm_eps`) after its projection and before RoPE (Qwen3's `q_norm` and
    /// `k_norm`).
    #[serde(default)]
    pub qk_norm: bool,
    /// The token embeddings are multiplied by this (Gemma: sqrt(hidden), in the checkpoint's
    /// dtype) before the first layer; the tied head reads the table unscaled.
    #[serde(default)]
    pub embed_scale: Option<f32>,
    /// Each block's output is RMS-normalised before its residual add (Gemma's
    /// `post_attention_layernorm` / `post_feedforward_layernorm`), besides the norm before it.
    #[serde(default)]
    pub sandwich_norms: bool,
    /// Attention score scale instead of 1/sqrt(head_dim) (Gemma: `query_pre_attn_scalar`^-1/2).
    #[serde(default)]
    pub attn_scale: Option<f32>,
    /// Sliding-window layers, if the model has them.
    #[serde(default)]
    pub sliding: Option<SlidingWindow>,
    /// Final logits become `cap * tanh(logits / cap)` (Gemma's `final_logit_softcapping`).
    #[serde(default)]
    pub final_softcap: Option<f32>,
    /// MLP non-linearity (a gated one, `Silu` or `GeluTanhGated`, exactly for Llama).
    pub activation: Activation,
    /// Token type (segment) vocabulary: BERT's sentence A/B embeddings; 0 for decoders.
    pub type_vocab: usize,
    /// Pooling of an encoder's output (ignored by decoders).
    pub pooling: Pooling,
}

/// Names of the built-in presets, for `--model` help and errors.
pub const PRESETS: [&str; 9] = [
    "default",
    "tiny-llama",
    "tiny-qwen3",
    "tiny-gemma3",
    "tiny-gpt2",
    "tiny-bert",
    "gpt2-small",
    "llama-1b",
    "llama-8b",
];

impl ModelConfig {
    /// The model `wgpar` runs with no arguments: Llama-shaped, small enough for seconds on a
    /// CPU Vulkan driver, and with 12 query / 4 KV heads so it splits over 2 and 4 devices.
    pub fn default_model() -> Self {
        Self {
            name: "default".into(),
            arch: Arch::Llama,
            vocab: 8192,
            hidden: 384,
            layers: 6,
            heads: 12,
            kv_heads: 4,
            head_dim: 32,
            ffn: 1024,
            max_seq: 256,
            norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rotary_dim: None,
            rope_freq_factors: None,
            tied_head: false,
            qk_norm: false,
            embed_scale: None,
            sandwich_norms: false,
            attn_scale: None,
            sliding: None,
            final_softcap: None,
            activation: Activation::Silu,
            type_vocab: 0,
            pooling: Pooling {
                mode: PoolMode::Mean,
                normalize: false,
            },
        }
    }

    /// A preset by name.
    pub fn preset(name: &str) -> Result<Self> {
        let base = Self::default_model();
        let cfg = match name {
            "default" => base,
            "tiny-llama" => Self::tiny_llama(base),
            "tiny-qwen3" => Self::tiny_qwen3(base),
            "tiny-gemma3" => Self::tiny_gemma3(base),
            "tiny-gpt2" => Self::tiny_gpt2(base),
            "tiny-bert" => Self::tiny_bert(base),
            "gpt2-small" => Self::gpt2_small(base),
            "llama-1b" => Self::llama_1b(base),
            "llama-8b" => Self::llama_8b(base),
            other => {
                return Err(WgparError::UnknownModel {
                    name: other.to_string(),
                    presets: PRESETS.join(", "),
                })
            }
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The `tiny-llama` preset.
    fn tiny_llama(base: Self) -> Self {
        Self {
            name: "tiny-llama".into(),
            vocab: 389,
            hidden: 96,
            layers: 2,
            heads: 6,
            kv_heads: 2,
            head_dim: 16,
            ffn: 172,
            max_seq: 96,
            ..base
        }
    }

    /// Qwen3-shaped, smaller: query/key norms, a tied head, and heads wider than
    /// hidden / heads (4 heads of 32 over a stream of 96), as Qwen3-0.6B has (16 x 128 over
    /// 1024).
    fn tiny_qwen3(base: Self) -> Self {
        Self {
            name: "tiny-qwen3".into(),
            vocab: 413,
            hidden: 96,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            ffn: 192,
            max_seq: 96,
            norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tied_head: true,
            qk_norm: true,
            ..base
        }
    }

    /// Gemma-3-shaped, smaller: scaled embeddings, sandwich norms, GeGLU, query/key norms,
    /// a query scale that is not 1/sqrt(head_dim), heads wider than hidden / heads, and
    /// sliding-window layers (window 5) around every third, global one, which rotates with
    /// its own base. Gemma 3 has no final soft-capping; tests set one.
    fn tiny_gemma3(base: Self) -> Self {
        let layers = 3;
        Self {
            name: "tiny-gemma3".into(),
            vocab: 419,
            hidden: 80,
            layers,
            heads: 4,
            kv_heads: 2,
            head_dim: 24,
            ffn: 176,
            max_seq: 96,
            norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tied_head: true,
            qk_norm: true,
            embed_scale: Some((80f32).sqrt()),
            sandwich_norms: true,
            attn_scale: Some(1.0 / 20f32.sqrt()),
            sliding: Some(SlidingWindow {
                window: 5,
                layers: (0..layers).map(|i| (i + 1) % 3 != 0).collect(),
                rope_theta: 10_000.0,
            }),
            activation: Activation::GeluTanhGated,
            ..base
        }
    }

    /// Gemma 3 1B's text model (google/gemma-3-1b-pt config.json), for `plan`.
    pub fn gemma3_1b() -> Self {
        Self::gemma3_shape(
            "gemma3-1b",
            [262_144, 1152, 26, 4, 1, 256, 6912, 32_768, 512],
            256,
        )
    }

    /// Gemma 3 27B's text model (google/gemma-3-27b-pt text_config; its vision tower not
    /// counted), for `plan`: global layers' RoPE scaled linearly by 8.
    pub fn gemma3_27b() -> Self {
        let shape = [262_208, 5376, 62, 32, 16, 128, 21_504, 131_072, 1024];
        Self {
            rope_scaling: Some(RopeScaling::Linear { factor: 8.0 }),
            ..Self::gemma3_shape("gemma3-27b", shape, 168)
        }
    }

    /// A Gemma 3 text model of `[vocab, hidden, layers, heads, kv_heads, head_dim, ffn,
    /// max_seq, sliding window]` and `query_pre_attn_scalar`: every sixth layer global.
    fn gemma3_shape(name: &str, s: [usize; 9], query_scalar: usize) -> Self {
        let [vocab, hidden, layers, heads, kv_heads, head_dim, ffn, max_seq, window] = s;
        Self {
            name: name.into(),
            vocab,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            ffn,
            max_seq,
            sliding: Some(SlidingWindow {
                window,
                layers: (0..layers).map(|i| (i + 1) % 6 != 0).collect(),
                rope_theta: 10_000.0,
            }),
            embed_scale: Some((hidden as f32).sqrt()),
            attn_scale: Some(1.0 / (query_scalar as f32).sqrt()),
            ..Self::tiny_gemma3(Self::default_model())
        }
    }

    /// The `tiny-gpt2` preset.
    fn tiny_gpt2(base: Self) -> Self {
        Self {
            name: "tiny-gpt2".into(),
            arch: Arch::Gpt2,
            vocab: 411,
            hidden: 96,
            layers: 2,
            heads: 6,
            kv_heads: 6,
            head_dim: 16,
            ffn: 384,
            max_seq: 96,
            tied_head: true,
            activation: Activation::GeluTanh,
            ..base
        }
    }

    /// MiniLM-shaped encoder, smaller: post-norm, bidirectional, two token types.
    fn tiny_bert(base: Self) -> Self {
        Self {
            name: "tiny-bert".into(),
            arch: Arch::Bert,
            vocab: 397,
            hidden: 96,
            layers: 2,
            heads: 6,
            kv_heads: 6,
            head_dim: 16,
            ffn: 384,
            max_seq: 64,
            norm_eps: 1e-12,
            activation: Activation::GeluErf,
            type_vocab: 2,
            pooling: Pooling {
                mode: PoolMode::Mean,
                normalize: true,
            },
            ..base
        }
    }

    /// The `gpt2-small` preset.
    fn gpt2_small(base: Self) -> Self {
        Self {
            name: "gpt2-small".into(),
            arch: Arch::Gpt2,
            vocab: 50_257,
            hidden: 768,
            layers: 12,
            heads: 12,
            kv_heads: 12,
            head_dim: 64,
            ffn: 3072,
            max_seq: 1024,
            tied_head: true,
            activation: Activation::GeluTanh,
            ..base
        }
    }

    /// Llama 3.2 1B shapes.
    fn llama_1b(base: Self) -> Self {
        Self {
            name: "llama-1b".into(),
            vocab: 128_256,
            hidden: 2048,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            max_seq: 2048,
            rope_theta: 500_000.0,
            tied_head: true,
            ..base
        }
    }

    /// Llama 3.1 8B shapes (for projections; too large to run on a CPU driver).
    fn llama_8b(base: Self) -> Self {
        Self {
            name: "llama-8b".into(),
            vocab: 128_256,
            hidden: 4096,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14_336,
            max_seq: 2048,
            rope_theta: 500_000.0,
            ..base
        }
    }

    /// Checks that the shapes fit together.
    pub fn validate(&self) -> Result<()> {
        let problem = self
            .dims_problem()
            .or_else(|| self.numerics_problem())
            .or_else(|| self.size_problem())
            .or_else(|| self.structure_problem());
        match problem {
            Some(m) => Err(WgparError::model(
                self.name.clone(),
                "shapes",
                format!("model '{}': {m}", self.name),
            )),
            None => Ok(()),
        }
    }

    /// What is wrong with the dimensions themselves (zero, heads that do not group, head
    /// sizes the kernels cannot take), if anything.
    fn dims_problem(&self) -> Option<String> {
        if self.vocab == 0 || self.hidden == 0 || self.layers == 0 || self.ffn == 0 {
            return Some("vocab, hidden, layers and ffn must be positive".into());
        }
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Some(format!(
                "{} query heads must be a positive multiple of {} kv heads",
                self.heads, self.kv_heads
            ));
        }
        if self.head_dim == 0 || self.head_dim > 256 {
            return Some(format!("head_dim {} outside 1..=256", self.head_dim));
        }
        if self.arch == Arch::Llama {
            if let Some(m) = self.rotary_problem() {
                return Some(m);
            }
        }
        if self.max_seq == 0 {
            return Some("max_seq must be positive".into());
        }
        None
    }

    /// What is wrong with the rotated part of each head (RoPE turns pairs `i`, `i + rot / 2`).
    fn rotary_problem(&self) -> Option<String> {
        match self.rotary_dim {
            None if !self.head_dim.is_multiple_of(2) => Some(format!(
                "RoPE needs an even head_dim, got {}",
                self.head_dim
            )),
            Some(r) if r == 0 || r > self.head_dim || !r.is_multiple_of(2) => Some(format!(
                "RoPE over {r} dimensions of heads of {}: must be even, positive and at most \
                 the head",
                self.head_dim
            )),
            _ => None,
        }
    }

    /// Dimensions of each head RoPE rotates: `rotary_dim`, else the whole head.
    pub fn rope_dim(&self) -> usize {
        self.rotary_dim.unwrap_or(self.head_dim)
    }

    /// What is wrong with the norm epsilon and the RoPE parameters, if anything.
    fn numerics_problem(&self) -> Option<String> {
        // A negative, zero or non-finite epsilon divides by zero or flips signs in every norm;
        // a non-positive RoPE base makes every rotation NaN: the output would be garbage.
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Some(format!(
                "normalisation epsilon {} must be a positive finite number (typically 1e-5 to \
                 1e-12)",
                self.norm_eps
            ));
        }
        if self.arch == Arch::Llama && !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Some(format!(
                "rope_theta {} must be a positive finite number (typically 10000 or 500000)",
                self.rope_theta
            ));
        }
        if self.arch == Arch::Llama {
            return super::rope::problem(self);
        }
        None
    }

    /// Sizes computed from the shapes (elements of one matrix, parameters, FLOPs) must not
    /// overflow: every product is bounded by 2^48 elements, far beyond any device.
    fn size_problem(&self) -> Option<String> {
        const LIMIT: u64 = 1 << 48;
        let product = |dims: &[usize]| {
            dims.iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
                .is_some_and(|p| p <= LIMIT)
        };
        let fits = product(&[self.vocab, self.hidden])
            && product(&[self.max_seq, self.hidden])
            && product(&[self.ffn, self.hidden])
            && product(&[self.heads, self.head_dim, self.max_seq])
            && product(&[self.heads, self.head_dim, self.hidden])
            && product(&[self.type_vocab, self.hidden])
            // The parameter count sums every layer's matrices.
            && product(&[self.layers, self.ffn, self.hidden])
            && product(&[self.layers, self.heads, self.head_dim, self.hidden]);
        (!fits).then(|| {
            format!(
                "shapes beyond any device: layers {}, vocab {}, hidden {}, ffn {}, heads {}, \
                 max_seq {}",
                self.layers, self.vocab, self.hidden, self.ffn, self.heads, self.max_seq
            )
        })
    }

    /// Whether the activation fits the architecture's blocks and an encoder has token types.
    fn structure_problem(&self) -> Option<String> {
        if self.gated() != (self.arch == Arch::Llama) {
            return Some(format!(
                "{:?} activation does not fit the {:?} block structure (only Llama gates, \
                 with SiLU or tanh GELU)",
                self.activation, self.arch
            ));
        }
        if self.arch != Arch::Llama && self.has_gemma_features() {
            return Some(format!(
                "embedding scale, sandwich norms, attention scale, sliding windows and \
                 soft-capping apply to the Llama block structure (Gemma 3), not {:?}",
                self.arch
            ));
        }
        if let Some(m) = self.gemma_problem() {
            return Some(m);
        }
        if self.arch == Arch::Bert && self.type_vocab == 0 {
            return Some("a BERT encoder needs at least one token type".into());
        }
        if self.qk_norm && self.arch != Arch::Llama {
            return Some(format!(
                "query/key norms apply to the Llama block structure (Qwen3), not {:?}",
                self.arch
            ));
        }
        None
    }

    /// Whether the MLP gates its up projection (SwiGLU, GeGLU).
    pub fn gated(&self) -> bool {
        matches!(
            self.activation,
            Activation::Silu | Activation::GeluTanhGated
        )
    }

    /// Whether any Gemma-style feature is set.
    fn has_gemma_features(&self) -> bool {
        self.embed_scale.is_some()
            || self.sandwich_norms
            || self.attn_scale.is_some()
            || self.sliding.is_some()
            || self.final_softcap.is_some()
    }

    /// What is wrong with the Gemma-style values (scales, caps, the window's layers).
    fn gemma_problem(&self) -> Option<String> {
        let positive = |v: Option<f32>| v.is_none_or(|v| v.is_finite() && v > 0.0);
        if !positive(self.embed_scale) || !positive(self.attn_scale) {
            return Some(format!(
                "embedding scale {:?} and attention scale {:?} must be positive and finite",
                self.embed_scale, self.attn_scale
            ));
        }
        if !positive(self.final_softcap) {
            return Some(format!(
                "final logit soft-cap {:?} must be positive and finite",
                self.final_softcap
            ));
        }
        let s = self.sliding.as_ref()?;
        if s.window == 0 || s.layers.len() != self.layers {
            return Some(format!(
                "sliding window {} over {} layer flags, for {} layers (window must be positive)",
                s.window,
                s.layers.len(),
                self.layers
            ));
        }
        if !(s.rope_theta.is_finite() && s.rope_theta > 0.0) {
            return Some(format!(
                "sliding layers' rope_theta {} must be a positive finite number",
                s.rope_theta
            ));
        }
        None
    }

    /// Layer `i`'s attention window (positions a token sees, its own included), if it slides.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let s = self.sliding.as_ref()?;
        s.layers
            .get(i)
            .copied()
            .unwrap_or(false)
            .then_some(s.window)
    }

    /// The most new positions one step may write per sequence (a prefill chunk), where the
    /// model has ring layers: a sliding window rounded up to whole KV blocks. `None`: no
    /// bound (every layer's cache holds the whole context).
    pub fn ring_step(&self) -> Option<usize> {
        let s = self.sliding.as_ref()?;
        let step = s.window.div_ceil(KV_BLOCK) * KV_BLOCK;
        // A ring as long as the context saves nothing: the layer stays paged.
        (s.layers.iter().any(|&on| on) && ring_rows(s.window, step) < self.max_seq).then_some(step)
    }

    /// The rows a sliding layer's cache keeps per slot (a ring: position p at row p % rows),
    /// where layer `i` has one: its window less one plus [`Self::ring_step`], in whole KV
    /// blocks; every key a step's queries see is then still there after the step's writes.
    pub fn layer_ring(&self, i: usize) -> Option<usize> {
        let window = self.layer_window(i)?;
        Some(ring_rows(window, self.ring_step()?))
    }

    /// Positions layer `i`'s KV cache holds per slot: its ring ([`Self::layer_ring`]), or
    /// `max_seq`. What the engines allocate and the memory accounting counts.
    pub fn cached_positions(&self, i: usize) -> usize {
        self.layer_ring(i).unwrap_or(self.max_seq)
    }

    /// The config the sliding layers' RoPE tables come from: their own base, no scaling and
    /// no per-pair factors. `None` without sliding layers.
    pub fn local_rope(&self) -> Option<ModelConfig> {
        let s = self.sliding.as_ref()?;
        Some(ModelConfig {
            rope_theta: s.rope_theta,
            rope_scaling: None,
            rope_freq_factors: None,
            ..self.clone()
        })
    }

    /// Whether this is an encoder (pooled output, no LM head, no generation).
    pub fn is_encoder(&self) -> bool {
        self.arch == Arch::Bert
    }

    /// Whether a token attends only to earlier positions (decoders) or to the whole sequence.
    pub fn causal(&self) -> bool {
        !self.is_encoder()
    }

    /// Whether each residual is followed by a norm (BERT) instead of each block starting with
    /// one (GPT-2, Llama).
    pub fn post_norm(&self) -> bool {
        self.arch == Arch::Bert
    }

    /// Whether positions are a learned table added to the embeddings (not RoPE).
    pub fn learned_positions(&self) -> bool {
        self.arch != Arch::Llama
    }

    /// Query projection width (heads x head_dim).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Key (or value) projection width.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Parameters in one decoder layer.
    pub fn layer_params(&self) -> usize {
        let h = self.hidden;
        let attn = h * self.q_dim() * 2 + h * self.kv_dim() * 2;
        let mlp = match self.arch {
            Arch::Gpt2 | Arch::Bert => 2 * h * self.ffn,
            Arch::Llama => 3 * h * self.ffn,
        };
        let qk_norms = if self.qk_norm { 2 * self.head_dim } else { 0 };
        let out_norms = if self.sandwich_norms { 2 * h } else { 0 };
        attn + mlp + 4 * h + qk_norms + out_norms
    }

    /// Where `plan`'s figures for this model count what wgpar holds today rather than what the
    /// model needs: `None` when nowhere. The cost models (`plan`'s projection, the engines' span
    /// accounting) charge Gemma 3's sliding-window layers the keys of their window and its
    /// extra elementwise passes, and the memory columns count a sliding layer's KV cache over
    /// its ring ([`Self::cached_positions`]), as the engines allocate it: nothing is left.
    pub fn cost_model_gaps(&self) -> Option<String> {
        None
    }

    /// All parameters (embeddings and head included).
    pub fn params(&self) -> usize {
        let emb = self.vocab * self.hidden;
        let pos = if self.learned_positions() {
            (self.max_seq + self.type_vocab) * self.hidden
        } else {
            0
        };
        let head = if self.tied_head || self.is_encoder() {
            0
        } else {
            emb
        };
        emb + pos + head + self.layers * self.layer_params()
    }

    /// Multiply-add FLOPs (2 per MAC) of one layer's matmuls for `tokens` new tokens; attention
    /// score FLOPs for `context` keys per token are added.
    pub fn layer_flops(&self, tokens: usize, context: usize) -> u64 {
        let h = self.hidden as u64;
        let t = tokens as u64;
        let proj = 2 * t * h * (2 * self.q_dim() + 2 * self.kv_dim()) as u64;
        let mlp = match self.arch {
            Arch::Gpt2 | Arch::Bert => 2 * t * 2 * h * self.ffn as u64,
            Arch::Llama => 2 * t * 3 * h * self.ffn as u64,
        };
        let attn = 2 * 2 * t * context as u64 * self.q_dim() as u64;
        proj + mlp + attn
    }
}

/// Rows of a ring holding a `window` and `step` new positions (every key a step's queries
/// see survives the step's writes), in whole KV blocks.
fn ring_rows(window: usize, step: usize) -> usize {
    (window - 1 + step).div_ceil(KV_BLOCK) * KV_BLOCK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid() {
        for name in PRESETS {
            ModelConfig::preset(name).unwrap();
        }
    }

    #[test]
    fn cost_model_gaps_name_nothing_once_sliding_layers_cache_their_ring() {
        for c in [
            ModelConfig::preset("tiny-llama").unwrap(),
            ModelConfig::gemma3_1b(),
            ModelConfig::gemma3_27b(),
        ] {
            assert_eq!(c.cost_model_gaps(), None, "{}", c.name);
        }
    }

    #[test]
    fn a_sliding_layer_caches_its_window_and_one_step() {
        // Gemma 3 1B: window 512, a step of 512, 1023 rows in whole blocks: 1024.
        let g = ModelConfig::gemma3_1b();
        assert_eq!(g.ring_step(), Some(512));
        assert_eq!(g.cached_positions(0), 1024);
        assert_eq!(g.layer_ring(5), None, "layer 5 is global");
        assert_eq!(g.cached_positions(5), 32_768);
        // tiny-gemma3: window 5, a step of one block (16), 20 rows: 32 of 96.
        let t = ModelConfig::preset("tiny-gemma3").unwrap();
        assert_eq!((t.ring_step(), t.cached_positions(0)), (Some(16), 32));
        assert_eq!(t.cached_positions(2), t.max_seq);
        // A ring as long as the context saves nothing: the layers stay paged, no step bound.
        let short = ModelConfig { max_seq: 32, ..t };
        assert_eq!((short.ring_step(), short.cached_positions(0)), (None, 32));
        let llama = ModelConfig::preset("tiny-llama").unwrap();
        assert_eq!(llama.ring_step(), None);
        assert_eq!(llama.cached_positions(0), llama.max_seq);
    }

    #[test]
    fn partial_rotary_must_be_even_and_within_the_head() {
        let base = ModelConfig::preset("tiny-llama").unwrap();
        let with = |r: usize| ModelConfig {
            rotary_dim: Some(r),
            ..base.clone()
        };
        assert_eq!(with(12).rope_dim(), 12);
        assert_eq!(base.rope_dim(), 16);
        with(12).validate().unwrap();
        for bad in [0, 7, 18] {
            let e = with(bad).validate().unwrap_err().to_string();
            assert!(e.contains(&format!("RoPE over {bad} dimensions")), "{e}");
        }
        // An odd head is fine when its rotated part is even.
        let odd = ModelConfig {
            head_dim: 15,
            ..with(12)
        };
        odd.validate().unwrap();
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let e = ModelConfig::preset("gpt5").unwrap_err().to_string();
        assert!(e.contains("tiny-llama") && e.contains("gpt5"), "{e}");
        assert!(!e.contains("invalid configuration"), "{e}");
    }

    #[test]
    fn activation_must_fit_the_arch() {
        let bad = ModelConfig {
            activation: Activation::GeluTanh,
            ..ModelConfig::preset("tiny-llama").unwrap()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("GeluTanh") && e.contains("Llama"), "{e}");
        let bert = ModelConfig::preset("tiny-bert").unwrap();
        assert!(bert.is_encoder() && bert.post_norm() && !bert.causal());
        let no_types = ModelConfig {
            type_vocab: 0,
            ..bert
        };
        assert!(no_types.validate().is_err());
    }

    #[test]
    fn gemma3_shapes_have_their_published_sizes() {
        // Gemma 3 1B is 1.0B parameters, the 27B's text model 27.0B (tied heads).
        let b = |c: ModelConfig| {
            c.validate().unwrap();
            c.params() as f64 / 1e9
        };
        assert!((0.99..1.01).contains(&b(ModelConfig::gemma3_1b())));
        assert!((26.9..27.1).contains(&b(ModelConfig::gemma3_27b())));
        let c = ModelConfig::gemma3_27b();
        assert_eq!((c.layer_window(4), c.layer_window(5)), (Some(1024), None));
        assert_eq!(c.final_softcap, None);
    }

    #[test]
    fn gpt2_small_has_124m_parameters() {
        let p = ModelConfig::preset("gpt2-small").unwrap().params();
        // 124.4M with learned positions and a tied head.
        assert!((124_000_000..125_000_000).contains(&p), "{p}");
    }
}
