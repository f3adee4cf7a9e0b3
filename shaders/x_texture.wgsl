// x_texture.wgsl: copies the input x of a `cpu` mat-vec or mat-mul
// (matmul.wgsl) into a texture before the product reads it.
//
// Why: on lavapipe a storage-buffer load costs a loop over the SIMD lanes
// while a texel fetch is vector code (docs/ARCHITECTURE.md, "lavapipe
// facts"), and the `cpu` products read each x value once per four or eight
// weight rows; this copy reads it once.
//
// Bindings (group 0): as x_copy_io.wgsl, with
//   3 xt    texture_storage_2d<rgba32uint, write>, at least k4 x n texels:
//           texel (k, t) holds the bits of x[t * k4 + k]
// Dispatch: (ceil(k4 / 64), n, 1).

@group(0) @binding(3) var xt: texture_storage_2d<rgba32uint, write>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (!copies(gid)) {
        return;
    }
    textureStore(xt, gid.xy, bitcast<vec4<u32>>(x[gid.y * p.k4 + gid.x]));
}
