//! A log of what every transfer and collective did, for the timeline recorder and for reports.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Serialize, Serializer};

use super::compress::LinkPrecision;
use super::config::Algorithm;
use crate::device::DType;

/// The kinds of operation the comm layer records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum CollectiveOp {
    /// Sum over all devices, result on every device.
    AllReduce,
    /// Every device receives the concatenation of all inputs.
    AllGather,
    /// Sum over all devices, device r keeps slice r.
    ReduceScatter,
    /// One device's tensor copied to another device.
    SendRecv,
    /// Device -> host ([`PendingDownload`](super::PendingDownload)).
    Download,
    /// Host -> device.
    Upload,
    /// Every device's tensor to the host and back (the benchmark's floor).
    RoundTrip,
}

impl CollectiveOp {
    /// Every op, in a fixed order.
    pub const ALL: [CollectiveOp; 7] = [
        CollectiveOp::AllReduce,
        CollectiveOp::AllGather,
        CollectiveOp::ReduceScatter,
        CollectiveOp::SendRecv,
        CollectiveOp::Download,
        CollectiveOp::Upload,
        CollectiveOp::RoundTrip,
    ];

    /// `all_reduce`, `all_gather`, ...
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::SendRecv => "send_recv",
            CollectiveOp::Download => "download",
            CollectiveOp::Upload => "upload",
            CollectiveOp::RoundTrip => "round_trip",
        }
    }

    fn slot(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for CollectiveOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn micros<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e6)
}

/// One operation as it ran.
#[derive(Debug, Clone, Serialize)]
pub struct CommRecord {
    /// Position in the log of its [`CommStats`], from 0.
    pub seq: u64,
    /// What ran.
    pub op: CollectiveOp,
    /// How (point-to-point transfers report the algorithm their chunking resembles).
    pub algorithm: Algorithm,
    /// Element type of the tensors.
    pub dtype: DType,
    /// How the payload travelled (f16 for an f32 all-reduce on the reduced-precision link).
    pub link: LinkPrecision,
    /// Elements, nccl-tests style: `bytes / dtype size`.
    pub count: usize,
    /// Size S as nccl-tests defines it: the buffer for all-reduce and send/recv, the total
    /// (all ranks) for all-gather and reduce-scatter.
    pub bytes: u64,
    /// Bytes actually copied device -> host, all devices together.
    pub d2h_bytes: u64,
    /// Bytes actually copied host -> device, all devices together.
    pub h2d_bytes: u64,
    /// Device labels, in rank order.
    pub participants: Vec<String>,
    /// Chunks (steps) the data moved in.
    pub chunks: usize,
    /// When the call started.
    #[serde(skip)]
    pub start: Instant,
    /// When it returned. Uploads are queued by then, not necessarily finished: later work on
    /// the same device is ordered after them.
    #[serde(skip)]
    pub end: Instant,
    /// `start` relative to [`CommStats::epoch`], microseconds (for JSON).
    pub start_us: f64,
    /// `end - start`.
    #[serde(serialize_with = "micros", rename = "duration_us")]
    pub duration: Duration,
    /// Calling-thread time spent waiting for device -> host copies.
    #[serde(serialize_with = "micros", rename = "d2h_us")]
    pub d2h: Duration,
    /// Calling-thread time spent in the host step (reduction or copies).
    #[serde(serialize_with = "micros", rename = "reduce_us")]
    pub reduce: Duration,
    /// Calling-thread time spent getting upload buffers and submitting host -> device copies.
    #[serde(serialize_with = "micros", rename = "h2d_us")]
    pub h2d: Duration,
    /// The error, when the operation failed.
    pub error: Option<String>,
}

#[derive(Debug)]
struct Log {
    records: VecDeque<CommRecord>,
    capacity: usize,
    next_seq: u64,
}

/// Totals of one kind of operation.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OpSummary {
    /// The op.
    pub op: CollectiveOp,
    /// Calls, failures included.
    pub calls: u64,
    /// Calls that failed.
    pub failures: u64,
    /// Sum of S over the calls.
    pub bytes: u64,
    /// Sum of call durations.
    #[serde(serialize_with = "micros", rename = "time_us")]
    pub time: Duration,
}

/// The stats log: a bounded ring of [`CommRecord`]s plus call counters that are never dropped.
#[derive(Debug)]
pub struct CommStats {
    epoch: Instant,
    log: Mutex<Log>,
    calls: [AtomicU64; 7],
    failures: [AtomicU64; 7],
    bytes: [AtomicU64; 7],
    nanos: [AtomicU64; 7],
}

impl CommStats {
    /// An empty log that keeps the last `capacity` records.
    pub fn new(capacity: usize) -> Self {
        Self {
            epoch: Instant::now(),
            log: Mutex::new(Log {
                records: VecDeque::new(),
                capacity: capacity.max(1),
                next_seq: 0,
            }),
            calls: Default::default(),
            failures: Default::default(),
            bytes: Default::default(),
            nanos: Default::default(),
        }
    }

    /// The instant `start_us` counts from.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        // A panic elsewhere while holding the lock leaves the log consistent enough to read.
        crate::threads::lock(&self.log)
    }

    /// Appends a record (its `seq` and `start_us` are filled in here).
    pub fn push(&self, mut record: CommRecord) {
        let i = record.op.slot();
        self.calls[i].fetch_add(1, Ordering::Relaxed);
        if record.error.is_some() {
            self.failures[i].fetch_add(1, Ordering::Relaxed);
        }
        self.bytes[i].fetch_add(record.bytes, Ordering::Relaxed);
        self.nanos[i].fetch_add(record.duration.as_nanos() as u64, Ordering::Relaxed);
        record.start_us = record
            .start
            .saturating_duration_since(self.epoch)
            .as_secs_f64()
            * 1e6;
        let mut log = self.log();
        record.seq = log.next_seq;
        log.next_seq += 1;
        if log.records.len() == log.capacity {
            log.records.pop_front();
        }
        log.records.push_back(record);
    }

    /// A copy of the records kept, oldest first.
    pub fn records(&self) -> Vec<CommRecord> {
        self.log().records.iter().cloned().collect()
    }

    /// Takes the records kept, oldest first, leaving the log empty (counters stay).
    pub fn drain(&self) -> Vec<CommRecord> {
        self.log().records.drain(..).collect()
    }

    /// Calls of `op` so far, failures included.
    pub fn calls(&self, op: CollectiveOp) -> u64 {
        self.calls[op.slot()].load(Ordering::Relaxed)
    }

    /// Calls of every op so far.
    pub fn total_calls(&self) -> u64 {
        self.calls.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Totals per op that was called at least once.
    pub fn summary(&self) -> Vec<OpSummary> {
        CollectiveOp::ALL
            .iter()
            .filter(|op| self.calls(**op) > 0)
            .map(|&op| {
                let i = op.slot();
                OpSummary {
                    op,
                    calls: self.calls[i].load(Ordering::Relaxed),
                    failures: self.failures[i].load(Ordering::Relaxed),
                    bytes: self.bytes[i].load(Ordering::Relaxed),
                    time: Duration::from_nanos(self.nanos[i].load(Ordering::Relaxed)),
                }
            })
            .collect()
    }
}

impl Default for CommStats {
    fn default() -> Self {
        Self::new(1 << 16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(op: CollectiveOp, bytes: u64) -> CommRecord {
        let now = Instant::now();
        CommRecord {
            seq: 0,
            op,
            algorithm: Algorithm::GatherReduceBroadcast,
            dtype: DType::F32,
            link: LinkPrecision::Native,
            count: (bytes / 4) as usize,
            bytes,
            d2h_bytes: bytes,
            h2d_bytes: bytes,
            participants: vec!["gpu0".into()],
            chunks: 1,
            start: now,
            end: now,
            start_us: 0.0,
            duration: Duration::from_micros(5),
            d2h: Duration::ZERO,
            reduce: Duration::ZERO,
            h2d: Duration::ZERO,
            error: None,
        }
    }

    #[test]
    fn ring_keeps_last_records_and_all_counts() {
        let s = CommStats::new(2);
        for i in 0..5 {
            s.push(record(CollectiveOp::AllReduce, 4 * (i + 1)));
        }
        s.push(record(CollectiveOp::SendRecv, 8));
        let r = s.records();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].seq, 5);
        assert_eq!(s.calls(CollectiveOp::AllReduce), 5);
        let sum = s.summary();
        assert_eq!(sum[0].bytes, 4 + 8 + 12 + 16 + 20);
        assert_eq!(s.drain().len(), 2);
        assert!(s.records().is_empty());
        assert_eq!(s.total_calls(), 6);
        let json = serde_json::to_string(&r[1]).unwrap();
        assert!(json.contains("\"duration_us\":5.0"), "{json}");
    }
}
