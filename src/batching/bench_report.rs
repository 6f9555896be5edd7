//! What `wgpar bench serve` says about a run: the header naming the model, the engine and the
//! workload; the figures, the prefix cache, the refusals and the pipeline's accounting; the
//! run as JSON; and the trace's metadata a projection needs.

use serde::Serialize;

use super::{LongPrompt, ServeOptions, ServeRun, Sessions, WorkloadSpec};
use crate::device::DType;
use crate::error::{Result, WgparError};
use crate::model::ModelConfig;
use crate::trace::Recorder;

/// A measured serving run and what it ran.
pub struct BenchRun<'a> {
    /// The model.
    pub config: &'a ModelConfig,
    /// The workload.
    pub spec: &'a WorkloadSpec,
    /// Its sessions (shared prefix, turns).
    pub sessions: Sessions,
    /// The scheduler's limits.
    pub opts: &'a ServeOptions,
    /// The `--long-prompt` request.
    pub long_prompt: Option<LongPrompt>,
    /// The engine's name.
    pub engine: String,
    /// The strategy, placed.
    pub strategy: String,
    /// The weights' dtype.
    pub dtype: DType,
    /// The engine's lanes.
    pub lanes: usize,
    /// The devices' labels, `; `-separated.
    pub adapters: String,
}

#[derive(Serialize)]
struct Output<'a> {
    model: &'a str,
    strategy: &'a str,
    workload: &'a WorkloadSpec,
    sessions: Sessions,
    options: &'a ServeOptions,
    long_prompt: Option<LongPrompt>,
    #[serde(flatten)]
    run: &'a ServeRun,
}

impl BenchRun<'_> {
    /// The lines naming the model, the engine, the workload, its sessions and the cache.
    pub fn header(&self) -> String {
        let (c, spec, s) = (self.config, self.spec, self.sessions);
        let mut text = format!(
            "model {} ({} layers, hidden {}, {:?} weights); engine: {}\n\
             {} requests at {}, prompt {} tokens, output {} tokens, {} KV slots over {} lane(s)\n",
            c.name,
            c.layers,
            c.hidden,
            self.dtype,
            self.engine,
            spec.requests,
            spec.rate,
            spec.prompt_len,
            spec.output_len,
            self.opts.max_batch,
            self.lanes
        );
        if s.any() {
            text += &format!(
                "every session: a shared system prompt of {} tokens, {} turn(s), each later \
                 turn repeating the one before and its answer\n",
                s.shared_prefix, s.turns
            );
        }
        let cache = if self.opts.prefix_cache { "on" } else { "off" };
        text + &format!("prefix cache: {cache}\n")
    }

    /// The run as JSON: every request's outcome and the figures.
    pub fn json(&self, run: &ServeRun) -> Result<String> {
        let out = Output {
            model: &self.config.name,
            strategy: &self.strategy,
            workload: self.spec,
            sessions: self.sessions,
            options: self.opts,
            long_prompt: self.long_prompt,
            run,
        };
        serde_json::to_string_pretty(&out).map_err(|source| WgparError::Json {
            what: "the serving run".into(),
            source,
        })
    }

    /// Writes the run's trace to `path` with the metadata a projection needs.
    pub fn write_trace(&self, path: &str, recorder: &Recorder, run: &ServeRun) -> Result<()> {
        let processed: usize = (run.outcomes.iter())
            .filter(|o| o.error.is_none())
            .map(|o| o.prompt_len + o.tokens.len().saturating_sub(1))
            .sum();
        for (key, value) in [
            ("model", self.config.name.clone()),
            ("strategy", run.engine.clone()),
            ("dtype", format!("{:?}", self.dtype).to_lowercase()),
            ("workload", format!("{:?}", self.spec)),
            ("requests", self.spec.requests.to_string()),
            ("max_batch", self.opts.max_batch.to_string()),
            ("tokens", processed.to_string()),
            ("adapters", self.adapters.clone()),
        ] {
            recorder.set_meta(key, value);
        }
        Ok(recorder.timeline().write_chrome_trace(path)?)
    }
}

/// The run's figures, the prefix cache's hits, the refusals and the pipeline's accounting.
pub fn render_run(run: &ServeRun) -> String {
    let p = &run.prefix;
    let mut text = run.metrics.lines("Serving Benchmark Result");
    let hits = format!("{}/{}", p.hits, p.queries);
    text += &format!("{:<40}{:>14}\n", "Prefix cache hits (prompts):", hits);
    let rate = p.token_hit_rate() * 100.0;
    text += &format!(
        "{:<40}{:>14.1}\n",
        "Prefix cache hit rate (tokens, %):", rate
    );
    text += &format!("{:<40}{:>14}\n", "Prompt tokens saved:", p.reused_tokens);
    for o in run.outcomes.iter().filter(|o| o.error.is_some()) {
        let why = o.error.as_deref().unwrap_or("(no reason given)");
        text += &format!("refused: {why}\n");
    }
    if let Some(p) = &run.pipeline {
        text += &format!(
            "pipeline: {} passes over {} lane(s), {:.1} tokens/s = {:.0}% of the {:.1} its \
             measured stage times allow; bubble {:.1}% (a full pipeline of equal stages: \
             {:.1}%)\n",
            p.passes,
            p.microbatches,
            p.tokens_per_s(),
            p.tokens_per_s() / p.ideal_tokens_per_s() * 100.0,
            p.ideal_tokens_per_s(),
            p.measured_bubble * 100.0,
            p.theoretical_bubble * 100.0
        );
    }
    text
}
