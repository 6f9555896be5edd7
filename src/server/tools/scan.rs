//! Where JSON values begin and end in a model's raw text, finished or not: enough structure
//! to find a call's `name` and the exact text of its arguments while they are still being
//! written. It validates nothing (serde_json does, on the finished text); a value it cannot
//! place yet is reported unfinished.

/// Bytes of the string opening `text` (at its `"`), closing quote included; `None` while
/// unterminated.
pub(super) fn string_end(text: &str) -> Option<usize> {
    let b = text.as_bytes();
    let mut i = 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// Bytes of the value opening `text` (an object or array to its matching close, a string, or
/// a scalar up to a delimiter); `None` while it may go on.
pub(super) fn value_end(text: &str) -> Option<usize> {
    let b = text.as_bytes();
    match b.first()? {
        b'"' => string_end(text),
        b'{' | b'[' => {
            let (mut depth, mut i) = (0usize, 0);
            while i < b.len() {
                match b[i] {
                    b'"' => {
                        i += string_end(&text[i..])?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        _ => b
            .iter()
            .position(|c| matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace()),
    }
}

/// One member of an object: its key and where its value starts and (once written) ends.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Member {
    pub key: String,
    pub start: usize,
    pub end: Option<usize>,
}

/// An object's members so far.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct Object {
    pub members: Vec<Member>,
    /// Bytes up to and including its closing `}`, once written.
    pub end: Option<usize>,
    /// Something no JSON object could hold: it will not parse.
    pub broken: bool,
}

impl Object {
    /// The first member named one of `keys`.
    pub fn member(&self, keys: &[&str]) -> Option<&Member> {
        self.members.iter().find(|m| keys.contains(&m.key.as_str()))
    }
}

/// The members of the object opening `text` (at its `{`) as far as it is written.
pub(super) fn object(text: &str) -> Object {
    let mut out = Object::default();
    let skip = |at: usize| text.len() - text[at..].trim_start().len();
    let mut at = skip(1);
    loop {
        let rest = &text[at..];
        if rest.is_empty() {
            return out;
        }
        if rest.starts_with('}') {
            out.end = Some(at + 1);
            return out;
        }
        let key = match rest.starts_with('"').then(|| string_end(rest)) {
            None => break,
            Some(None) => return out,
            Some(Some(k)) => match serde_json::from_str::<String>(&rest[..k]) {
                Ok(key) => {
                    at = skip(at + k);
                    key
                }
                Err(_) => break,
            },
        };
        match text[at..].chars().next() {
            None => return out,
            Some(':') => at = skip(at + 1),
            Some(_) => break,
        }
        if at == text.len() {
            return out;
        }
        let end = value_end(&text[at..]).map(|e| at + e);
        out.members.push(Member {
            key,
            start: at,
            end,
        });
        let Some(e) = end else { return out };
        at = skip(e);
        match text[at..].chars().next() {
            None | Some('}') => {}
            Some(',') => at = skip(at + 1),
            Some(_) => break,
        }
    }
    out.broken = true;
    out
}

/// The objects one after another at the start of `text`, separated by whitespace or `sep`,
/// the last perhaps unfinished; it stops at anything else (e.g. a list's `]`).
pub(super) fn objects(text: &str, sep: char) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    loop {
        rest = rest.strip_prefix(sep).unwrap_or(rest).trim_start();
        if !rest.starts_with('{') {
            return out;
        }
        match value_end(rest) {
            Some(e) => {
                out.push(&rest[..e]);
                rest = rest[e..].trim_start();
            }
            None => {
                out.push(rest);
                return out;
            }
        }
    }
}
