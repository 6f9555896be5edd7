//! The kernel benchmark's options from their text (`wgpar bench kernels`' flags) and the
//! checks of how they combine, made before any device opens.

use super::bench::KernelBenchOptions;
use super::quant::variant_by_name;
use super::roofline::{self, MAX_COPY_BYTES, MIN_COPY_BYTES};
use crate::error::{Result, WgparError};
use crate::model::quant::QuantType;

/// A matmul shape `MxNxK`, each at least 1 (`--shapes`).
pub fn parse_shape(text: &str) -> Result<(usize, usize, usize)> {
    let dims: Vec<usize> = text
        .split('x')
        .map(|d| d.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| {
            WgparError::option("--shapes", format!("bad shape '{text}': expected MxNxK"))
        })?;
    match dims[..] {
        [m, n, k] if m > 0 && n > 0 && k > 0 => Ok((m, n, k)),
        _ => Err(WgparError::option(
            "--shapes",
            format!("bad shape '{text}': expected MxNxK, each at least 1"),
        )),
    }
}

/// Square matmul sizes (`--sizes`), blanks skipped, each at least 1.
pub fn parse_sizes(texts: &[String]) -> Result<Vec<usize>> {
    (texts.iter())
        .filter(|s| !s.trim().is_empty())
        .map(|s| match s.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(WgparError::option(
                "--sizes",
                format!("--sizes {s}: expected a size of at least 1"),
            )),
        })
        .collect()
}

/// Packed weight types by name (`--qtypes`), blanks skipped.
pub fn parse_qtypes(texts: &[String]) -> Result<Vec<QuantType>> {
    let known = roofline::packed_types();
    (texts.iter().map(|q| q.trim().to_ascii_lowercase()))
        .filter(|q| !q.is_empty())
        .map(|q| {
            known
                .iter()
                .copied()
                .find(|t| t.name() == q)
                .ok_or_else(|| {
                    let names: Vec<&str> = known.iter().map(|t| t.name()).collect();
                    let hint = match q.as_str() {
                        "f16" | "f32" => " (dense weights are --dtypes)",
                        _ => "",
                    };
                    WgparError::option(
                        "--qtypes",
                        format!(
                            "--qtypes {q}: not a packed type{hint}; expected one of {}",
                            names.join(", ")
                        ),
                    )
                })
        })
        .collect()
}

/// `--copy-size`: a size from 1 MiB to 8 GiB, a multiple of 16 bytes (one vec4).
pub fn parse_copy_size(text: &str) -> Result<u64> {
    let bad = |why: String| WgparError::option("--copy-size", format!("--copy-size {text}: {why}"));
    let bytes = crate::comm::units::parse_size(text).map_err(|e| bad(e.to_string()))?;
    if !(MIN_COPY_BYTES..=MAX_COPY_BYTES).contains(&bytes) || bytes % 16 != 0 {
        return Err(bad(format!(
            "expected a multiple of 16 bytes from {}M to {}G",
            MIN_COPY_BYTES >> 20,
            MAX_COPY_BYTES >> 30
        )));
    }
    Ok(bytes)
}

impl KernelBenchOptions {
    /// Every matmul shape measured: the square sizes, then the shapes.
    pub fn matmuls(&self) -> Vec<(usize, usize, usize)> {
        (self.sizes.iter().map(|&n| (n, n, n)))
            .chain(self.shapes.iter().copied())
            .collect()
    }

    /// Refuses options that do not go together: packed types or a copy size with no matmul
    /// shape, shapes that are not whole blocks of a packed type, `only` naming packed
    /// variants of other types (or none of a type), and nothing to measure at all.
    pub fn check(&self) -> Result<()> {
        let matmuls = self.matmuls();
        if !self.qtypes.is_empty() && matmuls.is_empty() {
            return Err(WgparError::option(
                "--qtypes",
                "--qtypes needs a matmul shape (--sizes or --shapes)".into(),
            ));
        }
        check_packed_shapes(&self.qtypes, &matmuls, &self.only)?;
        if self.copy_bytes.is_some() && matmuls.is_empty() {
            return Err(WgparError::option(
                "--copy-size",
                "--copy-size applies only with a matmul shape (--sizes or --shapes)".into(),
            ));
        }
        if matmuls.is_empty() && self.attention_prefill.is_empty() && !self.others {
            return Err(WgparError::option(
                "--sizes",
                "nothing to measure: --sizes and --shapes name no matmul, --attention-prefill no \
                 length, and --no-others drops the other kernels"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Every shape's inner dimension must be whole blocks of every packed type, and `only`, where
/// it names packed variants, must name one of each type and none of another type.
fn check_packed_shapes(
    qtypes: &[QuantType],
    matmuls: &[(usize, usize, usize)],
    only: &[String],
) -> Result<()> {
    for &t in qtypes {
        if let Some((m, n, k)) = matmuls.iter().find(|s| s.2 % t.block_len() != 0) {
            return Err(WgparError::option(
                "--qtypes",
                format!(
                    "shape {m}x{n}x{k}: k = {k} is not a whole number of {} blocks of {}",
                    t.name(),
                    t.block_len()
                ),
            ));
        }
    }
    let named: Vec<_> = only.iter().filter_map(|o| variant_by_name(o)).collect();
    if let Some(v) = named.iter().find(|v| !qtypes.contains(&v.qtype)) {
        return Err(WgparError::option(
            "--kernels",
            format!(
                "--kernels {}: a {} variant, and --qtypes does not name {}",
                v.name,
                v.qtype.name(),
                v.qtype.name()
            ),
        ));
    }
    if let Some(t) = qtypes
        .iter()
        .find(|t| !only.is_empty() && !named.iter().any(|v| v.qtype == **t))
    {
        return Err(WgparError::option(
            "--kernels",
            format!(
                "--kernels names no {} variant, and --qtypes names {}",
                t.name(),
                t.name()
            ),
        ));
    }
    Ok(())
}
