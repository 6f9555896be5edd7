//! The integer-dot GEMV variants (`qdp4gemv*`) against the CPU: every variant of every packed
//! type computes `x . dequant(w)^T + bias` within the int8 bound of an f64 product of
//! llama.cpp's dequantization (the `gguf` package's numpy code) of random blocks, on ragged
//! shapes (rows not a multiple of the workgroup's, widths that end in a partial staging tile),
//! into poisoned outputs.
//!
//! The bound comes from the reference data, not from the kernel: quantizing each input to
//! `d * round(x / d)` with `d` = its 32-value group's largest |x| / 127 moves the product by at
//! most `sum_j |w_j| * d_j / 2`; f32 accumulation adds a relative 1e-5 of `sum_j |w_j| |x_j|`.
//! The same check with the int8 term left out (a deliberately wrong bound) must fail, or the
//! kernel did not quantize its inputs and the test would prove nothing.

mod common;
mod gguf_support;

use gguf_support::{llama_dequantize, random_blocks};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wgpar::device::{open_devices, Adapters, DeviceSelection, GpuOptions};
use wgpar::kernels::quant::{
    choose_quant, choose_quant_for, quant_candidates, tuned_candidates, PackedMatrix, QuantClass,
    QuantIo, QuantRole, QuantVariant,
};
use wgpar::kernels::quant_dp4::{self, DP4_VARIANTS};
use wgpar::kernels::tune::{self, TuneMode, TuneSettings};
use wgpar::kernels::Family;
use wgpar::model::quant::QuantType;

/// Every block type, with widths past one 512-value staging tile that end in a partial one.
const TYPES: [(QuantType, usize); 12] = [
    (QuantType::Q8_0, 576),
    (QuantType::Q4_0, 160),
    (QuantType::Q4_1, 608),
    (QuantType::Q5_0, 576),
    (QuantType::Q5_1, 96),
    (QuantType::Iq4Nl, 544),
    (QuantType::Q2K, 256),
    (QuantType::Q3K, 768),
    (QuantType::Q4K, 768),
    (QuantType::Q5K, 768),
    (QuantType::Q6K, 768),
    (QuantType::Iq4Xs, 512),
];

/// Random inputs in (-1, 1), every 29th scaled by 20: groups with an outlier get a coarse
/// scale, as real activations do.
fn inputs(len: usize, seed: u64) -> Vec<f32> {
    let mut x = common::random(len, seed);
    x.iter_mut().step_by(29).for_each(|v| *v *= 20.0);
    x
}

/// Per output: the f64 product, and the bound's two terms (int8 rounding, f32 slack).
struct Reference {
    want: Vec<f64>,
    int8: Vec<f64>,
    f32_slack: Vec<f64>,
}

fn reference(x: &[f32], w: &[f32], bias: &[f32], (m, n, k): (usize, usize, usize)) -> Reference {
    let mut r = Reference {
        want: vec![0.0; m * n],
        int8: vec![0.0; m * n],
        f32_slack: vec![0.0; m * n],
    };
    for i in 0..m {
        let row = &x[i * k..(i + 1) * k];
        // d per 32-value group, as llama.cpp's q8_1 takes it.
        let d: Vec<f64> = (row.chunks(32))
            .map(|g| g.iter().fold(0.0f64, |a, v| a.max(v.abs() as f64)) / 127.0)
            .collect();
        for j in 0..n {
            let (mut dot, mut int8, mut mag) = (0.0f64, 0.0f64, 0.0f64);
            for t in 0..k {
                let (xv, wv) = (row[t] as f64, w[j * k + t] as f64);
                dot += xv * wv;
                int8 += wv.abs() * d[t / 32] / 2.0;
                mag += wv.abs() * (xv.abs() + d[t / 32]);
            }
            r.want[i * n + j] = dot + bias[j] as f64;
            r.int8[i * n + j] = int8;
            r.f32_slack[i * n + j] = 1e-5 * (mag + bias[j].abs() as f64);
        }
    }
    r
}

/// Outputs outside `bound` (non-finite ones included), and the largest error / bound.
fn check(got: &[f32], want: &[f64], bound: &dyn Fn(usize) -> f64) -> (usize, f64) {
    let mut worst = 0.0f64;
    let mut outside = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        if !g.is_finite() || err > bound(i) {
            outside += 1;
        }
        worst = worst.max(err / bound(i));
    }
    (outside, worst)
}

#[test]
fn every_dp4_variant_stays_within_the_int8_bound_of_llama_cpps_product() {
    let gpu = common::gpus(1).remove(0);
    eprintln!(
        "{}: dot4I8Packed {:?}",
        gpu.info().label(),
        quant_dp4::offered(&gpu)
    );
    let mut compared = 0usize;
    for (t, k) in TYPES {
        let mut rng = ChaCha8Rng::seed_from_u64(3 + k as u64);
        let all = random_blocks(t, 70 * k / t.block_len(), &mut rng);
        let all_deq = llama_dequantize(t, &all);
        let (mut worst, mut loose) = (0.0f64, 0usize);
        for (m, n) in [(1, 37), (3, 70), (8, 5)] {
            let row = t.row_bytes(k).unwrap();
            let (packed, w) = (&all[..n * row], &all_deq[..n * k]);
            let x = inputs(m * k, 11 + m as u64);
            let bias = common::random(n, 13);
            let r = reference(&x, w, &bias, (m, n, k));
            let wt = PackedMatrix::upload(&gpu, "w", t, packed, (n, k)).unwrap();
            let xt = gpu.upload_f32("x", &x).unwrap();
            let bt = gpu.upload_f32("bias", &bias).unwrap();
            let yt = gpu.upload_f32("y", &vec![0.0; m * n]).unwrap();
            for v in DP4_VARIANTS.iter().filter(|v| v.qtype == t) {
                let io = QuantIo {
                    x: &xt,
                    w: &wt,
                    bias: Some(&bt),
                    y: &yt,
                };
                let got = common::packed_matmul(&gpu, io, m, Some(v.name));
                let bound = |i: usize| r.int8[i] + r.f32_slack[i];
                let (outside, ratio) = check(&got, &r.want, &bound);
                assert_eq!(outside, 0, "{} at {m}x{n}x{k}: {ratio} x the bound", v.name);
                worst = worst.max(ratio);
                // Without the int8 term the bound is wrong, and the check must say so.
                loose += check(&got, &r.want, &|i| r.f32_slack[i]).0;
                compared += got.len();
            }
        }
        eprintln!("{t:?} k={k}: largest error {worst:.3} x the int8 bound");
        assert!(
            loose > 0,
            "{t:?}: no output beyond f32 rounding: inputs not quantized?"
        );
    }
    assert!(compared > 5_000, "compared {compared} outputs");
}

/// At the shape of SmolLM2-135M's Q8_0 head (49,152 rows of 576: k is 4.5 staging tiles of
/// 128 words and ends in a partial 512-value tile, 6,144 workgroups), every output of both
/// variants stays within the int8 bound, and the inputs were rounded to int8: the kernel has
/// no fault at this shape, so the head's changed answer comes from the rounding itself.
#[test]
fn q8_0_at_the_lm_head_shape_stays_within_the_int8_bound() {
    let gpu = common::gpus(1).remove(0);
    let (t, n, k) = (QuantType::Q8_0, 49_152, 576);
    let packed = random_blocks(t, n * k / 32, &mut ChaCha8Rng::seed_from_u64(17));
    let w = llama_dequantize(t, &packed);
    let wt = PackedMatrix::upload(&gpu, "w", t, &packed, (n, k)).unwrap();
    let mut compared = 0;
    for m in [1, 3] {
        let x = inputs(m * k, 19 + m as u64);
        let r = reference(&x, &w, &vec![0.0; n], (m, n, k));
        let xt = gpu.upload_f32("x", &x).unwrap();
        let yt = gpu.upload_f32("y", &vec![0.0; m * n]).unwrap();
        for v in DP4_VARIANTS.iter().filter(|v| v.qtype == t) {
            let io = QuantIo {
                x: &xt,
                w: &wt,
                bias: None,
                y: &yt,
            };
            let got = common::packed_matmul(&gpu, io, m, Some(v.name));
            let (outside, ratio) = check(&got, &r.want, &|i| r.int8[i] + r.f32_slack[i]);
            assert_eq!(outside, 0, "{} at {m}x{n}x{k}: {ratio} x the bound", v.name);
            let loose = check(&got, &r.want, &|i| r.f32_slack[i]).0;
            assert!(loose > 0, "{}: no output beyond f32 rounding", v.name);
            eprintln!(
                "{} {m}x{n}x{k}: largest error {ratio:.3} x the int8 bound",
                v.name
            );
            compared += got.len();
        }
    }
    assert_eq!(compared, 2 * 4 * n);
}

/// The rule that keeps the integer-dot GEMVs off the LM head, and off the tuner's list: the
/// head ([`QuantRole::Logits`]) never has them as candidates, forced or not, and has its own
/// tuning class; a layer's decode rows take them only when forced.
#[test]
fn the_lm_head_never_runs_an_integer_dot_variant() {
    let gpu = common::gpus(1).remove(0);
    if let Err(why) = quant_dp4::offered(&gpu) {
        common::feature_missing("native dot4I8Packed", &format!("the head rule ({why})"));
        return;
    }
    let dp4 = |vs: Vec<&'static QuantVariant>| {
        assert!(!vs.is_empty());
        (vs.iter())
            .filter(|v| v.family() == Family::MatmulQuantDp4)
            .count()
    };
    for t in [QuantType::Q8_0, QuantType::Q4K, QuantType::Q6K] {
        assert_eq!(
            dp4(quant_candidates(&gpu, t, 1, QuantRole::Layer)),
            2,
            "{t:?}"
        );
        assert_eq!(
            dp4(quant_candidates(&gpu, t, 8, QuantRole::Logits)),
            0,
            "{t:?}"
        );
        assert_eq!(
            dp4(quant_candidates(&gpu, t, 9, QuantRole::Layer)),
            0,
            "{t:?}"
        );
        assert_eq!(
            dp4(tuned_candidates(&gpu, t, 1, QuantRole::Layer)),
            0,
            "{t:?}"
        );
    }
    let shape = (1, 49_152, 576);
    let class = QuantClass::of(QuantType::Q8_0, shape);
    assert_ne!(class.key(), class.in_role(QuantRole::Logits).key());
    // Forced, with tuning off (no timing): the layer takes it, the head its default GEMV.
    tune::configure(TuneSettings {
        mode: TuneMode::Off,
        forced: vec!["qdp4gemv64_q8_0".into()],
        cache_dir: None,
    });
    let gpu = common::gpus(1).remove(0);
    let layer = choose_quant_for(&gpu, QuantType::Q8_0, shape, QuantRole::Layer).unwrap();
    let head = choose_quant_for(&gpu, QuantType::Q8_0, shape, QuantRole::Logits).unwrap();
    assert_eq!((layer.name, head.name), ("qdp4gemv64_q8_0", "qgemv64_q8_0"));
    tune::configure(TuneSettings::from_env().unwrap());
}

/// A forced integer-dot variant runs where the adapter offers native integer dot products,
/// and is refused by name, with the reason, where it does not; the tuner's candidates
/// follow the same gate.
#[test]
fn forced_dp4_variants_follow_the_adapters_offer() {
    let forced = |names: &[&str]| TuneSettings {
        mode: TuneMode::Auto,
        forced: names.iter().map(|s| s.to_string()).collect(),
        cache_dir: None,
    };
    assert!(tune::parse_forced("WGPAR_KERNELS", "qdp4gemv128_q4_k,qdp4gemv64_q8_0").is_ok());
    tune::configure(forced(&["qdp4gemv128_q4_k"]));
    let gpu = common::gpus(1).remove(0);
    let chosen = choose_quant(&gpu, QuantType::Q4K, (2, 40, 256));
    let q4k = quant_dp4::candidates(&gpu, QuantType::Q4K);
    match quant_dp4::offered(&gpu) {
        Ok(()) => {
            assert_eq!(chosen.unwrap().name, "qdp4gemv128_q4_k");
            assert_eq!(q4k.len(), 2);
        }
        Err(why) => {
            let e = chosen.unwrap_err().to_string();
            assert!(e.contains("qdp4gemv128_q4_k") && e.contains(&why), "{e}");
            assert!(q4k.is_empty());
        }
    }
    // Prefill rows never take a GEMV.
    tune::configure(forced(&["qdp4gemv64_q8_0"]));
    let gpu = common::gpus(1).remove(0);
    if quant_dp4::offered(&gpu).is_ok() {
        let prefill = choose_quant(&gpu, QuantType::Q8_0, (9, 40, 64)).unwrap();
        assert_eq!(prefill.name, "qgemm_q8_0");
    }
    tune::configure(TuneSettings::from_env().unwrap());
}

/// On llvmpipe's GL adapter naga emulates `dot4I8Packed`: the variants are no candidates
/// there, forcing one is refused with that reason, and one named explicitly still computes
/// within the bound (the emulation is exact).
#[test]
fn on_gl_the_dp4_variants_are_not_offered() {
    let adapters = Adapters::discover().unwrap();
    let Some(gl) = adapters.list().iter().find(|a| a.backend == "Gl") else {
        common::feature_missing("a GL adapter", "the integer-dot gate's refusal");
        return;
    };
    tune::configure(TuneSettings {
        mode: TuneMode::Auto,
        forced: vec!["qdp4gemv64_q4_0".into()],
        cache_dir: None,
    });
    let selection = DeviceSelection::Indices(vec![gl.index]);
    let gpu = open_devices(&adapters, &selection, &GpuOptions::default())
        .unwrap()
        .remove(0);
    let why = quant_dp4::offered(&gpu).unwrap_err();
    assert!(why.contains("Gl") && why.contains("emulates"), "{why}");
    assert!(quant_dp4::candidates(&gpu, QuantType::Q4_0).is_empty());
    let e = choose_quant(&gpu, QuantType::Q4_0, (1, 40, 64)).unwrap_err();
    assert!(e.to_string().contains("qdp4gemv64_q4_0") && e.to_string().contains(&why));
    tune::configure(TuneSettings::from_env().unwrap());
    let (t, (m, n, k)) = (QuantType::Q4_0, (2, 21, 96));
    let packed = random_blocks(t, n * k / 32, &mut ChaCha8Rng::seed_from_u64(5));
    let (x, bias) = (inputs(m * k, 6), common::random(n, 7));
    let r = reference(&x, &llama_dequantize(t, &packed), &bias, (m, n, k));
    let wt = PackedMatrix::upload(&gpu, "w", t, &packed, (n, k)).unwrap();
    let (xt, bt) = (
        gpu.upload_f32("x", &x).unwrap(),
        gpu.upload_f32("b", &bias).unwrap(),
    );
    let yt = gpu.upload_f32("y", &vec![0.0; m * n]).unwrap();
    let io = QuantIo {
        x: &xt,
        w: &wt,
        bias: Some(&bt),
        y: &yt,
    };
    let got = common::packed_matmul(&gpu, io, m, Some("qdp4gemv64_q4_0"));
    let (outside, ratio) = check(&got, &r.want, &|i| r.int8[i] + r.f32_slack[i]);
    assert_eq!((outside, got.len()), (0, m * n), "{ratio} x the bound");
}

/// Every variant's module, with its override constants applied as wgpu applies them,
/// validates with naga (no GPU needed), and its workgroup fits 256 invocations.
#[test]
fn every_dp4_variant_validates_with_naga() {
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let src = Family::MatmulQuantDp4.source();
    let module =
        naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{}", e.emit_to_string(src)));
    let mut validator = Validator::new(ValidationFlags::all(), Capabilities::all());
    let info = validator.validate(&module).unwrap();
    let packed = wgpar::model::quant::ALL_TYPES
        .iter()
        .filter(|t| t.is_quantized())
        .count();
    assert_eq!(DP4_VARIANTS.len(), 2 * packed);
    for v in DP4_VARIANTS {
        assert!(
            v.is_gemv() && v.family() == Family::MatmulQuantDp4,
            "{}",
            v.name
        );
        let constants: naga::back::PipelineConstants = v
            .constants
            .iter()
            .map(|(k, c)| (k.to_string(), *c))
            .collect();
        let (done, _) = naga::back::pipeline_constants::process_overrides(
            &module,
            &info,
            Some((naga::ShaderStage::Compute, v.entry)),
            &constants,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", v.name));
        validator
            .validate(&done)
            .unwrap_or_else(|e| panic!("{}: {e}", v.name));
        let ep = done
            .entry_points
            .iter()
            .find(|e| e.name == v.entry)
            .unwrap();
        let threads: u32 = ep.workgroup_size.iter().product();
        assert!((64..=256).contains(&threads), "{}: {threads}", v.name);
        let suffix = v.name.split_once('_').unwrap().1;
        assert_eq!(v.qtype.name(), suffix, "{}", v.name);
    }
}
