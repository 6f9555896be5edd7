// Multi-head attention against a KV cache, for prefill (seq > 1) and decode (seq = 1).
// q:    [tokens = batch * seq][n_heads * head_dim], token t = b * seq + i
// seqs: the step's sequence table, [batch][2] = (KV slot, past): row b reads cache slot
//       seqs[2b], and its token i sits at position past + i (validated on the host; clamped
//       to the cache here regardless)
// k,v:  cache [slots][n_kv_heads][max_seq][head_dim], already holding positions 0 ..= past + i
// lens: [batch] keys per sequence that are real (not padding), read only when not causal
// out:  [tokens][n_heads * head_dim]
// Causal (decoders): token i sees positions 0 ..= past + i. Bidirectional (encoders): every
// token sees positions 0 .. min(past + seq, lens[b]), so right-padding is never attended.
// Grouped-query attention: global query head h reads KV head h / group.
struct Params {
    batch: u32,
    seq: u32,
    slots: u32,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    max_seq: u32,
    scale: f32,
    // Tensor-parallel shards hold a contiguous range of query heads and the KV heads they read;
    // query head h (local) reads KV head (h + q_offset) / group - kv_offset (local).
    group: u32,
    q_offset: u32,
    kv_offset: u32,
    causal: u32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<f32>;
@group(0) @binding(2) var<storage, read> v_cache: array<f32>;
@group(0) @binding(3) var<storage, read> lens: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> seqs: array<u32>;
@group(0) @binding(6) var<uniform> p: Params;

const MAX_HEAD_DIM: u32 = 256u;
const WG: u32 = 64u;

// One invocation per (token, head), streaming over keys with an online softmax, so memory stays
// O(head_dim) whatever the context length.
@compute @workgroup_size(WG)
fn attend(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let idx = (wid.y * nwg.x + wid.x) * WG + lid;
    let tokens = p.batch * p.seq;
    if (idx >= tokens * p.n_heads) {
        return;
    }
    let t = idx / p.n_heads;
    let h = idx % p.n_heads;
    let b = t / p.seq;
    let i = t % p.seq;
    let kvh = (h + p.q_offset) / p.group - p.kv_offset;
    let d = p.head_dim;
    let q_base = t * p.n_heads * d + h * d;
    let slot = min(seqs[2u * b], p.slots - 1u);
    let past = seqs[2u * b + 1u];
    let kv_base = (slot * p.n_kv_heads + kvh) * p.max_seq * d;

    var qv: array<f32, MAX_HEAD_DIM>;
    var acc: array<f32, MAX_HEAD_DIM>;
    for (var c = 0u; c < d; c++) {
        qv[c] = q[q_base + c] * p.scale;
        acc[c] = 0.0;
    }
    var running_max = -3.4e38;
    var denom = 0.0;
    var end = past + i + 1u;
    if (p.causal == 0u) {
        end = min(past + p.seq, lens[b]);
    }
    end = min(end, p.max_seq);
    for (var j = 0u; j < end; j++) {
        let k_base = kv_base + j * d;
        var s = 0.0;
        for (var c = 0u; c < d; c++) {
            s += qv[c] * k_cache[k_base + c];
        }
        let new_max = max(running_max, s);
        let correction = exp(running_max - new_max);
        let weight = exp(s - new_max);
        denom = denom * correction + weight;
        for (var c = 0u; c < d; c++) {
            acc[c] = acc[c] * correction + weight * v_cache[k_base + c];
        }
        running_max = new_max;
    }
    let inv = 1.0 / denom;
    for (var c = 0u; c < d; c++) {
        out[q_base + c] = acc[c] * inv;
    }
}
