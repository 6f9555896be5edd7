//! The quantized matmul kernels against the CPU: every variant of every packed type computes
//! `x . dequant(w)^T + bias` like an f64 product of the CPU dequantization, on shapes whose
//! rows and columns are not multiples of the GEMV's or GEMM's tiles, into poisoned outputs.

mod common;

use wgpar::kernels::quant::{quant_matmul, PackedMatrix, QuantIo, GEMV_MAX_ROWS, QUANT_VARIANTS};
use wgpar::model::quant::{dequantize, quantize, QuantType};

fn reference(x: &[f32], w: &[f32], bias: &[f32], (m, n, k): (usize, usize, usize)) -> Vec<f64> {
    let mut y = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                .sum();
            y[i * n + j] = dot + bias[j] as f64;
        }
    }
    y
}

#[test]
fn every_variant_matches_the_cpu_dequantization() {
    let gpu = common::gpus(1).remove(0);
    let mut compared = 0usize;
    for (t, k) in [
        (QuantType::Q8_0, 96),
        (QuantType::Q4_0, 160),
        (QuantType::Q4K, 512),
        (QuantType::Q6K, 256),
    ] {
        for (m, n) in [(1, 37), (3, 70), (8, 5), (45, 70), (9, 131)] {
            let w = common::random(n * k, 7 + n as u64);
            let packed = quantize(t, &w);
            let w_deq = dequantize(t, &packed);
            let x = common::random(m * k, 11 + m as u64);
            let bias = common::random(n, 13);
            let want = reference(&x, &w_deq, &bias, (m, n, k));
            let wt = PackedMatrix::upload(&gpu, "w", t, &packed, (n, k)).unwrap();
            let xt = gpu.upload_f32("x", &x).unwrap();
            let bt = gpu.upload_f32("bias", &bias).unwrap();
            let yt = gpu.upload_f32("y", &vec![0.0; m * n]).unwrap();
            for v in QUANT_VARIANTS.iter().filter(|v| v.qtype == t) {
                if v.is_gemv() && m > GEMV_MAX_ROWS {
                    continue;
                }
                gpu.poison(&yt);
                let mut enc = gpu.encoder();
                let io = QuantIo {
                    x: &xt,
                    w: &wt,
                    bias: Some(&bt),
                    y: &yt,
                };
                quant_matmul(&gpu, &mut enc, io, m, Some(v.name)).unwrap();
                gpu.submit(enc);
                let got = gpu.read_f32(&yt).unwrap();
                let err = common::rel_err(&got, &want);
                assert!(
                    err < 1e-5,
                    "{} at {m}x{n}x{k}: relative error {err}",
                    v.name
                );
                compared += got.len();
            }
        }
    }
    assert!(compared > 5_000, "compared {compared} outputs");
}

#[test]
fn default_choice_runs_without_bias_and_refuses_broken_rows() {
    let gpu = common::gpus(1).remove(0);
    let (m, n, k) = (2, 33, 64);
    let w = common::random(n * k, 3);
    let packed = quantize(QuantType::Q8_0, &w);
    let want = reference(
        &common::random(m * k, 4),
        &dequantize(QuantType::Q8_0, &packed),
        &vec![0.0; n],
        (m, n, k),
    );
    let wt = PackedMatrix::upload(&gpu, "w", QuantType::Q8_0, &packed, (n, k)).unwrap();
    let xt = gpu.upload_f32("x", &common::random(m * k, 4)).unwrap();
    let yt = gpu.upload_f32("y", &vec![0.0; m * n]).unwrap();
    gpu.poison(&yt);
    let mut enc = gpu.encoder();
    let io = QuantIo {
        x: &xt,
        w: &wt,
        bias: None,
        y: &yt,
    };
    quant_matmul(&gpu, &mut enc, io, m, None).unwrap();
    gpu.submit(enc);
    assert!(common::rel_err(&gpu.read_f32(&yt).unwrap(), &want) < 1e-5);
    // Rows that are not whole blocks, and a byte count that does not match, are refused.
    let e = PackedMatrix::upload(&gpu, "w", QuantType::Q4K, &packed, (n, 64)).unwrap_err();
    assert!(e.to_string().contains("not whole"), "{e}");
    let e = PackedMatrix::upload(&gpu, "w", QuantType::Q8_0, &packed[1..], (n, k)).unwrap_err();
    assert!(e.to_string().contains("bytes for 33 rows"), "{e}");
}

#[test]
fn decode_rows_take_the_tuned_or_the_forced_variant() {
    use wgpar::kernels::quant::choose_quant;
    use wgpar::kernels::tune::{self, TuneMode, TuneSettings};
    let settings = |mode, forced: &[&str]| TuneSettings {
        mode,
        forced: forced.iter().map(|s| s.to_string()).collect(),
        cache_dir: None,
    };
    let (q4k, decode) = (QuantType::Q4K, (3, 40, 256));
    // Timed on this adapter (in memory only): one of Q4_K's variants, kept for the device.
    tune::configure(settings(TuneMode::Retune, &[]));
    let gpu = common::gpus(1).remove(0);
    let tuned = choose_quant(&gpu, q4k, decode).unwrap();
    assert!(QUANT_VARIANTS.iter().any(|v| std::ptr::eq(v, tuned)) && tuned.qtype == q4k);
    assert!(std::ptr::eq(
        choose_quant(&gpu, q4k, decode).unwrap(),
        tuned
    ));
    // Forced by name, as WGPAR_KERNELS does: decode rows take it, prefill rows the GEMM, and
    // another type's variants are not taken.
    assert!(tune::parse_forced("WGPAR_KERNELS", "qgemv128_q4_k,qgemm_q8_0").is_ok());
    tune::configure(settings(TuneMode::Auto, &["qgemv128_q4_k"]));
    let forced = common::gpus(1).remove(0);
    assert_eq!(
        choose_quant(&forced, q4k, decode).unwrap().name,
        "qgemv128_q4_k"
    );
    assert_eq!(
        choose_quant(&forced, q4k, (9, 40, 256)).unwrap().name,
        "qgemm_q4_k"
    );
    let q8 = choose_quant(&forced, QuantType::Q8_0, (3, 40, 64)).unwrap();
    assert_eq!(q8.qtype, QuantType::Q8_0);
    // Tuning off: the fixed default, the GEMV with 64 invocations.
    tune::configure(settings(TuneMode::Off, &[]));
    let fixed = common::gpus(1).remove(0);
    assert_eq!(
        choose_quant(&fixed, QuantType::Q6K, decode).unwrap().name,
        "qgemv64_q6_k"
    );
    tune::configure(TuneSettings::from_env().unwrap());
}
