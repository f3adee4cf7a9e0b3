// random_fill.wgsl: fills words word0 .. word0 + n_words of a buffer with
// seeded uniform random values offset + scale * u, u in [-1, 1): one f32 per
// word (format 0) or two packed f16 (format 1, element 2w in the low half);
// or quantized blocks of p.block_words words (format 2): the block's first
// word holds the f16 pair (scale, offset), its scale (and offset or minimum
// scale), and every other word random bits (quants, and the K-quants'
// sub-block scales); or groups of blocks of p.block_words words (format 3,
// Q4_0): the group's first p.scale_words words hold two f16 scales each,
// every other word random bits.
// Element e's u comes from a hash of (seed, e), so any range of a buffer can be
// filled independently and the CPU reference reproduces it. Used for synthetic
// models: weights generated on the GPU, no file and no host copy.
//
// Bindings (group 0):
//   0 p    uniform FillParams  (word0, n_words, format, seed, scale, offset,
//                               block_words, scale_words)
//   1 dst  storage rw  [>= word0 + n_words] u32
// Dispatch: (min(G, 65535), ceil(G / 65535), 1) with G = ceil(n_words / 256).
struct FillParams {
    word0: u32,
    n_words: u32,
    format: u32,
    seed: u32,
    scale: f32,
    offset: f32,
    block_words: u32,
    scale_words: u32,
}

@group(0) @binding(0) var<uniform> p: FillParams;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;

// "lowbias32" integer hash (Chris Wellons).
fn hash(x: u32) -> u32 {
    var h = x;
    h = h ^ (h >> 16u);
    h = h * 0x7feb352du;
    h = h ^ (h >> 15u);
    h = h * 0x846ca68bu;
    h = h ^ (h >> 16u);
    return h;
}

fn value(e: u32) -> f32 {
    let u = f32(hash(e ^ hash(p.seed)) >> 8u) * (2.0 / 16777216.0) - 1.0;
    return p.offset + p.scale * u;
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * 65535u * 256u;
    if i >= p.n_words {
        return;
    }
    let w = p.word0 + i;
    if p.format == 0u {
        dst[w] = bitcast<u32>(value(w));
    } else if p.format == 2u {
        if w % p.block_words == 0u {
            dst[w] = pack2x16float(vec2<f32>(p.scale, p.offset));
        } else {
            dst[w] = hash(w ^ hash(p.seed));
        }
    } else if p.format == 3u {
        if w % p.block_words < p.scale_words {
            dst[w] = pack2x16float(vec2<f32>(p.scale));
        } else {
            dst[w] = hash(w ^ hash(p.seed));
        }
    } else {
        dst[w] = pack2x16float(vec2<f32>(value(2u * w), value(2u * w + 1u)));
    }
}
