// Element-wise ops on a (rows x cols) f32 tensor `a`, in place, with an optional second operand
// and a scalar (scale, soft-cap).
struct Params {
    len: u32,
    cols: u32,
    scalar: f32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

const WG: u32 = 256u;

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}

// Residual connection: a += b.
@compute @workgroup_size(WG)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.len) {
        a[i] += b[i];
    }
}

// Row-broadcast bias: a[r][c] += b[c] (added once, after a row-parallel all-reduce).
@compute @workgroup_size(WG)
fn bias_add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.len) {
        a[i] += b[i % p.cols];
    }
}

// tanh via exp, clamped so exp never overflows (tanh(15) is 1 in f32).
fn tanh_clamped(x: f32) -> f32 {
    let e = exp(-2.0 * clamp(x, -15.0, 15.0));
    return (1.0 - e) / (1.0 + e);
}

fn gelu_tanh(v: f32) -> f32 {
    return 0.5 * v * (1.0 + tanh_clamped(0.7978845608028654 * (v + 0.044715 * v * v * v)));
}

// GELU, tanh approximation (GPT-2's "gelu_new").
@compute @workgroup_size(WG)
fn gelu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.len) {
        a[i] = gelu_tanh(a[i]);
    }
}

// GeGLU: a = gelu_tanh(a) * b, with a the gate projection and b the up projection (Gemma).
@compute @workgroup_size(WG)
fn geglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.len) {
        a[i] = gelu_tanh(a[i]) * b[i];
    }
}

// a *= scalar (Gemma's embedding scale).
@compute @workgroup_size(WG)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.len) {
        a[i] = a[i] * p.scalar;
    }
}

// Soft-capping: a = scalar * tanh(a / scalar) (Gemma's final logits).
@compute @workgroup_size(WG)
fn softcap(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.len) {
        a[i] = p.scalar * tanh_clamped(a[i] / p.scalar);
    }
}

// GELU, exact erf form (BERT). erf from Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7).
@compute @workgroup_size(WG)
fn gelu_erf(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.len) {
        let v = a[i];
        let z = abs(v) * 0.7071067811865476;
        let t = 1.0 / (1.0 + 0.3275911 * z);
        let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
        let erf_abs = 1.0 - poly * exp(-z * z);
        let erf_v = select(-erf_abs, erf_abs, v >= 0.0);
        a[i] = 0.5 * v * (1.0 + erf_v);
    }
}

// SwiGLU: a = silu(a) * b, with a the gate projection and b the up projection.
@compute @workgroup_size(WG)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wid, nwg, lid);
    if (i < p.len) {
        let g = a[i];
        a[i] = g / (1.0 + exp(-g)) * b[i];
    }
}
