//! `wgpar serve`'s OpenAI API as clients use it (issue 35): every field of the table is
//! honoured or refused by name; bias, penalties, min-p, stop ids and `n` against a CPU
//! replay of the same rules on the f64 reference's logits; log-probs (with `echo`, after
//! temperature, streamed) against the reference's log-softmax; /tokenize, /detokenize,
//! the model name, prompt lists; a GGUF's own chat template and `--chat-template`. Clients:
//! curl and the `openai` package.

mod common;
mod gguf_support;
mod hf_support;
mod serve_support;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use gguf_support::{gguf_tensors, model_meta, write_gguf, GgufSpec};
use serde_json::{json, Value};
use serve_support::Server;
use wgpar::model::quant::QuantType;
use wgpar::model::reference::CpuReference;
use wgpar::model::sampling::{Sampler, SamplingParams};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::server::api::fields::{Route, Rule, FIELDS};

fn serve(model: &str, extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(["serve", "--port", "0", "--model", model])
        .args(extra);
    Server::spawn(cmd, Duration::from_secs(300))
}

fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    let (code, text) = server.post(path, &body.to_string());
    let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{body}: {code} {text}"));
    (code, v)
}

fn ok(server: &Server, path: &str, body: &Value) -> Value {
    let (code, v) = post(server, path, body);
    assert_eq!(code, 200, "{body}: {v}");
    v
}

/// Token ids of a word-level text (`t5 t17` is [5, 17]).
fn ids(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| w.strip_prefix('t').unwrap().parse().unwrap())
        .collect()
}

/// The f64 reference's last-position logits after `seq`.
fn reference(w: &ModelWeights, seq: &[u32]) -> Vec<f32> {
    CpuReference::new(w).prefill(&[seq.to_vec()]).unwrap()[0].clone()
}

/// Log-softmax of `logits / t`, in f64 (written here, apart from the server's).
fn log_softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let x: Vec<f64> = logits.iter().map(|&v| v as f64 / t).collect();
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z = x.iter().map(|v| (v - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|v| v - z).collect()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// OpenAI's and vLLM's rules on one row: bias, repetition over prompt and output, then
/// presence and frequency over the output.
struct Rules {
    bias: HashMap<u32, f32>,
    repetition: f32,
    presence: f32,
    frequency: f32,
}

impl Rules {
    fn apply(&self, logits: &[f32], prompt: &[u32], out: &[u32]) -> Vec<f32> {
        let mut x = logits.to_vec();
        for (&t, &b) in &self.bias {
            x[t as usize] += b;
        }
        let seen: HashSet<u32> = prompt.iter().chain(out).copied().collect();
        for t in seen {
            let v = &mut x[t as usize];
            *v = if *v > 0.0 {
                *v / self.repetition
            } else {
                *v * self.repetition
            };
        }
        let mut counts: HashMap<u32, f32> = HashMap::new();
        for &t in out {
            *counts.entry(t).or_default() += 1.0;
        }
        for (t, c) in counts {
            x[t as usize] -= self.frequency * c + self.presence;
        }
        x
    }
}

fn python(args: &[&str]) -> Value {
    common::python_json("tests/serve_api/client.py", args)
}

/// Unknown fields, another route's, a bad value of an honoured one: 400s naming them.
fn others_refused_by_name(server: &Server) {
    for (path, body, param) in [
        (
            "/v1/completions",
            json!({"prompt": "t1", "frobnicate": 1}),
            "frobnicate",
        ),
        (
            "/v1/completions",
            json!({"prompt": "t1", "messages": []}),
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "t1"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "t1", "logit_bias": {"99999": 1}}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "t1", "max_tokens": 0}),
            "max_tokens",
        ),
    ] {
        let (code, v) = post(server, path, &body);
        assert_eq!(
            (code, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{body}: {v}"
        );
    }
}

/// Each field of the table: an honoured or no-effect one gets a 200 at its example, a
/// refused one a 400 naming it, one accepted only at a value a 200 there and a 400 elsewhere;
/// unknown fields, another route's field and another model are refused by name.
#[test]
fn every_field_of_the_table_is_honoured_or_refused_by_name() {
    let (dir, _) = hf_support::chat_checkpoint("serve-api-fields");
    let server = serve(dir.to_str().unwrap(), &["--served-model-name", "m"]);
    let base = |route: Route| match route {
        Route::Chat => (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": "t1"}], "max_tokens": 1}),
        ),
        _ => (
            "/v1/completions",
            json!({"model": "m", "prompt": "t1 t2", "max_tokens": 1}),
        ),
    };
    let mut checked = 0;
    for f in FIELDS {
        let routes = match f.route {
            Route::Both => vec![Route::Completions, Route::Chat],
            // tests/serve_embeddings.rs walks these, on an encoder.
            Route::Embeddings => continue,
            r => vec![r],
        };
        for route in routes {
            let (path, mut body) = base(route);
            if f.name == "top_logprobs" {
                body["logprobs"] = json!(true);
            }
            body[f.name] = serde_json::from_str(f.example).unwrap();
            let (code, v) = post(&server, path, &body);
            match f.rule {
                Rule::Honoured | Rule::NoEffect => assert_eq!(code, 200, "{body}: {v}"),
                Rule::OnlyAt(_) | Rule::Refused => {
                    assert_eq!(code, 400, "{body}: {v}");
                    assert_eq!(v["error"]["param"], f.name, "{body}: {v}");
                    assert!(v["error"]["message"].as_str().unwrap().contains(f.name));
                }
            }
            if let Rule::OnlyAt(at) = f.rule {
                body[f.name] = serde_json::from_str(at).unwrap();
                let (code, v) = post(&server, path, &body);
                assert_eq!(code, 200, "{body}: {v}");
            }
            checked += 1;
        }
    }
    assert!(checked > 150, "{checked}");
    others_refused_by_name(&server);
    // The openai client reports the refusal's field too.
    let got = python(&[&server.port.to_string(), "refused", "mirostat", "2"]);
    assert_eq!(got, json!({"status": 400, "param": "mirostat"}));
    let (code, v) = post(
        &server,
        "/v1/completions",
        &json!({"model": "x", "prompt": "t1"}),
    );
    assert_eq!((code, &v["error"]["param"]), (404, &json!("model")), "{v}");
}

/// `n` seeded choices: choice i is the request with seed + i.
fn n_choices_follow_their_seeds(server: &Server, mut sampled: Value, gen: usize) {
    let text = |body: Value| -> Vec<u32> {
        let v = ok(server, "/v1/completions", &body);
        ids(v["choices"][0]["text"].as_str().unwrap())
    };
    sampled["n"] = json!(3);
    let v = ok(server, "/v1/completions", &sampled);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let mut one = sampled.clone();
        one["n"] = json!(1);
        one["seed"] = json!(sampled["seed"].as_u64().unwrap() + i as u64);
        assert_eq!(ids(c["text"].as_str().unwrap()), text(one), "choice {i}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 3 * gen, "{v}");
}

/// Greedy with a bias that bans the plain pick, repetition, presence and frequency
/// penalties: each token is the argmax of the reference's logits under the same rules; a
/// seeded draw with min-p matches the sampler over the same processed logits; stop ids stop;
/// `n` seeded choices are the single requests of seed + i.
#[test]
fn sampling_rules_follow_the_reference() {
    let (dir, w) = hf_support::chat_checkpoint("serve-api-rules");
    let server = serve(dir.to_str().unwrap(), &["--served-model-name", "m"]);
    let prompt: Vec<u32> = vec![5, 17, 300, 42, 7, 17];
    let gen = 6;
    let text = |body: Value| -> Vec<u32> {
        let v = ok(&server, "/v1/completions", &body);
        ids(v["choices"][0]["text"].as_str().unwrap())
    };
    let plain =
        text(json!({"prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": true}));
    assert_eq!(plain.len(), gen);
    let banned = plain[0];
    let favoured = plain.iter().copied().find(|&t| t != banned).unwrap_or(3);
    let rules = Rules {
        bias: HashMap::from([(banned, -100.0), (favoured, 1.5)]),
        repetition: 1.5,
        presence: 0.7,
        frequency: 0.4,
    };
    let body = json!({"prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": true,
        "logit_bias": {banned.to_string(): -100, favoured.to_string(): 1.5},
        "repetition_penalty": 1.5, "presence_penalty": 0.7, "frequency_penalty": 0.4});
    let got = text(body.clone());
    let mut out = Vec::new();
    for _ in 0..gen {
        let seq = [&prompt[..], &out[..]].concat();
        out.push(argmax(&rules.apply(&reference(&w, &seq), &prompt, &out)));
    }
    assert_eq!(got, out, "plain {plain:?}");
    assert_ne!(got, plain, "the rules changed nothing");
    assert!(!got.contains(&banned));
    // A seeded draw after the rules, with min-p.
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 0,
        top_p: 1.0,
        seed: 77,
    };
    let mut sampler = Sampler::new(params).unwrap();
    let mut want = Vec::new();
    for _ in 0..gen {
        let seq = [&prompt[..], &want[..]].concat();
        let x = rules.apply(&reference(&w, &seq), &prompt, &want);
        want.push(sampler.sample_min_p(&x, 0.2));
    }
    let mut sampled = body.clone();
    sampled["temperature"] = json!(0.9);
    sampled["seed"] = json!(77);
    sampled["min_p"] = json!(0.2);
    assert_eq!(text(sampled.clone()), want);
    n_choices_follow_their_seeds(&server, sampled, gen);
    // Stop token ids end the text (the token not shown); the allow-list holds.
    let stop = plain[2];
    let v = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": gen,
        "temperature": 0, "ignore_eos": true, "stop_token_ids": [stop]}),
    );
    let cut = plain.iter().position(|&t| t == stop).unwrap();
    assert_eq!(ids(v["choices"][0]["text"].as_str().unwrap()), plain[..cut]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // min_tokens: the stop id cannot be picked before 2 tokens, then it stops.
    let v = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": gen,
        "temperature": 0, "ignore_eos": true, "stop_token_ids": [plain[0]], "min_tokens": 2}),
    );
    let mut want = Vec::new();
    while want.len() < gen {
        let seq = [&prompt[..], &want[..]].concat();
        let mut x = reference(&w, &seq);
        if want.len() < 2 {
            x[plain[0] as usize] = f32::NEG_INFINITY;
        }
        match argmax(&x) {
            t if t == plain[0] => break,
            t => want.push(t),
        }
    }
    assert_eq!(ids(v["choices"][0]["text"].as_str().unwrap()), want, "{v}");
    assert!(want.len() >= 2 && want[0] != plain[0]);
    // include_stop_str_in_output keeps the stop string.
    let stop = format!("t{}", plain[3]);
    let cut = |include: bool| {
        let v = ok(
            &server,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": gen,
            "temperature": 0, "ignore_eos": true, "stop": stop,
            "include_stop_str_in_output": include}),
        );
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    assert_eq!(cut(true), format!("{}{stop}", cut(false)));
    let allowed = [9u32, 10, 11];
    let got = text(
        json!({"prompt": prompt, "max_tokens": gen, "temperature": 1.0, "seed": 3,
        "ignore_eos": true, "allowed_token_ids": allowed}),
    );
    assert_eq!(got.len(), gen);
    assert!(got.iter().all(|t| allowed.contains(t)), "{got:?}");
}

/// Asserts `got` (log-prob, and top entries as token text -> log-prob) against the
/// reference's log-softmax `lp` for `token`.
fn check_entry(lp: &[f64], token: u32, got: f64, top: &[(u32, f64)], k: usize, at: &str) {
    assert!(
        (got - lp[token as usize]).abs() < 2e-3,
        "{at}: {got} vs {}",
        lp[token as usize]
    );
    let mut want: Vec<f64> = lp.to_vec();
    want.sort_by(|a, b| b.total_cmp(a));
    assert_eq!(top.len(), k, "{at}");
    for (i, &(t, l)) in top.iter().enumerate() {
        assert!((l - lp[t as usize]).abs() < 2e-3, "{at}: top {t}");
        assert!(
            (l - want[i]).abs() < 2e-3,
            "{at}: top {i} is {l}, want {}",
            want[i]
        );
    }
}

/// Completions' top log-probs object as (id, log-prob).
fn top_of(v: &Value) -> Vec<(u32, f64)> {
    let mut top: Vec<(u32, f64)> = v
        .as_object()
        .unwrap()
        .iter()
        .map(|(t, l)| (ids(t)[0], l.as_f64().unwrap()))
        .collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    top
}

/// `logprobs` with `echo` (the prompt's own log-probs, lm-eval style), after temperature,
/// with `max_tokens` 0, in chat through the openai client, and streamed: each against the
/// reference's log-softmax.
#[test]
fn logprobs_follow_the_reference_log_softmax() {
    let (dir, w) = hf_support::chat_checkpoint("serve-api-logprobs");
    let server = serve(dir.to_str().unwrap(), &["--served-model-name", "m"]);
    let prompt: Vec<u32> = vec![8, 31, 200, 9, 64];
    for (temperature, gen) in [(0.0, 3usize), (0.7, 3), (0.0, 0)] {
        let mut body = json!({"prompt": prompt, "max_tokens": gen, "echo": true, "logprobs": 4,
            "temperature": temperature, "ignore_eos": true});
        if temperature > 0.0 {
            body["seed"] = json!(5);
        }
        let v = ok(&server, "/v1/completions", &body);
        let c = &v["choices"][0];
        let lp = &c["logprobs"];
        let tokens: Vec<u32> = lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| ids(t.as_str().unwrap())[0])
            .collect();
        assert_eq!(tokens.len(), prompt.len() + gen, "{v}");
        assert_eq!(tokens[..prompt.len()], prompt[..]);
        assert!(
            lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
            "{v}"
        );
        assert_eq!(
            ids(c["text"].as_str().unwrap()),
            tokens,
            "echo puts the prompt first"
        );
        assert_eq!(v["usage"]["completion_tokens"], gen);
        let t = if temperature > 0.0 { temperature } else { 1.0 };
        for i in 1..tokens.len() {
            let reference = log_softmax(&reference(&w, &tokens[..i]), t);
            let got = lp["token_logprobs"][i].as_f64().unwrap();
            let at = format!("T {temperature} token {i}");
            check_entry(
                &reference,
                tokens[i],
                got,
                &top_of(&lp["top_logprobs"][i]),
                4,
                &at,
            );
        }
    }
    // Chat through the openai client: the template's prompt is t2 t4 t7 t8 t5.
    let port = server.port.to_string();
    let chat = python(&[&port, "chat_logprobs", "t7 t8", "3"]);
    let entries = chat["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 4, "{chat}");
    let mut seq = vec![2u32, 4, 7, 8, 5];
    for (i, e) in entries.iter().enumerate() {
        let token = ids(e["token"].as_str().unwrap())[0];
        let top: Vec<(u32, f64)> = e["top"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (ids(p[0].as_str().unwrap())[0], p[1].as_f64().unwrap()))
            .collect();
        let reference = log_softmax(&reference(&w, &seq), 1.0);
        check_entry(
            &reference,
            token,
            e["logprob"].as_f64().unwrap(),
            &top,
            3,
            &format!("chat {i}"),
        );
        seq.push(token);
    }
    // Streamed log-probs are the whole response's, chunk by chunk. The second request reuses
    // the first's cached prompt (prefilling only its last token), so its figures may differ
    // from the first's in the last bits of an f32.
    let s = python(&[&port, "stream_logprobs", "t3 t99 t250", "2"]);
    for key in ["text", "tokens"] {
        assert_eq!(s["stream"][key], s["whole"][key], "{s}");
    }
    assert_eq!(s["whole"]["tokens"].as_array().unwrap().len(), 5, "{s}");
    let close = |a: &Value, b: &Value| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-5;
    let (stream, whole) = (&s["stream"]["logprobs"], &s["whole"]["logprobs"]);
    let pairs = stream
        .as_array()
        .unwrap()
        .iter()
        .zip(whole.as_array().unwrap());
    assert_eq!(pairs.clone().filter(|(a, b)| close(a, b)).count(), 5, "{s}");
    for (a, b) in
        (s["stream"]["top"].as_array().unwrap().iter()).zip(s["whole"]["top"].as_array().unwrap())
    {
        let (a, b) = (a.as_object().unwrap(), b.as_object().unwrap());
        assert_eq!(a.len(), b.len(), "{s}");
        assert!(
            a.iter().all(|(k, v)| b.get(k).is_some_and(|w| close(v, w))),
            "{s}"
        );
    }
}

/// A streamed request's text per choice index, and its usage chunk.
fn streamed_texts(server: &Server, body: &Value, choices: usize) -> (Vec<String>, Value) {
    let (code, sse) = server.post("/v1/completions", &body.to_string());
    assert_eq!(code, 200, "{sse}");
    let mut streamed = vec![String::new(); choices];
    let mut usage = Value::Null;
    for line in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(line).unwrap();
        for c in chunk["choices"].as_array().unwrap() {
            streamed[c["index"].as_u64().unwrap() as usize] += c["text"].as_str().unwrap();
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    (streamed, usage)
}

/// /tokenize and /detokenize in llama-server's shapes, /v1/models under
/// --served-model-name, and prompt lists (one choice each, `n` per prompt).
#[test]
fn tokenize_models_and_prompt_lists() {
    let (dir, _) = hf_support::chat_checkpoint("serve-api-routes");
    let server = serve(dir.to_str().unwrap(), &["--served-model-name", "my-model"]);
    let v = ok(&server, "/tokenize", &json!({"content": "t5 t6 t300"}));
    assert_eq!(v, json!({"tokens": [5, 6, 300]}));
    let v = ok(
        &server,
        "/tokenize",
        &json!({"content": "t5 t6", "with_pieces": true}),
    );
    assert_eq!(
        v,
        json!({"tokens": [{"id": 5, "piece": "t5"}, {"id": 6, "piece": "t6"}]})
    );
    let v = ok(&server, "/detokenize", &json!({"tokens": [5, 6, 300]}));
    assert_eq!(v, json!({"content": "t5 t6 t300"}));
    let (code, v) = post(&server, "/tokenize", &json!({"content": "t5", "frob": 1}));
    assert_eq!((code, &v["error"]["param"]), (400, &json!("frob")));
    let (code, v) = post(&server, "/detokenize", &json!({"tokens": [999999]}));
    assert_eq!((code, &v["error"]["param"]), (400, &json!("tokens")));
    let (_, models) = server.get("/v1/models");
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "my-model");
    let (code, _) = post(
        &server,
        "/v1/completions",
        &json!({"model": "m", "prompt": "t1"}),
    );
    assert_eq!(code, 404);
    let one = |prompt: Value| {
        let v = ok(
            &server,
            "/v1/completions",
            &json!({"model": "my-model", "prompt": prompt,
            "max_tokens": 4, "temperature": 0, "ignore_eos": true}),
        );
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let (a, b) = (one(json!("t5 t6")), one(json!([7, 8, 9])));
    let v = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": ["t5 t6", [7, 8, 9]], "n": 2,
        "max_tokens": 4, "temperature": 0, "ignore_eos": true}),
    );
    let texts: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, [a.as_str(), &a, &b, &b], "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 16);
    // Streamed: each choice's chunks carry its index and add up to its text; echo first.
    let body = json!({"prompt": ["t5 t6", [7, 8, 9]], "n": 2, "max_tokens": 4, "temperature": 0,
        "ignore_eos": true, "stream": true, "echo": true,
        "stream_options": {"include_usage": true}});
    let (streamed, usage) = streamed_texts(&server, &body, 4);
    let echoed = [
        format!("t5 t6{a}"),
        format!("t5 t6{a}"),
        format!("t7 t8 t9{b}"),
        format!("t7 t8 t9{b}"),
    ];
    assert_eq!(streamed, echoed);
    assert_eq!(usage["completion_tokens"], 16);
}

/// Two GGUF files of one tiny Llama with a byte-level vocabulary: without a chat template,
/// and with one that writes the BOS token's text.
fn chat_gguf(dir: &Path) -> (PathBuf, PathBuf) {
    let config = ModelConfig {
        vocab: 257,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let w = ModelWeights::synthetic(&config, 50);
    let template = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\
                    {% endfor %}{% if add_generation_prompt %}<a>{% endif %}";
    let types = [vec![1; 256], vec![3]].concat();
    let mut meta = model_meta(&w, "llama");
    meta.extend([
        json!(["tokenizer.ggml.model", "str", "gpt2"]),
        json!([
            "tokenizer.ggml.tokens",
            "str_array",
            gguf_support::byte_tokens()
        ]),
        json!(["tokenizer.ggml.merges", "str_array", Vec::<String>::new()]),
        json!(["tokenizer.ggml.add_bos_token", "bool", false]),
        json!(["tokenizer.ggml.bos_token_id", "u32", 256]),
        // The end token is a control token: the tokenizer matches its text whole.
        json!(["tokenizer.ggml.token_type", "i32_array", types]),
    ]);
    let tensors = gguf_tensors(&w, true);
    let spec = |meta: Vec<Value>| GgufSpec {
        arch: "llama",
        matrices: QuantType::F32,
        meta,
    };
    let bare = write_gguf(dir, "bare", &tensors, &spec(meta.clone()));
    meta.push(json!(["tokenizer.chat_template", "str", template]));
    let file = write_gguf(dir, "chat", &tensors, &spec(meta));
    (bare, file)
}

/// A GGUF file's `tokenizer.chat_template` (with its BOS token's text) renders chat prompts;
/// `--chat-template FILE` overrides it; a GGUF without one refuses chat.
#[test]
fn gguf_chat_template_and_override() {
    let dir = hf_support::scratch("serve-api-gguf");
    let (bare, file) = chat_gguf(&dir);
    let messages = json!([{"role": "user", "content": "hi"}]);
    let pair = |server: &Server, rendered: &str| {
        let chat = ok(
            server,
            "/v1/chat/completions",
            &json!({"messages": messages,
            "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
        );
        let text = ok(
            server,
            "/v1/completions",
            &json!({"prompt": rendered,
            "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
        );
        assert_eq!(chat["usage"], text["usage"], "{chat} {text}");
        assert_eq!(
            chat["choices"][0]["message"]["content"],
            text["choices"][0]["text"]
        );
    };
    let server = serve(file.to_str().unwrap(), &[]);
    let tokens = ok(
        &server,
        "/tokenize",
        &json!({"content": "<|endoftext|><user>hi<a>"}),
    );
    assert_eq!(
        tokens["tokens"][0], 256,
        "the BOS text is the special token: {tokens}"
    );
    pair(&server, "<|endoftext|><user>hi<a>");
    drop(server);
    let own = dir.join("own.jinja");
    std::fs::write(&own, "[{{ messages[0]['content'] }}]{{ bos_token }}").unwrap();
    let server = serve(
        file.to_str().unwrap(),
        &["--chat-template", own.to_str().unwrap()],
    );
    pair(&server, "[hi]<|endoftext|>");
    drop(server);
    let server = serve(bare.to_str().unwrap(), &[]);
    let (code, v) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": messages}),
    );
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no chat template"),
        "{v}"
    );
    let server = serve(
        bare.to_str().unwrap(),
        &["--chat-template", own.to_str().unwrap()],
    );
    pair(&server, "[hi]<|endoftext|>");
}
