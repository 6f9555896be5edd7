//! A `[vocab][hidden]` table on a device (the token embedding, the LM head), split by rows into
//! blocks that each fit the adapter's storage-binding limit. Many adapters bind at most
//! 128 MiB (lavapipe, GL drivers, WebGPU's default), less than the embedding of GPT-2 small in
//! f32 (147 MiB) or of a Llama 3 model; a table that fits stays one block, bound as before.

use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::model::budget::vocab_block_rows;

/// Rows `first .. first + rows` of a table, in a buffer of their own.
pub(super) struct VocabBlock {
    /// First row (token id) of the block.
    pub(super) first: usize,
    /// Rows in the block.
    pub(super) rows: usize,
    /// `[rows][hidden]`, f32 or f16.
    pub(super) table: Tensor,
}

/// A table as blocks of rows, in order, covering every row once.
pub(super) struct VocabTable {
    blocks: Vec<VocabBlock>,
}

impl VocabTable {
    /// Uploads `data` (`[vocab][hidden]` f32) as `dtype`, in blocks of the most rows that fit
    /// one binding on `gpu`. Blocks are named `what` when there is one, `what.block{i}` else.
    pub(super) fn upload(
        gpu: &Gpu,
        what: &str,
        data: &[f32],
        (vocab, hidden): (usize, usize),
        dtype: DType,
    ) -> Result<Self> {
        if data.len() != vocab * hidden || vocab == 0 {
            return Err(WgparError::Shape {
                op: format!("upload {what}"),
                detail: format!(
                    "{} values for a table of {vocab} rows of {hidden}",
                    data.len()
                ),
            });
        }
        let info = gpu.info();
        let limit = info.max_storage_binding.min(info.max_buffer_size);
        let row_bytes = (hidden * dtype.size()) as u64;
        let per_block = vocab_block_rows(vocab, row_bytes, limit);
        if per_block == 0 {
            // The upload's own size check names the row, both numbers and the adapter.
            gpu.check_size(&format!("one row of {what}"), row_bytes)?;
        }
        let per_block = per_block.max(1);
        let count = vocab.div_ceil(per_block);
        let blocks = (0..count)
            .map(|i| {
                let first = i * per_block;
                let rows = per_block.min(vocab - first);
                let name = if count == 1 {
                    what.to_string()
                } else {
                    format!("{what}.block{i}")
                };
                let part = &data[first * hidden..(first + rows) * hidden];
                Ok(VocabBlock {
                    first,
                    rows,
                    table: gpu.upload_weights(&name, part, dtype)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { blocks })
    }

    /// The blocks, in row order.
    pub(super) fn blocks(&self) -> &[VocabBlock] {
        &self.blocks
    }
}
