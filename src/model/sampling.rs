//! Choosing the next token from logits: greedy, or a seeded draw after temperature, top-k and
//! top-p (nucleus) filtering.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, WgparError};

/// How to pick tokens. `temperature == 0` is greedy and ignores the rest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Logits are divided by this before the softmax; 0 picks the most likely token.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities first reach this total (1: all).
    pub top_p: f32,
    /// Seed of the draws: the same seed and logits give the same tokens.
    pub seed: u64,
}

impl SamplingParams {
    /// Always the most likely token.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A token picker with its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// Checks the parameters and seeds the stream.
    pub fn new(params: SamplingParams) -> Result<Self> {
        if !(params.temperature >= 0.0 && params.temperature.is_finite()) {
            return Err(WgparError::option(
                "--temperature",
                format!(
                    "temperature {} must be a finite number >= 0",
                    params.temperature
                ),
            ));
        }
        if !(params.top_p > 0.0 && params.top_p <= 1.0) {
            return Err(WgparError::option(
                "--top-p",
                format!("top-p {} must lie in (0, 1]", params.top_p),
            ));
        }
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        })
    }

    /// Always the most likely token.
    pub fn greedy() -> Self {
        let params = SamplingParams::greedy();
        Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks one token id from `logits` (NaN never wins; ties go to the lower id).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        // Candidates, most likely first.
        let mut order: Vec<usize> = (0..logits.len()).filter(|&i| !logits[i].is_nan()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let Some(&best) = order.first() else {
            return 0;
        };
        if p.temperature == 0.0 || p.top_k == 1 {
            return best as u32;
        }
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let t = p.temperature as f64;
        let top = logits[best] as f64;
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| ((logits[i] as f64 - top) / t).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = probs
                .iter()
                .position(|q| {
                    cumulative += q;
                    cumulative >= p.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            order.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.random::<f64>() * total;
        for (&i, q) in order.iter().zip(&probs) {
            if u < *q {
                return i as u32;
            }
            u -= q;
        }
        // Rounding left u just past the last bucket.
        order[probs.len() - 1] as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(params: SamplingParams, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut s = Sampler::new(params).unwrap();
        let mut c = vec![0; logits.len()];
        for _ in 0..draws {
            c[s.sample(logits) as usize] += 1;
        }
        c
    }

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: 9,
        }
    }

    #[test]
    fn greedy_picks_the_largest_and_skips_nan() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.1, f32::NAN, 3.0, 3.0, -1.0]), 2);
        let mut k1 = Sampler::new(params(1.0, 1, 1.0)).unwrap();
        assert_eq!(k1.sample(&[0.1, 2.0, 1.0]), 1);
    }

    #[test]
    fn draws_follow_the_softmax() {
        // Probabilities 0.5, 0.3, 0.2.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let c = counts(params(1.0, 0, 1.0), &logits, 20_000);
        for (got, want) in c.iter().zip([0.5, 0.3, 0.2]) {
            let share = *got as f64 / 20_000.0;
            assert!((share - want).abs() < 0.015, "{c:?}");
        }
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let c = counts(params(1.0, 2, 1.0), &logits, 5_000);
        assert_eq!(c[2], 0, "{c:?}");
        // 0.5 < 0.6 <= 0.8: the nucleus holds tokens 0 and 1, renormalised to 0.625 / 0.375.
        let c = counts(params(1.0, 0, 0.6), &logits, 20_000);
        assert_eq!(c[2], 0, "{c:?}");
        assert!((c[0] as f64 / 20_000.0 - 0.625).abs() < 0.015, "{c:?}");
    }

    #[test]
    fn same_seed_same_tokens_and_bad_params_refused() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = || {
            let mut s = Sampler::new(params(0.8, 10, 0.9)).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        assert!(Sampler::new(params(-1.0, 0, 1.0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 0.0)).is_err());
        assert!(Sampler::new(params(f32::NAN, 0, 1.0)).is_err());
    }
}
