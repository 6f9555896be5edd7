//! Per-device pools of staging buffers: `MAP_READ` buffers that receive device->host copies and
//! `MAP_WRITE` buffers that feed host->device copies.
//!
//! A buffer is leased out of the pool for the length of one operation and handed back when the
//! operation succeeds; on an error it is simply dropped, so a half-finished transfer never leaves
//! a pooled buffer in an unknown mapping state. Upload buffers are handed back with a map request
//! already queued behind their last copy, so the next operation finds them writable without a
//! round trip of its own.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::CommError;

/// Which way a staging buffer carries data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Device -> host (`MAP_READ | COPY_DST`).
    Download,
    /// Host -> device (`MAP_WRITE | COPY_SRC`).
    Upload,
}

const PENDING: u8 = 0;
const MAPPED: u8 = 1;
const FAILED: u8 = 2;

enum MapState {
    Unmapped,
    /// `map_async` was called; it resolves once `after` (if any) has finished on the device.
    Pending {
        status: Arc<AtomicU8>,
        after: Option<wgpu::SubmissionIndex>,
    },
    Mapped,
}

/// One staging buffer and where it stands with respect to mapping.
pub(crate) struct Slot {
    buffer: wgpu::Buffer,
    size: u64,
    direction: Direction,
    state: MapState,
}

impl Slot {
    fn new(device: &wgpu::Device, direction: Direction, size: u64) -> Self {
        let (usage, label) = match direction {
            Direction::Download => (
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                "comm download staging",
            ),
            Direction::Upload => (
                wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                "comm upload staging",
            ),
        };
        // Upload buffers start mapped, so their first use needs no round trip.
        let mapped = direction == Direction::Upload;
        let buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: mapped,
        });
        Self {
            buffer,
            size,
            direction,
            state: if mapped {
                MapState::Mapped
            } else {
                MapState::Unmapped
            },
        }
    }

    /// The wgpu buffer.
    pub(crate) fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Capacity in bytes.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Queues a map of the whole buffer (read for downloads, write for uploads) that resolves
    /// once submission `after` is done.
    pub(crate) fn request_map(&mut self, after: Option<wgpu::SubmissionIndex>) {
        let status = Arc::new(AtomicU8::new(PENDING));
        let sink = status.clone();
        let mode = match self.direction {
            Direction::Download => wgpu::MapMode::Read,
            Direction::Upload => wgpu::MapMode::Write,
        };
        self.buffer.map_async(mode, .., move |r| {
            sink.store(if r.is_ok() { MAPPED } else { FAILED }, Ordering::Release);
        });
        self.state = MapState::Pending { status, after };
    }

    /// True when the buffer is mapped (its map callback has run successfully).
    pub(crate) fn is_mapped(&mut self) -> bool {
        if let MapState::Pending { status, .. } = &self.state {
            if status.load(Ordering::Acquire) == MAPPED {
                self.state = MapState::Mapped;
            }
        }
        matches!(self.state, MapState::Mapped)
    }

    /// Blocks until the buffer is mapped, polling `device` (map callbacks run only inside a
    /// poll). Fails on a map error or after `timeout`.
    pub(crate) fn wait_mapped(
        &mut self,
        device: &wgpu::Device,
        what: &str,
        label: &str,
        wait: Wait,
    ) -> Result<(), CommError> {
        if matches!(self.state, MapState::Unmapped) {
            self.request_map(None);
        }
        if let MapState::Pending { status, .. } = &self.state {
            let status = status.clone();
            spin(device, wait.spin, || {
                status.load(Ordering::Acquire) != PENDING
            });
        }
        let timeout = wait.timeout;
        let deadline = Instant::now() + timeout;
        // The first round waits for the submission; later ones give wgpu a chance to run
        // callbacks that became ready in between. Another thread polling the same device (a
        // pipeline stage and its hand-off thread do) may have taken this buffer's callback
        // out of wgpu and not run it yet: then our poll returns with nothing to do while the
        // map is still pending, so keep looking, briefly sleeping, until the deadline.
        for round in 0.. {
            let (status, after) = match &self.state {
                MapState::Mapped => return Ok(()),
                MapState::Pending { status, after } => (status.clone(), after.clone()),
                MapState::Unmapped => {
                    return Err(CommError::gpu(what, label, "staging buffer was not mapped"))
                }
            };
            match status.load(Ordering::Acquire) {
                MAPPED => {
                    self.state = MapState::Mapped;
                    return Ok(());
                }
                FAILED => {
                    return Err(CommError::gpu(
                        what,
                        label,
                        "mapping a staging buffer failed",
                    ))
                }
                _ => {}
            }
            if round > 0 && Instant::now() >= deadline {
                break;
            }
            if round > 1 {
                std::thread::sleep(Duration::from_micros(50));
            }
            let submission_index = if round == 0 { after } else { None };
            poll_wait(device, submission_index, what, label, timeout)?;
        }
        if self.is_mapped() {
            Ok(())
        } else {
            Err(CommError::gpu(
                what,
                label,
                format!(
                    "a staging buffer map did not complete within {:.1} s of its submission",
                    timeout.as_secs_f64()
                ),
            ))
        }
    }

    /// Unmaps the buffer (all views must be gone).
    pub(crate) fn unmap(&mut self) {
        if !matches!(self.state, MapState::Unmapped) {
            self.buffer.unmap();
            self.state = MapState::Unmapped;
        }
    }
}

/// How to wait for a device: spin first, then block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wait {
    /// Time to spin (non-blocking polls, yielding the core in between) before blocking. A
    /// blocking wait costs a sleep and a wake-up, about 60 us on a virtual machine, which is
    /// more than a small transfer itself takes.
    pub spin: Duration,
    /// Longest blocking wait before the operation fails.
    pub timeout: Duration,
}

/// Polls `device` without blocking until `done()` or `limit` passes; true when done.
pub(crate) fn spin(device: &wgpu::Device, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    if limit.is_zero() {
        return done();
    }
    let start = Instant::now();
    loop {
        if done() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        let _ = device.poll(wgpu::PollType::Poll);
        std::thread::yield_now();
    }
}

/// Waits until `device` has finished everything submitted: spins, then blocks.
pub(crate) fn wait_device(
    device: &wgpu::Device,
    what: &str,
    label: &str,
    wait: Wait,
) -> Result<(), CommError> {
    let idle = spin(
        device,
        wait.spin,
        || matches!(device.poll(wgpu::PollType::Poll), Ok(s) if s.is_queue_empty()),
    );
    if idle {
        return Ok(());
    }
    poll_wait(device, None, what, label, wait.timeout)
}

/// Waits for `submission` (or everything submitted) on `device`, bounded by `timeout`.
pub(crate) fn poll_wait(
    device: &wgpu::Device,
    submission: Option<wgpu::SubmissionIndex>,
    what: &str,
    label: &str,
    timeout: Duration,
) -> Result<(), CommError> {
    match device.poll(wgpu::PollType::Wait {
        submission_index: submission,
        timeout: Some(timeout),
    }) {
        Ok(_) => Ok(()),
        Err(wgpu::PollError::Timeout) => Err(CommError::GpuTimeout {
            op: what.to_string(),
            device: label.to_string(),
            secs: timeout.as_secs_f64(),
        }),
        Err(e) => Err(CommError::gpu(what, label, e.to_string())),
    }
}

/// Counters of one pool, for tests and for sizing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StagingStats {
    /// Staging buffers created since the pool was made (steady state: no growth).
    pub allocations: u64,
    /// Idle buffers now held.
    pub idle_buffers: usize,
    /// Bytes of idle buffers now held.
    pub idle_bytes: u64,
}

/// The staging buffers of one device.
pub(crate) struct StagingPool {
    device: wgpu::Device,
    /// The device's creation counters (`Gpu::created`).
    counts: Arc<crate::device::CreationCounts>,
    downloads: Vec<Slot>,
    uploads: Vec<Slot>,
    max_idle: usize,
    max_slot: u64,
    allocations: u64,
}

impl StagingPool {
    pub(crate) fn new(
        device: wgpu::Device,
        counts: Arc<crate::device::CreationCounts>,
        max_idle: usize,
        max_slot: u64,
    ) -> Self {
        Self {
            device,
            counts,
            downloads: Vec::new(),
            uploads: Vec::new(),
            max_idle,
            max_slot,
            allocations: 0,
        }
    }

    /// A buffer of at least `bytes` (a multiple of 4, at most the slot cap). Reuses the smallest
    /// idle buffer that fits, preferring one that is already mapped; otherwise allocates,
    /// rounding up to a power of two so that slowly growing requests settle quickly.
    pub(crate) fn lease(&mut self, direction: Direction, bytes: u64) -> Slot {
        let bytes = bytes.max(4);
        let idle = match direction {
            Direction::Download => &mut self.downloads,
            Direction::Upload => &mut self.uploads,
        };
        let mut best: Option<(usize, bool, u64)> = None;
        for (i, slot) in idle.iter_mut().enumerate() {
            if slot.size < bytes {
                continue;
            }
            let key = (!slot.is_mapped(), slot.size);
            if best.is_none_or(|(_, m, s)| key < (m, s)) {
                best = Some((i, key.0, key.1));
            }
        }
        if let Some((i, _, _)) = best {
            return idle.swap_remove(i);
        }
        // Nothing fits: let the largest idle buffer go (it is too small), so that growing does
        // not raise the number of buffers held.
        if idle.len() >= self.max_idle {
            if let Some(i) = (0..idle.len()).max_by_key(|&i| idle[i].size) {
                idle.swap_remove(i);
            }
        }
        let size = bytes
            .checked_next_power_of_two()
            .unwrap_or(bytes)
            .min(self.max_slot.max(bytes));
        self.allocations += 1;
        self.counts.buffer();
        Slot::new(&self.device, direction, size)
    }

    /// Makes sure `count` download buffers of at least `bytes` are held (at most the idle
    /// cap), allocating the missing ones now: a caller that will keep that many downloads in
    /// flight allocates nothing later, whatever the timing of its hand-offs.
    pub(crate) fn reserve_downloads(&mut self, bytes: u64, count: usize) {
        let count = count.min(self.max_idle);
        let leased: Vec<Slot> = (0..count)
            .map(|_| self.lease(Direction::Download, bytes))
            .collect();
        for slot in leased {
            self.give_back(slot);
        }
    }

    /// Takes a buffer back after a successful operation; beyond the idle cap the smallest is
    /// dropped.
    pub(crate) fn give_back(&mut self, slot: Slot) {
        let idle = match slot.direction {
            Direction::Download => &mut self.downloads,
            Direction::Upload => &mut self.uploads,
        };
        idle.push(slot);
        if idle.len() > self.max_idle {
            if let Some(i) = (0..idle.len()).min_by_key(|&i| idle[i].size) {
                idle.swap_remove(i);
            }
        }
    }

    /// Drops every idle buffer (their memory is freed once the device is done with them).
    pub(crate) fn trim(&mut self) {
        self.downloads.clear();
        self.uploads.clear();
    }

    pub(crate) fn stats(&self) -> StagingStats {
        let all = self.downloads.iter().chain(self.uploads.iter());
        StagingStats {
            allocations: self.allocations,
            idle_buffers: self.downloads.len() + self.uploads.len(),
            idle_bytes: all.map(|s| s.size).sum(),
        }
    }
}
