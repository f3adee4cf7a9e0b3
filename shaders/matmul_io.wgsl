// matmul_io.wgsl: what every mat-mul and mat-vec variant shares (included by
// matmul.wgsl, matvec_*.wgsl, matmul_tiled.wgsl and matmul_coop.wgsl, after
// the weight-format prelude; see src/shaders.rs). Binding 2, the weights, is
// declared by the prelude (`weight4`), except in matmul_coop.wgsl, which
// reads f16 weights itself.
//
// y[t, c0 + r] (+)= sum_k W[r, k] * x[t, k] + bias[c0 + r], where W is one row
// part of a [out, in] weight (nn.Linear layout); a weight too large for one
// binding is split into row parts and launched once per part with its own c0.
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform MatmulParams
//   2 w     storage read  [rows, k] weights (declared by the format prelude)
//   3 bias  storage read  [out_stride] f32   (a dummy when flags bit 1 is clear)
//   4 x     storage read  [n, k/4] vec4<f32> ([n, 2k/4] with flags bit 3)
//                         (declared by matmul_x.wgsl; matvec_q8.wgsl reads
//                         x's q8 blocks here)
//   5 y     storage rw    [n, out_stride] f32
//   6 norm  storage read  [k/4] vec4<f32>  RMSNorm weights (a dummy when flags
//                         bit 2 is clear; matmul_x.wgsl)
// n = step_rows(step, p.count_sel).
// flags: bit 0 adds into y (residual connection fused), bit 1 adds the bias,
// bit 2 (mat-vec variants of the `gpu` set only): x is the residual stream and
// the kernel applies RMSNorm (weights `norm`, epsilon p.eps) to it first, which
// saves decode a dispatch per norm; bit 3 (the same variants): x holds the
// gate|up rows [gate (k) | up (k)] and the kernel takes silu(gate) * up, which
// saves decode the SwiGLU dispatch.
struct MatmulParams {
    rows: u32,
    k4: u32,
    col0: u32,
    out_stride: u32,
    flags: u32,
    count_sel: u32,
    eps: f32,
    _p1: u32,
}

// The flag bits (src/kernels/matmul.rs sets them; a test there checks that
// these values are its own).
const FLAG_ACCUMULATE: u32 = 1u;
const FLAG_BIAS: u32 = 2u;
const FLAG_FUSED_NORM: u32 = 4u;
const FLAG_FUSED_SWIGLU: u32 = 8u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: MatmulParams;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

// Stores the product of row r (within the part) for token t.
fn store(t: u32, r: u32, v: f32) {
    let col = p.col0 + r;
    var val = v;
    if ((p.flags & FLAG_BIAS) != 0u) {
        val += bias[col];
    }
    let idx = t * p.out_stride + col;
    if ((p.flags & FLAG_ACCUMULATE) != 0u) {
        val += y[idx];
    }
    y[idx] = val;
}
