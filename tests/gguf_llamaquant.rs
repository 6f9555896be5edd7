//! Files written by llama.cpp's own `llama-quantize` (issue 38): a one-layer random Llama
//! (hidden 256, vocabulary 64) quantized by the tool that writes the files people download,
//! one file per type with `--pure` and one Q4_K_M mix, committed under tests/data/llamaquant
//! (made by tests/gguf_support/llamaquant_fixtures.py; the README's test command cannot build
//! llama.cpp). For each file: every tensor is kept on the host in the file's own type, byte for
//! byte; its values are gguf-py's dequantization of those bytes (llama.cpp's reference code,
//! not wgpar's); the device holds about the file's bytes; and the single-device engine's
//! logits and greedy tokens follow the f64 CPU reference on the file's blocks.

mod common;
mod gguf_support;

use std::path::{Path, PathBuf};

use gguf_support::llama_dequantize;
use wgpar::device::DType;
use wgpar::model::gguf::GgufFile;
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::QuantType;
use wgpar::model::weights::{matrix_values, BlockMatrix};
use wgpar::model::{CpuReference, GpuModel, ModelWeights, Placement};
use wgpar::parallel::{Engine, SingleEngine};

/// Each fixture and the types llama-quantize stored its matrices in.
const FILES: [(&str, &[QuantType]); 13] = [
    ("pure-q8_0", &[QuantType::Q8_0]),
    ("pure-q4_0", &[QuantType::Q4_0]),
    ("pure-q4_1", &[QuantType::Q4_1]),
    ("pure-q5_0", &[QuantType::Q5_0]),
    ("pure-q5_1", &[QuantType::Q5_1]),
    ("pure-q2_k", &[QuantType::Q2K]),
    ("pure-q3_k", &[QuantType::Q3K]),
    ("pure-q4_k", &[QuantType::Q4K]),
    ("pure-q5_k", &[QuantType::Q5K]),
    ("pure-q6_k", &[QuantType::Q6K]),
    ("pure-iq4_nl", &[QuantType::Iq4Nl]),
    ("pure-iq4_xs", &[QuantType::Iq4Xs]),
    ("q4_k_m", &[QuantType::Q4K, QuantType::Q6K]),
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/llamaquant/{name}.gguf"))
}

/// The packed matrix wgpar holds for file tensor `name` (a table or a layer matrix) and the
/// dense copy beside it, which must be empty.
fn held<'a>(w: &'a ModelWeights, name: &str) -> (&'a BlockMatrix, &'a [f32]) {
    let l = &w.layers[0];
    let b = &l.blocks;
    let (m, dense): (Option<&BlockMatrix>, &[f32]) = match name {
        "token_embd.weight" => (w.tables.wte.as_ref(), &w.wte),
        "output.weight" => (w.tables.lm_head.as_ref(), w.lm_head.as_ref().unwrap()),
        _ => match name.split('.').nth(2).unwrap() {
            "attn_q" => (b.wq.as_ref(), &l.wq),
            "attn_k" => (b.wk.as_ref(), &l.wk),
            "attn_v" => (b.wv.as_ref(), &l.wv),
            "attn_output" => (b.wo.as_ref(), &l.wo),
            "ffn_gate" => (b.w_gate.as_ref(), l.w_gate.as_ref().unwrap()),
            "ffn_up" => (b.w_up.as_ref(), &l.w_up),
            _ => (b.w_down.as_ref(), &l.w_down),
        },
    };
    (m.unwrap_or_else(|| panic!("{name} not kept packed")), dense)
}

/// Every quantized tensor of the file is held in its type; its values (as the engines and the
/// reference read them) are gguf-py's dequantization of the file's bytes. Returns the file's
/// quantized tensor bytes and how many tensors were compared.
fn blocks_are_the_files(file: &GgufFile, w: &ModelWeights, types: &[QuantType]) -> (u64, usize) {
    let (mut bytes, mut compared) = (0u64, 0usize);
    for (name, info) in &file.tensors {
        if name.ends_with("norm.weight") {
            continue;
        }
        let (m, dense) = held(w, name);
        assert!(types.contains(&m.dtype), "{name}: {:?}", m.dtype);
        assert!(dense.is_empty(), "{name}: an f32 copy beside the blocks");
        let raw = file.data(info);
        // Q and K rows are permuted for wgpar's RoPE layout: same bytes, other order.
        if !name.contains("attn_q") && !name.contains("attn_k") {
            assert_eq!(m.bytes, raw, "{name}");
            let values = matrix_values(dense, Some(m));
            let want = llama_dequantize(m.dtype, raw);
            assert!(want.iter().any(|&v| v != 0.0), "{name}: all zero");
            assert_eq!(*values, want, "{name}: wgpar's values against gguf-py's");
        } else {
            assert_eq!(m.bytes.len(), raw.len(), "{name}");
        }
        bytes += raw.len() as u64;
        compared += 1;
    }
    (bytes, compared)
}

/// Logits of the single-device engine against the f64 reference, prefill and three decode
/// steps of a batch of two, the engine fed its own (= the reference's) greedy tokens.
fn engine_follows_the_reference(w: &ModelWeights, what: &str) {
    let prompts = common::prompts(2, 5, w.config.vocab, 38);
    let mut reference = CpuReference::new(w);
    let gpu = common::gpus(1).remove(0);
    let mut engine = SingleEngine::new(gpu, w, DType::F32).unwrap();
    let mut want = reference.prefill(&prompts).unwrap().concat();
    let mut got = engine.prefill(&prompts).unwrap();
    for step in 0..4 {
        assert!(got.data.iter().all(|v| v.is_finite()) && got.data.iter().any(|&v| v != 0.0));
        let err = got.relative_error(&want);
        assert!(
            err < 1e-4,
            "{what} step {step}: logits {err:.2e} from the reference"
        );
        let next = got.argmax();
        let rows: Vec<&[f32]> = want.chunks(w.config.vocab).collect();
        let want_next: Vec<u32> = rows
            .iter()
            .map(|r| {
                let best = r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1));
                best.unwrap().0 as u32
            })
            .collect();
        assert_eq!(next, want_next, "{what} step {step}: tokens");
        want = reference.decode(&next).unwrap().concat();
        got = engine.decode(&next).unwrap();
    }
}

#[test]
fn llama_quantize_files_load_packed_and_match_the_reference() {
    let mut checked = 0;
    for (name, types) in FILES {
        let path = fixture(name);
        let file = GgufFile::open(&path).unwrap();
        let w = Checkpoint::open(&path).unwrap().weights(false).unwrap();
        assert_eq!(
            (w.config.hidden, w.config.layers, w.config.vocab),
            (256, 1, 64)
        );
        let (file_bytes, tensors) = blocks_are_the_files(&file, &w, types);
        assert_eq!(
            tensors, 9,
            "{name}: seven layer matrices, the embedding and the head"
        );
        let gpu = common::gpus(1).remove(0);
        let before = gpu.bytes_allocated();
        let model =
            GpuModel::upload(gpu.clone(), &w, Placement::whole(&w.config), DType::F32).unwrap();
        let device = gpu.bytes_allocated() - before;
        drop(model);
        eprintln!("{name}: file matrices {file_bytes} B, device {device} B");
        // The device adds the norms and the RoPE tables (64 positions x 32 pairs x 2 x 4 B).
        let extra = 3 * 256 * 4 + 64 * 32 * 2 * 4 + 64;
        assert!(
            device >= file_bytes && device <= file_bytes + extra,
            "{name}: device {device} B for the file's {file_bytes} B"
        );
        engine_follows_the_reference(&w, name);
        checked += 1;
    }
    assert_eq!(checked, FILES.len());
}
