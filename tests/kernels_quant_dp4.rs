//! The integer-dot GEMV variants (`qdp4gemv*`, `qdp4x2gemv*`) against the CPU: every variant
//! of every packed type computes `x . dequant(w)^T + bias` within its rounding's bound of an
//! f64 product of llama.cpp's dequantization (the `gguf` package's numpy code) of random
//! blocks, on ragged shapes (rows not a multiple of the workgroup's, widths that end in a
//! partial staging tile), into poisoned outputs.
//!
//! The bounds come from the reference data, not from the kernel: quantizing each input to
//! `d * round(x / d)` with `d` = its 32-value group's largest |x| / 127 moves the product by at
//! most `sum_j |w_j| * d_j / 2` (one part); rounding the residual again on a grid of `d / 254`
//! leaves at most `sum_j |w_j| * d_j / 508` (two parts); f32 accumulation adds a relative 1e-5
//! of `sum_j |w_j| |x_j|`. The one-part check with the int8 term left out (a deliberately
//! wrong bound) must fail, or the kernel did not quantize its inputs and the test would prove
//! nothing; the two-part error must be far below the one-part error on the same data, or the
//! residual was dropped. On SmolLM2-135M itself, the two-part GEMVs in every layer keep the
//! f32 GEMVs' greedy tokens.

mod common;
mod gguf_support;

use gguf_support::{llama_dequantize, random_blocks};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wgpar::device::DType;
use wgpar::device::{open_devices, Adapters, DeviceSelection, GpuOptions};
use wgpar::kernels::quant::{
    choose_quant, choose_quant_for, quant_candidates, tuned_candidates, PackedMatrix, QuantClass,
    QuantIo, QuantRole, QuantVariant,
};
use wgpar::kernels::quant_dp4::{self, DP4_VARIANTS};
use wgpar::kernels::tune::{self, TuneMode, TuneSettings};
use wgpar::kernels::Family;
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::QuantType;
use wgpar::model::ModelWeights;
use wgpar::parallel::{Engine, SingleEngine};
use wgpar::server::{ChatTemplate, Message};

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

/// Per output: the f64 product, and the bounds' terms (one-part int8 rounding, two-part
/// residual rounding, f32 slack).
struct Reference {
    want: Vec<f64>,
    int8: Vec<f64>,
    residual: Vec<f64>,
    f32_slack: Vec<f64>,
}

impl Reference {
    /// Output i's bound for variant `v`.
    fn bound(&self, v: &QuantVariant, i: usize) -> f64 {
        let rounding = if quant_dp4::two_part(v) {
            self.residual[i]
        } else {
            self.int8[i]
        };
        rounding + self.f32_slack[i]
    }
}

fn reference(x: &[f32], w: &[f32], bias: &[f32], (m, n, k): (usize, usize, usize)) -> Reference {
    let mut r = Reference {
        want: vec![0.0; m * n],
        int8: vec![0.0; m * n],
        residual: vec![0.0; m * n],
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
            r.residual[i * n + j] = int8 / 254.0;
            r.f32_slack[i * n + j] = 1e-5 * (mag + bias[j].abs() as f64);
        }
    }
    r
}

/// What [`check`] found: outputs outside the bound (non-finite ones included), the largest
/// error / bound, and the largest error.
struct Checked {
    outside: usize,
    ratio: f64,
    error: f64,
}

fn check(got: &[f32], want: &[f64], bound: &dyn Fn(usize) -> f64) -> Checked {
    let mut c = Checked {
        outside: 0,
        ratio: 0.0,
        error: 0.0,
    };
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        if !g.is_finite() || err > bound(i) {
            c.outside += 1;
        }
        c.ratio = c.ratio.max(err / bound(i));
        c.error = c.error.max(err);
    }
    c
}

/// The largest errors of the one-part and the two-part variants of a type, and the largest
/// error / bound of each.
#[derive(Default)]
struct Worst {
    one: f64,
    two: f64,
    ratios: [f64; 2],
}

impl Worst {
    fn add(&mut self, v: &QuantVariant, c: &Checked) {
        let two = quant_dp4::two_part(v);
        let slot = if two { &mut self.two } else { &mut self.one };
        *slot = slot.max(c.error);
        self.ratios[two as usize] = self.ratios[two as usize].max(c.ratio);
    }

    /// The two-part error must be far below the one-part one: 254x in the rounding bounds,
    /// asserted 50x, which dropping the residual (the one-part error) cannot pass.
    fn assert_residual_kept(&self, what: &str) {
        eprintln!(
            "{what}: largest error one part {:.3e} ({:.3} x its bound), two parts {:.3e} \
             ({:.3} x its bound), {:.0}x smaller",
            self.one,
            self.ratios[0],
            self.two,
            self.ratios[1],
            self.one / self.two
        );
        assert!(
            self.one > 0.0 && self.two * 50.0 < self.one,
            "{what}: two-part error {} against one-part {}: residual dropped?",
            self.two,
            self.one
        );
    }
}

#[test]
fn every_dp4_variant_stays_within_its_rounding_bound_of_llama_cpps_product() {
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
        let (mut loose, mut worst) = (0usize, Worst::default());
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
                let c = check(&got, &r.want, &|i| r.bound(v, i));
                assert_eq!(
                    c.outside, 0,
                    "{} at {m}x{n}x{k}: {} x the bound",
                    v.name, c.ratio
                );
                worst.add(v, &c);
                if !quant_dp4::two_part(v) {
                    // Without the int8 term the bound is wrong, and the check must say so.
                    loose += check(&got, &r.want, &|i| r.f32_slack[i]).outside;
                }
                compared += got.len();
            }
        }
        worst.assert_residual_kept(&format!("{t:?} k={k}"));
        assert!(
            loose > 0,
            "{t:?}: no output beyond f32 rounding: inputs not quantized?"
        );
    }
    assert!(compared > 10_000, "compared {compared} outputs");
}

/// At the shape of SmolLM2-135M's Q8_0 head (49,152 rows of 576: k is 4.5 staging tiles of
/// 128 words and ends in a partial 512-value tile, 6,144 workgroups), every output of every
/// variant stays within its bound, and the one-part variants' inputs were rounded to int8: the
/// kernel has no fault at this shape, so the head's changed answer comes from the rounding.
#[test]
fn q8_0_at_the_lm_head_shape_stays_within_the_bounds() {
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
            let c = check(&got, &r.want, &|i| r.bound(v, i));
            assert_eq!(
                c.outside, 0,
                "{} at {m}x{n}x{k}: {} x the bound",
                v.name, c.ratio
            );
            if !quant_dp4::two_part(v) {
                let loose = check(&got, &r.want, &|i| r.f32_slack[i]).outside;
                assert!(loose > 0, "{}: no output beyond f32 rounding", v.name);
            }
            eprintln!(
                "{} {m}x{n}x{k}: largest error {:.3e}, {:.3} x its bound",
                v.name, c.error, c.ratio
            );
            compared += got.len();
        }
    }
    assert_eq!(compared, 4 * (1 + 3) * n);
}

/// SmolLM2-135M's own matrices: its tied Q8_0 head (49,152 x 576) and layer 0's Q4_1 down
/// projection (576 x 1,536), one input row with outliers as its hidden states have. Every
/// variant stays within its bound, and the two-part error is far below the one-part error
/// (the head's logits move by the figures this prints).
#[test]
fn on_smollm2s_matrices_two_parts_are_far_more_accurate_than_one() {
    let gpu = common::gpus(1).remove(0);
    let ckpt = Checkpoint::open(&common::smollm2_gguf()).unwrap();
    let file = ckpt.gguf().unwrap().file();
    let mut compared = 0;
    for (name, t) in [
        ("token_embd.weight", QuantType::Q8_0),
        ("blk.0.ffn_down.weight", QuantType::Q4_1),
    ] {
        let info = file.tensor(name).unwrap();
        assert_eq!(info.dtype, t, "{name}");
        let (k, n) = (info.dims[0], info.dims[1]);
        let packed = file.data(info);
        let w = llama_dequantize(t, packed);
        let wt = PackedMatrix::upload(&gpu, name, t, packed, (n, k)).unwrap();
        let x: Vec<f32> = inputs(k, 23).iter().map(|v| v * 1.6).collect();
        let r = reference(&x, &w, &vec![0.0; n], (1, n, k));
        let xt = gpu.upload_f32("x", &x).unwrap();
        let yt = gpu.upload_f32("y", &vec![0.0; n]).unwrap();
        let mut worst = Worst::default();
        for v in DP4_VARIANTS.iter().filter(|v| v.qtype == t) {
            let io = QuantIo {
                x: &xt,
                w: &wt,
                bias: None,
                y: &yt,
            };
            let got = common::packed_matmul(&gpu, io, 1, Some(v.name));
            let c = check(&got, &r.want, &|i| r.bound(v, i));
            assert_eq!(
                c.outside, 0,
                "{} on {name}: {} x the bound",
                v.name, c.ratio
            );
            worst.add(v, &c);
            compared += got.len();
        }
        worst.assert_residual_kept(name);
    }
    assert_eq!(compared, 4 * (49_152 + 576));
}

/// The rule that keeps the integer-dot GEMVs off the LM head, and the one-part ones off the
/// tuner's list: the head ([`QuantRole::Logits`]) never has any as candidates, forced or not,
/// and has its own tuning class; a layer's decode rows may be forced to any of them, and the
/// tuner times the two-part ones.
#[test]
fn the_tuner_times_two_part_variants_in_the_layers_only() {
    let gpu = common::gpus(1).remove(0);
    if let Err(why) = quant_dp4::offered(&gpu) {
        common::feature_missing("native dot4I8Packed", &format!("the head rule ({why})"));
        return;
    }
    let dp4 = |vs: Vec<&'static QuantVariant>| -> Vec<&'static str> {
        assert!(!vs.is_empty());
        (vs.iter())
            .filter(|v| v.family() == Family::MatmulQuantDp4)
            .map(|v| v.name)
            .collect()
    };
    for t in [
        QuantType::Q8_0,
        QuantType::Q4_1,
        QuantType::Q4K,
        QuantType::Q6K,
    ] {
        let s = t.name();
        let all = dp4(quant_candidates(&gpu, t, 1, QuantRole::Layer));
        let two = [format!("qdp4x2gemv64_{s}"), format!("qdp4x2gemv128_{s}")];
        assert_eq!(all.len(), 4, "{all:?}");
        assert!(two.iter().all(|n| all.contains(&n.as_str())), "{all:?}");
        assert_eq!(dp4(tuned_candidates(&gpu, t, 1, QuantRole::Layer)), two);
        assert_eq!(dp4(tuned_candidates(&gpu, t, 8, QuantRole::Layer)), two);
        for tuned in [false, true] {
            let pick = if tuned {
                tuned_candidates
            } else {
                quant_candidates
            };
            assert!(dp4(pick(&gpu, t, 8, QuantRole::Logits)).is_empty(), "{t:?}");
            assert!(dp4(pick(&gpu, t, 9, QuantRole::Layer)).is_empty(), "{t:?}");
        }
    }
    let shape = (1, 49_152, 576);
    let class = QuantClass::of(QuantType::Q8_0, shape);
    assert_ne!(class.key(), class.in_role(QuantRole::Logits).key());
    // Forced, with tuning off (no timing): the layer takes it, the head its default GEMV.
    for forced in ["qdp4gemv64_q8_0", "qdp4x2gemv128_q8_0"] {
        tune::configure(TuneSettings {
            mode: TuneMode::Off,
            forced: vec![forced.into()],
            cache_dir: None,
        });
        let gpu = common::gpus(1).remove(0);
        let layer = choose_quant_for(&gpu, QuantType::Q8_0, shape, QuantRole::Layer).unwrap();
        let head = choose_quant_for(&gpu, QuantType::Q8_0, shape, QuantRole::Logits).unwrap();
        assert_eq!((layer.name, head.name), (forced, "qgemv64_q8_0"));
    }
    tune::configure(TuneSettings::from_env().unwrap());
}

/// SmolLM2-135M's chat prompt with every prompt token run as a decode step, so that every
/// layer matmul is a GEMV and the forced kernels compute the near tie of its first answer
/// token ("The" over "L" by 0.08 logits in f64): its greedy tokens with tuning off and
/// `forced` names.
fn smollm2_chat_tokens(w: &ModelWeights, prompt: &[u32], forced: &[&str]) -> Vec<u32> {
    tune::configure(TuneSettings {
        mode: TuneMode::Off,
        forced: forced.iter().map(|s| s.to_string()).collect(),
        cache_dir: None,
    });
    let gpu = common::gpus(1).remove(0);
    // The layers' matmuls (every one Q4_1) run what was forced.
    let down = choose_quant(&gpu, QuantType::Q4_1, (1, 576, 1536)).unwrap();
    assert_eq!(down.name, forced.first().copied().unwrap_or("qgemv64_q4_1"));
    let mut engine = SingleEngine::new(gpu, w, DType::F32).unwrap();
    let mut step = engine.prefill_step(&[prompt[..1].to_vec()], false).unwrap();
    for &t in &prompt[1..] {
        step = engine.decode_step(&[t], false).unwrap();
    }
    let mut tokens = vec![step.tokens[0]];
    while tokens.len() < 3 {
        let next = engine
            .decode_step(&[tokens[tokens.len() - 1]], false)
            .unwrap();
        tokens.push(next.tokens[0]);
    }
    tune::configure(TuneSettings::from_env().unwrap());
    tokens
}

/// The two-part GEMVs forced for every layer matmul of the released SmolLM2-135M (its head
/// keeps its f32 GEMV: the head never runs an integer-dot variant) answer the chat with the
/// f32 GEMVs' greedy tokens, "The capital of ...". The one-part ones flip the first token,
/// which shows the prompt discriminates and the forced kernels ran.
#[test]
fn smollm2_keeps_its_greedy_tokens_with_two_part_layers() {
    let probe = common::gpus(1).remove(0);
    if let Err(why) = quant_dp4::offered(&probe) {
        common::feature_missing("native dot4I8Packed", &format!("the real model ({why})"));
        return;
    }
    drop(probe);
    let mut ckpt = Checkpoint::open(&common::smollm2_gguf()).unwrap();
    ckpt.limit_context(64).unwrap();
    let template = ChatTemplate::from_gguf(ckpt.gguf().unwrap().file())
        .unwrap()
        .unwrap();
    let chat = [Message::text("user", "What is the capital of France?")];
    let text = template.render(&chat, true).unwrap();
    let tokenizer = ckpt.tokenizer().unwrap();
    let prompt = tokenizer.encode_plain(&text).unwrap();
    let w = ckpt.weights(false).unwrap();
    let f32_gemv = smollm2_chat_tokens(&w, &prompt, &[]);
    let two = smollm2_chat_tokens(&w, &prompt, &["qdp4x2gemv64_q4_1"]);
    let one = smollm2_chat_tokens(&w, &prompt, &["qdp4gemv64_q4_1"]);
    let words = |t: &[u32]| tokenizer.decode(t).unwrap();
    eprintln!(
        "f32 GEMVs {:?}, two parts {:?}, one part {:?}",
        words(&f32_gemv),
        words(&two),
        words(&one)
    );
    assert!(words(&f32_gemv).starts_with("The capital"), "{f32_gemv:?}");
    assert_eq!(two, f32_gemv);
    assert_ne!(
        one[0], f32_gemv[0],
        "the one-part rounding no longer flips the tie"
    );
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
    let names = "qdp4gemv128_q4_k,qdp4gemv64_q8_0,qdp4x2gemv64_q6_k";
    assert!(tune::parse_forced("WGPAR_KERNELS", names).is_ok());
    tune::configure(forced(&["qdp4gemv128_q4_k"]));
    let gpu = common::gpus(1).remove(0);
    let chosen = choose_quant(&gpu, QuantType::Q4K, (2, 40, 256));
    let q4k = quant_dp4::candidates(&gpu, QuantType::Q4K);
    match quant_dp4::offered(&gpu) {
        Ok(()) => {
            assert_eq!(chosen.unwrap().name, "qdp4gemv128_q4_k");
            assert_eq!(q4k.len(), 4);
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
        assert!(
            !prefill.is_gemv() && prefill.name.starts_with("qgemm"),
            "{}",
            prefill.name
        );
    }
    tune::configure(TuneSettings::from_env().unwrap());
}

/// On llvmpipe's GL adapter naga emulates `dot4I8Packed`: the variants are no candidates
/// there, forcing one is refused with that reason, and one named explicitly (either
/// rounding) still computes within its bound (the emulation is exact).
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
    for name in ["qdp4gemv64_q4_0", "qdp4x2gemv64_q4_0"] {
        let v = quant_dp4::by_name(name).unwrap();
        let got = common::packed_matmul(&gpu, io, m, Some(name));
        let c = check(&got, &r.want, &|i| r.bound(v, i));
        assert_eq!(
            (c.outside, got.len()),
            (0, m * n),
            "{name}: {} x the bound",
            c.ratio
        );
    }
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
    assert_eq!(DP4_VARIANTS.len(), 4 * packed);
    assert_eq!(
        DP4_VARIANTS
            .iter()
            .filter(|v| quant_dp4::two_part(v))
            .count(),
        2 * packed
    );
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
