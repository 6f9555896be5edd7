//! all-MiniLM-L6-v2, the real checkpoint (fetched on first use by `.ci/fetch-model minilm`):
//! tokenizer ids, GPU embeddings against the CPU reference, and cosine similarities against the values the
//! sentence-transformers documentation publishes for this model.

mod common;
mod hf_support;

use wgpar::device::DType;
use wgpar::model::hf::Checkpoint;
use wgpar::model::{CpuReference, EncoderInput, PoolMode};
use wgpar::parallel::{cosine_similarity, Embeddings, Encoder, SingleEncoder};

struct MiniLm {
    encoder: SingleEncoder,
    ckpt: Checkpoint,
}

fn minilm() -> (MiniLm, wgpar::model::ModelWeights) {
    let dir = common::minilm_dir();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let weights = ckpt.weights(false).unwrap();
    let gpu = common::gpus(1).remove(0);
    let encoder = SingleEncoder::new(gpu, &weights, DType::F32).unwrap();
    (MiniLm { encoder, ckpt }, weights)
}

fn embed(m: &mut MiniLm, texts: &[&str]) -> (Vec<EncoderInput>, Embeddings) {
    let tok = m.ckpt.tokenizer().unwrap();
    let inputs: Vec<EncoderInput> = texts
        .iter()
        .map(|t| tok.encode_for_encoder(t).unwrap())
        .collect();
    let e = m.encoder.encode(&inputs).unwrap();
    (inputs, e)
}

#[test]
fn config_pooling_and_tokenizer() {
    let (m, _) = minilm();
    let c = m.ckpt.config();
    assert_eq!(
        (c.hidden, c.layers, c.heads, c.ffn, c.vocab),
        (384, 6, 12, 1536, 30522)
    );
    assert!(c.pooling.mode == PoolMode::Mean && c.pooling.normalize);
    let tok = m.ckpt.tokenizer().unwrap();
    // [CLS] a man is eating food . [SEP] in the uncased BERT vocabulary.
    assert_eq!(
        tok.encode("A man is eating food.").unwrap(),
        vec![101, 1037, 2158, 2003, 5983, 2833, 1012, 102]
    );
    // sentence-transformers cuts at max_seq_length 256, not tokenizer.json's 128.
    let long = "word ".repeat(400);
    assert_eq!(tok.encode(&long).unwrap().len(), 256);
}

#[test]
fn gpu_embeddings_match_cpu_reference() {
    let (mut m, weights) = minilm();
    let texts = [
        "A man is eating food.",
        "The stock market fell sharply today, dragging technology shares down with it.",
        "Hi",
    ];
    let (inputs, got) = embed(&mut m, &texts);
    let want = CpuReference::new(&weights).encode(&inputs).unwrap();
    for (b, w) in want.iter().enumerate() {
        let err = common::rel_err(got.row(b), w);
        assert!(err <= 1e-5, "'{}': relative error {err:.2e}", texts[b]);
        let norm: f64 = got.row(b).iter().map(|&v| (v as f64).powi(2)).sum();
        assert!((norm - 1.0).abs() < 1e-5, "not unit length: {norm}");
    }
}

#[test]
fn similar_sentences_score_higher() {
    let (mut m, _) = minilm();
    let (_, e) = embed(
        &mut m,
        &[
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "The stock market fell sharply today.",
        ],
    );
    let (close, far1, far2) = (e.cosine(0, 1), e.cosine(0, 2), e.cosine(1, 2));
    assert!(close > 0.6, "{close}");
    assert!(
        close > far1 + 0.3 && close > far2 + 0.3,
        "{close} {far1} {far2}"
    );
}

#[test]
fn matches_published_similarities() {
    let (mut m, _) = minilm();
    // From the sentence-transformers documentation for all-MiniLM-L6-v2 (Computing Embeddings
    // and Semantic Textual Similarity pages), printed there to 4 decimals: the bar is the
    // rounding (5e-5) plus as much again.
    let published = [
        (
            "The weather is lovely today.",
            "It's so sunny outside!",
            0.6660,
        ),
        (
            "The weather is lovely today.",
            "He drove to the stadium.",
            0.1046,
        ),
        ("It's so sunny outside!", "He drove to the stadium.", 0.1411),
        (
            "The new movie is awesome",
            "The new movie is so great",
            0.8939,
        ),
        (
            "The new movie is awesome",
            "The dog plays in the garden",
            0.0543,
        ),
        ("The new movie is awesome", "A woman watches TV", -0.0502),
        (
            "The cat sits outside",
            "The dog plays in the garden",
            0.2838,
        ),
        (
            "A man is playing guitar",
            "The dog plays in the garden",
            0.2277,
        ),
    ];
    for (a, b, want) in published {
        let (_, e) = embed(&mut m, &[a, b]);
        let got = cosine_similarity(e.row(0), e.row(1));
        assert!(
            (got - want).abs() < 1e-4,
            "'{a}' vs '{b}': {got:.4}, published {want:.4}"
        );
    }
}

/// The real checkpoint through tensor parallelism (2 and 3 devices: 12 heads split 6/6 and
/// 4/4/4) and pipelines (2 and 3 stages of its 6 layers, with micro-batches) equals the single
/// device within 1e-5.
#[test]
fn tensor_and_pipeline_parallel_embeddings_match_single_device() {
    use wgpar::comm::CommConfig;
    use wgpar::parallel::{Partition, PipelineEngine, TensorParallelEngine};
    let (mut m, weights) = minilm();
    let texts = [
        "A man is eating food.",
        "A man is riding a white horse on an enclosed ground.",
        "Hi",
    ];
    let (inputs, want) = embed(&mut m, &texts);
    let gpus = common::gpus(3);
    let check = |name: &str, got: Embeddings| {
        for (b, text) in texts.iter().enumerate() {
            let w: Vec<f64> = want.row(b).iter().map(|&v| v as f64).collect();
            let err = common::rel_err(got.row(b), &w);
            assert!(err <= 1e-5, "{name} '{text}': relative error {err:.2e}");
        }
    };
    for n in [2, 3] {
        let mut tp = TensorParallelEngine::new(
            &gpus[..n],
            &weights,
            DType::F32,
            None,
            CommConfig::default(),
        )
        .unwrap();
        check(&format!("tp={n}"), tp.encode(&inputs).unwrap());
        let mut pp = PipelineEngine::new(
            &gpus[..n],
            &weights,
            DType::F32,
            &Partition::Even,
            2,
            CommConfig::default(),
        )
        .unwrap();
        check(&format!("pp={n}"), pp.encode(&inputs).unwrap());
    }
}
