//! The CPU reference for encoders (BERT): the whole sequence at once, every token attending to
//! every other, a norm after each residual, then pooling. f64 throughout, like the decoder
//! reference; the oracle for the GPU encoder.

use super::config::PoolMode;
use super::input::EncoderInput;
use super::reference::{attend_head, layer_norm, linear, mlp, CpuReference};
use crate::error::{Result, WgparError};

impl CpuReference<'_> {
    /// Encodes each sequence on its own (no padding needed) and returns its pooled embedding,
    /// `[hidden]` per sequence, L2-normalised when the model's pooling says so.
    pub fn encode(&self, inputs: &[EncoderInput]) -> Result<Vec<Vec<f64>>> {
        let cfg = &self.weights.config;
        if !cfg.is_encoder() {
            return Err(WgparError::WrongModelKind {
                model: cfg.name.clone(),
                call: "a pooled embedding".into(),
                needs: "an encoder (BERT-style)",
            });
        }
        EncoderInput::check_batch(inputs, cfg)?;
        Ok(inputs
            .iter()
            .map(|input| {
                let states = self.token_states(input);
                pool(&states, cfg.pooling.mode, cfg.pooling.normalize)
            })
            .collect())
    }

    /// Final hidden state of every token of one (checked) sequence.
    pub fn token_states(&self, input: &EncoderInput) -> Vec<Vec<f64>> {
        let w = &self.weights;
        let cfg = &w.config;
        let (h, d, eps) = (cfg.hidden, cfg.head_dim, cfg.norm_eps);
        let types = input.types();
        let mut xs: Vec<Vec<f64>> = input
            .ids
            .iter()
            .zip(&types)
            .enumerate()
            .map(|(pos, (&t, &ty))| {
                let sum: Vec<f64> = (0..h)
                    .map(|c| {
                        let row = |table: &Option<Vec<f32>>, r: usize| {
                            table.as_ref().map_or(0.0, |m| m[r * h + c] as f64)
                        };
                        w.wte[t as usize * h + c] as f64
                            + row(&w.wpe, pos)
                            + row(&w.token_types, ty as usize)
                    })
                    .collect();
                match &w.embed_norm {
                    Some(gamma) => layer_norm(&sum, gamma, w.embed_norm_bias.as_deref(), eps),
                    None => sum,
                }
            })
            .collect();
        let group = cfg.heads / cfg.kv_heads;
        for lw in &w.layers {
            let project = |m: &[f32], b: &Option<Vec<f32>>, rows: usize| -> Vec<Vec<f64>> {
                xs.iter()
                    .map(|x| linear(x, m, b.as_deref(), rows, h))
                    .collect()
            };
            let q = project(&lw.wq, &lw.bq, cfg.q_dim());
            let k = project(&lw.wk, &lw.bk, cfg.kv_dim());
            let v = project(&lw.wv, &lw.bv, cfg.kv_dim());
            for (i, x) in xs.iter_mut().enumerate() {
                let mut attn = Vec::with_capacity(cfg.q_dim());
                for head in 0..cfg.heads {
                    let kvh = head / group;
                    attn.extend(attend_head(
                        &q[i][head * d..(head + 1) * d],
                        k.len(),
                        |p| &k[p][kvh * d..(kvh + 1) * d],
                        |p| &v[p][kvh * d..(kvh + 1) * d],
                    ));
                }
                let o = linear(&attn, &lw.wo, lw.bo.as_deref(), h, cfg.q_dim());
                let sum: Vec<f64> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
                *x = layer_norm(&sum, &lw.attn_norm, lw.attn_norm_bias.as_deref(), eps);
                let down = mlp(cfg, lw, x);
                let sum: Vec<f64> = x.iter().zip(&down).map(|(a, b)| a + b).collect();
                *x = layer_norm(&sum, &lw.mlp_norm, lw.mlp_norm_bias.as_deref(), eps);
            }
        }
        xs
    }
}

/// Reduces token states to one vector: their mean or the first one, optionally scaled to unit
/// length (a zero vector stays zero).
pub fn pool(states: &[Vec<f64>], mode: PoolMode, normalize: bool) -> Vec<f64> {
    let width = states.first().map_or(0, Vec::len);
    let mut out = match mode {
        PoolMode::Cls => states.first().cloned().unwrap_or_default(),
        PoolMode::Mean => {
            let n = states.len().max(1) as f64;
            (0..width)
                .map(|c| states.iter().map(|s| s[c]).sum::<f64>() / n)
                .collect()
        }
    };
    if normalize {
        let norm = out.iter().map(|v| v * v).sum::<f64>().sqrt();
        if norm > 0.0 {
            out.iter_mut().for_each(|v| *v /= norm);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelConfig, ModelWeights};

    #[test]
    fn pooling_by_hand() {
        let states = vec![vec![3.0, 0.0], vec![1.0, 2.0]];
        assert_eq!(pool(&states, PoolMode::Mean, false), vec![2.0, 1.0]);
        assert_eq!(pool(&states, PoolMode::Cls, true), vec![1.0, 0.0]);
        let unit = pool(&states, PoolMode::Mean, true);
        assert!((unit[0] - 2.0 / 5f64.sqrt()).abs() < 1e-15);
    }

    #[test]
    fn encoder_sees_the_whole_sequence() {
        // Bidirectional: changing the last token changes the first token's state (a causal
        // model would leave it alone).
        let cfg = ModelConfig::preset("tiny-bert").unwrap();
        let w = ModelWeights::synthetic(&cfg, 2);
        let r = CpuReference::new(&w);
        let a = r.token_states(&EncoderInput::new(vec![5, 6, 7]));
        let b = r.token_states(&EncoderInput::new(vec![5, 6, 8]));
        assert!(a[0].iter().zip(&b[0]).any(|(x, y)| (x - y).abs() > 1e-6));
        let e = r.encode(&[EncoderInput::new(vec![1, 2])]).unwrap();
        let norm: f64 = e[0].iter().map(|v| v * v).sum();
        assert!((norm - 1.0).abs() < 1e-12);
        let decoder = ModelWeights::synthetic(&ModelConfig::preset("tiny-gpt2").unwrap(), 1);
        assert!(CpuReference::new(&decoder).encode(&[]).is_err());
    }
}
