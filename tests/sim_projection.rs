//! Projection of hand-built timelines onto hand-built profiles, checked against schedules
//! worked out by hand; Chrome trace round trips; measured bubble of fill-drain schedules.

use std::time::{Duration, Instant};

use wgpar::sim::{
    project, CollectivePolicy, HostGaps, HostProfile, ProjectError, ProjectOptions,
    SHIPPED_PROFILES,
};
use wgpar::trace::{
    CollectiveOp, KernelFamily, Recorder, SpanAttrs, SpanId, SpanKind, Timeline, Track,
};

/// Hand profile with round numbers: devices at 1 TFLOP/s f32, 1000 GB/s memory, 2 us per
/// kernel launch; host links alpha 10 us, beta 10 GB/s (10 kB per us) each way; host memory
/// 10 GB/s. `count` devices per node.
fn profile(count: u32, shared_by: u32, device_link: bool, nodes: u32) -> HostProfile {
    let dl = if device_link {
        "[device_link]\nname = \"nv\"\nalpha_us = 10\nbeta_gbps = 100\n"
    } else {
        ""
    };
    let net = if nodes > 1 {
        "[network]\nname = \"ib\"\nalpha_us = 20\nbeta_gbps = 5\n"
    } else {
        ""
    };
    let text = format!(
        "name = \"hand\"\nnodes = {nodes}\n[host]\nname = \"c\"\nmemory_gbps = 10\n\
         [[devices]]\nname = \"g\"\ncount = {count}\nmemory_bytes = 1\nmemory_gbps = 1000\n\
         f32_tflops = 1\nf16_tflops = 2\nlaunch_overhead_us = 2\n\
         [devices.host_link]\nname = \"pcie\"\nshared_by = {shared_by}\n\
         h2d = {{ alpha_us = 10, beta_gbps = 10 }}\nd2h = {{ alpha_us = 10, beta_gbps = 10 }}\n\
         {dl}{net}"
    );
    HostProfile::from_toml_str(&text, "hand.toml").unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

/// Two-stage pipeline, four micro-batches. Stage 0 computes F_k (50 MFLOP, 1 MB: 50 us + 2 us
/// launch = 52 us), copies 100 kB to the host (10 + 10 = 20 us); stage 1 uploads it (20 us) and
/// computes G_k (52 us). Measured times are deliberately different (a slower machine).
fn pipeline_timeline() -> Timeline {
    let mut t = Timeline::new();
    let mut prev_g: Option<(f64, f64)> = None;
    for k in 0..4u32 {
        let base = 200.0 * k as f64;
        let f = t.push_us(
            SpanAttrs::compute("stage0.fwd", 0)
                .microbatch(k)
                .flops(50_000_000)
                .bytes(1_000_000),
            base,
            200.0,
        );
        let d = t.push_us(
            SpanAttrs::d2h("stage0.out", 0, 100_000)
                .microbatch(k)
                .after(f),
            base + 200.0,
            30.0,
        );
        let h = t.push_us(
            SpanAttrs::h2d("stage1.in", 1, 100_000)
                .microbatch(k)
                .after(d),
            base + 230.0,
            30.0,
        );
        let g_start = prev_g.map_or(base + 260.0, |(s, dur)| (s + dur).max(base + 260.0));
        t.push_us(
            SpanAttrs::compute("stage1.fwd", 1)
                .microbatch(k)
                .flops(50_000_000)
                .bytes(1_000_000)
                .after(h),
            g_start,
            200.0,
        );
        prev_g = Some((g_start, 200.0));
    }
    t
}

#[test]
fn pipeline_projection_matches_hand_schedule() {
    let p = profile(2, 1, false, 1);
    let proj = project(&pipeline_timeline(), &p, &ProjectOptions::default()).unwrap();
    // F_k: 52k .. 52(k+1). D_k follows F_k: 52(k+1) .. +20. H_k: +20. G_0 starts at 92;
    // G_k (k>0) waits for G_{k-1}: 92, 144, 196, 248; the last ends at 300.
    let times: Vec<(f64, f64)> = proj
        .timeline
        .spans
        .iter()
        .map(|s| (s.start_us(), s.end_us()))
        .collect();
    let expected = [
        (0.0, 52.0),
        (52.0, 72.0),
        (72.0, 92.0),
        (92.0, 144.0),
        (52.0, 104.0),
        (104.0, 124.0),
        (124.0, 144.0),
        (144.0, 196.0),
        (104.0, 156.0),
        (156.0, 176.0),
        (176.0, 196.0),
        (196.0, 248.0),
        (156.0, 208.0),
        (208.0, 228.0),
        (228.0, 248.0),
        (248.0, 300.0),
    ];
    assert_eq!(times, expected);

    let r = &proj.report.projected;
    assert!(close(r.makespan_us, 300.0));
    assert!(close(r.devices[0].busy_us, 208.0));
    assert!(close(r.devices[1].busy_us, 208.0));
    // Busy 416 of 2 x 300 device-us.
    assert!(close(r.bubble_share, 1.0 - 416.0 / 600.0));
    // Device 0 owns the four d2h copies, device 1 the four h2d copies: 80 us each.
    assert!(close(r.devices[0].comm_us, 80.0));
    assert!(close(r.comm_share, 160.0 / 600.0));
    // Only D_3 (after the last F) and H_0 (before the first G) are not hidden by compute.
    assert!(close(r.exposed_comm_share, 40.0 / 600.0));
    assert_eq!(r.transfer_bytes, 800_000);

    // The measured side summarises the recorded times: F_k at 200k for 200 us, last G ends
    // at 600 + 260 + 200 = 1060.
    let m = &proj.report.measured;
    assert!(close(m.makespan_us, 1060.0));
    assert!(close(m.bubble_share, 1.0 - 1600.0 / 2120.0));
}

/// Tensor-parallel layer on two devices: attention (device 0: 100 MFLOP = 102 us, device 1:
/// 150 MFLOP = 152 us), an all-reduce of 1 MB, the MLP (102 us each), a second all-reduce.
fn tp_timeline(algorithm: &str) -> Timeline {
    let mut t = Timeline::new();
    let mut attn = Vec::new();
    for d in 0..2u32 {
        let flops = if d == 0 { 100_000_000 } else { 150_000_000 };
        attn.push(
            t.push_us(
                SpanAttrs::compute("layer0.attn", d)
                    .layer(0)
                    .flops(flops)
                    .family(KernelFamily::Matmul),
                0.0,
                300.0,
            ),
        );
    }
    let mut ar1 = Vec::new();
    for d in 0..2u32 {
        ar1.push(
            t.push_us(
                SpanAttrs::collective(
                    "layer0.attn.allreduce",
                    d,
                    CollectiveOp::AllReduce,
                    algorithm,
                    2,
                    1_000_000,
                )
                .group(1)
                .after(attn[d as usize]),
                300.0,
                900.0,
            ),
        );
    }
    let mut mlp = Vec::new();
    for d in 0..2u32 {
        mlp.push(
            t.push_us(
                SpanAttrs::compute("layer0.mlp", d)
                    .layer(0)
                    .flops(100_000_000)
                    .after(ar1[d as usize]),
                1200.0,
                300.0,
            ),
        );
    }
    for d in 0..2u32 {
        t.push_us(
            SpanAttrs::collective(
                "layer0.mlp.allreduce",
                d,
                CollectiveOp::AllReduce,
                algorithm,
                2,
                1_000_000,
            )
            .group(2)
            .after(mlp[d as usize]),
            1500.0,
            900.0,
        );
    }
    t
}

fn device_spans(t: &Timeline, name: &str) -> Vec<(f64, f64)> {
    t.spans
        .iter()
        .filter(|s| s.name == name)
        .map(|s| (s.start_us(), s.end_us()))
        .collect()
}

#[test]
fn tensor_parallel_layer_with_two_host_staged_allreduces() {
    // All-reduce of 1 MB, independent links: d2h 10 + 100, reduce 3 MB at 10 GB/s = 300,
    // h2d 110: 520 us. Both start when the slower device (152 us) arrives.
    let p = profile(2, 1, false, 1);
    let proj = project(&tp_timeline("host-staged"), &p, &ProjectOptions::default()).unwrap();
    let t = &proj.timeline;
    assert_eq!(
        device_spans(t, "layer0.attn.allreduce"),
        [(152.0, 672.0), (152.0, 672.0)]
    );
    assert_eq!(
        device_spans(t, "layer0.mlp"),
        [(672.0, 774.0), (672.0, 774.0)]
    );
    assert_eq!(
        device_spans(t, "layer0.mlp.allreduce"),
        [(774.0, 1294.0), (774.0, 1294.0)]
    );
    let r = &proj.report.projected;
    assert!(close(r.makespan_us, 1294.0));
    assert!(close(r.devices[0].busy_us, 204.0));
    assert!(close(r.devices[1].busy_us, 254.0));
    assert!(close(r.comm_share, 2080.0 / 2588.0));
    assert!(close(r.bubble_share, 1.0 - 458.0 / 2588.0));
    assert_eq!(r.collective_bytes, 4_000_000);

    // Both GPUs behind one switch: each copy phase serialises, 220 + 300 + 220 = 740.
    let shared = profile(2, 2, false, 1);
    let proj = project(
        &tp_timeline("host-staged"),
        &shared,
        &ProjectOptions::default(),
    )
    .unwrap();
    assert!(close(
        proj.report.projected.makespan_us,
        152.0 + 740.0 + 102.0 + 740.0
    ));
}

#[test]
fn best_policy_picks_the_ring_when_devices_have_a_link() {
    // NVLink-like link: ring all-reduce = 2 steps of 10 + 500 kB / 100 GB/s = 30 us.
    let p = profile(2, 1, true, 1);
    let opts = ProjectOptions {
        collectives: CollectivePolicy::Best,
        ..Default::default()
    };
    let proj = project(&tp_timeline("host-staged"), &p, &opts).unwrap();
    assert!(close(
        proj.report.projected.makespan_us,
        152.0 + 30.0 + 102.0 + 30.0
    ));
    // As recorded, the same profile still pays the host path.
    let proj = project(&tp_timeline("host-staged"), &p, &ProjectOptions::default()).unwrap();
    assert!(close(proj.report.projected.makespan_us, 1294.0));
    // A recorded ring costs the ring.
    let proj = project(&tp_timeline("ring"), &p, &ProjectOptions::default()).unwrap();
    assert!(close(proj.report.projected.makespan_us, 314.0));
}

#[test]
fn host_staged_allreduce_recorded_as_phases() {
    // The comm layer may record the phases instead of one collective span: each device's
    // d2h, one host reduce over 2 x 1 MB read + 1 MB written, each device's h2d.
    let mut t = Timeline::new();
    let a0 = t.push_us(SpanAttrs::compute("attn", 0).flops(100_000_000), 0.0, 1.0);
    let a1 = t.push_us(SpanAttrs::compute("attn", 1).flops(150_000_000), 0.0, 1.0);
    let d0 = t.push_us(SpanAttrs::d2h("partial", 0, 1_000_000).after(a0), 1.0, 1.0);
    let d1 = t.push_us(SpanAttrs::d2h("partial", 1, 1_000_000).after(a1), 1.0, 1.0);
    let red = t.push_us(
        SpanAttrs::host_reduce("sum", 3_000_000).after_all(&[d0, d1]),
        2.0,
        1.0,
    );
    let h0 = t.push_us(SpanAttrs::h2d("sum", 0, 1_000_000).after(red), 3.0, 1.0);
    let h1 = t.push_us(SpanAttrs::h2d("sum", 1, 1_000_000).after(red), 3.0, 1.0);
    t.push_us(
        SpanAttrs::compute("mlp", 0).flops(100_000_000).after(h0),
        4.0,
        1.0,
    );
    t.push_us(
        SpanAttrs::compute("mlp", 1).flops(100_000_000).after(h1),
        4.0,
        1.0,
    );

    // d2h 102..212 and 152..262; reduce 262..562; h2d 562..672; mlp 672..774.
    let proj = project(&t, &profile(2, 1, false, 1), &ProjectOptions::default()).unwrap();
    assert_eq!(
        device_spans(&proj.timeline, "sum"),
        [(262.0, 562.0), (562.0, 672.0), (562.0, 672.0)]
    );
    assert!(close(proj.report.projected.makespan_us, 774.0));
    assert!(close(proj.report.projected.host_reduce_us, 300.0));

    // Behind one shared uplink the d2h copies queue in recorded order: device 0's runs
    // 102..212, device 1's waits for it, 212..322.
    let proj = project(&t, &profile(2, 2, false, 1), &ProjectOptions::default()).unwrap();
    assert_eq!(
        device_spans(&proj.timeline, "partial"),
        [(102.0, 212.0), (212.0, 322.0)]
    );
}

#[test]
fn copy_between_nodes_crosses_the_network() {
    // One device per node: the 100 kB hand-off adds 20 + 100 kB / 5 GB/s = 40 us.
    let p = profile(1, 1, false, 2);
    let mut t = Timeline::new();
    let f = t.push_us(SpanAttrs::compute("s0", 0).flops(50_000_000), 0.0, 1.0);
    let d = t.push_us(SpanAttrs::d2h("out", 0, 100_000).after(f), 1.0, 1.0);
    let h = t.push_us(SpanAttrs::h2d("in", 1, 100_000).after(d), 2.0, 1.0);
    t.push_us(
        SpanAttrs::compute("s1", 1).flops(50_000_000).after(h),
        3.0,
        1.0,
    );
    let proj = project(&t, &p, &ProjectOptions::default()).unwrap();
    // 52 + 20 + 40 + 20 + 52.
    assert!(close(proj.report.projected.makespan_us, 184.0));
}

/// GPipe fill-drain with p stages and m micro-batches of 1 ms each.
fn fill_drain(p: u32, m: u32) -> Timeline {
    let mut t = Timeline::new();
    let mut prev_stage: Vec<SpanId> = vec![SpanId::NONE; m as usize];
    for s in 0..p {
        for k in 0..m {
            let id = t.push_us(
                SpanAttrs::compute("fwd", s)
                    .microbatch(k)
                    .flops(1_000_000_000)
                    .kernels(0)
                    .after(prev_stage[k as usize]),
                1000.0 * (s + k) as f64,
                1000.0,
            );
            prev_stage[k as usize] = id;
        }
    }
    t
}

#[test]
fn fill_drain_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for (p, m) in [(2u32, 4u32), (4, 8), (3, 1)] {
        let expected = (p - 1) as f64 / (m + p - 1) as f64;
        let t = fill_drain(p, m);
        let s = t.summary();
        assert!(
            (s.bubble_share - expected).abs() < 1e-12,
            "p={p} m={m}: {}",
            s.bubble_share
        );
        assert!(close(s.makespan_us, 1000.0 * (m + p - 1) as f64));
        // Projected on equal devices (1 GFLOP at 1 TFLOP/s = 1 ms, no launch cost counted),
        // the schedule and its bubble are the same.
        let proj = project(&t, &profile(p, 1, false, 1), &ProjectOptions::default()).unwrap();
        assert!((proj.report.projected.bubble_share - expected).abs() < 1e-12);
        assert!(close(proj.report.projected.makespan_us, s.makespan_us));
    }
}

#[test]
fn kept_host_gaps_reproduce_a_matching_run() {
    // Durations equal the model's costs (52 us compute, 20 us copy), with 5 us of host time
    // before each span that is not explained by its predecessors.
    let mut t = Timeline::new();
    let a = t.push_us(SpanAttrs::compute("a", 0).flops(50_000_000), 0.0, 52.0);
    let b = t.push_us(SpanAttrs::d2h("b", 0, 100_000).after(a), 57.0, 20.0);
    t.push_us(
        SpanAttrs::compute("c", 0).flops(50_000_000).after(b),
        82.0,
        52.0,
    );
    let p = profile(1, 1, false, 1);
    let keep = ProjectOptions {
        host_gaps: HostGaps::Keep,
        ..Default::default()
    };
    let kept = project(&t, &p, &keep).unwrap();
    assert!(close(kept.report.projected.makespan_us, t.makespan_us()));
    let dropped = project(&t, &p, &ProjectOptions::default()).unwrap();
    assert!(close(dropped.report.projected.makespan_us, 124.0));
}

#[test]
fn wait_spans_take_no_time() {
    let mut t = Timeline::new();
    let a = t.push_us(SpanAttrs::compute("a", 0).flops(50_000_000), 0.0, 52.0);
    let w = t.push_us(SpanAttrs::wait("recv", 1).after(a), 0.0, 52.0);
    t.push_us(
        SpanAttrs::compute("b", 1).flops(50_000_000).after(w),
        52.0,
        52.0,
    );
    let proj = project(&t, &profile(2, 1, false, 1), &ProjectOptions::default()).unwrap();
    assert_eq!(device_spans(&proj.timeline, "recv"), [(52.0, 52.0)]);
    assert!(close(proj.report.projected.makespan_us, 104.0));
}

#[test]
fn inconsistent_timelines_are_errors() {
    let p = profile(2, 1, false, 1);
    let opts = ProjectOptions::default();

    // Device 2 on a 2-device profile.
    let mut t = Timeline::new();
    t.push_us(SpanAttrs::compute("x", 2), 0.0, 1.0);
    assert!(matches!(
        project(&t, &p, &opts),
        Err(ProjectError::TooFewDevices {
            device: 2,
            available: 2,
            ..
        })
    ));

    // Unknown algorithm.
    let t = tp_timeline("tree");
    match project(&t, &p, &opts) {
        Err(ProjectError::UnknownAlgorithm { algorithm, .. }) => assert_eq!(algorithm, "tree"),
        other => panic!("expected UnknownAlgorithm, got {other:?}"),
    }

    // Two devices that ran the same two collectives in opposite orders would deadlock.
    let mut t = Timeline::new();
    let ar = |name: &'static str, d: u32, g: u64| {
        SpanAttrs::collective(name, d, CollectiveOp::AllReduce, "ring", 2, 8).group(g)
    };
    t.push_us(ar("first", 0, 1), 0.0, 1.0);
    t.push_us(ar("second", 0, 2), 1.0, 1.0);
    t.push_us(ar("second", 1, 2), 0.0, 1.0);
    t.push_us(ar("first", 1, 1), 1.0, 1.0);
    assert!(matches!(
        project(&t, &p, &opts),
        Err(ProjectError::Cycle { .. })
    ));

    // A dependency that started after the span depending on it: named, not called a cycle.
    let mut t = Timeline::new();
    let early = t.push_us(SpanAttrs::compute("early", 0), 0.0, 1.0);
    let late = t.push_us(SpanAttrs::compute("late", 0).after(early), 5.0, 1.0);
    t.spans[0].deps.clear();
    t.spans[0].start_ns = 10_000;
    t.spans[1].deps = vec![early];
    let _ = late;
    match project(&t, &p, &opts) {
        Err(e @ ProjectError::DependencyStartsLater(_)) => {
            let text = e.to_string();
            assert!(
                text.contains("late") && text.contains("early") && text.contains("forward in time"),
                "{text}"
            );
        }
        other => panic!("expected DependencyStartsLater, got {other:?}"),
    }
    // Nothing to project.
    assert!(matches!(
        project(&Timeline::new(), &p, &opts),
        Err(ProjectError::EmptyTimeline)
    ));

    // Members of one group that disagree on the size.
    let mut t = Timeline::new();
    t.push_us(
        SpanAttrs::collective("a", 0, CollectiveOp::AllReduce, "ring", 2, 8).group(1),
        0.0,
        1.0,
    );
    t.push_us(
        SpanAttrs::collective("a", 1, CollectiveOp::AllReduce, "ring", 2, 16).group(1),
        0.0,
        1.0,
    );
    assert!(matches!(
        project(&t, &p, &opts),
        Err(ProjectError::MixedGroup { group: 1, .. })
    ));
}

#[test]
fn report_prints_a_table() {
    let p = profile(2, 1, false, 1);
    let proj = project(&pipeline_timeline(), &p, &ProjectOptions::default()).unwrap();
    let text = proj.report.to_string();
    assert!(
        text.contains("projection onto `hand` as `peak` runs it: 2 of 2 devices, 16 spans"),
        "{text}"
    );
    let makespan = text
        .lines()
        .find(|l| l.trim_start().starts_with("makespan"))
        .unwrap();
    assert!(
        makespan.contains("1.060 ms") && makespan.contains("300.0 us"),
        "{text}"
    );
    let bubble = text
        .lines()
        .find(|l| l.trim_start().starts_with("bubble share"))
        .unwrap();
    // 1 - 416/600 = 30.7 %.
    assert!(bubble.trim_end().ends_with("30.7 %"), "{text}");
    let gpu1 = text
        .lines()
        .find(|l| l.trim_start().starts_with("gpu1"))
        .unwrap();
    assert!(gpu1.contains("208.0 us"), "{text}");
    assert!(text.contains("speedup 3.53x"), "{text}");
}

#[test]
fn every_shipped_profile_projects_a_two_device_layer() {
    let t = tp_timeline("host-staged");
    for (name, _) in SHIPPED_PROFILES {
        let p = HostProfile::shipped(name).unwrap();
        let result = project(&t, &p, &ProjectOptions::default());
        if p.device_count() < 2 {
            assert!(
                matches!(result, Err(ProjectError::TooFewDevices { .. })),
                "{name}"
            );
        } else {
            let r = result.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(r.report.projected.makespan_us > 0.0, "{name}");
        }
    }
    // Faster links and memory: the DGX H100 host path beats the PCIe 3.0 desktop.
    let slow = project(
        &t,
        &HostProfile::shipped("pcie3-2gpu").unwrap(),
        &ProjectOptions::default(),
    )
    .unwrap();
    let fast = project(
        &t,
        &HostProfile::shipped("dgx-h100").unwrap(),
        &ProjectOptions::default(),
    )
    .unwrap();
    assert!(fast.report.projected.makespan_us < slow.report.projected.makespan_us);
}

#[test]
fn chrome_trace_round_trip_is_lossless() {
    let epoch = Instant::now();
    let rec = Recorder::with_epoch(epoch);
    rec.label_device(0, "test gpu 0 (Vulkan)");
    rec.label_device(1, "test gpu 1 (GL)");
    rec.set_meta("model", "tiny");
    std::thread::scope(|s| {
        for d in 0..2u32 {
            let rec = rec.clone();
            s.spawn(move || {
                let mut prev = SpanId::NONE;
                for k in 0..20u32 {
                    let a = epoch + Duration::from_nanos(1_000_003 * k as u64 + 17 * d as u64);
                    let b = a + Duration::from_nanos(777_777);
                    prev = rec.record(
                        a,
                        b,
                        SpanAttrs::compute(format!("layer{k}.mlp"), d)
                            .layer(k)
                            .microbatch(k % 3)
                            .flops(123_456_789)
                            .bytes(42)
                            .kernels(3)
                            .family(KernelFamily::Matmul)
                            .after(prev),
                    );
                    prev = rec.record(
                        b,
                        b + Duration::from_nanos(333),
                        SpanAttrs::collective(
                            "ar",
                            d,
                            CollectiveOp::AllReduce,
                            "host-staged",
                            2,
                            4096,
                        )
                        .group(k as u64)
                        .chunks(4)
                        .after(prev),
                    );
                }
            });
        }
    });
    rec.record_us(
        5.5,
        1.25,
        SpanAttrs::host_reduce("sum", 12_288).on_track(Track::Other("host reducer 1".into())),
    );
    let original = rec.timeline();
    assert_eq!(original.spans.len(), 81);

    let text = original.to_chrome_trace_string();
    let back = Timeline::from_chrome_trace_str(&text, "mem.json").unwrap();
    assert_eq!(back, original);

    // Through a file as well.
    let path = std::env::temp_dir().join(format!("wgpar-sim-trace-{}.json", std::process::id()));
    original.write_chrome_trace(&path).unwrap();
    let from_file = Timeline::read_chrome_trace(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(from_file, original);

    // The viewer half has one complete event per span, with its attributes in args.
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), 81);
    let reduce = complete.iter().find(|e| e["cat"] == "host_reduce").unwrap();
    assert_eq!(reduce["ts"], serde_json::json!(5.5));
    assert_eq!(reduce["dur"], serde_json::json!(1.25));
    assert_eq!(reduce["args"]["bytes"], serde_json::json!(12_288));
    let threads: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(threads, ["gpu0", "gpu1", "host reducer 1"]);
    assert_eq!(
        original
            .spans
            .iter()
            .filter(|s| s.kind == SpanKind::Collective)
            .count(),
        40
    );
}
