//! `wgpar run`: prefill + greedy decode on the chosen strategy, with tokens/s.

use clap::Args;
use wgpar::device::Adapters;
use wgpar::parallel::{generate, Engine, SingleEngine};
use wgpar::{Result, WgparError};

use super::text::TextArgs;
use super::{DeviceArgs, ModelArgs};

/// Options of `wgpar run`.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// How to spread the model: none (one device).
    #[arg(long, default_value = "none", value_parser = ["none"])]
    strategy: String,
    /// Sequences per batch.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Prompt length (random token ids).
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Tokens to generate per sequence.
    #[arg(long, default_value_t = 16)]
    gen: usize,
    #[command(flatten)]
    text: TextArgs,
}

impl RunArgs {
    /// What `wgpar` with no arguments runs.
    pub fn default_job() -> Self {
        Self {
            devices: DeviceArgs {
                devices: None,
                virtual_count: None,
                force_f32: false,
            },
            model: ModelArgs {
                model: "default".into(),
                dtype: "f32".into(),
                seed: 42,
            },
            strategy: "none".into(),
            batch: 4,
            prompt_len: 64,
            gen: 16,
            text: TextArgs::default(),
        }
    }
}

/// Runs generation and prints the rates.
pub fn run(args: &RunArgs) -> Result<()> {
    if let Some(prompt) = &args.text.prompt {
        return super::text::generate(&args.devices, &args.model, &args.text, prompt, args.gen);
    }
    let config = args.model.config()?;
    if args.batch == 0 || args.prompt_len == 0 || args.gen == 0 {
        return Err(WgparError::Config(
            "--batch, --prompt-len and --gen must be positive".into(),
        ));
    }
    if args.prompt_len + args.gen > config.max_seq {
        return Err(WgparError::Config(format!(
            "--prompt-len {} + --gen {} exceed max_seq {} of model '{}'",
            args.prompt_len, args.gen, config.max_seq, config.name
        )));
    }
    let adapters = Adapters::discover()?;
    let gpus = args.devices.open(&adapters)?;
    let dtype = args.model.dtype(&gpus)?;
    let weights = args.model.weights(&config)?;
    println!(
        "model {} ({} arch, {} layers, hidden {}, {:.1}M params, {:?} weights)",
        config.name,
        format!("{:?}", config.arch).to_lowercase(),
        config.layers,
        config.hidden,
        config.params() as f64 / 1e6,
        dtype
    );
    let mut engine: Box<dyn Engine> =
        Box::new(SingleEngine::new(gpus[0].clone(), &weights, dtype)?);
    println!("engine: {}", engine.name());
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|b| {
            (0..args.prompt_len)
                .map(|i| ((b * 7919 + i * 104_729) % config.vocab) as u32)
                .collect()
        })
        .collect();
    // One untimed pass compiles the pipelines and allocates buffers.
    generate(engine.as_mut(), &prompts, 2)?;
    let g = generate(engine.as_mut(), &prompts, args.gen)?;
    println!(
        "prefill: {} tokens in {:.1} ms = {:.1} tokens/s (time to first token {:.1} ms)",
        g.prompt_tokens,
        g.prefill_s * 1e3,
        g.prefill_tokens_per_s(),
        g.prefill_s * 1e3
    );
    let per_token_ms = g.decode_s.iter().sum::<f64>() / g.decode_s.len().max(1) as f64 * 1e3;
    println!(
        "decode: {} steps x {} sequences, {:.2} ms per step = {:.1} tokens/s",
        g.decode_s.len(),
        args.batch,
        per_token_ms,
        g.decode_tokens_per_s()
    );
    println!("first sequence's tokens: {:?}", g.tokens[0]);
    Ok(())
}
