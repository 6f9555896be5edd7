//! Headline numbers of a timeline: makespan, busy time, communication and bubble shares.

use serde::{Deserialize, Serialize};

use super::span::SpanKind;

/// The time extent of one span, as the summary needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    /// What the span did.
    pub kind: SpanKind,
    /// Device it belongs to (`None`: host).
    pub device: Option<u32>,
    /// Start, microseconds.
    pub start_us: f64,
    /// End, microseconds.
    pub end_us: f64,
    /// Bytes recorded on the span.
    pub bytes: u64,
}

/// Per-device totals, microseconds. Overlapping spans of one class count once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceSummary {
    /// Device index.
    pub device: u32,
    /// Time with at least one compute span running.
    pub busy_us: f64,
    /// Time with at least one transfer or collective of this device in flight.
    pub comm_us: f64,
    /// Communication time not hidden behind this device's compute.
    pub exposed_comm_us: f64,
    /// Time in explicit wait spans.
    pub wait_us: f64,
}

/// Summary of a timeline, with p the number of devices and T the makespan.
///
/// - `bubble_share = 1 - sum(busy) / (p T)`: the share of device-time not spent computing, the
///   measured bubble of Narayanan et al. For a GPipe fill-drain schedule with equal stages and no
///   transfers it equals `(p-1)/(m+p-1)`.
/// - `comm_share = sum(comm) / (p T)`: the share of device-time during which a device had a
///   transfer (its d2h or h2d) or a collective in flight. Host-only spans (a host reduce) are
///   counted through the collective span that covers them, if the comm layer records one.
/// - `exposed_comm_share = sum(exposed comm) / (p T)`: the same, minus time that overlapped the
///   device's own compute, i.e. communication the schedule failed to hide.
///
/// All shares are 0 for an empty timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Earliest start to latest end, microseconds.
    pub makespan_us: f64,
    /// One entry per device index `0..p`.
    pub devices: Vec<DeviceSummary>,
    /// See the type documentation.
    pub bubble_share: f64,
    /// See the type documentation.
    pub comm_share: f64,
    /// See the type documentation.
    pub exposed_comm_share: f64,
    /// Bytes moved by device-to-host and host-to-device spans.
    pub transfer_bytes: u64,
    /// Sum of the payload sizes of collective spans (one per participant).
    pub collective_bytes: u64,
    /// Time with a host reduce running, microseconds.
    pub host_reduce_us: f64,
}

impl Summary {
    /// Summarises spans over `device_count` devices.
    pub fn from_intervals(device_count: usize, spans: impl IntoIterator<Item = Interval>) -> Self {
        let spans: Vec<Interval> = spans.into_iter().collect();
        let start = spans
            .iter()
            .map(|s| s.start_us)
            .fold(f64::INFINITY, f64::min);
        let end = spans
            .iter()
            .map(|s| s.end_us)
            .fold(f64::NEG_INFINITY, f64::max);
        let makespan_us = if spans.is_empty() {
            0.0
        } else {
            (end - start).max(0.0)
        };

        let of_device = |d: u32, pred: &dyn Fn(SpanKind) -> bool| -> Vec<(f64, f64)> {
            spans
                .iter()
                .filter(|s| s.device == Some(d) && pred(s.kind))
                .map(|s| (s.start_us, s.end_us))
                .collect()
        };
        let devices: Vec<DeviceSummary> = (0..device_count as u32)
            .map(|d| {
                let busy = of_device(d, &|k| k == SpanKind::Compute);
                let comm = of_device(d, &|k| k.is_communication());
                let wait = of_device(d, &|k| k == SpanKind::Wait);
                let busy_us = union_length(busy.clone());
                let both = union_length(busy.into_iter().chain(comm.iter().copied()).collect());
                DeviceSummary {
                    device: d,
                    busy_us,
                    comm_us: union_length(comm),
                    exposed_comm_us: both - busy_us,
                    wait_us: union_length(wait),
                }
            })
            .collect();

        let capacity = device_count as f64 * makespan_us;
        let share = |x: f64| if capacity > 0.0 { x / capacity } else { 0.0 };
        let busy: f64 = devices.iter().map(|d| d.busy_us).sum();
        let comm: f64 = devices.iter().map(|d| d.comm_us).sum();
        let exposed: f64 = devices.iter().map(|d| d.exposed_comm_us).sum();
        let bytes_of = |pred: &dyn Fn(SpanKind) -> bool| -> u64 {
            spans.iter().filter(|s| pred(s.kind)).map(|s| s.bytes).sum()
        };
        Summary {
            makespan_us,
            bubble_share: if capacity > 0.0 {
                1.0 - busy / capacity
            } else {
                0.0
            },
            comm_share: share(comm),
            exposed_comm_share: share(exposed),
            transfer_bytes: bytes_of(&|k| {
                matches!(k, SpanKind::DeviceToHost | SpanKind::HostToDevice)
            }),
            collective_bytes: bytes_of(&|k| k == SpanKind::Collective),
            host_reduce_us: union_length(
                spans
                    .iter()
                    .filter(|s| s.kind == SpanKind::HostReduce)
                    .map(|s| (s.start_us, s.end_us))
                    .collect(),
            ),
            devices,
        }
    }

    /// Sum of per-device busy time, microseconds.
    pub fn total_busy_us(&self) -> f64 {
        self.devices.iter().map(|d| d.busy_us).sum()
    }
}

/// Total length covered by a set of intervals, counting overlaps once.
fn union_length(mut v: Vec<(f64, f64)>) -> f64 {
    v.retain(|(a, b)| b > a);
    v.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut total = 0.0;
    let mut current: Option<(f64, f64)> = None;
    for (a, b) in v {
        current = match current {
            Some((ca, cb)) if a <= cb => Some((ca, cb.max(b))),
            Some((ca, cb)) => {
                total += cb - ca;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    if let Some((ca, cb)) = current {
        total += cb - ca;
    }
    total
}

impl super::Timeline {
    /// The device time (timestamp queries) of the compute spans that have it beside their
    /// time on the host clock, one line; none when no span was timed on the device.
    pub fn device_time_line(&self) -> Option<String> {
        let timed: Vec<_> = (self.spans.iter())
            .filter_map(|s| s.device_ns.map(|ns| (ns, s.dur_ns)))
            .collect();
        if timed.is_empty() {
            return None;
        }
        let device: u64 = timed.iter().map(|t| t.0).sum();
        let host: u64 = timed.iter().map(|t| t.1).sum();
        Some(format!(
            "device time (timestamp queries) of {} compute spans: {:.1} ms of their {:.1} ms on the host clock ({:.0} %)",
            timed.len(),
            device as f64 / 1e6,
            host as f64 / 1e6,
            device as f64 / host.max(1) as f64 * 100.0
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(kind: SpanKind, device: u32, a: f64, b: f64) -> Interval {
        Interval {
            kind,
            device: Some(device),
            start_us: a,
            end_us: b,
            bytes: 10,
        }
    }

    #[test]
    fn union_counts_overlap_once() {
        assert_eq!(union_length(vec![(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]), 4.0);
        assert_eq!(union_length(vec![]), 0.0);
        assert_eq!(union_length(vec![(2.0, 1.0)]), 0.0);
    }

    #[test]
    fn shares_of_a_small_timeline() {
        // Device 0 computes 0-4 and sends 3-5 (1 us of it exposed); device 1 computes 5-8.
        let s = Summary::from_intervals(
            2,
            [
                iv(SpanKind::Compute, 0, 0.0, 4.0),
                iv(SpanKind::DeviceToHost, 0, 3.0, 5.0),
                iv(SpanKind::Compute, 1, 5.0, 8.0),
            ],
        );
        assert_eq!(s.makespan_us, 8.0);
        assert_eq!(s.devices[0].busy_us, 4.0);
        assert_eq!(s.devices[0].comm_us, 2.0);
        assert_eq!(s.devices[0].exposed_comm_us, 1.0);
        assert_eq!(s.bubble_share, 1.0 - 7.0 / 16.0);
        assert_eq!(s.comm_share, 2.0 / 16.0);
        assert_eq!(s.exposed_comm_share, 1.0 / 16.0);
        assert_eq!(s.transfer_bytes, 10);
    }

    #[test]
    fn empty_timeline_has_zero_shares() {
        let s = Summary::from_intervals(2, []);
        assert_eq!(
            (s.makespan_us, s.bubble_share, s.comm_share),
            (0.0, 0.0, 0.0)
        );
    }
}
