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
//! With the prefix cache on (`prefix.rs`), a prompt takes a free slot whose block table
//! references the cached blocks of its longest cached prefix (no copy) and fresh blocks for
//! the rest, sent with the step that carries its first chunk, and prefills only the rest. A later turn of a multi-turn session
//! ([`ServeRequest::follows`]) arrives when the turn before it is done: its prompt is that
//! turn's prompt and answer, then its own new tokens.
//!
//! Every step records what it waited for (the lane's previous output, whatever wrote or freed
//! its slots' blocks, and for a prefill the arrival of its requests as a release time), so the run's
//! timeline replays on any host profile ([`project_metrics`]).

mod bench;
pub mod bench_report;
mod chunk;
mod metrics;
mod prefix;
mod workload;

use crate::model::ModelConfig;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;

pub use bench::ServeBench;
pub(crate) use chunk::{chunk_budget, plan_chunk};
pub use chunk::{DEFAULT_STEP_TOKENS, MAX_STEP_TOKENS};
pub use metrics::{Percentiles, RequestOutcome, ServeMetrics, Timing};
pub use prefix::{reuses_prefixes, Lookup, PrefixCache, PrefixStats, Taken, DEFAULT_BLOCK};
pub use workload::{Length, LongPrompt, Rate, ServeRequest, Sessions, WorkloadSpec};

use crate::error::{Result, WgparError};
use crate::parallel::{BatchStep, PipelineStats, SeqRow, SlotTable, StepDone, StepEngine};
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
    /// Reuse the KV of cached prompt prefixes (`--no-prefix-cache` turns it off).
    pub prefix_cache: bool,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            max_batch: 8,
            max_prefill_tokens: 2048,
            max_step_tokens: DEFAULT_STEP_TOKENS,
            prefix_cache: true,
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
    /// What the prefix cache reused.
    pub prefix: PrefixStats,
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

/// Why `request`, with its whole `prompt` (a later turn's includes the turns before), cannot
/// be served by a model with `max_seq` tokens per slot and `vocab` ids.
fn refusal(
    request: &ServeRequest,
    prompt: &[u32],
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
    if prompt.is_empty() {
        return bad("empty prompt".into());
    }
    if request.max_new == 0 {
        return bad("asks for no tokens".into());
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return bad(format!("token id {t} is outside the vocabulary of {vocab}"));
    }
    // The last generated token is sampled, never cached.
    let needed = prompt.len() + request.max_new - 1;
    (needed > max_seq).then(|| WgparError::KvCapacity {
        request: request.id,
        needed,
        prompt: prompt.len(),
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
    let t0 = Instant::now();
    let clock = Clock {
        t0,
        recorder: recorder.clone(),
        config,
    };
    let mut state = State::new(requests, engine.lanes().max(1), opts, clock);
    let total = requests.len();
    // Later turns of a session arrive when the turn before is done, not on the clock.
    let firsts: Vec<usize> = (0..total)
        .filter(|&i| requests[i].follows.is_none())
        .collect();
    let mut arrived = 0;
    progress(0, total);
    while state.done < total {
        let now = t0.elapsed().as_secs_f64();
        while arrived < firsts.len() && requests[firsts[arrived]].arrival_s <= now {
            let (i, at) = (firsts[arrived], requests[firsts[arrived]].arrival_s);
            state.admit(i, at, &mut |d| progress(d, total));
            arrived += 1;
        }
        state.start_idle_lanes(engine)?;
        if state.done == total {
            break;
        }
        let until_arrival = (firsts.get(arrived)).map(|&i| (requests[i].arrival_s - now).max(0.0));
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
        let could_start = state.lanes.iter().any(|l| l.busy.is_none()) && state.cache.free() > 0;
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
    // A later turn follows an earlier request, and no request has two next turns.
    let mut followed = vec![false; requests.len()];
    for (i, r) in requests.iter().enumerate() {
        if let Some(p) = r.follows {
            if p >= i || std::mem::replace(&mut followed[p], true) {
                return Err(WgparError::InvalidCall(format!(
                    "request {i} follows request {p}: a turn must follow one earlier request \
                     that no other turn follows"
                )));
            }
        }
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
    fn new(requests: &'a [ServeRequest], lanes: usize, opts: &ServeOptions, clock: Clock) -> Self {
        let cache = PrefixCache::for_model(opts.max_batch, &clock.config, opts.prefix_cache);
        let ring_step = clock.config.ring_step();
        let mut next_turn = vec![None; requests.len()];
        for (i, r) in requests.iter().enumerate() {
            if let Some(p) = r.follows {
                next_turn[p] = Some(i);
            }
        }
        Self {
            requests,
            prompts: (requests.iter())
                .map(|r| match r.follows {
                    None => r.prompt.clone(),
                    Some(_) => Vec::new(),
                })
                .collect(),
            next_turn,
            clock,
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
            cache,
            freed_by: vec![SpanId::NONE; opts.max_batch],
            waiting: VecDeque::new(),
            per_lane: opts.max_batch.div_ceil(lanes),
            // Sliding layers' rings take at most their step of new positions a row.
            max_prefill_tokens: (opts.max_prefill_tokens).min(ring_step.unwrap_or(usize::MAX)),
            max_step_tokens: opts.max_step_tokens,
            done: 0,
        }
    }

    /// Request `i` has arrived, `at_s` seconds into the run: it waits for a slot, or is
    /// refused (and done) at once.
    fn admit(&mut self, i: usize, at_s: f64, progress: &mut dyn FnMut(usize)) {
        let Clock {
            t0,
            recorder,
            config,
        } = &self.clock;
        let at = Duration::try_from_secs_f64(at_s)
            .ok()
            .and_then(|d| t0.checked_add(d))
            .unwrap_or(*t0);
        self.outcomes[i].arrival_s = at_s;
        self.outcomes[i].arrival_us = recorder.us_since_epoch(at);
        self.outcomes[i].prompt_len = self.prompts[i].len();
        let r = &self.requests[i];
        match refusal(
            r,
            &self.prompts[i],
            config.max_seq,
            config.vocab,
            &config.name,
        ) {
            Some(e) => self.refuse(i, e.to_string(), progress),
            None => self.waiting.push_back(i),
        }
    }

    /// Request `i` is refused, and with it the later turns of its session.
    fn refuse(&mut self, i: usize, why: String, progress: &mut dyn FnMut(usize)) {
        self.outcomes[i].error = Some(why);
        self.done += 1;
        progress(self.done);
        if let Some(next) = self.next_turn[i] {
            let why = format!("the turn before it (request {i}) was refused");
            self.refuse(next, why, progress);
        }
    }

    /// Request `i` is done at `now`: the next turn of its session, if any, arrives with the
    /// prompt and answer of this one before its own tokens.
    fn next_turn(&mut self, i: usize, now: f64, progress: &mut dyn FnMut(usize)) {
        let Some(next) = self.next_turn[i] else {
            return;
        };
        let mut prompt = std::mem::take(&mut self.prompts[i]);
        prompt.extend_from_slice(&self.outcomes[i].tokens);
        prompt.extend_from_slice(&self.requests[next].prompt);
        self.prompts[next] = prompt;
        self.admit(next, now, progress);
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
            prefix: self.cache.stats(),
            timeline,
        }
    }
}

/// The run's clock and what refusals are judged by.
struct Clock {
    t0: Instant,
    recorder: Recorder,
    config: ModelConfig,
}

/// The scheduler's state between steps.
struct State<'a> {
    requests: &'a [ServeRequest],
    /// Each request's whole prompt (a later turn's once the turn before is done).
    prompts: Vec<Vec<u32>>,
    /// Each request's next turn.
    next_turn: Vec<Option<usize>>,
    clock: Clock,
    outcomes: Vec<RequestOutcome>,
    lanes: Vec<Lane>,
    /// The KV slots: which are free, and the prefixes they hold.
    cache: PrefixCache,
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
        if budget == 0 {
            return None;
        }
        // Waiting requests take their slots (and cached prefixes) first, so the plan knows
        // what each has left; a slot's block table rides on this step, which always runs.
        let (tables, mut deps) = self.take_slots(lane);
        let l = &self.lanes[lane];
        let remaining: Vec<usize> = (l.filling.iter())
            .map(|f| self.prompts[f.request].len() - f.cached)
            .collect();
        let plan = chunk::plan_chunk(&remaining, budget)?;
        // Remove from the back, so the indices before stay valid.
        let mut taken: Vec<Filling> = (plan.picked.iter().rev())
            .map(|&i| self.lanes[lane].filling.remove(i))
            .collect();
        taken.reverse();
        deps.push(self.lanes[lane].last);
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
            ids.extend_from_slice(&self.prompts[f.request][f.cached..f.cached + len]);
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
            kv_tables: tables,
            kv_copies: Vec::new(),
            adjust: None,
        };
        Some((step, InFlight::Chunk(taken, len)))
    }

    /// Waiting requests join `lane`'s filling prompts while it has room and slots are free,
    /// each in the slot the prefix cache gives it: the slots' block tables (their cached
    /// prefixes' blocks and fresh ones), and the steps those blocks and the slots wait for.
    fn take_slots(&mut self, lane: usize) -> (Vec<SlotTable>, Vec<SpanId>) {
        let (mut tables, mut deps) = (Vec::new(), Vec::new());
        let l = &self.lanes[lane];
        let mut room = (self.per_lane).saturating_sub(l.seqs.len() + l.filling.len());
        while room > 0 && self.cache.free() > 0 {
            let Some(request) = self.waiting.pop_front() else {
                break;
            };
            let Some(t) = self.cache.take(&self.prompts[request]) else {
                self.waiting.push_front(request);
                break;
            };
            deps.push(self.freed_by[t.slot]);
            deps.extend(t.deps);
            tables.extend(t.table);
            self.lanes[lane].filling.push(Filling {
                request,
                slot: t.slot,
                cached: t.reused,
            });
            room -= 1;
        }
        (tables, deps)
    }

    /// A decode step of every sequence `lane` runs; `None` when it runs none. A sequence
    /// entering a block it has not reached yet gets it with this step (and waits for whatever
    /// freed it).
    fn plan_decode(&mut self, lane: usize) -> Option<(BatchStep, InFlight)> {
        let (mut kv_tables, mut deps) = (Vec::new(), Vec::new());
        for s in &self.lanes[lane].seqs {
            if let Some((table, freed)) = self.cache.grow(s.slot, s.past + 1) {
                kv_tables.push(table);
                deps.extend(freed);
            }
        }
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
            deps: {
                deps.push(l.last);
                deps.retain(|d| !d.is_none());
                deps
            },
            release_us: None,
            logits: false,
            allow: None,
            kv_tables,
            kv_copies: Vec::new(),
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
            if f.cached < self.prompts[f.request].len() {
                unfinished.push(f);
                continue;
            }
            // The prompt's KV is on the device: later prompts may reuse it.
            self.cache.register(f.slot, &self.prompts[f.request], span);
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
            // Its KV holds the prompt and every token but the last (sampled, never fed).
            let mut held = self.prompts[s.request].clone();
            held.extend_from_slice(&out.tokens[..out.tokens.len() - 1]);
            self.cache.release(s.slot, &held, span);
            self.freed_by[s.slot] = span;
            self.done += 1;
            progress(self.done);
            self.next_turn(s.request, now, progress);
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
