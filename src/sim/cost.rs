//! The cost model: how long one operation takes on a profile, run by an engine.
//!
//! Compute: roofline `max(flops / (peak x gemm), bytes / (bandwidth x memory)) + kernels x
//! launch overhead` (plus, per compute span, the submission's fixed cost: `submit_us`), where the engine picks the peak (f32 shader cores, f16 shader cores or
//! tensor cores) and the fractions; calibrated per-family rates and rate curves replace the
//! roofline for an engine whose kernels calibration measures. Transfers: alpha-beta per link
//! direction, on the engine's wire format. Collectives: the engine's choice among the paths the
//! machine allows (formulas on each function and in `docs/PROJECTION.md`).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use crate::trace::{CollectiveOp, HeadWork, KernelFamily, Precision, Span};

use super::engine::{CollectiveEntry, Engine, LinkKind};
use super::numformat::NumFormat;
use super::profile::{
    rate_at, rate_on_surface, rate_on_surface_at_width, DeviceSpec, HostProfile, LinkSpec,
};
use super::project::CollectivePolicy;
use super::project_error::ProjectError;

/// Collective algorithms the cost model knows by their recorded names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Gather to host memory, reduce on the CPU, broadcast back (wgpar's host-staged path).
    HostStaged,
    /// Ring over device-to-device links (or bounced through the host when there are none).
    Ring,
}

impl Algorithm {
    /// Parses a recorded algorithm name: `host-staged` (also `host_staged`, `host`,
    /// `host-staged-chunked`) or `ring` (also `nvlink-ring`). Case-insensitive.
    pub fn parse(name: &str) -> Option<Algorithm> {
        match name.to_ascii_lowercase().as_str() {
            "host-staged" | "host_staged" | "host" | "host-staged-chunked" => {
                Some(Algorithm::HostStaged)
            }
            "ring" | "nvlink-ring" => Some(Algorithm::Ring),
            _ => None,
        }
    }

    /// Canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::HostStaged => "host-staged",
            Algorithm::Ring => "ring",
        }
    }

    fn kind(self) -> LinkKind {
        match self {
            Algorithm::HostStaged => LinkKind::HostStaged,
            Algorithm::Ring => LinkKind::Ring,
        }
    }
}

static PEAK: OnceLock<Engine> = OnceLock::new();

/// Operation costs on one profile, run by one engine, in microseconds.
#[derive(Debug, Clone, Copy)]
pub struct CostModel<'a> {
    profile: &'a HostProfile,
    engine: &'a Engine,
}

impl<'a> CostModel<'a> {
    /// A cost model for `profile` at its peak figures ([`Engine::peak`]).
    pub fn new(profile: &'a HostProfile) -> Self {
        CostModel {
            profile,
            engine: PEAK.get_or_init(Engine::peak),
        }
    }

    /// A cost model for `engine` running on `profile`.
    pub fn with_engine(profile: &'a HostProfile, engine: &'a Engine) -> Self {
        CostModel { profile, engine }
    }

    /// The engine.
    pub fn engine(&self) -> &'a Engine {
        self.engine
    }

    /// Whether the profile's measurements describe this engine (see
    /// [`EngineCompute::calibrated`](super::EngineCompute::calibrated)).
    fn measured(&self) -> bool {
        self.engine.compute.calibrated && self.profile.is_measured()
    }

    fn device(&self, index: usize) -> Result<&'a DeviceSpec, ProjectError> {
        self.profile
            .device(index)
            .ok_or_else(|| ProjectError::TooFewDevices {
                profile: self.profile.name.clone(),
                device: index,
                available: self.profile.device_count(),
            })
    }

    /// Time of kernels doing `flops` and moving `bytes` on device `index`, plus one launch
    /// overhead per kernel.
    ///
    /// For an engine whose kernels calibration measures, on a device with measured rates: the
    /// family's rate surface at the work's intensity and work per dispatch (`flops /
    /// kernels`; [`CostModel::span_compute_us`] reads it at a span's block width instead),
    /// else its rate-by-intensity curve, else the calibrated roofline. Otherwise the engine's
    /// roofline: `max(flops / (peak x fraction), bytes / (memory_gbps x memory))`, with the
    /// peak of the engine's arithmetic (an f32 engine keeps the span's recorded precision;
    /// f16/bf16/fp8 on tensor cores use `f16_tensor_tflops` where the device has it).
    pub fn compute_us(
        &self,
        index: usize,
        flops: u64,
        bytes: u64,
        kernels: u32,
        family: Option<KernelFamily>,
        precision: Precision,
    ) -> Result<f64, ProjectError> {
        let work = ComputeWork {
            flops,
            bytes,
            kernels,
            family,
            precision,
            block_width: None,
            head: None,
        };
        self.work_us(index, &work)
    }

    /// [`CostModel::compute_us`] of a compute span's work, read at the span's block width
    /// where it records one ([`Span::block_width`]) and the profile's surface says which width
    /// each curve was measured at.
    pub fn span_compute_us(&self, index: usize, span: &Span) -> Result<f64, ProjectError> {
        let work = ComputeWork {
            flops: span.flops,
            bytes: span.bytes,
            kernels: span.kernels,
            family: span.family,
            precision: span.precision,
            block_width: span.block_width(),
            head: span.head,
        };
        self.work_us(index, &work)
    }

    fn work_us(&self, index: usize, work: &ComputeWork) -> Result<f64, ProjectError> {
        let d = self.device(index)?;
        let c = &self.engine.compute;
        let launch = c.launch_overhead_us.unwrap_or(d.launch_overhead_us);
        let launches = work.kernels as f64 * launch;
        if c.calibrated && !d.rates.is_empty() {
            return Ok(measured_compute_us(d, work) + launches);
        }
        let precision = match c.dtype {
            NumFormat::F32 => work.precision,
            _ => Precision::F16,
        };
        let peak_tflops = match precision {
            Precision::F32 => d.f32_tflops,
            Precision::F16 if c.tensor_cores => d.f16_tensor_tflops.unwrap_or(d.f16_tflops),
            Precision::F16 => d.f16_tflops,
        };
        let fraction = match work.family {
            Some(KernelFamily::Attention) => c.attention,
            _ => c.gemm,
        };
        // 1 TFLOP/s = 1e6 FLOP per us, 1 GB/s = 1e3 bytes per us.
        let math = work.flops as f64 / (peak_tflops * 1e6 * fraction);
        let memory = work.bytes as f64 / (d.memory_gbps * 1e3 * c.memory);
        Ok(math.max(memory) + launches)
    }

    /// Fixed host cost of one submission and its wait on device `index`
    /// (`submit_overhead_us`, 0 where the profile has none). Engines record each submission
    /// and its wait as one compute span, so the projection adds this once per compute span,
    /// on top of [`CostModel::compute_us`] (which charges the dispatches).
    pub fn submit_us(&self, index: usize) -> Result<f64, ProjectError> {
        Ok(self.device(index)?.submit_overhead_us.unwrap_or(0.0))
    }

    /// Time of a device-to-host copy of `bytes` (recorded, f32) from device `index`.
    pub fn d2h_us(&self, index: usize, bytes: f64) -> Result<f64, ProjectError> {
        Ok(self
            .device(index)?
            .host_link
            .d2h
            .time_us(bytes * self.engine.wire_scale()))
    }

    /// Time of a host-to-device copy of `bytes` (recorded, f32) to device `index`.
    pub fn h2d_us(&self, index: usize, bytes: f64) -> Result<f64, ProjectError> {
        Ok(self
            .device(index)?
            .host_link
            .h2d
            .time_us(bytes * self.engine.wire_scale()))
    }

    /// Time for the host to stream `bytes` (read plus written) through memory.
    pub fn host_reduce_us(&self, bytes: f64) -> f64 {
        bytes / (self.profile.host.memory_gbps * 1e3)
    }

    /// Cost of collective `op` of size `bytes` (S, nccl-tests convention) over `devices` with
    /// `algorithm` at the profile's figures (the peak engine's formulas, whatever engine this
    /// model holds).
    ///
    /// `chunks` pipelines the host-staged phases; the ring ignores it (a ring is already
    /// pipelined step by step). With one participant there is nothing to exchange: 0.
    pub fn collective_us(
        &self,
        op: CollectiveOp,
        algorithm: Algorithm,
        devices: &[usize],
        bytes: u64,
        chunks: u32,
    ) -> Result<f64, ProjectError> {
        let entry = CollectiveEntry {
            kind: algorithm.kind(),
            efficiency: 1.0,
            latency_us: 0.0,
            step_latency_us: 0.0,
            intra_step_latency_us: None,
            tree_step_latency_us: None,
            tree_intra_step_latency_us: None,
        };
        if devices.len() < 2 {
            return Ok(0.0);
        }
        self.entry_us(op, &entry, devices, bytes as f64, chunks.max(1), true)
    }

    /// Cost of collective `op` as this model's engine runs it over `devices`: the entry the
    /// engine would choose (see [`Engine::collective_for`]; with [`CollectivePolicy::Best`] the
    /// cheapest entry the machine allows), on the engine's wire format. Returns the time and
    /// the kind used.
    pub fn engine_collective_us(
        &self,
        op: CollectiveOp,
        recorded: &str,
        policy: CollectivePolicy,
        devices: &[usize],
        bytes: u64,
        chunks: u32,
    ) -> Result<(f64, LinkKind), ProjectError> {
        if devices.len() < 2 {
            return Ok((0.0, LinkKind::HostStaged));
        }
        let wire = bytes as f64 * self.engine.wire_scale();
        let none = || ProjectError::NoCollective {
            engine: self.engine.name.clone(),
            profile: self.profile.name.clone(),
            devices: devices.len(),
            nodes: self.per_node(devices).len(),
        };
        match policy {
            CollectivePolicy::AsRecorded => {
                let entry = self
                    .engine
                    .collective_for(self.profile, devices, Some(recorded))
                    .ok_or_else(none)?;
                let t = self.entry_us(op, entry, devices, wire, chunks.max(1), false)?;
                Ok((t, entry.kind))
            }
            CollectivePolicy::Best => {
                let mut best: Option<(f64, LinkKind)> = None;
                for e in self
                    .engine
                    .collectives
                    .iter()
                    .filter(|e| e.kind.available(self.profile, devices))
                {
                    let t = self.entry_us(op, e, devices, wire, chunks.max(1), false)?;
                    if best.is_none_or(|(b, _)| t < b) {
                        best = Some((t, e.kind));
                    }
                }
                best.ok_or_else(none)
            }
        }
    }

    /// Cost of one entry; `peak` ignores the engine's efficiency and latency (the profile's
    /// figures as they are).
    fn entry_us(
        &self,
        op: CollectiveOp,
        entry: &CollectiveEntry,
        devices: &[usize],
        bytes: f64,
        chunks: u32,
        peak: bool,
    ) -> Result<f64, ProjectError> {
        // The profile's measured links and collective cost describe wgpar itself.
        let (eff, latency) = if peak || self.measured() {
            (1.0, 0.0)
        } else {
            (
                entry.efficiency,
                entry.latency_us + self.step_latency_us(op, entry, devices),
            )
        };
        match entry.kind {
            LinkKind::HostStaged => {
                let fixed = if peak || self.measured() {
                    self.profile.host.collective_overhead(devices.len())
                } else {
                    latency
                };
                Ok(self.host_staged_us(op, devices, bytes, chunks, eff)? + fixed)
            }
            LinkKind::Ring => Ok(self.ring_us(op, devices, bytes, eff, true)? + latency),
            LinkKind::HostRing => {
                let fixed = if self.measured() {
                    self.profile.host.collective_overhead(devices.len())
                } else {
                    latency
                };
                Ok(self.ring_us(op, devices, bytes, eff, false)? + fixed)
            }
            LinkKind::NcclShm | LinkKind::NcclP2p => {
                let shared = entry.kind == LinkKind::NcclShm;
                let beta = self.host_path_gbps(devices, shared)?;
                Ok(latency + bus_factor(op, devices.len()) * bytes / (beta * eff * 1e3))
            }
            LinkKind::NcclRingNvlink | LinkKind::NcclNvls => {
                let beta = self.device_link_gbps()?;
                Ok(latency + bus_factor(op, devices.len()) * bytes / (beta * eff * 1e3))
            }
            LinkKind::NcclNet => {
                // Rings cross each node boundary through the node's interfaces; inside a node
                // they run over the device link or PCIe, whichever the node has.
                let nodes = self.per_node(devices).len();
                let net = self.network(nodes)?;
                let nics = self
                    .profile
                    .network
                    .as_ref()
                    .and_then(|n| n.nics_per_node)
                    .unwrap_or(1) as f64;
                let intra = match &self.profile.device_link {
                    Some(dl) => dl.beta_gbps,
                    None => self.host_path_gbps(devices, true)?,
                };
                let beta = intra.min(nics * net.beta_gbps);
                Ok(latency + bus_factor(op, devices.len()) * bytes / (beta * eff * 1e3))
            }
            LinkKind::TcpStar => {
                // The root exchanges with one worker after another: it receives each partial,
                // reduces, then sends the result to each (a gather and a broadcast of S per
                // worker, every message paying the network's latency).
                let nodes = self.per_node(devices).len();
                let net = self.network(nodes)?;
                let per_message = net.alpha_us + bytes / (net.beta_gbps * eff * 1e3);
                let messages = match op {
                    CollectiveOp::AllReduce => 2.0,
                    CollectiveOp::AllGather | CollectiveOp::ReduceScatter => 2.0,
                    CollectiveOp::SendRecv => 1.0 / (devices.len() as f64 - 1.0),
                };
                Ok(latency + messages * (devices.len() as f64 - 1.0) * per_message)
            }
        }
    }

    /// The latency a call's ring steps add: `steps x step_latency_us`, with the steps of a
    /// ring over n ranks as in [`ring_steps`]. A cross-node ring (`nccl-net`) pays
    /// `step_latency_us` on the steps that cross nodes (NCCL 2.15's count: 2N for an
    /// all-reduce over N nodes, N - 1 for an all-gather or reduce-scatter) and the intra-node
    /// step latency on the rest; an all-reduce takes NCCL's tree instead where the entry gives
    /// tree steps and they add less.
    fn step_latency_us(&self, op: CollectiveOp, entry: &CollectiveEntry, devices: &[usize]) -> f64 {
        let steps = ring_steps(op, devices.len());
        if entry.kind != LinkKind::NcclNet {
            return steps * entry.step_latency_us;
        }
        let per_node = self.per_node(devices);
        let nodes = per_node.len();
        let inter = match op {
            CollectiveOp::AllReduce if nodes > 1 => 2.0 * nodes as f64,
            CollectiveOp::AllGather | CollectiveOp::ReduceScatter => nodes as f64 - 1.0,
            CollectiveOp::SendRecv if nodes > 1 => 1.0,
            _ => 0.0,
        }
        .min(steps);
        let intra = entry.intra_step_latency_us.unwrap_or_else(|| {
            // The collective the engine runs among the ranks of one node.
            per_node
                .values()
                .next()
                .and_then(|node| self.engine.collective_for(self.profile, node, None))
                .filter(|c| c.kind != LinkKind::NcclNet)
                .map_or(0.0, |c| c.step_latency_us)
        });
        let ring = inter * entry.step_latency_us + (steps - inter) * intra;
        // NCCL's tree across nodes: up and down a chain inside each node and a binary tree of
        // depth floor(log2 N) among nodes.
        let tree = match (op, entry.tree_step_latency_us) {
            (CollectiveOp::AllReduce, Some(between)) if nodes > 1 => {
                let per_node_ranks = per_node.values().map(Vec::len).max().unwrap_or(1) as f64;
                let depth = (usize::BITS - 1 - nodes.leading_zeros()) as f64;
                let within = entry.tree_intra_step_latency_us.unwrap_or(intra);
                2.0 * ((per_node_ranks - 1.0) * within + depth * between)
            }
            _ => f64::INFINITY,
        };
        ring.min(tree)
    }

    /// Host-staged collective, as phases per chunk of `s = S / k` bytes:
    ///
    /// | op | d2h per device | host reduce per node | h2d per device |
    /// |---|---|---|---|
    /// | allreduce | s | (n_node + 1) s | s |
    /// | allgather | s / n | 0 | s |
    /// | reducescatter | s | (n_node + 1) s | s / n |
    /// | sendrecv | s (sender) | 0 | s (receiver) |
    ///
    /// A copy phase takes the longest time over upstream links, where devices sharing one link
    /// queue up (sum of their alpha-beta times) and separate links overlap. Across N > 1 nodes
    /// a network phase sits between reduce and broadcast: a ring among node hosts,
    /// `2(N-1)(alpha + s/(N beta))` for allreduce, `(N-1)(...)` for allgather/reducescatter,
    /// `alpha + s/beta` for sendrecv. With k chunks the phases form a pipeline:
    /// `T = sum(phases) + (k - 1) * max(phases)`. `eff` scales every link's bandwidth.
    fn host_staged_us(
        &self,
        op: CollectiveOp,
        devices: &[usize],
        bytes: f64,
        chunks: u32,
        eff: f64,
    ) -> Result<f64, ProjectError> {
        let n = devices.len() as f64;
        let s = bytes / chunks as f64;
        let (d2h_each, h2d_each) = match op {
            CollectiveOp::AllReduce => (s, s),
            CollectiveOp::AllGather => (s / n, s),
            CollectiveOp::ReduceScatter => (s, s / n),
            CollectiveOp::SendRecv => (s, s),
        };
        let (senders, receivers): (&[usize], &[usize]) = match op {
            CollectiveOp::SendRecv => (&devices[..1], &devices[devices.len() - 1..]),
            _ => (devices, devices),
        };
        let d2h = self.copy_phase_us(senders, |l| l.d2h, d2h_each / eff)?;
        let h2d = self.copy_phase_us(receivers, |l| l.h2d, h2d_each / eff)?;

        let per_node = self.per_node(devices);
        let reduce = match op {
            CollectiveOp::AllReduce | CollectiveOp::ReduceScatter => per_node
                .values()
                .map(|local| self.host_reduce_us((local.len() as f64 + 1.0) * s))
                .fold(0.0, f64::max),
            CollectiveOp::AllGather | CollectiveOp::SendRecv => 0.0,
        };
        let nodes = per_node.len();
        let network = if nodes > 1 {
            let net = self.network(nodes)?;
            let big_n = nodes as f64;
            let ring_step = net.alpha_us + s / (big_n * net.beta_gbps * eff * 1e3);
            match op {
                CollectiveOp::AllReduce => 2.0 * (big_n - 1.0) * ring_step,
                CollectiveOp::AllGather | CollectiveOp::ReduceScatter => (big_n - 1.0) * ring_step,
                CollectiveOp::SendRecv => net.alpha_us + s / (net.beta_gbps * eff * 1e3),
            }
        } else {
            0.0
        };
        let phases = [d2h, reduce, network, h2d];
        let sum: f64 = phases.iter().sum();
        let max = phases.iter().copied().fold(0.0, f64::max);
        Ok(sum + (chunks as f64 - 1.0) * max)
    }

    /// Ring collective: `steps * (alpha + c / beta)` with
    ///
    /// | op | steps | c |
    /// |---|---|---|
    /// | allreduce | 2(n-1) | S/n |
    /// | allgather, reducescatter | n-1 | S/n |
    /// | sendrecv | 1 | S |
    ///
    /// With `device_link` allowed, the step link is the profile's device link. Otherwise each
    /// step bounces through the host (d2h then h2d, alphas added, slowest participant) and
    /// devices sharing an upstream link divide its bandwidth. When the ring crosses nodes, a
    /// step takes at least one network message `alpha_net + c / beta_net`. `eff` scales every
    /// bandwidth.
    fn ring_us(
        &self,
        op: CollectiveOp,
        devices: &[usize],
        bytes: f64,
        eff: f64,
        device_link: bool,
    ) -> Result<f64, ProjectError> {
        let n = devices.len() as f64;
        let (steps, c) = match op {
            CollectiveOp::AllReduce => (2.0 * (n - 1.0), bytes / n),
            CollectiveOp::AllGather | CollectiveOp::ReduceScatter => (n - 1.0, bytes / n),
            CollectiveOp::SendRecv => (1.0, bytes),
        };
        let intra = match (&self.profile.device_link, device_link) {
            (Some(dl), true) => dl.link().time_us(c / eff),
            _ => {
                let sharing = self.max_sharing(devices) as f64;
                let mut alpha: f64 = 0.0;
                let mut per_byte: f64 = 0.0;
                for &d in devices {
                    let link = &self.device(d)?.host_link;
                    alpha = alpha.max(link.d2h.alpha_us + link.h2d.alpha_us);
                    per_byte = per_byte
                        .max(1.0 / (link.d2h.beta_gbps * 1e3) + 1.0 / (link.h2d.beta_gbps * 1e3));
                }
                alpha + sharing * c * per_byte / eff
            }
        };
        let nodes = self.per_node(devices).len();
        let step = if nodes > 1 {
            intra.max(self.network(nodes)?.time_us(c / eff))
        } else {
            intra
        };
        Ok(steps * step)
    }

    /// Per-direction bandwidth of a path through PCIe among `devices`: the slowest link, divided
    /// among devices sharing one upstream link when the path goes through host memory.
    fn host_path_gbps(&self, devices: &[usize], through_host: bool) -> Result<f64, ProjectError> {
        let mut beta = f64::INFINITY;
        for &d in devices {
            let l = &self.device(d)?.host_link;
            beta = beta.min(l.d2h.beta_gbps.min(l.h2d.beta_gbps));
        }
        let sharing = if through_host {
            self.max_sharing(devices) as f64
        } else {
            1.0
        };
        Ok(beta / sharing)
    }

    fn device_link_gbps(&self) -> Result<f64, ProjectError> {
        self.profile
            .device_link
            .as_ref()
            .map(|l| l.beta_gbps)
            .ok_or_else(|| ProjectError::NoDeviceLink {
                profile: self.profile.name.clone(),
            })
    }

    /// Longest time over upstream links for `devices` each copying `bytes` in one direction.
    fn copy_phase_us(
        &self,
        devices: &[usize],
        direction: impl Fn(&super::profile::HostLinkSpec) -> LinkSpec,
        bytes: f64,
    ) -> Result<f64, ProjectError> {
        let mut per_uplink: BTreeMap<usize, f64> = BTreeMap::new();
        for &d in devices {
            let spec = self.device(d)?;
            let uplink = self.profile.uplink_of(d).unwrap_or(usize::MAX - d);
            *per_uplink.entry(uplink).or_insert(0.0) += direction(&spec.host_link).time_us(bytes);
        }
        Ok(per_uplink.values().copied().fold(0.0, f64::max))
    }

    /// Largest number of `devices` behind one upstream link.
    fn max_sharing(&self, devices: &[usize]) -> usize {
        let mut count: BTreeMap<Option<usize>, usize> = BTreeMap::new();
        for &d in devices {
            *count.entry(self.profile.uplink_of(d)).or_insert(0) += 1;
        }
        count.values().copied().max().unwrap_or(1)
    }

    /// Participants grouped by node.
    fn per_node(&self, devices: &[usize]) -> BTreeMap<usize, Vec<usize>> {
        let mut m: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for &d in devices {
            m.entry(self.profile.node_of(d)).or_default().push(d);
        }
        m
    }

    fn network(&self, nodes: usize) -> Result<LinkSpec, ProjectError> {
        self.profile
            .network
            .as_ref()
            .map(|n| n.link())
            .ok_or_else(|| ProjectError::NoNetwork {
                profile: self.profile.name.clone(),
                nodes,
            })
    }
}

/// Steps of a ring over `n` ranks: 2(n-1) for an all-reduce (reduce-scatter then
/// all-gather), n-1 for an all-gather or a reduce-scatter, one for a send/recv.
fn ring_steps(op: CollectiveOp, n: usize) -> f64 {
    let n = n as f64;
    match op {
        CollectiveOp::AllReduce => 2.0 * (n - 1.0),
        CollectiveOp::AllGather | CollectiveOp::ReduceScatter => n - 1.0,
        CollectiveOp::SendRecv => 1.0,
    }
}

/// nccl-tests' bus-bandwidth factor: the bytes each participant moves per byte of S.
fn bus_factor(op: CollectiveOp, n: usize) -> f64 {
    let n = n as f64;
    match op {
        CollectiveOp::AllReduce => 2.0 * (n - 1.0) / n,
        CollectiveOp::AllGather | CollectiveOp::ReduceScatter => (n - 1.0) / n,
        CollectiveOp::SendRecv => 1.0,
    }
}

/// A family's measured rates: its surface, the widths of the surface's curves, and its curve
/// by intensity alone.
type FamilyRates<'a> = (&'a [Vec<[f64; 3]>], &'a [f64], &'a [[f64; 2]]);

/// What a compute span asks of a device.
#[derive(Debug, Clone, Copy)]
struct ComputeWork {
    flops: u64,
    bytes: u64,
    kernels: u32,
    family: Option<KernelFamily>,
    precision: Precision,
    /// See [`Span::block_width`].
    block_width: Option<f64>,
    /// See [`Span::head`].
    head: Option<HeadWork>,
}

/// A calibrated device's time for a span (no launches): the family's measured surface at the
/// span's intensity and block width (where both span and surface know widths) or work per
/// dispatch, else its curve at the intensity, else the roofline of the measured rates (peaks
/// where none was measured).
fn measured_compute_us(d: &DeviceSpec, work: &ComputeWork) -> f64 {
    if let Some(us) = with_measured_head_us(d, work) {
        return us;
    }
    // 1 GFLOP/s = 1e3 FLOP per us, 1 GB/s = 1e3 bytes per us.
    if let Some(gflops) = measured_rate(d, work) {
        // The curve is an achieved rate at this intensity, memory stalls included: it is the
        // measured roofline itself, so no separate memory bound applies.
        return work.flops as f64 / (gflops * 1e3);
    }
    roofline_us(d, work)
}

/// The LM head is one large matrix streamed once: where the profile measured its rate (in
/// f32, as the surfaces), the head part is priced at it and the rest of the span as usual.
/// `None` where the span has no such head or the profile no head curve.
fn with_measured_head_us(d: &DeviceSpec, work: &ComputeWork) -> Option<f64> {
    let h = work
        .head
        .filter(|h| h.bytes > 0 && work.precision == Precision::F32)?;
    let gflops = rate_at(&d.rates.head_curve, h.flops as f64 / h.bytes as f64)?;
    let rest = ComputeWork {
        flops: work.flops.saturating_sub(h.flops),
        bytes: work.bytes.saturating_sub(h.bytes),
        head: None,
        ..*work
    };
    Some(measured_compute_us(d, &rest) + h.flops as f64 / (gflops * 1e3))
}

/// The measured rates of the span's kernel family at its precision (empty where none apply).
fn family_rates<'a>(d: &'a DeviceSpec, work: &ComputeWork) -> FamilyRates<'a> {
    match (work.family, work.precision) {
        (Some(KernelFamily::Matmul), Precision::F32) => (
            &d.rates.matmul_surface,
            &d.rates.matmul_surface_widths,
            &d.rates.matmul_curve,
        ),
        (Some(KernelFamily::Attention), _) => (
            &d.rates.attention_surface,
            &d.rates.attention_surface_widths,
            &d.rates.attention_curve,
        ),
        _ => (&[], &[], &[]),
    }
}

/// The achieved GFLOP/s the family's surface or curve gives the span, if any was measured.
fn measured_rate(d: &DeviceSpec, work: &ComputeWork) -> Option<f64> {
    let (flops, bytes) = (work.flops, work.bytes);
    // A measured curve knows how the rate depends on the shape (through the intensity); a
    // single rate does not, so the curve wins when both are given.
    let intensity = if bytes > 0 {
        flops as f64 / bytes as f64
    } else {
        f64::INFINITY
    };
    // A span with no recorded dispatches counts as one: its work is all in one dispatch.
    let mflop_per_dispatch = flops as f64 / 1e6 / f64::from(work.kernels.max(1));
    let (surface, widths, curve) = family_rates(d, work);
    // The surface also knows how the rate depends on the width of the work, so it wins over
    // the curve of one width; by the width itself where span and surface both record it,
    // else through the work per dispatch.
    let on_surface = match work.block_width {
        Some(w) if !widths.is_empty() => rate_on_surface_at_width(surface, widths, intensity, w),
        _ => None,
    };
    on_surface
        .or_else(|| rate_on_surface(surface, intensity, mflop_per_dispatch))
        .or_else(|| rate_at(curve, intensity))
}

/// The roofline of the device's single measured rates, its peaks where none was measured.
fn roofline_us(d: &DeviceSpec, work: &ComputeWork) -> f64 {
    let peak_gflops = match work.precision {
        Precision::F32 => d.f32_tflops * 1e3,
        Precision::F16 => d.f16_tflops * 1e3,
    };
    let gflops = match (work.family, work.precision) {
        (Some(KernelFamily::Matmul), Precision::F32) => d.rates.matmul_gflops,
        (Some(KernelFamily::Matmul), Precision::F16) => d.rates.matmul_f16_gflops,
        (Some(KernelFamily::Attention), _) => d.rates.attention_gflops,
        _ => None,
    }
    .unwrap_or(peak_gflops);
    let gbps = d.rates.elementwise_gbps.unwrap_or(d.memory_gbps);
    let math = work.flops as f64 / (gflops * 1e3);
    let memory = work.bytes as f64 / (gbps * 1e3);
    math.max(memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two devices, f32 1 TFLOP/s, 1000 GB/s memory, 2 us launch; host links alpha 10 us,
    /// beta 10 GB/s; host memory 10 GB/s.
    fn profile(shared_by: u32, device_link: bool, nodes: u32) -> HostProfile {
        let dl = if device_link {
            "[device_link]\nname = \"nv\"\nalpha_us = 10\nbeta_gbps = 100\n"
        } else {
            ""
        };
        let net = if nodes > 1 {
            "[network]\nname = \"ib\"\nalpha_us = 20\nbeta_gbps = 5\n"
        } else {
            ""
        };
        let text = format!(
            "name = \"t\"\nnodes = {nodes}\n[host]\nname = \"c\"\nmemory_gbps = 10\n\
             [[devices]]\nname = \"g\"\ncount = 2\nmemory_bytes = 1\nmemory_gbps = 1000\n\
             f32_tflops = 1\nf16_tflops = 2\nlaunch_overhead_us = 2\n\
             [devices.host_link]\nname = \"pcie\"\nshared_by = {shared_by}\n\
             h2d = {{ alpha_us = 10, beta_gbps = 10 }}\nd2h = {{ alpha_us = 10, beta_gbps = 10 }}\n\
             {dl}{net}"
        );
        HostProfile::from_toml_str(&text, "t.toml").unwrap()
    }

    #[test]
    fn roofline_takes_the_slower_bound_plus_launches() {
        let p = profile(1, false, 1);
        let m = CostModel::new(&p);
        // 50 MFLOP at 1 TFLOP/s = 50 us; 1 MB at 1000 GB/s = 1 us; + 2 us launch.
        let t = m
            .compute_us(0, 50_000_000, 1_000_000, 1, None, Precision::F32)
            .unwrap();
        assert_eq!(t, 52.0);
        // Memory-bound: 1 MFLOP = 1 us, 100 MB = 100 us; 3 launches = 6 us.
        let t = m
            .compute_us(0, 1_000_000, 100_000_000, 3, None, Precision::F32)
            .unwrap();
        assert_eq!(t, 106.0);
        // f16 doubles the math rate: 50 MFLOP at 2 TFLOP/s = 25 us.
        let t = m
            .compute_us(0, 50_000_000, 0, 0, None, Precision::F16)
            .unwrap();
        assert_eq!(t, 25.0);
    }

    #[test]
    fn a_rate_curve_follows_the_span_intensity() {
        let mut p = profile(1, false, 1);
        p.devices[0].rates.matmul_gflops = Some(900.0);
        p.devices[0].rates.matmul_curve = vec![[1.0, 100.0], [100.0, 500.0]];
        let m = CostModel::new(&p);
        let mm = Some(KernelFamily::Matmul);
        // Intensity 100 flops/byte: 50 MFLOP at 500 GFLOP/s = 100 us (+ 2 us launch); the
        // single rate of 900 GFLOP/s is ignored.
        let t = m
            .compute_us(0, 50_000_000, 500_000, 1, mm, Precision::F32)
            .unwrap();
        assert!((t - 102.0).abs() < 1e-9, "{t}");
        // Intensity 10, halfway in log scale: 300 GFLOP/s, 1 MFLOP takes 10/3 us.
        let t = m
            .compute_us(0, 1_000_000, 100_000, 0, mm, Precision::F32)
            .unwrap();
        assert!((t - 1e3 / 300.0).abs() < 1e-9, "{t}");
        // The curve already holds the memory stalls: a slow streaming rate does not bound it.
        p.devices[0].rates.elementwise_gbps = Some(0.001);
        let m = CostModel::new(&p);
        let t = m
            .compute_us(0, 1_000_000, 100_000, 0, mm, Precision::F32)
            .unwrap();
        assert!((t - 1e3 / 300.0).abs() < 1e-9, "{t}");
        // Without bytes the intensity is unbounded: the last point's rate.
        let t = m
            .compute_us(0, 50_000_000, 0, 0, mm, Precision::F32)
            .unwrap();
        assert!((t - 100.0).abs() < 1e-9, "{t}");
        // Attention has no curve here and no attention rate: the f32 peak (1 TFLOP/s).
        let t = m
            .compute_us(
                0,
                50_000_000,
                0,
                0,
                Some(KernelFamily::Attention),
                Precision::F32,
            )
            .unwrap();
        assert_eq!(t, 50.0);
    }

    #[test]
    fn calibrated_rates_replace_peaks() {
        let mut p = profile(1, false, 1);
        p.devices[0].rates.matmul_gflops = Some(500.0);
        p.devices[0].rates.elementwise_gbps = Some(250.0);
        let m = CostModel::new(&p);
        // 50 MFLOP at 500 GFLOP/s = 100 us, beats 1 MB at 250 GB/s = 4 us.
        let t = m
            .compute_us(
                0,
                50_000_000,
                1_000_000,
                0,
                Some(KernelFamily::Matmul),
                Precision::F32,
            )
            .unwrap();
        assert_eq!(t, 100.0);
        // Elementwise kernels keep the peak FLOP rate but use the measured bandwidth.
        let t = m
            .compute_us(
                0,
                0,
                1_000_000,
                0,
                Some(KernelFamily::Elementwise),
                Precision::F32,
            )
            .unwrap();
        assert_eq!(t, 4.0);
    }

    #[test]
    fn host_staged_allreduce_by_hand() {
        let s = 1_000_000;
        // d2h 10 + 100 = 110 us, reduce 3 MB at 10 GB/s = 300 us, h2d 110 us.
        let p = profile(1, false, 1);
        let t = CostModel::new(&p)
            .collective_us(
                CollectiveOp::AllReduce,
                Algorithm::HostStaged,
                &[0, 1],
                s,
                1,
            )
            .unwrap();
        assert_eq!(t, 520.0);
        // A shared uplink serialises the two copies in each direction: 220 + 300 + 220.
        let p = profile(2, false, 1);
        let m = CostModel::new(&p);
        let t = m
            .collective_us(
                CollectiveOp::AllReduce,
                Algorithm::HostStaged,
                &[0, 1],
                s,
                1,
            )
            .unwrap();
        assert_eq!(t, 740.0);
        // Four chunks of 250 kB: d2h 2 x (10 + 25) = 70, reduce 75, h2d 70 per chunk;
        // 215 + 3 x 75 = 440.
        let t = m
            .collective_us(
                CollectiveOp::AllReduce,
                Algorithm::HostStaged,
                &[0, 1],
                s,
                4,
            )
            .unwrap();
        assert_eq!(t, 440.0);
        // One participant: nothing to do.
        let t = m
            .collective_us(CollectiveOp::AllReduce, Algorithm::HostStaged, &[0], s, 1)
            .unwrap();
        assert_eq!(t, 0.0);
    }

    #[test]
    fn host_staged_other_ops_by_hand() {
        let p = profile(1, false, 1);
        let m = CostModel::new(&p);
        let s = 1_000_000;
        // allgather: d2h 10 + 50, no reduce, h2d 10 + 100.
        let t = m
            .collective_us(
                CollectiveOp::AllGather,
                Algorithm::HostStaged,
                &[0, 1],
                s,
                1,
            )
            .unwrap();
        assert_eq!(t, 170.0);
        // reducescatter: d2h 110, reduce 300, h2d 60.
        let t = m
            .collective_us(
                CollectiveOp::ReduceScatter,
                Algorithm::HostStaged,
                &[0, 1],
                s,
                1,
            )
            .unwrap();
        assert_eq!(t, 470.0);
        // sendrecv: 110 out, 110 in.
        let t = m
            .collective_us(CollectiveOp::SendRecv, Algorithm::HostStaged, &[0, 1], s, 1)
            .unwrap();
        assert_eq!(t, 220.0);
    }

    #[test]
    fn ring_by_hand() {
        let s = 1_000_000;
        // NVLink-like: 2(n-1) = 2 steps of 10 + 500 kB / 100 GB/s = 15 us.
        let p = profile(1, true, 1);
        let t = CostModel::new(&p)
            .collective_us(CollectiveOp::AllReduce, Algorithm::Ring, &[0, 1], s, 1)
            .unwrap();
        assert_eq!(t, 30.0);
        // Without device links each step bounces: 20 + 500 kB x (1/10 + 1/10 us per kB) = 120.
        let p = profile(1, false, 1);
        let t = CostModel::new(&p)
            .collective_us(CollectiveOp::AllReduce, Algorithm::Ring, &[0, 1], s, 1)
            .unwrap();
        assert_eq!(t, 240.0);
        // Behind one shared uplink the byte term doubles: 2 x (20 + 200) = 440.
        let p = profile(2, false, 1);
        let t = CostModel::new(&p)
            .collective_us(CollectiveOp::AllReduce, Algorithm::Ring, &[0, 1], s, 1)
            .unwrap();
        assert_eq!(t, 440.0);
    }

    #[test]
    fn collectives_across_nodes_pay_the_network() {
        // 2 nodes x 2 devices, devices 1 and 2 are on different nodes.
        let p = profile(1, true, 2);
        let m = CostModel::new(&p);
        let s = 1_000_000;
        // Ring step = max(NVLink 10 + 5, network 20 + 500 kB / 5 GB/s = 120) = 120; 2 steps.
        let t = m
            .collective_us(CollectiveOp::AllReduce, Algorithm::Ring, &[1, 2], s, 1)
            .unwrap();
        assert_eq!(t, 240.0);
        // Host-staged: d2h 110, reduce per node (1+1) MB = 200, network ring of 2 hosts
        // 2 x (20 + 100) = 240, h2d 110.
        let t = m
            .collective_us(
                CollectiveOp::AllReduce,
                Algorithm::HostStaged,
                &[1, 2],
                s,
                1,
            )
            .unwrap();
        assert_eq!(t, 660.0);
    }

    #[test]
    fn algorithm_names() {
        assert_eq!(Algorithm::parse("Host-Staged"), Some(Algorithm::HostStaged));
        assert_eq!(Algorithm::parse("ring"), Some(Algorithm::Ring));
        assert_eq!(Algorithm::parse("tree"), None);
        assert_eq!(Algorithm::HostStaged.name(), "host-staged");
    }
}
