// matmul_tiled.wgsl: the `gpu` mat-mul for several tokens (prefill) without
// cooperative matrices: y (+)= W x (+ bias) (needs a weight-format prelude;
// matmul_io.wgsl has the shared parameters, bindings and store).
//
// A workgroup of 256 lanes (a 16 x 16 grid) computes a tile of 64 * WIDE
// rows x 64 * WIDE tokens of y; each lane a block of 4 * WIDE rows x 4 * WIDE
// tokens. WIDE is an override constant set by the launcher: 1 (`Tiled`: 64 x
// 64 tiles, 4 x 4 per lane, 16 FMAs per two 16-byte workgroup loads) or 2
// (`TiledWide`: 128 x 128 tiles, 8 x 8 per lane, 64 FMAs per four loads:
// twice the arithmetic per load and each weight read from memory once per
// 128 tokens, but a quarter of the workgroups, so fewer to fill a large
// device with; `--kernels tuned` times both). The lane's rows are WIDE
// groups of 4, 64 rows apart (and its tokens likewise), so that the 16 lanes
// reading one row of the workgroup tile read 16 adjacent vec4s.
//
// K is walked 16 values at a time: each lane loads WIDE packed words of W and
// WIDE vec4s of x (coalesced along K) into registers, stores them to
// workgroup memory transposed ([k][groups of 4 rows] and [k][groups of 4
// tokens] as vec4), and loads the next slice from memory while it multiplies
// the current one (register prefetch: the memory latency overlaps the
// arithmetic, which matters when few workgroups share a core).
// Out-of-range rows and tokens read valid ones (clamped); their results are
// not stored. Values past K read as zero.
//
// Bindings (group 0): as matmul_io.wgsl, with
//   2 w     storage read  [rows, k] weights (declared by the format prelude)
// Dispatch: (ceil(rows / (64 * WIDE)), ceil(n / (64 * WIDE)), 1).

override WIDE: u32 = 1u;

// [16 k][16 * WIDE groups of 4 rows] and [16 k][16 * WIDE groups of 4 tokens].
var<workgroup> w_tile: array<vec4<f32>, 256u * WIDE>;
var<workgroup> x_tile: array<vec4<f32>, 256u * WIDE>;

// Four values of W at packed index `base + k` (zero past the row's end).
fn w_word(base: u32, k: u32) -> vec4<f32> {
    if (k < p.k4) {
        return weight4(base + k);
    }
    return vec4<f32>(0.0);
}

// Four values of x at vec4 index `base + k` (zero past the row's end).
fn x_word(base: u32, k: u32) -> vec4<f32> {
    if (k < p.k4) {
        return x[base + k];
    }
    return vec4<f32>(0.0);
}

// The 4 x 4 products of four rows' values `a` and four tokens' values `b`:
// column j holds token j's four rows.
fn outer(a: vec4<f32>, b: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(a * b.x, a * b.y, a * b.z, a * b.w);
}

// Stores a lane's 4 x 4 block: rows 4 rg .. + 4 and tokens 4 tg .. + 4 of
// the tile at (row0, tok0).
fn store_block(acc: mat4x4<f32>, row0: u32, tok0: u32, rg: u32, tg: u32, n: u32) {
    for (var j = 0u; j < 4u; j++) {
        let t = tok0 + 4u * tg + j;
        for (var i = 0u; i < 4u; i++) {
            let r = row0 + 4u * rg + i;
            if (t < n && r < p.rows) {
                store(t, r, acc[j][i]);
            }
        }
    }
}

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let n = step_rows(step, p.count_sel);
    let groups = 16u * WIDE;
    let row0 = wg.x * 64u * WIDE;
    let tok0 = wg.y * 64u * WIDE;
    if (row0 >= p.rows || tok0 >= n) {
        return;
    }
    // Loading: this lane loads row (token) lane / 4 of the tile (and, with
    // WIDE = 2, lane / 4 + 64), vec4 lane % 4 of the 16 values.
    let load_r = lane / 4u;
    let load_k = lane % 4u;
    let w_base0 = w_row(min(row0 + load_r, p.rows - 1u), p.k4);
    let x_base0 = min(tok0 + load_r, n - 1u) * p.k4;
    let w_base1 = w_row(min(row0 + load_r + 64u, p.rows - 1u), p.k4);
    let x_base1 = min(tok0 + load_r + 64u, n - 1u) * p.k4;
    var w0 = w_word(w_base0, load_k);
    var x0 = x_word(x_base0, load_k);
    var w1 = vec4<f32>(0.0);
    var x1 = vec4<f32>(0.0);
    if (WIDE == 2u) {
        w1 = w_word(w_base1, load_k);
        x1 = x_word(x_base1, load_k);
    }
    // Computing: row groups rg (+ 16) and token groups tg (+ 16).
    let rg = lane % 16u;
    let tg = lane / 16u;
    // acc_ab: row groups rg + 16 a, token groups tg + 16 b.
    var acc00 = mat4x4<f32>();
    var acc01 = mat4x4<f32>();
    var acc10 = mat4x4<f32>();
    var acc11 = mat4x4<f32>();
    let slot = load_k * 4u * groups + load_r / 4u;
    let comp = load_r % 4u;
    for (var k0 = 0u; k0 < bounded(p.k4); k0 += 4u) {
        for (var c = 0u; c < 4u; c++) {
            w_tile[slot + c * groups][comp] = w0[c];
            x_tile[slot + c * groups][comp] = x0[c];
            if (WIDE == 2u) {
                w_tile[slot + 16u + c * groups][comp] = w1[c];
                x_tile[slot + 16u + c * groups][comp] = x1[c];
            }
        }
        workgroupBarrier();
        // The next slice, loaded while this one is multiplied.
        w0 = w_word(w_base0, k0 + 4u + load_k);
        x0 = x_word(x_base0, k0 + 4u + load_k);
        if (WIDE == 2u) {
            w1 = w_word(w_base1, k0 + 4u + load_k);
            x1 = x_word(x_base1, k0 + 4u + load_k);
        }
        for (var kk = 0u; kk < 16u; kk++) {
            let a0 = w_tile[kk * groups + rg];
            let b0 = x_tile[kk * groups + tg];
            acc00 += outer(a0, b0);
            if (WIDE == 2u) {
                let a1 = w_tile[kk * groups + rg + 16u];
                let b1 = x_tile[kk * groups + tg + 16u];
                acc01 += outer(a0, b1);
                acc10 += outer(a1, b0);
                acc11 += outer(a1, b1);
            }
        }
        workgroupBarrier();
    }
    store_block(acc00, row0, tok0, rg, tg, n);
    if (WIDE == 2u) {
        store_block(acc01, row0, tok0, rg, tg + 16u, n);
        store_block(acc10, row0, tok0, rg + 16u, tg, n);
        store_block(acc11, row0, tok0, rg + 16u, tg + 16u, n);
    }
}
