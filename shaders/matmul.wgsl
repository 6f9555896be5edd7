// Matrix multiply: y[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n]).
// Weights are stored transposed ([n][k], the layout of a PyTorch Linear and of a tied embedding),
// so both operands are read along k. Accumulation is always f32; WT is f32 or f16 (the f16
// variant is made by the host, which prepends `enable f16;` and swaps the alias).
alias WT = f32;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<WT>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

// Tiling for CPU drivers such as lavapipe, which run a workgroup's invocations as SIMD lanes:
// a load whose address is the same for every lane is one scalar load, any other is a gather.
// So rows come from the workgroup id (uniform: x is read with scalar loads) and each
// invocation owns TN columns strided by the workgroup size, accumulating a TM x TN register
// tile: TM * TN multiply-adds per TN gathers. No workgroup memory or barriers, which cost more
// than they save on a CPU.
const TM: u32 = 4u;
const TN: u32 = 4u;
const WG: u32 = 8u;

fn load_w(i: u32) -> f32 {
    return f32(w[i]);
}

fn load_x4(base: u32) -> vec4<f32> {
    return vec4<f32>(x[base], x[base + 1u], x[base + 2u], x[base + 3u]);
}

fn load_w4(base: u32) -> vec4<f32> {
    return vec4<f32>(load_w(base), load_w(base + 1u), load_w(base + 2u), load_w(base + 3u));
}

@compute @workgroup_size(WG)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let m0 = wid.y * TM;
    let n_first = wid.x * (WG * TN) + lid;
    // Rows and columns past the edge are clamped for loading and skipped when storing, so
    // any M, N work.
    var xrow: array<u32, TM>;
    var wrow: array<u32, TN>;
    for (var i = 0u; i < TM; i++) {
        xrow[i] = min(m0 + i, p.m - 1u) * p.k;
    }
    for (var j = 0u; j < TN; j++) {
        wrow[j] = min(n_first + j * WG, p.n - 1u) * p.k;
    }
    var acc: array<array<f32, TN>, TM>;
    let k4 = p.k & ~3u;
    for (var kk = 0u; kk < k4; kk += 4u) {
        var wv: array<vec4<f32>, TN>;
        for (var j = 0u; j < TN; j++) {
            wv[j] = load_w4(wrow[j] + kk);
        }
        for (var i = 0u; i < TM; i++) {
            let xv = load_x4(xrow[i] + kk);
            for (var j = 0u; j < TN; j++) {
                acc[i][j] += dot(xv, wv[j]);
            }
        }
    }
    for (var kk = k4; kk < p.k; kk++) {
        var ws: array<f32, TN>;
        for (var j = 0u; j < TN; j++) {
            ws[j] = load_w(wrow[j] + kk);
        }
        for (var i = 0u; i < TM; i++) {
            let xs = x[xrow[i] + kk];
            for (var j = 0u; j < TN; j++) {
                acc[i][j] += xs * ws[j];
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

// Baseline for the kernel benchmark: one invocation per output, no tiling.
@compute @workgroup_size(8, 8)
fn matmul_naive(@builtin(global_invocation_id) gid: vec3<u32>) {
    let n = gid.x;
    let m = gid.y;
    if (n >= p.n || m >= p.m) {
        return;
    }
    var acc = 0.0;
    for (var kk = 0u; kk < p.k; kk++) {
        acc += x[m * p.k + kk] * load_w(n * p.k + kk);
    }
    if (p.has_bias != 0u) {
        acc += bias[n];
    }
    y[m * p.n + n] = acc;
}


// GPU-shaped GEMM for any inner dimension: the workgroup-memory tiling of `gemm_tiled` in
// matmul_vec4.wgsl (see there) with scalar tile loads, so k need not be a multiple of 4.
// Neighbouring invocations load neighbouring elements along k; edges are zero-filled.
override GT_TM: u32 = 4u;
override GT_TN: u32 = 4u;
override GT_WGX: u32 = 16u;
override GT_WGY: u32 = 16u;
const GT_BK: u32 = 16u;
const GT_MAXB: u32 = 128u;
var<workgroup> gt_x: array<f32, 2048>;
var<workgroup> gt_w: array<f32, 2048>;

@compute @workgroup_size(GT_WGX, GT_WGY)
fn gemm_tiled_scalar(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) l: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let bm = GT_WGY * GT_TM;
    let bn = GT_WGX * GT_TN;
    let threads = GT_WGX * GT_WGY;
    let m0 = wid.y * bm;
    let n0 = wid.x * bn;
    var acc: array<array<f32, 8>, 8>;
    for (var k0 = 0u; k0 < p.k; k0 += GT_BK) {
        for (var e = lid; e < bm * GT_BK; e += threads) {
            let r = e / GT_BK;
            let c = e % GT_BK;
            var v = 0.0;
            if (m0 + r < p.m && k0 + c < p.k) {
                v = x[(m0 + r) * p.k + k0 + c];
            }
            gt_x[c * GT_MAXB + r] = v;
        }
        for (var e = lid; e < bn * GT_BK; e += threads) {
            let r = e / GT_BK;
            let c = e % GT_BK;
            var v = 0.0;
            if (n0 + r < p.n && k0 + c < p.k) {
                v = load_w((n0 + r) * p.k + k0 + c);
            }
            gt_w[c * GT_MAXB + r] = v;
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
