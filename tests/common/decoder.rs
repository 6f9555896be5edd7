//! What the decoder-family tests (tests/qwen3.rs, tests/gemma3.rs) share: the f64 reference's
//! greedy tokens and per-step logits, an engine checked against them, and bit-exact
//! comparisons of loaded weights and of two models' logits.

use std::sync::Arc;

use wgpar::device::{DType, Gpu};
use wgpar::model::{CpuReference, ModelWeights};
use wgpar::parallel::{generate_keeping, Engine, KeepLogits, SingleEngine};

/// How a family's tests run greedy decoding against the reference.
#[derive(Debug, Clone, Copy)]
pub struct Greedy {
    /// Tokens generated per sequence (the prefill's pick, then decode steps).
    pub steps: usize,
    /// Prompt length (2 prompts, seed 7).
    pub prompt: usize,
    /// Largest relative error of an engine's logits against the f64 reference.
    pub bar: f64,
}

/// Index of the largest value (the first of equals).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The reference's greedy tokens per sequence and its logits per step (prefill first).
pub fn reference(
    w: &ModelWeights,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let mut r = CpuReference::new(w);
    let mut logits = vec![r.prefill(prompts).unwrap().concat()];
    let mut tokens = vec![Vec::new(); prompts.len()];
    let vocab = w.config.vocab;
    for step in 0..steps {
        let next: Vec<u32> = (0..prompts.len())
            .map(|b| argmax(&logits[step][b * vocab..(b + 1) * vocab]))
            .collect();
        for (t, &n) in tokens.iter_mut().zip(&next) {
            t.push(n);
        }
        if step + 1 < steps {
            logits.push(r.decode(&next).unwrap().concat());
        }
    }
    (tokens, logits)
}

/// The engine's greedy generation equals the reference's tokens, and every step's logits are
/// within `run.bar` (and within the final soft-cap where the model sets one); returns the
/// largest error seen.
pub fn check_engine(what: &str, engine: &mut dyn Engine, w: &ModelWeights, run: &Greedy) -> f64 {
    let prompts = super::prompts(2, run.prompt, w.config.vocab, 7);
    let (want_tokens, want_logits) = reference(w, &prompts, run.steps);
    let got = generate_keeping(engine, &prompts, run.steps, KeepLogits::All).unwrap();
    assert_eq!(got.tokens, want_tokens, "{what}: greedy tokens");
    assert_eq!(got.logits.len(), run.steps, "{what}: a logits set per step");
    let mut worst: f64 = 0.0;
    for (step, (g, r)) in got.logits.iter().zip(&want_logits).enumerate() {
        if let Some(cap) = w.config.final_softcap {
            assert!(g.data.iter().all(|v| v.abs() <= cap), "{what} step {step}");
        }
        let err = g.relative_error(r);
        assert!(
            err <= run.bar,
            "{what} step {step}: relative error {err:.2e}"
        );
        worst = worst.max(err);
    }
    worst
}

/// One device running `w` in f32.
pub fn single(gpu: Arc<Gpu>, w: &ModelWeights) -> SingleEngine {
    SingleEngine::new(gpu, w, DType::F32).unwrap()
}

/// The logits of `a` and `b` on one device for prompts of `prompt` tokens, bit for bit (same
/// values, same kernels).
pub fn same_logits(a: &ModelWeights, b: &ModelWeights, prompt: usize) {
    let gpu = super::gpus(1).remove(0);
    let prompts = super::prompts(2, prompt, a.config.vocab, 3);
    let la = single(gpu.clone(), a).prefill(&prompts).unwrap();
    let lb = single(gpu, b).prefill(&prompts).unwrap();
    assert!(la.data.iter().any(|&v| v != 0.0));
    assert_eq!(la, lb);
}

/// Every vector and matrix the device reads, bit for bit after `round` (the rounding of the
/// format the checkpoint stored `want` in): the tables, the tied head, and per layer the
/// norms, projections and whichever optional norms `want` has (which `got` must have too).
pub fn assert_same_weights(got: &ModelWeights, want: &ModelWeights, round: &dyn Fn(f32) -> f32) {
    let same = |x: &[f32], y: &[f32], what: &str| {
        assert_eq!(x.len(), y.len(), "{what}");
        let bad = (x.iter().zip(y)).position(|(a, b)| a.to_bits() != round(*b).to_bits());
        assert!(bad.is_none(), "{what} differs at {bad:?}");
    };
    let got = got.clone().with_dense();
    same(&got.wte, &want.wte, "wte");
    same(&got.final_norm, &want.final_norm, "final norm");
    assert!(got.lm_head.is_none() && got.config.tied_head, "tied head");
    for (i, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
        let pairs = [
            (&g.attn_norm, &w.attn_norm, "attn_norm"),
            (&g.mlp_norm, &w.mlp_norm, "mlp_norm"),
            (&g.wq, &w.wq, "wq"),
            (&g.wk, &w.wk, "wk"),
            (&g.wo, &w.wo, "wo"),
        ];
        for (x, y, what) in pairs {
            same(x, y, &format!("layer {i} {what}"));
        }
        let optional = [
            (&g.w_gate, &w.w_gate, "gate"),
            (&g.q_norm, &w.q_norm, "q_norm"),
            (&g.k_norm, &w.k_norm, "k_norm"),
            (&g.attn_out_norm, &w.attn_out_norm, "attn_out_norm"),
            (&g.mlp_out_norm, &w.mlp_out_norm, "mlp_out_norm"),
        ];
        for (x, y, what) in optional {
            if let Some(y) = y {
                let x = x
                    .as_ref()
                    .unwrap_or_else(|| panic!("layer {i} {what} missing"));
                same(x, y, &format!("layer {i} {what}"));
            }
        }
    }
}
