//! Engines on packed weights (`--weights`): with the layers' matrices stored as Q8_0, Q4_0,
//! Q4_K or Q6_K blocks, the single-device engine matches the CPU reference on the same weights
//! dequantized, and single, tensor-parallel and pipelined runs pick the same tokens. A
//! tensor-parallel split that would cut blocks is refused with the numbers.

mod common;

use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::model::quant::QuantType;
use wgpar::model::{CpuReference, ModelConfig, ModelWeights};
use wgpar::parallel::{
    generate, Engine, Logits, Partition, PipelineEngine, SingleEngine, TensorParallelEngine,
};

/// A Llama whose inner dimensions hold whole K-quant blocks also per tensor-parallel shard of
/// two (attention width 512, MLP 512).
fn config() -> ModelConfig {
    ModelConfig {
        name: "packed".into(),
        vocab: 300,
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        ffn: 512,
        max_seq: 32,
        ..ModelConfig::preset("tiny-llama").unwrap()
    }
}

fn packed(t: QuantType) -> (ModelWeights, ModelWeights) {
    let w = ModelWeights::synthetic(&config(), 61);
    let reference = w.dequantized(t);
    (
        ModelWeights {
            packed: Some(t),
            ..w
        },
        reference,
    )
}

#[test]
fn packed_engines_match_the_dequantized_reference_and_each_other() {
    let gpus = common::gpus(2);
    let prompts = common::prompts(2, 5, config().vocab, 4);
    for t in [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4K,
        QuantType::Q6K,
    ] {
        let (w, reference) = packed(t);
        let mut single = SingleEngine::new(gpus[0].clone(), &w, DType::F32).unwrap();
        let got = single.prefill(&prompts).unwrap();
        let want = CpuReference::new(&reference).prefill(&prompts).unwrap();
        let want = Logits {
            batch: 2,
            vocab: config().vocab,
            data: want.concat(),
        };
        let err = got.relative_error(&want.data);
        assert!(
            err < 1e-4,
            "{t:?}: prefill logits {err:.2e} from the reference"
        );
        let tokens = generate(&mut single, &prompts, 8).unwrap().tokens;
        assert_eq!(tokens[0].len(), 8);
        let mut tp =
            TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default()).unwrap();
        assert_eq!(
            generate(&mut tp, &prompts, 8).unwrap().tokens,
            tokens,
            "{t:?} tp"
        );
        let mut pp = PipelineEngine::new(
            &gpus,
            &w,
            DType::F32,
            &Partition::Even,
            1,
            CommConfig::default(),
        )
        .unwrap();
        assert_eq!(
            generate(&mut pp, &prompts, 8).unwrap().tokens,
            tokens,
            "{t:?} pp"
        );
    }
}

#[test]
fn packed_matrices_take_less_device_memory() {
    let gpu = common::gpus(1).remove(0);
    let (w, _) = packed(QuantType::Q8_0);
    let before = gpu.bytes_allocated();
    let dense = SingleEngine::new(
        gpu.clone(),
        &ModelWeights {
            packed: None,
            ..w.clone()
        },
        DType::F32,
    )
    .unwrap();
    let dense_bytes = gpu.bytes_allocated() - before;
    drop(dense);
    let before = gpu.bytes_allocated();
    let _q = SingleEngine::new(gpu.clone(), &w, DType::F32).unwrap();
    let q_bytes = gpu.bytes_allocated().saturating_sub(before);
    // The layers' matrices shrink to 34/128 of f32; embeddings, head and activations do not.
    let c = config();
    let matrices = (c.layers
        * (2 * c.q_dim() * c.hidden + 2 * c.kv_dim() * c.hidden + 3 * c.ffn * c.hidden))
        as u64;
    let saved = dense_bytes.saturating_sub(q_bytes);
    let expected = matrices * 4 - matrices / 32 * 34;
    assert!(
        saved.abs_diff(expected) * 100 <= expected * 5,
        "saved {saved} bytes, expected {expected} (dense {dense_bytes}, packed {q_bytes})"
    );
}

#[test]
fn a_split_that_cuts_blocks_is_refused_with_the_numbers() {
    let gpus = common::gpus(4);
    let (w, _) = packed(QuantType::Q4K);
    let e = TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default())
        .err()
        .expect("a split of 128 columns into 256-value blocks must be refused");
    let e = e.to_string();
    assert!(
        e.contains("0..128") && e.contains("q4_k") && e.contains("256"),
        "{e}"
    );
}
