//! Text in, text out: `wgpar run --model DIR --prompt "..."` tokenizes the prompt with the
//! checkpoint's tokenizer, generates greedily or by sampling, and streams the text as it comes.

use wgpar::generate::{self, Request};
use wgpar::model::sampling::{Sampler, SamplingParams};
use wgpar::model::ModelWeights;
use wgpar::parallel::run_plan::{Generation, PromptInput};
use wgpar::parallel::Engine;
use wgpar::{Result, WgparError};

use super::options::RunArgs;
use super::trace::write_trace;
use wgpar::load::MAX_CONTEXT;
use wgpar::parallel::timed::render_bubble;

/// Generates up to `--gen` tokens after `prompt` and prints the text, on the strategy and
/// devices `run`'s options name (tracing and pacing too).
pub fn generate(args: &RunArgs, prompt: &str) -> Result<()> {
    let sampling = check_options(args)?;
    let tokenizer = args.text.tokenizer.as_deref();
    let input = PromptInput::load(args.model.choice(), tokenizer, prompt, args.gen)?;
    let mut weights = input.ckpt.weights(true)?;
    args.model.choice().apply_weights(&mut weights)?;
    let shape = (input.ids.len(), args.gen);
    let Generation {
        mut engine,
        recorder,
        ..
    } = open_engine(args, weights, sampling, shape)?;
    eprintln!("{} prompt tokens", input.ids.len());
    stream(engine.as_mut(), &input, prompt, args.gen)?;
    out!("{}", render_bubble(engine.pipeline_stats().as_ref(), ""))?;
    if let Some(path) = &args.trace {
        write_trace(&recorder, path)?;
    }
    Ok(())
}

/// The engine of text generation on the strategy and devices `args` name, for prompts of
/// `seq` tokens and up to `max_new` generated ones ([`wgpar::parallel::run_plan`]), with the
/// pacing and model lines on stderr; `weights` dropped once on the devices.
pub(super) fn open_engine(
    args: &RunArgs,
    weights: ModelWeights,
    sampling: SamplingParams,
    shape: (usize, usize),
) -> Result<Generation> {
    let built = args.choice().generation_engine(&weights, sampling, shape)?;
    if let Some(what) = &built.paced {
        eprintln!("pacing transfers to {what}");
    }
    let c = &weights.config;
    let params = c.params() as f64 / 1e6;
    let name = built.engine.name();
    eprintln!(
        "model {} ({:?}, {} layers, {params:.1}M params) on {name}",
        c.name, c.arch, c.layers
    );
    Ok(built)
}

/// The options text generation takes, checked before anything is loaded: the sampling they
/// ask for (the engine picks the tokens, on the device where it can).
pub(super) fn check_options(args: &RunArgs) -> Result<SamplingParams> {
    let (model, text) = (&args.model, &args.text);
    let sampling = SamplingParams {
        temperature: text.temperature,
        top_k: text.top_k,
        top_p: text.top_p,
        seed: model.choice().seed,
    };
    Sampler::new(sampling)?;
    if args.gen == 0 {
        return Err(WgparError::option("--gen", "--gen must be positive".into()));
    }
    if args.logits_out.is_some() {
        return Err(WgparError::unsupported(
            "--logits-out writes the logits of a run on synthetic prompts: it does not apply \
             to text generation (--prompt)"
                .into(),
        ));
    }
    if model.max_seq == Some(0) || model.max_seq > Some(MAX_CONTEXT) {
        return Err(WgparError::option(
            "--max-seq",
            format!("--max-seq must be within 1..={}", MAX_CONTEXT),
        ));
    }
    Ok(sampling)
}

/// Runs the prefill and up to `max_new` tokens (an end-of-sequence id stops earlier),
/// printing the prompt and the continuation as it grows, then the timings on stderr.
fn stream(
    engine: &mut dyn Engine,
    input: &PromptInput,
    prompt: &str,
    max_new: usize,
) -> Result<()> {
    out!("{prompt}")?;
    let request = Request {
        ids: &input.ids,
        max_new,
        eos: input.ckpt.eos_tokens(),
        cancel: None,
    };
    let done = generate::generate(engine, &input.tokenizer, &request, &mut |text| {
        out!("{text}")
    })?;
    outln!()?;
    eprintln!(
        "prefill {:.1} ms; {} tokens in {:.1} ms ({:.1} tokens/s)",
        done.prefill_s * 1e3,
        done.ids.len(),
        done.decode_s * 1e3,
        done.tokens_per_s()
    );
    Ok(())
}
