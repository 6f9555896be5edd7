//! A serving benchmark's workload (`wgpar bench serve`): the drawn requests, the sessions
//! that repeat them, and one long prompt among them; checked before any device opens, then
//! warmed up and run through [`serve`](super::serve).

use crate::model::ModelConfig;
use crate::parallel::StepEngine;
use crate::trace::Recorder;
use crate::{Result, WgparError};

use super::{
    serve, Length, LongPrompt, Rate, ServeOptions, ServeRequest, ServeRun, Sessions, WorkloadSpec,
};

/// Most turns one session makes.
const MAX_TURNS: usize = 1024;

/// What a serving benchmark sends.
#[derive(Debug, Clone)]
pub struct ServeBench {
    /// The drawn requests (with sessions, the first turns).
    pub spec: WorkloadSpec,
    /// The shared system prompt and the turns of each session.
    pub sessions: Sessions,
    /// One more request with a longer prompt, arriving later.
    pub long_prompt: Option<LongPrompt>,
}

impl ServeBench {
    /// Checks the workload, its turns and its long prompt, naming the option at fault.
    pub fn check(&self) -> Result<()> {
        let spec = &self.spec;
        spec.check()
            .map_err(|detail| WgparError::option("workload", detail))?;
        let turns = self.sessions.turns;
        if turns == 0 || turns > MAX_TURNS {
            return Err(WgparError::option(
                "--turns",
                format!("--turns {turns} must be within 1..={MAX_TURNS}"),
            ));
        }
        WorkloadSpec {
            requests: spec.requests.saturating_mul(turns),
            prompt_len: Length::Fixed(
                (self.sessions).longest_prompt(spec.prompt_len.max(), spec.output_len.max()),
            ),
            ..spec.clone()
        }
        .check()
        .map_err(|detail| WgparError::option("--turns", detail))?;
        match self.long_prompt {
            // Longer than every drawn prompt, so its outcome is the one of its length.
            Some(long) if long.tokens <= spec.prompt_len.max() => Err(WgparError::option(
                "--long-prompt",
                format!(
                    "--long-prompt {} tokens must be longer than --prompt-len's longest, {}",
                    long.tokens,
                    spec.prompt_len.max()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The longest whole prompt a session sends (a later turn holds the turns before it).
    pub fn longest_prompt(&self) -> usize {
        (self.sessions).longest_prompt(self.spec.prompt_len.max(), self.spec.output_len.max())
    }

    /// The most tokens one step carries: a decode step of every slot, or prompt chunks
    /// within the step budget (prompts longer than that are prefilled over several steps).
    pub fn largest_step(&self, opts: &ServeOptions) -> usize {
        let longest = self
            .longest_prompt()
            .max(self.long_prompt.map_or(0, |l| l.tokens));
        (opts.max_batch * longest)
            .min(opts.max_prefill_tokens)
            .min(opts.max_step_tokens)
            .max(opts.max_batch)
    }

    /// The workload's requests, with the long prompt's among them.
    pub fn requests(&self, vocab: usize) -> Vec<ServeRequest> {
        let requests = self.sessions.generate(&self.spec, vocab);
        match self.long_prompt {
            Some(long) => long.insert(requests, self.spec.output_len.max(), vocab, self.spec.seed),
            None => requests,
        }
    }

    /// An untimed warm-up before the recorded run: a burst of a few short-output requests
    /// of the workload, so every kernel is compiled and a small batch's step shapes are
    /// allocated.
    pub fn warm_up(&self, engine: &mut dyn StepEngine, opts: &ServeOptions) -> Result<()> {
        let warm: Vec<_> = WorkloadSpec {
            requests: (2 * engine.lanes()).clamp(2, self.spec.requests),
            rate: Rate::Burst,
            output_len: Length::Fixed(2.min(self.spec.output_len.max())),
            ..self.spec.clone()
        }
        .generate(engine.model_config().vocab);
        serve(engine, &warm, opts, Recorder::disabled(), &mut |_, _| {})?;
        Ok(())
    }

    /// The long prompt's time to first token in `run`, seconds, when it has one.
    pub fn long_prompt_ttft(&self, run: &ServeRun) -> Option<f64> {
        let long = self.long_prompt?;
        (run.outcomes.iter())
            .filter(|o| long.tokens == o.prompt_len)
            .find_map(|o| Some(o.first_token_s? - o.arrival_s))
    }

    /// Refuses prompt and output lengths of which some requests cannot fit a KV slot of
    /// `config`, saying which do fit.
    pub fn check_fits(&self, config: &ModelConfig) -> Result<()> {
        let long = self.long_prompt.map_or(0, |l| l.tokens);
        let (prompt, output) = (self.longest_prompt().max(long), self.spec.output_len.max());
        // The last generated token is sampled, never cached.
        let longest = prompt + output - 1;
        if longest <= config.max_seq {
            return Ok(());
        }
        Err(WgparError::limit(
            "context (tokens)",
            (longest as u64, config.max_seq as u64),
            format!(
                "prompts up to {prompt} tokens{} and --output-len up to {output} need up to \
                 {longest} tokens of KV cache per request, but model '{}' holds {} (max_seq), \
                 so the longest requests would be refused; {}",
                if self.sessions.any() {
                    " (--prompt-len with --shared-prefix and --turns)"
                } else {
                    " (--prompt-len)"
                },
                config.name,
                config.max_seq,
                fitting_advice(config.max_seq, output, longest)
            ),
        ))
    }
}

/// What fits a context of `max_seq` tokens with outputs of up to `output` tokens, and the
/// context the `longest` request needs.
fn fitting_advice(max_seq: usize, output: usize, longest: usize) -> String {
    let fitting_prompt = (max_seq + 1).saturating_sub(output);
    if fitting_prompt >= 1 {
        format!(
            "with --output-len up to {output}, prompts of at most {fitting_prompt} tokens fit: \
             lower --prompt-len to at most {fitting_prompt}, or raise --max-seq to {longest}"
        )
    } else {
        format!(
            "--output-len up to {output} alone needs {} tokens: no prompt fits; raise \
             --max-seq to {longest}",
            output - 1
        )
    }
}
