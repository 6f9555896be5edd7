//! Reading one family's tensors by their Hugging Face names: the checkpoint's name prefix is
//! applied, shapes come from the config, and a progress bar counts the converted bytes.

use std::cell::RefCell;
use std::collections::HashSet;

use indicatif::{ProgressBar, ProgressStyle};

use super::tensors::TensorStore;
use crate::error::Result;

/// Reads tensors under one name prefix (e.g. `transformer.`, `bert.`, or none).
pub struct Reader<'a> {
    store: &'a TensorStore,
    prefix: String,
    bar: ProgressBar,
    /// Full names of the tensors read so far (for [`Self::unused`]).
    used: RefCell<HashSet<String>>,
}

/// Tensors that checkpoints carry but no model reads, and Hugging Face loads without a word:
/// GPT-2's causal-mask buffers, rotary frequency tables, BERT's position ids and the pooler,
/// which sentence embeddings do not use.
const IGNORED_SUFFIXES: [&str; 4] = [
    ".attn.bias",
    ".attn.masked_bias",
    "rotary_emb.inv_freq",
    "position_ids",
];
const IGNORED_PARTS: [&str; 1] = ["pooler."];

impl<'a> Reader<'a> {
    /// The first of `prefixes` under which `probe` exists (the first prefix when none does,
    /// so that the missing-tensor error names the canonical spelling).
    pub fn new(store: &'a TensorStore, prefixes: &[&str], probe: &str, progress: bool) -> Self {
        let prefix = prefixes
            .iter()
            .find(|p| store.contains(&format!("{p}{probe}")))
            .or(prefixes.first())
            .map_or(String::new(), |p| p.to_string());
        let bar = if progress {
            let bar = ProgressBar::new(store.bytes());
            if let Ok(style) = ProgressStyle::with_template(
                "loading {bar:40} {binary_bytes}/{binary_total_bytes} ({eta})",
            ) {
                bar.set_style(style);
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        Self {
            store,
            prefix,
            bar,
            used: RefCell::new(HashSet::new()),
        }
    }

    /// The name prefix this checkpoint's tensors were found under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Tensor `name` (without the prefix) as f32, which must have `shape`.
    pub fn tensor(&self, name: &str, shape: &[usize], what: &str) -> Result<Vec<f32>> {
        self.top_level(&self.full(name), shape, what)
    }

    /// Like [`Self::tensor`], `None` when the checkpoint has no such tensor.
    pub fn optional(&self, name: &str, shape: &[usize], what: &str) -> Result<Option<Vec<f32>>> {
        if self.store.contains(&self.full(name)) {
            self.tensor(name, shape, what).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Whether the checkpoint has tensor `name` (without the prefix).
    pub fn has(&self, name: &str) -> bool {
        self.store.contains(&self.full(name))
    }

    /// Tensor `name` read outside the prefix (Llama's `lm_head.weight` sits beside `model.`).
    pub fn top_level(&self, name: &str, shape: &[usize], what: &str) -> Result<Vec<f32>> {
        let v = self.store.load(name, shape, what)?;
        self.bar.inc(self.store.stored_bytes(name));
        self.used.borrow_mut().insert(name.to_string());
        Ok(v)
    }

    /// The checkpoint's tensors that nothing has read (sorted), less those Hugging Face also
    /// skips silently: after a model is loaded, what its config does not use (for example a
    /// second layer's tensors under `num_hidden_layers: 1`).
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.borrow();
        let mut names: Vec<String> = self
            .store
            .names()
            .filter(|n| !used.contains(*n))
            .filter(|n| !IGNORED_SUFFIXES.iter().any(|s| n.ends_with(s)))
            .filter(|n| !IGNORED_PARTS.iter().any(|p| n.contains(p)))
            .map(str::to_string)
            .collect();
        names.sort();
        names
    }

    /// Clears the progress bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// `[rows][cols]` from a `[cols][rows]` matrix (Conv1D weights are stored input-major).
pub fn transpose(m: &[f32], rows_in: usize, cols_in: usize) -> Vec<f32> {
    let mut out = vec![0.0; m.len()];
    for r in 0..rows_in {
        for c in 0..cols_in {
            out[c * rows_in + r] = m[r * cols_in + c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_by_hand() {
        // [[1, 2, 3], [4, 5, 6]] -> [[1, 4], [2, 5], [3, 6]]
        let t = transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3);
        assert_eq!(t, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }
}
