// attention_heads.wgsl: the head sizes the attention kernels' per-lane and
// workgroup arrays are made for (included before attention_io.wgsl; see
// src/shaders.rs): heads of up to 4 x HD4_MAX = 128 values, up to GMAX = 8
// query heads per KV head. attention_heads_wide.wgsl is the wide build's.
const HD4_MAX: u32 = 32u;
const GMAX: u32 = 8u;
