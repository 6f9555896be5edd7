//! Qwen3 (issue 37 item 1): per-head RMSNorm of queries and keys before RoPE, heads wider than
//! hidden / heads, a tied head. Every engine (single, TP over 2 devices, PP over 2 stages,
//! hybrid 2 x 2) gives the CPU f64 reference's greedy tokens, and its logits within the bar;
//! the reference without the norms does not match; Hugging Face folders and GGUF files
//! (f32 and packed) written here load to the same model; what is not supported is refused by
//! name.

mod common;
mod gguf_support;
mod hf_support;

use common::decoder::{assert_same_weights, check_engine, reference, same_logits, single, Greedy};

use gguf_support::{gguf_tensors, model_meta, write_gguf, GgufSpec};
use hf_support::{write_checkpoint, Store};
use serde_json::json;
use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::kernels::ops;
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{Engine, Partition, PipelineEngine, SingleEngine, TensorParallelEngine};

/// Tokens generated per sequence (the prefill's pick, then decode steps).
const STEPS: usize = 6;
/// Largest relative error of an engine's logits against the f64 reference.
const BAR: f64 = 1e-4;
/// Greedy decoding against the reference, as every check here runs it.
const RUN: Greedy = Greedy {
    steps: STEPS,
    prompt: 5,
    bar: BAR,
};

/// tiny-qwen3 (4 heads of 32 over a stream of 96, tied head) with `layers` layers, its query
/// and key projections scaled up: trained Qwen3 layers project far from unit RMS, so the
/// norms change the attention scores a lot (and a missing norm shows).
fn weights(layers: usize, seed: u64) -> ModelWeights {
    let config = ModelConfig {
        layers,
        ..ModelConfig::preset("tiny-qwen3").unwrap()
    };
    assert!(config.q_dim() != config.hidden && config.tied_head && config.qk_norm);
    let mut w = ModelWeights::synthetic(&config, seed);
    for l in &mut w.layers {
        for x in l.wq.iter_mut().chain(&mut l.wk) {
            *x *= 3.0;
        }
    }
    w
}

#[test]
fn single_tp_and_pp_give_the_reference_tokens() {
    let w = weights(2, 41);
    let gpus = common::gpus(2);
    check_engine("single", &mut single(gpus[0].clone(), &w), &w, &RUN);
    let mut tp =
        TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default()).unwrap();
    check_engine("tp=2", &mut tp, &w, &RUN);
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

/// The comparison has teeth: a reference without the query/key norms, or with them but the
/// projections left unscaled where the device scales them, is far outside the bar.
#[test]
fn the_reference_without_the_norms_does_not_match() {
    let w = weights(2, 43);
    let prompts = common::prompts(2, 5, w.config.vocab, 7);
    let gpu = common::gpus(1).remove(0);
    let got = single(gpu, &w).prefill(&prompts).unwrap();
    let (_, right) = reference(&w, &prompts, STEPS);
    assert!(got.relative_error(&right[0]) <= BAR);
    let mut off = w.clone();
    for l in &mut off.layers {
        (l.q_norm, l.k_norm) = (None, None);
    }
    let (_, wrong) = reference(&off, &prompts, STEPS);
    let err = got.relative_error(&wrong[0]);
    assert!(
        err > 100.0 * BAR,
        "norms off changed the logits by {err:.2e}"
    );
    // Scales of 1 instead of the trained ones: the scales matter too.
    let mut unit = w.clone();
    for l in &mut unit.layers {
        l.q_norm = Some(vec![1.0; w.config.head_dim]);
    }
    let (_, wrong) = reference(&unit, &prompts, STEPS);
    let err = got.relative_error(&wrong[0]);
    assert!(err > 100.0 * BAR, "unit query scales changed {err:.2e}");
}

/// A device model whose weights do not match the config's `qk_norm` is refused, naming it.
#[test]
fn weights_without_the_norms_are_refused() {
    let mut w = weights(2, 44);
    w.layers[1].k_norm = None;
    let gpu = common::gpus(1).remove(0);
    let e = SingleEngine::new(gpu, &w, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("qk_norm") && e.contains("layer 1"), "{e}");
}

#[test]
fn hugging_face_folders_load_to_the_same_model() {
    let w = weights(2, 45);
    for store in [Store::F32, Store::Bf16] {
        let dir = write_checkpoint("qwen3", &w, store);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let mut want = w.config.clone();
        want.name = ckpt.config().name.clone();
        assert_eq!(ckpt.config(), &want);
        let loaded = ckpt.weights(false).unwrap();
        assert_same_weights(&loaded, &w, &|x| store.round(x));
        if store == Store::F32 {
            same_logits(&loaded, &w, 5);
        }
    }
    // A config that names only the class, as some exports do.
    let dir = write_checkpoint("qwen3-class", &w, Store::F32);
    let mut json = hf_support::config_json(&w);
    json.as_object_mut().unwrap().remove("model_type");
    json["architectures"] = json!(["Qwen3ForCausalLM"]);
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let c = Checkpoint::open(&dir).unwrap().config().clone();
    assert!(c.qk_norm && c.head_dim == 32 && c.q_dim() == 128, "{c:?}");
}

#[test]
fn hugging_face_folder_without_a_norm_is_refused_by_name() {
    let w = weights(2, 46);
    let dir = hf_support::scratch("qwen3-no-norm");
    std::fs::write(
        dir.join("config.json"),
        hf_support::config_json(&w).to_string(),
    )
    .unwrap();
    let mut tensors = hf_support::llama_tensors(&w);
    tensors.retain(|(n, _, _)| n != "model.layers.1.self_attn.k_norm.weight");
    hf_support::write_safetensors(&dir.join("model.safetensors"), &tensors, Store::F32);
    let e = Checkpoint::open(&dir)
        .unwrap()
        .weights(false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("layers.1.self_attn.k_norm.weight"), "{e}");
    // Qwen3's mixture-of-experts sibling is another model type, refused as such.
    let mut json = hf_support::config_json(&w);
    json["model_type"] = "qwen3_moe".into();
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert!(e.contains("model_type 'qwen3_moe' is not supported"), "{e}");
}

fn spec<'a>(w: &ModelWeights, matrices: QuantType) -> GgufSpec<'a> {
    GgufSpec {
        arch: "qwen3",
        matrices,
        meta: model_meta(w, "qwen3"),
    }
}

/// A qwen3 GGUF (rows as stored: the converter does not permute them) loads to the weights of
/// the same model's folder, and runs to the same logits.
#[test]
fn gguf_f32_matches_the_folder() {
    let w = weights(2, 47);
    let dir = hf_support::scratch("qwen3-gguf");
    let file = write_gguf(
        &dir,
        "m",
        &gguf_tensors(&w, false),
        &spec(&w, QuantType::F32),
    );
    let g = Checkpoint::open(&file).unwrap();
    let mut want = w.config.clone();
    want.name = "gguf-test".into();
    assert_eq!(g.config(), &want);
    let loaded = g.weights(false).unwrap();
    assert_same_weights(&loaded, &w, &|x| Store::F32.round(x));
    same_logits(&loaded, &w, 5);
}

/// Packed GGUF matrices (Q8_0 written by llama.cpp's package, Q4_K by wgpar's quantizer) run
/// on one device and split over two to the reference's tokens on their own values.
#[test]
fn packed_gguf_runs_single_and_tp_to_the_reference_tokens() {
    let w = weights(2, 48);
    let dir = hf_support::scratch("qwen3-gguf-q8");
    let file = write_gguf(
        &dir,
        "m",
        &gguf_tensors(&w, false),
        &spec(&w, QuantType::Q8_0),
    );
    let loaded = Checkpoint::open(&file).unwrap().weights(false).unwrap();
    assert!(
        loaded.blocks().count() == 2 * 7,
        "every projection kept in Q8_0 blocks"
    );
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
    // K-quants take rows of 256: heads of 128 over a stream of 256, as Qwen3-4B's are.
    let config = ModelConfig {
        vocab: 300,
        hidden: 256,
        heads: 4,
        kv_heads: 2,
        head_dim: 128,
        ffn: 512,
        max_seq: 32,
        ..ModelConfig::preset("tiny-qwen3").unwrap()
    };
    let w = ModelWeights::synthetic(&config, 49);
    let file = write_gguf(
        &dir,
        "k",
        &gguf_tensors(&w, false),
        &spec(&w, QuantType::Q4K),
    );
    let loaded = Checkpoint::open(&file).unwrap().weights(false).unwrap();
    assert!(loaded.block_types().contains(&QuantType::Q4K));
    check_engine(
        "q4_k single",
        &mut single(gpus[0].clone(), &loaded),
        &loaded,
        &RUN,
    );
}

#[test]
fn gguf_features_it_lacks_are_refused_by_name() {
    let w = weights(2, 50);
    let dir = hf_support::scratch("qwen3-gguf-bad");
    let mut meta = model_meta(&w, "qwen3");
    meta.retain(|m| m[0] != "qwen3.attention.value_length");
    meta.push(json!(["qwen3.attention.value_length", "u32", 16]));
    let bad = GgufSpec {
        arch: "qwen3",
        matrices: QuantType::F32,
        meta,
    };
    let file = write_gguf(&dir, "v", &gguf_tensors(&w, false), &bad);
    let e = Checkpoint::open(&file).err().unwrap().to_string();
    assert!(
        e.contains("qwen3.attention.value_length") && e.contains("16"),
        "{e}"
    );
    let mut tensors = gguf_tensors(&w, false);
    tensors.retain(|t| t.name != "blk.0.attn_q_norm.weight");
    let file = write_gguf(&dir, "n", &tensors, &spec(&w, QuantType::F32));
    let e = Checkpoint::open(&file)
        .unwrap()
        .weights(false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("blk.0.attn_q_norm.weight"), "{e}");
}

/// The in-place per-head norm against f64 on random data: heads narrower and wider than its
/// 64 invocations, and more rows (tokens x heads) than one grid dimension holds, so the fold
/// into two is exercised; values past the bound heads stay as they were.
#[test]
fn head_norm_kernel_matches_f64_past_one_grid_dimension() {
    let gpu = &common::gpus(1)[0];
    for (tokens, heads, head_dim) in [(3, 5, 100), (2, 3, 256), (8200, 8, 12)] {
        let len = tokens * heads * head_dim;
        let tail = 37;
        let x: Vec<f32> = (common::random(len + tail, 8).iter())
            .map(|v| v * 4.0 + 0.3)
            .collect();
        let gamma = common::random(head_dim, 9);
        let (xt, gt) = (
            gpu.upload_f32("x", &x).unwrap(),
            gpu.upload_f32("gamma", &gamma).unwrap(),
        );
        let mut enc = gpu.encoder();
        let shape = (tokens, heads, head_dim);
        ops::head_norm(gpu, &mut enc, (&gt, &xt), shape, 1e-6).unwrap();
        gpu.submit(enc);
        gpu.wait().unwrap();
        let got = gpu.read_f32(&xt).unwrap();
        let mut want: Vec<f64> = Vec::with_capacity(len);
        for head in x[..len].chunks(head_dim) {
            let ms = head.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / head_dim as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            want.extend(
                head.iter()
                    .zip(&gamma)
                    .map(|(&v, &g)| v as f64 * inv * g as f64),
            );
        }
        let err = common::rel_err(&got[..len], &want);
        assert!(err <= 1e-5, "{shape:?}: relative error {err:.2e}");
        assert_eq!(got[len..], x[len..], "{shape:?}: past the bound heads");
    }
}

/// `wgpar chat` on a qwen3 GGUF renders its turns with the file's `tokenizer.chat_template`
/// (ChatML, as Qwen3's) and replies what `run --prompt` continues the rendered text with.
#[test]
fn chat_uses_the_gguf_template() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let config = ModelConfig {
        vocab: 257,
        ..ModelConfig::preset("tiny-qwen3").unwrap()
    };
    let w = ModelWeights::synthetic(&config, 51);
    let template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\
                    <|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\
                    {% endif %}";
    let mut meta = model_meta(&w, "qwen3");
    meta.extend([
        json!(["tokenizer.ggml.model", "str", "gpt2"]),
        json!(["tokenizer.ggml.pre", "str", "qwen2"]),
        json!([
            "tokenizer.ggml.tokens",
            "str_array",
            gguf_support::byte_tokens()
        ]),
        json!(["tokenizer.ggml.merges", "str_array", Vec::<String>::new()]),
        json!(["tokenizer.ggml.add_bos_token", "bool", false]),
        json!(["tokenizer.chat_template", "str", template]),
    ]);
    let dir = hf_support::scratch("qwen3-chat");
    let spec = GgufSpec {
        arch: "qwen3",
        matrices: QuantType::F32,
        meta,
    };
    let file = write_gguf(&dir, "chat", &gguf_tensors(&w, false), &spec);
    let model = file.to_str().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(["chat", "--model", model, "--gen", "4", "--verbose"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "hi\n/exit").unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let prompt: String = (stderr.lines())
        .find_map(|l| l.strip_prefix("prompt: "))
        .map(|q| serde_json::from_str(q).unwrap())
        .unwrap_or_else(|| panic!("no rendered prompt: {stderr}"));
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let reply = (stdout.split("> ").nth(1))
        .and_then(|turn| turn.split_once('\n'))
        .map(|(reply, _)| reply.to_string())
        .unwrap_or_else(|| panic!("no reply: {stdout}"));
    assert!(!reply.is_empty(), "an empty reply: {stdout}");
    let run = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(["run", "--model", model, "--prompt", &prompt, "--gen", "4"])
        .output()
        .unwrap();
    assert!(run.status.success(), "{run:?}");
    let continued = String::from_utf8_lossy(&run.stdout).to_string();
    let continued = continued
        .strip_prefix(&prompt)
        .expect("run prints the prompt first");
    assert_eq!(reply, continued.trim_end_matches('\n'));
}
