//! Kernel dispatch. An op is bound once to its buffers ([`Bound`]: a bind group made when the
//! buffers are allocated, pointing at the op's 256-byte slot of a [`Params`] uniform buffer),
//! configured per step shape (the params written into the host copy of that buffer, the
//! pipeline and workgroup grid chosen), and recorded into a [`Pass`] that shares one compute
//! pass between consecutive dispatches. Binding checks every operand against the largest shape
//! the op will run (a wrong length is an error, never an out-of-bounds GPU access); configuring
//! checks the step's shape against that capacity.
//!
//! The free functions (`matmul`, `norm`, ...) run one op once, with a params buffer of its
//! own: tests, benchmarks and calibration. The model binds its ops once instead
//! (`model::Activations`), so a decode step creates no buffer and no bind group.

use std::num::NonZeroU64;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use super::quant::{embed_variant, PackedMatrix, QuantVariant};
use super::variants::Variant;
use super::{tune, variants, Family, Kernel, WeightType};
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};

/// Largest workgroup count per dimension that every adapter accepts.
const MAX_GROUPS: u32 = 65_535;
/// Most rows (tokens of one step) a row-per-workgroup kernel takes in one dispatch; the CLI
/// checks a run's shapes against it before opening devices. Lift both together.
pub const MAX_ROWS_PER_DISPATCH: usize = MAX_GROUPS as usize;
/// Bytes between two ops' parameters in a [`Params`] buffer: the largest
/// `min_uniform_buffer_offset_alignment` wgpu allows, so every adapter accepts the offsets.
pub const PARAM_STRIDE: u64 = 256;
/// Candidates the device sampler keeps at most (`top_k`); must match `shaders/argmax.wgsl`.
pub const MAX_TOP_K: usize = 64;
/// Positions per KV block, the unit of a cache's block table; must match `KV_BLOCK` in
/// `shaders/kvcache.wgsl` and `shaders/attention.wgsl`.
pub const KV_BLOCK: usize = 16;

/// Blocks per slot of a cache of `max_seq` positions (the last one short when `max_seq` is
/// not a multiple of [`KV_BLOCK`]).
pub fn blocks_per_slot(max_seq: usize) -> usize {
    max_seq.div_ceil(KV_BLOCK)
}

/// The identity block table of a cache of `slots` x `max_seq`: slot `s`'s logical block `j`
/// is physical block `s * bps + j`, positions `KV_BLOCK * j ..` of slot region `s`, which is
/// the contiguous `[slots][kv_heads][max_seq][head_dim]` layout.
pub fn identity_blocks(slots: usize, max_seq: usize) -> Vec<u32> {
    (0..slots * blocks_per_slot(max_seq))
        .map(|b| b as u32)
        .collect()
}

fn weight_type(t: &Tensor) -> WeightType {
    match t.dtype() {
        DType::F16 => WeightType::F16,
        _ => WeightType::F32,
    }
}

pub(crate) fn need(
    op: &str,
    name: &str,
    t: &Tensor,
    len: usize,
    dtype: Option<DType>,
) -> Result<()> {
    if t.len() < len {
        return Err(WgparError::Shape {
            op: op.into(),
            detail: format!("{name} has {} elements, needs {len}", t.len()),
        });
    }
    if let Some(d) = dtype {
        if t.dtype() != d {
            return Err(WgparError::Shape {
                op: op.into(),
                detail: format!("{name} is {:?}, needs {d:?}", t.dtype()),
            });
        }
    }
    Ok(())
}

pub(crate) fn to_u32(op: &str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| WgparError::Shape {
        op: op.into(),
        detail: format!("{what} = {v} exceeds u32"),
    })
}

/// A step shape above what an op was bound for.
pub(crate) fn over(op: &str, what: &str, asked: usize, bound: usize) -> Result<()> {
    if asked > bound {
        return Err(WgparError::Shape {
            op: op.into(),
            detail: format!("{asked} {what}, the op was bound for {bound}"),
        });
    }
    Ok(())
}

/// Workgroups for `items` invocations in groups of `wg`, folded into two dimensions when one
/// would exceed the per-dimension limit (the shaders linearise `wid.y * nwg.x + wid.x`).
pub(crate) fn grid_1d(op: &str, items: usize, wg: u32) -> Result<[u32; 3]> {
    if items == 0 {
        return Ok([0, 0, 0]);
    }
    let groups = items.div_ceil(wg as usize);
    let x = groups.min(MAX_GROUPS as usize);
    let y = groups.div_ceil(x);
    if y > MAX_GROUPS as usize {
        return Err(WgparError::Shape {
            op: op.into(),
            detail: format!("{items} invocations exceed the dispatch limit"),
        });
    }
    Ok([x as u32, y as u32, 1])
}

fn rows_grid(op: &str, rows: usize) -> Result<[u32; 3]> {
    if rows > MAX_GROUPS as usize {
        return Err(WgparError::Shape {
            op: op.into(),
            detail: format!("{rows} rows exceed {MAX_GROUPS} (one workgroup per row)"),
        });
    }
    Ok([rows as u32, 1, 1])
}

/// The shape parameters of a set of ops: one uniform buffer with a [`PARAM_STRIDE`]-byte slot
/// per op and a host copy of it. Configuring an op writes its slot in the host copy;
/// [`flush`](Self::flush) sends what changed to the device in one write.
pub struct Params {
    buffer: wgpu::Buffer,
    host: Vec<u8>,
    reserved: u32,
    dirty: bool,
}

impl Params {
    /// A params buffer with room for `capacity` ops.
    pub fn new(gpu: &Gpu, what: &str, capacity: usize) -> Result<Self> {
        let bytes = capacity.max(1) as u64 * PARAM_STRIDE;
        if bytes > gpu.info().max_buffer_size {
            return Err(WgparError::TooLarge {
                what: what.to_string(),
                bytes,
                limit: gpu.info().max_buffer_size,
                kind: "buffer",
                adapter: gpu.info().label(),
            });
        }
        let buffer = gpu.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(Self {
            buffer,
            host: vec![0; bytes as usize],
            reserved: 0,
            dirty: false,
        })
    }

    /// Ops this buffer has room for.
    pub fn capacity(&self) -> usize {
        self.host.len() / PARAM_STRIDE as usize
    }

    /// Slots taken by bound ops.
    pub fn used(&self) -> usize {
        self.reserved as usize
    }

    fn reserve(&mut self, op: &str) -> Result<u32> {
        if self.reserved as usize >= self.capacity() {
            return Err(WgparError::Shape {
                op: op.into(),
                detail: format!(
                    "no params slot left ({} reserved for this set of ops)",
                    self.capacity()
                ),
            });
        }
        self.reserved += 1;
        Ok(self.reserved - 1)
    }

    fn write<P: Pod>(&mut self, slot: u32, params: &P) {
        let bytes = bytemuck::bytes_of(params);
        let at = slot as usize * PARAM_STRIDE as usize;
        let dst = &mut self.host[at..at + bytes.len()];
        if dst != bytes {
            dst.copy_from_slice(bytes);
            self.dirty = true;
        }
    }

    /// Sends the params changed since the last flush to the device: one `write_buffer` (it
    /// lands at the next submit, before the work recorded for it), or nothing when nothing
    /// changed. Returns whether it wrote.
    pub fn flush(&mut self, gpu: &Gpu) -> bool {
        if !self.dirty {
            return false;
        }
        let used = self.reserved as usize * PARAM_STRIDE as usize;
        gpu.queue()
            .write_buffer(&self.buffer, 0, &self.host[..used]);
        self.dirty = false;
        true
    }

    fn binding(&self, slot: u32) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: slot as u64 * PARAM_STRIDE,
            size: NonZeroU64::new(PARAM_STRIDE),
        })
    }
}

/// The pipeline and workgroup grid chosen for one op at one step shape.
#[derive(Clone)]
pub struct Dispatch {
    kernel: Arc<Kernel>,
    groups: [u32; 3],
    variant: &'static str,
}

impl Dispatch {
    fn new(
        gpu: &Gpu,
        (family, entry): (Family, &'static str),
        weights: WeightType,
        groups: [u32; 3],
    ) -> Self {
        Self {
            kernel: gpu.kernels().get(gpu.device(), family, entry, weights),
            groups,
            variant: entry,
        }
    }

    /// The pipeline of kernel variant `v` (chosen by `kernels::tune`): its layout is the op's
    /// one layout, so the op's bind group serves it.
    fn of_variant(gpu: &Gpu, v: &'static Variant, weights: WeightType, groups: [u32; 3]) -> Self {
        Self {
            kernel: v.kernel(gpu, weights),
            groups,
            variant: v.name,
        }
    }

    /// A compiled pipeline and its grid (ops outside this module, e.g. `kernels::quant`).
    pub(crate) fn of_kernel(kernel: Arc<Kernel>, groups: [u32; 3], variant: &'static str) -> Self {
        Self {
            kernel,
            groups,
            variant,
        }
    }

    /// The kernel variant (or entry point, for ops without variants) dispatched.
    pub fn variant(&self) -> &'static str {
        self.variant
    }

    /// Workgroups launched.
    pub fn groups(&self) -> [u32; 3] {
        self.groups
    }
}

/// An op bound to its buffers: a bind group made once (the family's layout, so it serves
/// every variant of the op), the params slot it reads, and its dispatch for the shape it was
/// last configured for.
pub struct Bound {
    group: wgpu::BindGroup,
    slot: u32,
    name: &'static str,
    dispatch: Option<Dispatch>,
}

impl Bound {
    pub(crate) fn new(
        gpu: &Gpu,
        params: &mut Params,
        family: Family,
        name: &'static str,
        buffers: &[&wgpu::Buffer],
    ) -> Result<Self> {
        let slot = params.reserve(name)?;
        let layout = gpu.kernels().layout(gpu.device(), family);
        let mut entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        entries.push(wgpu::BindGroupEntry {
            binding: buffers.len() as u32,
            resource: params.binding(slot),
        });
        let group = gpu.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(name),
            layout: &layout,
            entries: &entries,
        });
        Ok(Self {
            group,
            slot,
            name,
            dispatch: None,
        })
    }

    pub(crate) fn set(&mut self, params: &mut Params, values: &impl Pod, dispatch: Dispatch) {
        params.write(self.slot, values);
        self.dispatch = Some(dispatch);
    }

    /// The dispatch of the last configured shape.
    pub fn dispatch(&self) -> Option<&Dispatch> {
        self.dispatch.as_ref()
    }
}

/// Records bound ops into an encoder, sharing one compute pass between consecutive
/// dispatches (wgpu orders the dispatches of a pass and inserts the barriers their buffers
/// need). A copy ends the pass; the next dispatch opens another.
pub struct Pass<'e> {
    encoder: &'e mut wgpu::CommandEncoder,
    pass: Option<wgpu::ComputePass<'static>>,
}

impl<'e> Pass<'e> {
    /// Starts recording into `encoder`.
    pub fn new(encoder: &'e mut wgpu::CommandEncoder) -> Self {
        Self {
            encoder,
            pass: None,
        }
    }

    /// Records `op` with its configured dispatch.
    pub fn run(&mut self, op: &impl AsRef<Bound>) -> Result<()> {
        let op = op.as_ref();
        self.run_group(op.name, &op.group, op.dispatch.as_ref())
    }

    fn run_group(
        &mut self,
        name: &str,
        group: &wgpu::BindGroup,
        dispatch: Option<&Dispatch>,
    ) -> Result<()> {
        let d = dispatch.ok_or_else(|| WgparError::Shape {
            op: name.into(),
            detail: "recorded before it was configured for a step shape".into(),
        })?;
        let [x, y, z] = d.groups;
        if x == 0 || y == 0 || z == 0 {
            return Ok(());
        }
        let encoder = &mut *self.encoder;
        let pass = self.pass.get_or_insert_with(|| {
            encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("wgpar ops"),
                    timestamp_writes: None,
                })
                .forget_lifetime()
        });
        pass.set_pipeline(&d.kernel.pipeline);
        pass.set_bind_group(0, group, &[]);
        pass.dispatch_workgroups(x, y, z);
        Ok(())
    }

    /// Ends the open compute pass, if any, and gives the encoder for other commands.
    pub fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        self.encoder
    }

    /// Copies `bytes` bytes between buffers (ends the open compute pass).
    pub fn copy(
        &mut self,
        (src, src_offset): (&wgpu::Buffer, u64),
        (dst, dst_offset): (&wgpu::Buffer, u64),
        bytes: u64,
    ) {
        self.encoder()
            .copy_buffer_to_buffer(src, src_offset, dst, dst_offset, bytes);
    }
}

/// Binds, configures and records one op with a params buffer of its own.
pub(crate) fn once<O: AsRef<Bound>>(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    name: &str,
    build: impl FnOnce(&mut Params) -> Result<O>,
) -> Result<()> {
    let mut params = Params::new(gpu, name, 1)?;
    let op = build(&mut params)?;
    params.flush(gpu);
    Pass::new(encoder).run(&op)
}

macro_rules! bound_op {
    ($t:ty) => {
        impl AsRef<Bound> for $t {
            fn as_ref(&self) -> &Bound {
                &self.op
            }
        }
    };
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
}

/// Which matmul kernel to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// The production choice: the variant tuned for this adapter and shape class
    /// (`kernels::tune`).
    Tiled,
    /// One invocation per output: the benchmark baseline.
    Naive,
    /// A named variant of `kernels::variants::MATMUL` (tests, benchmarks); an error if it does
    /// not apply to the shape or device.
    Variant(&'static str),
}

/// Operands of a matmul `y[m][n] = x[m][k] . w[n][k] (+ bias[n])`.
#[derive(Debug, Clone, Copy)]
pub struct MatmulIo<'a> {
    /// `[m][k]` f32 input.
    pub x: &'a Tensor,
    /// `[n][k]` weights (f32 or f16), stored transposed as a PyTorch `Linear` holds them.
    pub w: &'a Tensor,
    /// `[n]` f32 bias.
    pub bias: Option<&'a Tensor>,
    /// `[m][n]` f32 output.
    pub y: &'a Tensor,
}

/// The variant and grid of a matmul at one shape: the tuner's choice for this device and
/// shape class (`kernels::tune`), or the named kernel.
fn matmul_launch(
    gpu: &Gpu,
    (m, n, k): (usize, usize, usize),
    weights: WeightType,
    kernel: MatmulKernel,
    operands: Option<tune::MatmulOperands<'_>>,
) -> Result<(&'static Variant, [u32; 3])> {
    const OP: &str = "matmul";
    // The variant: tuned per adapter and shape class (see `kernels::tune`), or named.
    let variant = match kernel {
        MatmulKernel::Tiled if m == 0 || n == 0 => variants::default_matmul(gpu, (m, n, k)),
        MatmulKernel::Tiled => tune::choose_matmul(gpu, (m, n, k), weights, operands)?,
        MatmulKernel::Naive => {
            variants::by_name("matmul_naive").ok_or_else(|| unknown("matmul_naive"))?
        }
        MatmulKernel::Variant(name) => {
            let v = variants::by_name(name).ok_or_else(|| unknown(name))?;
            if v.op != variants::Op::Matmul || !v.applies(gpu, (m, n, k)) {
                return Err(WgparError::Shape {
                    op: OP.into(),
                    detail: format!("variant {name} does not apply to {m}x{n}x{k} on this device"),
                });
            }
            v
        }
    };
    if m == 0 || n == 0 {
        return Ok((variant, [0, 0, 0]));
    }
    let groups = variant.grid((m, n, k)).ok_or_else(|| WgparError::Shape {
        op: OP.into(),
        detail: format!("{m}x{n} output exceeds the dispatch limit"),
    })?;
    Ok((variant, groups))
}

/// A bound matmul over up to `rows` rows. Every matmul variant reads the same layout, so the
/// bind group made here serves whichever the tuner picks per step shape.
pub struct Matmul {
    op: Bound,
    rows: usize,
    n: usize,
    k: usize,
    bias: bool,
    weights: WeightType,
    kernel: MatmulKernel,
    /// Input and weights, which a first-use tuning run times the variants on.
    x: wgpu::Buffer,
    w: wgpu::Buffer,
}
bound_op!(Matmul);

impl Matmul {
    /// Binds `io` for up to `rows` rows of `n` outputs over `k` inputs.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        io: MatmulIo<'_>,
        (rows, n, k): (usize, usize, usize),
    ) -> Result<Self> {
        const OP: &str = "matmul";
        need(OP, "x", io.x, rows * k, Some(DType::F32))?;
        need(OP, "w", io.w, n * k, None)?;
        need(OP, "y", io.y, rows * n, Some(DType::F32))?;
        if let Some(b) = io.bias {
            need(OP, "bias", b, n, Some(DType::F32))?;
        }
        let bias = io.bias.unwrap_or(io.x);
        let buffers = [io.x.buffer(), io.w.buffer(), bias.buffer(), io.y.buffer()];
        Ok(Self {
            op: Bound::new(gpu, params, Family::Matmul, OP, &buffers)?,
            rows,
            n,
            k,
            bias: io.bias.is_some(),
            weights: weight_type(io.w),
            kernel: MatmulKernel::Tiled,
            x: io.x.buffer().clone(),
            w: io.w.buffer().clone(),
        })
    }

    /// Runs `kernel` instead of the tuned choice (tests, benchmarks).
    pub fn with_kernel(mut self, kernel: MatmulKernel) -> Self {
        self.kernel = kernel;
        self
    }

    /// Configures the op for `m` rows: the params, and the variant and grid the kernels
    /// module chooses for this shape on this device.
    pub fn configure(&mut self, gpu: &Gpu, params: &mut Params, m: usize) -> Result<()> {
        const OP: &str = "matmul";
        over(OP, "rows", m, self.rows)?;
        let values = MatmulParams {
            m: to_u32(OP, "m", m)?,
            n: to_u32(OP, "n", self.n)?,
            k: to_u32(OP, "k", self.k)?,
            has_bias: self.bias as u32,
        };
        let operands = tune::MatmulOperands {
            x: &self.x,
            w: &self.w,
        };
        let (variant, groups) = matmul_launch(
            gpu,
            (m, self.n, self.k),
            self.weights,
            self.kernel,
            Some(operands),
        )?;
        let dispatch = Dispatch::of_variant(gpu, variant, self.weights, groups);
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// `y[m][n] = x[m][k] . w[n][k] (+ bias[n])`, with `w` stored transposed (f32 or f16).
pub fn matmul(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    io: MatmulIo<'_>,
    (m, n, k): (usize, usize, usize),
    kernel: MatmulKernel,
) -> Result<()> {
    once(gpu, encoder, "matmul", |params| {
        let mut op = Matmul::bind(gpu, params, io, (m, n, k))?.with_kernel(kernel);
        op.configure(gpu, params, m)?;
        Ok(op)
    })
}

fn unknown(name: &str) -> WgparError {
    WgparError::TuneSetting {
        name: "matmul variant".into(),
        value: name.into(),
        expected: format!("one of {}", variants::names().join(", ")),
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct NormParams {
    rows: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}

/// Row normalisation kind.
#[derive(Debug, Clone, Copy)]
pub enum Norm<'a> {
    /// LayerNorm with scale and shift.
    Layer {
        /// Scale.
        gamma: &'a Tensor,
        /// Shift.
        beta: &'a Tensor,
    },
    /// RMSNorm with scale.
    Rms {
        /// Scale.
        gamma: &'a Tensor,
    },
}

/// A bound row normalisation `y = norm(x)` over up to `rows` rows of `cols`.
pub struct NormOp {
    op: Bound,
    entry: &'static str,
    rows: usize,
    cols: usize,
    eps: f32,
}
bound_op!(NormOp);

impl NormOp {
    /// Binds `y = norm(x)` for up to `rows` rows of `cols`.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        kind: Norm<'_>,
        (x, y): (&Tensor, &Tensor),
        (rows, cols): (usize, usize),
        eps: f32,
    ) -> Result<Self> {
        const OP: &str = "norm";
        need(OP, "x", x, rows * cols, Some(DType::F32))?;
        need(OP, "y", y, rows * cols, Some(DType::F32))?;
        let (entry, gamma, beta) = match kind {
            Norm::Layer { gamma, beta } => ("layernorm", gamma, beta),
            Norm::Rms { gamma } => ("rmsnorm", gamma, gamma),
        };
        need(OP, "gamma", gamma, cols, Some(DType::F32))?;
        need(OP, "beta", beta, cols, Some(DType::F32))?;
        let buffers = [x.buffer(), y.buffer(), gamma.buffer(), beta.buffer()];
        Ok(Self {
            op: Bound::new(gpu, params, Family::Norm, OP, &buffers)?,
            entry,
            rows,
            cols,
            eps,
        })
    }

    /// Configures the op for `rows` rows.
    pub fn configure(&mut self, gpu: &Gpu, params: &mut Params, rows: usize) -> Result<()> {
        const OP: &str = "norm";
        over(OP, "rows", rows, self.rows)?;
        let values = NormParams {
            rows: to_u32(OP, "rows", rows)?,
            cols: to_u32(OP, "cols", self.cols)?,
            eps: self.eps,
            _pad: 0,
        };
        let dispatch = Dispatch::new(
            gpu,
            (Family::Norm, self.entry),
            WeightType::F32,
            rows_grid(OP, rows)?,
        );
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// `y = norm(x)` over rows of `cols`.
pub fn norm(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    kind: Norm<'_>,
    (x, y): (&Tensor, &Tensor),
    (rows, cols): (usize, usize),
    eps: f32,
) -> Result<()> {
    once(gpu, encoder, "norm", |params| {
        let mut op = NormOp::bind(gpu, params, kind, (x, y), (rows, cols), eps)?;
        op.configure(gpu, params, rows)?;
        Ok(op)
    })
}

/// A bound RMSNorm of every head of `y` in place (Qwen3's query and key norms): `tokens`
/// rows of `heads` heads of `head_dim` values, every head scaled by the one `gamma`.
pub struct HeadNormOp {
    op: Bound,
    heads: usize,
    head_dim: usize,
    tokens: usize,
    eps: f32,
}
bound_op!(HeadNormOp);

impl HeadNormOp {
    /// Binds the norm of up to `tokens` tokens of `heads` x `head_dim` values of `y`.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        (gamma, y): (&Tensor, &Tensor),
        (tokens, heads, head_dim): (usize, usize, usize),
        eps: f32,
    ) -> Result<Self> {
        const OP: &str = "head norm";
        need(OP, "y", y, tokens * heads * head_dim, Some(DType::F32))?;
        need(OP, "gamma", gamma, head_dim, Some(DType::F32))?;
        // `x` is unread by the in-place entry point; gamma fills its read-only slot.
        let buffers = [gamma.buffer(), y.buffer(), gamma.buffer(), gamma.buffer()];
        Ok(Self {
            op: Bound::new(gpu, params, Family::Norm, OP, &buffers)?,
            heads,
            head_dim,
            tokens,
            eps,
        })
    }

    /// Configures the op for `tokens` tokens.
    pub fn configure(&mut self, gpu: &Gpu, params: &mut Params, tokens: usize) -> Result<()> {
        const OP: &str = "head norm";
        over(OP, "tokens", tokens, self.tokens)?;
        let rows = tokens * self.heads;
        let values = NormParams {
            rows: to_u32(OP, "rows", rows)?,
            cols: to_u32(OP, "cols", self.head_dim)?,
            eps: self.eps,
            _pad: 0,
        };
        // One workgroup a row, the rows folded into two grid dimensions.
        let groups = grid_1d(OP, rows, 1)?;
        let dispatch = Dispatch::new(
            gpu,
            (Family::Norm, "rmsnorm_heads"),
            WeightType::F32,
            groups,
        );
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// RMSNorm of every `head_dim`-wide head of `tokens` x `heads` in `y`, in place, scaled by
/// `gamma`.
pub fn head_norm(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    (gamma, y): (&Tensor, &Tensor),
    (tokens, heads, head_dim): (usize, usize, usize),
    eps: f32,
) -> Result<()> {
    once(gpu, encoder, "head norm", |params| {
        let shape = (tokens, heads, head_dim);
        let mut op = HeadNormOp::bind(gpu, params, (gamma, y), shape, eps)?;
        op.configure(gpu, params, tokens)?;
        Ok(op)
    })
}

/// Applies `op` with its scalar (`Scale`, `Softcap`; others ignore it) to `a` (`rows x cols`
/// elements), `b` bound as its second operand (read where the op takes one).
pub fn elementwise_scalar(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    op: Elementwise,
    (a, b): (&Tensor, &Tensor),
    (rows, cols): (usize, usize),
    scalar: f32,
) -> Result<()> {
    let b = match op.b_len(rows, cols) {
        Some(_) => Operand::Tensor(b),
        None => Operand::Unused(b),
    };
    once(gpu, encoder, "elementwise", |params| {
        let bound = ElementwiseOp::bind(gpu, params, op, (a, b), (rows, cols))?;
        let mut bound = bound.with_scalar(scalar);
        bound.configure(gpu, params, rows)?;
        Ok(bound)
    })
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RowsParams {
    rows: u32,
    cols: u32,
    _pad: [u32; 2],
}

/// A bound softmax over each row of `x`, in place.
pub struct Softmax {
    op: Bound,
    rows: usize,
    cols: usize,
}
bound_op!(Softmax);

impl Softmax {
    /// Binds a softmax over up to `rows` rows of `cols` of `x`.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        x: &Tensor,
        (rows, cols): (usize, usize),
    ) -> Result<Self> {
        need("softmax", "x", x, rows * cols, Some(DType::F32))?;
        Ok(Self {
            op: Bound::new(gpu, params, Family::Softmax, "softmax", &[x.buffer()])?,
            rows,
            cols,
        })
    }

    /// Configures the op for `rows` rows.
    pub fn configure(&mut self, gpu: &Gpu, params: &mut Params, rows: usize) -> Result<()> {
        const OP: &str = "softmax";
        over(OP, "rows", rows, self.rows)?;
        let values = RowsParams {
            rows: to_u32(OP, "rows", rows)?,
            cols: to_u32(OP, "cols", self.cols)?,
            _pad: [0; 2],
        };
        let dispatch = Dispatch::new(
            gpu,
            (Family::Softmax, "softmax"),
            WeightType::F32,
            rows_grid(OP, rows)?,
        );
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// Softmax over each row of `x`, in place.
pub fn softmax(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    x: &Tensor,
    rows: usize,
    cols: usize,
) -> Result<()> {
    once(gpu, encoder, "softmax", |params| {
        let mut op = Softmax::bind(gpu, params, x, (rows, cols))?;
        op.configure(gpu, params, rows)?;
        Ok(op)
    })
}

/// Shape of one attention call: which tokens and which cache. Where each sequence row's
/// tokens go (its KV slot and past length) comes from the step's sequence table ([`KvCache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Sequence rows in this call.
    pub batch: usize,
    /// New tokens per sequence in this call.
    pub seq: usize,
    /// Sequences the cache holds (its slots).
    pub slots: usize,
    /// Query heads (local to this device).
    pub n_heads: usize,
    /// Key/value heads (local to this device).
    pub n_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// Cache capacity per sequence.
    pub max_seq: usize,
    /// Query heads per KV head in the whole model.
    pub group: usize,
    /// Global index of this device's first query head.
    pub q_head_offset: usize,
    /// Global index of this device's first KV head.
    pub kv_head_offset: usize,
}

impl AttnShape {
    /// Tokens in this call.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// Elements in one layer's K (or V) cache.
    pub fn cache_len(&self) -> usize {
        self.slots * self.n_kv_heads * self.max_seq * self.head_dim
    }

    fn validate(&self, op: &str) -> Result<()> {
        let bad = |detail: String| {
            Err(WgparError::Shape {
                op: op.into(),
                detail,
            })
        };
        // Every local query head must map onto a local KV head.
        let first = self.q_head_offset / self.group.max(1);
        let last = (self.q_head_offset + self.n_heads.max(1) - 1) / self.group.max(1);
        if self.group == 0
            || self.n_heads == 0
            || first < self.kv_head_offset
            || last >= self.kv_head_offset + self.n_kv_heads
        {
            return bad(format!(
                "query heads {}..{} (group {}) do not map onto KV heads {}..{}",
                self.q_head_offset,
                self.q_head_offset + self.n_heads,
                self.group,
                self.kv_head_offset,
                self.kv_head_offset + self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || self.head_dim > 256 {
            return bad(format!("head_dim {} outside 1..=256", self.head_dim));
        }
        if self.slots == 0 || self.seq > self.max_seq {
            return bad(format!(
                "{} new tokens per sequence in a cache of {} slots x {} positions",
                self.seq, self.slots, self.max_seq
            ));
        }
        Ok(())
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct AttnParams {
    batch: u32,
    seq: u32,
    slots: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    max_seq: u32,
    scale: f32,
    group: u32,
    q_offset: u32,
    kv_offset: u32,
    /// 1: causal; 0: bidirectional over each sequence's real keys (attention only; the KV
    /// store kernel ignores it).
    causal: u32,
    /// Keys a causal query sees, its own included (a sliding window); 0: all of them
    /// (attention only).
    window: u32,
    /// Rows per slot and head of a ring cache (position p at row p % ring); 0: paged.
    ring: u32,
    _pad: [u32; 2],
}

impl AttnParams {
    fn new(op: &str, s: &AttnShape, causal: bool) -> Result<Self> {
        Ok(Self {
            batch: to_u32(op, "batch", s.batch)?,
            seq: to_u32(op, "seq", s.seq)?,
            slots: to_u32(op, "slots", s.slots)?,
            n_heads: to_u32(op, "n_heads", s.n_heads)?,
            n_kv_heads: to_u32(op, "n_kv_heads", s.n_kv_heads)?,
            head_dim: to_u32(op, "head_dim", s.head_dim)?,
            max_seq: to_u32(op, "max_seq", s.max_seq)?,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            group: to_u32(op, "group", s.group)?,
            q_offset: to_u32(op, "q_head_offset", s.q_head_offset)?,
            kv_offset: to_u32(op, "kv_head_offset", s.kv_head_offset)?,
            causal: causal as u32,
            window: 0,
            ring: 0,
            _pad: [0; 2],
        })
    }
}

/// Which keys a query sees.
#[derive(Debug, Clone, Copy)]
pub enum AttnMask<'a> {
    /// Positions up to the query's own (decoders).
    Causal,
    /// Every position of the sequence that is not padding (encoders): sequence `b` has
    /// `lens[b]` real tokens, `1 <= lens[b]`, values above `past + seq` meaning all of them.
    Bidirectional {
        /// `[batch]` u32 real-token counts.
        lens: &'a Tensor,
    },
}

/// One layer's KV cache (`[slots][kv_heads][max_seq][head_dim]` each) and the step's sequence
/// table that addresses it: `seqs[2b]` = the KV slot of sequence row `b`, `seqs[2b + 1]` = its
/// past length (u32). The table's values are validated on the host before it is written
/// (slots below the cache's, `past + seq <= max_seq`); kernels clamp them regardless.
#[derive(Debug, Clone, Copy)]
pub struct KvCache<'a> {
    /// Keys.
    pub k: &'a Tensor,
    /// Values.
    pub v: &'a Tensor,
    /// `[batch][2]` u32 sequence table of the step.
    pub seqs: &'a Tensor,
}

/// How kernels address one layer's cache: through a block table (`[slots][blocks_per_slot]`
/// u32; `None`: the identity table, which the op then owns), or as a ring per slot.
#[derive(Debug, Clone, Copy, Default)]
pub struct KvAddress<'a> {
    /// The block table (also bound, never read, under a ring).
    pub blocks: Option<&'a Tensor>,
    /// `Some(rows)`: the cache is `[slots][kv_heads][rows][head_dim]`, position p at row
    /// p % rows (a sliding-window layer's, which holds only its window and a step's keys).
    pub ring: Option<usize>,
}

impl KvAddress<'_> {
    /// Positions one slot's head holds in a cache of `shape`.
    fn rows(&self, shape: &AttnShape) -> usize {
        self.ring.unwrap_or(shape.max_seq)
    }

    /// The ring's rows as the kernels take them (0: paged), checked against `shape`.
    fn ring_param(&self, op: &str, shape: &AttnShape) -> Result<u32> {
        match self.ring {
            None => Ok(0),
            Some(r) if r > 0 && r <= shape.max_seq => to_u32(op, "ring", r),
            Some(r) => Err(WgparError::Shape {
                op: op.into(),
                detail: format!(
                    "a ring of {r} rows for slots of {} positions",
                    shape.max_seq
                ),
            }),
        }
    }
}

/// The block table through which kernels address a cache (`[slots][blocks_per_slot]` u32,
/// entry `slot * bps + j` the physical block of the slot's logical block `j`, see
/// [`identity_blocks`]), bound beside the cache. Ops bound without one get the identity
/// table, which they own (the second part).
fn block_table(
    gpu: &Gpu,
    op: &str,
    blocks: Option<&Tensor>,
    s: &AttnShape,
) -> Result<(wgpu::Buffer, Option<Tensor>)> {
    let len = s.slots * blocks_per_slot(s.max_seq);
    match blocks {
        Some(t) => {
            need(op, "kv_blocks", t, len, Some(DType::U32))?;
            Ok((t.buffer().clone(), None))
        }
        None => {
            let t = gpu.upload_u32("kv identity blocks", &identity_blocks(s.slots, s.max_seq))?;
            Ok((t.buffer().clone(), Some(t)))
        }
    }
}

impl KvCache<'_> {
    /// Checks the cache against `shape` and returns its stored type: keys and values are both
    /// f32 or both f16 (the kernels' `KT` variant).
    fn check(&self, op: &str, shape: &AttnShape, rows: usize) -> Result<WeightType> {
        let stored = match self.k.dtype() {
            DType::F16 => DType::F16,
            _ => DType::F32,
        };
        let len = shape.slots * shape.n_kv_heads * rows * shape.head_dim;
        need(op, "k_cache", self.k, len, Some(stored))?;
        need(op, "v_cache", self.v, len, Some(stored))?;
        need(op, "seqs", self.seqs, 2 * shape.batch, Some(DType::U32))?;
        Ok(weight_type(self.k))
    }
}

/// A bound attention of queries over a KV cache (which must already hold the step's keys
/// and values), for up to `shape.batch` rows of `shape.seq` tokens.
pub struct Attention {
    op: Bound,
    shape: AttnShape,
    causal: bool,
    /// Score scale instead of 1/sqrt(head_dim), if set.
    scale: Option<f32>,
    /// Keys a causal query sees (its own included), if it slides.
    window: Option<usize>,
    /// Rows per slot of a ring cache (0: paged).
    ring: u32,
    /// A named variant (tests, benchmarks) instead of the tuned choice.
    variant: Option<&'static str>,
    /// The cache's stored type, which selects the kernels' `KT` variant.
    stored: WeightType,
    /// `q, k_cache, v_cache, lens, out, seqs, kv_blocks` as bound: a first-use tuning run
    /// times the variants on them (writing a scratch output instead of `out`).
    buffers: [wgpu::Buffer; 7],
    /// The identity block table, where bound without one.
    _owned_blocks: Option<Tensor>,
}
bound_op!(Attention);

impl Attention {
    /// Binds attention of `q` over `cache` (addressed contiguously: the identity block table)
    /// into `out`, for steps up to `capacity` (its batch and token count bound the step
    /// shapes configured later).
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        io: (&Tensor, KvCache<'_>, &Tensor),
        capacity: &AttnShape,
        mask: AttnMask<'_>,
    ) -> Result<Self> {
        Self::bind_paged(gpu, params, io, KvAddress::default(), capacity, mask)
    }

    /// [`bind`](Self::bind) with the cache addressed as `address` says (its block table,
    /// `capacity.slots x blocks_per_slot(max_seq)` u32, written by the caller, or a ring).
    pub fn bind_paged(
        gpu: &Gpu,
        params: &mut Params,
        (q, cache, out): (&Tensor, KvCache<'_>, &Tensor),
        address: KvAddress<'_>,
        capacity: &AttnShape,
        mask: AttnMask<'_>,
    ) -> Result<Self> {
        const OP: &str = "attention";
        capacity.validate(OP)?;
        let ring = address.ring_param(OP, capacity)?;
        let (blocks, owned_blocks) = block_table(gpu, OP, address.blocks, capacity)?;
        let q_len = capacity.tokens() * capacity.n_heads * capacity.head_dim;
        need(OP, "q", q, q_len, Some(DType::F32))?;
        need(OP, "out", out, q_len, Some(DType::F32))?;
        let stored = cache.check(OP, capacity, address.rows(capacity))?;
        // A causal op never reads `lens`; bind `q` there (read-only, so aliasing is allowed).
        let (lens, causal) = match mask {
            AttnMask::Causal => (q, true),
            AttnMask::Bidirectional { lens } => {
                need(OP, "lens", lens, capacity.batch, Some(DType::U32))?;
                (lens, false)
            }
        };
        let buffers = [
            q.buffer(),
            cache.k.buffer(),
            cache.v.buffer(),
            lens.buffer(),
            out.buffer(),
            cache.seqs.buffer(),
            &blocks,
        ];
        Ok(Self {
            op: Bound::new(gpu, params, Family::Attention, OP, &buffers)?,
            shape: *capacity,
            causal,
            scale: None,
            window: None,
            ring,
            variant: None,
            stored,
            buffers: buffers.map(|b| b.clone()),
            _owned_blocks: owned_blocks,
        })
    }

    /// Scores scaled by `scale` instead of 1/sqrt(head_dim) (Gemma's `query_pre_attn_scalar`),
    /// where `Some`.
    pub fn with_scale(mut self, scale: Option<f32>) -> Self {
        self.scale = scale;
        self
    }

    /// A causal query sees only the `window` keys ending at its own (a sliding-window
    /// layer), where `Some`; a bidirectional op refuses one at configure time.
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }

    /// Runs the variant called `name` instead of the tuned choice (tests, benchmarks); an
    /// error at configure time where it does not apply.
    pub fn with_variant(mut self, name: Option<&'static str>) -> Self {
        self.variant = name;
        self
    }

    /// Configures the op for `batch` rows of `seq` new tokens over a context of up to
    /// `context` positions (the longest row's past plus `seq`; held within `seq..=max_seq`):
    /// the variant is the one tuned for that context's bucket
    /// ([`variants::context_bucket`]), so callers configure again when the bucket changes.
    pub fn configure(
        &mut self,
        gpu: &Gpu,
        params: &mut Params,
        (batch, seq): (usize, usize),
        context: usize,
    ) -> Result<()> {
        const OP: &str = "attention";
        let shape = step_shape(OP, &self.shape, batch, seq)?;
        let mut values = AttnParams::new(OP, &shape, self.causal)?;
        if let Some(scale) = self.scale {
            values.scale = scale;
        }
        if let Some(window) = self.window {
            if !self.causal || window == 0 {
                return Err(WgparError::Shape {
                    op: OP.into(),
                    detail: format!(
                        "a sliding window of {window} needs a causal attention of a positive \
                         window"
                    ),
                });
            }
            values.window = to_u32(OP, "window", window)?;
        }
        self.check_ring(seq)?;
        values.ring = self.ring;
        let context = context.clamp(seq, shape.max_seq);
        let variant = self.choose(gpu, &shape, &values, context)?;
        let heads = shape.n_heads;
        let groups = variants::attention_grid(variant, batch, seq, heads).ok_or_else(|| {
            WgparError::Shape {
                op: OP.into(),
                detail: format!(
                    "{} tokens x {heads} heads exceed the dispatch limit",
                    batch * seq
                ),
            }
        })?;
        let dispatch = Dispatch::of_variant(gpu, variant, self.stored, groups);
        self.op.set(params, &values, dispatch);
        Ok(())
    }

    /// A ring holds the window's older keys and the step's new ones only if a step writes at
    /// most `ring - window + 1` positions a row; a ring is for a sliding (causal) layer.
    fn check_ring(&self, seq: usize) -> Result<()> {
        let ring = self.ring as usize;
        if ring == 0 {
            return Ok(());
        }
        let detail = match self.window.filter(|_| self.causal) {
            None => format!("a ring cache of {ring} rows needs a sliding window"),
            Some(w) if seq + w - 1 > ring => format!(
                "{seq} new positions a row over a window of {w} need {} ring rows, the cache \
                 has {ring}",
                seq + w - 1
            ),
            Some(_) => return Ok(()),
        };
        Err(WgparError::Shape {
            op: "attention".into(),
            detail,
        })
    }

    /// The variant for `shape`: the named one, or the tuner's choice for its class on this
    /// device (timed on the bound operands on first use).
    fn choose(
        &self,
        gpu: &Gpu,
        shape: &AttnShape,
        values: &AttnParams,
        context: usize,
    ) -> Result<&'static Variant> {
        const OP: &str = "attention";
        let (batch, seq, heads, dim) = (shape.batch, shape.seq, shape.n_heads, shape.head_dim);
        let applies = |v: &Variant| {
            variants::attention_applies(v, seq, dim)
                && variants::attention_grid(v, batch, seq, heads).is_some()
        };
        if let Some(name) = self.variant {
            let v = variants::by_name(name).ok_or_else(|| unknown(name))?;
            if !applies(v) {
                return Err(WgparError::Shape {
                    op: OP.into(),
                    detail: format!("variant {name} does not apply to seq {seq}, head_dim {dim}"),
                });
            }
            return Ok(v);
        }
        let class = variants::Class::Attention(
            variants::AttnClass::of(seq, context, batch * heads, dim, self.causal)
                .cached_as(self.stored),
        );
        let candidates: Vec<&'static Variant> =
            variants::ATTENTION.iter().filter(|v| applies(v)).collect();
        let out_len = shape.tokens() * heads * dim;
        tune::choose(
            gpu,
            class,
            &applies,
            variants::default_attention(gpu, seq, context, dim),
            &mut || {
                // Timing reads the bound operands and writes a scratch output.
                let scratch = gpu.empty("tune.attention.out", DType::F32, out_len)?;
                let [q, k, v, lens, _, seqs, blocks] = &self.buffers;
                tune::measure_variants(
                    gpu,
                    &candidates,
                    self.stored,
                    &[q, k, v, lens, scratch.buffer(), seqs, blocks],
                    bytemuck::bytes_of(values),
                    &|v| variants::attention_grid(v, batch, seq, heads),
                    tune::Effort::Tune,
                )
            },
        )
    }
}

/// Causal attention of a sliding-window layer (`window` keys ending at each query's own) with
/// scores scaled by `scale` (1/sqrt(head_dim) where `None`), the kernel variant named or
/// tuned, as [`attention_with`].
pub fn attention_window(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    io: (&Tensor, KvCache<'_>, &Tensor),
    shape: &AttnShape,
    (scale, window): (Option<f32>, usize),
    variant: Option<&'static str>,
) -> Result<()> {
    once(gpu, encoder, "attention", |params| {
        let mut op = Attention::bind(gpu, params, io, shape, AttnMask::Causal)?
            .with_variant(variant)
            .with_scale(scale)
            .with_window(Some(window));
        op.configure(gpu, params, (shape.batch, shape.seq), shape.max_seq)?;
        Ok(op)
    })
}

/// `capacity` with the step's batch and tokens, checked against it.
fn step_shape(op: &str, capacity: &AttnShape, batch: usize, seq: usize) -> Result<AttnShape> {
    over(op, "sequences", batch, capacity.batch)?;
    over(op, "tokens", batch * seq, capacity.tokens())?;
    let shape = AttnShape {
        batch,
        seq,
        ..*capacity
    };
    shape.validate(op)?;
    Ok(shape)
}

/// Causal attention of `q` over the cache (which must already hold the new keys and values).
pub fn attention(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    q: &Tensor,
    cache: KvCache<'_>,
    out: &Tensor,
    shape: &AttnShape,
) -> Result<()> {
    attention_masked(gpu, encoder, (q, cache, out), shape, AttnMask::Causal)
}

/// Attention of `q` over the cache (which must already hold the new keys and values), causal
/// or bidirectional as `mask` says.
pub fn attention_masked(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    io: (&Tensor, KvCache<'_>, &Tensor),
    shape: &AttnShape,
    mask: AttnMask<'_>,
) -> Result<()> {
    attention_with(gpu, encoder, io, shape, mask, None)
}

/// [`attention_masked`] with the kernel variant named (`Some`: tests, benchmarks; an error if
/// it does not apply) or tuned (`None`).
pub fn attention_with(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    io: (&Tensor, KvCache<'_>, &Tensor),
    shape: &AttnShape,
    mask: AttnMask<'_>,
    variant: Option<&'static str>,
) -> Result<()> {
    once(gpu, encoder, "attention", |params| {
        let mut op = Attention::bind(gpu, params, io, shape, mask)?.with_variant(variant);
        // The past lengths are in the device-side table: the cache's capacity bounds them.
        op.configure(gpu, params, (shape.batch, shape.seq), shape.max_seq)?;
        Ok(op)
    })
}

/// A bound KV-cache append: the step's keys and values (`[tokens][n_kv_heads * head_dim]`)
/// into each row's slot at positions `past ..`, as the sequence table says.
pub struct KvStore {
    op: Bound,
    shape: AttnShape,
    /// The cache's stored type, which selects the kernel's `KT` variant.
    stored: WeightType,
    /// Rows per slot of a ring cache (0: paged).
    ring: u32,
    /// The identity block table, where bound without one.
    _owned_blocks: Option<Tensor>,
}
bound_op!(KvStore);

impl KvStore {
    /// Binds the append of `k`, `v` into `cache` (addressed contiguously: the identity block
    /// table) for steps up to `capacity`.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        kv: (&Tensor, &Tensor),
        cache: KvCache<'_>,
        capacity: &AttnShape,
    ) -> Result<Self> {
        Self::bind_paged(gpu, params, kv, (cache, KvAddress::default()), capacity)
    }

    /// [`bind`](Self::bind) with the cache addressed as `address` says (as
    /// [`Attention::bind_paged`]).
    pub fn bind_paged(
        gpu: &Gpu,
        params: &mut Params,
        (k, v): (&Tensor, &Tensor),
        (cache, address): (KvCache<'_>, KvAddress<'_>),
        capacity: &AttnShape,
    ) -> Result<Self> {
        const OP: &str = "kv_store";
        capacity.validate(OP)?;
        let ring = address.ring_param(OP, capacity)?;
        let (blocks, owned_blocks) = block_table(gpu, OP, address.blocks, capacity)?;
        let len = capacity.tokens() * capacity.n_kv_heads * capacity.head_dim;
        need(OP, "k", k, len, Some(DType::F32))?;
        need(OP, "v", v, len, Some(DType::F32))?;
        let stored = cache.check(OP, capacity, address.rows(capacity))?;
        let buffers = [
            k.buffer(),
            v.buffer(),
            cache.k.buffer(),
            cache.v.buffer(),
            cache.seqs.buffer(),
            &blocks,
        ];
        Ok(Self {
            op: Bound::new(gpu, params, Family::KvCache, OP, &buffers)?,
            shape: *capacity,
            stored,
            ring,
            _owned_blocks: owned_blocks,
        })
    }

    /// Configures the op for `batch` rows of `seq` new tokens.
    pub fn configure(
        &mut self,
        gpu: &Gpu,
        params: &mut Params,
        (batch, seq): (usize, usize),
    ) -> Result<()> {
        const OP: &str = "kv_store";
        let shape = step_shape(OP, &self.shape, batch, seq)?;
        if self.ring != 0 && seq > self.ring as usize {
            return Err(WgparError::Shape {
                op: OP.into(),
                detail: format!(
                    "{seq} new positions a row into a ring of {} rows",
                    self.ring
                ),
            });
        }
        let mut values = AttnParams::new(OP, &shape, true)?;
        values.ring = self.ring;
        let len = shape.tokens() * shape.n_kv_heads * shape.head_dim;
        let dispatch = Dispatch::new(
            gpu,
            (Family::KvCache, "kv_store"),
            self.stored,
            grid_1d(OP, len, 256)?,
        );
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// Appends `k`, `v` ([tokens][n_kv_heads * head_dim]) to the cache: row `b`'s tokens go to
/// its slot at positions `past ..` as the sequence table says.
pub fn kv_store(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    k: &Tensor,
    v: &Tensor,
    cache: KvCache<'_>,
    shape: &AttnShape,
) -> Result<()> {
    once(gpu, encoder, "kv_store", |params| {
        let mut op = KvStore::bind(gpu, params, (k, v), cache, shape)?;
        op.configure(gpu, params, (shape.batch, shape.seq))?;
        Ok(op)
    })
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct RopeParams {
    tokens: u32,
    seq: u32,
    positions: u32,
    n_heads: u32,
    head_dim: u32,
    rot_dim: u32,
    _pad: [u32; 2],
}

/// Host-built rotary tables `cos`, `sin` (`[positions][rot_dim / 2]` each, `rot_dim` the
/// rotated values of a head).
#[derive(Debug, Clone, Copy)]
pub struct RopeTables<'a> {
    /// Cosines.
    pub cos: &'a Tensor,
    /// Sines.
    pub sin: &'a Tensor,
    /// Positions the tables cover.
    pub positions: usize,
}

/// The heads RoPE turns: `n_heads` of `head_dim` values, of which the first `rot_dim` rotate
/// (`head_dim` for the whole head; less under a partial rotary factor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeHeads {
    /// Heads per token.
    pub n_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Rotated values per head, the first ones (even, at most `head_dim`).
    pub rot_dim: usize,
}

/// A bound rotary embedding, in place on `x` (`[batch * seq][n_heads * head_dim]`).
pub struct Rope {
    op: Bound,
    batch: usize,
    tokens: usize,
    heads: RopeHeads,
    positions: usize,
}
bound_op!(Rope);

impl Rope {
    /// Binds RoPE on `x` for up to `batch` rows and `tokens` tokens of `heads`; row `b`'s
    /// token `i` is rotated by position `past + i`, `past` from the sequence table `seqs`
    /// (`[batch][2]`, validated on the host against the tables).
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        (x, tables, seqs): (&Tensor, RopeTables<'_>, &Tensor),
        (batch, tokens): (usize, usize),
        heads: RopeHeads,
    ) -> Result<Self> {
        const OP: &str = "rope";
        let bad = |detail: String| {
            Err(WgparError::Shape {
                op: OP.into(),
                detail,
            })
        };
        let RopeHeads {
            n_heads,
            head_dim,
            rot_dim,
        } = heads;
        if rot_dim == 0 || !rot_dim.is_multiple_of(2) || rot_dim > head_dim {
            return bad(format!(
                "{rot_dim} rotated values of heads of {head_dim}: must be even, positive and at \
                 most the head"
            ));
        }
        if tables.positions == 0 {
            return bad("rotary tables cover no positions".into());
        }
        need(OP, "x", x, tokens * n_heads * head_dim, Some(DType::F32))?;
        need(OP, "seqs", seqs, 2 * batch, Some(DType::U32))?;
        let table = tables.positions * rot_dim / 2;
        need(OP, "cos", tables.cos, table, Some(DType::F32))?;
        need(OP, "sin", tables.sin, table, Some(DType::F32))?;
        let buffers = [
            x.buffer(),
            tables.cos.buffer(),
            tables.sin.buffer(),
            seqs.buffer(),
        ];
        Ok(Self {
            op: Bound::new(gpu, params, Family::Rope, OP, &buffers)?,
            batch,
            tokens,
            heads,
            positions: tables.positions,
        })
    }

    /// Configures the op for `batch` rows of `seq` tokens.
    pub fn configure(
        &mut self,
        gpu: &Gpu,
        params: &mut Params,
        (batch, seq): (usize, usize),
    ) -> Result<()> {
        const OP: &str = "rope";
        over(OP, "sequences", batch, self.batch)?;
        over(OP, "tokens", batch * seq, self.tokens)?;
        let h = self.heads;
        let tokens = batch * seq;
        let values = RopeParams {
            tokens: to_u32(OP, "tokens", tokens)?,
            seq: to_u32(OP, "seq", seq)?,
            positions: to_u32(OP, "positions", self.positions)?,
            n_heads: to_u32(OP, "n_heads", h.n_heads)?,
            head_dim: to_u32(OP, "head_dim", h.head_dim)?,
            rot_dim: to_u32(OP, "rot_dim", h.rot_dim)?,
            _pad: [0; 2],
        };
        // One invocation per rotated pair; the values past rot_dim are not touched.
        let dispatch = Dispatch::new(
            gpu,
            (Family::Rope, "rope"),
            WeightType::F32,
            grid_1d(OP, tokens * h.n_heads * h.rot_dim / 2, 256)?,
        );
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// Rotary embedding in place on `x` ([batch * seq][n_heads * head_dim]): row `b`'s token `i`
/// is rotated by position `past + i`, `past` from the sequence table `seqs` (`[batch][2]`,
/// validated on the host against the tables).
pub fn rope(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    io: (&Tensor, RopeTables<'_>, &Tensor),
    (batch, seq): (usize, usize),
    heads: RopeHeads,
) -> Result<()> {
    once(gpu, encoder, "rope", |params| {
        let mut op = Rope::bind(gpu, params, io, (batch, batch * seq), heads)?;
        op.configure(gpu, params, (batch, seq))?;
        Ok(op)
    })
}

/// Element-wise operation, in place on the first operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elementwise {
    /// `a += b` (residual).
    Add,
    /// `a[r][c] += b[c]`.
    BiasAdd,
    /// `a = gelu_tanh(a)`.
    Gelu,
    /// `a = gelu_erf(a)`.
    GeluErf,
    /// `a = silu(a) * b`.
    SwiGlu,
    /// `a = gelu_tanh(a) * b` (Gemma's GeGLU).
    GeGlu,
    /// `a *= s`, `s` set by [`ElementwiseOp::with_scalar`].
    Scale,
    /// `a = s * tanh(a / s)`, `s` set by [`ElementwiseOp::with_scalar`].
    Softcap,
}

impl Elementwise {
    fn entry(self) -> &'static str {
        match self {
            Elementwise::Add => "add",
            Elementwise::BiasAdd => "bias_add",
            Elementwise::Gelu => "gelu",
            Elementwise::GeluErf => "gelu_erf",
            Elementwise::SwiGlu => "swiglu",
            Elementwise::GeGlu => "geglu",
            Elementwise::Scale => "scale",
            Elementwise::Softcap => "softcap",
        }
    }

    /// Elements of `b` the op reads for `rows x cols` elements of `a` (`None`: no `b`).
    fn b_len(self, rows: usize, cols: usize) -> Option<usize> {
        match self {
            Elementwise::Add | Elementwise::SwiGlu | Elementwise::GeGlu => Some(rows * cols),
            Elementwise::BiasAdd => Some(cols),
            Elementwise::Gelu
            | Elementwise::GeluErf
            | Elementwise::Scale
            | Elementwise::Softcap => None,
        }
    }
}

/// The second operand of an element-wise op.
#[derive(Debug, Clone, Copy)]
pub enum Operand<'a> {
    /// The op reads this tensor.
    Tensor(&'a Tensor),
    /// The op takes no second operand; its (never read) binding needs some buffer other than
    /// `a`, which is bound read-write.
    Unused(&'a Tensor),
}

/// A bound element-wise op over up to `rows x cols` elements.
pub struct ElementwiseOp {
    op: Bound,
    kind: Elementwise,
    rows: usize,
    cols: usize,
    /// The scalar of `Scale` and `Softcap` (1 until set).
    scalar: f32,
}
bound_op!(ElementwiseOp);

impl ElementwiseOp {
    /// Binds `kind` on `a` (and `b`) for up to `rows x cols` elements.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        kind: Elementwise,
        (a, b): (&Tensor, Operand<'_>),
        (rows, cols): (usize, usize),
    ) -> Result<Self> {
        const OP: &str = "elementwise";
        need(OP, "a", a, rows * cols, Some(DType::F32))?;
        let b = match (kind.b_len(rows, cols), b) {
            (Some(n), Operand::Tensor(b)) => {
                need(OP, "b", b, n, Some(DType::F32))?;
                b
            }
            (Some(_), Operand::Unused(_)) => {
                return Err(WgparError::Shape {
                    op: OP.into(),
                    detail: format!("{kind:?} needs a second operand"),
                })
            }
            (None, Operand::Tensor(b) | Operand::Unused(b)) => b,
        };
        if std::ptr::eq(a, b) || a.buffer() == b.buffer() {
            return Err(WgparError::Shape {
                op: OP.into(),
                detail: "the second operand must be another buffer than the first".into(),
            });
        }
        Ok(Self {
            op: Bound::new(
                gpu,
                params,
                Family::Elementwise,
                OP,
                &[a.buffer(), b.buffer()],
            )?,
            kind,
            rows,
            cols,
            scalar: 1.0,
        })
    }

    /// The scalar `Scale` multiplies by and `Softcap` caps at (read at configure time).
    pub fn with_scalar(mut self, scalar: f32) -> Self {
        self.scalar = scalar;
        self
    }

    /// Configures the op for `rows` rows.
    pub fn configure(&mut self, gpu: &Gpu, params: &mut Params, rows: usize) -> Result<()> {
        const OP: &str = "elementwise";
        over(OP, "rows", rows, self.rows)?;
        let len = rows * self.cols;
        let values = RowsParams {
            rows: to_u32(OP, "len", len)?,
            cols: to_u32(OP, "cols", self.cols)?,
            _pad: [self.scalar.to_bits(), 0],
        };
        let dispatch = Dispatch::new(
            gpu,
            (Family::Elementwise, self.kind.entry()),
            WeightType::F32,
            grid_1d(OP, len, 256)?,
        );
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// Applies `op` to `a` (`rows x cols` elements), with `b` where the op takes one.
pub fn elementwise(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    op: Elementwise,
    a: &Tensor,
    b: Option<&Tensor>,
    (rows, cols): (usize, usize),
) -> Result<()> {
    // An op without a second operand still binds one: a scratch buffer, never read.
    let scratch;
    let b = match b {
        Some(b) => Operand::Tensor(b),
        None => {
            scratch = gpu.empty("elementwise.unused", DType::F32, 1)?;
            Operand::Unused(&scratch)
        }
    };
    once(gpu, encoder, "elementwise", |params| {
        let mut bound = ElementwiseOp::bind(gpu, params, op, (a, b), (rows, cols))?;
        bound.configure(gpu, params, rows)?;
        Ok(bound)
    })
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct EmbedParams {
    tokens: u32,
    hidden: u32,
    seq: u32,
    positions: u32,
    has_positions: u32,
    has_types: u32,
    first_row: u32,
    rows: u32,
}

/// Token type (segment) embeddings for [`embed_with_types`].
#[derive(Debug, Clone, Copy)]
pub struct TokenTypes<'a> {
    /// `[tokens]` u32 type per token, each < `count` (checked on the host).
    pub ids: &'a Tensor,
    /// `[count][hidden]` f32 table.
    pub table: &'a Tensor,
    /// Number of token types.
    pub count: usize,
}

/// Learned position embeddings (`[positions][hidden]` f32) and the step's sequence table
/// (`[batch][2]` u32, (KV slot, past) per row) that places each row's tokens: row `b`'s token
/// `i` takes position `past + i` (validated on the host against `positions`).
#[derive(Debug, Clone, Copy)]
pub struct Positions<'a> {
    /// The table.
    pub wpe: &'a Tensor,
    /// Rows of the table.
    pub positions: usize,
    /// The sequence table.
    pub seqs: &'a Tensor,
}

/// A token table as an embedding lookup reads it: rows `first_row ..` of the `[vocab][hidden]`
/// table, the whole table or one block of it when the table is split to fit a binding.
#[derive(Debug, Clone, Copy)]
pub enum TokenTable<'a> {
    /// Values in f32 or f16.
    Dense(&'a Tensor),
    /// A GGUF file's blocks as stored, dequantized as they are read.
    Packed(&'a PackedMatrix),
}

/// The inputs of an embedding lookup.
#[derive(Debug, Clone, Copy)]
pub struct Embedding<'a> {
    /// `[tokens]` u32 token ids.
    pub ids: &'a Tensor,
    /// The token table, or one block of its rows. Only tokens whose id falls in the block are
    /// written, so one lookup per block fills every token once.
    pub wte: TokenTable<'a>,
    /// Token id of `wte`'s first row (0 for a whole table).
    pub first_row: usize,
    /// Learned positions, when the model has them.
    pub positions: Option<Positions<'a>>,
    /// Token types, when the model has them (BERT).
    pub types: Option<TokenTypes<'a>>,
}

/// The pipeline an embedding lookup runs: the dense one for the table's element type, or the
/// packed table's variant.
#[derive(Debug, Clone, Copy)]
enum EmbedKernel {
    Dense(WeightType),
    Packed(&'static QuantVariant),
}

/// A bound embedding lookup into `out` (`[tokens][hidden]`).
pub struct Embed {
    op: Bound,
    batch: usize,
    tokens: usize,
    hidden: usize,
    kernel: EmbedKernel,
    positions: Option<usize>,
    types: bool,
    /// Token ids the bound table block covers.
    first_row: usize,
    rows: usize,
}
bound_op!(Embed);

impl Embed {
    /// Binds the lookup of `input` into `out` for up to `batch` rows and `tokens` tokens.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        (input, out): (Embedding<'_>, &Tensor),
        (batch, tokens, hidden): (usize, usize, usize),
    ) -> Result<Self> {
        const OP: &str = "embed";
        let Embedding {
            ids,
            wte,
            first_row,
            positions,
            types,
        } = input;
        need(OP, "ids", ids, tokens, Some(DType::U32))?;
        let (table, rows, kernel) = table_rows(OP, wte, hidden)?;
        need(OP, "out", out, tokens * hidden, Some(DType::F32))?;
        if let Some(p) = &positions {
            if p.positions == 0 {
                return Err(WgparError::Shape {
                    op: OP.into(),
                    detail: "the position table is empty".into(),
                });
            }
            need(OP, "wpe", p.wpe, p.positions * hidden, Some(DType::F32))?;
            need(OP, "seqs", p.seqs, 2 * batch, Some(DType::U32))?;
        }
        if let Some(t) = &types {
            need(OP, "token types", t.ids, tokens, Some(DType::U32))?;
            need(
                OP,
                "token type table",
                t.table,
                t.count * hidden,
                Some(DType::F32),
            )?;
        }
        // Tables a call lacks are read bindings that are never read: bind the ids buffer
        // there rather than `out`, which is bound read-write.
        let (wpe, seqs) = positions.map_or((ids, ids), |p| (p.wpe, p.seqs));
        let (type_ids, type_table) = types.map_or((ids, ids), |t| (t.ids, t.table));
        let buffers = [
            ids.buffer(),
            table.buffer(),
            wpe.buffer(),
            out.buffer(),
            type_ids.buffer(),
            type_table.buffer(),
            seqs.buffer(),
        ];
        let family = match kernel {
            EmbedKernel::Dense(_) => Family::Embedding,
            EmbedKernel::Packed(_) => Family::EmbeddingQuant,
        };
        Ok(Self {
            op: Bound::new(gpu, params, family, OP, &buffers)?,
            batch,
            tokens,
            hidden,
            kernel,
            positions: positions.map(|p| p.positions),
            types: types.is_some(),
            first_row,
            rows,
        })
    }

    /// Configures the op for `batch` rows of `seq` tokens.
    pub fn configure(
        &mut self,
        gpu: &Gpu,
        params: &mut Params,
        (batch, seq): (usize, usize),
    ) -> Result<()> {
        const OP: &str = "embed";
        over(OP, "sequences", batch, self.batch)?;
        over(OP, "tokens", batch * seq, self.tokens)?;
        let tokens = batch * seq;
        let values = EmbedParams {
            tokens: to_u32(OP, "tokens", tokens)?,
            hidden: to_u32(OP, "hidden", self.hidden)?,
            seq: to_u32(OP, "seq", seq)?,
            positions: to_u32(OP, "positions", self.positions.unwrap_or(0))?,
            has_positions: self.positions.is_some() as u32,
            has_types: self.types as u32,
            first_row: to_u32(OP, "first row", self.first_row)?,
            rows: to_u32(OP, "rows", self.rows)?,
        };
        let dispatch = match self.kernel {
            EmbedKernel::Dense(weights) => Dispatch::new(
                gpu,
                (Family::Embedding, "embed"),
                weights,
                grid_1d(OP, tokens * self.hidden, 256)?,
            ),
            // One invocation per 16 values (`QE_WG` = 64 per workgroup).
            EmbedKernel::Packed(v) => Dispatch::of_kernel(
                v.kernel(gpu),
                grid_1d(OP, tokens * self.hidden / 16, 64)?,
                v.name,
            ),
        };
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// The table's buffer, its rows, and the pipeline that reads it; refuses a table that is not
/// whole rows of `hidden` values.
fn table_rows<'a>(
    op: &str,
    wte: TokenTable<'a>,
    hidden: usize,
) -> Result<(&'a Tensor, usize, EmbedKernel)> {
    let bad = |detail: String| WgparError::Shape {
        op: op.into(),
        detail,
    };
    match wte {
        TokenTable::Dense(t) => {
            if hidden == 0 || t.is_empty() || t.len() % hidden != 0 {
                return Err(bad(format!(
                    "a token table of {} values is not whole rows of {hidden}",
                    t.len()
                )));
            }
            Ok((t, t.len() / hidden, EmbedKernel::Dense(weight_type(t))))
        }
        TokenTable::Packed(m) => {
            let variant = embed_variant(m.qtype)
                .ok_or_else(|| bad(format!("no lookup reads {:?} blocks", m.qtype)))?;
            if m.cols != hidden || m.rows == 0 {
                return Err(bad(format!(
                    "a packed token table of {} rows of {} values, for rows of {hidden}",
                    m.rows, m.cols
                )));
            }
            Ok((&m.tensor, m.rows, EmbedKernel::Packed(variant)))
        }
    }
}

/// `out[t] = wte[ids[t]] (+ wpe[past + i])` for token `t = b * seq + i`. Token ids must be
/// < vocab (the caller checks them on the host, where the error can name the bad id).
pub fn embed(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    (ids, wte, positions): (&Tensor, &Tensor, Option<Positions<'_>>),
    out: &Tensor,
    (batch, seq, hidden): (usize, usize, usize),
) -> Result<()> {
    let input = Embedding {
        ids,
        wte: TokenTable::Dense(wte),
        first_row: 0,
        positions,
        types: None,
    };
    embed_with_types(gpu, encoder, input, out, (batch, seq, hidden))
}

/// [`embed`] plus, when `types` is given, `wtt[types[t]]` (BERT's segment embeddings).
pub fn embed_with_types(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    input: Embedding<'_>,
    out: &Tensor,
    (batch, seq, hidden): (usize, usize, usize),
) -> Result<()> {
    once(gpu, encoder, "embed", |params| {
        let mut op = Embed::bind(gpu, params, (input, out), (batch, batch * seq, hidden))?;
        op.configure(gpu, params, (batch, seq))?;
        Ok(op)
    })
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct PoolParams {
    batch: u32,
    seq: u32,
    hidden: u32,
    mode: u32,
    normalize: u32,
    _pad: [u32; 3],
}

/// How an encoder pools its token states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pooling {
    /// The first token's state instead of the mean over real tokens.
    pub first_token: bool,
    /// Scale the result to unit L2 norm.
    pub normalize: bool,
}

/// A bound encoder pooling of `x` (`[batch * seq][hidden]`) into `out` (`[batch][hidden]`).
pub struct Pool {
    op: Bound,
    batch: usize,
    tokens: usize,
    hidden: usize,
    how: Pooling,
}
bound_op!(Pool);

impl Pool {
    /// Binds pooling for up to `batch` sequences and `tokens` tokens.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        (x, lens, out): (&Tensor, &Tensor, &Tensor),
        (batch, tokens, hidden): (usize, usize, usize),
        how: Pooling,
    ) -> Result<Self> {
        const OP: &str = "pool";
        need(OP, "x", x, tokens * hidden, Some(DType::F32))?;
        need(OP, "lens", lens, batch, Some(DType::U32))?;
        need(OP, "out", out, batch * hidden, Some(DType::F32))?;
        let buffers = [x.buffer(), lens.buffer(), out.buffer()];
        Ok(Self {
            op: Bound::new(gpu, params, Family::Pool, OP, &buffers)?,
            batch,
            tokens,
            hidden,
            how,
        })
    }

    /// Configures the op for `batch` sequences of `seq` tokens.
    pub fn configure(
        &mut self,
        gpu: &Gpu,
        params: &mut Params,
        (batch, seq): (usize, usize),
    ) -> Result<()> {
        const OP: &str = "pool";
        over(OP, "sequences", batch, self.batch)?;
        over(OP, "tokens", batch * seq, self.tokens)?;
        let values = PoolParams {
            batch: to_u32(OP, "batch", batch)?,
            seq: to_u32(OP, "seq", seq)?,
            hidden: to_u32(OP, "hidden", self.hidden)?,
            mode: self.how.first_token as u32,
            normalize: self.how.normalize as u32,
            _pad: [0; 3],
        };
        let dispatch = Dispatch::new(
            gpu,
            (Family::Pool, "pool"),
            WeightType::F32,
            rows_grid(OP, batch)?,
        );
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// Encoder pooling: `out[b] = mean(x[b * seq .. b * seq + lens[b]])` (or `x[b * seq]` with
/// `first_token`), scaled to unit L2 norm when `normalize`. `lens` values must lie in
/// `1..=seq` (the caller checks them on the host).
pub fn pool(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    io: (&Tensor, &Tensor, &Tensor),
    (batch, seq, hidden): (usize, usize, usize),
    how: Pooling,
) -> Result<()> {
    once(gpu, encoder, "pool", |params| {
        let mut op = Pool::bind(gpu, params, io, (batch, batch * seq, hidden), how)?;
        op.configure(gpu, params, (batch, seq))?;
        Ok(op)
    })
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct PickParams {
    batch: u32,
    vocab: u32,
    top_k: u32,
    temperature: f32,
    top_p: f32,
    allow_words: u32,
    adjusted: u32,
    _pad: u32,
}

/// How the device picks each row's token from its logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TokenPick {
    /// The largest logit (lowest id among equal ones).
    Greedy,
    /// A draw among the `top_k` most likely tokens (1 ..= [`MAX_TOP_K`]) after dividing the
    /// logits by `temperature` (> 0), cut to the nucleus whose mass first reaches `top_p`
    /// (0 < top_p <= 1), as `model::sampling::Sampler` does on the host. The draws are the
    /// caller's uniform random numbers, one per row.
    Sample {
        /// Candidates kept.
        top_k: usize,
        /// Softmax temperature.
        temperature: f32,
        /// Nucleus mass.
        top_p: f32,
    },
}

/// What a pick reads besides the logits: whether each row keeps to its `allow` bit set, and
/// whether the rows' logit adjustments ([`pack_adjustments`]) apply first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickSetup {
    /// How to pick.
    pub how: TokenPick,
    /// Only tokens whose bit is set in the row's `allow` words may be picked.
    pub masked: bool,
    /// The logits are changed by the `adjust` buffer's entries before the pick.
    pub adjusted: bool,
}

impl PickSetup {
    /// `how`, over the logits as they are.
    pub fn plain(how: TokenPick) -> Self {
        Self {
            how,
            masked: false,
            adjusted: false,
        }
    }
}

/// A pick's buffers: `logits` (`[batch][vocab]`), `draws` (`[batch]` f32 in [0, 1)),
/// `allow` (`[batch][allow_words(vocab)]` u32 bit sets), `adjust` ([`adjust_words`]`(batch)`
/// u32, [`pack_adjustments`]) in; `out` (`[2][batch]` u32: the tokens, then each row's count
/// of non-finite logits) out.
#[derive(Debug, Clone, Copy)]
pub struct PickIo<'a> {
    /// Each row's logits.
    pub logits: &'a Tensor,
    /// Each row's uniform draw (sampling).
    pub draws: &'a Tensor,
    /// Each row's bit set of pickable tokens.
    pub allow: &'a Tensor,
    /// The rows' packed logit adjustments.
    pub adjust: &'a Tensor,
    /// Tokens, then non-finite counts.
    pub out: &'a Tensor,
}

/// A bound token pick over [`PickIo`].
pub struct Pick {
    op: Bound,
    batch: usize,
    vocab: usize,
}
bound_op!(Pick);

impl Pick {
    /// Binds a pick over up to `batch` rows of `vocab` logits.
    pub fn bind(
        gpu: &Gpu,
        params: &mut Params,
        io: PickIo<'_>,
        (batch, vocab): (usize, usize),
    ) -> Result<Self> {
        const OP: &str = "pick";
        need(OP, "logits", io.logits, batch * vocab, Some(DType::F32))?;
        need(OP, "draws", io.draws, batch, Some(DType::F32))?;
        let words = batch * allow_words(vocab);
        need(OP, "allow", io.allow, words, Some(DType::U32))?;
        need(
            OP,
            "adjust",
            io.adjust,
            adjust_words(batch),
            Some(DType::U32),
        )?;
        need(OP, "out", io.out, 2 * batch, Some(DType::U32))?;
        let buffers = [
            io.logits.buffer(),
            io.draws.buffer(),
            io.out.buffer(),
            io.allow.buffer(),
            io.adjust.buffer(),
        ];
        Ok(Self {
            op: Bound::new(gpu, params, Family::Argmax, OP, &buffers)?,
            batch,
            vocab,
        })
    }

    /// Configures the op for `batch` rows picked as `setup` says.
    pub fn configure(
        &mut self,
        gpu: &Gpu,
        params: &mut Params,
        batch: usize,
        setup: PickSetup,
    ) -> Result<()> {
        const OP: &str = "pick";
        over(OP, "rows", batch, self.batch)?;
        let (entry, top_k, temperature, top_p) = match setup.how {
            TokenPick::Greedy => ("argmax", 1, 1.0, 1.0),
            TokenPick::Sample {
                top_k,
                temperature,
                top_p,
            } => {
                let valid = (1..=MAX_TOP_K).contains(&top_k)
                    && temperature > 0.0
                    && temperature.is_finite()
                    && top_p > 0.0
                    && top_p <= 1.0;
                if !valid {
                    return Err(WgparError::SamplingRange {
                        top_k,
                        max_top_k: MAX_TOP_K,
                        temperature,
                        top_p,
                    });
                }
                ("sample", top_k, temperature, top_p)
            }
        };
        let values = PickParams {
            batch: to_u32(OP, "batch", batch)?,
            vocab: to_u32(OP, "vocab", self.vocab)?,
            top_k: top_k as u32,
            temperature,
            top_p,
            allow_words: if setup.masked {
                to_u32(OP, "allow words", allow_words(self.vocab))?
            } else {
                0
            },
            adjusted: setup.adjusted as u32,
            _pad: 0,
        };
        let dispatch = Dispatch::new(
            gpu,
            (Family::Argmax, entry),
            WeightType::F32,
            rows_grid(OP, batch)?,
        );
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// Most logit adjustments one row of a device pick takes ([`adjust_words`] sizes the buffer
/// for this many per row); a request that needs more is picked on the host.
pub const MAX_ADJUST_PER_ROW: usize = 2048;

/// One change to one token's logit of one row before the device pick, in the host
/// sampler's order: `x + add`, then divided by `repetition` where positive and multiplied
/// by it where not (1: unchanged), then minus `sub` (+inf bans the token).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitAdjust {
    /// The row (`0..batch` of the step).
    pub row: u32,
    /// The token.
    pub token: u32,
    /// Added first (logit bias).
    pub add: f32,
    /// Repetition penalty factor (1: none).
    pub repetition: f32,
    /// Subtracted last (presence and frequency penalties; +inf bans).
    pub sub: f32,
}

/// Words of the `adjust` buffer of a pick over `batch` rows: a header of `batch + 2` words
/// and up to [`MAX_ADJUST_PER_ROW`] entries of 4 words per row.
pub fn adjust_words(batch: usize) -> usize {
    batch + 2 + 4 * batch * MAX_ADJUST_PER_ROW
}

/// Packs `entries` over `rows` rows into the `adjust` buffer's layout (see
/// `shaders/argmax.wgsl`): a row count, each row's first entry and the end, then the
/// entries by row and token. Refuses a row out of range, a token twice in a row, a token
/// outside `vocab` and more than [`MAX_ADJUST_PER_ROW`] entries in a row.
pub fn pack_adjustments(rows: usize, vocab: usize, entries: &[LogitAdjust]) -> Result<Vec<u32>> {
    let mut sorted = entries.to_vec();
    sorted.sort_by_key(|e| (e.row, e.token));
    let mut per_row = vec![0usize; rows];
    for (i, e) in sorted.iter().enumerate() {
        if e.row as usize >= rows {
            return Err(WgparError::OutOfRange {
                what: "logit adjustment row".into(),
                index: e.row as usize,
                count: rows,
            });
        }
        if e.token as usize >= vocab {
            return Err(WgparError::TokenRange {
                sequence: e.row as usize,
                what: "token id",
                value: e.token,
                range: "vocabulary",
                limit: vocab,
            });
        }
        if i > 0 && (sorted[i - 1].row, sorted[i - 1].token) == (e.row, e.token) {
            // No variant names a duplicate; the server's adjustments come from one map per
            // row, so only a library caller reaches this.
            return Err(WgparError::InvalidCall(format!(
                "logit adjustments: row {} adjusts token {} twice",
                e.row, e.token
            )));
        }
        per_row[e.row as usize] += 1;
    }
    if let Some(r) = per_row.iter().position(|&n| n > MAX_ADJUST_PER_ROW) {
        return Err(WgparError::LengthMismatch {
            what: format!("logit adjustments of row {r} (at most)"),
            got: per_row[r],
            expected: MAX_ADJUST_PER_ROW,
        });
    }
    let mut words = Vec::with_capacity(rows + 2 + 4 * sorted.len());
    words.push(to_u32("pick", "adjusted rows", rows)?);
    let mut offset = 0u32;
    words.push(0);
    for n in per_row {
        offset += n as u32;
        words.push(offset);
    }
    for e in sorted {
        words.extend([
            e.token,
            e.add.to_bits(),
            e.repetition.to_bits(),
            e.sub.to_bits(),
        ]);
    }
    Ok(words)
}

/// Words of a row's `allow` bit set over `vocab` tokens.
pub fn allow_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Picks each row's token of `io.logits` on the device into `io.out` (`[2][batch]` u32:
/// tokens, then per-row counts of non-finite logits), as `setup` says.
pub fn pick(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    io: PickIo<'_>,
    (batch, vocab): (usize, usize),
    setup: PickSetup,
) -> Result<()> {
    once(gpu, encoder, "pick", |params| {
        let mut op = Pick::bind(gpu, params, io, (batch, vocab))?;
        op.configure(gpu, params, batch, setup)?;
        Ok(op)
    })
}
