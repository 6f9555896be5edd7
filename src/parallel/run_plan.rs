//! What a run on synthetic prompts (`wgpar run`) and text generation (`run --prompt`,
//! `chat`) check before they open a device: the strategy, the devices, the memory, the
//! injected fault, the pacer and the files they write ([`RunChoice::plan`]); and the engine
//! of text generation built from that plan ([`RunChoice::generation_engine`]), with its
//! prompt's input ([`PromptInput`]); and a timed run on synthetic prompts from that plan
//! ([`RunChoice::timed_generation`]), fault armed and warmed up.

use std::path::Path;
use std::sync::Arc;

use super::arming::{jobs_per_step, FaultSpec};
use super::auto::{AccountingParts, Setting};
use super::choice::StrategyChoice;
use super::timed::{adapter_labels, model_line, weight_bytes_line, Timed, TimedRun, WARMUP_STEPS};
use super::{build_engine, Engine, PipelineStats, Strategy};
use crate::comm::CommConfig;
use crate::device::{AdapterDesc, Adapters, DType, DeviceChoice, Gpu};
use crate::error::{Result, WgparError};
use crate::files::{check_writable_file, create_trace_file};
use crate::load::ModelChoice;
use crate::memory_check::{check_runs_capped, check_runs_fit, render_allocated, PlannedRun};
use crate::model::hf::{Checkpoint, TextTokenizer};
use crate::model::memory::{per_device, WeightFormat, Workload};
use crate::model::sampling::SamplingParams;
use crate::model::{ModelConfig, ModelWeights};
use crate::sim::{pacer_for, LinkPacer};
use crate::trace::{DeviceTiming, Recorder};

/// The choices of a run, as a command gives them.
#[derive(Debug, Clone)]
pub struct RunChoice<'a> {
    /// The devices.
    pub devices: DeviceChoice,
    /// The model.
    pub model: ModelChoice<'a>,
    /// The strategy.
    pub strategy: StrategyChoice,
    /// `--gpu-memory`: one cap per device, or one for all.
    pub gpu_memory: Option<&'a str>,
    /// `--inject-fault`: a worker's fault (tests of the failure path).
    pub inject_fault: Option<&'a str>,
    /// `--pace`: a host profile, or ALPHA_US:BETA_GBPS.
    pub pace: Option<&'a str>,
    /// `--trace`: the timeline's file.
    pub trace: Option<&'a str>,
    /// `--logits-out`: every step's logits' file.
    pub logits_out: Option<&'a str>,
    /// `--device-timestamps`: auto, on or off.
    pub device_timestamps: &'a str,
}

/// What a run checked before it opens a device.
pub struct RunPlan {
    /// The strategy, its `auto` placement resolved as far as the accounting goes.
    pub strategy: Strategy,
    /// The selected adapters.
    pub adapters: Vec<AdapterDesc>,
    /// The weights' dtype.
    pub dtype: DType,
    /// The pacer `--pace` asks for, with what it paces to.
    pub pacer: Option<(LinkPacer, String)>,
    /// The fault `--inject-fault` asks for.
    pub fault: Option<FaultSpec>,
}

/// Text generation's engine, ready: sampling, pacer, fault and recorder set.
pub struct Generation {
    /// The engine.
    pub engine: Box<dyn Engine>,
    /// The recorder `--trace` asks for (disabled without it).
    pub recorder: Recorder,
    /// What the transfers are paced to, when `--pace` asks.
    pub paced: Option<String>,
}

/// Refuses, before a device opens, `runs` that would not fit their adapters, or whose
/// accounted bytes (the weights stored as `model` says, the KV caches as `kv`) exceed the
/// `caps` (`--gpu-memory`).
pub fn check_planned_runs(
    model: ModelChoice<'_>,
    (config, dtype): (&ModelConfig, DType),
    kv: &[DType],
    caps: Option<&str>,
    runs: &[PlannedRun<'_>],
) -> Result<()> {
    check_runs_fit(config, dtype, runs)?;
    let format = model.weight_format(config, dtype)?;
    check_runs_capped(caps, &format, config, kv, runs)
}

impl RunChoice<'_> {
    /// Checks the syntax of `--inject-fault` and `--pace` before anything is loaded or
    /// discovered; [`Self::plan`] checks them against the strategy later.
    pub fn check_syntax(&self) -> Result<()> {
        if let Some(text) = self.inject_fault {
            FaultSpec::parse(text)?;
        }
        if let Some(text) = self.pace {
            pacer_for(text)?;
        }
        Ok(())
    }

    /// Checks what a run can check before opening devices: `batch` sequences of `seq` prompt
    /// tokens each, `steps` steps (prefill and decode) after the fault is injected.
    pub fn plan(
        &self,
        config: &ModelConfig,
        adapters: &Adapters,
        (batch, seq): (usize, usize),
        steps: usize,
    ) -> Result<RunPlan> {
        let strategy = self.strategy.named(1)?;
        let selected = self.devices.selected(adapters)?;
        self.check_counts(&strategy, selected.len(), batch)?;
        let fault = self.planned_fault(&strategy, selected.len(), steps)?;
        let dtype = self.model.dtype_for(&selected, self.devices.force_f32)?;
        let work = Workload { batch, prompt: seq };
        let setting = Setting {
            config,
            dtype,
            model: self.model,
            kv: self.devices.kv_dtypes(&selected),
            selected: &selected,
            work,
        };
        let auto = self.strategy.auto_placement(self.gpu_memory);
        let strategy = auto.before_open(strategy, &setting)?;
        // The largest step: a whole batch's prefill, or one micro-batch's in a pipeline.
        let step_batch = match strategy {
            Strategy::Pipeline { .. } | Strategy::Hybrid { .. } => batch.div_ceil(self.micro()),
            _ => batch,
        };
        let runs = [PlannedRun {
            strategy: &strategy,
            adapters: &selected,
            step_tokens: step_batch.saturating_mul(seq),
            batch: step_batch,
            work,
        }];
        let fit = (config, dtype);
        check_planned_runs(self.model, fit, &setting.kv, self.gpu_memory, &runs)?;
        self.check_outputs()?;
        let pacer = self.pace.map(pacer_for).transpose()?;
        Ok(RunPlan {
            strategy,
            adapters: selected,
            dtype,
            pacer,
            fault,
        })
    }

    /// Micro-batches per batch (1 unless given).
    fn micro(&self) -> usize {
        self.strategy.micro_batches.unwrap_or(1)
    }

    /// Refuses several devices for one, and more micro-batches than sequences.
    fn check_counts(&self, strategy: &Strategy, devices: usize, batch: usize) -> Result<()> {
        if matches!(strategy, Strategy::Single) && devices > 1 {
            return Err(WgparError::unsupported(format!(
                "{devices} devices selected, but --strategy none runs on one: pass --strategy \
                 tp, pp or hybrid to use them, or select one device"
            )));
        }
        let micro = self.micro();
        if micro > batch {
            return Err(WgparError::option(
                "--micro-batches",
                format!(
                    "--micro-batches {micro} exceeds the batch of {batch}: each micro-batch \
                     needs at least one sequence; use at most {batch}"
                ),
            ));
        }
        Ok(())
    }

    /// `--inject-fault`, checked against the strategy, its `devices` and the run's `steps`.
    fn planned_fault(
        &self,
        strategy: &Strategy,
        devices: usize,
        steps: usize,
    ) -> Result<Option<FaultSpec>> {
        let Some(text) = self.inject_fault else {
            return Ok(None);
        };
        let spec = FaultSpec::parse(text)?;
        spec.check(strategy, devices)?;
        let per_step = jobs_per_step(strategy, self.micro());
        spec.check_reached(steps * per_step, per_step)?;
        Ok(Some(spec))
    }

    /// The files the run will write (`--trace`, `--logits-out`), checked now rather than
    /// after it.
    fn check_outputs(&self) -> Result<()> {
        create_trace_file(self.trace.map(str::to_string).as_ref())?;
        if let Some(path) = self.logits_out {
            check_writable_file(Path::new(path))?;
        }
        Ok(())
    }

    /// The recorder `--trace` asks for (with device timestamps as `--device-timestamps`
    /// says), disabled without it.
    pub fn recorder(&self) -> Recorder {
        match self.trace {
            Some(_) => Recorder::new().with_device_timing(
                DeviceTiming::parse(self.device_timestamps).unwrap_or_default(),
            ),
            None => Recorder::disabled(),
        }
    }

    /// The engine of text generation on the planned strategy and devices, for prompts of `seq`
    /// tokens and up to `max_new` generated ones, sampling as `sampling` says; `weights` may
    /// be dropped once it returns.
    pub fn generation_engine(
        &self,
        weights: &ModelWeights,
        sampling: SamplingParams,
        (seq, max_new): (usize, usize),
    ) -> Result<Generation> {
        let adapters = Adapters::discover()?;
        // Prefill and max_new - 1 decode steps, the fault injected before the first.
        let plan = self.plan(&weights.config, &adapters, (1, seq), max_new)?;
        let count = plan.strategy.devices_used(plan.adapters.len());
        let gpus = self.devices.open_first(&adapters, count)?;
        let dtype = self.model.dtype(&gpus)?;
        let comm = CommConfig::default();
        let mut engine = build_engine(&plan.strategy, &gpus, weights, dtype, &comm, (1, seq))?;
        engine.set_sampling(sampling)?;
        let paced = plan.pacer.map(|(pacer, what)| {
            engine.set_pacer(Some(Arc::new(pacer)));
            what
        });
        if let Some(f) = plan.fault {
            engine.inject_fault(f.worker, f.fault)?;
        }
        let recorder = self.recorder();
        recorder.set_meta("model", weights.config.name.clone());
        recorder.set_meta("strategy", engine.name());
        engine.set_recorder(recorder.clone());
        Ok(Generation {
            engine,
            recorder,
            paced,
        })
    }
}

/// A timed generation on synthetic prompts, done ([`RunChoice::timed_generation`]): what
/// `wgpar run` prints and writes.
pub struct TimedGeneration {
    /// The measured part.
    pub timed: Timed,
    /// The decode's pipeline statistics (pipelines only): in flight, the whole decode; under
    /// GPipe, its last step.
    pub decode_pipeline: Option<PipelineStats>,
    /// The recorder `--trace` asks for (disabled without it), with the run's metadata.
    pub recorder: Recorder,
    /// Each device's allocated bytes against the accounting's ([`render_allocated`]), taken
    /// while the engine still held its buffers.
    pub memory: String,
    /// The devices' weight bytes beside a GGUF file's tensor bytes ([`weight_bytes_line`]).
    pub weights: String,
}

/// The opened devices and the strategy with its measured placement resolved.
struct Placed {
    gpus: Vec<Arc<Gpu>>,
    dtype: DType,
    strategy: Strategy,
}

impl RunChoice<'_> {
    /// `wgpar run` on synthetic prompts, in one call: plans `run` of `config` ([`Self::plan`]),
    /// opens the devices, loads the weights, resolves a measured placement, builds the engine,
    /// sets the pacer, arms the fault past the warm-up, warms up, then records the timed part
    /// ([`TimedRun::run`]) and checks the devices' bytes against the accounting. `say` gets
    /// each line as it happens (the model, the engine, the pacing, the fault), so that a run
    /// that fails later has said what it was.
    pub fn timed_generation(
        &self,
        config: &ModelConfig,
        run: TimedRun,
        say: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<TimedGeneration> {
        let adapters = Adapters::discover()?;
        // The timed part: one prefill, then a generation (a prefill and gen - 1 decode steps).
        let plan = self.plan(config, &adapters, (run.batch, run.prompt_len), run.gen + 1)?;
        let work = Workload {
            batch: run.batch,
            prompt: run.prompt_len,
        };
        let (placed, weights) = self.open_placed(config, &adapters, &plan, work)?;
        // What the engine holds from here on (the measurement's probe models are gone).
        let before: Vec<u64> = placed.gpus.iter().map(|g| g.bytes_live()).collect();
        let format = WeightFormat::of_weights(&weights, placed.dtype);
        say(&model_line(config, &weights, placed.dtype, &placed.gpus))?;
        let mut engine = self.ready_engine(&placed, weights, plan, run, say)?;
        let recorder = self.recorder();
        run.describe(&recorder, &config.name, &engine.name());
        recorder.set_meta("dtype", format!("{:?}", placed.dtype).to_lowercase());
        recorder.set_meta("adapters", adapter_labels(&placed.gpus));
        engine.set_recorder(recorder.clone());
        let timed = run.run(engine.as_mut(), config.vocab)?;
        let memory = AccountingParts::of(&placed.gpus, format, work);
        let accounted = per_device(&placed.strategy, placed.gpus.len(), &memory.spec(config))?;
        Ok(TimedGeneration {
            timed,
            decode_pipeline: engine.pipeline_stats(),
            recorder,
            memory: render_allocated(&placed.gpus, &accounted, &before),
            weights: weight_bytes_line(self.model, &accounted)?,
        })
    }

    /// Opens the plan's devices, loads the weights and resolves a measured placement
    /// (`--layers auto`, `--partition balanced`, `--split auto`), so that the accounting sees
    /// the engine's split.
    fn open_placed(
        &self,
        config: &ModelConfig,
        adapters: &Adapters,
        plan: &RunPlan,
        work: Workload,
    ) -> Result<(Placed, ModelWeights)> {
        let count = plan.strategy.devices_used(plan.adapters.len());
        let gpus = self.devices.open_first(adapters, count)?;
        let dtype = self.model.dtype(&gpus)?;
        debug_assert_eq!(dtype, plan.dtype);
        let weights = self.model.weights(config)?;
        let auto = self.strategy.auto_placement(self.gpu_memory);
        let strategy = auto.once_open(&plan.strategy, &gpus, (&weights, dtype), work)?;
        let placed = Placed {
            gpus,
            dtype,
            strategy,
        };
        Ok((placed, weights))
    }

    /// Builds the engine (the host weights dropped once it holds them), says its name, sets
    /// the pacer and the fault (shifted past the warm-up's jobs, so that it counts the timed
    /// run's), and runs the untimed warm-up.
    fn ready_engine(
        &self,
        placed: &Placed,
        weights: ModelWeights,
        plan: RunPlan,
        run: TimedRun,
        say: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Box<dyn Engine>> {
        let probe = (run.batch, run.prompt_len);
        let comm = CommConfig::default();
        let (gpus, dtype, strategy) = (&placed.gpus, placed.dtype, &placed.strategy);
        let mut engine = build_engine(strategy, gpus, &weights, dtype, &comm, probe)?;
        let vocab = weights.config.vocab;
        drop(weights);
        say(&format!("engine: {}", engine.name()))?;
        if let Some((pacer, what)) = plan.pacer {
            say(&format!("pacing transfers to {what}"))?;
            engine.set_pacer(Some(Arc::new(pacer)));
        }
        if let Some(f) = plan.fault {
            let fault = f.past_warmup(WARMUP_STEPS, jobs_per_step(strategy, self.micro()));
            say(&format!(
                "injecting a {:?} fault into {} {} after {} of its jobs in the timed run ({} \
                 with the warm-up's)",
                f.fault.kind,
                if f.stage { "stage" } else { "rank" },
                f.worker,
                f.fault.after,
                fault.after
            ))?;
            engine.inject_fault(f.worker, fault)?;
        }
        run.warm_up(engine.as_mut(), vocab)?;
        Ok(engine)
    }
}

/// The checkpoint, its tokenizer and the prompt's ids, with the context limited to what this
/// run needs (prompt + `--gen`, checked against the model's and --max-seq).
pub struct PromptInput {
    /// The checkpoint.
    pub ckpt: Checkpoint,
    /// Its tokenizer (or the one given).
    pub tokenizer: TextTokenizer,
    /// The prompt's ids.
    pub ids: Vec<u32>,
}

impl PromptInput {
    /// Loads `model`'s checkpoint and tokenizer (`tokenizer`: another tokenizer.json) and
    /// tokenizes `prompt`, for up to `gen` generated tokens.
    pub fn load(
        model: ModelChoice<'_>,
        tokenizer: Option<&Path>,
        prompt: &str,
        gen: usize,
    ) -> Result<Self> {
        let dir = model.checkpoint_dir().ok_or_else(|| {
            WgparError::option(
                "--model",
                format!(
                    "--prompt needs --model DIR or FILE.gguf, a Hugging Face model folder with \
                     tokenizer.json or a GGUF file ('{}' is neither)",
                    model.model
                ),
            )
        })?;
        let mut ckpt = Checkpoint::open(dir)?;
        if ckpt.config().is_encoder() {
            return Err(WgparError::unsupported(format!(
                "model '{}' is an encoder (BERT): it embeds text, use `wgpar embed`",
                ckpt.config().name
            )));
        }
        let tokenizer = ckpt.tokenizer_from(tokenizer)?;
        let ids = tokenizer.encode(prompt)?;
        if ids.is_empty() {
            return Err(WgparError::option(
                "--prompt",
                "the prompt has no tokens".into(),
            ));
        }
        let context = check_context(ids.len(), gen, ckpt.max_context(), model.max_seq)?;
        // The KV cache and position tables need only this run's length.
        ckpt.limit_context(context)?;
        Ok(Self {
            ckpt,
            tokenizer,
            ids,
        })
    }
}

/// Prompt + --gen tokens, refused beyond the model's context or --max-seq.
fn check_context(
    prompt: usize,
    max_new: usize,
    model_context: usize,
    max_seq: Option<usize>,
) -> Result<usize> {
    let context = prompt.saturating_add(max_new);
    if context > model_context {
        return Err(WgparError::limit(
            "context (tokens)",
            (context as u64, model_context as u64),
            format!(
                "{prompt} prompt tokens + --gen {max_new} exceed the model's context of \
                 {model_context}"
            ),
        ));
    }
    if let Some(limit) = max_seq.filter(|&limit| context > limit) {
        return Err(WgparError::limit(
            "context (tokens)",
            (context as u64, limit as u64),
            format!(
                "{prompt} prompt tokens + --gen {max_new} = {context} tokens exceed --max-seq \
                 {limit}: raise --max-seq or lower --gen"
            ),
        ));
    }
    Ok(context)
}
