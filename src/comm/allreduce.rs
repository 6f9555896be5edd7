//! All-reduce (sum): every device ends with the element-wise sum of all devices' tensors.
//! f32 is summed in f32; f16 is accumulated in f32 and rounded once.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use wgpu::WriteOnly;

use super::collectives::{
    check_devices, check_dtypes, check_lens, chunk_elems, verify_devices, Collectives, RunSpec,
};
use super::compress::{Convert, LinkPrecision};
use super::config::Algorithm;
use super::error::CommError;
use super::pipeline::{ceil4, step_range, Plan, Span, TensorRef};
use super::reduce::sum_into;
use super::stats::CollectiveOp;
use crate::device::{DType, Gpu, Tensor};
use crate::error::Result;

/// Chunk k covers elements `k*chunk ..` of every tensor; every member downloads it and receives
/// the sum back in place.
pub(crate) struct AllReducePlan {
    dtype: DType,
    len: usize,
    chunk: usize,
}

impl AllReducePlan {
    fn range(&self, k: usize) -> Range<usize> {
        step_range(k, self.chunk, self.len)
    }

    fn span(&self, k: usize) -> Span {
        let r = self.range(k);
        let eb = self.dtype.size() as u64;
        Span {
            buf: 0,
            offset: r.start as u64 * eb,
            len: ceil4(r.len() as u64 * eb),
        }
    }
}

impl Plan for AllReducePlan {
    fn steps(&self) -> usize {
        self.len.div_ceil(self.chunk)
    }

    fn downloads(&self, k: usize, _m: usize, out: &mut Vec<Span>) {
        out.push(self.span(k));
    }

    fn uploads(&self, k: usize, _m: usize, out: &mut Vec<Span>) {
        out.push(self.span(k));
    }

    fn out_elems(&self, k: usize) -> usize {
        self.range(k).len()
    }

    fn elem_bytes(&self) -> usize {
        self.dtype.size()
    }

    fn host(
        &self,
        _k: usize,
        part: Range<usize>,
        inputs: &[&[u8]],
        outputs: &mut [WriteOnly<'_, [u8]>],
    ) {
        let eb = self.dtype.size();
        let ins: Vec<&[u8]> = inputs
            .iter()
            .map(|i| &i[part.start * eb..part.end * eb])
            .collect();
        sum_into(self.dtype, part.len(), &ins, outputs);
    }
}

impl Collectives {
    /// Sums the tensors element-wise, in place: afterwards every tensor holds the sum. Each
    /// tensor must live on its own device (the `Gpu` it is paired with); all have the same
    /// length and dtype (f32, or f16 accumulated in f32). One part is a no-op that still checks
    /// its argument. Uses the configured algorithm.
    pub fn all_reduce(&self, parts: &[(&Gpu, &Tensor)]) -> Result<()> {
        self.all_reduce_with(parts, self.config().algorithm)
    }

    /// [`all_reduce`](Self::all_reduce) with an explicit algorithm for this call.
    pub fn all_reduce_with(&self, parts: &[(&Gpu, &Tensor)], algorithm: Algorithm) -> Result<()> {
        let gpus: Vec<&Gpu> = parts.iter().map(|p| p.0).collect();
        let tensors: Vec<TensorRef> = parts.iter().map(|p| TensorRef::of(p.1)).collect();
        Ok(self.all_reduce_refs(&gpus, &tensors, Some(algorithm), "tensor")?)
    }

    pub(crate) fn all_reduce_refs(
        &self,
        gpus: &[&Gpu],
        tensors: &[TensorRef],
        algorithm: Option<Algorithm>,
        who: &str,
    ) -> std::result::Result<(), CommError> {
        const OP: &str = "all_reduce";
        let start = Instant::now();
        let refs: Vec<&TensorRef> = tensors.iter().collect();
        let checked = (|| {
            check_devices(OP, who, gpus)?;
            let dtype = check_dtypes(OP, who, gpus, &refs, &[DType::F32, DType::F16])?;
            let len = check_lens(OP, who, "", gpus, &refs)?;
            Ok::<_, CommError>((dtype, len))
        })();
        let (dtype, len) = match checked {
            Ok(v) => v,
            Err(e) => return Err(self.fail(CollectiveOp::AllReduce, gpus, &refs, start, e)),
        };
        let bytes = (len * dtype.size()) as u64;
        if gpus.len() == 1 || len == 0 {
            let bufs: Vec<&wgpu::Buffer> = tensors.iter().map(|t| &t.buffer).collect();
            let r = verify_devices(OP, gpus, &bufs);
            self.record_local(
                CollectiveOp::AllReduce,
                gpus,
                dtype,
                bytes,
                start,
                r.as_ref().err(),
            );
            return r;
        }
        if dtype == DType::F32 && self.config().link == LinkPrecision::F16 {
            return self.all_reduce_f16_link(gpus, tensors, algorithm, start);
        }
        let algorithm = self.resolve(algorithm, bytes);
        let chunk = chunk_elems(self.budget(algorithm), dtype.size() as u64, 0);
        self.run(RunSpec {
            op: CollectiveOp::AllReduce,
            gpus: gpus.to_vec(),
            bufs: tensors.iter().map(|t| vec![t.buffer.clone()]).collect(),
            plan: Arc::new(AllReducePlan { dtype, len, chunk }),
            algorithm,
            dtype,
            bytes,
            link: LinkPrecision::Native,
        })
    }

    /// The f32 all-reduce over the f16 link: pack on every device, f16 all-reduce of the packed
    /// copies (f32 accumulation), unpack. Queue order keeps the three steps in sequence.
    fn all_reduce_f16_link(
        &self,
        gpus: &[&Gpu],
        tensors: &[TensorRef],
        algorithm: Option<Algorithm>,
        start: Instant,
    ) -> std::result::Result<(), CommError> {
        let link = self.link_cache();
        let len = tensors[0].len;
        let packed_bytes = (len as u64).div_ceil(2) * 4;
        let scratch: Vec<wgpu::Buffer> = gpus.iter().map(|g| link.lease(g, packed_bytes)).collect();
        let result = (|| {
            for (i, (g, t)) in gpus.iter().zip(tensors).enumerate() {
                if let Err(e) = link.convert(g, i, t, &scratch[i], Convert::Pack) {
                    let refs: Vec<&TensorRef> = tensors.iter().collect();
                    return Err(self.fail(CollectiveOp::AllReduce, gpus, &refs, start, e));
                }
            }
            let algorithm = self.resolve(algorithm, packed_bytes);
            let chunk = chunk_elems(self.budget(algorithm), 2, 0);
            self.run(RunSpec {
                op: CollectiveOp::AllReduce,
                gpus: gpus.to_vec(),
                bufs: scratch.iter().map(|b| vec![b.clone()]).collect(),
                plan: Arc::new(AllReducePlan {
                    dtype: DType::F16,
                    len,
                    chunk,
                }),
                algorithm,
                dtype: DType::F32,
                bytes: len as u64 * 4,
                link: LinkPrecision::F16,
            })?;
            for (i, (g, t)) in gpus.iter().zip(tensors).enumerate() {
                link.convert(g, i, t, &scratch[i], Convert::Unpack)?;
            }
            Ok(())
        })();
        if result.is_ok() {
            for (g, b) in gpus.iter().zip(scratch) {
                link.give_back(g, b);
            }
        }
        result
    }
}
