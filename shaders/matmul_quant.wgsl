// Matrix multiply on block-quantized weights: y[m][n] = x[m][k] . dequant(w)[n][k] (+ bias[n]).
// Each row of w is k / block_len ggml blocks (any type quant_blocks.wgsl reads, as GGUF stores
// them) packed back to back; the buffer is read as u32 words and the blocks' bytes picked out, so
// rows need no padding. Values are dequantized in registers, 16 at a time (every type keeps
// one scale and offset per 16 values: value = scale * q - offset), and accumulated in f32.
// QTYPE (ggml's type id) selects the layout: the host makes one pipeline per type.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

// The block readers (QTYPE, chunk_scale, chunk_q) are in quant_blocks.wgsl, appended.

fn row_bytes() -> u32 {
    return (p.k / block_len()) * block_bytes();
}

// Byte address of the block holding chunk ci of weight row n, and the chunk's index in it.
fn chunk_at(n: u32, ci: u32) -> vec2<u32> {
    let per_block = block_len() / 16u;
    return vec2<u32>(n * row_bytes() + (ci / per_block) * block_bytes(), ci % per_block);
}

// ---------------------------------------------------------------------------------------------
// Decode GEMV (m <= 8): a workgroup per GV_COLS weight rows; its invocations stride over the
// 16-value chunks along k (neighbours read neighbouring blocks), each dequantizes a chunk once
// and applies it to every row of x, and the partial sums meet in workgroup memory.
override GV_WG: u32 = 64u;
const GV_COLS: u32 = 4u;
const GV_ROWS: u32 = 8u;

var<workgroup> gv_sum: array<f32, GV_WG * 32u>;

@compute @workgroup_size(GV_WG)
fn qgemv(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let n0 = (wid.y * nwg.x + wid.x) * GV_COLS;
    let chunks = p.k / 16u;
    var acc: array<f32, 32>;
    for (var ci = lid; ci < chunks; ci += GV_WG) {
        let k0 = ci * 16u;
        // Sum of each row's 16 inputs, for the offset term (independent of the weight row).
        var xs: array<f32, GV_ROWS>;
        for (var r = 0u; r < p.m; r++) {
            var s = 0.0;
            for (var j = 0u; j < 16u; j++) {
                s += x[r * p.k + k0 + j];
            }
            xs[r] = s;
        }
        for (var cc = 0u; cc < GV_COLS; cc++) {
            let at = chunk_at(min(n0 + cc, p.n - 1u), ci);
            let sc = chunk_scale(at.x, at.y);
            var q: array<f32, 16>;
            for (var j = 0u; j < 16u; j++) {
                q[j] = chunk_q(at.x, at.y, j);
            }
            for (var r = 0u; r < p.m; r++) {
                var qx = 0.0;
                for (var j = 0u; j < 16u; j++) {
                    qx += q[j] * x[r * p.k + k0 + j];
                }
                acc[cc * GV_ROWS + r] += sc.x * qx - sc.y * xs[r];
            }
        }
    }
    // Only the rows the step has are reduced (decode runs one to a few).
    for (var cc = 0u; cc < GV_COLS; cc++) {
        for (var r = 0u; r < p.m; r++) {
            let i = cc * GV_ROWS + r;
            gv_sum[i * GV_WG + lid] = acc[i];
        }
    }
    workgroupBarrier();
    if (lid < 32u) {
        let cc = lid / GV_ROWS;
        let r = lid % GV_ROWS;
        let n = n0 + cc;
        if (r < p.m && n < p.n) {
            var v = 0.0;
            for (var t = 0u; t < GV_WG; t++) {
                v += gv_sum[lid * GV_WG + t];
            }
            if (p.has_bias != 0u) {
                v += bias[n];
            }
            y[r * p.n + n] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill GEMM: a 64 x 64 output block per 16 x 16 workgroup, 4 x 4 outputs per invocation
// (strided by 16 so stores are coalesced). Per 16-value step along k the workgroup stages a
// 64 x 16 tile of x and the dequantized 64 x 16 tile of w in workgroup memory.
const GM_TILE: u32 = 64u;

var<workgroup> gm_x: array<f32, 1024>;
var<workgroup> gm_w: array<f32, 1024>;

@compute @workgroup_size(16, 16)
fn qgemm(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let m0 = wid.y * GM_TILE;
    let n0 = wid.x * GM_TILE;
    // Each invocation stages 4 values of one x row and one w row per step.
    let row = lid / 4u;
    let j0 = (lid % 4u) * 4u;
    let xrow = min(m0 + row, p.m - 1u);
    let wrow = min(n0 + row, p.n - 1u);
    var acc: array<array<f32, 4>, 4>;
    let chunks = p.k / 16u;
    for (var ci = 0u; ci < chunks; ci++) {
        let at = chunk_at(wrow, ci);
        let sc = chunk_scale(at.x, at.y);
        for (var j = 0u; j < 4u; j++) {
            gm_x[row * 16u + j0 + j] = x[xrow * p.k + ci * 16u + j0 + j];
            gm_w[row * 16u + j0 + j] = sc.x * chunk_q(at.x, at.y, j0 + j) - sc.y;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            var xv: array<f32, 4>;
            var wv: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                xv[i] = gm_x[(lid3.y + 16u * i) * 16u + kk];
                wv[i] = gm_w[(lid3.x + 16u * i) * 16u + kk];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i][j] += xv[i] * wv[j];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let m = m0 + lid3.y + 16u * i;
        for (var j = 0u; j < 4u; j++) {
            let n = n0 + lid3.x + 16u * j;
            if (m < p.m && n < p.n) {
                var v = acc[i][j];
                if (p.has_bias != 0u) {
                    v += bias[n];
                }
                y[m * p.n + n] = v;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill GEMM, dequantize-then-multiply: the shape of matmul_block.wgsl's block GEMM on packed
// weights. A workgroup of QG_WGX x QG_WGY invocations computes a BM x BN block of y
// (BM = QG_WGY * QG_TM, BN = QG_WGX * QG_TN), each invocation a QG_TM x QG_TN register tile of
// it. Per QG_BK-value step along k (whole 32-value blocks):
// - w: the workgroup dequantizes the BN x QG_BK tile once into workgroup memory, scales
//   unpacked once per chunk and row, quants read as whole words (chunk_quad), neighbouring
//   invocations on neighbouring words (qg_stage_w);
// - x: the BM x QG_BK tile is staged as 4 x 4 blocks (4 rows x 4 values), transposed in
//   registers, so both stages are k-major with vec4 along m (x) or n (w);
// - then the dense tile product runs from workgroup memory with vec4 reads and vec4 fused
//   multiply-adds, every value read feeding QG_TM or QG_TN of them.
// Edge rows are clamped (w) or zero (x) on load and skipped on store.

// Rows and columns per invocation: multiples of 4, at most 16.
override QG_TM: u32 = 8u;
override QG_TN: u32 = 8u;
// Invocations along n and m.
override QG_WGX: u32 = 8u;
override QG_WGY: u32 = 8u;
// k step: 32 values (a block of the 32-value types, two chunks of a 256-value one), which
// divides every k of whole blocks.
override QG_BK: u32 = 32u;
// How w is staged: 0 a chunk (16 values) of 4 rows per work item (qg_stage_w), 1 a 32-value
// unit of one row per work item (qg_stage_w_units).
override QG_STAGE: u32 = 0u;
// Stage sizes in vec4, QG_BK * BM / 4 and QG_BK * BN / 4, set by the host (at most 4096 floats
// in all for the 16 KiB every adapter gives a workgroup; the larger tiles, which the host offers
// only where the device gives more, up to 8192).
override QG_XS4: u32 = 512u;
override QG_WS4: u32 = 512u;

var<workgroup> qg_x: array<vec4<f32>, QG_XS4>;
var<workgroup> qg_w: array<vec4<f32>, QG_WS4>;

// Stages x[m0 .. m0 + BM][k0 .. k0 + QG_BK] as qg_x[kk * bm4 + row group][row in group].
fn qg_stage_x(m0: u32, k0: u32, lid: u32) {
    let bm4 = QG_WGY * QG_TM / 4u;
    let bk4 = QG_BK / 4u;
    for (var e = lid; e < bm4 * bk4; e += QG_WGX * QG_WGY) {
        let g = e / bk4;
        let kq = k0 + (e % bk4) * 4u;
        var v: array<vec4<f32>, 4>;
        for (var q = 0u; q < 4u; q++) {
            let r = m0 + g * 4u + q;
            if (r < p.m) {
                let i = r * p.k + kq;
                v[q] = vec4<f32>(x[i], x[i + 1u], x[i + 2u], x[i + 3u]);
            }
        }
        let at = (kq - k0) * bm4 + g;
        qg_x[at] = vec4<f32>(v[0].x, v[1].x, v[2].x, v[3].x);
        qg_x[at + bm4] = vec4<f32>(v[0].y, v[1].y, v[2].y, v[3].y);
        qg_x[at + 2u * bm4] = vec4<f32>(v[0].z, v[1].z, v[2].z, v[3].z);
        qg_x[at + 3u * bm4] = vec4<f32>(v[0].w, v[1].w, v[2].w, v[3].w);
    }
}

// Dequantizes rows n0 .. n0 + BN of w, values k0 .. k0 + QG_BK, into qg_w[kk * bn4 + row / 4]
// (as vec4 over 4 rows). The unit of work is 4 rows' quads of one chunk (their 4 scales and
// offsets unpacked once), split over up to 4 invocations so that every invocation has one
// where the workgroup allows; split fastest, so neighbouring invocations read neighbouring
// words of each row.
fn qg_stage_w(n0: u32, k0: u32, lid: u32) {
    let bn4 = QG_WGX * QG_TN / 4u;
    let chunks = QG_BK / 16u;
    let threads = QG_WGX * QG_WGY;
    let split = clamp(threads / (bn4 * chunks), 1u, 4u);
    let quads = 4u / split;
    for (var e = lid; e < bn4 * chunks * split; e += threads) {
        let c = (e / split) % chunks;
        let g4 = e / (split * chunks);
        let ci = k0 / 16u + c;
        var at: array<vec2<u32>, 4>;
        var d: vec4<f32>;
        var o: vec4<f32>;
        for (var q = 0u; q < 4u; q++) {
            at[q] = chunk_at(min(n0 + g4 * 4u + q, p.n - 1u), ci);
            let sc = chunk_scale(at[q].x, at[q].y);
            d[q] = sc.x;
            o[q] = sc.y;
        }
        for (var g = (e % split) * quads; g < (e % split + 1u) * quads; g++) {
            var v: array<vec4<f32>, 4>;
            for (var q = 0u; q < 4u; q++) {
                v[q] = chunk_quad(at[q].x, at[q].y, g);
            }
            let s = (c * 16u + 4u * g) * bn4 + g4;
            qg_w[s] = vec4<f32>(v[0].x, v[1].x, v[2].x, v[3].x) * d - o;
            qg_w[s + bn4] = vec4<f32>(v[0].y, v[1].y, v[2].y, v[3].y) * d - o;
            qg_w[s + 2u * bn4] = vec4<f32>(v[0].z, v[1].z, v[2].z, v[3].z) * d - o;
            qg_w[s + 3u * bn4] = vec4<f32>(v[0].w, v[1].w, v[2].w, v[3].w) * d - o;
        }
    }
}

// The same tile as qg_stage_w, one 32-value unit of one row per work item, read by unit_at:
// each word of the unit loaded once (a funnel for the 2-byte-aligned blocks instead of a
// branch per word), its scales unpacked once, and Q4_0's and Q5_0's nibbles and fifth bits
// unpacked word-wide. Fewer loads per value than a chunk per work item (Q5_0: 8 loads per
// 32 values against 2 to 4 per 4), and the same layout in qg_w (scalar stores into its vec4, the
// neighbouring invocations' rows side by side).
fn qg_stage_w_units(n0: u32, k0: u32, lid: u32) {
    let bn = QG_WGX * QG_TN;
    let bn4 = bn / 4u;
    let units = QG_BK / 32u;
    for (var e = lid; e < bn * units; e += QG_WGX * QG_WGY) {
        // Units along k fastest: neighbouring invocations read neighbouring blocks of a row
        // where the step holds several.
        let t = e % units;
        let r = e / units;
        let kv = k0 + 32u * t;
        let n = min(n0 + r, p.n - 1u);
        let a = n * row_bytes() + (kv / block_len()) * block_bytes();
        let u = unit_at(a, (kv % block_len()) / 32u);
        for (var g = 0u; g < 8u; g++) {
            let sc = select(u.s0, u.s1, g >= 4u);
            let v = u.q[g] * sc.x - sc.y;
            let s = (32u * t + 4u * g) * bn4 + r / 4u;
            qg_w[s][r % 4u] = v.x;
            qg_w[s + bn4][r % 4u] = v.y;
            qg_w[s + 2u * bn4][r % 4u] = v.z;
            qg_w[s + 3u * bn4][r % 4u] = v.w;
        }
    }
}

@compute @workgroup_size(QG_WGX, QG_WGY)
fn qgemm_tile(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) l: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let bm4 = QG_WGY * QG_TM / 4u;
    let bn4 = QG_WGX * QG_TN / 4u;
    let m0 = wid.y * bm4 * 4u;
    let n0 = wid.x * bn4 * 4u;
    // acc[i][j4]: row i of the tile, column vec4 group j4.
    var acc: array<array<vec4<f32>, 4>, 16>;
    for (var k0 = 0u; k0 < p.k; k0 += QG_BK) {
        qg_stage_x(m0, k0, lid);
        if (QG_STAGE == 1u) {
            qg_stage_w_units(n0, k0, lid);
        } else {
            qg_stage_w(n0, k0, lid);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < QG_BK; kk++) {
            var a: array<vec4<f32>, 4>;
            var b: array<vec4<f32>, 4>;
            for (var i4 = 0u; i4 < QG_TM / 4u; i4++) {
                a[i4] = qg_x[kk * bm4 + l.y + i4 * QG_WGY];
            }
            for (var j4 = 0u; j4 < QG_TN / 4u; j4++) {
                b[j4] = qg_w[kk * bn4 + l.x + j4 * QG_WGX];
            }
            for (var i = 0u; i < QG_TM; i++) {
                let av = vec4<f32>(a[i / 4u][i % 4u]);
                for (var j4 = 0u; j4 < QG_TN / 4u; j4++) {
                    acc[i][j4] = fma(av, b[j4], acc[i][j4]);
                }
            }
        }
        workgroupBarrier();
    }
    qg_store(m0, n0, l.xy, &acc);
}

// Writes an invocation's tile (rows strided by 4 * QG_WGY per group of 4, column groups by
// 4 * QG_WGX), adding the bias, skipping what lies past m or n.
fn qg_store(m0: u32, n0: u32, l: vec2<u32>, acc: ptr<function, array<array<vec4<f32>, 4>, 16>>) {
    for (var i = 0u; i < QG_TM; i++) {
        let m = m0 + ((i / 4u) * QG_WGY + l.y) * 4u + i % 4u;
        if (m >= p.m) {
            continue;
        }
        for (var j4 = 0u; j4 < QG_TN / 4u; j4++) {
            let nb = n0 + (j4 * QG_WGX + l.x) * 4u;
            for (var q = 0u; q < 4u; q++) {
                let n = nb + q;
                if (n < p.n) {
                    var v = (*acc)[i][j4][q];
                    if (p.has_bias != 0u) {
                        v += bias[n];
                    }
                    y[m * p.n + n] = v;
                }
            }
        }
    }
}
