//! `bench serve --url`: the same seeded workload as the in-process benchmark, sent to any
//! OpenAI-compatible server as streamed `/v1/completions` of token ids; TTFT is taken at the
//! first streamed token, inter-token latency between successive streamed chunks of text.
//!
//! A later turn of a multi-turn session ([`ServeRequest::follows`]) is sent when the turn
//! before it has its answer: its prompt is that turn's prompt, the answer's token ids, then its
//! own tokens. The answer's ids are the server's `POST /tokenize` of the streamed text
//! (llama-server's route, which `wgpar serve` has too): what a chat client resends is the text
//! it got, and a completion's stream carries no token ids.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::batching::{ServeMetrics, ServeRequest, Timing};
use crate::error::{Result, WgparError};

/// What one request over HTTP gave.
#[derive(Debug, Clone, Default)]
pub struct HttpOutcome {
    /// Seconds from the start to its first token and to its end (`None`: it failed).
    pub timing: Option<Timing>,
    /// Why it failed.
    pub error: Option<String>,
    /// Seconds between successive streamed chunks of text.
    pub gaps: Vec<f64>,
}

/// Sends `requests` to `url` (`http://HOST:PORT`) at their arrival times; `progress(done)`.
pub fn run_http(
    url: &str,
    model: &str,
    requests: &[ServeRequest],
    progress: &(dyn Fn(usize) + Sync),
) -> Result<(ServeMetrics, Vec<HttpOutcome>)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| WgparError::runtime("cannot start the async runtime", e))?;
    let endpoint = format!("{}/v1/completions", url.trim_end_matches('/'));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3600))
        .build()
        .map_err(|e| WgparError::runtime("cannot build the HTTP client", e))?;
    let base = url.trim_end_matches('/').to_string();
    let (mut senders, mut receivers) = turn_channels(requests);
    let outcomes = runtime.block_on(async {
        let t0 = Instant::now();
        let done = std::sync::atomic::AtomicUsize::new(0);
        let tasks = requests.iter().enumerate().map(|(i, r)| {
            let (client, endpoint, done, base) = (&client, &endpoint, &done, &base);
            let (before, after) = (receivers[i].take(), senders[i].take());
            async move {
                let prompt = match before {
                    None => {
                        let at = Duration::try_from_secs_f64(r.arrival_s).unwrap_or(Duration::MAX);
                        tokio::time::sleep(at.saturating_sub(t0.elapsed())).await;
                        r.prompt.clone()
                    }
                    Some(rx) => match rx.await {
                        Ok(Some(mut p)) => {
                            p.extend_from_slice(&r.prompt);
                            p
                        }
                        _ => return failed("the turn before it failed", progress, done),
                    },
                };
                let arrival_s = t0.elapsed().as_secs_f64();
                let (out, text) = one(client, endpoint, model, (r, &prompt, arrival_s), t0).await;
                if let Some(tx) = after {
                    let answer = match text {
                        Some(text) => tokenize(client, base, &text).await.ok(),
                        None => None,
                    };
                    let _ = tx.send(answer.map(|ids| [prompt, ids].concat()));
                }
                progress(done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1);
                out
            }
        });
        futures_util::future::join_all(tasks).await
    });
    let timings: Vec<Timing> = outcomes.iter().filter_map(|o| o.timing).collect();
    let failed = outcomes.len() - timings.len();
    let gaps: Vec<f64> = outcomes
        .iter()
        .flat_map(|o| o.gaps.iter().copied())
        .collect();
    let metrics = ServeMetrics::from_timings(&timings, failed, None).with_gaps(&gaps);
    Ok((metrics, outcomes))
}

/// A one-shot channel from each request that has a later turn to that turn: the prompt the
/// later turn starts with (`None`: the turn before failed).
type Turn = Option<Vec<u32>>;

#[allow(clippy::type_complexity)]
fn turn_channels(
    requests: &[ServeRequest],
) -> (
    Vec<Option<tokio::sync::oneshot::Sender<Turn>>>,
    Vec<Option<tokio::sync::oneshot::Receiver<Turn>>>,
) {
    let mut senders: Vec<_> = requests.iter().map(|_| None).collect();
    let mut receivers: Vec<_> = requests.iter().map(|_| None).collect();
    for (i, r) in requests.iter().enumerate() {
        if let Some(p) = r.follows.filter(|&p| p < requests.len()) {
            let (tx, rx) = tokio::sync::oneshot::channel();
            (senders[p], receivers[i]) = (Some(tx), Some(rx));
        }
    }
    (senders, receivers)
}

/// A request that was never sent.
fn failed(
    why: &str,
    progress: &(dyn Fn(usize) + Sync),
    done: &std::sync::atomic::AtomicUsize,
) -> HttpOutcome {
    progress(done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1);
    HttpOutcome {
        timing: None,
        error: Some(why.into()),
        gaps: Vec::new(),
    }
}

/// The server's token ids of `text` (`POST /tokenize`, no special tokens added).
async fn tokenize(
    client: &reqwest::Client,
    base: &str,
    text: &str,
) -> std::result::Result<Vec<u32>, String> {
    let body = json!({"content": text, "add_special": false});
    let resp = (client.post(format!("{base}/tokenize")))
        .header("Content-Type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let text = resp.text().await.map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("/tokenize: {e}: {text}"))?;
    (v["tokens"]
        .as_array()
        .ok_or("no tokens in the /tokenize answer")?)
    .iter()
    .map(|t| {
        t.as_u64()
            .map(|t| t as u32)
            .ok_or("a token id is not a number".into())
    })
    .collect()
}

/// Sends request `r` with its whole `prompt`, sent `arrival_s` after `t0`: its outcome and
/// the streamed text.
async fn one(
    client: &reqwest::Client,
    endpoint: &str,
    model: &str,
    (r, prompt, arrival_s): (&ServeRequest, &[u32], f64),
    t0: Instant,
) -> (HttpOutcome, Option<String>) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": r.max_new,
        "stream": true, "ignore_eos": true, "temperature": 0,
        "stream_options": {"include_usage": true}});
    match stream(client, endpoint, &body, t0).await {
        Ok(Streamed {
            first_s,
            done_s,
            output_tokens,
            gaps,
            text,
        }) => (
            HttpOutcome {
                timing: Some(Timing {
                    arrival_s,
                    first_s,
                    done_s,
                    prompt_len: prompt.len(),
                    output_tokens,
                }),
                error: None,
                gaps,
            },
            Some(text),
        ),
        Err(e) => (
            HttpOutcome {
                timing: None,
                error: Some(e),
                gaps: Vec::new(),
            },
            None,
        ),
    }
}

/// What one SSE stream gave.
struct Streamed {
    first_s: f64,
    done_s: f64,
    output_tokens: usize,
    gaps: Vec<f64>,
    /// The streamed text, whole.
    text: String,
}

/// Reads one SSE stream.
async fn stream(
    client: &reqwest::Client,
    endpoint: &str,
    body: &Value,
    t0: Instant,
) -> std::result::Result<Streamed, String> {
    let mut resp = client
        .post(endpoint)
        .header("Content-Type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        let status = resp.status();
        return Err(format!(
            "{status}: {}",
            resp.text().await.unwrap_or_default()
        ));
    }
    let (mut first, mut chunks, mut usage) = (None, 0usize, None);
    let (mut last, mut gaps) = (None::<f64>, Vec::new());
    let mut pending = String::new();
    let mut whole = String::new();
    while let Some(bytes) = resp.chunk().await.map_err(|e| e.to_string())? {
        pending.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data:")) {
                let data = data.trim();
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
                if let Some(e) = v.get("error") {
                    return Err(e.to_string());
                }
                let text = v["choices"][0]["text"].as_str().unwrap_or_default();
                whole.push_str(text);
                if !text.is_empty() {
                    let now = t0.elapsed().as_secs_f64();
                    first.get_or_insert(now);
                    gaps.extend(last.map(|l| now - l));
                    last = Some(now);
                    chunks += 1;
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    usage = Some(n as usize);
                }
            }
        }
    }
    let done = t0.elapsed().as_secs_f64();
    let first = first.ok_or("no token streamed")?;
    Ok(Streamed {
        first_s: first,
        done_s: done,
        output_tokens: usage.unwrap_or(chunks),
        gaps,
        text: whole,
    })
}
