//! Number formats of weights, KV caches and activations on the wire, as bytes per element:
//! what the memory-bound part of a step and every transfer cost.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How one element (a weight, a cached key, an activation) is stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NumFormat {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float (FP8 E4M3 or E5M2).
    Fp8,
    /// 8-bit integers with a per-channel scale (weight-only INT8, e.g. FasterTransformer).
    Int8,
    /// 4-bit integers in groups of 128 with an f16 scale (AWQ / GPTQ): 0.5 + 2/128 bytes.
    Int4,
    /// ggml Q8_0: blocks of 32 int8 values and one f16 scale, 34 bytes per 32.
    Q8_0,
    /// ggml Q4_0: blocks of 32 4-bit values and one f16 scale, 18 bytes per 32.
    Q4_0,
    /// ggml Q4_K: super-blocks of 256 values in 144 bytes (4.5 bits per value).
    Q4K,
    /// Any other width, given as bytes per element.
    Bytes(f64),
}

impl NumFormat {
    /// Bytes per element.
    pub fn bytes(self) -> f64 {
        match self {
            NumFormat::F32 => 4.0,
            NumFormat::F16 | NumFormat::Bf16 => 2.0,
            NumFormat::Fp8 | NumFormat::Int8 => 1.0,
            NumFormat::Int4 => 0.5 + 2.0 / 128.0,
            NumFormat::Q8_0 => 34.0 / 32.0,
            NumFormat::Q4_0 => 18.0 / 32.0,
            NumFormat::Q4K => 144.0 / 256.0,
            NumFormat::Bytes(b) => b,
        }
    }

    /// The names [`FromStr`] accepts, for help texts and errors.
    pub const NAMES: &'static str = "f32, f16, bf16, fp8, int8, int4, q8_0, q4_0, q4_k, or a number of bytes per element (e.g. 0.6)";
}

impl fmt::Display for NumFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NumFormat::F32 => f.write_str("f32"),
            NumFormat::F16 => f.write_str("f16"),
            NumFormat::Bf16 => f.write_str("bf16"),
            NumFormat::Fp8 => f.write_str("fp8"),
            NumFormat::Int8 => f.write_str("int8"),
            NumFormat::Int4 => f.write_str("int4"),
            NumFormat::Q8_0 => f.write_str("q8_0"),
            NumFormat::Q4_0 => f.write_str("q4_0"),
            NumFormat::Q4K => f.write_str("q4_k"),
            NumFormat::Bytes(b) => write!(f, "{b}"),
        }
    }
}

/// Why a format name was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NumFormatError {
    /// Neither a format's name nor a number.
    #[error("'{given}' is not a number format: expected {}", NumFormat::NAMES)]
    Unknown {
        /// What was given.
        given: String,
    },
    /// A number of bytes per element outside what any format stores.
    #[error(
        "'{given}' bytes per element is outside {}..={}: a format stores between 1 bit and \
         8 bytes (f64) per element; or name one: {}",
        BYTES_RANGE.start(),
        BYTES_RANGE.end(),
        NumFormat::NAMES
    )]
    BytesOutOfRange {
        /// What was given.
        given: String,
    },
}

/// Bytes per element a number may give: down to about a bit, up to f64.
const BYTES_RANGE: std::ops::RangeInclusive<f64> = 0.1..=8.0;

impl FromStr for NumFormat {
    type Err = NumFormatError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let f = match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => NumFormat::F32,
            "f16" | "fp16" | "float16" => NumFormat::F16,
            "bf16" | "bfloat16" => NumFormat::Bf16,
            "fp8" | "f8" | "e4m3" => NumFormat::Fp8,
            "int8" | "i8" | "w8" => NumFormat::Int8,
            "int4" | "i4" | "w4" | "awq" | "gptq" => NumFormat::Int4,
            "q8_0" | "q8" | "q80" => NumFormat::Q8_0,
            "q4_0" | "q4" | "q40" => NumFormat::Q4_0,
            "q4_k" | "q4_k_m" | "q4k" => NumFormat::Q4K,
            other => match other.parse::<f64>() {
                Ok(b) if BYTES_RANGE.contains(&b) => NumFormat::Bytes(b),
                Ok(_) => {
                    return Err(NumFormatError::BytesOutOfRange {
                        given: s.to_owned(),
                    })
                }
                Err(_) => {
                    return Err(NumFormatError::Unknown {
                        given: s.to_owned(),
                    })
                }
            },
        };
        Ok(f)
    }
}

impl Serialize for NumFormat {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for NumFormat {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_and_names() {
        assert_eq!("q4_0".parse::<NumFormat>().unwrap().bytes(), 0.5625);
        assert_eq!("Q8_0".parse::<NumFormat>().unwrap().bytes(), 1.0625);
        assert_eq!("bf16".parse::<NumFormat>().unwrap().bytes(), 2.0);
        assert_eq!("0.6".parse::<NumFormat>().unwrap().bytes(), 0.6);
        for bad in ["q3", "0", "-1", "nan", "100"] {
            let e = bad.parse::<NumFormat>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("q4_0"), "{e}");
        }
        for f in [NumFormat::Q4K, NumFormat::Int4, NumFormat::Bytes(0.75)] {
            assert_eq!(f.to_string().parse::<NumFormat>().unwrap(), f);
        }
    }
}
