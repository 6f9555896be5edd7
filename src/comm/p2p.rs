//! Point-to-point transfers: device -> host in two halves (so a pipeline stage can start the copy,
//! keep computing, and collect the bytes later), host -> device, device -> device through the
//! host, and the round trip that serves as the benchmark's floor.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wgpu::WriteOnly;

use super::collectives::{
    check_devices, check_dtypes, check_lens, chunk_elems, lock, verify_devices, Collectives,
    RunSpec,
};
use super::compress::LinkPrecision;
use super::config::Algorithm;
use super::error::CommError;
use super::pipeline::{ceil4, classify, floor4, step_range, Plan, Span, TensorRef};
use super::reduce::copy_into;
use super::staging::{Direction, Slot, StagingPool, Wait};
use super::stats::{CollectiveOp, CommRecord, CommStats};
use crate::device::{DType, Gpu, Tensor};
use crate::error::Result;

/// Member m's buffers are `[input, output]`; `sources[m]` names the member whose input lands in
/// m's output (`None`: m receives nothing).
struct PermutePlan {
    eb: usize,
    len: usize,
    chunk: usize,
    sources: Vec<Option<usize>>,
    sends: Vec<bool>,
}

impl PermutePlan {
    fn new(eb: usize, len: usize, chunk: usize, sources: Vec<Option<usize>>) -> Self {
        let mut sends = vec![false; sources.len()];
        for s in sources.iter().flatten() {
            sends[*s] = true;
        }
        Self {
            eb,
            len,
            chunk,
            sources,
            sends,
        }
    }

    fn span(&self, k: usize, buf: usize) -> Span {
        let r = step_range(k, self.chunk, self.len);
        Span {
            buf,
            offset: (r.start * self.eb) as u64,
            len: ceil4((r.len() * self.eb) as u64),
        }
    }
}

impl Plan for PermutePlan {
    fn steps(&self) -> usize {
        self.len.div_ceil(self.chunk)
    }

    fn downloads(&self, k: usize, m: usize, out: &mut Vec<Span>) {
        if self.sends[m] {
            out.push(self.span(k, 0));
        }
    }

    fn uploads(&self, k: usize, m: usize, out: &mut Vec<Span>) {
        if self.sources[m].is_some() {
            out.push(self.span(k, 1));
        }
    }

    fn out_elems(&self, k: usize) -> usize {
        step_range(k, self.chunk, self.len).len()
    }

    fn elem_bytes(&self) -> usize {
        self.eb
    }

    fn host(
        &self,
        _k: usize,
        part: Range<usize>,
        inputs: &[&[u8]],
        outputs: &mut [WriteOnly<'_, [u8]>],
    ) {
        let bytes = part.start * self.eb..part.end * self.eb;
        // Outputs are the receiving members, in member order.
        for (out, src) in outputs.iter_mut().zip(self.sources.iter().flatten()) {
            copy_into(&inputs[*src][bytes.clone()], 0, std::slice::from_mut(out));
        }
    }
}

impl Collectives {
    /// Copies `src` (on its device) into `dst` (on another device, or the same one) through
    /// host memory. Same length and dtype.
    pub fn send_recv(&self, src: (&Gpu, &Tensor), dst: (&Gpu, &Tensor)) -> Result<()> {
        const OP: &str = "send_recv";
        let start = Instant::now();
        let gpus = [src.0, dst.0];
        let ts = [TensorRef::of(src.1), TensorRef::of(dst.1)];
        let refs: Vec<&TensorRef> = ts.iter().collect();
        let checked = (|| {
            let dtype = check_dtypes(
                OP,
                "tensor",
                &gpus,
                &refs,
                &[DType::F32, DType::F16, DType::U32],
            )?;
            let len = check_lens(OP, "tensor", "", &gpus, &refs)?;
            Ok::<_, CommError>((dtype, len))
        })();
        let (dtype, len) = match checked {
            Ok(v) => v,
            Err(e) => {
                return Err(self
                    .fail(CollectiveOp::SendRecv, &gpus, &refs, start, e)
                    .into())
            }
        };
        let bytes = (len * dtype.size()) as u64;
        if src.0.device() == dst.0.device() || len == 0 {
            let r =
                super::collectives::local_copy(OP, 0, src.0, &ts[0].buffer, &ts[1].buffer, bytes)
                    .and_then(|_| verify_devices(OP, &[dst.0], &[&ts[1].buffer]));
            self.record_local(
                CollectiveOp::SendRecv,
                &gpus,
                dtype,
                bytes,
                start,
                r.as_ref().err(),
            );
            return Ok(r?);
        }
        let algorithm = self.resolve(None, bytes);
        let chunk = chunk_elems(self.budget(algorithm), dtype.size() as u64, 0);
        Ok(self.run(RunSpec {
            op: CollectiveOp::SendRecv,
            gpus: gpus.to_vec(),
            bufs: vec![
                vec![ts[0].buffer.clone(), ts[0].buffer.clone()],
                vec![ts[1].buffer.clone(), ts[1].buffer.clone()],
            ],
            plan: Arc::new(PermutePlan::new(
                dtype.size(),
                len,
                chunk,
                vec![None, Some(0)],
            )),
            algorithm,
            dtype,
            bytes,
            link: LinkPrecision::Native,
        })?)
    }

    /// Ring exchange: part i is `(gpu_i, send_i, recv_i)` and `send_i` lands in `recv_{i+1}`
    /// (the last in the first), all at once (nccl-tests' send/recv pattern).
    pub fn shift(&self, parts: &[(&Gpu, &Tensor, &Tensor)], algorithm: Algorithm) -> Result<()> {
        let n = parts.len();
        let sources = (0..n).map(|m| Some((m + n - 1) % n)).collect();
        self.permute(CollectiveOp::SendRecv, parts, sources, algorithm)
    }

    /// Every tensor goes to the host and back into itself, on all devices at once, through the
    /// same staging path, chunking and threads as the collectives but with no reduction: the
    /// floor a host-staged collective of this size cannot beat.
    pub fn round_trip(&self, parts: &[(&Gpu, &Tensor)], algorithm: Algorithm) -> Result<()> {
        let parts: Vec<(&Gpu, &Tensor, &Tensor)> = parts.iter().map(|p| (p.0, p.1, p.1)).collect();
        let sources = (0..parts.len()).map(Some).collect();
        self.permute(CollectiveOp::RoundTrip, &parts, sources, algorithm)
    }

    fn permute(
        &self,
        op: CollectiveOp,
        parts: &[(&Gpu, &Tensor, &Tensor)],
        sources: Vec<Option<usize>>,
        algorithm: Algorithm,
    ) -> Result<()> {
        let name = op.name();
        let start = Instant::now();
        let gpus: Vec<&Gpu> = parts.iter().map(|p| p.0).collect();
        let ins: Vec<TensorRef> = parts.iter().map(|p| TensorRef::of(p.1)).collect();
        let outs: Vec<TensorRef> = parts.iter().map(|p| TensorRef::of(p.2)).collect();
        let all: Vec<&TensorRef> = ins.iter().chain(&outs).collect();
        let both: Vec<&Gpu> = [gpus.as_slice(), gpus.as_slice()].concat();
        let checked = (|| {
            check_devices(name, "tensor", &gpus)?;
            let dtype = check_dtypes(
                name,
                "tensor",
                &both,
                &all,
                &[DType::F32, DType::F16, DType::U32],
            )?;
            let len = check_lens(name, "tensor", "", &both, &all)?;
            Ok::<_, CommError>((dtype, len))
        })();
        let (dtype, len) = match checked {
            Ok(v) => v,
            Err(e) => return Err(self.fail(op, &gpus, &all, start, e).into()),
        };
        let bytes = (len * dtype.size()) as u64;
        let algorithm = self.resolve(Some(algorithm), bytes);
        let chunk = chunk_elems(self.budget(algorithm), dtype.size() as u64, 0);
        Ok(self.run(RunSpec {
            op,
            gpus: gpus.clone(),
            bufs: ins
                .iter()
                .zip(&outs)
                .map(|(i, o)| vec![i.buffer.clone(), o.buffer.clone()])
                .collect(),
            plan: Arc::new(PermutePlan::new(dtype.size(), len, chunk, sources)),
            algorithm,
            dtype,
            bytes,
            link: LinkPrecision::Native,
        })?)
    }

    /// Starts copying `tensor` to the host and returns at once; [`PendingDownload::finish`]
    /// hands over the bytes. Up to `depth` chunks are in flight, so tensors of at most
    /// `depth * max_slot_bytes` move entirely in the background.
    pub fn begin_download(&self, gpu: &Gpu, tensor: &Tensor) -> Result<PendingDownload> {
        self.begin_download_range(gpu, tensor, 0..tensor.len())
    }

    /// [`begin_download`](Self::begin_download) of elements `elems` only (any range: the
    /// aligned bytes around it are copied and trimmed on the host).
    pub fn begin_download_range(
        &self,
        gpu: &Gpu,
        tensor: &Tensor,
        elems: Range<usize>,
    ) -> Result<PendingDownload> {
        let eb = tensor.dtype().size() as u64;
        if elems.start > elems.end || elems.end > tensor.len() {
            return Err(CommError::mismatch(
                "download",
                format!(
                    "element range {}..{} is outside a tensor of {} elements",
                    elems.start,
                    elems.end,
                    tensor.len()
                ),
            )
            .into());
        }
        let begin = elems.start as u64 * eb;
        let end = elems.end as u64 * eb;
        let mut pd = PendingDownload {
            device: gpu.device().clone(),
            queue: gpu.queue().clone(),
            label: gpu.label().to_string(),
            describe: gpu.describe(),
            pool: self.pool(gpu),
            src: tensor.buffer().clone(),
            begin,
            end,
            next: floor4(begin),
            chunk: if end - begin > self.config().pipeline_threshold {
                self.config().chunk_bytes
            } else {
                self.config().max_slot_bytes
            },
            inflight: VecDeque::new(),
            wait: self.wait(),
            stats: self.stats().clone(),
            start: Instant::now(),
            dtype: tensor.dtype(),
            waited: Duration::ZERO,
            chunks: 0,
        };
        let slots = if end > begin {
            self.config()
                .depth
                .min(((ceil4(end) - floor4(begin)).div_ceil(pd.chunk)) as usize)
        } else {
            0
        };
        for i in 0..slots {
            let slot = lock(&pd.pool).lease(
                Direction::Download,
                pd.chunk.min(ceil4(end) - floor4(begin)),
            );
            pd.issue(slot, i == 0)?;
        }
        if slots == 0 {
            verify_devices("download", &[gpu], &[tensor.buffer()])?;
        }
        Ok(pd)
    }

    /// Writes `host` (raw elements of the tensor's dtype) into `tensor` from element `offset`,
    /// through pooled upload buffers; returns once the copies are queued. The byte offset must
    /// be a multiple of 4 and the end too, unless it is the tensor's end (wgpu copies whole
    /// 4-byte words, and a word must not be shared with elements the caller did not send).
    pub fn upload(&self, gpu: &Gpu, tensor: &Tensor, offset: usize, host: &[u8]) -> Result<()> {
        let start = Instant::now();
        let r = self.upload_inner(gpu, tensor, offset, host);
        let end = Instant::now();
        let bytes = host.len() as u64;
        self.stats().push(CommRecord {
            seq: 0,
            op: CollectiveOp::Upload,
            algorithm: Algorithm::GatherReduceBroadcast,
            dtype: tensor.dtype(),
            link: LinkPrecision::Native,
            count: host.len() / tensor.dtype().size(),
            bytes,
            d2h_bytes: 0,
            h2d_bytes: if r.is_ok() { ceil4(bytes) } else { 0 },
            participants: vec![gpu.label().to_string()],
            chunks: r.as_ref().copied().unwrap_or(0),
            start,
            end,
            start_us: 0.0,
            duration: end - start,
            d2h: Duration::ZERO,
            reduce: Duration::ZERO,
            h2d: end - start,
            error: r.as_ref().err().map(|e| e.to_string()),
        });
        r.map(|_| ()).map_err(Into::into)
    }

    fn upload_inner(
        &self,
        gpu: &Gpu,
        tensor: &Tensor,
        offset: usize,
        host: &[u8],
    ) -> std::result::Result<usize, CommError> {
        let begin = upload_range(tensor, offset, host)?;
        if host.is_empty() {
            verify_devices(UPLOAD, &[gpu], &[tensor.buffer()])?;
            return Ok(0);
        }
        let cfg = self.config();
        let chunk = if host.len() as u64 > cfg.pipeline_threshold {
            cfg.chunk_bytes
        } else {
            cfg.max_slot_bytes
        } as usize;
        let chunks = host.len().div_ceil(chunk);
        let pool = self.pool(gpu);
        let mut slots: Vec<Slot> = {
            let mut p = lock(&pool);
            (0..cfg.depth.min(chunks))
                .map(|_| p.lease(Direction::Upload, ceil4(chunk.min(host.len()) as u64)))
                .collect()
        };
        for (i, piece) in host.chunks(chunk).enumerate() {
            let n_slots = slots.len();
            let slot = &mut slots[i % n_slots];
            slot.wait_mapped(gpu.device(), UPLOAD, gpu.label(), self.wait())?;
            let to = (tensor, begin + (i * chunk) as u64);
            // Only the first copy can meet a tensor of another device: check it alone.
            upload_piece(gpu, slot, piece, to, i == 0)?;
        }
        let mut p = lock(&pool);
        for slot in slots {
            p.give_back(slot);
        }
        Ok(chunks)
    }
}

const UPLOAD: &str = "upload";

/// Checks that `host` is whole elements of `tensor` that fit at element `offset`, with both
/// byte ends on 4-byte words (or the end at the tensor's end); returns the first byte.
fn upload_range(
    tensor: &Tensor,
    offset: usize,
    host: &[u8],
) -> std::result::Result<u64, CommError> {
    let eb = tensor.dtype().size();
    if !host.len().is_multiple_of(eb) {
        return Err(CommError::mismatch(
            UPLOAD,
            format!(
                "{} bytes is not a whole number of {} elements ({eb} B each)",
                host.len(),
                tensor.dtype().name()
            ),
        ));
    }
    let count = host.len() / eb;
    if offset + count > tensor.len() {
        return Err(CommError::mismatch(
            UPLOAD,
            format!(
                "{count} elements at offset {offset} do not fit a tensor of {} elements",
                tensor.len()
            ),
        ));
    }
    let begin = (offset * eb) as u64;
    let end = begin + host.len() as u64;
    if !begin.is_multiple_of(4) || (!end.is_multiple_of(4) && end != tensor.bytes()) {
        return Err(CommError::mismatch(
            UPLOAD,
            format!(
                "bytes {begin}..{end} of a {} tensor: both ends must be multiples of 4 \
                 (the end may also be the tensor's end)",
                tensor.dtype().name()
            ),
        ));
    }
    Ok(begin)
}

/// Writes `piece` into the mapped upload `slot` (zero-padded to a word), copies it to byte
/// `at` of `tensor` and maps the slot again behind the copy. With `checked`, a validation
/// error (the tensor on another device) is caught and returned.
fn upload_piece(
    gpu: &Gpu,
    slot: &mut Slot,
    piece: &[u8],
    (tensor, at): (&Tensor, u64),
    checked: bool,
) -> std::result::Result<(), CommError> {
    let len = ceil4(piece.len() as u64);
    {
        let mut view = slot
            .buffer()
            .slice(0..len)
            .get_mapped_range_mut()
            .map_err(|e| CommError::gpu(UPLOAD, gpu.label(), e.to_string()))?;
        let (mut body, mut tail) = view.slice(..).split_at(piece.len());
        body.copy_from_slice(piece);
        // Padding to the 4-byte word lands in the tensor's own padding: make it zeros.
        tail.fill(0);
    }
    slot.unmap();
    let scope = checked.then(|| gpu.device().push_error_scope(wgpu::ErrorFilter::Validation));
    let mut enc = gpu.encoder();
    enc.copy_buffer_to_buffer(slot.buffer(), 0, tensor.buffer(), at, len);
    let idx = gpu.submit(enc);
    if let Some(scope) = scope {
        if let Some(err) = pollster::block_on(scope.pop()) {
            return Err(classify(UPLOAD, 0, &gpu.describe(), &err));
        }
    }
    slot.request_map(Some(idx));
    Ok(())
}

/// A device -> host copy in flight. Dropping it without [`finish`](Self::finish) is allowed (the
/// staging buffers are then freed instead of pooled).
pub struct PendingDownload {
    device: wgpu::Device,
    queue: wgpu::Queue,
    label: String,
    describe: String,
    pool: Arc<Mutex<StagingPool>>,
    src: wgpu::Buffer,
    /// Payload bytes `begin..end` of `src`.
    begin: u64,
    end: u64,
    /// Next aligned source byte not yet issued.
    next: u64,
    chunk: u64,
    /// Slots with their aligned source range, oldest first.
    inflight: VecDeque<(Slot, Range<u64>)>,
    wait: Wait,
    stats: Arc<CommStats>,
    start: Instant,
    dtype: DType,
    waited: Duration,
    chunks: usize,
}

impl std::fmt::Debug for PendingDownload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingDownload")
            .field("device", &self.label)
            .field("bytes", &(self.end - self.begin))
            .finish()
    }
}

impl PendingDownload {
    /// Payload bytes this download delivers.
    pub fn bytes(&self) -> u64 {
        self.end - self.begin
    }

    /// True when [`finish`](Self::finish) would not wait for the first chunk (never blocks).
    pub fn is_ready(&mut self) -> bool {
        // One non-blocking poll: map callbacks only run inside polls.
        let _ = self.device.poll(wgpu::PollType::Poll);
        match self.inflight.front_mut() {
            Some((slot, _)) => slot.is_mapped(),
            None => true,
        }
    }

    /// Queues the copy of the next chunk into `slot`.
    fn issue(&mut self, mut slot: Slot, checked: bool) -> std::result::Result<(), CommError> {
        let stop = ceil4(self.end);
        let len = self.chunk.min(stop - self.next).min(slot.size());
        let range = self.next..self.next + len;
        let scope = checked.then(|| self.device.push_error_scope(wgpu::ErrorFilter::Validation));
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        enc.copy_buffer_to_buffer(&self.src, range.start, slot.buffer(), 0, len);
        let idx = self.queue.submit(Some(enc.finish()));
        if let Some(scope) = scope {
            if let Some(err) = pollster::block_on(scope.pop()) {
                return Err(classify("download", 0, &self.describe, &err));
            }
        }
        slot.request_map(Some(idx));
        self.next = range.end;
        self.chunks += 1;
        self.inflight.push_back((slot, range));
        Ok(())
    }

    /// Waits for the copy and returns the bytes (raw elements of the tensor's dtype).
    pub fn finish(self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.finish_into(&mut out)?;
        Ok(out)
    }

    /// Like [`finish`](Self::finish), into a caller's buffer (cleared first), so a steady
    /// stream of downloads allocates nothing.
    pub fn finish_into(mut self, out: &mut Vec<u8>) -> Result<()> {
        let r = self.drain_into(out);
        let end = Instant::now();
        let bytes = self.end - self.begin;
        self.stats.push(CommRecord {
            seq: 0,
            op: CollectiveOp::Download,
            algorithm: Algorithm::GatherReduceBroadcast,
            dtype: self.dtype,
            link: LinkPrecision::Native,
            count: (bytes / self.dtype.size() as u64) as usize,
            bytes,
            d2h_bytes: if r.is_ok() {
                ceil4(self.end) - floor4(self.begin)
            } else {
                0
            },
            h2d_bytes: 0,
            participants: vec![self.label.clone()],
            chunks: self.chunks,
            start: self.start,
            end,
            start_us: 0.0,
            duration: end - self.start,
            d2h: self.waited,
            reduce: Duration::ZERO,
            h2d: Duration::ZERO,
            error: r.as_ref().err().map(|e| e.to_string()),
        });
        Ok(r?)
    }

    fn drain_into(&mut self, out: &mut Vec<u8>) -> std::result::Result<(), CommError> {
        out.clear();
        out.reserve((self.end - self.begin) as usize);
        while let Some((mut slot, range)) = self.inflight.pop_front() {
            let t = Instant::now();
            slot.wait_mapped(&self.device, "download", &self.label, self.wait)?;
            self.waited += t.elapsed();
            {
                let view = slot
                    .buffer()
                    .slice(0..range.end - range.start)
                    .get_mapped_range()
                    .map_err(|e| CommError::gpu("download", &self.label, e.to_string()))?;
                let a = (self.begin.max(range.start) - range.start) as usize;
                let b = (self.end.min(range.end) - range.start) as usize;
                if a < b {
                    out.extend_from_slice(&view[a..b]);
                }
            }
            slot.unmap();
            if self.next < ceil4(self.end) {
                self.issue(slot, false)?;
            } else {
                lock(&self.pool).give_back(slot);
            }
        }
        Ok(())
    }
}
