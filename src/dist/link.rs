//! Remote stage links: a pipeline's stage boundary between two MPI ranks. The last stage of
//! rank r hands its micro-batch (hidden states in host memory) to a link thread, which sends
//! it to rank r+1 while the stage goes on computing the next micro-batch (the bounded channel
//! in between is the double buffer); on rank r+1 a link thread receives it and feeds the first
//! stage there, which uploads it. Logits travel from the last rank back to rank 0's driver the
//! same way. Every wait is a non-blocking request polled against the job's timeout.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam::channel::{Receiver, Sender};
use mpi::request::StaticScope;
use mpi::traits::*;

use super::error::DistError;
use super::world::{poll_until, poll_with, Backoff, Comm, World};
use crate::error::{Result, WgparError};
use crate::model::{SeqRow, Step, StepOut};
use crate::parallel::pp::{Output, Payload, Readout, Work};
use crate::parallel::{KvCopy, KvEdits, SlotTable, StageStats};
use crate::trace::{Recorder, SpanAttrs, SpanId, Track};

/// Activations from rank r to rank r+1.
const TAG_ACTIVATIONS: i32 = 10;
/// Logits from the last rank to rank 0.
const TAG_LOGITS: i32 = 11;

/// First header word: protocol name and version (ranks of different wgpar builds disagree
/// here rather than misreading each other's bytes).
const MAGIC: u64 = 0x7767_7061_725f_0005;
const HEADER_WORDS: usize = 15;
/// `rows` word of a pass without a sequence table.
const NO_ROWS: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Work = 1,
    Stop = 2,
    Logits = 3,
}

/// What a link message says besides its payload.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Header {
    kind: Kind,
    group: u64,
    batch: u64,
    seq: u64,
    past: u64,
    new_cache: bool,
    release: bool,
    record: bool,
    /// The head must send its logits back, not only its picks (rank 0 asked for them, or
    /// picks on the host).
    logits: bool,
    dep: u64,
    run: u64,
    /// The KV cache the pass uses on every stage.
    cache: u64,
    /// Slots of the cache `new_cache` makes, plus one (0: one per sequence).
    slots: u64,
    /// Entries of the sequence table at the front of the payload (`NO_ROWS`: none).
    rows: u64,
    /// KV copies between slots after the sequence table (three words each).
    copies: u64,
    /// Words of KV block tables after the copies (slot, length, then the blocks, each).
    tables: u64,
}

impl Header {
    fn stop() -> Self {
        Header {
            kind: Kind::Stop,
            group: 0,
            batch: 0,
            seq: 0,
            past: 0,
            new_cache: false,
            release: false,
            record: false,
            logits: false,
            dep: 0,
            run: 0,
            cache: 0,
            slots: 0,
            rows: NO_ROWS,
            copies: 0,
            tables: 0,
        }
    }

    fn encode(&self, payload: &[u8]) -> Vec<u8> {
        let flags = u64::from(self.new_cache)
            | u64::from(self.release) << 1
            | u64::from(self.record) << 2
            | u64::from(self.logits) << 3;
        let words = [
            MAGIC,
            self.kind as u64,
            self.group,
            self.batch,
            self.seq,
            self.past,
            flags,
            self.dep,
            self.run,
            self.cache,
            self.slots,
            self.rows,
            self.copies,
            self.tables,
            payload.len() as u64,
        ];
        let mut out = Vec::with_capacity(HEADER_WORDS * 8 + payload.len());
        for w in words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.extend_from_slice(payload);
        out
    }

    fn decode(msg: &[u8], peer: usize) -> std::result::Result<(Header, &[u8]), DistError> {
        let bad = |detail: String| DistError::Protocol { peer, detail };
        if msg.len() < HEADER_WORDS * 8 {
            return Err(bad(format!("{} bytes, shorter than a header", msg.len())));
        }
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&msg[i * 8..i * 8 + 8]);
            u64::from_le_bytes(b)
        };
        if word(0) != MAGIC {
            return Err(bad(format!(
                "protocol {:#x}, expected {MAGIC:#x} (do both ranks run the same wgpar?)",
                word(0)
            )));
        }
        let kind = match word(1) {
            1 => Kind::Work,
            2 => Kind::Stop,
            3 => Kind::Logits,
            k => return Err(bad(format!("unknown message kind {k}"))),
        };
        let payload = &msg[HEADER_WORDS * 8..];
        if payload.len() as u64 != word(14) {
            return Err(bad(format!(
                "payload of {} bytes, header says {}",
                payload.len(),
                word(14)
            )));
        }
        let flags = word(6);
        Ok((
            Header {
                kind,
                group: word(2),
                batch: word(3),
                seq: word(4),
                past: word(5),
                new_cache: flags & 1 != 0,
                release: flags & 2 != 0,
                record: flags & 4 != 0,
                logits: flags & 8 != 0,
                dep: word(7),
                run: word(8),
                cache: word(9),
                slots: word(10),
                rows: word(11),
                copies: word(12),
                tables: word(13),
            },
            payload,
        ))
    }
}

/// A pass's sequence table as payload words (slot, past per row).
fn rows_bytes(rows: Option<&[SeqRow]>) -> Vec<u8> {
    let words: Vec<u64> = rows
        .unwrap_or(&[])
        .iter()
        .flat_map(|r| [r.slot as u64, r.past as u64])
        .collect();
    bytemuck::cast_slice(&words).to_vec()
}

/// A pass's KV copies as payload words (from, to, tokens per copy).
fn copies_bytes(copies: &[KvCopy]) -> Vec<u8> {
    let words: Vec<u64> = (copies.iter())
        .flat_map(|c| [c.from as u64, c.to as u64, c.tokens as u64])
        .collect();
    bytemuck::cast_slice(&words).to_vec()
}

/// A pass's KV block tables as payload words (slot, length, then the blocks, per table).
fn tables_words(tables: &[SlotTable]) -> Vec<u64> {
    (tables.iter())
        .flat_map(|t| {
            [t.slot as u64, t.blocks.len() as u64]
                .into_iter()
                .chain(t.blocks.iter().map(|&b| u64::from(b)))
        })
        .collect()
}

/// The tables of [`tables_words`]'s words; a length past the end is a protocol error.
fn tables_of(words: &[u64], peer: usize) -> std::result::Result<Vec<SlotTable>, DistError> {
    let mut tables = Vec::new();
    let mut rest = words;
    while let [slot, len, tail @ ..] = rest {
        let n = usize::try_from(*len).ok().filter(|&n| n <= tail.len());
        let Some(n) = n else {
            return Err(DistError::Protocol {
                peer,
                detail: format!("a KV block table of {len} blocks in {} words", tail.len()),
            });
        };
        tables.push(SlotTable {
            slot: *slot as usize,
            blocks: tail[..n].iter().map(|&b| b as u32).collect(),
        });
        rest = &tail[n..];
    }
    if !rest.is_empty() {
        return Err(DistError::Protocol {
            peer,
            detail: "a KV block table cut short".into(),
        });
    }
    Ok(tables)
}

/// What a work payload carries: the pass's sequence table (if it has one), its KV edits
/// (copies, then block tables) and its hidden states.
struct WorkParts {
    rows: Option<Arc<Vec<SeqRow>>>,
    edits: Arc<KvEdits>,
    hidden: Vec<u8>,
}

/// The first `count` records of `words` u64 each at the front of `payload`, and the rest.
fn take_words<'p>(
    payload: &'p [u8],
    (count, words): (u64, usize),
    (what, peer): (&str, usize),
) -> std::result::Result<(Vec<u64>, &'p [u8]), DistError> {
    let bytes = usize::try_from(count)
        .ok()
        .and_then(|n| n.checked_mul(8 * words))
        .filter(|&b| b <= payload.len())
        .ok_or_else(|| DistError::Protocol {
            peer,
            detail: format!(
                "{count} {what} entries in a payload of {} bytes",
                payload.len()
            ),
        })?;
    Ok((
        bytemuck::pod_collect_to_vec(&payload[..bytes]),
        &payload[bytes..],
    ))
}

/// Splits a work payload into its sequence table (`h.rows` entries), KV copies (`h.copies`),
/// block tables (`h.tables` words) and hidden states.
fn split_work(
    h: &Header,
    payload: &[u8],
    peer: usize,
) -> std::result::Result<WorkParts, DistError> {
    let (rows, rest) = if h.rows == NO_ROWS {
        (None, payload)
    } else {
        let (words, rest) = take_words(payload, (h.rows, 2), ("sequence table", peer))?;
        let rows = (words.chunks_exact(2))
            .map(|w| SeqRow {
                slot: w[0] as usize,
                past: w[1] as usize,
            })
            .collect();
        (Some(Arc::new(rows)), rest)
    };
    let (words, rest) = take_words(rest, (h.copies, 3), ("KV copy", peer))?;
    let copies = (words.chunks_exact(3))
        .map(|w| KvCopy {
            from: w[0] as usize,
            to: w[1] as usize,
            tokens: w[2] as usize,
        })
        .collect();
    let (words, rest) = take_words(rest, (h.tables, 1), ("KV block table word", peer))?;
    let tables = tables_of(&words, peer)?;
    Ok(WorkParts {
        rows,
        edits: Arc::new(KvEdits::of(tables, copies)),
        hidden: rest.to_vec(),
    })
}

/// Sends `msg` to `dest`, polling the request against the job's timeout.
pub(super) fn send(
    comm: &Comm,
    dest: usize,
    tag: i32,
    msg: Vec<u8>,
    timeout: std::time::Duration,
    what: &str,
) -> std::result::Result<(), DistError> {
    let deadline = Instant::now() + timeout;
    let started = Instant::now();
    // The request needs a 'static buffer: lend the message's heap block and take it back once
    // the send completed (on a timeout it is leaked: the rank is failing anyway).
    let raw: *mut [u8] = Box::into_raw(msg.into_boxed_slice());
    // SAFETY: `raw` comes from `Box::into_raw` and is not aliased until reclaimed below.
    let buf: &'static [u8] = unsafe { &*raw };
    let mut req = Some(
        comm.get()
            .process_at_rank(dest as i32)
            .immediate_send_with_tag(StaticScope, buf, tag),
    );
    let r = poll_until(
        deadline,
        || {
            let q = req.take()?;
            match q.test() {
                Ok(_) => Some(()),
                Err(q) => {
                    req = Some(q);
                    None
                }
            }
        },
        || DistError::Timeout {
            what: what.to_string(),
            peer: dest,
            secs: started.elapsed().as_secs_f64(),
        },
    );
    match req.take() {
        Some(q) => std::mem::forget(q),
        // SAFETY: the send completed; MPI no longer reads the buffer.
        None => drop(unsafe { Box::from_raw(raw) }),
    }
    r
}

/// Receives the next message from `src` with `tag`, polling (probe, then a matched receive of
/// a message already there) against the job's timeout.
fn receive(
    comm: &Comm,
    src: usize,
    tag: i32,
    timeout: std::time::Duration,
    what: &str,
) -> std::result::Result<Vec<u8>, DistError> {
    receive_with(comm, src, tag, timeout, what, Backoff::RUNTIME)
}

/// [`receive`] polling with `backoff` (the calibration compares schedules).
pub(super) fn receive_with(
    comm: &Comm,
    src: usize,
    tag: i32,
    timeout: std::time::Duration,
    what: &str,
    backoff: Backoff,
) -> std::result::Result<Vec<u8>, DistError> {
    let deadline = Instant::now() + timeout;
    let started = Instant::now();
    let process = comm.get().process_at_rank(src as i32);
    let msg = poll_with(
        backoff,
        deadline,
        || process.immediate_matched_probe_with_tag(tag),
        || DistError::Timeout {
            what: what.to_string(),
            peer: src,
            secs: started.elapsed().as_secs_f64(),
        },
    )?;
    let (bytes, _) = msg.matched_receive_vec::<u8>();
    Ok(bytes)
}

/// The link threads of one rank of a pipeline spread over ranks.
pub(crate) struct Links {
    threads: Vec<JoinHandle<()>>,
    /// One message per thread as it ends (also when it unwinds).
    done: Receiver<()>,
    /// Where rank 0's logits thread records each arrival: the driver's recorder, which the
    /// run sets after the links start ([`Links::set_logits_recorder`]). The arrival span is
    /// what the driver's next pass of that micro-batch depends on, so it must be in the same
    /// timeline as the pass, or the pass's dependency names a span of another recorder.
    logits_recorder: Arc<Mutex<Recorder>>,
}

/// Tells `Links` that its thread ended, however it ended.
struct Done(Sender<()>);

impl Drop for Done {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

impl Links {
    /// Starts the threads rank `world.rank()` needs:
    /// - `upstream`: from rank r-1 into this rank's first stage (`to_first`);
    /// - `downstream`: this rank's last stage's hand-offs (`from_last`) to rank r+1;
    /// - on rank 0, the logits from the last rank into the driver's output (`logits_out`).
    ///   Errors of any link go into `errors` (the driver's output on rank 0).
    pub(crate) fn start(
        world: &World,
        to_first: Option<Sender<Work>>,
        from_last: Option<Receiver<Work>>,
        errors: Sender<Result<Output>>,
        recorder: Recorder,
        stats: Arc<Mutex<Vec<StageStats>>>,
    ) -> Result<Self> {
        let rank = world.rank();
        let size = world.size();
        let timeout = world.timeout();
        let idle = world.idle_timeout();
        let mut threads = Vec::new();
        let (done_tx, done) = crossbeam::channel::unbounded();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            let done = Done(done_tx.clone());
            std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || {
                    let _done = done;
                    f()
                })
                .map_err(|e| WgparError::Worker {
                    worker: name,
                    message: format!("could not start thread: {e}"),
                })
        };
        if let Some(tx) = to_first {
            let comm = world.p2p().clone();
            let errors = errors.clone();
            let recorder = recorder.clone();
            threads.push(spawn(
                format!("mpi-recv-{}", rank - 1),
                Box::new(move || {
                    if let Err(e) = upstream(&comm, rank, idle, &tx, &recorder, &stats) {
                        let _ = errors.send(Err(e.into()));
                    }
                }),
            )?);
        }
        if let Some(rx) = from_last {
            let comm = world.p2p().clone();
            let errors = errors.clone();
            threads.push(spawn(
                format!("mpi-send-{}", rank + 1),
                Box::new(move || {
                    if let Err(e) = downstream(&comm, rank, timeout, &rx) {
                        let _ = errors.send(Err(e.into()));
                    }
                }),
            )?);
        }
        let logits_recorder = Arc::new(Mutex::new(recorder.clone()));
        if rank == 0 && size > 1 {
            let comm = world.p2p().clone();
            let recorder = logits_recorder.clone();
            threads.push(spawn(
                "mpi-logits".into(),
                Box::new(move || {
                    if let Err(e) = logits_in(&comm, size - 1, idle, &errors, &recorder) {
                        let _ = errors.send(Err(e.into()));
                    }
                }),
            )?);
        }
        Ok(Self {
            threads,
            done,
            logits_recorder,
        })
    }

    /// Records the logits' arrivals on rank 0 into `recorder` from now on.
    pub(crate) fn set_logits_recorder(&self, recorder: Recorder) {
        if let Ok(mut r) = self.logits_recorder.lock() {
            *r = recorder;
        }
    }

    /// Waits up to `grace` for every link thread to end (they end when their stream stops);
    /// threads still waiting on a peer after that are left behind (after a failure the
    /// process ends right away, so they must not hold it up until their timeout).
    pub(crate) fn finish(mut self, grace: std::time::Duration) {
        let deadline = Instant::now() + grace;
        let mut ended = 0;
        while ended < self.threads.len() {
            match self.done.recv_deadline(deadline) {
                Ok(()) => ended += 1,
                Err(_) => break,
            }
        }
        if ended == self.threads.len() {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

/// Rank r > 0: hand-offs from rank r-1 into the first stage, until rank r-1 says stop. Each
/// waits at most `idle` (the job's timeout, or longer for a server between requests).
fn upstream(
    comm: &Comm,
    rank: usize,
    idle: std::time::Duration,
    tx: &Sender<Work>,
    recorder: &Recorder,
    stats: &Mutex<Vec<StageStats>>,
) -> std::result::Result<(), DistError> {
    let src = rank - 1;
    let device = 0;
    let mut count = 0usize;
    let mut run = None;
    loop {
        let msg = receive(
            comm,
            src,
            TAG_ACTIVATIONS,
            idle,
            &format!("receive hand-off {count} from the previous stage"),
        )?;
        let got = Instant::now();
        let (h, payload) = Header::decode(&msg, src)?;
        match h.kind {
            Kind::Stop => return Ok(()),
            Kind::Logits => {
                return Err(DistError::Protocol {
                    peer: src,
                    detail: "logits on the activations link".into(),
                })
            }
            Kind::Work => {}
        }
        if run != Some(h.run) {
            // Rank 0 started another run (a GPipe step, a stream): this rank's stage
            // accounting starts afresh too, so that both cover the same work.
            reset_stats(stats);
        }
        run = Some(h.run);
        let rec = if h.record {
            recorder.clone()
        } else {
            Recorder::disabled()
        };
        // The receive, as seen on this rank; the merge of rank traces links it (and what
        // follows it) to the sending rank's download, so a projection pays the network there.
        let parts = split_work(&h, payload, src)?;
        let bytes = parts.hidden.len() as u64;
        let dep = rec.record_with(got, Instant::now(), || {
            SpanAttrs::wait("mpi recv", device)
                .on_track(Track::Other(format!("mpi recv {rank}")))
                .bytes(bytes)
                .microbatch(h.group as u32)
        });
        if !dep.is_none() && h.dep != 0 {
            rec.remote_dep(dep, src as u32, SpanId(h.dep));
        }
        if tx.send(handoff_work(&h, parts, dep, rec)).is_err() {
            // The stages stopped (their error is on its way to the driver).
            return Ok(());
        }
        count += 1;
    }
}

/// Clears every stage's accounting but what it holds (its layers and device).
fn reset_stats(stats: &Mutex<Vec<StageStats>>) {
    for s in crate::threads::lock(stats).iter_mut() {
        *s = StageStats {
            layers: s.layers.clone(),
            device: s.device.clone(),
            ..Default::default()
        };
    }
}

/// The work a hand-off from the previous stage asks of this rank's stages; `dep` is the
/// receive's span, recorded on `recorder`.
fn handoff_work(h: &Header, parts: WorkParts, dep: SpanId, recorder: Recorder) -> Work {
    Work {
        encoder: None,
        pacer: None,
        group: h.group as usize,
        cache: h.cache as usize,
        rows: parts.rows,
        slots: h.slots.checked_sub(1).map(|n| n as usize),
        // A release time is on the driver's clock: it holds only the first stage.
        release_us: None,
        ids: Arc::new(Vec::new()),
        step: Step {
            batch: h.batch as usize,
            seq: h.seq as usize,
            past: h.past as usize,
        },
        new_cache: h.new_cache,
        release: h.release,
        hidden: parts.hidden,
        deps: vec![dep],
        recorder,
        run: h.run,
        // The pick's settings stay on rank 0: the head picks greedily and sends the
        // logits too only where rank 0 needs them (see `Readout::remote`).
        readout: Readout::remote(h.logits),
        kv_edits: parts.edits,
    }
}

/// Rank r < last: the last stage's hand-offs to rank r+1; stop when the stages close.
fn downstream(
    comm: &Comm,
    rank: usize,
    timeout: std::time::Duration,
    rx: &Receiver<Work>,
) -> std::result::Result<(), DistError> {
    let dest = rank + 1;
    for work in rx.iter() {
        let tables = tables_words(&work.kv_edits.tables);
        let h = Header {
            kind: Kind::Work,
            group: work.group as u64,
            batch: work.step.batch as u64,
            seq: work.step.seq as u64,
            past: work.step.past as u64,
            new_cache: work.new_cache,
            release: work.release,
            record: work.recorder.is_enabled(),
            logits: work.readout.logits,
            // The hand-off's download: what the next stage's first span waits for.
            dep: work.deps.first().map_or(0, |d| d.0),
            run: work.run,
            cache: work.cache as u64,
            slots: work.slots.map_or(0, |n| n as u64 + 1),
            rows: work.rows.as_ref().map_or(NO_ROWS, |r| r.len() as u64),
            copies: work.kv_edits.copies.len() as u64,
            tables: tables.len() as u64,
        };
        let what = format!("send micro-batch {} to the next stage", work.group);
        send(
            comm,
            dest,
            TAG_ACTIVATIONS,
            h.encode(
                &[
                    rows_bytes(work.rows.as_deref().map(|r| &r[..])),
                    copies_bytes(&work.kv_edits.copies),
                    bytemuck::cast_slice(&tables).to_vec(),
                    work.hidden,
                ]
                .concat(),
            ),
            timeout,
            &what,
        )?;
    }
    send(
        comm,
        dest,
        TAG_ACTIVATIONS,
        Header::stop().encode(&[]),
        timeout,
        "send stop to the next stage",
    )
}

/// Rank 0: logits from the last rank into the driver's output, until the last rank stops.
/// Each waits at most `idle`; the driver bounds its own wait for a step in flight.
fn logits_in(
    comm: &Comm,
    last: usize,
    idle: std::time::Duration,
    out: &Sender<Result<Output>>,
    recorder: &Mutex<Recorder>,
) -> std::result::Result<(), DistError> {
    loop {
        let msg = receive(
            comm,
            last,
            TAG_LOGITS,
            idle,
            "receive logits from the last stage",
        )?;
        let got = Instant::now();
        let (h, payload) = Header::decode(&msg, last)?;
        match h.kind {
            Kind::Stop => return Ok(()),
            Kind::Work => {
                return Err(DistError::Protocol {
                    peer: last,
                    detail: "activations on the logits link".into(),
                })
            }
            Kind::Logits => {}
        }
        // `seq` counts the pick words in front of the floats (tokens, then non-finite
        // counts: 2 x batch for a decoder's picks, 0 for pooled embeddings).
        let words = h.seq as usize;
        if payload.len() % 4 != 0 || payload.len() < 4 * words || !words.is_multiple_of(2) {
            return Err(DistError::Protocol {
                peer: last,
                detail: format!(
                    "{} bytes of output do not hold {words} pick words and whole f32s",
                    payload.len()
                ),
            });
        }
        let rec = match recorder.lock() {
            Ok(r) if h.record => r.clone(),
            _ => Recorder::disabled(),
        };
        let dep = rec.record_with(got, Instant::now(), || {
            SpanAttrs::wait("mpi recv logits", 0)
                .on_track(Track::Other("mpi recv logits".into()))
                .bytes(payload.len() as u64)
                .microbatch(h.group as u32)
        });
        if !dep.is_none() && h.dep != 0 {
            rec.remote_dep(dep, last as u32, SpanId(h.dep));
        }
        let (picks, floats) = payload.split_at(4 * words);
        let floats: Vec<f32> = bytemuck::pod_collect_to_vec(floats);
        let payload = if words == 0 {
            Payload::Pooled(floats)
        } else {
            let picks: Vec<u32> = bytemuck::pod_collect_to_vec(picks);
            let half = words / 2;
            Payload::Picked(StepOut {
                tokens: picks[..half].to_vec(),
                non_finite: picks[half..].to_vec(),
                logits: (!floats.is_empty()).then_some(floats),
            })
        };
        let output = Output {
            group: h.group as usize,
            batch: h.batch as usize,
            payload,
            dep,
        };
        if out.send(Ok(output)).is_err() {
            return Ok(());
        }
    }
}

/// The last rank: sends one micro-batch's logits to rank 0.
pub(crate) fn send_logits(world: &World, out: &Output, record: bool) -> Result<()> {
    // The picks (as u32 words) in front of the floats; `seq` says how many words.
    let (picks, floats): (Vec<u32>, &[f32]) = match &out.payload {
        Payload::Picked(p) => (
            p.tokens.iter().chain(&p.non_finite).copied().collect(),
            p.logits.as_deref().unwrap_or(&[]),
        ),
        Payload::Pooled(p) => (Vec::new(), p),
    };
    let h = Header {
        kind: Kind::Logits,
        group: out.group as u64,
        batch: out.batch as u64,
        seq: picks.len() as u64,
        past: 0,
        new_cache: false,
        release: false,
        record,
        logits: false,
        dep: out.dep.0,
        run: 0,
        cache: 0,
        slots: 0,
        rows: NO_ROWS,
        copies: 0,
        tables: 0,
    };
    let what = format!("send logits of micro-batch {} to rank 0", out.group);
    send(
        world.p2p(),
        0,
        TAG_LOGITS,
        h.encode(
            &[
                bytemuck::cast_slice::<u32, u8>(&picks),
                bytemuck::cast_slice(floats),
            ]
            .concat(),
        ),
        world.timeout(),
        &what,
    )?;
    Ok(())
}

/// The last rank: tells rank 0 that no more logits come.
pub(crate) fn send_logits_stop(world: &World) -> Result<()> {
    send(
        world.p2p(),
        0,
        TAG_LOGITS,
        Header::stop().encode(&[]),
        world.timeout(),
        "send stop to rank 0",
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header {
            kind: Kind::Work,
            group: 3,
            batch: 2,
            seq: 1,
            past: 17,
            new_cache: false,
            release: true,
            record: true,
            logits: true,
            dep: 99,
            run: 4,
            cache: 5,
            slots: 9,
            rows: NO_ROWS,
            copies: 0,
            tables: 0,
        };
        let msg = h.encode(&[1, 2, 3, 4]);
        let (back, payload) = Header::decode(&msg, 1).unwrap();
        assert_eq!(back, h);
        assert_eq!(payload, &[1, 2, 3, 4]);
        let mut bad = msg.clone();
        bad[0] ^= 1;
        assert!(Header::decode(&bad, 1)
            .unwrap_err()
            .to_string()
            .contains("same wgpar"));
        assert!(Header::decode(&msg[..10], 1).is_err());
        assert!(Header::decode(&msg[..msg.len() - 1], 1).is_err());
    }

    #[test]
    fn sequence_tables_and_kv_copies_travel_ahead_of_the_hidden_states() {
        let rows = [SeqRow { slot: 3, past: 40 }, SeqRow { slot: 0, past: 7 }];
        let copies = [
            KvCopy {
                from: 5,
                to: 3,
                tokens: 39,
            },
            KvCopy {
                from: 1,
                to: 0,
                tokens: 7,
            },
        ];
        let h = Header {
            kind: Kind::Work,
            group: 1,
            batch: 2,
            seq: 1,
            past: 0,
            new_cache: false,
            release: false,
            record: false,
            logits: false,
            dep: 0,
            run: 1,
            cache: usize::MAX as u64,
            slots: 0,
            rows: 2,
            copies: 2,
            tables: 0,
        };
        let tables = [
            SlotTable {
                slot: 3,
                blocks: vec![7, 0, 12],
            },
            SlotTable {
                slot: 1,
                blocks: Vec::new(),
            },
        ];
        let words = tables_words(&tables);
        let h = Header {
            tables: words.len() as u64,
            ..h
        };
        let hidden = [9u8; 8];
        let payload = [
            rows_bytes(Some(&rows)),
            copies_bytes(&copies),
            bytemuck::cast_slice(&words).to_vec(),
            hidden.to_vec(),
        ];
        let msg = h.encode(&payload.concat());
        let (back, payload) = Header::decode(&msg, 0).unwrap();
        let parts = split_work(&back, payload, 0).unwrap();
        assert_eq!(parts.rows.as_deref().map(|t| t.as_slice()), Some(&rows[..]));
        assert_eq!(parts.edits.copies.as_slice(), &copies[..]);
        assert_eq!(parts.edits.tables.as_slice(), &tables[..]);
        assert_eq!(parts.hidden, hidden);
        // A table or copy list longer than the payload is a protocol error, not a panic, and
        // so is a block table longer than its words.
        let lies = [
            Header { rows: 1000, ..h },
            Header { copies: 1000, ..h },
            Header { tables: 1000, ..h },
            Header { tables: 3, ..h },
        ];
        for lying in lies {
            let msg = lying.encode(&hidden);
            let (back, payload) = Header::decode(&msg, 0).unwrap();
            assert!(split_work(&back, payload, 0).is_err());
        }
    }
}
