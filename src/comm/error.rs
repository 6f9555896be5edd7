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
    /// A tensor larger than a device lets the operation bind at once (the f16 link converts a
    /// whole tensor in one storage binding): a device limit met while running.
    #[error(
        "{op}: a tensor of {bytes} B exceeds the storage binding limit of {device} ({limit} B); \
         use the native link"
    )]
    TooLarge {
        /// The operation.
        op: String,
        /// Bytes the tensor holds.
        bytes: u64,
        /// The device's storage binding limit, bytes.
        limit: u64,
        /// Device description.
        device: String,
    },
    /// An invariant of the comm layer itself broke (a bug in wgpar): the rendezvous lost a
    /// rank's request or a posted result.
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
            CommError::TooLarge {
                op,
                bytes,
                limit,
                device,
            } => WgparError::TooLarge {
                what: format!("{op} (use the native link)"),
                bytes,
                limit,
                kind: "storage binding",
                adapter: device,
            },
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
        let bug: WgparError =
            CommError::Internal("the result of all_reduce #3 is missing".into()).into();
        assert!(matches!(bug, WgparError::Internal(_)));
        assert_eq!(bug.exit_code(), crate::error::EXIT_INTERNAL);
        // A tensor on another device than the one it was handed over with: the caller's bug.
        let wrong: WgparError = CommError::WrongDevice {
            op: "all_reduce".into(),
            index: 1,
            device: "gpu1".into(),
            detail: "buffer doesn't match device".into(),
        }
        .into();
        assert_eq!(wrong.exit_code(), crate::error::EXIT_INTERNAL, "{wrong}");
        // Device limits and failures while running are neither usage nor internal errors.
        let limit: WgparError = CommError::TooLarge {
            op: "all_reduce (f16 link)".into(),
            bytes: 3 << 30,
            limit: 128 << 20,
            device: "gpu0 (llvmpipe)".into(),
        }
        .into();
        assert_eq!(limit.exit_code(), crate::error::EXIT_FAILURE, "{limit}");
        let aborted: WgparError = CommError::Aborted {
            reason: "rank 1 left".into(),
        }
        .into();
        assert_eq!(aborted.exit_code(), crate::error::EXIT_FAILURE, "{aborted}");
    }

    #[test]
    fn too_large_names_both_sizes_and_the_way_out() {
        let e: WgparError = CommError::TooLarge {
            op: "all_reduce (f16 link)".into(),
            bytes: 3 << 30,
            limit: 128 << 20,
            device: "gpu0 (llvmpipe)".into(),
        }
        .into();
        let text = e.to_string();
        assert!(
            text.contains("3.0 GiB")
                && text.contains("128.0 MiB")
                && text.contains("storage binding")
                && text.contains("native link")
                && text.contains("gpu0 (llvmpipe)"),
            "{text}"
        );
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
