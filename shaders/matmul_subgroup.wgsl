// Decode GEMV with subgroup reductions: y[m][n] = x[m][.] . w[n][.] (+ bias[n]) for m <= 8,
// k divisible by 4, weights stored transposed ([n][k]) as in matmul.wgsl. Same scheme as
// `gemv` in matmul_vec4.wgsl (a workgroup per GV_COLS output columns, invocations striding
// along k with vec4 loads), but the partial sums are reduced with `subgroupAdd` and only one
// value per subgroup goes through workgroup memory. Compiled only where the device has
// `Features::SUBGROUP` (naga takes no `enable subgroups;`: the feature is requested instead).
// WT is f32 or f16 (the host makes the f16 variant).
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

override GV_WG: u32 = 128u;
const GV_COLS: u32 = 4u;
const GV_ROWS: u32 = 8u;
// Up to 64 subgroups per workgroup (256 invocations in subgroups of 4 or more).
const GV_MAX_SUBGROUPS: u32 = 64u;
var<workgroup> gv_part: array<vec4<f32>, 512>;

@compute @workgroup_size(GV_WG)
fn gemv_subgroup(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
) {
    let n0 = (wid.y * nwg.x + wid.x) * GV_COLS;
    let k4 = p.k / 4u;
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
        if (r < p.m) {
            let s = subgroupAdd(acc[r]);
            if (lane == 0u && sg < GV_MAX_SUBGROUPS) {
                gv_part[r * GV_MAX_SUBGROUPS + sg] = s;
            }
        }
    }
    workgroupBarrier();
    // Invocation r finishes row r: GV_COLS outputs from nsg partial sums.
    if (lid < p.m) {
        var total = vec4<f32>(0.0);
        for (var i = 0u; i < min(nsg, GV_MAX_SUBGROUPS); i++) {
            total += gv_part[lid * GV_MAX_SUBGROUPS + i];
        }
        for (var c = 0u; c < GV_COLS; c++) {
            let n = n0 + c;
            if (n < p.n) {
                var v = total[c];
                if (p.has_bias != 0u) {
                    v += bias[n];
                }
                y[lid * p.n + n] = v;
            }
        }
    }
}
