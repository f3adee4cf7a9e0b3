// matmul.wgsl: the `cpu` mat-mul and mat-vec (tuned on lavapipe), y (+)= W x
// (+ bias) (needs a weight-format prelude; matmul_io.wgsl has the shared
// parameters, bindings and store).
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform MatmulParams
//   2 w     storage read  [rows, k] weights (declared by the format prelude)
//   3 bias  storage read  [out_stride] f32   (a dummy when flags bit 1 is clear)
//   4 x     storage read  [n, k/4] vec4<f32>  (not read: see xt)
//   5 y     storage rw    [n, out_stride] f32
//   7 xt    texture_2d<u32>, at least k/4 x n texels: x as x_texture.wgsl
//           copies it, which the launcher dispatches first (on lavapipe a
//           texel fetch is vector code and a storage load a loop over the
//           lanes: docs/ARCHITECTURE.md, "lavapipe facts")
// n = step_rows(step, p.count_sel).
// Entry points and dispatch:
//   matmul: 4 rows x 4 tokens per invocation, for prefill.
//           Dispatch (ceil(ceil(rows/4) / 64), ceil(n/4), 1).
//   matvec: 8 rows x 1 token per invocation, 8 invocations per workgroup,
//           for decode (n = 1). Dispatch (ceil(rows / 64), n, 1).
// flags: bit 0 adds into y (residual connection fused), bit 1 adds the bias.

@group(0) @binding(7) var xt: texture_2d<u32>;

// x[t * k4 + k].
fn x_at(t: u32, k: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(textureLoad(xt, vec2<u32>(k, t), 0));
}

@compute @workgroup_size(64)
fn matmul(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r0 = gid.x * 4u;
    let t0 = gid.y * 4u;
    let n = step_rows(step, p.count_sel);
    if (r0 >= p.rows || t0 >= n) {
        return;
    }
    // Clamp out-of-range rows and tokens to valid ones; their results are not stored.
    let w0 = w_row(r0, p.k4);
    let w1 = w_row(min(r0 + 1u, p.rows - 1u), p.k4);
    let w2 = w_row(min(r0 + 2u, p.rows - 1u), p.k4);
    let w3 = w_row(min(r0 + 3u, p.rows - 1u), p.k4);
    let t1 = min(t0 + 1u, n - 1u);
    let t2 = min(t0 + 2u, n - 1u);
    let t3 = min(t0 + 3u, n - 1u);
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    for (var k = 0u; k < p.k4; k++) {
        let wa = weight4(w0 + k);
        let wb = weight4(w1 + k);
        let wc = weight4(w2 + k);
        let wd = weight4(w3 + k);
        let xa = x_at(t0, k);
        let xb = x_at(t1, k);
        let xc = x_at(t2, k);
        let xd = x_at(t3, k);
        a0 += vec4<f32>(dot(wa, xa), dot(wb, xa), dot(wc, xa), dot(wd, xa));
        a1 += vec4<f32>(dot(wa, xb), dot(wb, xb), dot(wc, xb), dot(wd, xb));
        a2 += vec4<f32>(dot(wa, xc), dot(wb, xc), dot(wc, xc), dot(wd, xc));
        a3 += vec4<f32>(dot(wa, xd), dot(wb, xd), dot(wc, xd), dot(wd, xd));
    }
    let acc = array<vec4<f32>, 4>(a0, a1, a2, a3);
    for (var ti = 0u; ti < 4u; ti++) {
        if (t0 + ti >= n) {
            break;
        }
        for (var ri = 0u; ri < 4u; ri++) {
            if (r0 + ri < p.rows) {
                store(t0 + ti, r0 + ri, acc[ti][ri]);
            }
        }
    }
}

// Eight rows per invocation share each load of x (on lavapipe every load is
// a per-lane scalar load, so loads, not bytes, bound this kernel), and a step
// covers 32 values through the prelude's `dot32`: quantized weights are read
// a whole quant word at a time with one scale per block. Workgroups of 8
// lanes: decode matrices have few rows (576 for SmolLM2), and lavapipe runs
// whole workgroups per thread, so small ones balance the threads.
@compute @workgroup_size(8)
fn matvec(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r0 = gid.x * 8u;
    let t = gid.y;
    if (r0 >= p.rows || t >= step_rows(step, p.count_sel)) {
        return;
    }
    var wr: array<u32, 8>;
    for (var i = 0u; i < 8u; i++) {
        wr[i] = w_row(min(r0 + i, p.rows - 1u), p.k4);
    }
    var a = array<f32, 8>();
    var xs: array<vec4<f32>, 8>;
    let k_whole = bounded(p.k4) & ~7u;
    for (var k = 0u; k < k_whole; k += 8u) { // loop bound: k_whole = bounded(..)
        for (var i = 0u; i < 8u; i++) {
            xs[i] = x_at(t, k + i);
        }
        let one = vec4<f32>(1.0);
        let sx = vec2<f32>(
            dot(xs[0] + xs[1] + xs[2] + xs[3], one),
            dot(xs[4] + xs[5] + xs[6] + xs[7], one),
        );
        for (var i = 0u; i < 8u; i++) {
            a[i] += dot32(wr[i] + k, xs, sx);
        }
    }
    // The float formats' K need not be a multiple of 32.
    for (var k = k_whole; k < p.k4; k++) {
        let xv = x_at(t, k);
        for (var i = 0u; i < 8u; i++) {
            a[i] += dot(weight4(wr[i] + k), xv);
        }
    }
    for (var ri = 0u; ri < 8u; ri++) {
        if (r0 + ri < p.rows) {
            store(t, r0 + ri, a[ri]);
        }
    }
}
