//! The kernel variants of each op, and the one place where they are chosen
//! for a device ([`KernelVariants::select`]) from its profile, the kernel
//! set asked for and how its kernels compile (`crate::device`); the
//! candidates `--kernels tuned` times (src/kernels/tune.rs) are listed here
//! too. Launchers ask for the choice (and, where a variant only fits some
//! shapes, for the variant of their shape) and never look at the device.
//!
//! Why two sets: the kernels tuned on lavapipe (`cpu`) do few, wide
//! invocations because llvmpipe runs a workgroup per thread and pays for every
//! load per lane; a GPU needs tens of thousands of lanes with coalesced loads
//! (`gpu`). Both sets run on any device (`--kernels`), so both are tested on
//! lavapipe against the same CPU references.

use super::ceil_div;
use super::prepared_x::XForm;
use crate::device::{CompileOptions, DeviceProfile, KernelSet, SpirvPath};
use crate::formats::{KvFormat, WeightFormat};
use crate::shaders::{self, Shader, WeightStore};

/// Mat-vec (decode, one token) variants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatvecVariant {
    /// `matmul.wgsl` `matvec`: eight rows per invocation, 8 lanes a
    /// workgroup, 32 values a step through the format's `dot32` (whole quant
    /// words, one scale per block).
    Rows8,
    /// `matvec_workgroup.wgsl`: a workgroup of `lanes` lanes (64, 128 or
    /// 256) per `rows` rows (1 to 16), coalesced loads along K, `steps`
    /// loads per row in flight per lane (2 or 4; matvec_rows.wgsl), reduced
    /// in workgroup memory.
    WorkgroupReduce { lanes: u32, rows: u32, steps: u32 },
    /// `matvec_subgroup.wgsl`: the same, reduced with subgroup sums.
    SubgroupReduce { lanes: u32, rows: u32, steps: u32 },
    /// `matvec_q8.wgsl`: weights in a block format times x quantized once
    /// per token into q8 blocks (`quantize_q8.wgsl`, which folds in the
    /// norm or SwiGLU), 4 x 8-bit packed dot products, a workgroup of
    /// `lanes` lanes (32, 64 or 128) per `rows` rows (1 to 8), reduced with
    /// subgroup sums (needs subgroup operations). Float weights take the
    /// `SubgroupReduce` default instead ([`MatvecVariant::for_format`]).
    /// x's 8-bit rounding changes the product (llama.cpp's trade):
    /// a `tuned` candidate, never a fixed rule's choice.
    IntegerDot { lanes: u32, rows: u32 },
    /// `matvec_subgroup.wgsl` built to read x in f16 (`matmul_x16.wgsl`),
    /// which `x_half.wgsl` writes once per token with the norm or SwiGLU
    /// folded in: the norm's sum of squares once per token, not once per
    /// workgroup, and half the bytes of x for every workgroup. Shapes as
    /// `SubgroupReduce`; for f16 weights (x's f16 rounding is what the
    /// matrix units do to it too; others take the `SubgroupReduce` default,
    /// [`MatvecVariant::for_format`]); a `tuned` candidate.
    HalfX { lanes: u32, rows: u32, steps: u32 },
}

/// Lanes and rows per workgroup of the `gpu` mat-vecs: the fixed rule's
/// choice, and what the shaders allow (their accumulators and partial sums).
pub const MATVEC_LANES_DEFAULT: u32 = 128;
pub const MATVEC_ROWS_DEFAULT: u32 = 2;
pub const MATVEC_LANES: [u32; 3] = [64, 128, 256];
pub const MATVEC_ROWS_MAX: u32 = 16;
/// Loads per row in flight per lane: the fixed rule's, and the others timed.
pub const MATVEC_STEPS_DEFAULT: u32 = 2;
pub const MATVEC_STEPS: [u32; 2] = [2, 4];
/// Lanes per workgroup and the most rows of the integer-dot mat-vec
/// (matvec_q8.wgsl's accumulators).
pub const MATVEC_Q8_LANES: [u32; 3] = [32, 64, 128];
pub const MATVEC_Q8_ROWS_MAX: u32 = 8;

impl MatvecVariant {
    /// Whether the variant can fold the kernel that writes its input (RMSNorm,
    /// SwiGLU) into itself; the `cpu` ones cannot.
    pub fn fuses_input(self) -> bool {
        self != MatvecVariant::Rows8
    }

    /// (lanes, rows) per workgroup.
    pub fn shape(self) -> (u32, u32) {
        match self {
            MatvecVariant::Rows8 => (8, 64),
            MatvecVariant::WorkgroupReduce { lanes, rows, .. }
            | MatvecVariant::SubgroupReduce { lanes, rows, .. }
            | MatvecVariant::HalfX { lanes, rows, .. }
            | MatvecVariant::IntegerDot { lanes, rows } => (lanes, rows),
        }
    }

    /// Loads per row in flight per lane (the `cpu` and integer-dot
    /// variants: 1, a block at a time).
    pub fn steps(self) -> u32 {
        match self {
            MatvecVariant::Rows8 | MatvecVariant::IntegerDot { .. } => 1,
            MatvecVariant::WorkgroupReduce { steps, .. }
            | MatvecVariant::SubgroupReduce { steps, .. }
            | MatvecVariant::HalfX { steps, .. } => steps,
        }
    }

    /// The form it reads x in where that is not x itself: prepared once
    /// per token by a kernel of `prepared_x` (which folds in the norm or
    /// SwiGLU), in q8 blocks or f16.
    pub fn prepared_x(self) -> Option<XForm> {
        match self {
            MatvecVariant::IntegerDot { .. } => Some(XForm::Q8),
            MatvecVariant::HalfX { .. } => Some(XForm::F16),
            _ => None,
        }
    }

    /// What a part in `format` runs when this variant is asked for: the
    /// integer-dot kernel takes block formats only, the f16-x one f16
    /// weights only; the others take the subgroup mat-vec of the fixed rule
    /// (a device that runs these has its subgroups).
    pub fn for_format(self, format: WeightFormat) -> Self {
        match self {
            MatvecVariant::IntegerDot { .. } if format.block().is_none() => {
                MatvecVariant::SubgroupReduce {
                    lanes: MATVEC_LANES_DEFAULT,
                    rows: MATVEC_ROWS_DEFAULT,
                    steps: MATVEC_STEPS_DEFAULT,
                }
            }
            MatvecVariant::HalfX { .. } if format != WeightFormat::F16 => {
                MatvecVariant::SubgroupReduce {
                    lanes: MATVEC_LANES_DEFAULT,
                    rows: MATVEC_ROWS_DEFAULT,
                    steps: MATVEC_STEPS_DEFAULT,
                }
            }
            v => v,
        }
    }

    /// The same kernel with `lanes` lanes per `rows` rows and `steps` loads
    /// per row in flight (the `cpu` variant has one shape; the integer-dot
    /// one no steps).
    pub fn with_shape(self, lanes: u32, rows: u32, steps: u32) -> Self {
        match self {
            MatvecVariant::Rows8 => self,
            MatvecVariant::IntegerDot { .. } => MatvecVariant::IntegerDot { lanes, rows },
            MatvecVariant::HalfX { .. } => MatvecVariant::HalfX { lanes, rows, steps },
            MatvecVariant::WorkgroupReduce { .. } => {
                MatvecVariant::WorkgroupReduce { lanes, rows, steps }
            }
            MatvecVariant::SubgroupReduce { .. } => {
                MatvecVariant::SubgroupReduce { lanes, rows, steps }
            }
        }
    }

    /// Its shader and entry.
    pub fn kernel(self) -> (&'static Shader, &'static str) {
        match self {
            MatvecVariant::Rows8 => (&shaders::MATMUL, "matvec"),
            MatvecVariant::WorkgroupReduce { .. } => (&shaders::MATVEC_WORKGROUP, "matvec"),
            MatvecVariant::SubgroupReduce { .. } => (&shaders::MATVEC_SUBGROUP, "matvec"),
            MatvecVariant::IntegerDot { .. } => (&shaders::MATVEC_Q8, "matvec"),
            MatvecVariant::HalfX { .. } => (&shaders::MATVEC_SUBGROUP_X16, "matvec"),
        }
    }

    /// The workgroups for `rows` rows of one part (each kernel's header
    /// says the same): the `gpu` ones spill past 32,768 into y.
    pub fn groups(self, rows: u32) -> (u32, u32, u32) {
        match self {
            MatvecVariant::Rows8 => (ceil_div(rows, 64), 1, 1),
            _ => {
                let g = ceil_div(rows, self.shape().1);
                (g.min(32768), ceil_div(g, 32768), 1)
            }
        }
    }

    /// How the timings name it: lanes x rows, and x steps where not 2;
    /// `q8` before the integer-dot kernel's, `x16` before the f16-x one's.
    pub fn label(self) -> String {
        let (lanes, rows) = self.shape();
        match (self, self.steps()) {
            (MatvecVariant::IntegerDot { .. }, _) => format!("q8 {lanes}x{rows}"),
            (MatvecVariant::HalfX { .. }, MATVEC_STEPS_DEFAULT) => format!("x16 {lanes}x{rows}"),
            (MatvecVariant::HalfX { .. }, steps) => format!("x16 {lanes}x{rows}x{steps}"),
            (_, MATVEC_STEPS_DEFAULT) => format!("{lanes}x{rows}"),
            (_, steps) => format!("{lanes}x{rows}x{steps}"),
        }
    }
}

/// Mat-mul (prefill, several tokens) variants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulVariant {
    /// `matmul.wgsl` `matmul`: 4 rows x 4 tokens per invocation, no tiles.
    Blocked4x4,
    /// `matmul_tiled.wgsl` with WIDE = 1: 64 x 64 output tiles staged in
    /// workgroup memory, 4 x 4 per lane.
    Tiled,
    /// `matmul_tiled.wgsl` with WIDE = 2: 128 x 128 output tiles, 8 x 8 per
    /// lane (twice the arithmetic per workgroup-memory load, a quarter of the
    /// workgroups). A timed candidate of `tuned` wherever `Tiled` is one.
    TiledWide,
    /// `matmul_coop.wgsl`: 64 x 32 output tiles from 16x16x16 cooperative
    /// matrices (tensor cores), f16 inputs, f32 accumulation. Needs f16
    /// weights, rows a multiple of 64 (per row part) and K a multiple of 64;
    /// block formats use `CoopStaged`, other shapes `Tiled`.
    Coop,
    /// `matmul_coop_staged.wgsl`: the same matrix units for weights in a
    /// block format, dequantized into workgroup memory (128 x 64 output
    /// tiles, four subgroups). What `Coop` becomes for a block-format part;
    /// with `--kernels tuned` also timed for f16 parts.
    CoopStaged,
    /// `matmul_coop_staged.wgsl` with WIDE = 2: 128 x 128 output tiles,
    /// 64 x 64 per subgroup (twice the products per workgroup-memory load,
    /// half the workgroups). A timed candidate of `tuned` wherever
    /// `CoopStaged` is one.
    CoopStagedWide,
    /// `matmul_coop.wgsl` with X_STRIDE = 72: `Coop` with its staged x
    /// rows padded by 8 halves, so that a matrix load from workgroup memory
    /// is free of bank conflicts. A timed candidate of `tuned` wherever
    /// `Coop` is one; takes what `Coop` takes.
    CoopPadded,
    /// `matmul_coop_staged.wgsl` with K_STRIDE = 40: `CoopStaged` with its
    /// staged rows padded by 8 halves (the same reason). A timed candidate
    /// of `tuned` wherever `CoopStaged` is one; takes what it takes.
    CoopStagedPadded,
    /// `matmul_coop_staged.wgsl` with K_STRIDE = 40 and PREFETCH:
    /// `CoopStagedPadded` with each K step's global loads issued before the
    /// step before it multiplies (double buffering in registers). A timed
    /// candidate wherever `CoopStagedPadded` is one; takes what it takes.
    CoopStagedPrefetch,
    /// `matmul_coop.wgsl` with X_STRIDE = 72 and TOKENS_FAST: `CoopPadded`
    /// with the grid's fast axis on the tokens, so that the workgroups of
    /// one weight tile run together and read it from memory once. A timed
    /// candidate wherever `CoopPadded` is one; takes what it takes.
    CoopTokensFast,
    /// `matmul_coop_staged.wgsl` with K_STRIDE = 40, PREFETCH and
    /// TOKENS_FAST: `CoopStagedPrefetch` with the tokens on the grid's fast
    /// axis (the same reason). A timed candidate wherever
    /// `CoopStagedPrefetch` is one; takes what it takes.
    CoopStagedTokensFast,
    /// `matmul_coop.wgsl` with X_F16 and TOKENS_FAST: `CoopTokensFast`
    /// reading x in f16, copied once per product by `x_f16.wgsl`, its B
    /// tiles loaded straight from that copy (no per-workgroup rounding and
    /// staging of x, no barrier in the K loop). A timed candidate wherever
    /// `CoopTokensFast` is one (timed with its copy); takes what it takes.
    CoopX16,
    /// `matmul_coop_staged.wgsl` with WIDE = 2, K_STRIDE = 40, BUFFERS = 2,
    /// TOKENS_FAST and X_F16: 128 x 128 tiles, 64 x 64 per subgroup, the
    /// slices double-buffered (one barrier per K step, each step's loads in
    /// flight during the products before it), x read from its f16 copy
    /// (`x_f16.wgsl`, timed with it), tokens on the grid's fast axis;
    /// 44 KiB of workgroup memory. A timed candidate wherever
    /// `CoopStagedWide` is one; takes what it takes.
    CoopStagedDouble,
}

impl MatmulVariant {
    pub const ALL: [MatmulVariant; 13] = [
        MatmulVariant::Blocked4x4,
        MatmulVariant::Tiled,
        MatmulVariant::TiledWide,
        MatmulVariant::Coop,
        MatmulVariant::CoopStaged,
        MatmulVariant::CoopStagedWide,
        MatmulVariant::CoopPadded,
        MatmulVariant::CoopStagedPadded,
        MatmulVariant::CoopStagedPrefetch,
        MatmulVariant::CoopTokensFast,
        MatmulVariant::CoopStagedTokensFast,
        MatmulVariant::CoopX16,
        MatmulVariant::CoopStagedDouble,
    ];

    /// The variant for one row part of a weight matrix (`rows` rows of
    /// `cols` values in `format`): `Coop` takes f16 parts of whole 64 x 64
    /// tiles, becomes `CoopStaged` for block formats (whose rows hold whole
    /// blocks, so K is a multiple of 32), and falls back to `Tiled` for the
    /// rest (f32 weights keep f32 arithmetic). `CoopStaged` and
    /// `CoopStagedWide` asked for by name take block formats and f16 rows
    /// with K a multiple of 32.
    pub fn for_part(self, format: WeightFormat, rows: usize, cols: usize) -> MatmulVariant {
        match (self, format) {
            (
                MatmulVariant::Coop
                | MatmulVariant::CoopPadded
                | MatmulVariant::CoopTokensFast
                | MatmulVariant::CoopX16,
                WeightFormat::F16,
            ) if cols.is_multiple_of(64) && rows.is_multiple_of(64) => self,
            (MatmulVariant::Coop, f) if f.block().is_some() => MatmulVariant::CoopStaged,
            (MatmulVariant::CoopPadded, f) if f.block().is_some() => {
                MatmulVariant::CoopStagedPadded
            }
            (MatmulVariant::CoopTokensFast | MatmulVariant::CoopX16, f) if f.block().is_some() => {
                MatmulVariant::CoopStagedTokensFast
            }
            // Asked for by name (the timings, tests): block formats and f16
            // rows of whole 32-value slices.
            (
                MatmulVariant::CoopStaged
                | MatmulVariant::CoopStagedWide
                | MatmulVariant::CoopStagedPadded
                | MatmulVariant::CoopStagedPrefetch
                | MatmulVariant::CoopStagedTokensFast
                | MatmulVariant::CoopStagedDouble,
                f,
            ) if f.block().is_some() || (f == WeightFormat::F16 && cols.is_multiple_of(32)) => self,
            (v, _) if v.cooperative() => MatmulVariant::Tiled,
            (v, _) => v,
        }
    }

    /// Whether the variant runs on the matrix units (rounding its inputs to
    /// f16): the start-up check guards these, and tolerances widen for them.
    pub fn cooperative(self) -> bool {
        self.kernel().cooperative
    }

    /// Whether the variant reads x in f16 (a copy `x_f16.wgsl` makes once
    /// per product) instead of x itself.
    pub fn reads_x16(self) -> bool {
        self.kernel().reads_x16
    }

    /// Everything the launcher needs of the variant's kernel, in one place
    /// (each kernel's header says the same).
    pub fn kernel(self) -> MatmulKernel {
        use MatmulVariant::*;
        // An override constant that switches a refinement on.
        const ON: f64 = 1.0;
        let base = MatmulKernel {
            shader: &shaders::MATMUL_COOP,
            constants: &[],
            tile: (64, 32),
            tokens_fast: false,
            cooperative: true,
            reads_x16: false,
            min_subgroup: 0,
        };
        let staged = MatmulKernel {
            shader: &shaders::MATMUL_COOP_STAGED,
            tile: (128, 64),
            // The staged kernel's per-lane loads fit SLICE_LOADS_MAX
            // (matmul_coop_staged.wgsl) with subgroups of 4 lanes or more.
            min_subgroup: 4,
            ..base
        };
        let tiled = MatmulKernel {
            shader: &shaders::MATMUL_TILED,
            cooperative: false,
            ..base
        };
        match self {
            Blocked4x4 => MatmulKernel {
                shader: &shaders::MATMUL,
                tile: (256, 4),
                ..tiled
            },
            Tiled => MatmulKernel {
                constants: &[("WIDE", 1.0)],
                tile: (64, 64),
                ..tiled
            },
            TiledWide => MatmulKernel {
                constants: &[("WIDE", 2.0)],
                tile: (128, 128),
                ..tiled
            },
            Coop => base,
            CoopPadded => MatmulKernel {
                constants: &[("X_STRIDE", 72.0)],
                ..base
            },
            CoopTokensFast => MatmulKernel {
                constants: &[("X_STRIDE", 72.0), ("TOKENS_FAST", ON)],
                tokens_fast: true,
                ..base
            },
            CoopX16 => MatmulKernel {
                constants: &[("TOKENS_FAST", ON), ("X_F16", ON)],
                tokens_fast: true,
                reads_x16: true,
                ..base
            },
            CoopStaged => MatmulKernel {
                constants: &[("WIDE", 1.0)],
                ..staged
            },
            // WIDE = 2: a 128-token x slice, 20 KiB in all, past the 16 KiB
            // some devices have (`Gpu::pipeline` checks).
            CoopStagedWide => MatmulKernel {
                constants: &[("WIDE", 2.0)],
                tile: (128, 128),
                ..staged
            },
            CoopStagedPadded => MatmulKernel {
                constants: &[("WIDE", 1.0), ("K_STRIDE", 40.0)],
                ..staged
            },
            CoopStagedPrefetch => MatmulKernel {
                constants: &[("WIDE", 1.0), ("K_STRIDE", 40.0), ("PREFETCH", ON)],
                ..staged
            },
            CoopStagedTokensFast => MatmulKernel {
                constants: &[
                    ("WIDE", 1.0),
                    ("K_STRIDE", 40.0),
                    ("PREFETCH", ON),
                    ("TOKENS_FAST", ON),
                ],
                tokens_fast: true,
                ..staged
            },
            // 2 x (128 + 128) x 40 halves and 4 KiB of tiles: 44 KiB, past
            // what WebGPU promises (`Gpu::pipeline` checks).
            CoopStagedDouble => MatmulKernel {
                constants: &[
                    ("WIDE", 2.0),
                    ("K_STRIDE", 40.0),
                    ("BUFFERS", 2.0),
                    ("TOKENS_FAST", ON),
                    ("X_F16", ON),
                ],
                tile: (128, 128),
                tokens_fast: true,
                reads_x16: true,
                ..staged
            },
        }
    }
}

/// A kind of kernel variant listed in full, so that a set of its variants
/// is a bit mask ([`VariantSet`]).
pub trait Listed: Copy + PartialEq + std::fmt::Debug + 'static {
    /// Every variant (at most 32).
    const LIST: &'static [Self];
}

impl Listed for MatmulVariant {
    const LIST: &'static [Self] = &MatmulVariant::ALL;
}

/// A set of variants of one kind (one bit per [`Listed::LIST`] entry): the
/// ones that failed their start-up check on this device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VariantSet<T>(u32, std::marker::PhantomData<T>);

/// The mat-mul variants refused on a device.
pub type MatmulSet = VariantSet<MatmulVariant>;

impl<T> Default for VariantSet<T> {
    fn default() -> Self {
        VariantSet(0, std::marker::PhantomData)
    }
}

impl<T: Listed> VariantSet<T> {
    fn bit(v: T) -> u32 {
        let i = T::LIST.iter().position(|&a| a == v);
        1 << i.unwrap_or_else(|| panic!("{v:?} is not in its kind's list"))
    }

    pub fn insert(&mut self, v: T) {
        self.0 |= Self::bit(v);
    }

    pub fn contains(&self, v: T) -> bool {
        self.0 & Self::bit(v) != 0
    }
}

/// A mat-mul variant's kernel: its shader (entry `matmul`), override
/// constants and dispatch.
#[derive(Clone, Copy, Debug)]
pub struct MatmulKernel {
    pub shader: &'static Shader,
    /// Override constants besides SUBGROUP_SIZE, which the cooperative
    /// kernels take from the device (their matrices are sized in subgroups
    /// of its one subgroup size).
    pub constants: &'static [(&'static str, f64)],
    /// Output tile of one workgroup: (weight rows, tokens).
    pub tile: (u32, u32),
    /// Tokens on the grid's fast axis (x), so that the workgroups of one
    /// weight tile run together and read it from memory once.
    pub tokens_fast: bool,
    /// Runs on the matrix units (cooperative matrices).
    pub cooperative: bool,
    /// Reads the f16 copy of x (`x_f16.wgsl`).
    pub reads_x16: bool,
    /// The smallest subgroup the kernel takes (0: any).
    pub min_subgroup: u32,
}

impl MatmulKernel {
    pub const ENTRY: &'static str = "matmul";

    /// The override constants for a device whose subgroups have
    /// `subgroup` lanes.
    pub fn constants(&self, subgroup: u32) -> Vec<(&'static str, f64)> {
        let size = self
            .cooperative
            .then_some(("SUBGROUP_SIZE", subgroup as f64));
        size.into_iter()
            .chain(self.constants.iter().copied())
            .collect()
    }

    /// The workgroups for `rows` rows of one part and `n` tokens.
    pub fn groups(&self, rows: u32, n: u32) -> (u32, u32, u32) {
        let (row_groups, token_groups) = (ceil_div(rows, self.tile.0), ceil_div(n, self.tile.1));
        match self.tokens_fast {
            true => (token_groups, row_groups, 1),
            false => (row_groups, token_groups, 1),
        }
    }

    /// Whether its binding 7 is the f16 copy of x (matmul_coop.wgsl and
    /// matmul_coop_staged.wgsl: read by `CoopX16` and `CoopStagedDouble`, a
    /// dummy for the others).
    pub fn binds_x16(&self) -> bool {
        [shaders::MATMUL_COOP.name, shaders::MATMUL_COOP_STAGED.name].contains(&self.shader.name)
    }
}

/// The most query heads per KV head and the largest head size the attention
/// kernels take (GMAX and 4 x HD4_MAX in attention_heads.wgsl); model
/// configs are checked against the same limits when loaded (src/config.rs).
pub const MAX_HEADS_PER_KV: usize = 8;
pub const NARROW_HEAD_DIM: usize = 128;
/// The wide builds (attention_heads_wide.wgsl: attention.wgsl and the `gpu`
/// decode kernels) take heads up to this size, with up to
/// [`WIDE_HEADS_PER_KV`] query heads per KV head.
pub const MAX_HEAD_DIM: usize = 256;
pub const WIDE_HEADS_PER_KV: usize = 4;

/// Decode attention (one query) variants; prefill and the merge have one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnDecodeVariant {
    /// `attention.wgsl` `decode_partial`: 64 lanes per (KV head, key chunk),
    /// softmax and value sums serial over the chunk.
    Serial,
    /// `attention_decode.wgsl`: 256 lanes per (KV head, key chunk), one key
    /// per lane, tree reductions, values summed in 8 key slices.
    Parallel,
    /// `attention_decode_lanes.wgsl`: as `Parallel`, but 8 lanes per key
    /// reading consecutive words of its row, summed by subgroup shuffles
    /// (needs subgroups of at least 8 lanes; a `tuned` candidate).
    LanesPerKey,
    /// `attention_decode.wgsl` with VALUE_BATCH = 8: as `Parallel`, with
    /// each lane's value rows loaded eight at a time, so that eight loads
    /// are in flight where `Parallel` waits for memory once per key (its
    /// value phase read an H200's cache at a tenth of the bandwidth); a
    /// `tuned` candidate.
    ParallelBatched,
    /// `attention_decode.wgsl` with CHUNK = 64 and VALUE_BATCH = 8: as
    /// `ParallelBatched` over key chunks of 64 (workgroups of 64 lanes),
    /// with partials and a merge of its own chunk size: four times the
    /// workgroups at a given depth, where 256-key chunks leave fewer
    /// workgroups than a large GPU has cores (128 at depth 4,096 for 8 KV
    /// heads, against an H200's 132 SMs), against a merge over four times
    /// the partials; a `tuned` candidate, timed with its merge.
    ParallelShort,
    /// `attention_decode_split.wgsl`: split-key flash decoding, one
    /// workgroup of 64 lanes per (split of `chunk` keys, KV head), eight
    /// lanes a key reading its row coalesced, an online softmax per key
    /// group (no barrier in the key loop), and a merge with lanes over the
    /// splits in parallel (needs subgroups of at least 8 lanes). The split
    /// lengths ([`SPLIT_KEY_CHUNKS`]) are `tuned` candidates each, so the
    /// timings choose how many splits a depth gets on the device.
    SplitKey { chunk: u32 },
}

/// Keys per split of the split-key decode candidates: at depth 16,384 and 8
/// KV heads, 1,024, 256 and 64 workgroups.
pub const SPLIT_KEY_CHUNKS: [u32; 3] = [128, 512, 2048];

impl Listed for AttnDecodeVariant {
    const LIST: &'static [Self] = &[
        AttnDecodeVariant::Serial,
        AttnDecodeVariant::Parallel,
        AttnDecodeVariant::LanesPerKey,
        AttnDecodeVariant::ParallelBatched,
        AttnDecodeVariant::ParallelShort,
        AttnDecodeVariant::SplitKey {
            chunk: SPLIT_KEY_CHUNKS[0],
        },
        AttnDecodeVariant::SplitKey {
            chunk: SPLIT_KEY_CHUNKS[1],
        },
        AttnDecodeVariant::SplitKey {
            chunk: SPLIT_KEY_CHUNKS[2],
        },
    ];
}

/// A decode attention variant's kernel: what its launcher and the variant
/// selection need, in one place (each kernel's header says the same).
#[derive(Clone, Copy, Debug)]
pub struct AttnDecodeKernel {
    /// Its partial kernel's shader (entry `decode_partial`) for heads of up
    /// to 128 values, and its wide build (heads of 256).
    pub shaders: (&'static Shader, &'static Shader),
    /// Override constants besides GROUP, HD4 and CHUNK.
    pub constants: &'static [(&'static str, f64)],
    /// Cache slots per key chunk: the partials' layout, the workgroups a
    /// step dispatches and the merge's chunk count.
    pub key_chunk: u32,
    /// Whether its shader's own merge (lanes over the splits) combines its
    /// partials, rather than attention.wgsl's (a lane per column).
    pub own_merge: bool,
    /// The fewest lanes a subgroup must have (0: no subgroup operations).
    /// Those that need some number their lanes by subgroup, counting on
    /// subgroups of one size in a workgroup, which Vulkan does not
    /// promise: each runs a start-up check where `tuned` would time it.
    pub min_subgroup: u32,
}

impl AttnDecodeVariant {
    /// Everything the launcher needs of the variant's kernel.
    pub fn kernel(self) -> AttnDecodeKernel {
        use AttnDecodeVariant::*;
        let parallel = AttnDecodeKernel {
            shaders: (&shaders::ATTENTION_DECODE, &shaders::ATTENTION_DECODE_WIDE),
            constants: &[],
            key_chunk: 256,
            own_merge: false,
            min_subgroup: 0,
        };
        let batched = AttnDecodeKernel {
            constants: &[("VALUE_BATCH", 8.0)],
            ..parallel
        };
        match self {
            Serial => AttnDecodeKernel {
                shaders: (&shaders::ATTENTION, &shaders::ATTENTION_WIDE),
                ..parallel
            },
            Parallel => parallel,
            ParallelBatched => batched,
            ParallelShort => AttnDecodeKernel {
                key_chunk: 64,
                ..batched
            },
            LanesPerKey => AttnDecodeKernel {
                shaders: (
                    &shaders::ATTENTION_DECODE_LANES,
                    &shaders::ATTENTION_DECODE_LANES_WIDE,
                ),
                min_subgroup: 8,
                ..parallel
            },
            SplitKey { chunk } => AttnDecodeKernel {
                shaders: (
                    &shaders::ATTENTION_DECODE_SPLIT,
                    &shaders::ATTENTION_DECODE_SPLIT_WIDE,
                ),
                key_chunk: chunk,
                own_merge: true,
                min_subgroup: 8,
                ..parallel
            },
        }
    }

    /// Cache slots per key chunk ([`AttnDecodeKernel::key_chunk`]).
    pub fn key_chunk(self) -> u32 {
        self.kernel().key_chunk
    }

    /// Whether it runs on a cache in pages of `page_slots` slots (`None`:
    /// one page): its chunks may not straddle two pages.
    pub fn fits_pages(self, page_slots: Option<usize>) -> bool {
        page_slots.is_none_or(|s| s.is_multiple_of(self.key_chunk() as usize))
    }
}

/// Attention partials for many queries (prefill, counter-causal pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnPrefillVariant {
    /// `attention.wgsl` `prefill_partial`/`anticausal_partial`: one query and
    /// the whole head per lane, keys read straight from the cache.
    RowPerLane,
    /// `attention_prefill.wgsl`: 64 queries x 4 lanes per workgroup, keys and
    /// values staged in workgroup memory 8 at a time.
    Tiled,
    /// `attention_prefill_coop.wgsl`: the same work split, scores and
    /// weighted values on the matrix units (16x16x16 f16 products, f32
    /// accumulators; head_dim a multiple of 16). A `tuned` candidate on
    /// devices with cooperative matrices, after a start-up check.
    Coop,
}

impl AttnPrefillVariant {
    /// Whether the variant runs heads of `head_dim` values, and a sliding
    /// window: `Coop` has neither a wide build nor a window mask; a layer
    /// that needs either takes another whatever the kernel set.
    pub fn takes(self, head_dim: usize, window: bool) -> bool {
        self != AttnPrefillVariant::Coop || (head_dim <= NARROW_HEAD_DIM && !window)
    }
}

/// The variant of every op with variants, chosen once per device, and the
/// candidates `tuned` may time beside them (the `bool`s: cleared where a
/// start-up check fails, `kernels::runtime`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelVariants {
    /// The set asked for (`auto` resolved: `cpu`, `gpu` or `tuned`).
    pub set: KernelSet,
    pub matvec: MatvecVariant,
    /// Whether the mat-vecs that read x prepared once per token are timed
    /// candidates: `IntegerDot` for block-format parts, `HalfX` for f16
    /// ones (`tuned` on devices with subgroup operations).
    pub matvec_prepared: bool,
    pub matmul: MatmulVariant,
    /// Whether block-format parts may take `CoopStaged` when `matmul` is
    /// `Coop` (cleared when that kernel fails its start-up check, which
    /// leaves f16 weights on the cooperative kernel).
    pub coop_staged: bool,
    /// Whether `CoopStaged` is a timed candidate for f16 parts (`tuned`
    /// only; cleared when it fails its start-up check with f16 weights).
    pub coop_staged_f16: bool,
    /// Whether the refined cooperative kernels (`CoopPadded`,
    /// `CoopTokensFast`, `CoopX16`, `CoopStagedPadded`, `CoopStagedPrefetch`,
    /// `CoopStagedTokensFast`, `CoopStagedWide`, `CoopStagedDouble`) are timed candidates wherever `Coop` and
    /// `CoopStaged` are (`tuned` only; one that fails its start-up check
    /// goes into `refused`).
    pub coop_refined: bool,
    /// The mat-mul candidates that failed their start-up check on this
    /// device, each dropped alone (its siblings stay candidates), for every
    /// weight format (a staged kernel checked with Q4_0 and f16 weights and
    /// failing with one is not timed with the other either).
    pub refused: MatmulSet,
    pub attn_decode: AttnDecodeVariant,
    /// The fewest lanes the device's subgroups have (0: no subgroup
    /// operations): which decode variants it can run
    /// ([`AttnDecodeKernel::min_subgroup`]).
    pub subgroup_min: u32,
    /// The decode attention variants that failed their start-up check here,
    /// each dropped alone.
    pub attn_decode_refused: VariantSet<AttnDecodeVariant>,
    pub attn_prefill: AttnPrefillVariant,
    /// Whether `AttnPrefillVariant::Coop` is a timed candidate (`tuned` on
    /// devices with cooperative matrices; cleared when it fails its
    /// start-up check).
    pub attn_prefill_coop: bool,
}

/// The fewest lanes the device's subgroups have; 0 without subgroup
/// operations.
fn subgroup_min(profile: &DeviceProfile) -> u32 {
    if profile.subgroups {
        profile.subgroup_min
    } else {
        0
    }
}

impl KernelVariants {
    /// The one place where variants are chosen from the device: the set
    /// `wanted` (`auto` resolved) on a device of `profile` whose kernels
    /// compile as `compile` says. Where a start-up check fails, the
    /// runtime clears what failed (`kernels::runtime`).
    pub fn select(profile: &DeviceProfile, wanted: KernelSet, compile: &CompileOptions) -> Self {
        let mut v = Self::for_set(profile, wanted.resolve(profile));
        // The direct cooperative GEMM loads f16 weights from a buffer; with
        // weights in textures (`SIEVE_WEIGHTS=texture` on such a device) the
        // tiled kernel takes its place, as where the device has no
        // cooperative matrices.
        if compile.weight_store == WeightStore::Texture && v.matmul == MatmulVariant::Coop {
            v.matmul = MatmulVariant::Tiled;
            v.coop_staged = false;
            v.coop_staged_f16 = false;
            v.coop_refined = false;
        }
        v
    }

    /// The set's rules on a device of `profile`.
    fn for_set(profile: &DeviceProfile, set: KernelSet) -> Self {
        match set {
            KernelSet::Cpu | KernelSet::Auto => KernelVariants {
                set: KernelSet::Cpu,
                matvec: MatvecVariant::Rows8,
                matvec_prepared: false,
                matmul: MatmulVariant::Blocked4x4,
                coop_staged: false,
                coop_staged_f16: false,
                coop_refined: false,
                refused: MatmulSet::default(),
                attn_decode: AttnDecodeVariant::Serial,
                subgroup_min: subgroup_min(profile),
                attn_decode_refused: VariantSet::default(),
                attn_prefill: AttnPrefillVariant::RowPerLane,
                attn_prefill_coop: false,
            },
            KernelSet::Gpu | KernelSet::Tuned => {
                // The cooperative GEMMs size their workgroups in subgroups
                // (and the staged one reads its subgroup's index): they need
                // a fixed subgroup size and subgroup operations.
                let matmul = if profile.coop_f16_16x16
                    && profile.shader_f16
                    && profile.subgroups
                    && profile.subgroup_min == profile.subgroup_max
                {
                    MatmulVariant::Coop
                } else {
                    MatmulVariant::Tiled
                };
                KernelVariants {
                    set,
                    matvec: if profile.subgroups {
                        MatvecVariant::SubgroupReduce {
                            lanes: MATVEC_LANES_DEFAULT,
                            rows: MATVEC_ROWS_DEFAULT,
                            steps: MATVEC_STEPS_DEFAULT,
                        }
                    } else {
                        MatvecVariant::WorkgroupReduce {
                            lanes: MATVEC_LANES_DEFAULT,
                            rows: MATVEC_ROWS_DEFAULT,
                            steps: MATVEC_STEPS_DEFAULT,
                        }
                    },
                    matvec_prepared: profile.subgroups && set == KernelSet::Tuned,
                    matmul,
                    coop_staged: matmul == MatmulVariant::Coop,
                    coop_staged_f16: matmul == MatmulVariant::Coop && set == KernelSet::Tuned,
                    coop_refined: matmul == MatmulVariant::Coop && set == KernelSet::Tuned,
                    refused: MatmulSet::default(),
                    attn_decode: AttnDecodeVariant::Parallel,
                    subgroup_min: subgroup_min(profile),
                    attn_decode_refused: VariantSet::default(),
                    attn_prefill: AttnPrefillVariant::Tiled,
                    attn_prefill_coop: matmul == MatmulVariant::Coop && set == KernelSet::Tuned,
                }
            }
        }
    }

    /// What a row part runs when `variant` is asked for on this device:
    /// [`MatmulVariant::for_part`], with block formats on `Tiled` where the
    /// staged cooperative kernel is off for them (`coop_staged`; f16
    /// weights asked for by name keep it: their start-up check is their
    /// own), and the direct cooperative kernel on `Tiled` for weights in
    /// textures (`store`).
    pub fn part_variant(
        &self,
        variant: MatmulVariant,
        store: WeightStore,
        format: WeightFormat,
        rows: usize,
        cols: usize,
    ) -> MatmulVariant {
        match variant.for_part(format, rows, cols) {
            MatmulVariant::CoopStaged
            | MatmulVariant::CoopStagedWide
            | MatmulVariant::CoopStagedPadded
            | MatmulVariant::CoopStagedPrefetch
            | MatmulVariant::CoopStagedTokensFast
            | MatmulVariant::CoopStagedDouble
                if !self.coop_staged && format.block().is_some() =>
            {
                MatmulVariant::Tiled
            }
            // The direct kernel binds f16 weights as a buffer of its own:
            // with weights in textures the tiled kernel takes its place.
            MatmulVariant::Coop
            | MatmulVariant::CoopPadded
            | MatmulVariant::CoopTokensFast
            | MatmulVariant::CoopX16
                if store == WeightStore::Texture =>
            {
                MatmulVariant::Tiled
            }
            v => v,
        }
    }

    /// Whether each weight matrix's variants are timed on the device
    /// (`tuned`) rather than picked by the fixed rules.
    pub fn tuned(&self) -> bool {
        self.set == KernelSet::Tuned
    }

    /// The mat-vec variants worth timing for a weight matrix, the fixed
    /// rule's first: the `gpu` mat-vec with 64, 128 or 256 lanes per 1, 2,
    /// 4, 8 or 16 rows, two loads per row in flight (16 rows: each load of
    /// x, which a workgroup reads whole, serves more weight bytes; on the
    /// H200 the Q4_0 mat-vec timed faster with every larger shape up to 8);
    /// and four in flight with
    /// 128 or 256 lanes per 1, 2 or 4 rows (eight rows of four loads each
    /// would hold more registers than a lane keeps fast); with
    /// `matvec_prepared`, the integer-dot mat-vec with 32, 64 or 128 lanes
    /// per 1, 2, 4 or 8 rows for the block formats, and the f16-x one with
    /// 64, 128 or 256 lanes per 1, 2, 4 or 8 rows for f16 weights (a part in
    /// another format drops them: [`MatvecVariant::for_format`]).
    pub fn matvec_candidates(&self) -> Vec<MatvecVariant> {
        let v = self.matvec;
        if v == MatvecVariant::Rows8 {
            return vec![v];
        }
        let mut out = vec![v];
        let mut push = |c: MatvecVariant| {
            if !out.contains(&c) {
                out.push(c);
            }
        };
        for lanes in MATVEC_LANES {
            for rows in [1, 2, 4, 8, MATVEC_ROWS_MAX] {
                push(v.with_shape(lanes, rows, MATVEC_STEPS_DEFAULT));
            }
        }
        for lanes in [128, 256] {
            for rows in [1, 2, 4] {
                push(v.with_shape(lanes, rows, 4));
            }
        }
        if self.matvec_prepared {
            for lanes in MATVEC_Q8_LANES {
                for rows in [1, 2, 4, MATVEC_Q8_ROWS_MAX] {
                    push(MatvecVariant::IntegerDot { lanes, rows });
                }
            }
            for lanes in MATVEC_LANES {
                for rows in [1, 2, 4, 8] {
                    push(MatvecVariant::HalfX {
                        lanes,
                        rows,
                        steps: MATVEC_STEPS_DEFAULT,
                    });
                }
            }
        }
        out
    }

    /// The mat-mul variants worth timing for one row part, the fixed rule's
    /// ([`KernelVariants::part_variant`]) first: on a device whose
    /// cooperative kernels passed their start-up check, the direct one for
    /// f16 parts it takes and the staged one (both tile widths with `tuned`)
    /// for block formats and (`tuned`) for f16 rows of whole 32-value
    /// slices; then the tiled kernel with both tile sizes (f32 weights keep to these: f32 arithmetic). The
    /// `cpu` set has one variant.
    pub fn matmul_candidates(
        &self,
        store: WeightStore,
        format: WeightFormat,
        rows: usize,
        cols: usize,
    ) -> Vec<MatmulVariant> {
        let rule = self.part_variant(self.matmul, store, format, rows, cols);
        if self.matmul == MatmulVariant::Blocked4x4 {
            return vec![rule];
        }
        let coop = self.matmul == MatmulVariant::Coop;
        let direct =
            coop && MatmulVariant::Coop.for_part(format, rows, cols) == MatmulVariant::Coop;
        let staged = coop
            && match format {
                WeightFormat::F16 => self.coop_staged_f16 && cols.is_multiple_of(32),
                f => self.coop_staged && f.block().is_some(),
            };
        let more = [
            direct.then_some(MatmulVariant::Coop),
            (direct && self.coop_refined).then_some(MatmulVariant::CoopPadded),
            (direct && self.coop_refined).then_some(MatmulVariant::CoopTokensFast),
            (direct && self.coop_refined).then_some(MatmulVariant::CoopX16),
            staged.then_some(MatmulVariant::CoopStaged),
            (staged && self.coop_refined).then_some(MatmulVariant::CoopStagedPadded),
            (staged && self.coop_refined).then_some(MatmulVariant::CoopStagedPrefetch),
            (staged && self.coop_refined).then_some(MatmulVariant::CoopStagedTokensFast),
            (staged && self.coop_refined).then_some(MatmulVariant::CoopStagedWide),
            (staged && self.coop_refined).then_some(MatmulVariant::CoopStagedDouble),
            Some(MatmulVariant::Tiled),
            Some(MatmulVariant::TiledWide),
        ];
        let mut out = vec![rule];
        for v in more.into_iter().flatten() {
            if !out.contains(&v) && !self.refused.contains(v) {
                out.push(v);
            }
        }
        out
    }

    /// The decode attention variants worth timing (`tuned`), the fixed
    /// rule's first: the one-key-per-lane kernel with one and with eight
    /// value rows loaded at a time, the latter also over chunks of 64 keys,
    /// the eight-lanes-per-key kernel, the split-key ones, and the
    /// `cpu` set's serial one; one for the other sets.
    pub fn attn_decode_candidates(&self) -> Vec<AttnDecodeVariant> {
        use AttnDecodeVariant::*;
        let mut out = vec![self.attn_decode];
        if self.tuned() {
            let more = [ParallelBatched, ParallelShort, LanesPerKey]
                .into_iter()
                .chain(SPLIT_KEY_CHUNKS.map(|chunk| SplitKey { chunk }))
                .chain([Serial]);
            out.extend(more.filter(|&v| self.takes_decode(v)));
        }
        out
    }

    /// Whether this device runs decode `variant`: its subgroups are wide
    /// enough for it, and it did not fail its start-up check.
    pub fn takes_decode(&self, variant: AttnDecodeVariant) -> bool {
        let need = variant.kernel().min_subgroup;
        (need == 0 || self.subgroup_min >= need) && !self.attn_decode_refused.contains(variant)
    }

    /// The prefill attention variants worth timing (`tuned`) for heads of
    /// `head_dim` values cached in `kv_format`, the fixed rule's first: the
    /// tiled kernel, the matrix-unit one (where it passed its start-up
    /// check, head_dim is a multiple of 16 and the cache is f16: it rounds
    /// keys and values to f16, which an f32 cache is chosen to avoid, and
    /// would turn values past f16's range into infinities) and the
    /// row-per-lane one; one for the other sets.
    pub fn attn_prefill_candidates(
        &self,
        head_dim: usize,
        kv_format: KvFormat,
    ) -> Vec<AttnPrefillVariant> {
        let mut out = vec![self.attn_prefill];
        if self.tuned() {
            let coop = head_dim.is_multiple_of(16) && kv_format == KvFormat::F16;
            if self.attn_prefill_coop && coop {
                out.push(AttnPrefillVariant::Coop);
            }
            out.push(AttnPrefillVariant::RowPerLane);
        }
        out
    }

    /// One line for `sieve info` and `sieve bench`.
    pub fn describe(&self, compile: &CompileOptions) -> String {
        let blocks = if self.matmul == MatmulVariant::Coop {
            if self.coop_staged {
                ", block formats CoopStaged"
            } else {
                ", block formats Tiled"
            }
        } else {
            ""
        };
        let matvec = match self.matvec {
            MatvecVariant::WorkgroupReduce { .. } if self.tuned() => {
                "WorkgroupReduce, lanes and rows timed per matrix".to_string()
            }
            MatvecVariant::SubgroupReduce { .. } if self.tuned() && self.matvec_prepared => {
                "SubgroupReduce, IntegerDot (block formats) or HalfX (f16), lanes and rows timed per matrix"
                    .to_string()
            }
            MatvecVariant::SubgroupReduce { .. } if self.tuned() => {
                "SubgroupReduce, lanes and rows timed per matrix".to_string()
            }
            v => format!("{v:?}"),
        };
        let timed = if self.tuned() && self.matmul == MatmulVariant::Coop {
            ", each part's fastest of Coop, CoopPadded, CoopTokensFast, CoopX16, CoopStaged, CoopStagedPadded, CoopStagedPrefetch, CoopStagedTokensFast, CoopStagedWide, CoopStagedDouble, Tiled, TiledWide timed"
        } else if self.tuned() {
            ", each part's fastest of Tiled, TiledWide timed"
        } else {
            ""
        };
        let loops = if compile.bounded_loops {
            ", wgpu's shader loop counters kept"
        } else {
            ""
        };
        // Said where it differs from what wgpu alone would do.
        let uses_coop = self.matmul == MatmulVariant::Coop || self.attn_prefill_coop;
        let spirv = match compile.spirv {
            SpirvPath::Coop if uses_coop => ", cooperative kernels as GLSL450 SPIR-V by sieve",
            SpirvPath::All => ", every kernel's SPIR-V by sieve",
            _ => "",
        };
        let attention = |names: Vec<String>| match names.as_slice() {
            [one] => one.clone(),
            more => format!("fastest of {} timed", more.join(", ")),
        };
        let decode = attention(
            self.attn_decode_candidates()
                .iter()
                .map(|v| format!("{v:?}"))
                .collect(),
        );
        // (Heads of a multiple of 16 values: every candidate.)
        let prefill = attention(
            self.attn_prefill_candidates(128, KvFormat::F16)
                .iter()
                .map(|v| format!("{v:?}"))
                .collect(),
        );
        format!(
            "{} (mat-vec {matvec}, mat-mul {:?}{blocks}{timed}, decode attention {decode}, prefill attention {prefill}, weights in {}s{loops}{spirv})",
            self.set.name(),
            self.matmul,
            compile.weight_store.name(),
        )
    }
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::device::Settings;

    /// The variants `set` gets on a device of `profile` with the default
    /// compile options of that set (wgpu writing the SPIR-V).
    fn select(profile: &DeviceProfile, set: KernelSet) -> KernelVariants {
        KernelVariants::select(profile, set, &compile_options(profile, set))
    }

    fn compile_options(profile: &DeviceProfile, set: KernelSet) -> CompileOptions {
        CompileOptions::new(set.resolve(profile), false, &Settings::default())
    }

    #[cfg_attr(test, test)]
    fn auto_picks_by_device_kind_and_features() {
        let v = select(
            &DeviceProfile::for_tests(true, true, false),
            KernelSet::Auto,
        );
        assert_eq!(v.set, KernelSet::Cpu);
        assert_eq!(v.matvec, MatvecVariant::Rows8);
        let v = select(
            &DeviceProfile::for_tests(false, true, true),
            KernelSet::Auto,
        );
        assert_eq!(
            (v.set, v.matvec, v.matmul),
            (
                KernelSet::Tuned,
                MatvecVariant::SubgroupReduce {
                    lanes: 128,
                    rows: 2,
                    steps: 2
                },
                MatmulVariant::Coop
            )
        );
        assert!(v.tuned());
        let v = select(
            &DeviceProfile::for_tests(false, false, false),
            KernelSet::Auto,
        );
        assert_eq!(
            (v.matvec, v.matmul),
            (
                MatvecVariant::WorkgroupReduce {
                    lanes: 128,
                    rows: 2,
                    steps: 2
                },
                MatmulVariant::Tiled
            )
        );
        // Forcing works both ways.
        let v = select(&DeviceProfile::for_tests(false, true, true), KernelSet::Cpu);
        assert_eq!(v.matmul, MatmulVariant::Blocked4x4);
        let v = select(
            &DeviceProfile::for_tests(true, false, false),
            KernelSet::Gpu,
        );
        assert_eq!(v.matmul, MatmulVariant::Tiled);
    }

    #[cfg_attr(test, test)]
    fn loop_counters_are_said() {
        let profile = DeviceProfile::for_tests(false, true, true);
        let v = select(&profile, KernelSet::Gpu);
        let mut compile = compile_options(&profile, KernelSet::Gpu);
        assert!(!compile.bounded_loops && !v.describe(&compile).contains("loop"));
        compile.bounded_loops = true;
        assert!(v
            .describe(&compile)
            .ends_with(", wgpu's shader loop counters kept)"));
    }

    /// `describe` says who writes the SPIR-V where sieve does (which
    /// kernels it writes: `device::tests`).
    #[cfg_attr(test, test)]
    fn spirv_path_is_said() {
        let profile = DeviceProfile::for_tests(false, true, true);
        let v = select(&profile, KernelSet::Tuned);
        let mut compile = compile_options(&profile, KernelSet::Tuned);
        assert_eq!(v.matmul, MatmulVariant::Coop);
        assert!(!v.describe(&compile).contains("SPIR-V"));
        compile.spirv = SpirvPath::Coop;
        assert!(v
            .describe(&compile)
            .ends_with(", cooperative kernels as GLSL450 SPIR-V by sieve)"));
        compile.spirv = SpirvPath::All;
        assert!(v
            .describe(&compile)
            .ends_with(", every kernel's SPIR-V by sieve)"));
        let cpu = select(&profile, KernelSet::Cpu);
        compile.spirv = SpirvPath::Coop;
        assert!(!cpu.describe(&compile).contains("SPIR-V"));
    }

    /// Weights in textures take the tiled kernel where the direct
    /// cooperative one would read a buffer, for the device's choice and
    /// for a part asked for by name.
    #[cfg_attr(test, test)]
    fn texture_store_leaves_the_direct_kernel_out() {
        let profile = DeviceProfile::for_tests(false, true, true);
        let mut compile = compile_options(&profile, KernelSet::Tuned);
        compile.weight_store = WeightStore::Texture;
        let v = KernelVariants::select(&profile, KernelSet::Tuned, &compile);
        assert_eq!(v.matmul, MatmulVariant::Tiled);
        assert!(!v.coop_staged && !v.coop_staged_f16 && !v.coop_refined);
        let v = select(&profile, KernelSet::Tuned);
        let store = WeightStore::Texture;
        let part = v.part_variant(MatmulVariant::Coop, store, WeightFormat::F16, 128, 576);
        assert_eq!(part, MatmulVariant::Tiled);
    }

    #[cfg_attr(test, test)]
    fn staged_kernel_off_leaves_block_formats_tiled() {
        let mut v = select(&DeviceProfile::for_tests(false, true, true), KernelSet::Gpu);
        let staged = v.part_variant(
            MatmulVariant::Coop,
            WeightStore::Buffer,
            WeightFormat::Q4_0,
            128,
            576,
        );
        assert_eq!(staged, MatmulVariant::CoopStaged);
        v.coop_staged = false;
        let q = v.part_variant(
            MatmulVariant::Coop,
            WeightStore::Buffer,
            WeightFormat::Q4_0,
            128,
            576,
        );
        let f = v.part_variant(
            MatmulVariant::Coop,
            WeightStore::Buffer,
            WeightFormat::F16,
            128,
            576,
        );
        assert_eq!((q, f), (MatmulVariant::Tiled, MatmulVariant::Coop));
        let compile = compile_options(&DeviceProfile::for_tests(false, true, true), KernelSet::Gpu);
        assert!(
            v.describe(&compile).contains("block formats Tiled"),
            "{}",
            v.describe(&compile)
        );
    }

    #[cfg_attr(test, test)]
    fn coop_falls_back_on_shapes_it_does_not_take() {
        let v = select(&DeviceProfile::for_tests(false, true, true), KernelSet::Gpu).matmul;
        assert_eq!(v, MatmulVariant::Coop);
        // (asked for, format, rows, k, what runs): the staged kernel takes
        // block formats, f16 where the direct one cannot, nothing else.
        use MatmulVariant::{Coop, CoopPadded, CoopStaged, CoopStagedPadded, Tiled};
        let cases = [
            (Coop, WeightFormat::F16, 128, 576, Coop),
            (Coop, WeightFormat::F32, 128, 576, Tiled),
            (Coop, WeightFormat::Q4_0, 128, 576, CoopStaged),
            (Coop, WeightFormat::Q6_K, 36, 512, CoopStaged),
            (Coop, WeightFormat::F16, 36, 576, Tiled),
            (Coop, WeightFormat::F16, 128, 100, Tiled),
            (CoopPadded, WeightFormat::F16, 128, 576, CoopPadded),
            (CoopPadded, WeightFormat::Q4_0, 128, 576, CoopStagedPadded),
            (CoopPadded, WeightFormat::F16, 36, 576, Tiled),
        ];
        for (asked, format, rows, k, runs) in cases {
            assert_eq!(
                asked.for_part(format, rows, k),
                runs,
                "{asked:?} on {format:?} {rows}x{k}"
            );
        }
        for staged in [
            MatmulVariant::CoopStaged,
            MatmulVariant::CoopStagedWide,
            MatmulVariant::CoopStagedPadded,
            MatmulVariant::CoopStagedPrefetch,
        ] {
            assert_eq!(staged.for_part(WeightFormat::Q4_K, 36, 512), staged);
            assert_eq!(staged.for_part(WeightFormat::F16, 36, 544), staged);
            let other = [(WeightFormat::F16, 36, 100), (WeightFormat::F32, 128, 576)];
            for (format, rows, cols) in other {
                assert_eq!(staged.for_part(format, rows, cols), MatmulVariant::Tiled);
            }
        }
        let cpu = MatmulVariant::Blocked4x4;
        assert_eq!(cpu.for_part(WeightFormat::F16, 36, 100), cpu);
    }

    /// The candidates timed per matrix: the fixed rule's choice first, only
    /// variants that take the part, none beyond the rule on the `cpu` set.
    /// Every override constant a mat-mul variant sets is declared by its
    /// shader (a misspelt name would otherwise be set on nothing), and
    /// only the cooperative kernels take the subgroup size.
    #[cfg_attr(test, test)]
    fn matmul_constants_are_overrides_of_their_shaders() {
        for v in MatmulVariant::ALL {
            let k = v.kernel();
            let constants = k.constants(32);
            for (name, _) in &constants {
                let declared = format!("override {name}:");
                assert!(
                    k.shader.body.contains(&declared),
                    "{v:?}: {} declares no {name}",
                    k.shader.file
                );
            }
            let sized = constants.iter().any(|(n, _)| *n == "SUBGROUP_SIZE");
            assert_eq!(sized, v.cooperative(), "{v:?}");
        }
    }

    #[cfg_attr(test, test)]
    fn candidates_start_with_the_rule() {
        let coop = DeviceProfile::for_tests(false, true, true);
        let mut v = select(&coop, KernelSet::Tuned);
        let mv = v.matvec_candidates();
        assert_eq!(mv[0], v.matvec);
        // 21 subgroup mat-vecs, then 12 integer-dot ones (block formats
        // only) and 12 f16-x ones (f16 only).
        assert_eq!(mv.len(), 21 + 12 + 12);
        for (i, c) in mv.iter().enumerate() {
            assert!(!mv[..i].contains(c), "{c:?} twice");
            let (f16, q4) = (
                c.for_format(WeightFormat::F16),
                c.for_format(WeightFormat::Q4_0),
            );
            match i {
                0..21 => assert!(matches!(c, MatvecVariant::SubgroupReduce { .. })),
                21..33 => assert!(c.prepared_x() == Some(XForm::Q8) && f16 == mv[0] && q4 == *c),
                _ => assert!(c.prepared_x() == Some(XForm::F16) && f16 == *c && q4 == mv[0]),
            }
        }
        use MatmulVariant::*;
        let f16 = v.matmul_candidates(WeightStore::Buffer, WeightFormat::F16, 128, 576);
        assert_eq!(
            f16,
            [
                Coop,
                CoopPadded,
                CoopTokensFast,
                CoopX16,
                CoopStaged,
                CoopStagedPadded,
                CoopStagedPrefetch,
                CoopStagedTokensFast,
                CoopStagedWide,
                CoopStagedDouble,
                Tiled,
                TiledWide
            ]
        );
        // Not whole 64 x 64 tiles: the direct kernel does not take it, the
        // staged one does (K a multiple of 32).
        let f16 = v.matmul_candidates(WeightStore::Buffer, WeightFormat::F16, 36, 544);
        assert_eq!(
            f16,
            [
                Tiled,
                CoopStaged,
                CoopStagedPadded,
                CoopStagedPrefetch,
                CoopStagedTokensFast,
                CoopStagedWide,
                CoopStagedDouble,
                TiledWide
            ]
        );
        let f16 = v.matmul_candidates(WeightStore::Buffer, WeightFormat::F16, 36, 100);
        assert_eq!(f16, [Tiled, TiledWide]);
        let f32 = v.matmul_candidates(WeightStore::Buffer, WeightFormat::F32, 128, 576);
        assert_eq!(f32, [Tiled, TiledWide]);
        let staged = [
            CoopStaged,
            CoopStagedPadded,
            CoopStagedPrefetch,
            CoopStagedTokensFast,
        ];
        let q = v.matmul_candidates(WeightStore::Buffer, WeightFormat::Q4_K, 128, 512);
        assert_eq!(
            q,
            [
                &staged[..],
                &[CoopStagedWide, CoopStagedDouble, Tiled, TiledWide]
            ]
            .concat()
        );
        // The wide tiles failing their check drop them alone, and so does
        // each refined one.
        v.refused.insert(CoopStagedWide);
        let q = v.matmul_candidates(WeightStore::Buffer, WeightFormat::Q4_K, 128, 512);
        assert_eq!(
            q,
            [&staged[..], &[CoopStagedDouble, Tiled, TiledWide]].concat()
        );
        v.refused.insert(CoopStagedPrefetch);
        v.refused.insert(CoopStagedDouble);
        let q = v.matmul_candidates(WeightStore::Buffer, WeightFormat::Q4_K, 128, 512);
        let kept = [CoopStaged, CoopStagedPadded, CoopStagedTokensFast];
        assert_eq!(q, [&kept[..], &[Tiled, TiledWide]].concat());
        v.coop_refined = false;
        let q = v.matmul_candidates(WeightStore::Buffer, WeightFormat::Q4_K, 128, 512);
        assert_eq!(q, [CoopStaged, Tiled, TiledWide]);
        // The staged kernel failing its check with block formats leaves it
        // a candidate for f16, and the other way round.
        v.coop_staged = false;
        let f16 = v.matmul_candidates(WeightStore::Buffer, WeightFormat::F16, 128, 576);
        assert_eq!(f16, [Coop, CoopStaged, Tiled, TiledWide]);
        let q = v.matmul_candidates(WeightStore::Buffer, WeightFormat::Q4_K, 128, 512);
        assert_eq!(q, [Tiled, TiledWide]);
        v.coop_staged = true;
        v.coop_staged_f16 = false;
        let f16 = v.matmul_candidates(WeightStore::Buffer, WeightFormat::F16, 128, 576);
        assert_eq!(f16, [Coop, Tiled, TiledWide]);
        let q = v.matmul_candidates(WeightStore::Buffer, WeightFormat::Q4_K, 128, 512);
        assert_eq!(q, [CoopStaged, Tiled, TiledWide]);
        // The fixed-rule set times nothing, and has no f16 staged candidate
        // and no wide staged one.
        let fixed = select(&coop, KernelSet::Gpu);
        assert!(!fixed.tuned() && !fixed.coop_staged_f16 && !fixed.coop_refined);
        let plain = select(
            &DeviceProfile::for_tests(false, true, false),
            KernelSet::Tuned,
        );
        let f16 = plain.matmul_candidates(WeightStore::Buffer, WeightFormat::F16, 128, 576);
        assert_eq!(f16, [Tiled, TiledWide]);
        let cpu = select(&coop, KernelSet::Cpu);
        assert_eq!(cpu.matvec_candidates(), [MatvecVariant::Rows8]);
        assert_eq!(
            cpu.matmul_candidates(WeightStore::Buffer, WeightFormat::F16, 128, 576),
            [Blocked4x4]
        );
        assert!(!cpu.tuned());
    }

    /// The attention candidates: the rule's first; the eight-lanes-per-key
    /// decode only with subgroups of at least 8 lanes; one variant for the
    /// fixed sets.
    #[cfg_attr(test, test)]
    fn attention_candidates_start_with_the_rule() {
        use AttnDecodeVariant::*;
        use AttnPrefillVariant::*;
        let subgroups = DeviceProfile::for_tests(false, true, false);
        let v = select(&subgroups, KernelSet::Tuned);
        assert_eq!(
            v.attn_decode_candidates(),
            [
                Parallel,
                ParallelBatched,
                ParallelShort,
                LanesPerKey,
                SplitKey { chunk: 128 },
                SplitKey { chunk: 512 },
                SplitKey { chunk: 2048 },
                Serial
            ]
        );
        assert_eq!(
            v.attn_prefill_candidates(128, KvFormat::F16),
            [Tiled, RowPerLane]
        );
        // With cooperative matrices, the matrix-unit prefill where the
        // head is whole 16-value blocks.
        let coop = DeviceProfile::for_tests(false, true, true);
        let mut v = select(&coop, KernelSet::Tuned);
        assert_eq!(
            v.attn_prefill_candidates(128, KvFormat::F16),
            [Tiled, Coop, RowPerLane]
        );
        assert_eq!(
            v.attn_prefill_candidates(64, KvFormat::F16),
            [Tiled, Coop, RowPerLane]
        );
        assert_eq!(
            v.attn_prefill_candidates(36, KvFormat::F16),
            [Tiled, RowPerLane]
        );
        assert_eq!(
            v.attn_prefill_candidates(128, KvFormat::F32),
            [Tiled, RowPerLane]
        );
        v.attn_prefill_coop = false;
        assert_eq!(
            v.attn_prefill_candidates(128, KvFormat::F16),
            [Tiled, RowPerLane]
        );
        let fixed = select(&coop, KernelSet::Gpu);
        assert_eq!(fixed.attn_prefill_candidates(128, KvFormat::F16), [Tiled]);
        let small = DeviceProfile {
            subgroup_min: 4,
            ..subgroups.clone()
        };
        let v = select(&small, KernelSet::Tuned);
        assert_eq!(
            v.attn_decode_candidates(),
            [Parallel, ParallelBatched, ParallelShort, Serial]
        );
        // A variant that failed its start-up check is dropped alone.
        let mut v = select(&subgroups, KernelSet::Tuned);
        v.attn_decode_refused.insert(SplitKey { chunk: 512 });
        v.attn_decode_refused.insert(LanesPerKey);
        assert_eq!(
            v.attn_decode_candidates(),
            [
                Parallel,
                ParallelBatched,
                ParallelShort,
                SplitKey { chunk: 128 },
                SplitKey { chunk: 2048 },
                Serial
            ]
        );
        let none = DeviceProfile::for_tests(false, false, false);
        let v = select(&none, KernelSet::Tuned);
        assert_eq!(
            v.attn_decode_candidates(),
            [Parallel, ParallelBatched, ParallelShort, Serial]
        );
        let v = select(&subgroups, KernelSet::Gpu);
        assert_eq!(v.attn_decode_candidates(), [Parallel]);
        assert_eq!(v.attn_prefill_candidates(128, KvFormat::F16), [Tiled]);
        let v = select(&subgroups, KernelSet::Cpu);
        assert_eq!(v.attn_decode_candidates(), [Serial]);
        assert_eq!(v.attn_prefill_candidates(128, KvFormat::F16), [RowPerLane]);
    }

    crate::kernels::checks::register![
        auto_picks_by_device_kind_and_features,
        loop_counters_are_said,
        spirv_path_is_said,
        texture_store_leaves_the_direct_kernel_out,
        staged_kernel_off_leaves_block_formats_tiled,
        coop_falls_back_on_shapes_it_does_not_take,
        matmul_constants_are_overrides_of_their_shaders,
        candidates_start_with_the_rule,
        attention_candidates_start_with_the_rule,
    ];
}
