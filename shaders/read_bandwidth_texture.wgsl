// read_bandwidth_texture.wgsl: read_bandwidth.wgsl's stream, read from a
// texture instead of a storage buffer: the path the `cpu` kernel set reads
// its weights through (weights_texture.wgsl), and on lavapipe the faster
// one (docs/ARCHITECTURE.md, "lavapipe facts"). `sieve bench` measures
// both and compares decode speed with the faster.
//
// Same work per invocation as read_bandwidth.wgsl: four independent
// 16-byte fetches in flight, adjacent lanes fetching adjacent texels, and
// texels found as the weights kernels find theirs (a shift and a mask).
//
// Bindings (group 0):
//   0 src  texture_2d<u32>, Rgba32Uint: 1 << PROBE_TEXTURE_SHIFT texels per
//          row (src/weights.rs: WEIGHT_TEXTURE_WIDTH), or one shorter row;
//          n = width x height texels in row-major order
//   1 dst  storage rw    [invocations] u32
// Dispatch: (groups, 1, 1), groups <= 65,535, with 256 invocations each;
// invocation i reads texels i + j * stride for j = 0, 1, ... where stride =
// groups * 256, and writes the wrapping sum of all their components to
// dst[i].
@group(0) @binding(0) var src: texture_2d<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;

// log2 of the texels per texture row, as W_TEXTURE_SHIFT in
// weights_texture.wgsl.
const PROBE_TEXTURE_SHIFT: u32 = 12u;

fn texel(t: u32) -> vec4<u32> {
    let width = 1u << PROBE_TEXTURE_SHIFT;
    return textureLoad(src, vec2<u32>(t & (width - 1u), t >> PROBE_TEXTURE_SHIFT), 0);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // As in read_bandwidth.wgsl, the clamps keep every loop finite.
    let stride = min(nwg.x, 65535u) * 256u;
    let size = textureDimensions(src);
    let n = bounded(size.x * size.y);
    var a = vec4<u32>(0u);
    var b = vec4<u32>(0u);
    var c = vec4<u32>(0u);
    var d = vec4<u32>(0u);
    var i = gid.x;
    for (; i + 3u * stride < n; i += 4u * stride) { // loop bound: n = bounded(..), stride < 2^24
        a += texel(i);
        b += texel(i + stride);
        c += texel(i + 2u * stride);
        d += texel(i + 3u * stride);
    }
    for (; i < n; i += stride) { // loop bound: as above
        a += texel(i);
    }
    let s = a + b + c + d;
    dst[gid.x] = s.x + s.y + s.z + s.w;
}
