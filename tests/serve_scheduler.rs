//! The serving loop's continuous batching against a model-free engine (no GPU): each slot's
//! "KV cache" is the token history the engine saw for it, and the next token is a function of
//! that history. A scheduler that mixed up slots, positions or lanes would change the tokens,
//! so every request must get exactly what it gets alone.

use std::collections::VecDeque;
use std::time::Duration;

use wgpar::batching::{serve, Length, Rate, ServeOptions, ServeRequest, WorkloadSpec};
use wgpar::model::sampling::SamplingParams;
use wgpar::model::ModelConfig;
use wgpar::parallel::{BatchStep, Engine, StepDone, StepEngine, StepOutput, StepStats};
use wgpar::trace::Recorder;
use wgpar::{Result, WgparError};

/// The next token after `history`.
fn next_token(history: &[u32], vocab: usize) -> u32 {
    let h = history.iter().enumerate().fold(17u64, |acc, (i, &t)| {
        acc.wrapping_mul(31).wrapping_add(t as u64 * (i as u64 + 1))
    });
    (h % vocab as u64) as u32
}

/// What a request gets alone: its prompt, then `max_new` greedy tokens.
fn alone(prompt: &[u32], max_new: usize, vocab: usize) -> Vec<u32> {
    let mut h = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..max_new {
        let t = next_token(&h, vocab);
        out.push(t);
        h.push(t);
    }
    out
}

struct Mock {
    config: ModelConfig,
    lanes: usize,
    history: Vec<Vec<u32>>,
    in_flight: VecDeque<StepDone>,
    busy: Vec<bool>,
    /// Largest number of rows in one step, and of sequences cached at once.
    widest: usize,
    /// Per slot, the lane of its last step.
    lane_of: Vec<usize>,
    /// Slots that held more than one sequence over the run.
    reused: Vec<usize>,
    /// Simulated step time.
    step: Duration,
    turn: usize,
    /// When set, the budget each step is held to (see [`Watch`]).
    watch: Option<Watch>,
}

/// What a chunked run is checked against: every request (to know when a slot's sequence has
/// its prompt cached and when it ends) and the step budget.
struct Watch {
    requests: Vec<ServeRequest>,
    budget: usize,
    /// Per slot, the request it holds.
    held: Vec<Option<usize>>,
    /// Per slot, steps of its lane since it was last in one.
    idle: Vec<usize>,
    /// Steps that continued a prompt already part-way in its slot.
    continued: usize,
    /// Longest run of a lane's steps a decoding sequence sat out.
    longest_wait: usize,
}

impl Watch {
    /// Whether slot `s`'s sequence has its whole prompt cached and tokens still to come.
    fn decoding(&self, s: usize, cached: usize) -> bool {
        self.held[s].is_some_and(|r| {
            let r = &self.requests[r];
            cached >= r.prompt.len() && cached < r.prompt.len() + r.max_new - 1
        })
    }

    /// Checks `step` (`history`: each slot's tokens before it) against the budget and the
    /// sequences of its lane that decode.
    fn check(&mut self, step: &BatchStep, history: &[Vec<u32>], lanes: &[usize]) {
        assert!(step.rows.len() * step.seq <= self.budget, "{step:?}");
        let mine = |s: &usize| lanes[*s] == step.lane;
        let decoding: Vec<usize> = (0..history.len())
            .filter(|s| mine(s) && self.decoding(*s, history[*s].len()))
            .collect();
        // Slots this step starts over held finished sequences until now.
        for (i, row) in step.rows.iter().enumerate() {
            if row.past == 0 {
                // The test's prompts start with their request's index.
                let first = step.ids[i * step.seq] as usize;
                assert_eq!(self.requests[first].prompt[0] as usize, first);
                self.held[row.slot] = Some(first);
            } else if step.seq > 1 {
                self.continued += 1;
            }
        }
        if step.seq > 1 {
            assert!(
                step.rows.len() * step.seq + decoding.len() <= self.budget,
                "a chunk step over the budget beside {} decoding: {step:?}",
                decoding.len()
            );
        }
        for s in decoding {
            if step.rows.iter().any(|r| r.slot == s) {
                self.idle[s] = 0;
            } else {
                self.idle[s] += 1;
                self.longest_wait = self.longest_wait.max(self.idle[s]);
            }
        }
    }
}

impl Mock {
    fn new(lanes: usize, step: Duration) -> Self {
        Self {
            config: ModelConfig {
                max_seq: 24,
                vocab: 50,
                ..ModelConfig::preset("tiny-llama").unwrap()
            },
            lanes,
            history: Vec::new(),
            in_flight: VecDeque::new(),
            busy: vec![false; lanes],
            widest: 0,
            lane_of: Vec::new(),
            reused: Vec::new(),
            step,
            turn: 0,
            watch: None,
        }
    }
}

impl Engine for Mock {
    fn name(&self) -> String {
        format!("mock with {} lanes", self.lanes)
    }
    fn prefill_step(&mut self, _: &[Vec<u32>], _: bool) -> Result<StepOutput> {
        Err(WgparError::Config("not used".into()))
    }
    fn decode_step(&mut self, _: &[u32], _: bool) -> Result<StepOutput> {
        Err(WgparError::Config("not used".into()))
    }
    fn set_sampling(&mut self, _: SamplingParams) -> Result<()> {
        Err(WgparError::Config("not used".into()))
    }
    fn last_step(&self) -> Option<StepStats> {
        None
    }
    fn set_recorder(&mut self, _: Recorder) {}
}

impl StepEngine for Mock {
    fn model_config(&self) -> &ModelConfig {
        &self.config
    }
    fn lanes(&self) -> usize {
        self.lanes
    }
    fn reserve_slots(&mut self, slots: usize) -> Result<()> {
        self.history = vec![Vec::new(); slots];
        self.lane_of = vec![0; slots];
        if let Some(w) = &mut self.watch {
            w.held = vec![None; slots];
            w.idle = vec![0; slots];
        }
        Ok(())
    }
    fn slots(&self) -> usize {
        self.history.len()
    }
    fn submit(&mut self, step: BatchStep) -> Result<()> {
        assert!(!self.busy[step.lane], "lane {} given two steps", step.lane);
        assert_eq!(step.ids.len(), step.rows.len() * step.seq);
        assert!(!step.rows.is_empty());
        self.busy[step.lane] = true;
        for row in &step.rows {
            self.lane_of[row.slot] = step.lane;
        }
        if let Some(w) = &mut self.watch {
            w.check(&step, &self.history, &self.lane_of);
        }
        let vocab = self.config.vocab;
        let mut tokens = Vec::new();
        for (i, row) in step.rows.iter().enumerate() {
            let h = &mut self.history[row.slot];
            if row.past == 0 {
                if !h.is_empty() {
                    self.reused.push(row.slot);
                }
                h.clear();
            }
            assert_eq!(row.past, h.len(), "slot {} is at {}", row.slot, h.len());
            h.extend_from_slice(&step.ids[i * step.seq..(i + 1) * step.seq]);
            assert!(
                h.len() <= self.config.max_seq,
                "slot {} overflows",
                row.slot
            );
            tokens.push(next_token(h, vocab));
        }
        self.widest = self.widest.max(step.rows.len());
        let cached = self.history.iter().filter(|h| !h.is_empty()).count();
        assert!(cached <= self.history.len());
        self.in_flight.push_back(StepDone {
            lane: step.lane,
            tokens,
            logits: None,
            span: wgpar::trace::SpanId::NONE,
        });
        Ok(())
    }
    fn complete(&mut self, timeout: Option<Duration>) -> Result<Option<StepDone>> {
        if self.in_flight.is_empty() {
            if let Some(t) = timeout {
                std::thread::sleep(t);
            }
            return Ok(None);
        }
        std::thread::sleep(self.step);
        // Lanes finish out of order, as a pipeline's micro-batches may.
        self.turn += 1;
        let pick = self.turn % self.in_flight.len();
        let done = self.in_flight.remove(pick).unwrap();
        self.busy[done.lane] = false;
        Ok(Some(done))
    }
}

fn check_against_alone(requests: &[ServeRequest], run: &wgpar::batching::ServeRun, vocab: usize) {
    for (r, o) in requests.iter().zip(&run.outcomes) {
        assert_eq!(o.error, None, "request {}", r.id);
        assert_eq!(
            o.tokens,
            alone(&r.prompt, r.max_new, vocab),
            "request {}",
            r.id
        );
        let (first, done) = (o.first_token_s.unwrap(), o.done_s.unwrap());
        assert!(r.arrival_s <= first && first <= done, "request {}", r.id);
    }
}

#[test]
fn every_request_gets_what_it_gets_alone_on_one_or_several_lanes() {
    let spec = WorkloadSpec {
        requests: 40,
        rate: Rate::Burst,
        prompt_len: Length::Uniform { min: 2, max: 5 },
        output_len: Length::Uniform { min: 1, max: 12 },
        seed: 3,
    };
    for lanes in [1, 3] {
        let mut engine = Mock::new(lanes, Duration::ZERO);
        let requests = spec.generate(engine.config.vocab);
        let opts = ServeOptions {
            max_batch: 6,
            max_prefill_tokens: 8,
            max_step_tokens: 512,
            prefix_cache: false,
        };
        let mut calls = 0;
        let run = serve(
            &mut engine,
            &requests,
            &opts,
            Recorder::disabled(),
            &mut |_, _| calls += 1,
        )
        .unwrap();
        check_against_alone(&requests, &run, engine.config.vocab);
        assert_eq!(run.metrics.completed, 40);
        assert_eq!(calls, 41, "progress at the start and per request");
        // A lane holds its share of the slots; prefills stay within the token budget.
        assert!(engine.widest <= 6usize.div_ceil(lanes), "{}", engine.widest);
        // Finished requests left early and their slots took new ones.
        assert!(!engine.reused.is_empty());
    }
}

#[test]
fn arrivals_while_the_batch_is_full_join_at_a_token_boundary() {
    // 200 requests/s against 2 ms steps: requests keep arriving while every slot is taken.
    let spec = WorkloadSpec {
        requests: 30,
        rate: Rate::PerSecond(200.0),
        prompt_len: Length::Fixed(3),
        output_len: Length::Uniform { min: 4, max: 10 },
        seed: 11,
    };
    for lanes in [1, 2] {
        let mut engine = Mock::new(lanes, Duration::from_millis(2));
        let requests = spec.generate(engine.config.vocab);
        let opts = ServeOptions {
            max_batch: 4,
            max_prefill_tokens: 64,
            max_step_tokens: 512,
            prefix_cache: false,
        };
        let run = serve(
            &mut engine,
            &requests,
            &opts,
            Recorder::disabled(),
            &mut |_, _| {},
        )
        .unwrap();
        check_against_alone(&requests, &run, engine.config.vocab);
        // Someone waited for a slot: the queue built up while the batch was full.
        assert!(
            run.outcomes
                .iter()
                .any(|o| o.first_token_s.unwrap() - o.arrival_s > 0.004),
            "no request ever queued"
        );
        assert!(run.metrics.ttft_ms.p99 >= run.metrics.ttft_ms.p50);
        assert!(run.metrics.request_throughput > 0.0);
    }
}

#[test]
fn a_request_too_long_for_a_slot_is_refused_and_the_others_finish() {
    let mut engine = Mock::new(2, Duration::ZERO);
    let vocab = engine.config.vocab;
    let mut requests = WorkloadSpec {
        requests: 6,
        rate: Rate::Burst,
        prompt_len: Length::Fixed(4),
        output_len: Length::Fixed(5),
        seed: 1,
    }
    .generate(vocab);
    // max_seq 24: 20 prompt + 5 generated - 1 = 24 fits; 6 more do not.
    requests[1].prompt = vec![1; 20];
    requests[3].max_new = 11;
    requests[3].prompt = vec![2; 20];
    requests[4].prompt.clear();
    requests[5].max_new = 1; // finishes with its prefill
    let run = serve(
        &mut engine,
        &requests,
        &ServeOptions::default(),
        Recorder::disabled(),
        &mut |_, _| {},
    )
    .unwrap();
    let e = run.outcomes[3].error.as_deref().unwrap();
    assert!(
        e.contains("request 3 needs 30 tokens of KV cache") && e.contains("holds 24"),
        "{e}"
    );
    assert!(run.outcomes[4]
        .error
        .as_deref()
        .unwrap()
        .contains("empty prompt"));
    assert!(run.outcomes[3].tokens.is_empty());
    for i in [0, 1, 2, 5] {
        let r = &requests[i];
        assert_eq!(run.outcomes[i].error, None);
        assert_eq!(run.outcomes[i].tokens, alone(&r.prompt, r.max_new, vocab));
    }
    assert_eq!(run.outcomes[5].tokens.len(), 1);
    assert_eq!((run.metrics.completed, run.metrics.failed), (4, 2));
    let bad = serve(
        &mut engine,
        &requests,
        &ServeOptions {
            max_batch: 0,
            max_prefill_tokens: 1,
            max_step_tokens: 512,
            prefix_cache: false,
        },
        Recorder::disabled(),
        &mut |_, _| {},
    );
    assert!(bad.is_err());
}

/// Long prompts arrive while short ones decode, under a step budget of 7 tokens (not a
/// multiple of any prompt): each long prompt is prefilled over several chunk steps at its
/// cached position, no step carries more than the budget, a decoding sequence sits out at
/// most one step of its lane, and every request still gets exactly what it gets alone.
#[test]
fn long_prompts_are_prefilled_in_chunks_between_decode_steps() {
    for lanes in [1, 2] {
        let mut engine = Mock::new(lanes, Duration::from_millis(1));
        engine.config.max_seq = 64;
        let vocab = engine.config.vocab;
        let mut requests = WorkloadSpec {
            requests: 12,
            rate: Rate::PerSecond(300.0),
            prompt_len: Length::Uniform { min: 2, max: 4 },
            output_len: Length::Uniform { min: 1, max: 14 },
            seed: 9,
        }
        .generate(vocab);
        for (i, len) in [(3, 37), (4, 29), (8, 23), (9, 41)] {
            requests[i].prompt = (0..len).map(|t| (t * 7 % vocab) as u32).collect();
        }
        for (i, r) in requests.iter_mut().enumerate() {
            r.prompt[0] = i as u32;
        }
        let opts = ServeOptions {
            max_batch: 4,
            max_prefill_tokens: 64,
            max_step_tokens: 7,
            prefix_cache: false,
        };
        engine.watch = Some(Watch {
            requests: requests.clone(),
            budget: 7,
            held: Vec::new(),
            idle: Vec::new(),
            continued: 0,
            longest_wait: 0,
        });
        let run = serve(
            &mut engine,
            &requests,
            &opts,
            Recorder::disabled(),
            &mut |_, _| {},
        )
        .unwrap();
        check_against_alone(&requests, &run, vocab);
        let w = engine.watch.as_ref().unwrap();
        // Under at most 7 a step, 37, 29, 23 and 41 tokens take at least 6, 5, 4 and 6
        // chunks: 17 continue a prompt.
        assert!(
            w.continued >= 17,
            "{lanes} lanes: {} continued",
            w.continued
        );
        assert!(
            w.longest_wait <= 1,
            "{lanes} lanes: waited {}",
            w.longest_wait
        );
        assert!(!engine.reused.is_empty());
    }
}

#[test]
fn a_step_budget_below_the_batch_is_refused() {
    let mut engine = Mock::new(1, Duration::ZERO);
    let requests = WorkloadSpec {
        requests: 2,
        rate: Rate::Burst,
        prompt_len: Length::Fixed(3),
        output_len: Length::Fixed(2),
        seed: 1,
    }
    .generate(engine.config.vocab);
    for (batch, step) in [(8, 7), (2, 0), (2, (1 << 16) + 1)] {
        let opts = ServeOptions {
            max_batch: batch,
            max_prefill_tokens: 64,
            max_step_tokens: step,
            prefix_cache: false,
        };
        let e = serve(
            &mut engine,
            &requests,
            &opts,
            Recorder::disabled(),
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--max-step-tokens"), "{e}");
    }
}
