//! Errors from loading, checking and writing host profiles.

use std::fmt;
use std::path::PathBuf;

/// Where in a profile file something went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// File name as given by the caller (or `<calibration>` for generated profiles).
    pub file: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        Ok(())
    }
}

/// Everything that can go wrong with a host profile or an engine description (both are TOML
/// files whose errors name file, line and field).
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid TOML, a field has the wrong type, or a field is missing or unknown.
    #[error("{at}: field `{field}`: {message}")]
    Parse {
        /// File, line and column.
        at: Location,
        /// Dotted path of the field, e.g. `devices[0].host_link.h2d.beta_gbps`.
        field: String,
        /// What the TOML parser reported.
        message: String,
    },
    /// The file parses but a value is out of range.
    #[error("{at}: field `{field}` = {value}: {reason}")]
    Invalid {
        /// File and line of the value (line unknown for generated profiles).
        at: Location,
        /// Dotted path of the field.
        field: String,
        /// The offending value as written.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// `resolve` was given a name that is neither a file nor a shipped profile.
    #[error("no profile file or shipped profile named `{name}`; shipped profiles: {known}")]
    Unknown {
        /// The name given.
        name: String,
        /// Comma-separated list of shipped profile names.
        known: String,
    },
    /// An engine name that is neither a file nor a shipped engine.
    #[error("no engine file or shipped engine named `{name}`; shipped engines: {known}")]
    UnknownEngine {
        /// The name given.
        name: String,
        /// Comma-separated list of shipped engine names.
        known: String,
    },
    /// The profile could not be turned into TOML.
    #[error("cannot write profile `{name}` as TOML: {message}")]
    Serialize {
        /// Profile name.
        name: String,
        /// Serializer message.
        message: String,
    },
}

impl ProfileError {
    /// The location of a parse or validation error.
    pub fn location(&self) -> Option<&Location> {
        match self {
            ProfileError::Parse { at, .. } | ProfileError::Invalid { at, .. } => Some(at),
            _ => None,
        }
    }

    /// The dotted field path of a parse or validation error.
    pub fn field(&self) -> Option<&str> {
        match self {
            ProfileError::Parse { field, .. } | ProfileError::Invalid { field, .. } => Some(field),
            _ => None,
        }
    }
}
