//! What a serving run achieved, as vLLM's `benchmark_serving` reports it: request and token
//! throughput, time to first token (TTFT), time per output token after the first (TPOT),
//! inter-token latency (ITL: every gap between two successive tokens of a request, pooled over
//! the requests, and the longest) and end-to-end latency percentiles; plus the bubble and
//! communication shares of the devices. A latency with no sample is `n/a` (JSON `null`), never 0.

use serde::Serialize;

use crate::stats::percentile;
use crate::trace::{SpanId, Summary};

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestOutcome {
    /// Index in the workload.
    pub id: usize,
    /// Arrival, seconds after the start of the run.
    pub arrival_s: f64,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens asked for.
    pub max_new: usize,
    /// Generated tokens (greedy); empty when refused.
    pub tokens: Vec<u32>,
    /// Why the request was refused (it never entered the batch), if it was.
    pub error: Option<String>,
    /// First token sampled, seconds after the start of the run.
    pub first_token_s: Option<f64>,
    /// Last token sampled, seconds after the start of the run.
    pub done_s: Option<f64>,
    /// When each generated token was sampled, seconds after the start of the run.
    #[serde(skip)]
    pub token_s: Vec<f64>,
    /// Arrival on the recorder's clock, microseconds since its epoch.
    #[serde(skip)]
    pub arrival_us: f64,
    /// The span that delivered the first token.
    #[serde(skip)]
    pub first_span: SpanId,
    /// The span that delivered the last token.
    #[serde(skip)]
    pub last_span: SpanId,
}

/// One completed request's times, seconds on one clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Arrival.
    pub arrival_s: f64,
    /// First token.
    pub first_s: f64,
    /// Last token.
    pub done_s: f64,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Generated tokens.
    pub output_tokens: usize,
}

/// Mean and percentiles of one latency, milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    /// No sample: every figure NaN, printed `n/a` and serialized as JSON `null`.
    pub const NONE: Self = Self {
        mean: f64::NAN,
        p50: f64::NAN,
        p90: f64::NAN,
        p99: f64::NAN,
    };

    /// Of `values` ([`Percentiles::NONE`] when empty).
    pub fn of(values: &[f64]) -> Self {
        if values.is_empty() {
            return Self::NONE;
        }
        let p = |q| percentile(values, q).unwrap_or(0.0);
        Self {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: p(50.0),
            p90: p(90.0),
            p99: p(99.0),
        }
    }
}

/// Headline figures of a serving run (measured, or projected onto a host profile).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ServeMetrics {
    /// Requests that finished.
    pub completed: usize,
    /// Requests refused (longer than the KV capacity, ...).
    pub failed: usize,
    /// First arrival to last completion, seconds.
    pub duration_s: f64,
    /// Prompt tokens of the completed requests.
    pub input_tokens: usize,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Generated tokens per second.
    pub output_tokens_per_s: f64,
    /// Prompt and generated tokens per second.
    pub total_tokens_per_s: f64,
    /// Time to first token, ms.
    pub ttft_ms: Percentiles,
    /// Time per output token after the first, ms (requests of one token have none).
    pub tpot_ms: Percentiles,
    /// Gaps between successive tokens of a request, pooled over the requests, ms.
    pub itl_ms: Percentiles,
    /// The longest gap between two successive tokens of any request, ms (NaN: none).
    pub max_itl_ms: f64,
    /// Arrival to last token, ms.
    pub e2e_ms: Percentiles,
    /// Device-time not spent computing, over the run (`None`: no device timeline, as for a
    /// server measured over HTTP).
    pub bubble_share: Option<f64>,
    /// Device-time with a transfer or collective in flight, over the run (`None`: as above).
    pub comm_share: Option<f64>,
}

impl ServeMetrics {
    /// The figures of `timings`, with `failed` refused requests, and the shares of the run's
    /// timeline `summary` where the run has one (an engine here, not a server over HTTP).
    /// Rates over an empty run are NaN (printed `n/a`, `null` in JSON), never 0.
    pub fn from_timings(timings: &[Timing], failed: usize, summary: Option<&Summary>) -> Self {
        let start = timings
            .iter()
            .map(|t| t.arrival_s)
            .fold(f64::INFINITY, f64::min);
        let end = timings
            .iter()
            .map(|t| t.done_s)
            .fold(f64::NEG_INFINITY, f64::max);
        let duration_s = if timings.is_empty() {
            0.0
        } else {
            (end - start).max(0.0)
        };
        let per_s = |n: usize| {
            if duration_s > 0.0 {
                n as f64 / duration_s
            } else {
                f64::NAN
            }
        };
        let input_tokens = timings.iter().map(|t| t.prompt_len).sum();
        let output_tokens = timings.iter().map(|t| t.output_tokens).sum();
        let ms = |v: Vec<f64>| Percentiles::of(&v.iter().map(|s| s * 1e3).collect::<Vec<_>>());
        Self {
            completed: timings.len(),
            failed,
            duration_s,
            input_tokens,
            output_tokens,
            request_throughput: per_s(timings.len()),
            output_tokens_per_s: per_s(output_tokens),
            total_tokens_per_s: per_s(input_tokens + output_tokens),
            ttft_ms: ms(timings.iter().map(|t| t.first_s - t.arrival_s).collect()),
            tpot_ms: ms(timings
                .iter()
                .filter(|t| t.output_tokens > 1)
                .map(|t| (t.done_s - t.first_s) / (t.output_tokens - 1) as f64)
                .collect()),
            itl_ms: Percentiles::NONE,
            max_itl_ms: f64::NAN,
            e2e_ms: ms(timings.iter().map(|t| t.done_s - t.arrival_s).collect()),
            bubble_share: summary.map(|s| s.bubble_share),
            comm_share: summary.map(|s| s.comm_share),
        }
    }

    /// With the inter-token figures of `gaps`, seconds (every gap of every request).
    pub fn with_gaps(mut self, gaps: &[f64]) -> Self {
        let ms: Vec<f64> = gaps.iter().map(|g| g * 1e3).collect();
        self.itl_ms = Percentiles::of(&ms);
        self.max_itl_ms = ms.iter().copied().fold(f64::NAN, f64::max);
        self
    }

    /// The figures as a vLLM-style block of lines.
    pub fn lines(&self, title: &str) -> String {
        let mut s = format!("============ {title} ============\n");
        let mut row = |k: &str, v: String| s.push_str(&format!("{k:<40}{v:>14}\n"));
        row("Successful requests:", self.completed.to_string());
        row("Refused requests:", self.failed.to_string());
        row("Duration (s):", format!("{:.2}", self.duration_s));
        row("Total input tokens:", self.input_tokens.to_string());
        row("Total generated tokens:", self.output_tokens.to_string());
        row("Request throughput (req/s):", ms2(self.request_throughput));
        row(
            "Output token throughput (tok/s):",
            ms2(self.output_tokens_per_s),
        );
        row(
            "Total token throughput (tok/s):",
            ms2(self.total_tokens_per_s),
        );
        for (name, short, p) in [
            ("Time to First Token", "TTFT", &self.ttft_ms),
            ("Time per Output Token (excl. 1st)", "TPOT", &self.tpot_ms),
            ("Inter-token Latency", "ITL", &self.itl_ms),
            ("End-to-end Latency", "E2E", &self.e2e_ms),
        ] {
            s.push_str(&format!("{:-^54}\n", format!(" {name} ")));
            for (q, v) in [
                ("Mean", p.mean),
                ("Median", p.p50),
                ("P90", p.p90),
                ("P99", p.p99),
            ] {
                s.push_str(&format!(
                    "{:<40}{:>14}\n",
                    format!("{q} {short} (ms):"),
                    ms2(v)
                ));
            }
            if short == "ITL" {
                let longest = ms2(self.max_itl_ms);
                s.push_str(&format!("{:<40}{longest:>14}\n", "Max ITL (ms):"));
            }
        }
        s.push_str(&format!("{:-^54}\n", " Devices "));
        let percent = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{:.1}", v * 100.0));
        s.push_str(&format!(
            "{:<40}{:>14}\n{:<40}{:>14}\n",
            "Bubble (% of device-time):",
            percent(self.bubble_share),
            "Communication (% of device-time):",
            percent(self.comm_share)
        ));
        s.push_str(&"=".repeat(54));
        s.push('\n');
        s
    }
}

/// A latency in ms (or a rate) with two decimals, or `n/a` when there was no sample.
fn ms2(v: f64) -> String {
    if v.is_nan() {
        "n/a".into()
    } else {
        format!("{v:.2}")
    }
}

/// Every gap between successive token times of each request, seconds.
pub fn token_gaps(outcomes: &[RequestOutcome]) -> Vec<f64> {
    (outcomes.iter())
        .flat_map(|o| o.token_s.windows(2).map(|w| w[1] - w[0]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Timeline;

    #[test]
    fn figures_follow_their_definitions() {
        let timings = [
            // Arrives at 0, first token at 0.1, 5 tokens by 0.5: TPOT 0.1 s.
            Timing {
                arrival_s: 0.0,
                first_s: 0.1,
                done_s: 0.5,
                prompt_len: 8,
                output_tokens: 5,
            },
            // One token only: no TPOT.
            Timing {
                arrival_s: 1.0,
                first_s: 1.3,
                done_s: 1.3,
                prompt_len: 4,
                output_tokens: 1,
            },
            Timing {
                arrival_s: 1.5,
                first_s: 1.6,
                done_s: 2.0,
                prompt_len: 8,
                output_tokens: 3,
            },
        ];
        let m = ServeMetrics::from_timings(&timings, 1, Some(&Timeline::new().summary()));
        assert_eq!((m.completed, m.failed), (3, 1));
        assert!((m.duration_s - 2.0).abs() < 1e-12);
        assert_eq!((m.input_tokens, m.output_tokens), (20, 9));
        assert!((m.request_throughput - 1.5).abs() < 1e-12);
        assert!((m.output_tokens_per_s - 4.5).abs() < 1e-12);
        assert!((m.total_tokens_per_s - 14.5).abs() < 1e-12);
        assert!((m.ttft_ms.p50 - 100.0).abs() < 1e-9);
        assert!((m.ttft_ms.mean - 500.0 / 3.0).abs() < 1e-9);
        assert!((m.tpot_ms.mean - 150.0).abs() < 1e-9, "{:?}", m.tpot_ms);
        assert!((m.e2e_ms.p99 - 500.0).abs() < 1e-6, "{:?}", m.e2e_ms);
        assert!((m.e2e_ms.p50 - 500.0).abs() < 1e-6, "{:?}", m.e2e_ms);
        let text = m.lines("Serving Benchmark Result");
        for want in [
            "Mean TTFT (ms):",
            "P99 TPOT (ms):",
            "Median E2E (ms):",
            "Bubble",
        ] {
            assert!(text.contains(want), "{text}");
        }
        let empty = ServeMetrics::from_timings(&[], 2, None);
        assert_eq!((empty.completed, empty.duration_s), (0, 0.0));
        // No sample is n/a, never 0: in the text, and null in JSON.
        let text = empty.lines("x");
        for want in [
            "Median TTFT (ms):",
            "P99 ITL (ms):",
            "Max ITL (ms):",
            "Request throughput (req/s):",
            "Bubble (% of device-time):",
            "Communication (% of device-time):",
        ] {
            let line = text.lines().find(|l| l.starts_with(want)).unwrap();
            assert!(line.ends_with("n/a"), "{line}");
        }
        let json = serde_json::to_value(&empty).unwrap();
        assert!(
            json["itl_ms"]["p50"].is_null() && json["max_itl_ms"].is_null(),
            "{json}"
        );
        assert!(json["ttft_ms"]["p99"].is_null(), "{json}");
        assert!(
            json["request_throughput"].is_null() && json["bubble_share"].is_null(),
            "{json}"
        );
    }

    #[test]
    fn inter_token_latency_pools_every_gap() {
        let outcome = |token_s: Vec<f64>| RequestOutcome {
            id: 0,
            arrival_s: 0.0,
            prompt_len: 1,
            max_new: token_s.len(),
            tokens: vec![0; token_s.len()],
            error: None,
            first_token_s: token_s.first().copied(),
            done_s: token_s.last().copied(),
            token_s,
            arrival_us: 0.0,
            first_span: SpanId::NONE,
            last_span: SpanId::NONE,
        };
        // Gaps 0.1, 0.1, 2.0 (a stall) and 0.3; a one-token request has none.
        let outcomes = [
            outcome(vec![1.0, 1.1, 1.2, 3.2]),
            outcome(vec![0.5, 0.8]),
            outcome(vec![4.0]),
        ];
        let gaps = token_gaps(&outcomes);
        assert_eq!(gaps.len(), 4);
        let m = ServeMetrics::default().with_gaps(&gaps);
        assert!((m.max_itl_ms - 2000.0).abs() < 1e-6, "{}", m.max_itl_ms);
        assert!(
            (m.itl_ms.mean - 2500.0 / 4.0).abs() < 1e-6,
            "{:?}",
            m.itl_ms
        );
        let want_p50 = percentile(&[100.0, 100.0, 2000.0, 300.0], 50.0).unwrap();
        assert!((m.itl_ms.p50 - want_p50).abs() < 1e-6, "{:?}", m.itl_ms);
        let text = m.lines("x");
        assert!(
            text.contains("Max ITL (ms):") && text.contains("2000.00"),
            "{text}"
        );
    }
}
