//! The WGSL kernels under `shaders/`, embedded at compile time.
//!
//! A kernel's source is `common.wgsl` (the shared `Step` uniform), then, for
//! kernels that read weights, one weight-format prelude (`weights_f16.wgsl` or
//! `weights_f32.wgsl`, which define `WPacked` and `unpack_w`), then the kernel
//! file itself. `all()` lists every kernel so that a test can validate each one
//! with naga and translate it to SPIR-V, MSL and HLSL.

/// One kernel file.
#[derive(Debug)]
pub struct Shader {
    pub name: &'static str,
    pub file: &'static str,
    pub body: &'static str,
    /// Whether the kernel reads weights and so needs a weight-format prelude.
    pub reads_weights: bool,
}

/// Storage format of weight matrices on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F16,
    F32,
}

impl WeightFormat {
    pub fn bytes_per_value(self) -> u64 {
        match self {
            WeightFormat::F16 => 2,
            WeightFormat::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F16 => "f16",
            WeightFormat::F32 => "f32",
        }
    }
}

const COMMON: &str = include_str!("../shaders/common.wgsl");
const WEIGHTS_F16: &str = include_str!("../shaders/weights_f16.wgsl");
const WEIGHTS_F32: &str = include_str!("../shaders/weights_f32.wgsl");

macro_rules! shader {
    ($ident:ident, $name:literal, $weights:literal) => {
        pub const $ident: Shader = Shader {
            name: $name,
            file: concat!("shaders/", $name, ".wgsl"),
            body: include_str!(concat!("../shaders/", $name, ".wgsl")),
            reads_weights: $weights,
        };
    };
}

shader!(EMBED, "embed", true);
shader!(RMSNORM, "rmsnorm", false);
shader!(MATMUL, "matmul", true);
shader!(ROPE_KV, "rope_kv", false);
shader!(ATTENTION, "attention", false);

shader!(SILU_MUL, "silu_mul", false);
shader!(SAMPLE, "sample", false);
shader!(COMPACT, "compact", false);
shader!(TOKEN_LOGIT, "token_logit", true);
shader!(ATTN_WEIGHTS, "attn_weights", false);
shader!(EPIKV_DELTA, "epikv_delta", false);
shader!(READ_BANDWIDTH, "read_bandwidth", false);
shader!(RANDOM_FILL, "random_fill", false);

/// Every kernel, for validation tests.
pub fn all() -> Vec<&'static Shader> {
    vec![
        &EMBED,
        &RMSNORM,
        &MATMUL,
        &ROPE_KV,
        &ATTENTION,
        &SILU_MUL,
        &SAMPLE,
        &COMPACT,
        &TOKEN_LOGIT,
        &ATTN_WEIGHTS,
        &EPIKV_DELTA,
        &READ_BANDWIDTH,
        &RANDOM_FILL,
    ]
}

/// The full WGSL source of a kernel. `weights` is required exactly when the
/// kernel reads weights.
pub fn source(shader: &Shader, weights: Option<WeightFormat>) -> String {
    let prelude = match (shader.reads_weights, weights) {
        (true, Some(WeightFormat::F16)) => WEIGHTS_F16,
        (true, Some(WeightFormat::F32)) => WEIGHTS_F32,
        (true, None) => panic!("kernel {} needs a weight format", shader.name),
        (false, _) => "",
    };
    format!("{COMMON}\n{prelude}\n{}", shader.body)
}
