//! The HTTP routes: OpenAI's completions and chat completions (JSON or Server-Sent Events,
//! tool calls parsed out of chat answers), embeddings (an encoder's server, [`super::embeddings`]),
//! models, health and metrics.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{self, Invalid, Params, Prompt};
use super::batcher::{Choices, Ending, Event, Job};
use super::embeddings::EncoderHandle;
use super::limits::Watched;
use super::tools::{CallDelta, CallStream, ToolCall, ToolConstraint, ToolRequest};
use super::{ServerOptions, Shared, TextModel};
use crate::model::constraint::{Constraint, Format, Grammars};
use crate::model::hf::TextStream;
use crate::model::sampling::{RequestPicker, TokenLogprobs};

/// What every handler sees.
#[derive(Clone)]
pub struct AppState {
    shared: Arc<Shared>,
    text: Arc<TextModel>,
    jobs: crossbeam::channel::Sender<Job>,
    api_key: Option<Arc<str>>,
    metrics_open: bool,
    stream_timeout: Duration,
    max_queue: usize,
    ids: Arc<AtomicU64>,
    /// The encoder of an embeddings server (which has no generation engine).
    encoder: Option<Arc<EncoderHandle>>,
    /// The model's token table for structured output, built by the first request that asks
    /// (or why the tokenizer cannot serve one).
    grammars: Arc<OnceLock<Result<Grammars, String>>>,
}

impl AppState {
    pub fn new(
        opts: &ServerOptions,
        text: TextModel,
        shared: Arc<Shared>,
        jobs: crossbeam::channel::Sender<Job>,
    ) -> Self {
        Self {
            shared,
            text: Arc::new(text),
            jobs,
            api_key: opts.api_key.as_deref().map(Arc::from),
            metrics_open: opts.metrics_open,
            stream_timeout: opts.limits.stream_timeout,
            max_queue: opts.max_queue,
            ids: Arc::new(AtomicU64::new(0)),
            encoder: None,
            grammars: Arc::new(OnceLock::new()),
        }
    }

    /// The state of an embeddings server, whose requests go to `encoder`.
    pub fn with_encoder(mut self, encoder: EncoderHandle) -> Self {
        self.encoder = Some(Arc::new(encoder));
        self
    }
}

/// The router, with the API key check (all but /health, and /metrics when it is open) and
/// the body limit.
pub fn router(state: AppState, max_body: usize) -> Router {
    let (text, chat) = match state.encoder {
        Some(_) => (post(encoder_only), post(encoder_only)),
        None => (post(completions), post(chat_completions)),
    };
    let mut api = Router::new()
        .route("/v1/completions", text)
        .route("/v1/chat/completions", chat)
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize));
    let mut open = Router::new().route("/health", get(health));
    if state.metrics_open {
        open = open.route("/metrics", get(metrics));
    } else {
        api = api.route("/metrics", get(metrics));
    }
    let api = api.layer(middleware::from_fn_with_state(state.clone(), require_key));
    open.merge(api)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// An OpenAI-style error body with `status`.
pub(super) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let body = json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

async fn require_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = request.headers().get(header::AUTHORIZATION);
        if !super::auth::authorized(given.map(HeaderValue::as_bytes), key) {
            return error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key: send Authorization: Bearer KEY",
            );
        }
    }
    next.run(request).await
}

async fn health(State(state): State<AppState>) -> Response {
    let s = &state.shared;
    if s.failed.load(Ordering::SeqCst) {
        error(StatusCode::SERVICE_UNAVAILABLE, "the engine failed")
    } else if s.draining.load(Ordering::SeqCst) {
        let body = json!({"status": "draining"});
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    } else if !s.ready.load(Ordering::SeqCst) {
        error(StatusCode::SERVICE_UNAVAILABLE, "loading the model")
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let mut r = state.shared.metrics.render().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(state): State<AppState>) -> Response {
    Json(json!({"object": "list", "data": [{
        "id": state.text.name, "object": "model", "created": now_s(), "owned_by": "wgpar",
        "max_model_len": state.text.max_seq,
    }]}))
    .into_response()
}

/// A 400 naming the field to blame, as OpenAI's `param`.
pub(super) fn invalid(bad: Invalid) -> Response {
    let body = json!({"error": {"message": bad.message, "type": "invalid_request_error",
        "param": bad.param, "code": 400}});
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

/// A body's fields, every one among `known`.
fn fields_of(body: &[u8], known: &[&str]) -> Result<serde_json::Map<String, Value>, Invalid> {
    let obj = api::object(body)?;
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(Invalid::new(
            k,
            format!("'{k}' is not a field of this route"),
        )),
        None => Ok(obj),
    }
}

/// llama-server's `POST /tokenize`: `content`, `add_special` (default false), `with_pieces`.
async fn tokenize(State(state): State<AppState>, body: Bytes) -> Response {
    let run = || -> Result<Value, Invalid> {
        let obj = fields_of(&body, &["content", "add_special", "with_pieces"])?;
        let flag = |name: &str| match obj.get(name) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(Invalid::new(
                name,
                format!("'{name}' must be true or false, not {v}"),
            )),
        };
        let Some(Value::String(content)) = obj.get("content") else {
            return Err(Invalid::new("content", "'content' must be a string".into()));
        };
        let tok = &state.text.tokenizer;
        let ids = if flag("add_special")? {
            tok.encode(content)
        } else {
            tok.encode_plain(content)
        }
        .map_err(|e| Invalid::from(e.to_string()))?;
        if !flag("with_pieces")? {
            return Ok(json!({"tokens": ids}));
        }
        let pieces = ids
            .iter()
            .map(|&id| Ok(json!({"id": id, "piece": tok.decode(&[id])?})))
            .collect::<crate::Result<Vec<_>>>()
            .map_err(|e| Invalid::from(e.to_string()))?;
        Ok(json!({"tokens": pieces}))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(bad) => invalid(bad),
    }
}

/// llama-server's `POST /detokenize`: `tokens` to `content`.
async fn detokenize(State(state): State<AppState>, body: Bytes) -> Response {
    let run = || -> Result<Value, Invalid> {
        let obj = fields_of(&body, &["tokens"])?;
        let vocab = state.text.vocab;
        let bad = || {
            Invalid::new(
                "tokens",
                format!("'tokens' must list token ids below {vocab}"),
            )
        };
        let Some(Value::Array(list)) = obj.get("tokens") else {
            return Err(bad());
        };
        let ids = list
            .iter()
            .map(|t| {
                t.as_u64()
                    .filter(|&t| (t as usize) < vocab)
                    .map(|t| t as u32)
                    .ok_or_else(bad)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let content = state
            .text
            .tokenizer
            .decode(&ids)
            .map_err(|e| Invalid::from(e.to_string()))?;
        Ok(json!({"content": content}))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(bad) => invalid(bad),
    }
}

/// Completions or chat.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Text,
    Chat,
}

async fn embeddings(State(state): State<AppState>, body: Bytes) -> Response {
    let encoder = state.encoder.as_deref();
    super::embeddings::respond(encoder, &state.text, &state.shared, &body).await
}

/// Completions and chat on an encoder's server.
async fn encoder_only(State(state): State<AppState>) -> Response {
    let m = format!(
        "model '{}' is an encoder (BERT-style): it serves /v1/embeddings only; completions \
         and chat need a decoder",
        state.text.name
    );
    error(StatusCode::BAD_REQUEST, m)
}

async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    generate(state, &body, Kind::Text).await
}

async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    generate(state, &body, Kind::Chat).await
}

/// A checked request, ready for the engine: its prompts' token ids (one entry per prompt;
/// each gets `params.n` choices).
struct Accepted {
    prompts: Vec<Vec<u32>>,
    max_new: usize,
    params: Params,
    /// A chat request's tools (`None`: its answer is not parsed for calls).
    tools: Option<ToolRequest>,
}

/// Why a request is not served.
enum Refusal {
    /// A 400.
    Bad(Invalid),
    /// `model` names another model: a 404, as vLLM answers.
    NoModel(String),
}

impl From<Invalid> for Refusal {
    fn from(bad: Invalid) -> Self {
        Refusal::Bad(bad)
    }
}

/// A prompt's token ids.
fn prompt_ids(
    text: &TextModel,
    prompt: Prompt,
    params: &Params,
    tools: Option<&ToolRequest>,
) -> Result<Vec<u32>, Invalid> {
    let ids = match prompt {
        Prompt::Tokens(ids) => ids,
        Prompt::Text(t) => text
            .tokenizer
            .encode(&t)
            .map_err(|e| Invalid::new("prompt", e.to_string()))?,
        Prompt::Chat(messages) => {
            let template = text.template.as_ref().ok_or_else(|| {
                Invalid::new(
                    "messages",
                    format!(
                        "model '{}' has no chat template (tokenizer_config.json's chat_template, \
                         chat_template.jinja, or the GGUF's tokenizer.chat_template; or serve \
                         --chat-template FILE): use /v1/completions",
                        text.name
                    ),
                )
            })?;
            let defs = tools.map(|t| &t.tools[..]);
            let rendered =
                template.render_with_tools(&messages, defs, params.add_generation_prompt)?;
            text.tokenizer
                .encode_plain(&rendered)
                .map_err(|e| Invalid::new("messages", e.to_string()))?
        }
    };
    if ids.is_empty() {
        return Err(Invalid::new("prompt", "the prompt has no tokens".into()));
    }
    if let Some(t) = ids.iter().find(|&&t| t as usize >= text.vocab) {
        return Err(Invalid::new(
            "prompt",
            format!("token id {t} is outside the vocabulary of {}", text.vocab),
        ));
    }
    Ok(ids)
}

/// A request's prompts as token ids, and a chat request's tools (a forced `tool_choice`
/// sets `params.format` to the calls' schema).
fn prompts_of(
    text: &TextModel,
    obj: &serde_json::Map<String, Value>,
    kind: Kind,
    params: &mut Params,
) -> Result<(Vec<Vec<u32>>, Option<ToolRequest>), Invalid> {
    let (prompts, tools) = match kind {
        Kind::Text => (api::completion_prompts(obj)?, None),
        Kind::Chat => (
            vec![api::chat_messages(obj)?],
            ToolRequest::from_request(obj, text.template.as_ref())?,
        ),
    };
    if let Some(forced) = tools.as_ref().and_then(ToolRequest::constraint) {
        params.format = Some(forced_format(params, forced)?);
    }
    let ids = prompts
        .into_iter()
        .map(|p| prompt_ids(text, p, params, tools.as_ref()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((ids, tools))
}

/// Reads and checks a request: fields, model, prompts, context; the message names what is
/// wrong.
fn accept(text: &TextModel, body: &[u8], kind: Kind) -> Result<Accepted, Refusal> {
    let obj = api::object(body)?;
    let route = match kind {
        Kind::Text => api::Route::Completions,
        Kind::Chat => api::Route::Chat,
    };
    let mut params = api::params(&obj, route, text.vocab)?;
    if let Some(m) = params.model.as_deref().filter(|&m| m != text.name) {
        return Err(Refusal::NoModel(format!(
            "the model `{m}` does not exist: this server serves `{}`",
            text.name
        )));
    }
    let (prompts, tools) = prompts_of(text, &obj, kind, &mut params)?;
    let scoring = params.echo && params.logprobs.is_some();
    if params.max_tokens == Some(0) && !scoring {
        return Err(Invalid::new(
            "max_tokens",
            "'max_tokens' is 0: only a request with 'echo' and 'logprobs' (scoring its prompt) may generate nothing".into(),
        )
        .into());
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    // The last generated token is sampled, never cached.
    let room = (text.max_seq + 1).saturating_sub(longest);
    let max_new = match (params.max_tokens, kind) {
        (Some(n), _) => n,
        (None, Kind::Text) => 16.min(room).max(1),
        (None, Kind::Chat) => room.max(1),
    };
    if params.rules.min_tokens > max_new {
        return Err(Invalid::new(
            "min_tokens",
            format!(
                "'min_tokens' {} is more than max_tokens {max_new}",
                params.rules.min_tokens
            ),
        )
        .into());
    }
    let need = longest + max_new.saturating_sub(1);
    if need > text.max_seq {
        return Err(Invalid::new(
            "max_tokens",
            format!(
                "{longest} prompt tokens + max_tokens {max_new} need {need} tokens of context, \
                 but the model holds {} (--max-seq)",
                text.max_seq
            ),
        )
        .into());
    }
    Ok(Accepted {
        prompts,
        max_new,
        params,
        tools,
    })
}

/// The engine's jobs for a request, one per choice (prompt-major), and their receivers.
/// Each choice's receiver and ending, in the order of the jobs.
type Channels = Vec<(UnboundedReceiver<Event>, Arc<Ending>)>;

/// The format a forced `tool_choice` (`required` or a named function) holds the answer to:
/// the calls' schema, as `response_format: json_schema` would. Refused beside it, by name:
/// `response_format` (two schemas for one answer; vLLM refuses it too), and `min_tokens` and
/// `allowed_token_ids`, which could leave a step where the schema's tokens are all banned.
fn forced_format(params: &Params, forced: ToolConstraint) -> Result<Format, Invalid> {
    let clash = [
        (params.format_field, params.format.is_some()),
        ("min_tokens", params.rules.min_tokens > 0),
        ("allowed_token_ids", params.rules.allowed.is_some()),
    ];
    if let Some((name, _)) = clash.into_iter().find(|(_, set)| *set) {
        return Err(Invalid::new(
            name,
            format!(
                "'{name}' cannot be combined with 'tool_choice' \"required\" or a named \
                 function: the answer is held to the calls' schema"
            ),
        ));
    }
    Ok(Format::JsonSchema(forced.schema))
}

/// The grammar a request's `response_format` (or forced `tool_choice`) asks for, compiled
/// against the model's tokens.
fn constraint(state: &AppState, accepted: &Accepted) -> Result<Option<Constraint>, Invalid> {
    let Some(format) = &accepted.params.format else {
        return Ok(None);
    };
    let forced = (accepted.tools.as_ref()).is_some_and(|t| t.constraint().is_some());
    let field = if forced {
        "tools"
    } else {
        accepted.params.format_field
    };
    let bad = |m: String| Invalid::new(field, format!("'{field}': {m}"));
    let grammars = state.grammars.get_or_init(|| {
        let text = &state.text;
        let json = text.tokenizer.to_json().map_err(|e| e.to_string())?;
        Grammars::new(&json, text.vocab, &text.eos).map_err(|e| e.to_string())
    });
    let grammars = grammars.as_ref().map_err(|e| bad(e.clone()))?;
    let compiled = grammars.compile(format);
    compiled
        .map(Some)
        .map_err(|e| bad(format!("the {} does not compile: {e}", format.kind())))
}

fn jobs(
    accepted: &Accepted,
    eos: &[u32],
    constraint: Option<Constraint>,
) -> Result<(Vec<Job>, Channels), Invalid> {
    let p = &accepted.params;
    let scoring = p.echo && p.logprobs.is_some();
    let (mut jobs, mut rxs) = (Vec::new(), Vec::new());
    for prompt in &accepted.prompts {
        // The choices of a prompt share its prefill (where the prefix cache can lend it).
        let choices = (p.n > 1).then(Choices::fresh);
        for i in 0..p.n {
            let mut rules = p.rules.clone();
            if rules.min_tokens > 0 {
                let eos = if p.ignore_eos { &[][..] } else { eos };
                rules.end_tokens = [eos, &p.stop_ids[..]].concat();
            }
            // Each choice its own stream: a seeded request's choices differ, repeatably.
            if let Some(s) = rules.sampling.as_mut() {
                s.seed = s.seed.wrapping_add(i as u64);
            }
            // A greedy structured request is masked in the device's pick; any other masks
            // its read-back logits in its own picker.
            let host = scoring || p.logprobs.is_some() || !rules.is_greedy();
            let picker = host
                .then(|| RequestPicker::new(rules, p.logprobs, prompt))
                .transpose()
                .map_err(|e| Invalid::from(e.to_string()))?
                .map(|picker| match &constraint {
                    Some(c) => picker.with_constraint(c.clone()),
                    None => picker,
                });
            let device_constraint = constraint.clone().filter(|_| !host);
            let split = if scoring { 1 } else { prompt.len() };
            let (tx, rx) = unbounded_channel();
            let ending = Arc::new(Ending::default());
            jobs.push(Job {
                prompt: prompt[..split].to_vec(),
                score: prompt[split..].to_vec(),
                max_new: accepted.max_new,
                events: tx,
                accepted: Instant::now(),
                ignore_eos: p.ignore_eos,
                stop_ids: p.stop_ids.clone(),
                picker,
                constraint: device_constraint,
                ending: ending.clone(),
                cache: p.cache,
                choices,
            });
            rxs.push((rx, ending));
        }
    }
    Ok((jobs, rxs))
}

async fn generate(state: AppState, body: &[u8], kind: Kind) -> Response {
    let shared = &state.shared;
    if shared.failed.load(Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine failed");
    }
    if shared.draining.load(Ordering::SeqCst) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        );
    }
    let checked = accept(&state.text, body, kind).and_then(|a| {
        let c = constraint(&state, &a)?;
        let j = jobs(&a, &state.text.eos, c).map_err(Refusal::Bad)?;
        Ok((a, j))
    });
    let (accepted, (jobs, rxs)) = match checked {
        Ok(a) => a,
        Err(refusal) => {
            shared.metrics.rejected.inc();
            return match refusal {
                Refusal::Bad(bad) => invalid(bad),
                Refusal::NoModel(m) => {
                    let body = json!({"error": {"message": m, "type": "NotFoundError",
                        "param": "model", "code": 404}});
                    (StatusCode::NOT_FOUND, Json(body)).into_response()
                }
            };
        }
    };
    let count = jobs.len();
    if shared.queued.fetch_add(count, Ordering::SeqCst) + count > state.max_queue {
        shared.queued.fetch_sub(count, Ordering::SeqCst);
        shared.metrics.rejected.inc();
        let mut r = error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "{} requests are waiting already (--max-queue)",
                state.max_queue
            ),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return r;
    }
    let prompt_tokens: usize = accepted.prompts.iter().map(Vec::len).sum();
    shared.metrics.prompt_tokens.inc_by(prompt_tokens as u64);
    for job in jobs {
        if job.max_new == 0 && job.score.is_empty() {
            // A one-token prompt scored with nothing to generate: no step to run.
            shared.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = job.events.send(Event::Done { eos: false });
        } else if state.jobs.send(job).is_err() {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            );
        }
    }
    let id = state.ids.fetch_add(1, Ordering::Relaxed);
    let out = Output::new(&state.text, kind, id, accepted, rxs);
    if out.params.stream {
        stream_response(out, state.stream_timeout).into_response()
    } else {
        whole_response(out).await
    }
}

/// What ends a choice's text: stop strings, from `min_tokens` generated tokens on.
struct Stops {
    strings: Vec<String>,
    min_tokens: usize,
}

/// Text of the generated tokens, grown token by token.
struct Detok {
    generated: usize,
    /// The text keeps the stop string that ended it (`include_stop_str_in_output`).
    keep_stop: bool,
    /// Decodes each token in the context of the ones before it, the prompt's included.
    stream: TextStream,
    /// The text sent so far.
    sent: String,
    /// The whole text so far (cut at a stop string): `sent` and what is held back.
    text: String,
}

impl Detok {
    fn new(text: &TextModel, prompt: &[u32], keep_stop: bool) -> Self {
        Self {
            generated: 0,
            keep_stop,
            stream: text.tokenizer.stream_after(prompt),
            sent: String::new(),
            text: String::new(),
        }
    }

    /// Adds `token`; returns the text that may go out now and whether a stop string ended
    /// the request. Held back: a partial character, and a tail that could begin a stop string
    /// (so a client never sees part of one).
    fn push(&mut self, text: &TextModel, token: u32, stop: &Stops) -> (String, bool) {
        self.generated += 1;
        // Before `min_tokens`, stop strings do not stop.
        let stop = match self.generated < stop.min_tokens {
            true => &[][..],
            false => &stop.strings[..],
        };
        // The prompt's tokens are the stream's context, which keeps word boundaries, as
        // `run --prompt`; a partial character comes back empty until it is whole.
        let new = (text.tokenizer.step(&mut self.stream, token)).unwrap_or_default();
        self.text.push_str(&new);
        let stopped = api::stop_at(&self.text, stop);
        let ready = match stopped {
            Some((at, end)) => {
                let cut = if self.keep_stop { end } else { at };
                self.text.truncate(cut);
                cut
            }
            None => self.text.len() - api::partial_stop(&self.text, stop),
        };
        (self.release(ready), stopped.is_some())
    }

    /// The held-back rest, once the request has ended without a stop string: a character the
    /// last tokens left incomplete included (as U+FFFD).
    fn flush(&mut self, text: &TextModel) -> String {
        let rest = (text.tokenizer.finish(&self.stream)).unwrap_or_default();
        self.text.push_str(&rest);
        self.release(self.text.len())
    }

    /// Moves `text[..ready]` into `sent`; returns what is new.
    fn release(&mut self, ready: usize) -> String {
        let ready = &self.text[..ready];
        let new = ready
            .strip_prefix(self.sent.as_str())
            .unwrap_or_default()
            .to_string();
        if ready.starts_with(self.sent.as_str()) {
            self.sent = ready.to_string();
        }
        new
    }
}

/// One token's log-probs as a response shows them.
struct LogprobEntry {
    token: String,
    /// `None`: the prompt's first token, which nothing predicts.
    logprob: Option<f32>,
    top: Vec<(String, f32)>,
}

fn entry(text: &TextModel, lp: &TokenLogprobs) -> LogprobEntry {
    let piece = |id: u32| text.tokenizer.decode(&[id]).unwrap_or_default();
    LogprobEntry {
        token: piece(lp.id),
        logprob: Some(lp.logprob),
        top: lp.top.iter().map(|&(id, l)| (piece(id), l)).collect(),
    }
}

/// One choice of a response.
struct Choice {
    detok: Detok,
    /// `echo`'s prompt text, not yet sent.
    echo: String,
    /// Log-prob entries not yet sent (all of them, for a whole response).
    logprobs: Vec<LogprobEntry>,
    /// Characters of the text before the first unsent entry (completions' `text_offset`).
    offset: usize,
    finish: Option<&'static str>,
    rx: Option<UnboundedReceiver<Event>>,
    /// Tells the engine that a stop string ended this choice, or that its client stalled.
    ending: Arc<Ending>,
    /// Watches the text for tool calls (a chat request with tools).
    calls: Option<CallStream>,
    /// The calls found once the choice ended.
    tool_calls: Vec<ToolCall>,
    /// Tool-call deltas not yet streamed.
    deltas: Vec<CallDelta>,
}

impl Choice {
    /// The content so far: the text, less any tool calls.
    fn content(&self) -> &str {
        match &self.calls {
            Some(calls) => calls.content(),
            None => &self.detok.sent,
        }
    }

    /// Passes a delta of text through the tool-call watch (its call deltas queued); `end`:
    /// the choice ended with it. An error where a call streamed in part is no call.
    fn content_delta(&mut self, delta: String, end: bool) -> Result<String, String> {
        let Some(calls) = self.calls.as_mut() else {
            return Ok(delta);
        };
        let pushed = calls.push(&delta);
        let mut out = pushed.content;
        self.deltas.extend(pushed.calls);
        if end {
            let done = calls.finish()?;
            out.push_str(&done.content);
            self.deltas.extend(done.deltas);
            if !done.calls.is_empty() {
                self.finish = Some("tool_calls");
            }
            self.tool_calls = done.calls;
        }
        Ok(out)
    }
}

/// What an event makes of a choice.
enum Step {
    Nothing,
    Delta(String),
    Finished(String),
    Failed(String),
}

/// What a response is built from.
struct Output {
    text: Arc<TextModel>,
    kind: Kind,
    id: String,
    created: u64,
    prompt_tokens: usize,
    choices: Vec<Choice>,
    stops: Stops,
    params: Params,
}

/// What a choice's channel closing early means: the engine went away mid-request (its
/// thread ended), or the request was cancelled because its client stopped reading.
fn ended_early(ending: &Ending) -> String {
    if ending.cancelled() {
        "cancelled: the client did not read the stream for --stream-timeout".into()
    } else {
        "the engine stopped before the request finished".into()
    }
}

impl Output {
    fn new(text: &Arc<TextModel>, kind: Kind, id: u64, accepted: Accepted, rxs: Channels) -> Self {
        let p = &accepted.params;
        let mut rxs = rxs.into_iter();
        let mut choices = Vec::new();
        for prompt in &accepted.prompts {
            let echo = match p.echo {
                true => text.tokenizer.decode(prompt).unwrap_or_default(),
                false => String::new(),
            };
            for _ in 0..p.n {
                let mut logprobs = Vec::new();
                if p.echo && p.logprobs.is_some() {
                    // The first prompt token has no log-prob: nothing comes before it.
                    logprobs.push(LogprobEntry {
                        token: text.tokenizer.decode(&prompt[..1]).unwrap_or_default(),
                        logprob: None,
                        top: Vec::new(),
                    });
                }
                let (rx, ending) = rxs.next().unzip();
                choices.push(Choice {
                    detok: Detok::new(text, prompt, p.include_stop),
                    offset: if p.echo { 0 } else { echo_len(text, prompt) },
                    echo: echo.clone(),
                    logprobs,
                    finish: None,
                    rx,
                    ending: ending.unwrap_or_default(),
                    calls: (accepted.tools.as_ref().map(ToolRequest::stream)).map(|s| {
                        if p.stream {
                            s.live()
                        } else {
                            s
                        }
                    }),
                    tool_calls: Vec::new(),
                    deltas: Vec::new(),
                });
            }
        }
        Self {
            text: text.clone(),
            kind,
            id: match kind {
                Kind::Text => format!("cmpl-{id}"),
                Kind::Chat => format!("chatcmpl-{id}"),
            },
            created: now_s(),
            prompt_tokens: accepted.prompts.iter().map(Vec::len).sum(),
            choices,
            stops: Stops {
                strings: p.stop.clone(),
                min_tokens: p.rules.min_tokens,
            },
            params: accepted.params,
        }
    }

    fn usage(&self) -> Value {
        let p = self.prompt_tokens;
        let c: usize = self.choices.iter().map(|c| c.detok.generated).sum();
        json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
    }

    /// The next event of any choice still open; `None` once every choice has finished.
    async fn next_event(&mut self) -> Option<(usize, Event)> {
        std::future::poll_fn(|cx| {
            let mut open = false;
            for (i, c) in self.choices.iter_mut().enumerate() {
                let Some(rx) = c.rx.as_mut() else { continue };
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(e)) => return Poll::Ready(Some((i, e))),
                    Poll::Ready(None) => {
                        // Closed without Done: an error, never a truncated answer.
                        c.rx = None;
                        let gone = Event::Error(ended_early(&c.ending));
                        return Poll::Ready(Some((i, gone)));
                    }
                    Poll::Pending => open = true,
                }
            }
            if open {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        })
        .await
    }

    /// Applies choice `i`'s `event`.
    fn apply(&mut self, i: usize, event: Event) -> Step {
        let text = &self.text;
        let stop = &self.stops;
        let c = &mut self.choices[i];
        match event {
            Event::Scored(lp) => {
                c.logprobs.push(entry(text, &lp));
                Step::Nothing
            }
            Event::Token(picked) => {
                if let Some(lp) = &picked.logprobs {
                    c.logprobs.push(entry(text, lp));
                }
                match c.detok.push(text, picked.id, stop) {
                    (d, true) => {
                        // A stop string finished the choice: the engine frees its slot and
                        // counts it as finished.
                        c.finish = Some("stop");
                        c.ending.stop();
                        c.rx = None;
                        c.content_delta(d, true)
                            .map_or_else(Step::Failed, Step::Finished)
                    }
                    (d, false) => match c.content_delta(d, false) {
                        Ok(d) if d.is_empty() && c.logprobs.is_empty() && c.deltas.is_empty() => {
                            Step::Nothing
                        }
                        Ok(d) => Step::Delta(d),
                        Err(e) => Step::Failed(e),
                    },
                }
            }
            Event::Done { eos } => {
                c.finish = Some(if eos { "stop" } else { "length" });
                c.rx = None;
                let rest = c.detok.flush(text);
                c.content_delta(rest, true)
                    .map_or_else(Step::Failed, Step::Finished)
            }
            Event::Error(e) => Step::Failed(e),
        }
    }

    /// Choice `i`'s log-probs not yet sent, in the route's shape (taken).
    fn logprobs(&mut self, i: usize) -> Value {
        if self.params.logprobs.is_none() {
            return Value::Null;
        }
        let c = &mut self.choices[i];
        let entries = std::mem::take(&mut c.logprobs);
        if self.kind == Kind::Chat {
            let one = |token: &str, lp: f32| json!({"token": token, "logprob": lp, "bytes": token.as_bytes()});
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut v = one(&e.token, e.logprob.unwrap_or(0.0));
                    v["top_logprobs"] = e.top.iter().map(|(t, l)| one(t, *l)).collect();
                    v
                })
                .collect();
            return json!({ "content": content });
        }
        let mut offsets = Vec::new();
        for e in &entries {
            offsets.push(c.offset);
            c.offset += e.token.chars().count();
        }
        let top: Vec<Value> = entries
            .iter()
            .map(|e| match e.logprob {
                None => Value::Null,
                Some(_) => {
                    Value::Object(e.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect())
                }
            })
            .collect();
        json!({"tokens": entries.iter().map(|e| e.token.as_str()).collect::<Vec<_>>(),
            "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
            "top_logprobs": top, "text_offset": offsets})
    }

    /// Choice `i`: `text` is the delta (streaming) or the whole text.
    fn choice(&mut self, i: usize, text: &str, stream: bool) -> Value {
        let echo = std::mem::take(&mut self.choices[i].echo);
        let text = format!("{echo}{text}");
        let finish = self.choices[i].finish;
        let logprobs = self.logprobs(i);
        let calls = &self.choices[i].tool_calls;
        let message = || {
            let mut m = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                // OpenAI's `content` is null beside calls, unless the model wrote text too.
                if text.trim().is_empty() && !stream {
                    m["content"] = Value::Null;
                }
                let listed = calls.iter().enumerate().map(|(k, c)| c.to_json(k));
                m["tool_calls"] = listed.collect();
            }
            m
        };
        match (self.kind, stream) {
            (Kind::Text, _) => {
                json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
            (Kind::Chat, false) => json!({"index": i, "logprobs": logprobs,
                "finish_reason": finish, "message": message()}),
            (Kind::Chat, true) => json!({"index": i, "logprobs": logprobs,
                "finish_reason": finish, "delta": message()}),
        }
    }

    /// Choice `i`'s streamed chunks for `delta`: one; or, with tool-call deltas queued, as
    /// OpenAI streams them: the text (if any), then a chunk per delta (a call's header with
    /// its id, type and name, or a piece of its arguments), then, where the choice ended, one
    /// with the finish reason.
    fn stream_chunks(&mut self, i: usize, delta: &str) -> Vec<Value> {
        // Taken so that the text's chunk does not list the calls (they go out as deltas).
        let calls = std::mem::take(&mut self.choices[i].tool_calls);
        let deltas = std::mem::take(&mut self.choices[i].deltas);
        let finish = match deltas.is_empty() {
            true => self.choices[i].finish,
            false => self.choices[i].finish.take(),
        };
        let text = self.choice(i, delta, true);
        let mut chunks = Vec::new();
        if deltas.is_empty() || !delta.is_empty() || !text["logprobs"].is_null() {
            chunks.push(text);
        }
        let piece = |delta: Value, finish: Option<&str>| json!({"index": i, "delta": delta, "logprobs": null, "finish_reason": finish});
        for d in &deltas {
            chunks.push(piece(json!({"tool_calls": [d.to_json()]}), None));
        }
        if !deltas.is_empty() && finish.is_some() {
            chunks.push(piece(json!({}), finish));
        }
        self.choices[i].finish = finish;
        self.choices[i].tool_calls = calls;
        chunks
            .into_iter()
            .map(|c| self.body(vec![c], true))
            .collect()
    }

    /// A body around `choices`.
    fn body(&self, choices: Vec<Value>, stream: bool) -> Value {
        let object = match (self.kind, stream) {
            (Kind::Text, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        };
        let mut body = json!({"id": self.id, "object": object, "created": self.created,
            "model": self.text.name, "choices": choices});
        if !stream {
            body["usage"] = self.usage();
        } else if self.params.include_usage {
            body["usage"] = Value::Null;
        }
        body
    }
}

/// Characters of a prompt's text (where completions' `text_offset` starts without `echo`).
fn echo_len(text: &TextModel, prompt: &[u32]) -> usize {
    text.tokenizer
        .decode(prompt)
        .map_or(0, |t| t.chars().count())
}

/// Waits for every choice's tokens, then answers with one JSON body.
async fn whole_response(mut out: Output) -> Response {
    while let Some((i, event)) = out.next_event().await {
        if let Step::Failed(e) = out.apply(i, event) {
            return error(StatusCode::INTERNAL_SERVER_ERROR, e);
        }
    }
    let choices = (0..out.choices.len())
        .map(|i| {
            let text = out.choices[i].content().to_string();
            out.choice(i, &text, false)
        })
        .collect();
    Json(out.body(choices, false)).into_response()
}

/// Where a stream is.
enum Phase {
    Tokens,
    /// Chunks still to send before the next event (a choice's tool calls).
    Queued(Vec<Value>),
    Done,
    Over,
}

/// One `data:` chunk per token and choice, each choice's finish chunk, usage if asked, and
/// `[DONE]`.
/// A client that leaves an event unread for `stall` is cancelled ([`Watched`]).
fn stream_response(
    out: Output,
    stall: Duration,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let endings = out.choices.iter().map(|c| c.ending.clone()).collect();
    let events = stream::unfold((out, Phase::Tokens), |(mut out, phase)| async move {
        let data = |v: Value| SseEvent::default().data(v.to_string());
        match phase {
            Phase::Over => None,
            Phase::Queued(mut chunks) => {
                let chunk = chunks.remove(0);
                let next = match chunks.is_empty() {
                    true => Phase::Tokens,
                    false => Phase::Queued(chunks),
                };
                Some((Ok(data(chunk)), (out, next)))
            }
            Phase::Done => Some((Ok(SseEvent::default().data("[DONE]")), (out, Phase::Over))),
            Phase::Tokens => loop {
                let Some((i, event)) = out.next_event().await else {
                    // Every choice has finished: usage if asked, then [DONE].
                    if !out.params.include_usage {
                        return Some((Ok(SseEvent::default().data("[DONE]")), (out, Phase::Over)));
                    }
                    let mut body = out.body(Vec::new(), true);
                    body["usage"] = out.usage();
                    return Some((Ok(data(body)), (out, Phase::Done)));
                };
                let delta = match out.apply(i, event) {
                    Step::Nothing => continue,
                    Step::Delta(d) | Step::Finished(d) => d,
                    Step::Failed(e) => {
                        let body =
                            json!({"error": {"message": e, "type": "server_error", "code": 500}});
                        return Some((Ok(data(body)), (out, Phase::Over)));
                    }
                };
                let mut chunks = out.stream_chunks(i, &delta);
                let chunk = chunks.remove(0);
                let next = match chunks.is_empty() {
                    true => Phase::Tokens,
                    false => Phase::Queued(chunks),
                };
                return Some((Ok(data(chunk)), (out, next)));
            },
        }
    });
    Sse::new(Watched::new(events, endings, stall))
}
