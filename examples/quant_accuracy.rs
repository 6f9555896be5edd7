//! Packed weights against f32, through the library API (the figures of docs/BENCHMARKS.md,
//! "Packed weights"): for each block type, on one random Llama-shaped model,
//!
//! - greedy agreement: over `STEPS` decode steps fed f32's own greedy tokens (teacher forcing,
//!   so one early difference does not decide every later step), how often the packed model's
//!   top token is f32's;
//! - the mean |Δ log-prob| of f32's chosen token between the two;
//! - whether single, tensor-parallel and pipelined runs on two virtual devices pick the same
//!   tokens;
//! - decode tokens/s at batch 1 on one device, beside f32 and f16 weights.
//!
//! `cargo run --release --example quant_accuracy`

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions};
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    generate, Engine, Logits, Partition, PipelineEngine, SingleEngine, TensorParallelEngine,
};

const STEPS: usize = 256;
const PROMPT: usize = 16;

fn config() -> ModelConfig {
    ModelConfig {
        name: "packed-bench".into(),
        vocab: 2048,
        hidden: 512,
        layers: 4,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        ffn: 1536,
        max_seq: PROMPT + STEPS + 8,
        ..ModelConfig::preset("tiny-llama").expect("preset")
    }
}

fn log_softmax_at(l: &Logits, token: u32) -> f64 {
    let max = l.data.iter().fold(f32::MIN, |m, &v| m.max(v)) as f64;
    let sum: f64 = l.data.iter().map(|&v| (v as f64 - max).exp()).sum();
    l.data[token as usize] as f64 - max - sum.ln()
}

/// (agreement, mean |Δ log-prob|) of `packed` against `dense` over STEPS teacher-forced steps.
fn agreement(dense: &mut dyn Engine, packed: &mut dyn Engine, prompt: &[Vec<u32>]) -> (f64, f64) {
    let mut d = dense.prefill(prompt).expect("prefill");
    let mut p = packed.prefill(prompt).expect("prefill");
    let (mut same, mut delta) = (0usize, 0.0f64);
    for step in 0..STEPS {
        let t = d.argmax();
        same += usize::from(p.argmax() == t);
        delta += (log_softmax_at(&d, t[0]) - log_softmax_at(&p, t[0])).abs();
        if step + 1 < STEPS {
            d = dense.decode(&t).expect("decode");
            p = packed.decode(&t).expect("decode");
        }
    }
    (same as f64 / STEPS as f64, delta / STEPS as f64)
}

fn same_tokens(gpus: &[Arc<Gpu>], w: &ModelWeights, prompt: &[Vec<u32>]) -> bool {
    let run = |e: &mut dyn Engine| generate(e, prompt, 32).expect("generate").tokens;
    let mut single = SingleEngine::new(gpus[0].clone(), w, DType::F32).expect("single");
    let want = run(&mut single);
    drop(single);
    let mut tp =
        TensorParallelEngine::new(gpus, w, DType::F32, None, CommConfig::default()).expect("tp");
    let tp_same = run(&mut tp) == want;
    drop(tp);
    let mut pp = PipelineEngine::new(
        gpus,
        w,
        DType::F32,
        &Partition::Even,
        1,
        CommConfig::default(),
    )
    .expect("pp");
    tp_same && run(&mut pp) == want
}

fn decode_rate(gpu: &Arc<Gpu>, w: &ModelWeights, dtype: DType, prompt: &[Vec<u32>]) -> f64 {
    let mut e = SingleEngine::new(gpu.clone(), w, dtype).expect("engine");
    generate(&mut e, prompt, 8).expect("warm-up");
    generate(&mut e, prompt, 64)
        .expect("generate")
        .decode_tokens_per_s()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let adapters = Adapters::discover()?;
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: 2,
    };
    let gpus = open_devices(&adapters, &selection, &GpuOptions::default())?;
    println!("adapter: {}", gpus[0].describe());
    let w = ModelWeights::synthetic(&config(), 5);
    let prompt = vec![(0..PROMPT as u32)
        .map(|i| (i * 37 + 11) % 2048)
        .collect::<Vec<_>>()];
    let mut dense = SingleEngine::new(gpus[0].clone(), &w, DType::F32)?;
    let f32_rate = decode_rate(&gpus[0], &w, DType::F32, &prompt);
    let f16_rate = if gpus[0].supports_f16_weights() {
        format!("{:.1}", decode_rate(&gpus[0], &w, DType::F16, &prompt))
    } else {
        "-".into()
    };
    println!("f32 weights: {f32_rate:.1} tok/s, f16 weights: {f16_rate} tok/s (decode, batch 1)");
    println!("| type | greedy agreement ({STEPS} steps) | mean abs Δ log-prob | single = tp = pp | decode tok/s |");
    println!("|---|---|---|---|---|");
    for t in [
        QuantType::Q8_0,
        QuantType::Q6K,
        QuantType::Q4K,
        QuantType::Q4_0,
    ] {
        let pw = ModelWeights {
            packed: Some(t),
            ..w.clone()
        };
        let mut packed = SingleEngine::new(gpus[0].clone(), &pw, DType::F32)?;
        let (agree, delta) = agreement(&mut dense, &mut packed, &prompt);
        drop(packed);
        let same = same_tokens(&gpus, &pw, &prompt);
        let rate = decode_rate(&gpus[0], &pw, DType::F32, &prompt);
        println!(
            "| {} | {:.1} % | {delta:.4} | {} | {rate:.1} |",
            t.name(),
            agree * 100.0,
            if same { "yes" } else { "no" }
        );
    }
    Ok(())
}
