// read_bandwidth.wgsl: streams a buffer and writes one sum per invocation, to
// measure the device's streaming-read bandwidth (`sieve bench`).
//
// Bindings (group 0):
//   0 src  storage read  [n] vec4<f32>
//   1 dst  storage rw    [invocations] f32
// Dispatch: (groups, 1, 1) with 64 invocations each; invocation i reads elements
// i, i + stride, ... where stride = groups * 64 (coalesced on GPUs).
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 64u;
    let n = arrayLength(&src);
    var acc = vec4<f32>(0.0);
    for (var i = gid.x; i < n; i += stride) {
        acc += src[i];
    }
    dst[gid.x] = acc.x + acc.y + acc.z + acc.w;
}
