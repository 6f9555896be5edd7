//! Command-line interface: parses arguments and hands them to the engines and benchmarks.
//! Nothing here touches wgpu directly.

/// Writes to stdout, formatted like `print!`, as a `Result`: a closed pipe (`wgpar devices |
/// true`) or a full disk is an error the command returns, where `print!` would panic.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!($($arg)*))
    };
}

/// [`out!`] with a newline, like `println!`.
macro_rules! outln {
    () => {
        $crate::cli::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod allreduce;
mod bench;
mod bench_decode;
mod bench_projection;
mod bench_serve;
mod calibrate;
mod chat;
mod compare;
mod devices;
mod embed;
mod memory;
mod mpi;
mod placement;
mod plan;
mod project;
mod run;
mod server;
mod text;

use clap::{Args, Parser, Subcommand};
use wgpar::device::{
    open_devices, AdapterDesc, Adapters, DType, DeviceSelection, Gpu, GpuOptions, KvCacheType,
};
use wgpar::model::hf::Checkpoint;
use wgpar::model::hub::ModelRef;
use wgpar::model::memory::{FileBlocks, Vectors, WeightFormat, Workload};
use wgpar::model::quant::QuantType;
use wgpar::model::{budget, ModelConfig, ModelWeights};
use wgpar::parallel::Strategy;
use wgpar::{Result, WgparError};

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// wgpar: run transformer inference across several GPUs of any vendor and backend, and see
/// where the time goes (tensor vs pipeline parallelism, PCIe vs NVLink).
#[derive(Parser)]
#[command(name = "wgpar", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    mpi: mpi::MpiArgs,
}

#[derive(Subcommand)]
enum Command {
    /// List every adapter on every backend, with the limits and features that matter.
    Devices {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Prefill a batch of prompts and greedily decode, reporting tokens/s; with --prompt and a
    /// model folder, generate text.
    Run(run::RunArgs),
    /// OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics) over any
    /// strategy, with continuous batching; the benchmark is `bench serve`.
    Serve(server::ServerArgs),
    /// Interactive chat in the terminal through the model's chat template, on any strategy:
    /// replies stream as they are generated, /reset and /exit, Ctrl-C stops a reply.
    Chat(chat::ChatArgs),
    /// Single vs tensor vs pipeline vs hybrid parallelism: measured here, projected onto host
    /// profiles, with verdicts, a Markdown report and SVG charts.
    Compare(compare::CompareArgs),
    /// Sentence embeddings of texts with an encoder checkpoint (BERT, e.g. all-MiniLM-L6-v2),
    /// and their pairwise cosine similarities.
    Embed(embed::EmbedArgs),
    /// Modeled projections of a model on host profiles, for models and machines not at hand
    /// (TP all-reduce share vs batch and sequence, PP vs TP throughput, bubble cost).
    Plan(plan::PlanArgs),
    /// Collectives between devices through host memory, nccl-tests style (-b 8 -e 64M -f 2).
    Allreduce(allreduce::AllreduceArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCommand,
    },
    /// Measure this machine (links, host reduce, kernel rates) and write a host profile.
    Calibrate(calibrate::CalibrateArgs),
    /// Replay a recorded run (`run --trace`) on a host profile.
    Project(project::ProjectArgs),
}

/// Writes `text` to stdout and flushes it, so that a failed write is seen here, by the command
/// that printed, and not lost in the flush at exit.
pub(crate) fn write_stdout(text: std::fmt::Arguments) -> Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(text)
        .and_then(|()| stdout.flush())
        .map_err(|source| WgparError::Stdout { source })
}

/// Checks, before the work whose results go there, that files can be written in folder `dir`
/// (created if missing): a probe file is made and removed.
fn check_writable_dir(dir: &Path, shown: &Path) -> Result<()> {
    let io = |source| WgparError::Io {
        path: shown.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let probe = dir.join(format!(".wgpar-write-check-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(io)?;
    std::fs::remove_file(&probe).map_err(io)
}

/// Creates (or truncates) the trace file `path` names, if any, so that a path that cannot be
/// written fails before the work rather than after it.
fn create_trace_file(path: Option<&String>) -> Result<()> {
    if let Some(path) = path {
        std::fs::File::create(path).map_err(|source| WgparError::Io {
            path: path.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Checks, before the work, that file `path` can be written: its folder takes a file, and an
/// existing `path` opens for writing. Nothing is truncated or left behind.
fn check_writable_file(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    check_writable_dir(dir, path)?;
    if path.exists() {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|source| WgparError::Io {
                path: path.display().to_string(),
                source,
            })?;
    }
    Ok(())
}

/// Device selection options shared by every command that runs on GPUs.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Adapter indices from `wgpar devices`, comma-separated (an index may repeat).
    #[arg(long)]
    devices: Option<String>,
    /// Open N independent devices on one adapter (the first of --devices, or the preferred one).
    #[arg(long = "virtual", value_name = "N", value_parser = parse_virtual)]
    virtual_count: Option<usize>,
    /// Keep weights in f32 even where the adapter has SHADER_F16.
    #[arg(long)]
    force_f32: bool,
    #[command(flatten)]
    binding: ModelDeviceArgs,
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
    max_binding: Option<u64>,
    /// KV-cache element type: f16 halves the cache (attention still accumulates in f32).
    /// `auto` stores f16 on every device with SHADER_F16 and f32 on the others; `f16` is
    /// refused when a selected adapter lacks it.
    #[arg(long, value_enum, default_value_t = KvArg::Auto)]
    kv_dtype: KvArg,
}

/// `--kv-dtype`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
enum KvArg {
    #[default]
    Auto,
    F16,
    F32,
}

impl ModelDeviceArgs {
    /// Device options with this cap and KV type (f32 forcing comes from the environment
    /// alone).
    fn gpu_options(&self) -> GpuOptions {
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
    fn kv_dtypes(&self, selected: &[AdapterDesc], force_f32: bool) -> Vec<DType> {
        let force = force_f32 || wgpar::switches::flag(wgpar::switches::FORCE_F32);
        let kind = self.gpu_options().kv_cache;
        (selected.iter())
            .map(|a| kind.resolve(a.shader_f16 && !force).unwrap_or(DType::F32))
            .collect()
    }

    /// Refuses `--kv-dtype f16` before any device opens when a selected adapter lacks
    /// SHADER_F16 (opening would refuse it too, later).
    fn check_kv(&self, selected: &[AdapterDesc]) -> Result<()> {
        let kind = self.gpu_options().kv_cache;
        for a in selected {
            kind.resolve_on(a, a.shader_f16, false)?;
        }
        Ok(())
    }

    /// `selected` as the checks before opening must see them: with the cap the devices will
    /// be opened with.
    fn apply(&self, mut selected: Vec<AdapterDesc>) -> Vec<AdapterDesc> {
        if let Some(cap) = self.max_binding {
            for adapter in &mut selected {
                adapter.max_storage_binding = adapter.max_storage_binding.min(cap);
            }
        }
        selected
    }

    /// The adapters of `selection`, described without opening any, with the cap applied.
    fn described(
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
fn parse_virtual(text: &str) -> std::result::Result<usize, String> {
    let max = wgpar::device::MAX_DEVICES;
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        Ok(n) => Err(format!("{n} devices: select 1 to {max}")),
        Err(e) => Err(format!("'{text}' is not a device count: {e}")),
    }
}

fn parse_binding(text: &str) -> std::result::Result<u64, String> {
    let bytes = wgpar::comm::units::parse_size(text).map_err(|e| e.to_string())?;
    if bytes < 256 {
        return Err(format!(
            "{bytes} B is below the smallest binding wgpar opens (256 B)"
        ));
    }
    Ok(bytes)
}

impl DeviceArgs {
    fn open(&self, adapters: &Adapters) -> Result<Vec<Arc<Gpu>>> {
        let selection =
            DeviceSelection::from_options(self.devices.as_deref(), self.virtual_count, adapters)?;
        open_devices(adapters, &selection, &self.gpu_options())
    }

    fn gpu_options(&self) -> GpuOptions {
        GpuOptions {
            force_f32: self.force_f32,
            ..self.binding.gpu_options()
        }
    }

    /// The KV-cache type each of `selected` will store once opened.
    fn kv_dtypes(&self, selected: &[AdapterDesc]) -> Vec<DType> {
        self.binding.kv_dtypes(selected, self.force_f32)
    }

    /// The adapter of each selected device, in order, without opening any: what the checks
    /// that must come before opening devices need.
    fn selected(&self, adapters: &Adapters) -> Result<Vec<AdapterDesc>> {
        let selection =
            DeviceSelection::from_options(self.devices.as_deref(), self.virtual_count, adapters)?;
        self.binding.described(&selection, adapters)
    }

    /// Opens only the first `count` selected devices.
    fn open_first(&self, adapters: &Adapters, count: usize) -> Result<Vec<Arc<Gpu>>> {
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
fn described(selection: &DeviceSelection, adapters: &Adapters) -> Result<Vec<AdapterDesc>> {
    let indices = match selection {
        DeviceSelection::Indices(v) => v.clone(),
        DeviceSelection::Virtual { adapter, count } => vec![*adapter; *count],
    };
    indices
        .into_iter()
        .map(|i| adapters.get(i).map(|(_, d)| d.clone()))
        .collect()
}

/// One configuration a command will run, as [`check_runs_fit`] checks it.
struct PlannedRun<'a> {
    strategy: &'a Strategy,
    /// The adapters of the devices it uses, in order.
    adapters: &'a [AdapterDesc],
    /// New tokens of its largest step (a whole prefill, or one micro-batch's).
    step_tokens: usize,
    /// Sequences whose KV cache a device holds.
    batch: usize,
    /// The whole batch and prompt, for the memory accounting (`--gpu-memory`).
    work: Workload,
}

/// What a command that builds a model checks before it opens a device or builds a weight:
/// every configuration it will run fits the selected adapters' buffer and storage-binding
/// limits, and the model's weights fit the host's memory. So an oversized model is refused
/// in milliseconds, not after minutes of building weights.
/// Refuses a prompt and generation longer than the model's context.
fn check_context(prompt_len: usize, gen: usize, config: &ModelConfig) -> Result<()> {
    if prompt_len.saturating_add(gen) > config.max_seq {
        return Err(WgparError::limit(
            "context (tokens)",
            (prompt_len.saturating_add(gen) as u64, config.max_seq as u64),
            format!(
            "--prompt-len {prompt_len} + --gen {gen} exceed max_seq {} of model '{}' (raise it \
             with --max-seq)",
            config.max_seq, config.name
        ),
        ));
    }
    Ok(())
}

fn check_runs_fit(config: &ModelConfig, dtype: DType, runs: &[PlannedRun]) -> Result<()> {
    for run in runs {
        run.strategy
            .check_fits(config, dtype, run.adapters, run.step_tokens, run.batch)?;
    }
    budget::check_host_weights(config, budget::host_available_bytes())
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
    model: ModelRef,
    /// Weight storage: auto keeps a checkpoint stored in f16 or bf16 in f16 where every
    /// selected device has SHADER_F16 (else f32, with a note), and everything else in f32;
    /// f32 or f16 (needs SHADER_F16 on every device) force one.
    #[arg(long, default_value = "auto", value_parser = ["auto", "f32", "f16"])]
    dtype: String,
    /// Store the layers' projection matrices packed on the device as q8_0, q4_0, q4_k or q6_k
    /// blocks, dequantized in the kernels (embeddings and the LM head stay in --dtype). A GGUF
    /// file's blocks are kept as stored by default; a TYPE re-packs the matrices stored in
    /// another type, `dense` converts every matrix to --dtype.
    #[arg(long, value_name = "TYPE", value_parser = ["q8_0", "q4_0", "q4_k", "q6_k", "dense"])]
    weights: Option<String>,
    /// Seed of the synthetic weights (presets), or of sampling (--prompt with --temperature).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Longest context (prompt + generated tokens) the KV cache and position tables hold:
    /// sets a preset's, or limits a checkpoint's (default: the preset's, or 2048).
    #[arg(long, value_name = "TOKENS")]
    max_seq: Option<usize>,
}

/// Context a checkpoint gets where the command does not know its lengths (the KV cache and
/// position tables are sized for it).
const DEFAULT_CONTEXT: usize = 2048;

/// Largest `--max-seq`: far beyond what a CPU driver decodes, small enough that a KV cache
/// size computed from it cannot overflow.
const MAX_CONTEXT: usize = 1 << 20;

impl ModelArgs {
    /// The model folder or GGUF file, when `--model` names one rather than a preset.
    fn checkpoint_dir(&self) -> Option<&Path> {
        self.model.path()
    }

    /// The checkpoint, its context limited to `context` (or its own, if shorter).
    fn checkpoint(&self, dir: &Path, context: usize) -> Result<Checkpoint> {
        let mut ckpt = Checkpoint::open(dir)?;
        let limit = ckpt.max_context().min(context);
        ckpt.limit_context(limit)?;
        Ok(ckpt)
    }

    /// The decoder to run: a preset, or a checkpoint's config (context up to 2048 tokens, or
    /// `--max-seq`).
    fn config(&self) -> Result<ModelConfig> {
        let config = self.any_config()?;
        if config.is_encoder() {
            return Err(WgparError::unsupported(format!(
                "model '{}' is an encoder (BERT): use `wgpar embed`",
                config.name
            )));
        }
        self.packed(&config)?;
        Ok(config)
    }

    /// [`Self::config`], an encoder's included (`serve` answers embeddings with one).
    fn any_config(&self) -> Result<ModelConfig> {
        if self.max_seq == Some(0) || self.max_seq > Some(MAX_CONTEXT) {
            return Err(WgparError::option(
                "--max-seq",
                format!("--max-seq must be within 1..={MAX_CONTEXT}"),
            ));
        }
        let config = match self.checkpoint_dir() {
            Some(dir) => {
                let ckpt = Checkpoint::open(dir)?;
                let limit = match self.max_seq {
                    Some(n) if n > ckpt.max_context() => {
                        return Err(WgparError::option(
                            "--max-seq",
                            format!(
                                "--max-seq {n} exceeds the context of {} tokens of model '{}'",
                                ckpt.max_context(),
                                ckpt.config().name
                            ),
                        ))
                    }
                    Some(n) => n,
                    None => ckpt.max_context().min(DEFAULT_CONTEXT),
                };
                let mut ckpt = ckpt;
                ckpt.limit_context(limit)?;
                ckpt.config().clone()
            }
            None => {
                let mut config = ModelConfig::preset(self.model.name())?;
                if let Some(n) = self.max_seq {
                    config.max_seq = n;
                }
                config
            }
        };
        Ok(config)
    }

    /// Weights for `config` (from [`Self::config`]): synthetic for a preset, loaded (with a
    /// progress bar) for a checkpoint.
    fn weights(&self, config: &ModelConfig) -> Result<ModelWeights> {
        self.weights_of_layers(config, 0..config.layers)
    }

    /// [`Self::weights`] of layers `keep` alone (an MPI rank's stages), the others absent:
    /// a checkpoint's other layers are not read, synthetic ones are drawn and dropped.
    fn weights_of_layers(&self, config: &ModelConfig, keep: Range<usize>) -> Result<ModelWeights> {
        let mut w = match self.checkpoint_dir() {
            Some(dir) => {
                let ckpt = self.checkpoint(dir, config.max_seq)?;
                ckpt.weights_of_layers(true, keep)?
            }
            None => {
                let mut w = ModelWeights::synthetic(config, self.seed);
                w.keep_layers(&keep);
                w
            }
        };
        self.apply_weights(&mut w)?;
        Ok(w)
    }

    /// Applies `--weights` to loaded weights: the block type to pack into, or `dense` (the
    /// file's blocks dropped). A note on stderr names the file's blocks that get re-packed.
    fn apply_weights(&self, w: &mut ModelWeights) -> Result<()> {
        w.packed = self.packed(&w.config)?;
        if self.weights.as_deref() == Some("dense") {
            w.drop_blocks();
        }
        if let Some(t) = w.packed {
            let mut other: Vec<&str> = w
                .blocks()
                .filter(|(_, _, m)| m.dtype != t)
                .map(|(_, _, m)| m.dtype.name())
                .collect();
            let count = other.len();
            other.sort_unstable();
            other.dedup();
            if count > 0 {
                eprintln!(
                    "note: --weights {} re-packs {count} layer matrices the file stores as {} \
                     (a second rounding); leave --weights out to keep the file's own blocks",
                    t.name(),
                    other.join(", ")
                );
            }
        }
        Ok(())
    }

    /// How the weights will be stored, known before they are built: `dtype` for dense ones,
    /// `--weights`, and a GGUF file's own blocks and biases read from its tensor index.
    fn weight_format(&self, config: &ModelConfig, dtype: DType) -> Result<WeightFormat> {
        let mut format = WeightFormat::of_config(config, dtype, self.packed(config)?);
        let Some(dir) = self.checkpoint_dir() else {
            return Ok(format);
        };
        if let Some(gguf) = Checkpoint::open(dir)?.gguf() {
            format.vectors = Vectors::of_gguf(gguf.file());
            if self.weights.as_deref() != Some("dense") {
                format.blocks = FileBlocks::of_gguf(gguf.file(), config);
            }
        }
        Ok(format)
    }

    /// The block type `--weights` asks for, checked against the model's shapes (`None` for
    /// none and for `dense`).
    fn packed(&self, config: &ModelConfig) -> Result<Option<QuantType>> {
        let Some(name) = self.weights.as_ref().filter(|n| *n != "dense") else {
            return Ok(None);
        };
        let t = QuantType::parse(name).ok_or_else(|| {
            let packs: Vec<&str> = (wgpar::model::quant::WEIGHTS_TYPES.iter())
                .filter(|t| t.is_quantized())
                .map(|t| t.name())
                .collect();
            WgparError::option(
                "--weights",
                format!(
                    "--weights {name}: wgpar packs into {} or dense (a GGUF's other block types \
                     are kept as stored without --weights)",
                    packs.join(", ")
                ),
            )
        })?;
        wgpar::model::quant::check_packable(config, t)?;
        Ok(Some(t))
    }

    /// The weight dtype `--dtype` asks for, checked against the selected adapters before any
    /// device is opened (`force_f32`: --force-f32 or WGPAR_FORCE_F32=1).
    fn dtype_for(&self, adapters: &[AdapterDesc], force_f32: bool) -> Result<DType> {
        let force_f32 = force_f32 || wgpar::switches::flag(wgpar::switches::FORCE_F32);
        if self.dtype == "auto" {
            let lacking = adapters.iter().find(|a| !a.shader_f16);
            let why = match lacking {
                _ if force_f32 => {
                    Some("--force-f32 (or WGPAR_FORCE_F32=1) keeps every device in f32".into())
                }
                Some(a) => Some(format!(
                    "adapter {} ({}) lacks SHADER_F16",
                    a.index,
                    a.label()
                )),
                None => None,
            };
            return self.auto_dtype(why);
        }
        if self.dtype != "f16" {
            return Ok(DType::F32);
        }
        if force_f32 {
            return Err(WgparError::unsupported(
                "--dtype f16 asks for f16 weights, but --force-f32 (or WGPAR_FORCE_F32=1) keeps \
                 every device in f32: drop one of the two"
                    .into(),
            ));
        }
        match adapters.iter().find(|a| !a.shader_f16) {
            Some(a) => Err(WgparError::unsupported(format!(
                "--dtype f16 needs SHADER_F16, which adapter {} ({}) lacks: use --dtype f32, or \
                 pick adapters that have it (`wgpar devices` lists the features)",
                a.index,
                a.label()
            ))),
            None => Ok(DType::F16),
        }
    }

    /// `--dtype auto`: f16 for a checkpoint stored in 16 bits unless `why_f32` says why not
    /// (then f32, with a note), f32 for everything else (presets, f32 checkpoints).
    fn auto_dtype(&self, why_f32: Option<String>) -> Result<DType> {
        let half = match self.checkpoint_dir() {
            Some(dir) => Checkpoint::open(dir)?.stores_half(),
            None => false,
        };
        if !half {
            return Ok(DType::F32);
        }
        match why_f32 {
            Some(why) => {
                eprintln!(
                    "wgpar: note: the checkpoint stores f16/bf16 weights; they are held in f32 \
                     because {why}"
                );
                Ok(DType::F32)
            }
            None => {
                eprintln!(
                    "wgpar: note: weights held in f16, as the checkpoint stores them (--dtype \
                     f32 widens them)"
                );
                Ok(DType::F16)
            }
        }
    }

    fn dtype(&self, gpus: &[Arc<Gpu>]) -> Result<DType> {
        if self.dtype == "auto" {
            let lacking = gpus.iter().find(|g| !g.supports_f16_weights());
            let why = lacking.map(|g| {
                format!(
                    "{} keeps weights in f32 (no SHADER_F16, or --force-f32)",
                    g.describe()
                )
            });
            return self.auto_dtype(why);
        }
        match self.dtype.as_str() {
            "f16" => match gpus.iter().find(|g| !g.supports_f16_weights()) {
                Some(g) if g.info().shader_f16 => Err(WgparError::unsupported(format!(
                    "--dtype f16 asks for f16 weights, but --force-f32 (or WGPAR_FORCE_F32=1) \
                     keeps {} in f32: drop one of the two",
                    g.describe()
                ))),
                Some(g) => Err(WgparError::unsupported(format!(
                    "--dtype f16 needs SHADER_F16, which {} lacks: use --dtype f32, or pick \
                     adapters that have it (`wgpar devices` lists the features)",
                    g.describe()
                ))),
                None => Ok(DType::F16),
            },
            _ => Ok(DType::F32),
        }
    }
}

/// Where no Wayland display can be reached (`XDG_RUNTIME_DIR` unset or not a folder, and
/// `WAYLAND_DISPLAY` unset or relative to it: a headless shell, CI), adapter discovery would
/// still probe for one and libwayland print "error: XDG_RUNTIME_DIR is invalid or not set"
/// although nothing failed. Two probes do it: the EGL one of the GL backend (which reads
/// `WAYLAND_DISPLAY`: forgotten here) and Mesa's Vulkan device-select layer, which up to Mesa
/// 22.3 connects to the default display `wayland-0` even with no `WAYLAND_DISPLAY` (disabled
/// here with its own switch `NODEVICE_SELECT=1`, unless the user set it or chose a device with
/// `MESA_VK_DEVICE_SELECT`). The layer only orders GPUs by the display they drive, and there
/// is none; wgpar lists and picks every adapter itself. A reachable display changes nothing.
fn quiet_unreachable_display_probes() {
    let runtime_ok = std::env::var_os("XDG_RUNTIME_DIR")
        .is_some_and(|d| !d.is_empty() && Path::new(&d).is_dir());
    let display_absolute =
        std::env::var_os("WAYLAND_DISPLAY").is_some_and(|d| Path::new(&d).is_absolute());
    if runtime_ok || display_absolute {
        return;
    }
    // Runs first in main, before any thread exists.
    std::env::remove_var("WAYLAND_DISPLAY");
    let user_chose = ["NODEVICE_SELECT", "MESA_VK_DEVICE_SELECT"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if !user_chose {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

/// The devices' adapters for a trace's metadata: their labels, `; `-separated.
fn adapter_labels(gpus: &[std::sync::Arc<wgpar::device::Gpu>]) -> String {
    let labels: Vec<String> = gpus.iter().map(|g| g.info().label()).collect();
    labels.join("; ")
}

/// Entry point: parse, dispatch, report errors as values.
pub fn main() -> Result<()> {
    quiet_unreachable_display_probes();
    let cli = Cli::parse();
    // Every environment switch is checked before a device opens or a model is built.
    wgpar::switches::validate()?;
    // Under mpirun (or --mpi) every rank runs its part of the job; a build without the `mpi`
    // feature refuses a parallel launch here.
    if cli.mpi.active()? {
        return mpi::main(cli);
    }
    match cli.command {
        Some(Command::Devices { json }) => devices::print(&Adapters::discover()?, json),
        Some(Command::Run(args)) => run::run(&args),
        Some(Command::Embed(args)) => embed::run(&args),
        Some(Command::Bench { what }) => bench::run(&what),
        Some(Command::Serve(args)) => server::run(&args),
        Some(Command::Chat(args)) => chat::run(&args),
        Some(Command::Compare(args)) => compare::run(&args),
        Some(Command::Plan(args)) => plan::run(&args),
        Some(Command::Allreduce(args)) => allreduce::run(&args),
        Some(Command::Calibrate(args)) => calibrate::run(&args),
        Some(Command::Project(args)) => project::run(&args),
        None => {
            // No arguments: show the machine, then the main job: compare the strategies on
            // the embedded default model.
            let adapters = Adapters::discover()?;
            devices::print(&adapters, false)?;
            outln!()?;
            compare::run(&compare::CompareArgs::default_job())
        }
    }
}
