//! `wgpar allreduce` under `mpirun`: the cross-process all-reduce (one device per rank) in
//! nccl-tests columns, beside its floor measured in the same run: the bare download of S bytes,
//! an `MPI_Allreduce` of host buffers of S bytes, and the upload, one after the other. The
//! ratio shows what wgpar adds on top of what the devices and MPI cost anyway.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::error::DistError;
use super::reduce::MpiGroup;
use super::world::World;
use crate::comm::units::format_size;
use crate::comm::{Collectives, CommConfig, LinkPrecision};
use crate::device::Gpu;
use crate::error::Result;
use crate::stats::median;

/// What to measure.
#[derive(Debug, Clone, Serialize)]
pub struct MpiBenchOptions {
    /// Smallest size, bytes.
    pub min_bytes: u64,
    /// Largest size, bytes.
    pub max_bytes: u64,
    /// Size multiplier.
    pub factor: u64,
    /// Timed iterations per size.
    pub iters: usize,
    /// Warm-up iterations per size.
    pub warmup: usize,
    /// Seed of the data.
    pub seed: u64,
    /// Staging, chunking and link precision.
    #[serde(skip)]
    pub config: CommConfig,
}

/// One size.
#[derive(Debug, Clone, Serialize)]
pub struct MpiBenchRow {
    /// S, bytes.
    pub size: u64,
    /// f32 elements.
    pub count: usize,
    /// Chunks the all-reduce ran in.
    pub chunks: usize,
    /// Mean iteration time (the slowest rank's, per iteration), us.
    pub time_us: f64,
    /// S / time, GB/s.
    pub algbw: f64,
    /// algbw x 2(n-1)/n.
    pub busbw: f64,
    /// Elements off the CPU reference (checked on every rank).
    pub wrong: u64,
    /// Median iteration, us.
    pub p50_us: f64,
    /// 99th percentile iteration, us.
    pub p99_us: f64,
    /// Median floor iteration (download + host MPI_Allreduce + upload), us.
    pub floor_p50_us: f64,
    /// Median of the floor's host MPI_Allreduce alone, us.
    pub mpi_p50_us: f64,
    /// Median time / median floor.
    pub floor_ratio: f64,
}

/// The benchmark's result; `Display` prints it in nccl-tests form.
#[derive(Debug, Clone, Serialize)]
pub struct MpiBenchReport {
    /// Ranks.
    pub nranks: usize,
    /// Per rank: host and device.
    pub ranks: Vec<String>,
    /// Options as run.
    pub options: MpiBenchOptions,
    /// Link precision.
    pub link: String,
    /// One row per size.
    pub rows: Vec<MpiBenchRow>,
    /// Sum of `wrong`.
    pub wrong_total: u64,
    /// Mean busbw, GB/s.
    pub avg_busbw: f64,
}

fn data(seed: u64, rank: usize, size: u64, n: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (rank as u64) << 40 ^ size);
    (0..n)
        .map(|_| {
            let m: f32 = rng.random_range(0.25..2.0);
            if rng.random_bool(0.5) {
                m
            } else {
                -m
            }
        })
        .collect()
}

/// One rank's samples of one size: op times, floor times, MPI-only times (us), wrong count.
#[derive(serde::Deserialize, Serialize)]
struct RankSamples {
    times: Vec<f64>,
    floors: Vec<f64>,
    mpis: Vec<f64>,
    wrong: u64,
}

fn percentile(v: &[f64], p: f64) -> f64 {
    crate::stats::nearest_rank(v, p).unwrap_or(0.0)
}

/// Runs the benchmark on every rank (`gpu` is this rank's device); rank 0 gets the report.
pub fn run_bench(
    world: &World,
    gpu: &Arc<Gpu>,
    opts: &MpiBenchOptions,
) -> Result<Option<MpiBenchReport>> {
    if opts.min_bytes == 0 || opts.min_bytes > opts.max_bytes || opts.factor < 2 || opts.iters == 0
    {
        return Err(crate::error::WgparError::option(
            "-b/-e",
            format!(
                "sizes {}..{} x{} with {} iterations: need 0 < min <= max, factor >= 2, iters >= 1",
                opts.min_bytes, opts.max_bytes, opts.factor, opts.iters
            ),
        ));
    }
    let coll = Arc::new(Collectives::new(opts.config.clone())?);
    let bench = SizeBench {
        world,
        gpu,
        opts,
        group: MpiGroup::new(world, coll.clone(), &opts.config),
        coll,
    };
    let mut rows = Vec::new();
    let mut size = opts.min_bytes;
    loop {
        let count = (size / 4).max(1) as usize;
        let samples = bench.samples(count)?;
        rows.extend(bench.row(count, &samples)?);
        if size >= opts.max_bytes {
            break;
        }
        size = size.saturating_mul(opts.factor).min(opts.max_bytes);
    }
    let label = format!(
        "{} {} ({})",
        world.host(),
        gpu.describe(),
        gpu.info().driver_info
    );
    let ranks = world.gather_to_root(&label);
    if world.rank() != 0 {
        return Ok(None);
    }
    let wrong_total = rows.iter().map(|r| r.wrong).sum();
    let avg_busbw = rows.iter().map(|r| r.busbw).sum::<f64>() / rows.len().max(1) as f64;
    Ok(Some(MpiBenchReport {
        nranks: world.size(),
        ranks,
        link: format!("{:?}", opts.config.link),
        options: opts.clone(),
        rows,
        wrong_total,
        avg_busbw,
    }))
}

/// One rank's part of the benchmark at every size.
struct SizeBench<'a> {
    world: &'a World,
    gpu: &'a Arc<Gpu>,
    opts: &'a MpiBenchOptions,
    coll: Arc<Collectives>,
    group: MpiGroup,
}

impl SizeBench<'_> {
    /// This rank's timings of `count` floats: the all-reduce, the floor (a download, the MPI
    /// all-reduce of host memory, an upload) and the MPI part alone; and the elements the
    /// checked all-reduce got wrong.
    fn samples(&self, count: usize) -> Result<RankSamples> {
        let (world, gpu, opts) = (self.world, self.gpu, self.opts);
        let bytes = count as u64 * 4;
        let mine = data(opts.seed, world.rank(), bytes, count);
        let tensor = gpu.upload_f32("mpi allreduce", &mine)?;
        let floor_tensor = gpu.upload_f32("mpi allreduce floor", &mine)?;
        let wrong = self.wrong_elements(&tensor, count)?;
        let mut s = RankSamples {
            times: Vec::with_capacity(opts.iters),
            floors: Vec::with_capacity(opts.iters),
            mpis: Vec::with_capacity(opts.iters),
            wrong,
        };
        let mut host = Vec::new();
        let mut recv = vec![0f32; count];
        for it in 0..opts.warmup + opts.iters {
            world.barrier();
            let t0 = Instant::now();
            self.group.all_reduce_tensor(gpu, &tensor)?;
            self.coll.wait_idle(gpu)?;
            let t = t0.elapsed().as_secs_f64() * 1e6;
            world.barrier();
            let f0 = Instant::now();
            self.coll
                .begin_download(gpu, &floor_tensor)?
                .finish_into(&mut host)?;
            let m0 = Instant::now();
            let copied: Vec<f32>;
            let send: &[f32] = match bytemuck::try_cast_slice(&host) {
                Ok(v) => v,
                Err(_) => {
                    copied = bytemuck::pod_collect_to_vec(&host);
                    &copied
                }
            };
            self.group.host_all_reduce(send, &mut recv)?;
            let m = m0.elapsed().as_secs_f64() * 1e6;
            self.coll
                .upload(gpu, &floor_tensor, 0, bytemuck::cast_slice(&recv))?;
            self.coll.wait_idle(gpu)?;
            let f = f0.elapsed().as_secs_f64() * 1e6;
            if it >= opts.warmup {
                s.times.push(t);
                s.floors.push(f);
                s.mpis.push(m);
            }
        }
        Ok(s)
    }

    /// Checked once, on fresh data; the sum is formed in rank order in f64, and an element is
    /// wrong beyond one f32 (or f16, on that link) rounding per rank of the magnitudes.
    fn wrong_elements(&self, tensor: &crate::device::Tensor, count: usize) -> Result<u64> {
        let (n, opts) = (self.world.size(), self.opts);
        let bytes = count as u64 * 4;
        self.group.all_reduce_tensor(self.gpu, tensor)?;
        let got = self.gpu.read_f32(tensor)?;
        let all: Vec<Vec<f32>> = (0..n).map(|r| data(opts.seed, r, bytes, count)).collect();
        let eps = match opts.config.link {
            LinkPrecision::Native => f32::EPSILON as f64,
            LinkPrecision::F16 => 2f64.powi(-10),
        };
        let mut wrong = 0u64;
        for i in 0..count {
            let exact: f64 = all.iter().map(|v| v[i] as f64).sum();
            let scale: f64 = all.iter().map(|v| (v[i] as f64).abs()).sum();
            if ((got[i] as f64) - exact).abs() > eps * (n as f64) * scale || !got[i].is_finite() {
                wrong += 1;
            }
        }
        Ok(wrong)
    }

    /// Rank 0's row of the size: per iteration, the slowest rank's time; wrong counts add up.
    /// Other ranks send their samples and get `None`.
    fn row(&self, count: usize, samples: &RankSamples) -> Result<Option<MpiBenchRow>> {
        let (world, opts) = (self.world, self.opts);
        let rank = world.rank();
        let text = serde_json::to_string(samples).map_err(|e| DistError::Protocol {
            peer: rank,
            detail: e.to_string(),
        })?;
        let gathered = world.gather_to_root(&text);
        if rank != 0 {
            return Ok(None);
        }
        let parsed: Vec<RankSamples> = (gathered.iter().enumerate())
            .map(|(r, t)| {
                serde_json::from_str(t).map_err(|e| DistError::Protocol {
                    peer: r,
                    detail: format!("benchmark times: {e}"),
                })
            })
            .collect::<std::result::Result<_, _>>()?;
        let slowest = |pick: fn(&RankSamples) -> &Vec<f64>| -> Vec<f64> {
            (0..opts.iters)
                .map(|i| parsed.iter().map(|p| pick(p)[i]).fold(0.0, f64::max))
                .collect()
        };
        let t = slowest(|p| &p.times);
        let f = slowest(|p| &p.floors);
        let m = slowest(|p| &p.mpis);
        let bytes = count as u64 * 4;
        let n = world.size() as f64;
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        let p50 = median(t.clone()).unwrap_or(mean);
        let fp50 = median(f).unwrap_or(0.0);
        let algbw = bytes as f64 / (mean * 1e-6) / 1e9;
        Ok(Some(MpiBenchRow {
            size: bytes,
            count,
            chunks: self.group.chunks(bytes),
            time_us: mean,
            algbw,
            busbw: algbw * 2.0 * (n - 1.0) / n,
            wrong: parsed.iter().map(|p| p.wrong).sum(),
            p50_us: p50,
            p99_us: percentile(&t, 0.99),
            floor_p50_us: fp50,
            mpi_p50_us: median(m).unwrap_or(0.0),
            floor_ratio: if fp50 > 0.0 { p50 / fp50 } else { 0.0 },
        }))
    }
}

impl fmt::Display for MpiBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "# wgpar allreduce over MPI: one device per rank, host-staged, nccl-tests columns"
        )?;
        writeln!(
            f,
            "# nranks {}  dtype float  sizes {}..{} x{}  iters {}  warmup {}  seed {}  link {}  chunk {} above {}",
            self.nranks,
            format_size(o.min_bytes),
            format_size(o.max_bytes),
            o.factor,
            o.iters,
            o.warmup,
            o.seed,
            self.link,
            format_size(o.config.chunk_bytes),
            format_size(o.config.pipeline_threshold)
        )?;
        for (r, d) in self.ranks.iter().enumerate() {
            writeln!(f, "#  Rank {r:2} {d}")?;
        }
        writeln!(f, "# time: per iteration the slowest rank's; floor: download + MPI_Allreduce of host buffers + upload, unpipelined, same run")?;
        writeln!(f, "#")?;
        writeln!(
            f,
            "# {:>10} {:>10} {:>6} {:>5} {:>6} | {:>9} {:>7} {:>7} {:>6} | {:>9} {:>9} {:>9} {:>9} {:>7}",
            "size", "count", "type", "redop", "chunks", "time", "algbw", "busbw", "#wrong", "p50", "p99", "floor", "mpi", "x floor"
        )?;
        writeln!(
            f,
            "# {:>10} {:>10} {:>6} {:>5} {:>6} | {:>9} {:>7} {:>7} {:>6} | {:>9} {:>9} {:>9} {:>9} {:>7}",
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(p50 us)", "(p50 us)", "(p50)"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "  {:>10} {:>10} {:>6} {:>5} {:>6} | {:>9.1} {:>7.3} {:>7.3} {:>6} | {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7.2}",
                r.size, r.count, "float", "sum", r.chunks, r.time_us, r.algbw, r.busbw, r.wrong, r.p50_us, r.p99_us, r.floor_p50_us, r.mpi_p50_us, r.floor_ratio
            )?;
        }
        crate::comm::bench::write_nccl_summary(f, self.wrong_total, (self.avg_busbw, 3))
    }
}
