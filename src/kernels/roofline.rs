//! The kernel benchmark's roofline: the adapter's attainable bandwidth, measured in the same run
//! by a vec4 buffer copy (`shaders/copy.wgsl`), and every packed-weight matmul variant
//! ([`QUANT_VARIANTS`]) timed at the benchmark's shapes. Each matmul row (packed or dense) gets
//! its effective weight bandwidth, the bytes of the weights as stored (a GGUF file's blocks for
//! the packed types) read per second, and that figure's ratio to the copy's.

use std::cell::Cell;

use super::bench::{KernelBenchOptions, KernelBenchRow};
use super::ops::{grid_1d, to_u32, Bound, Dispatch, Params, Pass};
use super::quant::QUANT_VARIANTS;
use super::quant::{PackedMatrix, QuantIo, QuantMatmul, QuantVariant, GEMV_MAX_ROWS};
use super::tune::{self, Effort};
use super::{Family, WeightType};
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::model::quant::QuantType;

/// The copy kernel's name in the benchmark's rows.
pub const COPY_KERNEL: &str = "copy_vec4";

/// Bytes the copy moves when the options name none: large enough to leave every cache of a
/// current GPU (an H200's L2 is 50 MB), capped at the adapter's storage-binding limit.
pub const DEFAULT_COPY_BYTES: u64 = 512 << 20;

/// Smallest copy the benchmark accepts: below this the copy measures caches and launch cost.
pub const MIN_COPY_BYTES: u64 = 1 << 20;

/// Largest copy the benchmark accepts (the host builds the source buffer).
pub const MAX_COPY_BYTES: u64 = 8 << 30;

/// Bytes of packed weights the timed dispatches rotate through (see [`weight_buffers`]).
pub const WEIGHT_WORKING_SET: u64 = 256 << 20;

/// Most copies of a packed matrix the benchmark uploads to reach [`WEIGHT_WORKING_SET`].
pub const MAX_WEIGHT_BUFFERS: usize = 32;

/// The packed types that have matmul variants, in [`QUANT_VARIANTS`]' order.
pub fn packed_types() -> Vec<QuantType> {
    let mut types: Vec<QuantType> = Vec::new();
    for v in QUANT_VARIANTS {
        if !types.contains(&v.qtype) {
            types.push(v.qtype);
        }
    }
    types
}

/// The variants of `qtype` that apply to `m` rows and that `only` names (all when empty).
pub fn packed_variants(qtype: QuantType, m: usize, only: &[String]) -> Vec<&'static QuantVariant> {
    applying(QUANT_VARIANTS.iter(), qtype, m, only)
}

/// [`packed_variants`] and, where `gpu` offers the packed integer dot product, the
/// integer-dot GEMVs of `qtype` (both roundings, [`super::quant_dp4::candidates`]): every
/// packed kernel the adapter can run, so each has its roofline row.
pub fn bench_variants(
    gpu: &Gpu,
    qtype: QuantType,
    m: usize,
    only: &[String],
) -> Vec<&'static QuantVariant> {
    let mut all = packed_variants(qtype, m, only);
    let dp4 = super::quant_dp4::candidates(gpu, qtype);
    all.extend(applying(dp4.into_iter(), qtype, m, only));
    all
}

fn applying<'a>(
    variants: impl Iterator<Item = &'a QuantVariant>,
    qtype: QuantType,
    m: usize,
    only: &[String],
) -> Vec<&'a QuantVariant> {
    variants
        .filter(|v| v.qtype == qtype && (!v.is_gemv() || m <= GEMV_MAX_ROWS))
        .filter(|v| only.is_empty() || only.iter().any(|o| o == v.name))
        .collect()
}

/// The bound copy (its one bind group).
struct CopyOp(Bound);

impl AsRef<Bound> for CopyOp {
    fn as_ref(&self) -> &Bound {
        &self.0
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CopyParams {
    len: u32,
    _pad: [u32; 3],
}

/// Times the vec4 copy of `bytes` (capped at the adapter's binding limit when `requested` is
/// `None`; a requested size over it is refused): one row, `gbps` = bytes read + written over
/// the median time.
pub fn measure_copy(
    gpu: &Gpu,
    opts: &KernelBenchOptions,
    requested: Option<u64>,
) -> Result<KernelBenchRow> {
    let limit = gpu
        .info()
        .max_storage_binding
        .min(gpu.info().max_buffer_size);
    let bytes = match requested {
        Some(b) => {
            gpu.check_size("--copy-size: the copy kernel's buffer", b)
                .map_err(|e| WgparError::option("--copy-size", e.to_string()))?;
            b
        }
        None => DEFAULT_COPY_BYTES.min(limit),
    } / 16
        * 16;
    let len = (bytes / 4) as usize;
    let data = tune::pattern(len, 9);
    let src = gpu.upload_f32("copy.src", &data)?;
    let dst = gpu.empty("copy.dst", DType::F32, len)?;
    gpu.poison(&dst);
    let seconds = time_copy(gpu, opts, (&src, &dst), len / 4)?;
    // A rate is only worth the copy it timed: the destination must hold the source.
    if let Some(i) = (gpu.read_f32(&dst)?.iter().zip(&data)).position(|(a, b)| a != b) {
        return Err(WgparError::Measurement(format!(
            "the copy kernel did not copy: element {i} of {len} differs"
        )));
    }
    let mut row = super::bench::row(COPY_KERNEL, format!("{} MiB", bytes >> 20), "f32", seconds);
    row.gbps = Some(2.0 * bytes as f64 / seconds / 1e9);
    Ok(row)
}

/// Median seconds of one copy of `vec4s` vec4s from `src` to `dst`, bound once.
fn time_copy(
    gpu: &Gpu,
    opts: &KernelBenchOptions,
    (src, dst): (&Tensor, &Tensor),
    vec4s: usize,
) -> Result<f64> {
    const OP: &str = "copy";
    let mut params = Params::new(gpu, OP, 1)?;
    let buffers = [src.buffer(), dst.buffer()];
    let mut op = CopyOp(Bound::new(gpu, &mut params, Family::Copy, OP, &buffers)?);
    let values = CopyParams {
        len: to_u32(OP, "len", vec4s)?,
        _pad: [0; 3],
    };
    let kernel = gpu
        .kernels()
        .get(gpu.device(), Family::Copy, COPY_KERNEL, WeightType::F32);
    let dispatch = Dispatch::of_kernel(kernel, grid_1d(OP, vec4s, 256)?, COPY_KERNEL);
    op.0.set(&mut params, &values, dispatch);
    params.flush(gpu);
    let next = Cell::new(0);
    let run = |reps: usize| run_reps(gpu, (std::slice::from_ref(&op), &next), reps);
    tune::time_samples(&run, bench_effort(opts), f64::INFINITY)
}

fn bench_effort(opts: &KernelBenchOptions) -> Effort {
    Effort::Bench {
        samples: opts.iters,
    }
}

/// Seconds per dispatch of `reps` dispatches in one pass, submitted and waited for: the ops
/// in turn, from `next` on (kept across calls, so each sample carries on the rotation).
fn run_reps<O: AsRef<Bound>>(
    gpu: &Gpu,
    (ops, next): (&[O], &Cell<usize>),
    reps: usize,
) -> Result<f64> {
    let mut enc = gpu.encoder();
    {
        let mut pass = Pass::new(&mut enc);
        for _ in 0..reps {
            pass.run(&ops[next.get() % ops.len()])?;
            next.set(next.get() + 1);
        }
    }
    let start = std::time::Instant::now();
    gpu.submit(enc);
    gpu.wait()?;
    Ok(start.elapsed().as_secs_f64() / reps as f64)
}

/// Packed weights the dispatches rotate through: copies of the matrix until their bytes pass
/// [`WEIGHT_WORKING_SET`] (at most [`MAX_WEIGHT_BUFFERS`]), so each dispatch reads its weights
/// from memory as a model's layers do, not from a cache the previous dispatch filled (an
/// H200's L2 holds 50 MB, a Llama-8B Q4_0 4096 x 4096 matrix 9.4 MB).
fn weight_buffers(w_bytes: u64) -> usize {
    WEIGHT_WORKING_SET
        .div_ceil(w_bytes.max(1))
        .clamp(1, MAX_WEIGHT_BUFFERS as u64) as usize
}

/// Deterministic packed blocks of any type: pseudo-random bytes with bit 14 of every
/// little-endian u16 cleared. Every block type's f16 scales sit at even offsets of blocks of
/// even size, so each is finite and below 2 in magnitude (no NaN or infinity to slow a
/// driver's float path), while the quants stay varied.
fn packed_bytes(qtype: QuantType, (rows, cols): (usize, usize)) -> Result<Vec<u8>> {
    let row = qtype.row_bytes(cols).ok_or_else(|| WgparError::Shape {
        op: "bench".into(),
        detail: format!("{cols} columns are not whole {} blocks", qtype.name()),
    })?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut bytes = Vec::with_capacity(row * rows);
    while bytes.len() < row * rows {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let word = (state >> 16) & 0xbfff_bfff_bfff;
        bytes.extend_from_slice(&word.to_le_bytes()[..6]);
    }
    bytes.truncate(row * rows);
    Ok(bytes)
}

/// Every packed variant of `qtype` that applies to `(m, n, k)`, timed on the same operands: one
/// row each, with its weight bandwidth filled in ([`fill_weight_bytes`]); the fastest is the
/// winner.
pub fn bench_packed(
    gpu: &Gpu,
    opts: &KernelBenchOptions,
    (m, n, k): (usize, usize, usize),
    qtype: QuantType,
) -> Result<Vec<KernelBenchRow>> {
    let shape = format!("{m}x{n}x{k}");
    let w_bytes = check_packed_fits(gpu, (m, n, k), qtype)?;
    let x = gpu.upload_f32("bench.qx", &tune::pattern(m * k, 1))?;
    let bytes = packed_bytes(qtype, (n, k))?;
    let mut ws = Vec::new();
    for _ in 0..weight_buffers(w_bytes) {
        ws.push(PackedMatrix::upload(
            gpu,
            "bench.qw",
            qtype,
            &bytes,
            (n, k),
        )?);
    }
    let y = gpu.empty("bench.qy", DType::F32, m * n)?;
    let mut rows = Vec::new();
    for v in bench_variants(gpu, qtype, m, &opts.only) {
        let mut params = Params::new(gpu, "bench.quant", ws.len())?;
        let mut ops = Vec::new();
        for w in &ws {
            let io = QuantIo {
                x: &x,
                w,
                bias: None,
                y: &y,
            };
            let mut op = QuantMatmul::bind(gpu, &mut params, io, m)?.with_variant(v.name)?;
            op.configure(gpu, &mut params, m)?;
            ops.push(op);
        }
        params.flush(gpu);
        let next = Cell::new(0);
        let run = |reps: usize| run_reps(gpu, (&ops, &next), reps);
        let s = tune::time_samples(&run, bench_effort(opts), f64::INFINITY)?;
        let mut r = super::bench::row(v.name, shape.clone(), qtype.name(), s);
        r.gflops = Some(2.0 * m as f64 * n as f64 * k as f64 / s / 1e9);
        fill_weight_bytes(&mut r, w_bytes, (m * k + m * n) as u64 * 4);
        r.weight_buffers = Some(ws.len());
        rows.push(r);
    }
    let best = rows
        .iter()
        .map(|r| r.median_ms)
        .fold(f64::INFINITY, f64::min);
    for r in &mut rows {
        r.winner = r.median_ms == best;
    }
    Ok(rows)
}

/// A packed shape's operands must each fit one binding on `gpu` (refused naming the shape and
/// the limit otherwise); the weights' bytes.
fn check_packed_fits(gpu: &Gpu, (m, n, k): (usize, usize, usize), qtype: QuantType) -> Result<u64> {
    // In u128: shapes come from the command line and their products can overflow u64.
    let bytes = |a: usize, b: usize, size: usize| {
        u64::try_from(a as u128 * b as u128 * size as u128).unwrap_or(u64::MAX)
    };
    let w = qtype.row_bytes(k).map_or(u64::MAX, |row| bytes(n, row, 1));
    for (name, b) in [("x", bytes(m, k, 4)), ("w", w), ("y", bytes(m, n, 4))] {
        let what = format!("shape {m}x{n}x{k} ({}): {name}", qtype.name());
        gpu.check_size(&what, b)
            .map_err(|e| WgparError::option("--shapes", e.to_string()))?;
    }
    Ok(w)
}

/// Sets a matmul row's traffic: `weights` bytes as stored, `xy` bytes of activations read and
/// outputs written; `gbps` is their sum over the time, `weight_gbps` the weights' alone.
pub fn fill_weight_bytes(row: &mut KernelBenchRow, weights: u64, xy: u64) {
    let s = row.median_ms / 1e3;
    row.weight_bytes = Some(weights);
    row.xy_bytes = Some(xy);
    row.gbps = Some((weights + xy) as f64 / s / 1e9);
    row.weight_gbps = Some(weights as f64 / s / 1e9);
}

/// Each row with a weight bandwidth gets its ratio to the copy's `copy_gbps` (left `None`,
/// printed n/a, when no copy was measured).
pub fn apply_copy_ratio(rows: &mut [KernelBenchRow], copy_gbps: Option<f64>) {
    for r in rows {
        r.of_copy = match (r.weight_gbps, copy_gbps) {
            (Some(w), Some(c)) if c > 0.0 => Some(w / c),
            _ => None,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The benchmark's blocks dequantize to finite values for every packed type: no scale is a
    /// NaN or an infinity.
    #[test]
    fn packed_bytes_have_finite_scales() {
        let types = packed_types();
        assert!(types.len() >= 5, "{types:?}");
        for t in types {
            let bytes = packed_bytes(t, (3, 512)).unwrap();
            assert_eq!(bytes.len(), 3 * t.row_bytes(512).unwrap());
            let values = crate::model::quant::dequantize(t, &bytes);
            assert_eq!(values.len(), 3 * 512, "{t:?}");
            assert!(values.iter().all(|v| v.is_finite()), "{t:?}");
            assert!(values.iter().any(|v| *v != 0.0), "{t:?}");
        }
    }

    #[test]
    fn gemv_variants_apply_to_decode_rows_only() {
        let decode = packed_variants(QuantType::Q8_0, 1, &[]);
        let prefill = packed_variants(QuantType::Q8_0, GEMV_MAX_ROWS + 1, &[]);
        assert!(decode.iter().any(|v| v.is_gemv()));
        assert!(!prefill.is_empty() && prefill.iter().all(|v| !v.is_gemv()));
        let named = packed_variants(QuantType::Q8_0, 1, &[prefill[0].name.to_string()]);
        assert_eq!(named.len(), 1);
    }
}
