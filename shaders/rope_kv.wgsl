// rope_kv.wgsl: rotary position embedding of q and k (Hugging Face rotate_half
// convention: the first rotary_dim dimensions of a head rotate in pairs
// (j, j + rotary_dim/2), the others pass unchanged; rotary_dim 0 rotates
// nothing), cos and sin times attention_factor (LongRoPE; 1 otherwise), and
// the append of k and v to the KV cache in its storage format (KvPacked from
// the kv_f16/kv_f32 prelude).
//
// Bindings (group 0):
//   0 step      uniform Step
//   1 p         uniform RopeParams
//   2 qkv       storage read  [row0 + n_tokens, (n_heads + 2 n_kv) * head_dim] f32  (q | k | v per row)
//   3 pos       storage read  [row0 + n_tokens] u32   original positions of the step's tokens
//   4 inv_freq  storage read  [max(rotary_dim/2, 1)] f32 (rope_theta and rope_scaling folded in on the host)
//   5 q         storage rw    [row0 + n_tokens, n_heads * head_dim] f32  rotated queries
//   6 kc        storage rw    [page.len, n_kv * head_dim/4] KvPacked  one page of this layer's key cache (keys after RoPE)
//   7 vc        storage rw    [page.len, n_kv * head_dim/4] KvPacked  the same page of its value cache
//   8 page      uniform Page  the slots kc/vc hold
// Token t (row step.row0 + t) goes to cache slot step.start_slot + t, written only by the dispatch
// whose page holds that slot (dispatch once per page the step's slots touch;
// every dispatch rotates q, which is the same each time). A page of len 0
// writes no key or value (the counter-causal pass needs only the queries).
// One invocation makes four consecutive values of one head (q, k or v), so a
// packed cache word is written whole.
// Dispatch: (ceil((n_heads + 2 n_kv) * head_dim/4 / 64), n_tokens, 1).
struct RopeParams {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    rotary_dim: u32,
    attention_factor: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: RopeParams;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;
@group(0) @binding(4) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(5) var<storage, read_write> q: array<f32>;
@group(0) @binding(6) var<storage, read_write> kc: array<KvPacked>;
@group(0) @binding(7) var<storage, read_write> vc: array<KvPacked>;
@group(0) @binding(8) var<uniform> page: Page;

// sin and cos of `x` (>= 0) to within a few f32 ulps on every driver.
// WGSL's own sin and cos promise 2^-11 absolute error, and only inside
// [-pi, pi] (SwiftShader's were 2e-4 off at angles below 20 radians, where
// the CPU reference and Hugging Face evaluate them exactly). x is reduced by
// k multiples of pi/2 in three parts (Cody-Waite; Cephes' sinf constants,
// doubled): 1.5703125 has 8 significant bits and k is applied as its
// multiple of 256 and the rest, so both products are exact for k < 2^24;
// the parts after it err by about 1e-7 k ulps of pi/2 (4e-6 at an angle of
// 200,000). Cephes' minimax polynomials then take the rest, in
// [-pi/4, pi/4], and the quadrant k mod 4 picks and signs them.
fn sin_cos(x: f32) -> vec2<f32> {
    let k = round(x * 0.63661977236758134); // x / (pi/2)
    let k_high = floor(k / 256.0) * 256.0;
    var r = x - k_high * 1.5703125;
    r = r - (k - k_high) * 1.5703125;
    r = r - k * 4.837512969970703125e-4;
    r = r - k * 7.54978995489188216e-8;
    let z = r * r;
    let s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r;
    let c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z
        - 0.5 * z + 1.0;
    // sin and cos of r + q pi/2.
    switch (u32(k) & 3u) {
        case 0u: { return vec2<f32>(s, c); }
        case 1u: { return vec2<f32>(c, -s); }
        case 2u: { return vec2<f32>(-s, -c); }
        default: { return vec2<f32>(-c, s); }
    }
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    let hd4 = p.head_dim / 4u;
    let head = gid.x / hd4; // q heads, then k heads, then v heads
    if (t >= step.n_tokens || head >= p.n_heads + 2u * p.n_kv) {
        return;
    }
    let g = gid.x % hd4;
    let half = p.rotary_dim / 2u;
    let r = step.row0 + t; // this token's row of qkv, pos and q
    let src = r * (p.n_heads + 2u * p.n_kv) * p.head_dim + head * p.head_dim;
    var out: vec4<f32>;
    for (var e = 0u; e < 4u; e++) {
        let d = g * 4u + e;
        if (head < p.n_heads + p.n_kv && d < p.rotary_dim) {
            // Dimension d < half pairs with d + half: (a, b) -> (a c - b s, b c + a s).
            let j = select(d - half, d, d < half);
            let a = qkv[src + j];
            let b = qkv[src + j + half];
            let angle = f32(pos[r]) * inv_freq[j];
            let sc = sin_cos(angle) * p.attention_factor;
            out[e] = select(b * sc.y + a * sc.x, a * sc.y - b * sc.x, d < half);
        } else {
            out[e] = qkv[src + d];
        }
    }
    if (head < p.n_heads) {
        let dst = (r * p.n_heads + head) * p.head_dim + g * 4u;
        for (var e = 0u; e < 4u; e++) {
            q[dst + e] = out[e];
        }
        return;
    }
    let slot = step.start_slot + t;
    if (slot < page.first || slot >= page.first + page.len) {
        return;
    }
    let row = (slot - page.first) * p.n_kv * hd4;
    if (head < p.n_heads + p.n_kv) {
        kc[row + (head - p.n_heads) * hd4 + g] = pack_kv(out);
    } else {
        vc[row + (head - p.n_heads - p.n_kv) * hd4 + g] = pack_kv(out);
    }
}
