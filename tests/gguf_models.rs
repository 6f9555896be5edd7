//! GGUF checkpoints written by the tests (llama.cpp's `gguf` package, random weights) load to
//! the same model as a safetensors checkpoint of the same weights: the same config, the same
//! weights (the llama Q/K permutation undone), the same logits; packed tensors dequantize as
//! llama.cpp's reference code does; malformed files are refused fast, naming what is wrong.

mod common;
mod gguf_support;
mod hf_support;

use std::time::{Duration, Instant};

use gguf_support::{
    gguf_tensors, model_meta, permute_rows, reference_dequant, write_gguf, GgufSpec,
};
use hf_support::{scratch, write_checkpoint, Store};
use wgpar::device::DType;
use wgpar::error::WgparError;
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, SingleEngine};

/// Every weight vector, flattened with names, in a fixed order.
fn named_vectors(w: &ModelWeights) -> Vec<(String, Vec<f32>)> {
    // Matrices held in blocks alone are compared by their values.
    let w = &w.clone().with_dense();
    let mut v = vec![
        ("wte".to_string(), w.wte.clone()),
        ("final_norm".into(), w.final_norm.clone()),
    ];
    let mut opt = |name: String, x: &Option<Vec<f32>>| {
        if let Some(x) = x {
            v.push((name, x.clone()));
        }
    };
    opt("wpe".into(), &w.wpe);
    opt("lm_head".into(), &w.lm_head);
    opt("final_norm_bias".into(), &w.final_norm_bias);
    for (i, l) in w.layers.iter().enumerate() {
        let n = |s: &str| format!("layer {i} {s}");
        for (name, x) in [
            ("attn_norm", &l.attn_norm),
            ("wq", &l.wq),
            ("wk", &l.wk),
            ("wv", &l.wv),
            ("wo", &l.wo),
            ("mlp_norm", &l.mlp_norm),
            ("w_up", &l.w_up),
            ("w_down", &l.w_down),
        ] {
            opt(n(name), &Some(x.clone()));
        }
        for (name, x) in [
            ("attn_norm_bias", &l.attn_norm_bias),
            ("bq", &l.bq),
            ("bk", &l.bk),
            ("bv", &l.bv),
            ("bo", &l.bo),
            ("mlp_norm_bias", &l.mlp_norm_bias),
            ("w_gate", &l.w_gate),
            ("b_up", &l.b_up),
            ("b_down", &l.b_down),
        ] {
            opt(n(name), x);
        }
    }
    v
}

fn assert_bitwise_same(a: &ModelWeights, b: &ModelWeights) {
    let (va, vb) = (named_vectors(a), named_vectors(b));
    assert_eq!(
        va.iter().map(|x| &x.0).collect::<Vec<_>>(),
        vb.iter().map(|x| &x.0).collect::<Vec<_>>()
    );
    let mut compared = 0;
    for ((name, x), (_, y)) in va.iter().zip(&vb) {
        assert_eq!(x.len(), y.len(), "{name}");
        let bad = x
            .iter()
            .zip(y)
            .position(|(p, q)| p.to_bits() != q.to_bits());
        assert!(bad.is_none(), "{name} differs at {bad:?}");
        compared += x.len();
    }
    assert!(compared > 10_000, "compared {compared} values");
}

/// Prefill and one decode step give the same logits on both weight sets, bit for bit.
fn same_logits(a: &ModelWeights, b: &ModelWeights) {
    let gpu = common::gpus(1).remove(0);
    let mut ea = SingleEngine::new(gpu.clone(), a, DType::F32).unwrap();
    let mut eb = SingleEngine::new(gpu, b, DType::F32).unwrap();
    let prompts = common::prompts(2, 7, a.config.vocab, 3);
    let (la, lb) = (ea.prefill(&prompts).unwrap(), eb.prefill(&prompts).unwrap());
    assert!(la.data.iter().any(|&v| v != 0.0));
    assert_eq!(la, lb, "prefill logits differ");
    let next = lb.argmax();
    assert_eq!(ea.decode(&next).unwrap(), eb.decode(&next).unwrap());
}

fn spec<'a>(arch: &'a str, w: &ModelWeights, matrices: QuantType) -> GgufSpec<'a> {
    GgufSpec {
        arch,
        matrices,
        meta: model_meta(w, arch),
    }
}

/// Opens both checkpoints, checks configs agree, returns (gguf weights, safetensors weights).
fn load_pair(gguf: &std::path::Path, folder: &std::path::Path) -> (ModelWeights, ModelWeights) {
    let (g, s) = (
        Checkpoint::open(gguf).unwrap(),
        Checkpoint::open(folder).unwrap(),
    );
    let mut want = s.config().clone();
    want.name = "gguf-test".into();
    assert_eq!(g.config(), &want);
    assert_eq!(g.eos_tokens(), s.eos_tokens());
    (g.weights(false).unwrap(), s.weights(false).unwrap())
}

#[test]
fn llama_gguf_matches_its_safetensors_checkpoint() {
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let w = ModelWeights::synthetic(&config, 31);
    assert!(!w.config.tied_head);
    let folder = write_checkpoint("gguf-llama", &w, Store::F32);
    let dir = scratch("gguf-llama-file");
    let file = write_gguf(
        &dir,
        "m",
        &gguf_tensors(&w, true),
        &spec("llama", &w, QuantType::F32),
    );
    let (g, s) = load_pair(&file, &folder);
    assert_bitwise_same(&g, &s);
    same_logits(&g, &s);
}

#[test]
fn gpt2_gguf_matches_its_safetensors_checkpoint() {
    let config = ModelConfig::preset("tiny-gpt2").unwrap();
    let w = ModelWeights::synthetic(&config, 32);
    let folder = write_checkpoint("gguf-gpt2", &w, Store::F32);
    let dir = scratch("gguf-gpt2-file");
    let file = write_gguf(
        &dir,
        "m",
        &gguf_tensors(&w, false),
        &spec("gpt2", &w, QuantType::F32),
    );
    let (g, s) = load_pair(&file, &folder);
    assert_bitwise_same(&g, &s);
    same_logits(&g, &s);
}

#[test]
fn qwen2_gguf_keeps_rows_and_reads_biases() {
    // Qwen2 files are not permuted and carry Q/K/V biases.
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let mut w = ModelWeights::synthetic(&config, 33);
    for (i, l) in w.layers.iter_mut().enumerate() {
        l.bq = Some(common::random(config.q_dim(), 100 + i as u64));
        l.bk = Some(common::random(config.kv_dim(), 200 + i as u64));
        l.bv = Some(common::random(config.kv_dim(), 300 + i as u64));
    }
    let dir = scratch("gguf-qwen2");
    let file = write_gguf(
        &dir,
        "m",
        &gguf_tensors(&w, false),
        &spec("qwen2", &w, QuantType::F32),
    );
    let loaded = Checkpoint::open(&file).unwrap().weights(false).unwrap();
    let mut want = w.clone();
    want.config.name = "gguf-test".into();
    assert_bitwise_same(&loaded, &want);
}

/// A Llama of K-quant-friendly widths (rows of 256 and 512 values).
fn k_config() -> ModelConfig {
    ModelConfig {
        name: "k".into(),
        vocab: 300,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        ffn: 512,
        max_seq: 64,
        ..ModelConfig::preset("tiny-llama").unwrap()
    }
}

#[test]
fn packed_types_dequantize_like_llama_cpp_and_stay_close_to_f32() {
    let w = ModelWeights::synthetic(&k_config(), 34);
    let tensors = gguf_tensors(&w, true);
    // Relative RMS error of the matrices against the f32 weights, per type: loose bounds that
    // a wrong layout (error ~1) cannot meet.
    let bounds = [
        (QuantType::F16, 1e-3),
        (QuantType::Bf16, 5e-3),
        (QuantType::Q8_0, 0.01),
        (QuantType::Q6K, 0.03),
        (QuantType::Q4_0, 0.12),
        (QuantType::Q4K, 0.12),
    ];
    for (t, bound) in bounds {
        let dir = scratch(&format!("gguf-{}", t.name()));
        let file = write_gguf(&dir, "m", &tensors, &spec("llama", &w, t));
        let loaded = (Checkpoint::open(&file).unwrap().weights(false).unwrap()).with_dense();
        let l0 = &loaded.layers[0];
        // llama.cpp's reference dequantization of the stored (permuted) rows.
        if t != QuantType::F16 {
            for (name, mine, permute) in [
                ("blk.0.attn_q.weight", &l0.wq, w.config.heads),
                ("blk.0.attn_k.weight", &l0.wk, w.config.kv_heads),
                ("blk.0.ffn_down.weight", &l0.w_down, 0),
                ("token_embd.weight", &loaded.wte, 0),
            ] {
                let reference = reference_dequant(&dir, name);
                let stored = if permute > 0 {
                    permute_rows(mine, permute, w.config.hidden)
                } else {
                    mine.clone()
                };
                assert_eq!(stored.len(), reference.len(), "{t:?} {name}");
                let err = common::rel_err(
                    &stored,
                    &reference.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                );
                assert!(
                    err < 1e-6,
                    "{t:?} {name}: {err} from llama.cpp's dequantization"
                );
            }
        }
        let (mine, orig) = (named_vectors(&loaded), named_vectors(&w));
        for ((name, x), (_, y)) in mine.iter().zip(&orig) {
            let num: f32 = x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum();
            let den: f32 = y.iter().map(|b| b * b).sum();
            let rel = (num / den).sqrt();
            assert!(
                rel <= bound,
                "{t:?} {name}: relative RMS error {rel} > {bound}"
            );
        }
    }
}

/// A small valid GGUF file (tiny-llama, F32) for the malformed-file tests.
fn valid_file(dir: &std::path::Path) -> std::path::PathBuf {
    let w = ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 35);
    write_gguf(
        dir,
        "ok",
        &gguf_tensors(&w, true),
        &spec("llama", &w, QuantType::F32),
    )
}

fn open_err(bytes: &[u8], dir: &std::path::Path) -> String {
    let path = dir.join("bad.gguf");
    std::fs::write(&path, bytes).unwrap();
    let t = Instant::now();
    let r = Checkpoint::open(&path).and_then(|c| c.weights(false).map(|_| ()));
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    match r {
        Err(e @ (WgparError::Checkpoint { .. } | WgparError::TensorType { .. })) => e.to_string(),
        Err(e) => panic!("expected a checkpoint error, got {e}"),
        Ok(()) => panic!("a malformed file was accepted"),
    }
}

#[test]
fn malformed_files_are_refused_fast_naming_the_key_or_tensor() {
    let dir = scratch("gguf-bad");
    let good = std::fs::read(valid_file(&dir)).unwrap();
    let e = open_err(&good[..good.len() - 100], &dir);
    assert!(e.contains("truncated") && e.contains("tensor '"), "{e}");
    let mut v = good.clone();
    v[4] = 7;
    assert!(open_err(&v, &dir).contains("GGUF version 7"));
    // The tensor count, then the metadata count, forged to 2^40.
    for at in [8, 16] {
        let mut v = good.clone();
        v[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let e = open_err(&v, &dir);
        assert!(e.contains("1099511627776") && e.contains("at most"), "{e}");
    }
    // A key's string length forged: the error names the key's position.
    let mut v = good.clone();
    v[24..32].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(open_err(&v, &dir).contains("metadata key 0"));
    // A tensor's type changed to IQ2_XXS (16), which no kernel of wgpar's reads: the tensor
    // is named (`WgparError::TensorType`).
    let name = b"token_embd.weight";
    let at = good.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let type_at = at + 4 + 2 * 8;
    let mut v = good.clone();
    v[type_at..type_at + 4].copy_from_slice(&16u32.to_le_bytes());
    let e = open_err(&v, &dir);
    assert!(
        e.contains("'token_embd.weight'") && e.contains("IQ2_XXS") && e.contains("llama-quantize"),
        "{e}"
    );
    // Metadata that does not match the tensors: the shape error names the tensor.
    let key = b"llama.feed_forward_length";
    let at = good.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4;
    let mut v = good.clone();
    v[at..at + 4].copy_from_slice(&100u32.to_le_bytes());
    let e = open_err(&v, &dir);
    assert!(
        e.contains("blk.0.ffn_gate.weight") && e.contains("expected [100, 96]"),
        "{e}"
    );
}

#[test]
fn mutated_files_never_panic() {
    use rand::{Rng, SeedableRng};
    let dir = scratch("gguf-mutate");
    let good = std::fs::read(valid_file(&dir)).unwrap();
    // Mutations in the header, metadata and descriptors (the first few KiB).
    let header = good.len().min(8192);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let path = dir.join("m.gguf");
    let (mut refused, t) = (0, Instant::now());
    for _ in 0..150 {
        let mut v = good.clone();
        for _ in 0..rng.random_range(1..4) {
            let at = rng.random_range(0..header);
            v[at] = rng.random();
        }
        std::fs::write(&path, &v).unwrap();
        if Checkpoint::open(&path)
            .and_then(|c| c.weights(false))
            .is_err()
        {
            refused += 1;
        }
    }
    assert!(refused > 10, "only {refused} of 150 mutations refused");
    assert!(t.elapsed() < Duration::from_secs(60));
}
