//! The dispatch path allocates nothing in the token loop: after the first decode step, a
//! decode step creates no buffer and no bind group on any device, for every strategy (the
//! in-flight pipeline schedule included, and with the logits read back too, once their
//! readback exists). Plus the token path itself:
//! device-picked tokens against the logits, seeded device sampling against the host sampler,
//! non-finite logits refused with the step (and the layer on one device), and generation that
//! keeps only what it is asked for.

mod common;

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{Created, DType, Gpu};
use wgpar::model::sampling::{Sampler, SamplingParams};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    generate, generate_keeping, Engine, KeepLogits, Partition, PipelineEngine, Schedule,
    SingleEngine, TensorParallelEngine,
};
use wgpar::WgparError;

fn created(gpus: &[Arc<Gpu>]) -> Vec<Created> {
    gpus.iter().map(|g| g.created()).collect()
}

/// Prefill, two decode steps (the first may bind the decode shape), then `steps` more that
/// must create nothing on any device.
fn assert_steady(engine: &mut dyn Engine, gpus: &[Arc<Gpu>], config: &ModelConfig, logits: bool) {
    let prompts = common::prompts(3, 5, config.vocab, 8);
    let mut next = engine.prefill_step(&prompts, logits).unwrap().tokens;
    for _ in 0..2 {
        next = engine.decode_step(&next, logits).unwrap().tokens;
    }
    let before = created(gpus);
    for _ in 0..4 {
        let out = engine.decode_step(&next, logits).unwrap();
        assert_eq!(out.logits.is_some(), logits);
        next = out.tokens;
    }
    let after = created(gpus);
    for (i, (a, b)) in after.iter().zip(&before).enumerate() {
        assert_eq!(
            *a - *b,
            Created::default(),
            "{}: device {i} created buffers or bind groups in steady-state decode",
            engine.name()
        );
    }
}

fn weights() -> ModelWeights {
    ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 3)
}

#[test]
fn single_device_decode_creates_nothing() {
    let gpus = common::gpus(1);
    let w = weights();
    let mut e = SingleEngine::new(gpus[0].clone(), &w, DType::F32).unwrap();
    assert_steady(&mut e, &gpus, &w.config, false);
    assert_steady(&mut e, &gpus, &w.config, true);
    // Sampling on the device writes its draws, nothing more.
    e.set_sampling(SamplingParams {
        temperature: 0.9,
        top_k: 12,
        top_p: 0.95,
        seed: 4,
    })
    .unwrap();
    assert_steady(&mut e, &gpus, &w.config, false);
}

#[test]
fn tensor_parallel_decode_creates_nothing() {
    let gpus = common::gpus(2);
    let w = weights();
    let mut e =
        TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default()).unwrap();
    assert_steady(&mut e, &gpus, &w.config, false);
}

#[test]
fn pipeline_and_hybrid_decode_create_nothing() {
    let w = weights();
    let gpus = common::gpus(2);
    let mut pp = PipelineEngine::new(
        &gpus,
        &w,
        DType::F32,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    assert_steady(&mut pp, &gpus, &w.config, false);
    drop(pp);
    let gpus = common::gpus(4);
    let mut hybrid = PipelineEngine::hybrid(
        &gpus,
        &w,
        DType::F32,
        2,
        &Partition::Even,
        1,
        CommConfig::default(),
    )
    .unwrap();
    assert_steady(&mut hybrid, &gpus, &w.config, false);
}

/// The in-flight pipeline schedule (each micro-batch to its next token as soon as its own
/// pick is back) creates nothing either once every micro-batch shape has run, and reads back
/// the same tokens as the GPipe schedule.
#[test]
fn in_flight_pipeline_decode_creates_nothing() {
    let w = weights();
    let gpus = common::gpus(2);
    let prompts = common::prompts(3, 5, w.config.vocab, 12);
    let mut pp = PipelineEngine::new(
        &gpus,
        &w,
        DType::F32,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    assert_eq!(pp.schedule(), Schedule::InFlight);
    let first = pp.prefill_step(&prompts, false).unwrap().tokens;
    let warm = pp.decode_greedy(&first, 2, false).unwrap();
    let next: Vec<u32> = warm.tokens.iter().map(|t| t[1]).collect();
    let before = created(&gpus);
    let run = pp.decode_greedy(&next, 4, false).unwrap();
    let after = created(&gpus);
    assert!(run.logits.is_empty());
    for (i, (a, b)) in after.iter().zip(&before).enumerate() {
        assert_eq!(
            *a - *b,
            Created::default(),
            "device {i} created buffers or bind groups in in-flight decode"
        );
    }
    // The same run under GPipe gives the same tokens.
    let mut gpipe = PipelineEngine::new(
        &gpus,
        &w,
        DType::F32,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    gpipe.set_schedule(Schedule::GPipe);
    let g_first = gpipe.prefill_step(&prompts, false).unwrap().tokens;
    assert_eq!(g_first, first);
    let g_warm = gpipe.decode_greedy(&g_first, 2, false).unwrap();
    assert_eq!(g_warm.tokens, warm.tokens);
    let g_run = gpipe.decode_greedy(&next, 4, false).unwrap();
    assert_eq!(g_run.tokens, run.tokens);
}

/// Greedy device picks are the logits' argmax; a seeded device sample is what the host
/// sampler with the same seed picks from the same logits.
#[test]
fn device_picks_match_the_host() {
    let gpus = common::gpus(1);
    let w = weights();
    let prompts = common::prompts(4, 6, w.config.vocab, 9);
    let mut e = SingleEngine::new(gpus[0].clone(), &w, DType::F32).unwrap();
    let out = e.prefill_step(&prompts, true).unwrap();
    assert_eq!(out.tokens, out.logits.as_ref().unwrap().argmax());
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
        seed: 77,
    };
    e.set_sampling(params).unwrap();
    let mut host = Sampler::new(params).unwrap();
    let mut next = out.tokens;
    for step in 0..5 {
        let out = e.decode_step(&next, true).unwrap();
        let logits = out.logits.unwrap();
        let want: Vec<u32> = (0..logits.batch)
            .map(|b| host.sample(logits.row(b)))
            .collect();
        assert_eq!(out.tokens, want, "decode step {step}");
        next = out.tokens;
    }
    // A top-k the device does not do (0: all) falls back to the host sampler, same seed,
    // same tokens.
    let all = SamplingParams { top_k: 0, ..params };
    e.set_sampling(all).unwrap();
    let mut host = Sampler::new(all).unwrap();
    let out = e.decode_step(&next, true).unwrap();
    let logits = out.logits.unwrap();
    let want: Vec<u32> = (0..logits.batch)
        .map(|b| host.sample(logits.row(b)))
        .collect();
    assert_eq!(out.tokens, want);
}

#[test]
fn generation_keeps_logits_only_when_asked() {
    let gpus = common::gpus(1);
    let w = weights();
    let prompts = common::prompts(2, 4, w.config.vocab, 10);
    let mut e = SingleEngine::new(gpus[0].clone(), &w, DType::F32).unwrap();
    let plain = generate(&mut e, &prompts, 6).unwrap();
    assert!(plain.logits.is_empty());
    assert_eq!(
        plain.tokens.iter().map(Vec::len).collect::<Vec<_>>(),
        [6, 6]
    );
    let first = generate_keeping(&mut e, &prompts, 6, KeepLogits::Prefill).unwrap();
    assert_eq!(first.logits.len(), 1);
    let all = generate_keeping(&mut e, &prompts, 6, KeepLogits::All).unwrap();
    assert_eq!(all.logits.len(), 6);
    assert_eq!(plain.tokens, all.tokens);
    // Every kept step's tokens are its logits' argmax.
    for (s, l) in all.logits.iter().enumerate() {
        let picked: Vec<u32> = all.tokens.iter().map(|t| t[s]).collect();
        assert_eq!(picked, l.argmax(), "step {s}");
    }
}

fn poisoned_weights() -> ModelWeights {
    let mut w = weights();
    // An infinite weight in layer 1's MLP: layer 0 is finite, layer 1 is not.
    w.layers[1].w_up[5] = f32::INFINITY;
    w
}

#[test]
fn non_finite_logits_are_refused_with_step_and_layer() {
    let w = poisoned_weights();
    let prompts = common::prompts(2, 4, w.config.vocab, 11);
    let gpus = common::gpus(2);
    let mut single = SingleEngine::new(gpus[0].clone(), &w, DType::F32).unwrap();
    match single.prefill_step(&prompts, false) {
        Err(WgparError::NonFinite {
            step,
            rows,
            location,
        }) => {
            assert_eq!(step, 0);
            assert_eq!(rows, [0, 1]);
            let location = location.unwrap();
            assert!(location.starts_with("layer 1 on gpu0"), "{location}");
        }
        other => panic!("expected a non-finite error, got {other:?}"),
    }
    let mut tp =
        TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default()).unwrap();
    let e = tp.prefill_step(&prompts, false).unwrap_err();
    assert!(matches!(e, WgparError::NonFinite { step: 0, .. }), "{e}");
    let mut pp = PipelineEngine::new(
        &gpus,
        &w,
        DType::F32,
        &Partition::Even,
        1,
        CommConfig::default(),
    )
    .unwrap();
    let e = pp.prefill_step(&prompts, false).unwrap_err();
    assert!(matches!(e, WgparError::NonFinite { step: 0, .. }), "{e}");
}

/// Tuning creates its buffers and bind groups through the device's counters (so the counts
/// above see everything wgpar makes): one bind group per variant timed, and the uniform
/// beside the output scratch.
#[test]
fn tuning_creates_through_the_counters() {
    use wgpar::kernels::tune::{self, Effort, MatmulOperands};
    let gpu = &common::gpus(1)[0];
    let (m, n, k) = (3, 70, 45);
    let x = gpu.upload_f32("x", &common::random(m * k, 5)).unwrap();
    let w = gpu.upload_f32("w", &common::random(n * k, 6)).unwrap();
    let candidates: Vec<_> = wgpar::kernels::variants::MATMUL
        .iter()
        .filter(|v| v.candidate && v.applies(gpu, (m, n, k)))
        .collect();
    let before = gpu.created();
    let operands = MatmulOperands {
        x: x.buffer(),
        w: w.buffer(),
    };
    let timings = tune::measure_matmul_variants(
        gpu,
        (m, n, k),
        wgpar::kernels::WeightType::F32,
        Some(operands),
        Effort::Bench { samples: 1 },
        &candidates,
    )
    .unwrap();
    let made = gpu.created() - before;
    let timed = timings.iter().filter(|t| t.seconds.is_some()).count() as u64;
    assert!(timed >= 2, "only {timed} variants timed");
    assert_eq!(
        made.bind_groups, timed,
        "one counted bind group per variant timed"
    );
    assert_eq!(
        made.buffers, 2,
        "the output scratch and the uniform, both counted"
    );
}
