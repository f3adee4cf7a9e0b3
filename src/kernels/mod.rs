//! Kernel launchers. Each module owns one `.wgsl` file under `shaders/`: it
//! builds the pipeline and bind groups once, encodes dispatches into a compute
//! pass, and carries a plain-Rust CPU reference with tests on awkward shapes.

pub mod attention;
pub mod attn_weights;
pub mod compact;
pub mod embed;
pub mod epikv_delta;
pub mod matmul;
pub mod paging;
pub mod random_fill;
pub mod read_bandwidth;
pub mod rmsnorm;
pub mod rope_kv;
pub mod sample;
pub mod silu_mul;
pub mod token_logit;
pub mod tune;

use bytemuck::{Pod, Zeroable};

/// Mirror of `Step` in shaders/common.wgsl.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable, PartialEq)]
pub struct Step {
    pub n_tokens: u32,
    pub start_slot: u32,
    pub logit_row0: u32,
    pub n_logits: u32,
}

/// A host-side uniform struct as the GPU reads it: each field's name, byte
/// offset and scalar type, and the WGSL struct (in which kernels) it mirrors.
/// `tests/shaders.rs` compares it with the layout naga reflects from the WGSL,
/// so a field added, removed or reordered on one side only fails a test
/// instead of silently shifting every field after it.
#[derive(Debug)]
pub struct UniformLayout {
    pub host: &'static str,
    pub wgsl_struct: &'static str,
    pub shaders: Vec<&'static crate::shaders::Shader>,
    pub size: usize,
    pub fields: Vec<UniformField>,
}

/// One field of a [`UniformLayout`]; names starting with `_` are padding.
#[derive(Debug)]
pub struct UniformField {
    pub name: &'static str,
    pub offset: usize,
    /// `u32`, `f32`, or `padding` (an array of padding words).
    pub scalar: &'static str,
}

/// The WGSL scalar type a host field maps to.
pub trait HostScalar {
    const WGSL: &'static str;
}
impl HostScalar for u32 {
    const WGSL: &'static str = "u32";
}
impl HostScalar for f32 {
    const WGSL: &'static str = "f32";
}
impl<const N: usize> HostScalar for [u32; N] {
    const WGSL: &'static str = "padding";
}

#[doc(hidden)]
pub fn wgsl_scalar_of<T: HostScalar>(_: &T) -> &'static str {
    T::WGSL
}

/// `uniform_layout!(Params as "NormParams" in [shaders::RMSNORM] { dim4, eps, .. })`
/// lists every field of `Params` (checked at compile time: the destructuring
/// must be exhaustive) with its offset and type.
macro_rules! uniform_layout {
    ($ty:ident as $wgsl:literal in [$($shader:expr),+ $(,)?] { $($field:ident),+ $(,)? }) => {{
        #[allow(dead_code)]
        fn every_field_is_listed(p: $ty) {
            let $ty { $($field: _),+ } = p;
        }
        let zero = <$ty as bytemuck::Zeroable>::zeroed();
        $crate::kernels::UniformLayout {
            host: concat!(module_path!(), "::", stringify!($ty)),
            wgsl_struct: $wgsl,
            shaders: vec![$(&$shader),+],
            size: std::mem::size_of::<$ty>(),
            fields: vec![$($crate::kernels::UniformField {
                name: stringify!($field),
                offset: std::mem::offset_of!($ty, $field),
                scalar: $crate::kernels::wgsl_scalar_of(&zero.$field),
            }),+],
        }
    }};
}
pub(crate) use uniform_layout;

/// Every host-side uniform struct with the WGSL struct it mirrors.
pub fn uniform_layouts() -> Vec<UniformLayout> {
    use crate::shaders as s;
    vec![
        uniform_layout!(Step as "Step" in [s::RMSNORM, s::MATMUL, s::ATTENTION, s::ROPE_KV] {
            n_tokens, start_slot, logit_row0, n_logits
        }),
        uniform_layout!(TablePartParams as "EmbedParams" in [s::EMBED] {
            hidden4, row_begin, row_end, _p
        }),
        uniform_layout!(TablePartParams as "TokenParams" in [s::TOKEN_LOGIT] {
            hidden4, row_begin, row_end, _p
        }),
        paging::uniform_layout(),
        attention::uniform_layout(),
        attn_weights::uniform_layout(),
        compact::uniform_layout(),
        epikv_delta::uniform_layout(),
        matmul::uniform_layout(),
        random_fill::uniform_layout(),
        rmsnorm::uniform_layout(),
        rope_kv::uniform_layout(),
        sample::uniform_layout(),
        silu_mul::uniform_layout(),
    ]
}

/// Which row count a kernel uses (`count_sel` in the shaders).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// All tokens of the step.
    Tokens = 0,
    /// Only the rows whose logits are computed.
    Logits = 1,
}

/// Parameters of one row part of a table read by token id (`EmbedParams` in
/// embed.wgsl, `TokenParams` in token_logit.wgsl): the kernel skips ids
/// outside `row_begin..row_end`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct TablePartParams {
    hidden4: u32,
    row_begin: u32,
    row_end: u32,
    _p: u32,
}

/// One bind group per row part of `table`: bindings are `[step, part params,
/// part buffer, rest...]`.
pub(crate) fn table_part_groups(
    gpu: &crate::gpu::Gpu,
    pipeline: &wgpu::ComputePipeline,
    step: &wgpu::Buffer,
    table: &crate::weights::GpuMatrix,
    rest: &[&wgpu::Buffer],
) -> Vec<wgpu::BindGroup> {
    table
        .parts
        .iter()
        .map(|part| {
            let params = gpu.uniform(
                "table-part-params",
                &TablePartParams {
                    hidden4: (table.cols / 4) as u32,
                    row_begin: part.row0 as u32,
                    row_end: (part.row0 + part.rows) as u32,
                    _p: 0,
                },
            );
            let mut bufs = vec![step, &params, &part.buffer];
            bufs.extend_from_slice(rest);
            gpu.bind_group(pipeline, &bufs)
        })
        .collect()
}

pub(crate) fn ceil_div(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

pub(crate) fn dispatch(
    pass: &mut wgpu::ComputePass,
    pipeline: &wgpu::ComputePipeline,
    group: &wgpu::BindGroup,
    groups: (u32, u32, u32),
) {
    if groups.0 == 0 || groups.1 == 0 || groups.2 == 0 {
        return;
    }
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, group, &[]);
    pass.dispatch_workgroups(groups.0, groups.1, groups.2);
}

/// The largest |got - want| (infinite where either is NaN): how far a
/// kernel's start-up check lands from its CPU reference.
pub(crate) fn max_error(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(
            0.0,
            |a, d| if d.is_nan() { f32::INFINITY } else { a.max(d) },
        )
}

/// Test helpers shared by the kernel tests: a device, a step buffer, one-pass runs.
#[cfg(test)]
pub(crate) mod testutil {
    use super::paging::SlotPages;
    use super::Step;
    use crate::gpu::{Gpu, GpuOptions};
    use crate::shaders::WeightFormat;
    use std::sync::Arc;

    pub fn gpu() -> Arc<Gpu> {
        Gpu::new(&GpuOptions::default()).expect("a GPU adapter (lavapipe on CI)")
    }

    /// A device whose kernels are the given set.
    pub fn gpu_with(set: crate::device::KernelSet) -> Arc<Gpu> {
        Gpu::new(&GpuOptions {
            kernels: Some(set),
            ..Default::default()
        })
        .expect("a GPU adapter (lavapipe on CI)")
    }

    /// A device whose kernels are the given set, changed by `f` (to force
    /// a variant no fixed rule picks).
    pub fn gpu_with_variants(
        set: crate::device::KernelSet,
        f: impl FnOnce(&mut crate::device::KernelVariants),
    ) -> Arc<Gpu> {
        let mut gpu = gpu_with(set);
        f(&mut Arc::get_mut(&mut gpu)
            .expect("a device no one else holds")
            .kernels);
        gpu
    }

    pub fn step_buffer(gpu: &Gpu, step: Step) -> wgpu::Buffer {
        gpu.uniform("step", &step)
    }

    /// Runs `f` inside one compute pass and waits for it.
    pub fn run_pass(gpu: &Gpu, f: impl FnOnce(&mut wgpu::ComputePass)) {
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            f(&mut pass);
        }
        gpu.queue.submit([enc.finish()]);
    }

    /// Deterministic pseudo-random values in [-scale, scale).
    pub fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Per-slot rows of `data` (`row_len` values each) in pages of `page`
    /// slots, stored in `format`; also returns the values as stored (rounded
    /// to f16 for an f16 cache), which is what a CPU reference must use.
    pub fn kv_pages(
        gpu: &Gpu,
        data: &[f32],
        row_len: usize,
        page: usize,
        format: WeightFormat,
    ) -> (SlotPages, Vec<f32>) {
        match format {
            WeightFormat::F32 => (
                SlotPages::from_rows(gpu, data, row_len, page),
                data.to_vec(),
            ),
            WeightFormat::F16 => {
                let bits: Vec<u16> = data
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect();
                let stored = bits
                    .iter()
                    .map(|&b| half::f16::from_bits(b).to_f32())
                    .collect();
                (SlotPages::from_rows(gpu, &bits, row_len, page), stored)
            }
            q => panic!("a KV cache is f16 or f32, not {}", q.name()),
        }
    }

    /// Rows `0..n` of a cache stored in `format`, as f32.
    pub fn read_kv(gpu: &Gpu, pages: &SlotPages, n: usize, format: WeightFormat) -> Vec<f32> {
        match format {
            WeightFormat::F32 => pages.read(gpu, n).unwrap(),
            WeightFormat::F16 => pages
                .read::<u16>(gpu, n)
                .unwrap()
                .into_iter()
                .map(|b| half::f16::from_bits(b).to_f32())
                .collect(),
            q => panic!("a KV cache is f16 or f32, not {}", q.name()),
        }
    }

    /// Fills `m` with test weights, part by part in each part's format, and
    /// returns the values the kernels should see: random values rounded
    /// through f16 or f32, or random llama.cpp blocks of a quantized format,
    /// dequantized.
    pub fn fill_test_weights(gpu: &Gpu, m: &crate::weights::GpuMatrix, seed: u64) -> Vec<f32> {
        let mut all = Vec::with_capacity(m.rows * m.cols);
        for (i, part) in m.parts.iter().enumerate() {
            let (n, seed) = (part.rows * m.cols, seed + i as u64);
            let w = match part.format.block() {
                Some(b) => {
                    let blocks =
                        crate::quant::tests::random_blocks(part.format, n / b.values, seed);
                    let mut w = vec![0f32; n];
                    crate::gguf::dequantize_blocks(b.ggml, &blocks, &mut w).unwrap();
                    m.write_blocks(gpu, part.row0, &blocks, "w").unwrap();
                    w
                }
                None => {
                    // Rounded through the storage format so the reference
                    // sees the same values.
                    let w: Vec<f32> = rand_vec(n, seed, 0.5)
                        .into_iter()
                        .map(|v| match part.format {
                            WeightFormat::F16 => half::f16::from_f32(v).to_f32(),
                            _ => v,
                        })
                        .collect();
                    m.write_rows(gpu, part.row0, &w, "w").unwrap();
                    w
                }
            };
            all.extend(w);
        }
        all
    }

    pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }
}
