//! The calibration library API: a quick calibration of two devices on one adapter writes its
//! figures to the given log and returns a validated profile; bad options are errors; a model
//! with sliding-window layers is charged its windows.

mod common;

use wgpar::calibrate::{calibrate, CalibrationOptions};
use wgpar::device::DType;
use wgpar::model::{ModelConfig, ModelWeights, ShardSpec, Step};
use wgpar::parallel::cost;

fn options() -> CalibrationOptions {
    CalibrationOptions {
        batch: 2,
        prompt_len: 8,
        max_bytes: 64 << 10,
        iters: 2,
        quick: true,
        name: "api-test".into(),
    }
}

#[test]
fn quick_calibration_logs_and_returns_a_profile() {
    let gpus = common::gpus(2);
    let weights = ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 1);
    let mut log = Vec::new();
    let c = calibrate(&gpus, &weights, &options(), &mut log).unwrap();
    let text = String::from_utf8(log).unwrap();
    for section in [
        "host links",
        "submissions of n dispatches",
        "us per submission and its wait",
        "model blocks",
        "shared processor",
        "host reduce rate",
        "fixed cost per host-staged collective",
    ] {
        assert!(text.contains(section), "`{section}` missing:\n{text}");
    }
    let p = &c.profile;
    assert_eq!((p.name.as_str(), p.device_count()), ("api-test", 2));
    let sharing = p.devices[0].compute_sharing.as_ref().unwrap();
    assert_eq!(sharing.slowdown_curve.len(), 2);
    assert!(c.note.contains("tiny-llama"), "{}", c.note);
}

#[test]
fn bad_options_are_errors_that_name_them() {
    let gpus = common::gpus(1);
    let weights = ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 1);
    let cases = [
        (
            CalibrationOptions {
                iters: 0,
                ..options()
            },
            "--iters",
        ),
        (
            CalibrationOptions {
                max_bytes: 300,
                ..options()
            },
            "--max-bytes 300",
        ),
        (
            CalibrationOptions {
                prompt_len: 10_000,
                ..options()
            },
            "--prompt-len 10000",
        ),
    ];
    for (opts, needle) in cases {
        let e = calibrate(&gpus, &weights, &opts, &mut std::io::sink())
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{e}");
    }
    let e = calibrate(&[], &weights, &options(), &mut std::io::sink())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("devices to calibrate: 0 given, at least 1 needed"),
        "{e}"
    );
}

/// The model-block table's row for `step` (the model's own width, the first table): its
/// attention and whole-layer intensities (flop/B).
fn logged_intensities(log: &str, step: &str) -> (f64, f64) {
    let table = log
        .split("model blocks")
        .nth(1)
        .expect("no model blocks table");
    let row = table
        .lines()
        .find(|l| l.trim_start().starts_with(step))
        .unwrap_or_else(|| panic!("no row `{step}`:\n{log}"));
    let cols: Vec<f64> = row.trim_start()[step.len()..]
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    (cols[1], cols[4])
}

/// Summed attention-half and whole-layer flops per byte of every layer of `c` at `step`, as
/// the engines charge their spans (`parallel::cost`).
fn charged(c: &ModelConfig, step: &Step) -> (f64, f64) {
    let shard = ShardSpec::full(c);
    let (mut a, mut l) = ([0u64; 2], [0u64; 2]);
    for layer in 0..c.layers {
        let at = cost::layer_attention(c, &shard, step, DType::F32, layer);
        let m = cost::mlp(c, &shard, step, DType::F32);
        a = [a[0] + at.flops, a[1] + at.bytes];
        l = [l[0] + at.flops + m.flops, l[1] + at.bytes + m.bytes];
    }
    (a[0] as f64 / a[1] as f64, l[0] as f64 / l[1] as f64)
}

/// Issue 37: calibrating a model with sliding-window layers (tiny-gemma3, window 5) at a
/// prompt past the window divides the measured blocks' times by the work of the keys each
/// layer attends, its window on a sliding one, and times the bare kernel over that window too.
#[test]
fn a_sliding_window_model_is_calibrated_with_its_windows_charged() {
    let gemma = ModelConfig::preset("tiny-gemma3").unwrap();
    let window = gemma.sliding.as_ref().unwrap().window;
    let options = CalibrationOptions {
        batch: 1,
        prompt_len: 64,
        ..options()
    };
    assert!(options.prompt_len > window);
    let gpus = common::gpus(1);
    let mut log = Vec::new();
    calibrate(
        &gpus,
        &ModelWeights::synthetic(&gemma, 1),
        &options,
        &mut log,
    )
    .unwrap();
    let text = String::from_utf8(log).unwrap();
    assert!(
        text.contains(&format!("over 65 positions, sliding window {window}")),
        "{text}"
    );
    let plain = ModelConfig {
        sliding: None,
        ..gemma.clone()
    };
    let mut compared = 0;
    for (label, step) in [
        (
            "decode 1x1 (+64)",
            Step {
                batch: 1,
                seq: 1,
                past: 64,
            },
        ),
        // A ring model takes the 64-token prompt in chunks of its ring step (16): calibration
        // times the last chunk, as the engines run it.
        (
            "prefill 1x16 (+48)",
            Step {
                batch: 1,
                seq: 16,
                past: 48,
            },
        ),
    ] {
        let logged = logged_intensities(&text, label);
        let (windowed, whole) = (charged(&gemma, &step), charged(&plain, &step));
        // Printed with two decimals; the windowless charge must be told apart from it.
        for (got, want, without) in [
            (logged.0, windowed.0, whole.0),
            (logged.1, windowed.1, whole.1),
        ] {
            assert!((got - want).abs() <= 0.006, "{label}: {got} against {want}");
            assert!(
                (got - without).abs() > 0.02,
                "{label}: {got} against {without}"
            );
            compared += 1;
        }
    }
    assert_eq!(compared, 4);
}
