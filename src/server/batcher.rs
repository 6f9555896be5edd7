//! The engine thread: requests from every connection join the running batches at token
//! boundaries (continuous batching, as `batching::serve` schedules a benchmark), and each picked
//! token goes to its request's channel at once.
//!
//! The thread owns the engine (engines are not `Send`; it builds its own). A request whose
//! receiver is gone (the client disconnected, or a stop string ended it) leaves its lane at
//! the lane's next step boundary and frees its KV slot. An engine error, or a panic on this
//! thread, ends every request with that error and marks the server failed.
//!
//! Slots and KV blocks come from the prefix cache (`crate::batching::PrefixCache`): a prompt
//! takes a free slot whose block table references the cached blocks of its longest cached
//! prefix (no copy) and fresh blocks for the rest, sent with the step that carries its first
//! chunk, and prefills only the rest.
//!
//! The choices of an `n > 1` request share their prompt's prefill ([`Choices`]): the first
//! is scheduled as any request; the others wait, keeping their place in the queue and a free
//! slot each, until the step that completes the first's prompt has finished and its blocks
//! are cached, then take their slots referencing those blocks of the first's.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, RecvTimeoutError, TryRecvError};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::{Finish, Metrics};
use super::Shared;
use crate::batching::{Lookup, PrefixCache};
use crate::error::Result;
use crate::kernels::ops::{allow_words, pack_adjustments, MAX_ADJUST_PER_ROW};
use crate::model::constraint::Constraint;
use crate::model::sampling::{PickRules, Picked, RequestPicker, TokenLogprobs};
use crate::parallel::{BatchStep, Fault, FaultKind, SeqRow, SlotTable, StepDone, StepEngine};
use crate::trace::SpanId;

/// What the engine sends a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The next token (with its log-probs when the request asked).
    Token(Picked),
    /// The log-probs of the next prompt token a request scores (`echo` with `logprobs`).
    Scored(TokenLogprobs),
    /// The request has its tokens: `true` when an end-of-sequence token ended it (that token
    /// is not sent), `false` at `max_new`.
    Done { eos: bool },
    /// The engine failed.
    Error(String),
}

/// A request for the engine.
#[derive(Debug)]
pub struct Job {
    /// Prompt token ids (checked against the vocabulary and the context).
    pub prompt: Vec<u32>,
    /// Tokens to generate, at least 1.
    pub max_new: usize,
    /// Where its events go; dropping the receiver cancels the request.
    pub events: UnboundedSender<Event>,
    /// When it was accepted (for the time-to-first-token histogram).
    pub accepted: Instant,
    /// Whether end-of-sequence tokens are generated like any other.
    pub ignore_eos: bool,
    /// Tokens that end the request like end-of-sequence, `ignore_eos` or not.
    pub stop_ids: Vec<u32>,
    /// The request's own picker (sampling, bias, penalties, log-probs), over its row's
    /// read-back logits; `None`: the device's greedy pick. Its stream advances once per token
    /// of this request only, so a seeded request gets the same tokens whatever it is batched
    /// with.
    pub picker: Option<RequestPicker>,
    /// Structured output picked on the device (a greedy request with no `picker`): each
    /// step uploads the grammar's mask of this request's row for the pick kernel, and the
    /// picked token advances the grammar. Where the engine cannot mask on the device it
    /// becomes a host `picker`'s constraint instead.
    pub constraint: Option<Constraint>,
    /// Tokens fed after `prompt` one step at a time, each scored (its log-probs sent as
    /// [`Event::Scored`]) rather than picked: the rest of an echoed prompt whose own log-probs
    /// were asked. Generation starts after the last. Needs a `picker`.
    pub score: Vec<u32>,
    /// How the HTTP side ended it early, if it did.
    pub ending: Arc<Ending>,
    /// How its prompt may reuse cached KV (`cache_prompt`, `cache_salt`).
    pub cache: Lookup,
    /// The choices of one prompt it is one of (`n > 1`): they share the prompt's prefill.
    pub choices: Option<Choices>,
}

/// The jobs of one prompt's `n > 1` choices, which have the same prompt and cache lookup.
/// The first scheduled prefills the prompt; the others wait until its prompt's blocks are
/// cached, then reference them and prefill only the tail. Where the cache
/// cannot lend the prompt's blocks ([`PrefixCache::shares`]: `--no-prefix-cache`,
/// `cache_prompt: false`, a prompt within one block) none waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Choices(u64);

impl Choices {
    /// A group no other request has, in this process.
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// Where a group of [`Choices`] stands (a group with none of its jobs waiting has no entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Share {
    /// Its first job is prefilling the prompt: the others wait.
    Filling,
    /// The prompt's blocks are cached: the others take their slots as any job.
    Cached,
}

/// How the HTTP side ends a request before the engine does; the engine reads it at step
/// boundaries, frees the request's slot, and counts it as finished (a stop string) or
/// cancelled (a client that stopped reading).
#[derive(Debug, Default)]
pub struct Ending {
    stopped: AtomicBool,
    cancelled: AtomicBool,
}

impl Ending {
    /// A stop string ended the request: it finished.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }

    /// The request is abandoned (its client stopped reading).
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    /// Whether [`Ending::cancel`] was called.
    pub fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }
}

impl Job {
    /// Its receiver is gone or the HTTP side ended it: it leaves at the next step boundary.
    fn ended(&self) -> bool {
        self.events.is_closed() || self.ending.cancelled() || self.ending.stopped()
    }
}

struct Seq {
    job: Job,
    slot: usize,
    past: usize,
    next: u32,
    /// Tokens fed after the prompt (scored and generated): the KV holds `prompt` and these.
    tail: Vec<u32>,
    generated: usize,
    /// Tokens of `job.score` fed so far.
    scored: usize,
    /// Its `job.picker` picks on the device in the step in flight (see [`PickData`]).
    on_device: bool,
    first_at: Option<Instant>,
    /// When its last token came (for the inter-token latency).
    last_at: Option<Instant>,
}

enum Flight {
    /// A chunk of `len` prompt tokens of each of these (their `past` counts the cached ones).
    Chunk(Vec<Seq>, usize),
    Decode,
}

#[derive(Default)]
struct Lane {
    seqs: Vec<Seq>,
    /// Prompts part-way into their slots (`past` of their tokens cached), oldest first.
    filling: Vec<Seq>,
    busy: Option<Flight>,
    /// Whether the lane's last step was a decode step (its next may be a chunk step).
    decoded_last: bool,
}

/// How the engine loop batches.
#[derive(Debug, Clone, Copy)]
pub struct BatchOptions {
    /// KV slots over all lanes.
    pub slots: usize,
    /// Most prompt tokens one step's prompt chunks take.
    pub max_prefill_tokens: usize,
    /// Most tokens one step of a lane carries, its decode tokens first; a longer prompt is
    /// prefilled in chunks over several steps (`--max-step-tokens`).
    pub max_step_tokens: usize,
    /// Make the engine thread itself fail after `after` steps (tests of the failure path:
    /// `serve --inject-fault engine,kind=panic,at=step:N`).
    pub fault: Option<Fault>,
    /// Reuse the KV of cached prompt prefixes (`--no-prefix-cache` turns it off).
    pub prefix_cache: bool,
}

/// The scheduler's state between steps.
struct Batcher {
    lanes: Vec<Lane>,
    /// The KV slots: which are free, and the prefixes they hold.
    cache: PrefixCache,
    waiting: VecDeque<Job>,
    /// Groups of choices some of whose jobs are waiting, or whose first is prefilling.
    shares: HashMap<Choices, Share>,
    per_lane: usize,
    opts: BatchOptions,
    /// Token places of the KV cache over every slot.
    kv_tokens: usize,
    eos: Vec<u32>,
    metrics: Arc<Metrics>,
    shared: Arc<Shared>,
    /// The engine applies [`BatchStep::allow`] in its pick kernel.
    device_masks: bool,
    /// Words of a row's mask.
    mask_words: usize,
    /// Tokens of the vocabulary.
    vocab: usize,
}

/// Runs the engine loop until `jobs` closes and every request has finished, or the engine
/// fails or panics (then every request gets the error and the server is marked failed).
pub fn run(
    engine: &mut dyn StepEngine,
    jobs: &Receiver<Job>,
    opts: BatchOptions,
    eos: Vec<u32>,
    shared: Arc<Shared>,
) {
    let metrics = shared.metrics.clone();
    let mut opts = opts;
    // Sliding layers' rings take at most their step of new positions a row.
    if let Some(most) = engine.model_config().ring_step() {
        opts.max_prefill_tokens = opts.max_prefill_tokens.min(most);
    }
    if opts.prefix_cache && !crate::batching::reuses_prefixes(engine.model_config()) {
        eprintln!(
            "prefix cache: off for model '{}': its sliding-window layers keep a ring of their \
             window, which a cached prefix does not hold (every prompt is prefilled whole)",
            engine.model_config().name
        );
    }
    let mut b = Batcher {
        lanes: (0..engine.lanes().max(1))
            .map(|_| Lane::default())
            .collect(),
        cache: PrefixCache::for_model(opts.slots, engine.model_config(), opts.prefix_cache),
        waiting: VecDeque::new(),
        shares: HashMap::new(),
        per_lane: opts.slots.div_ceil(engine.lanes().max(1)),
        opts,
        kv_tokens: opts.slots * engine.model_config().max_seq,
        eos,
        metrics,
        shared,
        device_masks: engine.masks_on_device(),
        mask_words: allow_words(engine.model_config().vocab),
        vocab: engine.model_config().vocab,
    };
    // A panic leaves the engine in an unknown state: it is never stepped again.
    let why = match std::panic::catch_unwind(AssertUnwindSafe(|| b.serve(engine, jobs))) {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => format!(
            "the engine thread panicked: {}",
            crate::threads::panic_message(panic.as_ref()).unwrap_or("(no message)")
        ),
    };
    b.fail(&why);
    // Whatever arrives later gets the error too, until the listener closes.
    while let Ok(job) = jobs.recv() {
        b.shared.queued.fetch_sub(1, Ordering::SeqCst);
        b.metrics.failed.inc();
        let _ = job
            .events
            .send(Event::Error(format!("the engine failed: {why}")));
    }
}

impl Batcher {
    fn serve(&mut self, engine: &mut dyn StepEngine, jobs: &Receiver<Job>) -> Result<()> {
        let mut open = true;
        let mut steps = 0usize;
        loop {
            let idle = self.lanes.iter().all(|l| l.busy.is_none());
            if idle && self.waiting.is_empty() && self.running() == 0 {
                if !open {
                    return Ok(());
                }
                // Nothing to do: block for the next request (bounded, to notice shutdown).
                match jobs.recv_timeout(Duration::from_millis(200)) {
                    Ok(job) => self.admit(job),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => open = false,
                }
            }
            loop {
                match jobs.try_recv() {
                    Ok(job) => self.admit(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            self.drop_cancelled();
            for lane in 0..self.lanes.len() {
                if self.lanes[lane].busy.is_none() {
                    if let Some((step, flight)) = self.plan(lane) {
                        if step.logits {
                            (self.metrics.logits_rows).inc_by(step.rows.len() as u64);
                        }
                        engine.submit(step)?;
                        self.lanes[lane].busy = Some(flight);
                    }
                }
            }
            self.publish();
            if self.lanes.iter().all(|l| l.busy.is_none()) {
                continue;
            }
            // With an idle lane, wake soon to start new requests; otherwise wait for a step.
            let any_idle = self.lanes.iter().any(|l| l.busy.is_none());
            let timeout = any_idle.then_some(Duration::from_millis(2));
            if let Some(done) = engine.complete(timeout)? {
                self.finish(done)?;
                self.publish();
                steps += 1;
                self.injected_fault(steps)?;
                if steps.is_multiple_of(16) {
                    self.account(engine);
                }
            }
        }
    }

    /// Queues `job`; a device-masked request becomes a host-picked one where the engine
    /// cannot mask on the device.
    fn admit(&mut self, mut job: Job) {
        if let Some(c) = job.constraint.take_if(|_| !self.device_masks) {
            // Greedy rules take no sampler: making the picker cannot fail.
            match RequestPicker::new(PickRules::greedy(), None, &job.prompt) {
                Ok(p) => job.picker = Some(p.with_constraint(c)),
                Err(e) => {
                    self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                    self.metrics.failed.inc();
                    let _ = job.events.send(Event::Error(e.to_string()));
                    return;
                }
            }
        }
        self.waiting.push_back(job);
    }

    /// A request whose grammar failed ends alone, with the error; its slot frees.
    fn drop_failed(&mut self, s: Seq, why: String) {
        let _ = s.job.events.send(Event::Error(why));
        self.metrics.failed.inc();
        self.leave(&s);
    }

    fn running(&self) -> usize {
        self.lanes
            .iter()
            .map(|l| {
                l.seqs.len()
                    + l.filling.len()
                    + match &l.busy {
                        Some(Flight::Chunk(s, _)) => s.len(),
                        _ => 0,
                    }
            })
            .sum()
    }

    /// The fault `--inject-fault engine,...` asked for, after `steps` steps.
    fn injected_fault(&self, steps: usize) -> Result<()> {
        match self.opts.fault {
            Some(Fault { after, kind }) if steps > after => match kind {
                FaultKind::Panic => panic!("injected panic on the engine thread, step {steps}"),
                _ => Err(crate::WgparError::Internal(format!(
                    "injected error on the engine thread, step {steps}"
                ))),
            },
            _ => Ok(()),
        }
    }

    /// Requests whose client went away, or that the HTTP side ended, leave idle lanes and the
    /// queue; their slots free. One a stop string ended counts as finished, not cancelled.
    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.ended());
        let gone = before - self.waiting.len();
        if gone > 0 {
            self.shared.queued.fetch_sub(gone, Ordering::SeqCst);
            self.metrics.cancelled.inc_by(gone as u64);
            // A group none of whose jobs waits any more needs no entry.
            let waiting = &self.waiting;
            (self.shares).retain(|g, _| waiting.iter().any(|j| j.choices == Some(*g)));
        }
        let mut gone = Vec::new();
        for lane in self.lanes.iter_mut().filter(|l| l.busy.is_none()) {
            let (keep, out): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut lane.seqs)
                .into_iter()
                .partition(|s| !s.job.ended());
            lane.seqs = keep;
            gone.extend(out);
            let (keep, out): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut lane.filling)
                .into_iter()
                .partition(|s| !s.job.ended());
            lane.filling = keep;
            gone.extend(out);
        }
        for s in gone {
            self.leave(&s);
            if s.job.ending.stopped() && !s.job.ending.cancelled() {
                let m = &self.metrics;
                m.observe_done(s.job.accepted, s.first_at, s.generated, Finish::Stop);
            } else {
                self.metrics.cancelled.inc();
            }
        }
    }

    /// The next step for idle `lane`: after a decode step (or with nothing to decode), a
    /// step of prompt chunks if there are prompts to prefill; otherwise a decode step of its
    /// batch (see `crate::batching` for the budget).
    fn plan(&mut self, lane: usize) -> Option<(BatchStep, Flight)> {
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
    fn plan_chunk(&mut self, lane: usize) -> Option<(BatchStep, Flight)> {
        let budget = crate::batching::chunk_budget(
            self.opts.max_step_tokens,
            self.opts.max_prefill_tokens,
            self.lanes[lane].seqs.len(),
        );
        if budget == 0 {
            return None;
        }
        // Waiting requests take their slots (and cached prefixes) first, so the plan knows
        // what each has left; a slot's block table rides on this step, which always runs.
        let kv_tables = self.take_slots(lane);
        let remaining: Vec<usize> = (self.lanes[lane].filling.iter())
            .map(|s| s.job.prompt.len() - s.past)
            .collect();
        let plan = crate::batching::plan_chunk(&remaining, budget)?;
        // Remove from the back, so the indices before stay valid.
        let mut taken: Vec<Seq> = (plan.picked.iter().rev())
            .map(|&i| self.lanes[lane].filling.remove(i))
            .collect();
        taken.reverse();
        let len = plan.len;
        let rows = (taken.iter())
            .map(|s| SeqRow {
                slot: s.slot,
                past: s.past,
            })
            .collect();
        let ids = (taken.iter())
            .flat_map(|s| s.job.prompt[s.past..s.past + len].iter().copied())
            .collect();
        // Only a row whose chunk ends its prompt uses its pick; the others' are moot.
        let pick = self.pick_data(&mut taken);
        let step = BatchStep {
            lane,
            rows,
            seq: len,
            ids,
            deps: Vec::new(),
            release_us: None,
            logits: pick.logits,
            allow: pick.allow,
            adjust: pick.adjust,
            kv_tables,
            kv_copies: Vec::new(),
        };
        Some((step, Flight::Chunk(taken, len)))
    }

    /// Waiting requests join `lane`'s filling prompts while it has room and slots are free,
    /// oldest first, each in the slot the prefix cache gives it; the slots' block tables
    /// (their cached prefixes' blocks and fresh ones). A choice waiting for its first's prefill ([`Choices`]) is passed
    /// over, but keeps its place: a later request takes a slot only if one stays free for
    /// each such choice before it.
    fn take_slots(&mut self, lane: usize) -> Vec<SlotTable> {
        let mut tables = Vec::new();
        let l = &self.lanes[lane];
        let mut room = (self.per_lane).saturating_sub(l.seqs.len() + l.filling.len());
        let (mut at, mut kept) = (0, 0);
        while room > 0 && at < self.waiting.len() {
            if self.held(&self.waiting[at]) {
                (at, kept) = (at + 1, kept + 1);
                continue;
            }
            if self.cache.free() <= kept {
                break;
            }
            let job = &self.waiting[at];
            let Some(t) = self.cache.take_with(&job.prompt, job.cache) else {
                break;
            };
            let Some(job) = self.waiting.remove(at) else {
                break;
            };
            self.share(&job);
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.observe_scheduled(job.accepted);
            self.metrics
                .observe_prefix(job.prompt.len(), t.reused, self.cache.enabled());
            tables.extend(t.table);
            self.lanes[lane].filling.push(Seq {
                job,
                slot: t.slot,
                past: t.reused,
                next: 0,
                tail: Vec::new(),
                generated: 0,
                scored: 0,
                on_device: false,
                first_at: None,
                last_at: None,
            });
            room -= 1;
        }
        tables
    }

    /// Whether `job` waits for the first of its choices to finish prefilling their prompt.
    fn held(&self, job: &Job) -> bool {
        job.choices
            .is_some_and(|g| self.shares.get(&g) == Some(&Share::Filling))
    }

    /// `job` took a slot: the first of its choices to do so prefills their prompt for the
    /// others (where the cache can lend it; its siblings may still be on their way to the
    /// queue); a cached group none of whose jobs waits any more is dropped.
    fn share(&mut self, job: &Job) {
        let Some(g) = job.choices else {
            return;
        };
        match self.shares.get(&g) {
            None if self.cache.shares(job.prompt.len(), job.cache) => {
                self.shares.insert(g, Share::Filling);
            }
            Some(Share::Cached) if !self.waits(g) => {
                self.shares.remove(&g);
            }
            _ => {}
        }
    }

    /// Whether a job of group `g` waits.
    fn waits(&self, g: Choices) -> bool {
        self.waiting.iter().any(|j| j.choices == Some(g))
    }

    /// The prompt of group `g` is cached: its waiting choices may take their slots.
    fn cached(&mut self, g: Choices) {
        if !self.shares.contains_key(&g) {
            return;
        }
        if self.waits(g) {
            self.shares.insert(g, Share::Cached);
        } else {
            self.shares.remove(&g);
        }
    }

    /// A decode step of every sequence `lane` runs; `None` when it runs none.
    fn plan_decode(&mut self, lane: usize) -> Option<(BatchStep, Flight)> {
        let seqs = &self.lanes[lane].seqs;
        if seqs.is_empty() {
            return None;
        }
        let mut seqs = std::mem::take(&mut self.lanes[lane].seqs);
        let pick = self.pick_data(&mut seqs);
        // A sequence entering a block it has not reached yet gets it with this step.
        let kv_tables = (seqs.iter())
            .filter_map(|s| self.cache.grow(s.slot, s.past + 1).map(|(t, _)| t))
            .collect();
        self.lanes[lane].seqs = seqs;
        let seqs = &self.lanes[lane].seqs;
        let step = BatchStep {
            lane,
            rows: seqs
                .iter()
                .map(|s| SeqRow {
                    slot: s.slot,
                    past: s.past,
                })
                .collect(),
            seq: 1,
            ids: seqs.iter().map(|s| s.next).collect(),
            deps: Vec::new(),
            release_us: None,
            logits: pick.logits,
            allow: pick.allow,
            adjust: pick.adjust,
            kv_tables,
            kv_copies: Vec::new(),
        };
        Some((step, Flight::Decode))
    }

    /// Hands a finished step's tokens to their requests (a request with its own picker
    /// picks from its row's logits, or scores its next prompt token); finished ones leave.
    fn finish(&mut self, done: StepDone) -> Result<()> {
        let lane = done.lane;
        let tokens = &done.tokens;
        let flight = self
            .lanes
            .get_mut(lane)
            .and_then(|l| l.busy.take())
            .ok_or_else(|| {
                crate::WgparError::Internal(format!("lane {lane} returned a step it never ran"))
            })?;
        let (chunk, mut seqs) = match flight {
            Flight::Chunk(taken, len) => (Some(len), taken),
            Flight::Decode => (None, std::mem::take(&mut self.lanes[lane].seqs)),
        };
        if tokens.len() != seqs.len() {
            return Err(crate::WgparError::Shape {
                op: "serving step".into(),
                detail: format!("{} tokens for {} sequences", tokens.len(), seqs.len()),
            });
        }
        let now = Instant::now();
        let mut unfinished = Vec::new();
        for (row, (mut s, &greedy)) in seqs.drain(..).zip(tokens).enumerate() {
            match chunk {
                Some(len) => s.past += len,
                None => {
                    s.past += 1;
                    s.tail.push(s.next);
                }
            }
            if s.past < s.job.prompt.len() {
                // Part of its prompt is still to come: this chunk's token is not its.
                unfinished.push(s);
                continue;
            }
            if chunk.is_some() {
                // The prompt's KV is on the device: later prompts (its choices' first) may
                // reuse it.
                self.cache.register(s.slot, &s.job.prompt, SpanId::NONE);
                if let Some(g) = s.job.choices {
                    self.cached(g);
                }
            }
            let logits = done.logits.as_ref().map(|l| l.row(row));
            self.advance(lane, s, greedy, logits, now)?;
        }
        self.lanes[lane].filling.splice(0..0, unfinished);
        Ok(())
    }

    /// One request's token of a finished step: the device's greedy pick, or its own picker's
    /// from its row's `logits` (or the score of its next prompt token).
    fn advance(
        &mut self,
        lane: usize,
        mut s: Seq,
        greedy: u32,
        logits: Option<&[f32]>,
        now: Instant,
    ) -> Result<()> {
        let picked = match (&mut s.job.picker, logits) {
            (Some(picker), _) if s.on_device => match picker.accept(greedy) {
                Ok(()) => Picked {
                    id: greedy,
                    logprobs: None,
                },
                Err(e) => {
                    self.drop_failed(s, e.to_string());
                    return Ok(());
                }
            },
            (None, _) => {
                let fed = s.job.constraint.as_mut().map(|c| c.consume(greedy));
                if let Some(Err(e)) = fed {
                    self.drop_failed(s, e.to_string());
                    return Ok(());
                }
                Picked {
                    id: greedy,
                    logprobs: None,
                }
            }
            (Some(picker), Some(logits)) => match s.job.score.get(s.scored) {
                Some(&token) => {
                    // A prompt token: scored, fed next, not generated.
                    let _ = s
                        .job
                        .events
                        .send(Event::Scored(picker.score(logits, token)));
                    s.scored += 1;
                    s.next = token;
                    if s.scored == s.job.score.len() && s.job.max_new == 0 {
                        self.end(s, false);
                    } else {
                        self.lanes[lane].seqs.push(s);
                    }
                    return Ok(());
                }
                None => match picker.pick(logits) {
                    Ok(picked) => picked,
                    Err(e) => {
                        // Only this request's grammar failed: it alone ends, with the error.
                        self.drop_failed(s, e.to_string());
                        return Ok(());
                    }
                },
            },
            (Some(_), None) => {
                return Err(crate::WgparError::Internal(
                    "a host-picked request's step came back without logits".into(),
                ))
            }
        };
        let token = picked.id;
        s.next = token;
        s.generated += 1;
        match s.last_at {
            None => self.metrics.observe_first(s.job.accepted),
            Some(last) => self.metrics.observe_gap((now - last).as_secs_f64()),
        }
        s.first_at.get_or_insert(now);
        s.last_at = Some(now);
        let eos =
            (!s.job.ignore_eos && self.eos.contains(&token)) || s.job.stop_ids.contains(&token);
        if !eos {
            let _ = s.job.events.send(Event::Token(picked));
            self.metrics.generation_tokens.inc();
        }
        if eos || s.generated >= s.job.max_new {
            self.end(s, eos);
        } else {
            self.lanes[lane].seqs.push(s);
        }
        Ok(())
    }

    /// A request has its tokens: it hears so and its slot frees.
    fn end(&mut self, s: Seq, eos: bool) {
        let _ = s.job.events.send(Event::Done { eos });
        let why = if eos { Finish::Stop } else { Finish::Length };
        (self.metrics).observe_done(s.job.accepted, s.first_at, s.generated, why);
        self.leave(&s);
    }

    /// `s` leaves and its slot frees. A group's first leaving before its prompt was cached
    /// (cancelled) hands the prefill to the next of its choices.
    fn leave(&mut self, s: &Seq) {
        release(&mut self.cache, s);
        if let Some(g) = s.job.choices {
            if self.shares.get(&g) == Some(&Share::Filling) {
                self.shares.remove(&g);
            }
        }
    }

    /// Bubble and communication shares, from the engine's accounting.
    fn account(&self, engine: &dyn StepEngine) {
        if let Some(p) = engine.serving_stats() {
            self.metrics.bubble.set(p.measured_bubble);
        }
        if let Some(s) = engine.last_step() {
            self.metrics.communication.set(s.comm_share());
        }
    }

    /// Gauges: requests running and waiting, KV slots and blocks in use, cached blocks (and the
    /// evictions counter), and the share of the cache's token places that running sequences
    /// hold (a prompt chunk in flight holds its tokens).
    fn publish(&self) {
        let running = self.running() as i64;
        self.metrics.running.set(running);
        self.metrics.waiting.set(self.waiting.len() as i64);
        self.metrics
            .kv_slots_used
            .set((self.opts.slots - self.cache.free()) as i64);
        (self.metrics.kv_blocks_used).set(self.cache.blocks_in_use() as i64);
        (self.metrics.kv_blocks_cached).set(self.cache.blocks_cached() as i64);
        (self.metrics).observe_evictions(self.cache.stats().evictions);
        let held: usize = (self.lanes.iter())
            .map(|l| {
                let prefill: usize = match &l.busy {
                    Some(Flight::Chunk(s, len)) => s.iter().map(|s| s.past + len).sum(),
                    _ => 0,
                };
                let filling: usize = l.filling.iter().map(|s| s.past).sum();
                l.seqs.iter().map(|s| s.past + 1).sum::<usize>() + prefill + filling
            })
            .sum();
        (self.metrics.kv_usage).set(held as f64 / self.kv_tokens.max(1) as f64);
    }

    /// Ends every request with `why` and marks the server failed.
    fn fail(&mut self, why: &str) {
        self.shared.failed.store(true, Ordering::SeqCst);
        let message = format!("the engine failed: {why}");
        eprintln!("error: {message}");
        for job in self.waiting.drain(..) {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.failed.inc();
            let _ = job.events.send(Event::Error(message.clone()));
        }
        for lane in &mut self.lanes {
            let in_flight = match lane.busy.take() {
                Some(Flight::Chunk(s, _)) => s,
                _ => Vec::new(),
            };
            let filling = std::mem::take(&mut lane.filling);
            for s in lane.seqs.drain(..).chain(in_flight).chain(filling) {
                self.metrics.failed.inc();
                let _ = s.job.events.send(Event::Error(message.clone()));
            }
        }
        self.metrics.running.set(0);
        self.metrics.waiting.set(0);
        self.metrics.kv_slots_used.set(0);
        self.metrics.kv_usage.set(0.0);
    }
}

/// `s` leaves: its slot frees, and what its KV holds stays cached for later prompts.
fn release(cache: &mut PrefixCache, s: &Seq) {
    let prompt = &s.job.prompt;
    let mut held = prompt[..s.past.min(prompt.len())].to_vec();
    held.extend_from_slice(&s.tail);
    // The steps that wrote it have completed; the server records no timeline.
    cache.release(s.slot, &held, SpanId::NONE);
}

/// What a step's pick needs: the logits read back (for rows picked on the host), the rows'
/// masks and their logit adjustments for the device pick.
struct PickData {
    logits: bool,
    allow: Option<Vec<u32>>,
    adjust: Option<Vec<u32>>,
}

impl Batcher {
    /// The pick data of a step over `seqs`, marking which requests' pickers pick on the
    /// device: a greedy picker whose rules (bias, penalties, `min_tokens`) fit the device's
    /// adjustments, on an engine whose head is in this process, when it scores no prompt
    /// token. The others pick on the host from read-back logits.
    fn pick_data(&self, seqs: &mut [Seq]) -> PickData {
        let mut entries = Vec::new();
        for (row, s) in seqs.iter_mut().enumerate() {
            let scoring = s.scored < s.job.score.len();
            let device = (s.job.picker.as_ref())
                .filter(|_| self.device_masks && !scoring)
                .and_then(|p| p.device_adjustments(row as u32, self.vocab))
                .filter(|e| e.len() <= MAX_ADJUST_PER_ROW);
            s.on_device = device.is_some();
            entries.extend(device.unwrap_or_default());
        }
        let packed =
            (!entries.is_empty()).then(|| pack_adjustments(seqs.len(), self.vocab, &entries));
        let adjust = match packed {
            Some(Err(_)) => {
                // Not expected (the entries are in range, one per token of a row, bounded
                // per row), but never a device pick without its adjustments: the host picks.
                seqs.iter_mut().for_each(|s| s.on_device = false);
                None
            }
            p => p.transpose().ok().flatten(),
        };
        let logits = (seqs.iter()).any(|s| s.job.picker.is_some() && !s.on_device);
        PickData {
            logits,
            allow: masks(seqs, self.mask_words),
            adjust,
        }
    }
}

/// A step's per-row masks for the device pick: the grammar's allowed tokens for rows with a
/// device-side constraint (or a picker picking on the device with one), every token for
/// the others; `None` when no row has one.
fn masks(seqs: &mut [Seq], words: usize) -> Option<Vec<u32>> {
    let grammar = |s: &mut Seq| match &mut s.job.constraint {
        Some(c) => Some(c.allowed()),
        None => (s.job.picker.as_mut())
            .filter(|_| s.on_device)
            .and_then(|p| p.grammar_mask()),
    };
    let mut out = Vec::with_capacity(seqs.len() * words);
    let mut any = false;
    for s in seqs {
        match grammar(s) {
            // A grammar that cannot go on bans every token: the pick's token then fails to
            // advance it, which ends that request with the error.
            Some(allowed) => {
                any = true;
                out.extend(allowed.unwrap_or_else(|_| vec![0; words]));
            }
            None => out.extend(std::iter::repeat_n(u32::MAX, words)),
        }
    }
    any.then_some(out)
}
