//! Projection rules 4 and 5: step barriers at idle instants, and devices that share one
//! processor. Schedules worked out by hand.

use wgpar::sim::{project, HostProfile, ProjectOptions, StepBarriers};
use wgpar::trace::{SpanAttrs, SpanId, Timeline};

/// Two devices at 1 TFLOP/s (1 MFLOP per us), no launch cost. `sharing` is the TOML of an
/// optional `[devices.compute_sharing]` table.
fn profile(sharing: &str) -> HostProfile {
    let text = format!(
        "name = \"hand\"\nnodes = 1\n[host]\nname = \"c\"\nmemory_gbps = 10\n\
         [[devices]]\nname = \"g\"\ncount = 2\nmemory_bytes = 1\nmemory_gbps = 1000\n\
         f32_tflops = 1\nf16_tflops = 1\nlaunch_overhead_us = 0\n\
         [devices.host_link]\nname = \"pcie\"\nshared_by = 1\n\
         h2d = {{ alpha_us = 10, beta_gbps = 10 }}\nd2h = {{ alpha_us = 10, beta_gbps = 10 }}\n\
         {sharing}"
    );
    HostProfile::from_toml_str(&text, "hand.toml").unwrap()
}

const SHARED: &str = "[devices.compute_sharing]\nshared_by = 2\nslowdown = [1, 2]\n";

fn times(t: &Timeline, id: SpanId) -> (f64, f64) {
    let s = t.span(id).unwrap();
    (s.start_us(), s.end_us())
}

fn close(a: (f64, f64), b: (f64, f64)) -> bool {
    (a.0 - b.0).abs() < 1e-3 && (a.1 - b.1).abs() < 1e-3
}

#[test]
fn devices_on_one_processor_slow_each_other_down_while_they_overlap() {
    // gpu0: A (100 us alone). gpu1: C (50 us alone), then B (100 us alone).
    let mut t = Timeline::new();
    let a = t.push_us(SpanAttrs::compute("A", 0).flops(100_000_000), 0.0, 1.0);
    let c = t.push_us(SpanAttrs::compute("C", 1).flops(50_000_000), 0.0, 1.0);
    let b = t.push_us(SpanAttrs::compute("B", 1).flops(100_000_000), 1.0, 1.0);

    // Own processors: A [0, 100], C [0, 50], B [50, 150].
    let own = project(&t, &profile(""), &ProjectOptions::default()).unwrap();
    assert!(close(times(&own.timeline, a), (0.0, 100.0)));
    assert!(close(times(&own.timeline, b), (50.0, 150.0)));

    // Shared, each of two runs at half speed: A and C share until C is done at 100 (50 us of
    // work); A has 50 us left, shares with B until 200; B has done 50 us by then and finishes
    // its last 50 alone at 250.
    let shared = project(&t, &profile(SHARED), &ProjectOptions::default()).unwrap();
    let tl = &shared.timeline;
    assert!(close(times(tl, c), (0.0, 100.0)), "{:?}", times(tl, c));
    assert!(close(times(tl, a), (0.0, 200.0)), "{:?}", times(tl, a));
    assert!(close(times(tl, b), (100.0, 250.0)), "{:?}", times(tl, b));
    assert!((shared.report.projected.makespan_us - 250.0).abs() < 1e-3);

    // A measured slowdown below equal shares: 1.5 instead of 2. A and C overlap until C is
    // done at 75; A has 50 left, overlaps B until 150; B then has 50 left alone: ends at 200.
    let mild = "[devices.compute_sharing]\nshared_by = 2\nslowdown = [1, 1.5]\n";
    let p = project(&t, &profile(mild), &ProjectOptions::default()).unwrap();
    assert!(close(times(&p.timeline, a), (0.0, 150.0)));
    assert!(close(times(&p.timeline, b), (75.0, 200.0)));
}

#[test]
fn slowdown_follows_the_intensity_of_each_span() {
    // A decode-like span (1 flop per byte) and a prefill-like one (100 flops per byte), 100 us
    // each alone, on two devices of one processor. Measured: shared, the decode span runs
    // 1.25x slower, the prefill span 2x.
    let mut t = Timeline::new();
    let decode = t.push_us(
        SpanAttrs::compute("decode", 0)
            .flops(100_000_000)
            .bytes(100_000_000),
        0.0,
        1.0,
    );
    let prefill = t.push_us(
        SpanAttrs::compute("prefill", 1)
            .flops(100_000_000)
            .bytes(1_000_000),
        0.0,
        1.0,
    );
    let by_shape = "[devices.compute_sharing]\nshared_by = 2\nslowdown = [1, 1.5]\n\
                    slowdown_curve = [[1, 1, 1.25], [100, 1, 2]]\n";
    let p = project(&t, &profile(by_shape), &ProjectOptions::default()).unwrap();
    // Decode does 100 us of work at 0.8 per us: done at 125; prefill has done 62.5 by then
    // and finishes its last 37.5 alone at 162.5.
    assert!(close(times(&p.timeline, decode), (0.0, 125.0)));
    assert!(close(times(&p.timeline, prefill), (0.0, 162.5)));
}

#[test]
fn transfers_do_not_share_the_processor() {
    // A d2h copy on gpu1 overlapping A on gpu0 does not slow A down.
    let mut t = Timeline::new();
    let a = t.push_us(SpanAttrs::compute("A", 0).flops(100_000_000), 0.0, 1.0);
    let d = t.push_us(SpanAttrs::d2h("copy", 1, 100_000), 0.0, 1.0);
    let p = project(&t, &profile(SHARED), &ProjectOptions::default()).unwrap();
    assert!(close(times(&p.timeline, a), (0.0, 100.0)));
    // 10 us + 100 kB at 10 GB/s.
    assert!(close(times(&p.timeline, d), (0.0, 20.0)));
}

/// Two steps of a two-stage pipeline, one micro-batch each, with the host idle in between
/// (as when the driver collects step 1's logits before it issues step 2). Each compute span
/// takes 10 us on the profile.
fn two_steps() -> (Timeline, [SpanId; 4]) {
    let mut t = Timeline::new();
    let s0 = t.push_us(SpanAttrs::compute("s0", 0).flops(10_000_000), 0.0, 10.0);
    let s1 = t.push_us(
        SpanAttrs::compute("s1", 1).flops(10_000_000).after(s0),
        10.0,
        10.0,
    );
    let s0b = t.push_us(SpanAttrs::compute("s0", 0).flops(10_000_000), 25.0, 10.0);
    let s1b = t.push_us(
        SpanAttrs::compute("s1", 1).flops(10_000_000).after(s0b),
        35.0,
        10.0,
    );
    (t, [s0, s1, s0b, s1b])
}

#[test]
fn idle_instants_are_step_barriers() {
    let (t, [_, s1, s0b, s1b]) = two_steps();
    let p = project(&t, &profile(""), &ProjectOptions::default()).unwrap();
    // Step 2 enters stage 0 only once step 1 has left stage 1.
    assert!(close(times(&p.timeline, s1), (10.0, 20.0)));
    assert!(close(times(&p.timeline, s0b), (20.0, 30.0)));
    assert!(close(times(&p.timeline, s1b), (30.0, 40.0)));

    // Without the rule, step 2 overlaps step 1: stage 0 is free at 10.
    let off = ProjectOptions {
        barriers: StepBarriers::Off,
        ..Default::default()
    };
    let p = project(&t, &profile(""), &off).unwrap();
    assert!(close(times(&p.timeline, s0b), (10.0, 20.0)));
    assert!((p.report.projected.makespan_us - 30.0).abs() < 1e-3);
}

#[test]
fn spans_that_overlap_or_touch_make_no_barrier() {
    // The second step starts exactly when the first ends, and a third span overlaps: no idle
    // instant, so only recorded dependencies and resource order apply.
    let mut t = Timeline::new();
    t.push_us(SpanAttrs::compute("a", 0).flops(10_000_000), 0.0, 10.0);
    let b = t.push_us(SpanAttrs::compute("b", 1).flops(10_000_000), 10.0, 10.0);
    let p = project(&t, &profile(""), &ProjectOptions::default()).unwrap();
    assert!(close(times(&p.timeline, b), (0.0, 10.0)));
}
