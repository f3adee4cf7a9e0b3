// weights_blocks.wgsl: helpers the quantized weight preludes share
// (appended to each of weights_q*.wgsl; see src/shaders.rs). They read u32
// words through `w_u32(i)`, which each quantized prelude defines (or
// weights_words.wgsl, where the prelude's words are u32).

// A block format: the `gpu` mat-vec gives each lane whole 32-value blocks
// through `dot32` (matvec_rows.wgsl).
const QUANTIZED: bool = true;

// Four `bits`-bit fields of q, from bit 0: fields 0, 1, 2, 3.
fn fields4(q: u32, bits: u32) -> vec4<u32> {
    return (vec4<u32>(q) >> (vec4<u32>(0u, 1u, 2u, 3u) * bits)) & vec4<u32>((1u << bits) - 1u);
}

// The K-quants' (Q4_K, Q5_K) 6-bit sub-block scales and mins.
// Byte i (0..11) of the scales of the super-block at word `base`.
fn k_scale_byte(base: u32, i: u32) -> u32 {
    return (w_u32(base + 1u + i / 4u) >> ((i % 4u) * 8u)) & 255u;
}

// (d * scale, dmin * min) of sub-block j (0..7) of the super-block at `base`.
fn k_scale_min(base: u32, j: u32) -> vec2<f32> {
    let dm = unpack2x16float(w_u32(base));
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

// The signed bytes of q, from byte 0.
fn signed_bytes(q: u32) -> vec4<f32> {
    // Shift each byte to the top, then shift it down arithmetically.
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}

// Sum over the eight 4-bit fields of q (value n in nibble n) of field * x,
// where a holds x for fields 0..3 and b for fields 4..7; `high` holds a fifth
// bit per field (bit n for field n; 0 for formats without one).
fn nibbles_dot(q: u32, high: u32, a: vec4<f32>, b: vec4<f32>) -> f32 {
    let lo = fields4(q, 4u) | (fields4(high, 1u) << vec4<u32>(4u));
    let hi = fields4(q >> 16u, 4u) | (fields4(high >> 4u, 1u) << vec4<u32>(4u));
    return dot(vec4<f32>(lo), a) + dot(vec4<f32>(hi), b);
}

// Sum over the 32 values of one block of 4-bit quants in words first ..
// first + 3 (value 8i + n in nibble n of word first + i) of quant * x, with
// the fifth bits in `high` (bit v for value v; 0 for formats without one).
fn nibble_block_dot(first: u32, high: u32, xs: array<vec4<f32>, 8>) -> f32 {
    var xv = xs;
    var s = 0.0;
    for (var i = 0u; i < 4u; i++) {
        s += nibbles_dot(w_u32(first + i), high >> (8u * i), xv[2u * i], xv[2u * i + 1u]);
    }
    return s;
}
