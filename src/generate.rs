//! Streamed text generation, shared by `run --prompt` and `chat`: the prefill of a prompt,
//! then one token per decode step until an end token, a token limit or a cancel flag, each
//! token's text handed to a callback as soon as it is decoded. Each token is decoded in the
//! context of the ones before it, the prompt's included, which keeps word boundaries right
//! for tokenizers that mark spaces on the following token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::error::Result;
use crate::model::hf::TextTokenizer;
use crate::parallel::Engine;

/// What to generate after.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The prompt's token ids (not empty).
    pub ids: &'a [u32],
    /// Most tokens generated.
    pub max_new: usize,
    /// Tokens that end the text (not part of it).
    pub eos: &'a [u32],
    /// Set (by a signal handler, another thread) to stop before the next token.
    pub cancel: Option<&'a AtomicBool>,
}

/// Why the generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model produced an end token.
    EndToken,
    /// `max_new` tokens were generated.
    Length,
    /// The cancel flag was set.
    Cancelled,
}

/// The tokens generated and how long it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// Generated ids, the end token excluded.
    pub ids: Vec<u32>,
    /// Why it stopped.
    pub finish: Finish,
    /// Seconds of the prefill step.
    pub prefill_s: f64,
    /// Seconds of the decode steps.
    pub decode_s: f64,
}

impl Generated {
    /// Decode rate, tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.ids.len() as f64 / self.decode_s.max(1e-9)
    }
}

/// Runs the prefill of `req.ids` and decodes up to `req.max_new` tokens, giving `on_text`
/// each piece of text as it is decoded (the last piece when the stream ends, which may hold
/// the bytes of a character the tokens split).
pub fn generate(
    engine: &mut dyn Engine,
    tokenizer: &TextTokenizer,
    req: &Request<'_>,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Generated> {
    let cancelled = || req.cancel.is_some_and(|c| c.load(Ordering::Relaxed));
    let start = Instant::now();
    let mut step = engine.prefill_step(&[req.ids.to_vec()], false)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let mut text = tokenizer.stream_after(req.ids);
    let decode_start = Instant::now();
    let mut ids = Vec::new();
    let finish = loop {
        let next = step.tokens[0];
        if req.eos.contains(&next) {
            break Finish::EndToken;
        }
        if cancelled() {
            break Finish::Cancelled;
        }
        ids.push(next);
        on_text(&tokenizer.step(&mut text, next)?)?;
        if ids.len() >= req.max_new {
            break Finish::Length;
        }
        step = engine.decode_step(&[next], false)?;
    };
    on_text(&tokenizer.finish(&text)?)?;
    Ok(Generated {
        ids,
        finish,
        prefill_s,
        decode_s: decode_start.elapsed().as_secs_f64(),
    })
}
