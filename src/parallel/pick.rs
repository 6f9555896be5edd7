//! How engines pick tokens. On the device where the sampling parameters allow it (greedy, or
//! top-k with k <= `ops::MAX_TOP_K`, with temperature and top-p), so a step reads back token
//! ids; otherwise (top-k 0 or larger, with a temperature) from logits read back to the host
//! sampler. Either way the seeded stream gives one draw per sampled token, in row order, as
//! `model::sampling::Sampler` does, so the same seed gives the same tokens.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Logits;
use crate::error::{Result, WgparError};
use crate::kernels::ops::{TokenPick, MAX_TOP_K};
use crate::model::sampling::{Sampler, SamplingParams};

/// An engine's token picker.
#[derive(Debug, Clone)]
pub(crate) struct Picker {
    params: SamplingParams,
    /// Draws for device sampling.
    rng: ChaCha8Rng,
    /// The host sampler, for what the device cannot do.
    host: Sampler,
}

impl Picker {
    /// A picker for `params` (checked as the host sampler checks them).
    pub(crate) fn new(params: SamplingParams) -> Result<Self> {
        Ok(Self {
            host: Sampler::new(params)?,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
        })
    }

    /// Always the most likely token.
    pub(crate) fn greedy() -> Self {
        Self {
            params: SamplingParams::greedy(),
            rng: ChaCha8Rng::seed_from_u64(0),
            host: Sampler::greedy(),
        }
    }

    /// The device's pick, or `None` when only the host sampler can pick this way: then the
    /// device runs a greedy pick (which still counts non-finite logits) and the engine reads
    /// the logits back.
    pub(crate) fn device(&self) -> Option<TokenPick> {
        let p = &self.params;
        if p.temperature == 0.0 || p.top_k == 1 {
            return Some(TokenPick::Greedy);
        }
        (1..=MAX_TOP_K)
            .contains(&p.top_k)
            .then_some(TokenPick::Sample {
                top_k: p.top_k,
                temperature: p.temperature,
                top_p: p.top_p,
            })
    }

    /// The pick to configure on the device (greedy where the host samples).
    pub(crate) fn device_or_greedy(&self) -> TokenPick {
        self.device().unwrap_or(TokenPick::Greedy)
    }

    /// Whether the host samples from read-back logits.
    pub(crate) fn needs_logits(&self) -> bool {
        self.device().is_none()
    }

    /// Whether the host samples from read-back logits when the head is in another process,
    /// which picks greedily (the sampling settings stay here): for every pick but greedy.
    pub(crate) fn needs_remote_logits(&self) -> bool {
        self.device() != Some(TokenPick::Greedy)
    }

    /// One draw in [0, 1) per sequence for a device sampling pick; none for a greedy one.
    pub(crate) fn draws(&mut self, batch: usize) -> Vec<f32> {
        match self.device() {
            Some(TokenPick::Sample { .. }) => (0..batch)
                .map(|_| self.rng.random::<f64>() as f32)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Host sampling of every row of `logits`.
    pub(crate) fn host(&mut self, logits: &Logits) -> Vec<u32> {
        (0..logits.batch)
            .map(|b| self.host.sample(logits.row(b)))
            .collect()
    }
}

/// Refuses a step whose logits were not all finite: `non_finite[b]` counts row `b`'s.
pub(crate) fn check_finite(
    step: usize,
    non_finite: &[u32],
    location: Option<String>,
) -> Result<()> {
    let rows: Vec<usize> = (non_finite.iter().enumerate())
        .filter(|(_, &n)| n > 0)
        .map(|(b, _)| b)
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    Err(WgparError::NonFinite {
        step,
        rows,
        location,
    })
}

/// Per-row counts of non-finite values in host logits.
pub(crate) fn count_non_finite(logits: &Logits) -> Vec<u32> {
    (0..logits.batch)
        .map(|b| logits.row(b).iter().filter(|v| !v.is_finite()).count() as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: 3,
        }
    }

    #[test]
    fn device_picks_what_it_can() {
        assert_eq!(Picker::greedy().device(), Some(TokenPick::Greedy));
        let p = Picker::new(params(0.7, 1, 1.0)).unwrap();
        assert_eq!(p.device(), Some(TokenPick::Greedy));
        let p = Picker::new(params(0.7, 40, 0.9)).unwrap();
        assert!(matches!(
            p.device(),
            Some(TokenPick::Sample { top_k: 40, .. })
        ));
        for k in [0, MAX_TOP_K + 1] {
            let p = Picker::new(params(0.7, k, 0.9)).unwrap();
            assert!(p.needs_logits());
            assert_eq!(p.device_or_greedy(), TokenPick::Greedy);
        }
    }

    #[test]
    fn a_remote_head_sends_logits_only_for_sampling() {
        assert!(!Picker::greedy().needs_remote_logits());
        // Top-1 is greedy whatever the temperature.
        assert!(!Picker::new(params(0.7, 1, 1.0))
            .unwrap()
            .needs_remote_logits());
        for k in [0, 40, MAX_TOP_K + 1] {
            let p = Picker::new(params(0.7, k, 0.9)).unwrap();
            assert!(p.needs_remote_logits(), "top-k {k}");
        }
    }

    #[test]
    fn draws_are_seeded_and_only_for_sampling() {
        let mut a = Picker::new(params(1.0, 8, 1.0)).unwrap();
        let mut b = Picker::new(params(1.0, 8, 1.0)).unwrap();
        let da = a.draws(5);
        assert_eq!(da, b.draws(5));
        assert!(da.iter().all(|&u| (0.0..=1.0).contains(&u)));
        assert!(Picker::greedy().draws(5).is_empty());
    }

    #[test]
    fn non_finite_rows_are_named() {
        assert!(check_finite(2, &[0, 0], None).is_ok());
        let e = check_finite(3, &[0, 4, 1], Some("layer 1".into()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("step 3") && e.contains("[1, 2]") && e.contains("layer 1"),
            "{e}"
        );
    }
}
