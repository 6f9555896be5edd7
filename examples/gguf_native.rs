//! A GGUF's layer matrices on the device in the file's own blocks (the figures of
//! docs/BENCHMARKS.md, "GGUF blocks on the device"): the device bytes of the weights against the
//! file's tensor bytes, the layers alone and the whole model, and decode tokens/s at batch 1 on
//! the file's blocks against the same weights dense in f16 (f32 where the adapter has no f16).
//!
//! `python examples/write_mixed_gguf.py /tmp/mixed.gguf`, then
//! `cargo run --release --example gguf_native -- /tmp/mixed.gguf`

use std::sync::Arc;

use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions};
use wgpar::model::gguf::GgufFile;
use wgpar::model::hf::Checkpoint;
use wgpar::model::{GpuModel, ModelWeights, Placement};
use wgpar::parallel::{generate, SingleEngine};

const PROMPT: usize = 16;
const STEPS: usize = 64;

/// Device bytes `weights` take on `gpu` as `dtype` (dense parts), for `placement`.
fn device_bytes(
    gpu: &Arc<Gpu>,
    weights: &ModelWeights,
    placement: Placement,
    dtype: DType,
) -> Result<u64, Box<dyn std::error::Error>> {
    let before = gpu.bytes_allocated();
    let model = GpuModel::upload(gpu.clone(), weights, placement, dtype)?;
    let bytes = gpu.bytes_allocated() - before;
    drop(model);
    Ok(bytes)
}

fn decode_rate(
    gpu: &Arc<Gpu>,
    weights: &ModelWeights,
    dtype: DType,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut engine = SingleEngine::new(gpu.clone(), weights, dtype)?;
    let vocab = weights.config.vocab as u32;
    let prompt = vec![(0..PROMPT as u32).map(|i| (i * 37) % vocab).collect()];
    // One warm-up generation compiles the pipelines.
    generate(&mut engine, &prompt, 2)?;
    Ok(generate(&mut engine, &prompt, STEPS)?.decode_tokens_per_s())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: gguf_native FILE.gguf")?;
    let path = std::path::Path::new(&path);
    let file = GgufFile::open(path)?;
    let size = |names: &dyn Fn(&str) -> bool| -> u64 {
        let tensors = file.tensors.iter().filter(|(n, _)| names(n));
        tensors.map(|(_, i)| (i.end - i.start) as u64).sum()
    };
    let layer_matrix = |n: &str| n.starts_with("blk.") && !n.contains("norm");
    let (all, layers) = (size(&|_| true), size(&layer_matrix));
    let mut ckpt = Checkpoint::open(path)?;
    ckpt.limit_context(PROMPT + STEPS + 8)?;
    let w = ckpt.weights(false)?;
    let adapters = Adapters::discover()?;
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: 1,
    };
    let gpu = open_devices(&adapters, &selection, &GpuOptions::default())?.remove(0);
    println!("adapter: {}", gpu.describe());
    let dense_dtype = if gpu.supports_f16_weights() {
        DType::F16
    } else {
        DType::F32
    };
    let c = &w.config;
    println!(
        "model: {} ({} layers, hidden {}, MLP {}, vocabulary {}), file {} bytes",
        c.name,
        c.layers,
        c.hidden,
        c.ffn,
        c.vocab,
        std::fs::metadata(path)?.len()
    );
    let layers_only = Placement {
        embedding: false,
        head: false,
        ..Placement::whole(c)
    };
    let mut dense = w.clone();
    dense.drop_blocks();
    println!("| | file tensors | device, file's blocks | device, dense {dense_dtype:?} |");
    println!("|---|---|---|---|");
    for (what, file_bytes, placement) in [
        (
            "layer matrices (+ norms, RoPE tables on the device)",
            layers,
            layers_only,
        ),
        ("whole model", all, Placement::whole(c)),
    ] {
        let native = device_bytes(&gpu, &w, placement.clone(), dense_dtype)?;
        let dense_bytes = device_bytes(&gpu, &dense, placement, dense_dtype)?;
        println!("| {what} | {file_bytes} | {native} | {dense_bytes} |");
    }
    let native = decode_rate(&gpu, &w, dense_dtype)?;
    let dense_rate = decode_rate(&gpu, &dense, dense_dtype)?;
    println!(
        "decode tok/s (batch 1, {STEPS} steps): file's blocks {native:.1}, dense \
         {dense_dtype:?} {dense_rate:.1}"
    );
    Ok(())
}
