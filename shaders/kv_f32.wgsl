// kv_f32.wgsl: KV-cache format prelude for f32 keys and values (see src/shaders.rs).
alias KvPacked = vec4<f32>;

fn unpack_kv(p: KvPacked) -> vec4<f32> {
    return p;
}

fn pack_kv(v: vec4<f32>) -> KvPacked {
    return v;
}
