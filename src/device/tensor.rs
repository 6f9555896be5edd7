//! A typed buffer that lives on exactly one [`Gpu`](super::Gpu).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Element type of a tensor in GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// 32-bit float (all activations, and weights on the f32 path).
    F32,
    /// 16-bit float (weights, when the adapter has `SHADER_F16`).
    F16,
    /// 32-bit unsigned integer (token ids).
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 => 2,
        }
    }

    /// Name used in benchmarks (nccl-tests style: `float`, `half`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F16 => "half",
            DType::U32 => "uint32",
        }
    }
}

/// A flat GPU buffer of `len` elements of `dtype`. Shapes are tracked by the code that uses it;
/// the tensor only guarantees its length, so every kernel call checks lengths against its shape.
#[derive(Debug)]
pub struct Tensor {
    buffer: wgpu::Buffer,
    dtype: DType,
    len: usize,
    /// Its device's count of bytes held by live tensors, and this tensor's share of it.
    live: (Arc<AtomicUsize>, usize),
}

impl Tensor {
    /// A tensor of `buffer`; `live`: the device's live-bytes count, already holding this
    /// tensor's `bytes`, which its drop gives back.
    pub(crate) fn from_buffer(
        buffer: wgpu::Buffer,
        dtype: DType,
        len: usize,
        live: (Arc<AtomicUsize>, usize),
    ) -> Self {
        Self {
            buffer,
            dtype,
            len,
            live,
        }
    }

    /// The underlying wgpu buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the tensor holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of payload (without the padding to a multiple of 4 that f16 buffers carry).
    pub fn bytes(&self) -> u64 {
        (self.len * self.dtype.size()) as u64
    }

    /// A binding of the whole buffer.
    pub fn binding(&self) -> wgpu::BindingResource<'_> {
        self.buffer.as_entire_binding()
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        let (live, bytes) = &self.live;
        live.fetch_sub(*bytes, Ordering::Relaxed);
    }
}

/// Rounds a byte count up to wgpu's copy alignment (4).
pub(crate) fn padded_bytes(bytes: u64) -> u64 {
    bytes.div_ceil(wgpu::COPY_BUFFER_ALIGNMENT) * wgpu::COPY_BUFFER_ALIGNMENT
}
