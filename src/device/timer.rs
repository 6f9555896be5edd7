//! Device-side timing with timestamp queries (`TIMESTAMP_QUERY`).
//!
//! A [`GpuTimer`] brackets the work of one submission with two timestamps, written by empty
//! compute passes (pass timestamp writes need no extra feature, unlike timestamps inside
//! encoders), resolves them into a buffer in the same submission, and reads them after the
//! submission has finished. The result is the time the device spent between the two stamps,
//! without the host's encoding, submission and polling around it.

use crate::error::{Result, WgparError};

use super::Gpu;

/// Bytes of the two resolved timestamps.
const STAMPS_BYTES: u64 = 2 * wgpu::QUERY_SIZE as u64;

/// Times the work between [`begin`](Self::begin) and [`end`](Self::end) of one submission on
/// the device. One timer serves one submission at a time; engines keep one per worker thread.
#[derive(Debug)]
pub struct GpuTimer {
    query_set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    period_ns: f64,
}

impl GpuTimer {
    /// A timer for `gpu`, or `None` when its device was not opened with `TIMESTAMP_QUERY`
    /// (the adapter lacks it): then spans keep host clocks only.
    pub fn new(gpu: &Gpu) -> Option<GpuTimer> {
        let device = gpu.device();
        if !device.features().contains(wgpu::Features::TIMESTAMP_QUERY) {
            return None;
        }
        let query_set = device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("span timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolve = gpu.create_buffer(&wgpu::BufferDescriptor {
            label: Some("span timestamps (resolved)"),
            size: wgpu::QUERY_RESOLVE_BUFFER_ALIGNMENT.max(STAMPS_BYTES),
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = gpu.create_buffer(&wgpu::BufferDescriptor {
            label: Some("span timestamps (readback)"),
            size: STAMPS_BYTES,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Some(GpuTimer {
            query_set,
            resolve,
            readback,
            period_ns: f64::from(gpu.queue().get_timestamp_period()),
        })
    }

    fn stamp(&self, encoder: &mut wgpu::CommandEncoder, index: u32) {
        let (beginning, end) = if index == 0 {
            (Some(0), None)
        } else {
            (None, Some(index))
        };
        // An empty pass: only its timestamp write matters.
        drop(encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("timestamp"),
            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                query_set: &self.query_set,
                beginning_of_pass_write_index: beginning,
                end_of_pass_write_index: end,
            }),
        }));
    }

    /// Writes the first timestamp: encode this before the work to time.
    pub fn begin(&self, encoder: &mut wgpu::CommandEncoder) {
        self.stamp(encoder, 0);
    }

    /// Writes the second timestamp and queues its readback: encode this after the work, in
    /// the same encoder (or a later one of the same submission order).
    pub fn end(&self, encoder: &mut wgpu::CommandEncoder) {
        self.stamp(encoder, 1);
        encoder.resolve_query_set(&self.query_set, 0..2, &self.resolve, 0);
        encoder.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, STAMPS_BYTES);
    }

    /// Device time between the two stamps, microseconds. Call after the submission holding
    /// [`end`](Self::end) has finished (e.g. after [`Gpu::wait`]).
    pub fn read_us(&self, gpu: &Gpu) -> Result<f64> {
        let bytes = gpu.map_read(&self.readback, STAMPS_BYTES)?;
        let stamp = |i: usize| -> Result<u64> {
            bytes
                .get(i * 8..i * 8 + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .ok_or_else(|| WgparError::Map {
                    device: gpu.describe(),
                    message: format!("timestamp readback holds {} bytes, not 16", bytes.len()),
                })
        };
        let ticks = stamp(1)?.saturating_sub(stamp(0)?);
        Ok(ticks as f64 * self.period_ns / 1e3)
    }
}

/// A [`GpuTimer`] where timing is wanted and the device can time itself; otherwise every call
/// is a no-op and [`read_us`](Self::read_us) gives `None`. What engines hold per device.
#[derive(Debug, Default)]
pub struct SpanTimer(Option<GpuTimer>);

impl SpanTimer {
    /// A timer for `gpu` when `wanted` (usually: a trace is being recorded).
    pub fn new(gpu: &Gpu, wanted: bool) -> SpanTimer {
        SpanTimer(if wanted { GpuTimer::new(gpu) } else { None })
    }

    /// Whether this timer measures anything.
    pub fn is_active(&self) -> bool {
        self.0.is_some()
    }

    /// See [`GpuTimer::begin`].
    pub fn begin(&self, encoder: &mut wgpu::CommandEncoder) {
        if let Some(t) = &self.0 {
            t.begin(encoder);
        }
    }

    /// See [`GpuTimer::end`].
    pub fn end(&self, encoder: &mut wgpu::CommandEncoder) {
        if let Some(t) = &self.0 {
            t.end(encoder);
        }
    }

    /// See [`GpuTimer::read_us`]; `None` without a timer.
    pub fn read_us(&self, gpu: &Gpu) -> Result<Option<f64>> {
        self.0.as_ref().map(|t| t.read_us(gpu)).transpose()
    }
}
