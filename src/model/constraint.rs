//! Constrained decoding (structured output): which tokens may come next so the text stays a
//! prefix of a JSON value of a schema. The grammar engine is llguidance's; this module builds
//! its token table from the model's tokenizer once ([`Grammars`]) and keeps one matcher per
//! request ([`Constraint`]), whose mask the picker applies to a row's logits before the pick.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

use crate::error::{Result, WgparError};

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value of this schema (`json_schema`).
    JsonSchema(Value),
    /// Text matching this regular expression, whole (vLLM's `guided_regex`; Rust `regex`
    /// syntax, as llguidance reads it).
    Regex(String),
    /// Exactly one of these strings (vLLM's `guided_choice`).
    Choice(Vec<String>),
}

impl Format {
    /// What the grammar is, for messages: "schema", "regex" or "choice".
    pub fn kind(&self) -> &'static str {
        match self {
            Format::JsonObject | Format::JsonSchema(_) => "schema",
            Format::Regex(_) => "regex",
            Format::Choice(_) => "choice",
        }
    }

    /// The grammar llguidance compiles: a choice is the alternation of its strings, each
    /// escaped to match itself only.
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Format::JsonObject | Format::JsonSchema(_) => {
                TopLevelGrammar::from_json_schema(self.schema())
            }
            Format::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Format::Choice(options) => {
                let alternatives: Vec<String> = options.iter().map(|o| literal(o)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
        }
    }

    /// The JSON schema llguidance compiles: the user's, with compact separators and no free
    /// whitespace unless the schema sets its own `x-guidance` options (small models otherwise
    /// spend their tokens on blank lines between items).
    fn schema(&self) -> Value {
        let mut schema = match self {
            Format::JsonSchema(s) => s.clone(),
            _ => json!({"type": "object"}),
        };
        if let Some(obj) = schema.as_object_mut() {
            obj.entry("x-guidance").or_insert_with(|| {
                json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
            });
        }
        schema
    }
}

/// A regular expression matching `text` only: every character the `regex` syntax gives a
/// meaning is escaped.
fn literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The model's tokens as llguidance sees them, built once per served model.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    vocab: usize,
    eos: Vec<u32>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammars(vocab {})", self.vocab)
    }
}

/// Why the tokenizer cannot drive a grammar, as the user reads it.
fn unusable(detail: String) -> WgparError {
    WgparError::Grammar {
        after: None,
        detail,
    }
}

/// Every token's bytes from a `tokenizer.json` text (llguidance reads byte-level BPE and
/// byte-fallback SentencePiece vocabularies; special tokens are marked so no grammar emits
/// them), padded with empty tokens to `vocab`.
fn token_bytes(tokenizer_json: &str, vocab: usize) -> Result<Vec<Vec<u8>>> {
    let json: Value = serde_json::from_str(tokenizer_json)
        .map_err(|e| unusable(format!("tokenizer JSON: {e}")))?;
    // The reader asserts on odd vocabularies; a panic here is a tokenizer it cannot use.
    let read = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json));
    let mut words = match read {
        Ok(Ok(words)) => words,
        Ok(Err(e)) => return Err(unusable(e.to_string())),
        Err(_) => {
            return Err(unusable(
                "the tokenizer's vocabulary could not be read".into(),
            ))
        }
    };
    if words.len() > vocab {
        return Err(unusable(format!(
            "the tokenizer has {} tokens, more than the model's {vocab} logits",
            words.len()
        )));
    }
    words.resize(vocab, Vec::new());
    Ok(words)
}

impl Grammars {
    /// The token table of a model with `vocab` logits whose tokenizer is `tokenizer_json`
    /// and whose end tokens are `eos` (a grammar allows them only where the value is whole).
    pub fn new(tokenizer_json: &str, vocab: usize, eos: &[u32]) -> Result<Self> {
        let Some(&first) = eos.first() else {
            return Err(unusable(
                "the model has no end-of-sequence token to end a structured answer".into(),
            ));
        };
        let words = token_bytes(tokenizer_json, vocab)?;
        let info = TokRxInfo::new(vocab as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| unusable(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            vocab,
            eos: eos.to_vec(),
        })
    }

    /// A fresh matcher for `format`, or why its schema is not one llguidance compiles.
    pub fn compile(&self, format: &Format) -> std::result::Result<Constraint, String> {
        let grammar = format.grammar();
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            matcher,
            vocab: self.vocab,
            eos: self.eos.clone(),
            consumed: 0,
        })
    }
}

/// One request's grammar state: which tokens may come next.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    /// The end tokens: they end the value and are not fed to the matcher.
    eos: Vec<u32>,
    /// Tokens fed so far.
    consumed: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({} tokens in)", self.consumed)
    }
}

impl Constraint {
    fn failed(&self, e: impl std::fmt::Display) -> WgparError {
        WgparError::Grammar {
            after: Some(self.consumed),
            detail: e.to_string(),
        }
    }

    /// The tokens allowed next as a bit set, 32 per word (bit `t % 32` of word `t / 32`
    /// is token `t`): the grammar's continuations, and the end tokens once the value is
    /// whole (only those once nothing may follow).
    pub fn allowed(&mut self) -> Result<Vec<u32>> {
        let vob = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| self.failed(e))?;
        let mut words = vob.as_slice().to_vec();
        words.resize(self.vocab.div_ceil(32), 0);
        if words.iter().all(|&w| w == 0) {
            return Err(self.failed("no token continues the value"));
        }
        Ok(words)
    }

    /// Sets every logit the grammar does not allow next to minus infinity.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.allowed()?;
        apply_mask(&allowed, logits);
        Ok(())
    }

    /// Feeds the picked `token` (an end token ends the value and is not fed).
    pub fn consume(&mut self, token: u32) -> Result<()> {
        if self.eos.contains(&token) {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| self.failed(e))?;
        self.consumed += 1;
        Ok(())
    }
}

/// Sets `logits[t]` to minus infinity where bit `t` of `allowed` is clear.
pub fn apply_mask(allowed: &[u32], logits: &mut [f32]) {
    for (t, x) in logits.iter_mut().enumerate() {
        let bit = allowed.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
        if !bit {
            *x = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary: the 256 bytes (GPT-2's printable stand-ins) and an end token.
    fn byte_tokenizer() -> String {
        let mut chars = Vec::new();
        let mut extra = 0u32;
        for b in 0..=255u32 {
            let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
            let c = if printable {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            };
            chars.push(c.to_string());
        }
        let vocab: serde_json::Map<String, Value> = (chars.iter().enumerate())
            .map(|(i, c)| (c.clone(), json!(i)))
            .collect();
        json!({
            "added_tokens": [{"id": 256, "content": "<end>", "special": true}],
            "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "vocab": vocab, "merges": []}
        })
        .to_string()
    }

    #[test]
    fn the_mask_admits_only_the_schema_and_the_end_where_it_is_whole() {
        let g = Grammars::new(&byte_tokenizer(), 260, &[256]).unwrap();
        let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"], "additionalProperties": false});
        let mut c = g.compile(&Format::JsonSchema(schema)).unwrap();
        // Poisoned: every logit finite, the largest on a token the grammar refuses.
        let mut logits: Vec<f32> = (0..260).map(|i| (i as f32 * 0.37).sin()).collect();
        logits[b'x' as usize] = 9.0;
        c.mask(&mut logits).unwrap();
        let open: Vec<usize> = (0..260).filter(|&t| logits[t].is_finite()).collect();
        assert_eq!(open, vec![b'{' as usize], "only '{{' may start the object");
        for &b in br#"{"ok": true}"# {
            let allowed = c.allowed().unwrap();
            assert!(
                allowed[b as usize / 32] >> (b % 32) & 1 == 1,
                "{}",
                b as char
            );
            assert!(
                allowed[256 / 32] & 1 == 0,
                "no end before the value is whole"
            );
            c.consume(b as u32).unwrap();
        }
        let allowed = c.allowed().unwrap();
        assert_eq!(allowed[256 / 32] & 1, 1, "the end once the object closes");
        let open = (0..260)
            .filter(|&t| allowed[t / 32] >> (t % 32) & 1 == 1)
            .count();
        assert_eq!(open, 1, "nothing but the end after the object");
        c.consume(256).unwrap();
    }

    #[test]
    fn bad_schemas_and_tokenizers_are_refused() {
        let g = Grammars::new(&byte_tokenizer(), 257, &[256]).unwrap();
        let e = g
            .compile(&Format::JsonSchema(json!({"type": "frobnicate"})))
            .unwrap_err();
        assert!(e.contains("frobnicate"), "{e}");
        let e = Grammars::new(&byte_tokenizer(), 257, &[]).unwrap_err();
        assert!(
            matches!(&e, WgparError::Grammar { after: None, detail } if detail.contains("end-of-sequence")),
            "{e}"
        );
        assert!(
            e.to_string()
                .starts_with("structured output needs the model's tokens as bytes: "),
            "{e}"
        );
        // The model, not an option or a call, has to change: a failure while running.
        assert_eq!(e.exit_code(), crate::error::EXIT_FAILURE, "{e}");
        let e = Grammars::new(&byte_tokenizer(), 100, &[1]).unwrap_err();
        assert!(
            e.to_string().contains("more than the model's 100 logits"),
            "{e}"
        );
        let word = json!({"added_tokens": [], "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0}}});
        assert!(Grammars::new(&word.to_string(), 1, &[0]).is_err());
    }

    #[test]
    fn a_token_the_grammar_refuses_fails_with_the_tokens_fed() {
        let g = Grammars::new(&byte_tokenizer(), 257, &[256]).unwrap();
        let mut c = g.compile(&Format::Choice(vec!["ab".into()])).unwrap();
        c.consume(u32::from(b'a')).unwrap();
        let e = c.consume(u32::from(b'x')).unwrap_err();
        assert!(
            matches!(e, WgparError::Grammar { after: Some(1), .. }),
            "{e}"
        );
        assert!(
            e.to_string()
                .starts_with("structured output failed after 1 tokens: "),
            "{e}"
        );
    }

    #[test]
    fn masked_logits_are_minus_infinity_elsewhere() {
        let mut logits = vec![1.0f32; 40];
        apply_mask(&[0b101, 1 << 7], &mut logits);
        let open: Vec<usize> = (0..40).filter(|&t| logits[t].is_finite()).collect();
        assert_eq!(open, vec![0, 2, 39]);
    }
}
