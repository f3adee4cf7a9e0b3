// matmul_tiled.wgsl: the `gpu` mat-mul for several tokens (prefill) without
// cooperative matrices: y (+)= W x (+ bias) (needs a weight-format prelude;
// matmul_io.wgsl has the shared parameters, bindings and store).
//
// A workgroup of 256 lanes computes a 64-row x 64-token tile of y. K is walked
// 16 values at a time: each lane loads one packed word of W and one vec4 of x
// (coalesced along K), the tile slices go to workgroup memory transposed
// ([k][4 rows] and [k][4 tokens] as vec4), and each lane then accumulates a
// 4-row x 4-token block with two 16-byte workgroup loads per 16 FMAs. Each
// weight is read from memory once per 64 tokens (the `cpu` variant: once per
// 4 tokens).
//
// Bindings (group 0): as matmul_io.wgsl, with
//   2 w     storage read  [rows, k] weights (declared by the format prelude)
// Dispatch: (ceil(rows / 64), ceil(n / 64), 1).

// [16 k][16 groups of 4 rows] and [16 k][16 groups of 4 tokens].
var<workgroup> w_tile: array<vec4<f32>, 256>;
var<workgroup> x_tile: array<vec4<f32>, 256>;

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let n = step_rows(step, p.count_sel);
    let row0 = wg.x * 64u;
    let tok0 = wg.y * 64u;
    if (row0 >= p.rows || tok0 >= n) {
        return;
    }
    // Loading: lane = 4 * (row or token within the tile) + (vec4 within the 16 values).
    let load_i = lane / 4u;
    let load_k = lane % 4u;
    // Out-of-range rows and tokens read valid ones; their results are not stored.
    let w_base = min(row0 + load_i, p.rows - 1u) * p.k4;
    let x_base = min(tok0 + load_i, n - 1u) * p.k4;
    // Computing: rows row0 + 4 * rg .. + 4, tokens tok0 + 4 * tg .. + 4.
    let rg = lane % 16u;
    let tg = lane / 16u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < p.k4; k0 += 4u) {
        let k = k0 + load_k;
        var wv = vec4<f32>(0.0);
        var xv = vec4<f32>(0.0);
        if (k < p.k4) {
            wv = weight4(w_base + k);
            xv = x[x_base + k];
        }
        let slot = load_k * 64u + load_i / 4u;
        let comp = load_i % 4u;
        for (var c = 0u; c < 4u; c++) {
            w_tile[slot + c * 16u][comp] = wv[c];
            x_tile[slot + c * 16u][comp] = xv[c];
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            let a = w_tile[kk * 16u + rg];
            let b = x_tile[kk * 16u + tg];
            acc0 += a * b.x;
            acc1 += a * b.y;
            acc2 += a * b.z;
            acc3 += a * b.w;
        }
        workgroupBarrier();
    }
    let acc = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var j = 0u; j < 4u; j++) {
        let t = tok0 + tg * 4u + j;
        for (var i = 0u; i < 4u; i++) {
            let r = row0 + rg * 4u + i;
            if (t < n && r < p.rows) {
                store(t, r, acc[j][i]);
            }
        }
    }
}
