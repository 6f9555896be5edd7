//! One timeline from the traces of several processes (MPI ranks): clocks aligned by each
//! trace's offset from the job's start-up barrier, devices numbered through the ranks (packed,
//! or one rank per node of a multi-node profile), span ids renumbered in time order, and the
//! dependencies between ranks (a message received on one rank after a span of another) made
//! real dependencies, so that `sim::project` replays the whole job.

use std::collections::{BTreeMap, HashMap};

use thiserror::Error;

use super::span::{Span, SpanId, SpanKind, Track};
use super::timeline::Timeline;

/// Collective group ids with this bit set belong to a collective across processes: every rank
/// numbers them alike, so they are kept; other ids are made unique per rank.
pub const CROSS_PROCESS_GROUP: u64 = 1 << 63;

/// Trace metadata keys a rank's trace carries.
pub mod keys {
    /// This process's rank.
    pub const RANK: &str = "mpi_rank";
    /// Ranks in the job.
    pub const SIZE: &str = "mpi_size";
    /// The rank's host name.
    pub const HOST: &str = "mpi_host";
    /// Microseconds from the job's start-up barrier to this trace's time zero.
    pub const CLOCK_OFFSET_US: &str = "mpi_clock_offset_us";
    /// Devices this rank opened.
    pub const DEVICES: &str = "mpi_devices";
    /// The run's options as every rank saw them (model, strategy, batch, lengths, seed): the
    /// traces of one job carry the same.
    pub const RUN: &str = "mpi_run";
}

/// Metadata that names the run a trace belongs to: where two traces both carry one, they
/// must agree to be merged.
const RUN_IDENTITY: [&str; 7] = [
    keys::SIZE,
    keys::RUN,
    "model",
    "strategy",
    "dtype",
    "batch",
    "gen",
];

/// How the ranks' devices are numbered in the merged timeline (which decides which node of a
/// host profile each rank lands on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankPlacement {
    /// Consecutively: rank 1's first device follows rank 0's last (ranks on one machine).
    Pack,
    /// Rank r's devices start at `r * n`: one rank per node of `n` devices.
    PerNode(usize),
}

/// Why traces could not be merged.
#[derive(Debug, Error, PartialEq)]
pub enum MergeError {
    /// A trace lacks the rank metadata.
    #[error("trace {index} has no '{key}' metadata: is it a rank trace of `mpirun ... wgpar run --trace`?")]
    NotARankTrace {
        /// Position in the list given.
        index: usize,
        /// The missing key.
        key: &'static str,
    },
    /// The traces are not exactly ranks 0..n of one job.
    #[error(
        "the traces are ranks {found:?} of a {size}-rank job: pass one trace per rank, each once"
    )]
    Ranks {
        /// Ranks found.
        found: Vec<usize>,
        /// The job's size.
        size: usize,
    },
    /// A rank has more devices than a node holds.
    #[error("rank {rank} has {devices} devices but a node of the profile holds {per_node}")]
    NodeTooSmall {
        /// The rank.
        rank: usize,
        /// Its devices.
        devices: usize,
        /// Devices per node.
        per_node: usize,
    },
    /// Two traces of different runs (or jobs of different sizes).
    #[error(
        "trace {index} is of another run than trace {first_index}: its '{key}' is '{value}', \
         trace {first_index}'s is '{first}'; pass the rank traces of one run"
    )]
    DifferentRuns {
        /// The metadata that differs.
        key: &'static str,
        /// The first trace that has it.
        first_index: usize,
        /// Its value there.
        first: String,
        /// The trace that differs.
        index: usize,
        /// Its value there.
        value: String,
    },
    /// A rank claims more devices than one process can select.
    #[error("rank {rank} has {devices} devices; a rank opens at most {max}")]
    TooManyDevices {
        /// The rank.
        rank: usize,
        /// Its `mpi_devices`.
        devices: usize,
        /// The most a process selects.
        max: usize,
    },
    /// A remote dependency names a span that does not exist.
    #[error("rank {rank}'s span {span} waits for span {remote} of rank {from}, which its trace does not have")]
    UnknownRemote {
        /// The waiting rank.
        rank: usize,
        /// Its span.
        span: SpanId,
        /// The rank named.
        from: usize,
        /// The missing span.
        remote: SpanId,
    },
}

fn meta<'a>(t: &'a Timeline, index: usize, key: &'static str) -> Result<&'a str, MergeError> {
    t.meta
        .get(key)
        .map(String::as_str)
        .ok_or(MergeError::NotARankTrace { index, key })
}

/// Where rank `rank` of an MPI run writes the trace asked for as `path`: `run.json` ->
/// `run.rank1.json` (`run` -> `run.rank1`).
pub fn rank_trace_path(path: &str, rank: usize) -> String {
    match path.strip_suffix(".json") {
        Some(stem) => format!("{stem}.rank{rank}.json"),
        None => format!("{path}.rank{rank}"),
    }
}

/// Refuses traces whose run identity ([`RUN_IDENTITY`]) differs, whatever their order.
fn same_run(traces: &[Timeline]) -> Result<(), MergeError> {
    for key in RUN_IDENTITY {
        let mut first: Option<(usize, &String)> = None;
        for (index, t) in traces.iter().enumerate() {
            let Some(value) = t.meta.get(key) else {
                continue;
            };
            match first {
                None => first = Some((index, value)),
                Some((first_index, seen)) if seen != value => {
                    return Err(MergeError::DifferentRuns {
                        key,
                        first_index,
                        first: seen.clone(),
                        index,
                        value: value.clone(),
                    })
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}

impl Timeline {
    /// The job's size if this is one rank's trace of a multi-rank run (`None` otherwise).
    pub fn rank_of_job(&self) -> Option<(usize, usize)> {
        let rank = self.meta.get(keys::RANK)?.parse().ok()?;
        let size = self.meta.get(keys::SIZE)?.parse().ok()?;
        Some((rank, size))
    }

    /// Merges one trace per rank (any order) into one timeline (see the module docs).
    pub fn merge_ranks(
        traces: &[Timeline],
        placement: RankPlacement,
    ) -> Result<Timeline, MergeError> {
        let ranked = ranked_traces(traces)?;
        let offsets = device_offsets(&ranked, placement)?;
        let all = shifted_spans(&ranked, &offsets);
        let ids: HashMap<(usize, SpanId), SpanId> = all
            .iter()
            .enumerate()
            .map(|(i, (r, s))| ((*r, s.id), SpanId(i as u64 + 1)))
            .collect();
        let extra = remote_dependencies(&ranked, &ids)?;
        let (mut out, dropped) = renumbered(all, &ids, extra);
        for ((r, t), &off) in ranked.iter().zip(&offsets) {
            let host = t.meta.get(keys::HOST).cloned().unwrap_or_default();
            for (d, label) in &t.devices {
                out.devices
                    .insert(d + off, format!("rank {r} ({host}): {label}"));
            }
        }
        out.meta = merged_meta(&ranked, dropped);
        Ok(out)
    }
}

/// The traces by rank, checked to be one run's ranks 0..size, each once.
fn ranked_traces(traces: &[Timeline]) -> Result<Vec<(usize, &Timeline)>, MergeError> {
    let mut ranked: Vec<(usize, &Timeline)> = Vec::with_capacity(traces.len());
    let mut size = 0;
    for (i, t) in traces.iter().enumerate() {
        let number = |key| {
            meta(t, i, key)?
                .parse::<usize>()
                .map_err(|_| MergeError::NotARankTrace { index: i, key })
        };
        let rank = number(keys::RANK)?;
        size = number(keys::SIZE)?;
        ranked.push((rank, t));
    }
    same_run(traces)?;
    ranked.sort_by_key(|(r, _)| *r);
    let found: Vec<usize> = ranked.iter().map(|(r, _)| *r).collect();
    // Every trace gives the same size (checked above); the ranks must be 0..size, each once.
    if size == 0 || size != found.len() || found.iter().enumerate().any(|(i, &r)| i != r) {
        return Err(MergeError::Ranks { found, size });
    }
    Ok(ranked)
}

/// The first global device of each rank: packed one after another, or `n` per node.
fn device_offsets(
    ranked: &[(usize, &Timeline)],
    placement: RankPlacement,
) -> Result<Vec<u32>, MergeError> {
    let mut offsets = Vec::with_capacity(ranked.len());
    let mut next = 0usize;
    for (r, t) in ranked {
        let devices = t
            .meta
            .get(keys::DEVICES)
            .and_then(|d| d.parse().ok())
            .unwrap_or(0usize)
            .max(t.device_count());
        let max = crate::device::MAX_DEVICES;
        if devices > max {
            return Err(MergeError::TooManyDevices {
                rank: *r,
                devices,
                max,
            });
        }
        let off = match placement {
            RankPlacement::Pack => next,
            RankPlacement::PerNode(n) if devices > n => {
                return Err(MergeError::NodeTooSmall {
                    rank: *r,
                    devices,
                    per_node: n,
                })
            }
            RankPlacement::PerNode(n) => r * n,
        };
        next = off + devices;
        offsets.push(off as u32);
    }
    Ok(offsets)
}

/// Every rank's spans on the common clock (the earliest at or after 0), on their global
/// devices and tracks, with per-rank collective groups kept apart; sorted by time.
fn shifted_spans(ranked: &[(usize, &Timeline)], offsets: &[u32]) -> Vec<(usize, Span)> {
    let shifts: Vec<i64> = ranked
        .iter()
        .map(|(_, t)| {
            let us: f64 = t
                .meta
                .get(keys::CLOCK_OFFSET_US)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            (us * 1e3).round() as i64
        })
        .collect();
    let origin = ranked
        .iter()
        .zip(&shifts)
        .flat_map(|((_, t), sh)| t.spans.iter().map(move |s| s.start_ns as i64 + sh))
        .min()
        .unwrap_or(0)
        .min(0);
    let mut all = Vec::new();
    for ((r, t), (&off, &shift)) in ranked.iter().zip(offsets.iter().zip(&shifts)) {
        for s in &t.spans {
            let mut s = s.clone();
            s.start_ns = (s.start_ns as i64 + shift - origin).max(0) as u64;
            s.device = s.device.map(|d| d + off);
            s.track = match s.track {
                Track::Device(d) => Track::Device(d + off),
                Track::DeviceToHost(d) => Track::DeviceToHost(d + off),
                Track::HostToDevice(d) => Track::HostToDevice(d + off),
                Track::Host if *r == 0 => Track::Host,
                Track::Host => Track::Other(format!("rank{r} host")),
                Track::Other(name) => Track::Other(format!("rank{r} {name}")),
            };
            if let Some(c) = &mut s.collective {
                if let Some(g) = c.group {
                    if g & CROSS_PROCESS_GROUP == 0 {
                        c.group = Some(g | ((*r as u64 + 1) << 55));
                    }
                }
            }
            all.push((*r, s));
        }
    }
    all.sort_by_key(|(r, s)| (s.start_ns, s.end_ns(), *r, s.id));
    all
}

/// Dependencies across ranks, by (rank, old id): the waiting span, and (when it is a wait)
/// what directly follows it, depend on the remote span; the latter puts a device-to-host copy
/// right before a host-to-device copy, which is where a projection charges the network.
fn remote_dependencies(
    ranked: &[(usize, &Timeline)],
    ids: &HashMap<(usize, SpanId), SpanId>,
) -> Result<HashMap<(usize, SpanId), Vec<SpanId>>, MergeError> {
    let mut extra: HashMap<(usize, SpanId), Vec<SpanId>> = HashMap::new();
    for (r, t) in ranked {
        for d in &t.remote_deps {
            let remote =
                *ids.get(&(d.rank as usize, d.remote))
                    .ok_or(MergeError::UnknownRemote {
                        rank: *r,
                        span: d.span,
                        from: d.rank as usize,
                        remote: d.remote,
                    })?;
            extra.entry((*r, d.span)).or_default().push(remote);
            let waits = t.span(d.span).is_some_and(|s| s.kind == SpanKind::Wait);
            if waits {
                for s in t.spans.iter().filter(|s| s.deps.contains(&d.span)) {
                    extra.entry((*r, s.id)).or_default().push(remote);
                }
            }
        }
    }
    Ok(extra)
}

/// The spans under their new ids with their own and remote dependencies; also how many edges
/// were dropped for pointing forward in time.
fn renumbered(
    all: Vec<(usize, Span)>,
    ids: &HashMap<(usize, SpanId), SpanId>,
    mut extra: HashMap<(usize, SpanId), Vec<SpanId>>,
) -> (Timeline, usize) {
    let mut dropped = 0usize;
    let mut out = Timeline::new();
    for (r, mut s) in all {
        let key = (r, s.id);
        let new_id = ids[&key];
        let mut deps: Vec<SpanId> = s
            .deps
            .iter()
            .filter_map(|d| ids.get(&(r, *d)).copied())
            .collect();
        deps.extend(extra.remove(&key).unwrap_or_default());
        deps.sort();
        deps.dedup();
        let before = deps.len();
        // Clock alignment is good to the barrier's skew: an edge that would point forward
        // in time cannot be kept (the validator forbids it); count it.
        deps.retain(|d| *d < new_id);
        dropped += before - deps.len();
        s.id = new_id;
        s.deps = deps;
        out.spans.push(s);
    }
    (out, dropped)
}

/// Rank 0's metadata without the per-rank keys, plus the hosts, the rank count and the
/// dropped edges.
fn merged_meta(ranked: &[(usize, &Timeline)], dropped: usize) -> BTreeMap<String, String> {
    let mut meta = ranked[0].1.meta.clone();
    for key in [keys::RANK, keys::CLOCK_OFFSET_US, keys::HOST, keys::DEVICES] {
        meta.remove(key);
    }
    let hosts: Vec<String> = (ranked.iter())
        .map(|(_, t)| t.meta.get(keys::HOST).cloned().unwrap_or_default())
        .collect();
    meta.insert("mpi_hosts".into(), hosts.join(","));
    meta.insert("mpi_merged_ranks".into(), ranked.len().to_string());
    if dropped > 0 {
        meta.insert("mpi_merge_dropped_deps".into(), dropped.to_string());
    }
    meta
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::SpanAttrs;

    fn rank(r: usize, offset_us: f64) -> Timeline {
        let mut t = Timeline::new();
        t.meta.insert(keys::RANK.into(), r.to_string());
        t.meta.insert(keys::SIZE.into(), "2".into());
        t.meta.insert(keys::HOST.into(), format!("node{r}"));
        t.meta
            .insert(keys::CLOCK_OFFSET_US.into(), offset_us.to_string());
        t.meta.insert(keys::DEVICES.into(), "1".into());
        t.devices.insert(0, "gpu".into());
        t
    }

    #[test]
    fn merges_two_pipeline_ranks_with_their_link() {
        // Rank 0: compute, then download; rank 1 (its clock zero 100 us later): the receive,
        // then the upload that follows it, then compute.
        let mut a = rank(0, 0.0);
        let c = a.push_us(SpanAttrs::compute("layers 0..2", 0), 0.0, 50.0);
        let d = a.push_us(SpanAttrs::d2h("activations", 0, 4096).after(c), 50.0, 10.0);
        let mut b = rank(1, 100.0);
        let w = b.push_us(
            SpanAttrs::wait("mpi recv", 0).on_track(Track::Other("mpi recv 1".into())),
            -30.0_f64.max(0.0),
            5.0,
        );
        let h = b.push_us(SpanAttrs::h2d("activations", 0, 4096).after(w), 5.0, 10.0);
        b.push_us(SpanAttrs::compute("layers 2..4", 0).after(h), 15.0, 50.0);
        b.remote_deps.push(crate::trace::RemoteDep {
            span: w,
            rank: 0,
            remote: d,
        });
        let mut m = Timeline::merge_ranks(&[b.clone(), a.clone()], RankPlacement::Pack).unwrap();
        m.validate().unwrap();
        assert_eq!(m.spans.len(), 5);
        let h2d = m
            .spans
            .iter()
            .find(|s| s.kind == SpanKind::HostToDevice)
            .unwrap();
        let d2h = m
            .spans
            .iter()
            .find(|s| s.kind == SpanKind::DeviceToHost)
            .unwrap();
        assert_eq!(h2d.device, Some(1), "rank 1's device follows rank 0's");
        assert_eq!(h2d.start_ns, 105_000, "rank 1's clock moved by its offset");
        assert!(h2d.deps.contains(&d2h.id), "{:?}", h2d.deps);
        assert!(m.devices[&1].contains("node1"));
        let per_node =
            Timeline::merge_ranks(&[a.clone(), b.clone()], RankPlacement::PerNode(4)).unwrap();
        assert!(per_node.spans.iter().any(|s| s.device == Some(4)));
        assert!(matches!(
            Timeline::merge_ranks(&[a.clone()], RankPlacement::Pack),
            Err(MergeError::Ranks { .. })
        ));
        assert!(matches!(
            Timeline::merge_ranks(&[a.clone(), a.clone()], RankPlacement::Pack),
            Err(MergeError::Ranks { .. })
        ));
        assert!(matches!(
            Timeline::merge_ranks(&[Timeline::new()], RankPlacement::Pack),
            Err(MergeError::NotARankTrace { .. })
        ));
        b.remote_deps[0].remote = SpanId(77);
        assert!(matches!(
            Timeline::merge_ranks(&[a, b], RankPlacement::Pack),
            Err(MergeError::UnknownRemote { .. })
        ));
    }

    #[test]
    fn cross_process_collective_groups_are_kept_and_local_ones_made_unique() {
        let mut a = rank(0, 0.0);
        let mut b = rank(1, 0.0);
        for (t, r) in [(&mut a, 0u32), (&mut b, 1)] {
            let _ = r;
            t.push_us(
                SpanAttrs::collective(
                    "allreduce",
                    0,
                    crate::trace::CollectiveOp::AllReduce,
                    "host-staged",
                    2,
                    64,
                )
                .group(CROSS_PROCESS_GROUP | 5),
                0.0,
                3.0,
            );
            t.push_us(
                SpanAttrs::collective(
                    "allreduce",
                    0,
                    crate::trace::CollectiveOp::AllReduce,
                    "host-staged",
                    1,
                    64,
                )
                .group(5),
                4.0,
                3.0,
            );
        }
        let m = Timeline::merge_ranks(&[a, b], RankPlacement::Pack).unwrap();
        let groups: Vec<u64> = m
            .spans
            .iter()
            .filter_map(|s| s.collective.as_ref()?.group)
            .collect();
        assert_eq!(
            groups
                .iter()
                .filter(|g| **g == CROSS_PROCESS_GROUP | 5)
                .count(),
            2
        );
        let local: Vec<&u64> = groups
            .iter()
            .filter(|g| **g & CROSS_PROCESS_GROUP == 0)
            .collect();
        assert_eq!(local.len(), 2);
        assert_ne!(local[0], local[1]);
    }
}
