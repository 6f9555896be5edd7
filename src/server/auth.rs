//! The API key: where it comes from (`--api-key`, `--api-key-file` or `WGPAR_API_KEY`, one
//! of them) and how a request's `Authorization` header is checked against it (the scheme
//! `Bearer` in any case, the key compared in constant time).

use std::path::Path;

use subtle::ConstantTimeEq;

use crate::error::{Result, WgparError};

/// The environment variable that may hold the key.
pub const KEY_VAR: &str = "WGPAR_API_KEY";

/// Where the key may come from; at most one of them may be given.
#[derive(Debug, Default, Clone)]
pub struct KeySources<'a> {
    /// `--api-key KEY` (visible in `ps`: the file and the variable are not).
    pub flag: Option<&'a str>,
    /// `--api-key-file PATH`: the file's first line.
    pub file: Option<&'a Path>,
    /// The value of `WGPAR_API_KEY`, if set.
    pub env: Option<String>,
}

/// The one key the sources give, or none; refuses two sources at once and an empty key.
pub fn resolve(sources: KeySources<'_>) -> Result<Option<String>> {
    let given: Vec<&str> = [
        sources.flag.map(|_| "--api-key"),
        sources.file.map(|_| "--api-key-file"),
        sources.env.as_ref().map(|_| KEY_VAR),
    ]
    .into_iter()
    .flatten()
    .collect();
    if given.len() > 1 {
        return Err(WgparError::option(
            given[1],
            format!(
                "{} are given together: give the API key one way",
                given.join(" and ")
            ),
        ));
    }
    let (name, key) = match (sources.flag, sources.file, sources.env) {
        (Some(k), _, _) => ("--api-key", k.to_string()),
        (_, Some(path), _) => ("--api-key-file", read_key_file(path)?),
        (_, _, Some(k)) => (KEY_VAR, k),
        _ => return Ok(None),
    };
    let key = key.trim().to_string();
    if key.is_empty() || key.chars().any(|c| c.is_control() || c == ' ') {
        return Err(WgparError::option(
            name,
            format!("{name}: the API key is empty or holds spaces or control characters"),
        ));
    }
    Ok(Some(key))
}

/// The first line of `path` (a trailing newline is not part of the key).
fn read_key_file(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path).map_err(|source| WgparError::Io {
        path: format!("--api-key-file {}", path.display()),
        source,
    })?;
    Ok(text.lines().next().unwrap_or_default().to_string())
}

/// Whether an `Authorization` header value carries `key`: the scheme `Bearer` in any case
/// (RFC 9110 makes auth schemes case-insensitive), then the key, compared in constant time.
pub fn authorized(header: Option<&[u8]>, key: &str) -> bool {
    let Some(value) = header else {
        return false;
    };
    let scheme = b"bearer ";
    if value.len() < scheme.len() || !value[..scheme.len()].eq_ignore_ascii_case(scheme) {
        return false;
    }
    let given = value[scheme.len()..].trim_ascii();
    // `ct_eq` on slices of different lengths is false without comparing the bytes: only the
    // key's length can leak, never its contents.
    bool::from(given.ct_eq(key.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_in_any_case_and_only_the_exact_key() {
        let key = "s3same";
        for ok in [
            "Bearer s3same",
            "bearer s3same",
            "BEARER s3same",
            "Bearer  s3same ",
        ] {
            assert!(authorized(Some(ok.as_bytes()), key), "{ok}");
        }
        for bad in [
            "Bearer s3sam",
            "Bearer s3samee",
            "Basic s3same",
            "s3same",
            "Bearer",
            "",
        ] {
            assert!(!authorized(Some(bad.as_bytes()), key), "{bad}");
        }
        assert!(!authorized(None, key));
    }

    #[test]
    fn one_source_only_and_never_empty() {
        let dir = std::env::temp_dir().join(format!("wgpar-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "from-file\n").unwrap();
        let from_file = KeySources {
            file: Some(&file),
            ..Default::default()
        };
        assert_eq!(
            resolve(from_file.clone()).unwrap().as_deref(),
            Some("from-file")
        );
        let env = KeySources {
            env: Some("from-env".into()),
            ..Default::default()
        };
        assert_eq!(resolve(env).unwrap().as_deref(), Some("from-env"));
        let both = KeySources {
            flag: Some("x"),
            env: Some("y".into()),
            ..from_file
        };
        let e = resolve(both).unwrap_err().to_string();
        assert!(
            e.contains("--api-key and --api-key-file and WGPAR_API_KEY"),
            "{e}"
        );
        std::fs::write(&file, "\n").unwrap();
        let empty = KeySources {
            file: Some(&file),
            ..Default::default()
        };
        assert!(resolve(empty).is_err());
        assert_eq!(resolve(KeySources::default()).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
