//! Soak runs (issue 16 item 12): a pipeline taking 10,000 micro-batches and a 5,000-token
//! decode, with the process's resident memory sampled as they go. After a warm-up, memory must
//! stay flat within 5 %. Long: ignored in the regular run; run with
//! `cargo test --release --test soak -- --ignored --nocapture --test-threads=1` (figures in
//! docs/BENCHMARKS.md).

mod common;

use std::time::Instant;

use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, Partition, PipelineEngine, SingleEngine};

/// Resident memory of this process, bytes (Linux).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib * 1024
}

/// Prints the samples and checks that, after the first `warm` of them, the largest and the
/// smallest differ by at most 5 % of the smallest.
fn check_flat(what: &str, samples: &[(usize, u64)], warm: usize) {
    let steady = &samples[warm..];
    let lo = steady.iter().map(|s| s.1).min().unwrap();
    let hi = steady.iter().map(|s| s.1).max().unwrap();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    for (i, b) in samples.iter().step_by((samples.len() / 10).max(1)) {
        eprintln!("{what}: after {i:>6}: RSS {:.1} MiB", mib(*b));
    }
    let growth = (hi - lo) as f64 / lo as f64;
    eprintln!(
        "{what}: steady RSS {:.1}..{:.1} MiB over {} samples: spread {:.2} %",
        mib(lo),
        mib(hi),
        steady.len(),
        growth * 100.0
    );
    assert!(
        growth <= 0.05,
        "{what}: memory grew {:.1} %",
        growth * 100.0
    );
}

#[test]
#[ignore = "soak: minutes long; run with --ignored"]
fn pipeline_takes_10000_micro_batches_in_flat_memory() {
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let weights = ModelWeights::synthetic(&config, 3);
    let gpus = common::gpus(2);
    let (batch, m) = (8, 8);
    // The comm layer keeps a bounded log of its last transfers (`stats_capacity`, 65,536 by
    // default, about 250 bytes each): at three transfers per micro-batch it fills only after
    // ~22,000 micro-batches, growing the heap until then by design. A small log shows what
    // the engine itself does over 10,000 micro-batches.
    let comm = CommConfig {
        stats_capacity: 4096,
        ..CommConfig::default()
    };
    let mut pp =
        PipelineEngine::new(&gpus, &weights, DType::F32, &Partition::Even, m, comm).unwrap();
    let prompts = common::prompts(batch, 4, config.vocab, 1);
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut done = 0;
    while done < 10_000 {
        // A prefill and decode steps up to the context, then again from a fresh prefill.
        let mut next = pp.prefill(&prompts).unwrap().argmax();
        done += m;
        for _ in 0..(config.max_seq - 4 - 1).min((10_000 - done) / m) {
            next = pp.decode(&next).unwrap().argmax();
            done += m;
        }
        samples.push((done, rss()));
    }
    let run = pp.pipeline_stats().unwrap();
    eprintln!(
        "pipeline: {done} micro-batches per stage in {:.1} s ({} samples); last bubble {:.0} %",
        start.elapsed().as_secs_f64(),
        samples.len(),
        run.measured_bubble * 100.0
    );
    check_flat("pipeline", &samples, samples.len() / 10);
}

#[test]
#[ignore = "soak: minutes long; run with --ignored"]
fn decode_of_5000_tokens_in_flat_memory() {
    let config = ModelConfig {
        max_seq: 5_008,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let weights = ModelWeights::synthetic(&config, 3);
    let gpus = common::gpus(1);
    let mut engine = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
    drop(weights);
    let prompts = common::prompts(1, 4, config.vocab, 2);
    let start = Instant::now();
    let mut next = engine.prefill(&prompts).unwrap().argmax();
    let mut samples = Vec::new();
    for step in 1..=5_000 {
        next = engine.decode(&next).unwrap().argmax();
        if step % 50 == 0 {
            samples.push((step, rss()));
        }
    }
    eprintln!(
        "decode: 5000 tokens in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    check_flat("decode", &samples, samples.len() / 10);
}
