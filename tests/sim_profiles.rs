//! Host profiles: every shipped file parses, and broken files are reported with file, line and
//! field.

use std::path::Path;

use wgpar::sim::{HostProfile, ProfileError, SHIPPED_PROFILES};

#[test]
fn every_file_in_hosts_parses_and_is_shipped() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("hosts");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        // A profile `wgpar calibrate` wrote here (its default output) describes this machine,
        // not a shipped one.
        .filter(|p| {
            !std::fs::read_to_string(p)
                .unwrap_or_default()
                .starts_with("# Calibrated profile written by `wgpar calibrate`.")
        })
        .map(|p| {
            let profile = HostProfile::load(&p).unwrap_or_else(|e| panic!("{e}"));
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            // The name inside the file matches the file name, so `--profile` finds it.
            assert_eq!(profile.name, stem);
            stem
        })
        .collect();
    on_disk.sort();
    let mut shipped: Vec<String> = SHIPPED_PROFILES
        .iter()
        .map(|(n, _)| n.to_string())
        .collect();
    shipped.sort();
    assert_eq!(on_disk, shipped);
    for required in [
        "pcie3-2gpu",
        "pcie4-2gpu",
        "pcie4-4gpu",
        "pcie5-workstation",
        "dgx-a100",
        "dgx-h100",
        "laptop-igpu-dgpu",
        "apple-m-unified",
        "2node-ib200",
        "2node-dgx-h100",
    ] {
        assert!(shipped.iter().any(|s| s == required), "{required} missing");
    }
}

#[test]
fn shipped_profiles_have_the_expected_shape() {
    let a100 = HostProfile::shipped("dgx-a100").unwrap();
    assert_eq!(a100.device_count(), 8);
    // Hardware figures: NVLink3's 300 GB/s per direction (what NCCL reaches of it is the
    // engine's efficiency), and no in-switch reduction on the A100's NVSwitch.
    assert_eq!(a100.device_link.as_ref().map(|l| l.beta_gbps), Some(300.0));
    assert_eq!(a100.device_link.as_ref().map(|l| l.nvls), Some(false));
    assert_eq!(a100.devices[0].f16_tensor_tflops, Some(312.0));
    let h100 = HostProfile::shipped("dgx-h100").unwrap();
    assert_eq!(h100.device_link.as_ref().map(|l| l.nvls), Some(true));
    assert_eq!(a100.devices[0].f32_tflops, 19.5);
    let ib = HostProfile::shipped("2node-ib200").unwrap();
    assert_eq!((ib.nodes, ib.device_count()), (2, 8));
    assert_eq!(ib.network.as_ref().map(|n| n.beta_gbps), Some(25.0));
    assert_eq!(ib.network.as_ref().and_then(|n| n.nics_per_node), Some(1));
    let dgx2 = HostProfile::shipped("2node-dgx-h100").unwrap();
    assert_eq!((dgx2.nodes, dgx2.device_count()), (2, 16));
    assert_eq!(dgx2.device_link.as_ref().map(|l| l.nvls), Some(true));
    assert_eq!(dgx2.network.as_ref().map(|n| n.beta_gbps), Some(50.0));
    assert_eq!(dgx2.network.as_ref().and_then(|n| n.nics_per_node), Some(8));
    let pcie3 = HostProfile::shipped("pcie3-2gpu").unwrap();
    assert_eq!(pcie3.devices[0].host_link.d2h.beta_gbps, 12.0);
    assert!(pcie3.device_link.is_none());
    let laptop = HostProfile::shipped("laptop-igpu-dgpu").unwrap();
    assert_eq!(laptop.device_count(), 2);
    assert_ne!(
        laptop.device(0).unwrap().name,
        laptop.device(1).unwrap().name
    );
    assert!(HostProfile::resolve("hosts/dgx-h100.toml").is_ok());
    assert!(HostProfile::resolve("dgx-h100").is_ok());
    let err = HostProfile::resolve("no-such-machine").unwrap_err();
    assert!(err.to_string().contains("pcie4-2gpu"), "{err}");
}

/// The profiles docs/VALIDATION.md projects onto parse, and source every figure too.
#[test]
fn validation_profiles_parse_and_source_their_figures() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("hosts/validation");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let profile = HostProfile::load(&p).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(profile.name, p.file_stem().unwrap().to_string_lossy());
            let text = std::fs::read_to_string(&p).unwrap();
            check_sources(&profile.name, &text);
            n += 1;
        }
    }
    assert!(n >= 2, "{n} validation profiles");
}

/// Every numeric constant line in a shipped profile is preceded by a comment naming its source.
#[test]
fn every_constant_has_a_source_comment() {
    for (name, text) in SHIPPED_PROFILES {
        check_sources(name, text);
    }
}

fn check_sources(name: &str, text: &str) {
    {
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim();
            if t.starts_with('#') {
                continue;
            }
            let numeric = t
                .split_once('=')
                .map(|(k, v)| {
                    let v = v.trim();
                    !k.trim().is_empty()
                        && (v.starts_with(|c: char| c.is_ascii_digit()) || v.starts_with('{'))
                })
                .unwrap_or(false);
            // `nodes` and `count` describe the machine itself, not a measured figure.
            let structural = t.starts_with("nodes") || t.starts_with("count");
            if numeric && !structural {
                assert!(
                    i > 0 && lines[i - 1].trim_start().starts_with('#'),
                    "{name}.toml line {}: `{t}` has no source comment above it",
                    i + 1
                );
            }
        }
    }
}

fn base() -> String {
    HostProfile::shipped("pcie4-2gpu")
        .unwrap()
        .to_toml_string()
        .unwrap()
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn bad_field_type_names_file_line_and_field() {
    let text = base().replace("memory_gbps = 936.0", "memory_gbps = \"fast\"");
    let line = line_of(&text, "\"fast\"");
    let err = HostProfile::from_toml_str(&text, "bad.toml").unwrap_err();
    match &err {
        ProfileError::Parse { at, field, .. } => {
            assert_eq!(at.file, "bad.toml");
            assert_eq!(at.line, Some(line));
            assert_eq!(field, "devices[0].memory_gbps");
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("bad.toml:{line}:")), "{msg}");
    assert!(msg.contains("devices[0].memory_gbps"), "{msg}");
}

#[test]
fn missing_field_names_the_field_and_its_table() {
    let text = base().replace("f16_tflops = 35.6\n", "");
    let err = HostProfile::from_toml_str(&text, "missing.toml").unwrap_err();
    assert_eq!(err.field(), Some("devices[0].f16_tflops"), "{err}");
    let at = err.location().unwrap();
    assert_eq!(at.file, "missing.toml");
    // The error points at the [[devices]] table the field is missing from.
    assert_eq!(at.line, Some(line_of(&text, "[[devices]]")), "{err}");
    assert!(err.to_string().contains("f16_tflops"));
}

#[test]
fn negative_bandwidth_is_rejected_with_its_line() {
    let text = base().replacen("beta_gbps = 25.0", "beta_gbps = -25.0", 1);
    let line = line_of(&text, "-25.0");
    let err = HostProfile::from_toml_str(&text, "neg.toml").unwrap_err();
    match &err {
        ProfileError::Invalid {
            at, field, value, ..
        } => {
            assert_eq!(at.line, Some(line));
            assert_eq!(field, "devices[0].host_link.h2d.beta_gbps");
            assert_eq!(value, "-25");
        }
        other => panic!("expected a validation error, got {other:?}"),
    }
    assert!(
        err.to_string().contains(&format!("neg.toml:{line}")),
        "{err}"
    );
}

#[test]
fn zero_bandwidth_and_zero_count_are_rejected() {
    let text = base().replace("memory_gbps = 936.0", "memory_gbps = 0");
    let err = HostProfile::from_toml_str(&text, "z.toml").unwrap_err();
    assert_eq!(err.field(), Some("devices[0].memory_gbps"));
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "memory_gbps = 0"))
    );

    let text = base().replace("count = 2", "count = 0");
    let err = HostProfile::from_toml_str(&text, "c.toml").unwrap_err();
    assert_eq!(err.field(), Some("devices[0].count"));
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "count = 0"))
    );
    assert!(err.to_string().contains("at least 1"), "{err}");
}

#[test]
fn syntax_error_names_the_line_and_key() {
    let text = "name = \"x\"\nnodes = 1\n[host]\nname = \"cpu\"\nmemory_gbps = 12 GB\n";
    let err = HostProfile::from_toml_str(text, "syntax.toml").unwrap_err();
    assert_eq!(err.location().unwrap().line, Some(5), "{err}");
    assert_eq!(err.field(), Some("host.memory_gbps"));
}

#[test]
fn unknown_field_is_rejected() {
    let text = base().replace("f16_tflops = 35.6", "f16_tflops = 35.6\nf8_tflops = 1.0");
    let err = HostProfile::from_toml_str(&text, "u.toml").unwrap_err();
    assert_eq!(err.field(), Some("devices[0].f8_tflops"), "{err}");
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "f8_tflops")),
        "{err}"
    );
}

#[test]
fn implausible_figures_are_rejected_with_their_line() {
    // A bandwidth of 1e-300 GB/s once printed a 300-digit makespan.
    let text = base().replacen("beta_gbps = 25.0", "beta_gbps = 1e-300", 1);
    let err = HostProfile::from_toml_str(&text, "tiny.toml").unwrap_err();
    assert_eq!(
        err.field(),
        Some("devices[0].host_link.h2d.beta_gbps"),
        "{err}"
    );
    assert_eq!(err.location().unwrap().line, Some(line_of(&text, "1e-300")));
    assert!(err.to_string().contains("GB/s"), "{err}");
    for (from, to, field) in [
        (
            "f32_tflops = 35.6",
            "f32_tflops = 1e9",
            "devices[0].f32_tflops",
        ),
        (
            "alpha_us = 10.0",
            "alpha_us = 1e12",
            "devices[0].host_link.h2d.alpha_us",
        ),
        (
            "memory_gbps = 936.0",
            "memory_gbps = 1e30",
            "devices[0].memory_gbps",
        ),
        (
            "launch_overhead_us = 5.0",
            "launch_overhead_us = -1",
            "devices[0].launch_overhead_us",
        ),
    ] {
        let text = base().replacen(from, to, 1);
        let err = HostProfile::from_toml_str(&text, "x.toml").unwrap_err();
        assert_eq!(err.field(), Some(field), "{from}: {err}");
        assert!(err.location().unwrap().line.is_some(), "{err}");
    }
}

#[test]
fn processor_sharing_cannot_span_more_devices_than_the_group_has() {
    let text = base().replace(
        "[devices.host_link]",
        "[devices.compute_sharing]\nshared_by = 3\n\n[devices.host_link]",
    );
    let err = HostProfile::from_toml_str(&text, "s.toml").unwrap_err();
    assert_eq!(
        err.field(),
        Some("devices[0].compute_sharing.shared_by"),
        "{err}"
    );
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "shared_by = 3"))
    );
    assert!(err.to_string().contains("device count"), "{err}");
    let ok = base().replace(
        "[devices.host_link]",
        "[devices.compute_sharing]\nshared_by = 2\n\n[devices.host_link]",
    );
    assert!(HostProfile::from_toml_str(&ok, "s.toml").is_ok());
}

#[test]
fn unreadable_file_is_an_io_error() {
    let err = HostProfile::load("/nonexistent/x.toml").unwrap_err();
    assert!(matches!(err, ProfileError::Io { .. }));
}
