//! Serving: a stream of requests through one engine with continuous batching, measured the
//! way vLLM's `benchmark_serving` measures a server (`wgpar serve`).
//!
//! Requests arrive on their own clock (`workload.rs`). Each lane of the engine (one for a
//! device or a tensor-parallel group, one per micro-batch for a pipeline; see
//! [`StepEngine`]) holds a running batch: sequences in KV slots, each at its own position.
//! Whenever a lane is free the scheduler gives it its next step, alternating under a step
//! budget (`max_step_tokens`, see `chunk.rs`): a decode step of every sequence in the lane,
//! then a step of prompt chunks holding what the budget leaves (prompts part-way into the
//! lane's slots first, then waiting requests while the lane has slots). A prompt longer than
//! that is prefilled over several chunk steps, each at the position where its cached tokens
//! end; the chunk that completes it gives its first token and it joins the decode batch. A
//! sequence that has its tokens leaves at once and frees its slot. Greedy sampling, so each
//! request's tokens are those it would get alone. A request that cannot fit a slot
//! ([`WgparError::KvCapacity`]) is refused on arrival; the others run.
//!
//! Every step records what it waited for (the lane's previous output, whatever freed its
//! slots, and for a prefill the arrival of its requests as a release time), so the run's
//! timeline replays on any host profile ([`project_metrics`]).

mod chunk;
mod metrics;
mod workload;

use crate::model::ModelConfig;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;

pub(crate) use chunk::{chunk_budget, plan_chunk};
pub use chunk::{DEFAULT_STEP_TOKENS, MAX_STEP_TOKENS};
pub use metrics::{Percentiles, RequestOutcome, ServeMetrics, Timing};
pub use workload::{Length, LongPrompt, Rate, ServeRequest, WorkloadSpec};

use crate::error::{Result, WgparError};
use crate::parallel::{BatchStep, PipelineStats, SeqRow, StepDone, StepEngine};
use crate::sim::{project, HostProfile, ProjectError, ProjectOptions};
use crate::trace::{Recorder, SpanId, Timeline};

/// How the server batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ServeOptions {
    /// KV slots: sequences in the running batches at once, over all lanes.
    pub max_batch: usize,
    /// Most prompt tokens one step's prompt chunks take (a longer prompt is prefilled over
    /// several steps).
    pub max_prefill_tokens: usize,
    /// Most tokens one step of a lane carries, its decode tokens first: a longer prompt is
    /// prefilled in chunks of what is left (at least `max_batch`, at most
    /// [`MAX_STEP_TOKENS`]).
    pub max_step_tokens: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            max_batch: 8,
            max_prefill_tokens: 2048,
            max_step_tokens: DEFAULT_STEP_TOKENS,
        }
    }
}

/// Everything a serving run produced.
#[derive(Debug, Clone, Serialize)]
pub struct ServeRun {
    /// The engine, as it names itself.
    pub engine: String,
    /// Lanes (steps in flight at once).
    pub lanes: usize,
    /// KV slots.
    pub slots: usize,
    /// Per request, in workload order.
    pub outcomes: Vec<RequestOutcome>,
    /// The measured figures.
    pub metrics: ServeMetrics,
    /// Pipeline accounting (pipelines only).
    pub pipeline: Option<PipelineStats>,
    /// The recorded timeline (empty when the recorder was disabled).
    #[serde(skip)]
    pub timeline: Timeline,
}

/// A sequence in a running batch.
#[derive(Debug)]
struct Running {
    request: usize,
    slot: usize,
    past: usize,
    next: u32,
}

/// A prompt on its way into its KV slot: `cached` of its tokens are there.
#[derive(Debug)]
struct Filling {
    request: usize,
    slot: usize,
    cached: usize,
}

/// The step a lane is running.
enum InFlight {
    /// A chunk of `len` tokens of each of these prompts; those it completes join the lane.
    Chunk(Vec<Filling>, usize),
    /// A decode step of the lane's sequences.
    Decode,
}

struct Lane {
    seqs: Vec<Running>,
    /// Prompts part-way into their slots, oldest first.
    filling: Vec<Filling>,
    busy: Option<InFlight>,
    /// Whether the lane's last step was a decode step (its next may be a chunk step).
    decoded_last: bool,
    /// The span that delivered the lane's last output.
    last: SpanId,
}

/// Why `request` cannot be served by a model with `max_seq` tokens per slot and `vocab` ids.
fn refusal(
    request: &ServeRequest,
    max_seq: usize,
    vocab: usize,
    model: &str,
) -> Option<WgparError> {
    let bad = |reason: String| {
        Some(WgparError::BadRequest {
            request: request.id,
            reason,
        })
    };
    if request.prompt.is_empty() {
        return bad("empty prompt".into());
    }
    if request.max_new == 0 {
        return bad("asks for no tokens".into());
    }
    if let Some(t) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
        return bad(format!("token id {t} is outside the vocabulary of {vocab}"));
    }
    // The last generated token is sampled, never cached.
    let needed = request.prompt.len() + request.max_new - 1;
    (needed > max_seq).then(|| WgparError::KvCapacity {
        request: request.id,
        needed,
        prompt: request.prompt.len(),
        generated: request.max_new,
        capacity: max_seq,
        model: model.to_string(),
    })
}

/// Serves `requests` (in arrival order) on `engine`, recording into `recorder`; calls
/// `progress(done, total)` as requests finish. Fails only if the engine fails.
pub fn serve(
    engine: &mut dyn StepEngine,
    requests: &[ServeRequest],
    opts: &ServeOptions,
    recorder: Recorder,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ServeRun> {
    check_requests(requests, opts)?;
    let config = engine.model_config().clone();
    engine.reserve_slots(opts.max_batch)?;
    recorder.declare_complete_dependencies();
    engine.set_recorder(recorder.clone());
    let mut state = State::new(requests, engine.lanes().max(1), opts);
    let t0 = Instant::now();
    let total = requests.len();
    let mut arrived = 0;
    progress(0, total);
    while state.done < total {
        let now = t0.elapsed().as_secs_f64();
        while arrived < total && requests[arrived].arrival_s <= now {
            state.admit(arrived, (t0, &recorder), &config, &mut |d| {
                progress(d, total)
            });
            arrived += 1;
        }
        state.start_idle_lanes(engine)?;
        if state.done == total {
            break;
        }
        let until_arrival = (arrived < total).then(|| (requests[arrived].arrival_s - now).max(0.0));
        if state.lanes.iter().all(|l| l.busy.is_none()) {
            let Some(wait) = until_arrival else {
                return Err(WgparError::Internal(format!(
                    "the scheduler stalled with {} requests waiting",
                    state.waiting.len()
                )));
            };
            std::thread::sleep(Duration::try_from_secs_f64(wait).unwrap_or(Duration::MAX));
            continue;
        }
        // Wake up for the next arrival only when a free lane could take it.
        let could_start = state.lanes.iter().any(|l| l.busy.is_none()) && !state.free.is_empty();
        let timeout = until_arrival
            .filter(|_| could_start)
            .map(|w| Duration::try_from_secs_f64(w).unwrap_or(Duration::MAX));
        if let Some(done) = engine.complete(timeout)? {
            let now = t0.elapsed().as_secs_f64();
            state.finish_step(done, now, &mut |d| progress(d, total))?;
        }
    }
    Ok(state.into_run(engine, opts, recorder.timeline()))
}

/// Refuses options that serve nothing and requests out of arrival order.
fn check_requests(requests: &[ServeRequest], opts: &ServeOptions) -> Result<()> {
    check_options(opts)?;
    if requests.windows(2).any(|w| w[1].arrival_s < w[0].arrival_s)
        || requests.iter().any(|r| !r.arrival_s.is_finite())
    {
        return Err(WgparError::InvalidCall(
            "requests must be in arrival order, with finite arrival times".into(),
        ));
    }
    Ok(())
}

/// Refuses batching options that serve nothing, or a step budget that cannot hold every
/// running sequence's decode token.
pub fn check_options(opts: &ServeOptions) -> Result<()> {
    if opts.max_batch == 0 || opts.max_prefill_tokens == 0 {
        return Err(WgparError::option(
            "--max-batch",
            "--max-batch and --max-prefill-tokens must be at least 1".into(),
        ));
    }
    if !(opts.max_batch..=MAX_STEP_TOKENS).contains(&opts.max_step_tokens) {
        return Err(WgparError::option(
            "--max-step-tokens",
            format!(
                "--max-step-tokens {} must be within --max-batch {}..={MAX_STEP_TOKENS}: a \
                 step carries every running sequence's decode token",
                opts.max_step_tokens, opts.max_batch
            ),
        ));
    }
    Ok(())
}

impl<'a> State<'a> {
    fn new(requests: &'a [ServeRequest], lanes: usize, opts: &ServeOptions) -> Self {
        Self {
            requests,
            outcomes: requests
                .iter()
                .map(|r| RequestOutcome {
                    id: r.id,
                    arrival_s: r.arrival_s,
                    prompt_len: r.prompt.len(),
                    max_new: r.max_new,
                    tokens: Vec::new(),
                    error: None,
                    first_token_s: None,
                    done_s: None,
                    token_s: Vec::new(),
                    arrival_us: 0.0,
                    first_span: SpanId::NONE,
                    last_span: SpanId::NONE,
                })
                .collect(),
            lanes: (0..lanes)
                .map(|_| Lane {
                    seqs: Vec::new(),
                    filling: Vec::new(),
                    busy: None,
                    decoded_last: false,
                    last: SpanId::NONE,
                })
                .collect(),
            free: (0..opts.max_batch).rev().collect(),
            freed_by: vec![SpanId::NONE; opts.max_batch],
            waiting: VecDeque::new(),
            per_lane: opts.max_batch.div_ceil(lanes),
            max_prefill_tokens: opts.max_prefill_tokens,
            max_step_tokens: opts.max_step_tokens,
            done: 0,
        }
    }

    /// Request `i` has arrived: it waits for a slot, or is refused (and done) at once.
    fn admit(
        &mut self,
        i: usize,
        (t0, recorder): (Instant, &Recorder),
        config: &ModelConfig,
        progress: &mut dyn FnMut(usize),
    ) {
        let r = &self.requests[i];
        let at = Duration::try_from_secs_f64(r.arrival_s)
            .ok()
            .and_then(|d| t0.checked_add(d))
            .unwrap_or(t0);
        self.outcomes[i].arrival_us = recorder.us_since_epoch(at);
        match refusal(r, config.max_seq, config.vocab, &config.name) {
            Some(e) => {
                self.outcomes[i].error = Some(e.to_string());
                self.done += 1;
                progress(self.done);
            }
            None => self.waiting.push_back(i),
        }
    }

    /// Submits the next step of every idle lane that has one.
    fn start_idle_lanes(&mut self, engine: &mut dyn StepEngine) -> Result<()> {
        for lane in 0..self.lanes.len() {
            if self.lanes[lane].busy.is_none() {
                if let Some((step, flight)) = self.plan(lane) {
                    engine.submit(step)?;
                    self.lanes[lane].busy = Some(flight);
                }
            }
        }
        Ok(())
    }

    /// The run's outcomes with their latency metrics, and the engine's accounting.
    fn into_run(
        self,
        engine: &dyn StepEngine,
        opts: &ServeOptions,
        timeline: Timeline,
    ) -> ServeRun {
        let timings: Vec<Timing> = (self.outcomes.iter())
            .filter_map(|o| {
                Some(Timing {
                    arrival_s: o.arrival_s,
                    first_s: o.first_token_s?,
                    done_s: o.done_s?,
                    prompt_len: o.prompt_len,
                    output_tokens: o.tokens.len(),
                })
            })
            .collect();
        let failed = self.outcomes.iter().filter(|o| o.error.is_some()).count();
        let metrics = ServeMetrics::from_timings(&timings, failed, Some(&timeline.summary()))
            .with_gaps(&metrics::token_gaps(&self.outcomes));
        ServeRun {
            engine: engine.name(),
            lanes: self.lanes.len(),
            slots: opts.max_batch,
            outcomes: self.outcomes,
            metrics,
            pipeline: engine.serving_stats(),
            timeline,
        }
    }
}

/// The scheduler's state between steps.
struct State<'a> {
    requests: &'a [ServeRequest],
    outcomes: Vec<RequestOutcome>,
    lanes: Vec<Lane>,
    /// Free KV slots (popped from the end).
    free: Vec<usize>,
    /// Per slot, the span whose output freed it (a step that reuses the slot waits for it).
    freed_by: Vec<SpanId>,
    /// Arrived, admitted requests not yet prefilled, oldest first.
    waiting: VecDeque<usize>,
    /// A lane's share of the slots.
    per_lane: usize,
    max_prefill_tokens: usize,
    max_step_tokens: usize,
    done: usize,
}

impl State<'_> {
    /// The next step for idle `lane`: after a decode step (or with nothing to decode), a
    /// step of prompt chunks if there are prompts to prefill; otherwise a decode step of its
    /// batch. `None` when it has nothing to do.
    fn plan(&mut self, lane: usize) -> Option<(BatchStep, InFlight)> {
        let l = &self.lanes[lane];
        if l.seqs.is_empty() || l.decoded_last {
            if let Some(step) = self.plan_chunk(lane) {
                self.lanes[lane].decoded_last = false;
                return Some(step);
            }
        }
        let step = self.plan_decode(lane)?;
        self.lanes[lane].decoded_last = true;
        Some(step)
    }

    /// A chunk step for `lane`: its prompts part-way in first, then waiting requests while
    /// it has slots, within what the step budget leaves after the lane's decode tokens.
    fn plan_chunk(&mut self, lane: usize) -> Option<(BatchStep, InFlight)> {
        let l = &self.lanes[lane];
        let budget =
            chunk::chunk_budget(self.max_step_tokens, self.max_prefill_tokens, l.seqs.len());
        let room = (self.per_lane)
            .saturating_sub(l.seqs.len() + l.filling.len())
            .min(self.free.len());
        let filling = l.filling.len();
        let remaining: Vec<usize> = (l.filling.iter())
            .map(|f| self.requests[f.request].prompt.len() - f.cached)
            .chain((self.waiting.iter().take(room)).map(|&r| self.requests[r].prompt.len()))
            .collect();
        let plan = chunk::plan_chunk(&remaining, budget)?;
        let (mut taken, mut deps) = (Vec::new(), vec![self.lanes[lane].last]);
        // Remove from the back, so the indices before stay valid.
        for &i in plan.picked.iter().rev() {
            taken.push(if i < filling {
                self.lanes[lane].filling.remove(i)
            } else {
                let request = self.waiting.remove(i - filling)?;
                let slot = self.free.pop()?;
                deps.push(self.freed_by[slot]);
                Filling {
                    request,
                    slot,
                    cached: 0,
                }
            });
        }
        taken.reverse();
        deps.retain(|d| !d.is_none());
        let len = plan.len;
        let mut release: f64 = 0.0;
        let (mut rows, mut ids) = (Vec::new(), Vec::new());
        for f in &taken {
            release = release.max(self.outcomes[f.request].arrival_us);
            rows.push(SeqRow {
                slot: f.slot,
                past: f.cached,
            });
            ids.extend_from_slice(&self.requests[f.request].prompt[f.cached..f.cached + len]);
        }
        let step = BatchStep {
            lane,
            rows,
            seq: len,
            ids,
            deps,
            release_us: Some(release),
            logits: false,
            allow: None,
            adjust: None,
        };
        Some((step, InFlight::Chunk(taken, len)))
    }

    /// A decode step of every sequence `lane` runs; `None` when it runs none.
    fn plan_decode(&self, lane: usize) -> Option<(BatchStep, InFlight)> {
        let l = &self.lanes[lane];
        if l.seqs.is_empty() {
            return None;
        }
        let rows = (l.seqs.iter())
            .map(|s| SeqRow {
                slot: s.slot,
                past: s.past,
            })
            .collect();
        let step = BatchStep {
            lane,
            rows,
            seq: 1,
            ids: l.seqs.iter().map(|s| s.next).collect(),
            deps: if l.last.is_none() {
                Vec::new()
            } else {
                vec![l.last]
            },
            release_us: None,
            logits: false,
            allow: None,
            adjust: None,
        };
        Some((step, InFlight::Decode))
    }

    /// Takes a finished step's tokens: prompts a chunk completed join their lane with their
    /// first token (the others wait for their next chunk, their token unused), every decoded
    /// sequence gets its token, finished ones leave and free their slots.
    fn finish_step(
        &mut self,
        done: StepDone,
        now: f64,
        progress: &mut dyn FnMut(usize),
    ) -> Result<()> {
        let lane = done.lane;
        let flight = self
            .lanes
            .get_mut(lane)
            .and_then(|l| l.busy.take())
            .ok_or_else(|| {
                WgparError::Internal(format!("lane {lane} returned a step it never ran"))
            })?;
        self.lanes[lane].last = done.span;
        let rows = match &flight {
            InFlight::Chunk(taken, _) => taken.len(),
            InFlight::Decode => self.lanes[lane].seqs.len(),
        };
        if done.tokens.len() != rows {
            return Err(WgparError::Shape {
                op: "serving step".into(),
                detail: format!("{} tokens for {rows} sequences", done.tokens.len()),
            });
        }
        let seqs = match flight {
            InFlight::Chunk(taken, len) => self.filled(lane, taken, len, &done.tokens, done.span),
            InFlight::Decode => {
                let mut seqs = std::mem::take(&mut self.lanes[lane].seqs);
                for (s, &token) in seqs.iter_mut().zip(&done.tokens) {
                    s.past += 1;
                    s.next = token;
                }
                seqs
            }
        };
        for s in seqs {
            self.deliver(lane, s, (now, done.span), progress);
        }
        Ok(())
    }

    /// Prompts a chunk of `len` tokens advanced: those now wholly cached start decoding (their
    /// first token is the chunk's), the others go back to the front of the lane's queue.
    fn filled(
        &mut self,
        lane: usize,
        taken: Vec<Filling>,
        len: usize,
        tokens: &[u32],
        span: SpanId,
    ) -> Vec<Running> {
        let mut started = Vec::new();
        let mut unfinished = Vec::new();
        for (mut f, &token) in taken.into_iter().zip(tokens) {
            f.cached += len;
            if f.cached < self.requests[f.request].prompt.len() {
                unfinished.push(f);
                continue;
            }
            self.outcomes[f.request].first_span = span;
            started.push(Running {
                request: f.request,
                slot: f.slot,
                past: f.cached,
                next: token,
            });
        }
        self.lanes[lane].filling.splice(0..0, unfinished);
        started
    }

    /// Sequence `s` has its next token (`s.next`) at `now`: it is recorded, and the sequence
    /// leaves (freeing its slot) if it has all its tokens, or runs on in `lane`.
    fn deliver(
        &mut self,
        lane: usize,
        s: Running,
        (now, span): (f64, SpanId),
        progress: &mut dyn FnMut(usize),
    ) {
        let out = &mut self.outcomes[s.request];
        out.first_token_s.get_or_insert(now);
        out.tokens.push(s.next);
        out.token_s.push(now);
        if out.tokens.len() >= self.requests[s.request].max_new {
            out.done_s = Some(now);
            out.last_span = span;
            self.free.push(s.slot);
            self.freed_by[s.slot] = span;
            self.done += 1;
            progress(self.done);
        } else {
            self.lanes[lane].seqs.push(s);
        }
    }
}

/// A serving run's figures projected onto `profile`: the run's timeline replayed there
/// (requests released at their measured arrivals), each request's first and last token
/// taken from the projected spans that delivered them.
pub fn project_metrics(
    run: &ServeRun,
    profile: &HostProfile,
    opts: &ProjectOptions,
) -> std::result::Result<ServeMetrics, ProjectError> {
    let projected = project(&run.timeline, profile, opts)?;
    // The projection's clock starts at the first recorded span.
    let origin_us = run
        .timeline
        .spans
        .iter()
        .map(|s| s.start_ns)
        .min()
        .unwrap_or(0) as f64
        / 1e3;
    let end_s = |id: SpanId| projected.timeline.span(id).map(|s| s.end_ns() as f64 / 1e9);
    let timings: Vec<Timing> = run
        .outcomes
        .iter()
        .filter(|o| o.error.is_none())
        .filter_map(|o| {
            Some(Timing {
                arrival_s: (o.arrival_us - origin_us) / 1e6,
                first_s: end_s(o.first_span)?,
                done_s: end_s(o.last_span)?,
                prompt_len: o.prompt_len,
                output_tokens: o.tokens.len(),
            })
        })
        .collect();
    Ok(ServeMetrics::from_timings(
        &timings,
        run.metrics.failed,
        Some(&projected.report.projected),
    ))
}
