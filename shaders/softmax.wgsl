// Row-wise softmax in place, one workgroup per row, numerically stable (max subtracted).
struct Params {
    rows: u32,
    cols: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<uniform> p: Params;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wid.x * p.cols;
    var m = -3.4e38;
    for (var c = lid; c < p.cols; c += WG) {
        m = max(m, x[base + c]);
    }
    partial[lid] = m;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            partial[lid] = max(partial[lid], partial[lid + stride]);
        }
        workgroupBarrier();
    }
    let row_max = partial[0];
    workgroupBarrier();
    var s = 0.0;
    for (var c = lid; c < p.cols; c += WG) {
        let e = exp(x[base + c] - row_max);
        x[base + c] = e;
        s += e;
    }
    partial[lid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / partial[0];
    for (var c = lid; c < p.cols; c += WG) {
        x[base + c] *= inv;
    }
}
