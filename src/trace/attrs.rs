//! Builder for everything about a span except its id and times.

use std::borrow::Cow;

use super::span::{
    CollectiveInfo, CollectiveOp, HeadWork, KernelFamily, Precision, Span, SpanId, SpanKind, Track,
};

/// Attributes of a span to record; times and the id are added by the recorder.
///
/// Start from one of the constructors ([`SpanAttrs::compute`], [`SpanAttrs::d2h`], ...) and
/// chain setters:
///
/// ```
/// use wgpar::trace::{SpanAttrs, KernelFamily};
/// let attrs = SpanAttrs::compute("layer3.mlp.down", 0)
///     .layer(3)
///     .microbatch(1)
///     .flops(2 * 4096 * 11008)
///     .bytes(4096 * 11008 * 2)
///     .family(KernelFamily::Matmul);
/// ```
///
/// The name is a `Cow<'static, str>` so a static name costs no allocation.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanAttrs {
    /// What the span does.
    pub kind: SpanKind,
    /// Name shown in traces.
    pub name: Cow<'static, str>,
    /// Track override; `None` picks [`Track::default_for`] the kind and device.
    pub track: Option<Track>,
    /// Device index.
    pub device: Option<u32>,
    /// Micro-batch id.
    pub microbatch: Option<u32>,
    /// Layer index.
    pub layer: Option<u32>,
    /// Bytes (see [`Span::bytes`]).
    pub bytes: u64,
    /// FLOPs.
    pub flops: u64,
    /// Kernel dispatches (compute spans default to 1).
    pub kernels: u32,
    /// Kernel family.
    pub family: Option<KernelFamily>,
    /// Precision.
    pub precision: Precision,
    /// Dependencies.
    pub deps: Vec<SpanId>,
    /// Collective attributes.
    pub collective: Option<CollectiveInfo>,
    /// Device time from timestamp queries (see [`Span::device_ns`]).
    pub device_ns: Option<u64>,
    /// Earliest start (see [`Span::release_ns`]).
    pub release_ns: Option<u64>,
    /// Model width (see [`Span::width`]).
    pub width: Option<u32>,
    /// Tensor-parallel shards (see [`Span::shards`]).
    pub shards: u32,
    /// The head's part of the work (see [`Span::head`]).
    pub head: Option<HeadWork>,
}

impl SpanAttrs {
    /// Attributes of a span of `kind` with everything else empty.
    pub fn new(kind: SpanKind, name: impl Into<Cow<'static, str>>) -> Self {
        SpanAttrs {
            kind,
            name: name.into(),
            track: None,
            device: None,
            microbatch: None,
            layer: None,
            bytes: 0,
            flops: 0,
            kernels: if kind == SpanKind::Compute { 1 } else { 0 },
            family: None,
            precision: Precision::F32,
            deps: Vec::new(),
            collective: None,
            device_ns: None,
            release_ns: None,
            width: None,
            shards: 1,
            head: None,
        }
    }

    /// Kernels on `device` (one dispatch unless [`SpanAttrs::kernels`] says more).
    pub fn compute(name: impl Into<Cow<'static, str>>, device: u32) -> Self {
        Self::new(SpanKind::Compute, name).device(device)
    }

    /// A copy of `bytes` from `device` to the host.
    pub fn d2h(name: impl Into<Cow<'static, str>>, device: u32, bytes: u64) -> Self {
        Self::new(SpanKind::DeviceToHost, name)
            .device(device)
            .bytes(bytes)
    }

    /// A copy of `bytes` from the host to `device`.
    pub fn h2d(name: impl Into<Cow<'static, str>>, device: u32, bytes: u64) -> Self {
        Self::new(SpanKind::HostToDevice, name)
            .device(device)
            .bytes(bytes)
    }

    /// A host-side reduction touching `bytes` (read plus written) of host memory.
    pub fn host_reduce(name: impl Into<Cow<'static, str>>, bytes: u64) -> Self {
        Self::new(SpanKind::HostReduce, name).bytes(bytes)
    }

    /// Time `device` spent blocked.
    pub fn wait(name: impl Into<Cow<'static, str>>, device: u32) -> Self {
        Self::new(SpanKind::Wait, name).device(device)
    }

    /// One participant's view of a collective of size `bytes` (S, as in nccl-tests).
    pub fn collective(
        name: impl Into<Cow<'static, str>>,
        device: u32,
        op: CollectiveOp,
        algorithm: impl Into<String>,
        participants: u32,
        bytes: u64,
    ) -> Self {
        let mut a = Self::new(SpanKind::Collective, name)
            .device(device)
            .bytes(bytes);
        a.collective = Some(CollectiveInfo {
            op,
            algorithm: algorithm.into(),
            participants,
            group: None,
            chunks: 1,
        });
        a
    }

    /// Sets the device.
    pub fn device(mut self, device: u32) -> Self {
        self.device = Some(device);
        self
    }

    /// Puts the span on `track` instead of the default one.
    pub fn on_track(mut self, track: Track) -> Self {
        self.track = Some(track);
        self
    }

    /// Sets the micro-batch id.
    pub fn microbatch(mut self, microbatch: u32) -> Self {
        self.microbatch = Some(microbatch);
        self
    }

    /// Sets the layer index.
    pub fn layer(mut self, layer: u32) -> Self {
        self.layer = Some(layer);
        self
    }

    /// Sets the byte count.
    pub fn bytes(mut self, bytes: u64) -> Self {
        self.bytes = bytes;
        self
    }

    /// Sets the FLOP count.
    pub fn flops(mut self, flops: u64) -> Self {
        self.flops = flops;
        self
    }

    /// Sets the number of kernel dispatches.
    pub fn kernels(mut self, kernels: u32) -> Self {
        self.kernels = kernels;
        self
    }

    /// Sets the device time measured by timestamp queries, in microseconds (`None`: the
    /// adapter cannot time on the device).
    pub fn device_us(mut self, us: Option<f64>) -> Self {
        self.device_ns = us.map(super::us_to_ns);
        self
    }

    /// Sets the earliest start, microseconds since the epoch (see [`Span::release_ns`]),
    /// e.g. `recorder.us_since_epoch(arrival)`.
    pub fn not_before_us(mut self, us: f64) -> Self {
        self.release_ns = Some(super::us_to_ns(us));
        self
    }

    /// Sets the kernel family.
    pub fn family(mut self, family: KernelFamily) -> Self {
        self.family = Some(family);
        self
    }

    /// Sets the hidden width of the model whose blocks the span runs and the tensor-parallel
    /// shards they are split over (see [`Span::width`], [`Span::shards`]).
    pub fn blocks_of(mut self, width: usize, shards: usize) -> Self {
        self.width = u32::try_from(width).ok();
        self.shards = u32::try_from(shards).unwrap_or(u32::MAX).max(1);
        self
    }

    /// Records the part of the span's work that is the model's final norm and LM head (see
    /// [`Span::head`]); `None` leaves the span without one.
    pub fn head_part(mut self, head: impl Into<Option<HeadWork>>) -> Self {
        self.head = head.into();
        self
    }

    /// Sets the precision.
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Adds one dependency ([`SpanId::NONE`] is ignored).
    pub fn after(mut self, dep: SpanId) -> Self {
        if !dep.is_none() {
            self.deps.push(dep);
        }
        self
    }

    /// Adds several dependencies ([`SpanId::NONE`] entries are ignored).
    pub fn after_all(mut self, deps: &[SpanId]) -> Self {
        self.deps
            .extend(deps.iter().copied().filter(|d| !d.is_none()));
        self
    }

    /// Sets the collective group (see [`CollectiveInfo::group`]); no effect on other kinds.
    pub fn group(mut self, group: u64) -> Self {
        if let Some(c) = self.collective.as_mut() {
            c.group = Some(group);
        }
        self
    }

    /// Sets the collective's chunk count (at least 1); no effect on other kinds.
    pub fn chunks(mut self, chunks: u32) -> Self {
        if let Some(c) = self.collective.as_mut() {
            c.chunks = chunks.max(1);
        }
        self
    }

    /// Turns the attributes into a span with the given id and times.
    pub fn into_span(self, id: SpanId, start_ns: u64, dur_ns: u64) -> Span {
        let track = self
            .track
            .unwrap_or_else(|| Track::default_for(self.kind, self.device));
        let mut deps = self.deps;
        deps.sort_unstable();
        deps.dedup();
        Span {
            id,
            track,
            kind: self.kind,
            name: self.name.into_owned(),
            start_ns,
            dur_ns,
            device: self.device,
            microbatch: self.microbatch,
            layer: self.layer,
            bytes: self.bytes,
            flops: self.flops,
            kernels: self.kernels,
            family: self.family,
            precision: self.precision,
            deps,
            collective: self.collective,
            device_ns: self.device_ns,
            release_ns: self.release_ns,
            width: self.width,
            shards: self.shards,
            head: self.head,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_sets_fields_and_default_track() {
        let s = SpanAttrs::d2h("x", 2, 100)
            .microbatch(1)
            .after(SpanId(3))
            .after(SpanId::NONE)
            .after_all(&[SpanId(1), SpanId(3)])
            .into_span(SpanId(9), 10, 5);
        assert_eq!(s.track, Track::DeviceToHost(2));
        assert_eq!(s.deps, vec![SpanId(1), SpanId(3)]);
        assert_eq!(s.bytes, 100);
        assert_eq!(s.kernels, 0);
        assert_eq!(s.end_ns(), 15);
        let c = SpanAttrs::compute("k", 1).into_span(SpanId(1), 0, 0);
        assert_eq!(c.kernels, 1);
        let g = SpanAttrs::collective("ar", 1, CollectiveOp::AllReduce, "ring", 2, 8)
            .group(4)
            .chunks(0)
            .into_span(SpanId(2), 0, 0);
        let info = g.collective.unwrap();
        assert_eq!((info.group, info.chunks), (Some(4), 1));
    }
}
