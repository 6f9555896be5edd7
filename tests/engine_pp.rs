//! Pipeline parallelism against the single-device engine: p = 2, 3, 4, every schedule, even
//! and uneven partitions, a Vulkan + GL run, and injected failures that must end cleanly.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use wgpar::comm::CommConfig;
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    generate, Engine, Fault, FaultKind, Partition, PipelineEngine, SingleEngine,
};

const BAR: f64 = 1e-5;

fn config(name: &str, layers: usize) -> ModelConfig {
    ModelConfig {
        layers,
        ..ModelConfig::preset(name).unwrap()
    }
}

/// GPipe prefill + decode steps through `Engine`, compared step by step with one device.
fn compare_gpipe(gpus: &[Arc<Gpu>], config: &ModelConfig, how: &Partition, m: usize, batch: usize) {
    let weights = ModelWeights::synthetic(config, 21);
    let mut single = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
    let mut pp =
        PipelineEngine::new(gpus, &weights, DType::F32, how, m, CommConfig::default()).unwrap();
    let prompts = common::prompts(batch, 6, config.vocab, 2);
    let mut want = single.prefill(&prompts).unwrap();
    let mut got = pp.prefill(&prompts).unwrap();
    for step in 0..4 {
        let err = got.relative_error(&want.data);
        assert!(
            err <= BAR,
            "{} p={} {how:?} m={m} step {step}: {err:.2e}",
            config.name,
            gpus.len()
        );
        let next = want.argmax();
        want = single.decode(&next).unwrap();
        got = pp.decode(&next).unwrap();
    }
    let stats = pp.last_run().unwrap();
    assert_eq!(stats.microbatches, m.min(batch));
    assert!(stats.measured_bubble > 0.0 && stats.measured_bubble < 1.0);
}

#[test]
fn gpipe_p2_p3_p4_even_and_uneven() {
    let gpus = common::gpus(4);
    let llama = config("tiny-llama", 6);
    let gpt2 = config("tiny-gpt2", 5);
    for p in [2, 3, 4] {
        compare_gpipe(&gpus[..p], &llama, &Partition::Even, 1, 2);
        compare_gpipe(&gpus[..p], &gpt2, &Partition::Even, p, 2 * p);
    }
    compare_gpipe(&gpus[..2], &llama, &Partition::Explicit(vec![1, 5]), 3, 5);
    compare_gpipe(&gpus[..3], &gpt2, &Partition::Explicit(vec![3, 1, 1]), 4, 4);
}

/// In-flight generation: micro-batches decoding independently match one device, token for
/// token and logits within the bar (streams of requests: tests/serve_engines.rs).
#[test]
fn in_flight_generation_matches_single_device() {
    let gpus = common::gpus(3);
    let config = config("tiny-llama", 4);
    let weights = ModelWeights::synthetic(&config, 5);
    let mut single = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
    let mut pp = PipelineEngine::new(
        &gpus,
        &weights,
        DType::F32,
        &Partition::Even,
        3,
        CommConfig::default(),
    )
    .unwrap();

    let prompts = common::prompts(6, 5, config.vocab, 77);
    let got = pp.generate(&prompts, 5).unwrap();
    assert_eq!(pp.schedule(), wgpar::parallel::Schedule::InFlight);
    let want = generate(&mut single, &prompts, 5).unwrap();
    assert_eq!(got.tokens, want.tokens);
    for (g, w) in got.logits.iter().zip(&want.logits) {
        assert!(g.relative_error(&w.data) <= BAR);
    }
}

/// Stages on different backends: lavapipe Vulkan then llvmpipe GL.
#[test]
fn vulkan_and_gl_stages_in_one_run() {
    let adapters = Adapters::discover().unwrap();
    let vk = adapters.list().iter().find(|a| a.backend == "Vulkan");
    let gl = adapters.list().iter().find(|a| a.backend == "Gl");
    let (Some(vk), Some(gl)) = (vk, gl) else {
        assert!(
            std::env::var("CI").is_err(),
            "CI must have both a Vulkan and a GL adapter"
        );
        eprintln!("skipped: needs a Vulkan and a GL adapter");
        return;
    };
    let gpus = open_devices(
        &adapters,
        &DeviceSelection::Indices(vec![vk.index, gl.index]),
        &GpuOptions::default(),
    )
    .unwrap();
    assert_eq!(gpus[1].info().backend, "Gl");
    compare_gpipe(&gpus, &config("tiny-gpt2", 4), &Partition::Even, 2, 3);
    compare_gpipe(
        &gpus,
        &config("tiny-llama", 3),
        &Partition::Explicit(vec![1, 2]),
        1,
        1,
    );
}

/// A failure in a middle stage ends the run with an error naming that stage, quickly, and
/// the engine then refuses work instead of hanging; dropping it joins every thread.
#[test]
fn injected_failures_end_cleanly() {
    let gpus = common::gpus(3);
    let config = config("tiny-gpt2", 3);
    let weights = ModelWeights::synthetic(&config, 8);
    for kind in [FaultKind::Error, FaultKind::Panic, FaultKind::LoseDevice] {
        let mut pp = PipelineEngine::new(
            &gpus,
            &weights,
            DType::F32,
            &Partition::Even,
            4,
            CommConfig::default(),
        )
        .unwrap();
        pp.set_timeout(Duration::from_secs(10));
        pp.inject_fault(1, Fault { after: 2, kind }).unwrap();
        let prompts = common::prompts(8, 4, config.vocab, 3);
        let start = Instant::now();
        let e = pp.prefill(&prompts).unwrap_err().to_string();
        let took = start.elapsed();
        eprintln!("{kind:?} -> {e} ({took:?})");
        assert!(e.contains("stage 1"), "{kind:?}: {e}");
        assert!(took < Duration::from_secs(5), "{kind:?} took {took:?}");
        let again = pp.prefill(&prompts).unwrap_err().to_string();
        assert!(again.contains("earlier failure"), "{again}");
        let drop_start = Instant::now();
        drop(pp);
        assert!(
            drop_start.elapsed() < Duration::from_secs(5),
            "threads did not stop"
        );
    }
    // The devices of the lost-device run are gone; the others still work.
    let fresh = common::gpus(2);
    compare_gpipe(&fresh, &config, &Partition::Even, 2, 2);
}

#[test]
fn partition_errors_are_clear() {
    let gpus = common::gpus(2);
    let config = config("tiny-llama", 2);
    let weights = ModelWeights::synthetic(&config, 1);
    let e = PipelineEngine::new(
        &gpus,
        &weights,
        DType::F32,
        &Partition::Explicit(vec![2, 1]),
        1,
        CommConfig::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("summing to 2"), "{e}");
    let e = PipelineEngine::new(
        &gpus,
        &weights,
        DType::F32,
        &Partition::Even,
        0,
        CommConfig::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("micro-batches"), "{e}");
}

/// Pacing to a slow modelled link makes every hand-off take at least the link's time, and
/// changes nothing in the results.
#[test]
fn paced_handoffs_take_the_modelled_time() {
    use wgpar::sim::{LinkPacer, LinkSpec};
    let gpus = common::gpus(2);
    let config = config("tiny-gpt2", 2);
    let weights = ModelWeights::synthetic(&config, 9);
    let mut pp = PipelineEngine::new(
        &gpus,
        &weights,
        DType::F32,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    let prompts = common::prompts(2, 4, config.vocab, 1);
    let fast = pp.prefill(&prompts).unwrap();
    // 5 ms per message: two micro-batches cross one boundary (d2h + h2d) and leave the last
    // stage (d2h of logits). Uploads are counted whole; downloads from the moment the stage
    // waits for them (the rest overlaps its next compute).
    pp.set_pacer(Some(Arc::new(LinkPacer::from_link(LinkSpec {
        alpha_us: 5000.0,
        beta_gbps: 10.0,
    }))));
    let slow = pp.prefill(&prompts).unwrap();
    assert_eq!(fast, slow);
    let stats = pp.last_run().unwrap();
    let handoff: f64 = stats.stages.iter().map(|s| s.handoff_s()).sum();
    assert!(handoff >= 2.0 * 0.005 * 0.99, "hand-offs took {handoff} s");
    // The first micro-batch alone crosses three paced messages in sequence.
    assert!(
        stats.makespan_s >= 3.0 * 0.005,
        "makespan {}",
        stats.makespan_s
    );
}

/// Sum of a device's span durations (seconds) and bytes of one kind, and how many there are.
fn spans_of(
    timeline: &wgpar::trace::Timeline,
    device: u32,
    kind: wgpar::trace::SpanKind,
) -> (f64, u64, usize) {
    let mine: Vec<_> = timeline
        .spans
        .iter()
        .filter(|s| s.device == Some(device) && s.kind == kind)
        .collect();
    (
        mine.iter().map(|s| s.dur_ns).sum::<u64>() as f64 / 1e9,
        mine.iter().map(|s| s.bytes).sum(),
        mine.len(),
    )
}

fn assert_close(what: &str, got: f64, want: f64) {
    // Spans store whole nanoseconds.
    assert!(
        (got - want).abs() < 1e-6,
        "{what}: spans {got} s, stats {want} s"
    );
}

/// What the stage statistics say is what the timeline shows: every stage's busy, upload and
/// download time and bytes are the sums of its compute, h2d and d2h spans, also with paced
/// hand-offs (whose sleeps must not land in a compute span); the run's per-device bytes and
/// hand-off counts are the stages' means. A hybrid stage's upload is paced too.
#[test]
fn stage_statistics_are_the_sums_of_the_spans() {
    use wgpar::sim::{LinkPacer, LinkSpec};
    use wgpar::trace::{Recorder, SpanKind};
    let gpus = common::gpus(4);
    let config = config("tiny-gpt2", 4);
    let weights = ModelWeights::synthetic(&config, 12);
    let pacer = Arc::new(LinkPacer::from_link(LinkSpec {
        alpha_us: 3000.0,
        beta_gbps: 10.0,
    }));
    let prompts = common::prompts(4, 3, config.vocab, 5);
    for tp in [1, 2] {
        let devices = if tp == 1 { 2 } else { 4 };
        let mut pp = PipelineEngine::hybrid(
            &gpus[..devices],
            &weights,
            DType::F32,
            tp,
            &Partition::Even,
            2,
            CommConfig::default(),
        )
        .unwrap();
        pp.set_pacer(Some(pacer.clone()));
        let first = pp.prefill(&prompts).unwrap();
        let rec = Recorder::new();
        pp.set_recorder(rec.clone());
        let decoded = pp.decode_greedy(&first.argmax(), 3, false).unwrap();
        let stats = pp.last_run().unwrap().clone();
        let timeline = rec.timeline();
        assert!(timeline.has_complete_dependencies());
        assert_eq!(stats.passes, 2 * 3);
        // Compute spans record the model's width and the stage's tensor-parallel shards (a
        // head: one device's whole matrix).
        for s in timeline
            .spans
            .iter()
            .filter(|s| s.kind == SpanKind::Compute && s.flops > 0)
        {
            let shards = if s.name == "head" { 1 } else { tp as u32 };
            assert_eq!(
                (s.width, s.shards),
                (Some(config.hidden as u32), shards),
                "{}",
                s.name
            );
            // The LM head's share: all of a hybrid's head span; part of a plain pipeline's
            // last stage, one vocabulary-wide matrix per sequence of its micro-batch; none
            // elsewhere.
            let per_sequence = 2 * (config.hidden * config.vocab) as u64;
            let last_stage = tp == 1 && s.device == Some(devices as u32 - 1);
            match s.head {
                Some(h) if s.name == "head" => assert_eq!((h.flops, h.bytes), (s.flops, s.bytes)),
                Some(h) if last_stage => {
                    assert!(h.flops > 0 && h.flops % per_sequence == 0, "{}", h.flops);
                    assert!(
                        h.flops < s.flops && h.bytes < s.bytes,
                        "{h:?} in {}",
                        s.name
                    );
                }
                None => assert!(s.name != "head" && !last_stage, "{} has no head", s.name),
                Some(h) => panic!("{} on device {:?} has head {h:?}", s.name, s.device),
            }
        }
        for (s, st) in stats.stages.iter().enumerate() {
            // A hybrid stage is accounted on its first device (rank 0).
            let dev = (s * tp) as u32;
            let (busy, _, _) = spans_of(&timeline, dev, SpanKind::Compute);
            let (up, up_bytes, ups) = spans_of(&timeline, dev, SpanKind::HostToDevice);
            let (down, down_bytes, downs) = spans_of(&timeline, dev, SpanKind::DeviceToHost);
            let (coll, _, colls) = spans_of(&timeline, dev, SpanKind::Collective);
            assert_close(&format!("tp={tp} stage {s} compute"), busy, st.busy_s);
            assert_close(&format!("tp={tp} stage {s} upload"), up, st.upload_s);
            assert_close(&format!("tp={tp} stage {s} download"), down, st.download_s);
            assert_close(
                &format!("tp={tp} stage {s} collectives"),
                coll,
                st.collective_s,
            );
            assert_eq!((up_bytes, down_bytes), (st.bytes_in, st.bytes_out));
            assert_eq!((ups + downs, colls), (st.transfers, st.collectives));
            assert_eq!(ups, if s == 0 { 0 } else { 6 }, "tp={tp} stage {s}");
            // Every paced message, uploads of hybrid stages included, took the link's time.
            for span in timeline.spans.iter().filter(|x| {
                x.device.is_some_and(|d| d / tp as u32 == s as u32)
                    && matches!(x.kind, SpanKind::HostToDevice | SpanKind::DeviceToHost)
            }) {
                assert!(
                    span.dur_ns >= 3_000_000,
                    "tp={tp}: {} on device {:?} took {} ns",
                    span.name,
                    span.device,
                    span.dur_ns
                );
            }
        }
        let p = stats.stages.len() as f64;
        let mean = |f: &dyn Fn(&wgpar::parallel::StageStats) -> f64| {
            (stats.stages.iter().map(f).sum::<f64>() / p).round()
        };
        let run = &decoded.stats;
        assert_eq!(
            run.bytes_received as f64,
            mean(&|s| (s.bytes_in + s.collective_bytes) as f64)
        );
        assert_eq!(
            run.bytes_sent as f64,
            mean(&|s| (s.bytes_out + s.collective_bytes) as f64)
        );
        assert_eq!(
            run.collectives as f64,
            mean(&|s| (s.transfers + s.collectives) as f64)
        );
        assert_eq!(run.tokens, 4 * 3);
    }
}
