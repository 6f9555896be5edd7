//! Device-side span timing with timestamp queries, and the engines' use of it in traces.

mod common;

use std::time::Instant;

use wgpar::device::{DType, GpuTimer, SpanTimer};
use wgpar::kernels::ops::{self, MatmulIo, MatmulKernel};
use wgpar::parallel::{Engine, SingleEngine};
use wgpar::trace::{DeviceTiming, Recorder, SpanKind};

#[test]
fn timestamps_bracket_the_device_work_of_a_submission() {
    let gpu = &common::gpus(1)[0];
    let Some(timer) = GpuTimer::new(gpu) else {
        // Host clocks only: nothing to check on an adapter without TIMESTAMP_QUERY.
        common::feature_missing("TIMESTAMP_QUERY", "device span timing");
        return;
    };
    let (m, n, k) = (64, 200, 256);
    let x = gpu.upload_f32("x", &common::random(m * k, 1)).unwrap();
    let w = gpu
        .upload_weights("w", &common::random(n * k, 2), DType::F32)
        .unwrap();
    let y = gpu.empty("y", DType::F32, m * n).unwrap();
    let timed = |dispatches: usize| {
        let mut enc = gpu.encoder();
        timer.begin(&mut enc);
        for _ in 0..dispatches {
            let io = MatmulIo {
                x: &x,
                w: &w,
                bias: None,
                y: &y,
            };
            ops::matmul(gpu, &mut enc, io, (m, n, k), MatmulKernel::Naive).unwrap();
        }
        timer.end(&mut enc);
        let t0 = Instant::now();
        gpu.submit(enc);
        gpu.wait().unwrap();
        let host_us = t0.elapsed().as_secs_f64() * 1e6;
        (timer.read_us(gpu).unwrap(), host_us)
    };
    // Compile and warm up.
    timed(1);
    // The device time sits inside the host's submit-to-wait window, every time.
    let bracketed = |dispatches: usize| {
        let (device_us, host_us) = timed(dispatches);
        assert!(
            device_us <= host_us,
            "{dispatches} matmuls: {device_us} us on the device vs {host_us} us on the host"
        );
        device_us
    };
    // The least of three samples each, so that one preempted sample on a shared machine does
    // not decide the comparisons of work below.
    let least = |samples: [f64; 3]| samples.into_iter().fold(f64::INFINITY, f64::min);
    let empty_us = least([bracketed(0), bracketed(0), bracketed(0)]);
    let one_us = least([bracketed(1), bracketed(1), bracketed(1)]);
    let eight_us = least([bracketed(8), bracketed(8), bracketed(8)]);
    assert!(one_us > 0.0, "1 matmul took {one_us} us");
    assert!(
        eight_us > 4.0 * one_us,
        "8 matmuls {eight_us} us, 1 matmul {one_us} us"
    );
    assert!(
        empty_us < one_us,
        "nothing {empty_us} us, 1 matmul {one_us} us"
    );

    // A disabled span timer measures nothing and costs nothing.
    let off = SpanTimer::new(gpu, false);
    assert!(!off.is_active());
    assert_eq!(off.read_us(gpu).unwrap(), None);
}

#[test]
fn traced_compute_spans_carry_device_time_within_their_host_time() {
    let gpu = common::gpus(1).remove(0);
    let has_timestamps = GpuTimer::new(&gpu).is_some();
    let config = wgpar::model::ModelConfig::preset("tiny-llama").unwrap();
    let weights = wgpar::model::ModelWeights::synthetic(&config, 7);
    let mut engine = SingleEngine::new(gpu, &weights, DType::F32).unwrap();
    let prompts = common::prompts(2, 8, config.vocab, 3);
    engine.prefill(&prompts).unwrap();
    // On: this test machine's adapter is a CPU driver, which `Auto` leaves on host clocks.
    let rec = Recorder::new().with_device_timing(DeviceTiming::On);
    engine.set_recorder(rec.clone());
    engine.prefill(&prompts).unwrap();
    engine.decode(&[1, 2]).unwrap();
    let timeline = rec.timeline();
    let compute: Vec<_> = timeline
        .spans
        .iter()
        .filter(|s| s.kind == SpanKind::Compute)
        .collect();
    assert_eq!(compute.len(), 2);
    // Each forward holds the LM head for its two sequences' last tokens.
    let head = 2 * 2 * (config.hidden * config.vocab) as u64;
    for s in &compute {
        let h = s.head.expect("a forward records its head part");
        assert!(
            h.flops == head && h.flops < s.flops && h.bytes < s.bytes,
            "{h:?}"
        );
    }
    for s in compute {
        match s.device_ns {
            Some(ns) => {
                assert!(has_timestamps);
                assert!(
                    ns > 0 && ns <= s.dur_ns,
                    "{ns} ns on a {} ns span",
                    s.dur_ns
                );
            }
            None => assert!(!has_timestamps, "{} lacks device time", s.name),
        }
    }
    // Untraced again: no timer work.
    engine.set_recorder(Recorder::disabled());
    engine.decode(&[3, 4]).unwrap();
}

#[test]
fn automatic_device_timing_leaves_cpu_drivers_on_host_clocks() {
    let gpu = common::gpus(1).remove(0);
    let cpu = gpu.info().is_cpu();
    let config = wgpar::model::ModelConfig::preset("tiny-llama").unwrap();
    let weights = wgpar::model::ModelWeights::synthetic(&config, 7);
    let mut engine = SingleEngine::new(gpu.clone(), &weights, DType::F32).unwrap();
    let prompts = common::prompts(1, 4, config.vocab, 3);
    for (timing, expect) in [
        (DeviceTiming::Auto, !cpu && GpuTimer::new(&gpu).is_some()),
        (DeviceTiming::Off, false),
    ] {
        let rec = Recorder::new().with_device_timing(timing);
        engine.set_recorder(rec.clone());
        engine.prefill(&prompts).unwrap();
        let timed = rec.timeline().spans.iter().any(|s| s.device_ns.is_some());
        assert_eq!(timed, expect, "{timing:?}");
    }
}

#[test]
fn tensor_and_pipeline_runs_time_every_compute_span_on_the_device() {
    let gpu = common::gpus(1).remove(0);
    if GpuTimer::new(&gpu).is_none() {
        common::feature_missing("TIMESTAMP_QUERY", "device span timing");
        return;
    }
    let dir = std::env::temp_dir().join(format!("wgpar-device-timer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, strategy) in [
        ("tp", &["--strategy", "tp"][..]),
        ("pp", &["--strategy", "pp", "--micro-batches", "2"][..]),
    ] {
        let trace = dir.join(format!("{name}.json"));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_wgpar"))
            .args(["run", "--model", "tiny-llama", "--virtual", "2"])
            .args(strategy)
            .args(["--batch", "2", "--prompt-len", "8", "--gen", "2"])
            .args(["--device-timestamps", "on", "--trace"])
            .arg(&trace)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("device time (timestamp queries)"),
            "{stdout}"
        );
        let timeline = wgpar::trace::Timeline::read_chrome_trace(&trace).unwrap();
        let compute: Vec<_> = timeline
            .spans
            .iter()
            .filter(|s| s.kind == SpanKind::Compute)
            .collect();
        assert!(!compute.is_empty());
        for s in compute {
            let ns = s
                .device_ns
                .unwrap_or_else(|| panic!("{name}: {} untimed", s.name));
            assert!(
                ns <= s.dur_ns,
                "{name}: {} device {ns} ns > host {} ns",
                s.name,
                s.dur_ns
            );
        }
    }
    std::fs::remove_dir_all(dir).ok();
}
