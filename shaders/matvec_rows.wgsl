// matvec_rows.wgsl: the lane loop both `gpu` mat-vecs share (included after
// matmul_io.wgsl by matvec_workgroup.wgsl and matvec_subgroup.wgsl, which
// declare LANES; the weights come from the format prelude's `weight4`).
//
// This lane's partial sums of rows r0 and r0 + 1 (clamped to the part) of
// W x: packed words k = lane, lane + LANES, ..., two loads per row in flight
// per iteration, adjacent lanes reading adjacent words; x scaled by `inv`
// and the norm weights when the norm is fused.
fn lane_sums(r0: u32, lane: u32, inv: f32) -> vec2<f32> {
    let w0 = r0 * p.k4;
    let w1 = min(r0 + 1u, p.rows - 1u) * p.k4;
    var acc = vec2<f32>(0.0);
    var k = lane;
    for (; k + LANES < p.k4; k += 2u * LANES) {
        let xa = x_normed(k, inv);
        let xb = x_normed(k + LANES, inv);
        acc += vec2<f32>(dot(weight4(w0 + k), xa), dot(weight4(w1 + k), xa));
        acc += vec2<f32>(
            dot(weight4(w0 + k + LANES), xb),
            dot(weight4(w1 + k + LANES), xb),
        );
    }
    if (k < p.k4) {
        let xa = x_normed(k, inv);
        acc += vec2<f32>(dot(weight4(w0 + k), xa), dot(weight4(w1 + k), xa));
    }
    return acc;
}
