//! Measuring what one layer, the embedding and the head cost on each device, so the
//! partitioner can balance stages over unequal devices.

use std::sync::Arc;
use std::time::Instant;

use super::partition::StageCost;
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{GpuModel, ModelConfig, ModelWeights, Placement, ShardSpec, Step};
use crate::stats::median;

/// Times one decoder layer, the embedding and the head on each device for a step of `batch`
/// sequences of `seq` tokens (median of `samples` after a warm-up), using the model's own
/// first layer.
pub fn measure_stage_costs(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    batch: usize,
    seq: usize,
    samples: usize,
) -> Result<Vec<StageCost>> {
    let config: &ModelConfig = &weights.config;
    let step = Step {
        batch,
        seq,
        past: 0,
    };
    gpus.iter()
        .map(|gpu| {
            let placement = Placement {
                layers: 0..1,
                shard: ShardSpec::full(config),
                embedding: true,
                head: true,
            };
            let model = GpuModel::upload(gpu.clone(), weights, placement, dtype)?;
            let mut act = model.activations(step.tokens(), batch)?;
            let mut kv = model.kv_cache(batch)?;
            let ids: Vec<u32> = (0..step.tokens())
                .map(|i| (i % config.vocab) as u32)
                .collect();
            model.write_ids(&act, &ids)?;
            model.begin_step(&mut act, &mut kv, &step, &step.rows())?;
            let time = |f: &dyn Fn(&mut wgpu::CommandEncoder) -> Result<()>| -> Result<f64> {
                let mut v = Vec::new();
                for i in 0..samples + 1 {
                    let start = Instant::now();
                    let mut enc = gpu.encoder();
                    f(&mut enc)?;
                    gpu.submit(enc);
                    gpu.wait()?;
                    if i > 0 {
                        v.push(start.elapsed().as_secs_f64());
                    }
                }
                median(v).ok_or_else(|| {
                    WgparError::Measurement("stage costs need at least one timed sample".into())
                })
            };
            let embed_s = time(&|e| model.embed(e, &act))?;
            let layer_s = time(&|e| model.layer(e, 0, &act, &kv))?;
            let head_s = time(&|e| model.head(e, &act))?;
            Ok(StageCost {
                layer_s,
                embed_s,
                head_s,
                // wgpu reports no device memory size; callers that know it (a host profile,
                // a user budget) fill this in.
                memory: None,
            })
        })
        .collect()
}
