//! The calibrated rate surface (rate by arithmetic intensity and work per dispatch): the
//! lookup by hand, its use by the cost model, older profiles without it, and malformed
//! surfaces reported with file, line and field.

use wgpar::sim::{rate_on_surface, CostModel, HostProfile, ProfileError};
use wgpar::trace::{KernelFamily, Precision};

/// A narrow block width measured at intensities 1 and 16 (0.1 and 1.6 MFLOP per dispatch,
/// 10 and 40 GFLOP/s) and a wide one (1 and 16 MFLOP per dispatch, 30 and 120 GFLOP/s).
fn surface() -> Vec<Vec<[f64; 3]>> {
    vec![
        vec![[1.0, 0.1, 10.0], [16.0, 1.6, 40.0]],
        vec![[1.0, 1.0, 30.0], [16.0, 16.0, 120.0]],
    ]
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[test]
fn the_surface_interpolates_in_intensity_then_in_work_per_dispatch() {
    let s = surface();
    // Intensity 4 lies halfway between 1 and 16 in log scale. There the narrow curve runs
    // 10 + (40 - 10) / 2 = 25 GFLOP/s at sqrt(0.1 x 1.6) = 0.4 MFLOP per dispatch, the wide
    // one 30 + (120 - 30) / 2 = 75 GFLOP/s at sqrt(1 x 16) = 4 MFLOP per dispatch.
    let at = |w: f64| rate_on_surface(&s, 4.0, w).unwrap();
    assert!(close(at(0.4), 25.0), "{}", at(0.4));
    assert!(close(at(4.0), 75.0), "{}", at(4.0));
    // sqrt(0.4 x 4) is halfway between the two in log work: halfway between the rates.
    assert!(close(at(1.6_f64.sqrt()), 50.0), "{}", at(1.6_f64.sqrt()));
    // A quarter of the way (0.4 x 10^(1/4)): 25 + 50 / 4.
    let quarter = 0.4 * 10f64.powf(0.25);
    assert!(close(at(quarter), 37.5), "{}", at(quarter));
    // Beyond the narrowest and the widest curve: held at their rates.
    assert!(close(at(0.01), 25.0));
    assert!(close(at(1e6), 75.0));
    // Below the lowest measured intensity the curves hold their first points: narrow 10 at
    // 0.1, wide 30 at 1; 0.1 x sqrt(10) is halfway between them in log work.
    let w = 0.1 * 10f64.sqrt();
    assert!(close(rate_on_surface(&s, 0.2, w).unwrap(), 20.0));
    // The order of the curves does not matter.
    let reversed: Vec<_> = s.iter().rev().cloned().collect();
    assert!(close(
        rate_on_surface(&reversed, 4.0, quarter).unwrap(),
        37.5
    ));
    // One curve: its rate at the intensity, whatever the work per dispatch.
    assert!(close(rate_on_surface(&s[..1], 4.0, 100.0).unwrap(), 25.0));
    assert_eq!(rate_on_surface(&[], 4.0, 1.0), None);
}

/// One device, 1 TFLOP/s f32 peak, 2 us per dispatch, with `rates` as its measured rates.
fn profile(rates: &str) -> HostProfile {
    let text = format!(
        "name = \"t\"\nnodes = 1\n[host]\nname = \"c\"\nmemory_gbps = 10\n\
         [[devices]]\nname = \"g\"\ncount = 1\nmemory_bytes = 1000000000\nmemory_gbps = 100\n\
         f32_tflops = 1\nf16_tflops = 2\nlaunch_overhead_us = 2\n\
         [devices.host_link]\nname = \"pcie\"\nshared_by = 1\n\
         h2d = {{ alpha_us = 10, beta_gbps = 10 }}\nd2h = {{ alpha_us = 10, beta_gbps = 10 }}\n\
         [devices.rates]\n{rates}"
    );
    HostProfile::from_toml_str(&text, "t.toml").unwrap()
}

#[test]
fn a_span_is_costed_at_its_intensity_and_work_per_dispatch() {
    let p = profile(
        "matmul_curve = [[1, 1000], [16, 1000]]\n\
         matmul_surface = [[[1, 0.1, 10], [16, 1.6, 40]], [[1, 1, 30], [16, 16, 120]]]\n",
    );
    let m = CostModel::new(&p);
    let mm = Some(KernelFamily::Matmul);
    // 40 MFLOP over 10 MB (intensity 4) in 10 dispatches: 4 MFLOP each, the wide curve's
    // 75 GFLOP/s: 40e6 / 75e3 = 533.3 us, plus 10 x 2 us of dispatches. The curve's
    // 1000 GFLOP/s is ignored: the surface wins.
    let t = m
        .compute_us(0, 40_000_000, 10_000_000, 10, mm, Precision::F32)
        .unwrap();
    assert!(close(t, 40e6 / 75e3 + 20.0), "{t}");
    // The same work in 100 dispatches of 0.4 MFLOP: the narrow curve's 25 GFLOP/s.
    let t = m
        .compute_us(0, 40_000_000, 10_000_000, 100, mm, Precision::F32)
        .unwrap();
    assert!(close(t, 40e6 / 25e3 + 200.0), "{t}");
    // Attention spans have no surface here (and no curve): the calibrated roofline, i.e.
    // the f32 peak, 1 TFLOP/s, against 10 MB at 100 GB/s = 100 us.
    let t = m
        .compute_us(
            0,
            40_000_000,
            10_000_000,
            1,
            Some(KernelFamily::Attention),
            Precision::F32,
        )
        .unwrap();
    assert!(close(t, 102.0), "{t}");
}

/// A profile as `wgpar calibrate` wrote it before the rate surface (figures shortened):
/// curves by intensity only.
const OLD_CALIBRATED: &str = r#"# Calibrated profile written by `wgpar calibrate`.
# 2026-12-01, wgpar 0.1.0; driver llvmpipe Mesa 25.0.7-2~bpo12+1 (LLVM 15.0.6)

name = "this-machine"
description = "this machine as calibrated on 2026-12-01: 2 device(s), llvmpipe (LLVM 15.0.6, 256 bits) [Vulkan]"
nodes = 1

[host]
name = "AMD EPYC, 2 hardware threads"
memory_gbps = 4.8657
collective_overhead_us = [15656.07]

[[devices]]
name = "llvmpipe (LLVM 15.0.6, 256 bits) [Vulkan]"
count = 2
memory_bytes = 25276063744
memory_gbps = 0.519
f32_tflops = 0.000562
f16_tflops = 0.000562
launch_overhead_us = 135.3
submit_overhead_us = 175.7

[devices.host_link]
name = "measured host link"
shared_by = 1

[devices.host_link.h2d]
alpha_us = 52.6
beta_gbps = 9.72

[devices.host_link.d2h]
alpha_us = 55.5
beta_gbps = 6.96

[devices.rates]
matmul_gflops = 0.562
attention_gflops = 0.755
elementwise_gbps = 0.519
matmul_curve = [[0.503, 0.386], [0.997, 0.688], [13.26, 0.884], [47.28, 0.562]]
attention_curve = [[0.518, 0.173], [10.86, 1.686], [25.57, 0.755]]

[devices.compute_sharing]
shared_by = 2
slowdown = [1.0, 2.75]
slowdown_curve = [[0.503, 1.0, 3.33], [47.28, 1.0, 2.70]]
"#;

#[test]
fn an_older_calibrated_profile_still_loads_and_uses_its_curves() {
    let p = HostProfile::from_toml_str(OLD_CALIBRATED, "old.toml").unwrap();
    let d = &p.devices[0];
    assert!(d.rates.matmul_surface.is_empty() && d.rates.attention_surface.is_empty());
    // Saved again it has no surface fields, and reloads to the same profile.
    let text = p.to_toml_string().unwrap();
    assert!(!text.contains("surface"), "{text}");
    assert_eq!(HostProfile::from_toml_str(&text, "again.toml").unwrap(), p);
    // Intensity 13.26 is a curve point: 0.884 GFLOP/s whatever the work per dispatch;
    // 884 MFLOP takes 1 s, plus 3 dispatches of 135.3 us.
    let m = CostModel::new(&p);
    let t = m
        .compute_us(
            0,
            884_000_000,
            (884e6 / 13.26) as u64,
            3,
            Some(KernelFamily::Matmul),
            Precision::F32,
        )
        .unwrap();
    assert!((t - (1e6 + 3.0 * 135.3)).abs() < 1.0, "{t}");
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

/// `text` is refused as invalid at `field`, with a message that contains `needle` and names
/// the file and the first line containing `line_needle`.
fn assert_invalid_at(text: &str, field: &str, needle: &str, line_needle: &str) {
    let err = HostProfile::from_toml_str(text, "bad.toml").unwrap_err();
    assert!(matches!(err, ProfileError::Invalid { .. }), "{err:?}");
    assert_eq!(err.field(), Some(field), "{err}");
    let line = line_of(text, line_needle);
    let at = err.location().unwrap();
    assert_eq!(
        (at.file.as_str(), at.line),
        ("bad.toml", Some(line)),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("bad.toml:{line}:")), "{msg}");
    assert!(msg.contains(needle), "{msg}");
}

/// `OLD_CALIBRATED` with a surface line added after its attention curve.
fn with_surface(line: &str) -> String {
    OLD_CALIBRATED.replace(
        "attention_curve = [[0.518",
        &format!("{line}\nattention_curve = [[0.518"),
    )
}

/// `OLD_CALIBRATED` with `line` added loads, and saved and reloaded it is unchanged.
fn loads_and_round_trips(line: &str) -> HostProfile {
    let p = HostProfile::from_toml_str(&with_surface(line), "good.toml").unwrap();
    let again = HostProfile::from_toml_str(&p.to_toml_string().unwrap(), "again.toml").unwrap();
    assert_eq!(again, p);
    p
}

#[test]
fn a_malformed_surface_names_file_line_and_field() {
    let good = "matmul_surface = [[[1, 0.1, 10], [16, 1.6, 40]], [[1, 1, 30], [16, 16, 120]]]";
    let p = loads_and_round_trips(good);
    assert_eq!(p.devices[0].rates.matmul_surface, surface());

    for (line, field, needle) in [
        // Intensities of a curve must increase.
        (
            "matmul_surface = [[[1, 0.1, 10], [16, 1.6, 40]], [[16, 1, 30], [1, 16, 120]]]",
            "devices[0].rates.matmul_surface[1][1]",
            "increasing intensity",
        ),
        // No work per dispatch.
        (
            "attention_surface = [[[1, 0, 10]]]",
            "devices[0].rates.attention_surface[0][0][1]",
            "work per dispatch",
        ),
        // A negative rate.
        (
            "matmul_surface = [[[1, 0.1, -10]]]",
            "devices[0].rates.matmul_surface[0][0][2]",
            "GFLOP/s",
        ),
        // A curve with no points.
        (
            "matmul_surface = [[[1, 0.1, 10]], []]",
            "devices[0].rates.matmul_surface[1]",
            "at least one point",
        ),
    ] {
        assert_invalid_at(&with_surface(line), field, needle, "_surface");
    }

    // A point with two numbers instead of three: a parse error at the field's line.
    let text = with_surface("matmul_surface = [[[1, 0.1]]]");
    let err = HostProfile::from_toml_str(&text, "short.toml").unwrap_err();
    assert!(matches!(err, ProfileError::Parse { .. }), "{err:?}");
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "_surface")),
        "{err}"
    );
    assert!(
        err.field()
            .is_some_and(|f| f.starts_with("devices[0].rates.matmul_surface")),
        "{err}"
    );
}

#[test]
fn a_surface_with_widths_interpolates_in_log_width() {
    let s = surface();
    let widths = [64.0, 256.0];
    // At intensity 4 the narrow curve runs 25 GFLOP/s and the wide one 75 (see above);
    // width 128 lies halfway between 64 and 256 in log scale.
    let at = |w: f64| wgpar::sim::rate_on_surface_at_width(&s, &widths, 4.0, w).unwrap();
    assert!(close(at(64.0), 25.0), "{}", at(64.0));
    assert!(close(at(128.0), 50.0), "{}", at(128.0));
    assert!(close(at(256.0), 75.0), "{}", at(256.0));
    // Beyond the narrowest and the widest curve: held.
    assert!(close(at(16.0), 25.0) && close(at(4096.0), 75.0));
    // The curves' order does not matter as long as the widths follow it.
    let reversed: Vec<_> = s.iter().rev().cloned().collect();
    let r = wgpar::sim::rate_on_surface_at_width(&reversed, &[256.0, 64.0], 4.0, 128.0);
    assert!(close(r.unwrap(), 50.0));
    // Widths that do not name every curve: no answer (the caller falls back).
    assert_eq!(
        wgpar::sim::rate_on_surface_at_width(&s, &[64.0], 4.0, 128.0),
        None
    );
}

#[test]
fn a_span_that_records_its_width_is_read_at_it() {
    use wgpar::trace::{SpanAttrs, SpanId};
    let p = profile(
        "matmul_surface = [[[1, 0.1, 10], [16, 1.6, 40]], [[1, 1, 30], [16, 16, 120]]]\n\
         matmul_surface_widths = [64, 256]\n",
    );
    let m = CostModel::new(&p);
    let span = |attrs: SpanAttrs| attrs.into_span(SpanId(0), 0, 1000);
    // 40 MFLOP over 10 MB (intensity 4) in 10 dispatches, 4 MFLOP each: by work per
    // dispatch the wide curve's 75 GFLOP/s; recorded as 128 wide, 50 GFLOP/s, whatever the
    // work per dispatch: 40e6 / 50e3 = 800 us, plus 10 x 2 us of dispatches.
    let work = SpanAttrs::compute("forward", 0)
        .flops(40_000_000)
        .bytes(10_000_000)
        .kernels(10)
        .family(KernelFamily::Matmul);
    let t = m.span_compute_us(0, &span(work.clone())).unwrap();
    assert!(close(t, 40e6 / 75e3 + 20.0), "{t}");
    let t = m
        .span_compute_us(0, &span(work.clone().blocks_of(128, 1)))
        .unwrap();
    assert!(close(t, 40e6 / 50e3 + 20.0), "{t}");
    // A shard of a 256-wide model split 4 ways holds a quarter of its matrices, as a whole
    // block 128 wide does: the same rate.
    let shard = span(work.clone().blocks_of(256, 4));
    assert_eq!(shard.block_width(), Some(128.0));
    let t = m.span_compute_us(0, &shard).unwrap();
    assert!(close(t, 40e6 / 50e3 + 20.0), "{t}");
    // Without widths in the profile, the recorded width changes nothing.
    let p =
        profile("matmul_surface = [[[1, 0.1, 10], [16, 1.6, 40]], [[1, 1, 30], [16, 16, 120]]]\n");
    let t = CostModel::new(&p)
        .span_compute_us(0, &span(work.blocks_of(128, 1)))
        .unwrap();
    assert!(close(t, 40e6 / 75e3 + 20.0), "{t}");
}

#[test]
fn a_spans_head_part_is_priced_at_the_measured_head_rate() {
    use wgpar::trace::{HeadWork, SpanAttrs, SpanId};
    let rates = "matmul_surface = [[[1, 0.1, 10], [16, 1.6, 40]], [[1, 1, 30], [16, 16, 120]]]\n\
                 matmul_surface_widths = [64, 256]\n";
    let with_head = profile(&format!("{rates}head_curve = [[0.5, 20], [2, 80]]\n"));
    let without = profile(rates);
    // A 128-wide matmul span of `flops` over `bytes` in `kernels` dispatches, of which the
    // head is 8 MFLOP over 8 MB (intensity 1, halfway between the head curve's points in
    // log intensity: 50 GFLOP/s).
    let span = |flops: u64, bytes: u64, kernels: u32| {
        SpanAttrs::compute("layers", 0)
            .flops(flops)
            .bytes(bytes)
            .kernels(kernels)
            .family(KernelFamily::Matmul)
            .blocks_of(128, 1)
            .head_part(HeadWork {
                flops: 8_000_000,
                bytes: 8_000_000,
            })
            .into_span(SpanId(0), 0, 1000)
    };
    // 40 MFLOP over 10 MB (intensity 4) in 10 dispatches: 50 GFLOP/s on the surface (see
    // above). The rest: 32 MFLOP over 2 MB, intensity 16, 128 wide: halfway between 40 and
    // 120 in log width = 80 GFLOP/s -> 400 us. The head: 8e6 / 50e3 = 160 us. Dispatches
    // 10 x 2 us.
    let stage = span(40_000_000, 10_000_000, 10);
    let t = CostModel::new(&with_head)
        .span_compute_us(0, &stage)
        .unwrap();
    assert!(close(t, 32e6 / 80e3 + 8e6 / 50e3 + 20.0), "{t}");
    // Without a head curve the head is priced with the rest of the span, as before.
    let t = CostModel::new(&without).span_compute_us(0, &stage).unwrap();
    assert!(close(t, 40e6 / 50e3 + 20.0), "{t}");
    // The curve is an f32 measurement: an f16 span's head is priced with the rest.
    let mut f16 = stage.clone();
    f16.precision = Precision::F16;
    assert_eq!(
        CostModel::new(&with_head).span_compute_us(0, &f16).unwrap(),
        CostModel::new(&without).span_compute_us(0, &f16).unwrap()
    );
    // A span that is all head (the tensor-parallel engine's head span): 160 us + 4 x 2 us.
    let all_head = span(8_000_000, 8_000_000, 4);
    let t = CostModel::new(&with_head)
        .span_compute_us(0, &all_head)
        .unwrap();
    assert!(close(t, 8e6 / 50e3 + 8.0), "{t}");
}

#[test]
fn a_malformed_head_curve_names_file_line_and_field() {
    let p = loads_and_round_trips("head_curve = [[0.5, 20], [2, 80]]");
    assert_eq!(
        p.devices[0].rates.head_curve,
        vec![[0.5, 20.0], [2.0, 80.0]]
    );
    for (line, field, needle) in [
        (
            "head_curve = [[2, 20], [0.5, 80]]",
            "devices[0].rates.head_curve[1]",
            "strictly increasing intensity",
        ),
        (
            "head_curve = [[0.5, -20]]",
            "devices[0].rates.head_curve[0][1]",
            "GFLOP/s",
        ),
    ] {
        assert_invalid_at(&with_surface(line), field, needle, "head_curve");
    }
}

#[test]
fn malformed_surface_widths_name_file_line_and_field() {
    let curves = "matmul_surface = [[[1, 0.1, 10], [16, 1.6, 40]], [[1, 1, 30], [16, 16, 120]]]";
    let good = format!("{curves}\nmatmul_surface_widths = [64, 256]");
    let p = HostProfile::from_toml_str(&with_surface(&good), "good.toml").unwrap();
    assert_eq!(p.devices[0].rates.matmul_surface_widths, vec![64.0, 256.0]);
    let again = HostProfile::from_toml_str(&p.to_toml_string().unwrap(), "again.toml").unwrap();
    assert_eq!(again, p);
    for (widths, field, needle) in [
        (
            "matmul_surface_widths = [64]",
            "devices[0].rates.matmul_surface_widths",
            "one width per curve",
        ),
        (
            "matmul_surface_widths = [64, 0]",
            "devices[0].rates.matmul_surface_widths[1]",
            "block width",
        ),
        // Widths for a surface that has no curves.
        (
            "attention_surface_widths = [64]",
            "devices[0].rates.attention_surface_widths",
            "one width per curve",
        ),
    ] {
        let text = with_surface(&format!("{curves}\n{widths}"));
        assert_invalid_at(&text, field, needle, "_surface_widths");
    }
}
