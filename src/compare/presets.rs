//! Shapes of published models for `wgpar plan`, which needs no weights: 7B to 72B decoders as
//! their Hugging Face `config.json` files give them. (`wgpar plan --model` also reads any such
//! file or folder directly.)

use crate::model::ModelConfig;

/// Names of the plan-only presets.
pub const PLAN_PRESETS: [&str; 11] = [
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-70b",
    "mistral-7b",
    "qwen2-7b",
    "qwen2-72b",
    "qwen3-8b",
    "qwen3-32b",
    "gemma3-1b",
    "gemma3-27b",
];

/// The shape of a published model, from its `config.json`; the rest (a Llama decoder) comes
/// from the `llama-8b` preset.
struct Shape {
    vocab: usize,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    max_seq: usize,
    rope_theta: f32,
    /// Per-head query and key norms (Qwen3).
    qk_norm: bool,
}

/// The published shapes of the plan-only presets (every one has 128-wide heads; Qwen3's are
/// wider than hidden / heads).
const SHAPES: [(&str, Shape); 9] = [
    // meta-llama/Llama-2-7b-hf config.json.
    (
        "llama2-7b",
        Shape {
            vocab: 32_000,
            hidden: 4096,
            layers: 32,
            heads: 32,
            kv_heads: 32,
            ffn: 11_008,
            max_seq: 4096,
            rope_theta: 10_000.0,
            qk_norm: false,
        },
    ),
    // meta-llama/Llama-2-13b-hf config.json.
    (
        "llama2-13b",
        Shape {
            vocab: 32_000,
            hidden: 5120,
            layers: 40,
            heads: 40,
            kv_heads: 40,
            ffn: 13_824,
            max_seq: 4096,
            rope_theta: 10_000.0,
            qk_norm: false,
        },
    ),
    // meta-llama/Llama-2-70b-hf config.json.
    (
        "llama2-70b",
        Shape {
            vocab: 32_000,
            hidden: 8192,
            layers: 80,
            heads: 64,
            kv_heads: 8,
            ffn: 28_672,
            max_seq: 4096,
            rope_theta: 10_000.0,
            qk_norm: false,
        },
    ),
    // meta-llama/Meta-Llama-3-70B config.json.
    (
        "llama3-70b",
        Shape {
            vocab: 128_256,
            hidden: 8192,
            layers: 80,
            heads: 64,
            kv_heads: 8,
            ffn: 28_672,
            max_seq: 8192,
            rope_theta: 500_000.0,
            qk_norm: false,
        },
    ),
    // mistralai/Mistral-7B-v0.1 config.json (sliding window 4096 bounds the context).
    (
        "mistral-7b",
        Shape {
            vocab: 32_000,
            hidden: 4096,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            ffn: 14_336,
            max_seq: 4096,
            rope_theta: 10_000.0,
            qk_norm: false,
        },
    ),
    // Qwen/Qwen2-7B config.json.
    (
        "qwen2-7b",
        Shape {
            vocab: 152_064,
            hidden: 3584,
            layers: 28,
            heads: 28,
            kv_heads: 4,
            ffn: 18_944,
            max_seq: 32_768,
            rope_theta: 1_000_000.0,
            qk_norm: false,
        },
    ),
    // Qwen/Qwen2-72B config.json.
    (
        "qwen2-72b",
        Shape {
            vocab: 152_064,
            hidden: 8192,
            layers: 80,
            heads: 64,
            kv_heads: 8,
            ffn: 29_568,
            max_seq: 32_768,
            rope_theta: 1_000_000.0,
            qk_norm: false,
        },
    ),
    // Qwen/Qwen3-8B config.json (untied head).
    (
        "qwen3-8b",
        Shape {
            vocab: 151_936,
            hidden: 4096,
            layers: 36,
            heads: 32,
            kv_heads: 8,
            ffn: 12_288,
            max_seq: 40_960,
            rope_theta: 1_000_000.0,
            qk_norm: true,
        },
    ),
    // Qwen/Qwen3-32B config.json: 64 heads of 128 over a stream of 5120.
    (
        "qwen3-32b",
        Shape {
            vocab: 151_936,
            hidden: 5120,
            layers: 64,
            heads: 64,
            kv_heads: 8,
            ffn: 25_600,
            max_seq: 40_960,
            rope_theta: 1_000_000.0,
            qk_norm: true,
        },
    ),
];

/// A plan-only preset by name.
pub fn plan_preset(name: &str) -> Option<ModelConfig> {
    // Gemma 3's sliding layers and other features are the model module's to describe.
    match name {
        "gemma3-1b" => return Some(ModelConfig::gemma3_1b()),
        "gemma3-27b" => return Some(ModelConfig::gemma3_27b()),
        _ => {}
    }
    let base = ModelConfig::preset("llama-8b").ok()?;
    let (_, s) = SHAPES.iter().find(|(n, _)| *n == name)?;
    let c = ModelConfig {
        name: name.into(),
        vocab: s.vocab,
        hidden: s.hidden,
        layers: s.layers,
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: 128,
        ffn: s.ffn,
        max_seq: s.max_seq,
        rope_theta: s.rope_theta,
        norm_eps: if s.qk_norm { 1e-6 } else { base.norm_eps },
        qk_norm: s.qk_norm,
        ..base
    };
    c.validate().ok()?;
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_have_their_published_sizes() {
        for name in PLAN_PRESETS {
            assert!(plan_preset(name).is_some(), "{name}");
        }
        let b = |n: &str| plan_preset(n).unwrap().params() as f64 / 1e9;
        assert!((6.6..6.9).contains(&b("llama2-7b")), "{}", b("llama2-7b"));
        assert!(
            (12.8..13.2).contains(&b("llama2-13b")),
            "{}",
            b("llama2-13b")
        );
        assert!(
            (68.5..69.5).contains(&b("llama2-70b")),
            "{}",
            b("llama2-70b")
        );
        assert!((7.0..7.5).contains(&b("mistral-7b")), "{}", b("mistral-7b"));
        // Qwen3-8B is 8.19B and Qwen3-32B 32.8B with their untied heads.
        assert!((8.1..8.3).contains(&b("qwen3-8b")), "{}", b("qwen3-8b"));
        assert!((32.6..33.0).contains(&b("qwen3-32b")), "{}", b("qwen3-32b"));
        let q = plan_preset("qwen3-32b").unwrap();
        assert!(q.qk_norm && q.q_dim() == 8192 && q.hidden == 5120);
        assert!(plan_preset("gpt-5").is_none());
    }
}
