//! Value rules shared by host profiles and engine descriptions, and the two-pass TOML reading
//! that locates a broken value's file, line and field.
//!
//! Ranges are deliberately wide (a 0.1 MB/s link and a 1 PB/s one both pass) but finite: a
//! figure outside them is a typo or a unit mistake (`beta_gbps = 1e-300`), and letting it
//! through prints makespans hundreds of digits long instead of an error that names the line.

use serde::de::DeserializeOwned;

use super::locate::{key_on_line, line_col, Document, FieldPath, Seg};
use super::profile_error::{Location, ProfileError};

/// A value that breaks a rule, before it is given a file location.
#[derive(Debug)]
pub(crate) struct Violation {
    pub path: FieldPath,
    pub value: String,
    pub reason: &'static str,
}

impl Violation {
    pub(crate) fn new(path: FieldPath, value: impl ToString, reason: &'static str) -> Self {
        Violation {
            path,
            value: value.to_string(),
            reason,
        }
    }
}

fn within(
    path: &FieldPath,
    v: f64,
    lo: f64,
    lo_inclusive: bool,
    hi: f64,
    reason: &'static str,
) -> Result<(), Violation> {
    let above = if lo_inclusive { v >= lo } else { v > lo };
    if v.is_finite() && above && v <= hi {
        Ok(())
    } else {
        Err(Violation::new(path.clone(), v, reason))
    }
}

/// A bandwidth in GB/s: 0.1 MB/s to 1 PB/s.
pub(crate) fn bandwidth_gbps(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        1e-4,
        true,
        1e6,
        "must be a bandwidth between 0.0001 and 1000000 GB/s (0.1 MB/s to 1 PB/s)",
    )
}

/// A latency or fixed cost in microseconds: 0 to 10 s.
pub(crate) fn latency_us(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        0.0,
        true,
        1e7,
        "must be a time between 0 and 10000000 us (10 s)",
    )
}

/// A peak rate in TFLOP/s: 1 MFLOP/s to 100 PFLOP/s.
pub(crate) fn tflops(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        1e-6,
        true,
        1e5,
        "must be a rate between 0.000001 and 100000 TFLOP/s",
    )
}

/// A measured rate in GFLOP/s: 1 kFLOP/s to 100 PFLOP/s.
pub(crate) fn gflops(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        1e-6,
        true,
        1e8,
        "must be a rate between 0.000001 and 100000000 GFLOP/s",
    )
}

/// Device memory in bytes: at least one byte, at most 1 PB.
pub(crate) fn memory_bytes(path: &FieldPath, v: u64) -> Result<(), Violation> {
    if (1..=1_000_000_000_000_000).contains(&v) {
        Ok(())
    } else {
        Err(Violation::new(
            path.clone(),
            v,
            "must be between 1 byte and 1000000000000000 bytes (1 PB)",
        ))
    }
}

/// A fraction of a peak: greater than 0, at most 1.
pub(crate) fn fraction(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        0.0,
        false,
        1.0,
        "must be a fraction of the peak: greater than 0, at most 1",
    )
}

/// A collective's bus bandwidth over the link's figure: greater than 0, at most 2 (in-switch
/// reductions such as NVLink SHARP exceed the per-link figure).
pub(crate) fn efficiency(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        0.0,
        false,
        2.0,
        "must be greater than 0 and at most 2 (bus bandwidth over the link's bandwidth)",
    )
}

/// A slowdown of a shared processor: 1 to 1000.
pub(crate) fn slowdown(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        1.0,
        true,
        1e3,
        "must be a finite number from 1 to 1000 (a device cannot compute faster for sharing its processor)",
    )
}

/// A block width (hidden size) of a rate surface's curve: at least 1, at most 1e6.
pub(crate) fn block_width(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        1.0,
        true,
        1e6,
        "must be a block width (hidden size) from 1 to 1000000",
    )
}

/// Work per dispatch of a rate surface point: more than 0, at most 1e9 MFLOP (a PFLOP).
pub(crate) fn mflop_per_dispatch(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        0.0,
        false,
        1e9,
        "must be a work per dispatch greater than 0 and at most 1000000000 MFLOP",
    )
}

/// An arithmetic intensity in flops per byte: greater than 0, at most 1e6.
pub(crate) fn intensity(path: &FieldPath, v: f64) -> Result<(), Violation> {
    within(
        path,
        v,
        0.0,
        false,
        1e6,
        "must be an intensity greater than 0 and at most 1000000 flops per byte",
    )
}

pub(crate) fn at_least_one(path: &FieldPath, v: u64) -> Result<(), Violation> {
    if v >= 1 {
        Ok(())
    } else {
        Err(Violation::new(path.clone(), v, "must be at least 1"))
    }
}

pub(crate) fn non_empty(path: &FieldPath, s: &str) -> Result<(), Violation> {
    if s.trim().is_empty() {
        Err(Violation::new(
            path.clone(),
            format!("{s:?}"),
            "must not be empty",
        ))
    } else {
        Ok(())
    }
}

/// The field named in serde's "missing field `x`" / "unknown field `x`" messages.
fn named_field(message: &str) -> Option<&str> {
    let rest = message
        .strip_prefix("missing field `")
        .or_else(|| message.strip_prefix("unknown field `"))?;
    rest.split('`').next()
}

/// Reads `text` (from `file`, named in errors) as a `T` in three passes: TOML syntax into a tree
/// that remembers where every value is; the typed struct (wrong types, missing and unknown
/// fields); then `check`'s value rules. Every error carries file, line, column and field.
pub(crate) fn parse_checked<T: DeserializeOwned>(
    text: &str,
    file: &str,
    check: impl FnOnce(&T) -> Result<(), Violation>,
) -> Result<T, ProfileError> {
    let locate = |span: Option<std::ops::Range<usize>>| {
        let (line, column) = span.map(|s| line_col(text, s.start)).unzip();
        Location {
            file: file.to_owned(),
            line,
            column,
        }
    };
    let doc = Document::parse(text).map_err(|e| {
        let at = locate(e.span());
        let field = at
            .line
            .and_then(|l| key_on_line(text, l))
            .unwrap_or_else(|| "(unknown)".to_owned());
        ProfileError::Parse {
            at,
            field,
            message: e.message().trim().to_owned(),
        }
    })?;
    let value: T = toml::from_str(text).map_err(|e| {
        let message = e.message().trim().to_owned();
        let mut path = e
            .span()
            .map(|s| doc.path_at(&s))
            .unwrap_or_else(FieldPath::root);
        // "missing field `x`" and "unknown field `x`" point at the enclosing table. The span
        // may be the key itself, in which case the path already ends with it.
        if let Some(name) = named_field(&message) {
            if path.0.last() != Some(&Seg::Key(name.to_owned())) {
                path = path.key(name);
            }
        }
        ProfileError::Parse {
            at: locate(e.span()),
            field: path.to_string(),
            message,
        }
    })?;
    check(&value).map_err(|v| ProfileError::Invalid {
        at: locate(doc.span_of(&v.path)),
        field: v.path.to_string(),
        value: v.value,
        reason: v.reason,
    })?;
    Ok(value)
}

/// A rule broken by a value built in code (no file, so no line).
pub(crate) fn unlocated(what: &str, v: Violation) -> ProfileError {
    ProfileError::Invalid {
        at: Location {
            file: what.to_owned(),
            line: None,
            column: None,
        },
        field: v.path.to_string(),
        value: v.value,
        reason: v.reason,
    }
}
