//! `POST /v1/embeddings` (issue 35, item 6): `wgpar serve --model` an encoder's folder.
//! all-MiniLM-L6-v2 (mean pooling, Normalize) through the `openai` client (float, and its
//! default base64) and curl, against the f64 CPU reference of the same checkpoint; a synthetic
//! BERT with CLS pooling and no Normalize module, by token ids; every embeddings field of the
//! table honoured or refused by name; chat and completions refused on an encoder.

mod common;
mod hf_support;
mod serve_support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use serve_support::Server;
use wgpar::model::hf::Checkpoint;
use wgpar::model::{CpuReference, EncoderInput, ModelConfig, ModelWeights, PoolMode, Pooling};
use wgpar::server::api::fields::{Route, Rule, FIELDS};

fn serve(dir: &Path) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    // f32 weights and attention keys and values (an f16 KV cache, the default where the
    // adapter has SHADER_F16, costs about 1e-4 of relative error).
    let args = [
        "serve",
        "--port",
        "0",
        "--served-model-name",
        "m",
        "--dtype",
        "f32",
    ];
    cmd.args(args)
        .args(["--kv-dtype", "f32", "--model"])
        .arg(dir);
    Server::spawn(cmd, Duration::from_secs(300))
}

fn post(server: &Server, body: &Value) -> (u16, Value) {
    let (code, text) = server.post("/v1/embeddings", &body.to_string());
    let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{body}: {code} {text}"));
    (code, v)
}

/// `data[*].embedding` as floats.
fn vectors(v: &Value) -> Vec<Vec<f32>> {
    let data = v["data"].as_array().unwrap();
    for (i, d) in data.iter().enumerate() {
        assert_eq!(
            (d["index"].as_u64(), &d["object"]),
            (Some(i as u64), &json!("embedding"))
        );
    }
    data.iter()
        .map(|d| {
            let e = d["embedding"].as_array().unwrap();
            e.iter().map(|x| x.as_f64().unwrap() as f32).collect()
        })
        .collect()
}

fn close(got: &[Vec<f32>], want: &[Vec<f64>], bar: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (b, (g, w)) in got.iter().zip(want).enumerate() {
        let err = common::rel_err(g, w);
        assert!(err <= bar, "{what} [{b}]: relative error {err:.2e}");
    }
}

/// Each embeddings field of the table: 200 at its example if honoured or without effect, 400
/// naming it if refused (and 200 at the one value accepted).
fn walk_the_table(server: &Server) -> usize {
    let mut checked = 0;
    for f in FIELDS.iter().filter(|f| f.route == Route::Embeddings) {
        let mut body = json!({"model": "m", "input": "a b"});
        body[f.name] = serde_json::from_str(f.example).unwrap();
        let (code, v) = post(server, &body);
        match f.rule {
            Rule::Honoured | Rule::NoEffect => assert_eq!(code, 200, "{body}: {v}"),
            Rule::OnlyAt(_) | Rule::Refused => {
                assert_eq!(
                    (code, &v["error"]["param"]),
                    (400, &json!(f.name)),
                    "{body}: {v}"
                );
            }
        }
        if let Rule::OnlyAt(at) = f.rule {
            body[f.name] = serde_json::from_str(at).unwrap();
            assert_eq!(post(server, &body).0, 200, "{body}");
        }
        checked += 1;
    }
    checked
}

/// MiniLM's embeddings through curl and the openai client match the reference's of the same
/// token ids; refusals name their field.
#[test]
fn minilm_embeddings_match_the_reference() {
    let dir = common::minilm_dir();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let weights = ckpt.weights(false).unwrap();
    assert!(weights.config.pooling.mode == PoolMode::Mean && weights.config.pooling.normalize);
    let tok = ckpt.tokenizer().unwrap();
    let texts = [
        "A man is eating food.",
        "The market fell sharply today.",
        "Hi",
    ];
    let mut inputs: Vec<EncoderInput> = texts
        .iter()
        .map(|t| tok.encode_for_encoder(t).unwrap())
        .collect();
    // Token ids as given (no [CLS]/[SEP] added): 'man eating'.
    inputs.push(EncoderInput::new(vec![2158, 5983]));
    let want = CpuReference::new(&weights).encode(&inputs).unwrap();
    let server = serve(&dir);
    let input = json!([texts[0], texts[1], texts[2], [2158, 5983]]);
    let (code, v) = post(&server, &json!({"model": "m", "input": input}));
    assert_eq!(code, 200, "{v}");
    close(&vectors(&v), &want, 1e-5, "curl");
    let tokens: usize = inputs.iter().map(|i| i.ids.len()).sum();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": tokens, "total_tokens": tokens})
    );
    assert_eq!((&v["object"], &v["model"]), (&json!("list"), &json!("m")));
    // One string, one list of ids.
    let (_, one) = post(&server, &json!({"input": texts[2]}));
    close(&vectors(&one), &want[2..3], 1e-5, "one string");
    let (_, ids) = post(&server, &json!({"input": [2158, 5983]}));
    close(&vectors(&ids), &want[3..4], 1e-5, "token ids");
    // The openai client: floats, and its default (base64, decoded by the client).
    let port = server.port.to_string();
    for encoding in ["float", "default"] {
        let got = common::python_json(
            "tests/serve_tools/client.py",
            &["embed", &port, &input.to_string(), encoding],
        );
        let rows: Vec<Vec<f32>> = serde_json::from_value(got["data"].clone()).unwrap();
        close(&rows, &want, 1e-5, encoding);
        assert_eq!(got["usage"], json!([tokens, tokens]));
        assert_eq!(got["index"], json!([0, 1, 2, 3]));
    }
    let (code, b64) = post(
        &server,
        &json!({"input": texts[2], "encoding_format": "base64"}),
    );
    assert_eq!(code, 200);
    // 384 little-endian f32: 1536 bytes, 2048 base64 characters.
    assert_eq!(b64["data"][0]["embedding"].as_str().unwrap().len(), 2048);
    refusals(&server);
    assert!(walk_the_table(&server) >= 12);
}

/// Bad input, another model, a width other than the model's, and generation on an encoder.
fn refusals(server: &Server) {
    for (body, param) in [
        (json!({"input": []}), "input"),
        (json!({"input": [[]]}), "input"),
        (json!({"input": [3, 99999]}), "input"),
        (json!({"input": 5}), "input"),
        (json!({"input": vec![101; 600]}), "input"),
        (json!({"input": "x", "dimensions": 128}), "dimensions"),
        (
            json!({"input": "x", "encoding_format": "bytes"}),
            "encoding_format",
        ),
        (json!({"input": "x", "prompt": "y"}), "prompt"),
    ] {
        let (code, v) = post(server, &body);
        assert_eq!(
            (code, &v["error"]["param"]),
            (400, &json!(param)),
            "{body}: {v}"
        );
    }
    let (code, v) = post(server, &json!({"model": "x", "input": "y"}));
    assert_eq!((code, &v["error"]["param"]), (404, &json!("model")), "{v}");
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = json!({"messages": [{"role": "user", "content": "x"}], "prompt": "x"});
        let (code, text) = server.post(path, &body.to_string());
        assert_eq!(code, 400, "{text}");
        assert!(text.contains("is an encoder"), "{text}");
    }
}

/// Generation's options that do not apply to an encoder are refused by name (exit 2),
/// before any device opens: every option of `serve` an encoder's server has no use for.
fn refused_options(dir: &Path) {
    let template = dir.join("t.jinja");
    std::fs::write(&template, "{{ messages }}").unwrap();
    let template = template.to_str().unwrap();
    for (extra, name) in [
        (vec!["--virtual", "2"], "more than one device"),
        (vec!["--strategy", "tp"], "--strategy"),
        (vec!["--chat-template", template], "--chat-template"),
        (
            vec!["--inject-fault", "engine,kind=panic,at=step:0"],
            "--inject-fault",
        ),
        (vec!["--gpu-memory", "1G"], "--gpu-memory"),
        (vec!["--max-prefill-tokens", "512"], "--max-prefill-tokens"),
        (vec!["--no-prefix-cache"], "--no-prefix-cache"),
        (vec!["--seed", "7"], "--seed"),
        // The default value, given: still refused, not taken for absent.
        (vec!["--seed", "42"], "--seed"),
        (vec!["--seed=42"], "--seed"),
        (vec!["--pace", "10:1"], "--pace"),
        (vec!["--tp", "2"], "--tp"),
        (vec!["--split", "3,1"], "--split"),
        (vec!["--layers", "1,1"], "--layers"),
        (vec!["--partition", "even"], "--partition"),
        (vec!["--micro-batches", "2"], "--micro-batches"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_wgpar"))
            .args(["serve", "--port", "0", "--model"])
            .arg(dir)
            .args(&extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(
            err.contains(name) && err.contains("does not apply"),
            "{err}"
        );
        assert!(
            !err.contains("ready:"),
            "refused before the encoder opens: {err}"
        );
    }
}

/// A synthetic BERT folder with CLS pooling and no Normalize module: its vectors are the
/// reference's CLS vectors, unnormalised.
#[test]
fn cls_pooling_without_normalize_follows_the_folder() {
    let pooling = Pooling {
        mode: PoolMode::Cls,
        normalize: false,
    };
    let config = ModelConfig {
        pooling,
        ..ModelConfig::preset("tiny-bert").unwrap()
    };
    let weights = ModelWeights::synthetic(&config, 41);
    let dir = hf_support::scratch("serve-embed-cls");
    std::fs::write(
        dir.join("config.json"),
        hf_support::config_json(&weights).to_string(),
    )
    .unwrap();
    let tensors = hf_support::bert_tensors(&weights, "");
    hf_support::write_safetensors(
        &dir.join("model.safetensors"),
        &tensors,
        hf_support::Store::F32,
    );
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        r#"{"pooling_mode_mean_tokens": false, "pooling_mode_cls_token": true}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("modules.json"),
        r#"[{"type":"sentence_transformers.models.Transformer","path":""},
            {"type":"sentence_transformers.models.Pooling","path":"1_Pooling"}]"#,
    )
    .unwrap();
    hf_support::write_word_tokenizer(&dir, config.vocab);
    assert_eq!(Checkpoint::open(&dir).unwrap().config().pooling, pooling);
    let ids = common::prompts(3, 9, config.vocab, 5);
    let inputs: Vec<EncoderInput> = ids.iter().map(|p| EncoderInput::new(p.clone())).collect();
    let want = CpuReference::new(&weights).encode(&inputs).unwrap();
    let norm = |v: &[f64]| v.iter().map(|x| x.powi(2)).sum::<f64>().sqrt();
    assert!(
        want.iter().all(|w| (norm(w) - 1.0).abs() > 1e-2),
        "the reference is unnormalised"
    );
    refused_options(&dir);
    let server = serve(&dir);
    let (code, v) = post(&server, &json!({"input": ids}));
    assert_eq!(code, 200, "{v}");
    close(&vectors(&v), &want, 1e-5, "cls");
    // Text goes through the folder's tokenizer: `t5 t6` is ids 5 and 6.
    let (_, text) = post(&server, &json!({"input": "t5 t6"}));
    let want = CpuReference::new(&weights)
        .encode(&[EncoderInput::new(vec![5, 6])])
        .unwrap();
    close(&vectors(&text), &want, 1e-5, "text");
}
