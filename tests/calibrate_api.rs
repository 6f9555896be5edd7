//! The calibration library API: a quick calibration of two devices on one adapter writes its
//! figures to the given log and returns a validated profile; bad options are errors.

mod common;

use wgpar::calibrate::{calibrate, CalibrationOptions};
use wgpar::model::{ModelConfig, ModelWeights};

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
