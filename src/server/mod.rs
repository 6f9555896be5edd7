//! `wgpar serve`: an OpenAI-compatible HTTP server (axum on tokio) over any engine that runs a
//! continuously batched workload ([`StepEngine`]).
//!
//! The engine lives on its own thread ([`batcher`]); HTTP handlers (`routes`) check a
//! request, tokenize it (chat prompts through the checkpoint's template, [`chat`]) and hand
//! it over with a channel that its tokens come back on, as they are picked. `/health` says 503
//! until the engine is built and warmed, and again after it fails or panics. SIGINT or SIGTERM
//! start draining: `/health` says 503 `draining`, new generation requests get 503, requests in
//! flight get `shutdown_timeout` to finish; then the listener closes. Connections are held to
//! the limits of [`limits::ConnLimits`]. An encoder checkpoint is served by
//! [`embeddings::run_encoder`] instead: `/v1/embeddings` on an encoder thread.

pub mod api;
pub mod auth;
pub mod batcher;
pub mod chat;
pub mod client;
pub mod embeddings;
pub mod limits;
pub mod metrics;
mod routes;
pub mod setup;
pub mod tools;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Result, WgparError};
use crate::model::hf::TextTokenizer;
use crate::parallel::StepEngine;

pub use batcher::BatchOptions;
pub use chat::{ChatTemplate, Message};
pub use embeddings::{run_encoder, EncoderBuilder};
pub use limits::ConnLimits;
pub use metrics::Metrics;

/// State the HTTP side and the engine thread share.
pub struct Shared {
    /// The engine is built and warmed.
    pub ready: AtomicBool,
    /// The engine failed: no more requests are served.
    pub failed: AtomicBool,
    /// A signal came: requests in flight finish, new ones are refused.
    pub draining: AtomicBool,
    /// Requests handed to the engine and not yet in a running batch.
    pub queued: AtomicUsize,
    /// Why the engine could not be built (the server then exits with it).
    pub load_error: Mutex<Option<String>>,
    /// The exported figures.
    pub metrics: Arc<Metrics>,
    /// Wakes the listener to shut down (a signal, or a failed load).
    pub stop: tokio::sync::Notify,
}

impl Shared {
    /// Fresh state; the metrics carry `model_name`.
    pub fn new(model_name: &str) -> Self {
        Self {
            ready: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            queued: AtomicUsize::new(0),
            load_error: Mutex::new(None),
            metrics: Arc::new(Metrics::new(model_name)),
            stop: tokio::sync::Notify::new(),
        }
    }

    /// No request is waiting or running on the engine.
    fn idle(&self) -> bool {
        self.queued.load(Ordering::SeqCst) == 0 && self.metrics.running.get() == 0
    }
}

/// The text side of the model: what turns requests into token ids and back.
pub struct TextModel {
    /// The name `/v1/models` lists.
    pub name: String,
    /// The checkpoint's tokenizer.
    pub tokenizer: TextTokenizer,
    /// The chat template, if the checkpoint has one.
    pub template: Option<ChatTemplate>,
    /// Tokens that end generation.
    pub eos: Vec<u32>,
    /// Tokens per KV slot (prompt plus generated, less the last).
    pub max_seq: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

/// How the server listens and admits requests.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Address to bind.
    pub addr: SocketAddr,
    /// Requests that may wait for a KV slot; beyond, 503 with Retry-After.
    pub max_queue: usize,
    /// Required `Authorization: Bearer` key (every route but /health, and /metrics when
    /// `metrics_open`).
    pub api_key: Option<String>,
    /// `/metrics` answers without the key.
    pub metrics_open: bool,
    /// Timeouts and the connection cap.
    pub limits: ConnLimits,
    /// Largest request body, bytes.
    pub max_body: usize,
    /// How long requests in flight get to finish after SIGINT or SIGTERM.
    pub shutdown_timeout: Duration,
    /// How the engine batches.
    pub batch: BatchOptions,
}

/// Builds the engine on the engine thread (engines are not `Send`), warmed and with its KV
/// slots reserved.
pub type EngineBuilder = Box<dyn FnOnce() -> Result<Box<dyn StepEngine>> + Send>;

/// Serves until SIGINT or SIGTERM (then drains), or until the engine cannot be built.
pub fn run(opts: ServerOptions, text: TextModel, build: EngineBuilder) -> Result<()> {
    let shared = Arc::new(Shared::new(&text.name));
    shared.metrics.kv_slots.set(opts.batch.slots as i64);
    let (jobs_tx, jobs_rx) = crossbeam::channel::unbounded();
    let engine_thread = {
        let shared = shared.clone();
        let (batch, eos) = (opts.batch, text.eos.clone());
        std::thread::Builder::new()
            .name("wgpar-engine".into())
            .spawn(move || {
                // A panic while building is a failed load; one while serving, batcher::run's.
                let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(build))
                    .unwrap_or_else(|p| {
                        let why = crate::threads::panic_message(p.as_ref()).unwrap_or("?");
                        Err(WgparError::WorkerPanicked {
                            worker: "the engine build".into(),
                            message: why.to_string(),
                        })
                    });
                match built {
                    Ok(mut engine) => {
                        shared.ready.store(true, Ordering::SeqCst);
                        eprintln!("ready: {}", engine.name());
                        batcher::run(engine.as_mut(), &jobs_rx, batch, eos, shared);
                    }
                    Err(e) => {
                        shared.failed.store(true, Ordering::SeqCst);
                        *crate::threads::lock(&shared.load_error) = Some(e.to_string());
                        shared.stop.notify_one();
                    }
                }
            })
            .map_err(|e| WgparError::runtime("cannot start the engine thread", e))?
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| WgparError::runtime("cannot start the async runtime", e))?;
    let state = routes::AppState::new(&opts, text, shared.clone(), jobs_tx);
    runtime.block_on(listen(&opts, state, shared.clone()))?;
    // The job sender is gone with the router: the engine loop ends once idle.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !engine_thread.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let load_error = crate::threads::lock(&shared.load_error).take();
    match load_error {
        Some(e) => Err(WgparError::runtime("the engine could not start", e)),
        None => Ok(()),
    }
}

async fn listen(opts: &ServerOptions, state: routes::AppState, shared: Arc<Shared>) -> Result<()> {
    let listener = limits::bind(opts.addr).map_err(|source| WgparError::Io {
        path: format!("listening on {}", opts.addr),
        source,
    })?;
    let bound = listener.local_addr().map_err(|source| WgparError::Io {
        path: format!("listening on {}", opts.addr),
        source,
    })?;
    eprintln!("listening on http://{bound} (loading the model; /health says 503 until ready)");
    let app = routes::router(state, opts.max_body);
    let timeout = opts.shutdown_timeout;
    let stopping = Arc::new(tokio::sync::Notify::new());
    // Draining keeps the listener open (probes see /health 503 "draining", new requests a
    // 503) until the engine has nothing left or the timeout passes.
    let drained = {
        let (shared, stopping) = (shared.clone(), stopping.clone());
        async move {
            wait_for_stop(&shared).await;
            shared.draining.store(true, Ordering::SeqCst);
            eprintln!(
                "shutting down: draining the requests in flight (--shutdown-timeout {timeout:?})"
            );
            stopping.notify_waiters();
            let deadline = tokio::time::Instant::now() + timeout;
            while !shared.idle() && !shared.failed.load(Ordering::SeqCst) {
                if tokio::time::Instant::now() >= deadline {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let server = limits::serve(listener, app, opts.limits, drained);
    tokio::select! {
        _ = server => Ok(()),
        _ = async { stopping.notified().await; tokio::time::sleep(timeout).await } => {
            eprintln!("shutdown: --shutdown-timeout of {timeout:?} passed with requests in flight");
            Ok(())
        }
    }
}

/// SIGINT, SIGTERM, or a failed load.
async fn wait_for_stop(shared: &Shared) {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
        _ = shared.stop.notified() => {}
    }
}
