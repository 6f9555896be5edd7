//! Measuring what one layer, the embedding and the head cost on each device, so the
//! partitioner can balance stages over unequal devices.

use std::sync::Arc;
use std::time::Instant;

use super::partition::{stage_time, StageCost};
use super::pp::StageStats;
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

/// The devices' costs corrected by a run of the pipeline they were placed for: stage `s` (on
/// device `s`, holding `run[s].layers`) computed for [`StageStats::busy_s`] over its passes
/// where `costs` predicted its layers, embedding and head per pass; each device's costs are
/// scaled by that ratio. Compute time is what both measure (submitted and waited for) and
/// what a pipeline's bubble counts; the hand-off overlaps the next pass's compute.
///
/// [`measure_stage_costs`] times each device alone, one kernel per submission. In a running
/// pipeline the stages work at the same time (two CPU drivers share the host's cores, an
/// iGPU shares the memory bus with the CPU) and a stage submits all its layers at once, so
/// the run's own stage times are the better guide to re-balance by.
pub fn rescale_stage_costs(costs: &[StageCost], run: &[StageStats]) -> Result<Vec<StageCost>> {
    if costs.len() != run.len() {
        return Err(WgparError::Measurement(format!(
            "{} stage costs for a run of {} stages",
            costs.len(),
            run.len()
        )));
    }
    let p = costs.len();
    (costs.iter().zip(run).enumerate())
        .map(|(s, (c, stage))| {
            let predicted = stage_time(s, p, stage.layers.len(), c);
            let measured = stage.busy_s / stage.microbatches.max(1) as f64;
            if stage.microbatches == 0 || !(measured > 0.0 && predicted > 0.0) {
                return Err(WgparError::Measurement(format!(
                    "stage {s} ran {} passes in {measured} s (predicted {predicted} s per \
                     pass): no time to rescale its costs by",
                    stage.microbatches
                )));
            }
            let k = measured / predicted;
            Ok(StageCost {
                layer_s: c.layer_s * k,
                embed_s: c.embed_s * k,
                head_s: c.head_s * k,
                memory: c.memory,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::{partition, Partition};

    fn cost(layer_s: f64, embed_s: f64, head_s: f64) -> StageCost {
        StageCost {
            layer_s,
            embed_s,
            head_s,
            memory: None,
        }
    }

    fn ran(layers: std::ops::Range<usize>, passes: usize, per_pass_s: f64) -> StageStats {
        StageStats {
            layers,
            busy_s: per_pass_s * passes as f64,
            microbatches: passes,
            ..Default::default()
        }
    }

    #[test]
    fn a_run_slower_than_its_probe_moves_layers_off_that_device() {
        // The probe saw equal devices; the head costs the last stage two layers' time and the
        // embedding the first half of one, so 9 + 0.5 vs 7 + 2 is the best split.
        let probe = vec![cost(1.0, 0.5, 2.0), cost(1.0, 0.5, 2.0)];
        let before = partition(16, 2, &Partition::Balanced(probe.clone())).unwrap();
        assert_eq!(before, vec![0..9, 9..16]);
        // In the run, device 1's stage took twice what the probe predicted for it (7 + 2 = 9 s
        // predicted, 18 s measured); device 0's stage ran as predicted (9.5 s).
        let run = [ran(0..9, 16, 9.5), ran(9..16, 16, 18.0)];
        let scaled = rescale_stage_costs(&probe, &run).unwrap();
        assert!((scaled[0].layer_s - 1.0).abs() < 1e-12, "{scaled:?}");
        assert!((scaled[1].layer_s - 2.0).abs() < 1e-12, "{scaled:?}");
        assert!((scaled[1].head_s - 4.0).abs() < 1e-12, "{scaled:?}");
        // Device 0 now takes layers until its stage (n + 0.5) matches device 1's (2 (16 - n) + 4):
        // n = 12 gives 12.5 vs 12.
        let after = partition(16, 2, &Partition::Balanced(scaled)).unwrap();
        assert_eq!(after, vec![0..12, 12..16]);
    }

    #[test]
    fn a_run_that_matches_its_probe_keeps_the_costs() {
        let probe = vec![cost(1.5, 0.25, 0.0), cost(2.0, 0.0, 3.0)];
        let run = [ran(0..10, 8, 15.25), ran(10..16, 8, 15.0)];
        let scaled = rescale_stage_costs(&probe, &run).unwrap();
        for (a, b) in scaled.iter().zip(&probe) {
            assert!((a.layer_s - b.layer_s).abs() < 1e-12, "{a:?} vs {b:?}");
            assert!((a.embed_s - b.embed_s).abs() < 1e-12, "{a:?} vs {b:?}");
            assert!((a.head_s - b.head_s).abs() < 1e-12, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn a_run_without_passes_or_of_another_shape_is_refused() {
        let probe = vec![cost(1.0, 0.0, 0.0), cost(1.0, 0.0, 1.0)];
        let idle = [ran(0..8, 0, 0.0), ran(8..16, 0, 0.0)];
        let e = rescale_stage_costs(&probe, &idle).unwrap_err().to_string();
        assert!(e.contains("stage 0 ran 0 passes"), "{e}");
        let e = rescale_stage_costs(&probe, &idle[..1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 stage costs for a run of 1 stages"), "{e}");
    }
}
