//! [`Communicator`]: collectives called rank by rank, each from the worker thread that owns the
//! rank's device. The collective itself is the rendezvous: the last rank to arrive runs the
//! operation for everyone (on the same engine as the one-caller API) while the others sleep, and
//! all return its result.
//!
//! Failure handling, so that no rank waits forever:
//! - A rank whose [`RankHandle`] is dropped (its thread returned early or panicked) or that calls
//!   [`Communicator::abort`] aborts the communicator: every rank waiting now, and every later
//!   call, fails at once with [`CommError::Aborted`] naming that rank.
//! - A rank that waits longer than [`CommConfig::rendezvous_timeout`] aborts the communicator
//!   with [`CommError::Timeout`] listing the ranks that never arrived (the guard for a rank that
//!   hangs rather than fails).
//! - A rank that runs the operation and panics aborts the communicator too.
//! - Mismatched calls (different ops, lengths or dtypes across ranks) fail on every rank with
//!   the same error and leave the communicator usable.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::collectives::{check_devices, lock, Collectives};
use super::config::CommConfig;
use super::error::CommError;
use super::pipeline::TensorRef;
use super::stats::{CollectiveOp, CommStats};
use crate::device::{Gpu, Tensor};
use crate::error::Result;

/// What one rank asked for.
enum Request {
    AllReduce(TensorRef),
    AllGather(TensorRef, TensorRef),
    ReduceScatter(TensorRef, TensorRef),
}

impl Request {
    fn op(&self) -> CollectiveOp {
        match self {
            Request::AllReduce(_) => CollectiveOp::AllReduce,
            Request::AllGather(..) => CollectiveOp::AllGather,
            Request::ReduceScatter(..) => CollectiveOp::ReduceScatter,
        }
    }
}

struct Rendezvous {
    /// Sequence number of the collective being gathered.
    seq: u64,
    arrivals: Vec<Option<Request>>,
    arrived: usize,
    /// Outcome of collective `seq - 1`, kept until every rank has read it (no rank can start
    /// the next collective before that).
    result: Option<(u64, std::result::Result<(), CommError>, Instant)>,
    aborted: Option<String>,
    joined: Vec<bool>,
    /// A rank is running collective `seq` for everyone: waiters stop counting their timeout
    /// (the run has its own GPU timeouts).
    running: bool,
}

/// A fixed set of ranks (rank r = device `gpus[r]`) that call collectives from their own
/// threads. Create it once, share it (`Arc`), and give each worker a [`RankHandle`] from
/// [`join`](Self::join).
pub struct Communicator {
    gpus: Vec<Arc<Gpu>>,
    coll: Arc<Collectives>,
    state: Mutex<Rendezvous>,
    cv: Condvar,
    timeout: Duration,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let labels: Vec<&str> = self.gpus.iter().map(|g| g.label()).collect();
        f.debug_struct("Communicator")
            .field("ranks", &labels)
            .finish()
    }
}

impl Communicator {
    /// A communicator over `gpus` (rank r = `gpus[r]`, each its own device) with its own engine.
    pub fn new(gpus: Vec<Arc<Gpu>>, config: CommConfig) -> Result<Arc<Self>> {
        let timeout = config.rendezvous_timeout;
        Self::with_collectives(gpus, Arc::new(Collectives::new(config)?), timeout)
    }

    /// A communicator that shares an existing engine (its staging pools, threads and stats).
    pub fn with_collectives(
        gpus: Vec<Arc<Gpu>>,
        coll: Arc<Collectives>,
        rendezvous_timeout: Duration,
    ) -> Result<Arc<Self>> {
        let refs: Vec<&Gpu> = gpus.iter().map(|g| g.as_ref()).collect();
        check_devices("communicator", "rank", &refs)?;
        let n = gpus.len();
        Ok(Arc::new(Self {
            gpus,
            coll,
            state: Mutex::new(Rendezvous {
                seq: 0,
                arrivals: (0..n).map(|_| None).collect(),
                arrived: 0,
                result: None,
                aborted: None,
                joined: vec![false; n],
                running: false,
            }),
            cv: Condvar::new(),
            timeout: rendezvous_timeout,
        }))
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.gpus.len()
    }

    /// The device of `rank`.
    pub fn gpu(&self, rank: usize) -> Option<&Arc<Gpu>> {
        self.gpus.get(rank)
    }

    /// The engine underneath (for point-to-point transfers and one-caller collectives).
    pub fn collectives(&self) -> &Arc<Collectives> {
        &self.coll
    }

    /// The stats log.
    pub fn stats(&self) -> &Arc<CommStats> {
        self.coll.stats()
    }

    /// The abort reason, if the communicator was aborted.
    pub fn aborted(&self) -> Option<String> {
        lock(&self.state).aborted.clone()
    }

    /// The handle through which `rank`'s worker calls collectives. Dropping it (the thread
    /// ending, or unwinding from a panic) aborts the communicator, which is how the other ranks
    /// learn that this one is gone. One handle per rank.
    pub fn join(self: &Arc<Self>, rank: usize) -> Result<RankHandle> {
        self.check_rank(rank)?;
        let mut st = lock(&self.state);
        if st.joined[rank] {
            return Err(CommError::RankState {
                rank,
                detail: "has already joined: one handle per rank".into(),
            }
            .into());
        }
        st.joined[rank] = true;
        Ok(RankHandle {
            comm: self.clone(),
            rank,
        })
    }

    /// Aborts the communicator on behalf of `rank` (say, after its compute failed): waiting
    /// ranks and later calls fail with `reason`. The first abort's reason is kept.
    pub fn abort(&self, rank: usize, reason: &str) {
        let label = self.gpus.get(rank).map(|g| g.label()).unwrap_or("?");
        self.set_aborted(format!("rank {rank} ({label}): {reason}"));
    }

    fn set_aborted(&self, reason: String) {
        let mut st = lock(&self.state);
        if st.aborted.is_none() {
            st.aborted = Some(reason);
        }
        self.cv.notify_all();
    }

    fn check_rank(&self, rank: usize) -> std::result::Result<(), CommError> {
        if rank >= self.gpus.len() {
            return Err(CommError::RankState {
                rank,
                detail: format!("is outside a communicator of {} ranks", self.gpus.len()),
            });
        }
        Ok(())
    }

    /// Rank `rank`'s part of an in-place all-reduce (sum) of `tensor`, which lives on
    /// `gpu(rank)`. Returns when every rank's tensor holds the sum (uploads queued).
    pub fn all_reduce(&self, rank: usize, tensor: &Tensor) -> Result<()> {
        self.call(rank, Request::AllReduce(TensorRef::of(tensor)))?;
        Ok(())
    }

    /// [`all_reduce`](Self::all_reduce), also returning the instant the last rank arrived and
    /// the operation started: a rank's time before it was waiting for the others, its time
    /// after it was the collective itself.
    pub fn all_reduce_timed(&self, rank: usize, tensor: &Tensor) -> Result<Instant> {
        Ok(self.call(rank, Request::AllReduce(TensorRef::of(tensor)))?)
    }

    /// Rank `rank`'s part of an all-gather: `output` (n x input length) receives every rank's
    /// `input` in rank order.
    pub fn all_gather(&self, rank: usize, input: &Tensor, output: &Tensor) -> Result<()> {
        self.call(
            rank,
            Request::AllGather(TensorRef::of(input), TensorRef::of(output)),
        )?;
        Ok(())
    }

    /// Rank `rank`'s part of a reduce-scatter: `output` receives slice `rank` of the sum of
    /// every rank's `input` (n x output length).
    pub fn reduce_scatter(&self, rank: usize, input: &Tensor, output: &Tensor) -> Result<()> {
        self.call(
            rank,
            Request::ReduceScatter(TensorRef::of(input), TensorRef::of(output)),
        )?;
        Ok(())
    }

    /// Runs `req` once every rank has asked; returns when the last rank arrived.
    fn call(&self, rank: usize, req: Request) -> std::result::Result<Instant, CommError> {
        self.check_rank(rank)?;
        let n = self.gpus.len();
        let op = req.op();
        let mut st = lock(&self.state);
        if let Some(reason) = &st.aborted {
            return Err(CommError::Aborted {
                reason: reason.clone(),
            });
        }
        if st.arrivals[rank].is_some() {
            return Err(CommError::RankState {
                rank,
                detail: format!(
                    "entered {op} while already waiting in a collective (two threads share one \
                     rank?)"
                ),
            });
        }
        let seq = st.seq;
        st.arrivals[rank] = Some(req);
        st.arrived += 1;
        let at = Arrival { rank, op, seq };
        if st.arrived == n {
            self.lead(st, at)
        } else {
            self.follow(st, at)
        }
    }

    /// Last to arrive: runs the collective for everyone and posts its result.
    fn lead(
        &self,
        mut st: MutexGuard<'_, Rendezvous>,
        Arrival { rank, op, seq }: Arrival,
    ) -> std::result::Result<Instant, CommError> {
        let all_arrived = Instant::now();
        let reqs: Vec<Option<Request>> = st.arrivals.iter_mut().map(Option::take).collect();
        st.arrived = 0;
        st.running = true;
        drop(st);
        let mut guard = LeaderGuard {
            comm: self,
            rank,
            op,
            seq,
            done: false,
        };
        let result = self.execute(seq, reqs);
        guard.done = true;
        let mut st = lock(&self.state);
        st.result = Some((seq, result.clone(), all_arrived));
        st.seq += 1;
        st.running = false;
        self.cv.notify_all();
        result.map(|()| all_arrived)
    }

    /// Waits for the leader's result; aborts everyone when the others do not arrive in time.
    fn follow(
        &self,
        mut st: MutexGuard<'_, Rendezvous>,
        Arrival { rank, op, seq }: Arrival,
    ) -> std::result::Result<Instant, CommError> {
        let n = self.gpus.len();
        let deadline = Instant::now() + self.timeout;
        loop {
            if st.seq > seq {
                // The leader posts collective #seq's result before it moves `seq` on, under
                // the same lock, and the next result cannot be posted before this rank arrives
                // again: a missing result is a bug of the rendezvous, not of the caller.
                return match &st.result {
                    Some((s, r, at)) if *s == seq => r.clone().map(|()| *at),
                    _ => Err(CommError::Internal(format!(
                        "the result of {op} #{seq} is missing"
                    ))),
                };
            }
            if let Some(reason) = &st.aborted {
                return Err(CommError::Aborted {
                    reason: reason.clone(),
                });
            }
            let now = Instant::now();
            if st.running {
                // Everyone is here; the run finishes or fails on its own.
                st = match self.cv.wait(st) {
                    Ok(g) => g,
                    Err(poisoned) => poisoned.into_inner(),
                };
                continue;
            }
            if now >= deadline {
                let missing: Vec<usize> = (0..n).filter(|&r| st.arrivals[r].is_none()).collect();
                let err = CommError::Timeout {
                    op: op.name().to_string(),
                    seq,
                    rank,
                    secs: self.timeout.as_secs_f64(),
                    missing,
                };
                st.aborted = Some(err.to_string());
                self.cv.notify_all();
                return Err(err);
            }
            st = match self.cv.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    /// Checks that every rank asked for the same op, then runs it.
    fn execute(&self, seq: u64, reqs: Vec<Option<Request>>) -> std::result::Result<(), CommError> {
        let reqs: Vec<Request> = reqs.into_iter().flatten().collect();
        // The leader runs only once every rank's request is recorded (`arrived == n`, one
        // request per rank, checked in `call`): fewer here is a bug of the rendezvous.
        if reqs.len() != self.gpus.len() {
            return Err(CommError::Internal(format!(
                "{} of {} ranks recorded for collective #{seq}",
                reqs.len(),
                self.gpus.len()
            )));
        }
        let op = reqs[0].op();
        if let Some((r, other)) = reqs.iter().enumerate().find(|(_, q)| q.op() != op) {
            return Err(CommError::mismatch(
                op.name(),
                format!(
                    "collective #{seq}: rank {r} called {} but rank 0 called {}",
                    other.op(),
                    op
                ),
            ));
        }
        let gpus: Vec<&Gpu> = self.gpus.iter().map(|g| g.as_ref()).collect();
        let algo = Some(self.coll.config().algorithm);
        match op {
            CollectiveOp::AllReduce => {
                let ts: Vec<TensorRef> = reqs
                    .into_iter()
                    .filter_map(|q| match q {
                        Request::AllReduce(t) => Some(t),
                        _ => None,
                    })
                    .collect();
                self.coll.all_reduce_refs(&gpus, &ts, algo, "rank")
            }
            _ => {
                let (ins, outs): (Vec<TensorRef>, Vec<TensorRef>) = reqs
                    .into_iter()
                    .filter_map(|q| match q {
                        Request::AllGather(i, o) | Request::ReduceScatter(i, o) => Some((i, o)),
                        _ => None,
                    })
                    .unzip();
                if op == CollectiveOp::AllGather {
                    self.coll.all_gather_refs(&gpus, &ins, &outs, algo, "rank")
                } else {
                    self.coll
                        .reduce_scatter_refs(&gpus, &ins, &outs, algo, "rank")
                }
            }
        }
    }
}

/// Who entered a collective, which one, and its sequence number.
#[derive(Clone, Copy)]
struct Arrival {
    rank: usize,
    op: CollectiveOp,
    seq: u64,
}

/// Aborts the communicator if the rank running a collective unwinds out of it.
struct LeaderGuard<'a> {
    comm: &'a Communicator,
    rank: usize,
    op: CollectiveOp,
    seq: u64,
    done: bool,
}

impl Drop for LeaderGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.comm.abort(
                self.rank,
                &format!("panicked while running {} #{}", self.op, self.seq),
            );
        }
    }
}

/// One rank's membership in a [`Communicator`], owned by that rank's worker thread.
pub struct RankHandle {
    comm: Arc<Communicator>,
    rank: usize,
}

impl std::fmt::Debug for RankHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankHandle")
            .field("rank", &self.rank)
            .finish()
    }
}

impl RankHandle {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This rank's device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.comm.gpus[self.rank]
    }

    /// The communicator.
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.comm
    }

    /// See [`Communicator::all_reduce`].
    pub fn all_reduce(&self, tensor: &Tensor) -> Result<()> {
        self.comm.all_reduce(self.rank, tensor)
    }

    /// See [`Communicator::all_reduce_timed`].
    pub fn all_reduce_timed(&self, tensor: &Tensor) -> Result<Instant> {
        self.comm.all_reduce_timed(self.rank, tensor)
    }

    /// See [`Communicator::all_gather`].
    pub fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.comm.all_gather(self.rank, input, output)
    }

    /// See [`Communicator::reduce_scatter`].
    pub fn reduce_scatter(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.comm.reduce_scatter(self.rank, input, output)
    }

    /// Aborts the communicator with this rank's reason (see [`Communicator::abort`]).
    pub fn abort(&self, reason: &str) {
        self.comm.abort(self.rank, reason);
    }
}

impl Drop for RankHandle {
    fn drop(&mut self) {
        let why = if std::thread::panicking() {
            "its thread panicked"
        } else {
            "left the communicator (its handle was dropped)"
        };
        self.comm.abort(self.rank, why);
    }
}
