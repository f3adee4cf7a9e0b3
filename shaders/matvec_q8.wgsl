// matvec_q8.wgsl: the integer-dot mat-vec for one token (decode) with
// weights in a block format: y (+)= W x (+ bias), where x arrives as q8
// blocks (quantize_q8.wgsl writes them once per token) and each block's
// products are 4 x 8-bit packed dot products (`dot4I8Packed`: one
// instruction where the device has integer dot products, an emulation
// where not), scaled once per block: llama.cpp's mul_mat_vecq. The f32
// mat-vecs (matvec_subgroup.wgsl) convert every weight to f32 instead.
// Needs a block-format prelude (its `dot32_q8`; matmul_io.wgsl has the
// shared parameters, bias, output and store).
//
// A workgroup of LANES lanes (32, 64 or 128: override constants set by the
// launcher) takes ROWS consecutive rows (1 to 8). Lane i takes the blocks
// b = i, i + LANES, ... of each row: adjacent lanes read adjacent blocks of
// weights and of x, and each block of x (48 bytes) serves all ROWS rows.
// Each subgroup sums its lanes with subgroupAdd; one value per row and
// subgroup goes through workgroup memory (matvec_sums.wgsl).
//
// Bindings (group 0): as matmul_io.wgsl, with
//   2 w     storage read  [rows, k] weights (declared by the format prelude)
//   4 xq    storage read  [1, k / 32, 3] vec4<u32>: x's q8 blocks
//                         (quantize_q8.wgsl's layout)
// and no binding 6 (the norm or SwiGLU is folded into the quantization).
// Token: the step's single row (n = 1); flags bits 2 and 3 are ignored.
// Dispatch: (min(groups, 32768), ceil(groups / 32768), 1), groups =
// ceil(rows / ROWS); workgroup g = id.x + id.y * 32768 takes rows ROWS * g ..
// ROWS * g + ROWS - 1.
// Extensions: `subgroups` (wgpu's SUBGROUP feature; naga does not parse the
// `enable`: `shaders::naga_source` blanks it for naga and keeps it for
// Tint); the language extension packed_4x8_integer_dot_product (core in
// naga and Tint, nothing to enable).

enable subgroups;

@group(0) @binding(4) var<storage, read> xq: array<vec4<u32>>;

override LANES: u32 = 32u;
override ROWS: u32 = 2u;
// The largest ROWS: the size of the per-lane accumulators.
const ROWS_MAX: u32 = 8u;

// One slot per subgroup and row (subgroup s, row i at s * ROWS + i).
var<workgroup> partial: array<f32, LANES * ROWS>;

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
    // Rows past the part's last are computed on its last row (clamped, so
    // that the loads need no branch) and not stored.
    var starts: array<u32, ROWS_MAX>;
    for (var i = 0u; i < ROWS; i++) {
        starts[i] = w_row(min(r0 + i, p.rows - 1u), p.k4);
    }
    var acc: array<f32, ROWS_MAX>;
    let blocks = p.k4 / 8u;
    for (var b = lane; b < bounded(blocks); b += LANES) {
        let xa = xq[3u * b];
        let xb = xq[3u * b + 1u];
        let ds = bitcast<vec4<f32>>(xq[3u * b + 2u]);
        for (var i = 0u; i < ROWS; i++) {
            acc[i] += dot32_q8(starts[i] + 8u * b, xa, xb, ds);
        }
    }
    store_row_sums(acc, r0, lane, sg, n_sg, sg_lane);
}
