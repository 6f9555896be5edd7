//! Gemma 3 text (issue 37 item 2): embeddings scaled by sqrt(hidden), RMSNorm scales of
//! (1 + w) in the checkpoints, norms before and after attention and the MLP, GeGLU, per-head
//! query/key norms, a query scale of query_pre_attn_scalar^-1/2, sliding-window layers with
//! their own RoPE base around global ones, final-logit soft-capping. Every engine (single, TP
//! over 2, PP over 2 stages, hybrid 2 x 2) gives the CPU f64 reference's greedy tokens and
//! logits within the bar; a reference with any one feature off does not match; Hugging Face
//! folders (which store w) and GGUF files (which store 1 + w) load to the same model; what is
//! not supported is refused by name.

mod common;
mod gguf_support;
mod hf_support;
mod kv_copy_support;

use common::decoder::{assert_same_weights, check_engine, reference, same_logits, single, Greedy};

use gguf_support::{write_gguf, GgufSpec, GgufTensor};
use hf_support::{write_safetensors, Store};
use serde_json::{json, Value};
use wgpar::comm::CommConfig;
use wgpar::device::{DType, KvCacheType};
use wgpar::kernels::ops::{self, Elementwise};
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    generate_keeping, Engine, KeepLogits, Partition, PipelineEngine, SingleEngine,
    TensorParallelEngine,
};

/// Tokens generated per sequence (the prefill's pick, then decode steps).
const STEPS: usize = 6;
/// Prompt length: past the sliding window (5) already in the prefill.
const PROMPT: usize = 9;
/// Largest relative error of an engine's logits against the f64 reference.
const BAR: f64 = 1e-4;
/// Greedy decoding against the reference, as every check here runs it.
const RUN: Greedy = Greedy {
    steps: STEPS,
    prompt: PROMPT,
    bar: BAR,
};
/// The final soft-cap the tests set (Gemma 3 sets none; Gemma 2 30): low enough that the
/// synthetic logits are squeezed.
const CAP: f32 = 3.0;

/// tiny-gemma3 (4 heads of 24 over a stream of 80, layers 0, 1 sliding with a window of 5,
/// layer 2 global) with `layers` layers and a final soft-cap.
fn weights(layers: usize, seed: u64) -> ModelWeights {
    let base = ModelConfig::preset("tiny-gemma3").unwrap();
    let sliding = base.sliding.clone().map(|mut s| {
        s.layers = (0..layers).map(|i| (i + 1) % 3 != 0).collect();
        s
    });
    let config = ModelConfig {
        layers,
        sliding,
        final_softcap: Some(CAP),
        ..base
    };
    config.validate().unwrap();
    assert!(config.q_dim() != config.hidden && config.tied_head && config.sandwich_norms);
    ModelWeights::synthetic(&config, seed)
}

#[test]
fn single_tp_and_pp_give_the_reference_tokens() {
    let w = weights(3, 41);
    let gpus = common::gpus(2);
    check_engine("single", &mut single(gpus[0].clone(), &w), &w, &RUN);
    let mut tp =
        TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default()).unwrap();
    check_engine("tp=2", &mut tp, &w, &RUN);
    // Stages of 2 and 1 layers: the second holds only the global layer.
    let mut pp = PipelineEngine::new(
        &gpus,
        &w,
        DType::F32,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    check_engine("pp=2", &mut pp, &w, &RUN);
}

#[test]
fn hybrid_2x2_gives_the_reference_tokens() {
    let w = weights(4, 42);
    let gpus = common::gpus(4);
    let mut hybrid = PipelineEngine::hybrid(
        &gpus,
        &w,
        DType::F32,
        2,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    check_engine("hybrid tp=2 x pp=2", &mut hybrid, &w, &RUN);
}

/// `w` with every RMSNorm scale (block, head, output and final norms) shifted by `by`.
fn shift_norms(w: &ModelWeights, by: f32) -> ModelWeights {
    let mut w = w.clone();
    let shift = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x += by);
    shift(&mut w.final_norm);
    for l in &mut w.layers {
        shift(&mut l.attn_norm);
        shift(&mut l.mlp_norm);
        for v in [
            &mut l.q_norm,
            &mut l.k_norm,
            &mut l.attn_out_norm,
            &mut l.mlp_out_norm,
        ] {
            shift(v.as_mut().unwrap());
        }
    }
    w
}

/// The comparison has teeth: the device's logits match the reference, and are far from a
/// reference with any one Gemma feature off.
#[test]
fn the_reference_with_a_feature_off_does_not_match() {
    let w = weights(3, 43);
    let prompts = common::prompts(2, PROMPT, w.config.vocab, 7);
    let gpu = common::gpus(1).remove(0);
    let got = single(gpu, &w).prefill(&prompts).unwrap();
    let (_, right) = reference(&w, &prompts, STEPS);
    assert!(got.relative_error(&right[0]) <= BAR);
    let c = &w.config;
    let variant = |what: &str, config: ModelConfig, edit: &dyn Fn(&mut ModelWeights)| {
        let mut off = ModelWeights {
            config,
            ..w.clone()
        };
        edit(&mut off);
        let (_, wrong) = reference(&off, &prompts, STEPS);
        let err = got.relative_error(&wrong[0]);
        assert!(
            err > 100.0 * BAR,
            "{what}: the logits moved by {err:.2e} only"
        );
    };
    let same = |_: &mut ModelWeights| {};
    let mut window_off = c.clone();
    window_off.sliding.as_mut().unwrap().window = c.max_seq;
    variant("window off", window_off, &same);
    let mut local_rope_off = c.clone();
    local_rope_off.sliding.as_mut().unwrap().rope_theta = c.rope_theta;
    variant("sliding layers' RoPE base off", local_rope_off, &same);
    let cfg = |edit: &dyn Fn(&mut ModelConfig)| {
        let mut c = c.clone();
        edit(&mut c);
        c
    };
    variant("soft-cap off", cfg(&|c| c.final_softcap = None), &same);
    variant("query scale off", cfg(&|c| c.attn_scale = None), &same);
    variant("embedding scale off", cfg(&|c| c.embed_scale = None), &same);
    variant(
        "output norms off",
        cfg(&|c| c.sandwich_norms = false),
        &|w: &mut ModelWeights| {
            for l in &mut w.layers {
                (l.attn_out_norm, l.mlp_out_norm) = (None, None);
            }
        },
    );
    variant("head norms off", cfg(&|c| c.qk_norm = false), &|w| {
        for l in &mut w.layers {
            (l.q_norm, l.k_norm) = (None, None);
        }
    });
    // The scales as a checkpoint stores them (w, not 1 + w): what a loader that forgot the 1
    // would run.
    let stored = shift_norms(&w, -1.0);
    variant("(1 + w) off", c.clone(), &|m| *m = stored.clone());
    let silu = cfg(&|c| c.activation = wgpar::model::config::Activation::Silu);
    variant("SwiGLU instead of GeGLU", silu, &same);
}

/// A device model whose weights do not match the config's output norms is refused, naming
/// them.
#[test]
fn weights_without_the_output_norms_are_refused() {
    let mut w = weights(3, 44);
    w.layers[2].mlp_out_norm = None;
    let gpu = common::gpus(1).remove(0);
    let e = SingleEngine::new(gpu, &w, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("sandwich_norms") && e.contains("layer 2"), "{e}");
}

/// config.json of a `Gemma3ForCausalLM` of `w`'s shapes, as transformers 4 writes it
/// (`sliding_window_pattern`, `rope_local_base_freq`).
fn gemma_config_json(w: &ModelWeights) -> Value {
    let c = &w.config;
    let s = c.sliding.as_ref().unwrap();
    let query = 1.0 / (c.attn_scale.unwrap() * c.attn_scale.unwrap());
    json!({
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text", "vocab_size": c.vocab, "hidden_size": c.hidden,
        "num_hidden_layers": c.layers, "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.ffn, "max_position_embeddings": c.max_seq,
        "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
        "rope_local_base_freq": s.rope_theta, "sliding_window": s.window,
        "sliding_window_pattern": 3, "query_pre_attn_scalar": query.round(),
        "final_logit_softcapping": c.final_softcap, "attn_logit_softcapping": null,
        "hidden_activation": "gelu_pytorch_tanh", "rope_scaling": null,
        "torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 2,
    })
}

/// Gemma's Hugging Face names for `w`, every norm scale stored as `w - 1` (HF computes
/// `1 + w`).
fn gemma_hf_tensors(w: &ModelWeights) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let c = &w.config;
    let (h, f, q, kv, d) = (c.hidden, c.ffn, c.q_dim(), c.kv_dim(), c.head_dim);
    let s = shift_norms(w, -1.0);
    let mut t = vec![
        ("model.embed_tokens.weight".into(), vec![c.vocab, h], s.wte),
        ("model.norm.weight".into(), vec![h], s.final_norm),
    ];
    for (i, l) in s.layers.into_iter().enumerate() {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        t.extend([
            (n("input_layernorm.weight"), vec![h], l.attn_norm),
            (n("self_attn.q_proj.weight"), vec![q, h], l.wq),
            (n("self_attn.k_proj.weight"), vec![kv, h], l.wk),
            (n("self_attn.v_proj.weight"), vec![kv, h], l.wv),
            (n("self_attn.q_norm.weight"), vec![d], l.q_norm.unwrap()),
            (n("self_attn.k_norm.weight"), vec![d], l.k_norm.unwrap()),
            (n("self_attn.o_proj.weight"), vec![h, q], l.wo),
            (
                n("post_attention_layernorm.weight"),
                vec![h],
                l.attn_out_norm.unwrap(),
            ),
            (n("pre_feedforward_layernorm.weight"), vec![h], l.mlp_norm),
            (
                n("post_feedforward_layernorm.weight"),
                vec![h],
                l.mlp_out_norm.unwrap(),
            ),
            (n("mlp.gate_proj.weight"), vec![f, h], l.w_gate.unwrap()),
            (n("mlp.up_proj.weight"), vec![f, h], l.w_up),
            (n("mlp.down_proj.weight"), vec![h, f], l.w_down),
        ]);
    }
    t
}

fn write_gemma_folder(name: &str, w: &ModelWeights, config: &Value) -> hf_support::Scratch {
    let dir = hf_support::scratch(name);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    write_safetensors(
        &dir.join("model.safetensors"),
        &gemma_hf_tensors(w),
        Store::F32,
    );
    dir
}

/// A folder that stores `w` for `1 + w` loads to the multipliers, and its config to the same
/// model; `layer_types` (transformers 5) says the same as the pattern.
#[test]
fn hugging_face_folders_load_to_the_same_model() {
    let w = weights(3, 45);
    let json = gemma_config_json(&w);
    let dir = write_gemma_folder("gemma3-hf", &w, &json);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut want = w.config.clone();
    want.name = ckpt.config().name.clone();
    assert_eq!(ckpt.config(), &want);
    let loaded = ckpt.weights(false).unwrap();
    assert_same_weights(&loaded, &w, &|x| x);
    same_logits(&loaded, &w, PROMPT);
    let mut typed = json.clone();
    let obj = typed.as_object_mut().unwrap();
    obj.remove("sliding_window_pattern");
    obj.insert(
        "layer_types".into(),
        json!(["sliding_attention", "sliding_attention", "full_attention"]),
    );
    std::fs::write(dir.join("config.json"), typed.to_string()).unwrap();
    assert_eq!(Checkpoint::open(&dir).unwrap().config(), &want);
    // A bfloat16 checkpoint's embedding scale is sqrt(hidden) rounded to bfloat16, as
    // transformers casts it: sqrt(80) = 8.944 is 8.9375 there.
    let mut bf16 = json.clone();
    bf16["torch_dtype"] = "bfloat16".into();
    std::fs::write(dir.join("config.json"), bf16.to_string()).unwrap();
    let c = Checkpoint::open(&dir).unwrap().config().clone();
    assert_eq!(c.embed_scale, Some(8.9375));
}

/// A `Gemma3ForConditionalGeneration` folder of `w` (as transformers saves one): the text
/// config under `text_config` (its end tokens at the top level), a vision config, the text
/// model's tensors under `text` and a vision tower and projector under `vision`; `head`: an
/// untied LM head of this name (the text config then says so).
fn write_multimodal_folder(
    name: &str,
    w: &ModelWeights,
    (text, vision): (&str, &str),
    head: Option<&str>,
) -> hf_support::Scratch {
    let dir = hf_support::scratch(name);
    let mut text_config = gemma_config_json(w);
    let obj = text_config.as_object_mut().unwrap();
    obj.remove("architectures");
    obj.remove("eos_token_id");
    let config = json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text_config, "eos_token_id": [1, 106], "image_token_index": 262_144,
        "mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8,
            "num_hidden_layers": 1, "patch_size": 14, "image_size": 28},
        "tie_word_embeddings": head.is_none(),
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut tensors: Vec<_> = (gemma_hf_tensors(w).into_iter())
        .map(|(n, s, v)| (n.replacen("model.", text, 1), s, v))
        .collect();
    let v = |n: usize| (0..n).map(|i| i as f32 * 0.01).collect::<Vec<f32>>();
    tensors.extend([
        (
            format!("{vision}vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"),
            vec![8, 8],
            v(64),
        ),
        (
            format!("{vision}multi_modal_projector.mm_input_projection_weight"),
            vec![8, 4],
            v(32),
        ),
    ]);
    if let Some(head) = head {
        let c = &w.config;
        tensors.push((head.into(), vec![c.vocab, c.hidden], w.wte.clone()));
    }
    write_safetensors(&dir.join("model.safetensors"), &tensors, Store::F32);
    dir
}

/// A text-and-vision folder, in transformers 4's layout and 5's, loads its text model: the
/// text-only folder's config and weights, its greedy tokens, the vision tower not read.
#[test]
fn multimodal_folders_load_their_text_model() {
    let w = weights(3, 47);
    let gpu = common::gpus(1).remove(0);
    let prompts = common::prompts(2, PROMPT, w.config.vocab, 7);
    let text_dir = write_gemma_folder("gemma3-text", &w, &gemma_config_json(&w));
    let text = Checkpoint::open(&text_dir).unwrap();
    let text_w = text.weights(false).unwrap();
    let want = generate_keeping(
        &mut single(gpu.clone(), &text_w),
        &prompts,
        STEPS,
        KeepLogits::All,
    )
    .unwrap()
    .tokens;
    for (layout, prefixes) in [
        ("transformers 4", ("language_model.model.", "")),
        ("transformers 5", ("model.language_model.", "model.")),
    ] {
        let dir = write_multimodal_folder("gemma3-mm", &w, prefixes, None);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let mut config = text.config().clone();
        config.name = ckpt.config().name.clone();
        assert_eq!(ckpt.config(), &config, "{layout}");
        assert_eq!(ckpt.eos_tokens(), [1, 106], "{layout}");
        let loaded = ckpt.weights(false).unwrap();
        assert_same_weights(&loaded, &w, &|x| x);
        let got = generate_keeping(
            &mut single(gpu.clone(), &loaded),
            &prompts,
            STEPS,
            KeepLogits::All,
        )
        .unwrap()
        .tokens;
        assert_eq!(got, want, "{layout}: the text-only folder's tokens");
        check_engine(layout, &mut single(gpu.clone(), &loaded), &w, &RUN);
    }
    // An untied head sits beside the text model in transformers 4's layout, at the top in 5's.
    for (prefixes, head) in [
        (
            ("language_model.model.", ""),
            "language_model.lm_head.weight",
        ),
        (("model.language_model.", "model."), "lm_head.weight"),
    ] {
        let dir = write_multimodal_folder("gemma3-mm-head", &w, prefixes, Some(head));
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert!(!ckpt.config().tied_head, "{head}");
        let loaded = ckpt.weights(false).unwrap();
        assert_eq!(loaded.lm_head.as_ref(), Some(&w.wte), "{head}");
    }
}

/// What wgpar does not compute is refused by name: attention soft-capping, another
/// activation, a multimodal config whose text model is not Gemma 3's; a missing output norm
/// names its tensor.
#[test]
fn hugging_face_features_it_lacks_are_refused_by_name() {
    let w = weights(3, 46);
    let json = gemma_config_json(&w);
    let dir = write_gemma_folder("gemma3-hf-bad", &w, &json);
    let refused = |edit: &dyn Fn(&mut Value), want: &str| {
        let mut j = json.clone();
        edit(&mut j);
        std::fs::write(dir.join("config.json"), j.to_string()).unwrap();
        let e = Checkpoint::open(&dir).err().unwrap().to_string();
        assert!(e.contains(want), "{want}: {e}");
    };
    refused(
        &|j| j["attn_logit_softcapping"] = json!(50.0),
        "\"attn_logit_softcapping\" is 50.0: not supported",
    );
    refused(
        &|j| j["hidden_activation"] = "gelu".into(),
        "\"hidden_activation\" is 'gelu'",
    );
    refused(
        &|j| {
            let text = j.clone();
            *j = json!({"model_type": "gemma3", "text_config": text});
            j["text_config"]["model_type"] = "llama".into();
        },
        "\"text_config\" has model_type 'llama': a Gemma 3 text model",
    );
    refused(
        &|j| {
            j.as_object_mut().unwrap().remove("sliding_window_pattern");
            j["layer_types"] = json!(["sliding_attention"]);
        },
        "\"layer_types\"",
    );
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let mut tensors = gemma_hf_tensors(&w);
    tensors.retain(|(n, _, _)| n != "model.layers.1.post_feedforward_layernorm.weight");
    write_safetensors(&dir.join("model.safetensors"), &tensors, Store::F32);
    let e = Checkpoint::open(&dir)
        .unwrap()
        .weights(false)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("layers.1.post_feedforward_layernorm.weight"),
        "{e}"
    );
}

fn gemma_gguf_tensors(w: &ModelWeights) -> Vec<GgufTensor> {
    gguf_support::gemma3_tensors(w)
}

fn gemma_spec<'a>(w: &ModelWeights, matrices: QuantType) -> GgufSpec<'a> {
    GgufSpec {
        arch: "gemma3",
        matrices,
        meta: gguf_support::gemma3_meta(w),
    }
}

/// A gemma3 GGUF loads to the weights of the same model's folder and runs to the same logits.
/// The file does not store query_pre_attn_scalar: llama.cpp takes head_dim (27B aside), so
/// the model here has that scale.
#[test]
fn gguf_f32_matches_the_folder() {
    let mut w = weights(3, 47);
    w.config.attn_scale = Some(1.0 / (w.config.head_dim as f32).sqrt());
    let dir = hf_support::scratch("gemma3-gguf");
    let file = write_gguf(
        &dir,
        "m",
        &gemma_gguf_tensors(&w),
        &gemma_spec(&w, QuantType::F32),
    );
    let g = Checkpoint::open(&file).unwrap();
    let mut want = w.config.clone();
    want.name = "gguf-test".into();
    assert_eq!(g.config(), &want);
    let loaded = g.weights(false).unwrap();
    assert_same_weights(&loaded, &w, &|x| x);
    same_logits(&loaded, &w, PROMPT);
    // The folder of the same model (its scale written as query_pre_attn_scalar = head_dim).
    let mut json = gemma_config_json(&w);
    json["query_pre_attn_scalar"] = json!(w.config.head_dim);
    let folder = write_gemma_folder("gemma3-gguf-folder", &w, &json);
    let from_folder = Checkpoint::open(&folder).unwrap().weights(false).unwrap();
    same_logits(&loaded, &from_folder, PROMPT);
}

/// Packed GGUF matrices (Q8_0) run on one device and split over two to the reference's tokens
/// on their own values; a missing output norm is refused by name.
#[test]
fn packed_gguf_runs_single_and_tp_to_the_reference_tokens() {
    let config = ModelConfig {
        hidden: 96,
        head_dim: 32,
        ffn: 192,
        embed_scale: Some(96f32.sqrt()),
        attn_scale: Some(1.0 / 32f32.sqrt()),
        ..weights(3, 0).config
    };
    let w = ModelWeights::synthetic(&config, 48);
    let dir = hf_support::scratch("gemma3-gguf-q8");
    let file = write_gguf(
        &dir,
        "m",
        &gemma_gguf_tensors(&w),
        &gemma_spec(&w, QuantType::Q8_0),
    );
    let loaded = Checkpoint::open(&file).unwrap().weights(false).unwrap();
    assert_eq!(loaded.blocks().count(), 3 * 7, "every projection in blocks");
    let gpus = common::gpus(2);
    check_engine(
        "q8_0 single",
        &mut single(gpus[0].clone(), &loaded),
        &loaded,
        &RUN,
    );
    let mut tp =
        TensorParallelEngine::new(&gpus, &loaded, DType::F32, None, CommConfig::default()).unwrap();
    check_engine("q8_0 tp=2", &mut tp, &loaded, &RUN);
    let mut tensors = gemma_gguf_tensors(&w);
    tensors.retain(|t| t.name != "blk.2.post_attention_norm.weight");
    let file = write_gguf(&dir, "n", &tensors, &gemma_spec(&w, QuantType::F32));
    let e = Checkpoint::open(&file)
        .unwrap()
        .weights(false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("blk.2.post_attention_norm.weight"), "{e}");
}

/// The new element-wise entries against f64 on random data of a non-tile length: GeGLU,
/// scale, soft-cap.
#[test]
fn geglu_scale_and_softcap_kernels_match_f64() {
    let gpu = &common::gpus(1)[0];
    let (rows, cols) = (7, 301);
    let n = rows * cols;
    let a: Vec<f32> = common::random(n, 11).iter().map(|v| v * 8.0).collect();
    let b = common::random(n, 12);
    let gelu =
        |x: f64| 0.5 * x * (1.0 + (0.797_884_560_802_865_4 * (x + 0.044_715 * x * x * x)).tanh());
    type Want<'a> = &'a dyn Fn(f64, f64) -> f64;
    let cases: [(Elementwise, f32, Want); 3] = [
        (Elementwise::GeGlu, 1.0, &|x, y| gelu(x) * y),
        (Elementwise::Scale, 2.5, &|x, _| x * 2.5),
        (Elementwise::Softcap, 3.0, &|x, _| 3.0 * (x / 3.0).tanh()),
    ];
    for (kind, scalar, want) in cases {
        let at = gpu.upload_f32("a", &a).unwrap();
        let bt = gpu.upload_f32("b", &b).unwrap();
        let mut enc = gpu.encoder();
        ops::elementwise_scalar(gpu, &mut enc, kind, (&at, &bt), (rows, cols), scalar).unwrap();
        gpu.submit(enc);
        gpu.wait().unwrap();
        let got = gpu.read_f32(&at).unwrap();
        let want: Vec<f64> = (a.iter().zip(&b))
            .map(|(&x, &y)| want(x as f64, y as f64))
            .collect();
        assert!(got != a, "{kind:?} changed nothing");
        let err = common::rel_err(&got, &want);
        assert!(err <= 1e-5, "{kind:?}: relative error {err:.2e}");
    }
}

/// The sliding-window mask in every attention variant that applies (and the tuned choice)
/// against f64: rows at different positions (before, at and past the window), decode and
/// prefill, a query scale that is not 1/sqrt(head_dim), grouped heads.
#[test]
fn windowed_attention_matches_f64_in_every_variant() {
    use wgpar::kernels::ops::{AttnShape, KvCache};
    use wgpar::kernels::variants;
    let gpu = &common::gpus(1)[0];
    let (nh, nkv, d, max_seq, window, scale) = (4, 2, 24, 40, 5, 0.31f32);
    for (batch, seq) in [(3, 1), (2, 9), (1, 33)] {
        let slots = batch + 1;
        let max_seq = max_seq.max(seq + 4);
        let shape = AttnShape {
            batch,
            seq,
            slots,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            max_seq,
            group: nh / nkv,
            q_head_offset: 0,
            kv_head_offset: 0,
        };
        // Row b: slot slots-1-b, past 4b (row 0 starts inside the window).
        let rows: Vec<(usize, usize)> = (0..batch).map(|b| (slots - 1 - b, 4 * b)).collect();
        let flat: Vec<u32> = (rows.iter())
            .flat_map(|&(slot, past)| [slot as u32, past as u32])
            .collect();
        let seqs = gpu.upload_u32("seqs", &flat).unwrap();
        let tokens = batch * seq;
        let kc = common::random(shape.cache_len(), 31);
        let vc = common::random(shape.cache_len(), 32);
        let q: Vec<f32> = (common::random(tokens * nh * d, 33).iter())
            .map(|v| v * 3.0)
            .collect();
        let (kt, vt, qt) = (
            gpu.upload_f32("kc", &kc).unwrap(),
            gpu.upload_f32("vc", &vc).unwrap(),
            gpu.upload_f32("q", &q).unwrap(),
        );
        let want = windowed_f64(
            (&q, &kc, &vc),
            (nh, nkv, d, max_seq),
            (&rows, seq),
            (window, scale),
        );
        let mut kernels: Vec<Option<&'static str>> = vec![None];
        kernels.extend(
            (variants::ATTENTION.iter())
                .filter(|v| variants::attention_applies(v, seq, d))
                .map(|v| Some(v.name)),
        );
        assert!(kernels.len() >= 2, "no variant applies to seq {seq}");
        for kernel in kernels {
            let out = gpu.empty("out", DType::F32, tokens * nh * d).unwrap();
            gpu.poison(&out);
            let cache = KvCache {
                k: &kt,
                v: &vt,
                seqs: &seqs,
            };
            let mut enc = gpu.encoder();
            let io = (&qt, cache, &out);
            ops::attention_window(gpu, &mut enc, io, &shape, (Some(scale), window), kernel)
                .unwrap();
            gpu.submit(enc);
            gpu.wait().unwrap();
            let got = gpu.read_f32(&out).unwrap();
            let err = common::rel_err(&got, &want);
            assert!(
                err <= 1e-5,
                "seq {seq} {kernel:?}: relative error {err:.2e}"
            );
        }
    }
}

/// Relative error of `got` against `want` (the reference's f32 logits).
fn rel(got: &[f32], want: &[f32]) -> f64 {
    let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    common::rel_err(got, &want)
}

/// Sliding layers keep a ring of 32 rows (window 5 and a step of 16) in slots of 96. Every
/// slot's cache is filled with garbage first; then two sequences, in slots 2 and 0, take a
/// prompt of 40 tokens in chunks of 16, 16 and 8 and decode to position 95 (three rings
/// over): every step's logits within the bar of the f64 reference and its greedy tokens, on
/// every engine. A step of more new positions than the ring's step is refused by name.
#[test]
fn a_ring_cache_generates_past_three_rings_on_every_engine() {
    use kv_copy_support::{engine, gpus, row, run, step, strategies, SLOTS};
    let w = weights(4, 48);
    let c = w.config.clone();
    let ring = (c.cached_positions(0), c.cached_positions(2), c.ring_step());
    assert_eq!(
        ring,
        (32, 96, Some(16)),
        "layers 0, 1, 3 slide; layer 2 is global"
    );
    let (prompt, slots) = (40, [2, 0]);
    let prompts = common::prompts(2, prompt, c.vocab, 7);
    let steps = c.max_seq - prompt;
    let (want_tokens, want_logits) = reference(&w, &prompts, steps);
    let all = gpus(4, KvCacheType::F32).unwrap();
    let mut compared = 0;
    for (name, strategy, devices) in strategies() {
        let mut e = engine(&strategy, &all[..devices], &w);
        for past in [0, 16] {
            let garbage = common::prompts(SLOTS, 16, c.vocab, 9 + past as u64).concat();
            let rows: Vec<(usize, usize)> = (0..SLOTS).map(|s| (s, past)).collect();
            run(e.as_mut(), step(&rows, 16, garbage, Vec::new())).unwrap();
        }
        if name == "single" {
            let ids = prompts[0][..17].to_vec();
            let err = run(e.as_mut(), step(&[(1, 0)], 17, ids, Vec::new())).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("chunks of at most 16"), "{name}: {text}");
        }
        let rows = |past: usize| [(slots[0], past), (slots[1], past)];
        let mut done = None;
        for (past, len) in [(0, 16), (16, 16), (32, 8)] {
            let ids = [&prompts[0][past..past + len], &prompts[1][past..past + len]].concat();
            done = Some(run(e.as_mut(), step(&rows(past), len, ids, Vec::new())).unwrap());
        }
        let mut tokens = vec![Vec::new(); 2];
        for (k, want) in want_logits.iter().enumerate() {
            let d = done.take().unwrap();
            let got = [row(&d, 0), row(&d, 1)].concat();
            let err = rel(&got, want);
            assert!(err <= BAR, "{name} step {k}: relative error {err:.2e}");
            for (t, &n) in tokens.iter_mut().zip(&d.tokens) {
                t.push(n);
            }
            if k + 1 < want_logits.len() {
                let next = step(&rows(prompt + k), 1, d.tokens.clone(), Vec::new());
                done = Some(run(e.as_mut(), next).unwrap());
            }
            compared += 1;
        }
        assert_eq!(tokens, want_tokens, "{name}: greedy tokens");
    }
    assert_eq!(compared, 4 * steps, "every step of every engine compared");
}

/// A long prompt through the plain engines (`run`'s path) goes in chunks of the ring's
/// step: 40 tokens, then decode, give the reference's tokens and logits on every engine.
#[test]
fn plain_engines_prefill_a_long_prompt_in_ring_chunks() {
    let w = weights(3, 49);
    let gpus = common::gpus(4);
    let run = Greedy {
        steps: 20,
        prompt: 40,
        bar: BAR,
    };
    check_engine("single", &mut single(gpus[0].clone(), &w), &w, &run);
    let mut tp =
        TensorParallelEngine::new(&gpus[..2], &w, DType::F32, None, CommConfig::default()).unwrap();
    check_engine("tp=2", &mut tp, &w, &run);
    let mut hybrid = PipelineEngine::hybrid(
        &gpus,
        &w,
        DType::F32,
        2,
        &Partition::Even,
        2,
        CommConfig::default(),
    )
    .unwrap();
    check_engine("hybrid tp=2 x pp=2", &mut hybrid, &w, &run);
}

/// What a cache allocates is what the accounting counts: a sliding layer's keys and values
/// over its 32-row ring, the global layer's over all 96 positions (plus the block table).
#[test]
fn a_sliding_layers_cache_allocates_its_ring_as_accounted() {
    use wgpar::model::memory::kv_cache_bytes;
    let w = weights(3, 50);
    let c = &w.config;
    let gpu = common::gpus(1).remove(0);
    let e = single(gpu.clone(), &w);
    let slots = 3;
    let before = gpu.bytes_live();
    let _kv = e.model().kv_cache(slots).unwrap();
    let grew = gpu.bytes_live() - before;
    let table = (4 * slots * c.max_seq.div_ceil(16)) as u64;
    let per_row = (2 * slots * c.kv_dim() * 4) as u64;
    let want = per_row * (2 * 32 + 96);
    assert_eq!(
        kv_cache_bytes(c, e.model().placement(), slots, DType::F32),
        want
    );
    assert_eq!(grew, want + table, "allocated bytes");
    assert!(want < per_row * 3 * 96, "the rings save memory");
}

/// Rings of `rows` rows holding positions `0..end[s]` of slot s of a `[slots][nkv][max_seq][d]`
/// cache: position p at row p % rows, the latest position written last.
fn ring_of(
    full: &[f32],
    (slots, nkv, max_seq, d): (usize, usize, usize, usize),
    rows: usize,
    end: &[usize],
) -> Vec<f32> {
    let mut ring = vec![0.0; slots * nkv * rows * d];
    for (slot, &end) in end.iter().enumerate() {
        for h in 0..nkv {
            for p in 0..end {
                let from = ((slot * nkv + h) * max_seq + p) * d;
                let to = ((slot * nkv + h) * rows + p % rows) * d;
                ring[to..to + d].copy_from_slice(&full[from..from + d]);
            }
        }
    }
    ring
}

/// A ring cache (a sliding layer's: position p at row p % ring) in every attention variant
/// that applies against f64, rows whose keys wrap around the ring: the same outputs as the
/// whole-context layout. A ring read with another length than it was written with does not
/// match; one too short for the step's window is refused by name.
#[test]
fn ring_attention_matches_f64_in_every_variant() {
    use wgpar::kernels::ops::{Attention, AttnMask, AttnShape, KvAddress, KvCache, Params, Pass};
    use wgpar::kernels::variants;
    let gpu = &common::gpus(1)[0];
    let (nh, nkv, d, max_seq, window, scale) = (4, 2, 24, 64, 5, 0.31f32);
    let mut compared = 0;
    for (batch, seq) in [(3, 1), (2, 9), (1, 12)] {
        let slots = batch + 1;
        let shape = AttnShape {
            batch,
            seq,
            slots,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            max_seq,
            group: nh / nkv,
            q_head_offset: 0,
            kv_head_offset: 0,
        };
        let rows_of = (seq + window - 1).div_ceil(16) * 16;
        // Row b: slot slots-1-b, past 20 + 7b: its keys wrap around the ring.
        let rows: Vec<(usize, usize)> = (0..batch).map(|b| (slots - 1 - b, 20 + 7 * b)).collect();
        let mut end = vec![0; slots];
        for &(slot, past) in &rows {
            end[slot] = past + seq;
        }
        let flat: Vec<u32> = (rows.iter())
            .flat_map(|&(s, p)| [s as u32, p as u32])
            .collect();
        let seqs = gpu.upload_u32("seqs", &flat).unwrap();
        let tokens = batch * seq;
        let kc = common::random(shape.cache_len(), 41);
        let vc = common::random(shape.cache_len(), 42);
        let q: Vec<f32> = (common::random(tokens * nh * d, 43).iter())
            .map(|v| v * 3.0)
            .collect();
        let qt = gpu.upload_f32("q", &q).unwrap();
        let want = windowed_f64(
            (&q, &kc, &vc),
            (nh, nkv, d, max_seq),
            (&rows, seq),
            (window, scale),
        );
        let layout = (slots, nkv, max_seq, d);
        // A ring written with `written` rows (padded to `read` rows' size), read as `read`.
        let attend = |written: usize, read: usize, kernel: Option<&'static str>| {
            let len = slots * nkv * read * d;
            let mut k = ring_of(&kc, layout, written, &end);
            let mut v = ring_of(&vc, layout, written, &end);
            k.resize(len, 0.0);
            v.resize(len, 0.0);
            let (kt, vt) = (
                gpu.upload_f32("k", &k).unwrap(),
                gpu.upload_f32("v", &v).unwrap(),
            );
            let out = gpu.empty("out", DType::F32, tokens * nh * d).unwrap();
            gpu.poison(&out);
            let cache = KvCache {
                k: &kt,
                v: &vt,
                seqs: &seqs,
            };
            let address = KvAddress {
                blocks: None,
                ring: Some(read),
            };
            let mut params = Params::new(gpu, "ring test", 1).unwrap();
            let mut op = Attention::bind_paged(
                gpu,
                &mut params,
                (&qt, cache, &out),
                address,
                &shape,
                AttnMask::Causal,
            )
            .unwrap()
            .with_scale(Some(scale))
            .with_window(Some(window))
            .with_variant(kernel);
            op.configure(gpu, &mut params, (batch, seq), max_seq)?;
            params.flush(gpu);
            let mut enc = gpu.encoder();
            Pass::new(&mut enc).run(&op).unwrap();
            gpu.submit(enc);
            gpu.wait().unwrap();
            Ok::<_, wgpar::WgparError>(gpu.read_f32(&out).unwrap())
        };
        let mut kernels: Vec<Option<&'static str>> = vec![None];
        kernels.extend(
            (variants::ATTENTION.iter())
                .filter(|v| variants::attention_applies(v, seq, d))
                .map(|v| Some(v.name)),
        );
        assert!(kernels.len() >= 2, "no variant applies to seq {seq}");
        for kernel in kernels {
            let err = common::rel_err(&attend(rows_of, rows_of, kernel).unwrap(), &want);
            assert!(
                err <= 1e-5,
                "seq {seq} {kernel:?}: relative error {err:.2e}"
            );
            let wrong = common::rel_err(&attend(rows_of, rows_of + 16, kernel).unwrap(), &want);
            assert!(
                wrong > 1e-2,
                "seq {seq} {kernel:?}: a ring read at the wrong length matched ({wrong:.2e})"
            );
            compared += 1;
        }
        let short = seq + window - 2;
        let e = attend(short, short, None).unwrap_err().to_string();
        assert!(
            e.contains(&format!("need {} ring rows", seq + window - 1)),
            "{e}"
        );
    }
    assert!(compared >= 6, "compared {compared}");
}

/// The prefix cache is off for a model whose sliding layers keep a ring (no cached block
/// holds a ring's window): multi-turn chats served with `prefix_cache` on reuse nothing and
/// give the tokens of the run with it off, every prompt prefilled whole in chunks of the
/// ring's step, on one device, TP and a pipeline.
#[test]
fn a_ring_model_serves_chats_with_the_prefix_cache_off() {
    use wgpar::batching::{serve, Length, Rate, ServeOptions, Sessions, WorkloadSpec};
    use wgpar::parallel::{build_step_engine, PartitionSpec, Schedule, Strategy};
    use wgpar::trace::Recorder;
    let w = weights(3, 51);
    assert!(!wgpar::batching::reuses_prefixes(&w.config));
    let spec = WorkloadSpec {
        requests: 3,
        rate: Rate::Burst,
        prompt_len: Length::Uniform { min: 3, max: 6 },
        output_len: Length::Uniform { min: 2, max: 4 },
        seed: 31,
    };
    let chats = Sessions {
        shared_prefix: 20,
        turns: 3,
    }
    .generate(&spec, w.config.vocab);
    let gpus = common::gpus(2);
    let pipeline = Strategy::Pipeline {
        partition: PartitionSpec::Even,
        micro_batches: 2,
        schedule: Schedule::InFlight,
    };
    for (label, strategy, n) in [
        ("single", Strategy::Single, 1),
        ("tp2", Strategy::Tensor { split: None }, 2),
        ("pp2 m=2", pipeline, 2),
    ] {
        let run = |cache: bool| {
            let comm = CommConfig::default();
            let mut e =
                build_step_engine(&strategy, &gpus[..n], &w, DType::F32, &comm, (2, 48)).unwrap();
            let opts = ServeOptions {
                max_batch: 2,
                max_prefill_tokens: 128,
                max_step_tokens: 512,
                prefix_cache: cache,
            };
            serve(e.as_mut(), &chats, &opts, Recorder::new(), &mut |_, _| {})
                .unwrap_or_else(|e| panic!("{label} (cache {cache}): {e}"))
        };
        let (with, without) = (run(true), run(false));
        assert_eq!(with.prefix, Default::default(), "{label}: nothing reused");
        let mut longest = 0;
        for (a, b) in with.outcomes.iter().zip(&without.outcomes) {
            assert_eq!((&a.error, &b.error), (&None, &None), "{label} {}", a.id);
            assert_eq!(a.tokens.len(), a.max_new, "{label} {}", a.id);
            assert_eq!(a.tokens, b.tokens, "{label} request {}", a.id);
            longest = longest.max(a.prompt_len);
        }
        assert!(longest > 16, "{label}: a prompt went in several chunks");
    }
}

/// The f64 windowed attention of `q` over caches laid out `[slot][kv head][max_seq][d]`:
/// row `b` of `rows` (slot, past) holds `seq` queries at positions past.., each attending the
/// `window` positions up to its own, scores scaled by `scale`.
fn windowed_f64(
    (q, kc, vc): (&[f32], &[f32], &[f32]),
    (nh, nkv, d, max_seq): (usize, usize, usize, usize),
    (rows, seq): (&[(usize, usize)], usize),
    (window, scale): (usize, f32),
) -> Vec<f64> {
    let tokens = rows.len() * seq;
    let at = |slot: usize, h: usize, p: usize| ((slot * nkv + h) * max_seq + p) * d;
    let mut want = vec![0.0; tokens * nh * d];
    for t in 0..tokens {
        let (slot, past) = rows[t / seq];
        let pos = past + t % seq;
        let keys = (pos + 1).saturating_sub(window)..pos + 1;
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let qv = &q[(t * nh + h) * d..(t * nh + h + 1) * d];
            let score = |p: usize| {
                let k = &kc[at(slot, kvh, p)..at(slot, kvh, p) + d];
                qv.iter()
                    .zip(k)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * scale as f64
            };
            let m = keys.clone().map(score).fold(f64::MIN, f64::max);
            let z: f64 = keys.clone().map(|p| (score(p) - m).exp()).sum();
            for p in keys.clone() {
                let w = (score(p) - m).exp() / z;
                for c in 0..d {
                    want[(t * nh + h) * d + c] += w * vc[at(slot, kvh, p) + c] as f64;
                }
            }
        }
    }
    want
}
