//! Token tables larger than a storage binding: devices opened with a binding limit below the
//! table's size split the embedding and the LM head into blocks of rows. Every engine must then
//! compute what the CPU reference computes, with the block boundaries inside the vocabulary
//! (not at tile multiples) and tokens on both sides of them.

mod common;

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{DType, Gpu, GpuOptions};
use wgpar::model::quant::{quantize, QuantType};
use wgpar::model::weights::{BlockMatrix, TableBlocks};
use wgpar::model::{CpuReference, ModelConfig, ModelWeights};
use wgpar::parallel::{
    Engine, Logits, Partition, PipelineEngine, SingleEngine, TensorParallelEngine,
};

/// 160 KiB: above every other buffer of the tiny presets at these shapes, below their token
/// table at this vocabulary (2053 x 96 x 4 B = 770 KiB in f32: blocks of 384 rows, the last
/// of 133; 385 KiB in f16: blocks of 832, the last of 389).
const CAP: u64 = 160 << 10;
const VOCAB: usize = 2053;

fn capped_gpus(count: usize) -> Vec<Arc<Gpu>> {
    let options = GpuOptions {
        max_storage_binding: Some(CAP),
        ..GpuOptions::default()
    };
    common::gpus_with(count, &options)
}

fn config(preset: &str, tied_head: bool) -> ModelConfig {
    ModelConfig {
        vocab: VOCAB,
        tied_head,
        ..ModelConfig::preset(preset).unwrap()
    }
}

/// Prompts whose tokens sit in the first, a middle and the last block, and on the rows either
/// side of a block boundary.
fn prompts(batch: usize, seq: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut p = common::prompts(batch, seq, VOCAB, seed);
    // 1599/1600: the edge of a Q8_0 table's blocks (rows of 102 bytes: 1600 rows a block).
    let edges = [
        0u32,
        383,
        384,
        831,
        832,
        1599,
        1600,
        1663,
        1664,
        1920,
        VOCAB as u32 - 1,
    ];
    for (i, &id) in edges.iter().enumerate() {
        p[i % batch][i % seq] = id;
    }
    p
}

/// Runs `engine` against the CPU reference: prefill, then greedy decode steps with the
/// reference's choices, every step's logits within `bar`.
fn check(engine: &mut dyn Engine, weights: &ModelWeights, bar: f64, what: &str) {
    let (batch, seq) = (3, 13);
    let mut oracle = CpuReference::new(weights);
    let prompts = prompts(batch, seq, 7);
    let mut got = engine.prefill(&prompts).unwrap();
    let mut want = oracle.prefill(&prompts).unwrap().concat();
    for step in 0..4 {
        let err = got.relative_error(&want);
        assert!(
            err <= bar,
            "{what} step {step}: relative error {err:.2e} > {bar:.0e}"
        );
        let next = Logits {
            batch,
            vocab: VOCAB,
            data: want.clone(),
        }
        .argmax();
        got = engine.decode(&next).unwrap();
        want = oracle.decode(&next).unwrap().concat();
    }
}

#[test]
fn the_capped_device_cannot_bind_the_whole_table() {
    let gpu = capped_gpus(1).remove(0);
    assert_eq!(gpu.info().max_storage_binding, CAP);
    let table = (VOCAB * 96 * 4) as u64;
    let e = gpu.check_size("wte", table).unwrap_err().to_string();
    assert!(
        e.contains("160.0 KiB") && e.contains("storage binding"),
        "{e}"
    );
}

#[test]
fn single_device_tied_and_untied_f32_and_f16() {
    let gpu = capped_gpus(1).remove(0);
    for (preset, tied) in [
        ("tiny-gpt2", true),
        ("tiny-llama", false),
        ("tiny-llama", true),
    ] {
        let config = config(preset, tied);
        let weights = ModelWeights::synthetic(&config, 11);
        let mut engine = SingleEngine::new(gpu.clone(), &weights, DType::F32).unwrap();
        check(
            &mut engine,
            &weights,
            1e-4,
            &format!("{preset} tied={tied} f32"),
        );
        if gpu.info().shader_f16 {
            let rounded = weights.rounded_to_f16();
            let mut engine = SingleEngine::new(gpu.clone(), &weights, DType::F16).unwrap();
            check(
                &mut engine,
                &rounded,
                1e-3,
                &format!("{preset} tied={tied} f16"),
            );
        }
    }
}

#[test]
fn pipeline_stages_split_their_own_tables() {
    // Tied head on the last stage, which does not hold the embedding: it uploads the table as
    // its head, in blocks of its own.
    let gpus = capped_gpus(2);
    let config = config("tiny-gpt2", true);
    let weights = ModelWeights::synthetic(&config, 5);
    let mut pp = PipelineEngine::new(
        &gpus,
        &weights,
        DType::F32,
        &Partition::Even,
        3,
        CommConfig::default(),
    )
    .unwrap();
    check(&mut pp, &weights, 1e-4, "tiny-gpt2 pp=2 m=3");
}

#[test]
fn tensor_parallel_ranks_split_the_replicated_tables() {
    let gpus = capped_gpus(2);
    let config = config("tiny-llama", false);
    let weights = ModelWeights::synthetic(&config, 9);
    let mut tp =
        TensorParallelEngine::new(&gpus, &weights, DType::F32, None, CommConfig::default())
            .unwrap();
    check(&mut tp, &weights, 1e-4, "tiny-llama tp=2");
}

/// The token line `run` prints.
fn tokens_line(stdout: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with("first sequence's tokens"))
        .unwrap_or_else(|| panic!("no tokens in {stdout}"))
        .to_string()
}

#[test]
fn run_max_binding_splits_the_table_and_refuses_what_cannot_split() {
    let base = [
        "run",
        "--model",
        "tiny-gpt2",
        "--batch",
        "2",
        "--prompt-len",
        "9",
        "--gen",
        "5",
    ];
    let (ok, whole, err) = common::wgpar(&base);
    assert!(ok, "{err}");
    // 150 KiB: below tiny-gpt2's 154 KiB token table (split in two), above its 144 KiB MLP
    // matrices.
    let (ok, split, err) = common::wgpar(&[&base[..], &["--max-binding", "150K"]].concat());
    assert!(ok, "{err}");
    assert_eq!(tokens_line(&split), tokens_line(&whole));
    // A layer matrix cannot be split: refused before a device opens, with both sizes.
    let (ok, _, err) = common::wgpar(&[&base[..], &["--max-binding", "64K"]].concat());
    assert!(!ok);
    assert!(
        err.contains("layer0.") && err.contains("64.0 KiB") && err.contains("storage binding"),
        "{err}"
    );
    let (ok, _, err) = common::wgpar(&[&base[..], &["--max-binding", "12Q"]].concat());
    assert!(!ok && err.contains("not a size"), "{err}");
}

/// `weights` with its token table (and untied head) held in Q8_0 blocks alone, as a GGUF
/// file's are: 2053 rows of 102 bytes, split under the cap into 1600 rows and 453.
fn in_blocks(mut weights: ModelWeights) -> ModelWeights {
    let blocks = |values: &[f32]| BlockMatrix {
        dtype: QuantType::Q8_0,
        rows: VOCAB,
        cols: weights.config.hidden,
        bytes: quantize(QuantType::Q8_0, values),
    };
    weights.tables = TableBlocks {
        wte: Some(blocks(&weights.wte)),
        lm_head: weights.lm_head.as_deref().map(blocks),
    };
    weights.wte.clear();
    if let Some(h) = weights.lm_head.as_mut() {
        h.clear();
    }
    assert!(weights.has_blocks_only());
    weights
}

#[test]
fn tables_in_blocks_split_into_whole_rows_on_every_engine() {
    let gpus = capped_gpus(2);
    for (preset, tied) in [("tiny-gpt2", true), ("tiny-llama", false)] {
        let weights = in_blocks(ModelWeights::synthetic(&config(preset, tied), 13));
        let what = |engine: &str| format!("{preset} tied={tied} Q8_0 tables {engine}");
        let mut single = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
        check(&mut single, &weights, 1e-4, &what("single"));
        let mut pp = PipelineEngine::new(
            &gpus,
            &weights,
            DType::F32,
            &Partition::Even,
            3,
            CommConfig::default(),
        )
        .unwrap();
        check(&mut pp, &weights, 1e-4, &what("pp=2"));
        let mut tp =
            TensorParallelEngine::new(&gpus, &weights, DType::F32, None, CommConfig::default())
                .unwrap();
        check(&mut tp, &weights, 1e-4, &what("tp=2"));
    }
}
