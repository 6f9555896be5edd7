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
        common::feature_missing("SHADER_F16", "f16 encoder weights");
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

/// Runs the encoder blocks the way the parallel engines do, with a host-side sum standing in
/// for the all-reduce: tensor parallel over two devices, then a two-stage pipeline. The
/// post-norm must come after the sum, and every device needs the real lengths.
#[test]
fn tensor_and_pipeline_splits_match_reference() {
    use wgpar::model::{GpuModel, Placement, ShardSpec, Step};
    use wgpar::parallel::pad_batch;

    let config = ModelConfig::preset("tiny-bert").unwrap();
    let weights = ModelWeights::synthetic(&config, 34);
    let batch = inputs(&config);
    let want = CpuReference::new(&weights).encode(&batch).unwrap();
    let seq = batch.iter().map(|i| i.ids.len()).max().unwrap();
    let step = Step {
        batch: batch.len(),
        seq,
        past: 0,
    };
    let (ids, types, lens) = pad_batch(&batch, seq);
    let gpus = common::gpus(2);
    let n = step.tokens() * config.hidden;
    let check = |pooled: Vec<f32>, what: &str| {
        for (b, w) in want.iter().enumerate() {
            let row = &pooled[b * config.hidden..(b + 1) * config.hidden];
            let err = common::rel_err(row, w);
            assert!(err <= 1e-5, "{what} sequence {b}: {err:.2e}");
        }
    };

    // Tensor parallel: each device holds half the heads and half the MLP.
    let shards = ShardSpec::tensor_parallel(&config, &[1, 1]).unwrap();
    let ranks: Vec<_> = gpus
        .iter()
        .zip(&shards)
        .map(|(g, s)| {
            let placement = Placement {
                shard: s.clone(),
                ..Placement::whole(&config)
            };
            let m = GpuModel::upload(g.clone(), &weights, placement, DType::F32).unwrap();
            let mut act = m.activations(step.tokens(), step.batch).unwrap();
            let mut kv = m.kv_cache(step.batch).unwrap();
            m.write_ids(&act, &ids).unwrap();
            m.write_encoder_inputs(&act, &step, &types, &lens).unwrap();
            m.begin_step(&mut act, &mut kv, &step, &step.rows())
                .unwrap();
            let mut enc = m.gpu().encoder();
            m.embed(&mut enc, &act).unwrap();
            m.gpu().submit(enc);
            (m, act, kv)
        })
        .collect();
    let all_reduce = |partial: fn(&wgpar::model::Activations) -> &wgpar::device::Tensor| {
        let mut sum = vec![0.0f32; n];
        for (m, act, _) in &ranks {
            let part = m.gpu().read_f32(partial(act)).unwrap();
            sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
        }
        for (m, act, _) in &ranks {
            m.gpu().write_f32(partial(act), &sum).unwrap();
        }
    };
    for i in 0..config.layers {
        for (m, act, kv) in &ranks {
            let mut enc = m.gpu().encoder();
            m.attention(&mut enc, i, act, kv).unwrap();
            m.gpu().submit(enc);
        }
        all_reduce(|a| a.attn_out());
        for (m, act, _) in &ranks {
            let mut enc = m.gpu().encoder();
            m.attention_residual(&mut enc, i, act).unwrap();
            m.mlp(&mut enc, i, act).unwrap();
            m.gpu().submit(enc);
        }
        all_reduce(|a| a.mlp_out());
        for (m, act, _) in &ranks {
            let mut enc = m.gpu().encoder();
            m.mlp_residual(&mut enc, i, act).unwrap();
            m.gpu().submit(enc);
        }
    }
    for (r, (m, act, _)) in ranks.iter().enumerate() {
        let mut enc = m.gpu().encoder();
        m.pool(&mut enc, act).unwrap();
        m.gpu().submit(enc);
        check(
            m.gpu().read_f32(act.pooled().unwrap()).unwrap(),
            &format!("tp rank {r}"),
        );
    }

    // Pipeline: layer 0 with the embedding on one device, layer 1 and pooling on the other.
    let stage = |g: usize, layers: std::ops::Range<usize>, first: bool| {
        let placement = Placement {
            layers,
            embedding: first,
            head: !first,
            ..Placement::whole(&config)
        };
        let m = GpuModel::upload(gpus[g].clone(), &weights, placement, DType::F32).unwrap();
        let mut act = m.activations(step.tokens(), step.batch).unwrap();
        let mut kv = m.kv_cache(step.batch).unwrap();
        m.write_encoder_inputs(&act, &step, &types, &lens).unwrap();
        m.begin_step(&mut act, &mut kv, &step, &step.rows())
            .unwrap();
        (m, act, kv)
    };
    let run_layers =
        |(m, act, kv): &(GpuModel, wgpar::model::Activations, wgpar::model::KvCache),
         enc: &mut wgpu::CommandEncoder| {
            for i in 0..m.num_layers() {
                m.attention(enc, i, act, kv).unwrap();
                m.attention_residual(enc, i, act).unwrap();
                m.mlp(enc, i, act).unwrap();
                m.mlp_residual(enc, i, act).unwrap();
            }
        };
    let first = stage(0, 0..1, true);
    let last = stage(1, 1..config.layers, false);
    first.0.write_ids(&first.1, &ids).unwrap();
    let mut enc = first.0.gpu().encoder();
    first.0.embed(&mut enc, &first.1).unwrap();
    run_layers(&first, &mut enc);
    first.0.gpu().submit(enc);
    let hand_off = first.0.gpu().read_f32(first.1.x()).unwrap();
    last.0.gpu().write_f32(last.1.x(), &hand_off[..n]).unwrap();
    let mut enc = last.0.gpu().encoder();
    run_layers(&last, &mut enc);
    last.0.pool(&mut enc, &last.1).unwrap();
    last.0.gpu().submit(enc);
    check(
        last.0.gpu().read_f32(last.1.pooled().unwrap()).unwrap(),
        "pipeline",
    );
    assert!(first.1.pooled().is_none());
}
