// Embedding lookup: out[t][c] = wte[token[t]][c] (+ wpe[pos][c] for learned positions)
// (+ wtt[types[t]][c] for token types, BERT). Ids and types are validated on the host first.
// Token t = b * seq + i sits at position pos = seqs[2b + 1] + i, read from the step's sequence
// table ([batch][2] = (KV slot, past)), validated on the host and clamped to wpe here.
// wte may be one block of the table (rows first_row .. first_row + rows, when the whole table
// exceeds a storage binding): a lookup then writes only the tokens whose id is in its block, and
// one lookup per block writes every token once.
alias WT = f32;

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
@group(0) @binding(1) var<storage, read> wte: array<WT>;
@group(0) @binding(2) var<storage, read> wpe: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> types: array<u32>;
@group(0) @binding(5) var<storage, read> wtt: array<f32>;
@group(0) @binding(6) var<storage, read> seqs: array<u32>;
@group(0) @binding(7) var<uniform> p: Params;

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
    let id = ids[t];
    if (id < p.first_row || id - p.first_row >= p.rows) {
        return;
    }
    var v = f32(wte[(id - p.first_row) * p.hidden + c]);
    if (p.has_positions != 0u) {
        let pos = min(seqs[2u * (t / p.seq) + 1u] + t % p.seq, p.positions - 1u);
        v += wpe[pos * p.hidden + c];
    }
    if (p.has_types != 0u) {
        v += wtt[types[t] * p.hidden + c];
    }
    out[idx] = v;
}
