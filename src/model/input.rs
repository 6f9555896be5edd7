//! What an encoder reads per sequence: token ids and their token types (BERT's segment A/B),
//! checked against the model before anything reaches a device.

use super::config::ModelConfig;
use crate::error::{Result, WgparError};

/// One sequence for an encoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncoderInput {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Token type per token (segment id), or empty for all zeros.
    pub token_types: Vec<u32>,
}

impl EncoderInput {
    /// A single-segment sequence (every token type 0).
    pub fn new(ids: Vec<u32>) -> Self {
        Self {
            ids,
            token_types: Vec::new(),
        }
    }

    /// Token types, with the empty default expanded to zeros.
    pub fn types(&self) -> Vec<u32> {
        if self.token_types.is_empty() {
            vec![0; self.ids.len()]
        } else {
            self.token_types.clone()
        }
    }

    /// Checks every sequence against `config`: non-empty, within `max_seq`, ids inside the
    /// vocabulary, types inside the type vocabulary, one type per token. Returns the longest
    /// length.
    pub fn check_batch(inputs: &[Self], config: &ModelConfig) -> Result<usize> {
        if inputs.is_empty() {
            return Err(WgparError::InvalidCall("nothing to encode".into()));
        }
        let mut longest = 0;
        for (i, input) in inputs.iter().enumerate() {
            let n = input.ids.len();
            let fail = |m: String| Err(WgparError::InvalidCall(format!("sequence {i}: {m}")));
            if n == 0 {
                return fail("no tokens".into());
            }
            if n > config.max_seq {
                return fail(format!(
                    "{n} tokens exceed max_seq {} of model '{}'",
                    config.max_seq, config.name
                ));
            }
            if let Some(bad) = input.ids.iter().find(|&&t| t as usize >= config.vocab) {
                return fail(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    config.vocab
                ));
            }
            if !input.token_types.is_empty() && input.token_types.len() != n {
                return fail(format!(
                    "{} token types for {n} tokens",
                    input.token_types.len()
                ));
            }
            if let Some(bad) = input
                .token_types
                .iter()
                .find(|&&t| t as usize >= config.type_vocab)
            {
                return fail(format!(
                    "token type {bad} is outside the {} token types",
                    config.type_vocab
                ));
            }
            longest = longest.max(n);
        }
        Ok(longest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_sequences_are_named() {
        let cfg = ModelConfig::preset("tiny-bert").unwrap();
        let ok = EncoderInput::new(vec![1, 2, 3]);
        assert_eq!(
            EncoderInput::check_batch(std::slice::from_ref(&ok), &cfg).unwrap(),
            3
        );
        assert_eq!(ok.types(), vec![0, 0, 0]);
        let cases = [
            (EncoderInput::new(vec![]), "no tokens"),
            (EncoderInput::new(vec![5000]), "vocabulary"),
            (EncoderInput::new(vec![1; 65]), "max_seq"),
            (
                EncoderInput {
                    ids: vec![1, 2],
                    token_types: vec![0],
                },
                "1 token types for 2",
            ),
            (
                EncoderInput {
                    ids: vec![1],
                    token_types: vec![2],
                },
                "token type 2",
            ),
        ];
        for (bad, want) in cases {
            let e = EncoderInput::check_batch(&[ok.clone(), bad], &cfg)
                .unwrap_err()
                .to_string();
            assert!(e.contains("sequence 1") && e.contains(want), "{e}");
        }
    }
}
