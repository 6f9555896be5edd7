//! `wgpar compare` end to end on a tiny model: every strategy runs and matches the single
//! device, projections and verdicts exist, and the report, charts and JSON are written.

mod common;

use wgpar::compare::{
    breakdown_svg, markdown, run_compare, table, throughput_svg, CompareOptions, ServingOptions,
};
use wgpar::device::DType;
use wgpar::model::ModelConfig;
use wgpar::serve::{Length, Rate};
use wgpar::sim::{Engine, HostProfile};

#[test]
fn small_comparison_end_to_end() {
    let gpus = common::gpus(4);
    let config = ModelConfig {
        layers: 4,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let opts = CompareOptions {
        config,
        dtype: DType::F32,
        batches: vec![1, 2],
        micro_batches: vec![1, 2],
        schedule: wgpar::parallel::Schedule::InFlight,
        prompt_len: 5,
        gen: 3,
        reps: 2,
        profiles: vec![
            HostProfile::resolve("pcie4-4gpu").unwrap(),
            HostProfile::resolve("dgx-h100").unwrap(),
        ],
        engines: vec![
            Engine::shipped("wgpar").unwrap(),
            Engine::shipped("cuda-nccl").unwrap(),
        ],
        seed: 3,
        serving: Some(ServingOptions {
            requests: 5,
            rate: Rate::Burst,
            prompt_len: Length::Uniform { min: 3, max: 5 },
            output_len: Length::Uniform { min: 1, max: 3 },
            max_batch: 3,
            seed: 3,
        }),
    };
    let mut calls = 0;
    let report = run_compare(&gpus, &opts, &mut |_, _, _| calls += 1).unwrap();
    let labels: Vec<&str> = report
        .measurements
        .iter()
        .map(|m| m.label.as_str())
        .collect();
    for want in ["single", "tp2", "pp2 m=1", "pp4 m=2", "tp2xpp2 m=2"] {
        assert!(labels.contains(&want), "{want} missing from {labels:?}");
    }
    // tiny-llama has 6 heads / 2 KV heads: TP=4 is not a valid degree and is not planned.
    assert!(!labels.contains(&"tp4"));
    assert!(calls > report.measurements.len());
    for m in &report.measurements {
        assert!(m.max_rel_err <= 1e-3, "{}: {}", m.label, m.max_rel_err);
        assert!(m.tg_tps.mean > 0.0 && m.pp_tps.mean > 0.0);
        // Two profiles, each as wgpar runs it and as CUDA + NCCL would.
        assert_eq!(m.projected.len(), 4, "{}", m.label);
        let expect_comm = m.family != "single";
        assert_eq!(
            m.comm_share > 0.0,
            expect_comm,
            "{} comm share {}",
            m.label,
            m.comm_share
        );
        for p in &m.projected {
            assert!(
                p.per_token_ms > 0.0 && p.ttft_ms > 0.0,
                "{} on {}",
                m.label,
                p.profile
            );
        }
    }
    // A pipeline at batch 1 cannot beat one device on latency: it runs the same layers in
    // sequence plus the hand-offs.
    for profile in ["pcie4-4gpu", "dgx-h100"] {
        let lat = |label: &str| {
            report
                .measurements
                .iter()
                .find(|m| m.label == label && m.batch == 1)
                .and_then(|m| {
                    m.projected
                        .iter()
                        .find(|p| p.profile == profile && p.engine == "wgpar")
                })
                .map(|p| p.per_token_ms)
                .unwrap()
        };
        assert!(lat("pp2 m=1") >= lat("single"), "{profile}");
    }
    // On the DGX, wgpar still stages its all-reduces through the host; CUDA + NCCL reduces in
    // the NVSwitch (NVLS); on the PCIe desktop NCCL goes through host shared memory.
    let tp2 = report
        .measurements
        .iter()
        .find(|m| m.label == "tp2" && m.batch == 2)
        .unwrap();
    let via = |profile: &str, engine: &str| {
        tp2.projected
            .iter()
            .find(|p| p.profile == profile && p.engine == engine)
            .map(|p| p.collectives_via.clone())
            .unwrap()
    };
    assert_eq!(via("dgx-h100", "wgpar"), ["host-staged"]);
    assert_eq!(via("dgx-h100", "CUDA+NCCL"), ["nccl-nvls"]);
    assert_eq!(via("pcie4-4gpu", "CUDA+NCCL"), ["nccl-shm"]);
    assert!(!tp2.projected.is_empty());
    assert!(tp2
        .projected
        .iter()
        .all(|p| (p.engine == "wgpar") == (p.kind == "projected")));
    // A toy model fits every profile, and the check says how much it uses.
    assert!(tp2
        .projected
        .iter()
        .all(|p| p.fits && p.memory.0 > 0 && p.memory.0 < p.memory.1));
    // This machine, then each profile as each engine runs it.
    // The serving section: every strategy served the same stream (the same tokens, checked
    // inside), measured and projected, and the verdicts name the best under load.
    let serving = report.serving.as_ref().unwrap();
    let served: Vec<&str> = serving
        .measurements
        .iter()
        .map(|m| m.label.as_str())
        .collect();
    assert_eq!(
        served,
        ["single", "tp2", "pp2 m=2", "pp4 m=4", "tp2xpp2 m=2"]
    );
    for m in &serving.measurements {
        assert_eq!(m.metrics.completed, 5, "{}", m.label);
        assert!(m.metrics.output_tokens_per_s > 0.0 && m.metrics.ttft_ms.p50 > 0.0);
        assert_eq!(m.projected.len(), 2, "{}", m.label);
        assert_eq!(
            m.pipeline.is_some(),
            m.family == "pp" || m.family == "hybrid"
        );
        assert!(m.projected.iter().all(|p| p.metrics.completed == 5));
    }
    // This machine, then each profile as each engine runs it; the serving stream is measured
    // here and projected as wgpar runs it, so only those verdicts speak of load.
    assert_eq!(report.verdicts.len(), 5);
    for v in &report.verdicts {
        let served = v.profile.contains("measured") || v.profile.contains("wgpar");
        assert_eq!(v.under_load.is_some(), served, "{}", v.profile);
    }
    let text = table(&report);
    assert!(text.contains("verdicts") && text.contains("dgx-h100"));
    assert!(text.contains("serving under load") && text.contains("under load: highest throughput"));
    let md = markdown(&report, &[("t".into(), "throughput.svg".into())]);
    assert!(
        md.contains("## Projected onto `pcie4-4gpu, wgpar (projected)`")
            && md.contains("## Projected onto `dgx-h100, CUDA+NCCL (modeled)`")
            && md.contains("![t](throughput.svg)"),
        "{md}"
    );
    assert!(md.contains("## Serving under load"));
    for svg in [
        throughput_svg(&report).unwrap(),
        breakdown_svg(&report).unwrap(),
    ] {
        assert!(svg.starts_with("<svg") && svg.contains("</svg>") && svg.len() > 1000);
    }
    let json = serde_json::to_string(&report).unwrap();
    assert!(json.contains("\"tg_tps\""));
}
