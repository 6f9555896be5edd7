// Block GEMM with large register tiles: y[m][n] = x[m][.] . w[n][.] (+ bias[n]), weights
// stored transposed ([n][k]) as in matmul.wgsl, inner dimension a multiple of 4 (vec4 loads).
// The shape of a fast SGEMM on GPUs: a workgroup of BW_WGX x BW_WGY invocations computes a
// BM x BN block of y (BM = BW_WGY * BW_TM, BN = BW_WGX * BW_TN) and each invocation a
// BW_TM x BW_TN register tile of it (up to 16 x 16 accumulators), so every value read from
// workgroup memory feeds BW_TM or BW_TN multiply-adds. The k loop steps by BW_BK through one
// single-buffered workgroup-memory stage (one barrier pair per step):
// - loads: x rows and w rows are read as vec4 along k, neighbouring invocations taking
//   neighbouring 16-byte words of a row (coalesced); each invocation reads a 4 x 4 block
//   (4 rows x one vec4) and transposes it in registers, so the stage is stored k-major as
//   vec4 along m (x) or n (w) with vec4 stores only;
// - inner loop: per k, an invocation reads its BW_TM / 4 + BW_TN / 4 vec4 of the stage and
//   does BW_TM x BW_TN fused multiply-adds on vec4 accumulators. Its rows and columns are
//   vec4 groups strided by the workgroup dimensions, so neighbouring invocations read
//   neighbouring vec4 (no bank conflicts) and store neighbouring 16-byte runs of y.
// Edge tiles (any m, n, k / 4) are zero-filled on load and skipped on store.
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

// Rows and columns per invocation: multiples of 4, at most 16.
override BW_TM: u32 = 8u;
override BW_TN: u32 = 8u;
// Invocations along n and m (their product 64-256).
override BW_WGX: u32 = 8u;
override BW_WGY: u32 = 8u;
// k step: a multiple of 4.
override BW_BK: u32 = 16u;
// Stage sizes in vec4: BW_BK * BM / 4 and BW_BK * BN / 4 (the host sets them with the rest;
// at most 4096 floats in all, the 16 KiB every adapter gives a workgroup).
override BW_A4: u32 = 256u;
override BW_W4: u32 = 256u;

var<workgroup> bw_a: array<vec4<f32>, BW_A4>;
var<workgroup> bw_w: array<vec4<f32>, BW_W4>;

// Column k-chunk c of rows r0..r0+3 of a row-major [rows][k4] operand, transposed: the q-th
// vec4 returned holds element q of each row's chunk. Rows past `rows` or chunks past `k4` read
// as zero.
fn x_block(r0: u32, c: u32) -> array<vec4<f32>, 4> {
    var v: array<vec4<f32>, 4>;
    let k4 = p.k / 4u;
    if (c < k4) {
        for (var q = 0u; q < 4u; q++) {
            if (r0 + q < p.m) {
                v[q] = x[(r0 + q) * k4 + c];
            }
        }
    }
    return array<vec4<f32>, 4>(
        vec4<f32>(v[0].x, v[1].x, v[2].x, v[3].x),
        vec4<f32>(v[0].y, v[1].y, v[2].y, v[3].y),
        vec4<f32>(v[0].z, v[1].z, v[2].z, v[3].z),
        vec4<f32>(v[0].w, v[1].w, v[2].w, v[3].w),
    );
}

fn w_block(r0: u32, c: u32) -> array<vec4<f32>, 4> {
    var v: array<vec4<f32>, 4>;
    let k4 = p.k / 4u;
    if (c < k4) {
        for (var q = 0u; q < 4u; q++) {
            if (r0 + q < p.n) {
                v[q] = vec4<f32>(w[(r0 + q) * k4 + c]);
            }
        }
    }
    return array<vec4<f32>, 4>(
        vec4<f32>(v[0].x, v[1].x, v[2].x, v[3].x),
        vec4<f32>(v[0].y, v[1].y, v[2].y, v[3].y),
        vec4<f32>(v[0].z, v[1].z, v[2].z, v[3].z),
        vec4<f32>(v[0].w, v[1].w, v[2].w, v[3].w),
    );
}

@compute @workgroup_size(BW_WGX, BW_WGY)
fn gemm_block(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) l: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let threads = BW_WGX * BW_WGY;
    // Block extents in vec4 groups.
    let bm4 = BW_WGY * BW_TM / 4u;
    let bn4 = BW_WGX * BW_TN / 4u;
    let bk4 = BW_BK / 4u;
    let m0 = wid.y * bm4 * 4u;
    let n0 = wid.x * bn4 * 4u;
    let k4 = p.k / 4u;
    // acc[i][j4]: row group/lane i of the tile, column vec4 group j4.
    var acc: array<array<vec4<f32>, 4>, 16>;
    for (var kc = 0u; kc < k4; kc += bk4) {
        // Stage: bm4 x bk4 4 x 4 blocks of x, bn4 x bk4 of w; consecutive invocations take
        // consecutive k-chunks of a row group.
        for (var e = lid; e < bm4 * bk4; e += threads) {
            let g = e / bk4;
            let c = e % bk4;
            let t = x_block(m0 + g * 4u, kc + c);
            for (var q = 0u; q < 4u; q++) {
                bw_a[(c * 4u + q) * bm4 + g] = t[q];
            }
        }
        for (var e = lid; e < bn4 * bk4; e += threads) {
            let g = e / bk4;
            let c = e % bk4;
            let t = w_block(n0 + g * 4u, kc + c);
            for (var q = 0u; q < 4u; q++) {
                bw_w[(c * 4u + q) * bn4 + g] = t[q];
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BW_BK; kk++) {
            var a: array<vec4<f32>, 4>;
            var b: array<vec4<f32>, 4>;
            for (var i4 = 0u; i4 < BW_TM / 4u; i4++) {
                a[i4] = bw_a[kk * bm4 + l.y + i4 * BW_WGY];
            }
            for (var j4 = 0u; j4 < BW_TN / 4u; j4++) {
                b[j4] = bw_w[kk * bn4 + l.x + j4 * BW_WGX];
            }
            for (var i = 0u; i < BW_TM; i++) {
                let av = vec4<f32>(a[i / 4u][i % 4u]);
                for (var j4 = 0u; j4 < BW_TN / 4u; j4++) {
                    acc[i][j4] = fma(av, b[j4], acc[i][j4]);
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < BW_TM; i++) {
        let m = m0 + ((i / 4u) * BW_WGY + l.y) * 4u + i % 4u;
        if (m >= p.m) {
            continue;
        }
        for (var j4 = 0u; j4 < BW_TN / 4u; j4++) {
            let nb = n0 + (j4 * BW_WGX + l.x) * 4u;
            for (var q = 0u; q < 4u; q++) {
                let n = nb + q;
                if (n < p.n) {
                    var v = acc[i][j4][q];
                    if (p.has_bias != 0u) {
                        v += bias[n];
                    }
                    y[m * p.n + n] = v;
                }
            }
        }
    }
}
