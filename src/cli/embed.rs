//! `wgpar embed`: sentence embeddings from an encoder checkpoint, and the cosine similarity of
//! every pair of texts.

use clap::Args;
use wgpar::device::Adapters;
use wgpar::model::hf::Checkpoint;
use wgpar::parallel::{Encoder, SingleEncoder};
use wgpar::{Result, WgparError};

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
}

/// Embeds the texts and prints the vectors and their pairwise similarities.
pub fn run(args: &EmbedArgs) -> Result<()> {
    let dir = args.model.checkpoint_dir().ok_or_else(|| {
        WgparError::option(
            "--model",
            format!(
            "embed needs --model DIR, an encoder's Hugging Face folder (e.g. all-MiniLM-L6-v2); \
             '{}' is not a folder",
            args.model.model
        ),
        )
    })?;
    let selected = match (&args.devices.virtual_count, &args.devices.devices) {
        (Some(n), _) => *n,
        (None, Some(list)) => list.split(',').count(),
        (None, None) => 1,
    };
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
    let mut ckpt = Checkpoint::open(dir)?;
    if !ckpt.config().is_encoder() {
        return Err(WgparError::unsupported(format!(
            "model '{}' is a decoder ({:?}): use `wgpar run --prompt`",
            ckpt.config().name,
            ckpt.config().arch
        )));
    }
    let tokenizer = ckpt.tokenizer()?;
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
    let weights = ckpt.weights(true)?;
    let adapters = Adapters::discover()?;
    let gpus = args.devices.open(&adapters)?;
    let dtype = args.model.dtype(&gpus)?;
    let mut encoder = SingleEncoder::new(gpus[0].clone(), &weights, dtype)?;
    let pooling = weights.config.pooling;
    drop(weights);
    let e = encoder.encode(&inputs)?;
    eprintln!(
        "model {} on {}: {:?} pooling{}, {} values per text",
        ckpt.config().name,
        encoder.name(),
        pooling.mode,
        if pooling.normalize {
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
