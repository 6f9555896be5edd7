//! `wgpar embed`: sentence embeddings from an encoder checkpoint, and the cosine similarity of
//! every pair of texts.

use std::path::Path;

use clap::Args;
use wgpar::device::Adapters;
use wgpar::model::hf::Checkpoint;
use wgpar::model::{EncoderInput, Pooling};
use wgpar::parallel::{Embeddings, Encoder, SingleEncoder};
use wgpar::server::EncoderBuilder;
use wgpar::{Result, WgparError};

use super::server::{Prepared, ServerArgs};
use super::{DeviceArgs, ModelArgs};

/// Options of `wgpar embed`.
#[derive(Args, Clone, Debug)]
pub struct EmbedArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// A text to embed (repeat for several; all are encoded in one batch).
    #[arg(long = "text", required = true)]
    texts: Vec<String>,
    /// Print every value of each embedding, not just the first eight.
    #[arg(long)]
    full: bool,
    /// A Hugging Face tokenizer.json to use instead of the checkpoint's own.
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<std::path::PathBuf>,
}

/// Embeds the texts and prints the vectors and their pairwise similarities.
pub fn run(args: &EmbedArgs) -> Result<()> {
    let dir = checkpoint_dir(args)?;
    check_options(args)?;
    let mut ckpt = Checkpoint::open(dir)?;
    let inputs = tokenize(args, &mut ckpt)?;
    let encoded = encode(args, &ckpt, &inputs)?;
    print_embeddings(args, &inputs, &encoded)
}

/// `--model`, which must name an encoder's checkpoint folder.
fn checkpoint_dir(args: &EmbedArgs) -> Result<&Path> {
    args.model.checkpoint_dir().ok_or_else(|| {
        WgparError::option(
            "--model",
            format!(
                "embed needs --model DIR, an encoder's Hugging Face folder (e.g. \
                 all-MiniLM-L6-v2); '{}' is not a folder",
                args.model.model
            ),
        )
    })
}

/// Devices the options select (before any opens).
fn selected_count(devices: &DeviceArgs) -> usize {
    match (&devices.virtual_count, &devices.devices) {
        (Some(n), _) => *n,
        (None, Some(list)) => list.split(',').count(),
        (None, None) => 1,
    }
}

/// Refuses more than one device and a `--max-seq` outside the supported contexts.
fn check_options(args: &EmbedArgs) -> Result<()> {
    let selected = selected_count(&args.devices);
    if selected > 1 {
        return Err(WgparError::unsupported(format!(
            "{selected} devices selected, but embed encodes on one: select one with --devices \
             (--virtual does not apply)"
        )));
    }
    if args.model.max_seq == Some(0) || args.model.max_seq > Some(super::MAX_CONTEXT) {
        return Err(WgparError::option(
            "--max-seq",
            format!("--max-seq must be within 1..={}", super::MAX_CONTEXT),
        ));
    }
    Ok(())
}

/// The texts as encoder inputs, once the checkpoint is known to be an encoder and every
/// text fits `--max-seq`; the checkpoint's context is then cut to the longest text.
fn tokenize(args: &EmbedArgs, ckpt: &mut Checkpoint) -> Result<Vec<EncoderInput>> {
    if !ckpt.config().is_encoder() {
        return Err(WgparError::unsupported(format!(
            "model '{}' is a decoder ({:?}): use `wgpar run --prompt`",
            ckpt.config().name,
            ckpt.config().arch
        )));
    }
    let tokenizer = ckpt.tokenizer_from(args.tokenizer.as_deref())?;
    let inputs = args
        .texts
        .iter()
        .map(|t| tokenizer.encode_for_encoder(t))
        .collect::<Result<Vec<_>>>()?;
    let longest = inputs.iter().map(|i| i.ids.len()).max().unwrap_or(1);
    if let Some(limit) = args.model.max_seq.filter(|&limit| longest > limit) {
        return Err(WgparError::limit(
            "context (tokens)",
            (longest as u64, limit as u64),
            format!(
                "a text has {longest} tokens, more than --max-seq {limit}: raise --max-seq or \
             shorten the text"
            ),
        ));
    }
    ckpt.limit_context(longest.clamp(1, ckpt.max_context()))?;
    Ok(inputs)
}

/// What `embed` prints: the embeddings and how they were made.
struct Encoded {
    /// The checkpoint's model name.
    model: String,
    /// The encoder's description.
    engine: String,
    pooling: Pooling,
    embeddings: Embeddings,
}

/// Loads the weights onto the device and encodes `inputs` in one batch.
fn encode(args: &EmbedArgs, ckpt: &Checkpoint, inputs: &[EncoderInput]) -> Result<Encoded> {
    let weights = ckpt.weights(true)?;
    let adapters = Adapters::discover()?;
    let gpus = args.devices.open(&adapters)?;
    let dtype = args.model.dtype(&gpus)?;
    let mut encoder = SingleEncoder::new(gpus[0].clone(), &weights, dtype)?;
    let pooling = weights.config.pooling;
    // The encoder holds its own copy on the device; the host copy is no longer needed.
    drop(weights);
    let embeddings = encoder.encode(inputs)?;
    Ok(Encoded {
        model: ckpt.config().name.clone(),
        engine: encoder.name(),
        pooling,
        embeddings,
    })
}

/// The summary line (on stderr), each text's vector, and every pair's cosine similarity.
fn print_embeddings(args: &EmbedArgs, inputs: &[EncoderInput], encoded: &Encoded) -> Result<()> {
    let e = &encoded.embeddings;
    eprintln!(
        "model {} on {}: {:?} pooling{}, {} values per text",
        encoded.model,
        encoded.engine,
        encoded.pooling.mode,
        if encoded.pooling.normalize {
            ", L2-normalised"
        } else {
            ""
        },
        e.dim
    );
    for (b, text) in args.texts.iter().enumerate() {
        let row = e.row(b);
        let shown = if args.full {
            row.len()
        } else {
            row.len().min(8)
        };
        let values: Vec<String> = row[..shown].iter().map(|v| format!("{v:.6}")).collect();
        let more = if shown < row.len() { " ..." } else { "" };
        outln!(
            "[{b}] {text:?} ({} tokens): [{}{more}]",
            inputs[b].ids.len(),
            values.join(", ")
        )?;
    }
    if e.batch > 1 {
        outln!("cosine similarity:")?;
        for i in 0..e.batch {
            for j in i + 1..e.batch {
                outln!("  [{i}] vs [{j}]: {:.4}", e.cosine(i, j))?;
            }
        }
    }
    Ok(())
}

/// `serve --model` an encoder's folder: `/v1/embeddings` on one device (the options of
/// generation that do not apply are refused by name, before any device opens).
pub(super) fn serve(args: &ServerArgs, prepared: Prepared) -> Result<()> {
    let Prepared { config, text, opts } = prepared;
    refuse_for_encoder(args, &config.name)?;
    let adapters = Adapters::discover()?;
    let (devices, model) = (args.devices.clone(), args.model.clone());
    let dim = config.hidden;
    let build: EncoderBuilder = Box::new(move || {
        let weights = model.weights(&config)?;
        let gpus = devices.open(&adapters)?;
        let dtype = model.dtype(&gpus)?;
        let encoder = SingleEncoder::new(gpus[0].clone(), &weights, dtype)?;
        Ok(Box::new(encoder) as Box<dyn Encoder>)
    });
    wgpar::server::run_encoder(opts, text, dim, build)
}

/// The `--seed` clap gives when none is given (synthetic weights and sampling only).
const DEFAULT_SEED: u64 = 42;

/// Refuses, by name, every option of `serve` that an encoder's server has no use for: it
/// encodes on one device with no strategy, no memory plan (`--gpu-memory` is checked
/// against a decoder's accounting), no prefill steps (`--max-batch` bounds its batches),
/// no sampling and no chat.
fn refuse_for_encoder(args: &ServerArgs, model: &str) -> Result<()> {
    let refuse = |option: &str, given: bool| match given {
        true => Err(WgparError::unsupported(format!(
            "{option} does not apply to an encoder's server (model '{model}' serves \
             /v1/embeddings)"
        ))),
        false => Ok(()),
    };
    refuse("more than one device", selected_count(&args.devices) > 1)?;
    refuse(
        "--strategy",
        !matches!(args.strategy.strategy.as_str(), "none" | "single"),
    )?;
    // --tp, --split, --layers, --partition, --micro-batches, --schedule: none applies to a
    // single device, which is what the strategy check refuses them for.
    args.strategy.check_options()?;
    refuse("--gpu-memory", args.memory.gpu_memory.is_some())?;
    refuse("--max-prefill-tokens", args.max_prefill_tokens.is_some())?;
    refuse("--seed", args.model.seed != DEFAULT_SEED)?;
    refuse("--chat-template", args.chat_template.is_some())?;
    refuse("--pace", args.pace.is_some())?;
    refuse("--inject-fault", args.inject_fault.is_some())
}
