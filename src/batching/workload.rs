//! The requests of a serving benchmark: seeded Poisson arrivals (or all at once) and prompt
//! and output lengths, fixed or drawn uniformly, as vLLM's `benchmark_serving` makes them.

use std::fmt;
use std::str::FromStr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// The slowest Poisson rate accepted: one request per 10^6 s (about 11.6 days) on average.
/// Slower rates put arrivals past what a clock can wait for.
pub const MIN_RATE: f64 = 1e-6;

/// Most requests one workload makes.
pub const MAX_REQUESTS: usize = 1_000_000;

/// Most prompt tokens one workload holds at once (256 MiB of token ids).
pub const MAX_WORKLOAD_TOKENS: usize = 1 << 26;

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Rate {
    /// A Poisson process of this many requests per second (exponential gaps).
    PerSecond(f64),
    /// Every request at time zero.
    Burst,
}

impl FromStr for Rate {
    type Err = String;

    /// `inf` or a positive number of requests per second.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.eq_ignore_ascii_case("inf") {
            return Ok(Rate::Burst);
        }
        match text.parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 && r < MIN_RATE => Err(format!(
                "rate {text} req/s is a request every {:.3e} s on average; the slowest rate \
                 is {MIN_RATE:e} req/s",
                1.0 / r
            )),
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Rate::PerSecond(r)),
            Ok(f) if f.is_infinite() && f > 0.0 => Ok(Rate::Burst),
            _ => Err(format!(
                "'{text}' is not a rate: expected requests per second (> 0) or inf"
            )),
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rate::PerSecond(r) => write!(f, "{r} req/s"),
            Rate::Burst => f.write_str("inf"),
        }
    }
}

/// A length, fixed or drawn uniformly from an inclusive range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Length {
    /// Always this many tokens.
    Fixed(usize),
    /// Uniform over `min..=max` tokens.
    Uniform {
        /// Smallest.
        min: usize,
        /// Largest.
        max: usize,
    },
}

impl Length {
    /// The largest value it can take.
    pub fn max(&self) -> usize {
        match *self {
            Length::Fixed(n) => n,
            Length::Uniform { max, .. } => max,
        }
    }

    fn draw(&self, rng: &mut ChaCha8Rng) -> usize {
        match *self {
            Length::Fixed(n) => n,
            Length::Uniform { min, max } => rng.random_range(min..=max),
        }
    }
}

impl FromStr for Length {
    type Err = String;

    /// `N` (fixed) or `MIN:MAX` (uniform, inclusive); every value at least 1.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || format!("'{text}' is not a length: expected N or MIN:MAX, all >= 1");
        let num = |t: &str| t.trim().parse::<usize>().ok().filter(|&n| n >= 1);
        match text.split_once(':') {
            None => num(text).map(Length::Fixed).ok_or_else(bad),
            Some((a, b)) => match (num(a), num(b)) {
                (Some(min), Some(max)) if min <= max => Ok(if min == max {
                    Length::Fixed(min)
                } else {
                    Length::Uniform { min, max }
                }),
                (Some(min), Some(max)) => Err(format!(
                    "'{text}': MIN {min} is larger than MAX {max}; give MIN:MAX with MIN <= MAX"
                )),
                _ => Err(bad()),
            },
        }
    }
}

impl fmt::Display for Length {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Length::Fixed(n) => write!(f, "{n}"),
            Length::Uniform { min, max } => write!(f, "{min}:{max}"),
        }
    }
}

/// What requests to make.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadSpec {
    /// Number of requests.
    pub requests: usize,
    /// Arrival process.
    pub rate: Rate,
    /// Prompt tokens per request.
    pub prompt_len: Length,
    /// Tokens to generate per request (the first comes from the prefill).
    pub output_len: Length,
    /// Seed of arrivals, lengths and token ids.
    pub seed: u64,
}

/// One request of a serving run.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeRequest {
    /// Index in the workload.
    pub id: usize,
    /// Arrival, seconds after the start of the run.
    pub arrival_s: f64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate (>= 1; the first comes from the prefill).
    pub max_new: usize,
    /// A later turn of a multi-turn session: the request whose prompt and answer come first
    /// in this one's prompt. It is sent when that one is done (its `arrival_s` is then
    /// unused), and `prompt` holds only its new turn.
    pub follows: Option<usize>,
}

impl WorkloadSpec {
    /// Checks the workload's size before anything is allocated: at most `MAX_REQUESTS`
    /// requests and `MAX_WORKLOAD_TOKENS` prompt tokens (at the longest prompt).
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.requests == 0 {
            return Err("--requests must be at least 1".into());
        }
        if self.requests > MAX_REQUESTS {
            return Err(format!(
                "--requests {} is more than the {MAX_REQUESTS} one run makes",
                self.requests
            ));
        }
        let tokens = self.requests.saturating_mul(self.prompt_len.max());
        if tokens > MAX_WORKLOAD_TOKENS {
            return Err(format!(
                "--requests {} x --prompt-len up to {} is {tokens} prompt tokens; one run \
                 holds at most {MAX_WORKLOAD_TOKENS}",
                self.requests,
                self.prompt_len.max()
            ));
        }
        Ok(())
    }

    /// The requests, in arrival order, with token ids below `vocab`.
    pub fn generate(&self, vocab: usize) -> Vec<ServeRequest> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut t = 0.0f64;
        (0..self.requests)
            .map(|id| {
                if let Rate::PerSecond(r) = self.rate {
                    // Exponential gap: -ln(U) / rate, U in (0, 1].
                    let u: f64 = 1.0 - rng.random::<f64>();
                    t += -u.ln() / r;
                }
                let prompt_len = self.prompt_len.draw(&mut rng);
                let max_new = self.output_len.draw(&mut rng);
                let prompt = (0..prompt_len)
                    .map(|_| rng.random_range(0..vocab.max(1) as u32))
                    .collect();
                ServeRequest {
                    id,
                    arrival_s: t,
                    prompt,
                    max_new,
                    follows: None,
                }
            })
            .collect()
    }
}

/// One more request among a workload's: a long prompt arriving at a set time, to measure
/// what it does to the streams already running (`bench serve --long-prompt TOKENS@SECONDS`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LongPrompt {
    /// Its prompt tokens.
    pub tokens: usize,
    /// Its arrival, seconds after the start of the run.
    pub at_s: f64,
}

impl FromStr for LongPrompt {
    type Err = String;

    /// `TOKENS@SECONDS`, e.g. `1500@2.5`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad =
            || format!("'{text}' is not a long prompt: expected TOKENS@SECONDS, e.g. 1500@2.5");
        let (tokens, at) = text.split_once('@').ok_or_else(bad)?;
        let tokens = tokens.trim().parse::<usize>().ok().filter(|&n| n >= 1);
        let at_s = at.trim().parse::<f64>().ok();
        match (tokens, at_s) {
            (Some(tokens), Some(at_s)) if (0.0..=1e6).contains(&at_s) => Ok(Self { tokens, at_s }),
            _ => Err(bad()),
        }
    }
}

impl LongPrompt {
    /// `requests` with this one among them in arrival order (ids renumbered), generating
    /// `max_new` tokens, its token ids below `vocab` drawn from `seed`.
    pub fn insert(
        &self,
        mut requests: Vec<ServeRequest>,
        max_new: usize,
        vocab: usize,
        seed: u64,
    ) -> Vec<ServeRequest> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6c6f_6e67);
        let prompt = (0..self.tokens)
            .map(|_| rng.random_range(0..vocab.max(1) as u32))
            .collect();
        let at = requests.partition_point(|r| r.arrival_s <= self.at_s);
        let long = ServeRequest {
            id: at,
            arrival_s: self.at_s,
            prompt,
            max_new,
            follows: None,
        };
        requests.insert(at, long);
        for (id, r) in requests.iter_mut().enumerate() {
            r.id = id;
            r.follows = r.follows.map(|p| if p >= at { p + 1 } else { p });
        }
        requests
    }
}

/// Prompts that repeat, as chat and agent traffic does (`bench serve --shared-prefix N
/// --turns T`): every session's first prompt starts with one system prompt of
/// `shared_prefix` tokens, and each of `--requests` sessions makes `turns` requests, each
/// later one repeating the previous request's prompt and answer and adding a new user turn
/// of `--prompt-len` tokens, sent when the previous answer is done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Sessions {
    /// Tokens of the system prompt every session starts with (0: none).
    pub shared_prefix: usize,
    /// Requests per session (1: single-turn).
    pub turns: usize,
}

impl Sessions {
    /// Whether it changes the workload at all.
    pub fn any(&self) -> bool {
        self.shared_prefix > 0 || self.turns > 1
    }

    /// The longest whole prompt a session sends, with user turns of up to `prompt` tokens
    /// and answers of up to `output`.
    pub fn longest_prompt(&self, prompt: usize, output: usize) -> usize {
        let turns = self.turns.max(1);
        self.shared_prefix + turns * prompt + (turns - 1) * output
    }

    /// `spec`'s requests as sessions: the first turns arrive on `spec`'s clock, session after
    /// session, each followed by its later turns (drawn from `spec`'s lengths, another seed);
    /// token ids below `vocab`.
    pub fn generate(&self, spec: &WorkloadSpec, vocab: usize) -> Vec<ServeRequest> {
        let firsts = spec.generate(vocab);
        let turns = self.turns.max(1);
        let mut later = WorkloadSpec {
            requests: firsts.len() * (turns - 1),
            rate: Rate::Burst,
            seed: spec.seed ^ 0x7475_726e,
            ..spec.clone()
        }
        .generate(vocab)
        .into_iter();
        let mut rng = ChaCha8Rng::seed_from_u64(spec.seed ^ 0x7379_7374);
        let system: Vec<u32> = (0..self.shared_prefix)
            .map(|_| rng.random_range(0..vocab.max(1) as u32))
            .collect();
        let mut out = Vec::with_capacity(firsts.len() * turns);
        for mut first in firsts {
            first.prompt.splice(0..0, system.iter().copied());
            let at = first.arrival_s;
            out.push(first);
            for _ in 1..turns {
                let mut next = later.next().expect("one request per later turn");
                (next.arrival_s, next.follows) = (at, Some(out.len() - 1));
                out.push(next);
            }
        }
        for (id, r) in out.iter_mut().enumerate() {
            r.id = id;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_lengths_parse_or_say_why_not() {
        assert_eq!("inf".parse::<Rate>(), Ok(Rate::Burst));
        assert_eq!("2.5".parse::<Rate>(), Ok(Rate::PerSecond(2.5)));
        for bad in ["0", "-1", "nan", "fast", ""] {
            let e = bad.parse::<Rate>().unwrap_err();
            assert!(e.contains("requests per second"), "{bad}: {e}");
        }
        for slow in ["1e-20", "1e-7", "5e-300"] {
            let e = slow.parse::<Rate>().unwrap_err();
            assert!(e.contains("slowest rate"), "{slow}: {e}");
        }
        assert!("1e-6".parse::<Rate>().is_ok());
        assert_eq!("32".parse::<Length>(), Ok(Length::Fixed(32)));
        assert_eq!(
            "8:40".parse::<Length>(),
            Ok(Length::Uniform { min: 8, max: 40 })
        );
        assert_eq!("5:5".parse::<Length>(), Ok(Length::Fixed(5)));
        for bad in ["0", "9:3", "a:b", "1:", "-4", "3:0"] {
            assert!(bad.parse::<Length>().is_err(), "{bad}");
        }
    }

    #[test]
    fn poisson_arrivals_are_seeded_and_at_the_asked_rate() {
        let spec = WorkloadSpec {
            requests: 4000,
            rate: Rate::PerSecond(20.0),
            prompt_len: Length::Uniform { min: 4, max: 12 },
            output_len: Length::Fixed(3),
            seed: 7,
        };
        let a = spec.generate(100);
        assert_eq!(a, spec.generate(100), "same seed, same workload");
        let other = WorkloadSpec {
            seed: 8,
            ..spec.clone()
        }
        .generate(100);
        assert_ne!(a, other);
        assert!(a.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        // 4000 arrivals at 20/s take about 200 s (sd of the sum: sqrt(4000)/20 = 3.2 s).
        let last = a.last().unwrap().arrival_s;
        assert!((last - 200.0).abs() < 20.0, "{last}");
        assert!(a.iter().all(|r| (4..=12).contains(&r.prompt.len())
            && r.max_new == 3
            && r.prompt.iter().all(|&t| t < 100)));
        let lens: std::collections::BTreeSet<usize> = a.iter().map(|r| r.prompt.len()).collect();
        assert_eq!(lens.len(), 9, "every length in the range is drawn");
        let burst = WorkloadSpec {
            rate: Rate::Burst,
            ..spec
        }
        .generate(100);
        assert!(burst.iter().all(|r| r.arrival_s == 0.0));
    }

    #[test]
    fn sessions_share_a_system_prompt_and_chain_their_turns() {
        let spec = WorkloadSpec {
            requests: 3,
            rate: Rate::PerSecond(10.0),
            prompt_len: Length::Uniform { min: 2, max: 6 },
            output_len: Length::Fixed(3),
            seed: 4,
        };
        let s = Sessions {
            shared_prefix: 5,
            turns: 2,
        };
        let all = s.generate(&spec, 50);
        assert_eq!(all.len(), 6);
        assert!(all.iter().enumerate().all(|(i, r)| r.id == i));
        let firsts: Vec<_> = all.iter().step_by(2).collect();
        assert!(firsts.iter().all(|r| r.follows.is_none()
            && r.prompt[..5] == firsts[0].prompt[..5]
            && (7..=11).contains(&r.prompt.len())));
        for (i, r) in all.iter().enumerate().skip(1).step_by(2) {
            assert_eq!(r.follows, Some(i - 1));
            assert_eq!(r.arrival_s, all[i - 1].arrival_s);
            assert!((2..=6).contains(&r.prompt.len()));
        }
        assert!(all.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        assert_eq!(s.longest_prompt(6, 3), 5 + 12 + 3);
        assert!(!Sessions::default().any());
    }

    #[test]
    fn a_long_prompt_lands_in_arrival_order() {
        let lp: LongPrompt = "30@0.2".parse().unwrap();
        assert_eq!((lp.tokens, lp.at_s), (30, 0.2));
        for bad in ["30", "0@1", "30@-1", "30@nan", "a@1", "30@1e9"] {
            assert!(bad.parse::<LongPrompt>().is_err(), "{bad}");
        }
        let spec = WorkloadSpec {
            requests: 20,
            rate: Rate::PerSecond(50.0),
            prompt_len: Length::Fixed(4),
            output_len: Length::Fixed(3),
            seed: 5,
        };
        let base = spec.generate(100);
        let all = lp.insert(base.clone(), 7, 100, 5);
        assert_eq!(all.len(), 21);
        assert!(all.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        assert!(all.iter().enumerate().all(|(i, r)| r.id == i));
        let long: Vec<_> = all.iter().filter(|r| r.prompt.len() == 30).collect();
        assert_eq!(long.len(), 1);
        assert_eq!((long[0].arrival_s, long[0].max_new), (0.2, 7));
        assert!(long[0].prompt.iter().all(|&t| t < 100));
        // Some of the others came before it, some after.
        assert!(all[0].prompt.len() == 4 && all[20].prompt.len() == 4);
    }
}
