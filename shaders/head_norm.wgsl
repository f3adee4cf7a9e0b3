// head_norm.wgsl: RMSNorm of each query and key head, in place in the q|k|v
// rows of the step (Qwen3's and Gemma 3's q_norm and k_norm, before RoPE):
// x = x / sqrt(mean(x^2) + eps) * (w + weight_offset), the mean over head_dim,
// w the query heads' weight or the key heads' weight. Value heads are left alone.
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform HeadNormParams
//   2 qkv   storage rw    [n_tokens, (n_heads + 2 n_kv) * head_dim] f32  (q | k | v per row)
//   3 q_w   storage read  [head_dim] f32  weight of every query head
//   4 k_w   storage read  [head_dim] f32  weight of every key head
// Rows 0..step.n_tokens (all the step's rows, of one sequence or several).
// Dispatch: (n_heads + n_kv, n_tokens, 1); one workgroup per head of a row.
// A workgroup reads its head whole before the barrier and writes it after, so
// the update in place touches nothing another workgroup reads.
struct HeadNormParams {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    eps: f32,
    weight_offset: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: HeadNormParams;
@group(0) @binding(2) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> q_w: array<f32>;
@group(0) @binding(4) var<storage, read> k_w: array<f32>;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let head = wid.x;
    let t = wid.y;
    // Uniform across the workgroup: every invocation returns or none does.
    if (t >= step.n_tokens || head >= p.n_heads + p.n_kv) {
        return;
    }
    let base = (t * (p.n_heads + 2u * p.n_kv) + head) * p.head_dim;
    var ss = 0.0;
    for (var i = lid; i < bounded(p.head_dim); i += WG) {
        let v = qkv[base + i];
        ss += v * v;
    }
    partial[lid] = ss;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    let inv = inverseSqrt(partial[0] / f32(p.head_dim) + p.eps);
    for (var i = lid; i < bounded(p.head_dim); i += WG) {
        var w: f32;
        if (head < p.n_heads) {
            w = q_w[i];
        } else {
            w = k_w[i];
        }
        qkv[base + i] = qkv[base + i] * inv * (w + p.weight_offset);
    }
}
