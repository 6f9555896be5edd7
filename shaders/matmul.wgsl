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

// Each invocation owns a TM x TN block of outputs ("unit" tiling, no workgroup memory): on CPU
// drivers like lavapipe barriers and shared memory cost more than they save, while a register
// tile cuts loads per multiply-add by the tile size.
const TM: u32 = 4u;
const TN: u32 = 4u;
override WG_X: u32 = 8u;
override WG_Y: u32 = 1u;

fn load_w(i: u32) -> f32 {
    return f32(w[i]);
}

fn load_x4(base: u32) -> vec4<f32> {
    return vec4<f32>(x[base], x[base + 1u], x[base + 2u], x[base + 3u]);
}

fn load_w4(base: u32) -> vec4<f32> {
    return vec4<f32>(load_w(base), load_w(base + 1u), load_w(base + 2u), load_w(base + 3u));
}

@compute @workgroup_size(WG_X, WG_Y)
fn matmul(@builtin(global_invocation_id) gid: vec3<u32>) {
    let n0 = gid.x * TN;
    let m0 = gid.y * TM;
    if (n0 >= p.n || m0 >= p.m) {
        return;
    }
    // Rows past the edge are clamped for loading and skipped when storing, so any M, N work.
    var xrow: array<u32, TM>;
    var wrow: array<u32, TN>;
    for (var i = 0u; i < TM; i++) {
        xrow[i] = min(m0 + i, p.m - 1u) * p.k;
    }
    for (var j = 0u; j < TN; j++) {
        wrow[j] = min(n0 + j, p.n - 1u) * p.k;
    }
    var acc: array<array<f32, TN>, TM>;
    let k4 = p.k & ~3u;
    for (var kk = 0u; kk < k4; kk += 4u) {
        var xv: array<vec4<f32>, TM>;
        for (var i = 0u; i < TM; i++) {
            xv[i] = load_x4(xrow[i] + kk);
        }
        for (var j = 0u; j < TN; j++) {
            let wv = load_w4(wrow[j] + kk);
            for (var i = 0u; i < TM; i++) {
                acc[i][j] += dot(xv[i], wv);
            }
        }
    }
    for (var kk = k4; kk < p.k; kk++) {
        for (var i = 0u; i < TM; i++) {
            let xs = x[xrow[i] + kk];
            for (var j = 0u; j < TN; j++) {
                acc[i][j] += xs * load_w(wrow[j] + kk);
            }
        }
    }
    for (var i = 0u; i < TM; i++) {
        let m = m0 + i;
        if (m >= p.m) {
            break;
        }
        for (var j = 0u; j < TN; j++) {
            let n = n0 + j;
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
