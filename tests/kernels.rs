//! Every kernel against a CPU reference, on random data, on shapes that are not tile multiples,
//! with outputs poisoned (NaN) first so unwritten elements fail.

mod common;

use wgpar::device::{DType, Gpu, Tensor};
use wgpar::kernels::ops::{self, AttnShape, Elementwise, MatmulIo, MatmulKernel, Norm, TokenPick};
use wgpar::kernels::{tune, variants};
use wgpar::model::reference::{gelu_tanh, silu};

fn poisoned(gpu: &Gpu, len: usize) -> Tensor {
    let t = gpu.empty("out", DType::F32, len).unwrap();
    gpu.poison(&t);
    t
}

fn run(gpu: &Gpu, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
    let mut enc = gpu.encoder();
    f(&mut enc);
    gpu.submit(enc);
    gpu.wait().unwrap();
}

fn assert_close(name: &str, got: &[f32], want: &[f64], bar: f64) {
    let err = common::rel_err(got, want);
    assert!(err <= bar, "{name}: relative error {err:.2e} > {bar:.0e}");
}

fn matmul_ref(x: &[f32], w: &[f32], b: Option<&[f32]>, m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s: f64 = (0..k)
                .map(|kk| x[i * k + kk] as f64 * w[j * k + kk] as f64)
                .sum();
            if let Some(b) = b {
                s += b[j] as f64;
            }
            y[i * n + j] = s;
        }
    }
    y
}

/// Every matmul variant (not only the one tuning picks), the tuned choice and the naive
/// baseline, on shapes that are not tile multiples, decode rows (m <= 8) and inner dimensions
/// with and without a factor of 4, f32 and f16 weights, with and without bias.
#[test]
fn matmul_every_variant_any_shape_f32_f16() {
    let gpu = &common::gpus(1)[0];
    let mut covered = std::collections::BTreeSet::new();
    for (m, n, k) in [
        (1, 1, 1),
        (5, 7, 3),
        (13, 37, 29),
        (64, 33, 70),
        (3, 130, 257),
        (1, 300, 88),
        (8, 75, 64),
        (67, 45, 36),
        (130, 70, 100),
        (2, 129, 260),
        // Edges of the block GEMMs (blocks of 64-128 rows and columns, k steps of 8-16).
        (67, 131, 260),
        (130, 257, 96),
        (9, 513, 20),
    ] {
        let x = common::random(m * k, 1);
        let w = common::random(n * k, 2);
        let b = common::random(n, 3);
        let xt = gpu.upload_f32("x", &x).unwrap();
        let bt = gpu.upload_f32("b", &b).unwrap();
        let mut dtypes = vec![DType::F32];
        if gpu.supports_f16_weights() {
            dtypes.push(DType::F16);
        }
        let mut kernels = vec![MatmulKernel::Tiled, MatmulKernel::Naive];
        kernels.extend(
            variants::MATMUL
                .iter()
                .filter(|v| v.applies(gpu, (m, n, k)))
                .map(|v| MatmulKernel::Variant(v.name)),
        );
        for dtype in dtypes {
            let wt = gpu.upload_weights("w", &w, dtype).unwrap();
            // The f16 reference uses the same rounded weights: the bar checks the kernel, not
            // the format.
            let w_used: Vec<f32> = match dtype {
                DType::F16 => w.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
                _ => w.clone(),
            };
            for &kernel in &kernels {
                if let MatmulKernel::Variant(name) = kernel {
                    covered.insert(name);
                }
                for bias in [None, Some(&bt)] {
                    let y = poisoned(gpu, m * n);
                    let io = MatmulIo {
                        x: &xt,
                        w: &wt,
                        bias,
                        y: &y,
                    };
                    run(gpu, |e| ops::matmul(gpu, e, io, (m, n, k), kernel).unwrap());
                    let want = matmul_ref(&x, &w_used, bias.map(|_| &b[..]), m, n, k);
                    let name = format!(
                        "matmul {m}x{n}x{k} {dtype:?} {kernel:?} bias={}",
                        bias.is_some()
                    );
                    assert_close(&name, &gpu.read_f32(&y).unwrap(), &want, 1e-5);
                }
            }
        }
    }
    // Every variant ran on some shape (subgroup ones where the adapter has subgroups).
    for v in variants::MATMUL {
        if !v.subgroups || variants::subgroups_usable(gpu) {
            assert!(covered.contains(v.name), "variant {} never tested", v.name);
        }
    }
}

#[test]
fn matmul_variant_that_does_not_apply_is_an_error() {
    let gpu = &common::gpus(1)[0];
    let x = gpu.upload_f32("x", &common::random(16 * 6, 1)).unwrap();
    let y = gpu.empty("y", DType::F32, 16 * 16).unwrap();
    let mut enc = gpu.encoder();
    // gemv takes at most 8 rows; vec4 variants need k divisible by 4.
    for (name, shape) in [("gemv_wg64", (16, 16, 4)), ("matmul_vec4", (2, 2, 6))] {
        let io = MatmulIo {
            x: &x,
            w: &x,
            bias: None,
            y: &y,
        };
        let e = ops::matmul(gpu, &mut enc, io, shape, MatmulKernel::Variant(name))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not apply"), "{e}");
    }
    let io = MatmulIo {
        x: &x,
        w: &x,
        bias: None,
        y: &y,
    };
    let e = ops::matmul(gpu, &mut enc, io, (1, 1, 1), MatmulKernel::Variant("nope"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope") && e.contains("gemm_64x64"), "{e}");
}

/// The block GEMMs, forced by name (what `WGPAR_KERNELS` sets) through the normal matmul path,
/// on edge shapes in every direction, f32 and f16 weights; decode rows (m <= 8) are left to
/// the kernels made for them even when a block GEMM is forced.
#[test]
fn block_gemms_forced_by_name() {
    let blocks: Vec<&'static variants::Variant> = variants::MATMUL
        .iter()
        .filter(|v| v.family == wgpar::kernels::Family::MatmulBlock)
        .collect();
    assert!(blocks.len() >= 4);
    for v in &blocks {
        // A fresh device per variant: a device keeps its choice per shape class.
        let gpus = common::gpus(1);
        let gpu = &gpus[0];
        let mut dtypes = vec![DType::F32];
        if gpu.supports_f16_weights() {
            dtypes.push(DType::F16);
        }
        tune::configure(tune::TuneSettings {
            mode: tune::TuneMode::Off,
            forced: vec![v.name.to_string()],
            cache_dir: None,
        });
        for (m, n, k) in [(67, 131, 260), (129, 65, 36), (200, 520, 12)] {
            let chosen =
                tune::choose_matmul(gpu, (m, n, k), wgpar::kernels::WeightType::F32, None).unwrap();
            assert_eq!(chosen.name, v.name);
            let x = common::random(m * k, 41);
            let w = common::random(n * k, 42);
            let b = common::random(n, 43);
            let xt = gpu.upload_f32("x", &x).unwrap();
            let bt = gpu.upload_f32("b", &b).unwrap();
            for &dtype in &dtypes {
                let wt = gpu.upload_weights("w", &w, dtype).unwrap();
                let w_used: Vec<f32> = match dtype {
                    DType::F16 => w.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
                    _ => w.clone(),
                };
                let y = poisoned(gpu, m * n);
                run(gpu, |e| {
                    let io = MatmulIo {
                        x: &xt,
                        w: &wt,
                        bias: Some(&bt),
                        y: &y,
                    };
                    ops::matmul(gpu, e, io, (m, n, k), MatmulKernel::Tiled).unwrap()
                });
                assert_close(
                    &format!("{} {m}x{n}x{k} {dtype:?}", v.name),
                    &gpu.read_f32(&y).unwrap(),
                    &matmul_ref(&x, &w_used, Some(&b), m, n, k),
                    1e-5,
                );
            }
        }
        // Decode rows: the forced block GEMM does not apply, the default does.
        let chosen =
            tune::choose_matmul(gpu, (1, 64, 64), wgpar::kernels::WeightType::F32, None).unwrap();
        assert_ne!(
            chosen.family,
            wgpar::kernels::Family::MatmulBlock,
            "{}",
            v.name
        );
        assert!(!v.applies(gpu, (8, 64, 64)) && v.applies(gpu, (9, 64, 64)));
    }
    tune::configure(tune::TuneSettings::from_env().unwrap());
}

/// First-use tuning times the candidates, keeps the fastest (which applies and computes the
/// right result) and writes it to the cache file under the adapter's key.
#[test]
fn tuning_chooses_a_variant_and_caches_it() {
    let dir = common::scratch("tune-cache");
    tune::configure(tune::TuneSettings {
        mode: tune::TuneMode::Retune,
        forced: Vec::new(),
        cache_dir: Some(dir.clone()),
    });
    let gpu = &common::gpus(1)[0];
    let (m, n, k) = (3, 96, 64);
    let x = common::random(m * k, 21);
    let w = common::random(n * k, 22);
    let (xt, wt) = (
        gpu.upload_f32("x", &x).unwrap(),
        gpu.upload_f32("w", &w).unwrap(),
    );
    let y = poisoned(gpu, m * n);
    run(gpu, |e| {
        let io = MatmulIo {
            x: &xt,
            w: &wt,
            bias: None,
            y: &y,
        };
        ops::matmul(gpu, e, io, (m, n, k), MatmulKernel::Tiled).unwrap()
    });
    assert_close(
        "tuned matmul",
        &gpu.read_f32(&y).unwrap(),
        &matmul_ref(&x, &w, None, m, n, k),
        1e-5,
    );
    let text = std::fs::read_to_string(dir.join(tune::CACHE_FILE)).unwrap();
    let cache: serde_json::Value = serde_json::from_str(&text).unwrap();
    let key = format!(
        "{} | {}",
        tune::adapter_key(gpu),
        variants::MatmulClass::of((m, n, k), wgpar::kernels::WeightType::F32).key()
    );
    let chosen = cache["entries"][&key]["variant"].as_str().unwrap();
    let v = variants::by_name(chosen).unwrap();
    assert!(v.candidate && v.applies(gpu, (m, n, k)), "{chosen}");
    // A forced variant wins over the cache; tuning off falls back to the fixed default.
    tune::configure(tune::TuneSettings {
        mode: tune::TuneMode::Off,
        forced: vec!["gemv_wg64".into()],
        cache_dir: Some(dir.clone()),
    });
    let fresh = &common::gpus(1)[0];
    let v = tune::choose_matmul(fresh, (m, n, k), wgpar::kernels::WeightType::F32, None).unwrap();
    assert_eq!(v.name, "gemv_wg64");
    let v = tune::choose_matmul(fresh, (64, n, k), wgpar::kernels::WeightType::F32, None).unwrap();
    assert_eq!(v.name, variants::default_matmul(fresh, (64, n, k)).name);
    tune::configure(tune::TuneSettings::from_env().unwrap());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn matmul_rejects_short_operands() {
    let gpu = &common::gpus(1)[0];
    let x = gpu.upload_f32("x", &common::random(10, 1)).unwrap();
    let y = gpu.empty("y", DType::F32, 4).unwrap();
    let mut enc = gpu.encoder();
    let io = MatmulIo {
        x: &x,
        w: &x,
        bias: None,
        y: &y,
    };
    let e = ops::matmul(gpu, &mut enc, io, (2, 2, 6), MatmulKernel::Tiled)
        .unwrap_err()
        .to_string();
    assert!(e.contains("x has 10 elements, needs 12"), "{e}");
}

#[test]
fn layernorm_and_rmsnorm() {
    let gpu = &common::gpus(1)[0];
    for (rows, cols) in [(1, 1), (3, 77), (9, 200)] {
        let x: Vec<f32> = common::random(rows * cols, 4)
            .iter()
            .map(|v| v * 3.0 + 0.5)
            .collect();
        let g = common::random(cols, 5);
        let b = common::random(cols, 6);
        let (xt, gt, bt) = (
            gpu.upload_f32("x", &x).unwrap(),
            gpu.upload_f32("g", &g).unwrap(),
            gpu.upload_f32("b", &b).unwrap(),
        );
        for layer in [true, false] {
            let y = poisoned(gpu, rows * cols);
            let kind = if layer {
                Norm::Layer {
                    gamma: &gt,
                    beta: &bt,
                }
            } else {
                Norm::Rms { gamma: &gt }
            };
            run(gpu, |e| {
                ops::norm(gpu, e, kind, (&xt, &y), (rows, cols), 1e-5).unwrap()
            });
            let mut want = Vec::new();
            for r in x.chunks(cols) {
                let n = cols as f64;
                let mean = if layer {
                    r.iter().map(|&v| v as f64).sum::<f64>() / n
                } else {
                    0.0
                };
                let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
                let inv = 1.0 / (var + 1e-5).sqrt();
                for c in 0..cols {
                    let shift = if layer { b[c] as f64 } else { 0.0 };
                    want.push((r[c] as f64 - mean) * inv * g[c] as f64 + shift);
                }
            }
            let name = format!(
                "{} {rows}x{cols}",
                if layer { "layernorm" } else { "rmsnorm" }
            );
            assert_close(&name, &gpu.read_f32(&y).unwrap(), &want, 1e-5);
        }
    }
}

#[test]
fn softmax_rows() {
    let gpu = &common::gpus(1)[0];
    for (rows, cols) in [(1, 1), (4, 100), (2, 1000)] {
        let x: Vec<f32> = common::random(rows * cols, 7)
            .iter()
            .map(|v| v * 20.0)
            .collect();
        let t = gpu.upload_f32("x", &x).unwrap();
        run(gpu, |e| ops::softmax(gpu, e, &t, rows, cols).unwrap());
        let mut want = Vec::new();
        for r in x.chunks(cols) {
            let m = r.iter().fold(f64::MIN, |a, &b| a.max(b as f64));
            let s: f64 = r.iter().map(|&v| (v as f64 - m).exp()).sum();
            want.extend(r.iter().map(|&v| (v as f64 - m).exp() / s));
        }
        assert_close(
            &format!("softmax {rows}x{cols}"),
            &gpu.read_f32(&t).unwrap(),
            &want,
            1e-5,
        );
    }
}

#[test]
fn elementwise_ops() {
    let gpu = &common::gpus(1)[0];
    let (rows, cols) = (7, 45);
    let len = rows * cols;
    let a: Vec<f32> = common::random(len, 8).iter().map(|v| v * 4.0).collect();
    let b = common::random(len, 9);
    let bt = gpu.upload_f32("b", &b).unwrap();
    type Reference<'a> = Box<dyn Fn(usize) -> f64 + 'a>;
    let cases: [(Elementwise, Reference); 4] = [
        (Elementwise::Add, Box::new(|i| a[i] as f64 + b[i] as f64)),
        (
            Elementwise::BiasAdd,
            Box::new(|i| a[i] as f64 + b[i % cols] as f64),
        ),
        (Elementwise::Gelu, Box::new(|i| gelu_tanh(a[i] as f64))),
        (
            Elementwise::SwiGlu,
            Box::new(|i| silu(a[i] as f64) * b[i] as f64),
        ),
    ];
    for (op, f) in cases.iter() {
        let at = gpu.upload_f32("a", &a).unwrap();
        run(gpu, |e| {
            ops::elementwise(gpu, e, *op, &at, Some(&bt), (rows, cols)).unwrap()
        });
        let want: Vec<f64> = (0..len).map(f).collect();
        assert_close(&format!("{op:?}"), &gpu.read_f32(&at).unwrap(), &want, 1e-5);
    }
    // erf-GELU against a high-precision erf (series; |x| <= 4 here).
    let erf = |x: f64| {
        let mut sum = 0.0;
        let mut term = x;
        for n in 0..80 {
            sum += term / (2 * n + 1) as f64;
            term *= -x * x / (n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    };
    let at = gpu.upload_f32("a", &a).unwrap();
    run(gpu, |e| {
        ops::elementwise(gpu, e, Elementwise::GeluErf, &at, None, (rows, cols)).unwrap()
    });
    let want: Vec<f64> = a
        .iter()
        .map(|&v| 0.5 * v as f64 * (1.0 + erf(v as f64 / 2f64.sqrt())))
        .collect();
    assert_close("gelu_erf", &gpu.read_f32(&at).unwrap(), &want, 1e-6);
}

/// A sequence table `[(slot, past)]` as the kernels read it.
fn seq_table(gpu: &Gpu, rows: &[(usize, usize)]) -> Tensor {
    let flat: Vec<u32> = rows
        .iter()
        .flat_map(|&(slot, past)| [slot as u32, past as u32])
        .collect();
    gpu.upload_u32("seqs", &flat).unwrap()
}

#[test]
fn embedding_with_and_without_positions() {
    let gpu = &common::gpus(1)[0];
    let (vocab, hidden, seq, positions) = (53, 37, 5, 11);
    // Rows with different pasts (and slots, which the embedding ignores).
    let rows = [(1usize, 3usize), (0, 6), (2, 0)];
    let batch = rows.len();
    let wte = common::random(vocab * hidden, 10);
    let wpe = common::random(positions * hidden, 11);
    let ids: Vec<u32> = (0..batch * seq).map(|i| (i * 17 % vocab) as u32).collect();
    let (idt, wtet, wpet) = (
        gpu.upload_u32("ids", &ids).unwrap(),
        gpu.upload_f32("wte", &wte).unwrap(),
        gpu.upload_f32("wpe", &wpe).unwrap(),
    );
    let seqs = seq_table(gpu, &rows);
    for with_pos in [false, true] {
        let out = poisoned(gpu, batch * seq * hidden);
        let pos_arg = with_pos.then_some(ops::Positions {
            wpe: &wpet,
            positions,
            seqs: &seqs,
        });
        run(gpu, |e| {
            ops::embed(gpu, e, (&idt, &wtet, pos_arg), &out, (batch, seq, hidden)).unwrap()
        });
        let mut want = Vec::new();
        for (t, &id) in ids.iter().enumerate() {
            for c in 0..hidden {
                let mut v = wte[id as usize * hidden + c] as f64;
                if with_pos {
                    let pos = rows[t / seq].1 + t % seq;
                    v += wpe[pos * hidden + c] as f64;
                }
                want.push(v);
            }
        }
        assert_close("embed", &gpu.read_f32(&out).unwrap(), &want, 1e-7);
    }
}

#[test]
fn rope_rotates_pairs_by_position() {
    // The whole head, and its first 6 of 10 values (partial rotary: the other 4 pass).
    for rot in [10, 6] {
        rope_case(rot);
    }
}

fn rope_case(rot: usize) {
    let gpu = &common::gpus(1)[0];
    let (seq, heads, dim, positions) = (3, 3, 10, 12);
    // Each row at its own past: the table, not one shared offset, places the tokens.
    let rows = [(0usize, 4usize), (1, 0), (2, 9)];
    let batch = rows.len();
    let half = rot / 2;
    let x = common::random(batch * seq * heads * dim, 12);
    let angle = |p: usize, i: usize| p as f64 * 10000f64.powf(-(2.0 * i as f64) / rot as f64);
    let cos: Vec<f32> = (0..positions * half)
        .map(|j| angle(j / half, j % half).cos() as f32)
        .collect();
    let sin: Vec<f32> = (0..positions * half)
        .map(|j| angle(j / half, j % half).sin() as f32)
        .collect();
    let (xt, ct, st) = (
        gpu.upload_f32("x", &x).unwrap(),
        gpu.upload_f32("cos", &cos).unwrap(),
        gpu.upload_f32("sin", &sin).unwrap(),
    );
    let seqs = seq_table(gpu, &rows);
    let tables = ops::RopeTables {
        cos: &ct,
        sin: &st,
        positions,
    };
    let shape = ops::RopeHeads {
        n_heads: heads,
        head_dim: dim,
        rot_dim: rot,
    };
    run(gpu, |e| {
        ops::rope(gpu, e, (&xt, tables, &seqs), (batch, seq), shape).unwrap()
    });
    let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for t in 0..batch * seq {
        let pos = rows[t / seq].1 + t % seq;
        for h in 0..heads {
            let base = (t * heads + h) * dim;
            for i in 0..half {
                let (c, s) = (angle(pos, i).cos(), angle(pos, i).sin());
                let (a, b) = (x[base + i] as f64, x[base + i + half] as f64);
                want[base + i] = a * c - b * s;
                want[base + i + half] = b * c + a * s;
            }
        }
    }
    assert_close("rope", &gpu.read_f32(&xt).unwrap(), &want, 1e-6);
}

/// KV store then attention, prefill (seq > 1) and decode (seq = 1), with grouped heads and
/// with a shard whose query heads start mid-group; the rows of a step sit in permuted KV slots
/// with different past lengths (and one slot of the cache is not in the step at all).
#[test]
fn kv_store_and_causal_attention() {
    let gpu = &common::gpus(1)[0];
    // (n_heads, n_kv_heads, group, q_offset, kv_offset): whole model, then a TP shard.
    for (nh, nkv, group, q_off, kv_off) in [(6, 2, 3, 0, 0), (4, 2, 3, 2, 0)] {
        let tables: [(usize, &[(usize, usize)]); 4] = [
            (5, &[(0, 0), (1, 0)]),
            (3, &[(2, 4), (0, 0)]),
            (3, &[(1, 9), (3, 2), (0, 13)]),
            (1, &[(3, 9), (0, 15), (2, 0)]),
        ];
        for (seq, rows) in tables {
            let (d, max_seq, slots) = (12, 16, 4);
            let batch = rows.len();
            let shape = AttnShape {
                batch,
                seq,
                slots,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: d,
                max_seq,
                group,
                q_head_offset: q_off,
                kv_head_offset: kv_off,
            };
            let tokens = batch * seq;
            // Cache pre-filled with random "earlier" keys and values.
            let k_old = common::random(shape.cache_len(), 13);
            let v_old = common::random(shape.cache_len(), 14);
            let k_new = common::random(tokens * nkv * d, 15);
            let v_new = common::random(tokens * nkv * d, 16);
            let q = common::random(tokens * nh * d, 17);
            let kc = gpu.upload_f32("kc", &k_old).unwrap();
            let vc = gpu.upload_f32("vc", &v_old).unwrap();
            let (kt, vt, qt) = (
                gpu.upload_f32("k", &k_new).unwrap(),
                gpu.upload_f32("v", &v_new).unwrap(),
                gpu.upload_f32("q", &q).unwrap(),
            );
            let seqs = seq_table(gpu, rows);
            let cache = ops::KvCache {
                k: &kc,
                v: &vc,
                seqs: &seqs,
            };
            let out = poisoned(gpu, tokens * nh * d);
            run(gpu, |e| {
                ops::kv_store(gpu, e, &kt, &vt, cache, &shape).unwrap();
                ops::attention(gpu, e, &qt, cache, &out, &shape).unwrap();
            });
            let mut kref = k_old.clone();
            let mut vref = v_old.clone();
            let at = |slot: usize, h: usize, p: usize| ((slot * nkv + h) * max_seq + p) * d;
            for t in 0..tokens {
                let ((slot, past), i) = (rows[t / seq], t % seq);
                for h in 0..nkv {
                    for c in 0..d {
                        kref[at(slot, h, past + i) + c] = k_new[(t * nkv + h) * d + c];
                        vref[at(slot, h, past + i) + c] = v_new[(t * nkv + h) * d + c];
                    }
                }
            }
            assert_close(
                "k cache",
                &gpu.read_f32(&kc).unwrap(),
                &kref.iter().map(|&v| v as f64).collect::<Vec<_>>(),
                0.0,
            );
            assert_close(
                "v cache",
                &gpu.read_f32(&vc).unwrap(),
                &vref.iter().map(|&v| v as f64).collect::<Vec<_>>(),
                0.0,
            );
            let scale = 1.0 / (d as f64).sqrt();
            let mut want = vec![0.0; tokens * nh * d];
            for t in 0..tokens {
                let ((slot, past), i) = (rows[t / seq], t % seq);
                for h in 0..nh {
                    let kvh = (h + q_off) / group - kv_off;
                    let qv = &q[(t * nh + h) * d..(t * nh + h + 1) * d];
                    let scores: Vec<f64> = (0..=past + i)
                        .map(|p| {
                            let s = at(slot, kvh, p);
                            (0..d)
                                .map(|c| qv[c] as f64 * kref[s + c] as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (p, s) in scores.iter().enumerate() {
                        let w = (s - m).exp() / z;
                        for c in 0..d {
                            want[(t * nh + h) * d + c] += w * vref[at(slot, kvh, p) + c] as f64;
                        }
                    }
                }
            }
            let name = format!("attention heads {nh}/{nkv} s{seq} rows {rows:?}");
            assert_close(&name, &gpu.read_f32(&out).unwrap(), &want, 1e-5);
        }
    }
}

/// An f16 KV cache: the append rounds f32 keys and values to f16 (checked bit for bit against
/// the host's rounding), and attention over the f16 cache, accumulating in f32, matches the f64
/// reference over the rounded cache. Prefill and decode, grouped heads, permuted slots,
/// shapes that fill no tile.
#[test]
fn kv_store_and_attention_f16_cache() {
    let gpu = &common::gpus(1)[0];
    if !gpu.supports_f16_weights() {
        assert!(
            std::env::var("CI").is_err(),
            "CI needs an adapter with SHADER_F16"
        );
        eprintln!("skipped: {} has no SHADER_F16", gpu.label());
        return;
    }
    let round =
        |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect() };
    let mut compared = 0;
    for (seq, rows) in [
        (5usize, vec![(1usize, 0usize), (0, 3)]),
        (1, vec![(2, 14), (0, 9), (1, 0)]),
    ] {
        let (nh, nkv, d, max_seq, slots) = (6, 2, 12, 19, 3);
        let batch = rows.len();
        let shape = AttnShape {
            batch,
            seq,
            slots,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            max_seq,
            group: 3,
            q_head_offset: 0,
            kv_head_offset: 0,
        };
        let tokens = batch * seq;
        let k_old = common::random(shape.cache_len(), 23);
        let v_old = common::random(shape.cache_len(), 24);
        let k_new = common::random(tokens * nkv * d, 25);
        let v_new = common::random(tokens * nkv * d, 26);
        let q = common::random(tokens * nh * d, 27);
        let kc = gpu.upload_f16("kc", &k_old).unwrap();
        let vc = gpu.upload_f16("vc", &v_old).unwrap();
        let kt = gpu.upload_f32("k", &k_new).unwrap();
        let vt = gpu.upload_f32("v", &v_new).unwrap();
        let qt = gpu.upload_f32("q", &q).unwrap();
        let seqs = seq_table(gpu, &rows);
        let cache = ops::KvCache {
            k: &kc,
            v: &vc,
            seqs: &seqs,
        };
        let out = poisoned(gpu, tokens * nh * d);
        run(gpu, |e| {
            ops::kv_store(gpu, e, &kt, &vt, cache, &shape).unwrap();
            ops::attention(gpu, e, &qt, cache, &out, &shape).unwrap();
        });
        let (mut kref, mut vref) = (round(&k_old), round(&v_old));
        let at = |slot: usize, h: usize, p: usize| ((slot * nkv + h) * max_seq + p) * d;
        for t in 0..tokens {
            let ((slot, past), i) = (rows[t / seq], t % seq);
            for c in 0..nkv * d {
                let (h, c) = (c / d, c % d);
                kref[at(slot, h, past + i) + c] = round(&[k_new[(t * nkv + h) * d + c]])[0];
                vref[at(slot, h, past + i) + c] = round(&[v_new[(t * nkv + h) * d + c]])[0];
            }
        }
        for (name, t, want) in [("k cache", &kc, &kref), ("v cache", &vc, &vref)] {
            let bytes = gpu.read_bytes(t.buffer(), 0, t.bytes()).unwrap();
            let got: Vec<f32> = bytemuck::pod_collect_to_vec::<u8, half::f16>(&bytes)
                .iter()
                .map(|h| h.to_f32())
                .collect();
            assert_eq!(&got[..want.len()], &want[..], "{name}");
        }
        let scale = 1.0 / (d as f64).sqrt();
        let mut want = vec![0.0; tokens * nh * d];
        for t in 0..tokens {
            let ((slot, past), i) = (rows[t / seq], t % seq);
            for h in 0..nh {
                let kvh = h / 3;
                let qv = &q[(t * nh + h) * d..(t * nh + h + 1) * d];
                let scores: Vec<f64> = (0..=past + i)
                    .map(|p| {
                        let s = at(slot, kvh, p);
                        (0..d)
                            .map(|c| qv[c] as f64 * kref[s + c] as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (p, s) in scores.iter().enumerate() {
                    let w = (s - m).exp() / z;
                    for c in 0..d {
                        want[(t * nh + h) * d + c] += w * vref[at(slot, kvh, p) + c] as f64;
                    }
                }
            }
        }
        // The cache holds exactly the rounded values, so f32 accumulation is the only error.
        assert_close(
            &format!("f16 attention s{seq}"),
            &gpu.read_f32(&out).unwrap(),
            &want,
            1e-5,
        );
        compared += want.len();
    }
    assert!(compared > 0);
}

/// Every attention variant (today's, tiled prefill, split decode) and the tuned choice against
/// the CPU reference: causal with and without cached keys, rows with different pasts in
/// shuffled slots (the sequence table), decode over a long context, more queries than one
/// tile holds, grouped heads, a tensor-parallel shard, and bidirectional masks with padding.
#[test]
fn attention_every_variant_causal_and_bidirectional() {
    let gpu = &common::gpus(1)[0];
    // (batch, seq, past of row 0, max_seq, n_heads, n_kv_heads, group, q_off, kv_off, head_dim)
    let cases = [
        (2, 5, 0usize, 16, 6, 2, 3, 0, 0, 12),
        (2, 3, 4, 16, 4, 2, 3, 2, 0, 12),
        (1, 1, 130, 160, 4, 1, 4, 0, 0, 16),
        (2, 70, 3, 80, 2, 2, 1, 0, 0, 8),
        (3, 1, 9, 16, 6, 2, 3, 0, 0, 128),
        (1, 2, 0, 8, 2, 2, 1, 0, 0, 200),
        // A tensor-parallel shard of a grouped layer at a head dimension the flash kernels
        // are compiled for, more queries than one of their workgroups takes.
        (2, 70, 3, 80, 4, 2, 3, 2, 0, 32),
    ];
    for (batch, seq, past0, max_seq, nh, nkv, group, q_off, kv_off, d) in cases {
        let slots = batch + 1;
        let shape = AttnShape {
            batch,
            seq,
            slots,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            max_seq,
            group,
            q_head_offset: q_off,
            kv_head_offset: kv_off,
        };
        // Row b: slot slots-1-b, past past0 - b (rows at different positions).
        let rows: Vec<(usize, usize)> = (0..batch)
            .map(|b| (slots - 1 - b, past0.saturating_sub(b)))
            .collect();
        let seqs = seq_table(gpu, &rows);
        let tokens = batch * seq;
        let kc = common::random(shape.cache_len(), 31);
        let vc = common::random(shape.cache_len(), 32);
        let q: Vec<f32> = common::random(tokens * nh * d, 33)
            .iter()
            .map(|v| v * 3.0)
            .collect();
        let (kt, vt, qt) = (
            gpu.upload_f32("kc", &kc).unwrap(),
            gpu.upload_f32("vc", &vc).unwrap(),
            gpu.upload_f32("q", &q).unwrap(),
        );
        // Row b has lens[b] real keys (bidirectional): all, or fewer (right padding).
        let lens: Vec<u32> = rows
            .iter()
            .enumerate()
            .map(|(b, &(_, past))| ((past + seq) as u32).saturating_sub(b as u32).max(1))
            .collect();
        let lens_t = gpu.upload_u32("lens", &lens).unwrap();
        let at = |slot: usize, h: usize, p: usize| ((slot * nkv + h) * max_seq + p) * d;
        for causal in [true, false] {
            let scale = 1.0 / (d as f64).sqrt();
            let mut want = vec![0.0; tokens * nh * d];
            for t in 0..tokens {
                let (b, i) = (t / seq, t % seq);
                let (slot, past) = rows[b];
                let end = if causal {
                    past + i + 1
                } else {
                    (past + seq).min(lens[b] as usize)
                };
                for h in 0..nh {
                    let kvh = (h + q_off) / group - kv_off;
                    let qv = &q[(t * nh + h) * d..(t * nh + h + 1) * d];
                    let scores: Vec<f64> = (0..end)
                        .map(|p| {
                            let s = at(slot, kvh, p);
                            (0..d).map(|c| qv[c] as f64 * kc[s + c] as f64).sum::<f64>() * scale
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (p, s) in scores.iter().enumerate() {
                        let w = (s - m).exp() / z;
                        for c in 0..d {
                            want[(t * nh + h) * d + c] += w * vc[at(slot, kvh, p) + c] as f64;
                        }
                    }
                }
            }
            let mask = if causal {
                ops::AttnMask::Causal
            } else {
                ops::AttnMask::Bidirectional { lens: &lens_t }
            };
            let mut kernels: Vec<Option<&'static str>> = vec![None];
            kernels.extend(
                variants::ATTENTION
                    .iter()
                    .filter(|v| variants::attention_applies(v, seq, d))
                    .map(|v| Some(v.name)),
            );
            for kernel in kernels {
                let out = poisoned(gpu, tokens * nh * d);
                let cache = ops::KvCache {
                    k: &kt,
                    v: &vt,
                    seqs: &seqs,
                };
                run(gpu, |e| {
                    ops::attention_with(gpu, e, (&qt, cache, &out), &shape, mask, kernel).unwrap()
                });
                let name = format!(
                    "attention {kernel:?} causal={causal} b{batch} s{seq} past{past0} h{nh}/{nkv} d{d}"
                );
                assert_close(&name, &gpu.read_f32(&out).unwrap(), &want, 1e-5);
            }
        }
    }
}

/// A shape of the flash-prefill test: `batch` rows of `seq` queries, row b at past
/// `past0 + 3b`, grouped heads, a sliding window or a bidirectional mask, an f32 or f16 cache.
#[derive(Debug, Clone, Copy)]
struct FlashCase {
    batch: usize,
    seq: usize,
    past0: usize,
    heads: (usize, usize),
    d: usize,
    window: Option<usize>,
    causal: bool,
    f16: bool,
}

impl FlashCase {
    fn shape(&self) -> AttnShape {
        let (n_heads, n_kv_heads) = self.heads;
        AttnShape {
            batch: self.batch,
            seq: self.seq,
            slots: self.batch + 1,
            n_heads,
            n_kv_heads,
            head_dim: self.d,
            max_seq: self.past0 + 3 * self.batch + self.seq + 5,
            group: n_heads / n_kv_heads,
            q_head_offset: 0,
            kv_head_offset: 0,
        }
    }

    /// `(slot, past)` of each row: slots in reverse order, pasts growing.
    fn rows(&self) -> Vec<(usize, usize)> {
        (0..self.batch)
            .map(|b| (self.batch - b, self.past0 + 3 * b))
            .collect()
    }

    /// Real keys of each row (bidirectional): row b loses b of them to padding.
    fn lens(&self) -> Vec<u32> {
        (self.rows().iter().enumerate())
            .map(|(b, &(_, past))| (past + self.seq - b) as u32)
            .collect()
    }

    /// The keys query `i` of row `b` sees.
    fn keys(&self, b: usize, i: usize) -> std::ops::Range<usize> {
        let past = self.rows()[b].1;
        if !self.causal {
            return 0..self.lens()[b] as usize;
        }
        let pos = past + i;
        (pos + 1).saturating_sub(self.window.unwrap_or(usize::MAX))..pos + 1
    }

    /// The attention output in f64 (scores scaled by 1/sqrt(d)).
    fn reference(&self, q: &[f32], kc: &[f32], vc: &[f32]) -> Vec<f64> {
        let shape = self.shape();
        let (nh, nkv, d) = (shape.n_heads, shape.n_kv_heads, self.d);
        let at = |slot: usize, h: usize, p: usize| ((slot * nkv + h) * shape.max_seq + p) * d;
        let scale = 1.0 / (d as f64).sqrt();
        let mut want = vec![0.0; self.batch * self.seq * nh * d];
        for t in 0..self.batch * self.seq {
            let (b, i) = (t / self.seq, t % self.seq);
            let slot = self.rows()[b].0;
            for h in 0..nh {
                let kvh = h / shape.group;
                let qv = &q[(t * nh + h) * d..(t * nh + h + 1) * d];
                let score = |p: usize| {
                    let k = &kc[at(slot, kvh, p)..at(slot, kvh, p) + d];
                    let dot: f64 = qv.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum();
                    dot * scale
                };
                let keys = self.keys(b, i);
                let m = keys.clone().map(score).fold(f64::MIN, f64::max);
                let z: f64 = keys.clone().map(|p| (score(p) - m).exp()).sum();
                for p in keys {
                    let w = (score(p) - m).exp() / z;
                    for c in 0..d {
                        want[(t * nh + h) * d + c] += w * vc[at(slot, kvh, p) + c] as f64;
                    }
                }
            }
        }
        want
    }
}

/// Runs `case` with `kernel` (the tuned choice where `None`) into a poisoned output.
fn run_flash_case(
    gpu: &Gpu,
    case: &FlashCase,
    (q, kc, vc): (&Tensor, &Tensor, &Tensor),
    kernel: Option<&'static str>,
) -> Vec<f32> {
    let shape = case.shape();
    let seqs = seq_table(gpu, &case.rows());
    let lens = gpu.upload_u32("lens", &case.lens()).unwrap();
    let out = poisoned(gpu, case.batch * case.seq * shape.n_heads * case.d);
    let cache = ops::KvCache {
        k: kc,
        v: vc,
        seqs: &seqs,
    };
    let io = (q, cache, &out);
    run(gpu, |e| match (case.causal, case.window) {
        (true, Some(w)) => ops::attention_window(gpu, e, io, &shape, (None, w), kernel).unwrap(),
        (true, None) => {
            let mask = ops::AttnMask::Causal;
            ops::attention_with(gpu, e, io, &shape, mask, kernel).unwrap()
        }
        (false, _) => {
            let mask = ops::AttnMask::Bidirectional { lens: &lens };
            ops::attention_with(gpu, e, io, &shape, mask, kernel).unwrap()
        }
    });
    gpu.read_f32(&out).unwrap()
}

/// The flash prefill variants (head dimension fixed per pipeline) and every other variant that
/// applies, against f64: head dims 32, 64, 80, 96 and 128; queries not a multiple of the 64-query
/// workgroup nor of any key tile; rows with different pasts; grouped heads; sliding windows
/// narrower and wider than a tile; bidirectional with padding; an f16 cache.
#[test]
fn attention_flash_variants_head_dims_windows_f16() {
    let gpu = &common::gpus(1)[0];
    let case = |batch, seq, past0, heads, d| FlashCase {
        batch,
        seq,
        past0,
        heads,
        d,
        window: None,
        causal: true,
        f16: false,
    };
    let cases = [
        case(2, 70, 5, (6, 2), 64),
        FlashCase {
            causal: false,
            ..case(2, 67, 4, (3, 3), 64)
        },
        FlashCase {
            window: Some(20),
            ..case(1, 150, 7, (2, 1), 64)
        },
        FlashCase {
            window: Some(5),
            ..case(2, 33, 2, (4, 2), 128)
        },
        FlashCase {
            f16: true,
            ..case(2, 37, 30, (6, 2), 64)
        },
        case(2, 45, 6, (4, 1), 32),
        FlashCase {
            window: Some(40),
            ..case(1, 100, 0, (2, 2), 32)
        },
        // Head dim 32 (four queries per invocation too): an f16 cache with cached keys (a
        // chunk of a prompt) over several workgroups; padding; a window narrower than a
        // block of keys; more queries than the widest workgroup's 256.
        FlashCase {
            f16: true,
            ..case(2, 130, 9, (6, 2), 32)
        },
        FlashCase {
            causal: false,
            ..case(2, 67, 4, (3, 3), 32)
        },
        FlashCase {
            window: Some(3),
            ..case(1, 70, 3, (2, 1), 32)
        },
        case(1, 300, 2, (2, 1), 32),
        case(1, 65, 3, (2, 2), 80),
        case(2, 20, 50, (3, 1), 96),
        case(1, 66, 0, (4, 2), 128),
    ];
    let (mut flash_runs, mut flash4_runs) = (0, 0);
    for case in cases {
        if case.f16 && !gpu.supports_f16_weights() {
            assert!(std::env::var("CI").is_err(), "CI needs SHADER_F16");
            eprintln!("skipped the f16 case: {} has no SHADER_F16", gpu.label());
            continue;
        }
        let shape = case.shape();
        let round = |v: Vec<f32>| -> Vec<f32> {
            let keep = |x: f32| half::f16::from_f32(x).to_f32();
            v.into_iter()
                .map(|x| if case.f16 { keep(x) } else { x })
                .collect()
        };
        let kc = round(common::random(shape.cache_len(), 41));
        let vc = round(common::random(shape.cache_len(), 42));
        let q: Vec<f32> = (common::random(case.batch * case.seq * shape.n_heads * case.d, 43))
            .iter()
            .map(|v| v * 3.0)
            .collect();
        let upload = |name, v: &[f32]| match case.f16 {
            true => gpu.upload_f16(name, v).unwrap(),
            false => gpu.upload_f32(name, v).unwrap(),
        };
        let (kt, vt) = (upload("kc", &kc), upload("vc", &vc));
        let qt = gpu.upload_f32("q", &q).unwrap();
        let want = case.reference(&q, &kc, &vc);
        let mut kernels: Vec<Option<&'static str>> = vec![None];
        kernels.extend(
            (variants::ATTENTION.iter())
                .filter(|v| variants::attention_applies(v, case.seq, case.d))
                .map(|v| Some(v.name)),
        );
        for kernel in kernels {
            flash_runs += kernel.is_some_and(|k| k.starts_with("flash_")) as usize;
            flash4_runs += kernel.is_some_and(|k| k.starts_with("flash4_")) as usize;
            let got = run_flash_case(gpu, &case, (&qt, &kt, &vt), kernel);
            assert_close(&format!("{kernel:?} {case:?}"), &got, &want, 1e-5);
        }
    }
    assert!(flash_runs >= 8, "only {flash_runs} flash runs");
    assert!(
        flash4_runs >= 12,
        "only {flash4_runs} four-query flash runs"
    );
}

#[test]
fn attention_rejects_short_caches_and_bad_head_maps() {
    let gpu = &common::gpus(1)[0];
    let t = gpu.empty("t", DType::F32, 4096).unwrap();
    let seqs = gpu.empty("seqs", DType::U32, 2).unwrap();
    let mut shape = AttnShape {
        batch: 1,
        seq: 4,
        slots: 3,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 8,
        max_seq: 256,
        group: 2,
        q_head_offset: 0,
        kv_head_offset: 0,
    };
    let cache = ops::KvCache {
        k: &t,
        v: &t,
        seqs: &seqs,
    };
    let mut enc = gpu.encoder();
    let e = ops::attention(gpu, &mut enc, &t, cache, &t, &shape)
        .unwrap_err()
        .to_string();
    assert!(e.contains("k_cache has 4096 elements, needs 6144"), "{e}");
    shape.slots = 2;
    shape.n_heads = 3;
    let e = ops::attention(gpu, &mut enc, &t, cache, &t, &shape)
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not map onto KV heads"), "{e}");
}

#[test]
fn oversized_buffer_is_a_clear_error() {
    let gpu = &common::gpus(1)[0];
    let limit = gpu
        .info()
        .max_buffer_size
        .min(gpu.info().max_storage_binding);
    let e = gpu
        .empty("huge", DType::F32, (limit / 4 + 1024) as usize)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("huge needs") && e.contains("allows at most"),
        "{e}"
    );
}

/// Runs the device pick over `logits` (`batch` rows) with `draws`; returns (tokens,
/// non-finite counts).
fn device_pick(
    gpu: &Gpu,
    logits: &[f32],
    batch: usize,
    draws: &[f32],
    how: TokenPick,
) -> (Vec<u32>, Vec<u32>) {
    masked_pick(gpu, logits, batch, draws, (how, None))
}

/// As [`device_pick`], keeping each row to its bits of `allow` when given.
fn masked_pick(
    gpu: &Gpu,
    logits: &[f32],
    batch: usize,
    draws: &[f32],
    (how, allow): (TokenPick, Option<&[u32]>),
) -> (Vec<u32>, Vec<u32>) {
    adjusted_pick(gpu, logits, batch, draws, (how, allow, None))
}

/// As [`masked_pick`], the logits changed first by the packed `adjust` words when given.
fn adjusted_pick(
    gpu: &Gpu,
    logits: &[f32],
    batch: usize,
    draws: &[f32],
    (how, allow, adjust): (TokenPick, Option<&[u32]>, Option<&[u32]>),
) -> (Vec<u32>, Vec<u32>) {
    let vocab = logits.len() / batch;
    let lt = gpu.upload_f32("logits", logits).unwrap();
    let dt = gpu.upload_f32("draws", draws).unwrap();
    let words = batch * ops::allow_words(vocab);
    let at = gpu.empty("allow", DType::U32, words).unwrap();
    // Poisoned: an unmasked pick must not read it, a masked one overwrites it.
    gpu.write_u32(&at, allow.unwrap_or(&vec![0; words]))
        .unwrap();
    let jt = gpu
        .empty("adjust", DType::U32, ops::adjust_words(batch))
        .unwrap();
    // Poisoned: a row count of u32::MAX and offsets past the end, unless written.
    let poison = vec![u32::MAX; ops::adjust_words(batch)];
    gpu.write_u32(&jt, adjust.unwrap_or(&poison)).unwrap();
    let out = gpu.empty("picked", DType::U32, 2 * batch).unwrap();
    gpu.write_u32(&out, &vec![0xdead_beef; 2 * batch]).unwrap();
    let setup = ops::PickSetup {
        how,
        masked: allow.is_some(),
        adjusted: adjust.is_some(),
    };
    let io = ops::PickIo {
        logits: &lt,
        draws: &dt,
        allow: &at,
        adjust: &jt,
        out: &out,
    };
    run(gpu, |e| {
        ops::pick(gpu, e, io, (batch, vocab), setup).unwrap()
    });
    let words: Vec<u32> =
        bytemuck::pod_collect_to_vec(&gpu.read_bytes(out.buffer(), 0, out.bytes()).unwrap());
    (words[..batch].to_vec(), words[batch..].to_vec())
}

/// Greedy picks against the host argmax (ties to the lower id, NaN never wins), non-finite
/// logits counted per row, on vocabularies that are not workgroup multiples.
#[test]
fn argmax_picks_and_counts_non_finite() {
    let gpu = &common::gpus(1)[0];
    for (batch, vocab) in [(1, 1), (3, 257), (5, 1000), (2, 8193)] {
        let mut logits = common::random(batch * vocab, 30);
        // Row 1 (when there is one): a tie at the maximum, a NaN and an infinity.
        if batch > 1 && vocab > 10 {
            let r = &mut logits[vocab..2 * vocab];
            r[3] = 5.0;
            r[9] = 5.0;
            r[4] = f32::NAN;
            r[7] = f32::NEG_INFINITY;
        }
        let draws = vec![0.5; batch];
        let (tokens, bad) = device_pick(gpu, &logits, batch, &draws, TokenPick::Greedy);
        let want = wgpar::parallel::Logits {
            batch,
            vocab,
            data: logits.clone(),
        }
        .argmax();
        assert_eq!(tokens, want, "argmax {batch}x{vocab}");
        let want_bad: Vec<u32> = logits
            .chunks(vocab)
            .map(|r| r.iter().filter(|v| !v.is_finite()).count() as u32)
            .collect();
        assert_eq!(bad, want_bad, "non-finite counts {batch}x{vocab}");
    }
    // A row of NaN picks token 0 and counts every logit.
    let (tokens, bad) = device_pick(gpu, &[f32::NAN; 300], 1, &[0.1], TokenPick::Greedy);
    assert_eq!((tokens, bad), (vec![0], vec![300]));
}

/// Seeded top-k / temperature / top-p draws against the host sampler fed the same stream.
#[test]
fn device_sampling_matches_the_host_sampler() {
    use rand::{Rng, SeedableRng};
    use wgpar::model::sampling::{Sampler, SamplingParams};
    let gpu = &common::gpus(1)[0];
    let (batch, vocab) = (6, 733);
    for (top_k, temperature, top_p) in
        [(1, 1.0, 1.0), (5, 1.0, 1.0), (40, 0.7, 0.9), (64, 1.3, 0.5)]
    {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: 5 + top_k as u64,
        };
        let mut host = Sampler::new(params).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(params.seed);
        for round in 0..4 {
            let logits: Vec<f32> = common::random(batch * vocab, 40 + round)
                .iter()
                .map(|v| v * 4.0)
                .collect();
            let draws: Vec<f32> = (0..batch).map(|_| rng.random::<f64>() as f32).collect();
            let how = TokenPick::Sample {
                top_k,
                temperature,
                top_p,
            };
            let (tokens, bad) = device_pick(gpu, &logits, batch, &draws, how);
            let want: Vec<u32> = logits.chunks(vocab).map(|r| host.sample(r)).collect();
            assert_eq!(
                tokens, want,
                "top-k {top_k} T {temperature} top-p {top_p} round {round}"
            );
            assert!(bad.iter().all(|&n| n == 0));
        }
    }
    // Parameters the kernel cannot honour are refused, not clamped.
    let mut enc = gpu.encoder();
    let t = gpu.empty("t", DType::F32, 16).unwrap();
    let a = gpu.empty("a", DType::U32, 1).unwrap();
    let j = gpu.empty("j", DType::U32, ops::adjust_words(1)).unwrap();
    let o = gpu.empty("o", DType::U32, 2).unwrap();
    let io = ops::PickIo {
        logits: &t,
        draws: &t,
        allow: &a,
        adjust: &j,
        out: &o,
    };
    for how in [
        TokenPick::Sample {
            top_k: 0,
            temperature: 1.0,
            top_p: 1.0,
        },
        TokenPick::Sample {
            top_k: ops::MAX_TOP_K + 1,
            temperature: 1.0,
            top_p: 1.0,
        },
        TokenPick::Sample {
            top_k: 4,
            temperature: 0.0,
            top_p: 1.0,
        },
        TokenPick::Sample {
            top_k: 4,
            temperature: 1.0,
            top_p: 0.0,
        },
    ] {
        assert!(
            ops::pick(gpu, &mut enc, io, (1, 16), ops::PickSetup::plain(how)).is_err(),
            "{how:?}"
        );
    }
}

/// Masked picks (a structured-output grammar's bit set per row) against the host: greedy is
/// the argmax of the logits with every banned token at -inf, a seeded sample is the host
/// sampler's draw from them; the non-finite count still covers the whole row.
#[test]
fn masked_picks_keep_to_each_rows_allowed_tokens() {
    use rand::{Rng, SeedableRng};
    use wgpar::model::constraint::apply_mask;
    let gpu = &common::gpus(1)[0];
    let (batch, vocab) = (5, 1037);
    let words = ops::allow_words(vocab);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
    let logits: Vec<f32> = common::random(batch * vocab, 71)
        .iter()
        .map(|v| v * 4.0)
        .collect();
    // Row r allows about one token in 2 + 3r, row 0 everything (an unconstrained request).
    let allow: Vec<u32> = (0..batch)
        .flat_map(|r| {
            let mut row = vec![0u32; words];
            for t in 0..vocab {
                if r == 0 || rng.random_range(0..2 + 3 * r) == 0 {
                    row[t / 32] |= 1 << (t % 32);
                }
            }
            row
        })
        .collect();
    let masked: Vec<f32> = (logits.chunks(vocab).zip(allow.chunks(words)))
        .flat_map(|(l, a)| {
            let mut l = l.to_vec();
            apply_mask(a, &mut l);
            l
        })
        .collect();
    let argmax = |x: &[f32]| {
        (wgpar::parallel::Logits {
            batch,
            vocab,
            data: x.to_vec(),
        })
        .argmax()
    };
    let draws = vec![0.5; batch];
    let (tokens, bad) = masked_pick(
        gpu,
        &logits,
        batch,
        &draws,
        (TokenPick::Greedy, Some(&allow)),
    );
    assert_eq!(tokens, argmax(&masked));
    assert_eq!(bad, vec![0; batch]);
    // The mask changed the pick of every constrained row: it was compared, not bypassed.
    let free = argmax(&logits);
    assert_eq!(tokens[0], free[0]);
    assert!(
        (1..batch).filter(|&r| tokens[r] != free[r]).count() >= batch - 2,
        "{tokens:?} {free:?}"
    );
    let draws: Vec<f32> = (0..batch).map(|_| rng.random::<f64>() as f32).collect();
    let how = TokenPick::Sample {
        top_k: 20,
        temperature: 0.9,
        top_p: 0.95,
    };
    let (tokens, _) = masked_pick(gpu, &logits, batch, &draws, (how, Some(&allow)));
    for (r, (row, &u)) in masked.chunks(vocab).zip(&draws).enumerate() {
        let allowed = allow[r * words + tokens[r] as usize / 32] >> (tokens[r] % 32) & 1;
        assert_eq!(allowed, 1, "row {r} sampled a banned token {}", tokens[r]);
        let want = host_draw(row, u);
        assert_eq!(tokens[r], want, "row {r}");
    }
}

/// Top-k 20 at temperature 0.9, then top-p 0.95, then the draw `u` over what is left, in
/// f64 over the finite logits of `row` (written apart from the kernel and the sampler).
fn host_draw(row: &[f32], u: f32) -> u32 {
    let mut order: Vec<usize> = (0..row.len()).filter(|&i| row[i].is_finite()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(20);
    let top = row[order[0]] as f64;
    let probs: Vec<f64> = order
        .iter()
        .map(|&i| ((row[i] as f64 - top) / 0.9).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    let mut cumulative = 0.0;
    let keep = probs
        .iter()
        .position(|q| {
            cumulative += q / total;
            cumulative >= 0.95
        })
        .map_or(probs.len(), |i| i + 1);
    let kept: f64 = probs[..keep].iter().sum();
    let mut x = u as f64 * kept;
    for (i, q) in probs[..keep].iter().enumerate() {
        if x < *q {
            return order[i] as u32;
        }
        x -= q;
    }
    order[keep - 1] as u32
}

/// Logit adjustments (bias, repetition, penalties, bans) applied before the greedy pick,
/// against the same changes made on the host to a copy of the logits, with and without a
/// mask; rows without entries pick their plain argmax.
#[test]
fn adjusted_picks_follow_the_host_changes() {
    use rand::{Rng, SeedableRng};
    use wgpar::kernels::ops::LogitAdjust;
    let gpu = &common::gpus(1)[0];
    let (batch, vocab) = (5, 1037);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
    let logits: Vec<f32> = common::random(batch * vocab, 91)
        .iter()
        .map(|v| v * 4.0)
        .collect();
    let argmax = |x: &[f32]| {
        (wgpar::parallel::Logits {
            batch,
            vocab,
            data: x.to_vec(),
        })
        .argmax()
    };
    let plain = argmax(&logits);
    // Row 0 none; rows 1.. ban their plain pick, and change 40 r other tokens at random.
    let mut entries = Vec::new();
    for (r, &p) in plain.iter().enumerate().skip(1) {
        let mut tokens: Vec<u32> = (0..40 * r)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        tokens.push(p);
        tokens.sort_unstable();
        tokens.dedup();
        for t in tokens {
            let banned = t == p;
            entries.push(LogitAdjust {
                row: r as u32,
                token: t,
                add: rng.random_range(-3.0..3.0),
                repetition: [1.0, 1.7, 0.6][rng.random_range(0..3)],
                sub: if banned {
                    f32::INFINITY
                } else {
                    rng.random_range(-2.0..2.0)
                },
            });
        }
    }
    let mut changed = logits.clone();
    for e in &entries {
        let x = &mut changed[e.row as usize * vocab + e.token as usize];
        let mut y = *x + e.add;
        if e.repetition != 1.0 {
            y = if y > 0.0 {
                y / e.repetition
            } else {
                y * e.repetition
            };
        }
        *x = y - e.sub;
    }
    let words = ops::pack_adjustments(batch, vocab, &entries).unwrap();
    let draws = vec![0.5; batch];
    let how = (TokenPick::Greedy, None, Some(&words[..]));
    let (tokens, bad) = adjusted_pick(gpu, &logits, batch, &draws, how);
    assert_eq!(tokens, argmax(&changed));
    assert_eq!(bad, vec![0; batch]);
    assert_eq!(tokens[0], plain[0]);
    assert!(
        (1..batch).all(|r| tokens[r] != plain[r]),
        "{tokens:?} {plain:?}"
    );
    // With a mask of every other token as well: the changed logits, masked.
    let allow = vec![0x5555_5555u32; batch * ops::allow_words(vocab)];
    let masked: Vec<f32> = (changed.iter().enumerate())
        .map(|(i, &x)| {
            if (i % vocab) % 2 == 0 {
                x
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let how = (TokenPick::Greedy, Some(&allow[..]), Some(&words[..]));
    let (tokens, _) = adjusted_pick(gpu, &logits, batch, &draws, how);
    assert_eq!(tokens, argmax(&masked));
}

/// A request's bias, repetition, presence, frequency and `min_tokens` rules, made into the
/// device's entries, give the host picker's greedy token on each row; the packing refuses
/// what the kernel could not take.
#[test]
fn device_adjustments_pick_as_the_host_picker() {
    use wgpar::kernels::ops::LogitAdjust;
    use wgpar::model::sampling::{PickRules, RequestPicker};
    let gpu = &common::gpus(1)[0];
    let (batch, vocab) = (4, 700);
    let logits: Vec<f32> = common::random(batch * vocab, 93)
        .iter()
        .map(|v| v * 3.0)
        .collect();
    let plain = (wgpar::parallel::Logits {
        batch,
        vocab,
        data: logits.clone(),
    })
    .argmax();
    let mut entries = Vec::new();
    let mut want = Vec::new();
    for (r, row) in logits.chunks(vocab).enumerate() {
        let p = plain[r];
        let rules = PickRules {
            bias: vec![(p, -100.0 * (r % 2) as f32), ((p + 7) % vocab as u32, 2.5)],
            presence: 0.3 * r as f32,
            frequency: 0.45,
            repetition: [1.0, 1.3, 0.8, 2.0][r],
            min_tokens: 6,
            end_tokens: vec![(p + 1) % vocab as u32],
            ..PickRules::greedy()
        };
        // The plain pick in the prompt (repetition), two tokens generated, one twice.
        let mut picker = RequestPicker::new(rules, None, &[p, 3, 9]).unwrap();
        for t in [(p + 2) % vocab as u32, 5, 5] {
            picker.accept(t).unwrap();
        }
        entries.extend(picker.device_adjustments(r as u32, vocab).unwrap());
        want.push(picker.pick(row).unwrap().id);
    }
    let words = ops::pack_adjustments(batch, vocab, &entries).unwrap();
    let how = (TokenPick::Greedy, None, Some(&words[..]));
    let (tokens, _) = adjusted_pick(gpu, &logits, batch, &vec![0.5; batch], how);
    assert_eq!(tokens, want);
    assert_ne!(want, plain, "the rules changed no pick");
    // A sampler or log-probs keep the picker on the host.
    let sampled = PickRules {
        sampling: Some(wgpar::model::sampling::SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
        }),
        ..PickRules::greedy()
    };
    let p = RequestPicker::new(sampled, None, &[]).unwrap();
    assert!(p.device_adjustments(0, vocab).is_none());
    let p = RequestPicker::new(PickRules::greedy(), Some(2), &[]).unwrap();
    assert!(p.device_adjustments(0, vocab).is_none());
    let e = |row, token| LogitAdjust {
        row,
        token,
        add: 1.0,
        repetition: 1.0,
        sub: 0.0,
    };
    assert!(ops::pack_adjustments(2, vocab, &[e(2, 1)]).is_err());
    assert!(ops::pack_adjustments(2, vocab, &[e(0, vocab as u32)]).is_err());
    assert!(ops::pack_adjustments(2, vocab, &[e(1, 4), e(1, 4)]).is_err());
    let many: Vec<LogitAdjust> = (0..=ops::MAX_ADJUST_PER_ROW as u32)
        .map(|t| e(0, t))
        .collect();
    assert!(ops::pack_adjustments(1, 5000, &many).is_err());
    assert!(ops::pack_adjustments(1, 5000, &many[1..]).is_ok());
}

/// Issue 34 item 2: a small roofline run. The copy kernel gives a finite rate; every packed
/// variant that applies (the GEMVs only at decode rows) and every dense variant gets its
/// weight bytes as stored, a finite weight bandwidth consistent with its time, and its ratio
/// to the copy's; figures that do not apply stay unset (printed n/a). Where the adapter offers
/// the packed integer dot product, its GEMVs have rows too.
#[test]
fn roofline_rows_have_finite_bandwidth_and_ratio() {
    use wgpar::kernels::bench::{bench_kernels, KernelBenchOptions};
    use wgpar::kernels::quant_dp4;
    use wgpar::kernels::roofline::{bench_variants, COPY_KERNEL};
    use wgpar::model::quant::QuantType;
    let gpu = &common::gpus(1)[0];
    let qtypes = vec![QuantType::Q8_0, QuantType::Q4K];
    let opts = KernelBenchOptions {
        sizes: Vec::new(),
        shapes: vec![(1, 40, 256), (9, 24, 512)],
        iters: 1,
        warmup: 0,
        f16: false,
        others: false,
        save: false,
        qtypes: qtypes.clone(),
        copy_bytes: Some(1 << 20),
        ..Default::default()
    };
    let rows = bench_kernels(gpu, &opts).unwrap();
    let copy = &rows[0];
    assert_eq!(copy.kernel, COPY_KERNEL);
    let copy_gbps = copy.gbps.unwrap();
    assert!(copy_gbps.is_finite() && copy_gbps > 0.0, "{copy:?}");
    assert!(copy.weight_gbps.is_none() && copy.of_copy.is_none() && copy.gflops.is_none());
    let mut packed = 0;
    for (m, n, k) in opts.shapes.clone() {
        let shape = format!("{m}x{n}x{k}");
        let dense: Vec<_> = rows
            .iter()
            .filter(|r| r.shape == shape && r.dtype == "f32")
            .collect();
        assert!(!dense.is_empty(), "{shape}");
        for r in &dense {
            assert_eq!(r.weight_bytes, Some((n * k * 4) as u64), "{}", r.kernel);
            assert_eq!(r.weight_buffers, Some(1), "{}", r.kernel);
        }
        for &t in &qtypes {
            let got: Vec<_> = (rows.iter())
                .filter(|r| r.shape == shape && r.dtype == t.name())
                .collect();
            let want: Vec<&str> = (bench_variants(gpu, t, m, &[]).iter())
                .map(|v| v.name)
                .collect();
            let names: Vec<&str> = got.iter().map(|r| r.kernel.as_str()).collect();
            assert_eq!(names, want, "{shape} {t:?}");
            let dp4 = names.iter().filter(|n| n.starts_with("qdp4")).count();
            let offered = quant_dp4::offered(gpu).is_ok() && m <= 8;
            assert_eq!(
                dp4 > 0,
                offered,
                "{shape} {t:?}: integer-dot rows {names:?}"
            );
            assert_eq!(got.iter().filter(|r| r.winner).count(), 1, "{shape} {t:?}");
            for r in got {
                let w = (n * t.row_bytes(k).unwrap()) as u64;
                assert_eq!(r.weight_bytes, Some(w), "{}", r.kernel);
                assert_eq!(
                    r.xy_bytes,
                    Some(((m * k + m * n) * 4) as u64),
                    "{}",
                    r.kernel
                );
                let gbps = r.weight_gbps.unwrap();
                let want = w as f64 / (r.median_ms / 1e3) / 1e9;
                assert!(gbps.is_finite() && gbps > 0.0, "{r:?}");
                assert!((gbps - want).abs() <= 1e-9 * want.max(1.0), "{r:?}");
                let ratio = r.of_copy.unwrap();
                assert!(
                    (ratio - gbps / copy_gbps).abs() <= 1e-12 * ratio.max(1.0),
                    "{r:?}"
                );
                assert!(r.speedup_vs_naive.is_none() && r.speedup_vs_legacy.is_none());
                packed += 1;
            }
        }
    }
    // Decode rows: every variant of both types; 9 rows: the GEMMs alone.
    assert!(packed >= 2 * 3 + 2, "{packed} packed rows");
    for r in rows.iter().filter(|r| r.kernel != COPY_KERNEL) {
        assert!(r.of_copy.is_some_and(f64::is_finite), "{r:?}");
    }
}

/// Issue 34 item 2 through the command line: the roofline table follows the kernel table, with
/// the copy's rate and each matmul's ratio, and `n/a` (never 0) where a figure was not measured.
#[test]
fn bench_kernels_prints_the_roofline_with_na_for_unmeasured() {
    let args = [
        "bench",
        "kernels",
        "--devices",
        "0",
        "--sizes=",
        "--shapes",
        "1x48x256",
        "--dtypes",
        "f32",
        "--qtypes",
        "q6_k",
        "--kernels",
        "qgemm_q6_k",
        "--copy-size",
        "2M",
        "--iters",
        "1",
        "--no-others",
        "--no-save",
    ];
    let (ok, out, err) = common::wgpar(&args);
    assert!(ok, "{err}");
    let line = |start: &str| {
        out.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no line starting {start}: {out}"))
    };
    // The copy has no arithmetic rate and no naive or legacy comparison.
    let copy: Vec<&str> = line("copy_vec4").split_whitespace().collect();
    assert_eq!(copy[..4], ["copy_vec4", "2", "MiB", "f32"], "{out}");
    assert_eq!(copy[5], "n/a", "{out}");
    let copy_gbps: f64 = copy[7].parse().unwrap();
    assert!(copy_gbps > 0.0, "{out}");
    let roof = line("# roofline");
    assert!(roof.contains("copy_vec4 of 2 MiB moved"), "{roof}");
    // In the roofline table: weights MB, buffers rotated, x+y KB, weight GB/s, of peak (none
    // given), copy GB/s, of copy.
    let packed: Vec<&str> = (out.lines())
        .skip_while(|l| !l.starts_with("# roofline"))
        .find(|l| l.starts_with("qgemm_q6_k"))
        .unwrap_or_else(|| panic!("no packed roofline row: {out}"))
        .split_whitespace()
        .collect();
    let weights_mb: f64 = packed[4].parse().unwrap();
    assert!((weights_mb - 48.0 * 210.0 / 1e6).abs() < 0.01, "{packed:?}");
    let buffers: usize = packed[5].parse().unwrap();
    assert!(buffers > 1, "{packed:?}");
    let weight_gbps: f64 = packed[7].parse().unwrap();
    assert!(weight_gbps.is_finite() && weight_gbps > 0.0, "{packed:?}");
    assert_eq!(packed[8], "n/a", "{packed:?}");
    let of_copy: f64 = packed[10].trim_end_matches('%').parse().unwrap();
    assert!(of_copy > 0.0, "{packed:?}");
    for l in out.lines() {
        assert!(
            !l.split_whitespace().any(|w| w == "0.00" || w == "0.0%"),
            "a zero printed for a figure: {l}"
        );
    }
}
