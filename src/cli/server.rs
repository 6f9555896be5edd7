//! `wgpar serve`: the OpenAI-compatible HTTP server (see `wgpar::server` and docs/SERVING.md).
//! Checks the options, the model and the strategy before anything opens, then hands a
//! builder of the engine to the server.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use wgpar::batching::{serve, Length, Rate, ServeOptions, WorkloadSpec};
use wgpar::comm::CommConfig;
use wgpar::device::{Adapters, DType};
use wgpar::model::memory::Workload;
use wgpar::model::ModelConfig;
use wgpar::parallel::Fault;
use wgpar::parallel::{build_step_engine, Schedule, StepEngine, Strategy};
use wgpar::server::auth::{self, KeySources};
use wgpar::server::{BatchOptions, ConnLimits, EngineBuilder, ServerOptions, TextModel};
use wgpar::sim::LinkPacer;
use wgpar::trace::Recorder;
use wgpar::{Result, WgparError};

use super::options::{DeviceArgs, ModelArgs, StrategyArgs};

mod encoder;
use wgpar::parallel::arming::FaultSpec;
use wgpar::parallel::auto::{AutoPlacement, Setting};

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
    pub(super) memory: super::options::MemoryArgs,
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

/// Prompt tokens one prefill step takes without `--max-prefill-tokens`.
const DEFAULT_PREFILL_TOKENS: usize = 2048;

impl ServerArgs {
    /// `--max-prefill-tokens`, or its default.
    fn prefill_tokens(&self) -> usize {
        self.max_prefill_tokens.unwrap_or(DEFAULT_PREFILL_TOKENS)
    }

    /// `--max-step-tokens`, or its default.
    fn step_tokens(&self) -> usize {
        (self.max_step_tokens).unwrap_or(wgpar::batching::DEFAULT_STEP_TOKENS)
    }
}

/// Most KV slots and queue places the server takes.
const MAX_SLOTS: usize = 4096;
const MAX_QUEUE: usize = 1 << 20;

/// The batching options, for their check before anything opens.
fn serve_options(args: &ServerArgs) -> ServeOptions {
    ServeOptions {
        max_batch: args.max_batch,
        max_prefill_tokens: args.prefill_tokens(),
        max_step_tokens: args.step_tokens(),
        prefix_cache: !args.no_prefix_cache,
    }
}

/// Checks the options that need no model.
fn check_options(args: &ServerArgs) -> Result<()> {
    if args.max_batch == 0 || args.max_batch > MAX_SLOTS || args.prefill_tokens() == 0 {
        return Err(WgparError::option(
            "--max-batch",
            format!(
                "--max-batch must be within 1..={MAX_SLOTS} and --max-prefill-tokens at least 1"
            ),
        ));
    }
    wgpar::batching::check_options(&serve_options(args))?;
    if args.max_queue > MAX_QUEUE || args.max_body < 64 {
        return Err(WgparError::option(
            "--max-queue",
            format!("--max-queue must be at most {MAX_QUEUE}, --max-body at least 64 bytes"),
        ));
    }
    if !(0.0..=86400.0).contains(&args.shutdown_timeout) {
        return Err(WgparError::option(
            "--shutdown-timeout",
            "--shutdown-timeout must be within 0..=86400 seconds".into(),
        ));
    }
    check_limits(args)?;
    if args.strategy.schedule() == Schedule::GPipe {
        return Err(WgparError::unsupported(
            "--schedule gpipe does not apply to serve: requests join and leave the running \
             batch at every token"
                .into(),
        ));
    }
    Ok(())
}

/// Longest timeout the server takes, seconds (a day).
const MAX_TIMEOUT_S: f64 = 86400.0;

/// Checks the connection limits, and that --metrics-open has a key to be open from.
fn check_limits(args: &ServerArgs) -> Result<()> {
    let timeouts = [
        ("--header-timeout", args.header_timeout),
        ("--keep-alive-timeout", args.keep_alive_timeout),
        ("--body-timeout", args.body_timeout),
        ("--stream-timeout", args.stream_timeout),
    ];
    for (name, t) in timeouts {
        if !(t > 0.0 && t <= MAX_TIMEOUT_S) {
            return Err(WgparError::option(
                name,
                format!("{name} {t} must be within (0, {MAX_TIMEOUT_S}] seconds"),
            ));
        }
    }
    if args.max_connections == 0 || args.max_connections > MAX_QUEUE {
        return Err(WgparError::option(
            "--max-connections",
            format!("--max-connections must be within 1..={MAX_QUEUE}"),
        ));
    }
    Ok(())
}

/// The connection limits the options give (checked by `check_limits`).
fn conn_limits(args: &ServerArgs) -> ConnLimits {
    ConnLimits {
        header_timeout: Duration::from_secs_f64(args.header_timeout),
        keep_alive_timeout: Duration::from_secs_f64(args.keep_alive_timeout),
        body_timeout: Duration::from_secs_f64(args.body_timeout),
        max_connections: args.max_connections,
        stream_timeout: Duration::from_secs_f64(args.stream_timeout),
    }
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

/// The engine-thread fault of `--inject-fault engine,kind=...,at=step:N`, if that is the
/// spec (the stage and rank faults are `run`'s).
fn engine_fault(args: &ServerArgs) -> Result<Option<Fault>> {
    match args.inject_fault.as_deref().map(str::trim) {
        Some(spec) if spec == "engine" || spec.starts_with("engine,") => {
            let rest = spec.trim_start_matches("engine").trim_start_matches(',');
            // The same keys as a stage's fault, for a worker that is the engine thread.
            let fault = FaultSpec::parse(&format!("stage=0,{rest}"))?.fault;
            if fault.kind == wgpar::parallel::FaultKind::LoseDevice {
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
    let opts = ServerOptions {
        addr: SocketAddr::new(args.host, args.port),
        max_queue: args.max_queue,
        api_key: api_key(args)?,
        metrics_open: args.metrics_open,
        limits: conn_limits(args),
        max_body: args.max_body,
        shutdown_timeout: Duration::from_secs_f64(args.shutdown_timeout),
        batch: BatchOptions {
            slots: args.max_batch,
            max_prefill_tokens: args.prefill_tokens(),
            max_step_tokens: args.step_tokens(),
            fault: engine_fault(args)?,
            prefix_cache: !args.no_prefix_cache,
        },
    };
    Ok(Prepared { config, text, opts })
}

/// Runs the server until SIGINT or SIGTERM.
pub fn run(args: &ServerArgs) -> Result<()> {
    check_options(args)?;
    let any = args.model.choice().any_config()?;
    if any.is_encoder() {
        return encoder::serve(args, prepared(args, any)?);
    }
    let Prepared { config, text, opts } = prepare(args)?;
    let adapters = Adapters::discover()?;
    let selected = args.devices.selected(&adapters)?;
    let dtype = args
        .model
        .choice()
        .dtype_for(&selected, args.devices.force_f32)?;
    let strategy =
        super::options::serving_strategy(&args.strategy, selected.len(), args.max_batch)?;
    let fault = match &args.inject_fault {
        Some(_) if opts.batch.fault.is_some() => None,
        Some(t) => {
            let spec = FaultSpec::parse(t)?;
            spec.check(&strategy, selected.len())?;
            Some(spec)
        }
        None => None,
    };
    let auto = args.strategy.auto_placement(&args.memory);
    let (step_tokens, work) = serving_work(args, &config);
    let setting = Setting {
        config: &config,
        dtype,
        model: args.model.choice(),
        kv: args.devices.kv_dtypes(&selected),
        selected: &selected,
        work,
    };
    let strategy = auto.before_open(strategy, &setting)?;
    check_fits(args, &setting, &strategy, step_tokens)?;
    let pacer = args
        .pace
        .as_deref()
        .map(super::options::pacer_for)
        .transpose()?;
    let server = ServerEngine {
        devices: args.devices.clone(),
        model: args.model.clone(),
        adapters,
        config,
        dtype,
        strategy,
        auto,
        batch: opts.batch,
        pacer: pacer.map(|(p, _)| p),
        fault,
    };
    let build: EngineBuilder = Box::new(move || server.build());
    wgpar::server::run(opts, text, build)
}

/// The largest step's tokens, and the work the accounting sizes: the cache holds
/// --max-batch sequences, the largest step's tokens sized as prompts.
pub(super) fn serving_work(args: &ServerArgs, config: &ModelConfig) -> (usize, Workload) {
    // A step is a decode step of every slot, or prompt chunks within both budgets: a longer
    // prompt is prefilled over several steps, never whole.
    let step_tokens = (args.max_batch * config.max_seq)
        .min(args.prefill_tokens())
        .min(args.step_tokens())
        .max(args.max_batch);
    let work = Workload {
        batch: args.max_batch,
        prompt: step_tokens.div_ceil(args.max_batch.max(1)),
    };
    (step_tokens, work)
}

/// Refuses, before any device opens, a server whose largest step (`step_tokens`) or memory
/// does not fit.
fn check_fits(
    args: &ServerArgs,
    setting: &Setting<'_>,
    strategy: &Strategy,
    step_tokens: usize,
) -> Result<()> {
    let (config, dtype) = (setting.config, setting.dtype);
    let runs = [super::memory::PlannedRun {
        strategy,
        adapters: setting.selected,
        step_tokens,
        batch: args.max_batch,
        work: setting.work,
    }];
    super::memory::check_runs_fit(config, dtype, &runs)?;
    (args.memory).check_runs(
        &args.model,
        (config, dtype),
        &args.devices.kv_dtypes(setting.selected),
        &runs,
    )
}

/// What the server's engine is built from, on the server's own thread.
struct ServerEngine {
    devices: DeviceArgs,
    model: ModelArgs,
    adapters: Adapters,
    config: ModelConfig,
    dtype: DType,
    strategy: Strategy,
    auto: AutoPlacement,
    batch: BatchOptions,
    pacer: Option<LinkPacer>,
    fault: Option<FaultSpec>,
}

impl ServerEngine {
    /// Opens the devices, places the model (measured where `auto` asks), builds the engine,
    /// drops the host weights, and warms it up.
    fn build(self) -> Result<Box<dyn StepEngine>> {
        let (config, dtype, batch) = (&self.config, self.dtype, self.batch);
        let gpus = self.devices.open(&self.adapters)?;
        let weights = self.model.choice().weights(config)?;
        // A measured placement, on the devices the server runs on (warm-up sized probe).
        let probe = Workload {
            batch: batch.slots,
            prompt: 16.min(config.max_seq),
        };
        let strategy = (self.auto).once_open(&self.strategy, &gpus, (&weights, dtype), probe)?;
        let comm = CommConfig::default();
        let shape = (probe.batch, probe.prompt);
        let mut engine = build_step_engine(&strategy, &gpus, &weights, dtype, &comm, shape)?;
        drop(weights);
        if let Some(pacer) = self.pacer {
            engine.set_pacer(Some(Arc::new(pacer)));
        }
        warm_up(engine.as_mut(), batch)?;
        if let Some(f) = self.fault {
            engine.inject_fault(f.worker, f.fault)?;
        }
        Ok(engine)
    }
}

/// The checkpoint's tokenizer, chat template and end tokens, with the served name and the
/// context.
fn text_model(args: &ServerArgs, config: &ModelConfig) -> Result<TextModel> {
    let side = super::options::text_side(
        &args.model,
        config,
        args.tokenizer.as_deref(),
        args.chat_template.as_deref(),
    )?;
    Ok(TextModel {
        name: (args.served_model_name.clone()).unwrap_or_else(|| config.name.clone()),
        tokenizer: side.tokenizer,
        template: side.template,
        eos: side.eos,
        max_seq: config.max_seq,
        vocab: config.vocab,
    })
}

/// Compiles every kernel and reserves the KV slots: a few short requests through the
/// scheduler, untimed.
pub(super) fn warm_up(
    engine: &mut dyn wgpar::parallel::StepEngine,
    batch: BatchOptions,
) -> Result<()> {
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
