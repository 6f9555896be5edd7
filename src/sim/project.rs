//! Projection: replaying a recorded timeline on a host profile.
//!
//! Every span gets a new duration from the [`CostModel`]; then the spans are re-scheduled as
//! early as these rules allow:
//! 1. a span starts after all its recorded dependencies end (plus a network hop when a
//!    device-to-host copy on one node feeds a host-to-device copy on another);
//! 2. a resource runs one span at a time, in recorded start order. Resources are tracks, except
//!    that host-link copies queue on their upstream link, so devices that share one (see
//!    `shared_by`) wait for each other;
//! 3. spans of one collective group start together, when the last participant is ready;
//! 4. (with [`StepBarriers::Idle`]) where nothing was running in the recorded run, the host was
//!    between steps: every later span waits for every earlier one. Not for a timeline whose
//!    engine recorded every wait of its driver ([`Timeline::has_complete_dependencies`], e.g.
//!    an in-flight pipeline, where micro-batches share no step boundary);
//!    A span released by an outside event (a request's arrival, [`Span::release_ns`])
//!    starts no earlier than the same time after the first span as it was released;
//! 5. compute spans of devices that share a processor ([`ComputeSharing`]) slow each other
//!    down while they overlap, by the profile's measured slowdown.
//!
//! Rule 5 makes a span's duration depend on the schedule, so the schedule is built by an
//! event-driven simulation in time order rather than a single pass over the dependency graph.
//! Wait spans take no time in the projection: waiting is whatever the new schedule makes it.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

use crate::trace::{
    us_to_ns, CollectiveInfo, Interval, Span, SpanId, SpanKind, Summary, Timeline, Track,
};

use super::cost::{Algorithm, CostModel};
use super::engine::{Engine, LinkKind};
use super::profile::{ComputeSharing, HostProfile};
use super::project_error::{ForwardDependency, ProjectError};
use super::report::{KindTotal, ProjectionReport};

/// Which algorithm a collective is costed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectivePolicy {
    /// The algorithm the run recorded.
    #[default]
    AsRecorded,
    /// The cheapest collective the engine can run on the profile (for the peak engine, a ring
    /// over NVLink instead of the host path): what the run would cost with the engine's comm
    /// layer tuned for that machine.
    Best,
}

/// What to do with host time between a span's inputs becoming ready and its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostGaps {
    /// Start spans as soon as the model allows (pure model).
    #[default]
    Drop,
    /// Keep each measured gap (host work such as encoding and submission that the timeline
    /// does not record as spans). Useful when projecting onto the calibrated profile of the
    /// machine that ran the trace.
    Keep,
}

/// Whether idle instants of the recorded run separate steps (rule 4 of the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepBarriers {
    /// An instant at which no recorded span was running (after the first one began) is a step
    /// boundary: every span that starts after it waits for every span that ended before it.
    /// Engines are driven by a host loop that collects a step's results before it issues the
    /// next step; that wait is not a recorded dependency, and without this rule a projection
    /// would overlap consecutive steps (a pipeline's next step would enter stage 0 while the
    /// previous one still runs on the last stage). A timeline that declares its dependencies
    /// complete ([`Timeline::has_complete_dependencies`]) records those waits, and is
    /// projected as with [`StepBarriers::Off`].
    #[default]
    Idle,
    /// Only recorded dependencies and resource order constrain the schedule.
    Off,
}

/// Options of [`project`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct ProjectOptions {
    /// Collective algorithm choice.
    pub collectives: CollectivePolicy,
    /// Host gap handling.
    pub host_gaps: HostGaps,
    /// Step boundaries at idle instants.
    pub barriers: StepBarriers,
}

/// The projected timeline and its report.
#[derive(Debug, Clone)]
pub struct Projection {
    /// Side-by-side numbers, printable with `Display`.
    pub report: ProjectionReport,
    /// The re-scheduled timeline (same spans and ids, new times), exportable as a Chrome trace.
    pub timeline: Timeline,
}

/// Where a span queues: its track, or the upstream link for host-link copies.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Resource {
    Track(Track),
    Uplink { to_device: bool, uplink: usize },
}

/// Projects `timeline` onto `profile` at the profile's peak figures ([`Engine::peak`]).
pub fn project(
    timeline: &Timeline,
    profile: &HostProfile,
    options: &ProjectOptions,
) -> Result<Projection, ProjectError> {
    project_engine(timeline, profile, &Engine::peak(), options)
}

/// Projects `timeline` onto `profile` as `engine` would run it: the engine's arithmetic and
/// efficiencies for compute, its wire format for transfers and collectives, and its choice of
/// collective on that machine.
pub fn project_engine(
    timeline: &Timeline,
    profile: &HostProfile,
    engine: &Engine,
    options: &ProjectOptions,
) -> Result<Projection, ProjectError> {
    if timeline.spans.is_empty() {
        return Err(ProjectError::EmptyTimeline);
    }
    let mut tl = timeline.clone();
    tl.validate()?;
    let mut options = *options;
    if tl.has_complete_dependencies() {
        options.barriers = StepBarriers::Off;
    }
    let options = &options;
    let spans = &tl.spans;
    let model = CostModel::with_engine(profile, engine);
    let devices = span_devices(spans, profile)?;
    let index_of: HashMap<_, usize> = spans.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
    check_dependency_order(spans, &index_of)?;
    let units = Units::of(spans)?;
    let (cost, via) = unit_costs(&model, profile, spans, &units, &devices, options)?;
    let resources: Vec<Resource> = spans
        .iter()
        .enumerate()
        .map(|(i, s)| resource_of(s, devices[i], profile))
        .collect();
    let preds = predecessors(profile, spans, &index_of, &devices, &resources, options);
    let waits = host_waits(spans, &preds, options);
    let pools = compute_pools(profile, spans, &units, &devices);
    let (start, end) = simulate(
        &units.members,
        &units.unit_of,
        &preds,
        (&waits.gap_us, &waits.release_us),
        &cost,
        &pools,
    )
    .map_err(|stuck| ProjectError::Cycle {
        span: spans[stuck].id,
        name: spans[stuck].name.clone(),
    })?;
    let placed = Placed {
        devices: &devices,
        start: &start,
        end: &end,
    };
    let report = projection_report(
        timeline,
        &tl,
        (profile, engine, &model),
        &placed,
        options,
        via,
    )?;
    Ok(Projection {
        report,
        timeline: projected_timeline(&tl, &placed, profile, engine),
    })
}

/// Each span's device (its own, or its track's), checked against the profile.
fn span_devices(spans: &[Span], profile: &HostProfile) -> Result<Vec<Option<usize>>, ProjectError> {
    let devices: Vec<Option<usize>> = spans
        .iter()
        .map(|s| s.device.or_else(|| s.track.device()).map(|d| d as usize))
        .collect();
    if let Some(max) = devices.iter().flatten().max() {
        if *max >= profile.device_count() {
            return Err(ProjectError::TooFewDevices {
                profile: profile.name.clone(),
                device: *max,
                available: profile.device_count(),
            });
        }
    }
    Ok(devices)
}

/// A dependency that started after its dependent is not something a run records; caught
/// here it names both spans, instead of surfacing as a cycle with resource order.
fn check_dependency_order(
    spans: &[Span],
    index_of: &HashMap<SpanId, usize>,
) -> Result<(), ProjectError> {
    for s in spans {
        for dep in &s.deps {
            if let Some(d) = index_of.get(dep).map(|&i| &spans[i]) {
                if d.start_ns > s.start_ns {
                    return Err(ProjectError::DependencyStartsLater(Box::new(
                        ForwardDependency {
                            span: s.id,
                            name: s.name.clone(),
                            start_us: s.start_us(),
                            dep: d.id,
                            dep_name: d.name.clone(),
                            dep_start_us: d.start_us(),
                        },
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Units of scheduling: a collective group is one unit, every other span is one alone.
struct Units {
    /// Each span's unit.
    unit_of: Vec<usize>,
    /// Each unit's spans, in span order.
    members: Vec<Vec<usize>>,
}

impl Units {
    fn of(spans: &[Span]) -> Result<Self, ProjectError> {
        let mut unit_of = vec![0usize; spans.len()];
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut group_unit: HashMap<u64, usize> = HashMap::new();
        for (i, s) in spans.iter().enumerate() {
            let group = s.collective.as_ref().and_then(|c| c.group);
            let unit = match group.and_then(|g| group_unit.get(&g).copied()) {
                Some(u) => {
                    check_same_collective(group.unwrap_or_default(), &spans[members[u][0]], s)?;
                    u
                }
                None => {
                    members.push(Vec::new());
                    let u = members.len() - 1;
                    if let Some(g) = group {
                        group_unit.insert(g, u);
                    }
                    u
                }
            };
            unit_of[i] = unit;
            members[unit].push(i);
        }
        Ok(Self { unit_of, members })
    }
}

/// The modelled cost of every span (a group's members share one collective cost), and the
/// links the collectives went over.
fn unit_costs(
    model: &CostModel<'_>,
    profile: &HostProfile,
    spans: &[Span],
    units: &Units,
    devices: &[Option<usize>],
    options: &ProjectOptions,
) -> Result<(Vec<f64>, Vec<LinkKind>), ProjectError> {
    let mut cost = vec![0.0f64; spans.len()];
    let mut via: Vec<LinkKind> = Vec::new();
    for unit_members in &units.members {
        let first = &spans[unit_members[0]];
        if first.kind == SpanKind::Collective {
            let (t, kind) = collective_cost(model, profile, spans, unit_members, devices, options)?;
            if let Some(kind) = kind.filter(|k| !via.contains(k)) {
                via.push(kind);
            }
            for &m in unit_members {
                cost[m] = t;
            }
        } else {
            cost[unit_members[0]] = span_cost(model, first, devices[unit_members[0]])?;
        }
    }
    Ok((cost, via))
}

/// Every span's predecessors with the network hop before it: the previous span on its
/// resource (by recorded start, then id), its recorded dependencies, and idle barriers when
/// the options ask for them.
fn predecessors(
    profile: &HostProfile,
    spans: &[Span],
    index_of: &HashMap<SpanId, usize>,
    devices: &[Option<usize>],
    resources: &[Resource],
    options: &ProjectOptions,
) -> Vec<Vec<(usize, f64)>> {
    let mut by_resource: HashMap<&Resource, Vec<usize>> = HashMap::new();
    for (i, r) in resources.iter().enumerate() {
        by_resource.entry(r).or_default().push(i);
    }
    let mut preds: Vec<Vec<(usize, f64)>> = vec![Vec::new(); spans.len()];
    for list in by_resource.values_mut() {
        list.sort_by_key(|&i| (spans[i].start_ns, spans[i].id));
        for w in list.windows(2) {
            preds[w[1]].push((w[0], 0.0));
        }
    }
    for (i, s) in spans.iter().enumerate() {
        for dep in &s.deps {
            // validate() guarantees every dependency exists.
            if let Some(&p) = index_of.get(dep) {
                let hop = network_hop_us(profile, &spans[p], devices[p], s, devices[i]);
                preds[i].push((p, hop));
            }
        }
    }
    if options.barriers == StepBarriers::Idle {
        for (from, to) in idle_barriers(spans, resources) {
            preds[to].push((from, 0.0));
        }
    }
    preds
}

/// What holds a span back besides its predecessors, in microseconds on the projection's
/// clock (the first span starts at 0).
struct HostWaits {
    /// Earliest start: when the requests it serves arrived.
    release_us: Vec<f64>,
    /// The measured host gap (start minus the latest end of its predecessors), when kept.
    gap_us: Vec<f64>,
}

fn host_waits(spans: &[Span], preds: &[Vec<(usize, f64)>], options: &ProjectOptions) -> HostWaits {
    let first_start = spans.iter().map(|s| s.start_ns).min().unwrap_or(0);
    let release_us = spans
        .iter()
        .map(|s| {
            s.release_ns
                .map_or(0.0, |r| r.saturating_sub(first_start) as f64 / 1e3)
        })
        .collect();
    let gap_us = (0..spans.len())
        .map(|i| match options.host_gaps {
            HostGaps::Drop => 0.0,
            HostGaps::Keep => {
                let ready = preds[i]
                    .iter()
                    .map(|&(p, _)| spans[p].end_ns())
                    .max()
                    .unwrap_or(first_start);
                spans[i].start_ns.saturating_sub(ready) as f64 / 1e3
            }
        })
        .collect();
    HostWaits { release_us, gap_us }
}

/// The shared processor each compute unit runs on (its rate depends on what else runs there).
fn compute_pools<'a>(
    profile: &'a HostProfile,
    spans: &[Span],
    units: &Units,
    devices: &[Option<usize>],
) -> Vec<Option<Shared<'a>>> {
    units
        .members
        .iter()
        .map(|m| {
            let s = &spans[m[0]];
            match (s.kind, devices[m[0]]) {
                (SpanKind::Compute, Some(d)) => {
                    profile.compute_pool_of(d).map(|(pool, sharing)| Shared {
                        pool,
                        sharing,
                        intensity: if s.bytes > 0 {
                            s.flops as f64 / s.bytes as f64
                        } else {
                            f64::INFINITY
                        },
                    })
                }
                _ => None,
            }
        })
        .collect()
}

/// Where and when the projection placed every span.
struct Placed<'a> {
    devices: &'a [Option<usize>],
    start: &'a [f64],
    end: &'a [f64],
}

/// The report: measured and projected summaries, totals by kind, the submission overhead
/// charged, and notes.
fn projection_report(
    timeline: &Timeline,
    tl: &Timeline,
    (profile, engine, model): (&HostProfile, &Engine, &CostModel<'_>),
    placed: &Placed<'_>,
    options: &ProjectOptions,
    via: Vec<LinkKind>,
) -> Result<ProjectionReport, ProjectError> {
    let spans = &tl.spans;
    let device_count = tl.device_count();
    let projected = Summary::from_intervals(
        device_count,
        (0..spans.len()).map(|i| Interval {
            kind: spans[i].kind,
            device: placed.devices[i].map(|d| d as u32),
            start_us: placed.start[i],
            end_us: placed.end[i],
            bytes: spans[i].bytes,
        }),
    );
    let mut submit_overhead_us = 0.0;
    for (s, d) in spans.iter().zip(placed.devices) {
        if let (SpanKind::Compute, Some(d)) = (s.kind, d) {
            submit_overhead_us += model.submit_us(*d)?;
        }
    }
    let mut notes = Vec::new();
    if profile.lacks_submit_overhead() {
        notes.push(format!(
            "profile `{}` was calibrated before `wgpar calibrate` measured the fixed cost of a \
             submission (`submit_overhead_us`); it is taken as 0, so short steps come out fast: \
             calibrate again",
            profile.name
        ));
    }
    Ok(ProjectionReport {
        profile: profile.name.clone(),
        engine: engine.label().to_owned(),
        collectives_via: via.iter().map(|k| k.name().to_owned()).collect(),
        profile_devices: profile.device_count(),
        devices_used: device_count,
        spans: spans.len(),
        options: *options,
        measured: timeline.summary(),
        projected,
        by_kind: totals_by_kind(spans, placed),
        submit_overhead_us,
        notes,
    })
}

/// Measured and projected time per span kind, for the kinds the timeline has.
fn totals_by_kind(spans: &[Span], placed: &Placed<'_>) -> Vec<KindTotal> {
    SpanKind::ALL
        .iter()
        .filter(|k| spans.iter().any(|s| s.kind == **k))
        .map(|&k| KindTotal {
            kind: k,
            measured_us: spans.iter().filter(|s| s.kind == k).map(Span::dur_us).sum(),
            projected_us: (0..spans.len())
                .filter(|&i| spans[i].kind == k)
                .map(|i| placed.end[i] - placed.start[i])
                .sum(),
        })
        .collect()
}

/// The timeline with every span moved to where the projection placed it.
fn projected_timeline(
    tl: &Timeline,
    placed: &Placed<'_>,
    profile: &HostProfile,
    engine: &Engine,
) -> Timeline {
    let mut out = tl.clone();
    for (i, s) in out.spans.iter_mut().enumerate() {
        s.start_ns = us_to_ns(placed.start[i]);
        s.dur_ns = us_to_ns(placed.end[i]).saturating_sub(s.start_ns);
    }
    out.meta
        .insert("projected_onto".to_owned(), profile.name.clone());
    out.meta
        .insert("projected_engine".to_owned(), engine.name.clone());
    out
}

/// Modelled duration of a non-collective span.
fn span_cost(model: &CostModel<'_>, s: &Span, device: Option<usize>) -> Result<f64, ProjectError> {
    let need_device = || {
        device.ok_or_else(|| ProjectError::NoDevice {
            span: s.id,
            name: s.name.clone(),
            kind: s.kind.label(),
        })
    };
    match s.kind {
        // One compute span is one submission and its wait: its dispatches plus the
        // submission's fixed host cost.
        SpanKind::Compute => {
            let device = need_device()?;
            Ok(model.span_compute_us(device, s)? + model.submit_us(device)?)
        }
        SpanKind::DeviceToHost => model.d2h_us(need_device()?, s.bytes as f64),
        SpanKind::HostToDevice => model.h2d_us(need_device()?, s.bytes as f64),
        SpanKind::HostReduce => Ok(model.host_reduce_us(s.bytes as f64)),
        SpanKind::Wait => Ok(0.0),
        // Collectives are costed per unit by `collective_cost`.
        SpanKind::Collective => Ok(0.0),
    }
}

/// Cost of the collective a unit's members took part in, and the path it took (none with a
/// single participant).
fn collective_cost(
    model: &CostModel<'_>,
    profile: &HostProfile,
    spans: &[Span],
    unit: &[usize],
    devices: &[Option<usize>],
    options: &ProjectOptions,
) -> Result<(f64, Option<LinkKind>), ProjectError> {
    let first = &spans[unit[0]];
    let info: &CollectiveInfo =
        first
            .collective
            .as_ref()
            .ok_or_else(|| ProjectError::NotACollective {
                span: first.id,
                name: first.name.clone(),
            })?;
    // "auto" (modeled timelines): whatever the engine prefers on the machine.
    let known = Algorithm::parse(&info.algorithm).is_some()
        || info.algorithm == "auto"
        || model
            .engine()
            .collectives
            .iter()
            .any(|c| c.kind.name() == info.algorithm);
    if !known {
        return Err(ProjectError::UnknownAlgorithm {
            span: first.id,
            name: first.name.clone(),
            algorithm: info.algorithm.clone(),
        });
    }
    // Participants: the recorded members' devices, topped up with the lowest free indices
    // when fewer participants recorded a span than the collective had.
    let mut parts: BTreeSet<usize> = unit.iter().filter_map(|&m| devices[m]).collect();
    let wanted = (info.participants as usize).max(parts.len());
    let mut next = 0;
    while parts.len() < wanted {
        parts.insert(next);
        next += 1;
    }
    let parts: Vec<usize> = parts.into_iter().collect();
    if let Some(&max) = parts.last() {
        if max >= profile.device_count() {
            return Err(ProjectError::TooFewDevices {
                profile: profile.name.clone(),
                device: max,
                available: profile.device_count(),
            });
        }
    }
    if parts.len() < 2 {
        return Ok((0.0, None));
    }
    let (t, kind) = model.engine_collective_us(
        info.op,
        &info.algorithm,
        options.collectives,
        &parts,
        first.bytes,
        info.chunks,
    )?;
    Ok((t, Some(kind)))
}

fn check_same_collective(group: u64, first: &Span, other: &Span) -> Result<(), ProjectError> {
    let same = match (&first.collective, &other.collective) {
        (Some(a), Some(b)) => {
            a.op == b.op
                && a.algorithm == b.algorithm
                && a.participants == b.participants
                && a.chunks == b.chunks
                && first.bytes == other.bytes
                && first.kind == other.kind
        }
        _ => false,
    };
    if same {
        Ok(())
    } else {
        Err(ProjectError::MixedGroup {
            group,
            first: first.id,
            span: other.id,
            name: other.name.clone(),
        })
    }
}

fn resource_of(s: &Span, device: Option<usize>, profile: &HostProfile) -> Resource {
    let uplink = device.and_then(|d| profile.uplink_of(d));
    match (&s.track, s.kind, uplink) {
        (Track::DeviceToHost(_), SpanKind::DeviceToHost, Some(uplink)) => Resource::Uplink {
            to_device: false,
            uplink,
        },
        (Track::HostToDevice(_), SpanKind::HostToDevice, Some(uplink)) => Resource::Uplink {
            to_device: true,
            uplink,
        },
        _ => Resource::Track(s.track.clone()),
    }
}

/// Extra time on a dependency edge: a device-to-host copy on one node feeding a
/// host-to-device copy on another crosses the network once.
fn network_hop_us(
    profile: &HostProfile,
    from: &Span,
    from_device: Option<usize>,
    to: &Span,
    to_device: Option<usize>,
) -> f64 {
    match (from.kind, to.kind, from_device, to_device, &profile.network) {
        (SpanKind::DeviceToHost, SpanKind::HostToDevice, Some(a), Some(b), Some(net))
            if profile.node_of(a) != profile.node_of(b) =>
        {
            net.link().time_us(to.bytes as f64)
        }
        _ => 0.0,
    }
}

/// Dependencies that rule 4 adds: at each instant where no recorded span was running, the
/// first span of every resource after it waits for the last span of every resource before it
/// (later spans of a resource follow through resource order). Returns `(from, to)` indices.
fn idle_barriers(spans: &[Span], resources: &[Resource]) -> Vec<(usize, usize)> {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| (spans[i].start_ns, spans[i].id));
    let mut edges = Vec::new();
    let mut last_on: HashMap<&Resource, usize> = HashMap::new();
    let mut served_epoch: HashMap<&Resource, usize> = HashMap::new();
    let mut frontier: Vec<usize> = Vec::new();
    let mut epoch = 0;
    let mut latest_end: Option<u64> = None;
    for &i in &order {
        if latest_end.is_some_and(|e| spans[i].start_ns > e) {
            epoch += 1;
            frontier = last_on.values().copied().collect();
            frontier.sort_unstable();
        }
        let r = &resources[i];
        if epoch > 0 && served_epoch.get(r).copied().unwrap_or(0) < epoch {
            edges.extend(frontier.iter().map(|&f| (f, i)));
        }
        served_epoch.insert(r, epoch);
        last_on.insert(r, i);
        latest_end = Some(latest_end.map_or(spans[i].end_ns(), |e| e.max(spans[i].end_ns())));
    }
    edges
}

/// A time-ordered event: (time in microseconds, unit). Ties go to the lower unit, so the
/// schedule does not depend on hash order.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Event(f64, usize);

impl Eq for Event {}

impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Event {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
    }
}

/// Where a compute unit shares a processor, and its intensity.
struct Shared<'a> {
    pool: usize,
    sharing: &'a ComputeSharing,
    /// Flops per byte of the unit's span.
    intensity: f64,
}

/// A compute span running on a shared processor.
struct Running {
    unit: usize,
    /// Remaining work, in microseconds of running alone.
    left_us: f64,
    /// Flops per byte, which sets how much the span slows down when shared.
    intensity: f64,
}

/// Compute spans running on one shared processor.
struct Pool<'a> {
    sharing: &'a ComputeSharing,
    active: Vec<Running>,
}

impl Pool<'_> {
    /// How many times slower than alone `r` runs with the current company.
    fn slowdown(&self, r: &Running) -> f64 {
        self.sharing.slowdown_at(self.active.len(), r.intensity)
    }
}

/// Work below this many microseconds counts as done (floating-point residue).
const DONE_US: f64 = 1e-6;

/// Event-driven schedule of the units: a unit starts when every predecessor outside it has
/// ended (plus hops) and its host gap has passed, and not before its release time; it then runs for its cost, or, on a shared
/// processor, until its work is done at the rate the current sharing allows. Returns start and
/// end per span, or the index of a span stuck in a cycle.
fn simulate(
    members: &[Vec<usize>],
    unit_of: &[usize],
    preds: &[Vec<(usize, f64)>],
    (gap_us, release_us): (&[f64], &[f64]),
    cost: &[f64],
    pool_of_unit: &[Option<Shared<'_>>],
) -> Result<(Vec<f64>, Vec<f64>), usize> {
    let graph = Graph {
        members,
        unit_of,
        preds,
        gap_us,
        release_us,
    };
    let mut sim = Sim::new(&graph);
    while let Some(t) = sim.next_event() {
        sim.advance_to(t);
        for u in sim.finished() {
            sim.finish(u);
        }
        sim.start_ready(cost, pool_of_unit);
    }
    if sim.done < members.len() {
        let stuck = (0..unit_of.len())
            .find(|&i| sim.indegree[unit_of[i]] > 0)
            .unwrap_or(0);
        return Err(stuck);
    }
    Ok((sim.start, sim.end))
}

/// The units and what orders them: each unit's spans, each span's unit and predecessors
/// (with hops), host gaps and release times.
struct Graph<'g> {
    members: &'g [Vec<usize>],
    unit_of: &'g [usize],
    preds: &'g [Vec<(usize, f64)>],
    gap_us: &'g [f64],
    release_us: &'g [f64],
}

impl Graph<'_> {
    /// Earliest start of unit `u` once its predecessors outside it have ended.
    fn ready_at(&self, u: usize, end: &[f64]) -> f64 {
        self.members[u]
            .iter()
            .map(|&m| {
                let after = self.preds[m]
                    .iter()
                    .filter(|&&(p, _)| self.unit_of[p] != u)
                    .map(|&(p, hop)| end[p] + hop)
                    .fold(0.0, f64::max);
                (after + self.gap_us[m]).max(self.release_us[m])
            })
            .fold(0.0, f64::max)
    }
}

/// The simulation's state: unit successors and remaining predecessors, span times, the
/// queues of starts and fixed-length ends, and the shared processors' running work.
struct Sim<'g, 'p> {
    graph: &'g Graph<'g>,
    succ: Vec<BTreeSet<usize>>,
    indegree: Vec<usize>,
    start: Vec<f64>,
    end: Vec<f64>,
    starts: BinaryHeap<Reverse<Event>>,
    ends: BinaryHeap<Reverse<Event>>,
    pools: BTreeMap<usize, Pool<'p>>,
    now: f64,
    done: usize,
}

impl<'g, 'p> Sim<'g, 'p> {
    fn new(graph: &'g Graph<'g>) -> Self {
        let units = graph.members.len();
        let mut succ: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); units];
        let mut indegree = vec![0usize; units];
        for (i, ps) in graph.preds.iter().enumerate() {
            for &(p, _) in ps {
                let (from, to) = (graph.unit_of[p], graph.unit_of[i]);
                if from != to && succ[from].insert(to) {
                    indegree[to] += 1;
                }
            }
        }
        let n = graph.unit_of.len();
        let end = vec![0.0f64; n];
        let starts = (0..units)
            .filter(|&u| indegree[u] == 0)
            .map(|u| Reverse(Event(graph.ready_at(u, &end), u)))
            .collect();
        Self {
            graph,
            succ,
            indegree,
            start: vec![0.0f64; n],
            end,
            starts,
            ends: BinaryHeap::new(),
            pools: BTreeMap::new(),
            now: 0.0,
            done: 0,
        }
    }

    /// The next start, fixed end, or end of shared work at the current rates.
    fn next_event(&self) -> Option<f64> {
        let next_start = self.starts.peek().map(|e| e.0 .0);
        let next_end = self.ends.peek().map(|e| e.0 .0);
        let next_pool = self
            .pools
            .values()
            .filter(|p| !p.active.is_empty())
            .map(|p| {
                let soonest = (p.active.iter())
                    .map(|r| r.left_us * p.slowdown(r))
                    .fold(f64::INFINITY, f64::min);
                self.now + soonest
            })
            .reduce(f64::min);
        [next_start, next_end, next_pool]
            .into_iter()
            .flatten()
            .reduce(f64::min)
    }

    /// Moves the clock to `t`, the shared work progressing at its current rates.
    fn advance_to(&mut self, t: f64) {
        let t = t.max(self.now);
        for p in self.pools.values_mut() {
            let rates: Vec<f64> = p.active.iter().map(|r| 1.0 / p.slowdown(r)).collect();
            for (r, rate) in p.active.iter_mut().zip(rates) {
                r.left_us -= (t - self.now) * rate;
            }
        }
        self.now = t;
    }

    /// Units that end now (fixed ends due, shared work done), in unit order.
    fn finished(&mut self) -> Vec<usize> {
        let mut finished: Vec<usize> = Vec::new();
        while self.ends.peek().is_some_and(|e| e.0 .0 <= self.now) {
            if let Some(Reverse(Event(_, u))) = self.ends.pop() {
                finished.push(u);
            }
        }
        for p in self.pools.values_mut() {
            p.active.retain(|r| {
                let over = r.left_us <= DONE_US;
                if over {
                    finished.push(r.unit);
                }
                !over
            });
        }
        finished.sort_unstable();
        finished
    }

    /// Unit `u` ends now; successors whose predecessors have all ended get their start.
    fn finish(&mut self, u: usize) {
        self.done += 1;
        for &m in &self.graph.members[u] {
            self.end[m] = self.now;
        }
        for &v in &self.succ[u] {
            self.indegree[v] -= 1;
            if self.indegree[v] == 0 {
                let at = self.graph.ready_at(v, &self.end);
                self.starts.push(Reverse(Event(at, v)));
            }
        }
    }

    /// Starts every unit due now: on its shared processor, or for its fixed cost.
    fn start_ready(&mut self, cost: &[f64], pool_of_unit: &[Option<Shared<'p>>]) {
        while self.starts.peek().is_some_and(|e| e.0 .0 <= self.now) {
            let Some(Reverse(Event(_, u))) = self.starts.pop() else {
                break;
            };
            let c = cost[self.graph.members[u][0]];
            for &m in &self.graph.members[u] {
                self.start[m] = self.now;
            }
            match &pool_of_unit[u] {
                Some(shared) if c > DONE_US => self
                    .pools
                    .entry(shared.pool)
                    .or_insert_with(|| Pool {
                        sharing: shared.sharing,
                        active: Vec::new(),
                    })
                    .active
                    .push(Running {
                        unit: u,
                        left_us: c,
                        intensity: shared.intensity,
                    }),
                _ => self.ends.push(Reverse(Event(self.now + c, u))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{KernelFamily, SpanAttrs};

    fn work(name: &'static str, device: u32) -> SpanAttrs {
        SpanAttrs::compute(name, device)
            .flops(1_000_000)
            .bytes(1_000_000)
            .family(KernelFamily::Matmul)
    }

    /// Two independent spans on two devices, the second recorded after an idle instant.
    fn two_steps() -> Timeline {
        let mut tl = Timeline::new();
        tl.push_us(work("a", 0), 0.0, 100.0);
        tl.push_us(work("b", 1), 300.0, 100.0);
        tl
    }

    fn starts(p: &Projection) -> Vec<u64> {
        p.timeline.spans.iter().map(|s| s.start_ns).collect()
    }

    #[test]
    fn idle_instants_are_barriers_unless_dependencies_are_complete() {
        let profile = HostProfile::resolve("pcie4-2gpu").unwrap();
        let opts = ProjectOptions::default();
        let barred = project(&two_steps(), &profile, &opts).unwrap();
        let s = starts(&barred);
        assert!(
            s[1] > 0 && s[1] >= barred.timeline.spans[0].end_ns(),
            "{s:?}"
        );

        let mut complete = two_steps();
        complete
            .meta
            .insert("dependencies".into(), "complete".into());
        assert!(complete.has_complete_dependencies());
        let free = project(&complete, &profile, &opts).unwrap();
        assert_eq!(starts(&free), vec![0, 0]);
        assert_eq!(free.report.options.barriers, StepBarriers::Off);
    }

    #[test]
    fn a_released_span_starts_no_earlier_than_its_release() {
        let profile = HostProfile::resolve("pcie4-2gpu").unwrap();
        let mut tl = Timeline::new();
        tl.meta.insert("dependencies".into(), "complete".into());
        // The first span starts 1 ms after the epoch; the second was released 5 ms later.
        tl.push_us(work("a", 0), 1000.0, 100.0);
        tl.push_us(work("b", 1).not_before_us(6000.0), 6100.0, 100.0);
        let p = project(&tl, &profile, &ProjectOptions::default()).unwrap();
        assert_eq!(p.timeline.spans[1].start_ns, 5_000_000);
        // Without the release it would start at once on its idle device.
        tl.spans[1].release_ns = None;
        let p = project(&tl, &profile, &ProjectOptions::default()).unwrap();
        assert_eq!(p.timeline.spans[1].start_ns, 0);
    }
}
