//! Errors from projecting a timeline onto a profile.

use crate::trace::{SpanId, TraceError};

/// Why a timeline cannot be projected onto a profile.
#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    /// The timeline itself is inconsistent.
    #[error("timeline: {0}")]
    Trace(#[from] TraceError),
    /// The timeline uses more devices than the profile has.
    #[error(
        "the timeline uses device {device}, but profile `{profile}` has only {available} devices"
    )]
    TooFewDevices {
        /// Profile name.
        profile: String,
        /// Highest device index used (or needed by a collective's participant count).
        device: usize,
        /// Devices in the profile.
        available: usize,
    },
    /// A span that runs on a device names none (and its track does not imply one).
    #[error("span {span} ({name}) is a {kind} span without a device")]
    NoDevice {
        /// The span.
        span: SpanId,
        /// Its name.
        name: String,
        /// Its kind label.
        kind: &'static str,
    },
    /// A collective span without collective attributes.
    #[error("span {span} ({name}) is a collective span without op/algorithm attributes")]
    NotACollective {
        /// The span.
        span: SpanId,
        /// Its name.
        name: String,
    },
    /// The recorded algorithm has no cost model.
    #[error(
        "span {span} ({name}): unknown collective algorithm `{algorithm}` \
         (known: host-staged, ring, auto, or a kind of the engine)"
    )]
    UnknownAlgorithm {
        /// The span.
        span: SpanId,
        /// Its name.
        name: String,
        /// The algorithm as recorded.
        algorithm: String,
    },
    /// Spans of one collective group disagree on what the collective is.
    #[error(
        "collective group {group}: span {span} ({name}) records a different op, algorithm, \
         size or participant count than span {first}"
    )]
    MixedGroup {
        /// The group.
        group: u64,
        /// First member.
        first: SpanId,
        /// The member that disagrees.
        span: SpanId,
        /// Its name.
        name: String,
    },
    /// A collective spans nodes but the profile has no network.
    #[error("a collective spans {nodes} nodes but profile `{profile}` has no [network]")]
    NoNetwork {
        /// Profile name.
        profile: String,
        /// Nodes spanned.
        nodes: usize,
    },
    /// The engine has no collective the machine allows for these participants.
    #[error(
        "engine `{engine}` has no collective that profile `{profile}` allows for {devices} devices \
         on {nodes} node(s): add an entry for this path (e.g. nccl-net or host-staged across \
         nodes) to the engine's [[collectives]]"
    )]
    NoCollective {
        /// Engine name.
        engine: String,
        /// Profile name.
        profile: String,
        /// Participants.
        devices: usize,
        /// Nodes they span.
        nodes: usize,
    },
    /// An NVLink collective was asked of a profile without a device link.
    #[error("profile `{profile}` has no [device_link] for an NVLink collective")]
    NoDeviceLink {
        /// Profile name.
        profile: String,
    },
    /// The timeline has no spans: there is nothing to replay.
    #[error(
        "the timeline has no spans, so there is nothing to project: record one with \
         `wgpar run --trace FILE` (a run that computes at least one step)"
    )]
    EmptyTimeline,
    /// A span depends on a span that started after it, which no run can record: the trace
    /// was edited or its clocks are inconsistent. (Boxed: errors stay small.)
    #[error("{0}")]
    DependencyStartsLater(Box<ForwardDependency>),
    /// Dependencies, track order and collective groups form a cycle (e.g. two devices that
    /// recorded the same two collectives in opposite orders).
    #[error("span {span} ({name}) waits on itself through dependencies, track order or a collective group")]
    Cycle {
        /// A span on the cycle.
        span: SpanId,
        /// Its name.
        name: String,
    },
}

/// A dependency that points forward in time: span `span` starts before span `dep`, which it
/// depends on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "span {span} ({name}) starts at {start_us:.3} us but depends on span {dep} ({dep_name}), \
     which starts later, at {dep_start_us:.3} us: a dependency that points forward in time \
     (the trace's times or dependencies were edited)"
)]
pub struct ForwardDependency {
    /// The dependent span.
    pub span: SpanId,
    /// Its name.
    pub name: String,
    /// Its recorded start, microseconds.
    pub start_us: f64,
    /// The dependency.
    pub dep: SpanId,
    /// Its name.
    pub dep_name: String,
    /// Its recorded start, microseconds.
    pub dep_start_us: f64,
}
