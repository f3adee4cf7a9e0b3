// silu_mul.wgsl: the gated MLP's activation, out = act(gate) * up: SiLU
// (SwiGLU), or with GELU_TANH the tanh-approximated GELU (Gemma).
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform SiluParams
//   2 gu    storage read  [n_tokens, 2 * ffn/4] vec4<f32>  (gate in the first half of each row, up in the second)
//   3 out   storage rw    [n_tokens, ffn/4] vec4<f32>
// Dispatch: (ceil(ffn/4 / 64), n_tokens, 1).
struct SiluParams {
    ffn4: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

// An override constant: GELU (tanh approximation, PyTorch's
// gelu(approximate="tanh")) instead of SiLU.
override GELU_TANH: bool = false;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: SiluParams;
@group(0) @binding(2) var<storage, read> gu: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.ffn4 || t >= step.n_tokens) {
        return;
    }
    let g = gu[t * 2u * p.ffn4 + i];
    let u = gu[t * 2u * p.ffn4 + p.ffn4 + i];
    var a: vec4<f32>;
    if (GELU_TANH) {
        // tanh(z) = 1 - 2 / (exp(2z) + 1): exact at both ends (exp's
        // overflow to inf gives 1) where some tanh builtins return NaN.
        let z = 0.7978845608028654 * (g + 0.044715 * g * g * g);
        a = 0.5 * g * (2.0 - 2.0 / (exp(2.0 * z) + 1.0));
    } else {
        a = g / (1.0 + exp(-g));
    }
    out[t * p.ffn4 + i] = a * u;
}
