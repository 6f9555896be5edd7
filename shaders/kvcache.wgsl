// Appends new keys and values to a layer's KV cache.
// k_new, v_new: [tokens = batch * seq][n_kv_heads * head_dim]
// caches:       [batch][n_kv_heads][max_seq][head_dim]; token (b, i) lands at position past + i.
// Same layout as attention.wgsl's parameters: both kernels take one shape.
struct Params {
    batch: u32,
    seq: u32,
    past: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    max_seq: u32,
    scale: f32,
    group: u32,
    q_offset: u32,
    kv_offset: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> k_new: array<f32>;
@group(0) @binding(1) var<storage, read> v_new: array<f32>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn kv_store(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let idx = (wid.y * nwg.x + wid.x) * WG + lid;
    let row = p.n_kv_heads * p.head_dim;
    if (idx >= p.batch * p.seq * row) {
        return;
    }
    let t = idx / row;
    let rem = idx % row;
    let h = rem / p.head_dim;
    let c = rem % p.head_dim;
    let b = t / p.seq;
    let pos = p.past + t % p.seq;
    let dst = ((b * p.n_kv_heads + h) * p.max_seq + pos) * p.head_dim + c;
    k_cache[dst] = k_new[idx];
    v_cache[dst] = v_new[idx];
}
