// weights_q8_0.wgsl: weight-format prelude for Q8_0 (binding 2 `w` and
// `weight4(g)`, as in weights_f16.wgsl; layouts in src/quant.rs).
// Blocks of 32 values in 9 words: word 0 holds d (f16, low half), words
// 1..8 the signed 8-bit quants, value 4i + n in byte n of word 1 + i.
// x = d * q.
@group(0) @binding(2) var<storage, read> w: array<u32>;

fn weight4(g: u32) -> vec4<f32> {
    let base = (g >> 3u) * 9u;
    let d = unpack2x16float(w[base]).x;
    // Sign-extend each byte: shift it to the top, then arithmetic shift down.
    let q = w[base + 1u + (g & 7u)];
    let v = bitcast<vec4<i32>>(vec4<u32>(q) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u);
    return d * vec4<f32>(v);
}
