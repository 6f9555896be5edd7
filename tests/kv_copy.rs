//! Device-side KV copies between slots (`BatchStep::kv_copies`) on every serving engine: a
//! prefix copied from the slot that computed it, then the rest of the prompt prefilled at
//! that past, gives exactly the logits and greedy tokens of a slot that computed the whole
//! prompt itself (in the same chunks), in f32 and f16 caches, over an odd number of
//! positions; a slot left holding garbage (no copy) does not. Bad copies are typed errors
//! and the engine keeps serving.

mod common;
mod kv_copy_support;

use kv_copy_support::{
    bad_copies_are_refused, copy_matches_recompute, engine, gpus, llama, run, step, strategies,
};
use wgpar::device::KvCacheType;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{KvCopy, PartitionSpec, Schedule, Strategy};
use wgpar::WgparError;

/// GPT-2 with heads of 9: an f16 head of an odd prefix ends mid-word.
fn gpt2_odd_head(max_seq: usize) -> ModelConfig {
    ModelConfig {
        name: "tiny-gpt2-odd".into(),
        heads: 3,
        kv_heads: 3,
        head_dim: 9,
        hidden: 27,
        ffn: 70,
        layers: 2,
        vocab: 97,
        max_seq,
        ..ModelConfig::preset("tiny-gpt2").unwrap()
    }
}

/// On every engine, in f32 and f16 caches: each `(prefix, length)` case's copied prefix gives
/// the logits of a slot that computed it in place (the same KV and the same rows of one step:
/// the same arithmetic), and with `refusals` bad copies are refused; returns the cases
/// compared.
fn copies_match_on_every_engine(
    weights: &ModelWeights,
    cases: &[(usize, usize)],
    refusals: bool,
) -> usize {
    let mut compared = 0;
    for (kv, kv_label) in [(KvCacheType::F32, "f32 KV"), (KvCacheType::F16, "f16 KV")] {
        let Some(all) = gpus(4, kv) else { continue };
        for (name, strategy, devices) in strategies() {
            let label = format!("{name}, {kv_label}");
            let mut e = engine(&strategy, &all[..devices], weights);
            for &(k, len) in cases {
                let gap = copy_matches_recompute(&label, e.as_mut(), k, len);
                assert!(gap <= 1e-5, "{label}, k={k}: logits differ by {gap}");
                compared += 1;
            }
            if refusals {
                bad_copies_are_refused(&label, e.as_mut());
            }
        }
    }
    compared
}

#[test]
fn a_copied_prefix_gives_the_tokens_of_one_computed_in_place_on_every_engine() {
    let weights = ModelWeights::synthetic(&llama(), 31);
    // An odd prefix, then one that fills all but a position of the slot.
    let compared = copies_match_on_every_engine(&weights, &[(7, 12), (29, 33)], true);
    assert!(compared >= 8, "compared {compared} cases");
}

/// f16 heads of 9: a prefix of 7 positions is 63 halves, which ends mid-word; the copy
/// takes the word whole (one position past the prefix, which the next step overwrites).
#[test]
fn an_f16_prefix_that_ends_mid_word_copies_whole() {
    let config = gpt2_odd_head(24);
    let weights = ModelWeights::synthetic(&config, 5);
    let Some(all) = gpus(2, KvCacheType::F16) else {
        return;
    };
    let pipeline = Strategy::Pipeline {
        partition: PartitionSpec::Even,
        micro_batches: 2,
        schedule: Schedule::InFlight,
    };
    for (name, strategy, devices) in [("single", Strategy::Single, 1), ("pp2", pipeline, 2)] {
        let mut e = engine(&strategy, &all[..devices], &weights);
        let gap = copy_matches_recompute(name, e.as_mut(), 7, 11);
        assert!(gap <= 1e-5, "{name}: logits differ by {gap}");
    }
}

/// Odd heads in slots of an odd length put every other f16 slot at a 2-byte offset, which
/// no buffer copy reaches: refused, whatever the cache's type, before anything runs.
#[test]
fn odd_heads_in_odd_slots_are_refused_by_name() {
    let config = gpt2_odd_head(23);
    let weights = ModelWeights::synthetic(&config, 5);
    let all = gpus(1, KvCacheType::F32).unwrap();
    let mut e = engine(&Strategy::Single, &all, &weights);
    let copy = KvCopy {
        from: 1,
        to: 0,
        tokens: 4,
    };
    let err = run(e.as_mut(), step(&[(0, 4)], 1, vec![3], vec![copy])).unwrap_err();
    assert!(
        matches!(err, WgparError::KvCopy { .. }) && err.to_string().contains("odd head_dim"),
        "{err}"
    );
    run(e.as_mut(), step(&[(0, 0)], 2, vec![3, 4], Vec::new())).unwrap();
}

/// Gemma 3's sliding layers keep a ring per slot (32 rows in slots of 96): a copy takes the
/// source slot's ring whole, beside the global layer's positions; the copied prefix then
/// gives the logits and tokens of one computed in place, decoding past the ring's length's
/// worth of positions, in f32 and f16 caches, on every engine.
#[test]
fn a_ring_models_copied_prefix_gives_the_tokens_of_one_computed_in_place() {
    let config = ModelConfig::preset("tiny-gemma3").unwrap();
    assert_eq!((config.cached_positions(0), config.max_seq), (32, 96));
    let weights = ModelWeights::synthetic(&config, 37);
    // Chunks within the ring's step of 16: the prefix, then the rest.
    let compared = copies_match_on_every_engine(&weights, &[(7, 12), (16, 30)], false);
    assert!(compared >= 8, "compared {compared} cases");
}
