//! The prefill GEMMs on packed weights (`qgemm`, `qgemm_tile`) over several output blocks in
//! both directions: every GEMM variant of every packed type against an f64 product of
//! llama.cpp's dequantization (the `gguf` package's numpy code) of random blocks, on row and
//! column counts that are no multiple of any block (so every variant has partial blocks at both
//! edges), bound for more rows than the step runs as the engines bind them, into poisoned
//! outputs with a guard row that must stay poisoned. And the tuner's choice for prefill rows:
//! a GEMM, per class, forced names honoured only where they apply.

mod common;
mod gguf_support;

use gguf_support::{llama_dequantize, random_blocks};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wgpar::kernels::ops::{Params, Pass};
use wgpar::kernels::quant::{choose_quant, PackedMatrix, QuantIo, QuantMatmul, QUANT_VARIANTS};
use wgpar::model::quant::QuantType;

fn reference(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, n, k): (usize, usize, usize),
) -> Vec<f64> {
    let mut y = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                .sum();
            y[i * n + j] = dot + bias.map_or(0.0, |b| b[j] as f64);
        }
    }
    y
}

/// Every packed type with a column count of whole blocks: an odd number of 32-value blocks
/// (7 or 9), or two or three super-blocks.
const TYPES: [(QuantType, usize); 12] = [
    (QuantType::Q8_0, 224),
    (QuantType::Q4_0, 288),
    (QuantType::Q4_1, 224),
    (QuantType::Q5_0, 288),
    (QuantType::Q5_1, 224),
    (QuantType::Iq4Nl, 288),
    (QuantType::Q2K, 512),
    (QuantType::Q3K, 768),
    (QuantType::Q4K, 512),
    (QuantType::Q5K, 768),
    (QuantType::Q6K, 512),
    (QuantType::Iq4Xs, 512),
];

/// (rows run, rows bound, columns): 1 to 3 blocks of 32 or 64 rows, 2 to 4 of 64 columns,
/// none whole.
const SHAPES: [(usize, usize, usize); 3] = [(67, 80, 131), (130, 130, 70), (9, 40, 200)];

/// One GEMM run of `variant`: `m` rows of a matmul bound for `rows`, into a poisoned output one
/// row longer than bound, the result and whether the rows past `m` kept their poison.
fn run_gemm(
    gpu: &wgpar::device::Gpu,
    variant: &str,
    io: QuantIo<'_>,
    (m, rows): (usize, usize),
) -> (Vec<f32>, bool) {
    let n = io.w.rows;
    gpu.poison(io.y);
    let mut params = Params::new(gpu, "test.qgemm", 1).unwrap();
    let mut op = QuantMatmul::bind(gpu, &mut params, io, rows)
        .unwrap()
        .with_variant(variant)
        .unwrap();
    op.configure(gpu, &mut params, m).unwrap();
    params.flush(gpu);
    let mut enc = gpu.encoder();
    Pass::new(&mut enc).run(&op).unwrap();
    gpu.submit(enc);
    let got = gpu.read_f32(io.y).unwrap();
    let untouched = got[m * n..].iter().all(|v| v.to_bits() == 0x7fc0_1234);
    (got[..m * n].to_vec(), untouched)
}

#[test]
fn every_gemm_matches_llama_cpps_dequantization_over_many_blocks() {
    let gpu = common::gpus(1).remove(0);
    let mut compared = 0usize;
    for (t, k) in TYPES {
        let n_max = SHAPES.iter().map(|s| s.2).max().unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(31 + k as u64);
        let all = random_blocks(t, n_max * k / t.block_len(), &mut rng);
        let all_deq = llama_dequantize(t, &all);
        for (i, (m, rows, n)) in SHAPES.into_iter().enumerate() {
            let row = t.row_bytes(k).unwrap();
            // Bound for `rows`; the rows past `m` are not the step's.
            let x = common::random(rows * k, 41 + i as u64);
            let bias = common::random(n, 43);
            // Every other shape without a bias.
            let with_bias = i % 2 == 0;
            let want = reference(
                &x,
                &all_deq[..n * k],
                with_bias.then_some(&bias[..]),
                (m, n, k),
            );
            let wt = PackedMatrix::upload(&gpu, "w", t, &all[..n * row], (n, k)).unwrap();
            let xt = gpu.upload_f32("x", &x).unwrap();
            let bt = gpu.upload_f32("bias", &bias).unwrap();
            let yt = gpu.upload_f32("y", &vec![0.0; (rows + 1) * n]).unwrap();
            let io = QuantIo {
                x: &xt,
                w: &wt,
                bias: with_bias.then_some(&bt),
                y: &yt,
            };
            for v in QUANT_VARIANTS
                .iter()
                .filter(|v| v.qtype == t && !v.is_gemv())
            {
                let (got, untouched) = run_gemm(&gpu, v.name, io, (m, rows));
                let err = common::rel_err(&got, &want);
                assert!(
                    err < 1e-5,
                    "{} at {m}x{n}x{k}: relative error {err}",
                    v.name
                );
                assert!(untouched, "{} at {m}x{n}x{k} wrote past row {m}", v.name);
                compared += got.len();
            }
        }
    }
    // 12 types, 10 GEMMs each, 19,677 outputs per type and GEMM.
    assert!(compared >= 2_361_240, "compared {compared} outputs");
}

#[test]
fn prefill_rows_are_tuned_among_the_gemms_per_class() {
    use wgpar::kernels::tune::{self, TuneMode, TuneSettings};
    let dir = common::scratch_dir("qgemm-tune");
    let settings = |mode, forced: &[&str], cache: bool| TuneSettings {
        mode,
        forced: forced.iter().map(|s| s.to_string()).collect(),
        cache_dir: cache.then(|| dir.path().to_path_buf()),
    };
    let (q4k, prefill) = (QuantType::Q4K, (64, 40, 256));
    // Timed on this adapter: a GEMM of the type, kept for the device and the whole class
    // (33 to 64 rows), and written to the cache under the class key.
    tune::configure(settings(TuneMode::Retune, &[], true));
    let gpu = common::gpus(1).remove(0);
    let tuned = choose_quant(&gpu, q4k, prefill).unwrap();
    assert!(!tuned.is_gemv() && tuned.qtype == q4k, "{}", tuned.name);
    assert!(std::ptr::eq(
        choose_quant(&gpu, q4k, (33, 40, 256)).unwrap(),
        tuned
    ));
    let cache = std::fs::read_to_string(dir.path().join("tune.json")).unwrap();
    assert!(cache.contains("qmatmul q4_k m<=64 n2^6 k2^8"), "{cache}");
    assert!(cache.contains(tuned.name), "{cache}");
    // Forced names: a GEMV only for decode rows; prefill rows take the first GEMM named.
    let forced = ["qgemv64_q4_k", "qgemm32x64r4x8_q4_k", "qgemm_q4_k"];
    tune::configure(settings(TuneMode::Auto, &forced, false));
    let forced_gpu = common::gpus(1).remove(0);
    let pick = |m| choose_quant(&forced_gpu, q4k, (m, 40, 256)).unwrap().name;
    assert_eq!(pick(3), "qgemv64_q4_k");
    assert_eq!(pick(9), "qgemm32x64r4x8_q4_k");
    assert_eq!(pick(200), "qgemm32x64r4x8_q4_k");
    // Tuning off: the tiled GEMM with 64 x 64 blocks.
    tune::configure(settings(TuneMode::Off, &[], false));
    let fixed = common::gpus(1).remove(0);
    let name = choose_quant(&fixed, QuantType::Q6K, prefill).unwrap().name;
    assert_eq!(name, "qgemm64x64r16x8_q6_k");
    tune::configure(TuneSettings::from_env().unwrap());
}
