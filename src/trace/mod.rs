//! Timelines of a run: what each device, link and the host did, and when.
//!
//! Engines and the comm layer record [`Span`]s through a shared [`Recorder`] as they run; the
//! resulting [`Timeline`] is summarised ([`Summary`]), exported as a Chrome trace
//! ([`Timeline::to_chrome_trace`]), drawn as SVG ([`timeline_svg`]) and replayed on host
//! profiles by [`crate::sim`].

mod attrs;
mod chrome;
mod error;
mod merge;
mod recorder;
mod span;
mod summary;
mod svg;
mod timeline;

pub use attrs::SpanAttrs;
pub use chrome::TRACE_FORMAT_VERSION;
pub use error::TraceError;
pub use merge::{
    keys as rank_keys, rank_trace_path, MergeError, RankPlacement, CROSS_PROCESS_GROUP,
};
pub use recorder::{DeviceTiming, Recorder};
pub use span::{
    CollectiveInfo, CollectiveOp, HeadWork, KernelFamily, Precision, Span, SpanId, SpanKind, Track,
};
pub use summary::{DeviceSummary, Interval, Summary};
pub use svg::{timeline_svg, timeline_svg_with, SvgOptions};
pub(crate) use timeline::us_to_ns;
pub use timeline::{RemoteDep, Timeline};
