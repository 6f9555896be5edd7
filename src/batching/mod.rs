//! Serving: a stream of requests through one engine with continuous batching, measured the
//! way vLLM's `benchmark_serving` measures a server (`wgpar serve`).
//!
//! Requests arrive on their own clock (`workload.rs`). Each lane of the engine (one for a
//! device or a tensor-parallel group, one per micro-batch for a pipeline; see
//! [`StepEngine`]) holds a running batch: sequences in KV slots, each at its own position.
//! Whenever a lane is free the scheduler gives it its next step: first a prefill of waiting
//! requests (those of the oldest one's prompt length, as many as free slots, the lane's share
//! of the slots and `max_prefill_tokens` allow), which then join the lane's batch; otherwise
//! one decode step of every sequence in the lane. A sequence that has its tokens leaves at
//! once and frees its slot. Greedy sampling, so each request's tokens are those it would get
//! alone. A request that cannot fit a slot ([`WgparError::KvCapacity`]) is refused on arrival;
//! the others run.
//!
//! Every step records what it waited for (the lane's previous output, whatever freed its
//! slots, and for a prefill the arrival of its requests as a release time), so the run's
//! timeline replays on any host profile ([`project_metrics`]).

mod metrics;
mod workload;

use crate::model::ModelConfig;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;

pub use metrics::{Percentiles, RequestOutcome, ServeMetrics, Timing};
pub use workload::{Length, Rate, ServeRequest, WorkloadSpec};

use crate::error::{Result, WgparError};
use crate::parallel::{BatchStep, PipelineStats, SeqRow, StepDone, StepEngine};
use crate::sim::{project, HostProfile, ProjectError, ProjectOptions};
use crate::trace::{Recorder, SpanId, Timeline};

/// How the server batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ServeOptions {
    /// KV slots: sequences in the running batches at once, over all lanes.
    pub max_batch: usize,
    /// Most prompt tokens one prefill step takes (a longer prompt still runs, alone).
    pub max_prefill_tokens: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            max_batch: 8,
            max_prefill_tokens: 2048,
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

/// The step a lane is running.
enum InFlight {
    /// A prefill of new sequences, which join the lane when it returns.
    Prefill(Vec<Running>),
    /// A decode step of the lane's sequences.
    Decode,
}

struct Lane {
    seqs: Vec<Running>,
    busy: Option<InFlight>,
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
    if opts.max_batch == 0 || opts.max_prefill_tokens == 0 {
        return Err(WgparError::option(
            "--max-batch",
            "--max-batch and --max-prefill-tokens must be at least 1".into(),
        ));
    }
    if requests.windows(2).any(|w| w[1].arrival_s < w[0].arrival_s)
        || requests.iter().any(|r| !r.arrival_s.is_finite())
    {
        return Err(WgparError::InvalidCall(
            "requests must be in arrival order, with finite arrival times".into(),
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
                    busy: None,
                    last: SpanId::NONE,
                })
                .collect(),
            free: (0..opts.max_batch).rev().collect(),
            freed_by: vec![SpanId::NONE; opts.max_batch],
            waiting: VecDeque::new(),
            per_lane: opts.max_batch.div_ceil(lanes),
            max_prefill_tokens: opts.max_prefill_tokens,
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
    done: usize,
}

impl State<'_> {
    /// The next step for idle `lane`: a prefill of waiting requests if it can take some,
    /// else a decode step of its batch; `None` when it has nothing to do.
    fn plan(&mut self, lane: usize) -> Option<(BatchStep, InFlight)> {
        let room = self
            .per_lane
            .saturating_sub(self.lanes[lane].seqs.len())
            .min(self.free.len());
        if let (Some(&oldest), true) = (self.waiting.front(), room > 0) {
            let len = self.requests[oldest].prompt.len();
            let mut rows = Vec::new();
            let mut ids = Vec::new();
            let mut deps = vec![self.lanes[lane].last];
            let mut release: f64 = 0.0;
            let mut joining = Vec::new();
            while let Some(&r) = self.waiting.front() {
                let fits = rows.is_empty() || (rows.len() + 1) * len <= self.max_prefill_tokens;
                if self.requests[r].prompt.len() != len || rows.len() == room || !fits {
                    break;
                }
                self.waiting.pop_front();
                let slot = self.free.pop()?;
                deps.push(self.freed_by[slot]);
                release = release.max(self.outcomes[r].arrival_us);
                rows.push(SeqRow { slot, past: 0 });
                ids.extend_from_slice(&self.requests[r].prompt);
                joining.push(Running {
                    request: r,
                    slot,
                    past: 0,
                    next: 0,
                });
            }
            deps.retain(|d| !d.is_none());
            return Some((
                BatchStep {
                    lane,
                    rows,
                    seq: len,
                    ids,
                    deps,
                    release_us: Some(release),
                    logits: false,
                    allow: None,
                },
                InFlight::Prefill(joining),
            ));
        }
        let l = &self.lanes[lane];
        if l.seqs.is_empty() {
            return None;
        }
        Some((
            BatchStep {
                lane,
                rows: l
                    .seqs
                    .iter()
                    .map(|s| SeqRow {
                        slot: s.slot,
                        past: s.past,
                    })
                    .collect(),
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
            },
            InFlight::Decode,
        ))
    }

    /// Takes a finished step's tokens: new sequences join their lane, every sequence gets
    /// its token, finished ones leave and free their slots.
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
        let prefill = matches!(flight, InFlight::Prefill(_));
        let mut seqs = match flight {
            InFlight::Prefill(new) => {
                for s in &new {
                    self.outcomes[s.request].first_token_s = Some(now);
                    self.outcomes[s.request].first_span = done.span;
                }
                new
            }
            InFlight::Decode => std::mem::take(&mut self.lanes[lane].seqs),
        };
        let chosen = done.tokens;
        if chosen.len() != seqs.len() {
            return Err(WgparError::Shape {
                op: "serving step".into(),
                detail: format!("{} tokens for {} sequences", chosen.len(), seqs.len()),
            });
        }
        for (s, &token) in seqs.iter_mut().zip(&chosen) {
            s.past += if prefill {
                self.requests[s.request].prompt.len()
            } else {
                1
            };
            s.next = token;
            self.outcomes[s.request].tokens.push(token);
            self.outcomes[s.request].token_s.push(now);
        }
        for s in seqs {
            let out = &mut self.outcomes[s.request];
            if out.tokens.len() >= self.requests[s.request].max_new {
                out.done_s = Some(now);
                out.last_span = done.span;
                self.free.push(s.slot);
                self.freed_by[s.slot] = done.span;
                self.done += 1;
                progress(self.done);
            } else {
                self.lanes[lane].seqs.push(s);
            }
        }
        Ok(())
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
