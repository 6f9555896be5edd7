//! A pipeline you can watch: a deep, thin variant of the default model (16 layers of FFN 384
//! instead of 6 of FFN 1024, see [`demo_model`]) split over every adapter this machine has
//! (or two virtual devices when it has one), eight micro-batches flowing through the stages,
//! then the timeline drawn in the terminal: fill, steady state, drain. Then the same
//! micro-batches decoding in flight: each moves to its next token as soon as its own logits
//! are back, so the stages stay busy with no fill and drain per token. Both pictures come after
//! one untimed prefill and decode token (the warm-up), so they show the steady state.
//!
//! The layers are placed by each device's measured speed (the partition `--layers auto`
//! uses), timed at the decode step's shape: two adapters on one machine are rarely equally
//! fast (a Vulkan and a GL driver, say), and the last stage also holds the LM head. Each
//! report gives two theories: the bubble of a pipeline of equal stages, and that of a perfect
//! pipeline with the stage times just measured, so what is left over is the schedule's own.
//!
//! `cargo run --release --example pipeline_demo`

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    measure_stage_costs, partition, Engine, Partition, PipelineEngine, PipelineStats,
};
use wgpar::trace::{Recorder, SpanKind, Timeline};

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
    let adapters = Adapters::discover()?;
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
    let micro_batches = 8;
    let placement = place_by_speed(&gpus, &weights)?;
    let mut pp = PipelineEngine::new(
        &gpus,
        &weights,
        DType::F32,
        &placement,
        micro_batches,
        CommConfig::default(),
    )?;
    println!("{}", pp.name());
    let prompts: Vec<Vec<u32>> = (0..micro_batches)
        .map(|b| {
            (0..16)
                .map(|i| ((b * 31 + i * 7) % config.vocab) as u32)
                .collect()
        })
        .collect();
    warm_up(&mut pp, &prompts)?;
    let recorder = Recorder::new();
    pp.set_recorder(recorder.clone());
    pp.prefill(&prompts)?;
    let stats = pp.last_run().cloned().ok_or("no run recorded")?;
    println!(
        "\nprefill (GPipe): {} micro-batches through {} stages; each digit is the micro-batch a stage computes\n",
        micro_batches,
        gpus.len()
    );
    draw(&recorder.timeline(), gpus.len());
    report(&stats);
    // Decode in flight: a fresh recorder, so the picture shows only the decode run.
    let first = pp.prefill(&prompts)?;
    let recorder = Recorder::new();
    pp.set_recorder(recorder.clone());
    pp.decode_greedy(&first.argmax(), 6, false)?;
    let stats = pp.last_run().cloned().ok_or("no run recorded")?;
    println!("\ndecode (in flight): 6 tokens per sequence, every micro-batch on its own\n");
    draw(&recorder.timeline(), gpus.len());
    report(&stats);
    Ok(())
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

/// The layers balanced over the stages by each device's measured time for one decode token
/// of one sequence (each micro-batch's decode step), the embedding charged to the first
/// stage and the head to the last; printed in one line.
fn place_by_speed(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
) -> Result<Partition, wgpar::WgparError> {
    let costs = measure_stage_costs(gpus, weights, DType::F32, 1, 1, PLACEMENT_SAMPLES)?;
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
    let held: Vec<String> = stages
        .iter()
        .map(|r| format!("{}..{}", r.start, r.end))
        .collect();
    println!(
        "placed by measured speed (one decode token, median of {PLACEMENT_SAMPLES}): {}; head {} \
         ms on the last device: stages hold layers {}",
        per_device.join(" vs "),
        costs.last().map_or_else(|| "?".into(), |c| ms(c.head_s)),
        held.join(", ")
    );
    Ok(Partition::Balanced(costs))
}

/// One untimed prefill and one untimed decode token through every stage, so that the pictures
/// show the steady state: each device compiles (and autotunes) its kernels for both step shapes
/// on first use, the GL stage slowest, and a cold first token would draw that as a stall.
fn warm_up(pp: &mut PipelineEngine, prompts: &[Vec<u32>]) -> Result<(), wgpar::WgparError> {
    let first = pp.prefill(prompts)?;
    pp.decode_greedy(&first.argmax(), 1, false)?;
    println!(
        "warmed up: one untimed prefill of {} prompts and one decode token through every stage \
         (kernels compiled and tuned, buffers allocated)",
        prompts.len()
    );
    Ok(())
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
            "  layers {:>2}..{:<2} on {}: busy {:.1} ms, hand-off {:.2} ms, {} B out",
            s.layers.start,
            s.layers.end,
            s.device,
            s.busy_s * 1e3,
            s.handoff_s() * 1e3,
            s.bytes_out
        );
    }
}
