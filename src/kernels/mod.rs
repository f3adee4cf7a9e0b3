//! Kernel launchers. Each module owns one `.wgsl` file under `shaders/`: it
//! builds the pipeline and bind groups once, encodes dispatches into a compute
//! pass, and carries a plain-Rust CPU reference with tests on awkward shapes.

pub mod attention;
pub mod attn_weights;
#[cfg(any(test, feature = "kernel-checks"))]
pub mod checks;
pub mod compact;
pub mod embed;
pub mod epikv_delta;
pub mod head_norm;
pub mod key_scores;
pub mod matmul;
pub mod paging;
pub mod prepared_x;
pub mod query_scores;
pub mod random_fill;
pub mod read_bandwidth;
pub mod rmsnorm;
pub mod rope_kv;
pub mod runtime;
pub mod sample;
pub mod silu_mul;
pub mod startup;
pub mod token_logit;
pub mod tune;
pub mod variants;

use bytemuck::{Pod, Zeroable};

/// Mirror of `Step` in shaders/common.wgsl.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable, PartialEq)]
pub struct Step {
    pub n_tokens: u32,
    pub start_slot: u32,
    pub logit_row0: u32,
    pub n_logits: u32,
    /// First activation row of these tokens, for the kernels that work on
    /// one sequence's rows of a step several sequences share (RoPE and the
    /// cache append, attention, attention weights); 0 for one sequence.
    pub row0: u32,
    pub _p0: u32,
    pub _p1: u32,
    pub _p2: u32,
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
            n_tokens, start_slot, logit_row0, n_logits, row0, _p0, _p1, _p2
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
        head_norm::uniform_layout(),
        key_scores::uniform_layout(),
        query_scores::uniform_layout(),
        matmul::uniform_layout(),
        matmul::x_copy_layout(),
        prepared_x::uniform_layout(),
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
            gpu.bind_group_with_weights(pipeline, [step, &params], part.binding(gpu), rest, None)
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
#[cfg(any(test, feature = "kernel-checks"))]
pub(crate) mod testutil {
    use super::paging::SlotPages;
    use super::runtime::Runtime;
    use super::Step;
    use crate::device::KernelSet;
    use crate::formats::{KvFormat, WeightFormat};
    use crate::gpu::{Gpu, GpuOptions};
    pub use crate::kernels::checks::note;
    use half::f16;
    use std::sync::Arc;

    /// A device for the kernel tests: the timings of `tuned` are not kept
    /// between processes (the tests check that candidates are timed).
    fn open(opts: GpuOptions) -> Arc<Gpu> {
        let mut gpu = Gpu::new(&opts).expect("a GPU adapter (lavapipe on CI)");
        Arc::get_mut(&mut gpu)
            .expect("a device no one else holds")
            .settings
            .tune_cache = None;
        gpu
    }

    pub fn gpu() -> Arc<Runtime> {
        Runtime::new(open(GpuOptions::default()))
    }

    /// A device whose kernels are the given set.
    pub fn gpu_with(set: KernelSet) -> Arc<Runtime> {
        Runtime::new(open(GpuOptions {
            kernels: Some(set),
            ..Default::default()
        }))
    }

    /// A device whose kernels are the given set, changed by `f` (to force
    /// a variant no fixed rule picks).
    pub fn gpu_with_variants(
        set: KernelSet,
        f: impl FnOnce(&mut super::variants::KernelVariants),
    ) -> Arc<Runtime> {
        let mut rt = gpu_with(set);
        f(&mut Arc::get_mut(&mut rt)
            .expect("a device no one else holds")
            .kernels);
        rt
    }

    /// A device with the default kernel set whose weight matrices live in
    /// `store`, its storage bindings capped at `max_binding` bytes if given
    /// (to split small matrices into parts).
    pub fn gpu_storing(
        store: crate::shaders::WeightStore,
        max_binding: Option<u64>,
    ) -> Arc<Runtime> {
        let mut gpu = open(GpuOptions {
            max_binding_override: max_binding,
            ..Default::default()
        });
        Arc::get_mut(&mut gpu)
            .expect("a device no one else holds")
            .compile
            .weight_store = store;
        Runtime::new(gpu)
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

    /// `body` with its cooperative-matrix operations rewritten into plain
    /// WGSL with the same meaning, for devices without them. A matrix is a
    /// slot of 256 f32 in a scratch buffer (at `binding`), one set of slots
    /// per (workgroup, subgroup; four subgroups a workgroup), set by `init`
    /// (WGSL run first in every entry point, calling `emu_init(workgroup, subgroup, lane in the
    /// subgroup)`); each call site of a constructor or load owns a slot. The
    /// lanes of a subgroup share each operation, element by element, and a
    /// storage barrier ends it (the kernels call them in uniform control
    /// flow): loads read column-major (`coopLoad`) or row-major
    /// (`coopLoadT`) memory as naga's SPIR-V output does, `coopMultiplyAdd`
    /// accumulates in f32, and `coopStore` writes column-major (the kernels'
    /// barriers then publish it). Private arrays would do, but llvmpipe
    /// lowers their dynamic indexing into branch ladders and takes many
    /// minutes to compile them. Also returns the slots one subgroup uses.
    pub fn emulate_coop(body: &str, init: &str, binding: u32) -> (String, u32) {
        // Rewrites each `call` (up to its closing parenthesis) with `f`,
        // given the text between the call's parenthesis and its `&NAME[`,
        // NAME, the index and the text after `]`.
        fn rewrite(
            src: &str,
            call: &str,
            mut f: impl FnMut(&str, &str, &str, &str) -> String,
        ) -> String {
            let mut out = String::new();
            let mut rest = src;
            while let Some(at) = rest.find(call) {
                out.push_str(&rest[..at]);
                let tail = &rest[at + call.len()..];
                let amp = tail.find('&').unwrap();
                let before = &tail[..amp];
                let tail = &tail[amp + 1..];
                let open = tail.find('[').unwrap();
                let name = &tail[..open];
                let mut depth = 0;
                let mut close_index = open;
                for (j, c) in tail[open..].char_indices() {
                    match c {
                        '[' | '(' => depth += 1,
                        ']' | ')' => depth -= 1,
                        _ => {}
                    }
                    if depth == 0 {
                        close_index = open + j;
                        break;
                    }
                }
                let index = &tail[open + 1..close_index];
                let tail = &tail[close_index + 1..];
                let close = tail.find(')').unwrap();
                out.push_str(&f(before, name, index, &tail[..close]));
                rest = &tail[close + 1..];
            }
            out.push_str(rest);
            out
        }
        // Without comments, which name the operations too.
        let code: Vec<&str> = body
            .lines()
            .map(|l| l.split("//").next().unwrap())
            .collect();
        let mut src = code
            .join("\n")
            .replace("enable wgpu_cooperative_matrix;", "")
            .replace("coopMultiplyAdd(", "emu_mad(");
        let mut slot = 0u32;
        while let Some(at) = src.find("coop_mat16x16<f32, C>()") {
            src.replace_range(at..at + 23, &format!("emu_zero({slot}u)"));
            slot += 1;
        }
        src = src.replace("coop_mat16x16<f32, C>", "u32");
        let mut names = vec![];
        for (call, row_major) in [
            ("coopLoadT<coop_mat16x16<f16, A>>(", true),
            ("coopLoadT<coop_mat16x16<f16, B>>(", true),
            ("coopLoad<coop_mat16x16<f16, A>>(", false),
            ("coopLoad<coop_mat16x16<f16, B>>(", false),
        ] {
            src = rewrite(&src, call, |_, name, index, rest| {
                if !names.iter().any(|n| n == name) {
                    names.push(name.to_string());
                }
                slot += 1;
                format!("emu_load_{name}({}u, {index}{rest}, {row_major})", slot - 1)
            });
        }
        let mut stores = vec![];
        src = rewrite(&src, "coopStore(", |before, name, index, rest| {
            if !stores.iter().any(|n| n == name) {
                stores.push(name.to_string());
            }
            format!("emu_store_{name}({before}{index}{rest})")
        });
        let left = [
            "coop_mat",
            "coopLoad",
            "coopStore",
            "coopMultiplyAdd",
            "cooperative",
        ];
        assert!(
            !left.iter().any(|w| src.contains(w)),
            "an operation the emulation lacks:\n{src}"
        );
        // Every entry point starts with `init`.
        let mut from = 0;
        while let Some(at) = src[from..].find("@compute") {
            let brace = from + at + src[from + at..].find(") {").unwrap() + 3;
            src.insert_str(brace, &format!("\n    {init}\n"));
            from = brace;
        }
        // The 16 products of one element of a multiply-add, written out, to
        // spend few loop iterations: with one lane doing whole products,
        // results went wrong past about 200 products per invocation, likely
        // llvmpipe's budget of 65,535 loop iterations per invocation (past
        // which its loops end silently; not confirmed).
        let products: Vec<String> = (0..16)
            .map(|k| format!("emu_mem[emu_at(a, i, {k}u)] * emu_mem[emu_at(b, {k}u, j)]"))
            .collect();
        let products = products.join("\n            + ");
        src.push_str(&format!(
            "
@group(0) @binding({binding}) var<storage, read_write> emu_mem: array<f32>;
var<private> emu_base: u32;
var<private> emu_lane: u32;
const EMU_SLOTS: u32 = {slot}u;
fn emu_init(workgroup: u32, subgroup: u32, subgroup_lane: u32) {{
    emu_base = (workgroup * 4u + subgroup) * EMU_SLOTS;
    emu_lane = subgroup_lane;
}}
fn emu_at(m: u32, i: u32, j: u32) -> u32 {{
    return (emu_base + m) * 256u + 16u * i + j;
}}
fn emu_zero(m: u32) -> u32 {{
    for (var e = emu_lane; e < 256u; e += SUBGROUP_SIZE) {{
        emu_mem[(emu_base + m) * 256u + e] = 0.0;
    }}
    storageBarrier();
    return m;
}}
fn emu_mad(a: u32, b: u32, c: u32) -> u32 {{
    for (var e = emu_lane; e < 256u; e += SUBGROUP_SIZE) {{
        let i = e / 16u;
        let j = e % 16u;
        emu_mem[emu_at(c, i, j)] += {products};
    }}
    storageBarrier();
    return c;
}}
"
        ));
        for name in names {
            src.push_str(&format!(
                "
fn emu_load_{name}(m: u32, at: u32, stride: u32, row_major: bool) -> u32 {{
    for (var e = emu_lane; e < 256u; e += SUBGROUP_SIZE) {{
        let i = e / 16u;
        let j = e % 16u;
        let src_at = select(at + j * stride + i, at + i * stride + j, row_major);
        emu_mem[emu_at(m, i, j)] = f32({name}[src_at]);
    }}
    storageBarrier();
    return m;
}}
"
            ));
        }
        for name in stores {
            src.push_str(&format!(
                "
fn emu_store_{name}(c: u32, at: u32, stride: u32) {{
    for (var e = emu_lane; e < 256u; e += SUBGROUP_SIZE) {{
        let i = e / 16u;
        let j = e % 16u;
        {name}[at + j * stride + i] = emu_mem[emu_at(c, i, j)];
    }}
}}
"
            ));
        }
        (src, slot)
    }

    /// Whether `emulate_coop` can run here (f16, subgroups, one subgroup
    /// size); where not, a note says that `what` is not run.
    pub fn can_emulate_coop(gpu: &Gpu, what: &str) -> bool {
        let prof = &gpu.profile;
        let can = prof.shader_f16 && prof.subgroups && prof.subgroup_min == prof.subgroup_max;
        if !can {
            note(format!(
                "this device lacks f16, subgroups or a fixed subgroup size; {what} is not run"
            ));
        }
        can
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
        format: KvFormat,
    ) -> (SlotPages, Vec<f32>) {
        match format {
            KvFormat::F32 => (
                SlotPages::from_rows(gpu, data, row_len, page),
                data.to_vec(),
            ),
            KvFormat::F16 => {
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
        }
    }

    /// Rows `0..n` of a cache stored in `format`, as f32.
    pub fn read_kv(gpu: &Gpu, pages: &SlotPages, n: usize, format: KvFormat) -> Vec<f32> {
        match format {
            KvFormat::F32 => pages.read(gpu, n).unwrap(),
            KvFormat::F16 => pages
                .read::<u16>(gpu, n)
                .unwrap()
                .into_iter()
                .map(|b| half::f16::from_bits(b).to_f32())
                .collect(),
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
                    let blocks = random_blocks(part.format, n / b.values, seed);
                    let mut w = vec![0f32; n];
                    crate::formats::dequant::dequantize_blocks(b.ggml, &blocks, &mut w).unwrap();
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

    /// Every quantized format, for tests.
    pub fn quantized() -> Vec<WeightFormat> {
        WeightFormat::ALL
            .into_iter()
            .filter(|f| f.block().is_some())
            .collect()
    }

    /// Random GGUF blocks of `format`: random quants and scale bytes, with
    /// finite, moderate f16 scales.
    pub fn random_blocks(format: WeightFormat, n_blocks: usize, seed: u64) -> Vec<u8> {
        let b = format.block().unwrap();
        let bytes = b.ggml.block_bytes() as usize;
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = vec![0u8; n_blocks * bytes];
        for block in out.chunks_exact_mut(bytes) {
            for x in block.iter_mut() {
                *x = next() as u8;
            }
            let mut scale = |at: usize| {
                let v = (next() % 1000) as f32 / 1000.0 * 0.02 + 0.001;
                block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            };
            match format {
                WeightFormat::Q4_1 | WeightFormat::Q4_K | WeightFormat::Q5_K => {
                    scale(0);
                    scale(2);
                }
                WeightFormat::Q6_K => scale(208),
                _ => scale(0),
            }
        }
        out
    }

    pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }
}
