//! The CPU reference forward pass: plain loops, f64 accumulation, the oracle every GPU test
//! compares against. Deliberately simple rather than fast.

use std::borrow::Cow;
use std::sync::Arc;

use super::config::{Activation, Arch, ModelConfig};
use super::rope::frequencies;
use super::weights::{LayerWeights, ModelWeights};
use crate::error::{Result, WgparError};

/// A CPU model with its own KV cache, mirroring the GPU engines' prefill/decode API, and
/// a per-sequence path ([`CpuReference::step`]) in which every sequence has its own KV slot
/// and past length, as the GPU's sequence table allows.
pub struct CpuReference<'a> {
    /// The weights, with dense values for every matrix (a copy, filled in, when some are held
    /// in a file's blocks alone), shared so a step can read them while it fills the cache.
    pub(super) weights: Arc<Cow<'a, ModelWeights>>,
    /// Per layer: keys and values, `[slot][kv_heads][position][head_dim]` flattened.
    k_cache: Vec<Vec<f64>>,
    v_cache: Vec<Vec<f64>>,
    /// Tokens cached per slot.
    past: Vec<usize>,
    /// Keys and values are rounded to f16 as they are cached (an f16 KV cache).
    f16_cache: bool,
}

pub(super) fn linear(
    x: &[f64],
    w: &[f32],
    bias: Option<&[f32]>,
    out_dim: usize,
    in_dim: usize,
) -> Vec<f64> {
    (0..out_dim)
        .map(|o| {
            let row = &w[o * in_dim..(o + 1) * in_dim];
            let dot: f64 = row.iter().zip(x).map(|(&a, &b)| a as f64 * b).sum();
            dot + bias.map_or(0.0, |b| b[o] as f64)
        })
        .collect()
}

pub(super) fn layer_norm(x: &[f64], gamma: &[f32], beta: Option<&[f32]>, eps: f32) -> Vec<f64> {
    let n = x.len() as f64;
    match beta {
        Some(beta) => {
            let mean = x.iter().sum::<f64>() / n;
            let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
            let inv = 1.0 / (var + eps as f64).sqrt();
            x.iter()
                .enumerate()
                .map(|(i, v)| (v - mean) * inv * gamma[i] as f64 + beta[i] as f64)
                .collect()
        }
        None => {
            let ms = x.iter().map(|v| v * v).sum::<f64>() / n;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            x.iter()
                .enumerate()
                .map(|(i, v)| v * inv * gamma[i] as f64)
                .collect()
        }
    }
}

/// GELU, tanh approximation (GPT-2).
pub fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + (0.797_884_560_802_865_4 * (x + 0.044_715 * x * x * x)).tanh())
}

/// GELU, exact form 0.5 x (1 + erf(x / sqrt 2)) (BERT).
pub fn gelu_erf(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x * std::f64::consts::FRAC_1_SQRT_2))
}

/// The error function to about 1e-14: its Maclaurin series near zero, where it converges
/// fast, and a continued fraction for erfc further out, where the series would cancel.
pub fn erf(x: f64) -> f64 {
    let a = x.abs();
    let value = if a < 2.5 {
        let (mut term, mut sum, mut n) = (a, a, 0.0);
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -a * a / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else if a < 6.0 {
        // erfc(a) = exp(-a^2) / sqrt(pi) / (a + (1/2) / (a + 1 / (a + (3/2) / (a + ...)))),
        // evaluated from the tail.
        let mut t = a;
        for k in (1..=80).rev() {
            t = a + (k as f64 / 2.0) / t;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * t)
    } else {
        1.0
    };
    value.copysign(x)
}

/// The MLP non-linearity of a non-gated family.
fn activate(activation: Activation, x: f64) -> f64 {
    match activation {
        Activation::GeluErf => gelu_erf(x),
        Activation::GeluTanh => gelu_tanh(x),
        // The gated forms gate in `mlp`; alone they are their gate function.
        Activation::Silu => silu(x),
        Activation::GeluTanhGated => gelu_tanh(x),
    }
}

/// The MLP of one layer on one (normed) token: up (and gate), activation, down with its bias.
pub(super) fn mlp(cfg: &ModelConfig, lw: &LayerWeights, n: &[f64]) -> Vec<f64> {
    let h = cfg.hidden;
    let up = linear(n, &lw.w_up, lw.b_up.as_deref(), cfg.ffn, h);
    let act: Vec<f64> = match &lw.w_gate {
        Some(wg) => {
            let gate = linear(n, wg, None, cfg.ffn, h);
            let f = |g: f64| activate(cfg.activation, g);
            gate.iter().zip(&up).map(|(g, u)| f(*g) * u).collect()
        }
        None => up.iter().map(|&u| activate(cfg.activation, u)).collect(),
    };
    linear(&act, &lw.w_down, lw.b_down.as_deref(), h, cfg.ffn)
}

/// One head's attention output: softmax of `q . key(p)` over `p < n` (scaled by
/// 1/sqrt(head_dim)), weighting `value(p)`.
pub(super) fn attend_head<'k>(
    q: &[f64],
    n: usize,
    key: impl Fn(usize) -> &'k [f64],
    value: impl Fn(usize) -> &'k [f64],
) -> Vec<f64> {
    let scale = 1.0 / (q.len() as f64).sqrt();
    attend_keys(q, (0..n, scale), key, value)
}

/// One head's attention output over the key positions `keys`, scores scaled by `scale`.
fn attend_keys<'k>(
    q: &[f64],
    (keys, scale): (std::ops::Range<usize>, f64),
    key: impl Fn(usize) -> &'k [f64],
    value: impl Fn(usize) -> &'k [f64],
) -> Vec<f64> {
    let scores: Vec<(usize, f64)> = keys
        .map(|p| {
            (
                p,
                q.iter().zip(key(p)).map(|(a, b)| a * b).sum::<f64>() * scale,
            )
        })
        .collect();
    let max = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<(usize, f64)> = scores.iter().map(|&(p, s)| (p, (s - max).exp())).collect();
    let denom: f64 = exps.iter().map(|e| e.1).sum();
    let mut out = vec![0.0; q.len()];
    for &(p, e) in &exps {
        for (o, v) in out.iter_mut().zip(value(p)) {
            *o += e / denom * v;
        }
    }
    out
}

/// SiLU (x * sigmoid(x)).
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// RoPE tables `[positions][rope_dim / 2]` (cos, sin) in f64, each times the magnitude: from
/// [`frequencies`], as the device tables are.
pub fn rope_tables(config: &ModelConfig, positions: usize) -> (Vec<f64>, Vec<f64>) {
    let rope = frequencies(config);
    let half = config.rope_dim() / 2;
    let mut cos = Vec::with_capacity(positions * half);
    let mut sin = Vec::with_capacity(positions * half);
    for pos in 0..positions {
        for &f in &rope.inv_freq {
            let angle = pos as f64 * f;
            cos.push(angle.cos() * rope.magnitude);
            sin.push(angle.sin() * rope.magnitude);
        }
    }
    (cos, sin)
}

/// Rotates the first `2 * half` values of each of `heads` heads of `head_dim` at `pos` (pairs
/// `i`, `i + half`, as Transformers' `rotate_half` over the rotated part); the rest pass.
fn apply_rope(
    v: &mut [f64],
    (heads, head_dim, half): (usize, usize, usize),
    pos: usize,
    tables: &(Vec<f64>, Vec<f64>),
) {
    for h in 0..heads {
        let base = h * head_dim;
        for i in 0..half {
            let (c, s) = (tables.0[pos * half + i], tables.1[pos * half + i]);
            let (a, b) = (v[base + i], v[base + i + half]);
            v[base + i] = a * c - b * s;
            v[base + i + half] = b * c + a * s;
        }
    }
}

/// RMSNorm of every `head_dim`-wide head of `v` in place, with the one scale `gamma` (Qwen3's
/// `q_norm` / `k_norm`).
fn norm_heads(v: &mut [f64], gamma: &[f32], eps: f32) {
    for head in v.chunks_mut(gamma.len()) {
        let normed = layer_norm(head, gamma, None, eps);
        head.copy_from_slice(&normed);
    }
}

/// A token's queries, keys and values from its normed stream `n`: the projections (and
/// biases), the per-head norms where the model has them, then RoPE at `pos`.
fn project_qkv(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    n: &[f64],
    pos: usize,
    rope: Option<&(Vec<f64>, Vec<f64>)>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (h, d) = (cfg.hidden, cfg.head_dim);
    let mut q = linear(n, &lw.wq, lw.bq.as_deref(), cfg.q_dim(), h);
    let mut k = linear(n, &lw.wk, lw.bk.as_deref(), cfg.kv_dim(), h);
    let v = linear(n, &lw.wv, lw.bv.as_deref(), cfg.kv_dim(), h);
    // Qwen3 normalises each head after its projection and before the rotation.
    if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
        norm_heads(&mut q, qn, cfg.norm_eps);
        norm_heads(&mut k, kn, cfg.norm_eps);
    }
    if let Some(tables) = rope {
        let half = cfg.rope_dim() / 2;
        apply_rope(&mut q, (cfg.heads, d, half), pos, tables);
        apply_rope(&mut k, (cfg.kv_heads, d, half), pos, tables);
    }
    (q, k, v)
}

/// The logits of a sequence's last position: final norm, then the head.
fn last_logits(w: &ModelWeights, x_seq: &[Vec<f64>]) -> Vec<f32> {
    let cfg = &w.config;
    let last = &x_seq[x_seq.len() - 1];
    let n = layer_norm(
        last,
        &w.final_norm,
        w.final_norm_bias.as_deref(),
        cfg.norm_eps,
    );
    let out = linear(&n, w.head(), None, cfg.vocab, cfg.hidden);
    // Gemma 2's soft-capping (a config may set it for Gemma 3): cap * tanh(logit / cap).
    let cap = cfg.final_softcap.map(f64::from);
    let capped = |v: f64| cap.map_or(v, |c| c * (v / c).tanh());
    out.into_iter().map(|v| capped(v) as f32).collect()
}

/// The RoPE tables of every layer: the global ones, and the sliding layers' own where the
/// model has them (Gemma 3); `None` for families without RoPE.
struct LayerRope {
    global: (Vec<f64>, Vec<f64>),
    local: Option<(Vec<f64>, Vec<f64>)>,
}

impl LayerRope {
    fn of(cfg: &ModelConfig) -> Option<Self> {
        (cfg.arch == Arch::Llama).then(|| Self {
            global: rope_tables(cfg, cfg.max_seq),
            local: cfg.local_rope().map(|c| rope_tables(&c, c.max_seq)),
        })
    }

    /// Layer `l`'s tables.
    fn layer(&self, cfg: &ModelConfig, l: usize) -> &(Vec<f64>, Vec<f64>) {
        match (&self.local, cfg.layer_window(l)) {
            (Some(local), Some(_)) => local,
            _ => &self.global,
        }
    }
}

/// `x += out`, RMS-normalising `out` first where the model has output norms (Gemma).
fn add_residual(cfg: &ModelConfig, x: &mut [f64], out: &[f64], out_norm: Option<&Vec<f32>>) {
    let normed = out_norm.map(|g| layer_norm(out, g, None, cfg.norm_eps));
    for (xi, oi) in x.iter_mut().zip(normed.as_deref().unwrap_or(out)) {
        *xi += oi;
    }
}

impl<'a> CpuReference<'a> {
    /// A reference model over `weights` with an empty cache. Matrices held in a file's blocks
    /// alone are dequantized into a copy once, here.
    pub fn new(weights: &'a ModelWeights) -> Self {
        let weights = match weights.has_blocks_only() {
            true => Cow::Owned(weights.clone().with_dense()),
            false => Cow::Borrowed(weights),
        };
        let weights = Arc::new(weights);
        Self {
            weights,
            k_cache: Vec::new(),
            v_cache: Vec::new(),
            past: Vec::new(),
            f16_cache: false,
        }
    }

    /// The same reference with keys and values rounded to f16 as they enter the cache, as a
    /// device with an f16 KV cache stores them (everything else stays f64).
    pub fn with_f16_cache(self) -> Self {
        Self {
            f16_cache: true,
            ..self
        }
    }

    /// A reference model whose cache holds `slots` sequences, all empty, for
    /// [`step`](Self::step).
    pub fn with_slots(weights: &'a ModelWeights, slots: usize) -> Result<Self> {
        let mut r = Self::new(weights);
        r.reset(slots)?;
        Ok(r)
    }

    fn reset(&mut self, slots: usize) -> Result<()> {
        let cfg = &self.weights.config;
        if cfg.is_encoder() {
            return Err(WgparError::WrongModelKind {
                model: cfg.name.clone(),
                call: "a reference prefill (logits)".into(),
                needs: "a decoder (encode an encoder's inputs instead)",
            });
        }
        let per_layer = slots * cfg.kv_heads * cfg.max_seq * cfg.head_dim;
        self.k_cache = vec![vec![0.0; per_layer]; cfg.layers];
        self.v_cache = vec![vec![0.0; per_layer]; cfg.layers];
        self.past = vec![0; slots];
        Ok(())
    }

    /// Runs the prompts (equal lengths) from an empty cache; returns each sequence's
    /// last-position logits.
    pub fn prefill(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        self.reset(prompts.len())?;
        let seq = prompts.first().map_or(0, |t| t.len());
        if seq == 0 || prompts.iter().any(|t| t.len() != seq) {
            return Err(WgparError::Shape {
                op: "reference".into(),
                detail: "sequences must be non-empty and of equal length".into(),
            });
        }
        let rows: Vec<(usize, &[u32])> = prompts.iter().map(|p| &p[..]).enumerate().collect();
        self.step(&rows)
    }

    /// Appends one token per sequence; returns the new logits.
    pub fn decode(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        if tokens.len() != self.past.len() {
            return Err(WgparError::Shape {
                op: "decode".into(),
                detail: format!("{} tokens for {} sequences", tokens.len(), self.past.len()),
            });
        }
        let rows: Vec<(usize, &[u32])> = tokens.chunks(1).enumerate().collect();
        self.step(&rows)
    }

    /// Tokens cached in `slot` (0 for a slot it does not have).
    pub fn past(&self, slot: usize) -> usize {
        self.past.get(slot).copied().unwrap_or(0)
    }

    /// Empties `slot`: its next tokens start at position 0.
    pub fn release(&mut self, slot: usize) {
        if let Some(p) = self.past.get_mut(slot) {
            *p = 0;
        }
    }

    /// Appends each row's tokens to its own slot (rows in distinct slots, any lengths >= 1;
    /// slot `s` continues from [`past(s)`](Self::past)); returns each row's last-position
    /// logits.
    pub fn step(&mut self, rows: &[(usize, &[u32])]) -> Result<Vec<Vec<f32>>> {
        self.check_rows(rows)?;
        let w = Arc::clone(&self.weights);
        let cfg = &w.config;
        let rope = LayerRope::of(cfg);
        // Layers run position by position within a sequence; causality comes from the cache
        // holding only positions up to the current one.
        let mut xs = self.embed_rows(&w, rows);
        for (l, layer) in w.layers.iter().enumerate() {
            for (&(slot, _), x_seq) in rows.iter().zip(xs.iter_mut()) {
                for (i, x) in x_seq.iter_mut().enumerate() {
                    let pos = self.past[slot] + i;
                    let tables = rope.as_ref().map(|r| r.layer(cfg, l));
                    self.layer_step(l, layer, slot, pos, x, tables);
                }
            }
        }
        let logits = xs.iter().map(|x_seq| last_logits(&w, x_seq)).collect();
        for &(slot, tokens) in rows {
            self.past[slot] += tokens.len();
        }
        Ok(logits)
    }

    /// Refuses, row by row, a slot that is not distinct, an empty row, a token outside the
    /// vocabulary and a row that would overflow its slot's context.
    fn check_rows(&self, rows: &[(usize, &[u32])]) -> Result<()> {
        let cfg = &self.weights.config;
        for (i, &(slot, tokens)) in rows.iter().enumerate() {
            let bad = |detail: String| {
                Err(WgparError::Shape {
                    op: "reference".into(),
                    detail,
                })
            };
            if slot >= self.past.len() || rows[..i].iter().any(|r| r.0 == slot) {
                return bad(format!(
                    "row {i}: slot {slot} is not a distinct slot of {}",
                    self.past.len()
                ));
            }
            if tokens.is_empty() {
                return bad(format!("row {i} has no tokens"));
            }
            if let Some(t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
                return bad(format!("token {t} outside the vocabulary of {}", cfg.vocab));
            }
            if self.past[slot] + tokens.len() > cfg.max_seq {
                return Err(WgparError::limit(
                    "context (tokens)",
                    ((self.past[slot] + tokens.len()) as u64, cfg.max_seq as u64),
                    format!(
                        "{} tokens exceed max_seq {}",
                        self.past[slot] + tokens.len(),
                        cfg.max_seq
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Each row's token embeddings (plus learned positions, continuing from its slot's past),
    /// `[row][position][hidden]`.
    fn embed_rows(&self, w: &ModelWeights, rows: &[(usize, &[u32])]) -> Vec<Vec<Vec<f64>>> {
        let h = w.config.hidden;
        // Gemma scales the looked-up rows (by sqrt(hidden) in the checkpoint's dtype).
        let scale = w.config.embed_scale.map_or(1.0, f64::from);
        rows.iter()
            .map(|&(slot, seq_tokens)| {
                seq_tokens
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| {
                        let t = t as usize;
                        (0..h)
                            .map(|c| {
                                let mut v = w.wte[t * h + c] as f64 * scale;
                                if let Some(wpe) = &w.wpe {
                                    v += wpe[(self.past[slot] + i) * h + c] as f64;
                                }
                                v
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect()
    }

    fn layer_step(
        &mut self,
        l: usize,
        lw: &LayerWeights,
        kv_slot: usize,
        pos: usize,
        x: &mut [f64],
        rope: Option<&(Vec<f64>, Vec<f64>)>,
    ) {
        let cfg = &self.weights.config;
        let (h, d) = (cfg.hidden, cfg.head_dim);
        let n = layer_norm(x, &lw.attn_norm, lw.attn_norm_bias.as_deref(), cfg.norm_eps);
        let (q, k, v) = project_qkv(cfg, lw, &n, pos, rope);
        let slot = |kvh: usize, p: usize| ((kv_slot * cfg.kv_heads + kvh) * cfg.max_seq + p) * d;
        for kvh in 0..cfg.kv_heads {
            let s = slot(kvh, pos);
            self.k_cache[l][s..s + d].copy_from_slice(&k[kvh * d..(kvh + 1) * d]);
            self.v_cache[l][s..s + d].copy_from_slice(&v[kvh * d..(kvh + 1) * d]);
            if self.f16_cache {
                for x in self.k_cache[l][s..s + d]
                    .iter_mut()
                    .chain(&mut self.v_cache[l][s..s + d])
                {
                    *x = half::f16::from_f64(*x).to_f64();
                }
            }
        }
        let group = cfg.heads / cfg.kv_heads;
        let mut attn = Vec::with_capacity(cfg.q_dim());
        let (k_cache, v_cache) = (&self.k_cache[l], &self.v_cache[l]);
        // A sliding layer sees the `window` positions ending at its own (HF: key > query -
        // window); Gemma scales scores by query_pre_attn_scalar^-1/2.
        let first = cfg
            .layer_window(l)
            .map_or(0, |w| (pos + 1).saturating_sub(w));
        let scale = cfg.attn_scale.map_or(1.0 / (d as f64).sqrt(), f64::from);
        for head in 0..cfg.heads {
            let kvh = head / group;
            attn.extend(attend_keys(
                &q[head * d..(head + 1) * d],
                (first..pos + 1, scale),
                |p| &k_cache[slot(kvh, p)..slot(kvh, p) + d],
                |p| &v_cache[slot(kvh, p)..slot(kvh, p) + d],
            ));
        }
        let o = linear(&attn, &lw.wo, lw.bo.as_deref(), h, cfg.q_dim());
        add_residual(cfg, x, &o, lw.attn_out_norm.as_ref());
        let n = layer_norm(x, &lw.mlp_norm, lw.mlp_norm_bias.as_deref(), cfg.norm_eps);
        let down = mlp(cfg, lw, &n);
        add_residual(cfg, x, &down, lw.mlp_out_norm.as_ref());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_tabulated_values() {
        // Values of erf to 16 digits (Abramowitz and Stegun, table 7.1, extended).
        let table = [
            (0.0, 0.0),
            (0.1, 0.112_462_916_018_284_9),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (2.5, 0.999_593_047_982_555),
            (3.0, 0.999_977_909_503_001_4),
            (4.5, 0.999_999_999_803_383_9),
        ];
        for (x, want) in table {
            assert!((erf(x) - want).abs() < 1e-14, "erf({x}) = {}", erf(x));
            assert!((erf(-x) + want).abs() < 1e-14, "erf(-{x})");
        }
        assert_eq!(erf(7.0), 1.0);
        assert!((gelu_erf(1.0) - 0.841_344_746_068_542_9).abs() < 1e-14);
    }
}
