//! The sequence table at the model level: rows of one step with different past lengths, in
//! permuted KV slots, give the CPU reference's per-sequence results (Llama: RoPE; GPT-2:
//! learned positions), for prefill-sized and decode steps and through slot reuse.

mod common;

use wgpar::device::DType;
use wgpar::model::{CpuReference, GpuModel, ModelConfig, ModelWeights, Placement, SeqRow, Step};

/// Runs one step of `rows` (slot, tokens; equal lengths) on the GPU model; returns each row's
/// logits.
fn gpu_step(
    m: &GpuModel,
    act: &mut wgpar::model::Activations,
    kv: &mut wgpar::model::KvCache,
    rows: &[(usize, usize, Vec<u32>)],
) -> Vec<Vec<f32>> {
    let seq = rows[0].2.len();
    let step = Step {
        batch: rows.len(),
        seq,
        past: 0,
    };
    let table: Vec<SeqRow> = rows
        .iter()
        .map(|&(slot, past, _)| SeqRow { slot, past })
        .collect();
    let ids: Vec<u32> = rows.iter().flat_map(|r| r.2.clone()).collect();
    m.write_ids(act, &ids).unwrap();
    m.begin_step(act, kv, &step, &table).unwrap();
    let gpu = m.gpu();
    let mut enc = gpu.encoder();
    m.embed(&mut enc, act).unwrap();
    m.layers(&mut enc, act, kv).unwrap();
    m.head(&mut enc, act).unwrap();
    gpu.submit(enc);
    let vocab = m.config().vocab;
    let logits = gpu.read_f32(act.logits().unwrap()).unwrap();
    logits[..rows.len() * vocab]
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect()
}

fn check(config: &ModelConfig) {
    let gpu = common::gpus(1).remove(0);
    let weights = ModelWeights::synthetic(config, 21);
    let m = GpuModel::upload(gpu, &weights, Placement::whole(config), DType::F32).unwrap();
    let slots = 4;
    let mut act = m.activations(16, 3).unwrap();
    let mut kv = m.kv_cache(slots).unwrap();
    let mut cpu = CpuReference::with_slots(&weights, slots).unwrap();
    let vocab = config.vocab;
    let mut compare = |cpu: &mut CpuReference, what: &str, rows: Vec<(usize, usize, Vec<u32>)>| {
        for &(slot, past, _) in &rows {
            assert_eq!(cpu.past(slot), past, "{what}: test bookkeeping");
        }
        let got = gpu_step(&m, &mut act, &mut kv, &rows);
        let cpu_rows: Vec<(usize, &[u32])> = rows.iter().map(|r| (r.0, &r.2[..])).collect();
        let want = cpu.step(&cpu_rows).unwrap();
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            let w: Vec<f64> = w.iter().map(|&v| v as f64).collect();
            let err = common::rel_err(g, &w);
            assert!(
                err <= 1e-4,
                "{} {what} row {b} (slot {}): relative error {err:.2e}",
                config.name,
                rows[b].0
            );
        }
    };
    let p = |n: usize, seed: u64| common::prompts(1, n, vocab, seed).remove(0);
    // Three sequences prefilled one by one into slots 2, 0 and 3, with different lengths.
    compare(&mut cpu, "prefill slot 2", vec![(2, 0, p(5, 1))]);
    compare(&mut cpu, "prefill slot 0", vec![(0, 0, p(3, 2))]);
    compare(&mut cpu, "prefill slot 3", vec![(3, 0, p(8, 3))]);
    // One decode step over all three: pasts 5, 3, 8 in slots 2, 0, 3 (table order differs
    // from slot order).
    compare(
        &mut cpu,
        "decode",
        vec![(2, 5, p(1, 4)), (0, 3, p(1, 5)), (3, 8, p(1, 6))],
    );
    // Two new tokens per row at different pasts (a chunked step).
    compare(&mut cpu, "chunk", vec![(3, 9, p(2, 7)), (2, 6, p(2, 8))]);
    // Slot 0 is freed and reused by a new sequence while slot 2 goes on decoding.
    cpu.release(0);
    compare(
        &mut cpu,
        "reuse slot 0",
        vec![(0, 0, p(4, 9)), (2, 8, p(4, 10))],
    );
    compare(
        &mut cpu,
        "decode after reuse",
        vec![(0, 4, p(1, 11)), (2, 12, p(1, 12))],
    );
}

#[test]
fn llama_rows_with_their_own_slots_and_pasts() {
    check(&ModelConfig::preset("tiny-llama").unwrap());
}

#[test]
fn gpt2_rows_with_their_own_slots_and_pasts() {
    check(&ModelConfig::preset("tiny-gpt2").unwrap());
}

#[test]
fn bad_tables_are_refused_before_any_dispatch() {
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let gpu = common::gpus(1).remove(0);
    let weights = ModelWeights::synthetic(&config, 21);
    let m = GpuModel::upload(gpu, &weights, Placement::whole(&config), DType::F32).unwrap();
    let mut act = m.activations(8, 2).unwrap();
    let mut kv = m.kv_cache(2).unwrap();
    let step = Step {
        batch: 2,
        seq: 1,
        past: 0,
    };
    let row = |slot, past| SeqRow { slot, past };
    let mut err = |rows: &[SeqRow]| {
        m.begin_step(&mut act, &mut kv, &step, rows)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&[row(0, 0)]).contains("1 rows for a step of 2"));
    assert!(err(&[row(0, 0), row(2, 0)]).contains("KV slot 2, the cache has 2"));
    assert!(err(&[row(1, 0), row(1, 3)]).contains("share KV slot 1"));
    let e = err(&[row(0, config.max_seq), row(1, 0)]);
    assert!(e.contains("exceed max_seq"), "{e}");
    m.begin_step(&mut act, &mut kv, &step, &[row(1, 5), row(0, 0)])
        .unwrap();
}
