//! A pipeline you can watch: a deep, thin variant of the default model (16 layers of FFN 384
//! instead of 6 of FFN 1024, see [`demo_model`]) split over every adapter this machine has
//! (or two virtual devices when it has one), eight micro-batches flowing through the stages,
//! then the timeline drawn in the terminal: fill, steady state, drain. Then the same
//! micro-batches decoding in flight: each moves to its next token as soon as its own logits
//! are back, so the stages stay busy with no fill and drain per token. Each picture comes
//! after an untimed warm-up through every stage (kernels compiled, buffers allocated), printed
//! in one line, so it shows the steady state.
//!
//! The layers are placed by each device's measured speed (the partition `--layers auto`
//! uses): two adapters on one machine are rarely equally fast (a Vulkan and a GL driver, say),
//! and the last stage also holds the LM head. Prefill and decode are placed apart, each by
//! its own step's costs: a prompt's tokens make the layers dear next to the head, a decode
//! token leaves the head a large share. Each placement is then checked by a run of its step
//! with every stage at work (a prefill; a short in-flight decode), and placed again by those
//! times while they call for a split not tried yet ([`rescale_stage_costs`], at most four
//! splits); the most even split is kept. Each
//! report gives two theories: the bubble of a pipeline of equal stages, and that of a perfect
//! pipeline with the stage times just measured, so what is left over is the schedule's own.
//!
//! When every adapter is a CPU driver (lavapipe and llvmpipe on a machine without a GPU),
//! each adapter's worker pool is cut to its share of the cores (`LP_NUM_THREADS`, unless set)
//! before any device opens, and a line says so: otherwise every pool takes every core, a
//! device timed alone gets them all, and two stages running at once time-share them, which
//! misplaces the layers and slows both stages. On GPUs each stage owns its device already.
//!
//! `cargo run --release --example pipeline_demo`

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    measure_stage_costs, partition, rescale_stage_costs, Engine, Partition, PipelineEngine,
    PipelineStats, StageCost,
};
use wgpar::trace::{Recorder, SpanKind, Timeline};
use wgpar::WgparError;

const WIDTH: usize = 100;

fn devices(adapters: &Adapters) -> Result<Vec<Arc<Gpu>>, wgpar::WgparError> {
    let all: Vec<usize> = adapters.list().iter().map(|a| a.index).collect();
    let selection = if all.len() >= 2 {
        DeviceSelection::Indices(all)
    } else {
        DeviceSelection::Virtual {
            adapter: adapters.preferred(),
            count: 2,
        }
    };
    open_devices(adapters, &selection, &GpuOptions::default())
}

/// One text row per device: each column a slice of time, showing which micro-batch that
/// device was computing ('.' idle, '>' handing off).
fn draw(timeline: &Timeline, stages: usize) {
    let start = timeline.spans.iter().map(|s| s.start_ns).min().unwrap_or(0);
    let end = timeline.spans.iter().map(|s| s.end_ns()).max().unwrap_or(1);
    let per_col = ((end - start) as f64 / WIDTH as f64).max(1.0);
    for stage in 0..stages as u32 {
        let mut row = vec!['.'; WIDTH];
        for s in timeline.spans.iter().filter(|s| s.device == Some(stage)) {
            let c0 = ((s.start_ns - start) as f64 / per_col) as usize;
            let c1 = (((s.end_ns() - start) as f64 / per_col).ceil() as usize).min(WIDTH);
            let mark = match (s.kind, s.microbatch) {
                (SpanKind::Compute, Some(mb)) => char::from_digit(mb % 36, 36).unwrap_or('#'),
                (SpanKind::Compute, None) => '#',
                _ => '>',
            };
            for cell in row.iter_mut().take(c1.max(c0 + 1)).skip(c0) {
                if *cell == '.' || mark != '>' {
                    *cell = mark;
                }
            }
        }
        println!("stage {stage} |{}|", row.into_iter().collect::<String>());
    }
    println!(
        "         0 ms {:>width$}",
        format!("{:.1} ms", (end - start) as f64 / 1e6),
        width = WIDTH - 3
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let adapters = share_cores(Adapters::discover()?)?;
    let gpus = devices(&adapters)?;
    for g in &gpus {
        println!("stage device: {}", g.describe());
    }
    let config = demo_model()?;
    println!(
        "model: {} layers, hidden {}, FFN {}, vocab {} (the default model made deeper and \
         thinner, so a split by layers can even out the stages, LM head included)",
        config.layers, config.hidden, config.ffn, config.vocab
    );
    let weights = ModelWeights::synthetic(&config, 7);
    let prompts: Vec<Vec<u32>> = (0..MICRO_BATCHES)
        .map(|b| {
            (0..PROMPT_TOKENS)
                .map(|i| ((b * 31 + i * 7) % config.vocab) as u32)
                .collect()
        })
        .collect();
    show_prefill(&gpus, &weights, &prompts)?;
    show_decode(&gpus, &weights, &prompts)
}

/// The prefill on layers placed by each device's time for a prompt, warmed up and checked
/// (see [`placed_pipeline`]), then one GPipe step drawn.
fn show_prefill(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    prompts: &[Vec<u32>],
) -> Result<(), Box<dyn std::error::Error>> {
    println!("\nprefill (GPipe): {MICRO_BATCHES} prompts of {PROMPT_TOKENS} tokens");
    let mut pp = placed_pipeline(gpus, weights, prompts, Phase::Prefill)?;
    println!("{}", pp.name());
    let recorder = Recorder::new();
    pp.set_recorder(recorder.clone());
    pp.prefill(prompts)?;
    let stats = pp.last_run().cloned().ok_or("no run recorded")?;
    println!(
        "\n{MICRO_BATCHES} micro-batches through {} stages; each digit is the micro-batch a \
         stage computes\n",
        gpus.len()
    );
    draw(&recorder.timeline(), gpus.len());
    report(&stats);
    Ok(())
}

/// Decode on layers placed by each device's time for one token, warmed up and checked (see
/// [`placed_pipeline`]), then six tokens per sequence in flight drawn.
fn show_decode(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    prompts: &[Vec<u32>],
) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\ndecode (in flight): {DECODE_TOKENS} tokens per sequence, every micro-batch on its own"
    );
    let mut pp = placed_pipeline(gpus, weights, prompts, Phase::Decode)?;
    println!("{}", pp.name());
    let first = pp.prefill(prompts)?;
    // A fresh recorder, so the picture shows only the decode run.
    let recorder = Recorder::new();
    pp.set_recorder(recorder.clone());
    pp.decode_greedy(&first.argmax(), DECODE_TOKENS, false)?;
    let stats = pp.last_run().cloned().ok_or("no run recorded")?;
    println!();
    draw(&recorder.timeline(), gpus.len());
    report(&stats);
    Ok(())
}

/// Tokens per prompt.
const PROMPT_TOKENS: usize = 16;

/// Decode tokens per sequence drawn.
const DECODE_TOKENS: usize = 6;

/// Micro-batches (one sequence each) in flight.
const MICRO_BATCHES: usize = 8;

/// The variable that sizes the worker pool of Mesa's CPU drivers (llvmpipe, lavapipe); each
/// adapter has its own pool, as many threads as the machine has cores unless it is set.
const CPU_DRIVER_THREADS: &str = "LP_NUM_THREADS";

/// When every adapter is a CPU driver, gives each adapter its share of the cores, so the
/// stages compute side by side as they would on separate GPUs. Left alone, each adapter's
/// pool takes every core: timed alone (the placement probe) a device gets them all, running
/// together the stages time-share them and each dispatch waits for its slowest worker, so the
/// probe misplaces the layers and both stages slow down. The drivers read the variable when
/// an adapter is made, so the adapters are found again once it is set; a value the user set
/// is kept. Real GPUs (and a GPU beside a CPU driver) are left as they are.
fn share_cores(adapters: Adapters) -> Result<Adapters, wgpar::WgparError> {
    let n = adapters.list().len();
    if n < 2 || !adapters.list().iter().all(|a| a.is_cpu()) {
        return Ok(adapters);
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if let Some(set) = std::env::var_os(CPU_DRIVER_THREADS) {
        println!(
            "CPU drivers only: {n} adapters on {cores} cores, each with {CPU_DRIVER_THREADS}={} \
             worker threads as set",
            set.to_string_lossy()
        );
        return Ok(adapters);
    }
    let each = (cores / n).max(1);
    drop(adapters);
    // Before any device or stage thread exists: nothing else reads the environment now.
    std::env::set_var(CPU_DRIVER_THREADS, each.to_string());
    let adapters = Adapters::discover()?;
    println!(
        "CPU drivers only: {n} adapters on {cores} cores, so each gets {each} worker thread(s) \
         ({CPU_DRIVER_THREADS}={each}) and the stages compute side by side, as on separate GPUs"
    );
    Ok(adapters)
}

/// The default model with its layers made thinner and more numerous: same width, heads and
/// vocabulary, about 1.4x its layers' weights. With six layers the LM head (about two layers' cost)
/// forces a split with a large step between the stages; with sixteen a layer is a small step,
/// so the measured-speed placement can balance two stages to within a few percent.
fn demo_model() -> Result<ModelConfig, wgpar::WgparError> {
    let mut config = ModelConfig::preset("default")?;
    config.name = "default-deep".into();
    config.layers = 16;
    config.ffn = 384;
    config.validate()?;
    Ok(config)
}

/// Samples per device when timing a layer, the embedding and the head (the median is kept).
const PLACEMENT_SAMPLES: usize = 15;

/// Decode tokens per sequence of the run that checks a decode placement after its warm-up.
const CHECK_TOKENS: usize = 3;

/// A warmed-up pipeline and the stage times of its check run.
struct Checked {
    pp: PipelineEngine,
    run: PipelineStats,
}

impl Checked {
    /// Builds the pipeline placed by `costs`, warms it up, and times `phase`'s check run.
    fn new(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        prompts: &[Vec<u32>],
        costs: &[StageCost],
        phase: Phase,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let mut pp = pipeline(gpus, weights, costs)?;
        phase.warm_up(&mut pp, prompts)?;
        let first = pp.prefill(prompts)?;
        if phase == Phase::Decode {
            pp.decode_greedy(&first.argmax(), CHECK_TOKENS, false)?;
        }
        let run = pp.last_run().cloned().ok_or("no run recorded")?;
        Ok(Self { pp, run })
    }

    /// Compute seconds per pass of each stage.
    fn per_pass(&self) -> Vec<f64> {
        (self.run.stages.iter())
            .map(|s| s.busy_s / s.microbatches.max(1) as f64)
            .collect()
    }

    /// The check's own steady-state bubble, 1 - mean / slowest of the stages' compute per
    /// pass: both stages are timed in the same run, so this ratio holds when the machine's
    /// load moves between two checks, where their absolute times would not.
    fn imbalance(&self) -> f64 {
        let t = self.per_pass();
        let slowest = t.iter().cloned().fold(0.0, f64::max);
        if slowest > 0.0 {
            1.0 - t.iter().sum::<f64>() / (t.len() as f64 * slowest)
        } else {
            1.0
        }
    }

    /// `layers 0..10, 10..16 computed 12.1 vs 12.9 ms per pass`.
    fn describe(&self) -> String {
        let ms: Vec<String> = (self.per_pass().iter())
            .map(|t| format!("{:.1}", t * 1e3))
            .collect();
        format!(
            "layers {} computed {} ms per pass",
            spans(self.pp.stage_layers()),
            ms.join(" vs ")
        )
    }
}

/// The step a pipeline is placed, warmed up and checked for.
#[derive(Clone, Copy, PartialEq)]
enum Phase {
    /// GPipe prefill of the prompts.
    Prefill,
    /// In-flight decode after a prefill.
    Decode,
}

impl Phase {
    /// Tokens per sequence of the step the probe times.
    fn probe_tokens(self) -> usize {
        match self {
            Phase::Prefill => PROMPT_TOKENS,
            Phase::Decode => 1,
        }
    }

    /// One untimed pass of the step through every stage: a prefill, then for decode a token.
    fn warm_up(self, pp: &mut PipelineEngine, prompts: &[Vec<u32>]) -> Result<(), WgparError> {
        let first = pp.prefill(prompts)?;
        if self == Phase::Decode {
            pp.decode_greedy(&first.argmax(), 1, false)?;
        }
        Ok(())
    }

    /// What the warm-up and the check ran, for the one line that says so.
    fn warmed(self, prompts: usize) -> String {
        match self {
            Phase::Prefill => format!(
                "one untimed prefill of the {prompts} prompts through every stage (kernels \
                 compiled and tuned, buffers allocated), then a timed one to check the placement"
            ),
            Phase::Decode => format!(
                "one untimed prefill of the {prompts} prompts and one decode token through every \
                 stage (kernels compiled and tuned, buffers allocated), then a \
                 {CHECK_TOKENS}-token decode to check the placement"
            ),
        }
    }
}

/// Most placements tried per step: the probe's, then each placed again by the last check.
const CHECK_ROUNDS: usize = 4;

/// The pipeline placed for `phase` by measured speed, warmed up, and its placement checked.
/// The probe times each device alone, one kernel per submission; after the warm-up a run of
/// the step itself times the stages as they really work (at once, each stage's layers in one
/// submission). While those times call for a split not tried yet (at most [`CHECK_ROUNDS`]),
/// that split is built, warmed up and checked the same way; the most even one is kept.
fn placed_pipeline(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    prompts: &[Vec<u32>],
    phase: Phase,
) -> Result<PipelineEngine, Box<dyn std::error::Error>> {
    let mut costs = probe_costs(gpus, weights, phase.probe_tokens())?;
    let mut best: Option<Checked> = None;
    let (mut tried, mut checks) = (Vec::new(), Vec::new());
    for _ in 0..CHECK_ROUNDS {
        let checked = Checked::new(gpus, weights, prompts, &costs, phase)?;
        checks.push(checked.describe());
        tried.push(checked.pp.stage_layers().to_vec());
        costs = rescale_stage_costs(&costs, &checked.run.stages)?;
        let how = Partition::Balanced(costs.clone());
        let next = partition(weights.config.layers, gpus.len(), &how)?;
        if best
            .as_ref()
            .is_none_or(|b| checked.imbalance() < b.imbalance())
        {
            best = Some(checked);
        }
        if tried.contains(&next) {
            break;
        }
    }
    let kept = best.ok_or("no placement checked")?;
    println!("warmed up: {}", phase.warmed(prompts.len()));
    println!(
        "checked with every stage at work (a further split placed by the check before it): \
         {}; kept layers {}",
        checks.join("; "),
        spans(kept.pp.stage_layers())
    );
    Ok(kept.pp)
}

fn spans(ranges: &[std::ops::Range<usize>]) -> String {
    let held: Vec<String> = ranges
        .iter()
        .map(|r| format!("{}..{}", r.start, r.end))
        .collect();
    held.join(", ")
}

fn pipeline(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    costs: &[StageCost],
) -> Result<PipelineEngine, wgpar::WgparError> {
    PipelineEngine::new(
        gpus,
        weights,
        DType::F32,
        &Partition::Balanced(costs.to_vec()),
        MICRO_BATCHES,
        CommConfig::default(),
    )
}

/// Each device's time for a step of one sequence of `tokens` tokens (a prompt, or 1: one
/// decode token), the embedding charged to the first stage and the head to the last, and the
/// layers balanced by it; printed in one line. A prompt's tokens make the layers dearer next
/// to the head (logits for its last token only), so prefill and decode balance differently.
fn probe_costs(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    tokens: usize,
) -> Result<Vec<StageCost>, wgpar::WgparError> {
    let costs = measure_stage_costs(gpus, weights, DType::F32, 1, tokens, PLACEMENT_SAMPLES)?;
    let stages = partition(
        weights.config.layers,
        gpus.len(),
        &Partition::Balanced(costs.clone()),
    )?;
    let ms = |s: f64| format!("{:.2}", s * 1e3);
    let per_device: Vec<String> = costs
        .iter()
        .map(|c| format!("{} ms/layer", ms(c.layer_s)))
        .collect();
    let step = match tokens {
        1 => "one decode token".to_string(),
        n => format!("a {n}-token prompt"),
    };
    println!(
        "placed by measured speed ({step}, median of {PLACEMENT_SAMPLES}): {}; head {} ms on \
         the last device: stages hold layers {}",
        per_device.join(" vs "),
        costs.last().map_or_else(|| "?".into(), |c| ms(c.head_s)),
        spans(&stages)
    );
    Ok(costs)
}

fn report(stats: &PipelineStats) {
    // A perfect pipeline with these stages' measured times (unequal stages included) would
    // run in the ideal makespan; its bubble is the idle share of that.
    let busy: f64 = stats.stages.iter().map(|s| s.busy_s).sum();
    let p = stats.stages.len().max(1) as f64;
    let measured_stages = if stats.ideal_makespan_s > 0.0 {
        1.0 - busy / (p * stats.ideal_makespan_s)
    } else {
        0.0
    };
    println!(
        "\nbubble: measured {:.0}%; theory {:.0}% with equal stages, {:.0}% with these stages' \
         measured times; throughput {:.0} tokens/s, {:.0}% of the ideal pipeline",
        stats.measured_bubble * 100.0,
        stats.theoretical_bubble * 100.0,
        measured_stages * 100.0,
        stats.tokens_per_s(),
        stats.tokens_per_s() / stats.ideal_tokens_per_s() * 100.0
    );
    for s in &stats.stages {
        println!(
            "  layers {:>2}..{:<2} on {}: busy {:.1} ms, idle {:.1} ms, hand-off {:.2} ms, {} B out",
            s.layers.start,
            s.layers.end,
            s.device,
            s.busy_s * 1e3,
            (stats.makespan_s - s.busy_s).max(0.0) * 1e3,
            s.handoff_s() * 1e3,
            s.bytes_out
        );
    }
}
