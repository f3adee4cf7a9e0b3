// matmul_x.wgsl: the product's input x as the f32 mat-mul and mat-vec
// variants read it (included after matmul_io.wgsl; see src/shaders.rs):
// bindings 4 (x) and 6 (the fused norm's weights), and x with the fused
// RMSNorm or SwiGLU applied. The integer-dot mat-vec (matvec_q8.wgsl) reads
// a q8 copy of x at binding 4 instead, and has no binding 6.
@group(0) @binding(4) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> norm: array<vec4<f32>>;

fn fused_norm() -> bool {
    return (p.flags & FLAG_FUSED_NORM) != 0u;
}

fn fused_swiglu() -> bool {
    return (p.flags & FLAG_FUSED_SWIGLU) != 0u;
}

// Values 4k .. 4k + 3 of token 0's x as the binding holds them.
fn x_raw(k: u32) -> vec4<f32> {
    return x[k];
}

// x[k] of token 0 as the product sees it: scaled by `inv` (the token's
// 1 / rms) and the norm weights when the norm is fused; silu(gate) * up when
// the SwiGLU is fused.
fn x_normed(k: u32, inv: f32) -> vec4<f32> {
    if (fused_swiglu()) {
        let g = x[k];
        return g / (1.0 + exp(-g)) * x[p.k4 + k];
    }
    if (fused_norm()) {
        return x[k] * inv * norm[k];
    }
    return x[k];
}

// 1 / sqrt(mean(x^2) + eps) from a row's sum of squares.
fn inv_rms(sum_sq: f32) -> f32 {
    return inverseSqrt(sum_sq / f32(p.k4 * 4u) + p.eps);
}

