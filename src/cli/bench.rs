//! `wgpar bench ...`.

use std::sync::Arc;

use clap::{Args, Subcommand};
use wgpar::device::{open_devices, AdapterDesc, Adapters, DType, DeviceSelection, Gpu};
use wgpar::kernels::bench::{bench_kernels, KernelBenchOptions};
use wgpar::model::memory::Workload;
use wgpar::model::{ModelConfig, ModelWeights};
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

fn parse_shape(text: &str) -> Result<(usize, usize, usize)> {
    let dims: Vec<usize> = text
        .split('x')
        .map(|d| d.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| {
            WgparError::option("--shapes", format!("bad shape '{text}': expected MxNxK"))
        })?;
    match dims[..] {
        [m, n, k] if m > 0 && n > 0 && k > 0 => Ok((m, n, k)),
        _ => Err(WgparError::option(
            "--shapes",
            format!("bad shape '{text}': expected MxNxK, each at least 1"),
        )),
    }
}

fn micro_batch_count(text: &str, p: usize) -> Result<usize> {
    match text {
        "p" => Ok(p),
        t if t.ends_with('p') => t[..t.len() - 1]
            .parse::<usize>()
            .map(|k| k * p)
            .map_err(|_| {
                WgparError::option("--micro-batches", format!("bad micro-batch count '{t}'"))
            }),
        t => t.parse().map_err(|_| {
            WgparError::option("--micro-batches", format!("bad micro-batch count '{t}'"))
        }),
    }
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

/// `bench pipeline`: every (stages, micro-batches) pair checked to fit, then measured on
/// virtual devices of the preferred adapter, one table row per phase and schedule.
fn bench_pipeline(args: &PipelineBenchArgs) -> Result<()> {
    let config = args.model.choice().config()?;
    check_pipeline_args(args)?;
    super::memory::check_context(args.prompt_len, args.gen, &config)?;
    let counts = micro_batch_counts(args)?;
    let adapters = Adapters::discover()?;
    let max = args.stages.iter().copied().max().unwrap_or(1);
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: max,
    };
    let selected = args.binding.described(&selection, &adapters)?;
    let dtype = args.model.choice().dtype_for(&selected, false)?;
    check_pipelines_fit(args, &counts, (&config, dtype), &selected)?;
    let gpus = open_devices(&adapters, &selection, &args.binding.gpu_options())?;
    let weights = args.model.choice().weights(&config)?;
    print_pipeline_header(args, &config, &gpus[0])?;
    measure_pipelines(args, &counts, &gpus, (&weights, dtype))
}

/// The micro-batch counts of each stage count, `[stages][micro-batch option]`.
fn micro_batch_counts(args: &PipelineBenchArgs) -> Result<Vec<Vec<usize>>> {
    (args.stages.iter())
        .map(|&p| {
            (args.micro_batches.iter())
                .map(|t| micro_batch_count(t, p))
                .collect::<Result<Vec<_>>>()
        })
        .collect()
}

/// The batch a run with `m` micro-batches measures: `--batch`, or `--per-microbatch` each.
fn pipeline_batch(args: &PipelineBenchArgs, m: usize) -> usize {
    args.batch.unwrap_or(args.per_microbatch * m)
}

/// Refuses, before a device opens, any (stages, micro-batches) pair whose run would not fit
/// the `selected` devices.
fn check_pipelines_fit(
    args: &PipelineBenchArgs,
    counts: &[Vec<usize>],
    (config, dtype): (&ModelConfig, DType),
    selected: &[AdapterDesc],
) -> Result<()> {
    use wgpar::parallel::{PartitionSpec, Schedule, Strategy};
    let pipelines: Vec<(Strategy, usize, usize, usize)> = (args.stages.iter().zip(counts))
        .flat_map(|(&p, ms)| {
            ms.iter().map(move |&m| {
                let strategy = Strategy::Pipeline {
                    partition: PartitionSpec::Even,
                    micro_batches: m,
                    schedule: Schedule::InFlight,
                };
                (strategy, p, pipeline_batch(args, m), m)
            })
        })
        .collect();
    let runs: Vec<super::memory::PlannedRun> = (pipelines.iter())
        .map(|(strategy, p, batch, m)| super::memory::PlannedRun {
            strategy,
            adapters: &selected[..*p],
            step_tokens: batch.div_ceil(*m) * args.prompt_len,
            batch: *batch,
            work: Workload {
                batch: *batch,
                prompt: args.prompt_len,
            },
        })
        .collect();
    super::memory::check_runs_fit(config, dtype, &runs)?;
    (args.memory).check_runs(
        &args.model,
        (config, dtype),
        &args.binding.kv_dtypes(selected, false),
        &runs,
    )
}

/// Measures every (stages, micro-batches) pair on the first `p` of `gpus` and prints its rows.
fn measure_pipelines(
    args: &PipelineBenchArgs,
    counts: &[Vec<usize>],
    gpus: &[Arc<Gpu>],
    (weights, dtype): (&ModelWeights, DType),
) -> Result<()> {
    use wgpar::parallel::{bench_pipeline, PipelineBench, Schedule};
    let decode = args.phases.iter().any(|p| p == "decode");
    let schedules: Vec<Schedule> = if decode {
        (args.schedules.iter())
            .filter_map(|s| Schedule::parse(s))
            .collect()
    } else {
        Vec::new()
    };
    for (&p, ms) in args.stages.iter().zip(counts) {
        for &m in ms {
            let bench = PipelineBench {
                micro_batches: m,
                batch: pipeline_batch(args, m),
                prompt_len: args.prompt_len,
                gen: args.gen,
                reps: args.reps,
                prefill: args.phases.iter().any(|p| p == "prefill"),
                schedules: schedules.clone(),
            };
            for r in bench_pipeline(&gpus[..p], weights, dtype, &bench)? {
                print_pipeline_row(&r, p, bench.batch)?;
            }
        }
    }
    Ok(())
}

/// `bench pipeline`'s counts, checked before anything is loaded.
fn check_pipeline_args(args: &PipelineBenchArgs) -> Result<()> {
    if args.stages.is_empty() || args.stages.contains(&0) {
        return Err(WgparError::option(
            "--stages",
            "--stages must be positive".into(),
        ));
    }
    if args.prompt_len == 0 || args.per_microbatch == 0 || args.batch == Some(0) {
        return Err(WgparError::option(
            "--prompt-len",
            "--prompt-len, --per-microbatch and --batch must be positive".into(),
        ));
    }
    if args.phases.iter().any(|p| p == "decode") && args.gen < 2 {
        return Err(WgparError::option(
            "--gen",
            "--gen must be at least 2 to measure decode".into(),
        ));
    }
    Ok(())
}

/// `bench pipeline`'s title line (model, work, device) and column heads.
fn print_pipeline_header(
    args: &PipelineBenchArgs,
    config: &wgpar::model::ModelConfig,
    gpu: &wgpar::device::Gpu,
) -> Result<()> {
    outln!(
        "# model {} ({} layers), prompt {}, {}, gen {}, {} ({} {})",
        config.name,
        config.layers,
        args.prompt_len,
        match args.batch {
            Some(b) => format!("batch {b}"),
            None => format!("{} sequence(s) per micro-batch", args.per_microbatch),
        },
        args.gen,
        gpu.describe(),
        gpu.info().driver,
        gpu.info().driver_info
    )?;
    outln!(
        "{:<8} {:<9} {:>3} {:>4} {:>5} {:>8} {:>10} {:>11} {:>8} {:>8} {:>8} {:>18}",
        "phase",
        "schedule",
        "p",
        "m",
        "batch",
        "tokens",
        "tokens/s",
        "ideal tok/s",
        "of ideal",
        "bubble",
        "theory",
        "hand-off/pass"
    )?;
    Ok(())
}

/// One row of `bench pipeline`'s table.
fn print_pipeline_row(r: &wgpar::parallel::PipelineBenchRow, p: usize, batch: usize) -> Result<()> {
    let s = &r.stats;
    let (handoff_s, handoff_b) = s.handoff_per_microbatch();
    outln!(
        "{:<8} {:<9} {:>3} {:>4} {:>5} {:>8} {:>10.1} {:>11.1} {:>7.0}% {:>7.1}% {:>7.1}% {:>7.2} ms {:>6} B",
        r.phase,
        r.schedule,
        p,
        s.microbatches,
        batch,
        s.tokens,
        s.tokens_per_s(),
        s.ideal_tokens_per_s(),
        s.tokens_per_s() / s.ideal_tokens_per_s() * 100.0,
        s.measured_bubble * 100.0,
        s.theoretical_bubble * 100.0,
        handoff_s * 1e3,
        handoff_b
    )
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
    let gpus = args.devices.open(&adapters)?;
    let mut all = Vec::new();
    for gpu in &gpus {
        let rows = bench_kernels(gpu, &opts)?;
        if !args.json {
            print_kernel_rows(gpu, &rows, args.peak_gflops, args.peak_gbps)?;
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
    let sizes = (args.sizes.iter())
        .filter(|s| !s.trim().is_empty())
        .map(|s| match s.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(WgparError::option(
                "--sizes",
                format!("--sizes {s}: expected a size of at least 1"),
            )),
        })
        .collect::<Result<Vec<_>>>()?;
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
    let only = wgpar::kernels::tune::parse_forced("--kernels", &args.kernels.join(","))?;
    let matmuls: Vec<(usize, usize, usize)> = (sizes.iter().map(|&n| (n, n, n)))
        .chain(shapes.iter().copied())
        .collect();
    let packed = packed_options(args, &matmuls, &only)?;
    if sizes.is_empty() && shapes.is_empty() && args.attention_prefill.is_empty() && args.no_others
    {
        return Err(WgparError::option(
            "--sizes",
            "nothing to measure: --sizes and --shapes name no matmul, --attention-prefill no \
             length, and --no-others drops the other kernels"
                .into(),
        ));
    }
    Ok(KernelBenchOptions {
        sizes,
        shapes,
        iters: args.iters,
        warmup: args.warmup,
        f32: args.dtypes.iter().any(|d| d == "f32"),
        f16: args.dtypes.iter().any(|d| d == "f16"),
        naive: args.naive,
        only,
        others: !args.no_others,
        attention_prefill: args.attention_prefill.clone(),
        save: !args.no_save,
        qtypes: packed.qtypes,
        copy_bytes: packed.copy_bytes,
        ..Default::default()
    })
}

/// `bench kernels`' roofline options, checked.
struct PackedOptions {
    qtypes: Vec<wgpar::model::quant::QuantType>,
    copy_bytes: Option<u64>,
}

/// `--qtypes` and `--copy-size`, checked against the matmul shapes and `--kernels`.
fn packed_options(
    args: &KernelsBenchArgs,
    matmuls: &[(usize, usize, usize)],
    only: &[String],
) -> Result<PackedOptions> {
    use wgpar::kernels::roofline;
    let known = roofline::packed_types();
    let qtypes = (args.qtypes.iter().map(|q| q.trim().to_ascii_lowercase()))
        .filter(|q| !q.is_empty())
        .map(|q| {
            known
                .iter()
                .copied()
                .find(|t| t.name() == q)
                .ok_or_else(|| {
                    let names: Vec<&str> = known.iter().map(|t| t.name()).collect();
                    let hint = match q.as_str() {
                        "f16" | "f32" => " (dense weights are --dtypes)",
                        _ => "",
                    };
                    WgparError::option(
                        "--qtypes",
                        format!(
                            "--qtypes {q}: not a packed type{hint}; expected one of {}",
                            names.join(", ")
                        ),
                    )
                })
        })
        .collect::<Result<Vec<_>>>()?;
    if !qtypes.is_empty() && matmuls.is_empty() {
        return Err(WgparError::option(
            "--qtypes",
            "--qtypes needs a matmul shape (--sizes or --shapes)".into(),
        ));
    }
    check_packed_shapes(&qtypes, matmuls, only)?;
    let copy_bytes = match &args.copy_size {
        None => None,
        Some(_) if matmuls.is_empty() => {
            return Err(WgparError::option(
                "--copy-size",
                "--copy-size applies only with a matmul shape (--sizes or --shapes)".into(),
            ))
        }
        Some(text) => Some(copy_size(text)?),
    };
    Ok(PackedOptions { qtypes, copy_bytes })
}

/// Every shape's inner dimension must be whole blocks of every packed type, and `--kernels`,
/// where it names packed variants, must name one of each type and none of another type.
fn check_packed_shapes(
    qtypes: &[wgpar::model::quant::QuantType],
    matmuls: &[(usize, usize, usize)],
    only: &[String],
) -> Result<()> {
    use wgpar::kernels::quant::variant_by_name;
    for &t in qtypes {
        if let Some((m, n, k)) = matmuls.iter().find(|s| s.2 % t.block_len() != 0) {
            return Err(WgparError::option(
                "--qtypes",
                format!(
                    "shape {m}x{n}x{k}: k = {k} is not a whole number of {} blocks of {}",
                    t.name(),
                    t.block_len()
                ),
            ));
        }
    }
    let named: Vec<_> = only.iter().filter_map(|o| variant_by_name(o)).collect();
    if let Some(v) = named.iter().find(|v| !qtypes.contains(&v.qtype)) {
        return Err(WgparError::option(
            "--kernels",
            format!(
                "--kernels {}: a {} variant, and --qtypes does not name {}",
                v.name,
                v.qtype.name(),
                v.qtype.name()
            ),
        ));
    }
    if let Some(t) = qtypes
        .iter()
        .find(|t| !only.is_empty() && !named.iter().any(|v| v.qtype == **t))
    {
        return Err(WgparError::option(
            "--kernels",
            format!(
                "--kernels names no {} variant, and --qtypes names {}",
                t.name(),
                t.name()
            ),
        ));
    }
    Ok(())
}

/// `--copy-size`: a size from 1 MiB to 8 GiB, a multiple of 16 bytes (one vec4).
fn copy_size(text: &str) -> Result<u64> {
    use wgpar::kernels::roofline::{MAX_COPY_BYTES, MIN_COPY_BYTES};
    let bad = |why: String| WgparError::option("--copy-size", format!("--copy-size {text}: {why}"));
    let bytes = wgpar::comm::units::parse_size(text).map_err(|e| bad(e.to_string()))?;
    if !(MIN_COPY_BYTES..=MAX_COPY_BYTES).contains(&bytes) || bytes % 16 != 0 {
        return Err(bad(format!(
            "expected a multiple of 16 bytes from {}M to {}G",
            MIN_COPY_BYTES >> 20,
            MAX_COPY_BYTES >> 30
        )));
    }
    Ok(bytes)
}

/// A figure, or `n/a` where it was not measured.
fn figure(v: Option<f64>, digits: usize) -> String {
    v.map_or("n/a".to_string(), |v| format!("{v:.digits$}"))
}

/// A rate with three significant digits (two decimals at least), so a slow kernel on a CPU
/// driver does not print as 0.00; `n/a` where it was not measured.
fn significant(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() && v.abs() < 1.0 && v != 0.0 => {
            let digits = (2 - v.abs().log10().floor() as i32).clamp(2, 9) as usize;
            format!("{v:.digits$}")
        }
        other => figure(other, 2),
    }
}

fn print_kernel_rows(
    gpu: &wgpar::device::Gpu,
    rows: &[wgpar::kernels::bench::KernelBenchRow],
    peak_gflops: Option<f64>,
    peak_gbps: Option<f64>,
) -> Result<()> {
    outln!(
        "# {} driver: {} {}",
        gpu.describe(),
        gpu.info().driver,
        gpu.info().driver_info
    )?;
    outln!(
        "{:<18} {:<20} {:<6} {:>11} {:>9} {:>7} {:>8} {:>7} {:>8} {:>8}  note",
        "kernel",
        "shape",
        "dtype",
        "median ms",
        "GFLOP/s",
        "peak",
        "GB/s",
        "peak",
        "x naive",
        "x today"
    )?;
    let frac = |v: Option<f64>, peak: Option<f64>| match (v, peak) {
        (Some(v), Some(p)) => format!("{}%", significant(Some(v / p * 100.0))),
        _ => "n/a".to_string(),
    };
    for r in rows {
        let note = match (r.winner, r.legacy) {
            (true, true) => "winner, today's",
            (true, false) => "winner",
            (false, true) => "today's",
            _ => "",
        };
        outln!(
            "{:<18} {:<20} {:<6} {:>11.3} {:>9} {:>7} {:>8} {:>7} {:>8} {:>8}  {note}",
            r.kernel,
            r.shape,
            r.dtype,
            r.median_ms,
            significant(r.gflops),
            frac(r.gflops, peak_gflops),
            significant(r.gbps),
            frac(r.gbps, peak_gbps),
            significant(r.speedup_vs_naive),
            significant(r.speedup_vs_legacy)
        )?;
    }
    print_roofline(rows, peak_gbps)
}

/// The roofline table: every matmul row's weight bandwidth against the copy kernel's in the
/// same run (and against `--peak-gbps` when given); each shape's and type's fastest marked.
fn print_roofline(
    rows: &[wgpar::kernels::bench::KernelBenchRow],
    peak_gbps: Option<f64>,
) -> Result<()> {
    use wgpar::kernels::roofline::COPY_KERNEL;
    let matmuls: Vec<_> = rows.iter().filter(|r| r.weight_bytes.is_some()).collect();
    if matmuls.is_empty() {
        return Ok(());
    }
    let copy = rows.iter().find(|r| r.kernel == COPY_KERNEL);
    let copy_gbps = copy.and_then(|c| c.gbps);
    outln!(
        "# roofline: {} of {} moved {} GB/s (bytes read + written over time, this run); \
         weight GB/s = the weights' bytes as stored, per second (x and y counted apart); bufs = \
         weight buffers the dispatches rotate through (1: the same weights, cache-friendly)",
        COPY_KERNEL,
        copy.map_or("n/a", |c| c.shape.as_str()),
        significant(copy_gbps)
    )?;
    outln!(
        "{:<18} {:<20} {:<6} {:>11} {:>11} {:>5} {:>9} {:>11} {:>8} {:>9} {:>8}  note",
        "kernel",
        "shape",
        "dtype",
        "median ms",
        "weights MB",
        "bufs",
        "x+y KB",
        "weight GB/s",
        "of peak",
        "copy GB/s",
        "of copy"
    )?;
    let scaled = |b: Option<u64>, unit: f64| b.map(|b| b as f64 / unit);
    let percent = |f: Option<f64>| {
        f.map_or("n/a".to_string(), |f| {
            format!("{}%", significant(Some(f * 100.0)))
        })
    };
    for r in matmuls {
        outln!(
            "{:<18} {:<20} {:<6} {:>11.3} {:>11} {:>5} {:>9} {:>11} {:>8} {:>9} {:>8}  {}",
            r.kernel,
            r.shape,
            r.dtype,
            r.median_ms,
            figure(scaled(r.weight_bytes, 1e6), 2),
            r.weight_buffers
                .map_or("n/a".to_string(), |b| b.to_string()),
            figure(scaled(r.xy_bytes, 1e3), 1),
            significant(r.weight_gbps),
            percent(r.weight_gbps.zip(peak_gbps).map(|(w, p)| w / p)),
            significant(copy_gbps),
            percent(r.of_copy),
            if r.winner { "winner" } else { "" }
        )?;
    }
    Ok(())
}
