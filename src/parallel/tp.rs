//! Tensor parallelism (Megatron pairing): every device holds a shard of every layer and runs it
//! in its own thread; after the attention output and the MLP down projection, whose results
//! are partial sums, a host-staged all-reduce sums them. Those two all-reduces per layer are the
//! only synchronisation between devices.
//!
//! Embedding and LM head are replicated (each device holds the full tables): the embedding is
//! a lookup every rank needs anyway, and a vocab-parallel head would add an all-gather of
//! `batch x vocab` logits per step to save `vocab x hidden` weights per device. Only rank 0
//! computes the head; the other ranks skip it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::cost;
use super::worker::Workers;
use super::{prompt_shape, Engine, Logits, StepStats};
use crate::comm::{CommConfig, Communicator, RankHandle};
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{
    Activations, GpuModel, KvCache, ModelConfig, ModelWeights, Placement, ShardSpec, Step,
};
use crate::trace::{CollectiveOp, KernelFamily, Recorder, SpanAttrs, SpanId};

/// One rank's state, owned by its worker thread.
struct Rank {
    model: GpuModel,
    comm: RankHandle,
    /// Activations per token count: the all-reduced tensors must be exactly the step's size.
    acts: HashMap<usize, Activations>,
    kv: Option<KvCache>,
    collectives: u64,
}

struct Job {
    ids: Arc<Vec<u32>>,
    step: Step,
    new_cache: bool,
    recorder: Recorder,
}

struct RankOutput {
    logits: Option<Vec<f32>>,
    compute_s: f64,
    comm_s: f64,
    collectives: usize,
    bytes: u64,
}

impl Rank {
    fn run(&mut self, job: Job) -> Result<RankOutput> {
        let step = job.step;
        let rec = &job.recorder;
        if job.new_cache {
            self.kv = Some(self.model.kv_cache(step.batch)?);
        }
        let tokens = step.tokens();
        if !self.acts.contains_key(&tokens) {
            self.acts
                .insert(tokens, self.model.activations(tokens, step.batch)?);
        }
        let (Some(act), Some(kv)) = (self.acts.get(&tokens), self.kv.as_ref()) else {
            return Err(WgparError::Config("decode before prefill".into()));
        };
        let m = &self.model;
        let gpu = m.gpu().clone();
        let dev = gpu.ordinal() as u32;
        let shard = &m.placement().shard;
        let config = m.config();
        let dtype = m.weight_dtype();
        let world = shard.world as u32;
        let bytes = (tokens * config.hidden * 4) as u64;
        let mut out = RankOutput {
            logits: None,
            compute_s: 0.0,
            comm_s: 0.0,
            collectives: 0,
            bytes: 0,
        };
        let mut prev = SpanId::NONE;

        m.write_ids(act, &job.ids)?;
        let mut start = Instant::now();
        let mut enc = gpu.encoder();
        m.embed(&mut enc, act, &step)?;
        for i in 0..m.num_layers() {
            let layer = (m.placement().layers.start + i) as u32;
            for half in 0..2 {
                let (cost, name, family) = if half == 0 {
                    m.attention(&mut enc, i, act, kv, &step)?;
                    (
                        cost::attention(config, shard, &step, dtype),
                        "attention",
                        KernelFamily::Attention,
                    )
                } else {
                    m.mlp(&mut enc, i, act, &step)?;
                    (
                        cost::mlp(config, shard, &step, dtype),
                        "mlp",
                        KernelFamily::Matmul,
                    )
                };
                gpu.submit(std::mem::replace(&mut enc, gpu.encoder()));
                gpu.wait()?;
                let end = Instant::now();
                out.compute_s += (end - start).as_secs_f64();
                let compute = rec.record_with(start, end, || {
                    SpanAttrs::compute(name, dev)
                        .layer(layer)
                        .flops(cost.flops)
                        .bytes(cost.bytes)
                        .family(family)
                        .after(prev)
                });
                let partial = if half == 0 {
                    &act.attn_out
                } else {
                    &act.mlp_out
                };
                let comm_start = Instant::now();
                self.comm.all_reduce(partial)?;
                let comm_end = Instant::now();
                out.comm_s += (comm_end - comm_start).as_secs_f64();
                out.collectives += 1;
                out.bytes += bytes;
                let group = self.collectives;
                self.collectives += 1;
                prev = rec.record_with(comm_start, comm_end, || {
                    SpanAttrs::collective(
                        "allreduce",
                        dev,
                        CollectiveOp::AllReduce,
                        "host-staged",
                        world,
                        bytes,
                    )
                    .layer(layer)
                    .group(group)
                    .after(compute)
                });
                start = Instant::now();
                if half == 0 {
                    m.attention_residual(&mut enc, i, act, &step)?;
                } else {
                    m.mlp_residual(&mut enc, i, act, &step)?;
                }
            }
        }
        if shard.rank == 0 {
            m.head(&mut enc, act, &step)?;
            gpu.submit(enc);
            let logits = act
                .logits
                .as_ref()
                .ok_or_else(|| WgparError::Config("rank 0 has no logits buffer".into()))?;
            let mut data = gpu.read_f32(logits)?;
            data.truncate(step.batch * config.vocab);
            out.logits = Some(data);
            let cost = cost::head(config, step.batch, dtype);
            let end = Instant::now();
            out.compute_s += (end - start).as_secs_f64();
            rec.record_with(start, end, || {
                SpanAttrs::compute("head", dev)
                    .flops(cost.flops)
                    .bytes(cost.bytes)
                    .family(KernelFamily::Matmul)
                    .after(prev)
            });
        } else {
            gpu.submit(enc);
            gpu.wait()?;
            out.compute_s += start.elapsed().as_secs_f64();
        }
        Ok(out)
    }
}

/// The model sharded over several devices, one worker thread per device.
pub struct TensorParallelEngine {
    workers: Workers<Job, RankOutput>,
    comm: Arc<Communicator>,
    config: ModelConfig,
    shards: Vec<ShardSpec>,
    labels: Vec<String>,
    batch: usize,
    past: usize,
    last: Option<StepStats>,
    failed: Option<String>,
    recorder: Recorder,
}

impl TensorParallelEngine {
    /// Shards `weights` over `gpus` with relative shares `split` (`None`: even), stored as
    /// `dtype`. Errors list the valid degrees when the heads do not divide.
    pub fn new(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        split: Option<&[usize]>,
        comm_config: CommConfig,
    ) -> Result<Self> {
        let config = weights.config.clone();
        let even = vec![1; gpus.len()];
        let split = split.unwrap_or(&even);
        if split.len() != gpus.len() {
            return Err(WgparError::Config(format!(
                "--split has {} shares for {} devices",
                split.len(),
                gpus.len()
            )));
        }
        let shards = ShardSpec::tensor_parallel(&config, split)?;
        let comm = Communicator::new(gpus.to_vec(), comm_config)?;
        // Upload every rank's shard at once: each device copies its own weights.
        let models: Vec<Result<GpuModel>> = std::thread::scope(|s| {
            let handles: Vec<_> = gpus
                .iter()
                .zip(&shards)
                .map(|(gpu, shard)| {
                    let placement = Placement {
                        layers: 0..config.layers,
                        shard: shard.clone(),
                        embedding: true,
                        head: shard.rank == 0,
                    };
                    s.spawn(move || GpuModel::upload(gpu.clone(), weights, placement, dtype))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(WgparError::Config("weight upload thread panicked".into()))
                    })
                })
                .collect()
        });
        let mut states = Vec::new();
        for (rank, model) in models.into_iter().enumerate() {
            let model = model?;
            states.push((
                format!("tp rank {rank} ({})", gpus[rank].describe()),
                Rank {
                    model,
                    comm: comm.join(rank)?,
                    acts: HashMap::new(),
                    kv: None,
                    collectives: 0,
                },
            ));
        }
        let labels = gpus.iter().map(|g| g.label().to_string()).collect();
        let workers = Workers::spawn(states, Rank::run, |rank, why| rank.comm.abort(why))?;
        Ok(Self {
            workers,
            comm,
            config,
            shards,
            labels,
            batch: 0,
            past: 0,
            last: None,
            failed: None,
            recorder: Recorder::disabled(),
        })
    }

    /// Each rank's shard.
    pub fn shards(&self) -> &[ShardSpec] {
        &self.shards
    }

    /// The communicator (its stats log has every all-reduce).
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.comm
    }

    fn step(&mut self, ids: Vec<u32>, step: Step, new_cache: bool) -> Result<Logits> {
        if let Some(why) = &self.failed {
            return Err(WgparError::Worker {
                worker: "tensor-parallel engine".into(),
                message: format!("stopped after an earlier failure: {why}"),
            });
        }
        let ids = Arc::new(ids);
        let start = Instant::now();
        for i in 0..self.workers.len() {
            self.workers.send(
                i,
                Job {
                    ids: ids.clone(),
                    step,
                    new_cache,
                    recorder: self.recorder.clone(),
                },
            )?;
        }
        let outputs = match self.workers.collect(self.workers.len()) {
            Ok(o) => o,
            Err(e) => {
                self.failed = Some(e.to_string());
                return Err(e);
            }
        };
        let wall_s = start.elapsed().as_secs_f64();
        let n = outputs.len() as f64;
        self.last = Some(StepStats {
            tokens: step.tokens(),
            wall_s,
            compute_s: outputs.iter().map(|o| o.compute_s).sum::<f64>() / n,
            comm_s: outputs.iter().map(|o| o.comm_s).sum::<f64>() / n,
            collectives: outputs[0].collectives,
            bytes_sent: outputs[0].bytes,
            bytes_received: outputs[0].bytes,
        });
        self.past = step.past + step.seq;
        let data = outputs
            .into_iter()
            .find_map(|o| o.logits)
            .ok_or_else(|| WgparError::Config("no rank returned logits".into()))?;
        Ok(Logits {
            batch: step.batch,
            vocab: self.config.vocab,
            data,
        })
    }
}

impl Engine for TensorParallelEngine {
    fn name(&self) -> String {
        let shares: Vec<usize> = self.shards.iter().map(|s| s.local_heads()).collect();
        format!(
            "tp={} on {} (query heads {:?})",
            self.shards.len(),
            self.labels.join(","),
            shares
        )
    }

    fn prefill(&mut self, prompts: &[Vec<u32>]) -> Result<Logits> {
        let (batch, seq) = prompt_shape(prompts)?;
        self.batch = batch;
        self.step(
            prompts.concat(),
            Step {
                batch,
                seq,
                past: 0,
            },
            true,
        )
    }

    fn decode(&mut self, tokens: &[u32]) -> Result<Logits> {
        if self.batch == 0 {
            return Err(WgparError::Config("decode before prefill".into()));
        }
        if tokens.len() != self.batch {
            return Err(WgparError::Config(format!(
                "decode got {} tokens for {} sequences",
                tokens.len(),
                self.batch
            )));
        }
        let step = Step {
            batch: self.batch,
            seq: 1,
            past: self.past,
        };
        self.step(tokens.to_vec(), step, false)
    }

    fn last_step(&self) -> Option<StepStats> {
        self.last.clone()
    }

    fn set_recorder(&mut self, recorder: Recorder) {
        for (i, label) in self.labels.iter().enumerate() {
            recorder.label_device(i as u32, label.clone());
        }
        self.recorder = recorder;
    }
}
