// Multi-head attention against a KV cache, for prefill (seq > 1) and decode (seq = 1).
// q:    [tokens = batch * seq][n_heads * head_dim], token t = b * seq + i
// seqs: the step's sequence table, [batch][2] = (KV slot, past): row b reads cache slot
//       seqs[2b], and its token i sits at position past + i (validated on the host; clamped
//       to the cache here regardless)
// k,v:  cache [slots][n_kv_heads][max_seq][head_dim], already holding positions 0 ..= past + i,
//       read as a pool of blocks of KV_BLOCK positions through the block table (see kv_row),
//       or a ring [slots][n_kv_heads][ring][head_dim] on a sliding layer: keys older than the
//       window are masked, so a ring row overwritten since is never read
// lens: [batch] keys per sequence that are real (not padding), read only when not causal
// out:  [tokens][n_heads * head_dim]
// Causal (decoders): token i sees positions 0 ..= past + i. Bidirectional (encoders): every
// token sees positions 0 .. min(past + seq, lens[b]), so right-padding is never attended.
// Sliding window (window > 0, causal only): token i sees only positions
// past + i + 1 - window ..= past + i.
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
    // Keys a causal query sees, its own included; 0: every earlier one.
    window: u32,
    // Rows of a ring layer's cache per slot and head (position p at row p % ring, the window
    // and one step's new keys); 0: paged through kv_blocks.
    ring: u32,
    _pad1: u32,
    _pad2: u32,
}

// The first key a causal query at position `pos` sees: 0, or the window's start.
fn first_key(pos: u32) -> u32 {
    if (p.causal == 0u || p.window == 0u || pos + 1u <= p.window) {
        return 0u;
    }
    return pos + 1u - p.window;
}

// KT: the cache's stored type (f32, or f16 in the f16 variant); scores and sums stay f32.
alias KT = f32;

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<KT>;
@group(0) @binding(2) var<storage, read> v_cache: array<KT>;
@group(0) @binding(3) var<storage, read> lens: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> seqs: array<u32>;
@group(0) @binding(6) var<storage, read> kv_blocks: array<u32>;
@group(0) @binding(7) var<uniform> p: Params;

// KV_BLOCK and kv_row (the block-table lookup): kv_blocks.wgsl, appended.

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
    for (var j = first_key(past + i); j < end; j++) {
        let k_base = kv_row(slot, kvh, j);
        var s = 0.0;
        for (var c = 0u; c < d; c++) {
            s += qv[c] * f32(k_cache[k_base + c]);
        }
        let new_max = max(running_max, s);
        let correction = exp(running_max - new_max);
        let weight = exp(s - new_max);
        denom = denom * correction + weight;
        for (var c = 0u; c < d; c++) {
            acc[c] = acc[c] * correction + weight * f32(v_cache[k_base + c]);
        }
        running_max = new_max;
    }
    let inv = 1.0 / denom;
    for (var c = 0u; c < d; c++) {
        out[q_base + c] = acc[c] * inv;
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill, tiled (flash-style): a workgroup of FT_BQ invocations takes FT_BQ consecutive queries
// of one (sequence, head), one query per invocation, and walks the keys in tiles of FT_BK
// (workgroup memory under 16 KiB) that the whole workgroup loads once into workgroup memory (neighbouring invocations load
// neighbouring elements of a key row); each query keeps an online softmax, so no seq x seq
// scores are ever stored. Grid: [ceil(seq / FT_BQ), n_heads, batch]. head_dim <= 128.
const FT_BQ: u32 = 64u;
const FT_BK: u32 = 12u;
const FT_MAXD: u32 = 128u;
var<workgroup> ft_k: array<f32, 1536>;
var<workgroup> ft_v: array<f32, 1536>;
var<workgroup> ft_end: u32;

@compute @workgroup_size(FT_BQ)
fn attend_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = wid.z;
    let h = wid.y;
    let i_raw = wid.x * FT_BQ + lid;
    let valid = i_raw < p.seq;
    let i = min(i_raw, p.seq - 1u);
    let t = b * p.seq + i;
    let kvh = (h + p.q_offset) / p.group - p.kv_offset;
    let d = p.head_dim;
    let q_base = t * p.n_heads * d + h * d;
    let slot = min(seqs[2u * b], p.slots - 1u);
    let past = seqs[2u * b + 1u];
    var qv: array<f32, FT_MAXD>;
    var acc: array<f32, FT_MAXD>;
    for (var c = 0u; c < d; c++) {
        qv[c] = q[q_base + c] * p.scale;
        acc[c] = 0.0;
    }
    // Keys this query sees, and (uniform over the workgroup) the most any of its queries sees.
    var end = min(past + i + 1u, p.max_seq);
    if (lid == 0u) {
        var wg_end = past + min(p.seq, wid.x * FT_BQ + FT_BQ);
        if (p.causal == 0u) {
            wg_end = min(past + p.seq, lens[b]);
        }
        ft_end = min(wg_end, p.max_seq);
    }
    // Read through workgroup memory, so the tile loop (which has barriers) is uniform.
    let tile_end = workgroupUniformLoad(&ft_end);
    if (p.causal == 0u) {
        end = tile_end;
    }
    var running_max = -3.4e38;
    var denom = 0.0;
    let start = first_key(past + i);
    for (var j0 = 0u; j0 < tile_end; j0 += FT_BK) {
        for (var e = lid; e < FT_BK * d; e += FT_BQ) {
            let r = e / d;
            let c = e % d;
            let j = j0 + r;
            var kv = 0.0;
            var vv = 0.0;
            if (j < tile_end) {
                let at = kv_row(slot, kvh, j) + c;
                kv = f32(k_cache[at]);
                vv = f32(v_cache[at]);
            }
            ft_k[r * FT_MAXD + c] = kv;
            ft_v[r * FT_MAXD + c] = vv;
        }
        workgroupBarrier();
        for (var r = 0u; r < FT_BK; r++) {
            if (j0 + r < end && j0 + r >= start) {
                var s = 0.0;
                for (var c = 0u; c < d; c++) {
                    s += qv[c] * ft_k[r * FT_MAXD + c];
                }
                let new_max = max(running_max, s);
                let correction = exp(running_max - new_max);
                let weight = exp(s - new_max);
                denom = denom * correction + weight;
                for (var c = 0u; c < d; c++) {
                    acc[c] = acc[c] * correction + weight * ft_v[r * FT_MAXD + c];
                }
                running_max = new_max;
            }
        }
        workgroupBarrier();
    }
    if (valid) {
        let inv = 1.0 / denom;
        for (var c = 0u; c < d; c++) {
            out[q_base + c] = acc[c] * inv;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decode split over the context: a workgroup of SP_WG invocations per (token, head); invocation
// l takes keys l, l + SP_WG, ... with its own online softmax, then a reduction pass in
// workgroup memory combines the partial maxima, denominators and accumulators (rescaled to the
// common maximum), SP_CHUNK dimensions at a time. For long contexts, where one invocation per
// (token, head) would walk thousands of keys alone. Grid: tokens * n_heads workgroups, folded
// into two dimensions.
const SP_WG: u32 = 64u;
const SP_CHUNK: u32 = 32u;
var<workgroup> sp_max: array<f32, SP_WG>;
var<workgroup> sp_den: array<f32, SP_WG>;
var<workgroup> sp_acc: array<f32, 2048>;

@compute @workgroup_size(SP_WG)
fn attend_split(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let idx_raw = wid.y * nwg.x + wid.x;
    let tokens = p.batch * p.seq;
    let valid = idx_raw < tokens * p.n_heads;
    let idx = min(idx_raw, tokens * p.n_heads - 1u);
    let t = idx / p.n_heads;
    let h = idx % p.n_heads;
    let b = t / p.seq;
    let i = t % p.seq;
    let kvh = (h + p.q_offset) / p.group - p.kv_offset;
    let d = p.head_dim;
    let q_base = t * p.n_heads * d + h * d;
    let slot = min(seqs[2u * b], p.slots - 1u);
    let past = seqs[2u * b + 1u];
    var qv: array<f32, MAX_HEAD_DIM>;
    var acc: array<f32, MAX_HEAD_DIM>;
    for (var c = 0u; c < d; c++) {
        qv[c] = q[q_base + c] * p.scale;
        acc[c] = 0.0;
    }
    var end = past + i + 1u;
    if (p.causal == 0u) {
        end = min(past + p.seq, lens[b]);
    }
    end = min(end, p.max_seq);
    var running_max = -3.4e38;
    var denom = 0.0;
    for (var j = first_key(past + i) + lid; j < end; j += SP_WG) {
        let k_base = kv_row(slot, kvh, j);
        var s = 0.0;
        for (var c = 0u; c < d; c++) {
            s += qv[c] * f32(k_cache[k_base + c]);
        }
        let new_max = max(running_max, s);
        let correction = exp(running_max - new_max);
        let weight = exp(s - new_max);
        denom = denom * correction + weight;
        for (var c = 0u; c < d; c++) {
            acc[c] = acc[c] * correction + weight * f32(v_cache[k_base + c]);
        }
        running_max = new_max;
    }
    // Reduction pass: rescale every partial to the common maximum and sum.
    sp_max[lid] = running_max;
    workgroupBarrier();
    var m = -3.4e38;
    for (var r = 0u; r < SP_WG; r++) {
        m = max(m, sp_max[r]);
    }
    let scale = exp(running_max - m);
    sp_den[lid] = denom * scale;
    workgroupBarrier();
    var total = 0.0;
    for (var r = 0u; r < SP_WG; r++) {
        total += sp_den[r];
    }
    let inv = 1.0 / total;
    for (var c0 = 0u; c0 < d; c0 += SP_CHUNK) {
        for (var cc = 0u; cc < SP_CHUNK; cc++) {
            if (c0 + cc < d) {
                sp_acc[lid * SP_CHUNK + cc] = acc[c0 + cc] * scale;
            }
        }
        workgroupBarrier();
        if (lid < SP_CHUNK && c0 + lid < d) {
            var v = 0.0;
            for (var r = 0u; r < SP_WG; r++) {
                v += sp_acc[r * SP_CHUNK + lid];
            }
            if (valid) {
                out[q_base + c0 + lid] = v * inv;
            }
        }
        workgroupBarrier();
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill, flash-style with the head dimension fixed per pipeline: FA_D4 (head_dim / 4) and
// FA_BK (keys per tile) are override constants, so every inner loop has a constant trip count
// that the compiler unrolls and the query and accumulator (vec4 arrays) stay in registers.
// A workgroup of FA_BQ invocations takes FA_BQ consecutive queries of one (sequence, head), one
// query per invocation; the keys its queries see are walked in tiles of FA_BK that the
// workgroup loads once into workgroup memory (neighbouring invocations load neighbouring vec4s
// of a row; every invocation then reads the same element, a broadcast). Per tile each query
// scores the FA_BK keys first, takes the tile's maximum, rescales its accumulator once and then
// adds the weighted values: one exp per key instead of two, and no per-key rescale.
// Grid: [ceil(seq / FA_BQ), n_heads, batch]. head_dim = 4 * FA_D4, FA_BK * FA_D4 <= FA_TILE4.
override FA_D4: u32 = 16u;
override FA_BK: u32 = 16u;
const FA_BQ: u32 = 64u;
const FA_MAXD4: u32 = 32u;
const FA_MAXBK: u32 = 32u;
const FA_TILE4: u32 = 384u;
const FA_NONE: f32 = -3.4e38;
var<workgroup> fa_k: array<vec4<f32>, FA_TILE4>;
var<workgroup> fa_v: array<vec4<f32>, FA_TILE4>;
var<workgroup> fa_span: vec2<u32>;

// Loads keys j0 .. j0 + FA_BK of (slot, KV head) into the tiles (zeros past `end`).
fn fa_load(slot: u32, kvh: u32, j0: u32, end: u32, lid: u32) {
    for (var e = lid; e < FA_BK * FA_D4; e += FA_BQ) {
        let j = j0 + e / FA_D4;
        var kv = vec4<f32>(0.0);
        var vv = vec4<f32>(0.0);
        if (j < end) {
            let at = kv_row(slot, kvh, j) + (e % FA_D4) * 4u;
            kv = vec4<f32>(f32(k_cache[at]), f32(k_cache[at + 1u]), f32(k_cache[at + 2u]),
                f32(k_cache[at + 3u]));
            vv = vec4<f32>(f32(v_cache[at]), f32(v_cache[at + 1u]), f32(v_cache[at + 2u]),
                f32(v_cache[at + 3u]));
        }
        fa_k[e] = kv;
        fa_v[e] = vv;
    }
}

@compute @workgroup_size(FA_BQ)
fn attend_flash(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = wid.z;
    let h = wid.y;
    let i_raw = wid.x * FA_BQ + lid;
    let i = min(i_raw, p.seq - 1u);
    let kvh = (h + p.q_offset) / p.group - p.kv_offset;
    let q_base = ((b * p.seq + i) * p.n_heads + h) * FA_D4 * 4u;
    let slot = min(seqs[2u * b], p.slots - 1u);
    let past = seqs[2u * b + 1u];
    var qv: array<vec4<f32>, FA_MAXD4>;
    var acc: array<vec4<f32>, FA_MAXD4>;
    for (var c = 0u; c < FA_D4; c++) {
        let at = q_base + c * 4u;
        qv[c] = vec4<f32>(q[at], q[at + 1u], q[at + 2u], q[at + 3u]) * p.scale;
        acc[c] = vec4<f32>(0.0);
    }
    // Keys this query sees, and (uniform over the workgroup) the span any of its queries sees.
    var start = first_key(past + i);
    var end = min(past + i + 1u, p.max_seq);
    if (lid == 0u) {
        var wg_end = past + min(p.seq, wid.x * FA_BQ + FA_BQ);
        if (p.causal == 0u) {
            wg_end = min(past + p.seq, lens[b]);
        }
        fa_span = vec2<u32>(first_key(past + wid.x * FA_BQ), min(wg_end, p.max_seq));
    }
    // Read through workgroup memory, so the tile loop (which has barriers) is uniform.
    let span = workgroupUniformLoad(&fa_span);
    if (p.causal == 0u) {
        start = 0u;
        end = span.y;
    }
    var running_max = FA_NONE;
    var denom = 0.0;
    var s: array<f32, FA_MAXBK>;
    for (var j0 = span.x; j0 < span.y; j0 += FA_BK) {
        fa_load(slot, kvh, j0, span.y, lid);
        workgroupBarrier();
        // Tiles wholly outside this query's keys cost it nothing but the barriers.
        if (j0 < end && j0 + FA_BK > start) {
            var tile_max = running_max;
            for (var r = 0u; r < FA_BK; r++) {
                var dv = vec4<f32>(0.0);
                for (var c = 0u; c < FA_D4; c++) {
                    dv = fma(qv[c], fa_k[r * FA_D4 + c], dv);
                }
                let j = j0 + r;
                var sc = FA_NONE;
                if (j >= start && j < end) {
                    sc = dv.x + dv.y + dv.z + dv.w;
                }
                s[r] = sc;
                tile_max = max(tile_max, sc);
            }
            let correction = exp(running_max - tile_max);
            denom *= correction;
            for (var c = 0u; c < FA_D4; c++) {
                acc[c] *= correction;
            }
            for (var r = 0u; r < FA_BK; r++) {
                // A masked key weighs nothing, even while every score so far is masked.
                let w = select(0.0, exp(s[r] - tile_max), s[r] > FA_NONE);
                denom += w;
                for (var c = 0u; c < FA_D4; c++) {
                    acc[c] = fma(vec4<f32>(w), fa_v[r * FA_D4 + c], acc[c]);
                }
            }
            running_max = tile_max;
        }
        workgroupBarrier();
    }
    if (i_raw < p.seq) {
        let inv = 1.0 / denom;
        for (var c = 0u; c < FA_D4; c++) {
            let v = acc[c] * inv;
            let at = q_base + c * 4u;
            out[at] = v.x;
            out[at + 1u] = v.y;
            out[at + 2u] = v.z;
            out[at + 3u] = v.w;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill with four queries per invocation, one in each lane of a vec4: every key or value
// element read feeds four multiply-adds instead of one, so reading the K/V tile stops bounding
// the kernel. F4_D is head_dim (fixed per pipeline, constant trip counts), F4_WG the
// invocations of a workgroup, which takes 4 * F4_WG consecutive queries of one (sequence,
// head): invocation l holds queries l, l + F4_WG, l + 2 F4_WG and l + 3 F4_WG. The keys are
// walked in blocks of four with one max and one rescale per block (the scores of a block are
// four vec4 values, never an indexed array). F4_SHARED = 1 stages tiles of F4_BK keys in
// workgroup memory, loaded once for the workgroup (what a GPU wants); 0 reads each key and
// value straight from the cache at an address the whole workgroup shares (a broadcast, which a
// CPU driver serves faster than workgroup memory). Every query walks the union of the
// workgroup's keys, with no per-query branch, and masks the keys it does not see.
// Grid: [ceil(seq / (4 * F4_WG)), n_heads, batch]. F4_BK: a multiple of 4; F4_TILE =
// F4_BK * F4_D (the workgroup memory of a tile, K and V each).
override F4_D: u32 = 32u;
override F4_WG: u32 = 16u;
override F4_BK: u32 = 4u;
override F4_SHARED: u32 = 0u;
override F4_TILE: u32 = 128u;
const F4_MAXD: u32 = 128u;
var<workgroup> f4_kt: array<f32, F4_TILE>;
var<workgroup> f4_vt: array<f32, F4_TILE>;
// Per invocation: its four queries (pre-scaled) and their accumulators, element c of each in
// the lanes of [c]; the running maxima and denominators; the context of its keys.
var<private> f4_q: array<vec4<f32>, F4_MAXD>;
var<private> f4_acc: array<vec4<f32>, F4_MAXD>;
var<private> f4_m: vec4<f32>;
var<private> f4_l: vec4<f32>;
var<private> f4_first: vec4<u32>;
var<private> f4_end: vec4<u32>;
var<private> f4_slot: u32;
var<private> f4_kvh: u32;
var<private> f4_last: u32;

// Stages keys j0 .. j0 + F4_BK (the last real key `f4_last` repeated past it, masked later) in
// the tiles; each key's row is looked up on its own, so no two keys need be contiguous.
fn f4_load(j0: u32, lid: u32) {
    for (var e = lid; e < F4_BK * F4_D; e += F4_WG) {
        let at = kv_row(f4_slot, f4_kvh, min(j0 + e / F4_D, f4_last)) + e % F4_D;
        f4_kt[e] = f32(k_cache[at]);
        f4_vt[e] = f32(v_cache[at]);
    }
}

// Element c of the key (value) at tile index t, or at cache row `row` when not staged.
fn f4_key(t: u32, row: u32, c: u32) -> f32 {
    if (F4_SHARED != 0u) {
        return f4_kt[t * F4_D + c];
    }
    return f32(k_cache[row + c]);
}

fn f4_value(t: u32, row: u32, c: u32) -> f32 {
    if (F4_SHARED != 0u) {
        return f4_vt[t * F4_D + c];
    }
    return f32(v_cache[row + c]);
}

// The four queries' scores (FA_NONE where a query does not see key j).
fn f4_mask(j: u32, dots: vec4<f32>) -> vec4<f32> {
    let seen = (vec4<u32>(j) >= f4_first) & (vec4<u32>(j) < f4_end);
    return select(vec4<f32>(FA_NONE), dots, seen);
}

fn f4_weight(s: vec4<f32>, mx: vec4<f32>) -> vec4<f32> {
    // A masked key weighs nothing, even while every score so far is masked.
    return select(vec4<f32>(0.0), exp(s - mx), s > vec4<f32>(FA_NONE));
}

// Keys j .. j + 3 (tile indices t .. t + 3) into the four queries' running softmax.
fn f4_block(j: u32, t: u32) {
    let r0 = kv_row(f4_slot, f4_kvh, min(j, f4_last));
    let r1 = kv_row(f4_slot, f4_kvh, min(j + 1u, f4_last));
    let r2 = kv_row(f4_slot, f4_kvh, min(j + 2u, f4_last));
    let r3 = kv_row(f4_slot, f4_kvh, min(j + 3u, f4_last));
    var d0 = vec4<f32>(0.0);
    var d1 = vec4<f32>(0.0);
    var d2 = vec4<f32>(0.0);
    var d3 = vec4<f32>(0.0);
    for (var c = 0u; c < F4_D; c++) {
        let qc = f4_q[c];
        d0 = fma(qc, vec4<f32>(f4_key(t, r0, c)), d0);
        d1 = fma(qc, vec4<f32>(f4_key(t + 1u, r1, c)), d1);
        d2 = fma(qc, vec4<f32>(f4_key(t + 2u, r2, c)), d2);
        d3 = fma(qc, vec4<f32>(f4_key(t + 3u, r3, c)), d3);
    }
    let s0 = f4_mask(j, d0);
    let s1 = f4_mask(j + 1u, d1);
    let s2 = f4_mask(j + 2u, d2);
    let s3 = f4_mask(j + 3u, d3);
    let mx = max(max(f4_m, max(s0, s1)), max(s2, s3));
    let correction = exp(f4_m - mx);
    let w0 = f4_weight(s0, mx);
    let w1 = f4_weight(s1, mx);
    let w2 = f4_weight(s2, mx);
    let w3 = f4_weight(s3, mx);
    f4_l = f4_l * correction + ((w0 + w1) + (w2 + w3));
    for (var c = 0u; c < F4_D; c++) {
        var a = f4_acc[c] * correction;
        a = fma(w0, vec4<f32>(f4_value(t, r0, c)), a);
        a = fma(w1, vec4<f32>(f4_value(t + 1u, r1, c)), a);
        a = fma(w2, vec4<f32>(f4_value(t + 2u, r2, c)), a);
        a = fma(w3, vec4<f32>(f4_value(t + 3u, r3, c)), a);
        f4_acc[c] = a;
    }
    f4_m = mx;
}

// Query `lane` of this invocation, token i (i_raw before clamping to the sequence): its
// scaled elements into lane `lane` of f4_q and the keys it sees into f4_first / f4_end.
fn f4_query(lane: u32, b: u32, h: u32, i_raw: u32, past: u32, end: u32) {
    let i = min(i_raw, p.seq - 1u);
    let at = ((b * p.seq + i) * p.n_heads + h) * F4_D;
    for (var c = 0u; c < F4_D; c++) {
        f4_q[c][lane] = q[at + c] * p.scale;
        f4_acc[c][lane] = 0.0;
    }
    if (p.causal != 0u) {
        f4_first[lane] = first_key(past + i);
        f4_end[lane] = min(past + i + 1u, p.max_seq);
    } else {
        f4_first[lane] = 0u;
        f4_end[lane] = end;
    }
}

// Writes query `lane`'s output, if token i_raw is in the sequence.
fn f4_store(lane: u32, b: u32, h: u32, i_raw: u32) {
    if (i_raw < p.seq) {
        let at = ((b * p.seq + i_raw) * p.n_heads + h) * F4_D;
        let inv = 1.0 / f4_l[lane];
        for (var c = 0u; c < F4_D; c++) {
            out[at + c] = f4_acc[c][lane] * inv;
        }
    }
}

@compute @workgroup_size(F4_WG)
fn attend_flash4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = wid.z;
    let h = wid.y;
    let q0 = wid.x * 4u * F4_WG;
    let past = seqs[2u * b + 1u];
    f4_slot = min(seqs[2u * b], p.slots - 1u);
    f4_kvh = (h + p.q_offset) / p.group - p.kv_offset;
    // The keys any of the workgroup's queries sees (uniform: from the workgroup id, the
    // parameters and the read-only sequence table).
    var hi = past + min(p.seq, q0 + 4u * F4_WG);
    if (p.causal == 0u) {
        hi = min(past + p.seq, lens[b]);
    }
    let span = vec2<u32>(first_key(past + q0), min(hi, p.max_seq));
    f4_last = span.y - 1u;
    for (var lane = 0u; lane < 4u; lane++) {
        f4_query(lane, b, h, q0 + lane * F4_WG + lid, past, span.y);
    }
    f4_m = vec4<f32>(FA_NONE);
    f4_l = vec4<f32>(0.0);
    for (var j0 = span.x; j0 < span.y; j0 += F4_BK) {
        if (F4_SHARED != 0u) {
            f4_load(j0, lid);
            workgroupBarrier();
        }
        for (var t = 0u; t < F4_BK && j0 + t < span.y; t += 4u) {
            f4_block(j0 + t, t);
        }
        if (F4_SHARED != 0u) {
            workgroupBarrier();
        }
    }
    for (var lane = 0u; lane < 4u; lane++) {
        f4_store(lane, b, h, q0 + lane * F4_WG + lid);
    }
}
