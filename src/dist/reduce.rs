//! The all-reduce of a tensor-parallel group spread over MPI ranks, one device per rank:
//! device -> host staging -> `MPI_Iallreduce` -> host -> device, chunked and pipelined like the
//! in-process host path (the download of chunk k+1 runs while chunk k is reduced over MPI and
//! chunk k-1 is uploaded). With the f16 link, each rank sends its chunk as f16 (an all-gather of
//! half the bytes) and sums every rank's values in f32 in rank order, rounding once, as the
//! in-process f16 link does.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use half::f16;
use half::slice::HalfFloatSliceExt;
use mpi::collective::SystemOperation;
use mpi::request::StaticScope;
use mpi::traits::*;

use super::error::DistError;
use super::world::{poll_until, Comm, World};
use crate::comm::{Collectives, CommConfig, CrossProcessGroup, LinkPrecision};
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};

/// Host buffers reused from call to call (no allocation in steady state).
#[derive(Default)]
struct HostBufs {
    /// This rank's chunk as downloaded.
    bytes: Vec<u8>,
    /// This rank's chunk as f32 (when the download is not 4-byte aligned) .
    send: Vec<f32>,
    /// The sum.
    recv: Vec<f32>,
    /// f16 link: this rank's chunk, and every rank's.
    half: Vec<u16>,
    gathered: Vec<u16>,
}

/// A tensor-parallel group over MPI ranks (see the module docs).
pub struct MpiGroup {
    comm: Arc<Comm>,
    coll: Arc<Collectives>,
    rank: usize,
    size: usize,
    timeout: Duration,
    link: LinkPrecision,
    chunk_elems: usize,
    threshold_bytes: u64,
    bufs: Mutex<HostBufs>,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl MpiGroup {
    /// The group of every rank of `world`, staging through `coll` with `config`'s chunking
    /// (`chunk_bytes` pieces above `pipeline_threshold`) and link precision.
    pub fn new(world: &World, coll: Arc<Collectives>, config: &CommConfig) -> Self {
        Self {
            comm: world.coll().clone(),
            rank: world.rank(),
            size: world.size(),
            timeout: world.timeout(),
            link: config.link,
            chunk_elems: ((config.chunk_bytes / 4) as usize / 4 * 4).max(4),
            threshold_bytes: config.pipeline_threshold,
            coll,
            bufs: Mutex::new(HostBufs::default()),
        }
    }

    /// The staging engine.
    pub fn collectives(&self) -> &Arc<Collectives> {
        &self.coll
    }

    /// Chunks an all-reduce of `bytes` runs in.
    pub fn chunks(&self, bytes: u64) -> usize {
        if bytes > self.threshold_bytes {
            (bytes as usize / 4).div_ceil(self.chunk_elems)
        } else {
            1
        }
    }

    /// In-place sum of `tensor` (f32, on `gpu`) over every rank; returns once the result's
    /// upload is queued.
    pub fn all_reduce_tensor(&self, gpu: &Gpu, tensor: &Tensor) -> Result<()> {
        if tensor.dtype() != DType::F32 {
            return Err(WgparError::Shape {
                op: "mpi all_reduce".into(),
                detail: format!("supports f32 tensors; got {}", tensor.dtype().name()),
            });
        }
        let len = tensor.len();
        if len == 0 {
            return Ok(());
        }
        let chunk = if (len * 4) as u64 > self.threshold_bytes {
            self.chunk_elems
        } else {
            len
        };
        let steps = len.div_ceil(chunk);
        let range = |k: usize| k * chunk..((k + 1) * chunk).min(len);
        let mut bufs = crate::threads::lock(&self.bufs);
        let mut pending = Some(self.coll.begin_download_range(gpu, tensor, range(0))?);
        for k in 0..steps {
            let r = range(k);
            if let Some(p) = pending.take() {
                p.finish_into(&mut bufs.bytes)?;
            }
            if k + 1 < steps {
                pending = Some(self.coll.begin_download_range(gpu, tensor, range(k + 1))?);
            }
            self.reduce_host(&mut bufs, r.len(), k)?;
            self.coll.upload(
                gpu,
                tensor,
                r.start,
                bytemuck::cast_slice(&bufs.recv[..r.len()]),
            )?;
        }
        Ok(())
    }

    /// Sums `bufs.bytes` (n f32 values) over the ranks into `bufs.recv`.
    fn reduce_host(&self, bufs: &mut HostBufs, n: usize, step: usize) -> Result<()> {
        let HostBufs {
            bytes,
            send,
            recv,
            half,
            gathered,
        } = bufs;
        let values: &[f32] = match bytemuck::try_cast_slice(&bytes[..n * 4]) {
            Ok(v) => v,
            Err(_) => {
                send.clear();
                send.extend(
                    bytes[..n * 4]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
                &send[..]
            }
        };
        if recv.len() < n {
            recv.resize(n, 0.0);
        }
        let deadline = Instant::now() + self.timeout;
        let what = || format!("all-reduce chunk {step} ({n} elements)");
        match self.link {
            LinkPrecision::Native => {
                iall_reduce(&self.comm, values, &mut recv[..n], deadline, self.size)
                    .map_err(|e| with_what(e, what()))?;
            }
            LinkPrecision::F16 => {
                half.resize(n, 0);
                let h: &mut [f16] = bytemuck::cast_slice_mut(&mut half[..]);
                h.convert_from_f32_slice(values);
                gathered.resize(n * self.size, 0);
                iall_gather(
                    &self.comm,
                    &half[..n],
                    &mut gathered[..],
                    deadline,
                    self.size,
                )
                .map_err(|e| with_what(e, what()))?;
                let all: &[f16] = bytemuck::cast_slice(&gathered[..]);
                // Rank order, f32 accumulation, one rounding: every rank gets the same bits.
                for (i, out) in recv[..n].iter_mut().enumerate() {
                    let mut acc = 0.0f32;
                    for r in 0..self.size {
                        acc += all[r * n + i].to_f32();
                    }
                    *out = f16::from_f32(acc).to_f32();
                }
            }
        }
        Ok(())
    }

    /// The benchmark's floor, step 2: `MPI_Allreduce` of host buffers (no device), polled.
    pub fn host_all_reduce(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        iall_reduce(&self.comm, send, recv, deadline, self.size)
            .map_err(|e| with_what(e, "host all-reduce".into()))?;
        Ok(())
    }

    /// Rank 0's `data` on every rank (length, then values), each step polled.
    fn bcast(&self, data: &mut Vec<f32>) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut len = [data.len() as u64];
        ibcast(&self.comm, &mut len[..], deadline, self.size)
            .map_err(|e| with_what(e, "share logits (length)".into()))?;
        data.resize(len[0] as usize, 0.0);
        ibcast(&self.comm, &mut data[..], deadline, self.size)
            .map_err(|e| with_what(e, "share logits".into()))?;
        Ok(())
    }
}

fn with_what(e: DistError, what: String) -> WgparError {
    match e {
        DistError::CollectiveTimeout { ranks, secs, .. } => {
            DistError::CollectiveTimeout { what, ranks, secs }.into()
        }
        other => other.into(),
    }
}

/// `MPI_Iallreduce` (sum) polled against `deadline`.
fn iall_reduce(
    comm: &Comm,
    send: &[f32],
    recv: &mut [f32],
    deadline: Instant,
    size: usize,
) -> std::result::Result<(), DistError> {
    // SAFETY: the request borrows both buffers for 'static only on paper: it completes before
    // this function returns, or, on a timeout, the process is about to fail (the caller's error
    // ends it through `World::fail`) and the request is forgotten, never touching freed memory
    // before exit because the buffers are owned by the long-lived group.
    let (s, r): (&'static [f32], &'static mut [f32]) = unsafe {
        (
            std::slice::from_raw_parts(send.as_ptr(), send.len()),
            std::slice::from_raw_parts_mut(recv.as_mut_ptr(), recv.len()),
        )
    };
    let mut req =
        Some(
            comm.get()
                .immediate_all_reduce_into(StaticScope, s, r, SystemOperation::sum()),
        );
    poll_request(&mut req, deadline, size)
}

/// `MPI_Iallgather` polled against `deadline`.
fn iall_gather(
    comm: &Comm,
    send: &[u16],
    recv: &mut [u16],
    deadline: Instant,
    size: usize,
) -> std::result::Result<(), DistError> {
    // SAFETY: as in `iall_reduce`.
    let (s, r): (&'static [u16], &'static mut [u16]) = unsafe {
        (
            std::slice::from_raw_parts(send.as_ptr(), send.len()),
            std::slice::from_raw_parts_mut(recv.as_mut_ptr(), recv.len()),
        )
    };
    let mut req = Some(comm.get().immediate_all_gather_into(StaticScope, s, r));
    poll_request(&mut req, deadline, size)
}

/// `MPI_Ibcast` from rank 0, polled against `deadline`.
fn ibcast<T: mpi::datatype::Equivalence + 'static>(
    comm: &Comm,
    buf: &mut [T],
    deadline: Instant,
    size: usize,
) -> std::result::Result<(), DistError> {
    // SAFETY: as in `iall_reduce`.
    let b: &'static mut [T] =
        unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), buf.len()) };
    let mut req = Some(
        comm.get()
            .process_at_rank(0)
            .immediate_broadcast_into(StaticScope, b),
    );
    poll_request(&mut req, deadline, size)
}

fn poll_request<D: ?Sized>(
    req: &mut Option<mpi::request::Request<'static, D, StaticScope>>,
    deadline: Instant,
    size: usize,
) -> std::result::Result<(), DistError> {
    let started = Instant::now();
    let result = poll_until(
        deadline,
        || {
            let r = req.take()?;
            match r.test() {
                Ok(_) => Some(()),
                Err(r) => {
                    *req = Some(r);
                    None
                }
            }
        },
        || DistError::CollectiveTimeout {
            what: "collective".into(),
            ranks: size,
            secs: started.elapsed().as_secs_f64(),
        },
    );
    if let Some(r) = req.take() {
        // Timed out: the request can never be completed safely; let it go (see above).
        std::mem::forget(r);
    }
    result
}

impl CrossProcessGroup for MpiGroup {
    fn size(&self) -> usize {
        self.size
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn all_reduce(&self, gpu: &Gpu, tensor: &Tensor) -> Result<()> {
        self.all_reduce_tensor(gpu, tensor)
    }

    fn share_output(&self, output: Option<Vec<f32>>) -> Result<Vec<f32>> {
        // Rank 0 holds the LM head (or the pooling) in every tensor-parallel layout, and the
        // engine hands it the step's output: none there is a bug of the engine, not of a
        // caller's input.
        if self.rank == 0 && output.is_none() {
            return Err(WgparError::Internal(
                "rank 0 of a tensor-parallel group returned no output".into(),
            ));
        }
        let mut data = output.unwrap_or_default();
        self.bcast(&mut data)?;
        Ok(data)
    }
}
