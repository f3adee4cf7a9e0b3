// weights_blocks.wgsl: helpers the quantized weight preludes share
// (appended to each of weights_q*.wgsl; see src/shaders.rs). They read `w`,
// which every quantized prelude declares as array<u32>.

// Four `bits`-bit fields of q, from bit 0: fields 0, 1, 2, 3.
fn fields4(q: u32, bits: u32) -> vec4<u32> {
    return (vec4<u32>(q) >> (vec4<u32>(0u, 1u, 2u, 3u) * bits)) & vec4<u32>((1u << bits) - 1u);
}

// The K-quants' (Q4_K, Q5_K) 6-bit sub-block scales and mins.
// Byte i (0..11) of the scales of the super-block at word `base`.
fn k_scale_byte(base: u32, i: u32) -> u32 {
    return (w[base + 1u + i / 4u] >> ((i % 4u) * 8u)) & 255u;
}

// (d * scale, dmin * min) of sub-block j (0..7) of the super-block at `base`.
fn k_scale_min(base: u32, j: u32) -> vec2<f32> {
    let dm = unpack2x16float(w[base]);
    var sc: u32;
    var m: u32;
    if (j < 4u) {
        sc = k_scale_byte(base, j) & 63u;
        m = k_scale_byte(base, j + 4u) & 63u;
    } else {
        let b = k_scale_byte(base, j + 4u);
        sc = (b & 15u) | ((k_scale_byte(base, j - 4u) >> 6u) << 4u);
        m = (b >> 4u) | ((k_scale_byte(base, j) >> 6u) << 4u);
    }
    return dm * vec2<f32>(f32(sc), f32(m));
}
