//! Kernel variants: for each op with candidates, the pipelines that compute it (entry point and
//! override constants), which shapes each applies to, and the workgroup grid each needs.
//!
//! Every variant of an op binds that op's one bind-group layout (same bindings, same kinds, the
//! params uniform last), so a bind group made once serves whichever variant is chosen; variants
//! differ only by pipeline and grid. Which variant runs is chosen per adapter by [`super::tune`].

use std::sync::Arc;

use super::cache::Kernel;
use super::{Family, WeightType};
use crate::device::Gpu;

/// An op whose kernel is chosen among variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `y = x . w^T (+ bias)`.
    Matmul,
    /// Attention over the KV cache.
    Attention,
}

/// How a matmul variant maps the output onto workgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulGrid {
    /// A workgroup per `rows x cols` block of the output: `[ceil(n / cols), ceil(m / rows)]`.
    Blocks {
        /// Output rows per workgroup.
        rows: u32,
        /// Output columns per workgroup.
        cols: u32,
    },
    /// A workgroup per `cols` output columns for all rows (m <= 8), folded into two grid
    /// dimensions when the count exceeds the per-dimension limit.
    Columns {
        /// Output columns per workgroup.
        cols: u32,
    },
}

/// One candidate kernel of an op.
#[derive(Debug)]
pub struct Variant {
    /// Unique name (what `WGPAR_KERNELS` and `bench kernels` use).
    pub name: &'static str,
    /// The op it computes.
    pub op: Op,
    /// Shader family (file).
    pub family: Family,
    /// Entry point.
    pub entry: &'static str,
    /// Override constants of the pipeline.
    pub constants: &'static [(&'static str, f64)],
    /// Needs `Features::SUBGROUP`.
    pub subgroups: bool,
    /// Needs an inner dimension divisible by 4 (vec4 loads).
    pub k_multiple_of_4: bool,
    /// Most rows (m) it accepts; `u32::MAX` for any.
    pub max_rows: u32,
    /// Fewest rows (m) it is offered for: the block GEMMs, whose blocks span 64-128 rows,
    /// are prefill kernels and leave decode rows (m <= 8) to the GEMV and register-tile ones.
    pub min_rows: u32,
    /// Grid shape (matmul variants; attention variants name theirs by `entry`).
    pub grid: MatmulGrid,
    /// Largest head dimension it takes (attention variants).
    pub max_head_dim: u32,
    /// Offered to the autotuner (the naive baseline is not).
    pub candidate: bool,
    /// Today's production kernel before GPU-shaped variants existed (the A/B reference).
    pub legacy: bool,
}

const ANY: u32 = u32::MAX;

macro_rules! mm {
    ($name:expr, $family:ident, $entry:expr, $consts:expr, sg = $sg:expr, k4 = $k4:expr,
     max_rows = $mr:expr, $grid:expr, candidate = $cand:expr, legacy = $legacy:expr) => {
        Variant {
            name: $name,
            op: Op::Matmul,
            family: Family::$family,
            entry: $entry,
            constants: $consts,
            subgroups: $sg,
            k_multiple_of_4: $k4,
            max_rows: $mr,
            min_rows: 1,
            grid: $grid,
            max_head_dim: ANY,
            candidate: $cand,
            legacy: $legacy,
        }
    };
}

const fn blocks(rows: u32, cols: u32) -> MatmulGrid {
    MatmulGrid::Blocks { rows, cols }
}

/// A block GEMM of `matmul_block.wgsl`: `tm x tn` outputs per invocation, `wgx x wgy`
/// invocations, a k step of `bk`; the block is `(wgy * tm) x (wgx * tn)` and the stage sizes
/// follow from it. Prefill only (m > 8).
macro_rules! block {
    ($name:expr, tm = $tm:expr, tn = $tn:expr, wgx = $wgx:expr, wgy = $wgy:expr, bk = $bk:expr) => {
        Variant {
            name: $name,
            op: Op::Matmul,
            family: Family::MatmulBlock,
            entry: "gemm_block",
            constants: &[
                ("BW_TM", $tm as f64),
                ("BW_TN", $tn as f64),
                ("BW_WGX", $wgx as f64),
                ("BW_WGY", $wgy as f64),
                ("BW_BK", $bk as f64),
                ("BW_A4", ($bk * $wgy * $tm / 4) as f64),
                ("BW_W4", ($bk * $wgx * $tn / 4) as f64),
            ],
            subgroups: false,
            k_multiple_of_4: true,
            max_rows: ANY,
            min_rows: 9,
            grid: blocks($wgy * $tm, $wgx * $tn),
            max_head_dim: ANY,
            candidate: true,
            legacy: false,
        }
    };
}

/// Every matmul variant, in the order first-use tuning times them (it has a time budget, so
/// the likeliest winners come first; the default of each shape is the first that applies:
/// `matmul_vec4` for an inner dimension divisible by 4, `matmul` otherwise). `matmul` and
/// `matmul_vec4` are the CPU-shaped kernels wgpar had before (rows from the workgroup id, an
/// 8-invocation workgroup, a 4 x 4 register tile); the `rt_*` ones vary
/// that scheme's tile and workgroup; `gemv_*` are decode kernels (m <= 8) with a workgroup per
/// block of columns and a reduction along k; `gemm_*` are workgroup-memory tiled GEMMs, and
/// among them `gemm_r*` the block GEMMs with large register tiles (`gemm_rTMxTN_BMxBN`: a
/// TM x TN tile per invocation, a BM x BN block per workgroup), listed right after
/// `matmul_vec4`, largest blocks first.
pub static MATMUL: &[Variant] = &[
    mm!(
        "matmul_vec4",
        MatmulVec4,
        "matmul_vec4",
        &[],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(4, 32),
        candidate = true,
        legacy = true
    ),
    block!(
        "gemm_r16x8_128x128",
        tm = 16,
        tn = 8,
        wgx = 16,
        wgy = 8,
        bk = 8
    ),
    block!(
        "gemm_r8x8_128x128",
        tm = 8,
        tn = 8,
        wgx = 16,
        wgy = 16,
        bk = 8
    ),
    block!(
        "gemm_r16x8_128x64",
        tm = 16,
        tn = 8,
        wgx = 8,
        wgy = 8,
        bk = 16
    ),
    block!(
        "gemm_r8x16_64x128",
        tm = 8,
        tn = 16,
        wgx = 8,
        wgy = 8,
        bk = 16
    ),
    block!(
        "gemm_r8x8_128x64",
        tm = 8,
        tn = 8,
        wgx = 8,
        wgy = 16,
        bk = 16
    ),
    block!("gemm_r8x8_64x64", tm = 8, tn = 8, wgx = 8, wgy = 8, bk = 16),
    mm!(
        "matmul",
        Matmul,
        "matmul",
        &[],
        sg = false,
        k4 = false,
        max_rows = ANY,
        blocks(4, 32),
        candidate = true,
        legacy = true
    ),
    mm!(
        "matmul_naive",
        Matmul,
        "matmul_naive",
        &[],
        sg = false,
        k4 = false,
        max_rows = ANY,
        blocks(8, 8),
        candidate = false,
        legacy = false
    ),
    mm!(
        "rt_2x8_wg8",
        MatmulVec4,
        "matmul_vec4_rt",
        &[("RT_TM", 2.0), ("RT_TN", 8.0), ("RT_WG", 8.0)],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(2, 64),
        candidate = true,
        legacy = false
    ),
    mm!(
        "rt_8x2_wg8",
        MatmulVec4,
        "matmul_vec4_rt",
        &[("RT_TM", 8.0), ("RT_TN", 2.0), ("RT_WG", 8.0)],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(8, 16),
        candidate = true,
        legacy = false
    ),
    mm!(
        "rt_4x4_wg16",
        MatmulVec4,
        "matmul_vec4_rt",
        &[("RT_TM", 4.0), ("RT_TN", 4.0), ("RT_WG", 16.0)],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(4, 64),
        candidate = true,
        legacy = false
    ),
    mm!(
        "rt_4x2_wg32",
        MatmulVec4,
        "matmul_vec4_rt",
        &[("RT_TM", 4.0), ("RT_TN", 2.0), ("RT_WG", 32.0)],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(4, 64),
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemv_wg64",
        MatmulVec4,
        "gemv",
        &[("GV_WG", 64.0)],
        sg = false,
        k4 = true,
        max_rows = 8,
        MatmulGrid::Columns { cols: 4 },
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemv_wg128",
        MatmulVec4,
        "gemv",
        &[("GV_WG", 128.0)],
        sg = false,
        k4 = true,
        max_rows = 8,
        MatmulGrid::Columns { cols: 4 },
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemv_wg256",
        MatmulVec4,
        "gemv",
        &[("GV_WG", 256.0)],
        sg = false,
        k4 = true,
        max_rows = 8,
        MatmulGrid::Columns { cols: 4 },
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemv_sg128",
        MatmulSubgroup,
        "gemv_subgroup",
        &[("GV_WG", 128.0)],
        sg = true,
        k4 = true,
        max_rows = 8,
        MatmulGrid::Columns { cols: 4 },
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemv_sg256",
        MatmulSubgroup,
        "gemv_subgroup",
        &[("GV_WG", 256.0)],
        sg = true,
        k4 = true,
        max_rows = 8,
        MatmulGrid::Columns { cols: 4 },
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemm_32x32",
        MatmulVec4,
        "gemm_tiled",
        &[
            ("GT_TM", 4.0),
            ("GT_TN", 4.0),
            ("GT_WGX", 8.0),
            ("GT_WGY", 8.0)
        ],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(32, 32),
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemm_64x64",
        MatmulVec4,
        "gemm_tiled",
        &[
            ("GT_TM", 4.0),
            ("GT_TN", 4.0),
            ("GT_WGX", 16.0),
            ("GT_WGY", 16.0)
        ],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(64, 64),
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemm_128x64",
        MatmulVec4,
        "gemm_tiled",
        &[
            ("GT_TM", 8.0),
            ("GT_TN", 4.0),
            ("GT_WGX", 16.0),
            ("GT_WGY", 16.0)
        ],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(128, 64),
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemm_64x128",
        MatmulVec4,
        "gemm_tiled",
        &[
            ("GT_TM", 4.0),
            ("GT_TN", 8.0),
            ("GT_WGX", 16.0),
            ("GT_WGY", 16.0)
        ],
        sg = false,
        k4 = true,
        max_rows = ANY,
        blocks(64, 128),
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemm_s_64x64",
        Matmul,
        "gemm_tiled_scalar",
        &[
            ("GT_TM", 4.0),
            ("GT_TN", 4.0),
            ("GT_WGX", 16.0),
            ("GT_WGY", 16.0)
        ],
        sg = false,
        k4 = false,
        max_rows = ANY,
        blocks(64, 64),
        candidate = true,
        legacy = false
    ),
    mm!(
        "gemm_s_32x32",
        Matmul,
        "gemm_tiled_scalar",
        &[
            ("GT_TM", 4.0),
            ("GT_TN", 4.0),
            ("GT_WGX", 8.0),
            ("GT_WGY", 8.0)
        ],
        sg = false,
        k4 = false,
        max_rows = ANY,
        blocks(32, 32),
        candidate = true,
        legacy = false
    ),
];

macro_rules! attn {
    ($name:expr, $entry:expr, max_head_dim = $hd:expr, legacy = $legacy:expr) => {
        Variant {
            name: $name,
            op: Op::Attention,
            family: Family::Attention,
            entry: $entry,
            constants: &[],
            subgroups: false,
            k_multiple_of_4: false,
            max_rows: ANY,
            min_rows: 1,
            grid: MatmulGrid::Columns { cols: 1 },
            max_head_dim: $hd,
            candidate: true,
            legacy: $legacy,
        }
    };
}

/// A flash prefill variant of `attend_flash`: head dimension `4 * d4` fixed in the pipeline
/// (constant trip counts, registers instead of memory), tiles of `bk` keys.
macro_rules! flash {
    ($name:expr, d4 = $d4:expr, bk = $bk:expr) => {
        Variant {
            name: $name,
            op: Op::Attention,
            family: Family::Attention,
            entry: "attend_flash",
            constants: &[("FA_D4", $d4 as f64), ("FA_BK", $bk as f64)],
            subgroups: false,
            k_multiple_of_4: false,
            max_rows: ANY,
            min_rows: 1,
            grid: MatmulGrid::Columns { cols: 1 },
            max_head_dim: 4 * $d4,
            candidate: true,
            legacy: false,
        }
    };
}

/// A prefill variant of `attend_flash4`: four queries per invocation (the lanes of a vec4),
/// head dimension `d` fixed in the pipeline, `wg` invocations (`4 * wg` queries) per
/// workgroup, keys in tiles of `bk` staged in workgroup memory when `shared`, else read
/// straight from the cache at addresses the workgroup shares.
macro_rules! flash4 {
    ($name:expr, d = $d:expr, wg = $wg:expr, bk = $bk:expr, shared = $shared:expr) => {
        Variant {
            name: $name,
            op: Op::Attention,
            family: Family::Attention,
            entry: "attend_flash4",
            constants: &[
                ("F4_D", $d as f64),
                ("F4_WG", $wg as f64),
                ("F4_BK", $bk as f64),
                ("F4_SHARED", $shared as u32 as f64),
                ("F4_TILE", ($bk * $d) as f64),
            ],
            subgroups: false,
            k_multiple_of_4: false,
            max_rows: ANY,
            min_rows: 1,
            grid: MatmulGrid::Columns { cols: 1 },
            max_head_dim: $d,
            candidate: true,
            legacy: false,
        }
    };
}

/// Every attention variant: today's (one invocation per (token, head) streaming over the
/// keys), the tiled flash-style prefill (key/value tiles shared by 64 queries in workgroup
/// memory) and the decode kernel split over the context (a workgroup per (token, head), then
/// a reduction pass).
pub static ATTENTION: &[Variant] = &[
    // The flash variants come first: the first one timed is never dropped for a slow first
    // sample, and that sample includes the driver's compile of a pipeline whose loops are
    // unrolled (seconds on lavapipe); only the one of the layer's head dimension applies.
    // Four queries per invocation, reading the cache directly: the CPU driver's shape
    // (docs/BENCHMARKS.md, issue 36), first so that it is timed within the tuning budget.
    flash4!("flash4_d32_w16", d = 32, wg = 16, bk = 4, shared = false),
    flash4!("flash4_d64_w16", d = 64, wg = 16, bk = 4, shared = false),
    flash!("flash_d32_k16", d4 = 8, bk = 16),
    flash!("flash_d64_k16", d4 = 16, bk = 16),
    flash!("flash_d80_k16", d4 = 20, bk = 16),
    flash!("flash_d96_k16", d4 = 24, bk = 16),
    flash!("flash_d128_k12", d4 = 32, bk = 12),
    attn!("attend", "attend", max_head_dim = 256, legacy = true),
    attn!(
        "attend_tiled",
        "attend_tiled",
        max_head_dim = 128,
        legacy = false
    ),
    attn!(
        "attend_split",
        "attend_split",
        max_head_dim = 256,
        legacy = false
    ),
    flash!("flash_d32_k8", d4 = 8, bk = 8),
    flash!("flash_d64_k8", d4 = 16, bk = 8),
    flash!("flash_d128_k8", d4 = 32, bk = 8),
    // Four queries per invocation with K/V tiles in workgroup memory: the GPU's shape.
    flash4!(
        "flash4_d32_w64_t16",
        d = 32,
        wg = 64,
        bk = 16,
        shared = true
    ),
    flash4!(
        "flash4_d64_w64_t16",
        d = 64,
        wg = 64,
        bk = 16,
        shared = true
    ),
];

/// The head dimension a variant is compiled for, if fixed (the flash prefill kernels).
pub fn fixed_head_dim(v: &Variant) -> Option<usize> {
    v.constants.iter().find_map(|&(name, value)| match name {
        "FA_D4" => Some(4 * value as usize),
        "F4_D" => Some(value as usize),
        _ => None,
    })
}

/// Queries a workgroup of the tiled prefill variant `v` takes (64, or 4 per invocation of
/// `attend_flash4`).
fn queries_per_group(v: &Variant) -> usize {
    (v.constants.iter())
        .find(|(name, _)| *name == "F4_WG")
        .map_or(64, |&(_, wg)| 4 * wg as usize)
}

/// The variant called `name`, of any op.
pub fn by_name(name: &str) -> Option<&'static Variant> {
    MATMUL.iter().chain(ATTENTION).find(|v| v.name == name)
}

/// Every variant name, for messages.
pub fn names() -> Vec<&'static str> {
    MATMUL.iter().chain(ATTENTION).map(|v| v.name).collect()
}

/// Whether attention variant `v` takes `shape` (query tokens per sequence, head dim).
pub fn attention_applies(v: &Variant, seq: usize, head_dim: usize) -> bool {
    v.op == Op::Attention
        && head_dim <= v.max_head_dim as usize
        && fixed_head_dim(v).is_none_or(|d| d == head_dim)
        // The tiled kernels share key tiles between the queries of a sequence: prefill only.
        && (!matches!(v.entry, "attend_tiled" | "attend_flash" | "attend_flash4") || seq > 1)
}

/// Workgroup grid of attention variant `v` for `batch x seq` tokens and `n_heads` heads.
pub fn attention_grid(v: &Variant, batch: usize, seq: usize, n_heads: usize) -> Option<[u32; 3]> {
    let fold = |groups: usize| -> Option<[u32; 3]> {
        let groups = groups.max(1);
        let x = groups.min(MAX_GROUPS as usize);
        let y = groups.div_ceil(x);
        (y <= MAX_GROUPS as usize).then_some([x as u32, y as u32, 1])
    };
    match v.entry {
        "attend" => fold((batch * seq * n_heads).div_ceil(64)),
        "attend_split" => fold(batch * seq * n_heads),
        "attend_tiled" | "attend_flash" | "attend_flash4" => {
            let g = [seq.div_ceil(queries_per_group(v)), n_heads, batch];
            g.iter().all(|&d| d <= MAX_GROUPS as usize).then_some([
                g[0] as u32,
                g[1] as u32,
                g[2] as u32,
            ])
        }
        _ => None,
    }
}

/// The attention variant used untuned: the flash prefill where one is compiled for the head
/// dimension; otherwise today's kernel on a CPU driver, and on a GPU the tiled kernel for
/// prefill and the split one for decode over a context of 256 keys or more.
pub fn default_attention(
    gpu: &Gpu,
    seq: usize,
    context: usize,
    head_dim: usize,
) -> &'static Variant {
    // The flash prefill wins on lavapipe too (docs/BENCHMARKS.md, issue 36).
    let name = if let Some(flash) = default_flash(seq, head_dim) {
        flash
    } else if gpu.info().is_cpu() {
        "attend"
    } else if seq > 1 && head_dim <= 128 {
        "attend_tiled"
    } else if context >= 256 {
        "attend_split"
    } else {
        "attend"
    };
    by_name(name).unwrap_or(&ATTENTION[0])
}

/// The flash prefill variant compiled for `head_dim`, with the largest key tile its workgroup
/// memory holds, where one exists and `seq > 1`.
fn default_flash(seq: usize, head_dim: usize) -> Option<&'static str> {
    let name = match head_dim {
        32 => "flash_d32_k16",
        64 => "flash_d64_k16",
        80 => "flash_d80_k16",
        96 => "flash_d96_k16",
        128 => "flash_d128_k12",
        _ => return None,
    };
    (seq > 1).then_some(name)
}

/// The shape class a tuned attention choice is kept for: power-of-two buckets of new tokens,
/// of the context the step attends over ([`context_bucket`]) and of query rows, the head
/// dimension, causal or not, and the cache's element type (an f16 cache halves the bytes each
/// variant reads, which can change the winner). Keyed by the context rather than the cache's
/// capacity, a generation moves to the variant tuned for longer contexts as its context grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnClass {
    seq_log2: u32,
    ctx_log2: u32,
    rows_log2: u32,
    head_dim: u32,
    causal: bool,
    f16_cache: bool,
}

impl AttnClass {
    /// The class of `rows` (batch x heads) query rows of `seq` new tokens over a context of
    /// `context` positions (the longest row's past plus its new tokens).
    pub fn of(seq: usize, context: usize, rows: usize, head_dim: usize, causal: bool) -> Self {
        Self {
            seq_log2: log2_bucket(seq),
            ctx_log2: context_bucket(context),
            rows_log2: log2_bucket(rows),
            head_dim: head_dim as u32,
            causal,
            f16_cache: false,
        }
    }

    /// The class for a cache stored as `stored` (f32 unless changed).
    pub fn cached_as(self, stored: crate::kernels::WeightType) -> Self {
        Self {
            f16_cache: stored == crate::kernels::WeightType::F16,
            ..self
        }
    }

    /// A stable text key, e.g. `attention/causal/s2^0/ctx2^11/rows2^5/d128`, with `/kv-f16`
    /// appended for an f16 cache (f32 keys stay as earlier versions saved them).
    pub fn key(&self) -> String {
        format!(
            "attention/{}/s2^{}/ctx2^{}/rows2^{}/d{}{}",
            if self.causal {
                "causal"
            } else {
                "bidirectional"
            },
            self.seq_log2,
            self.ctx_log2,
            self.rows_log2,
            self.head_dim,
            if self.f16_cache { "/kv-f16" } else { "" }
        )
    }
}

/// A shape class of any op: what a tuned choice is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// A matmul class.
    Matmul(MatmulClass),
    /// An attention class.
    Attention(AttnClass),
}

impl Class {
    /// A stable text key.
    pub fn key(&self) -> String {
        match self {
            Class::Matmul(c) => c.key(),
            Class::Attention(c) => c.key(),
        }
    }
}

/// Largest workgroup count per dimension that every adapter accepts.
pub const MAX_GROUPS: u32 = 65_535;

impl Variant {
    /// Whether this variant computes a `m x n x k` matmul on `gpu` (shape and features).
    pub fn applies(&self, gpu: &Gpu, (m, _n, k): (usize, usize, usize)) -> bool {
        if self.k_multiple_of_4 && !k.is_multiple_of(4) {
            return false;
        }
        if m > self.max_rows as usize || m < self.min_rows as usize {
            return false;
        }
        !self.subgroups || subgroups_usable(gpu)
    }

    /// Workgroup grid for an `m x n` output, or `None` past the dispatch limits.
    pub fn grid(&self, (m, n, _k): (usize, usize, usize)) -> Option<[u32; 3]> {
        let (m, n) = (u32::try_from(m).ok()?, u32::try_from(n).ok()?);
        match self.grid {
            MatmulGrid::Blocks { rows, cols } => {
                let g = [n.div_ceil(cols), m.div_ceil(rows), 1];
                (g[0] <= MAX_GROUPS && g[1] <= MAX_GROUPS).then_some(g)
            }
            MatmulGrid::Columns { cols } => {
                let groups = n.div_ceil(cols).max(1);
                let x = groups.min(MAX_GROUPS);
                let y = groups.div_ceil(x);
                (y <= MAX_GROUPS).then_some([x, y, 1])
            }
        }
    }

    /// The compiled pipeline of this variant on `gpu` for `weights`.
    pub fn kernel(&'static self, gpu: &Gpu, weights: WeightType) -> Arc<Kernel> {
        gpu.kernels().get_variant(
            gpu.device(),
            self.family,
            self.entry,
            weights,
            self.constants,
            self.name,
        )
    }
}

/// Whether subgroup variants may run on `gpu`: the device has `SUBGROUP` and
/// `WGPAR_NO_SUBGROUPS` is not set (the switch CI uses to cover the fallback path).
pub fn subgroups_usable(gpu: &Gpu) -> bool {
    gpu.device().features().contains(wgpu::Features::SUBGROUP)
        && !crate::switches::flag(crate::switches::NO_SUBGROUPS)
}

/// The variant used when nothing is tuned (`WGPAR_TUNE=off`, or no timing possible): on a CPU
/// driver the kernels wgpar always ran there; on a GPU the GPU-shaped ones.
pub fn default_matmul(gpu: &Gpu, shape: (usize, usize, usize)) -> &'static Variant {
    let (m, _, k) = shape;
    let name = if gpu.info().is_cpu() {
        if k.is_multiple_of(4) {
            "matmul_vec4"
        } else {
            "matmul"
        }
    } else if k.is_multiple_of(4) {
        if m <= 8 {
            "gemv_wg128"
        } else {
            "gemm_64x64"
        }
    } else {
        "gemm_s_64x64"
    };
    by_name(name).unwrap_or(&MATMUL[0])
}

/// The shape class a tuned choice is kept for: exact m up to 8 (decode batches), then
/// power-of-two buckets of m, n and k; whether k is a multiple of 4; the weight type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatmulClass {
    m: u32,
    n_log2: u32,
    k_log2: u32,
    k4: bool,
    weights: WeightType,
}

fn log2_bucket(v: usize) -> u32 {
    usize::BITS - v.max(1).saturating_sub(1).leading_zeros()
}

/// Contexts up to 2^6 = 64 positions share one attention class: below that every variant
/// reads a few KiB of cache, and a step that crossed a bucket at every power of two would
/// retune (and allocate its scratch) in the first tokens of most generations.
pub const MIN_CONTEXT_LOG2: u32 = 6;

/// The context bucket of an attention class: `ceil(log2(context))`, at least
/// [`MIN_CONTEXT_LOG2`]. A generation changes bucket (and so may change variant) when its
/// context passes 64, 128, 256, ... positions.
pub fn context_bucket(context: usize) -> u32 {
    log2_bucket(context).max(MIN_CONTEXT_LOG2)
}

impl MatmulClass {
    /// The class of an `m x n x k` matmul with `weights`.
    pub fn of((m, n, k): (usize, usize, usize), weights: WeightType) -> Self {
        let m = if m <= 8 {
            m as u32
        } else {
            1000 + log2_bucket(m)
        };
        Self {
            m,
            n_log2: log2_bucket(n),
            k_log2: log2_bucket(k),
            k4: k.is_multiple_of(4),
            weights,
        }
    }

    /// A stable text key, e.g. `matmul/f16/m1/n2^14/k2^12/k4`.
    pub fn key(&self) -> String {
        let m = if self.m <= 8 {
            format!("m{}", self.m)
        } else {
            format!("m2^{}", self.m - 1000)
        };
        let w = match self.weights {
            WeightType::F32 => "f32",
            WeightType::F16 => "f16",
        };
        let k4 = if self.k4 { "/k4" } else { "" };
        format!("matmul/{w}/{m}/n2^{}/k2^{}{k4}", self.n_log2, self.k_log2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_classes_bucket() {
        let mut names = names();
        names.sort();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len());
        assert_eq!(
            MatmulClass::of((1, 14336, 4096), WeightType::F16).key(),
            "matmul/f16/m1/n2^14/k2^12/k4"
        );
        assert_eq!(
            MatmulClass::of((100, 1000, 1023), WeightType::F32),
            MatmulClass::of((128, 1024, 999), WeightType::F32)
        );
        assert_ne!(
            MatmulClass::of((100, 1000, 1023), WeightType::F32),
            MatmulClass::of((129, 1000, 1023), WeightType::F32)
        );
    }

    #[test]
    fn flash4_grids_and_head_dims() {
        let grid = |name: &str| attention_grid(by_name(name).unwrap(), 3, 300, 12);
        // 64 queries per workgroup, or 4 per invocation of 16 and of 64 invocations.
        assert_eq!(grid("flash_d32_k16"), Some([5, 12, 3]));
        assert_eq!(grid("flash4_d32_w16"), Some([5, 12, 3]));
        assert_eq!(grid("flash4_d32_w64_t16"), Some([2, 12, 3]));
        let v = by_name("flash4_d64_w16").unwrap();
        assert_eq!(fixed_head_dim(v), Some(64));
        assert!(attention_applies(v, 2, 64));
        assert!(!attention_applies(v, 1, 64), "prefill only");
        assert!(!attention_applies(v, 2, 32));
    }

    #[test]
    fn grids_cover_the_output() {
        for v in MATMUL {
            let g = v.grid((13, 200_000, 64)).unwrap_or([0; 3]);
            match v.grid {
                MatmulGrid::Blocks { rows, cols } => {
                    if g[0] > 0 {
                        assert!(g[0] * cols >= 200_000 && g[1] * rows >= 13, "{}", v.name);
                    }
                }
                MatmulGrid::Columns { cols } => {
                    assert!(g[0] * g[1] * cols >= 200_000, "{}", v.name)
                }
            }
        }
    }
}
