//! A streamed answer watched for tool calls ([`CallStream`]): text goes out as content until a
//! call may have started; from there it is held, and (in a live stream) each call goes out as
//! OpenAI streams it: a header with its id and name once both the name is known and its
//! arguments have begun, then the arguments' text piece by piece as the model writes it.
//! Nothing that is not the arguments goes out: a piece is sent only while inside the
//! arguments' value (the scan in [`super::scan`] knows where it closes), so the wrapper's
//! closing `}` and the call's closing marker are never in it. When the answer ends, the whole
//! text is parsed as [`super::parse`] parses it, and what went out must be how those calls
//! begin; the rest of each call follows.

use serde_json::{json, Value};

use super::{mistral_name, parse, scan, ToolCall, ToolConstraint, ToolFormat, ARGS};

/// One item of a streamed `delta.tool_calls`: a call's header (its first delta: id, name and
/// arguments `""`), or a piece of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct CallDelta {
    /// The call's index among the answer's calls.
    pub index: usize,
    /// The call's id and function name, on its first delta only.
    pub head: Option<(String, String)>,
    /// A piece of the arguments' JSON text (empty on a header).
    pub arguments: String,
}

impl CallDelta {
    /// The delta as OpenAI streams it.
    pub fn to_json(&self) -> Value {
        let mut v = json!({"index": self.index, "function": {"arguments": self.arguments}});
        if let Some((id, name)) = &self.head {
            v["id"] = json!(id);
            v["type"] = json!("function");
            v["function"]["name"] = json!(name);
        }
        v
    }

    /// The two deltas of call `index` sent whole: its header, then all of its arguments.
    fn whole(index: usize, call: &ToolCall) -> [Self; 2] {
        [
            Self {
                index,
                head: Some((call.id.clone(), call.name.clone())),
                arguments: String::new(),
            },
            Self {
                index,
                head: None,
                arguments: call.arguments.clone(),
            },
        ]
    }
}

/// What a piece of text lets out: content, and (live) tool-call deltas.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Pushed {
    /// Text that goes out as content.
    pub content: String,
    /// Tool-call deltas, in order.
    pub calls: Vec<CallDelta>,
}

/// The end of an answer: the content and deltas still to send, and its calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Finished {
    /// Content not yet released.
    pub content: String,
    /// Deltas that finish the calls (all of them, where none went out yet; none unless live).
    pub deltas: Vec<CallDelta>,
    /// The calls, as the whole answer holds them (ids as streamed).
    pub calls: Vec<ToolCall>,
}

/// A call whose header went out: its id, name, and the arguments' text sent so far.
#[derive(Debug, Clone)]
struct Sent {
    id: String,
    name: String,
    arguments: String,
}

/// A streamed answer's text, watched for tool calls (see the module's notes).
#[derive(Debug, Clone)]
pub struct CallStream {
    format: ToolFormat,
    /// At most one call is returned (`parallel_tool_calls: false`).
    single: bool,
    /// The whole text so far.
    text: String,
    /// Bytes of `text` looked at and released as content.
    sent: usize,
    /// The content released (before `finish`, `text[..sent]`).
    content: String,
    /// Where a call may have started: from there nothing goes out as content before the end.
    held: Option<usize>,
    /// The schema decoding is held to (`tool_choice` `required` or a named function): the
    /// whole answer is held and read as calls at the end.
    forced: Option<ToolConstraint>,
    /// Calls go out as they are written (a streamed response); else `finish` reads them.
    live: bool,
    /// The calls whose header went out.
    calls: Vec<Sent>,
}

/// Where a call's parts lie in the held text.
enum Shape<'a> {
    /// `{"name": .., "arguments": {..}}` as far as written.
    Wrapped(&'a str),
    /// Mistral's `name[ARGS]{..}`: the name, and the arguments as far as written.
    Named(&'a str, &'a str),
}

impl Shape<'_> {
    /// The call's name and its arguments' text so far, once the name is known and the
    /// arguments have begun as an object (or the call has ended without any: `{}`). `None`
    /// before that, and where they cannot become a call's.
    fn progress(&self) -> Option<(String, String)> {
        match *self {
            Shape::Named(name, args) => {
                let name = name.trim();
                let end = scan::value_end(args).unwrap_or(args.len());
                mistral_name(name).then(|| (name.to_string(), args[..end].to_string()))
            }
            Shape::Wrapped(raw) => {
                let object = scan::object(raw);
                let m = object.member(&["name"]).filter(|_| !object.broken)?;
                let name: String = serde_json::from_str(&raw[m.start..m.end?]).ok()?;
                let args = match object.member(ARGS) {
                    None => object.end.map(|_| "{}".to_string())?,
                    Some(m) if raw[m.start..].starts_with('{') => {
                        raw[m.start..m.end.unwrap_or(raw.len())].to_string()
                    }
                    // Arguments as a string are sent once whole, decoded.
                    Some(m) => {
                        let text: String = serde_json::from_str(&raw[m.start..m.end?]).ok()?;
                        serde_json::from_str::<serde_json::Map<String, Value>>(&text).ok()?;
                        text
                    }
                };
                Some((name, args))
            }
        }
    }
}

/// The calls in `body` (the held text, from where a call may start) as far as written, in
/// the places [`super::parse`] reads them from.
fn shapes(format: ToolFormat, body: &str) -> Vec<Shape<'_>> {
    match format {
        ToolFormat::Hermes => (body.split("<tool_call>").skip(1))
            .map(|b| b.split_once("</tool_call>").map_or(b, |(inner, _)| inner))
            .map(str::trim_start)
            .take_while(|t| t.starts_with('{'))
            .map(Shape::Wrapped)
            .collect(),
        ToolFormat::Llama3 => {
            let body = body.trim_start().trim_start_matches("<|python_tag|>");
            let calls = scan::objects(body, ';').into_iter();
            calls.map(Shape::Wrapped).collect()
        }
        ToolFormat::Mistral => {
            let body = body.trim_start().trim_start_matches("[TOOL_CALLS]");
            if let Some(list) = body.trim_start().strip_prefix('[') {
                let calls = scan::objects(list, ',').into_iter();
                return calls.map(Shape::Wrapped).collect();
            }
            let mut out = Vec::new();
            for part in body.split("[TOOL_CALLS]") {
                match part.split_once("[ARGS]") {
                    Some((name, args)) if args.trim_start().starts_with('{') => {
                        out.push(Shape::Named(name, args.trim_start()))
                    }
                    _ => break,
                }
            }
            out
        }
    }
}

impl CallStream {
    /// A stream for `format`, keeping one call only when `single`; calls are read at the end
    /// (see [`Self::live`]).
    pub fn new(format: ToolFormat, single: bool) -> Self {
        Self {
            format,
            single,
            text: String::new(),
            sent: 0,
            content: String::new(),
            held: None,
            forced: None,
            live: false,
            calls: Vec::new(),
        }
    }

    /// A stream of an answer held to `constraint`: nothing goes out as content; at the end
    /// the answer is read as calls (as content if it is none, e.g. cut by `max_tokens`).
    pub fn forced(format: ToolFormat, constraint: ToolConstraint) -> Self {
        Self {
            held: Some(0),
            forced: Some(constraint),
            ..Self::new(format, false)
        }
    }

    /// The same stream sending its calls' deltas as they are written (a streamed response).
    /// A forced answer's calls still go out whole at the end: its text is read as calls only
    /// once it is complete.
    pub fn live(self) -> Self {
        Self { live: true, ..self }
    }

    /// The content released so far.
    pub fn content(&self) -> &str {
        &self.content
    }

    /// Adds `delta`; returns the content, and (live) the call deltas, that may go out now.
    pub fn push(&mut self, delta: &str) -> Pushed {
        self.text.push_str(delta);
        let content = match self.held {
            Some(_) => String::new(),
            None => self.watch(),
        };
        let calls = match self.live && self.forced.is_none() {
            true => self.advance(),
            false => Vec::new(),
        };
        Pushed { content, calls }
    }

    /// The content before any call: up to a marker or the beginning of one at the end of the
    /// text (or none, where the answer opens with the format's leading character).
    fn watch(&mut self) -> String {
        if let Some(lead) = self.format.leading().filter(|_| self.sent == 0) {
            let start = self.text.trim_start();
            if start.is_empty() {
                return String::new();
            }
            if start.starts_with(lead) {
                self.held = Some(0);
                return String::new();
            }
        }
        let rest = &self.text[self.sent..];
        let markers = self.format.markers();
        let ready = match markers.iter().filter_map(|m| rest.find(m)).min() {
            Some(at) => {
                self.held = Some(self.sent + at);
                self.sent + at
            }
            None => {
                let markers: Vec<String> = markers.iter().map(|m| m.to_string()).collect();
                self.text.len() - crate::server::api::partial_stop(rest, &markers)
            }
        };
        self.release(ready)
    }

    /// The deltas the held text allows beyond those sent: headers of calls newly named,
    /// pieces of arguments newly written.
    fn advance(&mut self) -> Vec<CallDelta> {
        let Some(held) = self.held else {
            return Vec::new();
        };
        let limit = if self.single { 1 } else { usize::MAX };
        let mut out = Vec::new();
        let found = shapes(self.format, &self.text[held..]);
        for (k, shape) in found.iter().enumerate().take(limit) {
            let Some((name, args)) = shape.progress() else {
                break;
            };
            if k == self.calls.len() {
                let id = self.format.call_id();
                let head = Some((id.clone(), name.clone()));
                out.push(CallDelta {
                    index: k,
                    head,
                    arguments: String::new(),
                });
                let arguments = String::new();
                self.calls.push(Sent {
                    id,
                    name,
                    arguments,
                });
            } else if self.calls[k].name != name {
                break;
            }
            let sent = &mut self.calls[k];
            if let Some(more) = args.strip_prefix(&sent.arguments).filter(|m| !m.is_empty()) {
                let arguments = more.to_string();
                out.push(CallDelta {
                    index: k,
                    head: None,
                    arguments,
                });
                sent.arguments = args;
            }
        }
        out
    }

    /// Moves `text[sent..ready]` into the content; returns it.
    fn release(&mut self, ready: usize) -> String {
        let out = self.text[self.sent..ready].to_string();
        self.content.push_str(&out);
        self.sent = ready;
        out
    }

    /// The answer has ended: the content not yet released, the deltas that finish its calls,
    /// and the calls (none when the held text holds no readable call: it is then content).
    /// An error where a call's header went out but the whole text does not finish it as a
    /// call (cut short, or broken): nothing sent can be taken back, so the stream must end in
    /// an error rather than leave the client a call that is not one.
    pub fn finish(&mut self) -> Result<Finished, String> {
        let calls = match &self.forced {
            Some(forced) => forced.calls(&self.text, self.format).unwrap_or_default(),
            None => {
                let mut parsed = parse(self.format, &self.text).calls;
                if self.single {
                    parsed.truncate(1);
                }
                parsed
            }
        };
        if calls.is_empty() {
            if !self.calls.is_empty() {
                return Err(self.unfinished(0));
            }
            let content = self.release(self.text.len());
            return Ok(Finished {
                content,
                ..Finished::default()
            });
        }
        let mut calls = calls;
        let deltas = self.settle(&mut calls)?;
        let content = match &self.forced {
            Some(_) => String::new(),
            // The content before the calls went out already; text after them is content too.
            None => (parse(self.format, &self.text).content.get(self.sent..))
                .unwrap_or_default()
                .to_string(),
        };
        self.content.push_str(&content);
        self.sent = self.text.len();
        Ok(Finished {
            content,
            deltas,
            calls,
        })
    }

    /// The deltas that finish `calls` from what went out (the calls take the ids sent); an
    /// error where what went out is not how `calls` begin.
    fn settle(&self, calls: &mut [ToolCall]) -> Result<Vec<CallDelta>, String> {
        if !self.live {
            return Ok(Vec::new());
        }
        if calls.len() < self.calls.len() {
            return Err(self.unfinished(calls.len()));
        }
        let mut out = Vec::new();
        for (k, call) in calls.iter_mut().enumerate() {
            let Some(sent) = self.calls.get(k) else {
                out.extend(CallDelta::whole(k, call));
                continue;
            };
            let rest = (call.arguments.strip_prefix(&sent.arguments))
                .filter(|_| call.name == sent.name)
                .ok_or_else(|| self.unfinished(k))?;
            if !rest.is_empty() {
                let arguments = rest.to_string();
                out.push(CallDelta {
                    index: k,
                    head: None,
                    arguments,
                });
            }
            call.id = sent.id.clone();
        }
        Ok(out)
    }

    /// Why the stream ends in an error: call `k` went out in part and is no call.
    fn unfinished(&self, k: usize) -> String {
        let name = self.calls.get(k).map_or("", |c| c.name.as_str());
        let held = &self.text[self.held.unwrap_or(0)..];
        format!(
            "tool call {k} ('{name}') was streamed in part, but the answer does not finish it as \
             a call (cut short, e.g. by max_tokens, or not valid JSON); the model's text from \
             the call on: {held}"
        )
    }
}
