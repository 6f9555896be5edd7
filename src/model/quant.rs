//! Block-quantized weight formats of GGUF (ggml's layouts), with F32, F16 and BF16 beside
//! them. A row of `n` values is `n / block_len` blocks stored one after another; rows follow
//! each other. This module converts between packed bytes and f32 on the host: [`dequantize`]
//! (the host reference of every block type the kernels read), [`quantize`] for `--weights`
//! (the types [`WEIGHTS_TYPES`] lists; the others come from files alone). Layouts (per block;
//! `d`, `m`, `dmin` are f16):
//!
//! | type | values | bytes | layout |
//! |---|---|---|---|
//! | Q8_0 | 32 | 34 | `d`, 32 × i8 `q`: `x = d q` |
//! | Q4_0 | 32 | 18 | `d`, 16 bytes: low nibbles are values 0..16, high 16..32, `x = d (q - 8)` |
//! | Q4_1 | 32 | 20 | `d`, `m`, 16 bytes of nibbles as Q4_0, `x = d q + m` |
//! | Q5_0 | 32 | 22 | `d`, 4 bytes of fifth bits (value `j` in bit `j`), nibbles as Q4_0, `x = d (q - 16)` |
//! | Q5_1 | 32 | 24 | `d`, `m`, fifth bits, nibbles, `x = d q + m` |
//! | IQ4_NL | 32 | 18 | `d`, nibbles as Q4_0 indexing a fixed 16-value table: `x = d T[q]` |
//! | Q2_K | 256 | 84 | 16 bytes of 4-bit scale / 4-bit min per 16 values, 64 bytes of 2-bit `q`, `d`, `dmin` |
//! | Q3_K | 256 | 110 | 32 bytes of third bits, 64 bytes of 2-bit `q`, 12 bytes of sixteen 6-bit scales, `d` |
//! | Q4_K | 256 | 144 | `d`, `dmin`, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles |
//! | Q5_K | 256 | 176 | as Q4_K, with 32 bytes of fifth bits before the nibbles |
//! | Q6_K | 256 | 210 | 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 × i8 scales, `d` |
//! | IQ4_XS | 256 | 136 | `d`, eight 6-bit scales (2 high bits in a u16, 4 low in 4 bytes), 128 bytes of table nibbles |

use std::ops::Range;

use half::{bf16, f16};

use crate::error::{Result, WgparError};
use crate::model::config::ModelConfig;

/// A tensor element type of GGUF that wgpar reads, with ggml's type id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit, one f16 scale per 32.
    Q8_0,
    /// 4-bit, one f16 scale per 32, offset 8.
    Q4_0,
    /// 4-bit with a scale and a min per 32.
    Q4_1,
    /// 5-bit, one scale per 32, offset 16.
    Q5_0,
    /// 5-bit with a scale and a min per 32.
    Q5_1,
    /// 2-bit K-quant: 4-bit scales and mins per 16 values.
    Q2K,
    /// 3-bit K-quant: 6-bit signed scales per 16 values.
    Q3K,
    /// 4-bit K-quant: 256-value super-blocks of eight 32-value sub-blocks with 6-bit scales and
    /// mins.
    Q4K,
    /// 5-bit K-quant: Q4_K with a fifth bit per value.
    Q5K,
    /// 6-bit K-quant: 256-value super-blocks of sixteen 16-value sub-blocks with i8 scales.
    Q6K,
    /// 4-bit non-linear (a fixed table of 16 levels), one scale per 32.
    Iq4Nl,
    /// IQ4_NL's levels in 256-value super-blocks with 6-bit scales per 32.
    Iq4Xs,
}

/// Every type, for tests and help texts.
pub const ALL_TYPES: [QuantType; 15] = [
    QuantType::F32,
    QuantType::F16,
    QuantType::Bf16,
    QuantType::Q8_0,
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q2K,
    QuantType::Q3K,
    QuantType::Q4K,
    QuantType::Q5K,
    QuantType::Q6K,
    QuantType::Iq4Nl,
    QuantType::Iq4Xs,
];

/// The types `--weights` packs into (those [`quantize`] writes); the others are read from
/// files only.
pub const WEIGHTS_TYPES: [QuantType; 7] = [
    QuantType::F32,
    QuantType::F16,
    QuantType::Bf16,
    QuantType::Q8_0,
    QuantType::Q4_0,
    QuantType::Q4K,
    QuantType::Q6K,
];

/// IQ4_NL's and IQ4_XS's 16 levels (ggml's `kvalues_iq4nl`).
pub const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl QuantType {
    /// The type of ggml id `id`, `None` for one wgpar does not read.
    pub fn from_ggml(id: u32) -> Option<Self> {
        ALL_TYPES.into_iter().find(|t| t.ggml_id() == id)
    }

    /// ggml's id of the type.
    pub fn ggml_id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Iq4Nl => 20,
            Self::Iq4Xs => 23,
            Self::Bf16 => 30,
        }
    }

    /// ggml's name of a type id, for errors about types wgpar does not read.
    pub fn ggml_name(id: u32) -> String {
        const NAMES: [&str; 42] = [
            "F32",
            "F16",
            "Q4_0",
            "Q4_1",
            "Q4_2",
            "Q4_3",
            "Q5_0",
            "Q5_1",
            "Q8_0",
            "Q8_1",
            "Q2_K",
            "Q3_K",
            "Q4_K",
            "Q5_K",
            "Q6_K",
            "Q8_K",
            "IQ2_XXS",
            "IQ2_XS",
            "IQ3_XXS",
            "IQ1_S",
            "IQ4_NL",
            "IQ3_S",
            "IQ2_S",
            "IQ4_XS",
            "I8",
            "I16",
            "I32",
            "I64",
            "F64",
            "IQ1_M",
            "BF16",
            "Q4_0_4_4",
            "Q4_0_4_8",
            "Q4_0_8_8",
            "TQ1_0",
            "TQ2_0",
            "IQ4_NL_4_4",
            "IQ4_NL_4_8",
            "IQ4_NL_8_8",
            "MXFP4",
            "NVFP4",
            "Q1_0",
        ];
        NAMES
            .get(id as usize)
            .map_or_else(|| format!("type {id}"), |n| n.to_string())
    }

    /// The name `--weights` and the docs use (`q8_0`, `q4_k`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q2K => "q2_k",
            Self::Q3K => "q3_k",
            Self::Q4K => "q4_k",
            Self::Q5K => "q5_k",
            Self::Q6K => "q6_k",
            Self::Iq4Nl => "iq4_nl",
            Self::Iq4Xs => "iq4_xs",
        }
    }

    /// The type `--weights` names (one of [`WEIGHTS_TYPES`]).
    pub fn parse(name: &str) -> Option<Self> {
        WEIGHTS_TYPES.into_iter().find(|t| t.name() == name)
    }

    /// Values per block (1 for the float types).
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Iq4Nl => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::Iq4Xs => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q8_0 => 34,
            Self::Q4_0 | Self::Iq4Nl => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Iq4Xs => 136,
        }
    }

    /// Whether the type packs blocks (not a plain float).
    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Bytes of a row of `n` values, `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_len())
            .then(|| n / self.block_len() * self.block_bytes())
    }
}

/// Refuses storing `config`'s projection matrices as `t` when an inner dimension (hidden for
/// Q/K/V, up and gate; the attention width for the output projection; the MLP width for down)
/// is not a whole number of `t`'s blocks, naming the dimension.
pub fn check_packable(config: &ModelConfig, t: QuantType) -> Result<()> {
    let dims = [
        ("hidden size", config.hidden),
        ("attention width (heads x head_dim)", config.q_dim()),
        ("MLP width", config.ffn),
    ];
    for (what, n) in dims {
        if !n.is_multiple_of(t.block_len()) {
            return Err(WgparError::unsupported(format!(
                "--weights {} packs rows in blocks of {} values, but model '{}' has a {what} of \
                 {n}; pick a type with smaller blocks (q8_0 and q4_0 take multiples of 32)",
                t.name(),
                t.block_len(),
                config.name
            )));
        }
    }
    Ok(())
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K's `j`-th 6-bit (scale, min) of the 12 packed bytes `s`.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn dequant_block(t: QuantType, b: &[u8], out: &mut [f32]) {
    match t {
        QuantType::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        QuantType::F16 => out[0] = half_at(b, 0),
        QuantType::Bf16 => out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        QuantType::Q8_0 => {
            let d = half_at(b, 0);
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = d * f32::from(q as i8);
            }
        }
        QuantType::Q4_0 => dequant_legacy(b, out, (false, false)),
        QuantType::Q4_1 => dequant_legacy(b, out, (true, false)),
        QuantType::Q5_0 => dequant_legacy(b, out, (false, true)),
        QuantType::Q5_1 => dequant_legacy(b, out, (true, true)),
        QuantType::Iq4Nl => dequant_iq4nl(b, out),
        QuantType::Q2K => dequant_q2k(b, out),
        QuantType::Q3K => dequant_q3k(b, out),
        QuantType::Q4K => dequant_q4k(b, out),
        QuantType::Q5K => dequant_q5k(b, out),
        QuantType::Q6K => dequant_q6k(b, out),
        QuantType::Iq4Xs => dequant_iq4xs(b, out),
    }
}

fn dequant_q4k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    // Four groups of 64 values: 32 bytes whose low nibbles are sub-block 2g, high 2g+1.
    for g in 0..4 {
        let (s1, m1) = scale_min_k4(2 * g, scales);
        let (s2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
        for l in 0..32 {
            let q = qs[32 * g + l];
            out[64 * g + l] = d1 * f32::from(q & 0xF) - m1;
            out[64 * g + 32 + l] = d2 * f32::from(q >> 4) - m2;
        }
    }
}

fn dequant_q6k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    // Two halves of 128 values; each byte position l feeds four values 32 apart.
    for h in 0..2 {
        let (ql, qh, sc) = (&ql[64 * h..], &qh[32 * h..], &sc[8 * h..]);
        for l in 0..32 {
            let is = l / 16;
            let q = |low: u8, shift: u32| -> f32 {
                f32::from((low | (((qh[l] >> shift) & 3) << 4)) as i8 - 32)
            };
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            let o = &mut out[128 * h..];
            o[l] = s(0) * q(ql[l] & 0xF, 0);
            o[l + 32] = s(2) * q(ql[l + 32] & 0xF, 2);
            o[l + 64] = s(4) * q(ql[l] >> 4, 4);
            o[l + 96] = s(6) * q(ql[l + 32] >> 4, 6);
        }
    }
}

/// Q4_0, Q4_1, Q5_0 and Q5_1 (`with_min`: an f16 min follows the scale; `fifth`: 4 bytes of fifth
/// bits follow, value `j` in bit `j`). Without a min, values are offset by half their range.
fn dequant_legacy(b: &[u8], out: &mut [f32], (with_min, fifth): (bool, bool)) {
    let d = half_at(b, 0);
    let mut at = 2;
    let m = if with_min {
        at += 2;
        half_at(b, 2)
    } else {
        0.0
    };
    let high = if fifth {
        at += 4;
        u32::from_le_bytes([b[at - 4], b[at - 3], b[at - 2], b[at - 1]])
    } else {
        0
    };
    let offset = match (with_min, fifth) {
        (true, _) => 0.0,
        (false, true) => 16.0,
        (false, false) => 8.0,
    };
    for (j, &q) in b[at..at + 16].iter().enumerate() {
        let bit = |k: usize| (((high >> k) & 1) as u8) << 4;
        let lo = (q & 0xF) | bit(j);
        let hi = (q >> 4) | bit(j + 16);
        out[j] = d * (f32::from(lo) - offset) + m;
        out[j + 16] = d * (f32::from(hi) - offset) + m;
    }
}

fn dequant_q5k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    // As Q4_K; value l of sub-block s takes its fifth bit from bit s of qh[l].
    for g in 0..4 {
        let (s1, m1) = scale_min_k4(2 * g, scales);
        let (s2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
        for l in 0..32 {
            let q = qs[32 * g + l];
            let h1 = ((qh[l] >> (2 * g)) & 1) << 4;
            let h2 = ((qh[l] >> (2 * g + 1)) & 1) << 4;
            out[64 * g + l] = d1 * f32::from((q & 0xF) | h1) - m1;
            out[64 * g + 32 + l] = d2 * f32::from((q >> 4) | h2) - m2;
        }
    }
}

/// 16 nibbles in IQ4_NL's layout (low: values 0..16, high: 16..32), each a level of
/// [`IQ4_LEVELS`] times `d`.
fn iq4_nibbles(qs: &[u8], d: f32, out: &mut [f32]) {
    for (j, &q) in qs[..16].iter().enumerate() {
        out[j] = d * f32::from(IQ4_LEVELS[usize::from(q & 0xF)]);
        out[j + 16] = d * f32::from(IQ4_LEVELS[usize::from(q >> 4)]);
    }
}

fn dequant_iq4nl(b: &[u8], out: &mut [f32]) {
    iq4_nibbles(&b[2..18], half_at(b, 0), out);
}

fn dequant_iq4xs(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    let high = u16::from_le_bytes([b[2], b[3]]);
    // Sub-block s (32 values): 4 low scale bits in byte 4 + s/2, 2 high bits in `high`.
    for s in 0..8 {
        let low = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF;
        let scale = i32::from(low) | ((i32::from(high >> (2 * s)) & 3) << 4);
        let qs = &b[8 + 16 * s..8 + 16 * s + 16];
        iq4_nibbles(qs, d * (scale - 32) as f32, &mut out[32 * s..32 * s + 32]);
    }
}

fn dequant_q2k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    // Chunk c (16 values): scale byte c; bytes 32 (c / 8) + 16 (c % 2) .. +16 of qs, at bit
    // 2 ((c % 8) / 2).
    for c in 0..16 {
        let (sc, shift) = (scales[c], 2 * ((c % 8) / 2));
        let (dl, ml) = (d * f32::from(sc & 0xF), dmin * f32::from(sc >> 4));
        let q = &qs[32 * (c / 8) + 16 * (c % 2)..];
        for j in 0..16 {
            out[16 * c + j] = dl * f32::from((q[j] >> shift) & 3) - ml;
        }
    }
}

/// Q3_K's `c`-th 6-bit scale (biased by 32) of the 12 packed bytes `s`: low 4 bits from
/// bytes 0..8, high 2 from bytes 8..12.
fn scale_k3(c: usize, s: &[u8]) -> i32 {
    let low = (s[c % 8] >> (4 * (c / 8))) & 0xF;
    let high = (s[8 + c % 4] >> (2 * (c / 4))) & 3;
    i32::from(low | (high << 4)) - 32
}

fn dequant_q3k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = half_at(b, 108);
    // Chunk c as Q2_K's, its third bit in hmask[16 (c % 2) + j], bit 4 (c / 8) + (c % 8) / 2;
    // a clear bit subtracts 4.
    for c in 0..16 {
        let (shift, hbit) = (2 * ((c % 8) / 2), 4 * (c / 8) + (c % 8) / 2);
        let dl = d * scale_k3(c, scales) as f32;
        let q = &qs[32 * (c / 8) + 16 * (c % 2)..];
        let h = &hmask[16 * (c % 2)..];
        for j in 0..16 {
            let q3 = i32::from((q[j] >> shift) & 3) + 4 * i32::from((h[j] >> hbit) & 1) - 4;
            out[16 * c + j] = dl * q3 as f32;
        }
    }
}

/// The values of `bytes`, packed as `t`. `bytes.len()` must be a whole number of blocks.
pub fn dequantize(t: QuantType, bytes: &[u8]) -> Vec<f32> {
    let (bl, bb) = (t.block_len(), t.block_bytes());
    let blocks = bytes.len() / bb;
    let mut out = vec![0.0f32; blocks * bl];
    for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
        dequant_block(t, b, o);
    }
    out
}

fn push_half(out: &mut Vec<u8>, x: f32) {
    out.extend_from_slice(&f16::from_f32(x).to_le_bytes());
}

fn quant_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    push_half(out, d);
    out.extend(x.iter().map(|v| (v * inv).round() as i8 as u8));
}

fn quant_q4_0(x: &[f32], out: &mut Vec<u8>) {
    // ggml's choice: the value of largest magnitude maps to -8, so the scale keeps its sign.
    let max = x
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_half(out, d);
    let q = |v: f32| ((v * inv + 8.5) as i32).clamp(0, 15) as u8;
    out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
}

/// Packs Q4_K's eight 6-bit scales and mins into 12 bytes (the inverse of [`scale_min_k4`]).
fn pack_scales_k4(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    s
}

fn quant_q4k(x: &[f32], out: &mut Vec<u8>) {
    // Per 32-value sub-block: x ≈ scale q - min with q in 0..=15 and min >= 0; then the
    // scales and mins are themselves quantized to 6 bits against the block's d and dmin.
    let mut scale = [0.0f32; 8];
    let mut min = [0.0f32; 8];
    for (s, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().fold(0.0f32, |m, &v| m.min(v));
        let hi = sub.iter().fold(f32::MIN, |m, &v| m.max(v));
        min[s] = -lo;
        scale[s] = (hi - lo) / 15.0;
    }
    let max_scale = scale.iter().fold(0.0f32, |m, &v| m.max(v));
    let max_min = min.iter().fold(0.0f32, |m, &v| m.max(v));
    let d = f16::from_f32(max_scale / 63.0).to_f32();
    let dmin = f16::from_f32(max_min / 63.0).to_f32();
    let q6 = |v: f32, unit: f32| {
        if unit > 0.0 {
            (v / unit).round().clamp(0.0, 63.0) as u8
        } else {
            0
        }
    };
    let sc: [u8; 8] = std::array::from_fn(|s| q6(scale[s], d));
    let mn: [u8; 8] = std::array::from_fn(|s| q6(min[s], dmin));
    push_half(out, d);
    push_half(out, dmin);
    out.extend_from_slice(&pack_scales_k4(&sc, &mn));
    let q4 = |v: f32, s: usize| {
        let step = d * f32::from(sc[s]);
        if step > 0.0 {
            ((v + dmin * f32::from(mn[s])) / step)
                .round()
                .clamp(0.0, 15.0) as u8
        } else {
            0
        }
    };
    for g in 0..4 {
        out.extend(
            (0..32).map(|l| q4(x[64 * g + l], 2 * g) | (q4(x[64 * g + 32 + l], 2 * g + 1) << 4)),
        );
    }
}

fn quant_q6k(x: &[f32], out: &mut Vec<u8>) {
    // Sixteen 16-value sub-blocks, each with an i8 scale of a common f16 d; values in -32..=31.
    let amax: [f32; 16] = std::array::from_fn(|s| {
        x[16 * s..16 * s + 16]
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()))
    });
    let max_scale = amax.iter().fold(0.0f32, |m, &v| m.max(v)) / 32.0;
    let d = f16::from_f32(max_scale / 127.0).to_f32();
    let sc: [i8; 16] = std::array::from_fn(|s| {
        if d > 0.0 {
            (amax[s] / 32.0 / d).round().clamp(-128.0, 127.0) as i8
        } else {
            0
        }
    });
    let q = |i: usize| -> u8 {
        let step = d * f32::from(sc[i / 16]);
        let v = if step > 0.0 {
            (x[i] / step).round()
        } else {
            0.0
        };
        (v.clamp(-32.0, 31.0) as i32 + 32) as u8
    };
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for h in 0..2 {
        for l in 0..32 {
            let base = 128 * h;
            let (q1, q2) = (q(base + l), q(base + l + 32));
            let (q3, q4) = (q(base + l + 64), q(base + l + 96));
            ql[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            ql[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            qh[32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    push_half(out, d);
}

/// `x` packed as `t`. `x.len()` must be a whole number of blocks (callers check rows with
/// [`QuantType::row_bytes`]).
///
/// # Panics
/// For a type outside [`WEIGHTS_TYPES`] (read from files only: `--weights` cannot name one).
pub fn quantize(t: QuantType, x: &[f32]) -> Vec<u8> {
    let bl = t.block_len();
    let mut out = Vec::with_capacity(x.len() / bl * t.block_bytes());
    for block in x.chunks_exact(bl) {
        match t {
            QuantType::F32 => out.extend_from_slice(&block[0].to_le_bytes()),
            QuantType::F16 => push_half(&mut out, block[0]),
            QuantType::Bf16 => out.extend_from_slice(&bf16::from_f32(block[0]).to_le_bytes()),
            QuantType::Q8_0 => quant_q8_0(block, &mut out),
            QuantType::Q4_0 => quant_q4_0(block, &mut out),
            QuantType::Q4K => quant_q4k(block, &mut out),
            QuantType::Q6K => quant_q6k(block, &mut out),
            other => panic!("wgpar has no quantizer for {other:?} (a file-only type)"),
        }
    }
    out
}

/// Refuses a tensor-parallel shard whose column range (`wo`'s heads, `w_down`'s MLP columns)
/// would cut `t`'s blocks, with the numbers. `from_file`: the file stores the matrix as `t`.
pub fn check_block_split(
    t: QuantType,
    what: &str,
    cols: &Range<usize>,
    from_file: bool,
) -> Result<()> {
    let bl = cols.start % t.block_len() + cols.len() % t.block_len();
    if bl == 0 {
        return Ok(());
    }
    let fix = if from_file {
        format!(
            "the file stores it as {}: use fewer devices, or --weights q8_0 to re-pack it in \
             32-value blocks",
            t.name()
        )
    } else {
        "use fewer devices or another --weights type".to_string()
    };
    Err(WgparError::unsupported(format!(
        "{what}: this tensor-parallel shard holds input columns {}..{} ({} values), which cut \
         {} blocks of {} values; {fix}",
        cols.start,
        cols.end,
        cols.len(),
        t.name(),
        t.block_len()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn round_trips_within_each_types_step() {
        // Relative RMS error bounds well above each format's expected error on uniform data,
        // well below what a wrong layout gives (~1).
        let bounds = [
            (QuantType::F32, 0.0),
            (QuantType::F16, 1e-3),
            (QuantType::Bf16, 5e-3),
            (QuantType::Q8_0, 0.01),
            (QuantType::Q4_0, 0.12),
            (QuantType::Q4K, 0.1),
            (QuantType::Q6K, 0.03),
        ];
        let x = random(1024, 3);
        for (t, bound) in bounds {
            assert!(WEIGHTS_TYPES.contains(&t));
            let packed = quantize(t, &x);
            assert_eq!(packed.len(), t.row_bytes(x.len()).unwrap(), "{t:?}");
            let y = dequantize(t, &packed);
            assert_eq!(y.len(), x.len());
            let err: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
            let norm: f32 = x.iter().map(|a| a * a).sum();
            let rel = (err / norm).sqrt();
            assert!(rel <= bound, "{t:?}: relative RMS error {rel} > {bound}");
        }
    }

    #[test]
    fn q8_0_and_q4_0_by_hand() {
        let mut b = f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = dequantize(QuantType::Q8_0, &b);
        assert_eq!((y[0], y[16], y[31]), (-8.0, 0.0, 7.5));
        let mut b = f16::from_f32(2.0).to_le_bytes().to_vec();
        b.extend([0x9Fu8; 16]);
        let y = dequantize(QuantType::Q4_0, &b);
        // Low nibble 0xF -> (15 - 8) * 2, high nibble 0x9 -> (9 - 8) * 2.
        assert_eq!((y[0], y[15], y[16], y[31]), (14.0, 14.0, 2.0, 2.0));
    }

    #[test]
    fn k4_scales_pack_and_unpack() {
        let sc = [1, 63, 17, 40, 62, 5, 33, 48];
        let mn = [0, 12, 63, 7, 31, 60, 2, 45];
        let packed = pack_scales_k4(&sc, &mn);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &packed), (sc[j], mn[j]), "sub-block {j}");
        }
    }

    #[test]
    fn ggml_ids_round_trip() {
        for t in ALL_TYPES {
            assert_eq!(QuantType::from_ggml(t.ggml_id()), Some(t));
            assert_eq!(QuantType::ggml_name(t.ggml_id()).to_lowercase(), t.name());
        }
        for t in WEIGHTS_TYPES {
            assert_eq!(QuantType::parse(t.name()), Some(t));
        }
        assert_eq!(QuantType::parse("q5_0"), None);
        assert_eq!(QuantType::from_ggml(16), None);
        assert_eq!(QuantType::ggml_name(34), "TQ1_0");
        assert_eq!(QuantType::ggml_name(13), "Q5_K");
    }
}
