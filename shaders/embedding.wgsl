// Embedding lookup from a dense token table: out[t][c] = wte[token[t]][c] (+ wpe[pos][c] for
// learned positions) (+ wtt[types[t]][c] for token types, BERT). Ids and types are validated
// on the host first. The parameters, the other bindings and the positions and types are in
// embedding_common.wgsl, appended by the host.
alias WT = f32;

@group(0) @binding(1) var<storage, read> wte: array<WT>;

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
    let row = table_row(t);
    if (row < 0) {
        return;
    }
    out[idx] = f32(wte[u32(row) * p.hidden + c]) + extras(t, c);
}
