//! y (+)= W x (+ bias) with f16 or f32 weights: the mat-vec (one token,
//! decode) and mat-mul (several tokens, prefill) variants of
//! `shaders/matmul.wgsl` (`cpu`), `matvec_workgroup.wgsl`,
//! `matvec_subgroup.wgsl`, `matmul_tiled.wgsl`, `matmul_coop.wgsl` and
//! `matmul_coop_staged.wgsl` (`gpu`), all sharing `matmul_io.wgsl`. Which one runs is chosen in src/device.rs.

use anyhow::{bail, Result};
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

use super::prepared_x::{FusedInput, PreparedX, XForm};
use super::runtime::Runtime;
use super::tune::{Candidate, Dispatch, TuneKey};
use super::variants::{
    MatmulKernel, MatmulVariant, MatvecVariant, MATVEC_LANES, MATVEC_Q8_LANES, MATVEC_Q8_ROWS_MAX,
    MATVEC_ROWS_MAX, MATVEC_STEPS,
};
use super::{ceil_div, dispatch, Rows};
use crate::formats::WeightFormat;
use crate::shaders::{self, Shader};
use crate::weights::{GpuMatrix, MatrixPart};

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Params {
    rows: u32,
    k4: u32,
    col0: u32,
    out_stride: u32,
    flags: u32,
    count_sel: u32,
    eps: f32,
    _p: u32,
}

/// How `Params` mirrors `MatmulParams` (checked against naga in tests/shaders.rs).
pub(crate) fn uniform_layout() -> super::UniformLayout {
    super::uniform_layout!(Params as "MatmulParams" in [shaders::MATMUL, shaders::MATVEC_WORKGROUP, shaders::MATVEC_SUBGROUP, shaders::MATVEC_SUBGROUP_X16, shaders::MATVEC_Q8, shaders::MATMUL_TILED, shaders::MATMUL_COOP, shaders::MATMUL_COOP_STAGED] {
        rows, k4, col0, out_stride, flags, count_sel, eps, _p
    })
}

pub(crate) fn x_copy_layout() -> super::UniformLayout {
    super::uniform_layout!(XCopyParams as "XCopyParams" in [shaders::X_TEXTURE, shaders::X_F16] {
        k4, count_sel, _p0, _p1
    })
}

/// How the product is stored.
#[derive(Clone, Copy, Debug)]
pub struct MatmulOptions {
    /// Add into y instead of overwriting (fuses a residual connection).
    pub accumulate: bool,
    pub rows: Rows,
}

/// One row part with its pipelines (a part's format picks its kernels, and
/// with `--kernels tuned` the timings on the device its variants).
struct Part {
    rows: u32,
    matvec: (Arc<wgpu::ComputePipeline>, wgpu::BindGroup),
    matvec_variant: MatvecVariant,
    /// Whether the mat-vec folds in the kernel that writes its input (the
    /// timings may choose not to, part by part).
    matvec_fused: bool,
    matmul: (Arc<wgpu::ComputePipeline>, wgpu::BindGroup),
    matmul_variant: MatmulVariant,
}

/// One weight matrix bound to its input and output buffers.
pub struct Matmul {
    /// The mat-vec variant asked for (the device's, or the test's); each
    /// part's own, which timings may have changed, is in
    /// [`Matmul::matvec_variants`].
    pub matvec_variant: MatvecVariant,
    /// Every part's mat-vec computes its input itself ([`FusedInput`]):
    /// skip the kernel that writes x when n = 1. Where some part does not
    /// (the timings found the unfused way faster there), that kernel runs
    /// and the parts that fold it in still read its input instead.
    pub fuses_input: bool,
    parts: Vec<Part>,
    /// The copy of x into a texture that the `cpu` kernels (matmul.wgsl)
    /// read it from, where a part runs one of them.
    x_copy: Option<XCopy>,
    /// The copy of x into f16 that `CoopX16` reads, where a part runs it.
    x16_copy: Option<XCopy>,
    /// x prepared once per token in each form a part's mat-vec reads it in
    /// (`IntegerDot`, `HalfX`).
    prepared: Vec<PreparedX>,
}

/// x_texture.wgsl or x_f16.wgsl bound to one product's x.
struct XCopy {
    pipeline: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    k4: u32,
}

/// `XCopyParams` of x_texture.wgsl and x_f16.wgsl.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct XCopyParams {
    k4: u32,
    count_sel: u32,
    _p0: u32,
    _p1: u32,
}

impl XCopy {
    /// `shader` (x_texture.wgsl or x_f16.wgsl) copying `x` (of `k4` groups
    /// of four values a token) into `out` for the step's `rows`.
    fn new(
        gpu: &Runtime,
        shader: &'static Shader,
        [step, x]: [&wgpu::Buffer; 2],
        out: wgpu::BindingResource,
        k4: u32,
        rows: Rows,
    ) -> Result<Self> {
        let pipeline = gpu.pipeline(shader, None, "main", &[])?;
        let params = XCopyParams {
            k4,
            count_sel: rows as u32,
            _p0: 0,
            _p1: 0,
        };
        let params = gpu.uniform("x-copy-params", &params);
        let group = gpu.bind_group_of(
            &pipeline,
            &[
                step.as_entire_binding(),
                params.as_entire_binding(),
                x.as_entire_binding(),
                out,
            ],
        );
        Ok(XCopy {
            pipeline,
            group,
            k4,
        })
    }

    fn groups(&self, n: u32) -> (u32, u32, u32) {
        (ceil_div(self.k4, 64), n, 1)
    }

    fn encode(&self, pass: &mut wgpu::ComputePass, n: u32) {
        dispatch(pass, &self.pipeline, &self.group, self.groups(n));
    }
}

/// Whether a variant pair's kernel is matmul.wgsl, which reads x from a
/// texture.
fn reads_x_texture((matvec, matmul): (MatvecVariant, MatmulVariant)) -> bool {
    matvec == MatvecVariant::Rows8 || matmul == MatmulVariant::Blocked4x4
}

/// The mat-vec pipeline of a variant for weights in `format` (the `gpu`
/// ones with their rows per workgroup as the override constant ROWS).
fn matvec_pipeline(
    gpu: &Runtime,
    v: MatvecVariant,
    format: WeightFormat,
) -> Result<Arc<wgpu::ComputePipeline>> {
    let (shader, entry) = v.kernel();
    match v {
        MatvecVariant::Rows8 => gpu.pipeline(shader, Some(format.into()), entry, &[]),
        MatvecVariant::IntegerDot { lanes, rows } => {
            if !(1..=MATVEC_Q8_ROWS_MAX).contains(&rows) || !MATVEC_Q8_LANES.contains(&lanes) {
                bail!("{v:?}: lanes must be one of {MATVEC_Q8_LANES:?}, rows 1 to {MATVEC_Q8_ROWS_MAX}");
            }
            if format.block().is_none() {
                bail!(
                    "{v:?} takes weights in block formats, not {}",
                    format.name()
                );
            }
            let constants = [("LANES", lanes as f64), ("ROWS", rows as f64)];
            gpu.pipeline(shader, Some(format.into()), entry, &constants)
        }
        _ => {
            let (lanes, rows) = v.shape();
            let steps = v.steps();
            if !(1..=MATVEC_ROWS_MAX).contains(&rows)
                || !MATVEC_LANES.contains(&lanes)
                || !MATVEC_STEPS.contains(&steps)
            {
                bail!(
                    "{v:?}: lanes must be one of {MATVEC_LANES:?}, rows 1 to {MATVEC_ROWS_MAX}, steps one of {MATVEC_STEPS:?}"
                );
            }
            let constants = [
                ("LANES", lanes as f64),
                ("ROWS", rows as f64),
                ("STEPS", steps as f64),
            ];
            gpu.pipeline(shader, Some(format.into()), entry, &constants)
        }
    }
}

/// The mat-mul pipeline of a variant for weights in `format`.
fn matmul_pipeline(
    gpu: &Runtime,
    v: MatmulVariant,
    format: WeightFormat,
) -> Result<Arc<wgpu::ComputePipeline>> {
    let kernel = v.kernel();
    let subgroup = gpu.profile.subgroup_max;
    if subgroup < kernel.min_subgroup {
        bail!(
            "{v:?} needs subgroups of at least {} lanes; this device's have {subgroup}",
            kernel.min_subgroup
        );
    }
    let constants = kernel.constants(subgroup);
    gpu.pipeline(
        kernel.shader,
        Some(format.into()),
        MatmulKernel::ENTRY,
        &constants,
    )
}

/// Flag bits of `MatmulParams` (FLAG_* in matmul_io.wgsl; the test
/// `flag_bits_match_the_shaders` compares the two).
const ACCUMULATE: u32 = 1;
const BIAS: u32 = 2;
const FUSED_NORM: u32 = 4;
const FUSED_SWIGLU: u32 = 8;

impl FusedInput<'_> {
    /// The flag bit and the name the timings use.
    fn kind(fused: Option<&Self>) -> (u32, &'static str) {
        match fused {
            None => (0, "x"),
            Some(FusedInput::RmsNorm { .. }) => (FUSED_NORM, "rmsnorm"),
            Some(FusedInput::SwiGlu { .. }) => (FUSED_SWIGLU, "swiglu"),
        }
    }
}

impl Matmul {
    /// `x` is `[n, w.cols]` f32, `y` is `[n, w.rows]` f32, `bias` is `[w.rows]`
    /// f32. The variants are the device's (`Gpu::kernels`).
    pub fn new(
        gpu: &Runtime,
        step: &wgpu::Buffer,
        w: &GpuMatrix,
        bias: Option<&wgpu::Buffer>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        opts: MatmulOptions,
    ) -> Result<Self> {
        Self::normed(gpu, step, w, bias, x, y, opts, None)
    }

    /// As [`Matmul::new`], where `x` is written by the kernel `fused`
    /// describes: the `gpu` mat-vec folds that kernel in (`fuses_input`).
    /// With `--kernels tuned`, each part's variants are timed on the device
    /// (once per shape and device: src/kernels/tune.rs).
    #[allow(clippy::too_many_arguments)]
    pub fn normed(
        gpu: &Runtime,
        step: &wgpu::Buffer,
        w: &GpuMatrix,
        bias: Option<&wgpu::Buffer>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        opts: MatmulOptions,
        fused: Option<FusedInput>,
    ) -> Result<Self> {
        let variants = (gpu.kernels.matvec, gpu.kernels.matmul);
        let tune = gpu.kernels.tuned();
        Self::build(gpu, step, w, bias, x, y, opts, variants, fused, tune)
    }

    /// As [`Matmul::new`] with the given variants (tests run every variant on
    /// any device; the cooperative one needs its features, and falls back
    /// per part as [`KernelVariants::part_variant`](super::variants::KernelVariants::part_variant) says).
    #[allow(clippy::too_many_arguments)]
    pub fn with_variants(
        gpu: &Runtime,
        step: &wgpu::Buffer,
        w: &GpuMatrix,
        bias: Option<&wgpu::Buffer>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        opts: MatmulOptions,
        variants: (MatvecVariant, MatmulVariant),
        fused: Option<FusedInput>,
    ) -> Result<Self> {
        Self::build(gpu, step, w, bias, x, y, opts, variants, fused, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        gpu: &Runtime,
        step: &wgpu::Buffer,
        w: &GpuMatrix,
        bias: Option<&wgpu::Buffer>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        opts: MatmulOptions,
        (matvec_variant, matmul_variant): (MatvecVariant, MatmulVariant),
        fused: Option<FusedInput>,
        tune: bool,
    ) -> Result<Self> {
        let fused = fused.filter(|_| matvec_variant.fuses_input());
        let dummy;
        let bias_buf = match bias {
            Some(b) => b,
            None => {
                dummy = gpu.storage("no-bias", 16);
                &dummy
            }
        };
        let no_norm = gpu.storage("no-norm", 16);
        let flags =
            if opts.accumulate { ACCUMULATE } else { 0 } | if bias.is_some() { BIAS } else { 0 };
        let (fused_flag, input) = FusedInput::kind(fused.as_ref());
        // The most tokens a product runs for: y holds that many rows.
        let max_tokens = (y.size() / (4 * w.rows as u64)) as usize;
        let k4 = (w.cols / 4) as u32;
        let x_copy = if reads_x_texture((matvec_variant, matmul_variant)) {
            let view = gpu.x_texture(k4, max_tokens as u32)?;
            let copy = XCopy::new(
                gpu,
                &shaders::X_TEXTURE,
                [step, x],
                wgpu::BindingResource::TextureView(&view),
                k4,
                opts.rows,
            )?;
            Some((view, copy))
        } else {
            None
        };
        let x_view = x_copy.as_ref().map(|(view, _)| view);
        // Binding 7 of the cooperative kernels: the f16 copy of x
        // where the variant reads it, a dummy otherwise.
        let no_x16 = gpu.storage("no-x16", 16);
        let x16_for = |v: MatmulVariant| -> Result<Option<wgpu::Buffer>> {
            Ok(if v.reads_x16() {
                Some(gpu.x16_buffer(k4, max_tokens as u32)?)
            } else if v.kernel().binds_x16() {
                Some(no_x16.clone())
            } else {
                None
            })
        };
        // One token's x prepared in each form a part's mat-vec may read it
        // in (asked for, or the timed candidates'), where the rows take it.
        let forms: Vec<XForm> = match (
            matvec_variant.prepared_x(),
            tune && gpu.kernels.matvec_prepared,
        ) {
            (_, true) => vec![XForm::Q8, XForm::F16],
            (Some(form), false) => vec![form],
            (None, false) => vec![],
        };
        let prepared_x: Vec<(XForm, wgpu::Buffer)> = forms
            .into_iter()
            .filter(|f| f.takes(w.cols))
            .map(|f| Ok((f, gpu.prepared_x_buffer(f, w.cols)?)))
            .collect::<Result<_>>()?;
        let shared = PartBindings {
            step,
            bias: bias_buf,
            x,
            y,
            prepared_x: &prepared_x,
            no_norm: &no_norm,
            x_view,
            x16_for: &x16_for,
            flags,
            fused: fused.as_ref(),
            fused_flag,
            input,
            max_tokens,
            variants: (matvec_variant, matmul_variant),
            tune,
        };
        let parts: Vec<Part> = w
            .parts
            .iter()
            .map(|part| shared.part(gpu, w, part, &opts))
            .collect::<Result<_>>()?;
        let x16_copy = if parts.iter().any(|p| p.matmul_variant.reads_x16()) {
            let x16 = gpu.x16_buffer(k4, max_tokens as u32)?;
            let out = x16.as_entire_binding();
            Some(XCopy::new(
                gpu,
                &shaders::X_F16,
                [step, x],
                out,
                k4,
                opts.rows,
            )?)
        } else {
            None
        };
        // The input of the parts that read x prepared: from the folded
        // kernel's input where there is one (such parts always fold it in),
        // else from x; once per form.
        let prepared = prepared_x
            .iter()
            .filter(|(f, _)| {
                parts
                    .iter()
                    .any(|p| p.matvec_variant.prepared_x() == Some(*f))
            })
            .map(|(f, out)| {
                PreparedX::new(gpu, *f, step, w.cols, x, fused.as_ref(), out, opts.rows)
            })
            .collect::<Result<_>>()?;
        Ok(Matmul {
            matvec_variant,
            fuses_input: fused.is_some() && parts.iter().all(|p| p.matvec_fused),
            parts,
            x_copy: x_copy.map(|(_, copy)| copy),
            x16_copy,
            prepared,
        })
    }

    /// The mat-mul variant of each row part (they differ where `Coop` falls
    /// back for a part, or where timings chose differently).
    pub fn matmul_variants(&self) -> Vec<MatmulVariant> {
        self.parts.iter().map(|p| p.matmul_variant).collect()
    }

    /// The mat-vec variant of each row part.
    pub fn matvec_variants(&self) -> Vec<MatvecVariant> {
        self.parts.iter().map(|p| p.matvec_variant).collect()
    }

    /// Encodes the product for `n` rows of x (n must match the step's row count).
    pub fn encode(&self, pass: &mut wgpu::ComputePass, n: u32) {
        if let Some(copy) = &self.x_copy {
            // Only where this step runs matmul.wgsl (the mat-vec for one
            // token, the mat-mul for more).
            let needed = self.parts.iter().any(|p| match n {
                1 => p.matvec_variant == MatvecVariant::Rows8,
                _ => p.matmul_variant == MatmulVariant::Blocked4x4,
            });
            if needed {
                copy.encode(pass, n);
            }
        }
        if let Some(copy) = &self.x16_copy {
            if n > 1 {
                copy.encode(pass, n);
            }
        }
        if n == 1 {
            for prepared in &self.prepared {
                prepared.encode(pass, n);
            }
        }
        for part in &self.parts {
            if n == 1 {
                let groups = part.matvec_variant.groups(part.rows);
                dispatch(pass, &part.matvec.0, &part.matvec.1, groups);
            } else {
                let groups = part.matmul_variant.kernel().groups(part.rows, n);
                dispatch(pass, &part.matmul.0, &part.matmul.1, groups);
            }
        }
    }
}

/// What every row part of one product binds alike (`Matmul::build`).
struct PartBindings<'a> {
    step: &'a wgpu::Buffer,
    bias: &'a wgpu::Buffer,
    x: &'a wgpu::Buffer,
    y: &'a wgpu::Buffer,
    /// x prepared in each form a part's mat-vec may read it in.
    prepared_x: &'a [(XForm, wgpu::Buffer)],
    no_norm: &'a wgpu::Buffer,
    /// x as a texture, where `matmul.wgsl` reads it.
    x_view: Option<&'a wgpu::TextureView>,
    /// Binding 7 of the cooperative kernels for a variant.
    x16_for: &'a dyn Fn(MatmulVariant) -> Result<Option<wgpu::Buffer>>,
    /// Accumulate and bias flags.
    flags: u32,
    fused: Option<&'a FusedInput<'a>>,
    fused_flag: u32,
    /// How the timings name the input (`FusedInput::kind`).
    input: &'static str,
    max_tokens: usize,
    /// The variants asked for, and whether to time the candidates instead.
    variants: (MatvecVariant, MatmulVariant),
    tune: bool,
}

impl PartBindings<'_> {
    /// One row part's variants, pipelines and bind groups.
    fn part(
        &self,
        gpu: &Runtime,
        w: &GpuMatrix,
        part: &MatrixPart,
        opts: &MatmulOptions,
    ) -> Result<Part> {
        let PartBindings {
            step,
            x,
            y,
            x_view,
            flags,
            fused_flag,
            input,
            max_tokens,
            tune,
            ..
        } = *self;
        let (matvec_variant, matmul_variant) = self.variants;
        let (bias_buf, no_norm, fused) = (self.bias, self.no_norm, self.fused);
        let x16_for = self.x16_for;
        let params = |flags: u32, eps: f64| Params {
            rows: part.rows as u32,
            k4: (w.cols / 4) as u32,
            col0: part.row0 as u32,
            out_stride: w.rows as u32,
            flags,
            count_sel: opts.rows as u32,
            eps: eps as f32,
            _p: 0,
        };
        let ((matvec_v, matvec_fused), matmul_v) = if tune {
            let shape = TunedPart {
                part,
                cols: w.cols,
                flags,
                prepared: self.prepared_x.iter().map(|(f, _)| *f).collect(),
            };
            (
                shape.matvec(gpu, fused_flag, input),
                shape.matmul(gpu, max_tokens.min(TUNE_TOKENS)),
            )
        } else {
            let m = gpu.kernels.part_variant(
                matmul_variant,
                gpu.compile.weight_store,
                part.format,
                part.rows,
                w.cols,
            );
            ((matvec_variant.for_format(part.format), fused.is_some()), m)
        };
        let matvec = matvec_pipeline(gpu, matvec_v, part.format)?;
        let matmul = matmul_pipeline(gpu, matmul_v, part.format)?;
        let plain = gpu.uniform("matmul-params", &params(flags, 0.0));
        let rest = [bias_buf, x, y, no_norm];
        // A fused mat-vec reads the folded kernel's input (and the
        // norm's weights and epsilon) instead of x.
        let fused_bindings = match fused.filter(|_| matvec_fused) {
            Some(FusedInput::RmsNorm {
                residual,
                weights,
                eps,
            }) => Some((*residual, *weights, *eps)),
            Some(FusedInput::SwiGlu { gate_up }) => Some((*gate_up, no_norm, 0.0)),
            None => None,
        };
        let matvec_group = match fused_bindings {
            // The mat-vecs that read x prepared (which folds in the kernel
            // that writes x: `Matmul::build`).
            _ if matvec_v.prepared_x().is_some() => {
                let form = matvec_v.prepared_x();
                let (_, xp) = self
                    .prepared_x
                    .iter()
                    .find(|(f, _)| Some(*f) == form)
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "{matvec_v:?}: x cannot be prepared for it in rows of {} values",
                            w.cols
                        )
                    })?;
                let rest = [bias_buf, xp, y];
                gpu.bind_group_with_weights(&matvec, [step, &plain], part.binding(gpu), &rest, None)
            }
            Some((input, norm, eps)) => {
                let fused = gpu.uniform("matvec-params", &params(flags | fused_flag, eps));
                let rest = [bias_buf, input, y, norm];
                gpu.bind_group_with_weights(&matvec, [step, &fused], part.binding(gpu), &rest, None)
            }
            None => {
                let xt = x_view.filter(|_| matvec_v == MatvecVariant::Rows8);
                let xt = xt.map(wgpu::BindingResource::TextureView);
                gpu.bind_group_with_weights(&matvec, [step, &plain], part.binding(gpu), &rest, xt)
            }
        };
        let xt = x_view.filter(|_| matmul_v == MatmulVariant::Blocked4x4);
        let x16 = x16_for(matmul_v)?;
        let extra = xt
            .map(wgpu::BindingResource::TextureView)
            .or(x16.as_ref().map(|b| b.as_entire_binding()));
        let matmul_group =
            gpu.bind_group_with_weights(&matmul, [step, &plain], part.binding(gpu), &rest, extra);
        Ok(Part {
            rows: part.rows as u32,
            matvec: (matvec, matvec_group),
            matvec_variant: matvec_v,
            matvec_fused,
            matmul: (matmul, matmul_group),
            matmul_variant: matmul_v,
        })
    }
}

/// Tokens the mat-mul candidates are timed at (fewer where the engine's
/// steps hold fewer): a prompt chunk of this size is where prefill spends
/// its time.
const TUNE_TOKENS: usize = 512;

/// One row part being tuned (`--kernels tuned`): its candidates run on
/// scratch inputs and outputs of its shape, with its own weights.
struct TunedPart<'a> {
    part: &'a crate::weights::MatrixPart,
    cols: usize,
    /// Accumulate and bias flags as the engine's product has them.
    flags: u32,
    /// The forms of prepared x whose mat-vecs are candidates (the product
    /// has a buffer for each).
    prepared: Vec<XForm>,
}

/// Scratch bindings standing in for the engine's while a part's candidates
/// are timed (one set shared by all of them).
struct Scratch {
    buffers: [wgpu::Buffer; 6],
    /// x in f16 (`CoopX16`), as many tokens as x (a dummy for one token).
    x16: wgpu::Buffer,
    tokens: u32,
}

impl Scratch {
    /// The bind group of a mat-vec (`None`) or of mat-mul `v`'s pipeline.
    fn bind(
        &self,
        gpu: &Runtime,
        pipeline: &wgpu::ComputePipeline,
        weights: &MatrixPart,
        v: Option<MatmulVariant>,
    ) -> wgpu::BindGroup {
        let [step, params, bias, x, y, norm] = &self.buffers;
        let rest = [bias, x, y, norm];
        let x16 = v
            .filter(|v| v.kernel().binds_x16())
            .map(|_| self.x16.as_entire_binding());
        gpu.bind_group_with_weights(pipeline, [step, params], weights.binding(gpu), &rest, x16)
    }

    /// These inputs' x prepared in `form` (folding in the input kernel
    /// `fused_flag` says, reading its input from x and the norm's weights
    /// from the norm binding, as the fused candidates' scratch holds them)
    /// and the buffer it writes.
    fn prepare_x(
        &self,
        gpu: &Runtime,
        form: XForm,
        fused_flag: u32,
        cols: usize,
    ) -> Result<(PreparedX, wgpu::Buffer)> {
        let [step, _, _, x, _, norm] = &self.buffers;
        let fused = match fused_flag {
            FUSED_NORM => Some(FusedInput::RmsNorm {
                residual: x,
                weights: norm,
                eps: 1e-5,
            }),
            FUSED_SWIGLU => Some(FusedInput::SwiGlu { gate_up: x }),
            _ => None,
        };
        let out = gpu.storage("tune-x-prepared", form.bytes(cols));
        let kernel = PreparedX::new(gpu, form, step, cols, x, fused.as_ref(), &out, Rows::Tokens)?;
        Ok((kernel, out))
    }

    /// The bind group of a mat-vec reading x prepared into `xp`.
    fn bind_prepared(
        &self,
        gpu: &Runtime,
        pipeline: &wgpu::ComputePipeline,
        weights: &MatrixPart,
        xp: &wgpu::Buffer,
    ) -> wgpu::BindGroup {
        let [step, params, bias, _, y, _] = &self.buffers;
        let rest = [bias, xp, y];
        gpu.bind_group_with_weights(pipeline, [step, params], weights.binding(gpu), &rest, None)
    }

    /// The dispatches of mat-mul `v` on these inputs: the copy of x into
    /// f16 first where `v` reads it, then the product.
    fn matmul_dispatches(
        &self,
        gpu: &Runtime,
        v: MatmulVariant,
        part: &MatrixPart,
        k4: u32,
    ) -> Result<Vec<Dispatch>> {
        let pipeline = matmul_pipeline(gpu, v, part.format)?;
        let group = self.bind(gpu, &pipeline, part, Some(v));
        let product = (
            pipeline,
            group,
            v.kernel().groups(part.rows as u32, self.tokens),
        );
        if !v.reads_x16() {
            return Ok(vec![product]);
        }
        let [step, _, _, x, _, _] = &self.buffers;
        let out = self.x16.as_entire_binding();
        let copy = XCopy::new(gpu, &shaders::X_F16, [step, x], out, k4, Rows::Tokens)?;
        let groups = copy.groups(self.tokens);
        Ok(vec![(copy.pipeline, copy.group, groups), product])
    }

    /// The kernel a fused mat-vec folds in (`fused_flag`), run on the
    /// inputs of `self` (the fused candidates' scratch) and writing the x
    /// of `plain` (the unfused ones'), as the engine runs it for one token.
    fn input_kernel(
        &self,
        gpu: &Runtime,
        plain: &Scratch,
        fused_flag: u32,
        cols: usize,
    ) -> Result<Dispatch> {
        let [step, _, _, input, _, norm] = &self.buffers;
        let x = &plain.buffers[3];
        Ok(if fused_flag == FUSED_NORM {
            let eps = 1e-5;
            super::rmsnorm::RmsNorm::new(gpu, step, cols, eps, norm, input, x, Rows::Tokens)?
                .dispatch_for(1)
        } else {
            super::silu_mul::SiluMul::new(
                gpu,
                step,
                cols,
                crate::family::Activation::Silu,
                input,
                x,
            )?
            .dispatch_for(1)
        })
    }
}

/// The mat-vecs a part in `format` times, each with whether it folds in
/// the input kernel `fused_flag` names (0: none): the device's candidates
/// that take the format (the integer-dot ones only where the product has
/// x prepared in their form, `prepared`), each folded in, then each after
/// that kernel; those that read x prepared always fold it in (the kernel
/// that prepares it does: `Matmul::build`).
fn matvec_choices(
    gpu: &Runtime,
    format: WeightFormat,
    prepared: &[XForm],
    fused_flag: u32,
) -> Vec<(MatvecVariant, bool)> {
    let cands: Vec<MatvecVariant> = gpu
        .kernels
        .matvec_candidates()
        .into_iter()
        .filter(|v| {
            v.for_format(format) == *v && v.prepared_x().is_none_or(|f| prepared.contains(&f))
        })
        .collect();
    let fused_first: &[bool] = if fused_flag != 0 {
        &[true, false]
    } else {
        &[false]
    };
    fused_first
        .iter()
        .flat_map(|&fused| cands.iter().map(move |&v| (v, fused && v.fuses_input())))
        .filter(|&(v, fold)| !(v.prepared_x().is_some() && fused_flag != 0 && !fold))
        .collect()
}

impl TunedPart<'_> {
    /// Scratch bindings for `tokens` tokens with the given flags; x is
    /// twice as wide with a fused SwiGLU (gate then up). x and the norm
    /// weights hold random values, not zeros: matrix units (and some
    /// multipliers) run faster on zeros, which would favour them.
    fn scratch(&self, gpu: &Runtime, tokens: usize, flags: u32) -> Result<Scratch> {
        let (rows, cols) = (self.part.rows as u64, self.cols as u64);
        let x_width = if flags & FUSED_SWIGLU != 0 { 2 } else { 1 };
        let step = gpu.uniform(
            "tune-step",
            &super::Step {
                n_tokens: tokens as u32,
                ..Default::default()
            },
        );
        let params = gpu.uniform(
            "tune-params",
            &Params {
                rows: rows as u32,
                k4: (cols / 4) as u32,
                col0: 0,
                out_stride: rows as u32,
                flags,
                count_sel: Rows::Tokens as u32,
                eps: 1e-5,
                _p: 0,
            },
        );
        let x = gpu.storage("tune-x", tokens as u64 * cols * 4 * x_width);
        let norm = gpu.storage("tune-norm", cols * 4);
        let fill = super::random_fill::RandomFill::new(gpu)?;
        let random = |seed, offset| super::random_fill::Distribution {
            seed,
            scale: 1.0,
            offset,
        };
        fill.fill(gpu, &x, 0, x.size() / 4, WeightFormat::F32, random(1, 0.0))?;
        fill.fill(gpu, &norm, 0, cols, WeightFormat::F32, random(2, 1.0))?;
        let x16 = if tokens > 1 {
            gpu.storage("tune-x16", tokens.next_multiple_of(32) as u64 * cols * 2)
        } else {
            gpu.storage("tune-no-x16", 16)
        };
        Ok(Scratch {
            x16,
            tokens: tokens as u32,
            buffers: [
                step,
                params,
                gpu.storage("tune-bias", rows * 4),
                x,
                gpu.storage("tune-y", tokens as u64 * rows * 4),
                norm,
            ],
        })
    }

    fn key(&self, op: &'static str, input: &'static str, tokens: usize) -> TuneKey {
        TuneKey::Matrix {
            op,
            input,
            format: self.part.format,
            rows: self.part.rows,
            cols: self.cols,
            tokens,
        }
    }

    /// The fastest mat-vec of the device's candidates for this part, and
    /// whether it folds in the kernel that writes its input. With an input
    /// to fold in (`fused_flag`), each variant is timed both ways, the
    /// unfused one after that kernel (the RMSNorm or the SwiGLU, timed
    /// with it): folded in, the norm's sum of squares or every SiLU is
    /// computed again in each workgroup, which can cost more than the
    /// dispatch it saves.
    fn matvec(&self, gpu: &Runtime, fused_flag: u32, input: &'static str) -> (MatvecVariant, bool) {
        let choices = matvec_choices(gpu, self.part.format, &self.prepared, fused_flag);
        if choices.len() == 1 {
            return choices[0];
        }
        let rows = self.part.rows as u32;
        let unfused = |fold: bool| fused_flag != 0 && !fold;
        let labels = choices
            .iter()
            .map(|&(v, fold)| match unfused(fold) {
                true => format!("{} unfused", v.label()),
                false => v.label(),
            })
            .collect();
        let i = gpu
            .tuner
            .choose(gpu, self.key("mat-vec", input, 1), labels, || {
                let plain = self.scratch(gpu, 1, self.flags);
                // The fused candidates' inputs and the kernel the unfused ones
                // run first, where there is an input to fold in.
                let (fused, input_kernel) = if fused_flag == 0 {
                    (Err(anyhow::anyhow!("no input to fold in")), Ok(None))
                } else {
                    let fused = self.scratch(gpu, 1, self.flags | fused_flag);
                    let kernel = match (&fused, &plain) {
                        (Ok(f), Ok(p)) => f.input_kernel(gpu, p, fused_flag, self.cols).map(Some),
                        (Err(e), _) | (_, Err(e)) => Err(anyhow::anyhow!("{e:#}")),
                    };
                    (fused, kernel)
                };
                choices
                    .iter()
                    .map(|&(v, fold)| {
                        let scratch = if fold { &fused } else { &plain };
                        let before = match (&input_kernel, unfused(fold)) {
                            (Ok(Some(d)), true) => Ok(vec![d.clone()]),
                            (Err(e), true) => {
                                Err(anyhow::anyhow!("the unfused input kernel: {e:#}"))
                            }
                            _ => Ok(vec![]),
                        };
                        let fold_flag = if fold { fused_flag } else { 0 };
                        Candidate {
                            dispatches: scratch_or_error(scratch).and_then(|scratch| {
                                let mut run = before?;
                                let p = matvec_pipeline(gpu, v, self.part.format)?;
                                let group = match v.prepared_x() {
                                    Some(form) => {
                                        let (kernel, xp) =
                                            scratch.prepare_x(gpu, form, fold_flag, self.cols)?;
                                        run.push(kernel.dispatch_for(1));
                                        scratch.bind_prepared(gpu, &p, self.part, &xp)
                                    }
                                    None => scratch.bind(gpu, &p, self.part, None),
                                };
                                run.push((p, group, v.groups(rows)));
                                Ok(run)
                            }),
                        }
                    })
                    .collect()
            });
        choices[i]
    }

    /// The fastest mat-mul of the device's candidates for this part at
    /// `tokens` tokens (the rule's when a product never has two).
    fn matmul(&self, gpu: &Runtime, tokens: usize) -> MatmulVariant {
        let (format, rows) = (self.part.format, self.part.rows);
        let store = gpu.compile.weight_store;
        let cands = gpu
            .kernels
            .matmul_candidates(store, format, rows, self.cols);
        if cands.len() == 1 || tokens < 2 {
            return cands[0];
        }
        let labels = cands.iter().map(|v| format!("{v:?}")).collect();
        let i = gpu
            .tuner
            .choose(gpu, self.key("mat-mul", "x", tokens), labels, || {
                let scratch = self.scratch(gpu, tokens, self.flags);
                cands
                    .iter()
                    .map(|&v| Candidate {
                        dispatches: scratch_or_error(&scratch).and_then(|scratch| {
                            scratch.matmul_dispatches(gpu, v, self.part, (self.cols / 4) as u32)
                        }),
                    })
                    .collect()
            });
        cands[i]
    }
}

/// The scratch bindings, or their error as each candidate's own.
fn scratch_or_error(scratch: &Result<Scratch>) -> Result<&Scratch> {
    scratch
        .as_ref()
        .map_err(|e| anyhow::anyhow!("the timings' scratch inputs: {e:#}"))
}

/// The start-up checks of the cooperative GEMMs (`kernels::startup` runs
/// them), which rest on an experimental wgpu feature: before the engine
/// relies on them, one small product each (f16 weights, and Q4_0 for the
/// staged kernel that block formats use) against the CPU reference. The
/// direct kernel failing sends every format to the tiled kernel, the staged
/// one block formats (or, with f16 weights, its f16 candidacy); a timed
/// candidate beside them (`tuned`) that fails is refused alone
/// (`KernelVariants::refused`), its siblings kept. Each failure is a
/// warning.
pub(super) fn start_up_checks(rt: &mut Runtime) {
    use WeightFormat::{F16, Q4_0};
    if rt.kernels.matmul != MatmulVariant::Coop {
        return;
    }
    let then = "weights in block formats use the tiled kernel";
    if !passes_check(rt, MatmulVariant::CoopStaged, Q4_0, then) {
        rt.kernels.coop_staged = false;
    }
    // With timings the staged kernel is also a candidate for f16 weights,
    // checked with them on its own.
    let then = "it is not timed for f16 weights";
    if rt.kernels.coop_staged_f16 && !passes_check(rt, MatmulVariant::CoopStaged, F16, then) {
        rt.kernels.coop_staged_f16 = false;
    }
    if rt.kernels.coop_refined {
        use MatmulVariant::*;
        let staged = [
            (rt.kernels.coop_staged, Q4_0),
            (rt.kernels.coop_staged_f16, F16),
        ];
        let refined_staged = [
            CoopStagedWide,
            CoopStagedPadded,
            CoopStagedPrefetch,
            CoopStagedTokensFast,
            CoopStagedDouble,
        ];
        let checks = staged
            .into_iter()
            .filter(|&(kept, _)| kept)
            .flat_map(|(_, format)| refined_staged.map(|v| (v, format)))
            .chain([CoopPadded, CoopTokensFast, CoopX16].map(|v| (v, F16)));
        for (variant, format) in checks {
            if !rt.kernels.refused.contains(variant)
                && !passes_check(rt, variant, format, "it is not timed")
            {
                rt.kernels.refused.insert(variant);
            }
        }
    }
    let then = "every weight format uses the tiled kernel";
    if !passes_check(rt, MatmulVariant::Coop, F16, then) {
        rt.kernels.matmul = MatmulVariant::Tiled;
        rt.kernels.coop_staged = false;
        rt.kernels.coop_staged_f16 = false;
        rt.kernels.coop_refined = false;
    }
}

/// Whether `variant` passes its start-up check ([`check_variant`]) with
/// `format` weights; a warning saying what failed and `then` (what follows)
/// where not.
fn passes_check(rt: &Runtime, variant: MatmulVariant, format: WeightFormat, then: &str) -> bool {
    let Err(e) = check_variant(rt, variant, format) else {
        return true;
    };
    eprintln!(
        "warning: the cooperative-matrix mat-mul ({variant:?}) failed its check with {} weights on {} ({e:#}); {then}",
        format.name(),
        rt.info.name
    );
    false
}

/// Runs `variant` once on a 128 x 192 weight in `format` (136 rows for a
/// block format, so the staged kernel's second row tile is partial) and 150
/// tokens (past one 128-token tile, so every subgroup of the wide staged
/// kernel has tokens; bias and residual on), and compares with [`reference()`]: an
/// error when the kernel fails to build or run, or its result is off by more
/// than f16 rounding of the input explains. `format` is f16 or Q4_0 (the
/// two the cooperative kernels are checked with).
pub fn check_variant(
    gpu: &Runtime,
    variant: MatmulVariant,
    format: crate::formats::WeightFormat,
) -> Result<()> {
    let block = format.block();
    let rows = if block.is_some() { 136usize } else { 128 };
    let (cols, n) = (192usize, 150usize);
    let wave = |len: usize, f: f32| -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 * f).sin() * 0.5 * 1024.0).round() / 1024.0)
            .collect()
    };
    let mut w = wave(rows * cols, 0.37);
    let x = wave(n * cols, 0.91);
    let b = wave(rows, 1.3);
    let y0 = wave(n * rows, 2.1);
    let m = GpuMatrix::new(gpu, "check-w", rows, cols, format)?;
    match block {
        // The reference multiplies the values the blocks hold.
        Some(block) => {
            let blocks = crate::formats::repack::quantize(format, &w)?;
            crate::formats::dequant::dequantize_blocks(block.ggml, &blocks, &mut w)?;
            m.write_blocks(gpu, 0, &blocks, "check-w")?;
        }
        None => m.write_rows(gpu, 0, &w, "check-w")?,
    }
    let step = gpu.uniform(
        "check-step",
        &super::Step {
            n_tokens: n as u32,
            ..Default::default()
        },
    );
    let (bb, xb, yb) = (
        gpu.storage_from("check-b", &b),
        gpu.storage_from("check-x", &x),
        gpu.storage_from("check-y", &y0),
    );
    let opts = MatmulOptions {
        accumulate: true,
        rows: Rows::Tokens,
    };
    let (ran, e) = gpu.catch_errors(|| -> Result<()> {
        let variants = (MatvecVariant::Rows8, variant);
        let mm = Matmul::with_variants(gpu, &step, &m, Some(&bb), &xb, &yb, opts, variants, None)?;
        if mm.matmul_variants() != [variant] {
            anyhow::bail!("{variant:?} does not take {} weights", format.name());
        }
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            mm.encode(&mut pass, n as u32);
        }
        gpu.queue.submit([enc.finish()]);
        Ok(())
    });
    if let Some(e) = e {
        anyhow::bail!("{e}");
    }
    ran?;
    let got: Vec<f32> = gpu.read(&yb, 0, n * rows)?;
    let mut want = y0;
    reference(&w, rows, cols, Some(&b), &x, &mut want, true);
    let err = super::max_error(&got, &want);
    // x values are multiples of 2^-10 below 0.5: exact in f16, as are the
    // f16 weights; a dequantized weight (an f16 scale times a small integer)
    // may round. A broken kernel is off by far more.
    let tol = if block.is_some() { 1e-2 } else { 1e-3 };
    if err > tol {
        anyhow::bail!("max |error| {err} against the CPU reference");
    }
    Ok(())
}

/// CPU reference: `y[t, r] = (accumulate ? y : 0) + sum_k w[r, k] x[t, k] + bias[r]`.
pub fn reference(
    w: &[f32],
    rows: usize,
    cols: usize,
    bias: Option<&[f32]>,
    x: &[f32],
    y: &mut [f32],
    accumulate: bool,
) {
    let n = x.len() / cols;
    for t in 0..n {
        for r in 0..rows {
            let mut s = 0.0f64;
            for k in 0..cols {
                s += w[r * cols + k] as f64 * x[t * cols + k] as f64;
            }
            let mut v = s as f32 + bias.map_or(0.0, |b| b[r]);
            if accumulate {
                v += y[t * rows + r];
            }
            y[t * rows + r] = v;
        }
    }
}

#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod tests {
    use super::*;
    use crate::device::KernelSet;
    use crate::formats::WeightFormat;
    use crate::gpu::Gpu;
    use crate::gpu::GpuOptions;
    use crate::kernels::rmsnorm::RmsNorm;
    use crate::kernels::testutil::*;
    use crate::kernels::variants::KernelVariants;
    use crate::kernels::Step;
    use crate::shaders::{Shader, WeightStore};

    /// The mat-mul the `gpu` set's rule picks on this device (with its
    /// weights in buffers): `Coop` where it has cooperative matrices.
    fn gpu_set_matmul(gpu: &Gpu) -> MatmulVariant {
        let compile = crate::device::CompileOptions {
            weight_store: WeightStore::Buffer,
            ..gpu.compile
        };
        KernelVariants::select(&gpu.profile, KernelSet::Gpu, &compile).matmul
    }

    /// Every mat-vec variant this device can run: the `gpu` ones with 1, 2
    /// and 16 rows per workgroup of 128 lanes, and of 64 and 256 lanes with
    /// a few row counts (13: odd, past 8), two loads per row in
    /// flight, and four with a few shapes; the subgroup one where the
    /// device has subgroups.
    fn matvecs(gpu: &Runtime) -> Vec<MatvecVariant> {
        let mut out = vec![MatvecVariant::Rows8];
        let shapes = [
            (128, 1, 2),
            (128, 2, 2),
            (128, 16, 2),
            (64, 1, 2),
            (64, 13, 2),
            (256, 2, 2),
            (256, 8, 2),
            (128, 3, 4),
            (256, 4, 4),
        ];
        for (lanes, rows, steps) in shapes {
            out.push(MatvecVariant::WorkgroupReduce { lanes, rows, steps });
            if gpu.profile.subgroups {
                out.push(MatvecVariant::SubgroupReduce { lanes, rows, steps });
            }
        }
        // The mat-vecs reading x prepared: the integer-dot one (block
        // formats) with each lane count, 1, 3 and 8 rows, and the f16-x one
        // (f16 weights) with a few shapes; parts in other formats fall back
        // to the subgroup one.
        if gpu.profile.subgroups {
            for (lanes, rows) in [(32, 1), (64, 3), (128, 8), (32, 8)] {
                out.push(MatvecVariant::IntegerDot { lanes, rows });
            }
            for (lanes, rows, steps) in [(128, 2, 2), (64, 13, 2), (256, 4, 4)] {
                out.push(MatvecVariant::HalfX { lanes, rows, steps });
            }
        }
        out
    }

    /// The product's expected rows for one token where the parts that ran
    /// a mat-vec reading x prepared (`ran`) take theirs from `prepared` (the
    /// reference on x as the device prepared it: [`prepared_references`])
    /// and the others from `want`. Those rows must stay within `drift` of
    /// `want` (x's rounding moves them a little; a kernel that prepared the
    /// wrong input, far more).
    fn expected_rows(
        m: &GpuMatrix,
        ran: &[MatvecVariant],
        want: &[f32],
        prepared: &[(XForm, Vec<f32>)],
        drift: f32,
    ) -> Vec<f32> {
        let mut out = want.to_vec();
        for (part, v) in m.parts.iter().zip(ran) {
            if let Some((form, w)) = prepared.iter().find(|(f, _)| Some(*f) == v.prepared_x()) {
                let rows = part.row0..part.row0 + part.rows;
                let d = max_abs_diff(&w[rows.clone()], &want[rows.clone()]);
                assert!(
                    d <= drift,
                    "{v:?}: x prepared as {form:?} moves the product by {d}"
                );
                out[rows.clone()].copy_from_slice(&w[rows]);
            }
        }
        out
    }

    /// The reference product (as [`reference`] with these arguments) on x
    /// as the device prepared it in each form for the product just run (its
    /// own values read back, so that its rounding of x, which may differ
    /// from the CPU's at a rounding boundary, is not this test's business:
    /// the preparing kernels are tested against CPU references in
    /// `kernels::prepared_x`), for one token.
    fn prepared_references(
        gpu: &Runtime,
        w: &[f32],
        (rows, cols): (usize, usize),
        bias: Option<&[f32]>,
        y0: &[f32],
        accumulate: bool,
    ) -> Vec<(XForm, Vec<f32>)> {
        use crate::kernels::prepared_x::Q8Block;
        [XForm::Q8, XForm::F16]
            .into_iter()
            .filter(|form| form.takes(cols))
            .map(|form| {
                let buffer = gpu.prepared_x_buffer(form, cols).unwrap();
                let words = form.bytes(cols) as usize / 4;
                let words: Vec<u32> = gpu.read(&buffer, 0, words).unwrap();
                let x: Vec<f32> = match form {
                    XForm::Q8 => words
                        .chunks(12)
                        .flat_map(|b| Q8Block::from_words(b).values().collect::<Vec<_>>())
                        .collect(),
                    XForm::F16 => words
                        .iter()
                        .flat_map(|w| [*w as u16, (*w >> 16) as u16])
                        .map(|h| half::f16::from_bits(h).to_f32())
                        .collect(),
                };
                let mut want = y0.to_vec();
                reference(w, rows, cols, bias, &x, &mut want, accumulate);
                (form, want)
            })
            .collect()
    }

    /// The variant pairs this device can run for `n` tokens: every mat-vec
    /// (n = 1) or every mat-mul variant (n > 1: the cooperative ones where
    /// the device has the features and the shape is one they take).
    fn variants(gpu: &Runtime, m: &GpuMatrix, n: usize) -> Vec<(MatvecVariant, MatmulVariant)> {
        if n == 1 {
            return matvecs(gpu)
                .into_iter()
                .map(|v| (v, MatmulVariant::Tiled))
                .collect();
        }
        let mut matmul = vec![
            MatmulVariant::Blocked4x4,
            MatmulVariant::Tiled,
            MatmulVariant::TiledWide,
        ];
        // The cooperative variants where the device has them and every
        // part takes one (Coop and CoopStaged run side by side in a stack).
        let takes = |v: MatmulVariant| {
            m.parts
                .iter()
                .all(|p| v.for_part(p.format, p.rows, m.cols).cooperative())
        };
        let coop_device = gpu_set_matmul(gpu);
        if coop_device == MatmulVariant::Coop {
            for v in [MatmulVariant::Coop, MatmulVariant::CoopStagedWide] {
                if takes(v) {
                    matmul.push(v);
                }
            }
        }
        matmul
            .into_iter()
            .map(|v| (MatvecVariant::Rows8, v))
            .collect()
    }

    /// The flag bits the host sets are the values matmul_io.wgsl tests
    /// (naga's reading of the assembled source of a kernel that includes it).
    #[cfg_attr(test, test)]
    fn flag_bits_match_the_shaders() {
        let src = shaders::source(
            &shaders::MATMUL_TILED,
            Some(WeightFormat::F16.into()),
            WeightStore::Buffer,
        );
        let module = shaders::parse(&src).unwrap();
        let value = |name: &str| -> u32 {
            let (_, c) = module
                .constants
                .iter()
                .find(|(_, c)| c.name.as_deref() == Some(name))
                .unwrap_or_else(|| panic!("{name} is not in matmul_io.wgsl"));
            match module.global_expressions[c.init] {
                naga::Expression::Literal(naga::Literal::U32(v)) => v,
                ref e => panic!("{name} = {e:?}"),
            }
        };
        for (name, host) in [
            ("FLAG_ACCUMULATE", ACCUMULATE),
            ("FLAG_BIAS", BIAS),
            ("FLAG_FUSED_NORM", FUSED_NORM),
            ("FLAG_FUSED_SWIGLU", FUSED_SWIGLU),
        ] {
            assert_eq!(value(name), host, "{name}");
        }
    }

    /// Checks every variant on one shape; returns the mat-mul variants run.
    fn check(
        gpu: &Runtime,
        rows: usize,
        cols: usize,
        n: usize,
        format: WeightFormat,
        bias: bool,
        accumulate: bool,
    ) -> Vec<MatmulVariant> {
        check_stack(gpu, &[(rows, format)], cols, n, bias, accumulate)
    }

    /// As `check`, for a stack of row blocks `(rows, format)`.
    fn check_stack(
        gpu: &Runtime,
        blocks: &[(usize, WeightFormat)],
        cols: usize,
        n: usize,
        bias: bool,
        accumulate: bool,
    ) -> Vec<MatmulVariant> {
        let m = GpuMatrix::stacked(gpu, "w", cols, blocks).unwrap();
        let rows = m.rows;
        let w = fill_test_weights(gpu, &m, 1 + rows as u64);
        // Quantized weights reach about 20: the tolerance scales with them.
        let w_max = w.iter().fold(1f32, |a, v| a.max(v.abs()));
        let b = rand_vec(rows, 7, 1.0);
        let x = rand_vec(n * cols, 3 + n as u64, 1.0);
        let y0 = rand_vec(n * rows, 11, 1.0);
        if let [(_, format)] = blocks {
            assert_eq!(m.parts.len(), m.rows.div_ceil(m.parts[0].rows));
            assert!(m.parts.iter().all(|p| p.format == *format));
        }
        let step = step_buffer(
            gpu,
            Step {
                n_tokens: n as u32,
                ..Default::default()
            },
        );
        let bias_buf = gpu.storage_from("b", &b);
        let xb = gpu.storage_from("x", &x);
        let mut want = y0.clone();
        reference(
            &w,
            rows,
            cols,
            bias.then_some(&b[..]),
            &x,
            &mut want,
            accumulate,
        );
        let mut ran = vec![];
        for pair in variants(gpu, &m, n) {
            let yb = gpu.storage_from("y", &y0);
            let mm = Matmul::with_variants(
                gpu,
                &step,
                &m,
                bias.then_some(&bias_buf),
                &xb,
                &yb,
                MatmulOptions {
                    accumulate,
                    rows: Rows::Tokens,
                },
                pair,
                None,
            )
            .unwrap();
            run_pass(gpu, |pass| mm.encode(pass, n as u32));
            let got: Vec<f32> = gpu.read(&yb, 0, n * rows).unwrap();
            let err = match n {
                1 => {
                    let bias = bias.then_some(&b[..]);
                    let shape = (rows, cols);
                    let prepared = prepared_references(gpu, &w, shape, bias, &y0, accumulate);
                    let ran = mm.matvec_variants();
                    let drift = 0.05 * w_max * (cols as f32).sqrt();
                    max_abs_diff(&got, &expected_rows(&m, &ran, &want, &prepared, drift))
                }
                _ => max_abs_diff(&got, &want),
            };
            // The cooperative GEMMs round x to f16 (relative error 2^-11 per
            // value, values up to 1 here); f16 weights are exact in f16, but
            // dequantized ones (an f16 scale times a small integer) round too.
            let ran_here = mm.matmul_variants();
            let tol = w_max
                * (cols as f32).sqrt()
                * if n == 1 {
                    1e-4
                } else if ran_here.contains(&MatmulVariant::CoopStaged)
                    || ran_here.contains(&MatmulVariant::CoopStagedWide)
                {
                    4e-3
                } else if ran_here.contains(&MatmulVariant::Coop) {
                    2e-3
                } else {
                    1e-4
                };
            let which = if n == 1 {
                format!("{:?}", pair.0)
            } else {
                format!("{ran_here:?}")
            };
            assert!(
                err < tol,
                "{which}: {blocks:?} cols {cols} n {n}: max err {err}"
            );
            ran.extend(ran_here);
        }
        ran
    }

    #[cfg_attr(test, test)]
    fn matches_reference_on_awkward_shapes() {
        for store in WeightStore::ALL {
            matches_reference_on_awkward_shapes_in(&gpu_storing(store, None));
        }
    }

    fn matches_reference_on_awkward_shapes_in(gpu: &Runtime) {
        for &(rows, cols, n) in &[
            (1, 4, 1),
            (7, 12, 1),
            (13, 36, 5),
            (64, 64, 4),
            (130, 96, 7),
            (33, 200, 17),
            // Several tiles of the tiled variant in both directions, a partial
            // last tile, K not a multiple of its 16-value step.
            (197, 132, 70),
            // The same for the wide tiled variant (128 x 128 tiles), bias
            // and residual on.
            (301, 68, 141),
            // Mat-vec: K long enough for the two-loads loop and its tail
            // (k/4 = 257 and 600 with 128 lanes), odd row count.
            (5, 1028, 1),
            (131, 2400, 1),
        ] {
            for format in [WeightFormat::F32, WeightFormat::F16] {
                check(gpu, rows, cols, n, format, n % 2 == 1, rows % 2 == 1);
            }
        }
    }

    /// Every quantized format through every variant: rows not a multiple of
    /// any tile, K of one block and of many, one token and several tiles of
    /// tokens; the reference is llama.cpp's dequantization of the same blocks.
    #[cfg_attr(test, test)]
    fn quantized_formats_match_reference() {
        for (store, format) in WeightStore::ALL
            .into_iter()
            .flat_map(|s| quantized().into_iter().map(move |f| (s, f)))
        {
            let gpu = gpu_storing(store, None);
            let block = format.block().unwrap().values;
            for &(rows, blocks, n) in &[
                (1, 1, 1),
                (7, 2, 1),
                (13, 3, 5),
                (130, 1, 7),
                (67, 9, 70),
                // Two token tiles of the wide tiled variant, a partial row tile.
                (131, 2, 133),
                (5, 10, 1),
                // Mat-vec: more 32-value blocks than the `gpu` variants'
                // 128 lanes (130 blocks of 32, or 17 of 256: 136), so some
                // lanes take two.
                (3, 4160usize.div_ceil(block), 1),
            ] {
                check(
                    &gpu,
                    rows,
                    blocks * block,
                    n,
                    format,
                    n % 2 == 1,
                    rows % 2 == 1,
                );
            }
        }
    }

    /// A stacked matrix whose tensors keep different formats (a Q4_K_M
    /// file's q|k|v: Q4_K, Q4_K, Q6_K), with a float block too: every
    /// variant, one token and several, each part through its own kernels.
    #[cfg_attr(test, test)]
    fn mixed_format_stacks_match_reference() {
        let gpu = gpu();
        let blocks = [
            (13, WeightFormat::Q4_K),
            (5, WeightFormat::Q4_K),
            (7, WeightFormat::Q6_K),
            (9, WeightFormat::F16),
        ];
        for n in [1, 6] {
            check_stack(&gpu, &blocks, 512, n, n == 1, true);
        }
        let m = GpuMatrix::stacked(&gpu, "w", 512, &blocks).unwrap();
        let formats: Vec<_> = m.parts.iter().map(|p| (p.row0, p.rows, p.format)).collect();
        assert_eq!(
            formats,
            [
                (0, 18, WeightFormat::Q4_K),
                (18, 7, WeightFormat::Q6_K),
                (25, 9, WeightFormat::F16)
            ]
        );
        assert_eq!(m.format_at(20), Some(WeightFormat::Q6_K));
        assert!(m.single_format("w").is_err());
        // Blocks of one format cannot run on into rows stored in another.
        let q4 = random_blocks(WeightFormat::Q4_K, 2 * 20, 1);
        let err = m.write_blocks(&gpu, 0, &q4, "w").unwrap_err();
        assert!(err.to_string().contains("stored as q6_k"), "{err}");
    }

    /// Shapes the cooperative GEMM takes (rows and K multiples of 64; tokens
    /// not a multiple of its 32-token tile). On a device without cooperative
    /// matrices (lavapipe) the other variants run and a note says so.
    #[cfg_attr(test, test)]
    fn cooperative_shapes() {
        let gpu = gpu();
        let mut coop = false;
        for &(rows, cols, n) in &[(64, 64, 2), (192, 320, 45), (128, 576, 33)] {
            for accumulate in [false, true] {
                let ran = check(
                    &gpu,
                    rows,
                    cols,
                    n,
                    WeightFormat::F16,
                    !accumulate,
                    accumulate,
                );
                coop |= ran.contains(&MatmulVariant::Coop);
            }
        }
        // The staged kernel with both tile widths (block formats; f16 above
        // too): rows not a multiple of its 128-row tile, tokens not a
        // multiple of its 64 or 128 (and past one 128-token tile), K of one
        // 32-value step and of several, 256-value K-quant blocks.
        let (mut staged, mut wide) = (false, false);
        for &(rows, cols, n, format) in &[
            (200, 320, 45, WeightFormat::Q4_0),
            (16, 32, 3, WeightFormat::Q8_0),
            (136, 512, 130, WeightFormat::Q4_K),
            (64, 256, 2, WeightFormat::Q6_K),
        ] {
            let ran = check(&gpu, rows, cols, n, format, true, n % 2 == 0);
            staged |= ran.contains(&MatmulVariant::CoopStaged);
            wide |= ran.contains(&MatmulVariant::CoopStagedWide);
        }
        if gpu_set_matmul(&gpu) != MatmulVariant::Coop {
            note("this device has no 16x16 f16 cooperative matrices with subgroups; matmul_coop.wgsl and matmul_coop_staged.wgsl are only validated and translated (tests/shaders.rs)");
        } else {
            assert!(coop, "the cooperative variant did not run");
            assert!(staged, "the staged cooperative variant did not run");
            assert!(wide, "the wide staged cooperative variant did not run");
        }
    }

    /// Shapes for the fused inputs: K short, K past the two-loads loop of the
    /// float weights (k/4 = 257 and 600 with 128 lanes), and a block format
    /// whose 130 blocks give some lanes two.
    const FUSED_SHAPES: &[(usize, usize, WeightFormat)] = &[
        (5, 36, WeightFormat::F32),
        (130, 1028, WeightFormat::F32),
        (64, 2400, WeightFormat::F16),
        (7, 4160, WeightFormat::Q4_0),
        // A block for each of 256 lanes (K >= 8,192): the block loop with
        // the widest workgroup, in a K-quant.
        (3, 8448, WeightFormat::Q4_K),
    ];

    /// The `gpu` mat-vecs with the RMSNorm folded in match the norm's CPU
    /// reference followed by the product's; the `cpu` mat-vec declines it.
    #[cfg_attr(test, test)]
    fn fused_norm_matches_reference() {
        let gpu = gpu();
        for &(rows, cols, format) in FUSED_SHAPES {
            let residual = rand_vec(cols, 6, 3.0);
            let g = rand_vec(cols, 8, 1.0);
            let eps = 1e-5;
            let x = crate::kernels::rmsnorm::reference(&residual, &g, eps as f32);
            let (rb, gb) = (gpu.storage_from("r", &residual), gpu.storage_from("g", &g));
            let fused = FusedInput::RmsNorm {
                residual: &rb,
                weights: &gb,
                eps,
            };
            check_fused_input(&gpu, rows, cols, format, &x, fused);
        }
    }

    /// The `gpu` mat-vecs with the SwiGLU folded in match the SwiGLU's CPU
    /// reference followed by the product's.
    #[cfg_attr(test, test)]
    fn fused_swiglu_matches_reference() {
        let gpu = gpu();
        for &(rows, cols, format) in FUSED_SHAPES {
            let gate_up = rand_vec(2 * cols, 11, 4.0);
            let x = crate::kernels::silu_mul::reference(
                &gate_up,
                cols,
                crate::family::Activation::Silu,
            );
            let gub = gpu.storage_from("gate-up", &gate_up);
            let fused = FusedInput::SwiGlu { gate_up: &gub };
            check_fused_input(&gpu, rows, cols, format, &x, fused);
        }
    }

    /// `--kernels tuned`: building a product times the device's candidates
    /// once per shape (the mat-vec's twelve shapes with the fused norm,
    /// the mat-mul's at the tokens y holds), uses the one it chose, and
    /// still matches the reference; a second product of the same shape
    /// reuses the timing.
    #[cfg_attr(test, test)]
    fn tuned_products_time_their_candidates_once_per_shape() {
        let gpu = gpu_with(KernelSet::Tuned);
        if !gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            note("this device has no timestamp queries: nothing to time");
            return;
        }
        let (rows, cols, n) = (40, 96, 5);
        let m = GpuMatrix::new(&gpu, "w", rows, cols, WeightFormat::F16).unwrap();
        let w = fill_test_weights(&gpu, &m, 21);
        let residual = rand_vec(n * cols, 6, 3.0);
        let g = rand_vec(cols, 8, 1.0);
        let eps = 1e-5;
        let (rb, gb) = (gpu.storage_from("r", &residual), gpu.storage_from("g", &g));
        let xb = gpu.storage_from("x", &vec![0f32; n * cols]);
        let build = |y: &wgpu::Buffer, step: &wgpu::Buffer| {
            normed_product(&gpu, step, &m, (&rb, &gb, eps), &xb, y)
        };
        let one = step_buffer(
            &gpu,
            Step {
                n_tokens: 1,
                ..Default::default()
            },
        );
        let yb = gpu.storage_from("y", &vec![0f32; n * rows]);
        let mm = build(&yb, &one);
        let results = gpu.tuner.results();
        let matvec = results
            .iter()
            .find(|t| t.key.op() == "mat-vec")
            .expect("the mat-vec was timed");
        assert!(
            matches!(
                matvec.key,
                TuneKey::Matrix {
                    input: "rmsnorm",
                    ..
                }
            ),
            "{:?}",
            matvec.key
        );
        // Each variant with the norm folded in, then each after the norm
        // but those reading x prepared (f16 weights: the f16-x ones, no
        // integer-dot ones).
        let prepared = [XForm::Q8, XForm::F16];
        let choices = matvec_choices(&gpu, WeightFormat::F16, &prepared, FUSED_NORM);
        assert!(choices
            .iter()
            .all(|(v, _)| v.prepared_x() != Some(XForm::Q8)));
        let unfused = choices.iter().position(|c| !c.1).unwrap();
        // (Those need subgroups.)
        assert_eq!(
            choices[..unfused]
                .iter()
                .any(|(v, _)| v.prepared_x() == Some(XForm::F16)),
            gpu.profile.subgroups
        );
        assert!(choices[unfused..]
            .iter()
            .all(|(v, _)| v.prepared_x().is_none()));
        assert_eq!(matvec.labels.len(), choices.len());
        assert_eq!(matvec.labels[0], "128x2");
        assert_eq!(matvec.labels[unfused], "128x2 unfused");
        assert!(
            matvec.seconds.iter().all(|s| s.is_some_and(|s| s > 0.0)),
            "{matvec:?}"
        );
        let chosen = mm.matvec_variants()[0];
        assert_eq!((chosen, mm.fuses_input), choices[matvec.choice]);
        // The mat-mul (the tiled kernel's two tile sizes at least) once, at
        // the tokens y holds.
        let mm_timed: Vec<_> = results.iter().filter(|t| t.key.op() == "mat-mul").collect();
        assert_eq!(mm_timed.len(), 1);
        assert!(
            matches!(mm_timed[0].key, TuneKey::Matrix { tokens, .. } if tokens == n),
            "{:?}",
            mm_timed[0].key
        );
        let store = gpu.compile.weight_store;
        let mm_cands = gpu
            .kernels
            .matmul_candidates(store, WeightFormat::F16, rows, cols);
        assert_eq!(mm_timed[0].labels.len(), mm_cands.len());
        assert_eq!(mm.matmul_variants()[0], mm_cands[mm_timed[0].choice]);
        let x = crate::kernels::rmsnorm::reference(&residual[..cols], &g, eps as f32);
        let mut want = vec![0f32; rows];
        reference(&w, rows, cols, None, &x, &mut want, false);
        let norm = RmsNorm::new(&gpu, &one, cols, eps, &gb, &rb, &xb, Rows::Tokens).unwrap();
        run_pass(&gpu, |pass| {
            if !mm.fuses_input {
                norm.encode(pass, 1);
            }
            mm.encode(pass, 1)
        });
        let got: Vec<f32> = gpu.read(&yb, 0, rows).unwrap();
        let w_max = w.iter().fold(1f32, |a, v| a.max(v.abs()));
        let err = max_abs_diff(&got, &want);
        assert!(
            err < 1e-4 * w_max * (cols as f32).sqrt(),
            "{chosen:?}: {err}"
        );
        let y2 = gpu.storage_from("y2", &vec![0f32; n * rows]);
        let again = build(&y2, &one);
        assert_eq!(gpu.tuner.results().len(), results.len(), "timed again");
        assert_eq!(again.matvec_variants(), mm.matvec_variants());
        for t in &results {
            assert!(crate::kernels::tune::describe(t).contains(&format!("{rows}x{cols}")));
        }
    }

    /// `m`'s product with the device's variants and the RMSNorm of
    /// `(residual, weights, eps)` as its input, writing y.
    fn normed_product(
        gpu: &Runtime,
        step: &wgpu::Buffer,
        m: &GpuMatrix,
        (residual, weights, eps): (&wgpu::Buffer, &wgpu::Buffer, f64),
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Matmul {
        let fused = FusedInput::RmsNorm {
            residual,
            weights,
            eps,
        };
        let opts = MatmulOptions {
            accumulate: false,
            rows: Rows::Tokens,
        };
        Matmul::normed(gpu, step, m, None, x, y, opts, Some(fused)).unwrap()
    }

    /// A product whose timings chose the unfused mat-vec for one part and
    /// the fused one for the other (forced here): it no longer fuses its
    /// input, so the norm kernel runs, and both parts match the reference,
    /// the fused one reading the norm's input, the other the norm's output.
    #[cfg_attr(test, test)]
    fn tuned_product_mixes_fused_and_unfused_parts() {
        let gpu = gpu_with(KernelSet::Tuned);
        let rule = gpu.kernels.matvec;
        let (cols, eps) = (160, 1e-5);
        let blocks = [(24, WeightFormat::F16), (32, WeightFormat::Q8_0)];
        let m = GpuMatrix::stacked(&gpu, "w", cols, &blocks).unwrap();
        let rows = m.rows;
        let w = fill_test_weights(&gpu, &m, 31);
        // The F16 part unfused (the rule's variant), the Q8_0 part fused.
        for (&(part_rows, format), want) in blocks.iter().zip([(rule, false), (rule, true)]) {
            let choices = matvec_choices(&gpu, format, &[XForm::Q8, XForm::F16], FUSED_NORM);
            let choice = choices.iter().position(|c| *c == want).unwrap();
            let labels: Vec<String> = (0..choices.len()).map(|i| i.to_string()).collect();
            let key = TuneKey::Matrix {
                op: "mat-vec",
                input: "rmsnorm",
                format,
                rows: part_rows,
                cols,
                tokens: 1,
            };
            gpu.tuner.force(key, labels.clone(), choice);
        }
        let residual = rand_vec(cols, 16, 3.0);
        let g = rand_vec(cols, 18, 1.0);
        let (rb, gb) = (gpu.storage_from("r", &residual), gpu.storage_from("g", &g));
        let xb = gpu.storage_from("x", &vec![1e3f32; cols]);
        let yb = gpu.storage_from("y", &vec![0f32; rows]);
        let one = step_buffer(
            &gpu,
            Step {
                n_tokens: 1,
                ..Default::default()
            },
        );
        let mm = normed_product(&gpu, &one, &m, (&rb, &gb, eps), &xb, &yb);
        assert!(!mm.fuses_input, "one part runs unfused");
        assert_eq!(mm.matvec_variants(), [rule, rule]);
        let x = crate::kernels::rmsnorm::reference(&residual, &g, eps as f32);
        let mut want = vec![0f32; rows];
        reference(&w, rows, cols, None, &x, &mut want, false);
        let w_max = w.iter().fold(1f32, |a, v| a.max(v.abs()));
        let tolerance = 1e-4 * w_max * (cols as f32).sqrt();
        // Without the norm kernel, x holds garbage: the fused part is right
        // all the same, the unfused one is not (it reads x).
        run_pass(&gpu, |pass| mm.encode(pass, 1));
        let got: Vec<f32> = gpu.read(&yb, 0, rows).unwrap();
        assert!(max_abs_diff(&got[24..], &want[24..]) < tolerance);
        assert!(max_abs_diff(&got[..24], &want[..24]) > 1.0);
        let norm = RmsNorm::new(&gpu, &one, cols, eps, &gb, &rb, &xb, Rows::Tokens).unwrap();
        run_pass(&gpu, |pass| {
            norm.encode(pass, 1);
            mm.encode(pass, 1)
        });
        let got: Vec<f32> = gpu.read(&yb, 0, rows).unwrap();
        let err = max_abs_diff(&got, &want);
        assert!(err < tolerance, "{err}");
    }

    /// Every mat-vec variant given `fused`, whose result the product should
    /// see as `x`: the `gpu` ones take it and match the reference product of
    /// `x` (bias and residual on), the `cpu` one declines it.
    fn check_fused_input(
        gpu: &Runtime,
        rows: usize,
        cols: usize,
        format: WeightFormat,
        x: &[f32],
        fused: FusedInput,
    ) {
        let m = GpuMatrix::new(gpu, "w", rows, cols, format).unwrap();
        let w = fill_test_weights(gpu, &m, 5);
        let w_max = w.iter().fold(1f32, |a, v| a.max(v.abs()));
        let b = rand_vec(rows, 9, 1.0);
        let y0 = rand_vec(rows, 10, 1.0);
        let mut want = y0.clone();
        reference(&w, rows, cols, Some(&b), x, &mut want, true);
        let step = step_buffer(
            gpu,
            Step {
                n_tokens: 1,
                ..Default::default()
            },
        );
        let bb = gpu.storage_from("b", &b);
        // The input buffer holds garbage: the fused path must not read it.
        let garbage = gpu.storage_from("x", &vec![1e3f32; cols]);
        for v in matvecs(gpu) {
            let yb = gpu.storage_from("y", &y0);
            let opts = MatmulOptions {
                accumulate: true,
                rows: Rows::Tokens,
            };
            let pair = (v, MatmulVariant::Tiled);
            let mm = Matmul::with_variants(
                gpu,
                &step,
                &m,
                Some(&bb),
                &garbage,
                &yb,
                opts,
                pair,
                Some(fused),
            )
            .unwrap();
            assert_eq!(mm.fuses_input, v.fuses_input(), "{v:?}");
            if !mm.fuses_input {
                continue;
            }
            run_pass(gpu, |pass| mm.encode(pass, 1));
            let got: Vec<f32> = gpu.read(&yb, 0, rows).unwrap();
            let tol = 1e-4 * w_max * (cols as f32).sqrt();
            let prepared = prepared_references(gpu, &w, (rows, cols), Some(&b), &y0, true);
            let ran = mm.matvec_variants();
            // x's rounding (q8: a step of up to max |x| / 127 a value)
            // moves the product by about that times |w| sqrt(K) / 4.
            let x_max = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let drift = 0.05 * w_max * x_max * (cols as f32).sqrt();
            let err = max_abs_diff(&got, &expected_rows(&m, &ran, &want, &prepared, drift));
            assert!(err < tol, "{v:?} {format:?} {rows}x{cols}: {err}");
        }
    }

    /// The cooperative kernels with their matrix operations emulated
    /// (`emulate_coop`), so that where the device has no cooperative
    /// matrices (lavapipe) the rest of them runs against the CPU reference:
    /// staging, dequantization, tile and subgroup offsets, row and token
    /// bounds, the epilogue with bias and residual. Shapes with partial row
    /// and token tiles, K of several steps, a K-quant.
    #[cfg_attr(test, test)]
    fn cooperative_kernels_emulated_match_reference() {
        // The direct kernel loads f16 weights from a buffer: the `gpu` set's store.
        let gpu = gpu_with(KernelSet::Gpu);
        if !can_emulate_coop(&gpu, "the emulated cooperative kernels") {
            return;
        }
        use WeightFormat::{F16, Q4_0, Q4_K};
        // (kernel, the entry point's first statement, variant, format, rows, K, tokens)
        // The direct kernel's binding 7 is x in f16 (`CoopX16`): the
        // emulation's memory goes after it.
        let direct = (
            &shaders::MATMUL_COOP,
            "emu_init(wg.x + wg.y * 64u, 0u, lane);",
        );
        let staged = (
            &shaders::MATMUL_COOP_STAGED,
            "emu_init(wg.x + wg.y * 64u, sg, sg_lane);",
        );
        // K of several hundred values (real models' 576 and more), within
        // llvmpipe's budget of loop iterations per invocation (`emulate_coop`;
        // the K-quant at 1,024 passed it with 4-lane subgroups, where each
        // lane stages 96 vec4 a step: 512 here).
        // The wide staged kernel: tokens past one 128-token tile, a partial
        // row tile, and fewer tokens than one tile.
        let prefetch = MatmulVariant::CoopStagedPrefetch;
        let tokens_fast = MatmulVariant::CoopStagedTokensFast;
        // One pipeline per (variant, format) (shapes share it): each costs
        // some 30 s of llvmpipe compilation in a cold shader cache, and CI
        // runs these tests twice, so formats are checked through the plain
        // staged kernel (the others differ in tiles, padding and loop
        // order, not in how a format is read) and the rest take Q4_0.
        let cases = [
            (direct, MatmulVariant::Coop, F16, 128, 192, 40),
            (direct, MatmulVariant::Coop, F16, 64, 640, 3),
            (staged, MatmulVariant::CoopStaged, Q4_0, 200, 576, 70),
            (staged, MatmulVariant::CoopStaged, Q4_K, 136, 512, 3),
            // K of one step, one token.
            (staged, MatmulVariant::CoopStaged, Q4_0, 16, 32, 1),
            // f16 weights through the staged kernel (a candidate of the
            // timings): rows not a multiple of its tile, K not of 64.
            (staged, MatmulVariant::CoopStaged, F16, 72, 96, 9),
            (staged, MatmulVariant::CoopStagedWide, Q4_0, 200, 576, 150),
            (staged, MatmulVariant::CoopStagedWide, Q4_0, 72, 96, 9),
            // The padded kernels: the same shapes as their unpadded ones.
            (direct, MatmulVariant::CoopPadded, F16, 128, 192, 40),
            (direct, MatmulVariant::CoopPadded, F16, 64, 640, 3),
            (staged, MatmulVariant::CoopStagedPadded, Q4_0, 200, 576, 70),
            // Prefetching: K of one step (nothing to prefetch), and many.
            (staged, prefetch, Q4_0, 200, 576, 70),
            (staged, prefetch, Q4_0, 16, 32, 1),
            // Tokens on the grid's fast axis: more row tiles than token
            // tiles (3 x 2), and fewer (2 x 3).
            (direct, MatmulVariant::CoopTokensFast, F16, 192, 192, 40),
            (staged, tokens_fast, Q4_0, 200, 576, 150),
            // x read in f16 from its copy: more row tiles than token tiles,
            // a partial token tile, K of three steps.
            (direct, MatmulVariant::CoopX16, F16, 192, 192, 40),
            // Double-buffered slices, x from its f16 copy: a partial token
            // tile, K of three steps, a partial row tile.
            (staged, MatmulVariant::CoopStagedDouble, Q4_0, 200, 96, 70),
        ];
        for ((shader, init), variant, format, rows, cols, n) in cases {
            let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
            let mut kernel = variant.kernel();
            // The double-buffered kernel's 44 KiB of workgroup memory is
            // past llvmpipe's 32 KiB: here it runs with 64-token tiles and
            // unpadded rows (28 KiB), its buffering and x16 reads as they are
            // (the other variants test the wide and padded shapes).
            if variant == MatmulVariant::CoopStagedDouble
                && gpu.limits.max_compute_workgroup_storage_size < 45056
            {
                kernel.constants = &[
                    ("WIDE", 1.0),
                    ("K_STRIDE", 32.0),
                    ("BUFFERS", 2.0),
                    ("TOKENS_FAST", 1.0),
                    ("X_F16", 1.0),
                ];
                kernel.tile = (128, 64);
            }
            let binds_x16 = kernel.binds_x16();
            let (body, slots) = emulate_coop(shader.body, init, 7 + binds_x16 as u32);
            let emulated = Shader {
                name: leak(format!("{}-emulated", shader.name)),
                body: leak(body),
                ..*shader
            };
            let fmt = (shader.prelude == shaders::Prelude::Weights).then_some(format.into());
            let constants = kernel.constants(gpu.profile.subgroup_max);
            let pipeline = gpu.pipeline(&emulated, fmt, "matmul", &constants).unwrap();
            let m = GpuMatrix::new(&gpu, "w", rows, cols, format).unwrap();
            assert_eq!(variant.for_part(format, rows, cols), variant);
            let w = fill_test_weights(&gpu, &m, 3);
            let w_max = w.iter().fold(1f32, |a, v| a.max(v.abs()));
            let b = rand_vec(rows, 7, 1.0);
            let x = rand_vec(n * cols, 5, 1.0);
            let y0 = rand_vec(n * rows, 11, 1.0);
            let mut want = y0.clone();
            reference(&w, rows, cols, Some(&b), &x, &mut want, true);
            let params = Params {
                rows: rows as u32,
                k4: (cols / 4) as u32,
                col0: 0,
                out_stride: rows as u32,
                flags: 3,
                count_sel: Rows::Tokens as u32,
                eps: 0.0,
                _p: 0,
            };
            let step = step_buffer(
                &gpu,
                Step {
                    n_tokens: n as u32,
                    ..Default::default()
                },
            );
            let groups = kernel.groups(rows as u32, n as u32);
            assert!(groups.0 <= 64);
            // 4 subgroups per workgroup, `slots` matrices of 256 f32 each.
            let scratch = gpu.storage(
                "emulated-matrices",
                (64 * groups.1 as u64) * 4 * slots as u64 * 256 * 4,
            );
            let (pb, bb, xb, yb) = (
                gpu.uniform("p", &params),
                gpu.storage_from("b", &b),
                gpu.storage_from("x", &x),
                gpu.storage_from("y", &y0),
            );
            let no_norm = gpu.storage("no-norm", 16);
            let mut bufs = vec![
                &step,
                &pb,
                m.parts[0].buffer().unwrap(),
                &bb,
                &xb,
                &yb,
                &no_norm,
            ];
            // x in f16, copied for every variant of the direct kernel (the
            // others do not read it).
            let x16 = gpu.x16_buffer((cols / 4) as u32, n as u32).unwrap();
            let copy = XCopy::new(
                &gpu,
                &shaders::X_F16,
                [&step, &xb],
                x16.as_entire_binding(),
                (cols / 4) as u32,
                Rows::Tokens,
            )
            .unwrap();
            if binds_x16 {
                bufs.push(&x16);
            }
            bufs.push(&scratch);
            let group = gpu.bind_group(&pipeline, &bufs);
            run_pass(&gpu, |pass| {
                if binds_x16 {
                    copy.encode(pass, n as u32);
                }
                dispatch(pass, &pipeline, &group, groups)
            });
            let got: Vec<f32> = gpu.read(&yb, 0, n * rows).unwrap();
            let err = max_abs_diff(&got, &want);
            let tol = w_max * 4e-3 * (cols as f32).sqrt();
            assert!(
                err < tol,
                "{variant:?} {format:?} {rows}x{cols}, n {n}: max err {err}"
            );
        }
    }

    /// The start-up check that guards the cooperative GEMM passes for the
    /// kernels that work here and fails (an error, no panic) for one the
    /// device cannot run, which is what makes the engine fall back.
    #[cfg_attr(test, test)]
    fn start_up_check_accepts_working_and_refuses_broken_variants() {
        let gpu = gpu();
        for format in [WeightFormat::F16, WeightFormat::Q4_0] {
            check_variant(&gpu, MatmulVariant::Blocked4x4, format).unwrap();
            check_variant(&gpu, MatmulVariant::Tiled, format).unwrap();
            check_variant(&gpu, MatmulVariant::TiledWide, format).unwrap();
        }
        let has_coop = gpu_set_matmul(&gpu) == MatmulVariant::Coop;
        for (variant, format) in [
            (MatmulVariant::Coop, WeightFormat::F16),
            (MatmulVariant::CoopStaged, WeightFormat::Q4_0),
            (MatmulVariant::CoopStagedWide, WeightFormat::Q4_0),
            (MatmulVariant::CoopPadded, WeightFormat::F16),
            (MatmulVariant::CoopStagedPadded, WeightFormat::Q4_0),
            (MatmulVariant::CoopStagedPrefetch, WeightFormat::Q4_0),
            (MatmulVariant::CoopTokensFast, WeightFormat::F16),
            (MatmulVariant::CoopStagedTokensFast, WeightFormat::Q4_0),
            (MatmulVariant::CoopX16, WeightFormat::F16),
            (MatmulVariant::CoopStagedDouble, WeightFormat::Q4_0),
        ] {
            let coop = check_variant(&gpu, variant, format);
            if has_coop {
                coop.unwrap();
            } else {
                assert!(
                    coop.is_err(),
                    "the cooperative kernel {variant:?} ran without the feature"
                );
            }
        }
    }

    #[cfg_attr(test, test)]
    fn matrices_split_across_bindings() {
        // A 1 KiB binding limit forces 8-row parts for 32 f32 columns.
        let gpu = Runtime::new(
            Gpu::new(&GpuOptions {
                max_binding_override: Some(1024),
                ..Default::default()
            })
            .unwrap(),
        );
        for n in [1, 6] {
            check(&gpu, 45, 32, n, WeightFormat::F32, true, false);
        }
    }

    crate::kernels::checks::register![
        flag_bits_match_the_shaders,
        matches_reference_on_awkward_shapes,
        quantized_formats_match_reference,
        mixed_format_stacks_match_reference,
        cooperative_shapes,
        fused_norm_matches_reference,
        fused_swiglu_matches_reference,
        tuned_products_time_their_candidates_once_per_shape,
        tuned_product_mixes_fused_and_unfused_parts,
        cooperative_kernels_emulated_match_reference,
        start_up_check_accepts_working_and_refuses_broken_variants,
        matrices_split_across_bindings,
    ];
}
