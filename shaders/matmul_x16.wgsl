// matmul_x16.wgsl: x as the f16-x mat-vec reads it (matvec_subgroup.wgsl's
// `HalfX` build; included after matmul_io.wgsl in place of matmul_x.wgsl,
// see src/shaders.rs): binding 4 holds x in f16, which x_half.wgsl wrote
// with the norm or SwiGLU already applied, so nothing is folded in here and
// there is no binding 6.
//
//   4 x     storage read  [1, k/4] vec2<u32>: values 4k .. 4k + 3 as four f16

@group(0) @binding(4) var<storage, read> x: array<vec2<u32>>;

fn fused_norm() -> bool {
    return false;
}

// Values 4k .. 4k + 3 of x.
fn x_raw(k: u32) -> vec4<f32> {
    let h = x[k];
    return vec4<f32>(unpack2x16float(h.x), unpack2x16float(h.y));
}

fn x_normed(k: u32, inv: f32) -> vec4<f32> {
    return x_raw(k);
}

// (Never called: there is no norm to fold in.)
fn inv_rms(sum_sq: f32) -> f32 {
    return 1.0;
}
