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
