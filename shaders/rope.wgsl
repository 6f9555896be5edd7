// Rotary position embedding in place, "rotate half" convention over the first rot_dim values of
// each head (pairs c and c + rot_dim / 2); the rest of the head passes untouched (partial
// rotary, Phi-4-mini: rot_dim = 0.75 head_dim; rot_dim = head_dim otherwise).
// cos and sin are host-computed tables [positions][rot_dim / 2]: exact at every position, and
// no large-argument trigonometry on the GPU.
// x:    [tokens = batch * seq][n_heads * head_dim]; token t = b * seq + i
// seqs: the step's sequence table, [batch][2] = (KV slot, past); token (b, i) sits at position
//       seqs[2b + 1] + i (checked against the tables on the host; clamped here regardless).
struct Params {
    tokens: u32,
    seq: u32,
    // Rows of the cos/sin tables.
    positions: u32,
    n_heads: u32,
    head_dim: u32,
    // Rotated values per head (even, at most head_dim).
    rot_dim: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> cos_table: array<f32>;
@group(0) @binding(2) var<storage, read> sin_table: array<f32>;
@group(0) @binding(3) var<storage, read> seqs: array<u32>;
@group(0) @binding(4) var<uniform> p: Params;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn rope(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let idx = (wid.y * nwg.x + wid.x) * WG + lid;
    let half_dim = p.rot_dim / 2u;
    if (idx >= p.tokens * p.n_heads * half_dim) {
        return;
    }
    let c = idx % half_dim;
    let th = idx / half_dim;
    let t = th / p.n_heads;
    let h = th % p.n_heads;
    let pos = min(seqs[2u * (t / p.seq) + 1u] + t % p.seq, p.positions - 1u);
    let base = (t * p.n_heads + h) * p.head_dim;
    let cs = cos_table[pos * half_dim + c];
    let sn = sin_table[pos * half_dim + c];
    let a = x[base + c];
    let b = x[base + c + half_dim];
    x[base + c] = a * cs - b * sn;
    x[base + c + half_dim] = b * cs + a * sn;
}
