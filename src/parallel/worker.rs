//! Worker threads: one per device, each owning its device's model part, fed jobs over a
//! channel. A job that errors or panics comes back as an error naming the worker; it never
//! takes the caller down or leaves it waiting.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;

use crossbeam::channel::{unbounded, Receiver, Sender};

use crate::comm::CommError;
use crate::error::{Result, WgparError};

/// A pool of named worker threads, each running `handle(state, job)` for the jobs sent to it.
pub(crate) struct Workers<J: Send + 'static, R: Send + 'static> {
    senders: Vec<Sender<J>>,
    replies: Receiver<(usize, Result<R>)>,
    threads: Vec<JoinHandle<()>>,
    names: Vec<String>,
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    crate::threads::panic_message(payload)
        .unwrap_or("panicked")
        .to_string()
}

/// Whether `e` is a peer's echo of another rank's failure (its communicator was aborted),
/// rather than a root cause.
fn is_abort_echo(e: &WgparError) -> bool {
    match e {
        WgparError::WorkerFailed { source, .. } => is_abort_echo(source),
        WgparError::Comm(CommError::Aborted { .. }) => true,
        _ => false,
    }
}

impl<J: Send + 'static, R: Send + 'static> Workers<J, R> {
    /// Starts one thread per state. `on_error(state, message)` runs in the worker after a job
    /// fails (e.g. to abort a communicator so peers stop waiting).
    pub fn spawn<S: Send + 'static>(
        states: Vec<(String, S)>,
        handle: fn(&mut S, J) -> Result<R>,
        on_error: fn(&mut S, &str),
    ) -> Result<Self> {
        let (reply_tx, replies) = unbounded();
        let mut senders = Vec::new();
        let mut threads = Vec::new();
        let mut names = Vec::new();
        for (index, (name, mut state)) in states.into_iter().enumerate() {
            let (tx, rx) = unbounded::<J>();
            let reply_tx = reply_tx.clone();
            let thread_name = name.clone();
            let thread = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || {
                    for job in rx.iter() {
                        let outcome = catch_unwind(AssertUnwindSafe(|| handle(&mut state, job)));
                        let result = match outcome {
                            Ok(r) => r,
                            Err(payload) => Err(WgparError::WorkerPanicked {
                                worker: thread_name.clone(),
                                message: panic_message(&*payload),
                            }),
                        };
                        if let Err(e) = &result {
                            on_error(&mut state, &e.to_string());
                        }
                        let failed = result.is_err();
                        if reply_tx.send((index, result)).is_err() || failed {
                            // After a failure the worker's state (device queue, communicator)
                            // is suspect: stop taking jobs; the engine reports the error.
                            break;
                        }
                    }
                })
                .map_err(|e| WgparError::Worker {
                    worker: name.clone(),
                    message: format!("could not start thread: {e}"),
                })?;
            senders.push(tx);
            threads.push(thread);
            names.push(name);
        }
        Ok(Self {
            senders,
            replies,
            threads,
            names,
        })
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.senders.len()
    }

    /// Sends `job` to worker `index`.
    pub fn send(&self, index: usize, job: J) -> Result<()> {
        self.senders[index]
            .send(job)
            .map_err(|_| WgparError::WorkerStopped {
                worker: self.names[index].clone(),
                detail: "its thread ended after an earlier failure".into(),
            })
    }

    /// Waits for one reply from each of `count` workers; returns them by worker index, or the
    /// first error (all replies are still drained, so no worker is left blocked).
    pub fn collect(&self, count: usize) -> Result<Vec<R>> {
        let mut out: Vec<Option<R>> = (0..self.len()).map(|_| None).collect();
        let mut first_error = None;
        for _ in 0..count {
            match self.replies.recv() {
                Ok((i, Ok(r))) => out[i] = Some(r),
                Ok((i, Err(e))) => {
                    let e = match e {
                        WgparError::WorkerPanicked { .. } | WgparError::WorkerFailed { .. } => e,
                        other => WgparError::WorkerFailed {
                            worker: self.names[i].clone(),
                            source: Box::new(other),
                        },
                    };
                    // Prefer the root cause over the peers' "aborted" echoes.
                    let is_echo = is_abort_echo(&e);
                    match &first_error {
                        None => first_error = Some(e),
                        Some(prev) if is_abort_echo(prev) && !is_echo => first_error = Some(e),
                        _ => {}
                    }
                }
                Err(_) => {
                    first_error.get_or_insert(WgparError::WorkerStopped {
                        worker: "every worker".into(),
                        detail: "no reply came back".into(),
                    });
                    break;
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(out.into_iter().flatten().collect())
    }
}

impl<J: Send + 'static, R: Send + 'static> Drop for Workers<J, R> {
    fn drop(&mut self) {
        // Closing the channels ends each worker's job loop; then every thread is joined.
        self.senders.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
