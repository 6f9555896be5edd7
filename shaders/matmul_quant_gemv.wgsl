// Decode GEMV on packed weights, block-wise (the layout is described in
// quant_gemv_common.wgsl, appended with quant_blocks.wgsl): the QV_TPR partial sums of a row
// group meet in workgroup memory, a tree of log2(QV_TPR) steps per row of x; with QV_TPR = 1
// there is nothing to reduce and each invocation stores its own sums.

// QV_WG is at most 256.
var<workgroup> qv_red: array<vec4<f32>, 256>;

@compute @workgroup_size(QV_WG)
fn qgemv_wg(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let at = qv_place(wid, nwg, lid);
    for (var r = 0u; r < QV_ROWS; r++) {
        if (r >= p.m) {
            break;
        }
        var v = qv_row(at.x, at.y, r);
        if (QV_TPR > 1u) {
            qv_red[lid] = v;
            workgroupBarrier();
            for (var s = QV_TPR / 2u; s > 0u; s >>= 1u) {
                if (at.y < s) {
                    qv_red[lid] += qv_red[lid + s];
                }
                workgroupBarrier();
            }
            v = qv_red[lid];
            workgroupBarrier();
        }
        if (at.y == 0u) {
            qv_store(at.x, r, v);
        }
    }
}
