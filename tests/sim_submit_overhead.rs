//! The fixed host cost of a submission (`submit_overhead_us`): a profile field that
//! round-trips, is validated, is absent from older profiles (0, with a note on calibrated ones),
//! and is charged once per compute span, never on copies.

use wgpar::sim::{project, HostProfile, ProjectOptions, SHIPPED_PROFILES};
use wgpar::trace::{KernelFamily, SpanAttrs, Timeline};

/// Round-number device: 1 TFLOP/s, 1000 GB/s, 2 us per dispatch; `extra` is appended to the
/// device table (e.g. a `submit_overhead_us` line), `rates` to the file (a measured section).
fn profile_text(extra: &str, rates: &str) -> String {
    format!(
        "name = \"hand\"\nnodes = 1\n[host]\nname = \"c\"\nmemory_gbps = 10\n\
         [[devices]]\nname = \"g\"\ncount = 2\nmemory_bytes = 1\nmemory_gbps = 1000\n\
         f32_tflops = 1\nf16_tflops = 2\nlaunch_overhead_us = 2\n{extra}\
         [devices.host_link]\nname = \"pcie\"\nshared_by = 1\n\
         h2d = {{ alpha_us = 10, beta_gbps = 10 }}\nd2h = {{ alpha_us = 10, beta_gbps = 10 }}\n\
         {rates}"
    )
}

/// Three dependent compute spans on device 0 (50 MFLOP, 1 MB, 3 kernels: 50 us + 3 x 2 us),
/// then a 100 kB download (10 + 10 us).
fn timeline() -> Timeline {
    let mut t = Timeline::new();
    let mut prev = None;
    for k in 0..3u32 {
        let mut a = SpanAttrs::compute("forward", 0)
            .flops(50_000_000)
            .bytes(1_000_000)
            .family(KernelFamily::Matmul)
            .kernels(3);
        if let Some(p) = prev {
            a = a.after(p);
        }
        prev = Some(t.push_us(a, 1000.0 * k as f64, 900.0));
    }
    let mut d = SpanAttrs::d2h("logits", 0, 100_000);
    if let Some(p) = prev {
        d = d.after(p);
    }
    t.push_us(d, 3000.0, 100.0);
    t
}

#[test]
fn the_field_round_trips_and_is_validated() {
    let p =
        HostProfile::from_toml_str(&profile_text("submit_overhead_us = 250\n", ""), "hand.toml")
            .unwrap();
    assert_eq!(p.devices[0].submit_overhead_us, Some(250.0));
    let text = p.to_toml_string().unwrap();
    assert!(text.contains("submit_overhead_us = 250"));
    assert_eq!(HostProfile::from_toml_str(&text, "again.toml").unwrap(), p);

    let err =
        HostProfile::from_toml_str(&profile_text("submit_overhead_us = -5\n", ""), "bad.toml")
            .unwrap_err();
    assert_eq!(err.field(), Some("devices[0].submit_overhead_us"));
    assert!(err.to_string().contains("bad.toml:"), "{err}");
}

#[test]
fn projection_charges_it_once_per_compute_span() {
    let with =
        HostProfile::from_toml_str(&profile_text("submit_overhead_us = 100\n", ""), "hand.toml")
            .unwrap();
    let without = HostProfile::from_toml_str(&profile_text("", ""), "hand.toml").unwrap();
    let t = timeline();
    let a = project(&t, &without, &ProjectOptions::default()).unwrap();
    let b = project(&t, &with, &ProjectOptions::default()).unwrap();
    // Worked by hand: 3 x (50 + 3 x 2) + (10 + 10) = 188 us; with the submissions, 3 x 100 more.
    assert!((a.report.projected.makespan_us - 188.0).abs() < 1e-3);
    assert!((b.report.projected.makespan_us - 488.0).abs() < 1e-3);
    assert_eq!(a.report.submit_overhead_us, 0.0);
    assert!((b.report.submit_overhead_us - 300.0).abs() < 1e-9);
    // Each compute span carries its own submission; the download does not.
    let spans = &b.timeline.spans;
    for s in &spans[..3] {
        assert!((s.dur_ns as f64 / 1e3 - 156.0).abs() < 1e-3, "{}", s.dur_ns);
    }
    assert!((spans[3].dur_ns as f64 / 1e3 - 20.0).abs() < 1e-3);
    assert!(b.report.notes.is_empty());
    assert!(b
        .report
        .to_string()
        .contains("fixed host cost of the submissions"));
}

#[test]
fn profiles_without_it_load_with_zero_and_calibrated_ones_say_so() {
    // A calibrated profile of before: measured rates, no submit_overhead_us.
    let old = HostProfile::from_toml_str(
        &profile_text(
            "",
            "[devices.rates]\nmatmul_gflops = 1000\nelementwise_gbps = 1000\n",
        ),
        "old-calibration.toml",
    )
    .unwrap();
    assert_eq!(old.devices[0].submit_overhead_us, None);
    assert!(old.lacks_submit_overhead());
    let p = project(&timeline(), &old, &ProjectOptions::default()).unwrap();
    assert_eq!(p.report.submit_overhead_us, 0.0);
    assert_eq!(p.report.notes.len(), 1);
    assert!(p.report.notes[0].contains("submit_overhead_us"));
    assert!(p.report.to_string().contains("note: profile `hand`"));

    // Spec-sheet profiles leave it out and are not warned about.
    for (name, _) in SHIPPED_PROFILES {
        let prof = HostProfile::shipped(name).unwrap();
        assert!(
            !prof.devices.is_empty() && prof.devices.iter().all(|d| d.submit_overhead_us.is_none()),
            "{name}"
        );
        assert!(!prof.lacks_submit_overhead(), "{name}");
    }
}
