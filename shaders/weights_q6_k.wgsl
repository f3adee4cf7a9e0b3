// weights_q6_k.wgsl: weight-format prelude for Q6_K (its words through
// `w_at`, and `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Super-blocks of 256 values in 53 words: word 0 holds d (f16, low half),
// words 1..4 the signed 8-bit scales of the 16 groups of 16 values (group s
// in byte s % 4 of word 1 + s / 4), words 5..36 the low four bits (value
// 8i + n in nibble n of word 5 + i), words 37..52 the high two bits (value
// 16i + n in bits 2n of word 37 + i). x = d * scale * (q - 32).
alias WWord = u32;

fn weight4(g: u32) -> vec4<f32> {
    let base = (g >> 6u) * 53u;
    let j = g & 63u;
    let d = unpack2x16float(w_at(base)).x;
    let s = j >> 2u;
    let sc = bitcast<i32>(w_at(base + 1u + (s >> 2u)) << (24u - (s & 3u) * 8u)) >> 24u;
    let lo = w_at(base + 5u + (j >> 1u)) >> ((j & 1u) * 16u);
    let hi = w_at(base + 37u + (j >> 2u)) >> ((j & 3u) * 8u);
    let q = fields4(lo, 4u);
    let h = fields4(hi, 2u) << vec4<u32>(4u);
    return d * f32(sc) * (vec4<f32>(q | h) - 32.0);
}

fn dot32(g: u32, xs: array<vec4<f32>, 8>, sx: vec2<f32>) -> f32 {
    let base = (g >> 6u) * 53u;
    let j = (g >> 3u) & 7u;
    // Chunk j is groups 2j and 2j + 1 of 16 values, one scale each.
    let scales = signed_bytes(w_at(base + 1u + (j >> 1u)));
    var xv = xs;
    var s = vec2<f32>(0.0);
    for (var m = 0u; m < 8u; m++) {
        let lo = w_at(base + 5u + 4u * j + (m >> 1u)) >> ((m & 1u) * 16u);
        let hi = w_at(base + 37u + 2u * j + (m >> 2u)) >> ((m & 3u) * 8u);
        let q = fields4(lo, 4u) | (fields4(hi, 2u) << vec4<u32>(4u));
        s[m >> 2u] += dot(vec4<f32>(q), xv[m]);
    }
    let sc = select(scales.xy, scales.zw, (j & 1u) == 1u);
    return unpack2x16float(w_at(base)).x * dot(sc, s - 32.0 * sx);
}

fn dot32_q8(g: u32, xa: vec4<u32>, xb: vec4<u32>, ds: vec4<f32>) -> f32 {
    let base = (g >> 6u) * 53u;
    let j = (g >> 3u) & 7u;
    let scales = signed_bytes(w_at(base + 1u + (j >> 1u)));
    let sc = select(scales.xy, scales.zw, (j & 1u) == 1u);
    let xw = array<u32, 8>(xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w);
    // Values 16h .. 16h + 15 (group 2j + h, one scale each) in words 4h ..
    // 4h + 3 of x: their integer sums apart.
    var s = vec2<i32>(0);
    for (var m = 0u; m < 8u; m++) {
        let lo = w_at(base + 5u + 4u * j + (m >> 1u)) >> ((m & 1u) * 16u);
        let hi = w_at(base + 37u + 2u * j + (m >> 2u)) >> ((m & 3u) * 8u);
        let q = nibbles_to_bytes(lo & 0xffffu) | pairs_to_bytes(hi);
        s[m >> 2u] += dot4I8Packed(q, xw[m]);
    }
    return unpack2x16float(w_at(base)).x * dot(sc, ds.x * vec2<f32>(s) - 32.0 * ds.yz);
}
