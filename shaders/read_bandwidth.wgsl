// read_bandwidth.wgsl: streams a buffer and writes one sum per invocation, to
// measure the device's streaming-read bandwidth (`sieve bench`), the bound
// that decode speed is compared with.
//
// Built to saturate a GPU's memory system: 16-byte loads, adjacent lanes
// reading adjacent words (each subgroup load is one contiguous run), four
// independent loads in flight per lane, and enough workgroups to fill every
// compute unit (the launcher picks the count from the buffer size).
//
// Bindings (group 0):
//   0 src  storage read  [n] vec4<u32>
//   1 dst  storage rw    [invocations] u32
// Dispatch: (groups, 1, 1), groups <= 65,535, with 256 invocations each; invocation i reads
// elements i + j * stride for j = 0, 1, ... where stride = groups * 256, and
// writes the wrapping sum of all their components to dst[i].
@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // The launcher dispatches at most 65,535 groups (as DX12 and Metal
    // allow); the clamps keep every loop below finite whatever the dispatch
    // and binding sizes.
    let stride = min(nwg.x, 65535u) * 256u;
    let n = bounded(arrayLength(&src));
    var a = vec4<u32>(0u);
    var b = vec4<u32>(0u);
    var c = vec4<u32>(0u);
    var d = vec4<u32>(0u);
    var i = gid.x;
    for (; i + 3u * stride < n; i += 4u * stride) { // loop bound: n = bounded(..), stride < 2^24
        a += src[i];
        b += src[i + stride];
        c += src[i + 2u * stride];
        d += src[i + 3u * stride];
    }
    for (; i < n; i += stride) { // loop bound: as above
        a += src[i];
    }
    let s = a + b + c + d;
    dst[gid.x] = s.x + s.y + s.z + s.w;
}
