// attention_heads_wide.wgsl: the wide build of attention.wgsl, the `gpu`
// decode kernels and the tiled prefill (included
// before attention_io.wgsl in its place of attention_heads.wgsl; see
// src/shaders.rs): heads of up to 4 x HD4_MAX = 256 values (Gemma 3), up to
// GMAX = 4 query heads per KV head, so that the workgroup arrays of
// GMAX x HD4_MAX queries keep their size (4 KiB).
const HD4_MAX: u32 = 64u;
const GMAX: u32 = 4u;
