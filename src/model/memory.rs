//! Device memory, accounted per device before anything is allocated: the weights (dense in
//! `--dtype`, or packed blocks per tensor as [`crate::model::GpuModel::upload`] stores them),
//! the KV cache (in its own element type), the activation sets the engine makes, the logits,
//! and the host-mapped readback and communication staging buffers. `run`, `plan`, `compare`
//! and `--gpu-memory` all read this one accounting.
//!
//! Weights, KV cache, activations and logits are storage tensors, which
//! [`crate::device::Gpu::bytes_live`] counts: [`DeviceBytes::tensors`] predicts that
//! count. Readback and staging buffers are mapped buffers wgpu makes outside it; they are
//! estimated from the engines' pools and listed beside it.

use std::collections::BTreeSet;

use crate::device::DType;
use crate::error::{human_bytes, Result, WgparError};
use crate::model::budget::vocab_block_rows;
use crate::model::gguf::GgufFile;
use crate::model::quant::QuantType;
use crate::model::{Arch, ModelConfig, ModelWeights, Placement};
use crate::parallel::{split_groups, PartitionSpec, Strategy};

/// Bytes one device holds, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceBytes {
    /// Weights: matrices, tables and vectors.
    pub weights: u64,
    /// KV caches.
    pub kv_cache: u64,
    /// Activation sets (without their logits).
    pub activations: u64,
    /// Logits of the last stage's activation sets.
    pub logits: u64,
    /// Host-mapped buffers the picks are read back through (estimated).
    pub readback: u64,
    /// Host-mapped communication staging of all-reduces and hand-offs (estimated).
    pub staging: u64,
}

impl DeviceBytes {
    /// The storage tensors: what [`crate::device::Gpu::bytes_live`] counts.
    pub fn tensors(&self) -> u64 {
        self.weights + self.kv_cache + self.activations + self.logits
    }

    /// Everything the device holds for the run.
    pub fn total(&self) -> u64 {
        self.tensors() + self.readback + self.staging
    }

    /// Each kind with its name, in a fixed order.
    pub fn parts(&self) -> [(&'static str, u64); 6] {
        [
            ("weights", self.weights),
            ("KV cache", self.kv_cache),
            ("activations", self.activations),
            ("logits", self.logits),
            ("readback", self.readback),
            ("staging", self.staging),
        ]
    }

    /// `weights 1.0 MiB, KV cache 2.0 MiB, ...` (kinds of zero bytes left out).
    pub fn describe(&self) -> String {
        let parts: Vec<String> = (self.parts().iter())
            .filter(|(_, b)| *b > 0)
            .map(|(what, b)| format!("{what} {}", human_bytes(*b)))
            .collect();
        parts.join(", ")
    }
}

/// The projection matrices of a layer, in [`crate::model::weights::LayerBlocks`]'s order.
const MATRICES: [&str; 7] = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"];

/// The block type each layer matrix and vocabulary table has in its source (a GGUF file's
/// block-type tensors), where the device keeps those blocks; `None` for a dense
/// one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileBlocks {
    layers: Vec<[Option<QuantType>; 7]>,
    /// The token embedding's blocks.
    pub wte: Option<QuantType>,
    /// An untied LM head's blocks.
    pub lm_head: Option<QuantType>,
}

impl FileBlocks {
    /// Every matrix dense (presets, safetensors folders).
    pub fn none() -> Self {
        Self::default()
    }

    /// The blocks loaded weights keep.
    pub fn of_weights(w: &ModelWeights) -> Self {
        let layers = (w.layers.iter())
            .map(|l| {
                let mut types = [None; 7];
                for (name, m) in l.blocks.iter() {
                    if let Some(i) = MATRICES.iter().position(|n| *n == name) {
                        types[i] = Some(m.dtype);
                    }
                }
                types
            })
            .collect();
        Self {
            layers,
            wte: w.tables.wte.as_ref().map(|m| m.dtype),
            lm_head: w.tables.lm_head.as_ref().map(|m| m.dtype),
        }
    }

    /// The blocks a GGUF file's layers and tables hold, read from its tensor index alone (no
    /// tensor is read): what [`crate::model::gguf::weights`] keeps when it loads them.
    pub fn of_gguf(file: &GgufFile, config: &ModelConfig) -> Self {
        let kept = |name: String| match file.tensor(&name).map(|t| t.dtype) {
            Some(t) if t.is_quantized() => Some(t),
            _ => None,
        };
        let layers = (0..config.layers)
            .map(|i| {
                let n = |part: &str| kept(format!("blk.{i}.{part}.weight"));
                // GPT-2 files fuse Q, K and V into one tensor, whose rows each takes.
                let (q, k, v) = match config.arch {
                    Arch::Gpt2 => (n("attn_qkv"), n("attn_qkv"), n("attn_qkv")),
                    _ => (n("attn_q"), n("attn_k"), n("attn_v")),
                };
                let gate = (config.arch == Arch::Llama)
                    .then(|| n("ffn_gate"))
                    .flatten();
                [q, k, v, n("attn_output"), gate, n("ffn_up"), n("ffn_down")]
            })
            .collect();
        Self {
            layers,
            wte: kept("token_embd.weight".into()),
            lm_head: kept("output.weight".into()),
        }
    }

    fn get(&self, layer: usize, matrix: usize) -> Option<QuantType> {
        self.layers.get(layer).and_then(|l| l[matrix])
    }

    /// The distinct block types the layers hold, in a fixed order.
    pub fn types(&self) -> Vec<QuantType> {
        let mut seen: Vec<QuantType> = self.layers.iter().flatten().flatten().copied().collect();
        seen.sort_by_key(|t| t.ggml_id());
        seen.dedup();
        seen
    }
}

/// The small tensors a model has beside its matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vectors {
    /// Q, K and V biases (GPT-2, BERT, Qwen2).
    pub qkv_bias: bool,
    /// Attention output and MLP biases, LayerNorm shifts (GPT-2, BERT).
    pub other_biases: bool,
    /// The LM head is the token embedding.
    pub tied_head: bool,
}

impl Vectors {
    /// As the family of `config` has them (GPT-2 and BERT biased, Llama not).
    pub fn of(config: &ModelConfig) -> Self {
        let biased = config.arch != Arch::Llama;
        Self {
            qkv_bias: biased,
            other_biases: biased,
            tied_head: config.tied_head,
        }
    }

    /// As loaded weights have them.
    pub fn of_weights(w: &ModelWeights) -> Self {
        let first = w.layers.first();
        Self {
            qkv_bias: first.is_some_and(|l| l.bq.is_some()),
            other_biases: first.is_some_and(|l| l.bo.is_some()),
            tied_head: w.lm_head.is_none(),
        }
    }

    /// As a GGUF file's tensor index has them.
    pub fn of_gguf(file: &GgufFile) -> Self {
        let has = |name: &str| file.tensor(name).is_some();
        Self {
            qkv_bias: has("blk.0.attn_q.bias") || has("blk.0.attn_qkv.bias"),
            other_biases: has("blk.0.attn_output.bias"),
            tied_head: !has("output.weight"),
        }
    }
}

/// How a model's weights are stored on the devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightFormat {
    /// Dense weights (`--dtype`): tables and the matrices not in blocks.
    pub dense: DType,
    /// `--weights`: the block type the layer matrices are packed in.
    pub packed: Option<QuantType>,
    /// The blocks the source holds, kept where `packed` is unset or the same type.
    pub blocks: FileBlocks,
    /// Biases and the tied head.
    pub vectors: Vectors,
}

impl WeightFormat {
    /// Dense weights of `config`'s family in `dense`, packed as `packed` if given.
    pub fn of_config(config: &ModelConfig, dense: DType, packed: Option<QuantType>) -> Self {
        Self {
            dense,
            packed,
            blocks: FileBlocks::none(),
            vectors: Vectors::of(config),
        }
    }

    /// Exactly as `w` will be uploaded with dense weights in `dense`.
    pub fn of_weights(w: &ModelWeights, dense: DType) -> Self {
        Self {
            dense,
            packed: w.packed,
            blocks: FileBlocks::of_weights(w),
            vectors: Vectors::of_weights(w),
        }
    }

    /// Bytes of one row of the LM head's table (the embedding's when tied) on a device.
    fn head_row_bytes(&self, hidden: usize) -> u64 {
        let t = match self.vectors.tied_head {
            true => self.blocks.wte,
            false => self.blocks.lm_head,
        };
        table_row_bytes(hidden, t, self.dense)
    }

    /// The block type matrix `m` of layer `layer` is stored in, `None` for dense: the file's
    /// own blocks when kept, else `--weights`'s type.
    fn matrix_type(&self, layer: usize, m: usize) -> Option<QuantType> {
        match (self.blocks.get(layer, m), self.packed) {
            (Some(b), None) => Some(b),
            (Some(b), Some(p)) if b == p => Some(b),
            (_, p) => p,
        }
    }
}

/// The work a run does: what sizes its activation sets and caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Sequences in a batch.
    pub batch: usize,
    /// Prompt tokens per sequence (the prefill step's length).
    pub prompt: usize,
}

/// What the accounting needs besides the strategy.
#[derive(Debug, Clone)]
pub struct MemorySpec<'a> {
    /// The model's shapes (its `max_seq` sizes the KV cache and position tables).
    pub config: &'a ModelConfig,
    /// How the weights are stored.
    pub format: &'a WeightFormat,
    /// Per device, the KV cache's element type (`--kv-dtype auto` can differ between
    /// adapters); devices past the end of the list take the last, an empty list means f32.
    pub kv_dtypes: &'a [DType],
    /// The run's work.
    pub work: Workload,
    /// Per device, the bytes one binding may hold (splits the vocabulary tables); devices
    /// past the end of the list take the last, an empty list means no limit.
    pub binding_limits: &'a [u64],
}

/// The bytes `len` elements of `width` bytes take in a storage buffer (padded to 4 bytes, at
/// least one element), as [`crate::device::Gpu`] allocates them.
fn padded(len: usize, width: usize) -> u64 {
    ((len.max(1) * width) as u64).div_ceil(4) * 4
}

/// Bytes of a `[rows][cols]` layer matrix stored as `t` (packed) or dense in `dense`.
fn matrix_bytes(rows: usize, cols: usize, t: Option<QuantType>, dense: DType) -> u64 {
    match t.and_then(|t| t.row_bytes(cols)) {
        Some(row) => padded(rows * row, 1),
        None => padded(rows * cols, dense.size()),
    }
}

/// Bytes of one row of a `[vocab][hidden]` table: in its blocks `t`, or dense in `dense`.
fn table_row_bytes(hidden: usize, t: Option<QuantType>, dense: DType) -> u64 {
    match t.and_then(|t| t.row_bytes(hidden)) {
        Some(row) => row as u64,
        None => (hidden * dense.size()) as u64,
    }
}

/// Bytes of a `[vocab][hidden]` table of rows of `row` bytes, split into blocks of rows that
/// fit `limit` (as the upload splits it, each block padded to 4 bytes).
fn table_bytes(vocab: usize, row: u64, limit: u64) -> u64 {
    let per = vocab_block_rows(vocab, row, limit).max(1);
    let (full, rest) = (vocab / per, vocab % per);
    let block = |rows: usize| padded(rows * row as usize, 1);
    full as u64 * block(per) + if rest > 0 { block(rest) } else { 0 }
}

/// Bytes of layer `i`'s weights on a device holding `placement`.
fn layer_bytes(
    config: &ModelConfig,
    placement: &Placement,
    format: &WeightFormat,
    i: usize,
) -> u64 {
    let s = &placement.shard;
    let (h, d, v) = (config.hidden, config.head_dim, &format.vectors);
    let (q, kv, f) = (s.local_heads() * d, s.local_kv_heads() * d, s.local_ffn());
    let m = |idx: usize, rows: usize, cols: usize| {
        matrix_bytes(rows, cols, format.matrix_type(i, idx), format.dense)
    };
    let vec = |present: bool, len: usize| if present { padded(len, 4) } else { 0 };
    let gate = if config.arch == Arch::Llama {
        m(4, f, h)
    } else {
        0
    };
    // Qwen3's query and key norm scales, whole on every shard.
    let qk_norms = if config.qk_norm { 2 * padded(d, 4) } else { 0 };
    // Gemma's block output norms, whole on every shard.
    let out_norms = if config.sandwich_norms {
        2 * padded(h, 4)
    } else {
        0
    };
    m(0, q, h)
        + m(1, kv, h)
        + m(2, kv, h)
        + m(3, h, q)
        + gate
        + m(5, f, h)
        + m(6, h, f)
        + 2 * padded(h, 4)
        + qk_norms
        + out_norms
        + vec(v.other_biases, h) * 2
        + vec(v.qkv_bias, q)
        + 2 * vec(v.qkv_bias, kv)
        + vec(v.other_biases, h)
        + vec(v.other_biases, f)
        + vec(v.other_biases, h)
}

/// Bytes of the weights a device holding `placement` uploads; `limit`: its binding limit.
pub fn weight_bytes(
    config: &ModelConfig,
    placement: &Placement,
    format: &WeightFormat,
    limit: u64,
) -> u64 {
    let h = config.hidden;
    let layers: u64 = (placement.layers.clone())
        .map(|i| layer_bytes(config, placement, format, i))
        .sum();
    let decoder_head = placement.head && !config.is_encoder();
    let tied = format.vectors.tied_head;
    let table = |t: Option<QuantType>| {
        table_bytes(config.vocab, table_row_bytes(h, t, format.dense), limit)
    };
    let mut bytes = layers;
    if placement.embedding || (decoder_head && tied) {
        bytes += table(format.blocks.wte);
    }
    if placement.embedding && config.learned_positions() {
        bytes += padded(config.max_seq * h, 4);
    }
    if placement.embedding && config.is_encoder() {
        bytes += padded(config.type_vocab * h, 4) + 2 * padded(h, 4);
    }
    if decoder_head {
        let shift = if format.vectors.other_biases {
            padded(h, 4)
        } else {
            0
        };
        bytes += padded(h, 4)
            + shift
            + if tied {
                0
            } else {
                table(format.blocks.lm_head)
            };
    }
    let rope_tables = 2 * padded(config.max_seq * config.rope_dim() / 2, 4);
    if config.arch == Arch::Llama && !placement.layers.is_empty() {
        bytes += rope_tables;
    }
    // The sliding layers' own tables, where the device holds one (Gemma 3).
    if placement
        .layers
        .clone()
        .any(|i| config.layer_window(i).is_some())
    {
        bytes += rope_tables;
    }
    bytes
}

/// Bytes of one KV cache of `slots` sequences on a device holding `placement`, its elements
/// `kv_dtype`: each layer's keys and values over the positions it caches
/// ([`ModelConfig::cached_positions`]: a sliding-window layer only its ring).
pub fn kv_cache_bytes(
    config: &ModelConfig,
    placement: &Placement,
    slots: usize,
    kv_dtype: DType,
) -> u64 {
    (placement.layers.clone())
        .map(|i| {
            let rows = config.cached_positions(i);
            let len = slots * placement.shard.local_kv_heads() * rows * config.head_dim;
            2 * padded(len, kv_dtype.size())
        })
        .sum()
}

/// One activation set for `tokens` tokens of `batch` sequences on a device holding
/// `placement`: (activations, logits, readback) bytes, as
/// [`crate::model::GpuModel::activations`] allocates them; `limit`: the binding limit (a split
/// LM head writes its blocks' logits apart first).
fn activation_set(
    config: &ModelConfig,
    placement: &Placement,
    (tokens, batch): (usize, usize),
    (head_row, limit): (u64, u64),
) -> (u64, u64, u64) {
    let batch = batch.max(1);
    let t = tokens.max(batch).div_ceil(batch) * batch;
    let s = &placement.shard;
    let (h, d) = (config.hidden, config.head_dim);
    let (q, kv, f) = (s.local_heads() * d, s.local_kv_heads() * d, s.local_ffn());
    let f32s = |len: usize| padded(len, 4);
    let mut act = 4 * f32s(t * h) + 2 * f32s(t * q) + 2 * f32s(t * kv) + 2 * f32s(t * f);
    // lens, seqs, ids, types, last, last_norm, unused.
    act += f32s(batch) + f32s(2 * batch) + 2 * f32s(t) + 2 * f32s(batch * h) + f32s(1);
    let decoder_head = placement.head && !config.is_encoder();
    if placement.head && config.is_encoder() {
        act += f32s(batch * h);
    }
    if !decoder_head {
        return (act, 0, 0);
    }
    // draws, picks, the picks' allow bit sets and logit adjustments.
    act += f32s(batch) + f32s(2 * batch);
    act += f32s(batch * crate::kernels::ops::allow_words(config.vocab));
    act += f32s(crate::kernels::ops::adjust_words(batch));
    let rows = vocab_block_rows(config.vocab, head_row, limit).max(1);
    let mut logits = f32s(batch * config.vocab);
    if rows < config.vocab {
        let (full, rest) = (config.vocab / rows, config.vocab % rows);
        logits += full as u64 * f32s(batch * rows);
        logits += if rest > 0 { f32s(batch * rest) } else { 0 };
    }
    (act, logits, padded(2 * batch, 4))
}

/// The activation sets (tokens, sequences) and KV caches (slots) an engine makes on each of
/// its devices for `work`: the single engine one set grown to the prefill; tensor
/// parallelism one per step shape (each prefill chunk's, see
/// [`crate::parallel::prefill_chunks`], and decode); a pipeline one per shape of each
/// micro-batch and a cache per micro-batch.
fn engine_sets(
    config: &ModelConfig,
    strategy: &Strategy,
    work: &Workload,
) -> (BTreeSet<(usize, usize)>, Vec<usize>) {
    let (b, p) = (work.batch.max(1), work.prompt.max(1));
    let chunks: BTreeSet<usize> = (crate::parallel::prefill_chunks(config, p).iter())
        .map(|&(_, len)| len)
        .collect();
    let shapes = |g: usize| {
        let decode = std::iter::once((g, g));
        chunks.iter().map(move |&len| (g * len, g)).chain(decode)
    };
    match strategy {
        Strategy::Single => ([(b * p, b)].into(), vec![b]),
        Strategy::Tensor { .. } => (shapes(b).collect(), vec![b]),
        Strategy::Pipeline { micro_batches, .. } | Strategy::Hybrid { micro_batches, .. } => {
            let groups: Vec<usize> = (split_groups(b, *micro_batches).iter())
                .map(|g| g.len())
                .collect();
            let sets = groups.iter().flat_map(|&g| shapes(g)).collect();
            (sets, groups)
        }
    }
}

/// Stages of a pipeline's hand-offs held per activation shape (pp's `HANDOFF_DEPTH`).
const HANDOFF_DEPTH: u64 = 3;

/// Host-mapped staging a device holds for `sets`: a tensor-parallel rank one download and one
/// upload of the stream per step shape; a pipeline stage that hands off, `HANDOFF_DEPTH`
/// downloads, and one that receives, an upload.
fn staging_bytes(
    config: &ModelConfig,
    placement: &Placement,
    sets: &BTreeSet<(usize, usize)>,
    last_stage: bool,
) -> u64 {
    let stream = |t: usize| padded(t * config.hidden, 4);
    let mut per_set = 0;
    if placement.shard.world > 1 {
        per_set += 2;
    }
    let pipelined = !(placement.embedding && last_stage);
    if pipelined && !last_stage {
        per_set += HANDOFF_DEPTH;
    }
    if pipelined && !placement.embedding {
        per_set += 1;
    }
    sets.iter().map(|&(t, _)| per_set * stream(t)).sum()
}

/// What each device `strategy` uses of `devices` selected ones holds for `spec`, in the
/// strategy's device order (stage-major for a pipeline).
pub fn per_device(
    strategy: &Strategy,
    devices: usize,
    spec: &MemorySpec<'_>,
) -> Result<Vec<DeviceBytes>> {
    let config = spec.config;
    let placements = strategy.placements(config, strategy.devices_used(devices))?;
    let (sets, caches) = engine_sets(config, strategy, &spec.work);
    let limit = |i: usize| {
        let l = spec.binding_limits;
        l.get(i).or(l.last()).copied().unwrap_or(u64::MAX)
    };
    let kv = |i: usize| {
        let k = spec.kv_dtypes;
        k.get(i).or(k.last()).copied().unwrap_or(DType::F32)
    };
    let last_stage_start = placements.iter().rposition(|p| p.shard.rank == 0);
    let head_row = spec.format.head_row_bytes(config.hidden);
    Ok((placements.iter().enumerate())
        .map(|(i, placement)| {
            let mut bytes = DeviceBytes {
                weights: weight_bytes(config, placement, spec.format, limit(i)),
                ..DeviceBytes::default()
            };
            bytes.kv_cache = (caches.iter())
                .map(|&slots| kv_cache_bytes(config, placement, slots, kv(i)))
                .sum();
            for &set in &sets {
                let (a, l, r) = activation_set(config, placement, set, (head_row, limit(i)));
                bytes.activations += a;
                bytes.logits += l;
                bytes.readback += r;
            }
            let last_stage = last_stage_start.is_some_and(|s| i >= s);
            bytes.staging = staging_bytes(config, placement, &sets, last_stage);
            bytes
        })
        .collect())
}

/// `strategy` (a pipeline or hybrid) with its stages holding `counts` layers.
fn with_layers(strategy: &Strategy, counts: Vec<usize>) -> Strategy {
    let mut s = strategy.clone();
    if let Strategy::Pipeline { partition, .. } | Strategy::Hybrid { partition, .. } = &mut s {
        *partition = PartitionSpec::Explicit(counts);
    }
    s
}

/// Whether every device of stage `stage` (of `tp` devices each) fits its cap.
fn stage_fits(bytes: &[DeviceBytes], caps: &[u64], stage: usize, tp: usize) -> bool {
    (stage * tp..(stage + 1) * tp)
        .all(|d| bytes.get(d).map(DeviceBytes::total) <= caps.get(d).copied())
}

/// Refuses, before anything is opened, a tensor-parallel split whose shards would cut the
/// blocks of a packed matrix they split by input columns (the attention output's heads, the
/// down projection's MLP columns), with the numbers: what uploading the shard would refuse
/// later, after the devices opened.
pub fn check_block_splits(
    strategy: &Strategy,
    devices: usize,
    config: &ModelConfig,
    format: &WeightFormat,
) -> Result<()> {
    let placements = strategy.placements(config, strategy.devices_used(devices))?;
    for p in placements.iter().filter(|p| p.shard.world > 1) {
        let d = config.head_dim;
        let heads = p.shard.q_heads.start * d..p.shard.q_heads.end * d;
        for layer in p.layers.clone() {
            for (matrix, name, cols) in [(3, "wo", &heads), (6, "w_down", &p.shard.ffn)] {
                let file = format.blocks.get(layer, matrix);
                // The upload keeps the file's blocks unless --weights re-packs another type.
                let Some(t) = format.packed.or(file) else {
                    continue;
                };
                let from_file = file == Some(t);
                let what = format!("layer{layer}.{name}");
                crate::model::quant::check_block_split(t, &what, cols, from_file)?;
            }
        }
    }
    Ok(())
}

/// Layer counts per pipeline stage chosen by memory (`--layers auto` with `--gpu-memory`):
/// the most layers each stage holds ([`stage_layer_limits`]), then the most even split within
/// those bounds, spare layers taken off the end stages first. A model that fits no split is
/// refused with each stage's numbers.
pub fn layers_by_memory(
    strategy: &Strategy,
    devices: usize,
    spec: &MemorySpec<'_>,
    caps: &[u64],
) -> Result<Vec<usize>> {
    let most = stage_layer_limits(strategy, devices, spec, caps)?;
    Ok(even_within(spec.config.layers, &most))
}

/// The most layers each pipeline stage's devices hold within their `caps` (the first stage
/// with the embedding, the last with the head); refused, with each stage's numbers, when
/// they cannot hold the model together.
pub fn stage_layer_limits(
    strategy: &Strategy,
    devices: usize,
    spec: &MemorySpec<'_>,
    caps: &[u64],
) -> Result<Vec<usize>> {
    let tp = match strategy {
        Strategy::Pipeline { .. } => 1,
        Strategy::Hybrid { tp, .. } => (*tp).max(1),
        _ => {
            return Err(WgparError::unsupported(
                "--layers auto applies to pp and hybrid".into(),
            ))
        }
    };
    let (layers, stages) = (spec.config.layers, devices / tp);
    if stages == 0 || stages > layers {
        return Err(WgparError::unsupported(format!(
            "{stages} pipeline stages for {layers} layers: each stage needs at least one layer"
        )));
    }
    // Stage s holding n layers, the others sharing the rest (their counts do not change s's).
    let counts_with = |s: usize, n: usize| {
        let mut c = vec![1; stages];
        c[s] = n;
        c[(s + 1) % stages] += layers - n - (stages - 1);
        c
    };
    let most = (0..stages)
        .map(|s| {
            let mut fit = 0;
            for n in 1..=layers - (stages - 1) {
                let bytes = per_device(&with_layers(strategy, counts_with(s, n)), devices, spec)?;
                if !stage_fits(&bytes, caps, s, tp) {
                    break;
                }
                fit = n;
            }
            Ok(fit)
        })
        .collect::<Result<Vec<usize>>>()?;
    if most.contains(&0) || most.iter().sum::<usize>() < layers {
        return Err(no_split(strategy, devices, spec, caps, &most));
    }
    Ok(most)
}

/// The most even counts summing to `layers` with each at most `most[s]` (which sum to at least
/// `layers`): the smallest ceiling that holds them, the excess taken off the end stages first.
pub(crate) fn even_within(layers: usize, most: &[usize]) -> Vec<usize> {
    let ceiling = (1..=layers)
        .find(|&t| most.iter().map(|&m| m.min(t)).sum::<usize>() >= layers)
        .unwrap_or(layers);
    let mut counts: Vec<usize> = most.iter().map(|&m| m.min(ceiling)).collect();
    let mut excess = counts.iter().sum::<usize>() - layers;
    let p = counts.len();
    let mut order = vec![0, p - 1];
    order.extend(1..p.saturating_sub(1));
    while excess > 0 {
        let before = excess;
        for &s in &order {
            if excess > 0 && counts[s] > 1 && counts[s] == *counts.iter().max().unwrap_or(&0) {
                counts[s] -= 1;
                excess -= 1;
            }
        }
        if before == excess {
            // Every stage at its floor of one or below the largest: take from any above one.
            if let Some(s) = order.iter().copied().find(|&s| counts[s] > 1) {
                counts[s] -= 1;
                excess -= 1;
            }
        }
    }
    counts
}

/// The refusal of [`layers_by_memory`]: each stage's most layers within its cap and what one
/// layer takes there.
fn no_split(
    strategy: &Strategy,
    devices: usize,
    spec: &MemorySpec<'_>,
    caps: &[u64],
    most: &[usize],
) -> WgparError {
    let (stages, layers) = (most.len(), spec.config.layers);
    let tp = devices / stages.max(1);
    let lines: Vec<String> = (0..stages)
        .map(|s| {
            let d = s * tp;
            // Stage s with one layer, the next holding the rest.
            let mut counts = vec![1; stages];
            counts[(s + 1) % stages] += layers - stages;
            let bytes = per_device(&with_layers(strategy, counts), devices, spec);
            let one = bytes
                .ok()
                .and_then(|b| b.get(d).copied())
                .unwrap_or_default();
            let cap = caps.get(d).copied().unwrap_or(0);
            format!(
                "stage {s} (gpu{d}) holds at most {} layers in its {} cap (one layer: {}, {})",
                most[s],
                human_bytes(cap),
                human_bytes(one.total()),
                one.describe()
            )
        })
        .collect();
    WgparError::Config(format!(
        "--layers auto: the {} layers of model '{}' fit no split over these caps: {}. Raise \
         --gpu-memory, lower --batch or --max-seq, use more devices, or --weights q8_0 / q4_k",
        spec.config.layers,
        spec.config.name,
        lines.join("; ")
    ))
}

/// Tensor-parallel shares chosen by memory (`--split auto` with `--gpu-memory`): among heads
/// in proportion to each device's cap (MiB) and, over two devices, every split of the query
/// heads, the one that leaves the fullest device the most room under its cap. Refused with
/// each device's numbers (for the proportional split) when none fits.
pub fn split_by_memory(devices: usize, spec: &MemorySpec<'_>, caps: &[u64]) -> Result<Vec<usize>> {
    let proportional: Vec<usize> = (caps.iter().take(devices))
        .map(|&c| (c >> 20).clamp(1, 1 << 20) as usize)
        .collect();
    let mut candidates = vec![proportional.clone()];
    if devices == 2 {
        let heads = spec.config.heads;
        candidates.extend((1..heads).map(|k| vec![k, heads - k]));
    }
    // The fullest device's share of its cap, for a split that fits every cap.
    let fullest = |split: &Vec<usize>| -> Option<f64> {
        let strategy = Strategy::Tensor {
            split: Some(split.clone()),
        };
        let bytes = per_device(&strategy, devices, spec).ok()?;
        let ratios = bytes
            .iter()
            .zip(caps)
            .map(|(b, &c)| b.total() as f64 / c.max(1) as f64);
        let worst = ratios.fold(0.0, f64::max);
        (worst <= 1.0).then_some(worst)
    };
    let best = (candidates.iter())
        .filter_map(|c| fullest(c).map(|r| (r, c)))
        .min_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((_, split)) = best {
        return Ok(split.clone());
    }
    let strategy = Strategy::Tensor {
        split: Some(proportional.clone()),
    };
    let bytes = per_device(&strategy, devices, spec)?;
    let lines: Vec<String> = (bytes.iter().zip(caps).enumerate())
        .map(|(i, (b, &cap))| {
            let verdict = if b.total() > cap { "over" } else { "fits" };
            format!(
                "gpu{i} needs {} of its {} cap ({verdict}): {}",
                human_bytes(b.total()),
                human_bytes(cap),
                b.describe()
            )
        })
        .collect();
    Err(WgparError::Config(format!(
        "--split auto: model '{}' fits no split of its heads over these caps (in proportion to \
         them, {proportional:?}: {}). Raise --gpu-memory, lower --batch or --max-seq, or \
         --weights q8_0 / q4_k",
        spec.config.name,
        lines.join("; ")
    )))
}

/// What a tensor-parallel split by [`split_by_speed`] rests on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitBasis {
    /// Measured speed, within each device's memory cap (even when the devices measured within
    /// [`crate::parallel::partition::EVEN_SPLIT_SLACK`] of each other).
    Speed,
    /// The split by speed would cut a packed matrix's blocks: an even split instead.
    EvenForBlocks,
    /// No split by speed fits the caps and the blocks: the split by memory
    /// ([`split_by_memory`]).
    Memory,
}

/// Query heads per device for `--split auto`, and what they rest on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadSplit {
    /// Query heads per device.
    pub heads: Vec<usize>,
    /// Why.
    pub basis: SplitBasis,
}

/// The most query heads each of `devices` devices can hold under its cap: device `i` holding
/// `h` heads while the others share the rest evenly, the largest `h` whose bytes fit cap `i`
/// (0 when none does). Without caps, every head less one for each other device.
pub fn head_limits(devices: usize, spec: &MemorySpec<'_>, caps: Option<&[u64]>) -> Vec<usize> {
    let heads = spec.config.heads;
    let top = heads.saturating_sub(devices.saturating_sub(1));
    let Some(caps) = caps else {
        return vec![top; devices];
    };
    let fits = |i: usize, h: usize| {
        let mut split = vec![(heads - h) / (devices - 1).max(1); devices];
        split[i] = h;
        // The remainder goes to the first others, as a proportional split would place it.
        let left = heads - split.iter().sum::<usize>();
        for j in (0..devices).filter(|&j| j != i).take(left) {
            split[j] += 1;
        }
        let strategy = Strategy::Tensor { split: Some(split) };
        per_device(&strategy, devices, spec)
            .is_ok_and(|b| b.get(i).map(DeviceBytes::total) <= caps.get(i).copied())
    };
    (0..devices)
        .map(|i| (1..=top).rev().find(|&h| fits(i, h)).unwrap_or(0))
        .collect()
}

/// Tensor-parallel heads for `--split auto` once each device's layer time `layer_s` is
/// measured: by speed within the most heads each cap holds ([`head_limits`],
/// [`crate::parallel::partition::heads_by_speed`]), provided the split fits every cap and cuts
/// no packed matrix's blocks; else the even split where it does, else the split by memory.
pub fn split_by_speed(
    layer_s: &[f64],
    spec: &MemorySpec<'_>,
    caps: Option<&[u64]>,
) -> Result<HeadSplit> {
    let n = layer_s.len();
    let usable = |split: &[usize]| {
        let strategy = Strategy::Tensor {
            split: Some(split.to_vec()),
        };
        let fits = match caps {
            Some(caps) => per_device(&strategy, n, spec)
                .is_ok_and(|b| b.iter().zip(caps).all(|(b, &c)| b.total() <= c)),
            None => strategy.placements(spec.config, n).is_ok(),
        };
        fits && check_block_splits(&strategy, n, spec.config, spec.format).is_ok()
    };
    let most = head_limits(n, spec, caps);
    let by_speed = crate::parallel::partition::heads_by_speed(spec.config.heads, layer_s, &most);
    if let Some(heads) = by_speed.as_ref().filter(|s| usable(s)) {
        let (heads, basis) = (heads.clone(), SplitBasis::Speed);
        return Ok(HeadSplit { heads, basis });
    }
    let even = spec.config.heads / n.max(1);
    if spec.config.heads.is_multiple_of(n.max(1)) && usable(&vec![even; n]) {
        let (heads, basis) = (vec![even; n], SplitBasis::EvenForBlocks);
        return Ok(HeadSplit { heads, basis });
    }
    let Some(caps) = caps else {
        return Err(WgparError::unsupported(format!(
            "--split auto: neither the split by speed {by_speed:?} nor an even one over {n} \
             devices splits model '{}' (its packed matrices' blocks): give --split",
            spec.config.name
        )));
    };
    let heads = split_by_memory(n, spec, caps)?;
    let basis = SplitBasis::Memory;
    Ok(HeadSplit { heads, basis })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::{PartitionSpec, Schedule};

    fn spec<'a>(config: &'a ModelConfig, format: &'a WeightFormat) -> MemorySpec<'a> {
        MemorySpec {
            config,
            format,
            kv_dtypes: &[],
            work: Workload {
                batch: 2,
                prompt: 8,
            },
            binding_limits: &[],
        }
    }

    #[test]
    fn single_weights_are_the_parameters_in_the_dtype() {
        let c = ModelConfig::preset("tiny-llama").unwrap();
        let f32s = WeightFormat::of_config(&c, DType::F32, None);
        let f16s = WeightFormat::of_config(&c, DType::F16, None);
        let one = per_device(&Strategy::Single, 1, &spec(&c, &f32s)).unwrap();
        let half = per_device(&Strategy::Single, 1, &spec(&c, &f16s)).unwrap();
        assert_eq!(one.len(), 1);
        // Norms and the RoPE tables stay f32; the matrices and tables halve. `params` counts
        // four vectors per layer, of which a Llama layer has two (its norms).
        let (h, layers) = (c.hidden as u64, c.layers as u64);
        let rope = 2 * (c.max_seq * c.head_dim / 2 * 4) as u64;
        let norms = (2 * layers + 1) * h;
        let matrices = c.params() as u64 - 4 * layers * h;
        assert_eq!(one[0].weights, (matrices + norms) * 4 + rope);
        assert_eq!(half[0].weights, matrices * 2 + norms * 4 + rope);
        assert_eq!(one[0].kv_cache, half[0].kv_cache);
    }

    /// Qwen3's heads are wider than hidden / heads and each layer holds two `[head_dim]`
    /// norm scales, whole on every tensor-parallel shard.
    #[test]
    fn qwen3_weights_count_wide_heads_and_the_head_norms() {
        let c = ModelConfig::preset("tiny-qwen3").unwrap();
        assert!(c.q_dim() > c.hidden && c.qk_norm && c.tied_head);
        let f32s = WeightFormat::of_config(&c, DType::F32, None);
        let whole = Placement::whole(&c);
        let (h, d, layers) = (c.hidden, c.head_dim, c.layers);
        let rope = 2 * (c.max_seq * d / 2 * 4) as u64;
        // `params` counts four hidden-wide vectors a layer (a Llama layer has two), not the
        // final norm, and the head norms.
        let values = c.params() - 2 * layers * h + h;
        assert_eq!(
            weight_bytes(&c, &whole, &f32s, u64::MAX),
            values as u64 * 4 + rope
        );
        let without = ModelConfig {
            qk_norm: false,
            ..c.clone()
        };
        let fewer = weight_bytes(&without, &whole, &f32s, u64::MAX);
        let norms = (layers * 2 * d * 4) as u64;
        assert_eq!(weight_bytes(&c, &whole, &f32s, u64::MAX) - fewer, norms);
    }

    #[test]
    fn packed_layers_take_their_block_bytes_and_a_file_type_wins() {
        // Every matrix whole Q8_0 blocks of 32 values.
        let c = ModelConfig {
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            ffn: 256,
            ..ModelConfig::preset("tiny-llama").unwrap()
        };
        let dense = WeightFormat::of_config(&c, DType::F32, None);
        let q8 = WeightFormat::of_config(&c, DType::F32, Some(QuantType::Q8_0));
        let whole = Placement::whole(&c);
        let (d, q) = (
            weight_bytes(&c, &whole, &dense, u64::MAX),
            weight_bytes(&c, &whole, &q8, u64::MAX),
        );
        // A layer matrix of n values: 4n dense, 34n/32 in Q8_0.
        let h = c.hidden;
        let layer_values = (c.q_dim() + 2 * c.kv_dim()) * h + h * c.q_dim() + 3 * c.ffn * h;
        let saved =
            (c.layers * layer_values) as u64 * 4 - (c.layers * layer_values / 32 * 34) as u64;
        assert_eq!(d - q, saved);
        // A file whose layer 0 is Q4_0 throughout keeps those blocks without --weights.
        let mut file = dense.clone();
        file.blocks.layers = vec![[Some(QuantType::Q4_0); 7]; c.layers];
        let mut mixed = file.clone();
        mixed.blocks.layers[1] = [None; 7];
        assert!(
            weight_bytes(&c, &whole, &mixed, u64::MAX) > weight_bytes(&c, &whole, &file, u64::MAX)
        );
        assert_eq!(file.blocks.types(), vec![QuantType::Q4_0]);
    }

    #[test]
    fn the_kv_cache_halves_in_f16_and_splits_over_stages() {
        let c = ModelConfig::preset("tiny-llama").unwrap();
        let f = WeightFormat::of_config(&c, DType::F32, None);
        let mut s = spec(&c, &f);
        let pp = Strategy::Pipeline {
            partition: PartitionSpec::Even,
            micro_batches: 2,
            schedule: Schedule::default(),
        };
        let full = per_device(&Strategy::Single, 1, &s).unwrap()[0].kv_cache;
        let stages = per_device(&pp, 2, &s).unwrap();
        assert_eq!(stages.len(), 2);
        assert_eq!(stages.iter().map(|d| d.kv_cache).sum::<u64>(), full);
        s.kv_dtypes = &[DType::F16];
        assert_eq!(
            per_device(&Strategy::Single, 1, &s).unwrap()[0].kv_cache * 2,
            full
        );
        // Only the last stage holds logits; the first hands off through staging.
        assert!(stages[0].logits == 0 && stages[1].logits > 0);
        assert!(stages[0].staging > 0);
    }

    #[test]
    fn a_sliding_layer_counts_only_its_ring() {
        // Gemma 3 1B: 22 sliding layers of 1024 rows, 4 global ones of 32768 positions.
        let c = ModelConfig::gemma3_1b();
        let f = WeightFormat::of_config(&c, DType::F32, None);
        let s = spec(&c, &f);
        let per_position = 2 * 2 * (c.kv_dim() * 4) as u64;
        let want = per_position * (22 * 1024 + 4 * 32_768);
        assert_eq!(
            per_device(&Strategy::Single, 1, &s).unwrap()[0].kv_cache,
            want
        );
        // Without the window, every layer holds the whole context.
        let global = ModelConfig {
            sliding: None,
            ..c.clone()
        };
        let s = spec(&global, &f);
        let whole = per_position * 26 * 32_768;
        assert_eq!(
            per_device(&Strategy::Single, 1, &s).unwrap()[0].kv_cache,
            whole
        );
    }

    #[test]
    fn layers_auto_fills_each_stage_within_its_cap() {
        let c = ModelConfig {
            layers: 8,
            ..ModelConfig::preset("tiny-llama").unwrap()
        };
        let f = WeightFormat::of_config(&c, DType::F32, None);
        let s = spec(&c, &f);
        let pp = Strategy::Pipeline {
            partition: PartitionSpec::Even,
            micro_batches: 1,
            schedule: Schedule::default(),
        };
        // Even split under generous caps.
        assert_eq!(
            layers_by_memory(&pp, 2, &s, &[1 << 30; 2]).unwrap(),
            vec![4, 4]
        );
        // The second device's cap holds only what 2 layers and the head take.
        let two = per_device(&with_layers(&pp, vec![6, 2]), 2, &s).unwrap()[1].total();
        let counts = layers_by_memory(&pp, 2, &s, &[1 << 30, two]).unwrap();
        assert_eq!(counts, vec![6, 2]);
        let bytes = per_device(&with_layers(&pp, counts), 2, &s).unwrap();
        assert!(bytes[1].total() <= two);
        // Caps that hold less than the model: refused with each stage's numbers.
        let e = layers_by_memory(&pp, 2, &s, &[two, two])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("stage 0 (gpu0) holds at most") && e.contains("stage 1 (gpu1)"),
            "{e}"
        );
    }

    #[test]
    fn even_within_takes_spares_off_the_ends() {
        assert_eq!(even_within(8, &[8, 8]), vec![4, 4]);
        assert_eq!(even_within(9, &[8, 8, 8]), vec![3, 3, 3]);
        assert_eq!(even_within(10, &[8, 8, 8]), vec![3, 4, 3]);
        assert_eq!(even_within(8, &[2, 8]), vec![2, 6]);
        assert_eq!(even_within(3, &[1, 1, 1]), vec![1, 1, 1]);
    }

    #[test]
    fn split_auto_follows_the_caps() {
        let c = ModelConfig::preset("default").unwrap();
        let f = WeightFormat::of_config(&c, DType::F32, None);
        let s = spec(&c, &f);
        // Generous caps: a split that fits both.
        let split = split_by_memory(2, &s, &[3 << 30, 1 << 30]).unwrap();
        let tp = |split: &[usize]| Strategy::Tensor {
            split: Some(split.to_vec()),
        };
        let bytes = per_device(&tp(&split), 2, &s).unwrap();
        assert!(
            bytes[0].total() <= 3 << 30 && bytes[1].total() <= 1 << 30,
            "{split:?}"
        );
        // Caps that only an uneven split meets: rank 0 also holds the LM head.
        let even = per_device(&Strategy::Tensor { split: None }, 2, &s).unwrap();
        let caps = [even[0].total() + (10 << 20), even[1].total() - (1 << 20)];
        let split = split_by_memory(2, &s, &caps).unwrap();
        assert!(split[0] > split[1], "{split:?}");
        let e = split_by_memory(2, &s, &[1 << 20, 1 << 20])
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpu0 needs") && e.contains("(over)"), "{e}");
    }

    #[test]
    fn split_by_speed_follows_the_times_within_caps_and_blocks() {
        let c = ModelConfig::preset("default").unwrap();
        let f = WeightFormat::of_config(&c, DType::F32, None);
        let s = spec(&c, &f);
        let heads = c.heads;
        // Without caps: a device three times faster takes three quarters of the heads.
        let fast = split_by_speed(&[1.0, 3.0], &s, None).unwrap();
        assert_eq!(fast.basis, SplitBasis::Speed);
        assert_eq!(fast.heads, vec![heads * 3 / 4, heads / 4]);
        assert_eq!(head_limits(2, &s, None), vec![heads - 1; 2]);
        // A cap on the fast device bounds its heads; the split still fits both caps.
        let even = per_device(&Strategy::Tensor { split: None }, 2, &s).unwrap();
        let caps = [even[0].total() + (2 << 20), 1 << 40];
        let most = head_limits(2, &s, Some(&caps));
        assert!(most[0] < heads * 3 / 4 && most[0] >= heads / 2, "{most:?}");
        let bounded = split_by_speed(&[1.0, 3.0], &s, Some(&caps)).unwrap();
        assert_eq!(bounded.heads[0], most[0], "{bounded:?}");
        let tp = Strategy::Tensor {
            split: Some(bounded.heads.clone()),
        };
        assert!(per_device(&tp, 2, &s).unwrap()[0].total() <= caps[0]);
        // Q4_0 blocks of 32 values: the split by speed, 7 and 5 heads, gives the down
        // projection 597 and 427 of its 1024 input columns, which cut blocks; the even one
        // does not.
        let q4 = WeightFormat::of_config(&c, DType::F32, Some(QuantType::Q4_0));
        let s4 = spec(&c, &q4);
        let cut = split_by_speed(&[1.0, 1.3], &s4, None).unwrap();
        assert_eq!(cut.basis, SplitBasis::EvenForBlocks, "{cut:?}");
        assert_eq!(cut.heads, vec![heads / 2; 2]);
    }
}
