//! Finding where a field sits in a TOML file, so errors can name its line.
//!
//! The typed profile structs hold plain numbers; positions come from a second, shape-free parse
//! of the same text with `toml_edit`, which records the byte span of every value.

use std::fmt;
use std::ops::Range;

/// One step of a path into a TOML document: a table key or an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg {
    /// A key of a table.
    Key(String),
    /// An index into an array (of tables).
    Index(usize),
}

/// A dotted path such as `devices[0].host_link.h2d.beta_gbps`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldPath(pub Vec<Seg>);

impl FieldPath {
    /// The empty path (the document root).
    pub fn root() -> Self {
        FieldPath(Vec::new())
    }

    /// This path extended by a key.
    pub fn key(&self, k: &str) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Key(k.to_owned()));
        FieldPath(v)
    }

    /// This path extended by an index.
    pub fn index(&self, i: usize) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Index(i));
        FieldPath(v)
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(top level)");
        }
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) if i == 0 => f.write_str(k)?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// Every value of a parsed document with its path and byte span.
///
/// Built with `toml_edit`, which keeps spans for all items (implicit tables, created by a
/// dotted header such as `[a.b.c]`, have none and are simply absent).
#[derive(Debug)]
pub struct Document {
    items: Vec<Located>,
}

/// One value of the document and where it is.
#[derive(Debug)]
struct Located {
    path: FieldPath,
    /// Span of the value (absent for implicit tables).
    value: Option<Range<usize>>,
    /// Span of its key, when it has one.
    key: Option<Range<usize>>,
}

impl Document {
    /// Parses `text`; fails only on TOML syntax errors.
    pub fn parse(text: &str) -> Result<Self, toml_edit::TomlError> {
        let doc = toml_edit::ImDocument::parse(text)?;
        let mut items = Vec::new();
        walk_table(doc.as_table(), &FieldPath::root(), &mut items);
        Ok(Document { items })
    }

    /// Byte span of the value at `path`, if it exists and has one.
    pub fn span_of(&self, path: &FieldPath) -> Option<Range<usize>> {
        self.items
            .iter()
            .find(|it| &it.path == path)
            .and_then(|it| it.value.clone().or_else(|| it.key.clone()))
    }

    /// Path of the smallest value (or key) whose span contains `at`; the root if none does.
    pub fn path_at(&self, at: &Range<usize>) -> FieldPath {
        self.items
            .iter()
            .flat_map(|it| {
                [&it.value, &it.key]
                    .into_iter()
                    .flatten()
                    .map(move |s| (&it.path, s))
            })
            .filter(|(_, s)| s.start <= at.start && at.end <= s.end)
            // On equal spans (an array of tables and its table share the header) the deeper
            // path is the more precise answer.
            .min_by_key(|(p, s)| (s.end - s.start, std::cmp::Reverse(p.0.len())))
            .map(|(p, _)| p.clone())
            .unwrap_or_default()
    }
}

fn walk_table(table: &toml_edit::Table, path: &FieldPath, out: &mut Vec<Located>) {
    for (key, item) in table.iter() {
        let p = path.key(key);
        let key_span = table.key(key).and_then(|k| k.span());
        out.push(Located {
            path: p.clone(),
            value: item.span(),
            key: key_span,
        });
        match item {
            toml_edit::Item::Table(t) => walk_table(t, &p, out),
            toml_edit::Item::ArrayOfTables(a) => {
                for (i, t) in a.iter().enumerate() {
                    let pi = p.index(i);
                    out.push(Located {
                        path: pi.clone(),
                        value: t.span(),
                        key: None,
                    });
                    walk_table(t, &pi, out);
                }
            }
            toml_edit::Item::Value(v) => walk_value(v, &p, out),
            toml_edit::Item::None => {}
        }
    }
}

fn walk_value(value: &toml_edit::Value, path: &FieldPath, out: &mut Vec<Located>) {
    match value {
        toml_edit::Value::InlineTable(t) => {
            for (key, v) in t.iter() {
                let p = path.key(key);
                let key_span = t.key(key).and_then(|k| k.span());
                out.push(Located {
                    path: p.clone(),
                    value: v.span(),
                    key: key_span,
                });
                walk_value(v, &p, out);
            }
        }
        toml_edit::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                let p = path.index(i);
                out.push(Located {
                    path: p.clone(),
                    value: v.span(),
                    key: None,
                });
                walk_value(v, &p, out);
            }
        }
        _ => {}
    }
}

/// 1-based line and column of byte offset `at` in `text`.
pub fn line_col(text: &str, at: usize) -> (usize, usize) {
    let at = at.min(text.len());
    // Step back to a char boundary so slicing cannot panic on a multi-byte character.
    let at = (0..=at)
        .rev()
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(0);
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// The dotted key assigned on `line` (1-based), prefixed by the table header above it; used to
/// name the field of a syntax error, where no parsed tree exists.
pub fn key_on_line(text: &str, line: usize) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let this = lines.get(line.checked_sub(1)?)?.trim();
    let (key, _) = this.split_once('=')?;
    let key = key.trim();
    if key.is_empty() || key.starts_with('#') || key.starts_with('[') {
        return None;
    }
    let header = lines[..line - 1]
        .iter()
        .rev()
        .map(|l| l.trim())
        .find(|l| l.starts_with('['))
        .map(|h| h.trim_matches(|c| c == '[' || c == ']').trim().to_owned());
    Some(match header {
        Some(h) if !h.is_empty() => format!("{h}.{key}"),
        _ => key.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "name = \"x\"\n[host]\nmemory_gbps = 5\n\n[[devices]]\nname = \"a\"\n[devices.host_link.h2d]\nalpha_us = 1\nbeta_gbps = -2\n";

    #[test]
    fn spans_and_paths_agree() {
        let doc = Document::parse(DOC).unwrap();
        let path = FieldPath::root()
            .key("devices")
            .index(0)
            .key("host_link")
            .key("h2d")
            .key("beta_gbps");
        assert_eq!(path.to_string(), "devices[0].host_link.h2d.beta_gbps");
        let span = doc.span_of(&path).unwrap();
        assert_eq!(&DOC[span.clone()], "-2");
        assert_eq!(line_col(DOC, span.start), (9, 13));
        assert_eq!(doc.path_at(&span), path);
        assert!(doc.span_of(&FieldPath::root().key("nope")).is_none());
    }

    #[test]
    fn key_on_line_uses_header() {
        assert_eq!(
            key_on_line(DOC, 9).as_deref(),
            Some("devices.host_link.h2d.beta_gbps")
        );
        assert_eq!(key_on_line(DOC, 1).as_deref(), Some("name"));
        assert_eq!(key_on_line(DOC, 2), None);
    }
}
