//! One recorded operation on a timeline, and the small enums that describe it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Identifier of a span inside one timeline.
///
/// Ids start at 1 and grow in recording order, so a span can only depend on spans recorded
/// before it. [`SpanId::NONE`] is what a disabled recorder hands out; dependencies on it are
/// dropped when a span is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SpanId(pub u64);

impl SpanId {
    /// The id returned by a disabled recorder; never refers to a span.
    pub const NONE: SpanId = SpanId(0);

    /// True for [`SpanId::NONE`].
    pub fn is_none(self) -> bool {
        self == SpanId::NONE
    }
}

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// What a span spent its time on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// Kernels running on a device.
    Compute,
    /// A copy from device memory to host memory.
    DeviceToHost,
    /// A copy from host memory to device memory.
    HostToDevice,
    /// The host summing staged partials (the middle phase of a host-staged collective).
    HostReduce,
    /// A whole collective operation as seen by one participant (see [`CollectiveInfo`]).
    Collective,
    /// Time a device spent blocked (waiting on a channel, a peer or the host).
    Wait,
}

impl SpanKind {
    /// Every kind, in the order reports and legends list them.
    pub const ALL: [SpanKind; 6] = [
        SpanKind::Compute,
        SpanKind::DeviceToHost,
        SpanKind::HostToDevice,
        SpanKind::HostReduce,
        SpanKind::Collective,
        SpanKind::Wait,
    ];

    /// Short lower-case label, used as the Chrome trace category.
    pub fn label(self) -> &'static str {
        match self {
            SpanKind::Compute => "compute",
            SpanKind::DeviceToHost => "d2h",
            SpanKind::HostToDevice => "h2d",
            SpanKind::HostReduce => "host_reduce",
            SpanKind::Collective => "collective",
            SpanKind::Wait => "wait",
        }
    }

    /// True for kinds that move data between memories (counted as communication).
    pub fn is_communication(self) -> bool {
        matches!(
            self,
            SpanKind::DeviceToHost | SpanKind::HostToDevice | SpanKind::Collective
        )
    }
}

/// The row of the timeline a span is drawn on; a track runs one span at a time.
///
/// Names: `gpu{d}` (compute, collectives and waits of device `d`), `gpu{d} d2h`, `gpu{d} h2d`
/// (the two directions of its host link, which run concurrently with compute), `host` (host-side
/// reduction), or any other free-form name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Track {
    /// The compute queue of a device.
    Device(u32),
    /// The device-to-host direction of a device's host link.
    DeviceToHost(u32),
    /// The host-to-device direction of a device's host link.
    HostToDevice(u32),
    /// The host CPU.
    Host,
    /// Any other track, by name.
    Other(String),
}

impl Track {
    /// The track a span of `kind` on `device` is drawn on when the caller does not choose one.
    pub fn default_for(kind: SpanKind, device: Option<u32>) -> Track {
        match (kind, device) {
            (SpanKind::DeviceToHost, Some(d)) => Track::DeviceToHost(d),
            (SpanKind::HostToDevice, Some(d)) => Track::HostToDevice(d),
            (SpanKind::HostReduce, _) | (_, None) => Track::Host,
            (_, Some(d)) => Track::Device(d),
        }
    }

    /// The device a track belongs to, if any.
    pub fn device(&self) -> Option<u32> {
        match self {
            Track::Device(d) | Track::DeviceToHost(d) | Track::HostToDevice(d) => Some(*d),
            Track::Host | Track::Other(_) => None,
        }
    }
}

impl fmt::Display for Track {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Track::Device(d) => write!(f, "gpu{d}"),
            Track::DeviceToHost(d) => write!(f, "gpu{d} d2h"),
            Track::HostToDevice(d) => write!(f, "gpu{d} h2d"),
            Track::Host => f.write_str("host"),
            Track::Other(name) => f.write_str(name),
        }
    }
}

impl FromStr for Track {
    type Err = std::convert::Infallible;

    /// Parses the names written by `Display`; anything else becomes [`Track::Other`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "host" {
            return Ok(Track::Host);
        }
        let parsed = s.strip_prefix("gpu").and_then(|rest| {
            let (num, suffix) = match rest.split_once(' ') {
                Some((n, sfx)) => (n, Some(sfx)),
                None => (rest, None),
            };
            // Reject "gpu01" so that formatting the parsed track gives back the same name.
            if num.len() > 1 && num.starts_with('0') {
                return None;
            }
            let d: u32 = num.parse().ok()?;
            match suffix {
                None => Some(Track::Device(d)),
                Some("d2h") => Some(Track::DeviceToHost(d)),
                Some("h2d") => Some(Track::HostToDevice(d)),
                Some(_) => None,
            }
        });
        Ok(parsed.unwrap_or_else(|| Track::Other(s.to_owned())))
    }
}

impl Serialize for Track {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Track {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(s.parse().unwrap_or_else(|never| match never {}))
    }
}

/// The family of a compute span's kernels; picks the calibrated rate the projection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelFamily {
    /// Matrix multiplication (linear layers, LM head).
    Matmul,
    /// Attention over the KV cache.
    Attention,
    /// Memory-streaming kernels: norms, activations, residual adds, RoPE, copies.
    Elementwise,
}

/// Arithmetic precision of a compute span (selects the f32 or f16 FLOP rate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// 32-bit float arithmetic.
    #[default]
    F32,
    /// 16-bit float arithmetic.
    F16,
}

/// The collective operations the comm layer performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    /// Every participant ends with the element-wise sum of all inputs.
    AllReduce,
    /// Every participant ends with the concatenation of all inputs.
    AllGather,
    /// Participant `i` ends with the `i`-th slice of the element-wise sum.
    ReduceScatter,
    /// One participant's buffer moves to another.
    SendRecv,
}

impl CollectiveOp {
    /// Lower-case name as used in reports.
    pub fn label(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "allreduce",
            CollectiveOp::AllGather => "allgather",
            CollectiveOp::ReduceScatter => "reducescatter",
            CollectiveOp::SendRecv => "sendrecv",
        }
    }
}

/// Extra attributes of a [`SpanKind::Collective`] span.
///
/// The span's `bytes` is the collective's size S as nccl-tests defines it: the buffer size per
/// participant (the full output for all-gather, the full input for reduce-scatter).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveInfo {
    /// Which collective.
    pub op: CollectiveOp,
    /// Algorithm that ran it, e.g. `"host-staged"` or `"ring"`; the projection costs this one.
    pub algorithm: String,
    /// Number of participating devices.
    pub participants: u32,
    /// Spans with the same group are the same call seen from different participants; the
    /// projection starts them together, as the collective cannot start before all have arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<u64>,
    /// Number of chunks a pipelined algorithm split the buffer into (1 = not pipelined).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub chunks: u32,
}

fn one() -> u32 {
    1
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

fn is_f32(p: &Precision) -> bool {
    *p == Precision::F32
}

/// One operation on a timeline.
///
/// Times are integer nanoseconds since the recorder's epoch so that a trace file reproduces
/// them bit for bit; [`Span::start_us`] and friends give microseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Unique id within the timeline.
    pub id: SpanId,
    /// The track it ran on.
    pub track: Track,
    /// What it did.
    pub kind: SpanKind,
    /// Human-readable name, e.g. `layer3.mlp.down`.
    pub name: String,
    /// Start, nanoseconds since the epoch.
    pub start_ns: u64,
    /// Duration in nanoseconds.
    pub dur_ns: u64,
    /// Device index the span belongs to (`None` for host-only work).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    /// Micro-batch (or in-flight sequence) id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatch: Option<u32>,
    /// Transformer layer index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u32>,
    /// Bytes: moved for transfers, payload S for collectives, memory traffic for compute, bytes
    /// read plus written for a host reduce.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes: u64,
    /// Floating-point operations performed (compute spans).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub flops: u64,
    /// Kernel dispatches inside the span, each paying the profile's launch overhead.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub kernels: u32,
    /// Kernel family of a compute span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family: Option<KernelFamily>,
    /// Arithmetic precision of a compute span.
    #[serde(default, skip_serializing_if = "is_f32")]
    pub precision: Precision,
    /// Spans that had to finish before this one could start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deps: Vec<SpanId>,
    /// Collective attributes, for [`SpanKind::Collective`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<CollectiveInfo>,
    /// Time the device spent on the span's work, from timestamp queries (where the adapter has
    /// `TIMESTAMP_QUERY`), nanoseconds. The span's start and duration stay on the host clock,
    /// which also holds encoding, submission and the wait; this is the device's part of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_ns: Option<u64>,
    /// Hidden width of the model whose blocks a compute span ran (e.g. 768 for GPT-2 small),
    /// where the span is a model's work. With [`Span::shards`] it tells a calibrated
    /// projection which measured block width the span's rate is read at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    /// Tensor-parallel shards the blocks' matrices were split over (1: whole blocks).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub shards: u32,
    /// The part of a compute span's `flops` and `bytes` that is the model's final norm and LM
    /// head (one large matrix over the vocabulary), where the span includes it: a calibrated
    /// profile with a measured head rate prices that part on its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<HeadWork>,
    /// Earliest start, nanoseconds since the epoch: the span's work was released by an event
    /// outside the run (a request arriving at a server). The projection starts it no earlier
    /// than the same time after the timeline's first span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_ns: Option<u64>,
}

/// The final norm and LM head inside a compute span (see [`Span::head`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadWork {
    /// FLOPs of the head, counted in the span's `flops`.
    pub flops: u64,
    /// Bytes the head moves, counted in the span's `bytes`.
    pub bytes: u64,
}

impl Span {
    /// Start in microseconds since the epoch.
    pub fn start_us(&self) -> f64 {
        self.start_ns as f64 / 1e3
    }

    /// Duration in microseconds.
    pub fn dur_us(&self) -> f64 {
        self.dur_ns as f64 / 1e3
    }

    /// Width of a whole (unsharded) block of the same architecture with as much work per
    /// dispatch as this span's: `width / sqrt(shards)`, since a block's matrices grow with the
    /// square of its width and a tensor-parallel shard holds `1 / shards` of them. `None`
    /// where the span records no width.
    pub fn block_width(&self) -> Option<f64> {
        self.width
            .map(|w| f64::from(w) / f64::from(self.shards.max(1)).sqrt())
    }

    /// End in nanoseconds since the epoch.
    pub fn end_ns(&self) -> u64 {
        self.start_ns.saturating_add(self.dur_ns)
    }

    /// End in microseconds since the epoch.
    pub fn end_us(&self) -> f64 {
        self.end_ns() as f64 / 1e3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn track_names_round_trip() {
        for t in [
            Track::Device(0),
            Track::DeviceToHost(3),
            Track::HostToDevice(12),
            Track::Host,
            Track::Other("net0".into()),
        ] {
            assert_eq!(t.to_string().parse::<Track>().unwrap(), t);
        }
        assert_eq!(
            "gpu01".parse::<Track>().unwrap(),
            Track::Other("gpu01".into())
        );
        assert_eq!(
            "gpu1 x".parse::<Track>().unwrap(),
            Track::Other("gpu1 x".into())
        );
    }

    #[test]
    fn default_tracks() {
        assert_eq!(
            Track::default_for(SpanKind::Compute, Some(1)),
            Track::Device(1)
        );
        assert_eq!(
            Track::default_for(SpanKind::DeviceToHost, Some(1)),
            Track::DeviceToHost(1)
        );
        assert_eq!(
            Track::default_for(SpanKind::HostReduce, Some(1)),
            Track::Host
        );
        assert_eq!(Track::default_for(SpanKind::Compute, None), Track::Host);
    }
}
