//! Prefix caching over the paged KV (issue 36). Against a model-free engine whose "KV" is a
//! pool of token blocks read and written through the steps' block tables, every request of
//! random shared-prefix and multi-turn workloads, on one lane or several, gets what its whole
//! prompt gets alone: a reused block that was not the prompt's, or a shared block written
//! again, would change the tokens; no step carries a KV copy, and prompts do read blocks
//! other slots wrote. On real engines (one device, tensor parallel, a pipeline), two running
//! sequences share a prompt's blocks by reference (no copy in any step, a table for each
//! prompt, none with `--no-prefix-cache`) and multi-turn sessions reuse their previous turns;
//! every request gets the tokens it gets without the cache (greedy), and the cache is asserted
//! to have hit, so the runs compare something. Over HTTP, a chat's second turn reuses the
//! first turn's KV (`/metrics` hits grow) and answers as a server without the cache does.
//! The four choices of an `n = 4` request reuse the first's prompt blocks (hits grow by three
//! times them) and answer as without the cache, greedy and seeded, single, TP and pipeline.

mod common;
mod hf_support;
mod serve_support;

use std::collections::VecDeque;
use std::process::Command;
use std::time::Duration;

use serve_support::Server;
use wgpar::batching::{
    serve, Length, Rate, ServeOptions, ServeRequest, ServeRun, Sessions, WorkloadSpec,
};
use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::model::sampling::SamplingParams;
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::parallel::{
    build_step_engine, BatchStep, Engine, PartitionSpec, Schedule, StepDone, StepEngine,
    StepOutput, StepStats, Strategy,
};
use wgpar::trace::Recorder;
use wgpar::{Result, WgparError};

/// The mock's next token after `history`.
fn next_token(history: &[u32], vocab: usize) -> u32 {
    let h = history.iter().enumerate().fold(29u64, |acc, (i, &t)| {
        acc.wrapping_mul(131)
            .wrapping_add(t as u64 * (i as u64 + 7))
    });
    (h % vocab as u64) as u32
}

/// Positions of one KV block.
const BLOCK: usize = 16;

/// A model-free step engine: its KV is a pool of 16-position blocks of tokens (each with the
/// slot that wrote it), read and written through per-slot block tables as the engines do.
struct Mock {
    config: ModelConfig,
    lanes: usize,
    /// Each slot's logical blocks' physical blocks (identity at first).
    tables: Vec<Vec<usize>>,
    /// Each block's positions: the token written there and the slot that wrote it.
    pool: Vec<[Option<(u32, usize)>; BLOCK]>,
    in_flight: VecDeque<StepDone>,
    /// Copies asked for (none: blocks are shared by reference), tables applied, and rows that
    /// read a position another slot wrote (a prefix reused by reference).
    copies: usize,
    tables_applied: usize,
    foreign_reads: usize,
    turn: usize,
}

impl Mock {
    /// A mock of a 40-token vocabulary and 80 positions (5 blocks) a slot, over `lanes` lanes.
    fn new(lanes: usize) -> Self {
        Self {
            config: ModelConfig {
                max_seq: 80,
                vocab: 40,
                ..ModelConfig::preset("tiny-llama").unwrap()
            },
            lanes,
            tables: Vec::new(),
            pool: Vec::new(),
            in_flight: VecDeque::new(),
            copies: 0,
            tables_applied: 0,
            foreign_reads: 0,
            turn: 0,
        }
    }

    /// Slot `slot`'s first `past` positions (each must have been written), and whether
    /// another slot wrote some of them.
    fn read(&self, slot: usize, past: usize) -> (Vec<u32>, bool) {
        let mut foreign = false;
        let history = (0..past)
            .map(|p| {
                let b = self.tables[slot][p / BLOCK];
                let (token, writer) = self.pool[b][p % BLOCK]
                    .unwrap_or_else(|| panic!("slot {slot} reads unwritten position {p}"));
                foreign |= writer != slot;
                token
            })
            .collect();
        (history, foreign)
    }
}

impl Engine for Mock {
    fn name(&self) -> String {
        "history mock".into()
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
        let bps = self.config.max_seq / BLOCK;
        self.tables = (0..slots)
            .map(|s| (s * bps..(s + 1) * bps).collect())
            .collect();
        self.pool = vec![[None; BLOCK]; slots * bps];
        Ok(())
    }
    fn slots(&self) -> usize {
        self.tables.len()
    }
    /// Runs the step at once (as a device runs steps in submission order), tables first.
    fn submit(&mut self, step: BatchStep) -> Result<()> {
        for t in &step.kv_tables {
            for (j, &b) in t.blocks.iter().enumerate() {
                self.tables[t.slot][j] = b as usize;
            }
            self.tables_applied += 1;
        }
        self.copies += step.kv_copies.len();
        let mut tokens = Vec::new();
        for (i, row) in step.rows.iter().enumerate() {
            let (mut h, foreign) = self.read(row.slot, row.past);
            self.foreign_reads += usize::from(foreign && step.seq > 1);
            let ids = &step.ids[i * step.seq..(i + 1) * step.seq];
            for (k, &id) in ids.iter().enumerate() {
                let p = row.past + k;
                assert!(p < self.config.max_seq);
                let b = self.tables[row.slot][p / BLOCK];
                self.pool[b][p % BLOCK] = Some((id, row.slot));
            }
            h.extend_from_slice(ids);
            tokens.push(next_token(&h, self.config.vocab));
        }
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
                std::thread::sleep(t.min(Duration::from_millis(1)));
            }
            return Ok(None);
        }
        // A step takes a while, so later sessions arrive while earlier ones run; lanes finish
        // out of order, as a pipeline's micro-batches may.
        std::thread::sleep(Duration::from_micros(300));
        self.turn += 1;
        let pick = self.turn % self.in_flight.len();
        Ok(self.in_flight.remove(pick))
    }
}

/// What each request gets alone: its whole prompt (a later turn's holds the turns before and
/// their answers), then greedy tokens.
fn alone_sessions(requests: &[ServeRequest], vocab: usize) -> Vec<Vec<u32>> {
    let mut whole: Vec<Vec<u32>> = Vec::new();
    let mut out: Vec<Vec<u32>> = Vec::new();
    for r in requests {
        let mut h = match r.follows {
            Some(p) => [whole[p].clone(), out[p].clone()].concat(),
            None => Vec::new(),
        };
        h.extend_from_slice(&r.prompt);
        whole.push(h.clone());
        let mut got = Vec::new();
        for _ in 0..r.max_new {
            let t = next_token(&h, vocab);
            got.push(t);
            h.push(t);
        }
        out.push(got);
    }
    out
}

#[test]
fn reused_prefixes_are_the_prompts_own_on_one_lane_or_several() {
    let mut foreign = 0;
    for (seed, lanes, slots, step) in [(1, 1, 3, 512), (2, 2, 4, 9), (3, 3, 3, 6), (4, 1, 2, 5)] {
        let spec = WorkloadSpec {
            requests: 7,
            rate: Rate::PerSecond(400.0),
            prompt_len: Length::Uniform { min: 1, max: 9 },
            output_len: Length::Uniform { min: 1, max: 5 },
            seed,
        };
        let requests = Sessions {
            shared_prefix: 17 + seed as usize,
            turns: 3,
        }
        .generate(&spec, 40);
        let mut engine = Mock::new(lanes);
        let opts = ServeOptions {
            max_batch: slots,
            max_prefill_tokens: 64,
            max_step_tokens: step,
            prefix_cache: true,
        };
        let run = serve(
            &mut engine,
            &requests,
            &opts,
            Recorder::disabled(),
            &mut |_, _| {},
        )
        .unwrap();
        let want = alone_sessions(&requests, 40);
        for (o, w) in run.outcomes.iter().zip(&want) {
            assert_eq!(o.error, None, "seed {seed} request {}", o.id);
            assert_eq!(&o.tokens, w, "seed {seed} request {}", o.id);
        }
        let p = run.prefix;
        assert_eq!(p.queries, 21, "seed {seed}");
        // A later turn finds its previous turn's slot unless a waiting request took it first.
        assert!(p.hits > 0 && p.reused_tokens > 0, "seed {seed}: {p:?}");
        // Shared by reference: never a copy; every prompt's table sent (and more as
        // sequences reach new blocks).
        assert_eq!(engine.copies, 0, "seed {seed}");
        assert!(engine.tables_applied >= 21, "seed {seed}");
        foreign += engine.foreign_reads;
    }
    assert!(foreign > 0, "some prompt read blocks another slot wrote");
    // The shared-prefix scenario the real engines run below, on the mock.
    let requests = shared_prefix(40);
    let mut engine = Mock::new(1);
    let opts = ServeOptions {
        max_batch: 2,
        max_prefill_tokens: 128,
        max_step_tokens: 512,
        prefix_cache: true,
    };
    let run = serve(
        &mut engine,
        &requests,
        &opts,
        Recorder::disabled(),
        &mut |_, _| {},
    )
    .unwrap();
    let want = alone_sessions(&requests, 40);
    assert!(run.outcomes.iter().zip(&want).all(|(o, w)| &o.tokens == w));
    assert_eq!(
        (engine.copies, engine.foreign_reads),
        (0, 1),
        "the third prompt reads the first's blocks, not a copy"
    );
    assert_eq!((run.prefix.shared, run.prefix.reused_tokens), (1, 32));
}

fn strategies() -> Vec<(&'static str, Strategy, usize)> {
    let pipeline = Strategy::Pipeline {
        partition: PartitionSpec::Even,
        micro_batches: 2,
        schedule: Schedule::InFlight,
    };
    vec![
        ("single", Strategy::Single, 1),
        ("tp2", Strategy::Tensor { split: None }, 2),
        ("pp2 m=2", pipeline, 2),
    ]
}

fn request(id: usize, prompt: Vec<u32>, max_new: usize) -> ServeRequest {
    ServeRequest {
        id,
        arrival_s: 0.0,
        prompt,
        max_new,
        follows: None,
    }
}

/// Two slots, all at once: the first two prompts prefill together; the second answers with its
/// prefill and frees its slot, which the third takes referencing the first's 32-token prefix
/// (two blocks) while the first still runs.
fn shared_prefix(vocab: u32) -> Vec<ServeRequest> {
    let token = |i: u32| (i * 37 + 11) % vocab;
    let shared: Vec<u32> = (0..32).map(token).collect();
    let with = |tail: &[u32]| [shared.clone(), tail.to_vec()].concat();
    let other: Vec<u32> = (100..134).map(token).collect();
    vec![
        request(0, with(&[5, 6]), 10),
        request(1, other, 1),
        request(2, with(&[7, 8, 9]), 4),
    ]
}

/// Three sessions of three turns behind a 20-token system prompt, two slots.
fn sessions(vocab: usize) -> Vec<ServeRequest> {
    let spec = WorkloadSpec {
        requests: 3,
        rate: Rate::Burst,
        prompt_len: Length::Uniform { min: 3, max: 6 },
        output_len: Length::Uniform { min: 2, max: 4 },
        seed: 31,
    };
    Sessions {
        shared_prefix: 20,
        turns: 3,
    }
    .generate(&spec, vocab)
}

/// A real engine whose steps are watched: the KV copies and block tables they carry.
struct Watch {
    inner: Box<dyn StepEngine>,
    copies: usize,
    tables: usize,
}

impl Engine for Watch {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn prefill_step(&mut self, prompts: &[Vec<u32>], logits: bool) -> Result<StepOutput> {
        self.inner.prefill_step(prompts, logits)
    }
    fn decode_step(&mut self, tokens: &[u32], logits: bool) -> Result<StepOutput> {
        self.inner.decode_step(tokens, logits)
    }
    fn set_sampling(&mut self, params: SamplingParams) -> Result<()> {
        self.inner.set_sampling(params)
    }
    fn last_step(&self) -> Option<StepStats> {
        self.inner.last_step()
    }
    fn set_recorder(&mut self, recorder: Recorder) {
        self.inner.set_recorder(recorder)
    }
    fn pipeline_stats(&self) -> Option<wgpar::parallel::PipelineStats> {
        self.inner.pipeline_stats()
    }
}

impl StepEngine for Watch {
    fn model_config(&self) -> &ModelConfig {
        self.inner.model_config()
    }
    fn lanes(&self) -> usize {
        self.inner.lanes()
    }
    fn reserve_slots(&mut self, slots: usize) -> Result<()> {
        self.inner.reserve_slots(slots)
    }
    fn slots(&self) -> usize {
        self.inner.slots()
    }
    fn submit(&mut self, step: BatchStep) -> Result<()> {
        self.copies += step.kv_copies.len();
        self.tables += step.kv_tables.len();
        self.inner.submit(step)
    }
    fn complete(&mut self, timeout: Option<Duration>) -> Result<Option<StepDone>> {
        self.inner.complete(timeout)
    }
    fn masks_on_device(&self) -> bool {
        self.inner.masks_on_device()
    }
    fn serving_stats(&self) -> Option<wgpar::parallel::PipelineStats> {
        self.inner.serving_stats()
    }
}

/// `reqs` served on two slots of a real engine; the run, and the KV copies and block tables
/// its steps carried.
fn run(
    label: &str,
    strategy: &Strategy,
    n: usize,
    reqs: &[ServeRequest],
    cache: bool,
) -> (ServeRun, usize, usize) {
    let gpus = common::gpus(n);
    let config = ModelConfig {
        layers: 2,
        max_seq: 64,
        ..ModelConfig::preset("tiny-llama").unwrap()
    };
    let weights = ModelWeights::synthetic(&config, 23);
    let inner = build_step_engine(
        strategy,
        &gpus,
        &weights,
        DType::F32,
        &CommConfig::default(),
        (2, 48),
    )
    .unwrap();
    let mut engine = Watch {
        inner,
        copies: 0,
        tables: 0,
    };
    let opts = ServeOptions {
        max_batch: 2,
        max_prefill_tokens: 128,
        max_step_tokens: 512,
        prefix_cache: cache,
    };
    let run = serve(&mut engine, reqs, &opts, Recorder::new(), &mut |_, _| {})
        .unwrap_or_else(|e| panic!("{label} (cache {cache}): {e}"));
    (run, engine.copies, engine.tables)
}

/// Served with and without the cache: the same tokens for every request, none refused.
fn same_tokens(label: &str, with: &ServeRun, without: &ServeRun) {
    assert_eq!(with.outcomes.len(), without.outcomes.len());
    for (a, b) in with.outcomes.iter().zip(&without.outcomes) {
        assert_eq!((&a.error, &b.error), (&None, &None), "{label} {}", a.id);
        assert_eq!(a.prompt_len, b.prompt_len, "{label} {}", a.id);
        assert_eq!(a.tokens.len(), a.max_new, "{label} {}", a.id);
        assert_eq!(a.tokens, b.tokens, "{label} request {}", a.id);
    }
    assert_eq!(
        without.prefix,
        Default::default(),
        "{label}: the cache was off"
    );
}

#[test]
fn two_running_sequences_share_a_prompts_blocks_without_a_copy_on_every_strategy() {
    let vocab = ModelConfig::preset("tiny-llama").unwrap().vocab;
    for (label, strategy, n) in strategies() {
        let shared = shared_prefix(vocab as u32);
        let (with, copies, tables) = run(label, &strategy, n, &shared, true);
        let (without, copies_off, tables_off) = run(label, &strategy, n, &shared, false);
        same_tokens(label, &with, &without);
        let p = with.prefix;
        // The third prompt references the first's two blocks while the first still runs.
        assert_eq!((p.queries, p.hits, p.shared), (3, 1, 1), "{label}: {p:?}");
        assert_eq!(p.reused_tokens, 32, "{label}: {p:?}");
        assert_eq!(
            (copies, tables),
            (0, 3),
            "{label}: no copy, a table a prompt"
        );
        assert_eq!(
            (copies_off, tables_off),
            (0, 0),
            "{label}: identity tables when off"
        );
    }
}

#[test]
fn cached_prefixes_give_the_tokens_of_whole_prefills_on_every_strategy() {
    let vocab = ModelConfig::preset("tiny-llama").unwrap().vocab;
    for (label, strategy, n) in strategies() {
        let chats = sessions(vocab);
        let (with, copies, _) = run(label, &strategy, n, &chats, true);
        same_tokens(label, &with, &run(label, &strategy, n, &chats, false).0);
        let p = with.prefix;
        assert_eq!(copies, 0, "{label}");
        // Every later turn reuses at least its previous turn's prompt (>= 23 tokens).
        assert_eq!(p.queries, 9, "{label}: {p:?}");
        assert!(p.hits >= 6 && p.reused_tokens >= 6 * 23, "{label}: {p:?}");
        let later: usize = (with.outcomes.iter().zip(&chats))
            .filter(|(_, r)| r.follows.is_some())
            .map(|(o, _)| o.prompt_len)
            .sum();
        assert!(later > 6 * 23, "{label}: later turns hold the earlier ones");
    }
}

/// `wgpar serve` of the chat checkpoint on a free port, cache on or off.
fn chat_server(dir: &hf_support::Scratch, cache: bool) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(["serve", "--port", "0", "--served-model-name", "m"])
        .args(["--model", dir.to_str().unwrap(), "--max-batch", "2"]);
    if !cache {
        cmd.arg("--no-prefix-cache");
    }
    Server::spawn(cmd, Duration::from_secs(300))
}

/// The reply to `messages` (greedy, 6 tokens).
fn reply(server: &Server, messages: &serde_json::Value) -> String {
    reply_with(server, messages, serde_json::json!({}))
}

/// The same with the request's `extra` fields.
fn reply_with(server: &Server, messages: &serde_json::Value, extra: serde_json::Value) -> String {
    let mut body = serde_json::json!({"model": "m", "messages": messages, "max_tokens": 6,
        "temperature": 0, "ignore_eos": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (code, text) = server.post("/v1/chat/completions", &body.to_string());
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// `n` words of the chat checkpoint's vocabulary, from the `from`th.
fn words(from: usize, n: usize) -> String {
    (from..from + n)
        .map(|i| format!("t{}", 7 + i * 13 % 300))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A chat's first turn: a system prompt and a user message.
fn first_turn() -> serde_json::Value {
    serde_json::json!([
        {"role": "system", "content": words(0, 20)},
        {"role": "user", "content": words(40, 9)},
    ])
}

/// Two turns of a chat; the hits (tokens) `/metrics` counted after each.
fn two_turns(server: &Server) -> (Vec<String>, [f64; 2]) {
    let mut messages = first_turn();
    let first = reply(server, &messages);
    let after_first = server.metric("wgpar:prefix_cache_hits_total");
    let list = messages.as_array_mut().unwrap();
    list.push(serde_json::json!({"role": "assistant", "content": first}));
    list.push(serde_json::json!({"role": "user", "content": words(80, 7)}));
    let second = reply(server, &messages);
    let after_second = server.metric("wgpar:prefix_cache_hits_total");
    (vec![first, second], [after_first, after_second])
}

#[test]
fn a_chats_second_turn_reuses_the_first_over_http() {
    let (dir, _) = hf_support::chat_checkpoint("serve-prefix-chat");
    let mut cached = chat_server(&dir, true);
    let (with, hits) = two_turns(&cached);
    let queries = cached.metric("wgpar:prefix_cache_queries_total");
    let blocks = idle_blocks(&cached);
    cached.terminate(Duration::from_secs(60));
    let mut plain = chat_server(&dir, false);
    let (without, off_hits) = two_turns(&plain);
    let off_queries = plain.metric("wgpar:prefix_cache_queries_total");
    plain.terminate(Duration::from_secs(60));
    assert_eq!(with, without, "the same replies with and without the cache");
    assert!(
        with.iter().all(|r| r.split_whitespace().count() >= 3),
        "{with:?}"
    );
    // The second prompt starts with the first's BOS, system and user messages (32 tokens:
    // t2, t4 + 20 words, t4 + 9 words), which its slot still holds.
    assert_eq!(hits, [0.0, 32.0], "nothing cached before the first turn");
    assert!(queries > hits[1], "{queries} tokens looked up");
    assert_eq!((off_hits, off_queries), ([0.0, 0.0], 0.0));
    // Both turns done: no block is referenced, and the conversation's blocks stay cached.
    assert_eq!(
        blocks.0, 0.0,
        "blocks still referenced with no request running"
    );
    assert!(
        blocks.1 >= 2.0,
        "{} blocks cached after two turns",
        blocks.1
    );
}

/// `/metrics`' KV blocks in use and cached once no sequence holds a slot (waits at most 30 s).
fn idle_blocks(server: &Server) -> (f64, f64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while server.metric("wgpar:kv_slots_used") != 0.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let used = server.metric("wgpar:kv_blocks_used");
    (used, server.metric("wgpar:kv_blocks_cached"))
}

#[test]
fn no_prefix_cache_is_refused_with_a_url_and_turns_must_be_positive() {
    let (ok, _, err) = common::wgpar(&[
        "bench",
        "serve",
        "--model",
        "tiny-llama",
        "--url",
        "http://127.0.0.1:9",
        "--no-prefix-cache",
    ]);
    assert!(!ok);
    assert!(err.contains("--no-prefix-cache"), "{err}");
    let (ok, _, err) = common::wgpar(&["bench", "serve", "--model", "tiny-llama", "--turns", "0"]);
    assert!(!ok);
    assert!(err.contains("--turns"), "{err}");
}

#[test]
fn a_salted_prompt_reuses_only_its_salts_kv_and_cache_prompt_false_none() {
    let (dir, _) = hf_support::chat_checkpoint("serve-prefix-salt");
    // Four slots, so no request below evicts another namespace's slot (least recently used).
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(["serve", "--port", "0", "--served-model-name", "m"])
        .args(["--model", dir.to_str().unwrap(), "--max-batch", "4"]);
    let mut server = Server::spawn(cmd, Duration::from_secs(300));
    let hits = |s: &Server| s.metric("wgpar:prefix_cache_hits_total");
    let first = first_turn();
    reply_with(&server, &first, serde_json::json!({"cache_salt": "alice"}));
    let mut second = first.clone();
    let list = second.as_array_mut().unwrap();
    list.push(serde_json::json!({"role": "assistant", "content": words(120, 4)}));
    list.push(serde_json::json!({"role": "user", "content": words(80, 7)}));
    let mut replies = Vec::new();
    let mut seen = Vec::new();
    for extra in [
        serde_json::json!({"cache_salt": "bob"}),
        serde_json::json!({}),
        serde_json::json!({"cache_salt": "alice"}),
        serde_json::json!({"cache_prompt": false}),
    ] {
        let before = hits(&server);
        replies.push(reply_with(&server, &second, extra.clone()));
        seen.push((extra, hits(&server) - before));
    }
    let refused = server.post(
        "/v1/chat/completions",
        &serde_json::json!({"model": "m", "messages": first, "cache_salt": ""}).to_string(),
    );
    server.terminate(Duration::from_secs(60));
    assert!(replies.windows(2).all(|w| w[0] == w[1]), "{replies:?}");
    // Another salt and the shared namespace find nothing of alice's; alice finds at least her
    // first turn's 32 prompt tokens (as in the unsalted chat above); cache_prompt false looks
    // nothing up.
    let gained: Vec<f64> = seen.iter().map(|(_, h)| *h).collect();
    assert_eq!([gained[0], gained[1], gained[3]], [0.0; 3], "{seen:?}");
    assert!(gained[2] >= 32.0, "{seen:?}");
    assert_eq!(refused.0, 400, "{}", refused.1);
    assert!(refused.1.contains("cache_salt"), "{}", refused.1);
}

/// `wgpar serve` of the chat checkpoint with four slots, `strategy`'s options, cache on or
/// off.
fn choices_server(dir: &hf_support::Scratch, strategy: &[&str], cache: bool) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(["serve", "--port", "0", "--served-model-name", "m"])
        .args(["--model", dir.to_str().unwrap(), "--max-batch", "4"])
        .args(strategy);
    if !cache {
        cmd.arg("--no-prefix-cache");
    }
    Server::spawn(cmd, Duration::from_secs(300))
}

/// The four choices of one request (greedy, or sampled with a seed), by index; its prompt's
/// tokens; the hits (tokens) `/metrics` counted for it.
fn four_choices(server: &Server, sampled: bool) -> (Vec<String>, usize, f64) {
    let messages = serde_json::json!([
        {"role": "system", "content": words(0, 20)},
        {"role": "user", "content": words(40, 16)},
    ]);
    let mut body = serde_json::json!({"model": "m", "messages": messages, "max_tokens": 6,
        "n": 4, "temperature": 0, "ignore_eos": true});
    if sampled {
        (body["temperature"], body["seed"]) = (serde_json::json!(0.9), serde_json::json!(11));
    }
    let before = server.metric("wgpar:prefix_cache_hits_total");
    let (code, text) = server.post("/v1/chat/completions", &body.to_string());
    assert_eq!(code, 200, "{text}");
    let hits = server.metric("wgpar:prefix_cache_hits_total") - before;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut got = vec![String::new(); 4];
    for c in v["choices"].as_array().unwrap() {
        let i = c["index"].as_u64().unwrap() as usize;
        got[i] = c["message"]["content"].as_str().unwrap().to_string();
    }
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    (got, prompt, hits)
}

#[test]
fn the_choices_of_one_request_share_its_prompts_prefill_over_http() {
    let (dir, _) = hf_support::chat_checkpoint("serve-prefix-choices");
    let strategies: [(&str, &[&str]); 3] = [
        ("single", &[]),
        ("tp2", &["--strategy", "tp", "--virtual", "2"]),
        ("pp2", &["--strategy", "pp", "--virtual", "2"]),
    ];
    for (label, strategy) in strategies {
        let mut cached = choices_server(&dir, strategy, true);
        let greedy = four_choices(&cached, false);
        let sampled = four_choices(&cached, true);
        cached.terminate(Duration::from_secs(60));
        let mut plain = choices_server(&dir, strategy, false);
        let (greedy_off, _, greedy_off_hits) = four_choices(&plain, false);
        let (sampled_off, _, sampled_off_hits) = four_choices(&plain, true);
        plain.terminate(Duration::from_secs(60));
        // The prompt's whole blocks before its last token, which each of the three later
        // choices copies from the first's slot (at least).
        let (prompt, blocks) = (greedy.1, (greedy.1 - 1) / 16 * 16);
        assert_eq!(prompt, 40, "{label}");
        for (what, hits) in [("greedy", greedy.2), ("sampled", sampled.2)] {
            assert!(
                hits >= (3 * blocks) as f64,
                "{label} {what}: {hits} tokens hit"
            );
        }
        assert_eq!((greedy_off_hits, sampled_off_hits), (0.0, 0.0), "{label}");
        assert!(
            greedy.0.iter().all(|c| c == &greedy.0[0]),
            "{label}: {greedy:?}"
        );
        assert!(
            greedy.0[0].split_whitespace().count() >= 3,
            "{label}: {greedy:?}"
        );
        assert_eq!(
            greedy.0, greedy_off,
            "{label}: greedy with and without the cache"
        );
        assert!(
            sampled.0.iter().all(|c| !c.is_empty()),
            "{label}: {sampled:?}"
        );
        assert_eq!(
            sampled.0, sampled_off,
            "{label}: each seeded choice as without"
        );
    }
}
