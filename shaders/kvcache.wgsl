// Appends new keys and values to a layer's KV cache.
// k_new, v_new: [tokens = batch * seq][n_kv_heads * head_dim]
// caches:       [slots][n_kv_heads][max_seq][head_dim], a pool of blocks of KV_BLOCK positions
//               addressed through the block table kv_blocks (as attention.wgsl's kv_row), or
//               [slots][n_kv_heads][ring][head_dim], a ring per slot (a sliding layer)
// seqs:         the step's sequence table, [batch][2] = (KV slot, past): token (b, i) lands in
//               slot seqs[2b] at position seqs[2b + 1] + i (validated on the host; a slot or
//               position outside the cache is skipped here regardless).
// Same layout as attention.wgsl's parameters: both kernels take one shape.
struct Params {
    batch: u32,
    seq: u32,
    slots: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    max_seq: u32,
    scale: f32,
    group: u32,
    q_offset: u32,
    kv_offset: u32,
    causal: u32,
    window: u32,
    // Rows of a ring layer's cache per slot and head (position p at row p % ring); 0: paged.
    ring: u32,
    _pad0: u32,
    _pad1: u32,
}

// KT: the cache's stored type (f32, or f16 in the f16 variant); activations are f32.
alias KT = f32;

@group(0) @binding(0) var<storage, read> k_new: array<f32>;
@group(0) @binding(1) var<storage, read> v_new: array<f32>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<KT>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<KT>;
@group(0) @binding(4) var<storage, read> seqs: array<u32>;
@group(0) @binding(5) var<storage, read> kv_blocks: array<u32>;
@group(0) @binding(6) var<uniform> p: Params;

// KV_BLOCK and kv_row (the block-table lookup): kv_blocks.wgsl, appended.

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
    let slot = seqs[2u * b];
    let pos = seqs[2u * b + 1u] + t % p.seq;
    if (slot >= p.slots || pos >= p.max_seq) {
        return;
    }
    let dst = kv_row(slot, h, pos) + c;
    k_cache[dst] = KT(k_new[idx]);
    v_cache[dst] = KT(v_new[idx]);
}
