//! All-gather (every device receives the concatenation of all inputs, rank order) and
//! reduce-scatter (device r receives slice r of the element-wise sum).
//!
//! Both keep device copies 4-byte aligned even when a rank's slice starts at an odd f16 element:
//! downloads take the aligned bytes around a slice and the host step skips the extra ones;
//! uploads always cover a contiguous, aligned range of the destination, so no neighbouring
//! element is ever overwritten.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use wgpu::WriteOnly;

use super::collectives::{
    check_devices, check_dtypes, check_lens, chunk_elems, local_copy, Collectives, RunSpec,
};
use super::compress::LinkPrecision;
use super::config::Algorithm;
use super::error::CommError;
use super::pipeline::{ceil4, floor4, step_range, Plan, Span, TensorRef};
use super::reduce::{copy_into, sum_into};
use super::stats::CollectiveOp;
use crate::device::{DType, Gpu, Tensor};
use crate::error::Result;

/// Steps walk the gathered output (`n * m` elements); a rank downloads the part of its input
/// that falls in the step, and every rank uploads the whole step.
struct AllGatherPlan {
    eb: usize,
    m: usize,
    n: usize,
    chunk: usize,
}

impl AllGatherPlan {
    fn range(&self, k: usize) -> Range<usize> {
        step_range(k, self.chunk, self.n * self.m)
    }

    /// Elements of rank r's input inside step k, in output coordinates.
    fn piece(&self, k: usize, r: usize) -> Range<usize> {
        let step = self.range(k);
        step.start.max(r * self.m)..step.end.min((r + 1) * self.m)
    }
}

impl Plan for AllGatherPlan {
    fn steps(&self) -> usize {
        (self.n * self.m).div_ceil(self.chunk)
    }

    fn downloads(&self, k: usize, r: usize, out: &mut Vec<Span>) {
        let p = self.piece(k, r);
        if p.is_empty() {
            return;
        }
        let eb = self.eb as u64;
        let base = (r * self.m) as u64;
        let a = floor4((p.start as u64 - base) * eb);
        let b = ceil4((p.end as u64 - base) * eb);
        out.push(Span {
            buf: 0,
            offset: a,
            len: b - a,
        });
    }

    fn uploads(&self, k: usize, _d: usize, out: &mut Vec<Span>) {
        let r = self.range(k);
        out.push(Span {
            buf: 1,
            offset: (r.start * self.eb) as u64,
            len: ceil4((r.len() * self.eb) as u64),
        });
    }

    fn out_elems(&self, k: usize) -> usize {
        self.range(k).len()
    }

    fn elem_bytes(&self) -> usize {
        self.eb
    }

    fn host(
        &self,
        k: usize,
        part: Range<usize>,
        inputs: &[&[u8]],
        outputs: &mut [WriteOnly<'_, [u8]>],
    ) {
        let eb = self.eb;
        let g = self.range(k).start + part.start..self.range(k).start + part.end;
        for (r, input) in inputs.iter().enumerate().take(self.n) {
            let lo = g.start.max(r * self.m);
            let hi = g.end.min((r + 1) * self.m);
            if lo >= hi {
                continue;
            }
            // Byte 0 of the download is this source byte (the aligned start of the piece).
            let base = floor4(((self.piece(k, r).start - r * self.m) * eb) as u64) as usize;
            let from = (lo - r * self.m) * eb - base;
            copy_into(
                &input[from..from + (hi - lo) * eb],
                (lo - g.start) * eb,
                outputs,
            );
        }
    }
}

/// Steps walk the `m` output elements; every rank downloads, for each destination rank r, the
/// aligned bytes around slice r of its input, and rank r uploads its slice of the sum.
struct ReduceScatterPlan {
    dtype: DType,
    m: usize,
    n: usize,
    chunk: usize,
}

impl ReduceScatterPlan {
    fn range(&self, k: usize) -> Range<usize> {
        step_range(k, self.chunk, self.m)
    }

    /// Byte range of slice r of an input for step k, aligned outwards.
    fn span(&self, k: usize, r: usize) -> (u64, u64) {
        let eb = self.dtype.size() as u64;
        let s = self.range(k);
        let base = (r * self.m) as u64;
        (
            floor4((base + s.start as u64) * eb),
            ceil4((base + s.end as u64) * eb),
        )
    }
}

impl Plan for ReduceScatterPlan {
    fn steps(&self) -> usize {
        self.m.div_ceil(self.chunk)
    }

    fn downloads(&self, k: usize, _i: usize, out: &mut Vec<Span>) {
        for r in 0..self.n {
            let (a, b) = self.span(k, r);
            out.push(Span {
                buf: 0,
                offset: a,
                len: b - a,
            });
        }
    }

    fn uploads(&self, k: usize, _r: usize, out: &mut Vec<Span>) {
        let s = self.range(k);
        let eb = self.dtype.size();
        out.push(Span {
            buf: 1,
            offset: (s.start * eb) as u64,
            len: ceil4((s.len() * eb) as u64),
        });
    }

    fn out_elems(&self, k: usize) -> usize {
        self.range(k).len()
    }

    fn elem_bytes(&self) -> usize {
        self.dtype.size()
    }

    fn host(
        &self,
        k: usize,
        part: Range<usize>,
        inputs: &[&[u8]],
        outputs: &mut [WriteOnly<'_, [u8]>],
    ) {
        let eb = self.dtype.size();
        let step = self.range(k);
        let mut pos = 0usize;
        let mut ins: Vec<&[u8]> = Vec::with_capacity(inputs.len());
        for (r, out) in outputs.iter_mut().enumerate().take(self.n) {
            let (a, b) = self.span(k, r);
            let shift = ((r * self.m + step.start) * eb) as u64 - a;
            let from = pos + shift as usize + part.start * eb;
            ins.clear();
            ins.extend(inputs.iter().map(|i| &i[from..from + part.len() * eb]));
            sum_into(self.dtype, part.len(), &ins, std::slice::from_mut(out));
            pos += (b - a) as usize;
        }
    }
}

impl Collectives {
    /// Gathers: part i is `(gpu_i, input_i, output_i)`; every `output_i` receives
    /// `input_0 ++ input_1 ++ ...` (rank order). All inputs have the same length m and dtype;
    /// every output holds `n * m` elements. One part copies input to output on its device.
    pub fn all_gather(&self, parts: &[(&Gpu, &Tensor, &Tensor)]) -> Result<()> {
        self.all_gather_with(parts, self.config().algorithm)
    }

    /// [`all_gather`](Self::all_gather) with an explicit algorithm.
    pub fn all_gather_with(
        &self,
        parts: &[(&Gpu, &Tensor, &Tensor)],
        algorithm: Algorithm,
    ) -> Result<()> {
        let gpus: Vec<&Gpu> = parts.iter().map(|p| p.0).collect();
        let ins: Vec<TensorRef> = parts.iter().map(|p| TensorRef::of(p.1)).collect();
        let outs: Vec<TensorRef> = parts.iter().map(|p| TensorRef::of(p.2)).collect();
        Ok(self.all_gather_refs(&gpus, &ins, &outs, Some(algorithm), "tensor")?)
    }

    /// Reduce-scatter: part r is `(gpu_r, input_r, output_r)`; `output_r` receives elements
    /// `r*m .. (r+1)*m` of the sum of all inputs. Outputs hold m elements, inputs `n * m`, all of
    /// one dtype (f32, or f16 accumulated in f32).
    pub fn reduce_scatter(&self, parts: &[(&Gpu, &Tensor, &Tensor)]) -> Result<()> {
        self.reduce_scatter_with(parts, self.config().algorithm)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with an explicit algorithm.
    pub fn reduce_scatter_with(
        &self,
        parts: &[(&Gpu, &Tensor, &Tensor)],
        algorithm: Algorithm,
    ) -> Result<()> {
        let gpus: Vec<&Gpu> = parts.iter().map(|p| p.0).collect();
        let ins: Vec<TensorRef> = parts.iter().map(|p| TensorRef::of(p.1)).collect();
        let outs: Vec<TensorRef> = parts.iter().map(|p| TensorRef::of(p.2)).collect();
        Ok(self.reduce_scatter_refs(&gpus, &ins, &outs, Some(algorithm), "tensor")?)
    }

    pub(crate) fn all_gather_refs(
        &self,
        gpus: &[&Gpu],
        ins: &[TensorRef],
        outs: &[TensorRef],
        algorithm: Option<Algorithm>,
        who: &str,
    ) -> std::result::Result<(), CommError> {
        const OP: &str = "all_gather";
        let start = Instant::now();
        let in_refs: Vec<&TensorRef> = ins.iter().collect();
        let all: Vec<&TensorRef> = ins.iter().chain(outs).collect();
        let n = gpus.len();
        let checked = (|| {
            check_devices(OP, who, gpus)?;
            let dtype = check_dtypes(
                OP,
                who,
                gpus,
                &in_refs,
                &[DType::F32, DType::F16, DType::U32],
            )?;
            check_out_dtype(OP, who, gpus, outs, dtype)?;
            let m = check_lens(OP, who, "input", gpus, &in_refs)?;
            check_scaled((OP, who), ("output", "input"), gpus, outs, m)?;
            Ok::<_, CommError>((dtype, m))
        })();
        let (dtype, m) = match checked {
            Ok(v) => v,
            Err(e) => return Err(self.fail(CollectiveOp::AllGather, gpus, &all, start, e)),
        };
        let bytes = (n * m * dtype.size()) as u64;
        if n == 1 || m == 0 {
            let r = local_copies(OP, gpus, ins, outs, (m * dtype.size()) as u64);
            self.record_local(
                CollectiveOp::AllGather,
                gpus,
                dtype,
                bytes,
                start,
                r.as_ref().err(),
            );
            return r;
        }
        let algorithm = self.resolve(algorithm, bytes);
        let eb = dtype.size();
        let chunk = chunk_elems(self.budget(algorithm), eb as u64, 8);
        self.run(RunSpec {
            op: CollectiveOp::AllGather,
            gpus: gpus.to_vec(),
            bufs: ins
                .iter()
                .zip(outs)
                .map(|(i, o)| vec![i.buffer.clone(), o.buffer.clone()])
                .collect(),
            plan: Arc::new(AllGatherPlan { eb, m, n, chunk }),
            algorithm,
            dtype,
            bytes,
            link: LinkPrecision::Native,
        })
    }

    pub(crate) fn reduce_scatter_refs(
        &self,
        gpus: &[&Gpu],
        ins: &[TensorRef],
        outs: &[TensorRef],
        algorithm: Option<Algorithm>,
        who: &str,
    ) -> std::result::Result<(), CommError> {
        const OP: &str = "reduce_scatter";
        let start = Instant::now();
        let out_refs: Vec<&TensorRef> = outs.iter().collect();
        let all: Vec<&TensorRef> = ins.iter().chain(outs).collect();
        let n = gpus.len();
        let checked = (|| {
            check_devices(OP, who, gpus)?;
            let in_refs: Vec<&TensorRef> = ins.iter().collect();
            let dtype = check_dtypes(OP, who, gpus, &in_refs, &[DType::F32, DType::F16])?;
            check_out_dtype(OP, who, gpus, outs, dtype)?;
            let m = check_lens(OP, who, "output", gpus, &out_refs)?;
            check_scaled((OP, who), ("input", "output"), gpus, ins, m)?;
            Ok::<_, CommError>((dtype, m))
        })();
        let (dtype, m) = match checked {
            Ok(v) => v,
            Err(e) => return Err(self.fail(CollectiveOp::ReduceScatter, gpus, &all, start, e)),
        };
        let bytes = (n * m * dtype.size()) as u64;
        if n == 1 || m == 0 {
            let r = local_copies(OP, gpus, ins, outs, (m * dtype.size()) as u64);
            self.record_local(
                CollectiveOp::ReduceScatter,
                gpus,
                dtype,
                bytes,
                start,
                r.as_ref().err(),
            );
            return r;
        }
        let algorithm = self.resolve(algorithm, bytes);
        let eb = dtype.size() as u64;
        let chunk = chunk_elems(self.budget(algorithm), n as u64 * eb, 8 * n as u64);
        self.run(RunSpec {
            op: CollectiveOp::ReduceScatter,
            gpus: gpus.to_vec(),
            bufs: ins
                .iter()
                .zip(outs)
                .map(|(i, o)| vec![i.buffer.clone(), o.buffer.clone()])
                .collect(),
            plan: Arc::new(ReduceScatterPlan { dtype, m, n, chunk }),
            algorithm,
            dtype,
            bytes,
            link: LinkPrecision::Native,
        })
    }
}

/// Checks that every output has the inputs' dtype.
fn check_out_dtype(
    op: &str,
    who: &str,
    gpus: &[&Gpu],
    outs: &[TensorRef],
    dtype: DType,
) -> std::result::Result<(), CommError> {
    for (i, t) in outs.iter().enumerate() {
        if t.dtype != dtype {
            return Err(CommError::mismatch(
                op,
                format!(
                    "{who} {i} ({}) output holds {} but the inputs hold {}",
                    gpus[i].label(),
                    t.dtype.name(),
                    dtype.name()
                ),
            ));
        }
    }
    Ok(())
}

/// Checks that every tensor in `ts` (the `what` side) holds `m` elements of the `per` side
/// for each of the `gpus.len()` ranks.
fn check_scaled(
    (op, who): (&str, &str),
    (what, per): (&str, &str),
    gpus: &[&Gpu],
    ts: &[TensorRef],
    m: usize,
) -> std::result::Result<(), CommError> {
    let n = gpus.len();
    for (i, t) in ts.iter().enumerate() {
        if t.len != n * m {
            return Err(CommError::mismatch(
                op,
                format!(
                    "{who} {i} ({}) {what} has {} elements, expected {n} ranks x {m} {per} \
                     elements = {}",
                    gpus[i].label(),
                    t.len,
                    n * m
                ),
            ));
        }
    }
    Ok(())
}

/// Input -> output on each device (the one-participant case).
fn local_copies(
    op: &str,
    gpus: &[&Gpu],
    ins: &[TensorRef],
    outs: &[TensorRef],
    bytes: u64,
) -> std::result::Result<(), CommError> {
    for (i, gpu) in gpus.iter().enumerate() {
        local_copy(op, i, gpu, &ins[i].buffer, &outs[i].buffer, bytes)?;
        if bytes == 0 {
            local_copy(op, i, gpu, &outs[i].buffer, &outs[i].buffer, 0)?;
        }
    }
    Ok(())
}
