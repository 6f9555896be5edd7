//! `--model FILE.gguf` on the command line: `run --prompt` generates the same text from a GGUF
//! file as from a safetensors folder of the same weights and vocabulary, on one device, tensor
//! parallel and pipelined over two; `run` benchmarks and `plan` read the file too.

mod common;
mod gguf_support;
mod hf_support;

use common::wgpar;
use gguf_support::{gguf_tensors, model_meta, write_gguf, GgufSpec};
use hf_support::{write_checkpoint, Store};
use serde_json::{json, Value};
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelConfig, ModelWeights};

/// GPT-2's byte-level vocabulary without merges: the 256 byte characters, then the end token.
fn byte_tokens() -> Vec<String> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256;
    let mut tokens: Vec<String> = (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap().to_string()
        })
        .collect();
    tokens.push("<|endoftext|>".into());
    tokens
}

fn tokenizer_json(tokens: &[String]) -> Value {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    json!({"version": "1.0", "truncation": null, "padding": null,
           "added_tokens": [{"id": 256, "content": "<|endoftext|>", "single_word": false,
                             "lstrip": false, "rstrip": false, "normalized": false,
                             "special": true}],
           "normalizer": null, "pre_tokenizer": byte_level, "post_processor": byte_level,
           "decoder": byte_level,
           "model": {"type": "BPE", "dropout": null, "unk_token": null,
                     "continuing_subword_prefix": "", "end_of_word_suffix": "",
                     "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}})
}

#[test]
fn gguf_runs_like_its_safetensors_folder_on_every_engine() {
    let config = ModelConfig {
        vocab: 257,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let w = ModelWeights::synthetic(&config, 50);
    let tokens = byte_tokens();
    let folder = write_checkpoint("gguf-cli", &w, Store::F32);
    std::fs::write(
        folder.join("tokenizer.json"),
        tokenizer_json(&tokens).to_string(),
    )
    .unwrap();
    let mut meta = model_meta(&w, "llama");
    meta.extend([
        json!(["tokenizer.ggml.model", "str", "gpt2"]),
        json!(["tokenizer.ggml.tokens", "str_array", tokens]),
        json!(["tokenizer.ggml.merges", "str_array", Vec::<String>::new()]),
        json!(["tokenizer.ggml.add_bos_token", "bool", false]),
    ]);
    let spec = GgufSpec {
        arch: "llama",
        matrices: QuantType::F32,
        meta,
    };
    let dir = hf_support::scratch("gguf-cli-file");
    let file = write_gguf(&dir, "m", &gguf_tensors(&w, true), &spec);
    let run = |model: &str, extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            model,
            "--prompt",
            "Hello, GGUF",
            "--gen",
            "8",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = wgpar(&args);
        assert!(ok, "{model} {extra:?}: {err}");
        // The generated text is the first line (a pipeline adds its bubble after it).
        out.lines().next().unwrap_or_default().to_string()
    };
    let want = run(folder.to_str().unwrap(), &[]);
    assert!(
        want.starts_with("Hello, GGUF") && want.len() > "Hello, GGUF".len(),
        "{want}"
    );
    let file = file.to_str().unwrap();
    assert_eq!(run(file, &[]), want);
    for strategy in ["tp", "pp"] {
        assert_eq!(
            run(file, &["--virtual", "2", "--strategy", strategy]),
            want,
            "{strategy}"
        );
    }
    let (ok, out, err) = wgpar(&["run", "--model", file, "--prompt-len", "5", "--gen", "2"]);
    assert!(ok && out.contains("decode:"), "{out}{err}");
    let (ok, out, err) = wgpar(&["plan", "--model", file, "--devices", "2", "--seqs", "16"]);
    assert!(ok, "{err}");
    assert!(out.contains("gguf-test"), "{out}");
}

#[test]
fn weights_option_packs_or_refuses_before_devices_open() {
    // The default model's widths (384, 384, 1024) are whole Q8_0 blocks but not Q4_K ones.
    let args = |t: &'static str| ["run", "--weights", t, "--prompt-len", "4", "--gen", "2"];
    let (ok, out, err) = wgpar(&args("q8_0"));
    assert!(ok && out.contains("decode:"), "{out}{err}");
    let (ok, _, err) = wgpar(&args("q4_k"));
    assert!(
        !ok && err.contains("hidden size of 384") && err.contains("256"),
        "{err}"
    );
    // plan projects the wgpar engine only with formats the runtime holds.
    let plan = |w: &'static str, engines: &'static str| {
        wgpar(&[
            "plan",
            "--model",
            "tiny-llama",
            "--weights",
            w,
            "--engines",
            engines,
            "--seqs",
            "16",
        ])
    };
    let (ok, _, err) = plan("int4", "wgpar,cuda-nccl");
    assert!(
        !ok && err.contains("--weights int4") && err.contains("q6_k"),
        "{err}"
    );
    let (ok, _, err) = plan("int4", "cuda-nccl");
    assert!(ok, "{err}");
    let (ok, _, err) = plan("q4_k", "wgpar");
    assert!(ok, "{err}");
}

#[test]
fn a_gguf_keeps_its_blocks_unless_weights_says_otherwise() {
    let config = gguf_support::whole_block_llama();
    let w = ModelWeights::synthetic(&config, 52);
    let spec = GgufSpec {
        arch: "llama",
        matrices: QuantType::Q8_0,
        meta: model_meta(&w, "llama"),
    };
    let dir = hf_support::scratch("gguf-cli-blocks");
    let file = write_gguf(&dir, "q8", &gguf_tensors(&w, true), &spec);
    let file = file.to_str().unwrap();
    let run = |extra: &[&'static str]| {
        let mut args = vec!["run", "--model", file, "--prompt-len", "4", "--gen", "2"];
        args.extend_from_slice(extra);
        let (ok, out, err) = wgpar(&args);
        assert!(ok && out.contains("decode:"), "{extra:?}: {out}{err}");
        err
    };
    // The file's own Q8_0 blocks, and --weights of the same type: nothing re-packed.
    for extra in [&[][..], &["--weights", "q8_0"], &["--weights", "dense"]] {
        let err = run(extra);
        assert!(!err.contains("re-packs"), "{extra:?}: {err}");
    }
    let err = run(&["--weights", "q4_0"]);
    assert!(
        err.contains("note: --weights q4_0 re-packs") && err.contains("as q8_0"),
        "{err}"
    );
}
