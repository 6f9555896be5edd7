//! `--model FILE.gguf` on the command line: `run --prompt` generates the same text from a GGUF
//! file as from a safetensors folder of the same weights and vocabulary, on one device, tensor
//! parallel and pipelined over two; `run` benchmarks and `plan` read the file too.

mod common;
mod gguf_support;
mod hf_support;

use common::wgpar;
use gguf_support::{gguf_tensors, model_meta, write_gguf, GgufSpec};
use hf_support::Store;
use serde_json::{json, Value};
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelConfig, ModelWeights};

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

/// A tiny Llama over GPT-2's byte vocabulary, drawn from `seed`: as a safetensors folder with
/// its tokenizer.json written into `folder`, and as a GGUF file in `dir` (returned).
fn tiny_byte_llama(
    seed: u64,
    folder: &std::path::Path,
    dir: &std::path::Path,
) -> std::path::PathBuf {
    let config = ModelConfig {
        vocab: 257,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let w = ModelWeights::synthetic(&config, seed);
    let tokens = gguf_support::byte_tokens();
    hf_support::write_checkpoint_to(folder, &w, Store::F32);
    let tokenizer = tokenizer_json(&tokens).to_string();
    std::fs::write(folder.join("tokenizer.json"), tokenizer).unwrap();
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
    write_gguf(dir, "m", &gguf_tensors(&w, true), &spec)
}

#[test]
fn gguf_runs_like_its_safetensors_folder_on_every_engine() {
    let (folder, dir) = (
        hf_support::scratch("gguf-cli"),
        hf_support::scratch("gguf-cli-file"),
    );
    let file = tiny_byte_llama(50, &folder, &dir);
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

/// Runs `wgpar` with extra environment variables: (exit code, stdout, stderr).
fn wgpar_env(args: &[&str], env: &[(&str, &std::path::Path)]) -> (Option<i32>, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// Lays `files` out as the Hugging Face cache does: blobs, a snapshot of links to them, and
/// `refs/main` naming the snapshot.
fn hub_cache_repo(cache: &std::path::Path, repo: &str, files: &[(&str, &std::path::Path)]) {
    let folder = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = folder.join("snapshots/0123abcd");
    std::fs::create_dir_all(folder.join("blobs")).unwrap();
    std::fs::create_dir_all(folder.join("refs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    for (i, (name, source)) in files.iter().enumerate() {
        let blob = folder.join(format!("blobs/{i:040x}"));
        std::fs::copy(source, &blob).unwrap();
        std::os::unix::fs::symlink(&blob, snapshot.join(name)).unwrap();
    }
    std::fs::write(folder.join("refs/main"), "0123abcd").unwrap();
}

/// Issue 38 item 6: `--model org/name` from the Hugging Face cache (a folder, or a GGUF repo's
/// file picked by `:TAG`) and `--model ollama:name` from Ollama's store run the same text as
/// the files' own paths; a name found nowhere is a usage error that lists where it looked.
#[test]
fn models_resolve_from_the_hub_cache_and_ollama_store() {
    let (folder, stores) = (
        hf_support::scratch("gguf-hub"),
        hf_support::scratch("gguf-hub-stores"),
    );
    let file = tiny_byte_llama(51, &folder, &stores);
    let cache = stores.join("hf");
    let names = ["config.json", "model.safetensors", "tokenizer.json"];
    let folder_files: Vec<_> = names.iter().map(|n| (*n, folder.join(n))).collect();
    let links: Vec<(&str, &std::path::Path)> = folder_files
        .iter()
        .map(|(n, p)| (*n, p.as_path()))
        .collect();
    hub_cache_repo(&cache, "acme/tiny", &links);
    hub_cache_repo(
        &cache,
        "acme/tiny-GGUF",
        &[("tiny-F32.gguf", &file), ("tiny-Q8_0.gguf", &file)],
    );
    let ollama = stores.join("ollama");
    let manifest = ollama.join("manifests/models.example/library/tiny/latest");
    std::fs::create_dir_all(manifest.parent().unwrap()).unwrap();
    std::fs::create_dir_all(ollama.join("blobs")).unwrap();
    std::fs::copy(&file, ollama.join("blobs/sha256-00ff")).unwrap();
    let layers = json!({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:0011"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:00ff"}]});
    std::fs::write(&manifest, layers.to_string()).unwrap();

    let env = [
        ("HF_HUB_CACHE", cache.as_path()),
        ("OLLAMA_MODELS", ollama.as_path()),
    ];
    let run = |model: &str| {
        let args = [
            "run",
            "--model",
            model,
            "--prompt",
            "Hello, hub",
            "--gen",
            "6",
        ];
        wgpar_env(&args, &env)
    };
    let (code, want, err) = run(folder.to_str().unwrap());
    assert!(
        code == Some(0) && want.starts_with("Hello, hub"),
        "{want}{err}"
    );
    for name in [
        "acme/tiny",
        "acme/tiny@0123abcd",
        "acme/tiny-GGUF:f32",
        "ollama:tiny:latest",
    ] {
        let (code, out, err) = run(name);
        assert_eq!(code, Some(0), "{name}: {err}");
        assert_eq!(out.lines().next(), want.lines().next(), "{name}");
    }
    let (code, _, err) = run("acme/tiny-GGUF");
    assert!(
        code == Some(2) && err.contains("tiny-F32.gguf, tiny-Q8_0.gguf"),
        "{err}"
    );
    for (name, looked) in [
        (
            "acme/absent",
            "models--acme--absent: not in the Hugging Face cache",
        ),
        ("acme/tiny@v9", "no ref or snapshot 'v9'"),
        ("ollama:absent", "no manifest library/absent/latest"),
    ] {
        let (code, _, err) = run(name);
        assert_eq!(code, Some(2), "{name}: {err}");
        assert!(err.contains(looked), "{name}: {err}");
    }
}
