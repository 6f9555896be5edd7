//! Continuous batching on real engines: for one device, tensor parallelism, pipelines and
//! hybrid TP x PP, every served request gets exactly the tokens it gets alone on one device
//! (greedy), with requests arriving while the batch or the pipeline is full, requests that
//! finish early, and a request too long for a KV slot that is refused while the others finish.
//! The served run's trace replays on a host profile.

mod common;

use std::sync::Arc;

use wgpar::batching::{
    project_metrics, serve, Length, Rate, ServeOptions, ServeRequest, WorkloadSpec,
};
use wgpar::comm::CommConfig;
use wgpar::device::{DType, Gpu};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    build_step_engine, generate, BatchStep, Engine, PartitionSpec, Schedule, SingleEngine,
    StepDone, StepEngine, StepOutput, StepStats, Strategy,
};
use wgpar::sim::{HostProfile, ProjectOptions};
use wgpar::trace::Recorder;

fn config(name: &str, layers: usize) -> ModelConfig {
    ModelConfig {
        layers,
        max_seq: 16,
        ..ModelConfig::preset(name).unwrap()
    }
}

/// A step engine that passes every step on and notes the chunks: steps of several tokens
/// per row at a cached position, and the most tokens a slot held before a new sequence
/// took it over (stale cache a wrong position would read).
struct Chunks {
    inner: Box<dyn StepEngine>,
    continued: usize,
    widest: usize,
    held: Vec<usize>,
    stale: usize,
}

impl Engine for Chunks {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn prefill_step(&mut self, p: &[Vec<u32>], logits: bool) -> wgpar::Result<StepOutput> {
        self.inner.prefill_step(p, logits)
    }
    fn decode_step(&mut self, t: &[u32], logits: bool) -> wgpar::Result<StepOutput> {
        self.inner.decode_step(t, logits)
    }
    fn set_sampling(&mut self, p: wgpar::model::sampling::SamplingParams) -> wgpar::Result<()> {
        self.inner.set_sampling(p)
    }
    fn last_step(&self) -> Option<StepStats> {
        self.inner.last_step()
    }
    fn set_recorder(&mut self, r: Recorder) {
        self.inner.set_recorder(r)
    }
}

impl StepEngine for Chunks {
    fn model_config(&self) -> &ModelConfig {
        self.inner.model_config()
    }
    fn lanes(&self) -> usize {
        self.inner.lanes()
    }
    fn reserve_slots(&mut self, slots: usize) -> wgpar::Result<()> {
        self.held = vec![0; slots];
        self.inner.reserve_slots(slots)
    }
    fn slots(&self) -> usize {
        self.inner.slots()
    }
    fn submit(&mut self, step: BatchStep) -> wgpar::Result<()> {
        self.widest = self.widest.max(step.rows.len() * step.seq);
        for row in &step.rows {
            if row.past == 0 {
                self.stale = self.stale.max(self.held[row.slot]);
            } else if step.seq > 1 {
                self.continued += 1;
            }
            self.held[row.slot] = row.past + step.seq;
        }
        self.inner.submit(step)
    }
    fn complete(&mut self, t: Option<std::time::Duration>) -> wgpar::Result<Option<StepDone>> {
        self.inner.complete(t)
    }
}

/// Each request's tokens alone on one device (none for one that does not fit).
fn alone(gpus: &[Arc<Gpu>], weights: &ModelWeights, requests: &[ServeRequest]) -> Vec<Vec<u32>> {
    let mut single = SingleEngine::new(gpus[0].clone(), weights, DType::F32).unwrap();
    requests
        .iter()
        .map(|r| {
            if r.prompt.len() + r.max_new - 1 > weights.config.max_seq {
                return Vec::new();
            }
            generate(&mut single, std::slice::from_ref(&r.prompt), r.max_new)
                .unwrap()
                .tokens
                .remove(0)
        })
        .collect()
}

fn strategies() -> Vec<(&'static str, Strategy, usize)> {
    let pipeline = |m| Strategy::Pipeline {
        partition: PartitionSpec::Even,
        micro_batches: m,
        schedule: Schedule::InFlight,
    };
    vec![
        ("single", Strategy::Single, 1),
        ("tp2", Strategy::Tensor { split: None }, 2),
        ("pp2 m=2", pipeline(2), 2),
        ("pp3 m=3", pipeline(3), 3),
        (
            "tp2xpp2 m=2",
            Strategy::Hybrid {
                tp: 2,
                partition: PartitionSpec::Even,
                micro_batches: 2,
                schedule: Schedule::InFlight,
            },
            4,
        ),
    ]
}

#[test]
fn served_requests_get_what_they_get_alone_under_every_strategy() {
    let gpus = common::gpus(4);
    let config = config("tiny-llama", 4);
    let weights = ModelWeights::synthetic(&config, 17);
    // Arrivals every few milliseconds against steps of several: requests come while every
    // slot (and every pipeline lane) is busy. Lengths vary, so requests finish early and
    // prefills group by prompt length.
    let spec = WorkloadSpec {
        requests: 12,
        rate: Rate::PerSecond(400.0),
        prompt_len: Length::Uniform { min: 2, max: 4 },
        output_len: Length::Uniform { min: 1, max: 6 },
        seed: 23,
    };
    let mut requests = spec.generate(config.vocab);
    // One request that cannot fit a slot: 14 + 4 - 1 = 17 tokens, a slot holds 16.
    requests[5].prompt = vec![3; 14];
    requests[5].max_new = 4;
    let want = alone(&gpus, &weights, &requests);
    for (label, strategy, devices) in strategies() {
        let mut engine = build_step_engine(
            &strategy,
            &gpus[..devices],
            &weights,
            DType::F32,
            &CommConfig::default(),
            (1, 4),
        )
        .unwrap();
        let opts = ServeOptions {
            max_batch: 4,
            max_prefill_tokens: 8,
            max_step_tokens: 512,
            prefix_cache: false,
        };
        let recorder = Recorder::new();
        let run = serve(engine.as_mut(), &requests, &opts, recorder, &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        for (i, o) in run.outcomes.iter().enumerate() {
            if i == 5 {
                let e = o
                    .error
                    .as_deref()
                    .unwrap_or_else(|| panic!("{label}: not refused"));
                assert!(e.contains("needs 17 tokens of KV cache"), "{label}: {e}");
                continue;
            }
            assert_eq!(o.error, None, "{label} request {i}");
            assert_eq!(o.tokens, want[i], "{label} request {i}");
        }
        assert_eq!(
            (run.metrics.completed, run.metrics.failed),
            (11, 1),
            "{label}"
        );
        assert!(
            run.outcomes
                .iter()
                .any(|o| o.max_new == 1 && o.error.is_none()),
            "{label}: the workload has a request that finishes with its prefill"
        );
        // Someone queued behind a full batch.
        assert!(
            run.metrics.ttft_ms.p99 > run.metrics.ttft_ms.p50,
            "{label}: {:?}",
            run.metrics.ttft_ms
        );
        assert!(run.timeline.has_complete_dependencies(), "{label}");
        if devices > 1 && label.starts_with("pp") {
            let stats = run.pipeline.as_ref().unwrap();
            assert!(stats.passes > 0 && stats.tokens > 0, "{label}: {stats:?}");
        }
        // The trace replays: every completed request has projected first and last tokens.
        let profile = HostProfile::resolve("pcie4-4gpu").unwrap();
        let projected = project_metrics(&run, &profile, &ProjectOptions::default())
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(projected.completed, 11, "{label}");
        assert!(
            projected.ttft_ms.p50 > 0.0 && projected.duration_s > 0.0,
            "{label}"
        );
    }
}

/// A GPT-2-style model reads learned positions through the sequence table too; a burst of
/// requests fills a pipeline's lanes at once.
#[test]
fn learned_positions_and_a_burst_through_a_pipeline() {
    let gpus = common::gpus(2);
    let config = config("tiny-gpt2", 3);
    let weights = ModelWeights::synthetic(&config, 4);
    let requests = WorkloadSpec {
        requests: 7,
        rate: Rate::Burst,
        prompt_len: Length::Fixed(3),
        output_len: Length::Uniform { min: 2, max: 7 },
        seed: 2,
    }
    .generate(config.vocab);
    let want = alone(&gpus, &weights, &requests);
    for (strategy, devices) in [
        (Strategy::Single, 1),
        (
            Strategy::Pipeline {
                partition: PartitionSpec::Even,
                micro_batches: 2,
                schedule: Schedule::InFlight,
            },
            2,
        ),
    ] {
        let mut engine = build_step_engine(
            &strategy,
            &gpus[..devices],
            &weights,
            DType::F32,
            &CommConfig::default(),
            (1, 3),
        )
        .unwrap();
        let run = serve(
            engine.as_mut(),
            &requests,
            &ServeOptions {
                max_batch: 3,
                max_prefill_tokens: 64,
                max_step_tokens: 512,
                prefix_cache: false,
            },
            Recorder::disabled(),
            &mut |_, _| {},
        )
        .unwrap();
        for (i, o) in run.outcomes.iter().enumerate() {
            assert_eq!(o.tokens, want[i], "{strategy} request {i}");
        }
        // The same engine still runs a plain batch afterwards.
        let prompts = vec![requests[0].prompt.clone(), requests[1].prompt.clone()];
        let g = generate(engine.as_mut(), &prompts, 2).unwrap();
        assert_eq!(g.tokens[0], want[0][..2], "{strategy}");
    }
}

/// Long prompts prefilled in chunks of what a 7-token step budget leaves beside the running
/// streams (so chunks of 3 to 7 tokens, not dividing the prompts) give exactly the tokens of
/// one whole prefill, on one device, tensor parallel, a pipeline (the chunks pass its
/// stages as micro-batches do) and hybrid; slots are reused after holding longer sequences,
/// so a chunk that read past its cached tokens would read another sequence's keys.
#[test]
fn prompts_prefilled_in_chunks_get_the_tokens_of_one_prefill_under_every_strategy() {
    let gpus = common::gpus(4);
    let config = ModelConfig {
        max_seq: 40,
        ..config("tiny-llama", 3)
    };
    let weights = ModelWeights::synthetic(&config, 29);
    let mut requests = WorkloadSpec {
        requests: 9,
        rate: Rate::Burst,
        prompt_len: Length::Uniform { min: 2, max: 4 },
        output_len: Length::Uniform { min: 3, max: 9 },
        seed: 31,
    }
    .generate(config.vocab);
    // Long prompts among the short ones.
    for (i, len) in [(0, 22), (2, 31), (5, 17), (7, 26)] {
        requests[i].prompt = (0..len).map(|t| (t * 13 + i) as u32 % 200).collect();
    }
    let want = alone(&gpus, &weights, &requests);
    let labels = ["single", "tp2", "pp2 m=2", "tp2xpp2 m=2"];
    for (label, strategy, devices) in strategies() {
        if !labels.contains(&label) {
            continue;
        }
        let inner = build_step_engine(
            &strategy,
            &gpus[..devices],
            &weights,
            DType::F32,
            &CommConfig::default(),
            (1, 4),
        )
        .unwrap();
        let mut engine = Chunks {
            inner,
            continued: 0,
            widest: 0,
            held: Vec::new(),
            stale: 0,
        };
        let opts = ServeOptions {
            max_batch: 3,
            max_prefill_tokens: 64,
            max_step_tokens: 7,
            prefix_cache: false,
        };
        let run = serve(
            &mut engine,
            &requests,
            &opts,
            Recorder::disabled(),
            &mut |_, _| {},
        )
        .unwrap_or_else(|e| panic!("{label}: {e}"));
        for (i, o) in run.outcomes.iter().enumerate() {
            assert_eq!(o.error, None, "{label} request {i}");
            assert_eq!(o.tokens, want[i], "{label} request {i}");
        }
        // 22, 31, 17 and 26 tokens in chunks of at most 7: at least 4 + 4 + 2 + 3 continue.
        assert!(engine.continued >= 13, "{label}: {}", engine.continued);
        assert!(engine.widest <= 7, "{label}: a step of {}", engine.widest);
        assert!(
            engine.stale > 17,
            "{label}: no slot reused after a long sequence"
        );
    }
}
