//! `wgpar calibrate` under mpirun: one profile of the machine(s) a multi-process run uses.
//!
//! A run under mpirun is several processes, each driving its own device(s), on one host or
//! several. What the projection needs from them differs from the in-process calibration in one
//! measured way: ranks on one host share its processor between *processes* (each with its own
//! driver thread pool and its own MPI polling threads), which is not what devices of one
//! process sharing it cost. So:
//!
//! 1. **Alone rates.** Every rank's devices are measured alone by the in-process calibration
//!    (`crate::calibrate`). Ranks on one host whose devices are the same adapters are the same
//!    hardware: the first of them measures for all (as virtual devices on one adapter are
//!    measured once). Ranks on one host with different devices take turns; ranks on different
//!    hosts measure at the same time. A rank that waits sleeps between polls, so it does not
//!    slow the one measuring.
//! 2. **Sharing between processes.** On each host, k = 2..N of its devices (taken round-robin
//!    over its ranks, so k = 2 is two processes) run the model's whole layers at the run's step
//!    shapes for a window, at once; the ranks with nothing to run wait in the runtime's own
//!    MPI polling, as an idle pipeline stage does. The slowdown against each device alone,
//!    measured just before in the same way (so that load coming or going on the machine
//!    between the phases stays out of the ratio), becomes the group's `compute_sharing`.
//! 3. **What the waiting ranks' polling costs.** One device computes while the other ranks
//!    wait (a) polling as the runtime does ([`Backoff::RUNTIME`]), (b) polling less often
//!    ([`Backoff::SPARSE`]), (c) asleep. Logged, with how late each schedule notices a
//!    message that arrives after a wait, which is what a longer back-off costs.
//! 4. **MPI between ranks.** A ping-pong size sweep between rank 0 and another rank of its
//!    host, and one on another host if there is one, fitted to alpha-beta. Between hosts this
//!    is the profile's `[network]`; on one host it goes into the file's header (a profile's
//!    hand-off between processes on one node is not costed: tens of microseconds per message
//!    against milliseconds of compute, see docs/MULTINODE.md).
//!
//! Rank 0 assembles one profile: a node per host (hosts must hold the same devices, as the
//! profile format describes identical nodes), each node's devices in rank order, which is the
//! order in which `wgpar project` places merged rank traces.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::calibrate::blocks::{time_blocks, StackWork};
use crate::calibrate::sharing::{sharing_steps, sustained_block_time};
use crate::calibrate::{calibrate, join_all, Calibration, CalibrationOptions};
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{GpuModel, ModelWeights, Placement, Step};
use crate::sim::{
    fit_alpha_beta, AlphaBetaFit, ComputeSharing, DeviceSpec, HostProfile, NamedLink,
};
use crate::stats::median;

use super::error::DistError;
use super::world::{Backoff, World};

/// How a rank waits while another rank measures alone: polls seldom, so that it takes next
/// to nothing from the measured one.
const ASLEEP: Backoff = Backoff {
    spin: Duration::ZERO,
    min_sleep: Duration::from_millis(5),
    max_sleep: Duration::from_millis(5),
    fraction: 0.0,
};

/// Tag of the ping-pong messages on the point-to-point communicator (no pipeline runs
/// during a calibration, so nothing else uses it then).
const TAG_PING: i32 = 7100;

/// What each rank learns about every rank before measuring.
#[derive(Debug, Clone)]
struct RankInfo {
    host: String,
    labels: Vec<String>,
}

/// One rank's alone measurement, as sent to the others.
#[derive(Debug, Clone)]
struct AloneResult {
    profile: HostProfile,
    note: String,
    log: String,
    /// Whole-layer time alone per step, per device of the rank (from its adapter group).
    block_times: Vec<Vec<(Step, f64)>>,
}

/// Calibrates the devices of every rank of the job and returns, on rank 0, the profile of
/// the whole job (other ranks get `None`). Progress and figures go to `log` on rank 0.
pub fn calibrate_ranks(
    world: &World,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    options: &CalibrationOptions,
    log: &mut dyn Write,
) -> Result<Option<Calibration>> {
    let layout = Layout::of(world, gpus);
    if world.rank() == 0 {
        layout.say(world, log);
    }
    // 1. Alone, in turns.
    let alone = Alone::measure(world, &layout, (gpus, weights, options), log)?;
    // 2 and 3. Sharing between processes, host by host (hosts measure at the same time).
    let sharing = SharingRun::new(world, &layout, gpus, weights)?.measure(&alone, options, log)?;
    // 4. MPI between ranks.
    let links = MpiLinks::measure(world, &layout.infos, options)?;
    world.barrier_with("calibration end", ASLEEP, world.timeout())?;
    if world.rank() != 0 {
        return Ok(None);
    }
    links.say(log);
    let profile = assemble(
        &layout.infos,
        &layout.source,
        &alone.results,
        sharing,
        links.remote.as_ref(),
        log,
    )?;
    let base = alone.of(0)?;
    Ok(Some(Calibration {
        note: job_note(&layout.infos, &profile, links.local.as_ref(), &base.note),
        profile,
        block_times: base.block_times.clone(),
    }))
}

/// Who measures what: every rank's host and devices, which rank measures alone for each
/// (the first rank of its host with the same devices), and in which turn.
struct Layout {
    infos: Vec<RankInfo>,
    source: Vec<usize>,
    turn: Vec<usize>,
    turns: usize,
}

impl Layout {
    fn of(world: &World, gpus: &[Arc<Gpu>]) -> Self {
        let labels: Vec<String> = gpus.iter().map(|g| g.info().label()).collect();
        let infos: Vec<RankInfo> = world
            .all_gather(&labels.join("\u{1f}"))
            .into_iter()
            .zip(world.hosts())
            .map(|(l, h)| RankInfo {
                host: h.clone(),
                labels: l.split('\u{1f}').map(str::to_string).collect(),
            })
            .collect();
        let n = infos.len();
        let source: Vec<usize> = (0..n)
            .map(|r| {
                (0..=r)
                    .find(|&q| infos[q].host == infos[r].host && infos[q].labels == infos[r].labels)
                    .unwrap_or(r)
            })
            .collect();
        // Turns: the measuring ranks of one host go one after the other.
        let turn: Vec<usize> = (0..n)
            .map(|r| {
                (0..r)
                    .filter(|&q| source[q] == q && infos[q].host == infos[r].host)
                    .count()
            })
            .collect();
        let turns = (0..n)
            .filter(|&r| source[r] == r)
            .map(|r| turn[r] + 1)
            .max()
            .unwrap_or(1);
        Self {
            infos,
            source,
            turn,
            turns,
        }
    }

    fn say(&self, world: &World, log: &mut dyn Write) {
        let hosts = distinct(world.hosts());
        let measuring: Vec<String> = (0..self.infos.len())
            .filter(|&r| self.source[r] == r)
            .map(|r| r.to_string())
            .collect();
        let _ = writeln!(
            log,
            "calibrating {} ranks on {} host(s) ({}); measuring alone: rank(s) {}",
            self.infos.len(),
            hosts.len(),
            hosts.join(", "),
            measuring.join(", ")
        );
    }
}

/// Every rank's alone measurement (`None` for the ranks whose source measured for them).
struct Alone {
    results: Vec<Option<AloneResult>>,
    source: Vec<usize>,
}

impl Alone {
    /// Measures alone in turns, then shares the results with every rank (rank 0 logs them).
    fn measure(
        world: &World,
        layout: &Layout,
        (gpus, weights, options): (&[Arc<Gpu>], &ModelWeights, &CalibrationOptions),
        log: &mut dyn Write,
    ) -> Result<Self> {
        let me = world.rank();
        // A turn of measuring alone takes minutes: a waiting rank allows for that, beyond the
        // job's timeout for ordinary waits. A rank that fails tells the others at once anyway.
        let turn_timeout = world.timeout().max(Duration::from_secs(3600));
        let mut mine: Option<Calibration> = None;
        let mut my_log = Vec::new();
        for t in 0..layout.turns {
            world.barrier_with("calibration turn start", ASLEEP, turn_timeout)?;
            if layout.source[me] == me && layout.turn[me] == t {
                mine = Some(calibrate(gpus, weights, options, &mut my_log)?);
            }
        }
        world.barrier_with("calibration turns end", ASLEEP, turn_timeout)?;
        let payload = match &mine {
            Some(c) => encode_alone(c, &String::from_utf8_lossy(&my_log))?,
            None => String::new(),
        };
        let results = (world.all_gather(&payload).iter().enumerate())
            .map(|(r, text)| {
                (!text.is_empty())
                    .then(|| decode_alone(text, r))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        if me == 0 {
            for (r, a) in results.iter().enumerate() {
                if let Some(a) = a {
                    let _ = writeln!(log, "\n## rank {r} ({}) alone", layout.infos[r].host);
                    let _ = write!(log, "{}", a.log);
                }
            }
        }
        Ok(Self {
            results,
            source: layout.source.clone(),
        })
    }

    /// The alone measurement that stands for rank `r`.
    fn of(&self, r: usize) -> Result<&AloneResult> {
        let source = self.source[r];
        self.results[source]
            .as_ref()
            .ok_or_else(|| WgparError::Measurement(format!("rank {source} sent no calibration")))
    }
}

/// The sharing measurement's parts: this rank's models, its host's device slots
/// (round-robin over the host's ranks), rank 0's host's slots, and the most slots a host has.
struct SharingRun<'a> {
    world: &'a World,
    weights: &'a ModelWeights,
    models: Vec<Arc<GpuModel>>,
    my_slots: Vec<(usize, usize)>,
    host0: Vec<(usize, usize)>,
    most_slots: usize,
}

/// One step shape's sharing measurement.
struct StepRow {
    /// Flops per byte, 1, then the slowdown with k = 2.. devices busy.
    row: Vec<f64>,
    /// The slowest device's whole-layer time alone, seconds (weights the average).
    t1_all: f64,
}

impl<'a> SharingRun<'a> {
    fn new(
        world: &'a World,
        layout: &Layout,
        gpus: &[Arc<Gpu>],
        weights: &'a ModelWeights,
    ) -> Result<Self> {
        let config = &weights.config;
        let models: Vec<Arc<GpuModel>> = gpus
            .iter()
            .map(|g| {
                GpuModel::upload(g.clone(), weights, Placement::whole(config), DType::F32)
                    .map(Arc::new)
            })
            .collect::<Result<_>>()?;
        let infos = &layout.infos;
        let most_slots = (infos.iter().map(|i| slots(infos, &i.host).len()))
            .max()
            .unwrap_or(1);
        Ok(Self {
            world,
            weights,
            models,
            my_slots: slots(infos, world.host()),
            host0: slots(infos, &infos[0].host),
            most_slots,
        })
    }

    /// The slowdown curve over the step shapes, and its throughput-weighted average per
    /// number of busy devices (`None` where no host has two devices).
    fn measure(
        &self,
        alone: &Alone,
        options: &CalibrationOptions,
        log: &mut dyn Write,
    ) -> Result<Option<ComputeSharing>> {
        let me = self.world.rank();
        // Each device's whole-layer time alone per step, on this rank.
        let my_times = per_device_times(&alone.of(me)?.block_times, self.models.len());
        if me == 0 && self.most_slots > 1 {
            let _ = writeln!(
                log,
                "\nsharing between processes (devices of a host taken round-robin over its ranks; idle ranks wait in MPI as a pipeline stage does):"
            );
            let _ = writeln!(
                log,
                "    {:<22} {:>9} {:>8}  slowdown with k devices busy, k = 2..{}",
                "step", "alone ms", "flop/B", self.most_slots
            );
        }
        let window: f64 = if options.quick { 0.3 } else { 1.0 };
        let mut rows = Vec::new();
        let config = &self.weights.config;
        for step in &sharing_steps(options.batch, options.prompt_len, options.quick, config) {
            rows.push(self.step_row(step, (&my_times, alone), window, log)?);
        }
        Ok(self.sharing(rows))
    }

    /// Step `step` alone on each slot, then on k = 2.. slots at once, and the waiting ranks'
    /// polling costs; the row of slowdowns.
    fn step_row(
        &self,
        step: &Step,
        (my_times, alone): (&[Vec<(Step, f64)>], &Alone),
        window: f64,
        log: &mut dyn Write,
    ) -> Result<StepRow> {
        let (world, config) = (self.world, &self.weights.config);
        // Everyone agrees on the window from the slowest device alone.
        let t1_mine: f64 = my_times.iter().map(|t| lookup(t, step)).fold(0.0, f64::max);
        let t1_all = (world.all_gather_f64(&[t1_mine]).iter())
            .map(|v| v[0])
            .fold(0.0, f64::max);
        // Keyed as the in-process sharing rows are: sliding layers charged their window.
        let intensity = StackWork::of(config, &Placement::whole(config), step).layer_intensity();
        let mut row = vec![intensity, 1.0];
        if self.most_slots < 2 {
            return Ok(StepRow { row, t1_all });
        }
        // Each slot alone right before the shared windows, the other ranks waiting in MPI as
        // an idle stage does: the alone time the slowdown is taken against. Measured here,
        // not taken from the rate curves of minutes before, so that load that comes or goes
        // on the machine between the two phases does not enter the slowdown (the curves
        // carry the rates; this carries only the ratio).
        let alone_w = window.max(3.0 * t1_all);
        let mut alone_now = Vec::with_capacity(self.most_slots);
        for j in 0..self.most_slots {
            let t = self.slot_window(&[j], step, alone_w, Backoff::RUNTIME)?;
            alone_now.push(t.get(j).copied().unwrap_or(0.0));
        }
        let mut curve_row = Vec::new();
        for k in 2..=self.most_slots {
            let w = window.max(3.0 * k as f64 * t1_all);
            let set: Vec<usize> = (0..k).collect();
            let t = self.slot_window(&set, step, w, Backoff::RUNTIME)?;
            row.push(slowdown(k, &t, |j| alone_now[j]));
            // Against the curves' alone figure, for the log only.
            curve_row.push(slowdown(k, &t, |j| {
                let (r, d) = self.host0[j];
                let times = alone
                    .of(r)
                    .map(|a| a.block_times.clone())
                    .unwrap_or_default();
                lookup(&per_device_times(&times, d + 1)[d], step)
            }));
        }
        // 3. One device busy, the other ranks waiting with sparser polling, and asleep.
        let mut diag = Vec::new();
        for backoff in [Backoff::SPARSE, ASLEEP] {
            let t = self.slot_window(&[0], step, alone_w, backoff)?;
            diag.push(t.first().copied().unwrap_or(0.0));
        }
        if world.rank() == 0 {
            let curves_ms = lookup(&my_times[0], step) * 1e3;
            say_step_row(
                step,
                (&row, &curve_row, curves_ms),
                (&alone_now, &diag),
                log,
            );
        }
        Ok(StepRow { row, t1_all })
    }

    /// Runs `step` on the host slots `set` (this rank's among them) for `w` seconds, the
    /// others waiting with `idle`; the time per repetition of each of rank 0's host's slots.
    fn slot_window(&self, set: &[usize], step: &Step, w: f64, idle: Backoff) -> Result<Vec<f64>> {
        let me = self.world.rank();
        let busy: Vec<usize> = set
            .iter()
            .filter_map(|&j| self.my_slots.get(j))
            .filter(|(r, _)| *r == me)
            .map(|(_, d)| *d)
            .collect();
        let times = busy_window(self.world, &self.models, &busy, step, w, idle)?;
        // Per host slot index: this rank's times where its slots are.
        let mut mine = vec![0.0; self.most_slots];
        for (&d, t) in busy.iter().zip(&times) {
            if let Some(j) = (self.my_slots.iter()).position(|&(r, dd)| r == me && dd == d) {
                mine[j] = *t;
            }
        }
        let gathered = self.world.all_gather_f64(&mine);
        Ok((0..self.host0.len())
            .map(|j| gathered[self.host0[j].0][j])
            .collect())
    }

    /// The job's sharing: per k, the slowdown averaged over the steps weighted by their time
    /// alone, and the curve over intensity (near-equal intensities merged).
    fn sharing(&self, rows: Vec<StepRow>) -> Option<ComputeSharing> {
        if self.most_slots < 2 {
            return None;
        }
        let weight: f64 = rows.iter().map(|r| r.t1_all).sum();
        let mut slowdown = vec![1.0];
        for k in 2..=self.most_slots {
            let sum: f64 = rows.iter().map(|r| r.t1_all * r.row[k]).sum();
            slowdown.push((sum / weight.max(f64::MIN_POSITIVE)).max(1.0));
        }
        let mut curve: Vec<Vec<f64>> = rows.into_iter().map(|r| r.row).collect();
        curve.sort_by(|a, b| a[0].total_cmp(&b[0]));
        curve.dedup_by(|b, a| b[0] <= a[0] * 1.02);
        Some(ComputeSharing {
            shared_by: self.most_slots as u32,
            slowdown,
            slowdown_curve: curve,
        })
    }
}

/// Throughput-equivalent slowdown of `k` devices at once taking `t` per repetition, against
/// `alone(j)` each (see `calibrate::sharing`).
fn slowdown(k: usize, t: &[f64], alone: impl Fn(usize) -> f64) -> f64 {
    let sum: f64 = (0..k.min(t.len()))
        .map(|j| alone(j) / t[j].max(f64::MIN_POSITIVE))
        .sum();
    (k as f64 / sum.max(f64::MIN_POSITIVE)).max(1.0)
}

/// Rank 0's log line of one step's sharing, and of what the waiting ranks' polling costs.
fn say_step_row(
    step: &Step,
    (row, curve_row, curves_ms): (&[f64], &[f64], f64),
    (alone_now, diag): (&[f64], &[f64]),
    log: &mut dyn Write,
) {
    let kind = if step.seq == 1 { "decode" } else { "prefill" };
    let list = |v: &[f64]| {
        v.iter()
            .map(|s| format!("{s:.2}"))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let _ = writeln!(
        log,
        "    {:<22} {:>9.2} {:>8.2}  {}   (against the curves' alone {:.2} ms: {})",
        format!("{kind} {}x{} (+{})", step.batch, step.seq, step.past),
        alone_now[0] * 1e3,
        row[0],
        list(&row[2..]),
        curves_ms,
        list(curve_row)
    );
    if let [fixed, asleep] = diag[..] {
        let polling = alone_now[0];
        let _ = writeln!(
            log,
            "      one busy, the others waiting: polling {:.2} ms ({:.3}x asleep), with sparser polling {:.2} ms ({:.3}x), asleep {:.2} ms",
            polling * 1e3,
            polling / asleep,
            fixed * 1e3,
            fixed / asleep,
            asleep * 1e3
        );
    }
}

/// MPI between ranks: ping-pong fits to a rank on rank 0's host and on another host, and how
/// late a waiting rank notices a message with each back-off.
struct MpiLinks {
    local: Option<AlphaBetaFit>,
    remote: Option<AlphaBetaFit>,
    lateness: Vec<(f64, f64)>,
}

impl MpiLinks {
    fn measure(world: &World, infos: &[RankInfo], options: &CalibrationOptions) -> Result<Self> {
        let local_peer = (1..infos.len()).find(|&r| infos[r].host == infos[0].host);
        let remote_peer = (1..infos.len()).find(|&r| infos[r].host != infos[0].host);
        let sizes: Vec<u64> = std::iter::successors(Some(256u64), |s| Some(s * 4))
            .take_while(|&s| s <= options.max_bytes)
            .collect();
        let fit = |peer: Option<usize>| -> Result<Option<AlphaBetaFit>> {
            match peer {
                Some(p) => ping_pong(world, p, &sizes, options.iters.max(5)),
                None => Ok(None),
            }
        };
        let (local, remote) = (fit(local_peer)?, fit(remote_peer)?);
        let mut lateness = Vec::new();
        if let Some(p) = local_peer {
            for backoff in [Backoff::RUNTIME, Backoff::SPARSE] {
                lateness.push(wake_lateness(world, p, backoff)?);
            }
        }
        Ok(Self {
            local,
            remote,
            lateness,
        })
    }

    fn say(&self, log: &mut dyn Write) {
        for (what, fit) in [
            ("on this host", &self.local),
            ("between hosts", &self.remote),
        ] {
            if let Some(f) = fit {
                let _ = writeln!(
                    log,
                    "MPI send between ranks {what}: alpha {:.1} us, beta {:.3} GB/s (R^2 {:.4}, ping-pong halves)",
                    f.alpha_us, f.beta_gbps, f.r_squared
                );
            }
        }
        if let [(new_ms, new_late), (old_ms, old_late)] = self.lateness[..] {
            let _ = writeln!(
                log,
                "a message after a {new_ms:.0} ms wait is noticed {new_late:.0} us late with the runtime's back-off, {old_late:.0} us with the sparser one (after {old_ms:.0} ms)"
            );
        }
    }
}

/// The profile's header: the job's ranks and devices, the MPI link on one host, and rank 0's
/// alone calibration's note.
fn job_note(
    infos: &[RankInfo],
    profile: &HostProfile,
    local: Option<&AlphaBetaFit>,
    base: &str,
) -> String {
    let devices: Vec<String> = (infos.iter().enumerate())
        .map(|(r, i)| format!("rank {r}: {}", i.labels.join(" + ")))
        .collect();
    let mut note = format!(
        "calibrated under mpirun: {} ranks on {} host(s); devices in rank order ({})",
        infos.len(),
        profile.nodes,
        devices.join("; ")
    );
    if let Some(f) = local {
        note.push_str(&format!(
            "\nMPI between ranks on one host (not costed by the projection): alpha {:.1} us, beta {:.3} GB/s",
            f.alpha_us, f.beta_gbps
        ));
    }
    note.push('\n');
    note.push_str(base);
    note
}

/// Runs `step` on the devices `busy` of this rank for `window` seconds, all ranks starting
/// together; a rank with nothing to run waits for the others with `idle`. Mean time of a
/// repetition per busy device, seconds.
fn busy_window(
    world: &World,
    models: &[Arc<GpuModel>],
    busy: &[usize],
    step: &Step,
    window: f64,
    idle: Backoff,
) -> Result<Vec<f64>> {
    // Warm the step's buffers up outside the window.
    for &d in busy {
        time_blocks(&models[d], step, true, 1)?;
    }
    world.barrier_with("sharing window start", ASLEEP, world.timeout())?;
    let until = Instant::now() + Duration::from_secs_f64(window);
    let times: Vec<Result<f64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = busy
            .iter()
            .map(|&d| {
                let m = &models[d];
                scope.spawn(move || sustained_block_time(m, step, until))
            })
            .collect();
        join_all(handles)
    });
    let times: Vec<f64> = times.into_iter().collect::<Result<_>>()?;
    // The waiting ranks poll here for the whole window; so does a rank whose devices are done.
    let slack = Duration::from_secs_f64(window) + world.timeout();
    world.barrier_with("sharing window end", idle, slack)?;
    Ok(times)
}

/// Ping-pong between rank 0 and `peer` over `sizes`: half the median round trip per size,
/// fitted to alpha-beta (on rank 0; `None` elsewhere and on a bad fit).
fn ping_pong(
    world: &World,
    peer: usize,
    sizes: &[u64],
    iters: usize,
) -> Result<Option<AlphaBetaFit>> {
    let me = world.rank();
    world.barrier_with("ping-pong start", ASLEEP, world.timeout())?;
    if me != 0 && me != peer {
        return Ok(None);
    }
    let other = if me == 0 { peer } else { 0 };
    let mut points = Vec::new();
    for &size in sizes {
        let mut buf = vec![1u8; size as usize];
        let mut rtts = Vec::new();
        for i in 0..=iters {
            let t = Instant::now();
            if me == 0 {
                send(world, other, &buf)?;
                receive(world, other, &mut buf, Backoff::RUNTIME)?;
            } else {
                receive(world, other, &mut buf, Backoff::RUNTIME)?;
                send(world, other, &buf)?;
            }
            if i > 0 {
                rtts.push(t.elapsed().as_secs_f64());
            }
        }
        if let Some(m) = median(rtts) {
            points.push((size, m / 2.0));
        }
    }
    if me != 0 {
        return Ok(None);
    }
    Ok(fit_alpha_beta(&points).ok())
}

/// How late a rank that has waited notices a message, with `backoff`: rank 0 sends after a
/// pause, `peer` answers at once; the round trip beyond the pause and the ping-pong's own
/// round trip is the lateness. Returns (pause ms, mean lateness us) on rank 0.
fn wake_lateness(world: &World, peer: usize, backoff: Backoff) -> Result<(f64, f64)> {
    let me = world.rank();
    world.barrier_with("lateness start", ASLEEP, world.timeout())?;
    if me != 0 && me != peer {
        return Ok((0.0, 0.0));
    }
    let other = if me == 0 { peer } else { 0 };
    let mut buf = vec![0u8; 64];
    let pause = Duration::from_millis(8);
    let rounds = 20;
    // A round trip with nobody waiting long: the baseline.
    let mut base = Vec::new();
    let mut late = Vec::new();
    for i in 0..2 * rounds {
        let long = i % 2 == 1;
        if me == 0 {
            if long {
                std::thread::sleep(pause);
            }
            let t = Instant::now();
            send(world, other, &buf)?;
            receive(world, other, &mut buf, Backoff::RUNTIME)?;
            let rtt = t.elapsed().as_secs_f64();
            if long {
                late.push(rtt);
            } else {
                base.push(rtt);
            }
        } else {
            receive(world, other, &mut buf, backoff)?;
            send(world, other, &buf)?;
        }
    }
    let b = median(base).unwrap_or(0.0);
    let l = late.iter().sum::<f64>() / late.len().max(1) as f64;
    Ok((pause.as_secs_f64() * 1e3, ((l - b) * 1e6).max(0.0)))
}

fn send(world: &World, to: usize, buf: &[u8]) -> Result<()> {
    super::link::send(
        world.p2p(),
        to,
        TAG_PING,
        buf.to_vec(),
        world.timeout(),
        &format!("calibration ping-pong to rank {to}"),
    )?;
    Ok(())
}

fn receive(world: &World, from: usize, buf: &mut [u8], backoff: Backoff) -> Result<()> {
    let msg = super::link::receive_with(
        world.p2p(),
        from,
        TAG_PING,
        world.timeout(),
        &format!("calibration ping-pong from rank {from}"),
        backoff,
    )?;
    if msg.len() != buf.len() {
        return Err(DistError::Protocol {
            peer: from,
            detail: format!("ping-pong of {} bytes, expected {}", msg.len(), buf.len()),
        }
        .into());
    }
    buf.copy_from_slice(&msg);
    Ok(())
}

/// The profile of the job: a node per host, each node's devices in rank order.
fn assemble(
    infos: &[RankInfo],
    source: &[usize],
    alone: &[Option<AloneResult>],
    sharing: Option<ComputeSharing>,
    network: Option<&AlphaBetaFit>,
    log: &mut dyn Write,
) -> Result<HostProfile> {
    let hosts = distinct(&infos.iter().map(|i| i.host.clone()).collect::<Vec<_>>());
    check_identical_nodes(infos, &hosts)?;
    let get = |r: usize| -> Result<&AloneResult> {
        alone[source[r]].as_ref().ok_or_else(|| {
            WgparError::Measurement(format!("rank {} sent no calibration", source[r]))
        })
    };
    // Node 0's devices: every rank of the first host, its groups expanded to single devices
    // then merged back where consecutive devices are the same.
    let mut groups: Vec<DeviceSpec> = Vec::new();
    for r in (0..infos.len()).filter(|&r| infos[r].host == hosts[0]) {
        let p = &get(r)?.profile;
        for g in &p.devices {
            match groups.last_mut() {
                Some(last) if same_device(last, g) => last.count += g.count,
                _ => groups.push(g.clone()),
            }
        }
    }
    apply_sharing(&mut groups, sharing, log);
    let base = &get(0)?.profile;
    let network = network_link(hosts.len(), network)?;
    let profile = HostProfile {
        name: base.name.clone(),
        description: format!(
            "{} ranks under mpirun on {} host(s): {}",
            infos.len(),
            hosts.len(),
            base.description
        ),
        nodes: hosts.len() as u32,
        host: base.host.clone(),
        devices: groups,
        device_link: None,
        network,
    };
    profile.validate()?;
    Ok(profile)
}

/// Refuses hosts whose devices differ: a profile describes identical nodes.
fn check_identical_nodes(infos: &[RankInfo], hosts: &[String]) -> Result<()> {
    let node_labels = |h: &str| -> Vec<String> {
        infos
            .iter()
            .filter(|i| i.host == h)
            .flat_map(|i| i.labels.clone())
            .collect()
    };
    let first = node_labels(&hosts[0]);
    for h in &hosts[1..] {
        let other = node_labels(h);
        if other != first {
            return Err(DistError::Layout(format!(
                "a profile describes identical nodes, but host {} has devices [{}] and host {h} has [{}]: calibrate each kind of node on its own",
                hosts[0],
                first.join(", "),
                other.join(", ")
            ))
            .into());
        }
    }
    Ok(())
}

/// Puts the sharing measured between processes on the node's one device group, when the
/// node is one group; otherwise drops every group's sharing that claims more devices than
/// the group has.
fn apply_sharing(groups: &mut [DeviceSpec], sharing: Option<ComputeSharing>, log: &mut dyn Write) {
    let node_devices: u32 = groups.iter().map(|g| g.count).sum();
    if let Some(s) = sharing {
        if groups.len() == 1 && s.shared_by == node_devices {
            groups[0].compute_sharing = Some(s);
            return;
        }
        // The format pools sharing inside one group; devices of different adapters on
        // one host cannot say how they slow each other.
        let _ = writeln!(
            log,
            "note: the host's devices are not all the same adapter; the sharing between processes measured above is not in the profile (each group keeps its own)"
        );
    }
    // Without a measurement, ranks with one device each on separate hosts share nothing.
    for g in groups.iter_mut() {
        if g.compute_sharing
            .as_ref()
            .is_some_and(|c| c.shared_by > g.count)
        {
            g.compute_sharing = None;
        }
    }
}

/// The link between hosts: none on one host, else the ping-pong's alpha-beta fit.
fn network_link(hosts: usize, network: Option<&AlphaBetaFit>) -> Result<Option<NamedLink>> {
    match (hosts, network) {
        (1, _) => Ok(None),
        (_, Some(f)) => Ok(Some(NamedLink {
            name: "MPI between hosts (measured ping-pong)".into(),
            alpha_us: f.alpha_us.max(0.1),
            beta_gbps: f.beta_gbps,
            nvls: false,
            nics_per_node: None,
        })),
        (_, None) => Err(WgparError::Measurement(
            "the ping-pong between hosts gave no alpha-beta fit".into(),
        )),
    }
}

/// Whether two device groups describe the same device (all but count and sharing equal).
fn same_device(a: &DeviceSpec, b: &DeviceSpec) -> bool {
    let strip = |d: &DeviceSpec| DeviceSpec {
        count: 1,
        compute_sharing: None,
        ..d.clone()
    };
    strip(a) == strip(b)
}

/// A host's devices as (rank, local device), round-robin over its ranks: the first two are
/// on two processes when the host runs two or more ranks.
fn slots(infos: &[RankInfo], host: &str) -> Vec<(usize, usize)> {
    let ranks: Vec<usize> = (0..infos.len())
        .filter(|&r| infos[r].host == host)
        .collect();
    let most = ranks
        .iter()
        .map(|&r| infos[r].labels.len())
        .max()
        .unwrap_or(0);
    let mut out = Vec::new();
    for d in 0..most {
        for &r in &ranks {
            if d < infos[r].labels.len() {
                out.push((r, d));
            }
        }
    }
    out
}

fn distinct(list: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for h in list {
        if !out.contains(h) {
            out.push(h.clone());
        }
    }
    out
}

/// Whole-layer times per device of a rank from its adapter groups' block times.
fn per_device_times(groups: &[Vec<(Step, f64)>], devices: usize) -> Vec<Vec<(Step, f64)>> {
    // Devices of one adapter group share their group's measurement; `calibrate` groups runs
    // of devices on one adapter, which under mpirun is one group per rank in practice.
    let first = groups.first().cloned().unwrap_or_default();
    (0..devices)
        .map(|d| groups.get(d).cloned().unwrap_or_else(|| first.clone()))
        .collect()
}

fn lookup(times: &[(Step, f64)], step: &Step) -> f64 {
    times
        .iter()
        .find(|(s, _)| s == step)
        .map_or(0.0, |(_, t)| *t)
}

fn encode_alone(c: &Calibration, log: &str) -> Result<String> {
    let times: Vec<Vec<[f64; 4]>> = c
        .block_times
        .iter()
        .map(|g| {
            g.iter()
                .map(|(s, t)| [s.batch as f64, s.seq as f64, s.past as f64, *t])
                .collect()
        })
        .collect();
    let v = serde_json::json!({
        "profile": c.profile.to_toml_string()?,
        "note": c.note,
        "log": log,
        "block_times": times,
    });
    Ok(v.to_string())
}

fn decode_alone(text: &str, rank: usize) -> Result<AloneResult> {
    let bad = |detail: String| -> WgparError { DistError::Protocol { peer: rank, detail }.into() };
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("calibration result: {e}")))?;
    let field = |k: &str| {
        v[k].as_str()
            .map(str::to_string)
            .ok_or_else(|| bad(format!("no {k}")))
    };
    let profile = HostProfile::from_toml_str(&field("profile")?, &format!("rank {rank}"))?;
    let times: Vec<Vec<[f64; 4]>> = serde_json::from_value(v["block_times"].clone())
        .map_err(|e| bad(format!("block times: {e}")))?;
    Ok(AloneResult {
        profile,
        note: field("note")?,
        log: field("log")?,
        block_times: times
            .into_iter()
            .map(|g| {
                g.into_iter()
                    .map(|[b, s, p, t]| {
                        (
                            Step {
                                batch: b as usize,
                                seq: s as usize,
                                past: p as usize,
                            },
                            t,
                        )
                    })
                    .collect()
            })
            .collect(),
    })
}
