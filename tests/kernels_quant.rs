//! The quantized matmul kernels against the CPU: every variant of every packed type computes
//! `x . dequant(w)^T + bias` like an f64 product of llama.cpp's dequantization (the `gguf`
//! package's numpy code) of random blocks, on shapes whose rows and columns are not multiples
//! of the GEMV's or GEMM's tiles, into poisoned outputs; the embedding lookup reads the same
//! values, and wgpar's host reader matches llama.cpp's.

mod common;
mod gguf_support;

use std::collections::BTreeSet;

use gguf_support::{llama_dequantize, random_blocks};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use wgpar::kernels::quant::{
    quant_candidates, tuned_candidates, PackedMatrix, QuantIo, QuantRole, GEMV_MAX_ROWS,
    QUANT_VARIANTS,
};
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

/// Every block type with a column count of whole blocks that is no multiple of the kernels'
/// tiles (ragged: 96 or 160 for 32-value blocks, 256 or 512 for 256-value ones).
const TYPES: [(QuantType, usize); 12] = [
    (QuantType::Q8_0, 96),
    (QuantType::Q4_0, 160),
    (QuantType::Q4_1, 96),
    (QuantType::Q5_0, 160),
    (QuantType::Q5_1, 96),
    (QuantType::Iq4Nl, 160),
    (QuantType::Q2K, 256),
    (QuantType::Q3K, 512),
    (QuantType::Q4K, 512),
    (QuantType::Q5K, 256),
    (QuantType::Q6K, 768),
    (QuantType::Iq4Xs, 512),
];

/// `rows x cols` random blocks of `t` and llama.cpp's dequantization of them, which wgpar's
/// host reader must reproduce.
fn blocks_and_values(t: QuantType, (rows, cols): (usize, usize), seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let packed = random_blocks(t, rows * cols / t.block_len(), &mut rng);
    let values = llama_dequantize(t, &packed);
    let host = dequantize(t, &packed);
    assert_eq!(host.len(), values.len(), "{t:?}");
    let scale = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = host
        .iter()
        .zip(&values)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        worst <= scale * 1e-6 && scale > 0.0,
        "{t:?}: host dequantization {worst} from llama.cpp's (values up to {scale})"
    );
    (packed, values)
}

#[test]
fn every_variant_matches_llama_cpps_dequantization() {
    let gpu = common::gpus(1).remove(0);
    let mut compared = 0usize;
    let (mut ran, mut skipped) = (BTreeSet::new(), BTreeSet::new());
    for (t, k) in TYPES {
        let (all, all_deq) = blocks_and_values(t, (131, k), 7 + k as u64);
        for (m, n) in [(1, 37), (3, 70), (8, 5), (45, 70), (9, 131)] {
            let row = t.row_bytes(k).unwrap();
            let (packed, w_deq) = (&all[..n * row], &all_deq[..n * k]);
            let x = common::random(m * k, 11 + m as u64);
            let bias = common::random(n, 13);
            let want = reference(&x, w_deq, &bias, (m, n, k));
            let wt = PackedMatrix::upload(&gpu, "w", t, packed, (n, k)).unwrap();
            let xt = gpu.upload_f32("x", &x).unwrap();
            let bt = gpu.upload_f32("bias", &bias).unwrap();
            let yt = gpu.upload_f32("y", &vec![0.0; m * n]).unwrap();
            for v in QUANT_VARIANTS.iter().filter(|v| v.qtype == t) {
                if v.is_gemv() && m > GEMV_MAX_ROWS {
                    continue;
                }
                if !v.usable(&gpu) {
                    skipped.insert(v.name);
                    continue;
                }
                ran.insert(v.name);
                let io = QuantIo {
                    x: &xt,
                    w: &wt,
                    bias: Some(&bt),
                    y: &yt,
                };
                let got = common::packed_matmul(&gpu, io, m, Some(v.name));
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
    assert!(compared > 20_000, "compared {compared} outputs");
    // Subgroup variants run where the adapter has usable subgroups, the large-tile GEMMs where
    // it gives their workgroup memory, and are named where not.
    if !skipped.is_empty() {
        eprintln!("not run (no usable subgroups, or too little workgroup memory): {skipped:?}");
    }
    assert_eq!(ran.len() + skipped.len(), QUANT_VARIANTS.len());
    let limit = gpu.device().limits().max_compute_workgroup_storage_size as usize;
    let why = |name: &str| {
        let v = QUANT_VARIANTS.iter().find(|v| v.name == name).unwrap();
        v.subgroups || v.workgroup_bytes() > limit
    };
    assert!(skipped.iter().all(|n| why(n)), "{skipped:?}");
    // Every adapter the suite runs on (lavapipe, a GPU) gives 32 KiB: the large tiles ran.
    assert!(
        limit < 32768 || ran.iter().any(|n| n.starts_with("qgemm128x128")),
        "{ran:?}"
    );
}

#[test]
fn the_tuner_times_no_gemm_whose_block_would_be_mostly_idle() {
    let gpu = common::gpus(1).remove(0);
    let names = |m: usize, tuned: bool| -> Vec<&'static str> {
        let all = if tuned {
            tuned_candidates(&gpu, QuantType::Q5_0, m, QuantRole::Layer)
        } else {
            quant_candidates(&gpu, QuantType::Q5_0, m, QuantRole::Layer)
        };
        all.iter().map(|v| v.name).collect()
    };
    let gemms = |list: &[&str]| -> Vec<String> {
        (list.iter())
            .filter(|n| n.starts_with("qgemm"))
            .map(|n| n.to_string())
            .collect()
    };
    // One decode row: no GEMM is timed, every one can still be forced.
    assert!(gemms(&names(1, true)).is_empty(), "{:?}", names(1, true));
    assert!(names(1, false).contains(&"qgemm64x64r16x8u_q5_0"));
    assert!(names(1, true).contains(&"qgv1w8r1_q5_0"));
    // Eight rows: the 16-row block (half used) is timed, the 64-row ones are not.
    let eight = gemms(&names(8, true));
    assert_eq!(eight, ["qgemm16x64r16x4u_q5_0"], "{eight:?}");
    // A prefill step times every GEMM the device can run, the 128-row tiles included.
    let prefill = names(64, true);
    assert!(
        prefill.iter().all(|n| n.starts_with("qgemm")),
        "{prefill:?}"
    );
    assert!(prefill.contains(&"qgemm64x128r8x16u_q5_0"), "{prefill:?}");
    assert!(prefill.contains(&"qgemm128x128r16x8u_q5_0"), "{prefill:?}");
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
    let io = QuantIo {
        x: &xt,
        w: &wt,
        bias: None,
        y: &yt,
    };
    assert!(common::rel_err(&common::packed_matmul(&gpu, io, m, None), &want) < 1e-5);
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
    // One of Q4_K's variants, the integer-dot GEMVs included where the adapter offers them.
    let mut all = QUANT_VARIANTS
        .iter()
        .chain(wgpar::kernels::quant_dp4::DP4_VARIANTS);
    assert!(all.any(|v| std::ptr::eq(v, tuned)) && tuned.qtype == q4k);
    assert!(std::ptr::eq(
        choose_quant(&gpu, q4k, decode).unwrap(),
        tuned
    ));
    // Forced by name, as WGPAR_KERNELS does: decode rows take it, prefill rows a GEMM, and
    // another type's variants are not taken.
    assert!(tune::parse_forced("WGPAR_KERNELS", "qgemv128_q4_k,qgemm_q8_0").is_ok());
    tune::configure(settings(TuneMode::Auto, &["qgemv128_q4_k"]));
    let forced = common::gpus(1).remove(0);
    assert_eq!(
        choose_quant(&forced, q4k, decode).unwrap().name,
        "qgemv128_q4_k"
    );
    assert!(!choose_quant(&forced, q4k, (9, 40, 256)).unwrap().is_gemv());
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

/// The embedding lookup from a packed token table (`qembed_*`), against the CPU
/// dequantization: a block of rows `first .. first + rows` of a table writes the tokens whose
/// id falls in it (plus learned positions, or token types) and leaves every other token's row
/// as it was.
#[test]
fn the_packed_embedding_lookup_matches_the_cpu_dequantization() {
    use wgpar::kernels::ops::{embed_with_types, Embedding, Positions, TokenTable, TokenTypes};
    let gpu = common::gpus(1).remove(0);
    let (batch, seq, first, rows) = (3, 5, 40, 75);
    let tokens = batch * seq;
    // Ids on both sides of the block and on its edges.
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| [0, 39, 40, 41, 77, 114, 115, 200][i as usize % 8] + i / 8)
        .collect();
    let past = [0u32, 7, 2];
    let seqs: Vec<u32> = (0..batch as u32)
        .flat_map(|b| [b, past[b as usize]])
        .collect();
    let mut compared = 0usize;
    for (t, hidden) in TYPES {
        let (packed, values) = blocks_and_values(t, (rows, hidden), 21 + hidden as u64);
        let positions = 16;
        let wpe = common::random(positions * hidden, 5);
        let types: Vec<u32> = (0..tokens as u32).map(|i| i % 2).collect();
        let wtt = common::random(2 * hidden, 6);
        let w = PackedMatrix::upload(&gpu, "wte", t, &packed, (rows, hidden)).unwrap();
        let ids_t = gpu.upload_u32("ids", &ids).unwrap();
        let seqs_t = gpu.upload_u32("seqs", &seqs).unwrap();
        let wpe_t = gpu.upload_f32("wpe", &wpe).unwrap();
        let types_t = gpu.upload_u32("types", &types).unwrap();
        let wtt_t = gpu.upload_f32("wtt", &wtt).unwrap();
        let out = gpu.upload_f32("out", &vec![0.0; tokens * hidden]).unwrap();
        for extra in ["none", "positions", "types"] {
            gpu.poison(&out);
            let poisoned = gpu.read_f32(&out).unwrap();
            let input = Embedding {
                ids: &ids_t,
                wte: TokenTable::Packed(&w),
                first_row: first,
                positions: (extra == "positions").then_some(Positions {
                    wpe: &wpe_t,
                    positions,
                    seqs: &seqs_t,
                }),
                types: (extra == "types").then_some(TokenTypes {
                    ids: &types_t,
                    table: &wtt_t,
                    count: 2,
                }),
            };
            let mut enc = gpu.encoder();
            embed_with_types(&gpu, &mut enc, input, &out, (batch, seq, hidden)).unwrap();
            gpu.submit(enc);
            let got = gpu.read_f32(&out).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                let row = &got[i * hidden..(i + 1) * hidden];
                let Some(r) = (id as usize).checked_sub(first).filter(|&r| r < rows) else {
                    let was = &poisoned[i * hidden..(i + 1) * hidden];
                    let same = row.iter().zip(was).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{t:?} {extra}: token {i} (id {id}) outside the block");
                    continue;
                };
                let pos = (past[i / seq] as usize + i % seq).min(positions - 1);
                let want: Vec<f64> = (0..hidden)
                    .map(|c| {
                        let add = match extra {
                            "positions" => wpe[pos * hidden + c],
                            "types" => wtt[types[i] as usize * hidden + c],
                            _ => 0.0,
                        };
                        values[r * hidden + c] as f64 + add as f64
                    })
                    .collect();
                let err = common::rel_err(row, &want);
                assert!(err < 1e-6, "{t:?} {extra}: token {i} (id {id}): {err}");
                compared += hidden;
            }
        }
    }
    assert!(compared > 10_000, "compared {compared} values");
}
