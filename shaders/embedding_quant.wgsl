// Embedding lookup from a token table held in ggml blocks (a GGUF's token_embd as stored):
// out[t][c] = dequant(w)[token[t]][c] (+ wpe[pos][c]) (+ wtt[types[t]][c]), as embedding.wgsl
// computes it from a dense table, with the same bindings and parameters. The block readers
// are in quant_blocks.wgsl, appended by the host; QTYPE selects the type (one pipeline each).
// One invocation per 16 values of a token's row: they share one scale and offset, so each
// invocation reads its chunk's scale once and writes 16 values.
// w may be one block of the table (rows first_row .. first_row + rows): a lookup then writes
// only the tokens whose id is in its block, and one lookup per block writes every token once.

struct Params {
    tokens: u32,
    hidden: u32,
    seq: u32,
    // Rows of wpe.
    positions: u32,
    has_positions: u32,
    has_types: u32,
    first_row: u32,
    rows: u32,
}

@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wpe: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> types: array<u32>;
@group(0) @binding(5) var<storage, read> wtt: array<f32>;
@group(0) @binding(6) var<storage, read> seqs: array<u32>;
@group(0) @binding(7) var<uniform> p: Params;

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
    let id = ids[t];
    if (id < p.first_row || id - p.first_row >= p.rows) {
        return;
    }
    let per_block = block_len() / 16u;
    let row_bytes = (p.hidden / block_len()) * block_bytes();
    let a = (id - p.first_row) * row_bytes + (ci / per_block) * block_bytes();
    let c = ci % per_block;
    let s = chunk_scale(a, c);
    var pos = 0u;
    if (p.has_positions != 0u) {
        pos = min(seqs[2u * (t / p.seq) + 1u] + t % p.seq, p.positions - 1u);
    }
    let base = t * p.hidden + ci * 16u;
    for (var j = 0u; j < 16u; j++) {
        let col = ci * 16u + j;
        var v = s.x * chunk_q(a, c, j) - s.y;
        if (p.has_positions != 0u) {
            v += wpe[pos * p.hidden + col];
        }
        if (p.has_types != 0u) {
            v += wtt[types[t] * p.hidden + col];
        }
        out[base + j] = v;
    }
}
