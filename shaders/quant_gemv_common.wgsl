// The part shared by the block-wise decode GEMVs on packed weights (matmul_quant_gemv.wgsl,
// workgroup-memory reduction; matmul_quant_subgroup.wgsl, subgroup reduction): bindings, and
// each invocation's partial dot products. y[m][n] = x[m][k] . dequant(w)[n][k] (+ bias[n]) for
// m <= 8; w as in matmul_quant.wgsl (blocks back to back, read as u32 words), x read as vec4.
//
// Layout: a workgroup of QV_WG invocations is QV_WG / QV_TPR row groups; each row group owns
// QV_NR neighbouring weight rows, and its QV_TPR invocations stride along k by 32-value units
// (a whole 32-value block, or one sub-block of a 256-value one), neighbours on neighbouring
// units, so a row group's loads sweep its rows' bytes front to back. An invocation reads
// each unit of each of its rows with whole-word loads (chunk_quad), unpacks the unit's scales
// once, and applies the 32 dequantized values to every row of x: the x values it loads serve
// all QV_NR weight rows. QV_TPR = 1 (no reduction) is the layout of a CPU driver, where an
// invocation is a SIMD lane and uniform loads of x are scalar; QV_TPR = 32-64 the layout of a
// GPU, a warp or wave per row group.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

// Invocations per workgroup.
override QV_WG: u32 = 64u;
// Invocations per row group: a power of two dividing QV_WG.
override QV_TPR: u32 = 64u;
// Weight rows per row group, 1 to 4 (the components of an accumulator).
override QV_NR: u32 = 1u;
// Most rows of x (GEMV_MAX_ROWS).
const QV_ROWS: u32 = 8u;

// The first weight row of the invocation's row group, and the invocation's lane in it.
fn qv_place(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> vec2<u32> {
    let group = (wid.y * nwg.x + wid.x) * (QV_WG / QV_TPR) + lid / QV_TPR;
    return vec2<u32>(group * QV_NR, lid % QV_TPR);
}

// 32 values of x row r from vec4 index i, dotted with a unit's two chunks (q: quants 0..32
// as 8 quads; s0, s1: the chunks' scale and offset).
fn qv_dot(i: u32, q: array<vec4<f32>, 8>, s0: vec2<f32>, s1: vec2<f32>) -> f32 {
    let x0 = x[i];
    let x1 = x[i + 1u];
    let x2 = x[i + 2u];
    let x3 = x[i + 3u];
    let x4 = x[i + 4u];
    let x5 = x[i + 5u];
    let x6 = x[i + 6u];
    let x7 = x[i + 7u];
    let d0 = dot(x0, q[0]) + dot(x1, q[1]) + dot(x2, q[2]) + dot(x3, q[3]);
    let d1 = dot(x4, q[4]) + dot(x5, q[5]) + dot(x6, q[6]) + dot(x7, q[7]);
    let one = vec4<f32>(1.0);
    let sum0 = dot(x0 + x1 + x2 + x3, one);
    let sum1 = dot(x4 + x5 + x6 + x7, one);
    return s0.x * d0 - s0.y * sum0 + s1.x * d1 - s1.y * sum1;
}

// acc[r][c]: this invocation's share of x row r . weight row n0 + c (rows past n clamped to
// the last, their sums discarded by the caller).
fn qv_partial(n0: u32, lane: u32) -> array<vec4<f32>, QV_ROWS> {
    let per_block = block_len() / 32u;
    let bytes = block_bytes();
    let row_bytes = (p.k / block_len()) * bytes;
    let units = p.k / 32u;
    let k4 = p.k / 4u;
    var acc: array<vec4<f32>, QV_ROWS>;
    for (var u = lane; u < units; u += QV_TPR) {
        let c0 = 2u * (u % per_block);
        for (var c = 0u; c < QV_NR; c++) {
            let a = min(n0 + c, p.n - 1u) * row_bytes + (u / per_block) * bytes;
            let s0 = chunk_scale(a, c0);
            let s1 = chunk_scale(a, c0 + 1u);
            var q: array<vec4<f32>, 8>;
            for (var g = 0u; g < 4u; g++) {
                q[g] = chunk_quad(a, c0, g);
                q[g + 4u] = chunk_quad(a, c0 + 1u, g);
            }
            for (var r = 0u; r < QV_ROWS; r++) {
                if (r < p.m) {
                    acc[r][c] += qv_dot(r * k4 + 8u * u, q, s0, s1);
                }
            }
        }
    }
    return acc;
}

// Writes row r's sums v (one per weight row n0 + c) where the weight row exists.
fn qv_store(n0: u32, r: u32, v: vec4<f32>) {
    for (var c = 0u; c < QV_NR; c++) {
        let n = n0 + c;
        if (n < p.n) {
            var out = v[c];
            if (p.has_bias != 0u) {
                out += bias[n];
            }
            y[r * p.n + n] = out;
        }
    }
}
