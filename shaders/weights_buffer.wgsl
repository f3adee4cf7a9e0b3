// weights_buffer.wgsl: the weights binding as a storage buffer (appended to
// every weight-format prelude when the matrix is stored in buffers: the `gpu`
// and `tuned` kernel sets; see src/shaders.rs and `WeightStore` in
// src/weights.rs). The prelude names its word type `WWord` (u32 for the block
// formats, vec2<u32> for f16, vec4<f32> for f32).
//
// Binding (group 0):
//   2 w  storage read  [words] WWord  one row part of a [rows, k] matrix
//
// `w_at(i)`: word i of the part; `w_at2(i)`: words i and i + 1.
@group(0) @binding(2) var<storage, read> w: array<WWord>;

fn w_at(i: u32) -> WWord {
    return w[i];
}

fn w_at2(i: u32) -> array<WWord, 2> {
    return array<WWord, 2>(w[i], w[i + 1u]);
}
