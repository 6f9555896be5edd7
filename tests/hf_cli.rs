//! The command line, end to end: `wgpar run --model DIR --prompt` generates the same text as
//! the CPU reference's greedy choice, sampling is reproducible by seed, `wgpar embed` prints
//! similarities, and misuse gives an error and a failing exit status.

mod common;
mod hf_support;

use common::wgpar;
use hf_support::{write_checkpoint, write_word_tokenizer, Store};
use wgpar::model::{CpuReference, ModelConfig, ModelWeights};
use wgpar::parallel::Logits;

/// A tiny GPT-2 checkpoint with a word-level tokenizer (`t0`, `t1`, ...; `t0` ends text).
fn tiny_gpt2() -> (hf_support::Scratch, ModelWeights) {
    let weights = ModelWeights::synthetic(&ModelConfig::preset("tiny-gpt2").unwrap(), 12);
    let dir = write_checkpoint("cli-gpt2", &weights, Store::F32);
    write_word_tokenizer(&dir, weights.config.vocab);
    (dir, weights)
}

#[test]
fn greedy_text_matches_the_reference() {
    let (dir, weights) = tiny_gpt2();
    let prompt = [5u32, 17, 300, 42];
    let mut reference = CpuReference::new(&weights);
    let mut logits = reference.prefill(&[prompt.to_vec()]).unwrap();
    let mut want = prompt.iter().map(|t| format!("t{t}")).collect::<Vec<_>>();
    for step in 0..6 {
        let vocab = weights.config.vocab;
        let next = Logits {
            batch: 1,
            vocab,
            data: logits.concat(),
        }
        .argmax()[0];
        if next == 0 {
            break;
        }
        want.push(format!("t{next}"));
        if step < 5 {
            logits = reference.decode(&[next]).unwrap();
        }
    }
    let (ok, out, err) = wgpar(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "t5 t17 t300 t42",
        "--gen",
        "6",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.trim_end(), want.join(" "), "stderr: {err}");
    assert!(err.contains("tokens/s"), "{err}");
}

#[test]
fn sampling_is_reproducible_by_seed() {
    let (dir, _) = tiny_gpt2();
    let run = |seed: &str| {
        let (ok, out, err) = wgpar(&[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "t1 t2",
            "--gen",
            "8",
            "--temperature",
            "1.5",
            "--top-k",
            "50",
            "--top-p",
            "0.95",
            "--seed",
            seed,
        ]);
        assert!(ok, "{err}");
        out
    };
    assert_eq!(run("3"), run("3"));
    let (ok, _, err) = wgpar(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "t1",
        "--top-p",
        "0",
    ]);
    assert!(!ok && err.contains("top-p"), "{err}");
}

#[test]
fn misuse_is_an_error() {
    let (dir, _) = tiny_gpt2();
    let d = dir.to_str().unwrap();
    let (ok, _, err) = wgpar(&["run", "--model", "tiny-bert"]);
    assert!(!ok && err.contains("wgpar embed"), "{err}");
    let (ok, _, err) = wgpar(&["embed", "--model", d, "--text", "x"]);
    assert!(!ok && err.contains("decoder"), "{err}");
    let (ok, _, err) = wgpar(&["run", "--prompt", "hello"]);
    assert!(!ok && err.contains("--model DIR"), "{err}");
    // Sampling options pick text tokens: without a prompt they would be ignored.
    for option in [
        ["--temperature", "0.8"],
        ["--top-k", "5"],
        ["--top-p", "0.9"],
    ] {
        let (ok, _, err) = wgpar(&["run", "--model", "tiny-llama", option[0], option[1]]);
        assert!(!ok && err.contains("need --prompt"), "{option:?}: {err}");
    }
    let (ok, _, err) = wgpar(&["run", "--model", "no-such-thing"]);
    assert!(
        !ok && err.contains("no-such-thing") && err.contains("tiny-llama"),
        "{err}"
    );
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let (ok, _, err) = wgpar(&["run", "--model", d, "--prompt", "t1"]);
    assert!(!ok && err.contains("tokenizer.json"), "{err}");
}

#[test]
fn benchmark_runs_on_checkpoint_weights() {
    let (dir, _) = tiny_gpt2();
    let (ok, out, err) = wgpar(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--gen",
        "3",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("decode:"), "{out}");
}

#[test]
fn embed_prints_similarities() {
    let dir = common::minilm_dir();
    let (ok, out, err) = wgpar(&[
        "embed",
        "--model",
        dir.to_str().unwrap(),
        "--text",
        "The new movie is awesome",
        "--text",
        "The new movie is so great",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("[0] vs [1]: 0.89"), "{out}");
}
