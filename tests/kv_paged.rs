//! Paged KV addressing (`BatchStep::kv_tables`) on every serving engine: a slot whose blocks
//! are scattered over other slots' regions of the pool (its short tail block on another
//! region's tail) gives exactly the logits and greedy tokens of a slot in the contiguous
//! layout, in f32 and f16 caches, with every block poisoned first; copies run through the
//! tables; a block moved under a running sequence moves its reads; bad tables are typed
//! errors and the engine keeps serving.

mod common;
mod kv_copy_support;

use kv_copy_support::{
    bad_tables_are_refused, engine, gpus, llama, scattered_blocks_match_contiguous, strategies,
};
use wgpar::device::KvCacheType;
use wgpar::model::ModelWeights;

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
