//! Writes GGUF checkpoints for the tests with llama.cpp's `gguf` Python package (from the tests'
//! `.venv`): `ModelWeights` under llama.cpp's tensor names, metadata as its converter writes
//! it, tensors in a chosen type. Q8_0, Q4_0, BF16 and F16 are packed by the package itself;
//! Q4_K and Q6_K (which it cannot quantize) by wgpar's quantizer, and the package then
//! dequantizes every packed tensor (`.deq` files) so the loader is checked against llama.cpp's
//! reference code.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use wgpar::model::quant::{quantize, QuantType};
use wgpar::model::{Arch, ModelConfig, ModelWeights};

/// tiny-llama with every inner dimension whole Q8_0 blocks, also when halved by tensor
/// parallelism over two devices.
pub fn whole_block_llama() -> ModelConfig {
    ModelConfig {
        hidden: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        ffn: 256,
        ..ModelConfig::preset("tiny-llama").unwrap()
    }
}

/// One tensor to write: name, shape (outermost first), values, heads to permute (llama Q/K).
pub struct GgufTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
    pub permute_heads: usize,
}

/// One f32 tensor of `shape` (written in the spec's type where it is a matrix).
pub fn tensor(name: String, shape: Vec<usize>, values: &[f32]) -> GgufTensor {
    assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
    GgufTensor {
        name,
        shape,
        values: values.to_vec(),
        permute_heads: 0,
    }
}

/// llama.cpp's tensors of `w`; `permute`: Q/K rows permuted as the converter does for `llama`.
pub fn gguf_tensors(w: &ModelWeights, permute: bool) -> Vec<GgufTensor> {
    let c = &w.config;
    let (h, f, q, kv) = (c.hidden, c.ffn, c.q_dim(), c.kv_dim());
    let mut t = vec![
        tensor("token_embd.weight".into(), vec![c.vocab, h], &w.wte),
        tensor("output_norm.weight".into(), vec![h], &w.final_norm),
    ];
    if let Some(b) = &w.final_norm_bias {
        t.push(tensor("output_norm.bias".into(), vec![h], b));
    }
    if let Some(wpe) = &w.wpe {
        t.push(tensor(
            "position_embd.weight".into(),
            vec![c.max_seq, h],
            wpe,
        ));
    }
    if let Some(head) = &w.lm_head {
        t.push(tensor("output.weight".into(), vec![c.vocab, h], head));
    }
    for (i, l) in w.layers.iter().enumerate() {
        let n = |s: &str| format!("blk.{i}.{s}");
        t.push(tensor(n("attn_norm.weight"), vec![h], &l.attn_norm));
        t.push(tensor(n("ffn_norm.weight"), vec![h], &l.mlp_norm));
        t.push(tensor(n("attn_output.weight"), vec![h, q], &l.wo));
        t.push(tensor(n("ffn_up.weight"), vec![f, h], &l.w_up));
        t.push(tensor(n("ffn_down.weight"), vec![h, f], &l.w_down));
        let biases = [
            ("attn_norm.bias", &l.attn_norm_bias, h),
            ("ffn_norm.bias", &l.mlp_norm_bias, h),
            ("attn_output.bias", &l.bo, h),
            ("ffn_up.bias", &l.b_up, f),
            ("ffn_down.bias", &l.b_down, h),
        ];
        for (name, b, len) in biases {
            if let Some(b) = b {
                t.push(tensor(n(name), vec![len], b));
            }
        }
        if c.arch == Arch::Gpt2 {
            let qkv: Vec<f32> = [&l.wq, &l.wk, &l.wv]
                .into_iter()
                .flatten()
                .copied()
                .collect();
            t.push(tensor(n("attn_qkv.weight"), vec![3 * h, h], &qkv));
            let bias: Vec<f32> = [&l.bq, &l.bk, &l.bv]
                .into_iter()
                .flat_map(|b| b.clone().unwrap())
                .collect();
            t.push(tensor(n("attn_qkv.bias"), vec![3 * h], &bias));
            continue;
        }
        t.push(tensor(
            n("ffn_gate.weight"),
            vec![f, h],
            l.w_gate.as_ref().unwrap(),
        ));
        let mut wq = tensor(n("attn_q.weight"), vec![q, h], &l.wq);
        let mut wk = tensor(n("attn_k.weight"), vec![kv, h], &l.wk);
        if permute {
            (wq.permute_heads, wk.permute_heads) = (c.heads, c.kv_heads);
        }
        t.extend([wq, wk, tensor(n("attn_v.weight"), vec![kv, h], &l.wv)]);
        for (name, scale) in [
            ("attn_q_norm.weight", &l.q_norm),
            ("attn_k_norm.weight", &l.k_norm),
        ] {
            if let Some(s) = scale {
                t.push(tensor(n(name), vec![c.head_dim], s));
            }
        }
        for (name, b, len) in [
            ("attn_q.bias", &l.bq, q),
            ("attn_k.bias", &l.bk, kv),
            ("attn_v.bias", &l.bv, kv),
        ] {
            if let Some(b) = b {
                t.push(tensor(n(name), vec![len], b));
            }
        }
    }
    t
}

/// Metadata llama.cpp's converter writes for `w` under architecture `arch`.
pub fn model_meta(w: &ModelWeights, arch: &str) -> Vec<Value> {
    let c = &w.config;
    let k = |key: &str| format!("{arch}.{key}");
    let mut m = vec![
        json!(["general.name", "str", "gguf-test"]),
        json!([k("context_length"), "u32", c.max_seq]),
        json!([k("embedding_length"), "u32", c.hidden]),
        json!([k("block_count"), "u32", c.layers]),
        json!([k("feed_forward_length"), "u32", c.ffn]),
        json!([k("attention.head_count"), "u32", c.heads]),
        json!(["tokenizer.ggml.eos_token_id", "u32", 0]),
    ];
    if c.arch == Arch::Gpt2 {
        m.push(json!([
            k("attention.layer_norm_epsilon"),
            "f32",
            c.norm_eps
        ]));
    } else {
        m.push(json!([k("attention.head_count_kv"), "u32", c.kv_heads]));
        m.push(json!([
            k("attention.layer_norm_rms_epsilon"),
            "f32",
            c.norm_eps
        ]));
        m.push(json!([k("rope.freq_base"), "f32", c.rope_theta]));
        // The converter writes the head sizes where they are not hidden / heads (Qwen3).
        if c.head_dim * c.heads != c.hidden {
            m.push(json!([k("attention.key_length"), "u32", c.head_dim]));
            m.push(json!([k("attention.value_length"), "u32", c.head_dim]));
        }
    }
    m
}

/// llama.cpp's gemma3 tensors of `w` (a Gemma 3 model): the norm scales as the multipliers
/// (the converter adds Gemma's 1), the block output norms under their own names.
pub fn gemma3_tensors(w: &ModelWeights) -> Vec<GgufTensor> {
    let mut t = gguf_tensors(w, false);
    let h = w.config.hidden;
    for (i, l) in w.layers.iter().enumerate() {
        for (name, v) in [
            ("post_attention_norm", &l.attn_out_norm),
            ("post_ffw_norm", &l.mlp_out_norm),
        ] {
            t.push(tensor(
                format!("blk.{i}.{name}.weight"),
                vec![h],
                v.as_ref().unwrap(),
            ));
        }
    }
    t
}

/// gemma3 metadata of `w` (every third layer global, as the tests' models have it): the
/// window, the pattern, the sliding layers' base and the final soft-cap where set.
pub fn gemma3_meta(w: &ModelWeights) -> Vec<Value> {
    let c = &w.config;
    let s = c.sliding.as_ref().unwrap();
    let mut meta = model_meta(w, "gemma3");
    meta.extend([
        json!(["gemma3.attention.sliding_window", "u32", s.window]),
        json!(["gemma3.attention.sliding_window_pattern", "u32", 3]),
        json!(["gemma3.rope.freq_base_swa", "f32", s.rope_theta]),
    ]);
    if let Some(cap) = c.final_softcap {
        meta.push(json!(["gemma3.final_logit_softcapping", "f32", cap]));
    }
    meta
}

/// What to write: the matrices' type (1-D tensors stay F32, as llama.cpp keeps them).
pub struct GgufSpec<'a> {
    pub arch: &'a str,
    pub matrices: QuantType,
    pub meta: Vec<Value>,
}

/// A tensor's ggml type name, and its bytes exactly as the file is to store them (rows in the
/// file's order), or `None` for the package's quantizer on the values.
pub type Stored = Option<(&'static str, Option<Vec<u8>>)>;

/// Writes `tensors` and `spec`'s metadata to `dir/name.gguf` and returns the file's path. Each
/// packed tensor's llama.cpp dequantization is at `dir/NAME.bin.deq`.
pub fn write_gguf(dir: &Path, name: &str, tensors: &[GgufTensor], spec: &GgufSpec) -> PathBuf {
    write_gguf_with(dir, name, tensors, spec, &|_| None)
}

/// [`write_gguf`], with the tensors `stored` gives bytes for written as those bytes.
pub fn write_gguf_with(
    dir: &Path,
    name: &str,
    tensors: &[GgufTensor],
    spec: &GgufSpec,
    stored: &dyn Fn(&GgufTensor) -> Stored,
) -> PathBuf {
    let path = dir.join(format!("{name}.gguf"));
    let mut entries = Vec::new();
    for t in tensors {
        let file = dir.join(format!("{}.bin", t.name));
        if let Some((qtype, bytes)) = stored(t) {
            let packed = bytes.is_some();
            let bytes =
                bytes.unwrap_or_else(|| t.values.iter().flat_map(|x| x.to_le_bytes()).collect());
            std::fs::write(&file, bytes).unwrap();
            entries.push(json!({
                "name": t.name, "shape": t.shape, "file": file, "packed": packed,
                "type": qtype, "permute_heads": if packed { 0 } else { t.permute_heads },
            }));
            continue;
        }
        let matrix = t.shape.len() == 2;
        let qtype = if matrix {
            spec.matrices
        } else {
            QuantType::F32
        };
        // wgpar packs the K-quants (the package has no quantizer for them), after permuting.
        let packed = matches!(qtype, QuantType::Q4K | QuantType::Q6K);
        let bytes: Vec<u8> = if packed {
            let v = if t.permute_heads > 0 {
                permute_rows(&t.values, t.permute_heads, t.shape[1])
            } else {
                t.values.clone()
            };
            quantize(qtype, &v)
        } else {
            t.values.iter().flat_map(|x| x.to_le_bytes()).collect()
        };
        std::fs::write(&file, bytes).unwrap();
        entries.push(json!({
            "name": t.name, "shape": t.shape, "file": file, "packed": packed,
            "type": ggml_type_name(qtype),
            "permute_heads": if packed { 0 } else { t.permute_heads },
        }));
    }
    let manifest = json!({"path": path, "arch": spec.arch, "meta": spec.meta, "tensors": entries});
    let manifest_path = dir.join(format!("{name}.json"));
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_support/write_gguf.py");
    let out = std::process::Command::new(crate::common::python())
        .arg(script)
        .arg(&manifest_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "write_gguf.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// The converter's permutation (the test's own, for the tensors wgpar packs).
pub fn permute_rows(m: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let head_dim = m.len() / cols / heads;
    let half = head_dim / 2;
    let mut out = vec![0.0; m.len()];
    for h in 0..heads {
        for s in 0..2 {
            for i in 0..half {
                let from = (h * head_dim + s * half + i) * cols;
                let to = (h * head_dim + 2 * i + s) * cols;
                out[to..to + cols].copy_from_slice(&m[from..from + cols]);
            }
        }
    }
    out
}

/// ggml's name of `t`.
pub fn ggml_type_name(t: QuantType) -> &'static str {
    match t {
        QuantType::F32 => "F32",
        QuantType::F16 => "F16",
        QuantType::Bf16 => "BF16",
        QuantType::Q8_0 => "Q8_0",
        QuantType::Q4_0 => "Q4_0",
        QuantType::Q4_1 => "Q4_1",
        QuantType::Q5_0 => "Q5_0",
        QuantType::Q5_1 => "Q5_1",
        QuantType::Q2K => "Q2_K",
        QuantType::Q3K => "Q3_K",
        QuantType::Q4K => "Q4_K",
        QuantType::Q5K => "Q5_K",
        QuantType::Q6K => "Q6_K",
        QuantType::Iq4Nl => "IQ4_NL",
        QuantType::Iq4Xs => "IQ4_XS",
    }
}

/// The block types whose values the tests draw as random blocks, each with the byte offsets of
/// its f16 scale fields and their range: values then stay O(0.05), like a small model's.
fn scale_fields(t: QuantType) -> &'static [(usize, f32, f32)] {
    match t {
        QuantType::Q8_0 => &[(0, 2e-4, 6e-4)],
        QuantType::Q4_0 => &[(0, 3e-3, 8e-3)],
        QuantType::Q4_1 => &[(0, 3e-3, 6e-3), (2, -0.05, -0.02)],
        QuantType::Q5_0 => &[(0, 1.5e-3, 4e-3)],
        QuantType::Q5_1 => &[(0, 1.5e-3, 3e-3), (2, -0.05, -0.02)],
        QuantType::Q2K => &[(80, 1e-3, 2e-3), (82, 5e-4, 1e-3)],
        QuantType::Q3K => &[(108, 2e-4, 4e-4)],
        QuantType::Q4K => &[(0, 1e-4, 3e-4), (2, 1e-4, 3e-4)],
        QuantType::Q5K => &[(0, 5e-5, 1.5e-4), (2, 1e-4, 3e-4)],
        QuantType::Q6K => &[(208, 2e-5, 6e-5)],
        QuantType::Iq4Nl => &[(0, 2e-4, 6e-4)],
        QuantType::Iq4Xs => &[(0, 1e-5, 2e-5)],
        _ => panic!("{t:?} is not a block type"),
    }
}

/// `blocks` random, valid blocks of `t` (random bytes, finite f16 scales), which no quantizer
/// of wgpar's wrote.
pub fn random_blocks(t: QuantType, blocks: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let bb = t.block_bytes();
    let mut out: Vec<u8> = (0..blocks * bb).map(|_| rng.random::<u8>()).collect();
    for block in out.chunks_exact_mut(bb) {
        for &(at, lo, hi) in scale_fields(t) {
            let d = half::f16::from_f32(rng.random_range(lo..hi));
            block[at..at + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    out
}

/// llama.cpp's dequantization (the `gguf` package's numpy code) of whole blocks of `t`.
pub fn llama_dequantize(t: QuantType, bytes: &[u8]) -> Vec<f32> {
    let dir = std::env::temp_dir().join(format!("wgpar-deq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (input, output) = (dir.join("blocks.bin"), dir.join("values.bin"));
    std::fs::write(&input, bytes).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_support/dequantize.py");
    let out = std::process::Command::new(crate::common::python())
        .arg(script)
        .arg(ggml_type_name(t))
        .args([&input, &output])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "dequantize.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let values = std::fs::read(&output).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    values
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// llama.cpp's dequantization of tensor `name`, written beside it by the script.
pub fn reference_dequant(dir: &Path, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir.join(format!("{name}.bin.deq"))).unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// GPT-2's byte-level vocabulary without merges: the 256 byte characters, then the end token.
pub fn byte_tokens() -> Vec<String> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap().to_string()
        })
        .chain(["<|endoftext|>".to_string()])
        .collect()
}

/// A tiny Llama of random weights (seed 77) with a byte-level vocabulary (256 bytes and an
/// end token, which is also BOS) and chat `template`, as a GGUF file in `dir`: a model that
/// can write any text, and whose unmasked greedy text is noise (tests of structured output);
/// its context `max_seq` tokens (bytes).
pub fn byte_llama(dir: &Path, template: &str, max_seq: usize) -> PathBuf {
    let config = ModelConfig {
        vocab: 257,
        max_seq,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let w = ModelWeights::synthetic(&config, 77);
    let types = [vec![1; 256], vec![3]].concat();
    let mut meta = model_meta(&w, "llama");
    meta.extend([
        json!(["tokenizer.ggml.model", "str", "gpt2"]),
        json!(["tokenizer.ggml.tokens", "str_array", byte_tokens()]),
        json!(["tokenizer.ggml.merges", "str_array", Vec::<String>::new()]),
        json!(["tokenizer.ggml.add_bos_token", "bool", false]),
        json!(["tokenizer.ggml.bos_token_id", "u32", 256]),
        json!(["tokenizer.ggml.eos_token_id", "u32", 256]),
        json!(["tokenizer.ggml.token_type", "i32_array", types]),
        json!(["tokenizer.chat_template", "str", template]),
    ]);
    let spec = GgufSpec {
        arch: "llama",
        matrices: QuantType::F32,
        meta,
    };
    write_gguf(dir, "bytes", &gguf_tensors(&w, true), &spec)
}
