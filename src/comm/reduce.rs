//! Host-side kernels of the collectives: element-wise sums (accumulated in f32) and plain
//! copies, from mapped download buffers into mapped upload buffers.
//!
//! They work in L1-sized blocks: a block of the sum is built once and then written to every
//! destination, so each input byte is read once and each output byte written once. Inputs are
//! summed in rank order, so every algorithm and chunking gives bit-identical results (and the
//! CPU reference in the tests does the same).

use half::f16;
use half::slice::HalfFloatSliceExt;
use wgpu::WriteOnly;

use crate::device::DType;

/// Elements per block: 4 KiB of f32 accumulators.
const BLOCK: usize = 1024;

/// Writes `count` sums `inputs[0][j] + inputs[1][j] + ...` (elements of `dtype`, starting at byte
/// 0 of every input) to the start of every output.
pub(crate) fn sum_into(
    dtype: DType,
    count: usize,
    inputs: &[&[u8]],
    outputs: &mut [WriteOnly<'_, [u8]>],
) {
    let size = dtype.size();
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    let mut halves = [f16::ZERO; BLOCK];
    let mut start = 0;
    while start < count {
        let len = BLOCK.min(count - start);
        let bytes = start * size..(start + len) * size;
        let acc = &mut acc[..len];
        match dtype {
            DType::F16 => {
                for (i, input) in inputs.iter().enumerate() {
                    let src = &input[bytes.clone()];
                    if i == 0 {
                        widen(src, acc);
                    } else {
                        widen_add(src, acc, &mut tmp[..len]);
                    }
                }
            }
            _ => {
                let ins: Vec<&[u8]> = inputs.iter().map(|i| &i[bytes.clone()]).collect();
                sum_f32_block(&ins, acc, &mut tmp[..len]);
            }
        }
        let out: &[u8] = match dtype {
            DType::F16 => {
                let h = &mut halves[..len];
                narrow(acc, h);
                bytemuck::cast_slice(h)
            }
            _ => bytemuck::cast_slice(acc),
        };
        for o in outputs.iter_mut() {
            o.slice(bytes.clone()).copy_from_slice(out);
        }
        start += len;
    }
}

/// `acc[j] = ((in0[j] + in1[j]) + in2[j]) + ...` for one block of f32 inputs, in one pass for
/// up to four inputs (a pass per input would write the accumulators back every time).
fn sum_f32_block(inputs: &[&[u8]], acc: &mut [f32], tmp: &mut [f32]) {
    let mut f: [&[f32]; 4] = [&[]; 4];
    let aligned = inputs.len() <= 4
        && inputs.iter().zip(f.iter_mut()).all(|(i, slot)| {
            bytemuck::try_cast_slice::<u8, f32>(i)
                .map(|s| *slot = s)
                .is_ok()
        });
    if aligned {
        // Zipped iterators carry the lengths, so the loops vectorize without bounds checks.
        let len = acc.len();
        let [a0, a1, a2, a3] = f.map(|x| &x[..len.min(x.len())]);
        match inputs.len() {
            0 => acc.fill(0.0),
            1 => acc.copy_from_slice(a0),
            2 => {
                for ((a, x0), x1) in acc.iter_mut().zip(a0).zip(a1) {
                    *a = x0 + x1;
                }
            }
            3 => {
                for (((a, x0), x1), x2) in acc.iter_mut().zip(a0).zip(a1).zip(a2) {
                    *a = x0 + x1 + x2;
                }
            }
            _ => {
                for ((((a, x0), x1), x2), x3) in acc.iter_mut().zip(a0).zip(a1).zip(a2).zip(a3) {
                    *a = x0 + x1 + x2 + x3;
                }
            }
        }
        return;
    }
    // Many inputs (or unaligned bytes): one input at a time, same order.
    for (i, input) in inputs.iter().enumerate() {
        if i == 0 {
            load(DType::F32, input, acc);
        } else {
            load(DType::F32, input, tmp);
            for (a, t) in acc.iter_mut().zip(tmp.iter()) {
                *a += *t;
            }
        }
    }
}

/// f16 bytes -> f32, 8 at a time with F16C where the CPU has it (the f16 sum is bound by these
/// conversions: `half`'s portable path is about 8x slower than copying the same bytes).
fn widen(src: &[u8], dst: &mut [f32]) {
    match bytemuck::try_cast_slice::<u8, u16>(src) {
        #[cfg(target_arch = "x86_64")]
        Ok(bits) if f16c::available() => f16c::widen(bits, dst),
        _ => load(DType::F16, src, dst),
    }
}

/// `acc[j] += f16 element j of src`, without a round trip through scratch where F16C exists.
fn widen_add(src: &[u8], acc: &mut [f32], tmp: &mut [f32]) {
    match bytemuck::try_cast_slice::<u8, u16>(src) {
        #[cfg(target_arch = "x86_64")]
        Ok(bits) if f16c::available() => f16c::widen_add(bits, acc),
        _ => {
            load(DType::F16, src, tmp);
            for (a, t) in acc.iter_mut().zip(tmp.iter()) {
                *a += *t;
            }
        }
    }
}

/// f32 -> f16, rounding to nearest even (as `half` and the CPU reference do).
fn narrow(src: &[f32], dst: &mut [f16]) {
    #[cfg(target_arch = "x86_64")]
    if f16c::available() {
        f16c::narrow(src, bytemuck::cast_slice_mut(dst));
        return;
    }
    dst.convert_from_f32_slice(src);
}

/// 8-wide f16 <-> f32 conversions with the F16C instructions, chosen at run time.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{
        __m128i, _mm256_add_ps, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps,
        _mm256_storeu_ps, _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };
    use std::sync::OnceLock;

    use half::f16;

    /// Whether this CPU has AVX and F16C (checked once).
    pub(super) fn available() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx")
                && std::arch::is_x86_feature_detected!("f16c")
        })
    }

    /// Widens `min(src.len(), dst.len())` halves. Call only when [`available`].
    pub(super) fn widen(src: &[u16], dst: &mut [f32]) {
        if available() {
            // SAFETY: the CPU supports the features the function is compiled for.
            unsafe { widen_f16c(src, dst) }
        }
    }

    /// Adds `min(src.len(), acc.len())` widened halves into `acc`. Call only when
    /// [`available`].
    pub(super) fn widen_add(src: &[u16], acc: &mut [f32]) {
        if available() {
            // SAFETY: as above.
            unsafe { widen_add_f16c(src, acc) }
        }
    }

    /// Narrows `min(src.len(), dst.len())` floats. Call only when [`available`].
    pub(super) fn narrow(src: &[f32], dst: &mut [u16]) {
        if available() {
            // SAFETY: as above.
            unsafe { narrow_f16c(src, dst) }
        }
    }

    #[target_feature(enable = "avx,f16c")]
    unsafe fn widen_f16c(src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let whole = n / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= n, within both slices; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        for i in whole..n {
            dst[i] = f16::from_bits(src[i]).to_f32();
        }
    }

    #[target_feature(enable = "avx,f16c")]
    unsafe fn widen_add_f16c(src: &[u16], acc: &mut [f32]) {
        let n = src.len().min(acc.len());
        let whole = n / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= n, within both slices; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                let a = _mm256_loadu_ps(acc.as_ptr().add(i));
                _mm256_storeu_ps(
                    acc.as_mut_ptr().add(i),
                    _mm256_add_ps(a, _mm256_cvtph_ps(h)),
                );
            }
        }
        for i in whole..n {
            acc[i] += f16::from_bits(src[i]).to_f32();
        }
    }

    #[target_feature(enable = "avx,f16c")]
    unsafe fn narrow_f16c(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let whole = n / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= n, within both slices; unaligned loads and stores.
            unsafe {
                let f = _mm256_loadu_ps(src.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast::<__m128i>(), h);
            }
        }
        for i in whole..n {
            dst[i] = f16::from_f32(src[i]).to_bits();
        }
    }
}

/// Decodes `dst.len()` elements of `dtype` from `src` into f32.
fn load(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F16 => match bytemuck::try_cast_slice::<u8, f16>(src) {
            Ok(h) => h.convert_to_f32_slice(dst),
            Err(_) => {
                for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        },
        _ => match bytemuck::try_cast_slice::<u8, f32>(src) {
            Ok(f) => dst.copy_from_slice(f),
            Err(_) => {
                for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        },
    }
}

/// Writes `src` at byte `offset` of every output.
pub(crate) fn copy_into(src: &[u8], offset: usize, outputs: &mut [WriteOnly<'_, [u8]>]) {
    for o in outputs.iter_mut() {
        o.slice(offset..offset + src.len()).copy_from_slice(src);
    }
}

/// CPU reference of the sum, in the same order and precision as the host reduction: what tests and the
/// benchmark compare against.
pub fn reference_sum(dtype: DType, inputs: &[Vec<f32>]) -> Vec<f32> {
    let Some(first) = inputs.first() else {
        return Vec::new();
    };
    let mut acc: Vec<f32> = first.clone();
    for input in &inputs[1..] {
        for (a, x) in acc.iter_mut().zip(input) {
            *a += *x;
        }
    }
    if dtype == DType::F16 {
        for a in &mut acc {
            *a = f16::from_f32(*a).to_f32();
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_sum(dtype: DType, inputs: &[Vec<f32>]) -> Vec<f32> {
        let encode = |v: &Vec<f32>| -> Vec<u8> {
            match dtype {
                DType::F16 => v
                    .iter()
                    .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                    .collect(),
                _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            }
        };
        let raw: Vec<Vec<u8>> = inputs.iter().map(encode).collect();
        let views: Vec<&[u8]> = raw.iter().map(|v| v.as_slice()).collect();
        let count = inputs[0].len();
        let mut a = vec![0u8; count * dtype.size()];
        let mut b = vec![0u8; count * dtype.size()];
        {
            let mut outs = [WriteOnly::from(&mut a[..]), WriteOnly::from(&mut b[..])];
            sum_into(dtype, count, &views, &mut outs);
        }
        assert_eq!(a, b);
        match dtype {
            DType::F16 => a
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => bytemuck::pod_collect_to_vec(&a),
        }
    }

    #[test]
    fn fast_f16_conversions_agree_with_half() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut wide = vec![0f32; all.len()];
        widen(bytemuck::cast_slice(&all), &mut wide);
        for (h, w) in all.iter().zip(&wide) {
            let want = f16::from_bits(*h).to_f32();
            assert!(
                want.to_bits() == w.to_bits() || (want.is_nan() && w.is_nan()),
                "{h:#x}"
            );
        }
        // Ties, overflow, subnormals and ordinary values round like half does.
        let probes: Vec<f32> = (0..70_001)
            .map(|i| f32::from_bits(0x3300_0000u32.wrapping_add(i * 0x9e37)))
            .chain([
                65504.0,
                65520.0,
                1e9,
                -0.0,
                5.9604645e-8,
                2.9802322e-8,
                1.0009766,
            ])
            .collect();
        let mut narrowed = vec![f16::ZERO; probes.len()];
        narrow(&probes, &mut narrowed);
        for (x, h) in probes.iter().zip(&narrowed) {
            assert_eq!(f16::from_f32(*x).to_bits(), h.to_bits(), "{x:e}");
        }
    }

    #[test]
    fn sums_match_reference_across_block_edges() {
        for dtype in [DType::F32, DType::F16] {
            let inputs: Vec<Vec<f32>> = (0..3)
                .map(|r| {
                    (0..2500)
                        .map(|i| ((i * 7 + r * 13) % 29) as f32 * 0.25 - 3.0)
                        .collect()
                })
                .collect();
            // The reference takes values as they are stored.
            let stored: Vec<Vec<f32>> = inputs
                .iter()
                .map(|v| {
                    v.iter()
                        .map(|x| match dtype {
                            DType::F16 => f16::from_f32(*x).to_f32(),
                            _ => *x,
                        })
                        .collect()
                })
                .collect();
            assert_eq!(run_sum(dtype, &inputs), reference_sum(dtype, &stored));
        }
    }
}
