//! Tunables of the host-staged comm layer: algorithm choice, chunking, staging bounds, threads
//! and timeouts.

use std::str::FromStr;
use std::time::Duration;

use serde::Serialize;

use super::compress::LinkPrecision;
use super::error::CommError;

/// How a collective moves its data through the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum Algorithm {
    /// Pick by size: [`GatherReduceBroadcast`](Self::GatherReduceBroadcast) up to
    /// [`CommConfig::pipeline_threshold`] bytes per device, [`Pipelined`](Self::Pipelined) above.
    #[default]
    Auto,
    /// Download everything, reduce on the host, upload everything: the fewest submissions and
    /// waits, so the lowest latency for small tensors. Tensors larger than
    /// [`CommConfig::max_slot_bytes`] run in slot-sized pieces, one after the other.
    GatherReduceBroadcast,
    /// Chunks of [`CommConfig::chunk_bytes`]: the download of chunk k+1, the host reduction of
    /// chunk k and the upload of chunk k-1 overlap.
    Pipelined,
}

impl Algorithm {
    /// Short name used in benchmark tables and stats: `auto`, `grb`, `pipe`.
    pub fn short(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::GatherReduceBroadcast => "grb",
            Algorithm::Pipelined => "pipe",
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.short())
    }
}

impl FromStr for Algorithm {
    type Err = CommError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "grb" | "gather-reduce-broadcast" | "gather" | "direct" => {
                Ok(Self::GatherReduceBroadcast)
            }
            "pipe" | "pipelined" | "chunked" => Ok(Self::Pipelined),
            other => Err(CommError::Config(format!(
                "unknown algorithm '{other}': expected auto, grb (gather-reduce-broadcast) or \
                 pipe (pipelined)"
            ))),
        }
    }
}

/// Settings shared by every collective of a [`Collectives`](super::Collectives) or
/// [`Communicator`](super::Communicator).
///
/// Staging memory per device is bounded by [`CommConfig::staging_bound`]: at most
/// `max_idle_slots` idle download and as many idle upload buffers are kept, each at most
/// `max_slot_bytes`; an operation in flight leases at most `depth` of each. Larger tensors are
/// always chunked, so a 2 GiB tensor needs no more staging than a 16 MiB one.
#[derive(Debug, Clone, Serialize)]
pub struct CommConfig {
    /// Algorithm for all-reduce, all-gather and reduce-scatter.
    pub algorithm: Algorithm,
    /// How f32 all-reduce payloads travel (exact, or as f16 with a documented error).
    pub link: LinkPrecision,
    /// With [`Algorithm::Auto`], staged bytes per device above which the pipelined algorithm is
    /// used.
    pub pipeline_threshold: u64,
    /// Chunk size of the pipelined algorithm, bytes of staging per device per chunk.
    pub chunk_bytes: u64,
    /// Largest staging buffer, bytes. Also the piece size of gather-reduce-broadcast and of
    /// point-to-point transfers on large tensors.
    pub max_slot_bytes: u64,
    /// Chunks in flight in the pipelined algorithm (2 = double buffering).
    pub depth: usize,
    /// Idle staging buffers of each kind kept per device.
    pub max_idle_slots: usize,
    /// Host threads that share a reduction, the calling thread included (default: half the
    /// cores).
    pub host_threads: usize,
    /// Bytes of output per thread below which a host step runs on one thread (spreading tiny
    /// steps costs more in wake-ups than it saves).
    pub parallel_min_bytes: u64,
    /// How long a wait for a device polls without blocking (yielding the core between polls)
    /// before it sleeps. Sleeping costs a wake-up (about 60 us on a virtual machine), more than
    /// a small transfer; zero always blocks.
    #[serde(serialize_with = "secs")]
    pub spin_wait: Duration,
    /// How long a rank of a [`Communicator`](super::Communicator) waits for the others before it
    /// aborts the communicator.
    #[serde(serialize_with = "secs")]
    pub rendezvous_timeout: Duration,
    /// How long any single wait on a GPU may take before the operation fails.
    #[serde(serialize_with = "secs")]
    pub gpu_timeout: Duration,
    /// Records kept in the stats log (oldest dropped first; call counts are never dropped).
    pub stats_capacity: usize,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Default for CommConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        Self {
            algorithm: Algorithm::Auto,
            link: LinkPrecision::Native,
            pipeline_threshold: 1 << 20,
            chunk_bytes: 1 << 20,
            max_slot_bytes: 16 << 20,
            depth: 2,
            max_idle_slots: 4,
            // Half the cores: the driver's own threads (lavapipe's copies, a real driver's
            // submissions) need the rest. On 2 cores a second reduction thread made a 4-device
            // all-reduce slower, not faster.
            host_threads: (cores / 2).clamp(1, 8),
            parallel_min_bytes: 64 << 10,
            spin_wait: Duration::from_micros(500),
            rendezvous_timeout: Duration::from_secs(60),
            gpu_timeout: Duration::from_secs(60),
            stats_capacity: 1 << 16,
        }
    }
}

impl CommConfig {
    /// Checks that the numbers make sense together.
    pub fn validate(&self) -> Result<(), CommError> {
        let bad = |m: String| Err(CommError::Config(m));
        if self.chunk_bytes < 4096 {
            return bad(format!(
                "chunk_bytes must be at least 4096, got {}",
                self.chunk_bytes
            ));
        }
        if self.max_slot_bytes < self.chunk_bytes {
            return bad(format!(
                "max_slot_bytes ({}) must be at least chunk_bytes ({})",
                self.max_slot_bytes, self.chunk_bytes
            ));
        }
        if self.depth == 0 || self.depth > 8 {
            return bad(format!("depth must be 1..=8, got {}", self.depth));
        }
        if self.max_idle_slots < self.depth {
            return bad(format!(
                "max_idle_slots ({}) must be at least depth ({})",
                self.max_idle_slots, self.depth
            ));
        }
        if self.host_threads == 0 {
            return bad("host_threads must be at least 1".into());
        }
        Ok(())
    }

    /// The most staging memory one device holds while idle, bytes: idle download and upload
    /// buffers of at most `max_slot_bytes` each.
    pub fn staging_bound(&self) -> u64 {
        2 * self.max_idle_slots as u64 * self.max_slot_bytes
    }

    /// The algorithm to run for `bytes` of staging per device.
    pub fn choose(&self, bytes: u64) -> Algorithm {
        match self.algorithm {
            Algorithm::Auto if bytes > self.pipeline_threshold => Algorithm::Pipelined,
            Algorithm::Auto => Algorithm::GatherReduceBroadcast,
            other => other,
        }
    }

    /// Pieces a collective of `bytes` staged bytes per device moves in, with the algorithm
    /// [`choose`](Self::choose) picks: what a trace records so a projection pipelines the
    /// phases the same way.
    pub fn chunks(&self, bytes: u64) -> u32 {
        let piece = match self.choose(bytes) {
            Algorithm::Pipelined => self.chunk_bytes,
            _ => self.max_slot_bytes,
        };
        bytes.div_ceil(piece.max(1)).clamp(1, u64::from(u32::MAX)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid_and_bounded() {
        let c = CommConfig::default();
        c.validate().unwrap();
        assert_eq!(c.staging_bound(), 2 * 4 * (16 << 20));
        assert_eq!(c.choose(4096), Algorithm::GatherReduceBroadcast);
        assert_eq!(c.choose(64 << 20), Algorithm::Pipelined);
    }

    #[test]
    fn chunk_counts_follow_the_chosen_algorithm() {
        let c = CommConfig::default();
        // Gather-reduce-broadcast moves up to one 16 MiB slot at a time.
        assert_eq!(c.chunks(4096), 1);
        assert_eq!(c.chunks(1 << 20), 1);
        // Above the threshold: 1 MiB pipelined chunks, the last one partial.
        assert_eq!(c.chunks((1 << 20) + 1), 2);
        assert_eq!(c.chunks(64 << 20), 64);
        let grb = CommConfig {
            algorithm: Algorithm::GatherReduceBroadcast,
            ..CommConfig::default()
        };
        assert_eq!(grb.chunks((40 << 20) + 3), 3);
    }

    #[test]
    fn algorithm_names_parse() {
        assert_eq!("pipe".parse::<Algorithm>().ok(), Some(Algorithm::Pipelined));
        assert_eq!(
            "GRB".parse::<Algorithm>().ok(),
            Some(Algorithm::GatherReduceBroadcast)
        );
        let e = "ring".parse::<Algorithm>().unwrap_err().to_string();
        assert!(e.contains("ring"), "{e}");
    }
}
