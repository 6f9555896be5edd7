// Bandwidth probe: dst = src, one vec4 per invocation. The kernel benchmark's roofline divides
// every matmul's weight bandwidth by this copy's rate (bytes read + written over time): what
// the adapter attains from a kernel, on the same run.
struct Params {
    len: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;
@group(0) @binding(2) var<uniform> p: Params;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn copy_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    if (i < p.len) {
        dst[i] = src[i];
    }
}
