// matvec_subgroup.wgsl: the `gpu` mat-vec for one token (decode) on devices
// with subgroup operations: y (+)= W x (+ bias) (needs a weight-format
// prelude; matmul_io.wgsl has the shared parameters, bindings and store;
// matvec_rows.wgsl the lane loop).
//
// The same work split as matvec_workgroup.wgsl (a workgroup of LANES lanes
// per ROWS rows, coalesced loads along K, two loads per row in flight), but each
// subgroup sums its lanes with subgroupAdd and only one value per row and
// subgroup goes through workgroup memory: one barrier instead of eight
// (matvec_sums.wgsl).
//
// Bindings (group 0): as matmul_io.wgsl, with
//   2 w     storage read  [rows, k] weights (declared by the format prelude)
// Token: the step's single row (n = 1). Takes a fused RMSNorm (flags bit 2)
// or a fused SwiGLU (flags bit 3; x is then [2k/4], gate then up).
// Dispatch: (min(groups, 32768), ceil(groups / 32768), 1), groups =
// ceil(rows / ROWS); workgroup g = id.x + id.y * 32768 takes rows ROWS * g ..
// ROWS * g + ROWS - 1 (LANES and ROWS: override constants, matvec_rows.wgsl).
// Built with matmul_x16.wgsl in place of matmul_x.wgsl (`HalfX`,
// src/shaders.rs MATVEC_SUBGROUP_X16) it reads x in f16 at binding 4, which
// x_half.wgsl wrote with the norm or SwiGLU applied, and has no binding 6.
// Extensions: `subgroups` (wgpu's SUBGROUP feature; the device refuses the
// module without it). naga does not parse that `enable`: the assembler
// blanks it for naga (`shaders::naga_source`) and keeps it for Tint.

enable subgroups;

// One slot per subgroup and row (subgroup s, row i at s * ROWS + i); LANES
// subgroups cover any subgroup size. Sized by the override constants, so
// that small shapes keep workgroup memory free for more workgroups.
var<workgroup> partial: array<f32, LANES * ROWS>;

// With a fused norm (flags bit 2): 1 / rms of x, summed by all lanes with
// subgroup sums; 1 otherwise.
fn row_inv_rms(lane: u32, sg: u32, n_sg: u32, sg_lane: u32) -> f32 {
    if (!fused_norm()) {
        return 1.0;
    }
    var ss = 0.0;
    for (var k = lane; k < bounded(p.k4); k += LANES) {
        let v = x_raw(k);
        ss += dot(v, v);
    }
    let s = subgroupAdd(ss);
    if (sg_lane == 0u) {
        partial[sg * ROWS] = s;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < n_sg; i++) {
        total += partial[i * ROWS];
    }
    workgroupBarrier();
    return inv_rms(total);
}

@compute @workgroup_size(LANES)
fn matvec(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) n_sg: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let r0 = (wg.x + wg.y * 32768u) * ROWS;
    if (r0 >= p.rows || step_rows(step, p.count_sel) == 0u) {
        return;
    }
    let inv = row_inv_rms(lane, sg, n_sg, sg_lane);
    let acc = lane_sums(r0, lane, inv);
    store_row_sums(acc, r0, lane, sg, n_sg, sg_lane);
}
