// matvec_sums.wgsl: the last step of the subgroup mat-vecs
// (matvec_subgroup.wgsl, matvec_q8.wgsl; included after matmul_io.wgsl, see
// src/shaders.rs), which declare `partial` (one slot per subgroup and row,
// subgroup s, row i at s * ROWS + i), ROWS and ROWS_MAX.
//
// Each subgroup sums its lanes' partial sums of each row with subgroupAdd,
// one value per row and subgroup goes through workgroup memory, and lane i
// of the workgroup stores row r0 + i. Every lane calls it (a barrier).

fn store_row_sums(acc: array<f32, ROWS_MAX>, r0: u32, lane: u32, sg: u32, n_sg: u32, sg_lane: u32) {
    for (var i = 0u; i < ROWS; i++) {
        let s = subgroupAdd(acc[i]);
        if (sg_lane == 0u) {
            partial[sg * ROWS + i] = s;
        }
    }
    workgroupBarrier();
    if (lane < ROWS && r0 + lane < p.rows) {
        var total = 0.0;
        for (var i = 0u; i < n_sg; i++) {
            total += partial[i * ROWS + lane];
        }
        store(0u, r0 + lane, total);
    }
}
