//! The WGSL kernels under `shaders/`, embedded at compile time.
//!
//! A kernel's source is `common.wgsl` (the shared `Step` and `Page` uniforms),
//! then, for kernels that read packed data, one format prelude: for weights
//! `weights_<format>.wgsl` (the weights binding `w` and `weight4`), for the KV
//! cache `kv_f16.wgsl` or `kv_f32.wgsl` (`KvPacked`, `unpack_kv`, `pack_kv`);
//! then the declarations it shares with its sibling variants (for the mat-mul
//! variants `matmul_io.wgsl`, and the `gpu` mat-vecs also `matvec_rows.wgsl`;
//! for attention `attention_io.wgsl`, and the `gpu` decode kernels also
//! `attention_decode_io.wgsl`), then the kernel file itself. `enable`
//! directives of the kernel are moved to the top, where WGSL wants them.
//! `all()` lists every kernel so that a test can validate each one
//! with naga and translate it to SPIR-V, MSL and HLSL.

use anyhow::{anyhow, bail, Result};

use crate::formats::{KvFormat, WeightFormat};

/// One kernel file.
#[derive(Debug)]
pub struct Shader {
    pub name: &'static str,
    pub file: &'static str,
    pub body: &'static str,
    /// Which packed data the kernel reads, and so which format prelude it takes.
    pub prelude: Prelude,
    /// Shared declarations the kernel includes after the prelude.
    pub include: &'static str,
}

/// The format prelude a kernel takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prelude {
    None,
    /// Weight matrices (`WPacked`).
    Weights,
    /// Weight matrices in a block format only (the integer-dot mat-vec:
    /// the preludes' `dot32_q8`).
    BlockWeights,
    /// KV-cache rows (`KvPacked`).
    Kv,
}

const COMMON: &str = include_str!("../shaders/common.wgsl");
/// How the weight-format preludes reach the matrix: binding 2 and `w_at`,
/// `w_at2`, by where the matrix lives ([`WeightStore`]; for a texture, by
/// the format's word type too: `WeightFormat::texture_words`).
const WEIGHTS_BUFFER: &str = include_str!("../shaders/weights_buffer.wgsl");
const WEIGHTS_TEXTURE: &str = include_str!("../shaders/weights_texture.wgsl");

/// Where a weight matrix lives on the device (`src/weights.rs`), and so
/// which binding the weight-format preludes read it through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightStore {
    /// Storage buffers (`weights_buffer.wgsl`): the `gpu` and `tuned` sets.
    Buffer,
    /// Rgba32Uint textures (`weights_texture.wgsl`): the `cpu` set, for
    /// lavapipe, which fetches texels with vector code but loads a storage
    /// buffer one lane at a time (docs/ARCHITECTURE.md, "Kernel variants").
    Texture,
}

impl WeightStore {
    pub const ALL: [WeightStore; 2] = [WeightStore::Buffer, WeightStore::Texture];

    /// The store `SIEVE_WEIGHTS` asks for (`buffer` or `texture`), None if
    /// it is unset; an error names the variable and the values it takes.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var("SIEVE_WEIGHTS").as_deref() {
            Err(_) | Ok("") => Ok(None),
            Ok("buffer") => Ok(Some(WeightStore::Buffer)),
            Ok("texture") => Ok(Some(WeightStore::Texture)),
            Ok(other) => bail!("SIEVE_WEIGHTS={other:?}: expected buffer or texture"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightStore::Buffer => "buffer",
            WeightStore::Texture => "texture",
        }
    }

    /// The binding declarations for weights of `format` stored this way.
    fn binding(self, format: WeightFormat) -> String {
        match self {
            WeightStore::Buffer => WEIGHTS_BUFFER.to_string(),
            WeightStore::Texture => {
                format!("{WEIGHTS_TEXTURE}\n{}", format.texture_words())
            }
        }
    }
}

/// What the products share, then x as the f32 ones read it.
const MATMUL_IO: &str = concat!(
    include_str!("../shaders/matmul_io.wgsl"),
    include_str!("../shaders/matmul_x.wgsl")
);
/// The `gpu` mat-vecs also share their lane loop.
const MATVEC_IO: &str = concat!(
    include_str!("../shaders/matmul_io.wgsl"),
    include_str!("../shaders/matmul_x.wgsl"),
    include_str!("../shaders/matvec_rows.wgsl")
);
/// The subgroup mat-vec adds their sums' last step.
const MATVEC_SUBGROUP_IO: &str = concat!(
    include_str!("../shaders/matmul_io.wgsl"),
    include_str!("../shaders/matmul_x.wgsl"),
    include_str!("../shaders/matvec_rows.wgsl"),
    include_str!("../shaders/matvec_sums.wgsl")
);
/// Its `HalfX` build reads x in f16, with nothing to fold in.
const MATVEC_SUBGROUP_X16_IO: &str = concat!(
    include_str!("../shaders/matmul_io.wgsl"),
    include_str!("../shaders/matmul_x16.wgsl"),
    include_str!("../shaders/matvec_rows.wgsl"),
    include_str!("../shaders/matvec_sums.wgsl")
);
/// The kernels that prepare a mat-vec's x once per token share their input.
const X_INPUT: &str = include_str!("../shaders/x_input.wgsl");
/// The integer-dot mat-vec reads x's q8 blocks, not x.
const MATVEC_Q8_IO: &str = concat!(
    include_str!("../shaders/matmul_io.wgsl"),
    include_str!("../shaders/matvec_sums.wgsl")
);
/// The attention kernels' head sizes, then what they share.
const ATTENTION_IO: &str = concat!(
    include_str!("../shaders/attention_heads.wgsl"),
    include_str!("../shaders/attention_io.wgsl")
);
/// The same for the wide build of attention.wgsl (heads of up to 256).
const ATTENTION_WIDE_IO: &str = concat!(
    include_str!("../shaders/attention_heads_wide.wgsl"),
    include_str!("../shaders/attention_io.wgsl")
);
/// The two copies of a product's input share their parameters and input.
const X_COPY_IO: &str = include_str!("../shaders/x_copy_io.wgsl");
/// The `gpu` decode attentions also share the phases after their scores.
const ATTENTION_DECODE_IO: &str = concat!(
    include_str!("../shaders/attention_heads.wgsl"),
    include_str!("../shaders/attention_io.wgsl"),
    include_str!("../shaders/attention_decode_io.wgsl")
);
/// The same for their wide builds (heads of up to 256).
const ATTENTION_DECODE_WIDE_IO: &str = concat!(
    include_str!("../shaders/attention_heads_wide.wgsl"),
    include_str!("../shaders/attention_io.wgsl"),
    include_str!("../shaders/attention_decode_io.wgsl")
);

macro_rules! shader {
    ($ident:ident, $name:literal, $prelude:ident) => {
        shader!($ident, $name, $prelude, "");
    };
    ($ident:ident, $name:literal, $prelude:ident, $include:expr) => {
        pub const $ident: Shader = Shader {
            name: $name,
            file: concat!("shaders/", $name, ".wgsl"),
            body: include_str!(concat!("../shaders/", $name, ".wgsl")),
            prelude: Prelude::$prelude,
            include: $include,
        };
    };
}

shader!(EMBED, "embed", Weights);
shader!(RMSNORM, "rmsnorm", None);
shader!(HEAD_NORM, "head_norm", None);
shader!(MATMUL, "matmul", Weights, MATMUL_IO);
shader!(MATVEC_WORKGROUP, "matvec_workgroup", Weights, MATVEC_IO);
shader!(
    MATVEC_SUBGROUP,
    "matvec_subgroup",
    Weights,
    MATVEC_SUBGROUP_IO
);
shader!(MATVEC_Q8, "matvec_q8", BlockWeights, MATVEC_Q8_IO);
/// matvec_subgroup.wgsl reading x in f16 (x_half.wgsl's; `HalfX`).
pub const MATVEC_SUBGROUP_X16: Shader = Shader {
    name: "matvec_subgroup_x16",
    file: "shaders/matvec_subgroup.wgsl",
    body: include_str!("../shaders/matvec_subgroup.wgsl"),
    prelude: Prelude::Weights,
    include: MATVEC_SUBGROUP_X16_IO,
};
shader!(QUANTIZE_Q8, "quantize_q8", None, X_INPUT);
shader!(X_HALF, "x_half", None, X_INPUT);
shader!(MATMUL_TILED, "matmul_tiled", Weights, MATMUL_IO);
shader!(MATMUL_COOP, "matmul_coop", None, MATMUL_IO);
shader!(MATMUL_COOP_STAGED, "matmul_coop_staged", Weights, MATMUL_IO);
shader!(ROPE_KV, "rope_kv", Kv);
shader!(ATTENTION, "attention", Kv, ATTENTION_IO);
/// attention.wgsl built for heads of up to 256 values (and up to 4 query
/// heads per KV head; attention_heads_wide.wgsl).
pub const ATTENTION_WIDE: Shader = Shader {
    name: "attention_wide",
    file: "shaders/attention.wgsl",
    body: include_str!("../shaders/attention.wgsl"),
    prelude: Prelude::Kv,
    include: ATTENTION_WIDE_IO,
};
shader!(
    ATTENTION_DECODE,
    "attention_decode",
    Kv,
    ATTENTION_DECODE_IO
);
shader!(
    ATTENTION_DECODE_LANES,
    "attention_decode_lanes",
    Kv,
    ATTENTION_DECODE_IO
);
/// The `gpu` decode kernels built for heads of up to 256 values (and up to
/// 4 query heads per KV head; attention_heads_wide.wgsl).
pub const ATTENTION_DECODE_WIDE: Shader = Shader {
    name: "attention_decode_wide",
    include: ATTENTION_DECODE_WIDE_IO,
    ..ATTENTION_DECODE
};
pub const ATTENTION_DECODE_LANES_WIDE: Shader = Shader {
    name: "attention_decode_lanes_wide",
    include: ATTENTION_DECODE_WIDE_IO,
    ..ATTENTION_DECODE_LANES
};
shader!(
    ATTENTION_DECODE_SPLIT,
    "attention_decode_split",
    Kv,
    ATTENTION_DECODE_IO
);
pub const ATTENTION_DECODE_SPLIT_WIDE: Shader = Shader {
    name: "attention_decode_split_wide",
    include: ATTENTION_DECODE_WIDE_IO,
    ..ATTENTION_DECODE_SPLIT
};
shader!(ATTENTION_PREFILL, "attention_prefill", Kv, ATTENTION_IO);
/// attention_prefill.wgsl built for heads of up to 256 values (tiles of 4
/// keys; attention_heads_wide.wgsl).
pub const ATTENTION_PREFILL_WIDE: Shader = Shader {
    name: "attention_prefill_wide",
    include: ATTENTION_WIDE_IO,
    ..ATTENTION_PREFILL
};
shader!(
    ATTENTION_PREFILL_COOP,
    "attention_prefill_coop",
    Kv,
    ATTENTION_IO
);

shader!(SILU_MUL, "silu_mul", None);
shader!(SAMPLE, "sample", None);
shader!(COMPACT, "compact", None);
shader!(TOKEN_LOGIT, "token_logit", Weights);
shader!(ATTN_WEIGHTS, "attn_weights", Kv);
shader!(KEY_SCORES, "key_scores", Kv);
shader!(QUERY_SCORES, "query_scores", Kv);
shader!(EPIKV_DELTA, "epikv_delta", None);
shader!(READ_BANDWIDTH, "read_bandwidth", None);
shader!(READ_BANDWIDTH_TEXTURE, "read_bandwidth_texture", None);
shader!(X_TEXTURE, "x_texture", None, X_COPY_IO);
shader!(X_F16, "x_f16", None, X_COPY_IO);
shader!(RANDOM_FILL, "random_fill", None);

/// Every kernel, for validation tests.
pub fn all() -> Vec<&'static Shader> {
    vec![
        &EMBED,
        &RMSNORM,
        &HEAD_NORM,
        &MATMUL,
        &MATVEC_WORKGROUP,
        &MATVEC_SUBGROUP,
        &MATVEC_SUBGROUP_X16,
        &MATVEC_Q8,
        &QUANTIZE_Q8,
        &X_HALF,
        &MATMUL_TILED,
        &MATMUL_COOP,
        &MATMUL_COOP_STAGED,
        &ROPE_KV,
        &ATTENTION,
        &ATTENTION_WIDE,
        &ATTENTION_DECODE,
        &ATTENTION_DECODE_LANES,
        &ATTENTION_DECODE_WIDE,
        &ATTENTION_DECODE_LANES_WIDE,
        &ATTENTION_DECODE_SPLIT,
        &ATTENTION_DECODE_SPLIT_WIDE,
        &ATTENTION_PREFILL_WIDE,
        &ATTENTION_PREFILL,
        &ATTENTION_PREFILL_COOP,
        &SILU_MUL,
        &SAMPLE,
        &COMPACT,
        &TOKEN_LOGIT,
        &ATTN_WEIGHTS,
        &KEY_SCORES,
        &QUERY_SCORES,
        &EPIKV_DELTA,
        &READ_BANDWIDTH,
        &READ_BANDWIDTH_TEXTURE,
        &X_TEXTURE,
        &X_F16,
        &RANDOM_FILL,
    ]
}

/// Whether `shader` is one of sieve's own kernels (its body and shared
/// declarations), whose loops are known to end: only these are compiled
/// without wgpu's loop bounding (see `Gpu::pipeline`).
pub fn is_builtin(shader: &Shader) -> bool {
    all()
        .iter()
        .any(|s| s.body == shader.body && s.include == shader.include)
}

/// The packed data a kernel's prelude is assembled for: weights in a
/// weight format, or KV-cache rows in a KV format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Packed {
    Weights(WeightFormat),
    Kv(KvFormat),
}

impl Packed {
    /// The format's name (`q4_0`; `kv f16` for the KV cache's).
    pub fn name(self) -> String {
        match self {
            Packed::Weights(f) => f.name().to_string(),
            Packed::Kv(f) => format!("kv {}", f.name()),
        }
    }
}

impl From<WeightFormat> for Packed {
    fn from(f: WeightFormat) -> Self {
        Packed::Weights(f)
    }
}

impl From<KvFormat> for Packed {
    fn from(f: KvFormat) -> Self {
        Packed::Kv(f)
    }
}

/// The full WGSL source of a kernel. `packed` (its weights' or its KV
/// cache's format, as its [`Prelude`] says) is required exactly when the
/// kernel takes a prelude; `store` (where its weights live) matters only
/// to kernels that read weights.
pub fn source(shader: &Shader, packed: Option<Packed>, store: WeightStore) -> String {
    let prelude = match (shader.prelude, packed) {
        (Prelude::None, _) => String::new(),
        (Prelude::Weights, Some(Packed::Weights(f))) => {
            format!("{}\n{}", f.prelude(), store.binding(f))
        }
        (Prelude::BlockWeights, Some(Packed::Weights(f))) if f.block().is_some() => {
            format!("{}\n{}", f.prelude(), store.binding(f))
        }
        (Prelude::Kv, Some(Packed::Kv(f))) => f.prelude().to_string(),
        (_, p) => panic!(
            "kernel {} takes a {:?} prelude, given {p:?}",
            shader.name, shader.prelude
        ),
    };
    let (enables, body): (Vec<&str>, Vec<&str>) =
        shader.body.lines().partition(|l| l.starts_with("enable "));
    format!(
        "{}\n{COMMON}\n{prelude}\n{}\n{}",
        enables.join("\n"),
        shader.include,
        body.join("\n")
    )
}

/// One kernel module [`source`] can assemble: a kernel with one format
/// and one weight store ([`formats`], [`stores`]).
#[derive(Clone, Copy, Debug)]
pub struct Module {
    pub shader: &'static Shader,
    pub packed: Option<Packed>,
    pub store: WeightStore,
}

impl Module {
    /// Its WGSL, as the WGSL specification wants it ([`source`]).
    pub fn source(&self) -> String {
        source(self.shader, self.packed, self.store)
    }

    /// A file name that says what it is: the kernel, then its format and,
    /// for a kernel that reads weights, where they live
    /// (`matvec_subgroup-q4_k-buffer.wgsl`, `attention-kv_f16.wgsl`).
    pub fn file_name(&self) -> String {
        let mut name = self.shader.name.to_string();
        match self.packed {
            Some(Packed::Weights(f)) => name = format!("{name}-{}-{}", f.name(), self.store.name()),
            Some(Packed::Kv(f)) => name = format!("{name}-kv_{}", f.name()),
            None => {}
        }
        name + ".wgsl"
    }
}

/// Every kernel module sieve can assemble: each kernel with each format
/// and store it takes.
pub fn modules() -> Vec<Module> {
    let mut out = vec![];
    for shader in all() {
        for packed in formats(shader) {
            for store in stores(shader) {
                out.push(Module {
                    shader,
                    packed,
                    store,
                });
            }
        }
    }
    out
}

/// A hash of every kernel module sieve can assemble with weights stored
/// as `store` (each kernel with each format it takes): what the tuning
/// cache's key holds of the kernels, so that a changed kernel, prelude or
/// shared declaration times again.
pub fn sources_hash(store: WeightStore) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for shader in all() {
        for f in formats(shader) {
            source(shader, f, store).hash(&mut h);
        }
    }
    h.finish()
}

/// Enable-extensions the WGSL specification requires (and Tint, Dawn's
/// compiler, with it) that naga 30 refuses to parse: naga takes subgroup
/// builtins without an `enable` and checks them against the device's
/// features instead.
const NOT_FOR_NAGA: &[&str] = &["enable subgroups;"];

/// A kernel source as naga reads it: [`source`]'s text with the
/// directives of `NOT_FOR_NAGA` blanked (spaces, so that naga's error
/// spans still point into `src`). wgpu compiles WGSL with naga except on
/// the web, where the browser reads [`source`]'s text as it is.
pub fn naga_source(src: &str) -> String {
    let mut out = src.to_string();
    for directive in NOT_FOR_NAGA {
        out = out.replace(directive, &" ".repeat(directive.len()));
    }
    out
}

/// naga's module of a kernel source ([`source`]'s text, read as
/// [`naga_source`]); its error spans point into `src`.
pub fn parse(src: &str) -> Result<naga::Module, naga::front::wgsl::ParseError> {
    naga::front::wgsl::parse_str(&naga_source(src))
}

/// Whether a kernel uses cooperative matrices (tensor cores).
pub fn uses_cooperative_matrices(shader: &Shader) -> bool {
    enables(shader).contains(&"wgpu_cooperative_matrix")
}

/// Every format a kernel can be assembled with by [`source`]: None for a
/// kernel without a prelude, every weight format for weights, f16 and f32
/// for the KV cache.
pub fn formats(shader: &Shader) -> Vec<Option<Packed>> {
    match shader.prelude {
        Prelude::None => vec![None],
        Prelude::Weights => WeightFormat::ALL.map(|f| Some(f.into())).to_vec(),
        Prelude::BlockWeights => WeightFormat::ALL
            .into_iter()
            .filter(|f| f.block().is_some())
            .map(|f| Some(f.into()))
            .collect(),
        Prelude::Kv => KvFormat::ALL.map(|f| Some(f.into())).to_vec(),
    }
}

/// Every store a kernel can be assembled for by [`source`]: both for a
/// kernel that reads weights, one (which [`source`] ignores) for the rest.
pub fn stores(shader: &Shader) -> Vec<WeightStore> {
    match shader.prelude {
        Prelude::Weights | Prelude::BlockWeights => WeightStore::ALL.to_vec(),
        _ => vec![WeightStore::Buffer],
    }
}

/// The optional features a kernel's source asks for with `enable`
/// (`f16`, `subgroups`, `wgpu_cooperative_matrix`).
pub fn enables(shader: &Shader) -> Vec<&'static str> {
    shader
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("enable "))
        .map(|l| l.trim_end_matches(';').trim())
        .collect()
}

/// A kernel source (as [`source`] assembles it) parsed and validated by
/// naga with `capabilities`. `file` names the kernel in errors.
pub(crate) fn validated_module(
    src: &str,
    file: &str,
    capabilities: naga::valid::Capabilities,
) -> Result<(naga::Module, naga::valid::ModuleInfo)> {
    let module = parse(src).map_err(|e| anyhow!("{file}: {}", e.emit_to_string(src)))?;
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities)
        .validate(&module)
        .map_err(|e| anyhow!("{file}: {}", e.emit_to_string(src)))?;
    Ok((module, info))
}

/// `entry` (which must exist) of a module from [`validated_module`], with
/// the override constants applied by naga, which also drops the other
/// entry points and what only they use.
pub(crate) fn entry_module(
    (module, info): &(naga::Module, naga::valid::ModuleInfo),
    file: &str,
    entry: &str,
    constants: &[(&str, f64)],
) -> Result<(naga::Module, naga::valid::ModuleInfo)> {
    let constants: naga::back::PipelineConstants =
        constants.iter().map(|&(k, v)| (k.to_string(), v)).collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        module,
        info,
        Some((naga::ShaderStage::Compute, entry)),
        &constants,
    )
    .map_err(|e| anyhow!("{file}: override constants: {e}"))?;
    if !module.entry_points.iter().any(|e| e.name == entry) {
        bail!("{file}: no entry point {entry}");
    }
    Ok((module.into_owned(), info.into_owned()))
}

/// Bytes of workgroup memory that `entry` of a kernel source (as
/// [`source`] assembles it) uses with the given override constants: the
/// sizes naga gives the workgroup variables the entry point uses, each
/// rounded up to 16 bytes, summed.
/// wgpu does not check this against the device's limit, so sieve does,
/// for every pipeline it builds (`Gpu::pipeline`). `file` names the
/// kernel in errors.
pub fn workgroup_bytes(
    src: &str,
    file: &str,
    entry: &str,
    constants: &[(&str, f64)],
) -> Result<u64> {
    let parsed = validated_module(src, file, naga::valid::Capabilities::all())?;
    let (module, info) = entry_module(&parsed, file, entry, constants)?;
    let index = module.entry_points.iter().position(|e| e.name == entry);
    let uses = info.get_entry_point(index.expect("entry_module checks it"));
    // Each variable rounded up to 16 bytes, as WebGPU counts them (a
    // driver may pad scalars beside vectors as much).
    Ok(module
        .global_variables
        .iter()
        .filter(|(h, v)| v.space == naga::AddressSpace::WorkGroup && !uses[*h].is_empty())
        .map(|(_, v)| (module.types[v.ty].inner.size(module.to_ctx()) as u64).next_multiple_of(16))
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only sieve's own kernels are compiled without wgpu's loop bounding:
    /// a kernel with another body or other shared declarations is not one.
    #[test]
    fn builtin_kernels_are_recognised_and_others_are_not() {
        assert!(all().into_iter().all(is_builtin));
        let foreign = Shader {
            body: "@compute @workgroup_size(1) fn main() { loop {} }",
            ..MATMUL_TILED
        };
        assert!(!is_builtin(&foreign));
        let foreign_include = Shader {
            include: "fn spin() { loop {} }",
            ..MATMUL_TILED
        };
        assert!(!is_builtin(&foreign_include));
    }

    /// Workgroup memory as naga lays it out, per entry point and with the
    /// override constants applied: the figures the kernels' headers give.
    #[test]
    fn workgroup_bytes_count_what_an_entry_point_uses() {
        let bytes = |shader: &Shader, format, entry, constants: &[(&str, f64)]| {
            workgroup_bytes(
                &source(shader, format, WeightStore::Buffer),
                shader.file,
                entry,
                constants,
            )
            .unwrap()
        };
        let kv16 = Some(KvFormat::F16.into());
        let (f16, q4) = (
            Some(WeightFormat::F16.into()),
            Some(WeightFormat::Q4_0.into()),
        );
        // The `gpu` decode attentions: 16 KiB, what Vulkan and WebGPU promise.
        for shader in [&ATTENTION_DECODE, &ATTENTION_DECODE_LANES] {
            assert_eq!(
                bytes(shader, kv16, "decode_partial", &[("GROUP", 4.0)]),
                16384
            );
        }
        // The split-key decode: its queries, key groups' sums and states;
        // its merge: the reduction arrays it shares with them.
        for shader in [&ATTENTION_DECODE_SPLIT, &ATTENTION_DECODE_SPLIT_WIDE] {
            assert_eq!(bytes(shader, kv16, "decode_partial", &[]), 12800);
            assert_eq!(bytes(shader, kv16, "merge", &[]), 12288);
        }
        // Their wide builds, and the tiled prefill's: the same arrays.
        assert_eq!(
            bytes(&ATTENTION_PREFILL_WIDE, kv16, "prefill_partial", &[]),
            16384
        );
        for shader in [&ATTENTION_DECODE_WIDE, &ATTENTION_DECODE_LANES_WIDE] {
            assert_eq!(
                bytes(shader, kv16, "decode_partial", &[("GROUP", 2.0)]),
                16384
            );
        }
        // attention.wgsl: the decode entry uses its workgroup arrays, the
        // prefill entry (one query per lane) none.
        assert_eq!(
            bytes(&ATTENTION, kv16, "decode_partial", &[]),
            4096 + 8192 + 64
        );
        assert_eq!(bytes(&ATTENTION, kv16, "prefill_partial", &[]), 0);
        // Its wide build: the same arrays, GMAX x HD4_MAX queries both ways.
        assert_eq!(
            bytes(&ATTENTION_WIDE, kv16, "decode_partial", &[]),
            4096 + 8192 + 32
        );
        // Sized by override constants.
        let staged = |wide| bytes(&MATMUL_COOP_STAGED, q4, "matmul", &[("WIDE", wide)]);
        assert_eq!((staged(1.0), staged(2.0)), (16384, 20480));
        let lanes = |l: f64, r: f64| {
            bytes(
                &MATVEC_WORKGROUP,
                f16,
                "matvec",
                &[("LANES", l), ("ROWS", r)],
            )
        };
        assert_eq!((lanes(64.0, 2.0), lanes(256.0, 8.0)), (512, 8192));
        // Variables rounded up to 16 bytes each, unused ones not counted.
        let src = "var<workgroup> a: u32;
var<workgroup> b: array<vec4<f32>, 4>;
var<workgroup> unused: array<f32, 1000>;
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(4)
fn main(@builtin(local_invocation_index) i: u32) {
    a = i;
    b[i] = vec4<f32>(1.0);
    workgroupBarrier();
    out[i] = a + u32(b[3u - i].x);
}
fn other() { unused[0] = 1.0; }";
        assert_eq!(
            workgroup_bytes(src, "probe.wgsl", "main", &[]).unwrap(),
            16 + 64
        );
        let e = workgroup_bytes(
            &source(&ATTENTION, kv16, WeightStore::Buffer),
            "attention.wgsl",
            "nope",
            &[],
        );
        assert!(format!("{:#}", e.unwrap_err()).contains("attention.wgsl: no entry point nope"));
    }
}
