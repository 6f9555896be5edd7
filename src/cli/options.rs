//! The option structs every command shares (devices, model, strategy, memory, text, a run's
//! options, MPI's), each turned into the library's plain choice it stands for. Commands import
//! these, never each other.

use std::path::PathBuf;

use clap::Args;
use wgpar::device::{parse_binding, parse_virtual, BindingChoice, DeviceChoice, KvCacheType};
use wgpar::dist::{launch, DistError, RankFault};
use wgpar::load::ModelChoice;
use wgpar::model::hub::ModelRef;
use wgpar::parallel::choice::{parse_counts, Counts, StrategyChoice};
use wgpar::parallel::run_plan::RunChoice;
use wgpar::parallel::timed::TimedRun;
use wgpar::parallel::KeepLogits;
use wgpar::{Result, WgparError};

pub(crate) use wgpar::files::{check_writable_dir, check_writable_file, create_trace_file};

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
    /// The binding cap and KV type these options ask for.
    pub(crate) fn choice(&self) -> BindingChoice {
        BindingChoice {
            max_binding: self.max_binding,
            kv_cache: match self.kv_dtype {
                KvArg::Auto => KvCacheType::Auto,
                KvArg::F16 => KvCacheType::F16,
                KvArg::F32 => KvCacheType::F32,
            },
        }
    }
}

impl DeviceArgs {
    /// The devices these options select.
    pub(crate) fn choice(&self) -> DeviceChoice {
        DeviceChoice {
            devices: self.devices.clone(),
            virtual_count: self.virtual_count,
            force_f32: self.force_f32,
            binding: self.binding.choice(),
        }
    }
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
    /// Seed of the synthetic weights (presets), or of sampling (--prompt with --temperature);
    /// default 42.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Longest context (prompt + generated tokens) the KV cache and position tables hold:
    /// sets a preset's, or limits a checkpoint's (default: the preset's, or 2048).
    #[arg(long, value_name = "TOKENS")]
    pub(crate) max_seq: Option<usize>,
}

/// The seed without `--seed`.
const DEFAULT_SEED: u64 = 42;

impl ModelArgs {
    /// The model these options name, as the library loads it.
    pub(crate) fn choice(&self) -> ModelChoice<'_> {
        ModelChoice {
            model: &self.model,
            dtype: &self.dtype,
            weights: self.weights.as_deref(),
            seed: self.seed.unwrap_or(DEFAULT_SEED),
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
    /// The strategy these options name.
    pub(crate) fn choice(&self) -> StrategyChoice {
        StrategyChoice {
            strategy: self.strategy.clone(),
            tp: self.tp,
            split: self.split.clone(),
            layers: self.layers.clone(),
            partition: self.partition.clone(),
            micro_batches: self.micro_batches,
            schedule: self.schedule.clone(),
        }
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
    /// The run's choices, as the library plans it.
    pub(crate) fn choice(&self) -> RunChoice<'_> {
        RunChoice {
            devices: self.devices.choice(),
            model: self.model.choice(),
            strategy: self.strategy.choice(),
            gpu_memory: self.memory.gpu_memory.as_deref(),
            inject_fault: self.inject_fault.as_deref(),
            pace: self.pace.as_deref(),
            trace: self.trace.as_deref(),
            logits_out: self.logits_out.as_deref(),
            device_timestamps: &self.device_timestamps,
        }
    }

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

/// Options of every command about MPI ranks.
#[derive(Args, Clone, Debug)]
pub struct MpiArgs {
    /// Run as MPI ranks even if no launcher is detected (it is detected from the variables
    /// mpirun sets: OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK). Needs a build with `--features
    /// mpi`.
    #[arg(long, global = true)]
    mpi: bool,
    /// Under MPI: seconds any wait on another rank may take before the run fails with an
    /// error naming that rank.
    #[arg(long, global = true, default_value_t = 120.0, value_name = "SECS")]
    mpi_timeout: f64,
    /// Under MPI, for tests and demonstrations of the failure path: make RANK fail with KIND
    /// (error, panic, kill, hang) after AFTER micro-batches (error, panic in a pipeline; steps
    /// of tensor parallelism) or milliseconds (kill: SIGKILL; hang: SIGSTOP).
    #[arg(long, global = true, value_name = "RANK:KIND[:AFTER]")]
    mpi_fault: Option<String>,
}

impl MpiArgs {
    /// True when this process is one of several MPI ranks (or `--mpi` asks for it). A binary
    /// without the feature refuses a parallel launch here, before anything else runs.
    pub fn active(&self) -> Result<bool> {
        let detected = launch::detect();
        if cfg!(feature = "mpi") {
            return Ok(self.mpi || detected.is_some_and(|l| l.is_parallel()));
        }
        if self.mpi {
            return Err(DistError::FeatureMissing.into());
        }
        match detected {
            Some(l) if l.is_parallel() => Err(DistError::NotBuilt {
                launcher: l.launcher,
                rank: l.rank,
                size: l.size,
            }
            .into()),
            _ => Ok(false),
        }
    }

    /// `--mpi-fault`, parsed.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn fault(&self) -> Result<Option<RankFault>> {
        self.mpi_fault.as_deref().map(RankFault::parse).transpose()
    }

    /// `--mpi-timeout`, checked.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn timeout(&self) -> Result<std::time::Duration> {
        if !(self.mpi_timeout.is_finite() && self.mpi_timeout > 0.0) {
            return Err(wgpar::WgparError::option(
                "--mpi-timeout",
                format!(
                    "--mpi-timeout {}: must be a positive number of seconds",
                    self.mpi_timeout
                ),
            ));
        }
        Ok(std::time::Duration::from_secs_f64(self.mpi_timeout))
    }
}
