//! OpenAI's request fields, read from JSON and checked one by one so a bad request gets a 400
//! that names the field, never a panic.

use serde_json::{Map, Value};

use super::chat::Message;
use crate::batching::Lookup;
use crate::model::constraint::Format;
use crate::model::sampling::{PickRules, SamplingParams};

pub mod fields;

pub use fields::Route;

/// What a request asks for, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// `model`, if given (it must name the served model).
    pub model: Option<String>,
    /// `max_tokens`, `max_completion_tokens` or `n_predict` (`None`: the endpoint's default).
    pub max_tokens: Option<usize>,
    /// Strings that end the text (not included).
    pub stop: Vec<String>,
    /// Tokens that end the text like end-of-sequence (vLLM's `stop_token_ids`).
    pub stop_ids: Vec<u32>,
    /// Server-Sent Events instead of one JSON body.
    pub stream: bool,
    /// A last chunk with `usage` (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Generate `max_tokens` even past an end-of-sequence token (vLLM's `ignore_eos`, for
    /// benchmarks).
    pub ignore_eos: bool,
    /// How to pick tokens: greedy or seeded sampling (without a `seed` the request gets a
    /// random one, as OpenAI's API does), bias, penalties, min-p.
    pub rules: PickRules,
    /// Log-probabilities with this many top tokens (`None`: none).
    pub logprobs: Option<usize>,
    /// Completions' `echo`: the prompt comes first (with its log-probs when `logprobs`).
    pub echo: bool,
    /// Choices per prompt.
    pub n: usize,
    /// The chat template's `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// vLLM's `include_stop_str_in_output`: the text keeps the stop string that ended it.
    pub include_stop: bool,
    /// `response_format` (or vLLM's `guided_json`, `guided_regex`, `guided_choice`): what
    /// the output must be (`None`: free text).
    pub format: Option<Format>,
    /// The field `format` came from, for messages about it.
    pub format_field: &'static str,
    /// How the prompt may reuse cached KV: llama-server's `cache_prompt` (default true) and
    /// vLLM's `cache_salt` (KV shared only among requests with the same salt).
    pub cache: Lookup,
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

/// A 400: the message, and the field it is about.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    /// The field (OpenAI's `param`), when one is to blame.
    pub param: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl Invalid {
    /// A 400 about field `param`.
    pub fn new(param: &str, message: String) -> Self {
        Self {
            param: Some(param.to_string()),
            message,
        }
    }
}

impl From<String> for Invalid {
    fn from(message: String) -> Self {
        Self {
            param: None,
            message,
        }
    }
}

impl From<&str> for Invalid {
    fn from(message: &str) -> Self {
        message.to_string().into()
    }
}

/// Most tokens a request may ask for.
const MAX_TOKENS_LIMIT: u64 = 1 << 20;
/// Most choices per prompt.
pub const MAX_N: u64 = 8;
/// Most top log-probs per token.
pub const MAX_LOGPROBS: u64 = 20;

fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn number(obj: &Map<String, Value>, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, Invalid> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            Some(x) => Err(Invalid::new(
                name,
                format!("'{name}' is {x}; it must be within {lo}..={hi}"),
            )),
            None => Err(Invalid::new(
                name,
                format!("'{name}' must be a number, not {v}"),
            )),
        },
    }
}

fn integer(obj: &Map<String, Value>, name: &str, lo: u64, hi: u64) -> Result<Option<u64>, Invalid> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(Invalid::new(
                name,
                format!("'{name}' must be a whole number within {lo}..={hi}, not {v}"),
            )),
        },
    }
}

fn boolean(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>, Invalid> {
    match field(obj, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(Invalid::new(
            name,
            format!("'{name}' must be true or false, not {v}"),
        )),
    }
}

/// A list of token ids below `vocab`.
fn token_ids(obj: &Map<String, Value>, name: &str, vocab: usize) -> Result<Vec<u32>, Invalid> {
    let bad = |v: &Value| {
        Invalid::new(
            name,
            format!("'{name}' must list token ids below {vocab}, not {v}"),
        )
    };
    match field(obj, name) {
        None => Ok(Vec::new()),
        Some(Value::Array(list)) => list
            .iter()
            .map(|t| match t.as_u64() {
                Some(t) if (t as usize) < vocab => Ok(t as u32),
                _ => Err(bad(t)),
            })
            .collect(),
        Some(v) => Err(bad(v)),
    }
}

/// The request body as a JSON object.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, Invalid> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(other) => Err(format!("the body must be a JSON object, not {other}").into()),
        Err(e) => Err(format!("the body is not valid JSON: {e}").into()),
    }
}

/// The fields every generation request shares, for `route` with a vocabulary of `vocab`;
/// every field is first checked against [`fields::FIELDS`].
pub fn params(obj: &Map<String, Value>, route: Route, vocab: usize) -> Result<Params, Invalid> {
    fields::check(obj, route)?;
    let model = match field(obj, "model") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(Invalid::new(
                "model",
                format!("'model' must be a string, not {v}"),
            ))
        }
    };
    let n = integer(obj, "n", 1, MAX_N)?.unwrap_or(1) as usize;
    let mut max_tokens = None;
    for name in ["max_tokens", "max_completion_tokens", "n_predict"] {
        // 0 only scores an echoed prompt (checked with the prompt).
        if let Some(m) = integer(obj, name, 0, MAX_TOKENS_LIMIT)? {
            max_tokens = Some(m as usize);
        }
    }
    let (logprobs, echo) = logprobs(obj, route)?;
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")?.unwrap_or(false),
        Some(v) => {
            return Err(Invalid::new(
                "stream_options",
                format!("'stream_options' must be an object, not {v}"),
            ))
        }
    };
    let rules = rules(obj, vocab)?;
    let (format, format_field) = output_format(obj)?;
    if format.is_some() {
        // Either could leave a step where the grammar's tokens are all banned.
        for (name, set) in [
            ("min_tokens", rules.min_tokens > 0),
            ("allowed_token_ids", rules.allowed.is_some()),
        ] {
            if set {
                return Err(Invalid::new(
                    name,
                    format!("'{name}' cannot be combined with '{format_field}'"),
                ));
            }
        }
    }
    Ok(Params {
        model,
        max_tokens,
        stop: stop(obj)?,
        stop_ids: token_ids(obj, "stop_token_ids", vocab)?,
        stream: boolean(obj, "stream")?.unwrap_or(false),
        include_usage,
        ignore_eos: boolean(obj, "ignore_eos")?.unwrap_or(false),
        rules,
        logprobs,
        echo,
        n,
        add_generation_prompt: boolean(obj, "add_generation_prompt")?.unwrap_or(true),
        include_stop: boolean(obj, "include_stop_str_in_output")?.unwrap_or(false),
        format,
        format_field,
        cache: cache_use(obj)?,
    })
}

/// `cache_prompt` and `cache_salt`: whether and within which namespace the prompt reuses
/// cached KV. A salt is a non-empty string of at most [`MAX_CACHE_SALT`] bytes.
fn cache_use(obj: &Map<String, Value>) -> Result<Lookup, Invalid> {
    let reuse = boolean(obj, "cache_prompt")?.unwrap_or(true);
    let salt = match field(obj, "cache_salt") {
        None => None,
        Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_CACHE_SALT => Some(s.as_str()),
        Some(v) => {
            return Err(Invalid::new(
                "cache_salt",
                format!(
                    "'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT} \
                     bytes, not {v}"
                ),
            ))
        }
    };
    Ok(Lookup::new(reuse, salt))
}

/// The longest `cache_salt` taken, in bytes.
pub const MAX_CACHE_SALT: usize = 1024;

/// The grammar the output must follow, and the field that gave it: `response_format`, or
/// one of vLLM's `guided_json` (a schema, as `json_schema`), `guided_regex` (a regular
/// expression the whole text matches) and `guided_choice` (a non-empty list of strings, the
/// text one of them). At most one of them.
fn output_format(obj: &Map<String, Value>) -> Result<(Option<Format>, &'static str), Invalid> {
    let mut found = Vec::new();
    if let Some(f) = response_format(obj)? {
        found.push((f, "response_format"));
    }
    if let Some(v) = field(obj, "guided_json") {
        // vLLM takes the schema as an object or as its JSON text.
        let schema = match v {
            Value::String(text) => serde_json::from_str(text).ok(),
            Value::Object(_) => Some(v.clone()),
            _ => None,
        }
        .filter(Value::is_object);
        let schema = schema.ok_or_else(|| {
            Invalid::new(
                "guided_json",
                format!("'guided_json' must be a JSON schema object, not {v}"),
            )
        })?;
        found.push((Format::JsonSchema(schema), "guided_json"));
    }
    if let Some(v) = field(obj, "guided_regex") {
        let rx = v.as_str().filter(|r| !r.is_empty()).ok_or_else(|| {
            Invalid::new(
                "guided_regex",
                format!("'guided_regex' must be a non-empty string, not {v}"),
            )
        })?;
        found.push((Format::Regex(rx.to_string()), "guided_regex"));
    }
    if let Some(v) = field(obj, "guided_choice") {
        let options: Option<Vec<String>> = (v.as_array())
            .filter(|l| !l.is_empty())
            .and_then(|l| l.iter().map(|o| o.as_str().map(String::from)).collect());
        let options = options.filter(|o| o.iter().all(|s| !s.is_empty()));
        let options = options.ok_or_else(|| {
            Invalid::new(
                "guided_choice",
                format!("'guided_choice' must be a non-empty list of non-empty strings, not {v}"),
            )
        })?;
        found.push((Format::Choice(options), "guided_choice"));
    }
    match found.len() {
        0 => Ok((None, "response_format")),
        1 => Ok(found
            .pop()
            .map(|(f, name)| (Some(f), name))
            .unwrap_or((None, ""))),
        _ => {
            let second = found[1].1;
            Err(Invalid::new(
                second,
                format!("'{second}' cannot be combined with '{}'", found[0].1),
            ))
        }
    }
}

/// `response_format`: `{"type": "text"}`, `{"type": "json_object"}`, or `{"type":
/// "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` (the schema is
/// enforced whether `strict` is true or not). Anything else is refused by name.
fn response_format(obj: &Map<String, Value>) -> Result<Option<Format>, Invalid> {
    let bad = |m: String| Invalid::new("response_format", m);
    let Some(v) = field(obj, "response_format") else {
        return Ok(None);
    };
    let Value::Object(rf) = v else {
        return Err(bad(format!("'response_format' must be an object, not {v}")));
    };
    let only = |keys: &[&str]| match rf.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(bad(format!("'response_format' has an unknown key '{k}'"))),
        None => Ok(()),
    };
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => only(&["type"]).map(|_| None),
        Some("json_object") => only(&["type"]).map(|_| Some(Format::JsonObject)),
        Some("json_schema") => {
            only(&["type", "json_schema"])?;
            json_schema(rf.get("json_schema")).map(Some)
        }
        Some(other) => Err(bad(format!(
            "'response_format' type \"{other}\" is not supported: wgpar takes text, \
             json_object or json_schema"
        ))),
        None => Err(bad("'response_format' needs a string 'type'".into())),
    }
}

/// `response_format.json_schema`: a `schema` (an object, or `true` for any JSON value), an
/// optional string `name` and `description`, an optional boolean `strict`.
fn json_schema(v: Option<&Value>) -> Result<Format, Invalid> {
    let bad = |m: &str| {
        Invalid::new(
            "response_format",
            format!("'response_format.json_schema' {m}"),
        )
    };
    let Some(Value::Object(js)) = v else {
        return Err(bad("must be an object with a 'schema'"));
    };
    for (k, v) in js {
        let fits = match k.as_str() {
            "name" | "description" => v.is_string(),
            "strict" => v.is_boolean() || v.is_null(),
            "schema" => v.is_object() || v == &Value::Bool(true),
            _ => return Err(bad(&format!("has an unknown key '{k}'"))),
        };
        if !fits {
            return Err(bad(&format!("'{k}' has the wrong type: {v}")));
        }
    }
    match js.get("schema") {
        Some(schema) => Ok(Format::JsonSchema(schema.clone())),
        None => Err(bad("needs a 'schema'")),
    }
}

/// `stop`: a string or a list of up to 4 non-empty ones.
fn stop(obj: &Map<String, Value>) -> Result<Vec<String>, Invalid> {
    let bad = |v: &Value| {
        Invalid::new(
            "stop",
            format!("'stop' must be a non-empty string or a list of up to 4, not {v}"),
        )
    };
    match field(obj, "stop") {
        None => Ok(Vec::new()),
        Some(Value::String(s)) if !s.is_empty() => Ok(vec![s.clone()]),
        Some(Value::Array(list)) if list.len() <= 4 => list
            .iter()
            .map(|s| match s {
                Value::String(s) if !s.is_empty() => Ok(s.clone()),
                other => Err(bad(other)),
            })
            .collect(),
        Some(v) => Err(bad(v)),
    }
}

/// Completions' `logprobs: k` and `echo`, or chat's `logprobs: true` and `top_logprobs: k`.
fn logprobs(obj: &Map<String, Value>, route: Route) -> Result<(Option<usize>, bool), Invalid> {
    if route == Route::Chat {
        let top = integer(obj, "top_logprobs", 0, MAX_LOGPROBS)?;
        return match (boolean(obj, "logprobs")?.unwrap_or(false), top) {
            (true, top) => Ok((Some(top.unwrap_or(0) as usize), false)),
            (false, Some(_)) => Err(Invalid::new(
                "top_logprobs",
                "'top_logprobs' needs 'logprobs': true".into(),
            )),
            (false, None) => Ok((None, false)),
        };
    }
    let k = integer(obj, "logprobs", 0, MAX_LOGPROBS)?;
    Ok((
        k.map(|k| k as usize),
        boolean(obj, "echo")?.unwrap_or(false),
    ))
}

/// Most `logit_bias` entries a request may give (OpenAI's own cap).
pub const MAX_LOGIT_BIAS: usize = 300;

/// `logit_bias`: token id (a string, as OpenAI's JSON keys) to a bias in -100..=100, at most
/// [`MAX_LOGIT_BIAS`] entries, each token once.
fn logit_bias(obj: &Map<String, Value>, vocab: usize) -> Result<Vec<(u32, f32)>, Invalid> {
    let Some(v) = field(obj, "logit_bias") else {
        return Ok(Vec::new());
    };
    let Value::Object(map) = v else {
        return Err(Invalid::new(
            "logit_bias",
            format!("'logit_bias' must map token ids to numbers, not {v}"),
        ));
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(Invalid::new(
            "logit_bias",
            format!(
                "'logit_bias' has {} entries; at most {MAX_LOGIT_BIAS} are allowed",
                map.len()
            ),
        ));
    }
    let entries: Vec<(u32, f32)> = map
        .iter()
        .map(|(k, b)| {
            let id = k.parse::<u32>().ok().filter(|&t| (t as usize) < vocab);
            match (id, b.as_f64()) {
                (Some(id), Some(b)) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(Invalid::new(
                    "logit_bias",
                    format!("'logit_bias' entry \"{k}\": {b} must be a token id below {vocab} with a bias in -100..=100"),
                )),
            }
        })
        .collect::<Result<_, _>>()?;
    let mut ids: Vec<u32> = entries.iter().map(|e| e.0).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(Invalid::new(
            "logit_bias",
            format!("'logit_bias' names token {} twice", w[0]),
        ));
    }
    Ok(entries)
}

/// The pick: sampling, bias, allow-list, penalties and min-p.
fn rules(obj: &Map<String, Value>, vocab: usize) -> Result<PickRules, Invalid> {
    let repetition = match (
        number(obj, "repetition_penalty", 0.0, 10.0)?,
        number(obj, "repeat_penalty", 0.0, 10.0)?,
    ) {
        (Some(_), Some(_)) => {
            return Err(Invalid::new(
                "repeat_penalty",
                "give 'repetition_penalty' or 'repeat_penalty', not both".into(),
            ))
        }
        (Some(0.0), _) | (_, Some(0.0)) => {
            return Err(Invalid::new(
                "repetition_penalty",
                "'repetition_penalty' must be above 0".into(),
            ))
        }
        (a, b) => a.or(b).unwrap_or(1.0),
    };
    let allowed = match field(obj, "allowed_token_ids") {
        None => None,
        Some(_) => Some(token_ids(obj, "allowed_token_ids", vocab)?)
            .filter(|l| !l.is_empty())
            .ok_or_else(|| Invalid::new("allowed_token_ids", "'allowed_token_ids' is empty".into()))
            .map(Some)?,
    };
    Ok(PickRules {
        sampling: sampling(obj)?,
        bias: logit_bias(obj, vocab)?,
        allowed,
        presence: number(obj, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency: number(obj, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        repetition: repetition as f32,
        min_p: number(obj, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        min_tokens: integer(obj, "min_tokens", 0, MAX_TOKENS_LIMIT)?.unwrap_or(0) as usize,
        // The route adds the model's end tokens and `stop_token_ids`.
        end_tokens: Vec::new(),
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
                return Err(Invalid::new(
                    "top_k",
                    format!("'top_k' must be -1 or a whole number >= 0, not {v}"),
                ))
            }
        },
    };
    if top_p == 0.0 && temperature > 0.0 {
        return Err(Invalid::new(
            "top_p",
            "'top_p' is 0: it must be above 0 to keep any token".into(),
        ));
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

/// `prompt` of `/v1/completions`: a string, token ids, or a list of either (one choice
/// each).
pub fn completion_prompts(obj: &Map<String, Value>) -> Result<Vec<Prompt>, Invalid> {
    let bad = |v: &Value| {
        Invalid::new(
            "prompt",
            format!("'prompt' must be a string, token ids, or a list of either, not {v}"),
        )
    };
    let ids = |list: &[Value]| -> Result<Vec<u32>, Invalid> {
        list.iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| bad(t))
            })
            .collect()
    };
    match field(obj, "prompt") {
        None => Err(Invalid::new("prompt", "'prompt' is required".into())),
        Some(Value::String(s)) => Ok(vec![Prompt::Text(s.clone())]),
        Some(Value::Array(list)) if list.is_empty() => {
            Err(Invalid::new("prompt", "'prompt' is empty".into()))
        }
        Some(Value::Array(list)) if list.iter().all(Value::is_number) => {
            Ok(vec![Prompt::Tokens(ids(list)?)])
        }
        Some(Value::Array(list)) => list
            .iter()
            .map(|p| match p {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                Value::Array(t) if !t.is_empty() => Ok(Prompt::Tokens(ids(t)?)),
                other => Err(bad(other)),
            })
            .collect(),
        Some(v) => Err(bad(v)),
    }
}

/// `messages` of `/v1/chat/completions`: roles, text contents, and tool calls and answers.
pub fn chat_messages(obj: &Map<String, Value>) -> Result<Prompt, Invalid> {
    let bad = |message: String| Invalid::new("messages", message);
    let list = match field(obj, "messages") {
        None => return Err(bad("'messages' is required".into())),
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(v) => return Err(bad(format!("'messages' must be a non-empty list, not {v}"))),
    };
    let message = |(i, m): (usize, &Value)| -> Result<Message, Invalid> {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("'messages[{i}].role' must be a string")))?;
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .map(
                    |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                        _ => Err(bad(format!("'messages[{i}].content' parts must be text"))),
                    },
                )
                .collect::<Result<Vec<_>, _>>()?
                .concat(),
            Some(Value::Null) | None if role == "assistant" => String::new(),
            _ => return Err(bad(format!("'messages[{i}].content' must be a string"))),
        };
        let tools = super::tools::message_fields(i, m)?;
        Ok(Message {
            role: role.to_string(),
            content,
            tool_calls: tools.tool_calls,
            tool_call_id: tools.tool_call_id,
            name: tools.name,
        })
    };
    list.iter()
        .enumerate()
        .map(message)
        .collect::<Result<_, _>>()
        .map(Prompt::Chat)
}

/// Where the first stop string starts in `text`, and where it ends, if any.
pub fn stop_at(text: &str, stop: &[String]) -> Option<(usize, usize)> {
    stop.iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, at + s.len())))
        .min()
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
        params(&object(json.as_bytes())?, Route::Completions, 1000)
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
        assert_eq!(stop_at("abc END", &stop), Some((4, 7)));
        // Multi-byte stop strings are cut on character boundaries only.
        let stop = vec!["é!".to_string()];
        assert_eq!(partial_stop("café", &stop), "é".len());
        assert_eq!(partial_stop("caf", &stop), 0);
    }

    #[test]
    fn response_formats_are_read_or_refused_by_name() {
        let format = |rf: &str| params_of(&format!(r#"{{"response_format":{rf}}}"#));
        assert_eq!(format(r#"{"type":"text"}"#).unwrap().format, None);
        assert_eq!(
            format(r#"{"type":"json_object"}"#).unwrap().format,
            Some(Format::JsonObject)
        );
        let schema = r#"{"type":"json_schema","json_schema":{"name":"n","strict":true,
            "schema":{"type":"object"}}}"#;
        assert_eq!(
            format(schema).unwrap().format,
            Some(Format::JsonSchema(serde_json::json!({"type": "object"})))
        );
        for bad in [
            r#"{"type":"regex"}"#,
            r#"{"type":"json_object","schema":{}}"#,
            r#"{"type":"json_schema"}"#,
            r#"{"type":"json_schema","json_schema":{"name":"n"}}"#,
            r#"{"type":"json_schema","json_schema":{"schema":3}}"#,
            r#""json""#,
        ] {
            let e = format(bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("response_format"), "{bad}: {e:?}");
            assert!(e.message.contains("response_format"), "{bad}: {e:?}");
        }
        let e = params_of(r#"{"response_format":{"type":"json_object"},"min_tokens":2}"#);
        assert_eq!(e.unwrap_err().param.as_deref(), Some("min_tokens"));
    }

    #[test]
    fn sampling_follows_openai_defaults() {
        // No temperature: OpenAI's default of 1, with a random seed.
        let p = params_of(r#"{"prompt":"a"}"#)
            .unwrap()
            .rules
            .sampling
            .unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p), (1.0, 0, 1.0));
        let s = params_of(r#"{"temperature":0.7,"top_p":0.9,"seed":11,"top_k":-1}"#)
            .unwrap()
            .rules
            .sampling
            .unwrap();
        assert_eq!((s.temperature, s.top_k, s.top_p, s.seed), (0.7, 0, 0.9, 11));
        // Greedy: temperature 0, or top_k 1.
        assert_eq!(
            params_of(r#"{"temperature":0}"#).unwrap().rules.sampling,
            None
        );
        assert_eq!(params_of(r#"{"top_k":1}"#).unwrap().rules.sampling, None);
        for (bad, field) in [
            (r#"{"temperature":2.5}"#, "temperature"),
            (r#"{"top_p":0}"#, "top_p"),
            (r#"{"top_k":-2}"#, "top_k"),
            (r#"{"top_k":1.5}"#, "top_k"),
            (r#"{"seed":"s"}"#, "seed"),
        ] {
            let e = params_of(bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{bad}: {e:?}");
        }
    }
}
