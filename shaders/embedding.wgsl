// Embedding lookup: out[t][c] = wte[token[t]][c] (+ wpe[past + t % seq][c] for learned positions)
// (+ wtt[types[t]][c] for token types, BERT). Ids and types are validated on the host first.
alias WT = f32;

struct Params {
    tokens: u32,
    hidden: u32,
    seq: u32,
    past: u32,
    has_positions: u32,
    has_types: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read> wte: array<WT>;
@group(0) @binding(2) var<storage, read> wpe: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> types: array<u32>;
@group(0) @binding(5) var<storage, read> wtt: array<f32>;
@group(0) @binding(6) var<uniform> p: Params;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn embed(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let idx = (wid.y * nwg.x + wid.x) * WG + lid;
    if (idx >= p.tokens * p.hidden) {
        return;
    }
    let t = idx / p.hidden;
    let c = idx % p.hidden;
    var v = f32(wte[ids[t] * p.hidden + c]);
    if (p.has_positions != 0u) {
        v += wpe[(p.past + t % p.seq) * p.hidden + c];
    }
    if (p.has_types != 0u) {
        v += wtt[types[t] * p.hidden + c];
    }
    out[idx] = v;
}
