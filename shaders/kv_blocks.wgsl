// KV addressing shared by attention.wgsl and kvcache.wgsl (appended to each; both declare
// `kv_blocks` and a `Params` with slots, n_kv_heads, head_dim, max_seq and ring).
// A ring layer (ring > 0, a sliding-window layer's cache) holds `ring` rows per slot and
// head, position `pos` at row pos % ring, and reads no block table: each slot owns its ring.
// Positions per KV block: the cache is a pool of physical blocks, block `b = s * bps + j`
// (bps = ceil(max_seq / KV_BLOCK) blocks per slot region) holding positions
// KV_BLOCK * j .. KV_BLOCK * (j + 1) of slot region s, every head. kv_blocks[slot * bps + j] is
// the physical block of slot `slot`'s logical block j (the identity table, s * bps + j, is the
// contiguous layout). Validated on the host; clamped to the pool here regardless.
const KV_BLOCK: u32 = 16u;

// Element index of the first value of position `pos` of KV head `kvh` (local) of `slot`.
fn kv_row(slot: u32, kvh: u32, pos: u32) -> u32 {
    if (p.ring != 0u) {
        return ((min(slot, p.slots - 1u) * p.n_kv_heads + kvh) * p.ring + pos % p.ring) * p.head_dim;
    }
    let bps = (p.max_seq + KV_BLOCK - 1u) / KV_BLOCK;
    let block = min(kv_blocks[slot * bps + pos / KV_BLOCK], p.slots * bps - 1u);
    let at = (block % bps) * KV_BLOCK + pos % KV_BLOCK;
    return (((block / bps) * p.n_kv_heads + kvh) * p.max_seq + at) * p.head_dim;
}
