//! Calibration: measure this machine and describe it as a host profile (`wgpar calibrate`).
//!
//! What is measured, and why this way:
//! - host links (`links.rs`): device->host, host->device and device->host->device copies
//!   through the comm layer's staging path (what the engines use), over a size sweep, fitted
//!   to `t = alpha + bytes / beta` by `sim::fit_alpha_beta`; the host reduction rate from the
//!   reduce phase of real host-staged all-reduces; the fixed cost of an all-reduce through the
//!   rank-per-thread communicator as the tensor-parallel engine meets it;
//! - the host cost of a submission (`blocks::dispatch_costs`): submissions of the model's own
//!   layers at a width of 16 on one token (an empty pass, then 1 to 8 layers), each with its
//!   wait, fitted to `submit + n x launch` (`submit_overhead_us` and `launch_overhead_us`):
//!   every engine span is one submission, so a step of a small model pays these fixed costs
//!   in full while its arithmetic is short;
//! - kernels at the model's own shapes (`kernels.rs`): matmul GFLOP/s, attention (over the
//!   whole context, and over a sliding-window layer's window where the model has one) and
//!   element-wise GB/s (the element-wise rate goes into the profile);
//! - the model's blocks (`blocks.rs`: attention half, whole decoder layer) at decode and
//!   prefill steps of the run's shapes, net of dispatch costs: the achieved rate as a function
//!   of arithmetic intensity (`attention_curve`, `matmul_curve`). The times are measured (a
//!   sliding layer's kernel skips the keys before its window); the work they are divided by
//!   is the engines' span accounting (`blocks::StackWork`), a sliding layer charged its
//!   window's keys, so the rate prices the spans the projection reads. Engines record a whole
//!   forward pass or layer half as one span, so the rate that predicts such a span is the rate
//!   of that block, not of a bare matmul. The same blocks are measured at a half and a sixth
//!   of the model's width too (`blocks::narrow_widths`), and at twice it with fewer layers
//!   (`blocks::wide_config`): at equal intensity a narrow block runs slower (fewer workgroups
//!   per dispatch), so the rate is kept as a surface over intensity and block width
//!   (`attention_surface`, `matmul_surface`, with `*_surface_widths`), which projects a model
//!   of another width, or a tensor-parallel shard, from the block widths around it;
//! - the model's final norm and LM head alone at each batch size (`blocks::head_curve`):
//!   one large matrix over the vocabulary, which does not run at a block's rate
//!   (`head_curve`, used for the head part that spans record);
//! - devices on one adapter (`--virtual N`) share its processor (`sharing.rs`): the slowdown of
//!   k = 2..N of them computing at once, per step shape, written as `compute_sharing`.
//!
//! Every figure is written to a log as it is measured (the CLI passes standard output).

use std::io::Write;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::comm::{Collectives, CommConfig};
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{GpuModel, ModelConfig, ModelWeights, Placement, Step};
use crate::sim::{
    calibrated_profile, AlphaBetaFit, ComputeSharing, HostProfile, MachineMeasurement,
    MeasuredDevice,
};
use crate::stats::median;

/// Writes a line to the calibration log. A log that cannot be written (a closed pipe) must
/// not stop a measurement, so write errors are dropped.
macro_rules! say {
    ($log:expr) => {
        let _ = writeln!($log);
    };
    ($log:expr, $($arg:tt)*) => {
        let _ = writeln!($log, $($arg)*);
    };
}

/// Writes part of a line to the calibration log (see `say!`).
macro_rules! say_part {
    ($log:expr, $($arg:tt)*) => {
        let _ = write!($log, $($arg)*);
    };
}

pub(crate) mod blocks;
mod kernels;
mod links;
pub(crate) mod sharing;

/// What to calibrate for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalibrationOptions {
    /// Largest batch of the runs to project (steps of 1, 2, 4, ... sequences are measured).
    pub batch: usize,
    /// Prompt length of the runs to project (prefill steps; decode steps attend to it).
    pub prompt_len: usize,
    /// Largest copy of the link sweep, bytes (sizes grow by 4 from 256 bytes).
    pub max_bytes: u64,
    /// Timed repetitions per point (the median is used).
    pub iters: usize,
    /// A fast, rough calibration: two batch sizes and shorter sharing windows (the caller
    /// chooses the smaller `max_bytes` and `iters` that go with it).
    pub quick: bool,
    /// Name of the profile.
    pub name: String,
}

/// A calibrated profile and the note its file header carries (date, driver, shapes, the
/// device->host->device fit).
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The profile of this machine.
    pub profile: HostProfile,
    /// Lines for the header of the profile file.
    pub note: String,
    /// Time of the model's whole layers alone at each measured step, seconds, per adapter
    /// group in device order (what the rate curves were fitted from): a measurement of sharing
    /// made elsewhere (between MPI ranks) compares against the same alone run.
    pub block_times: Vec<Vec<(Step, f64)>>,
}

/// Measures `gpus` (devices on one adapter are measured once, as a group that shares a
/// processor) at the shapes of `weights`' model and returns the profile. Progress and every
/// measured figure go to `log`.
pub fn calibrate(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    options: &CalibrationOptions,
    log: &mut dyn Write,
) -> Result<Calibration> {
    let config = &weights.config;
    let sizes = checked_sizes(gpus, config, options)?;
    let date = utc_date();
    let host_name = cpu_name();
    say_devices(gpus, (&host_name, &date), log)?;
    let coll = Collectives::new(CommConfig::default())?;
    let steps = blocks::block_steps(options.batch, options.prompt_len, options.quick, config);
    let mut tokens: Vec<usize> = steps.iter().map(Step::tokens).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let sweep = Sweep {
        weights,
        options,
        coll: &coll,
        sizes: &sizes,
        steps: &steps,
        tokens: &tokens,
    };
    let mut measured = Vec::new();
    let mut block_times = Vec::new();
    for group in adapter_groups(gpus) {
        let (device, alone_s) = sweep.measure_group(&group, log)?;
        measured.push(device);
        block_times.push(alone_s);
    }
    let (bounce, host_reduce) = sweep.between_devices(gpus, log)?;
    let mut machine = MachineMeasurement {
        name: options.name.clone(),
        description: format!(
            "this machine as calibrated on {date}: {} device(s), {}",
            gpus.len(),
            gpus[0].info().label()
        ),
        host_name,
        host_reduce_gbps: host_reduce,
        collective_overhead_us: Vec::new(),
        devices: measured,
    };
    if gpus.len() > 1 {
        machine.collective_overhead_us = collective_overheads(gpus, &machine, options, log)?;
    }
    let profile = calibrated_profile(&machine)?;
    let note = format!(
        "{date}, wgpar {}; driver {} {}\nkernel rates at model {} shapes, batch up to {}, prompt {}\n\
         device->host->device fit: alpha {:.1} us, beta {:.3} GB/s (R^2 {:.4})",
        env!("CARGO_PKG_VERSION"),
        gpus[0].info().driver,
        gpus[0].info().driver_info,
        config.name,
        options.batch,
        options.prompt_len,
        bounce.alpha_us,
        bounce.beta_gbps,
        bounce.r_squared
    );
    Ok(Calibration {
        profile,
        note,
        block_times,
    })
}

/// The options checked against the devices and the model; the link sweep's sizes (from 256
/// bytes, times 4, up to `--max-bytes`).
fn checked_sizes(
    gpus: &[Arc<Gpu>],
    config: &ModelConfig,
    options: &CalibrationOptions,
) -> Result<Vec<u64>> {
    let (batch, prompt_len, iters) = (options.batch, options.prompt_len, options.iters);
    if gpus.is_empty() {
        return Err(WgparError::TooFew {
            what: "devices to calibrate".into(),
            got: 0,
            min: 1,
        });
    }
    if iters == 0 || batch == 0 || prompt_len == 0 {
        return Err(WgparError::option(
            "--iters",
            "--iters, --batch and --prompt-len must be positive".into(),
        ));
    }
    if prompt_len + 1 > config.max_seq {
        return Err(WgparError::limit(
            "context (tokens)",
            ((prompt_len + 1) as u64, config.max_seq as u64),
            format!(
                "--prompt-len {prompt_len} leaves no room to decode in max_seq {} of model '{}'",
                config.max_seq, config.name
            ),
        ));
    }
    let max_bytes = options.max_bytes;
    let sizes: Vec<u64> = std::iter::successors(Some(256u64), |s| Some(s * 4))
        .take_while(|&s| s <= max_bytes)
        .collect();
    if sizes.len() < 2 {
        return Err(WgparError::option(
            "--max-bytes",
            format!(
            "--max-bytes {max_bytes} leaves fewer than two sizes (the sweep starts at 256 bytes)"
        ),
        ));
    }
    Ok(sizes)
}

/// The header of the log: the devices and their drivers.
fn say_devices(
    gpus: &[Arc<Gpu>],
    (host_name, date): (&str, &str),
    log: &mut dyn Write,
) -> Result<()> {
    say!(
        log,
        "calibrating {} device(s) on {host_name}, {date}",
        gpus.len()
    );
    for g in gpus {
        say!(
            log,
            "  {}: driver {} {}",
            g.describe(),
            g.info().driver,
            g.info().driver_info
        );
    }
    Ok(())
}

/// The fixed cost of one host-staged collective for 2..=N devices.
fn collective_overheads(
    gpus: &[Arc<Gpu>],
    machine: &MachineMeasurement,
    options: &CalibrationOptions,
    log: &mut dyn Write,
) -> Result<Vec<f64>> {
    let base = calibrated_profile(machine)?;
    let overheads = links::collective_overheads(gpus, &base, options.iters.max(9), log)?;
    let list: Vec<String> = (overheads.iter().enumerate())
        .map(|(i, o)| format!("{} devices {o:.1} us", i + 2))
        .collect();
    say!(
        log,
        "  fixed cost per host-staged collective: {}",
        list.join(", ")
    );
    Ok(overheads)
}

/// What every adapter group's measurement shares: the model, the options, and the sizes,
/// steps and token counts swept.
struct Sweep<'a> {
    weights: &'a ModelWeights,
    options: &'a CalibrationOptions,
    coll: &'a Collectives,
    sizes: &'a [u64],
    steps: &'a [Step],
    tokens: &'a [usize],
}

/// A model's rate curve and its surface over widths, as measured for one adapter.
struct Surfaces {
    attention: Vec<Vec<[f64; 3]>>,
    matmul: Vec<Vec<[f64; 3]>>,
    widths: Vec<f64>,
}

impl Sweep<'_> {
    /// Links, kernels, blocks and (for several devices on one adapter) the shared processor
    /// of one adapter group; also the whole layers' time alone at each step.
    fn measure_group(
        &self,
        group: &[Arc<Gpu>],
        log: &mut dyn Write,
    ) -> Result<(MeasuredDevice, Vec<(Step, f64)>)> {
        let (config, iters) = (&self.weights.config, self.options.iters);
        let gpu = &group[0];
        say!(log);
        say!(
            log,
            "# {} (stands for {} device(s))",
            gpu.describe(),
            group.len()
        );
        let (h2d, d2h) = self.host_links(gpu, log)?;
        say!(
            log,
            "kernels at the shapes of model {} (median of {iters}):",
            config.name
        );
        let least_model = synthetic_model(gpu, &blocks::dispatch_config(config))?;
        let dispatch = blocks::dispatch_costs(&least_model, iters, log)?;
        drop(least_model);
        say!(
            log,
            "  fitted: {:.1} us per submission and its wait + {:.1} us per dispatch",
            dispatch.submit_us,
            dispatch.launch_us
        );
        let prompt_len = self.options.prompt_len;
        let elementwise_gbps =
            kernels::kernel_rates(gpu, config, self.tokens, prompt_len, iters, log)?;
        let model = Arc::new(GpuModel::upload(
            gpu.clone(),
            self.weights,
            Placement::whole(config),
            DType::F32,
        )?);
        let measured_blocks = blocks::block_curves(&model, self.steps, dispatch, iters, log)?;
        let head_curve = blocks::head_curve(&model, self.steps, dispatch, iters, log)?;
        let surfaces = self.surfaces(gpu, &measured_blocks, dispatch, log)?;
        let alone_s = measured_blocks.alone_s.clone();
        let compute_sharing = self.sharing(group, model, &alone_s, log)?;
        let attention_curve = blocks::curve(measured_blocks.attention);
        let matmul_curve = blocks::curve(measured_blocks.layers);
        let plateau = |c: &[[f64; 2]]| c.last().map_or(0.0, |p| p[1]);
        let device = MeasuredDevice {
            name: gpu.info().label(),
            count: group.len() as u32,
            memory_bytes: memory_bytes(gpu),
            h2d,
            d2h,
            matmul_gflops: plateau(&matmul_curve),
            matmul_f16_gflops: None,
            attention_gflops: Some(plateau(&attention_curve)),
            elementwise_gbps,
            launch_overhead_us: dispatch.launch_us,
            submit_overhead_us: dispatch.submit_us,
            matmul_curve,
            attention_curve,
            matmul_surface: surfaces.matmul,
            attention_surface: surfaces.attention,
            surface_widths: surfaces.widths,
            head_curve,
            compute_sharing,
        };
        Ok((device, alone_s))
    }

    /// Host-to-device and device-to-host fits from a sweep of sizes.
    fn host_links(
        &self,
        gpu: &Arc<Gpu>,
        log: &mut dyn Write,
    ) -> Result<(AlphaBetaFit, AlphaBetaFit)> {
        let (sizes, iters) = (self.sizes, self.options.iters);
        say!(
            log,
            "host links (size sweep {} B .. {} B, median of {iters}):",
            sizes[0],
            self.options.max_bytes
        );
        let (d2h_pts, h2d_pts) = links::link_sweeps(self.coll, gpu, sizes, iters)?;
        say!(log, "  {:>10} {:>12} {:>12}", "bytes", "d2h us", "h2d us");
        for (d, h) in d2h_pts.iter().zip(&h2d_pts) {
            say!(log, "  {:>10} {:>12.1} {:>12.1}", d.0, d.1 * 1e6, h.1 * 1e6);
        }
        let d2h = links::fit_link("device->host", &d2h_pts, log)?;
        let h2d = links::fit_link("host->device", &h2d_pts, log)?;
        links::print_fit("device->host", &d2h, log);
        links::print_fit("host->device", &h2d, log);
        Ok((h2d, d2h))
    }

    /// The model's blocks' rate surfaces: its own width, then wider and narrower ones.
    fn surfaces(
        &self,
        gpu: &Arc<Gpu>,
        own: &blocks::BlockCurves,
        dispatch: blocks::DispatchCosts,
        log: &mut dyn Write,
    ) -> Result<Surfaces> {
        let config = &self.weights.config;
        let mut s = Surfaces {
            attention: vec![blocks::surface_curve(own.attention.clone())],
            matmul: vec![blocks::surface_curve(own.layers.clone())],
            widths: vec![config.hidden as f64],
        };
        let other_widths = blocks::wide_config(config).into_iter().chain(
            blocks::narrow_widths(config)
                .into_iter()
                .filter_map(|w| blocks::config_at_width(config, w)),
        );
        for other in other_widths {
            say!(
                log,
                "  the same blocks {} wide ({} heads of {}, {} key/value heads, MLP {}):",
                other.hidden,
                other.heads,
                other.head_dim,
                other.kv_heads,
                other.ffn
            );
            let other_model = synthetic_model(gpu, &other)?;
            let b =
                blocks::block_curves(&other_model, self.steps, dispatch, self.options.iters, log)?;
            s.attention.push(blocks::surface_curve(b.attention));
            s.matmul.push(blocks::surface_curve(b.layers));
            s.widths.push(other.hidden as f64);
        }
        Ok(s)
    }

    /// How devices on one adapter slow each other (none for a group of one).
    fn sharing(
        &self,
        group: &[Arc<Gpu>],
        model: Arc<GpuModel>,
        alone_s: &[(Step, f64)],
        log: &mut dyn Write,
    ) -> Result<Option<ComputeSharing>> {
        if group.len() < 2 {
            return Ok(None);
        }
        let (options, config) = (self.options, &self.weights.config);
        say!(
            log,
            "shared processor ({} devices on one adapter):",
            group.len()
        );
        let mut models = vec![model];
        for g in &group[1..] {
            models.push(Arc::new(GpuModel::upload(
                g.clone(),
                self.weights,
                Placement::whole(config),
                DType::F32,
            )?));
        }
        let shapes =
            sharing::sharing_steps(options.batch, options.prompt_len, options.quick, config);
        let window = if options.quick { 0.3 } else { 1.0 };
        Ok(Some(sharing::sharing_slowdown(
            &models, &shapes, window, alone_s, log,
        )?))
    }

    /// The device-to-host-to-device fit between the first two devices (or the one), and the
    /// host's reduce rate.
    fn between_devices(
        &self,
        gpus: &[Arc<Gpu>],
        log: &mut dyn Write,
    ) -> Result<(AlphaBetaFit, f64)> {
        let (sizes, iters) = (self.sizes, self.options.iters);
        say!(log);
        say!(log, "between devices:");
        let b = gpus.get(1).unwrap_or(&gpus[0]);
        let bounce_pts = links::bounce_sweep(self.coll, &gpus[0], b, sizes, iters)?;
        let bounce = links::fit_link("device->host->device", &bounce_pts, log)?;
        links::print_fit("dev->host->dev", &bounce, log);
        let host_reduce = if gpus.len() > 1 {
            links::host_reduce_gbps(gpus, sizes, iters, log)?
        } else {
            let r = links::host_sum_gbps(iters)?;
            say!(
                log,
                "  one device: host summing two 16 MiB buffers: {r:.2} GB/s"
            );
            r
        };
        say!(
            log,
            "  host reduce rate: {host_reduce:.2} GB/s (bytes read plus written)"
        );
        Ok((bounce, host_reduce))
    }
}

/// A model of shape `c` with synthetic weights, whole on `gpu` in f32: the blocks the
/// calibration times at shapes other than the calibrated model's.
fn synthetic_model(gpu: &Arc<Gpu>, c: &ModelConfig) -> Result<GpuModel> {
    GpuModel::upload(
        gpu.clone(),
        &ModelWeights::synthetic(c, 1),
        Placement::whole(c),
        DType::F32,
    )
}

/// Median of timed repetitions after one untimed warm-up, seconds.
pub(crate) fn median_time(iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        f()?;
        v.push(t.elapsed().as_secs_f64());
    }
    median(v).ok_or_else(|| WgparError::Measurement("no timed repetitions".into()))
}

pub(crate) fn random(len: usize, seed: u32) -> Vec<f32> {
    // Deterministic, non-trivial values (timing must not see zeros).
    (0..len as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) >> 9) % 2000)
        .map(|h| h as f32 / 1000.0 - 1.0)
        .collect()
}

/// Joins calibration threads in order; a thread that panicked becomes an error.
pub(crate) fn join_all<T>(
    handles: Vec<std::thread::ScopedJoinHandle<'_, Result<T>>>,
) -> Vec<Result<T>> {
    handles
        .into_iter()
        .map(|h| {
            h.join().unwrap_or_else(|_| {
                Err(WgparError::WorkerPanicked {
                    worker: "calibration thread".into(),
                    message: "while measuring".into(),
                })
            })
        })
        .collect()
}

fn cpu_name() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = text
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!(
        "{}, {cores} hardware threads",
        model.unwrap_or_else(|| "unknown CPU".into())
    )
}

/// Device memory: wgpu does not report it. A CPU driver's memory is the host's; otherwise the
/// largest buffer the adapter allows, a lower bound.
fn memory_bytes(gpu: &Gpu) -> u64 {
    if gpu.info().is_cpu() {
        let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = text
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
        if let Some(k) = kib {
            return k * 1024;
        }
    }
    gpu.info().max_buffer_size.max(1)
}

/// Today's UTC date, `YYYY-MM-DD` (civil-from-days, proleptic Gregorian).
fn utc_date() -> String {
    let days = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// Devices that sit on the same adapter, in runs of consecutive device indices.
fn adapter_groups(gpus: &[Arc<Gpu>]) -> Vec<Vec<Arc<Gpu>>> {
    let mut groups: Vec<Vec<Arc<Gpu>>> = Vec::new();
    for g in gpus {
        match groups.last_mut() {
            Some(last) if last[0].info().index == g.info().index => last.push(g.clone()),
            _ => groups.push(vec![g.clone()]),
        }
    }
    groups
}
