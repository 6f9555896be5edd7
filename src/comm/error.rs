//! Errors of the comm layer. They are `Clone` so that one failure can be handed to every rank of
//! a rank-per-thread collective; each converts into a [`WgparError`] at the public boundary.

use thiserror::Error;

use crate::error::WgparError;

/// What went wrong in a transfer or collective.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CommError {
    /// Tensors that do not fit together (lengths, dtypes, counts of participants).
    #[error("{op}: {detail}")]
    Mismatch {
        /// The operation, e.g. `all_reduce`.
        op: String,
        /// What did not fit, with the numbers.
        detail: String,
    },
    /// A tensor was handed over with a `Gpu` it does not belong to.
    #[error("{op}: tensor {index} is not on {device}: {detail}")]
    WrongDevice {
        /// The operation.
        op: String,
        /// Position of the tensor in the call (or the rank).
        index: usize,
        /// The device it was said to live on.
        device: String,
        /// The driver's account of the mismatch.
        detail: String,
    },
    /// An option value the user gave (a size, a dtype, a chunk, a link precision) that the
    /// comm layer refuses: a usage error.
    #[error("{0}")]
    Config(String),
    /// A call that does not fit a rank's state in the communicator (a rank outside it, joined
    /// twice, or entering a collective while already in one): the calling program's threads
    /// and ranks disagree, not an option.
    #[error("rank {rank}: {detail}")]
    RankState {
        /// The rank the call named.
        rank: usize,
        /// What its state is, and what the call needed.
        detail: String,
    },
    /// An invariant of the comm layer itself broke (a bug in wgpar).
    #[error("{0}")]
    Internal(String),
    /// wgpu reported an error while the comm layer was using a device.
    #[error("{op} on {device}: {message}")]
    Gpu {
        /// The operation.
        op: String,
        /// Device description.
        device: String,
        /// wgpu's message.
        message: String,
    },
    /// A device did not finish a transfer in time.
    #[error("{op} on {device}: the GPU did not finish within {secs:.1} s")]
    GpuTimeout {
        /// The operation.
        op: String,
        /// Device description.
        device: String,
        /// The limit that passed.
        secs: f64,
    },
    /// The communicator was aborted: a rank failed, left or timed out. Every later call fails.
    #[error("communicator aborted: {reason}")]
    Aborted {
        /// Why, naming the rank.
        reason: String,
    },
    /// A rank waited longer than the rendezvous timeout for the others.
    #[error(
        "{op} #{seq}: rank {rank} waited {secs:.1} s for rank(s) {missing:?} to arrive; \
         aborting the communicator"
    )]
    Timeout {
        /// The operation.
        op: String,
        /// Collective sequence number.
        seq: u64,
        /// The rank that gave up.
        rank: usize,
        /// Seconds waited.
        secs: f64,
        /// The ranks that never arrived.
        missing: Vec<usize>,
    },
}

impl CommError {
    pub(crate) fn mismatch(op: &str, detail: impl Into<String>) -> Self {
        Self::Mismatch {
            op: op.to_string(),
            detail: detail.into(),
        }
    }

    pub(crate) fn gpu(op: &str, device: &str, message: impl Into<String>) -> Self {
        Self::Gpu {
            op: op.to_string(),
            device: device.to_string(),
            message: message.into(),
        }
    }
}

impl From<CommError> for WgparError {
    fn from(e: CommError) -> Self {
        match e {
            CommError::Mismatch { op, detail } => WgparError::Shape { op, detail },
            CommError::Config(message) => WgparError::option("collective options", message),
            CommError::Internal(message) => WgparError::Internal(message),
            CommError::Gpu {
                op,
                device,
                message,
            } => WgparError::Gpu {
                device,
                message: format!("{op}: {message}"),
            },
            // Run-time failures keep their typed cause.
            e @ (CommError::WrongDevice { .. }
            | CommError::RankState { .. }
            | CommError::GpuTimeout { .. }
            | CommError::Aborted { .. }
            | CommError::Timeout { .. }) => WgparError::Comm(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_becomes_shape_error_with_numbers() {
        let e: WgparError =
            CommError::mismatch("all_reduce", "tensor 1 has 7 elements, tensor 0 has 8").into();
        let text = e.to_string();
        assert!(text.contains("all_reduce") && text.contains('7') && text.contains('8'));
        assert!(matches!(e, WgparError::Shape { .. }));
    }

    #[test]
    fn runtime_states_are_not_usage_errors() {
        let option: WgparError = CommError::Config("--chunk 0: must be positive".into()).into();
        assert_eq!(option.exit_code(), 2, "{option}");
        let state: WgparError = CommError::RankState {
            rank: 1,
            detail: "has already joined".into(),
        }
        .into();
        assert!(matches!(
            state,
            WgparError::Comm(CommError::RankState { rank: 1, .. })
        ));
        assert_eq!(state.exit_code(), crate::error::EXIT_INTERNAL, "{state}");
        let bug: WgparError = CommError::Internal("pool not locked".into()).into();
        assert!(matches!(bug, WgparError::Internal(_)));
        assert_eq!(bug.exit_code(), crate::error::EXIT_INTERNAL);
    }

    #[test]
    fn abort_keeps_its_typed_cause() {
        let e: WgparError = CommError::Aborted {
            reason: "rank 2 (gpu2) panicked".into(),
        }
        .into();
        assert!(matches!(e, WgparError::Comm(CommError::Aborted { .. })));
        assert!(e.to_string().contains("rank 2"));
    }
}
