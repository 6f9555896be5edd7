//! Adapter discovery on every backend wgpu offers, and a plain description of each adapter.

use serde::Serialize;

use crate::error::{Result, WgparError};

/// What a user needs to know about one adapter to decide where to run.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterDesc {
    /// Position in [`Adapters::list`]; the index `--devices` takes.
    pub index: usize,
    /// Adapter name as the driver reports it.
    pub name: String,
    /// PCI vendor id (0 when the backend does not say).
    pub vendor: u32,
    /// Vulkan, Metal, Dx12 or Gl.
    pub backend: String,
    /// Discrete, integrated, virtual GPU or CPU.
    pub device_type: String,
    /// Driver name.
    pub driver: String,
    /// Driver version / details.
    pub driver_info: String,
    /// Largest single buffer, bytes.
    pub max_buffer_size: u64,
    /// Largest storage-buffer binding, bytes.
    pub max_storage_binding: u64,
    /// Most storage buffers one compute shader may bind.
    pub max_storage_buffers_per_stage: u32,
    /// Most workgroups in one dimension of a dispatch (kernels put rows there).
    pub max_workgroups_per_dimension: u32,
    /// Has `SHADER_F16` (f16 weights in storage).
    pub shader_f16: bool,
    /// Has `TIMESTAMP_QUERY` (GPU-side timing).
    pub timestamp_query: bool,
    /// Has `SUBGROUP` operations.
    pub subgroup: bool,
    /// Subgroup size range reported by the adapter, when known.
    pub subgroup_size: (u32, u32),
}

impl AdapterDesc {
    fn new(index: usize, adapter: &wgpu::Adapter) -> Self {
        let info = adapter.get_info();
        let limits = adapter.limits();
        let features = adapter.features();
        Self {
            index,
            name: info.name,
            vendor: info.vendor,
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver: info.driver,
            driver_info: info.driver_info,
            max_buffer_size: limits.max_buffer_size,
            max_storage_binding: limits.max_storage_buffer_binding_size,
            max_storage_buffers_per_stage: limits.max_storage_buffers_per_shader_stage,
            max_workgroups_per_dimension: limits.max_compute_workgroups_per_dimension,
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            timestamp_query: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            subgroup: features.contains(wgpu::Features::SUBGROUP),
            subgroup_size: (info.subgroup_min_size, info.subgroup_max_size),
        }
    }

    /// A CPU driver (lavapipe, llvmpipe, WARP): it computes on the host's cores, so devices on
    /// it share the processor, and its costs differ from a GPU's.
    pub fn is_cpu(&self) -> bool {
        self.device_type == "Cpu"
    }

    /// A short human label, e.g. `llvmpipe (LLVM 15.0.6, 256 bits) [Vulkan]`.
    pub fn label(&self) -> String {
        format!("{} [{}]", self.name, self.backend)
    }
}

/// All adapters found on this machine, in a stable order (Vulkan first, then the others).
pub struct Adapters {
    adapters: Vec<wgpu::Adapter>,
    descs: Vec<AdapterDesc>,
}

impl Adapters {
    /// Enumerates adapters on all backends. Errors with installation advice when there is none.
    pub fn discover() -> Result<Self> {
        Self::discover_on(wgpu::Backends::all())
    }

    /// Enumerates adapters on the given backends only.
    pub fn discover_on(backends: wgpu::Backends) -> Result<Self> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let mut adapters = pollster::block_on(instance.enumerate_adapters(backends));
        // A stable order so indices mean the same thing run after run: by backend, then name.
        adapters.sort_by_key(|a| {
            let info = a.get_info();
            (backend_rank(info.backend), info.name)
        });
        if adapters.is_empty() {
            return Err(WgparError::NoAdapter {
                backends: format!("{backends:?}"),
            });
        }
        let descs = adapters
            .iter()
            .enumerate()
            .map(|(i, a)| AdapterDesc::new(i, a))
            .collect();
        Ok(Self { adapters, descs })
    }

    /// Descriptions of every adapter, indexed as `--devices` expects.
    pub fn list(&self) -> &[AdapterDesc] {
        &self.descs
    }

    /// The adapter at `index`, or an error naming how many exist.
    pub fn get(&self, index: usize) -> Result<(&wgpu::Adapter, &AdapterDesc)> {
        match (self.adapters.get(index), self.descs.get(index)) {
            (Some(a), Some(d)) => Ok((a, d)),
            _ => Err(WgparError::AdapterIndex {
                index,
                count: self.adapters.len(),
            }),
        }
    }

    /// Index of the preferred default adapter: a real GPU before a CPU one, Vulkan/Metal/DX12
    /// before GL.
    pub fn preferred(&self) -> usize {
        self.descs
            .iter()
            .min_by_key(|d| {
                let cpu = d.is_cpu();
                let gl = d.backend == "Gl";
                (cpu, gl, d.index)
            })
            .map(|d| d.index)
            .unwrap_or(0)
    }
}

fn backend_rank(backend: wgpu::Backend) -> u8 {
    match backend {
        wgpu::Backend::Vulkan => 0,
        wgpu::Backend::Metal => 1,
        wgpu::Backend::Dx12 => 2,
        wgpu::Backend::Gl => 3,
        _ => 4,
    }
}
