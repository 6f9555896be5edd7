//! The BERT encoder on the GPU against the CPU reference on random weights: padded batches of
//! different lengths, token types, mean and CLS pooling, with and without normalisation; and
//! a BERT-named checkpoint (with the `bert.` prefix) loading to the same weights.

mod common;
mod hf_support;

use wgpar::device::DType;
use wgpar::model::hf::Checkpoint;
use wgpar::model::{CpuReference, EncoderInput, ModelConfig, ModelWeights, PoolMode, Pooling};
use wgpar::parallel::{Encoder, SingleEncoder};

fn inputs(config: &ModelConfig) -> Vec<EncoderInput> {
    let ids = common::prompts(1, 40, config.vocab, 17).remove(0);
    vec![
        EncoderInput::new(ids[..7].to_vec()),
        EncoderInput {
            ids: ids[7..20].to_vec(),
            token_types: (0..13).map(|i| (i >= 6) as u32).collect(),
        },
        EncoderInput::new(ids[20..21].to_vec()),
        EncoderInput::new(ids[21..40].to_vec()),
    ]
}

fn check(pooling: Pooling, bar: f64) {
    let config = ModelConfig {
        pooling,
        ..ModelConfig::preset("tiny-bert").unwrap()
    };
    let weights = ModelWeights::synthetic(&config, 31);
    let gpu = common::gpus(1).remove(0);
    let mut encoder = SingleEncoder::new(gpu, &weights, DType::F32).unwrap();
    let batch = inputs(&config);
    let got = encoder.encode(&batch).unwrap();
    let want = CpuReference::new(&weights).encode(&batch).unwrap();
    assert_eq!((got.batch, got.dim), (4, config.hidden));
    for (b, w) in want.iter().enumerate() {
        let err = common::rel_err(got.row(b), w);
        assert!(
            err <= bar,
            "{pooling:?} sequence {b}: relative error {err:.2e} > {bar:.0e}"
        );
    }
    // Padding must not leak: each sequence alone gives the same vector as in the batch.
    for (b, input) in batch.iter().enumerate() {
        let alone = encoder.encode(std::slice::from_ref(input)).unwrap();
        let err = common::rel_err(alone.row(0), &want[b]);
        assert!(err <= bar, "{pooling:?} sequence {b} alone: {err:.2e}");
    }
}

#[test]
fn mean_pooled_normalised_matches_reference() {
    check(
        Pooling {
            mode: PoolMode::Mean,
            normalize: true,
        },
        1e-5,
    );
}

#[test]
fn mean_and_cls_pooling_unnormalised_match_reference() {
    for mode in [PoolMode::Mean, PoolMode::Cls] {
        check(
            Pooling {
                mode,
                normalize: false,
            },
            1e-5,
        );
    }
}

#[test]
fn f16_weights_stay_close() {
    let config = ModelConfig::preset("tiny-bert").unwrap();
    let weights = ModelWeights::synthetic(&config, 32);
    let gpu = common::gpus(1).remove(0);
    if !gpu.supports_f16_weights() {
        eprintln!("adapter lacks SHADER_F16: f16 weights are covered by the f32 fallback");
        return;
    }
    let mut encoder = SingleEncoder::new(gpu, &weights, DType::F16).unwrap();
    let batch = inputs(&config);
    let got = encoder.encode(&batch).unwrap();
    let want = CpuReference::new(&weights.rounded_to_f16())
        .encode(&batch)
        .unwrap();
    for (b, w) in want.iter().enumerate() {
        let err = common::rel_err(got.row(b), w);
        assert!(err <= 1e-4, "sequence {b}: {err:.2e}");
    }
}

#[test]
fn bert_checkpoint_with_prefix_loads_to_the_same_encoder() {
    let config = ModelConfig::preset("tiny-bert").unwrap();
    let synthetic = ModelWeights::synthetic(&config, 33);
    let dir = hf_support::scratch("bert");
    std::fs::write(
        dir.join("config.json"),
        hf_support::config_json(&synthetic).to_string(),
    )
    .unwrap();
    let mut tensors = hf_support::bert_tensors(&synthetic, "bert.");
    // Tensors the loader must skip: position ids and a pooler.
    tensors.push(("bert.pooler.dense.bias".into(), vec![3], vec![0.5; 3]));
    hf_support::write_safetensors(
        &dir.join("model.safetensors"),
        &tensors,
        hf_support::Store::F32,
    );
    // sentence-transformers modules: mean pooling then Normalize.
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("modules.json"),
        r#"[{"type":"sentence_transformers.models.Transformer","path":""},
            {"type":"sentence_transformers.models.Pooling","path":"1_Pooling"},
            {"type":"sentence_transformers.models.Normalize","path":"2_Normalize"}]"#,
    )
    .unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut want = config.clone();
    want.name = ckpt.config().name.clone();
    assert_eq!(ckpt.config(), &want);
    let loaded = ckpt.weights(false).unwrap();
    let gpu = common::gpus(1).remove(0);
    let batch = inputs(&config);
    let a = SingleEncoder::new(gpu.clone(), &loaded, DType::F32)
        .unwrap()
        .encode(&batch)
        .unwrap();
    let b = SingleEncoder::new(gpu, &synthetic, DType::F32)
        .unwrap()
        .encode(&batch)
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn encoder_refuses_bad_input_without_panicking() {
    let config = ModelConfig::preset("tiny-bert").unwrap();
    let weights = ModelWeights::synthetic(&config, 1);
    let gpu = common::gpus(1).remove(0);
    let mut encoder = SingleEncoder::new(gpu.clone(), &weights, DType::F32).unwrap();
    let e = encoder.encode(&[]).unwrap_err().to_string();
    assert!(e.contains("nothing to encode"), "{e}");
    let e = encoder
        .encode(&[EncoderInput::new(vec![config.vocab as u32])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("vocabulary"), "{e}");
    let decoder = ModelWeights::synthetic(&ModelConfig::preset("tiny-gpt2").unwrap(), 1);
    assert!(SingleEncoder::new(gpu, &decoder, DType::F32).is_err());
}
