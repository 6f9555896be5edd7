// What the two embedding lookups share (embedding.wgsl from a dense token table,
// embedding_quant.wgsl from one in ggml blocks): the parameters, every binding but the token
// table's (binding 1, which each declares in its own type), and the learned positions and
// token types added to a token's row. The host appends this file to each.
// Token t = b * seq + i sits at position pos = seqs[2b + 1] + i, read from the step's sequence
// table ([batch][2] = (KV slot, past)), validated on the host and clamped to wpe here.
// The table may be one block of rows (first_row .. first_row + rows, when the whole table
// exceeds a storage binding): a lookup then writes only the tokens whose id is in its block,
// and one lookup per block writes every token once.

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
@group(0) @binding(2) var<storage, read> wpe: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> types: array<u32>;
@group(0) @binding(5) var<storage, read> wtt: array<f32>;
@group(0) @binding(6) var<storage, read> seqs: array<u32>;
@group(0) @binding(7) var<uniform> p: Params;

// The row of the table token t reads, or -1 when its id is outside this block.
fn table_row(t: u32) -> i32 {
    let id = ids[t];
    if (id < p.first_row || id - p.first_row >= p.rows) {
        return -1;
    }
    return i32(id - p.first_row);
}

// What learned positions and token types add to column c of token t's row.
fn extras(t: u32, c: u32) -> f32 {
    var v = 0.0;
    if (p.has_positions != 0u) {
        let pos = min(seqs[2u * (t / p.seq) + 1u] + t % p.seq, p.positions - 1u);
        v += wpe[pos * p.hidden + c];
    }
    if (p.has_types != 0u) {
        v += wtt[types[t] * p.hidden + c];
    }
    return v;
}
