// weights_q8_0.wgsl: weight-format prelude for Q8_0 (its words through
// `w_at`, and `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Blocks of 32 values in 9 words: word 0 holds d (f16, low half), words
// 1..8 the signed 8-bit quants, value 4i + n in byte n of word 1 + i.
// x = d * q.
alias WWord = u32;

fn weight4(g: u32) -> vec4<f32> {
    let base = (g >> 3u) * 9u;
    let d = unpack2x16float(w_at(base)).x;
    return d * signed_bytes(w_at(base + 1u + (g & 7u)));
}

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    let base = (g >> 3u) * 9u;
    var xv = xs;
    var s = 0.0;
    for (var i = 0u; i < 8u; i++) {
        s += dot(signed_bytes(w_at(base + 1u + i)), xv[i]);
    }
    return unpack2x16float(w_at(base)).x * s;
}

fn dot32_q8(g: u32, xa: vec4<u32>, xb: vec4<u32>, ds: vec4<f32>) -> f32 {
    let base = (g >> 3u) * 9u;
    let s = dot4I8Packed(w_at(base + 1u), xa.x) + dot4I8Packed(w_at(base + 2u), xa.y)
        + dot4I8Packed(w_at(base + 3u), xa.z) + dot4I8Packed(w_at(base + 4u), xa.w)
        + dot4I8Packed(w_at(base + 5u), xb.x) + dot4I8Packed(w_at(base + 6u), xb.y)
        + dot4I8Packed(w_at(base + 7u), xb.z) + dot4I8Packed(w_at(base + 8u), xb.w);
    return unpack2x16float(w_at(base)).x * ds.x * f32(s);
}
