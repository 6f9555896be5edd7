// The part shared by the block-wise decode GEMVs on packed weights (matmul_quant_gemv.wgsl,
// workgroup-memory reduction; matmul_quant_subgroup.wgsl, subgroup reduction): bindings, and
// each invocation's partial dot products. y[m][n] = x[m][k] . dequant(w)[n][k] (+ bias[n]) for
// m <= 8; w as in matmul_quant.wgsl (blocks back to back, read as u32 words), x read as vec4.
//
// Layout: a workgroup of QV_WG invocations is QV_WG / QV_TPR row groups; each row group owns
// QV_NR neighbouring weight rows, and its QV_TPR invocations stride along k by 32-value units
// (a whole 32-value block, or one sub-block of a 256-value one), neighbours on neighbouring
// units, so a row group's loads sweep its rows' bytes front to back. An invocation reads
// each unit of each of its rows with whole-word loads, each word once (unit_at), unpacks the
// unit's scales once, and dequantizes in registers; the x values it loads serve all QV_NR
// weight rows. QV_TPR = 1 (no reduction) is the layout of a CPU driver, where an
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
// 1: read every type through chunk_quad (unit_any) instead of its own word-run reader (the
// variant that checks chunk_quad against the reference for every type).
override QV_CHUNKS: u32 = 0u;
// Values per step of an invocation along k: 32 (a unit, unit_at), or for Q4_K 64 (a pair
// of sub-blocks that share their 32 nibble bytes, qv_row_q4k).
override QV_STEP: u32 = 32u;
// Most rows of x (GEMV_MAX_ROWS).
const QV_ROWS: u32 = 8u;

// The first weight row of the invocation's row group, and the invocation's lane in it.
fn qv_place(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> vec2<u32> {
    let group = (wid.y * nwg.x + wid.x) * (QV_WG / QV_TPR) + lid / QV_TPR;
    // Written so that with QV_TPR = 1 the lane is a constant: a CPU driver then sees every
    // load of x as uniform.
    return vec2<u32>(group * QV_NR, select(lid % QV_TPR, 0u, QV_TPR == 1u));
}

// 32 values of x (8 vec4) and, where the type has offsets, the sums of its two halves.
struct XUnit {
    v: array<vec4<f32>, 8>,
    sums: vec2<f32>,
}

fn qv_x(i: u32) -> XUnit {
    var xu: XUnit;
    for (var j = 0u; j < 8u; j++) {
        xu.v[j] = x[i + j];
    }
    // The branch folds away per type.
    if (has_offset()) {
        let one = vec4<f32>(1.0);
        xu.sums = vec2<f32>(
            dot(xu.v[0] + xu.v[1] + xu.v[2] + xu.v[3], one),
            dot(xu.v[4] + xu.v[5] + xu.v[6] + xu.v[7], one),
        );
    }
    return xu;
}

// A unit of x dotted with a dequantized unit of weights.
fn qv_dot(xu: XUnit, u: QUnit) -> f32 {
    let d0 = dot(xu.v[0], u.q[0]) + dot(xu.v[1], u.q[1]) + dot(xu.v[2], u.q[2]) + dot(xu.v[3], u.q[3]);
    let d1 = dot(xu.v[4], u.q[4]) + dot(xu.v[5], u.q[5]) + dot(xu.v[6], u.q[6]) + dot(xu.v[7], u.q[7]);
    var v = u.s0.x * d0 + u.s1.x * d1;
    if (has_offset()) {
        v -= u.s0.y * xu.sums.x + u.s1.y * xu.sums.y;
    }
    return v;
}

// This invocation's share of x row r . weight rows n0 .. n0 + QV_NR (component c: row
// n0 + c; rows past n clamped to the last, their sums discarded by the caller). Per unit, the
// 32 values of x are loaded once and applied to every weight row. Rows of x are the outer
// loop (one call per row): every index is then a constant or uniform, so nothing lives in an
// indexed array (a CPU driver would keep such an array in memory); a decode step has one row,
// and a few rows re-read the weights from cache.
fn qv_row(n0: u32, lane: u32, r: u32) -> vec4<f32> {
    // The branch folds away per type.
    if (QTYPE == 14u && QV_CHUNKS == 0u) {
        return qv_row_q6k(n0, lane, r);
    }
    if (QTYPE == 12u && QV_STEP == 64u) {
        return qv_row_q4k(n0, lane, r);
    }
    let per_block = block_len() / 32u;
    let bytes = block_bytes();
    let row_bytes = (p.k / block_len()) * bytes;
    let units = p.k / 32u;
    let first = r * (p.k / 4u);
    var acc = vec4<f32>(0.0);
    for (var u = lane; u < units; u += QV_TPR) {
        let xu = qv_x(first + 8u * u);
        let base = (u / per_block) * bytes;
        for (var c = 0u; c < QV_NR; c++) {
            let a = min(n0 + c, p.n - 1u) * row_bytes + base;
            var wu: QUnit;
            if (QV_CHUNKS != 0u) {
                wu = unit_any(a, u % per_block);
            } else {
                wu = unit_at(a, u % per_block);
            }
            let d = qv_dot(xu, wu);
            acc += select(vec4<f32>(0.0), vec4<f32>(d), vec4<u32>(0u, 1u, 2u, 3u) == vec4<u32>(c));
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

// x values v .. v + 32 (8 vec4 from vec4 index i) and the sums of their two 16-value halves.
fn qv_x32(i: u32) -> XUnit {
    var xu: XUnit;
    for (var j = 0u; j < 8u; j++) {
        xu.v[j] = x[i + j];
    }
    let one = vec4<f32>(1.0);
    xu.sums = vec2<f32>(
        dot(xu.v[0] + xu.v[1] + xu.v[2] + xu.v[3], one),
        dot(xu.v[4] + xu.v[5] + xu.v[6] + xu.v[7], one),
    );
    return xu;
}

// qv_row for Q6_K, a step being the two 32-value sub-blocks of a half that share their bytes:
// quarters q0 and q0 + 2 take the low and high nibbles of the same 32 ql bytes, and the bit
// pairs 2 q0 and 2 q0 + 4 of the same 32 qh bytes. Per 64 values and row that is 9 + 9 words
// (runs 2-byte aligned, funnel-shifted as they stream) and 3 for the scales and d, where two
// 32-value units read 40: on a CPU driver each weight word is a gather across rows, and the
// gathers were Q6_K's cost. Every word is used as it arrives (nothing kept in arrays).
fn qv_row_q6k(n0: u32, lane: u32, r: u32) -> vec4<f32> {
    let row_bytes = (p.k / 256u) * 210u;
    let steps = p.k / 64u;
    let first = r * (p.k / 4u);
    var acc = vec4<f32>(0.0);
    for (var u = lane; u < steps; u += QV_TPR) {
        let blk = u / 4u;
        let h = (u % 4u) / 2u;
        let q0 = u % 2u;
        let v0 = blk * 256u + 128u * h + 32u * q0;
        let xa = qv_x32(first + v0 / 4u);
        let xb = qv_x32(first + (v0 + 64u) / 4u);
        let xsum = vec4<f32>(xa.sums, xb.sums);
        for (var c = 0u; c < QV_NR; c++) {
            let a = min(n0 + c, p.n - 1u) * row_bytes + blk * 210u;
            let d = q6k_pair(a, h, q0, xa, xb, xsum);
            acc += select(vec4<f32>(0.0), vec4<f32>(d), vec4<u32>(0u, 1u, 2u, 3u) == vec4<u32>(c));
        }
    }
    return acc;
}

// Sub-blocks 4h + q0 and 4h + q0 + 2 of the Q6_K block at byte a dotted with xa and xb.
fn q6k_pair(a: u32, h: u32, q0: u32, xa: XUnit, xb: XUnit, xsum: vec4<f32>) -> f32 {
    let ql = a + 64u * h + 32u * q0;
    let qh = a + 128u + 32u * h;
    let il = ql >> 2u;
    let ih = qh >> 2u;
    let odd = (a & 2u) != 0u;
    var lprev = w[il];
    var hprev = w[ih];
    var dots = vec4<f32>(0.0);
    for (var g = 0u; g < 8u; g++) {
        let lnext = w[il + g + 1u];
        let hnext = w[ih + g + 1u];
        let lw = funnel(lprev, lnext, odd);
        let hw = funnel(hprev, hnext, odd);
        lprev = lnext;
        hprev = hnext;
        let lo = bytes4(lw, 0u, 0xfu) | (bytes4(hw, 2u * q0, 3u) << vec4<u32>(4u));
        let hi = bytes4(lw, 4u, 0xfu) | (bytes4(hw, 2u * q0 + 4u, 3u) << vec4<u32>(4u));
        let pa = dot(xa.v[g], vec4<f32>(lo));
        let pb = dot(xb.v[g], vec4<f32>(hi));
        if (g < 4u) {
            dots += vec4<f32>(pa, 0.0, pb, 0.0);
        } else {
            dots += vec4<f32>(0.0, pa, 0.0, pb);
        }
    }
    let sc = a + 192u + 8u * h + 2u * q0;
    let sa = u16_at(sc);
    let sb = u16_at(sc + 4u);
    let scales = vec4<f32>(
        f32(signed_byte(sa & 0xffu)),
        f32(signed_byte(sa >> 8u)),
        f32(signed_byte(sb & 0xffu)),
        f32(signed_byte(sb >> 8u)),
    );
    // value = d * scale * (q - 32), per 16 values.
    return f16_at(a + 208u) * dot(scales, dots - 32.0 * xsum);
}

// qv_row for Q4_K a pair of sub-blocks (64 values) per step: sub-blocks 2j and 2j + 1 of a
// block are the low and high nibbles of the same 32 bytes, so a step reads those 8 words
// once (a block is 144 bytes, so rows and nibble runs are word-aligned: no funnelling) and
// the 4 words of d, dmin and scales, 12 loads per 64 values where two units read 26 (9 + 4
// each). Every word is used as it arrives.
fn qv_row_q4k(n0: u32, lane: u32, r: u32) -> vec4<f32> {
    let row_words = (p.k / 256u) * 36u;
    let steps = p.k / 64u;
    let first = r * (p.k / 4u);
    var acc = vec4<f32>(0.0);
    for (var u = lane; u < steps; u += QV_TPR) {
        let blk = u / 4u;
        let j = u % 4u;
        let xa = qv_x32(first + 16u * u);
        let xb = qv_x32(first + 16u * u + 8u);
        let xsum = vec2<f32>(xa.sums.x + xa.sums.y, xb.sums.x + xb.sums.y);
        for (var c = 0u; c < QV_NR; c++) {
            let i = min(n0 + c, p.n - 1u) * row_words + blk * 36u;
            let d = q4k_pair(i, j, xa, xb, xsum);
            acc += select(vec4<f32>(0.0), vec4<f32>(d), vec4<u32>(0u, 1u, 2u, 3u) == vec4<u32>(c));
        }
    }
    return acc;
}

// Sub-blocks 2j and 2j + 1 of the Q4_K block at word i dotted with xa and xb (xsum: their
// sums, for the mins).
fn q4k_pair(i: u32, j: u32, xa: XUnit, xb: XUnit, xsum: vec2<f32>) -> f32 {
    var da = 0.0;
    var db = 0.0;
    let q = i + 4u + 8u * j;
    for (var g = 0u; g < 8u; g++) {
        let v = w[q + g];
        da += dot(xa.v[g], vec4<f32>(bytes4(v, 0u, 0xfu)));
        db += dot(xb.v[g], vec4<f32>(bytes4(v, 4u, 0xfu)));
    }
    let sm = q4k_pair_scales(i, j);
    let dm = unpack2x16float(w[i]);
    return dm.x * (sm.x * da + sm.y * db) - dm.y * (sm.z * xsum.x + sm.w * xsum.y);
}

// The 6-bit scales and mins of sub-blocks 2j and 2j + 1 of the Q4_K block at word i, as
// (scale 2j, scale 2j + 1, min 2j, min 2j + 1): the bytes of the pair sit in the same half of
// each of the three scale words (k4_scale's layout), so one shift per word picks them.
fn q4k_pair_scales(i: u32, j: u32) -> vec4<f32> {
    let sh = vec2<u32>(16u * (j % 2u)) + vec2<u32>(0u, 8u);
    let lo = (vec2<u32>(w[i + 1u]) >> sh) & vec2<u32>(0xffu);
    let hi = (vec2<u32>(w[i + 2u]) >> sh) & vec2<u32>(0xffu);
    let top = (vec2<u32>(w[i + 3u]) >> sh) & vec2<u32>(0xffu);
    let six = vec2<u32>(63u);
    let sc = select(lo & six, (top & vec2<u32>(0xfu)) | ((lo >> vec2<u32>(6u)) << vec2<u32>(4u)), j >= 2u);
    let mn = select(hi & six, (top >> vec2<u32>(4u)) | ((hi >> vec2<u32>(6u)) << vec2<u32>(4u)), j >= 2u);
    return vec4<f32>(vec2<f32>(sc), vec2<f32>(mn));
}
