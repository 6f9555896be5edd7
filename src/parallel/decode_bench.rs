//! The decode benchmark (`wgpar bench decode`): what one engine's steady decode step costs on
//! the host, how fast it runs, and whether it creates buffers or bind groups per step.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::Engine;
use crate::device::{Created, Gpu};
use crate::error::{Result, WgparError};
use crate::stats::median;

/// One engine's decode figures.
#[derive(Debug, Clone, Serialize)]
pub struct DecodeMeasure {
    /// Median host time to stage, record and submit one decode step (mean over devices);
    /// absent for a pipeline (its stage threads do not report it).
    pub encode_us: Option<f64>,
    /// The same in CPU time of the recording thread (the host work without waits for a
    /// core); absent where the platform has no thread CPU clock.
    pub encode_cpu_us: Option<f64>,
    /// Median wall time of a decode step.
    pub step_ms: f64,
    /// Generated tokens per second over the timed steps.
    pub tokens_per_s: f64,
    /// Buffers created per timed step (most over devices).
    pub buffers_per_step: f64,
    /// Bind groups created per timed step (most over devices).
    pub bind_groups_per_step: f64,
}

/// Prefills `prompts` on `engine` (which runs on `devices`), decodes `warmup` untimed steps,
/// then times `steps` greedy decode steps.
pub fn measure_decode(
    engine: &mut dyn Engine,
    devices: &[Arc<Gpu>],
    prompts: &[Vec<u32>],
    (warmup, steps): (usize, usize),
) -> Result<DecodeMeasure> {
    if steps == 0 {
        return Err(WgparError::InvalidCall("no timed steps".into()));
    }
    let mut next = engine.prefill_step(prompts, false)?.tokens;
    for _ in 0..warmup {
        next = engine.decode_step(&next, false)?.tokens;
    }
    let before = created(devices);
    let (mut encode, mut encode_cpu, mut walls) = (Vec::new(), Vec::new(), Vec::new());
    let start = Instant::now();
    for _ in 0..steps {
        let t = Instant::now();
        next = engine.decode_step(&next, false)?.tokens;
        walls.push(t.elapsed().as_secs_f64());
        let stats = engine.last_step();
        encode.extend(stats.as_ref().and_then(|s| s.encode_s));
        encode_cpu.extend(stats.and_then(|s| s.encode_cpu_s));
    }
    let total = start.elapsed().as_secs_f64();
    let after = created(devices);
    let per_step = |f: fn(&Created) -> u64| {
        (after.iter().zip(&before))
            .map(|(a, b)| f(a).saturating_sub(f(b)))
            .max()
            .unwrap_or(0) as f64
            / steps as f64
    };
    let none = || WgparError::Internal("no timed steps".into());
    Ok(DecodeMeasure {
        encode_us: median(encode).map(|s| s * 1e6),
        encode_cpu_us: median(encode_cpu).map(|s| s * 1e6),
        step_ms: median(walls).ok_or_else(none)? * 1e3,
        tokens_per_s: (prompts.len() * steps) as f64 / total,
        buffers_per_step: per_step(|c| c.buffers),
        bind_groups_per_step: per_step(|c| c.bind_groups),
    })
}

fn created(gpus: &[Arc<Gpu>]) -> Vec<Created> {
    gpus.iter().map(|g| g.created()).collect()
}
