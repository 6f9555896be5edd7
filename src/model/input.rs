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
            return Err(WgparError::TooFew {
                what: "sequences (nothing to encode)".into(),
                got: 0,
                min: 1,
            });
        }
        let mut longest = 0;
        for (i, input) in inputs.iter().enumerate() {
            input.check(i, config)?;
            longest = longest.max(input.ids.len());
        }
        Ok(longest)
    }

    /// [`Self::check_batch`] for this sequence, the `sequence`-th of its batch.
    fn check(&self, sequence: usize, config: &ModelConfig) -> Result<()> {
        let n = self.ids.len();
        if n == 0 {
            return Err(WgparError::TooFew {
                what: format!("sequence {sequence}: tokens"),
                got: 0,
                min: 1,
            });
        }
        if n > config.max_seq {
            return Err(WgparError::limit(
                "context (tokens)",
                (n as u64, config.max_seq as u64),
                format!(
                    "sequence {sequence}: {n} tokens exceed max_seq {} of model '{}'",
                    config.max_seq, config.name
                ),
            ));
        }
        let outside =
            |values: &[u32], limit: usize| values.iter().copied().find(|&t| t as usize >= limit);
        if let Some(value) = outside(&self.ids, config.vocab) {
            return Err(WgparError::TokenRange {
                sequence,
                what: "token id",
                value,
                range: "vocabulary",
                limit: config.vocab,
            });
        }
        if !self.token_types.is_empty() && self.token_types.len() != n {
            return Err(WgparError::LengthMismatch {
                what: format!("sequence {sequence}: token types, one per token"),
                got: self.token_types.len(),
                expected: n,
            });
        }
        if let Some(value) = outside(&self.token_types, config.type_vocab) {
            return Err(WgparError::TokenRange {
                sequence,
                what: "token type",
                value,
                range: "type vocabulary",
                limit: config.type_vocab,
            });
        }
        Ok(())
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
            (EncoderInput::new(vec![]), "tokens: 0 given, at least 1"),
            (
                EncoderInput::new(vec![5000]),
                "token id 5000 is outside the vocabulary of 397",
            ),
            (
                EncoderInput::new(vec![1; 65]),
                "65 tokens exceed max_seq 64",
            ),
            (
                EncoderInput {
                    ids: vec![1, 2],
                    token_types: vec![0],
                },
                "token types, one per token: 1 given for 2",
            ),
            (
                EncoderInput {
                    ids: vec![1],
                    token_types: vec![2],
                },
                "token type 2 is outside the type vocabulary of 2",
            ),
        ];
        for (bad, want) in cases {
            let e = EncoderInput::check_batch(&[ok.clone(), bad], &cfg).unwrap_err();
            let text = e.to_string();
            assert!(text.contains("sequence 1") && text.contains(want), "{text}");
            // A sequence too long for the model is a limit with its numbers; the others are
            // calls that do not fit the model.
            let expected = if text.contains("max_seq") {
                crate::error::EXIT_FAILURE
            } else {
                crate::error::EXIT_INTERNAL
            };
            assert_eq!(e.exit_code(), expected, "{text}");
        }
        let e = EncoderInput::check_batch(&[], &cfg).unwrap_err();
        assert!(
            matches!(e, WgparError::TooFew { got: 0, min: 1, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("nothing to encode"), "{e}");
        let e = EncoderInput::check_batch(&[EncoderInput::new(vec![1, 9999])], &cfg).unwrap_err();
        assert!(
            matches!(
                e,
                WgparError::TokenRange {
                    sequence: 0,
                    value: 9999,
                    limit: 397,
                    ..
                }
            ),
            "{e}"
        );
    }
}
