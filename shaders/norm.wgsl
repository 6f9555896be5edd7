// Row normalisations, one workgroup per row: LayerNorm (GPT-2, BERT), RMSNorm (Llama), and
// RMSNorm of every head of the queries or keys in place (Qwen3's q_norm / k_norm).
struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> gamma: array<f32>;
@group(0) @binding(3) var<storage, read> beta: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

// Tree sum of one value per invocation; every invocation gets the total.
fn workgroup_sum(lid: u32, value: f32) -> f32 {
    partial[lid] = value;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(WG)
fn layernorm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wid.x * p.cols;
    var s = 0.0;
    for (var c = lid; c < p.cols; c += WG) {
        s += x[base + c];
    }
    let mean = workgroup_sum(lid, s) / f32(p.cols);
    var v = 0.0;
    for (var c = lid; c < p.cols; c += WG) {
        let d = x[base + c] - mean;
        v += d * d;
    }
    let inv = inverseSqrt(workgroup_sum(lid, v) / f32(p.cols) + p.eps);
    for (var c = lid; c < p.cols; c += WG) {
        y[base + c] = (x[base + c] - mean) * inv * gamma[c] + beta[c];
    }
}

@compute @workgroup_size(WG)
fn rmsnorm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wid.x * p.cols;
    var s = 0.0;
    for (var c = lid; c < p.cols; c += WG) {
        let v = x[base + c];
        s += v * v;
    }
    let inv = inverseSqrt(workgroup_sum(lid, s) / f32(p.cols) + p.eps);
    for (var c = lid; c < p.cols; c += WG) {
        y[base + c] = x[base + c] * inv * gamma[c];
    }
}

// RMSNorm of `y` in place, row by row: a row is one head of one token (`cols` = head_dim) and
// every row shares `gamma`. `x` is not read (bound to any read-only buffer), since a buffer may
// not be bound read-only and read-write at once. Rows can outnumber one grid dimension
// (tokens x heads), so the row folds two: wid.y * nwg.x + wid.x. Each invocation rewrites only
// the values it read, after the reduction's barriers, so in place is safe.
@compute @workgroup_size(WG)
fn rmsnorm_heads(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.cols;
    var s = 0.0;
    for (var c = lid; c < p.cols; c += WG) {
        let v = y[base + c];
        s += v * v;
    }
    let inv = inverseSqrt(workgroup_sum(lid, s) / f32(p.cols) + p.eps);
    for (var c = lid; c < p.cols; c += WG) {
        y[base + c] = y[base + c] * inv * gamma[c];
    }
}
