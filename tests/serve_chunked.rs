//! `wgpar serve --max-step-tokens` (issue 36): long prompts sent together with short ones are
//! prefilled in chunks between the decode steps of the running streams, on one device, tensor
//! parallel and a pipeline, and every answer equals `wgpar run --prompt` (one whole prefill).
//! A step budget below --max-batch is refused before any device opens.

mod common;
mod hf_support;
mod serve_support;

use std::process::Command;
use std::time::Duration;

use hf_support::{write_checkpoint, write_word_tokenizer, Scratch, Store};
use serve_support::Server;
use wgpar::model::{ModelConfig, ModelWeights};

/// A Llama-shaped checkpoint (rotary positions, which a chunk must continue) of context 64,
/// with a word tokenizer (`t7` is token 7) and no end token.
fn checkpoint() -> Scratch {
    let config = ModelConfig {
        max_seq: 64,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let weights = ModelWeights::synthetic(&config, 19);
    let dir = write_checkpoint("serve-chunked", &weights, Store::F32);
    write_word_tokenizer(&dir, weights.config.vocab);
    dir
}

/// `wgpar run --prompt` text after the prompt.
fn run_text(dir: &Scratch, prompt: &str, gen: usize, strategy: &[&str]) -> String {
    let gen = gen.to_string();
    let model = dir.to_str().unwrap();
    let mut args = vec!["run", "--model", model, "--prompt", prompt, "--gen", &gen];
    args.extend_from_slice(strategy);
    let (ok, out, err) = common::wgpar(&args);
    assert!(ok, "{err}");
    let text = out.lines().next().unwrap_or_default();
    text.strip_prefix(prompt)
        .unwrap_or_else(|| panic!("{text}"))
        .to_string()
}

/// A prompt of `len` words of the preset's word-level vocabulary.
fn prompt(len: usize, salt: usize) -> String {
    (0..len)
        .map(|i| format!("t{}", (i * 37 + salt * 11 + 5) % 380))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn chunked_prompts_answer_as_one_prefill_on_every_strategy() {
    // 5 tokens a step beside up to 4 streams: chunks of 1 to 5 tokens, none dividing 23.
    let dir = checkpoint();
    let prompts = vec![prompt(23, 1), prompt(3, 2), prompt(31, 3), prompt(9, 4)];
    let prompts_json = serde_json::to_string(&prompts).unwrap();
    for strategy in [
        &[][..],
        &["--strategy", "tp", "--virtual", "2"],
        &["--strategy", "pp", "--virtual", "2"],
    ] {
        let want: Vec<String> = (prompts.iter())
            .map(|p| run_text(&dir, p, 6, strategy))
            .collect();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
        cmd.args(["serve", "--port", "0", "--served-model-name", "m"])
            .args(["--model", dir.to_str().unwrap()])
            .args(["--max-batch", "4", "--max-step-tokens", "5"])
            .args(strategy);
        let server = Server::spawn(cmd, Duration::from_secs(300));
        let port = server.port.to_string();
        let out = common::python_json(
            "tests/serve_http/client.py",
            &[&port, "concurrent", &prompts_json, "6"],
        );
        let (alone, together) = (
            out["alone"].as_array().unwrap(),
            out["together"].as_array().unwrap(),
        );
        assert_eq!(together.len(), prompts.len(), "{out}");
        for (i, w) in want.iter().enumerate() {
            assert_eq!(w.split_whitespace().count(), 6, "{strategy:?}: {w}");
            assert_eq!(
                alone[i].as_str(),
                Some(w.as_str()),
                "{strategy:?} {i} alone"
            );
            assert_eq!(
                together[i]["text"].as_str(),
                Some(w.as_str()),
                "{strategy:?} {i} together: {}",
                together[i]
            );
        }
        let distinct: std::collections::BTreeSet<_> = want.iter().collect();
        assert!(distinct.len() > 1, "every prompt gave the same text");
    }
}

#[test]
fn a_step_budget_below_the_batch_is_refused_before_devices_open() {
    let args = [
        "serve",
        "--port",
        "0",
        "--max-batch",
        "8",
        "--model",
        "tiny-llama",
    ];
    for bad in ["7", "0", "70000"] {
        let a = [&args[..], &["--max-step-tokens", bad]].concat();
        let (ok, _, err) = common::wgpar(&a);
        assert!(!ok, "--max-step-tokens {bad} was accepted");
        assert!(err.contains("--max-step-tokens"), "{bad}: {err}");
    }
}
