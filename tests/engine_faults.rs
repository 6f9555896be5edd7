//! Faults in tensor-parallel ranks and pipeline stages (issue 16 items 8 and 11): each ends the
//! step with a typed error that names the worker and keeps its cause, the engine refuses
//! further work, and dropping it joins every thread it started.

mod common;

use std::time::{Duration, Instant};

use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, Fault, FaultKind, Partition, PipelineEngine, TensorParallelEngine};
use wgpar::WgparError;

/// Names of the threads wgpar started in this process (Linux; elsewhere the join check is
/// skipped), by the names it gives them: tensor-parallel ranks (`tp rank N ...`), collective
/// workers (`wgpar-comm-N`) and the pipeline's stage and hand-off threads (`pp-...`). The driver's own threads (lavapipe's rasterizer pool, Mesa's shader-cache
/// writer) come and go with devices and caches on their own schedule, so they are not counted.
fn threads() -> Option<Vec<String>> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let mut names: Vec<String> = tasks
        .filter_map(|t| t.ok())
        .map(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .map(|n| n.trim().to_string())
                .unwrap_or_default()
        })
        .filter(|n: &String| {
            ["tp rank", "wgpar-", "pp-"]
                .iter()
                .any(|p| n.starts_with(p))
        })
        .collect();
    names.sort();
    Some(names)
}

/// Waits until this process's threads are those of `before` again, up to a few seconds: a
/// joined thread can stay listed in `/proc` for a moment while the kernel finishes its exit, so
/// one read right after the join can still show it. A thread that was never joined stays, and
/// fails the check with its name.
fn assert_threads_back_to(before: &Option<Vec<String>>, kind: FaultKind) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut now = threads();
    while now != *before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        now = threads();
    }
    assert_eq!(now, *before, "{kind:?}: threads left running");
}

/// The engine just built runs threads of its own, so the join check compares something. A new
/// thread names itself once it runs, so this waits for the names a moment.
fn assert_started_threads(before: &Option<Vec<String>>) {
    let Some(before) = before else { return };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut now = threads().unwrap_or_default();
    while now.len() <= before.len() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        now = threads().unwrap_or_default();
    }
    assert!(now.len() > before.len(), "no wgpar thread started: {now:?}");
}

/// The innermost cause of an error chain.
fn root(e: &WgparError) -> String {
    let mut cause: &dyn std::error::Error = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

fn check_fault(
    engine: &mut dyn Engine,
    kind: FaultKind,
    worker: &str,
    prompts: &[Vec<u32>],
    steps_before: usize,
) {
    engine.prefill(prompts).unwrap();
    let mut next: Vec<u32> = vec![1; prompts.len()];
    for _ in 1..steps_before {
        next = engine.decode(&next).unwrap().argmax();
    }
    let start = Instant::now();
    let e = engine.decode(&next).unwrap_err();
    let took = start.elapsed();
    let text = e.to_string();
    eprintln!("{kind:?}: {text} ({took:?})");
    assert!(text.contains(worker), "{kind:?}: {text}");
    assert!(
        took < Duration::from_secs(1),
        "{kind:?}: the failure took {took:?}"
    );
    match kind {
        FaultKind::Error => {
            assert!(
                matches!(&e, WgparError::WorkerFailed { .. }),
                "{kind:?}: {e:?}"
            );
            assert!(root(&e).starts_with("injected error fault"), "{}", root(&e));
        }
        FaultKind::Panic => {
            assert!(
                matches!(&e, WgparError::WorkerPanicked { .. }),
                "{kind:?}: {e:?}"
            );
        }
        FaultKind::LoseDevice => {
            assert!(root(&e).contains("was lost"), "{kind:?}: {}", root(&e));
        }
    }
    assert!(!text.contains("invalid configuration"), "{text}");
    let again = engine.decode(&next).unwrap_err();
    assert!(
        matches!(again, WgparError::EngineStopped { .. }),
        "{again:?}"
    );
}

#[test]
fn tensor_parallel_rank_faults_end_cleanly() {
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let weights = ModelWeights::synthetic(&config, 4);
    let prompts = common::prompts(2, 5, config.vocab, 6);
    for kind in [FaultKind::Error, FaultKind::Panic, FaultKind::LoseDevice] {
        let gpus = common::gpus(2);
        let before = threads();
        let mut tp =
            TensorParallelEngine::new(&gpus, &weights, DType::F32, None, CommConfig::default())
                .unwrap();
        assert_started_threads(&before);
        tp.inject_fault(1, Fault { after: 2, kind }).unwrap();
        check_fault(&mut tp, kind, "rank 1", &prompts, 2);
        drop(tp);
        assert_threads_back_to(&before, kind);
    }
}

#[test]
fn pipeline_stage_faults_keep_their_cause() {
    let config = ModelConfig::preset("tiny-gpt2").unwrap();
    let weights = ModelWeights::synthetic(&config, 4);
    let prompts = common::prompts(2, 5, config.vocab, 6);
    for kind in [FaultKind::Error, FaultKind::Panic, FaultKind::LoseDevice] {
        let gpus = common::gpus(2);
        let before = threads();
        let mut pp = PipelineEngine::new(
            &gpus,
            &weights,
            DType::F32,
            &Partition::Even,
            1,
            CommConfig::default(),
        )
        .unwrap();
        assert_started_threads(&before);
        Engine::inject_fault(&mut pp, 1, Fault { after: 2, kind }).unwrap();
        check_fault(&mut pp, kind, "stage 1", &prompts, 2);
        drop(pp);
        assert_threads_back_to(&before, kind);
    }
}
