//! `GET /metrics`: the server's figures in Prometheus text format (prometheus-client), named
//! as vLLM names its own so dashboards carry over.

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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
        let mut registry = Registry::with_prefix("wgpar");
        let latency = || Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let m = Self {
            registry: Registry::default(),
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
        let r = &mut registry;
        r.register(
            "num_requests_running",
            "Requests in the running batches",
            m.running.clone(),
        );
        r.register(
            "num_requests_waiting",
            "Requests waiting for a KV slot",
            m.waiting.clone(),
        );
        r.register(
            "kv_slots_used",
            "KV slots holding a sequence",
            m.kv_slots_used.clone(),
        );
        r.register("kv_slots", "KV slots reserved", m.kv_slots.clone());
        r.register(
            "prompt_tokens",
            "Prompt tokens of accepted requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        r.register(
            "requests_finished",
            "Requests that got their tokens",
            m.finished.clone(),
        );
        r.register(
            "requests_cancelled",
            "Requests whose client left",
            m.cancelled.clone(),
        );
        r.register(
            "requests_rejected",
            "Requests refused (4xx, 503)",
            m.rejected.clone(),
        );
        r.register(
            "bubble_ratio",
            "Pipeline bubble share of device time",
            m.bubble.clone(),
        );
        r.register(
            "communication_ratio",
            "Communication share of device time",
            m.communication.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Time to first token",
            m.ttft.clone(),
        );
        r.register(
            "time_per_output_token_seconds",
            "Time per output token after the first",
            m.tpot.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "End-to-end request latency",
            m.e2e.clone(),
        );
        Self { registry, ..m }
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
