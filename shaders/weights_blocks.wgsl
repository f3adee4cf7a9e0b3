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

// The integer-dot mat-vec (matvec_q8.wgsl) multiplies each prelude's
// `dot32_q8(g, xa, xb, ds)`: the block of 32 values at packed group g
// times x's q8 block (quantize_q8.wgsl): quants in xa (values 0..15, value
// 4i + n in byte n of component i) and xb (values 16..31), and ds = (d, s0,
// s1, 0), x ~ d * q, s0 and s1 = d * (sum of q) over values 0..15 and
// 16..31. The weights' small integers are moved into the bytes of words in
// x's order and multiplied 4 x 8-bit at a time (`dot4I8Packed`); a block's
// scales and offsets apply once, to the integer sums.

// The four 4-bit fields of h's low 16 bits (the rest zero) as the four
// bytes of a word (field n in byte n).
fn nibbles_to_bytes(h: u32) -> u32 {
    let t = (h | (h << 8u)) & 0x00ff00ffu;
    return (t | (t << 4u)) & 0x0f0f0f0fu;
}

// Bits 0..3 of b as bit 4 of bytes 0..3: the fifth bits of four 5-bit
// quants (the four shifted copies of b the product adds do not overlap).
fn bits_to_bytes(b: u32) -> u32 {
    return (((b & 15u) * 0x00204081u) & 0x01010101u) << 4u;
}

// The four 2-bit fields of f's low 8 bits as bits 4..5 of bytes 0..3: the
// high bits of four 6-bit quants (Q6_K).
fn pairs_to_bytes(f: u32) -> u32 {
    let b = f & 255u;
    return ((b | (b << 6u) | (b << 12u) | (b << 18u)) & 0x03030303u) << 4u;
}

// Sum over the eight 4-bit fields of q (value n in nibble n), with fifth
// bits from `high` (bit n for field n; 0 for formats without one), of field
// times the q8 x values in x0 (fields 0..3) and x1 (fields 4..7).
fn nibbles_dot_q8(q: u32, high: u32, x0: u32, x1: u32) -> i32 {
    let lo = nibbles_to_bytes(q & 0xffffu) | bits_to_bytes(high);
    let hi = nibbles_to_bytes(q >> 16u) | bits_to_bytes(high >> 4u);
    return dot4I8Packed(lo, x0) + dot4I8Packed(hi, x1);
}

// Sum over the 32 values of one block of 4-bit quants in the words q
// (value 8i + n in nibble n of component i), with the fifth bits in `high`
// (bit v for value v; 0 for formats without one), of quant times q8 x.
fn nibble_block_dot_q8(q: vec4<u32>, high: u32, xa: vec4<u32>, xb: vec4<u32>) -> i32 {
    return nibbles_dot_q8(q.x, high, xa.x, xa.y) + nibbles_dot_q8(q.y, high >> 8u, xa.z, xa.w)
        + nibbles_dot_q8(q.z, high >> 16u, xb.x, xb.y) + nibbles_dot_q8(q.w, high >> 24u, xb.z, xb.w);
}

// The words w_u32(first) .. w_u32(first + 3) as a vec4.
fn w_words4(first: u32) -> vec4<u32> {
    return vec4<u32>(w_u32(first), w_u32(first + 1u), w_u32(first + 2u), w_u32(first + 3u));
}
