//! The device layer's facts and settings: the [`DeviceProfile`] read from
//! the adapter once, when the [`crate::gpu::Gpu`] is opened (what kind of
//! device it is: a CPU implementation of Vulkan such as lavapipe or
//! SwiftShader, or a real GPU; its subgroup sizes, workgroup memory and
//! optional features), the [`KernelSet`] asked for, how kernels are
//! compiled there ([`CompileOptions`]) and the `SIEVE_*` environment
//! ([`Settings`]). Which kernel variant each op runs is chosen above this
//! layer, from the profile and the set (`kernels::variants`).

use anyhow::{bail, Result};

use crate::shaders::WeightStore;

/// Which kernel set to use: `--kernels` or `SIEVE_KERNELS`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelSet {
    /// `cpu` on a CPU implementation of the API, `tuned` elsewhere.
    #[default]
    Auto,
    /// Few wide invocations (tuned on lavapipe).
    Cpu,
    /// Many lanes, coalesced loads, workgroup tiles; cooperative matrices
    /// (tensor cores) where the device offers them. Fixed rules pick each
    /// weight matrix's variant.
    Gpu,
    /// The `gpu` set, with each weight matrix's mat-vec and mat-mul variant
    /// chosen by timing the candidates on the device when the engine is
    /// built (src/kernels/tune.rs), the fixed rule's choice first.
    Tuned,
}

impl KernelSet {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => KernelSet::Auto,
            "cpu" => KernelSet::Cpu,
            "gpu" => KernelSet::Gpu,
            "tuned" => KernelSet::Tuned,
            other => bail!(
                "unknown kernel set '{other}' (option --kernels or SIEVE_KERNELS): expected auto, cpu, gpu or tuned"
            ),
        })
    }

    /// The set `Auto` stands for on a device of `profile`: `cpu` on a CPU
    /// implementation of the API, `tuned` elsewhere.
    pub fn resolve(self, profile: &DeviceProfile) -> KernelSet {
        match self {
            KernelSet::Auto if profile.cpu_implementation => KernelSet::Cpu,
            KernelSet::Auto => KernelSet::Tuned,
            other => other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KernelSet::Auto => "auto",
            KernelSet::Cpu => "cpu",
            KernelSet::Gpu => "gpu",
            KernelSet::Tuned => "tuned",
        }
    }
}

/// What the kernels need to know about a device.
#[derive(Clone, Debug)]
pub struct DeviceProfile {
    pub name: String,
    pub vendor: u32,
    pub device_type: wgpu::DeviceType,
    /// A CPU implementation of the graphics API (lavapipe/llvmpipe, SwiftShader).
    pub cpu_implementation: bool,
    pub subgroup_min: u32,
    pub subgroup_max: u32,
    /// Bytes of workgroup memory one workgroup may use.
    pub workgroup_memory: u32,
    /// `enable f16;` shaders (SHADER_F16 was requested).
    pub shader_f16: bool,
    /// Subgroup operations in compute shaders (SUBGROUP was requested).
    pub subgroups: bool,
    /// 16x16x16 cooperative matrices with f16 inputs and f32 accumulators
    /// (EXPERIMENTAL_COOPERATIVE_MATRIX was requested).
    pub coop_f16_16x16: bool,
}

impl DeviceProfile {
    pub fn new(info: &wgpu::AdapterInfo, features: wgpu::Features, limits: &wgpu::Limits) -> Self {
        let lower = info.name.to_ascii_lowercase();
        let cpu_implementation = info.device_type == wgpu::DeviceType::Cpu
            || lower.contains("llvmpipe")
            || lower.contains("swiftshader")
            || lower.contains("lavapipe");
        DeviceProfile {
            name: info.name.clone(),
            vendor: info.vendor,
            device_type: info.device_type,
            cpu_implementation,
            subgroup_min: info.subgroup_min_size,
            subgroup_max: info.subgroup_max_size,
            workgroup_memory: limits.max_compute_workgroup_storage_size,
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            coop_f16_16x16: features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX),
        }
    }

    /// A made-up device for unit tests of the choices made from a profile:
    /// a CPU implementation or a discrete GPU, with or without subgroups
    /// and cooperative matrices.
    #[cfg(any(test, feature = "kernel-checks"))]
    pub(crate) fn for_tests(cpu: bool, subgroups: bool, coop: bool) -> Self {
        DeviceProfile {
            name: "test".into(),
            vendor: 0,
            device_type: if cpu {
                wgpu::DeviceType::Cpu
            } else {
                wgpu::DeviceType::DiscreteGpu
            },
            cpu_implementation: cpu,
            subgroup_min: 32,
            subgroup_max: 32,
            workgroup_memory: 49152,
            shader_f16: true,
            subgroups,
            coop_f16_16x16: coop,
        }
    }
}

/// Whether the adapter's cooperative-matrix configurations include the one
/// sieve's GEMM uses: 16x16x16, f16 inputs, f32 accumulator.
pub fn has_coop_f16_16x16(props: &[wgpu::CooperativeMatrixProperties]) -> bool {
    use wgpu::CooperativeScalarType as T;
    props.iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16) && p.ab_type == T::F16 && p.cr_type == T::F32
    })
}

/// Who writes the SPIR-V a Vulkan driver gets (`SIEVE_SPIRV`: `wgpu`,
/// `coop`, `all`; `coop` by default where the device takes SPIR-V as it
/// is, wgpu's passthrough; `wgpu` elsewhere, and on other backends).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpirvPath {
    /// wgpu translates every kernel.
    Wgpu,
    /// sieve writes its cooperative-matrix kernels itself, under the
    /// GLSL450 memory model (src/spirv.rs says why); wgpu the rest.
    #[default]
    Coop,
    /// sieve writes every kernel itself: the same path for all of them,
    /// so that it runs and is tested where no kernel uses cooperative
    /// matrices (lavapipe).
    All,
}

impl SpirvPath {
    /// The path `SIEVE_SPIRV` asks for (`value`), `Coop` if it is unset
    /// or empty; an error names the variable and the values it takes.
    fn parse(value: Option<&str>) -> Result<Self> {
        match value {
            None | Some("") | Some("coop") => Ok(SpirvPath::Coop),
            Some("wgpu") => Ok(SpirvPath::Wgpu),
            Some("all") => Ok(SpirvPath::All),
            Some(other) => bail!("SIEVE_SPIRV={other:?}: expected wgpu, coop or all"),
        }
    }

    /// Whether sieve writes the SPIR-V of `shader`: its own kernels that
    /// use cooperative matrices, or every kernel with `All`.
    pub fn writes(self, shader: &crate::shaders::Shader) -> bool {
        match self {
            SpirvPath::Wgpu => false,
            SpirvPath::Coop => {
                crate::shaders::is_builtin(shader)
                    && crate::shaders::uses_cooperative_matrices(shader)
            }
            SpirvPath::All => true,
        }
    }
}

/// How sieve compiles its kernels on one device, fixed when the [`Gpu`]
/// is opened (part of every pipeline's cache key).
///
/// [`Gpu`]: crate::gpu::Gpu
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompileOptions {
    /// Whether sieve's own kernels keep the loop counter wgpu adds to every
    /// shader loop (`SIEVE_LOOP_BOUNDING=1`). Off by default: it cost an
    /// H200 a fifth of its decode speed, and dropping it is sound since
    /// every loop of the kernels ends (docs/ARCHITECTURE.md, "Kernel
    /// variants").
    pub bounded_loops: bool,
    /// Who writes the SPIR-V of the kernels that a Vulkan driver gets.
    pub spirv: SpirvPath,
    /// Where weight matrices live: textures for the `cpu` set (lavapipe
    /// fetches texels with vector code and loads storage buffers one lane
    /// at a time), buffers for the others; `SIEVE_WEIGHTS` overrides it.
    pub weight_store: WeightStore,
}

impl CompileOptions {
    /// The options for kernel set `set` (resolved) on a device that takes
    /// SPIR-V as it is (`passthrough`) or not, with the overrides of
    /// `settings`.
    pub fn new(set: KernelSet, passthrough: bool, settings: &Settings) -> Self {
        let default_store = match set {
            KernelSet::Cpu => WeightStore::Texture,
            _ => WeightStore::Buffer,
        };
        CompileOptions {
            bounded_loops: settings.loop_bounding,
            // sieve writes SPIR-V itself only where the driver takes it as it is.
            spirv: if passthrough {
                settings.spirv
            } else {
                SpirvPath::Wgpu
            },
            weight_store: settings.weights.unwrap_or(default_store),
        }
    }
}

/// sieve's `SIEVE_*` environment variables about the device and its
/// kernels, read in one place ([`Settings::from_env`]); an option given on
/// the command line or in [`GpuOptions`](crate::gpu::GpuOptions) wins
/// over its variable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// `SIEVE_BACKEND`: vulkan, metal, dx12 or gl.
    pub backend: Option<String>,
    /// `SIEVE_ADAPTER`: a substring of the adapter's name.
    pub adapter: Option<String>,
    /// `SIEVE_KERNELS`: auto, cpu, gpu or tuned.
    pub kernels: Option<KernelSet>,
    /// `SIEVE_WEIGHTS`: buffer or texture.
    pub weights: Option<WeightStore>,
    /// `SIEVE_SPIRV`: wgpu, coop (the default) or all.
    pub spirv: SpirvPath,
    /// `SIEVE_LOOP_BOUNDING=1`: keep wgpu's shader loop counters.
    pub loop_bounding: bool,
    /// `SIEVE_MATRIX_UNITS=0`: the kernels as on a device without
    /// cooperative matrices (the tiled GEMMs, the tiled prefill attention),
    /// to measure what the matrix units buy.
    pub no_matrix_units: bool,
    /// Where `--kernels tuned` keeps its timings between processes
    /// (`SIEVE_TUNE_CACHE`: a folder, or `off`); by default the user's
    /// cache folder (`$XDG_CACHE_HOME/sieve`, else `$HOME/.cache/sieve`),
    /// None where there is none or it is off; in a browser, the page's
    /// localStorage (items `sieve/tuning-....json`).
    pub tune_cache: Option<std::path::PathBuf>,
    /// `SIEVE_TUNE_FORCE`: `op=pattern` pairs, comma-separated
    /// (`mat-vec=q8 64x2,mat-mul=Tiled`): for every shape of that op,
    /// `--kernels tuned` keeps the candidates the pattern names (the label
    /// equal to it, else the labels it begins, or with `!` first those it
    /// does not begin: `mat-vec=!q8`) and takes the one kept untimed, or
    /// times those kept among themselves (the fixed rule's where it keeps
    /// none). To run a candidate the timings might pick, or to compare
    /// kernels side by side. Ops: `mat-vec`, `mat-mul`, `attention decode`,
    /// `attention prefill`; labels as `sieve bench` prints them
    /// ([`forced`](crate::kernels::tune::forced)).
    pub tune_force: Vec<(String, String)>,
}

/// The ops `SIEVE_TUNE_FORCE` names (`TuneKey::op`).
pub const TUNED_OPS: [&str; 4] = [
    "mat-vec",
    "mat-mul",
    "attention decode",
    "attention prefill",
];

/// `SIEVE_TUNE_FORCE`'s pairs ([`Settings::tune_force`]).
fn parse_tune_force(value: &str) -> Result<Vec<(String, String)>> {
    let mut pairs: Vec<(String, String)> = vec![];
    for pair in value.split(',') {
        let (op, label) = pair.split_once('=').unwrap_or((pair, ""));
        let (op, label) = (op.trim(), label.trim());
        if !TUNED_OPS.contains(&op) || label.trim_start_matches('!').is_empty() {
            bail!(
                "SIEVE_TUNE_FORCE={value:?}: expected op=pattern pairs separated by commas, ops {}",
                TUNED_OPS.join(", ")
            );
        }
        if pairs.iter().any(|(o, _)| o == op) {
            bail!("SIEVE_TUNE_FORCE={value:?}: {op} is named twice");
        }
        pairs.push((op.to_string(), label.to_string()));
    }
    Ok(pairs)
}

impl Settings {
    /// The label `SIEVE_TUNE_FORCE` names for `op`, if any.
    pub fn forced_label(&self, op: &str) -> Option<&str> {
        self.tune_force
            .iter()
            .find(|(o, _)| o == op)
            .map(|(_, l)| l.as_str())
    }

    /// The variables as the process has them; an error names a variable
    /// whose value is not one it takes.
    pub fn from_env() -> Result<Self> {
        Self::parse(|name| std::env::var(name).ok())
    }

    /// The settings from `var` (a variable's value by name, None if unset).
    pub fn parse(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let set = |name: &str| var(name).filter(|v| !v.is_empty());
        Ok(Settings {
            backend: set("SIEVE_BACKEND"),
            adapter: set("SIEVE_ADAPTER"),
            kernels: set("SIEVE_KERNELS")
                .map(|v| KernelSet::parse(&v))
                .transpose()?,
            weights: match set("SIEVE_WEIGHTS").as_deref() {
                None => None,
                Some("buffer") => Some(WeightStore::Buffer),
                Some("texture") => Some(WeightStore::Texture),
                Some(other) => bail!("SIEVE_WEIGHTS={other:?}: expected buffer or texture"),
            },
            spirv: SpirvPath::parse(var("SIEVE_SPIRV").as_deref())?,
            loop_bounding: var("SIEVE_LOOP_BOUNDING").is_some_and(|v| v == "1"),
            no_matrix_units: var("SIEVE_MATRIX_UNITS").is_some_and(|v| v == "0"),
            tune_cache: match set("SIEVE_TUNE_CACHE").as_deref() {
                Some("off") | Some("0") => None,
                Some(dir) => Some(dir.into()),
                // In a browser the page's localStorage, its items named
                // `sieve/...` (src/platform.rs).
                None if cfg!(target_arch = "wasm32") => Some("sieve".into()),
                None => set("XDG_CACHE_HOME")
                    .map(std::path::PathBuf::from)
                    .or_else(|| set("HOME").map(|h| std::path::Path::new(&h).join(".cache")))
                    .map(|d| d.join("sieve")),
            },
            tune_force: set("SIEVE_TUNE_FORCE")
                .map(|v| parse_tune_force(&v))
                .transpose()?
                .unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Who writes which kernel's SPIR-V.
    #[test]
    fn spirv_path_covers_the_cooperative_kernels() {
        use crate::shaders::{self, Shader};
        let coop = &shaders::MATMUL_COOP;
        let plain = &shaders::MATMUL_TILED;
        // A kernel of sieve's with another body is not one of its own.
        let other = Shader {
            body: "enable wgpu_cooperative_matrix;",
            ..*coop
        };
        assert!(
            SpirvPath::Coop.writes(coop)
                && SpirvPath::Coop.writes(&shaders::ATTENTION_PREFILL_COOP)
        );
        assert!(!SpirvPath::Coop.writes(plain) && !SpirvPath::Coop.writes(&other));
        assert!(SpirvPath::All.writes(plain) && SpirvPath::All.writes(&other));
        assert!(!SpirvPath::Wgpu.writes(coop));
    }

    /// Each variable is read where it is set, unset or empty variables
    /// leave the defaults, and a value a variable does not take is an
    /// error naming it and what it takes.
    #[test]
    fn settings_parse_each_variable() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(Settings::parse(env(&[])).unwrap(), Settings::default());
        assert_eq!(Settings::default().tune_cache, None);
        let s = Settings::parse(env(&[
            ("SIEVE_BACKEND", "vulkan"),
            ("SIEVE_ADAPTER", ""),
            ("SIEVE_KERNELS", "gpu"),
            ("SIEVE_WEIGHTS", "texture"),
            ("SIEVE_SPIRV", "all"),
            ("SIEVE_LOOP_BOUNDING", "1"),
            ("SIEVE_MATRIX_UNITS", "0"),
            ("SIEVE_TUNE_CACHE", "off"),
            (
                "SIEVE_TUNE_FORCE",
                "mat-vec=q8 64x2, attention decode=Parallel",
            ),
            ("HOME", "/home/u"),
        ]))
        .unwrap();
        assert_eq!(
            s,
            Settings {
                backend: Some("vulkan".into()),
                adapter: None,
                kernels: Some(KernelSet::Gpu),
                weights: Some(WeightStore::Texture),
                spirv: SpirvPath::All,
                loop_bounding: true,
                no_matrix_units: true,
                tune_cache: None,
                tune_force: vec![
                    ("mat-vec".into(), "q8 64x2".into()),
                    ("attention decode".into(), "Parallel".into())
                ],
            }
        );
        assert_eq!(s.forced_label("mat-vec"), Some("q8 64x2"));
        assert_eq!(s.forced_label("mat-mul"), None);
        // The tuning cache: a folder given, else the user's cache folder.
        let cache = |pairs| Settings::parse(env(pairs)).unwrap().tune_cache;
        assert_eq!(
            cache(&[("SIEVE_TUNE_CACHE", "t"), ("HOME", "/h")]),
            Some("t".into())
        );
        assert_eq!(
            cache(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]),
            Some("/x/sieve".into())
        );
        assert_eq!(cache(&[("HOME", "/h")]), Some("/h/.cache/sieve".into()));
        for (name, value, expected) in [
            ("SIEVE_KERNELS", "tpu", "expected auto, cpu, gpu or tuned"),
            ("SIEVE_WEIGHTS", "disk", "expected buffer or texture"),
            ("SIEVE_SPIRV", "glsl", "expected wgpu, coop or all"),
            ("SIEVE_TUNE_FORCE", "matvec=q8", "expected op=pattern pairs"),
            ("SIEVE_TUNE_FORCE", "mat-vec", "ops mat-vec, mat-mul"),
            ("SIEVE_TUNE_FORCE", "mat-vec=!", "expected op=pattern pairs"),
            (
                "SIEVE_TUNE_FORCE",
                "mat-vec=q8,mat-vec=x16",
                "mat-vec is named twice",
            ),
        ] {
            let e = Settings::parse(|n: &str| (n == name).then(|| value.to_string()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(name) && e.contains(expected), "{e}");
        }
    }

    /// The `cpu` set stores weights in textures, the others in buffers,
    /// unless `SIEVE_WEIGHTS` says otherwise; sieve's own SPIR-V only where
    /// the driver takes it as it is.
    #[test]
    fn compile_options_follow_the_set_and_the_settings() {
        let s = Settings::default();
        let cpu = CompileOptions::new(KernelSet::Cpu, true, &s);
        assert_eq!(cpu.weight_store, WeightStore::Texture);
        assert_eq!(cpu.spirv, SpirvPath::Coop);
        let gpu = CompileOptions::new(KernelSet::Tuned, false, &s);
        assert_eq!(gpu.weight_store, WeightStore::Buffer);
        assert_eq!(gpu.spirv, SpirvPath::Wgpu);
        let forced = Settings {
            weights: Some(WeightStore::Buffer),
            loop_bounding: true,
            ..s
        };
        let cpu = CompileOptions::new(KernelSet::Cpu, true, &forced);
        assert_eq!(cpu.weight_store, WeightStore::Buffer);
        assert!(cpu.bounded_loops);
    }

    #[test]
    fn kernel_set_names_parse() {
        for s in [
            KernelSet::Auto,
            KernelSet::Cpu,
            KernelSet::Gpu,
            KernelSet::Tuned,
        ] {
            assert_eq!(KernelSet::parse(s.name()).unwrap(), s);
        }
        let e = KernelSet::parse("tpu").unwrap_err().to_string();
        assert!(e.contains("--kernels") && e.contains("tpu"), "{e}");
    }
}
