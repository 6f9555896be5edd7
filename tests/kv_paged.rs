//! Paged KV addressing (`BatchStep::kv_tables`) on every serving engine: a slot whose blocks
//! are scattered over other slots' regions of the pool (its short tail block on another
//! region's tail) gives exactly the logits and greedy tokens of a slot in the contiguous
//! layout, in f32 and f16 caches, with every block poisoned first; copies run through the
//! tables; a block moved under a running sequence moves its reads; bad tables are typed
//! errors and the engine keeps serving.

mod common;
mod kv_copy_support;

use std::sync::Arc;

use kv_copy_support::{bad_tables_are_refused, llama, scattered_blocks_match_contiguous, SLOTS};
use wgpar::comm::CommConfig;
use wgpar::device::{DType, Gpu, GpuOptions, KvCacheType};
use wgpar::model::ModelWeights;
use wgpar::parallel::{build_step_engine, PartitionSpec, Schedule, StepEngine, Strategy};

fn strategies() -> Vec<(&'static str, Strategy, usize)> {
    let hybrid = Strategy::Hybrid {
        tp: 2,
        partition: PartitionSpec::Even,
        micro_batches: 2,
        schedule: Schedule::InFlight,
    };
    let pipeline = Strategy::Pipeline {
        partition: PartitionSpec::Even,
        micro_batches: 2,
        schedule: Schedule::InFlight,
    };
    vec![
        ("single", Strategy::Single, 1),
        ("tp2", Strategy::Tensor { split: None }, 2),
        ("pp2 m=2", pipeline, 2),
        ("tp2xpp2 m=2", hybrid, 4),
    ]
}

/// Devices with an f32 or f16 KV cache; `None` where the adapter cannot hold f16.
fn gpus(count: usize, kv: KvCacheType) -> Option<Vec<Arc<Gpu>>> {
    let gpus = common::gpus_with(
        count,
        &GpuOptions {
            kv_cache: kv,
            ..GpuOptions::default()
        },
    );
    if kv == KvCacheType::F16 && !gpus[0].supports_f16_weights() {
        common::feature_missing("SHADER_F16", "paged KV in an f16 cache");
        return None;
    }
    Some(gpus)
}

fn engine(strategy: &Strategy, gpus: &[Arc<Gpu>], weights: &ModelWeights) -> Box<dyn StepEngine> {
    let comm = CommConfig::default();
    let mut e = build_step_engine(strategy, gpus, weights, DType::F32, &comm, (1, 4)).unwrap();
    e.reserve_slots(SLOTS).unwrap();
    e
}

#[test]
fn scattered_blocks_give_the_tokens_of_contiguous_ones_on_every_engine() {
    let config = llama();
    let weights = ModelWeights::synthetic(&config, 31);
    let mut compared = 0;
    for (kv, kv_label) in [(KvCacheType::F32, "f32 KV"), (KvCacheType::F16, "f16 KV")] {
        let Some(all) = gpus(4, kv) else { continue };
        for (name, strategy, devices) in strategies() {
            let label = format!("{name}, {kv_label}");
            let mut e = engine(&strategy, &all[..devices], &weights);
            let gap = scattered_blocks_match_contiguous(&label, e.as_mut());
            // The same KV and the same rows of one step: the same arithmetic.
            assert!(gap <= 1e-5, "{label}: logits differ by {gap}");
            bad_tables_are_refused(&label, e.as_mut());
            compared += 1;
        }
    }
    assert!(compared >= 4, "compared {compared} engines");
}
