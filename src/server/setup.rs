//! The server's limits from plain option values (`wgpar serve`, `wgpar mpi serve`): their
//! checks before anything opens, the batching and connection options they give, the work
//! the memory accounting sizes, the engine-thread fault of the failure tests, and the
//! untimed warm-up of a built engine.

use std::time::Duration;

use crate::batching::{self, serve, Length, Rate, ServeOptions, WorkloadSpec};
use crate::model::memory::Workload;
use crate::model::ModelConfig;
use crate::parallel::arming::FaultSpec;
use crate::parallel::{Fault, FaultKind, StepEngine};
use crate::trace::Recorder;
use crate::{Result, WgparError};

use super::{BatchOptions, ConnLimits};

/// Prompt tokens one prefill step takes without `--max-prefill-tokens`.
pub const DEFAULT_PREFILL_TOKENS: usize = 2048;
/// Most KV slots the server takes.
const MAX_SLOTS: usize = 4096;
/// Most queue places (and open connections) the server takes.
const MAX_QUEUE: usize = 1 << 20;
/// Longest timeout the server takes, seconds (a day).
const MAX_TIMEOUT_S: f64 = 86400.0;

/// The server's limits as the options give them (times in seconds, `None`: the default).
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// KV slots: sequences in the running batches at once.
    pub max_batch: usize,
    /// Most prompt tokens one step's prompt chunks take.
    pub max_prefill_tokens: Option<usize>,
    /// Most tokens one engine step carries.
    pub max_step_tokens: Option<usize>,
    /// Whether the KV of a cached prefix is reused.
    pub prefix_cache: bool,
    /// Requests that may wait for a KV slot.
    pub max_queue: usize,
    /// Largest request body, bytes.
    pub max_body: usize,
    /// Seconds requests in flight get to finish at shutdown.
    pub shutdown_timeout: f64,
    /// Seconds a connection gets to send a whole request head.
    pub header_timeout: f64,
    /// Seconds a kept-alive connection may stay idle.
    pub keep_alive_timeout: f64,
    /// Seconds a request body may pause between its pieces.
    pub body_timeout: f64,
    /// Seconds a streaming client may leave an event unread.
    pub stream_timeout: f64,
    /// Open connections served at once.
    pub max_connections: usize,
}

impl ServeLimits {
    /// `max_prefill_tokens`, or its default.
    pub fn prefill_tokens(&self) -> usize {
        self.max_prefill_tokens.unwrap_or(DEFAULT_PREFILL_TOKENS)
    }

    /// `max_step_tokens`, or its default.
    pub fn step_tokens(&self) -> usize {
        (self.max_step_tokens).unwrap_or(batching::DEFAULT_STEP_TOKENS)
    }

    /// The scheduler's options.
    pub fn serve_options(&self) -> ServeOptions {
        ServeOptions {
            max_batch: self.max_batch,
            max_prefill_tokens: self.prefill_tokens(),
            max_step_tokens: self.step_tokens(),
            prefix_cache: self.prefix_cache,
        }
    }

    /// The batcher's options, with the engine thread's `fault` (tests of the failure path).
    pub fn batch_options(&self, fault: Option<Fault>) -> BatchOptions {
        BatchOptions {
            slots: self.max_batch,
            max_prefill_tokens: self.prefill_tokens(),
            max_step_tokens: self.step_tokens(),
            fault,
            prefix_cache: self.prefix_cache,
        }
    }

    /// Checks every limit, naming the option at fault.
    pub fn check(&self) -> Result<()> {
        if self.max_batch == 0 || self.max_batch > MAX_SLOTS || self.prefill_tokens() == 0 {
            return Err(WgparError::option(
                "--max-batch",
                format!(
                    "--max-batch must be within 1..={MAX_SLOTS} and --max-prefill-tokens at \
                     least 1"
                ),
            ));
        }
        batching::check_options(&self.serve_options())?;
        if self.max_queue > MAX_QUEUE || self.max_body < 64 {
            return Err(WgparError::option(
                "--max-queue",
                format!("--max-queue must be at most {MAX_QUEUE}, --max-body at least 64 bytes"),
            ));
        }
        if !(0.0..=MAX_TIMEOUT_S).contains(&self.shutdown_timeout) {
            return Err(WgparError::option(
                "--shutdown-timeout",
                "--shutdown-timeout must be within 0..=86400 seconds".into(),
            ));
        }
        self.check_connections()
    }

    /// Checks the connection timeouts and count.
    fn check_connections(&self) -> Result<()> {
        let timeouts = [
            ("--header-timeout", self.header_timeout),
            ("--keep-alive-timeout", self.keep_alive_timeout),
            ("--body-timeout", self.body_timeout),
            ("--stream-timeout", self.stream_timeout),
        ];
        for (name, t) in timeouts {
            if !(t > 0.0 && t <= MAX_TIMEOUT_S) {
                return Err(WgparError::option(
                    name,
                    format!("{name} {t} must be within (0, {MAX_TIMEOUT_S}] seconds"),
                ));
            }
        }
        if self.max_connections == 0 || self.max_connections > MAX_QUEUE {
            return Err(WgparError::option(
                "--max-connections",
                format!("--max-connections must be within 1..={MAX_QUEUE}"),
            ));
        }
        Ok(())
    }

    /// The connection limits (checked by [`check`](Self::check)).
    pub fn conn_limits(&self) -> ConnLimits {
        ConnLimits {
            header_timeout: Duration::from_secs_f64(self.header_timeout),
            keep_alive_timeout: Duration::from_secs_f64(self.keep_alive_timeout),
            body_timeout: Duration::from_secs_f64(self.body_timeout),
            max_connections: self.max_connections,
            stream_timeout: Duration::from_secs_f64(self.stream_timeout),
        }
    }

    /// The largest step's tokens, and the work the accounting sizes: the cache holds
    /// `max_batch` sequences, the largest step's tokens sized as prompts.
    pub fn serving_work(&self, config: &ModelConfig) -> (usize, Workload) {
        // A step is a decode step of every slot, or prompt chunks within both budgets: a
        // longer prompt is prefilled over several steps, never whole.
        let step_tokens = (self.max_batch * config.max_seq)
            .min(self.prefill_tokens())
            .min(self.step_tokens())
            .max(self.max_batch);
        let work = Workload {
            batch: self.max_batch,
            prompt: step_tokens.div_ceil(self.max_batch.max(1)),
        };
        (step_tokens, work)
    }
}

/// The engine-thread fault of an `--inject-fault` spec `engine,kind=...,at=step:N`, if that
/// is the spec (the stage and rank faults are `run`'s).
pub fn engine_fault(spec: Option<&str>) -> Result<Option<Fault>> {
    match spec.map(str::trim) {
        Some(spec) if spec == "engine" || spec.starts_with("engine,") => {
            let rest = spec.trim_start_matches("engine").trim_start_matches(',');
            // The same keys as a stage's fault, for a worker that is the engine thread.
            let fault = FaultSpec::parse(&format!("stage=0,{rest}"))?.fault;
            if fault.kind == FaultKind::LoseDevice {
                return Err(WgparError::option(
                    "--inject-fault",
                    "--inject-fault engine: kind=device-lost needs a stage or a rank (the \
                     engine thread owns no device of its own)"
                        .into(),
                ));
            }
            Ok(Some(fault))
        }
        _ => Ok(None),
    }
}

/// Compiles every kernel and reserves the KV slots: a few short requests through the
/// scheduler, untimed.
pub fn warm_up(engine: &mut dyn StepEngine, batch: BatchOptions) -> Result<()> {
    let config = engine.model_config().clone();
    let warm = WorkloadSpec {
        requests: (2 * engine.lanes()).clamp(2, batch.slots.max(2)),
        rate: Rate::Burst,
        prompt_len: Length::Fixed(4.min(config.max_seq)),
        output_len: Length::Fixed(2.min(config.max_seq + 1 - 4.min(config.max_seq))),
        seed: 0,
    }
    .generate(config.vocab);
    let opts = ServeOptions {
        max_batch: batch.slots,
        max_prefill_tokens: batch.max_prefill_tokens,
        max_step_tokens: batch.max_step_tokens,
        prefix_cache: batch.prefix_cache,
    };
    serve(engine, &warm, &opts, Recorder::disabled(), &mut |_, _| {})?;
    Ok(())
}
