// quantize_q8.wgsl: a product's input x written once per token as q8 blocks
// (llama.cpp's q8_1), for the integer-dot mat-vec (matvec_q8.wgsl), which
// multiplies 4 x 8-bit packed words at a time instead of converting every
// weight to f32. With FLAG_NORM the kernel takes x = RMSNorm(input) * norm
// first, with FLAG_SWIGLU x = silu(gate) * up: the kernel that would write x
// folded in here, once per token, where the f32 mat-vecs fold it into every
// workgroup.
//
// Block b (32 values x[32b .. 32b + 31]) of token t is three vec4<u32> at
// xq[(t * blocks + b) * 3]: words 0..7 the signed 8-bit quants q (value
// 4i + n in byte n of word i), then d, s0 and s1 as f32 bits (and a zero
// word): x ~ d * q, d = max |x| / 127, s0 and s1 = d * (sum of q) over
// values 0..15 and 16..31, which the formats with an offset (Q4_0's -8,
// Q4_1's min, the K-quants' mins) and Q6_K's 16-value scales need.
//
// Bindings (group 0):
//   0 step  uniform Step
//   1 p     uniform QuantizeParams
//   2 x     storage read  [n, k4] vec4<f32> ([n, 2 k4] with FLAG_SWIGLU:
//                         gate then up)
//   3 norm  storage read  [k4] vec4<f32> RMSNorm weights (a dummy unless
//                         FLAG_NORM)
//   4 xq    storage rw    [n, k4 / 8, 3] vec4<u32>
// n = step_rows(step, p.count_sel); k4 is a multiple of 8 (whole blocks).
// Dispatch: (ceil(k4 / 8 / 64), n, 1): lane l of workgroup g takes block
// 64 g + l of token id.y; with FLAG_NORM every workgroup sums the token's
// squares itself (a read of k values, against a dispatch to share it).

struct QuantizeParams {
    k4: u32,
    count_sel: u32,
    flags: u32,
    eps: f32,
}

const FLAG_NORM: u32 = 1u;
const FLAG_SWIGLU: u32 = 2u;
const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: QuantizeParams;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> norm: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> xq: array<vec4<u32>>;

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

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let t = wg.y;
    if (t >= step_rows(step, p.count_sel)) {
        return;
    }
    var inv = 1.0;
    if ((p.flags & FLAG_NORM) != 0u) {
        inv = token_inv_rms(t, lane);
    }
    let blocks = p.k4 / 8u;
    let b = wg.x * WG + lane;
    if (b >= blocks) {
        return;
    }
    var v: array<vec4<f32>, 8>;
    var amax = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        v[i] = x_value4(t, b * 8u + i, inv);
        amax = max(amax, abs(v[i]));
    }
    let d = max(max(amax.x, amax.y), max(amax.z, amax.w)) / 127.0;
    let scale = select(0.0, 1.0 / d, d > 0.0);
    var words: array<u32, 8>;
    var sums = vec2<i32>(0);
    for (var i = 0u; i < 8u; i++) {
        let q = vec4<i32>(clamp(round(v[i] * scale), vec4<f32>(-127.0), vec4<f32>(127.0)));
        words[i] = pack4xI8(q);
        sums[i / 4u] += q.x + q.y + q.z + q.w;
    }
    let at = (t * blocks + b) * 3u;
    xq[at] = vec4<u32>(words[0], words[1], words[2], words[3]);
    xq[at + 1u] = vec4<u32>(words[4], words[5], words[6], words[7]);
    let s = d * vec2<f32>(sums);
    xq[at + 2u] = vec4<u32>(bitcast<u32>(d), bitcast<u32>(s.x), bitcast<u32>(s.y), 0u);
}
