//! The single-device engine against the CPU reference: both families, f32 and f16 weights,
//! prefill then decode, on a lone device and on the second device of a two-device set.

mod common;

use std::sync::Arc;

use wgpar::device::{DType, Gpu};
use wgpar::model::{CpuReference, ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, SingleEngine};

const DECODE_STEPS: usize = 6;

fn check(gpu: Arc<Gpu>, config: &ModelConfig, dtype: DType, batch: usize, seq: usize) {
    let weights = ModelWeights::synthetic(config, 11);
    // The f16 run is compared with a reference whose weights went through the same rounding,
    // and with the unrounded reference under the looser f16 bar.
    let rounded = weights.rounded_to_f16();
    let (oracle_weights, bar) = match dtype {
        DType::F16 => (&rounded, 1e-3),
        _ => (&weights, 1e-4),
    };
    let mut engine = SingleEngine::new(gpu, &weights, dtype).unwrap();
    let mut oracle = CpuReference::new(oracle_weights);
    let mut exact = CpuReference::new(&weights);
    let prompts = common::prompts(batch, seq, config.vocab, 5);
    let mut logits = engine.prefill(&prompts).unwrap();
    let mut want = oracle.prefill(&prompts).unwrap().concat();
    let mut want_exact = exact.prefill(&prompts).unwrap().concat();
    for step in 0..=DECODE_STEPS {
        let err = logits.relative_error(&want);
        assert!(
            err <= bar,
            "{} {dtype:?} step {step}: relative error {err:.2e} > {bar:.0e}",
            config.name
        );
        if dtype == DType::F16 {
            let err = logits.relative_error(&want_exact);
            assert!(err <= 1e-2, "f16 vs f32 weights: {err:.2e}");
        }
        if step == DECODE_STEPS {
            break;
        }
        // Decode the reference's greedy choice so both sides see the same tokens.
        let next = wgpar::parallel::Logits {
            batch,
            vocab: config.vocab,
            data: want.clone(),
        }
        .argmax();
        logits = engine.decode(&next).unwrap();
        want = oracle.decode(&next).unwrap().concat();
        want_exact = exact.decode(&next).unwrap().concat();
    }
}

#[test]
fn llama_f32_matches_reference() {
    let gpu = common::gpus(1).remove(0);
    check(
        gpu,
        &ModelConfig::preset("tiny-llama").unwrap(),
        DType::F32,
        3,
        13,
    );
}

#[test]
fn gpt2_f32_matches_reference() {
    let gpu = common::gpus(1).remove(0);
    check(
        gpu,
        &ModelConfig::preset("tiny-gpt2").unwrap(),
        DType::F32,
        2,
        17,
    );
}

#[test]
fn f16_weights_match_reference() {
    let gpu = common::gpus(1).remove(0);
    if !gpu.supports_f16_weights() {
        common::feature_missing("SHADER_F16", "f16 weights");
        return;
    }
    for name in ["tiny-llama", "tiny-gpt2"] {
        check(
            gpu.clone(),
            &ModelConfig::preset(name).unwrap(),
            DType::F16,
            2,
            9,
        );
    }
}

#[test]
fn runs_on_the_second_device_of_a_set() {
    let mut set = common::gpus(2);
    let second = set.remove(1);
    assert_eq!(second.label(), "gpu1");
    check(
        second,
        &ModelConfig::preset("tiny-gpt2").unwrap(),
        DType::F32,
        1,
        5,
    );
    check(
        set.remove(0),
        &ModelConfig::preset("tiny-llama").unwrap(),
        DType::F32,
        1,
        5,
    );
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let gpu = common::gpus(1).remove(0);
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let weights = ModelWeights::synthetic(&config, 1);
    let mut engine = SingleEngine::new(gpu, &weights, DType::F32).unwrap();
    let e = engine.decode(&[1]).unwrap_err().to_string();
    assert!(
        e.contains("before prefill") || e.contains("sequences"),
        "{e}"
    );
    let e = engine
        .prefill(&[vec![1, 2], vec![3]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("equal lengths"), "{e}");
    let e = engine.prefill(&[vec![100_000]]).unwrap_err().to_string();
    assert!(e.contains("100000") && e.contains("vocabulary"), "{e}");
    let too_long = vec![vec![1u32; config.max_seq + 1]];
    let e = engine.prefill(&too_long).unwrap_err().to_string();
    assert!(e.contains("max_seq"), "{e}");
}

/// Issue 29 item 20: attention variants are chosen per context bucket, so a generation that
/// grows past 64 positions runs the variant chosen for its longer context (the class keyed by
/// the cache's capacity served the whole generation before). The tokens stay the reference's.
#[test]
fn attention_is_chosen_again_as_the_context_grows() {
    let gpu = common::gpus(1).remove(0);
    let config = ModelConfig::preset("tiny-llama").unwrap();
    assert!(
        config.max_seq > 80,
        "the preset must hold a context past 64"
    );
    let weights = ModelWeights::synthetic(&config, 11);
    let mut engine = SingleEngine::new(gpu.clone(), &weights, DType::F32).unwrap();
    let mut oracle = CpuReference::new(&weights);
    let prompts = common::prompts(1, 60, config.vocab, 5);
    let first = engine.prefill(&prompts).unwrap();
    oracle.prefill(&prompts).unwrap();
    let mut next = first.argmax();
    // Contexts 61..=70: across the bucket boundary at 64 (bucket 2^6, then 2^7).
    for step in 0..10 {
        let got = engine.decode(&next).unwrap();
        let want = oracle.decode(&next).unwrap().concat();
        let err = got.relative_error(&want);
        assert!(err < 1e-4, "step {step}: rel err {err}");
        next = got.argmax();
    }
    let classes: Vec<String> = gpu
        .kernels()
        .choices()
        .into_iter()
        .map(|(class, _)| class)
        .filter(|c| c.starts_with("attention/causal/s2^0/"))
        .collect();
    for bucket in ["ctx2^6", "ctx2^7"] {
        assert!(
            classes.iter().any(|c| c.contains(bucket)),
            "no decode attention class for {bucket}: {classes:?}"
        );
    }
}

/// Weights that hold some layers alone (an MPI rank's) are refused by an engine that needs
/// the others, naming the first missing layer; the layers held are the loaded ones.
#[test]
fn weights_without_a_layer_the_engine_needs_are_refused() {
    let gpu = common::gpus(1).remove(0);
    let config = ModelConfig::preset("tiny-llama").unwrap();
    let whole = ModelWeights::synthetic(&config, 3);
    let mut part = whole.clone();
    part.keep_layers(&(0..1));
    assert!(!part.layers[0].is_absent() && part.layers[1].is_absent());
    assert_eq!(part.layers[0].wq, whole.layers[0].wq);
    assert!(part.host_bytes() < whole.host_bytes());
    let e = SingleEngine::new(gpu, &part, DType::F32).err().unwrap();
    assert!(
        matches!(&e, wgpar::WgparError::NotHeld { part, .. } if part == "weights of layer 1"),
        "{e}"
    );
    assert_eq!(e.exit_code(), wgpar::error::EXIT_INTERNAL, "{e}");
}
