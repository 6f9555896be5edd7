//! Byte sizes as benchmarks spell them: `8`, `64K`, `256M`, `1G` (binary multiples, as in
//! nccl-tests), with an optional `B`/`iB` suffix.

use super::error::CommError;

/// Parses a byte size: digits, then optionally `K`, `M` or `G` (x1024, x1024^2, x1024^3), then
/// optionally `B` or `iB`. Case does not matter; spaces around are ignored.
pub fn parse_size(text: &str) -> Result<u64, CommError> {
    let t = text.trim();
    let bad = || {
        CommError::Config(format!(
            "'{text}' is not a size: expected a number with an optional K, M or G suffix \
             (e.g. 8, 64K, 256M)"
        ))
    };
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(bad());
    }
    let value: u64 = t[..digits_end].parse().map_err(|_| bad())?;
    let suffix = t[digits_end..].trim().to_ascii_lowercase();
    let unit = suffix
        .strip_suffix("ib")
        .or_else(|| suffix.strip_suffix('b'))
        .unwrap_or(&suffix);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        _ => return Err(bad()),
    };
    if suffix == "ib" {
        return Err(bad());
    }
    value.checked_mul(1u64 << shift).ok_or_else(bad)
}

/// Formats a byte count the way [`parse_size`] reads it, choosing the largest exact unit.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_suffixed_sizes() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size(" 2g ").unwrap(), 2 << 30);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("16kb").unwrap(), 16384);
        assert_eq!(parse_size("12B").unwrap(), 12);
    }

    #[test]
    fn rejects_garbage_with_the_text() {
        for bad in [
            "",
            "K",
            "12X",
            "1.5M",
            "-3",
            "99999999999999999999G",
            "4iB",
            "12 K M",
        ] {
            let e = parse_size(bad).unwrap_err().to_string();
            assert!(e.contains(bad.trim()) || bad.trim().is_empty(), "{e}");
        }
        assert!(parse_size("99999999999G").is_err());
    }

    #[test]
    fn formats_back() {
        assert_eq!(format_size(64 << 20), "64M");
        assert_eq!(format_size(3000), "3000");
        assert_eq!(parse_size(&format_size(4096)).unwrap(), 4096);
    }
}
