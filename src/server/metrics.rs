//! `GET /metrics`: the server's figures in Prometheus text format (prometheus-client), named
//! and meant as vLLM's own under the `wgpar:` prefix, each with a `model_name` label, so
//! dashboards and alerts written for vLLM carry over (docs/SERVING.md lists them;
//! docs/grafana-wgpar.json is a dashboard of them).
//!
//! The prefix cache's counters count tokens, as vLLM's do: `prefix_cache_queries` the prompt
//! tokens looked up, `prefix_cache_hits` those found cached (so not prefilled: the tokens
//! saved); the hit rate is their ratio. `prefix_cache_requests` and
//! `prefix_cache_request_hits` count prompts. With `--no-prefix-cache` nothing is looked up
//! and all four stay 0.

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

/// Why a request ended with its tokens (vLLM's `finished_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Finish {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens`.
    Length,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabel {
    finished_reason: &'static str,
}

type F64Gauge = Gauge<f64, AtomicU64>;

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// Requests in the running batches.
    pub running: Gauge,
    /// Requests accepted and waiting for a KV slot.
    pub waiting: Gauge,
    /// Share of the KV cache's token places holding a sequence's tokens (0 to 1).
    pub kv_usage: F64Gauge,
    /// KV slots holding a sequence.
    pub kv_slots_used: Gauge,
    /// KV slots reserved.
    pub kv_slots: Gauge,
    /// KV blocks a running sequence references (paged KV, `crate::batching::PrefixCache`).
    pub kv_blocks_used: Gauge,
    /// KV blocks nobody references that keep cached prefixes until they are evicted.
    pub kv_blocks_cached: Gauge,
    prefix_evictions: Counter,
    /// Prompt tokens of accepted requests.
    pub prompt_tokens: Counter,
    /// Tokens sent to clients.
    pub generation_tokens: Counter,
    prefix_queries: Counter,
    prefix_hits: Counter,
    prefix_requests: Counter,
    prefix_request_hits: Counter,
    /// Rows of steps whose logits came back to the host (a request picked there).
    pub logits_rows: Counter,
    success: Family<ReasonLabel, Counter>,
    /// Requests whose client went away (or stopped reading) before the end.
    pub cancelled: Counter,
    /// Requests refused with 4xx or 503.
    pub rejected: Counter,
    /// Requests ended by an engine failure.
    pub failed: Counter,
    /// Pipeline bubble share of device time (pipelines; 0 otherwise).
    pub bubble: F64Gauge,
    /// Communication share of the last step's device time.
    pub communication: F64Gauge,
    ttft: Histogram,
    itl: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    queue: Histogram,
}

/// Latency buckets, 1 ms to about 9 minutes (lavapipe's slow steps included).
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

impl Metrics {
    /// Fresh metrics of the model that `/v1/models` calls `model_name`.
    pub fn new(model_name: &str) -> Self {
        let label = [("model_name".into(), model_name.to_string().into())];
        let mut m = Self {
            registry: Registry::with_labels(label.into_iter()),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            kv_slots_used: Gauge::default(),
            kv_slots: Gauge::default(),
            kv_blocks_used: Gauge::default(),
            kv_blocks_cached: Gauge::default(),
            prefix_evictions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_requests: Counter::default(),
            prefix_request_hits: Counter::default(),
            logits_rows: Counter::default(),
            success: Family::default(),
            cancelled: Counter::default(),
            rejected: Counter::default(),
            failed: Counter::default(),
            bubble: Gauge::default(),
            communication: Gauge::default(),
            ttft: latency(),
            itl: latency(),
            tpot: latency(),
            e2e: latency(),
            queue: latency(),
        };
        m.register_all();
        // Both series exist from the start: no request has finished yet is a true 0.
        for why in [Finish::Stop, Finish::Length] {
            m.finished(why);
        }
        m
    }

    /// Registers every metric in the order the exposition lists them.
    fn register_all(&mut self) {
        self.register_gauges();
        self.register_counters();
        self.register_latencies();
    }

    fn register_gauges(&mut self) {
        let r = &mut self.registry;
        let counts = [
            (
                "num_requests_running",
                "Requests in the running batches",
                &self.running,
            ),
            (
                "num_requests_waiting",
                "Requests waiting for a KV slot",
                &self.waiting,
            ),
            (
                "kv_slots_used",
                "KV slots holding a sequence",
                &self.kv_slots_used,
            ),
            ("kv_slots", "KV slots reserved", &self.kv_slots),
            (
                "kv_blocks_used",
                "KV blocks (16 positions each) that running sequences reference",
                &self.kv_blocks_used,
            ),
            (
                "kv_blocks_cached",
                "KV blocks nobody references that hold cached prefixes",
                &self.kv_blocks_cached,
            ),
        ];
        register_each(r, counts);
        let shares = [
            (
                "kv_cache_usage_perc",
                "Share of the KV cache's token places in use (1 = full)",
                &self.kv_usage,
            ),
            (
                "bubble_ratio",
                "Pipeline bubble share of device time",
                &self.bubble,
            ),
            (
                "communication_ratio",
                "Communication share of device time",
                &self.communication,
            ),
        ];
        register_each(r, shares);
    }

    fn register_counters(&mut self) {
        let r = &mut self.registry;
        let counters = [
            (
                "prompt_tokens",
                "Prefill tokens processed",
                &self.prompt_tokens,
            ),
            (
                "generation_tokens",
                "Generation tokens processed",
                &self.generation_tokens,
            ),
            (
                "logits_readback_rows",
                "Step rows whose logits were read back for a host pick",
                &self.logits_rows,
            ),
            (
                "requests_cancelled",
                "Requests whose client left",
                &self.cancelled,
            ),
            (
                "requests_rejected",
                "Requests refused (4xx, 503)",
                &self.rejected,
            ),
            (
                "requests_failed",
                "Requests ended by an engine failure",
                &self.failed,
            ),
        ];
        register_each(r, counters);
        let prefix = [
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                &self.prefix_queries,
            ),
            (
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache (reused, not prefilled)",
                &self.prefix_hits,
            ),
            (
                "prefix_cache_requests",
                "Prompts looked up in the prefix cache",
                &self.prefix_requests,
            ),
            (
                "prefix_cache_request_hits",
                "Prompts that reused cached tokens",
                &self.prefix_request_hits,
            ),
            (
                "prefix_cache_evictions",
                "Cached KV blocks evicted, least recently used first, for fresh ones",
                &self.prefix_evictions,
            ),
        ];
        register_each(r, prefix);
        r.register(
            "wgpar:request_success",
            "Requests that finished, by finished_reason (stop, length)",
            self.success.clone(),
        );
    }

    fn register_latencies(&mut self) {
        let r = &mut self.registry;
        let latencies = [
            (
                "time_to_first_token_seconds",
                "Time to first token",
                &self.ttft,
            ),
            (
                "inter_token_latency_seconds",
                "Time between successive tokens",
                &self.itl,
            ),
            (
                "request_time_per_output_token_seconds",
                "A request's mean time per output token after the first",
                &self.tpot,
            ),
            (
                "e2e_request_latency_seconds",
                "End-to-end request latency",
                &self.e2e,
            ),
            (
                "request_queue_time_seconds",
                "Time a request waited before its prefill was scheduled",
                &self.queue,
            ),
        ];
        register_each(r, latencies);
    }

    /// A request's first token, `since` its acceptance.
    pub fn observe_first(&self, accepted: Instant) {
        self.ttft.observe(accepted.elapsed().as_secs_f64());
    }

    /// A token after the first: `gap` seconds after the one before it.
    pub fn observe_gap(&self, gap: f64) {
        self.itl.observe(gap);
    }

    /// The prefix cache's evictions so far (`total`, from its stats): the counter follows it.
    pub fn observe_evictions(&self, total: u64) {
        let seen = self.prefix_evictions.get();
        if total > seen {
            self.prefix_evictions.inc_by(total - seen);
        }
    }

    /// A prompt of `prompt` tokens took a slot reusing `reused` cached ones (looked up only
    /// when the cache is `on`).
    pub fn observe_prefix(&self, prompt: usize, reused: usize, on: bool) {
        if !on {
            return;
        }
        self.prefix_queries.inc_by(prompt as u64);
        self.prefix_hits.inc_by(reused as u64);
        self.prefix_requests.inc();
        if reused > 0 {
            self.prefix_request_hits.inc();
        }
    }

    /// A request's prefill was scheduled.
    pub fn observe_scheduled(&self, accepted: Instant) {
        self.queue.observe(accepted.elapsed().as_secs_f64());
    }

    /// A request that finished (`why`) with `generated` tokens, the first at `first`.
    pub fn observe_done(
        &self,
        accepted: Instant,
        first: Option<Instant>,
        generated: usize,
        why: Finish,
    ) {
        let reason = match why {
            Finish::Stop => "stop",
            Finish::Length => "length",
        };
        self.success
            .get_or_create(&ReasonLabel {
                finished_reason: reason,
            })
            .inc();
        self.e2e.observe(accepted.elapsed().as_secs_f64());
        if let (Some(first), true) = (first, generated > 1) {
            self.tpot
                .observe(first.elapsed().as_secs_f64() / (generated - 1) as f64);
        }
    }

    /// Requests that finished for `why` so far.
    pub fn finished(&self, why: Finish) -> u64 {
        let reason = if why == Finish::Stop {
            "stop"
        } else {
            "length"
        };
        self.success
            .get_or_create(&ReasonLabel {
                finished_reason: reason,
            })
            .get()
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

/// Registers a handle to each metric (a clone shares the value) as `wgpar:NAME`.
fn register_each<M: Metric + Clone, const N: usize>(
    registry: &mut Registry,
    metrics: [(&str, &str, &M); N],
) {
    for (name, help, metric) in metrics {
        registry.register(format!("wgpar:{name}"), help, metric.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_prefix_and_the_model_label() {
        let m = Metrics::new("tiny");
        m.running.set(3);
        let t0 = Instant::now();
        m.observe_done(t0, Some(t0), 4, Finish::Stop);
        let text = m.render();
        assert!(
            text.contains("wgpar:num_requests_running{model_name=\"tiny\"} 3"),
            "{text}"
        );
        assert!(
            text.contains(
                "wgpar:request_success_total{model_name=\"tiny\",finished_reason=\"stop\"} 1"
            ) || text.contains(
                "wgpar:request_success_total{finished_reason=\"stop\",model_name=\"tiny\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("wgpar:inter_token_latency_seconds_bucket"),
            "{text}"
        );
        // Prefix-cache counters count tokens; one off lookup counts nothing.
        m.observe_prefix(40, 32, true);
        m.observe_prefix(10, 0, true);
        m.observe_prefix(99, 0, false);
        let text = m.render();
        for line in [
            "wgpar:prefix_cache_queries_total{model_name=\"tiny\"} 50",
            "wgpar:prefix_cache_hits_total{model_name=\"tiny\"} 32",
            "wgpar:prefix_cache_requests_total{model_name=\"tiny\"} 2",
            "wgpar:prefix_cache_request_hits_total{model_name=\"tiny\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }
}
