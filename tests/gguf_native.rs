//! A GGUF file's packed layer matrices, token embedding and LM head stay in the file's own
//! blocks on the device, type by type. Two files of random blocks (so that no quantizer of
//! wgpar's could reproduce them): a Q4_K_M-like mix of Q4_K, Q6_K and Q8_0, and a file holding
//! each of Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL and IQ4_XS. For each, the device holds
//! about the file's tensor bytes, the whole model; single, tensor-parallel and pipelined
//! engines pick the tokens of a CPU f64 reference on the file's blocks dequantized, and their
//! logits match it, not a reference re-rounded through wgpar's quantizer. A tensor-parallel
//! split that would cut a file's blocks is refused with the numbers; a type no kernel reads is
//! refused by name.

mod common;
mod gguf_support;
mod hf_support;

use std::path::{Path, PathBuf};

use gguf_support::{
    ggml_type_name, gguf_tensors, model_meta, random_blocks, reference_dequant, write_gguf_with,
    GgufSpec,
};
use hf_support::scratch;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::error::WgparError;
use wgpar::model::gguf::GgufFile;
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::{dequantize, QuantType};
use wgpar::model::weights::matrix_values;
use wgpar::model::{CpuReference, GpuModel, ModelConfig, ModelWeights, Placement};
use wgpar::parallel::{
    generate, Engine, Logits, Partition, PipelineEngine, SingleEngine, TensorParallelEngine,
};

/// A Llama with non-tile shapes where they may be (vocabulary 300, prompts of 5) whose inner
/// dimensions hold whole 256-value blocks, also per tensor-parallel shard of two.
fn config() -> ModelConfig {
    ModelConfig {
        name: "native".into(),
        vocab: 300,
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        ffn: 512,
        max_seq: 32,
        ..ModelConfig::preset("tiny-llama").unwrap()
    }
}

/// The type a Q4_K_M-like file stores tensor `name` in (the token embedding in Q4_K, the head,
/// V and down in Q6_K, one layer's Q and up in Q8_0); `None` for the norms (written F32).
fn file_type(name: &str) -> Option<QuantType> {
    match name {
        "token_embd.weight" => return Some(QuantType::Q4K),
        "output.weight" => return Some(QuantType::Q6K),
        _ => {}
    }
    let part = name.split('.').nth(2)?;
    let layer1 = name.starts_with("blk.1.");
    Some(match part {
        "attn_v" | "ffn_down" => QuantType::Q6K,
        "attn_q" | "ffn_up" if layer1 => QuantType::Q8_0,
        "attn_q" | "attn_k" | "attn_output" | "ffn_gate" | "ffn_up" => QuantType::Q4K,
        _ => return None,
    })
}

/// The type a file of every block type the Q4_K_M-like mix leaves out stores tensor `name` in:
/// each of Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL and IQ4_XS holds one or more of the
/// tables and the two layers' matrices; `None` for the norms.
fn other_type(name: &str) -> Option<QuantType> {
    use QuantType::*;
    match name {
        "token_embd.weight" => return Some(Q4_1),
        "output.weight" => return Some(Q5K),
        _ => {}
    }
    let part = name.split('.').nth(2)?;
    let layer0 = name.starts_with("blk.0.");
    Some(match (part, layer0) {
        ("attn_q", true) | ("attn_v", false) => Q5_0,
        ("attn_k", true) | ("attn_output", false) => Q5_1,
        ("attn_v", true) | ("ffn_gate", false) => Q2K,
        ("attn_output", true) | ("attn_q", false) => Q3K,
        ("ffn_gate", true) | ("ffn_down", false) => Iq4Nl,
        ("ffn_up", true) | ("attn_k", false) => Iq4Xs,
        ("ffn_down", true) => Q4_1,
        ("ffn_up", false) => Q5K,
        _ => return None,
    })
}

/// Which type each tensor of a test file is stored in.
type Mix = fn(&str) -> Option<QuantType>;

/// The metadata of `w` for a `llama` file.
fn spec(w: &ModelWeights) -> GgufSpec<'static> {
    let mut meta = model_meta(w, "llama");
    // The attention width (heads x head_dim) is twice the hidden size.
    let key_length = w.config.head_dim;
    meta.push(serde_json::json!([
        "llama.attention.key_length",
        "u32",
        key_length
    ]));
    GgufSpec {
        arch: "llama",
        matrices: QuantType::F32,
        meta,
    }
}

/// Writes a file of random blocks in `mix`'s types (under `dir`) and returns its path.
fn write_mixed(dir: &Path, mix: Mix) -> PathBuf {
    let w = ModelWeights::synthetic(&config(), 5);
    let tensors = gguf_tensors(&w, true);
    let spec = spec(&w);
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let seed: u64 = rng.random();
    write_gguf_with(dir, "mixed", &tensors, &spec, &|t| {
        let qtype = mix(&t.name)?;
        let name_seed = (t.name.bytes()).fold(seed, |h, b| h.wrapping_mul(31) ^ u64::from(b));
        let mut rng = ChaCha8Rng::seed_from_u64(name_seed);
        let blocks = t.values.len() / qtype.block_len();
        Some((
            ggml_type_name(qtype),
            Some(random_blocks(qtype, blocks, &mut rng)),
        ))
    })
}

fn load(path: &Path) -> ModelWeights {
    Checkpoint::open(path).unwrap().weights(false).unwrap()
}

/// A block whose scale is infinite, in the token table's second slice of rows (the reader
/// checks blocks 256 rows at a time): refused, naming the tensor and the value's index.
#[test]
fn a_non_finite_block_is_refused_naming_the_tensor_and_the_value() {
    let dir = scratch("gguf-native-inf");
    let path = write_mixed(&dir, file_type);
    let info = GgufFile::open(&path)
        .unwrap()
        .tensor("token_embd.weight")
        .unwrap()
        .clone();
    let mut bytes = std::fs::read(&path).unwrap();
    // Row 290 is one Q4_K block (256 values, 144 bytes); its f16 scale d becomes infinite.
    let at = info.start + 290 * 144;
    bytes[at..at + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
    let bad = dir.join("inf.gguf");
    std::fs::write(&bad, bytes).unwrap();
    let e = Checkpoint::open(&bad)
        .unwrap()
        .weights(false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("token_embd.weight") && e.contains(&format!("value {} is", 290 * 256)),
        "{e}"
    );
}

#[test]
fn the_device_holds_the_files_blocks_as_stored() {
    device_holds_the_blocks_of("gguf-native-bytes", file_type);
}

#[test]
fn the_device_holds_every_other_block_type_as_stored() {
    device_holds_the_blocks_of("gguf-native-bytes-other", other_type);
}

/// A file of `mix`'s types, loaded: every layer matrix and both tables are kept as the file's
/// blocks (whose values are llama.cpp's dequantization), and the device holds about the file's
/// tensor bytes.
fn device_holds_the_blocks_of(scratch_name: &str, mix: Mix) {
    let dir = scratch(scratch_name);
    let path = write_mixed(&dir, mix);
    let w = load(&path);
    let file = GgufFile::open(&path).unwrap();
    // Every layer matrix and both tables are kept in the file's type; all but Q and K byte
    // for byte (unpermuted).
    let mut kept = 0;
    for (name, info) in &file.tensors {
        let Some(t) = mix(name) else {
            continue;
        };
        let table = match name.as_str() {
            "token_embd.weight" => Some((&w.tables.wte, &w.wte)),
            "output.weight" => Some((&w.tables.lm_head, w.lm_head.as_ref().unwrap())),
            _ => None,
        };
        if let Some((m, dense)) = table {
            let m = m.as_ref().unwrap_or_else(|| panic!("{name} not kept"));
            assert_eq!((m.dtype, m.rows, m.cols), (t, 300, 256), "{name}");
            assert_eq!(m.bytes, file.data(info), "{name}");
            assert!(dense.is_empty(), "{name}: an f32 copy beside the blocks");
            assert_eq!(m.dequantize(), reference_dequant(&dir, name), "{name}");
            kept += 1;
            continue;
        }
        let layer: usize = name.split('.').nth(1).unwrap().parse().unwrap();
        let b = &w.layers[layer].blocks;
        let m = match name.split('.').nth(2).unwrap() {
            "attn_q" => &b.wq,
            "attn_k" => &b.wk,
            "attn_v" => &b.wv,
            "attn_output" => &b.wo,
            "ffn_gate" => &b.w_gate,
            "ffn_up" => &b.w_up,
            _ => &b.w_down,
        };
        let m = m.as_ref().unwrap_or_else(|| panic!("{name} not kept"));
        assert_eq!(m.dtype, t, "{name}");
        assert_eq!(m.bytes.len(), info.end - info.start, "{name}");
        if !name.contains("attn_q") && !name.contains("attn_k") {
            assert_eq!(m.bytes, file.data(info), "{name}");
        }
        // The host holds the blocks alone, whose values are llama.cpp's dequantization.
        if name.contains("attn_v") || name.contains("ffn_down") {
            let dense = if name.contains("attn_v") {
                &w.layers[layer].wv
            } else {
                &w.layers[layer].w_down
            };
            assert!(dense.is_empty(), "{name}: an f32 copy beside the blocks");
            let values = matrix_values(dense, Some(m));
            assert_eq!(*values, reference_dequant(&dir, name), "{name}");
            assert_eq!(*values, dequantize(t, &m.bytes), "{name}");
        }
        kept += 1;
    }
    assert_eq!(
        kept, 16,
        "two layers of seven matrices, the embedding and the head"
    );
    let file_bytes: u64 = file
        .tensors
        .iter()
        .map(|(_, i)| (i.end - i.start) as u64)
        .sum();
    let gpu = common::gpus(1).remove(0);
    let placement = || Placement::whole(&w.config);
    let before = gpu.bytes_allocated();
    let model = GpuModel::upload(gpu.clone(), &w, placement(), DType::F32).unwrap();
    let device_bytes = gpu.bytes_allocated() - before;
    drop(model);
    let mut dense = w.clone();
    dense.drop_blocks();
    let before = gpu.bytes_allocated();
    let model = GpuModel::upload(gpu.clone(), &dense, placement(), DType::F32).unwrap();
    let dense_bytes = gpu.bytes_allocated() - before;
    drop(model);
    // The host holds what the file holds (blocks, f32 norms and tables), not an f32 copy.
    let (host, dense_host) = (w.host_bytes(), dense.host_bytes());
    eprintln!(
        "file tensors {file_bytes} B, host {host} B (dense {dense_host} B), device \
         {device_bytes} B, dense f32 {dense_bytes} B"
    );
    assert!(
        host.abs_diff(file_bytes) * 100 <= file_bytes,
        "host weights {host} bytes, the file's tensors {file_bytes}"
    );
    assert!(dense_host > 3 * host, "dense host {dense_host}");
    assert!(
        device_bytes.abs_diff(file_bytes) * 100 <= file_bytes * 5,
        "device weights {device_bytes} bytes, the file's tensors {file_bytes}"
    );
    assert!(dense_bytes > 3 * device_bytes, "dense {dense_bytes}");
}

/// Greedy tokens and each step's logits (`[batch][vocab]` flattened) of the CPU reference.
fn reference_run(w: &ModelWeights, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<f32>> {
    let mut r = CpuReference::new(w);
    let mut logits = vec![r.prefill(prompts).unwrap()];
    for _ in 1..steps {
        let next = argmax(logits.last().unwrap());
        logits.push(r.decode(&next).unwrap());
    }
    logits.into_iter().map(|l| l.concat()).collect()
}

fn argmax(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter()
        .map(|r| {
            let best = r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1));
            best.map_or(0, |(i, _)| i as u32)
        })
        .collect()
}

/// Tokens `[batch][steps]` of per-step `[batch][vocab]` logits.
fn tokens_of(steps: &[Vec<f32>], batch: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); batch];
    for l in steps {
        let rows: Vec<Vec<f32>> = l.chunks(vocab).map(<[f32]>::to_vec).collect();
        for (b, t) in argmax(&rows).into_iter().enumerate() {
            out[b].push(t);
        }
    }
    out
}

#[test]
fn engines_on_the_files_blocks_match_the_f64_reference_of_those_blocks() {
    engines_match_the_reference_on("gguf-native-engines", file_type);
}

#[test]
fn engines_on_every_other_block_type_match_the_f64_reference() {
    engines_match_the_reference_on("gguf-native-engines-other", other_type);
}

/// Single, tensor-parallel and pipelined engines on a file of `mix`'s types pick the tokens of
/// the f64 reference on its blocks dequantized, step by step, the single engine's logits close
/// to it.
fn engines_match_the_reference_on(scratch_name: &str, mix: Mix) {
    let dir = scratch(scratch_name);
    let w = load(&write_mixed(&dir, mix));
    let (batch, steps, vocab) = (2, 6, config().vocab);
    let prompts = common::prompts(batch, 5, vocab, 8);
    let want = reference_run(&w, &prompts, steps);
    let want_tokens = tokens_of(&want, batch, vocab);
    // A second rounding (wgpar's quantizer on the dequantized values) is what the device must
    // not compute with: its logits sit measurably away from the file's.
    let rerounded = reference_run(&w.dequantized(QuantType::Q4K), &prompts, 1);
    let rel = |got: &[f32], want: &[f32]| {
        let got = Logits {
            batch,
            vocab,
            data: got.to_vec(),
        };
        got.relative_error(want)
    };
    let second_rounding = rel(&rerounded[0], &want[0]);
    assert!(
        second_rounding > 1e-3,
        "re-rounding moved logits by {second_rounding:.2e}"
    );
    let gpus = common::gpus(2);
    let mut single = SingleEngine::new(gpus[0].clone(), &w, DType::F32).unwrap();
    let mut next = Vec::new();
    let mut compared = 0;
    for (step, want) in want.iter().enumerate() {
        let got = if step == 0 {
            single.prefill(&prompts).unwrap()
        } else {
            single.decode(&next).unwrap()
        };
        assert!(got.data.iter().all(|v| v.is_finite()) && got.data.iter().any(|&v| v != 0.0));
        let err = got.relative_error(want);
        assert!(
            err < 1e-4 && err * 10.0 < second_rounding,
            "step {step}: logits {err:.2e} from the reference (a second rounding: \
             {second_rounding:.2e})"
        );
        next = got.argmax();
        let want_next: Vec<u32> = want_tokens.iter().map(|t| t[step]).collect();
        assert_eq!(next, want_next, "step {step}: single-device tokens");
        compared += 1;
    }
    assert_eq!(compared, steps);
    let mut tp =
        TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default()).unwrap();
    assert_eq!(
        generate(&mut tp, &prompts, steps).unwrap().tokens,
        want_tokens,
        "tp"
    );
    let mut pp = PipelineEngine::new(
        &gpus,
        &w,
        DType::F32,
        &Partition::Even,
        1,
        CommConfig::default(),
    )
    .unwrap();
    assert_eq!(
        generate(&mut pp, &prompts, steps).unwrap().tokens,
        want_tokens,
        "pp"
    );
}

#[test]
fn a_split_that_cuts_the_files_blocks_is_refused_and_q8_0_repacks_it() {
    let dir = scratch("gguf-native-split");
    let file = write_mixed(&dir, file_type);
    // The command line refuses it before any device opens (nothing on stdout, in moments).
    let start = std::time::Instant::now();
    let path = file.to_str().unwrap();
    let tp = [
        "run",
        "--model",
        path,
        "--strategy",
        "tp",
        "--virtual",
        "4",
        "--prompt-len",
        "4",
        "--gen",
        "2",
    ];
    let (ok, out, err) = common::wgpar(&tp);
    assert!(!ok && out.is_empty(), "{out}{err}");
    assert!(err.contains("0..128") && err.contains("q4_k"), "{err}");
    assert!(start.elapsed() < std::time::Duration::from_secs(5));
    let w = load(&file);
    let gpus = common::gpus(4);
    // Four shards of the attention output hold 128 columns each: half a Q4_K block.
    let e = TensorParallelEngine::new(&gpus, &w, DType::F32, None, CommConfig::default())
        .err()
        .expect("a split of 128 columns into 256-value blocks must be refused")
        .to_string();
    assert!(
        e.contains("0..128") && e.contains("q4_k") && e.contains("256") && e.contains("q8_0"),
        "{e}"
    );
    // Re-packed in 32-value blocks, the same split holds whole blocks.
    let repacked = ModelWeights {
        packed: Some(QuantType::Q8_0),
        ..w
    };
    let prompts = common::prompts(2, 5, config().vocab, 8);
    let mut tp =
        TensorParallelEngine::new(&gpus, &repacked, DType::F32, None, CommConfig::default())
            .unwrap();
    assert_eq!(generate(&mut tp, &prompts, 2).unwrap().tokens[0].len(), 2);
}

/// A tensor in a type no kernel reads (IQ2_XXS, IQ1_S, TQ2_0) is refused when the file is
/// opened, as a typed error naming the tensor and its type; `run` refuses it before any device
/// opens.
#[test]
fn types_without_kernels_are_refused_naming_the_tensor() {
    let dir = scratch("gguf-native-refused");
    let w = ModelWeights::synthetic(&config(), 9);
    let tensors = gguf_tensors(&w, true);
    let mut refused = 0;
    for (ggml_type, block_bytes) in [("IQ2_XXS", 66), ("IQ1_S", 50), ("TQ2_0", 66)] {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let bytes: Vec<u8> = (0..config().hidden * config().ffn / 256 * block_bytes)
            .map(|_| rng.random::<u8>())
            .collect();
        let stored = |t: &gguf_support::GgufTensor| -> gguf_support::Stored {
            (t.name == "blk.1.ffn_down.weight").then(|| (ggml_type, Some(bytes.clone())))
        };
        let path = write_gguf_with(&dir, ggml_type, &tensors, &spec(&w), &stored);
        match Checkpoint::open(&path).err() {
            Some(WgparError::TensorType {
                tensor,
                ggml_type: t,
                ..
            }) => {
                assert_eq!(
                    (tensor.as_str(), t.as_str()),
                    ("blk.1.ffn_down.weight", ggml_type)
                );
            }
            other => panic!("{ggml_type}: {other:?}"),
        }
        let start = std::time::Instant::now();
        let (ok, out, err) = common::wgpar(&["run", "--model", path.to_str().unwrap()]);
        assert!(!ok && out.is_empty(), "{out}{err}");
        assert!(
            err.contains("blk.1.ffn_down.weight") && err.contains(ggml_type),
            "{err}"
        );
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        refused += 1;
    }
    assert_eq!(refused, 3);
}

/// The devices' weight bytes and the file's tensor bytes of `run`'s last line.
fn weight_bytes(out: &str) -> (u64, u64) {
    let line = out.lines().find(|l| l.starts_with("weights: ")).unwrap();
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (nums[0], nums[1])
}

/// An F16 file runs in f16 by default (`--dtype auto`; the adapter has SHADER_F16), within
/// 10 % of its tensor bytes, and `run` prints both figures; `--dtype f32` widens it, as asked.
#[test]
fn an_f16_file_stays_f16_on_the_device_unless_asked() {
    let dir = scratch("gguf-native-f16");
    let w = ModelWeights::synthetic(&config(), 13);
    let spec = GgufSpec {
        matrices: QuantType::F16,
        ..spec(&w)
    };
    let path = gguf_support::write_gguf(&dir, "f16", &gguf_tensors(&w, true), &spec);
    let path = path.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--model", path, "--prompt-len", "4", "--gen", "2"];
        args.extend(extra);
        let (ok, out, err) = common::wgpar(&args);
        assert!(ok, "{out}{err}");
        out
    };
    let out = run(&[]);
    assert!(out.contains("F16 weights"), "{out}");
    let (device, file) = weight_bytes(&out);
    assert!(
        device.abs_diff(file) * 10 <= file,
        "device weights {device} B, the file's tensors {file} B"
    );
    let out = run(&["--dtype", "f32"]);
    assert!(out.contains("F32 weights"), "{out}");
    let (device32, file32) = weight_bytes(&out);
    assert_eq!(file32, file);
    assert!(
        device32 > device * 18 / 10,
        "f32 {device32} B, f16 {device} B"
    );
}
