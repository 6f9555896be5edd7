//! `wgpar project` end to end: record a tiny pipeline run with `wgpar run --trace`, replay it
//! on shipped and calibrated profiles, and draw it.

mod common;

use std::path::PathBuf;

use common::{scratch, wgpar};
use wgpar::trace::Timeline;

fn record_pipeline(dir: &std::path::Path) -> PathBuf {
    let trace = dir.join("pp.json");
    let (ok, stdout, stderr) = wgpar(&[
        "run",
        "--model",
        "tiny-llama",
        "--strategy",
        "pp",
        "--virtual",
        "2",
        "--micro-batches",
        "2",
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--gen",
        "3",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(ok, "run failed:\n{stdout}\n{stderr}");
    trace
}

#[test]
fn a_recorded_pipeline_run_projects_onto_shipped_and_calibrated_profiles() {
    let dir = scratch("project");
    let trace = record_pipeline(&dir);
    let trace_s = trace.to_str().unwrap();
    let recorded = Timeline::read_chrome_trace(&trace).unwrap();
    // Prefill (alone), then generate: prefill and two decode steps; the pipeline engine also
    // leaves short idle instants inside a step (between a stage's compute and its download).
    assert!(recorded.steps().len() >= 4, "{:?}", recorded.steps());
    // What ran, for readers and for throughput: 2 sequences x (8 + 8 prompt tokens + 2 decode
    // steps) = 36 tokens processed.
    let meta = |k: &str| recorded.meta.get(k).map(String::as_str);
    assert_eq!(meta("tokens"), Some("36"));
    assert_eq!(meta("model"), Some("tiny-llama"));
    assert_eq!(
        (meta("batch"), meta("prompt_len"), meta("gen")),
        (Some("2"), Some("8"), Some("3"))
    );
    assert!(meta("strategy").is_some_and(|s| !s.is_empty()));
    assert!(meta("adapters").is_some_and(|s| !s.is_empty()));

    let (ok, stdout, stderr) = wgpar(&[
        "project",
        "--trace",
        trace_s,
        "--host",
        "pcie4-2gpu",
        "--json",
        "--tokens",
        "22",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let r = &v["report"];
    assert_eq!(r["profile"], "pcie4-2gpu");
    assert_eq!(r["devices_used"], 2);
    let measured = r["measured"]["makespan_us"].as_f64().unwrap();
    assert!((measured - recorded.makespan_us()).abs() < 1e-6);
    let projected = r["projected"]["makespan_us"].as_f64().unwrap();
    // Whether the profiled box beats this adapter depends on the adapter (a CPU driver loses,
    // a GPU may not): check what holds on any, that both runs are timed and the throughput
    // is the tokens over each makespan.
    assert!(projected > 0.0 && projected.is_finite(), "{projected}");
    let bubble = r["projected"]["bubble_share"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&bubble));
    let tp = &v["throughput"];
    assert_eq!(tp["tokens"], 22);
    for (key, makespan_us) in [
        ("projected_tokens_per_s", projected),
        ("measured_tokens_per_s", measured),
    ] {
        let rate = tp[key].as_f64().unwrap();
        let want = 22.0 / (makespan_us * 1e-6);
        assert!((rate / want - 1.0).abs() < 1e-6, "{key}: {rate} vs {want}");
    }

    // Onto this machine, calibrated: a table, a projected trace and both pictures of step 0.
    let cal = dir.join("cal.toml");
    let (ok, out, err) = wgpar(&[
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
        cal.to_str().unwrap(),
    ]);
    assert!(ok, "{out}\n{err}");
    let (out_trace, svg, svg_p) = (dir.join("proj.json"), dir.join("m.svg"), dir.join("p.svg"));
    let (ok, stdout, stderr) = wgpar(&[
        "project",
        "--trace",
        trace_s,
        "--host",
        cal.to_str().unwrap(),
        "--out",
        out_trace.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
        "--svg-projected",
        svg_p.to_str().unwrap(),
        "--step",
        "0",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    for needle in [
        "makespan",
        "bubble share",
        "comm share",
        "latency (makespan)",
        // Tokens from the trace's metadata, no --tokens needed.
        "throughput (36 tokens)",
    ] {
        assert!(stdout.contains(needle), "`{needle}` missing:\n{stdout}");
    }
    let projected = Timeline::read_chrome_trace(&out_trace).unwrap();
    assert_eq!(projected.spans.len(), recorded.spans.len());
    assert_eq!(
        projected.meta.get("projected_onto").map(String::as_str),
        Some("this-machine")
    );
    for file in [&svg, &svg_p] {
        let text = std::fs::read_to_string(file).unwrap();
        assert!(
            text.starts_with("<svg") && text.contains(">gpu0<"),
            "{text}"
        );
    }
    // Step 0 starts with stage 0's first micro-batch: only part of the run is drawn.
    let text = std::fs::read_to_string(&svg).unwrap();
    let boxes = text.matches("<title>").count();
    assert!(boxes >= 1 && boxes < recorded.spans.len(), "{boxes}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn an_empty_trace_and_an_unknown_engine_are_refused_with_the_reason() {
    let dir = scratch("project-empty");
    let empty = dir.join("empty.json");
    Timeline::new().write_chrome_trace(&empty).unwrap();
    let (ok, stdout, stderr) = wgpar(&[
        "project",
        "--trace",
        empty.to_str().unwrap(),
        "--host",
        "pcie4-2gpu",
    ]);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("no spans") && stderr.contains("--trace"),
        "{stderr}"
    );
    let trace = record_pipeline(&dir);
    let (ok, _, stderr) = wgpar(&[
        "project",
        "--trace",
        trace.to_str().unwrap(),
        "--host",
        "pcie4-2gpu",
        "--engine",
        "tensorrt",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("tensorrt") && stderr.contains("cuda-nccl"),
        "{stderr}"
    );
    // The same run as CUDA + NCCL would run it on a DGX: its all-reduces... none here (a
    // pipeline), but its arithmetic on tensor cores makes it faster than wgpar's.
    let time = |engine: &str| {
        let (ok, stdout, stderr) = wgpar(&[
            "project",
            "--trace",
            trace.to_str().unwrap(),
            "--host",
            "dgx-h100",
            "--engine",
            engine,
            "--json",
        ]);
        assert!(ok, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(
            v["report"]["engine"],
            if engine == "wgpar" {
                "wgpar"
            } else {
                "CUDA+NCCL"
            }
        );
        v["report"]["projected"]["makespan_us"].as_f64().unwrap()
    };
    assert!(time("cuda-nccl") < time("wgpar"));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_inputs_are_errors_with_the_reason() {
    let dir = scratch("project-bad");
    let missing = dir.join("nope.json");
    let (ok, _, stderr) = wgpar(&[
        "project",
        "--trace",
        missing.to_str().unwrap(),
        "--host",
        "dgx-h100",
    ]);
    assert!(!ok);
    assert!(stderr.contains("nope.json"), "{stderr}");

    let trace = record_pipeline(&dir);
    let (ok, _, stderr) = wgpar(&[
        "project",
        "--trace",
        trace.to_str().unwrap(),
        "--host",
        "no-such-host",
    ]);
    assert!(!ok);
    assert!(stderr.contains("no-such-host"), "{stderr}");
    let (ok, _, stderr) = wgpar(&[
        "project",
        "--trace",
        trace.to_str().unwrap(),
        "--host",
        "pcie4-2gpu",
        "--svg",
        dir.join("x.svg").to_str().unwrap(),
        "--step",
        "99",
    ]);
    assert!(!ok);
    assert!(stderr.contains("--step 99"), "{stderr}");
    let (ok, _, stderr) = wgpar(&[
        "project",
        "--trace",
        trace.to_str().unwrap(),
        "--host",
        "pcie4-2gpu",
        "--svg-size",
        "0x10",
    ]);
    assert!(!ok);
    assert!(stderr.contains("WIDTHxHEIGHT"), "{stderr}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bench_projection_records_calibrates_and_projects_every_pair() {
    let dir = scratch("bench-projection");
    let out = dir.join("out");
    let (ok, stdout, stderr) = wgpar(&[
        "bench",
        "projection",
        "--model",
        "tiny-llama",
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--gen",
        "2",
        "--rounds",
        "2",
        "--quick",
        "--configs",
        "single,pp2-m2,tp4",
        // The calibration shape, and another model and shape it never saw.
        "--runs",
        "tiny-llama:2x8,tiny-gpt2:2x12",
        "--out-dir",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    // TP over 4 splits neither model's 6 heads: skipped and listed, not run.
    assert_eq!(rows.len(), 4);
    assert_eq!(v["skipped"].as_array().unwrap().len(), 2, "{v}");
    let sample: Vec<(String, bool)> = rows
        .iter()
        .map(|r| {
            (
                r["workload"]["model"].as_str().unwrap().to_owned(),
                r["in_sample"].as_bool().unwrap(),
            )
        })
        .collect();
    assert!(sample.contains(&("tiny-llama".into(), true)), "{sample:?}");
    assert!(sample.contains(&("tiny-gpt2".into(), false)), "{sample:?}");
    for row in rows {
        // Two runs onto two calibrations.
        let pairs = row["pairs"].as_array().unwrap();
        assert_eq!(pairs.len(), 4);
        for p in pairs {
            let (m, pr) = (
                p["measured_ms"].as_f64().unwrap(),
                p["projected_ms"].as_f64().unwrap(),
            );
            assert!(m > 0.0 && pr > 0.0);
            let e = p["error_pct"].as_f64().unwrap();
            assert!(((pr - m) / m * 100.0 - e).abs() < 1e-9);
        }
        let e = row["error_pct_median"].as_f64().unwrap();
        let [lo, hi] = [0, 1].map(|i| row["error_pct_range"][i].as_f64().unwrap());
        assert!(lo <= e && e <= hi);
        assert_eq!(row["within_tolerance"], e.abs() <= 15.0);
    }
    // Per configuration, the out-of-sample pairs only: tiny-gpt2's, one workload each.
    let summary = v["out_of_sample"].as_array().unwrap();
    let configs: Vec<&str> = summary
        .iter()
        .map(|c| c["config"].as_str().unwrap())
        .collect();
    assert_eq!(configs, ["single", "pp2-m2"], "{v}");
    for c in summary {
        assert_eq!(
            (c["workloads"].as_u64(), c["pairs"].as_u64()),
            (Some(1), Some(4))
        );
        let row = rows
            .iter()
            .find(|r| r["config"]["name"] == c["config"] && r["in_sample"] == false)
            .unwrap();
        let mut magnitudes: Vec<f64> = row["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["error_pct"].as_f64().unwrap().abs())
            .collect();
        magnitudes.sort_by(f64::total_cmp);
        let expected = (magnitudes[1] + magnitudes[2]) / 2.0;
        let got = c["abs_error_pct_median"].as_f64().unwrap();
        assert!((got - expected).abs() < 1e-9, "{got} vs {expected}");
        assert_eq!(c["error_pct_median"], row["error_pct_median"]);
        assert_eq!(c["within_tolerance"], got <= 15.0);
    }
    for file in [
        "cal0.toml",
        "cal1.toml",
        "tiny-llama_2x8.single.r0.json",
        "tiny-gpt2_2x12.pp2-m2.r1.json",
    ] {
        assert!(out.join(file).is_file(), "{file} missing");
    }

    let (ok, _, stderr) = wgpar(&["bench", "projection", "--configs", "pp2"]);
    assert!(!ok);
    assert!(stderr.contains("bad configuration 'pp2'"), "{stderr}");
    let (ok, _, stderr) = wgpar(&["bench", "projection", "--runs", "tiny-gpt2:4"]);
    assert!(!ok);
    assert!(stderr.contains("MODEL:BATCHxPROMPT"), "{stderr}");
    std::fs::remove_dir_all(dir).ok();
}
