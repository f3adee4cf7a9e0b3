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
// Bindings (group 0): as x_input.wgsl, with
//   4 xq    storage rw    [n, k4 / 8, 3] vec4<u32>
// k4 is a multiple of 8 (whole blocks).
// Dispatch: (ceil(k4 / 8 / 64), n, 1): lane l of workgroup g takes block
// 64 g + l of token id.y.

@group(0) @binding(4) var<storage, read_write> xq: array<vec4<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let t = wg.y;
    if (t >= step_rows(step, p.count_sel)) {
        return;
    }
    let inv = token_scale(t, lane);
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
