// Embedding lookup from a token table held in ggml blocks (a GGUF's token_embd as stored):
// out[t][c] = dequant(w)[token[t]][c] (+ positions) (+ token types), as embedding.wgsl computes
// it from a dense table, with the same bindings and parameters (embedding_common.wgsl). The
// block readers are in quant_blocks.wgsl; the host appends both. QTYPE selects the type (one
// pipeline each). One invocation per 16 values of a token's row: they share one scale and
// offset, so each invocation reads its chunk's scale once and writes 16 values.

@group(0) @binding(1) var<storage, read> w: array<u32>;

const QE_WG: u32 = 64u;

@compute @workgroup_size(QE_WG)
fn qembed(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let chunks = p.hidden / 16u;
    let idx = (wid.y * nwg.x + wid.x) * QE_WG + lid;
    if (idx >= p.tokens * chunks) {
        return;
    }
    let t = idx / chunks;
    let ci = idx % chunks;
    let row = table_row(t);
    if (row < 0) {
        return;
    }
    let per_block = block_len() / 16u;
    let row_bytes = (p.hidden / block_len()) * block_bytes();
    let a = u32(row) * row_bytes + (ci / per_block) * block_bytes();
    let c = ci % per_block;
    let s = chunk_scale(a, c);
    for (var j = 0u; j < 16u; j++) {
        let col = ci * 16u + j;
        out[t * p.hidden + col] = s.x * chunk_q(a, c, j) - s.y + extras(t, col);
    }
}
