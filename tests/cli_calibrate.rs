//! `wgpar calibrate` end to end on the test adapter (lavapipe on CI): a quick sweep writes a
//! profile that parses and holds every measured figure.

mod common;

use common::{scratch, wgpar};
use wgpar::sim::HostProfile;

#[test]
fn quick_calibration_writes_a_profile_that_parses() {
    let dir = scratch("calibrate");
    let path = dir.join("nested").join("this-machine.toml");
    let path_s = path.to_str().unwrap();
    let (ok, stdout, stderr) = wgpar(&[
        "calibrate",
        "--virtual",
        "2",
        "--quick",
        "--model",
        "tiny-llama",
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--out",
        path_s,
    ]);
    assert!(ok, "calibrate failed:\n{stdout}\n{stderr}");
    for needle in [
        "device->host",
        "host->device",
        "dev->host->dev",
        "R^2",
        "per submission and its wait",
    ] {
        assert!(
            stdout.contains(needle),
            "`{needle}` missing from:\n{stdout}"
        );
    }

    let p = HostProfile::load(&path).unwrap();
    assert_eq!(p.name, "this-machine");
    assert_eq!(p.device_count(), 2);
    let d = p.device(1).unwrap();
    assert!(d.host_link.d2h.beta_gbps > 0.0 && d.host_link.h2d.beta_gbps > 0.0);
    assert!(d.launch_overhead_us > 0.0);
    // The submission's fixed cost is measured and written (it may fit to 0 on a noisy run).
    assert!(d.submit_overhead_us.is_some_and(|s| s >= 0.0));
    assert!(d.rates.elementwise_gbps.is_some_and(|g| g > 0.0));
    // Decode and prefill steps of two batch sizes: at least two distinct intensities.
    assert!(
        d.rates.matmul_curve.len() >= 2,
        "{:?}",
        d.rates.matmul_curve
    );
    assert!(d.rates.attention_curve.len() >= 2);
    // The LM head alone at each batch size: a point per size, at about half a flop per byte
    // per sequence (each f32 weight read once per step, two flops per sequence).
    assert!(
        d.rates.head_curve.len() >= 2
            && d.rates
                .head_curve
                .iter()
                .all(|p| p[0] > 0.1 && p[0] <= 1.0 && p[1] > 0.0),
        "{:?}",
        d.rates.head_curve
    );
    assert!(stdout.contains("final norm and LM head"), "{stdout}");
    let sharing = d
        .compute_sharing
        .as_ref()
        .expect("virtual devices share a processor");
    assert_eq!(sharing.shared_by, 2);
    assert_eq!(sharing.slowdown.len(), 2);
    // One row per measured step shape (--quick: prefill and decode of the batch), each the
    // intensity and then a slowdown for one and for two busy devices.
    assert_eq!(
        sharing.slowdown_curve.len(),
        2,
        "{:?}",
        sharing.slowdown_curve
    );
    assert!(sharing
        .slowdown_curve
        .iter()
        .all(|row| row.len() == 3 && row[1] == 1.0 && row[2] >= 1.0));
    assert_eq!(
        p.compute_pool_of(0).map(|x| x.0),
        p.compute_pool_of(1).map(|x| x.0)
    );
    assert_eq!(p.host.collective_overhead_us.len(), 1);
    assert!(p.host.memory_gbps > 0.0);
    // The header says where the numbers come from.
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("# Calibrated profile written by `wgpar calibrate`."));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_options_are_reported_not_panicked() {
    let (ok, _, stderr) = wgpar(&["calibrate", "--max-bytes", "300", "--out", "/dev/null"]);
    assert!(!ok);
    assert!(stderr.contains("fewer than two sizes"), "{stderr}");
    let (ok, _, stderr) = wgpar(&["calibrate", "--max-bytes", "lots"]);
    assert!(!ok);
    assert!(stderr.contains("--max-bytes"), "{stderr}");
    let (ok, _, stderr) = wgpar(&["calibrate", "--iters", "0"]);
    assert!(!ok);
    assert!(stderr.contains("must be positive"), "{stderr}");
}
