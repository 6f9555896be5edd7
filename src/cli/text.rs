//! Text in, text out: `wgpar run --model DIR --prompt "..."` tokenizes the prompt with the
//! checkpoint's tokenizer, generates greedily or by sampling, and streams the text as it comes.

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::Adapters;
use wgpar::generate::{self, Request};
use wgpar::model::hf::{Checkpoint, TextTokenizer};
use wgpar::model::sampling::{Sampler, SamplingParams};
use wgpar::model::ModelWeights;
use wgpar::parallel::{build_engine, Engine};
use wgpar::trace::Recorder;
use wgpar::{Result, WgparError};

use super::options::RunArgs;
use super::prepare::{plan, recorder_for, write_trace};
use wgpar::load::MAX_CONTEXT;
use wgpar::parallel::timed::render_bubble;

/// Generates up to `--gen` tokens after `prompt` and prints the text, on the strategy and
/// devices `run`'s options name (tracing and pacing too).
pub fn generate(args: &RunArgs, prompt: &str) -> Result<()> {
    let sampling = check_options(args)?;
    let input = Input::load(args, prompt)?;
    let mut weights = input.ckpt.weights(true)?;
    args.model.choice().apply_weights(&mut weights)?;
    let shape = (input.ids.len(), args.gen);
    let (mut engine, recorder) = open_engine(args, weights, sampling, shape)?;
    eprintln!("{} prompt tokens", input.ids.len());
    stream(engine.as_mut(), &input, prompt, args.gen)?;
    out!("{}", render_bubble(engine.pipeline_stats().as_ref(), ""))?;
    if let Some(path) = &args.trace {
        write_trace(&recorder, path)?;
    }
    Ok(())
}

/// The engine of text generation on the strategy and devices `args` name, for prompts of
/// `seq` tokens and up to `max_new` generated ones: pacing, fault and recorder set, the
/// model line printed on stderr, `weights` dropped once on the devices.
pub(super) fn open_engine(
    args: &RunArgs,
    weights: ModelWeights,
    sampling: SamplingParams,
    (seq, max_new): (usize, usize),
) -> Result<(Box<dyn Engine>, Recorder)> {
    let adapters = Adapters::discover()?;
    // Prefill and --gen - 1 decode steps, the fault injected before the first.
    let plan = plan(args, &weights.config, &adapters, (1, seq), max_new)?;
    let gpus = args
        .devices
        .open_first(&adapters, plan.strategy.devices_used(plan.adapters.len()))?;
    let dtype = args.model.choice().dtype(&gpus)?;
    let comm = CommConfig::default();
    let mut engine = build_engine(&plan.strategy, &gpus, &weights, dtype, &comm, (1, seq))?;
    engine.set_sampling(sampling)?;
    if let Some((pacer, what)) = plan.pacer {
        eprintln!("pacing transfers to {what}");
        engine.set_pacer(Some(Arc::new(pacer)));
    }
    if let Some(f) = plan.fault {
        engine.inject_fault(f.worker, f.fault)?;
    }
    let recorder = recorder_for(args);
    recorder.set_meta("model", weights.config.name.clone());
    recorder.set_meta("strategy", engine.name());
    engine.set_recorder(recorder.clone());
    eprintln!(
        "model {} ({:?}, {} layers, {:.1}M params) on {}",
        weights.config.name,
        weights.config.arch,
        weights.config.layers,
        weights.config.params() as f64 / 1e6,
        engine.name(),
    );
    Ok((engine, recorder))
}

/// The options text generation takes, checked before anything is loaded: the sampling they
/// ask for (the engine picks the tokens, on the device where it can).
pub(super) fn check_options(args: &RunArgs) -> Result<SamplingParams> {
    let (model, text) = (&args.model, &args.text);
    let sampling = SamplingParams {
        temperature: text.temperature,
        top_k: text.top_k,
        top_p: text.top_p,
        seed: model.seed,
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

/// The checkpoint, its tokenizer and the prompt's ids, with the context limited to what this
/// run needs (prompt + --gen, checked against the model's and --max-seq).
struct Input {
    ckpt: Checkpoint,
    tokenizer: TextTokenizer,
    ids: Vec<u32>,
}

impl Input {
    fn load(args: &RunArgs, prompt: &str) -> Result<Self> {
        let model = &args.model;
        let dir = model.choice().checkpoint_dir().ok_or_else(|| {
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
        let tokenizer = ckpt.tokenizer_from(args.text.tokenizer.as_deref())?;
        let ids = tokenizer.encode(prompt)?;
        if ids.is_empty() {
            return Err(WgparError::option(
                "--prompt",
                "the prompt has no tokens".into(),
            ));
        }
        let context = check_context(ids.len(), args.gen, ckpt.max_context(), model.max_seq)?;
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

/// Runs the prefill and up to `max_new` tokens (an end-of-sequence id stops earlier),
/// printing the prompt and the continuation as it grows, then the timings on stderr.
fn stream(engine: &mut dyn Engine, input: &Input, prompt: &str, max_new: usize) -> Result<()> {
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
