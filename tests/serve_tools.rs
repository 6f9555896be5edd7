//! Tool calls through `wgpar serve` (issue 35, item 5), with the `openai` client's own types:
//! a tiny checkpoint the test writes, with a Hermes-style chat template given by
//! `--chat-template`, whose word vocabulary holds a tool call's pieces as tokens. Logit bias
//! with a repetition penalty makes the greedy answer spell them out in order, so the answer
//! is known: it must come back as `message.tool_calls` (and as streamed tool-call deltas)
//! with `finish_reason: "tool_calls"`. The prompt with tools, assistant `tool_calls` and
//! `tool` messages must be the one jinja2 renders, as Hugging Face sets it up. With
//! `tool_choice` `required` or a named function, a random byte-vocabulary model that writes
//! no call unaided answers with calls whose arguments `jsonschema` validates.

mod common;
mod gguf_support;
mod hf_support;
mod serve_support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use serve_support::Server;
use wgpar::model::ModelWeights;

/// Tokens the answers are made of: (id, text). A call's arguments span several tokens, so
/// that a stream sends them in pieces.
const PIECES: [(u32, &str); 11] = [
    (10, "Checking."),
    (11, "<tool_call>"),
    (12, r#"{"name": "get_weather", "arguments": {"city":"#),
    (13, r#""Paris","#),
    (14, r#""days":"#),
    (15, "3}}"),
    (16, "</tool_call>"),
    (
        17,
        r#"<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>"#,
    ),
    (18, r#"{"name": "get_weather", "parameters": {"city":"#),
    (19, r#"[TOOL_CALLS]get_weather[ARGS]{"city":"#),
    (20, "3}"),
];

/// The answers in each format: Hermes (text, then two calls), Llama 3.1 (the call is the
/// answer), Mistral's `name[ARGS]`; the first call is always get_weather(Paris, 3 days).
const HERMES: [u32; 8] = [10, 11, 12, 13, 14, 15, 16, 17];
const LLAMA: [u32; 4] = [18, 13, 14, 15];
const MISTRAL: [u32; 4] = [19, 13, 14, 20];

/// Templates that teach the Llama and Mistral formats (the markers named in a comment).
const LLAMA_TEMPLATE: &str = "{# <|python_tag|> #}{% for t in tools %}{{ t | tojson }}{% endfor %}\
{% for m in messages %}{{ m.content }}{% endfor %}";
const MISTRAL_TEMPLATE: &str = "{# [TOOL_CALLS] #}{% for t in tools %}{{ t | tojson }}{% endfor %}\
{% for m in messages %}{{ m.content }}{% endfor %}";

/// A Hermes-style template (tools listed in a system turn, calls in `<tool_call>` blocks,
/// answers in `tool_response` blocks).
const TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
Call a function with <tool_call>{"name": .., "arguments": ..}</tool_call>. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">{{ m.content }}</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}
{%- for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

/// tiny-gpt2 (context 512) with a word vocabulary (`tN` is token N, but for [`PIECES`]) and [`TEMPLATE`]
/// in a file of its own.
fn checkpoint(dir: &Path) {
    // A longer context than the preset's 96, for prompts with tool definitions.
    let config = wgpar::model::ModelConfig {
        max_seq: 512,
        ..wgpar::model::ModelConfig::preset("tiny-gpt2").unwrap()
    };
    let weights = ModelWeights::synthetic(&config, 21);
    hf_support::write_checkpoint_to(dir, &weights, hf_support::Store::F32);
    let mut words: serde_json::Map<String, Value> = (0..config.vocab as u32)
        .map(|i| (format!("t{i}"), json!(i)))
        .collect();
    for (id, text) in PIECES {
        words.remove(&format!("t{id}"));
        words.insert(text.to_string(), json!(id));
    }
    let tok = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": words, "unk_token": "t1"}});
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let config = json!({"bos_token": "", "eos_token": "t0"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("tools.jinja"), TEMPLATE).unwrap();
    std::fs::write(dir.join("llama.jinja"), LLAMA_TEMPLATE).unwrap();
    std::fs::write(dir.join("mistral.jinja"), MISTRAL_TEMPLATE).unwrap();
}

/// The text of piece `id`.
fn piece(id: u32) -> &'static str {
    PIECES.iter().find(|p| p.0 == id).unwrap().1
}

/// The calls' names and arguments as the text they came as.
fn raw(answer: &Value) -> Vec<Value> {
    let calls = answer["calls"].as_array().unwrap();
    calls.iter().map(|c| json!([c["name"], c["raw"]])).collect()
}

fn python(args: &[&str]) -> Value {
    common::python_json("tests/serve_tools/client.py", args)
}

/// Keys sorted at every level, as the template's `tojson` writes them.
fn tools() -> Value {
    json!([
        {"function": {"description": "Weather now", "name": "get_weather", "parameters":
            {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}},
         "type": "function"},
        {"function": {"name": "get_time", "parameters":
            {"properties": {"zone": {"type": "string"}}, "type": "object"}}, "type": "function"},
    ])
}

/// A greedy chat request whose answer is the first `n` of [`HERMES`].
fn scripted(n: usize, extra: Value) -> Value {
    script(&HERMES, n, extra)
}

/// A greedy chat request whose answer is the first `n` tokens of `ids`: each one's bias is
/// above the next one's, and the repetition penalty (dividing a picked token's logit by 10)
/// drops a picked one below every one not yet picked.
fn script(ids: &[u32], n: usize, extra: Value) -> Value {
    let bias: serde_json::Map<String, Value> = (ids.iter().enumerate())
        .map(|(k, id)| (id.to_string(), json!(100 - 10 * k as i64)))
        .collect();
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools(), "max_tokens": n, "temperature": 0, "logit_bias": bias,
        "repetition_penalty": 10, "allowed_token_ids": ids});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn weather() -> Value {
    json!({"name": "get_weather", "arguments": {"city": "Paris", "days": 3}})
}

fn time() -> Value {
    json!({"name": "get_time", "arguments": {"zone": "CET"}})
}

/// The calls' names and arguments, with ids and types checked.
fn calls_of(answer: &Value) -> Vec<Value> {
    let calls = answer["calls"].as_array().unwrap();
    let mut ids: Vec<&str> = calls.iter().map(|c| c["id"].as_str().unwrap()).collect();
    for c in calls {
        assert_eq!(c["type"], "function", "{answer}");
        assert!(c["id"].as_str().unwrap().starts_with("call_"), "{answer}");
    }
    ids.dedup();
    assert_eq!(ids.len(), calls.len(), "ids repeat: {answer}");
    calls
        .iter()
        .map(|c| json!({"name": c["name"], "arguments": c["arguments"]}))
        .collect()
}

fn serve(dir: &Path) -> Server {
    serve_with(dir, &dir.join("tools.jinja"))
}

/// `model` served with the chat template in file `template`.
fn serve_with(model: &Path, template: &Path) -> Server {
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
    .arg("--chat-template")
    .arg(template);
    Server::spawn(cmd, Duration::from_secs(300))
}

/// Calls come back as `message.tool_calls` and as streamed deltas, with the text before them
/// as content; `tool_choice: none` leaves the same text as content; `parallel_tool_calls:
/// false` keeps the first call; `required` and a named function refuse `allowed_token_ids`
/// beside them, and a word vocabulary (no bytes to write JSON with) by `tools`; a decoder
/// refuses `/v1/embeddings`.
#[test]
fn tool_calls_come_back_through_the_openai_client() {
    let dir = hf_support::scratch("serve-tools");
    checkpoint(&dir);
    let server = serve(&dir);
    let port = server.port.to_string();
    let ask = |cmd: &str, body: Value| python(&[cmd, &port, &body.to_string()]);
    // Without parsing, the answer is the pieces in order: the script works.
    let plain = ask("call", scripted(8, json!({"tool_choice": "none"})));
    let text = plain["content"].as_str().unwrap();
    let words: Vec<&str> = HERMES.iter().map(|&id| piece(id)).collect();
    assert_eq!(text.trim(), words.join(" "), "{plain}");
    assert_eq!(
        (&plain["finish"], &plain["calls"]),
        (&json!("length"), &json!([]))
    );
    // Parsed, whole and streamed.
    let whole = ask("call", scripted(8, json!({})));
    assert_eq!(calls_of(&whole), vec![weather(), time()], "{whole}");
    assert_eq!(whole["finish"], "tool_calls");
    assert_eq!(whole["content"].as_str().unwrap().trim(), "Checking.");
    let streamed = ask("stream", scripted(8, json!({})));
    assert_eq!(calls_of(&streamed), vec![weather(), time()], "{streamed}");
    assert_eq!(streamed["finish"], "tool_calls");
    assert_eq!(streamed["content"].as_str().unwrap().trim(), "Checking.");
    // As OpenAI streams them: per call a delta with its name, then its arguments as they are
    // written (get_weather's over four tokens, get_time's in one).
    assert_eq!(streamed["tool_chunks"], 7, "{streamed}");
    assert_eq!(raw(&streamed), raw(&whole), "{streamed} {whole}");
    let single = ask("call", scripted(8, json!({"parallel_tool_calls": false})));
    assert_eq!(calls_of(&single), vec![weather()], "{single}");
    let single = ask("stream", scripted(8, json!({"parallel_tool_calls": false})));
    assert_eq!(calls_of(&single), vec![weather()], "{single}");
    // A call cut short by max_tokens before its JSON is no call: the text stays content
    // (an unclosed last block whose JSON is whole still counts, as vLLM reads it).
    let cut = ask("stream", scripted(2, json!({})));
    assert_eq!(
        (&cut["calls"], &cut["finish"]),
        (&json!([]), &json!("length")),
        "{cut}"
    );
    assert!(
        cut["content"].as_str().unwrap().contains("<tool_call>"),
        "{cut}"
    );
    // Cut inside the arguments after the call's header went out: whole, the text is content;
    // streamed, the stream ends in an error naming the call (nothing sent is taken back).
    let cut = ask("call", scripted(4, json!({})));
    assert_eq!(
        (&cut["calls"], &cut["finish"]),
        (&json!([]), &json!("length"))
    );
    let cut = ask("stream", scripted(4, json!({})));
    assert_eq!(cut["calls_begun"], 1, "{cut}");
    let error = cut["error"].as_str().unwrap();
    assert!(error.contains("tool call 0 ('get_weather')"), "{cut}");
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_time"}}),
    ] {
        let got = ask("refused", scripted(8, json!({"tool_choice": choice})));
        let want = json!({"status": 400, "param": "allowed_token_ids"});
        assert_eq!(got, want, "{choice}");
        let mut body = scripted(8, json!({"tool_choice": choice}));
        body.as_object_mut().unwrap().remove("allowed_token_ids");
        let got = ask("refused", body);
        assert_eq!(got, json!({"status": 400, "param": "tools"}), "{choice}");
    }
    let (code, body) = server.post("/v1/embeddings", &json!({"input": "t3"}).to_string());
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("is a decoder"), "{body}");
}

/// In every format the server parses, a streamed answer's call goes out in pieces as it is
/// written (more than one piece of arguments), and the `openai` client's own accumulation
/// (`chat.completions.stream`) ends with the calls the whole answer has, arguments equal as
/// text.
#[test]
fn streamed_arguments_accumulate_to_the_whole_answer_in_every_format() {
    let dir = hf_support::scratch("serve-tools-pieces");
    checkpoint(&dir);
    let mut compared = 0;
    for (template, ids) in [
        ("tools.jinja", &HERMES[..]),
        ("llama.jinja", &LLAMA[..]),
        ("mistral.jinja", &MISTRAL[..]),
    ] {
        let server = serve_with(&dir, &dir.join(template));
        let port = server.port.to_string();
        let body = script(ids, ids.len(), json!({})).to_string();
        let whole = python(&["call", &port, &body]);
        let streamed = python(&["accumulate", &port, &body]);
        assert_eq!(whole["finish"], "tool_calls", "{template}: {whole}");
        assert_eq!(streamed["finish"], "tool_calls", "{template}: {streamed}");
        let first = &whole["calls"][0];
        let first = json!({"name": first["name"], "arguments": first["arguments"]});
        assert_eq!(first, weather(), "{template}: {whole}");
        assert_eq!(raw(&streamed), raw(&whole), "{template}");
        let pieces = streamed["pieces"].as_array().unwrap();
        assert!(pieces[0].as_u64().unwrap() >= 2, "{template}: {streamed}");
        compared += 1;
    }
    assert_eq!(compared, 3);
}

/// A conversation with tools, an assistant's `tool_calls` and the `tool` answer renders as
/// jinja2 renders it, and the server prompts the model with exactly that text.
#[test]
fn tool_messages_round_trip_through_the_template() {
    let dir = hf_support::scratch("serve-tools-render");
    checkpoint(&dir);
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_7", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18 C"},
    ]);
    let template = dir.join("tools.jinja");
    let want = python(&[
        "render",
        template.to_str().unwrap(),
        &messages.to_string(),
        &tools().to_string(),
    ]);
    let want = want["prompt"].as_str().unwrap();
    assert!(
        want.contains(
            r#"<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>"#
        ) && want.contains(r#"<tool_response id="call_7">18 C</tool_response>"#)
            && want.contains(r#""description": "Weather now""#),
        "{want}"
    );
    // The library's rendering of the parsed request is jinja2's, character for character.
    let body = json!({"messages": messages, "tools": tools()});
    let obj = body.as_object().unwrap();
    let wgpar::server::api::Prompt::Chat(parsed) = wgpar::server::api::chat_messages(obj).unwrap()
    else {
        panic!("not a chat prompt")
    };
    let ours = wgpar::server::ChatTemplate::from_file(&template, "", "").unwrap();
    let defs = tools().as_array().unwrap().clone();
    assert_eq!(
        ours.render_with_tools(&parsed, Some(&defs), true).unwrap(),
        want
    );
    // Over HTTP: the chat request's prompt is that text (same tokens, same greedy answer).
    let server = serve(&dir);
    let sample = json!({"model": "m", "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let mut chat = sample.clone();
    chat["messages"] = messages;
    chat["tools"] = tools();
    let mut text = sample;
    text["prompt"] = json!(want);
    let (c1, chat) = server.post("/v1/chat/completions", &chat.to_string());
    let (c2, text) = server.post("/v1/completions", &text.to_string());
    assert_eq!((c1, c2), (200, 200), "{chat} {text}");
    let (chat, text): (Value, Value) = (
        serde_json::from_str(&chat).unwrap(),
        serde_json::from_str(&text).unwrap(),
    );
    assert_eq!(chat["usage"], text["usage"], "{chat} {text}");
    assert!(chat["usage"]["prompt_tokens"].as_u64().unwrap() > 40);
    assert_eq!(
        chat["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .trim(),
        text["choices"][0]["text"].as_str().unwrap().trim()
    );
}

/// Functions whose arguments a random model can finish: bounded strings, integers and enums,
/// nothing else allowed.
fn bounded_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
            "properties": {"zone": {"enum": ["CET", "UTC", "PST"]}}, "required": ["zone"],
            "additionalProperties": false}}},
    ])
}

/// A chat request of the random model with [`bounded_tools`], `tool_choice` and `extra`.
fn forced_body(choice: Value, extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": bounded_tools(), "tool_choice": choice, "max_tokens": 160, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// `tool_choice: "required"` and a named function hold a random byte-vocabulary model, whose
/// own answer is no call, to calls: whole and streamed, greedy and sampled, every call's
/// arguments valid against its function's parameters (Python's `jsonschema`), `finish_reason`
/// `tool_calls`, no content. `response_format` and `min_tokens` beside them are refused by name.
#[test]
fn forced_tool_choices_hold_a_random_model_to_valid_calls() {
    let dir = hf_support::scratch("serve-tools-forced");
    let template = dir.join("tools.jinja");
    std::fs::write(&template, TEMPLATE).unwrap();
    // A context for the tools' system turn (about 650 bytes) and the answer.
    let model = gguf_support::byte_llama(&dir, "{{ messages[0]['content'] }}", 1024);
    let server = serve_with(&model, &template);
    let port = server.port.to_string();
    // Unconstrained, the model writes bytes, no call: the calls below are the mask's doing.
    let free = forced_body(json!("auto"), json!({"ignore_eos": true, "max_tokens": 40}));
    let free = python(&["call", &port, &free.to_string()]);
    assert_eq!(
        (&free["calls"], &free["finish"]),
        (&json!([]), &json!("length")),
        "{free}"
    );
    assert!(!free["content"].as_str().unwrap().is_empty(), "{free}");
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let sampled = |seed: u64| json!({"temperature": 1.0, "top_k": 0, "seed": seed});
    let cases = [
        (json!("required"), json!({})),
        (json!("required"), json!({"parallel_tool_calls": false})),
        (
            json!("required"),
            json!({"temperature": 1.0, "top_k": 0, "seed": 3,
            "parallel_tool_calls": false}),
        ),
        (named.clone(), json!({})),
        (named.clone(), sampled(4)),
        (named.clone(), sampled(5)),
    ];
    let mut checked = 0;
    for (choice, extra) in cases {
        for mode in ["call", "stream"] {
            let body = forced_body(choice.clone(), extra.clone());
            let got = python(&["forced", &port, &body.to_string(), mode]);
            assert_eq!(got["finish"], "tool_calls", "{mode} {body}: {got}");
            assert!(
                got["content"].is_null() || got["content"] == "",
                "{mode}: {got}"
            );
            let calls = got["calls"].as_array().unwrap();
            assert!(!calls.is_empty(), "{got}");
            for c in calls {
                assert_eq!(c["valid"], true, "{mode} {body}: {got}");
                assert!(c["id"].as_str().unwrap().starts_with("call_"), "{got}");
                checked += 1;
            }
            if choice == named || extra["parallel_tool_calls"] == false {
                assert_eq!(calls.len(), 1, "{got}");
            }
            if choice == named {
                assert_eq!(calls[0]["name"], "get_time", "{got}");
            }
        }
    }
    assert!(checked >= 12, "{checked} calls checked");
    for (extra, param) in [
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"min_tokens": 2}), "min_tokens"),
    ] {
        for choice in [json!("required"), named.clone()] {
            let body = forced_body(choice, extra.clone());
            let got = python(&["refused", &port, &body.to_string()]);
            assert_eq!(got, json!({"status": 400, "param": param}), "{body}");
        }
    }
}
