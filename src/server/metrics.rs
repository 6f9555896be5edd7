//! `GET /metrics`: the server's figures in Prometheus text format (prometheus-client), named
//! as vLLM names its own so dashboards carry over.

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

use super::batcher::Job;

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// Requests in the running batches.
    pub running: Gauge,
    /// Requests accepted and waiting for a KV slot.
    pub waiting: Gauge,
    /// KV slots holding a sequence.
    pub kv_slots_used: Gauge,
    /// KV slots reserved.
    pub kv_slots: Gauge,
    /// Prompt tokens of accepted requests.
    pub prompt_tokens: Counter,
    /// Tokens sent to clients.
    pub generation_tokens: Counter,
    /// Requests that got all their tokens.
    pub finished: Counter,
    /// Requests whose client went away before the end.
    pub cancelled: Counter,
    /// Requests refused with 4xx or 503.
    pub rejected: Counter,
    /// Pipeline bubble share of device time (pipelines; 0 otherwise).
    pub bubble: Gauge<f64, AtomicU64>,
    /// Communication share of the last step's device time.
    pub communication: Gauge<f64, AtomicU64>,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics, registered under the `wgpar` prefix.
    pub fn new() -> Self {
        let latency = || Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let mut m = Self {
            registry: Registry::with_prefix("wgpar"),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_slots_used: Gauge::default(),
            kv_slots: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            finished: Counter::default(),
            cancelled: Counter::default(),
            rejected: Counter::default(),
            bubble: Gauge::default(),
            communication: Gauge::default(),
            ttft: latency(),
            tpot: latency(),
            e2e: latency(),
        };
        m.register_all();
        m
    }

    /// Registers every metric under its vLLM-style name, in the order the exposition lists
    /// them: the gauges, the counters, the ratios, then the latency histograms.
    fn register_all(&mut self) {
        self.register_counts();
        self.register_shares_and_latencies();
    }

    /// The request and KV slot gauges, then the token and request counters.
    fn register_counts(&mut self) {
        let r = &mut self.registry;
        let gauges = [
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
        ];
        register_each(r, gauges);
        let counters = [
            (
                "prompt_tokens",
                "Prompt tokens of accepted requests",
                &self.prompt_tokens,
            ),
            (
                "generation_tokens",
                "Tokens generated",
                &self.generation_tokens,
            ),
            (
                "requests_finished",
                "Requests that got their tokens",
                &self.finished,
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
        ];
        register_each(r, counters);
    }

    /// The bubble and communication shares, then the latency histograms.
    fn register_shares_and_latencies(&mut self) {
        let r = &mut self.registry;
        let ratios = [
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
        register_each(r, ratios);
        let latencies = [
            (
                "time_to_first_token_seconds",
                "Time to first token",
                &self.ttft,
            ),
            (
                "time_per_output_token_seconds",
                "Time per output token after the first",
                &self.tpot,
            ),
            (
                "e2e_request_latency_seconds",
                "End-to-end request latency",
                &self.e2e,
            ),
        ];
        register_each(r, latencies);
    }

    /// A request's first token.
    pub fn observe_first(&self, job: &Job) {
        self.ttft.observe(job.accepted.elapsed().as_secs_f64());
    }

    /// A request that finished with `generated` tokens, the first at `first`.
    pub fn observe_done(&self, job: &Job, first: Option<Instant>, generated: usize) {
        self.finished.inc();
        self.e2e.observe(job.accepted.elapsed().as_secs_f64());
        if let (Some(first), true) = (first, generated > 1) {
            self.tpot
                .observe(first.elapsed().as_secs_f64() / (generated - 1) as f64);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

/// Registers a handle to each metric (a clone shares the value) under its name and help text.
fn register_each<M: Metric + Clone, const N: usize>(
    registry: &mut Registry,
    metrics: [(&str, &str, &M); N],
) {
    for (name, help, metric) in metrics {
        registry.register(name, help, metric.clone());
    }
}
