// x_input.wgsl: what the kernels that prepare a mat-vec's input once per
// token share (quantize_q8.wgsl, x_half.wgsl; included after common.wgsl,
// see src/shaders.rs): their parameters, the input and the norm's weights,
// and x as the kernel that writes it would (with FLAG_NORM x =
// RMSNorm(input) * norm, with FLAG_SWIGLU x = silu(gate) * up).
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform XInputParams
//   2 x     storage read  [n, k4] vec4<f32> ([n, 2 k4] with FLAG_SWIGLU:
//                         gate then up)
//   3 norm  storage read  [k4] vec4<f32> RMSNorm weights (a dummy unless
//                         FLAG_NORM)
//   4 the prepared x (declared by each kernel)
// n = step_rows(step, p.count_sel). With FLAG_NORM every workgroup sums
// its token's squares itself (a read of k values, against a dispatch to
// share it).

struct XInputParams {
    k4: u32,
    count_sel: u32,
    flags: u32,
    eps: f32,
}

const FLAG_NORM: u32 = 1u;
const FLAG_SWIGLU: u32 = 2u;
const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: XInputParams;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> norm: array<vec4<f32>>;

var<workgroup> partial: array<f32, WG>;

// 1 / rms of token t's input, summed by the workgroup's lanes (every lane
// calls it: it has barriers).
fn token_inv_rms(t: u32, lane: u32) -> f32 {
    var ss = 0.0;
    for (var k = lane; k < bounded(p.k4); k += WG) {
        let v = x[t * p.k4 + k];
        ss += dot(v, v);
    }
    partial[lane] = ss;
    workgroupBarrier();
    for (var span = WG / 2u; span > 0u; span /= 2u) {
        if (lane < span) {
            partial[lane] += partial[lane + span];
        }
        workgroupBarrier();
    }
    return inverseSqrt(partial[0] / f32(p.k4 * 4u) + p.eps);
}

// 1 / rms of token t's input with FLAG_NORM, else 1 (every lane calls it).
fn token_scale(t: u32, lane: u32) -> f32 {
    if ((p.flags & FLAG_NORM) != 0u) {
        return token_inv_rms(t, lane);
    }
    return 1.0;
}

// Values 4k .. 4k + 3 of token t's x.
fn x_value4(t: u32, k: u32, inv: f32) -> vec4<f32> {
    if ((p.flags & FLAG_SWIGLU) != 0u) {
        let g = x[t * 2u * p.k4 + k];
        return g / (1.0 + exp(-g)) * x[t * 2u * p.k4 + p.k4 + k];
    }
    let v = x[t * p.k4 + k];
    if ((p.flags & FLAG_NORM) != 0u) {
        return v * inv * norm[k];
    }
    return v;
}
