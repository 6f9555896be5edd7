//! The tokenizer a GGUF file carries in its metadata (`tokenizer.ggml.*`), rebuilt as the
//! `tokenizers` crate's types in the form Hugging Face's own `tokenizer.json` takes for the same
//! vocabulary, so that both give the same ids:
//!
//! - `gpt2` (byte-level BPE: GPT-2, Qwen2, Llama 3, SmolLM, ...): vocabulary and merges as
//!   stored, the pre-tokenizer, normalizer and merge rule `tokenizer.ggml.pre` names (the table
//!   [`PRE_RULES`]), byte-level decoder.
//! - `llama` (SentencePiece BPE, Llama 1/2, Mistral): merges recovered from the pieces' scores
//!   as Hugging Face's converter recovers them, byte fallback, `▁` for spaces and a leading `▁`
//!   (unless `add_space_prefix` is false).
//!
//! Control and user-defined tokens become added (special) tokens; `add_bos_token` and
//! `add_eos_token` add BOS and EOS (defaults: llama.cpp's for the vocabulary and pre-tokenizer);
//! `add_space_prefix` puts a space before the text.

mod pre;

use std::path::Path;

use serde_json::{json, Value as Json};

pub use pre::{PreRules, Step, NOT_REBUILT, PRE_RULES};

use super::config::Meta;
use super::file::{GgufFile, Value};
use crate::error::{Result, WgparError};
use crate::model::hf::TextTokenizer;

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

/// The special tokens the file asks to add around a text: `add_bos_token` (default: the
/// pre-tokenizer's, or SentencePiece's) and `add_eos_token`, each with its id.
struct Specials<'v> {
    bos: Option<(usize, &'v str)>,
    eos: Option<(usize, &'v str)>,
}

fn specials<'v>(meta: &Meta, v: &'v Vocab, bos_default: bool) -> Result<Specials<'v>> {
    let one = |flag: &str, id_key: &str, default: bool| -> Result<Option<(usize, &'v str)>> {
        if !meta.bool_or(flag, default)? {
            return Ok(None);
        }
        match token_id(meta, id_key, v.tokens.len())? {
            Some(id) => Ok(Some((id, v.tokens[id].as_str()))),
            None => Err(meta.fail(format!("key '{flag}' is true, but '{id_key}' is missing"))),
        }
    };
    Ok(Specials {
        bos: one(
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.bos_token_id",
            bos_default,
        )?,
        eos: one(
            "tokenizer.ggml.add_eos_token",
            "tokenizer.ggml.eos_token_id",
            false,
        )?,
    })
}

impl Specials<'_> {
    /// A `TemplateProcessing` post-processor that adds the tokens; `None` without any.
    fn template(&self) -> Option<Json> {
        if self.bos.is_none() && self.eos.is_none() {
            return None;
        }
        let special = |t: &Option<(usize, &str)>| {
            t.map(|(_, s)| json!({"SpecialToken": {"id": s, "type_id": 0}}))
        };
        let (bos, eos) = (special(&self.bos), special(&self.eos));
        let seq = |s: &str, t: u32| Some(json!({"Sequence": {"id": s, "type_id": t}}));
        let single: Vec<Json> = [bos.clone(), seq("A", 0), eos.clone()]
            .into_iter()
            .flatten()
            .collect();
        let pair: Vec<Json> = [bos.clone(), seq("A", 0), eos.clone(), bos, seq("B", 1), eos]
            .into_iter()
            .flatten()
            .collect();
        let tokens: serde_json::Map<String, Json> = [self.bos, self.eos]
            .into_iter()
            .flatten()
            .map(|(id, s)| (s.to_string(), json!({"id": s, "ids": [id], "tokens": [s]})))
            .collect();
        Some(
            json!({"type": "TemplateProcessing", "single": single, "pair": pair,
                    "special_tokens": tokens}),
        )
    }
}

/// The rules `tokenizer.ggml.pre` names (`default` where the key is absent, as in llama.cpp).
fn pre_rules(meta: &Meta, file: &Path) -> Result<&'static PreRules> {
    let pre = match meta.get("tokenizer.ggml.pre") {
        None => "default",
        Some(Value::Str(s)) => s.as_str(),
        Some(_) => return Err(meta.fail("key 'tokenizer.ggml.pre' is not a string".into())),
    };
    if let Some(rules) = pre::rules_of(pre) {
        return Ok(rules);
    }
    let reason = match NOT_REBUILT.iter().find(|(name, _)| *name == pre) {
        Some((_, why)) => {
            format!("wgpar does not rebuild this tokenizer from the metadata ({why})")
        }
        None => "wgpar does not know this pre-tokenizer (docs/MODELS.md lists those it rebuilds)"
            .to_string(),
    };
    Err(WgparError::UnknownPreTokenizer {
        file: file.display().to_string(),
        pre: pre.to_string(),
        reason,
    })
}

/// `tokenizer.ggml.merges`: each "left right", split at the first space after the first
/// character (a merge's left part is never empty). None stored (an empty array may be written
/// as no key at all): a vocabulary of single bytes and whole tokens.
fn merges(meta: &Meta) -> Result<Vec<Json>> {
    let key = "tokenizer.ggml.merges";
    let Some(items) = meta.opt_array(key)? else {
        return Ok(Vec::new());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Str(s) = m else {
                return Err(meta.fail(format!("key '{key}': merge {i} is not a string")));
            };
            let at = s
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(at, _)| at);
            at.map(|at| json!([&s[..at], &s[at + 1..]]))
                .ok_or_else(|| meta.fail(format!("key '{key}': merge {i} ('{s}') has no space")))
        })
        .collect()
}

/// The normalizers before a pre-tokenizer: NFC where the rules ask for it, then `prefix`
/// in front of the text where the file's `add_space_prefix` is true.
fn normalizer(nfc: bool, prefix: Option<&str>) -> Json {
    let mut steps = Vec::new();
    if nfc {
        steps.push(json!({"type": "NFC"}));
    }
    if let Some(p) = prefix {
        steps.push(json!({"type": "Prepend", "prepend": p}));
    }
    match steps.len() {
        0 => Json::Null,
        _ => json!({"type": "Sequence", "normalizers": steps}),
    }
}

fn byte_level(meta: &Meta, v: &Vocab, file: &Path) -> Result<Json> {
    let rules = pre_rules(meta, file)?;
    let prefix = meta.bool_or("tokenizer.ggml.add_space_prefix", false)?;
    let specials = specials(meta, v, rules.add_bos)?;
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(v),
        "normalizer": normalizer(rules.nfc, prefix.then_some(" ")),
        "pre_tokenizer": rules.pre_tokenizer(),
        "post_processor": specials.template().unwrap_or(byte_level.clone()),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": rules.ignore_merges,
                  "vocab": vocab_map(v), "merges": merges(meta)?}
    }))
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
    let specials = specials(meta, v, true)?;
    let prefix = meta.bool_or("tokenizer.ggml.add_space_prefix", true)?;
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
    // SentencePiece puts a space before the text unless the file says not to.
    let mut normalizers = vec![replace(" ", "\u{2581}")];
    if prefix {
        normalizers.insert(0, json!({"type": "Prepend", "prepend": "\u{2581}"}));
    }
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": specials.template(),
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

/// The `tokenizer.json` text equivalent to the tokenizer metadata of `file`.
pub fn tokenizer_json(file: &GgufFile) -> Result<String> {
    let meta = Meta::new(file)?;
    let meta = &meta;
    let v = vocab(meta)?;
    let kind = meta.string("tokenizer.ggml.model")?;
    let json = match kind {
        "gpt2" => byte_level(meta, &v, file.path())?,
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

/// The tokenizer `file`'s metadata describes.
pub fn load(file: &GgufFile) -> Result<TextTokenizer> {
    TextTokenizer::from_json(&tokenizer_json(file)?, file.path(), None)
}
