// weights_floats.wgsl: `dot32` for the float weight formats (appended to
// weights_f16.wgsl and weights_f32.wgsl; see src/shaders.rs): there is no
// block scale to factor out, so it is eight `weight4` dot products.

// Not a block format: the `gpu` mat-vec reads one packed word per lane and
// step (matvec_rows.wgsl).
const QUANTIZED: bool = false;

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    var xv = xs;
    var s = 0.0;
    for (var i = 0u; i < 8u; i++) {
        s += dot(weight4(g + i), xv[i]);
    }
    return s;
}
