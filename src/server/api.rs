//! OpenAI's request fields, read from JSON and checked one by one so a bad request gets a 400
//! that names the field, never a panic.

use serde_json::{Map, Value};

use super::chat::Message;
use crate::model::sampling::SamplingParams;

/// What a request asks for, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// `max_tokens` or `max_completion_tokens` (`None`: the endpoint's default).
    pub max_tokens: Option<usize>,
    /// Strings that end the text (not included).
    pub stop: Vec<String>,
    /// Server-Sent Events instead of one JSON body.
    pub stream: bool,
    /// A last chunk with `usage` (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Generate `max_tokens` even past an end-of-sequence token (vLLM's `ignore_eos`, for
    /// benchmarks).
    pub ignore_eos: bool,
    /// How to draw tokens when `temperature` > 0 (`None`: greedy). Without a `seed` the
    /// request gets a random one, as OpenAI's API does.
    pub sampling: Option<SamplingParams>,
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text to tokenize.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Chat messages for the template.
    Chat(Vec<Message>),
}

/// A 400: the message names the field.
pub type Invalid = String;

/// Most tokens a request may ask for.
const MAX_TOKENS_LIMIT: u64 = 1 << 20;

fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn number(obj: &Map<String, Value>, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, Invalid> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            Some(x) => Err(format!("'{name}' is {x}; it must be within {lo}..={hi}")),
            None => Err(format!("'{name}' must be a number, not {v}")),
        },
    }
}

fn integer(obj: &Map<String, Value>, name: &str, lo: u64, hi: u64) -> Result<Option<u64>, Invalid> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(format!(
                "'{name}' must be a whole number within {lo}..={hi}, not {v}"
            )),
        },
    }
}

fn boolean(obj: &Map<String, Value>, name: &str) -> Result<bool, Invalid> {
    match field(obj, name) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(format!("'{name}' must be true or false, not {v}")),
    }
}

/// The request body as a JSON object.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, Invalid> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(other) => Err(format!("the body must be a JSON object, not {other}")),
        Err(e) => Err(format!("the body is not valid JSON: {e}")),
    }
}

/// The fields every generation request shares.
pub fn params(obj: &Map<String, Value>) -> Result<Params, Invalid> {
    if let Some(v) = field(obj, "model") {
        if !v.is_string() {
            return Err(format!("'model' must be a string, not {v}"));
        }
    }
    if let Some(n) = field(obj, "n") {
        if n.as_u64() != Some(1) {
            return Err(format!(
                "'n' is {n}: this server makes one choice per request (n = 1)"
            ));
        }
    }
    let sampling = sampling(obj)?;
    number(obj, "presence_penalty", -2.0, 2.0)?;
    number(obj, "frequency_penalty", -2.0, 2.0)?;
    let max_tokens = match integer(obj, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)? {
        Some(n) => Some(n),
        None => integer(obj, "max_tokens", 1, MAX_TOKENS_LIMIT)?,
    };
    let stop = match field(obj, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(list)) if list.len() <= 4 => list
            .iter()
            .map(|s| match s {
                Value::String(s) if !s.is_empty() => Ok(s.clone()),
                other => Err(format!(
                    "'stop' entries must be non-empty strings, not {other}"
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => Err(format!(
            "'stop' must be a string or a list of up to 4, not {v}"
        ))?,
    };
    if stop.iter().any(String::is_empty) {
        return Err("'stop' must not be empty".into());
    }
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")?,
        Some(v) => return Err(format!("'stream_options' must be an object, not {v}")),
    };
    Ok(Params {
        max_tokens: max_tokens.map(|n| n as usize),
        stop,
        stream: boolean(obj, "stream")?,
        include_usage,
        ignore_eos: boolean(obj, "ignore_eos")?,
        sampling,
    })
}

/// `temperature` (OpenAI's default is 1; 0 is greedy), `top_p`, `seed`, and `top_k` (an
/// extension, as in vLLM and llama-server: 0 or -1 keep every token).
fn sampling(obj: &Map<String, Value>) -> Result<Option<SamplingParams>, Invalid> {
    let temperature = number(obj, "temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = number(obj, "top_p", 0.0, 1.0)?.unwrap_or(1.0);
    let seed = integer(obj, "seed", 0, u64::MAX)?;
    let top_k = match field(obj, "top_k") {
        None => 0,
        Some(v) => match v.as_i64() {
            Some(-1) => 0,
            Some(k) if (0..=i64::from(u32::MAX)).contains(&k) => k as usize,
            _ => {
                return Err(format!(
                    "'top_k' must be -1 or a whole number >= 0, not {v}"
                ))
            }
        },
    };
    if top_p == 0.0 && temperature > 0.0 {
        return Err("'top_p' is 0: it must be above 0 to keep any token".into());
    }
    if temperature == 0.0 || top_k == 1 {
        return Ok(None);
    }
    Ok(Some(SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        seed: seed.unwrap_or_else(rand::random),
    }))
}

/// `prompt` of `/v1/completions`: a string, a list of one string, or token ids.
pub fn completion_prompt(obj: &Map<String, Value>) -> Result<Prompt, Invalid> {
    let bad = |v: &Value| format!("'prompt' must be a string or a list of token ids, not {v}");
    match field(obj, "prompt") {
        None => Err("'prompt' is required".into()),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(list)) => match list.as_slice() {
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [] => Err("'prompt' is empty".into()),
            items => items
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| bad(t))
                })
                .collect::<Result<_, _>>()
                .map(Prompt::Tokens),
        },
        Some(v) => Err(bad(v)),
    }
}

/// `messages` of `/v1/chat/completions`: roles and text contents.
pub fn chat_messages(obj: &Map<String, Value>) -> Result<Prompt, Invalid> {
    let list = match field(obj, "messages") {
        None => return Err("'messages' is required".into()),
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(v) => return Err(format!("'messages' must be a non-empty list, not {v}")),
    };
    let message = |(i, m): (usize, &Value)| -> Result<Message, Invalid> {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("'messages[{i}].role' must be a string"))?;
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .map(
                    |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                        _ => Err(format!("'messages[{i}].content' parts must be text")),
                    },
                )
                .collect::<Result<Vec<_>, _>>()?
                .concat(),
            Some(Value::Null) | None if role == "assistant" => String::new(),
            _ => return Err(format!("'messages[{i}].content' must be a string")),
        };
        Ok(Message {
            role: role.to_string(),
            content,
        })
    };
    list.iter()
        .enumerate()
        .map(message)
        .collect::<Result<_, _>>()
        .map(Prompt::Chat)
}

/// Where the first stop string starts in `text`, if any.
pub fn stop_at(text: &str, stop: &[String]) -> Option<usize> {
    stop.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// Bytes at the end of `text` that begin some stop string (the longest such tail), to hold
/// back until the next token says whether the stop string follows.
pub fn partial_stop(text: &str, stop: &[String]) -> usize {
    stop.iter()
        .filter_map(|s| {
            (1..s.len())
                .rev()
                .filter(|&n| s.is_char_boundary(n))
                .find(|&n| text.ends_with(&s[..n]))
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params_of(json: &str) -> Result<Params, Invalid> {
        params(&object(json.as_bytes())?)
    }

    #[test]
    fn partial_stops_hold_back_the_longest_tail() {
        let stop = vec!["END".to_string(), "xyz".to_string()];
        assert_eq!(partial_stop("abc E", &stop), 1);
        assert_eq!(partial_stop("abc EN", &stop), 2);
        assert_eq!(partial_stop("abc xy", &stop), 2);
        assert_eq!(partial_stop("abc", &stop), 0);
        // A whole stop string is `stop_at`'s, not a partial one.
        assert_eq!(partial_stop("abc END", &stop), 0);
        assert_eq!(stop_at("abc END", &stop), Some(4));
        // Multi-byte stop strings are cut on character boundaries only.
        let stop = vec!["é!".to_string()];
        assert_eq!(partial_stop("café", &stop), "é".len());
        assert_eq!(partial_stop("caf", &stop), 0);
    }

    #[test]
    fn sampling_follows_openai_defaults() {
        // No temperature: OpenAI's default of 1, with a random seed.
        let p = params_of(r#"{"prompt":"a"}"#).unwrap().sampling.unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p), (1.0, 0, 1.0));
        let s = params_of(r#"{"temperature":0.7,"top_p":0.9,"seed":11,"top_k":-1}"#)
            .unwrap()
            .sampling
            .unwrap();
        assert_eq!((s.temperature, s.top_k, s.top_p, s.seed), (0.7, 0, 0.9, 11));
        // Greedy: temperature 0, or top_k 1.
        assert_eq!(params_of(r#"{"temperature":0}"#).unwrap().sampling, None);
        assert_eq!(params_of(r#"{"top_k":1}"#).unwrap().sampling, None);
        for (bad, field) in [
            (r#"{"temperature":2.5}"#, "temperature"),
            (r#"{"top_p":0}"#, "top_p"),
            (r#"{"top_k":-2}"#, "top_k"),
            (r#"{"top_k":1.5}"#, "top_k"),
            (r#"{"seed":"s"}"#, "seed"),
        ] {
            let e = params_of(bad).unwrap_err();
            assert!(e.contains(field), "{bad}: {e}");
        }
    }
}
