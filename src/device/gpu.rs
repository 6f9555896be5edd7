//! `Gpu`: one wgpu device and queue, with error capture, limits and buffer helpers.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::adapter::AdapterDesc;
use super::tensor::{padded_bytes, DType, Tensor};
use crate::error::{Result, WgparError};
use crate::kernels::KernelCache;

/// The element type a device stores its KV caches in ([`GpuOptions::kv_cache`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvCacheType {
    /// f16 where the device has `SHADER_F16` enabled, f32 elsewhere: each device of a mixed set
    /// decides for itself (`wgpar --kv-dtype auto`, the command line's default).
    Auto,
    /// f16 (half the bytes; attention still accumulates in f32). A device without
    /// `SHADER_F16` refuses to open.
    F16,
    /// f32: the exact path, and the library's default.
    #[default]
    F32,
}

impl KvCacheType {
    /// Parses `auto`, `f16` or `f32`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(Self::Auto),
            "f16" => Some(Self::F16),
            "f32" => Some(Self::F32),
            _ => None,
        }
    }

    /// The element type this choice stores on a device with (`f16`) or without `SHADER_F16`
    /// enabled; `None` for f16 without it (refused).
    pub fn resolve(self, f16: bool) -> Option<DType> {
        match (self, f16) {
            (Self::F32, _) | (Self::Auto, false) => Some(DType::F32),
            (Self::Auto | Self::F16, true) => Some(DType::F16),
            (Self::F16, false) => None,
        }
    }
}

/// Options that apply when a device is opened.
#[derive(Debug, Clone, Default)]
pub struct GpuOptions {
    /// Store weights in f32 even when the adapter has `SHADER_F16` (the fallback path).
    /// The environment variable `WGPAR_FORCE_F32=1` sets it too.
    pub force_f32: bool,
    /// Opens the device with a storage-binding limit below the adapter's (bytes), so that it
    /// behaves as an adapter with that limit would: tables larger than it (a model's token
    /// embedding and LM head) are split into blocks of rows. For tests, and for reproducing a
    /// smaller adapter's behaviour on a larger one. At least 256 bytes.
    pub max_storage_binding: Option<u64>,
    /// The KV caches' element type on this device.
    pub kv_cache: KvCacheType,
}

/// One wgpu device. Every GPU resource belongs to exactly one `Gpu`; data moves between
/// `Gpu`s only through the `comm` module.
pub struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: AdapterDesc,
    label: String,
    ordinal: usize,
    f16_weights: bool,
    kv_dtype: DType,
    errors: Arc<Mutex<Vec<String>>>,
    lost: Arc<Mutex<Option<String>>>,
    kernels: KernelCache,
    bytes_allocated: AtomicUsize,
    /// Bytes of the tensors alive now (each gives its bytes back when dropped).
    bytes_live: Arc<AtomicUsize>,
    counts: Arc<CreationCounts>,
}

/// The counters behind [`Gpu::created`], shareable with code that creates buffers on the
/// raw device (the communicator's staging pools).
#[derive(Debug, Default)]
pub(crate) struct CreationCounts {
    buffers: AtomicU64,
    bind_groups: AtomicU64,
}

impl CreationCounts {
    /// Counts one buffer created.
    pub(crate) fn buffer(&self) {
        self.buffers.fetch_add(1, Ordering::Relaxed);
    }
}

/// How many buffers and bind groups wgpar has created on one device: what the dispatch
/// path must not do per step once a model's buffers and bindings exist.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Created {
    /// Buffers (tensors, params, staging, readback).
    pub buffers: u64,
    /// Bind groups.
    pub bind_groups: u64,
}

impl std::ops::Sub for Created {
    type Output = Created;

    fn sub(self, earlier: Created) -> Created {
        Created {
            buffers: self.buffers.saturating_sub(earlier.buffers),
            bind_groups: self.bind_groups.saturating_sub(earlier.bind_groups),
        }
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("label", &self.label)
            .field("adapter", &self.info.name)
            .finish()
    }
}

impl KvCacheType {
    /// The type this choice stores on `info`'s device opened with (`f16`) or without
    /// `SHADER_F16`; refused for f16 without it, naming the adapter and why it lacks the
    /// feature (`force_f32`: --force-f32 turned it off). What opening a device checks, and
    /// what a caller checks before opening one.
    pub fn resolve_on(self, info: &AdapterDesc, f16: bool, force_f32: bool) -> Result<DType> {
        kv_dtype(self, f16, force_f32, info)
    }
}

fn kv_dtype(asked: KvCacheType, f16: bool, force_f32: bool, info: &AdapterDesc) -> Result<DType> {
    if let Some(t) = asked.resolve(f16) {
        return Ok(t);
    }
    if force_f32 {
        Err(WgparError::unsupported(format!(
            "--kv-dtype f16 asks for an f16 KV cache, but --force-f32 (or WGPAR_FORCE_F32=1) \
             keeps {} in f32: drop one of the two",
            info.label()
        )))
    } else {
        Err(WgparError::unsupported(format!(
            "--kv-dtype f16 needs SHADER_F16, which adapter {} ({}) lacks: use --kv-dtype auto \
             (f16 where available) or f32",
            info.index,
            info.label()
        )))
    }
}

impl Gpu {
    /// Opens a device on `adapter`, asking for the adapter's real limits and the features wgpar
    /// uses, and installs handlers that turn uncaptured errors and device loss into `Result`s.
    pub fn open(
        adapter: &wgpu::Adapter,
        info: &AdapterDesc,
        ordinal: usize,
        options: &GpuOptions,
    ) -> Result<Self> {
        let force_f32 = options.force_f32 || crate::switches::flag(crate::switches::FORCE_F32);
        let available = adapter.features();
        let mut wanted = wgpu::Features::empty();
        if !force_f32 {
            wanted |= wgpu::Features::SHADER_F16;
        }
        wanted |= wgpu::Features::TIMESTAMP_QUERY;
        // Subgroup reductions in the kernel variants that use them (chosen per adapter).
        wanted |= wgpu::Features::SUBGROUP;
        let required_features = available & wanted;
        let label = format!("gpu{ordinal}");
        let mut required_limits = adapter.limits();
        let mut info = info.clone();
        if let Some(cap) = options.max_storage_binding {
            if cap < 256 {
                return Err(WgparError::option(
                    "--max-binding",
                    format!("a storage-binding limit of {cap} B is below the 256 B minimum"),
                ));
            }
            let cap = cap.min(required_limits.max_storage_buffer_binding_size);
            required_limits.max_storage_buffer_binding_size = cap;
            info.max_storage_binding = cap;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some(&label),
            required_features,
            required_limits,
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| WgparError::RequestDevice {
            adapter: info.label(),
            message: e.to_string(),
        })?;

        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut v) = sink.lock() {
                v.push(e.to_string());
            }
        }));
        let lost = Arc::new(Mutex::new(None));
        let lost_sink = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            if let Ok(mut l) = lost_sink.lock() {
                *l = Some(format!("{reason:?}: {message}"));
            }
        });

        let f16 = required_features.contains(wgpu::Features::SHADER_F16);
        Ok(Self {
            kv_dtype: kv_dtype(options.kv_cache, f16, force_f32, &info)?,
            f16_weights: f16,
            device,
            queue,
            info,
            label,
            ordinal,
            errors,
            lost,
            kernels: KernelCache::default(),
            bytes_allocated: AtomicUsize::new(0),
            bytes_live: Arc::default(),
            counts: Arc::default(),
        })
    }

    /// The wgpu device.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The wgpu queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// The adapter this device was opened on.
    pub fn info(&self) -> &AdapterDesc {
        &self.info
    }

    /// Short label, `gpu0`, `gpu1`, ... in the order the set was opened.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Position in the device set.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Whether weights may be stored as f16 on this device.
    pub fn supports_f16_weights(&self) -> bool {
        self.f16_weights
    }

    /// The element type of the KV caches made on this device (f16 or f32), resolved from
    /// [`GpuOptions::kv_cache`] when it was opened.
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    /// Pipelines compiled on this device.
    pub fn kernels(&self) -> &KernelCache {
        &self.kernels
    }

    /// Bytes of tensors allocated through this `Gpu` so far.
    pub fn bytes_allocated(&self) -> u64 {
        self.bytes_allocated.load(Ordering::Relaxed) as u64
    }

    /// Bytes of the tensors made through this `Gpu` that are alive now: what it holds, without
    /// the scratch of an autotuner's measurement or a dropped model.
    pub fn bytes_live(&self) -> u64 {
        self.bytes_live.load(Ordering::Relaxed) as u64
    }

    /// A new tensor of `bytes` (padded) on `buffer`, counted as allocated and alive.
    fn tensor(&self, buffer: wgpu::Buffer, (dtype, len): (DType, usize), bytes: usize) -> Tensor {
        self.bytes_allocated.fetch_add(bytes, Ordering::Relaxed);
        self.bytes_live.fetch_add(bytes, Ordering::Relaxed);
        Tensor::from_buffer(buffer, dtype, len, (self.bytes_live.clone(), bytes))
    }

    /// Buffers and bind groups created through this `Gpu` so far.
    pub fn created(&self) -> Created {
        Created {
            buffers: self.counts.buffers.load(Ordering::Relaxed),
            bind_groups: self.counts.bind_groups.load(Ordering::Relaxed),
        }
    }

    /// The counters of [`created`](Self::created), for pools that create buffers later.
    pub(crate) fn creation_counts(&self) -> Arc<CreationCounts> {
        self.counts.clone()
    }

    /// Creates a buffer, counted in [`created`](Self::created). Every buffer wgpar makes goes
    /// through here.
    pub fn create_buffer(&self, desc: &wgpu::BufferDescriptor<'_>) -> wgpu::Buffer {
        self.counts.buffer();
        self.device.create_buffer(desc)
    }

    /// Creates a bind group, counted in [`created`](Self::created). Every bind group wgpar
    /// makes goes through here.
    pub fn create_bind_group(&self, desc: &wgpu::BindGroupDescriptor<'_>) -> wgpu::BindGroup {
        self.counts.bind_groups.fetch_add(1, Ordering::Relaxed);
        self.device.create_bind_group(desc)
    }

    /// Returns the first GPU error captured since the last check, or device loss.
    pub fn check(&self) -> Result<()> {
        // A non-blocking poll runs any pending device-lost callback first.
        let _ = self.device.poll(wgpu::PollType::Poll);
        if let Some(reason) = self.lost.lock().ok().and_then(|l| l.clone()) {
            return Err(WgparError::DeviceLost {
                device: self.describe(),
                reason,
            });
        }
        let first = self.errors.lock().ok().and_then(|mut v| {
            let first = v.first().cloned();
            v.clear();
            first
        });
        match first {
            Some(message) => Err(WgparError::Gpu {
                device: self.describe(),
                message,
            }),
            None => Ok(()),
        }
    }

    /// `gpu0 (llvmpipe [Vulkan])`.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.label, self.info.label())
    }

    /// Blocks until all submitted work is done, then reports any captured error.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| WgparError::Gpu {
                device: self.describe(),
                message: e.to_string(),
            })?;
        self.check()
    }

    /// A new command encoder.
    pub fn encoder(&self) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
    }

    /// Submits an encoder's commands.
    pub fn submit(&self, encoder: wgpu::CommandEncoder) -> wgpu::SubmissionIndex {
        self.queue.submit(Some(encoder.finish()))
    }

    /// Checks `bytes` against the adapter's buffer and storage-binding limits.
    pub fn check_size(&self, what: &str, bytes: u64) -> Result<()> {
        let too_large = |limit: u64, kind: &'static str| WgparError::TooLarge {
            what: what.to_string(),
            bytes,
            limit,
            kind,
            adapter: self.info.label(),
        };
        if bytes > self.info.max_buffer_size {
            return Err(too_large(self.info.max_buffer_size, "buffer"));
        }
        if bytes > self.info.max_storage_binding {
            return Err(too_large(self.info.max_storage_binding, "storage binding"));
        }
        Ok(())
    }

    fn storage_usage() -> wgpu::BufferUsages {
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST
    }

    /// An uninitialised storage tensor of `len` elements.
    pub fn empty(&self, what: &str, dtype: DType, len: usize) -> Result<Tensor> {
        let bytes = padded_bytes(((len.max(1)) * dtype.size()) as u64);
        self.check_size(what, bytes)?;
        let buffer = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes,
            usage: Self::storage_usage(),
            mapped_at_creation: false,
        });
        Ok(self.tensor(buffer, (dtype, len), bytes as usize))
    }

    fn upload_bytes(&self, what: &str, dtype: DType, len: usize, bytes: &[u8]) -> Result<Tensor> {
        let padded = padded_bytes(bytes.len().max(1) as u64) as usize;
        self.check_size(what, padded as u64)?;
        let contents: std::borrow::Cow<[u8]> = if padded == bytes.len() {
            bytes.into()
        } else {
            let mut v = bytes.to_vec();
            v.resize(padded, 0);
            v.into()
        };
        // create + write rather than create_buffer_init: the latter maps at creation and panics
        // inside wgpu when the device has been lost; a queued write just fails quietly and the
        // loss surfaces through `check`.
        let buffer = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: padded as u64,
            usage: Self::storage_usage(),
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&buffer, 0, &contents);
        Ok(self.tensor(buffer, (dtype, len), padded))
    }

    /// Uploads f32 data.
    pub fn upload_f32(&self, what: &str, data: &[f32]) -> Result<Tensor> {
        self.upload_bytes(what, DType::F32, data.len(), bytemuck::cast_slice(data))
    }

    /// Uploads u32 data (token ids).
    pub fn upload_u32(&self, what: &str, data: &[u32]) -> Result<Tensor> {
        self.upload_bytes(what, DType::U32, data.len(), bytemuck::cast_slice(data))
    }

    /// Uploads f32 data converted to f16.
    pub fn upload_f16(&self, what: &str, data: &[f32]) -> Result<Tensor> {
        let halves: Vec<half::f16> = data.iter().map(|&x| half::f16::from_f32(x)).collect();
        self.upload_bytes(what, DType::F16, data.len(), bytemuck::cast_slice(&halves))
    }

    /// Uploads weights in the storage dtype this device uses (f16 when allowed and asked for).
    pub fn upload_weights(&self, what: &str, data: &[f32], dtype: DType) -> Result<Tensor> {
        match dtype {
            DType::F16 if self.f16_weights => self.upload_f16(what, data),
            DType::F16 => Err(WgparError::unsupported(format!(
                "{} has no SHADER_F16: f16 weights are not available, use f32",
                self.describe()
            ))),
            _ => self.upload_f32(what, data),
        }
    }

    /// Overwrites the start of a tensor with f32 data (staged, lands at the next submit).
    pub fn write_f32(&self, tensor: &Tensor, data: &[f32]) -> Result<()> {
        self.check_write(tensor, data.len(), DType::F32)?;
        self.queue
            .write_buffer(tensor.buffer(), 0, bytemuck::cast_slice(data));
        Ok(())
    }

    /// Overwrites the start of a tensor with u32 data (staged, lands at the next submit).
    pub fn write_u32(&self, tensor: &Tensor, data: &[u32]) -> Result<()> {
        self.check_write(tensor, data.len(), DType::U32)?;
        self.queue
            .write_buffer(tensor.buffer(), 0, bytemuck::cast_slice(data));
        Ok(())
    }

    fn check_write(&self, tensor: &Tensor, len: usize, dtype: DType) -> Result<()> {
        if tensor.dtype() != dtype || len > tensor.len() {
            return Err(WgparError::Shape {
                op: "write".into(),
                detail: format!(
                    "{len} {dtype:?} elements into a tensor of {} {:?}",
                    tensor.len(),
                    tensor.dtype()
                ),
            });
        }
        Ok(())
    }

    /// Fills a tensor with a recognisable poison value (NaN for floats) so that elements a kernel
    /// fails to write show up in tests.
    pub fn poison(&self, tensor: &Tensor) {
        let words = padded_bytes(tensor.bytes()) as usize / 4;
        let poison = vec![0x7fc0_0000u32 | 0x1234; words];
        self.queue
            .write_buffer(tensor.buffer(), 0, bytemuck::cast_slice(&poison));
    }

    /// Copies a whole f32 tensor back to the host (submits and waits). Meant for results and
    /// tests; the collectives have their own pooled staging path.
    pub fn read_f32(&self, tensor: &Tensor) -> Result<Vec<f32>> {
        if tensor.dtype() != DType::F32 {
            return Err(WgparError::Shape {
                op: "read_f32".into(),
                detail: format!("tensor holds {:?}", tensor.dtype()),
            });
        }
        let bytes = self.read_bytes(tensor.buffer(), 0, tensor.bytes())?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Copies `len` bytes at `offset` of `buffer` to the host through a fresh staging buffer.
    pub fn read_bytes(&self, buffer: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        let size = padded_bytes(len.max(4));
        let staging = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.encoder();
        encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, size);
        self.submit(encoder);
        let mut bytes = self.map_read(&staging, size)?;
        bytes.truncate(len as usize);
        Ok(bytes)
    }

    /// Maps a `MAP_READ` buffer (after its copy was submitted), copies `len` bytes out in one
    /// bulk copy (some drivers map uncached memory) and unmaps it.
    pub fn map_read(&self, staging: &wgpu::Buffer, len: u64) -> Result<Vec<u8>> {
        let (tx, rx) = std::sync::mpsc::channel();
        staging
            .slice(..len)
            .map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
        self.wait()?;
        let mapped = rx.recv().map_err(|_| WgparError::Map {
            device: self.describe(),
            message: "map callback never ran".into(),
        })?;
        mapped.map_err(|e| WgparError::Map {
            device: self.describe(),
            message: e.to_string(),
        })?;
        let bytes = {
            let view = staging
                .slice(..len)
                .get_mapped_range()
                .map_err(|e| WgparError::Map {
                    device: self.describe(),
                    message: e.to_string(),
                })?;
            view.to_vec()
        };
        staging.unmap();
        Ok(bytes)
    }

    /// A small uniform buffer holding `params`, for a one-off dispatch (the model's ops keep
    /// their parameters in a `kernels::ops::Params` made once instead).
    pub fn uniform<T: bytemuck::Pod>(&self, params: &T) -> wgpu::Buffer {
        self.uniform_bytes(bytemuck::bytes_of(params))
    }

    /// A small uniform buffer holding `bytes` (already laid out as the kernel reads them),
    /// counted like every other buffer.
    pub fn uniform_bytes(&self, bytes: &[u8]) -> wgpu::Buffer {
        let buffer = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: padded_bytes(bytes.len() as u64),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&buffer, 0, bytes);
        buffer
    }
}

/// A `MAP_READ` buffer kept for repeated readbacks of up to one size (a step's tokens, or
/// its logits when asked for), so reading a step's result back creates nothing.
#[derive(Debug)]
pub struct Readback {
    buffer: wgpu::Buffer,
    size: u64,
}

impl Readback {
    /// A readback of up to `bytes` bytes on `gpu`.
    pub fn new(gpu: &Gpu, what: &str, bytes: u64) -> Result<Self> {
        let size = padded_bytes(bytes.max(4));
        if size > gpu.info.max_buffer_size {
            return Err(WgparError::TooLarge {
                what: what.to_string(),
                bytes: size,
                limit: gpu.info.max_buffer_size,
                kind: "buffer",
                adapter: gpu.info.label(),
            });
        }
        let buffer = gpu.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(Self { buffer, size })
    }

    /// Bytes it holds at most.
    pub fn size(&self) -> u64 {
        self.size
    }

    fn check(&self, bytes: u64) -> Result<u64> {
        let padded = padded_bytes(bytes);
        if padded > self.size {
            return Err(WgparError::Shape {
                op: "readback".into(),
                detail: format!("{bytes} bytes into a readback of {}", self.size),
            });
        }
        Ok(padded)
    }

    /// Records a copy of the first `bytes` bytes of `src` into the readback.
    pub fn copy(&self, encoder: &mut wgpu::CommandEncoder, src: &Tensor, bytes: u64) -> Result<()> {
        let padded = self.check(bytes)?;
        if padded > padded_bytes(src.bytes()) {
            return Err(WgparError::Shape {
                op: "readback".into(),
                detail: format!("{bytes} bytes out of a tensor of {}", src.bytes()),
            });
        }
        encoder.copy_buffer_to_buffer(src.buffer(), 0, &self.buffer, 0, padded);
        Ok(())
    }

    /// Waits for the submitted copy and returns its first `bytes` bytes.
    pub fn read(&self, gpu: &Gpu, bytes: u64) -> Result<Vec<u8>> {
        let padded = self.check(bytes)?;
        let mut data = gpu.map_read(&self.buffer, padded.max(4))?;
        data.truncate(bytes as usize);
        Ok(data)
    }
}
