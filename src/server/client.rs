//! `bench serve --url`: the same seeded workload as the in-process benchmark, sent to any
//! OpenAI-compatible server as streamed `/v1/completions` of token ids; TTFT is taken at the
//! first streamed token, inter-token latency between successive streamed chunks of text.

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
        .map_err(|e| WgparError::Internal(format!("cannot start the async runtime: {e}")))?;
    let endpoint = format!("{}/v1/completions", url.trim_end_matches('/'));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3600))
        .build()
        .map_err(|e| WgparError::Internal(format!("HTTP client: {e}")))?;
    let outcomes = runtime.block_on(async {
        let t0 = Instant::now();
        let done = std::sync::atomic::AtomicUsize::new(0);
        let tasks = requests.iter().map(|r| {
            let (client, endpoint, done) = (&client, &endpoint, &done);
            async move {
                let at = Duration::try_from_secs_f64(r.arrival_s).unwrap_or(Duration::MAX);
                tokio::time::sleep(at.saturating_sub(t0.elapsed())).await;
                let out = one(client, endpoint, model, r, t0).await;
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

async fn one(
    client: &reqwest::Client,
    endpoint: &str,
    model: &str,
    r: &ServeRequest,
    t0: Instant,
) -> HttpOutcome {
    let body = json!({"model": model, "prompt": r.prompt, "max_tokens": r.max_new,
        "stream": true, "ignore_eos": true, "temperature": 0,
        "stream_options": {"include_usage": true}});
    match stream(client, endpoint, &body, t0).await {
        Ok(Streamed {
            first_s,
            done_s,
            output_tokens,
            gaps,
        }) => HttpOutcome {
            timing: Some(Timing {
                arrival_s: r.arrival_s,
                first_s,
                done_s,
                prompt_len: r.prompt.len(),
                output_tokens,
            }),
            error: None,
            gaps,
        },
        Err(e) => HttpOutcome {
            timing: None,
            error: Some(e),
            gaps: Vec::new(),
        },
    }
}

/// What one SSE stream gave.
struct Streamed {
    first_s: f64,
    done_s: f64,
    output_tokens: usize,
    gaps: Vec<f64>,
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
    })
}
