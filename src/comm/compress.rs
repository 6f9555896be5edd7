//! Reduced-precision link: an f32 all-reduce whose payload crosses the host as f16 (half the
//! bytes each way) and is still summed in f32.
//!
//! On each device a small kernel packs the tensor into f16 pairs (`pack2x16float`, which needs
//! no `SHADER_F16`), the f16 all-reduce runs as usual (f32 accumulation, one rounding), and a
//! second kernel unpacks the sum into the f32 tensor.
//!
//! Error, per element, against the exact sum s of the inputs x_i: each input is rounded to f16
//! on the device (WGSL leaves the rounding direction to the driver: at most one f16 ulp,
//! relative 2^-10) and the sum is rounded once on the host (nearest: relative 2^-11), so
//! |result - s| <= 2^-10 * sum(|x_i|) + 2^-11 * |s| (plus 2^-24 absolute per input below f16's
//! normal range, 6.1e-5). Inputs or sums beyond f16's range (+-65504) are not representable:
//! use the native link for them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use super::collectives::lock;
use super::error::CommError;
use super::pipeline::{classify, TensorRef};
use crate::device::{DType, Gpu};

/// How an f32 all-reduce's payload travels between device and host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum LinkPrecision {
    /// As stored: exact.
    #[default]
    Native,
    /// f32 payloads packed to f16 on the device (half the bytes each way), summed in f32 on
    /// the host. Per element, |result - exact sum| <= 2^-10 * sum(|x_i|) + 2^-11 * |sum| for
    /// values within f16's normal range (6.1e-5 ..= 65504 in magnitude); larger values are not
    /// representable. Applies to f32 all-reduce; other ops and f16 tensors ignore it.
    F16,
}

impl std::str::FromStr for LinkPrecision {
    type Err = CommError;

    fn from_str(s: &str) -> Result<Self, CommError> {
        match s.to_ascii_lowercase().as_str() {
            "native" | "exact" => Ok(Self::Native),
            "f16" | "half" => Ok(Self::F16),
            other => Err(CommError::Config(format!(
                "unknown link precision '{other}': expected native or f16"
            ))),
        }
    }
}

const WGSL: &str = r#"
struct Params { count: u32, row: u32, pad0: u32, pad1: u32 }

@group(0) @binding(0) var<storage, read_write> wide: array<f32>;
@group(0) @binding(1) var<storage, read_write> packed: array<u32>;
@group(0) @binding(2) var<uniform> params: Params;

// Pair index from a 2-D dispatch (one dimension holds at most 65535 workgroups).
fn pair(gid: vec3<u32>) -> u32 {
    return gid.x + gid.y * params.row;
}

@compute @workgroup_size(256)
fn pack(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = pair(gid);
    if (2u * i >= params.count) {
        return;
    }
    var hi = 0.0;
    if (2u * i + 1u < params.count) {
        hi = wide[2u * i + 1u];
    }
    packed[i] = pack2x16float(vec2<f32>(wide[2u * i], hi));
}

@compute @workgroup_size(256)
fn unpack(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = pair(gid);
    if (2u * i >= params.count) {
        return;
    }
    let v = unpack2x16float(packed[i]);
    wide[2u * i] = v.x;
    if (2u * i + 1u < params.count) {
        wide[2u * i + 1u] = v.y;
    }
}
"#;

const GROUP: u32 = 256;

struct Kernels {
    pack: wgpu::ComputePipeline,
    unpack: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

impl Kernels {
    fn new(device: &wgpu::Device) -> Self {
        let entry = |binding, ty| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty,
            count: None,
        };
        let storage = wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only: false },
            has_dynamic_offset: false,
            min_binding_size: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("comm f16 link"),
            entries: &[
                entry(0, storage),
                entry(1, storage),
                entry(
                    2,
                    wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                ),
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("comm f16 link"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("comm f16 link"),
            source: wgpu::ShaderSource::Wgsl(WGSL.into()),
        });
        let make = |entry: &str| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions::default(),
                cache: None,
            })
        };
        Self {
            pack: make("pack"),
            unpack: make("unpack"),
            layout,
        }
    }
}

/// Per-device pack/unpack pipelines and reusable f16 scratch buffers.
#[derive(Default)]
pub(crate) struct LinkCache {
    kernels: Mutex<HashMap<wgpu::Device, Arc<Kernels>>>,
    scratch: Mutex<HashMap<wgpu::Device, wgpu::Buffer>>,
}

/// Which way to convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Convert {
    /// f32 tensor -> f16 scratch.
    Pack,
    /// f16 scratch -> f32 tensor.
    Unpack,
}

impl LinkCache {
    fn kernels(&self, gpu: &Gpu) -> Arc<Kernels> {
        lock(&self.kernels)
            .entry(gpu.device().clone())
            .or_insert_with(|| Arc::new(Kernels::new(gpu.device())))
            .clone()
    }

    /// A scratch buffer of at least `bytes` for `gpu`, taken out of the cache so concurrent
    /// operations on one device never share it.
    pub(crate) fn lease(&self, gpu: &Gpu, bytes: u64) -> wgpu::Buffer {
        let bytes = bytes.max(4).div_ceil(4) * 4;
        if let Some(b) = lock(&self.scratch).remove(gpu.device()) {
            if b.size() >= bytes {
                return b;
            }
        }
        gpu.create_buffer(&wgpu::BufferDescriptor {
            label: Some("comm f16 link scratch"),
            size: bytes.next_power_of_two(),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Hands a scratch buffer back (the larger one is kept).
    pub(crate) fn give_back(&self, gpu: &Gpu, buffer: wgpu::Buffer) {
        let mut s = lock(&self.scratch);
        match s.get(gpu.device()) {
            Some(old) if old.size() >= buffer.size() => {}
            _ => {
                s.insert(gpu.device().clone(), buffer);
            }
        }
    }

    /// Queues a conversion between `tensor` (f32) and `scratch` (packed f16) on `gpu`; device
    /// mismatches surface here as [`CommError::WrongDevice`].
    pub(crate) fn convert(
        &self,
        gpu: &Gpu,
        index: usize,
        tensor: &TensorRef,
        scratch: &wgpu::Buffer,
        way: Convert,
    ) -> Result<(), CommError> {
        const OP: &str = "all_reduce (f16 link)";
        if tensor.dtype != DType::F32 {
            return Err(CommError::mismatch(
                OP,
                "the f16 link converts f32 tensors only",
            ));
        }
        let bytes = tensor.len as u64 * 4;
        if bytes > gpu.info().max_storage_binding {
            return Err(CommError::TooLarge {
                op: OP.into(),
                bytes,
                limit: gpu.info().max_storage_binding,
                device: gpu.describe(),
            });
        }
        let k = self.kernels(gpu);
        let pairs = (tensor.len as u32).div_ceil(2);
        let groups = pairs.div_ceil(GROUP).max(1);
        let x = groups.min(65535);
        let y = groups.div_ceil(x);
        let params = gpu.uniform(&[tensor.len as u32, x * GROUP, 0, 0]);
        let scope = gpu.device().push_error_scope(wgpu::ErrorFilter::Validation);
        let bind = gpu.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("comm f16 link"),
            layout: &k.layout,
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: tensor.buffer.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: scratch.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 2,
                    resource: params.as_entire_binding(),
                },
            ],
        });
        let mut enc = gpu.encoder();
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("comm f16 link"),
                timestamp_writes: None,
            });
            pass.set_pipeline(match way {
                Convert::Pack => &k.pack,
                Convert::Unpack => &k.unpack,
            });
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(x, y, 1);
        }
        gpu.submit(enc);
        if let Some(err) = pollster::block_on(scope.pop()) {
            return Err(classify(OP, index, &gpu.describe(), &err));
        }
        Ok(())
    }
}
