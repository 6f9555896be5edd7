//! Per-adapter autotuning of kernel variants, in the manner of cubecl's autotune: for each
//! (op, shape class, weight type) the candidate variants are timed on first use on an adapter
//! and the fastest is kept, in memory and in a cache file keyed by adapter name, driver, wgpar
//! version and shape class, so the next process on that adapter does not time them again.
//!
//! Switches (read once per process; `configure` sets them from a CLI):
//! - `WGPAR_TUNE=auto` (default: use the cache, time on first use when it has no entry),
//!   `off` (no timing: the fixed default of [`variants::default_matmul`], for reproducible
//!   runs) or `retune` (time again and overwrite the cached choices).
//! - `WGPAR_KERNELS=name,...`: force variants; each op takes the first listed variant that
//!   applies to its shape (others tune as usual). Names: `wgpar bench kernels` lists them;
//!   the quantized matmul's are `qgemv64_TYPE`, `qgemv128_TYPE`, `qgemm_TYPE` and the
//!   block-wise GEMVs `qgvTPRwWGrNR_TYPE` and `qgvsgWGrNR_TYPE` ([`super::quant::QUANT_VARIANTS`]),
//!   integer-dot `qdp4gemv64_TYPE`, `qdp4gemv128_TYPE` and the two-part `qdp4x2gemv64_TYPE`,
//!   `qdp4x2gemv128_TYPE` (refused, with the reason, on an adapter without native integer
//!   dot products: [`super::quant_dp4::offered`]).
//! - `WGPAR_CACHE_DIR=dir`: the cache folder (default `$XDG_CACHE_HOME/wgpar`, else
//!   `$HOME/.cache/wgpar`); `WGPAR_CACHE_DIR=` (empty) keeps choices in memory only.
//! - `WGPAR_NO_SUBGROUPS=1`: never choose subgroup variants.
//!
//! Every candidate computes the same result within tolerance (the kernel tests run all of
//! them against the CPU reference), so a choice changes speed, not output beyond rounding.
//! Timing happens where a shape is first used: a benchmark must warm up before its timed
//! region (as `compare` and `bench pipeline` do) or run with `WGPAR_TUNE=off`, so tuning
//! stays out of its measurement.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::variants::{self, Class, MatmulClass, Op, Variant};
use super::WeightType;
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};

/// What happens when a shape class has no choice yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TuneMode {
    /// Use the cached choice, time the candidates when there is none.
    Auto,
    /// Never time: the fixed default variant.
    Off,
    /// Time again, ignoring and then overwriting cached choices.
    Retune,
}

/// Tuning settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TuneSettings {
    /// Mode.
    pub mode: TuneMode,
    /// Forced variant names, in order of preference.
    pub forced: Vec<String>,
    /// Cache folder; `None` keeps choices in memory only.
    pub cache_dir: Option<PathBuf>,
}

fn bad(name: &str, value: &str, expected: String) -> WgparError {
    WgparError::TuneSetting {
        name: name.into(),
        value: value.into(),
        expected,
    }
}

impl TuneSettings {
    /// Settings from the environment (see the module docs); an unknown mode or variant name
    /// is an error.
    pub fn from_env() -> Result<Self> {
        let mode = match std::env::var("WGPAR_TUNE").ok().as_deref() {
            None | Some("") | Some("auto") => TuneMode::Auto,
            Some("off") | Some("0") => TuneMode::Off,
            Some("retune") => TuneMode::Retune,
            Some(other) => {
                return Err(bad("WGPAR_TUNE", other, "auto, off or retune".into()));
            }
        };
        let forced = match std::env::var("WGPAR_KERNELS") {
            Ok(list) => parse_forced("WGPAR_KERNELS", &list)?,
            Err(_) => Vec::new(),
        };
        let cache_dir = match std::env::var_os("WGPAR_CACHE_DIR") {
            Some(dir) if dir.is_empty() => None,
            Some(dir) => Some(PathBuf::from(dir)),
            None => std::env::var_os("XDG_CACHE_HOME")
                .filter(|d| !d.is_empty())
                .map(|d| PathBuf::from(d).join("wgpar"))
                .or_else(|| {
                    std::env::var_os("HOME")
                        .filter(|d| !d.is_empty())
                        .map(|h| PathBuf::from(h).join(".cache").join("wgpar"))
                }),
        };
        Ok(Self {
            mode,
            forced,
            cache_dir,
        })
    }
}

/// Parses a comma-separated list of variant names (`what` names the setting in errors).
pub fn parse_forced(what: &str, list: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let quant = super::quant::variant_by_name(name).is_some();
        if variants::by_name(name).is_none() && !quant {
            let mut names = variants::names();
            names.extend(super::quant::QUANT_VARIANTS.iter().map(|v| v.name));
            names.extend(super::quant_dp4::DP4_VARIANTS.iter().map(|v| v.name));
            return Err(bad(
                what,
                name,
                format!("a kernel variant: {}", names.join(", ")),
            ));
        }
        out.push(name.to_string());
    }
    Ok(out)
}

static SETTINGS: OnceLock<Mutex<Option<TuneSettings>>> = OnceLock::new();

fn settings_slot() -> &'static Mutex<Option<TuneSettings>> {
    SETTINGS.get_or_init(|| Mutex::new(None))
}

/// Replaces the process's tuning settings (a CLI flag does this before any kernel runs).
/// Choices already made on open devices stay.
pub fn configure(settings: TuneSettings) {
    let mut slot = match settings_slot().lock() {
        Ok(s) => s,
        Err(p) => p.into_inner(),
    };
    *slot = Some(settings);
}

/// The process's tuning settings (from the environment unless [`configure`]d).
pub fn settings() -> Result<TuneSettings> {
    let mut slot = match settings_slot().lock() {
        Ok(s) => s,
        Err(p) => p.into_inner(),
    };
    if let Some(s) = slot.as_ref() {
        return Ok(s.clone());
    }
    let s = TuneSettings::from_env()?;
    *slot = Some(s.clone());
    Ok(s)
}

/// One cached choice.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CacheEntry {
    variant: String,
    /// Median ms of every candidate timed, for the curious.
    #[serde(default)]
    times_ms: BTreeMap<String, f64>,
    /// When it was saved (seconds since the Unix epoch; 0 in files from before it was kept):
    /// the oldest entries go first when the file is full.
    #[serde(default)]
    saved_s: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct CacheFile {
    entries: BTreeMap<String, CacheEntry>,
}

/// The cache file's name inside the cache folder.
pub const CACHE_FILE: &str = "tune.json";

/// A cache file larger than this is not read (it is only a cache: it is replaced at the next
/// save). Its entries are a few hundred bytes, so [`MAX_CACHE_ENTRIES`] of them fit.
pub const MAX_CACHE_BYTES: u64 = 4 << 20;

/// Entries kept in the file; past it the oldest are dropped at a save.
pub const MAX_CACHE_ENTRIES: usize = 4096;

/// A temporary file of a save older than this was left by a process that died mid-save (a
/// save takes milliseconds): the next save removes it.
const ORPHAN_AGE_S: u64 = 60;

/// Choices of this process, by full key (adapter + class); loaded from the file on first use.
struct Memory {
    loaded_from: Option<PathBuf>,
    file: CacheFile,
    /// A save failed in this process: later choices stay in memory, and the warning was
    /// printed once.
    save_failed: bool,
}

static MEMORY: OnceLock<Mutex<Memory>> = OnceLock::new();

fn memory() -> std::sync::MutexGuard<'static, Memory> {
    let m = MEMORY.get_or_init(|| {
        Mutex::new(Memory {
            loaded_from: None,
            file: CacheFile::default(),
            save_failed: false,
        })
    });
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn read_cache(path: &Path) -> CacheFile {
    // An unreadable, corrupt or oversized cache is no error: it is only a cache, and the
    // choices are timed again (and the file rewritten) on first use.
    let small = std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() <= MAX_CACHE_BYTES);
    if !small {
        return CacheFile::default();
    }
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The build part of a cache key: wgpar's version and a digest of every kernel variant's name
/// (and whether it is a tuning candidate). A binary whose candidates differ from those a
/// choice was made among (a variant added, dropped or renamed) times again rather than keep a
/// choice that never saw the new ones.
pub fn build_tag() -> &'static str {
    static TAG: OnceLock<String> = OnceLock::new();
    TAG.get_or_init(|| {
        let dense = (variants::MATMUL.iter())
            .chain(variants::ATTENTION)
            .map(|v| (v.name, v.candidate));
        let packed = (super::quant::QUANT_VARIANTS.iter())
            .chain(super::quant::QUANT_EMBED_VARIANTS)
            .chain(super::quant_dp4::DP4_VARIANTS)
            .map(|v| (v.name, true));
        // FNV-1a: stable across toolchains, unlike std's hasher.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (name, candidate) in dense.chain(packed) {
            for b in name.bytes().chain([u8::from(candidate), 0]) {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        format!("{}+k{h:016x}", env!("CARGO_PKG_VERSION"))
    })
}

/// Drops what no later run can use: entries of other wgpar builds (their keys name the
/// version and the kernel set, [`build_tag`]), then the oldest beyond [`MAX_CACHE_ENTRIES`].
fn prune(file: &mut CacheFile) {
    let version = format!("| wgpar {} |", build_tag());
    file.entries.retain(|k, _| k.contains(&version));
    let excess = file.entries.len().saturating_sub(MAX_CACHE_ENTRIES);
    if excess > 0 {
        let mut by_age: Vec<(u64, String)> = file
            .entries
            .iter()
            .map(|(k, e)| (e.saved_s, k.clone()))
            .collect();
        by_age.sort();
        for (_, k) in by_age.into_iter().take(excess) {
            file.entries.remove(&k);
        }
    }
}

/// Removes temporary files of saves that never finished (a process killed mid-save).
fn remove_orphans(dir: &Path) {
    let Ok(list) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!("{CACHE_FILE}.");
    for entry in list.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age.as_secs() > ORPHAN_AGE_S);
        if name.starts_with(&prefix) && name.ends_with(".tmp") && old {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn write_cache(dir: &Path, file: &CacheFile) -> Result<()> {
    let io = |path: &Path, source: std::io::Error| WgparError::TuneCache {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    remove_orphans(dir);
    let path = dir.join(CACHE_FILE);
    // Merge with what another process may have written meanwhile, prune, then replace
    // atomically.
    let mut merged = read_cache(&path);
    for (k, v) in &file.entries {
        merged.entries.insert(k.clone(), v.clone());
    }
    prune(&mut merged);
    let text = serde_json::to_vec_pretty(&merged).map_err(|e| {
        io(
            &path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        )
    })?;
    let tmp = dir.join(format!("{CACHE_FILE}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(&path, e)
    })
}

/// The adapter part of a cache key: name, backend, driver, driver version, and the build
/// ([`build_tag`]: wgpar's version and its kernel set).
pub fn adapter_key(gpu: &Gpu) -> String {
    let i = gpu.info();
    format!(
        "{} [{}] | {} {} | wgpar {}",
        i.name,
        i.backend,
        i.driver,
        i.driver_info,
        build_tag()
    )
}

/// The cached choice for `key` under `settings`, loading the file on first use.
fn cached(settings: &TuneSettings, key: &str) -> Option<String> {
    let mut mem = memory();
    if mem.loaded_from.as_deref() != settings.cache_dir.as_deref() {
        mem.file = settings
            .cache_dir
            .as_ref()
            .map(|d| read_cache(&d.join(CACHE_FILE)))
            .unwrap_or_default();
        mem.loaded_from = settings.cache_dir.clone();
        mem.save_failed = false;
    }
    mem.file.entries.get(key).map(|e| e.variant.clone())
}

fn remember(settings: &TuneSettings, key: String, entry: CacheEntry) {
    let mut mem = memory();
    mem.file.entries.insert(key.clone(), entry.clone());
    let Some(dir) = &settings.cache_dir else {
        return;
    };
    if mem.save_failed {
        return;
    }
    let one = CacheFile {
        entries: BTreeMap::from([(key, entry)]),
    };
    // A read-only or full cache folder costs a retune next time, nothing more: said once,
    // and not tried again in this process.
    if let Err(e) = write_cache(dir, &one) {
        mem.save_failed = true;
        eprintln!("wgpar: warning: tuning cache not saved (choices kept in memory): {e}");
    }
}

/// Serialises tuning across threads, so devices on one adapter time a class once and no two
/// tunings disturb each other's timings.
static TUNING: Mutex<()> = Mutex::new(());

/// Keys timed by this process (so `retune` times each class once per process).
static TUNED: Mutex<BTreeMap<String, ()>> = Mutex::new(BTreeMap::new());

fn tuned_in_process(key: &str) -> bool {
    TUNED.lock().map(|t| t.contains_key(key)).unwrap_or(false)
}

fn mark_tuned(key: &str) {
    if let Ok(mut t) = TUNED.lock() {
        t.insert(key.to_string(), ());
    }
}

/// Operands a tuning run may read instead of allocating its own (`x` then `w`, at least
/// `m x k` and `n x k` elements). Outputs always go to scratch.
#[derive(Debug, Clone, Copy)]
pub struct MatmulOperands<'a> {
    /// Activations.
    pub x: &'a wgpu::Buffer,
    /// Weights.
    pub w: &'a wgpu::Buffer,
}

/// The matmul variant to run for `shape` with `weights` on `gpu`: the device's earlier
/// choice for the class, a forced variant, the cached choice, or a new tuning run (per the
/// settings).
pub fn choose_matmul(
    gpu: &Gpu,
    shape: (usize, usize, usize),
    weights: WeightType,
    operands: Option<MatmulOperands<'_>>,
) -> Result<&'static Variant> {
    let class = Class::Matmul(MatmulClass::of(shape, weights));
    let applies =
        |v: &Variant| v.op == Op::Matmul && v.applies(gpu, shape) && v.grid(shape).is_some();
    choose(
        gpu,
        class,
        &applies,
        variants::default_matmul(gpu, shape),
        &mut || measure_matmul(gpu, shape, weights, operands, Effort::Tune),
    )
}

/// The variant to run for `class` on `gpu` (see [`choose_matmul`]); `measure` times every
/// candidate when tuning is due.
pub fn choose(
    gpu: &Gpu,
    class: Class,
    applies: &dyn Fn(&Variant) -> bool,
    fallback: &'static Variant,
    measure: &mut dyn FnMut() -> Result<Vec<Timing>>,
) -> Result<&'static Variant> {
    if let Some(v) = gpu.kernels().choice(&class) {
        if applies(v) {
            return Ok(v);
        }
    }
    let settings = settings()?;
    let chosen = decide(gpu, &settings, &class, applies, fallback, measure)?;
    gpu.kernels().set_choice(class, chosen);
    Ok(chosen)
}

fn decide(
    gpu: &Gpu,
    settings: &TuneSettings,
    class: &Class,
    applies: &dyn Fn(&Variant) -> bool,
    fallback: &'static Variant,
    measure: &mut dyn FnMut() -> Result<Vec<Timing>>,
) -> Result<&'static Variant> {
    let find = |name: &str| variants::by_name(name).filter(|v| applies(v));
    let mut timed = || -> Result<Vec<(&'static Variant, Option<f64>)>> {
        Ok((measure()?.into_iter())
            .filter(|t| t.variant.candidate)
            .map(|t| (t.variant, t.seconds))
            .collect())
    };
    decide_named(gpu, settings, &class.key(), &find, fallback, &mut timed)
}

/// A tuning candidate: anything named the way `WGPAR_KERNELS` and the cache file name it.
pub trait Candidate: Sync + 'static {
    /// Its unique name.
    fn name(&self) -> &'static str;
}

impl Candidate for Variant {
    fn name(&self) -> &'static str {
        self.name
    }
}

/// The choice for the class keyed `class_key` on `gpu`: the first forced name `find` accepts,
/// the fallback when tuning is off, the cached choice, or the fastest of what `measure` times
/// (then remembered in memory and in the cache file).
pub fn decide_named<T: Candidate>(
    gpu: &Gpu,
    settings: &TuneSettings,
    class_key: &str,
    find: &dyn Fn(&str) -> Option<&'static T>,
    fallback: &'static T,
    measure: &mut dyn FnMut() -> Result<Vec<(&'static T, Option<f64>)>>,
) -> Result<&'static T> {
    if let Some(v) = settings.forced.iter().find_map(|name| find(name)) {
        return Ok(v);
    }
    if settings.mode == TuneMode::Off {
        return Ok(fallback);
    }
    let key = format!("{} | {class_key}", adapter_key(gpu));
    let _serial = match TUNING.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    if settings.mode == TuneMode::Auto || tuned_in_process(&key) {
        if let Some(v) = cached(settings, &key).and_then(|n| find(&n)) {
            return Ok(v);
        }
    }
    let timings = match measure() {
        Ok(t) => t,
        // Out of memory for scratch, or a device error: run the default, untuned.
        Err(e) => {
            eprintln!("wgpar: warning: tuning {class_key} skipped: {e}");
            return Ok(fallback);
        }
    };
    let best = (timings.iter())
        .filter_map(|&(v, s)| s.map(|s| (v, s)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(fallback, |(v, _)| v);
    mark_tuned(&key);
    remember(settings, key, entry_of(best.name(), &timings));
    Ok(best)
}

/// The fastest candidate timed.
pub fn fastest(timings: &[Timing]) -> Option<&'static Variant> {
    timings
        .iter()
        .filter(|t| t.variant.candidate)
        .filter_map(|t| t.seconds.map(|s| (t.variant, s)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(v, _)| v)
}

fn entry_of<T: Candidate>(winner: &str, timings: &[(&'static T, Option<f64>)]) -> CacheEntry {
    CacheEntry {
        variant: winner.to_string(),
        times_ms: (timings.iter())
            .filter_map(|(v, s)| s.map(|s| (v.name().to_string(), s * 1e3)))
            .collect(),
        saved_s: now_s(),
    }
}

/// Stores `winner` as the tuned choice of `class` on `gpu`'s adapter (the kernel benchmark
/// does this with what it measured). Nothing is stored with `WGPAR_TUNE=off`.
pub fn record_choice(
    gpu: &Gpu,
    class: Class,
    winner: &'static Variant,
    timings: &[Timing],
) -> Result<()> {
    let settings = settings()?;
    if settings.mode == TuneMode::Off {
        return Ok(());
    }
    let key = format!("{} | {}", adapter_key(gpu), class.key());
    let timed: Vec<(&'static Variant, Option<f64>)> = (timings.iter())
        .filter(|t| t.variant.candidate)
        .map(|t| (t.variant, t.seconds))
        .collect();
    mark_tuned(&key);
    remember(&settings, key, entry_of(winner.name, &timed));
    gpu.kernels().set_choice(class, winner);
    Ok(())
}

/// Wall-clock budget of one first-use tuning run, seconds.
pub const TUNE_BUDGET_S: f64 = 2.0;

/// How hard to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effort {
    /// First-use tuning: few samples, and a candidate over 2x the best so far is not
    /// sampled further.
    Tune,
    /// The kernel benchmark: `samples` timed samples each after a warm-up.
    Bench {
        /// Timed samples (median kept).
        samples: usize,
    },
}

/// One candidate's time.
#[derive(Debug, Clone)]
pub struct Timing {
    /// The variant.
    pub variant: &'static Variant,
    /// Median seconds per dispatch; `None` if it was not timed (a grid past the limits).
    pub seconds: Option<f64>,
}

/// Times every candidate variant that applies to `shape` on `gpu` (and the legacy kernels,
/// which are candidates too). `operands` are read if given, else scratch is allocated.
pub fn measure_matmul(
    gpu: &Gpu,
    shape: (usize, usize, usize),
    weights: WeightType,
    operands: Option<MatmulOperands<'_>>,
    effort: Effort,
) -> Result<Vec<Timing>> {
    let candidates: Vec<&'static Variant> = variants::MATMUL
        .iter()
        .filter(|v| v.candidate && v.applies(gpu, shape))
        .collect();
    measure_matmul_variants(gpu, shape, weights, operands, effort, &candidates)
}

/// Times the given matmul variants (see [`measure_matmul`]).
pub fn measure_matmul_variants(
    gpu: &Gpu,
    (m, n, k): (usize, usize, usize),
    weights: WeightType,
    operands: Option<MatmulOperands<'_>>,
    effort: Effort,
    candidates: &[&'static Variant],
) -> Result<Vec<Timing>> {
    let shape = (m, n, k);
    let (x_own, w_own);
    let (x, w) = match operands {
        Some(o) => (o.x, o.w),
        None => {
            x_own = gpu.upload_f32("tune.x", &pattern(m * k, 1))?;
            let dtype = match weights {
                WeightType::F16 => DType::F16,
                WeightType::F32 => DType::F32,
            };
            w_own = gpu.upload_weights("tune.w", &pattern(n * k, 2), dtype)?;
            (x_own.buffer(), w_own.buffer())
        }
    };
    let y = gpu.empty("tune.y", DType::F32, m * n)?;
    let params = [m as u32, n as u32, k as u32, 0u32];
    measure_variants(
        gpu,
        candidates,
        weights,
        &[x, w, x, y.buffer()],
        bytemuck::cast_slice(&params),
        &|v| v.grid(shape),
        effort,
    )
}

/// Times `candidates` of one op: each binds `buffers` (in binding order; outputs must be
/// scratch the caller can lose) then a uniform holding `params`, over the grid `grid` gives
/// (a variant without one is listed untimed).
pub fn measure_variants(
    gpu: &Gpu,
    candidates: &[&'static Variant],
    weights: WeightType,
    buffers: &[&wgpu::Buffer],
    params: &[u8],
    grid: &dyn Fn(&Variant) -> Option<[u32; 3]>,
    effort: Effort,
) -> Result<Vec<Timing>> {
    // Through the counted constructors: tests/dispatch_alloc.rs counts every buffer and bind
    // group, tuning's included.
    let uniform = gpu.uniform_bytes(params);
    let mut out = Vec::new();
    let mut best = f64::INFINITY;
    let started = Instant::now();
    for &v in candidates {
        // First-use tuning has a wall-clock budget (pipeline compiles included; slow on a CPU
        // GL driver): past it the remaining candidates are left untimed. The legacy kernels
        // come first in the lists, so the default is always among those timed.
        if effort == Effort::Tune
            && best.is_finite()
            && started.elapsed().as_secs_f64() > TUNE_BUDGET_S
        {
            out.push(Timing {
                variant: v,
                seconds: None,
            });
            continue;
        }
        let Some(groups) = grid(v) else {
            out.push(Timing {
                variant: v,
                seconds: None,
            });
            continue;
        };
        let kernel = v.kernel(gpu, weights);
        let mut entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| entry(i as u32, b))
            .collect();
        entries.push(entry(buffers.len() as u32, &uniform));
        let bind_group = gpu.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("tune"),
            layout: &kernel.layout,
            entries: &entries,
        });
        let run = |reps: usize| -> Result<f64> {
            let mut enc = gpu.encoder();
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(v.name),
                    timestamp_writes: None,
                });
                pass.set_pipeline(&kernel.pipeline);
                pass.set_bind_group(0, &bind_group, &[]);
                for _ in 0..reps {
                    pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                }
            }
            let start = Instant::now();
            gpu.submit(enc);
            gpu.wait()?;
            Ok(start.elapsed().as_secs_f64() / reps as f64)
        };
        let s = time_samples(&run, effort, best)?;
        best = best.min(s);
        out.push(Timing {
            variant: v,
            seconds: Some(s),
        });
    }
    Ok(out)
}

fn entry(binding: u32, buffer: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: buffer.as_entire_binding(),
    }
}

/// Median seconds per dispatch of `run(reps)`: a single dispatch, then a probe batch sized by
/// it (always run, even when that is one dispatch again), then samples, each batch sized so
/// a sample lasts ~3 ms when tuning, ~10 ms when benchmarking (amortising submit latency). The single dispatch carries the submission and
/// the driver's wake-up, which can exceed a short kernel's own time several times over, so
/// the sample size and the early rejection both use the probe's per-dispatch time: in tuning,
/// a candidate whose probe is over 2x `best` is not sampled further (it cannot win).
pub fn time_samples(run: &dyn Fn(usize) -> Result<f64>, effort: Effort, best: f64) -> Result<f64> {
    let target = match effort {
        Effort::Tune => 0.003,
        Effort::Bench { .. } => 0.01,
    };
    let reps_for = |t: f64| ((target / t.max(1e-7)).ceil() as usize).clamp(1, 256);
    // The first dispatch of a pipeline may also carry its compilation (a CPU driver compiles
    // at first use) and whatever work was queued before: it only sizes the probe.
    let first = run(1)?;
    let probe = run(reps_for(first))?;
    let samples = match effort {
        Effort::Tune if probe > 2.0 * best => return Ok(probe),
        Effort::Tune if probe > 0.2 => 1,
        Effort::Tune => 3,
        Effort::Bench { samples } => samples.max(1),
    };
    let reps = reps_for(probe);
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        times.push(run(reps)?);
    }
    crate::stats::median(times)
        .ok_or_else(|| WgparError::Measurement("kernel tuning took no timing samples".into()))
}

/// Deterministic non-trivial data for tuning and benchmarks.
pub fn pattern(len: usize, seed: u32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| {
            let h = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) >> 9;
            (h % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel of 0.5 ms whose first dispatch also pays 2 ms of wake-up, and whose later
    /// submissions pay 0.05 ms each: tuned against a best of 0.9 ms, it is sampled (not
    /// rejected on its first dispatch) and timed near its own 0.5 ms.
    #[test]
    fn a_cold_first_dispatch_does_not_reject_a_fast_kernel() {
        let calls = std::cell::Cell::new(0usize);
        let run = |reps: usize| -> Result<f64> {
            let overhead = if calls.get() == 0 { 0.002 } else { 0.000_05 };
            calls.set(calls.get() + 1);
            Ok((overhead + 0.0005 * reps as f64) / reps as f64)
        };
        let t = time_samples(&run, Effort::Tune, 0.0009).unwrap();
        assert!((0.0005..0.00055).contains(&t), "{t}");
        assert_eq!(calls.get(), 5, "one dispatch, a probe, three samples");
        // A kernel truly over twice the best is still dropped after its probe.
        let slow = |reps: usize| -> Result<f64> {
            calls.set(calls.get() + 1);
            Ok(0.002 + 0.000_05 / reps as f64)
        };
        calls.set(0);
        assert!(time_samples(&slow, Effort::Tune, 0.0009).unwrap() > 0.0018);
        assert_eq!(calls.get(), 2, "one dispatch and a probe");
    }

    #[test]
    fn forced_names_are_checked() {
        assert_eq!(
            parse_forced("X", "gemv_wg64, matmul_vec4").unwrap(),
            vec!["gemv_wg64".to_string(), "matmul_vec4".to_string()]
        );
        let e = parse_forced("X", "gemv_wg64,nope").unwrap_err().to_string();
        assert!(e.contains("nope") && e.contains("gemm_64x64"), "{e}");
    }

    fn key(class: &str) -> String {
        format!(
            "lavapipe [Vulkan] | llvmpipe 1 | wgpar {} | {class}",
            build_tag()
        )
    }

    fn one(k: &str, v: &str, saved_s: u64) -> CacheFile {
        CacheFile {
            entries: BTreeMap::from([(
                k.to_string(),
                CacheEntry {
                    variant: v.into(),
                    times_ms: BTreeMap::new(),
                    saved_s,
                },
            )]),
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("wgpar-tune-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn cache_file_round_trips_and_merges() {
        let dir = scratch("merge");
        write_cache(&dir, &one(&key("a"), "gemv_wg64", 1)).unwrap();
        write_cache(&dir, &one(&key("b"), "gemm_64x64", 2)).unwrap();
        let back = read_cache(&dir.join(CACHE_FILE));
        assert_eq!(back.entries[&key("a")].variant, "gemv_wg64");
        assert_eq!(back.entries[&key("b")].variant, "gemm_64x64");
        std::fs::write(dir.join(CACHE_FILE), b"not json").unwrap();
        assert!(read_cache(&dir.join(CACHE_FILE)).entries.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 29 item 17: other versions' entries and the oldest past the cap are dropped.
    #[test]
    fn prune_drops_other_versions_and_the_oldest() {
        let mut file = CacheFile::default();
        let stale = "lavapipe [Vulkan] | llvmpipe 1 | wgpar 0.0.1 | matmul/x".to_string();
        file.entries.extend(one(&stale, "gemv_wg64", 9).entries);
        // This version with another kernel set: its choices were made among other candidates.
        let other_set = format!(
            "lavapipe [Vulkan] | llvmpipe 1 | wgpar {} | matmul/x",
            env!("CARGO_PKG_VERSION")
        );
        file.entries.extend(one(&other_set, "gemv_wg64", 9).entries);
        for i in 0..MAX_CACHE_ENTRIES + 3 {
            file.entries
                .extend(one(&key(&format!("c{i}")), "gemv_wg64", 10 + i as u64).entries);
        }
        prune(&mut file);
        assert_eq!(file.entries.len(), MAX_CACHE_ENTRIES);
        assert!(!file.entries.contains_key(&stale));
        assert!(!file.entries.contains_key(&other_set));
        assert!(build_tag().starts_with(env!("CARGO_PKG_VERSION")));
        for i in 0..3 {
            assert!(
                !file.entries.contains_key(&key(&format!("c{i}"))),
                "c{i} kept"
            );
        }
        assert!(file.entries.contains_key(&key("c3")));
    }

    /// Issue 29 item 17: an oversized file is not read, and a save replaces it with what is
    /// current; an orphaned temporary file of a killed save is removed, a fresh one is not.
    #[test]
    fn oversized_files_and_orphans_are_cleaned_at_a_save() {
        let dir = scratch("orphans");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(CACHE_FILE);
        let big = vec![b' '; MAX_CACHE_BYTES as usize + 1];
        std::fs::write(&path, &big).unwrap();
        assert!(read_cache(&path).entries.is_empty());
        let orphan = dir.join(format!("{CACHE_FILE}.999999.tmp"));
        let fresh = dir.join(format!("{CACHE_FILE}.999998.tmp"));
        std::fs::write(&orphan, b"{").unwrap();
        std::fs::write(&fresh, b"{").unwrap();
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&orphan)
            .unwrap()
            .set_modified(old)
            .unwrap();
        write_cache(&dir, &one(&key("a"), "gemv_wg64", 1)).unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() < 4096);
        assert_eq!(read_cache(&path).entries.len(), 1);
        assert!(!orphan.exists(), "the orphan was kept");
        assert!(fresh.exists(), "a save in progress elsewhere was removed");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
