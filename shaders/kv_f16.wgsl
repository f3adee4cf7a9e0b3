// kv_f16.wgsl: KV-cache format prelude for f16 keys and values (see
// src/shaders.rs). Four consecutive values of a key or value row are packed in
// two u32 words; pack2x16float/unpack2x16float are core WGSL, so this works
// with or without the SHADER_F16 feature. Half the memory and bandwidth of
// f32, with f16's rounding (about 3 decimal digits) on every cached value.
alias KvPacked = vec2<u32>;

fn unpack_kv(p: KvPacked) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(p.x), unpack2x16float(p.y));
}

fn pack_kv(v: vec4<f32>) -> KvPacked {
    return vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
}
