//! The tokenizer a GGUF file carries gives the same ids as the model's tokenizer.json. The test
//! learns a small BPE vocabulary from a sample text, writes it both ways (a Hugging Face
//! tokenizer.json, and GGUF metadata as llama.cpp's converter stores it: merges for byte-level
//! BPE, scores for SentencePiece), and encodes texts with both.

mod common;
mod gguf_support;
mod hf_support;

use std::collections::HashMap;

use gguf_support::{gguf_tensors, model_meta, write_gguf, GgufSpec};
use hf_support::scratch;
use serde_json::{json, Value};
use wgpar::model::hf::{Checkpoint, TextTokenizer};
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelConfig, ModelWeights};

const SAMPLE: &str = "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox \
    runs away quickly, and then the quick fox returns to the lazy brown dog. Numbers like 12345 \
    and 2026 appear, as do words such as tokenizer, tokenization and tokens. It's the fox's \
    day, isn't it? They're here and we'll see.";

const TEXTS: [&str; 6] = [
    "The quick brown fox",
    "the lazy dog's tokens, 2026 and 987654",
    "  two leading spaces and trailing ones  ",
    "Unseen: zebra, ÿ, naïve café, 日本語 and emoji 🦀",
    "line one\nline two\n\n\tindented",
    "It's here; they're quick.",
];

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the others map to
/// code points from 256 up, in byte order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// `merges` rounds of BPE over `words` (symbol sequences): each round merges the most frequent
/// adjacent pair (ties by the pair's text). Returns the merges in order.
fn learn_merges(mut words: Vec<Vec<String>>, merges: usize) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for _ in 0..merges {
        let mut counts: HashMap<(String, String), usize> = HashMap::new();
        for w in &words {
            for p in w.windows(2) {
                *counts.entry((p[0].clone(), p[1].clone())).or_default() += 1;
            }
        }
        let Some(best) = counts
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
            .map(|(p, _)| p)
        else {
            break;
        };
        for w in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == best.0 && w[i + 1] == best.1 {
                    w[i] = format!("{}{}", w[i], w[i + 1]);
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
        out.push(best);
    }
    out
}

/// A tiny model whose GGUF carries `meta` besides the model keys; returns its checkpoint.
fn gguf_with(dir: &std::path::Path, vocab: usize, meta: Vec<Value>) -> Checkpoint {
    let config = ModelConfig {
        vocab,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let w = ModelWeights::synthetic(&config, 40);
    let mut all = model_meta(&w, "llama");
    all.extend(meta);
    let spec = GgufSpec {
        arch: "llama",
        matrices: QuantType::F32,
        meta: all,
    };
    let file = write_gguf(dir, "tok", &gguf_tensors(&w, true), &spec);
    Checkpoint::open(&file).unwrap()
}

fn assert_same_ids(reference: &TextTokenizer, mine: &TextTokenizer) {
    let mut compared = 0;
    for text in TEXTS {
        let want = reference.encode(text).unwrap();
        assert!(!want.is_empty());
        assert_eq!(mine.encode(text).unwrap(), want, "ids of {text:?}");
        assert_eq!(
            mine.decode(&want).unwrap(),
            reference.decode(&want).unwrap()
        );
        assert_streams_as_decoded(mine, &want);
        compared += want.len();
    }
    assert!(compared > 50, "compared {compared} ids");
}

/// Streaming `ids` after each possible prompt gives, token by token, the text decoding the
/// whole sequence gives after the prompt's text (its whole characters).
fn assert_streams_as_decoded(tokenizer: &TextTokenizer, ids: &[u32]) {
    for cut in 0..ids.len() {
        let (prompt, rest) = ids.split_at(cut);
        let mut stream = tokenizer.stream_after(prompt);
        let mut text = String::new();
        for &id in rest {
            text += &tokenizer.step(&mut stream, id).unwrap();
        }
        text += &tokenizer.finish(&stream).unwrap();
        // A prompt that ends inside a character: the character comes with the stream.
        let whole = tokenizer.decode(ids).unwrap();
        let before = (0..=prompt.len())
            .rev()
            .map(|k| tokenizer.decode(&prompt[..k]).unwrap())
            .find(|t| !t.ends_with('\u{FFFD}'))
            .unwrap();
        assert_eq!(
            Some(text.as_str()),
            whole.strip_prefix(before.as_str()),
            "{ids:?} after {cut}"
        );
    }
}

/// A byte-level vocabulary learned from the sample: its tokens (the 256 byte characters, the
/// merged pieces, then `<|endoftext|>`), its merges, and GPT-2's `tokenizer.json` for it.
struct ByteLevelVocab {
    tokens: Vec<String>,
    merges: Vec<(String, String)>,
    reference: Value,
}

fn byte_level_vocab() -> ByteLevelVocab {
    let chars = byte_chars();
    let to_symbols =
        |w: &str| -> Vec<String> { w.bytes().map(|b| chars[b as usize].to_string()).collect() };
    let words: Vec<Vec<String>> = SAMPLE
        .split_inclusive(' ')
        .map(|w| to_symbols(&format!(" {}", w.trim_end())))
        .collect();
    let merges = learn_merges(words, 120);
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    for (a, b) in &merges {
        let t = format!("{a}{b}");
        if !tokens.contains(&t) {
            tokens.push(t);
        }
    }
    tokens.push("<|endoftext|>".into());
    let eot = tokens.len() - 1;
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    let reference = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": false,
                          "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
                  "byte_fallback": false, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    });
    ByteLevelVocab {
        tokens,
        merges,
        reference,
    }
}

/// The GGUF metadata of `v` with pre-tokenizer `pre`.
fn byte_level_meta(v: &ByteLevelVocab, pre: &str) -> Vec<Value> {
    let eot = v.tokens.len() - 1;
    let mut types = vec![1; v.tokens.len()];
    types[eot] = 3;
    let merges: Vec<String> = v.merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    vec![
        json!(["tokenizer.ggml.model", "str", "gpt2"]),
        json!(["tokenizer.ggml.pre", "str", pre]),
        json!(["tokenizer.ggml.tokens", "str_array", v.tokens]),
        json!(["tokenizer.ggml.token_type", "i32_array", types]),
        json!(["tokenizer.ggml.merges", "str_array", merges]),
        json!(["tokenizer.ggml.bos_token_id", "u32", eot]),
        json!(["tokenizer.ggml.add_bos_token", "bool", false]),
    ]
}

#[test]
fn byte_level_bpe_gives_the_tokenizer_json_ids() {
    let v = byte_level_vocab();
    let dir = scratch("gguf-tok-bpe");
    let ref_path = dir.join("tokenizer.json");
    std::fs::write(&ref_path, v.reference.to_string()).unwrap();
    let reference = TextTokenizer::from_file(&ref_path, None).unwrap();
    let ckpt = gguf_with(&dir, v.tokens.len(), byte_level_meta(&v, "gpt-2"));
    assert_same_ids(&reference, &ckpt.tokenizer().unwrap());
}

/// `--tokenizer FILE` runs a GGUF whose pre-tokenizer wgpar refuses (the refusal names the
/// value and the option), and is refused where no text is tokenized.
#[test]
fn tokenizer_option_runs_a_gguf_whose_pre_tokenizer_is_refused() {
    let v = byte_level_vocab();
    let dir = scratch("gguf-tok-option");
    let json = dir.join("tokenizer.json");
    std::fs::write(&json, v.reference.to_string()).unwrap();
    let ckpt = gguf_with(&dir, v.tokens.len(), byte_level_meta(&v, "no-such-pre"));
    let file = dir.join("tok.gguf");
    let (file, json) = (file.to_str().unwrap(), json.to_str().unwrap());
    let err = ckpt.tokenizer().unwrap_err().to_string();
    assert!(
        err.contains("'no-such-pre'") && err.contains("--tokenizer"),
        "{err}"
    );
    // The library's override gives the tokenizer.json's ids.
    let given = ckpt
        .tokenizer_from(Some(std::path::Path::new(json)))
        .unwrap();
    assert_same_ids(
        &TextTokenizer::from_file(std::path::Path::new(json), None).unwrap(),
        &given,
    );
    let prompt = [
        "run",
        "--model",
        file,
        "--prompt",
        "The quick fox",
        "--gen",
        "3",
    ];
    let (ok, _, err) = common::wgpar(&prompt);
    assert!(
        !ok && err.contains("'no-such-pre'") && err.contains("--tokenizer"),
        "{err}"
    );
    let (ok, out, err) = common::wgpar(&[&prompt[..], &["--tokenizer", json]].concat());
    assert!(ok && out.starts_with("The quick fox"), "{out}{err}");
    let (ok, _, err) = common::wgpar(&["run", "--tokenizer", json, "--prompt-len", "4"]);
    assert!(
        !ok && err.contains("--tokenizer") && err.contains("--prompt"),
        "{err}"
    );
    let (ok, _, err) = common::wgpar(&["serve", "--model", "tiny-llama", "--tokenizer", json]);
    assert!(
        !ok && err.contains("--tokenizer applies to a checkpoint"),
        "{err}"
    );
}

#[test]
fn sentencepiece_vocabulary_gives_the_tokenizer_json_ids() {
    const SPACE: char = '\u{2581}';
    let normalized = format!("{SPACE}{}", SAMPLE.replace(' ', &SPACE.to_string()));
    let words: Vec<Vec<String>> = normalized
        .split_inclusive(SPACE)
        .map(|w| w.chars().map(String::from).collect())
        .collect();
    let merges = learn_merges(words, 120);
    // SentencePiece's layout: unknown, BOS, EOS, the 256 byte pieces, characters, then pieces.
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let mut chars: Vec<char> = normalized.chars().collect();
    chars.sort();
    chars.dedup();
    for c in chars {
        tokens.push(c.to_string());
        types.push(1);
        scores.push(-1e6);
    }
    for (rank, (a, b)) in merges.iter().enumerate() {
        let t = format!("{a}{b}");
        if !tokens.contains(&t) {
            tokens.push(t);
            types.push(1);
            scores.push(-(rank as f32));
        }
    }
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let special = |id: usize, s: &str| {
        json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let replace = |from: &str, to: &str| json!({"type": "Replace", "pattern": {"String": from}, "content": to});
    let bos = json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
    let reference = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"}, replace(" ", "\u{2581}")]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos,
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [replace("\u{2581}", " "),
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>()}
    });
    let dir = scratch("gguf-tok-spm");
    let ref_path = dir.join("tokenizer.json");
    std::fs::write(&ref_path, reference.to_string()).unwrap();
    let reference = TextTokenizer::from_file(&ref_path, None).unwrap();
    let ckpt = gguf_with(
        &dir,
        tokens.len(),
        vec![
            json!(["tokenizer.ggml.model", "str", "llama"]),
            json!(["tokenizer.ggml.tokens", "str_array", tokens]),
            json!(["tokenizer.ggml.token_type", "i32_array", types]),
            json!(["tokenizer.ggml.scores", "f32_array", scores]),
            json!(["tokenizer.ggml.bos_token_id", "u32", 1]),
            json!(["tokenizer.ggml.unknown_token_id", "u32", 0]),
            json!(["tokenizer.ggml.add_bos_token", "bool", true]),
        ],
    );
    assert_same_ids(&reference, &ckpt.tokenizer().unwrap());
}
