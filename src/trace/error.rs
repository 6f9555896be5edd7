//! Errors from reading, writing and checking timelines.

use std::path::PathBuf;

use super::span::SpanId;

/// Everything that can go wrong with a timeline or a trace file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The trace file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid JSON, or its `wgpar` block does not have the expected shape.
    #[error("{file}:{line}:{column}: {message}")]
    Json {
        /// File name (or `<string>`).
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What serde_json reported.
        message: String,
    },
    /// Valid JSON, but not written by wgpar: the lossless `wgpar` block is missing.
    #[error(
        "{file}: no top-level \"wgpar\" key; only Chrome traces written by wgpar can be replayed"
    )]
    NotWgpar {
        /// File name.
        file: String,
    },
    /// The trace was written by an incompatible version of the format.
    #[error("{file}: trace format version {found}, this build reads version {expected}")]
    Version {
        /// File name.
        file: String,
        /// Version in the file.
        found: u32,
        /// Version this build writes and reads.
        expected: u32,
    },
    /// Two spans share an id.
    #[error("span id {id} appears more than once")]
    DuplicateId {
        /// The repeated id.
        id: SpanId,
    },
    /// A span depends on an id that is not in the timeline.
    #[error("span {span} ({name}) depends on {dep}, which is not in the timeline")]
    UnknownDependency {
        /// The dependent span.
        span: SpanId,
        /// Its name.
        name: String,
        /// The missing dependency.
        dep: SpanId,
    },
    /// A span depends on itself or on a later span.
    #[error("span {span} ({name}) depends on {dep}, which is not recorded before it")]
    ForwardDependency {
        /// The dependent span.
        span: SpanId,
        /// Its name.
        name: String,
        /// The dependency with an id not smaller than the span's.
        dep: SpanId,
    },
    /// A span's numbers are so large that its end time, or the timeline's byte or FLOP
    /// totals, would not fit in 64 bits: not a recorded run.
    #[error("span {span} ({name}): {what} overflows 64 bits; the trace was not recorded by a run")]
    Overflow {
        /// The span.
        span: SpanId,
        /// Its name.
        name: String,
        /// What overflowed, with the span's number.
        what: String,
    },
    /// A compute span's head part is larger than the span's own work.
    #[error(
        "span {span} ({name}): its head part ({head_flops} FLOPs, {head_bytes} B) exceeds the span's work ({flops} FLOPs, {bytes} B)"
    )]
    HeadExceedsSpan {
        /// The span.
        span: SpanId,
        /// Its name.
        name: String,
        /// The head's FLOPs.
        head_flops: u64,
        /// The head's bytes.
        head_bytes: u64,
        /// The span's FLOPs.
        flops: u64,
        /// The span's bytes.
        bytes: u64,
    },
}
