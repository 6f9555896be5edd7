//! Structured output (issue 35): `response_format` `json_object` and `json_schema` hold the
//! answer to its schema while decoding (llguidance's token mask per step). The `openai` client
//! sends the requests several at a time and Python's `jsonschema` validates every answer:
//! SmolLM2 answering questions, and a random model with a byte vocabulary, whose unmasked
//! output is not JSON at all, on every strategy. Bad schemas and other types are 400s naming
//! `response_format`.

mod common;
mod gguf_support;
mod hf_support;
mod serve_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use serve_support::Server;
use wgpar::model::ModelConfig;

fn serve(model: &Path, extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args([
        "serve",
        "--port",
        "0",
        "--served-model-name",
        "m",
        "--model",
    ])
    .arg(model)
    .args(extra);
    Server::spawn(cmd, Duration::from_secs(300))
}

fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    let (code, text) = server.post(path, &body.to_string());
    let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{body}: {code} {text}"));
    (code, v)
}

/// The client's answers to the `cases` set, all at once; asserts each finished on its own
/// (not at `max_tokens`) with text that validates against its schema, and returns them.
fn answers(server: &Server, cases: &str, max_tokens: usize) -> Vec<Value> {
    let port = server.port.to_string();
    let got = common::python_json(
        "tests/serve_structured/client.py",
        &[&port, cases, &max_tokens.to_string()],
    );
    let list = got.as_array().unwrap().clone();
    assert!(list.len() >= 4, "{got}");
    for a in &list {
        assert_eq!(a["finish"], "stop", "ran out of tokens: {a}");
        assert_eq!(a["valid"], true, "not valid against its schema: {a}");
    }
    list
}

/// A tiny Llama of random weights with a byte-level vocabulary and a chat template, as a
/// GGUF file.
fn byte_model(dir: &Path) -> PathBuf {
    let template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}\
                    {% if add_generation_prompt %}<a>{% endif %}";
    let context = ModelConfig::preset("tiny-llama").unwrap().max_seq;
    gguf_support::byte_llama(dir, template, context)
}

/// The random model's own greedy text for `prompt` (no format): not a JSON object, so what
/// the masked requests return is the mask's doing.
fn unmasked_is_not_json(server: &Server, prompt: &str) {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0,
        "ignore_eos": true});
    let (code, v) = post(server, "/v1/completions", &body);
    assert_eq!(code, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty(), "{v}");
    let parsed = serde_json::from_str::<Value>(text.trim());
    assert!(
        !parsed.as_ref().is_ok_and(Value::is_object),
        "the random model wrote a JSON object unaided: {text:?}"
    );
}

/// vLLM's `guided_choice`, `guided_regex` and `guided_json` hold the text to a choice, a
/// regular expression and a schema, greedy and sampled.
fn guided(server: &Server) {
    let text = |extra: Value| {
        let mut body = json!({"model": "m", "prompt": "abc", "max_tokens": 40});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (code, v) = post(server, "/v1/completions", &body);
        assert_eq!(code, 200, "{body}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{body}: {v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let options = ["red (1)", "green|x", "blue.*"];
    for t in [json!(0), json!(1.0)] {
        let got = text(json!({"guided_choice": options, "temperature": t, "seed": 3}));
        assert!(options.contains(&got.as_str()), "{got:?}");
        let got = text(json!({"guided_regex": "[0-9]{3}-[a-z]{2}", "temperature": t, "seed": 4}));
        let b = got.as_bytes();
        let fits = b.len() == 6
            && b[..3].iter().all(u8::is_ascii_digit)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_lowercase);
        assert!(fits, "{got:?}");
    }
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3,
        "maximum": 7}}, "required": ["n"], "additionalProperties": false});
    for g in [schema.clone(), json!(schema.to_string())] {
        let got = text(json!({"guided_json": g, "temperature": 0}));
        let v: Value = serde_json::from_str(&got).unwrap_or_else(|e| panic!("{got}: {e}"));
        let n = v["n"].as_i64().unwrap();
        assert!(
            (3..=7).contains(&n) && v.as_object().unwrap().len() == 1,
            "{v}"
        );
    }
}

/// A greedy structured request is masked in the device's pick; with `logprobs` the same
/// request reads its logits back and is masked on the host: the same text either way.
fn device_and_host_masks_agree(server: &Server) {
    let schema = json!({"type": "object", "properties": {
        "k": {"enum": ["x", "yy", "zzz"]}, "v": {"type": "integer", "minimum": 0, "maximum": 9999},
        "s": {"type": "string", "maxLength": 6}}, "required": ["k", "v", "s"],
        "additionalProperties": false});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "o", "schema": schema}});
    let mut texts = Vec::new();
    for logprobs in [None, Some(0)] {
        let body = json!({"model": "m", "prompt": "q r", "max_tokens": 60, "temperature": 0,
            "response_format": rf, "logprobs": logprobs});
        let (code, v) = post(server, "/v1/completions", &body);
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        texts.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    assert_eq!(texts[0], texts[1]);
    // Each of `n` choices gets its own copy of the compiled grammar.
    let body = json!({"model": "m", "prompt": "q r", "max_tokens": 60, "temperature": 0,
        "response_format": rf, "n": 3});
    let (code, v) = post(server, "/v1/completions", &body);
    assert_eq!(code, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    for c in choices {
        assert_eq!(c["text"].as_str(), Some(texts[0].as_str()), "{v}");
    }
    let value: Value = serde_json::from_str(&texts[0]).unwrap();
    assert!(
        ["x", "yy", "zzz"].contains(&value["k"].as_str().unwrap()),
        "{value}"
    );
}

#[test]
fn a_random_models_masked_answers_validate_on_every_strategy() {
    let dir = hf_support::scratch("serve-structured-bytes");
    let model = byte_model(&dir);
    for extra in [
        &[][..],
        &["--strategy", "tp", "--virtual", "2"],
        &["--strategy", "pp", "--virtual", "2"],
    ] {
        let server = serve(&model, extra);
        unmasked_is_not_json(&server, "abc");
        answers(&server, "bytes", 80);
        device_and_host_masks_agree(&server);
        guided(&server);
        // Sampling (read back to the host sampler) is masked too.
        let body = json!({"model": "m", "prompt": "abc", "max_tokens": 80, "temperature": 1.0,
            "seed": 5, "top_k": 0, "response_format": {"type": "json_object"}});
        let (code, v) = post(&server, "/v1/completions", &body);
        assert_eq!(code, 200, "{v}");
        let choice = &v["choices"][0];
        if choice["finish_reason"] == "stop" {
            let text = choice["text"].as_str().unwrap();
            let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(value.is_object(), "{text}");
        } else {
            // An unbounded object may run to max_tokens; what came is still a JSON prefix.
            assert_eq!(
                choice["text"].as_str().unwrap().chars().next(),
                Some('{'),
                "{v}"
            );
        }
    }
}

#[test]
fn bad_formats_are_refused_by_name() {
    let dir = hf_support::scratch("serve-structured-refusals");
    let server = serve(&byte_model(&dir), &[]);
    for rf in [
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}),
        json!({"type": "json_schema", "json_schema": {"name": "x"}}),
        json!({"type": "regex", "regex": "a+"}),
        json!({"type": "json_object", "strict": true}),
    ] {
        let body = json!({"model": "m", "prompt": "a", "response_format": rf});
        let (code, v) = post(&server, "/v1/completions", &body);
        assert_eq!(code, 400, "{rf}: {v}");
        assert_eq!(v["error"]["param"], "response_format", "{rf}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("response_format"), "{message}");
    }
    // vLLM's guided fields: a bad value, or two grammars, name the field.
    for (extra, name) in [
        (json!({"guided_regex": "("}), "guided_regex"),
        (json!({"guided_regex": 3}), "guided_regex"),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_choice": ["a", 1]}), "guided_choice"),
        (json!({"guided_json": "not json"}), "guided_json"),
        (
            json!({"guided_json": {"type": "frobnicate"}}),
            "guided_json",
        ),
        (
            json!({"guided_json": {}, "response_format": {"type": "json_object"}}),
            "guided_json",
        ),
        (
            json!({"guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
        ),
        (
            json!({"guided_choice": ["a"], "min_tokens": 2}),
            "min_tokens",
        ),
    ] {
        let mut body = json!({"model": "m", "prompt": "a"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (code, v) = post(&server, "/v1/completions", &body);
        assert_eq!(code, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], name, "{body}: {v}");
    }
    // A word-level tokenizer has no bytes to write JSON with: refused, not garbled.
    let (ckpt, _) = hf_support::chat_checkpoint("serve-structured-words");
    let words = serve(&ckpt, &[]);
    let body = json!({"model": "m", "prompt": "t1", "response_format": {"type": "json_object"}});
    let (code, v) = post(&words, "/v1/completions", &body);
    assert_eq!(
        (code, &v["error"]["param"]),
        (400, &json!("response_format")),
        "{v}"
    );
}

#[test]
fn smollm2_answers_validate_against_their_schemas() {
    let file = common::smollm2_gguf();
    let server = serve(&file, &["--max-seq", "256"]);
    let got = answers(&server, "smol", 120);
    let cases: Vec<&str> = got.iter().map(|a| a["case"].as_str().unwrap()).collect();
    for want in ["city", "color", "fruits", "weather", "object"] {
        assert!(cases.contains(&want), "{cases:?}");
    }
}
