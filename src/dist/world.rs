//! The MPI job as wgpar sees it: this rank, its peers, their hosts, one clock origin, and the
//! failure protocol (a failed rank tells every peer, which stop at once naming it).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::environment::Universe;
use mpi::request::StaticScope;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;

use super::error::DistError;

/// Tag of failure notices on the control communicator.
const TAG_FAIL: i32 = 1;
/// Longest failure message sent to peers (small enough for MPI's eager protocol).
const FAIL_TEXT_MAX: usize = 1500;

/// A communicator handle shared by threads.
pub(crate) struct Comm(Option<SimpleCommunicator>);

// SAFETY: `World::init` requires MPI_THREAD_MULTIPLE, under which MPI allows any thread to call
// any MPI function on any communicator concurrently; the handle itself is an immutable
// identifier (a pointer Open MPI never moves while the communicator lives).
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

impl Comm {
    pub(crate) fn get(&self) -> &SimpleCommunicator {
        // Only `Drop` takes the handle out.
        self.0.as_ref().expect("communicator used after drop")
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Freeing after MPI_Finalize is an error: a handle that outlived the job is let go.
        if let Some(c) = self.0.take() {
            if mpi::environment::is_finalized() {
                std::mem::forget(c);
            }
        }
    }
}

/// This process's place in the MPI job.
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    host: String,
    hosts: Vec<String>,
    timeout: Duration,
    /// How long a link waits for the next pass when none is in flight (a server idles
    /// between requests; a run never does): `timeout` unless a server says otherwise.
    idle_timeout: Duration,
    /// The job serves requests (see [`serve_requests`](Self::serve_requests)).
    serving: bool,
    epoch: Instant,
    epoch_unix_us: f64,
    control: Arc<Comm>,
    p2p: Arc<Comm>,
    coll: Arc<Comm>,
    world: Comm,
    stop: Arc<AtomicBool>,
    /// What the watchdog does before it ends this process at a peer's failure (a server
    /// fails its requests first).
    on_failure: Arc<Mutex<Option<FailureHook>>>,
    watchdog: Option<JoinHandle<()>>,
    // Declared last: dropped (MPI_Finalize) after every communicator.
    universe: Option<Universe>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("host", &self.host)
            .finish()
    }
}

impl World {
    /// Initialises MPI (thread level MULTIPLE), learns every rank's host, aligns a clock origin
    /// at a barrier, and starts the watchdog that stops this process when a peer reports a
    /// failure. `timeout` bounds every wait on a peer.
    pub fn init(timeout: Duration) -> Result<Self, DistError> {
        let (universe, provided) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| DistError::Init("MPI was already initialised".into()))?;
        if provided != Threading::Multiple {
            return Err(DistError::ThreadLevel {
                provided: format!("{provided:?}"),
            });
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        let size = world.size() as usize;
        let host = mpi::environment::processor_name()
            .unwrap_or_else(|_| "?".into())
            .trim()
            .to_string();
        let hosts = gather_strings_all(&world, &host);
        let local_rank = hosts[..rank].iter().filter(|h| **h == host).count();
        let control = Arc::new(Comm(Some(world.duplicate())));
        let p2p = Arc::new(Comm(Some(world.duplicate())));
        let coll = Arc::new(Comm(Some(world.duplicate())));
        // The clock origin: every rank leaves this barrier at (nearly) the same instant, so
        // times measured from it line up across ranks (to the barrier's skew, microseconds on
        // one machine, tens of microseconds over a network).
        world.barrier();
        let epoch = Instant::now();
        let epoch_unix_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64() * 1e6)
            .unwrap_or(0.0);
        let stop = Arc::new(AtomicBool::new(false));
        let on_failure = Arc::new(Mutex::new(None));
        let watchdog = {
            let control = control.clone();
            let stop = stop.clone();
            let hosts = hosts.clone();
            let hook = on_failure.clone();
            std::thread::Builder::new()
                .name("mpi-watchdog".into())
                .spawn(move || watch(&control, (&stop, &hook), &hosts, rank))
                .map_err(|e| DistError::Init(format!("could not start the watchdog: {e}")))?
        };
        Ok(Self {
            rank,
            size,
            local_rank,
            host,
            hosts,
            timeout,
            idle_timeout: timeout,
            serving: false,
            epoch,
            epoch_unix_us,
            control,
            p2p,
            coll,
            world: Comm(Some(world)),
            stop,
            on_failure,
            watchdog: Some(watchdog),
            universe: Some(universe),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank among the ranks on its host (by processor name).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// This rank's host name.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Every rank's host name, by rank.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// How long any wait on a peer may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How long a stage link waits for the next pass between passes (see
    /// [`serve_requests`](Self::serve_requests)).
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// Runs `hook` (with the failure's message) when a peer reports a failure, and ends this
    /// process `grace` later instead of at once: a server fails its requests in flight with
    /// that message first. Replaces an earlier hook.
    pub fn on_peer_failure(&self, hook: Box<dyn FnOnce(String) + Send>, grace: Duration) {
        *crate::threads::lock(&self.on_failure) = Some(FailureHook { hook, grace });
    }

    /// Marks the job a server: the stage links of engines built from now on wait without
    /// limit for the next pass, as a server's do between requests, and rank 0's pipeline
    /// fails its steps in flight when a peer fails. Waits within a pass keep the timeout: a
    /// step whose output does not come is still an error after it (the driver's own wait).
    pub fn serve_requests(&mut self) {
        // About 136 years: no deadline a server reaches, and no overflow adding it to now.
        self.idle_timeout = Duration::from_secs(u64::from(u32::MAX));
        self.serving = true;
    }

    /// Whether the job serves requests.
    pub fn serving(&self) -> bool {
        self.serving
    }

    /// The instant this rank left the start-up barrier: the common clock origin of the job.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Wall-clock time of [`epoch`](Self::epoch), microseconds since the Unix epoch (for a
    /// reader comparing traces of separate runs; the alignment itself uses the barrier).
    pub fn epoch_unix_us(&self) -> f64 {
        self.epoch_unix_us
    }

    pub(crate) fn p2p(&self) -> &Arc<Comm> {
        &self.p2p
    }

    pub(crate) fn coll(&self) -> &Arc<Comm> {
        &self.coll
    }

    /// Blocks until every rank arrives.
    pub fn barrier(&self) {
        self.world.get().barrier();
    }

    /// `text` of every rank, on rank 0 (other ranks get an empty list).
    pub fn gather_to_root(&self, text: &str) -> Vec<String> {
        let all = gather_strings_all(self.world.get(), text);
        if self.rank == 0 {
            all
        } else {
            Vec::new()
        }
    }

    /// Every rank's `text`, on every rank.
    pub fn all_gather(&self, text: &str) -> Vec<String> {
        gather_strings_all(self.world.get(), text)
    }

    /// Rank 0's `bytes`, on every rank (others pass anything; it is replaced).
    pub fn broadcast_bytes(&self, bytes: &mut Vec<u8>) {
        let root = self.world.get().process_at_rank(0);
        let mut len = bytes.len() as u64;
        root.broadcast_into(&mut len);
        bytes.resize(len as usize, 0);
        root.broadcast_into(&mut bytes[..]);
    }

    /// Waits until every rank arrives, like [`barrier`](Self::barrier), but polls a
    /// non-blocking barrier with `backoff` instead of spinning a core in MPI (what a rank that
    /// waits while others measure must not do), for at most `timeout`.
    pub fn barrier_with(
        &self,
        what: &str,
        backoff: Backoff,
        timeout: Duration,
    ) -> Result<(), DistError> {
        let mut req = Some(self.world.get().immediate_barrier());
        let r = poll_with(
            backoff,
            Instant::now() + timeout,
            || match req.take()?.test() {
                Ok(_) => Some(()),
                Err(r) => {
                    req = Some(r);
                    None
                }
            },
            || DistError::CollectiveTimeout {
                what: what.into(),
                ranks: self.size,
                secs: timeout.as_secs_f64(),
            },
        );
        if let Some(r) = req.take() {
            // A barrier whose peer is gone never completes: let it go (the job ends).
            std::mem::forget(r);
        }
        r
    }

    /// Every rank's `values` (the same length on every rank), on every rank, rank by rank.
    pub fn all_gather_f64(&self, values: &[f64]) -> Vec<Vec<f64>> {
        let n = values.len();
        let mut all = vec![0.0f64; n * self.size];
        if n > 0 {
            self.world.get().all_gather_into(values, &mut all[..]);
        }
        (0..self.size)
            .map(|r| all[r * n..(r + 1) * n].to_vec())
            .collect()
    }

    /// Checks that every rank has the same `value` of `what` (model, options, version).
    pub fn check_same(&self, what: &str, value: &str) -> Result<(), DistError> {
        let all = self.all_gather(value);
        if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| **v != all[0]) {
            return Err(DistError::Mismatch {
                detail: format!(
                    "{what}: rank 0 ({}) has '{}' but rank {r} ({}) has '{v}'",
                    self.hosts[0], all[0], self.hosts[r]
                ),
            });
        }
        Ok(())
    }

    /// Reports this rank's failure to every peer (their watchdogs stop them, naming this rank),
    /// then gives them `grace` to exit before aborting the job. Never returns.
    pub fn fail(&self, message: &str) -> ! {
        let mut text = message.as_bytes().to_vec();
        text.truncate(FAIL_TEXT_MAX);
        let control = self.control.get();
        let deadline = Instant::now() + Duration::from_secs(2);
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            // Leaked on purpose: the process ends below, and a request whose peer died may
            // never complete.
            let buf: &'static [u8] = Box::leak(text.clone().into_boxed_slice());
            let mut req = control
                .process_at_rank(peer as i32)
                .immediate_send_with_tag(StaticScope, buf, TAG_FAIL);
            loop {
                match req.test() {
                    Ok(_) => break,
                    Err(r) => req = r,
                }
                if Instant::now() > deadline {
                    std::mem::forget(req);
                    break;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        // The peers exit non-zero as soon as they read the notice, and the launcher then ends
        // this process; if they cannot (hung in a driver call), abort the whole job.
        std::thread::sleep(Duration::from_secs(3));
        self.world.get().abort(1)
    }

    /// Leaves the job cleanly: stops the watchdog, waits for every rank, finalises MPI.
    pub fn finish(mut self) {
        self.world.get().barrier();
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.shutdown();
        // Communicators are freed before the universe finalises MPI (field order), unless a
        // thread still holds one (then `Comm::drop` lets it go after finalisation).
        let _ = self.universe.as_ref();
    }
}

/// The watchdog: polls for failure notices and ends this process at the first, naming the
/// failed rank (exit status 1).
/// What to do at a peer's failure before this process ends, and how long to give it.
struct FailureHook {
    hook: Box<dyn FnOnce(String) + Send>,
    grace: Duration,
}

fn watch(
    control: &Comm,
    (stop, on_failure): (&AtomicBool, &Mutex<Option<FailureHook>>),
    hosts: &[String],
    rank: usize,
) {
    let comm = control.get();
    while !stop.load(Ordering::Acquire) {
        if let Some(probed) = comm
            .any_process()
            .immediate_matched_probe_with_tag(TAG_FAIL)
        {
            let (text, status) = probed.matched_receive_vec::<u8>();
            let peer = status.source_rank() as usize;
            let err = DistError::PeerFailed {
                rank: peer,
                host: hosts.get(peer).cloned().unwrap_or_else(|| "?".into()),
                message: String::from_utf8_lossy(&text).into_owned(),
            };
            super::launch::stderr_line(&format!("error: rank {rank}: stopping: {err}"));
            if let Some(FailureHook { hook, grace }) = crate::threads::lock(on_failure).take() {
                hook(err.to_string());
                std::thread::sleep(grace);
            }
            std::process::exit(1);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Every rank's string, on every rank (lengths first, then the bytes).
fn gather_strings_all(comm: &SimpleCommunicator, text: &str) -> Vec<String> {
    let n = comm.size() as usize;
    let len = text.len() as u64;
    let mut lens = vec![0u64; n];
    comm.all_gather_into(&len, &mut lens[..]);
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    if max == 0 {
        // Every rank's text is empty, and MPI refuses a gather of nothing.
        return vec![String::new(); n];
    }
    let mut padded = text.as_bytes().to_vec();
    padded.resize(max, 0);
    let mut all = vec![0u8; max * n];
    comm.all_gather_into(&padded[..], &mut all[..]);
    (0..n)
        .map(|r| {
            let s = &all[r * max..r * max + lens[r] as usize];
            String::from_utf8_lossy(s).into_owned()
        })
        .collect()
}

/// How a waiting thread polls a non-blocking MPI request. Open MPI's blocking calls spin a
/// core at 100 % (they poll the shared-memory segment), and on a machine whose cores also run
/// the devices' drivers (a CPU driver, or the host side of a GPU driver) every core a waiting
/// rank takes is taken from a computing one, so wgpar polls non-blocking requests: it yields
/// while a wait is short (a hand-off in flight), then sleeps between polls.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// How long the wait yields between polls before it starts sleeping.
    pub spin: Duration,
    /// Shortest sleep between polls.
    pub min_sleep: Duration,
    /// Longest sleep between polls.
    pub max_sleep: Duration,
    /// Once sleeping, each sleep is this fraction of the time waited so far (between the two
    /// bounds): the lateness it adds is bounded by that fraction of the wait, while a long
    /// idle wait wakes up a few hundred times a second instead of thousands.
    pub fraction: f64,
}

impl Backoff {
    /// What every wait of the runtime uses: yield for 200 us, then sleep 50 us between polls
    /// (which the kernel stretches to about 100 us). Measured against [`Backoff::SPARSE`] by
    /// `wgpar calibrate` under mpirun (docs/BENCHMARKS.md, "Ranks over MPI"): a waiting rank's
    /// polling did not measurably slow a computing one, and keeps the cores awake, which
    /// speeds up small dispatches on a CPU driver, while sparser polls noticed a message twice
    /// as late.
    pub const RUNTIME: Self = Self {
        spin: Duration::from_micros(200),
        min_sleep: Duration::from_micros(50),
        max_sleep: Duration::from_micros(50),
        fraction: 0.0,
    };

    /// A sparser schedule, measured for comparison: yield for 200 us, then sleep 1/16 of the
    /// time waited so far, 50 to 200 us.
    pub const SPARSE: Self = Self {
        spin: Duration::from_micros(200),
        min_sleep: Duration::from_micros(50),
        max_sleep: Duration::from_micros(200),
        fraction: 1.0 / 16.0,
    };

    /// The pause after a poll that found nothing, `waited` into the wait.
    pub fn pause(&self, waited: Duration) -> Option<Duration> {
        if waited < self.spin {
            return None;
        }
        Some(
            waited
                .mul_f64(self.fraction)
                .clamp(self.min_sleep, self.max_sleep),
        )
    }
}

/// Polls `done` until it returns `Some`, backing off as [`Backoff::RUNTIME`] says, or fails
/// with `timeout` (non-blocking requests polled against a deadline, never a blocking wait).
pub(crate) fn poll_until<T>(
    deadline: Instant,
    done: impl FnMut() -> Option<T>,
    timeout: impl FnOnce() -> DistError,
) -> Result<T, DistError> {
    poll_with(Backoff::RUNTIME, deadline, done, timeout)
}

/// [`poll_until`] with a given back-off.
pub(crate) fn poll_with<T>(
    backoff: Backoff,
    deadline: Instant,
    mut done: impl FnMut() -> Option<T>,
    timeout: impl FnOnce() -> DistError,
) -> Result<T, DistError> {
    let start = Instant::now();
    loop {
        if let Some(v) = done() {
            return Ok(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(timeout());
        }
        match backoff.pause(now - start) {
            None => std::thread::yield_now(),
            Some(d) => std::thread::sleep(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_yields_then_sleeps_a_bounded_fraction_of_the_wait() {
        let b = Backoff::SPARSE;
        assert_eq!(b.pause(Duration::from_micros(100)), None);
        assert_eq!(
            b.pause(Duration::from_micros(300)),
            Some(Duration::from_micros(50))
        );
        assert_eq!(
            b.pause(Duration::from_micros(2400)),
            Some(Duration::from_micros(150))
        );
        assert_eq!(
            b.pause(Duration::from_secs(3)),
            Some(Duration::from_micros(200))
        );
        assert_eq!(
            Backoff::RUNTIME.pause(Duration::from_secs(3)),
            Some(Duration::from_micros(50))
        );
    }
}
