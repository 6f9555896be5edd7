//! A pipeline you can watch: the default model split over every adapter this machine has
//! (or two virtual devices when it has one), eight micro-batches flowing through the stages,
//! then the timeline drawn in the terminal: fill, steady state, drain. Then the same
//! micro-batches decoding in flight: each moves to its next token as soon as its own logits
//! are back, so the stages stay busy with no fill and drain per token. Both pictures come after
//! one untimed prefill and decode token (the warm-up), so they show the steady state.
//!
//! `cargo run --release --example pipeline_demo`

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, Partition, PipelineEngine, PipelineStats};
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
    let config = ModelConfig::preset("default")?;
    let weights = ModelWeights::synthetic(&config, 7);
    let micro_batches = 8;
    let mut pp = PipelineEngine::new(
        &gpus,
        &weights,
        DType::F32,
        &Partition::Even,
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
    println!(
        "\nbubble: measured {:.0}%, theoretical {:.0}%; throughput {:.0} tokens/s, {:.0}% of the ideal pipeline",
        stats.measured_bubble * 100.0,
        stats.theoretical_bubble * 100.0,
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
