//! Collectives and transfers on virtual devices (lavapipe in CI), checked against a CPU
//! reference on random data. Run serially: `--test-threads=1`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use wgpar::comm::{
    reference_sum, Algorithm, CollectiveOp, Collectives, CommConfig, Communicator, LinkPrecision,
};
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions, Tensor};

const COUNTS: [usize; 4] = [1, 3, 1023, (1 << 20) + 5];
const DTYPES: [DType; 2] = [DType::F32, DType::F16];
const ALGOS: [Algorithm; 2] = [Algorithm::GatherReduceBroadcast, Algorithm::Pipelined];

fn devices(n: usize) -> Vec<Arc<Gpu>> {
    let adapters = Adapters::discover().expect("no adapter: install mesa-vulkan-drivers");
    let adapter = adapters.preferred();
    open_devices(
        &adapters,
        &DeviceSelection::Virtual { adapter, count: n },
        &GpuOptions::default(),
    )
    .expect("open virtual devices")
}

/// Random values of either sign in [0.25, 2): never zero, and distinct enough that a missing
/// or misplaced element cannot match by chance.
fn random(seed: u64, len: usize, dtype: DType) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len)
        .map(|_| {
            let v: f32 = rng.random_range(0.25..2.0);
            let v = if rng.random::<bool>() { v } else { -v };
            stored(dtype, v)
        })
        .collect()
}

/// The value as the device stores it.
fn stored(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn upload(gpu: &Gpu, dtype: DType, data: &[f32]) -> Tensor {
    match dtype {
        DType::F16 => gpu.upload_f16("test input", data).unwrap(),
        _ => gpu.upload_f32("test input", data).unwrap(),
    }
}

fn poisoned(gpu: &Gpu, dtype: DType, len: usize) -> Tensor {
    let t = gpu.empty("test output", dtype, len).unwrap();
    gpu.poison(&t);
    t
}

fn read(gpu: &Gpu, t: &Tensor) -> Vec<f32> {
    let bytes = gpu.read_bytes(t.buffer(), 0, t.bytes()).unwrap();
    match t.dtype() {
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytemuck::pod_collect_to_vec(&bytes),
    }
}

/// Tolerance: the engine sums in the reference's order, so results should be exact; allow one
/// unit in the last place of the dtype, relative to the sum of magnitudes.
fn check(what: &str, dtype: DType, got: &[f32], want: &[f32], magnitude: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let eps = match dtype {
        DType::F16 => 1.0 / 1024.0,
        _ => 1.0 / 8_388_608.0,
    };
    let mut wrong = 0;
    let mut first = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = eps * magnitude[i].max(w.abs());
        if !(g - w).abs().le(&tol) {
            wrong += 1;
            first.get_or_insert((i, *g, *w));
        }
    }
    assert_eq!(
        wrong, 0,
        "{what}: {wrong} wrong, first (index, got, want) {first:?}"
    );
}

fn magnitudes(inputs: &[Vec<f32>]) -> Vec<f32> {
    let abs: Vec<Vec<f32>> = inputs
        .iter()
        .map(|v| v.iter().map(|x| x.abs()).collect())
        .collect();
    reference_sum(DType::F32, &abs)
}

/// A config with tiny chunks, so that small tensors still take many pipelined steps, several
/// host threads and slot reuse.
fn small_chunks() -> CommConfig {
    CommConfig {
        chunk_bytes: 4096,
        max_slot_bytes: 16384,
        depth: 3,
        max_idle_slots: 3,
        host_threads: 3,
        parallel_min_bytes: 512,
        ..CommConfig::default()
    }
}

fn all_reduce_case(
    coll: &Collectives,
    gpus: &[Arc<Gpu>],
    len: usize,
    dtype: DType,
    algo: Algorithm,
) {
    let n = gpus.len();
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| random((len * 31 + r) as u64, len, dtype))
        .collect();
    let tensors: Vec<Tensor> = gpus
        .iter()
        .zip(&inputs)
        .map(|(g, d)| upload(g, dtype, d))
        .collect();
    let parts: Vec<(&Gpu, &Tensor)> = gpus.iter().map(|g| g.as_ref()).zip(&tensors).collect();
    coll.all_reduce_with(&parts, algo).unwrap();
    let want = reference_sum(dtype, &inputs);
    let mag = magnitudes(&inputs);
    for (r, (g, t)) in gpus.iter().zip(&tensors).enumerate() {
        check(
            &format!("all_reduce n={n} len={len} {dtype:?} {algo} rank {r}"),
            dtype,
            &read(g, t),
            &want,
            &mag,
        );
    }
}

#[test]
fn all_reduce_matches_reference() {
    let gpus = devices(4);
    let coll = Collectives::new(CommConfig::default()).unwrap();
    let small = Collectives::new(small_chunks()).unwrap();
    for n in 1..=4 {
        for &len in &COUNTS {
            for dtype in DTYPES {
                for algo in ALGOS {
                    all_reduce_case(&coll, &gpus[..n], len, dtype, algo);
                }
                if len < 100_000 {
                    all_reduce_case(&small, &gpus[..n], len, dtype, Algorithm::Pipelined);
                    all_reduce_case(
                        &small,
                        &gpus[..n],
                        len,
                        dtype,
                        Algorithm::GatherReduceBroadcast,
                    );
                }
            }
        }
    }
    let s = coll.stats();
    assert_eq!(s.calls(CollectiveOp::AllReduce), 4 * 4 * 2 * 2);
    let big = s
        .records()
        .into_iter()
        .find(|r| {
            r.participants.len() == 4
                && r.count == (1 << 20) + 5
                && r.algorithm == Algorithm::Pipelined
        })
        .expect("a pipelined 4-device record");
    assert_eq!(big.dtype, DType::F32);
    assert_eq!(big.bytes, 4 * ((1 << 20) + 5));
    assert_eq!(big.d2h_bytes, 4 * big.bytes.div_ceil(4) * 4);
    assert_eq!(big.chunks, 5);
    assert!(big.error.is_none());
    assert!(big.end > big.start && big.d2h + big.reduce + big.h2d <= big.end - big.start);
}

#[test]
fn f16_link_all_reduce_stays_within_its_documented_error() {
    let gpus = devices(4);
    let coll = Collectives::new(CommConfig {
        link: LinkPrecision::F16,
        ..CommConfig::default()
    })
    .unwrap();
    for n in 2..=4 {
        for &len in &COUNTS {
            for algo in ALGOS {
                let inputs: Vec<Vec<f32>> = (0..n)
                    .map(|r| random((len * 7 + r + 99) as u64, len, DType::F32))
                    .collect();
                let tensors: Vec<Tensor> = gpus[..n]
                    .iter()
                    .zip(&inputs)
                    .map(|(g, d)| upload(g, DType::F32, d))
                    .collect();
                let parts: Vec<(&Gpu, &Tensor)> =
                    gpus[..n].iter().map(|g| g.as_ref()).zip(&tensors).collect();
                coll.all_reduce_with(&parts, algo).unwrap();
                let exact = reference_sum(DType::F32, &inputs);
                let mag = magnitudes(&inputs);
                let mut rounded = 0;
                for (g, t) in gpus[..n].iter().zip(&tensors) {
                    let got = read(g, t);
                    for i in 0..len {
                        let bound = mag[i] / 1024.0 + exact[i].abs() / 2048.0 + 1e-6;
                        assert!(
                            (got[i] - exact[i]).abs() <= bound,
                            "n={n} len={len} {algo} [{i}]: {} vs {} (bound {bound})",
                            got[i],
                            exact[i]
                        );
                        rounded += (got[i] != exact[i]) as usize;
                    }
                }
                // The payload really went through f16.
                if len > 100 {
                    assert!(rounded > 0);
                }
            }
        }
    }
    let rec = coll
        .stats()
        .records()
        .into_iter()
        .rfind(|r| r.count == (1 << 20) + 5)
        .unwrap();
    assert_eq!(rec.link, LinkPrecision::F16);
    assert_eq!(rec.dtype, DType::F32);
    assert_eq!(rec.bytes, 4 * ((1 << 20) + 5));
    assert_eq!(rec.d2h_bytes, 4 * 2 * (((1 << 20) + 6) as u64));
}

fn gather_case(
    coll: &Collectives,
    gpus: &[Arc<Gpu>],
    m: usize,
    dtype: DType,
    algo: Algorithm,
    scatter: bool,
) {
    let n = gpus.len();
    let in_len = if scatter { n * m } else { m };
    let out_len = if scatter { m } else { n * m };
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| random((m * 17 + r + 1000) as u64, in_len, dtype))
        .collect();
    let ins: Vec<Tensor> = gpus
        .iter()
        .zip(&inputs)
        .map(|(g, d)| upload(g, dtype, d))
        .collect();
    let outs: Vec<Tensor> = gpus.iter().map(|g| poisoned(g, dtype, out_len)).collect();
    let parts: Vec<(&Gpu, &Tensor, &Tensor)> = gpus
        .iter()
        .zip(ins.iter().zip(&outs))
        .map(|(g, (i, o))| (g.as_ref(), i, o))
        .collect();
    let what = format!(
        "{} n={n} m={m} {dtype:?} {algo}",
        if scatter {
            "reduce_scatter"
        } else {
            "all_gather"
        }
    );
    if scatter {
        coll.reduce_scatter_with(&parts, algo).unwrap();
        let sum = reference_sum(dtype, &inputs);
        let mag = magnitudes(&inputs);
        for (r, (g, o)) in gpus.iter().zip(&outs).enumerate() {
            let slice = r * m..(r + 1) * m;
            check(
                &format!("{what} rank {r}"),
                dtype,
                &read(g, o),
                &sum[slice.clone()],
                &mag[slice],
            );
        }
        // Inputs are left alone.
        check(
            &format!("{what} input"),
            dtype,
            &read(&gpus[0], &ins[0]),
            &inputs[0],
            &vec![0.0; in_len],
        );
    } else {
        coll.all_gather_with(&parts, algo).unwrap();
        let want: Vec<f32> = inputs.concat();
        for (r, (g, o)) in gpus.iter().zip(&outs).enumerate() {
            check(
                &format!("{what} rank {r}"),
                dtype,
                &read(g, o),
                &want,
                &vec![0.0; out_len],
            );
        }
    }
}

#[test]
fn all_gather_and_reduce_scatter_match_reference() {
    let gpus = devices(4);
    let coll = Collectives::new(CommConfig::default()).unwrap();
    let small = Collectives::new(small_chunks()).unwrap();
    for scatter in [false, true] {
        for n in 1..=4 {
            for &m in &COUNTS {
                // Counts are per rank: odd ones put f16 slices at odd offsets in every chunk.
                for dtype in DTYPES {
                    for algo in ALGOS {
                        gather_case(&coll, &gpus[..n], m, dtype, algo, scatter);
                    }
                    if m < 100_000 {
                        gather_case(&small, &gpus[..n], m, dtype, Algorithm::Pipelined, scatter);
                    }
                }
            }
        }
    }
}

#[test]
fn point_to_point_transfers() {
    let gpus = devices(3);
    let coll = Collectives::new(small_chunks()).unwrap();
    for dtype in DTYPES {
        for &len in &[1usize, 3, 1023, 50_001] {
            let data = random(len as u64 + 7, len, dtype);
            let src = upload(&gpus[0], dtype, &data);
            let dst = poisoned(&gpus[1], dtype, len);
            coll.send_recv((&gpus[0], &src), (&gpus[1], &dst)).unwrap();
            check("send_recv", dtype, &read(&gpus[1], &dst), &data, &data);

            // Split download (a pipeline stage's hand-off): start, then collect.
            let pending = coll.begin_download(&gpus[1], &dst).unwrap();
            assert_eq!(pending.bytes(), (len * dtype.size()) as u64);
            let bytes = pending.finish().unwrap();
            let third = poisoned(&gpus[2], dtype, len);
            coll.upload(&gpus[2], &third, 0, &bytes).unwrap();
            check(
                "download + upload",
                dtype,
                &read(&gpus[2], &third),
                &data,
                &data,
            );

            // An unaligned element range downloads exactly those elements.
            if len > 10 {
                let mut out = Vec::new();
                coll.begin_download_range(&gpus[0], &src, 3..len - 2)
                    .unwrap()
                    .finish_into(&mut out)
                    .unwrap();
                let eb = dtype.size();
                assert_eq!(out.len(), (len - 5) * eb);
                let host = read(&gpus[0], &src);
                let first = match dtype {
                    DType::F16 => f16::from_le_bytes([out[0], out[1]]).to_f32(),
                    _ => f32::from_le_bytes([out[0], out[1], out[2], out[3]]),
                };
                assert_eq!(first, host[3]);
            }
        }
    }
    // Ring exchange and round trip.
    let data: Vec<Vec<f32>> = (0..3).map(|r| random(r, 5000, DType::F32)).collect();
    let sends: Vec<Tensor> = (0..3)
        .map(|r| upload(&gpus[r], DType::F32, &data[r]))
        .collect();
    let recvs: Vec<Tensor> = (0..3)
        .map(|r| poisoned(&gpus[r], DType::F32, 5000))
        .collect();
    let parts: Vec<(&Gpu, &Tensor, &Tensor)> = (0..3)
        .map(|r| (gpus[r].as_ref(), &sends[r], &recvs[r]))
        .collect();
    coll.shift(&parts, Algorithm::Pipelined).unwrap();
    for r in 0..3 {
        let from = (r + 2) % 3;
        check(
            "shift",
            DType::F32,
            &read(&gpus[r], &recvs[r]),
            &data[from],
            &data[from],
        );
    }
    let rt: Vec<(&Gpu, &Tensor)> = (0..3).map(|r| (gpus[r].as_ref(), &sends[r])).collect();
    coll.round_trip(&rt, Algorithm::Auto).unwrap();
    for r in 0..3 {
        check(
            "round_trip",
            DType::F32,
            &read(&gpus[r], &sends[r]),
            &data[r],
            &data[r],
        );
    }
    assert!(coll.stats().calls(CollectiveOp::Download) >= 8);
}

#[test]
fn staging_is_reused_in_steady_state() {
    let gpus = devices(2);
    let coll = Collectives::new(CommConfig::default()).unwrap();
    let ts: Vec<Tensor> = gpus
        .iter()
        .map(|g| upload(g, DType::F32, &random(1, 300_000, DType::F32)))
        .collect();
    let parts: Vec<(&Gpu, &Tensor)> = gpus.iter().map(|g| g.as_ref()).zip(&ts).collect();
    coll.all_reduce(&parts).unwrap();
    let warm = coll.staging_stats(&gpus[0]);
    for _ in 0..5 {
        coll.all_reduce(&parts).unwrap();
        coll.all_reduce_with(&parts, Algorithm::GatherReduceBroadcast)
            .unwrap();
    }
    let after = coll.staging_stats(&gpus[0]);
    assert!(warm.allocations > 0);
    assert!(
        after.allocations <= warm.allocations + 2,
        "staging buffers keep being created: {warm:?} -> {after:?}"
    );
    assert!(after.idle_bytes <= coll.config().staging_bound());
    coll.trim();
    assert_eq!(coll.staging_stats(&gpus[0]).idle_buffers, 0);
}

#[test]
fn mismatches_give_clear_errors() {
    let gpus = devices(3);
    let coll = Collectives::new(CommConfig::default()).unwrap();
    let a = gpus[0].upload_f32("a", &[1.0; 1024]).unwrap();
    let b = gpus[1].upload_f32("b", &[1.0; 1000]).unwrap();
    let e = coll
        .all_reduce(&[(&gpus[0], &a), (&gpus[1], &b)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("all_reduce: tensor 1 (gpu1) has 1000 elements but tensor 0 (gpu0) has 1024"),
        "{e}"
    );

    let h = gpus[1].upload_f16("h", &[1.0; 1024]).unwrap();
    let e = coll
        .all_reduce(&[(&gpus[0], &a), (&gpus[1], &h)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("half") && e.contains("float"), "{e}");

    let u = gpus[0].upload_u32("u", &[1; 4]).unwrap();
    let e = coll.all_reduce(&[(&gpus[0], &u)]).unwrap_err().to_string();
    assert!(e.contains("uint32"), "{e}");

    // The same device twice.
    let a2 = gpus[0].upload_f32("a2", &[1.0; 1024]).unwrap();
    let e = coll
        .all_reduce(&[(&gpus[0], &a), (&gpus[0], &a2)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("gpu0 is given twice"), "{e}");

    // A tensor paired with a device it does not live on, with two devices and with one.
    let c = gpus[2].upload_f32("c", &[1.0; 1024]).unwrap();
    let e = coll
        .all_reduce(&[(&gpus[0], &a), (&gpus[1], &c)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor 1 is not on gpu1") && e.contains("gpu2"),
        "{e}"
    );
    let e = coll.all_reduce(&[(&gpus[0], &c)]).unwrap_err().to_string();
    assert!(e.contains("tensor 0 is not on gpu0"), "{e}");
    // Nothing was left broken: the same engine still works.
    let c1 = gpus[1].upload_f32("c1", &[2.0; 1024]).unwrap();
    coll.all_reduce(&[(&gpus[0], &a), (&gpus[1], &c1)]).unwrap();
    assert_eq!(read(&gpus[1], &c1)[0], 3.0);

    // Gather shapes.
    let i0 = gpus[0].upload_f32("i0", &[1.0; 3]).unwrap();
    let i1 = gpus[1].upload_f32("i1", &[1.0; 3]).unwrap();
    let o0 = gpus[0].empty("o0", DType::F32, 6).unwrap();
    let o1 = gpus[1].empty("o1", DType::F32, 5).unwrap();
    let e = coll
        .all_gather(&[(&gpus[0], &i0, &o0), (&gpus[1], &i1, &o1)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor 1 (gpu1) output has 5 elements, expected 2 ranks x 3"),
        "{e}"
    );
    let e = coll
        .reduce_scatter(&[(&gpus[0], &o0, &i0), (&gpus[1], &o1, &i1)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("input has 5 elements, expected 2 ranks x 3"),
        "{e}"
    );

    // An output (first touched by an upload) on the wrong device.
    let o2 = gpus[2].empty("o2", DType::F32, 6).unwrap();
    let e = coll
        .all_gather(&[(&gpus[0], &i0, &o0), (&gpus[1], &i1, &o2)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensor 1 is not on gpu1"), "{e}");

    // Transfers.
    let e = coll
        .send_recv((&gpus[0], &a), (&gpus[1], &b))
        .unwrap_err()
        .to_string();
    assert!(e.contains("1000") && e.contains("1024"), "{e}");
    let e = coll
        .upload(&gpus[0], &a, 1020, &[0u8; 32])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("8 elements at offset 1020") && e.contains("1024"),
        "{e}"
    );
    let hh = gpus[0].upload_f16("hh", &[1.0; 9]).unwrap();
    let e = coll
        .upload(&gpus[0], &hh, 1, &[0u8; 4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiples of 4"), "{e}");
    let e = coll
        .begin_download_range(&gpus[0], &a, 10..2000)
        .unwrap_err()
        .to_string();
    assert!(e.contains("10..2000") && e.contains("1024"), "{e}");
    let e = coll.begin_download(&gpus[1], &a).unwrap_err().to_string();
    assert!(e.contains("not on gpu1"), "{e}");
    let failures: u64 = coll.stats().summary().iter().map(|s| s.failures).sum();
    assert!(failures >= 8, "failed calls are recorded too");
}

#[test]
fn rank_per_thread_collectives() {
    let gpus = devices(3);
    let comm = Communicator::new(gpus.clone(), CommConfig::default()).unwrap();
    let len = 70_001;
    let rounds = 4;
    let inputs: Vec<Vec<Vec<f32>>> = (0..rounds)
        .map(|k| {
            (0..3)
                .map(|r| random((k * 10 + r) as u64, len, DType::F32))
                .collect()
        })
        .collect();
    let inputs = Arc::new(inputs);
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let rank = comm.join(r).unwrap();
            let inputs = inputs.clone();
            std::thread::spawn(move || {
                let gpu = rank.gpu().clone();
                let mut results = Vec::new();
                for k in 0..rounds {
                    let t = gpu.upload_f32("partial", &inputs[k][r]).unwrap();
                    rank.all_reduce(&t).unwrap();
                    results.push(read(&gpu, &t));
                }
                // All-gather and reduce-scatter from the same threads.
                let piece = gpu.upload_f32("piece", &inputs[0][r][..1001]).unwrap();
                let gathered = gpu.empty("gathered", DType::F32, 3 * 1001).unwrap();
                rank.all_gather(&piece, &gathered).unwrap();
                let full = gpu.upload_f32("full", &inputs[1][r][..3 * 1001]).unwrap();
                let mine = gpu.empty("mine", DType::F32, 1001).unwrap();
                rank.reduce_scatter(&full, &mine).unwrap();
                (results, read(&gpu, &gathered), read(&gpu, &mine))
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let (results, gathered, mine) = h.join().unwrap();
        for k in 0..rounds {
            let want = reference_sum(DType::F32, &inputs[k]);
            check(
                &format!("rank {r} round {k}"),
                DType::F32,
                &results[k],
                &want,
                &magnitudes(&inputs[k]),
            );
        }
        let want: Vec<f32> = (0..3).flat_map(|q| inputs[0][q][..1001].to_vec()).collect();
        check("rank gather", DType::F32, &gathered, &want, &want);
        let parts: Vec<Vec<f32>> = (0..3).map(|q| inputs[1][q][..3 * 1001].to_vec()).collect();
        let sum = reference_sum(DType::F32, &parts);
        check(
            "rank scatter",
            DType::F32,
            &mine,
            &sum[r * 1001..(r + 1) * 1001],
            &magnitudes(&parts)[r * 1001..(r + 1) * 1001],
        );
    }
    // One record per collective, not per rank.
    assert_eq!(comm.stats().calls(CollectiveOp::AllReduce), rounds as u64);
    assert_eq!(comm.stats().calls(CollectiveOp::AllGather), 1);
    // Every handle is gone now: the communicator says who left.
    assert!(comm.aborted().is_some());
}

#[test]
fn rank_mismatch_fails_on_every_rank() {
    let gpus = devices(2);
    let comm = Communicator::new(gpus.clone(), CommConfig::default()).unwrap();
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let rank = comm.join(r).unwrap();
            std::thread::spawn(move || {
                let t = rank
                    .gpu()
                    .upload_f32("t", &vec![1.0; 100 + r * 28])
                    .unwrap();
                let first = rank.all_reduce(&t).map_err(|e| e.to_string());
                // Still usable after a mismatch.
                let u = rank.gpu().upload_f32("u", &[1.0; 16]).unwrap();
                rank.all_reduce(&u).unwrap();
                (first, read(rank.gpu(), &u)[0])
            })
        })
        .collect();
    for h in handles {
        let (first, after) = h.join().unwrap();
        let e = first.unwrap_err();
        assert!(
            e.contains("rank 1 (gpu1) has 128 elements but rank 0 (gpu0) has 100"),
            "{e}"
        );
        assert_eq!(after, 2.0);
    }
}

#[test]
fn a_failed_rank_does_not_hang_the_others() {
    let gpus = devices(3);
    let config = CommConfig {
        rendezvous_timeout: Duration::from_secs(30),
        ..CommConfig::default()
    };

    // Rank 2 fails before the collective (returns an error, dropping its handle); rank 1 panics
    // in a second round. Both must release the waiting ranks long before the timeout.
    for failure in ["error", "panic"] {
        let comm = Communicator::new(gpus.clone(), config.clone()).unwrap();
        let started = Instant::now();
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let rank = comm.join(r).unwrap();
                std::thread::spawn(move || -> Result<(), String> {
                    let t = rank
                        .gpu()
                        .upload_f32("t", &[1.0; 4096])
                        .map_err(|e| e.to_string())?;
                    if r == 2 {
                        std::thread::sleep(Duration::from_millis(100));
                        if failure == "panic" {
                            panic!("rank 2 blew up");
                        }
                        return Err("rank 2 could not compute its partial".into());
                    }
                    rank.all_reduce(&t).map_err(|e| e.to_string())
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        let waited = started.elapsed();
        assert!(
            waited < Duration::from_secs(10),
            "{failure}: took {waited:?}"
        );
        for result in &results[..2] {
            let e = result.as_ref().unwrap().as_ref().unwrap_err();
            assert!(
                e.contains("aborted") && e.contains("rank 2 (gpu2)"),
                "{failure}: {e}"
            );
        }
        let later = comm.all_reduce(0, &gpus[0].upload_f32("x", &[1.0]).unwrap());
        assert!(later.unwrap_err().to_string().contains("aborted"));
    }

    // A rank that never shows up (but keeps its handle) is caught by the timeout.
    let quick = CommConfig {
        rendezvous_timeout: Duration::from_millis(300),
        ..CommConfig::default()
    };
    let comm = Communicator::new(gpus[..2].to_vec(), quick).unwrap();
    let idle = comm.join(1).unwrap();
    let t = gpus[0].upload_f32("t", &[1.0; 8]).unwrap();
    let started = Instant::now();
    let e = comm.all_reduce(0, &t).unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(e.contains("waited") && e.contains("[1]"), "{e}");
    drop(idle);
}

#[test]
fn handles_can_cross_threads() {
    fn send<T: Send>() {}
    fn shared<T: Send + Sync>() {}
    shared::<Collectives>();
    shared::<Communicator>();
    send::<wgpar::comm::RankHandle>();
    send::<wgpar::comm::PendingDownload>();
    shared::<wgpar::comm::CommStats>();
}
