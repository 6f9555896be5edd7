//! Text to token ids and back, through the checkpoint's `tokenizer.json` (the `tokenizers`
//! crate, so BPE, WordPiece and their normalisers behave as in Python).

use std::path::{Path, PathBuf};

use std::str::FromStr;

use tokenizers::{Tokenizer, TruncationParams};

use crate::error::{Result, WgparError};
use crate::model::input::EncoderInput;

/// A loaded `tokenizer.json`.
pub struct TextTokenizer {
    inner: Tokenizer,
    file: PathBuf,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TextTokenizer({})", self.file.display())
    }
}

/// The state of a text stream ([`TextTokenizer::stream_after`]): the tokens still needed
/// to decode the next one's text, and the text they already gave.
#[derive(Debug, Clone)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

/// Says why `file` is not a tokenizer in the user's terms: not JSON (with the line and column),
/// JSON that is not a `tokenizers` file (which sections are missing), or the crate's own
/// message when the file has the right sections but a bad value.
fn diagnose(text: &str, e: &dyn std::fmt::Display) -> String {
    let json: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(j) => {
            return format!(
                "not valid JSON (line {}, column {}: {j}); tokenizer.json is the JSON file a \
                 Hugging Face 'fast' tokenizer saves",
                j.line(),
                j.column()
            )
        }
    };
    let missing: Vec<&str> = ["model", "normalizer", "pre_tokenizer", "decoder"]
        .into_iter()
        .filter(|k| json.get(k).is_none())
        .collect();
    if !json.is_object() || missing.contains(&"model") {
        return format!(
            "valid JSON, but not a Hugging Face tokenizers file: it has no \"model\" section \
             (missing: {}); save the checkpoint's fast tokenizer with \
             `tokenizer.save_pretrained(dir)`, which writes tokenizer.json",
            missing.join(", ")
        );
    }
    format!("not a tokenizer wgpar can read: {e}")
}

impl TextTokenizer {
    /// Loads `file`. Padding configured in the file is switched off (engines pad themselves);
    /// with `max_len`, longer texts are cut to that many tokens, otherwise they are kept whole.
    pub fn from_file(file: &Path, max_len: Option<usize>) -> Result<Self> {
        let fail = |detail: String| WgparError::Checkpoint {
            file: file.display().to_string(),
            tensor: None,
            detail,
        };
        if !file.is_file() {
            return Err(fail(
                "missing: wgpar needs the checkpoint's tokenizer.json (the 'fast' tokenizer \
                 file) to turn text into token ids"
                    .into(),
            ));
        }
        let text = crate::files::read_text(file, crate::files::TOKENIZER_LIMIT)
            .map_err(|e| fail(format!("unreadable: {e}")))?;
        Self::from_json(&text, file, max_len)
    }

    /// Loads a tokenizer from the text of a `tokenizer.json` (`file` names its origin in
    /// errors), as [`Self::from_file`] does.
    pub fn from_json(text: &str, file: &Path, max_len: Option<usize>) -> Result<Self> {
        let fail = |detail: String| WgparError::Checkpoint {
            file: file.display().to_string(),
            tensor: None,
            detail,
        };
        // Not JSON: say so (the tokenizers crate panics on some malformed sections instead of
        // returning an error, e.g. a `decoder` that is not an object).
        if let Err(e) = serde_json::from_str::<serde_json::Value>(text) {
            return Err(fail(diagnose(text, &e)));
        }
        let parsed = std::panic::catch_unwind(|| Tokenizer::from_str(text)).map_err(|_| {
            fail(
                "a section has a value of the wrong kind (the tokenizers crate could not read it); \
                 save the checkpoint's fast tokenizer again with `save_pretrained`"
                    .into(),
            )
        })?;
        let mut inner = parsed.map_err(|e| fail(diagnose(text, &e)))?;
        inner.with_padding(None);
        let truncation = max_len.map(|max_length| TruncationParams {
            max_length,
            ..TruncationParams::default()
        });
        inner
            .with_truncation(truncation)
            .map_err(|e| fail(format!("truncation: {e}")))?;
        Ok(Self {
            inner,
            file: file.to_path_buf(),
        })
    }

    /// A word-level tokenizer whose words are `t0`, `t1`, ... `t{vocab-1}` (one per id),
    /// split on whitespace: text in and out for a preset's synthetic weights (`wgpar serve`
    /// on a preset).
    pub fn word_level(vocab: usize) -> Result<Self> {
        let words: serde_json::Map<String, serde_json::Value> = (0..vocab)
            .map(|i| (format!("t{i}"), serde_json::Value::from(i)))
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": words, "unk_token": "t0"}
        });
        let file = PathBuf::from(format!("(word-level t0..t{})", vocab.saturating_sub(1)));
        let inner = Tokenizer::from_str(&json.to_string()).map_err(|e| WgparError::Checkpoint {
            file: file.display().to_string(),
            tensor: None,
            detail: e.to_string(),
        })?;
        Ok(Self { inner, file })
    }

    fn fail(&self, what: &str, e: impl std::fmt::Display) -> WgparError {
        WgparError::Checkpoint {
            file: self.file.display().to_string(),
            tensor: None,
            detail: format!("{what}: {e}"),
        }
    }

    /// Token ids of `text`, with the special tokens the file's post-processor adds (BOS,
    /// `[CLS]` ... `[SEP]`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| self.fail("encoding", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` alone, without the special tokens of the post-processor: for a
    /// chat prompt, whose template writes its own.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| self.fail("encoding", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// An encoder input: ids and token types of `text`.
    pub fn encode_for_encoder(&self, text: &str) -> Result<EncoderInput> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| self.fail("encoding", e))?;
        Ok(EncoderInput {
            ids: enc.get_ids().to_vec(),
            token_types: enc.get_type_ids().to_vec(),
        })
    }

    /// The tokenizer as `tokenizer.json` text (structured output reads every token's bytes
    /// from it).
    pub fn to_json(&self) -> Result<String> {
        (self.inner.to_string(false)).map_err(|e| self.fail("writing tokenizer.json", e))
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| self.fail("decoding", e))
    }

    /// A text stream that continues after `context` (the prompt): [`Self::step`] then gives
    /// the text each further token adds, as decoding context and continuation together
    /// would (word boundaries included), while decoding only a few tokens per step. Where
    /// the context ends inside a character, that character comes with the first tokens.
    pub fn stream_after(&self, context: &[u32]) -> TextStream {
        // The context's text, decoded once, is what the first tokens' text is cut from. A
        // context that ends inside a character (a byte-level token, a byte fallback) is cut
        // before that character's tokens, which then come out with the token completing it.
        let mut whole = context.len();
        let mut prefix = self.decode(context).unwrap_or_default();
        while prefix.ends_with('\u{FFFD}') && whole > 0 && context.len() - whole < 8 {
            whole -= 1;
            prefix = self.decode(&context[..whole]).unwrap_or_default();
        }
        if prefix.ends_with('\u{FFFD}') {
            (whole, prefix) = (0, String::new());
        }
        TextStream {
            ids: context.to_vec(),
            prefix_index: whole,
            prefix,
        }
    }

    /// The text `id` adds to `stream`: empty while the text ends inside a character (it
    /// comes with a later token). Each step decodes a window of the last few tokens (the `tokenizers` crate's stream decoding), so a
    /// generation costs time linear in its length, not quadratic.
    pub fn step(&self, stream: &mut TextStream, id: u32) -> Result<String> {
        let TextStream {
            ids,
            prefix,
            prefix_index,
        } = stream;
        tokenizers::step_decode_stream(&self.inner, vec![id], true, ids, prefix, prefix_index)
            .map(Option::unwrap_or_default)
            .map_err(|e| self.fail("decoding", e))
    }

    /// What `stream` still holds back when it ends (a character its last tokens left
    /// incomplete, decoded as U+FFFD), as decoding the whole sequence would show it.
    pub fn finish(&self, stream: &TextStream) -> Result<String> {
        let text = self.decode(&stream.ids)?;
        Ok(text
            .strip_prefix(stream.prefix.as_str())
            .unwrap_or_default()
            .to_string())
    }
}
