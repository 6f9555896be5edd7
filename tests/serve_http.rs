//! `wgpar serve` over HTTP (issue 27), on a tiny GPT-2 checkpoint the test writes with a real
//! tokenizer.json and a chat template: tokens equal `wgpar run --prompt` on single, tp and pp;
//! the chat prompt equals jinja2's; 64 concurrent streams; cancellation; bad input; the queue
//! bound; SIGTERM; an injected stage fault. Clients: curl and the Python `openai` package.

mod common;
mod hf_support;
mod serve_support;

use std::process::Command;
use std::time::{Duration, Instant};

use hf_support::{write_checkpoint, write_word_tokenizer, Scratch, Store};
use serde_json::Value;
use serve_support::Server;
use wgpar::model::{ModelConfig, ModelWeights};

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %} t3 \
{{ m['content'].strip() }}{% else %} t4 {{ m.content | trim }}{% endif %}{% endfor %}\
{% if add_generation_prompt %} t5{% endif %}";

/// tiny-gpt2 (context 128) with a word tokenizer (`t0` ends text) and a chat template.
fn checkpoint() -> Scratch {
    let mut config = ModelConfig::preset("tiny-gpt2").unwrap();
    config.max_seq = config.max_seq.min(128);
    let weights = ModelWeights::synthetic(&config, 12);
    let dir = write_checkpoint("serve-http", &weights, Store::F32);
    write_word_tokenizer(&dir, weights.config.vocab);
    let tok = serde_json::json!({"chat_template": TEMPLATE, "bos_token": "t2", "eos_token": "t0"});
    std::fs::write(dir.join("tokenizer_config.json"), tok.to_string()).unwrap();
    std::fs::write(dir.join("template.jinja"), TEMPLATE).unwrap();
    dir
}

/// `wgpar serve` on `dir`'s checkpoint, served as `m` (the name the clients give), with
/// `extra` options.
fn start(dir: &Scratch, extra: &[&str]) -> Server {
    let model = ["--model", dir.to_str().unwrap(), "--served-model-name", "m"];
    launch(&[&model[..], extra].concat())
}

/// `wgpar serve --port 0 ARGS`, once /health says 200.
fn launch(args: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(["serve", "--port", "0"]).args(args);
    Server::spawn(cmd, Duration::from_secs(300))
}

/// Runs tests/serve_http/client.py against `server`; its JSON output.
fn client(server: &Server, args: &[&str]) -> Value {
    let port = server.port.to_string();
    python(&[&[port.as_str()][..], args].concat())
}

fn python(args: &[&str]) -> Value {
    common::python_json("tests/serve_http/client.py", args)
}

/// `wgpar run --prompt` text after the prompt.
fn run_text(dir: &Scratch, prompt: &str, gen: usize, strategy: &[&str]) -> String {
    let gen = gen.to_string();
    let mut args = vec![
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        prompt,
        "--gen",
        &gen,
    ];
    args.extend_from_slice(strategy);
    let (ok, out, err) = common::wgpar(&args);
    assert!(ok, "{err}");
    // The text is the first line; a pipeline adds its bubble line.
    let text = out.lines().next().unwrap_or_default();
    text.strip_prefix(prompt)
        .unwrap_or_else(|| panic!("{text}"))
        .to_string()
}

#[test]
fn tokens_equal_run_on_every_strategy() {
    let dir = checkpoint();
    let prompt = "t5 t17 t300 t42 t7";
    for strategy in [
        &[][..],
        &["--strategy", "tp", "--virtual", "2"],
        &["--strategy", "pp", "--virtual", "2"],
    ] {
        let want = run_text(&dir, prompt, 12, strategy);
        assert!(
            !want.trim().is_empty(),
            "{strategy:?}: run generated nothing"
        );
        let server = start(&dir, strategy);
        let got = client(&server, &["complete", prompt, "12"]);
        assert_eq!(
            got["text"].as_str().unwrap(),
            want,
            "{strategy:?}: non-streamed"
        );
        assert_eq!(
            got["stream_text"].as_str().unwrap(),
            want,
            "{strategy:?}: streamed"
        );
        assert!(
            got["chunks"].as_u64().unwrap() >= 2,
            "{strategy:?}: one chunk per token: {got}"
        );
        let words = want.split_whitespace().count() as u64;
        assert_eq!(got["usage"]["completion_tokens"], words, "{got}");
        assert_eq!(got["usage"]["prompt_tokens"], 5, "{got}");
        assert_eq!(got["stream_usage"], got["usage"], "{got}");
        // curl agrees, and stop strings cut the text.
        let body =
            format!(r#"{{"model":"m","prompt":"{prompt}","max_tokens":12,"temperature":0}}"#);
        let (code, text) = server.post("/v1/completions", &body);
        assert_eq!(code, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want);
        let second = want.split_whitespace().nth(1).unwrap().to_string();
        let body = format!(
            r#"{{"prompt":"{prompt}","max_tokens":12,"temperature":0,"stop":["{second}"]}}"#
        );
        let (_, text) = server.post("/v1/completions", &body);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{text}");
        assert!(
            !v["choices"][0]["text"].as_str().unwrap().contains(&second),
            "{text}"
        );
        stop_strings_are_never_streamed_in_part(&server, prompt, &want);
    }
}

/// A stop string of two words: while its first word ends the text, the stream holds it back,
/// so streamed and whole texts both end before it, and neither shows its first word.
fn stop_strings_are_never_streamed_in_part(server: &Server, prompt: &str, want: &str) {
    let words: Vec<&str> = want.split_whitespace().collect();
    assert!(words.len() >= 4, "too short to place a stop string: {want}");
    let stop = format!("{} {}", words[2], words[3]);
    let cut = &want[..want.find(&stop).unwrap()];
    let stops = serde_json::to_string(&[&stop]).unwrap();
    let got = client(server, &["complete", prompt, "12", &stops]);
    for key in ["text", "stream_text"] {
        assert_eq!(got[key].as_str().unwrap(), cut, "{key}: {got}");
    }
    assert_eq!(got["finish"], "stop", "{got}");
    assert_eq!(got["stream_finish"], "stop", "{got}");
}

#[test]
fn chat_prompt_equals_jinja2() {
    let dir = checkpoint();
    let messages = r#"[{"role":"system","content":"  t10 t11 "},{"role":"user","content":"t12 t13"},{"role":"assistant","content":"t14"},{"role":"user","content":"t15"}]"#;
    let template = dir.join("template.jinja");
    let want = python(&[
        "0",
        "render",
        template.to_str().unwrap(),
        messages,
        "t2",
        "t0",
    ]);
    let want = want["prompt"].as_str().unwrap();
    let parsed: Vec<wgpar::server::Message> = serde_json::from_str::<Vec<Value>>(messages)
        .unwrap()
        .iter()
        .map(|m| {
            wgpar::server::Message::text(
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap(),
            )
        })
        .collect();
    let ours = wgpar::server::ChatTemplate::load(&dir).unwrap().unwrap();
    assert_eq!(ours.render(&parsed, true).unwrap(), want);
    // Over HTTP: the chat answer is the completion of jinja2's prompt.
    let server = start(&dir, &[]);
    let chat = client(&server, &["chat", messages, "8"]);
    let completion = client(&server, &["complete", want, "8"]);
    assert_eq!(chat["text"], completion["text"], "{chat} {completion}");
    assert_eq!(
        chat["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        want.split_whitespace().count()
    );
}

#[test]
fn sixty_four_concurrent_streams_on_pp_and_tp() {
    let dir = checkpoint();
    let prompts: Vec<String> = (0..64)
        .map(|i| format!("t{} t{} t{}", 10 + i, 200 + 3 * i, 7 + (i % 5)))
        .collect();
    let prompts_json = serde_json::to_string(&prompts).unwrap();
    for strategy in [
        ["--strategy", "pp", "--virtual", "2"],
        ["--strategy", "tp", "--virtual", "2"],
    ] {
        let server = start(&dir, &[&strategy[..], &["--max-batch", "16"]].concat());
        let out = client(&server, &["concurrent", &prompts_json, "6"]);
        let (alone, together) = (
            out["alone"].as_array().unwrap(),
            out["together"].as_array().unwrap(),
        );
        assert_eq!(together.len(), 64);
        for (i, (a, t)) in alone.iter().zip(together).enumerate() {
            assert_eq!(&t["text"], a, "{strategy:?} request {i}: {t}");
            assert_eq!(t["usage"]["prompt_tokens"], 3, "{t}");
            let words = a.as_str().unwrap().split_whitespace().count() as u64;
            assert_eq!(t["usage"]["completion_tokens"], words, "{t}");
        }
        let distinct: std::collections::BTreeSet<_> = alone.iter().map(|a| a.to_string()).collect();
        assert!(
            distinct.len() > 1,
            "every prompt gave the same text: no check of mixing"
        );
    }
}

/// `wgpar run --prompt` text after the prompt, sampled with `--temperature`, `--top-p` and
/// `--seed`.
fn run_sampled(dir: &Scratch, prompt: &str, gen: usize, (t, p, seed): (&str, &str, u64)) -> String {
    let seed = seed.to_string();
    let sampling = ["--temperature", t, "--top-p", p, "--seed", &seed];
    run_text(dir, prompt, gen, &sampling)
}

/// Per-request sampling: a seeded request gets the tokens `wgpar run` samples with that seed,
/// alone or batched with greedy and other sampled requests; another seed gives other tokens.
#[test]
fn sampled_requests_follow_their_own_seed() {
    let dir = checkpoint();
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("t{} t{} t{}", 30 + i, 90 + 7 * i, 5 + i))
        .collect();
    let prompts_json = serde_json::to_string(&prompts).unwrap();
    let (t, p) = ("1.3", "0.95");
    let mut compared = 0;
    for strategy in [&[][..], &["--strategy", "pp", "--virtual", "2"]] {
        let server = start(&dir, &[strategy, &["--max-batch", "8"]].concat());
        let out = client(&server, &["sampled", &prompts_json, "10", t, p]);
        let (alone, together) = (
            out["alone"].as_array().unwrap(),
            out["together"].as_array().unwrap(),
        );
        assert_eq!(together.len(), prompts.len(), "{out}");
        for (i, (a, t)) in alone.iter().zip(together).enumerate() {
            assert_eq!(&t["text"], a, "{strategy:?} request {i}: {t}");
        }
        // Sampled requests (even ones) against `run` with the same seed.
        for i in (0..prompts.len()).step_by(2) {
            let want = run_sampled(&dir, &prompts[i], 10, (t, p, 100 + i as u64));
            assert_eq!(alone[i].as_str().unwrap(), want, "{strategy:?} request {i}");
            compared += 1;
        }
        assert_ne!(
            out["reseeded"], alone[0],
            "seed 7 gave seed 100's text: {out}"
        );
        let greedy = run_text(&dir, &prompts[1], 10, &[]);
        assert_eq!(
            alone[1].as_str().unwrap(),
            greedy,
            "{strategy:?}: greedy row"
        );
    }
    assert_eq!(compared, 8);
}

#[test]
fn dropped_streams_free_their_slots() {
    let dir = checkpoint();
    let server = start(&dir, &["--max-batch", "4"]);
    let out = client(&server, &["cancel", "4", "t9 t8 t7"]);
    assert_eq!(out["firsts"].as_array().unwrap().len(), 4);
    let t0 = Instant::now();
    while server.metric("wgpar:kv_slots_used") != 0.0
        || server.metric("wgpar:requests_cancelled_total") < 4.0
    {
        assert!(t0.elapsed() < Duration::from_secs(30), "slots not freed");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The freed slots serve new requests.
    let (code, body) = server.post("/v1/completions", r#"{"prompt":"t1 t2","max_tokens":3}"#);
    assert_eq!(code, 200, "{body}");
}

#[test]
fn bad_requests_get_4xx_and_the_server_stays_up() {
    let dir = checkpoint();
    let server = start(&dir, &["--api-key", "sesame", "--max-body", "4096"]);
    let auth = [
        "-H",
        "Authorization: Bearer sesame",
        "-H",
        "Content-Type: application/json",
    ];
    let big = format!(r#"{{"prompt":"{}"}}"#, "t1 ".repeat(3000));
    let long_prompt = format!(r#"{{"prompt":"{}","max_tokens":4}}"#, "t1 ".repeat(200));
    let cases: Vec<(&str, String, &str)> = vec![
        ("/v1/completions", "{".into(), "JSON"),
        ("/v1/completions", "[]".into(), "object"),
        ("/v1/completions", "null".into(), "object"),
        ("/v1/completions", "{}".into(), "prompt"),
        ("/v1/completions", r#"{"prompt":5}"#.into(), "prompt"),
        ("/v1/completions", r#"{"prompt":[]}"#.into(), "prompt"),
        ("/v1/completions", r#"{"prompt":[1,-2]}"#.into(), "prompt"),
        (
            "/v1/completions",
            r#"{"prompt":[99999999]}"#.into(),
            "vocabulary",
        ),
        ("/v1/completions", r#"{"prompt":""}"#.into(), "no tokens"),
        (
            "/v1/completions",
            r#"{"prompt":"t1","max_tokens":0}"#.into(),
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","max_tokens":-1}"#.into(),
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","max_tokens":"8"}"#.into(),
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","max_tokens":1e30}"#.into(),
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","max_tokens":500}"#.into(),
            "context",
        ),
        ("/v1/completions", long_prompt, "context"),
        ("/v1/completions", r#"{"prompt":"t1","n":9}"#.into(), "'n'"),
        (
            "/v1/completions",
            r#"{"prompt":"t1","temperature":-1}"#.into(),
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","temperature":"hot"}"#.into(),
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","top_p":1.5}"#.into(),
            "top_p",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","temperature":2.5}"#.into(),
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","top_k":-2}"#.into(),
            "top_k",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","stop":7}"#.into(),
            "stop",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","stop":["a","b","c","d","e"]}"#.into(),
            "stop",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","stop":[""]}"#.into(),
            "stop",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","stream":"yes"}"#.into(),
            "stream",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","stream_options":1}"#.into(),
            "stream_options",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","seed":-3}"#.into(),
            "seed",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"t1","model":7}"#.into(),
            "model",
        ),
        ("/v1/chat/completions", "{}".into(), "messages"),
        (
            "/v1/chat/completions",
            r#"{"messages":[]}"#.into(),
            "messages",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"content":"t1"}]}"#.into(),
            "role",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":5}]}"#.into(),
            "content",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":"hi"}"#.into(),
            "messages",
        ),
        ("/v1/completions", big, ""),
    ];
    assert!(cases.len() >= 25);
    for (path, body, needle) in &cases {
        let (code, text) = server.curl(&[&auth[..], &["-d", body]].concat(), path);
        assert!((400..500).contains(&code), "{path} {body}: {code} {text}");
        assert!(
            text.contains(needle),
            "{path} {body}: '{needle}' not in {text}"
        );
    }
    // Without the key: 401, but /health needs none.
    let (code, _) = server.post("/v1/completions", r#"{"prompt":"t1"}"#);
    assert_eq!(code, 401);
    assert_eq!(server.get("/v1/models").0, 401);
    assert_eq!(server.get("/health").0, 200);
    let (code, text) = server.curl(
        &[&auth[..], &["-d", r#"{"prompt":"t1 t2","max_tokens":2}"#]].concat(),
        "/v1/completions",
    );
    assert_eq!(code, 200, "{text}");
}

#[test]
fn queue_overflow_gets_503() {
    let dir = checkpoint();
    let server = start(&dir, &["--max-batch", "1", "--max-queue", "1"]);
    let out = client(&server, &["flood", "12", "t3 t4 t5"]);
    let statuses: Vec<u64> = out
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_u64().unwrap())
        .collect();
    assert!(statuses.contains(&200), "{out}");
    let refused: Vec<&Value> = out
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["status"] == 503)
        .collect();
    assert!(!refused.is_empty(), "no 503: {out}");
    assert!(refused.iter().all(|r| r["retry_after"] == "1"), "{out}");
    assert!(statuses.iter().all(|&s| s == 200 || s == 503), "{out}");
}

#[test]
fn sigterm_drains_and_exits_0() {
    let dir = checkpoint();
    let mut server = start(&dir, &["--shutdown-timeout", "60"]);
    let port = server.port;
    let client = std::thread::spawn(move || {
        let out = Command::new("curl")
            .args([
                "-s",
                "-N",
                "-m",
                "120",
                "-H",
                "Content-Type: application/json",
                "-d",
            ])
            // Long and past end tokens, so it is still running when the poll below looks.
            .arg(r#"{"prompt":"t3 t4","max_tokens":90,"ignore_eos":true,"stream":true}"#)
            .arg(format!("http://127.0.0.1:{port}/v1/completions"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    });
    let t0 = Instant::now();
    while server.metric("wgpar:num_requests_running") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the request never ran"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = server.terminate(Duration::from_secs(90));
    assert!(status.success(), "{status:?}");
    let streamed = client.join().unwrap();
    assert!(streamed.trim_end().ends_with("data: [DONE]"), "{streamed}");
    assert!(streamed.contains("\"finish_reason\":"), "{streamed}");
}

#[test]
fn stage_fault_ends_streams_with_an_error_and_health_turns_503() {
    let dir = checkpoint();
    let server = start(
        &dir,
        &[
            "--strategy",
            "pp",
            "--virtual",
            "2",
            "--inject-fault",
            "stage=1,kind=error,at=step:0",
        ],
    );
    let out = client(&server, &["streams", "4", "t3 t4 t5"]);
    for r in out.as_array().unwrap() {
        assert!(
            r["error"].is_string(),
            "a stream ended without an error: {out}"
        );
    }
    assert_eq!(server.get("/health").0, 503);
    let (code, _) = server.post("/v1/completions", r#"{"prompt":"t1","max_tokens":2}"#);
    assert_eq!(code, 503);
}

/// `bench serve --url` drives the server (here on a preset, served with a word-level
/// tokenizer) with the seeded workload: every request completes with its output length.
#[test]
fn bench_serve_url_drives_the_server() {
    let server = launch(&["--model", "tiny-gpt2", "--max-batch", "4"]);
    let url = format!("http://127.0.0.1:{}", server.port);
    let (ok, out, err) = common::wgpar(&[
        "bench",
        "serve",
        "--url",
        &url,
        "--model",
        "tiny-gpt2",
        "--requests",
        "12",
        "--rate",
        "50",
        "--prompt-len",
        "3:9",
        "--output-len",
        "2:6",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["errors"].as_array().unwrap().len(), 0, "{out}");
    assert_eq!(v["metrics"]["completed"], 12, "{out}");
    assert_eq!(v["metrics"]["failed"], 0, "{out}");
    // A client over HTTP sees no device timeline: the shares are not measured, so null.
    assert!(v["metrics"]["bubble_share"].is_null(), "{out}");
    assert!(v["metrics"]["comm_share"].is_null(), "{out}");
    assert!(
        v["metrics"]["output_tokens_per_s"].as_f64().unwrap() > 0.0,
        "{out}"
    );
    // Once all are done, the gauges say so.
    assert_eq!(server.metric("wgpar:request_success_total"), 12.0);
    assert_eq!(server.metric("wgpar:kv_slots_used"), 0.0);
    assert_eq!(server.metric("wgpar:num_requests_running"), 0.0);
    // ignore_eos: every request gets its drawn output length; the in-process run agrees.
    let (ok, local, err) = common::wgpar(&[
        "bench",
        "serve",
        "--model",
        "tiny-gpt2",
        "--requests",
        "12",
        "--rate",
        "50",
        "--prompt-len",
        "3:9",
        "--output-len",
        "2:6",
        "--json",
    ]);
    assert!(ok, "{err}");
    let local: Value = serde_json::from_str(&local).unwrap();
    assert_eq!(
        v["metrics"]["output_tokens"], local["metrics"]["output_tokens"],
        "{out}"
    );
    assert_eq!(
        v["metrics"]["input_tokens"], local["metrics"]["input_tokens"],
        "{out}"
    );
    // The run here has the engine's timeline: its shares are measured.
    assert!(local["metrics"]["bubble_share"].is_f64(), "{local}");
    // A preset has no chat template: chat gets a 400 that says so.
    let (code, body) = server.post(
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"t1"}]}"#,
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("no chat template"), "{body}");
}
