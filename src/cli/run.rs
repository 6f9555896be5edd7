//! `wgpar run`: prefill + greedy decode on the chosen strategy, with tokens/s and where the
//! time went.

use std::sync::Arc;
use wgpar::comm::CommConfig;
use wgpar::device::{Adapters, DType, Gpu};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::timed::{
    kv_of, render_bubble, render_rates, storage_of, write_logits, WARMUP_STEPS,
};
use wgpar::parallel::{build_engine, Engine, Strategy};

use wgpar::{Result, WgparError};

use super::options::RunArgs;
use super::trace::{adapter_labels, write_trace};
use wgpar::memory_check::render_allocated;
use wgpar::model::memory::{per_device, DeviceBytes, WeightFormat, Workload};
use wgpar::parallel::arming::{jobs_per_step, FaultSpec};
use wgpar::parallel::auto::AccountingParts;
use wgpar::parallel::run_plan::RunPlan as Plan;

/// Injects fault `f` before the warm-up (shifted past the warm-up's jobs, so that it counts
/// the timed run's), and says so.
fn inject_before_warmup(engine: &mut dyn Engine, f: FaultSpec, per_step: usize) -> Result<()> {
    let fault = f.past_warmup(WARMUP_STEPS, per_step);
    outln!(
        "injecting a {:?} fault into {} {} after {} of its jobs in the timed run ({} with the \
         warm-up's)",
        f.fault.kind,
        if f.stage { "stage" } else { "rank" },
        f.worker,
        f.fault.after,
        fault.after
    )?;
    engine.inject_fault(f.worker, fault)
}

/// Runs generation and prints the rates.
pub fn run(args: &RunArgs) -> Result<()> {
    let choice = args.choice();
    choice.strategy.check_options()?;
    choice.check_syntax()?;
    if let Some(prompt) = &args.text.prompt {
        return super::text::generate(args, prompt);
    }
    let config = checked_config(args)?;
    let adapters = Adapters::discover()?;
    // The timed part: one prefill, then a generation (a prefill and gen - 1 decode steps).
    let timed_steps = args.gen + 1;
    let work = (args.batch, args.prompt_len);
    let plan = choice.plan(&config, &adapters, work, timed_steps)?;
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
    out!("{}", render_allocated(&placed.gpus, &accounted, &before))?;
    print_weight_bytes(args, &accounted)
}

/// The devices' weight bytes (as accounted, which the memory lines check against what was
/// allocated; summed over devices) beside a GGUF file's tensor bytes, so that a file widened
/// on the device shows.
fn print_weight_bytes(args: &RunArgs, accounted: &[DeviceBytes]) -> Result<()> {
    let device: u64 = accounted.iter().map(|a| a.weights).sum();
    let file = match args.model.choice().checkpoint_dir() {
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
    let config = args.model.choice().config()?;
    if args.batch == 0 || args.prompt_len == 0 || args.gen == 0 {
        return Err(WgparError::option(
            "--batch",
            "--batch, --prompt-len and --gen must be positive".into(),
        ));
    }
    wgpar::memory_check::check_context(args.prompt_len, args.gen, &config)?;
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
    let gpus = args.devices.choice().open_first(adapters, count)?;
    let dtype = args.model.choice().dtype(&gpus)?;
    debug_assert_eq!(dtype, plan.dtype);
    let weights = args.model.choice().weights(config)?;
    let work = Workload {
        batch: args.batch,
        prompt: args.prompt_len,
    };
    let auto = (args.strategy.choice()).auto_placement(args.memory.gpu_memory.as_deref());
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
    args.timed().warm_up(engine.as_mut(), config.vocab)?;
    Ok((engine, format))
}

/// The timed part, recorded ([`TimedRun::run`]); prints the rates, the bubble and the
/// tokens, and writes the logits and the trace if asked.
fn timed_generation(
    args: &RunArgs,
    config: &ModelConfig,
    engine: &mut dyn Engine,
    placed: &Placed,
) -> Result<()> {
    let recorder = args.choice().recorder();
    let timed = args.timed();
    timed.describe(&recorder, &config.name, &engine.name());
    recorder.set_meta("dtype", format!("{:?}", placed.dtype).to_lowercase());
    recorder.set_meta("adapters", adapter_labels(&placed.gpus));
    engine.set_recorder(recorder.clone());
    let done = timed.run(engine, config.vocab)?;
    let g = &done.generation;
    out!("{}", render_rates(g, args.batch, &done.prefill))?;
    // In flight, the last run is the whole decode; under GPipe, its last step.
    out!(
        "{}",
        render_bubble(engine.pipeline_stats().as_ref(), "  decode ")
    )?;
    outln!("first sequence's tokens: {:?}", g.tokens[0])?;
    if let Some(path) = &args.logits_out {
        write_logits(path, args.batch, config.vocab, g)?;
    }
    if let Some(path) = &args.trace {
        write_trace(&recorder, path)?;
    }
    Ok(())
}
