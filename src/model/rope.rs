//! RoPE as checkpoints define it: the base frequencies `theta^(-2i/d)`, a file's per-dimension
//! divisors (GGUF `rope_freqs.weight`, Llama 3.1 / 3.2), and a scaling for contexts past the
//! one the model was trained on (linear, Llama 3, YaRN, LongRoPE). [`frequencies`] resolves all of them
//! to one representation, per-pair inverse frequencies and a magnitude on cos and sin, from
//! which the device tables and the f64 reference are both built. A model that rotates only the
//! first `rotary_dim` values of each head (Phi-4-mini) has `rotary_dim / 2` pairs, and its base
//! frequencies run over that width (`theta^(-2i/rotary_dim)`), as Transformers and llama.cpp
//! compute them.

use serde::{Deserialize, Serialize};

use super::config::ModelConfig;

/// Llama 3's scaling (`rope_type: "llama3"`): long wavelengths are slowed by `factor`, short
/// ones kept, the band between blended.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3Scaling {
    /// Slow-down of the low frequencies.
    pub factor: f32,
    /// Wavelengths above `original_context / low_freq_factor` are fully scaled.
    pub low_freq_factor: f32,
    /// Wavelengths below `original_context / high_freq_factor` are kept.
    pub high_freq_factor: f32,
    /// Context the model was first trained for.
    pub original_context: usize,
}

/// YaRN (`rope_type: "yarn"`, GGUF `rope.scaling.type = yarn`): pairs that turn fewer than
/// `beta_slow` times over the original context are interpolated (slowed by `factor`), those
/// that turn more than `beta_fast` times kept, a linear ramp over the pair index between; cos
/// and sin are multiplied by `attention_factor`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct YarnScaling {
    /// Slow-down of the interpolated frequencies.
    pub factor: f32,
    /// Context the model was first trained for.
    pub original_context: usize,
    /// Rotations over the original context above which a pair is kept (32 by default).
    pub beta_fast: f32,
    /// Rotations below which a pair is fully interpolated (1 by default).
    pub beta_slow: f32,
    /// Magnitude on cos and sin, resolved from the checkpoint (`0.1 ln(factor) + 1` unless it
    /// names one).
    pub attention_factor: f32,
    /// Whether the ramp's ends are rounded to whole pairs (Hugging Face's `truncate`, true by
    /// default and always in llama.cpp).
    pub truncate: bool,
}

/// LongRoPE (Phi-3 128k, Phi-3.5; Hugging Face `longrope` or the older `su`, GGUF
/// `rope_factors_short` / `rope_factors_long`): every pair's frequency divided by its own
/// factor, from the short list when the served context (`max_seq`) is within
/// `original_context`, else from the long one; cos and sin multiplied by `attention_factor`
/// in both regimes, as Transformers does.
///
/// Transformers picks the list by the current sequence length and, on crossing the original
/// context, drops its cache and recomputes every position with the long list. wgpar's KV cache
/// keeps rotated keys, so it picks once, by the context the engine serves: a sequence shorter
/// than `original_context` on an engine serving more is rotated by the long list (serve it with
/// `--max-seq` at most `original_context` for Transformers' short-sequence numbers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LongRopeScaling {
    /// Divisors for contexts within `original_context`, one per rotated pair.
    pub short_factor: Vec<f32>,
    /// Divisors for longer contexts, one per rotated pair.
    pub long_factor: Vec<f32>,
    /// Context the model was first trained for.
    pub original_context: usize,
    /// Magnitude on cos and sin, resolved from the checkpoint
    /// (`sqrt(1 + ln(factor) / ln(original_context))` unless it names one).
    pub attention_factor: f32,
}

impl LongRopeScaling {
    /// The divisors a context of `max_seq` tokens rotates by.
    pub fn factors_for(&self, max_seq: usize) -> &[f32] {
        if max_seq > self.original_context {
            &self.long_factor
        } else {
            &self.short_factor
        }
    }
}

/// LongRoPE's default magnitude for a context `factor` times the original one:
/// `sqrt(1 + ln(factor) / ln(original))`, 1 when the context is not extended.
pub fn longrope_magnitude(factor: f64, original: usize) -> f64 {
    if factor <= 1.0 || original < 2 {
        1.0
    } else {
        (1.0 + factor.ln() / (original as f64).ln()).sqrt()
    }
}

/// How the frequencies are scaled for contexts past the original one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (positions interpolated).
    Linear {
        /// The divisor.
        factor: f32,
    },
    /// Llama 3.1's wavelength bands.
    Llama3(Llama3Scaling),
    /// YaRN's ramp and magnitude.
    Yarn(YarnScaling),
    /// LongRoPE's per-pair factors and magnitude.
    LongRope(LongRopeScaling),
}

/// The resolved rotation: what the tables are computed from.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFrequencies {
    /// Radians per position of each rotated pair `i < rope_dim / 2`.
    pub inv_freq: Vec<f64>,
    /// Factor on cos and sin (YaRN's attention factor, else 1).
    pub magnitude: f64,
}

/// `0.1 ln(factor) + 1` for factors above 1, else 1: YaRN's default attention factor (the
/// paper's `sqrt(1/t)`), as Hugging Face and llama.cpp compute it; `mscale` weights the log.
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// The inverse frequencies and magnitude `config` rotates by: the base frequencies, divided by
/// the file's per-pair factors (as llama.cpp applies `rope_freqs`), then scaled.
pub fn frequencies(config: &ModelConfig) -> RopeFrequencies {
    let d = config.rope_dim() as f64;
    let base = config.rope_theta as f64;
    let inv_freq: Vec<f64> = (0..config.rope_dim() / 2)
        .map(|i| {
            let f = base.powf(-(2.0 * i as f64) / d);
            config
                .rope_freq_factors
                .as_ref()
                .map_or(f, |ff| f / ff[i] as f64)
        })
        .collect();
    match &config.rope_scaling {
        None => RopeFrequencies {
            inv_freq,
            magnitude: 1.0,
        },
        Some(RopeScaling::Linear { factor }) => RopeFrequencies {
            inv_freq: inv_freq.iter().map(|f| f / *factor as f64).collect(),
            magnitude: 1.0,
        },
        Some(RopeScaling::Llama3(s)) => RopeFrequencies {
            inv_freq: inv_freq.iter().map(|&f| llama3_frequency(f, s)).collect(),
            magnitude: 1.0,
        },
        Some(RopeScaling::Yarn(s)) => yarn(inv_freq, config, s),
        Some(RopeScaling::LongRope(s)) => RopeFrequencies {
            inv_freq: inv_freq
                .iter()
                .zip(s.factors_for(config.max_seq))
                .map(|(&f, &by)| f / by as f64)
                .collect(),
            magnitude: s.attention_factor as f64,
        },
    }
}

/// One frequency under Llama 3 scaling: wavelengths shorter than the high-frequency bound are
/// kept, longer than the low-frequency bound divided by `factor`, and those in between blended
/// linearly in `original_context / wavelength`.
pub fn llama3_frequency(inv_freq: f64, s: &Llama3Scaling) -> f64 {
    let original = s.original_context as f64;
    let (low, high) = (s.low_freq_factor as f64, s.high_freq_factor as f64);
    let wavelength = 2.0 * std::f64::consts::PI / inv_freq;
    if wavelength < original / high {
        inv_freq
    } else if wavelength > original / low {
        inv_freq / s.factor as f64
    } else {
        let smooth = (original / wavelength - low) / (high - low);
        (1.0 - smooth) * inv_freq / s.factor as f64 + smooth * inv_freq
    }
}

/// YaRN over `inv_freq` (already divided by any per-pair factors, which llama.cpp applies to
/// the extrapolated frequency before the blend).
fn yarn(inv_freq: Vec<f64>, config: &ModelConfig, s: &YarnScaling) -> RopeFrequencies {
    let d = config.rope_dim() as f64;
    let log_base = (config.rope_theta as f64).ln();
    let original = s.original_context as f64;
    // The pair index at which a frequency turns `rotations` times over the original context.
    let pair_at = |rotations: f64| {
        d * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * log_base)
    };
    let (mut low, mut high) = (pair_at(s.beta_fast as f64), pair_at(s.beta_slow as f64));
    if s.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, high) = (low.max(0.0), high.min(d - 1.0));
    let factor = s.factor as f64;
    let inv_freq = inv_freq
        .iter()
        .enumerate()
        .map(|(i, &f)| {
            let ramp = ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
            // `ramp` 0: the pair turns fast enough to keep; 1: slow, interpolated.
            f / factor * ramp + f * (1.0 - ramp)
        })
        .collect();
    RopeFrequencies {
        inv_freq,
        magnitude: s.attention_factor as f64,
    }
}

/// What is wrong with `config`'s RoPE parameters beyond the base, if anything.
pub fn problem(config: &ModelConfig) -> Option<String> {
    let positive = |x: f32| x.is_finite() && x > 0.0;
    let pairs = config.rope_dim() / 2;
    if let Some(ff) = &config.rope_freq_factors {
        if ff.len() != pairs {
            return Some(format!(
                "RoPE frequency factors: {} values for {} (needs {pairs})",
                ff.len(),
                rotated(config)
            ));
        }
        if let Some((i, v)) = ff.iter().enumerate().find(|(_, &v)| !positive(v)) {
            return Some(format!(
                "RoPE frequency factor {i} is {v}: must be positive and finite"
            ));
        }
        if let Some(s @ (RopeScaling::Llama3(_) | RopeScaling::LongRope(_))) = &config.rope_scaling
        {
            let kind = match s {
                RopeScaling::Llama3(_) => "llama3",
                _ => "longrope",
            };
            return Some(format!(
                "RoPE frequency factors and {kind} scaling both given"
            ));
        }
    }
    if let Some(RopeScaling::LongRope(s)) = &config.rope_scaling {
        return longrope_problem(s, config);
    }
    let ok = match &config.rope_scaling {
        None => true,
        Some(RopeScaling::Linear { factor }) => positive(*factor),
        Some(RopeScaling::Llama3(s)) => {
            positive(s.factor)
                && positive(s.low_freq_factor)
                && positive(s.high_freq_factor)
                && s.high_freq_factor != s.low_freq_factor
                && s.original_context > 0
        }
        Some(RopeScaling::Yarn(s)) => {
            positive(s.factor)
                && positive(s.beta_fast)
                && positive(s.beta_slow)
                && positive(s.attention_factor)
                && s.original_context > 0
        }
        Some(RopeScaling::LongRope(_)) => true,
    };
    (!ok).then(|| {
        format!(
            "rope_scaling needs positive finite factors and context, got {:?}",
            config.rope_scaling
        )
    })
}

/// The rotated width of `config`'s heads, for messages: "head_dim 16", or "12 rotated
/// dimensions of head_dim 16".
fn rotated(config: &ModelConfig) -> String {
    match config.rotary_dim {
        Some(r) if r != config.head_dim => {
            format!("{r} rotated dimensions of head_dim {}", config.head_dim)
        }
        _ => format!("head_dim {}", config.head_dim),
    }
}

/// What is wrong with LongRoPE's lists for `config`'s rotated pairs, if anything.
fn longrope_problem(s: &LongRopeScaling, config: &ModelConfig) -> Option<String> {
    let pairs = config.rope_dim() / 2;
    for (name, list) in [
        ("short_factor", &s.short_factor),
        ("long_factor", &s.long_factor),
    ] {
        if list.len() != pairs {
            return Some(format!(
                "LongRoPE {name}: {} values for {} (needs {pairs})",
                list.len(),
                rotated(config)
            ));
        }
        if let Some((i, v)) = list
            .iter()
            .enumerate()
            .find(|(_, v)| !(v.is_finite() && **v > 0.0))
        {
            return Some(format!(
                "LongRoPE {name} {i} is {v}: must be positive and finite"
            ));
        }
    }
    let a = s.attention_factor;
    if !(a.is_finite() && a > 0.0) || s.original_context == 0 {
        return Some(format!(
            "LongRoPE needs a positive attention factor and original context, got {a} and {}",
            s.original_context
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_short_and_slows_long_wavelengths() {
        // Llama 3.1's values: factor 8, bounds 8192 / 4 = 2048 and 8192 / 1 = 8192 tokens.
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        };
        let tau = 2.0 * std::f64::consts::PI;
        let f = |wavelength: f64| tau / wavelength;
        // Wavelength 100 < 2048: kept.
        assert_eq!(llama3_frequency(f(100.0), &s), f(100.0));
        // Wavelength 10000 > 8192: divided by 8.
        assert!((llama3_frequency(f(10_000.0), &s) - f(10_000.0) / 8.0).abs() < 1e-18);
        // Wavelength 4096: 8192 / 4096 = 2, smooth = (2 - 1) / (4 - 1) = 1/3, so the
        // frequency is (2/3) f / 8 + (1/3) f = (1/12 + 1/3) f = (5/12) f.
        let got = llama3_frequency(f(4096.0), &s);
        assert!((got - f(4096.0) * 5.0 / 12.0).abs() < 1e-15, "{got}");
        // The tables use it.
        let mut cfg = ModelConfig::preset("tiny-llama").unwrap();
        let plain = frequencies(&cfg).inv_freq;
        cfg.rope_scaling = Some(RopeScaling::Llama3(s));
        let scaled = frequencies(&cfg).inv_freq;
        assert_eq!(plain[0], scaled[0]);
        assert_ne!(plain, scaled);
    }

    #[test]
    fn yarn_ramps_between_the_correction_pairs_and_sets_the_magnitude() {
        // head_dim 16, theta 10000, original context 64: pair i turns 64 / (2 pi 10000^(i/8))
        // times, so beta_fast 4 sits at pair 8 ln(64 / 8 pi) / ln 10000 = 0.81 (floor 0) and
        // beta_slow 1 at 8 ln(64 / 2 pi) / ln 10000 = 2.02 (ceil 3).
        let cfg = ModelConfig {
            rope_scaling: Some(RopeScaling::Yarn(YarnScaling {
                factor: 4.0,
                original_context: 64,
                beta_fast: 4.0,
                beta_slow: 1.0,
                attention_factor: 1.25,
                truncate: true,
            })),
            ..ModelConfig::preset("tiny-llama").unwrap()
        };
        let r = frequencies(&cfg);
        let base = |i: usize| 10_000f64.powf(-(i as f64) / 8.0);
        for (i, ramp) in [(0, 0.0), (1, 1.0 / 3.0), (2, 2.0 / 3.0), (3, 1.0), (7, 1.0)] {
            let want = base(i) * (1.0 - ramp) + base(i) / 4.0 * ramp;
            assert!((r.inv_freq[i] - want).abs() < 1e-15, "pair {i}");
        }
        assert_eq!(r.magnitude, 1.25);
        assert!((yarn_mscale(4.0, 1.0) - (1.0 + 0.1 * 4f64.ln())).abs() < 1e-15);
        assert_eq!(yarn_mscale(0.5, 1.0), 1.0);
    }

    #[test]
    fn file_factors_divide_before_the_scaling_and_are_validated() {
        let mut cfg = ModelConfig::preset("tiny-llama").unwrap();
        let plain = frequencies(&cfg).inv_freq;
        cfg.rope_freq_factors = Some((1..=8).map(|i| i as f32).collect());
        cfg.rope_scaling = Some(RopeScaling::Linear { factor: 2.0 });
        let got = frequencies(&cfg).inv_freq;
        for i in 0..8 {
            assert!(
                (got[i] - plain[i] / (i + 1) as f64 / 2.0).abs() < 1e-18,
                "pair {i}"
            );
        }
        cfg.rope_freq_factors = Some(vec![1.0; 7]);
        assert!(problem(&cfg).unwrap().contains("7 values for head_dim 16"));
        cfg.rope_freq_factors = Some(vec![1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
        assert!(problem(&cfg).unwrap().contains("factor 1 is 0"));
    }

    #[test]
    fn a_partial_rotation_spreads_its_frequencies_over_the_rotated_width() {
        // 12 of 16 values rotate: 6 pairs at theta^(-2i/12), Transformers' `dim`.
        let mut cfg = ModelConfig {
            rotary_dim: Some(12),
            ..ModelConfig::preset("tiny-llama").unwrap()
        };
        let r = frequencies(&cfg);
        assert_eq!(r.inv_freq.len(), 6);
        for (i, f) in r.inv_freq.iter().enumerate() {
            let want = 10_000f64.powf(-(2.0 * i as f64) / 12.0);
            assert!((f - want).abs() < 1e-18, "pair {i}");
        }
        // Per-pair lists have one value per rotated pair.
        cfg.rope_freq_factors = Some(vec![1.0; 8]);
        let e = problem(&cfg).unwrap();
        assert!(
            e.contains("8 values for 12 rotated dimensions of head_dim 16 (needs 6)"),
            "{e}"
        );
        cfg.rope_freq_factors = Some(vec![2.0; 6]);
        assert!(problem(&cfg).is_none());
        assert_eq!(frequencies(&cfg).inv_freq[1], r.inv_freq[1] / 2.0);
    }

    #[test]
    fn longrope_picks_its_list_by_the_served_context_and_scales_both() {
        // head_dim 16: 8 pairs; original context 32, so 64 tokens use the long list.
        let s = LongRopeScaling {
            short_factor: (1..=8).map(|i| i as f32).collect(),
            long_factor: (1..=8).map(|i| 10.0 * i as f32).collect(),
            original_context: 32,
            attention_factor: 1.5,
        };
        let mut cfg = ModelConfig {
            rope_scaling: Some(RopeScaling::LongRope(s.clone())),
            max_seq: 32,
            ..ModelConfig::preset("tiny-llama").unwrap()
        };
        let base = |i: usize| 10_000f64.powf(-(i as f64) / 8.0);
        for (max_seq, by) in [(32, 1.0), (33, 10.0)] {
            cfg.max_seq = max_seq;
            let r = frequencies(&cfg);
            for i in 0..8 {
                let want = base(i) / (by * (i + 1) as f64);
                assert!((r.inv_freq[i] - want).abs() < 1e-18, "{max_seq} pair {i}");
            }
            assert_eq!(r.magnitude, 1.5);
        }
        assert!(problem(&cfg).is_none());
        // sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12).
        let m = longrope_magnitude(32.0, 4096);
        assert!((m - (17.0f64 / 12.0).sqrt()).abs() < 1e-15, "{m}");
        assert_eq!(longrope_magnitude(1.0, 4096), 1.0);
        let mut bad = |f: fn(&mut LongRopeScaling)| {
            let mut s = s.clone();
            f(&mut s);
            cfg.rope_scaling = Some(RopeScaling::LongRope(s));
            problem(&cfg).unwrap()
        };
        let short = bad(|s| {
            s.long_factor.pop();
        });
        assert!(short.contains("long_factor: 7 values"), "{short}");
        assert!(bad(|s| s.short_factor[2] = -1.0).contains("short_factor 2 is -1"));
        assert!(bad(|s| s.attention_factor = 0.0).contains("attention factor"));
    }
}
