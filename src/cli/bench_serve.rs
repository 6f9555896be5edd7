//! `wgpar bench serve`: a serving benchmark in the style of vLLM's `benchmark_serving`. Requests
//! arrive on a seeded Poisson clock (or all at once) and run through one engine with
//! continuous batching; the command prints request and token throughput, TTFT, TPOT and
//! end-to-end percentiles, bubble and communication shares, and writes a trace that
//! `wgpar project` replays on any host profile.

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use wgpar::batching::bench_report::{render_run, BenchRun};
use wgpar::batching::{
    serve, Length, LongPrompt, Rate, ServeBench, ServeOptions, ServeRun, Sessions, WorkloadSpec,
};
use wgpar::model::memory::Workload;
use wgpar::parallel::StepEngine;
use wgpar::serving::{ServingChoice, ServingEngine as Built};
use wgpar::trace::{DeviceTiming, Recorder};
use wgpar::{Result, WgparError};

use super::options::{DeviceArgs, MemoryArgs, ModelArgs, StrategyArgs};

/// Options of `wgpar bench serve`.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    strategy: StrategyArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    /// Requests to send.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Arrival rate: requests per second of a seeded Poisson process, or inf (all at once).
    #[arg(long, default_value = "inf")]
    rate: Rate,
    /// Prompt tokens per request: N, or MIN:MAX drawn uniformly.
    #[arg(long, default_value = "32")]
    prompt_len: Length,
    /// Tokens to generate per request (the first comes from the prefill): N or MIN:MAX.
    #[arg(long, default_value = "16")]
    output_len: Length,
    /// One more request, with a prompt of TOKENS tokens arriving SECONDS into the run (and
    /// the longest --output-len): what a long prompt does to the streams already running.
    #[arg(long, value_name = "TOKENS@SECONDS")]
    long_prompt: Option<LongPrompt>,
    /// Seed of the arrivals, lengths and prompt tokens.
    #[arg(long, default_value_t = 0)]
    workload_seed: u64,
    /// KV slots: sequences in the running batches at once (over all pipeline lanes).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Most prompt tokens one step's prompt chunks take.
    #[arg(long, default_value_t = 2048)]
    max_prefill_tokens: usize,
    /// Most tokens one engine step carries: every running stream's decode token first, then
    /// chunks of waiting prompts (a longer prompt is prefilled over several steps); default
    /// 512. Not with --url (the server has its own).
    #[arg(long, value_name = "N")]
    max_step_tokens: Option<usize>,
    /// Prefill every prompt whole: no reuse of the KV of a cached prefix. Not with --url.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Every session's first prompt starts with the same system prompt of N tokens.
    #[arg(long, value_name = "N", default_value_t = 0)]
    shared_prefix: usize,
    /// Multi-turn sessions: each of --requests sessions makes T requests, each later one
    /// repeating the previous prompt and its answer, then a new turn of --prompt-len tokens,
    /// sent when the previous answer is done.
    #[arg(long, value_name = "T", default_value_t = 1)]
    turns: usize,
    /// Write the run's timeline as a Chrome trace (replay it with `wgpar project`).
    #[arg(long, value_name = "FILE")]
    trace: Option<String>,
    /// Pace transfers and collectives to a host profile's links, or to ALPHA_US:BETA_GBPS.
    #[arg(long, value_name = "PROFILE|ALPHA_US:BETA_GBPS")]
    pace: Option<String>,
    /// Send the workload to an OpenAI-compatible server at this address (http://HOST:PORT)
    /// as streamed completions of token ids, instead of running an engine here; --model
    /// gives the vocabulary the token ids are drawn from and the model name sent.
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// Print JSON (every request's outcome and the figures) instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs the benchmark.
pub fn run(args: &ServeArgs) -> Result<()> {
    let config = args.model.choice().config()?;
    let bench = bench(args);
    bench.check()?;
    args.strategy.choice().check_serving()?;
    bench.check_fits(&config)?;
    if let Some(url) = &args.url {
        return run_http(args, url, &config, &bench);
    }
    let opts = serve_options(args)?;
    super::options::create_trace_file(args.trace.as_ref())?;
    let mut built = build(args, &bench, &config, &opts)?;
    let what = BenchRun {
        config: &config,
        spec: &bench.spec,
        sessions: bench.sessions,
        opts: &opts,
        long_prompt: args.long_prompt,
        engine: built.engine.name(),
        strategy: built.strategy.to_string(),
        dtype: built.dtype,
        lanes: built.engine.lanes(),
        adapters: wgpar::parallel::timed::adapter_labels(&built.gpus),
    };
    if !args.json {
        out!("{}", what.header())?;
    }
    let recorder = Recorder::new().with_device_timing(DeviceTiming::Off);
    let run = measured(args.json, &bench, built.engine.as_mut(), &opts, &recorder)?;
    if let Some(path) = &args.trace {
        what.write_trace(path, &recorder, &run)?;
        if !args.json {
            let spans = run.timeline.spans.len();
            outln!(
                "trace: {spans} spans written to {path} (replay with `wgpar project --trace \
                 {path} --host PROFILE`)"
            )?;
        }
    }
    if args.json {
        return outln!("{}", what.json(&run)?);
    }
    out!("{}", render_run(&run))?;
    print_long_ttft(bench.long_prompt_ttft(&run))
}

/// The `--long-prompt` request's time to first token, seconds, when it has one.
fn print_long_ttft(ttft_s: Option<f64>) -> Result<()> {
    match ttft_s {
        Some(s) => outln!("{:<40}{:>14.2}", "Long prompt TTFT (ms):", s * 1e3),
        None => Ok(()),
    }
}

/// The workload the options describe (checked by [`ServeBench::check`]).
fn bench(args: &ServeArgs) -> ServeBench {
    ServeBench {
        spec: WorkloadSpec {
            requests: args.requests,
            rate: args.rate,
            prompt_len: args.prompt_len,
            output_len: args.output_len,
            seed: args.workload_seed,
        },
        sessions: Sessions {
            shared_prefix: args.shared_prefix,
            turns: args.turns,
        },
        long_prompt: args.long_prompt,
    }
}

/// The scheduler's limits, each at least 1.
fn serve_options(args: &ServeArgs) -> Result<ServeOptions> {
    let opts = ServeOptions {
        max_batch: args.max_batch,
        max_prefill_tokens: args.max_prefill_tokens,
        max_step_tokens: (args.max_step_tokens).unwrap_or(wgpar::batching::DEFAULT_STEP_TOKENS),
        prefix_cache: !args.no_prefix_cache,
    };
    wgpar::batching::check_options(&opts)?;
    Ok(opts)
}

/// Checks the run fits the selected adapters, then opens them and builds the engine (paced
/// when `--pace` asks).
fn build(
    args: &ServeArgs,
    bench: &ServeBench,
    config: &wgpar::model::ModelConfig,
    opts: &ServeOptions,
) -> Result<Built> {
    let work = Workload {
        batch: opts.max_batch,
        prompt: bench.longest_prompt(),
    };
    let choice = ServingChoice {
        devices: args.devices.choice(),
        model: args.model.choice(),
        strategy: args.strategy.choice(),
        gpu_memory: args.memory.gpu_memory.as_deref(),
        max_batch: opts.max_batch,
        step_tokens: bench.largest_step(opts),
        work,
        probe: work,
        pace: args.pace.as_deref(),
        fault: None,
    };
    let (built, _) = choice.plan(config.clone())?.build(args.model.choice())?;
    if let (Some(what), false) = (&built.paced, args.json) {
        outln!("pacing transfers to {what}")?;
    }
    Ok(built)
}

/// The recorded run (after an untimed warm-up), with a progress bar unless the output is
/// JSON.
fn measured(
    json: bool,
    bench: &ServeBench,
    engine: &mut dyn StepEngine,
    opts: &ServeOptions,
    recorder: &Recorder,
) -> Result<ServeRun> {
    bench.warm_up(engine, opts)?;
    let requests = bench.requests(engine.model_config().vocab);
    let bar = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(requests.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} requests [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let result = serve(engine, &requests, opts, recorder.clone(), &mut |done, _| {
        bar.set_position(done as u64)
    });
    bar.finish_and_clear();
    result
}

/// `--url`: the workload over HTTP against any OpenAI-compatible server.
fn run_http(
    args: &ServeArgs,
    url: &str,
    config: &wgpar::model::ModelConfig,
    bench: &ServeBench,
) -> Result<()> {
    if !url.starts_with("http://") {
        return Err(WgparError::option(
            "--url",
            format!("--url '{url}': expected http://HOST:PORT"),
        ));
    }
    if args.trace.is_some()
        || args.pace.is_some()
        || args.max_step_tokens.is_some()
        || args.no_prefix_cache
    {
        return Err(WgparError::unsupported(
            "--trace, --pace, --max-step-tokens and --no-prefix-cache record, pace, batch and \
             cache an engine run here; with --url the engine runs in the server (start it \
             with --no-prefix-cache instead)"
                .into(),
        ));
    }
    let spec = &bench.spec;
    let requests = bench.requests(config.vocab);
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        outln!(
            "{} requests at {} to {url}, prompt {} tokens, output {} tokens",
            spec.requests,
            spec.rate,
            spec.prompt_len,
            spec.output_len
        )?;
        ProgressBar::new(requests.len() as u64)
    };
    let (metrics, outcomes) =
        wgpar::server::client::run_http(url, &config.name, &requests, &|d| {
            bar.set_position(d as u64)
        })?;
    bar.finish_and_clear();
    // The long prompt is the one request of its length that the workload does not draw.
    let long = (args.long_prompt).and_then(|l| {
        let i = requests.iter().position(|r| r.prompt.len() == l.tokens)?;
        outcomes[i].timing.map(|t| t.first_s - t.arrival_s)
    });
    if args.json {
        let errors: Vec<_> = outcomes.iter().filter_map(|o| o.error.clone()).collect();
        let out = serde_json::json!({"url": url, "workload": spec, "long_prompt": args.long_prompt,
            "long_prompt_ttft_s": long, "metrics": metrics, "errors": errors});
        outln!("{out:#}")?;
        return any_completed(metrics.completed, &errors);
    }
    out!("{}", metrics.lines("Serving Benchmark Result (HTTP)"))?;
    print_long_ttft(long)?;
    let errors: Vec<String> = outcomes.iter().filter_map(|o| o.error.clone()).collect();
    for e in &errors {
        outln!("failed: {e}")?;
    }
    any_completed(metrics.completed, &errors)
}

/// A benchmark whose requests all failed measured nothing: it fails (exit 1) with the first
/// request's error, after the report that says n/a.
fn any_completed(completed: usize, errors: &[String]) -> Result<()> {
    match (completed, errors.first()) {
        (0, Some(first)) => Err(WgparError::BadRequest {
            request: 0,
            reason: format!(
                "the server failed all {} requests, so nothing was measured; the first: {first}",
                errors.len()
            ),
        }),
        _ => Ok(()),
    }
}
