//! `wgpar run`: prefill + greedy decode on the chosen strategy, with tokens/s and where the
//! time went.

use clap::Args;
use std::sync::Arc;
use wgpar::comm::CommConfig;
use wgpar::device::{AdapterDesc, Adapters, DType, Gpu};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    build_engine, generate, generate_keeping, Engine, Fault, FaultKind, KeepLogits, PartitionSpec,
    Schedule, Strategy,
};

use wgpar::sim::{HostProfile, LinkPacer, PaceSpec};
use wgpar::trace::{DeviceTiming, Recorder};
use wgpar::{Result, WgparError};

use super::memory::{parse_counts, print_allocated, Counts, MemoryArgs};
use super::placement::{AccountingParts, AutoPlacement, Setting};
use super::text::TextArgs;
use super::{DeviceArgs, ModelArgs};
use wgpar::model::memory::{per_device, DeviceBytes, WeightFormat, Workload};

/// Strategy options of `run`.
#[derive(Args, Clone, Debug)]
pub struct StrategyArgs {
    /// How to spread the model: none or single (first device), tp (tensor parallel over all
    /// devices), pp (one pipeline stage per device), hybrid (pipeline stages of --tp devices
    /// each).
    #[arg(long, default_value = "none", value_parser = ["none", "single", "tp", "pp", "hybrid"])]
    pub strategy: String,
    /// Hybrid: devices per pipeline stage (tensor-parallel degree inside a stage; default 2).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Tensor parallel: relative shares per device, e.g. 3,1 (default even); `run` also takes
    /// auto: heads by each device's measured layer time, within its --gpu-memory cap.
    #[arg(long, value_parser = parse_counts, value_name = "SHARES|auto")]
    pub split: Option<Counts>,
    /// Pipeline and hybrid: layers per stage, e.g. 5,7 (default: --partition); `run` also
    /// takes auto: the most even split within each device's --gpu-memory cap (without caps,
    /// balanced by measured speed, as --partition balanced).
    #[arg(long, value_parser = parse_counts, value_name = "COUNTS|auto")]
    pub layers: Option<Counts>,
    /// Pipeline and hybrid: even, or balanced by measured per-device layer/embedding/head time.
    #[arg(long, value_parser = ["even", "balanced"])]
    pub partition: Option<String>,
    /// Pipeline and hybrid: micro-batches per batch (default 1, at most --batch; `serve`:
    /// lanes in flight, default one per stage).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Pipeline and hybrid decode: in-flight (each micro-batch's next token enters stage 0 as
    /// soon as its previous one is sampled; the default) or gpipe (a fill-drain of all
    /// micro-batches per token).
    #[arg(long, value_parser = ["in-flight", "gpipe"])]
    pub schedule: Option<String>,
}

impl StrategyArgs {
    fn partition_spec(&self) -> PartitionSpec {
        match (&self.layers, self.partition.as_deref()) {
            (Some(Counts::Given(l)), _) => PartitionSpec::Explicit(l.clone()),
            (None, Some("balanced")) => PartitionSpec::Balanced,
            // `auto` is placed by `placement::AutoPlacement` once the accounting is at hand.
            _ => PartitionSpec::Even,
        }
    }

    /// The pipeline decode schedule (in flight unless `--schedule gpipe`).
    pub fn schedule(&self) -> Schedule {
        self.schedule
            .as_deref()
            .and_then(Schedule::parse)
            .unwrap_or_default()
    }

    /// Refuses options that do not apply to the chosen strategy instead of ignoring them.
    pub fn check_options(&self) -> Result<()> {
        let s = self.strategy.as_str();
        let pipeline = matches!(s, "pp" | "hybrid");
        let refuse = |option: &str, applies: &str| {
            Err(WgparError::unsupported(format!(
                "{option} does not apply to --strategy {s}: it {applies}"
            )))
        };
        if self.split.is_some() && s != "tp" {
            return refuse(
                "--split",
                "sets tensor-parallel shares (--strategy tp; hybrid stages split evenly)",
            );
        }
        if self.layers.is_some() && !pipeline {
            return refuse("--layers", "sets layers per pipeline stage (pp, hybrid)");
        }
        if self.partition.is_some() && !pipeline {
            return refuse("--partition", "splits layers into stages (pp, hybrid)");
        }
        if self.layers.is_some() && self.partition.as_deref() == Some("balanced") {
            return Err(WgparError::unsupported(
                "--layers and --partition balanced both set the stages: give one".into(),
            ));
        }
        if self.micro_batches.is_some() && !pipeline {
            return refuse(
                "--micro-batches",
                "splits a batch for a pipeline (pp, hybrid)",
            );
        }
        if self.schedule.is_some() && !pipeline {
            return refuse("--schedule", "schedules a pipeline's decode (pp, hybrid)");
        }
        if self.tp.is_some() && s != "hybrid" {
            return refuse(
                "--tp",
                "sets the devices per hybrid stage (--strategy tp uses every device)",
            );
        }
        Ok(())
    }

    /// Whether `--layers auto` or `--split auto` asks for a placement by memory.
    #[cfg(feature = "mpi")]
    fn auto(&self) -> bool {
        self.layers == Some(Counts::Auto) || self.split == Some(Counts::Auto)
    }

    /// The strategy these options name, with `micro_batches` where none is given. `auto`
    /// placements are refused here rather than run evenly (under mpirun, where each rank
    /// would measure alone).
    #[cfg(feature = "mpi")]
    pub fn strategy_with(&self, micro_batches: usize) -> Result<Strategy> {
        if self.auto() {
            return Err(WgparError::unsupported(
                "--layers auto and --split auto are not taken under mpirun (each rank would \
                 measure its own devices alone): give the counts"
                    .into(),
            ));
        }
        self.named(micro_batches)
    }

    /// The strategy these options name, `auto` placed evenly (see
    /// [`super::placement::AutoPlacement`]).
    pub(super) fn named(&self, micro_batches: usize) -> Result<Strategy> {
        self.check_options()?;
        let micro_batches = self.micro_batches.unwrap_or(micro_batches);
        Ok(match self.strategy.as_str() {
            "tp" => Strategy::Tensor {
                split: match &self.split {
                    Some(Counts::Given(v)) => Some(v.clone()),
                    _ => None,
                },
            },
            "pp" => Strategy::Pipeline {
                partition: self.partition_spec(),
                micro_batches,
                schedule: self.schedule(),
            },
            "hybrid" => Strategy::Hybrid {
                tp: self.tp.unwrap_or(2),
                partition: self.partition_spec(),
                micro_batches,
                schedule: self.schedule(),
            },
            _ => Strategy::Single,
        })
    }
}

/// Options of `wgpar run`.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub(super) devices: DeviceArgs,
    #[command(flatten)]
    pub(super) model: ModelArgs,
    #[command(flatten)]
    pub(super) strategy: StrategyArgs,
    /// Sequences per batch.
    #[arg(long, default_value_t = 4)]
    pub(super) batch: usize,
    /// Prompt length (random token ids).
    #[arg(long, default_value_t = 64)]
    pub(super) prompt_len: usize,
    /// Tokens to generate per sequence.
    #[arg(long, default_value_t = 16)]
    pub(super) gen: usize,
    /// Write the run's timeline as Chrome Trace Event JSON (opens in Perfetto).
    #[arg(long, value_name = "FILE")]
    pub(super) trace: Option<String>,
    /// Pace transfers and collectives to a host profile's links (shipped name or TOML path),
    /// e.g. pcie3-2gpu, so the run behaves like that machine's interconnect; or to one link
    /// given as ALPHA_US:BETA_GBPS, e.g. 50:0.125 for a 1 Gb/s network.
    #[arg(long, value_name = "PROFILE|ALPHA_US:BETA_GBPS")]
    pub(super) pace: Option<String>,
    /// With --trace, also time compute spans on the device with timestamp queries: auto (where
    /// the adapter has TIMESTAMP_QUERY and is not a CPU driver, on which timestamp writes
    /// slow each submission down), on, off.
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub(super) device_timestamps: String,
    /// Make a worker fail, to see the failure path end the run cleanly:
    /// `stage=S` (pp, hybrid) or `rank=R` (tp), `kind=error|panic|device-lost`, `at=step:N`
    /// (after N jobs of that worker in the timed run: steps for a rank, micro-batches for a
    /// stage), e.g. `stage=1,kind=panic,at=step:3`.
    #[arg(long, value_name = "SPEC")]
    pub(super) inject_fault: Option<String>,
    /// Write every step's logits and the generated tokens as JSON (rank 0 under MPI): for
    /// comparing strategies and layouts bit for bit.
    #[arg(long, value_name = "FILE")]
    pub(super) logits_out: Option<String>,
    #[command(flatten)]
    pub(super) memory: MemoryArgs,
    #[command(flatten)]
    pub(super) text: TextArgs,
}

/// A parsed `--inject-fault`: which worker, and how and when it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FaultSpec {
    /// Stage (pipeline) or rank (tensor parallel).
    pub worker: usize,
    /// Whether the spec named a stage (`stage=`) rather than a rank (`rank=`).
    pub stage: bool,
    pub fault: Fault,
}

impl FaultSpec {
    /// Parses `stage=1,kind=error,at=step:3` (or `rank=`; `at` defaults to step 0).
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |why: String| {
            WgparError::option(
                "--inject-fault",
                format!(
                "--inject-fault '{text}': {why}; expected e.g. stage=1,kind=error,at=step:3 or \
                 rank=0,kind=panic (kind: error, panic, device-lost)"
            ),
            )
        };
        let (mut worker, mut kind, mut after) = (None, None, 0);
        for part in text.split(',').map(str::trim) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("'{part}' is not key=value")))?;
            let number = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(format!("'{v}' is not a whole number")))
            };
            match key.trim() {
                "stage" | "rank" if worker.is_some() => {
                    return Err(bad("give one of stage= and rank=".into()))
                }
                "stage" => worker = Some((number(value)?, true)),
                "rank" => worker = Some((number(value)?, false)),
                "kind" => {
                    kind = Some(match value.trim() {
                        "error" => FaultKind::Error,
                        "panic" => FaultKind::Panic,
                        "device-lost" => FaultKind::LoseDevice,
                        other => return Err(bad(format!("unknown kind '{other}'"))),
                    })
                }
                "at" => after = number(value.trim().strip_prefix("step:").unwrap_or(value))?,
                other => return Err(bad(format!("unknown key '{other}'"))),
            }
        }
        let (worker, stage) = worker.ok_or_else(|| bad("no stage= or rank=".into()))?;
        let kind = kind.ok_or_else(|| bad("no kind=".into()))?;
        Ok(Self {
            worker,
            stage,
            fault: Fault { after, kind },
        })
    }

    /// Checks the spec against the strategy and the number of stages or ranks.
    pub fn check(&self, strategy: &Strategy, devices: usize) -> Result<()> {
        let (ok, count, what) = match strategy {
            Strategy::Tensor { .. } => (!self.stage, devices, "ranks"),
            Strategy::Pipeline { .. } => (self.stage, devices, "stages"),
            Strategy::Hybrid { tp, .. } => (self.stage, devices / (*tp).max(1), "stages"),
            Strategy::Single => {
                return Err(WgparError::unsupported(
                    "--inject-fault needs --strategy tp (rank=), pp or hybrid (stage=)".into(),
                ))
            }
        };
        if !ok {
            return Err(WgparError::option(
                "--inject-fault",
                format!(
                    "--inject-fault: --strategy {strategy} has {what}: use {}=",
                    if what == "ranks" { "rank" } else { "stage" }
                ),
            ));
        }
        if self.worker >= count {
            return Err(WgparError::option(
                "--inject-fault",
                format!(
                    "--inject-fault: no {} {} among {count} {what}",
                    &what[..what.len() - 1],
                    self.worker
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a fault that the run would end before: the worker runs `jobs` jobs after the
    /// fault is injected (`per_step` per step, micro-batches for a stage).
    pub fn check_reached(&self, jobs: usize, per_step: usize) -> Result<()> {
        if self.fault.after < jobs {
            return Ok(());
        }
        let worker = if self.stage { "stage" } else { "rank" };
        Err(WgparError::option(
            "--inject-fault",
            format!(
                "--inject-fault at=step:{}: {worker} {} runs {jobs} jobs in this run ({per_step} \
             per step), so the fault would never fire: use at=step:0 to at=step:{}, or a longer \
             --gen",
                self.fault.after,
                self.worker,
                jobs.saturating_sub(1)
            ),
        ))
    }
}

/// Checks the syntax of the options `run` parses itself (`--inject-fault`, `--pace`) before
/// anything is loaded or discovered; [`plan`] checks them against the strategy later.
pub(super) fn check_syntax(args: &RunArgs) -> Result<()> {
    if let Some(text) = &args.inject_fault {
        FaultSpec::parse(text)?;
    }
    if let Some(text) = &args.pace {
        pacer_for(text)?;
    }
    Ok(())
}

/// What `run` checks before it opens a device or builds a weight: the options against each
/// other, the model's config and the strategy, the adapters' limits, the trace file and the
/// pacer. Returns the strategy, the selected adapters, the weight dtype and the pacer.
pub(super) struct Plan {
    pub strategy: Strategy,
    pub adapters: Vec<AdapterDesc>,
    pub dtype: DType,
    pub pacer: Option<(LinkPacer, String)>,
    pub fault: Option<FaultSpec>,
}

/// Checks what `run` (and text generation) can check before opening devices; `batch`
/// sequences, `seq` prompt tokens each, `steps` steps (prefill and decode) after the fault is
/// injected.
pub(super) fn plan(
    args: &RunArgs,
    config: &ModelConfig,
    adapters: &Adapters,
    (batch, seq): (usize, usize),
    steps: usize,
) -> Result<Plan> {
    let strategy = args.strategy.named(1)?;
    let selected = args.devices.selected(adapters)?;
    if matches!(strategy, Strategy::Single) && selected.len() > 1 {
        return Err(WgparError::unsupported(format!(
            "{} devices selected, but --strategy none runs on one: pass --strategy tp, pp or \
             hybrid to use them, or select one device",
            selected.len()
        )));
    }
    let micro = args.strategy.micro_batches.unwrap_or(1);
    if micro > batch {
        return Err(WgparError::option(
            "--micro-batches",
            format!(
                "--micro-batches {micro} exceeds the batch of {batch}: each micro-batch needs at \
             least one sequence; use at most {batch}"
            ),
        ));
    }
    let fault = planned_fault(args, &strategy, selected.len(), steps)?;
    let dtype = args.model.dtype_for(&selected, args.devices.force_f32)?;
    let setting = Setting {
        config,
        dtype,
        selected: &selected,
        work: Workload { batch, prompt: seq },
    };
    let auto = AutoPlacement::of(&args.strategy, &args.memory);
    let strategy = auto.before_open(strategy, &args.model, &args.devices, &setting)?;
    // The largest step: a whole batch's prefill, or one micro-batch's in a pipeline.
    let step_batch = match strategy {
        Strategy::Pipeline { .. } | Strategy::Hybrid { .. } => batch.div_ceil(micro),
        _ => batch,
    };
    let runs = [super::PlannedRun {
        strategy: &strategy,
        adapters: &selected,
        step_tokens: step_batch.saturating_mul(seq),
        batch: step_batch,
        work: Workload { batch, prompt: seq },
    }];
    super::check_runs_fit(config, dtype, &runs)?;
    (args.memory).check_runs(
        &args.model,
        (config, dtype),
        &args.devices.kv_dtypes(&selected),
        &runs,
    )?;
    check_outputs(args)?;
    let pacer = args.pace.as_deref().map(pacer_for).transpose()?;
    Ok(Plan {
        strategy,
        adapters: selected,
        dtype,
        pacer,
        fault,
    })
}

/// `--inject-fault`, checked against the strategy, its `devices` and the run's `steps`.
fn planned_fault(
    args: &RunArgs,
    strategy: &Strategy,
    devices: usize,
    steps: usize,
) -> Result<Option<FaultSpec>> {
    let Some(text) = &args.inject_fault else {
        return Ok(None);
    };
    let spec = FaultSpec::parse(text)?;
    spec.check(strategy, devices)?;
    let micro = args.strategy.micro_batches.unwrap_or(1);
    let per_step = jobs_per_step(strategy, micro);
    spec.check_reached(steps * per_step, per_step)?;
    Ok(Some(spec))
}

/// The files the run will write (`--trace`, `--logits-out`), checked now rather than after it.
fn check_outputs(args: &RunArgs) -> Result<()> {
    super::create_trace_file(args.trace.as_ref())?;
    if let Some(path) = &args.logits_out {
        super::check_writable_file(std::path::Path::new(path))?;
    }
    Ok(())
}

/// Jobs a faulted worker runs per step: one per micro-batch for a pipeline stage, one for a
/// tensor-parallel rank.
fn jobs_per_step(strategy: &Strategy, micro_batches: usize) -> usize {
    match strategy {
        Strategy::Pipeline { .. } | Strategy::Hybrid { .. } => micro_batches,
        _ => 1,
    }
}

/// Steps of `run`'s warm-up (a generation of 2 tokens: prefill and one decode step).
const WARMUP_STEPS: usize = 2;

/// Injects fault `f` before the warm-up, so that its count of jobs (kept by the worker from its
/// start) skips the warm-up's `per_step` jobs per step and counts the timed run's.
fn inject_before_warmup(engine: &mut dyn Engine, f: FaultSpec, per_step: usize) -> Result<()> {
    let warmup = WARMUP_STEPS * per_step;
    outln!(
        "injecting a {:?} fault into {} {} after {} of its jobs in the timed run ({} with the \
         warm-up's)",
        f.fault.kind,
        if f.stage { "stage" } else { "rank" },
        f.worker,
        f.fault.after,
        f.fault.after + warmup
    )?;
    let mut fault = f.fault;
    fault.after += warmup;
    engine.inject_fault(f.worker, fault)
}

/// The recorder `--trace` asks for.
pub(super) fn recorder_for(args: &RunArgs) -> Recorder {
    if args.trace.is_some() {
        Recorder::new()
            .with_device_timing(DeviceTiming::parse(&args.device_timestamps).unwrap_or_default())
    } else {
        Recorder::disabled()
    }
}

/// Prints a pipeline's bubble share (measured and the GPipe bound), as compare and bench do.
pub(super) fn print_bubble(engine: &dyn Engine, indent: &str) -> Result<()> {
    if let Some(p) = engine.pipeline_stats() {
        outln!(
            "{indent}pipeline: {} stages x {} micro-batches ({}), bubble {:.0}% measured ({:.0}% for equal stages)",
            p.stages.len(),
            p.microbatches,
            p.schedule,
            p.measured_bubble * 100.0,
            p.theoretical_bubble * 100.0
        )?;
    }
    Ok(())
}

/// Writes the recorded timeline to `--trace` and summarises it.
pub(super) fn write_trace(recorder: &Recorder, path: &str) -> Result<()> {
    let timeline = recorder.timeline();
    timeline.write_chrome_trace(path)?;
    outln!(
        "trace: {} spans written to {path} (open in https://ui.perfetto.dev)",
        timeline.spans.len()
    )?;
    let timed: Vec<_> = timeline
        .spans
        .iter()
        .filter_map(|s| s.device_ns.map(|ns| (ns, s.dur_ns)))
        .collect();
    if !timed.is_empty() {
        let device: u64 = timed.iter().map(|t| t.0).sum();
        let host: u64 = timed.iter().map(|t| t.1).sum();
        outln!(
            "  device time (timestamp queries) of {} compute spans: {:.1} ms of their {:.1} ms on the host clock ({:.0} %)",
            timed.len(),
            device as f64 / 1e6,
            host as f64 / 1e6,
            device as f64 / host.max(1) as f64 * 100.0
        )?;
    }
    Ok(())
}

/// Runs generation and prints the rates.
pub fn run(args: &RunArgs) -> Result<()> {
    args.strategy.check_options()?;
    check_syntax(args)?;
    if let Some(prompt) = &args.text.prompt {
        return super::text::generate(args, prompt);
    }
    let config = checked_config(args)?;
    let adapters = Adapters::discover()?;
    // The timed part: one prefill, then a generation (a prefill and gen - 1 decode steps).
    let timed_steps = args.gen + 1;
    let work = (args.batch, args.prompt_len);
    let plan = plan(args, &config, &adapters, work, timed_steps)?;
    let (placed, weights) = open_placed(args, &config, &adapters, &plan)?;
    // What the engine holds from here on (the measurement's probe models are gone).
    let before: Vec<u64> = placed.gpus.iter().map(|g| g.bytes_live()).collect();
    let (mut engine, format) = ready_engine(args, &config, &placed, weights, plan)?;
    timed_generation(args, &config, engine.as_mut(), &placed)?;
    let work = Workload {
        batch: work.0,
        prompt: work.1,
    };
    let memory = AccountingParts::of(&placed.gpus, format, work);
    let accounted = per_device(&placed.strategy, placed.gpus.len(), &memory.spec(&config))?;
    print_allocated(&placed.gpus, &accounted, &before)?;
    print_weight_bytes(args, &accounted)
}

/// The devices' weight bytes (as accounted, which the memory lines check against what was
/// allocated; summed over devices) beside a GGUF file's tensor bytes, so that a file widened
/// on the device shows.
fn print_weight_bytes(args: &RunArgs, accounted: &[DeviceBytes]) -> Result<()> {
    let device: u64 = accounted.iter().map(|a| a.weights).sum();
    let file = match args.model.checkpoint_dir() {
        Some(path) if wgpar::model::gguf::is_gguf(path) => {
            let f = wgpar::model::gguf::GgufFile::open(path)?;
            let bytes: u64 = (f.tensors.iter())
                .map(|(_, i)| (i.end - i.start) as u64)
                .sum();
            let ratio = device as f64 / bytes.max(1) as f64;
            format!(", the file's tensors {bytes} B ({ratio:.2}x)")
        }
        _ => String::new(),
    };
    outln!("weights: {device} B on the device(s){file}")
}

/// The model's config, checked against `run`'s own options (sampling needs `--prompt`; the
/// batch, prompt and generation are positive and fit the context).
fn checked_config(args: &RunArgs) -> Result<ModelConfig> {
    if args.text.samples() {
        return Err(WgparError::unsupported(
            "--temperature, --top-k and --top-p pick the tokens of text generation: they need \
             --prompt (a run on synthetic prompts decodes greedily)"
                .into(),
        ));
    }
    args.text.refuse_tokenizer()?;
    let config = args.model.config()?;
    if args.batch == 0 || args.prompt_len == 0 || args.gen == 0 {
        return Err(WgparError::option(
            "--batch",
            "--batch, --prompt-len and --gen must be positive".into(),
        ));
    }
    super::check_context(args.prompt_len, args.gen, &config)?;
    Ok(config)
}

/// The opened devices and the strategy with its measured placement resolved.
struct Placed {
    gpus: Vec<Arc<Gpu>>,
    dtype: DType,
    strategy: Strategy,
}

/// Opens the plan's devices, loads the weights and resolves a measured placement (`--layers
/// auto`, `--partition balanced`, `--split auto`), so that the accounting sees the engine's
/// split.
fn open_placed(
    args: &RunArgs,
    config: &ModelConfig,
    adapters: &Adapters,
    plan: &Plan,
) -> Result<(Placed, ModelWeights)> {
    let count = plan.strategy.devices_used(plan.adapters.len());
    let gpus = args.devices.open_first(adapters, count)?;
    let dtype = args.model.dtype(&gpus)?;
    debug_assert_eq!(dtype, plan.dtype);
    let weights = args.model.weights(config)?;
    let work = Workload {
        batch: args.batch,
        prompt: args.prompt_len,
    };
    let auto = AutoPlacement::of(&args.strategy, &args.memory);
    let strategy = auto.once_open(&plan.strategy, &gpus, (&weights, dtype), work)?;
    let placed = Placed {
        gpus,
        dtype,
        strategy,
    };
    Ok((placed, weights))
}

/// Prints the model line, builds the engine (the host weights dropped once it holds them),
/// sets the pacer and the fault, and runs the untimed warm-up. Returns the engine and how
/// its weights are stored (for the accounting).
fn ready_engine(
    args: &RunArgs,
    config: &ModelConfig,
    placed: &Placed,
    weights: ModelWeights,
    plan: Plan,
) -> Result<(Box<dyn Engine>, WeightFormat)> {
    let (gpus, dtype, strategy) = (&placed.gpus, placed.dtype, &placed.strategy);
    outln!(
        "model {} ({} arch, {} layers, hidden {}, {:.1}M params, {}, {})",
        config.name,
        format!("{:?}", config.arch).to_lowercase(),
        config.layers,
        config.hidden,
        config.params() as f64 / 1e6,
        storage_of(&weights, dtype),
        kv_of(gpus),
    )?;
    let probe = (args.batch, args.prompt_len);
    let comm = CommConfig::default();
    let mut engine = build_engine(strategy, gpus, &weights, dtype, &comm, probe)?;
    let format = WeightFormat::of_weights(&weights, dtype);
    let prompts = synthetic_prompts(args, config.vocab);
    drop(weights);
    outln!("engine: {}", engine.name())?;
    if let Some((pacer, what)) = plan.pacer {
        outln!("pacing transfers to {what}")?;
        engine.set_pacer(Some(Arc::new(pacer)));
    }
    if let Some(f) = plan.fault {
        let micro = args.strategy.micro_batches.unwrap_or(1);
        inject_before_warmup(engine.as_mut(), f, jobs_per_step(strategy, micro))?;
    }
    // One untimed pass compiles the pipelines and allocates buffers.
    generate(engine.as_mut(), &prompts, WARMUP_STEPS)?;
    Ok((engine, format))
}

/// The timed part, recorded: one prefill (for its accounting), then the generation; prints
/// the rates, the bubble and the tokens, and writes the logits and the trace if asked.
fn timed_generation(
    args: &RunArgs,
    config: &ModelConfig,
    engine: &mut dyn Engine,
    placed: &Placed,
) -> Result<()> {
    let recorder = recorder_for(args);
    // What `wgpar project` needs to turn a makespan into throughput, and what a reader of the
    // trace needs to know what ran. The recorded part is one prefill, then a generation (a
    // prefill and gen - 1 decode steps).
    let processed = args.batch * (2 * args.prompt_len + args.gen - 1);
    for (key, value) in [
        ("model", config.name.clone()),
        ("strategy", engine.name()),
        ("dtype", format!("{:?}", placed.dtype).to_lowercase()),
        ("batch", args.batch.to_string()),
        ("prompt_len", args.prompt_len.to_string()),
        ("gen", args.gen.to_string()),
        ("tokens", processed.to_string()),
        ("adapters", super::adapter_labels(&placed.gpus)),
    ] {
        recorder.set_meta(key, value);
    }
    engine.set_recorder(recorder.clone());
    let prompts = synthetic_prompts(args, config.vocab);
    engine.prefill(&prompts)?;
    let prefill_stats = engine.last_step();
    let prefill_pipeline = engine.pipeline_stats();
    let g = generate_keeping(engine, &prompts, args.gen, keep_for(args))?;
    let (batch, prefill) = (
        args.batch,
        (prefill_stats.as_ref(), prefill_pipeline.as_ref()),
    );
    print_rates(&g, batch, prefill.0, prefill.1)?;
    // In flight, the last run is the whole decode; under GPipe, its last step.
    print_bubble(engine, "  decode ")?;
    outln!("first sequence's tokens: {:?}", g.tokens[0])?;
    if let Some(path) = &args.logits_out {
        write_logits(path, args.batch, config.vocab, &g)?;
    }
    if let Some(path) = &args.trace {
        write_trace(&recorder, path)?;
    }
    Ok(())
}

/// Prints a run's prefill and decode rates, with the prefill's accounting (`prefill_stats`)
/// and its pipeline's bubble.
fn print_rates(
    g: &wgpar::parallel::Generation,
    batch: usize,
    prefill_stats: Option<&wgpar::parallel::StepStats>,
    prefill_pipeline: Option<&wgpar::parallel::PipelineStats>,
) -> Result<()> {
    outln!(
        "prefill: {} tokens in {:.1} ms = {:.1} tokens/s (time to first token {:.1} ms)",
        g.prompt_tokens,
        g.prefill_s * 1e3,
        g.prefill_tokens_per_s(),
        g.prefill_s * 1e3
    )?;
    if let Some(s) = prefill_stats {
        outln!(
            "  compute {:.1} ms, communication {:.1} ms ({:.0}% of device time), {} collectives/hand-offs, {} B sent per device",
            s.compute_s * 1e3,
            s.comm_s * 1e3,
            s.comm_share() * 100.0,
            s.collectives,
            s.bytes_sent
        )?;
        outln!("  {}", s.per_token_line())?;
    }
    if let Some(p) = prefill_pipeline {
        outln!(
            "  pipeline: {} stages x {} micro-batches, bubble {:.0}% measured ({:.0}% = (p-1)/(m+p-1) for equal stages)",
            p.stages.len(),
            p.microbatches,
            p.measured_bubble * 100.0,
            p.theoretical_bubble * 100.0
        )?;
    }
    outln!(
        "decode: {} tokens x {} sequences in {:.1} ms, {:.2} ms per token = {:.1} tokens/s",
        g.decode_steps,
        batch,
        g.decode_s * 1e3,
        g.per_token_s() * 1e3,
        g.decode_tokens_per_s()
    )?;
    if g.decode_steps > 0 {
        let s = &g.decode_stats;
        outln!(
            "  compute {:.2} ms, communication {:.2} ms ({:.0}%), {} collectives/hand-offs per device",
            s.compute_s * 1e3,
            s.comm_s * 1e3,
            s.comm_share() * 100.0,
            s.collectives
        )?;
        outln!("  {}", s.per_token_line())?;
    }
    Ok(())
}

/// The logits a run keeps: every step's where `--logits-out` asks for them, else none (only
/// token ids are read back).
/// How the weights are held on the device: packed into one block type, the file's own
/// blocks, or `dtype` throughout.
pub(super) fn storage_of(weights: &ModelWeights, dtype: DType) -> String {
    match (weights.packed, weights.block_types().as_slice()) {
        (Some(t), _) if weights.tables.iter().next().is_some() => {
            let tables: Vec<String> = (weights.tables.iter())
                .map(|(name, m)| format!("{name} in the file's {}", m.dtype.name()))
                .collect();
            let tables = tables.join(", ");
            format!("{} layer matrices, {tables}, {dtype:?} elsewhere", t.name())
        }
        (Some(t), _) => format!("{} layer matrices, {dtype:?} elsewhere", t.name()),
        (None, []) => format!("{dtype:?} weights"),
        (None, types) => {
            let names: Vec<&str> = types.iter().map(|t| t.name()).collect();
            format!("the file's {} blocks, {dtype:?} elsewhere", names.join("/"))
        }
    }
}

/// The KV caches' element type: one for all devices, or each device's where they differ
/// (`--kv-dtype auto` over adapters with and without SHADER_F16).
pub(super) fn kv_of(gpus: &[Arc<Gpu>]) -> String {
    let types: Vec<DType> = gpus.iter().map(|g| g.kv_dtype()).collect();
    if types.windows(2).all(|w| w[0] == w[1]) {
        return format!(
            "{:?} KV cache",
            types.first().copied().unwrap_or(DType::F32)
        );
    }
    let each: Vec<String> = gpus
        .iter()
        .map(|g| format!("{:?} on {}", g.kv_dtype(), g.label()))
        .collect();
    format!("KV cache {}", each.join(", "))
}

/// `--batch` prompts of `--prompt-len` token ids spread over the vocabulary, the same in one
/// process and over ranks.
pub(super) fn synthetic_prompts(args: &RunArgs, vocab: usize) -> Vec<Vec<u32>> {
    (0..args.batch)
        .map(|b| {
            (0..args.prompt_len)
                .map(|i| ((b * 7919 + i * 104_729) % vocab) as u32)
                .collect()
        })
        .collect()
}

pub(super) fn keep_for(args: &RunArgs) -> KeepLogits {
    if args.logits_out.is_some() {
        KeepLogits::All
    } else {
        KeepLogits::None
    }
}

/// Writes a generation's tokens and every step's logits as JSON (`--logits-out`).
pub(super) fn write_logits(
    path: &str,
    batch: usize,
    vocab: usize,
    g: &wgpar::parallel::Generation,
) -> Result<()> {
    let rows: Vec<&Vec<f32>> = g.logits.iter().map(|l| &l.data).collect();
    let text = serde_json::to_string(&serde_json::json!({
        "batch": batch, "vocab": vocab, "tokens": g.tokens, "logits": rows
    }))
    .map_err(|source| WgparError::Json {
        what: "logits".into(),
        source,
    })?;
    std::fs::write(path, text).map_err(|source| WgparError::Io {
        path: path.to_string(),
        source,
    })
}

/// The pacer `--pace` names: one link as `ALPHA_US:BETA_GBPS`, else a host profile (device 0's
/// host link, collectives by the profile's cost model). Also says what it paces to.
pub(super) fn pacer_for(text: &str) -> Result<(LinkPacer, String)> {
    let spec = PaceSpec::parse(text).map_err(|source| WgparError::Pacing {
        target: format!("--pace {text}"),
        source,
    })?;
    let name = match spec {
        PaceSpec::Link {
            alpha_us,
            beta_gbps,
        } => {
            let pacer = LinkPacer::from_alpha_beta(alpha_us, beta_gbps).map_err(|source| {
                WgparError::Pacing {
                    target: format!("--pace {text}"),
                    source,
                }
            })?;
            return Ok((
                pacer,
                format!("one link of {alpha_us} us + bytes / {beta_gbps} GB/s per message"),
            ));
        }
        PaceSpec::Profile(name) => name,
    };
    let profile = HostProfile::resolve(&name)?;
    let pacer = LinkPacer::from_profile(&profile, 0).map_err(|source| WgparError::Pacing {
        target: format!("profile {}", profile.name),
        source,
    })?;
    Ok((pacer, format!("the links of {}", profile.name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpar::sim::Direction;

    #[test]
    fn pace_takes_a_link_or_a_profile() {
        let (gbit, what) = pacer_for("50:0.125").unwrap();
        assert!(
            what.contains("50 us") && what.contains("0.125 GB/s"),
            "{what}"
        );
        // 1 MB over 1 Gb/s: 50 us + 8 ms.
        let t = gbit.model_us(Direction::DeviceToHost, 1_000_000);
        assert!((t - 8050.0).abs() < 1e-6, "{t}");
        let (_, what) = pacer_for("pcie3-2gpu").unwrap();
        assert!(what.contains("pcie3-2gpu"), "{what}");
        let e = pacer_for("50:-1").unwrap_err().to_string();
        assert!(e.contains("--pace 50:-1"), "{e}");
        // A link with a bad number names the number, not a missing profile.
        let e = pacer_for("5:abc").unwrap_err().to_string();
        assert!(
            e.contains("'abc'") && !e.contains("shipped profiles"),
            "{e}"
        );
        assert!(pacer_for("no-such-profile").is_err());
    }
}
