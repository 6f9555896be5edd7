//! The chunked, host-staged executor every collective runs on.
//!
//! A collective is described by a [`Plan`]: per step (chunk), which byte spans each member
//! copies into its download staging buffer, which spans it copies out of its upload staging
//! buffer, and the host work that turns the mapped downloads into the mapped uploads. The
//! executor keeps `depth` steps in flight, so with `depth >= 2` the download of chunk k+1, the
//! host work on chunk k and the upload of chunk k-1 overlap; with `depth == 1` the steps run one
//! after the other (gather-reduce-broadcast). Each member gets one submission per step: the
//! upload of step k followed by the download of step k+depth.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wgpu::WriteOnly;

use super::error::CommError;
use super::staging::{wait_device, Direction, Slot, StagingPool, Wait};
use super::workers::{HostWorkers, Job};
use crate::device::{DType, Gpu, Tensor};

/// A tensor as the comm layer holds it: a clone of the buffer handle plus its type and length,
/// so that ranks can hand their tensors to the thread that runs the collective.
#[derive(Debug, Clone)]
pub(crate) struct TensorRef {
    pub buffer: wgpu::Buffer,
    pub dtype: DType,
    pub len: usize,
}

impl TensorRef {
    pub(crate) fn of(t: &Tensor) -> Self {
        Self {
            buffer: t.buffer().clone(),
            dtype: t.dtype(),
            len: t.len(),
        }
    }
}

/// Elements of step `k` when `len` elements move in chunks of `chunk` (the last one partial).
pub(crate) fn step_range(k: usize, chunk: usize, len: usize) -> Range<usize> {
    let a = k * chunk;
    a..(a + chunk).min(len)
}

/// Rounds down to wgpu's copy alignment.
pub(crate) fn floor4(x: u64) -> u64 {
    x & !3
}

/// Rounds up to wgpu's copy alignment.
pub(crate) fn ceil4(x: u64) -> u64 {
    x.div_ceil(4) * 4
}

/// A byte range of one of a member's buffers; offsets and lengths are multiples of 4.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    /// Index into the member's buffers.
    pub buf: usize,
    pub offset: u64,
    pub len: u64,
}

/// What a collective does, step by step. Plans hold sizes only, never buffers, so the host part
/// can run on worker threads.
pub(crate) trait Plan: Send + Sync + 'static {
    /// Number of steps (chunks); 0 means nothing to move.
    fn steps(&self) -> usize;
    /// Spans member `m` copies into its download buffer in step `k`, packed in order.
    fn downloads(&self, k: usize, m: usize, out: &mut Vec<Span>);
    /// Spans member `m` copies out of its upload buffer in step `k`, packed in order. Every
    /// uploading member's upload buffer holds `out_elems(k)` elements.
    fn uploads(&self, k: usize, m: usize, out: &mut Vec<Span>);
    /// Elements written into each upload buffer in step `k`.
    fn out_elems(&self, k: usize) -> usize;
    /// Bytes per element.
    fn elem_bytes(&self) -> usize;
    /// Host work on output elements `part` of step `k`. `inputs[m]` is member m's download
    /// buffer (empty when it downloads nothing in this step); `outputs` holds, for each member
    /// that uploads in this step, in member order, its upload buffer restricted to `part`.
    fn host(
        &self,
        k: usize,
        part: Range<usize>,
        inputs: &[&[u8]],
        outputs: &mut [WriteOnly<'_, [u8]>],
    );
}

/// One device taking part: its `Gpu`, its staging pool (locked for the operation) and the
/// buffers the plan's spans refer to.
pub(crate) struct Member<'a> {
    pub gpu: &'a Gpu,
    pub pool: &'a mut StagingPool,
    pub bufs: Vec<wgpu::Buffer>,
    /// Position in the caller's list or rank, for error messages.
    pub index: usize,
}

/// Wall time the calling thread spent in each phase (phases of different chunks overlap, so this
/// is the exposed, not the total, time of each) and bytes moved.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Phases {
    pub d2h: Duration,
    pub host: Duration,
    pub h2d: Duration,
    pub d2h_bytes: u64,
    pub h2d_bytes: u64,
    pub steps: usize,
}

/// How to run a plan.
pub(crate) struct Exec<'a> {
    pub op: &'static str,
    pub depth: usize,
    pub wait: Wait,
    pub workers: &'a HostWorkers,
    pub parallel_min_bytes: u64,
}

fn span_bytes(spans: &[Span]) -> u64 {
    spans.iter().map(|s| s.len).sum()
}

/// Runs `plan` over `members`. On success every staging buffer goes back to its pool; on error
/// they are dropped.
pub(crate) fn execute(
    ex: &Exec<'_>,
    members: &mut [Member<'_>],
    plan: Arc<dyn Plan>,
) -> Result<Phases, CommError> {
    let steps = plan.steps();
    let mut ph = Phases {
        steps,
        ..Phases::default()
    };
    if steps == 0 {
        return Ok(ph);
    }
    let depth = ex.depth.clamp(1, steps);
    let mut run = Run::lease(members, plan.as_ref(), depth);
    run.prologue(ex, members, plan.as_ref(), &mut ph)?;
    for k in 0..steps {
        run.step(ex, members, &plan, k, &mut ph)?;
    }
    run.give_back(ex, members)?;
    Ok(ph)
}

/// Buffers (by index) among `spans`, as a bit set; index 63 stands for every later one.
fn mark(spans: &[Span]) -> u64 {
    spans.iter().fold(0u64, |m, s| m | (1u64 << s.buf.min(63)))
}

/// The state of one running plan: per member, its staging slots (one per step in flight), the
/// bytes in flight in each, and the buffers already validated.
struct Run {
    depth: usize,
    steps: usize,
    downs: Vec<Vec<Slot>>,
    ups: Vec<Vec<Slot>>,
    /// Bytes sitting in each download slot (0: nothing issued for the step it holds).
    down_len: Vec<Vec<u64>>,
    /// Bytes each member uploads in the current step, and from where to where.
    up_len: Vec<u64>,
    up_spans: Vec<Vec<Span>>,
    /// Buffers (by index, per member) already checked to belong to the member's device: only
    /// a first use needs a validation scope.
    checked: Vec<u64>,
}

impl Run {
    /// Leases `depth` download and upload slots per member, each as large as the member's
    /// largest step (none where it never moves anything that way).
    fn lease(members: &mut [Member<'_>], plan: &dyn Plan, depth: usize) -> Self {
        let steps = plan.steps();
        let n = members.len();
        let mut spans = Vec::new();
        let mut down_max = vec![0u64; n];
        let mut up_max = vec![0u64; n];
        for k in 0..steps {
            for m in 0..n {
                spans.clear();
                plan.downloads(k, m, &mut spans);
                down_max[m] = down_max[m].max(span_bytes(&spans));
                spans.clear();
                plan.uploads(k, m, &mut spans);
                up_max[m] = up_max[m].max(span_bytes(&spans));
            }
        }
        let mut downs: Vec<Vec<Slot>> = Vec::with_capacity(n);
        let mut ups: Vec<Vec<Slot>> = Vec::with_capacity(n);
        for (m, mem) in members.iter_mut().enumerate() {
            let lease = |pool: &mut StagingPool, dir, bytes| -> Vec<Slot> {
                if bytes == 0 {
                    Vec::new()
                } else {
                    (0..depth).map(|_| pool.lease(dir, bytes)).collect()
                }
            };
            downs.push(lease(mem.pool, Direction::Download, down_max[m]));
            ups.push(lease(mem.pool, Direction::Upload, up_max[m]));
        }
        Self {
            depth,
            steps,
            downs,
            ups,
            down_len: vec![vec![0u64; depth]; n],
            up_len: vec![0u64; n],
            up_spans: vec![Vec::new(); n],
            checked: vec![0u64; n],
        }
    }

    /// Issues the downloads of the first `depth` steps.
    fn prologue(
        &mut self,
        ex: &Exec<'_>,
        members: &[Member<'_>],
        plan: &dyn Plan,
        ph: &mut Phases,
    ) -> Result<(), CommError> {
        let mut spans = Vec::new();
        for s in 0..self.depth {
            for (m, mem) in members.iter().enumerate() {
                if self.downs[m].is_empty() {
                    continue;
                }
                spans.clear();
                plan.downloads(s, m, &mut spans);
                if spans.is_empty() {
                    continue;
                }
                let t = Instant::now();
                let fresh = mark(&spans) & !self.checked[m] != 0;
                let down = Some((spans.as_slice(), &self.downs[m][s]));
                let idx = submit(ex, mem, None, down, fresh)?;
                self.checked[m] |= mark(&spans);
                self.downs[m][s].request_map(idx);
                self.down_len[m][s] = span_bytes(&spans);
                ph.d2h_bytes += self.down_len[m][s];
                ph.d2h += t.elapsed();
            }
        }
        Ok(())
    }

    /// Step `k`: waits for its downloads and for free upload slots, runs the host work, then
    /// submits its uploads and the downloads of step `k + depth`.
    fn step(
        &mut self,
        ex: &Exec<'_>,
        members: &[Member<'_>],
        plan: &Arc<dyn Plan>,
        k: usize,
        ph: &mut Phases,
    ) -> Result<(), CommError> {
        let s = k % self.depth;
        let t0 = Instant::now();
        for (m, mem) in members.iter().enumerate() {
            if self.down_len[m][s] > 0 {
                self.downs[m][s].wait_mapped(mem.gpu.device(), ex.op, mem.gpu.label(), ex.wait)?;
            }
        }
        let t1 = Instant::now();
        ph.d2h += t1 - t0;
        for (m, mem) in members.iter().enumerate() {
            self.up_spans[m].clear();
            plan.uploads(k, m, &mut self.up_spans[m]);
            self.up_len[m] = span_bytes(&self.up_spans[m]);
            if self.up_len[m] > 0 {
                self.ups[m][s].wait_mapped(mem.gpu.device(), ex.op, mem.gpu.label(), ex.wait)?;
            }
        }
        let t2 = Instant::now();
        ph.h2d += t2 - t1;
        host_step(
            ex,
            plan,
            (k, s),
            (&mut self.downs, &self.down_len),
            (&mut self.ups, &self.up_len),
        )?;
        let t3 = Instant::now();
        ph.host += t3 - t2;
        for (m, mem) in members.iter().enumerate() {
            self.submit_next(ex, mem, plan.as_ref(), (k, m), ph)?;
        }
        ph.h2d += t3.elapsed();
        Ok(())
    }

    /// Member `m`'s upload of step `k`, then its download of step `k + depth` into the slot
    /// just read.
    fn submit_next(
        &mut self,
        ex: &Exec<'_>,
        mem: &Member<'_>,
        plan: &dyn Plan,
        (k, m): (usize, usize),
        ph: &mut Phases,
    ) -> Result<(), CommError> {
        let s = k % self.depth;
        let next = k + self.depth;
        let mut next_spans = Vec::new();
        if next < self.steps && !self.downs[m].is_empty() {
            plan.downloads(next, m, &mut next_spans);
        }
        let up_len = self.up_len[m];
        let up = (up_len > 0).then(|| (self.up_spans[m].as_slice(), &self.ups[m][s]));
        let down = (!next_spans.is_empty()).then(|| (next_spans.as_slice(), &self.downs[m][s]));
        let used = mark(&self.up_spans[m]) | mark(&next_spans);
        let fresh = used & !self.checked[m] != 0;
        let idx = submit(ex, mem, up, down, fresh)?;
        self.checked[m] |= used;
        if up_len > 0 {
            self.ups[m][s].request_map(idx.clone());
            ph.h2d_bytes += up_len;
        }
        self.down_len[m][s] = span_bytes(&next_spans);
        if self.down_len[m][s] > 0 {
            self.downs[m][s].request_map(idx);
            ph.d2h_bytes += self.down_len[m][s];
        }
        Ok(())
    }

    /// Returns every slot to its pool and reports errors the devices captured.
    fn give_back(mut self, ex: &Exec<'_>, members: &mut [Member<'_>]) -> Result<(), CommError> {
        for (m, mem) in members.iter_mut().enumerate() {
            for slot in self.downs[m].drain(..).chain(self.ups[m].drain(..)) {
                mem.pool.give_back(slot);
            }
            mem.gpu
                .check()
                .map_err(|e| CommError::gpu(ex.op, mem.gpu.label(), e.to_string()))?;
        }
        Ok(())
    }
}

/// Records and submits one member's copies: `up` (upload slot -> destination spans) first, then
/// `down` (source spans -> download slot). With `checked`, wgpu validation errors (a tensor
/// handed over with the wrong device, above all) are caught here and returned.
fn submit(
    ex: &Exec<'_>,
    mem: &Member<'_>,
    up: Option<(&[Span], &Slot)>,
    down: Option<(&[Span], &Slot)>,
    checked: bool,
) -> Result<Option<wgpu::SubmissionIndex>, CommError> {
    if up.is_none() && down.is_none() {
        return Ok(None);
    }
    let scope = checked.then(|| {
        mem.gpu
            .device()
            .push_error_scope(wgpu::ErrorFilter::Validation)
    });
    let mut enc = mem.gpu.encoder();
    if let Some((spans, slot)) = up {
        let mut at = 0;
        for s in spans {
            enc.copy_buffer_to_buffer(slot.buffer(), at, &mem.bufs[s.buf], s.offset, s.len);
            at += s.len;
        }
    }
    if let Some((spans, slot)) = down {
        let mut at = 0;
        for s in spans {
            enc.copy_buffer_to_buffer(&mem.bufs[s.buf], s.offset, slot.buffer(), at, s.len);
            at += s.len;
        }
    }
    let idx = mem.gpu.submit(enc);
    if let Some(scope) = scope {
        if let Some(err) = pollster::block_on(scope.pop()) {
            return Err(classify(ex.op, mem.index, &mem.gpu.describe(), &err));
        }
    }
    Ok(Some(idx))
}

/// Turns a wgpu validation error into a comm error; a device mismatch becomes
/// [`CommError::WrongDevice`].
pub(crate) fn classify(op: &str, index: usize, device: &str, err: &wgpu::Error) -> CommError {
    let text = err.to_string();
    // wgpu's message ends with the innermost cause, the useful line.
    let detail = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("validation error")
        .to_string();
    if text.contains("doesn't match Device") {
        CommError::WrongDevice {
            op: op.to_string(),
            index,
            device: device.to_string(),
            detail,
        }
    } else {
        CommError::gpu(op, device, detail)
    }
}

/// Splits `0..len` into `parts` ranges whose inner boundaries are multiples of `granule`.
fn split(len: usize, parts: usize, granule: usize) -> Vec<Range<usize>> {
    let units = len.div_ceil(granule);
    let parts = parts.clamp(1, units.max(1));
    let mut out = Vec::with_capacity(parts);
    let mut start = 0;
    for p in 0..parts {
        let end = if p + 1 == parts {
            len
        } else {
            (units * (p + 1) / parts * granule).min(len)
        };
        if end > start {
            out.push(start..end);
        }
        start = end;
    }
    out
}

/// Maps the slots of step `k` (slot index `s`), runs the plan's host work on as many threads as
/// pay off, and unmaps.
fn host_step(
    ex: &Exec<'_>,
    plan: &Arc<dyn Plan>,
    (k, s): (usize, usize),
    (downs, down_len): (&mut [Vec<Slot>], &[Vec<u64>]),
    (ups, up_len): (&mut [Vec<Slot>], &[u64]),
) -> Result<(), CommError> {
    let inputs = map_inputs(ex, downs, down_len, s)?;
    let eb = plan.elem_bytes();
    let out_elems = plan.out_elems(k);
    let out_bytes = (out_elems * eb) as u64;
    let uploaders: Vec<usize> = (0..ups.len()).filter(|&m| up_len[m] > 0).collect();
    for &m in &uploaders {
        if up_len[m] != ceil4(out_bytes) {
            return Err(CommError::gpu(
                ex.op,
                "host",
                format!(
                    "internal: upload of {} B for {out_bytes} B of output",
                    up_len[m]
                ),
            ));
        }
    }
    // Enough work per thread to pay for waking it; inputs are read once per output element.
    let work = out_bytes * (inputs.iter().flatten().count().max(1) as u64);
    let threads = host_threads(ex, work);
    // Part boundaries must give 8-byte aligned views (wgpu's MAP_ALIGNMENT).
    let granule = 8 / gcd(8, eb);
    let mut jobs: Vec<Job> = Vec::new();
    for part in split(out_elems, threads, granule) {
        let mut views = Vec::with_capacity(uploaders.len());
        if !part.is_empty() {
            for &m in &uploaders {
                let a = (part.start * eb) as u64;
                let b = if part.end == out_elems {
                    up_len[m]
                } else {
                    (part.end * eb) as u64
                };
                let view = ups[m][s].buffer().slice(a..b).get_mapped_range_mut();
                views.push(view.map_err(|e| view_err(ex, e))?);
            }
        }
        jobs.push(host_job(plan.clone(), k, part, inputs.clone(), views));
    }
    let result = run_jobs(ex, jobs);
    // Every view is gone once the jobs have run; unmapping with a live view would panic.
    drop(inputs);
    result.map_err(|m| CommError::gpu(ex.op, "host", m))?;
    for (m, slots) in downs.iter_mut().enumerate() {
        if down_len[m].get(s).copied().unwrap_or(0) > 0 {
            slots[s].unmap();
        }
    }
    for &m in &uploaders {
        ups[m][s].unmap();
    }
    Ok(())
}

fn view_err(ex: &Exec<'_>, e: wgpu::MapRangeError) -> CommError {
    CommError::gpu(ex.op, "staging", e.to_string())
}

/// A mapped view of each member's download slot `s` (`None` where it holds nothing).
fn map_inputs(
    ex: &Exec<'_>,
    downs: &[Vec<Slot>],
    down_len: &[Vec<u64>],
    s: usize,
) -> Result<Vec<Option<Arc<wgpu::BufferView>>>, CommError> {
    let mut inputs = Vec::with_capacity(downs.len());
    for (m, slots) in downs.iter().enumerate() {
        let len = down_len[m].get(s).copied().unwrap_or(0);
        inputs.push(if len > 0 {
            let view = slots[s].buffer().slice(0..len).get_mapped_range();
            Some(Arc::new(view.map_err(|e| view_err(ex, e))?))
        } else {
            None
        });
    }
    Ok(inputs)
}

/// Threads worth using for `work` bytes of host work.
fn host_threads(ex: &Exec<'_>, work: u64) -> usize {
    let min = ex.parallel_min_bytes.max(1);
    if ex.workers.threads() > 1 && work >= 2 * min {
        ((work / min) as usize).clamp(1, ex.workers.threads())
    } else {
        1
    }
}

/// The plan's host work on output elements `part` of step `k`, writing into `views`.
fn host_job(
    plan: Arc<dyn Plan>,
    k: usize,
    part: Range<usize>,
    inputs: Vec<Option<Arc<wgpu::BufferView>>>,
    mut views: Vec<wgpu::BufferViewMut>,
) -> Job {
    Box::new(move || {
        let ins: Vec<&[u8]> = inputs
            .iter()
            .map(|v| v.as_deref().map(|v| &v[..]).unwrap_or(&[]))
            .collect();
        let mut outs: Vec<WriteOnly<'_, [u8]>> = views.iter_mut().map(|v| v.slice(..)).collect();
        plan.host(k, part, &ins, &mut outs);
    })
}

/// Runs `jobs`: a single one on the calling thread (no hand-off), more on the workers.
fn run_jobs(ex: &Exec<'_>, mut jobs: Vec<Job>) -> Result<(), String> {
    if jobs.len() == 1 {
        jobs.pop()
            .map(|job| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                    .map_err(|p| super::workers::panic_message(&*p))
            })
            .unwrap_or(Ok(()))
    } else {
        ex.workers.run(jobs)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Waits until everything submitted to `gpu` has finished, then reports captured errors.
pub(crate) fn wait_idle(gpu: &Gpu, op: &str, wait: Wait) -> Result<(), CommError> {
    wait_device(gpu.device(), op, gpu.label(), wait)?;
    gpu.check()
        .map_err(|e| CommError::gpu(op, gpu.label(), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_respects_granule_and_covers_everything() {
        for len in [1usize, 3, 7, 8, 1023, 4097] {
            for parts in 1..5 {
                let r = split(len, parts, 4);
                assert_eq!(r.first().map(|p| p.start), Some(0));
                assert_eq!(r.last().map(|p| p.end), Some(len));
                for w in r.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert_eq!(w[0].end % 4, 0);
                }
            }
        }
    }

    #[test]
    fn alignment_helpers() {
        assert_eq!(floor4(7), 4);
        assert_eq!(ceil4(7), 8);
        assert_eq!(ceil4(8), 8);
    }
}
