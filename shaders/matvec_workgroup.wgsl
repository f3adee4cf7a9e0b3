// matvec_workgroup.wgsl: the `gpu` mat-vec for one token (decode) without
// subgroup operations: y (+)= W x (+ bias) (needs a weight-format prelude;
// matmul_io.wgsl has the shared parameters, bindings and store;
// matvec_rows.wgsl the lane loop). The `cpu`
// variant gives each lane four whole rows, which leaves a large GPU mostly
// idle (a 4,096-row matrix is 1,024 lanes).
//
// A workgroup of LANES lanes takes ROWS rows (override constants, 128 and 2
// unless timings chose others; matvec_rows.wgsl). Lane i reads the packed
// weights k = i, i + LANES, ... of each row, so the lanes of a subgroup read
// one contiguous run of memory per load; each load of x serves all ROWS
// rows, and the loop keeps two loads per row in flight. The LANES partial sums of each row are then
// reduced in workgroup memory (matvec_subgroup.wgsl: with subgroup sums).
//
// Bindings (group 0): as matmul_io.wgsl, with
//   2 w     storage read  [rows, k] weights (declared by the format prelude)
// Token: the step's single row (n = 1). Takes a fused RMSNorm (flags bit 2)
// or a fused SwiGLU (flags bit 3; x is then [2k/4], gate then up).
// Dispatch: (min(groups, 32768), ceil(groups / 32768), 1), groups =
// ceil(rows / ROWS); workgroup g = id.x + id.y * 32768 takes rows ROWS * g ..
// ROWS * g + ROWS - 1.

// Row i's partial sum of lane l at i * LANES + l (sized by the override
// constants, so that small shapes keep workgroup memory free).
var<workgroup> partial: array<f32, LANES * ROWS>;

// With a fused norm (flags bit 2): 1 / rms of x, summed by all lanes and
// reduced in workgroup memory; 1 otherwise.
fn row_inv_rms(lane: u32) -> f32 {
    if (!fused_norm()) {
        return 1.0;
    }
    var ss = 0.0;
    for (var k = lane; k < bounded(p.k4); k += LANES) {
        let v = x_raw(k);
        ss += dot(v, v);
    }
    partial[lane] = ss;
    workgroupBarrier();
    for (var span = LANES / 2u; span > 0u; span /= 2u) {
        if (lane < span) {
            partial[lane] += partial[lane + span];
        }
        workgroupBarrier();
    }
    let inv = inv_rms(partial[0]);
    workgroupBarrier();
    return inv;
}

@compute @workgroup_size(LANES)
fn matvec(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let r0 = (wg.x + wg.y * 32768u) * ROWS;
    if (r0 >= p.rows || step_rows(step, p.count_sel) == 0u) {
        return;
    }
    let inv = row_inv_rms(lane);
    let acc = lane_sums(r0, lane, inv);
    for (var i = 0u; i < ROWS; i++) {
        partial[i * LANES + lane] = acc[i];
    }
    workgroupBarrier();
    for (var span = LANES / 2u; span > 0u; span /= 2u) {
        if (lane < span) {
            for (var i = 0u; i < ROWS; i++) {
                partial[i * LANES + lane] += partial[i * LANES + lane + span];
            }
        }
        workgroupBarrier();
    }
    if (lane < ROWS && r0 + lane < p.rows) {
        store(0u, r0 + lane, partial[lane * LANES]);
    }
}
