// rope_kv.wgsl: rotary position embedding of q and k (Hugging Face rotate_half
// convention, pairs (j, j + d/2)), and the append of k and v to the KV cache.
//
// Bindings (group 0):
//   0 step      uniform Step
//   1 p         uniform RopeParams
//   2 qkv       storage read  [n_tokens, (n_heads + 2 n_kv) * head_dim] f32  (q | k | v per row)
//   3 pos       storage read  [n_tokens] u32   original positions of the step's tokens
//   4 inv_freq  storage read  [head_dim/2] f32 (rope_theta and rope_scaling folded in on the host)
//   5 q         storage rw    [n_tokens, n_heads * head_dim] f32  rotated queries
//   6 kc        storage rw    [page.len, n_kv * head_dim] f32  one page of this layer's key cache (keys after RoPE)
//   7 vc        storage rw    [page.len, n_kv * head_dim] f32  the same page of its value cache
//   8 page      uniform Page  the slots kc/vc hold
// Token t goes to cache slot step.start_slot + t, written only by the dispatch
// whose page holds that slot (dispatch once per page the step's slots touch;
// every dispatch rotates q, which is the same each time). A page of len 0
// writes no key or value (the counter-causal pass needs only the queries).
// Dispatch: (ceil(((n_heads + n_kv) * half + n_kv * half) / 64), n_tokens, 1), half = head_dim/2:
// one invocation per rotated pair, then one per pair of copied v values.
struct RopeParams {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    _p0: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: RopeParams;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;
@group(0) @binding(4) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(5) var<storage, read_write> q: array<f32>;
@group(0) @binding(6) var<storage, read_write> kc: array<f32>;
@group(0) @binding(7) var<storage, read_write> vc: array<f32>;
@group(0) @binding(8) var<uniform> page: Page;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    if (t >= step.n_tokens) {
        return;
    }
    let half = p.head_dim / 2u;
    let rot_pairs = (p.n_heads + p.n_kv) * half;
    let row = t * (p.n_heads + 2u * p.n_kv) * p.head_dim;
    let slot = step.start_slot + t;
    let in_page = slot >= page.first && slot < page.first + page.len;
    let kv_row = (slot - page.first) * p.n_kv * p.head_dim;
    let idx = gid.x;
    if (idx < rot_pairs) {
        let head = idx / half;
        let j = idx % half;
        let src = row + head * p.head_dim + j;
        let a = qkv[src];
        let b = qkv[src + half];
        let angle = f32(pos[t]) * inv_freq[j];
        let c = cos(angle);
        let s = sin(angle);
        let ra = a * c - b * s;
        let rb = b * c + a * s;
        if (head < p.n_heads) {
            let dst = t * p.n_heads * p.head_dim + head * p.head_dim + j;
            q[dst] = ra;
            q[dst + half] = rb;
        } else if (in_page) {
            let dst = kv_row + (head - p.n_heads) * p.head_dim + j;
            kc[dst] = ra;
            kc[dst + half] = rb;
        }
    } else if (idx < rot_pairs + p.n_kv * half && in_page) {
        let e = 2u * (idx - rot_pairs);
        let src = row + (p.n_heads + p.n_kv) * p.head_dim + e;
        vc[kv_row + e] = qkv[src];
        vc[kv_row + e + 1u] = qkv[src + 1u];
    }
}
