//! Hybrid TP x PP against the single-device engine: 2 x 2 on four devices (and 2 x 1, 1 x 2
//! degenerate forms), both families, GPipe and in-flight schedules.

mod common;

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{DType, Gpu};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{generate, Engine, Partition, PipelineEngine, SingleEngine};

const BAR: f64 = 1e-4;

fn compare(gpus: &[Arc<Gpu>], tp: usize, config: &ModelConfig, m: usize, batch: usize) {
    let weights = ModelWeights::synthetic(config, 31);
    let mut single = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
    let mut hybrid = PipelineEngine::hybrid(
        gpus,
        &weights,
        DType::F32,
        tp,
        &Partition::Even,
        m,
        CommConfig::default(),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", config.name));
    let prompts = common::prompts(batch, 5, config.vocab, 4);
    let mut want = single.prefill(&prompts).unwrap();
    let mut got = hybrid.prefill(&prompts).unwrap();
    for step in 0..6 {
        let err = got.relative_error(&want.data);
        assert!(
            err <= BAR,
            "{} tp={tp} devices={} m={m} step {step}: {err:.2e}",
            config.name,
            gpus.len()
        );
        let next = want.argmax();
        want = single.decode(&next).unwrap();
        got = hybrid.decode(&next).unwrap();
    }
    assert!(hybrid.name().contains(&format!("tp={tp}")) || tp == 1);
    // In-flight generation through the same engine.
    let got = hybrid.generate(&prompts, 4).unwrap();
    let want = generate(&mut single, &prompts, 4).unwrap();
    assert_eq!(got.tokens, want.tokens);
    for (g, w) in got.logits.iter().zip(&want.logits) {
        assert!(g.relative_error(&w.data) <= BAR);
    }
}

#[test]
fn hybrid_2x2_both_families() {
    let gpus = common::gpus(4);
    let llama = ModelConfig {
        layers: 4,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let gpt2 = ModelConfig {
        layers: 3,
        ..ModelConfig::preset("tiny-gpt2").unwrap()
    };
    compare(&gpus, 2, &llama, 1, 2);
    compare(&gpus, 2, &llama, 2, 4);
    compare(&gpus, 2, &gpt2, 3, 3);
    // Degenerate shapes: one stage of two (pure TP through the pipeline machinery).
    compare(&gpus[..2], 2, &gpt2, 2, 2);
}

#[test]
fn hybrid_shape_errors() {
    let gpus = common::gpus(3);
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let weights = ModelWeights::synthetic(&config, 1);
    let e = PipelineEngine::hybrid(
        &gpus,
        &weights,
        DType::F32,
        2,
        &Partition::Even,
        1,
        CommConfig::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("3 devices do not form pipeline stages of 2"),
        "{e}"
    );
}
