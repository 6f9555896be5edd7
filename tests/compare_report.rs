//! `wgpar compare` end to end on a tiny model: every strategy runs and matches the single
//! device, projections and verdicts exist, and the report, charts and JSON are written.

mod common;

use wgpar::batching::{Length, Rate};
use wgpar::compare::{
    breakdown_svg, markdown, plan, plan_model, question_lines, run_compare, scale_svg, table,
    throughput_svg, CompareOptions, PlanOptions, PlanStrategy, ServingOptions,
};
use wgpar::device::DType;
use wgpar::model::ModelConfig;
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
        at_scale: true,
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
    assert!(text.contains("serving under load"));
    // One line per question, each naming every machine that answers it (the stream's
    // questions: the machines that served it).
    let lines = question_lines(&report.verdicts);
    assert_eq!(lines.len(), 5, "{lines:?}");
    for (i, line) in lines.iter().enumerate() {
        let machines = if i < 2 { 5 } else { 3 };
        let named = report
            .verdicts
            .iter()
            .filter(|v| line.contains(&format!("{}: ", v.profile)))
            .count();
        assert_eq!(named, machines, "{line}");
        assert!(text.contains(line.as_str()), "{line}");
    }
    check_scale(&report, &text);
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

/// The modeled section at scale: every (profile, engine, strategy, batch) of both questions,
/// the same rows `wgpar plan` gives, an answer line per question, in the table, the
/// Markdown report and one chart.
fn check_scale(report: &wgpar::compare::CompareReport, text: &str) {
    let scale = report.scale.as_ref().expect("asked for at_scale");
    let sizes: Vec<(usize, &str)> = scale
        .cases
        .iter()
        .map(|c| (c.rows.len(), c.model.as_str()))
        .collect();
    // 2 profiles x 2 engines x 5 strategies x 2 batches; then 1 profile x 2 engines x 3 and 4
    // strategies x 2 batches.
    assert_eq!(
        sizes,
        [(40, "llama-8b"), (12, "llama3-70b"), (16, "llama3-70b")]
    );
    for (case, lines) in scale.cases.iter().zip([2, 4, 4]) {
        assert!(case.params_b > 7.0, "{}", case.model);
        assert_eq!(case.answers.len(), lines, "{:?}", case.answers);
        assert!(!case.answers.iter().any(|a| a.contains("nothing fits")));
        assert!(text.contains(&case.question) && text.contains(&case.answers[0]));
        let fit = case.rows.iter().filter(|r| r.fits).count();
        assert!(fit > case.rows.len() / 2, "{}: {fit} fit", case.model);
        assert!(case
            .rows
            .iter()
            .filter(|r| r.fits)
            .all(|r| r.decode_tps.unwrap() > 0.0 && r.decode_ms.unwrap() > 0.0));
    }
    // The same numbers as the planner's.
    let c = &scale.cases[1];
    let opts = PlanOptions {
        config: plan_model("llama3-70b").unwrap(),
        weights: wgpar::sim::NumFormat::F16,
        file_format: None,
        strategies: vec![PlanStrategy::parse("tp4xpp2-mbest").unwrap()],
        batches: vec![32],
        seqs: vec![scale.prompt],
        profiles: vec![HostProfile::resolve("2node-ib200").unwrap()],
        engines: vec![Engine::shipped("wgpar").unwrap()],
        decode_steps: scale.decode_steps,
    };
    let planned = &plan(&opts).unwrap()[0];
    let row = c
        .rows
        .iter()
        .find(|r| r.engine == planned.engine && r.strategy == planned.strategy && r.batch == 32)
        .unwrap();
    assert_eq!(row.decode_tps, planned.decode_tps);
    assert!(row.strategy.ends_with("(best)"), "{}", row.strategy);
    // Issue 39 item 8: the article's rule holds for CUDA+NCCL on NVLink nodes, not on PCIe ones.
    let verdicts = |i: usize| scale.cases[i].answers.join("\n");
    let (pcie, dgx) = (verdicts(1), verdicts(2));
    assert!(
        pcie.contains("2node-ib200, CUDA+NCCL: does not hold"),
        "{pcie}"
    );
    assert!(
        dgx.contains("2node-dgx-h100, CUDA+NCCL: holds (tp8xpp2 m="),
        "{dgx}"
    );
    let md = markdown(report, &[]);
    assert!(md.contains("## Modeled at scale") && md.contains("| 2node-ib200 | wgpar | tp8 |"));
    let svg = scale_svg(scale).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("llama3-70b on 2node-ib200"));
    assert!(svg.contains("llama3-70b on 2node-dgx-h100"));
}
