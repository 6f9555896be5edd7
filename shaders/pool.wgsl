// Encoder pooling, one workgroup per sequence: the mean of the sequence's first lens[b] token
// states (or its first token's state), then optionally a scale to unit L2 norm.
// x:    [batch * seq][hidden] final token states (right-padded sequences)
// lens: [batch] real tokens per sequence (>= 1, checked on the host)
// out:  [batch][hidden]
struct Params {
    batch: u32,
    seq: u32,
    hidden: u32,
    // 0 = mean over real tokens, 1 = first token.
    mode: u32,
    normalize: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> lens: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn pool(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = wid.x;
    if (b >= p.batch) {
        return;
    }
    var count = min(lens[b], p.seq);
    if (p.mode == 1u) {
        count = 1u;
    }
    let first = b * p.seq;
    var squares = 0.0;
    // Each invocation owns the columns lid, lid + WG, ...: no two write the same element.
    for (var c = lid; c < p.hidden; c += WG) {
        var sum = 0.0;
        for (var i = 0u; i < count; i++) {
            sum += x[(first + i) * p.hidden + c];
        }
        let mean = sum / f32(count);
        out[b * p.hidden + c] = mean;
        squares += mean * mean;
    }
    if (p.normalize == 0u) {
        return;
    }
    // The early return above is uniform (a parameter), so every invocation reaches the barriers.
    partial[lid] = squares;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        workgroupBarrier();
    }
    let norm = sqrt(partial[0]);
    var inv = 0.0;
    if (norm > 0.0) {
        inv = 1.0 / norm;
    }
    for (var c = lid; c < p.hidden; c += WG) {
        out[b * p.hidden + c] *= inv;
    }
}
