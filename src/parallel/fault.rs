//! Faults to inject into an engine's workers (tests, `run --inject-fault`): how a pipeline
//! stage or a tensor-parallel rank fails, and after how many jobs.

/// A failure to inject into a stage (for tests and demos of the failure path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The stage's job returns an error.
    Error,
    /// The stage's job panics.
    Panic,
    /// The stage's device is destroyed (device loss).
    LoseDevice,
}

/// When and how a stage fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Jobs the worker runs before failing, counted from its start: micro-batches for a
    /// pipeline stage, steps for a tensor-parallel rank.
    pub after: usize,
    /// What happens.
    pub kind: FaultKind,
}
