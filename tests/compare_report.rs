//! `wgpar compare` end to end on a tiny model: every strategy runs and matches the single
//! device, projections and verdicts exist, and the report, charts and JSON are written.

mod common;

use wgpar::compare::{
    breakdown_svg, markdown, run_compare, table, throughput_svg, CompareOptions, ServingOptions,
};
use wgpar::device::DType;
use wgpar::model::ModelConfig;
use wgpar::serve::{Length, Rate};
use wgpar::sim::HostProfile;

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
        assert_eq!(m.projected.len(), 2, "{}", m.label);
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
                .and_then(|m| m.projected.iter().find(|p| p.profile == profile))
                .map(|p| p.per_token_ms)
                .unwrap()
        };
        assert!(lat("pp2 m=1") >= lat("single"), "{profile}");
    }
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
    assert_eq!(report.verdicts.len(), 3);
    assert!(report.verdicts.iter().all(|v| v.under_load.is_some()));
    let text = table(&report);
    assert!(text.contains("verdicts") && text.contains("dgx-h100"));
    assert!(text.contains("serving under load") && text.contains("under load: highest throughput"));
    let md = markdown(&report, &[("t".into(), "throughput.svg".into())]);
    assert!(md.contains("## Projected onto `pcie4-4gpu`") && md.contains("![t](throughput.svg)"));
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
