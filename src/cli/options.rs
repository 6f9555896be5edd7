//! The option structs every command shares (devices, model, strategy, memory, text, a run's
//! options) and the parsing of option values several commands take. Commands import these,
//! never each other.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use wgpar::device::{
    open_devices, AdapterDesc, Adapters, DType, DeviceSelection, Gpu, GpuOptions, KvCacheType,
};
use wgpar::load::{ModelChoice, TextSide};
use wgpar::model::hub::ModelRef;
use wgpar::model::ModelConfig;
use wgpar::parallel::auto::{AutoPlacement, MAX_LIST_TEXT};
use wgpar::parallel::timed::TimedRun;
use wgpar::parallel::KeepLogits;
use wgpar::parallel::{PartitionSpec, Schedule, Strategy};
use wgpar::{Result, WgparError};

pub(crate) use wgpar::files::{check_writable_dir, check_writable_file, create_trace_file};
pub(crate) use wgpar::sim::pacer_for;

/// Device selection options shared by every command that runs on GPUs.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Adapter indices from `wgpar devices`, comma-separated (an index may repeat).
    #[arg(long)]
    pub(crate) devices: Option<String>,
    /// Open N independent devices on one adapter (the first of --devices, or the preferred one).
    #[arg(long = "virtual", value_name = "N", value_parser = parse_virtual)]
    pub(crate) virtual_count: Option<usize>,
    /// Keep weights in f32 even where the adapter has SHADER_F16.
    #[arg(long)]
    pub(crate) force_f32: bool,
    #[command(flatten)]
    pub(crate) binding: ModelDeviceArgs,
}

/// How devices hold a model (`--max-binding`, `--kv-dtype`), for every command that opens
/// devices for one.
#[derive(Args, Clone, Debug, Default)]
pub struct ModelDeviceArgs {
    /// Run as if every adapter bound at most SIZE per storage buffer (e.g. 128M, WebGPU's
    /// default), below its own limit: the token embedding and LM head are split into blocks
    /// that fit, any other buffer larger than SIZE is refused, as on such an adapter. To
    /// rehearse a smaller adapter on a larger one.
    #[arg(long, value_name = "SIZE", value_parser = parse_binding)]
    pub(crate) max_binding: Option<u64>,
    /// KV-cache element type: f16 halves the cache (attention still accumulates in f32).
    /// `auto` stores f16 on every device with SHADER_F16 and f32 on the others; `f16` is
    /// refused when a selected adapter lacks it.
    #[arg(long, value_enum, default_value_t = KvArg::Auto)]
    pub(crate) kv_dtype: KvArg,
}

/// `--kv-dtype`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum KvArg {
    #[default]
    Auto,
    F16,
    F32,
}

impl ModelDeviceArgs {
    /// Device options with this cap and KV type (f32 forcing comes from the environment
    /// alone).
    pub(crate) fn gpu_options(&self) -> GpuOptions {
        GpuOptions {
            force_f32: false,
            max_storage_binding: self.max_binding,
            kv_cache: match self.kv_dtype {
                KvArg::Auto => KvCacheType::Auto,
                KvArg::F16 => KvCacheType::F16,
                KvArg::F32 => KvCacheType::F32,
            },
        }
    }

    /// The KV-cache type each of `selected` will store (`force_f32`: --force-f32), as opening
    /// them will resolve it; f32 where f16 would be refused (opening refuses it).
    pub(crate) fn kv_dtypes(&self, selected: &[AdapterDesc], force_f32: bool) -> Vec<DType> {
        let force = force_f32 || wgpar::switches::flag(wgpar::switches::FORCE_F32);
        let kind = self.gpu_options().kv_cache;
        (selected.iter())
            .map(|a| kind.resolve(a.shader_f16 && !force).unwrap_or(DType::F32))
            .collect()
    }

    /// Refuses `--kv-dtype f16` before any device opens when a selected adapter lacks
    /// SHADER_F16 (opening would refuse it too, later).
    pub(crate) fn check_kv(&self, selected: &[AdapterDesc]) -> Result<()> {
        let kind = self.gpu_options().kv_cache;
        for a in selected {
            kind.resolve_on(a, a.shader_f16, false)?;
        }
        Ok(())
    }

    /// `selected` as the checks before opening must see them: with the cap the devices will
    /// be opened with.
    pub(crate) fn apply(&self, mut selected: Vec<AdapterDesc>) -> Vec<AdapterDesc> {
        if let Some(cap) = self.max_binding {
            for adapter in &mut selected {
                adapter.max_storage_binding = adapter.max_storage_binding.min(cap);
            }
        }
        selected
    }

    /// The adapters of `selection`, described without opening any, with the cap applied.
    pub(crate) fn described(
        &self,
        selection: &DeviceSelection,
        adapters: &Adapters,
    ) -> Result<Vec<AdapterDesc>> {
        let selected = self.apply(described(selection, adapters)?);
        self.check_kv(&selected)?;
        Ok(selected)
    }
}

/// `--virtual N`: 1 to [`wgpar::device::MAX_DEVICES`], checked as the arguments are parsed.
pub(crate) fn parse_virtual(text: &str) -> std::result::Result<usize, String> {
    let max = wgpar::device::MAX_DEVICES;
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        Ok(n) => Err(format!("{n} devices: select 1 to {max}")),
        Err(e) => Err(format!("'{text}' is not a device count: {e}")),
    }
}

pub(crate) fn parse_binding(text: &str) -> std::result::Result<u64, String> {
    let bytes = wgpar::comm::units::parse_size(text).map_err(|e| e.to_string())?;
    if bytes < 256 {
        return Err(format!(
            "{bytes} B is below the smallest binding wgpar opens (256 B)"
        ));
    }
    Ok(bytes)
}

impl DeviceArgs {
    /// Devices the options select (before any opens).
    pub(crate) fn count(&self) -> usize {
        match (&self.virtual_count, &self.devices) {
            (Some(n), _) => *n,
            (None, Some(list)) => list.split(',').count(),
            (None, None) => 1,
        }
    }

    pub(crate) fn open(&self, adapters: &Adapters) -> Result<Vec<Arc<Gpu>>> {
        let selection =
            DeviceSelection::from_options(self.devices.as_deref(), self.virtual_count, adapters)?;
        open_devices(adapters, &selection, &self.gpu_options())
    }

    pub(crate) fn gpu_options(&self) -> GpuOptions {
        GpuOptions {
            force_f32: self.force_f32,
            ..self.binding.gpu_options()
        }
    }

    /// The KV-cache type each of `selected` will store once opened.
    pub(crate) fn kv_dtypes(&self, selected: &[AdapterDesc]) -> Vec<DType> {
        self.binding.kv_dtypes(selected, self.force_f32)
    }

    /// The adapter of each selected device, in order, without opening any: what the checks
    /// that must come before opening devices need.
    pub(crate) fn selected(&self, adapters: &Adapters) -> Result<Vec<AdapterDesc>> {
        let selection =
            DeviceSelection::from_options(self.devices.as_deref(), self.virtual_count, adapters)?;
        self.binding.described(&selection, adapters)
    }

    /// Opens only the first `count` selected devices.
    pub(crate) fn open_first(&self, adapters: &Adapters, count: usize) -> Result<Vec<Arc<Gpu>>> {
        let selection =
            DeviceSelection::from_options(self.devices.as_deref(), self.virtual_count, adapters)?;
        let selection = match selection {
            DeviceSelection::Indices(mut v) => {
                v.truncate(count);
                DeviceSelection::Indices(v)
            }
            DeviceSelection::Virtual { adapter, count: n } => DeviceSelection::Virtual {
                adapter,
                count: n.min(count),
            },
        };
        open_devices(adapters, &selection, &self.gpu_options())
    }
}

/// The adapter of each device of `selection`, in order, without opening any.
pub(crate) fn described(
    selection: &DeviceSelection,
    adapters: &Adapters,
) -> Result<Vec<AdapterDesc>> {
    let indices = match selection {
        DeviceSelection::Indices(v) => v.clone(),
        DeviceSelection::Virtual { adapter, count } => vec![*adapter; *count],
    };
    indices
        .into_iter()
        .map(|i| adapters.get(i).map(|(_, d)| d.clone()))
        .collect()
}

/// Model options shared by commands that run a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model: a preset (default, tiny-llama, tiny-qwen3, tiny-gpt2, tiny-bert, gpt2-small,
    /// llama-1b, llama-8b; synthetic weights), a Hugging Face model folder (config.json,
    /// *.safetensors, tokenizer.json), a GGUF file, `org/name[:TAG][@REVISION]` from the
    /// Hugging Face cache, or `ollama:name[:tag]` from Ollama's store (nothing is downloaded).
    #[arg(long, default_value = "default", value_name = "PRESET|DIR|FILE.gguf|ORG/NAME",
          value_parser = ModelRef::resolve)]
    pub(crate) model: ModelRef,
    /// Weight storage: auto keeps a checkpoint stored in f16 or bf16 in f16 where every
    /// selected device has SHADER_F16 (else f32, with a note), and everything else in f32;
    /// f32 or f16 (needs SHADER_F16 on every device) force one.
    #[arg(long, default_value = "auto", value_parser = ["auto", "f32", "f16"])]
    pub(crate) dtype: String,
    /// Store the layers' projection matrices packed on the device as q8_0, q4_0, q4_k or q6_k
    /// blocks, dequantized in the kernels (embeddings and the LM head stay in --dtype). A GGUF
    /// file's blocks are kept as stored by default; a TYPE re-packs the matrices stored in
    /// another type, `dense` converts every matrix to --dtype.
    #[arg(long, value_name = "TYPE", value_parser = ["q8_0", "q4_0", "q4_k", "q6_k", "dense"])]
    pub(crate) weights: Option<String>,
    /// Seed of the synthetic weights (presets), or of sampling (--prompt with --temperature).
    #[arg(long, default_value_t = 42)]
    pub(crate) seed: u64,
    /// Longest context (prompt + generated tokens) the KV cache and position tables hold:
    /// sets a preset's, or limits a checkpoint's (default: the preset's, or 2048).
    #[arg(long, value_name = "TOKENS")]
    pub(crate) max_seq: Option<usize>,
}

impl ModelArgs {
    /// The model these options name, as the library loads it.
    pub(crate) fn choice(&self) -> ModelChoice<'_> {
        ModelChoice {
            model: &self.model,
            dtype: &self.dtype,
            weights: self.weights.as_deref(),
            seed: self.seed,
            max_seq: self.max_seq,
        }
    }
}

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
    /// The automatic placement these options and `memory` ask for (`--layers auto`,
    /// `--split auto` within `--gpu-memory`).
    pub(crate) fn auto_placement(&self, memory: &MemoryArgs) -> AutoPlacement {
        AutoPlacement::new(
            self.layers == Some(Counts::Auto),
            self.split == Some(Counts::Auto),
            memory.gpu_memory.clone(),
        )
    }

    pub(crate) fn partition_spec(&self) -> PartitionSpec {
        match (&self.layers, self.partition.as_deref()) {
            (Some(Counts::Given(l)), _) => PartitionSpec::Explicit(l.clone()),
            (None, Some("balanced")) => PartitionSpec::Balanced,
            // `auto` is placed by `parallel::auto::AutoPlacement` once the accounting is at hand.
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
    pub(crate) fn auto(&self) -> bool {
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
    /// [`AutoPlacement`]).
    pub(crate) fn named(&self, micro_batches: usize) -> Result<Strategy> {
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
    pub(crate) devices: DeviceArgs,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) strategy: StrategyArgs,
    /// Sequences per batch.
    #[arg(long, default_value_t = 4)]
    pub(crate) batch: usize,
    /// Prompt length (random token ids).
    #[arg(long, default_value_t = 64)]
    pub(crate) prompt_len: usize,
    /// Tokens to generate per sequence.
    #[arg(long, default_value_t = 16)]
    pub(crate) gen: usize,
    /// Write the run's timeline as Chrome Trace Event JSON (opens in Perfetto).
    #[arg(long, value_name = "FILE")]
    pub(crate) trace: Option<String>,
    /// Pace transfers and collectives to a host profile's links (shipped name or TOML path),
    /// e.g. pcie3-2gpu, so the run behaves like that machine's interconnect; or to one link
    /// given as ALPHA_US:BETA_GBPS, e.g. 50:0.125 for a 1 Gb/s network.
    #[arg(long, value_name = "PROFILE|ALPHA_US:BETA_GBPS")]
    pub(crate) pace: Option<String>,
    /// With --trace, also time compute spans on the device with timestamp queries: auto (where
    /// the adapter has TIMESTAMP_QUERY and is not a CPU driver, on which timestamp writes
    /// slow each submission down), on, off.
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub(crate) device_timestamps: String,
    /// Make a worker fail, to see the failure path end the run cleanly:
    /// `stage=S` (pp, hybrid) or `rank=R` (tp), `kind=error|panic|device-lost`, `at=step:N`
    /// (after N jobs of that worker in the timed run: steps for a rank, micro-batches for a
    /// stage), e.g. `stage=1,kind=panic,at=step:3`.
    #[arg(long, value_name = "SPEC")]
    pub(crate) inject_fault: Option<String>,
    /// Write every step's logits and the generated tokens as JSON (rank 0 under MPI): for
    /// comparing strategies and layouts bit for bit.
    #[arg(long, value_name = "FILE")]
    pub(crate) logits_out: Option<String>,
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
    #[command(flatten)]
    pub(crate) text: TextArgs,
}

impl RunArgs {
    /// The timed run these options ask for (every step's logits kept for `--logits-out`).
    pub(crate) fn timed(&self) -> TimedRun {
        TimedRun {
            batch: self.batch,
            prompt_len: self.prompt_len,
            gen: self.gen,
            keep: match self.logits_out {
                Some(_) => KeepLogits::All,
                None => KeepLogits::None,
            },
        }
    }
}

/// Options of text generation (used with `--prompt`).
#[derive(Args, Clone, Debug)]
pub struct TextArgs {
    /// Text to continue; needs --model DIR (a Hugging Face folder with tokenizer.json).
    /// --gen sets the most tokens generated; an end-of-sequence token stops earlier.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Sampling temperature; 0 picks the most likely token (greedy). --seed seeds the draws.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample among the most likely tokens whose probabilities first reach p (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// A Hugging Face tokenizer.json to use instead of the model's own (a GGUF file's
    /// metadata or a folder's tokenizer.json); needs --prompt.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

impl TextArgs {
    /// Whether any sampling option differs from greedy decoding's defaults.
    pub fn samples(&self) -> bool {
        let greedy = Self::default();
        self.temperature != greedy.temperature
            || self.top_k != greedy.top_k
            || self.top_p != greedy.top_p
    }

    /// Refuses `--tokenizer` where no text is tokenized (a run on synthetic prompts).
    pub fn refuse_tokenizer(&self) -> Result<()> {
        match &self.tokenizer {
            Some(_) => Err(WgparError::unsupported(
                "--tokenizer turns --prompt's text into tokens: it needs --prompt (a run on \
                 synthetic prompts has no text)"
                    .into(),
            )),
            None => Ok(()),
        }
    }
}

impl Default for TextArgs {
    fn default() -> Self {
        Self {
            prompt: None,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            tokenizer: None,
        }
    }
}

/// `--gpu-memory`, for the commands that run a model on devices.
#[derive(Args, Clone, Debug, Default)]
pub struct MemoryArgs {
    /// Most memory each device may hold for the model (weights, KV cache, activations,
    /// logits, staging), e.g. 6G,10G: one size per selected device, or one for all (K, M, G,
    /// Ki, Mi, Gi: powers of 1024; or plain bytes). A run that would exceed a cap is refused
    /// before any device is opened, with each device's bytes by kind.
    #[arg(long, value_name = "SIZE[,SIZE...]")]
    pub gpu_memory: Option<String>,
}

/// Counts per device or stage (`--split`, `--layers`), or `auto`: placed by memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Counts {
    /// Chosen by the memory accounting within the `--gpu-memory` caps.
    Auto,
    /// Given, one per device or stage.
    Given(Vec<usize>),
}

/// Parses `auto` or comma-separated whole numbers (at most one per device wgpar can select).
pub fn parse_counts(text: &str) -> std::result::Result<Counts, String> {
    if text.trim() == "auto" {
        return Ok(Counts::Auto);
    }
    if text.len() > MAX_LIST_TEXT {
        return Err(format!(
            "{} characters: give at most one count per device",
            text.len()
        ));
    }
    (text.split(','))
        .map(|part| {
            (part.trim().parse::<usize>())
                .map_err(|_| format!("'{}' is not a whole number (or give auto)", part.trim()))
        })
        .collect::<std::result::Result<Vec<usize>, String>>()
        .map(Counts::Given)
}

/// The strategy a serving run uses on `devices` devices with `max_batch` KV slots: a pipeline
/// keeps one step per lane in flight, one lane per stage by default (never more lanes than
/// slots), and more lanes than slots are refused.
pub(crate) fn serving_strategy(
    args: &StrategyArgs,
    devices: usize,
    max_batch: usize,
) -> Result<Strategy> {
    let stages = match args.strategy.as_str() {
        "pp" => devices,
        "hybrid" => devices / args.tp.unwrap_or(2).max(1),
        _ => 1,
    };
    // `auto` is placed by `parallel::auto::AutoPlacement`, around the devices' opening.
    let strategy = args.named(stages.clamp(1, max_batch))?;
    check_lanes_have_slots(&strategy, max_batch)?;
    Ok(strategy)
}

/// Refuses a pipeline with more micro-batch lanes than KV slots: the extra lanes would never
/// run a sequence.
pub(crate) fn check_lanes_have_slots(strategy: &Strategy, max_batch: usize) -> Result<()> {
    let lanes = match strategy {
        Strategy::Pipeline { micro_batches, .. } | Strategy::Hybrid { micro_batches, .. } => {
            *micro_batches
        }
        _ => return Ok(()),
    };
    if lanes > max_batch {
        return Err(WgparError::unsupported(format!(
            "--micro-batches {lanes} keeps {lanes} lanes in flight, but --max-batch {max_batch} \
             gives KV slots to only {max_batch} of them: raise --max-batch to at least {lanes} \
             or lower --micro-batches to {max_batch}"
        )));
    }
    Ok(())
}

/// The model's text side ([`ModelChoice::text_side`]).
pub(crate) fn text_side(
    model: &ModelArgs,
    config: &ModelConfig,
    tokenizer: Option<&Path>,
    chat_template: Option<&Path>,
) -> Result<TextSide> {
    model.choice().text_side(config, tokenizer, chat_template)
}
