//! Tool-call parsing on the texts models write in each format, streamed in pieces as well as
//! whole; the request's checks; the constraint schema; tool messages for the template.

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::*;
use crate::server::api;

/// (name, arguments as a value) of each call.
fn named(calls: &[ToolCall]) -> Vec<(String, Value)> {
    calls
        .iter()
        .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
        .collect()
}

fn weather(city: &str) -> (String, Value) {
    ("get_weather".into(), json!({"city": city}))
}

#[test]
fn hermes_blocks_after_text() {
    // As Qwen 2.5 and Hermes 2 Pro write them: text, then one block per call.
    let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}\n</tool_call>";
    let p = parse(ToolFormat::Hermes, text);
    assert_eq!(p.content, "Let me look.\n");
    assert_eq!(named(&p.calls), vec![weather("Paris"), weather("Lyon")]);
    for c in &p.calls {
        assert!(c.id.starts_with("call_") && c.id.len() == 29, "{}", c.id);
    }
    assert_ne!(p.calls[0].id, p.calls[1].id);
    // Arguments given as JSON text are taken as the object they hold.
    let quoted = r#"<tool_call>{"name": "f", "arguments": "{\"x\": 1}"}</tool_call>"#;
    assert_eq!(
        named(&parse(ToolFormat::Hermes, quoted).calls),
        vec![("f".into(), json!({"x": 1}))]
    );
}

#[test]
fn llama_json_with_and_without_the_python_tag() {
    let p = parse(
        ToolFormat::Llama3,
        r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#,
    );
    assert_eq!(
        (p.content.as_str(), named(&p.calls)),
        ("", vec![weather("Paris")])
    );
    let two = r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}"#;
    let p = parse(ToolFormat::Llama3, two);
    assert_eq!(named(&p.calls), vec![weather("Paris"), weather("Oslo")]);
    // Not calls: prose, and JSON without a name.
    for text in ["The set {1, 2} has two members.", r#"{"answer": 4}"#] {
        let p = parse(ToolFormat::Llama3, text);
        assert_eq!((p.content.as_str(), p.calls.len()), (text, 0));
    }
}

#[test]
fn mistral_list_with_and_without_its_marker() {
    let body = r#"[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]"#;
    for text in [format!("[TOOL_CALLS]{body}"), format!(" {body}")] {
        let p = parse(ToolFormat::Mistral, &text);
        assert_eq!(named(&p.calls), vec![weather("Paris"), weather("Rome")]);
        // Mistral's templates take ids of 9 letters and digits.
        assert!(p
            .calls
            .iter()
            .all(|c| c.id.len() == 9 && c.id.chars().all(|ch| ch.is_ascii_alphanumeric())));
    }
    let p = parse(ToolFormat::Mistral, "[1] is a citation.");
    assert_eq!(p.calls.len(), 0);
}

/// The newer Mistral templates' `[TOOL_CALLS]name[ARGS]{..}`, one marker per call, after
/// content; a broken one (no name, arguments not an object, cut short) stays content.
#[test]
fn mistral_named_calls_with_args_markers() {
    let text = r#"Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS] {"city": "Rome"}"#;
    let p = parse(ToolFormat::Mistral, text);
    assert_eq!(named(&p.calls), vec![weather("Paris"), weather("Rome")]);
    assert_eq!(p.content, "Checking. ");
    for bad in [
        r#"[TOOL_CALLS][ARGS]{"city": "Paris"}"#,
        r#"[TOOL_CALLS]get_weather[ARGS][1, 2]"#,
        r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Pa"#,
        r#"[TOOL_CALLS]get weather[ARGS]{}"#,
    ] {
        let p = parse(ToolFormat::Mistral, bad);
        assert_eq!((p.content.as_str(), p.calls.len()), (bad, 0), "{bad}");
    }
}

#[test]
fn unreadable_calls_stay_content() {
    for (format, text) in [
        (
            ToolFormat::Hermes,
            r#"<tool_call>{"name": "f", "arguments": {"a": "#,
        ),
        (ToolFormat::Hermes, "<tool_call>not json</tool_call>"),
        (
            ToolFormat::Hermes,
            r#"<tool_call>{"arguments": {}}</tool_call>"#,
        ),
        (ToolFormat::Llama3, r#"{"name": "f", "parameters": [1]}"#),
        (ToolFormat::Mistral, r#"[TOOL_CALLS][{"name": "f""#),
    ] {
        let p = parse(format, text);
        assert_eq!((p.content.as_str(), p.calls.len()), (text, 0), "{format:?}");
    }
}

/// What a live stream let out: the content pieces, the call deltas, and the calls.
struct Streamed {
    content: Vec<String>,
    deltas: Vec<CallDelta>,
    calls: Vec<ToolCall>,
}

impl Streamed {
    /// The arguments' pieces of call `k`, checked: its first delta is its only header, with
    /// the call's id and name.
    fn pieces(&self, k: usize) -> Vec<&str> {
        let mine: Vec<&CallDelta> = self.deltas.iter().filter(|d| d.index == k).collect();
        let call = &self.calls[k];
        assert_eq!(mine[0].head, Some((call.id.clone(), call.name.clone())));
        assert_eq!(mine[0].arguments, "");
        assert!(mine[1..]
            .iter()
            .all(|d| d.head.is_none() && !d.arguments.is_empty()));
        mine[1..].iter().map(|d| d.arguments.as_str()).collect()
    }
}

/// Feeds `pieces` to a live stream in order.
fn stream_pieces<'a>(format: ToolFormat, pieces: impl Iterator<Item = &'a str>) -> Streamed {
    let mut s = CallStream::new(format, false).live();
    let (mut content, mut deltas) = (Vec::new(), Vec::new());
    for piece in pieces {
        let out = s.push(piece);
        content.push(out.content);
        deltas.extend(out.calls);
    }
    let end = s.finish().unwrap();
    content.push(end.content);
    deltas.extend(end.deltas);
    assert_eq!(s.content(), content.concat());
    Streamed {
        content,
        deltas,
        calls: end.calls,
    }
}

/// `text` cut at the byte offsets `cuts` (ascending char boundaries).
fn cut_at<'a>(text: &'a str, cuts: &'a [usize]) -> impl Iterator<Item = &'a str> {
    let ends = cuts.iter().copied().chain([text.len()]);
    let starts = [0].into_iter().chain(cuts.iter().copied());
    starts.zip(ends).map(move |(a, b)| &text[a..b])
}

/// `text` cut at random places, pieces of 1 to 5 bytes.
fn random_cuts(text: &str, seed: u64) -> Vec<usize> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (mut cuts, mut at) = (Vec::new(), 0);
    loop {
        at += rng.random_range(1..6);
        while at < text.len() && !text.is_char_boundary(at) {
            at += 1;
        }
        if at >= text.len() {
            return cuts;
        }
        cuts.push(at);
    }
}

/// A streamed answer agrees with the whole one: the same content and calls, every call's
/// argument pieces adding up to its arguments exactly, and no piece of a call in the content.
fn agrees(format: ToolFormat, text: &str, got: &Streamed) {
    let whole = parse(format, text);
    assert_eq!(got.content.concat(), whole.content, "{text}");
    assert_eq!(named(&got.calls), named(&whole.calls), "{text}");
    for (k, call) in got.calls.iter().enumerate() {
        assert_eq!(got.pieces(k).concat(), call.arguments, "{text}");
        assert_eq!(call.arguments, whole.calls[k].arguments, "{text}");
    }
    if !got.calls.is_empty() {
        let pieces = &got.content;
        assert!(pieces
            .iter()
            .all(|d| !d.contains('{') && !d.contains("<tool")));
    }
}

const STREAM_CASES: [(ToolFormat, &str); 9] = [
    (ToolFormat::Hermes, "Sure: <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
    (ToolFormat::Hermes, "a < b and <tool_ is not a tag; done."),
    (ToolFormat::Llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"),
    (ToolFormat::Llama3, "No call here {x}."),
    (ToolFormat::Mistral, "  [TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]"),
    (ToolFormat::Mistral, "Let me see. [TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}"),
    (ToolFormat::Hermes, "Cut: <tool_call>{\"name\": \"get_weather\", \"argu"),
    (ToolFormat::Hermes, "<tool_call>{\"arguments\": {\"q\": \"a}\\\"b</tool\", \"n\": [1, {\"x\": 2}]}, \"name\": \"search\"}</tool_call>\n<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"k\\\": 1}\"}</tool_call> après"),
    (ToolFormat::Llama3, "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"s\": \"é;}\"}}; {\"name\": \"b\"}"),
];

#[test]
fn streams_hold_text_once_a_call_may_start() {
    let mut compared = 0;
    for seed in 0..20 {
        for (format, text) in STREAM_CASES.into_iter().take(7) {
            let cuts = random_cuts(text, seed);
            agrees(format, text, &stream_pieces(format, cut_at(text, &cuts)));
            compared += 1;
        }
    }
    assert_eq!(compared, 140);
}

/// Every place a token boundary can fall: each text in two pieces cut at every position, and
/// one character at a time; the arguments' pieces always add up to the whole answer's.
#[test]
fn streams_agree_when_cut_at_every_position() {
    let mut compared = 0;
    for (format, text) in STREAM_CASES {
        let bounds: Vec<usize> = (1..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &at in &bounds {
            agrees(format, text, &stream_pieces(format, cut_at(text, &[at])));
            compared += 1;
        }
        let got = stream_pieces(format, cut_at(text, &bounds));
        agrees(format, text, &got);
        compared += 1;
    }
    assert!(compared > 600, "{compared}");
}

/// Written a few characters at a time, a call's arguments go out in pieces as they are
/// written, in every format: more than one piece per call, the header before any of them.
#[test]
fn arguments_stream_in_pieces_in_every_format() {
    let args = r#"{"city": "Paris", "days": 3, "units": "metric"}"#;
    let cases = [
        (ToolFormat::Hermes, format!("<tool_call>{{\"name\": \"get_weather\", \"arguments\": {args}}}</tool_call><tool_call>{{\"name\": \"get_time\", \"arguments\": {args}}}</tool_call>")),
        (ToolFormat::Llama3, format!("{{\"name\": \"get_weather\", \"parameters\": {args}}}; {{\"name\": \"get_time\", \"parameters\": {args}}}")),
        (ToolFormat::Mistral, format!("[TOOL_CALLS][{{\"name\": \"get_weather\", \"arguments\": {args}}}, {{\"name\": \"get_time\", \"arguments\": {args}}}]")),
        (ToolFormat::Mistral, format!("[TOOL_CALLS]get_weather[ARGS]{args}[TOOL_CALLS]get_time[ARGS]{args}")),
    ];
    for (format, text) in &cases {
        let cuts: Vec<usize> = (4..text.len()).step_by(4).collect();
        let got = stream_pieces(*format, cut_at(text, &cuts));
        agrees(*format, text, &got);
        assert_eq!(got.calls.len(), 2, "{text}");
        for k in 0..2 {
            assert_eq!(got.pieces(k).concat(), args, "{text}");
            assert!(got.pieces(k).len() >= 5, "{format:?}: {:?}", got.pieces(k));
        }
        // Call 1's header comes after every piece of call 0.
        let first_of_1 = got.deltas.iter().position(|d| d.index == 1).unwrap();
        assert!(got.deltas[first_of_1..].iter().all(|d| d.index == 1));
    }
}

/// A call whose header went out but which the answer never finishes (cut short) ends the
/// stream in an error naming it; the same text read whole (not live) is content, as before.
#[test]
fn a_call_streamed_in_part_and_never_finished_is_an_error() {
    let text = "Sure. <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa";
    let mut live = CallStream::new(ToolFormat::Hermes, false).live();
    let out = live.push(text);
    assert_eq!(out.content, "Sure. ");
    assert_eq!(out.calls.len(), 2, "{:?}", out.calls);
    assert_eq!(out.calls[1].arguments, "{\"city\": \"Pa");
    let e = live.finish().unwrap_err();
    assert!(
        e.contains("tool call 0 ('get_weather')") && e.contains("\"Pa"),
        "{e}"
    );
    let mut whole = CallStream::new(ToolFormat::Hermes, false);
    assert!(whole.push(text).calls.is_empty());
    let end = whole.finish().unwrap();
    assert_eq!((whole.content(), end.calls.len()), (text, 0));
    // Broken after its arguments (Llama's calls must be the whole answer): an error too.
    let mut live = CallStream::new(ToolFormat::Llama3, false).live();
    live.push("{\"name\": \"f\", \"parameters\": {\"a\": 1}} and more");
    assert!(live.finish().is_err());
}

#[test]
fn one_call_only_without_parallel_calls() {
    let text = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>";
    for live in [false, true] {
        let s = CallStream::new(ToolFormat::Hermes, true);
        let mut s = if live { s.live() } else { s };
        let pushed = s.push(text);
        let end = s.finish().unwrap();
        assert_eq!(end.calls.len(), 1);
        assert_eq!(end.calls[0].name, "a");
        let deltas = [pushed.calls, end.deltas].concat();
        assert!(deltas.iter().all(|d| d.index == 0), "{deltas:?}");
        assert_eq!(deltas.len(), if live { 2 } else { 0 });
    }
}

const TOOLS_TEMPLATE: &str = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}\
{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}{% endfor %}";

fn request(body: Value) -> Result<Option<ToolRequest>, Invalid> {
    let template = ChatTemplate::new(TOOLS_TEMPLATE, "", "").unwrap();
    ToolRequest::from_request(body.as_object().unwrap(), Some(&template))
}

fn tool(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters":
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

#[test]
fn requests_are_checked_by_field() {
    let ok = request(json!({"tools": [tool("a"), tool("b")]}))
        .unwrap()
        .unwrap();
    assert_eq!(
        (ok.choice.clone(), ok.parallel, ok.format),
        (ToolChoice::Auto, true, ToolFormat::Hermes)
    );
    assert_eq!(
        request(json!({"tools": [tool("a")], "tool_choice": "none"})).unwrap(),
        None
    );
    assert_eq!(request(json!({"tool_choice": "none"})).unwrap(), None);
    for (body, param) in [
        (json!({"tools": {"a": 1}}), "tools"),
        (
            json!({"tools": [{"type": "code", "function": {"name": "a"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools",
        ),
        (json!({"tools": [tool("a"), tool("a")]}), "tools"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]}),
            "tools",
        ),
        (json!({"tool_choice": "auto"}), "tool_choice"),
        (
            json!({"tools": [tool("a")], "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"tools": [tool("a")], "tool_choice": {"type": "function", "function": {"name": "z"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": [tool("a")], "parallel_tool_calls": "no"}),
            "parallel_tool_calls",
        ),
    ] {
        let e = request(body.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
    }
    // A template that does not read `tools` cannot take them.
    let plain = ChatTemplate::new("{{ messages[0].content }}", "", "").unwrap();
    let body = json!({"tools": [tool("a")]});
    let e = ToolRequest::from_request(body.as_object().unwrap(), Some(&plain)).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tools"));
}

#[test]
fn required_and_named_choices_give_their_schemas() {
    let base = |choice: ToolChoice, parallel: bool| ToolRequest {
        tools: vec![tool("a"), tool("b")],
        choice,
        parallel,
        format: ToolFormat::Hermes,
    };
    assert_eq!(base(ToolChoice::Auto, true).constraint(), None);
    let named = base(ToolChoice::Function("b".into()), true)
        .constraint()
        .unwrap();
    assert_eq!(named.schema, tool("b")["function"]["parameters"]);
    let calls = named
        .calls(r#"{"city": "Oslo"}"#, ToolFormat::Hermes)
        .unwrap();
    assert_eq!(calls[0].name, "b");
    assert_eq!(calls[0].arguments, r#"{"city":"Oslo"}"#);
    let required = base(ToolChoice::Required, false).constraint().unwrap();
    let s = &required.schema;
    assert_eq!(
        (
            s["type"].clone(),
            s["minItems"].clone(),
            s["maxItems"].clone()
        ),
        (json!("array"), json!(1), json!(1))
    );
    let any = s["items"]["anyOf"].as_array().unwrap();
    let names: Vec<&Value> = any
        .iter()
        .map(|o| &o["properties"]["name"]["enum"][0])
        .collect();
    assert_eq!(names, [&json!("a"), &json!("b")]);
    assert_eq!(
        any[1]["properties"]["arguments"],
        tool("b")["function"]["parameters"]
    );
    let text = r#"[{"name": "a", "arguments": {"city": "Paris"}}]"#;
    let calls = required.calls(text, ToolFormat::Hermes).unwrap();
    assert_eq!(
        named_pairs(&calls),
        vec![("a".to_string(), json!({"city": "Paris"}))]
    );
    assert!(required.calls("[]", ToolFormat::Hermes).is_err());
    assert!(named.calls("[1]", ToolFormat::Hermes).is_err());
}

/// `required` and a named function are accepted; their streams hold the whole answer and
/// read it as calls at the end (as content where it is none).
#[test]
fn forced_choices_are_read_whole_as_calls() {
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "b"}}),
    ] {
        let body = json!({"tools": [tool("a"), tool("b")], "tool_choice": choice});
        let req = request(body).unwrap().unwrap();
        assert!(req.constraint().is_some(), "{choice}");
    }
    let named = json!({"tools": [tool("a"), tool("b")],
        "tool_choice": {"type": "function", "function": {"name": "b"}}});
    let req = request(named).unwrap().unwrap();
    let mut stream = req.stream().live();
    assert_eq!(stream.push(r#"{"city": "#), Pushed::default());
    assert_eq!(stream.push(r#""Rome"}"#), Pushed::default());
    let end = stream.finish().unwrap();
    assert_eq!(end.content, "");
    assert_eq!(
        named_pairs(&end.calls),
        vec![("b".into(), json!({"city": "Rome"}))]
    );
    // Sent whole at the end: the header, then the arguments.
    let args: Vec<&str> = end.deltas.iter().map(|d| d.arguments.as_str()).collect();
    assert_eq!(args, ["", r#"{"city":"Rome"}"#]);
    // Cut short: no call, the text is content.
    let mut cut = req.stream().live();
    cut.push(r#"{"city": "Ro"#);
    let end = cut.finish().unwrap();
    assert_eq!(
        (end.content.as_str(), end.calls.len()),
        (r#"{"city": "Ro"#, 0)
    );
    assert_eq!(cut.content(), r#"{"city": "Ro"#);
}

fn named_pairs(calls: &[ToolCall]) -> Vec<(String, Value)> {
    named(calls)
}

#[test]
fn tool_messages_reach_the_template() {
    let body = json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]});
    let api::Prompt::Chat(messages) = api::chat_messages(body.as_object().unwrap()).unwrap() else {
        panic!("not a chat prompt");
    };
    assert_eq!(
        messages[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"],
        json!({"city": "Paris"})
    );
    assert_eq!(messages[2].tool_call_id.as_deref(), Some("call_1"));
    let template = ChatTemplate::new(TOOLS_TEMPLATE, "", "").unwrap();
    let t = [tool("get_weather")];
    let text = template
        .render_with_tools(&messages, Some(&t), false)
        .unwrap();
    assert_eq!(
        text,
        "<tools>{\"function\": {\"name\": \"get_weather\", \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"], \"type\": \"object\"}}, \"type\": \"function\"}</tools>\
<user>Weather in Paris?<assistant><tool_call>{\"arguments\": {\"city\": \"Paris\"}, \"name\": \"get_weather\"}</tool_call><tool>18 C"
    );
    // The call the template wrote reads back as the call that was made.
    let block = &text[text.find("<tool_call>").unwrap()..text.find("<tool>").unwrap()];
    assert_eq!(
        named(&parse(ToolFormat::Hermes, block).calls),
        vec![weather("Paris")]
    );
    for bad in [
        json!({"role": "user", "content": "x", "tool_calls": []}),
        json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}),
        json!({"role": "tool", "content": "x", "tool_call_id": 5}),
    ] {
        let body = json!({"messages": [bad]});
        let e = api::chat_messages(body.as_object().unwrap()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"), "{bad}");
    }
}

#[test]
fn formats_follow_the_template() {
    assert_eq!(
        ToolFormat::detect("{{ '<tool_call>' }}"),
        ToolFormat::Hermes
    );
    assert_eq!(
        ToolFormat::detect("{{ '<|python_tag|>' }}"),
        ToolFormat::Llama3
    );
    assert_eq!(
        ToolFormat::detect("{{ '[TOOL_CALLS]' }}"),
        ToolFormat::Mistral
    );
    assert_eq!(ToolFormat::detect("{{ messages }}"), ToolFormat::Hermes);
}
