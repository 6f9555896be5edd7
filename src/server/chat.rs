//! Chat prompts from the checkpoint's own template: `chat_template` of tokenizer_config.json
//! (or chat_template.jinja), a GGUF file's `tokenizer.chat_template`, or a file given with
//! `serve --chat-template`, rendered by minijinja with the variables Hugging Face templates
//! use (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`) and the Python string
//! methods they call (minijinja-contrib's pycompat). Tool definitions reach the template as
//! `tools` (Hugging Face's variable), and messages carry `tool_calls` and `tool_call_id`.

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;
use serde_json::Value;

use crate::error::{Result, WgparError};
use crate::model::gguf::file::{GgufFile, Value as GgufValue};

use super::tools::ToolFormat;

/// One chat message, as the template sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// Its text.
    pub content: String,
    /// An assistant's calls, as Hugging Face templates read them: `{"id", "type":
    /// "function", "function": {"name", "arguments": {...}}}` with the arguments an object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message's answer is to this call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The author's name (a `tool` message's function).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message of `role` with text `content` and nothing else.
    pub fn text(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
            ..Self::default()
        }
    }
}

/// A checkpoint's chat template with its special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// The template reads `tools`.
    reads_tools: bool,
    /// How its model writes tool calls (from the markers the template mentions).
    tool_format: ToolFormat,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

/// A special token of tokenizer_config.json: a string, or an object with `content`.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// `chat_template` as a string, or the `default` of a list of named templates.
fn template_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    }
}

/// A GGUF vocabulary's BOS and EOS texts (empty where the file names none).
fn gguf_special_tokens(file: &GgufFile) -> (String, String) {
    let tokens = match file.meta.get("tokenizer.ggml.tokens") {
        Some(GgufValue::Array(t)) => t.as_slice(),
        _ => &[],
    };
    let text = |key: &str| {
        let id = file.meta.get(key).and_then(GgufValue::as_u64);
        match id.and_then(|i| tokens.get(i as usize)) {
            Some(GgufValue::Str(s)) => s.clone(),
            _ => String::new(),
        }
    };
    (
        text("tokenizer.ggml.bos_token_id"),
        text("tokenizer.ggml.eos_token_id"),
    )
}

fn raise_exception(message: String) -> std::result::Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `json.dumps` separators (by default `", "` between items and `": "` after
/// keys), which Hugging Face's `tojson` writes and templates' tool definitions are rendered
/// with.
struct Spacing {
    item: String,
    key: String,
}

impl serde_json::ser::Formatter for Spacing {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(self.item.as_bytes())
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.begin_array_value(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.key.as_bytes())
    }
}

/// `tojson` as Hugging Face defines it for chat templates (`json.dumps` with
/// `ensure_ascii=False`, and its `indent` and `separators`), nothing HTML-escaped
/// (minijinja's own filter writes compact JSON with `<`, `>`, `&` and `'` escaped, which a
/// model never saw in training). Keys come sorted (`sort_keys` changes nothing).
fn tojson(
    value: &minijinja::Value,
    indent: Option<usize>,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, Error> {
    let fail = |e: String| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}"));
    let indent = indent.or(kwargs.get::<Option<usize>>("indent")?);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match (indent, separators) {
        (Some(_), Some(_)) => return Err(fail("indent with separators is not supported".into())),
        (Some(n), None) => {
            let pad = " ".repeat(n);
            let f = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, f))
        }
        (None, given) => {
            let (item, key) = match given.as_deref() {
                None => (", ".to_string(), ": ".to_string()),
                Some([item, key]) => (item.clone(), key.clone()),
                Some(_) => return Err(fail("separators must be two strings".into())),
            };
            let f = Spacing { item, key };
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, f))
        }
    };
    written.map_err(|e| fail(e.to_string()))?;
    let text = String::from_utf8(out).map_err(|e| fail(e.to_string()))?;
    Ok(minijinja::Value::from_safe_string(text))
}

impl ChatTemplate {
    /// The template of the checkpoint in `dir`, or `None` when it has none.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|source| WgparError::Json {
                what: config_path.display().to_string(),
                source,
            })?,
            Err(_) => Value::Null,
        };
        let file = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
        let Some(source) = file.or_else(|| template_text(config.get("chat_template"))) else {
            return Ok(None);
        };
        let bos = token_text(config.get("bos_token"));
        let eos = token_text(config.get("eos_token"));
        Self::new(&source, &bos, &eos).map(Some)
    }

    /// The template of a GGUF file (`tokenizer.chat_template`, with the BOS and EOS tokens'
    /// texts from its vocabulary), or `None` when it has none.
    pub fn from_gguf(file: &GgufFile) -> Result<Option<Self>> {
        let Some(GgufValue::Str(source)) = file.meta.get("tokenizer.chat_template") else {
            return Ok(None);
        };
        let (bos, eos) = gguf_special_tokens(file);
        let origin = file.path().display().to_string();
        Self::parse(source, &bos, &eos, &origin, "tokenizer.chat_template").map(Some)
    }

    /// The template in `path` (`serve --chat-template`), with the special tokens of the
    /// checkpoint's own template configuration (`bos`, `eos`).
    pub fn from_file(path: &Path, bos: &str, eos: &str) -> Result<Self> {
        let source = std::fs::read_to_string(path).map_err(|source| WgparError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(
            &source,
            bos,
            eos,
            &path.display().to_string(),
            "--chat-template",
        )
    }

    /// The checkpoint's BOS and EOS texts (for a template given on the command line): a
    /// GGUF file's vocabulary entries, or tokenizer_config.json's.
    pub fn special_tokens(path: &Path) -> (String, String) {
        if crate::model::gguf::is_gguf(path) {
            return match GgufFile::open(path) {
                Ok(file) => gguf_special_tokens(&file),
                Err(_) => Default::default(),
            };
        }
        let config: Value = std::fs::read_to_string(path.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        (
            token_text(config.get("bos_token")),
            token_text(config.get("eos_token")),
        )
    }

    /// A template from its source and special tokens.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self> {
        Self::parse(source, bos, eos, "tokenizer_config.json", "chat_template")
    }

    /// A template from `source`, which came from `origin`'s `key` (for the error).
    fn parse(source: &str, bos: &str, eos: &str, origin: &str, key: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        // Hugging Face renders with trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| {
                WgparError::model(
                    origin,
                    key,
                    format!("the chat template does not parse: {e}"),
                )
            })?;
        let reads_tools = env
            .get_template("chat")
            .is_ok_and(|t| t.undeclared_variables(false).contains("tools"));
        Ok(Self {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
            reads_tools,
            tool_format: ToolFormat::detect(source),
        })
    }

    /// Whether the template reads `tools` (else tool definitions could not reach the model).
    pub fn reads_tools(&self) -> bool {
        self.reads_tools
    }

    /// How the template's model writes tool calls.
    pub fn tool_format(&self) -> ToolFormat {
        self.tool_format
    }

    /// The prompt for `messages`, ending where the assistant's answer starts when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Self::render`] with tool definitions (`tools`, as the request gives them; `None`
    /// renders as Hugging Face does without tools: `tools` is none).
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        let template = self.env.get_template("chat").map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos,
                eos_token => &self.eos,
            })
            .map_err(|e| format!("the chat template failed: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tojson` writes what Python's `json.dumps(x, ensure_ascii=False, ...)` prints for the
    /// same value (the expected strings are Python's).
    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let source =
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}";
        let t = ChatTemplate::new(source, "", "").unwrap();
        let env = &t.env;
        let x = serde_json::json!({"a": [1, "x<y'é"], "b": null, "c": {}});
        let got = env
            .render_str(source, minijinja::context! { x => x })
            .unwrap();
        let want = [
            r#"{"a": [1, "x<y'é"], "b": null, "c": {}}"#,
            "{\n  \"a\": [\n    1,\n    \"x<y'é\"\n  ],\n  \"b\": null,\n  \"c\": {}\n}",
            r#"{"a":[1,"x<y'é"],"b":null,"c":{}}"#,
        ];
        assert_eq!(got, want.join("|"));
    }
}
