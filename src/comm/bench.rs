//! An nccl-tests compatible benchmark of the host-staged collectives, with the extras a
//! host-staged path needs: per-iteration p50/p99 and the floor (a bare device -> host -> device
//! round trip of the same bytes on every device, measured in the same run) with the ratio to it.
//!
//! Definitions follow nccl-tests: S is the buffer size (the total over ranks for all-gather and
//! reduce-scatter), algbw = S / time, busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for
//! all-gather and reduce-scatter, x 1 for send/recv; GB = 1e9 bytes.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::collectives::Collectives;
use super::compress::LinkPrecision;
use super::config::{Algorithm, CommConfig};
use super::error::CommError;
use super::reduce::reference_sum;
use super::units::format_size;
use crate::device::{AdapterDesc, DType, Gpu, Tensor};
use crate::error::{human_bytes, Result, WgparError};

/// The operation to benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum BenchOp {
    /// In-place sum; every rank ends with the total.
    AllReduce,
    /// Every rank receives all ranks' S/n bytes.
    AllGather,
    /// Rank r receives slice r of the sum of all ranks' S bytes.
    ReduceScatter,
    /// Rank r sends S bytes to rank r+1 and receives S bytes from rank r-1, all at once.
    SendRecv,
}

impl BenchOp {
    /// nccl-tests name: `allreduce`, `allgather`, `reducescatter`, `sendrecv`.
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "allreduce",
            BenchOp::AllGather => "allgather",
            BenchOp::ReduceScatter => "reducescatter",
            BenchOp::SendRecv => "sendrecv",
        }
    }

    /// busbw / algbw for n ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather | BenchOp::ReduceScatter => (n - 1.0) / n,
            BenchOp::SendRecv => 1.0,
        }
    }

    fn redop(self) -> &'static str {
        match self {
            BenchOp::AllReduce | BenchOp::ReduceScatter => "sum",
            _ => "none",
        }
    }
}

impl FromStr for BenchOp {
    type Err = CommError;

    fn from_str(s: &str) -> std::result::Result<Self, CommError> {
        match s.to_ascii_lowercase().replace(['_', '-'], "").as_str() {
            "allreduce" => Ok(Self::AllReduce),
            "allgather" => Ok(Self::AllGather),
            "reducescatter" => Ok(Self::ReduceScatter),
            "sendrecv" => Ok(Self::SendRecv),
            _ => Err(CommError::Config(format!(
                "unknown op '{s}': expected allreduce, allgather, reducescatter or sendrecv"
            ))),
        }
    }
}

/// Parses a benchmark dtype: `f32`/`float` or `f16`/`half`.
pub fn parse_dtype(s: &str) -> std::result::Result<DType, CommError> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float" | "float32" => Ok(DType::F32),
        "f16" | "half" | "float16" => Ok(DType::F16),
        _ => Err(CommError::Config(format!(
            "unknown dtype '{s}': expected f32 (float) or f16 (half)"
        ))),
    }
}

/// What to measure (`wgpar allreduce -b 8 -e 64M -f 2 ...`).
#[derive(Debug, Clone, Serialize)]
pub struct BenchOptions {
    /// Smallest S, bytes (`-b`).
    pub min_bytes: u64,
    /// Largest S, bytes (`-e`).
    pub max_bytes: u64,
    /// Multiplier between sizes (`-f`), at least 2.
    pub factor: u64,
    /// Timed iterations per size (`-n`).
    pub iters: usize,
    /// Untimed iterations per size before timing (`-w`).
    pub warmup: usize,
    /// The operation.
    pub op: BenchOp,
    /// f32 or f16.
    pub dtype: DType,
    /// Algorithm override (`Auto` picks by size).
    pub algorithm: Algorithm,
    /// Seed of the random data.
    pub seed: u64,
    /// Engine settings (its `algorithm` is replaced by the one above).
    pub config: CommConfig,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            min_bytes: 8,
            max_bytes: 64 << 20,
            factor: 2,
            iters: 20,
            warmup: 5,
            op: BenchOp::AllReduce,
            dtype: DType::F32,
            algorithm: Algorithm::Auto,
            seed: 42,
            config: CommConfig::default(),
        }
    }
}

/// Most timed or warm-up iterations per size: their times are kept (a million is 8 MB, and
/// minutes per size at the fastest collective).
pub const MAX_ITERS: usize = 1_000_000;

impl BenchOptions {
    /// Checks the options against each other, before any device is opened.
    pub fn validate(&self) -> std::result::Result<(), CommError> {
        let bad = |m: String| Err(CommError::Config(m));
        if self.min_bytes == 0 || self.min_bytes > self.max_bytes {
            return bad(format!(
                "sizes must satisfy 0 < min ({}) <= max ({})",
                self.min_bytes, self.max_bytes
            ));
        }
        if self.factor < 2 {
            return bad(format!("factor must be at least 2, got {}", self.factor));
        }
        if self.iters == 0 {
            return bad("iters must be at least 1".into());
        }
        if self.iters > MAX_ITERS || self.warmup > MAX_ITERS {
            return bad(format!(
                "iters (-n) {} and warm-up iters (-w) {} per size: at most {MAX_ITERS} each",
                self.iters, self.warmup
            ));
        }
        if !matches!(self.dtype, DType::F32 | DType::F16) {
            return bad(format!("dtype {} is not benchmarked", self.dtype.name()));
        }
        Ok(())
    }
}

/// A device line of the report header.
#[derive(Debug, Clone, Serialize)]
pub struct BenchDevice {
    /// Rank.
    pub rank: usize,
    /// `gpu0 (llvmpipe ... [Vulkan])`.
    pub device: String,
    /// Driver name.
    pub driver: String,
    /// Driver version details (e.g. the Mesa version).
    pub driver_info: String,
}

/// One size.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// S, bytes.
    pub size: u64,
    /// Elements, S / dtype size.
    pub count: usize,
    /// `float` or `half`.
    pub dtype: &'static str,
    /// `sum` or `none`.
    pub redop: &'static str,
    /// The algorithm that ran.
    pub algorithm: Algorithm,
    /// Mean time per iteration, us.
    pub time_us: f64,
    /// S / time, GB/s.
    pub algbw: f64,
    /// algbw x bus factor, GB/s.
    pub busbw: f64,
    /// Elements that differ from the CPU reference.
    pub wrong: u64,
    /// Fastest iteration, us.
    pub min_us: f64,
    /// Median iteration, us.
    pub p50_us: f64,
    /// 99th percentile iteration, us.
    pub p99_us: f64,
    /// Mean time of the floor (round trip of S bytes on every device at once), us.
    pub floor_us: f64,
    /// Median time of the floor, us.
    pub floor_p50_us: f64,
    /// Mean time / mean floor.
    pub floor_ratio: f64,
    /// Median time / median floor: what the table prints, as it resists load from other
    /// processes on a shared machine better than the means do.
    pub floor_ratio_p50: f64,
}

/// The benchmark's result; `Display` prints it the way nccl-tests does.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// The operation.
    pub op: BenchOp,
    /// Ranks (devices).
    pub nranks: usize,
    /// Options as run.
    pub options: BenchOptions,
    /// One line per device.
    pub devices: Vec<BenchDevice>,
    /// Median single-device round trip of 4 KiB (device -> host -> device), us.
    pub round_trip_4k_us: f64,
    /// One row per size.
    pub rows: Vec<BenchRow>,
    /// Sum of `wrong` over all rows.
    pub wrong_total: u64,
    /// Mean busbw over rows, GB/s.
    pub avg_busbw: f64,
}

/// Buffers of one size.
struct Case {
    /// Per rank: the op's input (all-reduce: the tensor).
    ins: Vec<Tensor>,
    /// Per rank: the op's output (not used by all-reduce).
    outs: Vec<Tensor>,
    /// Per rank: S bytes for the floor's round trip.
    floor: Vec<Tensor>,
    /// Per rank, the input values as stored.
    data: Vec<Vec<f32>>,
    out_len: usize,
}

/// Runs the benchmark on `gpus` (rank r = `gpus[r]`).
pub fn run_bench(gpus: &[Arc<Gpu>], opts: &BenchOptions) -> Result<BenchReport> {
    opts.validate()?;
    if gpus.is_empty() {
        return Err(WgparError::TooFew {
            what: "devices for the collective benchmark".into(),
            got: 0,
            min: 1,
        });
    }
    let mut config = opts.config.clone();
    config.algorithm = opts.algorithm;
    let coll = Collectives::new(config)?;
    let n = gpus.len();
    let eb = opts.dtype.size() as u64;
    let round_trip_4k_us = single_round_trip(&coll, &gpus[0])?;

    let mut rows: Vec<BenchRow> = Vec::new();
    let mut size = opts.min_bytes;
    loop {
        // Whole elements, and for the gather ops a whole number per rank.
        let per_rank = match opts.op {
            BenchOp::AllGather | BenchOp::ReduceScatter => (size / (eb * n as u64)).max(1),
            _ => (size / eb).max(1),
        } as usize;
        let s = match opts.op {
            BenchOp::AllGather | BenchOp::ReduceScatter => per_rank as u64 * n as u64 * eb,
            _ => per_rank as u64 * eb,
        };
        if rows.last().is_none_or(|r| r.size != s) {
            rows.push(bench_size(&coll, gpus, opts, per_rank, s)?);
        }
        match size.checked_mul(opts.factor) {
            Some(next) if next <= opts.max_bytes => size = next,
            _ => break,
        }
    }
    let wrong_total = rows.iter().map(|r| r.wrong).sum();
    let avg_busbw = rows.iter().map(|r| r.busbw).sum::<f64>() / rows.len().max(1) as f64;
    Ok(BenchReport {
        op: opts.op,
        nranks: n,
        options: opts.clone(),
        devices: gpus
            .iter()
            .enumerate()
            .map(|(rank, g)| BenchDevice {
                rank,
                device: g.describe(),
                driver: g.info().driver.clone(),
                driver_info: g.info().driver_info.clone(),
            })
            .collect(),
        round_trip_4k_us,
        rows,
        wrong_total,
        avg_busbw,
    })
}

/// Median of 4 KiB round trips on one device, waited for each time: the latency yardstick.
fn single_round_trip(coll: &Collectives, gpu: &Arc<Gpu>) -> Result<f64> {
    let t = gpu.upload_f32("round trip", &[1.5; 1024])?;
    let mut times = Vec::new();
    for i in 0..220 {
        let start = Instant::now();
        coll.round_trip(&[(gpu, &t)], Algorithm::Auto)?;
        coll.wait_idle(gpu)?;
        if i >= 20 {
            times.push(start.elapsed());
        }
    }
    Ok(percentile(&times, 0.5))
}

fn random(seed: u64, len: usize, dtype: DType) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len)
        .map(|_| {
            // Either sign, magnitude in [0.25, 2): never zero.
            let v: f32 = rng.random_range(0.25..2.0);
            let v = if rng.random::<bool>() { v } else { -v };
            match dtype {
                DType::F16 => f16::from_f32(v).to_f32(),
                _ => v,
            }
        })
        .collect()
}

fn encode(dtype: DType, data: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => data
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect(),
        _ => bytemuck::cast_slice(data).to_vec(),
    }
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytemuck::pod_collect_to_vec(bytes),
    }
}

fn make_case(gpus: &[Arc<Gpu>], opts: &BenchOptions, per_rank: usize, s: u64) -> Result<Case> {
    let n = gpus.len();
    let (in_len, out_len) = match opts.op {
        BenchOp::AllReduce | BenchOp::SendRecv => (per_rank, per_rank),
        BenchOp::AllGather => (per_rank, n * per_rank),
        BenchOp::ReduceScatter => (n * per_rank, per_rank),
    };
    let mut case = Case {
        ins: Vec::new(),
        outs: Vec::new(),
        floor: Vec::new(),
        data: Vec::new(),
        out_len,
    };
    let floor_len = (s / opts.dtype.size() as u64) as usize;
    for (r, g) in gpus.iter().enumerate() {
        let data = random(opts.seed ^ (s << 8) ^ r as u64, in_len, opts.dtype);
        case.ins.push(g.empty("bench input", opts.dtype, in_len)?);
        if opts.op != BenchOp::AllReduce {
            case.outs
                .push(g.empty("bench output", opts.dtype, out_len)?);
        }
        // The all-reduce's floor moves the tensor itself; the others get a buffer of S bytes.
        if opts.op != BenchOp::AllReduce {
            case.floor
                .push(g.empty("bench floor", opts.dtype, floor_len)?);
        }
        case.data.push(data);
    }
    Ok(case)
}

fn run_op(coll: &Collectives, gpus: &[Arc<Gpu>], op: BenchOp, case: &Case) -> Result<()> {
    let algo = coll.config().algorithm;
    match op {
        BenchOp::AllReduce => {
            let parts: Vec<(&Gpu, &Tensor)> =
                gpus.iter().map(|g| g.as_ref()).zip(&case.ins).collect();
            coll.all_reduce_with(&parts, algo)
        }
        _ => {
            let parts: Vec<(&Gpu, &Tensor, &Tensor)> = gpus
                .iter()
                .zip(case.ins.iter().zip(&case.outs))
                .map(|(g, (i, o))| (g.as_ref(), i, o))
                .collect();
            match op {
                BenchOp::AllGather => coll.all_gather_with(&parts, algo),
                BenchOp::ReduceScatter => coll.reduce_scatter_with(&parts, algo),
                _ => coll.shift(&parts, algo),
            }
        }
    }
}

fn run_floor(coll: &Collectives, gpus: &[Arc<Gpu>], case: &Case) -> Result<()> {
    let tensors = if case.floor.is_empty() {
        &case.ins
    } else {
        &case.floor
    };
    let parts: Vec<(&Gpu, &Tensor)> = gpus.iter().map(|g| g.as_ref()).zip(tensors).collect();
    coll.round_trip(&parts, coll.config().algorithm)
}

fn wait_all(coll: &Collectives, gpus: &[Arc<Gpu>]) -> Result<()> {
    for g in gpus {
        coll.wait_idle(g)?;
    }
    Ok(())
}

/// Uploads fresh inputs, poisons outputs, runs the op once and counts elements that differ from
/// the CPU reference by more than one unit in the last place (relative to the magnitudes summed).
fn check(coll: &Collectives, gpus: &[Arc<Gpu>], opts: &BenchOptions, case: &Case) -> Result<u64> {
    let n = gpus.len();
    for (r, g) in gpus.iter().enumerate() {
        coll.upload(g, &case.ins[r], 0, &encode(opts.dtype, &case.data[r]))?;
        if let Some(o) = case.outs.get(r) {
            g.poison(o);
        }
    }
    run_op(coll, gpus, opts.op, case)?;
    wait_all(coll, gpus)?;
    let m = case.out_len;
    let abs: Vec<Vec<f32>> = case
        .data
        .iter()
        .map(|v| v.iter().map(|x| x.abs()).collect())
        .collect();
    let (want, mag): (Vec<Vec<f32>>, Vec<Vec<f32>>) = match opts.op {
        BenchOp::AllReduce | BenchOp::ReduceScatter => {
            let sum = reference_sum(opts.dtype, &case.data);
            let mag = reference_sum(DType::F32, &abs);
            if opts.op == BenchOp::AllReduce {
                (vec![sum; n], vec![mag; n])
            } else {
                (0..n)
                    .map(|r| {
                        (
                            sum[r * m..(r + 1) * m].to_vec(),
                            mag[r * m..(r + 1) * m].to_vec(),
                        )
                    })
                    .unzip()
            }
        }
        BenchOp::AllGather => (vec![case.data.concat(); n], vec![abs.concat(); n]),
        BenchOp::SendRecv => (0..n)
            .map(|r| {
                let from = (r + n - 1) % n;
                (case.data[from].clone(), abs[from].clone())
            })
            .unzip(),
    };
    // One unit in the last place of the dtype, relative to the magnitudes summed; on the f16
    // link, its documented bound instead.
    let f16_link = opts.op == BenchOp::AllReduce
        && opts.dtype == DType::F32
        && opts.config.link == LinkPrecision::F16;
    let eps = match opts.dtype {
        DType::F16 => 1.0 / 1024.0,
        _ if f16_link => 1.5 / 1024.0,
        _ => 1.0 / 8_388_608.0,
    };
    let mut wrong = 0;
    let mut bytes = Vec::new();
    for (r, g) in gpus.iter().enumerate() {
        let t = if opts.op == BenchOp::AllReduce {
            &case.ins[r]
        } else {
            &case.outs[r]
        };
        let pending = coll.begin_download(g, t)?;
        pending.finish_into(&mut bytes)?;
        let got = decode(opts.dtype, &bytes);
        wrong += got
            .iter()
            .zip(&want[r])
            .zip(&mag[r])
            .filter(|((g, w), m)| !(*g - *w).abs().le(&(eps * m.max(w.abs()))))
            .count() as u64;
        wrong += want[r].len().abs_diff(got.len()) as u64;
    }
    Ok(wrong)
}

fn bench_size(
    coll: &Collectives,
    gpus: &[Arc<Gpu>],
    opts: &BenchOptions,
    per_rank: usize,
    s: u64,
) -> Result<BenchRow> {
    let n = gpus.len();
    let case = make_case(gpus, opts, per_rank, s)?;
    let wrong = check(coll, gpus, opts, &case)?;
    for _ in 0..opts.warmup {
        run_op(coll, gpus, opts.op, &case)?;
        wait_all(coll, gpus)?;
        run_floor(coll, gpus, &case)?;
        wait_all(coll, gpus)?;
    }
    // Op and floor iterations alternate, so that load from elsewhere on the machine hits both
    // alike. Each iteration ends when every device is idle (the op returns with uploads queued).
    let mut times = Vec::with_capacity(opts.iters);
    let mut floors = Vec::with_capacity(opts.iters);
    for _ in 0..opts.iters {
        let t = Instant::now();
        run_op(coll, gpus, opts.op, &case)?;
        wait_all(coll, gpus)?;
        times.push(t.elapsed());
        let t = Instant::now();
        run_floor(coll, gpus, &case)?;
        wait_all(coll, gpus)?;
        floors.push(t.elapsed());
    }
    let mean = |v: &[Duration]| v.iter().map(|d| d.as_secs_f64()).sum::<f64>() / v.len() as f64;
    let time = mean(&times);
    let floor = mean(&floors);
    let algbw = s as f64 / time / 1e9;
    let p50 = percentile(&times, 0.5);
    let floor_p50 = percentile(&floors, 0.5);
    Ok(BenchRow {
        size: s,
        count: (s / opts.dtype.size() as u64) as usize,
        dtype: opts.dtype.name(),
        redop: opts.op.redop(),
        algorithm: coll.resolve(Some(coll.config().algorithm), s),
        time_us: time * 1e6,
        algbw,
        busbw: algbw * opts.op.bus_factor(n),
        wrong,
        min_us: times
            .iter()
            .min()
            .map(|d| d.as_secs_f64() * 1e6)
            .unwrap_or(0.0),
        p50_us: p50,
        p99_us: percentile(&times, 0.99),
        floor_us: floor * 1e6,
        floor_p50_us: floor_p50,
        floor_ratio: time / floor,
        floor_ratio_p50: p50 / floor_p50,
    })
}

/// The `q` quantile (nearest rank) of `times`, in microseconds; 0 for none.
fn percentile(times: &[Duration], q: f64) -> f64 {
    let us: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1e6).collect();
    crate::stats::nearest_rank(&us, q).unwrap_or(0.0)
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_setup(f)?;
        write_columns(f)?;
        for r in &self.rows {
            writeln!(
                f,
                "  {:>10} {:>10} {:>6} {:>5} {:>4} | {:>9.1} {:>7.3} {:>7.3} {:>6} | {:>9.1} {:>9.1} {:>9.1} {:>7.2} {:>7.2}",
                r.size,
                r.count,
                r.dtype,
                r.redop,
                r.algorithm.short(),
                r.time_us,
                r.algbw,
                r.busbw,
                r.wrong,
                r.p50_us,
                r.p99_us,
                r.floor_p50_us,
                r.floor_ratio_p50,
                r.floor_ratio
            )?;
        }
        self.write_summary(f)
    }
}

impl BenchReport {
    /// The comment lines that say what ran where: options, staging setup, devices and the
    /// single-device round trip.
    fn write_setup(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        let c = &o.config;
        writeln!(
            f,
            "# wgpar {}: host-staged collectives, nccl-tests columns",
            self.op.name()
        )?;
        writeln!(
            f,
            "# nranks {}  dtype {}  algorithm {}  sizes {}..{} x{}  iters {}  warmup {}  seed {}",
            self.nranks,
            o.dtype.name(),
            o.algorithm,
            format_size(o.min_bytes),
            format_size(o.max_bytes),
            o.factor,
            o.iters,
            o.warmup,
            o.seed
        )?;
        writeln!(
            f,
            "# link {:?}  chunk {}  pipelined above {}  max slot {}  depth {}  host threads {}",
            c.link,
            format_size(c.chunk_bytes),
            format_size(c.pipeline_threshold),
            format_size(c.max_slot_bytes),
            c.depth,
            c.host_threads
        )?;
        for d in &self.devices {
            writeln!(
                f,
                "#  Rank {:2} Device {}  driver {} {}",
                d.rank, d.device, d.driver, d.driver_info
            )?;
        }
        writeln!(
            f,
            "# single-device round trip (4 KiB device->host->device): p50 {:.1} us",
            self.round_trip_4k_us
        )?;
        writeln!(f, "#")?;
        Ok(())
    }

    /// The wrong-value count and average bus bandwidth that close the table.
    fn write_summary(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_nccl_summary(f, self.wrong_total, (self.avg_busbw, 4))
    }
}

/// The lines that close an nccl-tests style table: the wrong-value count (OK or FAILED) and
/// the average bus bandwidth, with `decimals` digits.
pub fn write_nccl_summary(
    f: &mut fmt::Formatter<'_>,
    wrong_total: u64,
    (avg_busbw, decimals): (f64, usize),
) -> fmt::Result {
    let verdict = if wrong_total == 0 { "OK" } else { "FAILED" };
    writeln!(f, "# Out of bounds values : {wrong_total} {verdict}")?;
    writeln!(f, "# Avg bus bandwidth    : {avg_busbw:.decimals$}")?;
    writeln!(f, "#")
}

/// The two header lines of the table: column names, then units.
fn write_columns(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    writeln!(
            f,
            "# {:>10} {:>10} {:>6} {:>5} {:>4} | {:>9} {:>7} {:>7} {:>6} | {:>9} {:>9} {:>9} {:>7} {:>7}",
            "size",
            "count",
            "type",
            "redop",
            "algo",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            "p50",
            "p99",
            "floor",
            "x floor",
            "x mean"
        )?;
    writeln!(
            f,
            "# {:>10} {:>10} {:>6} {:>5} {:>4} | {:>9} {:>7} {:>7} {:>6} | {:>9} {:>9} {:>9} {:>7} {:>7}",
            "(B)",
            "(elements)",
            "",
            "",
            "",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            "",
            "(us)",
            "(us)",
            "(p50 us)",
            "(p50)",
            "(mean)"
        )?;
    Ok(())
}

impl BenchOptions {
    /// Refuses, before any device is opened, a largest size that one device's buffer cannot
    /// hold or the host cannot stage: each rank allocates a tensor of the full size (the
    /// gather operations' outputs too), and the host stages one copy per rank.
    pub fn check_fits(&self, adapters: &[AdapterDesc]) -> Result<()> {
        let bytes = self.max_bytes;
        for (rank, a) in adapters.iter().enumerate() {
            let limit = a.max_buffer_size.min(a.max_storage_binding);
            if bytes > limit {
                return Err(WgparError::TooLarge {
                    what: format!("rank {rank}'s {} tensor (-e {})", self.op.name(), bytes),
                    bytes,
                    limit,
                    kind: "storage binding",
                    adapter: a.label(),
                });
            }
        }
        let host = bytes.saturating_mul(adapters.len() as u64 + 1);
        if let Some(available) = crate::model::budget::host_available_bytes() {
            if host > available {
                return Err(WgparError::limit(
                    "host memory (bytes)",
                    (host, available),
                    format!(
                "-e {}: staging {} ranks through host memory needs about {}, but {} is available; \
                 lower -e",
                human_bytes(bytes),
                adapters.len(),
                human_bytes(host),
                human_bytes(available)
            ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_and_dtypes_parse() {
        assert_eq!(
            "all_reduce".parse::<BenchOp>().ok(),
            Some(BenchOp::AllReduce)
        );
        assert_eq!("sendrecv".parse::<BenchOp>().ok(), Some(BenchOp::SendRecv));
        assert!("broadcast".parse::<BenchOp>().is_err());
        assert_eq!(parse_dtype("half").ok(), Some(DType::F16));
        assert!(parse_dtype("bf16").is_err());
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(BenchOp::AllReduce.bus_factor(4), 1.5);
        assert_eq!(BenchOp::AllGather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::SendRecv.bus_factor(4), 1.0);
        assert_eq!(BenchOp::AllReduce.bus_factor(1), 0.0);
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
    }
}
