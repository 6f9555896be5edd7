//! Choosing the next token from logits: greedy, or a seeded draw after temperature, top-k and
//! top-p (nucleus) filtering.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, WgparError};
use crate::kernels::ops::LogitAdjust;
use crate::model::constraint::Constraint;

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
        self.sample_min_p(logits, 0.0)
    }

    /// As [`Self::sample`], then keeps only tokens whose probability is at least `min_p`
    /// times the most likely one's (after top-k and top-p; 0 keeps all).
    pub fn sample_min_p(&mut self, logits: &[f32], min_p: f32) -> u32 {
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
        if min_p > 0.0 {
            // `probs` is sorted, most likely first.
            let floor = probs[0] * min_p as f64;
            let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
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

/// What a serving request adds to the pick: logit bias, a token allow-list, penalties and
/// min-p, on top of greedy or seeded sampling. Applied in that order to a row's logits (as
/// vLLM orders its logits processors and penalties), then temperature, top-k, top-p, min-p.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PickRules {
    /// Seeded sampling (`None`: the most likely token).
    pub sampling: Option<SamplingParams>,
    /// Added to a token's logit (`logit_bias`; -100 bans it, +100 all but forces it).
    pub bias: Vec<(u32, f32)>,
    /// Only these tokens may be picked (`allowed_token_ids`).
    pub allowed: Option<Vec<u32>>,
    /// Subtracted once from the logit of every token generated so far (OpenAI's rule).
    pub presence: f32,
    /// Subtracted per occurrence among the generated tokens (OpenAI's rule).
    pub frequency: f32,
    /// Divides positive logits and multiplies negative ones of every token in the prompt or
    /// generated so far (the CTRL / Hugging Face rule; 1: none).
    pub repetition: f32,
    /// Drops tokens less likely than this share of the most likely one (0: none).
    pub min_p: f32,
    /// `end_tokens` cannot be picked before this many tokens are generated (vLLM's
    /// `min_tokens`).
    pub min_tokens: usize,
    /// The tokens that end a request (end-of-sequence and stop ids), for `min_tokens`.
    pub end_tokens: Vec<u32>,
}

impl PickRules {
    /// The most likely token, no rule acting on the logits.
    pub fn greedy() -> Self {
        Self {
            sampling: None,
            bias: Vec::new(),
            allowed: None,
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            min_p: 0.0,
            min_tokens: 0,
            end_tokens: Vec::new(),
        }
    }

    /// Nothing to do beyond the most likely token: the device's greedy pick serves it.
    pub fn is_greedy(&self) -> bool {
        // min-p only trims what a draw may pick: the most likely token always stays.
        self.sampling.is_none() && !self.changes_logits()
    }

    fn changes_logits(&self) -> bool {
        !self.bias.is_empty()
            || self.allowed.is_some()
            || self.presence != 0.0
            || self.frequency != 0.0
            || self.repetition != 1.0
            || self.min_tokens > 0
    }

    /// The temperature log-probabilities are taken at (1 for greedy picks).
    pub fn temperature(&self) -> f32 {
        self.sampling.map_or(1.0, |s| s.temperature)
    }
}

/// A token's log-probability and the `top` most likely tokens' (most likely first, ties to
/// the lower id).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token.
    pub id: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens with theirs.
    pub top: Vec<(u32, f32)>,
}

/// A picked token, with its log-probabilities when asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Picked {
    /// The token.
    pub id: u32,
    /// Its log-probabilities (`None` unless the request asked).
    pub logprobs: Option<TokenLogprobs>,
}

/// One request's picker on the host, over its row's read-back logits: the rules, the
/// sampler's own seeded stream, and the token counts the penalties need.
#[derive(Debug, Clone)]
pub struct RequestPicker {
    rules: PickRules,
    sampler: Option<Sampler>,
    /// Generated tokens' counts (presence and frequency penalties).
    counts: std::collections::HashMap<u32, u32>,
    /// Tokens of the prompt or generated (repetition penalty).
    seen: std::collections::HashSet<u32>,
    /// Log-probabilities of how many top tokens to return (`None`: none at all).
    logprobs: Option<usize>,
    /// The grammar the output must follow (structured output), if any.
    constraint: Option<Constraint>,
}

impl RequestPicker {
    /// A picker for a request with `prompt`; `logprobs`: how many top tokens to report.
    pub fn new(rules: PickRules, logprobs: Option<usize>, prompt: &[u32]) -> Result<Self> {
        let sampler = rules.sampling.map(Sampler::new).transpose()?;
        Ok(Self {
            sampler,
            counts: Default::default(),
            seen: prompt.iter().copied().collect(),
            logprobs,
            rules,
            constraint: None,
        })
    }

    /// The same picker, its tokens held to `constraint`'s grammar: the grammar's mask
    /// applies after every other rule, so no bias or penalty brings back a token it bans.
    pub fn with_constraint(mut self, constraint: Constraint) -> Self {
        self.constraint = Some(constraint);
        self
    }

    /// `logits` with the bias, allow-list and penalties applied.
    pub fn processed(&self, logits: &[f32]) -> Vec<f32> {
        let r = &self.rules;
        let mut out = logits.to_vec();
        let n = out.len();
        if let Some(allowed) = &r.allowed {
            let mut masked = vec![f32::NEG_INFINITY; out.len()];
            for &t in allowed.iter().filter(|&&t| (t as usize) < out.len()) {
                masked[t as usize] = out[t as usize];
            }
            out = masked;
        }
        for &(t, b) in r.bias.iter().filter(|(t, _)| (*t as usize) < n) {
            out[t as usize] += b;
        }
        if r.repetition != 1.0 {
            for &t in self.seen.iter().filter(|&&t| (t as usize) < n) {
                let x = &mut out[t as usize];
                *x = if *x > 0.0 {
                    *x / r.repetition
                } else {
                    *x * r.repetition
                };
            }
        }
        for (&t, &c) in self.counts.iter().filter(|(t, _)| (**t as usize) < n) {
            out[t as usize] -= r.frequency * c as f32 + r.presence;
        }
        if self.counts.values().sum::<u32>() < r.min_tokens as u32 {
            for &t in r.end_tokens.iter().filter(|&&t| (t as usize) < n) {
                out[t as usize] = f32::NEG_INFINITY;
            }
        }
        out
    }

    /// Picks the next token from its row's `logits` and counts it; fails only when the
    /// grammar of a constrained request has no continuation.
    pub fn pick(&mut self, logits: &[f32]) -> Result<Picked> {
        let mut processed = self.processed(logits);
        if let Some(c) = &mut self.constraint {
            c.mask(&mut processed)?;
        }
        let id = match &mut self.sampler {
            Some(s) => s.sample_min_p(&processed, self.rules.min_p),
            None => argmax(&processed),
        };
        let logprobs = self
            .logprobs
            .map(|k| token_logprobs(&processed, self.rules.temperature(), id, k));
        self.accept(id)?;
        Ok(Picked { id, logprobs })
    }

    /// The changes [`Self::processed`] makes to row `row`'s logits, as sparse entries for
    /// the device's greedy pick (`kernels::ops::LogitAdjust`; tokens at or past `vocab`
    /// left out, as the host leaves them), or `None` when this picker needs the logits on
    /// the host: it samples, reports log-probs or keeps to an allow-list. The grammar's
    /// mask is [`Self::grammar_mask`], applied by the pick after these.
    pub fn device_adjustments(&self, row: u32, vocab: usize) -> Option<Vec<LogitAdjust>> {
        let r = &self.rules;
        if self.sampler.is_some() || self.logprobs.is_some() || r.allowed.is_some() {
            return None;
        }
        let mut by_token = std::collections::BTreeMap::new();
        let mut entry = |t: u32, change: &dyn Fn(&mut LogitAdjust)| {
            let e = by_token.entry(t).or_insert(LogitAdjust {
                row,
                token: t,
                add: 0.0,
                repetition: 1.0,
                sub: 0.0,
            });
            change(e);
        };
        for &(t, b) in &r.bias {
            entry(t, &|e| e.add += b);
        }
        if r.repetition != 1.0 {
            for &t in &self.seen {
                entry(t, &|e| e.repetition = r.repetition);
            }
        }
        if r.frequency != 0.0 || r.presence != 0.0 {
            for (&t, &c) in &self.counts {
                entry(t, &|e| e.sub = r.frequency * c as f32 + r.presence);
            }
        }
        if self.counts.values().sum::<u32>() < r.min_tokens as u32 {
            for &t in &r.end_tokens {
                // x - inf is -inf: the host's ban, after everything else.
                entry(t, &|e| e.sub = f32::INFINITY);
            }
        }
        Some(
            by_token
                .into_values()
                .filter(|e| (e.token as usize) < vocab)
                .collect(),
        )
    }

    /// The grammar's bit set of the tokens allowed next (`None`: no grammar), for a device
    /// pick; fails when the grammar has no continuation.
    pub fn grammar_mask(&mut self) -> Option<Result<Vec<u32>>> {
        self.constraint.as_mut().map(Constraint::allowed)
    }

    /// Takes `id` as the next token (picked here or on the device): the grammar advances
    /// and the penalties count it; fails when the grammar does not allow it.
    pub fn accept(&mut self, id: u32) -> Result<()> {
        if let Some(c) = &mut self.constraint {
            c.consume(id)?;
        }
        *self.counts.entry(id).or_default() += 1;
        self.seen.insert(id);
        Ok(())
    }

    /// The log-probabilities of a given `token` (a prompt's own, for `echo`): of the raw
    /// logits after temperature, as no rule has acted on the prompt.
    pub fn score(&self, logits: &[f32], token: u32) -> TokenLogprobs {
        let k = self.logprobs.unwrap_or(0);
        token_logprobs(logits, self.rules.temperature(), token, k)
    }
}

/// The most likely token (NaN never wins; ties go to the lower id).
fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, x) in logits.iter().enumerate().filter(|(_, x)| !x.is_nan()) {
        if best.is_none_or(|b| *x > logits[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// Log-softmax of `logits / temperature`, in f64.
pub fn log_softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
    let t = temperature as f64;
    let scaled: Vec<f64> = logits.iter().map(|&x| x as f64 / t).collect();
    let top = scaled
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = scaled.iter().map(|x| (x - top).exp()).sum();
    let log_sum = top + sum.ln();
    scaled.iter().map(|x| x - log_sum).collect()
}

/// `token`'s log-probability under `logits / temperature`, with the `k` most likely.
pub fn token_logprobs(logits: &[f32], temperature: f32, token: u32, k: usize) -> TokenLogprobs {
    let lp = log_softmax(logits, temperature);
    let mut order: Vec<usize> = (0..lp.len()).filter(|&i| !lp[i].is_nan()).collect();
    let k = k.min(order.len());
    if k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
        order.truncate(k);
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    }
    TokenLogprobs {
        id: token,
        logprob: lp
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&x| x as f32),
        top: order[..k]
            .iter()
            .map(|&i| (i as u32, lp[i] as f32))
            .collect(),
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

    fn rules() -> PickRules {
        PickRules {
            sampling: None,
            bias: vec![(0, -100.0), (3, 0.5)],
            allowed: None,
            presence: 0.25,
            frequency: 0.5,
            repetition: 2.0,
            min_p: 0.0,
            min_tokens: 0,
            end_tokens: Vec::new(),
        }
    }

    #[test]
    fn rules_bias_then_penalise_then_pick() {
        // Token 1 is in the prompt; token 2 was generated twice, token 3 once.
        let mut p = RequestPicker::new(rules(), Some(2), &[1]).unwrap();
        p.counts.insert(2, 2);
        p.counts.insert(3, 1);
        p.seen.extend([2, 3]);
        let got = p.processed(&[5.0, 4.0, -1.0, 1.0, 0.5]);
        // 0: banned; 1: 4/2; 2: -1*2 - (0.5*2 + 0.25); 3: (1+0.5)/2 - 0.75; 4: untouched.
        let want = [-95.0, 2.0, -3.25, 0.0, 0.5];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
        let picked = p.pick(&[5.0, 4.0, -1.0, 1.0, 0.5]).unwrap();
        assert_eq!(picked.id, 1);
        let lp = picked.logprobs.unwrap();
        let z: f64 = want.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp.logprob as f64 - (2.0 - z.ln())).abs() < 1e-5, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 4]);
        // The pick is counted for the next step's penalties.
        assert_eq!(p.counts[&1], 1);
    }

    #[test]
    fn allow_list_and_min_p_cut_candidates() {
        let mut only = rules();
        only.bias.clear();
        only.repetition = 1.0;
        only.allowed = Some(vec![2, 4]);
        let mut p = RequestPicker::new(only, None, &[]).unwrap();
        assert_eq!(p.pick(&[9.0, 8.0, 1.0, 7.0, 2.0]).unwrap().id, 4);
        // Probabilities 0.5, 0.3, 0.2; min-p 0.5 keeps those >= 0.25: tokens 0 and 1.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = Sampler::new(params(1.0, 0, 1.0)).unwrap();
        let mut c = [0usize; 3];
        for _ in 0..5_000 {
            c[s.sample_min_p(&logits, 0.5) as usize] += 1;
        }
        assert_eq!(c[2], 0, "{c:?}");
        assert!((c[0] as f64 / 5_000.0 - 0.625).abs() < 0.03, "{c:?}");
    }

    #[test]
    fn logprobs_are_after_temperature() {
        let logits = [1.0f32, 2.0, 0.5];
        let t = token_logprobs(&logits, 0.5, 0, 3);
        let z: f64 = logits.iter().map(|&x| (x as f64 / 0.5).exp()).sum();
        assert!((t.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 0, 2]);
        let total: f64 = t.top.iter().map(|x| (x.1 as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
