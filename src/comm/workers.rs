//! Persistent host threads that share the host-side step of a collective (the reduction or the
//! copies between staging buffers).
//!
//! Threads are started once per [`Collectives`](super::Collectives): starting one per chunk
//! costs tens of microseconds on a busy machine, as much as reducing a 1 MiB chunk. Jobs own
//! what they touch (mapped views hold their buffer), so no borrowed data crosses threads.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;

use crossbeam::channel::{bounded, unbounded, Receiver, Sender};

/// A piece of host work.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// `host_threads - 1` worker threads; the calling thread is the last worker.
pub(crate) struct HostWorkers {
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<(), String>>,
    handles: Vec<JoinHandle<()>>,
}

impl HostWorkers {
    /// Starts `threads - 1` workers (none when `threads <= 1`).
    pub(crate) fn start(threads: usize) -> Self {
        let (jobs_tx, jobs_rx) = unbounded::<Job>();
        let (done_tx, done_rx) = bounded(threads.max(1));
        let handles = (1..threads.max(1))
            .filter_map(|i| {
                let jobs = jobs_rx.clone();
                let done = done_tx.clone();
                std::thread::Builder::new()
                    .name(format!("wgpar-comm-{i}"))
                    .spawn(move || worker(jobs, done))
                    .ok()
            })
            .collect();
        Self {
            jobs: Some(jobs_tx),
            done: done_rx,
            handles,
        }
    }

    /// Threads available to one call, the caller included.
    pub(crate) fn threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// Runs every job, the first on the calling thread, and returns once all are done. A job that
    /// panics turns into an error instead of taking the caller down.
    pub(crate) fn run(&self, mut jobs: Vec<Job>) -> Result<(), String> {
        if jobs.is_empty() {
            return Ok(());
        }
        let mine = jobs.remove(0);
        let mut sent = 0;
        if let Some(tx) = &self.jobs {
            for job in jobs.drain(..) {
                match tx.send(job) {
                    Ok(()) => sent += 1,
                    // No worker left: run it here.
                    Err(e) => run_guarded(e.0)?,
                }
            }
        }
        for job in jobs {
            run_guarded(job)?;
        }
        let mut result = run_guarded(mine);
        for _ in 0..sent {
            match self.done.recv() {
                Ok(r) => result = result.and(r),
                Err(_) => return Err("a host worker thread exited".into()),
            }
        }
        result
    }
}

fn run_guarded(job: Job) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(job)).map_err(|p| panic_message(&*p))
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    match crate::threads::panic_message(p) {
        Some(s) => format!("host step panicked: {s}"),
        None => "host step panicked".into(),
    }
}

fn worker(jobs: Receiver<Job>, done: Sender<Result<(), String>>) {
    while let Ok(job) = jobs.recv() {
        if done.send(run_guarded(job)).is_err() {
            break;
        }
    }
}

impl Drop for HostWorkers {
    fn drop(&mut self) {
        // Closing the job channel ends every worker loop.
        self.jobs = None;
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn runs_every_job_and_reports_panics() {
        let w = HostWorkers::start(3);
        assert_eq!(w.threads(), 3);
        let count = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<Job> = (0..5)
            .map(|_| {
                let c = count.clone();
                Box::new(move || {
                    c.fetch_add(1, Ordering::SeqCst);
                }) as Job
            })
            .collect();
        w.run(jobs).unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 5);
        let bad: Vec<Job> = vec![Box::new(|| {}), Box::new(|| panic!("boom"))];
        let e = w.run(bad).unwrap_err();
        assert!(e.contains("boom"), "{e}");
        // Still usable afterwards.
        w.run(vec![Box::new(|| {}), Box::new(|| {})]).unwrap();
    }
}
