//! What a device will allocate for its part of a model, known from the config alone: the
//! engines' buffers (weights, KV cache, activations, logits) listed with their sizes, so that a
//! run is refused in milliseconds, before any weight is built or device opened, when one of them
//! exceeds an adapter's buffer or storage-binding limit, or when the host cannot hold the
//! weights.

use crate::device::{AdapterDesc, DType};
use crate::error::{Result, WgparError};
use crate::model::{ModelConfig, Placement};

/// One buffer a device will allocate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buffer {
    /// What it holds, named as the upload names it (e.g. `wte`, `layer0.w_up`, `act.logits`).
    pub what: String,
    /// Bytes, before the 4-byte padding of a copy.
    pub bytes: u64,
    /// For a `[vocab][hidden]` table (token embedding, LM head), the bytes of one row: such a
    /// table is split by rows into blocks that each fit a binding
    /// ([`vocab_block_rows`]), so only a row has to fit. `None` for every other buffer.
    pub row_bytes: Option<u64>,
}

fn buffer(what: impl Into<String>, elements: u64, width: u64) -> Buffer {
    Buffer {
        what: what.into(),
        bytes: elements.saturating_mul(width),
        row_bytes: None,
    }
}

fn vocab_table(what: &str, config: &ModelConfig, width: u64) -> Buffer {
    Buffer {
        row_bytes: Some(config.hidden as u64 * width),
        ..buffer(what, config.vocab as u64 * config.hidden as u64, width)
    }
}

/// Rows of a `[rows][row_bytes / width]` table that one block holds when each block must fit
/// `limit` bytes (an adapter's storage-binding or buffer limit): all of them when the table
/// fits, else as many as fit, rounded down to a multiple of 64 where that leaves any (whole
/// matmul tiles). 0 when not even one row fits.
pub fn vocab_block_rows(rows: usize, row_bytes: u64, limit: u64) -> usize {
    // Blocks are padded to 4 bytes; a limit that is a multiple of 4 keeps a padded block in it.
    let limit = limit / 4 * 4;
    if row_bytes == 0 || (rows as u64).saturating_mul(row_bytes) <= limit {
        return rows;
    }
    let fit = (limit / row_bytes) as usize;
    if fit >= 64 {
        fit / 64 * 64
    } else {
        fit
    }
}

/// The buffers one device allocates for `placement` of `config` with weights stored as
/// `dtype`, activations for steps of up to `tokens` new tokens over `batch` sequences, and one
/// KV cache for `batch` sequences. Only the largest of each kind is listed (every layer has
/// the same shapes); small vectors (norms, biases) are left out: they never bind a limit
/// before a matrix of the same layer does.
pub fn device_buffers(
    config: &ModelConfig,
    placement: &Placement,
    dtype: DType,
    tokens: usize,
    batch: usize,
) -> Vec<Buffer> {
    let w = dtype.size() as u64;
    let (h, d) = (config.hidden as u64, config.head_dim as u64);
    let s = &placement.shard;
    let (q, kv, f) = (
        s.local_heads() as u64 * d,
        s.local_kv_heads() as u64 * d,
        s.local_ffn() as u64,
    );
    let (t, b) = (tokens as u64, batch as u64);
    let mut out = Vec::new();
    if placement.embedding {
        out.push(vocab_table("wte", config, w));
        if config.learned_positions() {
            out.push(buffer("wpe", config.max_seq as u64 * h, 4));
        }
    }
    if placement.head && !config.is_encoder() && !config.tied_head {
        out.push(vocab_table("lm_head", config, w));
    }
    if placement.head && !config.is_encoder() && config.tied_head && !placement.embedding {
        // A tied head on a device without the embedding uploads the table as its head.
        out.push(vocab_table("lm_head", config, w));
    }
    if !placement.layers.is_empty() {
        let first = placement.layers.start;
        let name = |part: &str| format!("layer{first}.{part}");
        out.push(buffer(name("wq"), q * h, w));
        out.push(buffer(name("wk"), kv * h, w));
        out.push(buffer(name("wo"), h * q, w));
        out.push(buffer(name("w_up"), f * h, w));
        out.push(buffer(name("w_down"), h * f, w));
        out.push(buffer(
            name("k_cache"),
            b * s.local_kv_heads() as u64 * config.max_seq as u64 * d,
            4,
        ));
        if config.arch == crate::model::Arch::Llama {
            out.push(buffer("rope.cos", config.max_seq as u64 * d / 2, 4));
        }
    }
    out.push(buffer("act.x", t * h, 4));
    out.push(buffer("act.q", t * q, 4));
    out.push(buffer("act.up", t * f, 4));
    if placement.head && !config.is_encoder() {
        out.push(buffer("act.logits", b * config.vocab as u64, 4));
    }
    out
}

/// Checks every buffer against `adapter`'s limits; the error names the buffer, both numbers and
/// what to change. A vocabulary table is checked by its row: it is split into blocks that fit.
pub fn check_buffers(buffers: &[Buffer], adapter: &AdapterDesc, device: &str) -> Result<()> {
    for b in buffers {
        let (limit, kind) = if adapter.max_storage_binding < adapter.max_buffer_size {
            (adapter.max_storage_binding, "storage binding")
        } else {
            (adapter.max_buffer_size, "buffer")
        };
        let (what, bytes) = match b.row_bytes {
            Some(row) => (format!("{device}'s {} (one row)", b.what), row),
            None => (format!("{device}'s {}", b.what), b.bytes),
        };
        let bytes = bytes.div_ceil(4) * 4;
        if bytes > limit {
            return Err(WgparError::TooLarge {
                what,
                bytes,
                limit,
                kind,
                adapter: adapter.label(),
            });
        }
    }
    Ok(())
}

/// Bytes of memory the host has available now (Linux `MemAvailable`), if known.
pub fn host_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Refuses to build `config`'s f32 weights in host memory when they would not fit in what the
/// host has available (`available`, from [`host_available_bytes`]).
pub fn check_host_weights(config: &ModelConfig, available: Option<u64>) -> Result<()> {
    let needed = (config.params() as u64).saturating_mul(4);
    match available {
        Some(avail) if needed > avail => Err(WgparError::limit(
            "host memory (bytes)",
            (needed, avail),
            format!(
            "model '{}' has {:.2}B parameters: its f32 weights need {} of host memory, but only \
             {} is available; pick a smaller model, or free memory",
            config.name,
            config.params() as f64 / 1e9,
            crate::error::human_bytes(needed),
            crate::error::human_bytes(avail)
        ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ShardSpec;

    fn adapter(limit: u64) -> AdapterDesc {
        AdapterDesc {
            index: 0,
            name: "test".into(),
            vendor: 0,
            backend: "Vulkan".into(),
            device_type: "Cpu".into(),
            driver: String::new(),
            driver_info: String::new(),
            max_buffer_size: limit * 2,
            max_storage_binding: limit,
            max_storage_buffers_per_stage: 8,
            max_workgroups_per_dimension: 65_535,
            shader_f16: false,
            timestamp_query: false,
            subgroup: false,
            subgroup_size: (0, 0),
        }
    }

    #[test]
    fn llama_1b_embedding_is_split_to_fit_a_128_mib_binding() {
        let c = ModelConfig::preset("llama-1b").unwrap();
        let bufs = device_buffers(&c, &Placement::whole(&c), DType::F32, 64, 1);
        let wte = bufs.iter().find(|b| b.what == "wte").unwrap();
        assert_eq!(wte.bytes, 128_256 * 2048 * 4);
        assert_eq!(wte.row_bytes, Some(2048 * 4));
        check_buffers(&bufs, &adapter(128 << 20), "gpu0").unwrap();
        // 16384 rows of 8 KiB per 128 MiB block: 7 full blocks and one of 13568 rows.
        assert_eq!(vocab_block_rows(128_256, 2048 * 4, 128 << 20), 16_384);
        // A binding smaller than one row cannot hold the table at all.
        let e = check_buffers(&bufs, &adapter(4 << 10), "gpu0").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("wte (one row)") && text.contains("8.0 KiB"),
            "{text}"
        );
    }

    #[test]
    fn vocab_blocks_are_whole_tiles_where_they_can_be() {
        // Fits: one block of every row, whatever the count.
        assert_eq!(vocab_block_rows(411, 384, 1 << 20), 411);
        // 163840 / 384 = 426 rows fit, rounded down to 384 (6 x 64).
        assert_eq!(vocab_block_rows(2053, 384, 160 << 10), 384);
        // Fewer than 64 rows fit: as many as fit.
        assert_eq!(vocab_block_rows(2053, 384, 20_000), 52);
        assert_eq!(vocab_block_rows(2053, 384, 300), 0);
        // A limit that is not a multiple of 4 is used as the multiple of 4 below it.
        assert_eq!(vocab_block_rows(10, 4, 39), 9);
    }

    #[test]
    fn tensor_parallel_shards_shrink_the_layer_matrices() {
        let c = ModelConfig::preset("default").unwrap();
        let shards = ShardSpec::tensor_parallel(&c, &[1, 1]).unwrap();
        let placement = Placement {
            shard: shards[1].clone(),
            head: false,
            ..Placement::whole(&c)
        };
        let bufs = device_buffers(&c, &placement, DType::F16, 8, 2);
        let up = bufs.iter().find(|b| b.what == "layer0.w_up").unwrap();
        assert_eq!(up.bytes, (c.ffn / 2 * c.hidden * 2) as u64);
        assert!(!bufs.iter().any(|b| b.what == "act.logits"));
        check_buffers(&bufs, &adapter(128 << 20), "gpu1").unwrap();
    }

    #[test]
    fn host_check_refuses_what_does_not_fit() {
        let c = ModelConfig::preset("llama-8b").unwrap();
        let e = check_host_weights(&c, Some(24 << 30))
            .unwrap_err()
            .to_string();
        assert!(e.contains("llama-8b") && e.contains("24.0 GiB"), "{e}");
        check_host_weights(&c, None).unwrap();
        check_host_weights(&ModelConfig::preset("tiny-llama").unwrap(), Some(1 << 30)).unwrap();
    }
}
