//! The HTTP routes: OpenAI's completions and chat completions (JSON or Server-Sent Events),
//! models, health and metrics.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
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

use super::api::{self, Params, Prompt};
use super::batcher::{Ending, Event, Job};
use super::limits::Watched;
use super::{ServerOptions, Shared, TextModel};
use crate::model::hf::TextStream;
use crate::model::sampling::Sampler;

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
        }
    }
}

/// The router, with the API key check (all but /health, and /metrics when it is open) and
/// the body limit.
pub fn router(state: AppState, max_body: usize) -> Router {
    let mut api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models));
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
fn error(status: StatusCode, message: impl Into<String>) -> Response {
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

/// Completions or chat.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Text,
    Chat,
}

async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    generate(state, &body, Kind::Text).await
}

async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    generate(state, &body, Kind::Chat).await
}

/// A checked request, ready for the engine.
struct Accepted {
    prompt: Vec<u32>,
    max_new: usize,
    params: Params,
}

/// Reads and checks a request: fields, prompt, context; the message names what is wrong.
fn accept(text: &TextModel, body: &[u8], kind: Kind) -> Result<Accepted, String> {
    let obj = api::object(body)?;
    let params = api::params(&obj)?;
    let prompt = match kind {
        Kind::Text => api::completion_prompt(&obj)?,
        Kind::Chat => api::chat_messages(&obj)?,
    };
    let ids = match prompt {
        Prompt::Tokens(ids) => ids,
        Prompt::Text(t) => text.tokenizer.encode(&t).map_err(|e| e.to_string())?,
        Prompt::Chat(messages) => {
            let template = text.template.as_ref().ok_or_else(|| {
                format!(
                    "model '{}' has no chat template (tokenizer_config.json's chat_template or \
                     chat_template.jinja): use /v1/completions",
                    text.name
                )
            })?;
            let rendered = template.render(&messages)?;
            text.tokenizer
                .encode_plain(&rendered)
                .map_err(|e| e.to_string())?
        }
    };
    if ids.is_empty() {
        return Err("the prompt has no tokens".into());
    }
    if let Some(t) = ids.iter().find(|&&t| t as usize >= text.vocab) {
        return Err(format!(
            "token id {t} is outside the vocabulary of {}",
            text.vocab
        ));
    }
    // The last generated token is sampled, never cached.
    let room = (text.max_seq + 1).saturating_sub(ids.len());
    let max_new = match (params.max_tokens, kind) {
        (Some(n), _) => n,
        (None, Kind::Text) => 16.min(room).max(1),
        (None, Kind::Chat) => room.max(1),
    };
    if ids.len() + max_new - 1 > text.max_seq {
        return Err(format!(
            "{} prompt tokens + max_tokens {max_new} need {} tokens of context, but the \
             model holds {} (--max-seq)",
            ids.len(),
            ids.len() + max_new - 1,
            text.max_seq
        ));
    }
    Ok(Accepted {
        prompt: ids,
        max_new,
        params,
    })
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
    let accepted = match accept(&state.text, body, kind) {
        Ok(a) => a,
        Err(message) => {
            shared.metrics.rejected.inc();
            return error(StatusCode::BAD_REQUEST, message);
        }
    };
    if shared.queued.fetch_add(1, Ordering::SeqCst) >= state.max_queue {
        shared.queued.fetch_sub(1, Ordering::SeqCst);
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
    let sampler = match accepted.params.sampling.map(Sampler::new).transpose() {
        Ok(s) => s,
        Err(e) => {
            shared.queued.fetch_sub(1, Ordering::SeqCst);
            shared.metrics.rejected.inc();
            return error(StatusCode::BAD_REQUEST, e.to_string());
        }
    };
    let (tx, rx) = unbounded_channel();
    let ending = Arc::new(Ending::default());
    shared
        .metrics
        .prompt_tokens
        .inc_by(accepted.prompt.len() as u64);
    let job = Job {
        prompt: accepted.prompt.clone(),
        max_new: accepted.max_new,
        events: tx,
        accepted: Instant::now(),
        ignore_eos: accepted.params.ignore_eos,
        sampler,
        ending: ending.clone(),
    };
    if state.jobs.send(job).is_err() {
        shared.queued.fetch_sub(1, Ordering::SeqCst);
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        );
    }
    let id = state.ids.fetch_add(1, Ordering::Relaxed);
    let out = Output {
        text: state.text.clone(),
        kind,
        id: match kind {
            Kind::Text => format!("cmpl-{id}"),
            Kind::Chat => format!("chatcmpl-{id}"),
        },
        created: now_s(),
        detok: Detok::new(&state.text, accepted.prompt),
        params: accepted.params,
        ending,
    };
    if out.params.stream {
        stream_response(out, rx, state.stream_timeout).into_response()
    } else {
        whole_response(out, rx).await
    }
}

/// Text of the generated tokens, grown token by token.
struct Detok {
    prompt_len: usize,
    generated: usize,
    /// Decodes each token in the context of the ones before it, the prompt's included.
    stream: TextStream,
    /// The text sent so far.
    sent: String,
    /// The whole text so far (cut at a stop string): `sent` and what is held back.
    text: String,
}

impl Detok {
    fn new(text: &TextModel, prompt: Vec<u32>) -> Self {
        Self {
            prompt_len: prompt.len(),
            generated: 0,
            stream: text.tokenizer.stream_after(&prompt),
            sent: String::new(),
            text: String::new(),
        }
    }

    fn generated(&self) -> usize {
        self.generated
    }

    /// Adds `token`; returns the text that may go out now and whether a stop string ended
    /// the request. Held back: a partial character, and a tail that could begin a stop string
    /// (so a client never sees part of one).
    fn push(&mut self, text: &TextModel, token: u32, stop: &[String]) -> (String, bool) {
        self.generated += 1;
        // The prompt's tokens are the stream's context, which keeps word boundaries, as
        // `run --prompt`; a partial character comes back empty until it is whole.
        let new = (text.tokenizer.step(&mut self.stream, token)).unwrap_or_default();
        self.text.push_str(&new);
        let stopped = api::stop_at(&self.text, stop);
        let ready = match stopped {
            Some(at) => {
                self.text.truncate(at);
                at
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

/// What a response is built from.
struct Output {
    text: Arc<TextModel>,
    kind: Kind,
    id: String,
    created: u64,
    detok: Detok,
    params: Params,
    /// Tells the engine that a stop string ended the request, or that its client stalled.
    ending: Arc<Ending>,
}

/// What a request's channel closing early means: the engine went away mid-request (its
/// thread ended), or the request was cancelled because its client stopped reading.
fn ended_early(out: &Output) -> String {
    if out.ending.cancelled() {
        "cancelled: the client did not read the stream for --stream-timeout".into()
    } else {
        "the engine stopped before the request finished".into()
    }
}

impl Output {
    fn usage(&self) -> Value {
        let (p, c) = (self.detok.prompt_len, self.detok.generated());
        json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
    }

    /// One choice: `text` is the delta (streaming) or the whole text.
    fn body(&self, text: &str, finish: Option<&str>, stream: bool) -> Value {
        let choice = match (self.kind, stream) {
            (Kind::Text, _) => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            (Kind::Chat, false) => json!({"index": 0, "logprobs": null, "finish_reason": finish,
                "message": {"role": "assistant", "content": text}}),
            (Kind::Chat, true) => json!({"index": 0, "logprobs": null, "finish_reason": finish,
                "delta": {"role": "assistant", "content": text}}),
        };
        let object = match (self.kind, stream) {
            (Kind::Text, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        };
        let mut body = json!({"id": self.id, "object": object, "created": self.created,
            "model": self.text.name, "choices": [choice]});
        if !stream {
            body["usage"] = self.usage();
        } else if self.params.include_usage {
            body["usage"] = Value::Null;
        }
        body
    }
}

/// Waits for every token, then answers with one JSON body.
async fn whole_response(mut out: Output, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut finish = None;
    while let Some(event) = rx.recv().await {
        match event {
            Event::Token(t) => {
                let stop = out.params.stop.clone();
                if out.detok.push(&out.text, t, &stop).1 {
                    finish = Some("stop");
                    out.ending.stop();
                    break;
                }
            }
            Event::Done { eos } => {
                finish = Some(if eos { "stop" } else { "length" });
                out.detok.flush(&out.text);
                break;
            }
            Event::Error(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e),
        }
    }
    // The channel closed without Done: never a truncated 200.
    let Some(finish) = finish else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, ended_early(&out));
    };
    let text = out.detok.sent.clone();
    Json(out.body(&text, Some(finish), false)).into_response()
}

/// Where a stream is.
enum Phase {
    Tokens,
    Usage,
    Done,
    Over,
}

/// One `data:` chunk per token, then the finish chunk, usage if asked, and `[DONE]`.
/// A client that leaves an event unread for `stall` is cancelled ([`Watched`]).
fn stream_response(
    out: Output,
    rx: UnboundedReceiver<Event>,
    stall: Duration,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let ending = out.ending.clone();
    let start = (out, Some(rx), Phase::Tokens);
    let events = stream::unfold(start, |(mut out, mut rx, phase)| async move {
        let data = |v: Value| SseEvent::default().data(v.to_string());
        match phase {
            Phase::Over => None,
            Phase::Done => Some((
                Ok(SseEvent::default().data("[DONE]")),
                (out, rx, Phase::Over),
            )),
            Phase::Usage => {
                let mut body = out.body("", None, true);
                body["choices"] = json!([]);
                body["usage"] = out.usage();
                Some((Ok(data(body)), (out, rx, Phase::Done)))
            }
            Phase::Tokens => {
                let next = |out: &Output| {
                    if out.params.include_usage {
                        Phase::Usage
                    } else {
                        Phase::Done
                    }
                };
                loop {
                    let event = match rx.as_mut() {
                        Some(r) => r.recv().await,
                        None => None,
                    };
                    let (delta, finish) = match event {
                        Some(Event::Token(t)) => {
                            let stop = out.params.stop.clone();
                            match out.detok.push(&out.text, t, &stop) {
                                (d, true) => {
                                    out.ending.stop();
                                    (d, Some("stop"))
                                }
                                (d, false) if d.is_empty() => continue,
                                (d, false) => (d, None),
                            }
                        }
                        Some(Event::Done { eos }) => (
                            out.detok.flush(&out.text),
                            Some(if eos { "stop" } else { "length" }),
                        ),
                        Some(Event::Error(e)) => {
                            let body = json!({"error": {"message": e, "type": "server_error", "code": 500}});
                            return Some((Ok(data(body)), (out, None, Phase::Over)));
                        }
                        // The channel closed without Done: an error event, never a silent end.
                        None if rx.is_some() => {
                            let e = ended_early(&out);
                            let body = json!({"error": {"message": e, "type": "server_error", "code": 500}});
                            return Some((Ok(data(body)), (out, None, Phase::Over)));
                        }
                        None => return None,
                    };
                    // A finished request lets go of its channel: a stop string cancels it.
                    if finish.is_some() {
                        rx = None;
                    }
                    let chunk = out.body(&delta, finish, true);
                    let phase = if finish.is_some() {
                        next(&out)
                    } else {
                        Phase::Tokens
                    };
                    return Some((Ok(data(chunk)), (out, rx, phase)));
                }
            }
        }
    });
    Sse::new(Watched::new(events, ending, stall))
}
