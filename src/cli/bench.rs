//! `wgpar bench ...`.

use clap::{Args, Subcommand};
use wgpar::device::{open_devices, AdapterDesc, Adapters, DType, DeviceSelection};
use wgpar::kernels::bench::{bench_kernels, KernelBenchOptions};
use wgpar::kernels::bench_options::{parse_copy_size, parse_qtypes, parse_shape, parse_sizes};
use wgpar::kernels::bench_table::render;
use wgpar::memory_check::{check_context, PlannedRun};
use wgpar::model::memory::Workload;
use wgpar::model::ModelConfig;
use wgpar::parallel::pipeline_sweep::{PipelineSweep, SweepRun};
use wgpar::parallel::run_plan::check_planned_runs;
use wgpar::parallel::Schedule;
use wgpar::{Result, WgparError};

use super::options::DeviceArgs;

/// What to benchmark.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Pipeline throughput and bubble: p stages x m micro-batches, GPipe prefill and
    /// in-flight (or GPipe) decode; measured bubble beside the theoretical one, throughput
    /// beside the ideal from the measured stage times.
    Pipeline(PipelineBenchArgs),
    /// Projection accuracy on this machine: rounds of calibrate + traced runs (single, TP,
    /// PP), every run projected onto every calibration; median makespan error per
    /// configuration.
    Projection(super::bench_projection::ProjectionBenchArgs),
    /// Host time to stage, record and submit one decode step, decode tokens/s, and the
    /// buffers and bind groups a steady-state step creates (single device, tensor and
    /// pipeline parallel).
    Decode(super::bench_decode::DecodeBenchArgs),
    /// Serving benchmark (vLLM benchmark_serving style): seeded Poisson arrivals, continuous
    /// batching on any strategy; throughput, TTFT, TPOT and latency percentiles.
    Serve(Box<super::bench_serve::ServeArgs>),
    /// Every matmul variant timed per shape (the winner is what autotuning picks, today's
    /// kernel beside it), attention prefill, and the other kernels' GB/s, per device.
    Kernels(KernelsBenchArgs),
}

/// Options of `wgpar bench kernels`.
#[derive(Args, Debug)]
pub struct KernelsBenchArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Square matmul sizes (M = N = K); `--sizes=` for none.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024")]
    sizes: Vec<String>,
    /// Further matmul shapes MxNxK (e.g. 1x14336x4096: decode GEMV, 1 row).
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<String>,
    /// Weight types: f32, f16 or both.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16")]
    dtypes: Vec<String>,
    /// Packed weight types (q8_0, q4_0, q4_k, q6_k, q5_0, ...): every packed matmul variant of
    /// each runs at every matmul shape, with its weight bandwidth (the blocks' bytes read per
    /// second) and that figure's ratio to the copy kernel's.
    #[arg(long, value_delimiter = ',')]
    qtypes: Vec<String>,
    /// Bytes the copy kernel moves to measure the attainable bandwidth (e.g. 256M; default
    /// 512M, capped at the adapter's storage-binding limit). It runs whenever a matmul does.
    #[arg(long)]
    copy_size: Option<String>,
    /// Only these matmul variants (today's kernel is always timed beside them).
    #[arg(long, value_delimiter = ',')]
    kernels: Vec<String>,
    /// Also time the naive one-invocation-per-output matmul.
    #[arg(long)]
    naive: bool,
    /// Attention prefill lengths to time (one sequence, 32 heads of 128).
    #[arg(long, value_delimiter = ',')]
    attention_prefill: Vec<usize>,
    /// Skip the memory-bound kernels (norms, element-wise, embedding, short attention).
    #[arg(long)]
    no_others: bool,
    /// Do not store each shape's winner in the tuning cache.
    #[arg(long)]
    no_save: bool,
    /// The adapter's peak arithmetic rate, GFLOP/s: each rate is followed by its fraction.
    #[arg(long)]
    peak_gflops: Option<f64>,
    /// The adapter's peak memory bandwidth, GB/s: each rate is followed by its fraction.
    #[arg(long)]
    peak_gbps: Option<f64>,
    /// Timed samples per kernel (median reported).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Untimed warm-up samples.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Options of `wgpar bench pipeline`.
#[derive(Args, Debug)]
pub struct PipelineBenchArgs {
    #[command(flatten)]
    binding: super::options::ModelDeviceArgs,
    #[command(flatten)]
    model: super::options::ModelArgs,
    #[command(flatten)]
    memory: super::options::MemoryArgs,
    /// Stage counts (virtual devices on the preferred adapter).
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    stages: Vec<usize>,
    /// Micro-batch counts; "p" and "4p" scale with the stage count.
    #[arg(long, value_delimiter = ',', default_value = "1,p,4p")]
    micro_batches: Vec<String>,
    /// Prompt length per sequence.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Sequences per micro-batch (the batch grows with m); see --batch.
    #[arg(long, default_value_t = 1)]
    per_microbatch: usize,
    /// A fixed batch for every m (split into m micro-batches) instead of --per-microbatch.
    #[arg(long)]
    batch: Option<usize>,
    /// Phases to measure: prefill (GPipe fill-drain), decode.
    #[arg(long, value_delimiter = ',', default_value = "prefill,decode", value_parser = ["prefill", "decode"])]
    phases: Vec<String>,
    /// Tokens generated per sequence in the decode phase (the first comes from the prefill).
    #[arg(long, default_value_t = 16)]
    gen: usize,
    /// Decode schedules: in-flight, gpipe.
    #[arg(long, value_delimiter = ',', default_value = "in-flight", value_parser = ["in-flight", "gpipe"])]
    schedules: Vec<String>,
    /// Timed repetitions (best kept, after a warm-up).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

impl PipelineBenchArgs {
    /// The sweep the options ask for.
    fn sweep(&self) -> PipelineSweep {
        let decode = self.phases.iter().any(|p| p == "decode");
        PipelineSweep {
            stages: self.stages.clone(),
            micro_batches: self.micro_batches.clone(),
            prompt_len: self.prompt_len,
            per_microbatch: self.per_microbatch,
            batch: self.batch,
            prefill: self.phases.iter().any(|p| p == "prefill"),
            schedules: (self.schedules.iter())
                .filter_map(|s| Schedule::parse(s))
                .filter(|_| decode)
                .collect(),
            gen: self.gen,
            reps: self.reps,
        }
    }
}

/// `bench pipeline`: every (stages, micro-batches) pair checked to fit, then measured on
/// virtual devices of the preferred adapter, one table row per phase and schedule.
fn bench_pipeline(args: &PipelineBenchArgs) -> Result<()> {
    let sweep = args.sweep();
    let config = args.model.choice().config()?;
    sweep.check()?;
    check_context(args.prompt_len, args.gen, &config)?;
    let runs = sweep.runs()?;
    let adapters = Adapters::discover()?;
    let max = args.stages.iter().copied().max().unwrap_or(1);
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: max,
    };
    let selected = args.binding.choice().described(&selection, &adapters)?;
    let dtype = args.model.choice().dtype_for(&selected, false)?;
    check_pipelines_fit(args, &runs, (&config, dtype), &selected)?;
    let gpus = open_devices(&adapters, &selection, &args.binding.choice().gpu_options())?;
    let weights = args.model.choice().weights(&config)?;
    out!("{}", sweep.header(&config, &gpus[0]))?;
    sweep.measure(&gpus, (&weights, dtype), |row| out!("{row}"))
}

/// Refuses, before a device opens, any (stages, micro-batches) pair whose run would not fit
/// the `selected` devices.
fn check_pipelines_fit(
    args: &PipelineBenchArgs,
    runs: &[SweepRun],
    (config, dtype): (&ModelConfig, DType),
    selected: &[AdapterDesc],
) -> Result<()> {
    let runs: Vec<PlannedRun> = (runs.iter())
        .map(|r| PlannedRun {
            strategy: &r.strategy,
            adapters: &selected[..r.stages],
            step_tokens: r.batch.div_ceil(r.micro_batches) * args.prompt_len,
            batch: r.batch,
            work: Workload {
                batch: r.batch,
                prompt: args.prompt_len,
            },
        })
        .collect();
    let kv = args.binding.choice().kv_dtypes(selected, false);
    let caps = args.memory.gpu_memory.as_deref();
    check_planned_runs(args.model.choice(), (config, dtype), &kv, caps, &runs)
}

/// Runs a benchmark command.
pub fn run(cmd: &BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Pipeline(args) => bench_pipeline(args),
        BenchCommand::Projection(args) => super::bench_projection::run(args),
        BenchCommand::Decode(args) => super::bench_decode::run(args),
        BenchCommand::Serve(args) => super::bench_serve::run(args),
        BenchCommand::Kernels(args) => bench_kernels_on_devices(args),
    }
}

/// `bench kernels`: the options checked, then every selected device benchmarked in turn,
/// printed as a table per device or as one JSON array.
fn bench_kernels_on_devices(args: &KernelsBenchArgs) -> Result<()> {
    let opts = kernel_options(args)?;
    let adapters = Adapters::discover()?;
    let gpus = args.devices.choice().open(&adapters)?;
    let mut all = Vec::new();
    for gpu in &gpus {
        let rows = bench_kernels(gpu, &opts)?;
        if !args.json {
            out!("{}", render(gpu, &rows, args.peak_gflops, args.peak_gbps))?;
        }
        all.push(
            serde_json::json!({ "device": gpu.describe(), "adapter": gpu.info(), "rows": rows }),
        );
    }
    if args.json {
        let text = serde_json::to_string_pretty(&all).map_err(|source| WgparError::Json {
            what: "the kernel benchmark".into(),
            source,
        })?;
        outln!("{text}")?;
    }
    Ok(())
}

/// `bench kernels`' options, checked before any device opens.
fn kernel_options(args: &KernelsBenchArgs) -> Result<KernelBenchOptions> {
    if args.iters == 0 {
        return Err(WgparError::option(
            "--iters",
            "--iters must be at least 1".into(),
        ));
    }
    let shapes = (args.shapes.iter())
        .map(|s| parse_shape(s))
        .collect::<Result<Vec<_>>>()?;
    let sizes = parse_sizes(&args.sizes)?;
    if let Some(d) = args.dtypes.iter().find(|d| *d != "f32" && *d != "f16") {
        return Err(WgparError::option(
            "--dtypes",
            format!("--dtypes {d}: expected f32 or f16"),
        ));
    }
    let peaks = [args.peak_gflops, args.peak_gbps];
    if let Some(p) = peaks
        .into_iter()
        .flatten()
        .find(|p| !(p.is_finite() && *p > 0.0))
    {
        return Err(WgparError::option(
            "--peak-gflops",
            format!("peak {p}: must be positive"),
        ));
    }
    let options = KernelBenchOptions {
        sizes,
        shapes,
        iters: args.iters,
        warmup: args.warmup,
        f32: args.dtypes.iter().any(|d| d == "f32"),
        f16: args.dtypes.iter().any(|d| d == "f16"),
        naive: args.naive,
        only: wgpar::kernels::tune::parse_forced("--kernels", &args.kernels.join(","))?,
        others: !args.no_others,
        attention_prefill: args.attention_prefill.clone(),
        save: !args.no_save,
        qtypes: parse_qtypes(&args.qtypes)?,
        copy_bytes: args.copy_size.as_deref().map(parse_copy_size).transpose()?,
        ..Default::default()
    };
    options.check()?;
    Ok(options)
}
