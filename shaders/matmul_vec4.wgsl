// Matrix multiply for inner dimensions that are a multiple of 4: y[m][n] = x[m][.] . w[n][.]
// (+ bias[n]), weights stored transposed ([n][k]) as in matmul.wgsl. Both operands are read
// as vec4 along k, which CPU drivers turn into one wide load per lane instead of four scalar
// ones (measured ~1.4x the scalar kernel on lavapipe); otherwise the same tiling: rows from
// the workgroup id (uniform loads), a TM x TN register tile over columns strided by WG.
// WT is f32 or f16 (the host makes the f16 variant, as for matmul.wgsl).
alias WT = f32;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<WT>>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

const TM: u32 = 4u;
const TN: u32 = 4u;
const WG: u32 = 8u;

@compute @workgroup_size(WG)
fn matmul_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let m0 = wid.y * TM;
    let n_first = wid.x * (WG * TN) + lid;
    let k4 = p.k / 4u;
    // Edge rows and columns are clamped for loading and skipped when storing.
    var xrow: array<u32, TM>;
    var wrow: array<u32, TN>;
    for (var i = 0u; i < TM; i++) {
        xrow[i] = min(m0 + i, p.m - 1u) * k4;
    }
    for (var j = 0u; j < TN; j++) {
        wrow[j] = min(n_first + j * WG, p.n - 1u) * k4;
    }
    var acc: array<array<f32, TN>, TM>;
    for (var kk = 0u; kk < k4; kk++) {
        var wv: array<vec4<f32>, TN>;
        for (var j = 0u; j < TN; j++) {
            wv[j] = vec4<f32>(w[wrow[j] + kk]);
        }
        for (var i = 0u; i < TM; i++) {
            let xv = x[xrow[i] + kk];
            for (var j = 0u; j < TN; j++) {
                acc[i][j] += dot(xv, wv[j]);
            }
        }
    }
    for (var i = 0u; i < TM; i++) {
        let m = m0 + i;
        if (m >= p.m) {
            break;
        }
        for (var j = 0u; j < TN; j++) {
            let n = n_first + j * WG;
            if (n < p.n) {
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
// Register-tile variants of `matmul_vec4` for the autotuner: the same scheme (rows from the
// workgroup id, columns strided by the workgroup) with the tile and workgroup set by override
// constants, so one entry point yields several candidates. Tiles up to 8 x 8.
override RT_TM: u32 = 4u;
override RT_TN: u32 = 4u;
override RT_WG: u32 = 8u;

@compute @workgroup_size(RT_WG)
fn matmul_vec4_rt(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let m0 = wid.y * RT_TM;
    let n_first = wid.x * (RT_WG * RT_TN) + lid;
    let k4 = p.k / 4u;
    var xrow: array<u32, 8>;
    var wrow: array<u32, 8>;
    for (var i = 0u; i < RT_TM; i++) {
        xrow[i] = min(m0 + i, p.m - 1u) * k4;
    }
    for (var j = 0u; j < RT_TN; j++) {
        wrow[j] = min(n_first + j * RT_WG, p.n - 1u) * k4;
    }
    var acc: array<array<f32, 8>, 8>;
    for (var kk = 0u; kk < k4; kk++) {
        var wv: array<vec4<f32>, 8>;
        for (var j = 0u; j < RT_TN; j++) {
            wv[j] = vec4<f32>(w[wrow[j] + kk]);
        }
        for (var i = 0u; i < RT_TM; i++) {
            let xv = x[xrow[i] + kk];
            for (var j = 0u; j < RT_TN; j++) {
                acc[i][j] += dot(xv, wv[j]);
            }
        }
    }
    for (var i = 0u; i < RT_TM; i++) {
        let m = m0 + i;
        if (m >= p.m) {
            break;
        }
        for (var j = 0u; j < RT_TN; j++) {
            let n = n_first + j * RT_WG;
            if (n < p.n) {
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
// Decode GEMV (m <= 8 rows): a workgroup of GV_WG invocations computes GV_COLS output columns
// for every row. Invocations stride along k with vec4 loads, so neighbouring invocations read
// neighbouring 16-byte words of a weight row (coalesced on a GPU); the partial sums are then
// reduced in workgroup memory. GV_WG is a power of two, 64-256.
override GV_WG: u32 = 128u;
const GV_COLS: u32 = 4u;
const GV_ROWS: u32 = 8u;
var<workgroup> gv_red: array<vec4<f32>, 256>;

@compute @workgroup_size(GV_WG)
fn gemv(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let n0 = (wid.y * nwg.x + wid.x) * GV_COLS;
    let k4 = p.k / 4u;
    // Columns past the edge are clamped for loading and skipped when storing.
    let w0 = min(n0, p.n - 1u) * k4;
    let w1 = min(n0 + 1u, p.n - 1u) * k4;
    let w2 = min(n0 + 2u, p.n - 1u) * k4;
    let w3 = min(n0 + 3u, p.n - 1u) * k4;
    var acc: array<vec4<f32>, GV_ROWS>;
    for (var kk = lid; kk < k4; kk += GV_WG) {
        let a = vec4<f32>(w[w0 + kk]);
        let b = vec4<f32>(w[w1 + kk]);
        let c = vec4<f32>(w[w2 + kk]);
        let d = vec4<f32>(w[w3 + kk]);
        for (var r = 0u; r < GV_ROWS; r++) {
            if (r < p.m) {
                let xv = x[r * k4 + kk];
                acc[r] += vec4<f32>(dot(xv, a), dot(xv, b), dot(xv, c), dot(xv, d));
            }
        }
    }
    for (var r = 0u; r < GV_ROWS; r++) {
        if (r >= p.m) {
            break;
        }
        gv_red[lid] = acc[r];
        workgroupBarrier();
        for (var s = GV_WG / 2u; s > 0u; s >>= 1u) {
            if (lid < s) {
                gv_red[lid] += gv_red[lid + s];
            }
            workgroupBarrier();
        }
        if (lid < GV_COLS) {
            let n = n0 + lid;
            if (n < p.n) {
                var v = gv_red[0][lid];
                if (p.has_bias != 0u) {
                    v += bias[n];
                }
                y[r * p.n + n] = v;
            }
        }
        workgroupBarrier();
    }
}

// ---------------------------------------------------------------------------------------------
// GPU-shaped GEMM: a workgroup of GT_WGX x GT_WGY invocations computes a BM x BN block of y
// (BM = GT_WGY * GT_TM, BN = GT_WGX * GT_TN), stepping k by GT_BK through workgroup-memory tiles
// of x and w. Tiles are loaded as vec4 along k (neighbouring invocations read neighbouring
// words) and stored k-major, so the inner loop reads a row of x values and a row of w values
// and does TM x TN multiply-adds per k. Invocations own rows and columns strided by the
// workgroup dimensions, so both the workgroup-memory reads and the stores of neighbouring
// invocations are contiguous. Edges are zero-filled on load and skipped on store.
override GT_TM: u32 = 4u;
override GT_TN: u32 = 4u;
override GT_WGX: u32 = 16u;
override GT_WGY: u32 = 16u;
const GT_BK: u32 = 16u;
const GT_MAXB: u32 = 128u;
var<workgroup> gt_x: array<f32, 2048>;
var<workgroup> gt_w: array<f32, 2048>;

@compute @workgroup_size(GT_WGX, GT_WGY)
fn gemm_tiled(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) l: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let bm = GT_WGY * GT_TM;
    let bn = GT_WGX * GT_TN;
    let threads = GT_WGX * GT_WGY;
    let m0 = wid.y * bm;
    let n0 = wid.x * bn;
    let k4 = p.k / 4u;
    let bk4 = GT_BK / 4u;
    var acc: array<array<f32, 8>, 8>;
    for (var k0 = 0u; k0 < k4; k0 += bk4) {
        for (var e = lid; e < bm * bk4; e += threads) {
            let r = e / bk4;
            let c = e % bk4;
            var v = vec4<f32>(0.0);
            if (m0 + r < p.m && k0 + c < k4) {
                v = x[(m0 + r) * k4 + k0 + c];
            }
            let base = c * 4u * GT_MAXB + r;
            gt_x[base] = v.x;
            gt_x[base + GT_MAXB] = v.y;
            gt_x[base + 2u * GT_MAXB] = v.z;
            gt_x[base + 3u * GT_MAXB] = v.w;
        }
        for (var e = lid; e < bn * bk4; e += threads) {
            let r = e / bk4;
            let c = e % bk4;
            var v = vec4<f32>(0.0);
            if (n0 + r < p.n && k0 + c < k4) {
                v = vec4<f32>(w[(n0 + r) * k4 + k0 + c]);
            }
            let base = c * 4u * GT_MAXB + r;
            gt_w[base] = v.x;
            gt_w[base + GT_MAXB] = v.y;
            gt_w[base + 2u * GT_MAXB] = v.z;
            gt_w[base + 3u * GT_MAXB] = v.w;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < GT_BK; kk++) {
            var xr: array<f32, 8>;
            var wr: array<f32, 8>;
            for (var i = 0u; i < GT_TM; i++) {
                xr[i] = gt_x[kk * GT_MAXB + l.y + i * GT_WGY];
            }
            for (var j = 0u; j < GT_TN; j++) {
                wr[j] = gt_w[kk * GT_MAXB + l.x + j * GT_WGX];
            }
            for (var i = 0u; i < GT_TM; i++) {
                for (var j = 0u; j < GT_TN; j++) {
                    acc[i][j] = fma(xr[i], wr[j], acc[i][j]);
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < GT_TM; i++) {
        let m = m0 + l.y + i * GT_WGY;
        if (m >= p.m) {
            break;
        }
        for (var j = 0u; j < GT_TN; j++) {
            let n = n0 + l.x + j * GT_WGX;
            if (n < p.n) {
                var v = acc[i][j];
                if (p.has_bias != 0u) {
                    v += bias[n];
                }
                y[m * p.n + n] = v;
            }
        }
    }
}
