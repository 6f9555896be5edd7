//! Environment switches and the tuning cache through the command line (issue 29: the switches
//! are checked before a device opens, items 17 and 18: a stale or unwritable cache).

mod common;

use std::process::Command;

fn wgpar_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const TINY_RUN: [&str; 9] = [
    "run",
    "--model",
    "tiny-gpt2",
    "--batch",
    "1",
    "--prompt-len",
    "4",
    "--gen",
    "2",
];

/// Every switch with a value it does not know is refused, naming the variable and the value,
/// before the model banner (so before a device opens or a weight is built).
#[test]
fn bad_switches_are_refused_before_anything_runs() {
    let cases = [
        ("WGPAR_TUNE", "sometimes"),
        ("WGPAR_KERNELS", "gemv_wg64,nope"),
        ("WGPAR_NO_SUBGROUPS", "maybe"),
        ("WGPAR_FORCE_F32", "2"),
        ("WGPAR_CHECKED_SHADERS", "yes please"),
    ];
    for (name, value) in cases {
        for args in [
            &TINY_RUN[..],
            &["allreduce", "--virtual", "2"],
            &["devices"],
        ] {
            let (ok, out, err) = wgpar_env(args, &[(name, value)]);
            assert!(!ok, "{name}={value} {args:?}: exit 0");
            assert!(out.is_empty(), "{name}={value} {args:?}: printed {out}");
            assert!(
                err.contains(name) && err.contains(value.split(',').next_back().unwrap()),
                "{name}={value}: {err}"
            );
        }
    }
    // Accepted spellings run.
    let (ok, out, err) = wgpar_env(&["devices"], &[("WGPAR_NO_SUBGROUPS", "true")]);
    assert!(ok, "{out}{err}");
}

/// Item 18: a cache folder that cannot be written costs one warning per run, not one per
/// tuned shape.
#[test]
fn an_unwritable_cache_warns_once() {
    let (ok, out, err) = wgpar_env(
        &TINY_RUN,
        &[("WGPAR_CACHE_DIR", "/proc"), ("WGPAR_TUNE", "retune")],
    );
    assert!(ok, "{out}{err}");
    assert_eq!(err.matches("tuning cache not saved").count(), 1, "{err}");
}

/// Item 17: a stale cache file (another wgpar version's entries, larger than the cache reads)
/// and a temporary file left by a save that was killed: the next run replaces the file with its
/// own entries, small, and removes the orphan.
#[test]
fn a_stale_cache_is_replaced_and_orphans_removed() {
    let dir = common::scratch_dir("stale-cache");
    let path = dir.join("tune.json");
    let mut stale = String::from("{\"entries\":{");
    for i in 0..60_000 {
        if i > 0 {
            stale.push(',');
        }
        stale.push_str(&format!(
            "\"lavapipe [Vulkan] | llvmpipe | wgpar 0.0.1 | matmul/{i}\":\
             {{\"variant\":\"gemv_wg64\",\"times_ms\":{{\"gemv_wg64\":1.0}}}}"
        ));
    }
    stale.push_str("}}");
    std::fs::write(&path, &stale).unwrap();
    assert!(
        stale.len() > 4 << 20,
        "the stale file must exceed the cache's read limit"
    );
    let orphan = dir.join("tune.json.4194300.tmp");
    std::fs::write(&orphan, b"{").unwrap();
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&orphan)
        .unwrap()
        .set_modified(hour_ago)
        .unwrap();

    let dir_s = dir.to_str().unwrap();
    let (ok, out, err) = wgpar_env(
        &TINY_RUN,
        &[("WGPAR_CACHE_DIR", dir_s), ("WGPAR_TUNE", "retune")],
    );
    assert!(ok, "{out}{err}");
    let text = std::fs::read_to_string(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let entries = v["entries"].as_object().unwrap();
    assert!(!entries.is_empty(), "the run saved no choice");
    // This build's keys: its version and kernel set (`kernels::tune::build_tag`).
    let version = format!("| wgpar {} |", wgpar::kernels::tune::build_tag());
    assert!(
        entries.keys().all(|k| k.contains(&version)),
        "stale entries kept: {:?}",
        entries.keys().take(3).collect::<Vec<_>>()
    );
    assert!(text.len() < 1 << 20, "the cache is {} bytes", text.len());
    assert!(!orphan.exists(), "the orphaned temporary file was kept");
}
