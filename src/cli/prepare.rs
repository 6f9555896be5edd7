//! What a run on synthetic prompts and text generation check before they open a device (the
//! strategy, devices, memory, fault and pacer: [`plan`]), and the trace they record.

use wgpar::device::{AdapterDesc, Adapters, DType};
use wgpar::model::memory::Workload;
use wgpar::model::ModelConfig;
use wgpar::parallel::Strategy;
use wgpar::sim::LinkPacer;
use wgpar::trace::{DeviceTiming, Recorder};
use wgpar::{Result, WgparError};

use super::memory::{check_runs_fit, PlannedRun};
use super::options::{check_writable_file, create_trace_file, pacer_for, RunArgs};
use wgpar::parallel::arming::{jobs_per_step, FaultSpec};
use wgpar::parallel::auto::Setting;

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
    let dtype = args
        .model
        .choice()
        .dtype_for(&selected, args.devices.force_f32)?;
    let setting = Setting {
        config,
        dtype,
        model: args.model.choice(),
        kv: args.devices.kv_dtypes(&selected),
        selected: &selected,
        work: Workload { batch, prompt: seq },
    };
    let auto = args.strategy.auto_placement(&args.memory);
    let strategy = auto.before_open(strategy, &setting)?;
    // The largest step: a whole batch's prefill, or one micro-batch's in a pipeline.
    let step_batch = match strategy {
        Strategy::Pipeline { .. } | Strategy::Hybrid { .. } => batch.div_ceil(micro),
        _ => batch,
    };
    let runs = [PlannedRun {
        strategy: &strategy,
        adapters: &selected,
        step_tokens: step_batch.saturating_mul(seq),
        batch: step_batch,
        work: Workload { batch, prompt: seq },
    }];
    check_runs_fit(config, dtype, &runs)?;
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
    create_trace_file(args.trace.as_ref())?;
    if let Some(path) = &args.logits_out {
        check_writable_file(std::path::Path::new(path))?;
    }
    Ok(())
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

/// Writes the recorded timeline to `--trace` and summarises it.
pub(super) fn write_trace(recorder: &Recorder, path: &str) -> Result<()> {
    let timeline = recorder.timeline();
    timeline.write_chrome_trace(path)?;
    outln!(
        "trace: {} spans written to {path} (open in https://ui.perfetto.dev)",
        timeline.spans.len()
    )?;
    if let Some(line) = timeline.device_time_line() {
        outln!("  {line}")?;
    }
    Ok(())
}

/// The devices' adapters for a trace's metadata: their labels, `; `-separated.
pub(super) fn adapter_labels(gpus: &[std::sync::Arc<wgpar::device::Gpu>]) -> String {
    let labels: Vec<String> = gpus.iter().map(|g| g.info().label()).collect();
    labels.join("; ")
}
