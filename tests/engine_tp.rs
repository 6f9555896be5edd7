//! Tensor parallelism against the single-device engine: TP = 2, 3, 4, both families, random
//! configurations, even and uneven splits, prefill then 16 decode steps.

mod common;

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgpar::comm::CommConfig;
use wgpar::device::{DType, Gpu};
use wgpar::model::{Arch, ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, SingleEngine, TensorParallelEngine};

const DECODE_STEPS: usize = 16;

/// Runs both engines on the same tokens (the single engine's greedy choices) and compares
/// logits at every step.
fn compare(
    gpus: &[Arc<Gpu>],
    config: &ModelConfig,
    split: Option<&[usize]>,
    batch: usize,
    seq: usize,
) {
    let weights = ModelWeights::synthetic(config, 3);
    let mut single = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
    let mut tp =
        TensorParallelEngine::new(gpus, &weights, DType::F32, split, CommConfig::default())
            .unwrap_or_else(|e| panic!("{}: {e}", config.name));
    let prompts = common::prompts(batch, seq, config.vocab, 9);
    let mut want = single.prefill(&prompts).unwrap();
    let mut got = tp.prefill(&prompts).unwrap();
    for step in 0..=DECODE_STEPS {
        let err = got.relative_error(&want.data);
        assert!(
            err <= 1e-4,
            "{} tp={} split {split:?} step {step}: relative error {err:.2e}",
            config.name,
            gpus.len()
        );
        if step == DECODE_STEPS {
            break;
        }
        let next = want.argmax();
        want = single.decode(&next).unwrap();
        got = tp.decode(&next).unwrap();
    }
    let stats = tp.last_step().unwrap();
    let layers = config.layers;
    assert_eq!(stats.collectives, 2 * layers, "two all-reduces per layer");
    assert_eq!(
        stats.bytes_sent,
        (2 * layers * batch * config.hidden * 4) as u64
    );
}

/// A random small config that `degree` splits evenly.
fn random_config(arch: Arch, degree: usize, seed: u64) -> ModelConfig {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let base = ModelConfig::preset(if arch == Arch::Llama {
        "tiny-llama"
    } else {
        "tiny-gpt2"
    })
    .unwrap();
    loop {
        let kv_heads = [1, 2, 3, 4, 6][rng.random_range(0..5)];
        let group = if arch == Arch::Llama {
            rng.random_range(1..=3)
        } else {
            1
        };
        let heads = kv_heads * group;
        let head_dim = [8, 12, 16, 20][rng.random_range(0..4)];
        let config = ModelConfig {
            name: format!("random-{arch:?}-{seed}"),
            heads,
            kv_heads,
            head_dim,
            hidden: rng.random_range(40..120),
            ffn: rng.random_range(50..200),
            layers: rng.random_range(1..=3),
            vocab: rng.random_range(100..300),
            ..base.clone()
        };
        if wgpar::model::valid_tp_degrees(&config).contains(&degree) && config.validate().is_ok() {
            return config;
        }
    }
}

#[test]
fn tp_2_3_4_match_single_device_both_families() {
    let gpus = common::gpus(4);
    for degree in [2, 3, 4] {
        for (i, arch) in [Arch::Llama, Arch::Gpt2].into_iter().enumerate() {
            let config = random_config(arch, degree, (degree * 10 + i) as u64);
            compare(&gpus[..degree], &config, None, 2, 7);
        }
    }
}

#[test]
fn tp_presets_even_and_uneven_splits() {
    let gpus = common::gpus(4);
    let llama = ModelConfig::preset("tiny-llama").unwrap(); // 6 heads, 2 KV heads
    compare(&gpus[..2], &llama, None, 2, 5);
    // 3:1 puts 4 and 2 query heads (a KV group split across devices: its KV head is replicated).
    compare(&gpus[..2], &llama, Some(&[3, 1]), 1, 6);
    let gpt2 = ModelConfig::preset("tiny-gpt2").unwrap(); // 6 heads
    compare(&gpus[..3], &gpt2, Some(&[2, 1, 3]), 2, 4);
}

#[test]
fn invalid_degree_lists_valid_degrees() {
    let gpus = common::gpus(4);
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let weights = ModelWeights::synthetic(&config, 1);
    let e = TensorParallelEngine::new(&gpus, &weights, DType::F32, None, CommConfig::default())
        .err()
        .expect("degree 4 must be refused")
        .to_string();
    assert!(e.contains("valid degrees: [1, 2, 6]"), "{e}");
    let e = TensorParallelEngine::new(
        &gpus[..2],
        &weights,
        DType::F32,
        Some(&[1, 1, 1]),
        CommConfig::default(),
    )
    .err()
    .expect("split length must match")
    .to_string();
    assert!(e.contains("3 shares for 2 devices"), "{e}");
}

/// The trace of a TP = 2 step: each all-reduce is one collective group with a span per rank,
/// all starting when the last rank arrived; a rank that arrived earlier shows the difference
/// as a wait span that ends where the collective starts.
#[test]
fn traced_all_reduces_split_waiting_from_communicating() {
    use std::collections::BTreeMap;
    use wgpar::trace::{Recorder, SpanKind};

    let gpus = common::gpus(2);
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let weights = ModelWeights::synthetic(&config, 3);
    let mut tp =
        TensorParallelEngine::new(&gpus, &weights, DType::F32, None, CommConfig::default())
            .unwrap();
    let prompts = common::prompts(2, 8, config.vocab, 9);
    tp.prefill(&prompts).unwrap();
    let rec = Recorder::new();
    tp.set_recorder(rec.clone());
    tp.decode(&[1, 2]).unwrap();
    let timeline = rec.timeline();
    let by_id: BTreeMap<_, _> = timeline.spans.iter().map(|s| (s.id, s)).collect();
    let mut groups: BTreeMap<u64, Vec<_>> = BTreeMap::new();
    for s in timeline
        .spans
        .iter()
        .filter(|s| s.kind == SpanKind::Collective)
    {
        let info = s.collective.as_ref().unwrap();
        assert_eq!((info.participants, info.chunks), (2, 1));
        groups.entry(info.group.unwrap()).or_default().push(s);
    }
    assert_eq!(groups.len(), 2 * config.layers);
    let mut waits = 0;
    for members in groups.values() {
        assert_eq!(members.len(), 2);
        let started = members[0].start_ns;
        for c in members {
            assert_eq!(c.start_ns, started, "members of a group start together");
            let before = by_id[&c.deps[0]];
            match before.kind {
                SpanKind::Wait => {
                    waits += 1;
                    assert_eq!(before.end_ns(), c.start_ns);
                    assert_eq!(before.device, c.device);
                }
                SpanKind::Compute => assert!(before.end_ns() <= c.start_ns),
                other => panic!("collective after a {other:?} span"),
            }
        }
    }
    // The rank that arrives first waits for the other (the engine skips waits under 1 us).
    assert!(waits >= 1, "{waits} waits in {} all-reduces", groups.len());
    // Every layer half records the model's width and its two shards (the projection reads
    // its rate at the block width 96 / sqrt 2); the head is one device's whole matrix.
    for s in timeline
        .spans
        .iter()
        .filter(|s| s.kind == SpanKind::Compute)
    {
        let shards = if s.name == "head" || s.name == "residual" {
            1
        } else {
            2
        };
        assert_eq!((s.width, s.shards), (Some(96), shards), "{}", s.name);
        // The head span is all LM head; nothing else is.
        let head = (s.name == "head").then_some((s.flops, s.bytes));
        assert_eq!(s.head.map(|h| (h.flops, h.bytes)), head, "{}", s.name);
    }
}
