//! Whether a configuration fits: weights, KV cache and activations per device against the
//! profile's memory, before anything is timed.

use serde::Serialize;

use super::modeled::shape_of;
use crate::device::DType;
use crate::error::Result;
use crate::model::memory::{per_device, MemorySpec, WeightFormat};
use crate::model::quant::QuantType;
use crate::model::{ModelConfig, ShardSpec};
use crate::parallel::{partition, Partition, PartitionSpec, Strategy};
use crate::sim::{Engine, HostProfile, NumFormat};

/// What one device of a configuration holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceMemory {
    /// Device index in the profile.
    pub device: usize,
    /// Weights it holds, bytes.
    pub weights: u64,
    /// Its KV cache, bytes.
    pub kv_cache: u64,
    /// Activations of the largest step (and the logits on the last stage), bytes.
    pub activations: u64,
    /// The engine's own reserve, bytes.
    pub reserve: u64,
    /// Sum of the above.
    pub total: u64,
    /// What the engine may use of the device: memory size x the engine's memory fraction.
    pub capacity: u64,
}

impl DeviceMemory {
    /// Whether it fits.
    pub fn fits(&self) -> bool {
        self.total <= self.capacity
    }
}

/// The workload whose memory is counted.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Sequences.
    pub batch: usize,
    /// Prompt tokens per sequence.
    pub prompt: usize,
    /// Tokens each sequence holds at the end (prompt plus generated).
    pub context: usize,
}

/// The weights whose memory is counted: a format every engine stores them in, and for the
/// wgpar engine the runtime's own storage where it is known (a GGUF file's per-tensor types).
#[derive(Debug, Clone, Copy)]
pub struct WeightsSpec<'a> {
    /// Bytes per parameter.
    pub format: NumFormat,
    /// How the wgpar runtime stores them, per tensor; `None`: from `format`.
    pub runtime: Option<&'a WeightFormat>,
}

impl WeightsSpec<'_> {
    /// Every parameter in `format`.
    pub fn uniform(format: NumFormat) -> Self {
        Self {
            format,
            runtime: None,
        }
    }
}

/// How the wgpar runtime stores weights of `format`: dense f32 or f16, or layer matrices in
/// blocks with the tables in f16 (as on an adapter with `SHADER_F16`). `None` for a format
/// the runtime does not load.
pub fn runtime_format(config: &ModelConfig, format: NumFormat) -> Option<WeightFormat> {
    let (dense, packed) = match format {
        NumFormat::F32 => (DType::F32, None),
        NumFormat::F16 => (DType::F16, None),
        NumFormat::Q8_0 => (DType::F16, Some(QuantType::Q8_0)),
        NumFormat::Q4_0 => (DType::F16, Some(QuantType::Q4_0)),
        NumFormat::Q4K => (DType::F16, Some(QuantType::Q4K)),
        _ => return None,
    };
    Some(WeightFormat::of_config(config, dense, packed))
}

/// The wgpar engine's memory, from the runtime's own accounting
/// ([`crate::model::memory::per_device`]): the weights as the runtime stores them, its KV
/// cache, activation sets, logits and staging (counted with the activations).
fn wgpar_memory(
    config: &ModelConfig,
    (strategy, devices): (&Strategy, usize),
    format: &WeightFormat,
    (engine, profile): (&Engine, &HostProfile),
    work: Workload,
) -> Result<Vec<DeviceMemory>> {
    let c = &engine.compute;
    let kv_dtype = match c.kv_dtype {
        NumFormat::F16 | NumFormat::Bf16 => DType::F16,
        _ => DType::F32,
    };
    let spec = MemorySpec {
        config,
        format,
        kv_dtypes: &[kv_dtype],
        work: crate::model::memory::Workload {
            batch: work.batch,
            prompt: work.prompt,
        },
        binding_limits: &[],
    };
    let accounted = per_device(strategy, devices, &spec)?;
    Ok((accounted.iter().enumerate())
        .map(|(device, b)| {
            let capacity = profile
                .device(device)
                .map_or(0.0, |s| s.memory_bytes as f64 * c.memory_fraction);
            let activations = b.activations + b.logits + b.readback + b.staging;
            let reserve = c.memory_reserve_bytes;
            DeviceMemory {
                device,
                weights: b.weights,
                kv_cache: b.kv_cache,
                activations,
                reserve,
                total: b.total().saturating_add(reserve),
                capacity: capacity as u64,
            }
        })
        .collect())
}

/// Memory of every device `strategy` uses on `profile` (devices `0..n` in stage-major order,
/// as [`super::modeled_timeline`] places them). The wgpar engine is counted by the runtime's
/// own accounting, where it loads the format; other engines by their parameters' bytes.
pub fn memory_per_device(
    config: &ModelConfig,
    strategy: &Strategy,
    devices: usize,
    weights: WeightsSpec<'_>,
    engine: &Engine,
    profile: &HostProfile,
    work: Workload,
) -> Result<Vec<DeviceMemory>> {
    if engine.name == "wgpar" {
        let format = match weights.runtime {
            Some(f) => Some(f.clone()),
            None => runtime_format(config, weights.format),
        };
        if let Some(format) = format {
            let at = (strategy, devices);
            return wgpar_memory(config, at, &format, (engine, profile), work);
        }
    }
    counted_memory(
        config,
        (strategy, devices),
        weights.format,
        (engine, profile),
        work,
    )
}

/// Memory of an engine counted by its parameters' bytes: each shard's weights, KV cache and
/// activations of one micro-batch, per pipeline stage.
fn counted_memory(
    config: &ModelConfig,
    (strategy, devices): (&Strategy, usize),
    weights: NumFormat,
    (engine, profile): (&Engine, &HostProfile),
    work: Workload,
) -> Result<Vec<DeviceMemory>> {
    let (tp, pp, m, spec) = shape_of(strategy, devices)?;
    let split = match strategy {
        Strategy::Tensor { split: Some(s) } => s.clone(),
        _ => vec![1; tp],
    };
    let shards = ShardSpec::tensor_parallel(config, &split)?;
    let ranges = match &spec {
        PartitionSpec::Explicit(v) => {
            partition(config.layers, pp, &Partition::Explicit(v.clone()))?
        }
        _ => partition(config.layers, pp, &Partition::Even)?,
    };
    let c = &engine.compute;
    let sizes = Sizes {
        config,
        engine,
        profile,
        work,
        tp,
        stages: ranges.len(),
        weight_bytes: weights.bytes(),
        context: if c.kv_preallocated {
            config.max_seq.max(work.context)
        } else {
            work.context
        },
        vocab_share: if c.vocab_parallel { tp as f64 } else { 1.0 },
        // A micro-batch is what one stage holds activations for at a time.
        mb_batch: work.batch.div_ceil(m.min(work.batch.max(1))),
    };
    let mut out = Vec::new();
    for (stage, layers) in ranges.iter().enumerate() {
        for (r, shard) in shards.iter().enumerate() {
            out.push(sizes.device((stage, r), layers.clone(), shard));
        }
    }
    Ok(out)
}

/// What every device of a counted engine's strategy has in common: the model, the engine's
/// formats and the workload, in the strategy's shape.
struct Sizes<'a> {
    config: &'a ModelConfig,
    engine: &'a Engine,
    profile: &'a HostProfile,
    work: Workload,
    tp: usize,
    stages: usize,
    /// Bytes per weight.
    weight_bytes: f64,
    /// Tokens the KV cache holds per sequence.
    context: usize,
    /// Devices the embedding and head are split over.
    vocab_share: f64,
    /// Sequences per micro-batch.
    mb_batch: usize,
}

impl Sizes<'_> {
    /// Memory of rank `r` of pipeline stage `stage`, which holds `layers` of `shard`.
    fn device(
        &self,
        (stage, r): (usize, usize),
        layers: std::ops::Range<usize>,
        shard: &ShardSpec,
    ) -> DeviceMemory {
        let (config, work) = (self.config, self.work);
        let c = &self.engine.compute;
        let kvb = c.kv_dtype.bytes();
        let ab = self.engine.wire.dtype.bytes().max(c.dtype.bytes());
        let (h, d) = (config.hidden as f64, config.head_dim as f64);
        // Positions cached per sequence over the layers: a sliding layer's ring at most.
        let positions: usize = (layers.clone())
            .map(|i| (self.config.layer_ring(i)).map_or(self.context, |r| r.min(self.context)))
            .sum();
        let n_layers = layers.len() as f64;
        let q = shard.local_heads() as f64 * d;
        let kv = shard.local_kv_heads() as f64 * d;
        let ffn = shard.local_ffn() as f64;
        let last = stage + 1 == self.stages;
        let params = self.with_embeddings(n_layers * self.layer_weights(shard), stage, last);
        let kv_cache = work.batch as f64 * positions as f64 * 2.0 * kv * kvb;
        let tokens = (self.mb_batch * work.prompt) as f64;
        let mut activations = tokens * (4.0 * h + q + 2.0 * kv + 2.0 * ffn) * ab;
        if last {
            activations += (self.mb_batch * config.vocab) as f64 * 4.0;
        }
        let device = stage * self.tp + r;
        let capacity = self
            .profile
            .device(device)
            .map_or(0.0, |s| s.memory_bytes as f64 * c.memory_fraction);
        let weights = (params * self.weight_bytes).round() as u64;
        let kv_cache = kv_cache.round() as u64;
        let activations = activations.round() as u64;
        let reserve = c.memory_reserve_bytes;
        DeviceMemory {
            device,
            weights,
            kv_cache,
            activations,
            reserve,
            total: weights
                .saturating_add(kv_cache)
                .saturating_add(activations)
                .saturating_add(reserve),
            capacity: capacity as u64,
        }
    }

    /// Parameters of one layer on `shard`: attention, MLP and norms.
    fn layer_weights(&self, shard: &ShardSpec) -> f64 {
        let config = self.config;
        let (h, d) = (config.hidden as f64, config.head_dim as f64);
        let q = shard.local_heads() as f64 * d;
        let kv = shard.local_kv_heads() as f64 * d;
        let ffn = shard.local_ffn() as f64;
        let mats = if config.arch == crate::model::Arch::Llama {
            3.0
        } else {
            2.0
        };
        let qk_norms = if config.qk_norm { 2.0 * d } else { 0.0 };
        let out_norms = if config.sandwich_norms { 2.0 * h } else { 0.0 };
        h * (q + 2.0 * kv) + q * h + mats * h * ffn + 4.0 * h + qk_norms + out_norms
    }

    /// `params` of a stage's layers plus the embedding (first stage) and head (last stage) it
    /// holds, added in that order.
    fn with_embeddings(&self, mut params: f64, stage: usize, last: bool) -> f64 {
        let config = self.config;
        let embed = (config.vocab * config.hidden) as f64;
        let positions = if config.learned_positions() {
            (config.max_seq * config.hidden) as f64
        } else {
            0.0
        };
        if stage == 0 {
            params += embed / self.vocab_share + positions;
        }
        // A tied head on a single stage reads the embedding it already holds.
        if last && !(config.tied_head && stage == 0) {
            params += embed / self.vocab_share;
        }
        params
    }
}

/// Bytes in GiB with two decimals, for reports.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_8b_model_in_f16_does_not_fit_an_8_gb_device_alone() {
        let config = ModelConfig::preset("llama-8b").unwrap();
        let laptop = HostProfile::shipped("laptop-igpu-dgpu").unwrap();
        let engine = Engine::shipped("cuda-nccl").unwrap();
        let work = Workload {
            batch: 1,
            prompt: 128,
            context: 136,
        };
        let single = memory_per_device(
            &config,
            &Strategy::Single,
            1,
            WeightsSpec::uniform(NumFormat::F16),
            &engine,
            &laptop,
            work,
        )
        .unwrap();
        // 8.03e9 parameters x 2 bytes: about 15 GiB of weights on an 8 GiB card.
        assert_eq!(single.len(), 1);
        assert!(single[0].weights > 14 * (1 << 30), "{:?}", single[0]);
        assert!(!single[0].fits());
        // At 4 bits the weights take about a quarter and fit.
        let q4 = memory_per_device(
            &config,
            &Strategy::Single,
            1,
            WeightsSpec::uniform(NumFormat::Q4_0),
            &engine,
            &laptop,
            work,
        )
        .unwrap();
        assert!(q4[0].fits(), "{:?}", q4[0]);
    }
}
