//! The KV-copy scenario shared by `tests/kv_copy.rs` (engines in one process) and
//! `tests/mpi_kv_copy.rs` (a pipeline over MPI ranks): a prefix copied from the slot that
//! computed it against the same prefix computed in place, and bad copies refused.
#![allow(dead_code)]

use wgpar::model::ModelConfig;
use wgpar::parallel::{BatchStep, KvCopy, SeqRow, StepDone, StepEngine};
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
