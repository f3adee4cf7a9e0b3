// weights_floats.wgsl: `dot32` for the float weight formats (appended to
// weights_f16.wgsl and weights_f32.wgsl; see src/shaders.rs): there is no
// block scale to factor out, so it is eight `weight4` dot products, read two
// at a time (`weight8`: one texel of f16 weights in a texture).

// Not a block format: the `gpu` mat-vec reads one packed word per lane and
// step (matvec_rows.wgsl).
const QUANTIZED: bool = false;

// Rows start right after each other (weights_rows.wgsl).
const W_ROW_ALIGN: u32 = 1u;

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    var xv = xs;
    var s = 0.0;
    for (var i = 0u; i < 8u; i += 2u) {
        let v = weight8(g + i);
        s += dot(v[0], xv[i]) + dot(v[1], xv[i + 1u]);
    }
    return s;
}
