//! `POST /v1/embeddings`: an encoder checkpoint (BERT-style, e.g. all-MiniLM-L6-v2) served
//! as OpenAI's embeddings API. `input` is a string, a list of strings, token ids or a list of
//! token-id lists; each gets one vector, pooled as the checkpoint's sentence-transformers
//! modules say (mean or CLS, then `Normalize` where the folder has it). The encoder runs on its
//! own thread (encoders are not `Send`), one request at a time, in batches of up to
//! `--max-batch` inputs; `encoding_format` is `float` or `base64`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::api::{self, Invalid, Route};
use super::routes::{error, invalid};
use super::{ServerOptions, Shared, TextModel};
use crate::error::{Result, WgparError};
use crate::model::EncoderInput;
use crate::parallel::Encoder;

/// Most inputs one request may hold (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// Builds the encoder on its own thread, with its weights on the device.
pub type EncoderBuilder = Box<dyn FnOnce() -> Result<Box<dyn Encoder>> + Send>;

/// One request's inputs, and where their vectors go (row-major, `dim` each).
struct EmbedJob {
    inputs: Vec<EncoderInput>,
    reply: tokio::sync::oneshot::Sender<std::result::Result<Vec<f32>, String>>,
}

/// What the HTTP side knows of the encoder.
pub struct EncoderHandle {
    jobs: crossbeam::channel::Sender<EmbedJob>,
    /// Width of each embedding.
    dim: usize,
}

/// Serves `text`'s encoder (built by `build`, whose vectors are `dim` wide) until SIGINT
/// or SIGTERM; completions and chat answer 400.
pub fn run_encoder(
    opts: ServerOptions,
    text: TextModel,
    dim: usize,
    build: EncoderBuilder,
) -> Result<()> {
    let shared = Arc::new(Shared::new(&text.name));
    let (jobs_tx, jobs_rx) = crossbeam::channel::unbounded();
    let chunk = opts.batch.slots.max(1);
    let thread = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("wgpar-encoder".into())
            .spawn(move || encoder_thread(build, &jobs_rx, chunk, &shared))
            .map_err(|e| WgparError::runtime("cannot start the encoder thread", e))?
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| WgparError::runtime("cannot start the async runtime", e))?;
    // Generation jobs have no engine here: their receiver is dropped (routes refuse them).
    let (no_jobs, _) = crossbeam::channel::unbounded();
    let handle = EncoderHandle { jobs: jobs_tx, dim };
    let state =
        super::routes::AppState::new(&opts, text, shared.clone(), no_jobs).with_encoder(handle);
    runtime.block_on(super::listen(&opts, state, shared.clone()))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while !thread.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let load_error = crate::threads::lock(&shared.load_error).take();
    match load_error {
        Some(e) => Err(WgparError::runtime("the encoder could not start", e)),
        None => Ok(()),
    }
}

/// Builds the encoder, then answers jobs until the HTTP side is gone. A failed build or a
/// panic marks the server failed.
fn encoder_thread(
    build: EncoderBuilder,
    jobs: &crossbeam::channel::Receiver<EmbedJob>,
    chunk: usize,
    shared: &Shared,
) {
    let fail = |why: String| {
        shared.failed.store(true, Ordering::SeqCst);
        *crate::threads::lock(&shared.load_error) = Some(why);
        shared.stop.notify_one();
    };
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(build));
    let mut encoder = match built {
        Ok(Ok(e)) => e,
        Ok(Err(e)) => return fail(e.to_string()),
        Err(p) => {
            let why = crate::threads::panic_message(p.as_ref()).unwrap_or("?");
            return fail(format!("the encoder build panicked: {why}"));
        }
    };
    shared.ready.store(true, Ordering::SeqCst);
    eprintln!("ready: {}", encoder.name());
    while let Ok(job) = jobs.recv() {
        let run = std::panic::AssertUnwindSafe(|| encode_all(encoder.as_mut(), &job.inputs, chunk));
        let result = std::panic::catch_unwind(run).unwrap_or_else(|p| {
            let why = crate::threads::panic_message(p.as_ref()).unwrap_or("?");
            shared.failed.store(true, Ordering::SeqCst);
            Err(format!("the encoder panicked: {why}"))
        });
        shared.queued.fetch_sub(1, Ordering::SeqCst);
        if result.is_err() {
            shared.metrics.failed.inc();
        }
        let _ = job.reply.send(result);
    }
}

/// Every input's vector, encoded `chunk` inputs at a time.
fn encode_all(
    encoder: &mut dyn Encoder,
    inputs: &[EncoderInput],
    chunk: usize,
) -> std::result::Result<Vec<f32>, String> {
    let mut data = Vec::new();
    for part in inputs.chunks(chunk) {
        let e = encoder.encode(part).map_err(|e| e.to_string())?;
        data.extend_from_slice(&e.data[..part.len() * e.dim]);
    }
    Ok(data)
}

/// A checked request.
struct EmbedRequest {
    inputs: Vec<EncoderInput>,
    base64: bool,
}

/// Why a request is not served: a 400, or a 404 for another model's name.
enum Refused {
    Bad(Invalid),
    NoModel(String),
}

impl From<Invalid> for Refused {
    fn from(bad: Invalid) -> Self {
        Refused::Bad(bad)
    }
}

/// `input` as encoder inputs: texts through the tokenizer (its special tokens and length
/// cut included), token ids as given.
fn inputs(
    obj: &Map<String, Value>,
    text: &TextModel,
) -> std::result::Result<Vec<EncoderInput>, Invalid> {
    let bad = |m: String| Invalid::new("input", m);
    let shape = "'input' must be a string, token ids, or a non-empty list of either";
    let ids = |list: &[Value]| -> std::result::Result<EncoderInput, Invalid> {
        let ids = list
            .iter()
            .map(|t| match t.as_u64() {
                Some(t) if (t as usize) < text.vocab => Ok(t as u32),
                _ => Err(bad(format!(
                    "token id {t} is not below the vocabulary of {}",
                    text.vocab
                ))),
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(EncoderInput::new(ids))
    };
    let encode = |s: &str| {
        text.tokenizer
            .encode_for_encoder(s)
            .map_err(|e| bad(e.to_string()))
    };
    let list = match obj.get("input").filter(|v| !v.is_null()) {
        None => return Err(bad("'input' is required".into())),
        Some(Value::String(s)) => return Ok(vec![encode(s)?]),
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(_) => return Err(bad(shape.into())),
    };
    if list.iter().all(Value::is_number) {
        return Ok(vec![ids(list)?]);
    }
    if list.len() > MAX_INPUTS {
        return Err(bad(format!(
            "'input' holds {} entries; at most {MAX_INPUTS}",
            list.len()
        )));
    }
    list.iter()
        .map(|v| match v {
            Value::String(s) => encode(s),
            Value::Array(t) if !t.is_empty() => ids(t),
            _ => Err(bad(shape.into())),
        })
        .collect()
}

/// Reads and checks a request for an encoder of `dim` values per vector.
fn read(body: &[u8], text: &TextModel, dim: usize) -> std::result::Result<EmbedRequest, Refused> {
    let obj = api::object(body)?;
    api::fields::check(&obj, Route::Embeddings)?;
    match obj.get("model").filter(|v| !v.is_null()) {
        None => {}
        Some(Value::String(m)) if *m == text.name => {}
        Some(Value::String(m)) => {
            return Err(Refused::NoModel(format!(
                "the model `{m}` does not exist: this server serves `{}`",
                text.name
            )))
        }
        Some(v) => {
            return Err(Invalid::new("model", format!("'model' must be a string, not {v}")).into())
        }
    }
    let base64 = match obj.get("encoding_format").filter(|v| !v.is_null()) {
        None => false,
        Some(v) if v == "float" => false,
        Some(v) if v == "base64" => true,
        Some(v) => {
            let m = format!("'encoding_format' must be \"float\" or \"base64\", not {v}");
            return Err(Invalid::new("encoding_format", m).into());
        }
    };
    if let Some(d) = obj.get("dimensions").filter(|v| !v.is_null()) {
        if d.as_u64() != Some(dim as u64) {
            let m = format!("'dimensions' is {d}: this model's embeddings have {dim} values, and wgpar does not shorten them");
            return Err(Invalid::new("dimensions", m).into());
        }
    }
    let inputs = inputs(&obj, text)?;
    for (i, input) in inputs.iter().enumerate() {
        let n = input.ids.len();
        if n == 0 || n > text.max_seq {
            let m = format!(
                "input {i} has {n} tokens; the model takes 1 to {} (--max-seq)",
                text.max_seq
            );
            return Err(Invalid::new("input", m).into());
        }
    }
    Ok(EmbedRequest { inputs, base64 })
}

/// Standard base64 (with padding) of `bytes`.
fn base64(bytes: &[u8]) -> String {
    const SET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let b = [
            group[0],
            *group.get(1).unwrap_or(&0),
            *group.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            let present = k <= group.len();
            let c = SET[(n >> (18 - 6 * k)) as usize & 63] as char;
            out.push(if present { c } else { '=' });
        }
    }
    out
}

/// One vector as the response shows it.
fn vector(row: &[f32], base64_format: bool) -> Value {
    if base64_format {
        let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
        return json!(base64(&bytes));
    }
    json!(row)
}

/// The response to a refused request.
fn refusal(refused: Refused) -> Response {
    match refused {
        Refused::Bad(bad) => invalid(bad),
        Refused::NoModel(m) => {
            let body = json!({"error": {"message": m, "type": "NotFoundError",
                "param": "model", "code": 404}});
            (StatusCode::NOT_FOUND, Json(body)).into_response()
        }
    }
}

/// Hands `inputs` to the encoder thread and waits for their vectors.
async fn run_job(
    encoder: &EncoderHandle,
    shared: &Shared,
    inputs: Vec<EncoderInput>,
) -> std::result::Result<Vec<f32>, Response> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    shared.queued.fetch_add(1, Ordering::SeqCst);
    if encoder.jobs.send(EmbedJob { inputs, reply: tx }).is_err() {
        shared.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the encoder has stopped",
        ));
    }
    match rx.await {
        Ok(Ok(data)) => Ok(data),
        Ok(Err(e)) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, e)),
        Err(_) => Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the encoder has stopped",
        )),
    }
}

/// Answers `POST /v1/embeddings`: 400 on a decoder's server (`encoder` is `None`).
pub(super) async fn respond(
    encoder: Option<&EncoderHandle>,
    text: &TextModel,
    shared: &Shared,
    body: &[u8],
) -> Response {
    let Some(encoder) = encoder else {
        let m = format!(
            "model '{}' is a decoder: /v1/embeddings needs an encoder (serve --model a \
             BERT-style folder such as all-MiniLM-L6-v2)",
            text.name
        );
        return error(StatusCode::BAD_REQUEST, m);
    };
    if shared.failed.load(Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the encoder failed");
    }
    if shared.draining.load(Ordering::SeqCst) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        );
    }
    let request = match read(body, text, encoder.dim) {
        Ok(r) => r,
        Err(refused) => {
            shared.metrics.rejected.inc();
            return refusal(refused);
        }
    };
    let tokens: usize = request.inputs.iter().map(|i| i.ids.len()).sum();
    shared.metrics.prompt_tokens.inc_by(tokens as u64);
    let count = request.inputs.len();
    let data = match run_job(encoder, shared, request.inputs).await {
        Ok(data) => data,
        Err(response) => return response,
    };
    let dim = encoder.dim;
    let list: Vec<Value> = (0..count)
        .map(|i| {
            let v = vector(&data[i * dim..(i + 1) * dim], request.base64);
            json!({"object": "embedding", "index": i, "embedding": v})
        })
        .collect();
    Json(json!({"object": "list", "data": list, "model": text.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_vectors() {
        // RFC 4648, section 10.
        for (raw, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(raw.as_bytes()), want, "{raw:?}");
        }
    }
}
