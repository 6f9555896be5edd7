//! A `[vocab][hidden]` table on a device (the token embedding, the LM head), split by rows into
//! blocks that each fit the adapter's storage-binding limit. Many adapters bind at most
//! 128 MiB (lavapipe, GL drivers, WebGPU's default), less than the embedding of GPT-2 small in
//! f32 (147 MiB) or of a Llama 3 model; a table that fits stays one block, bound as before.
//! A table a GGUF file stores in blocks the kernels read stays in those blocks, split the same
//! way by whole rows of blocks.

use super::matrix::DeviceMatrix;
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::kernels::quant::PackedMatrix;
use crate::model::budget::vocab_block_rows;
use crate::model::weights::BlockMatrix;

/// Rows `first .. first + rows` of a table, in a buffer of their own.
pub(super) struct VocabBlock {
    /// First row (token id) of the block.
    pub(super) first: usize,
    /// Rows in the block.
    pub(super) rows: usize,
    /// `[rows][hidden]`: f32 or f16 values, or the file's blocks.
    pub(super) table: DeviceMatrix,
}

/// A table as blocks of rows, in order, covering every row once.
pub(super) struct VocabTable {
    blocks: Vec<VocabBlock>,
}

/// Where a table's values come from: dense f32, or a file's blocks (which win when held).
#[derive(Clone, Copy)]
pub(super) struct TableSource<'a> {
    /// `[vocab][hidden]` f32, empty when the table is held in blocks alone.
    pub(super) dense: &'a [f32],
    /// The file's blocks, when kept.
    pub(super) blocks: Option<&'a BlockMatrix>,
}

impl TableSource<'_> {
    /// Bytes of one row as stored on the device in `dtype` (dense) or the blocks' type.
    fn row_bytes(&self, hidden: usize, dtype: DType) -> u64 {
        match self.blocks {
            Some(b) => b.row_bytes() as u64,
            None => (hidden * dtype.size()) as u64,
        }
    }

    /// Whether it holds `vocab` rows of `hidden` values.
    fn has_shape(&self, (vocab, hidden): (usize, usize)) -> bool {
        let rows = match self.blocks {
            Some(b) => b.rows == vocab && b.cols == hidden,
            None => self.dense.len() == vocab * hidden,
        };
        rows && vocab > 0
    }

    /// Rows `first .. first + rows` uploaded as one buffer named `name`.
    fn upload_rows(
        &self,
        gpu: &Gpu,
        name: &str,
        (first, rows, hidden): (usize, usize, usize),
        dtype: DType,
    ) -> Result<DeviceMatrix> {
        match self.blocks {
            Some(b) => {
                let bytes = b.row_run(first..first + rows);
                PackedMatrix::upload(gpu, name, b.dtype, bytes, (rows, hidden))
                    .map(DeviceMatrix::Packed)
            }
            None => {
                let part = &self.dense[first * hidden..(first + rows) * hidden];
                gpu.upload_weights(name, part, dtype)
                    .map(DeviceMatrix::Dense)
            }
        }
    }
}

impl VocabTable {
    /// Uploads `source` (`[vocab][hidden]`) as `dtype`, or as its blocks, in blocks of the most
    /// rows that fit one binding on `gpu`. Blocks are named `what` when there is one,
    /// `what.block{i}` else.
    pub(super) fn upload(
        gpu: &Gpu,
        what: &str,
        source: TableSource<'_>,
        (vocab, hidden): (usize, usize),
        dtype: DType,
    ) -> Result<Self> {
        if !source.has_shape((vocab, hidden)) {
            let held = match source.blocks {
                Some(b) => format!("{} rows of {} values in blocks", b.rows, b.cols),
                None => format!("{} values", source.dense.len()),
            };
            return Err(WgparError::Shape {
                op: format!("upload {what}"),
                detail: format!("{held} for a table of {vocab} rows of {hidden}"),
            });
        }
        let info = gpu.info();
        let limit = info.max_storage_binding.min(info.max_buffer_size);
        let row_bytes = source.row_bytes(hidden, dtype);
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
                Ok(VocabBlock {
                    first,
                    rows,
                    table: source.upload_rows(gpu, &name, (first, rows, hidden), dtype)?,
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
