//! The KV-copy and block-table scenarios shared by `tests/kv_copy.rs`, `tests/kv_paged.rs`
//! (engines in one process) and `tests/mpi_kv_copy.rs` (a pipeline over MPI ranks): a prefix
//! copied from the slot that computed it against the same prefix computed in place, a slot
//! whose blocks are scattered over the pool against one in the contiguous layout, and bad
//! copies and tables refused.
#![allow(dead_code)]

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{DType, Gpu, GpuOptions, KvCacheType};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    build_step_engine, BatchStep, KvCopy, PartitionSpec, Schedule, SeqRow, SlotTable, StepDone,
    StepEngine, Strategy,
};
use wgpar::WgparError;

use crate::common;

pub const SLOTS: usize = 5;
pub const DECODE_STEPS: usize = 4;

/// Non-tile shapes: 6 heads of 10 (2 KV heads) over a hidden of 60, 4 layers, a vocabulary
/// of 211, slots of 37 positions.
pub fn llama() -> ModelConfig {
    ModelConfig {
        name: "tiny-llama-odd".into(),
        heads: 6,
        kv_heads: 2,
        head_dim: 10,
        hidden: 60,
        ffn: 148,
        layers: 4,
        vocab: 211,
        max_seq: 37,
        ..ModelConfig::preset("tiny-llama").unwrap()
    }
}

/// Rows of `seq` tokens each (`ids` row after row) on lane 0, after `copies`.
pub fn step(rows: &[(usize, usize)], seq: usize, ids: Vec<u32>, copies: Vec<KvCopy>) -> BatchStep {
    tabled(rows, seq, ids, Vec::new(), copies)
}

/// [`step`] after `tables` (applied before the copies).
pub fn tabled(
    rows: &[(usize, usize)],
    seq: usize,
    ids: Vec<u32>,
    tables: Vec<SlotTable>,
    copies: Vec<KvCopy>,
) -> BatchStep {
    BatchStep {
        lane: 0,
        rows: (rows.iter())
            .map(|&(slot, past)| SeqRow { slot, past })
            .collect(),
        seq,
        ids,
        deps: Vec::new(),
        release_us: None,
        logits: true,
        allow: None,
        adjust: None,
        kv_tables: tables,
        kv_copies: copies,
    }
}

pub fn run(e: &mut dyn StepEngine, s: BatchStep) -> wgpar::Result<StepDone> {
    e.submit(s)?;
    Ok(e.complete(None)?.expect("a submitted step completes"))
}

/// Row `r`'s logits.
pub fn row(done: &StepDone, r: usize) -> &[f32] {
    let l = done.logits.as_ref().expect("logits asked for");
    &l.data[r * l.vocab..(r + 1) * l.vocab]
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Slots: `a` computes the prompt's first `k` tokens; `b` and `d` hold garbage there; `c`
/// computes the same first `k` tokens as `a`. Then `a`'s prefix is copied into `b`, and `b`,
/// `c`, `d` prefill the rest at past `k`: `b` must match `c` (logits and greedy decode),
/// `d` (never copied into) must not. Returns the largest logit gap between `b` and `c`.
pub fn copy_matches_recompute(label: &str, e: &mut dyn StepEngine, k: usize, len: usize) -> f32 {
    let vocab = e.model_config().vocab;
    let prompt = common::prompts(1, len, vocab, 7).remove(0);
    let garbage = common::prompts(2, k, vocab, 8);
    let (a, b, c, d) = (3, 0, 4, 1);
    let ids = [&prompt[..k], &prompt[..k], &garbage[0], &garbage[1]].concat();
    let rows = [(a, 0), (c, 0), (b, 0), (d, 0)];
    run(e, step(&rows, k, ids, Vec::new())).unwrap();
    let copy = KvCopy {
        from: a,
        to: b,
        tokens: k,
    };
    let rest = len - k;
    let ids = [&prompt[k..], &prompt[k..], &prompt[k..]].concat();
    let done = run(e, step(&[(b, k), (c, k), (d, k)], rest, ids, vec![copy])).unwrap();
    let gap = max_diff(row(&done, 0), row(&done, 1));
    let poisoned = max_diff(row(&done, 2), row(&done, 1));
    assert!(
        poisoned > 1e-3,
        "{label}: garbage in slot {d} left no trace ({poisoned})"
    );
    assert_eq!(done.tokens[0], done.tokens[1], "{label}: first token");
    let mut next = [done.tokens[0], done.tokens[1]];
    for i in 0..DECODE_STEPS {
        let past = len + i;
        let done = run(
            e,
            step(&[(b, past), (c, past)], 1, next.to_vec(), Vec::new()),
        )
        .unwrap();
        assert_eq!(done.tokens[0], done.tokens[1], "{label}: decode step {i}");
        next = [done.tokens[0], done.tokens[1]];
    }
    gap
}

/// Each bad copy is refused by name, with nothing run; a good step then still runs.
pub fn bad_copies_are_refused(label: &str, e: &mut dyn StepEngine) {
    let max_seq = e.model_config().max_seq;
    let bad = [
        (
            KvCopy {
                from: 2,
                to: 2,
                tokens: 3,
            },
            "onto itself",
        ),
        (
            KvCopy {
                from: 2,
                to: SLOTS,
                tokens: 3,
            },
            "target slot is out of range",
        ),
        (
            KvCopy {
                from: SLOTS + 4,
                to: 0,
                tokens: 3,
            },
            "source slot is out of range",
        ),
        (
            KvCopy {
                from: 2,
                to: 0,
                tokens: max_seq + 1,
            },
            "more positions",
        ),
    ];
    for (copy, why) in bad {
        let e_ = run(e, step(&[(0, 0)], 2, vec![1, 2], vec![copy])).unwrap_err();
        match &e_ {
            WgparError::KvCopy {
                from,
                to,
                tokens,
                slots,
                ..
            } => {
                assert_eq!(
                    (*from, *to, *tokens, *slots),
                    (copy.from, copy.to, copy.tokens, SLOTS)
                );
            }
            other => panic!("{label}: {copy:?} gave {other}"),
        }
        let text = e_.to_string();
        assert!(
            text.contains(why) && text.contains(&copy.tokens.to_string()),
            "{label}: {text}"
        );
    }
    let done = run(e, step(&[(0, 0), (1, 0)], 2, vec![5, 6, 5, 6], Vec::new())).unwrap();
    assert_eq!(
        done.tokens[0], done.tokens[1],
        "{label}: the engine serves on"
    );
}

/// The slot that keeps the identity table in [`scattered_blocks_match_contiguous`].
pub const CONTIGUOUS: usize = SLOTS - 1;

/// Tables that scatter slots `0..SLOTS - 1` over each other's regions of the pool (3 blocks
/// of 16, 16 and 5 positions per slot of 37), leaving [`CONTIGUOUS`]'s region alone: slot s's
/// full blocks are full blocks of other regions, its short tail another region's tail.
pub fn scattered_tables() -> Vec<SlotTable> {
    let full = [0u32, 1, 3, 4, 6, 7, 9, 10];
    let tails = [2u32, 5, 8, 11];
    (0..SLOTS - 1)
        .map(|s| SlotTable {
            slot: s,
            blocks: vec![
                full[(2 * s + 3) % 8],
                full[(2 * s + 4) % 8],
                tails[(s + 1) % 4],
            ],
        })
        .collect()
}

/// Every slot filled with garbage first (every block of the pool poisoned), then slot 0
/// scattered over other slots' blocks runs a prompt in two chunks and decodes to the cache's
/// last position beside [`CONTIGUOUS`] running the same in place: the same logits and tokens
/// at every step, while a scattered slot that skipped the first chunk reads garbage. Then
/// copies through scattered tables ([`copy_matches_recompute`]), and a table changed under
/// a running sequence moves its reads. Returns the largest logit gap.
pub fn scattered_blocks_match_contiguous(label: &str, e: &mut dyn StepEngine) -> f32 {
    let (vocab, max_seq) = (e.model_config().vocab, e.model_config().max_seq);
    assert_eq!(max_seq, 37, "the tables are made for slots of 37 positions");
    let garbage = common::prompts(SLOTS, max_seq, vocab, 9).concat();
    let all: Vec<(usize, usize)> = (0..SLOTS).map(|s| (s, 0)).collect();
    run(e, step(&all, max_seq, garbage, Vec::new())).unwrap();
    let (b, c, d) = (0, CONTIGUOUS, 1);
    let prompt = common::prompts(1, 33, vocab, 10).remove(0);
    let ids = [&prompt[..20], &prompt[..20]].concat();
    let first = tabled(&[(b, 0), (c, 0)], 20, ids, scattered_tables(), Vec::new());
    let done = run(e, first).unwrap();
    let mut gap = max_diff(row(&done, 0), row(&done, 1));
    let ids = [&prompt[20..], &prompt[20..], &prompt[20..]].concat();
    let done = run(e, step(&[(b, 20), (c, 20), (d, 20)], 13, ids, Vec::new())).unwrap();
    gap = gap.max(max_diff(row(&done, 0), row(&done, 1)));
    let poisoned = max_diff(row(&done, 2), row(&done, 1));
    assert!(
        poisoned > 1e-3,
        "{label}: slot {d}'s garbage left no trace ({poisoned})"
    );
    let mut next = [done.tokens[0], done.tokens[1]];
    assert_eq!(next[0], next[1], "{label}: first token");
    for past in 33..max_seq {
        let done = run(
            e,
            step(&[(b, past), (c, past)], 1, next.to_vec(), Vec::new()),
        )
        .unwrap();
        gap = gap.max(max_diff(row(&done, 0), row(&done, 1)));
        assert_eq!(done.tokens[0], done.tokens[1], "{label}: decode at {past}");
        next = [done.tokens[0], done.tokens[1]];
    }
    for (k, len) in [(7, 12), (29, 33)] {
        gap = gap.max(copy_matches_recompute(label, e, k, len));
    }
    a_moved_block_moves_the_reads(label, e);
    gap
}

/// Slots 0 and [`CONTIGUOUS`] hold the same 20 tokens; slot 0's first block then becomes
/// one that holds another slot's garbage (a leading part of its table): its next decode
/// differs from the contiguous slot's, which shows the kernels read through the table.
fn a_moved_block_moves_the_reads(label: &str, e: &mut dyn StepEngine) {
    let vocab = e.model_config().vocab;
    let prompt = common::prompts(1, 21, vocab, 11).remove(0);
    let (b, c) = (0, CONTIGUOUS);
    let ids = [&prompt[..20], &prompt[..20]].concat();
    run(e, step(&[(b, 0), (c, 0)], 20, ids, Vec::new())).unwrap();
    let ids = vec![prompt[20], prompt[20]];
    let same = run(e, step(&[(b, 20), (c, 20)], 1, ids.clone(), Vec::new())).unwrap();
    assert!(
        max_diff(row(&same, 0), row(&same, 1)) <= 1e-5,
        "{label}: same prefix"
    );
    // Slot 1's first block, which the copy scenario left holding garbage.
    let moved = vec![SlotTable {
        slot: b,
        blocks: vec![scattered_tables()[1].blocks[0]],
    }];
    let done = run(e, tabled(&[(b, 20), (c, 20)], 1, ids, moved, Vec::new())).unwrap();
    let gap = max_diff(row(&done, 0), row(&done, 1));
    assert!(gap > 1e-3, "{label}: a moved block changed nothing ({gap})");
    // Back to the scattered table, for whatever runs next.
    let back = scattered_tables().remove(b);
    run(e, tabled(&[(c, 0)], 1, vec![3], vec![back], Vec::new())).unwrap();
}

/// Each bad table is refused by name, with nothing run; a good step then still runs.
pub fn bad_tables_are_refused(label: &str, e: &mut dyn StepEngine) {
    let table = |slot: usize, blocks: Vec<u32>| SlotTable { slot, blocks };
    let bad = [
        (table(SLOTS, vec![0]), "slot is out of range"),
        (table(0, vec![0, 1, 2, 3]), "4 blocks for a slot of 3"),
        (
            table(1, vec![3, 3 * SLOTS as u32]),
            "names block 15 of a pool of 15",
        ),
        (table(2, vec![2]), "short one (5 positions)"),
        (table(2, vec![0, 1, 3]), "short one (5 positions)"),
    ];
    for (t, why) in bad {
        let err = run(
            e,
            tabled(&[(0, 0)], 2, vec![1, 2], vec![t.clone()], Vec::new()),
        )
        .unwrap_err();
        let text = err.to_string();
        match err {
            WgparError::KvTable { slot, slots, .. } => {
                assert_eq!((slot, slots), (t.slot, SLOTS), "{label}: {t:?}");
            }
            other => panic!("{label}: {t:?} gave {other}"),
        }
        assert!(text.contains(why), "{label}: {text}");
    }
    let done = run(e, step(&[(2, 0), (3, 0)], 2, vec![5, 6, 5, 6], Vec::new())).unwrap();
    assert_eq!(
        done.tokens[0], done.tokens[1],
        "{label}: the engine serves on"
    );
}

/// The engines both scenarios run on: name, strategy and devices.
pub fn strategies() -> Vec<(&'static str, Strategy, usize)> {
    let pipeline = Strategy::Pipeline {
        partition: PartitionSpec::Even,
        micro_batches: 2,
        schedule: Schedule::InFlight,
    };
    let hybrid = Strategy::Hybrid {
        tp: 2,
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

/// Devices with an f32 or f16 KV cache; `None` (said by name) where the adapter cannot hold f16.
pub fn gpus(count: usize, kv: KvCacheType) -> Option<Vec<Arc<Gpu>>> {
    let gpus = common::gpus_with(
        count,
        &GpuOptions {
            kv_cache: kv,
            ..GpuOptions::default()
        },
    );
    if kv == KvCacheType::F16 && !gpus[0].supports_f16_weights() {
        common::feature_missing("SHADER_F16", "KV copies and block tables in an f16 cache");
        return None;
    }
    Some(gpus)
}

/// A step engine of `strategy` over `gpus`, f32 activations, with [`SLOTS`] KV slots.
pub fn engine(
    strategy: &Strategy,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
) -> Box<dyn StepEngine> {
    let comm = CommConfig::default();
    let mut e = build_step_engine(strategy, gpus, weights, DType::F32, &comm, (1, 4)).unwrap();
    e.reserve_slots(SLOTS).unwrap();
    e
}
