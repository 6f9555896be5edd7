//! Encoders: engines whose result is one vector per sequence (BERT-style sentence embeddings)
//! rather than next-token logits. Sequences of different lengths share a batch: they are
//! right-padded on the device and their real lengths keep padding out of attention and
//! pooling.

use std::sync::Arc;

use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{Activations, EncoderInput, GpuModel, KvCache, ModelWeights, Placement, Step};

/// Pooled embeddings, `[batch][dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// Sequences.
    pub batch: usize,
    /// Width of each embedding.
    pub dim: usize,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl Embeddings {
    /// One sequence's embedding.
    pub fn row(&self, b: usize) -> &[f32] {
        &self.data[b * self.dim..(b + 1) * self.dim]
    }

    /// Cosine similarity of sequences `i` and `j`.
    pub fn cosine(&self, i: usize, j: usize) -> f64 {
        cosine_similarity(self.row(i), self.row(j))
    }

    /// Each text's vector (its first 8 values unless `full`) after its index, text and token
    /// count (`tokens[b]`), then every pair's cosine similarity when there are several.
    pub fn render(&self, texts: &[String], tokens: &[usize], full: bool) -> String {
        let mut s = String::new();
        for (b, text) in texts.iter().enumerate() {
            let row = self.row(b);
            let shown = if full { row.len() } else { row.len().min(8) };
            let values: Vec<String> = row[..shown].iter().map(|v| format!("{v:.6}")).collect();
            let more = if shown < row.len() { " ..." } else { "" };
            s += &format!(
                "[{b}] {text:?} ({} tokens): [{}{more}]\n",
                tokens[b],
                values.join(", ")
            );
        }
        if self.batch > 1 {
            s += "cosine similarity:\n";
            for i in 0..self.batch {
                for j in i + 1..self.batch {
                    s += &format!("  [{i}] vs [{j}]: {:.4}\n", self.cosine(i, j));
                }
            }
        }
        s
    }
}

/// `a . b / (|a| |b|)` in f64; 0 when either vector is zero.
pub fn cosine_similarity(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let denom = norm(a) * norm(b);
    if denom == 0.0 {
        0.0
    } else {
        dot / denom
    }
}

/// A way of running an encoder model.
pub trait Encoder {
    /// Short description, e.g. `single on gpu0 (llvmpipe, Vulkan)`.
    fn name(&self) -> String;

    /// Encodes a batch of sequences (any lengths up to the model's `max_seq`) into one pooled
    /// vector each.
    fn encode(&mut self, inputs: &[EncoderInput]) -> Result<Embeddings>;
}

/// The right-padded device batch for `inputs`: ids, token types and real lengths.
pub fn pad_batch(inputs: &[EncoderInput], seq: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut ids = Vec::with_capacity(inputs.len() * seq);
    let mut types = Vec::with_capacity(inputs.len() * seq);
    for input in inputs {
        let n = input.ids.len();
        ids.extend_from_slice(&input.ids);
        types.extend(input.types());
        // Padding ids are valid (0) but never attended or pooled.
        ids.extend(std::iter::repeat_n(0, seq - n));
        types.extend(std::iter::repeat_n(0, seq - n));
    }
    let lens = inputs.iter().map(|i| i.ids.len() as u32).collect();
    (ids, types, lens)
}

/// The whole encoder on one device.
pub struct SingleEncoder {
    model: GpuModel,
    act: Option<Activations>,
    kv: Option<KvCache>,
    batch: usize,
}

impl SingleEncoder {
    /// Uploads an encoder's `weights` to `gpu`, stored as `dtype`.
    pub fn new(gpu: Arc<Gpu>, weights: &ModelWeights, dtype: DType) -> Result<Self> {
        if !weights.config.is_encoder() {
            return Err(WgparError::unsupported(format!(
                "model '{}' is a decoder; an encoder needs a BERT-style model",
                weights.config.name
            )));
        }
        let placement = Placement::whole(&weights.config);
        Ok(Self {
            model: GpuModel::upload(gpu, weights, placement, dtype)?,
            act: None,
            kv: None,
            batch: 0,
        })
    }

    /// The model on the device.
    pub fn model(&self) -> &GpuModel {
        &self.model
    }
}

impl Encoder for SingleEncoder {
    fn name(&self) -> String {
        format!("single on {}", self.model.gpu().describe())
    }

    fn encode(&mut self, inputs: &[EncoderInput]) -> Result<Embeddings> {
        let m = &self.model;
        let c = m.config();
        let seq = EncoderInput::check_batch(inputs, c)?;
        let batch = inputs.len();
        let step = Step {
            batch,
            seq,
            past: 0,
        };
        let fits = self
            .act
            .as_ref()
            .is_some_and(|a| a.batch() == batch && a.capacity() >= step.tokens());
        if !fits {
            self.act = Some(m.activations(step.tokens(), batch)?);
        }
        if self.kv.as_ref().map(KvCache::slots) != Some(batch) {
            self.kv = Some(m.kv_cache(batch)?);
        }
        self.batch = batch;
        let (Some(act), Some(kv)) = (&mut self.act, &mut self.kv) else {
            // Both were made just above.
            return Err(WgparError::Internal("encoder buffers missing".into()));
        };
        let (ids, types, lens) = pad_batch(inputs, seq);
        m.write_ids(act, &ids)?;
        m.write_encoder_inputs(act, &step, &types, &lens)?;
        m.begin_step(act, kv, &step, &step.rows())?;
        let mut enc = m.gpu().encoder();
        m.embed(&mut enc, act)?;
        m.layers(&mut enc, act, kv)?;
        m.pool(&mut enc, act)?;
        m.gpu().submit(enc);
        // An encoder's activations always hold the pooled output (`pool` above wrote it).
        let pooled = act
            .pooled()
            .ok_or_else(|| WgparError::Internal("no pooled output buffer".into()))?;
        let mut data = m.gpu().read_f32(pooled)?;
        data.truncate(batch * c.hidden);
        Ok(Embeddings {
            batch,
            dim: c.hidden,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_and_cosine() {
        let inputs = [
            EncoderInput::new(vec![5, 6]),
            EncoderInput {
                ids: vec![7, 8, 9],
                token_types: vec![0, 1, 1],
            },
        ];
        let (ids, types, lens) = pad_batch(&inputs, 3);
        assert_eq!(ids, vec![5, 6, 0, 7, 8, 9]);
        assert_eq!(types, vec![0, 0, 0, 0, 1, 1]);
        assert_eq!(lens, vec![2, 3]);
        assert!((cosine_similarity(&[1.0, 0.0], &[1.0, 1.0]) - 0.5f64.sqrt()).abs() < 1e-12);
        assert_eq!(cosine_similarity(&[0.0, 0.0], &[1.0, 1.0]), 0.0);
    }
}
