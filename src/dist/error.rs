//! Errors of running as MPI ranks.

use thiserror::Error;

/// What went wrong between ranks (or in setting them up).
#[derive(Debug, Error)]
pub enum DistError {
    /// wgpar runs under an MPI launcher but was built without the `mpi` feature: running N
    /// independent copies would be wrong, so it refuses.
    #[error(
        "wgpar was started by {launcher} as rank {rank} of {size}, but this binary was built \
         without MPI support: rebuild with `cargo build --release --features mpi` (needs Open \
         MPI with its headers, libclang and pkg-config), or run it without mpirun"
    )]
    NotBuilt {
        /// The launcher the environment names (e.g. `Open MPI (OMPI_COMM_WORLD_SIZE)`).
        launcher: String,
        /// This process's rank.
        rank: usize,
        /// Ranks in the job.
        size: usize,
    },
    /// `--mpi` was given to a binary built without the `mpi` feature.
    #[error("--mpi needs a wgpar built with `--features mpi`")]
    FeatureMissing,
    /// MPI could not be initialised.
    #[error("MPI initialisation failed: {0}")]
    Init(String),
    /// The MPI library does not give the thread support wgpar needs.
    #[error(
        "the MPI library provides thread level {provided}, wgpar needs MPI_THREAD_MULTIPLE \
         (the pipeline's link threads and the engines call MPI concurrently)"
    )]
    ThreadLevel {
        /// What the library provided.
        provided: String,
    },
    /// Another rank failed; this one stops.
    #[error("rank {rank} ({host}) failed: {message}")]
    PeerFailed {
        /// The failed rank.
        rank: usize,
        /// Its host.
        host: String,
        /// Its error.
        message: String,
    },
    /// A message or collective did not complete in time.
    #[error(
        "{what}: nothing from rank {peer} within {secs:.1} s (is it alive? raise --mpi-timeout \
         for slow ranks)"
    )]
    Timeout {
        /// The operation, e.g. `receive activations of micro-batch 3`.
        what: String,
        /// The rank that was waited for.
        peer: usize,
        /// The limit that passed.
        secs: f64,
    },
    /// A collective over every rank did not complete in time.
    #[error(
        "{what}: the collective over {ranks} ranks did not complete within {secs:.1} s (a rank \
         is stuck or gone; raise --mpi-timeout for slow ranks)"
    )]
    CollectiveTimeout {
        /// The operation.
        what: String,
        /// Ranks taking part.
        ranks: usize,
        /// The limit that passed.
        secs: f64,
    },
    /// A message that does not follow the protocol (a bug, or binaries of different versions).
    #[error("malformed message from rank {peer}: {detail}")]
    Protocol {
        /// The sender.
        peer: usize,
        /// What was wrong.
        detail: String,
    },
    /// The ranks disagree about something they must share (model, options, version).
    #[error("ranks disagree: {detail}")]
    Mismatch {
        /// What differs, with each side's value.
        detail: String,
    },
    /// A layout of ranks and devices that the strategy cannot run.
    #[error("{0}")]
    Layout(String),
    /// An option that does not apply to a run across ranks.
    #[error("{option} is not supported across MPI ranks: {why}")]
    Unsupported {
        /// The option.
        option: String,
        /// Why, and what to do instead.
        why: String,
    },
}
