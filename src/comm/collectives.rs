//! [`Collectives`]: the one-caller entry point. It owns the staging pools (one per device it has
//! seen), the host worker threads and the stats log, and runs plans on them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::compress::{LinkCache, LinkPrecision};
use super::config::{Algorithm, CommConfig};
use super::error::CommError;
use super::pipeline::{execute, Exec, Member, Phases, Plan, TensorRef};
use super::staging::{StagingPool, StagingStats, Wait};
use super::stats::{CollectiveOp, CommRecord, CommStats};
use super::workers::HostWorkers;
use crate::device::{DType, Gpu};
use crate::error::Result;

/// Host-staged collectives and transfers between wgpu devices.
///
/// One `Collectives` serves any set of devices; share it (`Arc`) between the threads of an
/// engine. Operations on disjoint device sets run concurrently; operations that share a device
/// take turns on its staging pool.
///
/// Every operation returns once its last host->device copy is *queued*: work submitted to the
/// same device afterwards sees the result (queue order), and [`Gpu::wait`] waits for it.
pub struct Collectives {
    config: CommConfig,
    pools: Mutex<HashMap<wgpu::Device, Arc<Mutex<StagingPool>>>>,
    workers: Mutex<HostWorkers>,
    stats: Arc<CommStats>,
    link: LinkCache,
}

impl std::fmt::Debug for Collectives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collectives")
            .field("config", &self.config)
            .finish()
    }
}

/// What the runner needs to know to execute and record one operation.
pub(crate) struct RunSpec<'a> {
    pub op: CollectiveOp,
    pub gpus: Vec<&'a Gpu>,
    pub bufs: Vec<Vec<wgpu::Buffer>>,
    pub plan: Arc<dyn Plan>,
    pub algorithm: Algorithm,
    pub dtype: DType,
    /// S as nccl-tests defines it.
    pub bytes: u64,
    /// How the payload travels.
    pub link: LinkPrecision,
}

pub(crate) use crate::threads::lock;

impl Collectives {
    /// Starts the host worker threads; checks the configuration.
    pub fn new(config: CommConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            workers: Mutex::new(HostWorkers::start(config.host_threads)),
            stats: Arc::new(CommStats::new(config.stats_capacity)),
            pools: Mutex::new(HashMap::new()),
            link: LinkCache::default(),
            config,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }

    /// The stats log every operation writes to.
    pub fn stats(&self) -> &Arc<CommStats> {
        &self.stats
    }

    /// Staging counters of `gpu`'s pool (zeros when it was never used).
    pub fn staging_stats(&self, gpu: &Gpu) -> StagingStats {
        let pools = lock(&self.pools);
        pools
            .get(gpu.device())
            .map(|p| lock(p).stats())
            .unwrap_or_default()
    }

    /// Frees every idle staging buffer (they are re-created on demand).
    pub fn trim(&self) {
        for pool in lock(&self.pools).values() {
            lock(pool).trim();
        }
    }

    /// Holds `count` download buffers of at least `bytes` for `gpu` from now on (see
    /// `StagingPool::reserve_downloads`).
    pub(crate) fn reserve_downloads(&self, gpu: &Gpu, bytes: u64, count: usize) {
        lock(&self.pool(gpu)).reserve_downloads(bytes, count);
    }

    /// Pack/unpack kernels and scratch of the f16 link.
    pub(crate) fn link_cache(&self) -> &LinkCache {
        &self.link
    }

    pub(crate) fn pool(&self, gpu: &Gpu) -> Arc<Mutex<StagingPool>> {
        lock(&self.pools)
            .entry(gpu.device().clone())
            .or_insert_with(|| {
                Arc::new(Mutex::new(StagingPool::new(
                    gpu.device().clone(),
                    gpu.creation_counts(),
                    self.config.max_idle_slots,
                    self.config.max_slot_bytes,
                )))
            })
            .clone()
    }

    /// How this engine waits for devices.
    pub(crate) fn wait(&self) -> Wait {
        Wait {
            spin: self.config.spin_wait,
            timeout: self.config.gpu_timeout,
        }
    }

    /// Waits until `gpu` has finished all submitted work (spinning briefly first, as the
    /// collectives do), then reports any GPU error it captured.
    pub fn wait_idle(&self, gpu: &Gpu) -> Result<()> {
        Ok(super::pipeline::wait_idle(gpu, "wait", self.wait())?)
    }

    /// The algorithm for `staged` bytes per device, given an optional per-call override.
    pub(crate) fn resolve(&self, algorithm: Option<Algorithm>, staged: u64) -> Algorithm {
        match algorithm {
            None | Some(Algorithm::Auto) => self.config.choose(staged),
            Some(a) => a,
        }
    }

    /// Staging bytes per member per step for `algorithm`.
    pub(crate) fn budget(&self, algorithm: Algorithm) -> u64 {
        match algorithm {
            Algorithm::Pipelined => self.config.chunk_bytes,
            _ => self.config.max_slot_bytes,
        }
    }

    /// Locks the members' pools (in a fixed global order, so concurrent operations cannot
    /// deadlock), runs the plan, and records the operation.
    pub(crate) fn run(&self, spec: RunSpec<'_>) -> std::result::Result<(), CommError> {
        let start = Instant::now();
        let result = self.execute_locked(&spec);
        let end = Instant::now();
        let ph = result.as_ref().copied().unwrap_or_default();
        self.stats.push(CommRecord {
            seq: 0,
            op: spec.op,
            algorithm: spec.algorithm,
            dtype: spec.dtype,
            link: spec.link,
            count: (spec.bytes / spec.dtype.size() as u64) as usize,
            bytes: spec.bytes,
            d2h_bytes: ph.d2h_bytes,
            h2d_bytes: ph.h2d_bytes,
            participants: spec.gpus.iter().map(|g| g.label().to_string()).collect(),
            chunks: ph.steps,
            start,
            end,
            start_us: 0.0,
            duration: end - start,
            d2h: ph.d2h,
            reduce: ph.host,
            h2d: ph.h2d,
            error: result.as_ref().err().map(|e| e.to_string()),
        });
        result.map(|_| ())
    }

    fn execute_locked(&self, spec: &RunSpec<'_>) -> std::result::Result<Phases, CommError> {
        let pools: Vec<Arc<Mutex<StagingPool>>> = spec.gpus.iter().map(|g| self.pool(g)).collect();
        let mut order: Vec<usize> = (0..pools.len()).collect();
        order.sort_by_key(|&i| Arc::as_ptr(&pools[i]) as usize);
        // Locked in address order (no two collectives wait on each other), then put back in
        // rank order: every rank's pool is held, so no rank can go without one.
        let mut guards: Vec<(usize, MutexGuard<'_, StagingPool>)> =
            order.into_iter().map(|i| (i, lock(&pools[i]))).collect();
        guards.sort_by_key(|(i, _)| *i);
        let mut members = Vec::with_capacity(guards.len());
        for ((i, guard), gpu) in guards.iter_mut().zip(&spec.gpus) {
            members.push(Member {
                gpu,
                pool: guard,
                bufs: spec.bufs[*i].clone(),
                index: *i,
            });
        }
        let workers = lock(&self.workers);
        let exec = Exec {
            op: spec.op.name(),
            depth: match spec.algorithm {
                Algorithm::Pipelined => self.config.depth,
                _ => 1,
            },
            wait: self.wait(),
            workers: &workers,
            parallel_min_bytes: self.config.parallel_min_bytes,
        };
        execute(&exec, &mut members, spec.plan.clone())
    }

    /// Records an operation that moved nothing (one participant, or zero elements).
    pub(crate) fn record_local(
        &self,
        op: CollectiveOp,
        gpus: &[&Gpu],
        dtype: DType,
        bytes: u64,
        start: Instant,
        error: Option<&CommError>,
    ) {
        let end = Instant::now();
        self.stats.push(CommRecord {
            seq: 0,
            op,
            algorithm: Algorithm::GatherReduceBroadcast,
            dtype,
            link: LinkPrecision::Native,
            count: (bytes / dtype.size() as u64) as usize,
            bytes,
            d2h_bytes: 0,
            h2d_bytes: 0,
            participants: gpus.iter().map(|g| g.label().to_string()).collect(),
            chunks: 0,
            start,
            end,
            start_us: 0.0,
            duration: end - start,
            d2h: Default::default(),
            reduce: Default::default(),
            h2d: Default::default(),
            error: error.map(|e| e.to_string()),
        });
    }
}

impl Collectives {
    /// Records an operation rejected before it moved anything, and hands the error back.
    pub(crate) fn fail(
        &self,
        op: CollectiveOp,
        gpus: &[&Gpu],
        tensors: &[&TensorRef],
        start: Instant,
        e: CommError,
    ) -> CommError {
        let dtype = tensors.first().map(|t| t.dtype).unwrap_or(DType::F32);
        self.record_local(op, gpus, dtype, 0, start, Some(&e));
        e
    }
}

/// Elements per step so that a member stages at most `budget` bytes when each output element
/// costs `per_elem` staging bytes plus `slack` bytes of alignment per step. A multiple of 4, so
/// that step boundaries are 8-byte aligned for f16 and f32 alike.
pub(crate) fn chunk_elems(budget: u64, per_elem: u64, slack: u64) -> usize {
    let elems = budget.saturating_sub(slack) / per_elem.max(1);
    ((elems / 4) * 4).max(4) as usize
}

/// Checks the parts of a collective: at least one, each on its own device.
pub(crate) fn check_devices(
    op: &str,
    who: &str,
    gpus: &[&Gpu],
) -> std::result::Result<(), CommError> {
    if gpus.is_empty() {
        return Err(CommError::mismatch(op, "needs at least one participant"));
    }
    for j in 1..gpus.len() {
        for i in 0..j {
            if gpus[i].device() == gpus[j].device() {
                return Err(CommError::mismatch(
                    op,
                    format!(
                        "{} is given twice ({who}s {i} and {j}): each {who} must be on its own \
                         device",
                        gpus[j].label()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Checks that every tensor has the first one's dtype, and that it is one of `allowed`.
pub(crate) fn check_dtypes(
    op: &str,
    who: &str,
    gpus: &[&Gpu],
    tensors: &[&TensorRef],
    allowed: &[DType],
) -> std::result::Result<DType, CommError> {
    let Some(first) = tensors.first() else {
        return Err(CommError::mismatch(op, "needs at least one participant"));
    };
    let dtype = first.dtype;
    if !allowed.contains(&dtype) {
        let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
        return Err(CommError::mismatch(
            op,
            format!(
                "supports {} tensors; {who} 0 ({}) holds {}",
                names.join(" or "),
                gpus[0].label(),
                dtype.name()
            ),
        ));
    }
    for (i, t) in tensors.iter().enumerate().skip(1) {
        if t.dtype != dtype {
            return Err(CommError::mismatch(
                op,
                format!(
                    "{who} {i} ({}) holds {} but {who} 0 ({}) holds {}",
                    gpus[i].label(),
                    t.dtype.name(),
                    gpus[0].label(),
                    dtype.name()
                ),
            ));
        }
    }
    Ok(dtype)
}

/// Checks that every tensor has the first one's length.
pub(crate) fn check_lens(
    op: &str,
    who: &str,
    what: &str,
    gpus: &[&Gpu],
    tensors: &[&TensorRef],
) -> std::result::Result<usize, CommError> {
    let what = if what.is_empty() {
        String::new()
    } else {
        format!(" {what}")
    };
    let len = tensors.first().map(|t| t.len).unwrap_or(0);
    for (i, t) in tensors.iter().enumerate().skip(1) {
        if t.len != len {
            return Err(CommError::mismatch(
                op,
                format!(
                    "{who} {i} ({}){what} has {} elements but {who} 0 ({}){what} has {len}",
                    gpus[i].label(),
                    t.len,
                    gpus[0].label()
                ),
            ));
        }
    }
    Ok(len)
}

/// Checks, without submitting anything, that each buffer belongs to its `Gpu`: an empty encoder
/// that references the buffer fails validation otherwise.
pub(crate) fn verify_devices(
    op: &str,
    gpus: &[&Gpu],
    bufs: &[&wgpu::Buffer],
) -> std::result::Result<(), CommError> {
    for (i, (gpu, buf)) in gpus.iter().zip(bufs).enumerate() {
        let scope = gpu.device().push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = gpu.encoder();
        enc.clear_buffer(buf, 0, Some(0));
        drop(enc.finish());
        if let Some(err) = pollster::block_on(scope.pop()) {
            return Err(super::pipeline::classify(op, i, &gpu.describe(), &err));
        }
    }
    Ok(())
}

/// A device-local copy of `bytes` (rounded up to 4) from `src` to `dst`, queued.
pub(crate) fn local_copy(
    op: &str,
    index: usize,
    gpu: &Gpu,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    bytes: u64,
) -> std::result::Result<(), CommError> {
    if src == dst || bytes == 0 {
        return verify_devices(op, &[gpu], &[src]);
    }
    let scope = gpu.device().push_error_scope(wgpu::ErrorFilter::Validation);
    let mut enc = gpu.encoder();
    enc.copy_buffer_to_buffer(src, 0, dst, 0, super::pipeline::ceil4(bytes));
    gpu.submit(enc);
    if let Some(err) = pollster::block_on(scope.pop()) {
        return Err(super::pipeline::classify(op, index, &gpu.describe(), &err));
    }
    Ok(())
}
