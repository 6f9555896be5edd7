//! `wgpar embed`: sentence embeddings from an encoder checkpoint, and the cosine similarity of
//! every pair of texts.

use std::path::Path;

use clap::Args;
use wgpar::device::Adapters;
use wgpar::model::hf::Checkpoint;
use wgpar::model::{EncoderInput, Pooling};
use wgpar::parallel::{Embeddings, Encoder, SingleEncoder};
use wgpar::{Result, WgparError};

use super::options::{DeviceArgs, ModelArgs};

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
    args.model.choice().checkpoint_dir().ok_or_else(|| {
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

/// Refuses more than one device and a `--max-seq` outside the supported contexts.
fn check_options(args: &EmbedArgs) -> Result<()> {
    let selected = args.devices.choice().count();
    if selected > 1 {
        return Err(WgparError::unsupported(format!(
            "{selected} devices selected, but embed encodes on one: select one with --devices \
             (--virtual does not apply)"
        )));
    }
    if args.model.max_seq == Some(0) || args.model.max_seq > Some(wgpar::load::MAX_CONTEXT) {
        return Err(WgparError::option(
            "--max-seq",
            format!("--max-seq must be within 1..={}", wgpar::load::MAX_CONTEXT),
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
    let gpus = args.devices.choice().open(&adapters)?;
    let dtype = args.model.choice().dtype(&gpus)?;
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
    let tokens: Vec<usize> = inputs.iter().map(|i| i.ids.len()).collect();
    out!("{}", e.render(&args.texts, &tokens, args.full))
}
