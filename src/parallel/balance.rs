//! Measuring what one layer, the embedding and the head cost on each device, so the
//! partitioner can balance stages over unequal devices.

use std::sync::Arc;
use std::time::Instant;

use super::partition::StageCost;
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{
    Activations, GpuModel, KvCache, ModelConfig, ModelWeights, Placement, ShardSpec, Step,
};
use crate::stats::median;

/// Times one decoder layer, the embedding and the head on each device for a step of `batch`
/// sequences of `seq` tokens (median of `samples` after a warm-up), using the model's own
/// first layer. The devices take turns, sample by sample, so that a drift of the machine
/// (another process, a clock change, devices sharing a host's cores) falls on all of them
/// alike rather than on whichever was measured during it.
pub fn measure_stage_costs(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    batch: usize,
    seq: usize,
    samples: usize,
) -> Result<Vec<StageCost>> {
    let step = Step {
        batch,
        // Sliding layers' rings take at most their step of new positions a row.
        seq: seq.min(weights.config.ring_step().unwrap_or(seq)),
        past: 0,
    };
    let probes = (gpus.iter())
        .map(|gpu| Probe::upload(gpu, weights, dtype, &step))
        .collect::<Result<Vec<_>>>()?;
    // Per device: embedding, layer and head times.
    let mut times = vec![[Vec::new(), Vec::new(), Vec::new()]; probes.len()];
    for i in 0..samples + 1 {
        for (probe, t) in probes.iter().zip(&mut times) {
            let sample = probe.sample()?;
            if i > 0 {
                for (v, s) in t.iter_mut().zip(sample) {
                    v.push(s);
                }
            }
        }
    }
    let med = |v: Vec<f64>| {
        median(v).ok_or_else(|| {
            WgparError::Measurement("stage costs need at least one timed sample".into())
        })
    };
    (times.into_iter())
        .map(|[embed, layer, head]| {
            Ok(StageCost {
                layer_s: med(layer)?,
                embed_s: med(embed)?,
                head_s: med(head)?,
                // wgpu reports no device memory size; callers that know it (a host profile,
                // a user budget) fill this in.
                memory: None,
            })
        })
        .collect()
}

/// One device's probe: the model's first layer with the embedding and head, and a step's
/// activations and cache, ready to time.
struct Probe {
    gpu: Arc<Gpu>,
    model: GpuModel,
    act: Activations,
    kv: KvCache,
}

impl Probe {
    fn upload(gpu: &Arc<Gpu>, weights: &ModelWeights, dtype: DType, step: &Step) -> Result<Self> {
        let config: &ModelConfig = &weights.config;
        let placement = Placement {
            layers: 0..1,
            shard: ShardSpec::full(config),
            embedding: true,
            head: true,
        };
        let model = GpuModel::upload(gpu.clone(), weights, placement, dtype)?;
        let mut act = model.activations(step.tokens(), step.batch)?;
        let mut kv = model.kv_cache(step.batch)?;
        let ids: Vec<u32> = (0..step.tokens())
            .map(|i| (i % config.vocab) as u32)
            .collect();
        model.write_ids(&act, &ids)?;
        model.begin_step(&mut act, &mut kv, step, &step.rows())?;
        Ok(Self {
            gpu: gpu.clone(),
            model,
            act,
            kv,
        })
    }

    /// Seconds of the embedding, the layer and the head, each submitted and waited for alone.
    fn sample(&self) -> Result<[f64; 3]> {
        let (m, a) = (&self.model, &self.act);
        let time = |f: &dyn Fn(&mut wgpu::CommandEncoder) -> Result<()>| -> Result<f64> {
            let start = Instant::now();
            let mut enc = self.gpu.encoder();
            f(&mut enc)?;
            self.gpu.submit(enc);
            self.gpu.wait()?;
            Ok(start.elapsed().as_secs_f64())
        };
        Ok([
            time(&|e| m.embed(e, a))?,
            time(&|e| m.layer(e, 0, a, &self.kv))?,
            time(&|e| m.head(e, a))?,
        ])
    }
}
