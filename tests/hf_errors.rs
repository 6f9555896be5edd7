//! Bad checkpoints give errors that name the file (and tensor) at fault, never a panic:
//! missing tensor, wrong shape, wrong dtype, truncated or corrupt file, unknown architecture,
//! missing tokenizer, config or shard.

mod hf_support;

use std::path::Path;

use hf_support::{write_checkpoint, Store};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use wgpar::model::hf::Checkpoint;
use wgpar::model::{ModelConfig, ModelWeights};

fn weights(preset: &str) -> ModelWeights {
    ModelWeights::synthetic(&ModelConfig::preset(preset).unwrap(), 3)
}

/// Opens and loads `dir`, returning the first error's message.
fn load_error(dir: &Path) -> String {
    match Checkpoint::open(dir).and_then(|c| c.weights(false)) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(e: &str, parts: &[&str]) {
    for p in parts {
        assert!(e.contains(p), "'{p}' not in: {e}");
    }
}

/// A checkpoint folder for `w` whose tensors went through `edit` first.
fn edited(
    name: &str,
    w: &ModelWeights,
    edit: impl FnOnce(&mut hf_support::Tensors),
) -> hf_support::Scratch {
    let dir = write_checkpoint(name, w, Store::F32);
    let mut tensors = hf_support::tensors(w);
    edit(&mut tensors);
    hf_support::write_safetensors(&dir.join("model.safetensors"), &tensors, Store::F32);
    dir
}

#[test]
fn missing_tensor_is_named() {
    let dir = edited("missing", &weights("tiny-gpt2"), |t| {
        t.retain(|(n, _, _)| n != "h.1.mlp.c_fc.weight")
    });
    let e = load_error(&dir);
    assert_mentions(
        &e,
        &[
            "model.safetensors",
            "'h.1.mlp.c_fc.weight'",
            "missing",
            "layer 1",
        ],
    );
}

#[test]
fn wrong_shape_states_both_shapes() {
    let dir = edited("shape", &weights("tiny-llama"), |t| {
        let q = t
            .iter_mut()
            .find(|(n, _, _)| n == "model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        q.1 = vec![48, 192];
    });
    let e = load_error(&dir);
    assert_mentions(
        &e,
        &[
            "'model.layers.0.self_attn.q_proj.weight'",
            "shape [48, 192]",
            "expected [96, 96]",
        ],
    );
}

#[test]
fn wrong_dtype_is_refused() {
    let w = weights("tiny-llama");
    let dir = write_checkpoint("dtype", &w, Store::F32);
    // Rewrite with the final norm stored as I32.
    let tensors = hf_support::tensors(&w);
    let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            let dtype = if n == "model.norm.weight" {
                Dtype::I32
            } else {
                Dtype::F32
            };
            (
                n.clone(),
                dtype,
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let e = load_error(&dir);
    assert_mentions(
        &e,
        &["'model.norm.weight'", "dtype I32", "F32, F16 and BF16"],
    );
}

#[test]
fn truncated_file_is_reported_at_open() {
    let dir = write_checkpoint("truncated", &weights("tiny-gpt2"), Store::F16);
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(&e, &["model.safetensors", "truncated or corrupt"]);
}

#[test]
fn corrupt_header_and_tiny_file_are_reported() {
    let dir = write_checkpoint("corrupt", &weights("tiny-gpt2"), Store::F32);
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..16].copy_from_slice(b"not json");
    std::fs::write(&path, &bytes).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(&e, &["model.safetensors", "not a valid safetensors file"]);
    std::fs::write(&path, b"abc").unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(&e, &["model.safetensors", "not a valid safetensors file"]);
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let dir = write_checkpoint("arch", &weights("tiny-gpt2"), Store::F32);
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "t5", "d_model": 512}"#,
    )
    .unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(
        &e,
        &[
            "config.json",
            "model_type 't5' is not supported",
            "gpt2",
            "llama",
            "bert",
        ],
    );
}

#[test]
fn missing_tokenizer_config_and_weights_are_named() {
    let dir = write_checkpoint("notok", &weights("tiny-gpt2"), Store::F32);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let e = ckpt.tokenizer().unwrap_err().to_string();
    assert_mentions(&e, &["tokenizer.json", "missing"]);
    std::fs::write(dir.join("tokenizer.json"), "{ not a tokenizer").unwrap();
    let e = ckpt.tokenizer().unwrap_err().to_string();
    assert_mentions(&e, &["tokenizer.json", "not valid JSON", "line 1"]);

    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(&e, &["model.safetensors.index.json", "pytorch_model.bin"]);
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(&e, &["config.json", "missing"]);
    let e = Checkpoint::open(&dir.join("nowhere"))
        .err()
        .unwrap()
        .to_string();
    assert_mentions(&e, &["nowhere", "not a model folder"]);
}

#[test]
fn missing_shard_and_misplaced_tensor_are_named() {
    let w = weights("tiny-llama");
    let dir = write_checkpoint("shards", &w, Store::F32);
    std::fs::rename(
        dir.join("model.safetensors"),
        dir.join("part-1.safetensors"),
    )
    .unwrap();
    let mut map = serde_json::Map::new();
    for (n, _, _) in hf_support::tensors(&w) {
        map.insert(n, "part-1.safetensors".into());
    }
    map.insert("model.extra".into(), "part-1.safetensors".into());
    let index = |m: &serde_json::Map<String, serde_json::Value>| {
        serde_json::json!({ "weight_map": m }).to_string()
    };
    std::fs::write(dir.join("model.safetensors.index.json"), index(&map)).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(&e, &["part-1.safetensors", "'model.extra'", "lacks it"]);
    map.insert("model.extra".into(), "part-2.safetensors".into());
    std::fs::write(dir.join("model.safetensors.index.json"), index(&map)).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(&e, &["part-2.safetensors", "missing"]);
    map.insert("model.extra".into(), "../escape.safetensors".into());
    std::fs::write(dir.join("model.safetensors.index.json"), index(&map)).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap().to_string();
    assert_mentions(&e, &["not a plain file name"]);
}
