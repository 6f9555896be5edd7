//! `wgpar serve`: the OpenAI-compatible HTTP server (see `wgpar::server` and docs/SERVING.md).
//! Checks the options, the model and the strategy before anything opens, then hands a
//! builder of the engine to the server.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use wgpar::device::Adapters;
use wgpar::model::memory::Workload;
use wgpar::model::ModelConfig;
use wgpar::parallel::{Encoder, SingleEncoder};
use wgpar::server::auth::{self, KeySources};
use wgpar::server::setup::{engine_fault, ServeLimits};
use wgpar::server::{EncoderBuilder, EngineBuilder, ServerOptions, TextModel};
use wgpar::serving::ServingChoice;
use wgpar::{Result, WgparError};

use super::options::{DeviceArgs, MemoryArgs, ModelArgs, StrategyArgs};

/// Options of `wgpar serve`.
#[derive(Args, Clone, Debug)]
pub struct ServerArgs {
    #[command(flatten)]
    pub(super) devices: DeviceArgs,
    #[command(flatten)]
    pub(super) model: ModelArgs,
    #[command(flatten)]
    pub(super) strategy: StrategyArgs,
    #[command(flatten)]
    pub(super) memory: MemoryArgs,
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// KV slots: sequences in the running batches at once (over all pipeline lanes).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Most prompt tokens one step's prompt chunks take (default 2048; a decoder's option).
    #[arg(long, value_name = "TOKENS")]
    pub(super) max_prefill_tokens: Option<usize>,
    /// Most tokens one engine step carries: every running stream's decode token first, then
    /// chunks of waiting prompts, so a longer prompt is prefilled over several steps (default
    /// 512; a decoder's option).
    #[arg(long, value_name = "TOKENS")]
    pub(super) max_step_tokens: Option<usize>,
    /// Prefill every prompt whole: no reuse of the KV of a cached prefix (a decoder's option).
    #[arg(long)]
    pub(super) no_prefix_cache: bool,
    /// Requests that may wait for a KV slot; beyond, 503 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health (visible in `ps`:
    /// prefer --api-key-file or the WGPAR_API_KEY variable).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Read the API key from the first line of FILE.
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// Serve /metrics without the API key (for a scraper that sends none).
    #[arg(long)]
    metrics_open: bool,
    /// Seconds a connection gets to send a whole request head (from its opening, or from the
    /// end of its previous response).
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a kept-alive connection may stay idle between requests.
    #[arg(long, default_value_t = 5.0)]
    keep_alive_timeout: f64,
    /// Seconds a request body may pause between its pieces.
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Open connections served at once; a connection beyond gets 503 with Retry-After.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a streaming client may leave an event unread before its request is cancelled
    /// and its KV slot freed.
    #[arg(long, default_value_t = 60.0)]
    stream_timeout: f64,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// A Hugging Face tokenizer.json to use instead of the checkpoint's own (a GGUF file's
    /// metadata or a folder's tokenizer.json).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<std::path::PathBuf>,
    /// Seconds requests in flight get to finish after SIGINT or SIGTERM.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Pace transfers and collectives to a host profile's links, or to ALPHA_US:BETA_GBPS.
    #[arg(long, value_name = "PROFILE|ALPHA_US:BETA_GBPS")]
    pub(super) pace: Option<String>,
    /// Make a worker fail after warm-up (tests of the failure path), as `run --inject-fault`:
    /// e.g. `stage=1,kind=error,at=step:0`; or the engine thread itself, on any strategy:
    /// `engine,kind=panic,at=step:2`.
    #[arg(long, value_name = "SPEC")]
    pub(super) inject_fault: Option<String>,
    /// The model name `/v1/models` lists and requests' `model` must give (default: the
    /// model's own name).
    #[arg(long, value_name = "NAME")]
    served_model_name: Option<String>,
    /// A Jinja chat template file for `/v1/chat/completions`, over the checkpoint's own.
    #[arg(long, value_name = "FILE")]
    pub(super) chat_template: Option<std::path::PathBuf>,
}

impl ServerArgs {
    /// The server's limits as the options give them.
    pub(super) fn limits(&self) -> ServeLimits {
        ServeLimits {
            max_batch: self.max_batch,
            max_prefill_tokens: self.max_prefill_tokens,
            max_step_tokens: self.max_step_tokens,
            prefix_cache: !self.no_prefix_cache,
            max_queue: self.max_queue,
            max_body: self.max_body,
            shutdown_timeout: self.shutdown_timeout,
            header_timeout: self.header_timeout,
            keep_alive_timeout: self.keep_alive_timeout,
            body_timeout: self.body_timeout,
            stream_timeout: self.stream_timeout,
            max_connections: self.max_connections,
        }
    }
}

/// Checks the options that need no model.
fn check_options(args: &ServerArgs) -> Result<()> {
    args.limits().check()?;
    args.strategy.choice().check_serving()
}

/// The API key from --api-key, --api-key-file or WGPAR_API_KEY (one of them), and whether
/// /metrics is open; --metrics-open without a key does not apply.
fn api_key(args: &ServerArgs) -> Result<Option<String>> {
    let key = auth::resolve(KeySources {
        flag: args.api_key.as_deref(),
        file: args.api_key_file.as_deref(),
        env: std::env::var(auth::KEY_VAR).ok(),
    })?;
    if args.metrics_open && key.is_none() {
        return Err(WgparError::option(
            "--metrics-open",
            "--metrics-open applies with an API key (--api-key, --api-key-file or \
             WGPAR_API_KEY): without one, every route is open already"
                .into(),
        ));
    }
    Ok(key)
}

/// What a server needs besides its engine: the model's shape, its text side, and the
/// listener's and the scheduler's options, all checked.
pub(super) struct Prepared {
    pub(super) config: ModelConfig,
    pub(super) text: TextModel,
    pub(super) opts: ServerOptions,
}

/// Checks the options and loads the text side (tokenizer, chat template), before any device
/// opens.
pub(super) fn prepare(args: &ServerArgs) -> Result<Prepared> {
    check_options(args)?;
    let config = args.model.choice().config()?;
    prepared(args, config)
}

/// The rest of [`prepare`], once the model's `config` is known.
fn prepared(args: &ServerArgs, config: ModelConfig) -> Result<Prepared> {
    let text = text_model(args, &config)?;
    let limits = args.limits();
    let opts = ServerOptions {
        addr: SocketAddr::new(args.host, args.port),
        max_queue: args.max_queue,
        api_key: api_key(args)?,
        metrics_open: args.metrics_open,
        limits: limits.conn_limits(),
        max_body: args.max_body,
        shutdown_timeout: Duration::from_secs_f64(args.shutdown_timeout),
        batch: limits.batch_options(engine_fault(args.inject_fault.as_deref())?),
    };
    Ok(Prepared { config, text, opts })
}

/// Runs the server until SIGINT or SIGTERM.
pub fn run(args: &ServerArgs) -> Result<()> {
    check_options(args)?;
    let any = args.model.choice().any_config()?;
    if any.is_encoder() {
        return serve_encoder(args, prepared(args, any)?);
    }
    let Prepared { config, text, opts } = prepare(args)?;
    let plan = serving_choice(args, &config, &opts).plan(config)?;
    let (model, batch) = (args.model.clone(), opts.batch);
    let build: EngineBuilder = Box::new(move || plan.server_engine(model.choice(), batch));
    wgpar::server::run(opts, text, build)
}

/// The serving run the options ask for: the accounting sizes the largest step and the slots;
/// the engine is built (and an `auto` placement measured) with a warm-up-sized probe; a
/// stage's or a rank's fault is injected after the warm-up (the engine thread's is the
/// batcher's).
fn serving_choice<'a>(
    args: &'a ServerArgs,
    config: &ModelConfig,
    opts: &ServerOptions,
) -> ServingChoice<'a> {
    let (step_tokens, work) = args.limits().serving_work(config);
    ServingChoice {
        devices: args.devices.choice(),
        model: args.model.choice(),
        strategy: args.strategy.choice(),
        gpu_memory: args.memory.gpu_memory.as_deref(),
        max_batch: args.max_batch,
        step_tokens,
        work,
        probe: Workload {
            batch: opts.batch.slots,
            prompt: 16.min(config.max_seq),
        },
        pace: args.pace.as_deref(),
        fault: (args.inject_fault.as_deref()).filter(|_| opts.batch.fault.is_none()),
    }
}

/// The checkpoint's tokenizer, chat template and end tokens, with the served name and the
/// context.
fn text_model(args: &ServerArgs, config: &ModelConfig) -> Result<TextModel> {
    let (tokenizer, template) = (args.tokenizer.as_deref(), args.chat_template.as_deref());
    let side = args.model.choice().text_side(config, tokenizer, template)?;
    Ok(TextModel {
        name: (args.served_model_name.clone()).unwrap_or_else(|| config.name.clone()),
        tokenizer: side.tokenizer,
        template: side.template,
        eos: side.eos,
        max_seq: config.max_seq,
        vocab: config.vocab,
    })
}

/// `serve --model` an encoder's folder: `/v1/embeddings` on one device (the options of
/// generation that do not apply are refused by name, before any device opens).
fn serve_encoder(args: &ServerArgs, prepared: Prepared) -> Result<()> {
    let Prepared { config, text, opts } = prepared;
    refuse_for_encoder(args, &config.name)?;
    let adapters = Adapters::discover()?;
    let (devices, model) = (args.devices.choice(), args.model.clone());
    let dim = config.hidden;
    let build: EncoderBuilder = Box::new(move || {
        let weights = model.choice().weights(&config)?;
        let gpus = devices.open(&adapters)?;
        let dtype = model.choice().dtype(&gpus)?;
        let encoder = SingleEncoder::new(gpus[0].clone(), &weights, dtype)?;
        Ok(Box::new(encoder) as Box<dyn Encoder>)
    });
    wgpar::server::run_encoder(opts, text, dim, build)
}

/// Refuses, by name, every option of `serve` that an encoder's server has no use for: it
/// encodes on one device with no strategy, no memory plan (`--gpu-memory` is checked
/// against a decoder's accounting), no prefill steps (`--max-batch` bounds its batches),
/// no sampling and no chat. Each is refused when given at all, default value or not (`--seed`
/// is `None` unless given).
fn refuse_for_encoder(args: &ServerArgs, model: &str) -> Result<()> {
    let refuse = |option: &str, given: bool| match given {
        true => Err(WgparError::unsupported(format!(
            "{option} does not apply to an encoder's server (model '{model}' serves \
             /v1/embeddings)"
        ))),
        false => Ok(()),
    };
    refuse("more than one device", args.devices.choice().count() > 1)?;
    refuse(
        "--strategy",
        !matches!(args.strategy.strategy.as_str(), "none" | "single"),
    )?;
    // --tp, --split, --layers, --partition, --micro-batches, --schedule: none applies to a
    // single device, which is what the strategy check refuses them for.
    args.strategy.choice().check_options()?;
    refuse("--gpu-memory", args.memory.gpu_memory.is_some())?;
    refuse("--max-prefill-tokens", args.max_prefill_tokens.is_some())?;
    refuse("--max-step-tokens", args.max_step_tokens.is_some())?;
    refuse("--no-prefix-cache", args.no_prefix_cache)?;
    // The seed only makes a preset's synthetic weights; a folder's weights are its own.
    let synthetic = matches!(args.model.model, wgpar::model::hub::ModelRef::Preset(_));
    refuse("--seed", args.model.seed.is_some() && !synthetic)?;
    refuse("--chat-template", args.chat_template.is_some())?;
    refuse("--pace", args.pace.is_some())?;
    refuse("--inject-fault", args.inject_fault.is_some())
}
