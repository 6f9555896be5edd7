//! Matmul on block-quantized weights (`shaders/matmul_quant.wgsl`, and the block-wise GEMVs
//! of `matmul_quant_gemv.wgsl` and `matmul_quant_subgroup.wgsl`): the packed GGUF blocks stay
//! on the device as they are stored, and the kernels dequantize them in registers. A
//! [`PackedMatrix`] is `[n][k]` like a PyTorch `Linear`, each row `k / block_len` blocks.
//!
//! Variants, one pipeline per type (the type is an override constant): the chunk-wise decode
//! GEMVs (m <= 8) with 64 or 128 invocations; the block-wise decode GEMVs (whole-word loads,
//! each 32-value unit's scales unpacked once, x read as vec4, f32 accumulation; invocations
//! per row group, workgroup size and weight rows per row group as override constants;
//! reduced in workgroup memory, or with subgroups where [`subgroups_usable`]); the first
//! prefill GEMM (`qgemm`, dequantizing per 16-value step); and the tiled prefill GEMMs
//! (`qgemm_tile`: a tile of blocks dequantized into workgroup memory once per step, then a
//! register-tiled product; block and register tile set by override constants, the 64 x 128 and
//! 128 x 128 blocks only where the device gives them 24-32 KiB of workgroup memory). The
//! autotuner chooses per adapter and shape class ([`choose_quant`], the same settings, cache
//! file and `WGPAR_KERNELS` names as the dense kernels): for decode rows among the GEMVs and
//! the GEMMs whose block is under 4 times the rows (the integer-dot GEMVs of
//! `kernels::quant_dp4` too, the one-part ones only when forced, and none for the LM head:
//! [`QuantRole`]), among the GEMMs above 8 rows (by the same rule, counting the class's power
//! of two of rows). `with_variant` names one.

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use super::ops::{grid_1d, need, once, over, to_u32, Bound, Dispatch, Params, Pass};
use super::tune::{self, Candidate, Effort};
use super::variants::subgroups_usable;
use super::{Family, Kernel, WeightType};
use crate::device::{DType, Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::model::quant::QuantType;

/// Most rows the GEMV takes (its accumulators are sized for them).
pub const GEMV_MAX_ROWS: usize = 8;
/// Weight rows per GEMV workgroup (`GV_COLS` in the shader).
const GEMV_COLS: usize = 4;
/// Output block edge of the GEMM (`GM_TILE`).
const GEMM_TILE: usize = 64;

/// One candidate pipeline of the quantized matmul.
#[derive(Debug)]
pub struct QuantVariant {
    /// Unique name, e.g. `qgemv64_q8_0`.
    pub name: &'static str,
    /// Entry point (`qgemv`, `qgemm`, or the embedding lookup's `qembed`).
    pub entry: &'static str,
    /// The packed type it reads.
    pub qtype: QuantType,
    /// Override constants (the type, the GEMV's workgroup shape).
    pub constants: &'static [(&'static str, f64)],
    /// Needs `Features::SUBGROUP` (runs only where [`subgroups_usable`]).
    pub subgroups: bool,
}

impl QuantVariant {
    /// Whether it is a decode GEMV (m <= 8).
    pub fn is_gemv(&self) -> bool {
        self.entry.starts_with("qgemv")
    }

    /// Whether it can run on `gpu`: the subgroup variants need usable subgroups, and a tiled
    /// GEMM's stages must fit the device's workgroup memory (the larger tiles take more than
    /// the 16 KiB every adapter gives; GPUs and lavapipe give 32 KiB or more).
    pub fn usable(&self, gpu: &Gpu) -> bool {
        self.unusable_because(gpu).is_none()
    }

    /// Why it cannot run on `gpu`, with the numbers (`None` where [`Self::usable`]).
    pub fn unusable_because(&self, gpu: &Gpu) -> Option<String> {
        let limit = gpu.device().limits().max_compute_workgroup_storage_size as usize;
        if self.subgroups && !subgroups_usable(gpu) {
            Some("it needs subgroups, which this device lacks".into())
        } else if self.workgroup_bytes() > limit {
            let need = self.workgroup_bytes();
            Some(format!(
                "it needs {need} bytes of workgroup memory, this device gives {limit}"
            ))
        } else {
            None
        }
    }

    /// Workgroup memory a tiled GEMM's two stages take (the other entry points stay within
    /// 16 KiB and count as 0).
    pub fn workgroup_bytes(&self) -> usize {
        let stage = |name| self.constant(name).unwrap_or(0);
        16 * (stage("QG_XS4") + stage("QG_WS4"))
    }

    /// The family whose source holds its entry point: the embedding lookup's, the block-wise
    /// GEMVs', or the matmul's.
    pub fn family(&self) -> Family {
        match self.entry {
            "qembed" => Family::EmbeddingQuant,
            "qgemv_dp4" => Family::MatmulQuantDp4,
            "qgemv_wg" => Family::MatmulQuantGemv,
            "qgemv_sg" => Family::MatmulQuantSubgroup,
            _ => Family::MatmulQuant,
        }
    }

    /// The compiled pipeline on `gpu` (compiled on first use, then cached per device).
    pub(crate) fn kernel(&'static self, gpu: &Gpu) -> Arc<Kernel> {
        gpu.kernels().get_variant(
            gpu.device(),
            self.family(),
            self.entry,
            WeightType::F32,
            self.constants,
            self.name,
        )
    }

    fn constant(&self, name: &str) -> Option<usize> {
        (self.constants.iter())
            .find(|(k, _)| *k == name)
            .map(|(_, v)| *v as usize)
    }

    fn workgroup(&self) -> usize {
        self.constant("GV_WG")
            .or_else(|| self.constant("QV_WG"))
            .unwrap_or(256)
    }

    /// Weight rows one GEMV workgroup computes.
    fn rows_per_workgroup(&self) -> usize {
        match (self.constant("QV_TPR"), self.constant("QV_NR")) {
            (Some(tpr), Some(nr)) => self.workgroup() / tpr * nr,
            _ => self.constant("GV_COLS").unwrap_or(GEMV_COLS),
        }
    }

    /// The output block `(rows, columns)` a GEMM workgroup computes.
    fn gemm_block(&self) -> (usize, usize) {
        match (self.constant("QG_WGY"), self.constant("QG_TM")) {
            (Some(wgy), Some(tm)) => (
                wgy * tm,
                self.constant("QG_WGX").unwrap_or(1) * self.constant("QG_TN").unwrap_or(1),
            ),
            _ => (GEMM_TILE, GEMM_TILE),
        }
    }
}

impl Candidate for QuantVariant {
    fn name(&self) -> &'static str {
        self.name
    }
}

/// A tiled prefill GEMM (`qgemm_tile`) on `$t` blocks: `tm x tn` outputs per invocation,
/// `wgx x wgy` invocations, a k step of `bk` values (32; the stage sizes follow: 16 KiB, or
/// 24-32 KiB for the large blocks, which [`QuantVariant::usable`] offers where the device
/// gives that much), the weights staged a 16-value chunk of 4 rows per work item
/// (`stage 0`) or a 32-value unit of one row (`stage 1`, `QG_STAGE` in the shader).
macro_rules! qtile {
    ($name:expr, $t:ident, $id:literal, $tm:literal x $tn:literal, $wgx:literal x $wgy:literal, bk $bk:literal) => {
        qtile!($name, $t, $id, $tm x $tn, $wgx x $wgy, bk $bk, stage 0)
    };
    ($name:expr, $t:ident, $id:literal, $tm:literal x $tn:literal, $wgx:literal x $wgy:literal, bk $bk:literal, stage $stage:literal) => {
        QuantVariant {
            name: $name,
            entry: "qgemm_tile",
            qtype: QuantType::$t,
            subgroups: false,
            constants: &[
                ("QTYPE", $id as f64),
                ("QG_TM", $tm as f64),
                ("QG_TN", $tn as f64),
                ("QG_WGX", $wgx as f64),
                ("QG_WGY", $wgy as f64),
                ("QG_BK", $bk as f64),
                ("QG_STAGE", $stage as f64),
                ("QG_XS4", ($bk * $wgy * $tm / 4) as f64),
                ("QG_WS4", ($bk * $wgx * $tn / 4) as f64),
            ],
        }
    };
}

/// A block-wise GEMV (`qgemv_wg`, or `qgemv_sg` with subgroups): `tpr` invocations per row
/// group, `wg` per workgroup, `nr` weight rows per row group.
macro_rules! qv {
    ($name:expr, $entry:literal, $t:ident, $id:literal, sg = $sg:expr,
     tpr = $tpr:literal, wg = $wg:literal, nr = $nr:literal) => {
        QuantVariant {
            name: $name,
            entry: $entry,
            qtype: QuantType::$t,
            subgroups: $sg,
            constants: &[
                ("QTYPE", $id as f64),
                ("QV_WG", $wg as f64),
                ("QV_TPR", $tpr as f64),
                ("QV_NR", $nr as f64),
            ],
        }
    };
}

/// A block-wise GEMV reduced in workgroup memory, named `qgvTPRwWGrNR_TYPE`.
macro_rules! qv_wg {
    ($t:ident $id:literal $suffix:literal, $tpr:literal, $wg:literal, $nr:literal) => {
        qv!(
            concat!("qgv", $tpr, "w", $wg, "r", $nr, "_", $suffix),
            "qgemv_wg",
            $t,
            $id,
            sg = false,
            tpr = $tpr,
            wg = $wg,
            nr = $nr
        )
    };
}

/// A block-wise GEMV reduced with subgroups, one row group per workgroup, named
/// `qgvsgWGrNR_TYPE`.
macro_rules! qv_sg {
    ($t:ident $id:literal $suffix:literal, $wg:literal, $nr:literal) => {
        qv!(
            concat!("qgvsg", $wg, "r", $nr, "_", $suffix),
            "qgemv_sg",
            $t,
            $id,
            sg = true,
            tpr = $wg,
            wg = $wg,
            nr = $nr
        )
    };
}

/// A Q4_K block-wise GEMV stepping a pair of sub-blocks (64 values) at a time (`QV_STEP` 64,
/// `qv_row_q4k`), reduced in workgroup memory (`qgvpTPRwWGrNR_q4_k`) or with subgroups
/// (`qgvsgpWGrNR_q4_k`).
macro_rules! qv_pair {
    ($entry:literal, $name:expr, sg = $sg:expr, tpr = $tpr:literal, wg = $wg:literal, nr = $nr:literal) => {
        QuantVariant {
            name: $name,
            entry: $entry,
            qtype: QuantType::Q4K,
            subgroups: $sg,
            constants: &[
                ("QTYPE", 12.0),
                ("QV_WG", $wg as f64),
                ("QV_TPR", $tpr as f64),
                ("QV_NR", $nr as f64),
                ("QV_STEP", 64.0),
            ],
        }
    };
    (wg $tpr:literal, $wg:literal, $nr:literal) => {
        qv_pair!(
            "qgemv_wg",
            concat!("qgvp", $tpr, "w", $wg, "r", $nr, "_q4_k"),
            sg = false,
            tpr = $tpr,
            wg = $wg,
            nr = $nr
        )
    };
    (sg $wg:literal, $nr:literal) => {
        qv_pair!(
            "qgemv_sg",
            concat!("qgvsgp", $wg, "r", $nr, "_q4_k"),
            sg = true,
            tpr = $wg,
            wg = $wg,
            nr = $nr
        )
    };
}

macro_rules! qvariants {
    ($($t:ident $id:literal $suffix:literal),*; $($extra:expr),*) => {
        /// Every quantized matmul variant, per type: the chunk-wise GEMVs with 64 and 128
        /// invocations (`qgemv64`, `qgemv128`), the GEMM (`qgemm`), and the block-wise GEMVs
        /// (`qgvTPRwWGrNR`: TPR invocations per group of NR weight rows, WG per workgroup,
        /// reduced in workgroup memory; `qgvsgWGrNR`: a workgroup of WG per NR rows, reduced
        /// with subgroups; `qgvcq1w8r2`: `qgv1w8r2` reading every type through `chunk_quad`,
        /// which the tests thereby check), and the tiled GEMMs (`qgemmBMxBNrTMxTN`: a BM x BN
        /// block per workgroup, TM x TN per invocation; `qgemmBMxBNrTMxTNu`: the same with the
        /// weights staged a 32-value unit per work item). One invocation per row group (TPR 1)
        /// is a CPU driver's layout, a warp or wave per row group a GPU's. Then the variants
        /// of one type alone ([`TYPE_VARIANTS`]): Q4_K's pair-step GEMVs (`qgvp...`,
        /// `qgvsgp...`).
        pub static QUANT_VARIANTS: &[QuantVariant] = &[$(
            QuantVariant {
                name: concat!("qgemv64_", $suffix),
                entry: "qgemv",
                qtype: QuantType::$t,
                subgroups: false,
                constants: &[("QTYPE", $id as f64), ("GV_WG", 64.0)],
            },
            QuantVariant {
                name: concat!("qgemv128_", $suffix),
                entry: "qgemv",
                qtype: QuantType::$t,
                subgroups: false,
                constants: &[("QTYPE", $id as f64), ("GV_WG", 128.0)],
            },
            QuantVariant {
                name: concat!("qgemm_", $suffix),
                entry: "qgemm",
                qtype: QuantType::$t,
                subgroups: false,
                constants: &[("QTYPE", $id as f64)],
            },
            qv_wg!($t $id $suffix, 1, 8, 1),
            qv_wg!($t $id $suffix, 1, 8, 2),
            qv_wg!($t $id $suffix, 1, 8, 4),
            qv_wg!($t $id $suffix, 1, 32, 4),
            qv_wg!($t $id $suffix, 16, 64, 2),
            qv_wg!($t $id $suffix, 32, 64, 2),
            qv_wg!($t $id $suffix, 64, 64, 1),
            QuantVariant {
                name: concat!("qgvcq1w8r2_", $suffix),
                entry: "qgemv_wg",
                qtype: QuantType::$t,
                subgroups: false,
                constants: &[
                    ("QTYPE", $id as f64),
                    ("QV_WG", 8.0),
                    ("QV_TPR", 1.0),
                    ("QV_NR", 2.0),
                    ("QV_CHUNKS", 1.0),
                ],
            },
            qv_sg!($t $id $suffix, 8, 2),
            qv_sg!($t $id $suffix, 32, 2),
            qv_sg!($t $id $suffix, 64, 1),
            qv_sg!($t $id $suffix, 128, 4),
            qtile!(concat!("qgemm64x64r16x8_", $suffix), $t, $id, 16 x 8, 8 x 4, bk 32),
            qtile!(concat!("qgemm64x64r8x8_", $suffix), $t, $id, 8 x 8, 8 x 8, bk 32),
            qtile!(concat!("qgemm64x64r4x4_", $suffix), $t, $id, 4 x 4, 16 x 16, bk 32),
            qtile!(concat!("qgemm32x64r4x8_", $suffix), $t, $id, 4 x 8, 8 x 8, bk 32),
            qtile!(concat!("qgemm64x64r16x8u_", $suffix), $t, $id, 16 x 8, 8 x 4, bk 32, stage 1),
            qtile!(concat!("qgemm64x64r8x8u_", $suffix), $t, $id, 8 x 8, 8 x 8, bk 32, stage 1),
            qtile!(concat!("qgemm64x64r4x4u_", $suffix), $t, $id, 4 x 4, 16 x 16, bk 32, stage 1),
            qtile!(concat!("qgemm32x64r4x8u_", $suffix), $t, $id, 4 x 8, 8 x 8, bk 32, stage 1),
            qtile!(concat!("qgemm16x64r16x4u_", $suffix), $t, $id, 16 x 4, 16 x 1, bk 32, stage 1),
            qtile!(concat!("qgemm64x128r8x16u_", $suffix), $t, $id, 8 x 16, 8 x 8, bk 32, stage 1),
            qtile!(concat!("qgemm128x128r16x8u_", $suffix), $t, $id, 16 x 8, 16 x 8, bk 32, stage 1),
            qtile!(concat!("qgemm64x128r16x8u_", $suffix), $t, $id, 16 x 8, 16 x 4, bk 32, stage 1),
        )* $($extra),*];
    };
}

/// Variants every packed type has in [`QUANT_VARIANTS`].
pub const VARIANTS_PER_TYPE: usize = 27;
/// Variants of one type alone at the end of [`QUANT_VARIANTS`].
pub const TYPE_VARIANTS: usize = 7;

qvariants!(
    Q8_0 8 "q8_0", Q4_0 2 "q4_0", Q4_1 3 "q4_1", Q5_0 6 "q5_0", Q5_1 7 "q5_1",
    Q2K 10 "q2_k", Q3K 11 "q3_k", Q4K 12 "q4_k", Q5K 13 "q5_k", Q6K 14 "q6_k",
    Iq4Nl 20 "iq4_nl", Iq4Xs 23 "iq4_xs";
    qv_pair!(wg 1, 8, 1),
    qv_pair!(wg 1, 8, 2),
    qv_pair!(wg 1, 8, 4),
    qv_pair!(wg 1, 32, 4),
    qv_pair!(wg 16, 64, 2),
    qv_pair!(sg 32, 2),
    qv_pair!(sg 64, 1)
);

macro_rules! qembed_variants {
    ($($t:ident $id:literal $suffix:literal),*) => {
        /// The embedding lookup from a packed token table (`embedding_quant.wgsl`), per type.
        pub static QUANT_EMBED_VARIANTS: &[QuantVariant] = &[$(
            QuantVariant {
                name: concat!("qembed_", $suffix),
                entry: "qembed",
                qtype: QuantType::$t,
                subgroups: false,
                constants: &[("QTYPE", $id as f64)],
            },
        )*];
    };
}

qembed_variants!(
    Q8_0 8 "q8_0", Q4_0 2 "q4_0", Q4_1 3 "q4_1", Q5_0 6 "q5_0", Q5_1 7 "q5_1",
    Q2K 10 "q2_k", Q3K 11 "q3_k", Q4K 12 "q4_k", Q5K 13 "q5_k", Q6K 14 "q6_k",
    Iq4Nl 20 "iq4_nl", Iq4Xs 23 "iq4_xs"
);

/// The embedding lookup's pipeline variant for a token table packed as `qtype`.
pub fn embed_variant(qtype: QuantType) -> Option<&'static QuantVariant> {
    QUANT_EMBED_VARIANTS.iter().find(|v| v.qtype == qtype)
}

/// A quantized `[rows][cols]` matrix on a device: the packed blocks, row after row, in a u32
/// buffer (the last word zero-padded).
#[derive(Debug)]
pub struct PackedMatrix {
    /// The packed bytes as u32 words.
    pub tensor: Tensor,
    /// Block type.
    pub qtype: QuantType,
    /// Rows (outputs).
    pub rows: usize,
    /// Columns (inputs), a whole number of blocks.
    pub cols: usize,
}

impl PackedMatrix {
    /// Uploads `bytes`, which must be `rows` rows of `cols` values packed as `qtype`.
    pub fn upload(
        gpu: &Gpu,
        what: &str,
        qtype: QuantType,
        bytes: &[u8],
        (rows, cols): (usize, usize),
    ) -> Result<Self> {
        let fail = |detail: String| WgparError::Shape {
            op: "quantized matmul".into(),
            detail: format!("{what}: {detail}"),
        };
        if !qtype.is_quantized() {
            return Err(fail(format!("{qtype:?} is not a block type")));
        }
        let row = qtype.row_bytes(cols).ok_or_else(|| {
            fail(format!(
                "{cols} columns are not whole {qtype:?} blocks of {}",
                qtype.block_len()
            ))
        })?;
        if Some(bytes.len()) != row.checked_mul(rows) {
            return Err(fail(format!(
                "{} bytes for {rows} rows of {row}",
                bytes.len()
            )));
        }
        let words: Vec<u32> = bytes
            .chunks(4)
            .map(|c| {
                let mut b = [0u8; 4];
                b[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(b)
            })
            .collect();
        Ok(Self {
            tensor: gpu.upload_u32(what, &words)?,
            qtype,
            rows,
            cols,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        self.tensor.bytes()
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct QuantParams {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
}

/// Operands of `y[m][n] = x[m][k] . dequant(w)[n][k] (+ bias[n])`.
#[derive(Debug, Clone, Copy)]
pub struct QuantIo<'a> {
    /// `[m][k]` f32 input.
    pub x: &'a Tensor,
    /// `[n][k]` packed weights.
    pub w: &'a PackedMatrix,
    /// `[n]` f32 bias.
    pub bias: Option<&'a Tensor>,
    /// `[m][n]` f32 output.
    pub y: &'a Tensor,
}

/// A bound quantized matmul over up to `rows` rows.
pub struct QuantMatmul {
    op: Bound,
    rows: usize,
    n: usize,
    k: usize,
    bias: bool,
    qtype: QuantType,
    variant: Option<&'static QuantVariant>,
    role: QuantRole,
}

impl AsRef<Bound> for QuantMatmul {
    fn as_ref(&self) -> &Bound {
        &self.op
    }
}

/// The variant named `name` for `qtype`.
pub fn variant_by_name(name: &str) -> Option<&'static QuantVariant> {
    (QUANT_VARIANTS.iter().find(|v| v.name == name)).or_else(|| super::quant_dp4::by_name(name))
}

/// What a quantized matmul's output feeds, which decides whether the integer-dot GEMVs may
/// run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QuantRole {
    /// A layer's projection: every variant of the type may run it (the one-part integer-dot
    /// GEMVs only when forced, [`tuned_candidates`]).
    #[default]
    Layer,
    /// The LM head: its logits feed a pick over the vocabulary, where a logit moved by the
    /// int8 rounding of the inputs flips a close pick (SmolLM2-135M's first answer token:
    /// "The" leads "L" by 0.08, int8 inputs move its Q8_0 head's logits by up to 0.26), so the
    /// integer-dot GEMVs never run it, forced or not.
    Logits,
}

/// The variant a quantized matmul of `qtype` runs for `(m, n, k)` on `gpu` as a layer's
/// projection ([`choose_quant_for`] with [`QuantRole::Layer`]).
pub fn choose_quant(
    gpu: &Gpu,
    qtype: QuantType,
    (m, n, k): (usize, usize, usize),
) -> Result<&'static QuantVariant> {
    choose_quant_for(gpu, qtype, (m, n, k), QuantRole::Layer)
}

/// The variants that may run an `m`-row matmul of `qtype` in `role` on `gpu` (a
/// `WGPAR_KERNELS` name is looked up among them): for decode rows every usable variant of the
/// type, the integer-dot GEMVs included where the adapter offers them and the role is
/// [`QuantRole::Layer`]; above [`GEMV_MAX_ROWS`] rows the GEMMs.
pub fn quant_candidates(
    gpu: &Gpu,
    qtype: QuantType,
    m: usize,
    role: QuantRole,
) -> Vec<&'static QuantVariant> {
    let prefill = m > GEMV_MAX_ROWS;
    let mut candidates: Vec<&'static QuantVariant> = (QUANT_VARIANTS.iter())
        .filter(|v| v.qtype == qtype && v.usable(gpu) && !(prefill && v.is_gemv()))
        .collect();
    if !prefill && role == QuantRole::Layer {
        candidates.extend(super::quant_dp4::candidates(gpu, qtype));
    }
    candidates
}

/// The variants the tuner times among [`quant_candidates`]: all but the GEMMs whose block
/// would be mostly idle at `m` rows' class, and the one-part integer-dot GEMVs, which run
/// only when forced; the two-part ones ([`super::quant_dp4::two_part`]) are timed like the
/// rest. One-part int8 inputs are as accurate as llama.cpp's q8_1, and that
/// is not enough for SmolLM2-135M: in an f64 forward its first answer token leads by 0.08
/// logits, and int8 inputs to its layers alone, or to its head alone, turn "The capital of
/// France is Paris." into "L'..." (llama.cpp's CPU backend, int8 inputs throughout, answers the
/// same), so a timing win must not switch them on. Two parts bound the rounding 254 times
/// tighter, and the real model's greedy tokens stay those of the f32 GEMVs.
pub fn tuned_candidates(
    gpu: &Gpu,
    qtype: QuantType,
    m: usize,
    role: QuantRole,
) -> Vec<&'static QuantVariant> {
    (quant_candidates(gpu, qtype, m, role).into_iter())
        .filter(|v| v.family() != Family::MatmulQuantDp4 || super::quant_dp4::two_part(v))
        .filter(|v| v.is_gemv() || !mostly_idle(v, m))
        .collect()
}

/// Whether a GEMM's workgroup block has at least 4 times the rows of the step's tuning class
/// (decode rows exactly, prefill rows by the power of two at or above them, as
/// [`QuantClass::of`] counts them, so every step of a class has the same candidates), so
/// that three quarters of its multiply-adds or more fall on rows that do not exist: at one
/// row the 64-row tiles are never the fastest, and timing each of them costs the tuner as
/// much as a prefill step (they stay among [`quant_candidates`], to be forced by name).
fn mostly_idle(v: &QuantVariant, m: usize) -> bool {
    v.gemm_block().0 >= 4 * class_rows(m)
}

/// The rows a tuning class counts: decode rows exactly, prefill rows by the power of two at
/// or above them.
fn class_rows(m: usize) -> usize {
    if m > GEMV_MAX_ROWS {
        m.next_power_of_two()
    } else {
        m
    }
}

/// The variant a quantized matmul of `qtype` in `role` runs for `(m, n, k)` on `gpu`: a
/// `WGPAR_KERNELS` name among [`quant_candidates`] when one is forced, else the tuned choice
/// for the class (type, rows, power-of-two widths, role) among [`tuned_candidates`], timed on
/// first use as the dense kernels are ([`tune::decide_named`]). When tuning is off, the GEMV
/// with 64 invocations or the tiled GEMM with 64 x 64 blocks.
pub fn choose_quant_for(
    gpu: &Gpu,
    qtype: QuantType,
    (m, n, k): (usize, usize, usize),
    role: QuantRole,
) -> Result<&'static QuantVariant> {
    let class = QuantClass::of(qtype, (m, n, k)).in_role(role);
    if let Some(v) = gpu.kernels().quant_choice(&class) {
        return Ok(v);
    }
    let settings = tune::settings()?;
    super::quant_dp4::refuse_forced(gpu, &settings.forced)?;
    let candidates = quant_candidates(gpu, qtype, m, role);
    let find = |name: &str| candidates.iter().copied().find(|v| v.name == name);
    let timed = tuned_candidates(gpu, qtype, m, role);
    let mut measure = || time_quant(gpu, (m, n, k), &timed, Effort::Tune);
    let fallback = default_variant(qtype, m);
    let chosen = tune::decide_named(gpu, &settings, &class.key(), &find, fallback, &mut measure)?;
    gpu.kernels().set_quant_choice(class, chosen);
    Ok(chosen)
}

/// A tuning class of the quantized matmul: the type, the rows (decode rows exactly, prefill
/// rows by the power of two at or above them), the widths' power-of-two buckets, and the role
/// (its candidates differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantClass {
    qtype: QuantType,
    rows: usize,
    n_log2: u32,
    k_log2: u32,
    role: QuantRole,
}

impl QuantClass {
    /// The class of an `m x n x k` matmul on `qtype` blocks.
    pub fn of(qtype: QuantType, (m, n, k): (usize, usize, usize)) -> Self {
        let log2 = |v: usize| usize::BITS - v.max(1).saturating_sub(1).leading_zeros();
        Self {
            qtype,
            rows: class_rows(m),
            n_log2: log2(n),
            k_log2: log2(k),
            role: QuantRole::Layer,
        }
    }

    /// The same class for a matmul in `role`.
    pub fn in_role(self, role: QuantRole) -> Self {
        Self { role, ..self }
    }

    /// A stable text key (the cache file's): `m4` for four decode rows, `m<=64` for 33 to 64
    /// prefill rows, ` logits` after the LM head's.
    pub fn key(&self) -> String {
        let bound = if self.rows > GEMV_MAX_ROWS { "<=" } else { "" };
        let role = match self.role {
            QuantRole::Layer => "",
            QuantRole::Logits => " logits",
        };
        format!(
            "qmatmul {} m{bound}{} n2^{} k2^{}{role}",
            self.qtype.name(),
            self.rows,
            self.n_log2,
            self.k_log2
        )
    }
}

/// Seconds per dispatch of each of `candidates` (variants of one type) for an `m x n x k`
/// matmul, on scratch operands (zero blocks: the time does not depend on the values), each
/// bound once and dispatched as the engines dispatch it: the tuner's measurement, and the
/// benchmarks'.
pub fn time_quant(
    gpu: &Gpu,
    (m, n, k): (usize, usize, usize),
    candidates: &[&'static QuantVariant],
    effort: Effort,
) -> Result<Vec<(&'static QuantVariant, Option<f64>)>> {
    let Some(qtype) = candidates.first().map(|v| v.qtype) else {
        return Ok(Vec::new());
    };
    if let Some(v) = candidates.iter().find(|v| v.qtype != qtype) {
        return Err(WgparError::Shape {
            op: "quantized matmul timing".into(),
            detail: format!("{} reads {:?} blocks, not {qtype:?}", v.name, v.qtype),
        });
    }
    let x = gpu.upload_f32("tune.qx", &tune::pattern(m * k, 1))?;
    let blocks = vec![0u8; n * (k / qtype.block_len()) * qtype.block_bytes()];
    let w = PackedMatrix::upload(gpu, "tune.qw", qtype, &blocks, (n, k))?;
    let y = gpu.empty("tune.qy", DType::F32, m * n)?;
    let mut out = Vec::new();
    let mut best = f64::INFINITY;
    for &v in candidates {
        let mut params = Params::new(gpu, "tune.quant", 1)?;
        let io = QuantIo {
            x: &x,
            w: &w,
            bias: None,
            y: &y,
        };
        let mut op = QuantMatmul::bind(gpu, &mut params, io, m)?.with_variant(v.name)?;
        op.configure(gpu, &mut params, m)?;
        params.flush(gpu);
        let run = |reps: usize| -> Result<f64> {
            let mut enc = gpu.encoder();
            {
                let mut pass = Pass::new(&mut enc);
                for _ in 0..reps {
                    pass.run(&op)?;
                }
            }
            let start = std::time::Instant::now();
            gpu.submit(enc);
            gpu.wait()?;
            Ok(start.elapsed().as_secs_f64() / reps as f64)
        };
        let s = tune::time_samples(&run, effort, best)?;
        best = best.min(s);
        out.push((v, Some(s)));
    }
    Ok(out)
}

fn default_variant(qtype: QuantType, m: usize) -> &'static QuantVariant {
    let entry = if m <= GEMV_MAX_ROWS {
        "qgemv"
    } else {
        "qgemm_tile"
    };
    (QUANT_VARIANTS.iter())
        .find(|v| v.qtype == qtype && v.entry == entry)
        .unwrap_or(&QUANT_VARIANTS[0])
}

impl QuantMatmul {
    /// Binds `io` for up to `rows` rows.
    pub fn bind(gpu: &Gpu, params: &mut Params, io: QuantIo<'_>, rows: usize) -> Result<Self> {
        const OP: &str = "quantized matmul";
        let (n, k) = (io.w.rows, io.w.cols);
        need(OP, "x", io.x, rows * k, Some(DType::F32))?;
        need(OP, "y", io.y, rows * n, Some(DType::F32))?;
        if let Some(b) = io.bias {
            need(OP, "bias", b, n, Some(DType::F32))?;
        }
        let bias = io.bias.unwrap_or(io.x);
        let buffers = [
            io.x.buffer(),
            io.w.tensor.buffer(),
            bias.buffer(),
            io.y.buffer(),
        ];
        Ok(Self {
            op: Bound::new(gpu, params, Family::MatmulQuant, OP, &buffers)?,
            rows,
            n,
            k,
            bias: io.bias.is_some(),
            qtype: io.w.qtype,
            variant: None,
            role: QuantRole::Layer,
        })
    }

    /// Marks the op as the LM head ([`QuantRole::Logits`]): the tuner chooses among the
    /// variants that keep the inputs in f32.
    pub fn for_logits(mut self) -> Self {
        self.role = QuantRole::Logits;
        self
    }

    /// Runs the variant named `name` instead of the default choice (tests, benchmarks).
    pub fn with_variant(mut self, name: &str) -> Result<Self> {
        let v = variant_by_name(name).filter(|v| v.qtype == self.qtype);
        self.variant = Some(v.ok_or_else(|| WgparError::Shape {
            op: "quantized matmul".into(),
            detail: format!("no variant {name} for {:?} weights", self.qtype),
        })?);
        Ok(self)
    }

    /// Configures the op for `m` rows.
    pub fn configure(&mut self, gpu: &Gpu, params: &mut Params, m: usize) -> Result<()> {
        const OP: &str = "quantized matmul";
        over(OP, "rows", m, self.rows)?;
        let v = match self.variant {
            Some(v) => v,
            None => choose_quant_for(gpu, self.qtype, (m, self.n, self.k), self.role)?,
        };
        if let Some(why) = v.unusable_because(gpu) {
            return Err(WgparError::Shape {
                op: OP.into(),
                detail: format!("{} cannot run: {why}", v.name),
            });
        }
        if v.is_gemv() && m > GEMV_MAX_ROWS {
            return Err(WgparError::Shape {
                op: OP.into(),
                detail: format!("{} takes at most {GEMV_MAX_ROWS} rows, got {m}", v.name),
            });
        }
        let values = QuantParams {
            m: to_u32(OP, "m", m)?,
            n: to_u32(OP, "n", self.n)?,
            k: to_u32(OP, "k", self.k)?,
            has_bias: self.bias as u32,
        };
        let groups = if m == 0 {
            [0, 0, 0]
        } else if v.is_gemv() {
            grid_1d(
                OP,
                self.n.div_ceil(v.rows_per_workgroup()) * v.workgroup(),
                v.workgroup() as u32,
            )?
        } else {
            let (bm, bn) = v.gemm_block();
            let (gx, gy) = (self.n.div_ceil(bn), m.div_ceil(bm));
            [to_u32(OP, "n blocks", gx)?, to_u32(OP, "m blocks", gy)?, 1]
        };
        let dispatch = Dispatch::of_kernel(v.kernel(gpu), groups, v.name);
        self.op.set(params, &values, dispatch);
        Ok(())
    }
}

/// Runs `y = x . dequant(w)^T (+ bias)` once for `m` rows (tests, benchmarks); `variant`
/// names a variant, or `None` for the default choice.
pub fn quant_matmul(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    io: QuantIo<'_>,
    m: usize,
    variant: Option<&str>,
) -> Result<()> {
    once(gpu, encoder, "quantized matmul", |params| {
        let mut op = QuantMatmul::bind(gpu, params, io, m)?;
        if let Some(name) = variant {
            op = op.with_variant(name)?;
        }
        op.configure(gpu, params, m)?;
        Ok(op)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::ALL_TYPES;

    /// Each variant, with its constants applied, validates with naga (no GPU needed).
    #[test]
    fn every_quant_variant_validates_with_its_constants() {
        let packed = ALL_TYPES.iter().filter(|t| t.is_quantized()).count();
        assert_eq!(
            QUANT_VARIANTS.len(),
            VARIANTS_PER_TYPE * packed + TYPE_VARIANTS
        );
        assert_eq!(QUANT_EMBED_VARIANTS.len(), packed);
        for v in QUANT_VARIANTS.iter().chain(QUANT_EMBED_VARIANTS) {
            let module = naga::front::wgsl::parse_str(v.family().source()).unwrap();
            crate::kernels::with_overrides(&module, v.name, v.entry, v.constants);
            let suffix = v.name.split_once('_').unwrap().1;
            assert_eq!(
                ALL_TYPES.into_iter().find(|t| t.name() == suffix),
                Some(v.qtype),
                "{}",
                v.name
            );
        }
    }
}
