//! `wgpar bench decode`: what one decode step costs the host (staging its inputs, recording
//! its commands, submitting them), decode tokens/s, and the buffers and bind groups a
//! steady-state step creates, for the single-device, tensor-parallel and pipeline engines
//! (the pipeline's stage threads do not report an encode time: tokens/s and allocations
//! only).

use clap::Args;
use wgpar::device::{open_devices, Adapters, DeviceSelection};
use wgpar::memory_check::PlannedRun;
use wgpar::model::memory::Workload;
use wgpar::parallel::run_plan::check_planned_runs;
use wgpar::parallel::{decode_strategy, DecodeBench};
use wgpar::{Result, WgparError};

/// Options of `wgpar bench decode`.
#[derive(Args, Debug)]
pub struct DecodeBenchArgs {
    #[command(flatten)]
    model: super::options::ModelArgs,
    #[command(flatten)]
    binding: super::options::ModelDeviceArgs,
    #[command(flatten)]
    memory: super::options::MemoryArgs,
    /// Strategies: single, tp (over --tp virtual devices on the preferred adapter), pp (over
    /// --stages virtual devices, one micro-batch).
    #[arg(long, value_delimiter = ',', default_value = "single,tp,pp")]
    strategies: Vec<String>,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Prompt length per sequence.
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Decode steps timed.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Untimed decode steps first.
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

impl DecodeBenchArgs {
    /// The benchmark's work, the strategies' names checked.
    fn bench(&self) -> Result<DecodeBench> {
        Ok(DecodeBench {
            strategies: (self.strategies.iter())
                .map(|s| decode_strategy(s).map(|st| (s.clone(), st)))
                .collect::<Result<Vec<_>>>()?,
            tp: self.tp,
            stages: self.stages,
            batch: self.batch,
            prompt_len: self.prompt_len,
            warmup: self.warmup,
            steps: self.steps,
        })
    }
}

/// Runs the benchmark and prints a table (or JSON).
pub fn run(args: &DecodeBenchArgs) -> Result<()> {
    let config = args.model.choice().config()?;
    let bench = args.bench()?;
    bench.check(&config)?;
    let adapters = Adapters::discover()?;
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: bench.devices(),
    };
    let selected = args.binding.choice().described(&selection, &adapters)?;
    let dtype = args.model.choice().dtype_for(&selected, false)?;
    let runs: Vec<PlannedRun> = (bench.strategies.iter())
        .map(|(_, s)| PlannedRun {
            strategy: s,
            adapters: &selected[..bench.devices_of(s)],
            step_tokens: args.batch * args.prompt_len,
            batch: args.batch,
            work: Workload {
                batch: args.batch,
                prompt: args.prompt_len,
            },
        })
        .collect();
    let (binding, caps) = (args.binding.choice(), args.memory.gpu_memory.as_deref());
    let kv = binding.kv_dtypes(&selected, false);
    check_planned_runs(args.model.choice(), (&config, dtype), &kv, caps, &runs)?;
    let gpus = open_devices(&adapters, &selection, &binding.gpu_options())?;
    let weights = args.model.choice().weights(&config)?;
    let rows = bench.measure(&gpus, &weights, dtype)?;
    if args.json {
        let text = serde_json::to_string_pretty(&rows).map_err(|source| WgparError::Json {
            what: "the decode benchmark".into(),
            source,
        })?;
        return outln!("{text}");
    }
    out!("{}", bench.render(&config, &gpus[0], &rows))
}
