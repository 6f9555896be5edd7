//! Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` checked into a
//! [`ToolRequest`] (the definitions go to the chat template as `tools`), assistant
//! `tool_calls` and `tool` messages read for the template, and the calls a model writes parsed
//! out of its text in the format its template teaches ([`ToolFormat`]): whole ([`parse`]) or
//! as it streams ([`CallStream`], which holds text back once a call may have started and
//! sends each call's arguments piece by piece as the model writes them).
//!
//! `tool_choice: "required"` and a named function hold decoding to the calls' JSON schema:
//! [`ToolRequest::constraint`] gives that schema ([`ToolConstraint`]), which the server hands
//! to the structured-output token mask as `response_format: json_schema` would, and the
//! stream of such a request ([`ToolRequest::stream`]) holds the whole answer back and turns it
//! into calls with [`ToolConstraint::calls`] when it ends.

use serde_json::{json, Map, Value};

use super::api::Invalid;
use super::chat::ChatTemplate;

mod scan;
mod stream;

pub use stream::{CallDelta, CallStream, Finished, Pushed};

/// How a model writes its tool calls (told by the markers its chat template mentions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Hermes and Qwen: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, one block
    /// per call, after any text.
    Hermes,
    /// Llama 3.1 and 3.2: `{"name": .., "parameters": {..}}` as the whole answer (after the
    /// `<|python_tag|>` token where the model writes it), calls separated by `;`.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`.
    Mistral,
}

impl ToolFormat {
    /// The format a template's source teaches; Hermes where it names no marker (its tags
    /// never open ordinary text).
    pub fn detect(source: &str) -> Self {
        if source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if source.contains("<tool_call>") {
            Self::Hermes
        } else if source.contains("<|python_tag|>") || source.contains("ipython") {
            Self::Llama3
        } else {
            Self::Hermes
        }
    }

    /// Texts that open tool calls wherever they appear.
    fn markers(self) -> &'static [&'static str] {
        match self {
            Self::Hermes => &["<tool_call>"],
            Self::Llama3 => &["<|python_tag|>"],
            Self::Mistral => &["[TOOL_CALLS]"],
        }
    }

    /// The character that opens calls when it begins the answer: the marker tokens of
    /// Llama and Mistral are special tokens, left out of the decoded text.
    fn leading(self) -> Option<char> {
        match self {
            Self::Hermes => None,
            Self::Llama3 => Some('{'),
            Self::Mistral => Some('['),
        }
    }

    /// A fresh call id: Mistral's templates take 9 letters and digits, OpenAI writes
    /// `call_` and 24.
    fn call_id(self) -> String {
        use rand::Rng;
        const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
        let mut rng = rand::rng();
        let mut pick = |n: usize| -> String {
            (0..n)
                .map(|_| ALNUM[rng.random_range(0..ALNUM.len())] as char)
                .collect()
        };
        match self {
            Self::Mistral => pick(9),
            _ => format!("call_{}", pick(24)),
        }
    }
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Its id (`tool_call_id` of the answer).
    pub id: String,
    /// The function.
    pub name: String,
    /// Its arguments, a JSON object as text (OpenAI's `arguments`).
    pub arguments: String,
}

impl ToolCall {
    /// The call as `message.tool_calls[index]` (and a streamed delta) shows it.
    pub fn to_json(&self, index: usize) -> Value {
        json!({"index": index, "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// A model's text split into its content and its calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// Text outside the calls (all of it when there are none).
    pub content: String,
    /// The calls, in order.
    pub calls: Vec<ToolCall>,
}

/// The keys a call's arguments go by (Llama's templates write `parameters`); the first one
/// written counts.
const ARGS: &[&str] = &["arguments", "parameters"];

/// One call from its object's raw text: `name`, and the arguments as the model wrote them
/// (an object's own text, or the JSON text a string holds), so that the arguments streamed
/// piece by piece ([`CallStream`]) add up to the same text.
fn call_of(raw: &str, format: ToolFormat) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(raw).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    Some(ToolCall {
        id: format.call_id(),
        name,
        arguments: arguments_of(raw)?,
    })
}

/// The arguments of the whole call object `raw` as text: `{}` where it has none; `None`
/// unless they are an object, or a string holding one.
fn arguments_of(raw: &str) -> Option<String> {
    let object = scan::object(raw);
    let Some(m) = object.member(ARGS) else {
        return Some("{}".into());
    };
    let text = &raw[m.start..m.end?];
    match serde_json::from_str::<Value>(text).ok()? {
        Value::Object(_) => Some(text.to_string()),
        Value::String(s) if serde_json::from_str::<Value>(&s).is_ok_and(|a| a.is_object()) => {
            Some(s)
        }
        _ => None,
    }
}

/// The calls of a JSON list's raw text `raw` (`[{..}, ..]`); `None` unless every item is one.
fn list_calls(raw: &str, format: ToolFormat) -> Option<Vec<ToolCall>> {
    let Value::Array(list) = serde_json::from_str(raw).ok()? else {
        return None;
    };
    let items = scan::objects(raw.trim_start().strip_prefix('[')?, ',');
    if items.len() != list.len() {
        return None;
    }
    items.iter().map(|item| call_of(item, format)).collect()
}

/// The raw texts of JSON values one after another in `text`, separated by whitespace or
/// `sep`; `None` unless the whole text is such values.
fn json_values(text: &str, sep: char) -> Option<Vec<&str>> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        values.next()?.ok()?;
        let end = values.byte_offset();
        out.push(rest[..end].trim());
        rest = rest[end..].trim_start();
        rest = rest.strip_prefix(sep).unwrap_or(rest).trim_start();
    }
    Some(out)
}

/// Hermes blocks: every `<tool_call>` up to its `</tool_call>` (or the end).
fn hermes_calls(body: &str) -> Option<(Vec<ToolCall>, String)> {
    let mut calls = Vec::new();
    let mut trailing = String::new();
    for block in body.split("<tool_call>").skip(1) {
        let (inner, after) = block.split_once("</tool_call>").unwrap_or((block, ""));
        calls.push(call_of(inner.trim(), ToolFormat::Hermes)?);
        trailing.push_str(after.trim());
    }
    Some((calls, trailing))
}

/// Llama's `{..}; {..}` (after an optional `<|python_tag|>`).
fn llama_calls(body: &str) -> Option<(Vec<ToolCall>, String)> {
    let body = body.trim_start().trim_start_matches("<|python_tag|>");
    let values = json_values(body, ';')?;
    let calls = values.iter().map(|v| call_of(v, ToolFormat::Llama3));
    Some((calls.collect::<Option<_>>()?, String::new()))
}

/// Mistral's `[TOOL_CALLS][{..}, ..]` (the marker optional: it is a special token), or the
/// newer templates' `[TOOL_CALLS]name[ARGS]{..}`, one marker per call.
fn mistral_calls(body: &str) -> Option<(Vec<ToolCall>, String)> {
    let body = body.trim_start().trim_start_matches("[TOOL_CALLS]");
    if !body.trim_start().starts_with('[') && body.contains("[ARGS]") {
        return mistral_named_calls(body);
    }
    let values = json_values(body, ';')?;
    let [list] = values.as_slice() else {
        return None;
    };
    Some((list_calls(list, ToolFormat::Mistral)?, String::new()))
}

/// The `name[ARGS]{..}` calls after the first `[TOOL_CALLS]`, each further one after its own
/// marker.
fn mistral_named_calls(body: &str) -> Option<(Vec<ToolCall>, String)> {
    let mut calls = Vec::new();
    for part in body.split("[TOOL_CALLS]") {
        let (name, args) = part.split_once("[ARGS]")?;
        let name = name.trim();
        let args = args.trim();
        let value: Value = serde_json::from_str(args).ok()?;
        if !mistral_name(name) || !value.is_object() {
            return None;
        }
        calls.push(ToolCall {
            id: ToolFormat::Mistral.call_id(),
            name: name.to_string(),
            arguments: args.to_string(),
        });
    }
    Some((calls, String::new()))
}

/// Whether `name` can be a function's name in Mistral's `name[ARGS]` (anything else there is
/// text, not a call).
fn mistral_name(name: &str) -> bool {
    !name.is_empty() && (name.chars()).all(|c| c.is_alphanumeric() || "_-.".contains(c))
}

/// The calls in a model's whole text, in `format`. Text the calls cannot be read from (cut
/// short, not JSON, no `name`) stays content, as the model wrote it.
pub fn parse(format: ToolFormat, text: &str) -> Parsed {
    let none = || Parsed {
        content: text.to_string(),
        calls: Vec::new(),
    };
    let marked = format.markers().iter().filter_map(|m| text.find(m)).min();
    let leads = format
        .leading()
        .is_some_and(|c| text.trim_start().starts_with(c));
    let start = match (marked, leads) {
        (_, true) => 0,
        (Some(at), false) => at,
        (None, false) => return none(),
    };
    let (content, body) = text.split_at(start);
    let found = match format {
        ToolFormat::Hermes => hermes_calls(body),
        ToolFormat::Llama3 => llama_calls(body),
        ToolFormat::Mistral => mistral_calls(body),
    };
    match found {
        Some((calls, trailing)) if !calls.is_empty() => Parsed {
            content: format!("{content}{trailing}"),
            calls,
        },
        _ => none(),
    }
}

/// What `tool_choice` asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default with tools).
    Auto,
    /// No calls: tools are not rendered and the text is not parsed.
    None,
    /// At least one call.
    Required,
    /// A call of this function.
    Function(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    /// The definitions as the request gives them (what the template renders).
    pub tools: Vec<Value>,
    /// `tool_choice`.
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): false keeps the first call only.
    pub parallel: bool,
    /// How the served model writes calls.
    pub format: ToolFormat,
}

/// What decoding must be held to for `tool_choice: "required"` or a named function: the
/// structured-output token mask enforces `schema`, and [`ToolConstraint::calls`] reads the
/// calls out of the text it allowed.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolConstraint {
    /// A JSON schema the whole answer must match.
    pub schema: Value,
    /// What that answer is.
    pub form: ConstrainedForm,
}

/// The shape of a constrained answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConstrainedForm {
    /// `[{"name": .., "arguments": {..}}, ..]`: one or more calls of any tool.
    CallList,
    /// The arguments object of a call of this function.
    Arguments(String),
}

impl ToolConstraint {
    /// The calls of a constrained answer `text`.
    pub fn calls(&self, text: &str, format: ToolFormat) -> Result<Vec<ToolCall>, String> {
        let value: Value = serde_json::from_str(text.trim())
            .map_err(|e| format!("the constrained tool-call answer is not JSON: {e}"))?;
        let bad = || format!("the constrained tool-call answer does not match its schema: {text}");
        match &self.form {
            ConstrainedForm::Arguments(name) if value.is_object() => Ok(vec![ToolCall {
                id: format.call_id(),
                name: name.clone(),
                arguments: value.to_string(),
            }]),
            ConstrainedForm::CallList => match &value {
                Value::Array(list) if !list.is_empty() => {
                    list_calls(text.trim(), format).ok_or_else(bad)
                }
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }
}

fn bad(param: &str, message: String) -> Invalid {
    Invalid::new(param, message)
}

/// A function's name and parameters schema, from one `tools` entry.
fn function_of(i: usize, tool: &Value) -> Result<(String, Value), Invalid> {
    let at = format!("'tools[{i}]'");
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad(
            "tools",
            format!("{at} must have \"type\": \"function\""),
        ));
    }
    let Some(Value::Object(f)) = tool.get("function") else {
        return Err(bad("tools", format!("{at}.function must be an object")));
    };
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    let legal = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.';
    if name.is_empty() || name.len() > 64 || !name.chars().all(legal) {
        return Err(bad(
            "tools",
            format!("{at}.function.name must be 1 to 64 letters, digits, '_', '-' or '.'"),
        ));
    }
    let params = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(p) => {
            return Err(bad(
                "tools",
                format!("{at}.function.parameters must be a JSON schema object, not {p}"),
            ))
        }
    };
    let kind_ok =
        |key: &str, ok: fn(&Value) -> bool| f.get(key).is_none_or(|v| v.is_null() || ok(v));
    if !kind_ok("description", Value::is_string) || !kind_ok("strict", Value::is_boolean) {
        return Err(bad(
            "tools",
            format!("{at}.function: 'description' must be a string, 'strict' true or false"),
        ));
    }
    Ok((name.to_string(), params))
}

/// `tool_choice`, with the tools' `names`.
fn choice_of(v: Option<&Value>, names: &[String]) -> Result<ToolChoice, Invalid> {
    let named = |v: &Value| {
        let f = v.get("function")?;
        (v.get("type")?.as_str()? == "function").then_some(())?;
        f.get("name")?.as_str().map(str::to_string)
    };
    let choice = match v {
        None => return Ok(if names.is_empty() { ToolChoice::None } else { ToolChoice::Auto }),
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(v @ Value::Object(_)) => ToolChoice::Function(named(v).ok_or_else(|| {
            bad(
                "tool_choice",
                format!("'tool_choice' {v} must be {{\"type\": \"function\", \"function\": {{\"name\": ..}}}}"),
            )
        })?),
        Some(v) => {
            return Err(bad(
                "tool_choice",
                format!("'tool_choice' must be \"auto\", \"none\", \"required\" or a named function, not {v}"),
            ))
        }
    };
    if let ToolChoice::Function(name) = &choice {
        if !names.contains(name) {
            return Err(bad(
                "tool_choice",
                format!("'tool_choice' names function '{name}', which 'tools' does not define"),
            ));
        }
    }
    if choice != ToolChoice::None && names.is_empty() {
        return Err(bad(
            "tool_choice",
            "'tool_choice' other than \"none\" needs 'tools'".into(),
        ));
    }
    Ok(choice)
}

/// `parallel_tool_calls` (default true).
fn parallel_of(v: Option<&Value>) -> Result<bool, Invalid> {
    match v {
        None => Ok(true),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(
            "parallel_tool_calls",
            format!("'parallel_tool_calls' must be true or false, not {v}"),
        )),
    }
}

impl ToolRequest {
    /// The tools of a chat request `obj` for a model with `template` (its chat template):
    /// `None` when it gives none or `tool_choice` is `none`. Refused: a malformed definition
    /// or choice, and a template that does not read `tools`.
    pub fn from_request(
        obj: &Map<String, Value>,
        template: Option<&ChatTemplate>,
    ) -> Result<Option<Self>, Invalid> {
        let field = |name: &str| obj.get(name).filter(|v| !v.is_null());
        let tools = match field("tools") {
            None => Vec::new(),
            Some(Value::Array(list)) => list.clone(),
            Some(v) => return Err(bad("tools", format!("'tools' must be a list, not {v}"))),
        };
        let mut names: Vec<String> = Vec::new();
        for (i, tool) in tools.iter().enumerate() {
            let (name, _) = function_of(i, tool)?;
            if names.contains(&name) {
                return Err(bad("tools", format!("'tools' defines '{name}' twice")));
            }
            names.push(name);
        }
        let choice = choice_of(field("tool_choice"), &names)?;
        let parallel = parallel_of(field("parallel_tool_calls"))?;
        if choice == ToolChoice::None {
            return Ok(None);
        }
        if template.is_some_and(|t| !t.reads_tools()) {
            return Err(bad(
                "tools",
                "the model's chat template does not read `tools`, so they cannot reach the \
                 model: serve --chat-template FILE with a tool-capable template"
                    .into(),
            ));
        }
        let format = template.map_or(ToolFormat::Hermes, ChatTemplate::tool_format);
        Ok(Some(Self {
            tools,
            choice,
            parallel,
            format,
        }))
    }

    /// The schema `tool_choice: "required"` or a named function holds decoding to; `None`
    /// for `auto` (the model decides) and `none`.
    pub fn constraint(&self) -> Option<ToolConstraint> {
        let functions = self.tools.iter().enumerate();
        let defs: Vec<(String, Value)> = functions
            .filter_map(|(i, t)| function_of(i, t).ok())
            .collect();
        match &self.choice {
            ToolChoice::Auto | ToolChoice::None => None,
            ToolChoice::Function(name) => {
                let params = defs.iter().find(|(n, _)| n == name)?.1.clone();
                Some(ToolConstraint {
                    schema: params,
                    form: ConstrainedForm::Arguments(name.clone()),
                })
            }
            ToolChoice::Required => {
                let any: Vec<Value> = defs
                    .iter()
                    .map(|(name, params)| {
                        json!({"type": "object", "properties": {
                            "name": {"type": "string", "enum": [name]}, "arguments": params},
                            "required": ["name", "arguments"], "additionalProperties": false})
                    })
                    .collect();
                let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": any}});
                if !self.parallel {
                    schema["maxItems"] = json!(1);
                }
                Some(ToolConstraint {
                    schema,
                    form: ConstrainedForm::CallList,
                })
            }
        }
    }

    /// A stream watching one choice's text for calls (held whole where [`Self::constraint`]
    /// holds decoding to calls).
    pub fn stream(&self) -> CallStream {
        match self.constraint() {
            Some(c) => CallStream::forced(self.format, c),
            None => CallStream::new(self.format, !self.parallel),
        }
    }
}

/// A chat message's tool fields, for the template: an assistant's `tool_calls` (their
/// `arguments` JSON text read into objects, as Hugging Face templates expect), a `tool`
/// message's `tool_call_id`, and `name`.
pub fn message_fields(i: usize, m: &Value) -> Result<MessageTools, Invalid> {
    let at = |what: &str| format!("'messages[{i}].{what}'");
    let string = |key: &str| match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad("messages", format!("{} must be a string", at(key)))),
    };
    let calls = match m.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) if m.get("role").and_then(Value::as_str) == Some("assistant") => {
            let one = |(j, c): (usize, &Value)| -> Result<Value, Invalid> {
                let wrong = || {
                    bad(
                        "messages",
                        format!(
                            "{} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\": JSON text}}}}",
                            at(&format!("tool_calls[{j}]"))
                        ),
                    )
                };
                let f = c.get("function").ok_or_else(wrong)?;
                let name = f.get("name").and_then(Value::as_str).ok_or_else(wrong)?;
                let args = match f.get("arguments") {
                    Some(Value::String(s)) => serde_json::from_str(s).map_err(|_| wrong())?,
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => return Err(wrong()),
                };
                let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
                Ok(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": args}}))
            };
            Some(list.iter().enumerate().map(one).collect::<Result<_, _>>()?)
        }
        Some(_) => {
            return Err(bad(
                "messages",
                format!(
                    "{} must be a list, on an assistant message",
                    at("tool_calls")
                ),
            ))
        }
    };
    Ok(MessageTools {
        tool_calls: calls,
        tool_call_id: string("tool_call_id")?,
        name: string("name")?,
    })
}

/// The tool fields of one message ([`message_fields`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MessageTools {
    /// An assistant's calls, arguments as objects.
    pub tool_calls: Option<Vec<Value>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// The author's name.
    pub name: Option<String>,
}

#[cfg(test)]
mod tests;
