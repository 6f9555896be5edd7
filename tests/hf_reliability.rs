//! Checkpoints that would abort the process or silently produce garbage (issue 16 items 1, 5
//! and 9): a config.json with absurd layer counts, non-positive epsilons or RoPE bases,
//! non-finite weights, and a tokenizer.json that is JSON but not a tokenizer.

mod common;
mod hf_support;

use std::path::Path;

use hf_support::{config_json, write_checkpoint, write_word_tokenizer, Store};
use wgpar::model::hf::{Checkpoint, TextTokenizer};
use wgpar::model::{ModelConfig, ModelWeights};

fn weights(preset: &str) -> ModelWeights {
    ModelWeights::synthetic(&ModelConfig::preset(preset).unwrap(), 5)
}

/// A checkpoint of `preset` whose config.json went through `edit`.
fn with_config(
    name: &str,
    preset: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> hf_support::Scratch {
    let w = weights(preset);
    let dir = write_checkpoint(name, &w, Store::F32);
    let mut config = config_json(&w);
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

fn open_error(dir: &Path) -> String {
    match Checkpoint::open(dir).and_then(|c| c.weights(false)) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Item 1: a billion layers in config.json (Llama, GPT-2's `n_layer`, BERT) is refused at open
/// with the count the weights hold, not by an allocation abort; through the CLI too.
#[test]
fn absurd_layer_counts_are_refused_from_the_weights_present() {
    for (preset, key) in [
        ("tiny-llama", "num_hidden_layers"),
        ("tiny-gpt2", "n_layer"),
        ("tiny-bert", "num_hidden_layers"),
    ] {
        for layers in [1_000_000_000u64, 1000, 3] {
            let dir = with_config("layers", preset, |c| c[key] = layers.into());
            let e = open_error(&dir);
            assert!(
                e.contains(&format!("\"{key}\" is {layers}")) || e.contains("beyond any device"),
                "{preset} {layers}: {e}"
            );
            assert!(e.contains("config.json"), "{e}");
        }
    }
    let dir = with_config("layers-cli", "tiny-llama", |c| {
        c["num_hidden_layers"] = 1_000_000_000u64.into()
    });
    let (ok, out, err) = common::wgpar(&["run", "--model", dir.to_str().unwrap()]);
    assert!(!ok && out.is_empty(), "{out}");
    assert!(err.contains("num_hidden_layers"), "{err}");
    write_word_tokenizer(&dir, 397);
    let (ok, _, err) = common::wgpar(&["embed", "--model", dir.to_str().unwrap(), "--text", "t1"]);
    assert!(!ok && err.contains("num_hidden_layers"), "{err}");
}

/// Item 5: epsilons and RoPE bases that would make every output NaN or zero are refused.
#[test]
fn non_positive_epsilon_and_rope_base_are_refused() {
    let cases: [(&str, &str, serde_json::Value, &str); 6] = [
        ("tiny-llama", "rms_norm_eps", (-1e-5).into(), "epsilon"),
        ("tiny-llama", "rms_norm_eps", 0.0.into(), "epsilon"),
        ("tiny-llama", "rope_theta", 0.0.into(), "rope_theta"),
        ("tiny-llama", "rope_theta", (-10.0).into(), "rope_theta"),
        ("tiny-gpt2", "layer_norm_epsilon", (-1.0).into(), "epsilon"),
        ("tiny-bert", "layer_norm_eps", 0.0.into(), "epsilon"),
    ];
    for (preset, key, value, want) in cases {
        let dir = with_config("eps", preset, |c| c[key] = value.clone());
        let e = open_error(&dir);
        assert!(
            e.contains(want) && e.contains("config.json"),
            "{key}={value}: {e}"
        );
    }
    // A number too large for f32 becomes infinite: refused too.
    let dir = with_config("eps-inf", "tiny-llama", |c| c["rope_theta"] = 1e300.into());
    let e = open_error(&dir);
    assert!(e.contains("rope_theta inf"), "{e}");
}

/// Item 5: NaN or infinite weights are found at load and the tensor named.
#[test]
fn non_finite_weights_are_named_at_load() {
    for (bad, text) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf")] {
        let w = weights("tiny-llama");
        let dir = write_checkpoint("nan", &w, Store::F32);
        let mut tensors = hf_support::tensors(&w);
        let (name, _, values) = tensors
            .iter_mut()
            .find(|(n, _, _)| n.ends_with("layers.1.mlp.up_proj.weight"))
            .unwrap();
        let name = name.clone();
        values[7] = bad;
        values[9] = bad;
        hf_support::write_safetensors(&dir.join("model.safetensors"), &tensors, Store::F32);
        let e = open_error(&dir);
        assert!(
            e.contains(&name) && e.contains("2 of") && e.contains("index 7") && e.contains(text),
            "{e}"
        );
    }
}

/// Item 9: JSON that is not a tokenizer says so, instead of a serde position alone.
#[test]
fn a_json_file_that_is_not_a_tokenizer_says_so() {
    let dir = common::scratch_dir("not-a-tokenizer");
    let file = dir.join("tokenizer.json");
    std::fs::write(&file, r#"{"vocab_size": 5, "added_tokens": []}"#).unwrap();
    let e = TextTokenizer::from_file(&file, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not a Hugging Face tokenizers file") && e.contains("\"model\""),
        "{e}"
    );
    // Found by the property-test campaign: the tokenizers crate panicked on a malformed
    // decoder section; wgpar returns an error instead.
    write_word_tokenizer(&dir, 8);
    let valid = std::fs::read_to_string(&file).unwrap();
    for bad in ["NaN", "5", "{\"type\": 5}", "[1]"] {
        let text = valid.replace("\"decoder\":null", &format!("\"decoder\":{bad}"));
        assert_ne!(text, valid);
        std::fs::write(&file, text).unwrap();
        let r = TextTokenizer::from_file(&file, None);
        assert!(r.is_err(), "decoder {bad} accepted");
    }
    std::fs::write(&file, "{\"model\": [1, 2,").unwrap();
    let e = TextTokenizer::from_file(&file, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not valid JSON") && e.contains("line 1"), "{e}");
}

/// Issue 29 item 5: tensors the config does not use (a second layer's under
/// `num_hidden_layers: 1`) are named in a warning, as Hugging Face does; a checkpoint whose
/// tensors are all used loads without one.
#[test]
fn tensors_the_config_does_not_use_are_named() {
    let run = |dir: &Path| {
        common::wgpar(&[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--batch",
            "1",
            "--prompt-len",
            "2",
            "--gen",
            "1",
        ])
    };
    let full = write_checkpoint("unused-none", &weights("tiny-llama"), Store::F32);
    let (ok, out, err) = run(&full);
    assert!(ok, "{out}{err}");
    assert!(!err.contains("not used"), "{err}");

    let layers = weights("tiny-llama").config.layers;
    assert!(
        layers >= 2,
        "the preset needs a second layer to leave unused"
    );
    let cut = with_config("unused-some", "tiny-llama", |c| {
        c["num_hidden_layers"] = serde_json::json!(1)
    });
    let (ok, out, err) = run(&cut);
    assert!(ok, "{out}{err}");
    assert!(err.contains("not used by its config.json"), "{err}");
    assert!(err.contains("model.layers.1."), "{err}");
    assert!(!err.contains("model.layers.0."), "{err}");
}
