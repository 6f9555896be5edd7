//! The f16 KV cache (`--kv-dtype`, `GpuOptions::kv_cache`): single, tp and pp engines against
//! a CPU reference that rounds keys and values to f16 as they are cached, the cache's bytes
//! (exactly half of f32's), and `auto` on a Vulkan + GL pair (f16 where SHADER_F16 is, f32
//! on the other device).

mod common;

use std::sync::Arc;

use wgpar::comm::CommConfig;
use wgpar::device::{
    open_devices, AdapterDesc, Adapters, DType, DeviceSelection, Gpu, GpuOptions, KvCacheType,
};
use wgpar::model::{CpuReference, GpuModel, ModelConfig, ModelWeights, Placement};
use wgpar::parallel::{
    Engine, Logits, Partition, PipelineEngine, SingleEngine, TensorParallelEngine,
};

const DECODE_STEPS: usize = 6;

/// The bar against the reference that rounds the cache as the device does: the f32 engines'
/// bar against the f64 reference (measured: 7e-5 at most, where a key near a rounding
/// boundary lands on the other f16 than the reference's).
const BAR_ROUNDED: f64 = 1e-4;

fn f16_gpus(count: usize) -> Option<Vec<Arc<Gpu>>> {
    let gpus = common::gpus_with(
        count,
        &GpuOptions {
            kv_cache: KvCacheType::F16,
            ..GpuOptions::default()
        },
    );
    if !gpus[0].supports_f16_weights() {
        common::feature_missing("SHADER_F16", "the f16 KV cache");
        return None;
    }
    assert!(gpus.iter().all(|g| g.kv_dtype() == DType::F16));
    Some(gpus)
}

/// Non-tile shapes: 6 heads of 10 (2 KV heads for llama) over a hidden of 60, 3 layers, a
/// vocabulary of 211.
fn config(preset: &str) -> ModelConfig {
    let base = ModelConfig::preset(preset).unwrap();
    let kv_heads = if base.kv_heads < base.heads { 2 } else { 6 };
    ModelConfig {
        name: format!("{preset}-odd"),
        heads: 6,
        kv_heads,
        head_dim: 10,
        hidden: 60,
        ffn: 148,
        layers: 3,
        vocab: 211,
        max_seq: 37,
        ..base
    }
}

/// Prefill then decode on `engine`, every step's logits against the rounding reference (within
/// [`BAR_ROUNDED`]) and the exact one (further off, but within f16's bar). Returns the largest
/// error against the exact reference, which shows the cache really is f16.
fn check(engine: &mut dyn Engine, weights: &ModelWeights, what: &str) -> f64 {
    let (batch, seq) = (3, 11);
    let prompts = common::prompts(batch, seq, weights.config.vocab, 21);
    let mut rounded = CpuReference::new(weights).with_f16_cache();
    let mut exact = CpuReference::new(weights);
    let mut got = engine.prefill(&prompts).unwrap();
    let mut want = rounded.prefill(&prompts).unwrap().concat();
    let mut want_exact = exact.prefill(&prompts).unwrap().concat();
    let (mut worst, mut worst_exact) = (0.0f64, 0.0f64);
    for step in 0..=DECODE_STEPS {
        assert_eq!(got.data.len(), batch * weights.config.vocab, "{what}");
        let err = got.relative_error(&want);
        assert!(
            err <= BAR_ROUNDED,
            "{what} step {step}: {err:.2e} against the f16-cache reference"
        );
        let err_exact = got.relative_error(&want_exact);
        assert!(
            err_exact <= 1e-2,
            "{what} step {step}: {err_exact:.2e} against f32"
        );
        worst = worst.max(err);
        worst_exact = worst_exact.max(err_exact);
        if step == DECODE_STEPS {
            eprintln!("{what}: {worst:.2e} against the f16-cache reference, {worst_exact:.2e} against f32");
            break;
        }
        let next = Logits {
            batch,
            vocab: weights.config.vocab,
            data: want.clone(),
        }
        .argmax();
        got = engine.decode(&next).unwrap();
        want = rounded.decode(&next).unwrap().concat();
        want_exact = exact.decode(&next).unwrap().concat();
    }
    worst_exact
}

#[test]
fn f16_cache_matches_the_rounding_reference_on_single_tp_and_pp() {
    let Some(gpus) = f16_gpus(2) else { return };
    for preset in ["tiny-llama", "tiny-gpt2"] {
        let config = config(preset);
        let weights = ModelWeights::synthetic(&config, 5);
        let mut single = SingleEngine::new(gpus[0].clone(), &weights, DType::F32).unwrap();
        let mut tp =
            TensorParallelEngine::new(&gpus, &weights, DType::F32, None, CommConfig::default())
                .unwrap();
        let mut pp = PipelineEngine::new(
            &gpus,
            &weights,
            DType::F32,
            &Partition::Explicit(vec![2, 1]),
            1,
            CommConfig::default(),
        )
        .unwrap();
        let engines: [(&mut dyn Engine, &str); 3] =
            [(&mut single, "single"), (&mut tp, "tp"), (&mut pp, "pp")];
        for (engine, name) in engines {
            let off = check(engine, &weights, &format!("{preset} {name}"));
            // An f32 cache would sit within 1e-4 of the exact reference.
            assert!(
                off > 1e-4,
                "{preset} {name}: {off:.2e}: the cache is not f16"
            );
        }
    }
}

/// Bytes a model part's cache takes on `gpu`: what `kv_cache` adds to the device's count.
fn cache_bytes(gpu: &Arc<Gpu>, weights: &ModelWeights, slots: usize) -> u64 {
    let placement = Placement::whole(&weights.config);
    let model = GpuModel::upload(gpu.clone(), weights, placement, DType::F32).unwrap();
    let before = gpu.bytes_allocated();
    let cache = model.kv_cache(slots).unwrap();
    assert_eq!(cache.slots(), slots);
    gpu.bytes_allocated() - before
}

#[test]
fn an_f16_cache_takes_half_the_bytes() {
    let Some(f16) = f16_gpus(1) else { return };
    let f32 = common::gpus(1);
    assert_eq!(
        f32[0].kv_dtype(),
        DType::F32,
        "the library's default is f32"
    );
    let config = config("tiny-llama");
    let weights = ModelWeights::synthetic(&config, 2);
    let slots = 3;
    let elements =
        (config.layers * 2 * slots * config.kv_heads * config.max_seq * config.head_dim) as u64;
    // Beside the keys and values, the cache's block table: a u32 per block of each slot.
    let table = (slots * wgpar::parallel::blocks_per_slot(config.max_seq) * 4) as u64;
    let full = cache_bytes(&f32[0], &weights, slots);
    let half = cache_bytes(&f16[0], &weights, slots);
    assert_eq!(full, 4 * elements + table, "f32 cache bytes");
    assert_eq!(half, 2 * elements + table, "f16 cache bytes");
    assert_eq!(2 * (half - table), full - table);
}

/// A Vulkan adapter with SHADER_F16 and a GL one without (lavapipe and llvmpipe); CI must have
/// both, elsewhere the test says it is skipped.
fn vulkan_and_gl(adapters: &Adapters) -> Option<(&AdapterDesc, &AdapterDesc)> {
    let list = adapters.list();
    let vk = list.iter().find(|a| a.backend == "Vulkan" && a.shader_f16);
    let gl = list.iter().find(|a| a.backend == "Gl" && !a.shader_f16);
    if vk.is_none() || gl.is_none() {
        assert!(
            std::env::var("CI").is_err(),
            "CI must have a Vulkan adapter with SHADER_F16 and a GL adapter without"
        );
        eprintln!("skipped: needs a Vulkan and a GL adapter");
    }
    Some((vk?, gl?))
}

/// `auto` over lavapipe Vulkan (SHADER_F16) and llvmpipe GL (none): each device decides, the
/// pipeline runs across them, and `f16` refuses to open the GL device, naming it.
#[test]
fn auto_stores_f16_only_where_the_adapter_can() {
    let adapters = Adapters::discover().unwrap();
    let Some((vk, gl)) = vulkan_and_gl(&adapters) else {
        return;
    };
    let pair = DeviceSelection::Indices(vec![vk.index, gl.index]);
    let options = |kv_cache| GpuOptions {
        kv_cache,
        ..GpuOptions::default()
    };
    let gpus = open_devices(&adapters, &pair, &options(KvCacheType::Auto)).unwrap();
    let types: Vec<DType> = gpus.iter().map(|g| g.kv_dtype()).collect();
    assert_eq!(types, [DType::F16, DType::F32]);
    let config = config("tiny-gpt2");
    let weights = ModelWeights::synthetic(&config, 9);
    let mut pp = PipelineEngine::new(
        &gpus,
        &weights,
        DType::F32,
        &Partition::Explicit(vec![2, 1]),
        1,
        CommConfig::default(),
    )
    .unwrap();
    let prompts = common::prompts(2, 7, config.vocab, 4);
    let got = pp.prefill(&prompts).unwrap();
    let want = CpuReference::new(&weights)
        .prefill(&prompts)
        .unwrap()
        .concat();
    let err = got.relative_error(&want);
    assert!(
        err > 0.0 && err <= 1e-2,
        "mixed caches against f32: {err:.2e}"
    );
    let e = open_devices(&adapters, &pair, &options(KvCacheType::F16))
        .unwrap_err()
        .to_string();
    assert!(e.contains("SHADER_F16") && e.contains(&gl.label()), "{e}");
}

/// The command line: `auto` is the default and says what each device stores; `f16` on an
/// adapter without SHADER_F16 is refused before anything opens, naming it.
#[test]
fn the_command_line_says_and_checks_the_kv_type() {
    let adapters = Adapters::discover().unwrap();
    let Some((vk, gl)) = vulkan_and_gl(&adapters) else {
        return;
    };
    let run = |extra: &[&str]| {
        let base = [
            "run",
            "--model",
            "tiny-llama",
            "--prompt-len",
            "5",
            "--gen",
            "3",
        ];
        let (ok, out, err) = common::wgpar(&[&base[..], extra].concat());
        assert!(ok, "{extra:?}: {err}");
        out
    };
    let vk_index = vk.index.to_string();
    let out = run(&["--devices", &vk_index]);
    assert!(out.contains("F16 KV cache"), "{out}");
    let out = run(&["--devices", &vk_index, "--kv-dtype", "f32"]);
    assert!(out.contains("F32 KV cache"), "{out}");
    let pair = format!("{},{}", vk.index, gl.index);
    let out = run(&["--devices", &pair, "--strategy", "pp"]);
    assert!(out.contains("KV cache F16 on gpu0, F32 on gpu1"), "{out}");
    let start = std::time::Instant::now();
    let (ok, _, err) = common::wgpar(&["run", "--devices", &pair, "--kv-dtype", "f16"]);
    assert!(!ok);
    let named = format!("adapter {} ({})", gl.index, gl.label());
    assert!(
        err.contains("--kv-dtype f16") && err.contains(&named),
        "{err}"
    );
    assert!(
        start.elapsed() < std::time::Duration::from_secs(5),
        "refused late"
    );
}
