//! `wgpar plan`: modeled projections for models and machines that are not at hand. The
//! engines' schedules are rebuilt as timelines ([`modeled_timeline`]) and projected onto host
//! profiles, once per engine: wgpar as it runs today, and CUDA + NCCL (or any engine file) on
//! the same machine, side by side. Configurations whose weights, KV cache and activations do
//! not fit a device are marked, not timed.

use std::fmt::Write;
use std::path::Path;

use serde::Serialize;

use super::memory::{gib, memory_per_device, DeviceMemory, WeightsSpec, Workload};
use super::modeled::{modeled_timeline, shape_of, Formats};
use crate::error::{Result, WgparError};
use crate::model::memory::WeightFormat;
use crate::model::quant::QuantType;
use crate::model::{valid_tp_degrees, ModelConfig, Step};
use crate::parallel::{PartitionSpec, Schedule, Strategy};
use crate::sim::{project_engine, Engine, HostProfile, NumFormat, ProjectOptions};

/// A strategy to model: its label, the strategy and the devices it uses.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanStrategy {
    /// Label, e.g. `tp8`, `pp4 m=16`, `tp8xpp3 m=3`.
    pub label: String,
    /// The strategy.
    pub strategy: Strategy,
    /// Devices it uses.
    pub devices: usize,
    /// Model every micro-batch count (powers of two up to the batch) and keep the one with the
    /// shortest decode step, per batch: the `-mbest` suffix.
    pub best_micro_batches: bool,
}

impl PlanStrategy {
    /// Parses `single`, `tpN`, `ppN`, `ppN-mM`, `tpNxppP` or `tpNxppP-mM` (M micro-batches,
    /// default 1), and `ppN-mbest` / `tpNxppP-mbest` (the best micro-batch count per batch).
    pub fn parse(text: &str) -> Result<PlanStrategy> {
        let t = text.trim().to_ascii_lowercase();
        let bad = || {
            WgparError::option(
                "--strategies",
                format!(
                    "strategy '{text}': expected single, tpN, ppN, ppN-mM, tpNxppP or tpNxppP-mM, \
                     M a count or 'best' (e.g. tp8, pp4-m16, tp8xpp3-m3, tp8xpp2-mbest)"
                ),
            )
        };
        let number = |s: &str| s.parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(bad);
        if t == "single" {
            return Ok(PlanStrategy {
                label: "single".into(),
                strategy: Strategy::Single,
                devices: 1,
                best_micro_batches: false,
            });
        }
        if let Some(body) = t.strip_suffix("-mbest") {
            return Self::parse(body)?.best_of_micro_batches().ok_or_else(bad);
        }
        let (body, m) = match t.split_once("-m") {
            Some((b, m)) => (b, number(m)?),
            None => (t.as_str(), 1),
        };
        if let Some((tp, pp)) = body.split_once('x') {
            let tp = number(tp.strip_prefix("tp").ok_or_else(bad)?)?;
            let pp = number(pp.strip_prefix("pp").ok_or_else(bad)?)?;
            return Ok(PlanStrategy {
                label: format!("tp{tp}xpp{pp} m={m}"),
                strategy: Strategy::Hybrid {
                    tp,
                    partition: PartitionSpec::Even,
                    micro_batches: m,
                    // Each micro-batch's step waits only for its own previous output.
                    schedule: Schedule::InFlight,
                },
                devices: tp * pp,
                best_micro_batches: false,
            });
        }
        if let Some(n) = body.strip_prefix("tp") {
            if t.contains("-m") {
                return Err(bad());
            }
            let n = number(n)?;
            return Ok(PlanStrategy {
                label: format!("tp{n}"),
                strategy: Strategy::Tensor { split: None },
                devices: n,
                best_micro_batches: false,
            });
        }
        if let Some(n) = body.strip_prefix("pp") {
            let n = number(n)?;
            return Ok(PlanStrategy {
                label: format!("pp{n} m={m}"),
                strategy: Strategy::Pipeline {
                    partition: PartitionSpec::Even,
                    micro_batches: m,
                    // Each micro-batch's step waits only for its own previous output.
                    schedule: Schedule::InFlight,
                },
                devices: n,
                best_micro_batches: false,
            });
        }
        Err(bad())
    }

    /// This pipeline or hybrid strategy with its micro-batch count left to the plan; `None`
    /// for one that has no micro-batches.
    fn best_of_micro_batches(self) -> Option<Self> {
        let base = self
            .label
            .split(" m=")
            .next()
            .unwrap_or_default()
            .to_string();
        match self.strategy {
            Strategy::Pipeline { .. } | Strategy::Hybrid { .. } => Some(Self {
                label: format!("{base} m=best"),
                best_micro_batches: true,
                ..self
            }),
            _ => None,
        }
    }

    /// This strategy with `m` micro-batches, labelled with the count.
    fn with_micro_batches(&self, m: usize) -> Self {
        let mut strategy = self.strategy.clone();
        if let Strategy::Pipeline { micro_batches, .. } | Strategy::Hybrid { micro_batches, .. } =
            &mut strategy
        {
            *micro_batches = m;
        }
        let base = self.label.split(" m=").next().unwrap_or_default();
        Self {
            label: format!("{base} m={m} (best)"),
            strategy,
            devices: self.devices,
            best_micro_batches: false,
        }
    }

    /// Why this strategy cannot split `config`, if it cannot.
    pub fn check(&self, config: &ModelConfig) -> Result<()> {
        let (tp, pp, _, _) = shape_of(&self.strategy, self.devices)?;
        if tp > 1 && !valid_tp_degrees(config).contains(&tp) {
            return Err(WgparError::unsupported(format!(
                "{}: {} query / {} KV heads do not split over {tp} devices (valid degrees: {:?})",
                self.label,
                config.heads,
                config.kv_heads,
                valid_tp_degrees(config)
            )));
        }
        if pp > config.layers {
            return Err(WgparError::unsupported(format!(
                "{}: {pp} pipeline stages for {} layers",
                self.label, config.layers
            )));
        }
        Ok(())
    }
}

/// The strategies `wgpar plan` models on `n` devices by default: single; TP over n where the
/// heads allow; PP over n with 1 and 4n micro-batches where the layers allow.
pub fn default_strategies(config: &ModelConfig, n: usize) -> Vec<PlanStrategy> {
    let mut v = vec![PlanStrategy {
        label: "single".into(),
        strategy: Strategy::Single,
        devices: 1,
        best_micro_batches: false,
    }];
    if n >= 2 && valid_tp_degrees(config).contains(&n) {
        v.push(PlanStrategy {
            label: format!("tp{n}"),
            strategy: Strategy::Tensor { split: None },
            devices: n,
            best_micro_batches: false,
        });
    }
    if n >= 2 && n <= config.layers {
        for m in [1, 4 * n] {
            v.push(PlanStrategy {
                label: format!("pp{n} m={m}"),
                strategy: Strategy::Pipeline {
                    partition: PartitionSpec::Even,
                    micro_batches: m,
                    // Each micro-batch's step waits only for its own previous output.
                    schedule: Schedule::InFlight,
                },
                devices: n,
                best_micro_batches: false,
            });
        }
    }
    v
}

/// What to model.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// The model (its `max_seq` bounds prompt + decode steps).
    pub config: ModelConfig,
    /// How the weights are stored (bytes per parameter of the memory-bound decode).
    pub weights: NumFormat,
    /// How the wgpar runtime stores them, per tensor, when a file says it (a GGUF's own
    /// block types); `None`: every layer in `weights`.
    pub file_format: Option<WeightFormat>,
    /// Strategies.
    pub strategies: Vec<PlanStrategy>,
    /// Batch sizes.
    pub batches: Vec<usize>,
    /// Prompt lengths.
    pub seqs: Vec<usize>,
    /// Host profiles.
    pub profiles: Vec<HostProfile>,
    /// Engines, each projected onto every profile.
    pub engines: Vec<Engine>,
    /// Decode steps modeled per configuration (at least 1).
    pub decode_steps: usize,
}

/// One modeled configuration on one profile, as one engine runs it.
#[derive(Debug, Clone, Serialize)]
pub struct PlanRow {
    /// Profile.
    pub profile: String,
    /// Engine label.
    pub engine: String,
    /// Strategy label.
    pub strategy: String,
    /// Devices used.
    pub devices: usize,
    /// Batch.
    pub batch: usize,
    /// Prompt length.
    pub seq: usize,
    /// Whether weights, KV cache and activations fit every device.
    pub fits: bool,
    /// Memory of the fullest device (the one furthest over, when it does not fit).
    pub memory: DeviceMemory,
    /// Prefill latency (time to first token), ms; absent when it does not fit.
    pub prefill_ms: Option<f64>,
    /// Communication share of device-time during prefill.
    pub prefill_comm: Option<f64>,
    /// One decode step, ms (mean over the modeled steps).
    pub decode_ms: Option<f64>,
    /// Generated tokens/s.
    pub decode_tps: Option<f64>,
    /// Prefill plus the modeled decode steps, ms: the latency of a request that generates
    /// `decode_steps` tokens after the first.
    pub request_ms: Option<f64>,
    /// Communication share during decode.
    pub decode_comm: Option<f64>,
    /// Bubble share during decode.
    pub decode_bubble: Option<f64>,
    /// Collective paths the engine took.
    pub collectives_via: Vec<String>,
}

/// Checks everything the options say before modeling anything.
pub fn validate(opts: &PlanOptions) -> Result<()> {
    let fail = |m: String| Err(WgparError::option("plan options", m));
    if opts.batches.is_empty() || opts.batches.contains(&0) {
        return fail(format!(
            "--batches {:?}: every batch size must be at least 1",
            opts.batches
        ));
    }
    if opts.seqs.is_empty() || opts.seqs.contains(&0) {
        return fail(format!(
            "--seqs {:?}: every prompt length must be at least 1 token",
            opts.seqs
        ));
    }
    if opts.decode_steps == 0 {
        return fail(
            "--decode-steps 0: at least one decode step is needed to model decode latency".into(),
        );
    }
    if opts.strategies.is_empty() {
        return fail("no strategy to model: give --strategies or --devices".into());
    }
    if opts.profiles.is_empty() || opts.engines.is_empty() {
        return fail("plan needs at least one host profile and one engine".into());
    }
    let c = &opts.config;
    let longest = opts.seqs.iter().copied().max().unwrap_or(0);
    // Checked: a sum that wrapped would pass the context check.
    let Some(context) = longest.checked_add(opts.decode_steps) else {
        return fail(format!(
            "prompt {longest} + {} decode steps overflow a token count: give shorter --seqs \
             (the context of {} is {} tokens)",
            opts.decode_steps, c.name, c.max_seq
        ));
    };
    if context > c.max_seq {
        return fail(format!(
            "prompt {longest} + {} decode steps = {context} tokens exceed {}'s context of {} \
             tokens (max_seq): give shorter --seqs, or --max-seq {context} to model the longer \
             context anyway",
            opts.decode_steps, c.name, c.max_seq,
        ));
    }
    for s in &opts.strategies {
        s.check(c)?;
        for p in &opts.profiles {
            if p.device_count() < s.devices {
                return fail(format!(
                    "{} needs {} devices but profile {} has {}",
                    s.label,
                    s.devices,
                    p.name,
                    p.device_count()
                ));
            }
        }
    }
    Ok(())
}

/// Models every (profile, engine, strategy, batch, seq).
pub fn plan(opts: &PlanOptions) -> Result<Vec<PlanRow>> {
    validate(opts)?;
    let mut rows = Vec::new();
    for profile in &opts.profiles {
        for engine in &opts.engines {
            let formats = Formats::of(engine, opts.weights);
            for strategy in &opts.strategies {
                let cell = Cell {
                    opts,
                    profile,
                    engine,
                    formats: &formats,
                    strategy,
                };
                for &batch in &opts.batches {
                    for &seq in &opts.seqs {
                        rows.push(cell.best_row(batch, seq)?);
                    }
                }
            }
        }
    }
    Ok(rows)
}

/// One (profile, engine, strategy) of a plan, whose rows are its batches and prompt lengths.
struct Cell<'a> {
    opts: &'a PlanOptions,
    profile: &'a HostProfile,
    engine: &'a Engine,
    formats: &'a Formats,
    strategy: &'a PlanStrategy,
}

/// What projecting one configuration's modeled timelines gives a row.
struct RowTimes {
    prefill_ms: f64,
    prefill_comm: f64,
    decode_ms: f64,
    decode_comm: f64,
    decode_bubble: f64,
    collectives_via: Vec<String>,
}

impl Cell<'_> {
    /// [`Self::row`], or for a `-mbest` strategy the row of the micro-batch count whose decode
    /// step is shortest among those that fit. The counts are powers of two up to the batch and
    /// the stage count: with as many micro-batches in flight as stages the pipeline is full,
    /// and more only shrink each one's matmuls (and cost the model time per extra count).
    fn best_row(&self, batch: usize, seq: usize) -> Result<PlanRow> {
        if !self.strategy.best_micro_batches {
            return self.row(batch, seq);
        }
        let (_, stages, _, _) = shape_of(&self.strategy.strategy, self.strategy.devices)?;
        let most = batch.min(stages).max(1);
        let counts =
            std::iter::successors(Some(1usize), |m| Some(m * 2)).take_while(|&m| m <= most);
        let mut best: Option<PlanRow> = None;
        for m in counts {
            let strategy = self.strategy.with_micro_batches(m);
            let row = Cell {
                strategy: &strategy,
                ..*self
            }
            .row(batch, seq)?;
            let step = |r: &PlanRow| (r.fits, r.decode_ms.map(|ms| -ms));
            if best.as_ref().is_none_or(|b| step(&row) > step(b)) {
                best = Some(row);
            }
        }
        best.ok_or_else(|| WgparError::option("--batches", "a batch of 0 sequences".into()))
    }

    /// The row of one batch and prompt length: its memory, and its times when it fits.
    fn row(&self, batch: usize, seq: usize) -> Result<PlanRow> {
        let (opts, s) = (self.opts, self.strategy);
        let work = Workload {
            batch,
            prompt: seq,
            context: seq + opts.decode_steps,
        };
        let memory = memory_per_device(
            &opts.config,
            &s.strategy,
            s.devices,
            WeightsSpec {
                format: opts.weights,
                runtime: opts.file_format.as_ref(),
            },
            self.engine,
            self.profile,
            work,
        )?;
        let fits = memory.iter().all(DeviceMemory::fits);
        let mut row = PlanRow {
            profile: self.profile.name.clone(),
            engine: self.engine.label().to_owned(),
            strategy: s.label.clone(),
            devices: s.devices,
            batch,
            seq,
            fits,
            memory: fullest(&memory),
            prefill_ms: None,
            prefill_comm: None,
            decode_ms: None,
            decode_tps: None,
            request_ms: None,
            decode_comm: None,
            decode_bubble: None,
            collectives_via: Vec::new(),
        };
        if !fits {
            return Ok(row);
        }
        let t = self.times(batch, seq)?;
        row.prefill_ms = Some(t.prefill_ms);
        row.prefill_comm = Some(t.prefill_comm);
        row.decode_ms = Some(t.decode_ms);
        row.decode_tps = Some(batch as f64 / (t.decode_ms / 1e3));
        row.request_ms = Some(t.prefill_ms + opts.decode_steps as f64 * t.decode_ms);
        row.decode_comm = Some(t.decode_comm);
        row.decode_bubble = Some(t.decode_bubble);
        row.collectives_via = t.collectives_via;
        Ok(row)
    }

    /// Models the prefill and the decode steps and projects them onto the profile.
    fn times(&self, batch: usize, seq: usize) -> Result<RowTimes> {
        let (opts, s) = (self.opts, self.strategy);
        let (profile, engine) = (self.profile, self.engine);
        let err = |source: crate::sim::ProjectError| WgparError::Projection {
            what: format!("{} as {}", s.label, engine.label()),
            profile: profile.name.clone(),
            source,
        };
        let modeled = |step: Step, steps: usize| {
            modeled_timeline(
                &s.strategy,
                s.devices,
                &opts.config,
                self.formats,
                step,
                steps,
            )
        };
        let pre = modeled(
            Step {
                batch,
                seq,
                past: 0,
            },
            1,
        )?;
        let dec = modeled(
            Step {
                batch,
                seq: 1,
                past: seq,
            },
            opts.decode_steps,
        )?;
        // Each engine runs its own preferred collective on each machine (wgpar: host-staged;
        // CUDA + NCCL: NVLS, NVLink ring, P2P or shared memory as the hardware allows).
        let popts = ProjectOptions::default();
        let p = project_engine(&pre, profile, engine, &popts).map_err(err)?;
        let d = project_engine(&dec, profile, engine, &popts).map_err(err)?;
        let mut via = p.report.collectives_via.clone();
        for v in &d.report.collectives_via {
            if !via.contains(v) {
                via.push(v.clone());
            }
        }
        Ok(RowTimes {
            prefill_ms: p.report.projected.makespan_us / 1e3,
            prefill_comm: p.report.projected.comm_share,
            decode_ms: d.report.projected.makespan_us / 1e3 / opts.decode_steps as f64,
            decode_comm: d.report.projected.comm_share,
            decode_bubble: d.report.projected.bubble_share,
            collectives_via: via,
        })
    }
}

/// The device furthest over (or nearest to) its capacity; all zeros when there is none.
fn fullest(memory: &[DeviceMemory]) -> DeviceMemory {
    let ratio = |m: &DeviceMemory| m.total as f64 / m.capacity.max(1) as f64;
    memory
        .iter()
        .max_by(|a, b| ratio(a).total_cmp(&ratio(b)))
        .cloned()
        .unwrap_or(DeviceMemory {
            device: 0,
            weights: 0,
            kv_cache: 0,
            activations: 0,
            reserve: 0,
            total: 0,
            capacity: 0,
        })
}

/// The model as `wgpar plan --model` names it: a shipped preset, a plan-only preset of a
/// published model's shapes ([`super::PLAN_PRESETS`]), a Hugging Face model folder, or its
/// `config.json`.
pub fn plan_model(name: &str) -> Result<ModelConfig> {
    let path = Path::new(name);
    if crate::model::gguf::is_gguf(path) {
        return Ok(crate::model::gguf::Gguf::open(path)?.config().clone());
    }
    let file = if path.is_dir() {
        Some(path.join("config.json"))
    } else if path.is_file() {
        Some(path.to_path_buf())
    } else {
        None
    };
    if let Some(file) = file {
        let text =
            crate::files::read_text(&file, crate::files::CONFIG_LIMIT).map_err(|source| {
                WgparError::Io {
                    path: file.display().to_string(),
                    source,
                }
            })?;
        let stem = if path.is_dir() {
            path.file_name()
        } else {
            path.file_stem()
        };
        let model_name = stem
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        return Ok(crate::model::hf::config::parse(&file, &text, &model_name)?.config);
    }
    if let Some(c) = super::presets::plan_preset(name) {
        return Ok(c);
    }
    ModelConfig::preset(name).map_err(|e| {
        WgparError::option(
            "--model",
            format!(
                "{e}; plan also knows {} and takes a model folder or a config.json path",
                super::presets::PLAN_PRESETS.join(", ")
            ),
        )
    })
}

fn ms(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.decimals$}"))
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{:.1}", x * 100.0))
}

/// How `plan` counts a GGUF file's weights: its own layer blocks, and its tables in their blocks
/// or dense.
fn file_storage(f: &WeightFormat) -> String {
    let types: Vec<&str> = f.blocks.types().iter().map(|t| t.name()).collect();
    let layers = match types.is_empty() {
        true => "none: dense".to_string(),
        false => types.join(", "),
    };
    let table = |t: Option<QuantType>| match t {
        Some(t) => format!("in {} blocks", t.name()),
        None => format!("in {:?}", f.dense),
    };
    let head = match f.vectors.tied_head {
        true => "tied".to_string(),
        false => table(f.blocks.lm_head),
    };
    format!(
        "wgpar's memory counts the file's own layer blocks ({layers}), the token embedding {}, \
         the LM head {head}, as `wgpar run` holds them.",
        table(f.blocks.wte)
    )
}

/// The rows as Markdown tables, one per profile, engines side by side.
pub fn plan_markdown(opts: &PlanOptions, rows: &[PlanRow]) -> String {
    let mut s = String::new();
    let c = &opts.config;
    let engines: Vec<&str> = opts.engines.iter().map(|e| e.label()).collect();
    let _ = writeln!(
        s,
        "Modeled (not measured): {} ({:.2}B parameters, {} weights, {:.4} bytes per parameter), \
         engines {}; decode averaged over {} steps; request = prefill + {} decode steps. Each \
         engine runs its own arithmetic and collectives (wgpar: f32 WGSL, host-staged; \
         CUDA+NCCL: f16 tensor cores, NCCL over the best link the machine has).\n",
        c.name,
        c.params() as f64 / 1e9,
        opts.weights,
        opts.weights.bytes(),
        engines.join(", "),
        opts.decode_steps,
        opts.decode_steps
    );
    if let Some(f) = opts.file_format.as_ref().filter(|f| f.packed.is_none()) {
        let _ = writeln!(s, "{}\n", file_storage(f));
    }
    // Say where the projection approximates the model (Gemma 3's features).
    if let Some(gaps) = c.cost_model_gaps() {
        let _ = writeln!(s, "{gaps}\n");
    }
    for profile in &opts.profiles {
        let _ = writeln!(s, "### {}\n", profile.name);
        let _ = writeln!(
            s,
            "| strategy | engine | batch | prompt | memory (fullest device) | TTFT ms | decode ms/step | tokens/s | request ms | prefill comm % | decode comm % | bubble % | collectives |"
        );
        let _ = writeln!(
            s,
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for r in rows.iter().filter(|r| r.profile == profile.name) {
            let memory = if r.fits {
                format!("{} of {}", gib(r.memory.total), gib(r.memory.capacity))
            } else {
                format!(
                    "**does not fit**: device {} needs {} of {}",
                    r.memory.device,
                    gib(r.memory.total),
                    gib(r.memory.capacity)
                )
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.strategy,
                r.engine,
                r.batch,
                r.seq,
                memory,
                ms(r.prefill_ms, 2),
                ms(r.decode_ms, 3),
                ms(r.decode_tps, 0),
                ms(r.request_ms, 1),
                pct(r.prefill_comm),
                pct(r.decode_comm),
                pct(r.decode_bubble),
                if r.collectives_via.is_empty() {
                    "-".to_string()
                } else {
                    r.collectives_via.join(", ")
                }
            );
        }
        let _ = writeln!(s);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_parse_and_bad_ones_are_named() {
        let s = PlanStrategy::parse("tp8xpp3-m3").unwrap();
        assert_eq!((s.devices, s.label.as_str()), (24, "tp8xpp3 m=3"));
        assert_eq!(PlanStrategy::parse("pp4-m16").unwrap().devices, 4);
        assert_eq!(PlanStrategy::parse("TP2").unwrap().label, "tp2");
        assert_eq!(PlanStrategy::parse("single").unwrap().devices, 1);
        for bad in ["tp0", "tp", "pp2-m0", "dp2", "tp2-m4", "tp2xdp2", "x"] {
            let e = PlanStrategy::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("tpNxppP"), "{e}");
        }
    }
}
