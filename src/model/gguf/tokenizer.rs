//! The tokenizer a GGUF file carries in its metadata (`tokenizer.ggml.*`), rebuilt as the
//! `tokenizers` crate's types in the form Hugging Face's own `tokenizer.json` takes for the same
//! vocabulary, so that both give the same ids:
//!
//! - `gpt2` (byte-level BPE, GPT-2, Qwen2, Llama 3): vocabulary and merges as stored, byte-level
//!   pre-tokenizer (with the pre-tokenizing regex `tokenizer.ggml.pre` names) and decoder.
//! - `llama` (SentencePiece BPE, Llama 1/2, Mistral): merges recovered from the pieces' scores
//!   as Hugging Face's converter recovers them, byte fallback, `▁` for spaces and a leading `▁`.
//!
//! Control and user-defined tokens become added (special) tokens; `add_bos_token` adds BOS.

use serde_json::{json, Value as Json};

use super::config::Meta;
use super::file::Value;
use crate::error::Result;

/// Tokens by id, and their types (ggml: 1 normal, 2 unknown, 3 control, 4 user-defined,
/// 5 unused, 6 byte).
struct Vocab {
    tokens: Vec<String>,
    types: Vec<i64>,
}

fn vocab(meta: &Meta) -> Result<Vocab> {
    let key = "tokenizer.ggml.tokens";
    let items = meta
        .opt_array(key)?
        .ok_or_else(|| meta.fail(format!("key '{key}' is missing: the file has no tokenizer")))?;
    let tokens = items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::Str(s) => Ok(s.clone()),
            _ => Err(meta.fail(format!("key '{key}': token {i} is not a string"))),
        })
        .collect::<Result<Vec<_>>>()?;
    let types = match meta.opt_array("tokenizer.ggml.token_type")? {
        None => vec![1; tokens.len()],
        Some(t) if t.len() == tokens.len() => t
            .iter()
            .map(|v| match v {
                Value::I64(n) => *n,
                Value::U64(n) => *n as i64,
                _ => 1,
            })
            .collect(),
        Some(t) => {
            return Err(meta.fail(format!(
                "key 'tokenizer.ggml.token_type' has {} entries for {} tokens",
                t.len(),
                tokens.len()
            )))
        }
    };
    Ok(Vocab { tokens, types })
}

/// The id `key` names, checked against the vocabulary.
fn token_id(meta: &Meta, key: &str, vocab: usize) -> Result<Option<usize>> {
    match meta.opt_usize(key)? {
        Some(id) if id >= vocab => Err(meta.fail(format!(
            "key '{key}' is {id}, outside the vocabulary of {vocab}"
        ))),
        other => Ok(other),
    }
}

fn added_tokens(v: &Vocab) -> Vec<Json> {
    v.tokens
        .iter()
        .zip(&v.types)
        .enumerate()
        .filter(|(_, (_, &t))| t == 3 || t == 4)
        .map(|(id, (content, &t))| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": t == 4, "special": t == 3})
        })
        .collect()
}

/// A post-processor that puts BOS first when the file asks for it.
fn bos_template(bos: Option<(usize, &str)>) -> Json {
    let Some((id, token)) = bos else {
        return Json::Null;
    };
    let special = json!({"SpecialToken": {"id": token, "type_id": 0}});
    let seq = |s: &str, t: u32| json!({"Sequence": {"id": s, "type_id": t}});
    json!({"type": "TemplateProcessing",
           "single": [special, seq("A", 0)],
           "pair": [special, seq("A", 0), special, seq("B", 1)],
           "special_tokens": {token: {"id": token, "ids": [id], "tokens": [token]}}})
}

/// The regex a byte-level vocabulary splits text with before BPE (`tokenizer.ggml.pre`).
fn pre_regex(meta: &Meta) -> Result<Option<&'static str>> {
    let pre = match meta.get("tokenizer.ggml.pre") {
        Some(Value::Str(s)) => s.as_str(),
        _ => "default",
    };
    // GPT-2's own split is the byte-level pre-tokenizer's built-in regex (None).
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => None,
        "qwen2" => Some(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        "llama-bpe" | "llama3" => Some(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        other => {
            return Err(meta.fail(format!(
                "key 'tokenizer.ggml.pre' is '{other}': wgpar knows the pre-tokenizers of gpt2, \
                 qwen2 and llama-bpe"
            )))
        }
    })
}

fn byte_level(meta: &Meta, v: &Vocab) -> Result<Json> {
    let merges: Vec<Json> = match meta.opt_array("tokenizer.ggml.merges")? {
        None => Vec::new(),
        Some(items) => items
            .iter()
            .enumerate()
            .map(|(i, m)| match m {
                Value::Str(s) => s
                    .split_once(' ')
                    .map(|(a, b)| json!([a, b]))
                    .ok_or_else(|| {
                        meta.fail(format!(
                            "key 'tokenizer.ggml.merges': merge {i} has no space"
                        ))
                    }),
                _ => Err(meta.fail(format!(
                    "key 'tokenizer.ggml.merges': merge {i} is not a string"
                ))),
            })
            .collect::<Result<_>>()?,
    };
    let byte_level = |regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
               "use_regex": regex})
    };
    let pre = match pre_regex(meta)? {
        None => byte_level(true),
        Some(re) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            byte_level(false)]}),
    };
    let add_bos = meta.bool_or("tokenizer.ggml.add_bos_token", false)?;
    let bos = bos_of(meta, v, add_bos)?;
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(v),
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": if bos.is_null() { byte_level(true) } else { bos },
        "decoder": byte_level(true),
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab_map(v), "merges": merges}
    }))
}

fn bos_of(meta: &Meta, v: &Vocab, add_bos: bool) -> Result<Json> {
    let id = token_id(meta, "tokenizer.ggml.bos_token_id", v.tokens.len())?;
    Ok(match id {
        Some(id) if add_bos => bos_template(Some((id, &v.tokens[id]))),
        _ => Json::Null,
    })
}

fn vocab_map(v: &Vocab) -> Json {
    let map: serde_json::Map<String, Json> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), json!(id)))
        .collect();
    Json::Object(map)
}

/// SentencePiece merges from the pieces' scores: every split of a piece into two pieces of the
/// vocabulary is a merge, ranked by the piece's score (highest first), ties by the ids of the
/// two halves.
fn spm_merges(meta: &Meta, v: &Vocab) -> Result<Vec<Json>> {
    let scores: Vec<f64> = match meta.opt_array("tokenizer.ggml.scores")? {
        Some(s) if s.len() == v.tokens.len() => {
            s.iter().map(|x| x.as_f64().unwrap_or(0.0)).collect()
        }
        Some(s) => {
            return Err(meta.fail(format!(
                "key 'tokenizer.ggml.scores' has {} entries for {} tokens",
                s.len(),
                v.tokens.len()
            )))
        }
        None => (0..v.tokens.len()).map(|i| -(i as f64)).collect(),
    };
    let ids: std::collections::HashMap<&str, usize> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<(f64, usize, usize)> = Vec::new();
    for (id, piece) in v.tokens.iter().enumerate() {
        // Control, unknown and byte tokens are never the result of a merge.
        if v.types[id] != 1 && v.types[id] != 4 {
            continue;
        }
        let mut local: Vec<(f64, usize, usize)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((scores[id], *ids.get(l)?, *ids.get(r)?))
            })
            .collect();
        local.sort_by_key(|&(_, l, r)| (l, r));
        merges.extend(local);
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0));
    Ok(merges
        .into_iter()
        .map(|(_, l, r)| json!([v.tokens[l], v.tokens[r]]))
        .collect())
}

fn sentencepiece(meta: &Meta, v: &Vocab) -> Result<Json> {
    let unk = token_id(meta, "tokenizer.ggml.unknown_token_id", v.tokens.len())?;
    let add_bos = meta.bool_or("tokenizer.ggml.add_bos_token", true)?;
    let bos = bos_of(meta, v, add_bos)?;
    let mut added = added_tokens(v);
    // SentencePiece's unknown token is special too.
    if let Some(u) = unk.filter(|&u| v.types[u] == 2) {
        added.push(
            json!({"id": u, "content": v.tokens[u], "single_word": false,
                          "lstrip": false, "rstrip": false, "normalized": false,
                          "special": true}),
        );
        added.sort_by_key(|t| t["id"].as_u64());
    }
    let replace = |from: &str, to: &str| json!({"type": "Replace", "pattern": {"String": from}, "content": to});
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"}, replace(" ", "\u{2581}")]},
        "pre_tokenizer": null,
        "post_processor": bos,
        "decoder": {"type": "Sequence", "decoders": [
            replace("\u{2581}", " "), {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null,
                  "unk_token": unk.map(|u| v.tokens[u].clone()),
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab_map(v), "merges": spm_merges(meta, v)?}
    }))
}

/// The `tokenizer.json` text equivalent to the file's tokenizer metadata.
pub fn tokenizer_json(meta: &Meta) -> Result<String> {
    let v = vocab(meta)?;
    let kind = meta.string("tokenizer.ggml.model")?;
    let json = match kind {
        "gpt2" => byte_level(meta, &v)?,
        "llama" => sentencepiece(meta, &v)?,
        other => {
            return Err(meta.fail(format!(
                "key 'tokenizer.ggml.model' is '{other}': wgpar reads gpt2 (byte-level BPE) and \
                 llama (SentencePiece) vocabularies"
            )))
        }
    };
    Ok(json.to_string())
}
