//! `wgpar run`: prefill + greedy decode on the chosen strategy, with tokens/s and where the
//! time went.

use wgpar::model::ModelConfig;
use wgpar::parallel::timed::{render_bubble, render_rates, write_logits};
use wgpar::{Result, WgparError};

use super::options::RunArgs;
use super::trace::write_trace;

/// Runs generation and prints the rates.
pub fn run(args: &RunArgs) -> Result<()> {
    let choice = args.choice();
    choice.strategy.check_options()?;
    choice.check_syntax()?;
    if let Some(prompt) = &args.text.prompt {
        return super::text::generate(args, prompt);
    }
    let config = checked_config(args)?;
    let done = choice.timed_generation(&config, args.timed(), &mut |line| outln!("{line}"))?;
    let g = &done.timed.generation;
    out!("{}", render_rates(g, args.batch, &done.timed.prefill))?;
    out!(
        "{}",
        render_bubble(done.decode_pipeline.as_ref(), "  decode ")
    )?;
    outln!("first sequence's tokens: {:?}", g.tokens[0])?;
    if let Some(path) = &args.logits_out {
        write_logits(path, args.batch, config.vocab, g)?;
    }
    if let Some(path) = &args.trace {
        write_trace(&done.recorder, path)?;
    }
    out!("{}", done.memory)?;
    outln!("{}", done.weights)
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
