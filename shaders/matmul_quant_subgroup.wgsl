// Decode GEMV on packed weights with subgroup reductions (the layout is described in
// quant_gemv_common.wgsl, appended with quant_blocks.wgsl), one row group per workgroup
// (QV_TPR = QV_WG): each subgroup sums its partials with `subgroupAdd`, and one value per
// subgroup and row goes through workgroup memory. Compiled only where the device has
// `Features::SUBGROUP` (requested, as for matmul_subgroup.wgsl).

// Up to 64 subgroups per workgroup (256 invocations in subgroups of 4 or more).
const QV_MAX_SUBGROUPS: u32 = 64u;
var<workgroup> qv_part: array<vec4<f32>, 512>;

@compute @workgroup_size(QV_WG)
fn qgemv_sg(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
) {
    let at = qv_place(wid, nwg, lid);
    for (var r = 0u; r < QV_ROWS; r++) {
        if (r < p.m) {
            let s = subgroupAdd(qv_row(at.x, at.y, r));
            if (lane == 0u && sg < QV_MAX_SUBGROUPS) {
                qv_part[r * QV_MAX_SUBGROUPS + sg] = s;
            }
        }
    }
    workgroupBarrier();
    // Invocation r finishes row r.
    if (lid < p.m) {
        var total = vec4<f32>(0.0);
        for (var i = 0u; i < min(nsg, QV_MAX_SUBGROUPS); i++) {
            total += qv_part[lid * QV_MAX_SUBGROUPS + i];
        }
        qv_store(at.x, lid, total);
    }
}
