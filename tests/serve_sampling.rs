//! Greedy requests with `logit_bias`, repetition, presence and frequency penalties and
//! `min_tokens` (issue 35 item 2) are picked on the device: the step carries each row's
//! adjustments to the pick kernel and no logits come back for them
//! (`wgpar:logits_readback_rows_total` stays put). The same request with `logprobs` reads
//! its logits back and is picked by the host picker: the same tokens, on single, tp and pp,
//! alone and batched with requests of other rules.

mod common;
mod hf_support;
mod serve_support;

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use serve_support::Server;

const READBACK: &str = "wgpar:logits_readback_rows_total";

fn serve(model: &str, extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args([
        "serve",
        "--port",
        "0",
        "--served-model-name",
        "m",
        "--model",
        model,
    ])
    .args(extra);
    Server::spawn(cmd, Duration::from_secs(300))
}

/// The token ids of a completion of `body` (a word-level text: `t5 t17` is [5, 17]).
fn tokens(server: &Server, body: &Value) -> Vec<u32> {
    let (code, text) = server.post("/v1/completions", &body.to_string());
    assert_eq!(code, 200, "{body}: {text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    (v["choices"][0]["text"].as_str().unwrap())
        .split_whitespace()
        .map(|w| w.strip_prefix('t').unwrap().parse().unwrap())
        .collect()
}

/// A greedy request over `prompt` with bias and penalties built around its plain tokens.
fn ruled(prompt: &[u32], plain: &[u32], strength: f64) -> Value {
    let favoured = plain.iter().copied().find(|&t| t != plain[0]).unwrap_or(3);
    json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "logit_bias": {plain[0].to_string(): -100, favoured.to_string(): strength},
        "repetition_penalty": 1.0 + strength / 2.0, "presence_penalty": 0.5 * strength,
        "frequency_penalty": 0.4, "min_tokens": 3, "stop_token_ids": [plain[1]]})
}

#[test]
fn greedy_bias_and_penalties_pick_on_the_device_as_on_the_host() {
    let (dir, _) = hf_support::chat_checkpoint("serve-sampling-device");
    let prompts: [Vec<u32>; 3] = [
        vec![5, 17, 300, 42, 7, 17],
        vec![9, 9, 31],
        vec![64, 2, 8, 8],
    ];
    for extra in [
        &[][..],
        &["--strategy", "tp", "--virtual", "2"],
        &["--strategy", "pp", "--virtual", "2"],
    ] {
        let server = serve(dir.to_str().unwrap(), extra);
        let mut bodies = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let plain = tokens(
                &server,
                &json!({"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
            );
            bodies.push(ruled(p, &plain, 1.0 + i as f64));
        }
        // One at a time on the device: no logits read back.
        let before = server.metric(READBACK);
        let device: Vec<Vec<u32>> = bodies.iter().map(|b| tokens(&server, b)).collect();
        assert_eq!(server.metric(READBACK), before, "{extra:?}");
        // All at once, each row with its own adjustments, and a plain request beside them.
        let together: Vec<Vec<u32>> = std::thread::scope(|s| {
            let plain = s.spawn(|| {
                tokens(
                    &server,
                    &json!({"prompt": [3, 4], "max_tokens": 12, "temperature": 0}),
                )
            });
            let ruled: Vec<_> = (bodies.iter())
                .map(|b| s.spawn(|| tokens(&server, b)))
                .collect();
            let got = ruled.into_iter().map(|h| h.join().unwrap()).collect();
            plain.join().unwrap();
            got
        });
        assert_eq!(together, device, "{extra:?}");
        assert_eq!(server.metric(READBACK), before, "{extra:?}");
        // With log-probs the host picker picks from read-back logits: the same tokens.
        for (body, want) in bodies.iter().zip(&device) {
            let mut host = body.clone();
            host["logprobs"] = json!(0);
            assert_eq!(&tokens(&server, &host), want, "{extra:?} {body}");
        }
        assert!(server.metric(READBACK) > before, "{extra:?}");
        // The rules changed the tokens (compared, not bypassed): the banned plain pick is gone.
        for (body, got) in bodies.iter().zip(&device) {
            let banned: u32 = (body["logit_bias"].as_object().unwrap())
                .iter()
                .find(|(_, b)| b.as_f64() == Some(-100.0))
                .map(|(k, _)| k.parse().unwrap())
                .unwrap();
            assert!(!got.is_empty() && !got.contains(&banned), "{got:?} {body}");
        }
    }
}

/// More `logit_bias` entries than OpenAI's cap of 300, or one token twice, are refused by
/// name.
#[test]
fn logit_bias_over_the_cap_is_refused_by_name() {
    let (dir, _) = hf_support::chat_checkpoint("serve-sampling-cap");
    let server = serve(dir.to_str().unwrap(), &[]);
    let many: serde_json::Map<String, Value> =
        (0..301).map(|t| (t.to_string(), json!(1))).collect();
    let twice = json!({"7": 1, "07": 2});
    for (bias, says) in [(Value::Object(many), "at most 300"), (twice, "twice")] {
        let body = json!({"prompt": "t1", "max_tokens": 2, "logit_bias": bias});
        let (code, text) = server.post("/v1/completions", &body.to_string());
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(code, 400, "{v}");
        assert_eq!(v["error"]["param"], "logit_bias", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{v}"
        );
    }
}
